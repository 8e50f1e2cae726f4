"""Placements and layouts: how one tensor is laid out across the device mesh.

A placement says what one mesh axis does to a tensor, in DTensor's vocabulary:
``Shard(dim)`` splits tensor dim ``dim`` across the axis, ``Replicate()`` keeps a full
copy on every rank of the axis, ``Partial("sum")`` holds per-rank addends whose sum is the
value. A ``Layout`` is one placement per mesh axis. Both print compactly (``S(0)``, ``R``,
``P(sum)``, ``dp:S(0) tp:R``) and ``parse_placement``/``parse_layout`` are the exact inverses.

How a parameter is stored, which the passes decide and the runtime follows:
``ShardSpec`` its split along dim 0 over ``dp`` (ZeRO), ``TPParam`` its split along ``tp``.
Both split in ceil chunks (``autopar.sizes``).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Mapping, Union

import torch

from .sizes import chunk, chunk_range, padded_numel

__all__ = ["Shard", "Replicate", "Partial", "Placement", "Layout", "ShardSpec", "TPParam",
           "parse_placement", "parse_layout", "to_dtensor_placement", "from_dtensor_placement"]

_REDUCE_OPS = ("sum", "avg", "max", "min")


@dataclass(frozen=True)
class Shard:
    """Tensor dim ``dim`` is split across the mesh axis (in ceil(size/n) chunks: the last ranks
    hold fewer)."""
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


# ---- how a parameter is stored ---------------------------------------------------------------

@dataclass(frozen=True)
class ShardSpec:
    """A tensor split along dim 0 into N chunks of ``ceil(d0/N)`` rows; the last ranks may hold
    fewer rows (or none). Collectives move padded chunks of ``chunk_numel`` elements."""
    shape: tuple[int, ...]
    n: int
    index: int

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:]) if self.shape else 1

    @property
    def chunk_rows(self) -> int:
        return chunk(self.rows, self.n)

    @property
    def chunk_numel(self) -> int:
        return self.chunk_rows * self.row_numel

    @property
    def padded_numel(self) -> int:
        """Elements of the N equal chunks together (the tensor and its padding)."""
        return padded_numel(self.shape, self.n)

    def row_range(self, index: int | None = None) -> tuple[int, int]:
        return chunk_range(self.rows, self.n, self.index if index is None else index)

    @property
    def local_shape(self) -> tuple[int, ...]:
        lo, hi = self.row_range()
        return (hi - lo,) + tuple(self.shape[1:])

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def local_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``full`` (a view)."""
        lo, hi = self.row_range()
        return full.reshape(self.rows, *self.shape[1:])[lo:hi]

    def padded_chunks(self, full: torch.Tensor) -> torch.Tensor:
        """``full`` as an (N, chunk_numel) tensor, zero-padded at the end."""
        flat = full.reshape(-1)
        pad = self.padded_numel - flat.numel()
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        return flat.view(self.n, self.chunk_numel)

    def padded_local(self, local: torch.Tensor) -> torch.Tensor:
        flat = local.reshape(-1)
        pad = self.chunk_numel - flat.numel()
        return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat

    def unpad(self, gathered: torch.Tensor) -> torch.Tensor:
        """The full tensor from an (N * chunk_numel) gathered buffer (a view, no copy)."""
        return gathered.reshape(-1)[: self.numel].view(self.shape)


@dataclass(frozen=True)
class TPParam:
    """How one parameter is stored along ``tp``: whole, or split along a dim; a fused
    projection whose output is split into ``groups`` equal parts (``q, k, v``) is stored
    interleaved, each rank holding its slice of every part, so that the split of the local
    product gives each part's local shard."""
    placement: Placement = Replicate()
    groups: int = 1          # > 1: a fused projection stored interleaved (each part split alike)
    reason: str = ""

    @property
    def sharded(self) -> bool:
        return isinstance(self.placement, Shard)

    def __str__(self) -> str:
        g = f" interleaved x{self.groups}" if self.groups > 1 else ""
        return f"{self.placement}{g}"

    def local_shape(self, shape: tuple, n: int, index: int) -> tuple:
        if not self.sharded:
            return tuple(shape)
        d = self.placement.dim
        lo, hi = chunk_range(shape[d] // self.groups, n, index)
        out = list(shape)
        out[d] = (hi - lo) * self.groups
        return tuple(out)

    def local_of(self, full: torch.Tensor, n: int, index: int) -> torch.Tensor:
        """This rank's piece of the whole parameter (a copy when interleaved)."""
        if not self.sharded:
            return full
        d = self.placement.dim
        parts = full.chunk(self.groups, dim=d) if self.groups > 1 else (full,)
        pieces = []
        for p in parts:
            lo, hi = chunk_range(p.shape[d], n, index)
            pieces.append(p.narrow(d, lo, hi - lo))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=d)

    def full_from(self, locals_: list) -> torch.Tensor:
        """The whole parameter from every rank's piece (in rank order)."""
        if not self.sharded:
            return locals_[0]
        d = self.placement.dim
        if self.groups == 1:
            return torch.cat(locals_, dim=d)
        split = [x.chunk(self.groups, dim=d) if x.shape[d] else (x,) * self.groups for x in locals_]
        return torch.cat([torch.cat([s[g] for s in split], dim=d) for g in range(self.groups)], dim=d)
