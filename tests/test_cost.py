"""The cost model's formulas, and its predictions against published training runs.

Sources (each test names its own):
- Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
  SC'20: figure 1 (7.5B parameters, N_d = 64, mixed-precision Adam, K = 12) and table 1.
- Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", MLSys
  2023: table 2 (activation bytes per transformer layer).
- Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", SC'21: table 1 (GPT models on DGX A100 80GB nodes of NVIDIA's Selene: tensor-,
  pipeline-parallel sizes, GPUs, batch, achieved teraFLOP/s per GPU), equation 3 (the FLOPs
  per iteration that table counts, with activation recomputation), section 2.2 (bubbles).
"""

import dataclasses

import pytest
import sympy as sp
import torch

import autopar
from autopar.sizes import ring_bytes
from autopar.cost.comm import ALGORITHMS, NBYTES, P, bytes_per_rank_expr, collective_time
from autopar.cost.cluster import PRESETS, Link, get_cluster
from autopar.cost.formulas import N, PSI, evaluate
from autopar.cost.memory import MIXED_PRECISION, activation_bytes_per_layer, model_state_bytes
from autopar.sizes import inflight_microbatches
from autopar.cost.compute import group_time
from autopar.cost.estimate import Profiles, evaluate_plan, saved_bytes
from autopar.cost.pipeline import closed_form_pipeline
from autopar.models import GPTConfig, TinyGPT, gpt_batch, named
from autopar.schedule import build_schedule, simulate

pytestmark = pytest.mark.timeout(300)


# ---- compute -----------------------------------------------------------------------------------------

def test_group_time_sums_the_op_classes_on_the_roofline():
    """A layer's forward time: its matmuls at peak x matmul efficiency, its attention kernel at
    peak x attention efficiency plus a setup per (row, head) slice, the other ops' bytes at
    bandwidth x memory efficiency and a dispatch per op, summed (not the max of FLOPs and bytes:
    the classes run one after another). The peak is that of the dtype the matmuls run in: this
    fp32 model's at the A100's TF32 tensor-core rate (156 TFLOP/s, datasheet), not bf16's 312."""
    import dataclasses
    cfg = GPTConfig(vocab=67, seq=32, dim=64, heads=4, layers=2)
    x, _ = gpt_batch(cfg, 8)
    g = next(g for g in Profiles(TinyGPT(cfg), (x,)).base.groups if g.name == "blocks.0")
    h, s, b = cfg.dim, cfg.seq, 8
    assert g.dense_flops == 2 * b * s * (4 * h * h + 2 * 4 * h * h)    # q, k, v, proj; fc, out
    assert g.attention_flops == 4 * b * s * s * h and g.attention_heads == b * cfg.heads
    assert g.dense_flops + g.attention_flops < g.flops and 0 < g.pointwise_bytes < g.bytes_moved
    c = get_cluster("dgx-a100-80gb")
    d = c.device
    assert g.matmul_dtype == torch.float32
    peak = 156e12
    base = (g.dense_flops / (peak * d.matmul_efficiency) + g.attention_flops / (peak * d.matmul_efficiency)
            + g.pointwise_bytes / (d.mem_bandwidth * d.memory_efficiency))
    assert group_time(g, c) == pytest.approx(base) and group_time(g, c, 2.0) == pytest.approx(2 * base)
    slow = c.with_(device=dataclasses.replace(d, attention_efficiency=0.3, attention_overhead=1e-6, op_overhead=2e-6))
    extra = g.attention_flops / (peak * 0.3) - g.attention_flops / (peak * d.matmul_efficiency)
    assert group_time(g, slow) == pytest.approx(base + extra + g.attention_heads * 1e-6 + g.ops * 2e-6)


def test_backward_is_twice_the_arithmetic_and_the_measured_ratio_of_the_dispatch():
    """A group's backward: its forward's arithmetic twice (input and weight gradients) but its
    ops' dispatch ``backward_op_ratio`` times the forward's (the local CPU measures about 1.2:
    a backward runs gradient kernels, not every forward op twice); with the ratio at 2 (GPU
    presets, whose dispatch is 0 anyway) the backward is the forward twice."""
    from autopar.cost.estimate import group_passes
    cfg = GPTConfig(vocab=67, seq=32, dim=64, heads=4, layers=2)
    x, _ = gpt_batch(cfg, 8)
    g = next(g for g in Profiles(TinyGPT(cfg), (x,)).base.groups if g.name == "blocks.0")
    base = get_cluster("dgx-a100-80gb")
    for ratio in (1.2, 2.0):
        c = base.with_(device=dataclasses.replace(base.device, op_overhead=5e-6, backward_op_ratio=ratio))
        f, b = group_passes(g, c, 1, c.intra, "none", 1.5)[:2]
        arithmetic = group_time(g, c) - g.ops * 5e-6
        assert f == pytest.approx(1.5 * (arithmetic + g.ops * 5e-6))
        assert b == pytest.approx(1.5 * (2 * arithmetic + ratio * g.ops * 5e-6))
    assert b == pytest.approx(2 * f)


