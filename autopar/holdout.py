"""The hold-out harness: the cost model checked on models and plans its calibration never ran
(``benchmarks/bench_holdout.py`` runs it; BENCHMARKS.md, bench_holdout.py).

The grid (``grid_models``, ``plans``): GPTs (``autopar.models.TinyGPT``) at widths 32/64/96 x
depths 2/4 x sequence lengths 16/48 and the test suite's Llama, under one plan of every
parallelism on 2 and on 4 gloo processes. The jobs its ranks run (``measured_cases``,
``live_contention``, ``tune_pick``): per rank, the bytes each plan sends per step, its peak
memory and its step times, each plan's step compiled and measured as ``autopar.measure``
measures one. Reading a grid: its predictions (``predictions``), a row's step (``step_time``)
and ratio (``trial_ratio``), the summaries the benchmark prints, and a printed grid read back
and predicted again by the code as it is (``parse_grid``, ``repredict``).
"""
from __future__ import annotations

import dataclasses
import gc
import os
import re
import statistics

import torch
import torch.distributed as dist

from .cost import cache
from .cost.calibration.host_fits import reading
from .cost.calibration.stack import stack_seconds
from .cost.cluster import cached_local
from .cost.estimate import Profiles, evaluate_plan
from .measure import BLOCK, compiled_body, peak_of, timed_alone, timed_rounds
from .models import gpt_batch, lm_loss
from .phases import build
from .planspec import Plan
from .testing import steady_live_bytes
from .tuning import tune

__all__ = ["BATCH", "WIDTHS", "DEPTHS", "SEQS", "PLANS_2", "PLANS_4", "plans", "grid_models", "build", "prepared",
           "live_contention", "measured_cases", "tune_pick", "predictions", "live_slowdown", "with_contention",
           "STATISTICS", "OTHER", "step_time", "trial_path", "trial_clusters", "trial_ratio", "errors", "summary",
           "other_summary", "live_summary", "ROW", "grid_rows", "parse_grid", "parse_passes", "with_fields", "repredict"]

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

# (name, mesh axes, plan keyword arguments): one plan of each parallelism at world 4
PLANS_4 = (
    ("ddp", {"dp": 4}, {"dp": "ddp"}),
    ("zero1", {"dp": 4}, {"dp": "zero1"}),
    ("zero2", {"dp": 4}, {"dp": "zero2"}),
    ("zero3", {"dp": 4}, {"dp": "zero3"}),
    ("tp", {"dp": 2, "tp": 2}, {"dp": "ddp", "tp": True}),
    ("tp+sp", {"dp": 2, "tp": 2}, {"dp": "zero2", "tp": True, "sp": True}),
    ("pp 1f1b", {"pp": 2, "dp": 2}, {"dp": "ddp", "pp_schedule": "1f1b", "microbatches": 4}),
    ("pp interleaved", {"pp": 2, "dp": 2}, {"dp": "zero1", "pp_schedule": "interleaved", "microbatches": 4,
                                            "virtual_stages": 2}),
    ("pp zero_bubble", {"pp": 4}, {"dp": "ddp", "pp_schedule": "zero_bubble", "microbatches": 4}),
)


def plans(world: int) -> tuple:
    """One plan of every parallelism on ``world`` processes (``PLANS_2``, ``PLANS_4``: the
    plans tests/test_predict_local.py checks at world 4)."""
    return PLANS_2 if world == 2 else PLANS_4


def grid_models() -> list:
    """(key, spec, batch) of the hold-out models: ("gpt", GPTConfig fields) / ("llama", ...)."""
    out = [(f"gpt h{h} L{n} s{s}", ("gpt", dict(vocab=67, seq=s, dim=h, heads=4, layers=n, max_seq=s)), BATCH)
           for h in WIDTHS for n in DEPTHS for s in SEQS]
    return out + [("llama", ("llama", {}), BATCH)]


