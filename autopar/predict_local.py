"""The cost model's predictions against measurements on this machine: a small GPT
(``PREDICT_CONFIG``, global batch ``PREDICT_BATCH``) under one plan of every parallelism at
world 4 (``PREDICT_PLANS``: the hold-out grid's, ``autopar.holdout.PLANS_4``), and what each
plan measures per rank (bytes, peak memory, step time). tests/test_predict_local.py holds the
predictions to their bounds; benchmarks/bench_plan.py prints them."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .holdout import PLANS_4 as PREDICT_PLANS
from .measure import compiled_body, peak_of, timed_rounds
from .models import GPTConfig, TinyGPT, gpt_batch

__all__ = ["PREDICT_CONFIG", "PREDICT_BATCH", "PREDICT_PLANS", "measured_plans", "measured_memory"]

PREDICT_CONFIG = GPTConfig(vocab=67, seq=32, dim=64, heads=4, layers=4, max_seq=32)
PREDICT_BATCH = 16


def measured_plans(names=None, steps=7, extra=()):
    """Bytes per step, peak memory and step times of each plan in PREDICT_PLANS (and ``extra``
    (name, axes, plan kwargs) ones) on this rank. Bytes and memory are measured with each plan
    alone in the process (the census counts every live tensor); the step times with every plan
    compiled again and timed in rounds (``autopar.measure.timed_rounds``: each plan a block of
    consecutive steps a round), so that a disturbance of the machine falls on all plans alike
    instead of on the one measured at the time."""
    torch.set_num_threads(1)
    plans = [(name, axes, kw) for name, axes, kw in tuple(PREDICT_PLANS) + tuple(extra)
             if names is None or name in names]
    out = {name: measured_memory(axes, kw) for name, axes, kw in plans}
    runners = {name: _prepared(axes, kw) for name, axes, kw in plans}
    for _, (_, step) in runners.items():
        for _ in range(2):
            step()
    for name, times in timed_rounds({name: step for name, (_, step) in runners.items()}, steps).items():
        out[name]["times"] = times
    dist.barrier()
    return out


def _prepared(axes, kw):
    """(body: forward, backward and optimizer step; step: zero_grad, then body) of the small GPT
    (weights from ``torch.manual_seed(0)``) compiled under ``kw`` on a mesh of ``axes``."""
    torch.manual_seed(0)
    model = TinyGPT(PREDICT_CONFIG)
    body, dm, opt = compiled_body(model, gpt_batch(PREDICT_CONFIG, PREDICT_BATCH), axes, kw)
    del model

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
    peak = peak_of(body, opt, dm)
    return {"bytes": nbytes, "by_axis": by_axis, **peak}
