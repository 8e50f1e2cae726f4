"""Batch sizes on real processes: parity of plans whose ranks or micro-batches hold one
sequence."""
from __future__ import annotations

import torch

import autopar
from autopar.models import GPTConfig, TinyGPT, gpt_batch, lm_loss
from autopar.testing import parity

from .common import report
from autopar.zoo import ADAM_EPS


def parity_batches(configs):
    """``configs`` = [(mesh axes, plan kwargs, global batch, GPTConfig overrides), ...]: parity
    of TinyGPT (4 layers) on a global batch of that many sequences. One sequence leaves more
    gradient elements that are float noise than a larger batch does (tp=2 at one sequence misses
    parity at Adam's default eps from that noise alone): eps as the zoo's, ``autopar.zoo.ADAM_EPS``."""
    torch.set_num_threads(1)
    out = []
    for axes, kw, batch, model_kw in configs:
        c = GPTConfig(**{"layers": 4, **model_kw})
        mesh, plan = autopar.Mesh(**axes), autopar.Plan(**kw)
        x, t = gpt_batch(c, batch)
        rep = parity(lambda: TinyGPT(c), mesh, plan, (x,), t, lm_loss, eps=ADAM_EPS)
        out.append(report(rep, f"{mesh} {plan} batch {batch} dropout {c.dropout}"))
    return out
