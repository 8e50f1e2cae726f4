"""shard: annotate every node with its layout, one placement per mesh axis.

Parameters take the layout the plan stores them in (ZeRO-3: ``dp:S(0)``, else ``dp:R``);
inputs are this rank's slice of the batch (``dp:S(0)``). The batch shard is then followed
through the graph by small per-op-family rules that say where the sharded dim goes (kept by
pointwise ops, moved by transpose/permute, carried through merged or split dims by
view/reshape, turned ``Partial`` by a reduction over it). An op without a rule whose output
dim cannot be matched is marked ``R`` with a warning naming it, so the gap is visible.

This pass covers the data-parallel axis on the graph captured at this rank's batch slice
(the batch always divides by dp, so the shard is even). The sharding-rule registry
(``autopar.passes.rules``), written for the logical graph at global shapes, replaces these
rules once capture keeps global shapes and a localize step rewrites size arguments per rank.
"""
from __future__ import annotations

import logging
import math
import operator

import torch
from torch import fx

from autopar import meta
from autopar.context import CompileContext
from autopar.placement import Layout, Partial, Replicate, Shard

log = logging.getLogger("autopar")
aten = torch.ops.aten

_REDUCTIONS = {aten.sum.dim_IntList: "sum", aten.mean.dim: "avg", aten.sum.default: "sum",
               aten.mean.default: "avg", aten.amax.default: "max", aten.amin.default: "min"}
_LOSS = {aten.cross_entropy_loss.default, aten.nll_loss.default, aten.mse_loss.default}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
          aten.flatten.using_ints, aten.unflatten.int, aten.expand.default}


def _shape(x):
    v = x.meta.get(meta.VAL) if isinstance(x, fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _sharded_input(node: fx.Node, dp: dict):
    """(arg node, placement) of the first tensor input that is not Replicate on the axis.
    Parameters are skipped: every dp mode hands consumers the whole parameter."""
    for a in node.all_input_nodes:
        if a.op == "get_attr":
            continue
        p = dp.get(a)
        if p is not None and not isinstance(p, Replicate):
            return a, p
    return None, None


def _map_view(in_shape, out_shape, d):
    """Output dim that starts where input dim ``d`` starts, if the view keeps ``d`` outermost
    in it (merged with inner dims, or split with its leading factor kept)."""
    prefix, acc = math.prod(in_shape[:d]), 1
    for od, size in enumerate(out_shape):
        if acc == prefix and size != 1:
            return od if size % in_shape[d] == 0 or in_shape[d] % size == 0 else None
        acc *= size
        if acc > prefix:
            return None
    return None


def _rule(node: fx.Node, dp: dict):
    """Placement of ``node``'s output on the data-parallel axis."""
    src, p = _sharded_input(node, dp)
    if src is None:
        return Replicate()
    out, inp = _shape(node), _shape(src)
    if isinstance(p, Partial):   # a sum of addends stays one under negation and a replicated factor
        others = [dp.get(a, Replicate()) for a in node.all_input_nodes if a is not src and a.op != "get_attr"]
        linear = node.target == aten.neg.default or (
            node.target in (aten.mul.Tensor, aten.div.Tensor) and all(isinstance(o, Replicate) for o in others)
            and (node.target == aten.mul.Tensor or src is node.args[0]))
        return p if linear and p.op in ("sum", "avg") else None
    d = p.dim
    t = node.target
    if t in _REDUCTIONS:
        dims = node.args[1] if len(node.args) > 1 and node.args[1] is not None else range(len(inp))
        dims = [x % len(inp) for x in dims]
        if d in dims:
            return Partial(_REDUCTIONS[t])
        keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        return Shard(d if keep else d - sum(1 for x in dims if x < d))
    if t in _LOSS:
        reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)
        return {0: Shard(d), 1: Partial("avg"), 2: Partial("sum")}[reduction]
    if t in (aten.transpose.int, aten.t.default):
        a, b = (node.args[1], node.args[2]) if t == aten.transpose.int else (0, 1)
        a, b = a % len(inp), b % len(inp)
        return Shard(b if d == a else a if d == b else d)
    if t in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
        dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % len(inp)
        return Shard(d) if dim != d else None   # every piece keeps the batch shard
    if t == aten.permute.default:
        return Shard([x % len(inp) for x in node.args[1]].index(d))
    if t in _VIEWS and out is not None:
        od = _map_view(inp, out, d)
        return Shard(od) if od is not None else None
    if t == aten.embedding.default:   # (weight, indices): indices dims lead the output
        return Shard(d) if src is node.args[1] else None
    if out is not None and len(out) >= len(inp):   # pointwise, broadcasting, matmul-like, sdpa
        od = d + len(out) - len(inp)
        if t in (aten.linear.default, aten.matmul.default, aten.mm.default, aten.bmm.default,
                 aten.addmm.default, aten.scaled_dot_product_attention.default):
            od = d  # leading (batch) dims keep their place
        if od < len(out) and out[od] == inp[d]:
            return Shard(od)
    return None


def shard(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    axes = ctx.mesh.names
    zero3 = ctx.plan.dp == "zero3"
    dp: dict[fx.Node, object] = {}
    for node in gm.graph.nodes:
        val = node.meta.get(meta.VAL)
        if node.op == "get_attr":
            info = ctx.params.get(node.meta.get(meta.PARAM, ""))
            dp[node] = Shard(0) if zero3 and info is not None and not info.is_buffer else Replicate()
        elif node.op == "placeholder":
            dp[node] = Shard(0) if isinstance(val, torch.Tensor) and val.dim() > 0 else Replicate()
        elif node.op == "call_function" and node.target is operator.getitem:
            dp[node] = dp.get(node.args[0], Replicate())
        elif node.op == "call_function":
            if not isinstance(val, (torch.Tensor, tuple, list)):
                continue
            p = _rule(node, dp)
            if p is None:
                log.warning("autopar: no layout rule maps the batch shard through %s (node %s); "
                            "marking it replicated", node.target, node.name)
                p = Replicate()
            dp[node] = p
        else:
            continue
        node.meta[meta.LAYOUT] = Layout(tuple((a, dp[node] if a == "dp" else Replicate()) for a in axes))
    return gm
