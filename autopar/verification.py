"""verify: run a plan on simulated ranks and compare every node with the single-device graph.

``autopar.verify(model, mesh, plan, example_inputs=..., loss_fn=..., target=...)`` runs

    the reference   the captured logical graph (``autopar.capture``, global shapes) on one
                    device, under an ``fx.Interpreter`` that keeps every node's value and, by a
                    tensor hook, its gradient, with ``loss_fn(output, target)`` as the loss;
    each rank       ``autopar.compile`` of the same model for its place in the mesh, the emitted
                    graph run by the same recording interpreter (sequence-parallel regions
                    entered), on its data-parallel slice, then backward, ``full_grads()`` and
                    ``full_state_dict()``. The ranks are threads on torch's threaded process group
                    (``autopar.launch.run_threads``), or gloo processes (``launch.run``) where the
                    plan or the model needs them or ``spawn=True`` asks;

then rebuilds each logical node's global value from the ranks' local ones by the node's layout
and compares them in graph order (forward), then the gradients in reverse graph order (the order
backward computes them), and returns a ``VerifyReport``: the first node that diverges beyond the
tolerance, with its layout and the nearest collective feeding it, or "verified" with the largest
scaled error, ``max|a - b| / max(max|b|, floor)``. The floor is ``NOISE`` times the largest value
feeding the node (forward) or the largest gradient of the nodes reading it (backward): a value
that is zero but for rounding (a gradient that cancels, ``d(t / t.sum())/dt`` of one element) is
float noise on both sides, and noise is not compared with noise.

Putting a value together (``_combine``), one mesh axis at a time, tp first (it splits what is
local to dp, as ``passes.localize`` does), then dp:

    forward    Shard(d): the ranks' chunks concatenated along d (a fused projection that tensor
               parallelism stores interleaved, chunk by part); Replicate: rank 0's, the others
               must agree; Partial(op): reduced with op.
    gradient   along tp, every rank computes the same loss and Megatron's f/g make each rank's
               gradient the true one for what it holds: Shard concatenated; Replicate whole on
               every rank; and Partial(sum), the dual of Replicate, whole on every rank too (the
               sum's gradient is each addend's). Along dp, rank r's loss L_r covers its rows
               only and the global loss is c * sum_r L_r (c = 1/dp for a mean, found by
               comparing the ranks' losses with the reference's): the true gradient is
               c * sum_r of each rank's gradient, laid where the rank's value lies (Shard:
               the chunks concatenated times c; Replicate: the ranks' gradients summed times c).
               A value Partial along dp has no per-rank loss of its own: its gradient is not compared.

Parameters are compared as the user sees them: ``full_state_dict()`` against the model's, and
``full_grads()`` (reduced over dp: averaged) against the reference gradient times dp * c.

Where a pass keeps a logical value elsewhere than at the node of its name (``_measure_points``):
tensor parallelism moves a row-parallel product's bias after the reduction (``linear(x, W, b)``
becomes ``linear(x, W) + b``): the logical ``linear`` is measured at that add (``Divergence.at``);
the overlap pass fuses a node with its neighbour (f + column product, gather + product): it is
measured at the fused node that descends from it (torch.fx's ``from_node`` provenance). A node
fused into one that does not hold its value (a product with its reduce-scatter), or rewritten
into another op (bar the lowerings that keep the value: vocabulary parallelism, dropout sites),
is listed in ``VerifyReport.skipped``.

Not covered: pipelines (``Plan(pp_schedule=...)``: the threaded process group has no send/recv,
and a stage's graph is one micro-batch). Dropout runs on processes, every rank and the reference
drawing from ``torch.manual_seed(seed)`` (threads would share one generator).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.utils import _pytree as pytree

from . import meta, passes
from .api import compile as autopar_compile
from .capture import capture
from .compare import scaled_error
from .context import CompileContext
from .launch import run as run_processes, run_threads
from .mesh import Mesh
from .placement import Layout, Partial, Placement, Replicate, Shard, TPParam
from .passes.tensor_parallel import SPLITS
from .planspec import Plan
from .runtime.module import attr_path

__all__ = ["verify", "VerifyReport", "Divergence"]

aten = torch.ops.aten
TINY = 1e-30
NOISE = 1e-2
"""the scaled error's floor, as a share of the values around the node (module docstring): a
rounding error of a few eps times those, over a tolerance of 1e-4, stays below it, and a missing
reduction (an error the size of the value) stays far above"""
SPLIT_ORDER = ("dp", "tp")    # tp splits what is local to dp (passes/localize.py AXIS_ORDER)


# ---- the report ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Divergence:
    """The first node whose value (or gradient) differs from the single-device graph's."""
    node: str
    """the logical graph's node name"""
    op: str
    """its op (``aten.add.Tensor``, ``placeholder``, ``get_attr``)"""
    phase: str
    """``forward`` (the value) or ``gradient``"""
    layout: str
    """the node's layout in the emitted graph (``dp:S(0) tp:P(sum)``)"""
    error: float
    """scaled error ``max|a - b| / (max|b| + tiny)``"""
    tol: float
    collective: Optional[str] = None
    """the nearest collective node feeding it (forward: upstream; gradient: downstream, whose
    backward sends the gradient); None if none does"""
    comm: str = ""
    """that collective's ``CommInfo``"""
    at: str = ""
    """the emitted node where the value was measured, when not the node of the same name"""
    detail: str = ""

    def __str__(self) -> str:
        what = f"node {self.node} ({self.op}" + (f", measured at {self.at}" if self.at else "") + ")"
        grad = ", in its gradient" if self.phase == "gradient" else ""
        fed = f"fed by {self.collective} ({self.comm})" if self.collective else "fed by no collective"
        detail = f" [{self.detail}]" if self.detail else ""
        return (f"diverges at {what} layout {self.layout}{grad}: scaled error {self.error:.3g} > "
                f"{self.tol:g}{detail}; {fed}")


