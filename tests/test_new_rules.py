"""Rules for ops that real models reach: ``new_empty`` (DeepSeek-V3's keys), ``tensor_split``
along another dim than the batch's (Mamba's scan), an index by ``arange`` over the rows
(T5Gemma's masks: written as a gather by ``passes/per_sample_index.py``), ``sort``/``argsort``
(transformers' ``grouped_mm`` experts) and a fused q/k/v viewed as ``(3, heads, head_dim)``
(ModernBERT) under tp: each checked by the brute-force validator (``passes/rules/validate.py``:
every strategy on simulated ranks against the op on the whole tensors), the refusals by their
messages on a fake process group, and the models by parity with one device on real processes
(``autopar.testing.parity``: outputs, loss, gathered gradients and parameters after AdamW steps)."""
import logging

import pytest
import torch
from torch import nn

import autopar
from autopar import meta
from autopar.passes.per_sample_index import per_sample_index
from autopar.passes.rules import OpInfo, strategies_for
from autopar.passes.rules import search
from autopar.passes.rules.samples import default_samples
from autopar.passes.rules.validate import validate
from autopar.placement import Shard
from autopar.testing import fake_rank

from jobs import new_rules
from jobs.new_rules import FusedQKV, fused_qkv_batch

aten = torch.ops.aten
NEW_OPS = (aten.new_empty.default, aten.new_empty_strided.default, aten.tensor_split.indices,
           aten.tensor_split.sections, aten.sort.stable, aten.argsort.default, aten.argsort.stable)


def _strs(op, args, kwargs=None, n=2):
    return [str(s) for s in strategies_for(OpInfo.from_call(op, args, kwargs), n=n)]


# --- rules, by the validator --------------------------------------------------------------------

def test_the_new_rules_pass_the_validator():
    samples = [s for s in default_samples() if s[0] in NEW_OPS]
    assert {s[0] for s in samples} == set(NEW_OPS)
    report = validate(samples, ns=(2, 3))
    assert report.ok, str(report)
    assert report.checked >= 60


def test_new_empty_lays_its_output_out_in_any_way():
    got = _strs(aten.new_empty.default, (torch.randn(4, 6), [4, 3, 8]))
    assert "S(0) -> S(0)" in got and "S(1) -> S(2)" in got and "P(sum) -> S(1)" in got
    # DeepSeek-V3's keys: made like the heads-sharded value they are filled from, at the local size
    x = torch.randn(2, 4, 6, 8)
    report = validate([(aten.new_empty.default, (x, [2, 4, 6, 12]), {})], ns=(2,))
    assert report.ok and report.checked > 5, str(report)


def test_tensor_split_keeps_a_shard_of_the_other_dims_with_an_empty_part():
    # Mamba's scan without a cache: tensor_split(x, [seq], dim=2) leaves an empty second part
    args = (torch.randn(4, 6, 8), [8], 2)
    got = _strs(aten.tensor_split.indices, args)
    assert "S(0) -> (S(0),S(0))" in got and "S(1) -> (S(1),S(1))" in got
    assert not any(s.startswith("S(2)") for s in got)
    report = validate([(aten.tensor_split.indices, args, {})], ns=(2, 3))
    assert report.ok, str(report)


def test_sort_and_argsort_keep_a_shard_of_the_other_dims_only():
    x = torch.randn(4, 6, 5)
    for op, args, kwargs in ((aten.sort.stable, (x,), {"stable": True, "dim": 1}), (aten.argsort.default, (x, 1), {}),
                             (aten.argsort.stable, (x,), {"stable": True, "dim": 1})):
        got = _strs(op, args, kwargs)
        assert any(s.startswith("S(0)") for s in got) and any(s.startswith("S(2)") for s in got), (op, got)
        assert not any(s.startswith("S(1)") for s in got), (op, got)


# --- "mixes samples" only where the op does ---------------------------------------------------------

