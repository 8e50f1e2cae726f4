"""The planner (``autopar.plan``): search the plans of a world size for the fastest one that fits in memory.

The search space: every factorisation of the world into ``pp × dp × tp`` (tp dividing the
attention heads), the data-parallel mode (ddp, ZeRO-1/2/3), sequence parallelism, the
pipeline schedule with its micro-batch count (and stages per rank for the interleaved one),
and activation recomputation (none, selective, full). Every other field of a candidate is the
``base`` plan's: its precision (``param_dtype``, ``reduce_dtype``, ``master_dtype``), offload,
buckets, overlap; each candidate is priced in that precision. Per-node layouts come from the tensor-
parallel pass itself (Megatron's column/row choice found on the graph, autopar.passes), so a
candidate's graph is the one compile would build.

Each candidate is scored by a closed-form model over the *layer chain*: the profile of the
compiled graph (``cost.profile``) reduced to ``pre`` (embeddings), one layer and ``post``
(head, loss), the layer standing for each of the L repeated blocks — a repeated transformer
block is solved once, so a candidate costs the same for 24 or 192 layers. The closed forms are
those the detailed estimate (``cost.estimate``) replays in event time, and equal it for
uniform layers (tests check the ranking against it). Branch and bound: a candidate's busiest
rank computes at least ``(forward + backward) / pp`` of the whole model, so a mesh whose bound
exceeds the best time found skips its inner choices; ``exhaustive=True`` turns that off, and
tests check the answer is the same. The top candidates are then estimated in detail (event-
time replay of the schedule) for the report.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Optional

from autopar.mesh import Mesh
from autopar.planspec import DP_MODES, Plan
from autopar.sizes import FIRST_BUCKET_BYTES, batch_split_error, chunk, inflight_microbatches, state_bytes

from .cluster import get_cluster
from .comm import collective_time, pipeline_hop_time
from .compute import dispatch_ops, group_time
from .data_parallel import replica_gathers, sync_time
from .estimate import evaluate_plan
from .memory import persistent_bytes, precision
from .pipeline import closed_form_pipeline, loss_broadcast_time, schedule_tail_time, tied_exchange_time
from .profile import GroupCost, Profile
from .profile_cache import Profiles
from .result import Estimate
from .step_parts import group_passes, optimizer_time, oversubscription, padded_sum, saved_bytes

__all__ = ["find_plan", "PlanReport", "Candidate", "InfeasiblePlan", "candidates"]

RECOMPUTE = ("none", "selective", "full")


class InfeasiblePlan(ValueError):
    """No plan of the search space fits in device memory."""


@dataclass
class Candidate:
    plan: Plan
    axes: dict
    recompute: str
    step_time_s: float
    memory_bytes: float
    fits: bool
    reason: str = ""
    estimate: Optional[Estimate] = None

    @property
    def mesh_text(self) -> str:
        return "Mesh(" + ", ".join(f"{k}={v}" for k, v in self.axes.items()) + ")"


@dataclass
class PlanReport:
    """The planner's answer: ``plan`` on ``mesh`` (virtual, the axes to build a real one with),
    its predicted step time and peak memory per rank, and the best candidates side by side."""
    plan: Plan
    mesh: Mesh
    step_time_s: float
    memory_bytes: float
    candidates: list
    recompute: str = "none"
    estimate: Optional[Estimate] = None
    searched: int = 0
    pruned: int = 0
    elapsed_s: float = 0.0
    cluster: str = ""
    global_batch: int = 0
    notes: list = field(default_factory=list)

    def table(self, top: int = 10) -> str:
        head = (f"{'#':>2}  {'mesh':24s} {'plan':66s} {'recompute':9s} {'step ms':>10s} {'mem GiB':>8s}  why not")
        lines = [head, "-" * len(head)]
        for i, c in enumerate(self.candidates[:top]):
            lines.append(f"{i + 1:>2}  {c.mesh_text:24s} {_short(c.plan):66s} {c.recompute:9s} "
                         f"{c.step_time_s * 1e3:10.2f} {c.memory_bytes / 2**30:8.2f}  {c.reason}")
        return "\n".join(lines)

    def explain(self) -> str:
        lines = [f"autopar.plan: {self.plan} on Mesh({', '.join(f'{k}={v}' for k, v in self.mesh.axes.items())})"
                 f"{'' if self.recompute == 'none' else ', recompute=' + self.recompute}",
                 f"  cluster {self.cluster}, global batch {self.global_batch}: predicted step "
                 f"{self.step_time_s * 1e3:.2f} ms, {self.memory_bytes / 2**30:.2f} GiB per rank",
                 f"  searched {self.searched} candidates ({self.pruned} skipped by the bound) in {self.elapsed_s:.2f} s",
                 *[f"  note: {n}" for n in self.notes], "", self.table()]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()


def _short(p: Plan) -> str:
    return str(p).replace("Plan(", "").rstrip(")")


# ---- the layer chain --------------------------------------------------------------------------

class _Chain:
    """pre, one layer (each of the L), post; parameters per part (tied tables in both ends)."""

    def __init__(self, prof: Profile):
        layers = prof.layers
        self.L = len(layers)
        self.rows = prof.rows
        self.shapes = prof.shapes
        self.param_bytes = prof.param_bytes
        pre = next((g for g in prof.groups if g.name == "pre"), GroupCost("pre"))
        post = next((g for g in prof.groups if g.name == "post"), GroupCost("post"))
        self.pre_names = set(pre.params) | set(pre.reads)
        self.post_names = set(post.params) | set(post.reads)
        self.pre, self.post = pre, post
        self.tied = [x for x in prof.tied if x in self.pre_names and x in self.post_names]
        if not layers:
            self.layer, self.layer_names, self.layer_read = GroupCost("layer"), set(), set()
            return
        # repeated blocks: the first layer stands for each (the chain's layers share a signature);
        # different layers are averaged (the detailed estimate then uses each as it is)
        same = len(prof.signatures()) == 1
        self.layer = layers[0] if same else _average(layers)
        self.layer_names = set(layers[0].params)
        self.layer_read = set(layers[0].read_by_backward) & self.layer_names


def _average(layers: list) -> GroupCost:
    n = len(layers)
    g = GroupCost("layer")
    for f in ("flops", "bytes_moved", "saved", "saved_quadratic", "saved_after_core", "matmul_flops",
              "attention_flops", "out_bytes", "max_value", "final_bytes", "dense_flops", "pointwise_bytes", "attention_heads"):
        setattr(g, f, sum(getattr(x, f) for x in layers) / n)
    g.ops = round(sum(x.ops for x in layers) / n)
    g.op_names = {name: sum(x.op_names.get(name, 0) for x in layers) / n
                  for name in dict.fromkeys(k for x in layers for k in x.op_names)}
    g.weight_matmuls = round(sum(x.weight_matmuls for x in layers) / n)
    g.matmul_dtype = layers[0].matmul_dtype
    g.tp_forward, g.tp_backward = list(layers[0].tp_forward), list(layers[0].tp_backward)
    g.params, g.read_by_backward = dict(layers[0].params), set(layers[0].read_by_backward)
    return g


# ---- the closed-form score ------------------------------------------------------------------------

def even_buckets(nbytes: float, bucket_bytes: int) -> tuple:
    """(first bucket's bytes, each other's, how many others) of ``nbytes`` of gradients cut as
    the reducer cuts its buckets, ignoring where the parameters end: the first at min(1 MiB,
    ``bucket_bytes``), the rest in as few equal buckets of at most ``bucket_bytes`` (a closed
    form: a candidate of a trillion parameters has thousands of buckets)."""
    first = min(FIRST_BUCKET_BYTES, bucket_bytes)
    if nbytes <= first:
        return nbytes, 0.0, 0
    k = math.ceil((nbytes - first) / bucket_bytes)
    return first, (nbytes - first) / k, k


def _score(ch: _Chain, axes: dict, plan: Plan, recompute: str, c, gb: int) -> tuple[float, float]:
    """(step time, peak memory per rank) of one candidate by the closed forms."""
    p, n, t = axes.get("pp", 1), axes.get("dp", 1), axes.get("tp", 1)
    m, v = (plan.microbatches, plan.virtual_stages) if plan.pp_schedule else (1, 1)
    k = gb / (n * m) / ch.rows
    pr = precision(plan, plan.dp, ch.param_bytes)     # gathers in the compute dtype, sums in the reduce dtype
    pb, gbytes = pr.compute, pr.reduce
    slow = oversubscription(c, axes)
    ltp, ldp, lpp = (c.link_for(axes, axis) for axis in ("tp", "dp", "pp"))
    pre, layer, post = (g.scaled(k) for g in (ch.pre, ch.layer, ch.post))
    Fp, Bp, Wp = group_passes(pre, c, t, ltp, recompute, slow)[:3]
    Fl, Bl, Wl = group_passes(layer, c, t, ltp, recompute, slow)[:3]
    Fo, Bo, Wo = group_passes(post, c, t, ltp, recompute, slow)[:3]
    S = p * v
    mid = v * chunk(ch.L, S)         # layers on the busiest rank
    # parameters of the busiest rank (the first or the last: they add pre / post)
    shapes = ch.shapes

    def psi_of(names):
        return sum(math.prod(shapes[x]) for x in names)

    def pad_of(names):
        return padded_sum({x: shapes[x] for x in names}, n)

    lay_psi, lay_pad = psi_of(ch.layer_names), pad_of(ch.layer_names)
    pre_psi, pre_pad = psi_of(ch.pre_names), pad_of(ch.pre_names)
    post_psi, post_pad = psi_of(ch.post_names), pad_of(ch.post_names)
    if p == 1:
        ends = [(pre_psi + post_psi - psi_of(ch.pre_names & ch.post_names),
                 pre_pad + post_pad - pad_of(ch.pre_names & ch.post_names))]
        nl = ch.L
    else:
        ends = [(pre_psi, pre_pad), (post_psi, post_pad)]
        nl = mid
    psi = max(nl * lay_psi + e[0] for e in ends)
    pad = max(nl * lay_pad + e[1] for e in ends)
    mode = plan.dp
    # ---- time
    unit_g = collective_time("all_gather", lay_pad * pb, n, ldp)
    unit_gb = collective_time("all_gather", pad_of(ch.layer_read) * pb, n, ldp)
    red_kind = "all_reduce" if mode == "ddp" else "reduce_scatter"
    n_tensors = len(ch.layer_names) * nl + max(len(ch.pre_names), len(ch.post_names))
    states = state_bytes(mode, psi, n, pr.states, padded_psi=pad)
    opt = (optimizer_time(states, n_tensors, c) + sync_time(mode, n_tensors, c)) * slow
    tail = 0.0
    if mode in ("zero1", "zero2") and n > 1:     # the first bucket's gather, then k of the others' size
        first, rest, k = even_buckets(pad * pb, plan.bucket_bytes)
        parts = replica_gathers([first, rest] if k else [first], n, ldp, c, opt / slow, slow)
        tail = parts[0] + k * (parts[1] if k else 0.0)
    if S == 1:
        if mode == "zero3":    # the root unit (embeddings, final norm, head; a tied table once) is
            #                    gathered before the embedding and again before the head's backward
            root_g = collective_time("all_gather", ends[0][1] * pb, n, ldp)
            fwd = root_g + Fp + Fo + ch.L * max(Fl, unit_g)
            red_l = collective_time("reduce_scatter", lay_pad * gbytes, n, ldp)   # shares the stream
            bwd = root_g + Bp + Bo + ch.L * max(Bl, unit_gb + red_l)
        else:
            fwd, bwd = Fp + ch.L * Fl + Fo, Bp + ch.L * Bl + Bo
        if mode == "zero1":
            red = collective_time("reduce_scatter", pad * gbytes, n, ldp)
        else:   # the last bucket (the embeddings; ZeRO-3: the root unit) is reduced after backward
            last = ends[0][1] if mode == "zero3" else pre_pad if mode != "ddp" else pre_psi
            red = collective_time(red_kind, last * gbytes, n, ldp)
        step = fwd + bwd + red + opt + tail + c.device.pass_overhead * slow
    else:
        hop = pipeline_hop_time(layer.out_bytes, lpp, schedule=plan.pp_schedule) + \
            (getattr(lpp, "wake", 0.0) if slow > 1 else 0.0)
        fb = [mid * (Fl + Bl) + Fp + Bp] + [mid * (Fl + Bl)] * (p - 2) + [mid * (Fl + Bl) + Fo + Bo]
        # each stage pass's own cost, and its receive and send forward and backward
        fb = [x + v * (c.device.pass_overhead + 4 * c.device.message_overhead) * slow for x in fb]
        ws = [0.0] * p
        if plan.pp_schedule == "zero_bubble":
            ws = [min(mid * Wl + Wp, (mid * Bl + Bp) / 2)] + [min(mid * Wl, mid * Bl / 2)] * (p - 2) + \
                [min(mid * Wl + Wo, (mid * Bl + Bo) / 2)]
        if mode == "zero3":
            fb = [max(x, mid * (unit_g + unit_gb)) for x in fb]
        pipe = closed_form_pipeline(plan.pp_schedule, m, v, fb, ws)
        pipe += 2 * (p - 1) * hop
        red = collective_time(red_kind, (pad if mode != "ddp" else psi) * gbytes, n, ldp)
        tied = sum(math.prod(shapes[x]) for x in ch.tied) * pr.landed
        step = pipe + red + opt + tail + tied_exchange_time(tied, lpp) + loss_broadcast_time(p, lpp) + \
            schedule_tail_time(lpp, mid * Bl + Bp + hop)   # the first stage's last backward after the last's
    # ---- memory (the busiest rank)
    flight = inflight_microbatches(plan.pp_schedule, p, m, v, 0)

    act_layers = nl * saved_bytes(layer, recompute)
    ends_act = max(saved_bytes(pre, recompute), saved_bytes(post, recompute) + 2 * post.final_bytes) if p > 1 else \
        saved_bytes(pre, recompute) + saved_bytes(post, recompute) + 2 * post.final_bytes
    act = (act_layers + ends_act) * flight
    if recompute == "full":
        act += layer.saved
    work = 2 * max(layer.max_value, post.max_value, pre.max_value)
    base = persistent_bytes(mode, psi, n, pr.states, pad)
    extra = 0.0
    if mode == "zero3":
        extra += (2 + 1 / n) * lay_pad * pb + (pre_pad + post_pad) * pb   # in use, the next in flight
    if p > 1:
        extra += gbytes * psi            # micro-batch gradients accumulated until the flush
    peak = base + act + work + extra
    # a bucket completing: its gradients and their flat copy; ZeRO-2/3 free each flat buffer as it
    # is reduced (in place, no staging copy): the shards reduced so far, the bucket and its shard
    last = min(gbytes * pad, float(plan.bucket_bytes))
    if mode in ("ddp", "zero1"):
        peak = max(peak, base + 2 * last + (gbytes * psi - last if mode == "ddp" else 0.0))
    else:
        peak = max(peak, base + gbytes * pad / n + last * (2 + 1 / n))
    return step, peak


# ---- the search space ------------------------------------------------------------------------------

def _factorisations(world: int) -> list[tuple[int, int, int]]:
    out = []
    for pp in range(1, world + 1):
        if world % pp:
            continue
        for tp in range(1, world // pp + 1):
            if (world // pp) % tp == 0:
                out.append((pp, world // pp // tp, tp))
    return out


def _divisors(x: int) -> list[int]:
    return [d for d in range(1, x + 1) if x % d == 0]


def candidates(world: int, gb: int, *, heads: int = 0, layers: int = 0,
               mesh_axes: Optional[dict] = None, recompute=RECOMPUTE, max_microbatches: int = 512,
               base: Optional[Plan] = None):
    """Yield (axes, plan, recompute) of the search space (see the module docstring); each plan
    is ``base`` (default ``Plan()``) with the searched fields set."""
    for axes in _meshes(world, mesh_axes):
        if _ruled_out(axes, gb, heads, layers) is None:
            yield from _plans_for(axes, gb, layers, recompute, max_microbatches, base or Plan())


def _meshes(world: int, mesh_axes: Optional[dict]):
    """The factorisations ``{"pp", "dp", "tp"}`` of ``world`` that ``mesh_axes`` (if given) allows."""
    for pp, dp, tp in _factorisations(world):
        axes = {"pp": pp, "dp": dp, "tp": tp}
        if mesh_axes is None or (all(axes.get(a, 1) == s for a, s in mesh_axes.items())
                                 and all(axes[a] == 1 or a in mesh_axes for a in axes)):
            yield axes


def _ruled_out(axes: dict, gb: int, heads: int, layers: int) -> Optional[str]:
    """Why no plan of the mesh ``axes`` can run the model on ``gb`` rows (None: some can)."""
    pp, dp, tp = axes["pp"], axes["dp"], axes["tp"]
    if heads and heads % tp:
        return f"{heads} attention heads do not divide by tp={tp}"
    if pp > max(layers, 1):
        return f"pp={pp} stages exceed the model's {layers} layers"
    if gb % dp:
        return batch_split_error(gb, dp)
    if pp > 1 and gb // dp < pp:    # _plans_for keeps at least pp micro-batches
        return (f"pp={pp} needs at least {pp} micro-batches, and {gb // dp} rows per dp rank make at most "
                f"{gb // dp}; use a global batch of at least {pp * dp} rows")
    return None


def _plans_for(axes, gb, layers, recompute, max_microbatches, base: Plan):
    pp, dp, tp = axes["pp"], axes["dp"], axes["tp"]
    rows = gb // dp

    def plan(**fields):     # base's other fields kept; a combination base's fields refuse is no candidate
        try:
            return replace(base, **fields)
        except ValueError:
            return None

    for mode in DP_MODES:
        if dp == 1 and mode != "ddp":
            continue
        for sp in ((False, True) if tp > 1 else (False,)):
            for rc in recompute:
                # the plan carries its recomputation
                fields = dict(dp=mode, tp=tp > 1, sp=sp, recompute=rc, pp_schedule=None, microbatches=1,
                              virtual_stages=1)
                if pp == 1:
                    one = plan(**fields)
                    if one is not None:
                        yield axes, one, rc
                    continue
                for m in _divisors(rows):
                    if m > max_microbatches or m < pp:
                        continue
                    # zero-bubble defers weight gradients out of backward: not with recomputation
                    for sched in ("gpipe", "1f1b") + (("zero_bubble",) if rc == "none" else ()):
                        one = plan(**{**fields, "pp_schedule": sched, "microbatches": m})
                        if one is not None:
                            yield axes, one, rc
                    for v in (2, 4):
                        if m % pp == 0 and layers and layers % (pp * v) == 0:
                            one = plan(**{**fields, "pp_schedule": "interleaved", "microbatches": m,
                                          "virtual_stages": v})
                            if one is not None:
                                yield axes, one, rc


def _clean_axes(axes: dict) -> dict:
    out = {k: v for k, v in axes.items() if v > 1}
    return out or {"dp": 1}


# ---- the public function ---------------------------------------------------------------------------

def find_plan(model, world_size: int, *, example_inputs, example_kwargs=None, cluster="local",
         global_batch: Optional[int] = None, top: int = 10, exhaustive: bool = False,
         mesh_axes: Optional[dict] = None, recompute=RECOMPUTE, flash_attention: bool = True,
         profiles: Optional[Profiles] = None, detail: bool = True, base: Optional[Plan] = None) -> PlanReport:
    """Find the fastest plan for ``model`` on ``world_size`` devices of ``cluster`` (a preset
    name or a Cluster) that fits in device memory; ``example_inputs`` are one batch (meta
    tensors are fine), ``global_batch`` the rows per step (default: the example's).
    ``mesh_axes`` restricts the search to one mesh shape; ``recompute`` to some modes.
    ``base``: the plan whose fields the search does not choose every candidate keeps (its
    precision: ``Plan(param_dtype=torch.bfloat16)`` plans a mixed-precision run; default ``Plan()``).
    Raises InfeasiblePlan (with the smallest memory any plan needs) when nothing fits."""
    t0 = time.perf_counter()
    c = get_cluster(cluster)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: expected a positive integer")
    profiles = profiles or Profiles(model, example_inputs, example_kwargs, flash=flash_attention, cluster=c)
    first = profiles.base
    gb = global_batch or first.rows
    heads, layers = first.heads, len(first.layers)
    base = base or Plan()
    chains: dict = {}
    limit = float(c.device.memory_bytes)
    keep = max(top, 1)
    best_times: list = []          # the `keep` best feasible times so far (the bound prunes against the last)
    best_t, scored, pruned = math.inf, [], 0
    smallest = math.inf
    bound_cache: dict = {}
    refused: list = []
    for axes, pl, rc in candidates(world_size, gb, heads=heads, layers=layers, mesh_axes=mesh_axes,
                                   recompute=recompute, base=base):
        key = (axes["tp"], pl.sp)
        if key not in chains:
            try:
                chains[key] = _Chain(profiles.get(*key, dtype=base.param_dtype))
            except ValueError as exc:       # the tp pass refuses this size (heads, fused parts)
                chains[key] = None
                refused.append(f"tp={key[0]}{' with sp' if key[1] else ''}: {exc}")
        ch = chains[key]
        if ch is None:
            continue
        ax = _clean_axes(axes)
        if not exhaustive:
            bkey = (tuple(axes.values()), pl.sp, rc)
            if bkey not in bound_cache:
                bound_cache[bkey] = _bound(ch, axes, rc, c, gb)
            if bound_cache[bkey] > best_t:
                pruned += 1
                continue
        try:
            st, mem = _score(ch, ax, pl, rc, c, gb)
        except ValueError:
            continue
        fits = mem <= limit
        smallest = min(smallest, mem)
        scored.append(Candidate(pl, ax, rc, st, mem, fits))
        if fits:
            best_times.append(st)
            best_times.sort()
            del best_times[keep:]
            if len(best_times) == keep:
                best_t = best_times[-1]
    if not scored:     # not one candidate to score: say what ruled out each mesh, not "nothing fits"
        why = [f"Mesh({', '.join(f'{k}={v}' for k, v in _clean_axes(axes).items())}): "
               f"{_ruled_out(axes, gb, heads, layers) or 'the cost model refused every candidate'}"
               for axes in _meshes(world_size, mesh_axes)]
        rows = f"{gb} row" + ("s" if gb != 1 else "")
        raise InfeasiblePlan(f"no plan for world size {world_size} can run this model on a global batch of {rows}:\n  "
                             + "\n  ".join(why + refused or ["no mesh shape matches mesh_axes"]))
    feasible = sorted((x for x in scored if x.fits), key=lambda x: (x.step_time_s, x.memory_bytes))
    if not feasible:
        raise InfeasiblePlan(
            f"no plan for world size {world_size} fits in {limit / 2**30:.1f} GiB per device of {c.name}: the "
            f"smallest memory any candidate needs is {smallest / 2**30:.2f} GiB per rank "
            f"({len(scored)} candidates). Use more devices, a smaller global batch, or devices with more memory.")
    note = ""
    if detail:     # the best candidates again by the detailed estimate (event-time replay): it decides and
        shown = []  # reports; one the closed form thought fits but the walk over the step does not is dropped
        for x in feasible[:5 * top]:
            try:
                x.estimate = evaluate_plan(profiles, x.axes, x.plan, c, gb, recompute=x.recompute)
            except Exception as exc:   # the closed form stands for it
                note = f"detailed estimate of {x.plan} failed: {exc}"
            else:
                x.step_time_s, x.memory_bytes = x.estimate.step_time_s, x.estimate.memory_bytes
                x.fits = x.memory_bytes <= limit
            if x.fits:
                shown.append(x)
            if len(shown) == top:
                break
        if not shown:
            raise InfeasiblePlan(
                f"no plan for world size {world_size} fits in {limit / 2**30:.1f} GiB per device of {c.name} by "
                f"the detailed estimate; the closed form's best needed {feasible[0].memory_bytes / 2**30:.2f} GiB")
        shown.sort(key=lambda x: (x.step_time_s, x.memory_bytes))
    else:
        shown = feasible[:top]
    best = shown[0]
    shown = shown + sorted((x for x in scored if not x.fits and x not in shown), key=lambda x: x.memory_bytes)[:3]
    for x in shown[1:]:
        x.reason = _why(x, best, limit)
    shown[0].reason = "chosen"
    est = best.estimate
    report = PlanReport(plan=best.plan, mesh=Mesh(virtual=True, **best.axes),
                        step_time_s=est.step_time_s if est else best.step_time_s,
                        memory_bytes=est.memory_bytes if est else best.memory_bytes, candidates=shown,
                        recompute=best.recompute, estimate=est, searched=len(scored), pruned=pruned,
                        elapsed_s=time.perf_counter() - t0, cluster=c.name, global_batch=gb)
    if note:
        report.notes.append(note)
    report.notes += [f"not searched: {r.splitlines()[0]}" for r in refused]
    return report


def _why(x: Candidate, best: Candidate, limit: float) -> str:
    if not x.fits:
        return f"needs {x.memory_bytes / 2**30:.2f} GiB > {limit / 2**30:.2f} GiB"
    slower = x.step_time_s / best.step_time_s - 1
    diffs = []
    if x.axes != best.axes:
        diffs.append(x.mesh_text)
    if x.plan.dp != best.plan.dp:
        diffs.append(x.plan.dp)
    if x.plan.pp_schedule != best.plan.pp_schedule or x.plan.microbatches != best.plan.microbatches:
        diffs.append(f"{x.plan.pp_schedule or 'no pipeline'} m={x.plan.microbatches}")
    if x.plan.sp != best.plan.sp:
        diffs.append(f"sp={x.plan.sp}")
    if x.recompute != best.recompute:
        diffs.append(f"recompute={x.recompute}")
    return f"{slower:+.1%} slower ({', '.join(diffs) or 'same shape'})"


def _bound(ch: _Chain, axes: dict, rc: str, c, gb: int) -> float:
    """A lower bound on any candidate of this mesh / recompute: the busiest rank computes at
    least 1/pp of the model's forward and backward arithmetic (no overheads, no comm)."""
    p, n = axes["pp"], axes["dp"]
    k = gb / n / ch.rows
    slow = oversubscription(c, _clean_axes(axes))
    total = 0.0
    for g, mult, is_layer in ((ch.pre, 1, False), (ch.layer, ch.L, True), (ch.post, 1, False)):
        fc = (group_time(g, c, k) - dispatch_ops(g, c.device) * c.device.op_overhead) * slow
        total += mult * (3 * fc + (fc if is_layer and rc == "full" else 0.0))
    return total / p
