"""The overlap pass on real processes: the recorded timeline and its dump, ZeRO-3 prefetch
within its memory budget."""
from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist

import autopar
from autopar.models import GPTConfig, TinyGPT, gpt_batch, lm_loss
from autopar.testing import profiled_peak_bytes

from .common import step

def timeline_and_dump(out_dir, plan_kw):
    """Record one step's timeline, dump it (measured and predicted lanes) and report what a
    test checks: per rank, the lanes, exposed communication and the collectives counted."""
    torch.set_num_threads(1)
    c = GPTConfig(layers=2)
    tok, tgt = gpt_batch(c, 8)
    torch.manual_seed(0)
    dm = autopar.compile(TinyGPT(c), autopar.Mesh(dp=dist.get_world_size()), example_inputs=(tok,),
                         plan=autopar.Plan(**plan_kw))
    opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
    step(dm, opt, (tok,), tgt, lm_loss)
    dm.comm_stats.reset()
    with dm.record_timeline():
        step(dm, opt, (tok,), tgt, lm_loss)
    calls = sum(dm.comm_stats.calls.values())
    files = dm.dump(out_dir) if dist.get_rank() == 0 else []
    tl = dm.timelines[dist.get_rank()]
    return {"calls": calls, "events": tl.events, "lanes": tl.lanes(), "exposed": tl.exposed_comm_s,
            "duration": tl.duration_s, "n_timelines": len(dm.timelines), "files": [os.path.basename(f) for f in files]}


def prefetch_memory(multiples, steps=5):
    """ZeRO-3 on a GPT with 4 layers: for prefetch budgets of ``multiples`` of the largest
    unit's in-flight bytes (None: the default, one unit ahead), the most gather bytes in flight
    at once (the runtime's count), the unit sizes, and the measured peak of a step's
    allocations (profiler, median of ``steps``)."""
    torch.set_num_threads(1)
    c = GPTConfig(layers=4, dim=64, heads=4)
    tok, tgt = gpt_batch(c, 8)
    out = {}
    layer = None
    for m in multiples:
        budget = None if m is None else m * (layer or 0)
        torch.manual_seed(0)
        dm = autopar.compile(TinyGPT(c), autopar.Mesh(dp=dist.get_world_size()), example_inputs=(tok,),
                             plan=autopar.Plan(dp="zero3", prefetch_bytes=budget))
        units = [dm._sync.unit_bytes(k) for k in range(len(dm._sync.units))]
        if layer is None:
            layer = max(units)
            if m:
                raise ValueError("the first budget multiple must be 0 or None (it measures the unit size)")
        lx, lt = dm.shard_batch((tok,)), dm.shard_batch(tgt)

        def body():
            lm_loss(dm(*lx), lt).backward()
        body()
        for p in dm.parameters():
            p.grad = None
        gc.collect()
        dm._sync.peak_inflight_bytes = 0
        peaks = []

        def between():
            for p in dm.parameters():
                p.grad = None
        for _ in range(steps):   # after another step in the window: its frees are seen (profiled_peak_bytes)
            peaks.append(profiled_peak_bytes(body, before=lambda: (body(), between())))
            between()
        out[m] = {"budget": budget, "inflight": dm._sync.peak_inflight_bytes, "units": units,
                  "peak": sorted(peaks)[len(peaks) // 2], "peaks": peaks}
    return out
