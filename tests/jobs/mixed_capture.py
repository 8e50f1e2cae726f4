"""Mixed precision of a model that runs only with autocast's casts, on real processes: the
project's Llama (fp32 rotary tables meet bf16 activations in front of attention) against the
single-device model under the same policy (``autopar.testing.MixedReference``)."""
from __future__ import annotations

import torch

import autopar
from autopar.models import small
from autopar.testing import parity

from jobs.mixed import ADAM_EPS

BF16 = torch.bfloat16

PLANS = {   # name -> (mesh axes, plan)
    "zero3": ({"dp": 2}, autopar.Plan(dp="zero3", param_dtype=BF16)),
    "tp+sp": ({"tp": 2}, autopar.Plan(tp=True, sp=True, param_dtype=BF16)),
}


def llama_parity(name: str, steps: int = 3):
    """``parity`` of the tiny Llama under the plan ``PLANS[name]``: this rank's report."""
    axes, plan = PLANS[name]
    _, inputs, target, loss = small("tiny-llama")
    return parity(lambda: small("tiny-llama")[0], autopar.Mesh(**axes), plan, inputs, target, loss,
                  steps=steps, eps=ADAM_EPS)
