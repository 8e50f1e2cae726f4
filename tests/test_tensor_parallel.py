"""Tensor and sequence parallelism: parity on real processes, the collectives one block gets, the
activation memory, and the errors for layouts that cannot be split (the bytes: test_bytes.py).

Parity tolerance is ``autopar.testing.parity``'s (fp32, scaled error <= 1 at rtol 1e-4, atol
1e-5, 1e-6 for gradients): tensor parallelism sums the same products in another order (each
rank a part of every contraction, then an all-reduce), which leaves relative differences
of about 1e-6.
"""
import pytest
import torch

import autopar
from autopar import meta
from autopar.models import GPTConfig, TinyGPT, TinyMLP, gpt_batch
from autopar.testing import fake_rank

from jobs import tensor_parallel
from jobs.common import MODES, mlp_batch


def _check(reports, label):
    for r in reports:
        for key, rep in r.items():
            assert rep.ok, (f"{label} {key} rank {rep.rank}: output {rep.output_err:.3g} loss {rep.loss_err:.3g} "
                            f"grad {rep.grad_err:.3g} param {rep.param_err:.3g} noise {rep.noise_param_err:.3g} "
                            f"{rep.messages}")
            assert len(rep.losses) == 3 and rep.ref_losses[-1] < rep.ref_losses[0]


OVERLAP = [{}, {"overlap": False}]     # both ways: the overlap pass on (the default) and off


_TP_VARIANTS = [("tp", False, {}), ("tp+sp", True, {}), ("tp-overlap-off", False, {"overlap": False}),
                ("tp+sp-overlap-off", True, {"overlap": False}), ("tp+sp-collective-matmul", True, {"collective_matmul": True})]
# overlap off at tp=2 (and in the dp=2 x tp=2 tests below), every variant else at tp=2 and tp=4
_TP_CASES = [pytest.param(world, world, sp, kw, id=f"tp{world}-{name}") for world in (2, 4)
             for name, sp, kw in _TP_VARIANTS if world == 2 or kw.get("overlap", True)]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("world,tp,sp,kw", _TP_CASES)
def test_parity_tensor_parallel(ranks, world, tp, sp, kw):
    _check(ranks(tensor_parallel.parity_tp, world, tp, sp, ("ddp",), ("mlp", "gpt"), kw, timeout=300),
           f"tp={tp} sp={sp} {kw}")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kw", OVERLAP, ids=["", "overlap-off"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_parity_dp2_tp2_every_dp_mode(ranks, sp, kw):
    # overlap off: ZeRO-3 only, whose gathers and buckets the overlap pass moves most (every
    # dp mode runs without overlap in test_parity.py)
    modes = MODES if not kw else ("zero3",)
    _check(ranks(tensor_parallel.parity_tp, 4, 2, sp, modes, ("mlp", "gpt"), kw, timeout=500),
           f"dp=2 x tp=2 sp={sp} {kw}")


# ---- the graph ------------------------------------------------------------------------------

def _compile(model, inputs, plan, **mesh):
    return autopar.compile(model, autopar.Mesh(virtual=True, rank=0, **mesh), example_inputs=inputs, plan=plan)


_STARTED = {"all_gather": "tp_gather", "all_reduce": "tp_all_reduce", "reduce_scatter": "tp_reduce_scatter"}


def _tp_nodes(dm):
    """(function name, args) of each tp node of the emitted graph; a collective the overlap
    pass split into tp_start / tp_wait counts once, as the function it replaced."""
    out = []
    for n in dm.module.graph.nodes:
        name = getattr(n.target, "__name__", "") if n.op == "call_function" else ""
        if name == "tp_start":
            out.append((_STARTED[n.args[0]], n.args[1:]))
        elif name == "tp_copy_linear":       # Megatron's f fused with the linear that reads it
            out.append(("tp_copy", (n.args[0], n.args[3])))
        elif name.startswith("tp_") and name != "tp_wait":
            out.append((name, n.args))
    return out


