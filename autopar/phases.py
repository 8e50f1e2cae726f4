"""A training step's phases, predicted by the cost model and timed on each rank: where the
predicted step and the measured one part (benchmarks/step_phases.py prints them side by side).

A pipeline's ``train_step`` is its schedule (the module's own ``step_time``: the actions and
the wait for the last sends), then the deferred data-parallel reduction, the exchange of tied
gradients and the loss broadcast; a single-stage plan's step is its forward (with the loss),
its backward (with the gradient reductions it waits for); both end with the optimizer step.
``predicted_phases`` splits an Estimate's timeline into the same phases.

Beside the phases, two parts of every step (``STEP_PARTS``): the seconds the rank spent waiting
on the runtime's collectives (each asynchronous handle's ``wait`` and each synchronous
collective, as ``autopar.runtime.flight`` issues them: gradient buckets, tp all-reduces, pipeline
messages), and the step's thread CPU time (the rank's own work; a wait blocks without it, and
time its thread was runnable but off the core is in neither)."""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from .api import compile as autopar_compile
from .mesh import Mesh
from .models import GPTConfig, Llama, LlamaConfig, TinyGPT, gpt_batch, lm_loss
from .planspec import Plan
from .runtime import flight

__all__ = ["PIPELINE_PHASES", "STAGE_PHASES", "STEP_PARTS", "AFTER_SCHEDULE", "build", "predicted_phases",
           "phase_times", "medians"]

PIPELINE_PHASES = ("schedule", "dp reduction", "tied gradients", "loss broadcast", "optimizer")
STAGE_PHASES = ("forward", "backward + reductions", "optimizer")
STEP_PARTS = ("collective waits", "rank CPU")
AFTER_SCHEDULE = {"dp reduction (deferred)": "dp reduction", "tied gradients": "tied gradients",
                  "loss broadcast": "loss broadcast", "optimizer": "optimizer"}
"""{label of an Estimate's timeline entry after a pipeline's schedule: its phase}"""


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


def predicted_phases(e, pipeline: bool) -> dict:
    """{phase: seconds} of an Estimate's timeline, summing to its step time."""
    tl = e.timeline
    if pipeline:
        after = [x for x in tl if x[2] in AFTER_SCHEDULE or x[2].startswith(("all_gather params", "params up"))]
        out = {"schedule": min(x[3] for x in after)}
        for label, phase in AFTER_SCHEDULE.items():
            out[phase] = max((x[4] - x[3] for x in tl if x[2] == label), default=0.0)
        out["optimizer"] = e.step_time_s - sum(out.values()) + out["optimizer"]   # the gathers after it
        return out
    fwd = min(x[3] for x in tl if x[2].startswith("B "))
    opt = min(x[3] for x in tl if x[2] == "optimizer")
    tail = max(x[4] for x in tl) - opt
    return {"forward": fwd, "backward + reductions": e.step_time_s - fwd - tail, "optimizer": tail}


_WAITED = [0.0]     # seconds this process has spent in collectives' waits (``_count_waits``)
_COUNTING = [False]  # whether ``_count_waits`` has wrapped the runtime's collectives in this process


def _count_waits():
    """Make the runtime's collectives add the seconds their waits block to ``_WAITED``: each
    asynchronous handle's ``wait`` and each synchronous collective's call (once per process).

    At ``flight``, not through ``dm.record_timeline()``: the timeline traces the collectives of
    the axes' ``AxisComm`` and the pipeline's messages, not the synchronous ones a pipeline
    issues itself (the loss broadcast), where GPipe's first stage does its blocking; under it
    that rank's step reads no wait at all (2 processes, tests/test_step_phases.py)."""
    if _COUNTING[0]:
        return
    launch, wait = flight.launch, flight.Watched.wait

    def counted_launch(group, kind, label, nbytes, start, *args, **kwargs):
        t0 = time.perf_counter()
        handle = launch(group, kind, label, nbytes, start, *args, **kwargs)
        if handle is None:      # synchronous: the call was the wait
            _WAITED[0] += time.perf_counter() - t0
        return handle

    def counted_wait(self, *args):
        t0 = time.perf_counter()
        try:
            return wait(self, *args)
        finally:
            _WAITED[0] += time.perf_counter() - t0

    flight.launch, flight.Watched.wait = counted_launch, counted_wait
    _COUNTING[0] = True


def _timed(times: dict, label: str, fn):
    def wrapped(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[label] = times.get(label, 0.0) + time.perf_counter() - t0
    return wrapped


def phase_times(spec, batch: int, cases, steps: int = 21) -> dict:
    """{plan name: {"step": [s, ...], phase: [s, ...]}} on this rank: each of ``cases``
    ((name, mesh axes, plan kwargs), ...) compiled for the model of ``spec`` (``build``) on a
    global batch of ``batch`` rows, warmed up 3 steps, then the plans timed round-robin, one
    step each per round after a barrier, ``steps`` rounds; with each step's ``STEP_PARTS``.
    Every rank of the process group calls it alike."""
    torch.set_num_threads(1)
    _count_waits()
    runners = {}
    for name, axes, kw in cases:
        model, c = build(spec)
        x, t = gpt_batch(c, batch)
        plan = Plan(**kw)
        dm = autopar_compile(model, Mesh(**axes), example_inputs=(x,), plan=plan)
        del model
        opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
        lx, lt = dm.shard_batch((x,)), dm.shard_batch(t)
        times: dict = {}
        opt.step = _timed(times, "optimizer", opt.step)
        if plan.pp_schedule:
            for st in dm.stages.values():
                st.sync.flush_deferred = _timed(times, "dp reduction", st.sync.flush_deferred)
            for part in ("tied gradients", "loss broadcast"):
                dm.instrument(part, lambda fn, part=part, times=times: _timed(times, part, fn))

            def step(dm=dm, opt=opt, lx=lx, lt=lt, times=times):
                opt.zero_grad(set_to_none=True)
                dm.train_step(lx, lt, lm_loss)
                opt.step()
                times["schedule"] = dm.step_time
        else:
            fwd = _timed(times, "forward", lambda dm=dm, lx=lx, lt=lt: lm_loss(dm(*lx), lt))
            bwd = _timed(times, "backward + reductions", lambda loss: loss.backward())

            def step(opt=opt, times=times, fwd=fwd, bwd=bwd):
                opt.zero_grad(set_to_none=True)
                bwd(fwd())
                opt.step()
        runners[name] = (step, times)
    for step, _ in runners.values():
        for _ in range(3):
            step()
    out = {name: {} for name in runners}
    for _ in range(steps):
        for name, (step, times) in runners.items():
            dist.barrier()
            times.clear()
            waited, c0 = _WAITED[0], time.thread_time()
            t0 = time.perf_counter()
            step()
            times["step"] = time.perf_counter() - t0
            times["rank CPU"] = time.thread_time() - c0
            times["collective waits"] = _WAITED[0] - waited
            for k, v in times.items():
                out[name].setdefault(k, []).append(v)
    return out


def medians(per_rank: list, name: str) -> dict:
    """{phase: the slowest rank's median seconds} of plan ``name`` over ``phase_times``' results."""
    return {k: max(statistics.median(r[name][k]) for r in per_rank) for k in per_rank[0][name]}
