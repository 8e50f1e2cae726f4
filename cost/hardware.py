"""The hardware description types of the cost model, in SI units: ``Link``, ``Device``, ``Cluster``.

A cluster is one kind of device, described by roofline numbers (peak dense matmul FLOP/s per
dtype, memory bandwidth, memory capacity, and the fractions of those peaks that real kernels
achieve), plus one link per level of the interconnect:

* ``intra``: between devices of one node (NVLink on a DGX);
* ``inter``: between nodes (InfiniBand on a DGX);
* ``host``:  between a device and its host's memory (PCIe on a DGX).

A link is an alpha-beta model: a message of ``b`` bytes takes ``latency + b / bandwidth``
seconds, ``bandwidth`` being per GPU and per direction. Units throughout: bytes, seconds,
FLOP/s, bytes/s. What precision a step runs in is the plan's (``Plan(param_dtype=...)``, else
the model's own dtype): a cluster says how fast each dtype's matmuls run, not which one trains.

The presets and the local preset's cache are ``cost.cluster``'s, which exports these types too.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

__all__ = ["Link", "Device", "Cluster", "slowdown"]

@dataclass(frozen=True)
class Link:
    """One level of the interconnect as an alpha-beta model."""
    name: str            # "nvlink", "infiniband", "pcie", "gloo-tcp", ...
    bandwidth: float     # bytes/s, per GPU, per direction
    latency: float       # seconds per message (alpha)
    fits: tuple = ()     # measured links: ((collective, group size, alpha seconds, beta seconds per byte sent
    #                      per rank), ...): whole-collective fits, all groups of that size busy at once,
    #                      that replace the algorithm formulas for those kinds
    hop: float = 0.0     # measured links: seconds a pipeline's message costs its schedule as a latency
    #                      from its send to the receiver waiting on it (the replay of autopar's own
    #                      1F1B pipelines fitted to their measured schedules); 0: the p2p fit alone
    hop_interleaved: float = 0.0   # measured links: the same under the interleaved schedule (every
    #                      chunk boundary a message, each rank's chunks taking turns), fitted likewise
    #                      on autopar's own interleaved pipelines; 0: ``hop``
    wake: float = 0.0    # measured links of ranks sharing cores: seconds a rank woken by its message
    #                      waits for a core when all are taken (fitted like hop, hop kept at the
    #                      uncrowded link's)
    skew: tuple = ()     # measured links (the local preset's): ((collective, group size, compute seconds
    #                      before it, alpha seconds), ...): the latency of a small collective that
    #                      follows that much compute on every rank, round after round with no
    #                      barrier to line them up (ranks drift apart, the more so when they share
    #                      cores and the longer they compute), which replaces the fit's alpha
    skew_scale: float = 1.0   # measured links: what a collective of autopar's own tensor-parallel
    #                      steps blocks its rank for, over what ``skew`` gives at the CPU work its
    #                      steps do between collectives (the calibration's tp stacks); every skew
    #                      latency is taken at this scale: the table's shape along the compute, its
    #                      level on the runtime's own steps. 1: the table as measured
    skew_first: float = 1.0   # measured links: a factor on the skew table's shortest compute point
    #                      (every kind but p2p, every group size), the latency after little compute read
    #                      on autopar's own steps rather than on the probe's matmuls; between that point
    #                      and the next the table interpolates as measured. Set on the link of ranks
    #                      sharing cores, where the runtime's tp steps of the calibration's stacks (next
    #                      to no compute between their collectives) read 0.45-0.8 of that point, while the
    #                      models' steps, which compute longer between theirs, read the longer points
    #                      as measured (benchmarks/bench_holdout.py; BENCHMARKS.md, bench_holdout.py). 1: the table as measured
    skew_pooled: bool = False  # measured links: the kinds of a group size share one skew table, the
    #                      mean of their points (p2p apart), taken at ``skew_scale``. Set where the
    #                      scale measures the level on the runtime's own steps (the 2-process link):
    #                      there an all-gather or reduce-scatter of a tp+sp step blocks its rank as
    #                      long as a tp step's all-reduce (0.76-0.89 ms each; BENCHMARKS.md, bench_holdout.py),
    #                      while one calibration's tables of the kinds differ by their noise (a point
    #                      moves by 20% between calibrations), and a table of one kind priced the
    #                      others at the ratio of two noisy points. False: each kind its own
    #                      (ranks sharing cores, whose kinds differ for real: 4 ranks' all-gather reads
    #                      about 30% below their all-reduce in every calibration)
    tail: tuple = ()     # measured links: (seconds, seconds per second): what the exchanges after a
    #                      pipeline's schedule (the tied gradients', the loss broadcast) cost the rank
    #                      that finishes it last beyond their p2p time, as a + b x how long the other
    #                      ranks had waited for it (fitted on autopar's own 1F1B pipelines); (): none
    overlap_loss: float = 0.0   # measured links: the fraction of the communication that overlapping it
    #                      with compute does not hide (on CPU cores the collectives' own threads take
    #                      turns with the compute): the step moves that far from the overlapped one
    #                      to the compute plus the time some communication lane was busy; 0: overlap
    #                      hides it all

    def __post_init__(self) -> None:
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise ValueError(f"Link {self.name!r}: bandwidth must be a positive finite number of "
                             f"bytes/s, got {self.bandwidth!r}")
        if not (self.latency >= 0 and math.isfinite(self.latency)):
            raise ValueError(f"Link {self.name!r}: latency must be a non-negative finite number of "
                             f"seconds, got {self.latency!r}")
        if self.tail and not (len(self.tail) == 2 and all(math.isfinite(x) and x >= 0 for x in self.tail)):
            raise ValueError(f"Link {self.name!r}: tail must be (seconds, seconds per second of waiting), both "
                             f"finite and >= 0, or (); got {self.tail!r}")
        if not (self.skew_scale > 0 and math.isfinite(self.skew_scale)):
            raise ValueError(f"Link {self.name!r}: skew_scale must be a positive finite factor, got "
                             f"{self.skew_scale!r}")
        if not (self.skew_first > 0 and math.isfinite(self.skew_first)):
            raise ValueError(f"Link {self.name!r}: skew_first must be a positive finite factor, got "
                             f"{self.skew_first!r}")
        if not 0.0 <= self.overlap_loss <= 1.0:
            raise ValueError(f"Link {self.name!r}: overlap_loss must be a fraction in [0, 1], got "
                             f"{self.overlap_loss!r}")


@dataclass(frozen=True)
class Device:
    """Roofline description of one accelerator (or of one CPU core for the local preset)."""
    name: str
    peak_flops: float          # dense FLOP/s of 16-bit (bf16/fp16) matmuls: tensor cores on GPUs; on the
    #                            local CPU the measured matmul rate (of fp32: the calibration times no other
    #                            dtype, so it prices every dtype there)
    mem_bandwidth: float       # bytes/s
    memory_bytes: int          # device memory capacity
    matmul_efficiency: float   # achieved fraction of the peak on large matmuls (of each dtype's peak alike)
    memory_efficiency: float   # achieved fraction of mem_bandwidth
    step_overhead: float = 0.0  # seconds of an optimizer step per parameter tensor (local CPU: AdamW's
    #                             single-tensor loop timed on 64 x 64 tensors, so with that size's
    #                             arithmetic, which optimizer_time's roofline term charges again;
    #                             GPU presets: 0, fused)
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
    backward_op_ratio: float = 2.0   # a backward's framework time per forward op, in op_overheads (2: each
    #                            forward op's input and weight gradients; the local CPU measures it)
    backward_pass_share: float = 2 / 3   # the part of pass_overhead the backward takes (local CPU: measured)
    message_overhead: float = 0.0   # host seconds to post and complete one point-to-point message
    #                            (local CPU; GPU presets: 0, the copy engines move it)
    split_pass_overhead: float = 0.0   # host seconds a zero-bubble schedule's separate weight-gradient (W)
    #                            action adds per micro-batch and stage, beyond its matmuls (local CPU)
    split_op_overhead: float = 0.0     # the same, per matmul with a parameter weight in the stage (each
    #                            one's weight gradient W defers; local CPU; GPU presets: 0)
    split_forward_share: float = 0.0   # the part of that growth the F actions take (the autograd function
    #                            that defers a matmul's weight gradient is called in the forward; local CPU)
    sync_overhead: tuple = ()  # ((dp mode, seconds), ...): host work of the data-parallel runtime per
    #                            parameter tensor and step under each mode (bucket flattening, ZeRO's
    #                            chunks and replicas, ZeRO-3's gathers and hooks; measured on the local
    #                            CPU; GPU presets: none, the host runs ahead of the device)
    collective_overhead: float = 0.0   # host seconds the runtime spends issuing and completing one
    #                            tensor-parallel collective beyond the wire (its autograd function,
    #                            staging copies, the flight recorder; local CPU; GPU presets: 0)
    op_weights: tuple = ()     # ((op name, forward weight, backward weight), ...): an op's dispatch over
    #                            the mean of the calibration probe's ops, forward and backward
    #                            (``cost.compute.dispatch_ops``; local CPU, measured on tiny tensors;
    #                            GPU presets: none, every op weighs 1 and op_overhead is 0)
    fp32_flops: Optional[float] = None   # dense FLOP/s of fp32 matmuls without tensor cores (GPUs' CUDA
    #                            cores); None: peak_flops (the local CPU)
    tf32_flops: Optional[float] = None   # dense FLOP/s of TF32 tensor cores, the rate fp32 matmuls run at
    #                            where set: PyTorch runs them on TF32 under
    #                            ``torch.set_float32_matmul_precision("high")`` (its default, "highest",
    #                            runs them at fp32_flops: replace this with None to price that); None:
    #                            fp32 matmuls at fp32_flops

    def matmul_peak(self, dtype=None) -> float:
        """Peak dense FLOP/s of a matmul whose operands are ``dtype`` (a ``torch.dtype``; None:
        16-bit): 16-bit and narrower floats at ``peak_flops``; fp32 (and wider) at ``tf32_flops``
        where set, else ``fp32_flops``, else ``peak_flops``."""
        if dtype is None or dtype.itemsize <= 2:
            return self.peak_flops
        if self.tf32_flops is not None and dtype.itemsize == 4:
            return self.tf32_flops
        return self.fp32_flops if self.fp32_flops is not None else self.peak_flops

    def attention_rate_of(self, dtype=None) -> float:
        """Achieved FLOP/s of the fused attention kernel on ``dtype`` operands: the dtype's
        matmul peak at the attention efficiency (None: the matmul efficiency)."""
        eff = self.matmul_efficiency if self.attention_efficiency is None else self.attention_efficiency
        return self.matmul_peak(dtype) * eff

    @property
    def attention_rate(self) -> float:
        """FLOP/s of the fused attention kernel on 16-bit operands (``attention_rate_of``)."""
        return self.attention_rate_of(None)

    def __post_init__(self) -> None:
        for field in ("peak_flops", "mem_bandwidth", "memory_bytes"):
            value = getattr(self, field)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"Device {self.name!r}: {field} must be positive and finite, got {value!r}")
        for field in ("fp32_flops", "tf32_flops"):
            value = getattr(self, field)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"Device {self.name!r}: {field} must be positive and finite, or None; got "
                                 f"{value!r}")
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
    shared: Optional[Link] = None  # local preset: the link measured with twice as many processes as
    #                                cores (ranks then share cores, and a collective waits for each
    #                                of them to be scheduled); used when a mesh has more ranks than cores
    contention: tuple = ()         # local preset: ((processes, slowdown), ...): how much slower each
    #                                process computes when that many compute at once than alone
    shared_sync: tuple = ()        # local preset: ((dp mode, factor), ...): the data-parallel runtime's
    #                                host work per tensor (``Device.sync_overhead``) on ranks sharing cores,
    #                                over its charge at the measured contention: the factor at which the
    #                                model's step of the calibration's stacks under that mode on those
    #                                ranks grows with the blocks as the measured step does, their
    #                                collectives at the level the stacks' own tp steps read. ZeRO-3's
    #                                (its gathers' layout and hooks lie between its waits on the gathers,
    #                                while other ranks wait too: the calibration reads 0.41-0.73;
    #                                BENCHMARKS.md, bench_holdout.py). (): every mode at the contention's
    #                                slowdown in full
    fingerprint: tuple = ()        # local preset: ((part, seconds), ...) of a reference workload timed at
    #                                calibration (``cost.drift``): reading the preset checks it again
    citations: tuple = ()          # presets: ((field, source), ...), every number's source ("device.peak_flops",
    #                                "intra.bandwidth", ...; ``cited_fields`` lists the fields); ``source``
    #                                defaults to them, one line each

    def slowdown(self, processes: int) -> float:
        """Compute slowdown of each of ``processes`` ranks computing at once on this machine
        (local preset: measured at some counts, linear between them, and beyond the last in
        proportion to the processes; without a measurement, processes / cores once they
        outnumber the cores). 1 on the GPU presets: one device per rank."""
        if self.name != "local":
            return 1.0
        return slowdown(self.contention, self.gpus_per_node, processes)

    def __post_init__(self) -> None:
        if self.citations and not self.source:
            object.__setattr__(self, "source", "\n".join(f"{k}: {v}" for k, v in self.citations))
        if not all(len(x) == 2 and x[1] > 0 and math.isfinite(x[1]) for x in self.shared_sync):
            raise ValueError(f"Cluster {self.name!r}: shared_sync must be ((dp mode, positive finite factor), ...), "
                             f"got {self.shared_sync!r}")
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
        d["device"] = Device(**{**d["device"], **{k: tuple(tuple(x) for x in d["device"].get(k, ()))
                                                  for k in ("sync_overhead", "op_weights")}})
        for level in ("intra", "inter", "host", "shared"):
            if d.get(level):
                link = dict(d[level])
                link["fits"] = tuple(tuple(f) for f in link.get("fits", ()))
                link["skew"] = tuple(tuple(f) for f in link.get("skew", ()))
                link["tail"] = tuple(link.get("tail", ()))
                d[level] = Link(**link)
        d["contention"] = tuple(tuple(x) for x in d.get("contention", ()))
        d["citations"] = tuple(tuple(x) for x in d.get("citations", ()))
        d["fingerprint"] = tuple(tuple(x) for x in d.get("fingerprint", ()))
        d["shared_sync"] = tuple(tuple(x) for x in d.get("shared_sync", ()))
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


def slowdown(contention: tuple, cores: int, processes: int) -> float:
    """Compute slowdown of each of ``processes`` ranks computing at once on ``cores`` cores,
    from a measured ``contention`` table ((processes, slowdown), ...): linear between the
    measured counts, beyond the last in proportion to the processes; processes / cores once
    they outnumber the cores without a measurement."""
    points = sorted({(1, 1.0), *((int(k), float(f)) for k, f in contention)})
    if len(points) == 1:
        return max(1.0, processes / cores)
    for (k0, f0), (k1, f1) in zip(points, points[1:]):
        if processes == k1:          # a measured count: its measurement, not a rounding of it
            return f1
        if processes < k1:
            return f0 + (f1 - f0) * (max(processes, k0) - k0) / (k1 - k0)
    k, f = points[-1]
    return f * processes / k
