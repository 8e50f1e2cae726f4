"""shard: annotate every node with its layout, one placement per mesh axis.

The graph is the logical one, at global shapes. Parameters take the layout the plan stores
them in (ZeRO-3: ``dp:S(0)``, else ``dp:R``); inputs are split along the batch
(``dp:S(0)``). The batch shard is then followed through the graph with the sharding-rule
registry (``autopar.passes.rules``): each node takes the first strategy of its op that
accepts its inputs as they are laid out; that strategy's output placement is the node's
layout, and the strategy itself is kept in ``node.meta`` for the localize pass.

On a dp axis of one rank the shard moves nothing, but it still marks which dim of every
activation is the batch's (the rng pass slices dropout masks per micro-batch along it; sequence
parallelism keeps to batch activations). A batch of one row (one sequence per micro-batch)
puts that mark on size-1 dims, which rules leave whole; the walk then follows the batch as
dp=2 would on two rows (``_as_two_rows``).

Consumers see parameters whole in every dp mode (the collectives pass gathers ZeRO-3's
shards before use), so data parallelism never moves activations: a replicated tensor that
meets the batch shard (a mask built for the whole batch) is sliced locally, and an op that
cannot run on the batch shard otherwise is an error that names it, not a silent change of
the program. With ``Plan(tp=True)`` the tp axis is placed by passes/tensor_parallel.py, which
chooses among the strategies (least communication) instead of matching them: first the
parameters' placements (``decide``, before the dp walk: it may move row-parallel biases),
then every node's (``annotate``, on the dp-local shapes). Before both, a product written by hand
(``x @ W.T``) becomes ``linear`` (``weight_products``) and grouped-query attention
with fewer k/v heads than tp ranks reads each rank's k/v heads by index (``kv_heads``). Before
anything, an index that pairs each row with itself (``x[arange(B), idx]``) is written as a
gather (``per_sample_index``), whose rule keeps the rows sharded.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import fx

from autopar import meta
from autopar.context import CompileContext
from autopar.placement import Layout, Replicate, Shard
from . import tensor_parallel
from .kv_heads import kv_heads
from .analysis import input_nodes, is_value
from .per_sample_index import per_sample_index
from .weight_products import weight_products
from .rules import OpInfo, TensorMeta, format_placement, rule_for, strategies_for

R = Replicate()
_ORDERS = {torch.ops.aten.sort.default, torch.ops.aten.sort.stable, torch.ops.aten.argsort.default,
           torch.ops.aten.argsort.stable}


def _matches(required, current) -> bool:
    if isinstance(required, tuple):
        return all(r is None or _matches(r, c) for r, c in zip(required, current))
    return required == current


def _replicated(p) -> bool:
    return all(_replicated(x) for x in p) if isinstance(p, tuple) else p == R


def _free(required, current) -> bool:
    """``current`` becomes ``required`` without communication: a replicated input that the
    op wants sharded is sliced locally (the collectives pass inserts the slice)."""
    return isinstance(required, Shard) and current == R


def _choose(node: fx.Node, placed: dict, n: int, two_rows: bool = False, microbatches: int = 1):
    """The strategy ``node`` runs in on the data-parallel axis (None: everything replicated
    and the op has no rule). A strategy that matches its inputs as they are laid out wins;
    otherwise one that needs only local slices of replicated inputs. ``two_rows``: one dp
    rank runs a batch of one row (``_as_two_rows``). ``microbatches``: the graph is a pipeline
    stage that runs each of that many micro-batches apart, so even on one dp rank the batch is
    split, and an op that mixes its samples is refused as on dp > 1."""
    # every dp mode hands consumers the whole parameter (ZeRO-3 gathers it first)
    ins = input_nodes(node)
    current = tuple(R if a.op == "get_attr" else placed.get(a, R) for a in ins)
    sliceable = tuple(a.op != "get_attr" for a in ins)   # parameters are never sliced
    if two_rows and not all(_replicated(p) for p in current):
        s = _as_two_rows(node, current, sliceable)
        if s is not None:
            return s
    split = n > 1 or microbatches > 1
    whole = all(_replicated(p) for p in current) or not split   # (one dp rank, one micro-batch: nothing is split)
    if whole and rule_for(node.target) is None:
        return None          # nothing sharded reaches it: no need to search the op's strategies
    strategies = strategies_for(OpInfo.from_node(node, n), n)
    if strategies is None:
        raise NotImplementedError(
            f"autopar has no sharding rule for {node.target} (node {node.name}), which reads the "
            f"batch shard, and no candidate placement matched when its strategies were searched "
            f"(passes/rules/search.py, along dp={n}); add a rule in passes/rules/ so that data "
            "parallelism knows whether the op can run on a slice of the batch")
    for slicing in (False, True):
        for s in strategies:
            if all(_matches(r, c) or (slicing and ok and _free(r, c))
                   for r, c, ok in zip(s.inputs, current, sliceable)):
                return s
    if not split:    # one dp rank, one micro-batch: the op runs whole, as one without a rule does
        return None
    what = _why_unsplit(node, current, sliceable, strategies, n)
    if n == 1:
        raise ValueError(
            f"node {node.name} ({node.target}) {what}; the pipeline runs each of its {microbatches} "
            "micro-batches apart, which would change the result. Use microbatches=1, add a sharding rule "
            "for the op in passes/rules/, or keep the op out of the pipelined model")
    raise ValueError(
        f"node {node.name} ({node.target}) cannot run on its inputs as data parallelism lays them "
        f"out ({', '.join(format_placement(p) for p in current)} along dp={n}): the op {what}. Keep "
        "the op out of the data-parallel model, or add a sharding rule for it in passes/rules/.")


def _why_unsplit(node: fx.Node, current: tuple, sliceable: tuple, strategies: list, n: int) -> str:
    """Why no strategy of ``node`` reads its inputs as they are laid out. Only an op whose rule
    offers nothing for its batch-sharded inputs, at these sizes and at twice the batch, mixes the
    samples of its batch; one whose rule would run at twice the batch splits it unevenly at these
    sizes; one whose rule would run if a parameter were split with the batch reads a parameter
    sized by the batch; an op without a rule is not known to mix them, only not shown to keep
    them apart (the strategy search found no layout along the batch's dim)."""
    rule = rule_for(node.target)
    if rule is None:
        return ("has no sharding rule, and the strategy search (passes/rules/search.py) found no "
                "placement along the batch's dim at these shapes, so autopar cannot tell that it keeps "
                "the samples apart")
    ins = input_nodes(node)
    for s in strategies:
        if all(_matches(r, c) or (c == R and not ok) for r, c, ok in zip(s.inputs, current, sliceable)):
            whole = [a.name for a, r, c in zip(ins, s.inputs, current) if not _matches(r, c)]
            return (f"needs {', '.join(whole)} split along the batch with its other inputs, but a parameter "
                    "or buffer is never sliced by data parallelism (is it sized by the batch? compute it "
                    "from the inputs in forward instead)")
    where = f"passes/rules/{rule.__module__.rsplit('.', 1)[-1]}.{rule.__name__}"
    info = OpInfo.from_node(node, n)
    outs = info.out if isinstance(info.out, tuple) else (info.out,)
    ndim = max((m.ndim for m in outs if isinstance(m, TensorMeta)), default=0)
    if any(_fits(s, current, sliceable) for c in [*range(ndim), None]
           for s in strategies_for(_doubled(info, current, c), n) or []):
        return (f"splits the batch unevenly at these sizes: its sharding rule ({where}) keeps the batch's dim "
                f"sharded only where every rank's rows line up over dp={n}, and here they do not (at twice "
                "the batch they would). Choose a batch, or a dp size, whose rows divide evenly through the op")
    what = (f"mixes samples of its batch (a batch-wide statistic, or an order over all of it): its "
            f"sharding rule ({where}) has no strategy for these layouts")
    if node.target in _ORDERS:
        what += ("; a mixture-of-experts layer that sorts all its tokens by expert (transformers' 'grouped_mm' "
                 "experts) can route each token apart instead (experts_implementation='batched_mm')")
    return what


def _one_row(gm: fx.GraphModule, ctx: CompileContext) -> bool:
    """Whether the graph runs a batch of one row on this dp rank: one sequence per micro-batch
    (a pipeline stage's inputs are activations, so the context knows its rows) or an input
    batch of one row."""
    if ctx.microbatch_rows:
        return ctx.microbatch_rows // ctx.mesh.axis_size("dp") == 1
    return any(isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == 1
               for v in (x.meta.get(meta.VAL) for x in gm.graph.nodes if x.op == "placeholder"))


def _as_two_rows(node: fx.Node, current: tuple, sliceable: tuple):
    """The strategy of ``node`` on one dp rank that runs a batch of one row, found as dp=2 would
    find it for two rows, one per rank: every input dim that carries the batch shard doubled
    (a size-1 batch dim, or one it is merged into), and output dim ``c`` doubled, for the first
    ``c`` whose output the strategy shards ``S(c)``; else a strategy whose output is not a
    shard (the batch reduced: a Partial). At one row the rules cannot tell the batch's size-1
    dim from any other (they leave size-1 dims whole, and a view maps ``[16, h] -> [1, 16, h]``
    onto the 16), yet the shard must mark the batch's dim, which later passes read: the rng
    pass slices dropout masks per micro-batch along it; sequence parallelism keeps to batch
    activations. None: the op has no rule, or no strategy fits even so (a rule that reads sizes
    from the op's arguments, an op that mixes the batch): _choose decides as at any batch."""
    if rule_for(node.target) is None:
        return None
    info = OpInfo.from_node(node, 2)
    outs = info.out if isinstance(info.out, tuple) else (info.out,)
    ndim = max((m.ndim for m in outs if isinstance(m, TensorMeta)), default=0)
    for c in [*range(ndim), None]:
        for s in strategies_for(_doubled(info, current, c), 2) or []:
            if _fits(s, current, sliceable) and (_marks(s.output, c) if c is not None else not _sharded(s.output)):
                return s
    return None


def _fits(s, current, sliceable) -> bool:
    return all(_matches(r, c) or (ok and _free(r, c)) for r, c, ok in zip(s.inputs, current, sliceable))


def _marks(p, c: int) -> bool:
    if isinstance(p, tuple):
        return all(x is None or _marks(x, c) for x in p)
    return p == Shard(c)


def _sharded(p) -> bool:
    return any(_sharded(x) for x in p) if isinstance(p, tuple) else isinstance(p, Shard)


def _doubled(info: OpInfo, current: tuple, c) -> OpInfo:
    """``info`` with every input dim that ``current`` shards doubled, and output dim ``c`` (of
    every output that has one; None: none) doubled."""
    placements = iter(current)

    def grow(m, p, k=None):
        if isinstance(m, TensorMeta) and isinstance(p, Shard) and (k is None or p.dim == k):
            return TensorMeta(m.shape[:p.dim] + (2 * m.shape[p.dim],) + m.shape[p.dim + 1:], m.dtype)
        return m

    def walk(v):
        if isinstance(v, TensorMeta):
            return grow(v, next(placements))
        if isinstance(v, tuple) and any(isinstance(x, TensorMeta) for x in v):
            p = next(placements)
            return tuple(grow(m, q) for m, q in zip(v, p if isinstance(p, tuple) else (p,) * len(v)))
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v

    def out(m):
        return grow(m, Shard(c)) if c is not None and isinstance(m, TensorMeta) and m.ndim > c else m

    return replace(info, args=tuple(walk(a) for a in info.args), kwargs={k: walk(v) for k, v in info.kwargs.items()},
                   out=tuple(out(m) for m in info.out) if isinstance(info.out, tuple) else out(info.out))


def shard(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    per_sample_index(gm, ctx)      # x[arange(B), idx] as a gather: the batch shard follows it
    if ctx.plan.tp:     # parameter placements along tp first: they may move row-parallel biases
        weight_products(gm, ctx)    # x @ W.T as linear(x, W): a product tp can split
        kv_heads(gm, ctx)           # k/v heads fewer than tp: each rank's, by index (the k/v projections stay whole)
        tensor_parallel.decide(gm, ctx)
    _shard_dp(gm, ctx)
    if ctx.plan.tp:
        tensor_parallel.annotate(gm, ctx)
    return gm


def _shard_dp(gm: fx.GraphModule, ctx: CompileContext) -> None:
    axes, n = ctx.mesh.names, ctx.mesh.axis_size("dp")
    zero3 = ctx.plan.dp == "zero3"
    two_rows = n == 1 and _one_row(gm, ctx)
    placed: dict[fx.Node, object] = {}
    for node in gm.graph.nodes:
        val = node.meta.get(meta.VAL)
        if not is_value(val):
            continue
        if node.op == "get_attr":
            info = ctx.params.get(node.meta.get(meta.PARAM, ""))
            placed[node] = Shard(0) if zero3 and info is not None and info.requires_grad \
                and not info.is_buffer else R
        elif node.op == "placeholder":
            placed[node] = Shard(0) if isinstance(val, torch.Tensor) and val.dim() > 0 else R
        elif node.op == "call_function":
            s = _choose(node, placed, n, two_rows, ctx.plan.microbatches if ctx.microbatch_rows else 1)
            if s is None:
                placed[node] = R if isinstance(val, torch.Tensor) else tuple(R for _ in val)
            else:
                placed[node] = s.output
                node.meta[meta.STRATEGY] = {"dp": s}
        else:
            continue
        node.meta[meta.LAYOUT] = _layout(placed[node], axes)


def _layout(p, axes):
    """The node's Layout (a tuple of them for a multi-output node)."""
    if isinstance(p, tuple):
        return tuple(_layout(x, axes) for x in p)
    return Layout(tuple((a, p if a == "dp" else R) for a in axes))
