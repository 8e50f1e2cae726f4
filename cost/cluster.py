"""Cluster descriptions for the cost model: the presets, the local preset read from its cache,
and ``get_cluster``. The types (``Link``, ``Device``, ``Cluster``, ``slowdown``: what the
hardware can do, in SI units) are ``cost.hardware``'s, exported here too.

Where the numbers come from:

* Presets (``PRESETS``): every number has its source, next to it and in the preset's
  ``citations`` (field -> source). Peak FLOP/s, memory bandwidth and capacity, and link
  bandwidths are vendor datasheet figures. Efficiencies come from named measurements: the A100
  matmul efficiency is fitted on one published run (BLOOM-176B) that no validation run shares,
  the H100's scales it by published maximum-achievable-matmul measurements, and memory
  efficiencies are measured streaming kernels (see the presets' section). Latencies are
  typical NCCL-level per-message figures, an assumption rather than a datasheet number.
* ``"local"``: this machine, measured once by ``python -m autopar calibrate``
  (``autopar.cost.calibration``: matmuls, copies, attention, framework time per op and per
  pass, gloo collectives among busy ranks, autopar's own and a synthetic pipeline, the slowdown
  of ranks sharing cores) and read back from its cache (``autopar.cost.cache``), so that the cost model can be
  checked against the CPU test runs. ``get_cluster("local")`` only reads the cache.
"""
from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Optional

from . import cache, drift
from .hardware import Cluster, Device, Link, slowdown

__all__ = ["Link", "Device", "Cluster", "PRESETS", "get_cluster", "cached_local", "cited_fields", "slowdown"]

GB = 1e9      # datasheets use decimal units
TFLOPS = 1e12


# ---- presets ------------------------------------------------------------------------------------
#
# Every number of a preset has its source next to it, and again in ``Cluster.citations`` (field ->
# source; tests/test_cluster.py checks that every field is cited). Datasheet figures cite the
# datasheet; efficiencies cite the measurement they come from:
#
# * matmul_efficiency, A100: the one value at which autopar's estimate of BLOOM-176B's published
#   run (Bekman, "The Technology Behind BLOOM Training", Hugging Face blog, July 2022: 156 TFLOP/s
#   per A100 80GB; 384 GPUs, TP=4, PP=12, DP=8, ZeRO-1, micro-batch 2, global batch 2,048, activation
#   checkpointing; estimated as an fp32 model under Plan(param_dtype=torch.bfloat16), gradients summed
#   in fp32 as DeepSpeed's bf16 optimizer sums them) equals that throughput, every other number as below.
#   The same fraction of the peak prices TF32's and fp32's matmuls (no run of those is published)
#   (autopar/published_runs.py ``fit_matmul_efficiency``; `python benchmarks/bench_plan.py --fit`
#   prints it). That run is the calibration; the runs the model is then checked against
#   (Narayanan et al. 2021, Korthikanti et al. 2022, torchtitan 2024) take no part in it.
# * matmul_efficiency, H100: the A100 value scaled by the two devices' ratio of maximum achievable
#   matmul FLOP/s to peak (Bekman, ml-engineering, "Maximum Achievable Matmul FLOPS comparison
#   table", bf16, CUDA 12.1: A100 SXM 267.9 of 312 TFLOP/s = 85.9%, H100 SXM 792.1 of 989 = 80.1%):
#   the same software reaching the same fraction of each device's achievable matmul rate.
# * memory_efficiency: measured streaming kernels (A100 80GB SXM: a read kernel at 1.80 of 2.04 TB/s,
#   88%, Nsight Compute agreeing, NVIDIA developer forums, "Trouble to reach peak bandwidth of A100",
#   2025; H100 SXM: coalesced matrix loads at 2.8 of 3.35 TB/s, 84%, Nsight Compute, "GPU Memory
#   Bandwidth: What Your Profiler Isn't Telling You", mikamirai.com, March 2026).
# * latencies: per-message alphas of NCCL-level collectives, an assumption (no datasheet gives them;
#   they matter only for small messages).

# Per-message latencies: typical NCCL-level figures, an assumption (no datasheet states them).
NVLINK_LATENCY = 5e-6
INFINIBAND_LATENCY = 1e-5
PCIE_LATENCY = 1e-5

_LATENCY = "assumption: a typical NCCL-level per-message latency (no datasheet states one)"
_NO_HOST = ("0 on GPU presets: the host runs ahead of the device, so framework time per op, pass, message and "
            "optimizer tensor hides under kernels (fused optimizer); measured only on the local preset")
