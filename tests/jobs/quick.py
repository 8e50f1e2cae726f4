"""The fast tier's real-process parity: one representative plan of each parallelism on two
ranks, each against the single-device model (outputs, loss, gradients, parameters after
three AdamW steps)."""
from __future__ import annotations

import copy

import torch

import autopar
from autopar.models import GPTConfig, TinyGPT, TinyMLP, gpt_batch, lm_loss
from autopar.runtime import flight
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


FULL_VIEWS = (   # (name, mesh axes, plan)
    ("dp2 x tp2 zero3", {"dp": 2, "tp": 2}, autopar.Plan(dp="zero3", tp=True)),
    ("pp2 x dp2 zero3", {"pp": 2, "dp": 2}, autopar.Plan(dp="zero3", pp_schedule="1f1b", microbatches=2)),
)


def full_views():
    """``full_state_dict`` and ``full_grads`` of the small GPT (67 words: uneven pieces) under
    each plan of ``FULL_VIEWS``, after one backward: the collectives each issued (by kind) and
    the largest difference from the single-device model's parameters (exact) and gradients
    (scaled by 1e-6 + 1e-4 |g|)."""
    torch.set_num_threads(1)
    out = {}
    for name, axes, plan in FULL_VIEWS:
        torch.manual_seed(0)
        c = GPTConfig()
        ref = TinyGPT(c)
        x, t = gpt_batch(c, 8)
        dm = autopar.compile(copy.deepcopy(ref), autopar.Mesh(**axes), example_inputs=(x,), plan=plan)
        lm_loss(ref(x), t).backward()
        lx, lt = dm.shard_batch((x,)), dm.shard_batch(t)
        if plan.pp_schedule is not None:
            dm.train_step(lx, lt, lm_loss)
        else:
            lm_loss(dm(*lx), lt).backward()
        issued, launch = [], flight.launch

        def counted(group, kind, *args, **kwargs):
            issued.append(kind)
            return launch(group, kind, *args, **kwargs)

        flight.launch = counted
        try:
            state = dm.full_state_dict()
            state_calls = list(issued)
            issued.clear()
            grads = dm.full_grads()
            grad_calls = list(issued)
        finally:
            flight.launch = launch
        want = dict(ref.named_parameters())
        out[name] = {
            "state_calls": state_calls, "grad_calls": grad_calls,
            "state_keys": sorted(state) == sorted(ref.state_dict()),
            "state_err": max(float((state[k] - v).abs().max()) for k, v in ref.state_dict().items()),
            "grad_err": max(float(((grads[k] - p.grad).abs() / (1e-6 + 1e-4 * p.grad.abs())).max())
                            for k, p in want.items()),
        }
    return out
