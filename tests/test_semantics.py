"""Training semantics: dropout whose masks are the single-device model's, train /
eval modes, gradient accumulation with ``no_sync``, optimizers that are not elementwise, LR
schedulers. Real processes compare against the single-device model; the refusals run
in-process on a fake process group."""
import pytest
import torch

import autopar
from autopar.models import GPTConfig, TinyGPT, TinyMLP, gpt_batch
from autopar.testing import fake_rank
from jobs import semantics


# ---- dropout -----------------------------------------------------------------------------------

@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["tp+sp", "pp 1f1b", pytest.param("ddp", marks=pytest.mark.slow),
                                  pytest.param("zero3", marks=pytest.mark.slow),
                                  pytest.param("tp", marks=pytest.mark.slow)])
def test_dropout_training_matches_one_device(ranks, name):
    """GPT with hidden and attention dropout 0.1, three AdamW steps, every rank seeded as the
    single-device model: outputs, losses, gradients and parameters to fp32 tolerance."""
    for rep in (r[name] for r in ranks(semantics.dropout_parity, 2, [name], timeout=240)):
        assert rep.ok, (f"{name} rank {rep.rank}: out {rep.output_err:.3g} loss {rep.loss_err:.3g} "
                        f"grad {rep.grad_err:.3g} param {rep.param_err:.3g} {rep.messages}")
        assert rep.loss_err < 0.01


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["tp+sp", pytest.param("pp 1f1b", marks=pytest.mark.slow),
                                  pytest.param("ddp", marks=pytest.mark.slow),
                                  pytest.param("zero3", marks=pytest.mark.slow),
                                  pytest.param("tp", marks=pytest.mark.slow)])
def test_dropout_masks_are_slices_of_the_single_device_masks(ranks, name):
    """Each mask a rank holds is bitwise its slice (dp rows, micro-batch, tp heads, sp
    positions, written out in the test) of the mask the single-device forward drew, and the
    generator leaves the forward in the single-device model's state."""
    for r in ranks(semantics.dropout_masks, 2, name, timeout=240):
        assert r["generator_state_equal"]
        assert r["checked"], "no masks held"
        bad = [c for c in r["checked"] if not c[-1]]
        assert not bad, f"masks differ from the single-device slices: {bad}"
        m = 2 if name.startswith("pp") else 1
        sites = {c[0] for c in r["checked"]}
        assert len(r["checked"]) == len(sites) * m
        if not name.startswith("pp"):
            assert len(sites) == r["sites"] == 6      # 2 layers x (attention, 2 residual dropouts)


# ---- train / eval ---------------------------------------------------------------------------------

@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["zero3", "pp 1f1b", pytest.param("ddp", marks=pytest.mark.slow),
                                  pytest.param("tp+sp", marks=pytest.mark.slow)])
def test_eval_mode_matches_one_device_in_eval_mode(ranks, name):
    for r in ranks(semantics.eval_mode, 2, name, timeout=240):
        assert max(r["train_loss_err"]) < 1e-5, r
        if name.startswith("pp"):
            assert r["eval_loss_err"] < 1e-5
        else:
            assert r["eval_out_err"] < 1e-5 and r["eval_repeatable"] and not r["eval_out_grad_fn"]
            assert r["zero3_state_left"] == 0       # nothing gathered or kept for a backward
        assert r["eval_backward_bytes"] == 0        # no gradient buckets, no backward gathers


def test_a_forward_that_differs_between_modes_is_refused_in_the_other_mode():
    x = torch.randn(8, 16)
    with fake_rank(2, 0):
        dm = autopar.compile(semantics._TrainOnlyScale(), autopar.Mesh(dp=2), example_inputs=(x,),
                             plan=autopar.Plan(dp="ddp"))
        dm(x[:4])       # the captured (training) mode runs
        dm.eval()
        with pytest.raises(RuntimeError, match=r"compiled from the model in training mode.*aten\.mul"):
            dm(x[:4])


def test_dropout_only_models_switch_modes():
    tok, _ = gpt_batch(GPTConfig(dropout=0.1), 4)
    with fake_rank(2, 0):
        dm = autopar.compile(TinyGPT(GPTConfig(dropout=0.1)), autopar.Mesh(dp=2), example_inputs=(tok,),
                             plan=autopar.Plan(dp="ddp"))
    assert dm.ctx.mode_difference() == "" and len(dm.ctx.rng_sites) == 6


def test_batchnorm_running_statistics_are_refused():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16))
    with fake_rank(2, 0):
        with pytest.raises(ValueError, match=r"updates the buffers .*running_mean.*BatchNorm.*eval mode"):
            autopar.compile(model, autopar.Mesh(dp=2), example_inputs=(torch.randn(8, 16),),
                            plan=autopar.Plan(dp="ddp"))
        model.eval()    # frozen statistics compile
        autopar.compile(model, autopar.Mesh(dp=2), example_inputs=(torch.randn(8, 16),), plan=autopar.Plan(dp="ddp"))


