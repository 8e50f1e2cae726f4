"""Grouped-query and multi-query attention under tensor parallelism (and sequence parallelism):
the q heads and the k/v heads split together when both divide by tp (Megatron's layout); when
the k/v heads do not (fewer of them than ranks), the k/v projections stay whole and each rank
reads the k/v heads its q heads need (``passes/kv_heads.py``). Checked against the single-device
model (outputs, loss, gradients, parameters after 3 AdamW steps; ``autopar.testing.parity``'s
fp32 tolerances) for every way a model writes the attention core (``jobs/gqa.py``'s FORMS), and
the bytes tp moves per layer against Megatron's formula.
"""
import pytest
import torch

import autopar
from autopar import meta
from autopar.passes.rules import OpInfo, strategies_for
from autopar.passes.rules.validate import validate
from autopar.testing import fake_rank

from jobs import gqa

aten = torch.ops.aten

HEADS = [(8, 2), (8, 1), (4, 4)]
"""(q heads, k/v heads): GQA, MQA, and plain multi-head attention"""


def _check(reports, label):
    for r in reports:
        for key, rep in r.items():
            assert rep.ok, (f"{label} {key} rank {rep.rank}: output {rep.output_err:.3g} loss {rep.loss_err:.3g} "
                            f"grad {rep.grad_err:.3g} param {rep.param_err:.3g} noise {rep.noise_param_err:.3g} "
                            f"{rep.messages}")
            assert len(rep.losses) == 3 and rep.ref_losses[-1] < rep.ref_losses[0]


def _compile(a: gqa.ModelArgs, t: int, sp: bool = False):
    tok, _ = gqa.batch(a)
    torch.manual_seed(0)
    return autopar.compile(gqa.Transformer(a), autopar.Mesh(tp=t), example_inputs=(tok,),
                           plan=autopar.Plan(tp=True, sp=sp))


# ---- layouts (a fake process group, no processes) -------------------------------------------

def test_heads_split_with_their_kv_heads():
    """8 q heads over 2 k/v heads at tp=2: wq, wk, wv split on heads (each rank 4 q heads and the
    k/v head they read), wo on its input features; nothing is gathered around the attention."""
    a = gqa.ModelArgs(n_heads=8, n_kv_heads=2, form="sdpa_gqa")      # dim 32, head_dim 4
    for rank in (0, 1):
        with fake_rank(2, rank):
            dm = _compile(a, 2)
        p = dm.module.get_parameter
        assert tuple(p("layers.0.attention.wq.weight").shape) == (16, 32)   # 4 heads x 4
        assert tuple(p("layers.0.attention.wk.weight").shape) == (4, 32)    # 1 k/v head x 4
        assert tuple(p("layers.0.attention.wv.weight").shape) == (4, 32)
        assert tuple(p("layers.0.attention.wo.weight").shape) == (32, 16)
    tp = {k: str(v) for k, v in dm.ctx.tp_params.items()}
    assert [tp[f"layers.0.attention.{w}.weight"] for w in ("wq", "wk", "wv", "wo")] == ["S(0)", "S(0)", "S(0)", "S(1)"]
    sdpa = next(n for n in dm.module.graph.nodes if n.target == aten.scaled_dot_product_attention.default)
    assert str(sdpa.meta[meta.STRATEGY]["tp"]) == "S(1),S(1),S(1) -> S(1)"
    names = {getattr(n.target, "__name__", "") for n in dm.module.graph.nodes}
    assert not names & {"tp_gather", "tp_split"}, names


def test_kv_heads_fewer_than_tp_stay_whole():
    """1 k/v head (multi-query) at tp=2: wk and wv stay whole (a note says why), each rank reads
    the k/v head through an index_select at its share of the positions arange(8) // 8, so the
    attention still runs on 4 q heads a rank and wo stays row-parallel."""
    a = gqa.ModelArgs(n_heads=8, n_kv_heads=1, form="sdpa_gqa")
    with fake_rank(2, 1):
        dm = _compile(a, 2)
    p = dm.module.get_parameter
    assert tuple(p("layers.0.attention.wk.weight").shape) == (4, 32)        # whole: 1 head x 4
    assert tuple(p("layers.0.attention.wq.weight").shape) == (16, 32)
    assert tuple(p("layers.0.attention.wo.weight").shape) == (32, 16)
    tp = dm.ctx.tp_params
    assert str(tp["layers.0.attention.wk.weight"]) == str(tp["layers.0.attention.wv.weight"]) == "R"
    assert "grouped-query attention: 1 k/v heads for 8 q heads" in tp["layers.0.attention.wk.weight"].reason
    takes = [n for n in dm.module.graph.nodes if n.target == aten.index_select.default]
    assert len(takes) == 2 and all(str(n.meta[meta.STRATEGY]["tp"]) == "R,S(0) -> S(1)" for n in takes)
    assert any("grouped-query attention at scaled_dot_product_attention" in n for n in dm.ctx.notes)


