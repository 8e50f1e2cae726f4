"""The calibration's communication probes, run on every rank of a pool of gloo processes: each
collective kind's time by message size (``gloo_probe``), a small exchange's latency among
ranks that compute between exchanges (``exchange_probe``), a collective overlapped with
compute (``overlap_probe``) and a synthetic two-stage pipeline (``pipeline_probe``), all in
one job (``probe_all``). What is fitted to them is ``link_fits``'."""
from __future__ import annotations

import math
import statistics
import time
import warnings

import torch
import torch.distributed as dist

from autopar.schedule import build_schedule, lower

from .compute_probes import timed_median

__all__ = ["probe_all", "gloo_probe", "exchange_probe", "overlap_probe", "pipeline_probe", "collective_call",
           "excess_per_round", "about_a_millisecond", "GLOO_SIZES", "GLOO_WARMUP", "GLOO_REPS", "GLOO_WORLD",
           "SKEW_COMPUTE", "SKEW_BLOCKS", "KINDS", "OVERLAP_BYTES", "OVERLAP_REPS", "PIPE_M", "PIPE_F", "PIPE_B"]

GLOO_SIZES = tuple(4096 * 4**k for k in range(6))    # 4 KiB .. 4 MiB, 4x apart
GLOO_WARMUP = 3
GLOO_REPS = 9
GLOO_WORLD = 2                        # processes of the gloo fit, the synthetic pipeline and the dp runtime probe
SKEW_COMPUTE = (2e-4, 1e-3, 4e-3)     # compute seconds before a collective, for Link.skew
SKEW_BLOCKS = 7                       # blocks of rounds per skew point, their median taken
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
OVERLAP_BYTES, OVERLAP_REPS = 1 << 20, 31    # the overlap probe's all-reduce, and its rounds
PIPE_M, PIPE_F, PIPE_B = 4, 6e-4, 1.2e-3      # the synthetic pipeline: micro-batches, F and B seconds


def collective_call(kind: str, x, part, group, first: int):
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


def gloo_probe(sizes: tuple[int, ...], warmup: int, reps: int, kind: str = "all_reduce",
                group_size: int | None = None, busy: bool = False) -> list[float]:
    """Run on every rank (a job of ``Ranks``' pool): median seconds of an fp32 ``kind``
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
    work = about_a_millisecond(a) if busy else 0
    ops = [collective_call(kind, torch.ones(nbytes // 4), torch.empty(nbytes // 4 // n), group, first)
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


def excess_per_round(compute, exchange, rounds: int, blocks: int = 3) -> float:
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


_MS_WORK: dict = {}     # this process's (world size, shape) -> about_a_millisecond's count


def about_a_millisecond(a) -> int:
    """Matmuls of ``a`` that take about 1 ms on a core of one's own (timed alone, in turn; once
    per process: every rank of a pool runs the same probes, so all skip it alike)."""
    key = (dist.get_world_size(), tuple(a.shape))
    if key not in _MS_WORK:
        work = 1
        for r in range(dist.get_world_size()):
            if r == dist.get_rank():
                work = math.ceil(1e-3 / timed_median(lambda: a @ a, 0.01))
            dist.barrier()
        _MS_WORK[key] = work
    return _MS_WORK[key]


def exchange_probe(kind: str, group_size: int, compute_s: float) -> float:
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
    work = max(1, round(about_a_millisecond(a) * compute_s / 1e-3))
    x, part = torch.ones(1024), torch.empty(1024 // g)

    def compute():
        for _ in range(work):
            a @ a

    op = collective_call(kind, x, part, group, first)

    def exchange(i):
        compute()
        op()

    # 7 blocks, not 3: the step's collectives take these as their latency, and with 3 the same
    # machine's points moved by 1.7-2x on average (up to 4x) between calibrations (measured by
    # benchmarks/bench_holdout.py; BENCHMARKS.md, bench_holdout.py)
    excess = excess_per_round(compute, exchange, max(6, round(24 * (1e-3 / compute_s) ** 0.5)), blocks=SKEW_BLOCKS)
    return excess / 2 if kind == "p2p" else excess      # p2p: per message of the round trip


def probe_all(sizes: tuple[int, ...], warmup: int, reps: int) -> dict:
    """Every kind's medians, for groups of 2 and of the whole world (all groups at once), and
    each kind's latency after each compute length of SKEW_COMPUTE, round after round with no
    barrier between (``exchange_probe``: what a training step's collectives see, about twice
    the barrier-aligned call's latency on 2 processes of this machine); in one spawn."""

    # the tensor collectives' old names still run gloo's kernels; their deprecation notice is
    # no news to a user calibrating
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    world = dist.get_world_size()
    groups = sorted({2, world})
    out = {(kind, g): gloo_probe(sizes, warmup, reps, kind, g, busy=True) for kind in KINDS for g in groups
           if not (kind == "p2p" and g != 2)}
    for kind in KINDS:     # every world: a training step's collectives follow compute, unaligned
        for g in ([2] if kind == "p2p" else groups):
            for t in SKEW_COMPUTE:
                out[("skew", kind, g, t)] = exchange_probe(kind, g, t)
    if world == GLOO_WORLD:     # the synthetic pipeline fits the hop of a core per rank only
        out[("pipeline",)] = pipeline_probe()
    out[("overlap",)] = overlap_probe()
    return out


def overlap_probe() -> tuple:
    """(compute alone, collective alone, the two overlapped) seconds of each round, every rank at once:
    about 2 ms of matmuls; a 1 MiB all-reduce; the all-reduce issued asynchronously, the same
    matmuls, then its wait (as the overlap pass issues gradient buckets and ZeRO-3's prefetch).
    Timed in turn, round after round, a barrier before each."""
    torch.set_num_threads(1)
    a = torch.randn(160, 160)
    work = 2 * about_a_millisecond(a)
    x = torch.ones(OVERLAP_BYTES // 4)

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
    for _ in range(OVERLAP_REPS):
        for i, f in enumerate(variants):
            dist.barrier()
            t0 = time.perf_counter()
            f()
            times[i].append(time.perf_counter() - t0)
    return tuple(times)


def pipeline_probe(steps: int = 12) -> float:
    """Run on every rank: seconds per step of a synthetic two-stage 1F1B pipeline (stage =
    rank // (world / 2), its peer the same replica of the other stage), PIPE_M micro-batches
    whose F and B are PIPE_F and PIPE_B seconds of matmuls on a core of one's own; each step's
    receives posted up front and 16 KiB messages sent as each action ends, as autopar's pipeline
    runtime does. The mean over ``steps`` (after a barrier each), as ``op_overhead_probe``
    takes its schedules'."""
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    half = world // 2
    stage, replica = rank // half, rank % half
    peer = (1 - stage) * half + replica
    a = torch.randn(160, 160)
    per_ms = about_a_millisecond(a)
    work = {"F": max(1, round(per_ms * PIPE_F * 1e3)), "B": max(1, round(per_ms * PIPE_B * 1e3))}
    program = lower(build_schedule("1f1b", 2, PIPE_M))[stage]
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
