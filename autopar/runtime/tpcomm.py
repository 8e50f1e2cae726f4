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
    tp_param_sync(params, names)
                             ``tp_copy`` of a group of parameters: one all-reduce of their gradients
                             (in the reduce dtype, handed to the masters' reducer by name under
                             mixed precision, never rounded to the compute dtype on the way)

The overlap pass splits the forward collectives into ``tp_start`` (issue, asynchronously) and
``tp_wait`` (complete; the autograd node with the conjugate backward), and fuses ``tp_copy``
with the linear that reads it into ``tp_copy_linear``, whose backward all-reduce of the input
gradient travels while the weight gradient is computed.

Two ops are lowered rather than run on their local pieces (vocabulary parallelism):

    tp_vocab_embedding(w, idx, lo, hi, padding_idx)
                             the table split along the vocabulary, S(0): each rank looks up
                             the tokens in its rows [lo, hi) and zeros the rest -> P(sum)
    tp_vocab_cross_entropy(logits, target, comm, lo, hi, reduction, ignore_index)
                             logits split along the classes, S(1): the softmax's max and sum
                             and the target's logit are all-reduced (three vectors of one
                             value per row), never the logits -> R

Shards follow the project's convention (``ceil(size/t)`` per rank, the last ranks hold
fewer): collectives pad to equal chunks and cut the padding off.

How a parameter is stored along ``tp`` is an ``autopar.placement.TPParam`` (whole, split
along a dim, or a fused projection stored interleaved); ``gather_tp_param`` assembles the
whole parameter from the ranks' pieces.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..placement import TPParam
from ..sizes import chunk, chunk_range, local_size
from .comm import AxisComm, all_reduce, copy_to_axis

__all__ = ["Pending", "tp_start", "tp_wait", "tp_copy_linear", "tp_all_reduce", "tp_copy", "tp_gather",
           "tp_reduce_scatter", "tp_split", "tp_param_sync", "tp_vocab_embedding", "tp_vocab_cross_entropy",
           "SavedRegather", "gather_tp_param", "pad_rows"]


def pad_rows(y: torch.Tensor, rows: int) -> torch.Tensor:
    """``y`` with zero rows appended along dim 0 up to ``rows``, contiguous (a collective's
    equal chunk)."""
    if y.shape[0] < rows:
        y = torch.cat([y, y.new_zeros((rows - y.shape[0],) + tuple(y.shape[1:]))])
    return y.contiguous()


def _issue(kind: str, x: torch.Tensor, comm: AxisComm, dim: int, size: int, label: str,
           async_op: bool = False, phase: str | None = None):
    """Start an all-gather (S(dim) -> R) or reduce-scatter (P(sum) -> S(dim)) of ``x`` along
    ``dim`` (``size``: the whole dim), padded to equal chunks: (handle, receive buffer, send
    buffer), the dim moved first."""
    n, c = comm.size, chunk(size, comm.size)
    y = pad_rows(x.movedim(dim, 0), c if kind == "all_gather" else n * c)
    if kind == "all_gather":
        out = y.new_empty((n * c,) + tuple(y.shape[1:]))
        work = comm.all_gather_flat(out.view(-1), y.view(-1), label=label, async_op=async_op, phase=phase)
    else:
        out = y.new_empty((c,) + tuple(y.shape[1:]))
        work = comm.reduce_scatter_flat(out.view(-1), y.view(-1), label=label, async_op=async_op, phase=phase)
    return work, out, y


def _finish(kind: str, out: torch.Tensor, comm: AxisComm, dim: int, size: int) -> torch.Tensor:
    """The result of an ``_issue`` once complete: padding cut, the dim back in place, dense
    (views downstream need it)."""
    rows = size if kind == "all_gather" else local_size(size, comm.size, comm.index)
    return out[:rows].movedim(0, dim).contiguous()


def _gather(x: torch.Tensor, comm: AxisComm, dim: int, size: int, label: str) -> torch.Tensor:
    _, out, _ = _issue("all_gather", x, comm, dim, size, label)
    return _finish("all_gather", out, comm, dim, size)


def _scatter(x: torch.Tensor, comm: AxisComm, dim: int, size: int, label: str) -> torch.Tensor:
    _, out, _ = _issue("reduce_scatter", x, comm, dim, size, label)
    return _finish("reduce_scatter", out, comm, dim, size)


class Pending:
    """A tp collective in flight (``tp_start``): the input (with its autograd history), the
    handle and the receive buffer; ``tp_wait`` completes it."""
    __slots__ = ("kind", "x", "comm", "args", "work", "out")

    def __init__(self, kind, x, comm, args, work, out):
        self.kind, self.x, self.comm, self.args, self.work, self.out = kind, x, comm, args, work, out


