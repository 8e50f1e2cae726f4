"""The cost model prices the precision the plan runs in: ``Plan(param_dtype=, reduce_dtype=,
master_dtype=)`` or, without them, the model's own dtype; never the cluster's.

Each figure is checked against a formula written here, and the bytes against what the runtime
moves (``autopar.testing.fake_rank``: one rank of a world in this process, the collectives
counting what they would move). The model states are those the runtime keeps
(``tests/test_mixed.py`` measures them after a step): under ``param_dtype`` the optimizer owns
fp32 masters with Adam's m and v (12 B), gradients land in the master's dtype (4 B), and a
persistent bf16 copy exists only as ZeRO-1/2's replicas, so ZeRO-3 keeps (0 + 4 + 12)·Ψ/N
where ZeRO's paper counts (2 + 2 + 12)·Ψ/N.

Peaks (dense, datasheets): H100 SXM bf16 989 TFLOP/s, TF32 494.7, fp32 (no tensor cores) 66.9.
"""
import dataclasses

import pytest
import torch

import autopar
from autopar.cost.cluster import get_cluster
from autopar.cost.estimate import Profiles, evaluate_plan
from autopar.models import GPTConfig, TinyGPT, gpt_batch, lm_loss
from autopar.testing import fake_rank

pytestmark = pytest.mark.timeout(300)

BF16 = torch.bfloat16
CFG = GPTConfig(vocab=64, seq=16, dim=32, heads=4, layers=2, max_seq=16)   # every row count divides by 4
N = 4
H100 = get_cluster("dgx-h100")
PLANS = {"fp32": {}, "bf16": {"param_dtype": BF16}, "bf16 sums": {"param_dtype": BF16, "reduce_dtype": BF16}}


@pytest.fixture(scope="module")
def gpt():
    x, t = gpt_batch(CFG, 8)
    model = TinyGPT(CFG)
    psi = sum(p.numel() for p in model.parameters())
    assert all(p.shape[0] % N == 0 for p in model.parameters())     # the shards need no padding: Ψ/N each
    return model, x, t, psi, Profiles(model, (x,), cluster=H100)


def _estimate(gpt, axes, **plan):
    model, x, _, _, profiles = gpt
    return evaluate_plan(profiles, axes, autopar.Plan(**plan), H100, 8)


def test_zero3_gathers_in_param_dtype_and_sums_in_reduce_dtype(gpt):
    """ZeRO-3 over N = 4 (every parameter gathered in forward and again in backward, every
    gradient reduce-scattered): (2·c + r)·Ψ·(N−1)/N bytes a rank, c the compute copy's bytes and
    r the sums': fp32 (4, 4); ``param_dtype=bf16`` halves both gathers (2, 4: the sums stay in
    the fp32 masters' dtype); ``reduce_dtype=bf16`` then halves the reduce-scatter (2, 2). The
    runtime's counters of one step move the same bytes, in those dtypes; and the three plans
    differ in step time and memory too."""
    model, x, t, psi, _ = gpt
    ring = (N - 1) / N
    seen = {}
    for name, (c, r) in (("fp32", (4, 4)), ("bf16", (2, 4)), ("bf16 sums", (2, 2))):
        plan = autopar.Plan(dp="zero3", **PLANS[name])
        e = _estimate(gpt, {"dp": N}, dp="zero3", **PLANS[name])
        assert e.comm_bytes_by_axis["dp"] == (2 * c + r) * psi * ring
        with fake_rank(N, 0):
            dm = autopar.compile(TinyGPT(CFG), autopar.Mesh(dp=N), example_inputs=(x,), plan=plan)
            opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
            lx, lt = dm.shard_batch((x,)), dm.shard_batch(t)
            for step in range(2):
                opt.zero_grad(set_to_none=True)
                lm_loss(dm(*lx), lt).backward()
                opt.step()
                if step == 0:
                    dm.comm_stats.reset()
            moved = {(kind, phase, dtype): b for (axis, kind, phase, dtype), b in dm.comm_stats.dtype_bytes.items()
                     if axis == "dp" and b}
        names = {4: "float32", 2: "bfloat16"}
        assert moved == {("all_gather", "forward", names[c]): c * psi * ring,
                         ("all_gather", "backward", names[c]): c * psi * ring,
                         ("reduce_scatter", "backward", names[r]): r * psi * ring}
        seen[name] = e
    fp32, bf16, sums = seen["fp32"], seen["bf16"], seen["bf16 sums"]
    assert len({e.step_time_s for e in seen.values()}) == 3 and len({e.memory_bytes for e in seen.values()}) == 3
    assert fp32.memory_bytes > bf16.memory_bytes > sums.memory_bytes


