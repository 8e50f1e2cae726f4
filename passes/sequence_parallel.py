"""sequence_parallel: fuse each pointwise region that runs on ``Shard(seq)`` into one node.

Under ``Plan(sp=True)`` the shard pass keeps the pointwise regions between tensor-parallel
blocks (norms, bias and residual adds, dropout) on sequence shards, and the collectives pass
bounds each region by a reduce-scatter (entering) and an all-gather (leaving). This pass
makes each contiguous region one ``call_module`` node (``sp_region_<k>``, a GraphModule of
the region's ops): the dump shows one step per region, and a later pass or backend can
compile the region as a unit. It runs after localize, on the rank's localized graph.

A region is a connected set of such ops (edges are data dependencies between members) that
can be one node: the residual stream connects every region, so it is cut where fusing would
make a cycle through the tensor-parallel block between (see ``regions``).
"""
from __future__ import annotations

import torch
from torch import fx
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions, validate_partition

from autopar import meta
from autopar.capture import EXPORT_LOCK
from autopar.context import CompileContext
from autopar.placement import Layout, Shard
from autopar.passes.tensor_parallel import sp_op
from autopar.passes.recompute import node_layer

PREFIX = "sp_region_"


def _member(node: fx.Node) -> bool:
    if node.op != "call_function" or not sp_op(node.target):
        return False
    val, lay = node.meta.get(meta.VAL), node.meta.get(meta.LAYOUT)
    return (isinstance(val, torch.Tensor) and isinstance(lay, Layout) and "tp" in dict(lay.placements)
            and val.dim() >= 2 and lay["tp"] == Shard(val.dim() - 2))


def regions(gm: fx.GraphModule, by_layer: bool = False) -> list[list[fx.Node]]:
    """Groups of sequence-sharded pointwise nodes, in graph order. Each node joins the region(s)
    of its member inputs when the result can still be one node (no path leaves the region and
    comes back, as the residual stream would through a tensor-parallel block); otherwise it
    opens a region. The regions are then exactly the stretches between the collectives.
    ``by_layer`` (under recomputation): a region also ends where a numbered layer does (the
    residual add of one layer and the norm of the next become two regions), so that each
    layer can be recomputed alone, keeping only its input."""
    region: dict[fx.Node, int] = {}
    groups: list[list[fx.Node]] = []
    layer: dict[int, str] = {}
    for n in gm.graph.nodes:
        if not _member(n):
            continue
        key = node_layer(n) if by_layer else None
        cands = sorted({region[a] for a in n.all_input_nodes if a in region
                        and (key is None or layer.get(region[a]) in (None, key))}, reverse=True)
        tries = ([cands] if len(cands) > 1 else []) + [[c] for c in cands]
        for ids in tries:
            merged = [m for i in sorted(ids) for m in groups[i]] + [n]
            if validate_partition(merged):
                keep = min(ids)
                for i in ids:
                    if i != keep:
                        for m in groups[i]:
                            region[m] = keep
                        groups[i] = []
                groups[keep] = sorted(merged, key=_order(gm))
                region[n] = keep
                if key is not None:
                    layer[keep] = key
                break
        else:
            region[n] = len(groups)
            if key is not None:
                layer[len(groups)] = key
            groups.append([n])
    return [g for g in groups if len(g) > 1]


def _order(gm):
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    return pos.__getitem__


def sequence_parallel(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    if not ctx.plan.sp:
        return gm
    ok = regions(gm, by_layer=ctx.plan.recompute != "none")
    ops = [[n.name for n in g] for g in ok]
    metas = [{n.name: dict(n.meta) for n in g} for g in ok]
    with EXPORT_LOCK:     # its proxies read fx's preserved node meta, which an export in another thread sets
        fuse_by_partitions(gm, [dict.fromkeys(g) for g in ok], prefix=PREFIX)
    for k, names in enumerate(ops):
        node = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == f"{PREFIX}{k}")
        sub = gm.get_submodule(node.target)
        out = next(n for n in sub.graph.nodes if n.op == "output").args[0]
        outs = out if isinstance(out, (tuple, list)) else (out,)
        src = [metas[k].get(o.name, {}) for o in outs]
        if len(outs) == 1:
            node.meta.update({key: src[0][key] for key in (meta.VAL, meta.LAYOUT) if key in src[0]})
        else:
            node.meta[meta.VAL] = tuple(m.get(meta.VAL) for m in src)
            node.meta[meta.LAYOUT] = tuple(m.get(meta.LAYOUT) for m in src)
            for u in node.users:
                if u.target.__name__ == "getitem":
                    u.meta.update({key: src[u.args[1]][key] for key in (meta.VAL, meta.LAYOUT) if key in src[u.args[1]]})
        ctx.notes.append(f"{node.target}: {len(names)} sequence-parallel ops fused: {', '.join(names)}")
    gm.graph.lint()
    return gm
