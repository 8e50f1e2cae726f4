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
    parity at Adam's default eps from that noise alone): eps as the zoo's, ``autopar.zoo.ADAM_EPS``.
    An override ``dtype`` builds the model in that dtype: float64 where fp32's rounding, grown by
    Adam over the steps, reaches the tolerance on some CPUs (tp=2 at one sequence with dropout:
    3.2x the gradient tolerance by the third step on an AVX2 machine, while in float64 its
    first step's gradients agree to 6e-16 of the largest)."""
    torch.set_num_threads(1)
    out = []
    for axes, kw, batch, model_kw in configs:
        model_kw = dict(model_kw)
        dtype = model_kw.pop("dtype", torch.float32)
        c = GPTConfig(**{"layers": 4, **model_kw})
        mesh, plan = autopar.Mesh(**axes), autopar.Plan(**kw)
        x, t = gpt_batch(c, batch)
        rep = parity(lambda: TinyGPT(c).to(dtype), mesh, plan, (x,), t, lm_loss, eps=ADAM_EPS)
        out.append(report(rep, f"{mesh} {plan} batch {batch} dropout {c.dropout} {dtype}"))
    return out
