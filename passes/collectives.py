"""collectives: insert the communication the layouts need.

For the data-parallel axis every consumer needs its parameters whole (``dp:R``):

    zero3      the stored ``S(0)`` shard is all-gathered right before its first use
               (``dp_gather``) and released after its last forward use (``dp_release``);
               backward gathers again what it reads and reduce-scatters the gradient
    zero1/2    forward reads the full replicas; one ``dp_bucket_sync`` node per gradient
               bucket reduce-scatters their gradients into the rank's shards
    ddp        one ``dp_bucket_sync`` node per bucket all-reduces its gradients

(when each collective starts and is waited on is the overlap pass's and the runtime's
business: a bucket goes out as soon as its gradients are ready)

A replicated activation that a node's strategy wants sharded (a mask built for the whole
batch, meeting this rank's slice) is sliced locally (``dp_local_chunk``, no communication).

It also fixes the units of communication (``autopar.sizes``, whose cut the cost model prices
too): ZeRO-3 gathers parameters a unit at a time (one numbered layer, cut at
``plan.bucket_bytes``: ``sizes.gather_units``, ``ctx.gather_units``) and reduces each unit's
gradients together; the other modes bucket gradients in reverse order of first use, the order
they become ready, the first bucket at 1 MiB (``sizes.grad_buckets``, ``ctx.grad_buckets``).
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from autopar import meta
from autopar.context import CompileContext, layer_key
from autopar.meta import COMM_TP, REPLICAS, SYNC, CommInfo
from autopar.placement import Layout, Partial, Replicate, Shard
from autopar.runtime.dpsync import dp_bucket_sync, dp_gather, dp_local_chunk, dp_release
from autopar.runtime.tpcomm import (tp_all_reduce, tp_copy, tp_gather, tp_param_sync, tp_reduce_scatter, tp_split,
                                    tp_vocab_cross_entropy, tp_vocab_embedding)
from autopar.sizes import chunk_range, gather_units, grad_buckets, local_size, ring_bytes, unit_grad_buckets

from .analysis import input_nodes
from .lm_head import CE_VALUES
from .tensor_parallel import varying as _varying


def _bucket_sizes(order: list[str], ctx: CompileContext, specs) -> tuple[dict, dict]:
    """(padded bytes, dtype) of each parameter of ``order``: what ``sizes.grad_buckets`` and
    ``sizes.gather_units`` cut by."""
    return ({x: specs[x].padded_numel * ctx.params[x].dtype.itemsize for x in order},
            {x: ctx.params[x].dtype for x in order})


def collectives(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    g = gm.graph
    specs = ctx.shard_specs()
    position = {nd: i for i, nd in enumerate(g.nodes)}
    used = [nd for nd in g.nodes if nd.op == "get_attr" and nd.meta.get(meta.PARAM) in specs and nd.users]
    used.sort(key=lambda nd: min(position[u] for u in nd.users))     # order of first use
    params = {nd.meta[meta.PARAM]: nd for nd in used}
    order = list(params)
    nbytes, dtypes = _bucket_sizes(order, ctx, specs)
    if ctx.plan.dp == "zero3":
        ctx.gather_units = gather_units(order, nbytes, ctx.plan.bucket_bytes, layer_key, dtypes)
        ctx.grad_buckets = unit_grad_buckets(ctx.gather_units)
    else:
        ctx.grad_buckets = grad_buckets(order, nbytes, ctx.plan.bucket_bytes, dtypes)
    _insert_local_slices(gm, ctx)
    if ctx.plan.tp:
        _insert_tp_redistributions(gm, ctx)
        _reshape_permuted_views(gm)
    gm.add_submodule(SYNC, torch.nn.Module())   # stand-in: emit binds the DataParallelSync
    with g.inserting_before(next(iter(g.nodes))):
        sync = g.get_attr(SYNC)
    if ctx.plan.dp == "zero3":
        _insert_gathers(gm, ctx, params, specs, sync)
    elif ctx.plan.dp == "ddp" and ctx.mesh.axis_size("dp") == 1 and ctx.plan.pp_schedule is not None:
        # a pipeline stage with nothing to reduce: autograd accumulates the micro-batches'
        # gradients into .grad itself (no bucket holds a micro-batch's gradients)
        ctx.grad_buckets = []
        _insert_compute_casts(gm, ctx, params)
    else:
        _insert_bucket_syncs(gm, ctx, params, specs, sync)
    g.lint()
    return gm


def _insert_compute_casts(gm, ctx, params) -> None:
    """Mixed precision where no dp node hands the parameters over (a pipeline stage on dp=1):
    forward reads each master through a cast to the compute dtype, whose backward hands the
    master its gradient in the master's dtype (micro-batches accumulate there)."""
    if not ctx.plan.mixed:
        return
    g = gm.graph
    position = {nd: i for i, nd in enumerate(g.nodes)}
    for name, pnode in params.items():
        users = list(pnode.users)
        with g.inserting_before(min(users, key=position.__getitem__)):
            cast = g.call_function(torch.ops.aten._to_copy.default, (pnode,), {"dtype": ctx.plan.param_dtype})
        cast.meta.update({meta.VAL: pnode.meta.get(meta.VAL), meta.LAYOUT: pnode.meta.get(meta.LAYOUT)})
        for u in users:
            u.replace_input_with(pnode, cast)


