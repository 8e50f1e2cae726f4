"""The local preset: this machine measured for the cost model (about a minute), then cached.

``calibrate_local`` runs the probes (``compute_probes`` in this process; ``comm_probes``,
``runtime_probes`` and the contention probe on several gloo processes of a ``Ranks`` pool,
some compiling small models with ``autopar.compile``), fits the preset's numbers to their
results (``link_fits``, ``host_fits``, ``op_weights``), builds a Cluster named "local" whose
``source`` says what was measured and how, and stores it in the cache
(``autopar.cost.cache``) that ``get_cluster("local")`` reads. The calibration is the only
part of the cost model that runs processes (``ranks``).
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import socket

import torch

from .. import cache
from ..cluster import Cluster, Device, Link, cached_local
from ..drift import fingerprint
from .comm_probes import (GLOO_REPS, GLOO_SIZES, GLOO_WARMUP, GLOO_WORLD, OVERLAP_REPS, PIPE_B, PIPE_F, PIPE_M,
                          SKEW_BLOCKS, SKEW_COMPUTE, probe_all)
from .compute_probes import (ATTENTION_SHAPES, CONTENTION_READING_SECONDS, CONTENTION_READINGS, CONTENTION_SECONDS,
                             COPY_BYTES, LINEAR_SHAPES, MATMUL_SECONDS, MATMUL_SIZES, POOL_BYTES, contention_probe,
                             cpu_model, measure_attention, measure_matmul_efficiency, measure_matmul_flops,
                             measure_memory_bandwidth, measure_pointwise_efficiency, measure_step_overhead, total_ram)
from .host_fits import (SHARED_MODE, fit_op_overhead, fit_sync_overhead, reading, shared_skew_first,
                        shared_skew_scale, shared_sync_factor, slowdowns)
from .link_fits import fit_hop, fit_runtime_hop, fit_runtime_wake, fit_tail, gloo_link, skew_scale
from .op_weights import SAMPLES, SHAPE as OP_WEIGHT_SHAPE, measure_op_weights
from .ranks import Ranks
from .runtime_probes import (HOP_PIPELINES, OP_PIPELINES, SHARED_STEPS, SYNC_MODES, SYNC_STEPS, TAIL_PIPELINES,
                             WAKE_PIPELINES, op_overhead_probe, probe_layer_ops, shared_step_probe, sync_probe)
from .stack import (STACK_BLOCKS, STACK_DIM, STACK_ROWS, SYNC_BLOCKS, SYNC_DIM, SYNC_ROWS, TENSORS_PER_BLOCK,
                    stack_seconds)

__all__ = ["calibrate_local"]


@dataclasses.dataclass
class Readings:
    """What the probes read on this machine and what is fitted to it, filled in step by step
    by ``_measure_local``: the numbers of the preset and of its ``source``."""
    cores: int
    first_print: tuple = ()                  # cost.drift's reference workload, before the probes
    # this process alone (``compute_probes``, ``op_weights``)
    flops: float = 0.0
    mem_bw: float = 0.0
    step_overhead: float = 0.0
    pointwise: float = 0.0
    matmul: float = 0.0
    attention: float = 0.0
    attention_overhead: float = 0.0
    probe_mix: dict = dataclasses.field(default_factory=dict)
    op_weights: tuple = ()
    alone: float = 0.0                       # the synthetic stack's loop alone (the quicker of two)
    # on ranks: the runtime probes (``host_fits.fit_op_overhead``, ``fit_sync_overhead``)
    overhead: float = 0.0
    pass_overhead: float = 0.0
    ratio: float = 0.0
    share: float = 0.0
    message_overhead: float = 0.0
    split_pass: float = 0.0
    split_op: float = 0.0
    split_share: float = 0.0
    replays: list = dataclasses.field(default_factory=list)
    tails: list = dataclasses.field(default_factory=list)
    sync: tuple = ()
    collective_overhead: float = 0.0
    tp_added: float = 0.0
    tp_blocked: tuple = ()
    # on ranks: the links (``link_fits.gloo_link``) and the ranks sharing cores
    gloo: Link | None = None
    seconds: list = dataclasses.field(default_factory=list)
    pipe_alone: float | None = None
    shared: Link | None = None
    wake_runs: list | None = None
    shared_steps: list | None = None
    loops: dict = dataclasses.field(default_factory=dict)   # processes -> the contention probe's readings
    # fitted after the probes
    contention: tuple = ()
    synthetic_hop: float = 0.0
    skew_scale: float = 1.0
    skew_table: float = 0.0


def _measure_alone(got: Readings) -> None:
    """The probes of this process alone, no other rank alive."""
    got.first_print = fingerprint()
    got.flops = measure_matmul_flops()
    got.mem_bw = measure_memory_bandwidth()
    got.step_overhead = measure_step_overhead()
    got.pointwise = measure_pointwise_efficiency(got.mem_bw)
    got.matmul = measure_matmul_efficiency(got.flops)
    got.attention, got.attention_overhead = measure_attention(got.flops)
    got.probe_mix = probe_layer_ops()
    got.op_weights = measure_op_weights(got.probe_mix)
    got.alone = stack_seconds(CONTENTION_SECONDS)


def _measure_on_ranks(got: Readings, ranks: Ranks) -> None:
    """The probes on processes, grouped by world size so that each pool starts once: the
    runtime probes and the gloo link on ``GLOO_WORLD`` processes, then the contention of as
    many processes as cores and of twice as many (at most 8), and on the latter the link,
    pipelines and steps of ranks sharing cores."""
    pipelines = OP_PIPELINES + HOP_PIPELINES + TAIL_PIPELINES
    (got.overhead, got.pass_overhead, got.ratio, got.share, got.message_overhead, got.split_pass, got.split_op,
     got.split_share, got.replays, got.tails) = fit_op_overhead(
        pipelines, ranks(op_overhead_probe, 2, pipelines, timeout=240), got.op_weights)
    got.sync, got.collective_overhead, got.tp_added, got.tp_blocked = fit_sync_overhead(
        ranks(sync_probe, GLOO_WORLD, SYNC_MODES, SYNC_STEPS, timeout=180), got.op_weights, got.overhead, got.ratio)
    got.gloo, got.seconds, got.pipe_alone = gloo_link(_probe_link(ranks, GLOO_WORLD))
    crowd = [k for k in sorted({got.cores, 2 * got.cores}) if 1 < k <= 8]
    for k in [k for k in crowd if k == GLOO_WORLD] + [k for k in crowd if k != GLOO_WORLD]:
        if k == 2 * got.cores:     # ranks sharing cores: the same gloo fit with twice as many, and the
            got.shared, _, _ = gloo_link(_probe_link(ranks, k), k)     # runtime's pipelines that fit their wake
            got.wake_runs = ranks(op_overhead_probe, k, WAKE_PIPELINES, timeout=240)
            got.shared_steps = ranks(shared_step_probe, k, (SHARED_MODE, "tp"), SHARED_STEPS, timeout=240)
        got.loops[k] = [ranks(contention_probe, k, CONTENTION_READING_SECONDS, timeout=120)
                        for _ in range(CONTENTION_READINGS)]


def _probe_link(ranks: Ranks, world: int) -> list:
    """``comm_probes.probe_all``'s results on ``world`` processes, one dict per rank."""
    return ranks(probe_all, world, GLOO_SIZES, GLOO_WARMUP, GLOO_REPS, timeout=180)


