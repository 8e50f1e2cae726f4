"""emit and run: the DistributedModule.

``emit`` turns the rewritten graph into this rank's module: its parameters are this rank's
shards (ddp: full copies), ZeRO-1/2 replicas are non-persistent buffers, and the
``DataParallelSync`` of the dp axis serves the graph's collective nodes. Nothing of the
original model is kept: every tensor is copied (ZeRO-3 copies only this rank's rows).
"""
from __future__ import annotations

import math
import operator
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.utils import _pytree as pytree

from . import meta
from .comm import AxisComm, CommStats, ShardSpec
from .context import CompileContext
from .dpsync import DataParallelSync
from .tpcomm import SavedRegather

__all__ = ["DistributedModule", "emit", "collective_sequences", "check_collective_order"]


def _attr(obj, dotted: str):
    """``obj.a.b.c`` for ``"a.b.c"``: parameters and buffers under their qualified names."""
    return operator.attrgetter(dotted)(obj)


def emit(gm: fx.GraphModule, model: nn.Module, ctx: CompileContext,
         stats: CommStats | None = None) -> "DistributedModule":
    from autopar.passes.collectives import COMM_TP, REPLICAS, SYNC, shard_specs
    mode = ctx.plan.dp
    specs = shard_specs(ctx)
    stats = stats if stats is not None else CommStats()   # pipeline stages share one counter
    comm = _axis_comm(ctx, "dp", stats)
    tp_comm = _axis_comm(ctx, "tp", stats) if ctx.plan.tp else None
    if ctx.plan.sp:   # column inputs are saved as sequence shards, gathered again in backward
        tp_comm.regather = SavedRegather()
    root: dict[str, Any] = {}
    shards: dict[str, nn.Parameter] = {}
    replicas: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, info in ctx.params.items():
            full = _attr(model, name).detach()
            if name in ctx.tp_params:                   # this rank's slice along tp (a copy if interleaved)
                full = ctx.tp_params[name].local_of(full, tp_comm.size, tp_comm.index)
            if name not in specs:                       # buffers and frozen parameters: copied
                root[name] = full.clone() if info.is_buffer else nn.Parameter(full.clone(), requires_grad=False)
                continue
            if mode == "zero3":
                shard = nn.Parameter(specs[name].local_of(full).clone())
            elif mode == "ddp":
                shard = nn.Parameter(full.clone())
            else:   # the shard is a view of the replica's own rows: updating it updates the replica
                replicas[name] = full.clone()
                shard = nn.Parameter(specs[name].local_of(replicas[name]))
                root[f"{REPLICAS}.{name}"] = replicas[name]
            shards[name] = root[name] = shard
        for node in gm.graph.nodes:    # lifted constants of the captured graph
            if node.op == "get_attr" and node.target not in root and node.target not in (SYNC, COMM_TP) \
                    and not node.target.startswith(REPLICAS + "."):
                root[node.target] = _attr(gm, node.target)
            elif node.op == "call_module":     # fused regions (sequence parallelism)
                root[node.target] = gm.get_submodule(node.target)
    # with overlap, gradient reductions run on a second dp group, so that a bucket's reduction in
    # flight does not hold up the next unit's gather (measured on gloo: a gather issued behind a
    # reduce-scatter on one group waited for it). Every rank creates it (new_group is collective):
    # the condition depends on the plan and mesh only
    reduce_comm = None
    if ctx.plan.overlap and comm.size > 1 and not ctx.mesh.virtual:
        reduce_comm = AxisComm("dp", comm.size, comm.index, ctx.mesh.group("dp", "grads"), stats)
    sync = DataParallelSync(mode, comm, specs, ctx.grad_buckets, shards, replicas, ctx.gather_units,
                            overlap=ctx.plan.overlap, prefetch_bytes=ctx.plan.prefetch_bytes,
                            reduce_comm=reduce_comm)
    root[SYNC] = sync
    if tp_comm is not None:
        root[COMM_TP] = tp_comm
    out = fx.GraphModule(root, gm.graph, class_name="AutoparRank")
    for name, value in root.items():   # GraphModule keeps only what the graph reads: add the rest
        if name not in (SYNC, COMM_TP) and not _has_attr(out, name):
            _set_attr(out, name, value)
    if REPLICAS in dict(out.named_children()):
        for mod in out.get_submodule(REPLICAS).modules():
            for bname, buf in list(mod._buffers.items()):
                mod.register_buffer(bname, buf, persistent=False)
    return DistributedModule(out, ctx, sync, stats, tp_comm)


def _axis_comm(ctx: CompileContext, axis: str, stats: CommStats) -> AxisComm:
    mesh = ctx.mesh
    return AxisComm(axis, mesh.axis_size(axis), mesh.coordinate(axis),
                    mesh.group(axis) if axis in mesh.axes else None, stats)


