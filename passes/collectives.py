"""collectives: insert the communication the layouts need.

For the data-parallel axis every consumer needs its parameters whole (``dp:R``):

    zero3      the stored ``S(0)`` shard is all-gathered right before its first use
               (``dp_gather``) and released after its last forward use (``dp_release``);
               backward gathers again what it reads and reduce-scatters the gradient
    zero1/2    forward reads the full replica; ``dp_grad_sync`` routes the gradient to a
               bucketed reduce-scatter into the rank's shard (ZeRO-2: as soon as the bucket
               is ready; ZeRO-1: when backward ends)
    ddp        ``dp_grad_sync`` routes the gradient to a bucketed all-reduce

It also fixes the gradient buckets (``ctx.grad_buckets``): parameters in reverse order of
first use, the order their gradients become ready, cut at ``plan.bucket_bytes``.
"""
from __future__ import annotations

import torch
from torch import fx

from autopar import meta
from autopar.comm import CommInfo, ShardSpec, ring_bytes
from autopar.context import CompileContext
from autopar.dpsync import dp_gather, dp_grad_sync, dp_release
from autopar.placement import Layout, Replicate

SYNC = "sync_dp"        # attribute holding the DataParallelSync of the emitted module
REPLICAS = "replicas"   # ZeRO-1/2: submodule holding the full parameter replicas


def shard_specs(ctx: CompileContext) -> dict[str, ShardSpec]:
    """How every trainable parameter is split over ``dp`` (ddp: N=1, nothing split)."""
    n = ctx.mesh.axis_size("dp") if ctx.plan.dp != "ddp" else 1
    index = ctx.mesh.coordinate("dp") if n > 1 else 0
    return {name: ShardSpec(info.shape, n, index)
            for name, info in ctx.params.items() if not info.is_buffer and info.requires_grad}


def _plan_buckets(order: list[str], ctx: CompileContext, specs) -> list[list[str]]:
    buckets, cur, cur_bytes, cur_dtype = [], [], 0, None
    for name in reversed(order):
        info = ctx.params[name]
        size = specs[name].n * specs[name].chunk_numel * info.dtype.itemsize
        if cur and (cur_bytes + size > ctx.plan.bucket_bytes or info.dtype != cur_dtype):
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur.append(name)
        cur_bytes += size
        cur_dtype = info.dtype
    if cur:
        buckets.append(cur)
    return buckets


def collectives(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    g = gm.graph
    position = {nd: i for i, nd in enumerate(g.nodes)}
    mode, n = ctx.plan.dp, ctx.mesh.axis_size("dp")
    specs = shard_specs(ctx)
    params = [nd for nd in g.nodes if nd.op == "get_attr" and nd.meta.get(meta.PARAM) in specs]
    order = [nd.meta[meta.PARAM] for nd in params]
    ctx.grad_buckets = _plan_buckets(order, ctx, specs)
    bucket_of = {name: i for i, b in enumerate(ctx.grad_buckets) for name in b}
    whole = Layout.replicated(ctx.mesh.names)
    grad_kind = "all_reduce" if mode == "ddp" else "reduce_scatter"
    first = next(iter(g.nodes))
    gm.add_submodule(SYNC, torch.nn.Module())   # stand-in: emit binds the DataParallelSync
    with g.inserting_before(first):
        sync = g.get_attr(SYNC)
    for pnode in params:
        name = pnode.meta[meta.PARAM]
        spec, info = specs[name], ctx.params[name]
        padded = n * spec.chunk_numel * info.dtype.itemsize if mode != "ddp" else spec.numel * info.dtype.itemsize
        grad_info = CommInfo(grad_kind, "dp", ring_bytes(grad_kind, padded, n), "backward",
                             f"bucket {bucket_of[name]}")
        users = list(pnode.users)
        anchor = min(users, key=position.__getitem__) if users else pnode
        with g.inserting_before(anchor):
            if mode == "zero3":
                new = g.call_function(dp_gather, (pnode, sync, name))
                new.meta[meta.COMM] = CommInfo(
                    "all_gather", "dp", ring_bytes("all_gather", padded, n), "forward",
                    f"backward: gathered again if read, gradient reduce_scatter in bucket {bucket_of[name]}")
            elif mode == "ddp":
                new = g.call_function(dp_grad_sync, (pnode, pnode, sync, name))
                new.meta[meta.COMM] = grad_info
            else:
                _stand_in_buffer(gm, f"{REPLICAS}.{name}", pnode.meta.get(meta.VAL))
                replica = g.get_attr(f"{REPLICAS}.{name}")
                replica.meta[meta.LAYOUT] = whole
                replica.meta[meta.VAL] = pnode.meta.get(meta.VAL)
                new = g.call_function(dp_grad_sync, (replica, pnode, sync, name))
                new.meta[meta.COMM] = grad_info
        new.meta[meta.VAL] = pnode.meta.get(meta.VAL)
        new.meta[meta.LAYOUT] = whole
        for u in users:
            u.replace_input_with(pnode, new)
        if mode == "zero3" and users:
            last = max(users, key=position.__getitem__)
            with g.inserting_after(last):
                g.call_function(dp_release, (new, sync, name))
    g.lint()
    gm.recompile()
    return gm


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
