"""What the cost model's profile (``cost.profile``) reads off the nodes of the annotated graph.

Per node: its local bytes on this rank (``node_bytes``, its shards divided out), how many ways its
work is split (``split_factor``), what autograd keeps of it for backward (``saved_by``, the
saved-tensor table below), which nodes need a gradient (``needing_grad``), the tensor-parallel
collectives a communication node causes forward and backward (``tp_comm``), the ops that
compute with a parameter (``computing_users``) and the parameters an inserted node reads
(``params_read``); per graph: its batch rows, its attention heads, which attention runs fused
(``mark_flash``), and a group's signature (equal ops and shapes: a repeated block).

Saved tensors (what PyTorch's autograd formulas keep; derivatives.yaml): a matmul keeps its
activation inputs; layer/RMS norm keeps its input and per-row statistics (fp32); pointwise
nonlinearities keep their input; softmax keeps its output; dropout keeps a one-byte mask;
an embedding keeps its indices; attention keeps q, k, v, the output and per-row log-sum-exp
(flash / memory-efficient kernels) or, in the math form, the a·s² probabilities; losses
keep their input. Adds, views and copies keep nothing.
"""
from __future__ import annotations

import math
import operator

import torch
from torch import fx

from autopar import meta
from autopar.mesh import Mesh
from autopar.ops import ATTENTION, KEEP_INPUT, KEEP_OPERANDS, KEEP_OUTPUT, LOSSES, MATMULS, NORMS, VIEWS, op_name
from autopar.placement import Layout, Partial, Shard

__all__ = ["node_op", "local_numel", "split_factor", "node_bytes", "root_of", "broadcast_below", "saved_by", "needing_grad",
           "READ_BACK", "computing_users", "tp_comm", "signature_of", "mark_flash", "rows_of", "heads_of",
           "params_read"]


def node_op(node: fx.Node) -> str:
    """The op a call node runs (``autopar.ops.op_name`` of its target)."""
    return op_name(node.target)


def local_numel(val, layout, mesh: Mesh) -> float:
    n = float(val.numel())
    if not isinstance(layout, Layout):
        return n
    for axis, pl in layout.placements:
        if isinstance(pl, Shard):
            n /= mesh.axis_size(axis)
    return n


def split_factor(node: fx.Node, mesh: Mesh) -> float:
    """How many ways a node's work is divided on this rank: the largest split among its
    output and its inputs (a row-parallel matmul's output is Partial: work divided too)."""
    f = 1.0
    for x in [node] + [a for a in node.all_input_nodes]:
        lay = x.meta.get(meta.LAYOUT)
        if not isinstance(lay, Layout):
            continue
        k = 1.0
        for axis, pl in lay.placements:
            if isinstance(pl, (Shard, Partial)):
                k *= mesh.axis_size(axis)
        f = max(f, k)
    return f


def node_bytes(node: fx.Node, mesh: Mesh) -> float:
    val = node.meta.get(meta.VAL)
    if isinstance(val, torch.Tensor):
        return local_numel(val, node.meta.get(meta.LAYOUT), mesh) * val.element_size()
    if isinstance(val, (tuple, list)):
        lays = node.meta.get(meta.LAYOUT)
        lays = lays if isinstance(lays, (tuple, list)) else [None] * len(val)
        return sum(local_numel(v, lay, mesh) * v.element_size()
                   for v, lay in zip(val, lays) if isinstance(v, torch.Tensor))
    return 0.0


def root_of(node: fx.Node, sp: bool = False) -> fx.Node:
    """The tensor a chain of views reads (q, k, v split from one qkv product resolve to it).
    Under sequence parallelism a gathered column input is kept as its shard (and gathered
    again in backward), so the gather resolves to what it gathers."""
    seen = 0
    while node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node) and seen < 64 and (
            node_op(node) in VIEWS or (sp and node_op(node) == "tp_gather" and len(node.args) > 4 and node.args[4])):
        if node_op(node) in _COPYING_VIEWS and broadcast_below(node.args[0]):
            return node          # a reshape of a broadcast copies: its result is a tensor of its own
        node, seen = node.args[0], seen + 1
    return node


