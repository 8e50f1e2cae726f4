"""The building blocks of the fuzzer's random models (``autopar.fuzz``).

Each block is a small ``nn.Module`` of one op family real models use, written the way model
code writes it (``view``/``split``/``chunk`` of fused projections, norms written out by hand,
writes into slices), mapping hidden states ``(batch, seq, hidden)`` to the same shape. Their
constructors take only literals, so ``autopar.fuzz.source`` prints a failing model as this
file's classes plus one constructor call: a standalone module anyone can run.

This file is printed into that module as it is: it imports only torch and math.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Norm(nn.Module):
    """A norm over the last dim, ``width`` wide: ``layer`` (nn.LayerNorm), ``rms`` (written out,
    as Llama's), ``rms_torch`` (nn.RMSNorm), ``group`` (RMS over ``groups`` equal slices of the
    width, as Mamba-2's gated norm), or ``none``."""

    def __init__(self, kind, width, groups=1):
        super().__init__()
        self.kind, self.groups = kind, groups
        if kind == "layer":
            self.norm = nn.LayerNorm(width)
        elif kind == "rms_torch":
            self.norm = nn.RMSNorm(width, eps=1e-6)
        elif kind in ("rms", "group"):
            self.weight = nn.Parameter(1 + 0.1 * torch.randn(width))

    def forward(self, x):
        if self.kind in ("layer", "rms_torch"):
            return self.norm(x)
        if self.kind == "rms":
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        if self.kind == "group":
            shape = x.shape
            g = x.reshape(*shape[:-1], self.groups, shape[-1] // self.groups)
            g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + 1e-6)
            return g.reshape(shape) * self.weight
        return x


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    """Multi-head attention with ``kv_heads`` key/value heads (grouped-query when fewer than
    ``heads``). ``fused``: one projection for q, k and v, parted by ``split`` or by a ``view``
    to heads; ``qk_norm``: ``head`` (over each head's width), ``full`` (over q's and k's whole
    width, before the heads are parted), or ``none``, a ``Norm`` of kind ``qk_kind``; ``rope``: rotary embedding from cos/sin
    buffers (``table``) or read from them by position (``gather``); ``kernel``: ``sdpa``
    (``enable_gqa`` for fewer kv heads), ``explicit`` (scores, mask, softmax; kv heads
    repeated) or ``alibi`` (explicit, with ALiBi's per-head linear bias added to the scores);
    ``window``: a sliding window (0: none)."""

    def __init__(self, hidden, heads, kv_heads, head_dim, fused, qk_norm, qk_kind, rope, kernel, causal, window,
                 bias, seq):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.fused, self.qk_norm, self.rope, self.kernel = fused, qk_norm, rope, kernel
        self.causal, self.window = causal, window
        q, kv = heads * head_dim, kv_heads * head_dim
        if fused:
            self.qkv = nn.Linear(hidden, q + 2 * kv, bias=bias)
        else:
            self.q = nn.Linear(hidden, q, bias=bias)
            self.k = nn.Linear(hidden, kv, bias=bias)
            self.v = nn.Linear(hidden, kv, bias=bias)
        self.o = nn.Linear(q, hidden, bias=bias)
        if qk_norm == "head":
            self.q_norm, self.k_norm = Norm(qk_kind, head_dim), Norm(qk_kind, head_dim)
        elif qk_norm == "full":
            self.q_norm, self.k_norm = Norm(qk_kind, q), Norm(qk_kind, kv)
        if rope != "none":
            inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
            angles = torch.outer(torch.arange(seq).float(), inv)
            angles = torch.cat((angles, angles), dim=-1)
            self.register_buffer("cos", angles.cos(), persistent=False)
            self.register_buffer("sin", angles.sin(), persistent=False)
        if kernel in ("explicit", "alibi"):
            i = torch.arange(seq)
            allowed = torch.ones(seq, seq, dtype=torch.bool)
            if causal:
                allowed &= i[None, :] <= i[:, None]
            if window:
                allowed &= i[:, None] - i[None, :] < window
            self.register_buffer("allowed", allowed, persistent=False)
        if kernel == "alibi":
            slopes = 2.0 ** (-8.0 * torch.arange(1, heads + 1) / heads)
            distance = (i[None, :] - i[:, None]).float()
            self.register_buffer("alibi", slopes[:, None, None] * distance, persistent=False)

    def forward(self, x):
        b, s, _ = x.shape
        q_w, kv_w = self.heads * self.head_dim, self.kv_heads * self.head_dim
        if self.fused == "split":
            q, k, v = self.qkv(x).split([q_w, kv_w, kv_w], dim=-1)
        elif self.fused == "view":
            qkv = self.qkv(x).view(b, s, self.heads + 2 * self.kv_heads, self.head_dim)
            q, k, v = (qkv[:, :, :self.heads], qkv[:, :, self.heads:self.heads + self.kv_heads],
                       qkv[:, :, self.heads + self.kv_heads:])
            q, k, v = q.reshape(b, s, q_w), k.reshape(b, s, kv_w), v.reshape(b, s, kv_w)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, s, self.heads, self.head_dim)
        k = k.view(b, s, self.kv_heads, self.head_dim)
        v = v.view(b, s, self.kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.rope == "table":
            cos, sin = self.cos[:s], self.sin[:s]
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        elif self.rope == "gather":
            pos = torch.arange(s, device=x.device)
            cos, sin = self.cos[pos], self.sin[pos]
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if self.kernel == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal,
                                                 enable_gqa=self.kv_heads != self.heads)
        else:
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
            if self.kernel == "alibi":
                scores = scores + self.alibi[:, :s, :s]
            scores = scores.masked_fill(~self.allowed[:s, :s], float("-inf"))
            out = scores.softmax(dim=-1) @ v
        return self.o(out.transpose(1, 2).reshape(b, s, q_w))


