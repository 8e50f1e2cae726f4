"""The pieces of a step that the detailed estimate (``cost.estimate``) and the planner's closed
form (``cost.planner``) both read: a layer group's forward, backward and W times, the
activations it keeps, the optimizer step, and the slowdown of ranks sharing cores."""
from __future__ import annotations

import math

from autopar.sizes import padded_numel, ring_bytes

from .comm import collective_time
from .compute import compute_time, dispatch_ops, group_time
from .profile import GroupCost, is_layer

__all__ = ["tp_comm_time", "group_passes", "saved_bytes", "optimizer_time", "padded_sum", "oversubscription"]


def tp_comm_time(items, t: int, link, after: float | None = None) -> float:
    """Seconds of a group's tensor-parallel collectives, ``GroupCost.tp_forward`` /
    ``tp_backward`` items (kind, bytes each rank sends, scales with the batch), over ``t``
    ranks on ``link`` (``after``: the compute before each, for links with a measured skew table)."""
    return sum(collective_time(kind, nbytes / ring_bytes(kind, 1.0, t) if t > 1 else nbytes, t, link, after=after)
               for kind, nbytes, _ in items)


def group_passes(g: GroupCost, c, t: int, link, recompute: str, slow: float) -> tuple:
    """(F, B, W, forward compute alone, tp forward, tp backward) seconds of one group: its
    forward (the roofline, ``group_time``, times ``slow``, plus its tp collectives, which block
    the next op, each with the runtime's host work, ``Device.collective_overhead``), backward
    (twice the compute but for the ops' dispatch, which is ``Device.backward_op_ratio`` times the
    forward's, the backward tp collectives, and what
    recomputation redoes: a layer's whole forward under ``full``, its attention under
    ``selective``), and W (the weight-gradient matmuls a zero-bubble schedule defers). On a
    measured link (``Link.skew``) a collective's latency grows with the CPU work before it:
    the group's compute spread over its collectives, plus the runtime's own work for each."""
    f = group_time(g, c)
    fc = f * slow
    ops = dispatch_ops(g, c.device) * c.device.op_overhead * slow      # the forward's dispatch
    ops_b = dispatch_ops(g, c.device, backward=True) * c.device.op_overhead * slow   # backward's: x backward_op_ratio
    own = c.device.collective_overhead if t > 1 else 0.0    # the runtime's work per collective, on a core of its own
    host = own * slow
    # the CPU work between two collectives, the skew probe's abscissa: the group's compute spread
    # over them, and the runtime's own work for each (as much a rank's time off the wire as a matmul)
    tpf = tp_comm_time(g.tp_forward, t, link, after=f / max(1, len(g.tp_forward)) + own) + host * len(g.tp_forward)
    tpb = tp_comm_time(g.tp_backward, t, link, after=2 * f / max(1, len(g.tp_backward)) + own) + host * len(g.tp_backward)
    redo = 0.0
    if is_layer(g.name):
        if recompute == "full":
            redo = fc + tpf
        elif recompute == "selective":
            redo = g.attention_flops / c.device.attention_rate_of(g.matmul_dtype) * slow
    return (fc + tpf, 2 * (fc - ops) + c.device.backward_op_ratio * ops_b + tpb + redo,
            compute_time(g.matmul_flops, 0.0, c, g.matmul_dtype) * slow, f, tpf, tpb)


def saved_bytes(g: GroupCost, recompute: str) -> float:
    """Activation bytes a group keeps for backward: everything autograd saves; under full
    recomputation a layer keeps only its input (the previous layer's output), under selective
    recomputation all but its attention scores."""
    if not is_layer(g.name):
        return g.saved
    if recompute == "full":
        return g.out_bytes
    if recompute == "selective":
        return g.saved - g.saved_quadratic
    return g.saved


def optimizer_time(states: float, n_tensors: int, c) -> float:
    """Seconds of the optimizer step over this rank's shard: reading and writing parameters,
    gradients and state (3 x the state bytes, on the roofline) and AdamW's per-tensor cost
    (``Device.step_overhead``; on the local preset timed with a 64 x 64 tensor's arithmetic in
    it, so the two overlap there)."""
    return compute_time(0.0, 3 * states, c) + n_tensors * c.device.step_overhead


def padded_sum(params: dict, n: int) -> int:
    """Elements of the parameters (name -> shape) split over ``n`` ranks, padded to equal chunks."""
    return sum(padded_numel(shape, n) for shape in params.values())


def oversubscription(c, axes) -> float:
    """On the local CPU preset, ranks slow each other: beyond the core count they share cores,
    and below it they share caches and memory (the measured ``Cluster.slowdown``)."""
    return c.slowdown(math.prod(axes.values()))

