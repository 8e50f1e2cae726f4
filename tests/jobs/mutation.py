"""In-place writes as models write them: a model whose every block writes into a tensor in one
of the patterns real models use, trained under each plan against the single-device model."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.testing import parity

HIDDEN, HEADS, SEQ = 32, 4, 8

PATTERNS = ("copy_into_new_empty", "index_put", "masked_fill_slice", "write_through_view", "inplace_chain",
            "slice_assign")
"""The writes the blocks make, one a block:
- copy_into_new_empty: keys built with ``new_empty`` and filled by ``k[..., :d] = a`` and
  ``k[..., d:].copy_(b)`` (Hugging Face DeepSeek-V3's attention);
- index_put: ``k[..., idx] = v`` with a tensor index along the head dim (``index_put_``);
- masked_fill_slice: ``y[:, -2:].masked_fill_(...)`` on a slice of an activation;
- write_through_view: ``k.view(...).mul_(..)``, then ``k.add_(..)``: the base reads the view's write;
- inplace_chain: ``add_`` then ``relu_`` on a projection that attention reads through a view
  taken before the writes;
- slice_assign: ``h[:, :, :16] = ...`` on the block's output, which the residual then reads."""


class WritingAttention(nn.Module):
    """Causal attention whose keys, values or output are written in place by ``pattern``."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern, self.d = pattern, HIDDEN // HEADS
        self.q = nn.Linear(HIDDEN, HIDDEN)
        self.k_nope = nn.Linear(HIDDEN, HIDDEN // 2, bias=False)
        self.k_pe = nn.Linear(HIDDEN, HIDDEN // 2, bias=False)
        self.v = nn.Linear(HIDDEN, HIDDEN)
        self.o = nn.Linear(HIDDEN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)

    def heads(self, t, d):
        b, s, _ = t.shape
        return t.view(b, s, HEADS, d).transpose(1, 2)

    def keys(self, x):
        half = self.d // 2
        a, b = self.heads(self.k_nope(x), half), self.heads(self.k_pe(x), half)
        if self.pattern == "copy_into_new_empty":
            k = a.new_empty(a.shape[0], HEADS, a.shape[2], self.d)
            k[..., :half] = a
            k[..., half:].copy_(b)
            return k
        k = torch.cat([a, b], -1)
        if self.pattern == "index_put":
            k[..., torch.arange(half, self.d)] = b * 0.5 + 1.0
        elif self.pattern == "write_through_view":
            flat = k.view(k.shape[0], HEADS, -1)
            flat.mul_(0.5)
            k.add_(0.25)
        return k

    def forward(self, x):
        bsz, s, _ = x.shape
        x = self.norm(x)
        t = self.v(x)
        v = self.heads(t, self.d)
        if self.pattern == "inplace_chain":     # writes into the base, read through its view
            t.add_(0.5).relu_()
        y = F.scaled_dot_product_attention(self.heads(self.q(x), self.d), self.keys(x), v, is_causal=True)
        y = self.o(y.transpose(1, 2).reshape(bsz, s, HIDDEN))
        if self.pattern == "masked_fill_slice":
            y[:, -2:].masked_fill_(y[:, -2:] > 0.2, 0.0)
        elif self.pattern == "slice_assign":
            y[:, :, :HIDDEN // 2] = torch.tanh(y[:, :, HIDDEN // 2:])
        return y


class WritingNet(nn.Module):
    """An embedding, one residual block per pattern, a head."""

    def __init__(self, patterns=PATTERNS):
        super().__init__()
        self.inp = nn.Linear(16, HIDDEN)
        self.blocks = nn.ModuleList(WritingAttention(p) for p in patterns)
        self.out = nn.Linear(HIDDEN, 16)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def batch(rows: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, SEQ, 16, generator=g), torch.randn(rows, SEQ, 16, generator=g)


PLANS = {   # name -> (mesh axes, plan)
    "ddp": ({"dp": 2}, autopar.Plan()),
    "zero3": ({"dp": 2}, autopar.Plan(dp="zero3")),
    "tp": ({"tp": 2}, autopar.Plan(tp=True)),
    "tp+sp": ({"tp": 2}, autopar.Plan(tp=True, sp=True)),
    "zero2": ({"dp": 2}, autopar.Plan(dp="zero2")),
    "pp 1f1b": ({"pp": 2}, autopar.Plan(pp_schedule="1f1b", microbatches=2)),
    "pp zero-bubble": ({"pp": 2}, autopar.Plan(pp_schedule="zero_bubble", microbatches=2)),
    "dp x tp": ({"dp": 2, "tp": 2}, autopar.Plan(dp="zero3", tp=True, sp=True)),
}


def mutation_parity(name: str, patterns=PATTERNS) -> dict:
    """``parity`` of ``WritingNet(patterns)`` under ``PLANS[name]`` (three AdamW steps)."""
    torch.set_num_threads(1)
    axes, plan = PLANS[name]
    x, t = batch()
    rep = parity(lambda: WritingNet(patterns), autopar.Mesh(**axes), plan, (x,), t, F.mse_loss)
    return {"ok": rep.ok, "errors": (rep.output_err, rep.loss_err, rep.grad_err, rep.param_err, rep.noise_param_err),
            "messages": rep.messages}
