"""Graph analyses several passes (and the cost model's profile) share: results, not rewrites."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import fx

from autopar import meta
from autopar.context import CompileContext

__all__ = ["is_value", "input_nodes", "batch_dependent", "ParamMatmul", "param_name", "param_matmul"]

aten = torch.ops.aten


def is_value(val) -> bool:
    """A node's value is a tensor, or a tuple of values some of which are tensors."""
    return isinstance(val, torch.Tensor) or (
        isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val))


def input_nodes(node: fx.Node) -> list[fx.Node]:
    """The node's tensor inputs in the order strategies list them (args, then kwargs; lists
    walked; a multi-output value counts once)."""
    found = []

    def walk(v):
        if isinstance(v, fx.Node):
            if is_value(v.meta.get(meta.VAL)):
                found.append(v)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    for v in list(node.args) + list(node.kwargs.values()):
        walk(v)
    return found


def batch_dependent(graph: fx.Graph) -> set[fx.Node]:
    """The nodes with a graph input among their ancestors (the inputs included)."""
    dep: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "placeholder" or (n.op in ("call_function", "call_module", "call_method")
                                     and any(a in dep for a in n.all_input_nodes)):
            dep.add(n)
    return dep


@dataclass(frozen=True)
class ParamMatmul:
    """A product of an activation with a 2-D parameter (``linear``, ``addmm``, ``mm``,
    ``matmul``): the operands and which dims of the weight are its features."""
    act: fx.Node
    weight: fx.Node
    bias: Optional[fx.Node]
    out_dim: int      # the weight's output-feature dim
    in_dim: int       # the weight's input-feature dim
    k: int            # the activation's contracted dim


def param_name(node, ctx: CompileContext) -> Optional[str]:
    """The canonical name of the trainable parameter (not a buffer) a ``get_attr`` node reads."""
    if isinstance(node, fx.Node) and node.op == "get_attr":
        name = node.meta.get(meta.PARAM)
        info = ctx.params.get(name)
        if info is not None and not info.is_buffer:
            return name
    return None


def param_matmul(node: fx.Node, ctx: CompileContext) -> Optional[ParamMatmul]:
    """The node as a parameter product, or None."""
    t, a = node.target, node.args
    if t == aten.linear.default:
        x, w, b, out_dim, in_dim = a[0], a[1], (a[2] if len(a) > 2 else node.kwargs.get("bias")), 0, 1
    elif t == aten.addmm.default and not node.kwargs:
        b, x, w, out_dim, in_dim = a[0], a[1], a[2], 1, 0
    elif t in (aten.mm.default, aten.matmul.default):
        x, w, b, out_dim, in_dim = a[0], a[1], None, 1, 0
    else:
        return None
    if param_name(w, ctx) is None or w.meta[meta.VAL].dim() != 2 or not isinstance(x, fx.Node):
        return None
    if b is not None and param_name(b, ctx) is None:
        return None
    return ParamMatmul(x, w, b, out_dim, in_dim, x.meta[meta.VAL].dim() - 1)