_MAMF = ("Bekman, ml-engineering, 'Maximum Achievable Matmul FLOPS comparison table' (bf16, CUDA 12.1): "
         "A100 SXM 267.9 of 312 TFLOP/s = 85.9%, H100 SXM 792.1 of 989 TFLOP/s = 80.1%")
A100_MATMUL_EFFICIENCY = 0.601   # fitted on BLOOM-176B's published run (see above); bench_plan.py --fit
H100_MATMUL_EFFICIENCY = round(A100_MATMUL_EFFICIENCY * (792.1 / 989) / (267.9 / 312), 3)   # MAMF ratio


_TF32_USE = ("PyTorch runs fp32 matmuls on TF32 tensor cores under torch.set_float32_matmul_precision('high') "
             "(PyTorch CUDA semantics, 'TensorFloat-32 (TF32) on Ampere (and later) devices'; its default, "
             "'highest', does not): the preset assumes fp32 training sets it; tf32_flops=None prices the default")


def _device_citations(chip: str, datasheet: str, matmul: str, memory: str, fp32: str, tf32: str) -> tuple:
    return (
        ("device.peak_flops", f"NVIDIA {chip} datasheet: {datasheet} (dense BF16 tensor core)"),
        ("device.fp32_flops", fp32),
        ("device.tf32_flops", f"{tf32}; {_TF32_USE}"),
        ("device.mem_bandwidth", f"NVIDIA {chip} datasheet: {datasheet} (memory bandwidth)"),
        ("device.memory_bytes", f"NVIDIA {chip} datasheet: {datasheet} (capacity, read as decimal GB)"),
        ("device.matmul_efficiency", matmul),
        ("device.memory_efficiency", memory),
        ("device.step_overhead", _NO_HOST),
        ("device.op_overhead", _NO_HOST),
        ("device.attention_efficiency", "None: the fused attention kernel at the matmul efficiency (flash "
                                        "attention's FLOPs are matmuls)"),
        ("device.attention_overhead", _NO_HOST),
        ("device.pass_overhead", _NO_HOST),
        ("device.backward_op_ratio", "2: a backward runs each forward op's input and weight gradients; on GPU "
                                     "presets it multiplies op_overhead, which is 0 (the host runs ahead)"),
        ("device.backward_pass_share", "2/3: backward's share of a pass as of its ops; on GPU presets it "
                                       "splits pass_overhead, which is 0"),
        ("device.message_overhead", _NO_HOST),
        ("device.split_pass_overhead", _NO_HOST),
        ("device.split_op_overhead", _NO_HOST),
        ("device.split_forward_share", "0 on GPU presets: the share of split_pass_overhead and split_op_overhead, "
                                       "which are 0 there (the host runs ahead)"),
        ("device.collective_overhead", _NO_HOST),
        ("device.op_weights", "none on GPU presets: every op weighs 1 and op_overhead, which they multiply, is 0 "
                              "(the host runs ahead); measured only on the local preset"),
        ("device.sync_overhead", "none on GPU presets: the data-parallel runtime's host work per tensor hides "
                                 "under kernels as the host runs ahead; measured only on the local preset"),
    )


_A100 = Device(
    name="A100-SXM4-80GB",
    peak_flops=312 * TFLOPS,      # NVIDIA A100 Tensor Core GPU datasheet: BF16/FP16 tensor core, dense
    mem_bandwidth=2039 * GB,      # NVIDIA A100 Tensor Core GPU datasheet: HBM2e, 2,039 GB/s (SXM4 80GB)
    memory_bytes=80 * 10**9,      # NVIDIA A100 Tensor Core GPU datasheet: 80 GB (read as decimal GB)
    matmul_efficiency=A100_MATMUL_EFFICIENCY,   # fitted on BLOOM-176B's published run (see above)
    memory_efficiency=0.88,       # NVIDIA developer forums: a read kernel at 1.80 of 2.04 TB/s (88%)
    fp32_flops=19.5 * TFLOPS,     # NVIDIA A100 Tensor Core GPU datasheet: FP32 19.5 TFLOP/s
    tf32_flops=156 * TFLOPS,      # NVIDIA A100 Tensor Core GPU datasheet: TF32 tensor core 156 TFLOP/s, dense
)

