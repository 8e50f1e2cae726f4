"""The two tensor-parallel layouts of an LM head priced on a cluster: the policy a compile hands
the tensor-parallel pass (``passes/lm_head.py`` describes the layouts: each one's FLOPs, logits
and collectives).

A layout's time on one rank per step is

    compute_time(FLOPs, 4 · logits bytes) · slowdown + Σ collective_time(kind, bytes, t, tp link)

the head's three products (forward, input and weight gradients) over the rank's words on the
roofline, against the logits written and read four times (the product writes them, the loss
reads them, their gradient is written and read by the backward products), and each collective
alpha-beta on the link of the tp axis (``Cluster.link_for``). The split is taken when it is
faster, or when the whole logits and their gradient would not fit in the device's memory.
"""
from __future__ import annotations

import math

from autopar.passes.lm_head import HeadChoice, HeadCost, Policy

from .cluster import PRESETS, Cluster, cached_local, get_cluster
from .comm import collective_time
from .compute import compute_time

__all__ = ["head_time", "head_policy", "policy_cluster", "DEFAULT_CLUSTER"]

DEFAULT_CLUSTER = "dgx-h100"
"""The cluster a head is priced on when the compile names none and this machine was never
calibrated (``python -m autopar calibrate``)."""


def head_time(cost: HeadCost, c: Cluster, axes: dict) -> float:
    """Seconds of one layout of a head on one rank per step (the module docstring's sum)."""
    t = axes.get("tp", 1)
    link = c.link_for(axes, "tp")
    compute = compute_time(cost.flops, 4 * cost.logits_bytes, c) * c.slowdown(math.prod(axes.values()))
    return compute + sum(collective_time(kind, nbytes, t, link) for kind, nbytes, _, _ in cost.collectives)


def policy_cluster(cluster=None) -> Cluster:
    """The cluster a compile prices heads on: ``cluster`` (a Cluster or a preset name) if given,
    else this machine's calibrated ``local`` preset, else ``DEFAULT_CLUSTER``."""
    if cluster is not None:
        return get_cluster(cluster)
    return cached_local() or PRESETS[DEFAULT_CLUSTER]


def head_policy(cluster=None) -> Policy:
    """``policy(choice) -> (split, why)`` pricing both layouts of a head on ``policy_cluster(cluster)``."""
    c = policy_cluster(cluster)

    def policy(choice: HeadChoice) -> tuple:
        axes = dict(choice.axes)
        split, whole = choice.cost(True), choice.cost(False)
        ts, tw = head_time(split, c, axes), head_time(whole, c, axes)
        if 2 * whole.logits_bytes > c.device.memory_bytes:
            return True, (f"the whole logits and their gradient ({_size(2 * whole.logits_bytes)}) do not fit "
                          f"in {_size(c.device.memory_bytes)} on {c.name}")
        verdict = "faster" if ts < tw else "not faster"
        return ts < tw, (f"the split is {verdict} on {c.name}: {ts * 1e3:.4g} ms vs {tw * 1e3:.4g} ms whole per "
                         f"step (tp sends {_size(split.tp_bytes)} vs {_size(whole.tp_bytes)} per rank; logits "
                         f"{_size(split.logits_bytes)} vs {_size(whole.logits_bytes)})")

    return policy


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"