def _insert_local_slices(gm, ctx) -> None:
    """Where a node's strategy wants a replicated activation sharded (a mask built for the
    whole batch meeting this rank's slice), slice it locally: no communication, and plain
    autograd backward (the gradient is this rank's part, as data parallelism's is)."""
    n, index = ctx.mesh.axis_size("dp"), ctx.mesh.coordinate("dp")
    if "dp" not in ctx.mesh.axes:
        return
    for node in list(gm.graph.nodes):
        strategy = node.meta.get(meta.STRATEGY, {}).get("dp")
        if strategy is None:
            continue
        for src, want in zip(input_nodes(node), strategy.inputs):
            have = src.meta.get(meta.LAYOUT)
            if not isinstance(want, Shard) or not isinstance(have, Layout) or have["dp"] != Replicate():
                continue
            with gm.graph.inserting_before(node):
                part = gm.graph.call_function(dp_local_chunk, (src, want.dim, n, index))
            part.meta.update({meta.VAL: src.meta[meta.VAL], meta.LAYOUT: have.replace("dp", want)})
            node.replace_input_with(src, part)


def _insert_gathers(gm, ctx, params, specs, sync) -> None:
    """ZeRO-3: gather each parameter before its first use, release it after its last."""
    g, n = gm.graph, ctx.mesh.axis_size("dp")
    position = {nd: i for i, nd in enumerate(g.nodes)}
    bucket_of = {name: i for i, b in enumerate(ctx.grad_buckets) for name in b}
    unit_of = {name: i for i, u in enumerate(ctx.gather_units) for name in u}
    for name, pnode in params.items():
        users = list(pnode.users)
        with g.inserting_before(min(users, key=position.__getitem__)):
            full = g.create_node("call_function", dp_gather, (pnode, sync, name), name=f"{pnode.name}_full")
        full.meta.update({meta.VAL: pnode.meta.get(meta.VAL), meta.LAYOUT: _whole_dp(pnode, ctx),
                          meta.COMM: _unit_info(ctx.gather_units, unit_of[name], name, specs, ctx, n,
                                                bucket_of[name])})
        for u in users:
            u.replace_input_with(pnode, full)
        with g.inserting_after(max(users, key=position.__getitem__)):
            g.call_function(dp_release, (full, sync, name))


def _insert_bucket_syncs(gm, ctx, params, specs, sync) -> None:
    """ddp / ZeRO-1/2: one node per gradient bucket, before the first use of any member; it
    hands forward the full parameters (ZeRO-1/2: the replicas) and reduces their gradients."""
    g, mode, n = gm.graph, ctx.plan.dp, ctx.mesh.axis_size("dp")
    position = {nd: i for i, nd in enumerate(g.nodes)}
    kind = "all_reduce" if mode == "ddp" else "reduce_scatter"
    for k, bucket in enumerate(ctx.grad_buckets):
        users = {m: list(params[m].users) for m in bucket}
        anchor = min((u for us in users.values() for u in us), key=position.__getitem__)
        values, owners = [], []
        with g.inserting_before(anchor):
            for m in bucket:
                if mode == "ddp":
                    values.append(params[m])
                    continue
                _stand_in_buffer(gm, f"{REPLICAS}.{m}", params[m].meta[meta.VAL])
                replica = g.get_attr(f"{REPLICAS}.{m}")
                replica.meta.update({meta.VAL: params[m].meta[meta.VAL], meta.LAYOUT: _whole_dp(params[m], ctx)})
                values.append(replica)
                owners.append(params[m])
            node = g.create_node("call_function", dp_bucket_sync, (sync, k, values, owners), name=f"bucket_{k}")
            nbytes = sum((specs[m].padded_numel if mode != "ddp" else specs[m].numel)
                         * (ctx.plan.grad_reduce_dtype or ctx.params[m].dtype).itemsize for m in bucket)
            node.meta.update({meta.VAL: tuple(params[m].meta[meta.VAL] for m in bucket),
                              meta.LAYOUT: tuple(_whole_dp(params[m], ctx) for m in bucket),
                              meta.COMM: CommInfo(kind, "dp", ring_bytes(kind, nbytes, n), "backward",
                                                  f"bucket {k}: {', '.join(bucket)}")})
            for i, m in enumerate(bucket):
                item = g.create_node("call_function", operator.getitem, (node, i),
                                     name=f"{params[m].name}_{'synced' if mode == 'ddp' else 'full'}")
                item.meta.update({meta.VAL: params[m].meta[meta.VAL], meta.LAYOUT: _whole_dp(params[m], ctx)})
                for u in users[m]:
                    u.replace_input_with(params[m], item)


