"""weight_products: ``x @ W.T`` written as ``linear(x, W)``, so that tensor parallelism sees a product.

Models that compute a projection by hand (Falcon's ``FalconLinear``: ``hidden @ self.weight.T``,
then ``+ self.bias``) reach the graph as ``matmul(x, numpy_T(W))`` (or ``t``, ``transpose(0, 1)``,
``permute([1, 0])``). Tensor parallelism finds the products to split where a weight feeds a
product directly (``passes.analysis.param_matmul``): through a transpose it would find none, and
every such weight would stay whole, the plan splitting nothing. For a 2-D parameter ``W`` and
any ``x`` whose last dim is ``W``'s input features, ``matmul(x, W^T)`` is ``linear(x, W)``
exactly, so the pass writes it so (the transpose stays where something else reads it).
"""
from __future__ import annotations

import torch
from torch import fx

from autopar import meta
from autopar.context import CompileContext
from .analysis import param_name

__all__ = ["weight_products"]

aten = torch.ops.aten


def _transposed_weight(node) -> fx.Node | None:
    """The 2-D parameter ``node`` transposes, or None."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    t, a = node.target, node.args
    swaps = (t in (aten.numpy_T.default, aten.t.default)
             or (t == aten.transpose.int and sorted(d % 2 for d in a[1:3]) == [0, 1])
             or (t == aten.permute.default and [d % 2 for d in a[1]] == [1, 0]))
    w = a[0] if swaps else None
    val = w.meta.get(meta.VAL) if isinstance(w, fx.Node) else None
    return w if isinstance(val, torch.Tensor) and val.dim() == 2 else None


def weight_products(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    """Every ``matmul`` / ``mm`` of an activation by a transposed 2-D parameter as ``linear``."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (aten.matmul.default, aten.mm.default):
            continue
        x, wt = node.args[0], node.args[1]
        w = _transposed_weight(wt)
        if w is None or param_name(w, ctx) is None or not isinstance(x, fx.Node):
            continue
        with graph.inserting_before(node):
            lin = graph.call_function(aten.linear.default, (x, w))
        lin.meta = {k: node.meta[k] for k in (meta.VAL, *meta.ORIGIN) if k in node.meta}
        node.replace_all_uses_with(lin)
        graph.erase_node(node)
        if not wt.users:
            graph.erase_node(wt)
    graph.lint()
    return gm
