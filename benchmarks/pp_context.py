"""Does the way the hold-out grid measures a plan change its step time? One grid row (a model
and a world-2 plan of ``bench_holdout.py``) timed alone on 2 processes in three contexts:

    python benchmarks/pp_context.py [--model "gpt h96 L2 s48"] [--plan "pp 1f1b"] [--steps 41]

1. ``profiler``: compiled, ``--steps`` steps, again, after the census of live bytes, after the
   memory measurement's profiled steps (``autopar.measure.peak_of``), and again.
2. ``warm-up``: 200 consecutive steps after 3, the median of each 20.
3. ``history``: the row timed alone (``autopar.holdout.measured_cases(..., alone=True)``, as the
   grid times it) before and after the grid's 13 models under the same plan, in the same
   processes, and among them.
Each figure is the slower rank's median, in ms.
"""
from __future__ import annotations

import argparse
import statistics


def _profiler(spec, axes, kw, steps: int) -> list:
    import torch
    from autopar.holdout import prepared
    from autopar.measure import peak_of, timed_alone
    from autopar.testing import steady_live_bytes
    torch.set_num_threads(1)
    step, body, dm, opt = prepared(spec, 8, axes, kw)
    out = [("fresh", timed_alone(step, steps)), ("again", timed_alone(step, steps))]
    steady_live_bytes(3)
    out.append(("after the census", timed_alone(step, steps)))
    peak_of(body, opt, dm)
    out += [("after peak_of", timed_alone(step, steps)), ("again", timed_alone(step, steps))]
    return out


def _warmup(spec, axes, kw, steps: int = 200) -> list:
    import torch
    from autopar.holdout import prepared
    from autopar.measure import timed_alone
    torch.set_num_threads(1)
    times = timed_alone(prepared(spec, 8, axes, kw)[0], steps)
    return [(f"steps {i}-{i + 19}", times[i:i + 20]) for i in range(0, steps, 20)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt h96 L2 s48", help="a bench_holdout grid model key")
    ap.add_argument("--plan", default="pp 1f1b", help="a bench_holdout world-2 plan name")
    ap.add_argument("--steps", type=int, default=41)
    args = ap.parse_args()
    from autopar.holdout import PLANS_2, grid_models, measured_cases
    from autopar.testing import run
    models = grid_models()
    row = next((m for m in models if m[0] == args.model), None)
    plan = [p for p in PLANS_2 if p[0] == args.plan]
    if row is None or not plan:
        raise SystemExit(f"expected a grid model ({[m[0] for m in models][:3]}, ...) and a world-2 plan "
                         f"({[p[0] for p in PLANS_2]}); got {args.model!r}, {args.plan!r}")
    _, axes, kw = plan[0]

    def show(title, per_rank):
        print(f"\n{title}: {args.model}, {args.plan}, ms (slower rank's median)")
        for i, (label, _) in enumerate(per_rank[0]):
            print(f"  {label:20s} {max(statistics.median(r[i][1]) for r in per_rank) * 1e3:8.2f}")

    show("profiler", run(_profiler, 2, row[1], axes, kw, args.steps, timeout=900))
    show("warm-up", run(_warmup, 2, row[1], axes, kw, timeout=900))
    cases = ([("before " + row[0], row[1], row[2], plan)] + [(k, s, b, plan) for k, s, b in models]
             + [("after " + row[0], row[1], row[2], plan)])
    per_rank = run(measured_cases, 2, cases, args.steps, True, 4, True, timeout=1800)
    show("history", [[(key, r[(key, args.plan)]["times"]) for key, _, _, _ in cases] for r in per_rank])


if __name__ == "__main__":
    main()