def test_other_random_ops_are_refused():
    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 16)

        def forward(self, x):
            return self.fc(x) + torch.randn_like(x)

    with fake_rank(2, 0):
        with pytest.raises(NotImplementedError, match=r"randn_like.*draws random numbers.*only\s+for dropout"):
            autopar.compile(Noisy(), autopar.Mesh(dp=2), example_inputs=(torch.randn(8, 16),),
                            plan=autopar.Plan(dp="ddp"))


# ---- gradient accumulation ------------------------------------------------------------------------

def _one_reduction_bytes(r, mode):
    n = r["n"]
    if mode == "ddp":
        return 2 * r["psi"] * (n - 1) / n * 4           # all-reduce of every gradient, once
    return r["psi_padded"] * (n - 1) / n * 4            # reduce-scatter of the padded gradients, once


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["ddp", "zero3", pytest.param("zero1", marks=pytest.mark.slow),
                                  pytest.param("zero2", marks=pytest.mark.slow)])
def test_no_sync_accumulates_and_reduces_once(ranks, mode):
    for r in ranks(semantics.accumulation, 2, mode, None, timeout=240):
        assert r["grad_err"] < 1e-5, r
        assert r["calls"] == 1, r              # one bucket, reduced once over the four micro-steps
        assert r["reduce_bytes"] == _one_reduction_bytes(r, mode)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pipeline_no_sync_accumulates_across_steps(ranks):
    for r in ranks(semantics.accumulation, 4, "1f1b", {"pp": 2, "dp": 2}, timeout=240):
        assert r["grad_err"] < 1e-5, r
        assert 0 < r["psi_here"] < r["psi"]        # this rank's stage
        assert r["calls"] == 1                     # one bucket, once over the four steps
        assert r["reduce_bytes"] == 2 * r["psi_here"] * (2 - 1) / 2 * 4


# ---- optimizers ------------------------------------------------------------------------------------

@pytest.mark.parametrize("plan,axes", [(autopar.Plan(dp="zero1"), {"dp": 2}), (autopar.Plan(dp="zero3"), {"dp": 2}),
                                       (autopar.Plan(tp=True), {"tp": 2})])
def test_non_elementwise_optimizer_on_shards_is_refused(plan, axes):
    x = torch.randn(8, 16)
    with fake_rank(2, 0):
        dm = autopar.compile(TinyMLP(), autopar.Mesh(**axes), example_inputs=(x,), plan=plan)
        with pytest.raises(ValueError, match=r"Adafactor is not an elementwise optimizer.*per_tensor=True"):
            dm.optimizer(torch.optim.Adafactor, lr=0.01)
        assert isinstance(dm.optimizer(torch.optim.AdamW, lr=0.01), torch.optim.AdamW)


def test_non_elementwise_optimizer_on_whole_parameters_is_allowed():
    with fake_rank(2, 0):
        dm = autopar.compile(TinyMLP(), autopar.Mesh(dp=2), example_inputs=(torch.randn(8, 16),),
                             plan=autopar.Plan(dp="ddp"))
        assert isinstance(dm.optimizer(torch.optim.Adafactor, lr=0.01), torch.optim.Adafactor)


@pytest.mark.parametrize("plan,axes,why", [
    (autopar.Plan(dp="zero3"), {"dp": 2}, r"zero3 over dp=2: fc1\.weight, fc1\.bias, fc2\.weight, fc2\.bias"),
    (autopar.Plan(dp="zero1"), {"dp": 2}, r"zero1 over dp=2: fc1\.weight"),
    (autopar.Plan(tp=True), {"tp": 2}, r"split by tensor parallelism over tp=2: fc1\.weight, fc1\.bias, fc2\.weight")],
    ids=["zero3", "zero1", "tp"])
def test_stock_optimizer_with_per_tensor_statistics_on_shards_is_refused_at_its_first_step(plan, axes, why):
    """A LAMB-like optimizer built directly on dm.parameters() (not dm.optimizer) raises at its
    first step, naming the sharded parameters, why they are sharded, and dm.optimizer; nothing
    was stepped. An elementwise one on the same shards, and the LAMB-like one on a module
    whose parameters are whole, step."""
    x = torch.randn(8, 16)
    with fake_rank(2, 0):
        dm = autopar.compile(TinyMLP(), autopar.Mesh(**axes), example_inputs=(x,), plan=plan)
        for p in dm.parameters():
            p.grad = torch.ones_like(p)
        before = [p.detach().clone() for p in dm.parameters()]
        opt = semantics.TrustRatio(dm.parameters(), lr=0.1)
        with pytest.raises(ValueError, match=r"TrustRatio was built directly on the parameters of a compiled module.*"
                                             + why + r".*computed per shard.*dm\.optimizer\(TrustRatio"):
            opt.step()
        assert all(torch.equal(a, p) for a, p in zip(before, dm.parameters()))
        with pytest.raises(ValueError, match="per shard"):
            opt.step()                      # and at every later step
        torch.optim.SGD(dm.parameters(), lr=0.1).step()      # elementwise: steps
        assert not all(torch.equal(a, p) for a, p in zip(before, dm.parameters()))
        whole = autopar.compile(TinyMLP(), autopar.Mesh(dp=2), example_inputs=(x,), plan=autopar.Plan(dp="ddp"))
        semantics.TrustRatio(whole.parameters(), lr=0.1).step()


