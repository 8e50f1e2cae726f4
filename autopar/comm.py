"""Collectives: autograd-aware functions keyed by mesh axis, each counting the bytes it moves.

Every collective is issued through an ``AxisComm``: the process group of one mesh axis plus
the byte counter of the module that owns it. Bytes are those a ring algorithm moves per rank,
the quantity the ZeRO and Megatron formulas speak of:

    all_gather      (N-1)/N * S        S = bytes of the gathered (padded) result
    reduce_scatter  (N-1)/N * S        S = bytes of the (padded) input
    all_reduce      2 (N-1)/N * S      S = bytes of the tensor

(gloo may run another algorithm underneath; the count is the algorithmic volume.)

The autograd functions pair each collective with its conjugate, so a forward graph made of
them is differentiable and backward communication comes from autograd:

    AllGather       forward: all_gather along dim    / backward: reduce_scatter(sum) along dim
    ReduceScatter   forward: reduce_scatter along dim / backward: all_gather along dim
    AllReduce       forward: all_reduce(sum)          / backward: identity   (Megatron's g)
    CopyToAxis      forward: identity                 / backward: all_reduce(sum) (Megatron's f)
"""
from __future__ import annotations

import math
import time
from collections import defaultdict, deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["AxisComm", "CommStats", "CommInfo", "ShardSpec", "ring_bytes",
           "all_gather", "reduce_scatter", "all_reduce", "copy_to_axis"]


def ring_bytes(kind: str, nbytes: float, n: int) -> float:
    """Per-rank bytes a ring ``kind`` collective over ``n`` ranks moves for a ``nbytes`` tensor."""
    if n <= 1:
        return 0.0
    factor = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}[kind]
    return factor * (n - 1) * nbytes / n


@dataclass(frozen=True)
class CommInfo:
    """What a collective node of the graph does, for dumps and explain()."""
    kind: str          # all_gather | reduce_scatter | all_reduce
    axis: str
    nbytes: float      # per rank, per call
    phase: str = "forward"
    then: str = ""     # what else it causes (its conjugate in backward, its bucket)

    def __str__(self) -> str:
        then = f"; {self.then}" if self.then else ""
        return f"{self.phase} {self.kind}[{self.axis}] {self.nbytes:,.0f} B/rank{then}"


class CommStats:
    """Bytes and calls per (axis, kind, phase); ``log`` keeps each call for explain().

    While ``trace`` is a list (``DistributedModule.record_timeline``), every collective adds
    ``("comm", label, start, end)`` (issue to completion) and every wait that blocked the
    calling thread adds ``("wait", label, start, end)`` (``time.perf_counter`` seconds)."""

    def __init__(self):
        self.trace: list | None = None
        self.reset()

    def reset(self):
        self.bytes = defaultdict(float)
        self.calls = defaultdict(int)
        self.log: deque = deque(maxlen=4096)   # the latest calls: (axis, kind, phase, label, bytes)

    def record(self, axis: str, kind: str, phase: str, label: str, nbytes: float):
        self.bytes[(axis, kind, phase)] += nbytes
        self.calls[(axis, kind, phase)] += 1
        self.log.append((axis, kind, phase, label, nbytes))

    def total(self, axis: str | None = None, kind: str | None = None, phase: str | None = None) -> float:
        return sum(b for (a, k, p), b in self.bytes.items()
                   if (axis is None or a == axis) and (kind is None or k == kind)
                   and (phase is None or p == phase))


class AxisComm(nn.Module):
    """One mesh axis's process group, as seen by this rank, with the owner's byte counter.

    An ``nn.Module`` without parameters, so that the module which owns it (the dp axis's
    ``DataParallelSync``, held by the graph as ``self.sync_dp``) carries it as a submodule.
    """

    def __init__(self, axis: str, size: int, index: int, group, stats: CommStats):
        super().__init__()
        self.axis, self.size, self.index, self.group = axis, size, index, group
        self.stats = stats

    def extra_repr(self) -> str:
        return f"axis={self.axis!r}, size={self.size}, index={self.index}"

    def _check(self):
        if self.group is None and self.size > 1:
            raise RuntimeError(f"mesh axis {self.axis!r} is virtual (no processes): the graph can be "
                               "inspected and dumped but not run; build the Mesh inside torchrun")

    def _phase(self) -> str:
        return "backward" if torch._C._current_autograd_node() is not None else "forward"

    def _run(self, kind: str, label: str, launch, async_op: bool):
        """Issue a collective; under tracing, time it (and wrap an asynchronous handle)."""
        trace = self.stats.trace
        if trace is None:
            return launch(async_op)
        name = f"{kind}[{self.axis}] {label}".strip()
        t0 = time.perf_counter()
        work = launch(async_op)
        if not async_op:
            t1 = time.perf_counter()
            trace.append(("comm", name, t0, t1))
            trace.append(("wait", name, t0, t1))
            return work
        return _TracedWork(work, name, t0, trace)

    def all_gather_flat(self, out: torch.Tensor, inp: torch.Tensor, label: str = "", async_op=False, phase: str | None = None):
        """``out`` (N * inp.numel()) <- concatenation of every rank's ``inp``."""
        self._check()
        self.stats.record(self.axis, "all_gather", phase or self._phase(), label,
                          ring_bytes("all_gather", out.numel() * out.element_size(), self.size))
        if self.size == 1:
            out.copy_(inp.reshape(-1))
            return None
        inp = inp.contiguous()
        return self._run("all_gather", label, lambda a: dist.all_gather_single(out, inp, group=self.group, async_op=a),
                         async_op)

    def reduce_scatter_flat(self, out: torch.Tensor, inp: torch.Tensor, label: str = "", async_op=False, phase: str | None = None):
        """``out`` <- this rank's 1/N block of the sum over ranks of ``inp``."""
        self._check()
        self.stats.record(self.axis, "reduce_scatter", phase or self._phase(), label,
                          ring_bytes("reduce_scatter", inp.numel() * inp.element_size(), self.size))
        if self.size == 1:
            out.copy_(inp.reshape(-1))
            return None
        inp = inp.contiguous()
        return self._run("reduce_scatter", label, lambda a: dist.reduce_scatter_single(
            out, inp, op=dist.ReduceOp.SUM, group=self.group, async_op=a), async_op)

    def all_reduce_(self, t: torch.Tensor, label: str = "", async_op=False, phase: str | None = None,
                    op=dist.ReduceOp.SUM):
        """In-place reduction (a sum unless ``op`` says otherwise) over the axis."""
        self._check()
        self.stats.record(self.axis, "all_reduce", phase or self._phase(), label,
                          ring_bytes("all_reduce", t.numel() * t.element_size(), self.size))
        if self.size == 1:
            return None
        return self._run("all_reduce", label, lambda a: dist.all_reduce(t, op=op, group=self.group, async_op=a),
                         async_op)