def test_ops_are_weighed_by_their_measured_dispatch():
    """With ``Device.op_weights``, a group's dispatch is each op's count times its weight (its
    forward weight in forward, its gradient's in backward), an op the table lacks at its
    class's entry (views at ``<view>``, others at ``<op>``), and the rest of the roofline
    unchanged; without a table every op weighs 1. Written out here from the group's op names."""
    from autopar.cost.compute import dispatch_ops
    from autopar.cost.estimate import group_passes
    from autopar.ops import VIEWS
    cfg = GPTConfig(vocab=67, seq=32, dim=64, heads=4, layers=2)
    x, _ = gpt_batch(cfg, 8)
    g = next(g for g in Profiles(TinyGPT(cfg), (x,)).base.groups if g.name == "blocks.0")
    assert sum(g.op_names.values()) == g.ops and g.op_names["linear"] == 4 and g.weight_matmuls == 4
    table = (("linear", 2.0, 3.0), ("transpose", 0.25, 0.5), ("<view>", 0.5, 0.75), ("<op>", 1.5, 1.25))
    fw = {"linear": 2.0, "transpose": 0.25}
    bw = {"linear": 3.0, "transpose": 0.5}

    def by_hand(w, view, other):
        return sum(k * w.get(n, view if n in VIEWS else other) for n, k in g.op_names.items())

    base = get_cluster("dgx-a100-80gb")
    plain = base.with_(device=dataclasses.replace(base.device, op_overhead=5e-6, backward_op_ratio=1.2))
    weighed = plain.with_(device=dataclasses.replace(plain.device, op_weights=table))
    assert dispatch_ops(g, plain.device) == g.ops
    assert dispatch_ops(g, weighed.device) == pytest.approx(by_hand(fw, 0.5, 1.5))
    assert dispatch_ops(g, weighed.device, backward=True) == pytest.approx(by_hand(bw, 0.75, 1.25))
    arithmetic = group_time(g, plain) - g.ops * 5e-6
    assert group_time(g, weighed) == pytest.approx(arithmetic + by_hand(fw, 0.5, 1.5) * 5e-6)
    f, b = group_passes(g, weighed, 1, weighed.intra, "none", 1.0)[:2]
    assert f == pytest.approx(arithmetic + by_hand(fw, 0.5, 1.5) * 5e-6)
    assert b == pytest.approx(2 * arithmetic + 1.2 * by_hand(bw, 0.75, 1.25) * 5e-6)


def test_op_weights_are_relative_to_the_probe_mix_and_a_view_weighs_less_than_a_linear():
    """The measured table (``cost.calibration.op_weights``, timed here on this machine) weighs
    a mix of ops so that the mix it is relative to counts what it counts, forward and backward;
    a view, which only makes an alias, weighs less than a linear layer's matmul (the view
    class's median, what an unsampled view is charged, and a transpose; the ``view`` sample,
    ``x.view(x.shape)``, also reads the shape, and its forward at 2 x 4 x 8 came within 10% of a
    linear's on a busy machine); and every sampled op and the two class entries are in it."""
    from autopar.cost.calibration.op_weights import SAMPLES, measure_op_weights
    from autopar.cost.compute import OTHER_OP, VIEW_OP, dispatch_ops
    from autopar.cost.profile import GroupCost
    mix = {"linear": 4, "layer_norm": 2, "view": 3, "transpose": 4, "add": 2, "gelu": 1,
           "scaled_dot_product_attention": 1}
    table = measure_op_weights(mix, rounds=5)
    assert {n for n, *_ in table} == set(SAMPLES) | {VIEW_OP, OTHER_OP}
    w = {n: (f, b) for n, f, b in table}
    assert all(f >= 0 and b >= 0 for f, b in w.values())
    d = dataclasses.replace(get_cluster("dgx-a100-80gb").device, op_weights=table)
    g = GroupCost("mix", ops=sum(mix.values()), op_names=mix)
    assert dispatch_ops(g, d) == pytest.approx(g.ops, rel=1e-3)
    assert dispatch_ops(g, d, backward=True) == pytest.approx(g.ops, rel=1e-3)
    assert w[VIEW_OP][0] < w["linear"][0] and w["transpose"][0] < w["linear"][0]
    assert w["transpose"][1] < w["linear"][1]


# ---- communication ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_reduce"])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_bytes_per_rank_formula_is_what_the_counters_record(kind, p):
    expr = bytes_per_rank_expr(kind)
    assert float(expr.subs({NBYTES: 1000.0, P: p})) == pytest.approx(ring_bytes(kind, 1000.0, p))


def test_every_formula_is_symbolic_in_alpha_beta():
    for kind, algos in ALGORITHMS.items():
        for name, expr in algos.items():
            assert {str(s) for s in expr.free_symbols} <= {"alpha", "beta", "n", "p"}, (kind, name)


