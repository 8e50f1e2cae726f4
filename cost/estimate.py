"""The detailed estimate: predicted step time, memory and bytes of a plan, without running it
(``autopar.estimate``, ``dm.predict``).

The prediction composes the cost model's pieces over the profile of the compiled graph
(``cost.profile``: per layer, this rank's FLOPs, bytes, saved activations, tensor-parallel
collectives and parameters):

- compute: each layer's forward as the roofline of its op classes, summed
  (``cost.compute.group_time``); backward twice the forward's arithmetic (input and weight
  gradients) and ``Device.backward_op_ratio`` times its ops' dispatch (measured on the local
  CPU: about 1.2, not 2: a backward runs gradient kernels, not every forward op twice);
  full recomputation adds a forward, selective recomputation the attention's;
- communication: ``cost.comm``'s alpha-beta time of each collective on the link of its mesh
  axis (``Cluster.link_for``); tensor-parallel collectives sit on the compute stream (they
  block the next op); data-parallel ones on a communication stream that overlaps compute as
  the runtime does with the overlap pass (ZeRO-3 prefetches the next layer's gather;
  gradient buckets, cut as the collectives pass cuts them (``autopar.sizes``), ZeRO-1's too,
  are reduced while backward continues; ZeRO-1/2's parameter all-gathers after the step, one
  per bucket as the runtime issues them, each with its latency and its copies, are exposed); with
  ``Plan(overlap=False)`` every collective is exposed, one after another;
- optimizer offload (``Plan(offload="optimizer")``, ``cost.offload``): the device's optimizer
  step becomes the step on the host, and the host link's copies go where the runtime issues
  them: each gradient bucket's copy down as the bucket lands (on the compute lane, beside the
  next bucket's reduction; the last one after the final reduction), the parameters' copies
  up a bucket at a time after the step, pipelined with ZeRO-1/2's replica all-gathers; the
  optimizer state leaves the device's memory;
- pipeline: the plan's schedule replayed in event time (``cost.pipeline``) with each stage's F,
  B (and W) times and the point-to-point transfer of the activations that cross each cut;
  the deferred data-parallel reduction and the optimizer step follow. Stages are cut between
  layers, balanced (``partition``); with more stages than layers, where the pipeline pass
  cuts, inside layers (``Profiles.cut``; a compiled module's profile has its own stages);
- memory: a walk over the step as the runtime allocates it (``cost.peak_memory``): what persists
  between steps, the activations the schedule keeps in flight, ZeRO-3's gathered units, the
  gradients and bucket buffers of backward, the optimizer's temporaries.

Precision is the plan's (``cost.memory.precision``): without ``param_dtype`` the model's own
dtype throughout (an fp32 model: fp32 activations and collectives, 16 B of model states per
parameter under ddp, its matmuls at the device's fp32 peak, TF32's where the preset uses it);
with it the profile is of the program compile captures (the model's copy in ``param_dtype``,
``passes.autocast``'s casts for the cluster's device), ZeRO-3 gathers and ZeRO-1/2 replicas in
``param_dtype``, gradient sums in ``plan.grad_reduce_dtype``, model states as the runtime keeps
them (``autopar.sizes.mixed_state_dtypes``).

The modules: ``cost.result`` (``Estimate``), ``cost.profile_cache`` (``Profiles``),
``cost.step_parts`` (the pieces of a step the planner's closed form, ``cost.planner``, reads
too: ``group_passes``, ``saved_bytes``, ``optimizer_time``, ...), ``cost.data_parallel``,
``cost.single_stage``, ``cost.pipeline``, ``cost.peak_memory``, and the step composed
(``cost.step_layout``, ``cost.step_time``, ``cost.step_report``); this one lays the step out and
puts the estimate together. ``simulate=False`` (the planner's detailed re-ranking at scale)
replaces the two event-time replays by their closed forms, which equal them for uniform layers.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union

from autopar.mesh import Mesh
from autopar.planspec import Plan
from autopar.sizes import batch_split_error, inflight_microbatches

from .cluster import get_cluster
from .data_parallel import stage_sync
from .memory import precision
from .peak_memory import rank_peak, schedule_flight
from .pipeline import loss_broadcast_time, partition, pipeline_placement, stage_caveats, tied_exchange_time
from .profile import Profile, is_layer
from .profile_cache import Profiles, autocast_device
from .result import Estimate
from .step_layout import RECOMPUTE_MODES, StepLayout, pipeline_bytes, recompute_kinds, stage_names
from .step_parts import group_passes, oversubscription, saved_bytes
from .step_report import host_link_totals, step_formulas
from .step_time import StepEnd, step_end, time_pipeline, time_single_stage

# the public entry: what autopar's front end, the tests and the benchmarks import from here
__all__ = ["Estimate", "estimate_plan", "evaluate_plan", "predict_module", "Profiles", "partition", "autocast_device",
           "choose_recompute", "saved_bytes", "group_passes", "loss_broadcast_time", "tied_exchange_time",
           "RECOMPUTE_MODES"]


# ---- the public functions -----------------------------------------------------------------------

def predict_module(dm, cluster="local", global_batch=None, recompute=None) -> Estimate:
    """``dm.predict``: the estimate of a compiled module's plan from the profile of the graph it
    was compiled from (``global_batch`` defaults to the example's)."""
    prof = dm.ctx.profile
    if prof is None:
        raise RuntimeError("no cost-model profile was recorded at compile time (see the log for why)")
    rows = global_batch or prof.rows * (dm.plan.microbatches if dm.plan.pp_schedule else 1)
    if recompute is None and dm.ctx.recompute_layers and not isinstance(dm.plan.recompute, str):
        recompute = dm.ctx.recompute_layers      # a budget: the layers compile chose
    return evaluate_plan(prof, dict(dm.mesh.axes), dm.plan, get_cluster(cluster), rows, recompute=recompute)


def estimate_plan(model, mesh: Mesh, plan: Plan, *, example_inputs, example_kwargs=None, cluster="local",
                  global_batch: Optional[int] = None, recompute=None, flash_attention: bool = True,
                  profiles: Optional[Profiles] = None) -> Estimate:
    """The prediction of ``plan`` for ``model`` on ``mesh`` (``autopar.estimate`` without the
    planner: see there). ``recompute`` overrides the plan's (None: the plan's)."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be an autopar.Mesh, got {type(mesh).__name__}")
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be an autopar.Plan or 'auto', got {plan!r}")
    plan.check_mesh(mesh)
    if recompute is not None:
        plan = dataclasses.replace(plan, recompute=recompute)   # validated as a plan's
    profiles = profiles or Profiles(model, example_inputs, example_kwargs, flash=flash_attention, cluster=cluster)
    gb = global_batch or profiles.base.rows
    return evaluate_plan(profiles, dict(mesh.axes), plan, get_cluster(cluster), gb, recompute=recompute)


def evaluate_plan(profiles: Union[Profiles, Profile], axes: dict, plan: Plan, c, global_batch: int, *,
                  simulate: bool = True, recompute=None) -> Estimate:
    """The prediction of ``plan`` on a mesh of ``axes`` (name -> size) for cluster ``c``.
    ``recompute``: ``none`` / ``selective`` / ``full``, a dict of layer -> one of them, or a
    memory budget in bytes (``choose_recompute``); default: the plan's ``recompute``."""
    rc = plan.recompute if recompute is None else recompute
    if isinstance(rc, int) and not isinstance(rc, bool):
        return choose_recompute(profiles, axes, plan, c, global_batch, rc, simulate=simulate)
    s = _layout(profiles, axes, plan, c, global_batch, rc)
    # data parallelism, per stage: a stage holds every parameter it reads (a tied table lives in
    # each stage reading it)
    syncs = [stage_sync(gs, {name: s.prof.shapes[name] for name in stage_names(s, gs)}, plan, s.n, s.m, s.pr,
                        s.link_dp, s.f_stage[k], c) for k, gs in enumerate(s.stage_groups)]
    p2p_bytes, tied_bytes = pipeline_bytes(s)
    end = step_end(s, syncs)
    timeline, formulas = [], []
    if s.S == 1:
        tm = time_single_stage(s, syncs[0], end, timeline, formulas, simulate)
    else:
        tm = time_pipeline(s, syncs, end, p2p_bytes, tied_bytes, timeline, formulas, simulate)
    by_axis = _bytes_per_rank(s, syncs, p2p_bytes, tied_bytes)
    total, st, act, transient, worst = _memory_per_rank(s, end, p2p_bytes)
    host_bytes = host_memory = 0.0
    host_times, host_formula = {}, None
    if plan.offload == "optimizer":
        host_times = {"host step": max(end.opt_time), "host link down (exposed)": tm.host_exposed[0],
                      "host link up (exposed)": tm.host_exposed[1]}    # what the copies add to the step
        host_bytes, host_memory, host_formula = host_link_totals(s, syncs)
    psi_total = sum(syncs[k].psi for k in range(s.S) if k % s.p == worst)
    formulas += step_formulas(s, end, st, act, psi_total, by_axis, tm.bubble, host_formula)
    device_mem = float(c.device.memory_bytes)
    return Estimate(plan=plan, mesh_axes=dict(axes), cluster=c.name, global_batch=global_batch,
                    step_time_s=tm.step, memory_bytes=total, comm_bytes=sum(by_axis.values()),
                    bubble_fraction=tm.bubble, compute_s=tm.compute, exposed_comm_s=max(0.0, tm.exposed),
                    comm_bytes_by_axis=by_axis,
                    memory_breakdown={"model states": st, "activations": act, "transient": transient},
                    time_breakdown={"forward (busiest stage)": tm.forward, "backward (busiest stage)": tm.backward,
                                    "optimizer": max(end.opt_time), **host_times},
                    formulas=formulas, timeline=timeline, fits=total <= device_mem, device_memory=device_mem,
                    host_bytes=host_bytes, host_memory_bytes=host_memory,
                    recompute_layers={k: v for k, v in s.kinds.items() if v != "none"},
                    caveats=([] if s.as_cut else stage_caveats(s.groups, s.S)) + (
                        [profiles.caveats[plan.param_dtype]] if isinstance(profiles, Profiles)
                        and plan.param_dtype in profiles.caveats else []))


# ---- the step laid out -------------------------------------------------------------------------------

def _layout(profiles, axes: dict, plan: Plan, c, global_batch: int, rc) -> StepLayout:
    """The step of ``plan`` laid out: the profile (cut where the pipeline pass cuts when there
    are more stages than layers), its groups scaled to a micro-batch and priced
    (``group_passes``), and cut into stages (the pipeline pass's own, else ``partition``)."""
    p, n, t = axes.get("pp", 1), axes.get("dp", 1), axes.get("tp", 1)
    m, v = (plan.microbatches, plan.virtual_stages) if plan.pp_schedule else (1, 1)
    prof = profiles.get(t, plan.sp, plan.vocab_parallel, plan.param_dtype) if isinstance(profiles, Profiles) \
        else profiles
    if isinstance(profiles, Profiles) and p * v > max(1, len(prof.layers)):
        # more stages than layers: cut where the pipeline pass cuts, inside layers
        prof = profiles.cut(t, plan.sp, plan.vocab_parallel, plan, axes, global_batch)
    kinds = recompute_kinds(prof, rc)
    error = batch_split_error(global_batch, n, m)
    if error:
        raise ValueError(error)
    k = global_batch / (n * m) / prof.rows
    groups = [g.scaled(k) for g in prof.groups]
    # bytes per element of each copy the runtime makes (the plan's dtypes, else the model's)
    pr = precision(plan, plan.dp, prof.param_bytes)
    slow = oversubscription(c, axes)
    world = math.prod(axes.values())
    S = p * v
    # ranks sharing cores: a single stage's ranks all compute at once (each slowed by the
    # measured slowdown); a pipeline's replay shares the cores as its ranks compute and idle,
    # each slowed by the ranks computing at that moment (``pipeline_placement`` is read from this
    # module's namespace: benchmarks/replay_ab.py swaps it for the variants it compares)
    shared = pipeline_placement(p, world, c.gpus_per_node, c.slowdown) if (slow > 1 and S > 1) else None
    cslow = 1.0 if shared else slow
    link_tp, link_dp, link_pp = (c.link_for(axes, axis) for axis in ("tp", "dp", "pp"))
    # per group: forward / backward / W compute and the tp collectives on the compute stream
    passes = [group_passes(g, c, t, link_tp, kinds.get(g.name, "none"), cslow) for g in groups]
    F, B, W, f_raw, tpf, tpb = (list(x) for x in zip(*passes))
    as_cut = S > 1 and len(prof.stage_starts) == S     # the pipeline pass's own stages (Profile.stage_starts)
    if S == 1:
        starts = [0]
    elif as_cut:
        starts = list(prof.stage_starts)
    else:
        starts = partition([f + b for f, b in zip(F, B)], S)
    bounds = list(zip(starts, starts[1:] + [len(groups)]))
    return StepLayout(plan, axes, c, p, n, t, m, v, prof, kinds, groups, pr, slow, world, shared, cslow,
                      link_tp, link_dp, link_pp, F, B, W, f_raw, tpf, tpb, as_cut, bounds)


# ---- bytes and memory per rank ---------------------------------------------------------------------

def _bytes_per_rank(s: StepLayout, syncs: list, p2p_bytes: list, tied_bytes: float) -> dict:
    """The busiest rank's bytes sent per step, by mesh axis."""
    S, p, m = s.S, s.p, s.m
    per_rank = []
    for r in range(p):
        mine = [k for k in range(S) if k % p == r]
        tot = {}
        tp_b = m * sum(b for k in mine for g in s.stage_groups[k] for _, b, _ in g.tp_forward + g.tp_backward
                       + (g.tp_forward if s.kinds.get(g.name) == "full" else []))   # a recomputed layer's again
        if s.t > 1:
            tot["tp"] = tp_b
        if s.n > 1:
            tot["dp"] = sum(b for k in mine for b in syncs[k].comm_bytes.values())
        if p > 1:
            sends = sum(m * p2p_bytes[k] for k in mine if k < S - 1) + sum(m * p2p_bytes[k - 1] for k in mine if k > 0)
            tot["pp"] = sends + (tied_bytes if any(_holds_tied(s.prof, s.stage_groups[k]) for k in mine) else 0.0)
        per_rank.append(tot)
    worst = max(range(p), key=lambda r: sum(per_rank[r].values()))
    return per_rank[worst]


def _holds_tied(prof: Profile, gs) -> bool:
    names = set().union(*(g.reads for g in gs))
    return any(x in names for x in prof.tied)


def _memory_per_rank(s: StepLayout, end: StepEnd, p2p_bytes: list) -> tuple:
    """(peak, model states, activations, transient, rank) of the rank of the highest peak
    (``rank_peak``)."""
    plan, S, p, m = s.plan, s.S, s.p, s.m
    mem_rank = []
    # a stage's received inputs, per micro-batch: held from its forward to its backward (the runtime
    # keeps them to take their gradients), beside the sender's own copy
    received_by = [p2p_bytes[k - 1] if k > 0 and p > 1 else 0.0 for k in range(S)]
    for r in range(p):
        mine = [k for k in range(S) if k % p == r]
        gs = [g for k in mine for g in s.stage_groups[k]]
        received = [received_by[k] if i == 0 else 0.0 for k in mine for i in range(len(s.stage_groups[k]))]
        flight, w_extra = schedule_flight(plan, p, m, s.v, s.stage_groups, s.kinds, r, s.pr.compute, received_by) \
            if S > 1 else (inflight_microbatches(plan.pp_schedule, p, m, s.v, stage=r), 0.0)
        mem_rank.append(rank_peak(gs, stage_names(s, gs), s.prof, plan.dp, s.n, end.pr_device, plan.bucket_bytes,
                                  s.kinds, flight, S > 1, staging=s.c.name == "local",
                                  offload=plan.offload == "optimizer", extra=w_extra, received=received,
                                  parts=[s.stage_groups[k] for k in mine] if S > 1 else None, microbatches=m))
    worst = max(range(p), key=lambda r: mem_rank[r][0])
    return (*mem_rank[worst], worst)


# ---- a memory budget ----------------------------------------------------------------------------------

def choose_recompute(profiles, axes: dict, plan: Plan, c, global_batch: int, budget: int, *,
                     simulate: bool = True) -> Estimate:
    """``Plan(recompute=<bytes>)``: the estimate of the cheapest recomputation whose predicted
    peak per rank fits ``budget``. The choices are taken in order of cost, each adding to the
    last: the attention core of each layer that keeps a·s² scores (selective: a layer's
    attention FLOPs again), layer by layer; then whole layers (full: a layer's forward again),
    layer by layer. The peak falls along this order, so the first prefix that fits is found by
    bisection. A ValueError says how far the budget is from what full recomputation needs."""
    prof = profiles.get(axes.get("tp", 1), plan.sp, plan.vocab_parallel) if isinstance(profiles, Profiles) else profiles
    layers = [g for g in prof.groups if is_layer(g.name)]
    steps = [(g.name, "selective") for g in layers if g.saved_quadratic > 0] + [(g.name, "full") for g in layers]

    def at(k: int) -> Estimate:
        kinds = {g.name: "none" for g in layers}
        kinds.update(dict(steps[:k]))
        return evaluate_plan(profiles, axes, plan, c, global_batch, simulate=simulate, recompute=kinds)

    lo, hi = 0, len(steps)
    last = at(hi)
    if last.memory_bytes > budget:
        raise ValueError(f"Plan(recompute={budget}): no recomputation fits {budget / 2**20:.1f} MiB per rank; "
                         f"recomputing every layer the cost model predicts {last.memory_bytes / 2**20:.1f} MiB "
                         f"({plan} on {axes}). Raise the budget, or shard more (a higher ZeRO stage, tp, pp)")
    best = last
    while lo < hi:
        mid = (lo + hi) // 2
        e = at(mid)
        if e.memory_bytes <= budget:
            hi, best = mid, e
        else:
            lo = mid + 1
    best.formulas.append(("recompute within budget", f"peak <= {budget:,} B",
                          f"{best.memory_bytes:,.0f} B with {len(best.recompute_layers)} of {len(layers)} layers "
                          f"recomputed ({', '.join(f'{k} {v}' for k, v in best.recompute_layers.items()) or 'none'})"))
    return best


