"""The pipeline schedule replayed in event time with the cost model's stage times.

``simulate_shared`` replays a schedule whose ranks share processors, as processes on one CPU
do (the local preset); ``pipeline_placement`` says how the ranks of a mesh share them;
``pipeline_time`` is the estimate's pipeline: the replay, or its closed form
(``closed_form_pipeline``) in the planner's inner loop and for very long schedules.
"""
from __future__ import annotations

import functools
import math

from autopar.schedule import (COMPUTE, SCHEDULES, ScheduleDeadlock, Schedule, Timeline, action_costs, build_schedule,
                              deadlock_message, execute, lower, matching_recv, matching_send)

__all__ = ["simulate_shared", "execute_shared", "pipeline_placement", "closed_form_pipeline", "pipeline_time",
           "lowered_schedule"]


def simulate_shared(schedule: Schedule, costs: dict | None = None, comm: float = 0.0, *, duration=None,
                    latency=None, cores: float | None = None, wake: float = 0.0, placement=None,
                    speed: float = 1.0, rendezvous: bool = False) -> Timeline:
    """``autopar.schedule.simulate`` for ranks that share ``cores`` processors (default: one
    each) or are laid out by ``placement``, each at ``speed``; a rank woken by its message while
    every processor is taken waits ``wake`` for one: see ``execute_shared``."""
    schedule.validate()
    return execute_shared(schedule, lower(schedule), cores if cores is not None else schedule.p, costs, comm,
                          duration=duration, latency=latency, wake=wake, placement=placement, speed=speed,
                          rendezvous=rendezvous)


def execute_shared(schedule: Schedule, programs, cores: float, costs: dict | None = None, comm: float = 0.0, *,
                   duration=None, latency=None, wake: float = 0.0, placement=None, speed: float = 1.0,
                   rendezvous: bool = False) -> Timeline:
    """Replay lowered ``programs`` whose ranks share ``cores`` processors, as processes on one
    CPU do: a compute action's duration is its work on a processor of its own, and while k
    ranks compute at once each advances at min(1, cores / k) (processor sharing, the
    scheduler's fair share); a rank waiting for a message takes no processor, and one woken by
    its message while every processor is taken waits ``wake`` more for one. With cores >= the
    ranks and no wake this is ``execute``.

    ``placement``, when given, is per rank (group, processors of the group, processes per
    rank) and replaces ``cores``: ranks of one group share that group's processors alone, each
    rank standing for that many processes computing in lockstep (its replicas along the other
    mesh axes), so a busy rank advances at min(1, processors / (processes x busy ranks of its
    group)). Every rate is multiplied by ``speed`` (a process on a processor of its own, against
    the durations given).

    ``rendezvous``: messages move as gloo moves them, a send only once its receive is posted,
    the receives posted one compute action ahead (those between a compute action and the next
    when that action starts; one before a rank's first compute action when the rank reaches
    it), as the runtime posted them before it posted transfers in batches. The runtime now
    posts each receive in the batch ``autopar.schedule.batch_transfers`` places it in (with the
    sends issued at the same point of the schedule); this replay does not model those batches
    yet, so where a batch posts a receive later or earlier than one action ahead it prices
    another order than the one that runs. A send whose receive was posted before it travels from the send;
    one sent first waits in the sender's process until the receiver's notice that its receive
    is posted arrives, and the sender's event-loop thread, not the thread that sent, then
    writes it (gloo's tcp transport: ``Pair::send`` of an unbound buffer, ``onNotifyRecvReady``
    on the event-loop thread), so it travels from the post only while some processor is free
    for that thread: while every processor computes, it stands still."""
    cost = action_costs(schedule, costs)
    took = duration or (lambda a: cost[a.kind])
    travel = latency or (lambda a: comm)
    if not cores > 0:
        raise ValueError(f"cores={cores!r}: expected a positive number of processors")
    n = len(programs)
    pc, events = [0] * n, [[] for _ in programs]
    arrival: dict = {}
    left: dict = {}              # rank -> (action, start, work left) while it computes
    blocked: set = set()         # ranks asleep on a message not yet arrived
    resume: dict = {}            # rank -> when it gets a processor after its message woke it
    posted: set = set()          # rendezvous: receives posted
    waiting: dict = {}           # rendezvous: receive not yet posted -> its send, sent
    flying: dict = {}            # rendezvous: send -> latency left, moving only while a processor is free
    processors = cores if placement is None else sum({g: c for g, c, _ in placement}.values())
    now, eps = 0.0, 1e-15

    def post(recv) -> None:
        if recv in posted:
            return
        posted.add(recv)
        send = waiting.pop(recv, None)
        if send is not None:     # sent before: the sender's event-loop thread writes it now
            flying[send] = travel(send)

    while True:
        moved = True
        while moved:     # until no rank moves: a message sent now may wake a rank the pass went by
            moved = False
            for r, prog in enumerate(programs):      # run each idle rank up to its next compute or blocked receive
                while r not in left and pc[r] < len(prog):
                    a = prog[pc[r]]
                    if a.kind in COMPUTE:
                        left[r] = (a, now, took(a))
                        moved = True
                        if rendezvous:    # the runtime posts the receives before the next compute action now
                            for b in prog[pc[r] + 1:]:
                                if b.kind in COMPUTE:
                                    break
                                # a gradient's buffer takes the shapes of the forward's outputs: not
                                # posted before that forward ran
                                if b.kind.startswith("RECV") and not (b.kind == "RECV_B" and a.kind == "F"
                                                                      and (a.stage, a.mb) == (b.stage, b.mb)):
                                    post(b)
                        break
                    if a.kind.startswith("SEND"):
                        recv = matching_recv(a)
                        if not rendezvous or recv in posted:
                            arrival[a] = now + travel(a)
                        else:
                            waiting[recv] = a
                    elif r in resume:
                        if resume[r] > now + eps:
                            break
                        del resume[r]
                    elif rendezvous and a not in posted:
                        post(a)
                        continue
                    elif arrival.get(matching_send(a), math.inf) > now + eps:
                        blocked.add(r)
                        break
                    elif r in blocked:
                        blocked.discard(r)
                        full = (len(left) >= cores if placement is None else
                                sum(placement[q][2] for q in left if placement[q][0] == placement[r][0])
                                >= placement[r][1])
                        if wake and full:
                            resume[r] = now + wake
                            break
                    pc[r] += 1
                    moved = True
        if not left:
            waits = [resume[r] if r in resume else arrival.get(matching_send(prog[pc[r]]), math.inf)
                     for r, prog in enumerate(programs) if pc[r] < len(prog)]
            if flying:       # every processor free: the messages in flight move
                step = min([min(flying.values())] + [t - now for t in waits if t < math.inf])
                now += step
                _land(flying, arrival, step, now, eps)
                continue
            if not waits:
                break
            if min(waits) == math.inf:
                stuck = [r for r, prog in enumerate(programs) if pc[r] < len(prog)]
                raise ScheduleDeadlock(deadlock_message(schedule, programs, pc, stuck,
                                                         {a: q for q, pr in enumerate(programs) for a in pr
                                                          if a.kind.startswith("SEND")}))
            now = min(waits)
            continue
        if placement is None:
            pace = speed(len(left)) if callable(speed) else speed
            rates = dict.fromkeys(left, min(1.0, cores / len(left)) * pace)
        else:
            busy: dict = {}
            for r in left:
                busy[placement[r][0]] = busy.get(placement[r][0], 0) + placement[r][2]
            pace = speed(sum(busy.values())) if callable(speed) else speed
            rates = {r: min(1.0, placement[r][1] / busy[placement[r][0]]) * pace for r in left}
        step = min(w / rates[r] for r, (_, _, w) in left.items())
        pending = [t for t in list(arrival.values()) + list(resume.values()) if t > now + eps]
        step = min([step] + [t - now for t in pending])
        free = (len(left) if placement is None else sum(busy.values())) < processors - eps
        if flying and free:
            step = min([step] + list(flying.values()))
        now += step
        if flying and free:
            _land(flying, arrival, step, now, eps)
        for r in list(left):
            a, start, w = left[r]
            w -= step * rates[r]
            if w <= eps * max(1.0, now):
                events[r].append((a, start, now))
                del left[r]
                pc[r] += 1
            else:
                left[r] = (a, start, w)
    return Timeline(schedule, events, now)


