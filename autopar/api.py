"""The entry points: ``compile``, ``estimate`` and ``plan``.

``compile`` is the driver: capture the model into one graph, then run the plan's list of
passes (``passes.for_plan``) over it (a pipeline first cuts it into stages and runs the list
over each stage this rank holds), check that every rank will issue the same collectives,
and emit this rank's module. Every pass's result is snapshotted for ``dm.dump()``. Each rank
captures and runs the passes alone; before the first collective the ranks agree through the
store (``runtime.flight.agreed``): a rank that failed stops every rank at once, the others
naming it and its error, instead of leaving them waiting in a collective it never issues.
``estimate`` and ``plan`` are thin wrappers over the cost model (``autopar.cost``).
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import math
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from . import meta, passes
from .capture import capture
from .context import CompileContext
from .cost.cluster import get_cluster
from .cost.estimate import Estimate, Profiles, estimate_plan, evaluate_plan
from .cost.lm_head import head_policy
from .passes.autocast import compute_copy
from .passes.lm_head import tied_head_layouts
from .cost.planner import PlanReport, find_plan
from .cost.profile import copy_captured, is_layer, profile
from .explain import Inspector, graph_text
from .mesh import Mesh
from .planspec import Plan
from .runtime import DistributedModule, PipelineModule, emit, flight, slice_batch
from .runtime.module import cast_inputs
from .runtime.comm import CommStats
from .sizes import batch_split_error
from .schedule import SCHEDULES, Schedule, build_schedule, simulate
from .variants import ShapeVariants, bind_program, bind_stage, meta_copy

log = logging.getLogger("autopar")

__all__ = ["compile", "estimate", "plan"]


# ---- compile ---------------------------------------------------------------------------------------

def compile(model: nn.Module, mesh: Mesh, *, example_inputs, example_kwargs=None,
            plan: Union[Plan, str] = "auto", cluster=None, exported=None,
            base: Optional[Plan] = None) -> DistributedModule:
    """Compile ``model`` for ``mesh``. ``example_inputs`` (and ``example_kwargs``) are one
    global batch: the graph is captured at its shapes (the logical program), and this rank's
    module runs on its data-parallel slice. ``plan="auto"`` lets the planner choose among the
    plans the mesh's axes allow, by the cost model of ``cluster`` (a preset name or a Cluster;
    default: this machine's calibrated ``local`` preset); ``base`` gives the fields the planner
    does not choose (``base=Plan(param_dtype=torch.bfloat16)``: a mixed-precision run, planned
    as one). ``exported``: the
    ``torch.export.export(model, example_inputs, example_kwargs)`` of this very model, used
    instead of exporting again (one model compiled under several plans exports once; copy the
    two together, ``copy.deepcopy((model, exported))``); not for pipelines, which capture one
    micro-batch."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be an autopar.Mesh, got {type(mesh).__name__}")
    args, kwargs = tuple(example_inputs), dict(example_kwargs or {})
    _batch_rows(args, kwargs, mesh.axis_size("dp"))   # before planning, which would find no plan and not say why
    plan, reason = _resolve_plan(plan, mesh, model, example_inputs, example_kwargs, cluster, base)
    plan.check_mesh(mesh)
    ctx = CompileContext(mesh=mesh, plan=plan)
    ctx.model_class, ctx.model_config = _model_source(model)
    ctx.head_policy = head_policy(cluster) if plan.tp else None   # LM heads: whole or split, by the cost model
    ctx.notes.append(f"plan: {reason}")
    ctx.device_type = _device_type(model, mesh)
    source = model
    if plan.mixed:
        if exported is not None:
            raise ValueError(f"compile(exported=...) with Plan(param_dtype={plan.param_dtype}): the program is "
                             "captured from the model in the compute dtype, not from its own export; leave "
                             "exported out")
        source = compute_copy(model, plan.param_dtype)
    if plan.pp_schedule is not None:
        if exported is not None:
            raise ValueError("compile(exported=...) is for plans without a pipeline: a pipeline captures one "
                             f"micro-batch (the batch / microbatches={plan.microbatches}), not the example "
                             "inputs; leave exported out")
        return _compile_pipeline(model, source, ctx, args, kwargs, cluster)
    variants = ShapeVariants(meta_copy(source), lambda src, c, a, k, dm: bind_program(_lower(src, c, a, k, cluster), dm, c))
    gm = _lower(source, ctx, args, kwargs, cluster, exported=exported, check_modes=True)
    dm = emit(gm, model, ctx)
    dm.inspector = Inspector()
    dm.variants = variants          # another input shape: compiled on first call, on the same parameters
    ctx.snapshots.append(("emit", dm.module.code))
    del gm
    _collect(ctx)
    return dm