@pytest.mark.parametrize("layers", [1, 2])
def test_megatron_block_collectives(layers):
    """tp: per block exactly 2 all-reduces in forward (after the attention and MLP row
    products) and their conjugates in backward (Megatron's f before the qkv and fc column
    products); nothing else moves: the tied LM head stays replicated (at this size the cost
    model keeps it whole: test_lm_head.py)."""
    c = GPTConfig(layers=layers)
    tok, _ = gpt_batch(c, 8)
    dm = _compile(TinyGPT(c), (tok,), autopar.Plan(tp=True), tp=2)
    kinds = sorted(name for name, _ in _tp_nodes(dm))
    assert kinds == sorted(["tp_all_reduce"] * 2 * layers + ["tp_copy"] * 2 * layers), kinds
    tp = dm.ctx.tp_params
    for i in range(layers):
        assert str(tp[f"blocks.{i}.qkv.weight"]) == "S(0) interleaved x3"
        assert str(tp[f"blocks.{i}.fc.weight"]) == "S(0)"
        assert str(tp[f"blocks.{i}.proj.weight"]) == str(tp[f"blocks.{i}.out.weight"]) == "S(1)"
        assert str(tp[f"blocks.{i}.proj.bias"]) == "R"          # added once, after the all-reduce
    assert str(tp["wte.weight"]) == "R"                         # tied to the head: kept whole


@pytest.mark.parametrize("layers", [1, 2])
def test_sequence_parallel_block_collectives(layers):
    """tp+sp: per block 2 reduce-scatters (the row products' P(sum) onto the sequence shard)
    and 2 all-gathers (before the column products; backward reduce-scatters); the only
    other traffic is entering and leaving the sequence-parallel region (the embeddings'
    slices, the gather before the replicated head) and the gradient all-reduce of the
    replicated norm and bias parameters that now see a slice of the sequence (one per layer)."""
    c = GPTConfig(layers=layers)
    tok, _ = gpt_batch(c, 8)
    dm = _compile(TinyGPT(c), (tok,), autopar.Plan(tp=True, sp=True), tp=2)
    nodes = _tp_nodes(dm)
    by = {}
    for name, args in nodes:
        by.setdefault(name, []).append(args)
    assert len(by["tp_reduce_scatter"]) == 2 * layers
    varying_gathers = [args for args in by["tp_gather"] if args[4]]
    assert len(varying_gathers) == 2 * layers          # before qkv and fc
    assert len(by["tp_gather"]) == 2 * layers + 1      # + before the (tied, replicated) head
    assert len(by["tp_split"]) == 2                    # token and position embeddings enter SP
    assert "tp_all_reduce" not in by
    assert "tp_copy" not in by                          # no activation needs Megatron's f
    # the replicated norm and bias parameters read on sequence shards: one gradient all-reduce
    # per layer (ln1, ln2 weight and bias, proj and out biases) and one for ln_f
    assert len(by["tp_param_sync"]) == layers + 1
    assert [len(args[1]) for args in by["tp_param_sync"]] == [6] * layers + [2]
    # each pointwise region between the collectives is one node of the graph
    fused = [n for n in dm.module.graph.nodes if n.op == "call_module"]
    assert [n.target for n in fused] == [f"sp_region_{k}" for k in range(2 * layers + 1)]
    ops = [[m.target.__name__ for m in dm.module.get_submodule(n.target).graph.nodes if m.op == "call_function"]
           for n in fused]
    assert ops[0] == ["add.Tensor", "layer_norm.default"]                          # embeddings, ln1
    assert ops[1] == ["add.Tensor", "add.Tensor", "layer_norm.default"]            # bias, residual, ln2
    assert all(n.meta[meta.LAYOUT] for n in fused)


def test_explain_and_dump_show_tp_layouts(tmp_path):
    c = GPTConfig(layers=1)
    tok, _ = gpt_batch(c, 8)
    dm = _compile(TinyGPT(c), (tok,), autopar.Plan(dp="zero3", tp=True, sp=True), dp=2, tp=2)
    files = dm.dump(str(tmp_path))
    text = open(next(f for f in files if f.endswith("02_collectives.txt"))).read()
    assert "dp:S(0) tp:S(1)" in text                     # layouts on both axes
    assert "reduce_scatter[tp]" in text and "needs S(1)" in text    # the collective and its reason
    assert "column-parallel" in dm.explain() and "row-parallel" in dm.explain()


# ---- what cannot be split -------------------------------------------------------------------

