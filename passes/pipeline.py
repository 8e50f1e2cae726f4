"""pipeline: split the logical graph into p·v stages, one GraphModule each.

The graph's nodes that depend on the batch (every node with an input among its ancestors)
are kept in graph order and cut into contiguous stages. Nodes that do not depend on the
batch (parameters, position tables, masks built from constants) are copied into every stage
that reads them, so only batch activations cross a cut. A value crosses a cut when it is
defined before the cut and read after it (or is an output): residual streams, and anything
else, are passed along stage by stage. A parameter read by two stages (a tied embedding and
LM head) lives in both; the runtime sums its gradient over the two. One that no stage reads
(forward never uses it) is held by stage 0, so that state dicts and checkpoints keep every
tensor of the model.

The cut is chosen in two steps (stage cost = forward FLOPs, ``autopar.ops.node_flops``):

    1. T* = the smallest possible cost of the most expensive stage (dynamic program over
       the legal cuts: between two nodes where only tensors cross);
    2. among the partitions whose every stage costs at most T*·(1 + BALANCE_SLACK), the one
       where the fewest activation bytes cross the cuts (ties: the better balanced).

Both respect a per-stage memory limit (``Plan.stage_memory_bytes``): the stage's parameters,
gradients and optimizer state (the plan's ZeRO formula over the dp axis) plus the activations
of its in-flight micro-batches. The result goes to ``ctx.stages`` (one ``StageSpec`` each);
the returned GraphModule calls ``stage_0 .. stage_{S-1}`` in order, each a GraphModule, so
the dump shows every stage.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import numpy as np
import torch
from torch import fx

from autopar import meta
from autopar.context import CompileContext
from autopar.ops import node_flops, value_bytes
from autopar.sizes import inflight_microbatches, state_bytes

from .analysis import batch_dependent

BALANCE_SLACK = 0.10


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage of the logical graph."""
    index: int
    nodes: tuple[str, ...]       # its batch-dependent nodes, in graph order
    inputs: tuple[str, ...]      # values received from the previous stage, in order
    graph_inputs: tuple[int, ...]  # positions of the model's own inputs it reads
    outputs: tuple[str, ...]     # values sent to the next stage (last stage: the model's outputs)
    params: tuple[str, ...]      # canonical names of the parameters and buffers it reads
    flops: int                   # forward FLOPs of one micro-batch
    send_bytes: int              # bytes of ``outputs`` per micro-batch (0 for the last stage)
    kept: tuple[str, ...] = ()   # parameters and buffers no stage reads (forward never uses them),
                                 # held by stage 0 so that state dicts and checkpoints keep every tensor

    @property
    def held(self) -> tuple[str, ...]:
        """Every parameter and buffer the stage's module holds: those it reads, and ``kept``."""
        return self.params + self.kept

    def __str__(self) -> str:
        recv = ", ".join(self.inputs) or "-"
        return (f"stage {self.index}: {len(self.nodes)} nodes, {self.flops:,} FLOPs, receives [{recv}], "
                f"sends {self.send_bytes:,} B, {len(self.params)} parameters")


