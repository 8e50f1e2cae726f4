"""Tensor (and sequence) parallelism: the ``tp`` placement of every node, found from the graph.

Two walks over the graph in topological order share one chooser:

``decide`` finds how each parameter is stored along ``tp`` (Megatron's layout), with no
knowledge of module names. A *parameter matmul* is a ``linear`` / ``addmm`` / ``mm`` /
``matmul`` whose second operand is a 2-D parameter:

  * reading its activation whole (replicated, or sequence-sharded under SP, gathered
    first) it becomes **column-parallel**: the weight split along its output features, the
    output sharded along its last dim. If the output is split into equal parts (a fused
    ``q, k, v`` projection) the weight is stored interleaved, so each part stays sharded;
    so it is where the output is viewed as ``(parts, heads, head_dim)`` (ModernBERT's ``Wqkv``),
    whose view then shards the heads of every part; parts of heads tp cannot split keep the
    weight whole, with a warning;
  * reading an activation sharded along the dim it contracts it becomes **row-parallel**:
    the weight split along its input features, the output ``P(sum)``. Its bias moves after
    the product (``linear(x, W) + b``), so that it is added once, after the reduction.

Between the two, every node takes the strategy of the rule registry that needs the least
communication, so the column shard flows through pointwise ops (GeLU, SwiGLU's product),
the head split ``b,s,h -> b,s,nh,hd``, attention over heads and the merge back: the
reduction is deferred to the row-parallel product, and only a consumer that needs the
whole value (the residual add, LayerNorm) makes it an all-reduce. An LM head (a product over a
vocabulary, its table tied to the embedding or not; ``passes/lm_head.py``) is kept whole or
split along the vocabulary, whichever the plan or the compile's cost model says is cheaper:
split, a tied lookup and a cross-entropy on the logits are lowered vocabulary-parallel. A k/v
projection whose heads tp cannot split, next to a q projection (a product of the same input)
whose heads it can, stays whole: grouped-query attention with fewer k/v heads than ranks, where
each rank reads the k/v heads of its q heads (``passes/kv_heads.py``). Any
other parameter read by more than one node stays replicated, as do parameters no matmul
splits (norms, embeddings, biases of row-parallel layers).

``annotate`` then walks again with every parameter's placement fixed and records each
node's strategy and layout; the collectives pass inserts the redistributions.

With ``Plan(sp=True)`` the pointwise regions between tensor-parallel blocks (norms, bias
and residual adds, dropout) take ``Shard(seq)`` (the dim before the features): the row
product's ``P(sum)`` becomes a reduce-scatter there and the column product's input an
all-gather.

A user can fix any parameter's placement by name pattern (``Plan(tp_layout=...)``); the
walk then works around it.
"""
from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import fx

from autopar import meta
from autopar.context import CompileContext
from autopar.placement import Layout, Partial, Replicate, Shard, TPParam, parse_placement
from autopar.runtime.rng import rng_dropout
from autopar.sizes import chunk, ring_bytes

from .analysis import ParamMatmul, input_nodes, is_value, param_matmul, param_name as _param_name
from .kv_heads import kv_whole
from .lm_head import decide_head, find_heads, fold_losses, head_note
from .rules import OpInfo, RULES, Strategy, format_placement, shrink, strategies_for, tensor_inputs
from .rules.registry import replicated
from .rules.view import dim_groups

log = logging.getLogger("autopar")
aten = torch.ops.aten
R = Replicate()
INF = float("inf")
SP_BONUS = 1e18

VIEWLIKE = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
            aten.contiguous.default, aten.clone.default}
SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}
RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_ROW_NORMS = {aten.layer_norm.default, aten.native_layer_norm.default, aten.rms_norm.default}


def sp_op(target) -> bool:
    """Ops of the pointwise regions sequence parallelism shards along the sequence."""
    rule = RULES.get(target)
    return target is rng_dropout or target in _ROW_NORMS or (rule is not None and rule.__module__.endswith("pointwise"))


def varying(s: Strategy) -> bool:
    """Ranks compute different things: a replicated input's gradient is then a sum of addends."""
    def nonrep(p):
        return any(nonrep(x) for x in p) if isinstance(p, tuple) else p is not None and p != R
    return nonrep(s.inputs) or nonrep(s.output)