def _fit_links(got: Readings) -> None:
    """The contention table, and the links' fields fitted on the runtime's own steps and
    pipelines: the 2-process link's kinds share one table, at the level its tp steps read
    (``Link.skew_pooled``, ``skew_scale``); the pipelines' message latency, interleaved too,
    and the exchanges after a schedule; on ranks sharing cores the same, and their wake."""
    cores = got.cores
    got.contention = slowdowns(got.alone, got.loops)
    got.synthetic_hop = fit_hop(got.pipe_alone, GLOO_WORLD, cores, got.contention)
    gloo = dataclasses.replace(got.gloo, skew_pooled=True)
    got.skew_scale, got.skew_table = skew_scale(gloo, *got.tp_blocked)
    got.gloo = dataclasses.replace(gloo, skew_scale=got.skew_scale,
                                   hop=fit_runtime_hop(got.replays, cores, got.contention, ("1f1b",)),
                                   hop_interleaved=fit_runtime_hop(got.replays, cores, got.contention, ("interleaved",)),
                                   tail=fit_tail(got.tails, gloo))
    if got.shared is not None:
        got.shared = dataclasses.replace(got.shared, hop=got.gloo.hop, hop_interleaved=got.gloo.hop_interleaved,
                                         tail=got.gloo.tail,
                                         wake=fit_runtime_wake(got.wake_runs, cores, got.contention, got.gloo.hop))


