"""The cost model's predictions against measurements: the plans at world 4 and what each
measures per rank (bytes, peak memory, step time)."""
from __future__ import annotations


import torch
import torch.distributed as dist

from autopar.models import GPTConfig

from . import common, memory_peak

PREDICT_CONFIG = GPTConfig(vocab=67, seq=32, dim=64, heads=4, layers=4, max_seq=32)
PREDICT_BATCH = 16


# (name, mesh axes, plan keyword arguments): one plan of each parallelism at world 4
PREDICT_PLANS = (
    ("ddp", {"dp": 4}, {"dp": "ddp"}),
    ("zero1", {"dp": 4}, {"dp": "zero1"}),
    ("zero2", {"dp": 4}, {"dp": "zero2"}),
    ("zero3", {"dp": 4}, {"dp": "zero3"}),
    ("tp", {"dp": 2, "tp": 2}, {"dp": "ddp", "tp": True}),
    ("tp+sp", {"dp": 2, "tp": 2}, {"dp": "zero2", "tp": True, "sp": True}),
    ("pp 1f1b", {"pp": 2, "dp": 2}, {"dp": "ddp", "pp_schedule": "1f1b", "microbatches": 4}),
    ("pp interleaved", {"pp": 2, "dp": 2}, {"dp": "zero1", "pp_schedule": "interleaved", "microbatches": 4,
                                            "virtual_stages": 2}),
    ("pp zero_bubble", {"pp": 4}, {"dp": "ddp", "pp_schedule": "zero_bubble", "microbatches": 4}),
)


def measured_plans(names=None, steps=7, extra=()):
    """Bytes per step, peak memory and step times of each plan in PREDICT_PLANS (and ``extra``
    (name, axes, plan kwargs) ones) on this rank. Bytes and memory are measured with each plan
    alone in the process (the census counts every live tensor); the step times with every plan
    compiled again and timed in rounds (``common.timed_rounds``: each plan a block of consecutive
    steps a round), so that a disturbance of the machine falls on all plans alike instead of on
    the one measured at the time."""
    torch.set_num_threads(1)
    plans = [(name, axes, kw) for name, axes, kw in tuple(PREDICT_PLANS) + tuple(extra)
             if names is None or name in names]
    out = {name: measured_memory(axes, kw) for name, axes, kw in plans}
    runners = {name: _prepared(axes, kw) for name, axes, kw in plans}
    for _, (_, step) in runners.items():
        for _ in range(2):
            step()
    for name, times in common.timed_rounds({name: step for name, (_, step) in runners.items()}, steps).items():
        out[name]["times"] = times
    dist.barrier()
    return out


def _prepared(axes, kw):
    """(body: forward, backward and optimizer step; step: zero_grad, then body) of the small GPT
    compiled under ``kw`` on a mesh of ``axes``."""
    body, dm, opt = memory_peak.prepared(PREDICT_CONFIG, PREDICT_BATCH, axes, kw)

    def step():
        opt.zero_grad(set_to_none=True)
        body()

    body.dm, body.opt = dm, opt
    return body, step


def measured_memory(axes, kw):
    """Bytes per step (the counters, after two warm-up steps) and peak memory of one plan."""
    body, step = _prepared(axes, kw)
    dm, opt = body.dm, body.opt
    for _ in range(2):
        step()
    dm.comm_stats.reset()
    step()
    nbytes = dm.comm_stats.total()
    by_axis = {a: dm.comm_stats.total(axis=a) for a in ("dp", "tp", "pp")}
    # peak: what lives between steps (after zero_grad: parameters, optimizer state, persistent
    # buffers) plus the most a step allocates on top, each profiled step after zero_grad as in
    # training (a step profiled after another without it would find the gradients already there)
    peak = memory_peak.peak_of(body, opt, dm)
    return {"bytes": nbytes, "by_axis": by_axis, **peak}
