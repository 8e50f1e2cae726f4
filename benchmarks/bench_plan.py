"""The cost model and the planner, measured.

    python benchmarks/bench_plan.py [--skip-speed] [--skip-local] [--skip-published] [--runs 2] [--steps 21]

1. Planner speed: GPT-3 175B-shaped models of 24, 48, 96 and 192 layers on 1,024 virtual
   A100s (dgx-a100-80gb preset, global batch 1,536): capture + profiles, search, total.
2. Predictions against measurements on this machine (``local`` preset): the small GPT of
   tests/jobs/predict.py at world 4 under every plan of PREDICT_PLANS, measured on real gloo
   processes (bytes per step, peak memory, median step time), with the ratio to the prediction;
   and the plan the planner picks, measured in the same run.
3. Predictions against published runs: Narayanan et al. (SC'21) table 1 on DGX A100 80GB.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


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
    from jobs import predict as jobs
    from autopar.cost.calibration import calibrate_local
    from autopar.cost.estimate import Profiles, evaluate_plan
    from autopar.models import TinyGPT, gpt_batch
    from autopar.testing import run
    c = calibrate_local()
    cfg = jobs.PREDICT_CONFIG
    x, _ = gpt_batch(cfg, jobs.PREDICT_BATCH)
    profiles = Profiles(TinyGPT(cfg), (x,))
    pred = {name: evaluate_plan(profiles, axes, autopar.Plan(**kw), c, jobs.PREDICT_BATCH)
            for name, axes, kw in jobs.PREDICT_PLANS}
    report = autopar.plan(TinyGPT(cfg), 4, example_inputs=(x,), cluster=c, recompute=("none",))
    pick = next((n for n, axes, kw in jobs.PREDICT_PLANS
                 if axes == report.mesh.axes and autopar.Plan(**kw) == report.plan), None)
    print(f"\n## predictions against measurements: small GPT ({cfg}), batch {jobs.PREDICT_BATCH}, world 4 "
          f"on {os.cpu_count()} cores, local preset")
    print(f"planner pick (local preset, world 4): {report.plan} on {dict(report.mesh.axes)} = "
          f"{pick or 'not a hand plan'}")
    for k in range(runs):
        per_rank = run(jobs.measured_plans, 4, None, steps, timeout=900)
        print(f"\nrun {k + 1}:")
        print(f"{'plan':16s} {'bytes meas':>11s} {'pred':>11s} | {'peak MB meas':>12s} {'pred':>7s} {'ratio':>6s} | "
              f"{'step ms meas':>12s} {'pred':>7s} {'ratio':>6s}")
        fastest = None
        for name, _, _ in jobs.PREDICT_PLANS:
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


def published():
    import autopar
    from autopar.cost.cluster import get_cluster
    from autopar.cost.estimate import Profiles, evaluate_plan
    from autopar.models import NAMED, named
    rows = [("gpt-39b", 8, 2, 512, 1536, 138), ("gpt-76b", 8, 4, 1024, 1792, 140),
            ("gpt-146b", 8, 8, 1536, 2304, 148), ("gpt-310b", 8, 16, 1920, 2160, 155)]
    c = get_cluster("dgx-a100-80gb")
    print("\n## published runs: Narayanan et al. SC'21 table 1 (DGX A100 80GB), full recomputation, "
          "1F1B, micro-batch 1")
    print(f"{'model':9s} {'t':>2} {'p':>3} {'d':>3} {'batch':>6} {'published TF/s':>15} {'predicted':>10} "
          f"{'ratio':>6} {'mem GiB':>8} {'bubble':>7}  planner (predicted TF/s)")
    for name, t, p, gpus, batch, pub in rows:
        cfg = NAMED[name]
        model, example = named(name)
        profiles = Profiles(model, example, flash=False)
        d = gpus // (t * p)
        plan = autopar.Plan(dp="ddp", tp=True, pp_schedule="1f1b", microbatches=batch // d)
        e = evaluate_plan(profiles, {"pp": p, "dp": d, "tp": t}, plan, c, batch, recompute="full")
        s, lay, h, V = cfg.seq, cfg.layers, cfg.dim, cfg.vocab
        flops = 96 * batch * s * lay * h * h * (1 + s / (6 * h) + V / (16 * lay * h))
        tf = flops / (e.step_time_s * gpus) / 1e12
        r = autopar.plan(model, gpus, example_inputs=example, cluster=c, global_batch=batch, profiles=profiles)
        tf_plan = flops / (r.step_time_s * gpus) / 1e12
        print(f"{name:9s} {t:>2} {p:>3} {d:>3} {batch:>6} {pub:>15} {tf:>10.1f} {tf / pub:>6.2f} "
              f"{e.memory_bytes / 2**30:>8.1f} {e.bubble_fraction:>7.3f}  {r.plan} {dict(r.mesh.axes)} "
              f"recompute={r.recompute} ({tf_plan:.1f})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-local", action="store_true")
    ap.add_argument("--skip-published", action="store_true")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=21, help="timed steps per plan (the median is reported)")
    args = ap.parse_args()
    if not args.skip_speed:
        planner_speed()
    if not args.skip_local:
        local_predictions(args.runs, args.steps)
    if not args.skip_published:
        published()


if __name__ == "__main__":
    main()