@dataclass
class VerifyReport:
    """What ``verify`` found; ``str(report)`` is the one-line verdict."""
    ok: bool
    first_divergence: Optional[Divergence]
    largest_scaled_error: float
    largest_at: str
    """node (and phase) of the largest scaled error"""
    nodes_checked: int
    """logical nodes whose value was compared"""
    gradients_checked: int
    plan: str
    mesh: str
    errors: dict = field(default_factory=dict)
    """node -> {phase: scaled error}, for every comparison made"""
    skipped: dict = field(default_factory=dict)
    """node -> why it was not compared"""
    losses: tuple = ()
    """(single-device loss, per-rank losses)"""
    ranks: str = ""
    """how the ranks ran: ``threads`` (one process) or ``processes``"""

    def __str__(self) -> str:
        if self.first_divergence is not None:
            return str(self.first_divergence)
        return (f"verified: {self.nodes_checked} nodes, forward and gradient ({self.gradients_checked} "
                f"gradients), largest scaled error {self.largest_scaled_error:.2e} at node {self.largest_at}")


# ---- recording interpreter ----------------------------------------------------------------------------

class _Recorder(fx.Interpreter):
    """Runs a graph and keeps, for the nodes named in ``want`` (node name -> key), a copy of the
    value and, through a tensor hook, of its gradient once backward reaches it. Submodules that
    are graphs (sequence-parallel regions) are run by a recorder as well."""

    def __init__(self, gm: fx.GraphModule, want: dict, values: dict, grads: dict, top: bool = True):
        super().__init__(gm)
        self.want, self.values, self.grads, self.top = want, values, grads, top

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        key = self.want.get(n.name)
        if key is not None and isinstance(out, torch.Tensor) and (
                n.op == "call_function" or (self.top and n.op == "placeholder")):
            self.values[key] = out.detach().clone()
            if out.requires_grad:     # autograd hands a hook None where no gradient reaches the value
                out.register_hook(lambda g, key=key: None if g is None else
                                  self.grads.__setitem__(key, g.detach().clone()))
        return out

    def call_module(self, target, args, kwargs):
        sub = self.fetch_attr(target)
        if isinstance(sub, fx.GraphModule) and not kwargs:
            return _Recorder(sub, self.want, self.values, self.grads, top=False).run(*args)
        return super().call_module(target, args, kwargs)


