"""Tensor (and sequence) parallelism on real processes: parity, bytes per layer, activation
memory, vocabulary parallelism, ops without a rule."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
from autopar.models import GPTConfig, TinyGPT, TinyMLP, gpt_batch, lm_loss
from autopar.testing import parity, saved_activation_bytes

from .common import mlp_batch, mse, step

def tp_mesh(tp: int):
    world = dist.get_world_size()
    return autopar.Mesh(dp=world // tp, tp=tp) if world > tp else autopar.Mesh(tp=tp)


def parity_tp(tp: int, sp: bool, modes=("ddp",), models=("mlp", "gpt"), plan_kw=None):
    """MLP and GPT under tensor (and sequence) parallelism, with each dp mode in ``modes``
    (``plan_kw``: more Plan fields, e.g. overlap=False, collective_matmul=True)."""
    plan_kw = plan_kw or {}
    mesh = tp_mesh(tp)
    out = {}
    x, y = mlp_batch()
    c = GPTConfig()
    tok, tgt = gpt_batch(c, 8)
    for mode in modes:
        plan = autopar.Plan(dp=mode, tp=True, sp=sp, **plan_kw)
        if "mlp" in models:
            out[("mlp", mode)] = parity(TinyMLP, mesh, plan, (x,), y, mse)
        if "gpt" in models:
            out[("gpt", mode)] = parity(lambda: TinyGPT(c), mesh, plan, (tok,), tgt, lm_loss)
    return out


def tp_volume(sp: bool):
    """Bytes the tp axis moved in one training step of the GPT with 1 and with 2 layers: their
    difference is one layer's traffic. Also the batch, sequence and width for the formula."""
    t = dist.get_world_size()
    out = {}
    for layers in (1, 2):
        c = GPTConfig(layers=layers)
        tok, tgt = gpt_batch(c, 8)
        torch.manual_seed(0)
        dm = autopar.compile(TinyGPT(c), autopar.Mesh(tp=t), example_inputs=(tok,),
                             plan=autopar.Plan(tp=True, sp=sp))
        opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
        step(dm, opt, (tok,), tgt, lm_loss)
        dm.comm_stats.reset()
        step(dm, opt, (tok,), tgt, lm_loss)
        out[layers] = {"total": dm.comm_stats.total(axis="tp"), "bytes": dict(dm.comm_stats.bytes),
                       "calls": dict(dm.comm_stats.calls)}
    out["bsh"] = (8, c.seq, c.dim)
    return out


def tp_activation_memory():
    """Per-layer bytes saved for backward (the difference between the GPT with 2 and with 1
    layers), on one device and per rank under tp and tp+sp."""
    t = dist.get_world_size()
    out = {}
    for layers in (1, 2):
        c = GPTConfig(layers=layers)
        tok, _ = gpt_batch(c, 8)
        torch.manual_seed(0)
        ref = TinyGPT(c)
        params = {p.untyped_storage().data_ptr() for p in ref.parameters()}
        out[("single", layers)] = saved_activation_bytes(lambda: ref(tok), params)
        for name, sp in (("tp", False), ("tp+sp", True)):
            dm = autopar.compile(TinyGPT(c), autopar.Mesh(tp=t), example_inputs=(tok,),
                                 plan=autopar.Plan(tp=True, sp=sp))
            params = {p.untyped_storage().data_ptr() for p in dm.parameters()}
            out[(name, layers)] = saved_activation_bytes(lambda: dm(tok), params)
    out["sbh"] = (c.seq, 8, c.dim)
    return {k: (out[(k, 2)] - out[(k, 1)]) for k in ("single", "tp", "tp+sp")} | {"sbh": out["sbh"]}


class GPTWithLoss(torch.nn.Module):
    """The small GPT with its loss in the graph (what vocabulary parallelism needs)."""

    def __init__(self, c):
        super().__init__()
        self.gpt = TinyGPT(c)

    def forward(self, idx, targets):
        return lm_loss(self.gpt(idx), targets)


def parity_vocab_parallel():
    """Tied embedding/LM head split along the vocabulary (67 rows: uneven over 2 and 4) and
    the cross-entropy computed on the split logits; tp and tp+sp, tp = world size."""
    t = dist.get_world_size()
    c = GPTConfig()
    tok, tgt = gpt_batch(c, 8)
    out = {}
    for sp in (False, True):
        plan = autopar.Plan(tp=True, sp=sp, vocab_parallel=True)
        out[sp] = parity(lambda: GPTWithLoss(c), autopar.Mesh(tp=t), plan, (tok, tgt), tgt, lambda loss, _: loss)
        torch.manual_seed(0)
        dm = autopar.compile(GPTWithLoss(c), autopar.Mesh(tp=t), example_inputs=(tok, tgt), plan=plan)
        out[("table", sp)] = tuple(dm.module.get_parameter("gpt.wte.weight").shape)
    return out


class NoRuleMLP(torch.nn.Module):
    """A column-parallel product feeding an op the rule registry has no rule for, and for
    which the strategy search finds no sharded layout (logsumexp over every dim)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        h = self.a(x)
        return self.b(h - torch.logsumexp(h, dim=(0, 1), keepdim=True))


class RowThenColumn(torch.nn.Module):
    """A row-parallel product read directly by a column-parallel one: g, then f."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16, bias=False), torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.c(self.b(F.gelu(self.a(x))))


def parity_small_tp():
    x, y = mlp_batch()
    mesh, plan = autopar.Mesh(tp=dist.get_world_size()), autopar.Plan(tp=True)
    return {"no_rule": parity(NoRuleMLP, mesh, plan, (x,), y, mse),
            "row_then_column": parity(RowThenColumn, mesh, plan, (x,), y, mse)}
