"""How heavy-tailed a step's time is on this machine: the spread of iterations of bare compute and
of gloo collectives, and how a small hold-out row's median and mean step move from run to run.

    python benchmarks/gloo_tail.py [--world 2] [--iterations 81] [--rows "llama:ddp" "gpt h32 L4 s16:ddp"] [--repeats 8]

1. Iterations, each after a barrier, on ``--world`` gloo processes (one thread each), the slowest
   rank's time per iteration: 10 matmuls of 256 x 256 ("compute"); five all-reduces of 100 KB
   ("comm"); the matmuls then the all-reduces ("both"); one all-reduce issued asynchronously,
   the matmuls, then its wait ("async"). Prints min, median, mean, 90th percentile and max.
2. Hold-out rows (the grid's models and plans, ``autopar.holdout``; ``MODEL:PLAN``), each measured
   ``--repeats`` times in fresh processes as the grid measures a row (compiled, 3 untimed steps,
   41 steps each after a barrier): the slowest rank's median and mean step of each repeat, and
   how far the repeats spread (standard deviation over mean). ``--repeats 0`` skips this.

Why: the hold-out grid's step is the slowest rank's mean of its steps (``autopar.holdout.step_time``),
and the local calibration fits the pipelines' message latency to mean schedules; this script
shows the tail that makes the two statistics differ here (BENCHMARKS.md, gloo_tail.py).
"""
from __future__ import annotations

import argparse
import statistics
import time

MODES = ("compute", "comm", "both", "async")


def _iterations(mode: str, n: int) -> list:
    """Seconds of each of ``n`` iterations of ``mode`` on this rank (3 untimed first)."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    g = torch.randn(25_000)           # 100 KB of fp32
    out = []
    for i in range(n + 3):
        dist.barrier()
        t0 = time.perf_counter()
        work = dist.all_reduce(g, async_op=True) if mode == "async" else None
        if mode in ("compute", "both", "async"):
            for _ in range(10):
                a @ a
        if work is not None:
            work.wait()
        if mode in ("comm", "both"):
            for _ in range(5):
                dist.all_reduce(g)
        if i >= 3:
            out.append(time.perf_counter() - t0)
    return out


def _row(key: str, plan: str, world: int, steps: int) -> list:
    """This rank's ``steps`` step times of the hold-out row (``key``, ``plan``), measured alone."""
    import torch
    from autopar.holdout import grid_models, plans, prepared
    from autopar.measure import timed_alone
    torch.set_num_threads(1)
    _, spec, batch = next(m for m in grid_models() if m[0] == key)
    _, axes, kw = next(p for p in plans(world) if p[0] == plan)
    step, *_ = prepared(spec, batch, axes, kw)
    return timed_alone(step, steps)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=81)
    ap.add_argument("--rows", nargs="*", default=["llama:ddp", "gpt h32 L4 s16:ddp"], metavar="MODEL:PLAN")
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    from autopar.testing import run
    print(f"## iterations on {args.world} processes, each after a barrier, slowest rank (ms)")
    print(f"{'mode':8s} {'min':>7s} {'median':>7s} {'mean':>7s} {'p90':>7s} {'max':>7s}")
    for mode in MODES:
        per_rank = run(_iterations, args.world, mode, args.iterations, timeout=300)
        q = sorted(max(x) for x in zip(*per_rank))
        print(f"{mode:8s} {q[0] * 1e3:7.2f} {statistics.median(q) * 1e3:7.2f} {statistics.mean(q) * 1e3:7.2f} "
              f"{q[int(0.9 * len(q))] * 1e3:7.2f} {q[-1] * 1e3:7.2f}", flush=True)
    if args.repeats <= 0:
        return
    print(f"\n## hold-out rows on {args.world} processes, {args.repeats} repeats in fresh processes, 41 steps each: "
          "the slowest rank's median and mean step (ms)")
    for item in args.rows:
        key, _, plan = item.rpartition(":")
        if not key:
            raise SystemExit(f"--rows {item!r}: expected MODEL:PLAN, e.g. 'llama:ddp'")
        got = {"median": [], "mean": []}
        for _ in range(args.repeats):
            per_rank = run(_row, args.world, key, plan, args.world, 41, timeout=600)
            got["median"].append(max(statistics.median(r) for r in per_rank) * 1e3)
            got["mean"].append(max(statistics.mean(r) for r in per_rank) * 1e3)
        for name, v in got.items():
            spread = statistics.stdev(v) / statistics.mean(v) if len(v) > 1 else 0.0
            print(f"{key} {plan} {name:6s}: " + " ".join(f"{x:.2f}" for x in v)
                  + f" | {min(v):.2f}-{max(v):.2f}, spread {spread:.1%}", flush=True)


if __name__ == "__main__":
    main()
