"""LM heads under tensor parallelism (passes/lm_head.py, cost/lm_head.py): which products are heads,
the bytes a step moves with the head split along the vocabulary (simulated ranks, against
formulas written here), the cost model's choice between the two layouts and its line in explain,
and parity with one device on real processes.

Notation: t ranks, b·s tokens on a rank, h features, V words (``chunk(V, t)`` = ceil(V/t) on a
rank), L layers, 4-byte floats. A ring all-reduce of n bytes sends 2(t−1)/t·n per rank, an
all-gather or reduce-scatter (t−1)/t·n (n: the whole buffer).
"""
import math

import pytest
import torch

import autopar
from autopar.capture import capture
from autopar.context import CompileContext
from autopar.cost.lm_head import head_policy
from autopar.cost.profile import profile
from autopar.models import GPTConfig, TinyGPT, TinyMLP, gpt_batch
from autopar.passes.lm_head import HeadChoice, find_heads
from autopar.testing import fake_rank

from jobs import lm_head

pytestmark = pytest.mark.timeout(300)

TINY = GPTConfig()          # vocab 67, seq 16, dim 32, 2 layers; batch 8
HF = dict(V=96, h=32, L=2, b=4, s=16)       # jobs.lm_head.hf_lm, hf_batch(4)


def ar(n, t):
    return 2 * (t - 1) / t * n


def ag(n, t):
    return (t - 1) / t * n


