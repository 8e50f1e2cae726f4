"""Brute-force check of the sharding rules: simulate n ranks, run the op, compare.

For every sample call ``(op, args, kwargs)`` with small concrete tensors, and every strategy
its rule lists for an axis of ``n`` ranks, each rank gets its piece of every input:
  Shard(d)   this rank's ceil-chunk along d (``autopar.sizes``' convention);
  Replicate  the whole tensor;
  P(sum)     random addends summing to the tensor;   P(avg)  addends averaging to it;
  P(max)     the tensor on one rank, values <= it elsewhere (P(min): >=).
Each rank runs the op on its pieces with ``localize``'d arguments; the pieces of the output
are put together as the output placement says (Shard: concatenated, after checking each
rank's piece has the conventional size; Replicate: all ranks must agree; Partial: reduced)
and compared with the op on the whole inputs (fp32, atol 1e-5).

``python -m autopar.passes.rules.validate`` prints the report and exits 1 if any strategy
is wrong, any sample op has no rule, or any rule has no sample.
"""
from __future__ import annotations

import operator
import sys
from dataclasses import dataclass, field

import torch

from autopar.placement import Replicate, Shard
from autopar.sizes import chunk_range

from .registry import (RULES, OpInfo, Strategy, TensorMeta, format_placement, local_shape,
                       localize, strategies_for, tensor_inputs)
from . import samples as _samples

__all__ = ["Failure", "Report", "validate", "check_strategy", "main"]

ATOL = RTOL = 1e-5


@dataclass(frozen=True)
class Failure:
    """One strategy that does not reproduce the op."""
    op: str
    strategy: str
    n: int
    shapes: str
    detail: str

    def __str__(self) -> str:
        return f"{self.op} [{self.shapes}] n={self.n}: {self.strategy}: {self.detail}"


@dataclass
class Report:
    checked: int = 0
    wrong: list = field(default_factory=list)
    missing: list = field(default_factory=list)
    """ops of the samples with no rule"""
    untested: list = field(default_factory=list)
    """ops with a rule but no sample"""

    @property
    def ok(self) -> bool:
        return not (self.wrong or self.missing or self.untested)

    def __str__(self) -> str:
        lines = [f"wrong strategy: {f}" for f in self.wrong]
        lines += [f"missing rule: {op}" for op in self.missing]
        lines += [f"rule without a sample: {op}" for op in self.untested]
        lines.append(f"{self.checked} strategies checked, {len(self.wrong)} wrong, "
                     f"{len(self.missing)} ops without a rule, "
                     f"{len(self.untested)} rules without a sample")
        return "\n".join(lines)


def _pieces(full, placement, n: int, g: torch.Generator) -> list:
    """Each rank's local value of ``full`` under ``placement`` (tuples entry by entry)."""
    if isinstance(full, tuple):
        per = [_pieces(f, p, n, g) for f, p in zip(full, placement)]
        return [tuple(e[i] for e in per) for i in range(n)]
    if placement is None or isinstance(placement, Replicate):
        return [full.clone() for _ in range(n)]
    if isinstance(placement, Shard):
        d, size = placement.dim, full.shape[placement.dim]
        return [full.narrow(d, lo, hi - lo).clone() for lo, hi in (chunk_range(size, n, i) for i in range(n))]
    if not full.is_floating_point():
        raise TypeError(f"{placement} on a {full.dtype} tensor")
    noise = [torch.randn(full.shape, generator=g, dtype=full.dtype) for _ in range(n)]
    if placement.op == "sum":
        return noise[:-1] + [full - sum(noise[:-1])]
    if placement.op == "avg":
        mean = sum(noise) / n
        return [full + e - mean for e in noise]
    sign = -1 if placement.op == "max" else 1
    return [full if i == n - 1 else full + sign * e.abs() for i, e in enumerate(noise)]


def _assemble(pieces: list, placement, n: int, full_shape) -> torch.Tensor:
    """The global output from the ranks' outputs under ``placement``."""
    if isinstance(placement, tuple):
        return tuple(_assemble([p[j] for p in pieces], pl, n, full_shape[j])
                     for j, pl in enumerate(placement))
    if isinstance(placement, Replicate):
        for i, p in enumerate(pieces[1:], 1):
            if not _close(p, pieces[0]):
                raise AssertionError(f"R output differs between rank 0 and rank {i}")
        return pieces[0]
    if isinstance(placement, Shard):
        for i, p in enumerate(pieces):
            want = local_shape(full_shape, placement, n, i)
            if tuple(p.shape) != want:
                raise AssertionError(f"rank {i} holds shape {tuple(p.shape)}, "
                                     f"the ceil convention wants {want}")
        # empty pieces hold no data (and some kernels give them another dtype, e.g.
        # native_dropout's mask): leave them out of the concatenation
        kept = [p for p in pieces if p.numel()] or pieces[:1]
        return torch.cat(kept, placement.dim)
    stacked = torch.stack(pieces)
    return {"sum": lambda: stacked.sum(0), "avg": lambda: stacked.mean(0),
            "max": lambda: stacked.amax(0), "min": lambda: stacked.amin(0)}[placement.op]()


