"""New input shapes at run time: a compiled module called with a batch or sequence length it
was not compiled for compiles that shape once, with the same plan, and runs it on its own
parameters, gradient buckets and optimizer state, as DDP and FSDP take any shape.

autopar's program is specialised to its shapes (the layouts, the local sizes of every view,
the bytes of every collective are worked out from them), so a new shape is a new program:
``ShapeVariants`` keeps a copy of the model on the meta device (no memory for its weights),
exports it on the new global batch, runs the plan's passes, checks that the new program
holds the parameters exactly as the module does (the same layouts, the same shards, the same
gradient buckets and gather units; an error names what differs otherwise), and binds its
graph to the module's own tensors. The first call of a shape is slower (one compile); later
calls find it in the module's cache.

Every rank of the mesh must call the module with the same local shapes (the global batch
divides by dp): before compiling, the ranks compare the shapes they were called with, and a
rank whose shape differs gets an error naming both, on every rank, not a hang. A pipeline
compiles a new micro-batch shape alike, its stages cut where the compiled shape's were
(``CompileContext.stage_starts``) and each bound to the stage module's tensors (``bind_stage``).
"""
from __future__ import annotations

import copy
import logging

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.utils import _pytree as pytree

from .context import CompileContext
from .meta import COMM_TP, REPLICAS, RNG, SYNC
from .runtime.module import DistributedModule, attr_path
from .runtime.rng import RandomMasks

log = logging.getLogger("autopar")

__all__ = ["ShapeVariants", "bind_program", "bind_stage", "meta_copy", "MANY_SHAPES"]

MANY_SHAPES = 8
"""shapes compiled for one module past which the warning each new shape logs also advises
padding: a compile per shape suits a last smaller batch or a few sequence lengths (pad to a
few buckets), not a new length every step"""


def meta_copy(model: nn.Module) -> nn.Module | None:
    """``model`` with its parameters and buffers on the meta device (the rest of it copied):
    what a later export of another shape reads; None if the model does not copy."""
    if not isinstance(model, nn.Module):
        return None
    memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in model.parameters()}
    memo.update({id(b): torch.empty_like(b, device="meta") for b in model.buffers()})
    try:
        return copy.deepcopy(model, memo)
    except Exception as exc:      # a model that does not copy keeps its first shape only
        log.debug("autopar: no meta copy of %s for new shapes (%s: %s)", type(model).__name__,
                  type(exc).__name__, exc)
        return None


def _meta_rows(x, dp: int):
    """``x`` (a tensor of this rank's slice) as the global batch's tensor on the meta device."""
    if not isinstance(x, torch.Tensor):
        return x
    shape = (x.shape[0] * dp,) + tuple(x.shape[1:]) if x.dim() else ()
    return torch.empty(shape, dtype=x.dtype, device="meta")


def _device_of(module: nn.Module) -> torch.device:
    for t in list(module.parameters()) + list(module.buffers()):
        return t.device
    return torch.device("cpu")


def _off_meta(gm: fx.GraphModule, device: torch.device) -> None:
    """The meta copy's device, which ops that read a parameter's or buffer's ``.device`` (a
    rotary table's ``arange(..., device=inv_freq.device)``) recorded as a constant argument,
    becomes the module's own."""
    def real(a):
        if isinstance(a, torch.device) and a.type == "meta":
            return device
        if isinstance(a, (list, tuple)):
            return type(a)(real(x) for x in a)
        return a

    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.args = real(node.args)
            node.kwargs = {k: real(v) for k, v in node.kwargs.items()}
    gm.recompile()


class ShapeVariants:
    """The programs of a compiled module for input shapes other than the compiled one, made on
    demand by ``build`` (the compile driver's, handed in by ``compile``): ``build(source, ctx,
    args, kwargs, dm)`` captures ``source`` on the global batch ``(args, kwargs)`` into ``ctx``
    and returns ``dm``'s program for it (``bind_program`` of the rank's graph; a pipeline, its
    stages bound stage by stage)."""

    def __init__(self, source: nn.Module | None, build):
        self.source = source        # the model on the meta device (None: no new shapes)
        self.build = build

    def __call__(self, dm, args: tuple, kwargs: dict, shapes: tuple):
        """``dm``'s program for local inputs of ``shapes`` (``args``/``kwargs`` are one such call:
        this rank's data-parallel slice)."""
        ctx = dm.ctx
        if self.source is None:
            raise ValueError(f"input shapes {shapes}: the module was compiled for {ctx.input_shapes} and its model "
                             "could not be copied to compile another shape; compile again with example inputs of "
                             "this shape")
        _agree(ctx, shapes)
        count = len(dm.programs) + 1
        log.warning("autopar: compiling this module for this rank's input shapes %s (compiled for %s; shape %d "
                    "of its cache): the first call of a new shape compiles, later ones reuse it. Each rank takes "
                    "its slice of the batch: pass dm.shard_batch(global_batch)%s", shapes,
                    tuple(ctx.input_shapes), count,
                    "; many shapes: pad the batch to a few lengths" if count > MANY_SHAPES else "")
        dp = ctx.mesh.axis_size("dp")
        # the global batch on the meta device, as the model is: export reads shapes only (a
        # device an op records from them is put back by _off_meta)
        gargs, gkwargs = pytree.tree_map(lambda x: _meta_rows(x, dp), (tuple(args), dict(kwargs)))
        new = CompileContext(mesh=ctx.mesh, plan=ctx.plan)
        new.model_class, new.model_config = ctx.model_class, ctx.model_config
        new.head_policy, new.device_type = ctx.head_policy, ctx.device_type
        new.mode_difference = ctx.mode_difference
        with torch.enable_grad():      # the training program, as compile captured it, whatever the caller's mode
            return self.build(self.source, new, gargs, gkwargs, dm)