def prepared(spec, batch, axes, kw):
    """(step: zero_grad, forward, backward, AdamW step; body: the same without zero_grad; dm; opt)
    of the model of ``spec`` compiled under ``kw`` on a mesh of ``axes``."""
    model, c = build(spec)
    body, dm, opt = compiled_body(model, gpt_batch(c, batch), axes, kw)
    del model

    def step():
        opt.zero_grad(set_to_none=True)
        body()

    return step, body, dm, opt


# ---- the jobs the grid's ranks run --------------------------------------------------------------

def live_contention(seconds: float) -> tuple:
    """(seconds per loop alone or None, seconds per loop crowded) of this rank for the local
    calibration's contention probe read now: the synthetic stack's forward + backward
    (``cost.calibration.stack.stack_seconds``) looped ``seconds`` by rank 0 alone (the others
    waiting in a barrier, which takes no core), then by every rank at once for twice as long.
    ``live_slowdown`` makes the slowdown of it as the calibration does (the ranks' harmonic
    mean over alone)."""
    dist.barrier()
    alone = stack_seconds(seconds) if dist.get_rank() == 0 else None
    dist.barrier()
    return alone, stack_seconds(2 * seconds, dist.barrier)


def measured_cases(cases, steps: int = 7, memory: bool = True, block: int = BLOCK, alone: bool = False,
                   contention_seconds: float = 0.0) -> dict:
    """{(model key, plan name): {bytes, by_axis, peak, times}} on this rank for ``cases``, a list
    of (model key, spec, batch, [(plan name, mesh axes, plan kwargs), ...]). A model's plans
    are compiled one after another, each one's bytes (the counters, after two warm-up steps)
    and peak memory measured when it is compiled: ``autopar.measure.peak_of`` (what lives between
    its steps, the census after zero_grad, plus the profiler's peak of what a step allocates on
    top, each profiled step after zero_grad), less what lived before it was compiled.
    ``alone``: each plan's ``steps`` step times are then taken at once, the plan alone in the
    processes (``timed_alone``), and it is freed before the next is compiled. Otherwise the
    model's plans are timed in rounds, so that a disturbance of the machine falls on all of
    them alike: each round runs every plan for ``block`` consecutive steps and times all but the
    first, until each plan has at least ``steps`` times; then they are dropped before the next
    model. ``memory=False``: step times only (no counters, no census). ``contention_seconds``
    > 0: before each model's plans, the calibration's contention probe read again
    (``live_contention``), kept as ``out[("contention", model key)]``.

    Blocks, not one step each in turn: see ``autopar.tuning.timed_rounds``. Alone, not in
    rounds: on 2 processes, with a model's 9 plans resident and timed in rounds, ddp measures
    1.18x its step alone (up to 1.49x), zero-bubble 1.14x and interleaved 1.11x (geometric
    means over the hold-out grid's 13 models; BENCHMARKS.md, bench_holdout.py); on 4 within 4%."""
    torch.set_num_threads(1)
    out = {}
    for key, spec, batch, plans in cases:
        if contention_seconds > 0:
            out[("contention", key)] = live_contention(contention_seconds)
        runners = {}
        for name, axes, kw in plans:
            before = steady_live_bytes(3) if memory else 0    # collects garbage first
            step, body, dm, opt = prepared(spec, batch, axes, kw)
            out[(key, name)] = row = {"times": []}
            if memory:
                for _ in range(2):
                    step()
                dm.comm_stats.reset()
                step()
                row.update(bytes=dm.comm_stats.total(), by_axis={a: dm.comm_stats.total(axis=a) for a in ("dp", "tp", "pp")},
                           peak=peak_of(body, opt, dm)["peak"] - before)
                dist.barrier()
            if alone:
                row["times"] = timed_alone(step, steps)
                del step, body, dm, opt
                gc.collect()
                dist.barrier()
            else:
                runners[name] = step
        for step in runners.values():
            for _ in range(1 if memory else 2):
                step()
        for name, times in (timed_rounds(runners, steps, block) if runners else {}).items():
            out[(key, name)]["times"] = times
        runners = step = body = dm = opt = None
        gc.collect()
        dist.barrier()
    return out


