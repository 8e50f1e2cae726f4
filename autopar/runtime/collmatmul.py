"""Collective matmul: a tensor-parallel collective fused with the matmul next to it.

A column-parallel linear fed by a sequence-sharded activation first all-gathers the
activation, then multiplies; a row-parallel linear multiplies, then reduce-scatters the
partial sums. Run whole, the collective and the matmul cannot overlap: one needs the
other's entire result. Decomposing both along the sharded dim into one chunk per rank
breaks that dependency (Wang et al., ASPLOS 2023): the chunks travel a ring of
point-to-point transfers, and while one chunk is in flight the rank multiplies the chunk
it already has. The total volume is that of the ring collective; only the order changes.
Each step's send to the next rank and receive from the previous one are posted as one batch
(``flight.batch``): every rank's k-th batch meets its neighbours' k-th, so on NCCL, where a
receive posted alone would hold the stream its send waits behind (at tp=2 the next and the
previous rank are one), no rank waits for ever.

    all_gather_matmul      linear(all_gather(x, dim), w, b)          x: S(dim), w: any local weight
    matmul_reduce_scatter  reduce_scatter(linear(x, w), dim) + b     x: R along dim, S(-1); w: [out, in_local]

Both are autograd functions whose backward is the mirror decomposition (a ring
reduce-scatter for the gradient of a gathered input, a ring all-gather for the gradient
of a scattered output). Bytes are recorded once per collective on ``comm.stats``, the
same per-rank ring volume ``autopar.runtime.comm.all_gather`` / ``reduce_scatter`` record, so the
counters do not depend on whether a linear was decomposed.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..sizes import ring_bytes
from . import flight
from .comm import AxisComm
from .timing import now

__all__ = ["all_gather_matmul", "matmul_reduce_scatter"]


# ---- rings over one axis; tensors are laid out with the decomposed dim first ---------------

def _peers(comm: AxisComm) -> tuple[int, int]:
    """Global ranks of the next and the previous rank of the axis's ring."""
    p, r = comm.size, comm.index
    return (dist.get_global_rank(comm.group, (r + 1) % p),
            dist.get_global_rank(comm.group, (r - 1) % p))


def _waited(work, comm: AxisComm, label: str, device) -> None:
    """Wait for a ring transfer; under ``record_timeline`` a wait that blocked is recorded (its
    ends wait for ``device``'s compute: ``timing.now``)."""
    trace = comm.stats.trace
    if trace is None:
        work.wait()
        return
    t0 = now(device)
    work.wait()
    t1 = now(device)
    if t1 - t0 > 2e-5:
        trace.append(("wait", label, t0, t1))


def _start(comm: AxisComm, device) -> float:
    return now(device) if comm.stats.trace is not None else 0.0


def _span(comm: AxisComm, label: str, t0: float, device) -> None:
    if comm.stats.trace is not None:
        comm.stats.trace.append(("comm", label, t0, now(device)))


def _ring_gather(local: torch.Tensor, comm: AxisComm, compute, label: str = "") -> torch.Tensor:
    """All-gather ``local`` (p equal blocks along dim 0) around the ring; ``compute(j, block)``
    runs on block j while the transfer of the next block is in flight. Returns the gathered
    tensor. At step i a rank holds block (index - i) and receives block (index - i - 1)."""
    p, r = comm.size, comm.index
    s = local.shape[0]
    nxt, prv = _peers(comm)
    t0 = _start(comm, local.device)
    buf = local.new_empty((p * s,) + tuple(local.shape[1:]))
    buf[r * s:(r + 1) * s].copy_(local)
    sends = []
    for i in range(p):
        j = (r - i) % p
        block = buf[j * s:(j + 1) * s]
        recv = None
        if i < p - 1:
            k = (j - 1) % p
            recv, send = flight.batch([
                flight.Transfer("recv", buf[k * s:(k + 1) * s], prv, comm.group, f"{label or 'ring'} block {k}"),
                flight.Transfer("send", block, nxt, comm.group, f"{label or 'ring'} block {j}")])
            sends.append(send)
        compute(j, block)
        if recv is not None:
            _waited(recv, comm, label, local.device)
    for w in sends:
        _waited(w, comm, label, local.device)
    _span(comm, label, t0, local.device)
    return buf


