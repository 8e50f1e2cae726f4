"""shard: annotate every node with its layout, one placement per mesh axis.

The graph is the logical one, at global shapes. Parameters take the layout the plan stores
them in (ZeRO-3: ``dp:S(0)``, else ``dp:R``); inputs are split along the batch
(``dp:S(0)``). The batch shard is then followed through the graph with the sharding-rule
registry (``autopar.passes.rules``): each node takes the first strategy of its op that
accepts its inputs as they are laid out; that strategy's output placement is the node's
layout, and the strategy itself is kept in ``node.meta`` for the localize pass.

Consumers see parameters whole in every dp mode (the collectives pass gathers ZeRO-3's
shards before use), so data parallelism never moves activations: a replicated tensor that
meets the batch shard (a mask built for the whole batch) is sliced locally, and an op that
cannot run on the batch shard otherwise is an error that names it, not a silent change of
the program. With ``Plan(tp=True)`` the tp axis is placed by passes/tensor_parallel.py, which
chooses among the strategies (least communication) instead of matching them: first the
parameters' placements (``decide``, before the dp walk: it may move row-parallel biases),
then every node's (``annotate``, on the dp-local shapes).
"""
from __future__ import annotations

import torch
from torch import fx

from autopar import meta
from autopar.context import CompileContext
from autopar.placement import Layout, Replicate, Shard
from . import tensor_parallel
from .analysis import input_nodes, is_value
from .rules import OpInfo, format_placement, rule_for, strategies_for

R = Replicate()


def _matches(required, current) -> bool:
    if isinstance(required, tuple):
        return all(r is None or _matches(r, c) for r, c in zip(required, current))
    return required == current


def _replicated(p) -> bool:
    return all(_replicated(x) for x in p) if isinstance(p, tuple) else p == R


def _free(required, current) -> bool:
    """``current`` becomes ``required`` without communication: a replicated input that the
    op wants sharded is sliced locally (the collectives pass inserts the slice)."""
    return isinstance(required, Shard) and current == R


def _choose(node: fx.Node, placed: dict, n: int):
    """The strategy ``node`` runs in on the data-parallel axis (None: everything replicated
    and the op has no rule). A strategy that matches its inputs as they are laid out wins;
    otherwise one that needs only local slices of replicated inputs."""
    # every dp mode hands consumers the whole parameter (ZeRO-3 gathers it first)
    ins = input_nodes(node)
    current = tuple(R if a.op == "get_attr" else placed.get(a, R) for a in ins)
    sliceable = tuple(a.op != "get_attr" for a in ins)   # parameters are never sliced
    whole = all(_replicated(p) for p in current) or n == 1   # (one dp rank: nothing is split)
    if whole and rule_for(node.target) is None:
        return None          # nothing sharded reaches it: no need to search the op's strategies
    strategies = strategies_for(OpInfo.from_node(node, n), n)
    if strategies is None:
        raise NotImplementedError(
            f"autopar has no sharding rule for {node.target} (node {node.name}), which reads the "
            f"batch shard, and no candidate placement matched when its strategies were searched "
            f"(passes/rules/search.py, along dp={n}); add a rule in passes/rules/ so that data "
            "parallelism knows whether the op can run on a slice of the batch")
    for slicing in (False, True):
        for s in strategies:
            if all(_matches(r, c) or (slicing and ok and _free(r, c))
                   for r, c, ok in zip(s.inputs, current, sliceable)):
                return s
    if n == 1:       # one dp rank splits nothing: the op runs whole, as one without a rule does
        return None
    raise ValueError(
        f"node {node.name} ({node.target}) cannot run on its inputs as data parallelism lays them "
        f"out ({', '.join(format_placement(p) for p in current)} along dp={n}): the op mixes samples "
        "of the batch (a batch-wide statistic?) or splits the batch unevenly. Make the batch "
        "divide by dp, or keep the op out of the data-parallel model.")


def shard(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    if ctx.plan.tp:     # parameter placements along tp first: they may move row-parallel biases
        tensor_parallel.decide(gm, ctx)
    _shard_dp(gm, ctx)
    if ctx.plan.tp:
        tensor_parallel.annotate(gm, ctx)
    return gm


def _shard_dp(gm: fx.GraphModule, ctx: CompileContext) -> None:
    axes, n = ctx.mesh.names, ctx.mesh.axis_size("dp")
    zero3 = ctx.plan.dp == "zero3"
    placed: dict[fx.Node, object] = {}
    for node in gm.graph.nodes:
        val = node.meta.get(meta.VAL)
        if not is_value(val):
            continue
        if node.op == "get_attr":
            info = ctx.params.get(node.meta.get(meta.PARAM, ""))
            placed[node] = Shard(0) if zero3 and info is not None and info.requires_grad \
                and not info.is_buffer else R
        elif node.op == "placeholder":
            placed[node] = Shard(0) if isinstance(val, torch.Tensor) and val.dim() > 0 else R
        elif node.op == "call_function":
            s = _choose(node, placed, n)
            if s is None:
                placed[node] = R if isinstance(val, torch.Tensor) else tuple(R for _ in val)
            else:
                placed[node] = s.output
                node.meta[meta.STRATEGY] = {"dp": s}
        else:
            continue
        node.meta[meta.LAYOUT] = _layout(placed[node], axes)


def _layout(p, axes):
    """The node's Layout (a tuple of them for a multi-output node)."""
    if isinstance(p, tuple):
        return tuple(_layout(x, axes) for x in p)
    return Layout(tuple((a, p if a == "dp" else R) for a in axes))
