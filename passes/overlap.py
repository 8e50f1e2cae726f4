"""overlap: split collectives into an asynchronous start and a wait, issue early, wait late.

    tp_all_reduce / tp_gather / tp_reduce_scatter(x)
        ->  h = tp_start(kind, x, ...)  ...  y = tp_wait(h)
        the start right after ``x`` is computed, the wait right before the first node that
        reads ``y``: whatever runs in between runs while the transfer travels
    ZeRO-3 gather unit k (the ``dp_gather`` nodes of one layer)
        ->  dp_unit_start(sync, k)  ...  dp_unit_wait(sync, k)
        the wait before the unit's first ``dp_gather``; the start after the wait of unit j,
        the earliest j whose units j+1..k, issued ahead of their use, fit in
        ``plan.prefetch_bytes`` (None: j = k-1, one unit ahead, as FSDP's default; a unit
        larger than the budget is issued right before its wait), and never so far that every
        unit would be gathered at once (at most units - 2 ahead of the one in use)
    tp_copy(x) -> linear (Megatron's f before a column product)
        ->  tp_copy_linear(x, w, b): backward issues x's gradient all-reduce, computes the
        weight gradient while it travels, then waits (Megatron's asynchronous all-reduce)
    plan.collective_matmul (tp + sp)
        tp_gather(x) -> linear      =>  all_gather_matmul(x, w, b)
        linear -> tp_reduce_scatter =>  matmul_reduce_scatter(x, w, b)
        (``autopar.runtime.collmatmul``: the matmul of one chunk overlaps the ring transfer of the next)

With ``plan.overlap`` off every start sits right before its wait, so nothing overlaps: the
baseline the pass is measured against. Backward collectives come from autograd: gradient
buckets are launched as they fill and ZeRO-3 re-gathers ahead by the runtime
(``autopar.runtime.dpsync``) under the same flag and budget.

Bytes issued ahead count the gathered unit and its send buffer: (N + 1)/N of the unit's
parameters. Every rank runs the same graph, so every rank issues the same collectives in the
same order; the order_check pass verifies it before the first step.
"""
from __future__ import annotations

import torch
from torch import fx

from autopar import meta
from autopar.context import CompileContext
from autopar.runtime.collmatmul import all_gather_matmul, matmul_reduce_scatter
from autopar.runtime.dpsync import dp_gather, dp_unit_start, dp_unit_wait
from autopar.runtime.tpcomm import (tp_all_reduce, tp_copy, tp_copy_linear, tp_gather, tp_reduce_scatter, tp_start,
                                    tp_wait)
from autopar.sizes import gather_unit_bytes

__all__ = ["overlap", "unit_ahead_bytes"]