class _TracedWork:
    """An asynchronous collective's handle that records when it completed (a callback on its
    future where the backend offers one, else when the wait returned) and how long a wait
    blocked."""

    def __init__(self, work, name: str, start: float, trace: list):
        self._work, self._name, self._start, self._trace = work, name, start, trace
        self._done_at: float | None = None
        self._recorded = False
        try:
            work.get_future().add_done_callback(self._on_done)
        except (RuntimeError, AttributeError):
            pass

    def _on_done(self, _fut) -> None:
        self._done_at = time.perf_counter()

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def wait(self, *args) -> bool:
        t0 = time.perf_counter()
        result = self._work.wait(*args)
        t1 = time.perf_counter()
        if not self._recorded:
            self._recorded = True
            end = self._done_at if self._done_at is not None else t1
            self._trace.append(("comm", self._name, self._start, min(end, t1)))
            if t1 - t0 > 2e-5:       # a wait that found the transfer done did not block
                self._trace.append(("wait", self._name, t0, t1))
        return result


# ---- dim-0 sharding with padding ----------------------------------------------------------

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
        return -(-self.rows // self.n)

    @property
    def chunk_numel(self) -> int:
        return self.chunk_rows * self.row_numel

    def row_range(self, index: int | None = None) -> tuple[int, int]:
        i = self.index if index is None else index
        lo = min(i * self.chunk_rows, self.rows)
        return lo, min(lo + self.chunk_rows, self.rows)

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
        pad = self.n * self.chunk_numel - flat.numel()
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


# ---- autograd-aware collectives along a tensor dim ------------------------------------------

def _gather_dim(x: torch.Tensor, comm: AxisComm, dim: int) -> torch.Tensor:
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((comm.size * x.shape[0],) + tuple(x.shape[1:]))
    comm.all_gather_flat(out.view(-1), x.view(-1), label=f"dim {dim}")
    return out.movedim(0, dim)


def _scatter_dim(x: torch.Tensor, comm: AxisComm, dim: int) -> torch.Tensor:
    if x.shape[dim] % comm.size:
        raise ValueError(f"reduce_scatter along dim {dim} of size {x.shape[dim]} over "
                         f"{comm.axis}={comm.size}: the size must divide by the axis size")
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // comm.size,) + tuple(x.shape[1:]))
    comm.reduce_scatter_flat(out.view(-1), x.view(-1), label=f"dim {dim}")
    return out.movedim(0, dim)


class _AllGather(torch.autograd.Function):
    """forward: all_gather along dim / backward: reduce_scatter(sum) along dim."""

    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return _gather_dim(x, comm, dim)

    @staticmethod
    def backward(ctx, g):
        return _scatter_dim(g, ctx.comm, ctx.dim), None, None


class _ReduceScatter(torch.autograd.Function):
    """forward: reduce_scatter(sum) along dim / backward: all_gather along dim."""

    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return _scatter_dim(x, comm, dim)

    @staticmethod
    def backward(ctx, g):
        return _gather_dim(g, ctx.comm, ctx.dim), None, None


class _AllReduce(torch.autograd.Function):
    """forward: all_reduce(sum) / backward: identity (Megatron's g)."""

    @staticmethod
    def forward(ctx, x, comm):
        out = x.clone()
        comm.all_reduce_(out, label="partial sum")
        return out

    @staticmethod
    def backward(ctx, g):
        return g, None


class _CopyToAxis(torch.autograd.Function):
    """forward: identity / backward: all_reduce(sum) (Megatron's f)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        ctx.comm.all_reduce_(g, label="grad of replicated input")
        return g, None


def all_gather(x: torch.Tensor, comm: AxisComm, dim: int = 0) -> torch.Tensor:
    """Shard(dim) -> Replicate on ``comm``'s axis; backward reduce-scatters."""
    return _AllGather.apply(x, comm, dim)


def reduce_scatter(x: torch.Tensor, comm: AxisComm, dim: int = 0) -> torch.Tensor:
    """Partial(sum) -> Shard(dim); backward all-gathers."""
    return _ReduceScatter.apply(x, comm, dim)


def all_reduce(x: torch.Tensor, comm: AxisComm) -> torch.Tensor:
    """Partial(sum) -> Replicate; backward is the identity."""
    return _AllReduce.apply(x, comm)


def copy_to_axis(x: torch.Tensor, comm: AxisComm) -> torch.Tensor:
    """Replicate input entering per-rank compute; backward all-reduces its gradient."""
    return _CopyToAxis.apply(x, comm)
