"""The calibration's fits of the host's work: pure functions of the probes' results
(``runtime_probes``, ``compute_probes``), no process started. Framework time per op, stage
pass, message and zero-bubble W action (``fit_op_overhead``), the data-parallel and
tensor-parallel runtime's host work (``fit_sync_overhead``), the compute slowdown of ranks
sharing cores (``slowdowns``), and, on those ranks, the level of the shared link's skew table
and ZeRO-3's host work at which the cost model's step of the synthetic stack grows with its
blocks as the measured one did (``shared_skew_scale``, ``shared_skew_first``,
``shared_sync_factor``)."""
from __future__ import annotations

import dataclasses
import statistics
from typing import Callable

import torch

from autopar.planspec import Plan

from ..cluster import Cluster
from ..compute import weighed_ops
from ..estimate import Profiles, evaluate_plan
from .link_fits import fit_line, replays, tails
from .runtime_probes import SYNC_MODES
from .stack import SYNC_BLOCKS, SYNC_DIM, SYNC_ROWS, TENSORS_PER_BLOCK, Stack

__all__ = ["fit_op_overhead", "fit_sync_overhead", "slowdowns", "reading", "stack_growth", "fit_growth",
           "measured_growth", "shared_skew_scale", "shared_sync_factor", "shared_skew_first", "SHARED_MODE"]

SHARED_MODE = "zero3"     # the dp mode whose host work on ranks sharing cores is fitted (Cluster.shared_sync)


def fit_op_overhead(pipelines: tuple, per_rank: list, op_weights: tuple) -> tuple:
    """Framework time as autopar's compiled modules run them, from ``op_overhead_probe``'s
    results for ``pipelines`` on 2 processes (a list per rank): (seconds per forward op, seconds
    per stage pass, backward's per-op time over the forward's, backward's share of the pass,
    seconds per message, a zero-bubble W action's seconds per pass and per matmul with a
    parameter weight, the part of those the F actions take, ``replays``, ``tails``).

    The probe's GPTs are of negligible arithmetic (autopar.models.TinyGPT, h = 8, 2 x 8 tokens),
    of 2 and of 10 layers, each compiled as a two-stage 1F1B pipeline of 4 micro-batches. The
    thread CPU time of each rank's forward actions, against the ops the cost model's profile
    counts in its stage (each weighed by ``op_weights``, the measured ``Device.op_weights``:
    ``cost.compute.weighed_ops``), is fitted as pass + ops x per-op, and its backward actions'
    likewise (against the ops' backward weights): the per-op slopes are the dispatch (the FX
    module's Python and the aten ops; backward runs each forward op's gradients, not twice its
    cost: about 1.2x the forward's on the machine of BENCHMARKS.md), the constants what a stage
    does per micro-batch besides its ops (its call, the runtime's autograd functions and hooks).
    (A fit that makes no sense on a noisy machine falls back to pass + 3 x ops x per-op over
    F + B, split as the arithmetic is.) The CPU time of posting a batch of transfers, per
    transfer in it, is the per-message cost. The same pipelines under the zero-bubble schedule:
    the growth of the F, B and W actions' time per micro-batch over 1F1B's, fitted as pass +
    matmuls x per-matmul (the matmuls with a parameter weight, whose weight gradients W defers),
    is what splitting out the W action costs, and the F actions' part of that growth its forward
    share (each matmul whose weight gradient W defers runs through an autograd function of its
    own in the forward too). These four pipelines, the ``HOP_PIPELINES`` and the
    ``TAIL_PIPELINES`` are stepped in turn in one job. Last, per hop pipeline, what its replay
    needs (``fit_runtime_hop``, ``replays``): each stage's median F, B and W action and message
    CPU times, and the step's schedule as the slowest rank timed it; and per 1F1B hop or tail
    pipeline what ``fit_tail`` fits (``tails``)."""
    points, forward, backward, messages, split, split_forward = [], [], [], [], [], []
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
    replayed = replays(pipelines, per_rank)
    (op_f, pass_f), (op_b, pass_b) = fit_line(forward), fit_line(backward)
    if op_f > 0 and op_b > 0 and pass_f >= 0 and pass_b >= 0 and pass_f + pass_b > 0:
        per_op, ratio, per_pass, share = op_f, op_b / op_f, pass_f + pass_b, pass_b / (pass_f + pass_b)
    else:                # a nonsense fit (a noisy machine): F + B together, split as the arithmetic is
        per_op, per_pass = fit_line(points)
        ratio, share = 2.0, 2 / 3
        if per_op <= 0:  # everything per op
            per_op, per_pass = sum(y for _, y in points) / sum(x for x, _ in points), 0.0
    split_op, split_pass = fit_line(split)
    if split_op <= 0:
        split_op, split_pass = max(0.0, sum(y for _, y in split) / sum(x for x, _ in split)), 0.0
    grown = sum(y for _, y in split)
    split_share = min(1.0, max(0.0, sum(split_forward) / grown)) if grown > 0 else 0.0
    return (per_op, max(per_pass, 0.0), ratio, share, statistics.median(messages), max(split_pass, 0.0), split_op,
            split_share, replayed, tails(pipelines, per_rank))


