"""Compute time on a roofline: seconds of FLOPs and bytes on one device.

FLOPs per node come from ``autopar.ops.node_flops``; the profile (``cost.profile``) sums them
per layer by op class. A layer's forward is the roofline of each class, summed (the classes
run one after another, not at once):

    dense_flops / (peak · matmul_efficiency)
    + attention_flops / (peak · attention_efficiency) + slices · attention_overhead
    + pointwise_bytes / (bandwidth · memory_efficiency)
    + ops · op_overhead
"""
from __future__ import annotations

__all__ = ["compute_time", "group_time", "GROUP_TIME_FORMULA"]

GROUP_TIME_FORMULA = ("dense/(peak*matmul_eff) + attention/(peak*attention_eff) + slices*attention_setup"
                      " + pointwise_bytes/(bandwidth*memory_eff) + ops*op_overhead")


def compute_time(flops: float, nbytes: float, c) -> float:
    """Seconds of ``flops`` matmul FLOPs and ``nbytes`` moved on cluster ``c``'s device, the
    larger of the two (max(FLOPs / (peak · matmul_efficiency), bytes / (bandwidth ·
    memory_efficiency)))."""
    d = c.device
    return max(flops / (d.peak_flops * d.matmul_efficiency), nbytes / (d.mem_bandwidth * d.memory_efficiency))


def group_time(g, c, k: float = 1.0) -> float:
    """Seconds of one group's forward (a ``cost.profile.GroupCost``) at ``k`` times its profiled
    rows on one device of cluster ``c`` (the module docstring's sum)."""
    d = c.device
    return (g.dense_flops * k / (d.peak_flops * d.matmul_efficiency)
            + g.attention_flops * k / d.attention_rate + g.attention_heads * k * d.attention_overhead
            + g.pointwise_bytes * k / (d.mem_bandwidth * d.memory_efficiency) + g.ops * d.op_overhead)
