"""Bad input gets a clear error: what was expected, what was found, what to do."""
import re

import pytest
import torch

import autopar
from autopar.models import TinyMLP
from autopar.testing import run

from jobs import errors

VMESH = autopar.Mesh(dp=2, virtual=True)


def _dm(plan="zero3", mesh=VMESH):
    return autopar.compile(TinyMLP(), mesh, example_inputs=(torch.randn(8, 16),), plan=autopar.Plan(dp=plan))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_mesh_size_differs_from_world_size(ranks):
    msgs = ranks(errors.mesh_mismatch, 2, timeout=60)
    assert all(m and "4 ranks but the world size is 2" in m and "Mesh(dp=2)" in m for m in msgs)


def test_mesh_without_processes_says_how_to_get_them():
    with pytest.raises(RuntimeError, match="virtual=True"):
        autopar.Mesh(dp=2)
    with pytest.raises(ValueError, match="unknown mesh axis 'xp'"):
        autopar.Mesh(xp=2, virtual=True)


def test_batch_that_does_not_divide_by_dp():
    dm = _dm()
    with pytest.raises(ValueError, match="7 rows along dim 0, which does not divide by dp=2"):
        dm.shard_batch(torch.randn(7, 16))
    with pytest.raises(ValueError, match="does not divide by dp=2"):
        autopar.compile(TinyMLP(), VMESH, example_inputs=(torch.randn(5, 16),), plan=autopar.Plan())


def test_global_batch_passed_where_the_local_slice_belongs(caplog):
    """Another shape compiles (a batch twice the size is a shape like any other), and says so,
    naming shard_batch for the user who meant to pass a slice."""
    dm = _dm("ddp")
    with caplog.at_level("WARNING", logger="autopar"):
        assert dm(torch.randn(8, 16)).shape == (8, 16)
    assert re.search(r"compiling this module for this rank's input shapes \(\(8, 16\),\) \(compiled for "
                     r"\(\(4, 16\),\).*dm\.shard_batch\(global_batch\)", caplog.text), caplog.text


def test_unknown_plan_values():
    with pytest.raises(ValueError, match=r"Plan\(dp='zero4'\) is not a data-parallel mode; expected one of"):
        autopar.Plan(dp="zero4")
    with pytest.raises(ValueError, match="pp_schedule='gpipe2'"):
        autopar.Plan(pp_schedule="gpipe2")
    with pytest.raises(ValueError, match="plan='fast' is not a plan"):
        autopar.compile(TinyMLP(), VMESH, example_inputs=(torch.randn(8, 16),), plan="fast")


def test_plan_asks_for_an_axis_the_mesh_lacks():
    with pytest.raises(ValueError, match="uses mesh axis 'tp'.*has none"):
        autopar.compile(TinyMLP(), VMESH, example_inputs=(torch.randn(8, 16),), plan=autopar.Plan(tp=True))
    with pytest.raises(ValueError, match="uses mesh axis 'pp'"):
        autopar.compile(TinyMLP(), VMESH, example_inputs=(torch.randn(8, 16),),
                        plan=autopar.Plan(pp_schedule="1f1b"))


def test_mesh_axis_the_plan_leaves_idle():
    mesh = autopar.Mesh(dp=2, tp=2, virtual=True)
    with pytest.raises(ValueError, match="axis tp=2, which Plan\\(dp='ddp'\\) gives no role"):
        autopar.compile(TinyMLP(), mesh, example_inputs=(torch.randn(8, 16),), plan=autopar.Plan())


def test_not_a_module():
    with pytest.raises(TypeError, match="expects an nn.Module"):
        autopar.compile(lambda x: x, VMESH, example_inputs=(torch.randn(8, 16),), plan=autopar.Plan())


def test_virtual_mesh_cannot_run_collectives():
    dm = _dm("zero3")
    with pytest.raises(RuntimeError, match="virtual"):
        dm(torch.randn(4, 16))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_shards_written_outside_a_step_are_refused(ranks):
    msgs = ranks(errors.stale_shards, 2, timeout=60)
    assert all(m and "dm.gather_params()" in m and "stale" in m for m in msgs)


def test_auto_plan_says_what_it_picked(caplog):
    x = torch.randn(8, 16)
    with caplog.at_level("WARNING", logger="autopar"):
        dm = autopar.compile(TinyMLP(), VMESH, example_inputs=(x,), cluster="dgx-h100")
    report = autopar.plan(TinyMLP(), 2, example_inputs=(x,), cluster="dgx-h100", mesh_axes={"dp": 2},
                          recompute=("none",))
    assert dm.plan == report.plan
    assert f"plan='auto' picked {report.plan}" in caplog.text
    assert "plan='auto' picked" in dm.explain()


@pytest.mark.slow
def test_auto_plan_without_calibration_in_a_rank_says_what_to_do(tmp_path, monkeypatch):
    """Fresh processes: they read the cache path from the environment set here."""
    monkeypatch.setenv("AUTOPAR_CACHE", str(tmp_path / "none.json"))
    msgs = run(errors.auto_plan_uncalibrated, 2, timeout=90)
    assert all("python -m autopar calibrate" in m for m in msgs)
