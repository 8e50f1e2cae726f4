"""What one rank computes, keeps and sends, read from the compiled graph: the cost model's input.

``profile`` runs the shard and collectives passes on a copy of the captured graph for a virtual
mesh (no processes; a meta-device model captures without memory), then walks the annotated
graph once. Every node is put in a *group*:
a numbered layer (``blocks.3``: the first numbered module on its path), or ``pre`` / ``post``
for what runs before the first and after the last layer. Per group it records, for this
rank's slice:

- forward FLOPs (``autopar.ops.node_flops``, divided along the axes the node's work is split
  over) and the bytes its non-view ops read and write (the roofline's memory term);
- activation bytes autograd keeps for backward, by the saved-tensor table (``cost.node_costs``),
  each tensor counted once (views resolve to the tensor they view);
- the tensor-parallel collectives, forward and the ones autograd runs in backward;
- its parameters' local element counts, and which of them backward reads (ZeRO-3 gathers
  those again).

Layers whose ops and shapes are equal share a *signature*, so a planner evaluates a
repeated block once and multiplies.

What is read off each node (its local bytes, what autograd keeps of it, the collectives it
causes) is ``cost.node_costs``'s.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import fx

from autopar import meta, passes
from autopar.capture import spec_copies_quiet
from autopar.context import CompileContext, layer_key
from autopar.mesh import Mesh
from autopar.ops import ATTENTION, MATMULS, VIEWS, node_flops
from autopar.passes.analysis import batch_dependent
from autopar.planspec import Plan

from .node_costs import (READ_BACK, computing_users, heads_of, mark_flash, needing_grad, node_bytes, node_op,
                         params_read, root_of, rows_of, saved_by, signature_of, split_factor, tp_comm)

__all__ = ["GroupCost", "Profile", "profile", "is_layer", "layer_of", "repeated_stack", "truncated", "expand", "PROFILED_BLOCKS"]


def layer_of(group: str) -> str:
    """The group a part cut off by a pipeline stage belongs to (``blocks.0/1`` -> ``blocks.0``)."""
    return group.split("/")[0]


def is_layer(group: str) -> bool:
    """Whether a group is (part of) a numbered layer rather than what runs before or after them
    (``pre``, ``post``, or a part of either cut off by a pipeline stage: ``pre/1``)."""
    return layer_of(group) not in ("pre", "post")


@dataclass
class GroupCost:
    """One group's costs on one rank, at the profile's rows."""
    name: str
    flops: float = 0.0                 # forward FLOPs
    bytes_moved: float = 0.0           # forward bytes read + written by non-view ops
    saved: float = 0.0                 # activation bytes kept for backward
    saved_quadratic: float = 0.0       # the part that is a·s² attention scores (selective recompute)
    saved_after_core: float = 0.0      # the part kept by ops after the group's attention (freed in
                                       # backward before its attention core is recomputed)
    matmul_flops: float = 0.0          # forward FLOPs of matmuls with a parameter weight (the W of zero-bubble)
    attention_flops: float = 0.0       # forward FLOPs of attention (what selective recomputation redoes)
    dense_flops: float = 0.0           # forward FLOPs of every matmul (weights and activations alike)
    matmul_dtype: Optional[torch.dtype] = None   # the dtype most of the group's matmul and attention FLOPs
                                       # run in (the device's peak for it: ``Device.matmul_peak``);
                                       # None: 16-bit (a group built by hand)
    pointwise_bytes: float = 0.0       # forward bytes read + written by the ops neither matmul nor attention
    attention_heads: float = 0.0       # (batch row, head) slices the attention kernels run over
    tp_forward: list = field(default_factory=list)    # (kind, bytes per rank, scales with the batch) on tp
    tp_backward: list = field(default_factory=list)
    params: dict = field(default_factory=dict)        # canonical name -> local shape (after tp)
    param_bytes: dict = field(default_factory=dict)   # canonical name -> local bytes
    read_by_backward: set = field(default_factory=set)   # parameters this group's backward reads
    reads: set = field(default_factory=set)               # parameters this group reads
    out_bytes: float = 0.0             # bytes of what leaves the group (a pipeline cut after it)
    cross_bytes: float = 0.0           # bytes of everything made up to the group's end and read after it
                                       # (what a pipeline stage ending with the group sends)
    max_value: float = 0.0             # bytes of the group's largest activation (backward's working set)
    final_bytes: float = 0.0           # bytes of the model outputs this group produces
    w_stash: float = 0.0               # bytes a split backward keeps from B to W: each weight matmul's
                                       # input and output gradient (runtime.wgrad)
    ops: int = 0                       # ops the forward dispatches (views included: each costs a dispatch)
    op_names: dict = field(default_factory=dict)   # op name -> how many of ``ops`` it is (each op's dispatch is
                                       # weighed by ``Device.op_weights``: ``cost.compute.dispatch_ops``)
    weight_matmuls: int = 0            # matmuls with a parameter weight (each a W a zero-bubble schedule defers)
    signature: tuple = ()

    def scaled(self, k: float) -> "GroupCost":
        """The same group at k times the batch rows: activation-proportional costs scale."""
        g = copy.copy(self)
        g.flops, g.bytes_moved, g.saved = self.flops * k, self.bytes_moved * k, self.saved * k
        g.saved_quadratic, g.matmul_flops, g.out_bytes = self.saved_quadratic * k, self.matmul_flops * k, self.out_bytes * k
        g.cross_bytes = self.cross_bytes * k
        g.saved_after_core = self.saved_after_core * k
        g.attention_flops, g.dense_flops = self.attention_flops * k, self.dense_flops * k
        g.pointwise_bytes, g.attention_heads = self.pointwise_bytes * k, self.attention_heads * k
        g.max_value, g.final_bytes, g.w_stash = self.max_value * k, self.final_bytes * k, self.w_stash * k
        g.tp_forward = [(kind, b * k if sc else b, sc) for kind, b, sc in self.tp_forward]
        g.tp_backward = [(kind, b * k if sc else b, sc) for kind, b, sc in self.tp_backward]
        return g


@dataclass
class Profile:
    """A model's per-group costs for one rank of a tensor-parallel group of size ``tp``
    (sequence parallel if ``sp``), captured at ``rows`` batch rows."""
    tp: int
    sp: bool
    rows: int
    groups: list[GroupCost]
    tied: list = field(default_factory=list)   # parameters read by more than one group
    shapes: dict = field(default_factory=dict)  # parameter -> local shape (after tp)
    heads: int = 0                              # attention heads (the planner's tp must divide them)
    stage_starts: tuple = ()                    # the index in ``groups`` where each pipeline stage starts,
                                                # when the profile was cut as the pipeline pass cuts

    @property
    def layers(self) -> list[GroupCost]:
        return [g for g in self.groups if is_layer(g.name)]

    @property
    def param_bytes(self) -> int:
        """Bytes per element of the trainable parameters as the graph holds them (the model's
        dtype, or under mixed precision the compute copy's); 4 for a model without any."""
        nbytes = sum(b for g in self.groups for b in g.param_bytes.values())
        elements = sum(math.prod(shp) for g in self.groups for shp in g.params.values())
        return max(1, round(nbytes / elements)) if elements else 4

    def signatures(self) -> dict:
        """signature -> number of layers that have it (repeated blocks solved once)."""
        out: dict = {}
        for g in self.layers:
            out[g.signature] = out.get(g.signature, 0) + 1
        return out


CONTEXT_READ = ("params", "in_spec", "out_spec", "constant_inputs", "head_policy")
"""the fields of the compile's context ``profile`` reads (what capture filled in)"""


def copy_captured(gm: fx.GraphModule, ctx0: CompileContext, ctx: CompileContext, memo: dict) -> fx.GraphModule:
    """A copy of the captured graph ``gm`` (``memo``: what its tensors become), with the fields of
    ``ctx0`` that ``profile`` reads (``CONTEXT_READ``) copied into ``ctx``: the graph and the
    context as capture left them, which the passes then rewrite."""
    with spec_copies_quiet():
        copied = copy.deepcopy(gm, memo)
        for f in CONTEXT_READ:
            setattr(ctx, f, copy.copy(getattr(ctx0, f)))
    return copied


def profile(gm: fx.GraphModule, ctx0: CompileContext, *, tp: int = 1, sp: bool = False, flash: bool = True,
            tp_layout: tuple = (), vocab_parallel: Optional[bool] = None, dropout_math: bool = False,
            stage_starts: tuple = ()) -> Profile:
    """The per-group costs of the captured logical graph ``gm`` (with the context capture filled,
    ``ctx0``; neither is changed: the passes run on a copy) on one rank of a tp group of size
    ``tp`` (see the module docstring). ``flash``: attention runs as a fused kernel (no a·s²
    probabilities kept; ``dropout_math``: but attention with dropout keeps them, as autopar's
    runtime does, see ``mark_flash``). LM heads are laid out by ``vocab_parallel`` or ``ctx0.head_policy``,
    as the compile lays them out. ``stage_starts``: the names of the nodes where pipeline stages
    1, 2, ... start (``passes.stage_bounds``); a group a cut falls in is split there (its later
    part named ``<group>/<stage>``) and ``Profile.stage_starts`` says where each stage starts."""
    plan = Plan(tp=tp > 1, sp=sp and tp > 1, tp_layout=tp_layout if tp > 1 else (),
                vocab_parallel=vocab_parallel if tp > 1 else None)
    mesh = Mesh(tp=tp, virtual=True) if tp > 1 else Mesh(dp=1, virtual=True)
    ctx = CompileContext(mesh=mesh, plan=plan)
    # the passes below rewrite the graph, never a tensor: the copy shares the model's tensors
    gm = copy_captured(gm, ctx0, ctx, {id(t): t for t in (*gm.parameters(), *gm.buffers())})
    rows = rows_of(gm)
    # on the logical graph: which layer each parameter belongs to, who reads it, what backward reads
    logical = _logical_groups(gm)
    first_groups = _split_at(logical, stage_starts)
    readers, read_back = {}, {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.meta.get(meta.PARAM) in ctx.params:
            name = node.meta[meta.PARAM]
            for u in node.users:
                readers.setdefault(name, set()).add(logical.get(u, "pre"))
            for u in computing_users(node):
                if node_op(u) in READ_BACK:
                    read_back.setdefault(name, set()).add(logical.get(u, "pre"))
    order0 = list(dict.fromkeys(logical.values()))
    owner_of = {name: layer_key(name) or min(readers.get(name, {"pre"}), key=order0.index)
                for name in ctx.params}
    if first_groups:     # a layer cut by a stage: each parameter is the first part's that reads it
        owner_of = {name: g if g in readers.get(name, (g,)) else min(readers[name], key=order0.index)
                    for name, g in owner_of.items()}
    batch_before = batch_dependent(gm.graph)
    mark_flash(gm, flash, dropout_math)
    gm = passes.shard(gm, ctx)
    if tp > 1:
        gm = passes.collectives(gm, ctx)
    batch = batch_dependent(gm.graph) | batch_before
    grad = needing_grad(gm.graph, ctx.params)
    groups: dict[str, GroupCost] = {g: GroupCost(g) for g in order0}
    order: list[str] = list(order0)
    members: dict[str, list] = {g: [] for g in order0}
    where: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        if node.op in ("output", "get_attr"):
            continue
        g = logical.get(node)
        if g is None:      # inserted by a pass: with the parameters or the value it reads
            params = params_read(node)
            ins = [where[a] for a in node.all_input_nodes if a in where and logical.get(a)]
            g = owner_of.get(params[0], "pre") if params else (ins[0] if ins else "pre")
        where[node] = g
        members[g].append(node)
    counted: set = set()
    by_dtype: dict = {}        # group -> {dtype: matmul and attention FLOPs}
    stashed: set = set()       # matmul inputs a split backward keeps for W, counted once
    cored: set = set()         # groups whose attention forward has run (in graph order)
    for node in gm.graph.nodes:
        if node not in where:
            continue
        g = groups[where[node]]
        info = node.meta.get(meta.COMM)
        if info is not None and info.axis == "tp":
            if node in batch:     # a gathered activation is part of backward's working set too
                g.max_value = max(g.max_value, node_bytes(node, mesh))
            f, b = tp_comm(node, info, plan.sp)
            scales = node in batch       # parameter syncs and position-table slices do not
            g.tp_forward += [(kind, nb, scales) for kind, nb in f]
            g.tp_backward += [(kind, nb, scales) for kind, nb in b]
            if meta.LOWER not in node.meta:      # a lowered op (vocab-parallel loss) computes too
                continue
        if node.op != "call_function" or node not in batch:
            continue
        split = split_factor(node, mesh)
        flops = node_flops(node) / split
        name = node_op(node)
        g.ops += 1
        g.op_names[name] = g.op_names.get(name, 0) + 1
        if name not in VIEWS:
            g.max_value = max(g.max_value, node_bytes(node, mesh))
        g.flops += flops
        if name in MATMULS and any(a.op == "get_attr" or a not in batch for a in node.all_input_nodes):
            g.matmul_flops += flops
            g.weight_matmuls += 1
            g.w_stash += node_bytes(node, mesh)          # its output's gradient, kept for W
            for a in node.all_input_nodes:            # and its input (once per tensor)
                r = root_of(a, plan.sp)
                if a in batch and r in batch and r not in stashed:
                    stashed.add(r)
                    g.w_stash += node_bytes(r, mesh)
        if name in MATMULS:
            g.dense_flops += flops
        if (name in MATMULS or name in ATTENTION) and isinstance(node.meta.get(meta.VAL), torch.Tensor):
            per = by_dtype.setdefault(g.name, {})
            dtype = node.meta[meta.VAL].dtype
            per[dtype] = per.get(dtype, 0.0) + flops
        if name in ATTENTION:
            g.attention_flops += flops
            q, kv = node.args[0].meta[meta.VAL], node.args[1].meta[meta.VAL]
            g.attention_heads += flops / (4 * q.shape[-2] * kv.shape[-2] * q.shape[-1])
        if name not in VIEWS and flops:
            moved = node_bytes(node, mesh) + sum(node_bytes(a, mesh) for a in node.all_input_nodes)
            g.bytes_moved += moved
            if name not in MATMULS and name not in ATTENTION:
                g.pointwise_bytes += moved
        keep, extra, quadratic = saved_by(node, batch, grad)
        g.saved += extra / split
        if quadratic:
            g.saved_quadratic += extra / split
        after_core = where[node] in cored and not quadratic
        if after_core:
            g.saved_after_core += extra / split
        if name in ATTENTION:
            cored.add(where[node])
        for a in keep:
            r = root_of(a, plan.sp)
            if r in counted or r not in batch:
                continue
            counted.add(r)
            owner = groups[where.get(r, where[node])]
            owner.saved += node_bytes(r, mesh)
            if after_core and owner is g:
                g.saved_after_core += node_bytes(r, mesh)
    shapes: dict = {}
    for name, info in ctx.params.items():
        if info.is_buffer or not info.requires_grad:
            continue
        owner = owner_of[name]
        shape = tuple(ctx.local_shape(name)) if ctx.tp_params.get(name) is not None else tuple(info.shape)
        groups[owner].params[name] = shape
        groups[owner].param_bytes[name] = math.prod(shape) * info.dtype.itemsize
        shapes[name] = shape
        for gname in readers.get(name, ()):
            groups[gname].reads.add(name)
        for gname in read_back.get(name, ()):
            groups[gname].read_by_backward.add(name)
    for gname, per in by_dtype.items():
        groups[gname].matmul_dtype = max(per, key=per.get)
    order = [g for g in order if members[g] or groups[g].params]
    # what crosses each group boundary (a pipeline cut after the group)
    pos = {g: i for i, g in enumerate(order)}
    for i, gname in enumerate(order):
        out = 0.0
        for node in members[gname]:
            if node in batch and any(pos.get(where.get(u), -1) > i for u in node.users):
                out += node_bytes(node, mesh)
        groups[gname].out_bytes = out
        groups[gname].signature = signature_of(members[gname])
    last_reader: dict = {}
    for node in gm.graph.nodes:
        if node in logical and node in batch and node.op == "call_function":   # as the pass counts: logical ops
            last_reader[node] = max((pos.get(where.get(u), len(order)) if u.op != "output" else len(order)
                                     for u in node.users), default=-1)
    for node, last in last_reader.items():     # it crosses every cut from its group's end to its last reader
        for i in range(pos[where[node]], last):
            groups[order[i]].cross_bytes += node_bytes(node, mesh)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    for a in out_node.all_input_nodes:
        if a in where and a in batch:
            groups[where[a]].final_bytes += node_bytes(a, mesh)
    tied = [n for n, r in readers.items() if len(r) > 1 and n in ctx.params and not ctx.params[n].is_buffer]
    return Profile(tp=tp, sp=plan.sp, rows=rows, groups=[groups[g] for g in order], shapes=shapes, tied=tied,
                   heads=heads_of(gm), stage_starts=tuple(pos[g] for g in first_groups))


def _split_at(logical: dict, starts: tuple) -> list:
    """Split the groups of ``logical`` (node -> group, in graph order; changed in place) at the
    nodes named in ``starts``: from each such node on, a group that began in an earlier stage
    continues as ``<group>/<stage>``. Returns the group each of stages 0, 1, ... starts with."""
    if not starts:
        return []
    firsts, stage, begun = [], 0, {}
    for node in logical:
        if stage < len(starts) and node.name == starts[stage]:
            stage += 1
        base = logical[node]
        begun.setdefault(base, stage)
        logical[node] = base if begun[base] == stage else f"{base}/{stage}"
        if len(firsts) == stage:
            firsts.append(logical[node])
    if stage != len(starts):
        missing = starts[stage]
        raise ValueError(f"stage start {missing!r} is not a node of the profiled graph (or is out of order)")
    return firsts


def _logical_groups(gm: fx.GraphModule) -> dict:
    """node -> group of the captured (logical) graph, by the first numbered module on each
    node's path; ``pre`` before the first layer, ``post`` after."""
    out, seen_layer = {}, False
    for node in gm.graph.nodes:
        if node.op in ("output", "get_attr"):
            continue
        key = None
        for path, _ in reversed(list((node.meta.get("nn_module_stack") or {}).values())):
            key = layer_key(path)
            if key:
                break
        if key is None:
            key = "post" if seen_layer else "pre"
        else:
            seen_layer = True
        out[node] = key
    return out


# ---- a repeated block profiled once ---------------------------------------------------------------

PROFILED_BLOCKS = 2     # blocks of a repeated stack captured: the first, and one that stands for the rest


def repeated_stack(model: torch.nn.Module) -> Optional[tuple[str, int]]:
    """The model's stack of repeated blocks: the path of the ``nn.ModuleList`` (or
    ``nn.Sequential``) with the most children, all of one class with equal parameter names and
    shapes, and its length; None when there is none longer than ``PROFILED_BLOCKS``."""
    best = None
    for path, m in model.named_modules():
        if not isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)) or len(m) <= PROFILED_BLOCKS:
            continue
        kids = list(m)
        first = [(n, tuple(p.shape)) for n, p in kids[0].named_parameters()]
        if all(type(k) is type(kids[0]) and [(n, tuple(p.shape)) for n, p in k.named_parameters()] == first
               for k in kids[1:]) and (best is None or len(kids) > best[1]):
            best = (path, len(kids))
    return best