def _run_recorded(gm: fx.GraphModule, want: dict, values: dict, grads: dict, args: tuple, kwargs: dict):
    flat = pytree.tree_leaves((tuple(args), dict(kwargs)))
    out = _Recorder(gm, want, values, grads).run(*flat, enable_io_processing=False)
    return gm.graph.process_outputs(out)


def _mean_square(out) -> torch.Tensor:
    """The default loss: the mean square of every floating output (a mean over the rows, so
    that the global loss is the average of the data-parallel ranks')."""
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        raise ValueError("the model returns no floating tensor: pass a loss_fn")
    return sum((t if t.dtype == torch.float64 else t.float()).pow(2).mean() for t in leaves)


def _loss(loss_fn, out, target):
    if loss_fn is None:
        return _mean_square(out)
    return loss_fn(out) if target is None else loss_fn(out, target)


# ---- the logical graph ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Logical:
    """What a rank needs to know of a logical node to find it in its emitted graph."""
    kind: str              # fx op: placeholder | call_function | get_attr
    op: str                # str(target)
    bias: bool = False     # a product with a bias (tp may move the bias after it)
    param: str = ""        # get_attr: the parameter's canonical name
    stack: Optional[dict] = None   # export's nn_module_stack: the module that ran it


_UNSPECIFIED = {aten.empty.memory_format, aten.empty_like.default, aten.new_empty.default,
                aten.empty_strided.default, aten.new_empty_strided.default}
"""ops whose values are unspecified (memory the program writes before it reads): not compared"""


def _logical_nodes(gm: fx.GraphModule) -> dict:
    out = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in _UNSPECIFIED:
            continue
        if n.op == "get_attr":
            out[n.name] = _Logical("get_attr", "get_attr", param=str(n.target))
        elif n.op in ("placeholder", "call_function") and isinstance(n.meta.get(meta.VAL), torch.Tensor):
            bias = (n.target == aten.addmm.default or (n.target == aten.linear.default and (
                (len(n.args) > 2 and n.args[2] is not None) or n.kwargs.get("bias") is not None)))
            out[n.name] = _Logical(n.op, "placeholder" if n.op == "placeholder" else str(n.target), bias,
                                   stack=n.meta.get("nn_module_stack"))
    return out


@dataclass
class _Reference:
    values: dict
    grads: dict
    loss: float
    params: dict
    param_grads: dict
    logical: dict
    grouped: dict = field(default_factory=dict)   # node -> parts of an interleaved tp shard (set later)
    gm: Optional[fx.GraphModule] = None
    random: bool = False                          # draws dropout masks

    @property
    def nodes(self) -> dict:
        if self.gm is None:
            return {}
        if getattr(self, "_nodes", None) is None:
            self._nodes = {n.name: n for n in self.gm.graph.nodes}
        return self._nodes


def _reference(model, axes, plan, args, kwargs, target, loss_fn, seed) -> _Reference:
    ctx = CompileContext(mesh=Mesh(virtual=True, **axes), plan=plan)
    gm = capture(copy.deepcopy(model), args, kwargs, ctx)
    passes.find_sites(gm, ctx)
    values, grads = {}, {}
    want = {n.name: n.name for n in gm.graph.nodes}
    torch.manual_seed(seed)
    loss = _loss(loss_fn, _run_recorded(gm, want, values, grads, args, kwargs), target)
    loss.backward()
    params = {name: attr_path(gm, name).detach().clone() for name in ctx.params}
    param_grads = {name: attr_path(gm, name).grad.detach().clone() for name, info in ctx.params.items()
                   if info.requires_grad and not info.is_buffer and attr_path(gm, name).grad is not None}
    return _Reference(values, grads, float(loss.detach()), params, param_grads, _logical_nodes(gm), gm=gm,
                      random=bool(ctx.rng_sites) and model.training)


def _grouped(gm: fx.GraphModule, tp_groups: dict) -> dict:
    """Logical nodes holding an interleaved tp shard (a fused projection stored part by part,
    ``placement.TPParam``): from the parameter through everything computed from it, up to the
    split into its parts, as ``passes.tensor_parallel`` lays them out."""
    out = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr" and tp_groups.get(str(n.target), 1) > 1:
            out[n.name] = tp_groups[str(n.target)]
        elif n.op == "call_function" and n.target not in SPLITS:
            g = max((out.get(a.name, 0) for a in n.all_input_nodes), default=0)
            if g:
                out[n.name] = g
    return out


