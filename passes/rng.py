"""rng: random sites (dropout) draw the single-device mask and keep this rank's slice.

``find_sites`` runs on the logical graph before anything else (before a pipeline cuts it):
it numbers every random site in forward order (``meta.RNG_SITE``) and lists them in
``ctx.rng_sites`` with the size of the mask one device would draw (a pipeline's graph is one
micro-batch: a site that depends on the batch draws ``microbatches`` times as much). A random
op autopar cannot reproduce is refused there, naming the node.

``rng`` is a pass (after localize): each site becomes a call of the runtime's ``rng_dropout``
/ ``rng_sdpa`` with the emitted module's ``RandomMasks`` (``meta.RNG``), and the slice this rank
keeps is worked out from the node's layout: along the batch dim (the dp strategy's output
placement) the rows of this rank's data-parallel slice (per micro-batch in a pipeline:
``train_step`` cuts the dp slice into micro-batches), then the tp placement's chunk of that.
See ``autopar.runtime.rng`` for the draw itself (one stream per mesh), why it draws whole
masks, and ``Plan(dropout_rng="local")``, under which ``rng_sdpa`` runs torch's fused kernel.
"""
from __future__ import annotations

import math

import torch
from torch import fx

from autopar import meta
from autopar.context import CompileContext
from autopar.ops import dropout_p, random_site
from autopar.placement import Partial, Replicate, Shard
from autopar.runtime.rng import LocalSite, MaskSite, rng_dropout, rng_sdpa
from autopar.sizes import chunk_range
from .analysis import batch_dependent

__all__ = ["find_sites", "rng", "RANDOM_OPS"]


RANDOM_OPS = frozenset({
    "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm", "bernoulli",
    "bernoulli_", "normal", "normal_", "uniform", "uniform_", "exponential_", "geometric_", "cauchy_",
    "log_normal_", "multinomial", "poisson", "native_dropout", "feature_dropout", "alpha_dropout",
    "feature_alpha_dropout", "rrelu", "rrelu_with_noise", "random_"})
"""ATen ops that draw from the generator, besides the sites autopar reproduces."""


def _mask_val(node: fx.Node, kind: str):
    """(shape, dtype) of the mask the site draws at the captured shapes."""
    if kind == "dropout":
        val = node.meta[meta.VAL]
        return tuple(val.shape), val.dtype
    q, k = node.args[0].meta[meta.VAL], node.args[1].meta[meta.VAL]
    return tuple(q.shape[:-1]) + (k.shape[-2],), q.dtype


def find_sites(gm: fx.GraphModule, ctx: CompileContext, microbatches: int = 1) -> None:
    """Number the random sites of the logical graph (``microbatches``: the graph is one
    micro-batch of that many)."""
    batch = batch_dependent(gm.graph)
    sites = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        kind = random_site(node)
        if kind is None:
            name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
            if name in RANDOM_OPS:
                where = (node.meta.get(meta.SOURCE) or "").strip().splitlines()
                raise NotImplementedError(
                    f"node {node.name} ({node.target}) draws random numbers, which autopar reproduces only "
                    "for dropout (nn.Dropout / F.dropout and scaled_dot_product_attention's dropout_p): "
                    "under a distributed layout its draws would not match the single-device model's. "
                    "Replace it with dropout, or move the draw out of the model's forward"
                    + (f"; at {where[-1].strip()}" if where else ""))
            continue
        shape, dtype = _mask_val(node, kind)
        scale = microbatches if node in batch else 1
        node.meta[meta.RNG_SITE] = len(sites)
        sites.append(MaskSite(len(sites), kind, dropout_p(node), math.prod(shape) * scale, dtype))
    ctx.rng_sites = tuple(sites)


def _batch_dim(node: fx.Node) -> int | None:
    s = node.meta.get(meta.STRATEGY, {}).get("dp")
    out = s.output if s is not None else None
    out = out[0] if isinstance(out, tuple) else out
    return out.dim if isinstance(out, Shard) else None