def pipeline(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    n_stages = ctx.mesh.axis_size("pp") * ctx.plan.virtual_stages
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    order, bounds = stage_bounds(graph, ctx)
    pos = {n: i for i, n in enumerate(order)}
    cost = _costs(order)
    ctx.stages = []
    stage_graphs = []
    for k in range(n_stages):
        nodes = order[bounds[k]:bounds[k + 1]]
        sg, spec = _stage_graph(gm, k, nodes, pos, bounds, placeholders, output, n_stages, cost)
        _check_crossing(spec, sg, ctx)
        ctx.stages.append(spec)
        stage_graphs.append(sg)
    read = {name for spec in ctx.stages for name in spec.params}
    unread = tuple(name for name in ctx.params if name not in read)
    if unread:
        ctx.stages[0] = dataclasses.replace(ctx.stages[0], kept=unread)
    return _top_module(stage_graphs, ctx.stages, placeholders)


def stage_bounds(graph: fx.Graph, ctx: CompileContext, scale: float = 1.0) -> tuple[list, list[int]]:
    """(order, bounds): the graph's batch-dependent ops in graph order, and where each of the
    ``pp x virtual_stages`` stages starts in it (then ``len(order)``), as this pass cuts them
    (the module docstring). ``scale``: the micro-batch's rows over the graph's (``cost.estimate``
    cuts a graph captured at another batch the way the compile's own capture is cut: FLOPs and
    bytes grow with the rows, the cost of an op does not)."""
    n_stages = ctx.mesh.axis_size("pp") * ctx.plan.virtual_stages
    output = next(n for n in graph.nodes if n.op == "output")
    batch = batch_dependent(graph)
    order = [n for n in graph.nodes if n in batch and n.op == "call_function"]
    pos = {n: i for i, n in enumerate(order)}
    if len(order) < n_stages:
        raise ValueError(f"the graph has {len(order)} batch-dependent nodes, too few for {n_stages} "
                         "pipeline stages; use fewer stages (pp x virtual_stages)")
    cost = _costs(order, scale)
    cross, legal = _crossing(order, pos, output, ctx.microbatch_rows)
    if int(legal[1:-1].sum()) < n_stages - 1:
        raise ValueError(_no_cuts(order, pos, output, ctx.microbatch_rows, n_stages))
    if ctx.stage_starts:
        return order, [0] + _given_cuts(order, legal, ctx.stage_starts) + [len(order)]
    state, act = _memory_model(order, ctx)
    cuts = _choose_cuts(cost, cross * scale, legal, (state, act * scale), n_stages, ctx.plan.stage_memory_bytes)
    return order, [0] + cuts + [len(order)]


def _given_cuts(order, legal, starts: tuple) -> list[int]:
    """The cuts at the nodes ``starts`` names (a stage's first node each), checked to be legal."""
    at = {n.name: i for i, n in enumerate(order)}
    cuts = []
    for name in starts:
        if name not in at or not legal[at[name]]:
            raise ValueError(f"the pipeline's stage that starts at node {name} cannot start there at these input "
                             "shapes (the node is not in the graph, or other values than the micro-batch's "
                             "activations cross the cut); compile again for these shapes")
        cuts.append(at[name])
    return cuts


def _costs(order, scale: float = 1.0) -> np.ndarray:
    """A stage's cost per op: its forward FLOPs, and 1 (every op costs something)."""
    return np.array([node_flops(n) for n in order], dtype=np.float64) * scale + 1.0


# ---- analysis ----------------------------------------------------------------------------

def _crossing(order, pos, output, rows: int):
    """Bytes crossing each cut c (between order[c-1] and order[c]) and whether the cut is legal:
    everything crossing is a tensor with the micro-batch's ``rows`` along dim 0 (the stages
    send batch activations; a cut inside a region that flattens the batch into its tokens, an
    MoE layer's, is passed over)."""
    n = len(order)
    diff = np.zeros(n + 2)
    illegal = np.zeros(n + 2)
    for i, node in enumerate(order):
        last = max((pos[u] if u in pos else n for u in node.users), default=i)
        if output in node.users:
            last = n
        if last <= i:
            continue
        val = node.meta.get(meta.VAL)
        diff[i + 1] += value_bytes(val)
        diff[last + 1] -= value_bytes(val)
        if not isinstance(val, torch.Tensor) or val.dim() == 0 or val.shape[0] != rows:
            illegal[i + 1] += 1
            illegal[last + 1] -= 1
    cross = np.cumsum(diff)[: n + 1]
    legal = np.cumsum(illegal)[: n + 1] == 0
    legal[0] = legal[n] = True
    return cross, legal


def _no_cuts(order, pos, output, rows: int, n_stages: int) -> str:
    """Why the graph has too few legal cuts: the values that cross them and are not batch
    activations (the first few, by name)."""
    n, found = len(order), []
    for i, node in enumerate(order):
        last = n if output in node.users else max((pos.get(u, n) for u in node.users), default=i)
        val = node.meta.get(meta.VAL)
        if last > i and i + 1 < n and not (isinstance(val, torch.Tensor) and val.dim() and val.shape[0] == rows):
            tensor = isinstance(val, torch.Tensor)
            what = tuple(val.shape) if tensor else type(val).__name__
            found.append((tensor, f"{node.name} ({node.target}: {what})"))
    found = [text for _, text in sorted(found, key=lambda f: f[0])]     # numbers first: the rarer cause
    return (f"no cut splits the graph into {n_stages} pipeline stages with only batch activations crossing it "
            f"(tensors of the micro-batch's {rows} rows along dim 0); values crossing the candidate cuts: "
            f"{', '.join(found[:4]) or 'none'}. Keep such values within one stage (a number read from a tensor "
            "with .item(), a flattened batch), or use fewer stages (pp x virtual_stages)")


def _memory_model(order, ctx: CompileContext):
    """Per-node prefix sums: parameter state bytes (counted at the first reader) and
    activation bytes of one micro-batch."""
    mode, dp = ctx.plan.dp, ctx.mesh.axis_size("dp")
    seen, state, act = set(), [], []
    for node in order:
        numel = 0
        for a in node.all_input_nodes:
            name = a.meta.get(meta.PARAM) if a.op == "get_attr" else None
            info = ctx.params.get(name) if name else None
            if info is not None and name not in seen:
                seen.add(name)
                numel += info.numel
        state.append(float(state_bytes(mode, numel, dp)) if numel else 0.0)
        act.append(value_bytes(node.meta.get(meta.VAL)))
    plan, p = ctx.plan, ctx.mesh.axis_size("pp")
    in_flight = inflight_microbatches(plan.pp_schedule, p, plan.microbatches, plan.virtual_stages)
    return np.concatenate([[0.0], np.cumsum(state)]), np.concatenate([[0.0], np.cumsum(act)]) * in_flight


def _choose_cuts(cost, cross, legal, mem, n_stages, limit):
    n = len(cost)
    pre = np.concatenate([[0.0], np.cumsum(cost)])
    cand = np.nonzero(legal)[0]

    def seg_ok(i, js):
        ok = np.ones(len(js), dtype=bool)
        if limit is not None:
            ok &= (mem[0][js] - mem[0][i]) + (mem[1][js] - mem[1][i]) <= limit
        return ok

    def solve(cap):
        """DP over legal cuts: (min over partitions of the largest stage cost) when cap is None,
        else the fewest crossing bytes (then the smallest largest stage) with every stage cost
        <= cap. Returns (value, cuts)."""
        inf = float("inf")
        best = {0: ((0.0, 0.0) if cap is not None else 0.0, [])}
        for _ in range(n_stages):
            nxt = {}
            for i, (val, cuts) in best.items():
                js = cand[cand > i]
                if not len(js):
                    continue
                seg = pre[js] - pre[i]
                ok = seg_ok(i, js)
                if cap is not None:
                    ok &= seg <= cap
                for j, s, good in zip(js, seg, ok):
                    if not good:
                        continue
                    j = int(j)
                    new = max(val, s) if cap is None else (val[0] + (cross[j] if j < n else 0.0), max(val[1], s))
                    if j not in nxt or new < nxt[j][0]:
                        nxt[j] = (new, cuts + [j])
            best = nxt
        return best.get(n, (inf, None))

    t_star, _ = solve(None)
    if t_star == float("inf"):
        need = max((mem[0][n] + mem[1][n]) / n_stages, 0)
        raise ValueError(f"no split of the graph into {n_stages} stages keeps every stage within "
                         f"stage_memory_bytes={limit:,} (an even split needs about {need:,.0f} B per stage); "
                         "raise the limit, add stages, or shard more (ZeRO, tensor parallelism)")
    _, cuts = solve(t_star * (1 + BALANCE_SLACK))
    return [int(c) for c in cuts[:-1]]


# ---- building the stage graphs --------------------------------------------------------------

def _stage_graph(gm, k, nodes, pos, bounds, placeholders, output, n_stages, cost):
    lo, hi = bounds[k], bounds[k + 1]
    last = k == n_stages - 1
    # values this stage reads that an earlier stage made, and values it must pass on
    received = []
    for n in [n for n in pos if pos[n] < lo]:
        readers = [u for u in n.users if u in pos and pos[u] >= lo] + ([output] if output in n.users else [])
        if readers:
            received.append(n)
    if last:
        outs = list(_flat_outputs(output))
    else:
        outs = [n for n in list(received) + nodes
                if any((u in pos and pos[u] >= hi) or u is output for u in n.users)]
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph_inputs = []
    used_placeholders = {a for n in nodes for a in n.all_input_nodes if a.op == "placeholder"}
    used_placeholders |= {o for o in outs if o.op == "placeholder"}
    for i, ph in enumerate(placeholders):
        if ph in used_placeholders:
            env[ph] = g.node_copy(ph)
            graph_inputs.append(i)
    for n in received:
        p = g.placeholder(n.name)
        p.meta = dict(n.meta)
        env[n] = p
    params: list[str] = []

    def copy_free(a: fx.Node) -> fx.Node:   # batch-independent: recomputed in this stage
        if a not in env:
            for b in a.all_input_nodes:
                copy_free(b)
            env[a] = g.node_copy(a, lambda x: env[x])
            if a.op == "get_attr" and a.meta.get(meta.PARAM) and a.meta[meta.PARAM] not in params:
                params.append(a.meta[meta.PARAM])
        return env[a]

    for n in nodes:
        for a in n.all_input_nodes:
            if a not in env:
                copy_free(a)
        env[n] = g.node_copy(n, lambda x: env[x])
    g.output(tuple(env[o] for o in outs))
    # parameters first (after the inputs), as in the captured graph: later passes rely on it
    body = next(x for x in g.nodes if x.op != "placeholder")
    for x in [x for x in g.nodes if x.op == "get_attr"]:
        if x is not body:
            body.prepend(x)
    sub = fx.GraphModule(gm, g, class_name=f"Stage{k}")     # generates its code
    sub.graph.lint()
    send = 0 if last else sum(value_bytes(o.meta.get(meta.VAL)) for o in outs)
    spec = StageSpec(k, tuple(n.name for n in nodes), tuple(n.name for n in received), tuple(graph_inputs),
                     tuple(o.name for o in outs), tuple(params), int(cost[lo:hi].sum() - (hi - lo)), send)
    return sub, spec


def _flat_outputs(output: fx.Node):
    args = output.args[0]
    return args if isinstance(args, (tuple, list)) else (args,)


def _check_crossing(spec: StageSpec, sg: fx.GraphModule, ctx: CompileContext) -> None:
    """Received values are split over dp along dim 0 like the batch: they must be batch rows."""
    rows = ctx.microbatch_rows
    for p in sg.graph.nodes:
        if p.op != "placeholder" or p.name not in spec.inputs:
            continue
        val = p.meta.get(meta.VAL)
        if not isinstance(val, torch.Tensor) or val.dim() == 0 or val.shape[0] != rows:
            shape = tuple(val.shape) if isinstance(val, torch.Tensor) else type(val).__name__
            raise NotImplementedError(
                f"pipeline stage {spec.index} receives {p.name} of shape {shape}, which is not a tensor "
                f"with the micro-batch ({rows} rows) along dim 0; autopar sends only batch activations "
                "between stages. Compute such a value from the model's inputs inside the stage that "
                "reads it, or choose other cuts with fewer stages")


def _top_module(stage_graphs, specs, placeholders) -> fx.GraphModule:
    """A GraphModule calling the stages in order (what a single process would run)."""
    g = fx.Graph()
    root = torch.nn.Module()
    env: dict[str, fx.Node] = {}
    phs = [g.placeholder(p.name) for p in placeholders]
    final = None
    for sg, spec in zip(stage_graphs, specs):
        root.add_module(f"stage_{spec.index}", sg)
        args = [phs[i] for i in spec.graph_inputs] + [env[name] for name in spec.inputs]
        call = g.call_module(f"stage_{spec.index}", tuple(args))
        for j, name in enumerate(spec.outputs):
            env[name] = g.call_function(operator.getitem, (call, j))
        final = [env[name] for name in spec.outputs]
    g.output(tuple(final))
    top = fx.GraphModule(root, g, class_name="Pipeline")
    top.graph.lint()
    return top