def _lower(source: nn.Module, ctx: CompileContext, args: tuple, kwargs: dict, cluster, exported=None,
           check_modes: bool = False):
    """Capture ``source`` on the global batch ``(args, kwargs)`` and run the plan's passes: this
    rank's rewritten graph, with the order of its collectives checked against the other ranks'."""
    mesh = ctx.mesh
    with flight.agreed(mesh):     # every rank alone until each has its graph: one's failure stops them all
        [(_, _, gm)] = _lower_graph(source, ctx, args, kwargs, cluster, rows=max(_batch_rows(args, kwargs), default=1),
                                    part=(mesh.axis_size("dp"), mesh.coordinate("dp")), exported=exported,
                                    check_modes=check_modes)
    passes.check_collective_order([(gm, ctx)], ctx)   # before any communication: a mismatch is an error, not a hang
    return gm


def _lower_graph(source: nn.Module, ctx: CompileContext, args: tuple, kwargs: dict, cluster, *, rows: int,
                 part: tuple[int, int], microbatches: int = 1, exported=None, check_modes: bool = True,
                 cut=None) -> list[tuple]:
    """The compile driver's one sequence, for a single program and a pipeline alike: capture
    ``source`` on ``(args, kwargs)`` (the global batch; a pipeline's first micro-batch of it,
    one of ``microbatches``) into the logical graph, add autocast's casts, number the random
    sites, note what this rank's forward takes (part ``part = (n, i)`` of the inputs along dim 0:
    the shapes its inputs are checked against, and their dtypes), make the cost model's profile
    and choose a recompute budget's layers (``rows``: the global batch's rows), then run the
    plan's passes. Over the whole graph, or with ``cut`` over each piece that ``cut(graph)``
    yields as (key, its context, its graph, snapshot prefix): a pipeline's stages, each
    rewritten before the next is cut out. Returns (key, context, rewritten graph) per piece
    (a single program: one, its key None)."""
    plan = ctx.plan
    gm = capture(source, *_compute_inputs(args, kwargs, plan), ctx, check_modes=check_modes,
                 exported=exported, autocast=_compute_autocast(ctx))   # the logical graph
    gm = _autocast(gm, ctx)
    passes.find_sites(gm, ctx, microbatches=microbatches)     # dropout: the single-device draw order
    ctx.input_shapes = _shapes(_slice(args, kwargs, *part))
    ctx.input_dtypes = _dtypes(_compute_inputs(args, kwargs, plan))   # mixed precision: inputs cast first
    ctx.snapshots.append(("capture", graph_text(gm)))
    ctx.profile_source = _profile(gm, ctx)
    _recompute_budget(ctx, cluster, rows)
    pieces = cut(gm) if cut is not None else [(None, ctx, gm, "")]
    return [(key, pctx, _run_passes(pgm, pctx, prefix)) for key, pctx, pgm, prefix in pieces]