def fit_sync_overhead(per_rank: list, op_weights: tuple, op: float, ratio: float) -> tuple:
    """From ``sync_probe``'s results on 2 processes (one dict per rank): (((mode, seconds per
    parameter tensor), ...), seconds per tp collective, tp collectives added, (seconds a tp
    collective blocks its rank, CPU seconds between two, their kinds)): the data-parallel runtime's host work per parameter tensor and step under each
    dp mode (flattening gradients into buckets, ZeRO's
    padded chunks and shard views, ZeRO-3's gathers laid out into parameters and its saved-tensor
    hooks, ZeRO-1/2's copy into the replicas after the step), on 2 processes: the growth of a
    compiled step's thread CPU time from the 2- to the 8-block synthetic stack, less what the
    cost model charges for that growth elsewhere (the added ops' dispatch in forward and
    backward, ``op`` seconds a weighed forward op and ``ratio`` times that a backward one, as
    ``cost.compute.weighed_ops`` weighs them by ``op_weights``; the plain AdamW step's measured growth), over the tensors
    added; the ranks' mean. The tensor-parallel runtime's host work per collective likewise,
    from the same stacks under ``Plan(tp=True)`` (``Device.collective_overhead``)."""
    lo, hi = SYNC_BLOCKS
    stacks = [Profiles(Stack(SYNC_DIM, b), (torch.randn(SYNC_ROWS, SYNC_DIM),), blocks_once=False).base.groups
              for b in (lo, hi)]
    step = [sum(op * (weighed_ops(g.op_names, op_weights) + ratio * weighed_ops(g.op_names, op_weights, backward=True))
                for g in groups) for groups in stacks]
    added = (hi - lo) * TENSORS_PER_BLOCK
    charged = step[1] - step[0]

    def growth(r, key):
        return r[(key, hi)] - r[(key, lo)]

    sync = tuple((mode, max(0.0, statistics.mean(growth(r, mode) - growth(r, "adam") for r in per_rank) - charged)
                  / added) for mode in SYNC_MODES)
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


def slowdowns(alone: float, crowded: dict) -> tuple:
    """((processes, slowdown), ...): the synthetic stack's seconds per forward + backward with k
    processes looping at once (``crowded[k]``, per rank; ``contention_probe``; or several such
    readings, whose median is kept), over the same loop alone, of the ranks' aggregate rate:
    the harmonic mean of the ranks' seconds per loop (k loops over the sum of their rates). Ranks of a training step wait for each other at every
    collective, so a rank the scheduler favoured for a while gives its core back to the others:
    the step goes at the ranks' shared throughput, not at the mean of their separate paces (one
    rank starved for the probe's 1.5 s moved the mean to 2.37 where the others read 2.16-2.18).
    Processes on a core of their own still share caches and memory; more than the cores
    time-share them, and pay for the switching on top of the fair share.

    Several readings, the median: a single reading falls on whatever else the machine runs
    then. A single reading of 1.5 s once read k=4 as 2.82 where the calibrations around it read
    2.07-2.34, and the predictions of ranks sharing cores came out too slow by about as much
    (predicted again with 2.17, the hold-out grid's world-4 mean error goes from 13.1% to
    11.1%: benchmarks/bench_holdout.py --repredict; BENCHMARKS.md, bench_holdout.py)."""
    return tuple((k, max(1.0, statistics.median(reading(r, alone) for r in readings)
                      if isinstance(readings[0], (list, tuple)) else reading(readings, alone)))
                 for k, readings in sorted(crowded.items()))


def reading(per_rank: list, alone: float) -> float:
    """One contention reading: the ranks' seconds per loop, their harmonic mean over ``alone``."""
    return statistics.harmonic_mean(per_rank) / alone


def stack_growth(cluster: Cluster, world: int, mode: str, vary: str = "shared_sync") -> Callable[[float], float]:
    """x -> the cost model's growth of a step of the synthetic stack from the 2- to the 8-block
    stack on ``world`` ranks of ``cluster`` sharing cores, compiled on the dp axis under ``mode``
    (``"tp"``: on the tp axis, ``Plan(tp=True)``), with ``vary`` at x: ``"shared_sync"``, that
    mode's ``Cluster.shared_sync``; ``"skew_scale"`` or ``"skew_first"``, that field of the shared
    link."""
    lo, hi = SYNC_BLOCKS
    profiles = {b: Profiles(Stack(SYNC_DIM, b), (torch.randn(SYNC_ROWS, SYNC_DIM),), blocks_once=False)
                for b in (lo, hi)}
    axes, plan = ({"tp": world}, Plan(tp=True)) if mode == "tp" else ({"dp": world}, Plan(dp=mode))

    def growth(x: float) -> float:
        if vary in ("skew_scale", "skew_first"):
            c = dataclasses.replace(cluster, shared=dataclasses.replace(cluster.shared, **{vary: x}))
        else:
            c = dataclasses.replace(cluster, shared_sync=((mode, x),))
        return (evaluate_plan(profiles[hi], axes, plan, c, SYNC_ROWS * world).step_time_s
                - evaluate_plan(profiles[lo], axes, plan, c, SYNC_ROWS * world).step_time_s)

    return growth


