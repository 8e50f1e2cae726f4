"""The cost model on models and plans its calibration never ran, and the planner's pick measured
against every plan it could have picked.

    python benchmarks/bench_holdout.py [--worlds 2 4] [--steps 41] [--passes 5] [--calibrations each|once] [--live-contention 0] [--statistic mean|median] [--measure alone|rounds] [--block 4] [--plans PART ...] [--skip-grid] [--quality]
    python benchmarks/bench_holdout.py --compare LOG_A LOG_B [LOG ...]
    python benchmarks/bench_holdout.py --repredict LOG [--trials] [--set PART.FIELD=NUMBER ...]

The harness (the grid, the jobs its ranks run, reading a printed grid) is ``autopar.holdout``'s;
this script runs it and prints. Each figure's reasons are in BENCHMARKS.md, bench_holdout.py.

1. Hold-out grid (default): GPT (``autopar.models.TinyGPT``) at widths 32/64/96 x depths 2/4 x
   sequence lengths 16/48, and the test suite's Llama (``autopar.models.Llama()``), under one
   plan of every parallelism (ddp, ZeRO-1/2/3, tp, tp+sp, pp 1F1B, interleaved and zero-bubble)
   on 2 and on 4 gloo processes. The local calibration's probes run none of these (a synthetic
   stack of linear layers, GPTs of h=8, bare collectives and matmuls). Measured as
   tests/test_predict_local.py measures its small GPT: bytes by the counters, peak memory by the
   census plus the profiler's peak, step time as the slowest rank's mean of ``--steps`` steps
   (``--statistic``; ``autopar.holdout.step_time`` says why the mean). ``--measure alone``
   (default): each plan alone in the processes, as a training job runs it: compiled, 3
   untimed steps, then its steps one after another, freed before the next plan is compiled.
   ``--measure rounds``: all plans of a model resident and timed in rounds, each plan a block
   of ``--block`` consecutive steps a round, the first not timed (on 2 processes plans beside
   each other measure slower, ddp 1.18x and zero-bubble 1.14x their step alone).
   ``autopar.holdout.measured_cases`` measures either way. ``--passes K``: the whole grid
   measured K times, one pass after another (the first also counts bytes and memory), each
   compiling and timing every plan again; a row's step is the median of its K passes' steps,
   each pass's printed beside it, with how far the passes are apart. One pass reads each row in
   one stretch of about half a second: on the machine of BENCHMARKS.md a pass's steps take
   0.88-1.10x their rows' medians together, and a row's step moves 7.1-10.2% on average beyond
   that. Five passes by default: of three, two passes running slow together (each 1.2-2.1x the
   row's fastest) make a row miss, and the median of five needs three. The passes go round the
   worlds (pass 1 of world 2, of world 4, then pass 2 ...). Predicted by ``evaluate_plan`` on
   the ``local`` preset. ``--calibrations each`` (default): every pass after the first is
   preceded by a calibration of its own (its preset printed and kept beside the cache), and is
   predicted from it: each pass is a whole hold-out trial (calibrate on the probes, predict,
   measure) and a row's ratio is the median of its trials' predicted / measured. Three
   calibrations of the same machine within 80 minutes moved a row's prediction by 11% on
   average and 27% at most (ZeRO-1/2 on 2 processes by 21%), as much as the passes'
   measurements move; one calibration for every pass carries its error into every pass alike.
   ``--calibrations once``: every pass predicted from the one preset. ``--live-contention
   SECONDS`` (default 0: off): before each model's plans in every pass, the calibration's
   contention probe (the synthetic stack looped alone, then by every rank at once) is read
   again in the grid's processes, and the summary also prints the error had each row been
   predicted with that reading as its preset's contention of the world's processes. The
   contention of 2 processes reads 1.00-1.49 in calibrations minutes apart, and it scales every
   world-2 prediction; but read before each model (0.5 s) it predicts no better than the
   calibrations' own (mean 9.5% against 8.7%, worst 34.2% against 33.7%).
   Prints a row per (world, model, plan) and the mean and worst |predicted/measured - 1| of
   step time and memory, and how many rows' bytes are exact.
2. ``--quality``: on 4 processes, for four models of different shapes (wide and shallow,
   narrow and deep, long sequences, the Llama), ``autopar.plan`` (local preset, no
   recomputation: compile has nothing that matches the planner's recomputation choice), and
   every plan of its report's candidates, all measured in the same rounds: each plan's
   predicted and measured step time and rank, and the chosen plan's measured time over the
   fastest measured one. Before that, ``autopar.tune`` measures the planner's first three in
   processes of its own and chooses one; its pick's time in this benchmark's measurement over
   the fastest is printed beside the planner's.
3. ``--compare LOG_A LOG_B [LOG ...]``: grids this script printed (its output saved), the same
   rows measured in each: how far apart the measurements are (the noise floor any prediction
   is judged against), and each run's prediction error against its own measurement and
   against the geometric mean of all the runs' measurements.
4. ``--repredict LOG``: a grid this script printed, its rows predicted again by the code as it
   is on the cached local preset (``AUTOPAR_CACHE``: the run's own calibration), against that
   grid's measurements (``--trials``: each pass from its own trial's calibration, kept beside
   the cache, against that pass's measurement); ``--set`` replaces numbers of the preset first
   (``device.FIELD`` or a link's, ``intra``/``inter``/``shared``). How a change to the model
   reads on runs already measured.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import time

from autopar.holdout import (BATCH, OTHER, STATISTICS, build, grid_models, live_slowdown,
                             live_summary, measured_cases, other_summary, parse_grid, plans, predictions,
                             repredict, step_time, summary, trial_path, trial_ratio, tune_pick, with_contention)


def trial_cluster(i: int):
    """A calibration of its own for trial ``i`` (> 0) of ``--calibrations each``, measured now and
    kept at ``trial_path(i)`` (the cache itself, trial 0's, is left as it was)."""
    from autopar.cost.calibration import calibrate_local
    path = trial_path(i)
    c = calibrate_local(force=True, cache_path=path)
    print(f"\ntrial {i}: local preset measured again (kept in {path}):\n  " + c.source.replace("\n", "\n  "),
          flush=True)
    return c


def grid(worlds, steps: int, cluster, only=None, block: int = 4, alone: bool = True, passes: int = 1,
         statistic: str = "mean", recalibrate: bool = False, contention_seconds: float = 0.0) -> list:
    """The hold-out grid, ``passes`` passes over every world's rows, one pass after another.
    ``recalibrate``: each pass is a trial of its own, the machine calibrated before it (the first
    on ``cluster``, the others by ``trial_cluster``) and its rows predicted from that calibration;
    a row's ratio is the median of its trials' predicted / measured. Otherwise every pass is
    predicted from ``cluster`` and a row's ratio is its prediction over its passes' median.
    ``contention_seconds`` > 0: before each model's plans in every pass the calibration's
    contention probe is read again (``autopar.holdout.live_contention``), and each row is also
    predicted with its pass's calibration carrying that reading as its contention of ``world``
    processes (``ratio_live``; printed as a summary of its own)."""
    from autopar.testing import run
    if passes < 1:
        raise SystemExit(f"--passes {passes}: expected at least one pass over the grid")
    models = grid_models()
    plan_lists = {w: [p for p in plans(w) if not only or any(o in p[0] for o in only)] for w in worlds}
    clusters, measured, seconds = [], {w: [] for w in worlds}, dict.fromkeys(worlds, 0.0)
    for i in range(passes):
        clusters.append(trial_cluster(i) if recalibrate and i > 0 else cluster)
        for world in worlds:       # pass i of every world, then pass i + 1: the worlds share the machine's drift
            t0 = time.perf_counter()
            cases = [(k, spec, b, plan_lists[world]) for k, spec, b in models]
            # pass 1 measures bytes and memory too; every pass compiles and times each plan again
            measured[world].append(run(measured_cases, world, cases, steps, i == 0, block, alone, contention_seconds,
                                       timeout=3600))
            seconds[world] += time.perf_counter() - t0
    rows = []
    for world in worlds:
        plan_list = plan_lists[world]
        preds = [predictions(models, plan_list, c) for c in (clusters if recalibrate else clusters[:1])]
        preds += [preds[0]] * (passes - len(preds))
        live = []        # per pass: the predictions with the contention read before each model's plans
        if contention_seconds > 0:
            for i, m in enumerate(measured[world]):
                c = clusters[i] if recalibrate else clusters[0]
                read = {key: live_slowdown([r[("contention", key)] for r in m]) for key, _, _ in models}
                per_model = {key: with_contention(c, world, x) for key, x in read.items()}
                live.append((predictions(models, plan_list, c, per_model), read))
        per_rank = measured[world][0]
        trials = recalibrate and passes > 1
        print(f"\n## hold-out grid: world {world}, global batch {BATCH}, {len(models)} models x {len(plan_list)} "
              f"plans, measured in {seconds[world]:.0f} s on {os.cpu_count()} cores"
              + f"; step: the slowest rank's {statistic} of its {steps} timed steps"
              + (f", the median of {passes} passes'" if passes > 1 else "")
              + (f"; {passes} trials, each pass predicted from a calibration of its own taken just before it: pred "
                 f"the median of the trials' predictions, ratio the median of the trials' pred/meas" if trials else "")
              + ("; live: each pass's prediction with the contention read before the model's plans" if live else ""))
        print(f"{'model':16s} {'plan':15s} {'bytes meas':>10s} {'pred':>10s} | {'peak MB':>8s} {'pred':>7s} "
              f"{'ratio':>5s} | {'step ms':>8s} {'pred':>7s} {'ratio':>5s}" + (" | passes' steps" if passes > 1 else "")
              + (" | trials' predictions" if trials else ""))
        for key, _, _ in models:
            for name, _, _ in plan_list:
                k = (key, name)
                rs = [r[k] for r in per_rank]
                b = max(r["bytes"] for r in rs)
                peak = max(r["peak"] for r in rs)
                each = [step_time(m, k, statistic) for m in measured[world]]
                others = [step_time(m, k, OTHER[statistic]) for m in measured[world]]
                each_pred = [p[k].step_time_s for p in preds]
                step, pred_step = statistics.median(each), statistics.median(each_pred)
                e = preds[0][k]
                axes_ok = all(max(r["by_axis"][a] for r in rs) == v for a, v in e.comm_bytes_by_axis.items())
                ratio = trial_ratio(each_pred, each)
                rows.append(dict(world=world, model=key, plan=name, bytes=b, bytes_pred=e.comm_bytes,
                                 exact=b == e.comm_bytes and axes_ok, peak=peak, peak_pred=e.memory_bytes,
                                 step=step, ratio=ratio, passes=each,
                                 preds=each_pred, ratio_other=trial_ratio(each_pred, others),
                                 step_other=statistics.median(others)))
                if live:
                    rows[-1].update(preds_live=[p[k].step_time_s for p, _ in live],
                                    contention_live=[c[key] for _, c in live])
                    rows[-1]["ratio_live"] = trial_ratio(rows[-1]["preds_live"], each)
                print(f"{key:16s} {name:15s} {b:>10,.0f} {e.comm_bytes:>10,.0f} | {peak / 1e6:>8.3f} "
                      f"{e.memory_bytes / 1e6:>7.3f} {e.memory_bytes / peak:>5.2f} | {step * 1e3:>8.1f} "
                      f"{pred_step * 1e3:>7.1f} {ratio:>5.2f}"
                      + (" | " + " ".join(f"{x * 1e3:.1f}" for x in each) if passes > 1 else "")
                      + (" | " + " ".join(f"{x * 1e3:.1f}" for x in each_pred) if trials else "")
                      + (" | live " + " ".join(f"{x * 1e3:.1f}" for x in rows[-1]["preds_live"]) if live else ""))
        summary([r for r in rows if r["world"] == world], f"world {world}")
        other_summary([r for r in rows if r["world"] == world], f"world {world}", OTHER[statistic])
        live_summary([r for r in rows if r["world"] == world], f"world {world}")
    if len(worlds) > 1:
        summary(rows, "all worlds")
        other_summary(rows, "all worlds", OTHER[statistic])
        live_summary(rows, "all worlds")
    return rows


# wide and shallow, narrow and deep, long sequences, and the test suite's Llama
QUALITY_MODELS = (
    ("wide-shallow gpt h128 L2 s16", ("gpt", dict(vocab=67, seq=16, dim=128, heads=4, layers=2, max_seq=16)), 16),
    ("narrow-deep gpt h32 L8 s16", ("gpt", dict(vocab=67, seq=16, dim=32, heads=4, layers=8, max_seq=16)), 16),
    ("long-seq gpt h64 L2 s128", ("gpt", dict(vocab=67, seq=128, dim=64, heads=4, layers=2, max_seq=128)), 8),
    ("llama", ("llama", {}), 16),
)


TUNE_TOP = 3     # the candidates --quality hands autopar.tune: the planner's first three


def _plan_kwargs(plan) -> dict:
    return {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if getattr(plan, f.name) != f.default}


def quality(steps: int, cluster, world: int = 4, block: int = 4) -> list:
    """The planner's pick against every candidate of its report, measured in the same rounds."""
    import autopar
    from autopar.models import gpt_batch
    from autopar.testing import run
    ratios = []
    for key, spec, batch in QUALITY_MODELS:
        model, c = build(spec)
        x, _ = gpt_batch(c, batch)
        report = autopar.plan(model, world, example_inputs=(x,), cluster=cluster, recompute=("none",))
        cands = [(f"#{i + 1}", dict(x_.axes), _plan_kwargs(x_.plan), x_) for i, x_ in enumerate(report.candidates)
                 if x_.fits]
        t0 = time.perf_counter()
        # autopar.tune over the planner's first TUNE_TOP candidates, in processes of its own; then
        # every candidate measured by this benchmark, in the same rounds: tune's pick is judged by that
        tuned = cands[run(tune_pick, world, spec, batch, [(a, kw) for _, a, kw, _ in cands[:TUNE_TOP]], steps,
                          timeout=1800)[0]][0]
        per_rank = run(measured_cases, world, [(key, spec, batch, [(n, a, kw) for n, a, kw, _ in cands])], steps,
                       False, block, timeout=1800)
        measured = {n: step_time(per_rank, (key, n)) for n, _, _, _ in cands}
        order = sorted(measured, key=measured.get)
        print(f"\n## planner quality: {key} ({c}), global batch {batch}, world {world}; {report.searched} plans "
              f"searched, {len(cands)} candidates measured in {time.perf_counter() - t0:.0f} s")
        print(f"{'#':>3s} {'mesh':22s} {'plan':70s} {'pred ms':>8s} {'meas ms':>8s} {'rank':>4s}")
        for n, axes, kw, cand in cands:
            mesh = ", ".join(f"{a}={s}" for a, s in axes.items())
            print(f"{n:>3s} {mesh:22s} {str(cand.plan)[:70]:70s} {cand.step_time_s * 1e3:>8.1f} "
                  f"{measured[n] * 1e3:>8.1f} {order.index(n) + 1:>4d}")
        ratio = measured["#1"] / measured[order[0]]
        tuned_ratio = measured[tuned] / measured[order[0]]
        ratios.append((key, ratio, tuned_ratio))
        print(f"chosen (#1): measured {measured['#1'] * 1e3:.1f} ms; fastest measured {order[0]} "
              f"{measured[order[0]] * 1e3:.1f} ms; ratio {ratio:.3f} (goal <= 1.10)")
        print(f"autopar.tune over #1-#{min(TUNE_TOP, len(cands))}: chose {tuned}, measured here "
              f"{measured[tuned] * 1e3:.1f} ms; ratio {tuned_ratio:.3f}")
    print("\nplanner quality: chosen / fastest measured: " + ", ".join(f"{k} {r:.3f}" for k, r, _ in ratios))
    print(f"autopar.tune (the planner's first {TUNE_TOP}, measured) / fastest measured: "
          + ", ".join(f"{k} {t:.3f}" for k, _, t in ratios))
    return ratios


def compare(*paths: str) -> None:
    """How far printed grids' measurements of the same rows are apart (the measurement's own
    repeatability: no prediction can be closer to one run than the runs are to each other):
    each pair of runs, and each run's prediction error against its own measurement and
    against the geometric mean of every run's measurement of the row (rows as printed, 0.1 ms)."""
    if len(paths) < 2:
        raise SystemExit(f"--compare needs at least two grids this script printed; got {len(paths)}")
    runs = [parse_grid(p) for p in paths]
    names = [chr(ord("A") + i) for i in range(len(runs))]
    print("runs: " + ", ".join(f"{n} = {p}" for n, p in zip(names, paths)))
    worlds = sorted(set.intersection(*({k[0] for k in r} for r in runs)))
    for world in worlds + ([None] if len(worlds) > 1 else []):
        keys = [k for k in runs[0] if world in (None, k[0]) and all(k in r for r in runs)]
        label = f"world {world}" if world is not None else "all worlds"
        for i in range(len(runs)):
            for j in range(i + 1, len(runs)):
                again = [abs(runs[j][k][0] / runs[i][k][0] - 1) for k in keys]
                print(f"{label}: {len(keys)} rows measured in all; measured {names[j]} / measured {names[i]}: mean "
                      f"|ratio - 1| {statistics.mean(again):.1%}, worst {max(again):.1%}, {sum(x <= 0.10 for x in again)} "
                      f"within 10%, {sum(x <= 0.25 for x in again)} within 25%")
        geo = {k: math.exp(statistics.mean(math.log(r[k][0]) for r in runs)) for k in keys}
        for name, run in zip(names, runs):
            own = [abs(run[k][1] / run[k][0] - 1) for k in keys]
            both = [abs(run[k][1] / geo[k] - 1) for k in keys]
            spread = [abs(run[k][0] / geo[k] - 1) for k in keys]
            print(f"  run {name}'s prediction against its own measurement: mean {statistics.mean(own):.1%}, worst "
                  f"{max(own):.1%}; against the runs' geometric mean: mean {statistics.mean(both):.1%}, worst "
                  f"{max(both):.1%}, {sum(x <= 0.25 for x in both)} within 25% (its measurement from that mean: mean "
                  f"{statistics.mean(spread):.1%}, worst {max(spread):.1%})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="process counts of the grid")
    ap.add_argument("--steps", type=int, default=41,
                    help="timed steps per plan, at least (fewer measure the same row less alike "
                         "from one measurement to the next: BENCHMARKS.md, bench_holdout.py)")
    ap.add_argument("--block", type=int, default=4,
                    help="--measure rounds and --quality: consecutive steps of a plan a round, the first not timed "
                         "(1: one step each in turn)")
    ap.add_argument("--measure", choices=("alone", "rounds"), default="alone",
                    help="the grid's step times: each plan alone in the processes (compiled, --steps consecutive "
                         "steps, freed before the next), or all plans of a model in rounds of --block steps")
    ap.add_argument("--passes", type=int, default=5,
                    help="times the grid is measured, one pass after another, each compiling and timing every plan "
                         "again; a row's step is the median of the passes' (default 5: the median of fewer moves "
                         "with two slow passes)")
    ap.add_argument("--calibrations", choices=("each", "once"), default="each",
                    help="each (default): every pass a trial of its own, predicted from a calibration "
                         "taken just before it, a row's ratio the median of its trials'; once: every pass predicted "
                         "from the one calibration taken (or cached) before the grid")
    ap.add_argument("--statistic", choices=tuple(STATISTICS), default="mean",
                    help="a pass's step of a row: the slowest rank's mean (default) or median "
                         "of its timed steps; the summary also prints the error by the other")
    ap.add_argument("--live-contention", type=float, default=0.0, metavar="SECONDS",
                    help="before each model's plans in every pass, read the calibration's contention probe again "
                         "(SECONDS alone, twice that crowded; 0, the default: not) and print the error had each row "
                         "been predicted with that reading as its contention (read for 0.5 s: no better than the "
                         "calibrations' own; BENCHMARKS.md, bench_holdout.py)")
    ap.add_argument("--skip-grid", action="store_true", help="skip the hold-out grid")
    ap.add_argument("--plans", nargs="+", metavar="PART",
                    help="the grid's plans whose name contains one of these (e.g. pp: the pipelines only)")
    ap.add_argument("--quality", action="store_true", help="measure the planner's pick against its candidates")
    ap.add_argument("--quality-steps", type=int, default=41,
                    help="timed steps per candidate, at least, of --quality (as many as the grid's: the picks are a few %% apart)")
    ap.add_argument("--compare", nargs="+", metavar="LOG",
                    help="two or more grids this script printed: how far their measurements of the same rows are "
                         "apart, and each run's predictions against their geometric mean")
    ap.add_argument("--repredict", metavar="LOG",
                    help="a grid this script printed: its rows predicted again by this code on the cached local "
                         "preset (AUTOPAR_CACHE: the run's own calibration), against the grid's measurements")
    ap.add_argument("--trials", action="store_true",
                    help="--repredict: each pass from its own trial's calibration (local_cluster.trialN.json "
                         "beside the cache), a row's ratio the median over its passes")
    ap.add_argument("--set", nargs="+", default=[], metavar="PART.FIELD=NUMBER",
                    help="--repredict: preset numbers to replace first, e.g. shared.overlap_loss=1.0")
    args = ap.parse_args()
    if args.compare:
        compare(*args.compare)
        return
    if args.repredict:
        from autopar.cost.cluster import get_cluster
        repredict(args.repredict, get_cluster("local"), args.set, args.trials)
        return
    from autopar.cost.calibration import calibrate_local
    c = calibrate_local()
    print("local preset:\n  " + c.source.replace("\n", "\n  "))
    if not args.skip_grid:
        grid(args.worlds, args.steps, c, args.plans, args.block, args.measure == "alone", args.passes, args.statistic,
             args.calibrations == "each", args.live_contention)
    if args.quality:
        quality(args.quality_steps, c, block=args.block)


if __name__ == "__main__":
    main()