def _ring_reduce_scatter(partial, comm: AxisComm, label: str = "", device=None) -> torch.Tensor:
    """Reduce-scatter around the ring: ``partial(j)`` is this rank's addend for block j (a
    fresh tensor). The running sum of block j starts at rank j + 1 and ends at rank j, so at
    step i a rank adds its addend for block (index - 1 - i) to the sum received from the
    previous rank and passes it on; its own block's total is what it holds at the end. A step
    posts its send with the receive of the next step's sum (one batch).
    ``device``: where the addends are computed (what a timing under ``record_timeline`` waits for)."""
    p, r = comm.size, comm.index
    nxt, prv = _peers(comm)
    t0 = _start(comm, device)
    sends, inbox, acc, recv = [], None, None, None
    for i in range(p):
        j = (r - 1 - i) % p
        acc = partial(j).contiguous()        # computed while the running sum travels
        if recv is not None:
            _waited(recv, comm, label, device)
            acc.add_(inbox)
        if i < p - 1:
            if inbox is None:
                inbox = torch.empty_like(acc)
            send, recv = flight.batch([
                flight.Transfer("send", acc, nxt, comm.group, f"{label or 'ring'} block {j}"),
                flight.Transfer("recv", inbox, prv, comm.group, f"{label or 'ring'} block {(j - 1) % p}")])
            sends.append(send)
    for w in sends:
        _waited(w, comm, label, device)
    _span(comm, label, t0, device)
    return acc


# ---- argument checks (local, before any communication) --------------------------------------

def _check(name: str, x, weight, bias, comm: AxisComm, dim: int, size: int | None, scatter: bool) -> int:
    if x.dim() < 2:
        raise ValueError(f"{name}: expected x with at least 2 dims (the decomposed dim and the "
                         f"features), found shape {tuple(x.shape)}")
    d = dim + x.dim() if dim < 0 else dim
    if not 0 <= d < x.dim() - 1:
        raise ValueError(f"{name}: expected dim to name a non-last dim of x {tuple(x.shape)} "
                         f"(0..{x.dim() - 2}), found dim={dim}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{name}: expected weight of shape [out, {x.shape[-1]}] (x's last dim), "
                         f"found {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{name}: expected bias of shape ({weight.shape[0]},), found {tuple(bias.shape)}")
    p = comm.size
    if scatter and x.shape[d] % p:
        raise ValueError(f"{name}: expected x.shape[{d}] divisible by {comm.axis}={p} (equal "
                         f"shards), found {x.shape[d]}")
    if not scatter and size is not None and (size % p or size // p != x.shape[d]):
        raise ValueError(f"{name}: expected equal shards of the whole length {size} along dim {d} "
                         f"over {comm.axis}={p} ({size / p:g} per rank), found a shard of "
                         f"{x.shape[d]} on rank {comm.index}")
    comm.check_runnable()
    return d


def _bias_grad(g: torch.Tensor, ctx) -> torch.Tensor | None:
    return g.reshape(-1, g.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None


# ---- the two decompositions ------------------------------------------------------------------

class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, comm, dim):
        ctx.comm, ctx.dim, ctx.has_bias = comm, dim, bias is not None
        xt = x.movedim(dim, 0).contiguous()
        s, p = xt.shape[0], comm.size
        comm.stats.record(comm.axis, "all_gather", "forward",
                          ring_bytes("all_gather", p * xt.numel() * xt.element_size(), p))
        out = xt.new_empty((p * s,) + tuple(xt.shape[1:-1]) + (weight.shape[0],))

        def compute(j, block):
            torch.matmul(block, weight.t(), out=out[j * s:(j + 1) * s])

        gathered = _ring_gather(xt, comm, compute, f"all_gather[{comm.axis}] + matmul (ring)")
        if bias is not None:
            out.add_(bias)
        ctx.save_for_backward(gathered, weight)
        return out.movedim(0, dim).contiguous()

    @staticmethod
    def backward(ctx, g):
        gathered, weight = ctx.saved_tensors
        comm, dim = ctx.comm, ctx.dim
        gt = g.movedim(dim, 0)
        p, s = comm.size, gathered.shape[0] // comm.size
        gx = gw = None
        if ctx.needs_input_grad[0]:
            nbytes = gathered.numel() * gathered.element_size()
            comm.stats.record(comm.axis, "reduce_scatter", "backward",
                              ring_bytes("reduce_scatter", nbytes, p))
            gx = _ring_reduce_scatter(lambda j: gt[j * s:(j + 1) * s] @ weight, comm,
                                      f"matmul + reduce_scatter[{comm.axis}] (ring, grad)", gt.device)
            gx = gx.movedim(0, dim).contiguous()
        if ctx.needs_input_grad[1]:
            gw = gt.reshape(-1, gt.shape[-1]).t() @ gathered.view(-1, gathered.shape[-1])
        return gx, gw, _bias_grad(g, ctx), None, None


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, comm, dim):
        ctx.comm, ctx.dim, ctx.has_bias = comm, dim, bias is not None
        xt = x.movedim(dim, 0)
        p = comm.size
        s = xt.shape[0] // p
        full = xt.numel() // xt.shape[-1] * weight.shape[0] * xt.element_size()
        comm.stats.record(comm.axis, "reduce_scatter", "forward",
                          ring_bytes("reduce_scatter", full, p))
        out = _ring_reduce_scatter(lambda j: xt[j * s:(j + 1) * s] @ weight.t(), comm,
                                   f"matmul + reduce_scatter[{comm.axis}] (ring)", xt.device)
        if bias is not None:
            out.add_(bias)              # once, after the reduction
        ctx.save_for_backward(x, weight)
        return out.movedim(0, dim).contiguous()

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        comm, dim = ctx.comm, ctx.dim
        if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
            return None, None, _bias_grad(g, ctx), None, None
        p, gt = comm.size, g.movedim(dim, 0).contiguous()
        s = gt.shape[0]
        comm.stats.record(comm.axis, "all_gather", "backward",
                          ring_bytes("all_gather", p * gt.numel() * gt.element_size(), p))
        xt = x.movedim(dim, 0)
        gxt = None
        if ctx.needs_input_grad[0]:
            gxt = xt.new_empty((p * s,) + tuple(xt.shape[1:]))

        def compute(j, block):
            if gxt is not None:
                torch.matmul(block, weight, out=gxt[j * s:(j + 1) * s])

        gathered = _ring_gather(gt, comm, compute, f"all_gather[{comm.axis}] + matmul (ring, grad)")
        gx = gxt.movedim(0, dim).contiguous() if gxt is not None else None
        gw = None
        if ctx.needs_input_grad[1]:
            gw = gathered.view(-1, gathered.shape[-1]).t() @ xt.reshape(-1, xt.shape[-1])
        return gx, gw, _bias_grad(g, ctx), None, None


