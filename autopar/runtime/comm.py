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

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from ..sizes import ring_bytes
from . import flight
from .timing import now

__all__ = ["AxisComm", "CommStats", "TracedWork", "all_gather", "reduce_scatter", "all_reduce", "copy_to_axis"]


class CommStats:
    """Bytes and calls per (axis, kind, phase).

    While ``trace`` is a list (``DistributedModule.record_timeline``), every collective adds
    ``("comm", label, start, end)`` (issue to completion) and every wait that blocked the
    calling thread adds ``("wait", label, start, end)`` (``timing.now`` seconds: on CUDA each
    read waits for the compute stream, so a wait's span is the time the collective held it)."""

    def __init__(self):
        self.trace: list | None = None
        self.reset()

    def reset(self):
        self.bytes = defaultdict(float)
        self.calls = defaultdict(int)
        self.dtype_bytes = defaultdict(float)    # (axis, kind, phase, dtype name) -> bytes

    def record(self, axis: str, kind: str, phase: str, nbytes: float, dtype: torch.dtype | None = None):
        self.bytes[(axis, kind, phase)] += nbytes
        self.calls[(axis, kind, phase)] += 1
        if dtype is not None:
            self.dtype_bytes[(axis, kind, phase, str(dtype).removeprefix("torch."))] += nbytes

    def total(self, axis: str | None = None, kind: str | None = None, phase: str | None = None) -> float:
        return sum(b for (a, k, p), b in self.bytes.items()
                   if (axis is None or a == axis) and (kind is None or k == kind)
                   and (phase is None or p == phase))


