"""The sharding-rule registry: for one ATen op, the layouts it can run in along one mesh axis.

A rule reads an ``OpInfo`` (the op, its arguments with every tensor replaced by its shape and
dtype, its output's shape) and lists ``Strategy`` values: one placement per tensor input and
the placement of the output that running the op on the local pieces then produces. Rules
are written for ONE mesh axis of ``info.n`` ranks; the caller expands them over the mesh.
Every rule includes the all-Replicate strategy, so an op with a rule always has a way to run.

Some rules (view/reshape, mean, amax) are only correct for some axis sizes under the
project's uneven-shard convention (``autopar.sizes``: ``ceil(size/n)`` per rank,
the last ranks hold fewer, possibly none); they read ``info.n`` and, when it is ``None``,
offer only what is correct for every axis size.

``localize`` rewrites the op's non-tensor arguments that carry global sizes (view sizes,
factory sizes) for one rank, so the op can run on that rank's pieces.

An op of another library (``torch.ops.transformers.grouped_mm_fallback``) is registered by its
name, ``str(op)``: the table finds the rule when a graph's node carries the op, so the rule
exists before (and without) the library being imported. An op with no rule at all is handed
to the strategy search (``search``), which registers itself with ``register_search``: the
registry cannot import it (the search runs ``check``, which reads the registry).

Conventions: a tensor input is a ``TensorMeta``; a list of tensors (``cat``'s argument) is
a list of them, each its own input; the value of a multi-output node (what ``getitem``
reads) is a tuple of them and counts as ONE input whose placement is a tuple, where
``None`` marks an entry the op does not read.
"""
from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Union

import torch
from torch import fx

from autopar import meta
from autopar.placement import Partial, Placement, Replicate, Shard
from autopar.sizes import local_size

__all__ = ["TensorMeta", "OpInfo", "Strategy", "RULES", "LOCALIZERS", "RANDOM", "register",
           "register_localize", "register_search", "rule_for", "strategies_for", "localize",
           "local_size", "tensor_inputs", "format_placement", "shrink", "inplace", "out_meta", "fake_tensors"]