def tune_pick(spec, batch: int, pairs, steps: int) -> int:
    """The index in ``pairs`` ((mesh axes, plan kwargs), ...) of the plan ``autopar.tune``
    measures fastest for the model of ``spec`` on a global batch of ``batch`` rows."""
    torch.set_num_threads(1)
    model, c = build(spec)
    x, y = gpt_batch(c, batch)
    report = tune(model, [(axes, Plan(**kw)) for axes, kw in pairs], example_inputs=(x,),
                  targets=y, loss_fn=lm_loss, steps=steps)
    return report.rows.index(report.chosen)


# ---- reading a grid -----------------------------------------------------------------------------

def predictions(models, plan_list, cluster, per_model=None) -> dict:
    """(model key, plan name) -> Estimate, by ``evaluate_plan`` on ``cluster`` (or on
    ``per_model[model key]`` where given)."""
    out = {}
    for key, spec, batch in models:
        model, c = build(spec)
        x, _ = gpt_batch(c, batch)
        profiles = Profiles(model, (x,))
        on = (per_model or {}).get(key, cluster)
        for name, axes, kw in plan_list:
            out[(key, name)] = evaluate_plan(profiles, axes, Plan(**kw), on, batch)
    return out


def live_slowdown(per_rank) -> float:
    """The slowdown of ``live_contention``'s readings (per rank: (alone or None, crowded)): the
    ranks' harmonic mean crowded over rank 0's alone, at least 1, as the calibration makes each
    of its readings (``cost.calibration.host_fits.reading``)."""
    alone = next(a for a, _ in per_rank if a is not None)
    return max(1.0, reading([c for _, c in per_rank], alone))


def with_contention(cluster, processes: int, slowdown: float):
    """``cluster`` with its contention of ``processes`` processes set to ``slowdown`` (the other
    counts as calibrated)."""
    table = dict(cluster.contention)
    table[processes] = slowdown
    return cluster.with_(contention=tuple(sorted(table.items())))


STATISTICS = {"mean": statistics.mean, "median": statistics.median}


OTHER = {"mean": "median", "median": "mean"}


def step_time(per_rank, k, statistic: str = "mean") -> float:
    """The slowest rank's step time: the mean (default) or the median of its timed steps.

    The mean: a training run takes the sum of its steps, and the published step times
    bench_plan.py is checked against are averages over a logging interval. The local
    calibration's collective latencies are block averages (``comm_probes.excess_per_round``: a
    block's span over its rounds), so a prediction carries the communication's slow tail. On
    the 2 cores of the machine of BENCHMARKS.md a gloo collective's time is heavy-tailed (five
    100 KB all-reduces after a barrier: median 2.7 ms, mean 5.1, 90th percentile 11.9:
    benchmarks/gloo_tail.py), and a small plan's steps fall in two clusters (Llama's ddp on 2
    processes: about 3.6 ms and 6-8 ms), so the median of 41 steps jumps between the two from
    one measurement to the next (8 measurements in a row: slowest rank's median 4.5-6.4 ms,
    spread 10.6%; its mean 5.5-6.4 ms, 5.3%)."""
    return max(STATISTICS[statistic](r[k]["times"]) for r in per_rank)


def trial_path(i: int) -> str:
    """Where trial ``i``'s calibration is kept: the local preset's cache for trial 0, beside it
    as ``local_cluster.trial{i}.json`` for the others."""
    base = cache.cache_path()
    return base if i == 0 else os.path.join(os.path.dirname(base), f"local_cluster.trial{i}.json")


def trial_clusters(passes: int) -> list:
    """The calibrations of a run's trials, read from its cache (``AUTOPAR_CACHE``) at
    ``trial_path``; None where a trial's file is missing."""
    return [cached_local(trial_path(i)) for i in range(passes)]


