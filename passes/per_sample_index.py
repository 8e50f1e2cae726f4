"""per_sample_index: ``x[arange(B)[:, None], idx]`` written as a gather, so the batch shard follows it.

Indexing a tensor by ``arange`` over its own first dim pairs each row with itself: Hugging
Face's masks read ``padding_mask[batch_idx, kv_idx]`` with ``batch_idx = arange(B)`` (T5Gemma's
among them), a classifier picks ``logits[arange(B), last_token]``. The rule of ``aten.index``
sees only the index's shape, not that its values are the row numbers, so data parallelism
cannot keep the rows sharded there: a rank's slice of ``arange(B)`` holds global row numbers,
which its slice of ``x`` does not have. For every ``index(x, [I, T])`` whose ``I`` is such a
row index (an ``arange`` of ``x.shape[0]``, through unsqueezes, views, casts to an integer
dtype and ``+ 0``, lying along the first dim of the indices' broadcast shape ``S``) the pass
writes the same selection as

    G   = T expanded to S, reshaped to (B, M)          M = prod(S[1:])
    G   = where(G < 0, G + x.shape[1], G)              negative positions, as index reads them
    out = gather(x, 1, G, expanded over x's dims after the first two).view(*S, *x.shape[2:])

whose ops have rules that keep dim 0 sharded (each rank gathers within its own rows). The
wrap of negative positions is left out where ``T`` is itself an ``arange`` chain (never
negative); positions out of range still fail, as they do in ``index``. The rewrite is exact
on one device, so it runs under every plan and batch size (the shard pass calls it first; at
one row too, so that the walk marks the same nodes at one row as at two).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import fx

from autopar import meta
from autopar.context import CompileContext

__all__ = ["per_sample_index"]

aten = torch.ops.aten
_VIEWS = {aten.unsqueeze.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
          aten.squeeze.dim, aten.squeeze.default, aten.clone.default, aten.contiguous.default,
          aten.alias.default}
_CASTS = {aten._to_copy.default, aten.to.dtype, aten.to.device, aten.to.dtype_layout}
_ADDS = {aten.add.Tensor, aten.add.Scalar}


def _integer(val) -> bool:
    return isinstance(val, torch.Tensor) and not val.dtype.is_floating_point and val.dtype != torch.bool \
        and not val.dtype.is_complex


def _arange_end(node) -> Optional[int]:
    """``n`` if ``node``'s values are ``arange(n)`` in order along its one dim of size > 1 (or
    all of them, at ``n = 1``), else None."""
    val = node.meta.get(meta.VAL) if isinstance(node, fx.Node) else None
    if not _integer(val) or sum(s != 1 for s in val.shape) > 1:
        return None
    while True:   # ops that keep the values and their order (one dim of size > 1 throughout)
        if node.target in _VIEWS or (node.target in _CASTS and _integer(node.meta.get(meta.VAL))):
            node = node.args[0]
        elif node.target in _ADDS and len(node.args) > 1 and node.args[1] == 0:
            node = node.args[0]
        else:
            break
        if not isinstance(node, fx.Node):
            return None
    a = node.args
    if node.target == aten.arange.default and isinstance(a[0], int):
        return a[0]
    if node.target in (aten.arange.start, aten.arange.start_step) and a[0] == 0 and isinstance(a[1], int) \
            and (len(a) < 3 or a[2] == 1):
        return a[1]
    return None


def _row_index(node: fx.Node) -> Optional[tuple]:
    """``(x, T, S)`` if ``node`` is ``index(x, [I, T])`` with ``I`` the row numbers of ``x`` along
    the first dim of the broadcast shape ``S``, else None."""
    if node.target != aten.index.Tensor or len(node.args) != 2:
        return None
    x, indices = node.args
    if len(indices) != 2 or not all(isinstance(i, fx.Node) for i in indices):
        return None
    xv, iv, tv = (n.meta.get(meta.VAL) for n in (x, *indices))
    if not (isinstance(xv, torch.Tensor) and xv.dim() >= 2 and _integer(iv) and _integer(tv)):
        return None
    shape = tuple(torch.broadcast_shapes(iv.shape, tv.shape))
    lead = len(shape) - iv.dim()          # I's dims sit at the right of the broadcast shape
    if lead != 0 or iv.shape[0] != xv.shape[0] or shape[0] != xv.shape[0] or _arange_end(indices[0]) != xv.shape[0]:
        return None
    return x, indices[1], shape


def per_sample_index(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    g = gm.graph
    for node in list(g.nodes):
        found = _row_index(node)
        if found is None:
            continue
        x, t, shape = found
        xv = x.meta[meta.VAL]
        rows, cols, rest, m = xv.shape[0], xv.shape[1], list(xv.shape[2:]), math.prod(shape[1:])
        with g.inserting_before(node):
            def op(target, *args, **kwargs):
                new = g.call_function(target, args, kwargs)
                vals = [a.meta[meta.VAL] if isinstance(a, fx.Node) else a for a in args]
                with meta.VAL_LOCK:
                    new.meta[meta.VAL] = target(*vals, **kwargs)
                new.meta.update({k: node.meta[k] for k in meta.ORIGIN if k in node.meta})
                return new

            idx = op(aten.reshape.default, op(aten.expand.default, t, list(shape)), [rows, m])
            if _arange_end(t) is None:     # index reads -1 as the last position; gather does not
                idx = op(aten.where.self, op(aten.lt.Scalar, idx, 0), op(aten.add.Scalar, idx, cols), idx)
            if idx.meta[meta.VAL].dtype != torch.int64:
                idx = op(aten._to_copy.default, idx, dtype=torch.int64)
            if rest:
                idx = op(aten.expand.default, op(aten.view.default, idx, [rows, m] + [1] * len(rest)),
                         [rows, m] + rest)
            out = op(aten.view.default, op(aten.gather.default, x, 1, idx), list(shape) + rest)
        row_index = node.args[1][0]
        node.replace_all_uses_with(out)
        g.erase_node(node)
        _erase_unread(g, row_index)
    g.lint()
    return gm


def _erase_unread(g: fx.Graph, node: fx.Node) -> None:
    """The row index's chain back to its ``arange``, where nothing else reads it."""
    while isinstance(node, fx.Node) and not node.users and node.op == "call_function":
        src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        g.erase_node(node)
        node = src