def test_heads_that_do_not_divide_are_an_error():
    c = GPTConfig(heads=2, dim=32)
    tok, _ = gpt_batch(c, 8)
    with pytest.raises(ValueError, match=r"leading 2 \(attention heads\) does not divide by tp=4"):
        _compile(TinyGPT(c), (tok,), autopar.Plan(tp=True), tp=4)


def test_fused_projection_parts_that_do_not_divide_are_an_error():
    c = GPTConfig(heads=3, dim=30)    # qkv parts of 30 features over tp=4
    tok, _ = gpt_batch(c, 8)
    with pytest.raises(ValueError, match="fused projection .* do not divide by tp=4"):
        _compile(TinyGPT(c), (tok,), autopar.Plan(tp=True), tp=4)


def test_uneven_features_split_unevenly():
    """A 7-feature layer over tp=2: ranks hold 4 and 3 rows (the ceil convention)."""
    x = torch.randn(8, 16)
    dm = _compile(TinyMLP(), (x,), autopar.Plan(tp=True), tp=2)
    assert dm.module.get_parameter("fc2.weight").shape == (7, 16)   # row-parallel: input features
    dm1 = autopar.compile(TinyMLP(), autopar.Mesh(tp=2, virtual=True, rank=1), example_inputs=(x,),
                          plan=autopar.Plan(tp=True))
    assert dm1.module.get_parameter("fc3.weight").shape == (8, 7)
    assert dm.module.get_parameter("fc1.weight").shape == (16, 16)


def test_user_override_by_name_pattern():
    x = torch.randn(8, 16)
    dm = _compile(TinyMLP(), (x,), autopar.Plan(tp=True, tp_layout=(("fc1.*", "R"),)), tp=2)
    tp = dm.ctx.tp_params
    assert str(tp["fc1.weight"]) == "R"
    assert str(tp["fc2.weight"]) == "S(0)"      # fc2 now reads a whole input: column-parallel
    with pytest.raises(ValueError, match="matches no parameter"):
        _compile(TinyMLP(), (x,), autopar.Plan(tp=True, tp_layout=(("nope.*", "R"),)), tp=2)


# ---- activation memory ----------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("t", [2, 4])
def test_activation_memory_per_layer(ranks, t):
    """Bytes saved for backward per layer per rank (saved-tensor hooks, distinct storages;
    one layer = the GPT with 2 layers minus with 1), against Korthikanti et al. 2022 (section
    4.2): tensor parallelism keeps the tensors outside the tensor-parallel regions whole —
    here, in fp32 with no dropout, the two LayerNorm inputs and the two column-product inputs,
    4·s·b·h·4 bytes — and divides the rest by t; sequence parallelism divides everything by
    t (the column products' inputs are kept as sequence shards and gathered again in
    backward)."""
    r = ranks(tensor_parallel.tp_activation_memory, t, timeout=240)[0]
    s, b, h = r["sbh"]
    single, whole = r["single"], 4 * s * b * h * 4
    assert r["tp"] == pytest.approx(whole + (single - whole) / t, rel=0.10)
    assert r["tp+sp"] == pytest.approx(single / t, rel=0.10)
    assert r["tp+sp"] < r["tp"]