def _nbytes(m) -> float:
    n = 1
    for s in m.shape:
        n *= s
    return float(n * m.dtype.itemsize)


class _Walk:
    def __init__(self, gm: fx.GraphModule, ctx: CompileContext, decide: bool):
        self.gm, self.ctx, self.decide = gm, ctx, decide
        self.t = ctx.mesh.axis_size("tp")
        self.sp = ctx.plan.sp
        self.params: dict[str, TPParam] = {} if decide else dict(ctx.tp_params)
        self.pl: dict[fx.Node, object] = {}
        self.grouped: dict[fx.Node, int] = {}
        self.rows: list[tuple[fx.Node, ParamMatmul]] = []
        self.warned: set = set()
        self.lookups: set = set()      # vocab-parallel lookups: their P(sum) is reduced by the next op
        uses: dict[str, int] = {}
        for node in gm.graph.nodes:
            name = _param_name(node, ctx)
            if name is not None:
                uses[name] = uses.get(name, 0) + len(node.users)
        self.multi_use = {n for n, k in uses.items() if k > 1}
        if decide:
            self._apply_overrides()
            self._lay_out_heads()

    # -- parameters ------------------------------------------------------------------------
    def _apply_overrides(self):
        for pattern, text in self.ctx.plan.tp_layout:
            hits = [n for n in self.ctx.params if fnmatch.fnmatchcase(n, pattern)]
            if not hits:
                raise ValueError(f"Plan tp_layout pattern {pattern!r} matches no parameter; parameters are "
                                 f"named as in model.named_parameters(), e.g. {next(iter(self.ctx.params), '?')!r}")
            for name in hits:
                self.params[name] = TPParam(parse_placement(text), 1, f"Plan tp_layout {pattern!r}")

    def _lay_out_heads(self):
        """Each LM head whole or split along the vocabulary (``lm_head.decide_head``), unless the
        user fixed its weight; one line of explain says which and why."""
        for head in find_heads(self.gm, self.ctx):
            if head.weight in self.params:
                continue
            split, why = decide_head(head, self.ctx)
            how = "split along the vocabulary" if split else "kept whole"
            self.fix(head.weight, Shard(head.pm.out_dim) if split else R, f"lm head {how}")
            if head.bias is not None:
                self.fix(head.bias, Shard(0) if split else R, f"bias of the lm head, {how}")
            if split:
                fold_losses(self.gm, head)
            self.ctx.notes.append(head_note(head, split, why))

    def undecided(self, name: Optional[str]) -> bool:
        return self.decide and name is not None and name not in self.params

    def fix(self, name: str, placement, reason: str, groups: int = 1):
        if name not in self.params:
            self.params[name] = TPParam(placement, groups, reason)

    # -- the walk --------------------------------------------------------------------------
    def run(self):
        for node in list(self.gm.graph.nodes):
            val = node.meta.get(meta.VAL)
            if not is_value(val):
                continue
            if node.op == "placeholder":
                self.pl[node] = R
            elif node.op == "get_attr":
                name = _param_name(node, self.ctx)
                self.pl[node] = self.params[name].placement if name in self.params else R
            elif node.op == "call_function":
                s = self.choose(node)
                for a, p in zip(input_nodes(node), s.inputs):   # parameters a matmul fixed
                    name = _param_name(a, self.ctx)
                    if self.undecided(name) and p is not None:
                        self.fix(name, p, f"read as {p} by {node.name}")
                        self.pl[a] = p
                self.pl[node] = s.output
                node.meta.setdefault(meta.STRATEGY, {})["tp"] = s
        return self

    def _info(self, node) -> OpInfo:
        info = OpInfo.from_node(node, self.t)
        dp = node.meta.get(meta.STRATEGY, {}).get("dp")
        if dp is not None:
            mesh = self.ctx.mesh
            info = shrink(info, dp, mesh.axis_size("dp"), mesh.coordinate("dp"))
        return info

    def choose(self, node: fx.Node) -> Strategy:
        info = self._info(node)
        ins = input_nodes(node)
        cur = [self.pl.get(a, R) for a in ins]
        strategies = strategies_for(info, self.t)
        if strategies is None:
            if not self.decide and any(p != R and not isinstance(p, tuple) for p in cur) \
                    and node.target not in self.warned:
                self.warned.add(node.target)
                msg = (f"no sharding rule for {node.target} (node {node.name}): its inputs are made whole "
                       f"along tp and it runs replicated; add a rule in passes/rules/ to keep it sharded")
                log.warning("autopar: %s", msg)
                self.ctx.notes.append(f"warning: {msg}")
            return replicated(info)
        pm = param_matmul(node, self.ctx)
        if pm is not None and self.decide:
            s = self._decide_matmul(node, pm, info, strategies, ins, cur)
            if s is not None:
                return s
        if pm is not None and not self.decide:
            wp = self.params.get(_param_name(pm.weight, self.ctx))
            if wp is not None and wp.groups > 1:
                self.grouped[node] = wp.groups
        if node.target in RESHAPES and ins and self.grouped.get(ins[0]):
            s = self._grouped_view(node, info, cur[0], self.grouped[ins[0]])
            if s is not None:
                return s
        if node.target in SPLITS and ins and self.grouped.get(ins[0]):
            s = self._grouped_split(node, info, cur[0], self.grouped[ins[0]])
            if s is not None:
                return s
        s = self._vocab_parallel(node, info, cur)
        if s is not None:
            return s
        best, best_cost = None, INF
        for s in strategies:
            c = self.cost(node, s, ins, cur, info)
            if c < best_cost:
                best, best_cost = s, c
        if best is None and any(self.grouped.get(a) for a in ins):
            raise ValueError(
                f"node {node.name} ({node.target}) reads the output of a fused projection that tensor "
                "parallelism stores interleaved (each rank a slice of every part); only splitting it into "
                "its equal parts along the last dim is supported. Keep the projection whole with "
                "Plan(tp_layout=((<its weight name>, 'R'),)) or split the weight in the model")
        if best is None:
            raise ValueError(f"node {node.name} ({node.target}) has no tp strategy reachable from its inputs "
                             f"({', '.join(format_placement(p) for p in cur)}); this is a bug in autopar's "
                             "redistribution table")
        g = max((self.grouped.get(a, 0) for a in ins), default=0)
        if g:   # still interleaved: only the split into its parts may read it (cost() forbids moves)
            self.grouped[node] = g
        self._check_head_split(node, info, cur, best)
        return best

    def cost(self, node, s: Strategy, ins, cur, info) -> float:
        total, is_varying = 0.0, varying(s)
        metas = tensor_inputs(info)
        for a, want, have, m in zip(ins, s.inputs, cur, metas):
            if isinstance(want, tuple) or isinstance(have, tuple):
                if any(w is not None and w != h for w, h in zip(want, have)):
                    return INF
                continue
            if a in self.lookups and isinstance(want, Partial):
                return INF            # reduced once, here, not carried on to be reduced by every reader
            if self.grouped.get(a) and want != have:
                return INF            # an interleaved shard is only ever split into its parts
            name = _param_name(a, self.ctx)
            if name is not None:
                if self.undecided(name):
                    if isinstance(want, Partial) or (want != R and name in self.multi_use):
                        return INF
                    continue
                if want != have:
                    return INF
                if is_varying and want == R and self.ctx.params[name].requires_grad:
                    total += 2 * _nbytes(m)    # the weight-gradient all-reduce (f), at its 2·bytes bound
                continue
            total += self.convert_cost(have, want, _nbytes(m), m.dtype.is_floating_point)
        if total < INF and self.sp and self._sp_preferred(node, s, cur, info):
            total -= SP_BONUS
        heads = node.meta.get(meta.KV_HEADS)
        if heads is not None and total < INF and s.output == Shard(heads):
            # each rank's k/v heads (passes/kv_heads.py): reading every head instead costs the
            # attention a gather of q (of this output's size) right after
            total -= 2 * ring_bytes("all_gather", _nbytes(info.out), self.t) + 1.0
        return total

    def convert_cost(self, have, want, nbytes: float, grad: bool) -> float:
        if have == want:
            return 0.0
        f = ring_bytes("all_gather", nbytes, self.t)
        if have == Partial("avg") and want == R:
            return 2 * f                               # all-reduce, then / t
        if isinstance(want, Partial) or (isinstance(have, Partial) and have != Partial("sum")):
            return INF
        if have == R:
            return f if grad else 0.0                  # local slice; backward all-gathers
        if isinstance(have, Shard) and want == R:
            return 2 * f if grad else f
        if isinstance(have, Partial):
            if want == R:
                return 2 * f
            return 2 * f if self.sp else INF           # reduce-scatter: sequence parallelism only
        return 3 * f                                   # shard -> other shard: gather and slice

    def _sp_preferred(self, node, s, cur, info) -> bool:
        out = info.out[0] if isinstance(info.out, tuple) else info.out
        if not sp_op(node.target) or not out.dtype.is_floating_point or out.ndim < 2:
            return False
        dp = node.meta.get(meta.STRATEGY, {}).get("dp")
        if self.decide or dp is None or dp.output != Shard(0):
            # only activations of the batch (not position tables, rotary cos/sin); decide()
            # runs before the dp walk and needs no SP choice: SP never changes a parameter's
            # placement
            return False
        outp = s.output[0] if isinstance(s.output, tuple) else s.output
        if outp != Shard(out.ndim - 2):
            return False
        # never pull a tensor-parallel shard (heads, features) onto the sequence
        return not any(isinstance(h, Shard) and h != w for h, w in zip(cur, s.inputs)
                       if not isinstance(h, tuple))

    # -- vocabulary parallelism ------------------------------------------------------------
    def _vocab_parallel(self, node, info, cur) -> Optional[Strategy]:
        """The two ops vocabulary parallelism lowers (autopar.runtime.tpcomm): the lookup in a table
        split along the vocabulary (-> P(sum)), and the cross-entropy of logits split along
        the classes (-> R, never gathering the logits)."""
        if node.target == aten.embedding.default and not any(node.args[3:5]):
            name = _param_name(node.args[0], self.ctx)
            vocab = info.args[0].shape[0]
            if name in self.params and self.params[name].placement == Shard(0) and cur[1] == R:
                if vocab < self.t or chunk(vocab, self.t) * (self.t - 1) >= vocab:
                    raise ValueError(f"{name}: a vocabulary of {vocab} rows leaves some of tp={self.t} "
                                     "ranks without rows; keep the table whole (Plan tp_layout 'R')")
                node.meta[meta.LOWER] = "vocab_embedding"
                self.lookups.add(node)
                return Strategy((Shard(0), R), Partial())
        if node.target == aten.cross_entropy_loss.default:
            a = node.args
            plain = (len(a) < 3 or a[2] is None) and (len(a) < 6 or a[5] == 0.0) and not node.kwargs
            if plain and info.args[0].ndim == 2 and cur[0] == Shard(1) and cur[1] == R:
                node.meta[meta.LOWER] = "vocab_cross_entropy"
                return Strategy((Shard(1), R), R)
        return None

    # -- Megatron's choices ----------------------------------------------------------------
    def _decide_matmul(self, node, pm: ParamMatmul, info, strategies, ins, cur) -> Optional[Strategy]:
        wname = _param_name(pm.weight, self.ctx)
        bname = _param_name(pm.bias, self.ctx) if pm.bias is not None else None
        if not self.undecided(wname):
            return None
        if wname in self.multi_use or (bname is not None and bname in self.multi_use):
            self.fix(wname, R, "read by more than one node (tied): kept whole")
            return None
        act = cur[ins.index(pm.act)]
        wshape = pm.weight.meta[meta.VAL].shape
        pos = {a: i for i, a in enumerate(ins)}
        if act == Shard(pm.k):   # row-parallel
            want = {pos[pm.act]: Shard(pm.k), pos[pm.weight]: Shard(pm.in_dim)}
            s = self._find(strategies, want, Partial())
            if s is not None:
                self.fix(wname, Shard(pm.in_dim), f"row-parallel: {node.name} contracts the dim its input "
                                                   f"is split along")
                if bname is not None:
                    self.fix(bname, R, f"bias of row-parallel {node.name}: added once, after the reduction")
                self.rows.append((node, pm))
                return s
            return None
        # before the fused-projection check: one k/v head's view (b, s, 1, hd) keeps the
        # features last, and a rotary half-split of it reads like the parts of a fused output
        kv = self._kv_whole(node, pm, wshape[pm.out_dim])
        if kv is not None:
            self.fix(wname, R, kv)
            if bname is not None:
                self.fix(bname, R, kv)
            return None
        groups = self._groups_after(node, wshape[pm.out_dim])
        fused = self._fused_view(node, wshape[pm.out_dim]) if groups == 1 else None
        if fused is not None and fused[1] % self.t:
            why = (f"fused projection whose output {node.name} is viewed as {fused[0]} parts of {fused[1]} "
                   f"heads: {fused[1]} heads do not divide by tp={self.t}, so it is kept whole")
            self._warn_whole(wname, bname, why)
            return None
        groups = fused[0] if fused is not None else groups
        part = wshape[pm.out_dim] // groups
        if part < self.t:
            self.fix(wname, R, f"{part} output features: fewer than tp={self.t}")
            return None
        if groups > 1 and part % self.t:
            raise ValueError(
                f"{node.name} is a fused projection whose output is split into {groups} parts of {part} "
                f"features, which do not divide by tp={self.t}; use a tp size that divides {part}, or keep "
                f"{wname} whole with Plan(tp_layout=(({wname!r}, 'R'),))")
        out_ndim = info.out.ndim
        want = {pos[pm.act]: R, pos[pm.weight]: Shard(pm.out_dim)}
        if pm.bias is not None:
            want[pos[pm.bias]] = Shard(0)
        s = self._find(strategies, want, Shard(out_ndim - 1))
        if s is None:
            return None
        why = f"column-parallel: {node.name} splits its output features"
        self.fix(wname, Shard(pm.out_dim), why + (f" (fused x{groups}, interleaved)" if groups > 1 else ""), groups)
        if bname is not None:
            self.fix(bname, Shard(0), why, groups)
        if groups > 1:
            self.grouped[node] = groups
        return s

    def _kv_whole(self, node, pm: ParamMatmul, features: int) -> Optional[str]:
        """Why a k/v projection stays whole (None: it does not): its output splits into n heads
        that tp cannot split, and a product of the same input splits into m q heads that tp
        can split and that read them (``kv_heads.kv_whole``)."""
        n = _heads_after(node, features)
        if n is None:
            return None
        for u in pm.act.users:
            q = param_matmul(u, self.ctx) if u is not node else None
            if q is None or q.act is not pm.act:
                continue
            m = _heads_after(u, q.weight.meta[meta.VAL].shape[q.out_dim])
            if m is not None and m > n and kv_whole(n, m, self.t):
                return (f"grouped-query attention: {n} k/v heads for {m} q heads over tp={self.t}, kept whole "
                        f"(each rank reads the k/v heads of its {m // self.t} q heads)")
        return None

    @staticmethod
    def _find(strategies, want: dict, output) -> Optional[Strategy]:
        for s in strategies:
            if s.output == output and all(s.inputs[i] == p for i, p in want.items()):
                return s
        return None

    def _groups_after(self, node, size: int) -> int:
        """g if the product's output is split along its last dim into g equal parts (through
        views that keep that dim), else 1."""
        todo, seen = [node], set()
        while todo:
            n = todo.pop()
            for u in n.users:
                if u in seen:
                    continue
                seen.add(u)
                uval = u.meta.get(meta.VAL)
                if u.target in VIEWLIKE and isinstance(uval, torch.Tensor) and uval.shape[-1] == size:
                    todo.append(u)
                elif u.target in SPLITS:
                    g = _split_parts(u, size)
                    if g > 1:
                        return g
        return 1

    def _fused_view(self, node, size: int) -> Optional[tuple]:
        """``(g, h)`` if the product's output (through views keeping its last dim) is viewed as
        ``(..., g, h, ...)``: its ``size`` features read as g parts (a fused q, k, v: ModernBERT's
        ``view(b, s, 3, heads, head_dim)``) of h heads, where g does not divide by tp (a plain head
        split keeps its shard on g); else None. Stored interleaved (each rank a slice of every
        part), the view then keeps the shard on the heads (``_grouped_view``)."""
        todo, seen = [node], set()
        while todo:
            n = todo.pop()
            for u in n.users:
                uval = u.meta.get(meta.VAL)
                if u in seen or not isinstance(uval, torch.Tensor):
                    continue
                seen.add(u)
                if u.target in VIEWLIKE and uval.shape[-1] == size:
                    todo.append(u)
                    continue
                gb = _last_dim_split(n.meta[meta.VAL].shape, uval.shape) if u.target in RESHAPES else None
                if gb is not None and len(gb) >= 3 and uval.shape[gb[0]] % self.t:
                    return uval.shape[gb[0]], uval.shape[gb[1]]
        return None

    def _grouped_view(self, node, info, have, groups) -> Optional[Strategy]:
        """The view of an interleaved fused output into ``(groups, heads, ...)``: each rank's
        features are its heads of every part, so the view shards the heads."""
        a, b = info.args[0].shape, info.out.shape
        gb = _last_dim_split(a, b)
        if have != Shard(len(a) - 1) or gb is None or len(gb) < 2 or b[gb[0]] != groups or b[gb[1]] % self.t:
            return None
        return Strategy((have,), Shard(gb[1]))

    def _warn_whole(self, wname: str, bname: Optional[str], why: str) -> None:
        self.fix(wname, R, why)
        if bname is not None:
            self.fix(bname, R, why)
        msg = f"{wname}: {why}; its tensor-parallel layout would split a part, not heads"
        log.warning("autopar: %s", msg)
        self.ctx.notes.append(f"warning: {msg}")

    def _grouped_split(self, node, info, have, groups) -> Optional[Strategy]:
        x = info.args[0]
        d = _split_dim(node, x.ndim)
        if have != Shard(d) or _split_parts(node, node.args[0].meta[meta.VAL].shape[d]) != groups:
            return None
        return Strategy((Shard(d),), tuple(Shard(d) for _ in info.out))

    def _check_head_split(self, node, info, cur, s):
        """A reshape that splits the tp-sharded dim into (n, ...) with n not dividing by tp
        (an odd number of attention heads) cannot keep it sharded: say so."""
        if not self.decide or node.target not in RESHAPES or not isinstance(cur[0], Shard) or s.inputs[0] != R:
            return
        a, b = info.args[0].shape, info.out.shape
        d = cur[0].dim
        for ga, gb in dim_groups(a, b):
            if ga[0] == d and len(gb) > 1:
                lead = b[gb[0]]
                raise ValueError(
                    f"tensor parallelism splits dim {d} (size {a[d]}) of {node.args[0].name} over tp={self.t}, "
                    f"and {node.name} reshapes it into {tuple(b[i] for i in gb)}: the leading {lead} "
                    f"(attention heads) does not divide by tp={self.t}. Use a tp size that divides {lead}, "
                    "or keep the projections whole with Plan(tp_layout=...)")


