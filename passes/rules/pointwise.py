"""Sharding rules of elementwise ops, with broadcasting.

Any output dim may be sharded: each input that has that dim at full size (aligned from the
right, as broadcasting aligns) is sharded on it, an input that broadcasts along it (size 1 or
missing) is replicated. ``Partial`` inputs pass through only where the op commutes with the
reduction across ranks: sums through linear ops (add of two sums, scaling by a replicated
factor, neg), averages also through adding a replicated term, max/min through monotone ops
(a decreasing one swaps them). Anything else, e.g. ``gelu(a0 + a1)``, is not ``gelu(a0) +
gelu(a1)``, so no Partial strategy is offered.

Dropout: a Shard strategy is right when each rank draws its own mask, a Replicate one when
all ranks draw the same; arranging the RNG that way is the lowering's job.

An in-place op (``add_``, ``copy_``, ``masked_fill_``) takes its out-of-place form's rule,
less the strategies that would change the mutated input's placement (``inplace``).
"""
from __future__ import annotations

import torch

from .registry import (PARTIALS, R, OpInfo, Strategy, TensorMeta, arg, inplace, like_out,
                       register, replicated, shardable_dims, unread)
from autopar.placement import Partial, Shard

aten = torch.ops.aten
_FLIP = {"max": "min", "min": "max", "sum": "sum", "avg": "avg"}


def _tensor_positions(info: OpInfo) -> list:
    return ([i for i, a in enumerate(info.args) if isinstance(a, TensorMeta)]
            + [k for k, a in info.kwargs.items() if isinstance(a, TensorMeta)])


def partial_strategy(info: OpInfo, kind: str, at, out: str | None = None) -> Strategy:
    """Inputs at argument positions ``at`` hold P(kind), the other tensors R -> P(out or kind)."""
    ins = tuple(Partial(kind) if i in at else R for i in _tensor_positions(info))
    return Strategy(ins, like_out(info, Partial(out or kind)))


def elementwise(info: OpInfo) -> list:
    """All-Replicate, and one Shard strategy per output dim (broadcast inputs replicated)."""
    out = info.out[0] if isinstance(info.out, tuple) else info.out
    found = [replicated(info)]
    ins = [info.args[i] if isinstance(i, int) else info.kwargs[i] for i in _tensor_positions(info)]
    for od in shardable_dims(out.shape):
        placements = []
        for t in ins:
            d = od - (out.ndim - t.ndim)
            placements.append(Shard(d) if d >= 0 and t.shape[d] == out.shape[od] else R)
        found.append(Strategy(tuple(placements), like_out(info, Shard(od))))
    return found


@register(aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar)
def add_sub(info: OpInfo) -> list:
    found = elementwise(info)
    if _tensor_positions(info) == [0]:      # x +- constant: avg, max, min shift with it
        return found + [partial_strategy(info, k, {0}) for k in ("avg", "max", "min")]
    found += [partial_strategy(info, k, {0, 1}) for k in ("sum", "avg")]
    found += [partial_strategy(info, "avg", {0}), partial_strategy(info, "avg", {1})]
    found += [partial_strategy(info, k, {0}) for k in ("max", "min")]
    sign = arg(info, 2, "alpha", 1) * (-1 if info.target == aten.sub.Tensor else 1)
    if sign != 0:                            # x + sign*y: y's max/min, flipped when sign < 0
        found += [partial_strategy(info, k, {1}, k if sign > 0 else _FLIP[k]) for k in ("max", "min")]
    return found


@register(aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar)
def mul_div(info: OpInfo) -> list:
    found = elementwise(info)
    if _tensor_positions(info) == [0]:      # scaling by a constant c
        c = info.args[1]
        found += [partial_strategy(info, k, {0}) for k in ("sum", "avg")]
        if isinstance(c, (int, float)) and c != 0:
            found += [partial_strategy(info, k, {0}, k if c > 0 else _FLIP[k]) for k in ("max", "min")]
        return found
    factors = ({0}, {1}) if info.target == aten.mul.Tensor else ({0},)   # x / y: only x
    return found + [partial_strategy(info, k, at) for k in ("sum", "avg") for at in factors]


register(aten.add_.Tensor)(inplace(add_sub))
register(aten.div_.Tensor)(inplace(mul_div))


@register(aten.neg.default)
def neg(info: OpInfo) -> list:
    return elementwise(info) + [partial_strategy(info, k, {0}, _FLIP[k]) for k in _FLIP]


@register(aten.exp.default, aten.relu.default, aten.sigmoid.default, aten.tanh.default,
          aten.atan.default, aten.asinh.default, aten.expm1.default, aten.ceil.default,
          aten.floor.default, aten.round.default, aten.trunc.default, aten.sign.default,
          aten.clamp.default, aten.clamp.Tensor, aten.hardtanh.default)
def monotone(info: OpInfo) -> list:
    """Non-decreasing on all reals: f(max_i a_i) = max_i f(a_i) (clamp: in x, with its
    bounds replicated)."""
    return elementwise(info) + [partial_strategy(info, k, {0}) for k in ("max", "min")]


@register(aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
          aten.lift_fresh_copy.default, aten._to_copy.default, aten.to.dtype,
          aten.to.dtype_layout, aten.to.device)
def identity(info: OpInfo) -> list:
    """Copies and casts keep every placement; a Partial only between floating dtypes (see
    ``_cast_partials``)."""
    return elementwise(info) + _cast_partials(info)


