"""Training semantics: dropout with single-device masks, train/eval modes, gradient
accumulation, optimizers."""
from __future__ import annotations

import copy

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
from autopar.models import GPTConfig, TinyGPT, gpt_batch, lm_loss
from autopar.testing import parity

DROPOUT_PLANS = (   # (name, mesh axes, plan, layers)
    ("ddp", {"dp": 2}, autopar.Plan(dp="ddp"), 2),
    ("zero3", {"dp": 2}, autopar.Plan(dp="zero3"), 2),
    ("tp", {"tp": 2}, autopar.Plan(tp=True), 2),
    ("tp+sp", {"tp": 2}, autopar.Plan(tp=True, sp=True), 2),
    ("pp 1f1b", {"pp": 2}, autopar.Plan(pp_schedule="1f1b", microbatches=2), 4),
)


def dropout_parity(names=None):
    out = {}
    for name, axes, plan, layers in DROPOUT_PLANS:
        if names is not None and name not in names:
            continue
        c = GPTConfig(layers=layers, dropout=0.1)
        tok, tgt = gpt_batch(c, 8)
        out[name] = parity(lambda: TinyGPT(c), autopar.Mesh(**axes), plan, (tok,), tgt, lm_loss)
    return out


class _Bernoulli(TorchDispatchMode):
    """Records every mask the single-device model draws (``bernoulli_``), in order."""

    def __init__(self):
        super().__init__()
        self.masks = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.bernoulli_.float, torch.ops.aten.bernoulli.p):
            self.masks.append(out.clone())
        return out


def _expected_slice(mask, kind, axes, plan, mb, m):
    """This rank's part of a single-device mask, written from the plan (independently of
    autopar's slicing): dp rows (a pipeline: micro-batch ``mb`` of the dp slice), heads
    under tp, sequence positions under sp."""
    mesh = autopar.Mesh(**axes)
    n, d = mesh.axis_size("dp"), mesh.coordinate("dp")
    t, ti = mesh.axis_size("tp"), mesh.coordinate("tp")
    rows = mask.shape[0] // (n * m)
    out = mask[d * (mask.shape[0] // n) + mb * rows:][:rows]
    if kind == "sdpa" and plan.tp:      # (batch, heads, L, S): heads split
        h = out.shape[1] // t
        out = out[:, ti * h:(ti + 1) * h]
    elif kind == "dropout" and plan.sp:   # (batch, seq, hidden): sequence split
        s = out.shape[1] // t
        out = out[:, ti * s:(ti + 1) * s]
    return out


def dropout_masks(name):
    """Every mask this rank holds equals (bitwise) its slice of the single-device model's mask
    drawn from the same seed; and the generator ends the forward in the single-device state."""
    _, axes, plan, layers = next(p for p in DROPOUT_PLANS if p[0] == name)
    c = GPTConfig(layers=layers, dropout=0.1)
    tok, tgt = gpt_batch(c, 8)
    torch.manual_seed(0)
    ref = TinyGPT(c)
    dm = autopar.compile(copy.deepcopy(ref), autopar.Mesh(**axes), example_inputs=(tok,), plan=plan)
    torch.manual_seed(7)
    with _Bernoulli() as rec:
        ref(tok)
    after_ref = torch.rand(3)
    torch.manual_seed(7)
    if plan.pp_schedule is not None:
        dm.train_step(dm.shard_batch((tok,)), dm.shard_batch(tgt), lm_loss)
        holders = [st.module.rng_masks for st in dm.stages.values() if hasattr(st.module, "rng_masks")]
        m = plan.microbatches
    else:
        dm(*dm.shard_batch((tok,)))
        holders, m = [dm.module.rng_masks], 1
    after_dm = torch.rand(3)
    checked = []
    for h in holders:
        for (site, mb), local in h.masks.items():
            kind = dm.ctx.rng_sites[site].kind
            want = _expected_slice(rec.masks[site].div(0.9), kind, axes, plan, mb, m)
            checked.append((site, mb, kind, tuple(local.shape), bool(torch.equal(local, want))))
    return {"checked": checked, "sites": len(rec.masks), "generator_state_equal": bool(torch.equal(after_ref, after_dm))}
