"""weight_split: defer the weight gradients of matmuls to W actions (zero-bubble schedules).

Zero-bubble schedules run a stage's backward as B, the gradient of the stage's input (what
the previous stage waits for), and later W, the gradients of the weights, which fills what
would otherwise be bubble. The weight gradient of a matmul is the expensive half of its
backward (gᵀx, as many FLOPs as the forward), so every matmul whose weight does not depend on
the batch (a parameter, gathered or sliced as the layout says) and whose input does is
rewritten to ``autopar.runtime.wgrad.wsplit_matmul``, which defers that half to the module's
``WeightGradStash`` while B runs. Other parameter readers (norms, biases, embeddings) are
cheap and keep their weight gradient in B.

Runs last, on the graph emit turns into code; it only applies when the plan's schedule
splits backward (``Plan.split_backward``).
"""
from __future__ import annotations

import torch
from torch import fx

from autopar import meta
from autopar.context import CompileContext
from autopar.ops import op_name
from autopar.runtime.wgrad import WeightGradStash, wsplit_matmul

from .analysis import batch_dependent

__all__ = ["weight_split"]


def _matmul_operands(node: fx.Node):
    """(x, w, b, transposed) of a matmul node, or None."""
    name, a = op_name(node.target), node.args
    if name == "linear":
        return a[0], a[1], (a[2] if len(a) > 2 else node.kwargs.get("bias")), True
    if name == "addmm" and len(a) == 3 and not node.kwargs:
        return a[1], a[2], a[0], False
    if name in ("mm", "matmul") and len(a) == 2:
        return a[0], a[1], None, False
    return None


def weight_split(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    """Rewrite every matmul whose 2-D weight does not depend on the batch, and whose input does,
    into ``wsplit_matmul`` reading the module's stash; the count goes to ``ctx.notes``."""
    dep = batch_dependent(gm.graph)
    gm.add_module(meta.STASH, WeightGradStash())
    g = gm.graph
    with g.inserting_before(next(iter(g.nodes))):
        stash = g.get_attr(meta.STASH)
    count = 0
    for node in list(g.nodes):
        ops = _matmul_operands(node) if node.op == "call_function" else None
        if ops is None:
            continue
        x, w, b, transposed = ops
        val = w.meta.get(meta.VAL) if isinstance(w, fx.Node) else None
        if not (isinstance(w, fx.Node) and w not in dep and isinstance(val, torch.Tensor) and val.dim() == 2):
            continue
        if not (isinstance(x, fx.Node) and x in dep):
            continue
        with g.inserting_before(node):
            new = g.call_function(wsplit_matmul, (x, w, b, stash, transposed))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        g.erase_node(node)
        count += 1
    ctx.notes.append(f"zero-bubble: {count} matmuls compute their weight gradient in W")
    g.lint()
    return gm
