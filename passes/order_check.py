"""order_check: every rank of a dp or tp group will issue the same collectives, or compile fails.

Ranks run one program, but a rank compiled from another model, other example inputs or
another plan would wait forever in a collective its peers never issue. After the passes,
before emit (the first communication of a compile, bar ``plan='auto'``'s broadcast), each
rank lists per mesh axis the collectives its graphs will issue, and one all-gather of the
lists over the world compares them: a mismatch is a ValueError on every rank naming the group
and the first differing collective, instead of a hang. Ranks along ``pp`` run different
stages by design: the schedule's sends and receives are matched by its simulation.
"""
from __future__ import annotations

import torch.distributed as dist
from torch import fx

from autopar import meta
from autopar.context import CompileContext

__all__ = ["collective_sequences", "check_collective_order"]


def collective_sequences(graphs, ctx: CompileContext) -> dict[str, list[str]]:
    """Per mesh axis, the collectives this rank's graphs will issue, in order: the plan, then
    per (graph, its context) every node that communicates (forward, and the backward it
    causes), the ZeRO-3 gather units and the gradient buckets with their members and widths."""
    seq: dict[str, list[str]] = {axis: [f"plan {ctx.plan} on {ctx.mesh}"] for axis in ctx.mesh.axes}
    for gm, gctx in graphs:
        for node in _nodes(gm):
            info = node.meta.get(meta.COMM)
            if info is not None:
                seq.setdefault(info.axis, []).append(f"{node.name}: {info}")
        specs = gctx.shard_specs()
        sharded = gctx.plan.dp != "ddp"
        for kind, groups in (("gather unit", gctx.gather_units), ("gradient bucket", gctx.grad_buckets)):
            for i, names in enumerate(groups):
                width = sum(specs[n].chunk_numel if sharded else specs[n].numel for n in names)
                seq.setdefault("dp", []).append(f"{kind} {i}: {len(names)} tensors, {width} elements/rank "
                                                f"({', '.join(names)})")
    return {axis: s for axis, s in seq.items() if ctx.mesh.axis_size(axis) > 1}


def _nodes(gm: fx.GraphModule):
    """The graph's nodes in order, a fused region's (sp, recompute) in place of its node."""
    for node in gm.graph.nodes:
        sub = gm.get_submodule(node.target) if node.op == "call_module" else None
        sub = getattr(sub, "region", sub)
        if isinstance(sub, fx.GraphModule):
            yield from _nodes(sub)
        else:
            yield node


def check_collective_order(graphs, ctx: CompileContext) -> None:
    """Compare this rank's ``collective_sequences`` with its dp and tp peers' (see the module
    docstring); ``graphs``: (graph module, its context) per graph this rank runs. Every rank of
    the world must call it (one all-gather)."""
    mesh = ctx.mesh
    if mesh.virtual or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = ({a: mesh.coordinate(a) for a in mesh.axes}, collective_sequences(graphs, ctx))
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine)
    for axis in ("dp", "tp"):
        if mesh.axis_size(axis) < 2:
            continue
        groups: dict = {}
        for rank, (coords, _) in enumerate(rows):
            groups.setdefault(tuple(sorted((a, c) for a, c in coords.items() if a != axis)), []).append(rank)
        for members in groups.values():
            first = rows[members[0]][1].get(axis, [])
            for other in members[1:]:
                seq = rows[other][1].get(axis, [])
                if seq == first:
                    continue
                i = next((k for k, (x, y) in enumerate(zip(first, seq)) if x != y), min(len(first), len(seq)))
                a = first[i] if i < len(first) else "nothing (its sequence ends here)"
                b = seq[i] if i < len(seq) else "nothing (its sequence ends here)"
                raise ValueError(
                    f"the ranks of {axis} group {members} would issue different collectives: at collective "
                    f"#{i} on {axis}, rank {members[0]} issues {a!r} but rank {other} issues {b!r} (rank "
                    f"{members[0]}: {len(first)} collectives, rank {other}: {len(seq)}). Running would hang "
                    "there. Every rank must compile the same model with the same example inputs and the same plan.")