_COPYING_VIEWS = frozenset({"reshape", "flatten", "contiguous"})


def broadcast_below(node: fx.Node) -> bool:
    """Whether a chain of views under ``node`` broadcasts (an ``expand`` to more elements than it
    reads, as grouped-query attention repeats its key/value heads): then a reshape of it
    cannot be a view, and copies."""
    seen = 0
    while node.op == "call_function" and node_op(node) in VIEWS and node.args and isinstance(node.args[0], fx.Node) \
            and seen < 64:
        if node_op(node) == "expand":
            out, inp = node.meta.get(meta.VAL), node.args[0].meta.get(meta.VAL)
            if isinstance(out, torch.Tensor) and isinstance(inp, torch.Tensor) and out.numel() > inp.numel():
                return True
        node, seen = node.args[0], seen + 1
    return False


def saved_by(node: fx.Node, batch: set, grad: set) -> tuple[list, float, bool]:
    """(activation nodes whose value backward keeps, extra bytes the op keeps itself, whether
    the extra is attention scores) for one call_function node of the logical graph; ``grad``:
    the nodes that need a gradient (autograd records nothing for an op none of whose inputs do)."""
    name, args = node_op(node), [a for a in node.args if isinstance(a, fx.Node)]
    act = [a for a in args if a in batch]
    val = node.meta.get(meta.VAL)
    if node not in batch or node not in grad:
        return [], 0.0, False
    if name in KEEP_OPERANDS:
        a, b = (node.args + (None, None))[:2]
        keep = [a] if a in batch and b in grad else []      # for b's gradient (a quotient's: a / b**2)
        if b in batch and (a in grad or (name == "div" and b in grad)):
            keep.append(b)
        return keep, 0.0, False
    if name in MATMULS or name in LOSSES:
        return act, 0.0, False
    if name in NORMS:
        x = node.args[0].meta.get(meta.VAL)
        norm = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], (list, tuple)) else [x.shape[-1]]
        rows = x.numel() // max(1, math.prod(norm))
        stats = 2 if name in ("layer_norm", "native_layer_norm") else 1
        return act[:1], float(rows * 4 * stats), False
    if name in KEEP_OUTPUT:
        return [node], 0.0, False
    if name in KEEP_INPUT:
        return act, 0.0, False
    if name in ("dropout", "native_dropout", "feature_dropout"):
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        return [], (float(val.numel()) if p and train else 0.0), False
    if name in ("embedding", "tp_vocab_embedding"):
        idx = node.args[1]
        return ([idx] if isinstance(idx, fx.Node) and idx in batch else []), 0.0, False
    if name in ATTENTION:
        q = node.args[0].meta[meta.VAL]
        k = node.args[1].meta[meta.VAL]
        *b, s, _ = q.shape
        flash = node.meta.get(meta.FLASH, True)
        dropout = (node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)) or 0.0
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        act = act[:3] + ([mask] if isinstance(mask, fx.Node) and mask in batch else [])   # a mask is kept too
        if flash:
            return act + [node], float(math.prod(b) * s * 4), False
        probs = math.prod(b) * s * k.shape[-2]
        extra = probs * q.element_size() * (2 if dropout else 1) + (probs if dropout else 0)
        return act, float(extra), True
    return [], 0.0, False


def needing_grad(graph: fx.Graph, params: dict) -> set:
    """The nodes that need a gradient: the trainable parameters and every op that reads one of
    them or such an op's result."""
    out: set = set()
    for n in graph.nodes:
        if n.op == "get_attr":
            info = params.get(n.meta.get(meta.PARAM))
            if info is not None and info.requires_grad and not info.is_buffer:
                out.add(n)
        elif n.op in ("call_function", "call_module", "call_method") and any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


