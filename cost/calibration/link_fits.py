"""The calibration's fits of the links: pure functions of the probes' results (``comm_probes``,
``runtime_probes``), no process started. Each collective kind's alpha-beta line and its latency
among computing ranks (``kind_fits``, ``gloo_link``), the fraction of communication overlap
does not hide (``overlap_loss``), the level of the skew table on the runtime's own tp steps
(``skew_scale``), and what a pipeline's message costs its schedule: the latency, wake-up wait
and end-of-schedule exchanges at which the cost model's replay of the measured pipelines
lasts their measured schedules (``fit_hop``, ``fit_runtime_hop``, ``fit_runtime_wake``,
``fit_tail``)."""
from __future__ import annotations

import functools
import logging
import statistics

from autopar.schedule import build_schedule, simulate

from ..cluster import Link, slowdown
from ..comm import bytes_per_rank, collective_time
from ..pipeline import loss_broadcast_time, pipeline_placement, tied_exchange_time
from .comm_probes import GLOO_SIZES, GLOO_WORLD, PIPE_B, PIPE_F, PIPE_M
from .runtime_probes import HOP_PIPELINES, PROBE_VOCAB, TAIL_PIPELINES

log = logging.getLogger("autopar")

__all__ = ["fit_alpha_beta", "kind_fits", "gloo_link", "overlap_loss", "skew_scale", "pipeline_replay", "fit_hop",
           "bisect_latency", "replays", "fit_runtime_hop", "fit_runtime_wake", "tails", "fit_tail", "fit_line"]


def fit_alpha_beta(moved: list[float], seconds: list[float]) -> tuple[float, float]:
    """Least-squares fit of seconds = alpha + beta * moved, weighted by 1/seconds so that each
    point counts by its relative error (plain residuals would let the large messages decide
    alpha too, and the small messages are the ones that measure it). The 2x2 normal equations
    of the weighted problem, solved in closed form."""
    w = [1.0 / t**2 for t in seconds]            # squared weights of the residuals (t - a - b x) / t
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, moved))
    sy = sum(wi * t for wi, t in zip(w, seconds))
    sxx = sum(wi * x * x for wi, x in zip(w, moved))
    sxy = sum(wi * x * t for wi, x, t in zip(w, moved, seconds))
    det = sw * sxx - sx * sx
    if det == 0:
        return seconds[0], 0.0
    beta = (sw * sxy - sx * sy) / det
    return (sy - beta * sx) / sw, beta


def kind_fits(per_rank: list, world: int) -> tuple:
    """From ``probe_all``'s results on ``world`` processes (one dict per rank): whole-collective
    alpha-beta fits of each kind, what a Link's ``fits`` holds (p2p is a round trip of two
    messages: its fit is halved); the latency table of ``skew`` (the latency among computing
    ranks; the slowest rank's); the all-reduce's per-size times; the synthetic pipeline's step
    on ``GLOO_WORLD`` processes (``pipeline_probe``, slowest rank; None on others); and the
    overlap loss (``overlap_probe``)."""
    out = []
    skew = tuple((key[1], key[2], key[3], max(r[key] for r in per_rank)) for key in per_rank[0] if key[0] == "skew")
    pipeline = max(r[("pipeline",)] for r in per_rank) if ("pipeline",) in per_rank[0] else None
    overlap = overlap_loss([r[("overlap",)] for r in per_rank])
    for key in per_rank[0]:
        if key[0] in ("skew", "pipeline", "overlap"):
            continue
        kind, g = key
        seconds = [max(ts) for ts in zip(*(r[(kind, g)] for r in per_rank if r[(kind, g)]))]   # the slowest rank
        # a p2p probe is a round trip: two messages of the size
        moved = [bytes_per_rank(kind, s, g) * (2 if kind == "p2p" else 1) for s in GLOO_SIZES]
        alpha, beta = fit_alpha_beta(moved, seconds)
        if not beta > 0:   # nonsense fit (very noisy machine): the largest message's rate
            beta = seconds[-1] / moved[-1]
        if not alpha > 0:  # a noisy large message tilted the line below the origin: the small
            # messages, which are nearly all latency, say what a call costs (their median excess)
            alpha = statistics.median(t - beta * x for x, t in zip(moved[:3], seconds[:3]))
        out.append((kind, g, max(alpha, 1e-6) / (2 if kind == "p2p" else 1), beta / (2 if kind == "p2p" else 1)))
        if kind == "all_reduce" and g == world:
            times = seconds
    return tuple(out), skew, times, pipeline, overlap


