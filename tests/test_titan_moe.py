"""A torchtitan-style mixture-of-experts decoder (``jobs/titan_moe.py``: a top-k router with
softmax or sigmoid scores, routed experts as stacked 3-D w1/w2/w3 applied per token by gathering
their weights or densely over every expert, a shared expert) trained at world 2 under ZeRO-3,
tp and tp+sp (the experts whole, or split inside each expert) and a 1F1B pipeline against the
single-device model (``autopar.testing.parity``: outputs, loss, gathered gradients, parameters
after 3 AdamW steps), with the bytes and parameter shares each plan must show. The two
fixed-size ways of running the experts are first checked against torchtitan's own loop over
experts on one device."""
import pytest
import torch

from jobs import titan_moe as tm

VARIANTS = {
    "gather-softmax": tm.MoEArgs(form="gather"),
    "dense-sigmoid": tm.MoEArgs(form="dense", score_func="sigmoid", route_norm=True, route_scale=2.5),
}


@pytest.mark.parametrize("kw", [{"form": "gather"}, {"form": "dense"},
                                {"form": "gather", "score_func": "sigmoid", "route_norm": True, "top_k": 3}])
def test_expert_forms_match_the_loop_over_experts(kw):
    """Both fixed-size forms equal torchtitan's per-expert loop (tokens selected by expert id)
    on one device, on a batch that reaches every expert."""
    a = tm.MoEArgs(**kw)
    torch.manual_seed(0)
    moe = tm.MoE(a)
    x = torch.randn(32, a.dim)
    top, idx, _ = moe.router(x)
    assert idx.unique().numel() == a.num_experts
    want = tm.experts_for_loop(moe.experts, x, top, idx)
    assert want.norm() > 1.0
    torch.testing.assert_close(moe.experts(x, top, idx), want, rtol=1e-5, atol=1e-5)


def _check(reports, label):
    for r in reports:
        for plan, rep in r.items():
            assert rep.ok, (f"{label} under {plan}, rank {rep.rank}: output {rep.output_err:.3g} loss "
                            f"{rep.loss_err:.3g} grad {rep.grad_err:.3g} param {rep.param_err:.3g} "
                            f"noise {rep.noise_param_err:.3g} {rep.messages}")
            assert len(rep.losses) == 3 and rep.ref_losses[-1] < rep.ref_losses[0]


def _psi(a: tm.MoEArgs) -> int:
    return sum(p.numel() * 4 for p in tm.MoETransformer(a).parameters())


def _check_volumes(reports, a: tm.MoEArgs):
    """Per rank, the first step's bytes and what the rank holds (written from the algorithms,
    N = 2, Psi = the model's parameter bytes, 4 per fp32 element): ZeRO-3 all-gathers every
    parameter in forward and reduce-scatters every gradient, Psi (N-1)/N each (these shapes
    divide by 2: no padding), backward gathers again at most as much, and a rank holds Psi/N;
    tp communicates, and with the experts split a rank holds under 3/4 of Psi (the experts'
    3-D weights are most of it), while plain tp, which keeps them whole, says so in a
    warning; each pipeline stage holds part of Psi and sends activations."""
    psi, ring = _psi(a), 1 / 2
    for r in reports:
        for plan, rep in r.items():
            by, held = rep.step_bytes, rep.inspected["bytes"]
            axes = {ax for ax, _, _ in by}
            if plan == "zero3":
                assert axes == {"dp"}
                assert by[("dp", "all_gather", "forward")] == psi * ring
                assert by[("dp", "reduce_scatter", "backward")] == psi * ring
                assert by.get(("dp", "all_gather", "backward"), 0) <= psi * ring
                assert held == psi * ring
            elif plan.startswith("tp"):
                assert axes == {"tp"} and sum(by.values()) > 0
                if "experts split" in plan:
                    assert held < 0.75 * psi, (plan, held / psi)
                else:
                    assert any("keeps" in n and "experts.w1" in n for n in rep.inspected["notes"]), plan
            else:
                assert axes <= {"pp"} and sum(by.values()) > 0
                assert held < psi


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_moe_decoder_under_every_plan(ranks, variant):
    """A 2-layer decoder (4 experts, top-2, a shared expert) under ZeRO-3, tp and tp+sp (with
    the experts whole, and split inside each expert by ``tp_layout``) and 1F1B with 2
    micro-batches, at world 2."""
    a = VARIANTS[variant]
    reports = ranks(tm.parity_plans, 2, a, list(tm.PLANS), timeout=360)
    _check(reports, variant)
    _check_volumes(reports, a)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_moe_load_balance_loss_under_tp(ranks):
    """The Switch load-balance loss (the model computes loss + 0.01 aux from labels=) under tp
    and tp+sp, which do not split the batch its means run over."""
    a = tm.MoEArgs(aux_loss=0.01)
    reports = ranks(tm.parity_plans, 2, a, ["tp", "tp+sp", "tp experts split"], timeout=240)
    _check(reports, "aux loss")
    _check_volumes(reports, a)