def _whole_dp(pnode: fx.Node, ctx: CompileContext) -> Layout:
    """A parameter's layout once data parallelism hands it over whole (its tp placement kept)."""
    lay = pnode.meta.get(meta.LAYOUT)
    if not isinstance(lay, Layout):
        return Layout.replicated(ctx.mesh.names)
    return lay.replace("dp", Replicate()) if "dp" in ctx.mesh.axes else lay


def _unit_info(units, k, name, specs, ctx, n, bucket) -> CommInfo:
    unit = units[k]
    if name != unit[0]:
        return CommInfo("all_gather", "dp", 0.0, "forward", f"part of unit {k}, gathered with {unit[0]}")
    nbytes = sum(specs[m].padded_numel * ctx.params[m].dtype.itemsize for m in unit)
    return CommInfo("all_gather", "dp", ring_bytes("all_gather", nbytes, n), "forward",
                    f"unit {k} ({len(unit)} params); backward: gathered again if read, "
                    f"gradients reduce_scatter in bucket {bucket}")


def _stand_in_buffer(gm: fx.GraphModule, target: str, val) -> None:
    """A meta-device buffer at ``target`` so the graph lints; emit binds the real replica."""
    path, _, leaf = target.rpartition(".")
    if path and not _has(gm, path):
        gm.add_submodule(path, torch.nn.Module())
    gm.get_submodule(path).register_buffer(leaf, torch.empty(tuple(val.shape), dtype=val.dtype, device="meta"))


def _has(gm, path):
    try:
        gm.get_submodule(path)
        return True
    except AttributeError:
        return False


# ---- tensor parallelism --------------------------------------------------------------------

def _dp_local_shape(node: fx.Node, ctx: CompileContext) -> tuple:
    shape = list(node.meta[meta.VAL].shape)
    lay = node.meta.get(meta.LAYOUT)
    if isinstance(lay, Layout) and "dp" in ctx.mesh.axes and isinstance(lay["dp"], Shard):
        d = lay["dp"].dim
        shape[d] = local_size(shape[d], ctx.mesh.axis_size("dp"), ctx.mesh.coordinate("dp"))
    return tuple(shape)