def _compute_lines(got: Readings) -> list:
    """The source's lines of the compute probes."""
    matmul, attention, attention_overhead, pointwise = got.matmul, got.attention, got.attention_overhead, got.pointwise
    return [
        f"peak_flops: fp32 matmuls n={list(MATMUL_SIZES)} on 1 thread, best size's median rate "
        f"over ~{MATMUL_SECONDS}s each; matmul_efficiency {matmul:.2f}: the forward and backward products "
        f"of linear layers (m, k, n) in {list(LINEAR_SHAPES)}, each call's operands from the next copy of a "
        f"{POOL_BYTES >> 20} MiB pool (read from memory, not a hot cache), FLOPs / summed median times / peak",
        f"attention: causal SDPA forward + backward on (slices, s, d) in {list(ATTENTION_SHAPES)}, "
        f"inputs from a pool likewise, time = 3(4*B*s^2*d / rate + B*overhead): attention_efficiency {attention:.2f}, "
        f"attention_overhead {attention_overhead * 1e6:.2f} us per slice",
        f"mem_bandwidth: copy_ of {COPY_BYTES >> 20} MiB fp32 on 1 thread, (read + write) / median time; "
        f"memory_efficiency {pointwise:.2f}: GeLU, LayerNorm, softmax and add on 512x256 fp32 from a pool likewise, "
        "bytes / summed median times / that",
    ]


def _gloo_lines(got: Readings) -> list:
    """The source's lines of the 2-process gloo link and of the machine's memory."""
    seconds = got.seconds
    return [
        f"gloo-tcp: dist.all_reduce fp32 on {GLOO_WORLD} processes (1 thread each), "
        f"{GLOO_SIZES[0] >> 10} KiB..{GLOO_SIZES[-1] >> 20} MiB by 4x, median of {GLOO_REPS} after "
        f"{GLOO_WARMUP} warm-ups, each after ~1 ms of matmuls on every rank (its excess over the same "
        "compute timed with every rank at once), slowest rank; "
        "1/time-weighted least squares of "
        "time = alpha + bytes_moved/bandwidth, bytes_moved = 2(N-1)/N * size (each kind likewise; an alpha "
        "fitted below zero: the three smallest messages' median excess over bytes_moved/bandwidth); "
        f"times {[float(f'{s:.3g}') for s in seconds]} s; its skew: each kind's latency after "
        f"{[t * 1e3 for t in SKEW_COMPUTE]} ms of compute on every rank, round after round with no barrier "
        f"(excess over the same compute alone, the median of {SKEW_BLOCKS} blocks of rounds), which a step's "
        "collectives take as their alpha",
        "memory_bytes: physical RAM; gpus_per_node: os.cpu_count(); host link: mem_bandwidth, 1e-7 s",
    ]