@pytest.mark.parametrize("mode", ["ddp", "zero1", "zero2", "zero3"])
def test_model_states_are_what_the_runtime_keeps_in_the_plans_precision(gpt, mode):
    """Per rank, Ψ parameters over N = 4, Adam: fp32, (p, g, K) = (4, 4, 8): ddp 16Ψ, ZeRO-1
    8Ψ + 8Ψ/N, ZeRO-2 4Ψ + 12Ψ/N, ZeRO-3 16Ψ/N. bf16 compute with fp32 masters: no persistent
    bf16 copy but ZeRO-1/2's replicas (2Ψ), gradients landed in fp32 (ZeRO-1's persistent
    buffer in the sums' dtype), masters + m + v 12 B: ddp (4 + 12)Ψ, ZeRO-1 (2 + 4)Ψ + 12Ψ/N,
    ZeRO-2 2Ψ + (4 + 12)Ψ/N, ZeRO-3 (4 + 12)Ψ/N; with bf16 sums ZeRO-1's buffer is 2 B:
    (2 + 2)Ψ + 12Ψ/N. A bf16 model without ``param_dtype`` trains in bf16 alone: (2 + 2 + 4)Ψ
    under ddp."""
    _, _, _, psi, _ = gpt
    want = {
        "fp32": {"ddp": 16 * psi, "zero1": 8 * psi + 8 * psi / N, "zero2": 4 * psi + 12 * psi / N,
                 "zero3": 16 * psi / N},
        "bf16": {"ddp": 16 * psi, "zero1": 6 * psi + 12 * psi / N, "zero2": 2 * psi + 16 * psi / N,
                 "zero3": 16 * psi / N},
        "bf16 sums": {"ddp": 16 * psi, "zero1": 4 * psi + 12 * psi / N, "zero2": 2 * psi + 16 * psi / N,
                      "zero3": 16 * psi / N},
    }
    for name, plan in PLANS.items():
        e = _estimate(gpt, {"dp": N}, dp=mode, **plan)
        assert e.memory_breakdown["model states"] == want[name][mode], name
    if mode == "ddp":
        x = gpt[1]
        bf16_model = Profiles(TinyGPT(CFG).to(BF16), (x,), cluster=H100)
        e = evaluate_plan(bf16_model, {"dp": N}, autopar.Plan(), H100, 8)
        assert e.memory_breakdown["model states"] == 8 * psi


def test_an_fp32_plan_on_an_h100_runs_its_matmuls_at_tf32s_rate(gpt):
    """On one H100 (no communication, no host overheads on a GPU preset) the forward is the
    roofline of each layer group: its matmul and attention FLOPs at the peak of the dtype they
    run in times the matmul efficiency, its other bytes at 3.35 TB/s times 0.84. The fp32 plan's
    matmuls run at the TF32 tensor cores' 494.7 TFLOP/s; the bf16 plan's (its profile is of the
    bf16 program) at 989; with TF32 off (``tf32_flops=None``, PyTorch's default precision) fp32
    runs at the CUDA cores' 66.9."""
    _, _, _, _, profiles = gpt
    eff = H100.device.matmul_efficiency
    no_tf32 = H100.with_(device=dataclasses.replace(H100.device, tf32_flops=None))
    for cluster, dtype, peak in ((H100, None, 494.7e12), (H100, BF16, 989e12), (no_tf32, None, 66.9e12)):
        prof = profiles.get(1, False, None, dtype)
        assert {g.matmul_dtype for g in prof.groups if g.dense_flops} == {dtype or torch.float32}
        e = evaluate_plan(profiles, {"dp": 1}, autopar.Plan(param_dtype=dtype), cluster, 8)
        roofline = sum((g.dense_flops + g.attention_flops) / (peak * eff) + g.pointwise_bytes / (3.35e12 * 0.84)
                       for g in prof.groups)
        assert e.time_breakdown["forward (busiest stage)"] == pytest.approx(roofline, rel=1e-12)