def _close(a, b) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        return torch.allclose(a, b, rtol=RTOL, atol=ATOL, equal_nan=True)
    return torch.equal(a, b)


def _error(a, b) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"got {a.dtype}{list(a.shape)}, expected {b.dtype}{list(b.shape)}"
    if a.is_floating_point():
        return f"max error {(a - b).abs().nan_to_num(float('inf')).max().item():.3g}"
    return f"{(a != b).sum().item()} of {a.numel()} elements differ"


def _substitute(v, it):
    """Put the next local tensors where the TensorMeta placeholders are."""
    if isinstance(v, TensorMeta) or _is_value_tuple(v):
        return next(it)
    if isinstance(v, list):
        return [_substitute(x, it) for x in v]
    return v


def _is_value_tuple(v) -> bool:
    return isinstance(v, tuple) and any(isinstance(x, TensorMeta) for x in v)


def _tensors(info: OpInfo, args, kwargs) -> list:
    """The call's tensor inputs in strategy order, found where ``info`` has TensorMeta."""
    found = []

    def walk(m, v):
        if isinstance(m, TensorMeta) or _is_value_tuple(m):
            found.append(tuple(v) if _is_value_tuple(m) else v)
        elif isinstance(m, list):
            for mx, x in zip(m, v):
                walk(mx, x)
    for m, v in zip(info.args, args):
        walk(m, v)
    for k, m in info.kwargs.items():
        walk(m, kwargs[k])
    return found


def check_strategy(op, args, kwargs, info: OpInfo, s: Strategy, n: int, seed: int = 0):
    """None if ``s`` reproduces the op on ``n`` simulated ranks, else what went wrong."""
    full_in = _tensors(info, args, kwargs)
    if len(s.inputs) != len(full_in):
        return f"{len(s.inputs)} input placements for {len(full_in)} tensor inputs"
    g = torch.Generator().manual_seed(seed)
    try:
        per_input = [_pieces(t, p, n, g) for t, p in zip(full_in, s.inputs)]
        outs = []
        for i in range(n):
            largs, lkw = localize(info, s, n, i)
            it = iter([pieces[i] for pieces in per_input])
            outs.append(op(*[_substitute(a, it) for a in largs],
                           **{k: _substitute(v, it) for k, v in lkw.items()}))
        expected = op(*args, **kwargs)
        if expected is None:           # a check with no output: it only has to run
            return None
        if isinstance(expected, (list, tuple)):
            expected, outs = tuple(expected), [tuple(o) for o in outs]
            if not isinstance(s.output, tuple) or len(s.output) != len(expected):
                return (f"output placement {format_placement(s.output)} "
                        f"for {len(expected)} outputs")
            got = _assemble(outs, s.output, n, tuple(tuple(e.shape) for e in expected))
        else:
            got = _assemble(outs, s.output, n, tuple(expected.shape))
            got, expected = (got,), (expected,)
        for j, (a, b) in enumerate(zip(got, expected)):
            if not _close(a, b):
                return f"output {j}: {_error(a, b)}"
    except Exception as e:  # a strategy that makes the op fail is a wrong strategy
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def _shapes(info: OpInfo) -> str:
    return ", ".join("(" + ", ".join(map(str, t)) + ")" if isinstance(t, tuple) else str(t)
                     for t in tensor_inputs(info))


def _name(op) -> str:
    return "operator.getitem" if op is operator.getitem else str(op)


def validate(samples=None, ns=(2, 3), seed: int = 0) -> Report:
    """Check every strategy of every sample op for each axis size in ``ns``. Over the
    default samples, a registered op without a sample is reported too."""
    default = samples is None
    samples = _samples.default_samples() if default else samples
    report, seen = Report(), set()
    for k, (op, args, kwargs) in enumerate(samples):
        seen.add(op)
        if op not in RULES:
            if _name(op) not in report.missing:
                report.missing.append(_name(op))
            continue
        for n in ns:
            info = OpInfo.from_call(op, args, kwargs, n=n)
            for j, s in enumerate(strategies_for(info)):
                report.checked += 1
                err = check_strategy(op, args, kwargs, info, s, n, seed=seed + 1000 * k + j)
                if err is not None:
                    report.wrong.append(Failure(_name(op), str(s), n, _shapes(info), err))
    if default:
        report.untested = sorted(_name(op) for op in RULES if op not in seen)
    return report


def main() -> int:
    report = validate()
    print(report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