class _Split(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        a, b = torch.tensor_split(self.fc(x), [8], dim=2)     # the second part is empty
        return a * 2 + b.sum(-1, keepdim=True)


class _BatchBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("bias", torch.randn(4, 8))        # sized by the batch

    def forward(self, x):
        return self.fc(x) + self.bias


class _Statistic(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return h - h.mean(dim=0)


def _refusal(model, x, dp=2):
    with fake_rank(dp, 0), pytest.raises((ValueError, NotImplementedError)) as e:
        autopar.compile(model, autopar.Mesh(dp=dp), example_inputs=(x,), plan=autopar.Plan(dp="ddp"))
    return str(e.value)


def test_tensor_split_along_another_dim_runs_under_data_parallelism():
    with fake_rank(2, 0):
        dm = autopar.compile(_Split(), autopar.Mesh(dp=2), example_inputs=(torch.randn(4, 8, 8),),
                             plan=autopar.Plan(dp="zero3"))
    node = next(n for n in dm.module.graph.nodes if n.target == aten.tensor_split.indices)
    assert node.meta[meta.STRATEGY]["dp"].inputs == (Shard(0),)


@torch.library.custom_op("autopar_test::shift_rows", mutates_args=())
def shift_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row takes its neighbour's values: columns stay apart, rows do not."""
    return x.roll(1, 0)


@shift_rows.register_fake
def _(x):
    return torch.empty_like(x)


class _Shifted(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return shift_rows(self.fc(x))


def test_an_op_without_a_rule_is_not_said_to_mix_samples(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOPAR_STRATEGY_CACHE", str(tmp_path / "strategies.json"))
    monkeypatch.setattr(search, "_memory", {})
    monkeypatch.setattr(search, "_disk", [])
    msg = _refusal(_Shifted(), torch.randn(4, 8))     # the search finds S(1) only
    assert "(autopar_test.shift_rows.default)" in msg and "has no sharding rule" in msg
    assert "cannot tell that it keeps the samples apart" in msg and "mixes samples" not in msg


def test_a_buffer_sized_by_the_batch_is_named_not_called_a_mix_of_samples():
    msg = _refusal(_BatchBuffer(), torch.randn(4, 8))
    assert "node add" in msg and "needs bias split along the batch" in msg and "mixes samples" not in msg


class _Regroup(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(x).reshape(2, -1)     # 8 rows into 2: ranks' rows line up over 2, not 4


def test_a_batch_statistic_still_mixes_samples():
    msg = _refusal(_Statistic(), torch.randn(4, 8))
    # the mean is each rank's addend of the batch's (P(avg)); subtracting it from each sample mixes them
    assert "node sub" in msg and "mixes samples of its batch" in msg and "passes/rules/pointwise." in msg
    assert "unevenly" not in msg


def test_an_uneven_split_is_told_apart_from_a_mix_of_samples():
    msg = _refusal(_Regroup(), torch.randn(8, 3), dp=4)
    assert "node reshape" in msg and "splits the batch unevenly at these sizes" in msg and "mixes" not in msg


# --- an index by arange over the rows, as a gather ---------------------------------------------------

class _RowIndex(nn.Module):
    """The three shapes of a per-row index: a mask read at broadcast positions (T5Gemma's
    ``padding_mask[batch_idx, kv_idx]``), a position per row (``logits[arange(B), last]``, a
    negative one among them) and positions per row over a tensor with more dims."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, pick):
        h = self.fc(x)                                                   # (B, 6, 8)
        b = h.shape[0]
        mask = (h[..., 0] > 0)                                           # (B, 6)
        kv = torch.arange(6) + 0
        m = mask[torch.arange(b)[:, None, None, None], kv[None, None, None, :]]   # (B, 1, 1, 6)
        last = h[torch.arange(b), pick[:, 0]]                            # (B, 8)
        many = h[torch.arange(b)[:, None], pick]                         # (B, 3, 8)
        return many.sum(1) + last + m.float().sum((1, 2))[..., :1]


def _row_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 6, 8, generator=g), torch.tensor([[0, 5, -1], [2, -6, 3], [1, 1, 4], [-2, 0, 5]])


def test_an_index_by_the_row_numbers_becomes_a_gather():
    x, pick = _row_batch()
    model = _RowIndex()
    gm = torch.export.export(model, (x, pick), strict=False).module()
    want = gm(x, pick)
    per_sample_index(gm, None)
    gm.graph.lint()
    gm.recompile()
    assert not [n for n in gm.graph.nodes if n.target == aten.index.Tensor]
    assert len([n for n in gm.graph.nodes if n.target == aten.gather.default]) == 3
    assert not [n for n in gm.graph.nodes if n.target == aten.arange.default and not n.users]
    assert torch.equal(gm(x, pick), want)


def test_the_gather_keeps_the_rows_sharded_by_the_validator():
    # T5Gemma's mask read: (B, K) at positions (B, K) along dim 1, rows sharded alike
    args = (torch.randn(4, 6), 1, torch.randint(0, 6, (4, 6)))
    assert "S(0),S(0) -> S(0)" in _strs(aten.gather.default, args)
    report = validate([(aten.gather.default, args, {})], ns=(2, 3))
    assert report.ok, str(report)


def test_an_index_by_the_row_numbers_keeps_the_batch_shard():
    x, pick = _row_batch()
    with fake_rank(2, 1):
        dm = autopar.compile(_RowIndex(), autopar.Mesh(dp=2), example_inputs=(x, pick),
                             plan=autopar.Plan(dp="zero3"))
    gathers = [n for n in dm.module.graph.nodes if n.target == aten.gather.default]
    assert len(gathers) == 3 and all(str(n.meta[meta.LAYOUT]) == "dp:S(0)" for n in gathers)


# --- a fused q/k/v viewed as (3, heads, head_dim) under tp ---------------------------------------

def test_a_fused_qkv_view_splits_the_heads_of_each_part():
    x, _ = fused_qkv_batch()
    with fake_rank(2, 0):
        dm = autopar.compile(FusedQKV(), autopar.Mesh(tp=2), example_inputs=(x,), plan=autopar.Plan(tp=True))
    assert str(dm.ctx.tp_params["wqkv.weight"].placement) == "S(0)" and dm.ctx.tp_params["wqkv.weight"].groups == 3
    view = next(n for n in dm.module.graph.nodes if n.target == aten.view.default
                and n.meta[meta.VAL].dim() == 5)
    assert view.meta[meta.STRATEGY]["tp"].output == Shard(3)
    assert list(view.args[1]) == [4, 6, 3, 2, 8]          # this rank's 2 of 4 heads, in each of q, k, v


def test_a_fused_qkv_view_whose_heads_do_not_divide_stays_whole_with_a_warning(caplog):
    x, _ = fused_qkv_batch(24)
    with fake_rank(2, 0), caplog.at_level(logging.WARNING, logger="autopar"):
        dm = autopar.compile(FusedQKV(24, 3), autopar.Mesh(tp=2), example_inputs=(x,), plan=autopar.Plan(tp=True))
    assert str(dm.ctx.tp_params["wqkv.weight"].placement) == "R"
    assert any("wqkv.weight" in r.getMessage() and "3 heads do not divide by tp=2" in r.getMessage()
               for r in caplog.records)


@pytest.mark.timeout(240)
def test_fused_qkv_parity_under_tp(ranks):
    for heads, dim in ((4, 32), (3, 24)):
        for rep, warnings in ranks(new_rules.fused_qkv_parity, 2, heads, dim):
            assert rep.ok, (heads, rep.output_err, rep.loss_err, rep.grad_err, rep.param_err, rep.messages)
            assert any("do not divide" in w for w in warnings) == (heads == 3)


# --- tiny Hugging Face models, on real processes ------------------------------------------------------

def test_modernbert_splits_the_heads_of_its_fused_qkv_under_tp():
    build, batch = new_rules.hf_model("modernbert")
    with fake_rank(2, 0):
        dm = autopar.compile(build(), autopar.Mesh(tp=2), example_inputs=(), example_kwargs=batch,
                             plan=autopar.Plan(tp=True))
    wqkv = dm.ctx.tp_params["model.layers.0.attn.Wqkv.weight"]
    assert (str(wqkv.placement), wqkv.groups) == ("S(0)", 3)


HF_CASES = [("modernbert_3_heads", "tp"), ("mixtral_grouped_mm", "tp")]
"""the Hugging Face models that reach the new rules and that the zoo does not train (ModernBERT,
DeepSeek-V3, T5Gemma and Mamba are zoo rows under every plan: tests/test_zoo_new.py)"""


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name,plan", HF_CASES, ids=[f"{n}-{p}" for n, p in HF_CASES])
def test_hugging_face_models_reaching_the_new_rules_train_as_on_one_device(ranks, name, plan):
    got = ranks(new_rules.hf_parity, 2, name, plan, timeout=500)
    for ok, summary, warnings in got:
        assert ok, f"{name} under {plan}: {summary}"
        assert any("do not divide" in w for w in warnings) == (name == "modernbert_3_heads"), warnings


def test_the_grouped_mm_experts_sort_is_refused_under_dp_with_the_way_out():
    build, batch = new_rules.hf_model("mixtral_grouped_mm")
    with fake_rank(2, 0), pytest.raises(ValueError) as e:
        autopar.compile(build(), autopar.Mesh(dp=2), example_inputs=(), example_kwargs=batch,
                        plan=autopar.Plan(dp="zero3"))
    msg = str(e.value)
    assert "(aten.sort.default)" in msg and "mixes samples" in msg and "experts_implementation='batched_mm'" in msg