def test_alpha_beta_times():
    nvlink = Link("nvlink", 300e9, 5e-6)
    # ring all-reduce of 1 GB over 8: 2·7·α + 2·7/8·1e9/300e9
    assert collective_time("all_reduce", 1e9, 8, nvlink, "ring") == pytest.approx(14 * 5e-6 + 1.75e9 / 300e9)
    # small messages: the tree's log2(p) latency beats the ring's p - 1 (auto picks the faster)
    small = collective_time("all_reduce", 1024, 64, nvlink)
    assert small == pytest.approx(min(collective_time("all_reduce", 1024, 64, nvlink, a)
                                      for a in ("ring", "tree", "rabenseifner")))
    assert small < collective_time("all_reduce", 1024, 64, nvlink, "ring")
    assert collective_time("p2p", 1e6, 2, nvlink) == pytest.approx(5e-6 + 1e6 / 300e9)
    assert collective_time("all_gather", 1e6, 1, nvlink) == 0.0


def test_a_tied_table_costs_one_exchange_after_the_pipeline():
    """The two stages holding a tied embedding / LM head sum its gradients by one exchange, each
    posting its send and receive together (``_sum_tied_grads``): one point-to-point transfer of
    the table's gradient (the fp32 model's: 4 B an element) on the pipeline's link, alpha +
    bytes / bandwidth, not two."""
    c = GPTConfig(vocab=64, seq=8, dim=32, heads=2, layers=2, max_seq=8)
    x, _ = gpt_batch(c, 8)
    cluster = get_cluster("dgx-a100-80gb")
    e = evaluate_plan(Profiles(TinyGPT(c), (x,)), {"pp": 2}, autopar.Plan(pp_schedule="gpipe", microbatches=2),
                      cluster, 8)
    tied = [end - start for _, _, label, start, end in e.timeline if label == "tied gradients"]
    assert tied and len(set(tied)) == 1, tied
    link = cluster.intra                      # 2 GPUs of one node
    assert tied[0] == pytest.approx(link.latency + 64 * 32 * 4 / link.bandwidth)


def test_ranks_sharing_cores_exchange_after_the_pipeline_on_the_uncontended_link():
    """Ranks sharing cores (the local preset, world above the cores): inside the schedule a
    pipeline's messages ride the ``shared`` link, measured among ranks that all computed just
    before; past it the ranks wait rather than compute, so the tied table's exchange and the
    loss broadcast (a binomial tree over the p ranks) ride the link measured with a core per
    rank: alpha + bytes / bandwidth each, written here on that link, not on the shared one."""
    c = GPTConfig(vocab=64, seq=8, dim=32, heads=2, layers=4, max_seq=8)
    x, _ = gpt_batch(c, 8)
    own = Link("own-core", 1e9, 2e-4)
    base = PRESETS["dgx-h100"]
    cluster = base.with_(name="local", gpus_per_node=2, intra=own, inter=own, contention=((2, 1.0), (4, 2.0)),
                         shared=Link("shared", 5e8, 3e-3))
    e = evaluate_plan(Profiles(TinyGPT(c), (x,)), {"pp": 4}, autopar.Plan(pp_schedule="gpipe", microbatches=2),
                      cluster, 8)
    spans = {label: end - start for _, _, label, start, end in e.timeline if label in ("tied gradients",
                                                                                        "loss broadcast")}
    assert spans["tied gradients"] == pytest.approx(own.latency + 64 * 32 * 4 / own.bandwidth)   # fp32
    assert spans["loss broadcast"] == pytest.approx(2 * (own.latency + 4 / own.bandwidth))


def test_a_pipeline_action_on_a_time_shared_core_pays_its_stages_cache_refill():
    """pp = 2 x dp = 2 on 4 processes of 2 cores places a stage's two replicas on one core: each
    F action reads its stage's parameters and its micro-batch's saved activations again, and
    writes back as many bytes the other process left dirty, 2 x (parameters + activations) /
    bandwidth, and shares the core with its replica (half its rate). pp = 2 alone on 2
    processes keeps a core per rank and pays nothing. Both plans at the same micro-batch (2
    sequences), the first forward of the fill, when no other stage computes."""
    c = GPTConfig(vocab=64, seq=8, dim=32, heads=2, layers=2, max_seq=8)
    own = Link("own-core", 1e9, 2e-4)
    cluster = PRESETS["dgx-h100"].with_(name="local", gpus_per_node=2, intra=own, inter=own,
                                        contention=((2, 1.0), (4, 2.0)), shared=Link("shared", 5e8, 3e-3))
    first = {}
    model = TinyGPT(c)
    profiles = Profiles(model, (gpt_batch(c, 8)[0],))
    for world, axes, batch in ((2, {"pp": 2}, 8), (4, {"pp": 2, "dp": 2}, 16)):
        e = evaluate_plan(profiles, axes, autopar.Plan(pp_schedule="gpipe", microbatches=4), cluster, batch)
        first[world] = next(end - start for r, lane, name, start, end in e.timeline if r == 0 and name == "0F0")
        shown = [f for f in e.formulas if f[0] == "cache refill on a time-shared core"]
        assert bool(shown) == (world == 4), e.formulas
    # stage 0: the embeddings and the first layer (the even split of two layers over two stages)
    params = sum(p.numel() for name, p in model.named_parameters() if not name.startswith(("blocks.1", "ln_f", "head")))
    prof = profiles.get(1, False, False)
    saved = sum(saved_bytes(g.scaled(2 / prof.rows), "none") for g in prof.groups if g.name in ("pre", "blocks.0"))
    d = cluster.device
    refill = 2 * (params * 4 + saved) / (d.mem_bandwidth * d.memory_efficiency)     # fp32 parameters
    assert first[4] == pytest.approx(2 * (first[2] + refill), rel=1e-9)


