"""What the jobs of every feature share: the dp modes, the small MLP's batch, one training step,
and how the timing jobs time steps."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
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


BLOCK = 4      # timed_rounds: consecutive steps of one plan a round (the first not timed)


def timed_rounds(steps_by_name: dict, steps: int, block: int = BLOCK) -> dict:
    """{name: [seconds of each timed step]} of the step functions in ``steps_by_name``, timed in
    rounds so that a disturbance of the machine falls on all of them alike: each round runs
    every one for ``block`` consecutive steps, each after a barrier, and times all but the
    first, until each has at least ``steps`` times (``block=1``: one step each in turn, all
    timed).

    Why blocks: a training loop runs one plan step after step, and that is the step the cost
    model predicts. A step that follows another model's step starts with that model's
    parameters, optimizer state and activations in the caches instead of its own. Measured on
    2 processes (gpt h96 L2 s16, the 9 plans of the hold-out grid at world 2, three interleaved
    repeats, 2026-12-04): ddp took 8.1 ms a step one step each in turn, 7.2 ms in blocks of 4
    and 6.7 ms alone; ZeRO-1 11.6 and 8.9 ms, ZeRO-2 10.1 and 8.1 ms."""
    times = {name: [] for name in steps_by_name}
    timed = max(1, block - 1)
    for _ in range(-(-steps // timed)):
        for name, step in steps_by_name.items():
            for i in range(timed + (block > 1)):
                dist.barrier()
                t0 = time.perf_counter()
                step()
                if i or block <= 1:
                    times[name].append(time.perf_counter() - t0)
    return times


def report(rep, label):
    return {"label": label, "ok": rep.ok, "loss_err": rep.loss_err, "grad_err": rep.grad_err,
            "param_err": rep.param_err, "losses": rep.losses, "ref_losses": rep.ref_losses,
            "messages": rep.messages}