def gloo_link(per_rank: list, world: int = GLOO_WORLD) -> tuple:
    """(link, the all-reduce's per-size times, the synthetic pipeline's step or None): the gloo
    link between ``world`` local processes from ``probe_all``'s results on them: per-kind fits
    (``kind_fits``), and latency / bandwidth per message from the all-reduce's (a ring
    all-reduce sends 2(N-1) messages in turn)."""
    fits, skew, seconds, pipeline, overlap = kind_fits(per_rank, world)
    _, _, alpha, beta = next(f for f in fits if f[0] == "all_reduce" and f[1] == world)
    return Link("gloo-tcp", 1.0 / beta, max(alpha / (2 * (world - 1)), 1e-6), fits=fits, skew=skew,
                overlap_loss=overlap), seconds, pipeline


def overlap_loss(per_rank: list) -> float:
    """The fraction of the shorter of compute and collective that overlapping them did not hide,
    from each rank's ``overlap_probe``: per round, with the slowest rank's time of each, 0 when
    the two took the longer one's time, 1 when they took the sum; the median over the rounds
    (a round's collective alone varies 1.2-2.7 ms here, so one median of each varied 0.3-1.0).

    Measured on every world, the one whose ranks outnumber the cores too: gloo's collectives
    are host work (on the machine of BENCHMARKS.md, 300 all-reduces of 4 KiB on 4 processes kept
    rank 0's gloo event-loop thread busy 380 ms, 1.3 ms each, in 1.5 s), and cores the ranks' compute
    already fills cannot take it beside that compute. There the probe reads 1.0 with all-reduces
    of 4 KiB, 1 MiB and 4 MiB alike. The estimate charges it against the time some
    communication lane was busy, not each collective in turn: ZeRO-3's gathers and reductions
    run on process groups of their own, side by side. (Charged each in turn, ZeRO-3's hold-out
    steps on 4 processes come out at 1.39x their measured time: benchmarks/bench_holdout.py;
    BENCHMARKS.md, bench_holdout.py.)"""
    rounds = [[max(r[i][k] for r in per_rank) for i in range(3)] for k in range(len(per_rank[0][0]))]
    return statistics.median(min(1.0, max(0.0, (both - max(c, m)) / min(c, m))) for c, m, both in rounds)


def skew_scale(link: Link, blocked: float, between: float, kinds: list) -> tuple:
    """(``Link.skew_scale``, the table's latency it is taken against): ``blocked``, the seconds
    a collective of autopar's own tp steps blocks its rank (``fit_sync_overhead``), over
    the mean of the skew table's latency of its ``kinds`` on 2-rank groups after ``between``
    seconds of CPU work (on a link with ``skew_pooled``, as the calibration's 2-process link
    is, every kind's is the kinds' pooled table); 1 where either is not measured (no
    blocking, or no table for those kinds)."""
    kinds = [kind for kind in kinds if any(k == kind and g == GLOO_WORLD for k, g, _, _ in link.skew)]
    table = [collective_time(kind, 4, GLOO_WORLD, link, after=between) for kind in kinds]
    table = statistics.mean(table) if table else 0.0
    if not (blocked > 0 and table > 0):
        return 1.0, table
    return blocked / table, table


