"""Peak memory during a training step (forward, backward and the optimizer step: the allocator's
peak, ``jobs.memory_peak.peak_of``), per rank, on real processes, against the peak the cost
model predicts for the same plan (``evaluate_plan``, this machine's ``local`` preset), within
10%: ddp and ZeRO-1/2/3 on a GPT whose parameters dominate (ZeRO-2 and -3 free each bucket's
full gradients once reduced: the peak falls by about the full gradients against a reducer
that holds them to the end of backward), and recomputation none / selective / full under tp
and tp + sp on a GPT whose activations dominate. The planner, given a device memory that
only recomputation meets, picks it, and ``compile(plan="auto")`` runs within it."""
import dataclasses

import pytest

import autopar
from autopar.cost.estimate import Profiles, evaluate_plan
from autopar.models import GPTConfig, TinyGPT, gpt_batch

from jobs import memory_peak as jobs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WORLD = 2


def _predicted(config, batch, axes, kw, cluster, flash=True):
    x, _ = gpt_batch(config, batch)
    profiles = Profiles(TinyGPT(config), (x,), flash=flash, dropout_math=True)   # as the runtime runs it
    return evaluate_plan(profiles, axes, autopar.Plan(**kw), cluster, batch)


@pytest.fixture(scope="module")
def dp_peaks(ranks):
    return ranks(jobs.dp_peaks, WORLD, timeout=500)


@pytest.mark.parametrize("mode", ["ddp", "zero1", "zero2", "zero3"])
def test_data_parallel_peak_within_ten_percent(dp_peaks, local_cluster, mode):
    est = _predicted(jobs.PARAM_HEAVY, jobs.PARAM_HEAVY_BATCH, {"dp": WORLD},
                     {"dp": mode, "bucket_bytes": jobs.BUCKET_BYTES}, local_cluster[0])
    measured = max(r[mode]["peak"] for r in dp_peaks)
    assert est.memory_bytes == pytest.approx(measured, rel=0.10), (mode, [r[mode]["peaks"] for r in dp_peaks])


def test_zero2_frees_each_bucket_as_it_is_reduced(dp_peaks):
    """Against the same reducer holding every full-size bucket to the end of backward: the
    peak falls by at least the full gradients less one rank's shard of them, Ψ·(N-1)/N
    fp32 gradient bytes, less the two buckets the reducer may hold at once."""
    for r in dp_peaks:
        drop = r["zero2 holding"]["peak"] - r["zero2"]["peak"]
        assert drop >= 4 * r["zero2"]["psi"] * (WORLD - 1) / WORLD - 2 * jobs.BUCKET_BYTES, (drop, r["zero2"]["psi"])


RECOMPUTE_CASES = [(f"{name} {rc}", {"tp": WORLD}, {"tp": True, "sp": name == "tp+sp", "recompute": rc})
                   for name in ("tp", "tp+sp") for rc in ("none", "selective", "full")]


@pytest.fixture(scope="module")
def recompute_peaks(ranks):
    return ranks(jobs.plan_peaks, WORLD, RECOMPUTE_CASES, timeout=550)


@pytest.mark.parametrize("name,axes,kw", RECOMPUTE_CASES, ids=[c[0] for c in RECOMPUTE_CASES])
def test_recompute_peak_within_ten_percent(recompute_peaks, local_cluster, name, axes, kw):
    est = _predicted(jobs.ACTIVATION_HEAVY, jobs.ACTIVATION_HEAVY_BATCH, axes, kw, local_cluster[0])
    measured = max(r[name]["peak"] for r in recompute_peaks)
    assert est.memory_bytes == pytest.approx(measured, rel=0.10), (name, [r[name]["peaks"] for r in recompute_peaks])


PIPELINE_CONFIG = dataclasses.replace(jobs.ACTIVATION_HEAVY, layers=4)      # a layer per virtual stage
PIPELINE_CASES = [(f"pp {s}", {"pp": WORLD}, {"pp_schedule": s, "microbatches": 4,
                                              **({"virtual_stages": 2} if s == "interleaved" else {})})
                  for s in ("1f1b", "interleaved", "zero_bubble")]