def test_a_view_of_a_transpose_is_emitted_as_reshape():
    """torchtitan's ``out.transpose(1, 2).contiguous().view(b, s, -1)`` is captured without the
    contiguous (the attention's output, laid out like its q, made it one); under tp a
    redistribution may hand the attention a contiguous q, so the view is emitted as a reshape."""
    with fake_rank(2, 0):
        dm = _compile(gqa.ModelArgs(form="repeat_kv"), 2)
    g = dm.module.graph
    after = [n for n in g.nodes if n.op == "call_function" and isinstance(n.args[0], torch.fx.Node)
             and n.args[0].target == aten.transpose.int and n.target in (aten.view.default, aten.reshape.default)]
    assert after and all(n.target == aten.reshape.default for n in after)


def test_attention_rule_splits_grouped_heads_and_is_right():
    """The rule offers the head split under enable_gqa only where both head counts divide by the
    axis, and the brute-force validator finds every strategy right."""
    q, kv = torch.randn(2, 6, 5, 4), torch.randn(2, 3, 5, 4)
    samples = [(aten.scaled_dot_product_attention.default, (q, kv, kv.clone()), {"enable_gqa": True}),
               (aten.scaled_dot_product_attention.default, (q, kv[:, :1], kv[:, :1].clone()),
                {"enable_gqa": True, "is_causal": True})]
    report = validate(samples, ns=(2, 3))
    assert report.ok, str(report)
    heads = {n: [str(s) for s in strategies_for(OpInfo.from_call(*samples[0], n=n))] for n in (2, 3)}
    assert "S(1),S(1),S(1) -> S(1)" in heads[3] and "S(1),S(1),S(1) -> S(1)" not in heads[2]


# ---- bytes per layer --------------------------------------------------------------------------

def _per_layer(r) -> dict:
    return {k[1:]: r[2].get(k, 0.0) - r[1].get(k, 0.0) for k in set(r[1]) | set(r[2])
            if r[2].get(k, 0.0) != r[1].get(k, 0.0)}


def _expected_tp(t, z) -> dict:
    """Megatron: forward an all-reduce of b·s·h after the attention's and the MLP's row
    products, backward one before their column products (f); k/v heads that do not divide by
    tp add the backward all-reduce of the gradients of k and v (b·s·kv·hd each), which each
    rank's index_select of the heads reaches in part. An all-reduce of x elements moves
    2(t-1)/t·x·4 bytes per rank."""
    ar = lambda x: 2 * (t - 1) / t * x * 4
    bsh, kv = z["b"] * z["s"] * z["h"], z["b"] * z["s"] * z["kv"] * z["hd"]
    whole = z["kv"] % t != 0
    return {("all_reduce", "forward"): 2 * ar(bsh), ("all_reduce", "backward"): 2 * ar(bsh) + whole * 2 * ar(kv)}


def _expected_sp(t, z) -> dict:
    """Korthikanti et al.: each all-reduce becomes an all-gather and a reduce-scatter of b·s·h
    ((t-1)/t·x·4 bytes each), the column products' inputs kept as sequence shards and gathered
    again in backward, and the two RMSNorm weights read on sequence shards get their gradient
    all-reduce. k/v heads that do not divide by tp: k and v are computed on the sequence shard
    and gathered (b·s·kv·hd each; backward reduce-scatters), and the whole wk and wv, read on
    sequence shards, get their gradient all-reduce (kv·hd·h each)."""
    g = lambda x: (t - 1) / t * x * 4
    bsh, kv, h = z["b"] * z["s"] * z["h"], z["b"] * z["s"] * z["kv"] * z["hd"], z["h"]
    whole = z["kv"] % t != 0
    return {("all_gather", "forward"): 2 * g(bsh) + whole * 2 * g(kv),
            ("reduce_scatter", "forward"): 2 * g(bsh),
            ("all_gather", "backward"): 4 * g(bsh),
            ("reduce_scatter", "backward"): 2 * g(bsh) + whole * 2 * g(kv),
            ("all_reduce", "backward"): 2 * g(2 * h) + whole * 2 * 2 * g(z["kv"] * z["hd"] * h)}


