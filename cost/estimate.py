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
  gradient buckets, cut as the collectives pass cuts them, ZeRO-1's too, are reduced while
  backward continues; ZeRO-1/2's parameter all-gathers after the step, one per bucket as
  the runtime issues them, each with its latency and its copies, are exposed); with
  ``Plan(overlap=False)`` every collective is exposed, one after another;
- optimizer offload (``Plan(offload="optimizer")``, ``cost.offload``): the device's optimizer
  step becomes the step on the host, and the host link's copies go where the runtime issues
  them: each gradient bucket's copy down as the bucket lands (on the compute lane, beside the
  next bucket's reduction; the last one after the final reduction), the parameters' copies
  up a bucket at a time after the step, pipelined with ZeRO-1/2's replica all-gathers; the
  optimizer state leaves the device's memory;
- pipeline: the plan's schedule replayed in event time (``cost.replay``) with each stage's F,
  B (and W) times and the point-to-point transfer of the activations that cross each cut;
  the deferred data-parallel reduction and the optimizer step follow. Stages are cut between
  layers, balanced (``partition``); with more stages than layers, where the pipeline pass
  cuts, inside layers (``Profiles.cut``; a compiled module's profile has its own stages);
- memory: a walk over the step as the runtime allocates it (``_memory``): what persists
  between steps, the activations the schedule keeps in flight, ZeRO-3's gathered units, the
  gradients and bucket buffers of backward, the optimizer's temporaries.

Precision is the plan's (``cost.memory.precision``): without ``param_dtype`` the model's own
dtype throughout (an fp32 model: fp32 activations and collectives, 16 B of model states per
parameter under ddp, its matmuls at the device's fp32 peak, TF32's where the preset uses it);
with it the profile is of the program compile captures (the model's copy in ``param_dtype``,
``passes.autocast``'s casts for the cluster's device), ZeRO-3 gathers and ZeRO-1/2 replicas in
``param_dtype``, gradient sums in ``plan.grad_reduce_dtype``, model states as the runtime keeps
them (``autopar.sizes.mixed_state_dtypes``).

The pieces of a step (``group_passes``, ``saved_bytes``, ``optimizer_time``, ...) are the
ones the planner's closed form (``cost.planner``) reads too. ``simulate=False`` (the
planner's detailed re-ranking at scale) replaces the two event-time replays by their closed
forms, which equal them for uniform layers.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from autopar.capture import capture
from autopar.context import CompileContext, layer_key
from autopar.mesh import Mesh
from autopar.passes import stage_bounds
from autopar.passes.autocast import autocast, compute_source
from autopar.planspec import Plan
from autopar.schedule import bubble_formula
from autopar.sizes import batch_split_error, cut_buckets, inflight_microbatches, padded_numel, ring_bytes, state_bytes
from autopar.trace import ChromeTrace

from .cluster import get_cluster
from .comm import collective_time, pipeline_hop_time
from .compute import GROUP_TIME_FORMULA, compute_time, dispatch_ops, group_time
from .formulas import dp_comm_elements, tp_layer_comm_elements
from .lm_head import head_policy, policy_cluster
from .memory import Precision, model_state_bytes, persistent_bytes, precision
from .offload import device_precision, flow_time, host_bytes_per_element, host_copies, host_link_bytes, \
    host_link_formula, host_step_time, offload_elements
from .profile import GroupCost, Profile, expand, is_layer, layer_of, profile, repeated_stack, truncated
from .replay import lowered_schedule, pipeline_placement, pipeline_time

__all__ = ["Estimate", "estimate_plan", "evaluate_plan", "predict_module", "Profiles", "partition", "autocast_device"]

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
    recompute_layers: dict = field(default_factory=dict)   # layer -> "selective" | "full" (the others keep all)
    host_bytes: float = 0.0          # Plan(offload="optimizer"): bytes over the host link per step (down + up)
    host_memory_bytes: float = 0.0   # Plan(offload="optimizer"): host memory the optimizer's copy and state hold
    caveats: list = field(default_factory=list)   # what of this plan the estimate only approximates, and why

    def explain(self) -> str:
        mesh = ", ".join(f"{k}={v}" for k, v in self.mesh_axes.items())
        lines = [f"estimate: {self.plan} on Mesh({mesh}), cluster {self.cluster}, global batch {self.global_batch}",
                 f"  step time       {self.step_time_s * 1e3:12.3f} ms   (compute {self.compute_s * 1e3:.3f} ms, "
                 f"exposed communication {self.exposed_comm_s * 1e3:.3f} ms, bubble {self.bubble_fraction:.1%})",
                 f"  memory / rank   {self.memory_bytes / 2**30:12.3f} GiB  "
                 f"({'fits' if self.fits else 'DOES NOT FIT'} in {self.device_memory / 2**30:.1f} GiB)",
                 f"  bytes / rank    {self.comm_bytes:14,.0f} B per step"]
        if self.host_bytes:
            lines.append(f"  host link       {self.host_bytes:14,.0f} B per step (gradients down as each bucket is "
                         f"reduced, parameters up after the step, bucket by bucket under ZeRO-1/2's gathers); "
                         f"host memory {self.host_memory_bytes / 2**20:.3f} MiB")
        for k, v in self.memory_breakdown.items():
            lines.append(f"    memory {k:18s} {v / 2**20:14.3f} MiB")
        for k, v in self.comm_bytes_by_axis.items():
            lines.append(f"    bytes  {k:18s} {v:14,.0f} B")
        for k, v in self.time_breakdown.items():
            lines.append(f"    time   {k:18s} {v * 1e3:14.3f} ms")
        lines += [f"  caveat: {c}" for c in self.caveats]
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
    """``cost.profile`` results per (tp size, sp, compute dtype), captured once per dtype and
    re-annotated per variant: the planner's cache. ``flash``: attention as a fused kernel;
    ``dropout_math``: except attention with dropout, which autopar runs in the math form
    (``cost.profile``). A compute dtype (``Plan.param_dtype``) profiles the program compile
    captures under it: the model's copy in that dtype on inputs cast to it, with
    ``torch.autocast``'s casts for the device of ``cluster`` (``autocast_device``).

    A model with a stack of repeated blocks (``cost.profile.repeated_stack``) is captured with
    its first ``PROFILED_BLOCKS`` blocks only and each profile extended to the full depth
    (``expand``: equal to the whole model's profile, tested), so that capturing and profiling
    do not grow with depth; ``blocks_once=False`` captures the whole model."""

    def __init__(self, model, example_inputs, example_kwargs=None, *, flash: bool = True, cluster=None,
                 dropout_math: bool = False, blocks_once: bool = True):
        self.flash, self.dropout_math = flash, dropout_math
        self._cache: dict = {}
        self._args = (tuple(example_inputs), dict(example_kwargs or {}), cluster)
        self._model = model
        self._graphs: dict = {}     # compute dtype (None: the model's own) -> (graph, context) profiled
        self._whole_graphs: dict = {}   # the same of the whole model, captured if a pipeline cut needs it
        self.caveats: dict = {}     # compute dtype -> what its profile approximates (Estimate.caveats)
        self.stack = repeated_stack(model) if blocks_once else None     # (path, blocks) or None
        self._source = model
        if self.stack is not None:
            self._source = truncated(model, self.stack[0])
            try:
                names = [g.name for g in self.get(1, False).layers]
            except Exception:      # the model does not run with fewer blocks: capture it whole
                names = None
            if names != [f"{self.stack[0]}.{i}" for i in range(self.stack[1])]:
                self.stack, self._cache, self._graphs, self._source = None, {}, {}, model
        self._graph(None)

    def _graph(self, dtype) -> tuple:
        """(graph, context) of the profiled model (its first blocks, or whole) at compute ``dtype``."""
        if dtype not in self._graphs:
            self._graphs[dtype] = self._captured(self._source, dtype)
        return self._graphs[dtype]

    def _captured(self, model, dtype=None) -> tuple:
        """(graph, context) of ``model`` captured at the example inputs; with a compute ``dtype``,
        of the program compile captures under ``Plan(param_dtype=dtype)``."""
        inputs, kwargs, cluster = self._args
        ctx = CompileContext(mesh=Mesh(dp=1, virtual=True), plan=Plan(param_dtype=dtype))
        # LM heads laid out as a compile for ``cluster`` would (None: a compile's default, this
        # machine's calibrated preset if there is one, else cost.lm_head.DEFAULT_CLUSTER)
        ctx.head_policy = head_policy(cluster)
        if dtype is None:
            return capture(model, inputs, kwargs, ctx), ctx
        device = autocast_device(cluster)
        if device == "cuda" and not torch.cuda.is_available():    # torch disables CUDA's autocast here
            self.caveats[dtype] = (f"torch.autocast('cuda') is unavailable on this machine: the "
                                   f"{str(dtype).removeprefix('torch.')} program is profiled with the CPU's autocast "
                                   "(matmuls and attention in it, losses in float32), where CUDA's also keeps norms "
                                   "and softmax in float32")
            device = "cpu"
        ctx.device_type = device
        gm = capture(*compute_source(model, inputs, kwargs, dtype), ctx, autocast=(device, dtype))
        return autocast(gm, ctx), ctx

    def get(self, tp: int, sp: bool, vocab_parallel: Optional[bool] = None, dtype=None) -> Profile:
        """The profile at tp size ``tp``, with or without sequence parallelism; LM heads split
        along the vocabulary or kept whole as ``vocab_parallel`` says (``Plan.vocab_parallel``;
        None: as the compile's cost-model policy chooses); of the program in compute ``dtype``
        (``Plan.param_dtype``; None: the model's own dtypes)."""
        key = (tp, sp and tp > 1, vocab_parallel if tp > 1 else None, dtype)
        if key not in self._cache:
            gm, ctx = self._graph(dtype)
            p = profile(gm, ctx, tp=tp, sp=key[1], flash=self.flash, dropout_math=self.dropout_math,
                        vocab_parallel=key[2])
            self._cache[key] = expand(p, *self.stack) if self.stack is not None else p
        return self._cache[key]

    def cut(self, tp: int, sp: bool, vocab_parallel: Optional[bool], plan: Plan, axes: dict,
            global_batch: int) -> Profile:
        """The profile of ``get(tp, sp, vocab_parallel)`` with its groups cut where the pipeline
        pass cuts the model into the plan's ``pp x virtual_stages`` stages (``passes.stage_bounds``
        on the whole captured graph, scaled to a micro-batch of ``global_batch``): a stage that
        ends inside a layer ends inside it here too (``Profile.stage_starts``)."""
        gm, ctx = self._whole(plan.param_dtype)
        rows = self.base.rows
        m = plan.microbatches
        key = ("cut", tp, sp and tp > 1, vocab_parallel if tp > 1 else None, axes.get("pp", 1), axes.get("dp", 1),
               plan.virtual_stages, m, plan.pp_schedule, plan.dp, plan.stage_memory_bytes, global_batch,
               plan.param_dtype)
        if key not in self._cache:
            cctx = CompileContext(mesh=Mesh(**{a: s for a, s in axes.items() if s > 1} or {"dp": 1}, virtual=True),
                                  plan=plan)
            cctx.params, cctx.microbatch_rows = ctx.params, rows
            order, bounds = stage_bounds(gm.graph, cctx, scale=global_batch / m / rows)
            starts = tuple(order[b].name for b in bounds[1:-1])
            self._cache[key] = profile(gm, ctx, tp=tp, sp=key[1], flash=self.flash, dropout_math=self.dropout_math,
                                       vocab_parallel=key[2], stage_starts=starts)
        return self._cache[key]

    def _whole(self, dtype=None):
        """The whole model's captured graph and its context at compute ``dtype`` (captured on
        first use when the profiles were made from a truncated stack)."""
        if self.stack is None:
            return self._graph(dtype)
        if dtype not in self._whole_graphs:
            self._whole_graphs[dtype] = self._captured(self._model, dtype)
        return self._whole_graphs[dtype]

    @property
    def base(self) -> Profile:
        return self.get(1, False)


def autocast_device(cluster) -> str:
    """The device type whose ``torch.autocast`` a mixed-precision plan follows on ``cluster``
    (a Cluster, a preset name, or None: a compile's default, ``lm_head.policy_cluster``): the
    local preset's CPU, a GPU preset's CUDA."""
    return "cpu" if policy_cluster(cluster).name == "local" else "cuda"


# ---- the pieces of a step (the estimate and the planner's closed form read these) -----------------

def tp_comm_time(items, t: int, link, after: float | None = None) -> float:
    """Seconds of a group's tensor-parallel collectives, ``GroupCost.tp_forward`` /
    ``tp_backward`` items (kind, bytes each rank sends, scales with the batch), over ``t``
    ranks on ``link`` (``after``: the compute before each, for links with a measured skew table)."""
    return sum(collective_time(kind, nbytes / ring_bytes(kind, 1.0, t) if t > 1 else nbytes, t, link, after=after)
               for kind, nbytes, _ in items)


def group_passes(g: GroupCost, c, t: int, link, recompute: str, slow: float) -> tuple:
    """(F, B, W, forward compute alone, tp forward, tp backward) seconds of one group: its
    forward (the roofline, ``group_time``, times ``slow``, plus its tp collectives, which block
    the next op, each with the runtime's host work, ``Device.collective_overhead``), backward
    (twice the compute but for the ops' dispatch, which is ``Device.backward_op_ratio`` times the
    forward's, the backward tp collectives, and what
    recomputation redoes: a layer's whole forward under ``full``, its attention under
    ``selective``), and W (the weight-gradient matmuls a zero-bubble schedule defers). On a
    measured link (``Link.skew``) a collective's latency grows with the CPU work before it:
    the group's compute spread over its collectives, plus the runtime's own work for each."""
    f = group_time(g, c)
    fc = f * slow
    ops = dispatch_ops(g, c.device) * c.device.op_overhead * slow      # the forward's dispatch
    ops_b = dispatch_ops(g, c.device, backward=True) * c.device.op_overhead * slow   # backward's: x backward_op_ratio
    own = c.device.collective_overhead if t > 1 else 0.0    # the runtime's work per collective, on a core of its own
    host = own * slow
    # the CPU work between two collectives, the skew probe's abscissa: the group's compute spread
    # over them, and the runtime's own work for each (as much a rank's time off the wire as a matmul)
    tpf = tp_comm_time(g.tp_forward, t, link, after=f / max(1, len(g.tp_forward)) + own) + host * len(g.tp_forward)
    tpb = tp_comm_time(g.tp_backward, t, link, after=2 * f / max(1, len(g.tp_backward)) + own) + host * len(g.tp_backward)
    redo = 0.0
    if is_layer(g.name):
        if recompute == "full":
            redo = fc + tpf
        elif recompute == "selective":
            redo = g.attention_flops / c.device.attention_rate_of(g.matmul_dtype) * slow
    return (fc + tpf, 2 * (fc - ops) + c.device.backward_op_ratio * ops_b + tpb + redo,
            compute_time(g.matmul_flops, 0.0, c, g.matmul_dtype) * slow, f, tpf, tpb)


def saved_bytes(g: GroupCost, recompute: str) -> float:
    """Activation bytes a group keeps for backward: everything autograd saves; under full
    recomputation a layer keeps only its input (the previous layer's output), under selective
    recomputation all but its attention scores."""
    if not is_layer(g.name):
        return g.saved
    if recompute == "full":
        return g.out_bytes
    if recompute == "selective":
        return g.saved - g.saved_quadratic
    return g.saved


def optimizer_time(states: float, n_tensors: int, c) -> float:
    """Seconds of the optimizer step over this rank's shard: reading and writing parameters,
    gradients and state (3 x the state bytes, on the roofline) and AdamW's per-tensor cost
    (``Device.step_overhead``; on the local preset timed with a 64 x 64 tensor's arithmetic in
    it, so the two overlap there)."""
    return compute_time(0.0, 3 * states, c) + n_tensors * c.device.step_overhead


def replica_gathers(buckets, n: int, link, c, after: float, slow: float = 1.0) -> list:
    """Seconds of each of ZeRO-1/2's replica gathers after the optimizer step
    (``DpSync.gather_replicas``), one bucket after another (``buckets``: each one's gathered
    bytes, padded): the bucket's shards staged (this rank's 1/N, read and written), its
    all-gather, the replicas written from the gathered buffer (the bucket read and written),
    each copy on the roofline times ``slow``. The first gather follows the step's ``after``
    seconds of compute, each later one its predecessor's copies: every bucket pays the
    collective's latency, not one gather of them all."""
    out = []
    for i, nbytes in enumerate(buckets):
        copies = compute_time(0.0, 2 * nbytes / n + 2 * nbytes, c)
        out.append(collective_time("all_gather", nbytes, n, link, after=after if i == 0 else copies) + copies * slow)
    return out


def refill_time(param_elements: float, saved: float, pbytes: float, c) -> float:
    """Seconds a pipeline action spends on a time-shared core (more processes than cores in its
    group, ``pipeline_placement``) bringing its stage's working set back: between two of a
    rank's actions another process ran on that core (a replica of its stage, or a rank of
    another one while it waited for a message) and took the cache. The action reads its
    stage's parameters and the micro-batch's saved activations from memory again, and the
    lines it displaces are the other process's, as dirty and as many (replicas in lockstep):
    twice those bytes on the roofline, at the measured bandwidth (``compute_time``). A rank
    whose cores are its own keeps its cache between actions (pp = 2 on 2 processes), and ranks
    that compute without pause (one stage) are time-shared at the scheduler's slice, which
    the measured contention (``Cluster.slowdown``, its probe's working set far beyond the
    cache) already holds. Measured (2026-12-06, 1F1B on pp = 2 x dp = 2, 4 processes on 2
    cores, thread CPU per action against the estimate's at the measured contention): gpt h96
    L4 s16 0.22 ms more per F and 0.27 ms per B (this formula: 0.17), h96 L2 s48 0.16 and 0.14
    (0.12), h32 L2 s16 none to speak of (0.01); BENCHMARKS.md, hold-out run 79."""
    return compute_time(0.0, 2 * (param_elements * pbytes + saved), c)


def has_reducer(mode: str, n: int, pipelined: bool) -> bool:
    """Whether a rank's stage has a data-parallel reducer: every plan but a pipeline stage with
    nothing to reduce (ddp at dp = 1), whose micro-batches' gradients autograd accumulates
    (``passes.collectives``)."""
    return not (mode == "ddp" and n == 1 and pipelined)


def sync_time(mode: str, n_tensors: int, c) -> float:
    """Seconds of the data-parallel runtime's host work per parameter tensor in a step under
    ``mode`` (``Device.sync_overhead``, measured by the local calibration's dp runtime probe;
    ZeRO-1/2's copy into the replicas after the optimizer step included)."""
    return n_tensors * dict(c.device.sync_overhead).get(mode, 0.0)


def tied_exchange_time(nbytes: float, link) -> float:
    """Summing a tied weight's gradients between the two pipeline ranks that hold it: one
    exchange of ``nbytes``, each rank's send and receive posted together (the runtime's
    ``_sum_tied_grads``), so one point-to-point time, not two."""
    return collective_time("p2p", nbytes, 2, link) if nbytes else 0.0


def schedule_wait(timeline: list, p: int, Bs: list, hop: list) -> float:
    """How long the first of a pipeline's ``p`` ranks to end its schedule waits for the last:
    from the replay's ``timeline`` (its compute actions, numbered as ``pipeline_time`` numbers
    them), else (no replay) the first stage's final backward after the last stage's, ``Bs[0]`` and
    a message."""
    ends = {}
    for r, lane, name, _, t1 in timeline:
        if lane == "compute" and name[:1].isdigit():
            ends[r] = max(ends.get(r, 0.0), t1)
    if len(ends) == p:
        return max(ends.values()) - min(ends.values())
    return Bs[0] + (hop[0] if hop else 0.0)


def schedule_tail_time(link, wait: float) -> float:
    """What the exchanges after a pipeline's schedule cost the rank that ends it last beyond
    their p2p time, the other ranks having waited ``wait`` seconds for it: ``Link.tail``'s
    a + b x wait where measured (local preset), else 0."""
    tail = getattr(link, "tail", ())
    return tail[0] + tail[1] * wait if tail else 0.0


def loss_broadcast_time(p: int, link) -> float:
    """The mean loss broadcast from the last stage over the pipeline's ``p`` ranks (a
    binomial tree of one-value messages)."""
    return collective_time("p2p", 4, 2, link) * math.ceil(math.log2(p)) if p > 1 else 0.0


def padded_sum(params: dict, n: int) -> int:
    """Elements of the parameters (name -> shape) split over ``n`` ranks, padded to equal chunks."""
    return sum(padded_numel(shape, n) for shape in params.values())


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


def evaluate_plan(profiles: Union[Profiles, Profile], axes: dict, plan: Plan, c, global_batch: int, *,
                  simulate: bool = True, recompute=None) -> Estimate:
    """The prediction of ``plan`` on a mesh of ``axes`` (name -> size) for cluster ``c``.
    ``recompute``: ``none`` / ``selective`` / ``full``, a dict of layer -> one of them, or a
    memory budget in bytes (``choose_recompute``); default: the plan's ``recompute``."""
    rc = plan.recompute if recompute is None else recompute
    if isinstance(rc, int) and not isinstance(rc, bool):
        return choose_recompute(profiles, axes, plan, c, global_batch, rc, simulate=simulate)
    p, n, t = axes.get("pp", 1), axes.get("dp", 1), axes.get("tp", 1)
    m, v = (plan.microbatches, plan.virtual_stages) if plan.pp_schedule else (1, 1)
    prof = profiles.get(t, plan.sp, plan.vocab_parallel, plan.param_dtype) if isinstance(profiles, Profiles) \
        else profiles
    if isinstance(profiles, Profiles) and p * v > max(1, len(prof.layers)):
        # more stages than layers: cut where the pipeline pass cuts, inside layers
        prof = profiles.cut(t, plan.sp, plan.vocab_parallel, plan, axes, global_batch)
    kinds = dict(rc) if isinstance(rc, dict) else {g.name: rc for g in prof.groups if is_layer(g.name)}
    for kind in kinds.values():
        if kind not in RECOMPUTE_MODES:
            raise ValueError(f"recompute={kind!r}: expected one of {RECOMPUTE_MODES}, a dict of layer -> one "
                             "of them, or a budget in bytes")
    for g in prof.groups:      # the later part of a layer a stage cut splits is recomputed as the layer is
        if layer_of(g.name) in kinds:
            kinds.setdefault(g.name, kinds[layer_of(g.name)])
    error = batch_split_error(global_batch, n, m)
    if error:
        raise ValueError(error)
    k = global_batch / (n * m) / prof.rows
    groups = [g.scaled(k) for g in prof.groups]
    # bytes per element of each copy the runtime makes (the plan's dtypes, else the model's)
    pr = precision(plan, plan.dp, prof.param_bytes)
    pbytes, rbytes = pr.compute, pr.reduce
    slow = _oversubscription(c, axes)
    world = math.prod(axes.values())
    S = p * v
    # ranks sharing cores: a single stage's ranks all compute at once (each slowed by the
    # measured slowdown); a pipeline's replay shares the cores as its ranks compute and idle,
    # each slowed by the ranks computing at that moment
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
    stage_groups = [groups[a:b] for a, b in bounds]

    def stage_sum(xs, s):
        a, b = bounds[s]
        return sum(xs[a:b])

    f_stage = [f_raw[a:b] for a, b in bounds]

    # ---- data-parallel bytes and times, per stage ------------------------------------------
    mode = plan.dp
    formulas = []
    dp_bytes, dp_tail_buckets, dp_fwd_gather, dp_bwd_gather, dp_bwd_reduce = [], [], [], [], []
    states, psi_stage, n_tensors, opt_elements, off_buckets = [], [], [], [], []
    for s, gs in enumerate(stage_groups):
        # a stage holds every parameter it reads (a tied table lives in each stage reading it)
        names = set().union(*(g.params.keys() | g.reads for g in gs)) if S > 1 else set(prof.shapes)
        shapes = {name: prof.shapes[name] for name in names}
        psi = sum(math.prod(shp) for shp in shapes.values())
        pad = padded_sum(shapes, n)
        units = _zero3_units(gs, shapes, n, pbytes, plan.bucket_bytes) if mode == "zero3" else []
        read = sum(u.elements for u in units if u.backward is not None)     # backward re-gathers whole units
        # gathers in the compute dtype, gradient sums in the reduce dtype
        if mode == "ddp":
            by = {"backward all_reduce": ring_bytes("all_reduce", psi * rbytes, n)}
        elif mode in ("zero1", "zero2"):
            by = {"backward reduce_scatter": ring_bytes("reduce_scatter", pad * rbytes, n),
                  "optimizer all_gather": ring_bytes("all_gather", pad * pbytes, n)}
        else:
            by = {"forward all_gather": ring_bytes("all_gather", pad * pbytes, n) * m,
                  "backward all_gather": ring_bytes("all_gather", read * pbytes, n) * m,
                  "backward reduce_scatter": ring_bytes("reduce_scatter", pad * rbytes, n)}
        dp_bytes.append(by)
        psi_stage.append(psi)
        n_tensors.append(len(shapes))
        opt_elements.append(offload_elements(mode, psi, pad, n))     # the elements the optimizer steps
        if plan.offload == "optimizer":
            off_buckets.append(_offload_buckets(gs, shapes, mode, n, pbytes, plan.bucket_bytes, units))
        states.append(state_bytes(mode, psi, n, pr.states, padded_psi=pad))
        if mode == "zero3":
            fwd_g, bwd_g, red = _unit_times(units, len(gs), n, pbytes, link_dp, f_stage[s], m,
                                            host=sync_time(mode, 1, c), rbytes=rbytes)
        else:
            fwd_g, bwd_g = [0.0] * len(gs), [0.0] * len(gs)
            red = _bucket_times(gs, mode, n, pbytes, link_dp, plan.bucket_bytes, [2 * f * m for f in f_stage[s]],
                                lead=sum(f_stage[s]) * m, rbytes=rbytes)
        dp_fwd_gather.append(fwd_g)
        dp_bwd_gather.append(bwd_g)
        dp_bwd_reduce.append(red)
        # ZeRO-1/2's replica gathers after the step, a bucket at a time (bytes, timed below)
        dp_tail_buckets.append([sum(padded_numel(shapes[x], n) for x in b) * pbytes
                             for b in _grad_buckets(gs, shapes, n, pbytes, plan.bucket_bytes)]
                            if mode in ("zero1", "zero2") and n > 1 else [])
    # ---- point-to-point between stages ----------------------------------------------------------
    p2p_bytes = [stage_groups[s][-1].cross_bytes if s < S - 1 else 0.0 for s in range(S)]
    tied_bytes = 0.0
    if S > 1:
        for name in prof.tied:
            holders = [s for s, gs in enumerate(stage_groups) if any(name in g.reads for g in gs)]
            if len(set(h % p for h in holders)) > 1:   # exchanged as held: whole (ddp) or this rank's rows
                shp = prof.shapes[name]
                held = math.prod(shp) if mode == "ddp" else padded_numel(shp, n) // n
                tied_bytes += held * pr.landed     # the gradients as they landed
    opt_time = [optimizer_time(states[s], n_tensors[s], c) * slow for s in range(S)]
    pr_device, copies = pr, [None] * S
    if plan.offload == "optimizer":    # the step on the host; the host link's copies around it (cost.offload)
        opt_time = [host_step_time(opt_elements[s], n_tensors[s], pr, c) * slow for s in range(S)]
        copies = [host_copies(off_buckets[s], mode, pr, c, slow) for s in range(S)]
        pr_device = device_precision(pr)
    # the runtime's host work per tensor, at the contention's slowdown (on ranks sharing cores, at
    # the mode's measured share of it, ``Cluster.shared_sync``)
    host_slow = slow * (dict(getattr(c, "shared_sync", ())).get(mode, 1.0) if world > c.gpus_per_node else 1.0)
    sync = [sync_time(mode, n_tensors[s], c) * host_slow if has_reducer(mode, n, S > 1) else 0.0 for s in range(S)]
    # ZeRO-1/2: the updated shards all-gathered after the optimizer step
    tail_parts = [replica_gathers(b, n, link_dp, c, opt_time[s] / slow, slow) for s, b in enumerate(dp_tail_buckets)]
    dp_time_tail = [sum(parts) for parts in tail_parts]
    if plan.offload == "optimizer":     # each bucket's copy up pipelined with that bucket's own gather
        copies = [dataclasses.replace(x, gather_parts=tuple(parts)) for x, parts in zip(copies, tail_parts)]

    # ---- time ---------------------------------------------------------------------------------
    timeline: list = []
    # each stage's pass (a module call forward and backward) has a cost beyond its ops, and on
    # a pipeline each micro-batch's send and receive take the host too
    dev = c.device
    if S == 1:
        F, B = list(F), list(B)
        F[0] += dev.pass_overhead * (1 - dev.backward_pass_share) * cslow
        B[0] += sync[0] + dev.pass_overhead * dev.backward_pass_share * cslow   # the bucket bookkeeping runs inside backward
        def one_stage(copies_, lanes):
            return _single_stage(F, B, dp_fwd_gather[0], dp_bwd_gather[0], dp_bwd_reduce[0], dp_time_tail[0],
                                 opt_time[0], mode, n, lanes, simulate, plan.overlap, copies_)

        step, compute, exposed, bubble = one_stage(copies[0], timeline)
        loss = link_dp.overlap_loss if n > 1 and plan.overlap else 0.0
        if loss:     # collectives overlapped with compute that still delay it (measured, local preset)
            if simulate:     # the compute lane's work, then the communication's lanes as they ran
                serial = sum(t1 - t0 for _, lane, _, t0, t1 in timeline if lane == "compute") + \
                    busy_union([(t0, t1) for _, lane, _, t0, t1 in timeline if lane == "comm"])
            else:            # the closed form has no lanes: each collective in turn
                serial = _single_stage(F, B, dp_fwd_gather[0], dp_bwd_gather[0], dp_bwd_reduce[0], dp_time_tail[0],
                                       opt_time[0], mode, n, [], simulate, False, copies[0])[0]
            hidden = max(0.0, serial - step)
            formulas.append(("overlap on shared cores", "step = overlapped + overlap_loss x (compute + "
                             "communication busy - overlapped)",
                             f"{step:.4g} s + {loss:.2f} x {hidden:.4g} s = {step + loss * hidden:.4g} s"))
            step, exposed = step + loss * hidden, exposed + loss * hidden
        if copies[0] is not None:     # what the copies down, then up, add: the step without them
            no_down = dataclasses.replace(copies[0], down=(0.0,) * len(copies[0].down))
            no_copies = dataclasses.replace(no_down, up=(0.0,) * len(no_down.up))
            without = [one_stage(x, [])[0] for x in (no_down, no_copies)]
            host_exposed = (step - without[0], without[0] - without[1])
        tp_exposed = sum(tpf) + sum(tpb)
        exposed += tp_exposed
        compute -= tp_exposed
    else:
        msgs = [(s > 0) + (s < S - 1) for s in range(S)]     # a receive and a send per pass
        Fs = [stage_sum(F, s) + (dev.pass_overhead * (1 - dev.backward_pass_share) + msgs[s] * dev.message_overhead)
              * cslow for s in range(S)]
        Bs = [stage_sum(B, s) + (dev.pass_overhead * dev.backward_pass_share + msgs[s] * dev.message_overhead) * cslow
              for s in range(S)]
        Ws = [stage_sum(W, s) for s in range(S)]
        if plan.split_backward:     # splitting W out of backward costs host work of its own (measured on
            #                         the local preset: per W action, and per matmul whose weight gradient W
            #                         defers), part of it in the forward (each deferring matmul's autograd
            #                         function), the rest in B and W
            split = [(dev.split_pass_overhead + dev.split_op_overhead * sum(g.weight_matmuls for g in stage_groups[s]))
                     * cslow
                     for s in range(S)]
            share = dev.split_forward_share
            Fs = [f + x * share for f, x in zip(Fs, split)]
            Bs, Ws = [b + x * (1 - share) for b, x in zip(Bs, split)], [w + x * (1 - share) for w, x in zip(Ws, split)]
        refills = [0.0] * S
        if shared is not None:     # an action on a time-shared core refills the cache (refill_time)
            load: dict = {}
            for grp, _, procs in shared[1]:
                load[grp] = load.get(grp, 0.0) + procs
            for s in range(S):
                grp, cores, _ = shared[1][s % p]
                if load[grp] > cores:
                    refills[s] = refill_time(psi_stage[s], sum(saved_bytes(g, kinds.get(g.name, "none"))
                                                               for g in stage_groups[s]), pbytes, c)
            Fs, Bs = [f + x for f, x in zip(Fs, refills)], [b + x for b, x in zip(Bs, refills)]
            if plan.split_backward:
                Ws = [w + x for w, x in zip(Ws, refills)]
        if mode == "zero3":    # each micro-batch gathers the stage's units again (prefetched, or not)
            both = max if plan.overlap else (lambda a, b: a + b)
            Fs = [both(Fs[s], sum(dp_fwd_gather[s])) for s in range(S)]
            Bs = [both(Bs[s], sum(dp_bwd_gather[s])) for s in range(S)]
        hop = [pipeline_hop_time(p2p_bytes[s], link_pp, after=sum(f_stage[s]), schedule=plan.pp_schedule)
               for s in range(S)]
        pipe, bubble, busy = pipeline_time(plan, p, m, v, Fs, Bs, Ws, hop, timeline, simulate, shared,
                                            wake=getattr(link_pp, "wake", 0.0) if shared else 0.0, slow=slow)
        # after the last micro-batch: deferred dp reduction, tied gradients, optimizer, ZeRO gathers
        reduce_t, tail_t = [sum(dp_bwd_reduce[s]) for s in range(S)], list(dp_time_tail)
        if plan.offload == "optimizer":   # each bucket's copy down once its reduction lands it; the copies
            reduce_t = [flow_time(dp_bwd_reduce[s][::-1], copies[s].down_by_group(len(stage_groups[s]))[::-1])
                        for s in range(S)]            # up pipelined with the gathers (cost.offload)
            tail_t = [copies[s].up_tail(dp_time_tail[s]) for s in range(S)]
        after = [reduce_t[s] + opt_time[s] + tail_t[s] + sync[s] for s in range(S)]
        per_rank_after = [sum(after[s] for s in range(S) if s % p == r) for r in range(p)]
        # past its schedule a pipeline's ranks wait in these exchanges rather than compute, so
        # where ranks share cores they too ride the link as measured with a core per rank (the
        # shared link's fits are of ranks that all computed just before)
        link_tail = c.axis_link(axes, "pp")
        tied_t = tied_exchange_time(tied_bytes, link_tail)
        # the mean loss broadcast from the last stage over the pipeline's ranks (a binomial tree)
        loss_t = loss_broadcast_time(p, link_tail)
        # the rank that ends the schedule last meets the others after they waited for it, and
        # those exchanges then cost it more (measured, local preset: Link.tail)
        wait = schedule_wait(timeline, p, Bs, hop)
        late_t = schedule_tail_time(link_tail, wait)
        step = pipe + max(per_rank_after) + tied_t + loss_t + late_t
        if any(refills):
            formulas.append(("cache refill on a time-shared core", "per F, B (and W) action: 2 x (stage parameters "
                             "+ micro-batch activations) / (bandwidth x memory_eff)",
                             ", ".join(f"stage {s} {x * 1e3:.3g} ms" for s, x in enumerate(refills))))
        if late_t:
            a, b = link_tail.tail
            formulas.append(("pipeline schedule tail", "late = a + b x the other ranks' wait for the last",
                             f"{a * 1e3:.3g} ms + {b:.3g} x {wait * 1e3:.3g} ms = {late_t * 1e3:.3g} ms"))
        for r in range(p):      # after the schedule: the deferred reduction, the optimizer, the gathers
            mine = [s for s in range(S) if s % p == r]
            t0 = pipe
            up = "params up + all_gather" if plan.offload == "optimizer" else "all_gather params"
            for label, lane, dur in (("dp reduction (deferred)", "comm", sum(reduce_t[s] + sync[s] for s in mine)),
                                     ("schedule tail", "comm", late_t),
                                     ("tied gradients", "comm", tied_t),
                                     ("loss broadcast", "comm", loss_t),
                                     ("optimizer", "compute", sum(opt_time[s] for s in mine)),
                                     (up, "comm", sum(tail_t[s] for s in mine))):
                if dur:
                    timeline.append((r, lane, label, t0, t0 + dur))
                    t0 += dur
        tp_exposed = m * max(sum(tpf[a:b]) + sum(tpb[a:b]) for a, b in bounds)
        compute = busy - tp_exposed
        exposed = tp_exposed + max(per_rank_after) - min(opt_time) + tied_t + loss_t + late_t
        worst_r = max(range(p), key=lambda r: per_rank_after[r])
        host_exposed = tuple(sum(x[s] - y[s] for s in range(S) if s % p == worst_r)
                             for x, y in ((reduce_t, [sum(r) for r in dp_bwd_reduce]), (tail_t, dp_time_tail)))
    # ---- bytes per rank ---------------------------------------------------------------------------
    by_axis: dict = {}
    per_rank = []
    for r in range(p):
        mine = [s for s in range(S) if s % p == r]
        tot = {}
        tp_b = m * sum(b for s in mine for g in stage_groups[s] for _, b, _ in g.tp_forward + g.tp_backward
                       + (g.tp_forward if kinds.get(g.name) == "full" else []))   # a recomputed layer's again
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
    # a stage's received inputs, per micro-batch: held from its forward to its backward (the runtime
    # keeps them to take their gradients), beside the sender's own copy
    received_by = [p2p_bytes[s - 1] if s > 0 and p > 1 else 0.0 for s in range(S)]
    for r in range(p):
        mine = [s for s in range(S) if s % p == r]
        gs = [g for s in mine for g in stage_groups[s]]
        names = set().union(*(g.params.keys() | g.reads for g in gs)) if S > 1 else set(prof.shapes)
        received = [received_by[s] if i == 0 else 0.0 for s in mine for i in range(len(stage_groups[s]))]
        flight, w_extra = _schedule_flight(plan, p, m, v, stage_groups, kinds, r, pr.compute, received_by) \
            if S > 1 else (inflight_microbatches(plan.pp_schedule, p, m, v, stage=r), 0.0)
        mem_rank.append(_memory(gs, names, prof, mode, n, pr_device, plan.bucket_bytes, kinds, flight, S > 1,
                                staging=c.name == "local", offload=plan.offload == "optimizer", extra=w_extra,
                                received=received, parts=[stage_groups[s] for s in mine] if S > 1 else None,
                                microbatches=m))
    worst_m = max(range(p), key=lambda r: mem_rank[r][0])
    total, st, act, transient = mem_rank[worst_m]
    psi_total = sum(psi_stage[s] for s in range(S) if s % p == worst_m)
    lay = _first_layer(groups)
    formulas.append(("forward compute / layer / micro-batch",
                     GROUP_TIME_FORMULA + (" (x slowdown of ranks sharing cores)" if slow > 1 else ""),
                     f"{lay.dense_flops:,.0f} FLOP, {lay.attention_flops:,.0f} FLOP, {lay.attention_heads:,.0f} "
                     f"slices, {lay.pointwise_bytes:,.0f} B, {lay.ops} ops"
                     + (f" (weighing {dispatch_ops(lay, c.device):.1f} by their measured dispatch)"
                        if c.device.op_weights else "")
                     + f" -> {group_time(lay, c) * 1e3:.4g} ms"
                     + (f" x {slow:.2f}" if slow > 1 else "")))
    formulas.append(_precision_formula(plan, pr, lay, c))
    formulas.append((f"model states ({mode}, {_precision_name(plan, pr)}"
                     f"{', optimizer state on the host' if plan.offload else ''})",
                     str(model_state_bytes(mode, pr_device.states)), f"{st:,.0f} B at Psi={psi_total:,} (sharded "
                     f"terms padded to N equal chunks), N={n}"))
    host_bytes = host_memory = 0.0
    host_times = {}
    if plan.offload == "optimizer":
        mixed = pr.mixed
        host_times = {"host step": max(opt_time), "host link down (exposed)": host_exposed[0],
                      "host link up (exposed)": host_exposed[1]}    # what the copies add to the step
        per_rank_host = [sum(sum(host_link_bytes(opt_elements[s], pr)) for s in range(S) if s % p == r)
                         for r in range(p)]
        host_bytes = max(per_rank_host)
        host_memory = max(sum(host_bytes_per_element(pr) * opt_elements[s] for s in range(S)
                              if s % p == r) for r in range(p))
        formulas.append(("host link bytes / step (offload)", f"{host_link_formula(mode, pr)} (gradients "
                         f"down as they land, parameters up; ZeRO's Psi/N padded"
                         f"{'; fp32 masters stay on the device, so 4 B each way' if mixed else ''})",
                         f"{host_bytes:,.0f} B over {c.host.name} at {c.host.bandwidth / 1e9:.1f} GB/s"))
    formulas.append(("activations", f"saved per micro-batch x in-flight ({plan.pp_schedule or 'no pipeline'})",
                     f"{act:,.0f} B"))
    if t > 1:
        formulas.append(("tp bytes / layer / micro-batch", f"{tp_layer_comm_elements()} x element bytes (+ sp re-gather)",
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
                                    "optimizer": max(opt_time), **host_times},
                    formulas=formulas, timeline=timeline, fits=total <= device_mem, device_memory=device_mem,
                    host_bytes=host_bytes, host_memory_bytes=host_memory,
                    recompute_layers={k: v for k, v in kinds.items() if v != "none"},
                    caveats=([] if as_cut else _stage_caveats(groups, S)) + (
                        [profiles.caveats[plan.param_dtype]] if isinstance(profiles, Profiles)
                        and plan.param_dtype in profiles.caveats else []))


def _precision_name(plan: Plan, pr: Precision) -> str:
    """The plan's precision in words: ``mixed precision: bfloat16 compute, float32 masters,
    float32 sums``, or without ``param_dtype`` the model's own (``float32 throughout``)."""
    def name(dtype):
        return str(dtype).removeprefix("torch.")
    if plan.mixed:
        return (f"mixed precision: {name(plan.param_dtype)} compute, {name(plan.master_dtype)} masters, "
                f"{name(plan.grad_reduce_dtype)} sums")
    return {4: "float32", 2: "16-bit", 8: "float64"}.get(pr.compute, f"{pr.compute}-byte") + " throughout"


def _precision_formula(plan: Plan, pr: Precision, g: GroupCost, c) -> tuple:
    """(what, formula, value) of the bytes per element each copy is priced at and the matmul peak
    of the dtype the layers compute in."""
    dtype = g.matmul_dtype
    peak = c.device.matmul_peak(dtype)
    return (f"precision ({_precision_name(plan, pr)})",
            "bytes/element: compute copies & gathers, gradient sums, (p, g, K) kept; matmul peak of the compute dtype",
            f"{pr.compute} B, {pr.reduce} B, {pr.states}; {str(dtype or 'bf16').removeprefix('torch.')} matmuls at "
            f"{peak / 1e12:.4g} TFLOP/s peak x {c.device.matmul_efficiency}")


RECOMPUTE_MODES = ("none", "selective", "full")


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


def _cut_names(names: list, shapes: dict, n: int, nbytes: int, bucket_bytes: int) -> list[list[str]]:
    """``names`` in consecutive groups of at most ``bucket_bytes`` (``sizes.cut_buckets``, every
    group capped alike), their bytes padded to ``n`` equal chunks."""
    return [[names[i] for i in b]
            for b in cut_buckets([padded_numel(shapes[x], n) * nbytes for x in names], bucket_bytes, bucket_bytes)]


def _first_use(gs, shapes: dict) -> list[str]:
    """``shapes``' parameters in order of first use: the groups' parameters in order, then the others."""
    return [x for g in gs for x in g.params if x in shapes] + [x for x in shapes if not any(x in g.params for g in gs)]


def _grad_buckets(gs, shapes: dict, n: int, nbytes: int, bucket_bytes: int) -> list[list[str]]:
    """The gradient buckets of ``shapes``' parameters as the collectives pass cuts them
    (``sizes.cut_buckets`` over their bytes, ``nbytes`` per element, padded to ``n`` equal
    chunks), in the order gradients become ready: the reverse of first use (the groups'
    parameters in order, then the others)."""
    ready = list(reversed(_first_use(gs, shapes)))
    return [[ready[i] for i in b]
            for b in cut_buckets([padded_numel(shapes[x], n) * nbytes for x in ready], bucket_bytes)]


def _gather_units(gs, shapes: dict, n: int, nbytes: int, bucket_bytes: int) -> list[list[str]]:
    """ZeRO-3's gather units as the collectives pass makes them (one per numbered layer, the
    other parameters one root unit, each cut where it passes ``bucket_bytes``), in order of
    first use."""
    order = _first_use(gs, shapes)
    by_key: dict = {}
    for x in order:
        by_key.setdefault(layer_key(x) or "", []).append(x)
    units = [u for members in by_key.values() for u in _cut_names(members, shapes, n, nbytes, bucket_bytes)]
    position = {x: i for i, x in enumerate(order)}
    return sorted(units, key=lambda u: position[u[0]])


def _unit_buckets(gs, shapes: dict, n: int, nbytes: int, bucket_bytes: int) -> list[list[str]]:
    """ZeRO-3's gradient buckets: its gather units (``_gather_units``), last unit first, each
    unit's members last first."""
    return [list(reversed(u)) for u in reversed(_gather_units(gs, shapes, n, nbytes, bucket_bytes))]


@dataclass(frozen=True)
class Unit:
    """One of ZeRO-3's gather units (``_zero3_units``): its padded ``elements``, and the group
    indices where the runtime moves it: ``forward``, its gather before the first group that
    reads a member, and its gradients' reduce-scatter after that group's backward (backward
    runs in reverse: that member's gradient is the unit's last); ``backward``, its re-gather
    before the last group whose backward reads a member (None: backward reads none)."""
    names: tuple
    elements: int
    forward: int
    backward: Optional[int]


def _zero3_units(gs, shapes: dict, n: int, nbytes: int, bucket_bytes: int) -> list[Unit]:
    """A stage's ZeRO-3 units as the collectives pass makes them (``_gather_units``: one per
    numbered layer, the other parameters one root unit, each cut at ``bucket_bytes``), in order
    of first use, each placed on the groups whose work moves it. The root unit (embeddings,
    final norm, head) is gathered once in forward, before the embedding, and once in backward,
    before the head, and reduced once, after the embedding's backward: one collective each,
    not one per group."""
    readers, back_readers = {}, {}
    for i, g in enumerate(gs):
        for x in g.reads | g.params.keys():
            readers.setdefault(x, []).append(i)
        for x in g.read_by_backward:
            back_readers.setdefault(x, []).append(i)
    out = []
    for members in _gather_units(gs, shapes, n, nbytes, bucket_bytes):
        first = min((i for x in members for i in readers.get(x, ())), default=0)
        back = max((i for x in members for i in back_readers.get(x, ())), default=None)
        out.append(Unit(tuple(members), padded_sum({x: shapes[x] for x in members}, n), first, back))
    return out


def _unit_times(units: list[Unit], groups: int, n: int, pbytes: int, link, forward: list, m: int,
                host: float = 0.0, rbytes: Optional[int] = None) -> tuple:
    """(forward gathers, backward gathers, reduce-scatters): seconds per group of a stage's
    ZeRO-3 ``units`` (``_zero3_units``), each collective after the compute of the group it
    precedes or follows (``forward``: each group's forward compute; backward twice it, over
    ``m`` micro-batches for the reductions, which a pipeline defers to its flush), shared among
    the units that group moves. ``host``: the data-parallel runtime's work per parameter tensor in
    a step (``Device.sync_overhead``), a unit's share of it taken as CPU work before each of its
    three collectives, a third each: with the compute, the skew probe's abscissa. Gathers move
    ``pbytes`` per element (the compute dtype), reduce-scatters ``rbytes`` (the reduce dtype;
    None: ``pbytes``)."""
    out = {"forward": [0.0] * groups, "backward": [0.0] * groups, "reduce": [0.0] * groups}
    for lane, place, kind, scale in (("forward", "forward", "all_gather", 1), ("backward", "backward", "all_gather", 2),
                                     ("reduce", "forward", "reduce_scatter", 2 * m)):
        at = [getattr(u, place) for u in units]
        for u, i in zip(units, at):
            if i is not None:
                nbytes = u.elements * (pbytes if kind == "all_gather" or rbytes is None else rbytes)
                out[lane][i] += collective_time(kind, nbytes, n, link,
                                                after=scale * forward[i] / at.count(i) + host * len(u.names) / 3)
    return out["forward"], out["backward"], out["reduce"]


def _bucket_times(gs, mode, n, pbytes, link, bucket_bytes, backward, lead=0.0, rbytes=None) -> list:
    """Seconds of the gradient reductions each group's backward completes (ZeRO-3's:
    ``_unit_times``): the buckets of ``_grad_buckets`` (ddp unpadded; cut by ``pbytes`` per
    element, the dtype the graph holds the parameters in), each ``rbytes`` per element (the
    reduce dtype; None: ``pbytes``) once its last gradient is ready. ``backward``: each
    group's backward compute; ``lead``: the compute before backward since the ranks last
    synchronised (what the first reduction follows)."""
    out = [0.0] * len(gs)
    if n <= 1:
        return out
    kind, shard = ("all_reduce", 1) if mode == "ddp" else ("reduce_scatter", n)
    shapes = {x: shp for g in gs for x, shp in g.params.items()}
    group_of = {x: i for i, g in enumerate(gs) for x in g.params}
    completes: dict = {}
    for b in _grad_buckets(gs, shapes, shard, pbytes, bucket_bytes):
        completes.setdefault(min(group_of[x] for x in b), []).append(
            sum(padded_numel(shapes[x], shard) for x in b) * (pbytes if rbytes is None else rbytes))
    since = lead
    for i in reversed(range(len(gs))):
        since += backward[i]
        for nbytes in completes.get(i, ()):
            out[i] += collective_time(kind, nbytes, n, link, after=since or None)
            since = 0.0
    return out


def _offload_buckets(gs, shapes: dict, mode: str, n: int, nbytes: int, bucket_bytes: int, units: list) -> list:
    """(group completing it, this rank's elements) of each gradient bucket in launch order, for
    the host link's copies: ZeRO-3 its ``units`` (``_zero3_units``), last first, the others
    ``_grad_buckets`` (ZeRO: each member's padded share; a parameter of no group: group 0)."""
    if mode == "zero3":
        return [(u.forward, u.elements / n) for u in reversed(units)]
    share = 1 if mode == "ddp" else n
    group_of = {x: i for i, g in enumerate(gs) for x in g.params}
    return [(min(group_of.get(x, 0) for x in b), sum(padded_numel(shapes[x], share) for x in b) / share)
            for b in _grad_buckets(gs, shapes, share, nbytes, bucket_bytes)]


def _memory(gs, names, prof, mode, n, pr: Precision, bucket_bytes, recompute, flight, pipelined, staging=False,
            offload=False, extra=0.0, received=None, parts=None, microbatches=1):
    """(peak, model states, activations, transient) bytes of one rank: a walk over the step as
    the runtime allocates it. Persistent: parameters (ZeRO-3: shards), optimizer state, ZeRO-1's
    full-gradient buffer. Forward: activations of the in-flight micro-batches, the outputs and
    the loss's copy of them, ZeRO-3's gathered units. Backward, layer by layer in reverse: the
    layer's working set (its largest activation and that one's gradient), gradients waiting for
    their bucket, each bucket's flat buffer when it completes (ddp: it becomes .grad; ZeRO-2/3:
    freed once its reduce-scatter is waited on, before the next bucket's is made, the reduced
    shard kept), activations freed as layers finish.
    With a pipeline, gradients accumulate across micro-batches (whole) until the flush.
    ``staging``: the backend copies a reduce-scatter's input (gloo does; NCCL does not): ZeRO-1's
    (its persistent buffer is not scratch); ZeRO-2/3 reduce their scratch buffer in place
    (``AxisComm.reduce_scatter_flat(in_place=True)``).
    ZeRO-3 in forward: the unit in use, copied out of its flat buffer (which then goes), and
    the next one's gather in flight into its own (broadcast in place: no staging copy) with its
    send buffer: (2 + 1/N) units of its largest.
    ``offload``: the step runs on the host, after the device's gradients were dropped, and
    ZeRO-1/2's replica gathers are pipelined with the copies up (two buckets in flight).
    ``extra``: what a split backward's W adds beyond the activations' peak (``_schedule_flight``).
    ``received``: per group of ``gs``, the bytes of a micro-batch's inputs its stage receives
    (on the stage's first group): the receiving stage keeps them to its backward.
    ``parts``: the groups of each pipeline stage this rank runs; each stage has a reducer, and
    buckets, of its own. ``microbatches``: a pipeline's; from the second on, a micro-batch's
    gradients are summed into those accumulated (``_accumulation_peak``).
    ``pr``: bytes per element of each copy (``cost.memory.Precision``): ``states`` persist, the
    gathered units and autograd's gradients are in the compute dtype, bucket buffers and
    accumulated micro-batch gradients in the reduce dtype, reduced gradients land as ``landed``."""
    pb = gb = pr.compute            # gathered copies; gradients as autograd makes them
    rb, land, ob = pr.reduce, pr.landed, pr.states[2]
    shapes = {x: sh for x, sh in prof.shapes.items() if x in names}     # in the profile's order (names is a set)
    psi = sum(math.prod(sh) for sh in shapes.values())
    pad = padded_sum(shapes, n)
    zero = mode != "ddp"
    base = persistent_bytes(mode, psi, n, pr.states, pad)
    states = state_bytes(mode, psi, n, pr.states, padded_psi=pad)
    received = received or [0.0] * len(gs)
    saved = [(saved_bytes(g, recompute.get(g.name, "none")) + received[i]) * flight for i, g in enumerate(gs)]
    final = sum(g.final_bytes for g in gs) * flight
    act = sum(saved) + final * 2                       # outputs, and the loss's copy of them
    # ZeRO-3's gather units: a layer's parameters, cut where they pass the bucket size (as the
    # collectives pass cuts them: passes.collectives._gather_units)
    units = [pb * sum(padded_numel(shapes[g_x], n) for g_x in cut)
             for g in gs if is_layer(g.name)
             for cut in _cut_names([x for x in g.params if x in shapes], shapes, n, pb, bucket_bytes)]
    root = pb * sum(padded_sum(g.params, n) for g in gs if not is_layer(g.name))
    top = max(units, default=0.0)
    gathered = (root + (2 + 1 / n) * top) if mode == "zero3" else 0.0
    peak = base + act + gathered
    if pipelined and extra:          # a zero-bubble W: the stage's weight gradients made at once
        peak = max(peak, base + gb * psi + act + extra)
    buckets = (_unit_buckets(gs, shapes, n, gb, bucket_bytes) if mode == "zero3"
               else _grad_buckets(gs, shapes, n if zero else 1, gb, bucket_bytes))
    # each stage's own buckets (a rank of an interleaved pipeline runs several stages)
    stage_sets = [(part, {x: sh for x, sh in shapes.items() if any(x in g.params or x in g.reads for g in part)})
                  for part in parts] if parts else [(gs, shapes)]
    # a pipeline's micro-batch gradients wait in their stage's buckets, then join the accumulated
    # (``DataParallelSync._accumulate``); a stage with nothing to reduce leaves them to autograd
    accumulating = pipelined and microbatches > 1
    part_queues = ([[[(k, x) for x in b] for b in _grad_buckets(part, sh, n if zero else 1, gb, bucket_bytes)]
                    for k, (part, sh) in enumerate(stage_sets)]
                   if accumulating and mode != "zero3" and has_reducer(mode, n, pipelined) else None)
    # (stage, parameter) pairs by the group whose backward completes the parameter's gradient:
    # the stage's first group to read it (a tied weight's copy on the last stage included)
    arrivals: dict = {}
    for k, (part, sh) in enumerate(stage_sets if accumulating else ()):
        for x in sh:
            first = next((g for g in part if x in g.params or x in g.reads), None)
            if first is not None:
                arrivals.setdefault(id(first), []).append((k, x))
    done, pending, flats, outs, grads = set(), 0.0, 0.0, 0.0, 0.0
    accumulated = rb * psi if pipelined else 0.0      # micro-batch gradients held until the flush
    rem = act
    # ZeRO-3 in backward: the unit in use and the next one prefetched (two units; a unit is
    # copied out of its flat buffer before the next is issued)
    unit_bwd = [2 * top] if mode == "zero3" else []
    for i in reversed(range(len(gs))):
        g = gs[i]
        kind = recompute.get(g.name, "none")
        # a recomputed layer's activations live again while its backward runs (one micro-batch's);
        # a recomputed attention core's once the ops after it have run backward and let go of
        # what they kept (``saved_after_core``)
        redo = g.saved if kind == "full" else (
            max(0.0, g.saved_quadratic - g.saved_after_core) if kind == "selective" else 0.0)
        work = 2 * g.max_value + redo + (sum(unit_bwd) if unit_bwd else 0.0)
        peak = max(peak, base + rem + pending + flats + outs + grads + accumulated + work)
        freed = saved[i] + (2 * g.final_bytes * flight if g.final_bytes else 0.0)
        if pipelined:   # one micro-batch's backward: the others in flight keep theirs
            rem = max(0.0, rem - freed / max(flight, 1.0))
            if accumulating:
                top, pending = _accumulation_peak(arrivals.get(id(g), []), shapes, mode, gb, part_queues, done, pending)
                peak = max(peak, base + rem + accumulated + top)
            continue
        rem -= freed
        # the layer's gradients arrive one at a time (the reverse of forward's order); each
        # bucket goes out as soon as its last member's has
        for x in reversed([x for x in g.params if x in shapes]):
            pending += gb * math.prod(shapes[x])
            done.add(x)
            while buckets and all(y in done for y in buckets[0]):
                b = buckets.pop(0)
                flat_elements = padded_sum({y: shapes[y] for y in b}, n if zero else 1)
                flat = rb * flat_elements
                # ZeRO-3: the next unit in flight, and what of this layer's unit backward still reads
                # (a weight is dropped once the matmul that saved it has run: its gradient exists)
                units_now = (min(top + pb * sum(math.prod(sh) for y, sh in g.params.items()
                                                if y in shapes and y not in done), 2 * top)
                             if unit_bwd else 0.0)
                live = base + rem + pending + outs + grads + units_now
                if mode in ("zero2", "zero3"):   # the previous bucket's goes before this one is filled
                    # (beside its members' gradients); then the members' go, and the reduce-scatter
                    # runs on the flat buffer in place (no staging copy), its shard beside it
                    members = gb * sum(math.prod(shapes[y]) for y in b)
                    peak = max(peak, live + flat, live - members + flat + flat / n)
                elif mode == "zero1":    # summed into the persistent buffer through a flat copy; its
                    # reduce-scatter (the backend's staging copy of it in flight until the next
                    # bucket fills) lands in a shard kept to the end of backward
                    members = gb * sum(math.prod(shapes[y]) for y in b)
                    peak = max(peak, live + flat, live - members + flat / n + (flat if staging else 0.0))
                else:
                    peak = max(peak, live + flats + flat)
                pending -= gb * sum(math.prod(shapes[y]) for y in b)
                if mode == "ddp":
                    grads += land * flat_elements
                elif mode in ("zero2", "zero3"):
                    flats = flat            # freed as reduced: kept until the next bucket fills
                    outs += land * flat_elements / n
                else:
                    flats = flat if staging else 0.0
                    outs += flat / n
    if pipelined:     # the flush: bucket by bucket, each made from the accumulated gradients of its
        # members, which then go (``DataParallelSync.flush_deferred``)
        flat_all = rb * (pad if zero else psi)
        top_flat = max((rb * padded_sum({x: sh[x] for x in b}, n if zero else 1)
                        for part, sh in stage_sets
                        for b in (_unit_buckets if mode == "zero3" else _grad_buckets)(
                            part, sh, n if zero else 1, gb, bucket_bytes)), default=0.0)
        if mode in ("zero2", "zero3"):   # each freed as reduced, its shard kept
            peak = max(peak, base + accumulated + 2 * top_flat + flat_all / n)
        else:   # ddp: the flat buffers become the gradients as the accumulated go; ZeRO-1: each is
            # summed into the persistent buffer (in the base) and goes before its reduce-scatter
            # (and the backend's staging copy) is issued
            peak = max(peak, base + accumulated + top_flat)
        grads = land * (pad / n if zero else psi) if mode != "zero1" else 0.0
    else:
        grads = grads if mode == "ddp" else (outs if mode in ("zero2", "zero3") else 0.0)
    opt_tmp = 0.0 if offload else 2 * ob / 2 * max((math.prod(sh) for sh in shapes.values()), default=0)
    if mode in ("zero1", "zero2"):   # the replicas' all-gather, a bucket at a time: its shard and result
        # (and the backend's staging copy of the result: gloo's all_gather_into_tensor gathers into
        # a buffer of its own, then copies it out)
        gathers = sorted((pb * padded_sum({x: sh[x] for x in b}, n) * (1 + 1 / n + (1.0 if staging else 0.0))
                          for part, sh in stage_sets for b in _grad_buckets(part, sh, n, pb, bucket_bytes)),
                         reverse=True)
        opt_tmp += sum(gathers[:2 if offload else 1])
    peak = max(peak, base + (0.0 if offload else grads) + opt_tmp)
    return peak, states, act, peak - base - act if peak > base + act else 0.0


def _accumulation_peak(arriving, shapes, mode, gb, part_queues, done, pending: float) -> tuple:
    """(the peak, the bytes still waiting in buckets after): what the gradients of a pipelined
    micro-batch that one group's backward completes (``arriving``: (stage, parameter) pairs)
    hold beyond the activations and the gradients accumulated over the step's earlier
    micro-batches, at its worst (the second micro-batch: ``DataParallelSync._accumulate`` keeps
    the first as autograd made it and makes the sum as a new tensor beside both, later ones add
    in place). With buckets (``part_queues``, each stage's in the order they complete; consumed
    here) a micro-batch's gradients wait in theirs until its last member's arrives, and are
    summed in one at a time while all of them are held: the bucket's members and one sum.
    ZeRO-3 sums each as autograd makes it: the gradient and its sum. Without a reducer autograd
    adds into ``.grad`` in place: the gradient. ``done``: the parameters whose gradients have
    arrived (updated); ``pending``: the bytes of arrived gradients whose buckets are not
    complete."""
    worst = 0.0
    for k, x in reversed(arriving):
        size = gb * math.prod(shapes[x])
        if part_queues is None:
            worst = max(worst, pending + (2 if mode == "zero3" else 1) * size)
            continue
        done.add((k, x))
        pending += size
        q = part_queues[k]
        while q and all(y in done for y in q[0]):
            sizes = [gb * math.prod(shapes[y]) for _, y in q.pop(0)]
            worst = max(worst, pending + max(sizes))
            pending -= sum(sizes)
    return worst, pending


def _schedule_flight(plan, p, m, v, stage_groups, kinds, r, grad_bytes, received=None) -> tuple:
    """(rank ``r``'s peak of activation bytes over its actions in the schedule, in micro-batches
    through all of its stages' layers; what a W action adds beyond that peak). F of a stage
    adds one micro-batch's activations; B frees them, but under a split backward keeps what W
    reads (each weight matmul's input and output gradient, ``GroupCost.w_stash``) until that
    micro-batch's W, and W computes the stage's weight gradients all at once before autograd
    adds them to those accumulated (``runtime.wgrad``). 1F1B's walk gives min(m, p - r); an
    interleaved schedule's depends on how its stages' sizes differ. Schedules of more actions
    than the replay walks: ``inflight_microbatches``'s bound."""
    if m * p * v > 20000:
        return inflight_microbatches(plan.pp_schedule, p, m, v, stage=r), 0.0
    schedule, _ = lowered_schedule(plan.pp_schedule, p, m, v)
    # a stage's activations of one micro-batch, with the inputs it received (``received``, per
    # stage), kept from its F to its B
    act = [sum(saved_bytes(g, kinds.get(g.name, "none")) + 2 * g.final_bytes for g in gs)
           + (received[s] if received else 0.0) for s, gs in enumerate(stage_groups)]
    split = schedule.split_backward
    stash = [sum(g.w_stash for g in gs) if split else 0.0 for gs in stage_groups]
    wgrads = [grad_bytes * sum(math.prod(shp) for g in gs for shp in g.params.values()) for gs in stage_groups]
    alive = peak = at_w = 0.0
    for a in schedule.ranks[r]:
        if a.kind == "F":
            alive += act[a.stage]
        elif a.kind == "B":
            alive += stash[a.stage] - act[a.stage]
        elif a.kind == "W":
            at_w = max(at_w, alive + wgrads[a.stage])
            alive -= stash[a.stage]
        peak = max(peak, alive)
    whole = sum(act[s] for s in range(len(stage_groups)) if s % p == r)
    if not whole:
        return inflight_microbatches(plan.pp_schedule, p, m, v, stage=r), 0.0
    return peak / whole, max(0.0, at_w - peak)


def _stage_caveats(groups, S: int) -> list:
    """Given a bare profile (no captured graph to cut, no ``Profile.stage_starts``), the estimate
    cuts a pipeline between layers; the pipeline pass cuts between ops, where forward FLOPs
    balance and the fewest bytes cross. With more stages than layers the two differ: the
    runtime's stages end inside layers, and its sends and stage times with them. (``Profiles``
    and a compiled module's profile cut as the pass does.)"""
    layers = sum(1 for g in groups if is_layer(g.name))
    if S > 1 and S > layers:
        return [f"{S} pipeline stages over {layers} layers: the runtime cuts inside layers (passes.pipeline "
                "balances forward FLOPs op by op); this estimate cuts between layers, so its pipeline bytes and "
                "stage times are approximate"]
    return []


def _first_layer(groups):
    return next((g for g in groups if is_layer(g.name)), groups[0])


def _holds_tied(prof: Profile, gs) -> bool:
    names = set().union(*(g.reads for g in gs))
    return any(x in names for x in prof.tied)


def busy_union(intervals) -> float:
    """Seconds covered by the union of ``(start, end)`` intervals: how long some lane of them
    was busy (ZeRO-3's gathers and its reductions run on process groups of their own, side
    by side)."""
    covered, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > end:
            covered += b - max(a, end)
            end = b
    return covered


def _oversubscription(c, axes) -> float:
    """On the local CPU preset, ranks slow each other: beyond the core count they share cores,
    and below it they share caches and memory (the measured ``Cluster.slowdown``)."""
    return c.slowdown(math.prod(axes.values()))


def _single_stage(F, B, gf, gb, red, tail, opt, mode, n, timeline, simulate, overlap=True, copies=None):
    """One stage, two streams: returns (step, compute busy, exposed communication, bubble=0).
    With the overlap pass, ZeRO-3
    gathers go one unit ahead and gradient buckets are reduced while backward goes on (ZeRO-1
    too); without it, each collective is waited on when issued.

    ``copies`` (``Plan(offload="optimizer")``, ``cost.offload.HostCopies``): each bucket's
    gradients go down on the compute lane when the next bucket launches (the last, and all of
    ZeRO-1's, when backward ends, each after its own reduction); after the step on the host
    (``opt``) the parameters come up a bucket at a time on the compute lane, ZeRO-1/2's
    all-gather of each bucket (its share of ``tail``) on the communication lane after it."""
    down, up = (list(copies.down), list(copies.up)) if copies is not None else ([], [])
    gathers = copies.gathers(tail) if copies is not None else []
    if not overlap:
        compute = sum(F) + sum(B) + opt
        step = compute + sum(gf) + sum(gb) + sum(red) + tail + sum(down) + sum(up)
        t = 0.0
        for i in range(len(F)):
            for lane, name, d in (("comm", f"all_gather unit {i}", gf[i] if mode == "zero3" else 0.0),
                                  ("compute", f"F {i}", F[i])):
                if d:
                    timeline.append((0, lane, name, t, t + d))
                    t += d
        for i in reversed(range(len(B))):
            for lane, name, d in (("comm", f"all_gather unit {i} (backward)", gb[i] if mode == "zero3" else 0.0),
                                  ("compute", f"B {i}", B[i]), ("comm", f"reduce grads {i}", red[i] if n > 1 else 0.0),
                                  ("compute", f"grads down {i}", sum(d for g, d in zip(copies.group, down) if g == i)
                                   if copies is not None else 0.0)):
                if d:
                    timeline.append((0, lane, name, t, t + d))
                    t += d
        timeline.append((0, "compute", "optimizer", t, t + opt))
        t += opt
        for k, (u, g) in enumerate(zip(up, gathers)):
            timeline.append((0, "compute", f"params up, bucket {k}", t, t + u))
            if g:
                timeline.append((0, "comm", f"all_gather params, bucket {k}", t + u, t + u + g))
            t += u + g
        if tail and copies is None:
            timeline.append((0, "comm", "all_gather params", t, t + tail))
        return step, compute, step - compute, 0.0
    if not simulate:
        compute = sum(F) + sum(B) + opt
        if mode == "zero3":
            fwd = gf[0] + sum(max(f, g) for f, g in zip(F, gf[1:] + [0.0]))
            bwd = sum(max(b, g) for b, g in zip(B, gb))
        else:
            fwd, bwd = sum(F), sum(B)
        # the copies down on the compute lane (the last after the final reduction); up pipelined with the gathers
        after = copies.up_tail(tail) if copies is not None else tail
        step = fwd + bwd + red[0] + sum(down) + opt + after
        return step, compute, step - compute, 0.0
    comp_t = comm_t = red_t = 0.0
    red_end: dict = {}
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
        red_end[i] = red_t
        if copies is not None and copies.early:   # bucket k launches here: bucket k-1 lands, its copy goes down
            for k in (k for k, g in enumerate(copies.group) if g == i and k > 0):
                timeline.append((0, "compute", f"grads down, bucket {k - 1}", comp_t, comp_t + down[k - 1]))
                comp_t += down[k - 1]
    s0 = max(comp_t, comm_t, red_t)
    if copies is not None:    # the last bucket (ZeRO-1: every one) lands when its reduction ends
        t = comp_t
        for k in range(len(down) - 1 if copies.early else 0, len(down)):
            start = max(t, red_end.get(copies.group[k], 0.0))
            t = start + down[k]
            timeline.append((0, "compute", f"grads down, bucket {k}", start, t))
        s0 = max(t, s0)
    comp_t = s0 + opt
    timeline.append((0, "compute", "optimizer", s0, comp_t))
    if copies is not None:    # a bucket's copy up, then its gather while the next bucket's copy runs
        a = b = comp_t
        for k, (u, g) in enumerate(zip(up, gathers)):
            timeline.append((0, "compute", f"params up, bucket {k}", a, a + u))
            a += u
            if g:
                start = max(a, b)
                b = start + g
                timeline.append((0, "comm", f"all_gather params, bucket {k}", start, b))
        comp_t = max(a, b)
    elif tail:
        timeline.append((0, "comm", "all_gather params", comp_t, comp_t + tail))
        comp_t += tail
    compute = sum(F) + sum(B) + opt
    return comp_t, compute, comp_t - compute, 0.0



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