# ---- memory: published figures ------------------------------------------------------------------------

@pytest.mark.parametrize("mode,published_gb", [("ddp", 120), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.9)])
def test_zero_figure_1_memory(mode, published_gb):
    """ZeRO (SC'20) figure 1: 7.5B parameters on 64 GPUs, mixed precision Adam (K = 12):
    baseline 120 GB, P_os 31.4 GB, P_os+g 16.6 GB, P_os+g+p 1.9 GB per device."""
    got = evaluate(model_state_bytes(mode, MIXED_PRECISION), Psi=7.5e9, N=64) / 1e9
    assert got == pytest.approx(published_gb, rel=0.05)


@pytest.mark.parametrize("psi,nd,published", [(7.5e9, 1024, (120, 30.1, 15.1, 0.12)),
                                              (128e9, 64, (2048, 536, 284, 32)),
                                              (1e12, 1024, (16000, 4011.7, 2013.7, 15.6))])
def test_zero_table_1_memory(psi, nd, published):
    """ZeRO (SC'20) table 1, per-device GB of model states by stage and DP degree."""
    for mode, gb in zip(("ddp", "zero1", "zero2", "zero3"), published):
        assert evaluate(model_state_bytes(mode, MIXED_PRECISION), Psi=psi, N=nd) / 1e9 == pytest.approx(gb, rel=0.05)


def test_memory_formulas_are_symbolic():
    assert model_state_bytes("zero2", MIXED_PRECISION) == 2 * PSI + 14 * PSI / N
    s, b, h, a, t = sp.symbols("s b h a t", positive=True)
    assert sp.simplify(activation_bytes_per_layer() - s * b * h * (34 + 5 * a * s / h)) == 0
    assert sp.simplify(activation_bytes_per_layer(tp=True) - s * b * h * (10 + 24 / t + 5 * a * s / (h * t))) == 0
    assert sp.simplify(activation_bytes_per_layer(recompute="full") - 2 * s * b * h) == 0
    assert sp.simplify(activation_bytes_per_layer(flash=True) - 34 * s * b * h) == 0


@pytest.fixture(scope="module")
def gpt3_one_layer():
    model, example = named("gpt3-175b", layers=1)
    return Profiles(model, example, flash=False), Profiles(model, example, flash=True)


@pytest.mark.parametrize("tp,sp_,recompute,formula", [
    (1, False, "none", lambda s, b, h, a, t: s * b * h * (34 + 5 * a * s / h)),
    (8, False, "none", lambda s, b, h, a, t: s * b * h * (10 + 24 / t + 5 * a * s / (h * t))),
    (8, True, "none", lambda s, b, h, a, t: s * b * h / t * (34 + 5 * a * s / h)),
    (8, False, "selective", lambda s, b, h, a, t: s * b * h * (10 + 24 / t)),
    (8, True, "selective", lambda s, b, h, a, t: 34 * s * b * h / t),
    (1, False, "full", lambda s, b, h, a, t: 2 * s * b * h),
])
def test_activations_of_the_compiled_graph_match_korthikanti_table_2(gpt3_one_layer, tp, sp_, recompute, formula):
    """Korthikanti et al. table 2 at GPT-3 175B's layer (s=2048, h=12288, a=96, 16-bit, dropout):
    the bytes autopar's profile finds saved for backward in the captured graph of one layer
    (by the saved-tensor table of autograd's formulas, after the tp / sp passes) are the
    published formula, within 5%."""
    math_attention, _ = gpt3_one_layer
    prof = math_attention.get(tp, sp_)
    layer = prof.layers[0]
    b = prof.rows
    expected = formula(2048, b, 12288, 96, tp)
    assert saved_bytes(layer, recompute) == pytest.approx(expected, rel=0.05)


def test_flash_attention_removes_the_quadratic_term(gpt3_one_layer):
    _, flash = gpt3_one_layer
    layer = flash.base.layers[0]
    assert layer.saved_quadratic == 0
    assert layer.saved == pytest.approx(34 * 2048 * flash.base.rows * 12288, rel=0.05)