def _model_source(model: nn.Module) -> tuple[str, tuple[str, str] | None]:
    """The model's class (module-qualified) and, for a Hugging Face model (the model, or the
    submodule of it that has a config, as a wrapper holds one), the qualified-name prefix of that
    module ("" or e.g. "lm.") and its config as JSON: what a checkpoint records of where it came
    from (``autopar.checkpoint.export_safetensors`` writes that module's weights and config)."""
    found = None
    for prefix, module in (model.named_modules() if isinstance(model, nn.Module) else ()):
        to_json = getattr(getattr(module, "config", None), "to_json_string", None)
        if callable(to_json):
            found = (f"{prefix}." if prefix else "", to_json())
            break
    return f"{type(model).__module__}.{type(model).__qualname__}", found


def _compute_inputs(args: tuple, kwargs: dict, plan: Plan):
    """The example inputs as the compute dtype's program takes them: floating inputs cast to
    ``param_dtype`` (as ``DistributedModule.forward`` casts the inputs it is given)."""
    return cast_inputs((args, kwargs), plan.param_dtype)


def _device_type(model: nn.Module, mesh: Mesh) -> str:
    """The device type the module will run on: its parameters', or for a model on the meta
    device, the mesh's (``Mesh.device``: CUDA when the process group is NCCL's, else the CPU)."""
    tensors = list(model.parameters()) + list(model.buffers()) if isinstance(model, nn.Module) else []
    for t in tensors:
        if t.device.type != "meta":
            return t.device.type
    return mesh.device.type


def _compute_autocast(ctx: CompileContext):
    """Mixed precision: (device type, ``param_dtype``), the ``torch.autocast`` the model runs
    under while it is captured, as it runs on one device; None without ``param_dtype``."""
    return (ctx.device_type, ctx.plan.param_dtype) if ctx.plan.mixed else None


def _autocast(gm, ctx: CompileContext):
    """The casts torch.autocast makes, mixed precision's and those of the model's own autocast
    blocks (``meta.AUTOCAST``), in the logical graph (snapshotted)."""
    if not ctx.plan.mixed and not any(meta.AUTOCAST in n.meta for n in gm.graph.nodes):
        return gm
    gm = passes.autocast(gm, ctx)
    ctx.snapshots.append(("autocast", graph_text(gm)))
    return gm


def _run_passes(gm, ctx: CompileContext, prefix: str = ""):
    """The plan's passes over ``gm``, each snapshotted as ``<prefix><pass name>`` (rng only
    where the graph has random sites: on a model without dropout it changes nothing)."""
    for p in passes.for_plan(ctx.plan):
        gm = p(gm, ctx)
        if p is passes.rng and not ctx.rng_local:
            continue
        ctx.snapshots.append((prefix + p.__name__, graph_text(gm)))
    return passes.check_no_writes(gm, ctx)     # a write left in place could land in a copy its readers never see


def _compile_pipeline(model: nn.Module, source: nn.Module, ctx: CompileContext, args: tuple,
                      kwargs: dict, cluster=None, like: PipelineModule | None = None) -> PipelineModule:
    """Pipeline parallelism: capture one micro-batch (of ``source``: the model, or under mixed
    precision its copy in the compute dtype), cut the graph into stages, then run the plan's
    passes over each stage this rank holds, as a model of its own; the stages' tensors are
    ``model``'s. ``like``: a pipeline compiled at other input shapes, whose program for these
    shapes this is: cut where ``like`` was cut, its stages bound to ``like``'s stages' tensors."""
    with flight.agreed(ctx.mesh):     # ranks lower different stages alone: one's failure must stop them all
        schedule, laid = _lower_stages(source, ctx, args, kwargs, cluster, like)
    passes.check_collective_order([(sgm, sctx) for _, sctx, sgm in laid], ctx)   # before any communication
    stages = {}
    stats = CommStats() if like is None else like.comm_stats     # the stages share one byte counter
    for spec, sctx, sgm in laid:
        if like is None:
            dm = emit(sgm, model, sctx, stats, sites=ctx.rng_sites)
        else:
            dm = bind_stage(sgm, like.stages[str(spec.index)], sctx, ctx.rng_sites)
        dm.inspector = Inspector()
        ctx.snapshots += sctx.snapshots + [(f"stage{spec.index}_emit", dm.module.code)]
        stages[spec.index] = dm            # dm.ctx is the stage's context
    pm = PipelineModule(stages, ctx, schedule, stats)
    pm.inspector = Inspector()
    if like is None:     # another input shape: compiled on first call, on these stages' tensors
        pm.variants = ShapeVariants(meta_copy(source), lambda src, c, a, k, old: _compile_pipeline(
            None, src, c, a, k, cluster, like=old))
    _collect(ctx)
    return pm


