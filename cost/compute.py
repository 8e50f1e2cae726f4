"""Compute time on a roofline: seconds of FLOPs and bytes on one device.

FLOPs per node come from ``autopar.ops.node_flops``; the profile (``cost.profile``) sums them
per layer by op class. A layer's forward is the roofline of each class, summed (the classes
run one after another, not at once):

    dense_flops / (peak · matmul_efficiency)
    + attention_flops / (peak · attention_efficiency) + slices · attention_overhead
    + pointwise_bytes / (bandwidth · memory_efficiency)
    + ops · op_overhead

where ``peak`` is the device's matmul peak for the dtype the group's matmuls run in
(``Device.matmul_peak``: bf16 at the tensor-core peak, fp32 at TF32's or fp32's,
``GroupCost.matmul_dtype``, recorded from the graph), and ``ops`` counts each op by its weight (``dispatch_ops``): ops differ in framework time
(a view is a fraction of a linear's, an attention call several linears'), so a measured
table, ``Device.op_weights``, weighs each op name by its dispatch over the mean of the
calibration probe's ops; an op the table lacks weighs its class's median (a view's or
another op's), and every op weighs 1 on a preset without the table.
"""
from __future__ import annotations

import functools

from autopar.ops import VIEWS

VIEW_OP, OTHER_OP = "<view>", "<op>"     # a weight table's entries for the ops it does not name

__all__ = ["compute_time", "dispatch_ops", "group_time", "weighed_ops", "GROUP_TIME_FORMULA"]

GROUP_TIME_FORMULA = ("dense/(peak*matmul_eff) + attention/(peak*attention_eff) + slices*attention_setup"
                      " + pointwise_bytes/(bandwidth*memory_eff) + ops*op_overhead")


def compute_time(flops: float, nbytes: float, c, dtype=None) -> float:
    """Seconds of ``flops`` matmul FLOPs on ``dtype`` operands (None: 16-bit) and ``nbytes``
    moved on cluster ``c``'s device, the larger of the two (max(FLOPs / (peak(dtype) ·
    matmul_efficiency), bytes / (bandwidth · memory_efficiency)))."""
    d = c.device
    return max(flops / (d.matmul_peak(dtype) * d.matmul_efficiency),
               nbytes / (d.mem_bandwidth * d.memory_efficiency))


@functools.lru_cache(maxsize=64)
def _weights(table: tuple) -> tuple:
    """({op name: forward weight}, {op name: backward weight}) of a ``Device.op_weights`` table."""
    return {n: f for n, f, _ in table}, {n: b for n, _, b in table}


def weighed_ops(op_names: dict, table: tuple, backward: bool = False) -> float:
    """The ops of ``op_names`` (op name -> count) each weighed by ``table`` (a
    ``Device.op_weights``: its forward weight, or with ``backward`` its gradient's); an op the
    table lacks by the table's entry for its class (``VIEW_OP`` for the ops of
    ``autopar.ops.VIEWS``, ``OTHER_OP`` for the rest) or else 1."""
    w = _weights(table)[1 if backward else 0]
    view, other = w.get(VIEW_OP, 1.0), w.get(OTHER_OP, 1.0)
    return sum(n * w.get(name, view if name in VIEWS else other) for name, n in op_names.items())


def dispatch_ops(g, d, backward: bool = False) -> float:
    """Group ``g``'s ops (a ``cost.profile.GroupCost``) in units of ``Device.op_overhead`` on
    device ``d``: weighed by ``d.op_weights`` (``weighed_ops``); on a device without the table,
    or for a group without op names (built by hand), ``g.ops``."""
    if not d.op_weights or not g.op_names:
        return float(g.ops)
    return weighed_ops(g.op_names, d.op_weights, backward)


def group_time(g, c, k: float = 1.0) -> float:
    """Seconds of one group's forward (a ``cost.profile.GroupCost``) at ``k`` times its profiled
    rows on one device of cluster ``c`` (the module docstring's sum)."""
    d, dtype = c.device, g.matmul_dtype
    return (g.dense_flops * k / (d.matmul_peak(dtype) * d.matmul_efficiency)
            + g.attention_flops * k / d.attention_rate_of(dtype) + g.attention_heads * k * d.attention_overhead
            + g.pointwise_bytes * k / (d.mem_bandwidth * d.memory_efficiency)
            + dispatch_ops(g, d) * d.op_overhead)
