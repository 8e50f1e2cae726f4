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


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.heads = c.heads
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
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


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