R = Replicate()
PARTIALS = tuple(Partial(op) for op in ("sum", "avg", "max", "min"))


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one tensor: all a rule needs to know about it."""
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorMeta":
        return cls(tuple(int(s) for s in t.shape), t.dtype)

    def __str__(self) -> str:
        return f"{str(self.dtype).replace('torch.', '')}{list(self.shape)}"


Out = Union[TensorMeta, tuple]


def _to_meta(v):
    """A runtime value as an OpInfo argument: tensors become TensorMeta, containers are walked
    (lists stay lists; a tuple or list of tensors that is ONE value stays a tuple)."""
    if isinstance(v, torch.Tensor):
        return TensorMeta.of(v)
    if isinstance(v, (list, tuple)):
        return [_to_meta(x) for x in v]
    return v


def out_meta(v):
    """A value as a rule sees it: a tensor -> its ``TensorMeta``, recursively (lists and tuples
    become tuples); anything else as it is."""
    if isinstance(v, torch.Tensor):
        return TensorMeta.of(v)
    if isinstance(v, (list, tuple)):
        return tuple(out_meta(x) for x in v)
    return v


def _node_arg(a):
    if isinstance(a, fx.Node):
        val = a.meta.get(meta.VAL)
        if val is None:
            raise ValueError(f"node {a.name} has no meta[{meta.VAL!r}]: capture the graph with "
                             f"torch.export so every node carries its FakeTensor")
        return out_meta(val)          # a multi-output value becomes a tuple: one input
    if isinstance(a, (list, tuple)):
        return [_node_arg(x) for x in a]
    return a


def fake_tensors(v):
    """TensorMeta -> an empty meta tensor, recursively (tuples stay tuples)."""
    if isinstance(v, TensorMeta):
        return torch.empty(v.shape, dtype=v.dtype, device="meta")
    if isinstance(v, list):
        return [fake_tensors(x) for x in v]
    if isinstance(v, tuple):
        return tuple(fake_tensors(x) for x in v)
    return v


def _holds(v, cls) -> bool:
    if isinstance(v, cls):
        return True
    if isinstance(v, dict):
        v = list(v.values())
    return isinstance(v, (list, tuple)) and any(_holds(x, cls) for x in v)


def _clone(v):
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, (list, tuple)):
        return type(v)(_clone(x) for x in v)
    if isinstance(v, dict):
        return {k: _clone(x) for k, x in v.items()}
    return v


@dataclass(frozen=True)
class OpInfo:
    """One call of an op, described by shapes: what a rule reads."""
    target: Any
    """the OpOverload (or ``operator.getitem``)"""
    args: tuple
    """the call's args, every tensor replaced by its TensorMeta (lists kept as lists)"""
    kwargs: dict = field(default_factory=dict)
    out: Out = None
    """the output's TensorMeta, or a tuple of them for multi-output ops"""
    n: Optional[int] = None
    """size of the mesh axis the strategies are for; None = offer only what is right for any size"""

    @classmethod
    def from_node(cls, node: fx.Node, n: Optional[int] = None) -> "OpInfo":
        """From an FX node whose inputs and output carry ``meta["val"]`` FakeTensors."""
        if meta.VAL not in node.meta:
            raise ValueError(f"node {node.name} ({node.target}) has no meta[{meta.VAL!r}]: "
                             f"capture the graph with torch.export so every node carries it")
        return cls(node.target, tuple(_node_arg(a) for a in node.args),
                   {k: _node_arg(v) for k, v in node.kwargs.items()},
                   out_meta(node.meta[meta.VAL]), n)

    @classmethod
    def from_call(cls, op, args, kwargs=None, n: Optional[int] = None) -> "OpInfo":
        """From a call's arguments (real tensors or TensorMeta); ``out`` comes from running
        the op on meta tensors. A tuple argument is one multi-output value (``getitem``)."""
        kwargs = kwargs or {}

        def conv(v):
            return out_meta(v) if isinstance(v, tuple) else _to_meta(v)

        if op is operator.getitem and isinstance(args[0], list):   # a list-valued output
            args = (tuple(args[0]),) + tuple(args[1:])
        margs = tuple(conv(a) for a in args)
        mkw = {k: conv(v) for k, v in kwargs.items()}
        try:
            out = op(*fake_tensors(margs), **fake_tensors(mkw))
        except (NotImplementedError, RuntimeError):
            # the op reads a value (item()) or its output shape depends on the values
            # (nonzero): run it on copies of the real tensors, where they were given
            if _holds(args, TensorMeta) or _holds(kwargs, TensorMeta) or not _holds(args, torch.Tensor):
                raise
            out = op(*_clone(args), **_clone(kwargs))
        return cls(op, margs, mkw, out_meta(out), n)

    def with_n(self, n: Optional[int]) -> "OpInfo":
        return replace(self, n=n)


def format_placement(p) -> str:
    if isinstance(p, tuple):
        return "(" + ",".join(format_placement(x) for x in p) + ")"
    return "_" if p is None else str(p)


@dataclass(frozen=True)
class Strategy:
    """Required placements of the tensor inputs (flattening args then kwargs) -> output's."""
    inputs: tuple
    output: Union[Placement, tuple]

    def __str__(self) -> str:
        return f"{','.join(format_placement(p) for p in self.inputs)} -> {format_placement(self.output)}"


def tensor_inputs(info: OpInfo) -> list:
    """The tensor inputs in strategy order: TensorMeta, or a tuple of them for one
    multi-output value (computed once per OpInfo: the planners ask for every strategy)."""
    cached = info.__dict__.get("_tensor_inputs")
    if cached is not None:
        return list(cached)
    found = []

    def walk(v):
        if isinstance(v, TensorMeta) or (
                isinstance(v, tuple) and any(isinstance(x, TensorMeta) for x in v)):
            found.append(v)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    for a in list(info.args) + list(info.kwargs.values()):
        walk(a)
    object.__setattr__(info, "_tensor_inputs", tuple(found))     # frozen: a cache, not a field
    return found


RuleFn = Callable[[OpInfo], list]


class RuleTable(dict):
    """op -> rule, where an op of another library may be keyed by its name (``str(op)``):
    looking up the OpOverload finds a rule registered under its name."""

    def get(self, op, default=None):
        if dict.__contains__(self, op):
            return dict.__getitem__(self, op)
        return dict.get(self, str(op), default) if isinstance(op, torch._ops.OpOverload) else default

    def __contains__(self, op) -> bool:
        return self.get(op) is not None

    def __missing__(self, op):
        rule = self.get(op)
        if rule is None:
            raise KeyError(op)
        return rule


