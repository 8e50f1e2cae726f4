"""A rank's peak memory for the estimate: a walk over the step as the runtime allocates it
(``rank_peak``), with the activations a pipeline schedule keeps in flight (``schedule_flight``)
and the gradients of pipelined micro-batches as they accumulate (``accumulation_peak``)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.sizes import inflight_microbatches, padded_numel, state_bytes

from .data_parallel import has_reducer, layer_unit_cuts, stage_buckets, stage_unit_buckets
from .memory import Precision, persistent_bytes
from .pipeline import lowered_schedule
from .profile import is_layer
from .step_parts import padded_sum, saved_bytes

__all__ = ["rank_peak", "accumulation_peak", "schedule_flight"]


@dataclass(frozen=True)
class _Rank:
    """What a rank's walk over its step reads throughout: its parameters (``shapes``), the
    data-parallel mode over ``n`` ranks, bytes per element of each copy (``pb``: gathered
    copies; ``gb``: gradients as autograd makes them; ``rb``: bucket buffers and accumulated
    gradients; ``land``: reduced gradients), what persists (``base``), ZeRO-3's largest unit
    (``top``)."""
    shapes: dict
    mode: str
    n: int
    pb: int
    gb: int
    rb: int
    land: int
    base: float
    top: float
    staging: bool
    bucket_bytes: int

    @property
    def zero(self) -> bool:
        return self.mode != "ddp"


def rank_peak(gs, names, prof, mode, n, pr: Precision, bucket_bytes, recompute, flight, pipelined, staging=False,
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
    ``extra``: what a split backward's W adds beyond the activations' peak (``schedule_flight``).
    ``received``: per group of ``gs``, the bytes of a micro-batch's inputs its stage receives
    (on the stage's first group): the receiving stage keeps them to its backward.
    ``parts``: the groups of each pipeline stage this rank runs; each stage has a reducer, and
    buckets, of its own. ``microbatches``: a pipeline's; from the second on, a micro-batch's
    gradients are summed into those accumulated (``accumulation_peak``).
    ``pr``: bytes per element of each copy (``cost.memory.Precision``): ``states`` persist, the
    gathered units and autograd's gradients are in the compute dtype, bucket buffers and
    accumulated micro-batch gradients in the reduce dtype, reduced gradients land as ``landed``."""
    pb = pr.compute            # gathered copies; gradients as autograd makes them (the same dtype)
    shapes = {x: sh for x, sh in prof.shapes.items() if x in names}     # in the profile's order (names is a set)
    psi = sum(math.prod(sh) for sh in shapes.values())
    pad = padded_sum(shapes, n)
    base = persistent_bytes(mode, psi, n, pr.states, pad)
    states = state_bytes(mode, psi, n, pr.states, padded_psi=pad)
    received = received or [0.0] * len(gs)
    saved = [(saved_bytes(g, recompute.get(g.name, "none")) + received[i]) * flight for i, g in enumerate(gs)]
    final = sum(g.final_bytes for g in gs) * flight
    act = sum(saved) + final * 2                       # outputs, and the loss's copy of them
    # ZeRO-3's gather units: a layer's parameters, cut where they pass the bucket size (as the
    # collectives pass cuts them: autopar.sizes.cut_unit)
    units = [pb * sum(padded_numel(shapes[g_x], n) for g_x in cut)
             for g in gs if is_layer(g.name) for cut in layer_unit_cuts(g, shapes, n, pb, bucket_bytes)]
    root = pb * sum(padded_sum(g.params, n) for g in gs if not is_layer(g.name))
    top = max(units, default=0.0)
    r = _Rank(shapes, mode, n, pb, pb, pr.reduce, pr.landed, base, top, staging, bucket_bytes)
    gathered = (root + (2 + 1 / n) * top) if mode == "zero3" else 0.0
    peak = base + act + gathered
    if pipelined and extra:          # a zero-bubble W: the stage's weight gradients made at once
        peak = max(peak, base + r.gb * psi + act + extra)
    # each stage's own buckets (a rank of an interleaved pipeline runs several stages)
    stage_sets = [(part, {x: sh for x, sh in shapes.items() if any(x in g.params or x in g.reads for g in part)})
                  for part in parts] if parts else [(gs, shapes)]
    accumulated = r.rb * psi if pipelined else 0.0      # micro-batch gradients held until the flush
    peak, outs, grads = _backward_peak(r, gs, recompute, flight, pipelined, pipelined and microbatches > 1,
                                       stage_sets, saved, act, accumulated, peak)
    if pipelined:     # the flush
        peak = max(peak, _flush_peak(r, stage_sets, accumulated, psi, pad))
        grads = r.land * (pad / n if r.zero else psi) if mode != "zero1" else 0.0
    else:
        grads = grads if mode == "ddp" else (outs if mode in ("zero2", "zero3") else 0.0)
    peak = max(peak, base + (0.0 if offload else grads) + _step_temporaries(r, stage_sets, pr.states[2], offload))
    return peak, states, act, peak - base - act if peak > base + act else 0.0


