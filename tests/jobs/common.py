"""What the jobs of every feature share: the dp modes, the small MLP's batch, one training step."""
from __future__ import annotations

import torch
import torch.nn.functional as F

MODES = ("ddp", "zero1", "zero2", "zero3")


def mse(out, target):
    return F.mse_loss(out, target)


def mlp_batch(batch=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 16, generator=g), torch.randn(batch, 16, generator=g)


def step(dm, opt, inputs, target, loss_fn):
    out = dm(*dm.shard_batch(inputs))
    loss = loss_fn(out, dm.shard_batch(target))
    loss.backward()
    opt.step()
    return loss.detach()


def report(rep, label):
    return {"label": label, "ok": rep.ok, "loss_err": rep.loss_err, "grad_err": rep.grad_err,
            "param_err": rep.param_err, "losses": rep.losses, "ref_losses": rep.ref_losses,
            "messages": rep.messages}


def saved_checkpoints(ranks, root, save_job, world_of):
    """``get(plan name)``: the directory of a checkpoint ``save_job`` saved under that plan, on
    ``world_of(name)`` ranks, saved when first asked (for a module-scoped fixture)."""
    done = {}

    def get(name):
        if name not in done:
            path = str(root / name.replace(" ", "_"))
            ranks(save_job, world_of(name), name, path, timeout=240)
            done[name] = path
        return done[name]
    return get
