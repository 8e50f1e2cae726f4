"""Transfers that cross on one gloo connection: what they cost, and what a pipeline gains by
sending each way over a group of its own (``PipelineModule._p2p_group``).

    python benchmarks/gloo_crossing.py [--bytes 1024 24576 98304] [--compute-ms 1 5] [--reps 60]
                                       [--rows "gpt h64 L4 s48" "gpt h32 L2 s16"] [--repeats 4]

1. Two gloo processes (one thread each). Each repetition: a barrier, both ranks post their
   receive, compute for ``--compute-ms`` (64 x 64 matmuls), then send, and wait. Three ways:
   "one way" (rank 0 sends, rank 1 receives), "crossing, one group" (both send to each other
   over the default group: one TCP connection between them) and "crossing, two groups" (rank 0
   sends over a second group of the same two ranks, rank 1 over the default one: a connection
   each way). Printed: the slower rank's time from its send to its receive done (median, mean,
   90th percentile, max, and how many of them took over 1.5 ms), and the longest ``isend``
   call (gloo writes from the calling thread).
2. Pipelines: hold-out rows (``bench_holdout.py``'s models; 1F1B on 2 stages, 4 micro-batches,
   batch 8), each measured as the grid measures a row (compiled, 3 untimed steps, 41 steps each
   after a barrier; the slowest rank's mean), ``--repeats`` times in fresh processes, the two
   ways alternating: the transfers to the lower rank over the pp group itself ("one group")
   and over ``pp:down`` ("two groups", as autopar's pipelines send). Printed: each repeat, the
   medians, and one group's median over two groups'.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

WAYS = ("one way", "crossing, one group", "crossing, two groups")


def _compute(seconds: float) -> None:
    import torch
    x = torch.randn(64, 64)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        x = (x @ x).tanh()


def _transfers(way: str, nbytes: int, compute: float, reps: int) -> list:
    """(seconds from this rank's send to its receive done, seconds of its isend call) of each
    repetition; the rank that only sends reports its send call and 0."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    r = dist.get_rank()
    peer = 1 - r
    other = dist.new_group([0, 1])
    n = max(1, nbytes // 4)
    out = []
    for i in range(reps + 3):
        a, b = torch.full((n,), float(r)), torch.empty(n)
        sends = way != "one way" or r == 0
        receives = way != "one way" or r == 1
        send_group = other if (way == "crossing, two groups" and r == 0) else None
        recv_group = other if (way == "crossing, two groups" and r == 1) else None
        dist.barrier()
        rw = dist.irecv(b, peer, tag=i, group=recv_group) if receives else None
        _compute(compute)
        t0 = time.perf_counter()
        sw = dist.isend(a, peer, tag=i, group=send_group) if sends else None
        t1 = time.perf_counter()
        if rw is not None:
            rw.wait()
        t2 = time.perf_counter()
        if sw is not None:
            sw.wait()
        if i >= 3:
            out.append((t2 - t0 if receives else 0.0, t1 - t0 if sends else 0.0))
    return out


def _row(spec, one_group: bool, steps: int = 41) -> float:
    """The slowest rank's mean step of 1F1B on 2 stages (gathered by the caller: this rank's)."""
    import torch
    from autopar import tuning
    from autopar.holdout import prepared
    torch.set_num_threads(1)
    step, _, dm, _ = prepared(spec, 8, {"pp": 2}, {"dp": "ddp", "pp_schedule": "1f1b", "microbatches": 4})
    if one_group:
        dm._pp_down = dm._pp_group
    for _ in range(2):
        step()
    return statistics.mean(tuning.timed_rounds({"row": step}, steps, block=steps + 1)["row"])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", type=int, nargs="+", default=[1024, 24576, 98304])
    ap.add_argument("--compute-ms", type=float, nargs="+", default=[1.0, 5.0])
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--rows", nargs="*", default=["gpt h64 L4 s48", "gpt h32 L2 s16"])
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args(argv)
    from autopar.testing import run
    print(f"## transfers between 2 gloo processes on {os.cpu_count()} cores, {args.reps} repetitions each "
          f"(ms: the slower rank's send to receive done)")
    print(f"{'way':22s} {'bytes':>7s} {'compute':>8s} | {'median':>6s} {'mean':>6s} {'p90':>6s} {'max':>6s} "
          f"{'>1.5 ms':>7s} | {'isend max':>9s}")
    for nbytes in args.bytes:
        for compute in args.compute_ms:
            for way in WAYS:
                a, b = run(_transfers, 2, way, nbytes, compute / 1e3, args.reps, timeout=300)
                x = sorted(max(p[0], q[0]) for p, q in zip(a, b))
                call = max(max(p[1], q[1]) for p, q in zip(a, b))
                print(f"{way:22s} {nbytes:>7d} {compute:>6.0f}ms | {1e3 * statistics.median(x):>6.2f} "
                      f"{1e3 * statistics.mean(x):>6.2f} {1e3 * x[int(0.9 * (len(x) - 1))]:>6.2f} {1e3 * x[-1]:>6.2f} "
                      f"{sum(v > 1.5e-3 for v in x):>4d}/{len(x):<2d} | {1e3 * call:>9.2f}", flush=True)
    if not args.rows or args.repeats < 1:
        return
    from autopar.holdout import grid_models
    specs = {k: s for k, s, _ in grid_models()}
    print(f"\n## 1F1B on 2 stages (4 micro-batches, batch 8): the slowest rank's mean of 41 steps, ms; "
          f"{args.repeats} repeats in fresh processes, the two ways alternating")
    for key in args.rows:
        got = {True: [], False: []}
        for i in range(args.repeats):
            for one in ((True, False) if i % 2 == 0 else (False, True)):
                got[one].append(max(run(_row, 2, specs[key], one, timeout=600)))
        one, two = statistics.median(got[True]), statistics.median(got[False])
        print(f"{key:16s} one group {' '.join(f'{1e3 * v:.1f}' for v in got[True])} (median {1e3 * one:.1f}) | "
              f"two groups {' '.join(f'{1e3 * v:.1f}' for v in got[False])} (median {1e3 * two:.1f}) | "
              f"one / two {one / two:.2f}", flush=True)


if __name__ == "__main__":
    main()