def _backward_peak(r: _Rank, gs, recompute, flight, pipelined, accumulating, stage_sets, saved, act, accumulated,
                   peak) -> tuple:
    """(the peak so far, reduced shards, gradients kept) after backward, layer by layer in
    reverse. A pipeline's micro-batch gradients wait in their stage's buckets, then join the
    accumulated (``DataParallelSync._accumulate``); a stage with nothing to reduce leaves them
    to autograd. Without a pipeline each bucket goes out as soon as its last member's gradient
    has arrived (``_bucket_lands``)."""
    mode, n, shapes, gb = r.mode, r.n, r.shapes, r.gb
    buckets = (stage_unit_buckets(gs, shapes, n, gb, r.bucket_bytes) if mode == "zero3"
               else stage_buckets(gs, shapes, n if r.zero else 1, gb, r.bucket_bytes))
    part_queues = ([[[(k, x) for x in b] for b in stage_buckets(part, sh, n if r.zero else 1, gb, r.bucket_bytes)]
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
    rem = act
    # ZeRO-3 in backward: the unit in use and the next one prefetched (two units; a unit is
    # copied out of its flat buffer before the next is issued)
    unit_bwd = [2 * r.top] if mode == "zero3" else []
    for i in reversed(range(len(gs))):
        g = gs[i]
        kind = recompute.get(g.name, "none")
        # a recomputed layer's activations live again while its backward runs (one micro-batch's);
        # a recomputed attention core's once the ops after it have run backward and let go of
        # what they kept (``saved_after_core``)
        redo = g.saved if kind == "full" else (
            max(0.0, g.saved_quadratic - g.saved_after_core) if kind == "selective" else 0.0)
        work = 2 * g.max_value + redo + (sum(unit_bwd) if unit_bwd else 0.0)
        peak = max(peak, r.base + rem + pending + flats + outs + grads + accumulated + work)
        freed = saved[i] + (2 * g.final_bytes * flight if g.final_bytes else 0.0)
        if pipelined:   # one micro-batch's backward: the others in flight keep theirs
            rem = max(0.0, rem - freed / max(flight, 1.0))
            if accumulating:
                worst, pending = accumulation_peak(arrivals.get(id(g), []), shapes, mode, gb, part_queues, done,
                                                   pending)
                peak = max(peak, r.base + rem + accumulated + worst)
            continue
        rem -= freed
        # the layer's gradients arrive one at a time (the reverse of forward's order); each
        # bucket goes out as soon as its last member's has
        for x in reversed([x for x in g.params if x in shapes]):
            pending += gb * math.prod(shapes[x])
            done.add(x)
            while buckets and all(y in done for y in buckets[0]):
                live = (r.base + rem + pending + outs + grads
                        + (_units_in_use(r, g, done) if unit_bwd else 0.0))
                landed, pending, flats, outs, grads = _bucket_lands(r, buckets.pop(0), live, pending, flats, outs,
                                                                    grads)
                peak = max(peak, landed)
    return peak, outs, grads


def _units_in_use(r: _Rank, g, done) -> float:
    """ZeRO-3 in backward: the next unit in flight, and what of layer ``g``'s unit backward
    still reads (a weight is dropped once the matmul that saved it has run: its gradient exists)."""
    return min(r.top + r.pb * sum(math.prod(sh) for y, sh in g.params.items() if y in r.shapes and y not in done),
               2 * r.top)


def _bucket_lands(r: _Rank, b, live: float, pending, flats, outs, grads) -> tuple:
    """(the peak while bucket ``b`` is reduced, and the waiting gradients, the flat buffer kept,
    the reduced shards and the gradients kept after it), ``live`` bytes held beside it."""
    mode, shapes, gb = r.mode, r.shapes, r.gb
    flat_elements = padded_sum({y: shapes[y] for y in b}, r.n if r.zero else 1)
    flat = r.rb * flat_elements
    if mode in ("zero2", "zero3"):   # the previous bucket's goes before this one is filled
        # (beside its members' gradients); then the members' go, and the reduce-scatter
        # runs on the flat buffer in place (no staging copy), its shard beside it
        members = gb * sum(math.prod(shapes[y]) for y in b)
        peak = max(live + flat, live - members + flat + flat / r.n)
    elif mode == "zero1":    # summed into the persistent buffer through a flat copy; its
        # reduce-scatter (the backend's staging copy of it in flight until the next
        # bucket fills) lands in a shard kept to the end of backward
        members = gb * sum(math.prod(shapes[y]) for y in b)
        peak = max(live + flat, live - members + flat / r.n + (flat if r.staging else 0.0))
    else:
        peak = live + flats + flat
    pending -= gb * sum(math.prod(shapes[y]) for y in b)
    if mode == "ddp":
        grads += r.land * flat_elements
    elif mode in ("zero2", "zero3"):
        flats = flat            # freed as reduced: kept until the next bucket fills
        outs += r.land * flat_elements / r.n
    else:
        flats = flat if r.staging else 0.0
        outs += flat / r.n
    return peak, pending, flats, outs, grads


def _flush_peak(r: _Rank, stage_sets, accumulated: float, psi: int, pad: int) -> float:
    """A pipeline's flush: bucket by bucket, each made from the accumulated gradients of its
    members, which then go (``DataParallelSync.flush_deferred``)."""
    n, share = r.n, r.n if r.zero else 1
    flat_all = r.rb * (pad if r.zero else psi)
    top_flat = max((r.rb * padded_sum({x: sh[x] for x in b}, share)
                    for part, sh in stage_sets
                    for b in (stage_unit_buckets if r.mode == "zero3" else stage_buckets)(
                        part, sh, share, r.gb, r.bucket_bytes)), default=0.0)
    if r.mode in ("zero2", "zero3"):   # each freed as reduced, its shard kept
        return r.base + accumulated + 2 * top_flat + flat_all / n
    # ddp: the flat buffers become the gradients as the accumulated go; ZeRO-1: each is summed
    # into the persistent buffer (in the base) and goes before its reduce-scatter (and the
    # backend's staging copy) is issued
    return r.base + accumulated + top_flat


def _step_temporaries(r: _Rank, stage_sets, ob: int, offload: bool) -> float:
    """What the optimizer step holds beside the gradients: the optimizer's temporaries (two of
    the largest parameter's state, ``ob`` bytes per element in all, on the device); under
    ZeRO-1/2 the replicas' all-gather, a bucket at a time: its shard and result (and the
    backend's staging copy of the result: gloo's all_gather_into_tensor gathers into a buffer
    of its own, then copies it out); offloaded, two buckets in flight."""
    opt_tmp = 0.0 if offload else 2 * ob / 2 * max((math.prod(sh) for sh in r.shapes.values()), default=0)
    if r.mode in ("zero1", "zero2"):
        n = r.n
        gathers = sorted((r.pb * padded_sum({x: sh[x] for x in b}, n) * (1 + 1 / n + (1.0 if r.staging else 0.0))
                          for part, sh in stage_sets for b in stage_buckets(part, sh, n, r.pb, r.bucket_bytes)),
                         reverse=True)
        opt_tmp += sum(gathers[:2 if offload else 1])
    return opt_tmp


def accumulation_peak(arriving, shapes, mode, gb, part_queues, done, pending: float) -> tuple:
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


def schedule_flight(plan, p, m, v, stage_groups, kinds, r, grad_bytes, received=None) -> tuple:
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