def _land(flying: dict, arrival: dict, step: float, now: float, eps: float) -> None:
    """Move the messages in flight by ``step`` seconds; those with no latency left arrive now."""
    for a in list(flying):
        flying[a] -= step
        if flying[a] <= eps * max(1.0, now):
            arrival[a] = now
            del flying[a]


def pipeline_placement(p: int, world: int, cores: int, slowdown) -> tuple:
    """Where a pipeline's p ranks compute when ``world`` ranks share ``cores`` cores: (speed of a
    busy process, as a function of the processes computing at that moment; per rank (group,
    cores of the group, processes it stands for)). A stage's replicas along the other axes
    (world / p of them) run in lockstep, and the cores are dealt out by stage: with p >= cores,
    consecutive stages share a core (a stage's bubble frees its core for its neighbours, not for
    the other stages); with fewer stages, each has cores / p of them (the placement that
    reproduces BENCHMARKS.md's measured pipeline steps on the local preset). A pipeline without
    replicas (world = p) is one group of all the cores: the kernel runs whichever of its ranks
    compute on whichever core is free, so a fill or drain with fewer ranks computing than cores
    runs each at full speed (zero-bubble on pp=4, 4 processes, 2 cores, the mean of its rows'
    pred/meas in hold-out runs 36-40 re-predicted: 1.21-1.31 with a core per pair of stages,
    1.10-1.19 as one group; BENCHMARKS.md). ``slowdown(k)`` is the measured slowdown of k
    processes computing at once (``Cluster.slowdown``: the shared caches and memory, and beyond
    the cores the time-sharing); the speed of a busy process is its part beyond the fair share,
    for the processes busy at that moment: a stage computing alone in another's bubble runs as
    fast as it would alone."""
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
    moves it, ``execute_shared``'s ``rendezvous``), the closed form slows every stage by ``slow``."""
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
    tl = execute_shared(schedule, programs, schedule.p, duration=duration, latency=latency, wake=wake,
                        placement=placement, speed=speed, rendezvous=True) if placement is not None else \
        execute(schedule, programs, duration=duration, latency=latency)
    for r, evs in enumerate(tl.events):
        for a, s0, e in evs:
            timeline.append((r, "compute", str(a), s0, e))
    busy = max(sum(e - s0 for _, s0, e in evs) for evs in tl.events)
    return tl.makespan, tl.bubble_fraction(), busy
