"""The cost model on models and plans its calibration never ran, and the planner's pick measured
against every plan it could have picked.

    python benchmarks/bench_holdout.py [--worlds 2 4] [--steps 41] [--passes 5] [--calibrations each|once] [--live-contention 0] [--statistic mean|median] [--measure alone|rounds] [--block 4] [--plans PART ...] [--skip-grid] [--quality]
    python benchmarks/bench_holdout.py --compare LOG_A LOG_B [LOG ...]
    python benchmarks/bench_holdout.py --repredict LOG [--trials] [--set PART.FIELD=NUMBER ...]

1. Hold-out grid (default): GPT (``autopar.models.TinyGPT``) at widths 32/64/96 x depths 2/4 x
   sequence lengths 16/48, and the test suite's Llama (``autopar.models.Llama()``), under one
   plan of every parallelism (ddp, ZeRO-1/2/3, tp, tp+sp, pp 1F1B, interleaved and zero-bubble)
   on 2 and on 4 gloo processes. The local calibration's probes run none of these (a synthetic
   stack of linear layers, GPTs of h=8, bare collectives and matmuls). Measured as
   tests/jobs/predict.py measures its small GPT: bytes by the counters, peak memory by the
   census plus the profiler's peak, step time as the slowest rank's mean of ``--steps``
   steps (``--statistic``: the median in runs 5-43; ``_step`` says why). ``--measure alone``
   (default): each plan alone in the processes, as a training job runs it: compiled, 3
   untimed steps, then its steps one after another, freed before the next plan is compiled.
   ``--measure rounds``: all plans of a model resident and timed in rounds, each plan a block
   of ``--block`` consecutive steps a round, the first not timed (the way of
   runs 22-27; on 2 processes plans beside each other measured slower, ddp 1.18x and
   zero-bubble 1.14x their step alone: BENCHMARKS.md, runs 26-28).
   ``jobs.holdout.measured_cases`` measures either way. ``--passes K``: the whole grid measured
   K times, one pass after another (the first also counts bytes and memory), each compiling and
   timing every plan again; a row's step is the median of its K passes' steps, each pass's
   printed beside it, with how far the passes are apart. One pass (runs 5-34) read each row in
   one stretch of about half a second: on this machine a pass's steps ran 0.88-1.10x their
   rows' medians together, and a row's step moved 7.1-10.2% on average beyond that
   (BENCHMARKS.md, runs 35-37). Five passes by default since run 59 (three in runs 35-58): a
   row missed when two of its three passes ran slow together (run 58: five rows at world 2, each
   with two passes 1.2-2.1x its fastest), and the median of five trials needs three (run 60 measured
   seven; its first five, read as five, met the same goals, where run 61, five passes of the
   same code, did not: BENCHMARKS.md). The passes go round the worlds (pass 1 of world 2, of world 4,
   then pass 2 ...). Predicted by ``evaluate_plan`` on the ``local`` preset. ``--calibrations
   each`` (default): every pass after the first is preceded by a calibration of its own (its
   preset printed and kept beside the cache), and is predicted from it: each pass is a whole
   hold-out trial (calibrate on the probes, predict, measure) and a row's ratio is the median
   of its trials' predicted / measured. Three calibrations of the same machine within 80
   minutes moved a row's prediction by 11% on average and 27% at most (ZeRO-1/2 on 2
   processes by 21%: BENCHMARKS.md, runs 50-51), as much as the passes' measurements move; one
   calibration for every pass carries its error into every pass alike. ``--calibrations
   once``: every pass predicted from the one preset (runs 5-49). ``--live-contention SECONDS``
   (default 0: off): before each model's plans in every pass, the calibration's contention
   probe (the synthetic stack looped alone, then by every rank at once) is read again in the
   grid's processes, and the summary also prints the error had each row been predicted with
   that reading as its preset's contention of the world's processes. The contention of 2
   processes read 1.00-1.49 in calibrations minutes apart (BENCHMARKS.md, runs 50-53), and it
   scales every world-2 prediction; but read before each model (run 53, 0.5 s) it predicted
   no better than the calibrations' own (mean 9.5% against 8.7%, worst 34.2% against 33.7%).
   Prints a row per (world, model, plan) and the
   mean and worst |predicted/measured - 1| of step time and memory, and how many rows' bytes
   are exact.
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
   the cache, against that pass's measurement); ``--set`` replaces numbers of the preset first (``device.FIELD`` or a
   link's, ``intra``/``inter``/``shared``). How a change to the model reads on runs already
   measured.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

BATCH = 8
WIDTHS, DEPTHS, SEQS = (32, 64, 96), (2, 4), (16, 48)

# (name, mesh axes, plan keyword arguments): one plan of each parallelism on 2 processes
PLANS_2 = (
    ("ddp", {"dp": 2}, {"dp": "ddp"}),
    ("zero1", {"dp": 2}, {"dp": "zero1"}),
    ("zero2", {"dp": 2}, {"dp": "zero2"}),
    ("zero3", {"dp": 2}, {"dp": "zero3"}),
    ("tp", {"tp": 2}, {"dp": "ddp", "tp": True}),
    ("tp+sp", {"tp": 2}, {"dp": "ddp", "tp": True, "sp": True}),
    ("pp 1f1b", {"pp": 2}, {"dp": "ddp", "pp_schedule": "1f1b", "microbatches": 4}),
    ("pp interleaved", {"pp": 2}, {"dp": "ddp", "pp_schedule": "interleaved", "microbatches": 4,
                                   "virtual_stages": 2}),
    ("pp zero_bubble", {"pp": 2}, {"dp": "ddp", "pp_schedule": "zero_bubble", "microbatches": 4}),
)


def plans(world: int) -> tuple:
    """One plan of every parallelism on ``world`` processes: tests/jobs/predict.py's at 4."""
    from jobs import predict
    return PLANS_2 if world == 2 else predict.PREDICT_PLANS