def tp_start(kind: str, x: torch.Tensor, comm: AxisComm, *args) -> Pending:
    """Issue ``kind`` (all_reduce | all_gather | reduce_scatter) on ``x`` asynchronously; ``args``
    as the synchronous function's (all_gather: dim, size, partial_grad; reduce_scatter: dim, size)."""
    with torch.no_grad():
        if kind == "all_reduce":
            out = x.detach().clone()
            work = comm.all_reduce_(out, label="partial sum", async_op=True, phase="forward")
            return Pending(kind, x, comm, args, work, out)
        dim, size = args[0], args[1]
        label = f"S({dim}) -> R" if kind == "all_gather" else f"P(sum) -> S({dim})"
        work, out, staging = _issue(kind, x.detach(), comm, dim, size, label, async_op=True, phase="forward")
        return Pending(kind, x, comm, args, work, (out, staging))     # the send buffer lives until the wait


def tp_wait(p: Pending) -> torch.Tensor:
    """Complete a ``tp_start``: the result the synchronous function gives, with its backward."""
    return _WAITS[p.kind].apply(p.x, p)


class _AllReduceWait(torch.autograd.Function):
    """forward: wait for the all-reduce / backward: identity (Megatron's g)."""

    @staticmethod
    def forward(ctx, x, p):
        if p.work is not None:
            p.work.wait()
        return p.out

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherWait(torch.autograd.Function):
    """forward: wait for the all-gather / backward: as ``tp_gather``'s."""

    @staticmethod
    def forward(ctx, x, p):
        dim, size, partial = p.args
        ctx.comm, ctx.dim, ctx.size, ctx.partial = p.comm, dim, size, partial
        if p.work is not None:
            p.work.wait()
        out = _finish("all_gather", p.out[0], p.comm, dim, size)
        regather = getattr(p.comm, "regather", None)
        if partial and regather is not None:
            regather.note(out, x.detach(), p.comm, dim, size)
        return out

    @staticmethod
    def backward(ctx, g):
        return _Gather.backward(ctx, g)[0], None


class _ScatterWait(torch.autograd.Function):
    """forward: wait for the reduce-scatter / backward: all-gather."""

    @staticmethod
    def forward(ctx, x, p):
        dim, size = p.args
        ctx.comm, ctx.dim, ctx.size = p.comm, dim, size
        if p.work is not None:
            p.work.wait()
        return _finish("reduce_scatter", p.out[0], p.comm, dim, size)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.comm, ctx.dim, ctx.size, f"grad of P(sum) -> S({ctx.dim})"), None


def _local(x: torch.Tensor, comm: AxisComm, dim: int, size: int) -> torch.Tensor:
    lo, hi = chunk_range(size, comm.size, comm.index)
    return x.narrow(dim, lo, hi - lo)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim, size, partial_grad):
        ctx.comm, ctx.dim, ctx.size, ctx.partial = comm, dim, size, partial_grad
        out = _gather(x, comm, dim, size, f"S({dim}) -> R")
        regather = getattr(comm, "regather", None)
        if partial_grad and regather is not None:
            regather.note(out, x.detach(), comm, dim, size)
        return out

    @staticmethod
    def backward(ctx, g):
        if ctx.partial:
            summed = _scatter(ctx.comm.summing(g), ctx.comm, ctx.dim, ctx.size, f"grad of S({ctx.dim}) -> R")
            return summed.to(g.dtype), None, None, None, None
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
        piece = _local(x, comm, dim, size)
        # a copy, never a view of x: a consumer may update the piece in place (x /= ...)
        return piece.clone() if piece.is_contiguous() else piece.contiguous()

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.comm, ctx.dim, ctx.size, f"grad of R -> S({ctx.dim})"), None, None, None


class _ParamSync(torch.autograd.Function):
    """forward: identity on a group of replicated parameters / backward: one all-reduce of their
    gradients, in the reduce dtype. Autograd hands each input the gradient in that input's own
    dtype, so under mixed precision a sum returned here would be rounded to the compute dtype
    before it reached the fp32 master; instead the sums go to ``comm.grad_sink`` by parameter
    name (``DataParallelSync.add_summed``, which lands them on the masters in the reduce
    dtype) and autograd carries zeros for these reads."""

    @staticmethod
    def forward(ctx, comm, names, *params):
        ctx.comm, ctx.names = comm, names
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        flat = ctx.comm.summing(torch.cat([g.reshape(-1) for g in grads]))
        ctx.comm.all_reduce_(flat, label=f"grads of {len(grads)} replicated parameters read per rank")
        parts = [x.view_as(g) for x, g in zip(flat.split([g.numel() for g in grads]), grads)]
        sink = ctx.comm.grad_sink
        if sink is not None and ctx.names is not None and any(g.dtype != flat.dtype for g in grads):
            sink(dict(zip(ctx.names, parts)))
            return (None, None) + tuple(torch.zeros_like(g) for g in grads)
        return (None, None) + tuple(x.to(g.dtype) for x, g in zip(parts, grads))