def test_stock_optimizer_is_checked_again_when_its_groups_change():
    """A refusal is not dodged by stepping first on whole parameters and adding the shards."""
    x = torch.randn(8, 16)
    with fake_rank(2, 0):
        dm = autopar.compile(TinyMLP(), autopar.Mesh(dp=2), example_inputs=(x,), plan=autopar.Plan(dp="zero3"))
        opt = semantics.TrustRatio([torch.nn.Parameter(torch.ones(3))], lr=0.1)
        opt.step()
        opt.add_param_group({"params": list(dm.parameters())})
        with pytest.raises(ValueError, match="TrustRatio was built directly"):
            opt.step()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["adamw zero3", "adamw zero2", pytest.param("sgd zero3", marks=pytest.mark.slow),
                                  pytest.param("adamw zero1", marks=pytest.mark.slow),
                                  pytest.param("adamw tp", marks=pytest.mark.slow)])
def test_stock_elementwise_optimizer_on_shards_matches_one_device(ranks, name):
    """torch.optim.X(dm.parameters()) as FSDP2's users build it: under ZeRO-1/2 each step is
    followed by the replica all-gather dm.optimizer's step ends with, so forward never runs on
    stale replicas."""
    for r in ranks(semantics.stock_optimizer, 2, name, timeout=240):
        assert "error" not in r, r
        assert r["param_err"] < 1e-5, r
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["trust ratio zero3", pytest.param("trust ratio tp", marks=pytest.mark.slow)])
def test_stock_trust_ratio_optimizer_is_refused_on_every_rank(ranks, name):
    for r in ranks(semantics.stock_optimizer, 2, name, timeout=240):
        assert "was built directly on the parameters" in r.get("error", ""), r
        assert "dm.optimizer(TrustRatio" in r["error"] and "per shard" in r["error"], r


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_stock_refusal_guards_a_real_error(ranks):
    """The trust-ratio optimizer forced onto ZeRO-3's shards (declared elementwise) trains
    differently from one device: each shard's norms are not the tensor's."""
    for r in ranks(semantics.stock_optimizer, 2, "trust ratio zero3 forced elementwise", timeout=240):
        assert r["param_err"] > 1e-3, r


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["adafactor zero3 per_tensor", "adamw zero2 + lambda lr",
                                  pytest.param("adafactor zero2 per_tensor", marks=pytest.mark.slow),
                                  pytest.param("adafactor tp per_tensor", marks=pytest.mark.slow),
                                  pytest.param("sgd zero3 + onecycle", marks=pytest.mark.slow)])
def test_optimizers_and_schedulers_match_one_device(ranks, name):
    for r in ranks(semantics.optimizers, 2, name, timeout=240):
        assert r["is_instance"] and r["lr"] == pytest.approx(r["ref_lr"])
        assert r["param_err"] < 1e-5, r
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_refusal_guards_a_real_error(ranks):
    """Adafactor forced onto ZeRO-3's shards (declared elementwise) trains differently from one
    device: the per-shard statistics are not the tensor's."""
    for r in ranks(semantics.optimizers, 2, "adafactor zero3 forced elementwise", timeout=240):
        assert r["param_err"] > 1e-3, r


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dropout_on_an_uneven_sequence_split(ranks):
    """A sequence that does not divide by tp under sp is split unevenly (8 and 7 positions),
    dropout masks included: parity."""
    for rep in ranks(semantics.uneven_sequence_dropout, 2, timeout=240):
        assert rep.ok, (rep.output_err, rep.loss_err, rep.grad_err, rep.param_err)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("axes", [{"dp": 2}, {"tp": 2}], ids=["dp", "tp"])
def test_local_dropout_masks_are_independent_where_split_and_shared_where_replicated(ranks, axes):
    """Plan(dropout_rng='local'): each rank draws only its slice. Over dp every mask differs
    between the ranks (other rows); over tp the attention masks (heads split: the keys their
    fused kernel is seeded with) differ and the residual dropouts (replicated after the
    row-parallel all-reduce) are the same on both ranks; the same seed draws the same masks;
    the drop rate is p."""
    res = ranks(semantics.local_masks, 2, axes, timeout=240)
    for r in res:
        assert r["repeatable"]
        # 0.25 of the elements dropped, within 5 binomial standard deviations
        sd = (0.25 * 0.75 / r["elements"]) ** 0.5
        assert abs(r["drop_rate"] - 0.25) < 5 * sd, r["drop_rate"]
        assert r["loss"] == r["loss"] and r["loss"] < 10
    other = res[0]["same_as_rank"][1]
    for site, same in other.items():
        kind = res[0]["kinds"][site]
        if "dp" in axes or kind == "sdpa":
            assert not same, f"site {site} ({kind}): both ranks drew one mask for different slices"
        else:
            assert same, f"site {site} ({kind}): a replicated activation got different masks on the tp ranks"
