"""Parameters that take no gradient, under every plan, on real processes (tests/jobs/frozen.py).

A frozen table (requires_grad=False, read by forward), a frozen weight that tensor parallelism
splits, a trainable parameter forward never reads, one it reads only through ``detach()``, and a
buffer: trained under a plan, the module must match the same model trained on one device
(outputs, loss, gradients, and every key of the state dict after AdamW steps); those four get no
gradient and no optimizer state, and the gradient reduction carries none of the frozen or unused
ones (its bytes: the trained parameters' alone, by the ring formula); ``full_state_dict`` and
checkpoints hold every key under every plan, and a checkpoint saved under one plan loads under
another (a pipeline's under ZeRO-3 in the default suite, more pairs in the slow tier).

Tolerances: losses within 1e-5 relative, outputs and gradients within 1e-6 + 1e-4 |x|, parameters
within 1e-4 + 1e-3 |p| after AdamW at lr 1e-2 (another summation order, no more); a zero
gradient where one device has none lets weight decay move the parameter, which changes the loss
by ~7e-5 relative, and is caught as a gradient present where one device has none.
"""
import pytest
import torch.nn.functional as F

import autopar
from jobs.common import saved_checkpoints
from jobs import frozen as J

FAST = ("1f1b",)


def _check_training(results, name):
    for rank, r in enumerate(results):
        where = f"{name}, rank {rank}"
        assert r["extra_grads"] == [], f"{where}: gradients where one device has none: {r['extra_grads']}"
        assert r["missing_grads"] == [], f"{where}: no gradient where one device has one: {r['missing_grads']}"
        assert r["loss_err"] < 1e-5, f"{where}: loss off by {r['loss_err']:.2e} relative"
        assert r["out_err"] < 1.0, f"{where}: output off by {r['out_err']:.2f}"
        assert r["grad_err"] < 1.0, f"{where}: gradient of {r['grad_worst']} off by {r['grad_err']:.2f}"
        assert not r["missing"], f"{where}: full_state_dict() lacks {r['missing']}"
        assert r["state_err"] < 1.0, f"{where}: {r['state_worst']} off by {r['state_err']:.2f} after {J.STEPS} steps"
        assert r["changed"] == [], f"{where}: {r['changed']} changed, one device leaves them as they are"
        for report in (r["no_grad"], r["no_grad_after"]):
            assert report["with_grad"] == [], f"{where}: {report['with_grad']} got a gradient"
            assert report["with_state"] == [], f"{where}: {report['with_state']} got optimizer state"
            assert report["trainable_frozen"] == [], f"{where}: {report['trainable_frozen']} require grad"
        assert set(r["stepped"]) <= set(r["ref_stepped"]), f"{where}: optimizer state for {r['stepped']}"
        assert r["communicated"] == [], f"{where}: collectives read {r['communicated']}"
        for got in r["dp_bytes"]:
            assert got == pytest.approx(r["want_dp_bytes"]), \
                f"{where}: the gradient reduction sent {got} B, the trained parameters' alone {r['want_dp_bytes']} B"
    held = set().union(*(r["no_grad"]["held"] for r in results))
    assert held == set(J.NO_GRAD), f"{name}: the ranks hold {sorted(held)} of {J.NO_GRAD}"
    stepped = set().union(*(r["stepped"] for r in results))
    assert stepped == set(results[0]["ref_stepped"]), \
        f"{name}: optimizer state for {sorted(stepped)}, one device's for {results[0]['ref_stepped']}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", FAST)
def test_training_keeps_frozen_and_unused_parameters(ranks, name):
    _check_training(ranks(J.train_job, J.world_of(name), name, timeout=240), name)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [n for n in J.PLANS if n not in FAST])
def test_training_keeps_frozen_and_unused_parameters_slow(ranks, name):
    _check_training(ranks(J.train_job, J.world_of(name), name, timeout=240), name)


@pytest.fixture(scope="module")
def saved(ranks, tmp_path_factory):
    """plan name -> the directory of a checkpoint saved after SPLIT steps under it."""
    return saved_checkpoints(ranks, tmp_path_factory.mktemp("frozen_checkpoints"), J.save_job, J.world_of)


def _check_resumed(results, target):
    for rank, by_source in enumerate(results):
        for source, r in by_source.items():
            where = f"saved under {source}, loaded under {target}, rank {rank}"
            assert r["step"] == J.SPLIT, where
            assert not r["missing"], f"{where}: full_state_dict() lacks {r['missing']}"
            assert r["load_err"] < 1.0, f"{where}: {r['load_worst']} off by {r['load_err']:.2f} after the load"
            assert r["loss_err"] < 1e-5, f"{where}: loss off by {r['loss_err']:.2e} relative"
            assert r["final_err"] < 1.0, f"{where}: {r['final_worst']} off by {r['final_err']:.2f} a step later"
            for report in (r["no_grad"], r["no_grad_after"]):
                assert report["with_state"] == [], f"{where}: {report['with_state']} got optimizer state"
                assert report["with_grad"] == [], f"{where}: {report['with_grad']} got a gradient"


@pytest.mark.timeout(400)
def test_checkpoint_from_pipeline_loads_under_zero3(ranks, saved):
    _check_resumed(ranks(J.resume_job, 2, "zero3", {"1f1b": saved("1f1b")}, timeout=300), "zero3")


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("target, sources", [("1f1b", ("zero3", "tp sp")), ("tp", ("1f1b", "zero1")),
                                             ("ddp", ("gpipe",)), ("zero2", ("tp", "pp2 dp2 zero3")),
                                             ("pp2 dp2 zero3", ("1f1b", "ddp"))])
def test_checkpoint_loads_under_another_plan(ranks, saved, target, sources):
    paths = {source: saved(source) for source in sources}
    _check_resumed(ranks(J.resume_job, J.world_of(target), target, paths, timeout=300), target)


# ---- the checking tools on such a model ------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(300)
def test_parity_runs_on_frozen_and_unused_parameters(ranks):
    for rank, by_plan in enumerate(ranks(J.tools_job, 2, timeout=240)):
        for name, r in by_plan.items():
            assert r["ok"] and not r["messages"], f"{name}, rank {rank}: {r}"


@pytest.mark.timeout(120)
def test_verify_runs_on_frozen_and_unused_parameters():
    x, y = J.batch(0)
    for mesh, plan in (({"dp": 2}, "dp=zero3"), ({"tp": 2}, "tp,sp")):
        report = autopar.verify(J.model(), mesh, plan, example_inputs=(x,), target=y, loss_fn=F.mse_loss)
        assert report.ok, f"{plan}: {report}"
        assert report.gradients_checked > 0, f"{plan}: {report}"
