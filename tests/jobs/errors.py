"""Bad input on real processes: each must be a clear error on every rank, never a hang."""
from __future__ import annotations

import torch
import torch.distributed as dist

import autopar
from autopar.models import GPTConfig, TinyGPT, TinyMLP, gpt_batch, lm_loss

from .common import mlp_batch, mse

def mesh_mismatch():
    try:
        autopar.Mesh(dp=dist.get_world_size() * 2)
    except ValueError as e:
        return str(e)
    return None


def stale_shards():
    """ZeRO-2 shards written in place outside an optimizer step: forward refuses the stale
    replicas instead of running on them."""
    x, y = mlp_batch()
    dm = autopar.compile(TinyMLP(), autopar.Mesh(dp=dist.get_world_size()), example_inputs=(x,),
                         plan=autopar.Plan(dp="zero2"))
    mse(dm(dm.shard_batch(x)), dm.shard_batch(y)).backward()
    with torch.no_grad():
        for p in dm.parameters():
            p.sub_(0.1 * p.grad)
    try:
        dm(dm.shard_batch(x))
    except RuntimeError as e:
        return str(e)
    return None


def auto_plan_uncalibrated():
    """compile(plan='auto') in a rank (a daemonic process) with no cached calibration."""
    x, _ = mlp_batch()
    try:
        autopar.compile(TinyMLP(), autopar.Mesh(dp=dist.get_world_size()), example_inputs=(x,))
    except ValueError as exc:
        return str(exc)
    return "compiled"


def order_mismatch():
    """Rank 1 compiles a GPT with one layer more than rank 0's, under ddp, zero3 and tp: each
    compile must fail on every rank with the first differing collective, never hang."""
    torch.set_num_threads(1)
    c = GPTConfig(layers=2 + dist.get_rank())
    tok, _ = gpt_batch(c, 8)
    out = {}
    for name, mesh, plan in (("ddp", autopar.Mesh(dp=2), autopar.Plan(dp="ddp")),
                             ("zero3", autopar.Mesh(dp=2), autopar.Plan(dp="zero3")),
                             ("tp", autopar.Mesh(tp=2), autopar.Plan(tp=True))):
        try:
            autopar.compile(TinyGPT(c), mesh, example_inputs=(tok,), plan=plan)
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    # the ranks are still in step: a matching compile and a step run
    c = GPTConfig(layers=2)
    tok, tgt = gpt_batch(c, 8)
    dm = autopar.compile(TinyGPT(c), autopar.Mesh(dp=2), example_inputs=(tok,), plan=autopar.Plan(dp="zero3"))
    lm_loss(dm(*dm.shard_batch((tok,))), dm.shard_batch(tgt)).backward()
    out["after"] = True
    return out


def order_mismatch_plans():
    """The ranks pass different plans (overlap on one, off on the other): the compile fails on
    both with the first differing collective (here the plan itself), before any group is made."""
    torch.set_num_threads(1)
    c = GPTConfig(layers=2)
    tok, _ = gpt_batch(c, 8)
    try:
        autopar.compile(TinyGPT(c), autopar.Mesh(dp=2), example_inputs=(tok,),
                        plan=autopar.Plan(dp="zero2", overlap=dist.get_rank() == 0))
        return None
    except ValueError as exc:
        return str(exc)
