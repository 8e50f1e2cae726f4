"""Reading a hold-out grid (``autopar.holdout``, which benchmarks/bench_holdout.py runs):
``--repredict``, a printed grid's rows predicted again by this code on a given cluster (``--set``
numbers replaced first) against the grid's own measurements, and the summaries it prints."""
import dataclasses

import pytest

import autopar
from autopar import holdout
from autopar.cost.cluster import get_cluster
from autopar.cost.estimate import Profiles, evaluate_plan
from autopar.holdout import build
from autopar.models import gpt_batch

GRID = """## hold-out grid: world 2, global batch 8, 13 models x 9 plans, measured in 221 s on 2 cores
model            plan            bytes meas       pred |  peak MB    pred ratio |  step ms    pred ratio
gpt h32 L2 s16   ddp                112,512    112,512 |    0.674   0.690  1.02 |      5.1     4.3  0.84
gpt h32 L2 s16   pp 1f1b             24,960     24,960 |    0.468   0.446  0.95 |     11.2    11.2  1.00
"""


def _expected(cluster, plan_name):
    """pred / measured of the grid's row of ``plan_name``, by evaluate_plan here."""
    key, spec, batch = next(m for m in holdout.grid_models() if m[0] == "gpt h32 L2 s16")
    _, axes, kw = next(p for p in holdout.plans(2) if p[0] == plan_name)
    model, c = build(spec)
    x, _ = gpt_batch(c, batch)
    e = evaluate_plan(Profiles(model, (x,)), axes, autopar.Plan(**kw), cluster, batch)
    return e.step_time_s * 1e3 / {"ddp": 5.1, "pp 1f1b": 11.2}[plan_name]


def test_repredict_reads_the_printed_rows_and_applies_the_settings(tmp_path, capsys):
    log = tmp_path / "grid.log"
    log.write_text(GRID)
    c = get_cluster("dgx-a100-80gb")
    got = holdout.repredict(str(log), c)
    assert set(got) == {(2, "gpt h32 L2 s16", "ddp"), (2, "gpt h32 L2 s16", "pp 1f1b")}
    for plan in ("ddp", "pp 1f1b"):
        assert got[(2, "gpt h32 L2 s16", plan)] == pytest.approx(_expected(c, plan), rel=1e-9)
    out = capsys.readouterr().out
    as_printed = (abs(4.3 / 5.1 - 1) + abs(11.2 / 11.2 - 1)) / 2         # the log's own pred / meas
    assert f"world 2, as printed (its 0.1 ms rows): 2 rows; step time |pred/meas - 1| mean {as_printed:.1%}" in out
    # a device number replaced: the predictions move with it, as evaluate_plan moves on that cluster
    slower = holdout.repredict(str(log), c, ["device.op_overhead=1e-4"])
    moved = c.with_(device=dataclasses.replace(c.device, op_overhead=1e-4))
    assert slower[(2, "gpt h32 L2 s16", "ddp")] == pytest.approx(_expected(moved, "ddp"), rel=1e-9)
    assert slower[(2, "gpt h32 L2 s16", "ddp")] > got[(2, "gpt h32 L2 s16", "ddp")]


def test_repredict_says_what_it_expected(tmp_path):
    log = tmp_path / "grid.log"
    log.write_text(GRID)
    c = get_cluster("dgx-a100-80gb")
    with pytest.raises(SystemExit, match="expected PART.FIELD=NUMBER"):
        holdout.repredict(str(log), c, ["overlap_loss=1"])
    with pytest.raises(SystemExit, match="has no field 'nonsense'"):
        holdout.repredict(str(log), c, ["device.nonsense=1"])
    with pytest.raises(SystemExit, match="has no shared link"):
        holdout.repredict(str(log), c, ["shared.overlap_loss=1"])
    empty = tmp_path / "empty.log"
    empty.write_text("nothing here\n")
    with pytest.raises(SystemExit, match="no grid rows found"):
        holdout.repredict(str(empty), c)


