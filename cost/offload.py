"""Optimizer offload in the cost model: ``Plan(offload="optimizer")`` (ZeRO-Offload: Ren et al.,
USENIX ATC 2021) moves the optimizer's state and step to host memory, and charges the host
link (``Cluster.host``: PCIe on the GPU presets) for the traffic.

With E elements per rank (ZeRO: Ψ/N, padded to N equal chunks, the first rank's share; ddp: Ψ)
and (p, g, K) bytes per element of (parameter, gradient, optimizer state) as the cost model
counts them (``cost.memory``: FP32 (4, 4, 8) or ZeRO's mixed precision (2, 2, 12)):

    host link bytes / step    down g·E (gradients) + up p·E (parameters)
    link time                 2·α_host + (g + p)·E / β_host
    host step                 3·H·E / host bandwidth + tensors · step_overhead
    device model states       ``state_bytes`` with K = 0: the optimizer state leaves the device
    host memory               H·E, H = p + g + K (fp32: the parameter copy, its gradient, Adam's
                              m and v) or g + K under mixed precision (K holds the fp32 master)

The runtime (``autopar.runtime.offload``) copies the gradients down in the optimizer's step
pre-hook, after backward, then steps on the host, then copies the parameters up, before
ZeRO-1/2's parameter all-gather: the three run one after another and overlap nothing, so the
estimate adds link time + host step in place of the device's optimizer step. (ZeRO-Offload
overlaps the gradient copies with backward; this runtime does not, and neither does the model.)

The host's memory bandwidth: the local preset's host is its device (``Cluster.host`` is the
machine's memory), so its device bandwidth; the GPU presets describe no host memory, so
``HOST_MEMORY_BANDWIDTH`` per node, shared by its GPUs, at the device's achieved fraction.
"""
from __future__ import annotations

import sympy as sp

from .formulas import N, PSI

__all__ = ["HOST_MEMORY_BANDWIDTH", "offload_elements", "device_dtypes", "host_bytes_per_element",
           "host_link_bytes", "host_link_formula", "host_bandwidth", "offload_time"]

HOST_MEMORY_BANDWIDTH = 2 * 204.8e9
"""Bytes/s of one node's host memory: two CPU sockets of 8 DDR4-3200 channels each (8 x 25.6
GB/s = 204.8 GB/s a socket; the DGX A100's two AMD EPYC 7742, AMD's datasheet), the slower of
the two presets' hosts. Shared by the node's GPUs."""


def offload_elements(mode: str, psi: float, padded_psi: float, n: int) -> float:
    """E: the elements of this rank's optimizer copy (ddp: Ψ; ZeRO: the padded Ψ over N)."""
    return psi if mode == "ddp" else padded_psi / n


def device_dtypes(dtypes: tuple) -> tuple:
    """(p, g, K) bytes per element on the device once the optimizer state is offloaded: K = 0."""
    p, g, _ = dtypes
    return p, g, 0


def host_bytes_per_element(dtypes: tuple, mixed: bool) -> float:
    """H: host bytes per element of the optimizer's copy: p + g + K, or g + K under mixed
    precision, where K already holds the fp32 master."""
    p, g, k = dtypes
    return g + k if mixed else p + g + k


def host_link_bytes(elements: float, dtypes: tuple) -> tuple[float, float]:
    """(down, up) bytes per step over the host link: g·E gradients, p·E parameters."""
    p, g, _ = dtypes
    return g * elements, p * elements


def host_link_formula(mode: str, dtypes: tuple) -> sp.Expr:
    """The host link's bytes per step per rank as a sympy expression in Ψ and N:
    (g + p)·Ψ (ddp) or (g + p)·Ψ/N (ZeRO)."""
    p, g, _ = dtypes
    return (g + p) * (PSI if mode == "ddp" else PSI / N)


def host_bandwidth(c) -> float:
    """Bytes/s of host memory one rank's step streams at (see the module docstring)."""
    d = c.device
    if c.name == "local":
        return d.mem_bandwidth * d.memory_efficiency
    return HOST_MEMORY_BANDWIDTH / c.gpus_per_node * d.memory_efficiency


def offload_time(elements: float, n_tensors: int, dtypes: tuple, c) -> tuple[float, float]:
    """(link seconds, host step seconds) of one step of ``elements`` over ``n_tensors`` tensors
    on cluster ``c``: 2·α + (g + p)·E / β over ``c.host``, and 3·H·E / host bandwidth (read and
    write the copy, its gradient and state, as the device's ``optimizer_time`` counts) plus the
    per-tensor step overhead."""
    down, up = host_link_bytes(elements, dtypes)
    link = 2 * c.host.latency + (down + up) / c.host.bandwidth
    step = 3 * host_bytes_per_element(dtypes, c.mixed_precision) * elements / host_bandwidth(c) \
        + n_tensors * c.device.step_overhead
    return link, step
