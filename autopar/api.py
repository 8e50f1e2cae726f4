"""autopar.compile: capture, annotate layouts, insert collectives, emit.

It reads as the ordered list of passes; each pass is ``(GraphModule, CompileContext) ->
GraphModule`` and its result is snapshotted for ``dm.dump()``.
"""
from __future__ import annotations

import gc
import logging
from typing import Union

import torch
from torch import nn
from torch.utils import _pytree as pytree

from . import passes
from .capture import capture
from .context import CompileContext
from .explain import graph_text
from .mesh import Mesh
from .plan import Plan
from .runtime import DistributedModule, emit, slice_batch

log = logging.getLogger("autopar")

__all__ = ["compile"]


def _resolve_plan(plan: Union[Plan, str], mesh: Mesh) -> tuple[Plan, str]:
    if isinstance(plan, Plan):
        return plan, "given by the user"
    if plan == "auto":
        picked = Plan(dp="zero3")
        reason = (f"plan='auto' picked {picked}: until the planner lands, auto shards parameters, "
                  f"gradients and optimizer state over dp={mesh.axis_size('dp')} (ZeRO-3)")
        if mesh.rank == 0:
            log.warning("autopar: %s", reason)
        return picked, reason
    raise ValueError(f"plan={plan!r} is not a plan: pass plan='auto' or an autopar.Plan(...), "
                     "e.g. Plan(dp='zero2')")


def _check_axes(plan: Plan, mesh: Mesh) -> None:
    used = plan.axes_used()
    for axis in used:
        if axis != "dp" and axis not in mesh.axes:
            raise ValueError(f"{plan} uses mesh axis {axis!r}, but {mesh} has none; add it to the mesh "
                             f"(e.g. Mesh(dp=..., {axis}=2)) or drop it from the plan")
    for axis, size in mesh.axes.items():
        if axis not in used and size > 1:
            raise ValueError(f"{mesh} has axis {axis}={size}, which {plan} gives no role; "
                             f"set the plan's {axis} field or make the axis size 1")
    if plan.pp_schedule is not None:
        raise NotImplementedError(f"{plan}: pipeline parallelism is not built yet; use data and "
                                  "tensor parallelism (Plan(dp=..., tp=True, sp=...))")


def compile(model: nn.Module, mesh: Mesh, *, example_inputs, example_kwargs=None,
            plan: Union[Plan, str] = "auto") -> DistributedModule:
    """Compile ``model`` for ``mesh``. ``example_inputs`` (and ``example_kwargs``) are one
    global batch: the graph is captured at its shapes (the logical program), and this rank's
    module runs on its data-parallel slice."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be an autopar.Mesh, got {type(mesh).__name__}")
    plan, reason = _resolve_plan(plan, mesh)
    _check_axes(plan, mesh)
    ctx = CompileContext(mesh=mesh, plan=plan)
    ctx.notes.append(f"plan: {reason}")
    n, i = mesh.axis_size("dp"), mesh.coordinate("dp")
    args, kwargs = tuple(example_inputs), dict(example_kwargs or {})
    local = pytree.tree_map(lambda t: slice_batch(t, n, i) if isinstance(t, torch.Tensor) else t, (args, kwargs))

    gm = capture(model, args, kwargs, ctx)         # the logical graph, at global shapes
    # this rank's forward takes its slice of the batch: the shapes its inputs are checked against
    ctx.input_shapes = tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None
                             for x in pytree.tree_leaves(local))
    ctx.snapshots.append(("capture", graph_text(gm)))
    # layouts first: collectives and localize read them; localize on the final graph, then the
    # sequence-parallel regions become one node each (they hold localized ops)
    for p in (passes.shard, passes.collectives, passes.localize, passes.sequence_parallel):
        if p is passes.sequence_parallel and not plan.sp:
            continue
        gm = p(gm, ctx)
        ctx.snapshots.append((p.__name__, graph_text(gm)))
    dm = emit(gm, model, ctx)
    ctx.snapshots.append(("emit", dm.module.code))
    del gm
    gc.collect()   # export leaves reference cycles that hold the original weights
    return dm