_PRODUCTS = {aten.linear.default, aten.mm.default, aten.addmm.default, aten.matmul.default, aten.bmm.default}
HEAD_SEARCH = 16
"""nodes ``_heads_after`` visits from a product: enough for a norm over the whole projection
before its head view (OLMo 2's q/k norms: RMSNorm by hand, about 8 ops)"""


def _heads_after(node, features: int) -> Optional[int]:
    """n if the product's output is viewed as ``(..., n, features / n)`` heads, at once or after
    ops that keep its shape (no other product), else None."""
    shape = tuple(node.meta[meta.VAL].shape)
    todo, seen = [node], {node}
    while todo and len(seen) <= HEAD_SEARCH:
        for u in todo.pop(0).users:
            val = u.meta.get(meta.VAL)
            if u in seen or not isinstance(val, torch.Tensor):
                continue
            seen.add(u)
            if u.target in RESHAPES and val.dim() == len(shape) + 1 and tuple(val.shape[:-2]) == shape[:-1] \
                    and val.shape[-2] * val.shape[-1] == features:
                return val.shape[-2]
            if tuple(val.shape) == shape and u.target not in _PRODUCTS:
                todo.append(u)
    return None


def _last_dim_split(a, b) -> Optional[list]:
    """The dims of shape ``b`` that a view of shape ``a`` splits its last dim into (alone: not
    merged with the dims before it), else None."""
    for ga, gb in dim_groups(tuple(a), tuple(b)):
        if ga == [len(a) - 1]:
            return gb
    return None