# ---- vocabulary parallelism -----------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("t", [2, 4])
def test_vocab_parallel_parity(ranks, t):
    """Loss in the graph, the head split (Plan(vocab_parallel=True)): the tied table is split along
    its 67 rows (34/33 at t=2, 17/17/17/16 at t=4), the lookup and the cross-entropy are lowered,
    and training matches one device (more in test_lm_head.py)."""
    reports = ranks(tensor_parallel.parity_vocab_parallel, t, timeout=300)
    for sp in (False, True):
        rows = [r[("table", sp)] for r in reports]
        assert rows == [(len(range(67)[i * -(-67 // t):(i + 1) * -(-67 // t)]), 32) for i in range(t)]
    _check([{k: v for k, v in r.items() if not isinstance(k, tuple)} for r in reports], f"vocab tp={t}")


def test_vocab_parallel_never_gathers_logits():
    c = GPTConfig(layers=2)
    tok, tgt = gpt_batch(c, 8)
    dm = _compile(tensor_parallel.GPTWithLoss(c), (tok, tgt), autopar.Plan(tp=True, vocab_parallel=True), tp=2)
    kinds = sorted(name for name, _ in _tp_nodes(dm))
    assert "tp_gather" not in kinds, kinds
    assert kinds.count("tp_vocab_embedding") == 1 and kinds.count("tp_vocab_cross_entropy") == 1
    # the blocks' 2+2 per layer, the lookup's P(sum) all-reduce and f before the split head
    assert kinds.count("tp_all_reduce") == 2 * 2 + 1 and kinds.count("tp_copy") == 2 * 2 + 1
    assert str(dm.ctx.tp_params["gpt.wte.weight"]) == "S(0)"


def test_op_without_rule_runs_replicated_with_a_warning():
    """logsumexp over every dim has no sharding rule and the strategy search finds no sharded
    layout for it: its tp-sharded input is gathered, it runs replicated, and the compile says
    so (naming the op); training matches one device (the test below)."""
    x, _ = mlp_batch()
    dm = _compile(tensor_parallel.NoRuleMLP(), (x,), autopar.Plan(tp=True), tp=2)
    warnings = [n for n in dm.ctx.notes if "no sharding rule for aten.logsumexp.default" in n]
    assert len(warnings) == 1 and "runs replicated" in warnings[0]
    assert "logsumexp" in dm.explain()
    lse = next(n for n in dm.module.graph.nodes if n.target == torch.ops.aten.logsumexp.default)
    assert lse.args[0].target.__name__ == "tp_wait"       # of the gather's tp_start
    assert lse.args[0].args[0].args[0] == "all_gather"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_small_tp_models_match_one_device(ranks):
    """The op without a rule (logsumexp over every dim) and a row product read directly by a column product."""
    _check(ranks(tensor_parallel.parity_small_tp, 2, timeout=200), "small tp models")


def test_row_product_read_by_column_product():
    """The all-reduced output of a row product read directly by a column product gets g, then
    f (its gradient is a sum over tp); the parity runs in the test above."""
    x, _ = mlp_batch()
    dm = _compile(tensor_parallel.RowThenColumn(), (x,), autopar.Plan(tp=True), tp=2)
    kinds = [name for name, _ in _tp_nodes(dm)]
    assert kinds == ["tp_copy", "tp_all_reduce", "tp_copy", "tp_gather"], kinds


class _HandLinear(torch.nn.Module):
    """A projection written by hand, as Falcon's: ``x @ W.T`` (transposed as ``.T``, ``.t()`` or
    ``transpose``), then the bias added."""

    def __init__(self, i, o, how):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(o, i) * 0.1)
        self.bias = torch.nn.Parameter(torch.zeros(o))
        self.how = how

    def forward(self, x):
        w = {"T": lambda: self.weight.T, "t": lambda: self.weight.t(),
             "transpose": lambda: self.weight.transpose(0, 1)}[self.how]()
        return x @ w + self.bias


@pytest.mark.parametrize("how", ["T", "t", "transpose"])
def test_a_product_written_by_hand_is_split_as_a_linear_is(how):
    """x @ W.T is column- then row-parallel as nn.Linear is: the weights split, and the same
    collectives with the same bytes as the nn.Linear MLP's (no weight gathered)."""
    def collectives(mlp):
        with fake_rank(2, 0):
            dm = autopar.compile(mlp, autopar.Mesh(tp=2), example_inputs=(torch.randn(2, 8, 16),),
                                 plan=autopar.Plan(tp=True))
        comms = [(n.meta[meta.COMM].kind, n.meta[meta.COMM].phase, n.meta[meta.COMM].nbytes)
                 for n in dm.module.graph.nodes if meta.COMM in n.meta]
        return dm, comms

    dm, got = collectives(torch.nn.Sequential(_HandLinear(16, 64, how), torch.nn.GELU(), _HandLinear(64, 16, how)))
    layouts = {k: str(v) for k, v in dm.ctx.tp_params.items()}
    assert layouts["0.weight"] == "S(0)" and layouts["2.weight"] == "S(1)", layouts
    assert dict(dm.module.named_parameters())["0.weight"].shape == (32, 16)
    _, want = collectives(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)))
    assert got == want and all(kind == "all_reduce" for kind, *_ in got), (got, want)
