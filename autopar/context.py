"""CompileContext: what every pass receives besides the graph.

It carries the mesh, the plan and the facts capture established about the model
(parameter shapes, tied names, input specs). Passes read it and write only the graph and
``node.meta``; the few results a pass hands to the runtime (the gradient buckets) go into
named fields here so that nothing lives in global state.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .mesh import Mesh
from .plan import Plan


@dataclass
class ParamInfo:
    """One parameter or buffer of the captured model, under its canonical (first) name."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    is_buffer: bool
    aliases: tuple[str, ...] = ()   # other qualified names of the same tensor (tied weights)

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
    params: dict[str, ParamInfo] = field(default_factory=dict)
    in_spec: Any = None             # pytree spec of (args, kwargs) the graph was captured with
    out_spec: Any = None
    input_shapes: tuple = ()        # per-rank shapes of the flat tensor inputs
    input_dtypes: tuple = ()        # their dtypes (pipeline stages: what a receive allocates)
    constant_inputs: dict = field(default_factory=dict)  # flat index -> non-tensor value baked in
    snapshots: list = field(default_factory=list)   # (pass name, readable graph text)
    grad_buckets: list = field(default_factory=list)  # set by the collectives pass
    gather_units: list = field(default_factory=list)  # ZeRO-3, set by the collectives pass
    tp_params: dict = field(default_factory=dict)     # name -> tpcomm.TPParam, set by the shard pass
    notes: list = field(default_factory=list)        # lines for explain()
    stages: list = field(default_factory=list)       # passes.pipeline.StageSpec, set by the pipeline pass
    microbatch_rows: int = 0                          # global rows of one micro-batch (pipeline)
    profile: Any = None                               # autopar.profile.Profile of the logical graph (cost model)

    def local_shape(self, name: str) -> tuple[int, ...]:
        """The parameter's shape on this rank's slice of the ``tp`` axis (before ZeRO)."""
        info, tp = self.params[name], self.tp_params.get(name)
        if tp is None:
            return info.shape
        return tp.local_shape(info.shape, self.mesh.axis_size("tp"), self.mesh.coordinate("tp"))