def _lower_stages(source: nn.Module, ctx: CompileContext, args: tuple, kwargs: dict, cluster,
                  like: PipelineModule | None) -> tuple[Schedule, list]:
    """The schedule, and (stage spec, its context, its rewritten graph) per stage this rank
    holds: what each rank of a pipeline compiles alone (``_compile_pipeline``)."""
    mesh, plan = ctx.mesh, ctx.plan
    if like is not None:
        ctx.stage_starts = tuple(spec.nodes[0] for spec in like.ctx.stages[1:])
    p, m, v, n = mesh.axis_size("pp"), plan.microbatches, plan.virtual_stages, mesh.axis_size("dp")
    if p == 1 and v > 1:
        raise ValueError(f"{mesh} runs every stage on one rank: virtual_stages={v} needs a pp axis of 2 "
                         "or more ranks")
    if plan.pp_schedule in SCHEDULES:     # a micro-batch count that does not fit fails here
        schedule = build_schedule(plan.pp_schedule, p, m, v)
    else:
        schedule = Schedule.parse(plan.pp_schedule)
        if schedule.p != p:
            raise ValueError(f"the custom schedule has {schedule.p} ranks, the mesh has pp={p}")
    simulate(schedule)     # a schedule that would deadlock fails here, before any process waits
    rows = _batch_rows(args, kwargs)
    if len(rows) != 1:
        raise ValueError(f"the example inputs' batch sizes along dim 0 are {rows}: a pipeline cuts one batch "
                         "into micro-batches; give every batched input the same number of rows")
    _batch_rows(args, kwargs, n, m)
    ctx.microbatch_rows = rows[0] // m
    mb_args, mb_kwargs = _slice(args, kwargs, m, 0)     # the logical graph of one micro-batch
    laid = _lower_graph(source, ctx, mb_args, mb_kwargs, cluster, rows=rows[0], part=(n, 0), microbatches=m,
                        cut=lambda gm: _cut_stages(gm, ctx))
    return schedule, laid


def _cut_stages(gm, ctx: CompileContext):
    """The pipeline's cut of the logical graph ``gm`` (snapshotted), and each stage this rank
    holds as (stage spec, its context, its graph, snapshot prefix), one at a time: the driver
    (``_lower_graph``) runs the passes over a stage before the next is taken."""
    p = ctx.mesh.axis_size("pp")
    heads = tied_head_layouts(gm, ctx) if ctx.plan.tp else {}   # on the whole graph: both copies of a table alike
    top = passes.pipeline(gm, ctx)
    ctx.snapshots.append(("pipeline", top.code + "".join(
        f"\n# ---- stage {k} ----\n{graph_text(top.get_submodule(f'stage_{k}'))}" for k in range(len(ctx.stages)))))
    shared = {name: heads.get(name, ("R", None)) for name in ctx.params if sum(name in s.params for s in ctx.stages) > 1}
    ctx.notes += [note for _, note in shared.values() if note]
    for spec in ctx.stages:
        if spec.index % p != ctx.mesh.coordinate("pp"):
            continue
        sgm = top.get_submodule(f"stage_{spec.index}")
        yield spec, _stage_context(ctx, spec, sgm, shared), sgm, f"stage{spec.index}_"


COLLECT_BYTES = 64 << 20