_H100 = Device(
    name="H100-SXM5-80GB",
    peak_flops=989 * TFLOPS,      # NVIDIA H100 Tensor Core GPU datasheet: BF16 dense (1,979 with sparsity)
    mem_bandwidth=3350 * GB,      # NVIDIA H100 Tensor Core GPU datasheet: HBM3, 3.35 TB/s (SXM5)
    memory_bytes=80 * 10**9,      # NVIDIA H100 Tensor Core GPU datasheet: 80 GB (read as decimal GB)
    matmul_efficiency=H100_MATMUL_EFFICIENCY,   # the A100 value x the MAMF ratio 80.1% / 85.9%
    memory_efficiency=0.84,       # coalesced matrix loads at 2.8 of 3.35 TB/s (84%), Nsight Compute
    fp32_flops=66.9 * TFLOPS,     # NVIDIA H100 architecture whitepaper: SXM5 FP32 (non-tensor) 66.9 TFLOP/s
    tf32_flops=494.7 * TFLOPS,    # NVIDIA H100 architecture whitepaper: SXM5 TF32 tensor 494.7 TFLOP/s, dense
)

_A100_MATMUL = (f"{A100_MATMUL_EFFICIENCY}: fitted on BLOOM-176B's published run (Bekman, 'The Technology Behind "
                "BLOOM Training', Hugging Face blog, July 2022: 156 TFLOP/s per A100 80GB, TP=4 PP=12 DP=8, "
                "ZeRO-1, micro-batch 2, global batch 2,048, activation checkpointing): the value at which "
                "autopar's estimate of that run equals it (autopar/published_runs.py, bench_plan.py --fit); "
                "no validation run takes part")
_H100_MATMUL = (f"{H100_MATMUL_EFFICIENCY}: the A100 value x (80.1% / 85.9%), the ratio of the two devices' maximum "
                f"achievable matmul fractions ({_MAMF})")
_A100_MEMORY = ("0.88: NVIDIA developer forums, 'Trouble to reach peak bandwidth of A100' (2025): a read kernel on "
                "an A100 80GB SXM at 1.80 of 2.04 TB/s (88%), Nsight Compute agreeing")
_H100_MEMORY = ("0.84: 'GPU Memory Bandwidth: What Your Profiler Isn't Telling You' (mikamirai.com, March 2026): "
                "coalesced matrix loads on an H100 SXM at 2.8 of 3.35 TB/s (84%), Nsight Compute")
_A100_FP32 = "NVIDIA A100 Tensor Core GPU datasheet: FP32 19.5 TFLOP/s (CUDA cores, no tensor cores)"
_A100_TF32 = "NVIDIA A100 Tensor Core GPU datasheet: TF32 tensor core 156 TFLOP/s dense (312 with sparsity)"
_H100_FP32 = ("NVIDIA H100 Tensor Core GPU Architecture whitepaper, table 'NVIDIA H100 compared to A100' (H100 SXM5): "
              "peak FP32 (non-tensor) 66.9 TFLOP/s")
_H100_TF32 = ("NVIDIA H100 Tensor Core GPU Architecture whitepaper, table 'NVIDIA H100 compared to A100' (H100 SXM5): "
              "peak TF32 tensor 494.7 TFLOP/s dense (989.4 with sparsity)")

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
    citations=_device_citations("A100 Tensor Core GPU", "SXM4 80GB: 312 TFLOP/s, 2,039 GB/s HBM2e, 80 GB",
                                _A100_MATMUL, _A100_MEMORY, _A100_FP32, _A100_TF32) + (
        ("gpus_per_node", "NVIDIA DGX A100 datasheet: 8x A100 80GB"),
        ("intra.bandwidth", "NVIDIA A100 Tensor Core GPU datasheet: NVLink 3rd gen 600 GB/s total = 300 GB/s "
                            "per direction"),
        ("intra.latency", _LATENCY + ": NVLink 5 us"),
        ("inter.bandwidth", "NVIDIA DGX A100 datasheet: 8x single-port ConnectX-6 200 Gb/s HDR InfiniBand for "
                            "compute = 25 GB/s per GPU per direction"),
        ("inter.latency", _LATENCY + ": InfiniBand 10 us"),
        ("host.bandwidth", "NVIDIA DGX A100 datasheet: PCIe Gen4 x16 = 32 GB/s per direction"),
        ("host.latency", _LATENCY + ": PCIe 10 us"),
    ),
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
    citations=_device_citations("H100 Tensor Core GPU", "SXM5: 989 TFLOP/s (1,979 with sparsity), 3.35 TB/s "
                                "HBM3, 80 GB", _H100_MATMUL, _H100_MEMORY, _H100_FP32, _H100_TF32) + (
        ("gpus_per_node", "NVIDIA DGX H100 datasheet: 8x H100 80GB"),
        ("intra.bandwidth", "NVIDIA H100 Tensor Core GPU datasheet: NVLink 4th gen 900 GB/s total = 450 GB/s "
                            "per direction"),
        ("intra.latency", _LATENCY + ": NVLink 5 us"),
        ("inter.bandwidth", "NVIDIA DGX H100 datasheet: 8x ConnectX-7 400 Gb/s NDR InfiniBand = 50 GB/s per GPU "
                            "per direction"),
        ("inter.latency", _LATENCY + ": InfiniBand 10 us"),
        ("host.bandwidth", "NVIDIA DGX H100 datasheet: PCIe Gen5 x16 = 64 GB/s per direction"),
        ("host.latency", _LATENCY + ": PCIe 10 us"),
    ),
)