def truncated(model: torch.nn.Module, path: str, keep: int = PROFILED_BLOCKS) -> torch.nn.Module:
    """A shallow copy of ``model`` whose stack at ``path`` holds its first ``keep`` blocks (the
    blocks and every other module are the model's own; nothing is copied but the modules on
    the path)."""
    parts = path.split(".") if path else []
    root = _shallow(model)
    m = root
    for name in parts[:-1]:
        child = _shallow(m._modules[name])
        m._modules[name] = child
        m = child
    stack = m._modules[parts[-1]] if parts else root
    short = type(stack)(*list(stack)[:keep]) if isinstance(stack, torch.nn.Sequential) else \
        torch.nn.ModuleList(list(stack)[:keep])
    if parts:
        m._modules[parts[-1]] = short
        return root
    return short


def _shallow(m: torch.nn.Module) -> torch.nn.Module:
    out = copy.copy(m)
    out._modules = dict(m._modules)
    return out


def expand(p: Profile, stem: str, n: int) -> Profile:
    """The profile of the model with ``n`` blocks at ``stem`` from ``p``, the profile with
    ``PROFILED_BLOCKS``: block 1 stands for blocks 1 .. n-1 (renamed), block 0 and the groups
    before and after stay."""
    template = next(g for g in p.groups if g.name == f"{stem}.1")
    old = f"{stem}.1."
    groups = []
    for g in p.groups:
        if g.name == template.name:
            groups += [_renamed(template, old, f"{stem}.{i}.", f"{stem}.{i}") for i in range(1, n)]
        else:
            groups.append(g)
    shapes = dict(p.shapes)
    for name, shape in p.shapes.items():
        if name.startswith(old):
            for i in range(2, n):
                shapes[f"{stem}.{i}." + name[len(old):]] = shape
    return dataclasses.replace(p, groups=groups, shapes=shapes)


def _renamed(g: GroupCost, old: str, new: str, name: str) -> GroupCost:
    def ren(x: str) -> str:
        return new + x[len(old):] if x.startswith(old) else x
    out = copy.copy(g)
    out.name = name
    out.params = {ren(k): v for k, v in g.params.items()}
    out.param_bytes = {ren(k): v for k, v in g.param_bytes.items()}
    out.read_by_backward = {ren(k) for k in g.read_by_backward}
    out.reads = {ren(k) for k in g.reads}
    out.tp_forward, out.tp_backward = list(g.tp_forward), list(g.tp_backward)
    return out