def _host_lines(got: Readings) -> list:
    """The source's lines of the framework's and the runtime's host work."""
    overhead, ratio, pass_overhead, share = got.overhead, got.ratio, got.pass_overhead, got.share
    message_overhead, step_overhead, split_pass, split_op = (got.message_overhead, got.step_overhead, got.split_pass,
                                                             got.split_op)
    split_share, probe_mix, op_weights, sync = got.split_share, got.probe_mix, got.op_weights, got.sync
    tp_added, collective_overhead, skew_scale, tp_blocked = (got.tp_added, got.collective_overhead, got.skew_scale,
                                                             got.tp_blocked)
    skew_table = got.skew_table
    return [
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
        f"op_weights: each of {len(SAMPLES)} ops timed alone on {'x'.join(map(str, OP_WEIGHT_SHAPE))} fp32 "
        f"(1 thread), chains of 24 less 4 forward and backward, each chain's fastest of rounds through all in turn, over the "
        f"mean of a probe layer's ops (h=8: {sum(probe_mix.values())} ops): "
        + ", ".join(f"{n} {f:.2f}/{b:.2f}" for n, f, b in op_weights) + ",",
        f"sync_overhead: thread CPU time of training steps of a synthetic stack (blocks of 2 x (LayerNorm, "
        f"Linear d->2d, GeLU, Linear 2d->d), {TENSORS_PER_BLOCK} tensors a block, d={SYNC_DIM}) of "
        f"{' and '.join(map(str, SYNC_BLOCKS))} blocks compiled on dp={GLOO_WORLD} under each mode, "
        f"timed round-robin; the growth with the blocks less the added ops at op_overhead and a plain "
        f"AdamW step's growth, per added tensor: "
        + ", ".join(f"{m} {v * 1e6:.1f} us" for m, v in sync),
        f"collective_overhead: the same stacks on Mesh(tp={GLOO_WORLD}) under Plan(tp=True), their growth "
        f"less the added ops, AdamW's growth and the ddp bookkeeping, over the {tp_added:.0f} runtime "
        f"collectives added (as the module counts them): {collective_overhead * 1e6:.1f} us per collective; "
        f"skew_scale {skew_scale:.2f}: the same tp steps' wall growth beyond their CPU growth, per added collective "
        f"({tp_blocked[0] * 1e6:.0f} us, each step after a barrier), over the skew table's latency "
        f"after their CPU growth per collective ({tp_blocked[1] * 1e6:.0f} us; the kinds' tables pooled, the mean of "
        f"all-reduce, all-gather and reduce-scatter at each compute length, which every kind of this link takes): "
        f"{skew_table * 1e6:.0f} us",
    ]


def _link_lines(got: Readings) -> list:
    """The source's lines of the shared link and of what the runtime's pipelines fitted."""
    gloo, shared, cores, synthetic_hop, tails = got.gloo, got.shared, got.cores, got.synthetic_hop, got.tails
    return [
        "shared: the same gloo fit with 2 x cpu count processes (ranks sharing cores); its skew: each kind's "
        f"latency after {[t * 1e3 for t in SKEW_COMPUTE]} ms of compute on every rank, round after round "
        "(excess over the same compute alone)" if shared else "",
        f"hop: the message latency at which the model's replay of autopar's own 2-stage 1F1B pipelines "
        f"(4 micro-batches, GPTs of h=16 with {' and '.join(str(x[0]) for x in HOP_PIPELINES if x[1] == '1f1b')} "
        f"layers, run with the op_overhead probe; each stage's measured F and B action CPU times plus a message's, "
        f"the contention of 2 ranks; a send moving once its receive is posted) lasts their measured schedules "
        f"(each the mean of its steps), "
        f"the median: {gloo.hop * 1e3:.2f} ms on "
        f"{GLOO_WORLD} processes; hop_interleaved: the same for the interleaved schedule (2 stages a rank, GPTs "
        f"of h=16 with {' and '.join(str(x[0]) for x in HOP_PIPELINES if x[1] == 'interleaved')} layers): "
        f"{gloo.hop_interleaved * 1e3:.2f} ms "
        f"(a synthetic pipeline of bare matmuls, {PIPE_M} micro-batches of {PIPE_F * 1e3:g} / {PIPE_B * 1e3:g} ms, "
        f"receives posted before the step, fits {synthetic_hop * 1e3:.2f} ms)"
        + (f"; on {2 * cores} (shared) that hop, and a woken rank's wait for a core when all are taken, "
           f"fitted at that hop on the replays of autopar's own {2 * cores}-stage 1F1B pipelines on {2 * cores} "
           f"processes (4 micro-batches, GPTs of h=16 with "
           f"{' and '.join(str(x[0]) for x in WAKE_PIPELINES)} layers; each stage's measured action CPU times, "
           f"the median): wake {shared.wake * 1e3:.2f} ms" if shared else ""),
        f"tail: the 1F1B probe pipelines (those of hop, and GPTs of (layers, h, tokens) "
        f"{', '.join(str((x[0], x[2], x[3])) for x in TAIL_PIPELINES)}), each step's last rank to end its "
        f"schedule, its wall time from then to train_step's return less the estimate's p2p time of those "
        f"exchanges, fitted as a + b x how long the other rank waited (means over steps): "
        + (f"a {gloo.tail[0] * 1e3:.2f} ms, b {gloo.tail[1]:.3f}" if gloo.tail else "none")
        + " (points: " + ", ".join(f"{w * 1e3:.2f} ms waited, {t * 1e3:.2f} ms past" for _, w, t in tails) + ")"
        + ("; the same on the shared link" if shared else ""),
        f"overlap_loss: a 1 MiB all-reduce issued asynchronously before ~2 ms of matmuls and waited on after, "
        f"against each alone, every rank at once, {OVERLAP_REPS} rounds in turn, slowest rank; median over rounds "
        f"of (both - longer) / shorter: {gloo.overlap_loss:.2f} on {GLOO_WORLD} processes"
        + (f"; {shared.overlap_loss:.2f} on {2 * cores} (ranks sharing cores)" if shared else "")
        + "; charged against the time some communication lane was busy",
    ]


