"""Data parallelism in the cost model: a stage's gradient buckets and ZeRO-3 units, cut as the
collectives pass cuts them (``autopar.sizes.grad_buckets`` / ``gather_units``, over the
profile's parameters in order of first use), and the bytes and seconds of their collectives:
ZeRO-3's gathers and reduce-scatters per unit, the other modes' bucket reductions as backward
completes them, ZeRO-1/2's replica gathers after the optimizer step, and the runtime's host
work per parameter tensor (``stage_sync`` gathers them for one pipeline stage)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from autopar.context import layer_key
from autopar.sizes import cut_unit, gather_units, grad_buckets, padded_numel, ring_bytes, state_bytes, \
    unit_grad_buckets

from .comm import collective_time
from .compute import compute_time
from .memory import Precision
from .offload import offload_elements
from .step_parts import padded_sum

__all__ = ["first_use", "stage_buckets", "stage_units", "stage_unit_buckets", "layer_unit_cuts", "Unit",
           "zero3_units", "unit_times", "bucket_times", "offload_buckets", "replica_gathers", "has_reducer",
           "sync_time", "StageSync", "stage_sync"]


# ---- buckets and units, as the collectives pass cuts them ------------------------------------

def _padded_bytes(shapes: dict, n: int, nbytes: int) -> dict:
    """Each parameter's bytes (``nbytes`` per element), padded to ``n`` equal chunks."""
    return {x: padded_numel(shp, n) * nbytes for x, shp in shapes.items()}


def first_use(gs, shapes: dict) -> list[str]:
    """``shapes``' parameters in order of first use: the groups' parameters in order, then the others."""
    return [x for g in gs for x in g.params if x in shapes] + [x for x in shapes if not any(x in g.params for g in gs)]


def stage_buckets(gs, shapes: dict, n: int, nbytes: int, bucket_bytes: int) -> list[list[str]]:
    """The gradient buckets of ``shapes``' parameters as the collectives pass cuts them
    (``sizes.grad_buckets`` over their bytes, ``nbytes`` per element, padded to ``n`` equal
    chunks, in the order of first use of ``first_use``), in the order gradients become ready."""
    return grad_buckets(first_use(gs, shapes), _padded_bytes(shapes, n, nbytes), bucket_bytes)


def stage_units(gs, shapes: dict, n: int, nbytes: int, bucket_bytes: int) -> list[list[str]]:
    """ZeRO-3's gather units of ``shapes``' parameters as the collectives pass makes them
    (``sizes.gather_units``: one per numbered layer, the other parameters one root unit, each
    cut where it passes ``bucket_bytes``), in order of first use."""
    return gather_units(first_use(gs, shapes), _padded_bytes(shapes, n, nbytes), bucket_bytes, layer_key)


def stage_unit_buckets(gs, shapes: dict, n: int, nbytes: int, bucket_bytes: int) -> list[list[str]]:
    """ZeRO-3's gradient buckets: its gather units (``stage_units``), last unit first, each
    unit's members last first (``sizes.unit_grad_buckets``)."""
    return unit_grad_buckets(stage_units(gs, shapes, n, nbytes, bucket_bytes))


def layer_unit_cuts(g, shapes: dict, n: int, nbytes: int, bucket_bytes: int) -> list[list[str]]:
    """The ZeRO-3 unit of layer group ``g``'s parameters (those of ``shapes``) cut where it
    passes ``bucket_bytes`` (``sizes.cut_unit``)."""
    members = [x for x in g.params if x in shapes]
    return cut_unit(members, _padded_bytes({x: shapes[x] for x in members}, n, nbytes), bucket_bytes)


@dataclass(frozen=True)
class Unit:
    """One of ZeRO-3's gather units (``zero3_units``): its padded ``elements``, and the group
    indices where the runtime moves it: ``forward``, its gather before the first group that
    reads a member, and its gradients' reduce-scatter after that group's backward (backward
    runs in reverse: that member's gradient is the unit's last); ``backward``, its re-gather
    before the last group whose backward reads a member (None: backward reads none)."""
    names: tuple
    elements: int
    forward: int
    backward: Optional[int]


def zero3_units(gs, shapes: dict, n: int, nbytes: int, bucket_bytes: int) -> list[Unit]:
    """A stage's ZeRO-3 units as the collectives pass makes them (``stage_units``: one per
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
    for members in stage_units(gs, shapes, n, nbytes, bucket_bytes):
        first = min((i for x in members for i in readers.get(x, ())), default=0)
        back = max((i for x in members for i in back_readers.get(x, ())), default=None)
        out.append(Unit(tuple(members), padded_sum({x: shapes[x] for x in members}, n), first, back))
    return out


# ---- the collectives' seconds ------------------------------------------------------------------

def unit_times(units: list[Unit], groups: int, n: int, pbytes: int, link, forward: list, m: int,
               host: float = 0.0, rbytes: Optional[int] = None) -> tuple:
    """(forward gathers, backward gathers, reduce-scatters): seconds per group of a stage's
    ZeRO-3 ``units`` (``zero3_units``), each collective after the compute of the group it
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