def _split_dim(node, ndim) -> int:
    d = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    return d % ndim


def _split_parts(node, size) -> int:
    val = node.args[0].meta.get(meta.VAL)
    if not isinstance(val, torch.Tensor) or _split_dim(node, val.dim()) != val.dim() - 1:
        return 0
    arg = node.args[1] if len(node.args) > 1 else None
    if node.target == aten.chunk.default:
        return arg if size % arg == 0 else 0
    if node.target == aten.split.Tensor:
        return size // arg if size % arg == 0 else 0
    return len(arg) if len(set(arg)) == 1 else 0


def _split_bias(gm: fx.GraphModule, node: fx.Node, pm: ParamMatmul) -> None:
    """``linear(x, W, b)`` -> ``linear(x, W) + b`` (``addmm`` -> ``mm + b``): the bias of a
    row-parallel product is added after the reduction, once."""
    if pm.bias is None:
        return
    g = gm.graph
    if node.target == aten.linear.default:
        node.args = (pm.act, pm.weight)
        node.kwargs = {}
    else:
        node.target = aten.mm.default
        node.args = (pm.act, pm.weight)
    with g.inserting_after(node):
        add = g.call_function(aten.add.Tensor, (node, pm.bias))
    node.replace_all_uses_with(add, delete_user_cb=lambda u: u is not add)
    add.meta.update({k: v for k, v in node.meta.items() if k in (meta.VAL, *meta.ORIGIN)})


