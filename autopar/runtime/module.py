"""DistributedModule: this rank's part of the compiled model, as an ``nn.Module``.

Its ``module`` is the emitted GraphModule (``autopar.runtime.emit``); its parameters are this
rank's shards (ddp: full copies). It runs forward on this rank's data-parallel slice, builds
the optimizer over the shards, and gathers full views (state dict, gradients, the global
gradient norm) with collectives. Inspection (``explain``, ``predict``, ``dump``) needs the
cost model and the printing of the front end, which the runtime does not import: compile
hands the module an ``inspector`` that provides them (``autopar.explain.Inspector``).

``CompiledModule`` is the base it shares with a pipeline (``PipelineModule``): the context,
counters and optimizer bookkeeping of a compiled module, checkpoints, the offloaded optimizer
and inspection.
"""
from __future__ import annotations

import abc
import math
import operator
import weakref
from collections.abc import Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import Protocol

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.utils import _pytree as pytree

from ..context import CompileContext
from ..meta import REPLICAS, RNG
from ..placement import ShardSpec
from ..sizes import batch_split_error, cut_buckets
from . import flight
from .checkpoint import Resumed, load_module, save_module
from .comm import AxisComm, CommStats
from .dpsync import DataParallelSync
from .offload import HostLink, OptimizerOffload
from .optim import PerTensorState, built_here, check_optimizer, guard_shards
from .timeline import record
from .tpcomm import gather_tp_param, pad_rows

__all__ = ["CompiledModule", "DistributedModule", "Inspector", "slice_batch", "attr_path", "model_loss", "has_loss",
           "cast_input", "cast_inputs", "cast_outputs", "refuse_per_tensor_offload", "post_step_errors",
           "describe_call"]


def cast_input(x, dtype):
    """Mixed precision: a floating tensor input in the compute dtype ``dtype`` (as FSDP's
    ``cast_forward_inputs``); anything else as it is."""
    if dtype is not None and isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
        return x.to(dtype)
    return x


def cast_inputs(tree, dtype):
    """``cast_input`` over every leaf of ``tree``."""
    return tree if dtype is None else pytree.tree_map(lambda x: cast_input(x, dtype), tree)


def cast_outputs(tree, plan):
    """Mixed precision: the tensors of a module's output ``tree`` that are in the compute dtype
    (``plan.param_dtype``) cast to ``plan.output_cast_dtype``, differentiably, so that a loss
    computed on them runs in that dtype; other leaves (a loss autocast computed in fp32) as
    they are."""
    compute, dtype = plan.param_dtype, plan.output_cast_dtype
    if dtype is None or dtype == compute:
        return tree
    return pytree.tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.dtype == compute else x, tree)


def attr_path(obj, dotted: str):
    """``obj.a.b.c`` for ``"a.b.c"``: parameters and buffers under their qualified names."""
    return operator.attrgetter(dotted)(obj)


class Inspector(Protocol):
    """What ``explain``, ``predict`` and ``dump`` of a compiled module call (the front end's
    ``autopar.explain.Inspector`` implements it)."""

    def explain(self, dm, cluster) -> str: ...

    def predict(self, dm, cluster, global_batch, recompute): ...

    def dump(self, dm, path: str, cluster) -> list[str]: ...


_DEFAULT = object()    # dm.save / dm.load: the optimizer dm.optimizer built


