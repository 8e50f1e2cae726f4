"""Measuring a compiled training step on its ranks, as the hold-out harness (``autopar.holdout``)
and the test suite's jobs measure it: the step of a language model compiled under a plan
(``compiled_body``), its peak memory (``peak_of``: what lives between steps, the census after
zero_grad, plus the profiler's peak of what the step allocates on top,
``autopar.testing.profiled_peak_bytes``; ``collectives_settled``), and its step times: plans in
whole rounds of consecutive steps (``timed_rounds``) or one plan alone (``timed_alone``)."""
from __future__ import annotations

import contextlib
import gc
import time

import torch
import torch.distributed as dist

from . import tuning
from .api import compile as autopar_compile
from .mesh import Mesh
from .models import lm_loss
from .planspec import Plan
from .runtime import flight
from .runtime.rng import RandomMasks
from .testing import profiled_peak_bytes, steady_live_bytes

__all__ = ["compiled_body", "peak_of", "collectives_settled", "timed_rounds", "timed_alone", "STEPS", "BLOCK"]

STEPS = 3            # profiled steps per plan; the median is the plan's peak (gloo frees a collective's
                     # buffers from its own thread, a moment after the wait: steps differ a little)
BLOCK = 4      # timed_rounds: consecutive steps of one plan a round (the first not timed)


def compiled_body(model, batch, axes, kw, *, hold_reduced=False):
    """(body: forward, backward, optimizer step; dm; opt) of a language model ``model`` on
    ``batch`` = (tokens, targets), compiled under ``kw`` on a mesh of ``axes``."""
    x, t = batch
    plan = Plan(**kw)
    dm = autopar_compile(model, Mesh(**axes), example_inputs=(x,), plan=plan)
    del model
    if hold_reduced:        # free_reduced off: every full-size bucket kept until backward ends
        dm.sync.free_reduced = False
    opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
    lx, lt = dm.shard_batch((x,)), dm.shard_batch(t)

    def body():
        if plan.pp_schedule:
            dm.train_step(lx, lt, lm_loss)
        else:
            loss = lm_loss(dm(*lx), lt)
            loss.backward()
            del loss
        opt.step()
    return body, dm, opt


def peak_of(body, opt, dm=None, steps: int = STEPS) -> dict:
    """The step's peak: the steady census after zero_grad plus the median of ``steps`` profiled
    steps. The profiler does not see frees of blocks allocated before it started, so what a
    step frees of the last one's (its dropout masks, dropped at the next draw) is dropped
    before the census."""
    masks = [m for m in dm.modules() if isinstance(m, RandomMasks)] if dm is not None else []
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        body()
    def between():      # what separates two steps; the census is taken at this point
        opt.zero_grad(set_to_none=True)
        for m in masks:
            m.masks = {}

    between()
    gc.collect()
    base = steady_live_bytes(3)
    peaks = []
    with collectives_settled():    # frees of collectives' buffers seen (else some steps read higher)
        for _ in range(steps):   # the step measured after another in the same window (see profiled_peak_bytes)
            peaks.append(base + profiled_peak_bytes(body, before=lambda: (body(), between())))
            between()
    dist.barrier()
    return {"peak": sorted(peaks)[len(peaks) // 2], "peaks": peaks, "base": base}


@contextlib.contextmanager
def collectives_settled(pause: float = 1e-3):
    """Every collective's buffers freed on this thread, where the profiler sees the free.
    ``profiled_peak_bytes`` sees this thread's allocator events only, and gloo's worker thread
    holds a collective's buffers (among them its copy of a reduce-scatter's input) until a
    moment after the wait returns: a buffer whose last reference it drops is never seen freed,
    and the step's measured peak keeps it, in some steps and not in others. Here this thread
    holds each collective's handle through the wait and ``pause`` seconds more (a synchronous
    one, ``AxisComm``'s ``start(False)``, is issued asynchronously and waited on), so that gloo
    lets go first and dropping the handle here frees the buffers."""
    launch, wait = flight.launch, flight.Watched.wait

    def settled_launch(group, kind, label, nbytes, start, *args, peer=None):
        if not (len(args) == 1 and args[0] is False):     # p2p and asynchronous ones as issued
            return launch(group, kind, label, nbytes, start, *args, peer=peer)
        launch(group, kind, label, nbytes, start, True, peer=peer).wait()
        return None

    def settled_wait(self, *args):
        done = wait(self, *args)
        time.sleep(pause)
        return done

    flight.launch, flight.Watched.wait = settled_launch, settled_wait
    try:
        yield
    finally:
        flight.launch, flight.Watched.wait = launch, wait


def timed_rounds(steps_by_name: dict, steps: int, block: int = BLOCK) -> dict:
    """``autopar.tuning.timed_rounds`` in whole rounds: at least ``steps`` timed steps each, the
    count rounded up to full blocks."""
    per_block = max(1, block - 1)
    return tuning.timed_rounds(steps_by_name, -(-steps // per_block) * per_block, block)


def timed_alone(step, steps: int, warmup: int = 3) -> list:
    """Seconds of each of ``steps`` consecutive steps of one plan, each after a barrier, after
    ``warmup`` untimed ones: the plan alone in its processes, as a training loop runs it (one
    round of ``autopar.tuning.timed_rounds`` whose block is all the steps, its first untimed)."""
    for _ in range(warmup - 1):
        step()
    return tuning.timed_rounds({"plan": step}, steps, block=steps + 1)["plan"]
