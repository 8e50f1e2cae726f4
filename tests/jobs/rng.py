"""One random stream per mesh: dropout with ranks seeded apart (``torch.manual_seed(seed + rank)``)."""
from __future__ import annotations

import copy
import dataclasses

import torch
from torch.overrides import TorchFunctionMode

import autopar
from autopar.models import GPTConfig, TinyGPT, gpt_batch, lm_loss
from autopar.testing import parity

PLANS = {   # name -> (mesh axes, plan, layers)
    "tp": ({"tp": 2}, autopar.Plan(tp=True), 2),
    "tp+sp": ({"tp": 2}, autopar.Plan(tp=True, sp=True), 2),
    "zero3": ({"dp": 2}, autopar.Plan(dp="zero3"), 2),
    "pp 1f1b": ({"pp": 2}, autopar.Plan(pp_schedule="1f1b", microbatches=2), 4),
}


def seeded_apart_parity(name):
    """GPT with hidden and attention dropout 0.1, three AdamW steps; rank r seeds each step
    ``1000 + step + r``, the single-device model ``1000 + step``."""
    axes, plan, layers = PLANS[name]
    c = GPTConfig(layers=layers, dropout=0.1)
    tok, tgt = gpt_batch(c, 8)
    return parity(lambda: TinyGPT(c), autopar.Mesh(**axes), plan, (tok,), tgt, lm_loss, seed_per_rank=True)


def _compiled(name, dropout=0.1, **plan_changes):
    axes, plan, layers = PLANS[name]
    c = GPTConfig(layers=layers, dropout=dropout)
    tok, tgt = gpt_batch(c, 8)
    torch.manual_seed(0)
    ref = TinyGPT(c)
    plan = dataclasses.replace(plan, **plan_changes)
    dm = autopar.compile(copy.deepcopy(ref), autopar.Mesh(**axes), example_inputs=(tok,), plan=plan)
    return ref, dm, tok, tgt


def _step(dm, tok, tgt):
    if dm.plan.pp_schedule is not None:
        return dm.train_step(dm.shard_batch((tok,)), dm.shard_batch(tgt), lm_loss)
    out = dm(*dm.shard_batch((tok,)))
    lm_loss(out, dm.shard_batch(tgt)).backward()
    return out


def end_states(name):
    """After one training step, what this rank's default generator draws next: with every rank
    seeded 7 (``alike``), and with rank r seeded 7 + r (``apart``); and what one device draws
    after its forward from seed 7, and what seed 7 + r draws untouched."""
    ref, dm, tok, tgt = _compiled(name)
    rank = torch.distributed.get_rank()
    torch.manual_seed(7)
    ref(tok)
    one_device = torch.rand(3)
    torch.manual_seed(7 + rank)
    untouched = torch.rand(3)
    got = {}
    for how, seed in (("alike", 7), ("apart", 7 + rank)):
        torch.manual_seed(seed)
        _step(dm, tok, tgt)
        got[how] = torch.rand(3)
    return {"rank": rank, "alike_is_one_device": bool(torch.equal(got["alike"], one_device)),
            "apart_is_one_device": bool(torch.equal(got["apart"], one_device)),
            "apart_is_untouched": bool(torch.equal(got["apart"], untouched))}


class _Calls(TorchFunctionMode):
    """Records the attention calls (the ``torch.ops`` ones too) and their dropout."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(getattr(func, "__name__", func))
        if "scaled_dot_product" in name or "scaled_dot_product" in str(func):
            p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
            self.calls.append((str(func), float(p or 0.0)))
        return func(*args, **kwargs)


def local_seeded_apart(name):
    """Plan(dropout_rng="local") with rank r seeded 5 + r: this rank's output and the attention
    calls of its forward, twice from the same seeds (and the masks' keys)."""
    ref, dm, tok, tgt = _compiled(name, dropout=0.25, dropout_rng="local")
    rank = torch.distributed.get_rank()
    outs = []
    for _ in range(2):
        torch.manual_seed(5 + rank)
        with _Calls() as rec:
            out = dm(*dm.shard_batch((tok,)))
        lm_loss(out, dm.shard_batch(tgt)).backward()
        outs.append(out.detach())
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, outs[0])
    return {"rank": rank, "same_as_rank0": bool(torch.equal(outs[0], gathered[0])),
            "repeatable": bool(torch.equal(outs[0], outs[1])), "calls": rec.calls,
            "finite": bool(torch.isfinite(outs[0]).all())}


def local_recomputed(recompute):
    """Plan(tp=True, dropout_rng="local", recompute=...) with rank r seeded 5 + r: the loss and
    the gradients (gathered) of one step."""
    ref, dm, tok, tgt = _compiled("tp", dropout=0.25, dropout_rng="local", recompute=recompute)
    torch.manual_seed(5 + torch.distributed.get_rank())
    loss = lm_loss(dm(*dm.shard_batch((tok,))), dm.shard_batch(tgt))
    loss.backward()
    recomputed = sum(m.recomputes for m in dm.modules() if hasattr(m, "recomputes"))
    return {"loss": loss.detach(), "grads": {k: g.clone() for k, g in dm.full_grads().items() if g is not None},
            "recomputed": recomputed}