# ---- pipeline bubbles ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,p,m,v,published", [
    ("gpipe", 4, 8, 1, 3 / 11), ("1f1b", 8, 32, 1, 7 / 39), ("interleaved", 4, 8, 2, 3 / 19),
    ("zero_bubble", 4, 8, 1, 3 / 27)])
def test_closed_form_bubbles_equal_the_replayed_schedule(name, p, m, v, published):
    """Narayanan et al. section 2.2: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v·m+p-1)
    interleaved; Qi et al. (ZB-H1) (p-1)/(3m+p-1) with F = B = W: the closed forms the planner
    scores with equal the event-time replay of the real schedules."""
    split = name == "zero_bubble"
    f, b, w = (1.0, 1.0, 1.0) if split else (1.0, 2.0, 0.0)
    fb = [v * (f + b + w)] * p if split else [v * (f + b)] * p
    total = closed_form_pipeline(name, m, v, fb, [v * w] * p)
    tl = simulate(build_schedule(name, p, m, v))
    assert total == pytest.approx(tl.makespan)
    assert 1 - m * fb[0] / total == pytest.approx(published)
    assert tl.bubble_fraction() == pytest.approx(published)


def test_inflight_microbatches():
    assert inflight_microbatches("gpipe", 4, 8) == 8
    assert inflight_microbatches("1f1b", 4, 8, stage=0) == 4
    assert inflight_microbatches("1f1b", 4, 8, stage=3) == 1
    assert inflight_microbatches("interleaved", 4, 16, v=2) == pytest.approx(4 * (1 + 3 / 8))


# ---- published training runs -----------------------------------------------------------------------------
# autopar/published_runs.py: every row of Narayanan et al. table 1, Korthikanti et al. table 4 and
# torchtitan's Llama 3.1 H100 figures, each configured as published, and the calibration run
# (BLOOM-176B) that the A100 preset's matmul efficiency is fitted on.

from autopar import published_runs as PUB  # noqa: E402

NARAYANAN_TABLE_1 = [(r.model, r.axes["tp"], r.axes["pp"], r.gpus, r.global_batch, r.published)
                     for r in PUB.NARAYANAN_TABLE_1]
_FAST_ROWS = ("39.1B",)


def _published_setup(name, t, p, gpus, batch):
    run = next(r for r in PUB.NARAYANAN_TABLE_1 if r.model == name)
    profiles = Profiles(*named(name, dtype=torch.float32), flash=False, cluster=get_cluster(run.cluster))
    return profiles, run.axes, autopar.Plan(**run.plan)


@pytest.mark.parametrize("run", [pytest.param(r, id=r.label, marks=() if r.label in _FAST_ROWS else pytest.mark.slow)
                                 for r in PUB.VALIDATION])
def test_published_run_within_goal_or_a_named_outlier(run):
    """Each published run estimated as it ran: step time within 15% of the published one
    (through the row's own unit), or the row is a named outlier (``PUB.OUTLIERS``, with what
    the model does not represent) and really is outside: the list cannot go stale."""
    est = PUB.estimate(run)
    ratio = PUB.speed_ratio(run, est.step_time_s)
    if run.label in PUB.OUTLIERS:
        assert abs(ratio - 1) > PUB.GOAL, f"{run.label}: {ratio:.3f} is now within the goal; drop it from OUTLIERS"
    else:
        assert abs(ratio - 1) <= PUB.GOAL, f"{run.label}: predicted / published speed {ratio:.3f}"


def test_published_runs_are_fp32_models_under_mixed_precision_plans():
    """Every published row and the calibration are estimated as a user would hand them to
    autopar: the model in fp32, mixed precision asked of the plan (bf16 compute; Megatron's
    16-bit gradient all-reduce as ``reduce_dtype``); the profile the estimate prices is then
    the bf16 program's (2 B parameters), not the fp32 model's (4 B)."""
    for run in PUB.VALIDATION + (PUB.CALIBRATION,):
        plan = autopar.Plan(**run.plan)
        assert plan.param_dtype == torch.bfloat16, run.label
        assert plan.grad_reduce_dtype == (torch.bfloat16 if run.source in (PUB.NARAYANAN, PUB.KORTHIKANTI)
                                          else torch.float32), run.label
    run = next(r for r in PUB.NARAYANAN_TABLE_1 if r.label == "39.1B")
    profiles = PUB.profiles(run, get_cluster(run.cluster))
    assert profiles.base.param_bytes == 4 and profiles.get(8, False, True, torch.bfloat16).param_bytes == 2


