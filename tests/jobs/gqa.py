"""Grouped-query and multi-query attention under tensor parallelism: a torchtitan-style Llama 3
(``Attention`` with wq/wk/wv/wo and n_kv_heads, rotary positions from a precomputed complex
``freqs_cis`` or real cos/sin, RMSNorm, SwiGLU ``FeedForward`` with w1/w2/w3), whose attention
core is spelled in each of the ways models write it:

    sdpa_gqa            scaled_dot_product_attention(q, k, v, enable_gqa=True)
    repeat_kv           torchtitan: unsqueeze + expand + reshape of (b, s, kv, d)
    repeat_interleave   torchtitan: torch.repeat_interleave(x, n_rep, dim=2)
    hf                  Hugging Face: hidden[:, :, None].expand(b, kv, n_rep, s, d).reshape(...)
    explicit            softmax(q k^T / sqrt(d) + causal mask) v, k/v repeated as Hugging Face does

Jobs: parity with the single-device model (these models, and the zoo's Hugging Face ones), and
the bytes the tp axis moves per layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autopar
from autopar import zoo
from autopar.models import lm_loss
from autopar.testing import parity

from .common import step

FORMS = ("sdpa_gqa", "repeat_kv", "repeat_interleave", "hf", "explicit")


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 32
    n_layers: int = 1
    n_heads: int = 8
    n_kv_heads: int = 2
    vocab_size: int = 64
    ffn_hidden: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 16
    form: str = "repeat_kv"
    """how the attention core is written (FORMS)"""
    rope: str = "complex"
    """rotary positions from complex freqs_cis (torchtitan) or real cos/sin tables ("real")"""


def precompute_freqs_cis(dim: int, end: int, theta: float) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    freqs = torch.outer(torch.arange(end).float(), freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    """torchtitan's: pairs of features as complex numbers, rotated by ``freqs_cis``."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    f = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    return torch.view_as_real(xq_ * f).flatten(3).type_as(xq), torch.view_as_real(xk_ * f).flatten(3).type_as(xk)


def apply_rotary_real(xq, xk, cos, sin):
    """Hugging Face's: rotate_half with real cos/sin tables of (s, head_dim)."""
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]

    def rot(x):
        a, b = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-b, a), dim=-1) * sin
    return rot(xq), rot(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """torchtitan's: (bs, slen, n_kv_heads, head_dim) -> (bs, slen, n_kv_heads * n_rep, head_dim)."""
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (torch.unsqueeze(x, dim=3).expand(bs, slen, n_kv_heads, n_rep, head_dim)
            .reshape(bs, slen, n_kv_heads * n_rep, head_dim))


def hf_repeat_kv(hidden: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Hugging Face's: (batch, kv_heads, seq, head_dim) -> (batch, kv_heads * n_rep, seq, head_dim)."""
    batch, kv, slen, head_dim = hidden.shape
    if n_rep == 1:
        return hidden
    hidden = hidden[:, :, None, :, :].expand(batch, kv, n_rep, slen, head_dim)
    return hidden.reshape(batch, kv * n_rep, slen, head_dim)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.form = a.form
        self.n_heads, self.n_kv_heads = a.n_heads, a.n_kv_heads
        self.n_rep = a.n_heads // a.n_kv_heads
        self.head_dim = a.dim // a.n_heads
        self.wq = nn.Linear(a.dim, a.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * self.head_dim, a.dim, bias=False)

    def forward(self, x, rope):
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, rope) if not isinstance(rope, tuple) else apply_rotary_real(xq, xk, *rope)
        if self.form == "repeat_kv":
            xk, xv = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        elif self.form == "repeat_interleave":
            xk = torch.repeat_interleave(xk, dim=2, repeats=self.n_rep)
            xv = torch.repeat_interleave(xv, dim=2, repeats=self.n_rep)
        xq, xk, xv = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        if self.form in ("hf", "explicit"):
            xk, xv = hf_repeat_kv(xk, self.n_rep), hf_repeat_kv(xv, self.n_rep)
        if self.form == "explicit":
            scores = xq @ xk.transpose(2, 3) / math.sqrt(self.head_dim)
            causal = torch.full((seqlen, seqlen), float("-inf"), device=x.device).triu(1)
            out = torch.softmax(scores + causal, dim=-1) @ xv
        else:
            out = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True, enable_gqa=self.form == "sdpa_gqa")
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class TransformerBlock(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.attention = Attention(a)
        self.feed_forward = FeedForward(a.dim, a.ffn_hidden)
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)

    def forward(self, x, rope):
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, a: ModelArgs = ModelArgs()):
        super().__init__()
        self.args = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList(TransformerBlock(a) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)
        hd = a.dim // a.n_heads
        freqs = precompute_freqs_cis(hd, a.max_seq_len, a.rope_theta)
        self.register_buffer("freqs_cis", freqs, persistent=False)
        angles = torch.cat((freqs.angle(), freqs.angle()), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens):
        s = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        rope = self.freqs_cis[:s] if self.args.rope == "complex" else (self.cos[:s], self.sin[:s])
        for layer in self.layers:
            h = layer(h, rope)
        return self.output(self.norm(h))


