"""LM heads under tensor parallelism: found in the graph, and described by what each of their two
``tp`` layouts computes, holds and moves, so that a policy (the cost model's) can choose.

An *LM head* is a parameter product over a vocabulary whose logits reach only the graph's
outputs and cross-entropies (through views and casts): its weight is the table the embedding
looks up (tied), or its logits feed a cross-entropy in the graph, or its weight has the shape
of a table the graph looks up (an untied ``lm_head`` beside its ``wte``). Any other product
follows Megatron's rules in ``passes/tensor_parallel.py``.

Its two layouts along ``tp`` (t ranks, N = b·s tokens on this rank, h features, V words):

whole   every rank holds the table and computes all N·V logits and their gradient: 6·N·h·V
        FLOPs; a tied table's lookup is local; the loss runs on the whole logits.
split   the weight split along the vocabulary (Megatron's VocabParallelEmbedding and its
        column-parallel head; ``chunk(V, t)`` words on a rank): 6·N·h·chunk(V, t) FLOPs.
        A tied table's lookup is vocab-parallel (each rank looks up the tokens in its rows,
        zeros elsewhere: P(sum), all-reduced, b·s·h; reduce-scattered under sequence
        parallelism); the head reads its input whole (f: its gradient all-reduced, b·s·h; under
        sequence parallelism its input is all-gathered, its gradient reduce-scattered, and the
        input gathered again in backward for the weight gradient, as every column product's);
        a cross-entropy on the split logits is vocab-parallel (the max, the sum of exp and the
        target's logit all-reduced: three fp32 values per row, ``autopar.runtime.tpcomm``);
        logits the graph returns are all-gathered there, N·chunk(V, t)·t elements (backward takes
        the rank's slice: no communication).

A ``log_softmax`` along the vocabulary read only by ``nll_loss`` is the same cross-entropy
(``cross_entropy_loss`` is defined as that pair): a split head folds the pair into one
``cross_entropy_loss`` node, which the tensor-parallel pass lowers.

The gradient of a split tied table is the sum of its two readers' on the rank's rows: the
lookup scatters into the rows of the tokens it owns (the others are masked to zero), the head's
product gives the rows of its logits; autograd adds them, and no rank needs another's rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import fx

from autopar import meta
from autopar.context import CompileContext
from autopar.sizes import chunk, ring_bytes

from .analysis import ParamMatmul, param_matmul, param_name

__all__ = ["Head", "HeadChoice", "HeadCost", "find_heads", "decide_head", "fold_losses", "without_cost_model",
           "head_note", "tied_head_layouts"]

aten = torch.ops.aten

# ops the logits pass through, the vocabulary staying their last dim
_THROUGH = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.contiguous.default,
            aten.clone.default, aten.alias.default, aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default,
            aten.slice.Tensor}
_LOG_SOFTMAX = {aten.log_softmax.int, aten._log_softmax.default}
_NLL = {aten.nll_loss.default, aten.nll_loss_nd.default}
CE_VALUES = ("max", "sum of exp", "target logit")
"""What a vocab-parallel cross-entropy all-reduces: one fp32 value per row each."""


@dataclass(frozen=True)
class HeadCost:
    """One layout of an LM head on one rank, per training step."""
    flops: float
    """forward and backward FLOPs of the head's product (3 products of 2·N·h·words)"""
    logits_bytes: float
    """bytes of the logits the rank holds (their gradient as many again)"""
    collectives: tuple
    """``(kind, buffer bytes, phase, what)`` on tp around the head and its lookup (the rest of the
    model moves the same under both layouts)"""
    t: int

    @property
    def tp_bytes(self) -> float:
        """Bytes the rank sends on tp (ring algorithms, ``autopar.sizes.ring_bytes``)."""
        return sum(ring_bytes(kind, nbytes, self.t) for kind, nbytes, _, _ in self.collectives)


