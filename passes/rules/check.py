"""Run one strategy of an op on simulated ranks and compare with the op on the whole inputs.

Each of ``n`` ranks gets its piece of every input:
  Shard(d)   this rank's ceil-chunk along d (``autopar.sizes``' convention);
  Replicate  the whole tensor;
  P(sum)     random addends summing to the tensor;   P(avg)  addends averaging to it;
  P(max)     the tensor on one rank, values <= it elsewhere (P(min): >=).
Each rank runs the op on its pieces with ``localize``'d arguments; the pieces of the output
are put together as the output placement says (Shard: concatenated, after checking each
rank's piece has the conventional size; Replicate: all ranks must agree; Partial: reduced)
and compared with the op on the whole inputs (fp32, atol 1e-5). An op whose values are
random or unspecified (``registry.RANDOM``: ``rand``, ``empty``) is compared by shape and
dtype only; a Python number (``sym_size``) by equality.

The validator (``validate``) runs it over every rule; the strategy search (``search``) over
the candidate strategies of an op without one.
"""
from __future__ import annotations

import torch

from autopar.placement import Replicate, Shard
from autopar.sizes import chunk_range

from .registry import RANDOM, OpInfo, Strategy, TensorMeta, format_placement, local_shape, localize

__all__ = ["check_strategy", "ATOL", "RTOL"]

ATOL = RTOL = 1e-5


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
    return [full.clone() if i == n - 1 else full + sign * e.abs() for i, e in enumerate(noise)]


def _assemble(pieces: list, placement, n: int, full_shape, values: bool = True):
    """The global output from the ranks' outputs under ``placement`` (``values=False``:
    random values, so replicated pieces need not agree)."""
    if isinstance(placement, tuple):
        return tuple(_assemble([p[j] for p in pieces], pl, n, full_shape[j], values)
                     for j, pl in enumerate(placement))
    if isinstance(placement, Replicate):
        for i, p in enumerate(pieces[1:], 1):
            if values and not _close(p, pieces[0]):
                raise AssertionError(f"R output differs between rank 0 and rank {i}")
        return pieces[0]
    if isinstance(placement, Shard):
        for i, p in enumerate(pieces):
            want = local_shape(full_shape, placement, n, i)
            if tuple(p.shape) != want:
                raise AssertionError(f"rank {i} holds shape {tuple(p.shape)}, "
                                     f"the ceil convention wants {want}")
        # empty pieces hold no data (and some kernels give them another dtype, e.g.
        # native_dropout's mask): leave them out of the concatenation, unless all are (an
        # empty output, tensor_split's last part: its shape is still the pieces' together)
        kept = [p for p in pieces if p.numel()] or pieces
        return torch.cat(kept, placement.dim)
    stacked = torch.stack(pieces)
    return {"sum": lambda: stacked.sum(0), "avg": lambda: stacked.mean(0),
            "max": lambda: stacked.amax(0), "min": lambda: stacked.amin(0)}[placement.op]()


def _close(a, b, values: bool = True) -> bool:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return type(a) is type(b) and a == b
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not values:
        return True
    if a.is_floating_point() or a.is_complex():
        return torch.allclose(a, b, rtol=RTOL, atol=ATOL, equal_nan=True)
    return torch.equal(a, b)


def _error(a, b) -> str:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return f"got {a!r}, expected {b!r}"
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"got {a.dtype}{list(a.shape)}, expected {b.dtype}{list(b.shape)}"
    if a.is_floating_point() or a.is_complex():
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
        values = op not in RANDOM
        if isinstance(expected, (list, tuple)):
            expected, outs = tuple(expected), [tuple(o) for o in outs]
            if not isinstance(s.output, tuple) or len(s.output) != len(expected):
                return (f"output placement {format_placement(s.output)} "
                        f"for {len(expected)} outputs")
            got = _assemble(outs, s.output, n, tuple(_shape(e) for e in expected), values)
        else:
            got = _assemble(outs, s.output, n, _shape(expected), values)
            got, expected = (got,), (expected,)
        for j, (a, b) in enumerate(zip(got, expected)):
            if not _close(a, b, values):
                return f"output {j}: {_error(a, b)}"
    except Exception as e:  # a strategy that makes the op fail is a wrong strategy
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def _shape(v):
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()
