"""Cluster descriptions for the cost model: what the hardware can do, in SI units.

A cluster is one kind of device, described by roofline numbers (peak dense FLOP/s in the
training dtype, memory bandwidth, memory capacity, and the fractions of those peaks that
real kernels achieve), plus one link per level of the interconnect:

* ``intra``: between devices of one node (NVLink on a DGX);
* ``inter``: between nodes (InfiniBand on a DGX);
* ``host``:  between a device and its host's memory (PCIe on a DGX).

A link is an alpha-beta model: a message of ``b`` bytes takes ``latency + b / bandwidth``
seconds, ``bandwidth`` being per GPU and per direction. Units throughout: bytes, seconds,
FLOP/s, bytes/s.

Where the numbers come from:

* Presets (``PRESETS``): peak FLOP/s, memory bandwidth and capacity, and link bandwidths
  are vendor datasheet figures, cited next to each number and in each preset's ``source``.
  Latencies are typical NCCL-level per-message figures, an assumption rather than a
  datasheet number. Efficiencies (achieved fraction of peak) are model parameters that are
  calibrated elsewhere; the values here are starting points.
* ``"local"``: this machine, measured once by ``python -m autopar calibrate``
  (``autopar.cost.calibration``: matmuls, copies, attention, framework time per op and per
  pass, gloo collectives among busy ranks, a synthetic pipeline, the slowdown of ranks sharing
  cores) and read back from its cache (``autopar.cost.cache``), so that the cost model can be
  checked against the CPU test runs. ``get_cluster("local")`` only reads the cache.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from . import cache

__all__ = ["Link", "Device", "Cluster", "PRESETS", "get_cluster", "cached_local"]

GB = 1e9      # datasheets use decimal units
TFLOPS = 1e12


# ---- data ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Link:
    """One level of the interconnect as an alpha-beta model."""
    name: str            # "nvlink", "infiniband", "pcie", "gloo-tcp", ...
    bandwidth: float     # bytes/s, per GPU, per direction
    latency: float       # seconds per message (alpha)
    fits: tuple = ()     # measured links: ((collective, group size, alpha seconds, beta seconds per byte sent
    #                      per rank), ...): whole-collective fits, all groups of that size busy at once,
    #                      that replace the algorithm formulas for those kinds
    hop: float = 0.0     # measured links: seconds a pipeline's small message takes from its send to the
    #                      receiver waiting on it (a synthetic pipeline's replay fitted to its measured
    #                      step); 0: the p2p fit alone
    wake: float = 0.0    # measured links of ranks sharing cores: seconds a rank woken by its message
    #                      waits for a core when all are taken (fitted like hop, hop kept at the
    #                      uncrowded link's)
    skew: tuple = ()     # measured links of ranks sharing cores: ((collective, group size, compute seconds
    #                      before it, alpha seconds), ...): the latency of a small collective that
    #                      follows that much compute on every rank (ranks drift apart in their time
    #                      slices the longer they compute), which replaces the fit's alpha

    def __post_init__(self) -> None:
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise ValueError(f"Link {self.name!r}: bandwidth must be a positive finite number of "
                             f"bytes/s, got {self.bandwidth!r}")
        if not (self.latency >= 0 and math.isfinite(self.latency)):
            raise ValueError(f"Link {self.name!r}: latency must be a non-negative finite number of "
                             f"seconds, got {self.latency!r}")


@dataclass(frozen=True)
class Device:
    """Roofline description of one accelerator (or of one CPU core for the local preset)."""
    name: str
    peak_flops: float          # dense FLOP/s in the training dtype (bf16 on GPUs; fp32 on the local CPU)
    mem_bandwidth: float       # bytes/s
    memory_bytes: int          # device memory capacity
    matmul_efficiency: float   # achieved fraction of peak_flops on large matmuls
    memory_efficiency: float   # achieved fraction of mem_bandwidth
    dtype_bytes: int = 2       # element size of the training dtype (2 for bf16/fp16; 4 for local fp32)
    step_overhead: float = 0.0  # seconds of an optimizer step per parameter tensor beyond its arithmetic
    #                             (AdamW's single-tensor loop on the local CPU; GPU presets: 0, fused)
    op_overhead: float = 0.0   # seconds of framework dispatch per op (measured on the local CPU, where
    #                            small ops are dominated by it; GPU presets: 0, as the host runs ahead
    #                            of the device and kernel launches overlap compute)
    attention_efficiency: Optional[float] = None   # achieved fraction of peak_flops in the fused
    #                            attention kernel (None: as matmul_efficiency; measured on the local CPU,
    #                            where the kernel on small heads runs far below the matmul rate)
    attention_overhead: float = 0.0   # seconds per (batch row, head) slice of the attention kernel beyond
    #                            its FLOPs (the local CPU's per-slice setup; GPU presets: 0)
    pass_overhead: float = 0.0  # seconds per forward + backward of a module or pipeline stage beyond its
    #                            ops (its call, the runtime's autograd functions; local CPU; GPU presets: 0)
    message_overhead: float = 0.0   # host seconds to post and complete one point-to-point message
    #                            (local CPU; GPU presets: 0, the copy engines move it)
    sync_overhead: tuple = ()  # ((dp mode, seconds), ...): host work of the data-parallel runtime per
    #                            parameter tensor and step under each mode (bucket flattening, ZeRO's
    #                            chunks and replicas, ZeRO-3's gathers and hooks; measured on the local
    #                            CPU; GPU presets: none, the host runs ahead of the device)

    @property
    def attention_rate(self) -> float:
        """FLOP/s of the fused attention kernel."""
        eff = self.matmul_efficiency if self.attention_efficiency is None else self.attention_efficiency
        return self.peak_flops * eff

    def __post_init__(self) -> None:
        for field in ("peak_flops", "mem_bandwidth", "memory_bytes", "dtype_bytes"):
            value = getattr(self, field)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"Device {self.name!r}: {field} must be positive and finite, got {value!r}")
        for field in ("matmul_efficiency", "memory_efficiency", "attention_efficiency"):
            value = getattr(self, field)
            if field == "attention_efficiency" and value is None:
                continue
            if not 0 < value <= 1:
                raise ValueError(f"Device {self.name!r}: {field} is a fraction of the peak, in (0, 1]; "
                                 f"got {value!r}")


@dataclass(frozen=True)
class Cluster:
    """Devices of one kind, ``gpus_per_node`` to a node, and the links between them."""
    name: str
    device: Device
    gpus_per_node: int
    intra: Link      # between devices of one node (NVLink; on the local preset: gloo between processes)
    inter: Link      # between nodes (InfiniBand; local: same as intra)
    host: Link       # device <-> host memory (PCIe)
    source: str = ""  # citations, one line each
    mixed_precision: bool = True   # True: bf16 params/grads + fp32 master/Adam state (ZeRO's K=12);
    #                                False (local): fp32 everything
    shared: Optional[Link] = None  # local preset: the link measured with twice as many processes as
    #                                cores (ranks then share cores, and a collective waits for each
    #                                of them to be scheduled); used when a mesh has more ranks than cores
    contention: tuple = ()         # local preset: ((processes, slowdown), ...): how much slower each
    #                                process computes when that many compute at once than alone

    def slowdown(self, processes: int) -> float:
        """Compute slowdown of each of ``processes`` ranks computing at once on this machine
        (local preset: measured at some counts, linear between them, and beyond the last in
        proportion to the processes; without a measurement, processes / cores once they
        outnumber the cores). 1 on the GPU presets: one device per rank."""
        if self.name != "local":
            return 1.0
        return slowdown(self.contention, self.gpus_per_node, processes)

    def __post_init__(self) -> None:
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"Cluster {self.name!r}: gpus_per_node must be a positive integer, "
                             f"got {self.gpus_per_node!r}")

    def axis_link(self, axes: Mapping[str, int], axis: str) -> Link:
        """The link an axis's collective rides on.

        ``axes`` is a mesh's ordered mapping name -> size, outermost first (e.g.
        ``{"pp": 8, "dp": 24, "tp": 8}``; an ``autopar.Mesh`` is accepted too). Ranks are laid out
        row-major, the last axis varying fastest, and each node holds ``gpus_per_node``
        consecutive ranks. The group of ``axis`` spans ranks r, r+stride, ..., r+(size-1)*stride,
        stride being the product of the sizes of the axes after it. The result is ``intra``
        when every such group lies inside one node, ``inter`` otherwise: a collective runs
        at the pace of its slowest group.

        Groups stay inside nodes when the block of stride*size ranks they tile divides
        ``gpus_per_node`` (the usual case of powers of two: stride*size <= gpus_per_node), or
        when the whole mesh fits in one node. A block that does not divide the node size puts
        some group across a node boundary (tp=3 on 8-GPU nodes: ranks 6, 7, 8), hence ``inter``.
        An axis of size 1 has no collective to speak of: ``intra``.
        """
        axes = dict(getattr(axes, "axes", axes))
        if axis not in axes:
            raise ValueError(f"axis {axis!r} is not in the mesh axes {list(axes)} "
                             f"({', '.join(f'{k}={v}' for k, v in axes.items())})")
        names = list(axes)
        size = axes[axis]
        stride = math.prod(axes[name] for name in names[names.index(axis) + 1:])
        world = math.prod(axes.values())
        if size == 1 or world <= self.gpus_per_node or self.gpus_per_node % (stride * size) == 0:
            return self.intra
        return self.inter

    def link_for(self, axes: Mapping[str, int], axis: str) -> Link:
        """The link ``axis``'s collectives ride on a mesh of ``axes``: ``axis_link``, except that
        when the mesh has more ranks than the machine has devices (the local preset's ranks
        sharing cores) every collective rides the ``shared`` link measured that way; an axis
        the mesh lacks rides ``intra``."""
        if self.shared is not None and math.prod(dict(getattr(axes, "axes", axes)).values()) > self.gpus_per_node:
            return self.shared
        return self.axis_link(axes, axis) if axis in dict(getattr(axes, "axes", axes)) else self.intra

    @classmethod
    def from_dict(cls, d: dict) -> "Cluster":
        """Inverse of ``dataclasses.asdict`` (the cache's JSON form)."""
        d = dict(d)
        d["device"] = Device(**{**d["device"], "sync_overhead": tuple(
            tuple(x) for x in d["device"].get("sync_overhead", ()))})
        for level in ("intra", "inter", "host", "shared"):
            if d.get(level):
                link = dict(d[level])
                link["fits"] = tuple(tuple(f) for f in link.get("fits", ()))
                link["skew"] = tuple(tuple(f) for f in link.get("skew", ()))
                d[level] = Link(**link)
        d["contention"] = tuple(tuple(x) for x in d.get("contention", ()))
        return cls(**d)

    def with_(self, **changes: Any) -> "Cluster":
        """A copy with some of the Cluster's own fields replaced (``dataclasses.replace``);
        to change a device number, pass ``device=cluster.device`` replaced likewise."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"Cluster has no field(s) {unknown}; its fields are {sorted(known)} "
                             "(for device numbers pass device=dataclasses.replace(cluster.device, ...))")
        return dataclasses.replace(self, **changes)


# ---- presets ------------------------------------------------------------------------------------

# Per-message latencies: typical NCCL-level figures, an assumption (no datasheet states them).
NVLINK_LATENCY = 5e-6
INFINIBAND_LATENCY = 1e-5
PCIE_LATENCY = 1e-5

# Efficiencies are model parameters calibrated elsewhere (against measured step times); the
# values below are the starting points, not datasheet numbers.
_A100 = Device(
    name="A100-SXM4-80GB",
    peak_flops=312 * TFLOPS,      # NVIDIA A100 Tensor Core GPU datasheet: BF16/FP16 tensor core, dense
    mem_bandwidth=2039 * GB,      # NVIDIA A100 Tensor Core GPU datasheet: HBM2e, 2,039 GB/s (SXM4 80GB)
    memory_bytes=80 * 10**9,      # NVIDIA A100 Tensor Core GPU datasheet: 80 GB (read as decimal GB)
    matmul_efficiency=0.60,       # calibrated elsewhere
    memory_efficiency=0.80,       # calibrated elsewhere
    dtype_bytes=2,
)

_H100 = Device(
    name="H100-SXM5-80GB",
    peak_flops=989 * TFLOPS,      # NVIDIA H100 Tensor Core GPU datasheet: BF16 dense (1,979 with sparsity)
    mem_bandwidth=3350 * GB,      # NVIDIA H100 Tensor Core GPU datasheet: HBM3, 3.35 TB/s (SXM5)
    memory_bytes=80 * 10**9,      # NVIDIA H100 Tensor Core GPU datasheet: 80 GB (read as decimal GB)
    matmul_efficiency=0.55,       # calibrated elsewhere
    memory_efficiency=0.80,       # calibrated elsewhere
    dtype_bytes=2,
)

_DGX_A100 = Cluster(
    name="dgx-a100-80gb",
    device=_A100,
    gpus_per_node=8,              # NVIDIA DGX A100 datasheet: 8x A100 80GB
    # NVIDIA A100 Tensor Core GPU datasheet: NVLink 3rd gen, 600 GB/s total = 300 GB/s per direction
    intra=Link("nvlink", 300 * GB, NVLINK_LATENCY),
    # NVIDIA DGX A100 datasheet: 8x single-port ConnectX-6 200 Gb/s HDR InfiniBand = 25 GB/s per GPU
    inter=Link("infiniband", 25 * GB, INFINIBAND_LATENCY),
    # NVIDIA DGX A100 datasheet: PCIe Gen4; x16 at 16 GT/s = 32 GB/s per direction
    host=Link("pcie", 32 * GB, PCIE_LATENCY),
    source="\n".join([
        "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): 312 TFLOP/s dense BF16/FP16 tensor core, "
        "2,039 GB/s HBM2e, 80 GB, NVLink 3rd gen 600 GB/s total = 300 GB/s per direction",
        "NVIDIA DGX A100 datasheet: 8 GPUs per node, 8x single-port Mellanox ConnectX-6 200 Gb/s HDR "
        "InfiniBand for compute = 25 GB/s per GPU per direction; PCIe Gen4 x16 = 32 GB/s per direction",
        "latencies: NVLink 5 us, InfiniBand 10 us, PCIe 10 us per message: typical NCCL-level figures "
        "(assumption)",
        "efficiencies: matmul 0.60, memory 0.80: model parameters calibrated elsewhere",
    ]),
    mixed_precision=True,
)

_DGX_H100 = Cluster(
    name="dgx-h100",
    device=_H100,
    gpus_per_node=8,              # NVIDIA DGX H100 datasheet: 8x H100 80GB
    # NVIDIA H100 Tensor Core GPU datasheet: NVLink 4th gen, 900 GB/s total = 450 GB/s per direction
    intra=Link("nvlink", 450 * GB, NVLINK_LATENCY),
    # NVIDIA DGX H100 datasheet: 8x ConnectX-7 400 Gb/s NDR InfiniBand = 50 GB/s per GPU
    inter=Link("infiniband", 50 * GB, INFINIBAND_LATENCY),
    # NVIDIA DGX H100 datasheet: PCIe Gen5; x16 at 32 GT/s = 64 GB/s per direction
    host=Link("pcie", 64 * GB, PCIE_LATENCY),
    source="\n".join([
        "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOP/s dense BF16 (1,979 with sparsity), "
        "3.35 TB/s HBM3, 80 GB, NVLink 4th gen 900 GB/s total = 450 GB/s per direction",
        "NVIDIA DGX H100 datasheet: 8 GPUs per node, 8x ConnectX-7 400 Gb/s NDR InfiniBand = 50 GB/s "
        "per GPU per direction; PCIe Gen5 x16 = 64 GB/s per direction",
        "latencies: NVLink 5 us, InfiniBand 10 us, PCIe 10 us per message: typical NCCL-level figures "
        "(assumption)",
        "efficiencies: matmul 0.55, memory 0.80: model parameters calibrated elsewhere",
    ]),
    mixed_precision=True,
)

PRESETS: dict[str, Cluster] = {c.name: c for c in (_DGX_A100, _DGX_H100)}


def cached_local(path: str | None = None) -> Optional[Cluster]:
    """The local preset if this machine was calibrated before (nothing is measured), else None."""
    entry = cache.load_local(path)
    try:
        return Cluster.from_dict(entry) if entry is not None else None
    except (TypeError, KeyError, ValueError):
        return None


def get_cluster(spec: "Cluster | str") -> Cluster:
    """``spec`` is a Cluster (returned as is), a preset name (``"dgx-a100-80gb"``,
    ``"dgx-h100"``) or ``"local"``: this machine as ``python -m autopar calibrate`` measured it,
    read from its cache (nothing is measured here; without a cache it is an error that says
    how to make one)."""
    if isinstance(spec, Cluster):
        return spec
    if isinstance(spec, str):
        if spec == "local":
            local = cached_local()
            if local is None:
                problem = cache.problem()
                found = (f"the cache is unusable: {problem}" if problem else
                         "it has not been measured here yet")
                raise ValueError(f"cluster 'local' is this machine as measured by `python -m autopar calibrate` "
                                 f"(about a minute; cached in {cache.cache_path()}), and {found}: run that "
                                 "once (it rewrites the cache), or pass a preset ('dgx-h100', 'dgx-a100-80gb') "
                                 "or a Cluster")
            return local
        if spec in PRESETS:
            return PRESETS[spec]
    names = ", ".join(repr(n) for n in [*PRESETS, "local"])
    raise ValueError(f"unknown cluster {spec!r}: expected one of {names}, or a Cluster object "
                     "(autopar.cost.cluster.Cluster) describing your own hardware")


def slowdown(contention: tuple, cores: int, processes: int) -> float:
    """Compute slowdown of each of ``processes`` ranks computing at once on ``cores`` cores,
    from a measured ``contention`` table ((processes, slowdown), ...): linear between the
    measured counts, beyond the last in proportion to the processes; processes / cores once
    they outnumber the cores without a measurement."""
    points = sorted({(1, 1.0), *((int(k), float(f)) for k, f in contention)})
    if len(points) == 1:
        return max(1.0, processes / cores)
    for (k0, f0), (k1, f1) in zip(points, points[1:]):
        if processes <= k1:
            return f0 + (f1 - f0) * (max(processes, k0) - k0) / (k1 - k0)
    k, f = points[-1]
    return f * processes / k