_WAITS = {"all_reduce": _AllReduceWait, "all_gather": _GatherWait, "reduce_scatter": _ScatterWait}


class _CopyLinear(torch.autograd.Function):
    """forward: linear(x, w, b) on a replicated x read by per-rank compute /
    backward: the input gradient's all-reduce over tp (Megatron's f) issued asynchronously,
    the weight and bias gradients computed while it travels, then waited on (as Megatron's
    asynchronous tensor-parallel all-reduce)."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm):
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.has_bias = comm, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        gx = gw = gb = work = None
        if ctx.needs_input_grad[0]:
            gx = ctx.comm.summing(g.matmul(weight.to(g.dtype)))
            work = ctx.comm.all_reduce_(gx, label="grad of replicated input (async, under the weight gradient)",
                                        async_op=True, phase="backward")
        g2 = g.reshape(-1, g.shape[-1])
        if ctx.needs_input_grad[1]:
            gw = g2.t().matmul(x.reshape(-1, x.shape[-1]).to(g.dtype))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        if work is not None:
            work.wait()
        if gx is not None:
            gx = gx.to(g.dtype)
        return gx, gw, gb, None


def tp_copy_linear(x: torch.Tensor, weight: torch.Tensor, bias, comm: AxisComm) -> torch.Tensor:
    """``linear(tp_copy(x), weight, bias)`` with the backward all-reduce of x's gradient
    overlapping the weight gradient (the overlap pass fuses the pair)."""
    return _CopyLinear.apply(x, weight, bias, comm)


def tp_param_sync(comm: AxisComm, params: list, names: list | None = None) -> tuple:
    """Megatron's ``f`` for a group of replicated parameters read by per-rank compute (the
    norms and biases of sequence-parallel regions): identity forward, one all-reduce of all
    their gradients in backward. ``names``: the parameters' names, under which the sums reach
    ``comm.grad_sink`` when they are wider than the gradients (mixed precision)."""
    return _ParamSync.apply(comm, names, *params)


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


def tp_vocab_embedding(weight: torch.Tensor, idx: torch.Tensor, lo: int, hi: int,
                       padding_idx: int = -1) -> torch.Tensor:
    """Lookup in this rank's rows [lo, hi) of the table; other tokens give zeros (P(sum)). The
    gradient reaches only this rank's rows of the tokens it owns (none for ``padding_idx``)."""
    outside = (idx < lo) | (idx >= hi)
    pad = padding_idx - lo if lo <= padding_idx < hi else None
    out = F.embedding((idx - lo).masked_fill(outside, 0), weight, padding_idx=pad)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


class _VocabCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, comm, lo, hi, reduction, ignore_index):
        if logits.dtype.itemsize < 4:      # 16-bit logits: the softmax's sums in float32, as torch's
            logits = logits.float()
        m = logits.max(dim=-1).values if logits.shape[-1] else logits.new_full(logits.shape[:-1], -float("inf"))
        comm.all_reduce_(m, label="vocab-parallel cross_entropy: max", op=dist.ReduceOp.MAX)
        e = torch.exp(logits - m.unsqueeze(-1))
        total = e.sum(dim=-1)
        comm.all_reduce_(total, label="vocab-parallel cross_entropy: sum of exp")
        valid = target != ignore_index
        inside = valid & (target >= lo) & (target < hi)
        local = (target - lo).masked_fill(~inside, 0)
        picked = (logits.gather(-1, local.unsqueeze(-1)).squeeze(-1) - m) * inside
        comm.all_reduce_(picked, label="vocab-parallel cross_entropy: target logit")
        losses = (torch.log(total) - picked) * valid
        ctx.save_for_backward(e / total.unsqueeze(-1), local, inside, valid)
        ctx.reduction = reduction
        count = valid.sum()
        ctx.count = count
        if reduction == 0:
            return losses
        return losses.sum() / count if reduction == 1 else losses.sum()

    @staticmethod
    def backward(ctx, g):
        softmax, local, inside, valid = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local.unsqueeze(-1), -inside.unsqueeze(-1).to(grad.dtype))
        scale = g / ctx.count if ctx.reduction == 1 else g
        if ctx.reduction == 0:
            scale = g.unsqueeze(-1)
        grad = grad * valid.unsqueeze(-1) * scale
        return grad, None, None, None, None, None, None


