"""Bytes each rank moves per step against the formulas, for one rank of a world simulated in this
process (``autopar.testing.fake_rank``: the collectives move no data, the counters count what
they would): data parallelism (ZeRO, Rajbhandari et al. section 7), a tensor-parallel layer
(Megatron's f and g, Korthikanti et al.'s sequence parallelism), a pipeline's point-to-point
transfers, and ZeRO-3 on a world of 256.

The counters count what a ring algorithm moves per rank, whatever the backend, so these hold
on real processes too (the slow tier's parity runs use the same runtime)."""
import math

import pytest
import torch

import autopar
from autopar.cost import dp_comm_elements, evaluate
from autopar.cost.cluster import get_cluster
from autopar.cost.estimate import Profiles, evaluate_plan
from autopar.models import GPTConfig, Llama, TinyGPT, gpt_batch, lm_loss
from autopar.testing import fake_rank

from jobs import data_parallel, pipeline, tensor_parallel
from jobs.common import MODES

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def volumes():
    """Per (world, rank): each model under each dp mode (the uneven MLP's last rank holds fewer rows)."""
    out = {}
    for world, rank in ((2, 1), (4, 3)):
        with fake_rank(world, rank):
            out[(world, rank)] = data_parallel.volume_all()
    return out


@pytest.mark.parametrize("world,rank", [(2, 1), (4, 3)])
@pytest.mark.parametrize("model", ["mlp", "mlp_nobias", "gpt"])
@pytest.mark.parametrize("mode", MODES)
def test_dp_bytes_per_step_match_the_formula(volumes, world, rank, model, mode):
    r = volumes[(world, rank)][(model, mode)]
    psi = r["psi"] if mode == "ddp" else r["psi_padded"]   # ZeRO moves padded equal shards
    formula = evaluate(dp_comm_elements(mode), Psi=psi, N=world) * 4
    if mode == "zero3":
        # forward gather + reduce-scatter of everything, backward re-gather of what backward reads
        exact = (2 * psi + r["psi_read_padded"]) * (world - 1) / world * 4
        assert r["total"] == pytest.approx(exact, rel=0, abs=1e-6)
        assert r["total"] <= formula
        if model == "mlp_nobias":   # every weight is read by backward: exactly 3Ψ(N−1)/N
            assert r["total"] == pytest.approx(formula, rel=0, abs=1e-6)
            assert r["psi_read_padded"] == r["psi_padded"]
    else:
        assert r["total"] == pytest.approx(formula, rel=0, abs=1e-6)
    kinds = {(k, p) for (_, k, p) in r["bytes"]}
    expected = {"ddp": {("all_reduce", "backward")},
                "zero1": {("reduce_scatter", "backward"), ("all_gather", "optimizer")},
                "zero2": {("reduce_scatter", "backward"), ("all_gather", "optimizer")},
                "zero3": {("all_gather", "forward"), ("all_gather", "backward"),
                          ("reduce_scatter", "backward")}}[mode]
    assert kinds == expected


@pytest.mark.parametrize("mode", MODES)
def test_gradient_buckets_launch_during_backward(volumes, mode):
    """Buckets go out as soon as their gradients are ready, before backward has finished
    (ZeRO-1 too, with the overlap pass), strictly in order."""
    r = volumes[(2, 1)][("gpt", mode)]
    events = r["events"]
    first_launch = events.index(("launch", 0))
    last_ready = max(i for i, e in enumerate(events) if e[0] == "ready")
    assert r["n_buckets"] > 3
    assert first_launch < last_ready
    launches = [e[1] for e in events if e[0] == "launch"]
    assert launches == sorted(launches)   # same order on every rank


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("t", [2, 4])
def test_tp_bytes_per_layer(t, sp):
    """One layer moves 4 collectives of b*s*h elements per step (2 forward, 2 backward):
    tp: 4 all-reduces, each 2(t-1)/t*b*s*h*4 bytes; tp+sp: 4 all-gathers and 4 reduce-scatters,
    each (t-1)/t*b*s*h*4 bytes; the same 8(t-1)/t*b*s*h*4 bytes. SP adds the gradient
    all-reduce of the 6 replicated norm/bias vectors of h the layer reads on a slice, and
    the backward all-gather of the 2 column inputs it keeps as sequence shards (as Megatron's
    sequence parallelism does, to divide their activation memory by t)."""
    with fake_rank(t, t - 1):
        r = tensor_parallel.tp_volume(sp)
    b, s, h = r["bsh"]
    per_layer = r[2]["total"] - r[1]["total"]
    expected = 8 * (t - 1) / t * b * s * h * 4
    if sp:
        expected += 6 * 2 * (t - 1) / t * h * 4 + 2 * (t - 1) / t * b * s * h * 4
    assert per_layer == pytest.approx(expected, rel=0, abs=1e-6)
    kinds = {k for (a, k, p) in r[2]["bytes"] if a == "tp"}
    assert kinds == ({"all_reduce"} if not sp else {"all_reduce", "all_gather", "reduce_scatter"})