def test_activations_and_tensor_parallel_collectives_are_in_the_compute_dtype(gpt):
    """tp = 2 without sp: Megatron's f and g, two all-reduces of the b·s·h activations forward
    and two backward per layer, 8·b·s·h·(t−1)/t elements of the compute dtype a layer (4 B in
    fp32, 2 B in bf16); the activations kept for backward halve with them but for what stays in
    fp32 (norms' per-row statistics, the loss's input under autocast)."""
    b, s, h, t, layers = 8, CFG.seq, CFG.dim, 2, CFG.layers
    fp32 = _estimate(gpt, {"tp": t}, tp=True)
    bf16 = _estimate(gpt, {"tp": t}, tp=True, param_dtype=BF16)
    for e, size in ((fp32, 4), (bf16, 2)):
        assert e.comm_bytes_by_axis["tp"] == layers * 8 * b * s * h * (t - 1) / t * size
    ratio = bf16.memory_breakdown["activations"] / fp32.memory_breakdown["activations"]
    assert 0.5 <= ratio < 0.53, ratio


def test_the_planner_plans_the_precision_it_is_asked_for(gpt):
    """``autopar.plan(..., param_dtype=torch.bfloat16)`` searches mixed-precision plans: every
    candidate it reports carries the precision, its figures are the estimate of that plan, and
    they are not the fp32 search's. A ``base`` plan's other fields (the sums' dtype, the
    bucket size) ride along the same way; a ``reduce_dtype`` without ``param_dtype`` is refused
    as a Plan refuses it."""
    model, x, _, _, profiles = gpt
    kw = dict(example_inputs=(x,), cluster=H100, profiles=profiles, top=5)
    mixed = autopar.plan(model, N, param_dtype=BF16, **kw)
    plain = autopar.plan(model, N, **kw)
    assert mixed.plan.param_dtype == BF16 and all(c.plan.param_dtype == BF16 for c in mixed.candidates)
    assert all(c.plan.param_dtype is None for c in plain.candidates)
    assert autopar.Plan.parse(str(mixed.plan)) == mixed.plan
    again = evaluate_plan(profiles, mixed.candidates[0].axes, mixed.plan, H100, 8, recompute=mixed.recompute)
    assert (mixed.step_time_s, mixed.memory_bytes) == (again.step_time_s, again.memory_bytes)
    assert mixed.memory_bytes < plain.memory_bytes
    base = autopar.Plan(param_dtype=BF16, reduce_dtype=BF16, bucket_bytes=1 << 16)
    kept = autopar.plan(model, N, base=base, **kw)
    assert all((c.plan.param_dtype, c.plan.reduce_dtype, c.plan.bucket_bytes) == (BF16, BF16, 1 << 16)
               for c in kept.candidates)
    with pytest.raises(ValueError, match="reduce_dtype=bfloat16.*needs param_dtype"):
        autopar.plan(model, N, reduce_dtype=BF16, **kw)


def test_plan_auto_keeps_the_fields_of_its_base(gpt):
    """``compile(plan="auto", base=...)`` and ``estimate(plan="auto", base=...)`` plan the run the
    base asks for: the chosen plan carries its precision (and the module runs it: fp32 masters,
    bf16 compute); a base beside a given plan is refused, since that plan carries every field."""
    model, x, _, _, profiles = gpt
    base = autopar.Plan(param_dtype=BF16)
    est = autopar.estimate(model, autopar.Mesh(dp=N, virtual=True), "auto", example_inputs=(x,), cluster=H100,
                           profiles=profiles, base=base)
    assert est.plan.param_dtype == BF16
    with fake_rank(2):
        dm = autopar.compile(TinyGPT(CFG), autopar.Mesh(dp=2), example_inputs=(x,), plan="auto", cluster=H100,
                             base=base)
    assert dm.plan.param_dtype == BF16 and dm.plan.master_dtype == torch.float32
    with pytest.raises(ValueError, match=r"base=Plan\(.*param_dtype='bfloat16'.*\) is for plan='auto'"):
        autopar.compile(TinyGPT(CFG), autopar.Mesh(dp=1, virtual=True), example_inputs=(x,), plan=autopar.Plan(),
                        base=base)