def tp_vocab_cross_entropy(logits: torch.Tensor, target: torch.Tensor, comm: AxisComm, lo: int, hi: int,
                           reduction: int = 1, ignore_index: int = -100) -> torch.Tensor:
    """Cross-entropy of ``(N, C)`` logits split along C (this rank: classes [lo, hi))."""
    return _VocabCrossEntropy.apply(logits, target, comm, lo, hi, reduction, ignore_index)


_TOKEN = object()


class _Regathered:
    """One gathered tensor's saved shard, shared by every saved reference to the gathered
    tensor in a forward (q, k and v each save the input they share): backward gathers it
    once, when the first of them unpacks, and lets it go after the last."""
    __slots__ = ("shard", "comm", "dim", "size", "left", "full")

    def __init__(self, shard, comm, dim, size):
        self.shard, self.comm, self.dim, self.size = shard, comm, dim, size
        self.left, self.full = 0, None


class SavedRegather:
    """Sequence parallelism's saved-activation saving (Korthikanti et al. 2022, section 4.2.2):
    the input of a column product is all-gathered from sequence shards, and autograd would
    save the gathered tensor for the weight gradient. Instead the shard is saved and
    gathered again when backward needs it: one more all-gather of b·s·h per gathered input
    in backward, however many products read it (counted like every other collective).

    ``tp_gather`` notes each gathered tensor read by per-rank compute; ``scope`` installs the
    saved-tensor hooks for one forward."""

    def __init__(self):
        self._live: dict[int, list] = {}

    def note(self, out, shard, comm, dim, size) -> None:
        """``out`` was gathered from ``shard``; its saved references share one ``_Regathered``
        (made at the first, kept in the note: a later tensor at the same address gets its own)."""
        if out.untyped_storage().nbytes():
            self._live[out.untyped_storage().data_ptr()] = [weakref.ref(out), shard, comm, dim, size, None]

    def _entry(self, t):
        """The note of the gathered tensor ``t`` is, if any. An address only identifies a
        storage while that storage lives: a note whose tensor is gone is stale (its memory may
        hold another tensor now) and is dropped."""
        ptr = t.untyped_storage().data_ptr()
        entry = self._live.get(ptr)
        if entry is not None and entry[0]() is None:
            del self._live[ptr]
            return None
        return entry

    @contextmanager
    def scope(self):
        """Saved-tensor hooks for one forward. Hooks do not nest (the innermost alone runs), so
        these hand every tensor that is not theirs, and the shard they keep, to the hooks that
        were active (ZeRO-3's, a profiler's, the caller's). The saved references to one gathered
        tensor share one ``_Regathered``: one gather in backward for all of them."""
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        pack, unpack = outer if outer is not None else (lambda t: t, lambda p: p)

        def _pack(t):
            entry = self._entry(t) if self._live else None
            if entry is None:
                return pack(t)
            held = entry[5]
            if held is None:
                _, shard, comm, dim, size, _ = entry
                held = entry[5] = _Regathered(pack(shard), comm, dim, size)
            held.left += 1
            return (_TOKEN, held, t.size(), t.stride(), t.storage_offset())

        def _unpack(p):
            if isinstance(p, tuple) and p and p[0] is _TOKEN:
                _, held, shape, stride, offset = p
                full = held.full
                if full is None:
                    full = _gather(unpack(held.shard), held.comm, held.dim, held.size,
                                   "re-gather of a sequence-parallel input")
                held.left -= 1      # the last reader lets it go (a second backward gathers anew)
                held.full = full if held.left > 0 else None
                return full.as_strided(shape, stride, offset)
            return unpack(p)

        try:
            with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
                yield
        finally:
            self._live.clear()


def gather_tp_param(param: TPParam, local: torch.Tensor, comm: AxisComm, shape: tuple) -> torch.Tensor:
    """The whole parameter of ``shape`` stored as ``param`` says, all-gathered along ``tp`` from
    this rank's piece ``local`` (every rank of the axis must call)."""
    if not param.sharded or comm.size == 1:
        return local
    n, d = comm.size, param.placement.dim
    rows = [param.local_shape(shape, n, r)[d] for r in range(n)]
    c = max(rows)
    x = pad_rows(local.movedim(d, 0), c)
    out = x.new_empty((n * c,) + tuple(x.shape[1:]))
    comm.all_gather_flat(out.view(-1), x.view(-1), label="full parameter", phase="state")
    return param.full_from([out[r * c: r * c + rows[r]].movedim(0, d) for r in range(n)])