def _has_attr(mod: nn.Module, dotted: str) -> bool:
    try:
        _attr(mod, dotted)
        return True
    except AttributeError:
        return False


def _set_attr(mod: nn.Module, dotted: str, value: torch.Tensor) -> None:
    """Register ``value`` at ``dotted`` (a parameter, or a buffer), making the submodules."""
    *path, leaf = dotted.split(".")
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if isinstance(value, nn.Parameter):
        mod.register_parameter(leaf, value)
    else:
        mod.register_buffer(leaf, value)


class DistributedModule(nn.Module):
    """This rank's part of the compiled model. ``dm(*local_batch)`` runs it on this rank's
    data-parallel slice; gradients land reduced (and sharded, for ZeRO) after backward."""

    def __init__(self, module: fx.GraphModule, ctx: CompileContext, sync: DataParallelSync,
                 stats: CommStats, tp_comm: AxisComm | None = None):
        super().__init__()
        self.module = module
        self.ctx = ctx
        self.plan = ctx.plan
        self.mesh = ctx.mesh
        self.comm_stats = stats
        self._sync = sync
        self._tp = tp_comm              # the tp axis (None without tensor parallelism)
        self._names = list(sync.specs)  # trainable parameters, canonical names
        self._optimizer = None
        self.timelines: list = []       # per rank, from the last record_timeline()

    # ---- running -----------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        self._check_inputs(args, kwargs)
        with self._sync.forward_scope():
            if self._tp is None or getattr(self._tp, "regather", None) is None:
                return self.module(*args, **kwargs)
            with self._tp.regather.scope():
                return self.module(*args, **kwargs)

    def _check_inputs(self, args, kwargs):
        flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        if spec != self.ctx.in_spec:
            raise TypeError(f"the compiled module was captured with inputs structured as "
                            f"{self.ctx.in_spec}, but was called with {spec}; call it as the "
                            "example inputs were given (same positional args and keyword names)")
        for i, (x, shape) in enumerate(zip(flat, self.ctx.input_shapes)):
            if shape is None:
                if x != self.ctx.constant_inputs.get(i):
                    raise ValueError(f"input {i} is the constant {self.ctx.constant_inputs.get(i)!r} in the "
                                     f"captured graph, got {x!r}; compile again to change it")
            elif not isinstance(x, torch.Tensor) or tuple(x.shape) != shape:
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(
                    f"input {i}: expected this rank's slice of the batch with shape {shape} "
                    f"(dp={self.mesh.axis_size('dp')}), got {got}. Pass dm.shard_batch(global_batch), "
                    "and compile again with example inputs of the global batch to change shapes.")

    def shard_batch(self, batch):
        """This rank's data-parallel slice of ``batch`` (tensors split along dim 0)."""
        n, i = self.mesh.axis_size("dp"), self.mesh.coordinate("dp")
        return pytree.tree_map(lambda t: slice_batch(t, n, i) if isinstance(t, torch.Tensor) else t, batch)

    def optimizer(self, cls, **kwargs) -> torch.optim.Optimizer:
        """An optimizer of class ``cls`` over this rank's shards. For ZeRO-1/2 its state is
        sharded with the parameters and each step ends with the parameter all-gather."""
        opt = cls(self.parameters(), **kwargs)
        if self.plan.dp in ("zero1", "zero2"):
            opt.register_step_post_hook(lambda *_: self._sync.gather_replicas())
        self._optimizer = weakref.ref(opt)   # explain() reports its state
        return opt

    def gather_params(self) -> None:
        """ZeRO-1/2: refresh the full replicas from the shards (dm.optimizer does this)."""
        if self.plan.dp in ("zero1", "zero2"):
            self._sync.gather_replicas()

    # ---- full views (collectives: every rank must call) ---------------------------------
    def _full(self, name: str, local: torch.Tensor | None) -> torch.Tensor | None:
        """The whole tensor from this rank's piece: gathered over dp (ZeRO), then over tp."""
        if local is None:
            return None
        spec: ShardSpec | None = self._sync.specs.get(name)
        if spec is None or spec.n == 1:
            whole = local.detach().clone()
        else:
            out = local.new_empty(spec.n * spec.chunk_numel)
            self._sync.comm.all_gather_flat(out, spec.padded_local(local.detach()), label=f"full {name}",
                                            phase="state")
            whole = spec.unpad(out).clone()
        tp = self.ctx.tp_params.get(name)
        if tp is not None and tp.sharded and self._tp is not None:
            whole = tp.gather(whole, self._tp, self.ctx.params[name].shape)
        return whole

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors keyed by the original model's names (tied names each present)."""
        out = {}
        with torch.no_grad():
            for name, info in self.ctx.params.items():
                local = self.module.get_parameter(name) if name in self._sync.specs else _attr(self.module, name)
                full = self._full(name, local)
                for key in (name,) + info.aliases:
                    out[key] = full
        return out

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """Full, reduced gradients keyed by the original model's parameter names."""
        out = {}
        with torch.no_grad():
            for name in self._names:
                p = self.module.get_parameter(name)
                g = self._full(name, p.grad)
                for key in (name,) + self.ctx.params[name].aliases:
                    out[key] = g
        return out

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Fill this rank's shards (and replicas) from full tensors; works on a meta-built model."""
        with torch.no_grad():
            for name, info in self.ctx.params.items():
                if name not in state:
                    raise KeyError(f"load_full_state_dict: {name!r} missing; expected the keys of "
                                   "the original model's state_dict()")
                full = state[name]
                if tuple(full.shape) != info.shape:
                    raise ValueError(f"load_full_state_dict: {name} has shape {tuple(full.shape)}, "
                                     f"expected {info.shape}")
                if name in self.ctx.tp_params and self._tp is not None:
                    full = self.ctx.tp_params[name].local_of(full, self._tp.size, self._tp.index)
                if name in self._sync.specs:
                    p = self.module.get_parameter(name)
                    spec = self._sync.specs[name]
                    if self.plan.dp in ("zero1", "zero2"):
                        self._sync._replicas[name].copy_(full)
                    else:
                        p.copy_(spec.local_of(full) if spec.n > 1 else full)
                else:
                    _attr(self.module, name).copy_(full)
        self._sync.record_versions()

    def to_empty(self, *, device="cpu") -> "DistributedModule":
        """Allocate (uninitialised) storage for a module captured from a meta-device model;
        follow with ``load_full_state_dict``."""
        from autopar.passes.collectives import REPLICAS
        self.module.to_empty(device=device)
        for name, spec in self._sync.specs.items():
            # leaving the meta device makes new Parameter objects: point the sync at them
            self._sync._params[name] = self.module.get_parameter(name)
            if self.plan.dp in ("zero1", "zero2"):   # the shards are views of the new replicas again
                replica = _attr(self.module, f"{REPLICAS}.{name}")
                self.module.get_parameter(name).data = spec.local_of(replica)
                self._sync._replicas[name] = replica
        self._sync.record_versions()
        return self

    def _buffer(self, name: str) -> torch.Tensor:
        return _attr(self.module, name)

    def _grad_sq_sum(self, skip=lambda name: False) -> torch.Tensor:
        """Sum of squared gradient elements over this module's dp and tp shards (each element
        once), for clipping across pipeline stages; ``skip(name)`` leaves a parameter out."""
        first = self._tp is None or self._tp.index == 0
        total = torch.zeros(())
        for name, p in self.module.named_parameters():
            if p.grad is None or skip(name):
                continue
            if first or self.ctx.tp_params.get(name) is None or self.ctx.tp_params[name].sharded:
                total += p.grad.float().pow(2).sum()
        if self.plan.dp != "ddp" and self.mesh.axis_size("dp") > 1:
            dist.all_reduce(total, group=self._sync.comm.group)
        if self._tp is not None and self._tp.size > 1:
            dist.all_reduce(total, group=self._tp.group)
        return total

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by the true global norm over all shards; returns that norm."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        groups = []
        if self.plan.dp != "ddp" and self.mesh.axis_size("dp") > 1:
            groups.append(self._sync.comm.group)
        if self._tp is not None and self._tp.size > 1:
            groups.append(self._tp.group)
        if norm_type == math.inf:
            local = max((g.abs().max() for g in grads if g.numel()), default=torch.tensor(0.0))
            total = local.clone().float()
            for group in groups:
                dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        else:
            # a tensor replicated along tp is counted once: on the axis's first rank
            first = self._tp is None or self._tp.index == 0
            counted = [p.grad for name, p in self.module.named_parameters() if p.grad is not None
                       and (first or self.ctx.tp_params.get(name) is None or self.ctx.tp_params[name].sharded)]
            total = sum((g.float().pow(norm_type).sum() for g in counted), torch.tensor(0.0))
            for group in groups:
                dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
            total = total.pow(1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total

    # ---- inspection --------------------------------------------------------------------
    def explain(self, cluster=None) -> str:
        """The plan, its collectives and bytes, memory, and (with ``cluster``, or a calibrated
        local preset on disk) the cost model's predicted step, each cost as formula and number."""
        from .explain import explain
        return explain(self, cluster)

    def predict(self, cluster="local", global_batch=None, recompute: str = "none"):
        """The cost model's prediction of one training step of this plan (``autopar.estimate``
        on the graph this module was compiled from): an ``autopar.estimate.Estimate``.
        ``cluster`` is a preset name or a Cluster; ``global_batch`` defaults to the example's."""
        from .estimate import predict_module
        return predict_module(self, cluster, global_batch, recompute)

    def record_timeline(self):
        """``with dm.record_timeline(): <one step>`` records when each collective ran and how
        long each wait blocked, on every rank; afterwards ``dm.timelines`` holds each rank's
        ``autopar.timeline.Timeline`` (``exposed_comm_s``, ``lanes()``) and ``dm.dump`` writes
        them as a Chrome trace beside the cost model's prediction. Every rank must record."""
        from .timeline import record
        return record(self)

    def dump(self, path: str, cluster=None) -> list[str]:
        """Every pass's graph, the emitted code, explain(), and (after ``record_timeline``)
        timeline.json: the measured step of every rank beside the predicted one (``cluster``:
        default the calibrated local preset, if on disk)."""
        from .explain import dump
        return dump(self, path, cluster)


def slice_batch(t: torch.Tensor, n: int, i: int) -> torch.Tensor:
    if t.dim() == 0:
        return t
    if t.shape[0] % n:
        raise ValueError(f"the global batch has {t.shape[0]} rows along dim 0, which does not divide "
                         f"by dp={n}; use a global batch that is a multiple of {n}")
    k = t.shape[0] // n
    return t[i * k:(i + 1) * k]


# ---- every rank issues the same collectives --------------------------------------------------

def collective_sequences(graphs, ctx: CompileContext) -> dict[str, list[str]]:
    """Per mesh axis, the collectives this rank's graphs will issue, in order: the plan, then
    per (graph, its context) every node that communicates (forward, and the backward it
    causes), the ZeRO-3 gather units and the gradient buckets with their members and widths."""
    from autopar.passes.collectives import shard_specs
    seq: dict[str, list[str]] = {axis: [f"plan {ctx.plan} on {ctx.mesh}"] for axis in ctx.mesh.axes}
    for gm, gctx in graphs:
        for node in gm.graph.nodes:
            info = node.meta.get(meta.COMM)
            if info is not None:
                seq.setdefault(info.axis, []).append(f"{node.name}: {info}")
        specs = shard_specs(gctx)
        sharded = gctx.plan.dp != "ddp"
        for kind, groups in (("gather unit", gctx.gather_units), ("gradient bucket", gctx.grad_buckets)):
            for i, names in enumerate(groups):
                width = sum(specs[n].chunk_numel if sharded else specs[n].numel for n in names)
                seq.setdefault("dp", []).append(f"{kind} {i}: {len(names)} tensors, {width} elements/rank "
                                                f"({', '.join(names)})")
    return {axis: s for axis, s in seq.items() if ctx.mesh.axis_size(axis) > 1}


def check_collective_order(graphs, ctx: CompileContext) -> None:
    """Before emit (a compile's first communication, bar plan='auto''s broadcast): every rank's
    sequence of collectives on each dp / tp group must equal its peers' (they run one program,
    but a rank compiled from another model, other example inputs or another plan would
    otherwise wait forever in a collective its peers never issue). ``graphs``: (graph module,
    its context) per graph this rank runs. One all-gather of the sequences over the world; a
    mismatch anywhere is a ValueError on every rank naming the group and the first differing
    collective. (pp ranks run different stages by design: the schedule's sends and receives
    are matched by its simulation.)"""
    mesh = ctx.mesh
    if mesh.virtual or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = ({a: mesh.coordinate(a) for a in mesh.axes}, collective_sequences(graphs, ctx))
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine)
    for axis in ("dp", "tp"):
        if mesh.axis_size(axis) < 2:
            continue
        groups: dict = {}
        for rank, (coords, _) in enumerate(rows):
            groups.setdefault(tuple(sorted((a, c) for a, c in coords.items() if a != axis)), []).append(rank)
        for members in groups.values():
            first = rows[members[0]][1].get(axis, [])
            for other in members[1:]:
                seq = rows[other][1].get(axis, [])
                if seq == first:
                    continue
                i = next((k for k, (x, y) in enumerate(zip(first, seq)) if x != y), min(len(first), len(seq)))
                a = first[i] if i < len(first) else "nothing (its sequence ends here)"
                b = seq[i] if i < len(seq) else "nothing (its sequence ends here)"
                raise ValueError(
                    f"the ranks of {axis} group {members} would issue different collectives: at collective "
                    f"#{i} on {axis}, rank {members[0]} issues {a!r} but rank {other} issues {b!r} (rank "
                    f"{members[0]}: {len(first)} collectives, rank {other}: {len(seq)}). Running would hang "
                    "there. Every rank must compile the same model with the same example inputs and the same plan.")
