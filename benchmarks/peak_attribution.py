"""What is live at a step's peak: the blocks live at the peak of bench_memory's implementations,
grouped by the step phase and the ops that allocated them.

    python benchmarks/peak_attribution.py [--part full|selective] [--impls NAME ...] [--rows N]

World size 2 (two gloo processes, as bench_memory). Each implementation is built and runs 3
steps under the memory profiler (bench_dp.profiled's method); the 3rd is measured. At the
moment its live total peaks, every block allocated since the profiler started that is still
live is listed by (phase of the step, the innermost enclosing ops, at most 4), with its bytes
and count; blocks from before the measured step are one row ("before the step": the state).
Rank 0's figures. A block allocated inside gloo's worker thread shows with phase "?".

What it shows of the gap between ``autopar zero3 + full`` and ``torch FSDP2 + ckpt``
(BENCHMARKS.md, section bench_memory.py): the two hold the same activations and the same
gathered unit, and autopar's overlapped collectives hold gloo's staging copies while in
flight (a ``gloo:all_gather`` flat output, a ``c10d::_reduce_scatter_base_`` clone of its
input).
"""
from __future__ import annotations

import argparse
import collections
import gc

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

import autopar.testing
from autopar.models import GPTConfig, gpt_batch

# benchmarks/ is the script's folder
import bench_memory  # noqa: E402
from bench_dp import PHASE_RANGE, allocation_events, live_totals, quiet_stderr, settle_collectives  # noqa: E402

MARK = "bench::measured_step"


def attribute(events, result: dict, t0: int, depth: int = 4) -> collections.Counter:
    """(phase, ops) -> [bytes, blocks] of the blocks live at the peak."""
    rows: dict = collections.defaultdict(lambda: [0, 0])
    for i, nb in result["live"].items():
        t, path = events[i][0], events[i][4]
        if t < t0:
            key = ("before the step", "")
        else:
            phases = [p[len(PHASE_RANGE):].strip() for p in path if p.startswith(PHASE_RANGE)]
            ops = [p for p in path if not p.startswith(PHASE_RANGE) and p != MARK]
            key = (phases[-1] if phases else "?", " > ".join(ops[-depth:]))
        rows[key][0] += nb
        rows[key][1] += 1
    return rows


def rank_main(part: str, names: list) -> dict:
    torch.set_num_threads(1)
    cfg = GPTConfig(**bench_memory.CONFIG)
    batches = [gpt_batch(cfg, bench_memory.GLOBAL_BATCH, seed=s) for s in range(bench_memory.N_BATCHES)]
    out = {}
    for name in names:
        dist.barrier()
        gc.collect()
        with quiet_stderr(), settle_collectives(), \
                profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            impl = bench_memory.Impl(name, part, batches)
            impl.step(ranges=True)
            impl.step(ranges=True)
            with record_function(MARK):
                impl.step(ranges=True)
        mark = next(e for e in prof.profiler.kineto_results.events() if e.name() == MARK)
        events = allocation_events(prof, paths=True)
        res = live_totals(events, mark.start_ns(), mark.end_ns(), at_peak=True)
        rows = attribute(events, res, mark.start_ns())
        out[name] = {"state": res["state"], "peak": res["peak"],
                     "at_ms": (res["peak_ns"] - mark.start_ns()) / 1e6,
                     "step_ms": (mark.end_ns() - mark.start_ns()) / 1e6,
                     "rows": sorted(((k, v[0], v[1]) for k, v in rows.items()), key=lambda r: -r[1])}
        del impl
        gc.collect()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=tuple(bench_memory.PARTS), default="full")
    ap.add_argument("--impls", nargs="+", default=None, help="default: every implementation of the part")
    ap.add_argument("--rows", type=int, default=16, help="largest rows printed per implementation")
    args = ap.parse_args(argv)
    names = args.impls or list(bench_memory.PARTS[args.part])
    got = autopar.testing.run(rank_main, bench_memory.WORLD, args.part, names, timeout=600)[0]
    for name in names:
        r = got[name]
        print(f"== {name}: peak {r['peak'] / 2**20:.2f} MiB (state {r['state'] / 2**20:.2f}) "
              f"at {r['at_ms']:.1f} of {r['step_ms']:.1f} ms into the profiled step (rank 0)")
        print(f"   {'MiB':>7s} {'blocks':>6s}  phase / allocated in")
        for (phase, ops), nb, count in r["rows"][:args.rows]:
            print(f"   {nb / 2**20:7.3f} {count:6d}  {phase} / {ops}")
        print()


if __name__ == "__main__":
    main()
