"""Where the cost model's predicted step and the measured one part: each phase of a training
step predicted (the estimate's timeline on the local preset) and measured (timed on every rank),
side by side.

    python benchmarks/step_phases.py [--model KEY] [--world 4] [--pp 2] [--steps 21] [--plans NAME ...]

The model is one of ``bench_holdout.py``'s planner-quality models (default: the wide and shallow
GPT) or of its hold-out grid (``--model "gpt h32 L2 s16"``).
Plans: ddp, ZeRO-2 and ZeRO-3 on dp = world, tp on tp = world, and GPipe, 1F1B and zero-bubble on pp = --pp x dp =
world / pp with 2 micro-batches, timed round-robin (one step each per round after a barrier); the slowest
rank's median of each phase is shown, and the fastest rank's (a rank that reaches an exchange
last waits for nobody in it: its phase is the exchange alone).

Phases. A pipeline: its schedule (the train_step's own timer: every action and the wait for the
last sends; predicted, the replay's makespan), the deferred dp reduction, the exchange of tied
gradients, the loss broadcast, and the optimizer step (ZeRO's gathers after it included). A
single-stage plan: forward (with the loss), backward with the reductions it waits for, the
optimizer step. Predicted phases sum to the predicted step (a single stage's backward phase is
the rest), and the slowest rank's phases need not sum to its step: ranks wait for each other in
different phases.

Two more rows per plan (``autopar.phases.STEP_PARTS``): the step's collective waits (every
handle's wait and every synchronous collective, as the runtime's ``flight`` issues them), beside
the estimate's exposed communication; and the step's thread CPU time, beside the estimate's
compute. The two pairs are not the same split: the estimate counts each tp collective's host
work (``Device.collective_overhead``) as communication, the thread's CPU counts it as work, and
neither measured part holds the time a rank's thread was runnable but off its core.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PLANS = {       # name -> (the mesh axis the plan needs besides dp, or None; plan keyword arguments)
    "ddp": (None, dict(dp="ddp")),
    "zero2": (None, dict(dp="zero2")),
    "zero3": (None, dict(dp="zero3")),
    "tp": ("tp", dict(dp="ddp", tp=True)),
    "gpipe": ("pp", dict(dp="ddp", pp_schedule="gpipe", microbatches=2)),
    "1f1b": ("pp", dict(dp="ddp", pp_schedule="1f1b", microbatches=2)),
    "zero_bubble": ("pp", dict(dp="ddp", pp_schedule="zero_bubble", microbatches=2)),
}


def main():
    import bench_holdout as B
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    models = list(B.QUALITY_MODELS) + B.grid_models()
    keys = [k for k, _, _ in models]
    ap.add_argument("--model", default=keys[0], choices=keys,
                    help="one of bench_holdout's quality models, or of its hold-out grid ('gpt h32 L2 s16')")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages of the pipelined plans (dp = world / pp)")
    ap.add_argument("--steps", type=int, default=21, help="timed rounds (the median is reported)")
    ap.add_argument("--plans", nargs="+", default=["ddp", "gpipe", "1f1b", "zero_bubble"], choices=list(PLANS),
                    help="tp: Plan(tp=True) on Mesh(tp=--world)")
    args = ap.parse_args()
    if args.world % args.pp:
        raise SystemExit(f"--pp {args.pp} does not divide --world {args.world}")

    import autopar
    from autopar.cost.calibration import calibrate_local
    from autopar.models import gpt_batch
    from autopar.phases import (PIPELINE_PHASES, STAGE_PHASES, STEP_PARTS, build, medians, phase_times,
                                predicted_phases)
    from autopar.testing import run
    c = calibrate_local()
    key, spec, batch = next(m for m in models if m[0] == args.model)
    model, cfg = build(spec)
    x, _ = gpt_batch(cfg, batch)
    cases, pred = [], {}
    for name in args.plans:
        axis, kw = PLANS[name]
        pp = axis == "pp"
        if pp:
            axes = dict(pp=args.pp, dp=args.world // args.pp) if args.world > args.pp else dict(pp=args.pp)
        else:
            axes = {axis or "dp": args.world}
        cases.append((name, axes, kw))
        e = autopar.estimate(model, autopar.Mesh(**axes, virtual=True), autopar.Plan(**kw), example_inputs=(x,),
                             cluster=c)
        pred[name] = (e.step_time_s, {**predicted_phases(e, pp), "collective waits": e.exposed_comm_s,
                                      "rank CPU": e.compute_s})
    per_rank = run(phase_times, args.world, spec, batch, cases, args.steps, timeout=1800)
    print(f"## step phases: {key} ({cfg}), global batch {batch}, world {args.world}, {args.steps} rounds; "
          "ms, the slowest rank's median; predicted on the local preset")
    print(f"{'plan':12s} {'phase':24s} {'pred':>7s} {'meas':>7s} {'ratio':>6s} {'fastest':>8s}")
    for name, axes, kw in cases:
        meas = medians(per_rank, name)
        least = {k: min(statistics.median(r[name][k]) for r in per_rank) for k in per_rank[0][name]}
        step, phases = pred[name]
        for phase in (PIPELINE_PHASES if kw.get("pp_schedule") else STAGE_PHASES) + ("step",) + STEP_PARTS:
            p = step if phase == "step" else phases.get(phase, 0.0)
            m = meas.get(phase, 0.0)
            ratio = f"{p / m:6.2f}" if m else f"{'-':>6s}"
            print(f"{name:12s} {phase:24s} {p * 1e3:7.2f} {m * 1e3:7.2f} {ratio} {least.get(phase, 0.0) * 1e3:8.2f}")


if __name__ == "__main__":
    main()
