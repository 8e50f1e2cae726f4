"""The calibration's compute probes: this process alone times matmuls, copies, pointwise ops,
attention and an optimizer step on one thread (each call's inputs from the next copy of a pool
that outgrows a core's cache: ``input_pool``); ranks of a pool loop the synthetic stack at once
for the contention of ranks sharing cores (``contention_probe``). Also what the preset says of
the machine itself (``cpu_model``, ``total_ram``)."""
from __future__ import annotations

import itertools
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

from .stack import stack_seconds

__all__ = ["timed_median", "measure_matmul_flops", "measure_memory_bandwidth", "measure_pointwise_efficiency",
           "measure_matmul_efficiency", "measure_attention", "measure_step_overhead", "input_pool", "rotating",
           "contention_probe", "cpu_model", "total_ram", "MATMUL_SIZES", "MATMUL_SECONDS", "COPY_BYTES",
           "COPY_SECONDS", "POOL_BYTES", "LINEAR_SHAPES", "ATTENTION_SHAPES", "CONTENTION_SECONDS",
           "CONTENTION_READINGS", "CONTENTION_READING_SECONDS"]

MATMUL_SIZES = (384, 768)
MATMUL_SECONDS = 0.25                   # timed seconds per matmul size
COPY_BYTES = 64 * 2**20
COPY_SECONDS = 0.25
# the compute probes take each call's inputs from the next of as many copies as fill this: more
# than a core's own cache (2 MiB of L2 a core on the machine of BENCHMARKS.md), so they read them
# from memory shared with the other cores, as a training step's activations and weights are read
POOL_BYTES = 32 * 2**20
CONTENTION_SECONDS = 1.5              # the stack looped by this process alone, before and after the ranks' probes
CONTENTION_READINGS = 3               # readings per number of processes, the median kept
CONTENTION_READING_SECONDS = 0.5      # each reading's loop: the three together take CONTENTION_SECONDS
LINEAR_SHAPES = ((512, 64, 64), (512, 64, 256), (512, 256, 64), (512, 128, 128), (512, 128, 512), (512, 512, 128))
ATTENTION_SHAPES = ((64, 32, 16), (16, 256, 64))    # (row x head slices, sequence, head dim)


def timed_median(op, seconds: float, warmup: int = 3, min_reps: int = 5) -> float:
    """Median wall time of ``op()`` over about ``seconds`` of repetitions after ``warmup`` calls.
    The median rather than the mean: other processes share these cores."""
    for _ in range(warmup):
        op()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        op()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_matmul_flops() -> float:
    """Achieved fp32 matmul FLOP/s on one thread: the best size's median rate (2n^3 per n x n mm)."""
    rates = []
    for n in MATMUL_SIZES:
        a, b = torch.randn(n, n), torch.randn(n, n)
        c = torch.empty(n, n)
        t = timed_median(lambda: torch.mm(a, b, out=c), MATMUL_SECONDS)
        rates.append(2 * n**3 / t)
    return max(rates)