# ---- one rank --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Where:
    """Where a logical node is in a rank's emitted graph and what feeds it."""
    at: str               # the emitted node measured ("" = the node of that name)
    layout: Layout
    feeder: tuple         # (name, CommInfo text) of the nearest collective upstream, or ()
    grad_feeder: tuple    # ... downstream (its backward feeds the gradient)


@dataclass
class _RankRecord:
    coords: dict
    loss: float
    values: dict
    grads: dict
    where: dict = field(default_factory=dict)        # rank 0: logical name -> _Where
    skipped: dict = field(default_factory=dict)      # rank 0: logical name -> why
    tp_groups: dict = field(default_factory=dict)    # rank 0: parameter -> interleaved parts
    full_params: dict = field(default_factory=dict)  # rank 0
    full_grads: dict = field(default_factory=dict)   # rank 0


def _emitted_nodes(gm: fx.GraphModule) -> dict:
    """name -> (node, the call_module node of the region holding it, or None)."""
    out = {}
    for n in gm.graph.nodes:
        out.setdefault(n.name, (n, None))
        if n.op == "call_module" and isinstance(gm.get_submodule(n.target), fx.GraphModule):
            for m in gm.get_submodule(n.target).graph.nodes:
                if m.op == "call_function":
                    out.setdefault(m.name, (m, n))
    return out


def _nearest_collective(start: fx.Node, upstream: bool) -> tuple:
    """(name, CommInfo text) of the collective nearest ``start``: upstream, one that acts in
    forward (Megatron's f and the parameter syncs are the identity there); downstream, any (its
    backward hands ``start`` its gradient). () if none."""
    seen, frontier = {start}, [start]
    while frontier:
        nxt = []
        for n in frontier:
            for m in (n.all_input_nodes if upstream else n.users):
                if m in seen:
                    continue
                seen.add(m)
                nxt.append(m)
                info = m.meta.get(meta.COMM)
                if info is not None and not (upstream and info.phase == "backward"):
                    return m.name, str(info)
        frontier = nxt
    return ()


def _sources(node: fx.Node) -> set:
    """Names of the captured nodes ``node`` descends from (torch.fx's provenance, ``from_node``,
    which export's unlifting sets and a pass that copies a node's meta keeps)."""
    return {getattr(src, "name", None) for src in node.meta.get("from_node", ()) or ()}


def _moved_bias(stack, nodes: list) -> list:
    """The add tensor parallelism put after a row-parallel product (``tensor_parallel._split_bias``:
    aten.add with the product's module stack and no captured node of its own)."""
    return [m for m in nodes if m.op == "call_function" and m.target == aten.add.Tensor
            and not m.meta.get("from_node") and stack is not None and m.meta.get("nn_module_stack") == stack]


def _measure_points(gm: fx.GraphModule, logical: dict):
    """logical name -> (the emitted node holding its value, the region node holding that, or
    None), and the names not measured with why: a node of the same name running the same op
    (or a lowering that keeps its value: vocabulary parallelism, dropout sites); a product whose
    bias tensor parallelism moved after it, at that add (the product itself may have been fused
    with its reduce-scatter); a node a pass fused with its neighbour (overlap: f + column
    product, gather + product), at the fused node that descends from it."""
    emitted = _emitted_nodes(gm)
    nodes = [n for n, _ in emitted.values()]
    points, skipped = {}, {}
    for name, lg in logical.items():
        node, region = emitted.get(name, (None, None))
        moved = lg.bias and (node is None or node.target == aten.mm.default or (
            node.target == aten.linear.default and len(node.args) < 3 and not node.kwargs.get("bias")))
        if moved:
            adds = _moved_bias(lg.stack, nodes)
            if len(adds) == 1:
                points[name] = (adds[0], emitted[adds[0].name][1])
                continue
            if node is not None:
                skipped[name] = "its bias was moved after it, and the add is not found"
                continue
        if node is None:
            heirs = [n for n in nodes if name in _sources(n) and n.name not in logical]
            if len(heirs) == 1 and heirs[0].op == lg.kind:
                points[name] = (heirs[0], emitted[heirs[0].name][1])
            else:
                skipped[name] = "fused into a node that does not hold its value" if not heirs else \
                    f"not in the emitted graph (descendants: {', '.join(n.name for n in heirs)})"
            continue
        if node.op != lg.kind or (lg.kind == "call_function" and str(node.target) != lg.op
                                  and meta.LOWER not in node.meta and meta.RNG_SITE not in node.meta):
            skipped[name] = f"rewritten into {node.op} {node.target}"
            continue
        points[name] = (node, region)
    return points, skipped


