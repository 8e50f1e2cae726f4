"""Measurements of models and plans the local calibration never ran (benchmarks/bench_holdout.py):
per rank, the bytes each plan sends per step, its peak memory and its step times, measured as
``jobs.predict`` measures its small GPT, for any GPT or Llama shape and batch."""
from __future__ import annotations

import gc

import torch
import torch.distributed as dist

import autopar
from autopar import tuning
from autopar.models import GPTConfig, Llama, LlamaConfig, TinyGPT, gpt_batch, lm_loss
from autopar.testing import steady_live_bytes

from . import common, memory_peak


def build(spec):
    """(model, config) of ``spec``: ("gpt", GPTConfig fields) or ("llama", LlamaConfig fields),
    weights from ``torch.manual_seed(0)``."""
    kind, fields = spec
    torch.manual_seed(0)
    if kind == "gpt":
        c = GPTConfig(**fields)
        return TinyGPT(c), c
    c = LlamaConfig(**fields)
    return Llama(c), c


def prepared(spec, batch, axes, kw):
    """(step: zero_grad, forward, backward, AdamW step; body: the same without zero_grad; dm; opt)
    of the model of ``spec`` compiled under ``kw`` on a mesh of ``axes``."""
    model, c = build(spec)
    body, dm, opt = memory_peak.compiled_body(model, gpt_batch(c, batch), axes, kw)
    del model

    def step():
        opt.zero_grad(set_to_none=True)
        body()

    return step, body, dm, opt


def live_contention(seconds: float) -> tuple:
    """(seconds per loop alone or None, seconds per loop crowded) of this rank for the local
    calibration's contention probe read now: the synthetic stack's forward + backward
    (``calibration.local._stack_seconds``) looped ``seconds`` by rank 0 alone (the others
    waiting in a barrier, which takes no core), then by every rank at once for twice as long.
    ``bench_holdout.live_slowdown`` makes the slowdown of it as the calibration does (the ranks'
    harmonic mean over alone)."""
    from autopar.cost.calibration.local import _stack_seconds
    dist.barrier()
    alone = _stack_seconds(seconds) if dist.get_rank() == 0 else None
    dist.barrier()
    return alone, _stack_seconds(2 * seconds, dist.barrier)


def measured_cases(cases, steps: int = 7, memory: bool = True, block: int = common.BLOCK, alone: bool = False,
                   contention_seconds: float = 0.0) -> dict:
    """{(model key, plan name): {bytes, by_axis, peak, times}} on this rank for ``cases``, a list
    of (model key, spec, batch, [(plan name, mesh axes, plan kwargs), ...]). A model's plans
    are compiled one after another, each one's bytes (the counters, after two warm-up steps)
    and peak memory measured when it is compiled: ``memory_peak.peak_of`` (what lives between
    its steps, the census after zero_grad, plus the profiler's peak of what a step allocates on
    top, each profiled step after zero_grad), less what lived before it was compiled.
    ``alone``: each plan's ``steps`` step times are then taken at once, the plan alone in the
    processes (``_timed_alone``), and it is freed before the next is compiled. Otherwise the
    model's plans are timed in rounds, so that a disturbance of the machine falls on all of
    them alike: each round runs every plan for ``block`` consecutive steps and times all but the
    first, until each plan has at least ``steps`` times; then they are dropped before the next
    model. ``memory=False``: step times only (no counters, no census). ``contention_seconds``
    > 0: before each model's plans, the calibration's contention probe read again
    (``live_contention``), kept as ``out[("contention", model key)]``.

    Blocks, not one step each in turn: see ``common.timed_rounds``. Alone, not in rounds: on 2
    processes, with a model's 9 plans resident and timed in rounds, ddp measured 1.18x its step
    alone (up to 1.49x), zero-bubble 1.14x and interleaved 1.11x (geometric means over the
    hold-out grid's 13 models, 2026-12-04; BENCHMARKS.md, runs 26-28); on 4 within 4%."""
    torch.set_num_threads(1)
    out = {}
    for key, spec, batch, plans in cases:
        if contention_seconds > 0:
            out[("contention", key)] = live_contention(contention_seconds)
        runners = {}
        for name, axes, kw in plans:
            before = steady_live_bytes(3) if memory else 0    # collects garbage first
            step, body, dm, opt = prepared(spec, batch, axes, kw)
            out[(key, name)] = row = {"times": []}
            if memory:
                for _ in range(2):
                    step()
                dm.comm_stats.reset()
                step()
                row.update(bytes=dm.comm_stats.total(), by_axis={a: dm.comm_stats.total(axis=a) for a in ("dp", "tp", "pp")},
                           peak=memory_peak.peak_of(body, opt, dm)["peak"] - before)
                dist.barrier()
            if alone:
                row["times"] = _timed_alone(step, steps)
                del step, body, dm, opt
                gc.collect()
                dist.barrier()
            else:
                runners[name] = step
        for step in runners.values():
            for _ in range(1 if memory else 2):
                step()
        for name, times in (common.timed_rounds(runners, steps, block) if runners else {}).items():
            out[(key, name)]["times"] = times
        runners = step = body = dm = opt = None
        gc.collect()
        dist.barrier()
    return out


def _timed_alone(step, steps: int, warmup: int = 3) -> list:
    """Seconds of each of ``steps`` consecutive steps of one plan, each after a barrier, after
    ``warmup`` untimed ones: the plan alone in its processes, as a training loop runs it (one
    round of ``autopar.tuning.timed_rounds`` whose block is all the steps, its first untimed)."""
    for _ in range(warmup - 1):
        step()
    return tuning.timed_rounds({"plan": step}, steps, block=steps + 1)["plan"]


def tune_pick(spec, batch: int, pairs, steps: int) -> int:
    """The index in ``pairs`` ((mesh axes, plan kwargs), ...) of the plan ``autopar.tune``
    measures fastest for the model of ``spec`` on a global batch of ``batch`` rows."""
    torch.set_num_threads(1)
    model, c = build(spec)
    x, y = gpt_batch(c, batch)
    report = autopar.tune(model, [(axes, autopar.Plan(**kw)) for axes, kw in pairs], example_inputs=(x,),
                          targets=y, loss_fn=lm_loss, steps=steps)
    return report.rows.index(report.chosen)