def test_passes_summary_and_rows_with_the_passes_column(tmp_path, capsys):
    """A grid measured in several passes: a row's step is the median of its passes (the caller's),
    the summary says how far each pass's step is from that median and what each pass alone would
    have read, and the printed rows with the passes' column still parse."""
    rows = [dict(world=2, model="gpt h32 L2 s16", plan="ddp", bytes=1, bytes_pred=1, exact=True, peak=1.0,
                 peak_pred=1.0, step=5.0, step_pred=5.5, passes=[4.0, 5.0, 6.0], preds=[5.5] * 3, ratio=5.5 / 5),
            dict(world=2, model="gpt h32 L2 s16", plan="tp", bytes=1, bytes_pred=1, exact=True, peak=1.0,
                 peak_pred=1.0, step=10.0, step_pred=9.0, passes=[10.0, 12.0, 9.0], preds=[9.0] * 3, ratio=9 / 10)]
    holdout.summary(rows, "world 2")
    out = capsys.readouterr().out
    spread = [1 / 5, 0, 1 / 5, 0, 2 / 10, 1 / 10]
    each = [(abs(5.5 / 4 - 1) + abs(9 / 10 - 1)) / 2, (abs(5.5 / 5 - 1) + abs(9 / 12 - 1)) / 2,
            (abs(5.5 / 6 - 1) + abs(9 / 9 - 1)) / 2]
    assert (f"3 passes: a pass's step from the rows' median: mean {sum(spread) / 6:.1%}, worst {max(spread):.1%}; "
            f"each pass alone, step time mean (worst): {each[0]:.1%}") in out
    assert f", {each[2]:.1%} (" in out
    level = [(5.5 / 4 + 9 / 10) / 2, (5.5 / 5 + 9 / 12) / 2, (5.5 / 6 + 9 / 9) / 2]     # medians of two
    assert ("each pass's median pred/meas (the machine's pace against its calibration): "
            + ", ".join(f"{x:.3f}" for x in level)) in out
    log = tmp_path / "grid.log"
    log.write_text(GRID.splitlines()[0] + "\n" + "gpt h32 L2 s16   ddp                112,512    112,512 |    0.674   "
                   "0.690  1.02 |      5.1     4.3  0.84 | 4.9 5.1 5.6\n")
    assert holdout.parse_grid(str(log)) == {(2, "gpt h32 L2 s16", "ddp"): (5.1, 4.3)}


def test_each_trial_is_predicted_from_its_own_calibration_and_a_row_reads_their_median_ratio(capsys):
    """--calibrations each: pass i is predicted from calibration i; a row's ratio is the median of
    its trials' pred/meas (not the median prediction over the median measurement), and each
    trial alone is read against its own prediction."""
    preds, passes = [6.0, 4.0, 5.0], [5.0, 5.0, 4.0]      # ratios 1.2, 0.8, 1.25
    assert holdout.trial_ratio(preds, passes) == pytest.approx(1.2)
    assert holdout.trial_ratio([5.5] * 3, [4.0, 5.0, 6.0]) == pytest.approx(5.5 / 5.0)   # one calibration
    rows = [dict(world=4, model="llama", plan="zero3", bytes=1, bytes_pred=1, exact=True, peak=1.0, peak_pred=1.0,
                 step=5.0, step_pred=5.0, passes=passes, preds=preds, ratio=holdout.trial_ratio(preds, passes))]
    holdout.summary(rows, "world 4")
    out = capsys.readouterr().out
    assert "step time |pred/meas - 1| mean 20.0%, worst 20.0% (llama, zero3, world 4)" in out
    assert "each pass alone, step time mean (worst): 20.0% (20.0%), 20.0% (20.0%), 25.0% (25.0%)" in out


def test_a_rows_step_is_the_slowest_ranks_mean_and_the_summary_gives_the_median_beside_it(capsys):
    """A pass's step of a row: the slowest rank's mean of its timed steps (``--statistic mean``,
    the default) or median; the other statistic's error is printed beside the grid's."""
    per_rank = [{("m", "ddp"): {"times": [3.0, 3.0, 3.0, 9.0]}},      # mean 4.5, median 3.0
                {("m", "ddp"): {"times": [4.0, 4.0, 4.0, 4.0]}}]      # mean 4.0, median 4.0
    assert holdout.step_time(per_rank, ("m", "ddp")) == 4.5
    assert holdout.step_time(per_rank, ("m", "ddp"), "median") == 4.0
    rows = [dict(world=2, model="gpt h32 L2 s16", plan="ddp", step=4.5, step_other=4.0, step_pred=5.0,
                 ratio_other=5.0 / 4.0),
            dict(world=2, model="llama", plan="tp", step=10.0, step_other=8.0, step_pred=11.0, ratio_other=11.0 / 8.0)]
    holdout.other_summary(rows, "world 2", "median")
    out = capsys.readouterr().out
    err = [abs(5.0 / 4.0 - 1), abs(11.0 / 8.0 - 1)]
    assert (f"world 2 by the slowest rank's median step instead: step time |pred/meas - 1| mean "
            f"{sum(err) / 2:.1%}, worst {max(err):.1%} (llama, tp, world 2), 1 within 25%; measured median / "
            f"measured by the grid's statistic: {(4.0 / 4.5 + 8.0 / 10.0) / 2:.3f} on average") in out