def _rank_job(model, axes, plan, args, kwargs, target, loss_fn, logical, seed) -> _RankRecord:
    """One rank: compile, run forward and backward recording the logical nodes, gather the
    full parameters and gradients (collectives: every rank runs this)."""
    mesh = Mesh(**axes)
    dm = autopar_compile(model, mesh, example_inputs=args, example_kwargs=kwargs, plan=plan)
    dm.train(model.training)
    gm = dm.module
    points, skipped = _measure_points(gm, logical)
    values, grads = {}, {}
    want = {at.name: name for name, (at, _) in points.items()}
    gm.forward = lambda *a, **k: _run_recorded(gm, want, values, grads, a, k)
    torch.manual_seed(seed)
    out = dm(*dm.shard_batch(tuple(args)), **dm.shard_batch(dict(kwargs)))
    loss = _loss(loss_fn, out, dm.shard_batch(target) if target is not None else None)
    loss.backward()
    full_grads, full_params = dm.full_grads(), dm.full_state_dict()
    rec = _RankRecord({a: mesh.coordinate(a) for a in mesh.axes}, float(loss.detach()), values, grads)
    if mesh.rank == 0:
        for name, (at, region) in points.items():
            anchor = region if region is not None else at
            rec.where[name] = _Where(at.name if at.name != name else "", at.meta.get(meta.LAYOUT),
                                     _nearest_collective(anchor, True), _nearest_collective(anchor, False))
        rec.skipped = skipped
        rec.tp_groups = {name: p.groups for name, p in dm.ctx.tp_params.items() if p.groups > 1}
        rec.full_params = {k: v for k, v in full_params.items() if k in dm.ctx.params}
        rec.full_grads = {k: v for k, v in full_grads.items() if k in dm.ctx.params}
    return rec


# ---- putting values together --------------------------------------------------------------------------------

