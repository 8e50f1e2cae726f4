"""Per-rank memory against the ZeRO formulas, on real processes: the module's own tensors and a
census of every live tensor in the process (fresh processes, so that nothing else is counted;
the bytes per step are checked in test_bytes.py)."""
import pytest

from autopar.cost import evaluate, model_state_bytes
from autopar.testing import run

from jobs import data_parallel
from jobs.common import MODES

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


@pytest.fixture(scope="module")
def memories():
    out = {}
    for world in (2, 4):
        per_rank = run(data_parallel.memory_all, world, timeout=240)
        out.update({(world, mode): [r[mode] for r in per_rank] for mode in MODES})
    return out


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", MODES)
def test_memory_after_step_matches_zero_formula(memories, world, mode):
    for r in memories[(world, mode)]:
        formula = evaluate(model_state_bytes(mode), Psi=r["psi"], N=world)
        # the module's parameters, gradients, replicas and gradient buffers plus Adam's moments
        assert r["module_bytes"] + r["opt_bytes"] == formula
        # every live tensor in the process: nothing else is held (gathered parameters, full
        # gradients, bucket buffers and the original model are gone); the slack is Adam's
        # 0-dim step counters
        assert 0 <= r["census"] - formula <= 1024
        assert not r["original_alive"]


@pytest.mark.parametrize("world", [2, 4])
def test_zero3_forward_does_not_keep_full_parameters(memories, world):
    z3, ddp = memories[(world, "zero3")][0], memories[(world, "ddp")][0]
    full_params = 4 * z3["psi"]
    # after forward (autograd graph alive) ZeRO-3 holds its shards and activations, no full copy:
    # only the gather backward needs first, issued as forward ends (one unit, the default budget)
    assert z3["ahead_after_forward"] <= max(z3["unit_bytes"])
    assert z3["after_forward"] - z3["ahead_after_forward"] < full_params / world + 64 * 1024
    assert ddp["after_forward"] >= full_params
