"""``autopar.estimate``: predicted step time, memory and bytes of a plan, without running it.

The prediction composes the cost model's pieces over the profile of the compiled graph
(``autopar.profile``: per layer, this rank's FLOPs, bytes, saved activations, tensor-parallel
collectives and parameters):

- compute: each layer's forward on a roofline, max(FLOPs / (peak · efficiency), bytes /
  (memory bandwidth · efficiency)); backward twice the forward (input and weight gradients);
  full recomputation adds a forward, selective recomputation the attention's;
- communication: ``cost.comm``'s alpha-beta time of each collective on the link of its mesh
  axis (``Cluster.axis_link``); tensor-parallel collectives sit on the compute stream (they
  block the next op); data-parallel ones on a communication stream that overlaps compute as
  the runtime does with the overlap pass (ZeRO-3 prefetches the next layer's gather;
  gradient buckets, ZeRO-1's too, are reduced while backward continues; ZeRO-1/2's parameter
  all-gather after the step is exposed); with ``Plan(overlap=False)`` every collective is
  exposed, one after another;
- pipeline: the plan's schedule replayed in event time with each stage's F, B (and W) times
  and the point-to-point transfer of the activation that crosses each cut; the deferred
  data-parallel reduction and the optimizer step follow;
- memory: ``cost.memory``'s ZeRO formula over this rank's parameters, the activations the
  schedule keeps in flight, and the transient gathered parameters of ZeRO-3.

``simulate=False`` (the planner's inner loop) replaces the two event-time replays by their
closed forms, which equal them for uniform layers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

from autopar.capture import capture
from autopar.context import CompileContext
from autopar.mesh import Mesh
from autopar.planspec import Plan
from autopar.schedule import bubble_formula
from autopar.sizes import inflight_microbatches
from autopar.trace import ChromeTrace

from .cluster import get_cluster
from .comm import collective_time, pipeline_hop_time
from .compute import GROUP_TIME_FORMULA, compute_time, group_time
from .formulas import N as SYM_N, PSI, dp_comm_elements
from .memory import FP32, MIXED_PRECISION, model_state_bytes
from .profile import GroupCost, Profile, profile
from .replay import pipeline_placement, pipeline_time

__all__ = ["Estimate", "estimate_plan", "evaluate_plan", "predict_module", "Profiles", "partition"]

# autopar's data-parallel runtime dispatches per parameter tensor and step, besides the arithmetic
# (flattening into buckets, ZeRO's padded chunks and shard views; ZeRO-3's gathered units laid
# back into parameters, forward and backward; ZeRO-1/2's copy of the gathered parameters into
# the replicas after the step), in ops of the local preset's op_overhead (~6.5 us as compiled
# modules run them). ddp: the compiled module against the plain model at dp=1, +0.9 ms for 52
# tensors, less the pass overhead (~0.35 ms). The others: thread CPU time of a step against
# ddp's, same model, world 2 (one process per core; benchmarks/bench_plan.py's small GPT):
# ZeRO-1/2 +0.3 ms in backward and +0.7 ms in the optimizer, ZeRO-3 +6.9 ms in forward and
# backward.
SYNC_OPS_PER_TENSOR = {"ddp": 2, "zero1": 3, "zero2": 3, "zero3": 22}
GATHER_OPS_PER_TENSOR = {"zero1": 2, "zero2": 2}


# ---- results ------------------------------------------------------------------------------

@dataclass
class Estimate:
    """A plan's predicted step on one mesh and cluster. Times in seconds, sizes in bytes, per
    rank (the busiest pipeline rank where ranks differ)."""
    plan: Plan
    mesh_axes: dict
    cluster: str
    global_batch: int
    step_time_s: float
    memory_bytes: float
    comm_bytes: float
    bubble_fraction: float
    compute_s: float = 0.0
    exposed_comm_s: float = 0.0
    comm_bytes_by_axis: dict = field(default_factory=dict)
    memory_breakdown: dict = field(default_factory=dict)
    time_breakdown: dict = field(default_factory=dict)
    formulas: list = field(default_factory=list)     # (what, formula, value)
    timeline: list = field(default_factory=list)     # (rank, lane, name, start, end)
    fits: bool = True
    device_memory: float = 0.0

    def explain(self) -> str:
        mesh = ", ".join(f"{k}={v}" for k, v in self.mesh_axes.items())
        lines = [f"estimate: {self.plan} on Mesh({mesh}), cluster {self.cluster}, global batch {self.global_batch}",
                 f"  step time       {self.step_time_s * 1e3:12.3f} ms   (compute {self.compute_s * 1e3:.3f} ms, "
                 f"exposed communication {self.exposed_comm_s * 1e3:.3f} ms, bubble {self.bubble_fraction:.1%})",
                 f"  memory / rank   {self.memory_bytes / 2**30:12.3f} GiB  "
                 f"({'fits' if self.fits else 'DOES NOT FIT'} in {self.device_memory / 2**30:.1f} GiB)",
                 f"  bytes / rank    {self.comm_bytes:14,.0f} B per step"]
        for k, v in self.memory_breakdown.items():
            lines.append(f"    memory {k:18s} {v / 2**20:14.3f} MiB")
        for k, v in self.comm_bytes_by_axis.items():
            lines.append(f"    bytes  {k:18s} {v:14,.0f} B")
        for k, v in self.time_breakdown.items():
            lines.append(f"    time   {k:18s} {v * 1e3:14.3f} ms")
        if self.formulas:
            lines.append("  formulas (symbolic = value):")
            lines += [f"    {what}: {formula} = {value}" for what, formula, value in self.formulas]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()

    def add_lanes(self, trace: ChromeTrace, pid_of=lambda rank: rank) -> None:
        """The predicted step's compute and communication lanes, rank r as process ``pid_of(r)``."""
        for rank, lane, name, start, end in self.timeline:
            pid = pid_of(rank)
            trace.process(pid, f"rank {rank} (predicted): step {self.step_time_s * 1e3:.2f} ms, exposed "
                               f"communication {self.exposed_comm_s * 1e3:.2f} ms", ("compute", "communication"))
            trace.span(pid, 0 if lane == "compute" else 1, name, start, end, f"predicted {lane}")

    def chrome_trace(self) -> dict:
        """The simulated step as a Chrome / Perfetto trace: a compute and a communication lane
        per simulated rank."""
        trace = ChromeTrace()
        self.add_lanes(trace)
        return trace.as_dict()

    def write_chrome_trace(self, path: str) -> None:
        trace = ChromeTrace()
        self.add_lanes(trace)
        trace.write(path)