def test_the_contention_read_before_a_models_plans_replaces_the_calibrations_for_its_world(capsys):
    """--live-contention: the readings (per rank: rank 0's loop alone, every rank's loop crowded)
    make a slowdown as the calibration does (the ranks' harmonic mean over alone, at least 1);
    it replaces the preset's contention of that many processes only, and a row predicted with
    it reads slower where the reading is higher; the summary reads the rows' live ratios."""
    per_rank = [(2e-3, 3e-3), (None, 6e-3)]         # harmonic mean of 3 and 6 ms: 4 ms, over 2 ms alone
    assert holdout.live_slowdown(per_rank) == pytest.approx(2.0)
    assert holdout.live_slowdown([(2e-3, 1.8e-3), (None, 1.9e-3)]) == 1.0      # never below 1
    # a GPU preset named local: its contention table is read (no calibration needed here)
    c = get_cluster("dgx-a100-80gb").with_(name="local", contention=((2, 1.1), (4, 2.3)))
    live = holdout.with_contention(c, 2, 1.5)
    assert dict(live.contention) == {2: 1.5, 4: 2.3} and live.slowdown(2) == 1.5 and live.slowdown(4) == 2.3
    key, spec, batch = next(m for m in holdout.grid_models() if m[0] == "gpt h32 L2 s16")
    _, axes, kw = next(p for p in holdout.plans(2) if p[0] == "ddp")
    got = holdout.predictions([(key, spec, batch)], [("ddp", axes, kw)], c, {key: live})
    base = holdout.predictions([(key, spec, batch)], [("ddp", axes, kw)], c)
    assert got[(key, "ddp")].step_time_s > base[(key, "ddp")].step_time_s
    rows = [dict(world=2, model=key, plan="ddp", ratio_live=1.3, contention_live=[1.0, 1.5, 1.2]),
            dict(world=2, model="llama", plan="tp", ratio_live=0.9, contention_live=[1.1, 1.1, 1.1])]
    holdout.live_summary(rows, "world 2")
    out = capsys.readouterr().out
    assert ("world 2 predicted with the contention read before each model's plans (1.00-1.50): step time "
            "|pred/meas - 1| mean 20.0%, worst 30.0% (gpt h32 L2 s16, ddp, world 2), 1 within 25%") in out
    holdout.live_summary([dict(world=2, model=key, plan="ddp", ratio=1.0)], "world 2")
    assert capsys.readouterr().out == ""


def test_repredict_trials_reads_each_pass_against_its_own_calibration(tmp_path, monkeypatch):
    """--repredict --trials: pass i of a row is predicted again on trial i's calibration (with
    the --set numbers) against pass i's measurement, and the row's ratio is the median of those,
    as the grid computed it; a grid without its passes' column is refused with what it expected."""
    log = tmp_path / "grid.log"
    log.write_text(GRID.splitlines()[0] + "\n" + "gpt h32 L2 s16   ddp                112,512    112,512 |    0.674   "
                   "0.690  1.02 |      5.1     4.3  0.84 | 4.0 5.1 6.5 | 4.1 4.3 4.6\n")
    base = get_cluster("dgx-a100-80gb")
    trials = [base.with_(device=dataclasses.replace(base.device, op_overhead=o)) for o in (2e-5, 1e-4, 4e-5)]
    monkeypatch.setattr(holdout, "trial_clusters", lambda n: trials[:n])
    assert holdout.parse_passes(str(log)) == {(2, "gpt h32 L2 s16", "ddp"): [4.0, 5.1, 6.5]}
    got = holdout.repredict(str(log), base, trials=True)[(2, "gpt h32 L2 s16", "ddp")]
    each = [_expected(c, "ddp") * 5.1 / m for c, m in zip(trials, (4.0, 5.1, 6.5))]
    assert got == pytest.approx(sorted(each)[1], rel=1e-9) and len(set(each)) == 3
    moved = holdout.repredict(str(log), base, ["device.op_overhead=1e-3"], trials=True)
    assert moved[(2, "gpt h32 L2 s16", "ddp")] > got          # the setting applies to every trial's calibration
    plain = tmp_path / "plain.log"
    plain.write_text(GRID)
    with pytest.raises(SystemExit, match="rows without their passes' steps"):
        holdout.repredict(str(plain), base, trials=True)
    monkeypatch.setattr(holdout, "trial_clusters", lambda n: [trials[0], None, trials[2]])
    with pytest.raises(SystemExit, match=r"trial calibrations missing \[1\]"):
        holdout.repredict(str(log), base, trials=True)
