"""tune: the planner's best candidates measured on this cluster, and the fastest one chosen.

The cost model ranks plans by prediction; where its best candidates are closer to each other
than its error on the machine at hand (BENCHMARKS.md: about 11% per row on the local CPU
preset, where ranks share cores), only a measurement tells them apart. Run on every rank of a
process group (torchrun, or ``autopar.testing.run``), ``autopar.tune`` compiles each candidate
on a copy of the model, warms each up, then steps them in rounds (a disturbance of the machine
then falls on all of them alike): each round runs every candidate for ``block`` consecutive
training steps, each after a barrier, and times all but the first (``timed_rounds``: the step
right after another candidate's starts with that candidate's model in the caches; a training
loop's steps do not). It takes each candidate's median timed step of its slowest rank (the all-reduced maximum, so
every rank sees the same numbers and chooses the same plan)::

    report = autopar.plan(model, dist.get_world_size(), example_inputs=(x,))
    tuned = autopar.tune(model, report, example_inputs=(x,), targets=y, loss_fn=loss_fn)
    print(tuned.explain())
    dm = autopar.compile(model, autopar.Mesh(**tuned.chosen.axes), example_inputs=(x,), plan=tuned.chosen.plan)

A step is what a training loop runs: zero_grad, forward and backward (a pipeline's
``train_step``), and the optimizer's step. The candidates are compiled and stepped at once
(each holds its own copy of the model and optimizer state until ``tune`` returns), so the
candidates must fit in memory together; ``top`` bounds how many of a report's are measured.
"""
from __future__ import annotations

import copy
import math
import statistics
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .api import compile as compile_
from .cost.planner import PlanReport
from .mesh import Mesh, process_device
from .planspec import Plan
from .runtime.module import model_loss
from .runtime.timing import now

__all__ = ["tune", "TuneReport", "TuneRow", "timed_rounds"]


def _mesh_text(axes: dict) -> str:
    return "Mesh(" + ", ".join(f"{k}={v}" for k, v in axes.items()) + ")"


@dataclass
class TuneRow:
    """One measured candidate: its mesh axes and plan, the cost model's prediction (None when
    the candidate came without one) and the measured step (the median of the slowest rank's
    timed steps, and every timed step's, in the order run)."""
    axes: dict
    plan: Plan
    predicted_s: Optional[float]
    measured_s: float
    rounds_s: list = field(default_factory=list)

    @property
    def mesh_text(self) -> str:
        return _mesh_text(self.axes)