@dataclass(frozen=True)
class HeadChoice:
    """An LM head as the policy sees it: enough to price both layouts."""
    weight: str
    tied: bool
    """the embedding looks up the same table"""
    losses: int
    """cross-entropies in the graph that read the logits (vocab-parallel when split)"""
    gathered: bool
    """the graph returns the logits (or a view of them): split, they are gathered there"""
    tokens: int
    """rows of logits on this rank (b·s over dp)"""
    hidden: int
    vocab: int
    itemsize: int
    """bytes of one element of the head's input and logits"""
    gathered_itemsize: int
    """bytes of one element of the logits where they are gathered (after a cast)"""
    axes: tuple
    """the mesh's ``(axis, size)`` pairs (the cost model finds the tp link from them)"""
    sp: bool

    @property
    def t(self) -> int:
        return dict(self.axes).get("tp", 1)

    def describe(self) -> str:
        parts = ["tied to the embedding" if self.tied else "untied"]
        if self.losses:
            parts.append("cross-entropy in the graph")
        if self.gathered:
            parts.append("logits returned")
        return ", ".join(parts)

    def cost(self, split: bool) -> HeadCost:
        """This rank's FLOPs, logits and tp collectives under one layout (the module docstring)."""
        t, n, h, e = self.t, self.tokens, self.hidden, self.itemsize
        words = chunk(self.vocab, t) if split else self.vocab
        act = float(n * h * e)
        comm = []
        if split:
            if self.tied:
                comm += ([("reduce_scatter", act, "forward", "lookup P(sum) -> S(seq)"),
                          ("all_gather", act, "backward", "lookup gradient")] if self.sp else
                         [("all_reduce", act, "forward", "lookup P(sum) -> R")])
            comm += ([("all_gather", act, "forward", "head input S(seq) -> R"),
                      ("reduce_scatter", act, "backward", "head input gradient"),
                      ("all_gather", act, "backward", "head input re-gathered for the weight gradient")]
                     if self.sp else [("all_reduce", act, "backward", "f: head input gradient")])
            comm += [("all_reduce", float(n * 4), "forward", f"cross-entropy {v}")
                     for _ in range(self.losses) for v in CE_VALUES]
            if self.gathered:
                comm.append(("all_gather", float(n * words * t * self.gathered_itemsize), "forward",
                             "logits S(-1) -> R"))
        elif self.sp:
            if self.tied:
                comm.append(("all_gather", act, "backward", "lookup R -> S(seq) gradient"))
            comm.append(("all_gather", act, "forward", "head input S(seq) -> R"))
        return HeadCost(6.0 * n * h * words, float(n * words * e), tuple(comm), t)


Policy = Callable[[HeadChoice], tuple]
"""``policy(choice) -> (split, why)``: the cost model's (``cost.lm_head.head_policy``)."""


@dataclass(frozen=True)
class Head:
    """An LM head found in the graph."""
    matmul: fx.Node
    pm: ParamMatmul
    weight: str
    bias: Optional[str]
    lookup: Optional[fx.Node]
    """the embedding that reads the same table (tied), else None"""
    losses: tuple
    """the cross-entropy nodes (or ``nll_loss`` after a ``log_softmax``) that read the logits"""
    choice: HeadChoice