def all_gather_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      comm: AxisComm, dim: int, *, size: int | None = None) -> torch.Tensor:
    """``F.linear(all_gather(x, dim), weight, bias)`` with the gather decomposed into a ring.

    forward: all_gather along ``dim`` overlapped with the per-chunk linear (a ring of p steps:
    multiply the chunk held, pass it on, receive the next) /
    backward: grad x = reduce_scatter(grad @ weight) along ``dim`` as a ring of partial sums
    overlapped with the per-chunk matmul; grad weight = grad^T @ gathered x (kept from
    forward); grad bias = grad summed over all but the last dim.

    ``x`` is this rank's shard along ``dim`` (a non-last dim; every rank's shard has the same
    shape), ``weight`` this rank's local weight ``[out_local, x.shape[-1]]``. ``size``, when
    given, is the whole length along ``dim`` and is checked against ``p * x.shape[dim]``.
    With one rank this is ``F.linear``.
    """
    d = _check("all_gather_matmul", x, weight, bias, comm, dim, size, scatter=False)
    if comm.size == 1:
        return F.linear(x, weight, bias)
    return _AllGatherMatmul.apply(x, weight, bias, comm, d)


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          comm: AxisComm, dim: int) -> torch.Tensor:
    """``reduce_scatter(F.linear(x, weight), dim) + bias`` with the reduction decomposed into a ring.

    forward: per-chunk matmul overlapped with a ring reduce-scatter along ``dim`` (each step
    multiplies the chunk the next rank needs and adds the partial sum received); bias added
    once, after the reduction /
    backward: grad x = all_gather(grad, dim) @ weight as a ring overlapped with the per-chunk
    matmul; grad weight = gathered grad^T @ x; grad bias = this rank's output-shard grad
    summed over all but the last dim.

    ``x`` is whole along ``dim`` (divisible by the axis size) and split along its last dim;
    ``weight`` is ``[out, x.shape[-1]]`` (row-parallel). ``bias`` is replicated: each rank's
    shard received it once, so its gradient here is this rank's addend (the sum over its own
    shard), exactly what autograd gives ``reduce_scatter(linear(x, w)) + bias``; the whole
    gradient is the sum over the axis, which the caller takes as for any replicated parameter
    read by per-rank compute (``tp_param_sync`` / ``tp_copy``). With one rank this is ``F.linear``.
    """
    d = _check("matmul_reduce_scatter", x, weight, bias, comm, dim, None, scatter=True)
    if comm.size == 1:
        return F.linear(x, weight, bias)
    return _MatmulReduceScatter.apply(x, weight, bias, comm, d)