def _cast_partials(info: OpInfo) -> list:
    """Rounding is monotone, so max/min pass through any floating cast; a sum or average
    only through one that loses no precision (rounded addends need not sum to the rounded
    sum)."""
    src, dst = info.args[0].dtype, info.out.dtype
    if not (src.is_floating_point and dst.is_floating_point):
        return []
    kinds = _FLIP if torch.promote_types(src, dst) == dst else ("max", "min")
    return [partial_strategy(info, k, {0}) for k in kinds]


@register(aten.type_as.default)
def type_as(info: OpInfo) -> list:
    """x cast to other's dtype: only other's dtype is read, so other may be laid out in any way."""
    x, other = info.args[0], info.args[1]
    cast = [(R, R)] + [(Shard(d), Shard(d)) for d in shardable_dims(x.shape)]
    cast += [(s.inputs[0], s.output) for s in _cast_partials(info)]
    return [Strategy((p, q), out) for p, out in cast for q in unread(other)]


@register(aten._assert_tensor_metadata.default)
def assert_metadata(info: OpInfo) -> list:
    """A check of dtype (and, when given, global size and stride) with no output: it runs
    on any placement that leaves the checked properties as they are."""
    x = info.args[0]
    found = [Strategy((p,), R) for p in (R,) + (PARTIALS if x.dtype.is_floating_point else ())]
    if arg(info, 1, "size") is None and arg(info, 2, "stride") is None:
        found += [Strategy((Shard(d),), R) for d in shardable_dims(x.shape)]
    return found


@register(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(info: OpInfo) -> list:
    """Filled positions hold the fill value on every rank: right for avg/max/min, and for a
    sum only when the value is 0."""
    found = elementwise(info) + [partial_strategy(info, k, {0}) for k in ("avg", "max", "min")]
    if info.target == aten.masked_fill.Scalar and info.args[2] == 0:
        found.append(partial_strategy(info, "sum", {0}))
    return found


register(aten.masked_fill_.Scalar)(inplace(masked_fill))
register(aten.detach_.default)(inplace(identity))


@register(aten.fill.Scalar)
def fill(info: OpInfo) -> list:
    """Every element becomes the value: any shard; the value held on every rank is its own
    average, max and min."""
    return elementwise(info) + [partial_strategy(info, k, {0}) for k in ("avg", "max", "min")]


@register(aten.copy.default)
def copy(info: OpInfo) -> list:
    """``self`` takes ``src``'s values (broadcast, cast to self's dtype): self's placement is
    irrelevant but kept; a Partial passes where the cast does (see ``_cast_partials``)."""
    self_, src = info.args[0], info.args[1]
    found = elementwise(info)
    if self_.shape == src.shape and self_.dtype == src.dtype and src.dtype.is_floating_point:
        found += [Strategy((p, p), p) for p in PARTIALS]
    return found


register(aten.fill_.Tensor)(inplace(fill))
register(aten.copy_.default)(inplace(copy))


@register(aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf)
def where(info: OpInfo) -> list:
    """Condition replicated; both branches reduced alike, or (avg/max/min) one with R."""
    found = elementwise(info)
    branches = {1, 2} & set(_tensor_positions(info))
    if branches == {1, 2}:
        found += [partial_strategy(info, k, {1, 2}) for k in _FLIP]
    found += [partial_strategy(info, k, {b}) for k in ("avg", "max", "min") for b in branches]
    return found


register(  # elementwise, no Partial passes through
    aten.rsub.Scalar, aten.rsqrt.default, aten.sqrt.default, aten.log.default,
    aten.reciprocal.default, aten.abs.default, aten.sin.default, aten.cos.default,
    aten.erf.default, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.gelu.default,
    aten.silu.default, aten.dropout.default, aten.native_dropout.default,
    aten.maximum.default, aten.minimum.default, aten.max.other, aten.min.other,
    aten.logical_not.default,
    aten.eq.Scalar, aten.eq.Tensor, aten.ne.Scalar, aten.ne.Tensor, aten.lt.Scalar,
    aten.lt.Tensor, aten.le.Scalar, aten.le.Tensor, aten.gt.Scalar, aten.gt.Tensor,
    aten.ge.Scalar, aten.ge.Tensor, aten.zeros_like.default, aten.ones_like.default,
    aten.full_like.default, aten.acos.default, aten.acosh.default, aten.asin.default,
    aten.atanh.default, aten.cosh.default, aten.sinh.default, aten.tan.default, aten.log10.default,
    aten.log1p.default, aten.log2.default, aten.atan2.default, aten.atan2.out,
    aten.div.Tensor_mode, aten.div.Scalar_mode, aten.floor_divide.default, aten.fmod.Tensor,
    aten.fmod.Scalar, aten.remainder.Tensor, aten.remainder.Scalar, aten.pow.Scalar,
    aten.square.default, aten.elu.default, aten.leaky_relu.default, aten.isinf.default,
    aten.isnan.default, aten.bitwise_and.Tensor, aten.bitwise_and.Scalar, aten.bitwise_or.Tensor,
    aten.bitwise_or.Scalar, aten.bitwise_xor.Tensor, aten.bitwise_xor.Scalar,
    aten.bitwise_not.default, aten.__and__.Tensor, aten.logical_and.default,
    aten.logical_or.default, aten.logical_xor.default,
)(elementwise)
register(aten.empty_like.default, random=True)(elementwise)   # values unspecified
