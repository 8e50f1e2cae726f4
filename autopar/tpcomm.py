"""Tensor-parallel runtime: the redistributions of the ``tp`` axis and how parameters are stored.

The collectives pass puts these functions into the graph where a producer's ``tp``
placement differs from what its consumer's strategy needs. All are autograd functions,
and they keep one convention: the gradient of a replicated tensor is whole and the same on
every rank, the gradient of a shard is that shard of the whole gradient, and the gradient
of a ``P(sum)`` tensor is the whole gradient (each addend's).

    tp_all_reduce(x)         P(sum) -> R      backward: identity                 (Megatron's g)
    tp_copy(x)               R -> R, read by per-rank compute
                                              backward: all-reduce the addends    (Megatron's f)
    tp_gather(x, d, size, partial_grad)
                             S(d) -> R        backward: reduce-scatter when per-rank compute
                                              reads the result (its gradient is then a sum of
                                              addends), else this rank's slice
    tp_reduce_scatter(x, d, size)
                             P(sum) -> S(d)   backward: all-gather
    tp_split(x, d, size)     R -> S(d)        backward: all-gather (no forward communication)

Shards follow the project's convention (``ceil(size/t)`` per rank, the last ranks hold
fewer): collectives pad to equal chunks and cut the padding off.

``TPParam`` says how one parameter is stored along ``tp``: whole, or split along a dim;
a fused projection whose output is split into ``groups`` equal parts (``q, k, v``) is
stored interleaved, each rank holding its slice of every part, so that the split of the
local product gives each part's local shard.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .comm import AxisComm, all_reduce, copy_to_axis
from .placement import Replicate, Shard

__all__ = ["TPParam", "tp_all_reduce", "tp_copy", "tp_gather", "tp_reduce_scatter", "tp_split",
           "chunk_range"]


def chunk_range(size: int, n: int, index: int) -> tuple[int, int]:
    c = -(-size // n)
    lo = min(index * c, size)
    return lo, min(lo + c, size)


def _gather(x: torch.Tensor, comm: AxisComm, dim: int, size: int, label: str) -> torch.Tensor:
    n = comm.size
    c = -(-size // n)
    x = x.movedim(dim, 0)
    if x.shape[0] < c:
        x = torch.cat([x, x.new_zeros((c - x.shape[0],) + tuple(x.shape[1:]))])
    x = x.contiguous()
    out = x.new_empty((n * c,) + tuple(x.shape[1:]))
    comm.all_gather_flat(out.view(-1), x.view(-1), label=label)
    return out[:size].movedim(0, dim).contiguous()   # views downstream need it dense


def _scatter(x: torch.Tensor, comm: AxisComm, dim: int, size: int, label: str) -> torch.Tensor:
    n = comm.size
    c = -(-size // n)
    x = x.movedim(dim, 0)
    if x.shape[0] < n * c:
        x = torch.cat([x, x.new_zeros((n * c - x.shape[0],) + tuple(x.shape[1:]))])
    x = x.contiguous()
    out = x.new_empty((c,) + tuple(x.shape[1:]))
    comm.reduce_scatter_flat(out.view(-1), x.view(-1), label=label)
    lo, hi = chunk_range(size, n, comm.index)
    return out[:hi - lo].movedim(0, dim).contiguous()


def _local(x: torch.Tensor, comm: AxisComm, dim: int, size: int) -> torch.Tensor:
    lo, hi = chunk_range(size, comm.size, comm.index)
    return x.narrow(dim, lo, hi - lo)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim, size, partial_grad):
        ctx.comm, ctx.dim, ctx.size, ctx.partial = comm, dim, size, partial_grad
        return _gather(x, comm, dim, size, f"S({dim}) -> R")

    @staticmethod
    def backward(ctx, g):
        if ctx.partial:
            return _scatter(g, ctx.comm, ctx.dim, ctx.size, f"grad of S({ctx.dim}) -> R"), None, None, None, None
        return _local(g, ctx.comm, ctx.dim, ctx.size).contiguous(), None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim, size):
        ctx.comm, ctx.dim, ctx.size = comm, dim, size
        return _scatter(x, comm, dim, size, f"P(sum) -> S({dim})")

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.comm, ctx.dim, ctx.size, f"grad of P(sum) -> S({ctx.dim})"), None, None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim, size):
        ctx.comm, ctx.dim, ctx.size = comm, dim, size
        return _local(x, comm, dim, size).contiguous()

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.comm, ctx.dim, ctx.size, f"grad of R -> S({ctx.dim})"), None, None, None


def tp_all_reduce(x: torch.Tensor, comm: AxisComm) -> torch.Tensor:
    """P(sum) -> R; backward is the identity (``comm.all_reduce``)."""
    return all_reduce(x, comm)


def tp_copy(x: torch.Tensor, comm: AxisComm) -> torch.Tensor:
    """A replicated tensor read by per-rank compute; backward sums the ranks' gradient addends
    (``comm.copy_to_axis``)."""
    return copy_to_axis(x, comm)


def tp_gather(x: torch.Tensor, comm: AxisComm, dim: int, size: int, partial_grad: bool) -> torch.Tensor:
    """S(dim) -> R (``size``: the whole dim)."""
    return _Gather.apply(x, comm, dim, size, partial_grad)


def tp_reduce_scatter(x: torch.Tensor, comm: AxisComm, dim: int, size: int) -> torch.Tensor:
    """P(sum) -> S(dim); backward all-gathers."""
    return _ReduceScatter.apply(x, comm, dim, size)


def tp_split(x: torch.Tensor, comm: AxisComm, dim: int, size: int) -> torch.Tensor:
    """R -> S(dim) by taking this rank's slice; backward all-gathers the gradient."""
    return _Split.apply(x, comm, dim, size)


@dataclass(frozen=True)
class TPParam:
    """How one parameter is stored along ``tp``."""
    placement: object = Replicate()
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
        part = shape[d] // self.groups
        lo, hi = chunk_range(part, n, index)
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

    def gather(self, local: torch.Tensor, comm: AxisComm, shape: tuple) -> torch.Tensor:
        """The whole parameter, all-gathered along ``tp`` (every rank of the axis must call)."""
        if not self.sharded or comm.size == 1:
            return local
        n, d = comm.size, self.placement.dim
        pieces = []
        for r in range(n):
            pieces.append(self.local_shape(shape, n, r))
        c = max(p[d] for p in pieces)
        x = local.movedim(d, 0)
        if x.shape[0] < c:
            x = torch.cat([x, x.new_zeros((c - x.shape[0],) + tuple(x.shape[1:]))])
        x = x.contiguous()
        out = x.new_empty((n * c,) + tuple(x.shape[1:]))
        comm.all_gather_flat(out.view(-1), x.view(-1), label="full parameter", phase="state")
        blocks = [out[r * c: r * c + pieces[r][d]].movedim(0, d) for r in range(n)]
        return self.full_from(blocks)
