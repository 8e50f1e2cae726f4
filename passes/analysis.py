"""Graph analyses several passes (and the cost model's profile) share: results, not rewrites."""
from __future__ import annotations

import torch
from torch import fx

from autopar import meta

__all__ = ["is_value", "input_nodes", "batch_dependent"]


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