def fit_growth(growth, measured: float, low: float, high: float) -> tuple:
    """(x, the estimate's growth at 1): the x at which ``growth`` (linear in x: what x scales lies
    on the step's path) equals ``measured``, by the line through x = 1/2 and 1, within [low,
    high]; 1 where nothing grows or the estimate does not grow with x."""
    half, one = growth(0.5), growth(1.0)
    if measured <= 0 or one <= half:
        return 1.0, one
    return min(high, max(low, 1.0 + (measured - one) * 0.5 / (one - half))), one


def measured_growth(per_rank: list, mode: str) -> float:
    """The slowest rank's step growth from the 2- to the 8-block stack under ``mode``
    (``shared_step_probe``'s results, one dict per rank)."""
    lo, hi = SYNC_BLOCKS
    return max(r[(mode, hi)] for r in per_rank) - max(r[(mode, lo)] for r in per_rank)


def shared_skew_scale(cluster: Cluster, world: int, per_rank: list) -> tuple:
    """(scale; the measured growth; the estimate's at scale 1): the level of the shared link's
    skew table on the synthetic stacks' own steps, the ``Link.skew_scale`` at which the cost
    model's growth of the stack's ``Plan(tp=True)`` step on ``Mesh(tp=world)`` from 2 to 8 blocks
    (``stack_growth``) equals the growth the slowest rank measured (``per_rank``:
    ``shared_step_probe``'s results), within [1/4, 2]. The stacks compute next to nothing
    between their collectives (their latencies come from the table's shortest points): the level
    at which ``shared_sync_factor`` reads ZeRO-3's host work on the same stacks. The link
    itself does not take it (the models' steps, which compute between their collectives, read
    the table's longer points as measured: BENCHMARKS.md, bench_holdout.py), only the stacks' reading at
    its shortest point (``shared_skew_first``)."""
    measured = measured_growth(per_rank, "tp")
    scale, one = fit_growth(stack_growth(cluster, world, "tp", "skew_scale"), measured, 0.25, 2.0)
    return scale, measured, one


def shared_sync_factor(cluster: Cluster, world: int, per_rank: list, mode: str = SHARED_MODE,
                        scale: float = 1.0) -> tuple:
    """(``Cluster.shared_sync``'s factor for ``mode``; the measured growth; the estimate's at
    factor 1): the factor at which the cost model's growth of the synthetic stack's step from 2
    to 8 blocks under ``mode`` on ``world`` ranks sharing cores (``stack_growth``) equals the
    growth the slowest rank measured (``per_rank``: ``shared_step_probe``'s results), within
    [1/8, 2]; 1 where nothing grows. The stacks' collectives priced at ``scale`` times the
    shared link's table (``shared_skew_scale``: their own level, measured on their tp steps), so
    that what the table overprices them by is not read as host work."""
    measured = measured_growth(per_rank, mode)
    if scale != 1.0:
        cluster = dataclasses.replace(cluster, shared=dataclasses.replace(cluster.shared, skew_scale=scale))
    factor, one = fit_growth(stack_growth(cluster, world, mode), measured, 0.125, 2.0)
    return factor, measured, one


def shared_skew_first(cluster: Cluster, world: int, per_rank: list) -> tuple:
    """(factor; the measured growth; the estimate's at factor 1): the shared link's
    ``Link.skew_first``, the factor on its skew table's shortest compute point at which the cost
    model's growth of the synthetic stack's ``Plan(tp=True)`` step on ``Mesh(tp=world)`` from 2 to
    8 blocks (``stack_growth``) equals the growth the slowest rank measured (``per_rank``:
    ``shared_step_probe``'s results), within [1/8, 2]. The stacks compute next to nothing
    between their collectives, so their latencies come from the table at its shortest point
    and the interpolation to the next: the runtime's own reading of what the probe's matmuls
    measured there. The models' steps, which compute longer between their collectives, read the
    longer points as measured (BENCHMARKS.md, bench_holdout.py), and those stand."""
    measured = measured_growth(per_rank, "tp")
    first, one = fit_growth(stack_growth(cluster, world, "tp", "skew_first"), measured, 0.125, 2.0)
    return first, measured, one
