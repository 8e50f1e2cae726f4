"""Optimizer offload in the cost model: ``Plan(offload="optimizer")`` (ZeRO-Offload: Ren et al.,
USENIX ATC 2021) moves the optimizer's state and step to host memory, and charges the host
link (``Cluster.host``: PCIe on the GPU presets) for the traffic, priced as the runtime
(``autopar.runtime.offload``) moves it.

With E elements per rank (ZeRO: Ψ/N, padded to N equal chunks, the first rank's share; ddp: Ψ)
and (p, g, K) bytes per element of (parameter, gradient, optimizer state) as the plan's runtime
keeps them (``cost.memory.precision``: fp32 (4, 4, 8); bf16 compute with fp32 masters
``autopar.sizes.mixed_state_dtypes``, e.g. ZeRO-3's (0, 4, 12)):

    bytes / element           down d = the gradient as it lands, up u = the device parameter the
                              optimizer copies: fp32 (g, p) = (4, 4); mixed precision (4, 4),
                              the fp32 master (the master stays on the device, the reducer lands
                              gradients in its dtype)
    host link bytes / step    (d + u)·E
    device model states       ``state_bytes`` with (p, g, K) -> fp32 (p, g, 0); mixed precision
                              (p, 4, 4): gradients as they land, the master stays, m and v go
                              (p: ZeRO-1/2's bf16 replicas, 2; ddp and ZeRO-3 keep none, 0)
    host memory               H·E, H = u + d + the optimizer state without the master (fp32: K;
                              mixed: K − 4): the parameter copy, its gradient, Adam's m and v
    host step                 3·H·E / host bandwidth + tensors · step_overhead

ZeRO-Offload proper keeps the fp32 master on the host only and moves fp16 gradients down and
fp16 parameters up, 2 + 2 B per element under mixed precision; this runtime keeps the master
shards on the device (the gathers, the replica refresh and ddp's cast read them), so it moves
4 + 4 B, and so does this model: a known difference from the paper, priced as it runs.

What overlaps what (the runtime issues the copies from the training thread, on CUDA on the
current stream, so they share the compute lane and overlap communication, not compute):

    down  a bucket's copy runs on the compute lane when the next bucket launches, beside that
          bucket's reduction: it delays the rest of backward, so it costs the step where the
          compute lane is the critical path and hides in the slack where the reductions are;
          the last bucket's copy waits for the final reduction and is exposed whole. ZeRO-1's
          land when backward ends, each after its own reduction (``single_stage_time``
          places them; a pipeline's deferred reduction: ``flow_time(reductions, copies)``)
    up    after the host step, bucket by bucket in the reducer's order; ZeRO-1/2 issue each
          bucket's replica all-gather as soon as its rows are up, so the up-copies and the
          gathers form a two-stage pipeline: ``flow_time(ups, gathers)`` = the first bucket's
          copy + for each next bucket the longer of its copy and the previous gather + the
          last gather; for equal buckets max(U, G) + one bucket's copy or gather, whichever is
          shorter, not U + G. ddp and ZeRO-3: one copy of everything, nothing after it

Each bucket's copy is α_host + bytes/β_host. The host's memory bandwidth: the local preset's
host is its device (``Cluster.host`` is the machine's memory), so its device bandwidth; the
GPU presets describe no host memory, so ``HOST_MEMORY_BANDWIDTH`` per node, shared by its
GPUs, at the device's achieved fraction.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import sympy as sp

from .formulas import N, PSI
from .memory import Precision

__all__ = ["HOST_MEMORY_BANDWIDTH", "HostCopies", "offload_elements", "device_precision", "link_bytes_per_element",
           "host_bytes_per_element", "host_link_bytes", "host_link_formula", "host_bandwidth", "copy_time",
           "host_step_time", "host_copies", "flow_time"]

HOST_MEMORY_BANDWIDTH = 2 * 204.8e9
"""Bytes/s of one node's host memory: two CPU sockets of 8 DDR4-3200 channels each (8 x 25.6
GB/s = 204.8 GB/s a socket; the DGX A100's two AMD EPYC 7742, AMD's datasheet), the slower of
the two presets' hosts. Shared by the node's GPUs."""


def offload_elements(mode: str, psi: float, padded_psi: float, n: int) -> float:
    """E: the elements of this rank's optimizer copy (ddp: Ψ; ZeRO: the padded Ψ over N)."""
    return psi if mode == "ddp" else padded_psi / n


def device_precision(pr: Precision) -> Precision:
    """``pr`` with the (p, g, K) the device keeps once the optimizer state is offloaded: fp32
    (p, g, 0); mixed precision (p, the gradient as it lands, the master): the master stays."""
    p, g, _ = pr.states
    return replace(pr, states=(p, g, pr.master))


def link_bytes_per_element(pr: Precision) -> tuple:
    """(down, up) bytes per element over the host link: the gradient as it lands and the device
    parameter the optimizer copies (fp32: g, p; mixed precision: the master's dtype, both)."""
    p, g, _ = pr.states
    return (g, pr.master) if pr.mixed else (g, p)


