"""The local preset: this machine measured for the cost model (about a minute), then cached.

``calibrate_local`` runs the probes below (some on several gloo processes, some compiling
small models with ``autopar.compile``), builds a Cluster named "local" whose ``source`` says
what was measured and how, and stores it in the cache (``autopar.cost.cache``) that
``get_cluster("local")`` reads. This is the only part of the cost model that runs processes.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
import datetime
import logging
import os
import platform
import socket
import statistics
import time
import warnings

import torch
import torch.distributed as dist

from autopar.api import compile as autopar_compile
from autopar.mesh import Mesh
from autopar.models import GPTConfig, TinyGPT, gpt_batch
from autopar.planspec import Plan
from autopar.schedule import build_schedule, lower
from autopar.testing import RankPool

from .. import cache
from ..cluster import Cluster, Device, Link, cached_local, slowdown
from ..comm import bytes_per_rank, collective_time
from ..compute import weighed_ops
from ..drift import fingerprint
from ..estimate import Profiles, evaluate_plan, loss_broadcast_time, partition, tied_exchange_time
from ..replay import pipeline_placement, simulate_shared
from .op_weights import SAMPLES, SHAPE as _OP_WEIGHT_SHAPE, measure_op_weights

log = logging.getLogger("autopar")

__all__ = ["calibrate_local"]


class _Ranks:
    """The probes' processes: ``ranks(fn, world, *args)`` runs ``fn`` on a pool of ``world``
    local gloo processes kept between probes (starting torch in fresh processes cost more than
    most probes). One pool at a time: starting another closes the last, so no idle rank shares
    the cores with a probe."""

    def __init__(self):
        self.pool = None

    def __call__(self, fn, world: int, *args, timeout: float = 180.0):
        if self.pool is None or self.pool.world_size != world or not self.pool.alive:
            self.close()
            self.pool = RankPool(world, timeout=300.0)
        return self.pool.run(fn, *args, timeout=timeout)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

_MATMUL_SIZES = (384, 768)
_MATMUL_SECONDS = 0.25                   # timed seconds per matmul size
_COPY_BYTES = 64 * 2**20
_COPY_SECONDS = 0.25
# the compute probes take each call's inputs from the next of as many copies as fill this: more
# than a core's own cache (2 MiB of L2 a core on the machine of BENCHMARKS.md), so they read them
# from memory shared with the other cores, as a training step's activations and weights are read
_POOL_BYTES = 32 * 2**20
_GLOO_SIZES = tuple(4096 * 4**k for k in range(6))    # 4 KiB .. 4 MiB, 4x apart
_GLOO_WARMUP = 3
_GLOO_REPS = 9
_GLOO_WORLD = 2
_CONTENTION_SECONDS = 1.5
_CONTENTION_READINGS = 3               # readings per number of processes, the median kept
_CONTENTION_READING_SECONDS = 0.5      # each reading's loop: the three take what one reading did
_SKEW_COMPUTE = (2e-4, 1e-3, 4e-3)     # compute seconds before a collective, for Link.skew
_SKEW_BLOCKS = 7                       # blocks of rounds per skew point, their median taken


def _timed_median(op, seconds: float, warmup: int = 3, min_reps: int = 5) -> float:
    """Median wall time of ``op()`` over about ``seconds`` of repetitions after ``warmup`` calls.
    The median rather than the mean: other processes share these cores."""
    for _ in range(warmup):
        op()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        op()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _measure_matmul_flops() -> float:
    """Achieved fp32 matmul FLOP/s on one thread: the best size's median rate (2n^3 per n x n mm)."""
    rates = []
    for n in _MATMUL_SIZES:
        a, b = torch.randn(n, n), torch.randn(n, n)
        c = torch.empty(n, n)
        t = _timed_median(lambda: torch.mm(a, b, out=c), _MATMUL_SECONDS)
        rates.append(2 * n**3 / t)
    return max(rates)


