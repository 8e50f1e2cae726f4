"""A plan's step laid out on its profile, as ``cost.estimate`` composes it: the mesh's sizes,
the profile's groups scaled to a micro-batch and priced, cut into pipeline stages
(``StepLayout``); which layers recompute (``recompute_kinds``); what each stage holds and
sends (``stage_names``, ``pipeline_bytes``)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from autopar.planspec import Plan
from autopar.sizes import padded_numel

from .memory import Precision
from .profile import Profile, is_layer, layer_of

__all__ = ["RECOMPUTE_MODES", "StepLayout", "recompute_kinds", "stage_names", "pipeline_bytes"]

RECOMPUTE_MODES = ("none", "selective", "full")


@dataclass
class StepLayout:
    """A plan's step laid out on its profile (``cost.estimate`` lays it out): the mesh's sizes (``p``, ``n``,
    ``t``), micro-batches and stages per rank (``m``, ``v``), the profile and its groups scaled
    to a micro-batch, each layer's recomputation (``kinds``), the bytes per element of each copy
    (``pr``), the slowdown of ranks sharing cores (``slow``; ``cslow`` for compute outside a
    shared pipeline's replay, ``shared`` its ``pipeline_placement``), each axis's link, each
    group's passes (``group_passes``: ``F``, ``B``, ``W``, forward compute alone ``f_raw``, tp
    forward and backward), the stages' [first, end) group indices (``bounds``), and per stage
    its groups (``stage_groups``) and their forward compute alone (``f_stage``)."""
    plan: Plan
    axes: dict
    c: object
    p: int
    n: int
    t: int
    m: int
    v: int
    prof: Profile
    kinds: dict
    groups: list
    pr: Precision
    slow: float
    world: int
    shared: Optional[tuple]
    cslow: float
    link_tp: object
    link_dp: object
    link_pp: object
    F: list
    B: list
    W: list
    f_raw: list
    tpf: list
    tpb: list
    as_cut: bool
    bounds: list
    stage_groups: list = field(init=False)
    f_stage: list = field(init=False)

    def __post_init__(self):
        self.stage_groups = [self.groups[a:b] for a, b in self.bounds]
        self.f_stage = [self.f_raw[a:b] for a, b in self.bounds]

    @property
    def S(self) -> int:
        """Pipeline stages: ``p`` ranks of ``v`` stages each (1 without a pipeline)."""
        return self.p * self.v

    def stage_sum(self, xs: list, k: int) -> float:
        """The sum of per-group ``xs`` over stage ``k``'s groups."""
        a, b = self.bounds[k]
        return sum(xs[a:b])


def recompute_kinds(prof: Profile, rc) -> dict:
    """Each layer group's recomputation: ``rc`` for every layer, or a dict of layer -> mode;
    the later part of a layer a stage cut splits is recomputed as the layer is."""
    kinds = dict(rc) if isinstance(rc, dict) else {g.name: rc for g in prof.groups if is_layer(g.name)}
    for kind in kinds.values():
        if kind not in RECOMPUTE_MODES:
            raise ValueError(f"recompute={kind!r}: expected one of {RECOMPUTE_MODES}, a dict of layer -> one "
                             "of them, or a budget in bytes")
    for g in prof.groups:
        if layer_of(g.name) in kinds:
            kinds.setdefault(g.name, kinds[layer_of(g.name)])
    return kinds


def stage_names(s: StepLayout, gs) -> set:
    """The parameters groups ``gs`` hold: every one they read (without a pipeline, all)."""
    return set().union(*(g.params.keys() | g.reads for g in gs)) if s.S > 1 else set(s.prof.shapes)


def pipeline_bytes(s: StepLayout) -> tuple:
    """(bytes each stage sends the next per micro-batch, bytes of the tied gradients the
    pipeline's ranks exchange after the schedule)."""
    S, p, n = s.S, s.p, s.n
    p2p_bytes = [s.stage_groups[k][-1].cross_bytes if k < S - 1 else 0.0 for k in range(S)]
    tied_bytes = 0.0
    if S > 1:
        for name in s.prof.tied:
            holders = [k for k, gs in enumerate(s.stage_groups) if any(name in g.reads for g in gs)]
            if len(set(h % p for h in holders)) > 1:   # exchanged as held: whole (ddp) or this rank's rows
                shp = s.prof.shapes[name]
                held = math.prod(shp) if s.plan.dp == "ddp" else padded_numel(shp, n) // n
                tied_bytes += held * s.pr.landed     # the gradients as they landed
    return p2p_bytes, tied_bytes