class AxisComm(nn.Module):
    """One mesh axis's process group, as seen by this rank, with the owner's byte counter.

    An ``nn.Module`` without parameters, so that the module which owns it (the dp axis's
    ``DataParallelSync``, held by the graph as ``self.sync_dp``) carries it as a submodule.
    """

    def __init__(self, axis: str, size: int, index: int, group, stats: CommStats,
                 grad_dtype: torch.dtype | None = None):
        super().__init__()
        self.axis, self.size, self.index, self.group = axis, size, index, group
        self.stats = stats
        self.grad_dtype = grad_dtype    # mixed precision: the dtype gradient sums run in (None: their own)
        # tp: where tp_param_sync hands its gradient sums by parameter name when they are wider than
        # the gradients autograd carries (DataParallelSync.add_summed, bound by emit); None: autograd
        self.grad_sink = None
        self._gloo: bool | None = None  # the backend is gloo (``_in_place``), looked up on first use

    def summing(self, g: torch.Tensor) -> torch.Tensor:
        """A gradient about to be summed over the axis, in ``grad_dtype`` (``g`` itself when it
        is already, or without mixed precision): Plan(reduce_dtype) on the tp axis."""
        return g if self.grad_dtype is None or g.dtype == self.grad_dtype else g.to(self.grad_dtype)

    def extra_repr(self) -> str:
        return f"axis={self.axis!r}, size={self.size}, index={self.index}"

    def check_runnable(self) -> None:
        """Raise unless the axis can communicate: a virtual mesh's axis of more than one rank
        has no process group (its graph is inspected and dumped, not run)."""
        if self.group is None and self.size > 1:
            raise RuntimeError(f"mesh axis {self.axis!r} is virtual (no processes): the graph can be "
                               "inspected and dumped but not run; build the Mesh inside torchrun")

    def _phase(self) -> str:
        return "backward" if torch._C._current_autograd_node() is not None else "forward"

    def _run(self, kind: str, label: str, nbytes: int, launch, async_op: bool, device: torch.device):
        """Issue a collective of ``nbytes`` (noted by the flight recorder, whose handle raises
        ``CollectiveError`` if it fails); under tracing, time it (and wrap an asynchronous handle).
        A synchronous call is issued asynchronously and waited for at once: the wait is the
        recorder's, which on gloo gives up within seconds when a peer raised instead of issuing
        it (``flight.Watched``). ``device``: where its tensors are, whose work the timing waits for."""
        trace = self.stats.trace
        t0 = now(device) if trace is not None else 0.0
        work = flight.launch(self.group, kind, label, nbytes, launch, True)
        if not async_op:
            if work is not None:
                work.wait()
            if trace is not None:
                name, t1 = f"{kind}[{self.axis}] {label}".strip(), now(device)
                trace.append(("comm", name, t0, t1))
                trace.append(("wait", name, t0, t1))
            return None
        if trace is None:
            return work
        return TracedWork(work, f"{kind}[{self.axis}] {label}".strip(), t0, trace, device)

    def _in_place(self) -> bool:
        """Whether this axis's backend stages a copy of a flat all-gather's output or a
        reduce-scatter's input that an in-place form avoids (gloo: ``all_gather_into_tensor``
        gathers into a flat buffer of its own and copies out, ``reduce_scatter_tensor``
        all-reduces a clone of its input; its ``broadcast`` and ``all_reduce`` work in place)."""
        if self._gloo is None:
            self._gloo = self.group is not None and dist.get_backend(self.group) == "gloo"
        return self._gloo

    def all_gather_flat(self, out: torch.Tensor, inp: torch.Tensor, label: str = "", async_op=False,
                        phase: str | None = None, in_place: bool = False):
        """``out`` (N * inp.numel()) <- concatenation of every rank's ``inp``.

        ``in_place``: the caller holds ``out`` for as long as the collective is in flight, so
        on a backend that would stage a second copy of it (``_in_place``) each rank's block is
        broadcast into ``out`` from its owner instead: the same bytes arrive at every rank,
        with no flat copy beside ``out`` (ZeRO-3's unit gathers, in flight under compute)."""
        self.check_runnable()
        self.stats.record(self.axis, "all_gather", phase or self._phase(),
                          ring_bytes("all_gather", out.numel() * out.element_size(), self.size), out.dtype)
        if self.size == 1:
            out.copy_(inp.reshape(-1))
            return None
        inp = inp.contiguous()
        if in_place and self._in_place():
            return self._run("all_gather", label, out.numel() * out.element_size(),
                             lambda a: _broadcast_blocks(out, inp, self, a), async_op, out.device)
        return self._run("all_gather", label, out.numel() * out.element_size(),
                         lambda a: dist.all_gather_single(out, inp, group=self.group, async_op=a), async_op, out.device)

    def reduce_scatter_flat(self, out: torch.Tensor, inp: torch.Tensor, label: str = "", async_op=False,
                            phase: str | None = None, in_place: bool = False):
        """``out`` <- this rank's 1/N block of the sum over ranks of ``inp``.

        ``in_place``: ``inp`` is the caller's scratch (a bucket's flat gradients), free to be
        overwritten; on a backend whose reduce-scatter all-reduces a clone of its input
        (``_in_place``), ``inp`` is all-reduced where it is and this rank's block copied to
        ``out`` when the collective completes (``wait``): what the backend does, less the clone."""
        self.check_runnable()
        self.stats.record(self.axis, "reduce_scatter", phase or self._phase(),
                          ring_bytes("reduce_scatter", inp.numel() * inp.element_size(), self.size), inp.dtype)
        if self.size == 1:
            out.copy_(inp.reshape(-1))
            return None
        inp = inp.contiguous()
        if in_place and self._in_place():
            return self._run("reduce_scatter", label, inp.numel() * inp.element_size(),
                             lambda a: _reduce_in_place(out, inp, self, a), async_op, inp.device)
        return self._run("reduce_scatter", label, inp.numel() * inp.element_size(), lambda a: dist.reduce_scatter_single(
            out, inp, op=dist.ReduceOp.SUM, group=self.group, async_op=a), async_op, inp.device)

    def all_reduce_(self, t: torch.Tensor, label: str = "", async_op=False, phase: str | None = None,
                    op=dist.ReduceOp.SUM):
        """In-place reduction (a sum unless ``op`` says otherwise) over the axis."""
        self.check_runnable()
        self.stats.record(self.axis, "all_reduce", phase or self._phase(),
                          ring_bytes("all_reduce", t.numel() * t.element_size(), self.size), t.dtype)
        if self.size == 1:
            return None
        return self._run("all_reduce", label, t.numel() * t.element_size(),
                         lambda a: dist.all_reduce(t, op=op, group=self.group, async_op=a), async_op, t.device)