def ceil(a, b):
    return -(-a // b)


# ---- bytes per step on a simulated rank --------------------------------------------------------------

@pytest.mark.parametrize("t", [2, 4])
def test_tied_head_split_logits_returned_bytes(t):
    """TinyGPT (tied, logits returned) split: besides Megatron's 2 + 2 all-reduces of b·s·h per
    layer, the lookup's P(sum) is all-reduced (forward), the head's input gradient too (f,
    backward), and the logits are all-gathered at the output, padded to t chunks of ceil(V/t)
    words; backward of the gather moves nothing. Kept whole, only the layers move."""
    with fake_rank(t, t - 1):
        split = lm_head.head_bytes("tiny", True)
        whole = lm_head.head_bytes("tiny", False)
    b, s, h, V, L = 8, TINY.seq, TINY.dim, TINY.vocab, TINY.layers
    act = b * s * h * 4
    assert split == pytest.approx({("all_reduce", "forward"): (2 * L + 1) * ar(act, t),
                                   ("all_reduce", "backward"): (2 * L + 1) * ar(act, t),
                                   ("all_gather", "forward"): ag(b * s * ceil(V, t) * t * 4, t)}, abs=1e-6)
    assert whole == pytest.approx({("all_reduce", "forward"): 2 * L * ar(act, t),
                                   ("all_reduce", "backward"): 2 * L * ar(act, t)}, abs=1e-6)


@pytest.mark.parametrize("t", [2, 4])
def test_vocab_parallel_cross_entropy_bytes(t):
    """Loss in the graph (log_softmax + nll_loss, folded into one vocab-parallel cross-entropy):
    no logits move; the cross-entropy all-reduces three fp32 values per row (max, sum of exp,
    target logit), b·s rows."""
    with fake_rank(t, t - 1):
        got = lm_head.head_bytes("nll", True)
    b, s, h, L = 8, TINY.seq, TINY.dim, TINY.layers
    act = b * s * h * 4
    assert got == pytest.approx({("all_reduce", "forward"): (2 * L + 1) * ar(act, t) + 3 * ar(b * s * 4, t),
                                 ("all_reduce", "backward"): (2 * L + 1) * ar(act, t)}, abs=1e-6)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hugging_face_labels_path_bytes(name):
    """GPT-2 and Llama (tie_word_embeddings, ``labels=``: the cross-entropy in the graph, the logits
    returned beside the loss) split at tp=2: the cross-entropy's 3 values per row, the logits gathered once
    for the returned ``.logits``, the lookup's all-reduce and the head's f."""
    t = 2
    with fake_rank(t, 1):
        got = lm_head.head_bytes(name, True)
    V, h, L, b, s = (HF[k] for k in ("V", "h", "L", "b", "s"))
    act = b * s * h * 4
    assert got == pytest.approx({("all_reduce", "forward"): (2 * L + 1) * ar(act, t) + 3 * ar(b * s * 4, t),
                                 ("all_reduce", "backward"): (2 * L + 1) * ar(act, t),
                                 ("all_gather", "forward"): ag(b * s * ceil(V, t) * t * 4, t)}, abs=1e-6)


def test_sequence_parallel_split_adds():
    """tp+sp, t=2: the split adds the lookup's reduce-scatter (forward), the head input's
    reduce-scatter (backward of its all-gather, which the whole head has too) and its re-gather
    for the weight gradient (the column input kept as its sequence shard), and the logits'
    all-gather; everything else is the same."""
    t = 2
    with fake_rank(t, 1):
        split = lm_head.head_bytes("tiny", True, sp=True)
        whole = lm_head.head_bytes("tiny", False, sp=True)
    b, s, h, V = 8, TINY.seq, TINY.dim, TINY.vocab
    act = b * s * h * 4
    extra = {k: split.get(k, 0.0) - whole.get(k, 0.0) for k in set(split) | set(whole)}
    assert {k: v for k, v in extra.items() if v} == pytest.approx({
        ("reduce_scatter", "forward"): ag(act, t), ("reduce_scatter", "backward"): ag(act, t),
        ("all_gather", "backward"): ag(act, t), ("all_gather", "forward"): ag(b * s * ceil(V, t) * t * 4, t)},
        abs=1e-6)


# ---- the graph -------------------------------------------------------------------------------------

def _ctx(model, inputs, tp=2, **plan):
    """The context and captured graph of ``model`` for Mesh(tp=tp) (virtual)."""
    ctx = CompileContext(mesh=autopar.Mesh(tp=tp, virtual=True), plan=autopar.Plan(tp=True, **plan))
    return capture(model, inputs, {}, ctx), ctx


def test_which_products_are_heads():
    """Tied (the table the lookup reads), untied (shaped like a looked-up table, logits returned),
    the loss in the graph; not the MLP's last product, which no table or loss marks."""
    c = GPTConfig(layers=1)
    tok, tgt = gpt_batch(c, 4)
    gm, ctx = _ctx(TinyGPT(c), (tok,))
    (head,) = find_heads(gm, ctx)
    assert (head.weight, head.choice.tied, head.choice.losses, head.choice.gathered) == ("wte.weight", True, 0, True)
    assert head.choice.tokens == 4 * c.seq and head.choice.vocab == c.vocab
    gm, ctx = _ctx(lm_head.UntiedGPT(c), (tok,))
    assert [(h.weight, h.choice.tied) for h in find_heads(gm, ctx)] == [("head.weight", False)]
    gm, ctx = _ctx(lm_head.NllGPT(c), (tok, tgt))
    (head,) = find_heads(gm, ctx)
    assert (head.choice.losses, head.choice.gathered) == (1, False)
    gm, ctx = _ctx(TinyMLP(), (torch.randn(8, 16),))
    assert find_heads(gm, ctx) == []


def test_split_graph_lowers_lookup_and_loss():
    """Split with the loss in the graph: the lookup and the cross-entropy are lowered (the
    log_softmax folded in), nothing gathers the logits, the table is split along the vocabulary."""
    c = GPTConfig(layers=2)
    tok, tgt = gpt_batch(c, 8)
    dm = autopar.compile(lm_head.NllGPT(c), autopar.Mesh(tp=2, virtual=True), example_inputs=(tok, tgt),
                         plan=autopar.Plan(tp=True, vocab_parallel=True))
    names = [getattr(n.target, "__name__", str(n.target)) for n in dm.module.graph.nodes]
    assert names.count("tp_vocab_embedding") == 1 and names.count("tp_vocab_cross_entropy") == 1
    assert "log_softmax.int" not in " ".join(names) and "tp_gather" not in names
    assert str(dm.ctx.tp_params["gpt.wte.weight"]) == "S(0)"
    assert dm.module.get_parameter("gpt.wte.weight").shape == (34, 32)


def test_pipeline_stages_split_the_tied_table_alike():
    """Mesh(pp=2, tp=2): the lookup's stage and the head's stage hold the tied table split alike."""
    c = GPTConfig(layers=2)
    tok, _ = gpt_batch(c, 4)
    dm = autopar.compile(TinyGPT(c), autopar.Mesh(pp=2, tp=2, virtual=True), example_inputs=(tok,),
                         plan=autopar.Plan(tp=True, vocab_parallel=True, pp_schedule="1f1b", microbatches=2))
    assert str(dm.stages["0"].ctx.tp_params["wte.weight"]) == "S(0)"
    assert dm.stages["0"].module.get_parameter("wte.weight").shape == (34, 32)
    assert any(line.startswith("lm head wte.weight") for line in dm.ctx.notes)


# ---- the choice ------------------------------------------------------------------------------------

def _choice(tokens, hidden, vocab, t, itemsize=2, losses=0, gathered=True, tied=True, sp=False):
    return HeadChoice("w", tied, losses, gathered, tokens, hidden, vocab, itemsize, itemsize, (("tp", t),), sp)


def test_cost_model_prices_both_layouts():
    """The split divides the head's FLOPs and logits by t (ceil(V/t) words) and adds the
    collectives of the module docstring; a 530B-scale head (h 20480, V 51200, 2048 tokens, tp=8)
    splits on a DGX H100, the small GPT's stays whole (the collectives' latency exceeds what the
    split saves); logits that do not fit split whatever the time."""
    big = _choice(2048, 20480, 51200, 8)
    s, w = big.cost(True), big.cost(False)
    assert w.flops == 6 * 2048 * 20480 * 51200 and s.flops == w.flops / 8
    assert s.logits_bytes == 2048 * 6400 * 2 and w.tp_bytes == 0
    act = 2048 * 20480 * 2
    assert s.tp_bytes == pytest.approx(2 * ar(act, 8) + ag(2048 * 51200 * 2, 8))
    split, why = head_policy("dgx-h100")(big)
    assert split and "faster on dgx-h100" in why
    split, why = head_policy("dgx-h100")(_choice(8 * 16, 32, 67, 2, itemsize=4))
    assert not split and "not faster" in why
    # tp+sp, the small GPT: what the split adds, as measured in test_sequence_parallel_split_adds
    small = _choice(8 * 16, 32, 67, 2, itemsize=4, sp=True)
    act = 8 * 16 * 32 * 4
    assert small.cost(True).tp_bytes - small.cost(False).tp_bytes == pytest.approx(
        3 * ag(act, 2) + ag(8 * 16 * 34 * 2 * 4, 2))
    huge = _choice(2 ** 20, 8192, 2 ** 18, 2, gathered=False, losses=1)
    split, why = head_policy("dgx-h100")(huge)
    assert split and "do not fit" in why


def test_profile_models_the_split_head():
    """The cost model's profile of the compiled graph: the head's FLOPs divided by t, the logits'
    gather and the cross-entropy's all-reduces on the tp axis."""
    c = GPTConfig(layers=1)
    tok, tgt = gpt_batch(c, 8)
    ctx = CompileContext(mesh=autopar.Mesh(dp=1, virtual=True), plan=autopar.Plan())
    gm = capture(lm_head.NllGPT(c), (tok, tgt), {}, ctx)
    split = profile(gm, ctx, tp=2, vocab_parallel=True).groups[-1]
    whole = profile(gm, ctx, tp=2, vocab_parallel=False).groups[-1]
    head = 2 * 8 * c.seq * c.dim * c.vocab
    assert whole.dense_flops - split.dense_flops == pytest.approx(head / 2)
    rows = 8 * c.seq
    assert sorted(split.tp_forward) == sorted([("all_reduce", 3 * ar(rows * 4, 2), True)])
    assert whole.tp_forward == []


def test_explain_says_which_and_why():
    c = GPTConfig(layers=1)
    tok, _ = gpt_batch(c, 4)
    mesh = autopar.Mesh(tp=2, virtual=True)
    dm = autopar.compile(TinyGPT(c), mesh, example_inputs=(tok,), plan=autopar.Plan(tp=True), cluster="dgx-h100")
    lines = [x for x in dm.explain().splitlines() if "lm head wte.weight" in x and "over tp=2" in x]
    assert len(lines) == 1 and "kept whole" in lines[0] and "not faster on dgx-h100" in lines[0], lines
    dm = autopar.compile(TinyGPT(c), mesh, example_inputs=(tok,), plan=autopar.Plan(tp=True, vocab_parallel=True))
    lines = [x for x in dm.explain().splitlines() if "lm head wte.weight" in x and "over tp=2" in x]
    assert len(lines) == 1 and "split along the vocabulary" in lines[0] and "Plan(vocab_parallel=True)" in lines[0]


def test_vocabulary_smaller_than_tp():
    """A vocabulary that leaves a rank without words stays whole; asked to split, it is an error."""
    c = GPTConfig(vocab=3, layers=1)
    tok, _ = gpt_batch(c, 4)
    mesh = autopar.Mesh(tp=4, virtual=True)
    dm = autopar.compile(TinyGPT(c), mesh, example_inputs=(tok,), plan=autopar.Plan(tp=True))
    assert str(dm.ctx.tp_params["wte.weight"]) == "R"
    with pytest.raises(ValueError, match="vocabulary of 3 rows leaves some of tp=4 ranks without rows"):
        autopar.compile(TinyGPT(c), mesh, example_inputs=(tok,), plan=autopar.Plan(tp=True, vocab_parallel=True))


# ---- parity on real processes ------------------------------------------------------------------------

def _check(reports, label):
    for r in reports:
        for key, rep in r.items():
            assert rep.ok, (f"{label} {key} rank {rep.rank}: output {rep.output_err:.3g} loss {rep.loss_err:.3g} "
                            f"grad {rep.grad_err:.3g} param {rep.param_err:.3g} {rep.messages}")
            assert not math.isnan(rep.losses[-1]) and rep.ref_losses[-1] < rep.ref_losses[0]


def test_split_heads_match_one_device(ranks):
    """tp=2: the tied head with log_softmax + nll_loss in the graph (ignored labels), and an
    untied head whose logits are gathered at the output."""
    _check(ranks(lm_head.parity_small_heads, 2, timeout=200), "small heads tp=2")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("t", [2, 4])
def test_hugging_face_split_head_matches_one_device(ranks, t):
    """GPT-2 and Llama with tied embeddings, trained with ``labels=`` (some -100), the head split
    along the vocabulary (96 words: 48 or 24 a rank), tp and tp+sp."""
    _check(ranks(lm_head.parity_hf, t, timeout=500), f"hf tp={t}")


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_tied_head_logits_returned_matches_one_device(ranks, sp):
    """tp=4 (67 words: 17, 17, 17, 16): the tied table split, the logits gathered at the output."""
    _check(ranks(lm_head.parity_tied_logits, 4, sp, timeout=300), f"tied tp=4 sp={sp}")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_dp_by_tp_and_pipeline(ranks):
    """dp=2 x tp=2 and pp=2 x tp=2 (the tied table split in both stages)."""
    _check(ranks(lm_head.parity_dp_tp, 4, timeout=300), "dp=2 x tp=2")
    _check(ranks(lm_head.parity_pipeline_tied, 4, timeout=300), "pp=2 x tp=2")
