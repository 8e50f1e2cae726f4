"""Optimizer offload, Plan(offload="optimizer") (ZeRO-Offload): the optimizer's copy of this
rank's parameters, their gradients and its state live on the host and the step runs there.

Here host and device are both the CPU, so the tests check what is checkable: the bytes that
would cross the host link equal the formula written below (per step, E elements down in the
gradient's dtype and up in the device parameter's, E = this rank's trainable elements: Ψ under
ddp, its rows of every tensor under ZeRO; fp32 and mixed precision alike 4 B each way, as the
fp32 masters stay on the device); the optimizer steps tensors that share no storage with the
device-side module; what the module holds after a step equals the formula without optimizer
state; under ZeRO-2 in five buckets, the order the runtime issues a step's work in: each
bucket's gradients go down while the next bucket is reduced, each bucket's parameters come
up while the previous bucket's all-gather is in flight; parity with the single-device model
after three AdamW steps; and the cost model's host bytes (equal to the runtime's), the
overlap it prices, step time and memory."""
import dataclasses

import pytest
import torch

import autopar
from autopar.cost.cluster import get_cluster
from autopar.cost.estimate import Profiles
from autopar.cost.offload import flow_time
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


def link_bytes(e: int, mixed: bool) -> dict:
    """The host link's bytes per step for E elements: gradients down as they land, parameters up
    as the device holds them. fp32: 4 B + 4 B. Mixed precision (bf16 compute): the device
    parameter the optimizer copies is the fp32 master and the reducer lands the gradients in its
    dtype, so 4 B + 4 B too, where ZeRO-Offload's fp16 gradients and parameters are 2 B + 2 B."""
    if mixed:   # the gradient landed in the fp32 master's dtype down, the fp32 master up
        down, up = 4, 4
    else:       # the fp32 gradient down, the fp32 parameter up
        down, up = 4, 4
    return {("d2h", "optimizer"): down * e, ("h2d", "optimizer"): up * e}


def _check_order(order, buckets):
    """The measured step as the runtime issued it (``jobs.offload._log_order``): bucket k's
    gradients go to the host once bucket k+1's reduction is issued (the last when backward
    ends); after the host step, bucket k's parameters come up in bucket order and its all-gather
    is issued, then bucket k+1's come up and its all-gather is issued before bucket k's is
    waited on: each bucket's copies run while the previous bucket's traffic is in flight."""
    n = len(buckets)
    assert n >= 2, buckets
    want = [("reduce", 0)]
    for k in range(1, n):
        want += [("reduce", k), ("land", k - 1)]
    want.append(("land", n - 1))
    for k in range(n):
        want += [("up", name) for name in buckets[k]] + [("issue", k)]
        if k:
            want.append(("wait", k - 1))
    want.append(("wait", n - 1))
    assert [tuple(e) for e in order] == want


def _check_census(r, mode, mixed=False):
    """One rank's census of a step on the dp=2 GPT (fp32 unless ``mixed``: bf16 compute, fp32 masters)."""
    e = PSI if mode == "ddp" else rank_elements(r["dp"], r["dp_index"])
    assert r["elements"] == e
    assert r["bytes"] == link_bytes(e, mixed), r["bytes"]
    if mode == "zero2":
        _check_order(r["order"], r["buckets"])
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


def test_one_rank_mixed_precision_moves_the_fp32_masters_as_the_estimate_prices(gpt_profiles):
    """bf16 compute, dp=1 in this process: a step moves Ψ elements down and up at 4 B each (the
    gradient landed in the fp32 master's dtype, the master), as ``link_bytes`` writes out, and
    the cost model under mixed precision prices the same bytes."""
    model, tok, profiles = gpt_profiles
    tgt = gpt_batch(GPTConfig(), 8)[1]
    plan = autopar.Plan(param_dtype=torch.bfloat16, offload="optimizer")
    dm = autopar.compile(TinyGPT(GPTConfig()), autopar.Mesh(dp=1, virtual=True, rank=0), example_inputs=(tok,),
                         plan=plan)
    opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
    for _ in range(2):
        dm.offload_stats.reset()
        opt.zero_grad()
        lm_loss(dm(tok), tgt).backward()
        opt.step()
    moved = {(k, ph): b for (_, k, ph), b in dm.offload_stats.bytes.items()}
    assert moved == link_bytes(PSI, mixed=True)
    est = autopar.estimate(model, autopar.Mesh(dp=1, virtual=True), plan, example_inputs=(tok,),
                           cluster=DGX, profiles=profiles)
    assert est.host_bytes == sum(moved.values())