class TracedWork:
    """An asynchronous collective's handle that records when it completed (a callback on its
    future where the backend offers one for host work, else when the wait returned) and how
    long a wait blocked. ``device``: where its tensors are; on CUDA the wait's ends wait for the
    compute stream (``timing.now``), and completion is the wait's end: NCCL's future completes
    once its stream is joined to the caller's, not when the transfer has run."""

    def __init__(self, work, name: str, start: float, trace: list, device: torch.device | None = None):
        self._work, self._name, self._start, self._trace = work, name, start, trace
        self._device = device
        self._done_at: float | None = None
        self._recorded = False
        if device is None or torch.device(device).type != "cuda":
            try:
                work.get_future().add_done_callback(self._on_done)
            except (RuntimeError, AttributeError):
                pass

    def _on_done(self, _fut) -> None:
        self._done_at = now()     # host work (gloo): done when its future fires

    def wait(self, *args) -> bool:
        t0 = now(self._device)
        result = self._work.wait(*args)
        t1 = now(self._device)
        if not self._recorded:
            self._recorded = True
            end = self._done_at if self._done_at is not None else t1
            self._trace.append(("comm", self._name, self._start, min(end, t1)))
            if t1 - t0 > 2e-5:       # a wait that found the transfer done did not block
                self._trace.append(("wait", self._name, t0, t1))
        return result


class _Composite:
    """The handle of a collective made of several backend calls: ``wait`` waits for each, then
    runs ``then`` (once): the result is in place only after it."""
    __slots__ = ("_works", "_then")

    def __init__(self, works: list, then=None):
        self._works, self._then = works, then

    def wait(self, *args) -> bool:
        for w in self._works:
            w.wait(*args)
        self._works = []        # the calls' handles, and the buffers they hold, go with the wait
        if self._then is not None:
            then, self._then = self._then, None
            then()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def get_future(self):
        return torch.futures.collect_all([w.get_future() for w in self._works])


def _broadcast_blocks(out: torch.Tensor, inp: torch.Tensor, comm: AxisComm, async_op: bool):
    """All-gather as one broadcast per rank into its block of ``out`` (``all_gather_flat``,
    ``in_place``)."""
    w = inp.numel()
    out[comm.index * w:(comm.index + 1) * w].copy_(inp)
    works = [dist.broadcast(out[r * w:(r + 1) * w], src=dist.get_global_rank(comm.group, r), group=comm.group,
                            async_op=True) for r in range(comm.size)]
    handle = _Composite(works)
    if async_op:
        return handle
    handle.wait()
    return None


def _reduce_in_place(out: torch.Tensor, inp: torch.Tensor, comm: AxisComm, async_op: bool):
    """Reduce-scatter as an all-reduce of ``inp`` where it is, then this rank's block to ``out``
    (``reduce_scatter_flat``, ``in_place``)."""
    w = out.numel()
    handle = _Composite([dist.all_reduce(inp, op=dist.ReduceOp.SUM, group=comm.group, async_op=True)],
                        then=lambda: out.copy_(inp.view(-1)[comm.index * w:(comm.index + 1) * w]))
    if async_op:
        return handle
    handle.wait()
    return None


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
        return _scatter_dim(ctx.comm.summing(g), ctx.comm, ctx.dim).to(g.dtype), None, None


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
        total = ctx.comm.summing(g)
        total = total.clone() if total is g else total
        ctx.comm.all_reduce_(total, label="grad of replicated input")
        return total.to(g.dtype), None


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
