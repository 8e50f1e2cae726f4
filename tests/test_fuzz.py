"""The model fuzzer (autopar.fuzz): random models under every plan against one device.

Fast tier: a fixed budget of seeds whose models cover every block family finds no wrong and no
crashed cell; a deliberately broken rule (a mean over a tp shard without its all-reduce, as a
hand-written RMSNorm takes it) is found within that budget and shrunk to a small model; a printed model is the model. Slow tier:
every shrunk model of a bug the fuzzer found, under every plan; and a larger budget.
"""
import pytest
import torch

from autopar import fuzz
from autopar.passes.rules import RULES, reduction
from autopar.placement import Partial, Replicate

FAST_SEEDS = (21, 1661, 705)
"""three models of three blocks: every block family; norms over an MLP's inner width (whole and
in groups), q/k norms over the width and per head, fused projections parted by split and by
view, ALiBi, windowed and rotary attention, a Mamba-style mixer with its decaying scan, a write
along the sequence, an index shift of the positions, a top-1 router over stacked experts
(einsum), pre-, post- and parallel residuals, tied weights and learned positions"""

REGRESSIONS = {
    # verify compared rounding noise with noise: a router's top-1 weight renormalised to 1 has a
    # gradient that is zero but for rounding, on one device and on the ranks alike
    "top1_router_zero_gradient": fuzz.Spec(
        seed=1, hidden=16, seq=8, vocab=32,
        model=(("tied", False), ("positions", False), ("scale", 1.0), ("final_norm", "none"), ("residual", "pre"),
               ("loss", "mean_square")),
        blocks=(("MoE", (("experts", 2), ("top_k", 1), ("form", "dense"), ("ffn", 8)), "none"),)),
    # a three-operand einsum (experts' stacked weights applied with their gates) had no rule, and
    # the strategy search refused the batch's dim under dp
    "stacked_experts_einsum": fuzz.Spec(
        seed=13, hidden=16, seq=8, vocab=32,
        model=(("tied", False), ("positions", False), ("scale", 1.0), ("final_norm", "none"), ("residual", "pre"),
               ("loss", "mean_square")),
        blocks=(("MoE", (("experts", 2), ("top_k", 2), ("form", "stacked"), ("ffn", 8)), "none"),)),
    # the vocabulary-parallel cross-entropy took float64 logits down to float32: the loss and
    # its gradient a float32 rounding (1e-7) away from one device's
    "vocab_parallel_cross_entropy_in_float64": fuzz.Spec(
        seed=3, hidden=16, seq=8, vocab=32,
        model=(("tied", False), ("positions", False), ("scale", 1.0), ("final_norm", "none"), ("residual", "pre"),
               ("loss", "cross_entropy")),
        blocks=(("MLP", (("gated", False), ("fused", False), ("act", "relu"), ("inner_norm", "none"), ("groups", 2),
                         ("bias", False), ("ffn", 16)), "none"),)),
    # a pipeline's train_step with a loss_fn and no targets crashed in unflattening them; and it
    # summed and broadcast a float64 loss in float32
    "pipeline_loss_without_targets_in_float64": fuzz.Spec(
        seed=7, hidden=12, seq=8, vocab=40,
        model=(("tied", False), ("positions", False), ("scale", 1.0), ("final_norm", "layer"),
               ("residual", "parallel"), ("loss", "mean_square")),
        blocks=(("Index", (("mode", "index_select"),), "none"),)),
    # ranks as threads: the sequence-parallel fuser's proxies took the node meta of an export
    # running in another rank's thread (AssertionError in replace_all_uses_with)
    "view_write_under_dp_tp_threads": fuzz.Spec(
        seed=16, hidden=12, seq=6, vocab=40,
        model=(("tied", True), ("positions", True), ("scale", 1.0), ("final_norm", "rms_torch"), ("residual", "pre"),
               ("loss", "mean_square")),
        blocks=(("Writes", (("mode", "view_write"), ("width", 16)), "rms"),)),
}


def test_the_fast_budget_covers_every_family():
    families = {f for s in FAST_SEEDS for f in fuzz.generate(s).families()}
    assert families == set(fuzz.FAMILIES)


@pytest.mark.timeout(120)
def test_a_fixed_budget_of_random_models_is_never_wrong():
    summary = fuzz.run(FAST_SEEDS)
    assert len(summary.verdicts) == len(FAST_SEEDS) * (len(fuzz.PLANS) + len(fuzz.PIPELINE_PLANS))
    bad = [f"{v}\n{v.trace}" for v in summary.failures()]
    assert not bad, "\n".join(bad)
    assert summary.counts()["correct"] >= len(summary.verdicts) // 2, summary.table()


def _forgets_its_all_reduce(info):
    """The mean rule, broken: the mean over a sharded dim is taken to be each rank's local
    mean, replicated (the all-reduce of the partial means forgotten). A norm written out by
    hand (``x * rsqrt(x.pow(2).mean(-1) + eps)``) over a tp-sharded width then goes wrong."""
    return reduction.reduce_strategies(info, *reduction._dims_keepdim(info), lambda size, n: Replicate(),
                                       (Partial("sum"), Partial("avg")))


@pytest.mark.timeout(240)
def test_a_broken_mean_rule_is_found_within_the_fast_budget_and_shrunk(monkeypatch):
    for op in [op for op, fn in RULES.items() if fn is reduction.mean]:
        monkeypatch.setitem(RULES, op, _forgets_its_all_reduce)
    summary = fuzz.run(FAST_SEEDS, stop_at_wrong=True)
    wrong = [v for v in summary.verdicts if v.kind == "wrong"]
    assert wrong, summary.table()
    v = wrong[0]
    assert "diverges at node" in v.detail
    spec, got = fuzz.shrink(fuzz.generate(v.seed), v.plan, v, budget=40)
    assert got.kind == "wrong" and len(spec.blocks) < len(fuzz.generate(v.seed).blocks)
    text = fuzz.source(spec, v.plan)
    assert "class FuzzModel" in text and "def build()" in text


def test_a_printed_model_is_the_model():
    """``source(spec)`` run as a module builds the model ``build(spec)`` builds: the same
    parameters, the same output on the same batch."""
    spec = fuzz.generate(FAST_SEEDS[0])
    space: dict = {}
    exec(compile(fuzz.source(spec, "tp"), "<fuzz model>", "exec"), space)
    printed, built = space["build"](), fuzz.build(spec)
    batch = fuzz.example(spec)
    assert all(torch.equal(a, b) for a, b in zip(space["example"](), batch))
    a, b = printed.state_dict(), built.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(printed(*batch), built(*batch))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", sorted(REGRESSIONS))
def test_every_shrunk_regression_model_is_correct_under_every_plan(name):
    for plan in (*fuzz.PLANS, *fuzz.PIPELINE_PLANS):
        v = fuzz.check(REGRESSIONS[name], plan)
        assert v.kind == "correct", f"{v}\n{v.trace}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_larger_budget_of_random_models_is_never_wrong():
    summary = fuzz.run(range(2000, 2016))
    bad = [f"{v}\n{v.trace}" for v in summary.failures()]
    assert not bad, "\n".join(bad)
