"""emit: the rewritten graph becomes this rank's DistributedModule.

Its parameters are this rank's shards (ddp: full copies), ZeRO-1/2 replicas are
non-persistent buffers, and the ``DataParallelSync`` of the dp axis and the ``AxisComm`` of
the tp axis are bound where the graph's stand-ins (``meta.SYNC``, ``meta.COMM_TP``) were.
Nothing of the original model is kept: every tensor is copied (ZeRO-3 copies only this
rank's rows).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from ..context import CompileContext
from ..meta import COMM_TP, REPLICAS, RNG, SYNC
from .comm import AxisComm, CommStats
from .dpsync import DataParallelSync
from .module import DistributedModule, attr_path
from .rng import RandomMasks
from .tpcomm import SavedRegather

__all__ = ["emit"]


def emit(gm: fx.GraphModule, model: nn.Module, ctx: CompileContext,
         stats: CommStats | None = None, sites: tuple = ()) -> "DistributedModule":
    """This rank's module from the rewritten graph ``gm`` and the original ``model``'s tensors.
    ``sites``: every random site of the whole model, when ``gm`` is one pipeline stage of it
    (the pipeline draws the masks for its stages); without, ``ctx.rng_sites``."""
    mode = ctx.plan.dp
    specs = ctx.shard_specs()
    stats = stats if stats is not None else CommStats()   # pipeline stages share one counter
    comm = _axis_comm(ctx, "dp", stats)
    tp_comm = _axis_comm(ctx, "tp", stats) if ctx.plan.tp else None
    if ctx.plan.sp:   # column inputs are saved as sequence shards, gathered again in backward
        tp_comm.regather = SavedRegather()
    root: dict[str, Any] = {}
    shards: dict[str, nn.Parameter] = {}
    replicas: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, info in ctx.params.items():
            full = attr_path(model, name).detach()
            if name in ctx.tp_params:                   # this rank's slice along tp (a copy if interleaved)
                full = ctx.tp_params[name].local_of(full, tp_comm.size, tp_comm.index)
            if name not in specs:                       # buffers and frozen parameters: copied
                root[name] = full.clone() if info.is_buffer else nn.Parameter(
                    _in(full, ctx.plan.param_dtype).clone(), requires_grad=False)   # mixed: frozen ones in compute dtype
                continue
            master = _in(full, ctx.plan.master_dtype if ctx.plan.mixed else None)  # what the optimizer steps
            if mode == "zero3":
                shard = nn.Parameter(specs[name].local_of(master).clone())
            elif mode == "ddp":
                shard = nn.Parameter(master.clone())
            elif ctx.plan.mixed:   # replicas in the compute dtype; the master shard is a tensor of its own
                replicas[name] = _in(full, ctx.plan.param_dtype).clone()
                shard = nn.Parameter(specs[name].local_of(master).clone())
                root[f"{REPLICAS}.{name}"] = replicas[name]
            else:   # the shard is a view of the replica's own rows: updating it updates the replica
                replicas[name] = full.clone()
                shard = nn.Parameter(specs[name].local_of(replicas[name]))
                root[f"{REPLICAS}.{name}"] = replicas[name]
            shards[name] = root[name] = shard
        for node in gm.graph.nodes:    # lifted constants of the captured graph
            if node.op == "get_attr" and node.target not in root and node.target not in (SYNC, COMM_TP, RNG) \
                    and not node.target.startswith(REPLICAS + "."):
                root[node.target] = attr_path(gm, node.target)
            elif node.op == "call_module":     # fused regions (sequence parallelism)
                root[node.target] = gm.get_submodule(node.target)
    # with overlap, gradient reductions run on a second dp group: a backend runs one group's
    # collectives in issue order (gloo does), so a bucket's reduction in flight would hold up the
    # next unit's gather on the same group. Every rank creates it (new_group is collective): the
    # condition depends on the plan and mesh only
    reduce_comm = None
    if ctx.plan.overlap and comm.size > 1 and not ctx.mesh.virtual:
        reduce_comm = AxisComm("dp", comm.size, comm.index, ctx.mesh.group("dp", "grads"), stats,
                               grad_dtype=comm.grad_dtype)
    sync = DataParallelSync(mode, comm, specs, ctx.grad_buckets, shards, replicas, ctx.gather_units,
                            overlap=ctx.plan.overlap, prefetch_bytes=ctx.plan.prefetch_bytes,
                            reduce_comm=reduce_comm, compute_dtype=ctx.plan.param_dtype)
    root[SYNC] = sync
    if tp_comm is not None:
        root[COMM_TP] = tp_comm
        tp_comm.grad_sink = sync.add_summed     # tp_param_sync's sums reach the masters unrounded
    if ctx.rng_local:
        root[RNG] = RandomMasks(sites or ctx.rng_sites, ctx.rng_local, external=bool(sites),
                                mode=ctx.plan.dropout_rng, mesh=ctx.mesh)   # drawn on the module's device
        root[RNG].replayed = set(ctx.rng_replayed) & set(ctx.rng_local)
    out = fx.GraphModule(root, gm.graph, class_name="AutoparRank")
    for name, value in root.items():   # GraphModule keeps only what the graph reads: add the rest
        if name not in (SYNC, COMM_TP, RNG) and not _hasattr_path(out, name):
            _setattr_path(out, name, value)
    if REPLICAS in dict(out.named_children()):
        for mod in out.get_submodule(REPLICAS).modules():
            for bname, buf in list(mod.named_buffers(recurse=False, remove_duplicate=False)):
                mod.register_buffer(bname, buf, persistent=False)
    return DistributedModule(out, ctx, sync, stats, tp_comm)


def _axis_comm(ctx: CompileContext, axis: str, stats: CommStats) -> AxisComm:
    mesh = ctx.mesh
    return AxisComm(axis, mesh.axis_size(axis), mesh.coordinate(axis),
                    mesh.group(axis) if axis in mesh.axes else None, stats, grad_dtype=ctx.plan.grad_reduce_dtype)


def _in(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A floating ``t`` in ``dtype`` (None: as it is)."""
    return t if dtype is None or not t.is_floating_point() else t.to(dtype)


def _hasattr_path(mod: nn.Module, dotted: str) -> bool:
    try:
        attr_path(mod, dotted)
        return True
    except AttributeError:
        return False


def _setattr_path(mod: nn.Module, dotted: str, value: torch.Tensor) -> None:
    """Register ``value`` at ``dotted`` (a parameter, or a buffer), making the submodules."""
    *path, leaf = dotted.split(".")
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if isinstance(value, nn.Parameter):
        mod.register_parameter(leaf, value)
    else:
        mod.register_buffer(leaf, value)