RULES: dict[Any, RuleFn] = RuleTable()
"""op (or an op's name, for another library's op) -> rule; filled by ``@register``."""
LOCALIZERS: dict[Any, Callable] = {}
"""op -> localizer, for the ops whose non-tensor arguments carry global sizes."""
RANDOM: set = set()
"""ops whose output values are random or unspecified (``rand``, ``empty``): the validator
compares only their shapes and dtypes, and the search never runs such an op."""
_SEARCH: list = []


def register(*ops, random: bool = False):
    """Decorator: ``rule_fn`` lists the strategies of each op in ``ops`` (an OpOverload, or
    the name ``str(op)`` of another library's op); ``random``: the op's values are random."""
    def deco(fn):
        for op in ops:
            assert not dict.__contains__(RULES, op), \
                f"two sharding rules for {op}: {RULES[op].__name__}, {fn.__name__}"
            RULES[op] = fn
            if random:
                RANDOM.add(op)
        return fn
    return deco


def rule_for(op) -> Optional[RuleFn]:
    """The rule registered for ``op`` (or under its name), or None."""
    return RULES.get(op)


def register_search(fn: Callable) -> Callable:
    """``fn(info) -> strategies`` finds the strategies of an op that has no rule."""
    _SEARCH[:] = [fn]
    return fn


def register_localize(*ops):
    """Decorator: ``fn(info, strategy, n, index) -> (args, kwargs)`` for each op in ``ops``."""
    def deco(fn):
        for op in ops:
            LOCALIZERS[op] = fn
        return fn
    return deco


def strategies_for(info: OpInfo, n: Optional[int] = None) -> Optional[list]:
    """The op's strategies along one mesh axis of ``n`` ranks (default ``info.n``), without
    duplicates, all-Replicate first. An op with no rule is handed to the search; None when
    it finds no sharded strategy either (or no search is registered): the caller replicates
    the op or refuses it, as for an op nothing is known about.

    Partial placements are kept to floating tensors (rules list them by op, not by dtype):
    integer masks and indices are never held as addends."""
    if n is not None:
        info = info.with_n(n)
    rule = RULES.get(info.target)
    listed = rule(info) if rule is not None else _SEARCH[0](info) if _SEARCH else []
    if rule is None and len(listed) <= 1:
        return None
    out, seen = [], set()
    metas = _integer_metas(info)
    for s in listed:
        if s not in seen and not (metas and _partial_on_integers(metas, s)):
            seen.add(s)
            out.append(s)
    out.sort(key=lambda s: not _all_replicate(s))
    assert out and _all_replicate(out[0]), f"the strategies of {info.target} lack the all-Replicate one"
    return out


def _integer_metas(info: OpInfo) -> Optional[tuple]:
    """(tensor inputs, outputs) of the op when one of them is an integer tensor, else None (no
    strategy can then hold an integer as an addend: most ops, checked once, not per strategy)."""
    ins = tuple(tensor_inputs(info))
    outs = info.out if isinstance(info.out, tuple) else (info.out,)

    def ints(m):
        if isinstance(m, tuple):
            return any(ints(x) for x in m)
        return isinstance(m, TensorMeta) and not m.dtype.is_floating_point
    return (ins, outs) if ints(ins) or ints(outs) else None


def _partial_on_integers(metas: tuple, s: Strategy) -> bool:
    ins, outs = metas

    def bad(p, m):
        if isinstance(p, tuple):
            return any(bad(x, y) for x, y in zip(p, m))
        return isinstance(p, Partial) and isinstance(m, TensorMeta) and not m.dtype.is_floating_point
    return bad(s.inputs, ins) or bad(s.output if isinstance(s.output, tuple) else (s.output,), outs)


def _all_replicate(s: Strategy) -> bool:
    def rep(p):
        return all(rep(x) for x in p) if isinstance(p, tuple) else p is None or p == R
    return rep(s.inputs) and rep(s.output)


def localize(info: OpInfo, strategy: Strategy, n: int, index: int):
    """``(args, kwargs)`` of the op for rank ``index`` of ``n``: arguments carrying global sizes
    are rewritten to this rank's; tensors stay TensorMeta, for the caller to substitute."""
    fn = LOCALIZERS.get(info.target)
    if fn is None:
        return info.args, dict(info.kwargs)
    return fn(info, strategy, n, index)


