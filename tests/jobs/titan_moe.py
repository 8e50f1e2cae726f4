"""A torchtitan-style mixture-of-experts decoder: each block's feed-forward is a ``MoE`` of a
router (``gate``, a linear to one score per expert; softmax or sigmoid scores, top-k per token,
optionally renormalised and scaled), routed experts stored as stacked 3-D weights ``w1``/``w3``
(num_experts, dim, hidden) and ``w2`` (num_experts, hidden, dim), as torchtitan's
``GroupedExperts`` holds them, and an always-on shared expert (torchtitan's ``FeedForward``).

torchtitan runs the experts on tokens sorted by expert with sizes read from the routing
(``num_tokens_per_expert``), which autopar refuses as a data-dependent size; the two fixed-size
ways written here are those a model takes instead:

    gather   each token gathers its top-k experts' weights (``w1[idx]``: (tokens, k, dim,
             hidden)) and multiplies by them (``bmm``), the way transformers' ``batched_mm``
             experts do
    dense    every expert runs on every token (an einsum over the expert dim), and the outputs
             are summed with the router's weights scattered into a (tokens, experts) matrix
             that is zero off the top k

The attention and norms are the Llama 3 ones of ``jobs/gqa.py`` (heads not grouped here).
``aux_loss`` > 0 adds the Switch Transformer load-balance loss, E * sum_e f_e P_e (f_e the share
of routed slots that went to expert e, P_e its mean router probability), with the model
computing its own loss (``model(tokens, labels=...)["loss"]``). That loss is a product of two
means over the batch, so a data-parallel rank's or a micro-batch's value differs from the whole
batch's (as under DDP): it has single-device parity only on an axis that does not split the
batch (tp).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar import zoo
from autopar.models import lm_loss
from autopar.testing import parity

from .gqa import Attention, FeedForward, ModelArgs as AttentionArgs, RMSNorm, precompute_freqs_cis


@dataclass(frozen=True)
class MoEArgs:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    vocab_size: int = 64
    max_seq_len: int = 16
    num_experts: int = 4
    """routed experts per block"""
    top_k: int = 2
    """experts each token is routed to"""
    expert_hidden: int = 32
    """hidden width of one routed expert (and of each shared one)"""
    num_shared_experts: int = 1
    """experts every token runs through (0: none)"""
    score_func: str = "softmax"
    """softmax | sigmoid: how the router's logits become scores"""
    route_norm: bool = False
    """renormalise the top-k scores of a token to sum to 1 (DeepSeek-V3's sigmoid router does)"""
    route_scale: float = 1.0
    form: str = "gather"
    """gather | dense: how the routed experts are applied (the module docstring)"""
    aux_loss: float = 0.0
    """weight of the load-balance loss (> 0: the model computes its loss from ``labels``)"""


class Router(nn.Module):
    """torchtitan's ``TokenChoiceTopKRouter``: scores in fp32, the top k per token."""

    def __init__(self, a: MoEArgs):
        super().__init__()
        self.a = a
        self.gate = nn.Linear(a.dim, a.num_experts, bias=False)

    def forward(self, x):
        logits = self.gate(x).float()
        scores = torch.sigmoid(logits) if self.a.score_func == "sigmoid" else F.softmax(logits, dim=-1)
        top, idx = torch.topk(scores, k=self.a.top_k, dim=-1)
        if self.a.route_norm:
            top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
        return (top * self.a.route_scale).type_as(x), idx, logits


class GroupedExperts(nn.Module):
    def __init__(self, a: MoEArgs):
        super().__init__()
        self.form = a.form
        e, d, h = a.num_experts, a.dim, a.expert_hidden
        self.w1 = nn.Parameter(torch.randn(e, d, h) * d ** -0.5)
        self.w2 = nn.Parameter(torch.randn(e, h, d) * h ** -0.5)
        self.w3 = nn.Parameter(torch.randn(e, d, h) * d ** -0.5)

    def forward(self, x, top, idx):
        """``x`` (tokens, dim), each token's top-k scores and expert ids (tokens, k)."""
        if self.form == "dense":
            h = F.silu(torch.einsum("td,edh->teh", x, self.w1)) * torch.einsum("td,edh->teh", x, self.w3)
            out = torch.einsum("teh,ehd->ted", h, self.w2)
            weights = torch.zeros(x.shape[0], self.w1.shape[0], dtype=x.dtype, device=x.device).scatter(1, idx, top)
            return torch.einsum("ted,te->td", out, weights)
        t, k = idx.shape
        flat = idx.reshape(-1)
        xs = x.repeat_interleave(k, dim=0).unsqueeze(1)                       # (t k, 1, dim)
        h = F.silu(torch.bmm(xs, self.w1[flat])) * torch.bmm(xs, self.w3[flat])
        out = torch.bmm(h, self.w2[flat]).reshape(t, k, -1)                   # (t, k, dim)
        return (out * top.unsqueeze(-1)).sum(dim=1)