def _collect(ctx: CompileContext) -> None:
    """export leaves reference cycles that hold the original weights: they are young, and a
    collection of the two younger generations frees them (milliseconds). A model of
    ``COLLECT_BYTES`` of parameters and buffers or more also gets a full collection, in case
    some were promoted to the oldest (a full collection costs about half a second in a process
    that imported torch, a large part of compiling a small model)."""
    if sum(math.prod(info.shape) * info.dtype.itemsize for info in ctx.params.values()) >= COLLECT_BYTES:
        gc.collect()
    else:
        gc.collect(1)


def _stage_context(ctx: CompileContext, spec, sgm, shared) -> CompileContext:
    plan = ctx.plan
    tied = tuple((name, shared[name][0]) for name in shared if name in spec.params)
    if plan.tp and tied:    # both copies of a tied weight keep one layout along tp: whole, or an LM head's split
        plan = dataclasses.replace(plan, tp_layout=plan.tp_layout + tied)
    sctx = CompileContext(mesh=ctx.mesh, plan=plan)
    sctx.params = {name: ctx.params[name] for name in spec.held}
    sctx.captured_training, sctx.mode_difference = ctx.captured_training, ctx.mode_difference
    sctx.head_policy = ctx.head_policy
    sctx.device_type = ctx.device_type
    sctx.recompute_layers = ctx.recompute_layers
    n = ctx.mesh.axis_size("dp")
    vals = [x.meta.get(meta.VAL) for x in sgm.graph.nodes if x.op == "placeholder"]
    sctx.in_spec = pytree.tree_flatten((tuple(vals), {}))[1]
    sctx.out_spec = pytree.tree_flatten(tuple(spec.outputs))[1]
    sctx.input_shapes = tuple((v.shape[0] // n,) + tuple(v.shape[1:]) if v.dim() else tuple(v.shape) for v in vals)
    sctx.input_dtypes = tuple(v.dtype for v in vals)
    sctx.microbatch_rows = ctx.microbatch_rows
    if tied:
        sctx.notes.append(f"tied across stages (gradients summed after the step): {', '.join(n for n, _ in tied)}")
    return sctx


def _batch_rows(args: tuple, kwargs: dict, dp: int = 1, microbatches: int = 1) -> list[int]:
    """The example inputs' distinct sizes along dim 0 (0-d tensors aside), each checked to split
    into ``dp`` ranks x ``microbatches`` equal parts (a ValueError naming the axis otherwise)."""
    rows = sorted({t.shape[0] for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim()})
    for r in rows:
        error = batch_split_error(r, dp, microbatches)
        if error:
            raise ValueError(error)
    return rows


def _slice(args: tuple, kwargs: dict, n: int, i: int):
    """Part ``i`` of ``n`` of every tensor input along dim 0 (a 0-d tensor whole)."""
    return pytree.tree_map(lambda t: slice_batch(t, n, i) if isinstance(t, torch.Tensor) else t, (args, kwargs))


def _shapes(tree) -> tuple:
    return tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in pytree.tree_leaves(tree))


def _dtypes(tree) -> tuple:
    return tuple(x.dtype if isinstance(x, torch.Tensor) else None for x in pytree.tree_leaves(tree))


def _recompute_budget(ctx: CompileContext, cluster, rows: int) -> None:
    """``Plan(recompute=<bytes>)``: what each layer recomputes, chosen by the cost model
    (``cost.estimate.choose_recompute``) so that the predicted peak fits the budget; noted for
    ``explain()``. Every rank computes the same choice from the same profile."""
    budget = ctx.plan.recompute
    if isinstance(budget, str):
        return
    if ctx.profile is None:
        raise ValueError(f"Plan(recompute={budget}) needs the cost model's profile of the graph to choose what "
                         "to recompute, and none could be made (see the log); give recompute='selective' or "
                         "'full' instead")
    c = get_cluster(cluster if cluster is not None else "local")
    est = evaluate_plan(ctx.profile, dict(ctx.mesh.axes), ctx.plan, c, rows)
    ctx.recompute_layers = {g.name: est.recompute_layers.get(g.name, "none") for g in ctx.profile.groups
                            if is_layer(g.name)}
    ctx.notes.append(f"recompute within {budget:,} B per rank: predicted peak {est.memory_bytes:,.0f} B with "
                     + (", ".join(f"{k} {v}" for k, v in est.recompute_layers.items()) or "nothing recomputed"))


def _profile(gm, ctx: CompileContext):
    """A callable that makes the cost model's profile of the logical graph for this plan's tp /
    sp (numbers only: ``dm.predict``, ``dm.explain`` and a memory budget read it, through
    ``ctx.profile``): the graph as it is now, its tensors on the meta device, and what the
    profile reads of the context are copied here (the passes go on to rewrite both), the
    profile is made when first read; None, with a logged reason, if it fails."""
    # on the meta device: the profile reads shapes, and the model's full-size weights must not
    # outlive the compile here (a sharded plan frees them once compiled)
    memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in gm.parameters()}
    memo.update({id(b): torch.empty_like(b, device="meta") for b in gm.buffers()})
    captured = CompileContext(mesh=ctx.mesh, plan=ctx.plan)
    graph = copy_captured(gm, ctx, captured, memo)

    def make():
        # a pipeline cut by now: its stages as the pass cut them (a stage may end inside a layer)
        starts = tuple(spec.nodes[0] for spec in ctx.stages[1:])
        try:
            return profile(graph, captured, tp=ctx.mesh.axis_size("tp") if ctx.plan.tp else 1, sp=ctx.plan.sp,
                           tp_layout=ctx.plan.tp_layout, vocab_parallel=ctx.plan.vocab_parallel,
                           dropout_math=ctx.plan.dropout_rng == "exact",   # local: attention stays fused
                           stage_starts=starts)
        except Exception as exc:     # the cost model must never stop a compile
            log.warning("autopar: no cost-model profile for this graph (%s: %s)", type(exc).__name__, exc)
            return None
    return make