def pipeline_replay(world: int, cores: int, contention: tuple, hop: float, wake: float = 0.0,
                     place=pipeline_placement) -> float:
    """The cost model's replay of the synthetic pipeline (``pipeline_probe``) on ``world``
    processes sharing ``cores`` cores, its compute slowed by the ``contention`` of the ranks
    computing at each moment, the ranks laid out by ``place`` (``pipeline_placement``)."""
    s = build_schedule("1f1b", 2, PIPE_M)
    crowd = functools.partial(slowdown, contention, cores)
    speed, placement = place(2, world, cores, crowd) if crowd(world) > 1 else (1.0, None)
    return simulate(s, duration=lambda a: PIPE_F if a.kind == "F" else PIPE_B, latency=lambda a: hop,
                           speed=speed, wake=wake, placement=placement).makespan


def fit_hop(measured: float, world: int, cores: int, contention: tuple, hop: float | None = None,
             place=pipeline_placement) -> float:
    """The message latency (or, given ``hop``, the wake-up wait) at which ``pipeline_replay``
    lasts ``measured`` seconds (bisection; 0 if even none replays slower, or if not even 50 ms
    does: the probe was disturbed)."""

    def replay(x):
        return pipeline_replay(world, cores, contention, x if hop is None else hop, 0.0 if hop is None else x, place)

    fit = bisect_latency(replay, measured, "the synthetic pipeline", "hop" if hop is None else "wake")
    return 0.0 if fit is None else fit


def bisect_latency(replay, measured: float, what: str, kind: str) -> float | None:
    """The ``x`` in [0, 50 ms] at which ``replay(x)`` (growing with ``x``) lasts ``measured``
    seconds, by bisection; 0 when even ``replay(0)`` does not last less. None when not even
    50 ms replays that slowly: the probe was disturbed (another process took a core), not a
    property of the machine, and a warning says so."""
    lo, hi = 0.0, 0.05
    if replay(lo) >= measured:
        return 0.0
    if replay(hi) < measured:
        log.warning("autopar calibration: %s took %.1f ms, more than any %s up to 50 ms explains; no %s "
                    "fitted from it", what, measured * 1e3, kind, kind)
        return None
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if replay(mid) < measured else (lo, mid)
    return (lo + hi) / 2


def replays(pipelines: tuple, per_rank: list) -> list:
    """What ``fit_runtime_hop`` replays of ``op_overhead_probe``'s results (a list per rank)
    for the ``HOP_PIPELINES`` among ``pipelines``: (schedule, per stage {kind: action CPU
    seconds}, per stage a message's CPU seconds; the slowest rank's schedule). An interleaved
    pipeline's 4 stages take their rank's times (stage s runs on rank s % 2)."""
    out = []
    for k, pipeline in enumerate(pipelines):
        if pipeline not in HOP_PIPELINES:
            continue
        schedule = pipeline[1]
        rows = [per_rank[r][k] for r in range(len(per_rank))]
        ranks = [[row for row in rows if row[5] == r] for r in (0, 1)]
        stages = [ranks[s % 2] for s in range(4 if schedule == "interleaved" else 2)]
        out.append((schedule, [{kind: statistics.mean(row[3][kind] for row in st) for kind in ("F", "B", "W")}
                               for st in stages],
                    [statistics.mean(row[2] for row in st) for st in stages], max(row[4] for row in rows)))
    return out


