"""Activation recomputation (``Plan(recompute=...)``, ``passes/recompute.py``): the plan field,
the regions the pass makes, bitwise equality with the same plan without recomputation (the
recomputation repeats forward's ops on the same inputs and dropout masks), parity with the
single-device model, the collectives (ZeRO-3 gathers a unit once in backward, recomputation
or not), and the bytes each layer keeps against Korthikanti et al.'s table 2 forms, counted in
the tensors autograd saves and in the growth of the step's peak with the number of layers."""
import pytest
import torch

import autopar
from autopar.models import GPTConfig, TinyGPT

from jobs import memory_peak, recompute as jobs

pytestmark = pytest.mark.timeout(300)


def test_plan_recompute_field():
    assert autopar.Plan(recompute="selective").recompute == "selective"
    assert autopar.Plan.parse(str(autopar.Plan(dp="zero3", recompute=1 << 30))).recompute == 1 << 30
    assert autopar.Plan.parse("dp=zero2,recompute=full").recompute == "full"
    for bad in ("half", 0, -5, True, 1.5):
        with pytest.raises(ValueError, match="recompute"):
            autopar.Plan(recompute=bad)
    with pytest.raises(ValueError, match="splits backward"):
        autopar.Plan(pp_schedule="zero_bubble", microbatches=4, recompute="full")


class _EagerAttention(torch.nn.Module):
    """Attention written out (as Hugging Face's eager attention is): scores, scale, mask,
    softmax, dropout, the product with v."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.qkv, self.heads = torch.nn.Linear(d, 3 * d), heads

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in self.qkv(x).split(d, -1))
        scores = (q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        probs = torch.nn.functional.dropout(scores.softmax(-1), 0.1, self.training)
        return (probs @ v).transpose(1, 2).reshape(b, s, d)


def test_attention_core_of_eager_attention():
    """Selective recomputation's region in written-out attention: from the q·kᵀ product to the
    product with v, every node of the scores' size between (the inputs kept: q, k, v)."""
    from autopar.ops import op_name
    from autopar.passes.recompute import attention_cores

    gm = torch.export.export(_EagerAttention(), (torch.randn(2, 8, 16),)).module()
    (core,) = attention_cores(gm)
    names = [op_name(n.target) for n in core]
    assert names[0] == "matmul" and names[-1] == "matmul", names
    assert "softmax" in names and "dropout" in names and "masked_fill" in names
    scores = core[0].meta["val"].shape
    assert tuple(scores) == (2, 2, 8, 8)
    inside = set(core)
    kept = {a for n in core for a in n.all_input_nodes if a not in inside and a.op != "get_attr"}
    assert all(tuple(a.meta["val"].shape)[-2:] in ((8, 8), (8, 8)) or a.meta["val"].numel() < 2 * 8 * 8 * 2
               for a in kept)      # q, kᵀ, v (and the causal mask), none of the scores' size but the mask


def test_zero3_full_recompute_is_bitwise_the_plan_without_and_gathers_once(ranks):
    """ZeRO-3 with full recomputation at world 2: outputs, loss, gradients and parameters after
    two AdamW steps equal the same plan without recomputation bit for bit (dropout 0.1); every
    layer ran again in backward; the collectives per step are the same, so backward gathers
    each unit once (the recomputation and the gradients share it). explain lists the regions."""
    r = ranks(jobs.bitwise, 2, [("zero3 full", {"dp": 2}, {"dp": "zero3", "recompute": "full"})], timeout=240)
    for rank in r:
        got = rank["zero3 full"]
        assert got["diff"] == []
        assert got["recomputes"] == [("blocks.0", "full", 2), ("blocks.1", "full", 2)]
        assert got["calls_rc"] == got["calls"]
        assert got["calls"]["dp/all_gather/backward"] == got["units"] == 3   # each unit once: 2 layers, the rest


@pytest.mark.slow
def test_recompute_is_bitwise_the_plan_without_under_every_parallelism(ranks, local_cluster):
    cases = [("zero2 selective", {"dp": 2}, {"dp": "zero2", "recompute": "selective"}),
             ("tp full", {"tp": 2}, {"tp": True, "recompute": "full"}),
             ("tp+sp full", {"tp": 2}, {"tp": True, "sp": True, "recompute": "full"}),
             ("tp+sp selective", {"tp": 2}, {"tp": True, "sp": True, "recompute": "selective"}),
             ("pp 1f1b full", {"pp": 2}, {"pp_schedule": "1f1b", "microbatches": 2, "recompute": "full"}),
             ("pp interleaved selective", {"pp": 2}, {"pp_schedule": "interleaved", "microbatches": 2,
                                                      "virtual_stages": 2, "recompute": "selective"})]
    for rank in ranks(jobs.bitwise, 2, cases, 2, 8, GPTConfig(dropout=0.1, layers=4), local_cluster[0], timeout=280):
        for name, got in rank.items():
            assert got["diff"] == [], name
            assert got["recomputes"] and all(n > 0 for _, _, n in got["recomputes"]), name
            # the bytes of a step, the recomputed forward's tp collectives included, as predicted
            for axis, nbytes in got["predicted"].items():
                assert got["bytes"][axis] == nbytes, (name, axis, got["bytes"], got["predicted"])
            # recomputation issues only the collectives forward issues (full: a layer's tp ones again)
            for key, calls in got["calls"].items():
                assert got["calls_rc"][key] >= calls, (name, key)
                if "/backward" in key and not key.startswith("tp/all_gather"):
                    assert got["calls_rc"][key] == calls, (name, key)