def host_bytes_per_element(pr: Precision) -> float:
    """H: host bytes per element of the optimizer's copy: the parameter copy and its gradient
    as they cross the link, and the optimizer state the device no longer holds (fp32: K;
    mixed precision: K less the master, which stays on the device)."""
    down, up = link_bytes_per_element(pr)
    return down + up + pr.states[2] - device_precision(pr).states[2]


def host_link_bytes(elements: float, pr: Precision) -> tuple[float, float]:
    """(down, up) bytes per step over the host link: d·E gradients, u·E parameters."""
    down, up = link_bytes_per_element(pr)
    return down * elements, up * elements


def host_link_formula(mode: str, pr: Precision) -> sp.Expr:
    """The host link's bytes per step per rank as a sympy expression in Ψ and N:
    (d + u)·Ψ (ddp) or (d + u)·Ψ/N (ZeRO)."""
    down, up = link_bytes_per_element(pr)
    return (down + up) * (PSI if mode == "ddp" else PSI / N)


def host_bandwidth(c) -> float:
    """Bytes/s of host memory one rank's step streams at (see the module docstring)."""
    d = c.device
    if c.name == "local":
        return d.mem_bandwidth * d.memory_efficiency
    return HOST_MEMORY_BANDWIDTH / c.gpus_per_node * d.memory_efficiency


def copy_time(nbytes: float, c) -> float:
    """Seconds of one copy of ``nbytes`` over the host link: α + bytes/β (0 for none)."""
    return c.host.latency + nbytes / c.host.bandwidth if nbytes else 0.0


def host_step_time(elements: float, n_tensors: int, pr: Precision, c) -> float:
    """Seconds of the optimizer step on the host over ``elements`` in ``n_tensors`` tensors:
    3·H·E / host bandwidth (read and write the copy, its gradient and state, as the device's
    ``optimizer_time`` counts) plus the per-tensor step overhead."""
    h = host_bytes_per_element(pr)
    return 3 * h * elements / host_bandwidth(c) + n_tensors * c.device.step_overhead


@dataclass(frozen=True)
class HostCopies:
    """One step's copies over the host link of one stage, per gradient bucket in the reducer's
    (launch) order."""
    down: tuple         # seconds of each bucket's gradients going down
    elements: tuple     # this rank's elements of each copy up: ZeRO-1/2 a bucket's; else all, at once
    up: tuple           # seconds of each of those copies up
    group: tuple        # the layer group whose backward completes each bucket
    early: bool         # gradients land while backward goes on (False: ZeRO-1, when backward ends)
    gather_parts: tuple = ()   # seconds of each bucket's replica all-gather (ZeRO-1/2), when known

    def gathers(self, total: float) -> list:
        """ZeRO-1/2's replica all-gathers, ``total`` seconds in all: each bucket's own
        (``gather_parts``) where the estimate timed them, else a bucket's share by elements."""
        if len(self.gather_parts) == len(self.elements):
            return list(self.gather_parts)
        e = sum(self.elements)
        return [total * x / e if e else 0.0 for x in self.elements]

    def up_tail(self, gather: float) -> float:
        """Seconds from the end of the host step to the last replica written: the copies up
        pipelined with the buckets' all-gathers (``gather`` seconds in all; 0: none)."""
        return flow_time(self.up, self.gathers(gather))

    def down_by_group(self, groups: int) -> list:
        """Seconds of the copies down of the buckets each of ``groups`` layer groups completes."""
        out = [0.0] * groups
        for g, d in zip(self.group, self.down):
            out[g] += d
        return out


def host_copies(buckets: list, mode: str, pr: Precision, c, slow: float = 1.0) -> HostCopies:
    """``HostCopies`` of ``buckets`` ((group, this rank's elements) each, in launch order) on
    cluster ``c``, each copy's time times ``slow`` (ranks sharing cores on the local preset).
    The parameters come up a bucket at a time only where a gather follows (ZeRO-1/2)."""
    down, up = link_bytes_per_element(pr)
    ups = [e for _, e in buckets] if mode in ("zero1", "zero2") else [sum(e for _, e in buckets)]
    return HostCopies(down=tuple(copy_time(down * e, c) * slow for _, e in buckets), elements=tuple(ups),
                      up=tuple(copy_time(up * e, c) * slow for e in ups),
                      group=tuple(g for g, _ in buckets), early=mode != "zero1")


def flow_time(first: list, second: list) -> float:
    """Seconds until the last of ``second`` ends when item i's ``second`` starts once its
    ``first`` and item i−1's ``second`` have ended, and the ``first`` run back to back (a
    two-stage pipeline: copies up then their gathers; reductions then their copies down).
    For k equal items of a and b seconds: a + (k − 1)·max(a, b) + b."""
    a = b = 0.0
    for x, y in zip(first, second):
        a += x
        b = max(a, b) + y
    return max(a, b)