BATCH, SEQ = 2, 8


def width(heads: int) -> int:
    """The hidden size of the tests' models: 32, or 48 for a head count of 3's (head_dim 4)."""
    return 48 if heads % 3 == 0 else 32


def batch(a: ModelArgs, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, a.vocab_size, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def parity_matrix(cases, sp: bool = False):
    """``{(form, heads, kv_heads): ParityReport}`` on a tp mesh of the whole world (the Hugging
    Face form with real cos/sin rotary tables, the others with complex ``freqs_cis``)."""
    mesh, plan = autopar.Mesh(tp=dist.get_world_size()), autopar.Plan(tp=True, sp=sp)
    out = {}
    for form, heads, kv in cases:
        a = ModelArgs(dim=width(heads), n_heads=heads, n_kv_heads=kv, form=form,
                      rope="real" if form == "hf" else "complex")
        tok, tgt = batch(a)
        out[(form, heads, kv)] = parity(lambda: Transformer(a), mesh, plan, (tok,), tgt, lm_loss)
    return out


def parity_llama3(sp_values=(False, True)):
    """A 2-layer torchtitan-style Llama 3 (hidden 64, 8 heads over 2 k/v heads) under tp and tp+sp."""
    a = ModelArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=96, ffn_hidden=128)
    tok, tgt = batch(a)
    mesh = autopar.Mesh(tp=dist.get_world_size())
    return {sp: parity(lambda: Transformer(a), mesh, autopar.Plan(tp=True, sp=sp), (tok,), tgt, lm_loss)
            for sp in sp_values}


def tp_volume(form: str, heads: int, kv: int, sp: bool = False):
    """Bytes the tp axis moved in one training step of the model with 1 and with 2 layers
    (their difference is one layer's traffic), by (kind, phase), with the sizes the formula
    needs."""
    t = dist.get_world_size()
    out = {}
    for layers in (1, 2):
        a = ModelArgs(dim=width(heads), n_layers=layers, n_heads=heads, n_kv_heads=kv, form=form)
        tok, tgt = batch(a)
        torch.manual_seed(0)
        dm = autopar.compile(Transformer(a), autopar.Mesh(tp=t), example_inputs=(tok,),
                             plan=autopar.Plan(tp=True, sp=sp))
        opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
        step(dm, opt, (tok,), tgt, lm_loss)
        dm.comm_stats.reset()
        step(dm, opt, (tok,), tgt, lm_loss)
        out[layers] = {k: v for k, v in dm.comm_stats.bytes.items() if k[0] == "tp"}
    out["sizes"] = {"b": BATCH, "s": SEQ, "h": a.dim, "hd": a.dim // heads, "kv": kv, "heads": heads}
    return out


def parity_zoo(names, sp: bool = False):
    """Hugging Face architectures of the zoo (2 k/v heads over 4 q heads: at tp=4 the k/v heads
    stay whole) on a tp mesh of the whole world, called with ``labels=`` as the zoo does."""
    mesh, plan = autopar.Mesh(tp=dist.get_world_size()), autopar.Plan(tp=True, sp=sp)
    out = {}
    for name in names:
        a = zoo.arch(name)
        out[name] = parity(lambda: zoo.build(a), mesh, plan, (), None, None, kwargs=zoo.batch(a, zoo.ROWS),
                           eps=zoo.ADAM_EPS)
    return out