# --- small helpers shared by the rule files -------------------------------------------------

def even(size: int, n: Optional[int]) -> bool:
    """Every rank holds the same share (needed where ranks' results are averaged)."""
    return n is not None and size % n == 0


def nonempty(size: int, n: Optional[int]) -> bool:
    """Every rank holds at least one element (needed by max/min over the dim)."""
    return n is not None and local_size(size, n, n - 1) > 0


def norm_dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


def arg(info: OpInfo, pos: int, name: str, default=None):
    """Argument ``name`` of the call, given positionally at ``pos`` or as a keyword."""
    if len(info.args) > pos:
        return info.args[pos]
    return info.kwargs.get(name, default)


def with_arg(info: OpInfo, pos: int, name: str, value):
    """``(args, kwargs)`` with argument ``name`` (position ``pos``) set to ``value``."""
    args, kwargs = list(info.args), dict(info.kwargs)
    if len(args) > pos:
        args[pos] = value
    else:
        kwargs[name] = value
    return tuple(args), kwargs


def replicated(info: OpInfo) -> Strategy:
    """The all-Replicate strategy of ``info``."""
    ins = tuple(tuple(R for _ in t) if isinstance(t, tuple) else R for t in tensor_inputs(info))
    out = tuple(R for _ in info.out) if isinstance(info.out, tuple) else R
    return Strategy(ins, out)


def unread(m: TensorMeta) -> list:
    """Every placement of a tensor whose values the op does not read (only its dtype): R, a
    shard of any dim, and (floating) any Partial."""
    return [R] + [Shard(d) for d in shardable_dims(m.shape)] + (
        list(PARTIALS) if m.dtype.is_floating_point else [])


def like_out(info: OpInfo, p):
    """``p`` for the output, or for each output of a multi-output op."""
    return tuple(p for _ in info.out) if isinstance(info.out, tuple) else p


def shardable_dims(shape) -> list:
    """Dims worth sharding: size-0 and size-1 dims are left whole."""
    return [d for d, s in enumerate(shape) if s > 1]


def local_shape(shape, placement, n: int, index: int) -> tuple:
    if isinstance(placement, Shard):
        shape = list(shape)
        shape[placement.dim] = local_size(shape[placement.dim], n, index)
    return tuple(shape)


def inplace(rule: RuleFn) -> RuleFn:
    """The rule of an in-place op from its out-of-place form's: the output is the mutated
    first input, so only strategies that leave that input's placement as it is are kept."""
    @functools.wraps(rule)          # keeps the family's module: sequence parallelism reads it
    def rule_(info: OpInfo) -> list:
        return [s for s in rule(info) if s.inputs[0] == s.output]
    rule_.__name__ = f"{rule.__name__}_"
    return rule_


def prod(xs) -> int:
    return math.prod(xs)


def shrink(info: OpInfo, strategy: Strategy, n: int, index: int) -> OpInfo:
    """``info`` as rank ``index`` of ``n`` sees it under ``strategy``: every tensor input and
    the output at its local shape. Rules and localizers of a second mesh axis read this, so
    that axes compose (the tp axis splits what is local to the dp axis)."""
    placements = iter(strategy.inputs)

    def tmeta(m, p):
        return TensorMeta(local_shape(m.shape, p, n, index), m.dtype) if isinstance(m, TensorMeta) else m

    def walk(v):
        if isinstance(v, TensorMeta):
            return tmeta(v, next(placements))
        if isinstance(v, tuple) and any(isinstance(x, TensorMeta) for x in v):
            p = next(placements)
            return tuple(tmeta(m, q) for m, q in zip(v, p))
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v

    args = tuple(walk(a) for a in info.args)
    kwargs = {k: walk(v) for k, v in info.kwargs.items()}
    out = info.out
    if isinstance(out, tuple):
        outp = strategy.output if isinstance(strategy.output, tuple) else (strategy.output,) * len(out)
        out = tuple(tmeta(m, p) for m, p in zip(out, outp))
    else:
        out = tmeta(out, strategy.output)
    return replace(info, args=args, kwargs=kwargs, out=out)