def _local_site(node: fx.Node, kind: str, ctx: CompileContext, in_batch: bool) -> LocalSite:
    """The single-device mask's shape and, per micro-batch, this rank's ranges of it
    (``in_batch``: the site depends on the batch)."""
    shape, _ = _mask_val(node, kind)
    mesh = ctx.mesh
    pipelined = ctx.microbatch_rows > 0
    m = ctx.plan.microbatches if pipelined else 1
    bd = _batch_dim(node)
    if pipelined and m > 1 and in_batch and bd is None:
        raise NotImplementedError(
            f"random site {node.name} ({kind}) depends on the batch, but the data-parallel walk lost the batch's "
            "dim before it (an op on the way has no sharding rule, or its rule cannot follow the batch), so its "
            "mask cannot be cut into micro-batches as one device draws it; add or fix that op's rule in "
            "passes/rules/ (dm.dump() shows each node's dp placement), or train without its dropout")
    n, d = mesh.axis_size("dp"), mesh.coordinate("dp")
    layout = node.meta.get(meta.LAYOUT)
    layout = layout[0] if isinstance(layout, tuple) else layout
    placements = dict(layout.placements) if layout is not None else {}
    for axis, p in placements.items():
        if axis not in ("dp", "tp") and not isinstance(p, (Replicate, Partial)):
            raise NotImplementedError(f"random site {node.name} is split along mesh axis {axis} ({p}); "
                                      "autopar slices masks along dp and tp only")
    tp = placements.get("tp")
    full = list(shape)
    if pipelined and bd is not None:
        full[bd] *= m
    slices = []
    for k in range(m):
        ranges = {dim: (0, size) for dim, size in enumerate(full)}
        if bd is not None:
            if pipelined:    # train_step: dp slice of the batch, then micro-batch k of it
                rows = full[bd] // (n * m)
                lo = d * (full[bd] // n) + k * rows
                ranges[bd] = (lo, lo + rows)
            else:
                ranges[bd] = chunk_range(full[bd], n, d)
        if isinstance(tp, Shard):
            dim = tp.dim % len(full)
            lo, hi = ranges[dim]
            a, b = chunk_range(hi - lo, mesh.axis_size("tp"), mesh.coordinate("tp"))
            ranges[dim] = (lo + a, lo + b)
        slices.append(tuple((dim, lo, hi) for dim, (lo, hi) in ranges.items() if (lo, hi) != (0, full[dim])))
    return LocalSite(tuple(full), tuple(slices))


def rng(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    """Each random site of this rank's graph calls the runtime with its slice of the mask."""
    sites = [n for n in gm.graph.nodes if meta.RNG_SITE in n.meta and random_site(n) is not None]
    if not sites:
        return gm
    gm.add_submodule(meta.RNG, torch.nn.Module())   # stand-in: emit binds the RandomMasks
    first = next(iter(gm.graph.nodes))
    with gm.graph.inserting_before(first):
        masks = gm.graph.get_attr(meta.RNG)
    batch = batch_dependent(gm.graph)
    for node in sites:
        kind, index = random_site(node), node.meta[meta.RNG_SITE]
        ctx.rng_local[index] = _local_site(node, kind, ctx, node in batch)
        with gm.graph.inserting_before(node):
            if kind == "dropout":
                new = gm.graph.call_function(rng_dropout, (node.args[0], masks, index))
            else:
                a, kw = node.args, node.kwargs
                attn_mask = a[3] if len(a) > 3 else kw.get("attn_mask")
                causal = a[5] if len(a) > 5 else kw.get("is_causal", False)
                new = gm.graph.call_function(rng_sdpa, (a[0], a[1], a[2], attn_mask, masks, index, dropout_p(node),
                                                        causal), {"scale": kw.get("scale"),
                                                                  "enable_gqa": kw.get("enable_gqa", False)})
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        name = node.name
        gm.graph.erase_node(node)
        new._rename(name)       # the logical node's name: dumps and verify line up
    gm.graph.lint()
    return gm