def _contention_lines(got: Readings) -> list:
    """The source's line of the contention probe: each count's slowdown and its readings."""
    alone, loops, contention = got.alone, got.loops, got.contention
    return [
        f"contention: forward + backward of the synthetic stack ({STACK_BLOCKS} blocks, d={STACK_DIM}, "
        f"{STACK_ROWS} rows, 1 thread) with k "
        f"processes looping at once, the ranks' harmonic mean / alone, the median of {CONTENTION_READINGS} readings of {CONTENTION_READING_SECONDS} s: "
        + ", ".join(f"k={k}: {f:.2f} ({', '.join(f'{reading(r, alone):.2f}' for r in loops[k])})" for k, f in contention),
    ]


def _source(got: Readings, when: str) -> str:
    """The preset's ``source``: what was measured, how, and what it read (before the
    fingerprint's and the shared fits' lines)."""
    return "\n".join([
        f"measured on {socket.gethostname()} at {when} by autopar.cost.calibration.calibrate_local "
        f"(torch {torch.__version__}, {os.cpu_count()} cpus)",
    ] + _compute_lines(got) + _gloo_lines(got) + _host_lines(got) + _link_lines(got) + _contention_lines(got)).strip()


def _device(got: Readings) -> Device:
    return Device(name=f"cpu ({cpu_model()})", peak_flops=got.flops, mem_bandwidth=got.mem_bw,
                  memory_bytes=total_ram(), matmul_efficiency=got.matmul, memory_efficiency=got.pointwise,
                  op_overhead=got.overhead, step_overhead=got.step_overhead,
                  attention_efficiency=got.attention, attention_overhead=got.attention_overhead,
                  pass_overhead=got.pass_overhead, backward_op_ratio=got.ratio, backward_pass_share=got.share,
                  message_overhead=got.message_overhead, sync_overhead=got.sync,
                  split_pass_overhead=got.split_pass, split_op_overhead=got.split_op,
                  split_forward_share=got.split_share, collective_overhead=got.collective_overhead,
                  op_weights=got.op_weights)