def _insert_tp_redistributions(gm: fx.GraphModule, ctx: CompileContext) -> None:
    """Where a node's tp strategy needs an input laid out otherwise than it is, insert the
    redistribution (one per producer and target layout, shared by its consumers); where a
    replicated input is read by per-rank compute, insert Megatron's ``f`` (``tp_copy``) so
    that backward sums the ranks' gradient addends. Outputs are made whole along tp."""
    g, t = gm.graph, ctx.mesh.axis_size("tp")
    gm.add_submodule(COMM_TP, torch.nn.Module())     # stand-in: emit binds the AxisComm
    with g.inserting_before(next(iter(g.nodes))):
        comm = g.get_attr(COMM_TP)
    made: dict = {}
    shared: dict = {}     # replicated parameter read by per-rank compute -> its consumers
    carries = _carries_grad(g, ctx)

    def new(fn, args, src, placement, kind, why, nbytes, name):
        node = g.create_node("call_function", fn, args, name=name)
        lay = src.meta[meta.LAYOUT].replace("tp", placement)
        node.meta.update({meta.VAL: src.meta[meta.VAL], meta.LAYOUT: lay})
        if kind:
            node.meta[meta.COMM] = CommInfo(kind, "tp", ring_bytes(kind, nbytes, t), "forward", why)
        return node

    def convert(src, have, want, varying, consumer):
        key = (src, want, varying)
        if key in made:
            return made[key]
        val = src.meta[meta.VAL]
        shape = _dp_local_shape(src, ctx)
        nbytes = float(torch.Size(shape).numel() * val.dtype.itemsize)
        grad = val.dtype.is_floating_point
        why = f"{consumer.name} needs {want}"
        with g.inserting_before(consumer):   # the first consumer: the others come later
            if have == want:
                out = src
                if want == Replicate() and varying and grad and src in carries and src.op == "get_attr":
                    shared.setdefault(src, []).append(consumer)   # one f per layer's parameters, below
                    return src
                if want == Replicate() and varying and grad and src in carries:
                    out = new(tp_copy, (src, comm), src, want, "", "", 0, f"{src.name}_f")
                    out.meta[meta.COMM] = CommInfo("all_reduce", "tp", ring_bytes("all_reduce", nbytes, t),
                                                   "backward", f"f: {consumer.name} computes per rank, so "
                                                   "the gradient is a sum over tp")
            elif have == Replicate() and isinstance(want, Shard):
                out = new(tp_split, (src, comm, want.dim, shape[want.dim]), src, want, "", "", 0,
                          f"{src.name}_split")
                out.meta[meta.COMM] = CommInfo("all_gather", "tp", ring_bytes("all_gather", nbytes, t),
                                               "backward", f"local slice for {why}; backward all-gathers")
            elif isinstance(have, Shard) and want == Replicate():
                out = new(tp_gather, (src, comm, have.dim, shape[have.dim], varying), src, want,
                          "all_gather", why + ("; backward reduce-scatters" if varying else ""), nbytes,
                          f"{src.name}_gather")
            elif have == Partial() and want == Replicate():
                out = new(tp_all_reduce, (src, comm), src, want, "all_reduce", why + " (g)", nbytes,
                          f"{src.name}_allreduce")
                if varying and grad and src in carries:   # read per rank as well: f after g
                    carries.add(out)
                    made[key] = convert(out, want, want, varying, consumer)
                    return made[key]
            elif have == Partial("avg") and want == Replicate():   # a mean over a sharded dim
                total = new(tp_all_reduce, (src, comm), src, want, "all_reduce", why + " (mean of the ranks' means)",
                            nbytes, f"{src.name}_allreduce")
                out = new(torch.ops.aten.div.Tensor, (total, t), src, want, "", "", 0, f"{src.name}_mean")
            elif have == Partial() and isinstance(want, Shard):
                out = new(tp_reduce_scatter, (src, comm, want.dim, shape[want.dim]), src, want,
                          "reduce_scatter", why + "; backward all-gathers", nbytes, f"{src.name}_scatter")
            elif isinstance(have, Shard) and isinstance(want, Shard):
                whole = convert(src, have, Replicate(), False, consumer)
                made[key] = convert(whole, Replicate(), want, varying, consumer)
                return made[key]
            else:
                raise ValueError(f"{consumer.name} needs {src.name} as {want} along tp, but it is {have}; "
                                 "autopar has no redistribution between them")
        made[key] = out
        return out

    for node in list(g.nodes):
        s = node.meta.get(meta.STRATEGY, {}).get("tp")
        if s is None:
            continue
        varying = _varying(s)
        for src, want in zip(input_nodes(node), s.inputs):
            lay = src.meta.get(meta.LAYOUT)
            if not isinstance(lay, Layout) or want is None or isinstance(want, tuple):
                continue
            out = convert(src, lay["tp"], want, varying, node)
            if out is not src:
                node.replace_input_with(src, out)
        if meta.LOWER in node.meta:
            _lower_vocab_parallel(node, comm, ctx)
    _insert_param_syncs(g, comm, shared, ctx)
    output = next(n for n in g.nodes if n.op == "output")
    for src in output.all_input_nodes:
        lay = src.meta.get(meta.LAYOUT)
        if isinstance(lay, Layout) and lay["tp"] != Replicate():
            output.replace_input_with(src, convert(src, lay["tp"], Replicate(), False, output))


_PERMUTES = {torch.ops.aten.transpose.int, torch.ops.aten.permute.default, torch.ops.aten.t.default}


def _reshape_permuted_views(gm: fx.GraphModule) -> None:
    """A ``view`` of a transposed tensor becomes a ``reshape`` (the same values). Capture met the
    transpose contiguous because the op before it laid its output out so (attention's output
    follows q's strides, and export drops the model's ``.contiguous()`` as a no-op); a tp
    redistribution upstream hands that op a contiguous input instead, after which the view no
    longer applies, where a reshape copies. Where the view applies, reshape is that view (the
    same aliasing)."""
    views = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in views and isinstance(node.args[0], fx.Node) \
                and node.args[0].target in _PERMUTES:
            node.target = torch.ops.aten.reshape.default


