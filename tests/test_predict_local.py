"""Predictions of the cost model (``local`` preset, calibrated on this machine) against
measurements of the same plans on real processes: the small GPT of ``autopar.predict_local`` at world 4
under every plan of ``autopar.predict_local.PREDICT_PLANS`` (ddp, ZeRO-1/2/3, tp, tp+sp, three
pipelines). The calibration's probes never run this GPT (they run a synthetic stack of linear
layers, GPTs of h=8, bare collectives and matmuls), so these are hold-out predictions. Bytes
must be exact, memory within 10%, and each plan's predicted / measured step time between ``SHORT`` and ``LONG`` (benchmarks/bench_holdout.py measures the same on a grid of models and plans;
the bound's reasons are beside it).
"""
import dataclasses
import statistics

import pytest

import autopar
from autopar.cost.estimate import Profiles, evaluate_plan
from autopar.models import TinyGPT, gpt_batch
from autopar.testing import run

from autopar import predict_local

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow, pytest.mark.timing]


@pytest.fixture(scope="module")
def local(local_cluster):
    return local_cluster[0]


@pytest.fixture(scope="module")
def pick(local):
    """The planner's choice for the small GPT on 4 ranks of this machine (without
    recomputation, which compile does not implement)."""
    c = predict_local.PREDICT_CONFIG
    x, _ = gpt_batch(c, predict_local.PREDICT_BATCH)
    report = autopar.plan(TinyGPT(c), 4, example_inputs=(x,), cluster=local, recompute=("none",))
    kw = {f.name: getattr(report.plan, f.name) for f in dataclasses.fields(report.plan)
          if getattr(report.plan, f.name) != f.default or f.name == "dp"}
    for name, axes, plan_kw in predict_local.PREDICT_PLANS:
        if axes == report.mesh.axes and autopar.Plan(**plan_kw) == report.plan:
            return name, report
    return ("planner pick", dict(report.mesh.axes), kw), report


@pytest.fixture(scope="module")
def measured(local, pick, ranks):
    ranks.close_all()     # the suite's idle rank pools slowed these timings by half
    extra = () if isinstance(pick[0], str) else (pick[0],)
    # fresh processes: the memory census counts every tensor a process holds
    per_rank = run(predict_local.measured_plans, 4, None, 7, extra, timeout=560)
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


@pytest.fixture(scope="module")
def predicted(local):
    c = predict_local.PREDICT_CONFIG
    x, _ = gpt_batch(c, predict_local.PREDICT_BATCH)
    profiles = Profiles(TinyGPT(c), (x,))
    return {name: evaluate_plan(profiles, axes, autopar.Plan(**kw), local, predict_local.PREDICT_BATCH)
            for name, axes, kw in predict_local.PREDICT_PLANS}


NAMES = [name for name, _, _ in predict_local.PREDICT_PLANS]


@pytest.mark.parametrize("name", NAMES)
def test_bytes_are_exact(measured, predicted, name):
    """Bytes each rank sends per step, by the counters, against the prediction (the busiest
    rank where pipeline ranks differ), and per mesh axis."""
    ranks = measured[name]
    assert max(r["bytes"] for r in ranks) == predicted[name].comm_bytes
    for axis, b in predicted[name].comm_bytes_by_axis.items():
        assert max(r["by_axis"][axis] for r in ranks) == b


@pytest.mark.parametrize("name", NAMES)
def test_memory_within_ten_percent(measured, predicted, name):
    """Peak memory per rank: what lives between steps plus the profiler's peak of allocations
    during one step (median of three steps, busiest rank)."""
    peak = max(r["peak"] for r in measured[name])
    assert predicted[name].memory_bytes == pytest.approx(peak, rel=0.10)


def _step(measured, name):
    """The slowest rank's mean step, as benchmarks/bench_holdout.py measures a row
    (``autopar.holdout.step_time`` says why the mean)."""
    return max(statistics.mean(r["times"]) for r in measured[name])


def test_planner_pick_is_within_ten_percent_of_the_fastest_hand_plan(measured, pick):
    """The plan the planner picks, measured in the same processes as every hand plan: within
    10% of the fastest of them."""
    name = pick[0] if isinstance(pick[0], str) else pick[0][0]
    fastest = min(_step(measured, n) for n in NAMES)
    assert _step(measured, name) <= 1.10 * fastest, (name, {n: round(_step(measured, n) * 1e3, 1) for n in measured})


# The bounds on every plan's predicted / measured, stated from measurements (BENCHMARKS.md,
# bench_holdout.py). Short: on this GPT, each measured on a fresh calibration of its own, the nine
# plans read 0.70-1.14 (the shortest the pipelines: the model errs short on them, by 5-15% over
# the hold-out grid at world 4), and 0.62 (tp+sp) with the machine shared with another test
# process; 0.6 keeps that margin. Long: the calibration's latencies of collectives among ranks
# sharing cores (these plans' 4 ranks on 2 cores) move between calibrations here, the same
# all-reduce of 4 fitted at 7 to 20 ms, and a high one lengthens the data-parallel plans'
# predictions: ZeRO-1 predicted 81.5 ms on such a calibration and 61.9 ms on another, measured
# 53.6 ms (1.52); ZeRO-3 reads up to 1.79 on a calibration taken in a slow spell of the machine.
# A preset another machine state left in the cache is not this calibration: CI measures its own
# (.ci/run); predicted from a stale one in ~/.cache, zero3, tp and tp+sp read 1.81-1.99.
# The goal of 25% is the grid's (bench_holdout.py, five passes); a single pass here moves by
# 10-20% with the machine's pace.
SHORT, LONG = 0.6, 1.75


@pytest.mark.parametrize("name", NAMES)
def test_step_time(measured, predicted, name):
    """Each plan's predicted step time against its measurement (the slowest rank's mean):
    the ratio within [``SHORT``, ``LONG``]."""
    step = _step(measured, name)
    ratio = predicted[name].step_time_s / step
    assert SHORT <= ratio <= LONG, (f"{name}: predicted {predicted[name].step_time_s * 1e3:.1f} ms, measured "
                                    f"{step * 1e3:.1f} ms (ratio {ratio:.2f}, bounds {SHORT} to {LONG})")