def decide(gm: fx.GraphModule, ctx: CompileContext) -> None:
    """Fix ``ctx.tp_params`` (every parameter's tp placement) from the graph, and move the bias
    of each row-parallel product after it."""
    w = _Walk(gm, ctx, decide=True).run()
    for node in gm.graph.nodes:          # the decide walk's strategies are provisional
        node.meta.get(meta.STRATEGY, {}).pop("tp", None)
    for name in ctx.params:
        w.params.setdefault(name, TPParam(R, 1, "no product splits it"))
    ctx.tp_params = w.params
    for node, pm in w.rows:
        _split_bias(gm, node, pm)
    kept = whole_share(ctx)
    if kept.share > WHOLE_WARNING:
        msg = (f"tensor parallelism keeps {kept.share:.0%} of the trainable parameter bytes whole on every tp rank "
               f"({kept.describe()}): it splits only the 2-D weights that linear/mm products read, so memory "
               "per rank falls little; split others with Plan(tp_layout=...) where a rule allows it")
        log.warning("autopar: %s", msg)
        ctx.notes.append(f"warning: {msg}")
    gm.graph.lint()


WHOLE_WARNING = 0.5
"""share of the trainable parameter bytes tp may keep whole before compile warns (a plain
transformer keeps its embeddings and norms whole: well under half at any real size)"""