class CompiledModule(nn.Module, abc.ABC):
    """What every compiled module of this rank is, a single program (``DistributedModule``) or
    a pipeline's stages (``autopar.runtime.pipeline_module.PipelineModule``) alike: its context,
    plan and mesh, the byte counters of its collectives and of the host link, the optimizer
    ``optimizer`` built (and its offload), the inspector compile attaches and the programs for
    other input shapes; and what runs the same on both: ``shard_batch``, checkpoints
    (``save``, ``load``), the offloaded optimizer, and inspection (``explain``, ``predict``,
    ``dump``, ``record_timeline``). A subclass provides ``syncs``, ``stage_modules``,
    ``after_load`` and ``_device``."""

    def __init__(self, ctx: CompileContext, stats: CommStats):
        super().__init__()
        self.ctx = ctx
        self.plan = ctx.plan
        self.mesh = ctx.mesh
        self.comm_stats = stats           # a pipeline's stages share the pipeline's: every byte of this rank
        self._optimizer = None            # a weak reference to the optimizer dm.optimizer built
        self.offload_stats = CommStats()  # Plan(offload="optimizer"): bytes over the host link
        self._offload: OptimizerOffload | None = None
        self._per_tensor: PerTensorState | None = None   # dm.optimizer(..., per_tensor=True)'s full copies
        self.timelines: list = []         # per rank, from the last record_timeline()
        self.inspector: Inspector | None = None   # set by autopar.compile (explain, predict, dump)
        # (dm, args, kwargs, shapes) -> the module's program for other input shapes; set by autopar.compile
        self.variants = None
        self._programs: dict = {}         # local input shapes -> program for them (not the compiled one)

    # ---- what each kind provides -------------------------------------------------------------
    @abc.abstractmethod
    def syncs(self) -> list[DataParallelSync]:
        """The data-parallel reducers of this module (a pipeline: one per stage this rank runs)."""

    @abc.abstractmethod
    def stage_modules(self) -> list["DistributedModule"]:
        """The compiled programs this rank runs, in stage order (a single program: itself)."""

    @abc.abstractmethod
    def after_load(self) -> None:
        """After ``load`` wrote the shards: refresh what derives from them (ZeRO-1/2 replicas,
        ``per_tensor`` full copies) and note their versions."""

    @abc.abstractmethod
    def _device(self) -> torch.device:
        """Where this module's parameters and buffers live."""

    # ---- read-only views -----------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The device this rank's parameters live on: where its inputs go and its work runs."""
        return self._device()

    @property
    def built_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer ``dm.optimizer`` built last (None before one is built, or once it is
        freed: the module holds it weakly)."""
        return self._optimizer() if self._optimizer is not None else None

    @property
    def offload(self) -> OptimizerOffload | None:
        """``Plan(offload="optimizer")``: the host copies the optimizer steps, and the link they
        move over (``autopar.runtime.offload``); None until ``dm.optimizer`` builds them."""
        return self._offload

    @property
    def per_tensor_state(self) -> PerTensorState | None:
        """``dm.optimizer(..., per_tensor=True)``: the full copies of the parameters that the
        optimizer steps (``autopar.runtime.optim.PerTensorState``); None otherwise."""
        return self._per_tensor

    @property
    def programs(self) -> Mapping[tuple, nn.Module]:
        """Local input shapes -> the program compiled for them on first call (``variants``;
        the compiled shapes' own program is not among them). A read-only view."""
        return MappingProxyType(self._programs)

    # ---- data ------------------------------------------------------------------------------------
    def shard_batch(self, batch):
        """This rank's data-parallel slice of ``batch`` (tensors split along dim 0)."""
        n, i = self.mesh.axis_size("dp"), self.mesh.coordinate("dp")
        return pytree.tree_map(lambda t: slice_batch(t, n, i) if isinstance(t, torch.Tensor) else t, batch)

    # ---- the offloaded optimizer -----------------------------------------------------------------
    def _offloaded_optimizer(self, cls, named: dict, **kwargs) -> torch.optim.Optimizer:
        """``cls`` over host copies of the trainable ones of ``named`` (name -> device
        parameter), its step hooked to move gradients down before it and parameters up after
        (``_params_up``, which also refreshes ZeRO-1/2's replicas)."""
        trainable = {name: p for name, p in named.items() if p.requires_grad}
        self._offload = offload = OptimizerOffload(trainable, HostLink(self._device(), self.offload_stats))
        for sync in self.syncs():        # each bucket's gradients go down as soon as they are reduced
            sync.on_landed = offload.early
        opt = cls(offload.parameters(), **kwargs)
        opt.register_step_pre_hook(lambda *_: offload.grads_down())
        opt.register_step_post_hook(lambda *_: self._params_up(offload))
        return opt

    def _params_up(self, offload: OptimizerOffload) -> None:
        """After the offloaded step: the updated parameters up from the host. ZeRO-1/2: a bucket
        at a time, each bucket's replica all-gather issued as soon as its rows are up, so that
        the next bucket's copy runs while it is in flight (``DataParallelSync.gather_replicas``);
        then whatever no bucket holds. ddp, ZeRO-3: all at once (no gather follows)."""
        if self.plan.dp in ("zero1", "zero2"):
            for sync in self.syncs():
                sync.gather_replicas(before_bucket=offload.params_up)
        offload.params_up()

    # ---- checkpoints (collectives: every rank must call) ----------------------------------
    def save(self, path: str, optimizer=_DEFAULT, *, step: int | None = None, extra: dict | None = None) -> None:
        """Write a checkpoint to the directory ``path`` with ``torch.distributed.checkpoint``:
        each rank writes the pieces it owns of every parameter and persistent buffer (under
        the model's names) and of ``optimizer``'s state (default: the one ``dm.optimizer``
        built; None: the model alone), with the step (default: the optimizer's), the RNG state
        and ``extra`` (picklable values, returned by ``load``). It loads under any plan and
        world size (``autopar.runtime.checkpoint``). A checkpoint already at ``path`` is replaced."""
        save_module(self, path, self._optimizer_for(optimizer), step=step, extra=extra)

    def load(self, path: str, optimizer=_DEFAULT) -> Resumed:
        """Read the checkpoint at ``path`` (saved under any plan and world size, or by
        ``autopar.checkpoint.from_torch``) into this rank's pieces and ``optimizer``'s state
        (default: the one ``dm.optimizer`` built; None: the model alone), and restore the RNG
        state. The checkpoint is checked first, on every rank: a problem raises
        ``CheckpointError`` everywhere and changes nothing. Returns the saved step and extra."""
        return load_module(self, path, self._optimizer_for(optimizer))

    def _optimizer_for(self, optimizer):
        if optimizer is _DEFAULT:
            return self.built_optimizer
        return optimizer

    # ---- inspection --------------------------------------------------------------------
    def _inspect(self, what: str) -> Inspector:
        if self.inspector is None:
            raise RuntimeError(f"{what}() needs the cost model and printing of the front end, which "
                               "autopar.compile attaches; this module was built without them (compile it "
                               "with autopar.compile, or set dm.inspector = autopar.explain.Inspector())")
        return self.inspector

    def explain(self, cluster=None) -> str:
        """The plan, its collectives and bytes, memory, and (with ``cluster``, or a calibrated
        local preset on disk) the cost model's predicted step, each cost as formula and number."""
        return self._inspect("explain").explain(self, cluster)

    def predict(self, cluster="local", global_batch=None, recompute=None):
        """The cost model's prediction of one training step of this plan (the estimate of the
        graph this module was compiled from): an ``autopar.cost.estimate.Estimate``.
        ``cluster`` is a preset name or a Cluster; ``global_batch`` defaults to the example's;
        ``recompute`` overrides the plan's (None: the layers compile chose)."""
        return self._inspect("predict").predict(self, cluster, global_batch, recompute)

    def record_timeline(self):
        """``with dm.record_timeline(): <one step>`` records when each collective ran and how
        long each wait blocked, on every rank; afterwards ``dm.timelines`` holds each rank's
        ``autopar.runtime.timeline.MeasuredTimeline`` (``exposed_comm_s``, ``lanes()``) and ``dm.dump``
        writes them as a Chrome trace beside the cost model's prediction. Every rank must record."""
        return record(self)

    def dump(self, path: str, cluster=None) -> list[str]:
        """Every pass's graph, the emitted code, explain(), and (after ``record_timeline``)
        timeline.json: the measured step of every rank beside the predicted one (``cluster``:
        default the calibrated local preset, if on disk)."""
        return self._inspect("dump").dump(self, path, cluster)


class DistributedModule(CompiledModule):
    """This rank's part of the compiled model. ``dm(*local_batch)`` runs it on this rank's
    data-parallel slice; gradients land reduced (and sharded, for ZeRO) after backward."""

    def __init__(self, module: fx.GraphModule, ctx: CompileContext, sync: DataParallelSync,
                 stats: CommStats, tp_comm: AxisComm | None = None):
        super().__init__(ctx, stats)
        self.module = module
        self._sync = sync
        self._tp = tp_comm              # the tp axis (None without tensor parallelism)
        self._names = list(sync.specs)  # trainable parameters, canonical names
        # mixed precision: forward's outputs leave the module cast (cast_outputs); False for a
        # pipeline's stages, whose outputs go on to the next stage (the pipeline casts the last's)
        self.output_boundary = True
        self._guard_shards()

    @property
    def sync(self) -> DataParallelSync:
        """The data-parallel side of this program: its parameters' shard specs, ZeRO-1/2
        replicas, gradient buckets and reducer (``autopar.runtime.dpsync``)."""
        return self._sync

    @property
    def tp_comm(self) -> AxisComm | None:
        """The tp axis's communicator (size, this rank's index, group); None without tensor
        parallelism."""
        return self._tp

    # ---- running -----------------------------------------------------------------------
    @flight.published("forward")
    def forward(self, *args, **kwargs):
        args, kwargs = cast_inputs((args, kwargs), self.plan.param_dtype)
        module = self._program_for(args, kwargs)
        self._check_mode()
        masks = getattr(module, RNG, None)
        if masks is not None:
            masks.before_forward(self._device())
        with self._sync.forward_scope():
            if self._tp is None or getattr(self._tp, "regather", None) is None:
                out = module(*args, **kwargs)
            else:
                with self._tp.regather.scope():
                    out = module(*args, **kwargs)
        return cast_outputs(out, self.plan) if self.output_boundary else out

    def _program_for(self, args, kwargs) -> fx.GraphModule:
        """The program for these inputs: the compiled one at its shapes, else the one for their
        shapes (compiled by ``variants`` on first call and kept: see ``autopar.variants``)."""
        shapes = self._check_inputs(args, kwargs)
        if shapes == tuple(self.ctx.input_shapes):
            return self.module
        if shapes not in self._programs:
            if self.variants is None:
                raise ValueError(f"inputs of shapes {shapes}: expected this rank's slice of the batch with shapes "
                                 f"{tuple(self.ctx.input_shapes)} (dp={self.mesh.axis_size('dp')}). Pass "
                                 "dm.shard_batch(global_batch), or compile again with example inputs of the "
                                 "global batch to change shapes.")
            self._programs[shapes] = self.variants(self, args, kwargs, shapes)
        module = self._programs[shapes]
        if module.training != self.training:    # kept apart from the module tree: its mode follows here
            module.train(self.training)
        return module

    def _check_mode(self):
        """The graph was captured in one train/eval mode; the other runs it too when the two
        differ only in dropout (compile compared them), and is refused otherwise."""
        if self.training == self.ctx.captured_training:
            return
        check = self.ctx.mode_difference
        difference = check() if callable(check) else check
        if difference:
            have, want = ("training", "eval") if self.ctx.captured_training else ("eval", "training")
            raise RuntimeError(
                f"this module was compiled from the model in {have} mode, and the model's forward in {want} "
                f"mode is a different program: {difference}. autopar switches modes only where "
                f"they differ in dropout; compile a second module from model.{want.replace('training', 'train')}() "
                f"for {want}, sharing the weights with dm.load_full_state_dict(...)")

    def _check_inputs(self, args, kwargs) -> tuple:
        """The shapes of the tensor inputs (None for another leaf), after checking what a new
        shape cannot change: the call's structure, its constants and the tensors' dtypes."""
        flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        if spec != self.ctx.in_spec:
            raise TypeError(f"the compiled module was captured with {describe_call(self.ctx.in_spec)}, but was "
                            f"called with {describe_call(spec)}; call it as the example inputs were given (same "
                            "positional args and keyword names)")
        shapes = []
        for i, (x, shape) in enumerate(zip(flat, self.ctx.input_shapes)):
            if shape is None:
                if x != self.ctx.constant_inputs.get(i):
                    raise ValueError(f"input {i} is the constant {self.ctx.constant_inputs.get(i)!r} in the "
                                     f"captured graph, got {x!r}; compile again to change it")
            elif not isinstance(x, torch.Tensor):
                raise ValueError(f"input {i}: expected a tensor (this rank's slice of the batch with shape "
                                 f"{shape}), got {type(x).__name__}; pass dm.shard_batch(global_batch)")
            elif i < len(self.ctx.input_dtypes) and self.ctx.input_dtypes[i] is not None and \
                    x.dtype != self.ctx.input_dtypes[i]:
                raise ValueError(f"input {i}: expected dtype {self.ctx.input_dtypes[i]} (as the example inputs "
                                 f"were), got {x.dtype}; convert it (x.to({self.ctx.input_dtypes[i]})), or compile "
                                 "again with example inputs of that dtype")
            elif x.dim() != len(shape):
                raise ValueError(f"input {i}: expected this rank's slice of the batch with {len(shape)} dims "
                                 f"(shape {shape}), got shape {tuple(x.shape)}; pass dm.shard_batch(global_batch)")
            shapes.append(tuple(x.shape) if shape is not None else None)
        return tuple(shapes)

    def optimizer(self, cls, *, per_tensor: bool = False, **kwargs) -> torch.optim.Optimizer:
        """An optimizer of class ``cls`` over this rank's shards. For ZeRO-1/2 its state is
        sharded with the parameters and each step ends with the parameter all-gather.

        ``cls`` must update elementwise (``autopar.runtime.optim.ELEMENTWISE``: SGD, Adam,
        AdamW, ...) where parameters are sharded (ZeRO over dp > 1, tensor parallelism); any
        other optimizer (LAMB, Adafactor, Muon, L-BFGS, ...) there is refused, unless
        ``per_tensor=True``, which steps full copies of the parameters on every rank (see
        ``autopar.runtime.optim``). The result is an instance of ``cls``: learning-rate
        schedulers of ``torch.optim.lr_scheduler`` work on it.

        ``Plan(offload="optimizer")``: the optimizer steps host copies of this rank's
        parameters (``autopar.runtime.offload``), its state lives on the host, and each step
        moves the gradients down and the parameters up (``dm.offload_stats`` counts the bytes);
        after the step the device holds no gradients."""
        check_optimizer(cls, self.sharded_by, per_tensor, per_tensor_built=self.plan.offload is None)
        if per_tensor and self.plan.offload is not None:
            raise ValueError(refuse_per_tensor_offload(self.plan))
        if self.plan.offload == "optimizer":
            opt = self._offloaded_optimizer(cls, dict(self.named_parameters()), **kwargs)
        elif per_tensor:
            state = PerTensorState(dict(zip(self._names, (self.module.get_parameter(n) for n in self._names))),
                                   self._full, self._local_piece)
            opt = cls(list(state.copies.values()), **kwargs)
            opt.register_step_pre_hook(lambda *_: state.before_step())
            opt.register_step_post_hook(lambda *_: state.after_step())
            self._per_tensor = state
        else:
            opt = cls(self.parameters(), **kwargs)
        if self.plan.dp in ("zero1", "zero2") and self.plan.offload is None:   # offload: in its post-hook
            opt.register_step_post_hook(lambda *_: self._sync.gather_replicas())
        if self.plan.offload is not None:    # after the replica refresh, which bumps the shards' versions
            opt.register_step_post_hook(lambda *_, offload=self._offload: offload.record_versions())
        post_step_errors(opt)
        built_here(opt)
        self._optimizer = weakref.ref(opt)   # explain() reports its state
        return opt

    def syncs(self) -> list[DataParallelSync]:
        """The data-parallel reducers of this module: its own."""
        return [self._sync]

    @property
    def sharded_by(self) -> str:
        """What splits this module's parameters ("" when every rank holds them whole)."""
        why = []
        if self.plan.dp != "ddp" and self.mesh.axis_size("dp") > 1:
            why.append(f"{self.plan.dp} over dp={self.mesh.axis_size('dp')}")
        tp = [n for n, t in self.ctx.tp_params.items() if t.sharded]
        if tp and self._tp is not None and self._tp.size > 1:
            why.append(f"tensor parallelism over tp={self._tp.size}: {len(tp)} parameters split")
        return "; ".join(why)

    def _sharding(self, name: str) -> str:
        """Why this rank holds only a piece of trainable parameter ``name`` ("" when it is whole)."""
        why = []
        spec = self._sync.specs.get(name)
        if self.plan.dp != "ddp" and spec is not None and spec.n > 1:
            why.append(f"{self.plan.dp} over dp={spec.n}")
        tp = self.ctx.tp_params.get(name)
        if tp is not None and tp.sharded and self._tp is not None and self._tp.size > 1:
            why.append(f"split by tensor parallelism over tp={self._tp.size}")
        return " and ".join(why)

    def _guard_shards(self) -> None:
        """An optimizer built on these shards outside ``dm.optimizer`` is checked at its first
        step (``autopar.runtime.optim.guard_shards``); ZeRO-1/2's steps refresh the replicas."""
        own = dict(self.module.named_parameters())     # a program for other shapes may read fewer
        shards = {name: (own[name], why) for name in self._names if name in own and (why := self._sharding(name))}
        guard_shards(shards, self._sync.gather_replicas if self.plan.dp in ("zero1", "zero2") else None)

    def _local_piece(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the full tensor ``full`` of parameter ``name`` (tp, then dp)."""
        if name in self.ctx.tp_params and self._tp is not None:
            full = self.ctx.tp_params[name].local_of(full, self._tp.size, self._tp.index)
        spec = self._sync.specs[name]
        return spec.local_of(full) if spec.n > 1 else full

    @contextmanager
    def no_sync(self):
        """Gradient accumulation, as DDP's ``no_sync``: backward inside the block accumulates
        this rank's gradients locally, unsharded (every ZeRO stage: the full gradients are kept
        until the reduction, as FSDP's no_sync keeps them, trading memory for one reduction),
        and the first backward after the block reduces their sum with its own, once."""
        prev = self._sync.defer
        self._sync.defer = True
        try:
            yield
        finally:
            self._sync.defer = prev

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
            out = local.new_empty(spec.padded_numel)
            self._sync.comm.all_gather_flat(out, spec.padded_local(local.detach()), label=f"full {name}",
                                            phase="state")
            whole = spec.unpad(out).clone()
        tp = self.ctx.tp_params.get(name)
        if tp is not None and tp.sharded and self._tp is not None:
            whole = gather_tp_param(tp, whole, self._tp, self.ctx.params[name].shape)
        return whole

    def full_tensors(self, pieces: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
        """Name -> the whole tensor, from ``pieces`` (name -> this rank's piece of it, gathered
        over dp, then tp), for many names at once, in a few collectives instead of one or two a tensor:
        the ZeRO-sharded pieces are all-gathered over dp in flat buckets (one dtype each, at
        most ``FULL_BUCKET_BYTES`` gathered), then the tp-split ones over tp the same way. Every
        rank of the groups calls it with the same names (a None piece, a parameter without a
        gradient, is None on all of them)."""
        out: dict[str, torch.Tensor | None] = {}
        sharded = []
        for name, local in pieces.items():
            spec: ShardSpec | None = self._sync.specs.get(name) if local is not None else None
            if local is None:
                out[name] = None
            elif spec is None or spec.n == 1:
                out[name] = local.detach().clone()
            else:
                sharded.append((name, spec.padded_local(local.detach()), spec.unpad))
        out.update(_gather_flat(self._sync.comm, sharded, "full"))
        split = []
        for name, whole in out.items():
            tp = self.ctx.tp_params.get(name)
            if whole is not None and tp is not None and tp.sharded and self._tp is not None and self._tp.size > 1:
                shape = self.ctx.params[name].shape
                n, d = self._tp.size, tp.placement.dim
                rows = [tp.local_shape(shape, n, r)[d] for r in range(n)]
                piece = pad_rows(whole.movedim(d, 0), max(rows))    # the split dim first, as the tp gathers move it

                def assemble(flat, tp=tp, d=d, rows=rows, piece_shape=tuple(piece.shape)):
                    blocks = flat.view((n,) + piece_shape)
                    return tp.full_from([blocks[r][:rows[r]].movedim(0, d) for r in range(n)])
                split.append((name, piece, assemble))
        out.update(_gather_flat(self._tp, split, "full parameters"))
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors keyed by the original model's names (tied names each present)."""
        with torch.no_grad():
            full = self.full_tensors({name: (self.module.get_parameter(name) if name in self._sync.specs
                                          else attr_path(self.module, name)) for name in self.ctx.params})
        return {key: full[name] for name, info in self.ctx.params.items() for key in (name,) + info.aliases}

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """Full, reduced gradients keyed by the original model's parameter names."""
        with torch.no_grad():
            full = self.full_tensors({name: self.module.get_parameter(name).grad for name in self._names})
        return {key: full[name] for name in self._names for key in (name,) + self.ctx.params[name].aliases}

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
                        self._sync.replicas[name].copy_(full)
                    if self.plan.dp not in ("zero1", "zero2") or self.plan.mixed:   # else a view of the replica
                        p.copy_(spec.local_of(full) if spec.n > 1 else full)
                else:
                    attr_path(self.module, name).copy_(full)
        self._sync.record_versions()

    # ---- checkpoints (``save``, ``load``: CompiledModule's) ------------------------------------
    def stage_modules(self) -> list["DistributedModule"]:
        """The compiled programs this rank runs: this one."""
        return [self]

    def after_load(self) -> None:
        """After ``load`` wrote the shards: what derives from them is refreshed (ZeRO-1/2
        replicas gathered, ``per_tensor`` full copies), and their versions noted."""
        self.gather_params()
        self._sync.record_versions()
        state = self._per_tensor
        if state is not None:
            with torch.no_grad():
                for name, p in state.params.items():
                    state.copies[name].copy_(self._full(name, p.detach()))

    def to_empty(self, *, device=None) -> "DistributedModule":
        """Allocate (uninitialised) storage for a module captured from a meta-device model, on
        ``device`` (default the mesh's: ``Mesh.device``, this rank's GPU under NCCL); follow
        with ``load_full_state_dict``."""
        self.module.to_empty(device=self.mesh.device if device is None else device)
        self._programs.clear()          # they hold the meta-device tensors: made again on their next call
        for name, spec in self._sync.specs.items():
            # leaving the meta device makes new Parameter objects: point the sync at them
            param, replica = self.module.get_parameter(name), None
            if self.plan.dp in ("zero1", "zero2"):
                replica = attr_path(self.module, f"{REPLICAS}.{name}")
                if not self.plan.mixed:     # the shards are views of the new replicas again
                    param.data = spec.local_of(replica)
            self._sync.rebind(name, param, replica)
        self._sync.record_versions()
        self._guard_shards()
        return self

    def local_tensor(self, name: str) -> torch.Tensor:
        """This rank's tensor of parameter or buffer ``name`` (the model's qualified name) as the
        program holds it: its shard, or the whole tensor where nothing splits it."""
        return attr_path(self.module, name)

    def _norm_groups(self) -> list:
        """The groups a global gradient norm reduces over: dp where gradients are sharded, tp."""
        groups = []
        if self.plan.dp != "ddp" and self.mesh.axis_size("dp") > 1:
            groups.append(self._sync.comm.group)
        if self._tp is not None and self._tp.size > 1:
            groups.append(self._tp.group)
        return groups

    def grad_pow_sum(self, norm_type: float = 2.0, skip=lambda name: False, dtype=None) -> torch.Tensor:
        """Sum of |g|^norm_type over every gradient element of this module's dp and tp shards,
        each element once (a tensor replicated along tp counted on the axis's first rank), in
        ``dtype`` (default ``sum_dtype`` of the module's parameters); ``skip(name)`` leaves a
        parameter out (a pipeline's second copy of a tied weight). A collective over the
        groups the shards are split over: every rank of them must call it."""
        first = self._tp is None or self._tp.index == 0
        total = torch.zeros((), device=self._device(), dtype=dtype or sum_dtype(self.ctx.params))
        for name, p in self.module.named_parameters():
            if p.grad is None or skip(name):
                continue
            if first or self.ctx.tp_params.get(name) is None or self.ctx.tp_params[name].sharded:
                total += p.grad.to(total.dtype).pow(norm_type).sum()
        for group in self._norm_groups():
            flight.launch(group, "all_reduce", "grad norm", total.element_size(), dist.all_reduce, total,
                          dist.ReduceOp.SUM, group)
        return total

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by the true global norm over all shards; returns that norm."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if norm_type == math.inf:
            local = max((g.abs().max() for g in grads if g.numel()), default=torch.zeros((), device=self._device()))
            total = local.clone().to(sum_dtype(self.ctx.params))
            for group in self._norm_groups():
                flight.launch(group, "all_reduce", "grad norm (max)", total.element_size(), dist.all_reduce, total,
                              dist.ReduceOp.MAX, group)
        else:
            total = self.grad_pow_sum(norm_type).pow(1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total

    def _device(self) -> torch.device:
        """The device this rank's parameters live on (what the runtime allocates on)."""
        for p in self.module.parameters():
            return p.device
        for b in self.module.buffers():
            return b.device
        return self.mesh.device


@flight.published("optimizer step")
def _step(opt: torch.optim.Optimizer, *args, **kwargs):
    return type(opt).step(opt, *args, **kwargs)


class _PostedStep:
    """``opt.step`` of an optimizer ``post_step_errors`` was given: its class's step (with its
    hooks), run by ``_step``. It holds the optimizer weakly (a bound method would make a cycle
    that keeps the optimizer and its state alive until a garbage collection); ``__func__`` is
    what an LR scheduler's wrapper of ``opt.step`` binds to the optimizer."""
    __slots__ = ("_opt", "__func__")

    def __init__(self, opt: torch.optim.Optimizer):
        self._opt, self.__func__ = weakref.ref(opt), _step

    def __call__(self, *args, **kwargs):
        return _step(self._opt(), *args, **kwargs)


def post_step_errors(opt: torch.optim.Optimizer) -> None:
    """``opt.step`` posts an error it raises for the peers (``flight.published``), set as an
    instance attribute, as an LR scheduler's wrapper is."""
    opt.step = _PostedStep(opt)


def refuse_per_tensor_offload(plan) -> str:
    """Why ``per_tensor=True`` is refused under ``plan``'s offload, and what to do instead."""
    return (f"dm.optimizer(..., per_tensor=True) with Plan(offload={plan.offload!r}): per_tensor steps full "
            "copies of the parameters gathered on every rank, offload steps host copies of this rank's own "
            "shards; the two are not built together. Use an elementwise optimizer (AdamW, SGD, ...) with "
            "offload, or Plan(offload=None) with per_tensor=True")


def sum_dtype(params: dict) -> torch.dtype:
    """The dtype a step's loss and a gradient norm are summed in, the same on every rank (they
    are reduced together): float64 where the model (``ctx.params``) has a float64 parameter,
    else float32 (16-bit losses and gradients are summed in float32)."""
    return torch.float64 if any(info.dtype == torch.float64 for info in params.values()) else torch.float32


def model_loss(output) -> torch.Tensor:
    """The loss a model computed itself: ``output.loss`` (a Hugging Face model called with
    ``labels=``), ``output["loss"]``, or the output when it is a scalar tensor."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, torch.Tensor) and output.dim() == 0:
        loss = output
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(f"no loss_fn was given and the model's output ({type(output).__name__}) has no scalar "
                         "loss: pass loss_fn(output, targets), or call the model so that it computes its loss "
                         "(a Hugging Face model: labels=...)")
    return loss


def has_loss(out_spec, dims: tuple = ()) -> bool:
    """Whether outputs of structure ``out_spec``, whose leaves have ``dims`` dimensions (None: not
    a tensor; unknown dims: scalars), carry the model's own loss (see ``model_loss``)."""
    dims = tuple(dims) or (0,) * out_spec.num_leaves
    leaves = [torch.zeros((1,) * d) if d is not None else None for d in dims]
    try:
        model_loss(pytree.tree_unflatten(leaves, out_spec))
        return True
    except Exception:
        return False


def describe_call(spec) -> str:
    """``(args, kwargs)``'s structure in words: "2 positional inputs and keywords ['mask']"."""
    try:
        args, kwargs = pytree.tree_unflatten([0] * spec.num_leaves, spec)
        return f"{len(args)} positional input{'s' if len(args) != 1 else ''} and keywords {sorted(kwargs)}"
    except Exception:     # an exotic structure: its spec as torch prints it
        return str(spec)


def slice_batch(t: torch.Tensor, n: int, i: int, axis: str = "dp") -> torch.Tensor:
    """Part ``i`` of ``n`` equal parts of ``t`` along dim 0 (a 0-d tensor whole): rank ``i``'s
    slice of the global batch over dp, or (``axis="microbatches"``) micro-batch ``i`` of this
    rank's slice. Unequal parts are refused (``autopar.sizes.batch_split_error`` says why)."""
    if t.dim() == 0:
        return t
    if t.shape[0] % n:
        if axis == "dp":
            raise ValueError(batch_split_error(t.shape[0], dp=n))
        raise ValueError(f"this rank's slice of the batch has {t.shape[0]} rows along dim 0, which does not divide "
                         f"by {axis}={n}; pass dm.shard_batch(global_batch) with the global batch the module was "
                         "compiled for")
    k = t.shape[0] // n
    return t[i * k:(i + 1) * k]


FULL_BUCKET_BYTES = 64 << 20
"""bytes one all-gather of ``full_state_dict`` / ``full_grads`` brings at most (its output): a
few collectives for a model, not one a tensor, and a bounded buffer beside the full tensors"""


def _gather_flat(comm, items: list, label: str) -> dict[str, torch.Tensor]:
    """All-gather many tensors over ``comm`` in flat buckets: ``items`` = (name, this rank's
    piece, assemble), every rank's piece of a name the same size; ``assemble(flat)`` makes the
    whole tensor from the (N * piece numel) concatenation of the ranks' pieces in rank order.
    Buckets hold one dtype (and device: a module's tensors share one) and at most
    ``FULL_BUCKET_BYTES`` of output; each whole tensor is a copy of its own (the bucket's
    buffer is freed after it)."""
    out = {}
    if not items:
        return out
    n = comm.size
    for _, bucket in byte_buckets(items, lambda item: item[1].dtype, lambda item: n * item[1].numel()):
        flat = torch.cat([p.reshape(-1) for _, p, _ in bucket])
        gathered = flat.new_empty(n * flat.numel())
        comm.all_gather_flat(gathered, flat, label=f"{label}: {len(bucket)} tensors", phase="state")
        per_rank = gathered.view(n, flat.numel())
        off = 0
        for name, piece, assemble in bucket:
            k = piece.numel()
            out[name] = assemble(per_rank[:, off:off + k].reshape(-1)).clone()
            off += k
    return out


def byte_buckets(items: list, dtype_of, numel_of) -> list:
    """``items`` as (dtype, items) groups of one dtype and at most ``FULL_BUCKET_BYTES`` each
    (``numel_of(item)`` elements of ``dtype_of(item)``), by ``sizes.cut_buckets``: each dtype's
    items in order, the dtypes in order of first appearance; a larger single item is a group
    of its own."""
    by_dtype: dict = {}
    for item in items:
        by_dtype.setdefault(dtype_of(item), []).append(item)
    ordered = [(dtype, item) for dtype, group in by_dtype.items() for item in group]
    breaks = {i for i in range(1, len(ordered)) if ordered[i][0] != ordered[i - 1][0]}
    cuts = cut_buckets([numel_of(item) * dtype.itemsize for dtype, item in ordered], FULL_BUCKET_BYTES,
                       FULL_BUCKET_BYTES, breaks)
    return [(ordered[c[0]][0], [ordered[i][1] for i in c]) for c in cuts]