@pytest.fixture(scope="module")
def gpt_profiles():
    c = GPTConfig()
    tok, _ = gpt_batch(c, 8)
    return TinyGPT(c), tok, Profiles(TinyGPT(c), (tok,))


DGX = get_cluster("dgx-a100-80gb")
PRECISION = {"mixed": {"param_dtype": torch.bfloat16}, "fp32": {}}     # the plan's, on the fp32 GPT
PADDED = sum(-(-s[0] // 2) * 2 * torch.Size(s[1:]).numel() for s in SHAPES.values())   # rows padded over dp=2


def copy_seconds(nbytes: float, c) -> float:
    """One copy over the host link: its latency plus the bytes at its bandwidth."""
    return c.host.latency + nbytes / c.host.bandwidth


def _estimates(gpt_profiles, mode, c, **plan):
    model, tok, profiles = gpt_profiles
    mesh = autopar.Mesh(dp=2, virtual=True)
    return [autopar.estimate(model, mesh, autopar.Plan(dp=mode, **plan, **extra), example_inputs=(tok,), cluster=c,
                             profiles=profiles) for extra in ({}, {"offload": "optimizer"})]


@pytest.mark.parametrize("precision", list(PRECISION))
@pytest.mark.parametrize("mode", ["ddp", "zero2", "zero3"])
def test_estimate_prices_the_host_link_as_the_runtime_moves_it(gpt_profiles, mode, precision):
    """dgx-a100 under ``Plan(param_dtype=torch.bfloat16)`` (bf16 compute copies, fp32 masters
    and Adam state) and in fp32 (4, 4, 8), over dp=2 in one gradient bucket. Bytes: 4 + 4 per
    element either way, as the runtime moves them (mixed: the fp32 master comes up, the
    gradient lands in its dtype), E = Ψ
    (ddp) or the padded Ψ/N; the host holds the copy, its gradient, m and v, 16 B. Memory: the
    device keeps its compute copy, the gradients as they land and (mixed) the master. Time: the
    only bucket's copy down waits for the last reduction, and its copy up comes before its
    gather (ddp, ZeRO-3: one copy, nothing after it), so each is charged whole."""
    c = DGX
    base, off = _estimates(gpt_profiles, mode, c, **PRECISION[precision])
    e = PSI if mode == "ddp" else PADDED / 2
    assert off.host_bytes == (4 + 4) * e and base.host_bytes == 0
    assert off.host_memory_bytes == (4 + 4 + 8) * e
    # the persistent compute copy (mixed: ZeRO-2's bf16 replicas; ddp casts per forward, ZeRO-3
    # gathers per use), the landed gradient, the master
    p, g, k = ((2 if mode == "zero2" else 0), 4, 4) if precision == "mixed" else (4, 4, 0)
    states = {"ddp": (p + g + k) * PSI, "zero2": p * PSI + (g + k) * e, "zero3": (p + g + k) * e}[mode]
    assert off.memory_breakdown["model states"] == states
    assert off.memory_bytes < base.memory_bytes
    times = off.time_breakdown
    assert times["host link up (exposed)"] == pytest.approx(copy_seconds(4 * e, c), rel=1e-9)
    if mode != "zero3":       # ZeRO-3 reduces (and copies) a layer at a time
        assert times["host link down (exposed)"] == pytest.approx(copy_seconds(4 * e, c), rel=1e-9)
    # the step: the device's optimizer step replaced by the host's, plus what the copies add
    extra = times["host step"] + times["host link down (exposed)"] + times["host link up (exposed)"]
    assert off.step_time_s - base.step_time_s == pytest.approx(extra - base.time_breakdown["optimizer"], rel=1e-6)
    assert "host link" in off.explain()


def test_estimate_pipelines_the_copies_up_with_the_gathers_in_the_runtimes_buckets(gpt_profiles):
    """ZeRO-2 over dp=2 in 32 kB buckets (fp32): the predicted step has a copy up per bucket of
    the runtime's (a virtual-mesh compile's buckets), each of this rank's bucket rows x 4 B;
    bucket k's all-gather starts once its copy is up, and bucket k+1's copy starts before bucket
    k's gather ends; so the copies up add less than their sum, and at least the first one."""
    c = DGX
    model, tok, _ = gpt_profiles
    plan = dict(bucket_bytes=32_000)
    base, off = _estimates(gpt_profiles, "zero2", c, **plan)
    dm = autopar.compile(model, autopar.Mesh(dp=2, virtual=True, rank=0), example_inputs=(tok,),
                         plan=autopar.Plan(dp="zero2", offload="optimizer", **plan))
    widths = [b.width for b in dm._sync.buckets]
    assert len(widths) == 5 and sum(widths) == PADDED / 2
    lanes = {name: (start, end) for _, _, name, start, end in off.timeline}
    ups = [lanes[f"params up, bucket {k}"] for k in range(len(widths))]
    gathers = [lanes[f"all_gather params, bucket {k}"] for k in range(len(widths))]
    assert f"params up, bucket {len(widths)}" not in lanes
    for k, w in enumerate(widths):
        assert ups[k][1] - ups[k][0] == pytest.approx(copy_seconds(4 * w, c), rel=1e-9)
        assert lanes[f"grads down, bucket {k}"][1] - lanes[f"grads down, bucket {k}"][0] == \
            pytest.approx(copy_seconds(4 * w, c), rel=1e-9)
        assert gathers[k][0] >= ups[k][1] - 1e-15
        if k + 1 < len(widths):
            assert ups[k + 1][0] < gathers[k][1]
    exposed = off.time_breakdown["host link up (exposed)"]
    assert ups[0][1] - ups[0][0] <= exposed + 1e-15 < sum(u[1] - u[0] for u in ups)


def test_flow_time_is_the_two_stage_pipeline():
    """Three items of a = 1 then b = 2 seconds: 1 + 2 + 2 + 2 = 7 (not 3 + 6 = 9); b shorter
    than a: 3 x 2 + 1 = 7; with nothing second, the firsts' sum."""
    assert flow_time([1, 1, 1], [2, 2, 2]) == 7
    assert flow_time([2, 2, 2], [1, 1, 1]) == 7
    assert flow_time([1, 2, 3], [0, 0, 0]) == 6


def test_pipeline_estimate_charges_each_rank_for_its_stages(gpt_profiles):
    """1F1B over pp=2: each rank's optimizer copy is its stages' parameters (the tied table in
    both), so the busiest rank's host bytes lie between (4 + 4)·Ψ/2 and (4 + 4)·Ψ (mixed
    precision: the fp32 master up, the gradient landed in its dtype down). With dp=1 nothing
    overlaps the copies: the step grows by at least the bytes over PCIe."""
    model, tok, profiles = gpt_profiles
    c = get_cluster("dgx-a100-80gb")
    mesh = autopar.Mesh(pp=2, virtual=True)
    plan = autopar.Plan(pp_schedule="1f1b", microbatches=2)
    base = autopar.estimate(model, mesh, plan, example_inputs=(tok,), cluster=c, profiles=profiles)
    off = autopar.estimate(model, mesh, autopar.Plan.parse(str(plan).replace(")", ", offload='optimizer')")),
                           example_inputs=(tok,), cluster=c, profiles=profiles)
    assert 8 * PSI / 2 <= off.host_bytes <= 8 * PSI
    assert off.step_time_s - base.step_time_s >= off.host_bytes / c.host.bandwidth


# ---- real processes -------------------------------------------------------------------------

def _check_estimate_bytes(r, name, gpt_profiles, precision):
    """The cost model's host bytes per step for ``PLANS[name]`` equal what rank 0 (the first
    rank's share: the estimate's E) moved."""
    model, tok, profiles = gpt_profiles
    axes, plan = offload.PLANS[name]
    est = autopar.estimate(model, autopar.Mesh(**axes, virtual=True), plan, example_inputs=(tok,),
                           cluster=DGX, profiles=profiles)
    assert r["dp_index"] == 0 and est.host_bytes == sum(r["bytes"].values())


@pytest.mark.timeout(240)
def test_zero2_offload_matches_one_device_and_moves_the_formula_bytes(ranks, gpt_profiles):
    """ZeRO-2 in five buckets: parity, the census, the interleaved order of copies and
    collectives, and the cost model's host bytes equal to rank 0's."""
    reps = ranks(offload.offload_checks, 2, "zero2", timeout=200)
    for r in reps:
        _check_parity(r["parity"], "zero2")
        _check_census(r["census"], "zero2")
    _check_estimate_bytes(reps[0]["census"], "zero2", gpt_profiles, "fp32")


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
def test_mixed_precision_offload_keeps_fp32_masters_on_the_host(ranks, gpt_profiles, name):
    reps = ranks(offload.offload_checks, 2, name, timeout=300)
    for r in reps:
        _check_parity(r["parity"], name)
        _check_census(r["census"], name.split()[0], mixed=True)
    _check_estimate_bytes(reps[0]["census"], name, gpt_profiles, "mixed")


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