def trial_ratio(preds, measured) -> float:
    """A row's predicted / measured: the median over its passes of each pass's prediction (its
    trial's calibration's) over that pass's measurement; with one calibration for every pass,
    the prediction over the passes' median (an odd number of them)."""
    return statistics.median(p / m for p, m in zip(preds, measured))


def errors(rows, field: str) -> tuple:
    """(|ratio - 1| of each row, the row furthest off) by the rows' ``field`` ratio."""
    st = [abs(r[field] - 1) for r in rows]
    return st, rows[st.index(max(st))]


def summary(rows, label: str) -> None:
    """The grid's summary of ``rows`` under ``label``: step time, bytes and memory against their
    predictions; how far the passes measured a row apart; step time pred/meas by plan."""
    st, worst = errors(rows, "ratio")
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


def other_summary(rows, label: str, statistic: str) -> None:
    """The step time's error had each pass's step been the slowest rank's ``statistic`` instead."""
    st, worst = errors(rows, "ratio_other")
    print(f"  {label} by the slowest rank's {statistic} step instead: step time |pred/meas - 1| mean "
          f"{statistics.mean(st):.1%}, worst {max(st):.1%} ({worst['model']}, {worst['plan']}, world {worst['world']}), "
          f"{sum(x <= 0.25 for x in st)} within 25%; measured {statistic} / measured by the grid's statistic: "
          f"{statistics.mean(r['step_other'] / r['step'] for r in rows):.3f} on average")


def live_summary(rows, label: str) -> None:
    """The step time's error had each pass's rows been predicted with the contention read just
    before their model's plans (``grid``'s ``contention_seconds``); nothing without it."""
    if not rows or "ratio_live" not in rows[0]:
        return
    st, worst = errors(rows, "ratio_live")
    read = [x for r in rows for x in r["contention_live"]]
    by_plan: dict = {}
    for r in rows:
        by_plan.setdefault(r["plan"], []).append(r["ratio_live"])
    print(f"  {label} predicted with the contention read before each model's plans ({min(read):.2f}-{max(read):.2f}): "
          f"step time |pred/meas - 1| mean {statistics.mean(st):.1%}, worst {max(st):.1%} ({worst['model']}, "
          f"{worst['plan']}, world {worst['world']}), {sum(x <= 0.25 for x in st)} within 25%; by plan: " + "; ".join(
              f"{p} {statistics.mean(v):.2f}" for p, v in by_plan.items()))


ROW = re.compile(r"(gpt h\d+ L\d+ s\d+|llama)\s+(\S+(?: \S+)?)\s+([\d,]+)\s+([\d,]+) \|\s+([\d.]+)\s+([\d.]+)"
                  r"\s+([\d.]+) \|\s+([\d.]+)\s+([\d.]+)")


def grid_rows(path: str):
    """(world, row match, the line) of each row of the grids bench_holdout.py printed in ``path``."""
    world = None
    with open(path) as f:
        for line in f:
            m = re.match(r"## hold-out grid: world (\d+)", line)
            if m:
                world = int(m.group(1))
                continue
            m = ROW.match(line)
            if m and world is not None:
                yield world, m, line


def parse_grid(path: str) -> dict:
    """(world, model, plan) -> (measured ms, predicted ms) from a grid bench_holdout.py printed."""
    return {(world, m.group(1), m.group(2)): (float(m.group(8)), float(m.group(9)))
            for world, m, _ in grid_rows(path)}


def parse_passes(path: str) -> dict:
    """(world, model, plan) -> each pass's measured ms, from a grid bench_holdout.py printed with
    several passes (the columns after a row's ratio: the passes' steps, then their predictions);
    rows without them are left out."""
    return {(world, m.group(1), m.group(2)): [float(x) for x in line.split("|")[3].split()]
            for world, m, line in grid_rows(path) if len(line.split("|")) >= 5}


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
    """A grid bench_holdout.py printed, its rows predicted again by this code on ``cluster`` (with
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
