"""autopar.compile: capture, annotate layouts, insert collectives, emit.

It reads as the ordered list of passes; each pass is ``(GraphModule, CompileContext) ->
GraphModule`` and its result is snapshotted for ``dm.dump()``.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
from typing import Union

import torch
from torch import nn
from torch.utils import _pytree as pytree

from . import meta, passes
from .capture import capture
from .comm import CommStats
from .context import CompileContext
from .explain import graph_text
from .mesh import Mesh
from .plan import Plan
from .runtime import DistributedModule, check_collective_order, emit, slice_batch
from .wsplit import split_weight_grads

log = logging.getLogger("autopar")

__all__ = ["compile"]


def _resolve_plan(plan: Union[Plan, str], mesh: Mesh, model=None, example_inputs=(), example_kwargs=None,
                  cluster=None) -> tuple[Plan, str]:
    if isinstance(plan, Plan):
        return plan, "given by the user"
    if plan == "auto":
        return _auto_plan(mesh, model, example_inputs, example_kwargs, cluster)
    raise ValueError(f"plan={plan!r} is not a plan: pass plan='auto' or an autopar.Plan(...), "
                     "e.g. Plan(dp='zero2')")


def _auto_plan(mesh: Mesh, model, example_inputs, example_kwargs, cluster) -> tuple[Plan, str]:
    """plan='auto': rank 0 runs the planner over the plans this mesh's axes allow (without
    recomputation, which compile does not implement) and broadcasts its choice, so every rank
    compiles the same program whatever its own measurements would say."""
    import torch.distributed as dist
    from .cost.cluster import cached_local, get_cluster
    from .planner import plan as _plan
    chosen = [None, None]
    if mesh.rank == 0 or mesh.virtual:
        try:
            c = get_cluster(cluster) if cluster is not None else (cached_local() or _calibrate_here())
            rows = {t.shape[0] for t in pytree.tree_leaves((tuple(example_inputs), dict(example_kwargs or {})))
                    if isinstance(t, torch.Tensor) and t.dim()}
            report = _plan(model, mesh.size, example_inputs=example_inputs, example_kwargs=example_kwargs,
                           cluster=c, global_batch=max(rows) if rows else None, mesh_axes=dict(mesh.axes),
                           recompute=("none",))
            runner_up = report.candidates[1] if len(report.candidates) > 1 else None
            chosen = [str(report.plan), (
                f"plan='auto' picked {report.plan} on {mesh} with the cost model ({c.name}): predicted "
                f"{report.step_time_s * 1e3:.2f} ms and {report.memory_bytes / 2**20:.1f} MiB per rank, best of "
                f"{report.searched} candidates" + (f"; runner-up {runner_up.plan} {runner_up.reason}" if runner_up else ""))]
        except Exception as exc:     # every rank must hear of the failure, not wait for a plan
            chosen = [None, f"{type(exc).__name__}: {exc}"]
    if not mesh.virtual and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(chosen, src=0)
    if chosen[0] is None:
        raise ValueError(f"plan='auto' found no plan for {mesh}: {chosen[1]}")
    if mesh.rank == 0:
        log.warning("autopar: %s", chosen[1])
    return Plan.parse(chosen[0]), chosen[1]


def _calibrate_here():
    """The local preset, measured now: it spawns a few gloo processes, which a daemonic process
    (a rank started by autopar.testing.run or a multiprocessing pool) cannot do."""
    import multiprocessing
    from .cost.cluster import calibrate_local
    if multiprocessing.current_process().daemon:
        raise RuntimeError(
            "plan='auto' needs this machine's cost-model calibration, which is not cached yet and cannot be "
            "measured from this (daemonic) process: run `python -m autopar calibrate` once (or call "
            "autopar.cost.cluster.calibrate_local() before starting the ranks), or pass cluster='dgx-h100' / a Cluster")
    return calibrate_local()


def _check_axes(plan: Plan, mesh: Mesh) -> None:
    used = plan.axes_used()
    for axis in used:
        if axis != "dp" and axis not in mesh.axes:
            raise ValueError(f"{plan} uses mesh axis {axis!r}, but {mesh} has none; add it to the mesh "
                             f"(e.g. Mesh(dp=..., {axis}=2)) or drop it from the plan")
    for axis, size in mesh.axes.items():
        if axis not in used and size > 1:
            raise ValueError(f"{mesh} has axis {axis}={size}, which {plan} gives no role; "
                             f"set the plan's {axis} field or make the axis size 1")


def compile(model: nn.Module, mesh: Mesh, *, example_inputs, example_kwargs=None,
            plan: Union[Plan, str] = "auto", cluster=None) -> DistributedModule:
    """Compile ``model`` for ``mesh``. ``example_inputs`` (and ``example_kwargs``) are one
    global batch: the graph is captured at its shapes (the logical program), and this rank's
    module runs on its data-parallel slice. ``plan="auto"`` lets the planner choose among the
    plans the mesh's axes allow, by the cost model of ``cluster`` (a preset name or a Cluster;
    default: this machine's calibrated ``local`` preset)."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be an autopar.Mesh, got {type(mesh).__name__}")
    plan, reason = _resolve_plan(plan, mesh, model, example_inputs, example_kwargs, cluster)
    _check_axes(plan, mesh)
    ctx = CompileContext(mesh=mesh, plan=plan)
    ctx.notes.append(f"plan: {reason}")
    if plan.pp_schedule is not None:
        return _compile_pipeline(model, ctx, example_inputs, example_kwargs)
    n, i = mesh.axis_size("dp"), mesh.coordinate("dp")
    args, kwargs = tuple(example_inputs), dict(example_kwargs or {})
    local = pytree.tree_map(lambda t: slice_batch(t, n, i) if isinstance(t, torch.Tensor) else t, (args, kwargs))

    gm = capture(model, args, kwargs, ctx)         # the logical graph, at global shapes
    # this rank's forward takes its slice of the batch: the shapes its inputs are checked against
    ctx.input_shapes = tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None
                             for x in pytree.tree_leaves(local))
    ctx.snapshots.append(("capture", graph_text(gm)))
    ctx.profile = _profile(gm, ctx)
    # layouts first: collectives and localize read them; localize on the final graph, then the
    # sequence-parallel regions become one node each (they hold localized ops); overlap last,
    # on the final order of the nodes
    gm = _layout_passes(gm, ctx)
    check_collective_order([(gm, ctx)], ctx)    # before any communication: a mismatch is an error, not a hang
    dm = emit(gm, model, ctx)
    ctx.snapshots.append(("emit", dm.module.code))
    del gm
    gc.collect()   # export leaves reference cycles that hold the original weights
    return dm


