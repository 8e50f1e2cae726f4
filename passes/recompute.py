"""recompute: activation recomputation as regions of the forward graph that keep only their inputs.

Under ``Plan(recompute=...)`` the rank's final graph (after overlap, so that the tp
collectives inside a region keep their start / wait placement) is cut into regions, each made
one ``call_module`` node whose module is ``runtime.recompute.Recomputed``: forward runs the
region without keeping its activations, backward runs it again from its inputs.

    full        each numbered layer (``blocks.3``, the layer ZeRO-3 gathers as one unit and the
                cost model prices as one group) is a region: it keeps its inputs (the layer's
                input; under sp the sequence shard), everything inside is recomputed
    selective   each layer's attention core (Korthikanti et al. 2023, section 5): the score
                product q·kᵀ, its scaling and mask, softmax, dropout and the product with v
                (or one ``scaled_dot_product_attention`` node that runs the math kernel:
                dropout in training) is a region: q, k, v are kept, the a·s² tensors are not
    a budget    ``ctx.recompute_layers`` (worked out by the compile driver from the cost model)
                says per layer ``none``, ``selective`` or ``full``

A layer is the span of nodes from the first to the last one that its module ran (export's
``nn_module_stack``; inserted collectives and sp regions take the layer of what they read);
every node in the span joins the region except the data-parallel runtime's (ZeRO-3's gathers,
releases and unit start / wait, the gradient buckets): the gathered parameters enter the
region as inputs, so the recomputation reads them through ZeRO-3's saved-tensor tokens and
backward gathers a unit once, not twice. ``dp_release`` marks a parameter's last forward use:
it moves after the region. The "pre" part (embeddings) and "post" part (final norm, head,
loss) are not recomputed.
"""
from __future__ import annotations

import logging
import operator

import torch
from torch import fx

from autopar import meta
from autopar.context import CompileContext, layer_key
from autopar.ops import MATMULS, op_name
from autopar.runtime.dpsync import dp_bucket_sync, dp_gather, dp_release, dp_unit_start, dp_unit_wait
from autopar.runtime.recompute import Recomputed
from autopar.runtime.rng import rng_dropout, rng_sdpa

__all__ = ["recompute", "node_layer", "layer_of_nodes", "attention_cores", "PREFIX"]

PREFIX = "recompute_"
log = logging.getLogger("autopar")
_DP = frozenset({dp_gather, dp_release, dp_unit_start, dp_unit_wait, dp_bucket_sync})