class MoE(nn.Module):
    def __init__(self, a: MoEArgs):
        super().__init__()
        self.a = a
        self.router = Router(a)
        self.experts = GroupedExperts(a)
        self.shared_experts = (FeedForward(a.dim, a.expert_hidden * a.num_shared_experts)
                               if a.num_shared_experts else None)

    def forward(self, x):
        """(bs, slen, dim) -> the same, and this block's load-balance loss."""
        bs, slen, dim = x.shape
        flat = x.reshape(-1, dim)
        top, idx, logits = self.router(flat)
        out = self.experts(flat, top, idx)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        aux = x.new_zeros(())
        if self.a.aux_loss:
            e = self.a.num_experts
            routed = F.one_hot(idx, e).float().sum(dim=1).mean(dim=0) / self.a.top_k    # f_e
            probs = F.softmax(logits, dim=-1).mean(dim=0)                              # P_e
            aux = e * (routed * probs).sum()
        return out.reshape(bs, slen, dim), aux


class MoEBlock(nn.Module):
    def __init__(self, a: MoEArgs):
        super().__init__()
        self.attention = Attention(AttentionArgs(dim=a.dim, n_heads=a.n_heads, n_kv_heads=a.n_heads,
                                                 vocab_size=a.vocab_size, max_seq_len=a.max_seq_len))
        self.moe = MoE(a)
        self.attention_norm = RMSNorm(a.dim, 1e-5)
        self.ffn_norm = RMSNorm(a.dim, 1e-5)

    def forward(self, x, rope):
        h = x + self.attention(self.attention_norm(x), rope)
        out, aux = self.moe(self.ffn_norm(h))
        return h + out, aux


class MoETransformer(nn.Module):
    def __init__(self, a: MoEArgs = MoEArgs()):
        super().__init__()
        self.a = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList(MoEBlock(a) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.dim, 1e-5)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(a.dim // a.n_heads, a.max_seq_len, 10000.0),
                             persistent=False)

    def forward(self, tokens, labels=None):
        h = self.tok_embeddings(tokens)
        rope = self.freqs_cis[:tokens.shape[1]]
        aux = h.new_zeros(())
        for layer in self.layers:
            h, a = layer(h, rope)
            aux = aux + a
        logits = self.output(self.norm(h))
        if labels is None:
            return logits
        return {"loss": lm_loss(logits, labels) + self.a.aux_loss * aux, "logits": logits}


BATCH, SEQ = 4, 8
"""4 rows: 2 per data-parallel rank, or per micro-batch of a 2-stage pipeline"""

EXPERTS_SPLIT = (("*.experts.w1", "S(2)"), ("*.experts.w3", "S(2)"), ("*.experts.w2", "S(1)"))
"""Megatron's split inside every expert: w1 and w3 by their hidden features (column-parallel),
w2 by its input features (row-parallel); tp alone keeps 3-D weights whole (it splits the 2-D
weights that linear/mm products read)"""

PLANS = {
    "zero3": ({"dp": 2}, {"dp": "zero3"}),
    "tp": ({"tp": 2}, {"tp": True}),
    "tp+sp": ({"tp": 2}, {"tp": True, "sp": True}),
    "tp experts split": ({"tp": 2}, {"tp": True, "tp_layout": EXPERTS_SPLIT}),
    "tp+sp experts split": ({"tp": 2}, {"tp": True, "sp": True, "tp_layout": EXPERTS_SPLIT}),
    "pp 1f1b": ({"pp": 2}, {"pp_schedule": "1f1b", "microbatches": 2}),
}
"""the plans the MoE decoder trains under at world 2: (Mesh axes, Plan fields)"""


def batch(a: MoEArgs, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, a.vocab_size, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def holdings(dm) -> dict:
    """This rank's trainable parameter bytes and the compile's notes."""
    return {"bytes": sum(p.numel() * p.element_size() for p in dm.parameters() if p.requires_grad),
            "notes": list(dm.ctx.notes)}


def parity_plans(a: MoEArgs, plans) -> dict:
    """``{plan: ParityReport}``: the decoder trained for 3 AdamW steps (eps ``zoo.ADAM_EPS``:
    a gradient that is zero in exact arithmetic is not amplified into a step) under each plan of
    ``PLANS`` next to the single-device model (the model's own loss when ``a.aux_loss``), with
    the first step's bytes per collective and ``holdings`` (``inspected``)."""
    tok, tgt = batch(a)
    out = {}
    for name in plans:
        axes, fields = PLANS[name]
        mesh = autopar.Mesh(**axes)
        if a.aux_loss:
            out[name] = parity(lambda: MoETransformer(a), mesh, autopar.Plan(**fields), (), None, None,
                               kwargs={"tokens": tok, "labels": tgt}, inspect=holdings, eps=zoo.ADAM_EPS)
        else:
            out[name] = parity(lambda: MoETransformer(a), mesh, autopar.Plan(**fields), (tok,), tgt, lm_loss,
                               inspect=holdings, eps=zoo.ADAM_EPS)
    return out


def experts_for_loop(experts: GroupedExperts, x, top, idx):
    """torchtitan's reference path on one device: for each expert, the tokens routed to it
    (a data-dependent selection), through its w1/w3/w2, weighted and summed back per token."""
    out = torch.zeros_like(x)
    for e in range(experts.w1.shape[0]):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        h = F.silu(x[tok] @ experts.w1[e]) * (x[tok] @ experts.w3[e])
        out.index_add_(0, tok, (h @ experts.w2[e]) * top[tok, slot].unsqueeze(-1))
    return out
