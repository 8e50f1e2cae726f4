"""localize: rewrite the size arguments of the logical graph for this rank.

The graph is captured at global shapes; a node that runs on shards must be told its local
sizes (``view(x, [8, 16, 4, 8])`` becomes ``view(x, [2, 16, 4, 8])`` on one of 4 data-parallel
ranks). For each node the shard pass gave a strategy, the op's localizer in the rule
registry rewrites those arguments for this rank's coordinate on each mesh axis. Shapes in
``node.meta`` stay global: the dump shows the logical graph with layouts, the emitted code
the local sizes.
"""
from __future__ import annotations

from torch import fx

from autopar import meta
from autopar.context import CompileContext
from dataclasses import replace

from autopar.passes.rules import LOCALIZERS, OpInfo, localize as localize_args, shrink


def _merge(orig, new):
    """``new`` arguments with the graph's nodes kept where ``orig`` had them."""
    if isinstance(orig, fx.Node):
        return orig
    if isinstance(orig, (list, tuple)) and isinstance(new, (list, tuple)) and len(orig) == len(new):
        return type(orig)(_merge(o, x) for o, x in zip(orig, new)) if isinstance(orig, tuple) \
            else [_merge(o, x) for o, x in zip(orig, new)]
    return new


AXIS_ORDER = ("dp", "tp")   # the tp axis splits what is local to dp (as the shard pass chose)


def localize(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    for node in gm.graph.nodes:
        chosen = node.meta.get(meta.STRATEGY)
        if not chosen or node.target not in LOCALIZERS:
            continue
        info = OpInfo.from_node(node)
        for axis in AXIS_ORDER:
            if axis not in chosen:
                continue
            n, index, strategy = ctx.mesh.axis_size(axis), ctx.mesh.coordinate(axis), chosen[axis]
            info = info.with_n(n)
            args, kwargs = localize_args(info, strategy, n, index)
            info = shrink(replace(info, args=tuple(args), kwargs=dict(kwargs)), strategy, n, index)
        node.args = _merge(node.args, tuple(info.args))
        node.kwargs = {k: _merge(node.kwargs.get(k), v) for k, v in info.kwargs.items()}
    gm.graph.lint()
    return gm