READ_BACK = MATMULS | NORMS | {"embedding", "mul", "div"}
"""Ops whose backward reads a parameter they take (autograd saves it: a product's other
gradient needs it), so that ZeRO-3 gathers the parameter again in backward; a sum's does not."""

_PASS_THROUGH = VIEWS | {"_to_copy", "clone"}


def computing_users(node: fx.Node) -> list:
    """The ops that compute with ``node``'s value, through views and dtype copies of it."""
    out, todo, seen = [], list(node.users), set()
    while todo:
        u = todo.pop()
        if u in seen:
            continue
        seen.add(u)
        if u.op == "call_function" and node_op(u) in _PASS_THROUGH:
            todo.extend(u.users)
        elif u.op == "call_function":
            out.append(u)
    return out


def tp_comm(node: fx.Node, info, sp: bool = False) -> tuple[list, list]:
    """Forward and backward tp collectives a comm node causes (autograd's conjugates)."""
    fwd, bwd = [], []
    if info.phase == "backward":
        bwd.append((info.kind, info.nbytes))
        return fwd, bwd
    fwd.append((info.kind, info.nbytes))
    name = node_op(node)
    if name == "tp_gather":
        varying = bool(node.args[4]) if len(node.args) > 4 else False
        if varying:
            bwd.append(("reduce_scatter", info.nbytes))
            if sp:      # the column input was kept as its shard: gathered again in backward
                bwd.append(("all_gather", info.nbytes))
    elif name == "tp_reduce_scatter":
        bwd.append(("all_gather", info.nbytes))
    return fwd, bwd


def signature_of(nodes: list[fx.Node]) -> tuple:
    sig = []
    for n in nodes:
        val = n.meta.get(meta.VAL)
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
        sig.append((node_op(n) if n.op == "call_function" else n.op, shape))
    return tuple(sig)


def mark_flash(gm: fx.GraphModule, flash: bool, dropout_math: bool = False) -> None:
    """Mark each attention node fused (flash / memory-efficient kernel) or math form.
    ``dropout_math``: attention with dropout runs the math form whatever the kernel, as
    autopar's runtime runs it (``runtime.rng.rng_sdpa`` applies the single-device mask to the
    probabilities); without, the fused kernel is assumed to drop out inside (Megatron's)."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and node_op(n) in ATTENTION:
            dropout = (n.args[4] if len(n.args) > 4 else n.kwargs.get("dropout_p", 0.0)) or 0.0
            n.meta[meta.FLASH] = flash and not (dropout_math and dropout)


def rows_of(gm: fx.GraphModule) -> int:
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            v = n.meta.get(meta.VAL)
            if isinstance(v, torch.Tensor) and v.dim():
                return int(v.shape[0])
    return 1


def heads_of(gm: fx.GraphModule) -> int:
    """The heads of the graph's first attention (its query is batch x heads x seq x head dim)."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and node_op(n) in ATTENTION:
            return int(n.args[0].meta[meta.VAL].shape[1])
    return 0


def params_read(node: fx.Node, depth: int = 0) -> list:
    """Canonical names of the parameters an inserted node reads (through a bucket's getitem:
    the parameter at that index)."""
    if node.op == "get_attr":
        return [node.meta[meta.PARAM]] if node.meta.get(meta.PARAM) else []
    if depth > 3 or node.op != "call_function":
        return []
    if node.target is operator.getitem and isinstance(node.args[1], int):
        src = node.args[0]
        attrs = [a for a in src.all_input_nodes if a.op == "get_attr" and a.meta.get(meta.PARAM)]
        if node.args[1] < len(attrs):
            return [attrs[node.args[1]].meta[meta.PARAM]]
    out = []
    for a in node.all_input_nodes:
        out += params_read(a, depth + 1)
    return out
