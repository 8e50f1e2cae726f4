"""``autopar.phases`` (benchmarks/step_phases.py prints them): a step's phases as predicted
(split from the estimate's timeline) and as measured (``phase_times``, timed on each rank)."""
import math

import pytest

import autopar
from autopar.models import gpt_batch
from autopar.phases import PIPELINE_PHASES, STAGE_PHASES, STEP_PARTS, build, phase_times, predicted_phases
from autopar.testing import run

SPEC = ("gpt", dict(vocab=32, seq=8, dim=16, heads=2, layers=2, max_seq=8))
CASES = [("ddp", dict(dp=2), dict(dp="ddp")),
         ("gpipe", dict(pp=2), dict(dp="ddp", pp_schedule="gpipe", microbatches=2)),
         ("zero2 1f1b", dict(pp=2, dp=2), dict(dp="zero2", pp_schedule="1f1b", microbatches=2)),
         ("tp", dict(tp=2), dict(dp="ddp", tp=True))]


@pytest.mark.parametrize("name, axes, kw", CASES, ids=[c[0] for c in CASES])
def test_predicted_phases_split_the_predicted_step(name, axes, kw):
    model, c = build(SPEC)
    x, _ = gpt_batch(c, 8)
    e = autopar.estimate(model, autopar.Mesh(**axes, virtual=True), autopar.Plan(**kw), example_inputs=(x,),
                         cluster="dgx-a100-80gb")
    pipeline = bool(kw.get("pp_schedule"))
    phases = predicted_phases(e, pipeline)
    assert set(phases) == set(PIPELINE_PHASES if pipeline else STAGE_PHASES)
    assert all(v >= 0 for v in phases.values()), phases
    assert math.isclose(sum(phases.values()), e.step_time_s, rel_tol=1e-9)
    if pipeline:     # the schedule's phase ends where the replay's last compute action does
        last = max(end for _, lane, label, _, end in e.timeline if lane == "compute" and label[:1].isdigit())
        assert math.isclose(phases["schedule"], last, rel_tol=1e-9)
    else:            # forward ends where the first backward action starts
        assert phases["forward"] == min(s for _, _, label, s, _ in e.timeline if label.startswith("B "))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_measured_phases_are_recorded_every_round_within_the_step():
    cases = CASES[:2]
    per_rank = run(phase_times, 2, SPEC, 8, cases, 3, timeout=240)
    for rank, out in enumerate(per_rank):
        for name, _, kw in cases:
            rounds = out[name]
            names = PIPELINE_PHASES if kw.get("pp_schedule") else STAGE_PHASES
            assert set(rounds) == set(names) | {"step"} | set(STEP_PARTS), (rank, name, sorted(rounds))
            for i, step in enumerate(rounds["step"]):
                parts = [rounds[k][i] for k in names if k != "tied gradients"]
                assert all(p > 0 for p in parts), (rank, name, i, parts)
                assert sum(rounds[k][i] for k in names) <= step, (rank, name, i)
                # both plans wait on collectives every step (ddp's gradient bucket, the pipeline's
                # messages and loss broadcast); waits and the thread's CPU lie within the step
                waits, cpu = rounds["collective waits"][i], rounds["rank CPU"][i]
                assert 0 < waits < step and 0 < cpu <= step * 1.01, (rank, name, i, waits, cpu, step)