# ---- plan="auto" -------------------------------------------------------------------------------------

def _resolve_plan(plan: Union[Plan, str], mesh: Mesh, model, example_inputs, example_kwargs,
                  cluster, base: Optional[Plan] = None) -> tuple[Plan, str]:
    _check_base(plan, base)
    if isinstance(plan, Plan):
        return plan, "given by the user"
    if plan == "auto":
        return _auto_plan(mesh, model, example_inputs, example_kwargs, cluster, base)
    raise ValueError(f"plan={plan!r} is not a plan: pass plan='auto' or an autopar.Plan(...), "
                     "e.g. Plan(dp='zero2')")


def _check_base(plan, base) -> None:
    """``base`` is plan='auto''s: a given plan carries every field itself."""
    if base is None:
        return
    if not isinstance(base, Plan):
        raise TypeError(f"base must be an autopar.Plan (the fields plan='auto' keeps), got {base!r}")
    if plan != "auto":
        raise ValueError(f"base={base} is for plan='auto' (the fields the planner does not choose); with "
                         f"plan={plan} set those fields in the plan itself")


def _auto_plan(mesh: Mesh, model, example_inputs, example_kwargs, cluster,
               base: Optional[Plan] = None) -> tuple[Plan, str]:
    """plan='auto': rank 0 runs the planner over the plans this mesh's axes allow (recomputation
    included: the plan it returns carries it) and broadcasts its choice, so every rank
    compiles the same program whatever its own measurements would say."""
    chosen = [None, None]
    if mesh.rank == 0 or mesh.virtual:
        try:
            c = get_cluster(cluster if cluster is not None else "local")
            rows = _batch_rows(tuple(example_inputs), dict(example_kwargs or {}))
            profiles = Profiles(model, example_inputs, example_kwargs, cluster=c, dropout_math=True)   # as it will run
            report = find_plan(model, mesh.size, example_inputs=example_inputs, example_kwargs=example_kwargs,
                               cluster=c, global_batch=max(rows) if rows else None, mesh_axes=dict(mesh.axes),
                               profiles=profiles, base=base)
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


# ---- the cost model's entry points ----------------------------------------------------------------------

