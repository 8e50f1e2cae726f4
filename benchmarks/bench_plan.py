"""The cost model and the planner, measured.

    python benchmarks/bench_plan.py [--skip-speed] [--skip-local] [--skip-published] [--fit] [--runs 2] [--steps 21]

1. Planner speed: GPT-3 175B-shaped models of 24, 48, 96 and 192 layers on 1,024 virtual
   A100s (dgx-a100-80gb preset, global batch 1,536): capture + profiles, search, total.
2. Predictions against measurements on this machine (``local`` preset): the small GPT of
   autopar/predict_local.py at world 4 under every plan of PREDICT_PLANS, measured on real gloo
   processes (bytes per step, peak memory, median step time), with the ratio to the prediction;
   and the plan the planner picks, measured in the same run.
3. Predictions against published runs (autopar/published_runs.py): every row of Narayanan et al.
   (SC'21) table 1, Korthikanti et al. (2022) table 4's iteration times, torchtitan's Llama 3.1
   8B/70B/405B H100 figures, each estimated as published, with the ratio; ``--fit`` also fits the
   A100 matmul efficiency on the calibration run (BLOOM-176B) the preset's number comes from.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


def planner_speed():
    import autopar
    from autopar.cost.estimate import Profiles
    from autopar.models import named
    print("## planner speed: GPT-3 175B shape (h=12288, 96 heads, s=2048) on 1,024 virtual A100s, batch 1,536")
    print(f"{'layers':>6} {'capture+profile s':>18} {'search s':>9} {'total s':>8} {'candidates':>11}  chosen")
    rows = []
    for layers in (24, 48, 96, 192):
        t0 = time.perf_counter()
        model, example = named("gpt3-175b", layers=layers)
        profiles = Profiles(model, example)
        for tp in (1, 2, 4, 8, 16, 32):      # every tp size the search can reach (heads 96)
            for sp in (False, True):
                profiles.get(tp, sp)
        t1 = time.perf_counter()
        r = autopar.plan(model, 1024, example_inputs=example, cluster="dgx-a100-80gb", global_batch=1536,
                         profiles=profiles)
        t2 = time.perf_counter()
        rows.append((layers, t1 - t0, t2 - t1, t2 - t0))
        print(f"{layers:>6} {t1 - t0:>18.1f} {t2 - t1:>9.1f} {t2 - t0:>8.1f} {r.searched:>11}  "
              f"{r.plan} {dict(r.mesh.axes)} recompute={r.recompute}")
    base = rows[0]
    print("growth against 24 layers (linear would be 1, 2, 4, 8): total " +
          ", ".join(f"{x[3] / base[3]:.2f}" for x in rows) + "; search " +
          ", ".join(f"{x[2] / base[2]:.2f}" for x in rows))
    print("\n## planner speed: Narayanan et al.'s sizes on their GPU counts (autopar.plan from scratch, dgx-a100-80gb)")
    print(f"{'model':>10} {'GPUs':>5} {'batch':>5} {'blocks captured':>15} {'total s':>8} {'goal s':>6}  chosen")
    for name, gpus, batch, goal in (("gpt3-175b", 1024, 1536, 10), ("gpt-146b", 1536, 1536, 10),
                                    ("gpt-1t", 3072, 3072, 20)):
        model, example = named(name)
        t0 = time.perf_counter()
        r = autopar.plan(model, gpus, example_inputs=example, cluster="dgx-a100-80gb", global_batch=batch)
        total = time.perf_counter() - t0
        stack = Profiles(model, example).stack
        print(f"{name:>10} {gpus:>5} {batch:>5} {f'2 of {stack[1]}' if stack else 'all':>15} {total:>8.1f} {goal:>6}  "
              f"{dict(r.mesh.axes)} {r.plan}")


def local_predictions(runs: int, steps: int = 21):
    import autopar
    from autopar import predict_local as tier
    from autopar.cost.calibration import calibrate_local
    from autopar.cost.estimate import Profiles, evaluate_plan
    from autopar.models import TinyGPT, gpt_batch
    from autopar.testing import run
    c = calibrate_local()
    cfg = tier.PREDICT_CONFIG
    x, _ = gpt_batch(cfg, tier.PREDICT_BATCH)
    profiles = Profiles(TinyGPT(cfg), (x,))
    pred = {name: evaluate_plan(profiles, axes, autopar.Plan(**kw), c, tier.PREDICT_BATCH)
            for name, axes, kw in tier.PREDICT_PLANS}
    report = autopar.plan(TinyGPT(cfg), 4, example_inputs=(x,), cluster=c, recompute=("none",))
    pick = next((n for n, axes, kw in tier.PREDICT_PLANS
                 if axes == report.mesh.axes and autopar.Plan(**kw) == report.plan), None)
    print(f"\n## predictions against measurements: small GPT ({cfg}), batch {tier.PREDICT_BATCH}, world 4 "
          f"on {os.cpu_count()} cores, local preset")
    print(f"planner pick (local preset, world 4): {report.plan} on {dict(report.mesh.axes)} = "
          f"{pick or 'not a hand plan'}")
    for k in range(runs):
        per_rank = run(tier.measured_plans, 4, None, steps, timeout=900)
        print(f"\nrun {k + 1}:")
        print(f"{'plan':16s} {'bytes meas':>11s} {'pred':>11s} | {'peak MB meas':>12s} {'pred':>7s} {'ratio':>6s} | "
              f"{'step ms meas':>12s} {'pred':>7s} {'ratio':>6s}")
        fastest = None
        for name, _, _ in tier.PREDICT_PLANS:
            rs = [r[name] for r in per_rank]
            b = max(r["bytes"] for r in rs)
            peak = max(r["peak"] for r in rs)
            step = max(statistics.median(r["times"]) for r in rs)
            e = pred[name]
            fastest = min(fastest or (step, name), (step, name))
            print(f"{name:16s} {b:>11,.0f} {e.comm_bytes:>11,.0f} | {peak / 1e6:>12.3f} {e.memory_bytes / 1e6:>7.3f} "
                  f"{e.memory_bytes / peak:>6.2f} | {step * 1e3:>12.1f} {e.step_time_s * 1e3:>7.1f} "
                  f"{e.step_time_s / step:>6.2f}")
        if pick:
            mine = max(statistics.median(r[pick]["times"]) for r in per_rank)
            print(f"planner pick {pick}: measured {mine * 1e3:.1f} ms; fastest hand plan {fastest[1]} "
                  f"{fastest[0] * 1e3:.1f} ms; ratio {mine / fastest[0]:.2f}")


def published(fit: bool = False):
    """Every published run of autopar/published_runs.py, estimated as it ran, against its figure."""
    from autopar import published_runs as P
    from autopar.cost.cluster import get_cluster
    cal = P.CALIBRATION
    print("\n## published runs: the calibration and every validation row, each estimated as published")
    e = P.estimate(cal)
    print(f"calibration: {cal.label} ({cal.source}); A100 matmul efficiency "
          f"{get_cluster('dgx-a100-80gb').device.matmul_efficiency}: predicted {P.in_unit(cal, e.step_time_s):.1f} "
          f"TFLOP/s per GPU against {cal.published:g}")
    if fit:
        print(f"fit: the A100 matmul efficiency at which the estimate equals {cal.published:g}: "
              f"{P.fit_matmul_efficiency():.4f}")
    print(f"{'run':58s} {'mesh':24s} {'unit':>7s} {'published':>10s} {'predicted':>10s} {'speed':>6s} "
          f"{'mem GiB':>8s} {'pub GiB':>8s}")
    source, within = None, []
    for run in P.VALIDATION:
        if run.source != source:
            source = run.source
            print(f"-- {source}")
        e = P.estimate(run)
        ratio = P.speed_ratio(run, e.step_time_s)
        within.append(abs(ratio - 1) <= 0.15)
        mesh = " ".join(f"{k}={v}" for k, v in run.axes.items())
        pub_mem = f"{run.published_memory_gib:.1f}" if run.published_memory_gib else "-"
        print(f"{run.label:58s} {mesh:24s} {run.unit:>7s} {run.published:>10g} {P.in_unit(run, e.step_time_s):>10.2f} "
              f"{ratio:>6.2f} {e.memory_bytes / 2**30:>8.1f} {pub_mem:>8s}")
    print(f"speed = published step time / predicted step time (above 1: predicted faster than it ran); "
          f"{sum(within)} of {len(within)} rows within 15%")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-local", action="store_true")
    ap.add_argument("--skip-published", action="store_true")
    ap.add_argument("--fit", action="store_true", help="also fit the A100 matmul efficiency on the calibration run")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=21, help="timed steps per plan (the median is reported)")
    args = ap.parse_args()
    if not args.skip_speed:
        planner_speed()
    if not args.skip_local:
        local_predictions(args.runs, args.steps)
    if not args.skip_published:
        published(args.fit)


if __name__ == "__main__":
    main()