def grid_models() -> list:
    """(key, spec, batch) of the hold-out models: ("gpt", GPTConfig fields) / ("llama", ...)."""
    out = [(f"gpt h{h} L{n} s{s}", ("gpt", dict(vocab=67, seq=s, dim=h, heads=4, layers=n, max_seq=s)), BATCH)
           for h in WIDTHS for n in DEPTHS for s in SEQS]
    return out + [("llama", ("llama", {}), BATCH)]


def predictions(models, plan_list, cluster, per_model=None) -> dict:
    """(model key, plan name) -> Estimate, by ``evaluate_plan`` on ``cluster`` (or on
    ``per_model[model key]`` where given)."""
    import autopar
    from autopar.cost.estimate import Profiles, evaluate_plan
    from autopar.models import gpt_batch
    from jobs.holdout import build
    out = {}
    for key, spec, batch in models:
        model, c = build(spec)
        x, _ = gpt_batch(c, batch)
        profiles = Profiles(model, (x,))
        on = (per_model or {}).get(key, cluster)
        for name, axes, kw in plan_list:
            out[(key, name)] = evaluate_plan(profiles, axes, autopar.Plan(**kw), on, batch)
    return out


def live_slowdown(per_rank) -> float:
    """The slowdown of ``jobs.holdout.live_contention``'s readings (per rank: (alone or None,
    crowded)): the ranks' harmonic mean crowded over rank 0's alone, at least 1, as the
    calibration makes each of its readings (``calibration.local._reading``)."""
    from autopar.cost.calibration.local import _reading
    alone = next(a for a, _ in per_rank if a is not None)
    return max(1.0, _reading([c for _, c in per_rank], alone))


def with_contention(cluster, processes: int, slowdown: float):
    """``cluster`` with its contention of ``processes`` processes set to ``slowdown`` (the other
    counts as calibrated)."""
    table = dict(cluster.contention)
    table[processes] = slowdown
    return cluster.with_(contention=tuple(sorted(table.items())))


STATISTICS = {"mean": statistics.mean, "median": statistics.median}