def estimate(model, mesh: Mesh, plan: Union[Plan, str] = "auto", *, example_inputs, example_kwargs=None,
             cluster="local", global_batch: Optional[int] = None, recompute=None,
             flash_attention: bool = True, profiles: Optional[Profiles] = None,
             base: Optional[Plan] = None) -> Estimate:
    """Predict ``plan`` for ``model`` on ``mesh`` (real or ``virtual=True``) and ``cluster`` (a
    preset name or an ``autopar.cost.cluster.Cluster``) without running it: per-rank step time,
    memory, bytes and bubble (``autopar.cost.estimate.Estimate``). ``example_inputs`` are one
    batch (meta tensors are fine); ``global_batch`` (rows per step, default: the example's)
    scales it. ``recompute`` (``none``, ``selective``, ``full`` or a budget in bytes) overrides
    the plan's ``recompute``;
    ``flash_attention=False`` models attention that keeps its a·s² probabilities. The step is
    priced in the plan's precision (``param_dtype``, ``reduce_dtype``, ``master_dtype``), else
    in the model's own dtype, whatever the cluster.
    ``plan="auto"`` asks the planner first (``base``: the fields it does not choose, as for
    ``compile``)."""
    _check_base(plan, base)
    if plan == "auto":
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be an autopar.Mesh, got {type(mesh).__name__}")
        profiles = profiles or Profiles(model, example_inputs, example_kwargs, flash=flash_attention,
                                        cluster=cluster)
        plan = find_plan(model, mesh.size, example_inputs=example_inputs, example_kwargs=example_kwargs,
                         cluster=cluster, global_batch=global_batch, mesh_axes=dict(mesh.axes),
                         profiles=profiles, base=base).plan
    return estimate_plan(model, mesh, plan, example_inputs=example_inputs, example_kwargs=example_kwargs,
                         cluster=cluster, global_batch=global_batch, recompute=recompute,
                         flash_attention=flash_attention, profiles=profiles)


def plan(model, world_size: int, *, example_inputs, example_kwargs=None, cluster="local",
         global_batch: Optional[int] = None, top: int = 10, exhaustive: bool = False,
         mesh_axes: Optional[dict] = None, recompute=("none", "selective", "full"), flash_attention: bool = True,
         profiles: Optional[Profiles] = None, detail: bool = True, base: Optional[Plan] = None,
         param_dtype: Optional[torch.dtype] = None, reduce_dtype: Optional[torch.dtype] = None) -> PlanReport:
    """Search the plans of ``world_size`` devices of ``cluster`` for the fastest that fits in
    device memory (``autopar.cost.planner``: mesh factorisations, ZeRO stage, sequence
    parallelism, schedule, micro-batches, stages per rank, recomputation); ``example_inputs``
    are one batch (meta tensors are fine), ``global_batch`` the rows per step (default: the
    example's); ``mesh_axes`` restricts the search to one mesh shape. Every candidate keeps
    the fields of ``base`` the search does not choose (default ``Plan()``): its precision,
    offload, buckets; ``param_dtype`` and ``reduce_dtype`` set those of ``base``
    (``param_dtype=torch.bfloat16`` plans a mixed-precision run, priced and returned as one).
    Returns a PlanReport (the chosen plan, its top candidates and why each lost); raises
    InfeasiblePlan, with the smallest memory any plan needs, when nothing fits."""
    if base is not None and not isinstance(base, Plan):
        raise TypeError(f"base must be an autopar.Plan, got {base!r}")
    precision = {k: v for k, v in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)) if v is not None}
    base = dataclasses.replace(base or Plan(), **precision) if precision else base
    return find_plan(model, world_size, example_inputs=example_inputs, example_kwargs=example_kwargs,
                     cluster=cluster, global_batch=global_batch, top=top, exhaustive=exhaustive,
                     mesh_axes=mesh_axes, recompute=recompute, flash_attention=flash_attention,
                     profiles=profiles, detail=detail, base=base)