_BYTES = [pytest.param(form, heads, kv, t, marks=() if (heads, kv, t) in ((8, 2, 2), (8, 1, 2)) and form == "repeat_kv"
                       else pytest.mark.slow, id=f"{form}-{heads}/{kv}-tp{t}")
          for form in ("repeat_kv", "sdpa_gqa", "explicit") for heads, kv in HEADS for t in (2, 4)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("form,heads,kv,t", _BYTES)
def test_tp_bytes_per_layer(form, heads, kv, t):
    """One layer's tp traffic in one training step (the model with 2 layers minus with 1), on
    the last rank of a fake process group: Megatron's 4 all-reduces of b·s·h when the k/v heads
    split, nothing else (no all-gather of q, k or v)."""
    with fake_rank(t, t - 1):
        r = gqa.tp_volume(form, heads, kv)
    got, want = _per_layer(r), _expected_tp(t, r["sizes"])
    assert got.keys() == want.keys(), got
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=0, abs=1e-6), (k, got, want)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("form,heads,kv,t", [("repeat_kv", 8, 2, 2), ("sdpa_gqa", 8, 1, 2), ("hf", 8, 2, 4),
                                             ("repeat_interleave", 8, 1, 4)])
def test_tp_sp_bytes_per_layer(form, heads, kv, t):
    """tp+sp: one layer's traffic against Korthikanti et al.'s formula (``_expected_sp``)."""
    with fake_rank(t, t - 1):
        r = gqa.tp_volume(form, heads, kv, sp=True)
    got, want = _per_layer(r), _expected_sp(t, r["sizes"])
    assert got.keys() == want.keys(), got
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=0, abs=1e-6), (k, got, want)


# ---- parity on real processes -----------------------------------------------------------------

@pytest.mark.timeout(120)
def test_parity_fast(ranks):
    """tp=2: 8 q over 2 k/v heads through torchtitan's repeat_kv (the heads split), and 8 over 1
    through sdpa(enable_gqa) (the k/v head whole, read by every rank)."""
    _check(ranks(gqa.parity_matrix, 2, [("repeat_kv", 8, 2), ("sdpa_gqa", 8, 1)], timeout=100), "tp=2")


_MATRIX = [(form, heads, kv) for form in gqa.FORMS for heads, kv in HEADS]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("t", [2, 4])
def test_parity_matrix(ranks, t, sp):
    """Every form x (8/2, 8/1, 4/4) heads at tp=2, and 12 q over 3 k/v heads, whose q heads on a
    rank read two k/v heads; at tp=4 the heads of every case through two forms (the rewrite of
    each form is tp-independent: tp=2 covers it)."""
    if t == 2:
        cases = _MATRIX + [("sdpa_gqa", 12, 3), ("repeat_kv", 12, 3), ("explicit", 12, 3)]
    else:
        cases = [(form, heads, kv) for form in ("sdpa_gqa", "repeat_kv") for heads, kv in HEADS]
    _check(ranks(gqa.parity_matrix, t, cases, sp, timeout=360), f"tp={t} sp={sp}")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_llama3_parity(ranks):
    """A torchtitan-style Llama 3 (2 layers, hidden 64, 8 q heads over 2 k/v heads, complex
    rotary positions) under tp and tp+sp at world 2."""
    _check(ranks(gqa.parity_llama3, 2, timeout=240), "llama3")


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_hugging_face_kv_heads_fewer_than_tp(ranks, sp):
    """Hugging Face Llama, OLMo 2 (q/k norms over the whole projections), Gemma 2 and Qwen 3 of the
    zoo (4 q heads over 2 k/v heads) at tp=4, where the k/v heads stay whole."""
    _check(ranks(gqa.parity_zoo, 4, ["llama", "olmo2", "gemma2", "qwen3"], sp, timeout=360), f"zoo tp=4 sp={sp}")
