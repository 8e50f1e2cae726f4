"""Placements and layouts: how one tensor is laid out across the device mesh.

A placement says what one mesh axis does to a tensor, in DTensor's vocabulary:
``Shard(dim)`` splits tensor dim ``dim`` across the axis, ``Replicate()`` keeps a full
copy on every rank of the axis, ``Partial("sum")`` holds per-rank addends whose sum is the
value. A ``Layout`` is one placement per mesh axis. Both print compactly (``S(0)``, ``R``,
``P(sum)``, ``dp:S(0) tp:R``) and ``parse_placement``/``parse_layout`` are the exact inverses.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Union

__all__ = ["Shard", "Replicate", "Partial", "Placement", "Layout",
           "parse_placement", "parse_layout", "to_dtensor_placement", "from_dtensor_placement"]

_REDUCE_OPS = ("sum", "avg", "max", "min")


@dataclass(frozen=True)
class Shard:
    """Tensor dim ``dim`` is split across the mesh axis (uneven sizes: first ranks get one more)."""
    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Replicate:
    """Every rank of the mesh axis holds the whole tensor."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    """Every rank holds an addend; the value is their reduction (``sum`` or ``avg``, ...)."""
    op: str = "sum"

    def __post_init__(self):
        if self.op not in _REDUCE_OPS:
            raise ValueError(f"Partial reduce op must be one of {_REDUCE_OPS}, got {self.op!r}")

    def __str__(self) -> str:
        return f"P({self.op})"


Placement = Union[Shard, Replicate, Partial]

_PLACEMENT_RE = re.compile(r"^(?:S\((-?\d+)\)|R|P\((\w+)\))$")


def parse_placement(text: str) -> Placement:
    """Inverse of ``str(placement)``: ``"S(1)"`` -> ``Shard(1)``, ``"R"``, ``"P(sum)"``."""
    m = _PLACEMENT_RE.match(text.strip())
    if not m:
        raise ValueError(f"cannot parse placement {text!r}: expected S(<dim>), R or P(<op>)")
    if m.group(1) is not None:
        return Shard(int(m.group(1)))
    if m.group(2) is not None:
        return Partial(m.group(2))
    return Replicate()


@dataclass(frozen=True)
class Layout:
    """One placement per mesh axis, in mesh order: ``Layout((("dp", Shard(0)), ("tp", Replicate())))``."""
    placements: tuple[tuple[str, Placement], ...]

    @classmethod
    def of(cls, **axes: Placement) -> "Layout":
        return cls(tuple(axes.items()))

    @classmethod
    def replicated(cls, axis_names) -> "Layout":
        return cls(tuple((a, Replicate()) for a in axis_names))

    def __getitem__(self, axis: str) -> Placement:
        for name, p in self.placements:
            if name == axis:
                return p
        raise KeyError(f"layout {self} has no mesh axis {axis!r}")

    def as_dict(self) -> Mapping[str, Placement]:
        return dict(self.placements)

    def replace(self, axis: str, placement: Placement) -> "Layout":
        return Layout(tuple((a, placement if a == axis else p) for a, p in self.placements))

    def __str__(self) -> str:
        return " ".join(f"{a}:{p}" for a, p in self.placements) or "-"


def parse_layout(text: str) -> Layout:
    """Inverse of ``str(layout)``: ``"dp:S(0) tp:R"``."""
    text = text.strip()
    if text == "-":
        return Layout(())
    items = []
    for part in text.split():
        axis, sep, pl = part.partition(":")
        if not sep:
            raise ValueError(f"cannot parse layout entry {part!r} in {text!r}: expected axis:placement")
        items.append((axis, parse_placement(pl)))
    return Layout(tuple(items))


def to_dtensor_placement(p: Placement):
    """The one converter to DTensor's placement classes."""
    from torch.distributed.tensor import placement_types as pt
    if isinstance(p, Shard):
        return pt.Shard(p.dim)
    if isinstance(p, Replicate):
        return pt.Replicate()
    return pt.Partial(p.op)


def from_dtensor_placement(p) -> Placement:
    from torch.distributed.tensor import placement_types as pt
    if isinstance(p, pt.Shard):
        return Shard(p.dim)
    if isinstance(p, pt.Replicate):
        return Replicate()
    if isinstance(p, pt.Partial):
        return Partial(p.reduce_op)
    raise TypeError(f"unknown DTensor placement {p!r}")