def find_heads(gm: fx.GraphModule, ctx: CompileContext) -> list[Head]:
    """The graph's LM heads, in graph order."""
    readers: dict[str, list] = {}
    tables = set()
    for node in gm.graph.nodes:
        name = param_name(node, ctx)
        if name is not None:
            readers.setdefault(name, []).extend(node.users)
        if node.target == aten.embedding.default and param_name(node.args[0], ctx) is not None:
            tables.add(tuple(node.args[0].meta[meta.VAL].shape))
    heads = []
    for node in gm.graph.nodes:
        pm = param_matmul(node, ctx)
        if pm is None:
            continue
        weight = param_name(pm.weight, ctx)
        users = readers[weight]
        lookups = [u for u in users if _plain_lookup(u) and u.args[0].meta.get(meta.PARAM) == weight]
        tied = len(users) == 2 and len(lookups) == 1 and node in users
        bias = param_name(pm.bias, ctx) if pm.bias is not None else None
        if (len(users) > 1 and not tied) or (bias is not None and len(readers[bias]) > 1):
            continue
        wshape = pm.weight.meta[meta.VAL].shape
        vocab = wshape[pm.out_dim]
        found = _consumers(node, vocab)
        if found is None:
            continue
        losses, gathered, gathered_itemsize = found
        if not (tied or losses or (gathered and (vocab, wshape[pm.in_dim]) in tables)):
            continue
        out = node.meta[meta.VAL]
        dp = ctx.mesh.axis_size("dp")
        choice = HeadChoice(weight, tied, len(losses), gathered, chunk(out.numel() // vocab, dp), wshape[pm.in_dim],
                            vocab, out.element_size(), gathered_itemsize, tuple(ctx.mesh.axes.items()), ctx.plan.sp)
        heads.append(Head(node, pm, weight, bias, lookups[0] if tied else None, tuple(losses), choice))
    return heads


def _plain_lookup(node: fx.Node) -> bool:
    """``embedding(table, indices)`` without scale_grad_by_freq or sparse gradients."""
    a = node.args
    return node.target == aten.embedding.default and not any(a[3:5]) and not node.kwargs


def _consumers(node: fx.Node, vocab: int):
    """(cross-entropies reading the logits, whether the graph returns them, bytes of an element of
    what it returns); None when another op reads them (an ordinary product, or a head whose
    logits are transformed first: kept to Megatron's rules)."""
    losses, gathered, itemsize, todo = [], False, 0, [node]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u.target is aten._assert_tensor_metadata.default:
                continue
            val = u.meta.get(meta.VAL)
            if u.target in _THROUGH and isinstance(val, torch.Tensor) and val.dim() and val.shape[-1] == vocab \
                    and val.dtype.is_floating_point and not _slices_last(u):
                todo.append(u)
            elif _plain_ce(u, n):
                losses.append(u)
            elif _log_softmax_nll(u, n) is not None:
                losses.append(_log_softmax_nll(u, n))
            elif u.op == "output":
                gathered, itemsize = True, max(itemsize, n.meta[meta.VAL].element_size())
            else:
                return None
    return losses, gathered, itemsize


def _slices_last(node: fx.Node) -> bool:
    if node.target is not aten.slice.Tensor:
        return False
    ndim = node.args[0].meta[meta.VAL].dim()
    return (node.args[1] if len(node.args) > 1 else 0) % ndim == ndim - 1


def _plain_ce(node: fx.Node, logits: fx.Node) -> bool:
    """``cross_entropy_loss`` of (N, V) logits with class-index targets, no class weights and no
    label smoothing: what the vocab-parallel cross-entropy computes."""
    a = node.args
    return (node.target == aten.cross_entropy_loss.default and a[0] is logits and a[1] is not logits
            and logits.meta[meta.VAL].dim() == 2 and a[1].meta[meta.VAL].dim() == 1
            and (len(a) < 3 or a[2] is None) and (len(a) < 6 or a[5] == 0.0) and not node.kwargs)


def _log_softmax_nll(node: fx.Node, logits: fx.Node) -> Optional[fx.Node]:
    """The ``nll_loss`` when ``node`` is a ``log_softmax`` of (N, V) logits along V read only by
    an ``nll_loss`` without class weights."""
    if node.target not in _LOG_SOFTMAX or node.args[0] is not logits or logits.meta[meta.VAL].dim() != 2:
        return None
    dtype = node.args[2] if node.target == aten.log_softmax.int and len(node.args) > 2 else node.kwargs.get("dtype")
    if node.args[1] not in (1, -1) or dtype is not None:
        return None
    users = list(node.users)
    if len(users) != 1:
        return None
    nll = users[0]
    a = nll.args
    if nll.target not in _NLL or a[0] is not node or a[1].meta[meta.VAL].dim() != 1 \
            or (len(a) > 2 and a[2] is not None) or nll.kwargs:
        return None
    return nll


def without_cost_model(choice: HeadChoice) -> tuple:
    """The choice where no cost model is at hand (passes run alone): Megatron's column-parallel
    rule for an untied head; a tied one split when its logits stay in the graph (the split then
    moves three values per row instead of the logits), else kept whole."""
    if not choice.tied:
        return True, "untied: column-parallel (no cost model at hand)"
    if choice.losses and not choice.gathered:
        return True, "its logits stay in the graph (no cost model at hand)"
    return False, "its logits leave the graph (no cost model at hand)"


def decide_head(head: Head, ctx: CompileContext) -> tuple:
    """``(split, why)``: ``Plan(vocab_parallel=...)`` if set, else the compile's policy
    (``ctx.head_policy``), else ``without_cost_model``. A vocabulary that leaves some rank without
    words is kept whole (an error when the plan asks for the split)."""
    c, t = head.choice, head.choice.t
    if c.vocab < t or chunk(c.vocab, t) * (t - 1) >= c.vocab:
        if ctx.plan.vocab_parallel:
            raise ValueError(f"{head.weight}: a vocabulary of {c.vocab} rows leaves some of tp={t} ranks without "
                             "rows; keep the table whole (Plan(vocab_parallel=False) or tp_layout 'R')")
        return False, f"{c.vocab} words leave some of tp={t} ranks without any"
    if ctx.plan.vocab_parallel is not None:
        return ctx.plan.vocab_parallel, f"Plan(vocab_parallel={ctx.plan.vocab_parallel})"
    policy = ctx.head_policy or without_cost_model
    return policy(c)


def fold_losses(gm: fx.GraphModule, head: Head) -> None:
    """Each ``nll_loss(log_softmax(x))`` of a split head becomes ``cross_entropy_loss(x)`` (the same
    arguments after the input), so that one node computes it vocab-parallel."""
    for nll in head.losses:
        if nll.target not in _NLL:
            continue
        ls = nll.args[0]
        nll.target = aten.cross_entropy_loss.default
        nll.args = (ls.args[0],) + tuple(nll.args[1:])
        if not ls.users:
            gm.graph.erase_node(ls)


def head_note(head: Head, split: bool, why: str) -> str:
    """The line ``dm.explain()`` shows for a head: which layout, and why."""
    how = "split along the vocabulary" if split else "kept whole"
    return f"lm head {head.weight} ({head.choice.describe()}): {how} over tp={head.choice.t}: {why}"


def tied_head_layouts(gm: fx.GraphModule, ctx: CompileContext) -> dict:
    """``{table: (placement text, explain line)}`` for each tied head, decided on the whole graph
    before a pipeline cuts it: the lookup and the head may fall in different stages, whose two
    copies of the table must be laid out alike along tp."""
    out = {}
    for head in find_heads(gm, ctx):
        if head.lookup is not None:
            split, why = decide_head(head, ctx)
            out[head.weight] = (f"S({head.pm.out_dim})" if split else "R", head_note(head, split, why))
    return out