@pytest.fixture(scope="module")
def pipeline_peaks(ranks):
    return ranks(jobs.plan_peaks, WORLD, PIPELINE_CASES, PIPELINE_CONFIG, timeout=550)


@pytest.mark.parametrize("name,axes,kw", PIPELINE_CASES, ids=[c[0] for c in PIPELINE_CASES])
def test_pipeline_peak_within_ten_percent(pipeline_peaks, local_cluster, name, axes, kw):
    """The busiest rank's peak under each schedule, activations dominating: the estimate walks
    the schedule's actions (1F1B's first rank holds p micro-batches; the interleaved one holds
    its virtual stages' as they come; zero-bubble keeps each weight matmul's input and output
    gradient from B to W)."""
    est = _predicted(PIPELINE_CONFIG, jobs.ACTIVATION_HEAVY_BATCH, axes, kw, local_cluster[0])
    measured = max(r[name]["peak"] for r in pipeline_peaks)
    assert est.memory_bytes == pytest.approx(measured, rel=0.10), (name, [r[name]["peaks"] for r in pipeline_peaks])


ACCUMULATING_CASES = [(f"pp {s} x dp {mode}", {"pp": 2, "dp": 2}, {"dp": mode, "pp_schedule": s, "microbatches": 4,
                                                                   **({"virtual_stages": 2} if s == "interleaved" else {})})
                      for s, mode in (("1f1b", "ddp"), ("interleaved", "zero1"))]
ACCUMULATING_CONFIG = GPTConfig(vocab=67, seq=16, dim=96, heads=4, layers=4, max_seq=16)   # a layer per virtual stage
ACCUMULATING_BATCH = 8      # one row per micro-batch


@pytest.fixture(scope="module")
def accumulating_peaks(ranks):
    return ranks(jobs.plan_peaks, 4, ACCUMULATING_CASES, ACCUMULATING_CONFIG, ACCUMULATING_BATCH, timeout=550)


@pytest.mark.parametrize("name,axes,kw", ACCUMULATING_CASES, ids=[c[0] for c in ACCUMULATING_CASES])
def test_pipeline_with_data_parallel_peak_within_five_percent(accumulating_peaks, local_cluster, name, axes, kw):
    """Pipelines on pp = 2 x dp = 2, the busiest rank's peak: from the second micro-batch on, a
    stage's micro-batch gradients wait in its buckets until each bucket is complete and are
    then summed, one at a time, into those accumulated over the earlier micro-batches (the
    second micro-batch's sums are new tensors beside both), while the other micro-batches in
    flight keep their activations. The estimate had no such walk (its pipelined backward
    counted neither the waiting gradients nor the sums, and freed every micro-batch's
    activations at once) and came to 0.93 (1F1B) and 0.90 (interleaved) of these peaks;
    5%, not the 10% of the other plans, so that a miss of that size fails."""
    est = _predicted(ACCUMULATING_CONFIG, ACCUMULATING_BATCH, axes, kw, local_cluster[0])
    measured = max(r[name]["peak"] for r in accumulating_peaks)
    assert est.memory_bytes == pytest.approx(measured, rel=0.05), (name, [r[name]["peaks"] for r in accumulating_peaks])