def overlap(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    if ctx.plan.collective_matmul:
        n = _fuse_collective_matmuls(gm.graph, ctx.mesh.axis_size("tp"))
        ctx.notes.append(f"collective matmul: {n} all-gather/reduce-scatter + matmul pairs run as ring steps")
    n_tp = _split_tp(gm.graph, ctx.plan.overlap)
    n_f = _fuse_copy_linear(gm.graph) if ctx.plan.overlap else 0
    n_units = _place_unit_gathers(gm, ctx) if ctx.plan.dp == "zero3" else 0
    if n_tp or n_units or n_f:
        how = "issued early, waited late" if ctx.plan.overlap else "each waited on at once (overlap off)"
        ctx.notes.append(f"overlap: {n_tp} forward tp collectives and {n_units} ZeRO-3 unit gathers split into "
                         f"start/wait, {how}; {n_f} backward all-reduces of Megatron's f under their "
                         "linear's weight gradient")
    gm.graph.lint()
    return gm


# ---- tensor parallel ------------------------------------------------------------------------

def _split_tp(g: fx.Graph, on: bool) -> int:
    kinds = {tp_all_reduce: "all_reduce", tp_gather: "all_gather", tp_reduce_scatter: "reduce_scatter"}
    order = {n: i for i, n in enumerate(g.nodes)}
    count = 0
    for node in list(g.nodes):
        kind = kinds.get(node.target) if node.op == "call_function" else None
        if kind is None:
            continue
        x = node.args[0]
        with g.inserting_before(node):
            start = g.create_node("call_function", tp_start, (kind,) + tuple(node.args), name=f"{node.name}_start")
            wait = g.create_node("call_function", tp_wait, (start,), name=f"{node.name}_wait")
        start.meta[meta.COMM] = node.meta.get(meta.COMM)
        wait.meta.update({k: v for k, v in node.meta.items() if k != meta.COMM})
        node.replace_all_uses_with(wait)
        g.erase_node(node)
        if on:
            x.append(start)     # issue as soon as the input exists
            users = sorted(wait.users, key=lambda u: order.get(u, len(order)))
            if users:
                users[0].prepend(wait)     # wait only when the result is read
        count += 1
    return count


def _fuse_collective_matmuls(g: fx.Graph, t: int) -> int:
    """tp_gather -> linear (its only reader; the gradient is a sum over tp) becomes
    all_gather_matmul; linear without bias -> tp_reduce_scatter (its only reader, along a dim
    that divides by tp) becomes matmul_reduce_scatter."""
    linear = torch.ops.aten.linear.default
    count = 0
    for node in list(g.nodes):
        users = list(node.users)
        if node.op != "call_function" or len(users) != 1:
            continue
        user = users[0]
        if node.target is tp_gather and user.target is linear and user.args[0] is node and node.args[4] \
                and node.args[2] not in (-1, node.meta[meta.VAL].dim() - 1):
            x, comm, dim, size = node.args[:4]
            w, b = user.args[1], (user.args[2] if len(user.args) > 2 else None)
            fn, args, kwargs, comm_node = all_gather_matmul, (x, w, b, comm, dim), {"size": size}, node
        elif node.target is linear and user.target is tp_reduce_scatter and user.args[3] % t == 0 \
                and (len(node.args) < 3 or node.args[2] is None):
            x, w = node.args[:2]
            fn, args, kwargs, comm_node = matmul_reduce_scatter, (x, w, None, user.args[1], user.args[2]), {}, user
        else:
            continue
        _fuse_pair(g, node, user, fn, args, kwargs, comm_node, f"{user.name}_{fn.__name__}")
        count += 1
    return count


def _fuse_pair(g: fx.Graph, first: fx.Node, second: fx.Node, fn, args, kwargs, comm_node: fx.Node, name: str) -> None:
    """Replace ``first`` and its only reader ``second`` by one ``fn`` node where ``second`` was,
    with ``second``'s value and layout and ``comm_node``'s collective."""
    with g.inserting_before(second):
        fused = g.create_node("call_function", fn, args, kwargs, name=name)
    fused.meta.update({k: v for k, v in second.meta.items() if k != meta.COMM})
    fused.meta[meta.COMM] = comm_node.meta.get(meta.COMM)
    second.replace_all_uses_with(fused)
    g.erase_node(second)
    g.erase_node(first)


def _fuse_copy_linear(g: fx.Graph) -> int:
    """tp_copy(x) read only by a linear (Megatron's f before a column product) becomes
    tp_copy_linear: in backward the input gradient's all-reduce is issued before the weight
    gradient is computed and waited on after it."""
    count = 0
    for node in list(g.nodes):
        if node.op != "call_function" or node.target is not tp_copy or len(node.users) != 1:
            continue
        (lin,) = node.users
        if lin.target is not torch.ops.aten.linear.default or lin.args[0] is not node or node in lin.args[1:]:
            continue
        x, comm = node.args
        w, b = lin.args[1], (lin.args[2] if len(lin.args) > 2 else None)
        _fuse_pair(g, node, lin, tp_copy_linear, (x, w, b, comm), {}, node, f"{lin.name}_f")
        count += 1
    return count


# ---- ZeRO-3 ---------------------------------------------------------------------------------

def unit_ahead_bytes(ctx: CompileContext) -> list[int]:
    """Bytes each unit's gather holds while in flight (``sizes.gather_unit_bytes``)."""
    specs = ctx.shard_specs()
    return [gather_unit_bytes(sum(specs[n].padded_numel for n in unit), specs[unit[0]].n,
                              ctx.params[unit[0]].dtype.itemsize) for unit in ctx.gather_units]


def _issue_after(sizes: list[int], k: int, budget) -> int:
    """The unit j after whose wait unit k's gather is issued (-1: at the start of forward;
    k: right before its own wait). Never more than len(sizes) - 2 units ahead: with the unit
    in use, some unit is always not gathered."""
    most = max(len(sizes) - 2, 0)
    if budget is None:
        return k - 1 if most >= 1 else k
    j, ahead = k, 0
    while j - 1 >= -1 and ahead + sizes[j] <= budget and k - j + 1 <= most:
        ahead += sizes[j]
        j -= 1
    return j


def _place_unit_gathers(gm: fx.GraphModule, ctx: CompileContext) -> int:
    g = gm.graph
    unit_of = {name: k for k, unit in enumerate(ctx.gather_units) for name in unit}
    first: dict[int, fx.Node] = {}
    for node in g.nodes:
        if node.op == "call_function" and node.target is dp_gather:
            first.setdefault(unit_of[node.args[2]], node)
    if not first:
        return 0
    sync = next(n for n in g.nodes if n.op == "get_attr" and n.target == meta.SYNC)
    sizes = unit_ahead_bytes(ctx)
    units = sorted(first, key=lambda k: list(g.nodes).index(first[k]))
    waits: dict[int, fx.Node] = {}
    anchor: dict[int, fx.Node] = {-1: sync}      # the last node placed after unit j's wait
    last = -1     # gathers are issued in unit order: a unit never goes out before the one above
    placed: list[str] = []
    for pos, k in enumerate(units):
        with g.inserting_before(first[k]):
            waits[k] = g.create_node("call_function", dp_unit_wait, (sync, k), name=f"unit{k}_wait")
        start = g.create_node("call_function", dp_unit_start, (sync, k), name=f"unit{k}_start")
        j = _issue_after([sizes[u] for u in units], pos, ctx.plan.prefetch_bytes) if ctx.plan.overlap else pos
        j = last = max(j, last)
        if j >= pos:
            waits[k].prepend(start)
            placed.append(f"{k}: at its use")
        else:
            key = units[j] if j >= 0 else -1
            after = anchor.get(key, waits.get(key))
            after.append(start)
            anchor[key] = start
            placed.append(f"{k}: {'as forward starts' if key == -1 else f'at unit {key} wait'}")
    budget = ctx.plan.prefetch_bytes
    ctx.notes.append(f"ZeRO-3 gathers issued (prefetch {'one unit' if budget is None else f'{budget:,} B'}"
                     f"{'' if ctx.plan.overlap else ', overlap off'}): unit " + "; ".join(placed))
    return len(units)
