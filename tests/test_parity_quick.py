"""The fast tier's real processes: one representative plan of each parallelism on two gloo
ranks (ddp, ZeRO-2, ZeRO-3 with an uneven shard, tensor + sequence parallel, a 1F1B
pipeline), each against the single-device model: outputs, loss, gradients and parameters
after three AdamW steps (fp32; tolerances as ``autopar.testing.parity`` documents). The slow
tier runs every plan at world sizes 2, 4 and 8."""
import pytest

from jobs import quick


@pytest.fixture(scope="module")
def reports(ranks):
    return ranks(quick.quick_parity, 2, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [name for name, *_ in quick.PLANS])
def test_representative_plan_matches_one_device(reports, name):
    for rep in (r[name] for r in reports):
        assert rep.ok, (f"{name} rank {rep.rank}: output {rep.output_err:.3g} loss {rep.loss_err:.3g} "
                        f"grad {rep.grad_err:.3g} param {rep.param_err:.3g} noise {rep.noise_param_err:.3g} "
                        f"{rep.messages}")
        assert rep.ref_losses[-1] < rep.ref_losses[0]     # the run trained