def _step(per_rank, k, statistic: str = "mean") -> float:
    """The slowest rank's step time: the mean (default) or the median of its timed steps.

    The mean since run 44. A training run takes the sum of its steps, and the published step
    times bench_plan.py is checked against are averages over a logging interval. The local
    calibration's collective latencies are block averages (``_excess_per_round``: a block's
    span over its rounds), so a prediction carries the communication's slow tail. On these 2
    cores a gloo collective's time is heavy-tailed (five 100 KB all-reduces after a barrier:
    median 2.7 ms, mean 5.1, 90th percentile 11.9; 2026-12-05), and a small plan's steps fall
    in two clusters (Llama's ddp on 2 processes: about 3.6 ms and 6-8 ms), so the median of 41
    steps jumps between the two from run to run (8 runs in a row: slowest rank's median
    4.5-6.4 ms, spread 10.6%; its mean 5.5-6.4 ms, 5.3%)."""
    return max(STATISTICS[statistic](r[k]["times"]) for r in per_rank)


def trial_path(i: int) -> str:
    """Where trial ``i``'s calibration is kept: the local preset's cache for trial 0, beside it
    as ``local_cluster.trial{i}.json`` for the others."""
    from autopar.cost import cache
    base = cache.cache_path()
    return base if i == 0 else os.path.join(os.path.dirname(base), f"local_cluster.trial{i}.json")


def trial_cluster(i: int):
    """A calibration of its own for trial ``i`` (> 0) of ``--calibrations each``, measured now and
    kept at ``trial_path(i)`` (the cache itself, trial 0's, is left as it was)."""
    from autopar.cost.calibration import calibrate_local
    path = trial_path(i)
    c = calibrate_local(force=True, cache_path=path)
    print(f"\ntrial {i}: local preset measured again (kept in {path}):\n  " + c.source.replace("\n", "\n  "),
          flush=True)
    return c


def trial_ratio(preds, measured) -> float:
    """A row's predicted / measured: the median over its passes of each pass's prediction (its
    trial's calibration's) over that pass's measurement; with one calibration for every pass,
    the prediction over the passes' median (an odd number of them)."""
    return statistics.median(p / m for p, m in zip(preds, measured))


def grid(worlds, steps: int, cluster, only=None, block: int = 4, alone: bool = True, passes: int = 1,
         statistic: str = "mean", recalibrate: bool = False, contention_seconds: float = 0.0) -> list:
    """The hold-out grid, ``passes`` passes over every world's rows, one pass after another.
    ``recalibrate``: each pass is a trial of its own, the machine calibrated before it (the first
    on ``cluster``, the others by ``trial_cluster``) and its rows predicted from that calibration;
    a row's ratio is the median of its trials' predicted / measured. Otherwise every pass is
    predicted from ``cluster`` and a row's ratio is its prediction over its passes' median.
    ``contention_seconds`` > 0: before each model's plans in every pass the calibration's
    contention probe is read again (``jobs.holdout.live_contention``), and each row is also
    predicted with its pass's calibration carrying that reading as its contention of ``world``
    processes (``ratio_live``; printed as a summary of its own)."""
    from autopar.testing import run
    from jobs.holdout import measured_cases
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
                each = [_step(m, k, statistic) for m in measured[world]]
                others = [_step(m, k, OTHER[statistic]) for m in measured[world]]
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


OTHER = {"mean": "median", "median": "mean"}


def _errors(rows, field: str) -> tuple:
    """(|ratio - 1| of each row, the row furthest off) by the rows' ``field`` ratio."""
    st = [abs(r[field] - 1) for r in rows]
    return st, rows[st.index(max(st))]


def other_summary(rows, label: str, statistic: str) -> None:
    """The step time's error had each pass's step been the slowest rank's ``statistic`` instead."""
    st, worst = _errors(rows, "ratio_other")
    print(f"  {label} by the slowest rank's {statistic} step instead: step time |pred/meas - 1| mean "
          f"{statistics.mean(st):.1%}, worst {max(st):.1%} ({worst['model']}, {worst['plan']}, world {worst['world']}), "
          f"{sum(x <= 0.25 for x in st)} within 25%; measured {statistic} / measured by the grid's statistic: "
          f"{statistics.mean(r['step_other'] / r['step'] for r in rows):.3f} on average")


