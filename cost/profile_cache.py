"""The profiles the estimate and the planner price: ``cost.profile``'s per tensor-parallel
variant and compute dtype, captured once per dtype (``Profiles``), and the device type whose
autocast a mixed-precision plan follows (``autocast_device``)."""
from __future__ import annotations

from typing import Optional

import torch

from autopar.capture import capture
from autopar.context import CompileContext
from autopar.mesh import Mesh
from autopar.passes import stage_bounds
from autopar.passes.autocast import autocast, compute_source
from autopar.planspec import Plan

from .lm_head import head_policy, policy_cluster
from .profile import Profile, expand, profile, repeated_stack, truncated

__all__ = ["Profiles", "autocast_device"]


class Profiles:
    """``cost.profile`` results per (tp size, sp, compute dtype), captured once per dtype and
    re-annotated per variant: the planner's cache. ``flash``: attention as a fused kernel;
    ``dropout_math``: except attention with dropout, which autopar runs in the math form
    (``cost.profile``). A compute dtype (``Plan.param_dtype``) profiles the program compile
    captures under it: the model's copy in that dtype on inputs cast to it, with
    ``torch.autocast``'s casts for the device of ``cluster`` (``autocast_device``).

    A model with a stack of repeated blocks (``cost.profile.repeated_stack``) is captured with
    its first ``PROFILED_BLOCKS`` blocks only and each profile extended to the full depth
    (``expand``: equal to the whole model's profile, tested), so that capturing and profiling
    do not grow with depth; ``blocks_once=False`` captures the whole model."""

    def __init__(self, model, example_inputs, example_kwargs=None, *, flash: bool = True, cluster=None,
                 dropout_math: bool = False, blocks_once: bool = True):
        self.flash, self.dropout_math = flash, dropout_math
        self._cache: dict = {}
        self._args = (tuple(example_inputs), dict(example_kwargs or {}), cluster)
        self._model = model
        self._graphs: dict = {}     # compute dtype (None: the model's own) -> (graph, context) profiled
        self._whole_graphs: dict = {}   # the same of the whole model, captured if a pipeline cut needs it
        self.caveats: dict = {}     # compute dtype -> what its profile approximates (Estimate.caveats)
        self.stack = repeated_stack(model) if blocks_once else None     # (path, blocks) or None
        self._source = model
        if self.stack is not None:
            self._source = truncated(model, self.stack[0])
            try:
                names = [g.name for g in self.get(1, False).layers]
            except Exception:      # the model does not run with fewer blocks: capture it whole
                names = None
            if names != [f"{self.stack[0]}.{i}" for i in range(self.stack[1])]:
                self.stack, self._cache, self._graphs, self._source = None, {}, {}, model
        self._graph(None)

    def _graph(self, dtype) -> tuple:
        """(graph, context) of the profiled model (its first blocks, or whole) at compute ``dtype``."""
        if dtype not in self._graphs:
            self._graphs[dtype] = self._captured(self._source, dtype)
        return self._graphs[dtype]

    def _captured(self, model, dtype=None) -> tuple:
        """(graph, context) of ``model`` captured at the example inputs; with a compute ``dtype``,
        of the program compile captures under ``Plan(param_dtype=dtype)``."""
        inputs, kwargs, cluster = self._args
        ctx = CompileContext(mesh=Mesh(dp=1, virtual=True), plan=Plan(param_dtype=dtype))
        # LM heads laid out as a compile for ``cluster`` would (None: a compile's default, this
        # machine's calibrated preset if there is one, else cost.lm_head.DEFAULT_CLUSTER)
        ctx.head_policy = head_policy(cluster)
        if dtype is None:
            return capture(model, inputs, kwargs, ctx), ctx
        device = autocast_device(cluster)
        if device == "cuda" and not torch.cuda.is_available():    # torch disables CUDA's autocast here
            self.caveats[dtype] = (f"torch.autocast('cuda') is unavailable on this machine: the "
                                   f"{str(dtype).removeprefix('torch.')} program is profiled with the CPU's autocast "
                                   "(matmuls and attention in it, losses in float32), where CUDA's also keeps norms "
                                   "and softmax in float32")
            device = "cpu"
        ctx.device_type = device
        gm = capture(*compute_source(model, inputs, kwargs, dtype), ctx, autocast=(device, dtype))
        return autocast(gm, ctx), ctx

    def get(self, tp: int, sp: bool, vocab_parallel: Optional[bool] = None, dtype=None) -> Profile:
        """The profile at tp size ``tp``, with or without sequence parallelism; LM heads split
        along the vocabulary or kept whole as ``vocab_parallel`` says (``Plan.vocab_parallel``;
        None: as the compile's cost-model policy chooses); of the program in compute ``dtype``
        (``Plan.param_dtype``; None: the model's own dtypes)."""
        key = (tp, sp and tp > 1, vocab_parallel if tp > 1 else None, dtype)
        if key not in self._cache:
            gm, ctx = self._graph(dtype)
            p = profile(gm, ctx, tp=tp, sp=key[1], flash=self.flash, dropout_math=self.dropout_math,
                        vocab_parallel=key[2])
            self._cache[key] = expand(p, *self.stack) if self.stack is not None else p
        return self._cache[key]

    def cut(self, tp: int, sp: bool, vocab_parallel: Optional[bool], plan: Plan, axes: dict,
            global_batch: int) -> Profile:
        """The profile of ``get(tp, sp, vocab_parallel)`` with its groups cut where the pipeline
        pass cuts the model into the plan's ``pp x virtual_stages`` stages (``passes.stage_bounds``
        on the whole captured graph, scaled to a micro-batch of ``global_batch``): a stage that
        ends inside a layer ends inside it here too (``Profile.stage_starts``)."""
        gm, ctx = self._whole(plan.param_dtype)
        rows = self.base.rows
        m = plan.microbatches
        key = ("cut", tp, sp and tp > 1, vocab_parallel if tp > 1 else None, axes.get("pp", 1), axes.get("dp", 1),
               plan.virtual_stages, m, plan.pp_schedule, plan.dp, plan.stage_memory_bytes, global_batch,
               plan.param_dtype)
        if key not in self._cache:
            cctx = CompileContext(mesh=Mesh(**{a: s for a, s in axes.items() if s > 1} or {"dp": 1}, virtual=True),
                                  plan=plan)
            cctx.params, cctx.microbatch_rows = ctx.params, rows
            order, bounds = stage_bounds(gm.graph, cctx, scale=global_batch / m / rows)
            starts = tuple(order[b].name for b in bounds[1:-1])
            self._cache[key] = profile(gm, ctx, tp=tp, sp=key[1], flash=self.flash, dropout_math=self.dropout_math,
                                       vocab_parallel=key[2], stage_starts=starts)
        return self._cache[key]

    def _whole(self, dtype=None):
        """The whole model's captured graph and its context at compute ``dtype`` (captured on
        first use when the profiles were made from a truncated stack)."""
        if self.stack is None:
            return self._graph(dtype)
        if dtype not in self._whole_graphs:
            self._whole_graphs[dtype] = self._captured(self._model, dtype)
        return self._whole_graphs[dtype]

    @property
    def base(self) -> Profile:
        return self.get(1, False)


def autocast_device(cluster) -> str:
    """The device type whose ``torch.autocast`` a mixed-precision plan follows on ``cluster``
    (a Cluster, a preset name, or None: a compile's default, ``lm_head.policy_cluster``): the
    local preset's CPU, a GPU preset's CUDA."""
    return "cpu" if policy_cluster(cluster).name == "local" else "cuda"