# The H100s of torchtitan's published Llama 3.1 runs (benchmarks/llama3_h100_202412_torchtitan.md):
# Meta's Grand Teton hosts, 8 H100 each with NVLink, 96 GB HBM2e at 2.4 TB/s, a 400 Gb/s RDMA
# network per GPU, at a 500 W power limit. The peak under that limit is not published ("between
# SXM and NVL"): the SXM figure stands, as in torchtitan's own MFU.
_GT_H100 = dataclasses.replace(_H100, name="H100-HBM2e-96GB-500W", mem_bandwidth=2400 * GB,
                               memory_bytes=96 * 2**30)
_GRAND_TETON = _DGX_H100.with_(
    name="grand-teton-h100", device=_GT_H100, source="",
    inter=Link("rdma", 50 * GB, INFINIBAND_LATENCY),
    citations=tuple((k, v) for k, v in _DGX_H100.citations
                    if k not in ("device.mem_bandwidth", "device.memory_bytes", "device.peak_flops",
                                 "inter.bandwidth", "gpus_per_node", "intra.bandwidth")) + (
        ("device.peak_flops", "989 TFLOP/s, the H100 SXM datasheet's dense BF16: torchtitan's benchmark says the "
                              "500 W parts' peak lies between SXM's and NVL's and is not known; its MFU uses SXM's"),
        ("device.mem_bandwidth", "torchtitan benchmarks/llama3_h100_202412_torchtitan.md: HBM2e, 2.4 TB/s"),
        ("device.memory_bytes", "torchtitan benchmarks/llama3_h100_202412_torchtitan.md: 96 GB HBM2e (read as "
                                "GiB, as its memory readings are)"),
        ("gpus_per_node", "torchtitan benchmarks/llama3_h100_202412_torchtitan.md: 8 H100 per Grand Teton host"),
        ("intra.bandwidth", "NVIDIA H100 Tensor Core GPU datasheet (SXM5): NVLink 4th gen 900 GB/s total = "
                            "450 GB/s per direction (torchtitan: 'fully connected with NVLink')"),
        ("inter.bandwidth", "torchtitan benchmarks/llama3_h100_202412_torchtitan.md: RDMA network, 400 Gb/s "
                            "per GPU = 50 GB/s per direction"),
    ),
)

PRESETS: dict[str, Cluster] = {c.name: c for c in (_DGX_A100, _DGX_H100, _GRAND_TETON)}


def cited_fields(cluster: Cluster) -> list[str]:
    """The fields of a preset that need a source: every number of its device, the bandwidth and
    latency of each link, its node size. (The measured-link fields, ``shared`` and
    ``contention`` belong to the local preset, which records its measurements in ``source``.)"""
    device = [f"device.{f.name}" for f in dataclasses.fields(Device) if f.name != "name"]
    links = [f"{level}.{f}" for level in ("intra", "inter", "host") for f in ("bandwidth", "latency")]
    return device + links + ["gpus_per_node"]


def cached_local(path: str | None = None) -> Optional[Cluster]:
    """The local preset if this machine was calibrated before, else None. The first read in a
    process on an otherwise idle machine times the preset's reference workload again
    (``cost.drift``, about 15 ms) and warns if the machine's speed has moved too far from the
    calibration's."""
    entry = cache.load_local(path)
    try:
        cluster = Cluster.from_dict(entry) if entry is not None else None
    except (TypeError, KeyError, ValueError):
        return None
    if cluster is not None and cluster.fingerprint and cluster.fingerprint not in _CHECKED and drift.machine_idle():
        _CHECKED.add(cluster.fingerprint)
        when = re.search(r" at (\S+) by ", cluster.source)
        message = drift.stale_warning(cluster.fingerprint, when.group(1) if when else "")
        if message:
            warnings.warn(message, RuntimeWarning, stacklevel=2)
    return cluster


_CHECKED: set = set()     # the fingerprints this process has checked (each once)


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
