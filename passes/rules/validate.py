"""Brute-force check of the sharding rules: simulate n ranks, run the op, compare.

For every sample call ``(op, args, kwargs)`` with small concrete tensors, and every strategy
its rule lists for an axis of ``n`` ranks, ``check.check_strategy`` gives each of ``n``
simulated ranks its piece of every input (a ceil-chunk, the whole tensor, or random addends
of a Partial), runs the op on the pieces and compares the assembled output with the op on
the whole inputs.

``python -m autopar.passes.rules.validate`` prints the report and exits 1 if any strategy
is wrong, any sample op has no rule, or any rule has no sample.
"""
from __future__ import annotations

import operator
import sys
from dataclasses import dataclass, field

from .check import check_strategy
from .registry import RULES, OpInfo, strategies_for, tensor_inputs
from . import samples as _samples

__all__ = ["Failure", "Report", "validate", "check_strategy", "main"]


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
    unloaded: list = field(default_factory=list)
    """another library's ops with a rule (by name) that are not loaded: nothing to run"""

    @property
    def ok(self) -> bool:
        return not (self.wrong or self.missing or self.untested)

    def __str__(self) -> str:
        lines = [f"wrong strategy: {f}" for f in self.wrong]
        lines += [f"missing rule: {op}" for op in self.missing]
        lines += [f"rule without a sample: {op}" for op in self.untested]
        lines += [f"not checked, op not loaded (library not installed): {op}" for op in self.unloaded]
        lines.append(f"{self.checked} strategies checked, {len(self.wrong)} wrong, "
                     f"{len(self.missing)} ops without a rule, "
                     f"{len(self.untested)} rules without a sample")
        return "\n".join(lines)


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
        names = {str(op) for op in seen}
        for op in RULES:
            if op in seen or op in names:
                continue
            if isinstance(op, str) and _samples.resolve(op) is None:
                report.unloaded.append(op)
            else:
                report.untested.append(_name(op))
        report.untested.sort()
    return report


def main() -> int:
    report = validate()
    print(report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