def _insert_param_syncs(g: fx.Graph, comm: fx.Node, shared: dict, ctx: CompileContext) -> None:
    """Megatron's ``f`` on replicated parameters read by per-rank compute (under sequence
    parallelism: the norms and the row products' biases), one ``tp_param_sync`` per numbered
    layer, before the layer's first such read: one gradient all-reduce per layer instead of
    one per vector, and ZeRO-3 still meets each layer's parameters where the layer starts. The
    node names the parameters, so that under mixed precision their summed gradients reach the
    masters in the reduce dtype (``DataParallelSync.add_summed``)."""
    position = {n: i for i, n in enumerate(g.nodes)}
    groups: dict = {}
    for src, users in shared.items():
        groups.setdefault(layer_key(src.meta[meta.PARAM]), []).append(src)
    t = ctx.mesh.axis_size("tp")
    for k, params in enumerate(groups.values()):
        params.sort(key=lambda p: min(position[u] for u in shared[p]))
        anchor = min((u for p in params for u in shared[p]), key=position.__getitem__)
        with g.inserting_before(anchor):
            names = [p.meta[meta.PARAM] for p in params]
            sync = g.create_node("call_function", tp_param_sync, (comm, list(params), names), name=f"tp_grad_sync_{k}")
            nbytes = sum(float(p.meta[meta.VAL].numel() * p.meta[meta.VAL].dtype.itemsize) for p in params)
            sync.meta.update({meta.VAL: tuple(p.meta[meta.VAL] for p in params),
                              meta.LAYOUT: tuple(p.meta[meta.LAYOUT] for p in params),
                              meta.COMM: CommInfo("all_reduce", "tp", ring_bytes("all_reduce", nbytes, t), "backward",
                                                  f"f: gradients of {', '.join(p.meta[meta.PARAM] for p in params)}, "
                                                  "read per rank, summed over tp")})
            for i, p in enumerate(params):
                item = g.create_node("call_function", operator.getitem, (sync, i), name=f"{p.name}_f")
                item.meta.update({meta.VAL: p.meta[meta.VAL], meta.LAYOUT: p.meta[meta.LAYOUT]})
                for u in shared[p]:
                    u.replace_input_with(p, item)


def _lower_vocab_parallel(node: fx.Node, comm: fx.Node, ctx: CompileContext) -> None:
    """Replace the op by its vocabulary-parallel form (autopar.runtime.tpcomm) for this rank's rows."""
    t, r = ctx.mesh.axis_size("tp"), ctx.mesh.coordinate("tp")
    if node.meta[meta.LOWER] == "vocab_embedding":
        table, idx = node.args[:2]
        pad = node.args[2] if len(node.args) > 2 else -1
        lo, hi = chunk_range(table.meta[meta.VAL].shape[0], t, r)
        node.target, node.args, node.kwargs = tp_vocab_embedding, (table, idx, lo, hi, pad), {}
        return
    a = list(node.args) + [None, 1, -100, 0.0][len(node.args) - 2:]
    logits, target, reduction, ignore = a[0], a[1], a[3], a[4]
    lo, hi = chunk_range(logits.meta[meta.VAL].shape[1], t, r)
    node.target, node.args, node.kwargs = tp_vocab_cross_entropy, (logits, target, comm, lo, hi, reduction, ignore), {}
    rows = _dp_local_shape(logits, ctx)[0]
    nbytes = len(CE_VALUES) * ring_bytes("all_reduce", rows * 4.0, t)
    node.meta[meta.COMM] = CommInfo("all_reduce", "tp", nbytes, "forward",
                                    "vocab-parallel cross_entropy: max, sum of exp and target logit per row "
                                    "(3 all-reduces of one value per row; the logits stay split)")


def _carries_grad(g: fx.Graph, ctx: CompileContext) -> set:
    """Nodes whose value can carry a gradient: trainable parameters, floating inputs (the
    caller may pass one that requires grad) and what is computed from them. A replicated
    tensor outside this set (a rotary table, a mask) needs no ``f``."""
    out = set()
    for node in g.nodes:
        val = node.meta.get(meta.VAL)
        floating = isinstance(val, torch.Tensor) and val.dtype.is_floating_point
        if node.op == "get_attr":
            info = ctx.params.get(node.meta.get(meta.PARAM, ""))
            if info is not None and info.requires_grad and not info.is_buffer:
                out.add(node)
        elif node.op == "placeholder":
            if floating:
                out.add(node)
        elif any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out
