"""CompileContext: what every pass receives besides the graph.

It carries the mesh and the plan, the facts capture established about the model
(parameters, tied names, input specs), and, declared here in one place, the results a pass
hands to later passes and to emit. Passes read it and write only the graph, ``node.meta``
and those named fields, so that nothing lives in global state.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .mesh import Mesh
from .placement import ShardSpec
from .planspec import Plan


_NUMBERED = re.compile(r"^((?:[^.]+\.)*?\d+)(?:\.|$)")


def layer_key(path: str) -> Optional[str]:
    """The numbered layer a parameter name or module path sits in: the path through its first
    numeric component (``blocks.3.attn.qkv.weight`` and ``blocks.3.attn`` -> ``blocks.3``,
    ``0.weight`` -> ``0``); None outside any numbered layer. ZeRO-3 gathers a layer's
    parameters as one unit, and the cost model profiles a layer as one group."""
    m = _NUMBERED.match(path)
    return m.group(1) if m else None


@dataclass
class ParamInfo:
    """One parameter or buffer of the captured model, under its canonical (first) name."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    is_buffer: bool
    aliases: tuple[str, ...] = ()   # other qualified names of the same tensor (tied weights)
    persistent: bool = True         # in the model's state_dict() (a buffer registered persistent=False: not)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class CompileContext:
    mesh: Mesh
    plan: Plan
    # ---- set by capture (autopar/capture.py) and the compile driver (autopar/api.py) ----------
    params: dict[str, ParamInfo] = field(default_factory=dict)
    in_spec: Any = None             # pytree spec of (args, kwargs) the graph was captured with
    out_spec: Any = None
    output_dims: tuple = ()         # dims of the flat outputs (None: not a tensor): has the model its own loss?
    input_shapes: tuple = ()        # per-rank shapes of the flat tensor inputs
    input_dtypes: tuple = ()        # their dtypes (pipeline stages: what a receive allocates)
    constant_inputs: dict = field(default_factory=dict)  # flat index -> non-tensor value baked in
    microbatch_rows: int = 0        # global rows of one micro-batch (pipeline)
    stage_starts: tuple = ()        # pipeline: the first node of every stage but the first, where the
                                    # cuts must fall (a new input shape is cut where the compiled one was)
    device_type: str = "cpu"        # the device the module runs on ("cuda", "cpu"): the autocast rule's
    recompute_layers: dict = field(default_factory=dict)  # numbered layer -> "none" | "selective" | "full"
                                    # (the plan's mode for every layer, or the cost model's choice
                                    # under a memory budget)
    head_policy: Any = None         # LM head layout: policy(passes.lm_head.HeadChoice) -> (split, why),
                                    # the cost model's for the compile's cluster; None: passes.lm_head's default
    model_class: str = ""           # the captured model's class, module-qualified (checkpoints record it)
    model_config: Any = None        # a Hugging Face model in it: (its name prefix, its config as JSON)
    # ---- results of passes, for later passes and emit (the pass that sets each) ----------------
    tp_params: dict = field(default_factory=dict)     # shard (tensor_parallel.decide): name -> TPParam
    grad_buckets: list = field(default_factory=list)  # collectives: parameter names per gradient bucket
    gather_units: list = field(default_factory=list)  # collectives (ZeRO-3): parameter names per gather unit
    stages: list = field(default_factory=list)        # pipeline: a passes.pipeline.StageSpec per stage
    rng_sites: tuple = ()           # rng.find_sites: every random site of the model (runtime.rng.MaskSite)
    rng_local: dict = field(default_factory=dict)     # rng: site -> runtime.rng.LocalSite this graph keeps
    recomputed: list = field(default_factory=list)    # recompute: (module name, layer, kind, node names) per region
    rng_replayed: set = field(default_factory=set)    # recompute: random sites inside regions (masks drawn again)
    captured_training: bool = True  # the model's mode when compile captured it
    mode_difference: Any = ""       # capture: a callable -> how the other train/eval mode's graph differs
                                    # ("" = dropout only), worked out when first needed
    # ---- for the user -------------------------------------------------------------------------
    snapshots: list = field(default_factory=list)     # (pass name, readable graph text), for dm.dump()
    notes: list = field(default_factory=list)         # lines for explain()
    profile_source: Any = None      # () -> the cost model's profile of the logical graph, called when
                                    # ``profile`` is first read (a compile needs it only under a memory budget)
    _profile: Any = field(default=None, repr=False)

    @property
    def profile(self):
        """The cost model's profile of the logical graph (``cost.profile.Profile``), or None if it
        could not be made (logged): made from ``profile_source`` on first read."""
        if self.profile_source is not None:
            source, self.profile_source = self.profile_source, None
            self._profile = source()
        return self._profile

    def stored_dtype(self, name: str) -> torch.dtype:
        """The dtype the compiled module keeps parameter or buffer ``name`` in: under mixed
        precision a trainable parameter is the optimizer's master (``plan.master_dtype``),
        everything else the dtype the graph reads (``params[name].dtype``)."""
        info = self.params[name]
        if self.plan.mixed and info.requires_grad and not info.is_buffer:
            return self.plan.master_dtype
        return info.dtype

    def local_shape(self, name: str) -> tuple[int, ...]:
        """The parameter's shape on this rank's slice of the ``tp`` axis (before ZeRO)."""
        info, tp = self.params[name], self.tp_params.get(name)
        if tp is None:
            return info.shape
        return tp.local_shape(info.shape, self.mesh.axis_size("tp"), self.mesh.coordinate("tp"))

    def shard_specs(self) -> dict[str, ShardSpec]:
        """How every trainable parameter is split over ``dp`` (ddp: N=1, nothing split)."""
        n = self.mesh.axis_size("dp") if self.plan.dp != "ddp" else 1
        index = self.mesh.coordinate("dp") if n > 1 else 0
        return {name: ShardSpec(self.local_shape(name), n, index)
                for name, info in self.params.items() if not info.is_buffer and info.requires_grad}