def _measure_memory_bandwidth() -> float:
    """Achieved bytes/s of a large fp32 copy on one thread, counting the read and the write."""
    src = torch.ones(_COPY_BYTES // 4)
    dst = torch.empty_like(src)
    t = _timed_median(lambda: dst.copy_(src), _COPY_SECONDS, warmup=2, min_reps=3)
    return 2 * _COPY_BYTES / t


def _collective(kind: str, x, part, group, first: int):
    """A call of one fp32 ``kind`` collective on ``x`` within ``group`` (``part``: a rank's piece
    of it); p2p: a round trip between ranks ``first`` and ``first + 1``, the first sending first."""
    if kind == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    if kind == "all_gather":
        return lambda: dist.all_gather_into_tensor(x, part, group=group)
    if kind == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(part, x, group=group)
    rank = dist.get_rank()

    def p2p():
        if rank == first:
            dist.send(x, first + 1)
            dist.recv(x, first + 1)
        else:
            dist.recv(x, first)
            dist.send(x, first)
    return p2p


def _gloo_probe(sizes: tuple[int, ...], warmup: int, reps: int, kind: str = "all_reduce",
                group_size: int | None = None, busy: bool = False) -> list[float]:
    """Run on every rank (a job of ``_Ranks``' pool): median seconds of an fp32 ``kind``
    collective (all_reduce, all_gather, reduce_scatter; p2p: the pair's first rank sends to the
    second and back) of each size in bytes (the whole buffer), in groups of ``group_size``
    consecutive ranks all working at once (default: the world). A barrier before each timed
    call lines the ranks up, so the time is the collective's and not the wait for a late peer.

    ``busy``: each timed call follows about 1 ms of matmuls, as a collective in a training step
    follows compute, and the time is the call's excess over that compute (timed the same way,
    every rank computing at once, so ranks sharing cores slow it as they do): a rank entering
    the collective waits for peers still in their time slice and for gloo's threads to be
    scheduled, which back-to-back calls never see."""
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    g = group_size or world
    if kind == "p2p":
        g = 2
    groups = [dist.new_group(list(range(k, k + g))) for k in range(0, world, g)] if g < world else [None]
    group = groups[rank // g] if g < world else None
    n, first = g, (rank // g) * g
    a = torch.randn(160, 160)
    work = _about_a_millisecond(a) if busy else 0
    ops = [_collective(kind, torch.ones(nbytes // 4), torch.empty(nbytes // 4 // n), group, first)
           for nbytes in sizes]
    for op in ops:
        for _ in range(warmup):
            op()
    # the sizes in turn, rep after rep, and the compute alone among them (the base the excess
    # is taken over): a disturbance of the machine that lasts a while falls on all of them alike
    times = [[] for _ in range(len(ops) + 1)]
    for _ in range(reps):
        for i, op in enumerate(ops + [None]):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(work):
                a @ a
            if op is not None:
                op()
            times[i].append(time.perf_counter() - t0)
    base = statistics.median(times[-1]) if busy else 0.0
    return [max(statistics.median(ts) - base, 1e-6) for ts in times[:-1]]


def _fit_alpha_beta(moved: list[float], seconds: list[float]) -> tuple[float, float]:
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


_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")


def _excess_per_round(compute, exchange, rounds: int, blocks: int = 3) -> float:
    """Seconds ``exchange()`` adds to a round of ``compute()``; every rank runs ``rounds`` rounds
    of compute alone, then ``rounds`` of compute + exchange, both timed with all ranks at once
    (so ranks sharing cores slow the compute alike in both); the median over ``blocks``."""
    out = []
    for _ in range(blocks):
        spans = []
        for with_exchange in (False, True):
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(rounds):
                if with_exchange:
                    exchange(i)
                else:
                    compute()
            spans.append(time.perf_counter() - t0)
        out.append(max(spans[1] - spans[0], 0.0) / rounds)
    return statistics.median(out)


_MS_WORK: dict = {}     # this process's (world size, shape) -> _about_a_millisecond's count


def _about_a_millisecond(a) -> int:
    """Matmuls of ``a`` that take about 1 ms on a core of one's own (timed alone, in turn; once
    per process: every rank of a pool runs the same probes, so all skip it alike)."""
    key = (dist.get_world_size(), tuple(a.shape))
    if key not in _MS_WORK:
        work = 1
        for r in range(dist.get_world_size()):
            if r == dist.get_rank():
                work = math.ceil(1e-3 / _timed_median(lambda: a @ a, 0.01))
            dist.barrier()
        _MS_WORK[key] = work
    return _MS_WORK[key]


def _exchange_probe(kind: str, group_size: int, compute_s: float) -> float:
    """Seconds one small exchange adds when ranks outnumber cores: every rank computes about
    ``compute_s`` (of matmuls, timed on a free core) then exchanges within its group of
    ``group_size`` consecutive ranks — a 4 KiB collective, or a p2p round trip of the pair —
    round after round, as a training step's layers do. The excess over the same compute
    without the exchanges, per exchange, is the exchange's latency among busy ranks: a woken
    rank waits for a core as much as for the wire, and peers drift apart within their time
    slices the longer they compute."""
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    g = 2 if kind == "p2p" else group_size
    groups = [dist.new_group(list(range(k, k + g))) for k in range(0, world, g)] if g < world else [None]
    group, first = groups[rank // g], (rank // g) * g
    a = torch.randn(160, 160)
    work = max(1, round(_about_a_millisecond(a) * compute_s / 1e-3))
    x, part = torch.ones(1024), torch.empty(1024 // g)

    def compute():
        for _ in range(work):
            a @ a

    op = _collective(kind, x, part, group, first)

    def exchange(i):
        compute()
        op()

    # 7 blocks, not 3: the step's collectives take these as their latency, and with 3 the same
    # machine's points moved by 1.7-2x on average (up to 4x) between calibrations (BENCHMARKS.md,
    # runs 29-30)
    excess = _excess_per_round(compute, exchange, max(6, round(24 * (1e-3 / compute_s) ** 0.5)), blocks=_SKEW_BLOCKS)
    return excess / 2 if kind == "p2p" else excess      # p2p: per message of the round trip


def _probe_all(sizes: tuple[int, ...], warmup: int, reps: int) -> dict:
    """Every kind's medians, for groups of 2 and of the whole world (all groups at once), and
    each kind's latency after each compute length of _SKEW_COMPUTE, round after round with no
    barrier between (``_exchange_probe``: what a training step's collectives see, about twice
    the barrier-aligned call's latency on 2 processes of this machine); in one spawn."""

    # the tensor collectives' old names still run gloo's kernels; their deprecation notice is
    # no news to a user calibrating
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    world = dist.get_world_size()
    groups = sorted({2, world})
    out = {(kind, g): _gloo_probe(sizes, warmup, reps, kind, g, busy=True) for kind in _KINDS for g in groups
           if not (kind == "p2p" and g != 2)}
    for kind in _KINDS:     # every world: a training step's collectives follow compute, unaligned
        for g in ([2] if kind == "p2p" else groups):
            for t in _SKEW_COMPUTE:
                out[("skew", kind, g, t)] = _exchange_probe(kind, g, t)
    if world == _GLOO_WORLD:     # the synthetic pipeline fits the hop of a core per rank only
        out[("pipeline",)] = _pipeline_probe()
    out[("overlap",)] = _overlap_probe()
    return out


_OVERLAP_BYTES, _OVERLAP_REPS = 1 << 20, 31    # the overlap probe's all-reduce, and its rounds


def _overlap_probe() -> tuple:
    """(compute alone, collective alone, the two overlapped) seconds of each round, every rank at once:
    about 2 ms of matmuls; a 1 MiB all-reduce; the all-reduce issued asynchronously, the same
    matmuls, then its wait (as the overlap pass issues gradient buckets and ZeRO-3's prefetch).
    Timed in turn, round after round, a barrier before each."""
    torch.set_num_threads(1)
    a = torch.randn(160, 160)
    work = 2 * _about_a_millisecond(a)
    x = torch.ones(_OVERLAP_BYTES // 4)

    def compute():
        for _ in range(work):
            a @ a

    def both():
        w = dist.all_reduce(x, async_op=True)
        compute()
        w.wait()

    variants = (compute, lambda: dist.all_reduce(x), both)
    for f in variants:
        f()
    times: list = [[], [], []]
    for _ in range(_OVERLAP_REPS):
        for i, f in enumerate(variants):
            dist.barrier()
            t0 = time.perf_counter()
            f()
            times[i].append(time.perf_counter() - t0)
    return tuple(times)


def _overlap_loss(per_rank: list) -> float:
    """The fraction of the shorter of compute and collective that overlapping them did not hide,
    from each rank's ``_overlap_probe``: per round, with the slowest rank's time of each, 0 when
    the two took the longer one's time, 1 when they took the sum; the median over the rounds
    (a round's collective alone varies 1.2-2.7 ms here, so one median of each varied 0.3-1.0).

    Measured on every world, the one whose ranks outnumber the cores too: gloo's collectives
    are host work (2026-12-04, this machine: 300 all-reduces of 4 KiB on 4 processes kept rank
    0's gloo event-loop thread busy 380 ms, 1.3 ms each, in 1.5 s), and cores the ranks' compute
    already fills cannot take it beside that compute. There the probe reads 1.0 with all-reduces
    of 4 KiB, 1 MiB and 4 MiB alike. The estimate charges it against the time some
    communication lane was busy, not each collective in turn: ZeRO-3's gathers and reductions
    run on process groups of their own, side by side. (Charged each in turn, ZeRO-3's hold-out
    steps on 4 processes came out at 1.39x their measured time: BENCHMARKS.md, hold-out run 5.)"""
    rounds = [[max(r[i][k] for r in per_rank) for i in range(3)] for k in range(len(per_rank[0][0]))]
    return statistics.median(min(1.0, max(0.0, (both - max(c, m)) / min(c, m))) for c, m, both in rounds)


_PIPE_M, _PIPE_F, _PIPE_B = 4, 6e-4, 1.2e-3      # the synthetic pipeline: micro-batches, F and B seconds


def _pipeline_probe(steps: int = 12) -> float:
    """Run on every rank: seconds per step of a synthetic two-stage 1F1B pipeline (stage =
    rank // (world / 2), its peer the same replica of the other stage), _PIPE_M micro-batches
    whose F and B are _PIPE_F and _PIPE_B seconds of matmuls on a core of one's own; each step's
    receives posted up front and 16 KiB messages sent as each action ends, as autopar's pipeline
    runtime does. The mean over ``steps`` (after a barrier each), as ``_op_overhead_probe``
    takes its schedules'."""
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    half = world // 2
    stage, replica = rank // half, rank % half
    peer = (1 - stage) * half + replica
    a = torch.randn(160, 160)
    per_ms = _about_a_millisecond(a)
    work = {"F": max(1, round(per_ms * _PIPE_F * 1e3)), "B": max(1, round(per_ms * _PIPE_B * 1e3))}
    program = lower(build_schedule("1f1b", 2, _PIPE_M))[stage]
    x = torch.ones(4096)
    times = []
    for i in range(steps + 2):
        posted = {act: dist.irecv(torch.empty(4096), peer, tag=2 * act.mb + (act.kind == "RECV_B"))
                  for act in program if act.kind.startswith("RECV")}
        dist.barrier()
        t0, sends = time.perf_counter(), []
        for act in program:
            if act.kind in ("F", "B"):
                for _ in range(work[act.kind]):
                    a @ a
            elif act.kind.startswith("SEND"):
                sends.append(dist.isend(x, peer, tag=2 * act.mb + (act.kind == "SEND_B")))
            else:
                posted[act].wait()
        for w in sends:
            w.wait()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.mean(times)


def _pipeline_replay(world: int, cores: int, contention: tuple, hop: float, wake: float = 0.0,
                     place=pipeline_placement) -> float:
    """The cost model's replay of the synthetic pipeline (``_pipeline_probe``) on ``world``
    processes sharing ``cores`` cores, its compute slowed by the ``contention`` of the ranks
    computing at each moment, the ranks laid out by ``place`` (``pipeline_placement``)."""
    s = build_schedule("1f1b", 2, _PIPE_M)
    crowd = functools.partial(slowdown, contention, cores)
    speed, placement = place(2, world, cores, crowd) if crowd(world) > 1 else (1.0, None)
    return simulate_shared(s, duration=lambda a: _PIPE_F if a.kind == "F" else _PIPE_B, latency=lambda a: hop,
                           speed=speed, wake=wake, placement=placement).makespan


def _fit_hop(measured: float, world: int, cores: int, contention: tuple, hop: float | None = None,
             place=pipeline_placement) -> float:
    """The message latency (or, given ``hop``, the wake-up wait) at which ``_pipeline_replay``
    lasts ``measured`` seconds (bisection; 0 if even none replays slower, or if not even 50 ms
    does: the probe was disturbed)."""

    def replay(x):
        return _pipeline_replay(world, cores, contention, x if hop is None else hop, 0.0 if hop is None else x, place)

    fit = _bisect_latency(replay, measured, "the synthetic pipeline", "hop" if hop is None else "wake")
    return 0.0 if fit is None else fit


def _bisect_latency(replay, measured: float, what: str, kind: str) -> float | None:
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


def _measure_kinds(ranks: _Ranks, world: int) -> tuple[tuple, tuple, list[float], float]:
    """Whole-collective alpha-beta fits of each kind on ``world`` processes: what a Link's
    ``fits`` holds (p2p is a round trip of two messages: its fit is halved); the latency
    table of ``skew`` (the latency among computing ranks; the slowest rank's); the all-reduce's
    per-size times; the synthetic pipeline's step on ``_GLOO_WORLD`` processes (``_pipeline_probe``,
    slowest rank; None on others); and the overlap loss (``_overlap_probe``)."""
    per_rank = ranks(_probe_all, world, _GLOO_SIZES, _GLOO_WARMUP, _GLOO_REPS, timeout=180)
    out = []
    skew = tuple((key[1], key[2], key[3], max(r[key] for r in per_rank)) for key in per_rank[0] if key[0] == "skew")
    pipeline = max(r[("pipeline",)] for r in per_rank) if ("pipeline",) in per_rank[0] else None
    overlap = _overlap_loss([r[("overlap",)] for r in per_rank])
    for key in per_rank[0]:
        if key[0] in ("skew", "pipeline", "overlap"):
            continue
        kind, g = key
        seconds = [max(ts) for ts in zip(*(r[(kind, g)] for r in per_rank if r[(kind, g)]))]   # the slowest rank
        # a p2p probe is a round trip: two messages of the size
        moved = [bytes_per_rank(kind, s, g) * (2 if kind == "p2p" else 1) for s in _GLOO_SIZES]
        alpha, beta = _fit_alpha_beta(moved, seconds)
        if not beta > 0:   # nonsense fit (very noisy machine): the largest message's rate
            beta = seconds[-1] / moved[-1]
        if not alpha > 0:  # a noisy large message tilted the line below the origin: the small
            # messages, which are nearly all latency, say what a call costs (their median excess)
            alpha = statistics.median(t - beta * x for x, t in zip(moved[:3], seconds[:3]))
        out.append((kind, g, max(alpha, 1e-6) / (2 if kind == "p2p" else 1), beta / (2 if kind == "p2p" else 1)))
        if kind == "all_reduce" and g == world:
            times = seconds
    return tuple(out), skew, times, pipeline, overlap


def _measure_gloo(ranks: _Ranks, world: int = _GLOO_WORLD) -> tuple[Link, list[float], float]:
    """The gloo link between ``world`` local processes: per-kind fits, and latency / bandwidth
    per message from the all-reduce's (a ring all-reduce sends 2(N-1) messages in turn);
    also the all-reduce's per-size times."""
    fits, skew, seconds, pipeline, overlap = _measure_kinds(ranks, world)
    _, _, alpha, beta = next(f for f in fits if f[0] == "all_reduce" and f[1] == world)
    return Link("gloo-tcp", 1.0 / beta, max(alpha / (2 * (world - 1)), 1e-6), fits=fits, skew=skew,
                overlap_loss=overlap), seconds, pipeline


def _measure_pointwise_efficiency(mem_bw: float) -> float:
    """Achieved fraction of the copy bandwidth on the pointwise ops models are made of (GeLU,
    LayerNorm, softmax, an add; read + write of a 512 KiB fp32 tensor each, each call's from the
    next copy of a pool, ``_pool``): their bytes over their summed time; on a CPU the
    transcendental ones are bound by arithmetic before memory."""
    pool = _pool(lambda: (torch.randn(512, 256),))
    ops = (torch.nn.functional.gelu, lambda x: torch.nn.functional.layer_norm(x, (256,)),
           lambda x: torch.softmax(x, -1), lambda x: x + x)
    seconds = sum(_timed_median(_rotating(pool, op), 0.1) for op in ops)
    return min(1.0, len(ops) * 2 * pool[0][0].numel() * 4 / seconds / mem_bw)


_LINEAR_SHAPES = ((512, 64, 64), (512, 64, 256), (512, 256, 64), (512, 128, 128), (512, 128, 512), (512, 512, 128))
_ATTENTION_SHAPES = ((64, 32, 16), (16, 256, 64))    # (row x head slices, sequence, head dim)


def _pool(make) -> list:
    """``make()``'s tensors and as many more copies as fill ``_POOL_BYTES`` (at least two).

    A probe that loops over one input reads it from the core's cache after the first call; a
    layer in a training step reads what earlier layers wrote, and its weights, from memory
    shared with every core (``_rotating`` takes each call's inputs from the next copy). On this
    machine the linear layers' products ran at 0.91 of peak on one hot input and 0.68 through
    the pool, and a GPT's own matmuls (h=96, 384 tokens) at 0.67 (torch.profiler, 2026-12-05)."""
    first = make()
    size = max(1, sum(t.numel() * t.element_size() for t in first))
    return [first] + [make() for _ in range(max(1, _POOL_BYTES // size - 1))]


def _rotating(pool: list, fn):
    """``fn`` of the next entry of ``pool`` at each call (``_pool``)."""
    entries = itertools.cycle(pool)
    return lambda: fn(*next(entries))


def _measure_matmul_efficiency(peak: float) -> float:
    """Achieved fraction of ``peak`` on the products of small linear layers: for each (m, k, n)
    of _LINEAR_SHAPES, y = x[m,k] @ w[k,n] and its backward's dx = dy @ w^T and dw = x^T @ dy,
    each call's operands from the next copy of a pool (``_pool``); their FLOPs over their
    summed time."""
    flops = seconds = 0.0
    products = (lambda x, w, dy: torch.mm(x, w), lambda x, w, dy: torch.mm(dy, w.t()),
                lambda x, w, dy: torch.mm(x.t(), dy))
    for m, k, n in _LINEAR_SHAPES:
        pool = _pool(lambda: (torch.randn(m, k), torch.randn(k, n), torch.randn(m, n)))
        seconds += sum(_timed_median(_rotating(pool, product), 0.05) for product in products)
        flops += 3 * 2 * m * k * n
    return min(1.0, flops / seconds / peak)


def _measure_attention(peak: float) -> tuple[float, float]:
    """(fraction of ``peak``, seconds per (row, head) slice) of the fused causal attention
    kernel on one thread: forward + backward timed on a short-head and a long-head shape of
    _ATTENTION_SHAPES (each call's q, k, v from the next copy of a pool, ``_pool``) and solved
    for time = 3 (4·B·s²·d / rate + B·overhead), B slices (backward as two forwards, the
    model's rule)."""
    rows = []

    def fb(q, k, v):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    for slices, s, d in _ATTENTION_SHAPES:
        pool = _pool(lambda: tuple(torch.randn(slices, 1, s, d, requires_grad=True) for _ in range(3)))
        rows.append((4.0 * slices * s * s * d, float(slices), _timed_median(_rotating(pool, fb), 0.15) / 3))
    (f1, b1, t1), (f2, b2, t2) = rows
    det = f1 * b2 - f2 * b1
    inv_rate, overhead = (t1 * b2 - t2 * b1) / det, (f1 * t2 - f2 * t1) / det
    if overhead < 0 or inv_rate <= 0:      # no setup cost visible: the long shape's rate alone
        return min(1.0, f2 / t2 / peak), 0.0
    return min(1.0, 1.0 / inv_rate / peak), overhead


def _measure_step_overhead() -> float:
    """Seconds per parameter tensor of ``torch.optim.AdamW.step`` on small tensors (48 of 64 x 64):
    its per-tensor loop and a 64 x 64 tensor's arithmetic. The arithmetic is about a quarter of it
    (31 us a tensor at 1-32 elements against 42-44 us at 64 x 64 on this machine, 2026-12-07),
    and ``estimate.optimizer_time`` charges the state bytes on the roofline as well: the
    optimizer is priced above its measured step (BENCHMARKS.md, hold-out run 94's entry). Left
    as it is: pricing it alone makes the 2-process hold-out grid read short, its compute being
    priced low (the same entry; hold-out run 97's for the two corrected together)."""
    params = [torch.nn.Parameter(torch.randn(64, 64)) for _ in range(48)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    return _timed_median(opt.step, 0.2) / len(params)


def _probe_layer_ops() -> dict:
    """Op name -> count of one layer of the op_overhead probe's GPTs (h = 8): the mix
    ``Device.op_weights`` are relative to, so the probe's layers weigh what they count."""
    c = GPTConfig(vocab=_PROBE_VOCAB, seq=8, dim=8, heads=2, layers=2, max_seq=8)
    x, _ = gpt_batch(c, 2)
    layer = next(g for g in Profiles(TinyGPT(c), (x,), blocks_once=False).base.groups if g.name.startswith("blocks"))
    return dict(layer.op_names)


def _measure_op_overhead(ranks: _Ranks, op_weights: tuple) -> tuple:
    """(seconds per forward op, seconds per stage pass, backward's per-op time over the forward's,
    backward's share of the pass, seconds per message, a zero-bubble W action's seconds per
    pass and per matmul with a parameter weight, and the part of those the F actions take) of framework time as autopar's
    compiled modules run them: a GPT of negligible arithmetic (autopar.models.TinyGPT, h = 8,
    2 x 8 tokens) of 2 and of 10 layers, each compiled as a two-stage 1F1B pipeline of 4 micro-batches on 2 gloo
    processes. The thread CPU time of each rank's forward actions, against the ops the cost
    model's profile counts in its stage (each weighed by ``op_weights``, the measured
    ``Device.op_weights``: ``cost.compute.weighed_ops``), is fitted as pass + ops x per-op, and its backward actions' likewise
    (against the ops' backward weights): the per-op slopes are the dispatch (the FX module's Python and the aten
    ops; backward runs each forward op's gradients, not twice its cost: about 1.2x the forward's
    on this machine), the constants what a stage does per micro-batch besides its ops (its
    call, the runtime's autograd functions and hooks). (A fit that makes no sense on a noisy
    machine falls back to pass + 3 x ops x per-op over F + B, split as the arithmetic is.) The CPU
    time of posting a batch of transfers, per transfer in it, is the per-message cost. The same pipelines under the
    zero-bubble schedule: the growth of the F, B and W actions' time per micro-batch over
    1F1B's, fitted as pass + matmuls x per-matmul (the matmuls with a parameter weight, whose
    weight gradients W defers), is what splitting out the W action costs, and the F
    actions' part of that growth its forward share (each matmul whose weight gradient W defers
    runs through an autograd function of its own in the forward too). These four
    pipelines and the ``_HOP_PIPELINES`` are stepped in turn in one job (``_op_overhead_probe``).
    Last, per hop pipeline, what its replay needs (``_fit_runtime_hop``): each stage's median F,
    B and W action and message CPU times, and the step's schedule as the slowest rank timed it;
    and per 1F1B hop or ``_TAIL_PIPELINES`` pipeline what ``_fit_tail`` fits (``_tails``)."""
    points, forward, backward, messages, split, split_forward = [], [], [], [], [], []
    pipelines = _OP_PIPELINES + _HOP_PIPELINES + _TAIL_PIPELINES
    per_rank = ranks(_op_overhead_probe, 2, pipelines, timeout=240)     # a list per rank
    for per_pipeline in per_rank:
        got = dict(zip(pipelines, per_pipeline))
        for layers in (2, 10):
            (fb, (names, matmuls), msg, kinds, *_), (fbw, _, _, zb_kinds, *_) = got[(layers, "1f1b", 8)], \
                got[(layers, "zero_bubble", 8)]
            ops, ops_b = weighed_ops(names, op_weights), weighed_ops(names, op_weights, backward=True)
            points.append((3 * ops, fb))
            forward.append((ops, kinds["F"]))
            backward.append((ops_b, kinds["B"]))
            messages.append(msg)
            split.append((matmuls, fbw - fb))
            split_forward.append(zb_kinds["F"] - kinds["F"])
    replays = _replays(pipelines, per_rank)
    (op_f, pass_f), (op_b, pass_b) = _fit_line(forward), _fit_line(backward)
    if op_f > 0 and op_b > 0 and pass_f >= 0 and pass_b >= 0 and pass_f + pass_b > 0:
        per_op, ratio, per_pass, share = op_f, op_b / op_f, pass_f + pass_b, pass_b / (pass_f + pass_b)
    else:                # a nonsense fit (a noisy machine): F + B together, split as the arithmetic is
        per_op, per_pass = _fit_line(points)
        ratio, share = 2.0, 2 / 3
        if per_op <= 0:  # everything per op
            per_op, per_pass = sum(y for _, y in points) / sum(x for x, _ in points), 0.0
    split_op, split_pass = _fit_line(split)
    if split_op <= 0:
        split_op, split_pass = max(0.0, sum(y for _, y in split) / sum(x for x, _ in split)), 0.0
    grown = sum(y for _, y in split)
    split_share = min(1.0, max(0.0, sum(split_forward) / grown)) if grown > 0 else 0.0
    return (per_op, max(per_pass, 0.0), ratio, share, statistics.median(messages), max(split_pass, 0.0), split_op,
            split_share, replays, _tails(pipelines, per_rank))


def _tails(pipelines: tuple, per_rank: list) -> list:
    """Per 1F1B pipeline among the ``_HOP_PIPELINES`` and ``_TAIL_PIPELINES`` of
    ``_op_overhead_probe``'s results: (the pipeline, the mean over steps of how long the rank
    that ended its schedule first waited for the other, the mean of the last one's wall time from
    its schedule's end to ``train_step``'s return: the tied gradients' exchange and the loss
    broadcast as they ran)."""
    out = []
    for k, pipeline in enumerate(pipelines):
        if pipeline[1] != "1f1b" or pipeline not in _HOP_PIPELINES + _TAIL_PIPELINES:
            continue
        steps = zip(*(per_rank[r][k][6] for r in range(len(per_rank))))
        pairs = [(max(e for e, _ in ranks) - min(e for e, _ in ranks), max(ranks)[1]) for ranks in steps]
        out.append((pipeline, statistics.mean(w for w, _ in pairs), statistics.mean(t for _, t in pairs)))
    return out


def _fit_tail(tails: list, link: Link) -> tuple:
    """``Link.tail``: (a, b) of the line a + b x wait through the probe pipelines' ``_tails``,
    each one's time past its schedule less what the estimate already gives those exchanges there
    (``tied_exchange_time`` of its tied embedding, ``loss_broadcast_time`` over 2 ranks, on
    ``link``), against how long the other rank waited; a and b at least 0.

    Why (2026-12-05, this machine, 2 processes): the rank that ends a 1F1B schedule last (its
    final backward runs while the other waits) took 0.6-1.5 ms (median) and 1.4-2.5 ms (mean)
    from its schedule's end to the step's loss, against the estimate's 0.6 ms of p2p time, and
    the longer the other rank had waited, the longer: probe GPTs waited 0.6-3.3 ms; the
    hold-out grid's gpt h96 L4 s48 (not a probe) waited 2.5 ms and took 2.05 ms. Bare, the same
    exchange after a peer idle 0.2-8 ms took 0.13-0.19 ms (median): the cost is the pipeline's,
    not the link's, and is measured as such, not explained."""
    points = []
    for (_, _, dim, *rest), wait, past in tails:
        vocab = rest[1] if len(rest) > 1 else _PROBE_VOCAB
        modeled = tied_exchange_time(4.0 * vocab * dim, link) + loss_broadcast_time(2, link)
        points.append((wait, past - modeled))
    if len(points) < 2:
        return ()
    slope, intercept = _fit_line(points)
    if slope < 0:
        slope, intercept = 0.0, statistics.mean(y for _, y in points)
    if intercept < 0:       # through the origin instead
        slope, intercept = max(0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points)), 0.0
    return (intercept, slope)


def _replays(pipelines: tuple, per_rank: list) -> list:
    """What ``_fit_runtime_hop`` replays of ``_op_overhead_probe``'s results (a list per rank)
    for the ``_HOP_PIPELINES`` among ``pipelines``: (schedule, per stage {kind: action CPU
    seconds}, per stage a message's CPU seconds; the slowest rank's schedule). An interleaved
    pipeline's 4 stages take their rank's times (stage s runs on rank s % 2)."""
    out = []
    for k, pipeline in enumerate(pipelines):
        if pipeline not in _HOP_PIPELINES:
            continue
        schedule = pipeline[1]
        rows = [per_rank[r][k] for r in range(len(per_rank))]
        ranks = [[row for row in rows if row[5] == r] for r in (0, 1)]
        stages = [ranks[s % 2] for s in range(4 if schedule == "interleaved" else 2)]
        out.append((schedule, [{kind: statistics.mean(row[3][kind] for row in st) for kind in ("F", "B", "W")}
                               for st in stages],
                    [statistics.mean(row[2] for row in st) for st in stages], max(row[4] for row in rows)))
    return out


def _fit_runtime_hop(replays: list, cores: int, contention: tuple, schedules: tuple | None = None) -> float:
    """The message latency at which the cost model's replay of autopar's own pipelines lasts
    their measured schedules: the op-overhead probe's 1F1B pipelines of GPTs of h = 16
    (``_HOP_PIPELINES``; ``_measure_op_overhead``'s ``replays``: per pipeline its schedule, each
    stage's median F and B action CPU times with a message's CPU time added as the estimate adds
    it, and the schedule the slowest rank timed), replayed as the estimate replays 2 ranks on
    ``cores`` cores (placed by ``pipeline_placement``, slowed by the measured ``contention``),
    each send moving once its receive is posted, as the estimate replays them (``execute_shared``'s
    ``rendezvous``). The median of the pipelines' fits (bisection; 0 where even none replays slower).

    This is what a message costs the runtime's pipelines beyond the CPU time of posting it, as
    a latency on the schedule's critical path. Measured, not explained (2026-12-03, this
    machine, per-action timelines of 1F1B on 2 processes): a message reaches a rank waiting on
    it within 0.03 ms (median), but one or two posts (``dist.isend``/``irecv``) a step hold the
    thread 1-2 ms without using its CPU, and time passes between actions (2026-12-04: 7-25% of
    posts took over 1 ms, up to 5 ms, with both ranks of a pair waiting at once; gloo moves an
    unbound buffer only once the receiver's notice that its receive is posted reached the
    sender, so a message can wait on the sender's event-loop thread, which shares a core with
    its compute; posting every receive as early as its shapes allow measured within the noise,
    0.88-1.09x, in round-robin A/B runs). Replayed from each
    action's measured time, GPTs of h = 8 lose 0.7-1.2 ms a message, h = 12 to 64 lose 1.3-1.8
    ms, and a synthetic pipeline of bare matmuls (``_pipeline_probe``) 0-0.8 ms. So the probe's
    pipelines are of h = 16: outside the h = 8 case, and none of the hold-out grid's widths
    (32, 64, 96). The zero-bubble schedule is left out: its replay of its own measured actions
    can be longer than its measured schedule with no latency at all, so it cannot say what a
    message costs. ``schedules``: the replays of those schedules only (None: all).

    The interleaved schedule's messages cost more (2026-12-04, replays of measured actions on 2
    processes: GPTs of h = 16 and 64 with 4 layers lose 1.05-1.41 ms a message interleaved,
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
            return simulate_shared(s, duration=duration, latency=lambda a: hop, speed=speed,
                                   placement=placement, rendezvous=True).makespan

        fit = _bisect_latency(replay, measured, f"a {schedule_name} pipeline's schedule", "hop")
        if fit is not None:
            fits.append(fit)
    return statistics.median(fits) if fits else 0.0


def _fit_runtime_wake(per_rank: list, cores: int, contention: tuple, hop: float) -> float:
    """``Link.wake`` of ranks sharing cores: the wait for a core, when every one is taken, of a
    rank its message woke, at which the cost model's replay of autopar's own pipelines on as many
    processes as stages lasts their measured schedules. ``per_rank``: ``_op_overhead_probe``'s
    results on 2 x cores processes for the ``_WAKE_PIPELINES`` (1F1B, one stage a process, so
    that the estimate's placement makes them one group of every core, where a woken rank can
    find them all taken: ``pipeline_placement``). Replayed as ``_fit_runtime_hop`` replays the
    2-process pipelines: each stage's median F and B action CPU times, plus its messages' CPU
    times as the estimate adds them (a receive and a send per pass in the middle stages), the
    ``hop`` fitted on 2 processes, the measured ``contention``, sends moving once their receive
    is posted; the median of the pipelines' fits (bisection; 0 where even none replays slower).

    Why a pipeline of the runtime's and not ``_pipeline_probe``'s bare matmuls: that probe runs
    2 stages of 2 replicas each on 4 processes, which the estimate places as a core per stage, so
    no wake ever meets a full group there and its fit could only read 0 (the synthetic fit read
    0.00 ms in every calibration of hold-out run 70). On this machine (2026-12-06, 4 processes
    on 2 cores), the hold-out's gpt h96 L4 s48 under zero-bubble replayed from its own measured
    actions at the fitted hop lasted 30.0 ms against a measured 32.6-35.5 ms schedule; a wake of
    2 ms replayed 33.9 ms (its h32 L2 s16: 14.5 ms at none, 17.2 ms at 1 ms, measured 14.9-17.6)."""
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
            return simulate_shared(schedule, duration=duration, latency=lambda a: hop, speed=speed,
                                   placement=placement, wake=wake, rendezvous=True).makespan

        fit = _bisect_latency(replay, max(row[4] for row in rows),
                              f"a 1f1b pipeline's schedule on {world} processes", "wake")
        if fit is not None:
            fits.append(fit)
    return statistics.median(fits) if fits else 0.0


def _fit_line(points: list) -> tuple[float, float]:
    """Least-squares (slope, intercept) of y = intercept + slope x."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return slope, my - slope * mx


_OP_PIPELINES = ((2, "1f1b", 8), (2, "zero_bubble", 8), (10, "1f1b", 8), (10, "zero_bubble", 8))   # (layers, schedule, h)
_HOP_PIPELINES = ((2, "1f1b", 16), (4, "1f1b", 16), (4, "interleaved", 16))    # those _fit_runtime_hop replays
# (layers, schedule, h, seq): with the 1F1B hop pipelines, those _fit_tail fits (the other rank
# waiting longer at the end: longer actions; widths and lengths none of the hold-out grid's)
_TAIL_PIPELINES = ((4, "1f1b", 128, 24), (8, "1f1b", 80, 40))
# (layers, schedule, h): those _fit_runtime_wake replays, one stage a process on 2 x cores processes
_WAKE_PIPELINES = ((4, "1f1b", 16), (8, "1f1b", 16))
_PROBE_VOCAB = 16       # the probe GPTs' vocabulary unless a pipeline gives one (its tied embedding)


def _op_overhead_probe(pipelines: tuple, steps: int = 25) -> list:
    """On each rank of pipelines of as many stages as processes (2 unless the wake probe's;
    micro-batches of 2 sequences of 8 tokens,
    or of ``seq``) of GPTs of ``(layers, schedule, h[, seq[, vocab, heads]])`` each (vocabulary 16,
    2 heads unless given), all compiled first, then stepped in turn, round
    after round, each step after a barrier (a disturbance of the machine falls on all alike):
    per pipeline (thread CPU seconds of this
    rank's F, B (and W) actions per micro-batch, median of ``steps`` rounds after 3; (op name ->
    count of the ops the profile counts in its stage per micro-batch, its matmuls with a
    parameter weight); CPU seconds per transfer posted (a batch's over its transfers);
    {kind: median thread CPU seconds of one action of that kind}; the mean wall seconds of
    the step's schedule, ``train_step``'s own timer; this rank's pipeline index; per step, the
    wall time its schedule's last action ended and the seconds from then to ``train_step``'s
    return, for ``_tails``). The
    interleaved schedule runs 2 stages a rank.

    The schedule's mean, not its median: the hop fitted to it is a latency the estimate adds to
    every step, and a run takes the sum of its steps. On this machine a message's latency is
    heavy-tailed (2026-12-05: a step of gloo p2p or collectives after a barrier has a median
    well under its mean, 2.7 and 5.1 ms for five 100 KB all-reduces), so a median fits the hop
    of the usual step and the estimate misses the slow ones (the hold-out's 1F1B read
    0.87-0.92 of its measured steps by plan in runs 41-43; ``bench_holdout._step``).
    The actions' CPU times stay medians: they are the work, which the tail does not add to."""
    torch.set_num_threads(1)
    m = 4
    spent = {"compute": 0.0, "message": 0.0, "F": 0.0, "B": 0.0, "W": 0.0}
    count = {"message": 0, "F": 0, "B": 0, "W": 0}

    def loss(out, target):
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))

    def prepared(layers, schedule, dim, seq=8, vocab=_PROBE_VOCAB, heads=2):
        c = GPTConfig(vocab=vocab, seq=seq, dim=dim, heads=heads, layers=layers, max_seq=seq)
        torch.manual_seed(0)
        x, t = gpt_batch(c, 8)
        dm = autopar_compile(TinyGPT(c), Mesh(pp=dist.get_world_size()), example_inputs=(x,),
                             plan=Plan(pp_schedule=schedule, microbatches=m,
                                       virtual_stages=2 if schedule == "interleaved" else 1))
        opt = dm.optimizer(torch.optim.SGD, lr=1e-3)
        lx, lt = dm.shard_batch((x,)), dm.shard_batch(t)
        run_action = dm._run

        def timed(a, *args, **kwargs):
            c0 = time.thread_time()
            try:
                return run_action(a, *args, **kwargs)
            finally:
                took = time.thread_time() - c0
                compute = a.kind in ("F", "B", "W")
                spent["compute" if compute else "message"] += took
                count[a.kind if compute else "message"] += 1
                if compute:
                    spent[a.kind] += took

        dm._run = timed
        post = dm._post

        def timed_post(batch, *args, **kwargs):     # a batch of transfers: its CPU time per message
            c0 = time.thread_time()
            try:
                return post(batch, *args, **kwargs)
            finally:
                spent["message"] += time.thread_time() - c0
                count["message"] += len(batch)

        dm._post = timed_post

        def step():
            opt.zero_grad(set_to_none=True)
            dm.train_step(lx, lt, loss)
            done = time.time()
            opt.step()
            end = max((b for _, _, b in dm.timeline), default=done)     # the schedule's last action's end
            return dm.step_time, end, done - end

        groups = Profiles(TinyGPT(c), (x[: 8 // m],)).base.groups
        # the pipeline pass's even split, one stage a process
        starts = partition([float(g.ops) for g in groups], dist.get_world_size()) + [len(groups)]
        stage = min(int(k) for k in dm.stages)      # this rank's pipeline index
        mine = groups[starts[stage]:starts[stage + 1]]
        names = sum((collections.Counter(g.op_names) for g in mine), collections.Counter())
        return step, (dict(names), sum(g.weight_matmuls for g in mine)), stage

    runs = [prepared(*pipeline) for pipeline in pipelines]
    got = [{k: [] for k in ("compute", "message", "F", "B", "W", "schedule", "tail")} for _ in runs]
    for i in range(steps + 3):
        for k, (step, _, _) in enumerate(runs):
            spent.update(compute=0.0, message=0.0, F=0.0, B=0.0, W=0.0)
            count.update(message=0, F=0, B=0, W=0)
            dist.barrier()
            schedule, end, past = step()
            if i >= 3:
                g = got[k]
                g["compute"].append(spent["compute"] / m)
                g["message"].append(spent["message"] / max(count["message"], 1))
                for kind in ("F", "B", "W"):
                    g[kind].append(spent[kind] / max(count[kind], 1))      # one action's
                g["schedule"].append(schedule)
                g["tail"].append((end, past))
    dist.barrier()
    return [(statistics.median(g["compute"]), ops, statistics.median(g["message"]),
             {kind: statistics.median(g[kind]) for kind in ("F", "B", "W")}, statistics.mean(g["schedule"]), stage,
             g["tail"])
            for g, (_, ops, stage) in zip(got, runs)]


class _Block(torch.nn.Module):
    """Two residual halves of (LayerNorm, Linear d -> 2d, GeLU, Linear 2d -> d): 12 parameter
    tensors, as many as a transformer layer has."""

    def __init__(self, dim: int):
        super().__init__()
        self.halves = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(dim), torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(),
                                torch.nn.Linear(2 * dim, dim)) for _ in range(2))

    def forward(self, x):
        for half in self.halves:
            x = x + half(x)
        return x


class _Stack(torch.nn.Module):
    """The probes' synthetic workload: ``blocks`` of ``_Block`` on rows of width ``dim``, matmuls
    with pointwise ops between them; no attention, no embedding: none of the models the cost
    model's predictions are checked on."""

    def __init__(self, dim: int, blocks: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(dim) for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


_STACK_DIM, _STACK_BLOCKS, _STACK_ROWS = 96, 4, 128     # the contention probe's stack
_SYNC_DIM, _SYNC_ROWS, _SYNC_BLOCKS, _SYNC_STEPS = 8, 4, (2, 8), 25   # the dp runtime probe's stacks
_SYNC_MODES = ("ddp", "zero1", "zero2", "zero3")
_SHARED_MODE = "zero3"     # the dp mode whose host work on ranks sharing cores is fitted (Cluster.shared_sync)
_SHARED_STEPS = 9
_TENSORS_PER_BLOCK = 12


def _contention_probe(seconds: float) -> float:
    """Run on every rank (a job of ``_Ranks``' pool): seconds per forward + backward of the
    synthetic stack (``_Stack``: 4 blocks, d = 96, 128 rows; one thread) while every rank runs
    the same loop at once."""
    torch.set_num_threads(1)
    return _stack_seconds(seconds, dist.barrier)


def _stack_seconds(seconds: float, start=None) -> float:
    torch.manual_seed(0)
    model = _Stack(_STACK_DIM, _STACK_BLOCKS)
    x = torch.randn(_STACK_ROWS, _STACK_DIM)

    def fb():
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    for _ in range(5):
        fb()
    if start is not None:
        start()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fb()
        n += 1
    return (time.perf_counter() - t0) / n


def _sync_probe(modes: tuple, steps: int) -> dict:
    """Run on every rank (a job of ``_Ranks``' pool): (mode, blocks) -> thread CPU seconds of a
    training step (zero_grad, forward, backward, AdamW step) of the synthetic stack of
    ``_SYNC_BLOCKS`` blocks (d = 8, 4 rows a rank: no arithmetic to speak of) compiled by
    autopar on the dp axis of the world under each of ``modes``; ("adam", blocks): a plain
    AdamW step over the same parameters, their gradients set. Thread CPU time: the rank's own
    work, not its waits on collectives (gloo's threads carry those); the median over ``steps``
    rounds, each stepping every model once."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    world = dist.get_world_size()
    steps_of = {}
    for blocks in _SYNC_BLOCKS:
        torch.manual_seed(0)
        x = torch.randn(_SYNC_ROWS * world, _SYNC_DIM)
        model = _Stack(_SYNC_DIM, blocks)
        model(x).square().mean().backward()
        steps_of[("adam", blocks)] = torch.optim.AdamW(model.parameters(), lr=1e-3).step
        for mode in modes:
            steps_of[(mode, blocks)] = _compiled_step(_Stack(_SYNC_DIM, blocks), world, mode, x)
        steps_of[("tp", blocks)] = _compiled_step(_Stack(_SYNC_DIM, blocks), world, "tp", x)
    # round-robin, one step of each per round: a disturbance of the machine falls on all alike
    for step in steps_of.values():
        for _ in range(3):
            step()
    times = {key: [] for key in steps_of}
    walls = {key: [] for key in steps_of if key[0] == "tp"}
    for _ in range(steps):
        for key, step in steps_of.items():
            if key in walls:    # the ranks lined up: the wall time is the step's, not a wait for a late peer
                dist.barrier()
            c0, t0 = time.thread_time(), time.perf_counter()
            step()
            times[key].append(time.thread_time() - c0)
            if key in walls:
                walls[key].append(time.perf_counter() - t0)
    dist.barrier()
    out = {key: statistics.median(ts) for key, ts in times.items()}
    out.update({("tp wall", key[1]): statistics.median(ts) for key, ts in walls.items()})
    for blocks in _SYNC_BLOCKS:     # the collectives a tp step issues, as the module counts them
        stats = steps_of[("tp", blocks)].stats
        stats.reset()
        steps_of[("tp", blocks)]()
        out[("tp collectives", blocks)] = sum(n for (axis, _, _), n in stats.calls.items() if axis == "tp")
    out[("tp kinds",)] = sorted(steps_of[("tp", _SYNC_BLOCKS[-1])].stats.calls)     # (axis, kind, phase)
    return out


def _compiled_step(model, world: int, mode: str, x):
    """A training step of ``model`` compiled on the dp axis of ``world`` ranks under ``mode``
    (``"tp"``: on its tp axis, ``Plan(tp=True)``)."""
    if mode == "tp":
        dm = autopar_compile(model, Mesh(tp=world), example_inputs=(x,), plan=Plan(tp=True))
    else:
        dm = autopar_compile(model, Mesh(dp=world), example_inputs=(x,), plan=Plan(dp=mode))
    opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
    lx = dm.shard_batch((x,))

    def step():
        opt.zero_grad(set_to_none=True)
        dm(*lx).square().mean().backward()
        opt.step()

    step.stats = dm.comm_stats      # calls and bytes per (axis, kind, phase)
    return step


def _shared_step_probe(modes: tuple, steps: int) -> dict:
    """Run on every rank of the pool of ranks sharing cores: (mode, blocks) -> the median wall
    seconds of a training step of the synthetic stack of ``_SYNC_BLOCKS`` blocks compiled by
    autopar on all the ranks under each of ``modes`` (``_compiled_step``; ``"tp"``: on the tp
    axis), each step after a barrier, round-robin over ``steps`` rounds."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    world = dist.get_world_size()
    steps_of = {}
    for blocks in _SYNC_BLOCKS:
        torch.manual_seed(0)
        x = torch.randn(_SYNC_ROWS * world, _SYNC_DIM)
        for mode in modes:
            steps_of[(mode, blocks)] = _compiled_step(_Stack(_SYNC_DIM, blocks), world, mode, x)
    for step in steps_of.values():
        for _ in range(2):
            step()
    walls = {key: [] for key in steps_of}
    for _ in range(steps):
        for key, step in steps_of.items():
            dist.barrier()
            t0 = time.perf_counter()
            step()
            walls[key].append(time.perf_counter() - t0)
    dist.barrier()
    return {key: statistics.median(ts) for key, ts in walls.items()}


def _stack_growth(cluster: Cluster, world: int, mode: str, vary: str = "shared_sync") -> "collections.abc.Callable":
    """x -> the cost model's growth of a step of the synthetic stack from the 2- to the 8-block
    stack on ``world`` ranks of ``cluster`` sharing cores, compiled on the dp axis under ``mode``
    (``"tp"``: on the tp axis, ``Plan(tp=True)``), with ``vary`` at x: ``"shared_sync"``, that
    mode's ``Cluster.shared_sync``; ``"skew_scale"`` or ``"skew_first"``, that field of the shared
    link."""
    lo, hi = _SYNC_BLOCKS
    profiles = {b: Profiles(_Stack(_SYNC_DIM, b), (torch.randn(_SYNC_ROWS, _SYNC_DIM),), blocks_once=False)
                for b in (lo, hi)}
    axes, plan = ({"tp": world}, Plan(tp=True)) if mode == "tp" else ({"dp": world}, Plan(dp=mode))

    def growth(x: float) -> float:
        if vary in ("skew_scale", "skew_first"):
            c = dataclasses.replace(cluster, shared=dataclasses.replace(cluster.shared, **{vary: x}))
        else:
            c = dataclasses.replace(cluster, shared_sync=((mode, x),))
        return (evaluate_plan(profiles[hi], axes, plan, c, _SYNC_ROWS * world).step_time_s
                - evaluate_plan(profiles[lo], axes, plan, c, _SYNC_ROWS * world).step_time_s)

    return growth


def _fit_growth(growth, measured: float, low: float, high: float) -> tuple:
    """(x, the estimate's growth at 1): the x at which ``growth`` (linear in x: what x scales lies
    on the step's path) equals ``measured``, by the line through x = 1/2 and 1, within [low,
    high]; 1 where nothing grows or the estimate does not grow with x."""
    half, one = growth(0.5), growth(1.0)
    if measured <= 0 or one <= half:
        return 1.0, one
    return min(high, max(low, 1.0 + (measured - one) * 0.5 / (one - half))), one


def _measured_growth(per_rank: list, mode: str) -> float:
    """The slowest rank's step growth from the 2- to the 8-block stack under ``mode``
    (``_shared_step_probe``'s results, one dict per rank)."""
    lo, hi = _SYNC_BLOCKS
    return max(r[(mode, hi)] for r in per_rank) - max(r[(mode, lo)] for r in per_rank)


def _shared_skew_scale(cluster: Cluster, world: int, per_rank: list) -> tuple:
    """(scale; the measured growth; the estimate's at scale 1): the level of the shared link's
    skew table on the synthetic stacks' own steps, the ``Link.skew_scale`` at which the cost
    model's growth of the stack's ``Plan(tp=True)`` step on ``Mesh(tp=world)`` from 2 to 8 blocks
    (``_stack_growth``) equals the growth the slowest rank measured (``per_rank``:
    ``_shared_step_probe``'s results), within [1/4, 2]. The stacks compute next to nothing
    between their collectives (their latencies come from the table's shortest points): the level
    at which ``_shared_sync_factor`` reads ZeRO-3's host work on the same stacks. The link
    itself does not take it (the models' steps, which compute between their collectives, read
    the table's longer points as measured: BENCHMARKS.md, run 91), only the stacks' reading at
    its shortest point (``_shared_skew_first``)."""
    measured = _measured_growth(per_rank, "tp")
    scale, one = _fit_growth(_stack_growth(cluster, world, "tp", "skew_scale"), measured, 0.25, 2.0)
    return scale, measured, one


def _shared_sync_factor(cluster: Cluster, world: int, per_rank: list, mode: str = _SHARED_MODE,
                        scale: float = 1.0) -> tuple:
    """(``Cluster.shared_sync``'s factor for ``mode``; the measured growth; the estimate's at
    factor 1): the factor at which the cost model's growth of the synthetic stack's step from 2
    to 8 blocks under ``mode`` on ``world`` ranks sharing cores (``_stack_growth``) equals the
    growth the slowest rank measured (``per_rank``: ``_shared_step_probe``'s results), within
    [1/8, 2]; 1 where nothing grows. The stacks' collectives priced at ``scale`` times the
    shared link's table (``_shared_skew_scale``: their own level, measured on their tp steps), so
    that what the table overprices them by is not read as host work."""
    measured = _measured_growth(per_rank, mode)
    if scale != 1.0:
        cluster = dataclasses.replace(cluster, shared=dataclasses.replace(cluster.shared, skew_scale=scale))
    factor, one = _fit_growth(_stack_growth(cluster, world, mode), measured, 0.125, 2.0)
    return factor, measured, one


def _shared_skew_first(cluster: Cluster, world: int, per_rank: list) -> tuple:
    """(factor; the measured growth; the estimate's at factor 1): the shared link's
    ``Link.skew_first``, the factor on its skew table's shortest compute point at which the cost
    model's growth of the synthetic stack's ``Plan(tp=True)`` step on ``Mesh(tp=world)`` from 2 to
    8 blocks (``_stack_growth``) equals the growth the slowest rank measured (``per_rank``:
    ``_shared_step_probe``'s results), within [1/8, 2]. The stacks compute next to nothing
    between their collectives, so their latencies come from the table at its shortest point
    and the interpolation to the next: the runtime's own reading of what the probe's matmuls
    measured there. The models' steps, which compute longer between their collectives, read the
    longer points as measured (BENCHMARKS.md, runs 91-95), and those stand."""
    measured = _measured_growth(per_rank, "tp")
    first, one = _fit_growth(_stack_growth(cluster, world, "tp", "skew_first"), measured, 0.125, 2.0)
    return first, measured, one


def _measure_sync_overhead(ranks: _Ranks, op_weights: tuple, op: float, ratio: float) -> tuple:
    """(((mode, seconds per parameter tensor), ...), seconds per tp collective, tp collectives
    added): the data-parallel runtime's host work per parameter tensor and step under each
    dp mode (flattening gradients into buckets, ZeRO's
    padded chunks and shard views, ZeRO-3's gathers laid out into parameters and its saved-tensor
    hooks, ZeRO-1/2's copy into the replicas after the step), on 2 processes: the growth of a
    compiled step's thread CPU time from the 2- to the 8-block synthetic stack, less what the
    cost model charges for that growth elsewhere (the added ops' dispatch in forward and
    backward, ``op`` seconds a weighed forward op and ``ratio`` times that a backward one, as
    ``cost.compute.weighed_ops`` weighs them by ``op_weights``; the plain AdamW step's measured growth), over the tensors
    added; the ranks' mean. The tensor-parallel runtime's host work per collective likewise,
    from the same stacks under ``Plan(tp=True)`` (``Device.collective_overhead``)."""
    per_rank = ranks(_sync_probe, _GLOO_WORLD, _SYNC_MODES, _SYNC_STEPS, timeout=180)
    lo, hi = _SYNC_BLOCKS
    stacks = [Profiles(_Stack(_SYNC_DIM, b), (torch.randn(_SYNC_ROWS, _SYNC_DIM),), blocks_once=False).base.groups
              for b in (lo, hi)]
    step = [sum(op * (weighed_ops(g.op_names, op_weights) + ratio * weighed_ops(g.op_names, op_weights, backward=True))
                for g in groups) for groups in stacks]
    added = (hi - lo) * _TENSORS_PER_BLOCK
    charged = step[1] - step[0]

    def growth(r, key):
        return r[(key, hi)] - r[(key, lo)]

    sync = tuple((mode, max(0.0, statistics.mean(growth(r, mode) - growth(r, "adam") for r in per_rank) - charged)
                  / added) for mode in _SYNC_MODES)
    # tp: the same growth less what the model charges elsewhere (the ops, the AdamW step and the
    # ddp-mode bookkeeping, which a tp-only mesh runs too), over the collectives added
    collectives = statistics.mean(growth(r, "tp collectives") for r in per_rank)
    tp = statistics.mean(growth(r, "tp") - growth(r, "adam") for r in per_rank) - charged - added * dict(sync)["ddp"]
    # what the added collectives block a rank for (its wall growth beyond its CPU growth), and
    # the CPU work a tp step does between two of them (its CPU growth over them): the level of
    # the skew table on the runtime's own steps (``Link.skew_scale``)
    n = max(1.0, collectives)
    blocked = statistics.mean((growth(r, "tp wall") - growth(r, "tp")) / n for r in per_rank)
    between = statistics.mean(growth(r, "tp") / n for r in per_rank)
    kinds = sorted({kind for (axis, kind, _) in per_rank[0][("tp kinds",)] if axis == "tp"})
    return sync, max(0.0, tp) / n, collectives, (max(0.0, blocked), between, kinds)


def _skew_scale(link: Link, blocked: float, between: float, kinds: list) -> tuple:
    """(``Link.skew_scale``, the table's latency it is taken against): ``blocked``, the seconds
    a collective of autopar's own tp steps blocks its rank (``_measure_sync_overhead``), over
    the mean of the skew table's latency of its ``kinds`` on 2-rank groups after ``between``
    seconds of CPU work (on a link with ``skew_pooled``, as the calibration's 2-process link
    is, every kind's is the kinds' pooled table); 1 where either is not measured (no
    blocking, or no table for those kinds)."""
    kinds = [kind for kind in kinds if any(k == kind and g == _GLOO_WORLD for k, g, _, _ in link.skew)]
    table = [collective_time(kind, 4, _GLOO_WORLD, link, after=between) for kind in kinds]
    table = statistics.mean(table) if table else 0.0
    if not (blocked > 0 and table > 0):
        return 1.0, table
    return blocked / table, table


def _slowdowns(alone: float, crowded: dict) -> tuple:
    """((processes, slowdown), ...): the synthetic stack's seconds per forward + backward with k
    processes looping at once (``crowded[k]``, per rank; ``_contention_probe``; or several such
    readings, whose median is kept), over the same
    loop alone, of the ranks' aggregate rate: the harmonic mean of the ranks' seconds per loop
    (k loops over the sum of their rates). Ranks of a training step wait for each other at every
    collective, so a rank the scheduler favoured for a while gives its core back to the others:
    the step goes at the ranks' shared throughput, not at the mean of their separate paces (one
    rank starved for the probe's 1.5 s moved the mean to 2.37 where the others read 2.16-2.18).
    Processes on a core of their own still share caches and memory; more than the cores
    time-share them, and pay for the switching on top of the fair share.

    Several readings, the median: one reading (of 1.5 s, before three of 0.5 s) falls on
    whatever else the machine runs then. One calibration read k=4 as 2.82 where those before
    and after it read 2.07-2.34, and the predictions of ranks sharing cores came out too slow
    by about as much (predicted again with 2.17, that run's world-4 mean error went from 13.1%
    to 11.1%; BENCHMARKS.md, hold-out run 34)."""
    return tuple((k, max(1.0, statistics.median(_reading(r, alone) for r in readings)
                      if isinstance(readings[0], (list, tuple)) else _reading(readings, alone)))
                 for k, readings in sorted(crowded.items()))


def _reading(per_rank: list, alone: float) -> float:
    """One contention reading: the ranks' seconds per loop, their harmonic mean over ``alone``."""
    return statistics.harmonic_mean(per_rank) / alone


def _cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, or the platform's word for it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def _total_ram() -> int:
    """Physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _measure_local() -> Cluster:
    """Measure this machine (about a minute) and describe it as a Cluster named "local"."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # the distributed tests run one compute thread per process
    cores = os.cpu_count() or 1
    # contention is measured with as many processes as cores and twice as many (at most 8)
    crowd = [k for k in sorted({cores, 2 * cores}) if 1 < k <= 8]
    loops, ranks = {}, _Ranks()
    shared = wake_runs = shared_steps = None
    try:
        # this process alone first, no other rank alive
        first_print = fingerprint()
        flops = _measure_matmul_flops()
        mem_bw = _measure_memory_bandwidth()
        step_overhead = _measure_step_overhead()
        pointwise = _measure_pointwise_efficiency(mem_bw)
        matmul = _measure_matmul_efficiency(flops)
        attention, attention_overhead = _measure_attention(flops)
        probe_mix = _probe_layer_ops()
        op_weights = measure_op_weights(probe_mix)
        alone = _stack_seconds(_CONTENTION_SECONDS)
        # then the probes on processes, grouped by world size: each pool starts once
        overhead, pass_overhead, ratio, share, message_overhead, split_pass, split_op, split_share, replays, tails = \
            _measure_op_overhead(ranks, op_weights)
        sync, collective_overhead, tp_added, tp_blocked = _measure_sync_overhead(ranks, op_weights, overhead, ratio)
        gloo, seconds, pipe_alone = _measure_gloo(ranks)
        for k in [k for k in crowd if k == _GLOO_WORLD] + [k for k in crowd if k != _GLOO_WORLD]:
            if k == 2 * cores:     # ranks sharing cores: the same gloo fit with twice as many, and the
                shared, _, _ = _measure_gloo(ranks, k)     # runtime's pipelines that fit their wake
                wake_runs = ranks(_op_overhead_probe, k, _WAKE_PIPELINES, timeout=240)
                shared_steps = ranks(_shared_step_probe, k, (_SHARED_MODE, "tp"), _SHARED_STEPS, timeout=240)
            loops[k] = [ranks(_contention_probe, k, _CONTENTION_READING_SECONDS, timeout=120)
                        for _ in range(_CONTENTION_READINGS)]
        ranks.close()
        # alone again, and the quicker of the two: a loop alone is only ever slowed by others
        alone = min(alone, _stack_seconds(_CONTENTION_SECONDS))
    finally:
        ranks.close()
        torch.set_num_threads(threads)
    contention = _slowdowns(alone, loops)
    synthetic_hop = _fit_hop(pipe_alone, _GLOO_WORLD, cores, contention)
    # the 2-process link's kinds share one table, at the level its tp steps read (``Link.skew_pooled``)
    gloo = dataclasses.replace(gloo, skew_pooled=True)
    skew_scale, skew_table = _skew_scale(gloo, *tp_blocked)
    gloo = dataclasses.replace(gloo, skew_scale=skew_scale, hop=_fit_runtime_hop(replays, cores, contention, ("1f1b",)),
                               hop_interleaved=_fit_runtime_hop(replays, cores, contention, ("interleaved",)),
                               tail=_fit_tail(tails, gloo))
    if shared is not None:
        shared = dataclasses.replace(shared, hop=gloo.hop, hop_interleaved=gloo.hop_interleaved, tail=gloo.tail,
                                     wake=_fit_runtime_wake(wake_runs, cores, contention, gloo.hop))
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    source = "\n".join([
        f"measured on {socket.gethostname()} at {when} by autopar.cost.calibration.calibrate_local "
        f"(torch {torch.__version__}, {os.cpu_count()} cpus)",
        f"peak_flops: fp32 matmuls n={list(_MATMUL_SIZES)} on 1 thread, best size's median rate "
        f"over ~{_MATMUL_SECONDS}s each; matmul_efficiency {matmul:.2f}: the forward and backward products "
        f"of linear layers (m, k, n) in {list(_LINEAR_SHAPES)}, each call's operands from the next copy of a "
        f"{_POOL_BYTES >> 20} MiB pool (read from memory, not a hot cache), FLOPs / summed median times / peak",
        f"attention: causal SDPA forward + backward on (slices, s, d) in {list(_ATTENTION_SHAPES)}, "
        f"inputs from a pool likewise, time = 3(4*B*s^2*d / rate + B*overhead): attention_efficiency {attention:.2f}, "
        f"attention_overhead {attention_overhead * 1e6:.2f} us per slice",
        f"mem_bandwidth: copy_ of {_COPY_BYTES >> 20} MiB fp32 on 1 thread, (read + write) / median time; "
        f"memory_efficiency {pointwise:.2f}: GeLU, LayerNorm, softmax and add on 512x256 fp32 from a pool likewise, "
        "bytes / summed median times / that",
        f"gloo-tcp: dist.all_reduce fp32 on {_GLOO_WORLD} processes (1 thread each), "
        f"{_GLOO_SIZES[0] >> 10} KiB..{_GLOO_SIZES[-1] >> 20} MiB by 4x, median of {_GLOO_REPS} after "
        f"{_GLOO_WARMUP} warm-ups, each after ~1 ms of matmuls on every rank (its excess over the same "
        "compute timed with every rank at once), slowest rank; "
        "1/time-weighted least squares of "
        "time = alpha + bytes_moved/bandwidth, bytes_moved = 2(N-1)/N * size (each kind likewise; an alpha "
        "fitted below zero: the three smallest messages' median excess over bytes_moved/bandwidth); "
        f"times {[float(f'{s:.3g}') for s in seconds]} s; its skew: each kind's latency after "
        f"{[t * 1e3 for t in _SKEW_COMPUTE]} ms of compute on every rank, round after round with no barrier "
        f"(excess over the same compute alone, the median of {_SKEW_BLOCKS} blocks of rounds), which a step's "
        "collectives take as their alpha",
        "memory_bytes: physical RAM; gpus_per_node: os.cpu_count(); host link: mem_bandwidth, 1e-7 s",
        f"op_overhead, pass_overhead: CPU time of the F and B actions per micro-batch of 2-stage 1F1B "
        f"pipelines (4 micro-batches) of GPTs of h=8 with 2 and 10 layers compiled by autopar, on 2 "
        f"processes, stepped in turn, the F actions fitted as pass + ops x op (each op weighed by op_weights), "
        f"the B actions likewise: "
        f"{overhead * 1e6:.1f} us per op forward, backward_op_ratio {ratio:.2f} x that per op backward, "
        f"{pass_overhead * 1e6:.0f} us per stage pass (backward_pass_share {share:.2f}); message_overhead: a transfer's CPU "
        f"time posted in its batch, {message_overhead * 1e6:.0f} us; step_overhead: AdamW.step over 48 tensors of 64x64 / 48: "
        f"{step_overhead * 1e6:.1f} us; split_pass_overhead, split_op_overhead: the same pipelines under the "
        f"zero-bubble schedule, F + B + W time per micro-batch over 1F1B's F + B, fitted as pass + matmuls x "
        f"per-matmul (those with a parameter weight): "
        f"{split_pass * 1e6:.0f} us per W action, {split_op * 1e6:.1f} us per matmul; split_forward_share: the F "
        f"actions' growth over that, summed over the pipelines' ranks: {split_share:.2f}",
        f"op_weights: each of {len(SAMPLES)} ops timed alone on {'x'.join(map(str, _OP_WEIGHT_SHAPE))} fp32 "
        f"(1 thread), chains of 24 less 4 forward and backward, each chain's fastest of rounds through all in turn, over the "
        f"mean of a probe layer's ops (h=8: {sum(probe_mix.values())} ops): "
        + ", ".join(f"{n} {f:.2f}/{b:.2f}" for n, f, b in op_weights) + ",",
        f"sync_overhead: thread CPU time of training steps of a synthetic stack (blocks of 2 x (LayerNorm, "
        f"Linear d->2d, GeLU, Linear 2d->d), {_TENSORS_PER_BLOCK} tensors a block, d={_SYNC_DIM}) of "
        f"{' and '.join(map(str, _SYNC_BLOCKS))} blocks compiled on dp={_GLOO_WORLD} under each mode, "
        f"timed round-robin; the growth with the blocks less the added ops at op_overhead and a plain "
        f"AdamW step's growth, per added tensor: "
        + ", ".join(f"{m} {v * 1e6:.1f} us" for m, v in sync),
        f"collective_overhead: the same stacks on Mesh(tp={_GLOO_WORLD}) under Plan(tp=True), their growth "
        f"less the added ops, AdamW's growth and the ddp bookkeeping, over the {tp_added:.0f} runtime "
        f"collectives added (as the module counts them): {collective_overhead * 1e6:.1f} us per collective; "
        f"skew_scale {skew_scale:.2f}: the same tp steps' wall growth beyond their CPU growth, per added collective "
        f"({tp_blocked[0] * 1e6:.0f} us, each step after a barrier), over the skew table's latency "
        f"after their CPU growth per collective ({tp_blocked[1] * 1e6:.0f} us; the kinds' tables pooled, the mean of "
        f"all-reduce, all-gather and reduce-scatter at each compute length, which every kind of this link takes): "
        f"{skew_table * 1e6:.0f} us",
        "shared: the same gloo fit with 2 x cpu count processes (ranks sharing cores); its skew: each kind's "
        f"latency after {[t * 1e3 for t in _SKEW_COMPUTE]} ms of compute on every rank, round after round "
        "(excess over the same compute alone)" if shared else "",
        f"hop: the message latency at which the model's replay of autopar's own 2-stage 1F1B pipelines "
        f"(4 micro-batches, GPTs of h=16 with {' and '.join(str(x[0]) for x in _HOP_PIPELINES if x[1] == '1f1b')} "
        f"layers, run with the op_overhead probe; each stage's measured F and B action CPU times plus a message's, "
        f"the contention of 2 ranks; a send moving once its receive is posted) lasts their measured schedules "
        f"(each the mean of its steps), "
        f"the median: {gloo.hop * 1e3:.2f} ms on "
        f"{_GLOO_WORLD} processes; hop_interleaved: the same for the interleaved schedule (2 stages a rank, GPTs "
        f"of h=16 with {' and '.join(str(x[0]) for x in _HOP_PIPELINES if x[1] == 'interleaved')} layers): "
        f"{gloo.hop_interleaved * 1e3:.2f} ms "
        f"(a synthetic pipeline of bare matmuls, {_PIPE_M} micro-batches of {_PIPE_F * 1e3:g} / {_PIPE_B * 1e3:g} ms, "
        f"receives posted before the step, fits {synthetic_hop * 1e3:.2f} ms)"
        + (f"; on {2 * cores} (shared) that hop, and a woken rank's wait for a core when all are taken, "
           f"fitted at that hop on the replays of autopar's own {2 * cores}-stage 1F1B pipelines on {2 * cores} "
           f"processes (4 micro-batches, GPTs of h=16 with "
           f"{' and '.join(str(x[0]) for x in _WAKE_PIPELINES)} layers; each stage's measured action CPU times, "
           f"the median): wake {shared.wake * 1e3:.2f} ms" if shared else ""),
        f"tail: the 1F1B probe pipelines (those of hop, and GPTs of (layers, h, tokens) "
        f"{', '.join(str((x[0], x[2], x[3])) for x in _TAIL_PIPELINES)}), each step's last rank to end its "
        f"schedule, its wall time from then to train_step's return less the estimate's p2p time of those "
        f"exchanges, fitted as a + b x how long the other rank waited (means over steps): "
        + (f"a {gloo.tail[0] * 1e3:.2f} ms, b {gloo.tail[1]:.3f}" if gloo.tail else "none")
        + f" (points: " + ", ".join(f"{w * 1e3:.2f} ms waited, {t * 1e3:.2f} ms past" for _, w, t in tails) + ")"
        + ("; the same on the shared link" if shared else ""),
        f"overlap_loss: a 1 MiB all-reduce issued asynchronously before ~2 ms of matmuls and waited on after, "
        f"against each alone, every rank at once, {_OVERLAP_REPS} rounds in turn, slowest rank; median over rounds "
        f"of (both - longer) / shorter: {gloo.overlap_loss:.2f} on {_GLOO_WORLD} processes"
        + (f"; {shared.overlap_loss:.2f} on {2 * cores} (ranks sharing cores)" if shared else "")
        + "; charged against the time some communication lane was busy",
        f"contention: forward + backward of the synthetic stack ({_STACK_BLOCKS} blocks, d={_STACK_DIM}, "
        f"{_STACK_ROWS} rows, 1 thread) with k "
        f"processes looping at once, the ranks' harmonic mean / alone, the median of {_CONTENTION_READINGS} readings of {_CONTENTION_READING_SECONDS} s: "
        + ", ".join(f"k={k}: {f:.2f} ({', '.join(f'{_reading(r, alone):.2f}' for r in loops[k])})" for k, f in contention),
    ]).strip()
    device = Device(name=f"cpu ({_cpu_model()})", peak_flops=flops, mem_bandwidth=mem_bw,
                    memory_bytes=_total_ram(), matmul_efficiency=matmul, memory_efficiency=pointwise,
                    op_overhead=overhead, step_overhead=step_overhead,
                    attention_efficiency=attention, attention_overhead=attention_overhead,
                    pass_overhead=pass_overhead, backward_op_ratio=ratio, backward_pass_share=share,
                    message_overhead=message_overhead, sync_overhead=sync,
                    split_pass_overhead=split_pass, split_op_overhead=split_op, split_forward_share=split_share,
                    collective_overhead=collective_overhead, op_weights=op_weights)
    # the reference workload timed at the start and at the end, each part's mean (cost.drift)
    last_print = dict(fingerprint())
    prints = tuple((part, (s + last_print[part]) / 2) for part, s in first_print)
    source += ("\nfingerprint (cost.drift, checked when the preset is read): per tiny add "
               f"{prints[0][1] * 1e6:.2f} us, per 256x256 matmul {prints[1][1] * 1e3:.3f} ms, "
               "the mean of its timings before and after the probes")
    cluster = Cluster(name="local", device=device, gpus_per_node=os.cpu_count() or 1, intra=gloo,
                      inter=gloo, host=Link("host-memory", mem_bw, 1e-7), source=source,
                      shared=shared, contention=contention, fingerprint=prints)
    if shared is not None and shared_steps is not None:
        # the synthetic stacks' own steps on ranks sharing cores: ZeRO-3's host work, read with
        # the stacks' collectives at the level their tp steps read (next to no compute between
        # collectives), and the shared link's shortest skew point, read on the same tp steps
        scale, tp_measured, tp_one = _shared_skew_scale(cluster, 2 * cores, shared_steps)
        factor, measured, at_one = _shared_sync_factor(cluster, 2 * cores, shared_steps, scale=scale)
        first, _, first_one = _shared_skew_first(cluster, 2 * cores, shared_steps)
        cluster = dataclasses.replace(
            cluster, shared=dataclasses.replace(cluster.shared, skew_first=first),
            shared_sync=((_SHARED_MODE, factor),),
            source=cluster.source + (
                f"\nshared_sync: {_SHARED_MODE} {factor:.2f}: its host work per tensor on {2 * cores} processes "
                f"sharing cores, over its charge at their contention: the factor at which the model's step of the "
                f"synthetic stack (d={_SYNC_DIM}, {_SYNC_ROWS} rows a rank) on Mesh(dp={2 * cores}) under "
                f"Plan(dp={_SHARED_MODE!r}) grows from {' to '.join(map(str, _SYNC_BLOCKS))} blocks as the slowest "
                f"rank's measured step grew (the median of {_SHARED_STEPS} rounds, each step after a barrier): "
                f"{measured * 1e3:.1f} ms measured, {at_one * 1e3:.1f} ms at factor 1; the stacks' collectives at "
                f"{scale:.2f} x the shared link's skew table, the scale at which the model's Plan(tp=True) step of "
                f"the same stacks on Mesh(tp={2 * cores}) grows as measured in the same rounds "
                f"({tp_measured * 1e3:.1f} ms measured, {tp_one * 1e3:.1f} ms at scale 1)"
                f"\nshared skew_first {first:.2f}: the factor on the shared link's skew table at its shortest compute "
                f"point (every kind but p2p) at which the same tp steps grow as measured ({first_one * 1e3:.1f} ms "
                f"at factor 1); the longer points as measured"))
    return cluster



def calibrate_local(*, force: bool = False, cache_path: str | None = None) -> Cluster:
    """This machine as a Cluster named "local": read from the cache (``autopar.cost.cache``;
    ``cache_path`` overrides where) unless ``force``, else measured now by the probes of this
    module (about a minute; see the returned Cluster's ``source`` for each number's method)
    and stored there."""
    if not force:
        cached = cached_local(cache_path)
        if cached is not None:
            return cached
    cluster = _measure_local()
    cache.store_local(dataclasses.asdict(cluster), cache_path)
    return cluster
