"""Small reference models for the demo, the tests and the benchmarks.

``TinyMLP``: a stack of linear layers with GeLU, one of them with an odd number of rows
so that ZeRO shards do not divide evenly. ``TinyGPT``: token and position embeddings,
pre-LayerNorm blocks of causal self-attention (one fused qkv projection with bias) and an
MLP, a final LayerNorm and an LM head tied to the token embedding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class TinyMLP(nn.Module):
    def __init__(self, d_in: int = 16, hidden: int = 7, d_out: int = 16, bias: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(d_in, 32, bias=bias)
        self.fc2 = nn.Linear(32, hidden, bias=bias)     # 7 rows: uneven over 2 or 4 ranks
        self.fc3 = nn.Linear(hidden, d_out, bias=bias)

    def forward(self, x):
        return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 67
    seq: int = 16
    dim: int = 32
    heads: int = 4
    layers: int = 2
    max_seq: int = 32
    dropout: float = 0.0     # hidden and attention dropout (GPT-3 and Megatron train with 0.1)


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.heads, self.p = c.heads, c.dropout
        self.ln1 = nn.LayerNorm(c.dim)
        self.qkv = nn.Linear(c.dim, 3 * c.dim)
        self.proj = nn.Linear(c.dim, c.dim)
        self.ln2 = nn.LayerNorm(c.dim)
        self.fc = nn.Linear(c.dim, 4 * c.dim)
        self.out = nn.Linear(4 * c.dim, c.dim)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.p if self.training else 0.0)
        x = x + self._drop(self.proj(a.transpose(1, 2).reshape(b, s, h)))
        return x + self._drop(self.out(F.gelu(self.fc(self.ln2(x)))))

    def _drop(self, x):
        return F.dropout(x, self.p, self.training) if self.p else x


class TinyGPT(nn.Module):
    def __init__(self, c: GPTConfig = GPTConfig()):
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab, c.dim)
        self.wpe = nn.Embedding(c.max_seq, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)
        self.head.weight = self.wte.weight      # tied
        for emb in (self.wte, self.wpe):        # GPT-2's embedding init keeps initial logits O(1)
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, idx):
        s = idx.shape[1]
        if s > self.config.max_seq:
            raise ValueError(f"sequence of {s} tokens is longer than max_seq={self.config.max_seq}")
        x = self.wte(idx) + self.wpe(torch.arange(s, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def gpt_batch(c: GPTConfig, batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, c.vocab, (batch, c.seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# ---- Llama-style decoder (RMSNorm, rotary positions, grouped-query attention, SwiGLU) -------------

@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 64
    seq: int = 16
    dim: int = 32
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 64
    layers: int = 2
    eps: float = 1e-5


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate(x, cos, sin):
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class LlamaBlock(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.heads, self.kv, self.hd = c.heads, c.kv_heads, c.dim // c.heads
        self.norm1, self.norm2 = RMSNorm(c.dim, c.eps), RMSNorm(c.dim, c.eps)
        self.q = nn.Linear(c.dim, c.dim, bias=False)
        self.k = nn.Linear(c.dim, c.kv_heads * self.hd, bias=False)
        self.v = nn.Linear(c.dim, c.kv_heads * self.hd, bias=False)
        self.o = nn.Linear(c.dim, c.dim, bias=False)
        self.gate = nn.Linear(c.dim, c.ffn, bias=False)
        self.up = nn.Linear(c.dim, c.ffn, bias=False)
        self.down = nn.Linear(c.ffn, c.dim, bias=False)

    def forward(self, x, cos, sin):
        b, s, h = x.shape
        y = self.norm1(x)
        q = self.q(y).view(b, s, self.heads, self.hd).transpose(1, 2)
        k = self.k(y).view(b, s, self.kv, self.hd).transpose(1, 2)
        v = self.v(y).view(b, s, self.kv, self.hd).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        rep = self.heads // self.kv
        k = k[:, :, None].expand(b, self.kv, rep, s, self.hd).reshape(b, self.heads, s, self.hd)
        v = v[:, :, None].expand(b, self.kv, rep, s, self.hd).reshape(b, self.heads, s, self.hd)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, h))
        y = self.norm2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class Llama(nn.Module):
    """A Llama-style decoder: untied embedding and head, rotary positions, GQA, SwiGLU."""

    def __init__(self, c: LlamaConfig = LlamaConfig()):
        super().__init__()
        self.config = c
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList(LlamaBlock(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.dim, c.eps)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)
        hd = c.dim // c.heads
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.outer(torch.arange(c.seq).float(), inv)
        self.register_buffer("cos", torch.cat((ang, ang), -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat((ang, ang), -1).sin(), persistent=False)

    def forward(self, idx):
        s = idx.shape[1]
        x = self.embed(idx)
        cos, sin = self.cos[:s], self.sin[:s]
        for blk in self.layers:
            x = blk(x, cos, sin)
        return self.head(self.norm(x))


# ---- named sizes (for planning on the meta device) -------------------------------------------------

# GPT sizes of Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
# Using Megatron-LM" (SC'21), table 1 (vocabulary 51,200, sequence 2,048), and GPT-3 175B
# (Brown et al. 2020, table 2.1: 96 layers, d_model 12,288, 96 heads); Llama-style 70B and 7B as
# in Touvron et al., "Llama 2" (2023), table 1 / the released configurations (vocabulary 32,000,
# context 4,096; 70B: 80 layers, 8,192 hidden, 64 heads, 8 KV heads, SwiGLU 28,672). Korthikanti et
# al. 2022's 22B (table 3: 48 layers, 6,144 hidden, 64 heads); BLOOM-176B (BigScience 2022: 70 layers,
# 14,336 hidden, 112 heads, vocabulary 250,880; ALiBi and its embedding LayerNorm not modelled);
# Llama 3.1 8B / 70B / 405B as released (Dubey et al., "The Llama 3 Herd of Models", 2024, table 3:
# vocabulary 128,256; 32 / 80 / 126 layers; 4,096 / 8,192 / 16,384 hidden; FFN 14,336 / 28,672 /
# 53,248; 32 / 64 / 128 heads, 8 KV heads) at torchtitan's training sequence of 8,192.
NAMED = {
    "gpt-1.7b": GPTConfig(vocab=51200, seq=2048, dim=2304, heads=24, layers=24, max_seq=2048, dropout=0.1),
    "gpt-3.6b": GPTConfig(vocab=51200, seq=2048, dim=3072, heads=32, layers=30, max_seq=2048, dropout=0.1),
    "gpt-7.5b": GPTConfig(vocab=51200, seq=2048, dim=4096, heads=32, layers=36, max_seq=2048, dropout=0.1),
    "gpt-18b": GPTConfig(vocab=51200, seq=2048, dim=6144, heads=48, layers=40, max_seq=2048, dropout=0.1),
    "gpt-22b": GPTConfig(vocab=51200, seq=2048, dim=6144, heads=64, layers=48, max_seq=2048, dropout=0.1),
    "gpt-39b": GPTConfig(vocab=51200, seq=2048, dim=8192, heads=64, layers=48, max_seq=2048, dropout=0.1),
    "gpt-76b": GPTConfig(vocab=51200, seq=2048, dim=10240, heads=80, layers=60, max_seq=2048, dropout=0.1),
    "gpt-146b": GPTConfig(vocab=51200, seq=2048, dim=12288, heads=96, layers=80, max_seq=2048, dropout=0.1),
    "gpt3-175b": GPTConfig(vocab=51200, seq=2048, dim=12288, heads=96, layers=96, max_seq=2048, dropout=0.1),
    "gpt-310b": GPTConfig(vocab=51200, seq=2048, dim=16384, heads=128, layers=96, max_seq=2048, dropout=0.1),
    "gpt-530b": GPTConfig(vocab=51200, seq=2048, dim=20480, heads=128, layers=105, max_seq=2048, dropout=0.1),
    "gpt-1t": GPTConfig(vocab=51200, seq=2048, dim=25600, heads=160, layers=128, max_seq=2048, dropout=0.1),
    "bloom-176b": GPTConfig(vocab=250880, seq=2048, dim=14336, heads=112, layers=70, max_seq=2048, dropout=0.0),
    "llama-7b": LlamaConfig(vocab=32000, seq=4096, dim=4096, heads=32, kv_heads=32, ffn=11008, layers=32),
    "llama-70b": LlamaConfig(vocab=32000, seq=4096, dim=8192, heads=64, kv_heads=8, ffn=28672, layers=80),
    "llama3-8b": LlamaConfig(vocab=128256, seq=8192, dim=4096, heads=32, kv_heads=8, ffn=14336, layers=32),
    "llama3-70b": LlamaConfig(vocab=128256, seq=8192, dim=8192, heads=64, kv_heads=8, ffn=28672, layers=80),
    "llama3-405b": LlamaConfig(vocab=128256, seq=8192, dim=16384, heads=128, kv_heads=8, ffn=53248, layers=126),
}


def named(name: str, layers: int | None = None, device: str = "meta", dtype=torch.bfloat16):
    """``(model, example_inputs)`` of a named size, built on ``device`` (meta: no memory) in
    its training ``dtype``, with eight sequences as the example batch; ``layers`` overrides
    the depth."""
    if name not in NAMED:
        raise ValueError(f"unknown model {name!r}; named sizes: {', '.join(NAMED)}")
    from dataclasses import replace as _replace
    c = NAMED[name] if layers is None else _replace(NAMED[name], layers=layers)
    with torch.device(device):
        model = (TinyGPT(c) if isinstance(c, GPTConfig) else Llama(c)).to(dtype)
        tokens = torch.zeros(8, c.seq, dtype=torch.long)
    return model, (tokens,)


# ---- small runnable models (verify, examples) ----------------------------------------------------

SMALL = ("tiny-gpt", "tiny-mlp", "tiny-llama")
"""Models small enough to run on a CPU in a second, by name (``small``)."""


def small(name: str, batch: int = 8, seed: int = 0):
    """``(model, example_inputs, target, loss_fn)`` of a small model built in fp32 with weights
    from ``torch.manual_seed(seed)``, on a random global batch of ``batch`` rows: ``tiny-gpt``
    (``TinyGPT``, language-model loss), ``tiny-mlp`` (``TinyMLP``, mean squared error against a
    random target), ``tiny-llama`` (``Llama``, language-model loss)."""
    if name not in SMALL:
        raise ValueError(f"unknown small model {name!r}; small models: {', '.join(SMALL)}")
    torch.manual_seed(seed)
    if name == "tiny-mlp":
        model = TinyMLP()
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(batch, 16, generator=g), torch.randn(batch, 16, generator=g)
        return model, (x,), y, F.mse_loss
    model = TinyGPT() if name == "tiny-gpt" else Llama()
    tokens, targets = gpt_batch(model.config, batch, seed)
    return model, (tokens,), targets, lm_loss