def test_a_one_f_one_b_rank_holds_as_many_micro_batches_at_four_as_at_eight(ranks):
    """1F1B keeps min(m, p - r) micro-batches in flight on rank r, whatever the number m of
    micro-batches beyond p: with each micro-batch the same size, what a rank's step allocates
    beyond what lives between steps is the same at m = 8 as at m = 4 (p = 2), within a quarter
    of what one micro-batch sends. (A send's handle holds its tensor until waited, and gloo
    does not report a send complete before it is waited: the runtime waits for the sends whose
    receive the peer has posted as it goes, ``PipelineModule._release_sends``. Waiting for all
    of them at the end of the step held every micro-batch's stage outputs and input gradients
    to then: 65,536 B more at m = 8 here, four micro-batches' sends.)"""
    config = dataclasses.replace(jobs.ACTIVATION_HEAVY, dropout=0.0)   # no masks: they are drawn for every micro-batch
    rows = 2
    sent = rows * config.seq * config.dim * 4        # one micro-batch's hidden state, fp32
    for r in ranks(jobs.microbatch_peaks, WORLD, {"pp_schedule": "1f1b"}, (4, 8), rows, config, timeout=300):
        grew = (r[8]["peak"] - r[8]["base"]) - (r[4]["peak"] - r[4]["base"])
        assert abs(grew) <= sent / 4, (grew, sent, r[4], r[8])


def test_recomputation_lowers_the_measured_peak(recompute_peaks):
    for r in recompute_peaks:
        for tp in ("tp", "tp+sp"):
            none, selective, full = (r[f"{tp} {rc}"]["peak"] for rc in ("none", "selective", "full"))
            assert none > selective > full, (tp, none, selective, full)
            assert r[f"{tp} full"]["recomputed"] == [("blocks.0", "full"), ("blocks.1", "full")]


def test_planner_picks_recomputation_when_only_it_fits_and_compile_runs_within_the_limit(ranks, local_cluster):
    """A device memory between the smallest peak any plan of dp=2 reaches without
    recomputation and the smallest with it: the planner chooses a recomputing plan,
    ``compile(plan="auto")`` compiles that plan (its regions exist) and the measured peak stays
    within the memory given."""
    local = local_cluster[0]
    c, batch = jobs.ACTIVATION_HEAVY, jobs.ACTIVATION_HEAVY_BATCH
    x, _ = gpt_batch(c, batch)
    profiles = Profiles(TinyGPT(c), (x,), dropout_math=True)
    least = {rc: min(evaluate_plan(profiles, {"dp": WORLD}, autopar.Plan(dp=mode, recompute=rc), local, batch).memory_bytes
                     for mode in ("ddp", "zero1", "zero2", "zero3")) for rc in ("none", "selective", "full")}
    assert least["full"] < least["none"]
    limit = int((least["none"] + min(least.values())) / 2)
    cluster = local.with_(device=dataclasses.replace(local.device, memory_bytes=limit))
    report = autopar.plan(TinyGPT(c), WORLD, example_inputs=(x,), cluster=cluster, mesh_axes={"dp": WORLD},
                          profiles=profiles)
    assert report.plan.recompute != "none" and report.memory_bytes <= limit
    for r in ranks(jobs.auto_plan_peak, WORLD, cluster, timeout=300):
        assert autopar.Plan.parse(r["plan"]) == report.plan
        assert r["recomputed"]
        assert r["peak"] <= limit, (r["peak"], limit, r["peaks"])


def test_a_memory_budget_recomputes_the_cheapest_layers_that_fit(ranks, local_cluster):
    """``Plan(recompute=<bytes>)`` between the peaks of selective and full recomputation: some
    layers recompute whole, the measured peak is within the budget (and the budget is not met
    by selective recomputation alone)."""
    local = local_cluster[0]
    c, batch, axes = jobs.ACTIVATION_HEAVY, jobs.ACTIVATION_HEAVY_BATCH, {"tp": WORLD}
    peak = {rc: _predicted(c, batch, axes, {"tp": True, "recompute": rc}, local).memory_bytes
            for rc in ("selective", "full")}
    budget = int((peak["selective"] + peak["full"]) / 2)
    kw = {"tp": True, "recompute": budget}
    est = _predicted(c, batch, axes, kw, local)
    assert est.memory_bytes <= budget and "full" in est.recompute_layers.values()
    for r in ranks(jobs.plan_peaks, WORLD, [("budget", axes, kw)], timeout=300):
        assert sorted(r["budget"]["recomputed"]) == sorted((k, v) for k, v in est.recompute_layers.items())
        assert r["budget"]["peak"] <= budget, (r["budget"]["peaks"], budget)