def bind_program(gm: fx.GraphModule, dm, ctx: CompileContext, sites: tuple = ()) -> fx.GraphModule:
    """The rewritten graph ``gm`` of a new shape (its context ``ctx``) as ``dm``'s program: the
    parameters laid out as ``dm`` holds them (else an error naming what differs), the meta
    copy's device replaced by ``dm``'s, bound to ``dm``'s own tensors and communicators.
    ``sites``: every random site of the model, when ``gm`` is a pipeline stage (as ``emit``)."""
    _same_state(dm.ctx, ctx, tuple(ctx.input_shapes))
    _off_meta(gm, _device_of(dm.module))
    return _bind(gm, dm, ctx, sites)


def bind_stage(gm: fx.GraphModule, dm, ctx: CompileContext, sites: tuple) -> DistributedModule:
    """A pipeline stage's graph ``gm`` at a new shape as a stage module over the stage ``dm``'s
    tensors, gradient sync and tp communicator (``bind_program``)."""
    return DistributedModule(bind_program(gm, dm, ctx, sites), ctx, dm.sync, dm.comm_stats, dm.tp_comm)


def _agree(ctx: CompileContext, shapes: tuple) -> None:
    """Every rank of the mesh was called with ``shapes``, or an error on every rank."""
    if ctx.mesh.virtual or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, shapes)
    odd = [r for r, s in enumerate(every) if s != every[0]]
    if odd:
        raise ValueError(
            f"the ranks were called with different input shapes (rank 0: {every[0]}, rank {odd[0]}: "
            f"{every[odd[0]]}); every rank must run the same shapes, so the global batch must divide by "
            f"dp={ctx.mesh.axis_size('dp')} (drop or pad the last batch: DataLoader(drop_last=True))")


def _same_state(old: CompileContext, new: CompileContext, shapes: tuple) -> None:
    """The new shape's program holds the parameters as the module does, or an error naming
    what it would change."""
    checks = (("parameters", set(old.params), set(new.params)),
              ("dp shards", old.shard_specs(), new.shard_specs()),
              ("tp layouts", {k: str(v) for k, v in old.tp_params.items()},
               {k: str(v) for k, v in new.tp_params.items()}),
              ("gradient buckets", [tuple(b) for b in old.grad_buckets], [tuple(b) for b in new.grad_buckets]),
              ("ZeRO-3 gather units", [tuple(u) for u in old.gather_units], [tuple(u) for u in new.gather_units]))
    for what, a, b in checks:
        if a != b:
            diff = _first_difference(a, b)
            raise ValueError(f"input shapes {shapes}: the plan lays out the {what} differently at this shape than at "
                             f"the compiled {old.input_shapes} ({diff}), so the module's parameters and optimizer "
                             "state cannot run it; compile a module for this shape and move the weights with "
                             "dm.load_full_state_dict(other.full_state_dict())")


def _first_difference(a, b) -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return f"{k}: {a.get(k)} against {b.get(k)}"
    if isinstance(a, set):
        return f"only in one: {sorted(a ^ b)[:3]}"
    return f"{a} against {b}"


def _bind(gm: fx.GraphModule, dm, ctx: CompileContext, sites: tuple = ()) -> fx.GraphModule:
    """``gm``'s graph over ``dm``'s own parameters, buffers, replicas and communicators (the
    random sites and fused regions are the new program's own)."""
    own = dm.module
    root: dict = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            target = node.target
            if target in (SYNC, COMM_TP) or target in ctx.params or target.startswith(REPLICAS + "."):
                root[target] = attr_path(own, target) if target not in (SYNC, COMM_TP) else getattr(own, target)
            elif target != RNG:
                root[target] = _constant(gm, own, target)
        elif node.op == "call_module":
            root[node.target] = gm.get_submodule(node.target)
    if ctx.rng_local:
        masks = RandomMasks(sites or ctx.rng_sites, ctx.rng_local, external=bool(sites), mode=ctx.plan.dropout_rng,
                            mesh=ctx.mesh)
        masks.replayed = set(ctx.rng_replayed) & set(ctx.rng_local)
        root[RNG] = masks
    return fx.GraphModule(root, gm.graph, class_name="AutoparRankShape")


def _constant(gm: fx.GraphModule, own: nn.Module, target: str) -> torch.Tensor:
    """A constant of the new program (a tensor the forward makes, or a plain tensor attribute):
    its own value, or, where the meta copy of the model left it without data, the compiled
    program's value of the same name and shape."""
    value = attr_path(gm, target)
    if not isinstance(value, torch.Tensor) or value.device.type != "meta":
        return value
    try:
        kept = attr_path(own, target)
    except AttributeError:
        kept = None
    if isinstance(kept, torch.Tensor) and kept.shape == value.shape and kept.dtype == value.dtype:
        return kept
    raise ValueError(f"the program for a new input shape needs the constant {target} "
                     f"({tuple(value.shape)}), which the compiled program does not hold at that shape; compile "
                     "again with example inputs of this shape")