def _profile(gm, ctx: CompileContext):
    """The cost model's profile of the logical graph for this plan's tp / sp (numbers only:
    ``dm.predict`` and ``dm.explain`` read it); None, with a logged reason, if it fails."""
    from .profile import profile
    try:
        return profile(gm, ctx, tp=ctx.mesh.axis_size("tp") if ctx.plan.tp else 1, sp=ctx.plan.sp,
                       tp_layout=ctx.plan.tp_layout)
    except Exception as exc:     # the cost model must never stop a compile
        log.warning("autopar: no cost-model profile for this graph (%s: %s)", type(exc).__name__, exc)
        return None


def _layout_passes(gm, ctx: CompileContext, prefix: str = ""):
    for p in (passes.shard, passes.collectives, passes.localize, passes.sequence_parallel, passes.overlap):
        if p is passes.sequence_parallel and not ctx.plan.sp:
            continue
        gm = p(gm, ctx)
        ctx.snapshots.append((prefix + p.__name__, graph_text(gm)))
    return gm


def _compile_pipeline(model: nn.Module, ctx: CompileContext, example_inputs, example_kwargs):
    """Pipeline parallelism: capture one micro-batch, cut the graph into stages, then compile
    each stage this rank runs with the dp and tp passes, as a module of its own."""
    from .pipe import PipelineModule
    from .plan import PP_SCHEDULES
    from .schedule import Schedule, build_schedule, simulate
    mesh, plan = ctx.mesh, ctx.plan
    p, m, v, n = mesh.axis_size("pp"), plan.microbatches, plan.virtual_stages, mesh.axis_size("dp")
    if p == 1 and v > 1:
        raise ValueError(f"{mesh} runs every stage on one rank: virtual_stages={v} needs a pp axis of 2 "
                         "or more ranks")
    if plan.pp_schedule in PP_SCHEDULES:     # a micro-batch count that does not fit fails here
        schedule = build_schedule(plan.pp_schedule, p, m, v)
    else:
        schedule = Schedule.parse(plan.pp_schedule)
        if schedule.p != p:
            raise ValueError(f"the custom schedule has {schedule.p} ranks, the mesh has pp={p}")
    simulate(schedule)     # a schedule that would deadlock fails here, before any process waits
    args, kwargs = tuple(example_inputs), dict(example_kwargs or {})
    rows = {t.shape[0] for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim()}
    if len(rows) != 1 or next(iter(rows)) % (m * n):
        raise ValueError(f"the example inputs' batch sizes along dim 0 are {sorted(rows)}: a pipeline needs "
                         f"one batch size that divides by microbatches x dp = {m} x {n}; choose a global "
                         f"batch that is a multiple of {m * n}")
    ctx.microbatch_rows = next(iter(rows)) // m
    mb = pytree.tree_map(lambda t: slice_batch(t, m, 0) if isinstance(t, torch.Tensor) and t.dim() else t,
                         (args, kwargs))
    gm = capture(model, mb[0], mb[1], ctx)              # the logical graph of one micro-batch
    local = pytree.tree_map(lambda t: slice_batch(t, n, 0) if isinstance(t, torch.Tensor) else t, mb)
    ctx.input_shapes = tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None
                             for x in pytree.tree_leaves(local))
    ctx.snapshots.append(("capture", graph_text(gm)))
    ctx.profile = _profile(gm, ctx)
    top = passes.pipeline(gm, ctx)
    ctx.snapshots.append(("pipeline", top.code + "".join(
        f"\n# ---- stage {k} ----\n{graph_text(top.get_submodule(f'stage_{k}'))}" for k in range(len(ctx.stages)))))
    shared = [name for name in ctx.params if sum(name in s.params for s in ctx.stages) > 1]
    stages, stats = {}, CommStats()
    laid = []
    for spec in ctx.stages:
        if spec.index % p != mesh.coordinate("pp"):
            continue
        sctx = _stage_context(ctx, spec, top.get_submodule(f"stage_{spec.index}"), shared)
        laid.append((spec, sctx, _layout_passes(top.get_submodule(f"stage_{spec.index}"), sctx,
                                                prefix=f"stage{spec.index}_")))
    check_collective_order([(sgm, sctx) for _, sctx, sgm in laid], ctx)     # before any communication
    for spec, sctx, sgm in laid:
        dm = emit(sgm, model, sctx, stats)
        if schedule.split_backward:
            n_split = split_weight_grads(dm.module, _batch_free(dm.module))
            sctx.notes.append(f"zero-bubble: {n_split} matmuls compute their weight gradient in W")
        ctx.snapshots += sctx.snapshots       # stage<k>_shard, stage<k>_collectives, ...
        ctx.snapshots.append((f"stage{spec.index}_emit", dm.module.code))
        stages[spec.index] = dm            # dm.ctx is the stage's context
    pm = PipelineModule(stages, ctx, schedule, stats)
    del gm, top
    gc.collect()
    return pm


