"""Where a hold-out pipeline's step goes, action by action: each F and B action's thread CPU time
and wall time, the messages', the schedule, the parts of ``train_step`` after it and the
optimizer step, measured on every rank, beside the estimate's F and B per micro-batch and its
after-schedule phases (local preset).

    python benchmarks/pp_actions.py [--models "gpt h32 L2 s16" ...] [--schedule 1f1b] [--pp 2] [--steps 21]

The models are ``bench_holdout.py``'s grid models, under its world-2 pipeline plan (pp = 2,
4 micro-batches, global batch 8; ``--pp 4``: the same on 4 stages, one process each, as the
world-4 grid's zero-bubble plan), all compiled first, then stepped in turn after a barrier, round
after round; medians over ``--steps`` steps after 3. A stage's "F cpu" is the summed thread CPU
time of its 4 F actions (its "wall" adds what the action waited, e.g. for a receive it needs);
"msg" is every send/receive post. "after" is ``train_step``'s wall time outside the schedule's
own timer (the tied gradients' exchange and the loss broadcast among it). Compare with
``step_phases.py``, which times phases, not actions.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DEFAULT_MODELS = ("gpt h32 L2 s16", "gpt h64 L4 s16", "gpt h96 L4 s48")


def _timed(record, label, f, cpu=False):
    """``f`` wrapped to add its wall (and thread CPU) seconds to ``record[label ...]``."""
    def g(*args, **kwargs):
        c0, w0 = time.thread_time(), time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            record[label + " wall"] += time.perf_counter() - w0
            if cpu:
                record[label + " cpu"] += time.thread_time() - c0
                record[label + " n"] += 1
    return g


def measured(cases, steps: int, pp: int = 2) -> dict:
    """On every rank: {model key: {part: median seconds, "stage": this rank's stage}}."""
    import torch
    import torch.distributed as dist
    from autopar.holdout import prepared
    torch.set_num_threads(1)
    cur = collections.defaultdict(float)
    runs = []
    for key, spec, kw in cases:
        step, _, dm, opt = prepared(spec, 8, {"pp": pp}, kw)
        run_action = dm._run

        def action(a, *args, _run=run_action, **kwargs):
            kind = a.kind if a.kind in ("F", "B", "W") else "msg"
            return _timed(cur, kind, _run, cpu=True)(a, *args, **kwargs)

        dm._run = action
        dm.train_step = _timed(cur, "train_step", dm.train_step)
        opt.step = _timed(cur, "optimizer", opt.step, cpu=True)
        runs.append((key, step, dm))
    got = {key: collections.defaultdict(list) for key, _, _ in runs}
    for i in range(steps + 3):
        for key, step, dm in runs:
            cur.clear()
            dist.barrier()
            w0 = time.perf_counter()
            step()
            if i >= 3:
                g = got[key]
                g["step"].append(time.perf_counter() - w0)
                g["schedule"].append(dm.step_time)
                g["after"].append(cur["train_step wall"] - dm.step_time)
                for k, v in cur.items():
                    g[k].append(v)
    dist.barrier()
    return {key: dict({k: statistics.median(v) for k, v in got[key].items()},
                      stage=min(int(s) for s in dm.stages)) for key, _, dm in runs}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), help="bench_holdout grid model keys")
    ap.add_argument("--schedule", default="1f1b", choices=("1f1b", "interleaved", "zero_bubble"))
    ap.add_argument("--steps", type=int, default=21)
    ap.add_argument("--pp", type=int, default=2, help="stages, one process each (the world-4 grid's zero-bubble: 4)")
    args = ap.parse_args()

    import autopar
    from autopar.cost.calibration import calibrate_local
    from autopar.cost.estimate import Profiles, evaluate_plan
    from autopar.holdout import PLANS_2, grid_models
    from autopar.models import gpt_batch
    from autopar.phases import build
    from autopar.testing import run

    cluster = calibrate_local()
    kw = next(k for name, _, k in PLANS_2 if name == f"pp {args.schedule}")
    specs = {key: spec for key, spec, _ in grid_models()}
    unknown = [m for m in args.models if m not in specs]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}: expected keys of bench_holdout's grid, e.g. {list(specs)[:3]}")
    cases = [(m, specs[m], kw) for m in args.models]
    per_rank = run(measured, args.pp, cases, args.steps, args.pp, timeout=1800)
    print(f"pipeline {args.schedule} on pp = {args.pp}, 4 micro-batches, global batch 8; ms, medians of {args.steps} steps")
    for key, spec, _ in cases:
        model, c = build(spec)
        x, _ = gpt_batch(c, 8)
        e = evaluate_plan(Profiles(model, (x,)), {"pp": args.pp}, autopar.Plan(**kw), cluster, 8)
        parts = collections.defaultdict(float)
        span = 0.0
        for r, lane, name, t0, t1 in e.timeline:
            hit = re.fullmatch(r"(\d+)([FBW])(\d+)", name)
            parts[(r, f"{hit.group(2)}" if hit else name)] += t1 - t0
            if hit:
                span = max(span, t1)
        print(f"\n{key}: predicted step {e.step_time_s * 1e3:.2f}, schedule {span * 1e3:.2f}")
        for r in sorted({r for r, _ in parts}):
            print(f"  predicted rank {r}: F {parts[(r, 'F')] * 1e3:.2f}, B {parts[(r, 'B')] * 1e3:.2f}, "
                  f"tied gradients {parts[(r, 'tied gradients')] * 1e3:.2f}, loss broadcast "
                  f"{parts[(r, 'loss broadcast')] * 1e3:.2f}, optimizer {parts[(r, 'optimizer')] * 1e3:.2f}")
        for rr in sorted(per_rank, key=lambda p: p[key]["stage"]):
            m = rr[key]
            acts = "; ".join(f"{k} cpu {m.get(k + ' cpu', 0) * 1e3:.2f} wall {m.get(k + ' wall', 0) * 1e3:.2f} "
                             f"(x{m.get(k + ' n', 0):.0f})" for k in ("F", "B", "W", "msg") if m.get(k + " n"))
            pre = m['step'] - m['schedule'] - m['after'] - m['optimizer wall']
            print(f"  measured stage {m['stage']}: step {m['step'] * 1e3:.2f}, schedule {m['schedule'] * 1e3:.2f}, "
                  f"before it {pre * 1e3:.2f}, after {m['after'] * 1e3:.2f}, optimizer {m['optimizer wall'] * 1e3:.2f}; {acts}")


if __name__ == "__main__":
    main()