@dataclass
class TuneReport:
    """``rows`` in the order measured (a report's: the planner's order); ``chosen``: the row of
    the fastest measured step."""
    rows: list
    chosen: TuneRow
    steps: int
    warmup: int
    block: int = 1

    def explain(self) -> str:
        rounds = (f"in rounds of {self.block} consecutive steps each, the first untimed" if self.block > 1
                  else "one step each in turn")
        head = (f"tune: {len(self.rows)} candidates, each {self.warmup} warm-up and {self.steps} timed steps, {rounds}; "
                "the median of the slowest rank's step")
        lines = [head, f"{'#':>2}  {'mesh':24s} {'plan':66s} {'predicted ms':>12s} {'measured ms':>11s} "
                       f"{'/ fastest':>9s}"]
        for i, r in enumerate(self.rows):
            pred = f"{r.predicted_s * 1e3:12.2f}" if r.predicted_s is not None else f"{'-':>12s}"
            mark = "  <- chosen" if r is self.chosen else ""
            lines.append(f"{i + 1:>2}  {r.mesh_text:24s} {str(r.plan)[:66]:66s} {pred} {r.measured_s * 1e3:11.2f} "
                         f"{r.measured_s / self.chosen.measured_s:9.3f}{mark}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()


def _candidates(candidates, top: int) -> list:
    """(axes, plan, predicted seconds or None) of a PlanReport's fitting candidates (its first
    ``top``) or of a list of (axes, plan) pairs."""
    if isinstance(candidates, PlanReport):
        fit = [c for c in candidates.candidates if c.fits]
        return [(dict(c.axes), c.plan, c.step_time_s) for c in fit[:top]]
    out = []
    for i, item in enumerate(candidates):
        try:
            axes, plan = item
        except (TypeError, ValueError):
            shown = item if isinstance(item, Plan) else repr(item)
            raise TypeError(f"tune: candidate {i} is {shown}; expected a pair (mesh axes, Plan), e.g. "
                            "({'dp': 4}, autopar.Plan(dp='ddp')), or pass the PlanReport of autopar.plan") from None
        axes = dict(getattr(axes, "axes", axes))
        if not isinstance(plan, Plan):
            raise TypeError(f"tune: candidate {i}'s plan is {type(plan).__name__}; expected an autopar.Plan")
        out.append((axes, plan, None))
    return out


def _check(cands: list, world: int) -> None:
    if not cands:
        raise ValueError("tune: no candidate to measure (a PlanReport with no candidate that fits, or an empty "
                         "list): pass at least one (mesh axes, Plan)")
    for axes, plan, _ in cands:
        size = math.prod(axes.values())
        if size != world:
            raise ValueError(f"tune: candidate {_mesh_text(axes)} with {plan} has {size} ranks, but this process group has "
                             f"{world}: measure plans of the world they run on (autopar.plan(model, {world}, ...))")


def _stepper(dm, plan: Plan, opt, inputs: tuple, kwargs: dict, targets, loss_fn):
    """One training step of ``dm``: zero_grad, forward and backward (a pipeline's
    train_step), the optimizer's step."""
    if plan.pp_schedule:
        def step():
            opt.zero_grad(set_to_none=True)
            dm.train_step(inputs, targets, loss_fn, kwargs=kwargs or None)
            opt.step()
        return step

    def step():
        opt.zero_grad(set_to_none=True)
        out = dm(*inputs, **kwargs)
        loss = loss_fn(out, targets) if loss_fn is not None else model_loss(out)
        loss.backward()
        opt.step()
    return step


def timed_rounds(steps_by_name: dict, steps: int, block: int = 4, device=None) -> dict:
    """{name: seconds of each of its ``steps`` timed steps, in the order run} of the step
    functions in ``steps_by_name`` (every rank calls it alike), timed in rounds so that a
    disturbance of the machine falls on all of them alike: each round runs every one for
    ``block`` consecutive steps, each after a barrier, and times all but the first (the last
    round's blocks shorter where ``steps`` ends); ``block=1``: one step each in turn, all timed.
    ``device``: where the steps run (a dict: name -> device); each timing waits for its work
    there (``autopar.runtime.timing.now``: on CUDA a step's kernels, not only their launches).

    Why blocks: a training loop runs one plan step after step. A step right after another
    model's starts with that model's parameters, optimizer state and activations in the caches
    instead of its own. Measured on 2 processes (gpt h96 L2 s16, the 9 plans of the hold-out
    grid at world 2, three interleaved repeats; benchmarks/bench_holdout.py, BENCHMARKS.md,
    section bench_holdout.py):
    ddp took 8.1 ms a step one step each in turn, 7.2 ms in blocks of 4 and 6.7 ms alone;
    ZeRO-1 11.6 and 8.9 ms, ZeRO-2 10.1 and 8.1 ms."""
    times = {name: [] for name in steps_by_name}
    per_block = max(1, block - 1)          # timed steps a block
    for first in range(0, steps, per_block):
        timed = min(per_block, steps - first)
        for name, step in steps_by_name.items():
            where = device.get(name) if isinstance(device, dict) else device
            for i in range(timed + (block > 1)):
                dist.barrier()
                t0 = now(where)
                step()
                if i or block <= 1:        # a block's first step follows another model's: not timed
                    times[name].append(now(where) - t0)
    return times


def tune(model: nn.Module, candidates, *, example_inputs, example_kwargs=None, targets=None, loss_fn=None,
         optimizer=torch.optim.AdamW, optimizer_kwargs: Optional[dict] = None, steps: int = 7, warmup: int = 2,
         top: int = 3, block: int = 4) -> TuneReport:
    """Measure ``candidates`` (the ``PlanReport`` of ``autopar.plan``: its first ``top`` that
    fit; or a list of (mesh axes, Plan)) on this process group and choose the fastest. Every
    rank calls it alike. ``example_inputs`` / ``example_kwargs`` / ``targets`` are one global
    batch (each candidate's ranks step their data-parallel slice), the loss
    ``loss_fn(output, targets)`` or, without ``loss_fn``, the model's own (``output.loss``).
    ``optimizer`` (a class, with ``optimizer_kwargs``) is what each candidate steps, through
    ``DistributedModule.optimizer``. ``model`` is left as it is: each candidate compiles a copy.
    ``steps`` timed steps of each candidate, in rounds of ``block`` consecutive steps of one
    candidate, the first of each untimed (``block=1``: one step each in turn, all timed)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("tune measures the candidates on the ranks that will run them and found no process "
                           "group: call it on every rank after torch.distributed.init_process_group (torchrun), "
                           "or through autopar.testing.run")
    if steps < 1 or warmup < 0 or block < 1:
        raise ValueError(f"tune(steps={steps}, warmup={warmup}, block={block}): expected at least one timed step, no "
                         "negative warm-up and blocks of at least one step")
    cands = _candidates(candidates, top)
    _check(cands, dist.get_world_size())
    args, kwargs = tuple(example_inputs), dict(example_kwargs or {})
    runners = []
    for axes, plan, predicted in cands:
        error = None
        try:
            dm = compile_(copy.deepcopy(model), Mesh(**axes), example_inputs=args, example_kwargs=kwargs or None,
                          plan=plan)
        except Exception as e:     # every rank learns of it, or the others would wait for this one
            error = e
        failed = torch.tensor([error is not None], dtype=torch.int32, device=process_device())
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item():
            why = f"{type(error).__name__}: {error}" if error is not None else "it failed on another rank"
            raise RuntimeError(f"tune: candidate {_mesh_text(axes)} with {plan} did not compile ({why}); leave it out of "
                               "the candidates") from error
        opt = dm.optimizer(optimizer, **(optimizer_kwargs or {}))
        local_args, local_kwargs = dm.shard_batch(args), dm.shard_batch(kwargs)
        local_targets = dm.shard_batch(targets) if targets is not None else None
        runners.append((axes, plan, predicted, _stepper(dm, plan, opt, local_args, local_kwargs, local_targets,
                                                        loss_fn), dm.device))
    for *_, step, _ in runners:
        for _ in range(warmup):
            step()
    measured = timed_rounds({j: step for j, (*_, step, _) in enumerate(runners)}, steps, block,
                            {j: device for j, (*_, device) in enumerate(runners)})
    times = torch.tensor([measured[j] for j in range(len(runners))], dtype=torch.float64, device=process_device())
    dist.all_reduce(times, op=dist.ReduceOp.MAX)      # each timed step's slowest rank, the same on every rank
    rows = [TuneRow(axes, plan, predicted, statistics.median(times[j].tolist()), times[j].tolist())
            for j, (axes, plan, predicted, *_) in enumerate(runners)]
    return TuneReport(rows=rows, chosen=min(rows, key=lambda r: r.measured_s), steps=steps, warmup=warmup,
                      block=block)