@pytest.mark.slow
def test_recompute_world_4_composes_zero3_with_tp_and_sp(ranks):
    cases = [("zero3 x tp+sp full", {"dp": 2, "tp": 2}, {"dp": "zero3", "tp": True, "sp": True, "recompute": "full"})]
    for rank in ranks(jobs.bitwise, 4, cases, 2, 8, timeout=280):
        for name, got in rank.items():
            assert got["diff"] == [], name
            assert got["recomputes"], name


@pytest.mark.slow
def test_recompute_parity_with_the_single_device_model(ranks):
    cases = [("zero3 full", {"dp": 2}, {"dp": "zero3", "recompute": "full"}),
             ("tp+sp selective", {"tp": 2}, {"tp": True, "sp": True, "recompute": "selective"}),
             ("tp full", {"tp": 2}, {"tp": True, "recompute": "full"}),
             ("pp full", {"pp": 2}, {"pp_schedule": "1f1b", "microbatches": 2, "recompute": "full"})]
    for rank in ranks(jobs.recompute_parity, 2, cases, timeout=280):
        for name, got in rank.items():
            assert got["ok"], (name, got)


def _korthikanti(s, b, h, a, t, sp_, recompute, e=4, m=1):
    """Korthikanti et al. (MLSys 2023) table 2 per layer, written for activations of ``e``
    bytes and dropout masks of ``m`` (the paper: e = 2, m = 1, giving 34 and 5). A layer keeps
    the inputs of both norms and of both column products (4e), the two hidden dropout masks
    (2m), q, k and v (3e), the attention output (e), the MLP's GeLU input and output (8e); the
    attention core keeps softmax's output (e), its dropout mask (m) and the dropout's output
    (e) per a·s² elements. Tensor parallelism splits what lies between f and g (12e, the core);
    sequence parallelism splits the rest too. Plus what the paper leaves out: each layer norm's
    mean and 1/std (4 bytes a row, two per norm, rows on sequence shards under sp)."""
    split = 1 / t
    rows = s * b * (split if sp_ else 1)
    stats = 2 * 2 * rows * 4
    if recompute == "full":
        return s * b * h * e * (split if sp_ else 1)
    core = 0 if recompute == "selective" else a * s * s * b * (2 * e + m) * split
    if sp_:
        return s * b * h * (16 * e + 2 * m) * split + core + stats
    return s * b * h * (4 * e + 2 * m + 12 * e * split) + core + stats


@pytest.mark.slow
@pytest.mark.parametrize("sp_", [False, True], ids=["tp", "tp+sp"])
def test_bytes_kept_per_layer_are_korthikanti_table_2(ranks, sp_):
    """The bytes autograd saves in one forward (parameters aside), measured with one layer more
    and one less: the difference is one layer's, exactly the table's form for none, selective
    and full recomputation at tp=2 (GPT with dropout 0.1, fp32, one-byte masks)."""
    c = GPTConfig(dropout=0.1, layers=2)
    b = 8
    cases = [({"tp": 2}, {"tp": True, "sp": sp_, "recompute": rc}) for rc in ("none", "selective", "full")]
    for per_rank in ranks(memory_peak.saved_bytes_per_layer_all, 2, c, b, cases, timeout=250):
        for (_, kw), r in zip(cases, per_rank):
            assert r[3] - r[2] == _korthikanti(c.seq, b, c.dim, c.heads, 2, sp_, kw["recompute"]), (kw, r)


def _replay_state_bytes(recompute):
    """What a recomputed layer holds between steps instead of its dropout masks: a site inside
    a recomputed region keeps no mask but the CPU generator's state before its draw
    (``torch.get_rng_state()``, 5,056 bytes), to draw the same mask again where it is used;
    one site per layer under selective recomputation (the attention's), three under full (the
    attention's and the two hidden dropouts). Without recomputation the masks are the ones
    autograd saves (table 2 counts them)."""
    return {"none": 0, "selective": 1, "full": 3}[recompute] * torch.get_rng_state().numel()


def _state_bytes_per_layer(h, t, adam_steps=12):
    """fp32 parameters and AdamW's two moments of one block on a tp rank (12 bytes a
    parameter), plus AdamW's step count, a 4-byte tensor per parameter tensor (12 a block).
    The block's parameters: two norms (2h each, replicated), qkv (3h² + 3h) and fc (4h² + 4h)
    split by columns, proj and out split by rows (h² and 4h², each bias h replicated)."""
    psi = 2 * 2 * h + (3 * h * h + 3 * h + h * h + 4 * h * h + 4 * h + 4 * h * h) / t + 2 * h
    return 12 * psi + 4 * adam_steps, psi