def bucket_times(gs, mode, n, pbytes, link, bucket_bytes, backward, lead=0.0, rbytes=None) -> list:
    """Seconds of the gradient reductions each group's backward completes (ZeRO-3's:
    ``unit_times``): the buckets of ``stage_buckets`` (ddp unpadded; cut by ``pbytes`` per
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
    for b in stage_buckets(gs, shapes, shard, pbytes, bucket_bytes):
        completes.setdefault(min(group_of[x] for x in b), []).append(
            sum(padded_numel(shapes[x], shard) for x in b) * (pbytes if rbytes is None else rbytes))
    since = lead
    for i in reversed(range(len(gs))):
        since += backward[i]
        for nbytes in completes.get(i, ()):
            out[i] += collective_time(kind, nbytes, n, link, after=since or None)
            since = 0.0
    return out


def offload_buckets(gs, shapes: dict, mode: str, n: int, nbytes: int, bucket_bytes: int, units: list) -> list:
    """(group completing it, this rank's elements) of each gradient bucket in launch order, for
    the host link's copies: ZeRO-3 its ``units`` (``zero3_units``), last first, the others
    ``stage_buckets`` (ZeRO: each member's padded share; a parameter of no group: group 0)."""
    if mode == "zero3":
        return [(u.forward, u.elements / n) for u in reversed(units)]
    share = 1 if mode == "ddp" else n
    group_of = {x: i for i, g in enumerate(gs) for x in g.params}
    return [(min(group_of.get(x, 0) for x in b), sum(padded_numel(shapes[x], share) for x in b) / share)
            for b in stage_buckets(gs, shapes, share, nbytes, bucket_bytes)]


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


# ---- one stage's data parallelism ----------------------------------------------------------------

@dataclass
class StageSync:
    """A pipeline stage's data parallelism (``stage_sync``): its parameters (Ψ, padded to N
    equal chunks, tensors), the model states a rank keeps and the elements its optimizer steps,
    the bytes each rank sends per step by collective, and per group of the stage the seconds of
    ZeRO-3's forward and backward gathers and of the reductions its backward completes;
    ZeRO-1/2's replica gathers after the step, as each bucket's bytes; the buckets the host
    link's copies follow (``offload_buckets``, under ``Plan(offload="optimizer")``)."""
    psi: int
    tensors: int
    states: float
    opt_elements: float
    comm_bytes: dict
    forward_gathers: list
    backward_gathers: list
    reductions: list
    tail_buckets: list
    host_buckets: Optional[list]


def stage_sync(gs, shapes: dict, plan, n: int, m: int, pr: Precision, link, forward: list, c) -> StageSync:
    """The data parallelism of a stage of groups ``gs`` holding the parameters ``shapes``
    under ``plan`` over ``n`` ranks, ``m`` micro-batches a step: gathers in the compute dtype,
    gradient sums in the reduce dtype (``pr``); ``forward``: each group's forward compute, what
    each collective follows on ``link``."""
    mode, pbytes, rbytes = plan.dp, pr.compute, pr.reduce
    psi = sum(math.prod(shp) for shp in shapes.values())
    pad = padded_sum(shapes, n)
    units = zero3_units(gs, shapes, n, pbytes, plan.bucket_bytes) if mode == "zero3" else []
    read = sum(u.elements for u in units if u.backward is not None)     # backward re-gathers whole units
    if mode == "ddp":
        by = {"backward all_reduce": ring_bytes("all_reduce", psi * rbytes, n)}
    elif mode in ("zero1", "zero2"):
        by = {"backward reduce_scatter": ring_bytes("reduce_scatter", pad * rbytes, n),
              "optimizer all_gather": ring_bytes("all_gather", pad * pbytes, n)}
    else:
        by = {"forward all_gather": ring_bytes("all_gather", pad * pbytes, n) * m,
              "backward all_gather": ring_bytes("all_gather", read * pbytes, n) * m,
              "backward reduce_scatter": ring_bytes("reduce_scatter", pad * rbytes, n)}
    if mode == "zero3":
        fwd_g, bwd_g, red = unit_times(units, len(gs), n, pbytes, link, forward, m,
                                       host=sync_time(mode, 1, c), rbytes=rbytes)
    else:
        fwd_g, bwd_g = [0.0] * len(gs), [0.0] * len(gs)
        red = bucket_times(gs, mode, n, pbytes, link, plan.bucket_bytes, [2 * f * m for f in forward],
                           lead=sum(forward) * m, rbytes=rbytes)
    # ZeRO-1/2's replica gathers after the step, a bucket at a time (bytes)
    tail = ([sum(padded_numel(shapes[x], n) for x in b) * pbytes
             for b in stage_buckets(gs, shapes, n, pbytes, plan.bucket_bytes)]
            if mode in ("zero1", "zero2") and n > 1 else [])
    host = offload_buckets(gs, shapes, mode, n, pbytes, plan.bucket_bytes, units) \
        if plan.offload == "optimizer" else None
    return StageSync(psi=psi, tensors=len(shapes), states=state_bytes(mode, psi, n, pr.states, padded_psi=pad),
                     opt_elements=offload_elements(mode, psi, pad, n), comm_bytes=by, forward_gathers=fwd_g,
                     backward_gathers=bwd_g, reductions=red, tail_buckets=tail, host_buckets=host)
