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


@pytest.mark.timeout(300)
def test_full_views_gather_in_a_few_collectives(ranks):
    """``full_state_dict`` / ``full_grads`` gather every tensor at once: under dp x tp one
    all-gather over dp and one over tp (fp32, under ``FULL_BUCKET_BYTES``); under pp x dp one
    over dp in each stage, then each of the 2 pipeline ranks broadcasts which of its tensors
    are present and their values, flat: 1 + 2 x 2 (not one to three collectives a tensor).
    The tensors are the single-device model's."""
    expected = {"dp2 x tp2 zero3": ["all_gather"] * 2,
                "pp2 x dp2 zero3": ["all_gather"] + ["broadcast"] * 4}
    for per_rank in ranks(quick.full_views, 4, timeout=240):
        for name, r in per_rank.items():
            assert r["state_calls"] == expected[name] and r["grad_calls"] == expected[name], (name, r)
            assert r["state_keys"] and r["state_err"] == 0.0, (name, r)
            assert r["grad_err"] < 1.0, (name, r)