def _stage_context(ctx: CompileContext, spec, sgm, shared) -> CompileContext:
    plan = ctx.plan
    tied = tuple((name, "R") for name in shared if name in spec.params)
    if plan.tp and tied:    # both copies of a tied weight keep one layout: whole along tp
        plan = dataclasses.replace(plan, tp_layout=plan.tp_layout + tied)
    sctx = CompileContext(mesh=ctx.mesh, plan=plan)
    sctx.params = {name: ctx.params[name] for name in spec.params}
    n = ctx.mesh.axis_size("dp")
    phs = [x for x in sgm.graph.nodes if x.op == "placeholder"]
    vals = [x.meta.get(meta.VAL) for x in phs]
    sctx.in_spec = pytree.tree_flatten((tuple(vals), {}))[1]
    sctx.out_spec = pytree.tree_flatten(tuple(spec.outputs))[1]
    sctx.input_shapes = tuple((v.shape[0] // n,) + tuple(v.shape[1:]) if v.dim() else tuple(v.shape) for v in vals)
    sctx.input_dtypes = tuple(v.dtype for v in vals)
    sctx.microbatch_rows = ctx.microbatch_rows
    if tied:
        sctx.notes.append(f"tied across stages (gradients summed after the step): {', '.join(n for n, _ in tied)}")
    return sctx


def _batch_free(gm):
    """A predicate: the node does not depend on the graph's inputs (parameters and constants)."""
    from .passes.pipeline import batch_dependent
    dep = batch_dependent(gm.graph)
    return lambda node: node not in dep