# ---- profiles per tensor-parallel variant ------------------------------------------------------

class Profiles:
    """``autopar.profile`` results per (tp size, sp), captured once and re-annotated per
    variant: the planner's cache."""

    def __init__(self, model, example_inputs, example_kwargs=None, *, flash: bool = True):
        self._ctx = CompileContext(mesh=Mesh(dp=1, virtual=True), plan=Plan())
        self._gm = capture(model, tuple(example_inputs), dict(example_kwargs or {}), self._ctx)
        self.flash = flash
        self._cache: dict = {}

    def get(self, tp: int, sp: bool) -> Profile:
        key = (tp, sp and tp > 1)
        if key not in self._cache:
            self._cache[key] = profile(self._gm, self._ctx, tp=tp, sp=key[1], flash=self.flash)
        return self._cache[key]

    @property
    def base(self) -> Profile:
        return self.get(1, False)


# ---- the model -----------------------------------------------------------------------------------

def _comm_list_time(items, p: int, link, after: float | None = None) -> float:
    return sum(collective_time(kind, nbytes / _ring_factor(kind, p), p, link, after=after) for kind, nbytes, _ in items)


def _ring_factor(kind: str, p: int) -> float:
    """Per-rank bytes = factor · buffer bytes (the counters record per-rank bytes)."""
    if p <= 1:
        return 1.0
    return {"all_gather": (p - 1) / p, "reduce_scatter": (p - 1) / p, "all_reduce": 2 * (p - 1) / p}.get(kind, 1.0)


