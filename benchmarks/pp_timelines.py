"""Pipeline schedules side by side on one mesh, action by action: each rank's F, B and W actions
(the runtime's own ``timeline``: wall time from after the receive it needs to the action's end),
beside the estimate's replay of the same plan (local preset).

    python benchmarks/pp_timelines.py [--model wide-shallow] [--world 4] [--pp 2] [--microbatches 2]
                                      [--schedules gpipe 1f1b zero_bubble] [--steps 25]

The model is one of ``bench_holdout.py``'s planner-quality models (or ``tier``: the GPT of the
timing tier, ``autopar/predict_local.py``; or a hold-out grid model), on pp=--pp x dp=world/pp.
Each schedule is compiled, run 3 steps, then ``--steps`` steps each after a barrier; per rank,
the medians of the step, of the time before its first action ("pre"), from its first action's
start to its last one's end ("sched") and after ("post"), and of each kind's summed action
time; then the last step's actions (ms from the step's start). The estimate's line gives its
replay's spans of each pp rank (each standing for its dp replicas).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _job(spec, batch, plans, steps):
    import torch
    import torch.distributed as dist
    from autopar.holdout import prepared
    torch.set_num_threads(1)
    out = {}
    for name, axes, kw in plans:
        step, body, dm, opt = prepared(spec, batch, axes, kw)
        for _ in range(3):
            step()
        rows = []
        for _ in range(steps):
            dist.barrier()
            t0 = time.time()
            step()
            t1 = time.time()
            tl = list(getattr(dm, "timeline", None) or getattr(getattr(dm, "module", None), "timeline", None) or [])
            first = min((a for _, a, _ in tl), default=t0)
            last = max((b for _, _, b in tl), default=t1)
            kinds: dict = {}
            for label, a, b in tl:
                kind = "".join(ch for ch in label if ch.isalpha())[:1]
                kinds[kind] = kinds.get(kind, 0.0) + b - a
            rows.append((t1 - t0, first - t0, last - first, t1 - last, kinds,
                         [(label, (a - t0) * 1e3, (b - t0) * 1e3) for label, a, b in tl]))
        out[name] = rows
        del step, body, dm, opt
        gc.collect()
        dist.barrier()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="wide-shallow",
                    help="a planner-quality model's first word, a hold-out grid model (e.g. 'gpt h64 L2 s16'), or 'tier'")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages (dp = world / pp)")
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "zero_bubble"])
    ap.add_argument("--steps", type=int, default=25)
    args = ap.parse_args()
    import autopar
    import bench_holdout as bh
    from autopar.cost.cluster import get_cluster
    from autopar.cost.estimate import Profiles, evaluate_plan
    from autopar.models import gpt_batch
    from autopar.phases import build
    from autopar.testing import run
    if args.model == "tier":
        from autopar.predict_local import PREDICT_BATCH, PREDICT_CONFIG
        key, spec, batch = "tier", ("gpt", dataclasses.asdict(PREDICT_CONFIG)), PREDICT_BATCH
    else:
        key, spec, batch = next((q for q in bh.grid_models() if q[0] == args.model), None) or \
            next(q for q in bh.QUALITY_MODELS if q[0].split()[0] == args.model)
    if args.world % args.pp:
        raise SystemExit(f"--pp {args.pp} does not divide --world {args.world}")
    axes = {"pp": args.pp, "dp": args.world // args.pp} if args.world > args.pp else {"pp": args.pp}
    plans = [(s, axes, {"dp": "ddp", "pp_schedule": s, "microbatches": args.microbatches}) for s in args.schedules]
    measured = run(_job, args.world, spec, batch, plans, args.steps, timeout=1800)
    model, cfg = build(spec)
    x, _ = gpt_batch(cfg, batch)
    profiles, cluster = Profiles(model, (x,)), get_cluster("local")
    print(f"{key}: {cfg}, global batch {batch}, mesh {axes}, {args.microbatches} micro-batches")
    for name, _, kw in plans:
        e = evaluate_plan(profiles, axes, autopar.Plan(**kw), cluster, batch)
        spans = " ".join(f"r{r}:{label}[{t0 * 1e3:.1f}-{t1 * 1e3:.1f}]" for r, lane, label, t0, t1 in e.timeline
                         if lane == "compute" and label[:1].isdigit())
        print(f"\n{name}: estimate {e.step_time_s * 1e3:.1f} ms; replay {spans}")
        for r, per_rank in enumerate(measured):
            rows = per_rank[name]
            med = [statistics.median(x[i] for x in rows) * 1e3 for i in range(4)]
            kinds = sorted({k for x in rows for k in x[4]})
            acts = " ".join(f"{k} {statistics.median(x[4].get(k, 0.0) for x in rows) * 1e3:.1f}" for k in kinds)
            print(f"  rank {r}: step {med[0]:.1f} ms, pre {med[1]:.1f}, sched {med[2]:.1f}, post {med[3]:.1f}; "
                  f"actions {acts}")
            print("    last step: " + " ".join(f"{label}[{a:.2f}-{b:.2f}]" for label, a, b in rows[-1][5]))


if __name__ == "__main__":
    main()
