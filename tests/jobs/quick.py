"""The fast tier's real-process parity: one representative plan of each parallelism on two
ranks, each against the single-device model (outputs, loss, gradients, parameters after
three AdamW steps)."""
from __future__ import annotations

import autopar
from autopar.models import GPTConfig, TinyGPT, TinyMLP, gpt_batch, lm_loss
from autopar.testing import parity

from .common import mlp_batch, mse

PLANS = (   # (name, model, mesh axes, plan)
    ("ddp gpt", "gpt", {"dp": 2}, autopar.Plan(dp="ddp")),
    ("zero2 gpt", "gpt", {"dp": 2}, autopar.Plan(dp="zero2")),
    ("zero3 mlp (7 rows over 2 ranks)", "mlp", {"dp": 2}, autopar.Plan(dp="zero3")),
    ("zero3 gpt", "gpt", {"dp": 2}, autopar.Plan(dp="zero3")),
    ("tp+sp gpt", "gpt", {"tp": 2}, autopar.Plan(tp=True, sp=True)),
    ("pp 1f1b gpt", "gpt4", {"pp": 2}, autopar.Plan(pp_schedule="1f1b", microbatches=4)),
)


def quick_parity():
    out = {}
    x, y = mlp_batch()
    for name, model, axes, plan in PLANS:
        mesh = autopar.Mesh(**axes)
        if model == "mlp":
            out[name] = parity(TinyMLP, mesh, plan, (x,), y, mse)
            continue
        c = GPTConfig(layers=4) if model == "gpt4" else GPTConfig()
        tok, tgt = gpt_batch(c, 8)
        out[name] = parity(lambda: TinyGPT(c), mesh, plan, (tok,), tgt, lm_loss)
    return out
