"""autopar.tune on real processes: the candidates measured on every rank, one choice."""
from __future__ import annotations

import torch

import autopar
from autopar.models import GPTConfig, TinyGPT, gpt_batch, lm_loss

CONFIG = GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=2, max_seq=8)
BATCH = 8


def _model():
    torch.manual_seed(0)
    return TinyGPT(CONFIG)


def tune_pairs():
    """tune over two given plans of very different cost: ddp on dp=2, and GPipe on pp=2 with
    8 micro-batches of one row (each rank runs 8 forward and 8 backward passes and 16
    messages where ddp runs one pass of each). Returns the report's rows, the chosen row's
    index, and whether the model tuned was left as it was."""
    torch.set_num_threads(1)
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = gpt_batch(CONFIG, BATCH)
    pairs = [({"dp": 2}, autopar.Plan(dp="ddp")),
             (autopar.Mesh(pp=2, virtual=True), autopar.Plan(dp="ddp", pp_schedule="gpipe", microbatches=8))]
    report = autopar.tune(model, pairs, example_inputs=(x,), targets=y, loss_fn=lm_loss, steps=5, warmup=1)
    after = model.state_dict()
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    rows = [(r.axes, str(r.plan), r.predicted_s, r.measured_s, r.rounds_s) for r in report.rows]
    return rows, report.rows.index(report.chosen), unchanged, report.explain()


def tune_report():
    """tune over the first two candidates of a PlanReport (planned for the dgx-a100-80gb
    preset: the test needs no calibration of this machine)."""
    torch.set_num_threads(1)
    model = _model()
    x, y = gpt_batch(CONFIG, BATCH)
    planned = autopar.plan(model, 2, example_inputs=(x,), cluster="dgx-a100-80gb", recompute=("none",))
    report = autopar.tune(model, planned, example_inputs=(x,), targets=y, loss_fn=lm_loss, steps=2, warmup=1, top=2)
    expected = [(dict(c.axes), str(c.plan), c.step_time_s) for c in planned.candidates if c.fits][:2]
    got = [(r.axes, str(r.plan), r.predicted_s) for r in report.rows]
    return expected, got, str(report.chosen.plan)


def tune_refusals():
    """The errors of a candidate of another world size, of an empty list, of a list of plans without
    their meshes, and of a candidate that does not compile (3 micro-batches of 8 rows), on every rank."""
    model = _model()
    x, y = gpt_batch(CONFIG, BATCH)
    out = []
    cases = ([({"dp": 4}, autopar.Plan(dp="ddp"))], [], [autopar.Plan(dp="ddp")],
             [({"dp": 2}, autopar.Plan(dp="ddp")), ({"pp": 2}, autopar.Plan(pp_schedule="gpipe", microbatches=3))])
    for cands in cases:
        try:
            autopar.tune(model, cands, example_inputs=(x,), targets=y, loss_fn=lm_loss)
            out.append(None)
        except (ValueError, TypeError, RuntimeError) as e:
            out.append(f"{type(e).__name__}: {e}")
    return out