def partition(times: list[float], stages: int) -> list[int]:
    """Contiguous split of the group chain into ``stages`` parts minimising the largest part
    (binary search on the bound, greedy fill); returns the first group index of each stage."""
    n = len(times)
    if stages <= 1:
        return [0]
    if stages > n:
        raise ValueError(f"cannot cut {n} layer groups into {stages} pipeline stages; use fewer stages")

    def cut(bound):
        starts, acc = [0], 0.0
        for i, t in enumerate(times):
            if acc + t > bound and acc > 0:
                starts.append(i)
                acc = 0.0
            acc += t
        return starts

    lo, hi = max(times), sum(times)
    for _ in range(60):
        mid = (lo + hi) / 2
        if len(cut(mid)) <= stages:
            hi = mid
        else:
            lo = mid
    starts = cut(hi)
    while len(starts) < stages:       # more stages than needed: split the largest parts
        sizes = [(b - a) for a, b in zip(starts, starts[1:] + [n])]
        k = max(range(len(sizes)), key=lambda i: sizes[i])
        if sizes[k] < 2:
            raise ValueError(f"cannot cut {n} layer groups into {stages} pipeline stages")
        starts.insert(k + 1, starts[k] + sizes[k] // 2)
    return starts


def _padded(shape: tuple, n: int) -> int:
    rows = shape[0] if shape else 1
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return -(-rows // n) * n * row if n > 1 else rows * row


def evaluate_plan(profiles: Union[Profiles, Profile], axes: dict, plan: Plan, c, global_batch: int, *,
                  simulate: bool = True, recompute: str = "none") -> Estimate:
    """The prediction of ``plan`` on a mesh of ``axes`` (name -> size) for cluster ``c``."""
    p, n, t = axes.get("pp", 1), axes.get("dp", 1), axes.get("tp", 1)
    prof = profiles.get(t, plan.sp) if isinstance(profiles, Profiles) else profiles
    m, v = (plan.microbatches, plan.virtual_stages) if plan.pp_schedule else (1, 1)
    if global_batch % (n * m):
        raise ValueError(f"global batch {global_batch} does not split into dp={n} x microbatches={m}; "
                         f"choose a multiple of {n * m}")
    k = global_batch / (n * m) / prof.rows
    groups = [g.scaled(k) for g in prof.groups]
    dt = MIXED_PRECISION if c.mixed_precision else FP32
    pbytes = dt[0]
    slow = _oversubscription(c, axes)
    world = math.prod(axes.values())
    crowded = c.shared if (world > c.gpus_per_node and c.shared is not None) else None
    S = p * v
    # ranks sharing cores: a single stage's ranks all compute at once (each slowed by the
    # measured slowdown); a pipeline's replay shares the cores as its ranks compute and idle
    shared = pipeline_placement(p, world, c.gpus_per_node, slow) if (slow > 1 and S > 1) else None
    cslow = 1.0 if shared else slow
    intra_tp = crowded or (c.axis_link(axes, "tp") if "tp" in axes else c.intra)
    link_dp = crowded or (c.axis_link(axes, "dp") if "dp" in axes else c.intra)
    link_pp = crowded or (c.axis_link(axes, "pp") if "pp" in axes else c.intra)
    # per group: forward / backward compute and the tp collectives on the compute stream
    # (on a link of ranks sharing cores a collective's latency grows with the compute before
    # it, ``after``: the group's compute spread over its collectives)
    f_raw = [group_time(g, c) for g in groups]
    f_c = [f * cslow for f in f_raw]
    tpf = [_comm_list_time(g.tp_forward, t, intra_tp, after=f / max(1, len(g.tp_forward)))
           for g, f in zip(groups, f_raw)]
    tpb = [_comm_list_time(g.tp_backward, t, intra_tp, after=2 * f / max(1, len(g.tp_backward)))
           for g, f in zip(groups, f_raw)]
    layer = [g.name not in ("pre", "post") for g in groups]
    extra = []
    for g, fc, is_layer in zip(groups, f_c, layer):
        if recompute == "full" and is_layer:
            extra.append(fc)
        elif recompute == "selective" and is_layer:
            extra.append(g.attention_flops / c.device.attention_rate * cslow)
        else:
            extra.append(0.0)
    F = [fc + a for fc, a in zip(f_c, tpf)]
    B = [2 * fc + b + e + (a if recompute == "full" and is_l else 0.0)
         for fc, b, e, a, is_l in zip(f_c, tpb, extra, tpf, layer)]
    W = [compute_time(g.matmul_flops, 0.0, c) * cslow for g in groups]
    starts = partition([f + b for f, b in zip(F, B)], S) if S > 1 else [0]
    bounds = list(zip(starts, starts[1:] + [len(groups)]))
    stage_groups = [groups[a:b] for a, b in bounds]

    def stage_sum(xs, s):
        a, b = bounds[s]
        return sum(xs[a:b])

    f_stage = [f_raw[a:b] for a, b in bounds]

    # ---- data-parallel bytes and times, per stage ------------------------------------------
    mode = plan.dp
    formulas = []
    dp_bytes, dp_time_tail, dp_fwd_gather, dp_bwd_gather, dp_bwd_reduce = [], [], [], [], []
    states, psi_stage, n_tensors = [], [], []
    for s, gs in enumerate(stage_groups):
        # a stage holds every parameter it reads (a tied table lives in each stage reading it)
        names = set().union(*(g.params.keys() | g.reads for g in gs)) if S > 1 else set(prof.shapes)
        shapes = {name: prof.shapes[name] for name in names}
        psi = sum(math.prod(shp) for shp in shapes.values())
        pad = sum(_padded(shp, n) for shp in shapes.values())
        read = sum(_padded(shapes[name], n) for name in set().union(*(g.read_by_backward for g in gs)))
        f = (n - 1) / n if n > 1 else 0.0
        if mode == "ddp":
            by = {"backward all_reduce": 2 * f * psi * pbytes}
        elif mode in ("zero1", "zero2"):
            by = {"backward reduce_scatter": f * pad * pbytes, "optimizer all_gather": f * pad * pbytes}
        else:
            by = {"forward all_gather": f * pad * pbytes * m, "backward all_gather": f * read * pbytes * m,
                  "backward reduce_scatter": f * pad * pbytes}
        dp_bytes.append(by)
        psi_stage.append(psi)
        n_tensors.append(len(shapes))
        states.append(float(model_state_bytes(mode, dt).subs({PSI: psi, SYM_N: n})))
        fwd_g = [collective_time("all_gather", _padded_sum(g.params, n) * pbytes, n, link_dp, after=f)
                 for g, f in zip(gs, f_stage[s])]
        bwd_g = [collective_time("all_gather", sum(_padded(g.params[x], n) for x in g.read_by_backward
                                                   if x in g.params) * pbytes, n, link_dp, after=2 * f)
                 for g, f in zip(gs, f_stage[s])]
        kind = "all_reduce" if mode == "ddp" else "reduce_scatter"
        red = _bucket_times(gs, kind, n, pbytes, link_dp, plan.bucket_bytes, per_group=mode == "zero3",
                            backward=[2 * f * m for f in f_stage[s]],
                            lead=0.0 if mode == "zero3" else sum(f_stage[s]) * m)
        dp_fwd_gather.append(fwd_g if mode == "zero3" else [0.0] * len(gs))
        dp_bwd_gather.append(bwd_g if mode == "zero3" else [0.0] * len(gs))
        dp_bwd_reduce.append(red)
        dp_time_tail.append(pad * pbytes if mode in ("zero1", "zero2") else 0.0)    # bytes, timed below
    # ---- point-to-point between stages ----------------------------------------------------------
    p2p_bytes = [stage_groups[s][-1].out_bytes if s < S - 1 else 0.0 for s in range(S)]
    tied_bytes = 0.0
    if S > 1:
        for name in prof.tied:
            holders = [s for s, gs in enumerate(stage_groups) if any(name in g.reads for g in gs)]
            if len(set(h % p for h in holders)) > 1:   # exchanged as held: whole (ddp) or this rank's rows
                shp = prof.shapes[name]
                held = math.prod(shp) if mode == "ddp" else _padded(shp, n) // max(n, 1)
                tied_bytes += held * pbytes
    # optimizer step: reads and writes parameters, gradients and state of this rank's shard
    # (AdamW's single-tensor loop: on the local CPU its per-tensor cost, not the arithmetic, is
    # most of its time) and the runtime's per-tensor work of the data-parallel sync
    ovh = c.device.op_overhead
    opt_time = [(compute_time(0.0, 3 * states[s], c) + n_tensors[s] * (c.device.step_overhead
                 + GATHER_OPS_PER_TENSOR.get(mode, 0) * ovh)) * slow for s in range(S)]
    sync_time = [n_tensors[s] * SYNC_OPS_PER_TENSOR[mode] * ovh * slow for s in range(S)]
    # ZeRO-1/2: the updated shards all-gathered after the optimizer step
    dp_time_tail = [collective_time("all_gather", b, n, link_dp, after=opt_time[s] / slow) if b else 0.0
                    for s, b in enumerate(dp_time_tail)]

    # ---- time ---------------------------------------------------------------------------------
    timeline: list = []
    # each stage's pass (a module call forward and backward) has a cost beyond its ops, and on
    # a pipeline each micro-batch's send and receive take the host too
    dev = c.device
    if S == 1:
        F, B = list(F), list(B)
        F[0] += dev.pass_overhead / 3 * cslow
        B[0] += sync_time[0] + 2 * dev.pass_overhead / 3 * cslow   # the bucket bookkeeping runs inside backward
        step, compute, exposed, bubble = _single_stage(F, B, dp_fwd_gather[0], dp_bwd_gather[0], dp_bwd_reduce[0],
                                                       dp_time_tail[0], opt_time[0], mode, n, timeline, simulate,
                                                       plan.overlap)
        tp_exposed = sum(tpf) + sum(tpb)
        exposed += tp_exposed
        compute -= tp_exposed
    else:
        msgs = [(s > 0) + (s < S - 1) for s in range(S)]     # a receive and a send per pass
        Fs = [stage_sum(F, s) + (dev.pass_overhead / 3 + msgs[s] * dev.message_overhead) * cslow for s in range(S)]
        Bs = [stage_sum(B, s) + (2 * dev.pass_overhead / 3 + msgs[s] * dev.message_overhead) * cslow
              for s in range(S)]
        Ws = [stage_sum(W, s) for s in range(S)]
        if mode == "zero3":    # each micro-batch gathers the stage's units again (prefetched, or not)
            both = max if plan.overlap else (lambda a, b: a + b)
            Fs = [both(Fs[s], sum(dp_fwd_gather[s])) for s in range(S)]
            Bs = [both(Bs[s], sum(dp_bwd_gather[s])) for s in range(S)]
        hop = [pipeline_hop_time(p2p_bytes[s], link_pp, after=sum(f_stage[s])) for s in range(S)]
        pipe, bubble, busy = pipeline_time(plan, p, m, v, Fs, Bs, Ws, hop, timeline, simulate, shared,
                                            wake=getattr(link_pp, "wake", 0.0) if shared else 0.0, slow=slow)
        # after the last micro-batch: deferred dp reduction, tied gradients, optimizer, ZeRO gathers
        after = [sum(dp_bwd_reduce[s]) + opt_time[s] + dp_time_tail[s] + sync_time[s] for s in range(S)]
        per_rank_after = [sum(after[s] for s in range(S) if s % p == r) for r in range(p)]
        tied_t = collective_time("p2p", tied_bytes, 2, link_pp) if tied_bytes else 0.0
        # the mean loss broadcast from the last stage over the pipeline's ranks (a binomial tree)
        loss_t = collective_time("p2p", 4, 2, link_pp) * math.ceil(math.log2(p)) if p > 1 else 0.0
        step = pipe + max(per_rank_after) + 2 * tied_t + loss_t
        for r in range(p):      # after the schedule: the deferred reduction, the optimizer, the gathers
            mine = [s for s in range(S) if s % p == r]
            t0 = pipe
            for label, lane, dur in (("dp reduction (deferred)", "comm", sum(sum(dp_bwd_reduce[s]) + sync_time[s] for s in mine)),
                                     ("tied gradients", "comm", 2 * tied_t),
                                     ("loss broadcast", "comm", loss_t),
                                     ("optimizer", "compute", sum(opt_time[s] for s in mine)),
                                     ("all_gather params", "comm", sum(dp_time_tail[s] for s in mine))):
                if dur:
                    timeline.append((r, lane, label, t0, t0 + dur))
                    t0 += dur
        tp_exposed = m * max(sum(tpf[a:b]) + sum(tpb[a:b]) for a, b in bounds)
        compute = busy - tp_exposed
        exposed = tp_exposed + max(per_rank_after) - min(opt_time) + 2 * tied_t + loss_t
    # ---- bytes per rank ---------------------------------------------------------------------------
    by_axis: dict = {}
    per_rank = []
    for r in range(p):
        mine = [s for s in range(S) if s % p == r]
        tot = {}
        tp_b = m * sum(b for s in mine for g in stage_groups[s] for _, b, _ in g.tp_forward + g.tp_backward)
        if t > 1:
            tot["tp"] = tp_b
        if n > 1:
            tot["dp"] = sum(b for s in mine for b in dp_bytes[s].values())
        if p > 1:
            sends = sum(m * p2p_bytes[s] for s in mine if s < S - 1) + sum(m * p2p_bytes[s - 1] for s in mine if s > 0)
            tot["pp"] = sends + (tied_bytes if any(_holds_tied(prof, stage_groups[s]) for s in mine) else 0.0)
        per_rank.append(tot)
    worst = max(range(p), key=lambda r: sum(per_rank[r].values()))
    by_axis = per_rank[worst]
    # ---- memory ---------------------------------------------------------------------------------
    mem_rank = []
    for r in range(p):
        mine = [s for s in range(S) if s % p == r]
        gs = [g for s in mine for g in stage_groups[s]]
        names = set().union(*(g.params.keys() | g.reads for g in gs)) if S > 1 else set(prof.shapes)
        flight = inflight_microbatches(plan.pp_schedule if p > 1 else None, p, m, v, stage=r)
        mem_rank.append(_memory(gs, names, prof, mode, n, dt, plan.bucket_bytes, recompute, flight, S > 1,
                                staging=c.name == "local"))
    worst_m = max(range(p), key=lambda r: mem_rank[r][0])
    total, st, act, transient = mem_rank[worst_m]
    psi_total = sum(psi_stage[s] for s in range(S) if s % p == worst_m)
    lay = _first_layer(groups)
    formulas.append(("forward compute / layer / micro-batch",
                     GROUP_TIME_FORMULA + (" (x slowdown of ranks sharing cores)" if slow > 1 else ""),
                     f"{lay.dense_flops:,.0f} FLOP, {lay.attention_flops:,.0f} FLOP, {lay.attention_heads:,.0f} "
                     f"slices, {lay.pointwise_bytes:,.0f} B, {lay.ops} ops -> {group_time(lay, c) * 1e3:.4g} ms"
                     + (f" x {slow:.2f}" if slow > 1 else "")))
    formulas.append((f"model states ({mode}, {'mixed precision' if c.mixed_precision else 'fp32'})",
                     str(model_state_bytes(mode, dt)), f"{st:,.0f} B at Psi={psi_total:,}, N={n}"))
    formulas.append(("activations", f"saved per micro-batch x in-flight ({plan.pp_schedule or 'no pipeline'})",
                     f"{act:,.0f} B"))
    if t > 1:
        formulas.append(("tp bytes / layer / micro-batch", "8*b*s*h*(t-1)/t (+ sp re-gather)",
                         f"{sum(b for _, b, _ in _first_layer(groups).tp_forward):,.0f} B fwd"))
    if n > 1:
        formulas.append((f"dp elements / step ({mode})", str(dp_comm_elements(mode)), f"{by_axis.get('dp', 0):,.0f} B"))
    if p > 1:
        formulas.append(("bubble", bubble_formula(plan.pp_schedule, p, m, v) + " for equal stages;",
                         f"{bubble:.4f} replayed with these stages' times and transfers"))
    device_mem = float(c.device.memory_bytes)
    return Estimate(plan=plan, mesh_axes=dict(axes), cluster=c.name, global_batch=global_batch,
                    step_time_s=step, memory_bytes=total, comm_bytes=sum(by_axis.values()),
                    bubble_fraction=bubble, compute_s=compute, exposed_comm_s=max(0.0, exposed),
                    comm_bytes_by_axis=by_axis,
                    memory_breakdown={"model states": st, "activations": act, "transient": transient},
                    time_breakdown={"forward (busiest stage)": max(stage_sum(F, s) for s in range(S)) * m,
                                    "backward (busiest stage)": max(stage_sum(B, s) for s in range(S)) * m,
                                    "optimizer": max(opt_time)},
                    formulas=formulas, timeline=timeline, fits=total <= device_mem, device_memory=device_mem)


def _bucket_times(gs, kind, n, pbytes, link, bucket_bytes, per_group=False, backward=None, lead=0.0) -> list:
    """Seconds of the gradient reductions that become ready when each group's backward ends:
    buckets filled in backward order, the first cut at 1 MiB and the others at
    ``bucket_bytes`` (the collectives pass's rule); ZeRO-3 reduces each layer's unit.
    ``backward``: each group's backward compute, ``lead`` the compute before backward since the
    ranks last synchronised (what a bucket's reduction follows)."""
    out = [0.0] * len(gs)
    if n <= 1:
        return out
    back = backward or [None] * len(gs)
    if per_group:
        return [collective_time(kind, _padded_sum(g.params, n) * pbytes, n, link, after=b) for g, b in zip(gs, back)]
    cap, acc, since = min(1 << 20, bucket_bytes), 0.0, lead
    for i in reversed(range(len(gs))):
        since += back[i] or 0.0
        for shp in gs[i].params.values():
            size = _padded(shp, n) * pbytes
            if acc and acc + size > cap:
                out[i] += collective_time(kind, acc, n, link, after=since or None)
                acc, cap, since = 0.0, bucket_bytes, 0.0
            acc += size
    if acc:
        out[0] += collective_time(kind, acc, n, link, after=since or None)
    return out


def _padded_sum(params: dict, n: int) -> int:
    return sum(_padded(shp, n) for shp in params.values())


def _memory(gs, names, prof, mode, n, dt, bucket_bytes, recompute, flight, pipelined, staging=False):
    """(peak, model states, activations, transient) bytes of one rank: a walk over the step as
    the runtime allocates it. Persistent: parameters (ZeRO-3: shards), optimizer state, ZeRO-1's
    full-gradient buffer. Forward: activations of the in-flight micro-batches, the outputs and
    the loss's copy of them, ZeRO-3's gathered units. Backward, layer by layer in reverse: the
    layer's working set (its largest activation and that one's gradient), gradients waiting for
    their bucket, each bucket's flat buffer when it completes (ddp: it becomes .grad; ZeRO-2/3:
    kept until backward ends, with the reduced shard), activations freed as layers finish.
    With a pipeline, gradients accumulate across micro-batches (whole) until the flush.
    ``staging``: the backend copies a reduce-scatter's input (gloo does; NCCL does not).
    ZeRO-3 gathers into a flat buffer and copies out per parameter (two copies of a unit in
    flight), the next unit prefetched: three units of its largest while computing."""
    pb, gb, ob = dt
    shapes = {x: prof.shapes[x] for x in names}
    psi = sum(math.prod(sh) for sh in shapes.values())
    pad = sum(_padded(sh, n) for sh in shapes.values())
    zero = mode != "ddp"
    params = pb * (pad / n if mode == "zero3" else psi)
    optim = ob * (pad / n if zero else psi)
    base = params + optim + (gb * pad if mode == "zero1" else 0.0)
    states = float(model_state_bytes(mode, dt).subs({PSI: psi, SYM_N: n})) if mode != "zero1" else \
        params + optim + gb * pad
    saved = [_saved(g, recompute) * flight for g in gs]
    final = sum(g.final_bytes for g in gs) * flight
    act = sum(saved) + final * 2                       # outputs, and the loss's copy of them
    units = [pb * _padded_sum(g.params, n) for g in gs if g.name not in ("pre", "post")]
    root = pb * sum(_padded(sh, n) for g in gs if g.name in ("pre", "post") for sh in g.params.values())
    top = max(units, default=0.0)
    gathered = (root + 3 * top) if mode == "zero3" else 0.0
    peak = base + act + gathered
    # gradient buckets, in the order gradients become ready (reverse first use)
    order = [x for g in gs for x in g.params if x in shapes] + [x for x in shapes if not any(x in g.params for g in gs)]
    buckets, cur, cur_b, cap = [], [], 0.0, min(1 << 20, bucket_bytes)
    for x in reversed(order):
        size = _padded(shapes[x], n) * gb
        if cur and cur_b + size > cap:
            buckets.append(cur)
            cur, cur_b, cap = [], 0.0, bucket_bytes
        cur.append(x)
        cur_b += size
    if cur:
        buckets.append(cur)
    done, pending, flats, outs, grads = set(), 0.0, 0.0, 0.0, 0.0
    accumulated = gb * psi if pipelined else 0.0      # micro-batch gradients held until the flush
    rem = act
    unit_bwd = [3 * top] if mode == "zero3" else []
    for i in reversed(range(len(gs))):
        g = gs[i]
        work = 2 * g.max_value + (sum(unit_bwd) if unit_bwd else 0.0)
        peak = max(peak, base + rem + pending + flats + outs + grads + accumulated + work)
        rem -= saved[i] + (2 * g.final_bytes * flight if g.final_bytes else 0.0)
        if pipelined:
            continue
        pending += gb * sum(math.prod(sh) for x, sh in g.params.items() if x in shapes)
        done |= set(g.params)
        while buckets and all(x in done for x in buckets[0]):
            b = buckets.pop(0)
            flat = gb * sum(_padded(shapes[x], n) if zero else math.prod(shapes[x]) for x in b)
            launch = flat + ((flat / n + (flat if staging else 0.0)) if zero else 0.0)
            peak = max(peak, base + rem + pending + flats + outs + grads + launch + sum(unit_bwd))
            pending -= gb * sum(math.prod(shapes[x]) for x in b)
            if mode == "ddp":
                grads += flat
            elif mode in ("zero2", "zero3"):
                flats += flat
                outs += flat / n
    if pipelined:     # the flush: every bucket's flat buffer at once over the accumulated gradients
        flat_all = gb * (pad if zero else psi)
        peak = max(peak, base + accumulated + flat_all + (flat_all / n if mode in ("zero2", "zero3") else 0.0))
        grads = gb * (pad / n if zero else psi) if mode != "zero1" else 0.0
    else:
        grads = grads if mode == "ddp" else (outs if mode in ("zero2", "zero3") else 0.0)
    opt_tmp = 2 * ob / 2 * max((math.prod(sh) for sh in shapes.values()), default=0)
    if mode in ("zero1", "zero2"):
        opt_tmp += pb * max((_padded_sum({x: shapes[x] for x in b}, n) for b in [order]), default=0)
    peak = max(peak, base + grads + opt_tmp)
    return peak, states, act, peak - base - act if peak > base + act else 0.0


def _first_layer(groups):
    return next((g for g in groups if g.name not in ("pre", "post")), groups[0])


def _holds_tied(prof: Profile, gs) -> bool:
    names = set().union(*(g.reads for g in gs))
    return any(x in names for x in prof.tied)


def _saved(g: GroupCost, recompute: str) -> float:
    if g.name in ("pre", "post"):
        return g.saved
    if recompute == "full":
        return g.out_bytes         # only the layer's input (the previous layer's output) is kept
    if recompute == "selective":
        return g.saved - g.saved_quadratic
    return g.saved


def _oversubscription(c, axes) -> float:
    """On the local CPU preset, ranks slow each other: beyond the core count they share cores,
    and below it they share caches and memory (the measured ``Cluster.slowdown``)."""
    return c.slowdown(math.prod(axes.values()))


def _single_stage(F, B, gf, gb, red, tail, opt, mode, n, timeline, simulate, overlap=True):
    """One stage, two streams: returns (step, compute busy, exposed communication, bubble=0).
    With the overlap pass, ZeRO-3 gathers go one unit ahead and gradient buckets are reduced
    while backward goes on (ZeRO-1 too); without it, each collective is waited on when issued."""
    if not overlap:
        compute = sum(F) + sum(B) + opt
        step = compute + sum(gf) + sum(gb) + sum(red) + tail
        t = 0.0
        for i in range(len(F)):
            for lane, name, d in (("comm", f"all_gather unit {i}", gf[i] if mode == "zero3" else 0.0),
                                  ("compute", f"F {i}", F[i])):
                if d:
                    timeline.append((0, lane, name, t, t + d))
                    t += d
        for i in reversed(range(len(B))):
            for lane, name, d in (("comm", f"all_gather unit {i} (backward)", gb[i] if mode == "zero3" else 0.0),
                                  ("compute", f"B {i}", B[i]), ("comm", f"reduce grads {i}", red[i] if n > 1 else 0.0)):
                if d:
                    timeline.append((0, lane, name, t, t + d))
                    t += d
        timeline.append((0, "compute", "optimizer", t, t + opt))
        if tail:
            timeline.append((0, "comm", "all_gather params", t + opt, t + opt + tail))
        return step, compute, step - compute, 0.0
    if not simulate:
        compute = sum(F) + sum(B) + opt
        if mode == "zero3":
            fwd = gf[0] + sum(max(f, g) for f, g in zip(F, gf[1:] + [0.0]))
            bwd = sum(max(b, g) for b, g in zip(B, gb))
        else:
            fwd, bwd = sum(F), sum(B)
        step = fwd + bwd + red[0] + opt + tail
        return step, compute, step - compute, 0.0
    comp_t = comm_t = red_t = 0.0
    f_end: list = []
    # forward: gather unit i while unit i-1 computes (at most two gathered at once), then compute it
    for i in range(len(F)):
        ready = 0.0
        if mode == "zero3":
            start = max(comm_t, f_end[i - 2] if i >= 2 else 0.0)
            comm_t = ready = start + gf[i]
            timeline.append((0, "comm", f"all_gather unit {i}", start, comm_t))
        s0 = max(comp_t, ready)
        comp_t = s0 + F[i]
        f_end.append(comp_t)
        timeline.append((0, "compute", f"F {i}", s0, comp_t))
    # backward: reverse, re-gather (ZeRO-3), compute, reduce the layer's gradients
    ready = comp_t
    for i in reversed(range(len(B))):
        if mode == "zero3" and gb[i]:
            start = max(comm_t, ready - (B[i + 1] if i + 1 < len(B) else 0.0))
            comm_t = start + gb[i]
            timeline.append((0, "comm", f"all_gather unit {i} (backward)", start, comm_t))
            s0 = max(comp_t, comm_t)
        else:
            s0 = comp_t
        comp_t = s0 + B[i]
        ready = comp_t
        timeline.append((0, "compute", f"B {i}", s0, comp_t))
        if n > 1:       # the runtime reduces on a process group of its own: beside the gathers
            start = max(red_t, comp_t)
            red_t = start + red[i]
            timeline.append((0, "comm", f"{'all_reduce' if mode == 'ddp' else 'reduce_scatter'} grads {i}",
                             start, red_t))
    s0 = max(comp_t, comm_t, red_t)
    comp_t = s0 + opt
    timeline.append((0, "compute", "optimizer", s0, comp_t))
    if tail:
        timeline.append((0, "comm", "all_gather params", comp_t, comp_t + tail))
        comp_t += tail
    compute = sum(F) + sum(B) + opt
    return comp_t, compute, comp_t - compute, 0.0



def predict_module(dm, cluster="local", global_batch=None, recompute: str = "none") -> Estimate:
    """``dm.predict``: the estimate of a compiled module's plan from the profile of the graph it
    was compiled from (``global_batch`` defaults to the example's)."""
    prof = dm.ctx.profile
    if prof is None:
        raise RuntimeError("no cost-model profile was recorded at compile time (see the log for why)")
    rows = global_batch or prof.rows * (dm.plan.microbatches if dm.plan.pp_schedule else 1)
    return evaluate_plan(prof, dict(dm.mesh.axes), dm.plan, get_cluster(cluster), rows, recompute=recompute)


def estimate_plan(model, mesh: Mesh, plan: Plan, *, example_inputs, example_kwargs=None, cluster="local",
                  global_batch: Optional[int] = None, recompute: str = "none", flash_attention: bool = True,
                  profiles: Optional[Profiles] = None) -> Estimate:
    """The prediction of ``plan`` for ``model`` on ``mesh`` (``autopar.estimate`` without the
    planner: see there)."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be an autopar.Mesh, got {type(mesh).__name__}")
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be an autopar.Plan or 'auto', got {plan!r}")
    plan.check_mesh(mesh)
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute={recompute!r}: expected 'none', 'selective' or 'full'")
    profiles = profiles or Profiles(model, example_inputs, example_kwargs, flash=flash_attention)
    gb = global_batch or profiles.base.rows
    return evaluate_plan(profiles, dict(mesh.axes), plan, get_cluster(cluster), gb, recompute=recompute)