def live_summary(rows, label: str) -> None:
    """The step time's error had each pass's rows been predicted with the contention read just
    before their model's plans (``grid``'s ``contention_seconds``); nothing without it."""
    if not rows or "ratio_live" not in rows[0]:
        return
    st, worst = _errors(rows, "ratio_live")
    read = [x for r in rows for x in r["contention_live"]]
    by_plan: dict = {}
    for r in rows:
        by_plan.setdefault(r["plan"], []).append(r["ratio_live"])
    print(f"  {label} predicted with the contention read before each model's plans ({min(read):.2f}-{max(read):.2f}): "
          f"step time |pred/meas - 1| mean {statistics.mean(st):.1%}, worst {max(st):.1%} ({worst['model']}, "
          f"{worst['plan']}, world {worst['world']}), {sum(x <= 0.25 for x in st)} within 25%; by plan: " + "; ".join(
              f"{p} {statistics.mean(v):.2f}" for p, v in by_plan.items()))


def summary(rows, label: str) -> None:
    st, worst = _errors(rows, "ratio")
    mem = [abs(r["peak_pred"] / r["peak"] - 1) for r in rows]
    worst_m = max(rows, key=lambda r: abs(r["peak_pred"] / r["peak"] - 1))
    print(f"{label}: {len(rows)} rows; step time |pred/meas - 1| mean {statistics.mean(st):.1%}, worst {max(st):.1%} "
          f"({worst['model']}, {worst['plan']}, world {worst['world']}), {sum(x <= 0.25 for x in st)} within 25%; "
          f"bytes exact {sum(r['exact'] for r in rows)}/{len(rows)}; memory mean {statistics.mean(mem):.1%}, worst "
          f"{max(mem):.1%} ({worst_m['model']}, {worst_m['plan']}, world {worst_m['world']}), "
          f"{sum(x <= 0.10 for x in mem)} within 10%")
    k = min(len(r.get("passes", ())) for r in rows)
    if k > 1:      # how far the passes measured a row apart, and what each pass alone would have read
        spread = [abs(x / r["step"] - 1) for r in rows for x in r["passes"]]
        alone = [[abs(r["preds"][i] / r["passes"][i] - 1) for r in rows] for i in range(k)]
        level = [statistics.median(r["preds"][i] / r["passes"][i] for r in rows) for i in range(k)]
        print(f"  {k} passes: a pass's step from the rows' median: mean {statistics.mean(spread):.1%}, worst "
              f"{max(spread):.1%}; each pass alone, step time mean (worst): "
              + ", ".join(f"{statistics.mean(a):.1%} ({max(a):.1%})" for a in alone)
              + "; each pass's median pred/meas (the machine's pace against its calibration): "
              + ", ".join(f"{x:.3f}" for x in level))
    by_plan: dict = {}
    for r in rows:
        by_plan.setdefault(r["plan"], []).append(r["ratio"])
    print("  step time pred/meas by plan (mean, min..max): " + "; ".join(
        f"{p} {statistics.mean(v):.2f} ({min(v):.2f}..{max(v):.2f})" for p, v in by_plan.items()))


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
    from jobs.holdout import build, measured_cases, tune_pick
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
        measured = {n: _step(per_rank, (key, n)) for n, _, _, _ in cands}
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


_ROW = re.compile(r"(gpt h\d+ L\d+ s\d+|llama)\s+(\S+(?: \S+)?)\s+([\d,]+)\s+([\d,]+) \|\s+([\d.]+)\s+([\d.]+)"
                  r"\s+([\d.]+) \|\s+([\d.]+)\s+([\d.]+)")