def measure_memory_bandwidth() -> float:
    """Achieved bytes/s of a large fp32 copy on one thread, counting the read and the write."""
    src = torch.ones(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    t = timed_median(lambda: dst.copy_(src), COPY_SECONDS, warmup=2, min_reps=3)
    return 2 * COPY_BYTES / t


def measure_pointwise_efficiency(mem_bw: float) -> float:
    """Achieved fraction of the copy bandwidth on the pointwise ops models are made of (GeLU,
    LayerNorm, softmax, an add; read + write of a 512 KiB fp32 tensor each, each call's from the
    next copy of a pool, ``input_pool``): their bytes over their summed time; on a CPU the
    transcendental ones are bound by arithmetic before memory."""
    pool = input_pool(lambda: (torch.randn(512, 256),))
    ops = (torch.nn.functional.gelu, lambda x: torch.nn.functional.layer_norm(x, (256,)),
           lambda x: torch.softmax(x, -1), lambda x: x + x)
    seconds = sum(timed_median(rotating(pool, op), 0.1) for op in ops)
    return min(1.0, len(ops) * 2 * pool[0][0].numel() * 4 / seconds / mem_bw)


def input_pool(make) -> list:
    """``make()``'s tensors and as many more copies as fill ``POOL_BYTES`` (at least two).

    A probe that loops over one input reads it from the core's cache after the first call; a
    layer in a training step reads what earlier layers wrote, and its weights, from memory
    shared with every core (``rotating`` takes each call's inputs from the next copy). On the
    machine of BENCHMARKS.md the linear layers' products ran at 0.91 of peak on one hot input and 0.68 through
    the pool, and a GPT's own matmuls (h=96, 384 tokens) at 0.67 (torch.profiler)."""
    first = make()
    size = max(1, sum(t.numel() * t.element_size() for t in first))
    return [first] + [make() for _ in range(max(1, POOL_BYTES // size - 1))]


def rotating(pool: list, fn):
    """``fn`` of the next entry of ``pool`` at each call (``input_pool``)."""
    entries = itertools.cycle(pool)
    return lambda: fn(*next(entries))


def measure_matmul_efficiency(peak: float) -> float:
    """Achieved fraction of ``peak`` on the products of small linear layers: for each (m, k, n)
    of LINEAR_SHAPES, y = x[m,k] @ w[k,n] and its backward's dx = dy @ w^T and dw = x^T @ dy,
    each call's operands from the next copy of a pool (``input_pool``); their FLOPs over their
    summed time."""
    flops = seconds = 0.0
    products = (lambda x, w, dy: torch.mm(x, w), lambda x, w, dy: torch.mm(dy, w.t()),
                lambda x, w, dy: torch.mm(x.t(), dy))
    for m, k, n in LINEAR_SHAPES:
        pool = input_pool(lambda: (torch.randn(m, k), torch.randn(k, n), torch.randn(m, n)))
        seconds += sum(timed_median(rotating(pool, product), 0.05) for product in products)
        flops += 3 * 2 * m * k * n
    return min(1.0, flops / seconds / peak)


def measure_attention(peak: float) -> tuple[float, float]:
    """(fraction of ``peak``, seconds per (row, head) slice) of the fused causal attention
    kernel on one thread: forward + backward timed on a short-head and a long-head shape of
    ATTENTION_SHAPES (each call's q, k, v from the next copy of a pool, ``input_pool``) and solved
    for time = 3 (4·B·s²·d / rate + B·overhead), B slices (backward as two forwards, the
    model's rule)."""
    rows = []

    def fb(q, k, v):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    for slices, s, d in ATTENTION_SHAPES:
        pool = input_pool(lambda: tuple(torch.randn(slices, 1, s, d, requires_grad=True) for _ in range(3)))
        rows.append((4.0 * slices * s * s * d, float(slices), timed_median(rotating(pool, fb), 0.15) / 3))
    (f1, b1, t1), (f2, b2, t2) = rows
    det = f1 * b2 - f2 * b1
    inv_rate, overhead = (t1 * b2 - t2 * b1) / det, (f1 * t2 - f2 * t1) / det
    if overhead < 0 or inv_rate <= 0:      # no setup cost visible: the long shape's rate alone
        return min(1.0, f2 / t2 / peak), 0.0
    return min(1.0, 1.0 / inv_rate / peak), overhead


def measure_step_overhead() -> float:
    """Seconds per parameter tensor of ``torch.optim.AdamW.step`` on small tensors (48 of 64 x 64):
    its per-tensor loop and a 64 x 64 tensor's arithmetic. The arithmetic is about a quarter of it
    (31 us a tensor at 1-32 elements against 42-44 us at 64 x 64 on the machine of BENCHMARKS.md),
    and ``estimate.optimizer_time`` charges the state bytes on the roofline as well: the
    optimizer is priced above its measured step (benchmarks/bench_holdout.py; BENCHMARKS.md,
    bench_holdout.py). Left as it is: priced alone, the optimizer makes the 2-process hold-out
    grid read short, its compute being priced low; the two are corrected together or not at all
    (the same section)."""
    params = [torch.nn.Parameter(torch.randn(64, 64)) for _ in range(48)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    return timed_median(opt.step, 0.2) / len(params)


def contention_probe(seconds: float) -> float:
    """Run on every rank (a job of ``Ranks``' pool): seconds per forward + backward of the
    synthetic stack (``Stack``: 4 blocks, d = 96, 128 rows; one thread) while every rank runs
    the same loop at once."""
    torch.set_num_threads(1)
    return stack_seconds(seconds, dist.barrier)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, or the platform's word for it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def total_ram() -> int:
    """Physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
