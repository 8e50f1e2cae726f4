"""A pipeline's step for the cost model: the schedule replayed in event time with the stages'
times, and what runs around it.

``autopar.schedule.simulate`` replays a schedule, its ranks sharing processors as processes on
one CPU do (the local preset) where asked; ``pipeline_placement`` says how the ranks of a mesh
share them;
``pipeline_time`` is the estimate's pipeline: the replay, or its closed form
(``closed_form_pipeline``) in the planner's inner loop and for very long schedules. Around
it: the cut into stages (``partition``), a time-shared core's cache refill per action
(``refill_time``), and the exchanges after the schedule (``tied_exchange_time``,
``loss_broadcast_time``, ``schedule_wait``, ``schedule_tail_time``).
"""
from __future__ import annotations

import functools
import math

from autopar.schedule import SCHEDULES, Schedule, build_schedule, execute, lower

from .comm import collective_time
from .compute import compute_time
from .profile import is_layer

__all__ = ["pipeline_placement", "closed_form_pipeline", "pipeline_time",
           "lowered_schedule", "partition", "stage_caveats", "refill_time", "tied_exchange_time", "schedule_wait",
           "schedule_tail_time", "loss_broadcast_time"]


def pipeline_placement(p: int, world: int, cores: int, slowdown) -> tuple:
    """Where a pipeline's p ranks compute when ``world`` ranks share ``cores`` cores: (speed of a
    busy process, as a function of the processes computing at that moment; per rank (group,
    cores of the group, processes it stands for)). A stage's replicas along the other axes
    (world / p of them) run in lockstep, and the cores are dealt out by stage: with p >= cores,
    consecutive stages share a core (a stage's bubble frees its core for its neighbours, not for
    the other stages); with fewer stages, each has cores / p of them (the placement that
    reproduces the measured pipeline steps on the local preset: BENCHMARKS.md, bench_holdout.py).
    A pipeline without replicas (world = p) is one group of all the cores: the kernel runs
    whichever of its ranks compute on whichever core is free, so a fill or drain with fewer
    ranks computing than cores runs each at full speed (zero-bubble on pp=4, 4 processes, 2
    cores: the mean predicted / measured step of its rows is 1.10-1.19 as one group, 1.21-1.31
    with a core per pair of stages; BENCHMARKS.md, bench_holdout.py). ``slowdown(k)`` is the
    measured slowdown of k processes computing at once (``Cluster.slowdown``: the shared caches
    and memory, and beyond the cores the time-sharing); the speed of a busy process is its part
    beyond the fair share, for the processes busy at that moment: a stage computing alone in
    another's bubble runs as fast as it would alone."""
    replicas = world / p

    def speed(k: float) -> float:
        return max(1.0, k / cores) / slowdown(max(1, round(k)))
    if p >= cores and replicas == 1:
        return speed, [(0, float(cores), 1.0)] * p
    if p >= cores:
        return speed, [(r * cores // p, 1.0, replicas) for r in range(p)]
    return speed, [(r, cores / p, replicas) for r in range(p)]


def closed_form_pipeline(schedule: str, m: int, v: int, fb: list, w: list) -> float:
    """Makespan of a pipeline whose rank r takes ``fb[r]`` = F + B per micro-batch (``w[r]`` of
    B deferred as W by zero-bubble): the busiest rank's m micro-batches plus the fill and drain
    of the others, (m - 1)·max + Σ — for uniform ranks (m + p - 1)(F + B), the GPipe / 1F1B
    bubble (p - 1)/(m + p - 1); interleaving divides the fill and drain by v (Narayanan et al.,
    SC'21, section 2.2.2); zero-bubble fills them with W, (p - 1)(F + B - 2W) (Qi et al., "Zero
    Bubble Pipeline Parallelism", ICLR 2024, ZB-H1)."""
    top = max(range(len(fb)), key=lambda r: fb[r])
    rest = sum(fb) - fb[top]
    if schedule == "interleaved":
        return m * fb[top] + rest / v
    if schedule == "zero_bubble":
        return m * fb[top] + rest - 2 * (sum(w) - w[top])
    return m * fb[top] + rest


@functools.lru_cache(maxsize=64)
def lowered_schedule(name: str, p: int, m: int, v: int) -> tuple:
    """A schedule (one of SCHEDULES, or a parsed custom one) built, validated and lowered once:
    the planner's detailed estimates replay the same few schedules many times."""
    schedule = build_schedule(name, p, m, v) if name in SCHEDULES else Schedule.parse(name)
    schedule.validate()
    return schedule, lower(schedule)


def pipeline_time(plan, p, m, v, Fs, Bs, Ws, hop, timeline, simulate, shared=None, wake=0.0, slow=1.0):
    """(makespan of the schedule, bubble fraction, busiest rank's busy time). ``shared``: the
    ``pipeline_placement`` of ranks sharing cores (stage times are then each on a core of its
    own); the replay shares the cores as placed (a rank its message wakes while its cores are
    taken waiting ``wake`` for one; a message sent before its receive is posted moving as gloo
    moves it, ``autopar.schedule.execute``'s ``rendezvous``), the closed form slows every stage by ``slow``."""
    split = plan.split_backward
    if shared is not None and (not simulate or m * p * v > 20000):
        k = max(1.0, slow)
        Fs, Bs, Ws, shared = [f * k for f in Fs], [b * k for b in Bs], [w * k for w in Ws], None
        hop = [h + wake for h in hop]
    per_rank = [(sum(Fs[s] for s in range(len(Fs)) if s % p == r), sum(Bs[s] for s in range(len(Bs)) if s % p == r),
                 sum(Ws[s] for s in range(len(Ws)) if s % p == r)) for r in range(p)]
    if not simulate or m * p * v > 20000:
        fb = [f + b for f, b, _ in per_rank]
        ws = [min(w, b / 2) if split else 0.0 for _, b, w in per_rank]
        total = closed_form_pipeline(plan.pp_schedule, m, v, fb, ws) + (p - 1) * max(hop) * 2
        busy = m * max(fb)
        return total, 1 - m * sum(fb) / len(fb) / total if total else 0.0, busy
    schedule, programs = lowered_schedule(plan.pp_schedule, p, m, v)

    def duration(a):
        if a.kind == "F":
            return Fs[a.stage]
        if a.kind == "W":
            return min(Ws[a.stage], Bs[a.stage] / 2)
        if a.kind == "B" and split:
            return Bs[a.stage] - min(Ws[a.stage], Bs[a.stage] / 2)
        return Bs[a.stage]

    def latency(a):
        return hop[a.stage] if a.kind == "SEND_F" else hop[a.stage - 1]

    speed, placement = shared if shared is not None else (1.0, None)
    tl = execute(schedule, programs, duration=duration, latency=latency, wake=wake, placement=placement,
                 speed=speed, rendezvous=True) if placement is not None else \
        execute(schedule, programs, duration=duration, latency=latency)
    for r, evs in enumerate(tl.events):
        for a, s0, e in evs:
            timeline.append((r, "compute", str(a), s0, e))
    busy = max(sum(e - s0 for _, s0, e in evs) for evs in tl.events)
    return tl.makespan, tl.bubble_fraction(), busy


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

def stage_caveats(groups, S: int) -> list:
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
    cache) already holds. Measured on 1F1B at pp = 2 x dp = 2, 4 processes on 2 cores (thread
    CPU per action against the estimate's at the measured contention): gpt h96 L4 s16 0.22 ms
    more per F and 0.27 ms per B (this formula: 0.17), h96 L2 s48 0.16 and 0.14 (0.12), h32 L2
    s16 none to speak of (0.01); BENCHMARKS.md, bench_holdout.py."""
    return compute_time(0.0, 2 * (param_elements * pbytes + saved), c)


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


