"""Dropout's cost: autopar's single-device masks against torch DDP's per-rank masks.

    python benchmarks/bench_dropout.py [--world-sizes 2 4] [--steps N] [--warmup K]

autopar draws every dropout site's mask at the single-device (whole-batch) shape on every
rank and keeps its slice (autopar/runtime/rng.py), so that masks equal the single-device
model's; torch DDP runs the model on each rank's slice, which draws a mask of the slice's
shape (and, seeded alike, the same pattern on every rank). For every world size N it spawns
N gloo processes and trains the same GPT (hidden and attention dropout 0.1, fp32, AdamW):

    torch DDP          DistributedDataParallel, dropout 0.1 (local masks)
    autopar ddp        Plan(dp="ddp"), dropout 0.1 (whole masks, sliced: dropout_rng="exact")
    autopar ddp local  Plan(dp="ddp", dropout_rng="local"): each rank draws its slice only
    autopar ddp p=0    the same with dropout 0 (no masks at all)

and reports per implementation the median step time (max over ranks of the per-rank
median; one step of each in turn, round-robin, after a barrier) and the ratio to torch DDP;
and, measured apart, the time of one step's mask draws (``draw_masks``) alone against the
time of drawing only this rank's slices (what a counter-based generator would draw).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from autopar.models import GPTConfig, TinyGPT, gpt_batch, lm_loss  # noqa: E402
from autopar.runtime.rng import draw_masks  # noqa: E402
from autopar.testing import run  # noqa: E402

CONFIG = GPTConfig(vocab=512, seq=128, dim=128, heads=4, layers=4, max_seq=128, dropout=0.1)
BATCH = 16


def _job(steps: int, warmup: int):
    torch.manual_seed(0)
    world, rank = dist.get_world_size(), dist.get_rank()
    ref = TinyGPT(CONFIG)
    tok, tgt = gpt_batch(CONFIG, BATCH)
    mesh = autopar.Mesh(dp=world)
    impls = {}
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(ref))
    impls["torch DDP"] = (ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4), tok.chunk(world)[rank],
                          tgt.chunk(world)[rank])
    dm = autopar.compile(copy.deepcopy(ref), mesh, example_inputs=(tok,), plan=autopar.Plan(dp="ddp"))
    impls["autopar ddp"] = (dm, dm.optimizer(torch.optim.AdamW, lr=1e-4), dm.shard_batch(tok), dm.shard_batch(tgt))
    dml = autopar.compile(copy.deepcopy(ref), mesh, example_inputs=(tok,), plan=autopar.Plan(dp="ddp", dropout_rng="local"))
    impls["autopar ddp local"] = (dml, dml.optimizer(torch.optim.AdamW, lr=1e-4), dml.shard_batch(tok),
                                  dml.shard_batch(tgt))
    c0 = GPTConfig(**{**CONFIG.__dict__, "dropout": 0.0})
    torch.manual_seed(0)
    dm0 = autopar.compile(TinyGPT(c0), mesh, example_inputs=(tok,), plan=autopar.Plan(dp="ddp"))
    impls["autopar ddp p=0"] = (dm0, dm0.optimizer(torch.optim.AdamW, lr=1e-4), dm0.shard_batch(tok),
                                dm0.shard_batch(tgt))
    times = {k: [] for k in impls}
    for i in range(warmup + steps):
        for name, (model, opt, x, y) in impls.items():
            dist.barrier()
            t0 = time.perf_counter()
            lm_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    # the draws alone: whole masks sliced (autopar) against this rank's slices only
    masks = dm.module.rng_masks
    draw_whole, draw_local = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        draw_masks(masks.sites, [masks], microbatches=1)
        draw_whole.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for site in masks.sites:
            local = masks.masks[(site.index, 0)]
            torch.empty(local.shape, dtype=site.dtype).bernoulli_(1 - site.p).bool()
        draw_local.append(time.perf_counter() - t0)
    out = {k: statistics.median(v) for k, v in times.items()}
    out["draw whole masks"] = statistics.median(draw_whole)
    out["draw local slices"] = statistics.median(draw_local)
    out["mask elements whole"] = sum(s.numel for s in masks.sites)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    print(f"GPT {CONFIG}, global batch {BATCH}, fp32, AdamW; gloo on {os.cpu_count()} cores")
    for world in a.world_sizes:
        res = run(_job, world, a.steps, a.warmup, timeout=900)
        agg = {k: max(r[k] for r in res) for k in res[0]}
        base = agg["torch DDP"]
        print(f"\nworld {world}: median step (max over ranks)")
        for name in ("torch DDP", "autopar ddp", "autopar ddp local", "autopar ddp p=0"):
            print(f"  {name:18s} {agg[name] * 1e3:8.1f} ms   x{agg[name] / base:.2f} of torch DDP")
        print(f"  one step's mask draws: whole masks sliced {agg['draw whole masks'] * 1e3:.2f} ms, "
              f"local slices only {agg['draw local slices'] * 1e3:.2f} ms "
              f"(x{agg['draw whole masks'] / agg['draw local slices']:.2f}); "
              f"{agg['mask elements whole']:,} mask elements per step; whole-mask draws are "
              f"{agg['draw whole masks'] / agg['autopar ddp'] * 100:.1f}% of autopar's step")


if __name__ == "__main__":
    main()