def test_megatron_rows_bubble_and_memory():
    """Narayanan et al.'s 39.1B row: it fits on 80 GB, and its bubble is the schedule's
    (p-1)/(m+p-1) plus the imbalance of the end stages (embedding, head)."""
    run = next(r for r in PUB.NARAYANAN_TABLE_1 if r.label == "39.1B")
    est = PUB.estimate(run)
    p, m = run.axes["pp"], run.plan["microbatches"]
    assert est.fits
    assert (p - 1) / (m + p - 1) - 1e-9 <= est.bubble_fraction <= 0.2


@pytest.mark.slow
def test_a100_matmul_efficiency_is_the_calibration_runs_fit():
    """The dgx-a100-80gb preset's matmul efficiency is the value at which the estimate of the
    calibration run (BLOOM-176B, 156 TFLOP/s per GPU as published) equals its throughput, to
    the preset's three digits; the validation rows take no part in it."""
    assert PUB.CALIBRATION not in PUB.VALIDATION
    assert get_cluster("dgx-a100-80gb").device.matmul_efficiency == pytest.approx(PUB.fit_matmul_efficiency(),
                                                                                  abs=1e-3)


@pytest.mark.slow
def test_planner_beats_or_matches_the_published_configuration():
    """Given the model, cluster and batch of Narayanan et al.'s 39.1B run (512 GPUs, batch
    1536), the planner asked for the run's mixed precision finds a plan it predicts at least as
    fast as the published one, in that precision."""
    name, t, p, gpus, batch, _ = NARAYANAN_TABLE_1[4]      # 39.1B
    profiles, axes, plan = _published_setup(name, t, p, gpus, batch)
    c = get_cluster("dgx-a100-80gb")
    published = evaluate_plan(profiles, axes, plan, c, batch, recompute="full")
    report = autopar.plan(None, gpus, example_inputs=(), cluster=c, global_batch=batch, profiles=profiles,
                          param_dtype=torch.bfloat16)
    assert report.plan.param_dtype == torch.bfloat16
    assert report.step_time_s <= published.step_time_s
    assert report.memory_bytes <= c.device.memory_bytes
    assert report.candidates[0].reason == "chosen"


def test_overlap_loss_moves_the_step_from_overlapped_to_the_compute_plus_the_busy_communication():
    """A link's measured ``overlap_loss`` (the local preset's ranks share cores with their
    collectives' threads) keeps that fraction of what overlap hides. At 1 the step is the
    compute lane's work plus the time some communication lane was busy: with one lane (ddp's
    bucket reductions) the step of the same plan with every collective waited on when issued
    (``Plan(overlap=False)``); with ZeRO-3's two (gathers and reductions, each on a process
    group of its own) less than that, as long as the two lanes overlapped one another."""
    cfg = GPTConfig(vocab=64, seq=16, dim=32, heads=4, layers=2, max_seq=16)
    x, _ = gpt_batch(cfg, 8)
    prof = Profiles(TinyGPT(cfg), (x,))
    base = get_cluster("dgx-a100-80gb")
    slow = dataclasses.replace(base.intra, bandwidth=5e7)     # collectives long enough to hide, and to overlap one another
    base = base.with_(device=dataclasses.replace(base.device, op_overhead=5e-6))     # compute to hide them behind

    def est(loss, **kw):
        link = dataclasses.replace(slow, overlap_loss=loss)
        return evaluate_plan(prof, {"dp": 4}, autopar.Plan(**kw), base.with_(intra=link, inter=link), 8)

    for mode in ("ddp", "zero3"):     # small buckets: ddp's reductions go on beside backward
        steps = {loss: est(loss, dp=mode, bucket_bytes=1 << 14).step_time_s for loss in (0.0, 0.25, 1.0)}
        serial = est(1.0, dp=mode, bucket_bytes=1 << 14, overlap=False).step_time_s
        assert serial > steps[0.0] * 1.05                        # overlap hid something to lose
        assert steps[0.25] == pytest.approx(steps[0.0] + 0.25 * (steps[1.0] - steps[0.0]), rel=1e-9)
        lanes = est(0.0, dp=mode, bucket_bytes=1 << 14).timeline
        work = sum(t1 - t0 for _, lane, _, t0, t1 in lanes if lane == "compute")
        comm = sorted((t0, t1) for _, lane, _, t0, t1 in lanes if lane == "comm" and t1 > t0)
        busy, end = 0.0, 0.0                                      # the union, walked here
        for t0, t1 in comm:
            busy, end = busy + max(0.0, t1 - max(t0, end)), max(end, t1)
        assert steps[1.0] == pytest.approx(work + busy, rel=1e-9)
        side_by_side = any(a1 > b0 for (_, a1), (b0, _) in zip(comm, comm[1:]))
        if mode == "ddp":
            assert not side_by_side and steps[1.0] == pytest.approx(serial, rel=1e-9)
        else:
            assert side_by_side and steps[1.0] < serial * 0.99
    with pytest.raises(ValueError, match="overlap_loss"):
        Link("gloo", 1e9, 1e-4, overlap_loss=1.5)


