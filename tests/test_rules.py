"""The sharding-rule registry: the brute-force validator finds every rule right, the
tensor-parallel strategies are there, a wrong rule is caught, and the ops of a GPT-2 and a
Llama-style block all have rules (checked on their real calls)."""
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from autopar.models import GPTConfig, TinyGPT, gpt_batch
from autopar.passes.rules import (RULES, OpInfo, Strategy, localize, strategies_for)
from autopar.passes.rules.validate import check_strategy, validate
from autopar.placement import Partial, Replicate, Shard

aten = torch.ops.aten


def _strs(op, args, kwargs=None, n=2):
    return [str(s) for s in strategies_for(OpInfo.from_call(op, args, kwargs), n=n)]


# --- a Llama-style block: RMSNorm by hand, rotary embedding, grouped k/v heads, SiLU MLP ---

class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class LlamaBlock(nn.Module):
    def __init__(self, dim=32, heads=4, kv_heads=2, hidden=64, max_seq=32):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, self.hd, 2).float() / self.hd))
        ang = torch.outer(torch.arange(max_seq).float(), inv)
        self.register_buffer("cos", torch.cat((ang, ang), -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat((ang, ang), -1).sin(), persistent=False)

    def forward(self, x):
        b, s, d = x.shape
        h = self.norm1(x)
        q = self.wq(h).view(b, s, self.heads, self.hd).transpose(1, 2)
        k = self.wk(h).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        v = self.wv(h).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        cos, sin = self.cos[:s], self.sin[:s]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = self.heads // self.kv_heads     # grouped k/v heads repeated for each q head
        k = k[:, :, None].expand(b, self.kv_heads, rep, s, self.hd).reshape(b, self.heads, s, self.hd)
        v = v[:, :, None].expand(b, self.kv_heads, rep, s, self.hd).reshape(b, self.heads, s, self.hd)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, d))
        h = self.norm2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class ManualAttention(nn.Module):
    """nanoGPT-style attention: explicit causal mask buffer, masked_fill, softmax, matmul."""

    def __init__(self, dim=32, heads=4, seq=8):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.register_buffer("bias", torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq))

    def forward(self, x, y):
        b, s, c = x.shape
        q, k, v = (t.view(b, s, self.heads, c // self.heads).transpose(1, 2)
                   for t in self.qkv(x).split(c, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (c // self.heads) ** 0.5)
        att = F.softmax(att.masked_fill(self.bias[:, :, :s, :s] == 0, float("-inf")), dim=-1)
        o = self.proj((att @ v).transpose(1, 2).contiguous().view(b, s, c)).float().type_as(x)
        causal = torch.tril(torch.ones_like(o[0]))
        return F.cross_entropy(o.view(-1, c), y.view(-1)) + causal.sum()


def _captured_calls(model, inputs):
    """(graph module, [(op, concrete args, kwargs)] of every call_function node)."""
    gm = torch.export.export(model, inputs, strict=False).module()
    calls = []

    class Record(fx.Interpreter):
        def call_function(self, target, args, kwargs):
            calls.append((target, args, kwargs))
            return super().call_function(target, args, kwargs)

    with torch.no_grad():
        Record(gm).run(*inputs)
    return gm, calls


GRAPHS = {
    "gpt": lambda: (TinyGPT(GPTConfig()), (gpt_batch(GPTConfig(), 4)[0],)),
    "llama": lambda: (LlamaBlock(), (torch.randn(2, 6, 32),)),
    "manual_attention": lambda: (ManualAttention(), (torch.randn(2, 6, 32), torch.randint(0, 32, (2, 6)))),
}


# --- the validator ----------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_validator_finds_every_default_sample_right():
    report = validate(ns=(2, 3))
    assert report.ok, str(report)
    assert report.checked > 1000


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_every_op_of_the_captured_models_has_a_rule_and_it_is_right(name):
    torch.manual_seed(0)
    gm, calls = _captured_calls(*GRAPHS[name]())
    ops = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert not [str(op) for op in ops if op not in RULES]
    for n in gm.graph.nodes:   # from_node reads the FakeTensors of the node and its inputs
        if n.op == "call_function":
            assert strategies_for(OpInfo.from_node(n), n=2)
    report = validate(calls, ns=(2, 3))
    assert report.ok, str(report)


def test_a_wrong_rule_is_caught(monkeypatch):
    def wrong_sum(info):   # claims the sum over a sharded dim is still sharded
        return [Strategy((Replicate(),), Replicate()), Strategy((Shard(1),), Shard(1))]
    monkeypatch.setitem(RULES, aten.sum.dim_IntList, wrong_sum)
    report = validate([(aten.sum.dim_IntList, (torch.randn(4, 6, 8), [1]), {})], ns=(2,))
    assert [f.strategy for f in report.wrong] == ["S(1) -> S(1)"] and not report.ok
    assert "shape" in report.wrong[0].detail or "error" in report.wrong[0].detail


def test_the_validator_rejects_wrong_partials_and_uneven_views():
    x, w, b = torch.randn(4, 6, 8), torch.randn(12, 8), torch.randn(12)
    info = OpInfo.from_call(aten.linear.default, (x, w, b))
    # a replicated bias on a row-parallel linear would be added once per rank
    assert check_strategy(aten.linear.default, (x, w, b), {}, info,
                          Strategy((Shard(2), Shard(1), Replicate()), Partial()), 2)
    g = (torch.randn(3, 5),)
    assert check_strategy(aten.gelu.default, g, {}, OpInfo.from_call(aten.gelu.default, g),
                          Strategy((Partial(),), Partial()), 2)
    v = (torch.randn(3, 4, 6), [12, 6])   # 3 rows over 2 ranks: 2*4 and 1*4 rows, not ceil(12/2)
    assert "invalid for input" in check_strategy(
        aten.view.default, v, {}, OpInfo.from_call(aten.view.default, v),
        Strategy((Shard(0),), Shard(0)), 2)


def test_missing_rule_is_reported():
    report = validate([(aten.logcumsumexp.default, (torch.randn(4, 6), 1), {})])
    assert report.missing == ["aten.logcumsumexp.default"] and not report.ok


# --- specific strategies ------------------------------------------------------------------

def test_linear_column_and_row_parallel():
    x, w, b = torch.randn(4, 6, 8), torch.randn(12, 8), torch.randn(12)
    with_bias = _strs(aten.linear.default, (x, w, b))
    assert with_bias[0] == "R,R,R -> R"
    assert "R,S(0),S(0) -> S(2)" in with_bias          # column parallel
    assert "S(2),S(1),P(sum) -> P(sum)" in with_bias   # row parallel: the bias is an addend too
    assert "S(2),S(1),R -> P(sum)" not in with_bias
    assert "S(0),R,R -> S(0)" in with_bias             # data parallel
    no_bias = _strs(aten.linear.default, (x, w))
    assert "R,S(0) -> S(2)" in no_bias and "S(2),S(1) -> P(sum)" in no_bias


def test_view_maps_a_shard_through_split_and_merged_dims():
    x = torch.randn(4, 16, 32)
    heads = (x, [4, 16, 4, 8])    # b,s,h -> b,s,nh,hd
    assert "S(2) -> S(2)" in _strs(aten.view.default, heads, n=2)
    assert "S(2) -> S(2)" in _strs(aten.view.default, heads, n=4)
    assert "S(2) -> S(2)" not in _strs(aten.view.default, heads, n=3)   # 4 heads over 3 ranks
    merge = (x, [64, 32])         # b,s,h -> b*s,h
    assert {"S(0) -> S(0)", "S(2) -> S(1)"} <= set(_strs(aten.reshape.default, merge, n=2))
    assert "S(1) -> S(0)" not in _strs(aten.reshape.default, merge, n=2)  # inner dim of a merge
    assert "S(0) -> S(0)" not in _strs(aten.reshape.default, (torch.randn(3, 4, 5), [12, 5]), n=2)
    back = (torch.randn(4, 16, 4, 8), [4, 16, 32])   # attention output: b,s,nh,hd -> b,s,h
    assert "S(2) -> S(2)" in _strs(aten.reshape.default, back, n=2)
    # without an axis size only the shards that are right for every size are offered
    info = OpInfo.from_call(aten.view.default, heads)
    assert "S(2) -> S(2)" not in [str(s) for s in strategies_for(info)]
    assert "S(0) -> S(0)" in [str(s) for s in strategies_for(info)]


def test_softmax_does_not_shard_its_reduced_dim():
    x = torch.randn(4, 6, 8)
    strs = _strs(aten._softmax.default, (x, -1, False))
    assert strs == ["R -> R", "S(0) -> S(0)", "S(1) -> S(1)"]


def test_reductions_over_a_sharded_dim_are_partial():
    x = torch.randn(4, 6, 8)
    assert "S(1) -> P(sum)" in _strs(aten.sum.dim_IntList, (x, [1]))
    assert "S(1) -> P(avg)" in _strs(aten.mean.dim, (x, [1]), n=2)
    assert "S(1) -> P(avg)" not in _strs(aten.mean.dim, (x, [1]), n=4)  # 6 over 4: uneven
    assert "S(1) -> P(max)" in _strs(aten.amax.default, (x, [1]))
    assert "S(2) -> S(1)" in _strs(aten.sum.dim_IntList, (x, [1]))


def test_embedding_attention_and_loss():
    emb = _strs(aten.embedding.default, (torch.randn(10, 8), torch.randint(0, 10, (4, 6))))
    assert {"R,S(0) -> S(0)", "R,S(1) -> S(1)", "S(1),R -> S(2)"} <= set(emb)
    assert not [s for s in emb if s.startswith("S(0),")]     # vocab-parallel is a lowering
    q = torch.randn(2, 4, 6, 8)
    attn = _strs(aten.scaled_dot_product_attention.default, (q, q, q), {"is_causal": True})
    assert {"S(0),S(0),S(0) -> S(0)", "S(1),S(1),S(1) -> S(1)"} <= set(attn)
    assert "S(2),R,R -> S(2)" not in attn                     # causal: rows need their offset
    assert "S(2),R,R -> S(2)" in _strs(aten.scaled_dot_product_attention.default, (q, q, q))
    logits, tgt = torch.randn(6, 5), torch.randint(0, 5, (6,))
    for reduction, out in ((0, "S(0)"), (1, "P(avg)"), (2, "P(sum)")):
        assert f"S(0),S(0) -> {out}" in _strs(aten.cross_entropy_loss.default,
                                              (logits, tgt, None, reduction))


def test_partial_rules_of_pointwise_ops():
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    add = _strs(aten.add.Tensor, (x, y))
    assert "P(sum),P(sum) -> P(sum)" in add and "P(sum),R -> P(sum)" not in add
    mul = _strs(aten.mul.Tensor, (x, y))
    assert {"P(sum),R -> P(sum)", "R,P(sum) -> P(sum)"} <= set(mul)
    assert "P(sum),P(sum) -> P(sum)" not in mul
    assert "P(max) -> P(min)" in _strs(aten.neg.default, (x,))
    assert not [s for s in _strs(aten.gelu.default, (x,)) if "P(" in s]


def test_multi_output_ops_and_getitem():
    x = torch.randn(4, 6, 9)
    assert "S(0) -> (S(0),S(0),S(0))" in _strs(aten.split.Tensor, (x, 3, -1))
    assert "S(2) -> (S(2),S(2),S(2))" not in _strs(aten.split.Tensor, (x, 3, -1))
    pieces = tuple(torch.randn(4, 6, 3) for _ in range(3))
    assert "(_,S(0),_) -> S(0)" in _strs(operator.getitem, (pieces, 1))


def test_localize_rewrites_global_sizes():
    x = torch.randn(5, 4)
    info = OpInfo.from_call(aten.view.default, (x, [5, 2, 2]))
    s = Strategy((Shard(0),), Shard(0))
    assert [localize(info, s, 2, i)[0][1] for i in range(2)] == [[3, 2, 2], [2, 2, 2]]
    info = OpInfo.from_call(aten.zeros.default, ([4, 7],))
    assert localize(info, Strategy((), Shard(1)), 3, 2)[0][0] == [4, 1]
    info = OpInfo.from_call(aten.arange.start, (2, 9))
    assert [localize(info, Strategy((), Shard(0)), 2, i)[0][:2] for i in range(2)] == [(2, 6), (6, 9)]