def node_layer(node: fx.Node):
    """The numbered layer whose module ran ``node`` (export's ``nn_module_stack``); ``""`` for a
    node the model ran outside every numbered layer (embeddings, the head); None for a node
    without that record (one a pass inserted)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    for path, _ in reversed(list(stack.values())):
        key = layer_key(path)
        if key:
            return key
    return ""


def layer_of_nodes(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """node -> its numbered layer: the module that ran it, or for an inserted node (a
    collective, a fused sp region) the layer of the nodes inside it or of what it reads."""
    out: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_module"):
            continue
        key = node_layer(node)
        if key is None and node.op == "call_module":
            sub = gm.get_submodule(node.target)
            if isinstance(sub, fx.GraphModule):
                keys = [k for k in map(node_layer, sub.graph.nodes) if k is not None]
                key = keys[0] if keys else None
        if key is None:      # inserted: the layer of what it reads
            keys = [out[a] for a in node.all_input_nodes if a in out]
            key = keys[-1] if keys else None
        if key is not None:
            out[node] = key
    return {n: k for n, k in out.items() if k}


def _is_dp(node: fx.Node) -> bool:
    return node.op == "call_function" and (node.target in _DP or (
        node.target is operator.getitem and node.args[0].op == "call_function"
        and node.args[0].target is dp_bucket_sync))


def _scores_numel(node: fx.Node) -> int:
    val = node.meta.get(meta.VAL)
    return val.numel() if isinstance(val, torch.Tensor) else -1


def attention_cores(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """The attention cores of the graph: per softmax, the chain of nodes of the scores' size
    from the q·kᵀ product to the product with v (both included); and each attention node that
    keeps its a·s² probabilities (the math kernel: ``rng_sdpa``, dropout in training)."""
    cores = []
    taken: set = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or node in taken:
            continue
        if node.target is rng_sdpa:
            cores.append([node])
            taken.add(node)
            continue
        if op_name(node.target) not in ("softmax", "_softmax", "_safe_softmax"):
            continue
        size = _scores_numel(node)
        members, todo = {node}, [node]
        while todo:                       # back to the score product
            n = todo.pop()
            for a in n.all_input_nodes:
                if a.op != "call_function" or a in members or _is_dp(a):
                    continue
                if op_name(a.target) in MATMULS and _scores_numel(a) == size:
                    members.add(a)        # q·kᵀ: its inputs are kept
                elif _scores_numel(a) == size:
                    members.add(a)
                    todo.append(a)
        todo = [node]
        while todo:                       # forward to the product with v
            n = todo.pop()
            for u in n.users:
                if u.op != "call_function" or u in members:
                    continue
                if op_name(u.target) in MATMULS:
                    members.add(u)        # probs·v: its result leaves the core
                elif _scores_numel(u) == size or u.target is rng_dropout:
                    members.add(u)
                    todo.append(u)
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        core = sorted(members, key=order.__getitem__)
        taken |= members
        cores.append(core)
    return cores


def _layer_spans(gm: fx.GraphModule, layers: dict[fx.Node, str]) -> dict[str, list[fx.Node]]:
    """Per numbered layer, the recomputable nodes from its first to its last node (spans in
    graph order, each ending where the next begins)."""
    nodes = list(gm.graph.nodes)
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, n in enumerate(nodes):
        key = layers.get(n)
        if key is not None:
            first.setdefault(key, i)
            last[key] = i
    spans = {}
    order = sorted(first, key=first.__getitem__)
    for j, key in enumerate(order):
        end = last[key]
        if j + 1 < len(order):
            end = min(end, first[order[j + 1]] - 1)
        spans[key] = [n for n in nodes[first[key]:end + 1]
                      if n.op in ("call_function", "call_module") and not _is_dp(n)]
    return spans


def _close(members: list[fx.Node], gm: fx.GraphModule) -> list[fx.Node]:
    """Members plus the users that must run inside the region: a region hands only tensors out
    (a collective's pending handle stays inside, with its wait)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    inside = set(members)
    changed = True
    while changed:
        changed = False
        for n in list(inside):
            if isinstance(n.meta.get(meta.VAL), torch.Tensor):
                continue
            for u in n.users:
                if u not in inside and u.op in ("call_function", "call_module") and not _is_dp(u):
                    inside.add(u)
                    changed = True
    return sorted(inside, key=order.__getitem__)


def _random_site(n: fx.Node):
    """(the RandomMasks node, the site index) of a dropout site's node, else None."""
    if n.op != "call_function" or n.target not in (rng_dropout, rng_sdpa):
        return None
    at = 1 if n.target is rng_dropout else 4
    holder = n.args[at] if len(n.args) > at else n.kwargs.get("masks")
    site = n.args[at + 1] if len(n.args) > at + 1 else n.kwargs.get("site")
    return (holder, site) if isinstance(site, int) else None


def _sites_in(gm: fx.GraphModule, nodes) -> set:
    """The random sites ``nodes`` draw from, inside the fused regions among them too (sequence
    parallelism's pointwise regions hold the dropouts between its collectives)."""
    out = set()
    for n in nodes:
        site = _random_site(n)
        if site is not None:
            out.add(site[1])
        elif n.op == "call_module":
            sub = gm.get_submodule(n.target)
            inner = sub.region if isinstance(sub, Recomputed) else sub
            if isinstance(inner, fx.GraphModule):
                out |= _sites_in(inner, inner.graph.nodes)
    return out


def _fuse(gm: fx.GraphModule, members: list[fx.Node], name: str, layer: str, kind: str, replayed: set) -> fx.Node:
    """Make ``members`` (in graph order) one call_module node ``name`` running a ``Recomputed``;
    the random sites among them go to ``replayed`` (``RandomMasks.replayed``)."""
    g = gm.graph
    inside = set(members)
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[fx.Node] = []

    def arg(a: fx.Node) -> fx.Node:
        if a in env:
            return env[a]
        ph = sub.placeholder(a.name)
        ph.meta.update(a.meta)
        inputs.append(a)
        env[a] = ph
        return ph

    for n in members:
        for a in n.all_input_nodes:
            if a not in inside:
                arg(a)
        env[n] = sub.node_copy(n, lambda a: env[a])
    outputs = [n for n in members if any(u not in inside for u in n.users)]
    sub.output(tuple(env[n] for n in outputs))
    region = fx.GraphModule(gm, sub, class_name="Region")
    gm.add_submodule(name, Recomputed(region, layer, kind))
    replayed.update(_sites_in(gm, members))   # the region's dropout masks: drawn again where used
    last = members[-1]
    with g.inserting_after(last):
        call = g.call_module(name, tuple(inputs))
    call.meta[meta.VAL] = tuple(n.meta.get(meta.VAL) for n in outputs)
    with g.inserting_after(call):
        for i, n in enumerate(outputs):
            item = g.call_function(operator.getitem, (call, i))
            item.meta.update({k: v for k, v in n.meta.items() if k in (meta.VAL, meta.LAYOUT)})
            n.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
    for n in reversed(members):
        g.erase_node(n)
    _move_releases_after(g, call, inputs)
    return call


def _move_releases_after(g: fx.Graph, call: fx.Node, inputs: list[fx.Node]) -> None:
    """``dp_release`` of a parameter the region reads marks its last forward use: after the region."""
    pos = {n: i for i, n in enumerate(g.nodes)}
    for a in inputs:
        for u in list(a.users):
            if u.op == "call_function" and u.target is dp_release and pos[u] < pos[call]:
                call.append(u)


def recompute(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    mode = ctx.plan.recompute
    layers = layer_of_nodes(gm)
    spans = _layer_spans(gm, layers)
    choice = {key: mode for key in spans} if isinstance(mode, str) else ctx.recompute_layers
    fused = 0
    for key, members in spans.items():
        kind = choice.get(key, "none")
        if kind == "none" or not members:
            continue
        if kind == "full":
            regions = [_close(members, gm)]
        else:
            span = set(members)
            regions = [core for core in attention_cores(gm) if set(core) <= span]
        for region in regions:
            call = _fuse(gm, region, f"{PREFIX}{fused}", key, kind, ctx.rng_replayed)
            ctx.recomputed.append((call.target, key, kind, [n.name for n in region]))
            fused += 1
    if fused:
        ctx.notes.append(f"recompute: {fused} regions recomputed in backward "
                         f"({', '.join(sorted(set(k for _, _, k, _ in ctx.recomputed)))})")
    elif any(k != "none" for k in choice.values()) or (isinstance(mode, str) and not spans):
        why = ("the graph has no numbered layer (a module list of blocks, e.g. blocks.0)" if not spans else
               "no layer has an attention core that keeps its a·s² scores (a fused attention kernel keeps "
               "none: there is nothing for selective recomputation to drop)")
        msg = f"Plan(recompute={mode!r}) recomputes nothing: {why}"
        log.warning("autopar: %s", msg)
        ctx.notes.append(f"warning: {msg}")
    gm.graph.lint()
    return gm
