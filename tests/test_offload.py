"""Optimizer offload, Plan(offload="optimizer") (ZeRO-Offload): the optimizer's copy of this
rank's parameters, their gradients and its state live on the host and the step runs there.

Here host and device are both the CPU, so the tests check what is checkable: the bytes that
would cross the host link equal the formula written below (per step, E elements down in the
gradient's dtype and up in the device parameter's, E = this rank's trainable elements: Ψ under
ddp, its rows of every tensor under ZeRO); the optimizer steps tensors that share no storage
with the device-side module; what the module holds after a step equals the formula without
optimizer state; parity with the single-device model after three AdamW steps; and the cost
model's host bytes, step time and memory."""
import pytest
import torch

import autopar
from autopar.cost.cluster import get_cluster
from autopar.cost.estimate import Profiles
from autopar.models import GPTConfig, TinyGPT, gpt_batch, lm_loss
from autopar.testing import optimizer_state_bytes

from jobs import offload

SHAPES = {n: tuple(p.shape) for n, p in TinyGPT(GPTConfig()).named_parameters()}
PSI = sum(torch.Size(s).numel() for s in SHAPES.values())


def rank_elements(dp: int, index: int) -> int:
    """Elements of rank ``index``'s ZeRO shards over ``dp`` ranks: ceil(rows / dp) rows of every
    tensor, the last ranks what is left (67 vocabulary rows over 2: 34 and 33)."""
    total = 0
    for shape in SHAPES.values():
        rows, per_row = shape[0], torch.Size(shape[1:]).numel()
        ceil = -(-rows // dp)
        mine = max(0, min(rows - index * ceil, ceil))
        total += mine * per_row
    return total


def _check_parity(rep, name):
    assert rep["ok"], f"{name} rank {rep['rank']}: errors (output, loss, grad, param, noise) {rep['errors']} " \
                      f"{rep['messages']}"
    assert rep["ref_losses"][-1] < rep["ref_losses"][0]


def _check_census(r, mode, mixed=False):
    """One rank's census of a step on the dp=2 GPT (fp32 unless ``mixed``: bf16 compute, fp32 masters)."""
    e = PSI if mode == "ddp" else rank_elements(r["dp"], r["dp_index"])
    assert r["elements"] == e
    # over the host link, per step: gradients down, parameters up, 4 B each (fp32, masters too)
    assert r["bytes"] == {("d2h", "optimizer"): 4 * e, ("h2d", "optimizer"): 4 * e}, r["bytes"]
    # the gradients went down bucket by bucket as backward reduced them, none in the step itself
    assert r["down_in_backward"] == 4 * e
    # the optimizer steps host copies; its state (AdamW's m and v, fp32) is theirs, on the host
    assert r["optimizer_steps_host_copies"] and r["shared_with_device"] == 0
    assert r["state_devices"] == [r["host"]] and r["host"] == "cpu" and not r["pinned"]
    assert r["state_bytes"] == 8 * e
    assert r["host_held"] == {"parameters": 4 * e, "gradients": 4 * e, "optimizer state": 8 * e}
    # the device after the step: no gradients, no optimizer state; what the plan keeps of the parameters
    assert r["grads_left_on_device"] == 0 and r["held"]["gradients"] == 0
    held = r["held"]
    padded = sum(-(-s[0] // 2) * 2 * torch.Size(s[1:]).numel() for s in SHAPES.values())
    want = {"ddp": {"parameters": 4 * PSI, "replicas": 0, "persistent": 0},
            "zero1": {"parameters": 4 * PSI, "replicas": 0, "persistent": 4 * padded},   # shards view the replicas
            "zero2": {"parameters": 4 * PSI, "replicas": 0, "persistent": 0},
            "zero3": {"parameters": 4 * e, "replicas": 0, "persistent": 0}}[mode]
    if mixed:   # bf16 replicas, the fp32 master shards stay on the device
        want = {"ddp": {"parameters": 4 * PSI, "replicas": 0, "persistent": 0},
                "zero2": {"parameters": 4 * e, "replicas": 2 * PSI, "persistent": 0},
                "zero3": {"parameters": 4 * e, "replicas": 0, "persistent": 0}}[mode]
    assert {k: held[k] for k in want} == want, held
    assert "optimizer offload" in r["explain"] and "host link" in r["explain"]
    assert "unavailable" not in r["explain"]      # the prediction of the offloaded plan was printed


# ---- without processes ----------------------------------------------------------------------

def test_plan_round_trips_and_per_tensor_is_refused_with_offload():
    plan = autopar.Plan(dp="zero2", offload="optimizer")
    assert autopar.Plan.parse(str(plan)) == plan
    tok, tgt = gpt_batch(GPTConfig(), 4)
    dm = autopar.compile(TinyGPT(GPTConfig()), autopar.Mesh(dp=1, virtual=True, rank=0), example_inputs=(tok,),
                         plan=autopar.Plan(offload="optimizer"))
    with pytest.raises(ValueError, match="per_tensor=True.*offload"):
        dm.optimizer(torch.optim.AdamW, per_tensor=True, lr=1e-3)


def test_one_rank_step_moves_psi_each_way_and_keeps_no_state_on_the_device():
    """dp=1 in this process: the module trains as the plain model does (AdamW, 2 steps), E = Ψ
    elements go down and come back per step, and a device parameter loaded from outside
    (load_full_state_dict) is copied down again before the next step."""
    c = GPTConfig()
    tok, tgt = gpt_batch(c, 4)
    torch.manual_seed(0)
    ref = TinyGPT(c)
    model = TinyGPT(c)
    model.load_state_dict(ref.state_dict())
    dm = autopar.compile(model, autopar.Mesh(dp=1, virtual=True, rank=0), example_inputs=(tok,),
                         plan=autopar.Plan(offload="optimizer"))
    opt, opt_ref = dm.optimizer(torch.optim.AdamW, lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(2):
        dm.offload_stats.reset()
        for o, m in ((opt, dm), (opt_ref, ref)):
            o.zero_grad()
            lm_loss(m(tok), tgt).backward()
            o.step()
        assert dict(dm.offload_stats.bytes) == {("host", "d2h", "optimizer"): 4 * PSI,
                                                ("host", "h2d", "optimizer"): 4 * PSI}
    full = dm.full_state_dict()
    for k, p in ref.named_parameters():
        torch.testing.assert_close(full[k], p.detach(), rtol=1e-5, atol=1e-6)
    assert all(p.grad is None for p in dm.parameters()) and optimizer_state_bytes(opt) == 8 * PSI
    device = {p.untyped_storage().data_ptr() for p in dm.parameters()}
    assert not device & {v.untyped_storage().data_ptr() for s in opt.state.values() for v in s.values()}
    # a checkpoint loaded into the device parameters reaches the host copies before the next step
    dm.load_full_state_dict(ref.state_dict())
    dm.offload_stats.reset()
    opt.zero_grad()
    lm_loss(dm(tok), tgt).backward()
    opt.step()
    assert dm.offload_stats.bytes[("host", "d2h", "refresh")] == 4 * PSI
    assert "optimizer offload" in dm.explain(cluster="dgx-a100-80gb")


@pytest.fixture(scope="module")
def gpt_profiles():
    c = GPTConfig()
    tok, _ = gpt_batch(c, 8)
    return TinyGPT(c), tok, Profiles(TinyGPT(c), (tok,))


@pytest.mark.parametrize("mode", ["ddp", "zero2", "zero3"])
def test_estimate_charges_the_host_link_and_drops_optimizer_state(gpt_profiles, mode):
    """dgx-a100 (ZeRO's mixed precision: 2 B parameters and gradients, K = 12): the host link
    carries (2 + 2)·E bytes per step, E = Ψ (ddp) or the padded Ψ/N; the step grows by at least
    those bytes over PCIe; the device's model states lose K·E."""
    model, tok, profiles = gpt_profiles
    c = get_cluster("dgx-a100-80gb")
    mesh = autopar.Mesh(dp=2, virtual=True)
    base = autopar.estimate(model, mesh, autopar.Plan(dp=mode), example_inputs=(tok,), cluster=c, profiles=profiles)
    off = autopar.estimate(model, mesh, autopar.Plan(dp=mode, offload="optimizer"), example_inputs=(tok,),
                           cluster=c, profiles=profiles)
    padded = sum(-(-s[0] // 2) * 2 * torch.Size(s[1:]).numel() for s in SHAPES.values())
    e = PSI if mode == "ddp" else padded / 2
    assert off.host_bytes == (2 + 2) * e and base.host_bytes == 0
    assert off.step_time_s - base.step_time_s >= off.host_bytes / c.host.bandwidth
    assert base.memory_breakdown["model states"] - off.memory_breakdown["model states"] == 12 * e
    assert base.memory_bytes - off.memory_bytes >= 12 * e - 1e-6 * base.memory_bytes
    assert off.host_memory_bytes == (2 + 12) * e         # fp16 gradients + fp32 master, m, v
    assert "host link" in off.explain()


def test_pipeline_estimate_charges_each_rank_for_its_stages(gpt_profiles):
    """1F1B over pp=2: each rank's optimizer copy is its stages' parameters (the tied table in
    both), so the busiest rank's host bytes lie between (2 + 2)·Ψ/2 and (2 + 2)·Ψ."""
    model, tok, profiles = gpt_profiles
    c = get_cluster("dgx-a100-80gb")
    mesh = autopar.Mesh(pp=2, virtual=True)
    plan = autopar.Plan(pp_schedule="1f1b", microbatches=2)
    base = autopar.estimate(model, mesh, plan, example_inputs=(tok,), cluster=c, profiles=profiles)
    off = autopar.estimate(model, mesh, autopar.Plan.parse(str(plan).replace(")", ", offload='optimizer')")),
                           example_inputs=(tok,), cluster=c, profiles=profiles)
    assert 4 * PSI / 2 <= off.host_bytes <= 4 * PSI
    assert off.step_time_s - base.step_time_s >= off.host_bytes / c.host.bandwidth


# ---- real processes -------------------------------------------------------------------------

@pytest.mark.timeout(240)
def test_zero2_offload_matches_one_device_and_moves_the_formula_bytes(ranks):
    for r in ranks(offload.offload_checks, 2, "zero2", timeout=200):
        _check_parity(r["parity"], "zero2")
        _check_census(r["census"], "zero2")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["ddp", "zero1", "zero3"])
def test_every_dp_mode_with_offload_matches_one_device(ranks, mode):
    for r in ranks(offload.offload_checks, 2, mode, timeout=300):
        _check_parity(r["parity"], mode)
        _check_census(r["census"], mode)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["zero2 bf16", "zero3 bf16"])
def test_mixed_precision_offload_keeps_fp32_masters_on_the_host(ranks, name):
    for r in ranks(offload.offload_checks, 2, name, timeout=300):
        _check_parity(r["parity"], name)
        _check_census(r["census"], name.split()[0], mixed=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_zero2_with_tp_offload_on_four_ranks(ranks):
    """dp=2 x tp=2: each rank moves its own (tp slice, dp rows) elements, 4 B each way."""
    for r in ranks(offload.offload_checks, 4, "zero2 tp", timeout=400):
        _check_parity(r["parity"], "zero2 tp")
        c = r["census"]
        assert c["bytes"] == {("d2h", "optimizer"): 4 * c["elements"], ("h2d", "optimizer"): 4 * c["elements"]}
        assert c["down_in_backward"] == 4 * c["elements"]
        assert c["elements"] < PSI / 2 and c["state_bytes"] == 8 * c["elements"] and c["shared_with_device"] == 0
        assert c["grads_left_on_device"] == 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pipeline_offload_matches_one_device(ranks):
    for r in ranks(offload.offload_checks, 2, "pp 1f1b", timeout=300):
        _check_parity(r["parity"], "pp 1f1b")
        c = r["census"]
        assert c["bytes"] == {("d2h", "optimizer"): 4 * c["elements"], ("h2d", "optimizer"): 4 * c["elements"]}
        assert c["down_in_backward"] == 0      # dp=1: no bucket is reduced; the step copies them down
        assert c["state_bytes"] == 8 * c["elements"] and c["shared_with_device"] == 0
        assert "optimizer offload" in c["explain"] and "unavailable" not in c["explain"]