@dataclass(frozen=True)
class WholeShare:
    """What tensor parallelism keeps whole: share of trainable parameter bytes, largest ones."""
    share: float
    largest: tuple   # (name, bytes, reason) of the largest whole parameters with 2 or more dims

    def describe(self) -> str:
        return ", ".join(f"{n} {b / 2**10:.0f} KiB: {why}" for n, b, why in self.largest) or "norms and biases"


def whole_share(ctx: CompileContext, top: int = 3) -> WholeShare:
    """The trainable parameters ``ctx.tp_params`` leaves replicated along tp."""
    total, whole, big = 0, 0, []
    for name, info in ctx.params.items():
        if not info.requires_grad or info.is_buffer:
            continue
        nbytes = info.numel * info.dtype.itemsize
        total += nbytes
        p = ctx.tp_params.get(name)
        if p is None or not p.sharded:
            whole += nbytes
            if len(info.shape) >= 2:
                big.append((name, nbytes, p.reason if p is not None else "not placed"))
    big.sort(key=lambda x: -x[1])
    return WholeShare(whole / total if total else 0.0, tuple(big[:top]))


def annotate(gm: fx.GraphModule, ctx: CompileContext) -> None:
    """Each node's tp strategy and layout, parameters placed as ``decide`` fixed them."""
    w = _Walk(gm, ctx, decide=False).run()
    for node, p in w.pl.items():
        lay = node.meta.get(meta.LAYOUT)
        if isinstance(lay, tuple):
            ps = p if isinstance(p, tuple) else (p,) * len(lay)
            node.meta[meta.LAYOUT] = tuple(x.replace("tp", q if q is not None else R) for x, q in zip(lay, ps))
        elif isinstance(lay, Layout):
            node.meta[meta.LAYOUT] = lay.replace("tp", p)