@pytest.mark.parametrize("bucket_bytes", [25 << 20, 1 << 13])
def test_zero3_is_predicted_with_the_collectives_its_compiled_program_issues(bucket_bytes):
    """ZeRO-3's estimate issues the collectives of the compiled program's units (the
    collectives pass's: one per layer, the embeddings, final norm and head one root unit, each
    cut at ``bucket_bytes``): a gather per unit in forward, a re-gather per unit in backward, a
    reduce-scatter per gradient bucket. The root unit's go once each, not once per group that
    holds or reads it. On a link of latency alone every collective of a kind takes the same
    time, so the timeline's time over one collective's is their count."""
    cfg = GPTConfig(vocab=64, seq=16, dim=32, heads=4, layers=2, max_seq=16)
    x, _ = gpt_batch(cfg, 8)
    plan = autopar.Plan(dp="zero3", overlap=False, bucket_bytes=bucket_bytes)
    dm = autopar.compile(TinyGPT(cfg), autopar.Mesh(dp=4, virtual=True), example_inputs=(x,), plan=plan)
    units, buckets = dm.ctx.gather_units, dm.ctx.grad_buckets
    assert (len(units) > 3) == (bucket_bytes < 1 << 20)      # the small bucket cuts the layers
    link = Link("latency alone", 1e30, 1e-3)
    c = get_cluster("dgx-a100-80gb").with_(intra=link, inter=link)     # the fp32 model priced in fp32, as compiled
    e = evaluate_plan(Profiles(TinyGPT(cfg), (x,)), {"dp": 4}, plan, c, 8)

    def count(kind, backward):
        name = "reduce grads" if kind == "reduce_scatter" else "all_gather unit"
        spent = sum(t1 - t0 for _, lane, label, t0, t1 in e.timeline
                    if lane == "comm" and label.startswith(name) and label.endswith("(backward)") == backward)
        return spent / collective_time(kind, 4096, 4, link)

    assert count("all_gather", False) == pytest.approx(len(units))
    assert count("reduce_scatter", False) == pytest.approx(len(buckets))
    if len(units) == 3:     # every unit whole: backward reads each (a cut piece may hold biases alone)
        assert count("all_gather", True) == pytest.approx(len(units))


@pytest.mark.parametrize("sp_on", [False, True])
def test_collective_overhead_is_charged_once_per_runtime_tp_collective(sp_on):
    """``Device.collective_overhead`` (the runtime's host work per tensor-parallel collective,
    measured by the local calibration) adds that many seconds per collective the step issues.
    The count is Megatron's, written here: per layer, tp issues an all-reduce after attention
    and after the MLP and one for each of their inputs' gradients (4); tp + sp an all-gather
    before and a reduce-scatter after each of the two, their mirror images in backward, the
    two re-gathers of the inputs the weight gradients need, and one all-reduce of the
    gradients of what sp leaves replicated (the norms, the row-parallel biases): 11. The
    runtime issues those per layer (a 2-layer GPT's flight recorder under tp + sp: 26, the 22
    and four around the embedding, the final norm and the head)."""
    per_layer = 11 if sp_on else 4
    steps = {}
    for layers in (2, 3):
        cfg = GPTConfig(vocab=64, seq=16, dim=32, heads=4, layers=layers, max_seq=16)
        x, _ = gpt_batch(cfg, 8)
        prof = Profiles(TinyGPT(cfg), (x,))
        base = get_cluster("dgx-a100-80gb")
        for host in (0.0, 1e-3):
            c = base.with_(device=dataclasses.replace(base.device, collective_overhead=host))
            steps[(layers, host)] = evaluate_plan(prof, {"tp": 2}, autopar.Plan(tp=True, sp=sp_on), c, 8).step_time_s
    added = {n: steps[(n, 1e-3)] - steps[(n, 0.0)] for n in (2, 3)}
    assert added[3] - added[2] == pytest.approx(per_layer * 1e-3, rel=1e-6)