class MLP(nn.Module):
    """A feed-forward block: ``gated`` (SwiGLU; ``fused``: one projection chunked in two),
    else up, activation, down; ``inner_norm``: a norm over the inner width (``group``: in
    groups) before the down projection, as some state-space and vision blocks have."""

    def __init__(self, hidden, ffn, gated, fused, act, inner_norm, groups, bias):
        super().__init__()
        self.gated, self.fused, self.act = gated, fused, act
        if gated and fused:
            self.gate_up = nn.Linear(hidden, 2 * ffn, bias=bias)
        else:
            self.up = nn.Linear(hidden, ffn, bias=bias)
            if gated:
                self.gate = nn.Linear(hidden, ffn, bias=bias)
        self.inner = Norm(inner_norm, ffn, groups)
        self.down = nn.Linear(ffn, hidden, bias=bias)

    def activation(self, x):
        return F.silu(x) if self.act == "silu" else F.gelu(x, approximate="tanh") if self.act == "gelu" else F.relu(x)

    def forward(self, x):
        if self.gated and self.fused:
            g, u = self.gate_up(x).chunk(2, dim=-1)
            h = self.activation(g) * u
        elif self.gated:
            h = self.activation(self.gate(x)) * self.up(x)
        else:
            h = self.activation(self.up(x))
        return self.down(self.inner(h))


class SeqMixer(nn.Module):
    """A Mamba-style mixer: a projection to ``inner`` channels and a gate, a depthwise causal
    convolution along the sequence (``kernel`` taps), a scan along the sequence (``scan``:
    ``cumsum`` of gated inputs, ``cummax``, ``logcumsumexp``, or ``decay``: the linear
    recurrence ``h_t = a_t h_{t-1} + u_t`` with input-dependent decays ``a_t = exp(-softplus(dt)
    * exp(A_log))`` as a cumulative sum of logs, as Mamba-2's chunked scan), a gated norm over
    the inner width (``norm``), and a projection back."""

    def __init__(self, hidden, inner, kernel, scan, norm, groups):
        super().__init__()
        self.inner, self.kernel, self.scan = inner, kernel, scan
        self.in_proj = nn.Linear(hidden, 2 * inner, bias=False)
        self.conv = nn.Conv1d(inner, inner, kernel, groups=inner, padding=kernel - 1)
        self.dt = nn.Linear(inner, inner)
        self.A_log = nn.Parameter(torch.log(torch.linspace(0.5, 1.0, inner)))
        self.norm = Norm(norm, inner, groups)
        self.out_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        s = x.shape[1]
        u, z = self.in_proj(x).split(self.inner, dim=-1)
        u = self.conv(u.transpose(1, 2))[..., :s].transpose(1, 2)
        u = F.silu(u)
        if self.scan == "cumsum":
            h = torch.cumsum(u * torch.sigmoid(self.dt(u)), dim=1) / (1 + torch.arange(s, device=x.device))[:, None]
        elif self.scan == "cummax":
            h = torch.cummax(self.dt(u), dim=1).values
        elif self.scan == "logcumsumexp":
            h = torch.logcumsumexp(self.dt(u), dim=1)
        else:
            log_a = -F.softplus(self.dt(u)) * torch.exp(self.A_log) * 0.1
            cum = torch.cumsum(log_a, dim=1)
            h = torch.exp(cum) * torch.cumsum(u * torch.exp(-cum), dim=1)
        return self.out_proj(self.norm(h * F.silu(z)))


