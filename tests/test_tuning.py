"""autopar.tune: the planner's candidates measured on the process group, the fastest chosen."""
import pytest

import autopar
from autopar.models import TinyGPT, gpt_batch
from autopar.testing import run

from jobs import tuning as jobs

pytestmark = pytest.mark.timeout(300)


def test_tune_without_a_process_group_says_where_to_call_it():
    model = TinyGPT(jobs.CONFIG)
    x, _ = gpt_batch(jobs.CONFIG, jobs.BATCH)
    with pytest.raises(RuntimeError, match="on every rank after torch.distributed.init_process_group"):
        autopar.tune(model, [({"dp": 2}, autopar.Plan(dp="ddp"))], example_inputs=(x,))


def test_tune_refuses_what_it_cannot_measure_with_the_fix():
    ranks = run(jobs.tune_refusals, 2, timeout=240)
    assert ranks[0] == ranks[1]          # every rank refuses alike
    msgs = ranks[0]
    assert "Mesh(dp=4)" in msgs[0] and "has 4 ranks, but this process group has 2" in msgs[0], msgs[0]
    assert "no candidate to measure" in msgs[1], msgs[1]
    assert msgs[2].startswith("TypeError") and "expected a pair (mesh axes, Plan)" in msgs[2], msgs[2]
    assert msgs[3].startswith("RuntimeError: tune: candidate Mesh(pp=2)") and "did not compile" in msgs[3], msgs[3]
    assert "leave it out of the candidates" in msgs[3], msgs[3]


@pytest.mark.slow
def test_tune_measures_every_candidate_alike_on_every_rank_and_picks_the_fastest():
    ranks = run(jobs.tune_pairs, 2, timeout=240)
    rows, chosen, unchanged, text = ranks[0]
    for other in ranks[1:]:      # the slowest rank's times, all-reduced: one table, one choice everywhere
        assert other[:2] == (rows, chosen)
    assert all(r[2] is None for r in rows)                      # given pairs carry no prediction
    assert all(len(r[4]) == 5 and min(r[4]) > 0 for r in rows)  # 5 timed steps each
    assert "in rounds of 4 consecutive steps each, the first untimed" in text.splitlines()[0], text
    # GPipe with 8 one-row micro-batches runs 8 passes each way and 16 messages per rank where
    # ddp runs one pass each way: several times slower, whatever the machine's noise
    assert rows[1][3] > 2 * rows[0][3], text
    assert chosen == 0 and rows[0][0] == {"dp": 2}, text
    assert unchanged, "tune changed the model it was given"
    assert "<- chosen" in text.splitlines()[2] and "Mesh(pp=2)" in text, text


@pytest.mark.slow
def test_tune_takes_a_plan_report_its_candidates_in_the_planners_order():
    expected, got, chosen = run(jobs.tune_report, 2, timeout=240)[0]
    assert got == expected
    assert chosen in [p for _, p, _ in expected]