def _grid_rows(path: str):
    """(world, row match, the line) of each row of the grids this script printed in ``path``."""
    world = None
    with open(path) as f:
        for line in f:
            m = re.match(r"## hold-out grid: world (\d+)", line)
            if m:
                world = int(m.group(1))
                continue
            m = _ROW.match(line)
            if m and world is not None:
                yield world, m, line


def parse_grid(path: str) -> dict:
    """(world, model, plan) -> (measured ms, predicted ms) from a grid this script printed."""
    return {(world, m.group(1), m.group(2)): (float(m.group(8)), float(m.group(9)))
            for world, m, _ in _grid_rows(path)}


def parse_passes(path: str) -> dict:
    """(world, model, plan) -> each pass's measured ms, from a grid this script printed with
    several passes (the columns after a row's ratio: the passes' steps, then their predictions);
    rows without them are left out."""
    return {(world, m.group(1), m.group(2)): [float(x) for x in line.split("|")[3].split()]
            for world, m, line in _grid_rows(path) if len(line.split("|")) >= 5}


def trial_clusters(passes: int) -> list:
    """The calibrations of a run's trials, read from its cache (``AUTOPAR_CACHE``) at
    ``trial_path``; None where a trial's file is missing."""
    from autopar.cost.cluster import cached_local
    return [cached_local(trial_path(i)) for i in range(passes)]


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


def with_fields(cluster, sets=()):
    """``cluster`` with ``LINK.FIELD=VALUE`` settings applied: a number (numbers joined by commas
    for a tuple, as ``tail``) of its ``device`` or of a link (``intra``, ``inter``, ``shared``;
    ``intra`` also sets ``inter`` where the two are one link, as on the local preset)."""
    for item in sets:
        key, _, value = item.partition("=")
        part, _, name = key.partition(".")
        if part not in ("device", "intra", "inter", "shared") or not name or not value:
            raise SystemExit(f"--set {item!r}: expected PART.FIELD=NUMBER with PART one of device, intra, inter, "
                             f"shared (e.g. shared.overlap_loss=1.0)")
        target = getattr(cluster, part)
        if target is None:
            raise SystemExit(f"--set {item!r}: cluster {cluster.name!r} has no {part} link (only the local preset "
                             f"has one, where ranks outnumber cores)")
        if not hasattr(target, name):
            raise SystemExit(f"--set {item!r}: the cluster's {part} has no field {name!r}")
        try:      # a number, or numbers joined by commas for a tuple field (e.g. intra.tail=0.0002,0.3)
            number = tuple(float(x) for x in value.split(",")) if "," in value else float(value)
        except ValueError:
            raise SystemExit(f"--set {item!r}: {value!r} is not a number (or numbers joined by commas)") from None
        new = dataclasses.replace(target, **{name: number})
        changes = {part: new}
        if part == "intra" and cluster.inter == cluster.intra:
            changes["inter"] = new
        cluster = cluster.with_(**changes)
    return cluster