def _node_error(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """``max|a - b| / max(max|b|, floor)`` over the finite elements of ``b`` (a mask's -inf), in
    float64: ``compare.scaled_error`` with the reference's largest magnitude as its scale; inf
    when the shapes differ or an element is finite in one and not the other, or an infinity
    of the other sign."""
    if tuple(a.shape) != tuple(b.shape):
        return math.inf
    if not b.numel():
        return 0.0
    a, b = a.double(), b.double()
    finite = torch.isfinite(b)
    if not torch.equal(finite, torch.isfinite(a)) or not torch.equal(a[~finite].nan_to_num(0.0),
                                                                      b[~finite].nan_to_num(0.0)):
        return math.inf
    if not finite.any():
        return 0.0
    a, b = a[finite], b[finite]
    return scaled_error(a, b, atol=max(float(b.abs().max()), floor) + TINY, dtype=torch.float64)


def _cat(parts: list, dim: int, groups: int) -> torch.Tensor:
    kept = [p for p in parts if p.numel()] or parts[:1]   # ceil chunks: the last ranks may hold none
    if groups > 1:
        return TPParam(Shard(dim), groups).full_from(kept)
    return torch.cat(kept, dim)


class _Disagree(Exception):
    pass


def _combine(parts: list, p: Placement, axis: str, gradient: bool, groups: int, c: float, tol: float):
    """One mesh axis's pieces (in coordinate order) -> the value along it (see the module
    docstring); None where it is not compared."""
    if isinstance(p, Shard):
        out = _cat(parts, p.dim % parts[0].dim() if parts[0].dim() else 0, groups)
        return out * c if gradient and axis == "dp" else out
    if gradient and axis == "dp":
        return None if isinstance(p, Partial) else torch.stack(parts).sum(0) * c
    if isinstance(p, Replicate) or gradient:
        for i, x in enumerate(parts[1:], 1):
            e = _node_error(x, parts[0])
            if e > tol:
                raise _Disagree(f"{axis} ranks 0 and {i} hold different values of a {p} "
                                f"{'gradient' if gradient else 'value'} (scaled difference {e:.3g})")
        if gradient and isinstance(p, Partial) and p.op == "avg":   # X = mean of the parts: dX/dpart = 1/n
            return parts[0] * len(parts)
        return parts[0]
    stacked = torch.stack(parts)
    return {"sum": lambda: stacked.sum(0), "avg": lambda: stacked.mean(0),
            "max": lambda: stacked.amax(0), "min": lambda: stacked.amin(0)}[p.op]()


def _assemble(pieces: dict, layout: Layout, axes: dict, gradient: bool, groups: int, c: float, tol: float):
    """The global value from ``pieces`` (coordinate tuple in mesh order -> local tensor)."""
    names = list(axes)
    order = [a for a in names if a not in SPLIT_ORDER] + [a for a in reversed(SPLIT_ORDER) if a in axes]
    cur = dict(pieces)
    for axis in order:
        i = names.index(axis)
        p = layout[axis] if axis in dict(layout.placements) else Replicate()
        grouped: dict = {}
        for key, v in sorted(cur.items()):
            grouped.setdefault(key[:i] + key[i + 1:], []).append(v)
        names.pop(i)
        nxt = {}
        for key, parts in grouped.items():
            v = _combine(parts, p, axis, gradient, groups if axis == "tp" else 1, c, tol)
            if v is None:
                return None
            nxt[key] = v
        cur = nxt
    return cur[()]


# ---- the comparison -------------------------------------------------------------------------------------------

def _default_tol(t: torch.Tensor) -> float:
    return 2e-2 if t.dtype in (torch.float16, torch.bfloat16) else 1e-4


class _Comparison:
    def __init__(self, ref: _Reference, records: list, axes: dict, tol: Optional[float]):
        self.ref, self.records, self.axes, self.tol = ref, records, axes, tol
        self.rank0 = records[0]
        self.errors: dict = {}
        self.largest = (0.0, "-")
        self._floors: dict = {}

    def _record(self, name: str, phase: str, err: float):
        self.errors.setdefault(name, {})[phase] = err
        if err > self.largest[0] or self.largest[1] == "-":
            self.largest = (err, name if phase == "forward" else f"{name} ({phase})")

    def _floor(self, name: str, phase: str) -> float:
        """``NOISE`` times the largest value feeding ``name`` (forward) or the largest gradient
        of the nodes reading it (gradient), in the single-device graph, or theirs if larger:
        rounding noise is carried along (a gradient that cancels is noise, and so is what a
        product makes of it)."""
        memo = self._floors.setdefault(phase, {})
        if name in memo:
            return memo[name]
        order = list(self.ref.nodes.values())
        for node in (order if phase == "forward" else reversed(order)):    # each after what it reads
            if phase == "forward":
                around = [(n.name, self.ref.values.get(n.name)) for n in node.all_input_nodes]
            else:       # a reader of several outputs (topk) is read through its getitems
                readers = [r for u in node.users
                           for r in ((u,) if isinstance(self.ref.values.get(u.name), torch.Tensor) else u.users)]
                around = [(r.name, self.ref.grads.get(r.name)) for r in readers]
            memo[node.name] = max((max(NOISE * float(t.detach().abs().max()), memo.get(n, 0.0)) for n, t in around
                                   if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()),
                                  default=0.0)
        return memo.get(name, 0.0)

    def check(self, name: str, phase: str, ref_val: torch.Tensor, c: float = 1.0) -> Optional[Divergence]:
        """Compare one node's value or gradient; a Divergence if it exceeds the tolerance."""
        lg, where = self.ref.logical[name], self.rank0.where.get(name)
        floor = self._floor(name, phase)
        layout = where.layout if where is not None else None
        tol = self.tol if self.tol is not None else _default_tol(ref_val)
        detail = ""
        if lg.kind == "get_attr":
            got = (self.rank0.full_params if phase == "forward" else self.rank0.full_grads).get(lg.param)
            if got is None:
                return None
            err = _node_error(got * c if phase == "gradient" else got, ref_val, floor)
        else:
            store = "values" if phase == "forward" else "grads"
            pieces = {tuple(r.coords[a] for a in self.axes): getattr(r, store).get(name) for r in self.records}
            if any(v is None for v in pieces.values()) or not isinstance(layout, Layout):
                return None
            try:
                got = _assemble(pieces, layout, self.axes, phase == "gradient", self.ref.grouped.get(name, 1), c, tol)
            except _Disagree as exc:
                got, err, detail = None, math.inf, str(exc)
            except RuntimeError as exc:      # pieces that do not fit together
                got, err, detail = None, math.inf, f"the ranks' pieces do not fit together: {exc}"
            if got is None and not detail:
                return None
            if got is not None:
                err = _node_error(got, ref_val, floor)
                if math.isinf(err):
                    detail = f"put together it has shape {tuple(got.shape)}, one device {tuple(ref_val.shape)}"
        self._record(name, phase, err)
        if err <= tol:
            return None
        feeder = (where.feeder if phase == "forward" else where.grad_feeder) if where is not None else ()
        return Divergence(name, lg.op, phase, str(layout) if layout is not None else "?", err, tol,
                          feeder[0] if feeder else None, feeder[1] if feeder else "",
                          where.at if where is not None else "", detail)


def _loss_scale(ref: _Reference, records: list, axes: dict) -> float:
    """c of the module docstring: the global loss is c * sum over dp ranks of theirs."""
    n = axes.get("dp", 1)
    per_dp = {}
    for r in records:
        per_dp.setdefault(r.coords.get("dp", 0), r.loss)
    total = sum(per_dp.values())
    if n == 1:
        return 1.0
    for c in (1.0 / n, 1.0):
        if abs(c * total - ref.loss) <= 1e-4 * (abs(ref.loss) + 1e-12):
            return c
    raise ValueError(f"the loss does not decompose over the data-parallel ranks: one device {ref.loss:.6g}, the "
                     f"dp ranks {[round(v, 6) for v in per_dp.values()]} (mean {total / n:.6g}, sum {total:.6g}); "
                     "verify needs a loss_fn that is a mean or a sum over the batch rows")


def _compare(ref: _Reference, records: list, axes: dict, plan: Plan, tol: Optional[float]) -> VerifyReport:
    cmp = _Comparison(ref, records, axes, tol)
    ref.grouped = _grouped(ref.gm, records[0].tp_groups)
    names = list(ref.logical)
    checked, first = 0, None
    for name in names:
        lg = ref.logical[name]
        val = ref.params.get(lg.param) if lg.kind == "get_attr" else ref.values.get(name)
        if val is None or name in records[0].skipped:
            continue
        div = cmp.check(name, "forward", val)
        checked += name in cmp.errors
        if div is not None and first is None:
            first = div
    grads = 0
    if first is None:
        c = _loss_scale(ref, records, axes)
        for name in reversed(names):
            lg = ref.logical[name]
            g = ref.param_grads.get(lg.param) if lg.kind == "get_attr" else ref.grads.get(name)
            if g is None or name in records[0].skipped:
                continue
            scale = axes.get("dp", 1) * c if lg.kind == "get_attr" else c
            div = cmp.check(name, "gradient", g, scale)
            grads += "gradient" in cmp.errors.get(name, {})
            if div is not None:
                first = div
                break
    mesh = ", ".join(f"{a}={s}" for a, s in axes.items())
    return VerifyReport(first is None, first, cmp.largest[0], cmp.largest[1], checked, grads, str(plan),
                        f"Mesh({mesh})", cmp.errors, dict(records[0].skipped),
                        (ref.loss, tuple(r.loss for r in records)))


# ---- the entry point -----------------------------------------------------------------------------------------

def _axes(mesh) -> dict:
    if isinstance(mesh, Mesh):
        return dict(mesh.axes)
    if isinstance(mesh, dict):
        return dict(mesh)
    if isinstance(mesh, str):
        axes = {}
        for part in mesh.replace(" ", "").split(","):
            name, sep, size = part.partition("=")
            if not sep or not size.isdigit():
                raise ValueError(f"cannot read mesh {mesh!r}: expected axis=size pairs, e.g. 'dp=2,tp=2'")
            axes[name] = int(size)
        Mesh(virtual=True, **axes)      # checks the names and sizes
        return axes
    raise TypeError(f"mesh must be an autopar.Mesh, a dict or a text like 'dp=2,tp=2', got {type(mesh).__name__}")


def verify(model: nn.Module, mesh: Union[Mesh, dict, str], plan: Union[Plan, str], *, example_inputs,
           example_kwargs=None, target=None, loss_fn=None, tol: Optional[float] = None,
           spawn: Optional[bool] = None,
           timeout: float = 120.0, seed: int = 0) -> VerifyReport:
    """Run ``plan`` for ``mesh`` on simulated ranks and compare every node's value and gradient
    with the single-device graph (module docstring). ``mesh``: an ``autopar.Mesh`` (virtual is
    fine: only its axes are read), a dict or ``"dp=2,tp=2"``; ``plan``: a ``Plan`` or its text
    (``str(plan)``, or the short form ``"dp=zero3,tp,sp"``).
    ``example_inputs`` (and ``example_kwargs``) are one global batch, ``target`` the global
    target; the loss is ``loss_fn(output, target)`` (``loss_fn(output)`` without a target; by
    default the mean square of the outputs) and must be a mean or a sum over the batch rows.
    ``tol``: the largest scaled error accepted (default 1e-4, 2e-2 for 16-bit floats).
    The ranks are threads of this process unless the plan or the model needs processes
    (collective matmuls send point to point, which the threaded process group cannot; dropout
    needs a random generator per rank) or ``spawn=True`` asks for them (``autopar.launch.run``:
    ``model`` and ``loss_fn`` must pickle, and patches made in this process do not reach them);
    ``spawn=False`` refuses those plans instead. ``timeout`` bounds the ranks' run in seconds."""
    axes = _axes(mesh)
    plan = Plan.parse(plan) if isinstance(plan, str) and plan != "auto" else plan
    if not isinstance(plan, Plan):
        raise ValueError(f"verify takes a concrete plan (an autopar.Plan or its text), got {plan!r}; "
                         "autopar.plan(...) chooses one")
    if plan.pp_schedule is not None:
        raise NotImplementedError(f"verify compares plans without a pipeline; {plan} has pp_schedule="
                                  f"{plan.pp_schedule!r} (its stages run with send/recv, which the threaded process "
                                  "group lacks). Verify the plan without pp, e.g. its dp and tp part")
    plan.check_mesh(Mesh(virtual=True, **axes))
    with torch.random.fork_rng(devices=[]):      # the seeding below leaves the caller's generator alone
        return _verify(model, axes, plan, tuple(example_inputs), dict(example_kwargs or {}), target, loss_fn,
                       tol, spawn, timeout, seed)


def _verify(model, axes, plan, args, kwargs, target, loss_fn, tol, spawn, timeout, seed) -> VerifyReport:
    ref = _reference(model, axes, plan, args, kwargs, target, loss_fn, seed)
    needs = ("its collective matmuls send point to point, which the threaded process group cannot"
             if plan.collective_matmul else
             f"{type(model).__name__} draws dropout masks, and threads would share one random generator"
             if ref.random else "")
    if spawn is False and needs:
        raise ValueError(f"verify(spawn=False) runs the ranks as threads, but {needs}: pass spawn=True or leave "
                         "spawn unset" + (", or verify model.eval()" if ref.random else ""))
    spawn = bool(spawn or needs)
    world = math.prod(axes.values())
    job = (model, axes, plan, args, kwargs, target, loss_fn, ref.logical, seed)
    if spawn:
        records = run_processes(_rank_job, world, *job, timeout=timeout)
    else:
        copies = [copy.deepcopy(model) for _ in range(world)]   # compile flips train/eval on its model
        records = run_threads(_rank_job_copy, world, copies, *job[1:], timeout=timeout)
    records = sorted(records, key=lambda r: tuple(r.coords[a] for a in axes))   # rank 0 first
    report = _compare(ref, records, axes, plan, tol)
    report.ranks = "processes" if spawn else "threads"
    return report


def _rank_job_copy(copies, *rest) -> _RankRecord:
    """``_rank_job`` on this thread's own copy of the model."""
    return _rank_job(copies[dist.get_rank()], *rest)