DEEP = GPTConfig(vocab=64, seq=32, dim=32, heads=4, layers=2, max_seq=32, dropout=0.1)
DEEP_BATCH = 32


@pytest.mark.slow
def test_peak_grows_per_layer_by_korthikanti_table_2(ranks):
    """Activation bytes per layer measured from the step's peak: the same GPT at 2 and 4
    layers, per-layer growth (peak(4) - peak(2)) / 2 less each layer's model state (the
    census between steps grows by exactly that: parameters, AdamW's moments and step counts;
    no gradient, see below). Against table 2 for none, selective and full recomputation
    under tp = 2 and tp + sp. A recomputed region's dropout masks are drawn again where they
    are used, not held through the step (Megatron's way): what a recomputed layer holds
    instead, the generator state before each of its draws, is part of its state between steps
    (``_replay_state_bytes``), so the per-layer activations are table 2's exactly.

    Where the peak is: in the top layer's backward, every layer's kept activations still
    alive and no lower layer's gradients yet, a moment at the same place in both depths; the
    top layer's working set (its recomputation, its gradients) appears once in both and
    cancels. That holds while a layer keeps more than its gradients take (under full + sp
    s·b·h·4/t against 4·Ψ_layer: here 65,536 against 25,792 bytes); below that the peak is
    in the bottom layer's backward and grows per layer by the gradients instead
    (ACTIVATION_HEAVY: 65,536 against 100,736). Each depth's peak is the smaller of one
    profiled step on each of the 2 ranks (tp ranks hold the same bytes): with the collectives
    settled (``memory_peak.collectives_settled``) the steps agree to the byte (3 steps a case on
    both ranks, measured twice, all agree; one step rather than 2 saves a third of the test's
    time), and a step where the profiler missed a free only reads higher.

    Tolerance 2%: the measurement is exact (every term is whole tensors' bytes), and 2% is
    under half of what holding selective's attention masks through the step would add (4.5%,
    a·s²·b/t): 10% would not tell the two apart."""
    s, b, h, a, t = DEEP.seq, DEEP_BATCH, DEEP.dim, DEEP.heads, 2
    state, psi = _state_bytes_per_layer(h, t)
    cases = [(f"{name} {rc}", {"tp": t}, {"tp": True, "sp": name == "tp+sp", "recompute": rc})
             for name in ("tp", "tp+sp") for rc in ("none", "selective", "full")]
    assert _korthikanti(s, b, h, a, t, True, "full") > 4 * psi     # the peak stays at the top layer
    per_rank = ranks(memory_peak.depth_peaks, 2, cases, (2, 4), DEEP, b, 1, timeout=200)
    for name, _, kw in cases:
        peak = {n: min(p for r in per_rank for p in r[n][name]["peaks"]) for n in (2, 4)}
        base = {n: [r[n][name]["base"] for r in per_rank] for n in (2, 4)}
        held = state + _replay_state_bytes(kw["recompute"])
        assert [(b4 - b2) / 2 for b2, b4 in zip(base[2], base[4])] == [held, held], (name, base)
        measured = (peak[4] - peak[2]) / 2 - held
        table = _korthikanti(s, b, h, a, t, kw["sp"], kw["recompute"])
        assert measured == pytest.approx(table, rel=0.02), (name, measured, table, peak)


def test_explain_lists_what_each_region_keeps(ranks):
    text = ranks(jobs.explained, 2, {"tp": 2}, {"tp": True, "sp": True, "recompute": "full"}, timeout=200)[0]
    assert "activation recomputation (recompute='full'): 2 regions" in text
    assert "blocks.1     full      keeps 8,192 B" in text        # the layer's input, a sequence shard
    assert "without recomputation" in text


def test_a_plan_that_recomputes_nothing_says_why(caplog):
    """Selective recomputation of a GPT whose attention is a fused kernel (no dropout: it keeps
    no a·s² scores) has nothing to drop: a warning naming the cause, not a silent no-op."""
    c = GPTConfig()
    x = torch.randint(0, c.vocab, (4, c.seq))
    with caplog.at_level("WARNING", logger="autopar"):
        dm = autopar.compile(TinyGPT(c), autopar.Mesh(dp=1, virtual=True), example_inputs=(x,),
                             plan=autopar.Plan(recompute="selective"))
    assert "recomputes nothing" in caplog.text and "attention core" in caplog.text
    assert not [m for m in dm.modules() if hasattr(m, "recomputes")]
    full = autopar.compile(TinyGPT(c), autopar.Mesh(dp=1, virtual=True), example_inputs=(x,),
                           plan=autopar.Plan(recompute="full"))
    assert sorted(m.layer for m in full.modules() if hasattr(m, "recomputes")) == ["blocks.0", "blocks.1"]
