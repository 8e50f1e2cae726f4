"""kv_heads: grouped-query attention with fewer k/v heads than tensor-parallel ranks.

Megatron splits the q heads and the k/v heads alike over tp when both counts divide by it:
each rank keeps m/t q heads and the n/t k/v heads they read, and nothing moves around the
attention core (the view, expand and attention rules keep that split). When the m q heads
split but the n k/v heads do not (fewer k/v heads than ranks: multi-query attention, n = 1,
or n = 2 at tp = 4, where every rank's q heads read one k/v head and each k/v head is
replicated within a group of t/n ranks; or n = 3 at tp = 2, where a rank's q heads read two),
autopar keeps the k/v projections whole (``tensor_parallel`` decides so: every rank computes
k and v, n·hd features, small next to q's m·hd) and has each rank read the k/v heads its q
heads need. This pass writes that read as an ``index_select`` of the k/v heads at the
positions ``arange(m) // (m/n)`` (q head j reads k/v head j // (m/n)), in place of each
repetition of k/v heads for their q heads:

    reshape(expand(unsqueeze(x, d+1), (.., n, r, ..)), (.., n*r, ..))   repeat_kv (Hugging Face,
                                                                          torchtitan)
    repeat_interleave(x, r, d)                                            torchtitan
    scaled_dot_product_attention(q, k, v, enable_gqa=True)               k, v of n < m heads

The rule registry then shards the positions (``arange``'s S(0)) and ``index_select`` reads
the replicated x at them (``meta.KV_HEADS`` marks the op, so that the tensor-parallel walk
prefers that strategy to reading every head: the two cost alike at the op, the split saves
the gather of q after it), giving the op's output split on heads like q, with no
communication in forward; in backward Megatron's f all-reduces the gradient of x
(b·s·n·hd elements for k and for v), since each rank's index_add reaches only its group.

The rewrite keeps the single-device program's values exactly (it is the same gather), and is
made only where it lets the q heads split while the k/v heads cannot (``kv_whole``).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import fx
from torch._guards import detect_fake_mode

from autopar import meta
from autopar.context import CompileContext

aten = torch.ops.aten
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def kv_whole(n: int, m: int, t: int) -> bool:
    """n k/v heads for m q heads over tp=t stay whole, each rank reading the ones its q heads
    need: the q heads split (m divides by t), the k/v heads do not (n does not)."""
    return t > 1 and n % t != 0 and m % t == 0 and m % n == 0


def kv_heads(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    """Each repetition of k/v heads whose count tp cannot split, as an ``index_select``."""
    t = ctx.mesh.axis_size("tp")
    g = gm.graph
    for node in list(g.nodes):
        if node.op != "call_function":
            continue
        if node.target == aten.scaled_dot_product_attention.default:
            _attention(g, node, t, ctx)
            continue
        site = _repeat_site(node)
        if site is None:
            continue
        x, d, r = site
        n = x.meta[meta.VAL].shape[d]
        if not kv_whole(n, n * r, t):
            continue
        out = _take_heads(g, node, x, d, n * r, r, node.meta[meta.VAL])
        node.replace_all_uses_with(out)
        _erase_dead(g, node)
        ctx.notes.append(_note(node.name, n, n * r, t))
    g.lint()
    return gm


def _repeat_site(node: fx.Node) -> Optional[tuple]:
    """``(x, d, r)`` if ``node`` repeats each head of x along dim d r times, consecutively
    (``repeat_interleave(x, r, d)``, or its unsqueeze / expand / reshape spelling), else None."""
    val = node.meta.get(meta.VAL)
    if not isinstance(val, torch.Tensor):
        return None
    if node.target == aten.repeat_interleave.self_int:
        x, r = node.args[0], node.args[1]
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        if dim is None or not isinstance(r, int) or r < 2:
            return None
        return x, dim % val.dim(), r
    if node.target not in _RESHAPES or not _is(node.args[0], aten.expand.default) \
            or not _is(node.args[0].args[0], aten.unsqueeze.default):
        return None
    expand, unsq = node.args[0], node.args[0].args[0]
    x = unsq.args[0]
    xs, us, es = (tuple(n.meta[meta.VAL].shape) for n in (x, unsq, expand))
    j = unsq.args[1] % len(us)
    if j < 1 or us != xs[:j] + (1,) + xs[j:] or es != xs[:j] + (es[j],) + xs[j:] or es[j] < 2:
        return None
    r = es[j]
    if tuple(val.shape) != xs[:j - 1] + (xs[j - 1] * r,) + xs[j:]:
        return None                      # merges other dims: not the head repetition
    return x, j - 1, r


def _is(a, target) -> bool:
    return isinstance(a, fx.Node) and a.op == "call_function" and a.target == target


def _attention(g: fx.Graph, node: fx.Node, t: int, ctx: CompileContext) -> None:
    """sdpa(enable_gqa=True) with k/v heads tp cannot split: k and v at q's head count."""
    if not node.kwargs.get("enable_gqa", False):
        return
    q, k, v = node.args[:3]
    qv, kv = q.meta[meta.VAL], k.meta[meta.VAL]
    d = qv.dim() - 3
    if d < 0 or kv.dim() != qv.dim():
        return
    m, n = qv.shape[d], kv.shape[d]
    if n == m or v.meta[meta.VAL].shape[d] != n or not kv_whole(n, m, t):
        return
    new_k = _take_heads(g, node, k, d, m, m // n, None)
    new_v = _take_heads(g, node, v, d, m, m // n, None)
    node.args = (q, new_k, new_v) + tuple(node.args[3:])
    node.kwargs = {**node.kwargs, "enable_gqa": False}
    ctx.notes.append(_note(node.name, n, m, t))


def _take_heads(g: fx.Graph, before: fx.Node, x: fx.Node, d: int, m: int, r: int, out_val) -> fx.Node:
    """``index_select(x, d, arange(m) // r)``, inserted before ``before``."""
    xv = x.meta[meta.VAL]
    mode = detect_fake_mode([xv])
    kept = {k: before.meta[k] for k in meta.ORIGIN if k in before.meta}
    with g.inserting_before(before):
        pos = g.call_function(aten.arange.start, (0, m), {"dtype": torch.int64, "device": xv.device})
        idx = g.call_function(aten.div.Tensor_mode, (pos, r), {"rounding_mode": "floor"})
        out = g.call_function(aten.index_select.default, (x, d, idx))
    with meta.VAL_LOCK, mode if mode is not None else contextlib.nullcontext():
        pv = aten.arange.start(0, m, dtype=torch.int64, device=xv.device)
        iv = aten.div.Tensor_mode(pv, r, rounding_mode="floor")
        ov = out_val if out_val is not None else aten.index_select.default(xv, d, iv)
    for n, val in ((pos, pv), (idx, iv), (out, ov)):
        n.meta.update(kept)
        n.meta[meta.VAL] = val
    out.meta[meta.KV_HEADS] = d
    return out


def _erase_dead(g: fx.Graph, node: fx.Node) -> None:
    """``node`` and the inputs only it read (the unsqueeze and expand of a repeat_kv)."""
    todo = [node]
    while todo:
        n = todo.pop()
        if n.users or n.op != "call_function":
            continue
        ins = n.all_input_nodes
        g.erase_node(n)
        todo.extend(ins)


def _note(name: str, n: int, m: int, t: int) -> str:
    return (f"grouped-query attention at {name}: {n} k/v heads for {m} q heads over tp={t}; the k/v "
            f"projections stay whole and each rank reads the k/v heads of its {m // t} q heads (index_select), "
            "their gradient all-reduced over tp")