def test_pipeline_point_to_point_bytes():
    """Each step sends the residual stream of every micro-batch forward across each cut, and its
    gradient backward: b·s·h·4 B per cut and direction (b the whole batch); the tied embedding's
    gradient goes each way once."""
    r = []
    for rank in (0, 1):
        with fake_rank(2, rank):
            r.append(pipeline.pp_bytes())
    residual = r[0]["residual_bytes"]
    assert r[0]["stage_sends"] == [residual // 4, 0]            # one micro-batch crosses the cut
    tied = 67 * 32 * 4                                         # wte.weight's gradient, each way
    assert r[0]["bytes"] == {("pp", "send", "forward"): residual, ("pp", "send", "tied"): tied}
    assert r[1]["bytes"] == {("pp", "send", "backward"): residual, ("pp", "send", "tied"): tied}
    assert r[0]["calls"][("pp", "send", "forward")] == 4


@pytest.mark.parametrize("axes,kw", [
    pytest.param({"pp": 4}, {"pp_schedule": "1f1b", "microbatches": 4}, id="pp4-1f1b"),
    pytest.param({"pp": 2}, {"pp_schedule": "interleaved", "microbatches": 2, "virtual_stages": 2}, id="pp2x2-interleaved"),
])
def test_pipeline_with_more_stages_than_layers_is_estimated_as_the_pass_cuts(axes, kw):
    """A 2-layer GPT on 4 stages: the pipeline pass ends stages inside layers, and the estimate
    (``evaluate_plan`` on the model's ``Profiles``) cuts where the pass cuts, so each rank's
    point-to-point bytes by the counters (activations and the tied embedding's gradient) equal
    the prediction's busiest rank, and the estimate carries no caveat about the cut."""
    c = GPTConfig(layers=2)
    x, t = gpt_batch(c, 8)
    plan = autopar.Plan(**kw)
    fp32 = get_cluster("dgx-h100")      # the fp32 model, priced in fp32 (no param_dtype in the plan)
    pred = evaluate_plan(Profiles(TinyGPT(c), (x,)), axes, plan, fp32, 8)
    world = axes["pp"]
    got, starts = [], None
    for rank in range(world):
        with fake_rank(world, rank):
            torch.manual_seed(0)
            dm = autopar.compile(TinyGPT(c), autopar.Mesh(**axes), example_inputs=(x,), plan=plan)
            dm.train_step((x,), t, lm_loss)
            dm.comm_stats.reset()
            dm.train_step((x,), t, lm_loss)
            got.append(dm.comm_stats.total(axis="pp"))
            starts = [s.nodes[0] for s in dm.ctx.stages]
    assert len(starts) == 4 and "layer_norm_1" in starts      # a stage starts inside blocks.0
    assert max(got) == pred.comm_bytes_by_axis["pp"], (got, pred.comm_bytes_by_axis)
    assert pred.caveats == []


def test_zero3_on_a_world_of_256():
    """Rank 255 of 256 trains a step: it holds no rows of most tables, and moves
    (2Ψ + Ψ_read_by_backward)(N−1)/N of padded bytes."""
    with fake_rank(256, 255):
        r = data_parallel.volume("zero3", "gpt", batch=512)
    n = 256
    assert r["total"] == pytest.approx((2 * r["psi_padded"] + r["psi_read_padded"]) * (n - 1) / n * 4, rel=0,
                                       abs=1e-6)
    assert r["psi_padded"] > r["psi"]       # 256 chunks pad most tensors


@pytest.mark.parametrize("axes,kw", [
    pytest.param({"tp": 2}, {"tp": True}, id="tp", marks=pytest.mark.slow),
    pytest.param({"tp": 2}, {"tp": True, "vocab_parallel": True}, id="tp-vocab-split", marks=pytest.mark.slow),
    pytest.param({"tp": 2}, {"tp": True, "vocab_parallel": False}, id="tp-vocab-whole", marks=pytest.mark.slow),
    pytest.param({"tp": 2}, {"tp": True, "sp": True}, id="tp+sp"),
    pytest.param({"dp": 2}, {"dp": "zero3"}, id="zero3"),
    pytest.param({"dp": 2, "tp": 2}, {"dp": "zero3", "tp": True, "sp": True}, id="zero3+tp+sp",
                 marks=pytest.mark.slow),
])
def test_llama_bytes_match_the_cost_model(axes, kw):
    """The test suite's Llama (separate q, k, v and gate, up products; RMSNorm weights that
    multiply) on the last rank of a fake world: each axis's bytes per step by the counters
    equal the cost model's prediction (``evaluate_plan`` on the model's profile, the compile's
    default LM-head policy on both sides, or the plan's ``vocab_parallel``). Sequence parallelism gathers each sequence-sharded
    input once more in backward however many products read it (q, k and v share one gather);
    ZeRO-3 gathers again in backward every parameter backward reads, the norms' too."""
    world = math.prod(axes.values())
    torch.manual_seed(0)
    x, t = gpt_batch(Llama().config, 8)
    fp32 = get_cluster("dgx-h100")      # the fp32 model, priced in fp32 (no param_dtype in the plan)
    pred = evaluate_plan(Profiles(Llama(), (x,)), axes, autopar.Plan(**kw), fp32, 8)
    with fake_rank(world, world - 1):
        dm = autopar.compile(Llama(), autopar.Mesh(**axes), example_inputs=(x,), plan=autopar.Plan(**kw))
        opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
        lx, lt = dm.shard_batch((x,)), dm.shard_batch(t)
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            lm_loss(dm(*lx), lt).backward()
            opt.step()
            if _ == 0:
                dm.comm_stats.reset()
        got = {a: dm.comm_stats.total(axis=a) for a in axes}
    assert got == {a: pred.comm_bytes_by_axis.get(a, 0.0) for a in axes}