def test_the_split_backwards_host_work_goes_to_the_forward_by_its_measured_share():
    """Splitting W out of the backward costs host work per stage (``split_pass_overhead`` +
    ``split_op_overhead`` x the stage's matmuls with a parameter weight, whose weight gradients
    W defers); ``split_forward_share`` of it lands in every F action (each deferring matmul's
    autograd function runs in the forward), the rest in B + W. The replayed actions, a share of
    0 against 0.4: F grows by 0.4 of the split's work, B + W shrink by as much, per micro-batch
    and stage, and a 1F1B plan does not move. Per matmul: the GPT's 2 x 4 layer linears and its
    head, 9 in all over the stages."""
    cfg = GPTConfig(vocab=64, seq=16, dim=32, heads=4, layers=2, max_seq=16)
    x, _ = gpt_batch(cfg, 8)
    prof = Profiles(TinyGPT(cfg), (x,))
    base = get_cluster("dgx-a100-80gb")
    per_stage = 1e-3

    def actions(schedule, share, per_matmul=0.0):
        c = base.with_(device=dataclasses.replace(base.device, split_pass_overhead=per_stage,
                                                  split_op_overhead=per_matmul, split_forward_share=share))
        e = evaluate_plan(prof, {"pp": 2}, autopar.Plan(pp_schedule=schedule, microbatches=4), c, 8)
        took = {}
        for r, lane, name, t0, t1 in e.timeline:
            if lane == "compute" and name[-2:-1] in "FBW" and name[:-2].isdigit():
                took[name[-2]] = took.get(name[-2], 0.0) + t1 - t0
        return took, e.step_time_s

    (none, _), (some, _) = actions("zero_bubble", 0.0), actions("zero_bubble", 0.4)
    moved = 0.4 * per_stage * 2 * 4        # 2 stages, 4 micro-batches
    assert some["F"] - none["F"] == pytest.approx(moved, rel=1e-6)
    assert (none["B"] + none["W"]) - (some["B"] + some["W"]) == pytest.approx(moved, rel=1e-6)
    assert actions("1f1b", 0.0)[1] == actions("1f1b", 0.4)[1]
    per_matmul = 1e-4
    more = actions("zero_bubble", 1.0, per_matmul)[0]["F"] - actions("zero_bubble", 1.0)[0]["F"]
    assert more == pytest.approx(per_matmul * (2 * 4 + 1) * 4, rel=1e-6)     # 9 matmuls, 4 micro-batches


_ESTIMATE_IN_A_PROCESS = """
import dataclasses
import autopar
from autopar.cost.cluster import get_cluster
from autopar.cost.estimate import Profiles, evaluate_plan
from autopar.models import GPTConfig, TinyGPT, gpt_batch
c = GPTConfig(vocab=128, seq=8, dim=128, heads=4, layers=4, max_seq=8)
x, _ = gpt_batch(c, 8)
profiles = Profiles(TinyGPT(c), (x,))
cluster = get_cluster("dgx-a100-80gb")
for mode, kw in (("ddp", {}), ("zero1", {"pp_schedule": "interleaved", "virtual_stages": 2}), ("zero3", {})):
    plan = autopar.Plan(dp=mode, **({"pp_schedule": "1f1b"} | kw), microbatches=4)
    e = evaluate_plan(profiles, {"pp": 2, "dp": 2}, plan, cluster, 8)
    print(e.memory_bytes, e.step_time_s)
"""


@pytest.mark.slow
def test_an_estimate_does_not_depend_on_the_process_string_hash_seed():
    """The estimate walks a rank's parameters and buckets in the profile's order, not a set's:
    the same plans estimated in processes with different ``PYTHONHASHSEED`` give the same
    figures (a walk of a pipeline's gradient buckets in a set's order of a rank's parameters
    would put 1F1B's peak here anywhere in 8.09-8.61 MB over three seeds)."""
    import os
    import subprocess
    import sys
    outs = set()
    for seed in ("1", "2", "3"):
        done = subprocess.run([sys.executable, "-c", _ESTIMATE_IN_A_PROCESS], env={**os.environ, "PYTHONHASHSEED": seed},
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        outs.add(done.stdout)
    assert len(outs) == 1, outs


@pytest.mark.parametrize("mode", ["zero1", "zero2"])
def test_zero_replica_gathers_pay_one_latency_per_runtime_bucket(mode):
    """ZeRO-1/2 over dp=2 in 32 kB buckets (fp32, dgx-a100's links): after the optimizer step
    the runtime all-gathers the updated rows one bucket at a time (a virtual-mesh compile's
    buckets), so the step's tail is, per bucket of W padded elements a rank, one all-gather of
    2·W·4 B plus its copies (this rank's W rows staged, read and written; the 2·W gathered
    rows written into the replicas, read and written) at the device's memory rate: its latency
    paid per bucket, not once for the whole model. Written here from the link's alpha-beta."""
    c = get_cluster("dgx-a100-80gb")
    cfg = GPTConfig()
    tok, _ = gpt_batch(cfg, 8)
    model = TinyGPT(cfg)
    plan = autopar.Plan(dp=mode, bucket_bytes=32_000)
    dm = autopar.compile(model, autopar.Mesh(dp=2, virtual=True, rank=0), example_inputs=(tok,), plan=plan)
    widths = [b.width for b in dm._sync.buckets]
    assert len(widths) > 2
    e = autopar.estimate(model, autopar.Mesh(dp=2, virtual=True), plan, example_inputs=(tok,), cluster=c)
    link, rate = c.link_for({"dp": 2}, "dp"), c.device.mem_bandwidth * c.device.memory_efficiency
    expected = sum(link.latency * 1 + (2 * w * 4) / 2 / link.bandwidth + (2 * w * 4 + 2 * 2 * w * 4) / rate
                   for w in widths)
    gathers = [end - start for _, lane, name, start, end in e.timeline if name == "all_gather params"]
    assert gathers == [pytest.approx(expected, rel=1e-9)]