def repredict(path: str, cluster, sets=(), trials: bool = False) -> dict:
    """A grid this script printed, its rows predicted again by this code on ``cluster`` (with
    ``with_fields(sets)``) against the grid's own measurements: how a change to the model reads
    on a run without measuring it again. ``trials``: each pass predicted again from its own
    trial's calibration (``trial_clusters``, each with ``sets``) against that pass's
    measurement, a row's ratio the median over its passes, as the grid computed it
    (``trial_ratio``); a run whose machine moved between passes reads on its own calibrations
    rather than on trial 0's alone. Returns (world, model, plan) -> predicted / measured."""
    rows = parse_grid(path)
    if not rows:
        raise SystemExit(f"--repredict {path}: no grid rows found (expected a log this script printed)")
    if trials:
        per_pass = parse_passes(path)
        if set(per_pass) != set(rows):
            raise SystemExit(f"--repredict {path} --trials: rows without their passes' steps (a grid of one pass?)")
        counts = {len(v) for v in per_pass.values()}
        clusters = trial_clusters(max(counts))
        missing = [i for i, c in enumerate(clusters) if c is None]
        if len(counts) != 1 or missing:
            raise SystemExit(f"--repredict --trials: passes per row {sorted(counts)}, trial calibrations missing "
                             f"{missing} beside {os.environ.get('AUTOPAR_CACHE', 'the cache')}: pass the run's own "
                             "AUTOPAR_CACHE, which holds local_cluster.trial1.json ... of --calibrations each")
        clusters = [with_fields(c, sets) for c in clusters]
    else:
        clusters = [with_fields(cluster, sets)]
    models = {k: (k, spec, b) for k, spec, b in grid_models()}
    out = {}
    for world in sorted({w for w, _, _ in rows}):
        keys = [k for k in rows if k[0] == world]
        plan_list = [p for p in plans(world) if any(k[2] == p[0] for k in keys)]
        preds = [predictions([models[m] for m in dict.fromkeys(k[1] for k in keys)], plan_list, c) for c in clusters]
        for k in keys:
            ms = [pred[(k[1], k[2])].step_time_s * 1e3 for pred in preds]
            out[k] = trial_ratio(ms, per_pass[k]) if trials else ms[0] / rows[k][0]
    for world in sorted({w for w, _, _ in out}) + [None]:
        keys = [k for k in out if world in (None, k[0])]
        for label, ratio in (("as printed (its 0.1 ms rows)", {k: rows[k][1] / rows[k][0] for k in keys}),
                             ("predicted again", {k: out[k] for k in keys})):
            err = {k: abs(r - 1) for k, r in ratio.items()}
            worst = max(err, key=err.get)
            print(f"{'all worlds' if world is None else f'world {world}'}, {label}: {len(keys)} rows; step time "
                  f"|pred/meas - 1| mean {statistics.mean(err.values()):.1%}, worst {err[worst]:.1%} ({worst[1]}, "
                  f"{worst[2]}, world {worst[0]}), {sum(e <= 0.25 for e in err.values())} within 25%")
        by_plan: dict = {}
        for k in keys:
            by_plan.setdefault(k[2], []).append(out[k])
        print("  predicted again, pred/meas by plan (mean, min..max): " + "; ".join(
            f"{p} {statistics.mean(v):.2f} ({min(v):.2f}..{max(v):.2f})" for p, v in by_plan.items()))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="process counts of the grid")
    ap.add_argument("--steps", type=int, default=41,
                    help="timed steps per plan, at least (fewer measure the same row less alike "
                         "from run to run: BENCHMARKS.md, runs 26-28)")
    ap.add_argument("--block", type=int, default=4,
                    help="--measure rounds and --quality: consecutive steps of a plan a round, the first not timed "
                         "(1: one step each in turn)")
    ap.add_argument("--measure", choices=("alone", "rounds"), default="alone",
                    help="the grid's step times: each plan alone in the processes (compiled, --steps consecutive "
                         "steps, freed before the next), or all plans of a model in rounds of --block steps")
    ap.add_argument("--passes", type=int, default=5,
                    help="times the grid is measured, one pass after another, each compiling and timing every plan "
                         "again; a row's step is the median of the passes' (default 5 since run 59; 3 in runs 35-58; "
                         "one pass: runs 5-34)")
    ap.add_argument("--calibrations", choices=("each", "once"), default="each",
                    help="each (default, run 50 on): every pass a trial of its own, predicted from a calibration "
                         "taken just before it, a row's ratio the median of its trials'; once: every pass predicted "
                         "from the one calibration taken (or cached) before the grid (runs 5-49)")
    ap.add_argument("--statistic", choices=tuple(STATISTICS), default="mean",
                    help="a pass's step of a row: the slowest rank's mean (default; runs 44 on) or median (runs 5-43) "
                         "of its timed steps; the summary also prints the error by the other")
    ap.add_argument("--live-contention", type=float, default=0.0, metavar="SECONDS",
                    help="before each model's plans in every pass, read the calibration's contention probe again "
                         "(SECONDS alone, twice that crowded; 0, the default: not) and print the error had each row "
                         "been predicted with that reading as its contention (run 53 read 0.5: no better than the "
                         "calibrations' own; BENCHMARKS.md)")
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