def _with_shared_fits(cluster: Cluster, got: Readings) -> Cluster:
    """``cluster`` with what the synthetic stacks' own steps on ranks sharing cores fit: ZeRO-3's
    host work, read with the stacks' collectives at the level their tp steps read (next to no
    compute between collectives), and the shared link's shortest skew point, read on the same
    tp steps; their lines added to its source."""
    cores, shared_steps = got.cores, got.shared_steps
    scale, tp_measured, tp_one = shared_skew_scale(cluster, 2 * cores, shared_steps)
    factor, measured, at_one = shared_sync_factor(cluster, 2 * cores, shared_steps, scale=scale)
    first, _, first_one = shared_skew_first(cluster, 2 * cores, shared_steps)
    return dataclasses.replace(
        cluster, shared=dataclasses.replace(cluster.shared, skew_first=first),
        shared_sync=((SHARED_MODE, factor),),
        source=cluster.source + (
            f"\nshared_sync: {SHARED_MODE} {factor:.2f}: its host work per tensor on {2 * cores} processes "
            f"sharing cores, over its charge at their contention: the factor at which the model's step of the "
            f"synthetic stack (d={SYNC_DIM}, {SYNC_ROWS} rows a rank) on Mesh(dp={2 * cores}) under "
            f"Plan(dp={SHARED_MODE!r}) grows from {' to '.join(map(str, SYNC_BLOCKS))} blocks as the slowest "
            f"rank's measured step grew (the median of {SHARED_STEPS} rounds, each step after a barrier): "
            f"{measured * 1e3:.1f} ms measured, {at_one * 1e3:.1f} ms at factor 1; the stacks' collectives at "
            f"{scale:.2f} x the shared link's skew table, the scale at which the model's Plan(tp=True) step of "
            f"the same stacks on Mesh(tp={2 * cores}) grows as measured in the same rounds "
            f"({tp_measured * 1e3:.1f} ms measured, {tp_one * 1e3:.1f} ms at scale 1)"
            f"\nshared skew_first {first:.2f}: the factor on the shared link's skew table at its shortest compute "
            f"point (every kind but p2p) at which the same tp steps grow as measured ({first_one * 1e3:.1f} ms "
            f"at factor 1); the longer points as measured"))


def _measure_local() -> Cluster:
    """Measure this machine (about a minute) and describe it as a Cluster named "local"."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # the distributed tests run one compute thread per process
    got, ranks = Readings(cores=os.cpu_count() or 1), Ranks()
    try:
        _measure_alone(got)
        _measure_on_ranks(got, ranks)
        ranks.close()
        # alone again, and the quicker of the two: a loop alone is only ever slowed by others
        got.alone = min(got.alone, stack_seconds(CONTENTION_SECONDS))
    finally:
        ranks.close()
        torch.set_num_threads(threads)
    _fit_links(got)
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    source = _source(got, when)
    device = _device(got)
    # the reference workload timed at the start and at the end, each part's mean (cost.drift)
    last_print = dict(fingerprint())
    prints = tuple((part, (s + last_print[part]) / 2) for part, s in got.first_print)
    source += ("\nfingerprint (cost.drift, checked when the preset is read): per tiny add "
               f"{prints[0][1] * 1e6:.2f} us, per 256x256 matmul {prints[1][1] * 1e3:.3f} ms, "
               "the mean of its timings before and after the probes")
    cluster = Cluster(name="local", device=device, gpus_per_node=os.cpu_count() or 1, intra=got.gloo,
                      inter=got.gloo, host=Link("host-memory", got.mem_bw, 1e-7), source=source,
                      shared=got.shared, contention=got.contention, fingerprint=prints)
    if got.shared is not None and got.shared_steps is not None:
        cluster = _with_shared_fits(cluster, got)
    return cluster


def calibrate_local(*, force: bool = False, cache_path: str | None = None) -> Cluster:
    """This machine as a Cluster named "local": read from the cache (``autopar.cost.cache``;
    ``cache_path`` overrides where) unless ``force``, else measured now by the calibration's
    probes (about a minute; see the returned Cluster's ``source`` for each number's method)
    and stored there."""
    if not force:
        cached = cached_local(cache_path)
        if cached is not None:
            return cached
    cluster = _measure_local()
    cache.store_local(dataclasses.asdict(cluster), cache_path)
    return cluster