class Writes(nn.Module):
    """In-place updates and writes into views of a projection's output, as model code writes
    them: ``slice_mul`` (``h[..., :k] *= 2``), ``masked_fill`` (``masked_fill_`` on a slice),
    ``first_token`` (``h[:, 0] = 0``: a write along the sequence), ``new_empty``
    (DeepSeek's ``new_empty`` and slice ``copy_`` of two halves, swapped), ``add_relu``
    (``add_`` of a bias, ``relu_``), ``view_write`` (a write through a ``view`` to heads)."""

    def __init__(self, hidden, width, mode, heads):
        super().__init__()
        self.mode, self.heads = mode, heads
        self.proj = nn.Linear(hidden, width)
        self.back = nn.Linear(width, hidden)
        self.bias = nn.Parameter(0.1 * torch.randn(width))

    def forward(self, x):
        h = self.proj(x)
        k = h.shape[-1] // 2
        if self.mode == "slice_mul":
            h[..., :k] *= 2
        elif self.mode == "masked_fill":
            h[..., k:].masked_fill_(h[..., k:] < -0.5, 0.0)
        elif self.mode == "first_token":
            h[:, 0] = 0
        elif self.mode == "new_empty":
            out = h.new_empty(h.shape)
            out[..., :k] = h[..., h.shape[-1] - k:]
            out[..., k:] = h[..., :h.shape[-1] - k]
            h = out
        elif self.mode == "add_relu":
            h.add_(self.bias).relu_()
        elif self.mode == "view_write":
            v = h.view(h.shape[0], h.shape[1], self.heads, h.shape[-1] // self.heads)
            v[:, :, 0] *= 0.5
        return self.back(h)


class Index(nn.Module):
    """Gathers, scatters and index ops with fixed indices (buffers): ``gather`` (a permutation of
    the channels by ``torch.gather``), ``index_select`` (of the channels), ``scatter_add``
    (channels folded onto a half), ``shift`` (each position reads the one before, by index
    along the sequence), ``take_seq`` (a permutation of the positions)."""

    def __init__(self, hidden, mode, seq, seed):
        super().__init__()
        self.mode = mode
        g = torch.Generator().manual_seed(seed)
        self.proj = nn.Linear(hidden, hidden)
        self.register_buffer("perm", torch.randperm(hidden, generator=g), persistent=False)
        self.register_buffer("fold", torch.arange(hidden) % max(hidden // 2, 1), persistent=False)
        self.register_buffer("seq_perm", torch.randperm(seq, generator=g), persistent=False)
        self.register_buffer("prev", (torch.arange(seq) - 1).clamp(min=0), persistent=False)

    def forward(self, x):
        h = self.proj(x)
        if self.mode == "gather":
            return torch.gather(h, -1, self.perm.expand(h.shape))
        if self.mode == "index_select":
            return h.index_select(-1, self.perm)
        if self.mode == "scatter_add":
            return torch.zeros_like(h).scatter_add(-1, self.fold.expand(h.shape), h)
        if self.mode == "shift":
            return h[:, self.prev[:h.shape[1]]]
        return h[:, self.seq_perm]


class MoE(nn.Module):
    """A router over ``experts`` feed-forward experts, the top ``top_k`` of each token weighted
    by their (renormalised) router scores; every expert runs on every token and the gates zero
    the ones not chosen (``dense``), or the experts' weights are stacked 3-D and applied by
    ``einsum`` (``stacked``)."""

    def __init__(self, hidden, ffn, experts, top_k, form):
        super().__init__()
        self.top_k, self.form = top_k, form
        self.router = nn.Linear(hidden, experts, bias=False)
        if form == "dense":
            self.experts = nn.ModuleList(MLP(hidden, ffn, True, False, "silu", "none", 1, False)
                                         for _ in range(experts))
        else:
            self.w_in = nn.Parameter(torch.randn(experts, hidden, ffn) / math.sqrt(hidden))
            self.w_out = nn.Parameter(torch.randn(experts, ffn, hidden) / math.sqrt(ffn))

    def forward(self, x):
        scores = self.router(x).softmax(dim=-1)
        top, idx = scores.topk(self.top_k, dim=-1)
        gates = torch.zeros_like(scores).scatter(-1, idx, top / top.sum(-1, keepdim=True))
        if self.form == "dense":
            outs = torch.stack([e(x) for e in self.experts], dim=-1)
            return (outs * gates.unsqueeze(-2)).sum(-1)
        h = F.silu(torch.einsum("bsh,ehf->bsef", x, self.w_in))
        return torch.einsum("bsef,efh,bse->bsh", h, self.w_out, gates)


class FuzzModel(nn.Module):
    """Token embedding (and learned positions), the blocks with their residuals (``residual``:
    ``pre``-norm ``x + block(norm(x))``, ``post``-norm ``norm(x + block(x))``, or ``parallel``:
    blocks side by side on one normed input, ``x + sum(block(norm(x)))``), a final norm and an
    LM head, tied to the embedding or not; a buffer scales the embedding (``scale``: a
    non-persistent buffer read in forward). Called with ``targets`` it returns the language
    model's loss, the cross-entropy of the logits, as Hugging Face models called with labels."""

    def __init__(self, vocab, hidden, seq, blocks, norms, final_norm, tied, positions, scale, residual="pre"):
        super().__init__()
        self.residual = residual
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden) if positions else None
        self.blocks = nn.ModuleList(blocks)
        self.norms = nn.ModuleList(Norm(kind, hidden, 1) for kind in norms)
        self.final = Norm(final_norm, hidden, 1)
        self.head = nn.Linear(hidden, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.full((hidden,), scale), persistent=False)

    def forward(self, tokens, targets=None):
        x = self.embed(tokens) * self.scale
        if self.pos is not None:
            x = x + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        if self.residual == "parallel":
            h = self.norms[0](x)
            x = x + sum(block(h) for block in self.blocks)
        for norm, block in zip(self.norms, self.blocks):
            if self.residual == "pre":
                x = x + block(norm(x))
            elif self.residual == "post":
                x = norm(x + block(x))
        logits = self.head(self.final(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