def fit_runtime_hop(replays: list, cores: int, contention: tuple, schedules: tuple | None = None) -> float:
    """The message latency at which the cost model's replay of autopar's own pipelines lasts
    their measured schedules: the op-overhead probe's 1F1B pipelines of GPTs of h = 16
    (``HOP_PIPELINES``; ``fit_op_overhead``'s ``replays``: per pipeline its schedule, each
    stage's median F and B action CPU times with a message's CPU time added as the estimate adds
    it, and the schedule the slowest rank timed), replayed as the estimate replays 2 ranks on
    ``cores`` cores (placed by ``pipeline_placement``, slowed by the measured ``contention``),
    each send moving once its receive is posted, as the estimate replays them (``autopar.schedule.execute``'s
    ``rendezvous``). The median of the pipelines' fits (bisection; 0 where even none replays slower).

    This is what a message costs the runtime's pipelines beyond the CPU time of posting it, as
    a latency on the schedule's critical path. Measured, not explained (the machine of
    BENCHMARKS.md, per-action timelines of 1F1B on 2 processes: benchmarks/pp_timelines.py and
    pp_actions.py): a message reaches a rank waiting on it within 0.03 ms (median), but one or
    two posts (``dist.isend``/``irecv``) a step hold the thread 1-2 ms without using its CPU, and
    time passes between actions (7-25% of posts take over 1 ms, up to 5 ms, with both ranks of
    a pair waiting at once; gloo moves an unbound buffer only once the receiver's notice that
    its receive is posted reached the sender, so a message can wait on the sender's event-loop
    thread, which shares a core with its compute; posting every receive as early as its shapes
    allow measures within the noise, 0.88-1.09x, in round-robin A/B comparisons). Replayed from
    each action's measured time, GPTs of h = 8 lose 0.7-1.2 ms a message, h = 12 to 64 lose 1.3-1.8
    ms, and a synthetic pipeline of bare matmuls (``pipeline_probe``) 0-0.8 ms. So the probe's
    pipelines are of h = 16: outside the h = 8 case, and none of the hold-out grid's widths
    (32, 64, 96). The zero-bubble schedule is left out: its replay of its own measured actions
    can be longer than its measured schedule with no latency at all, so it cannot say what a
    message costs. ``schedules``: the replays of those schedules only (None: all).

    The interleaved schedule's messages cost more (replays of measured actions on 2 processes:
    GPTs of h = 16 and 64 with 4 layers lose 1.05-1.41 ms a message interleaved,
    0.45-1.03 ms under 1F1B), so its pipelines are fitted apart (``Link.hop_interleaved``)."""
    crowd = functools.partial(slowdown, contention, cores)
    speed, placement = pipeline_placement(2, 2, cores, crowd) if crowd(2) > 1 else (1.0, None)
    fits = []
    for schedule_name, per_stage, msg, measured in replays:
        if schedules is not None and schedule_name not in schedules:
            continue
        s = build_schedule(schedule_name, 2, 4, len(per_stage) // 2)

        def duration(a):
            t = per_stage[a.stage][a.kind]
            return t + msg[a.stage] if a.kind in ("F", "B") else t

        def replay(hop):
            return simulate(s, duration=duration, latency=lambda a: hop, speed=speed,
                                   placement=placement, rendezvous=True).makespan

        fit = bisect_latency(replay, measured, f"a {schedule_name} pipeline's schedule", "hop")
        if fit is not None:
            fits.append(fit)
    return statistics.median(fits) if fits else 0.0


def fit_runtime_wake(per_rank: list, cores: int, contention: tuple, hop: float) -> float:
    """``Link.wake`` of ranks sharing cores: the wait for a core, when every one is taken, of a
    rank its message woke, at which the cost model's replay of autopar's own pipelines on as many
    processes as stages lasts their measured schedules. ``per_rank``: ``op_overhead_probe``'s
    results on 2 x cores processes for the ``WAKE_PIPELINES`` (1F1B, one stage a process, so
    that the estimate's placement makes them one group of every core, where a woken rank can
    find them all taken: ``pipeline_placement``). Replayed as ``fit_runtime_hop`` replays the
    2-process pipelines: each stage's median F and B action CPU times, plus its messages' CPU
    times as the estimate adds them (a receive and a send per pass in the middle stages), the
    ``hop`` fitted on 2 processes, the measured ``contention``, sends moving once their receive
    is posted; the median of the pipelines' fits (bisection; 0 where even none replays slower).

    Why a pipeline of the runtime's and not ``pipeline_probe``'s bare matmuls: that probe runs
    2 stages of 2 replicas each on 4 processes, which the estimate places as a core per stage, so
    no wake ever meets a full group there and its fit could only read 0 (the synthetic fit reads
    0.00 ms in every calibration). On the machine of BENCHMARKS.md (4 processes on 2 cores), the
    hold-out grid's gpt h96 L4 s48 under zero-bubble replayed from its own measured actions at the
    fitted hop lasts 30.0 ms against a measured 32.6-35.5 ms schedule; a wake of 2 ms replays
    33.9 ms (its h32 L2 s16: 14.5 ms at none, 17.2 ms at 1 ms, measured 14.9-17.6)."""
    world = len(per_rank)
    crowd = functools.partial(slowdown, contention, cores)
    speed, placement = pipeline_placement(world, world, cores, crowd)
    msgs = [(s > 0) + (s < world - 1) for s in range(world)]
    schedule = build_schedule("1f1b", world, 4)
    fits = []
    for k in range(len(per_rank[0])):
        rows = sorted((r[k] for r in per_rank), key=lambda row: row[5])      # by pipeline stage

        def duration(a, rows=rows):
            return rows[a.stage][3][a.kind] + msgs[a.stage] * rows[a.stage][2]

        def replay(wake, duration=duration):
            return simulate(schedule, duration=duration, latency=lambda a: hop, speed=speed,
                                   placement=placement, wake=wake, rendezvous=True).makespan

        fit = bisect_latency(replay, max(row[4] for row in rows),
                              f"a 1f1b pipeline's schedule on {world} processes", "wake")
        if fit is not None:
            fits.append(fit)
    return statistics.median(fits) if fits else 0.0


def tails(pipelines: tuple, per_rank: list) -> list:
    """Per 1F1B pipeline among the ``HOP_PIPELINES`` and ``TAIL_PIPELINES`` of
    ``op_overhead_probe``'s results: (the pipeline, the mean over steps of how long the rank
    that ended its schedule first waited for the other, the mean of the last one's wall time from
    its schedule's end to ``train_step``'s return: the tied gradients' exchange and the loss
    broadcast as they ran)."""
    out = []
    for k, pipeline in enumerate(pipelines):
        if pipeline[1] != "1f1b" or pipeline not in HOP_PIPELINES + TAIL_PIPELINES:
            continue
        steps = zip(*(per_rank[r][k][6] for r in range(len(per_rank))))
        pairs = [(max(e for e, _ in ranks) - min(e for e, _ in ranks), max(ranks)[1]) for ranks in steps]
        out.append((pipeline, statistics.mean(w for w, _ in pairs), statistics.mean(t for _, t in pairs)))
    return out


def fit_tail(tails: list, link: Link) -> tuple:
    """``Link.tail``: (a, b) of the line a + b x wait through the probe pipelines' ``tails``,
    each one's time past its schedule less what the estimate already gives those exchanges there
    (``tied_exchange_time`` of its tied embedding, ``loss_broadcast_time`` over 2 ranks, on
    ``link``), against how long the other rank waited; a and b at least 0.

    Why (the machine of BENCHMARKS.md, 2 processes): the rank that ends a 1F1B schedule last (its
    final backward runs while the other waits) took 0.6-1.5 ms (median) and 1.4-2.5 ms (mean)
    from its schedule's end to the step's loss, against the estimate's 0.6 ms of p2p time, and
    the longer the other rank had waited, the longer: probe GPTs waited 0.6-3.3 ms; the
    hold-out grid's gpt h96 L4 s48 (not a probe) waited 2.5 ms and took 2.05 ms. Bare, the same
    exchange after a peer idle 0.2-8 ms took 0.13-0.19 ms (median): the cost is the pipeline's,
    not the link's, and is measured as such, not explained."""
    points = []
    for (_, _, dim, *rest), wait, past in tails:
        vocab = rest[1] if len(rest) > 1 else PROBE_VOCAB
        modeled = tied_exchange_time(4.0 * vocab * dim, link) + loss_broadcast_time(2, link)
        points.append((wait, past - modeled))
    if len(points) < 2:
        return ()
    slope, intercept = fit_line(points)
    if slope < 0:
        slope, intercept = 0.0, statistics.mean(y for _, y in points)
    if intercept < 0:       # through the origin instead
        slope, intercept = max(0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points)), 0.0
    return (intercept, slope)


def fit_line(points: list) -> tuple[float, float]:
    """Least-squares (slope, intercept) of y = intercept + slope x."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return slope, my - slope * mx
