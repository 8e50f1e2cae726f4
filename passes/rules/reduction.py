"""Sharding rules of reductions and of the normalizations built on them.

A shard of a dim that is NOT reduced survives (moving left by the reduced dims before it,
unless ``keepdim``). A shard of a reduced dim leaves each rank a partial result: ``sum`` ->
``P(sum)``; ``mean`` -> ``P(avg)``, right only when every rank holds the same number of
elements (the mean of uneven chunks' means is not the mean); ``amax``/``amin`` ->
``P(max)``/``P(min)``, right only when no rank's chunk is empty. Ops whose result needs the
whole reduced dim at once (var, max with indices, softmax, layer_norm, rms_norm) do not shard
it. Linear reductions (sum, mean) pass ``P(sum)`` and ``P(avg)`` through; amax passes
``P(max)`` and amin ``P(min)``.
"""
from __future__ import annotations

import torch

from .registry import (OpInfo, Strategy, arg, even, like_out, nonempty, norm_dim, register,
                       replicated, shardable_dims)
from autopar.placement import Partial, Shard

aten = torch.ops.aten
_KEEPDIM_POS = {aten.var.dim: 3, aten.std.dim: 3, aten.var.correction: None,
                aten.std.correction: None, aten.var_mean.correction: None}



def reduce_strategies(info: OpInfo, dims, keepdim: bool, on_reduced=None, passthrough=()) -> list:
    """Strategies of a reduction of ``info.args[0]`` over ``dims`` (None or [] = all):
    ``on_reduced(size)`` is the output placement when a reduced dim of ``size`` is sharded
    (None: not offered)."""
    x = info.args[0]
    dims = set(range(x.ndim)) if not dims and dims != 0 else \
        {norm_dim(d, x.ndim) for d in ([dims] if isinstance(dims, int) else dims)}
    found = [replicated(info)] + [Strategy((p,), like_out(info, p)) for p in passthrough]
    for d in shardable_dims(x.shape):
        if d not in dims:
            found.append(Strategy((Shard(d),), like_out(info, Shard(
                d if keepdim else d - sum(1 for r in dims if r < d)))))
        elif on_reduced is not None and on_reduced(x.shape[d], info.n) is not None:
            found.append(Strategy((Shard(d),), like_out(info, on_reduced(x.shape[d], info.n))))
    return found


def _dims_keepdim(info: OpInfo):
    if info.target in (aten.sum.default, aten.mean.default):
        return None, False
    pos = _KEEPDIM_POS.get(info.target, 2)
    return arg(info, 1, "dim"), bool(arg(info, pos if pos else 99, "keepdim", False))


@register(aten.sum.default, aten.sum.dim_IntList)
def sum_(info: OpInfo) -> list:
    return reduce_strategies(info, *_dims_keepdim(info), lambda size, n: Partial("sum"),
                             (Partial("sum"), Partial("avg")))


@register(aten.mean.default, aten.mean.dim)
def mean(info: OpInfo) -> list:
    return reduce_strategies(info, *_dims_keepdim(info),
                             lambda size, n: Partial("avg") if even(size, n) else None,
                             (Partial("sum"), Partial("avg")))


@register(aten.amax.default, aten.amin.default)
def amax_amin(info: OpInfo) -> list:
    p = Partial("max" if info.target == aten.amax.default else "min")
    return reduce_strategies(info, *_dims_keepdim(info),
                             lambda size, n: p if nonempty(size, n) else None, (p,))


@register(aten.max.dim, aten.min.dim, aten.var.dim, aten.std.dim, aten.var.correction,
          aten.std.correction, aten.var_mean.correction)
def whole_dim_reduction(info: OpInfo) -> list:
    """Indices (max.dim) and spreads (var) need the whole reduced dim: shard the others."""
    return reduce_strategies(info, *_dims_keepdim(info))


@register(aten._softmax.default, aten.softmax.int, aten._log_softmax.default,
          aten.log_softmax.int)
def softmax(info: OpInfo) -> list:
    return reduce_strategies(info, arg(info, 1, "dim"), True)


@register(aten.layer_norm.default, aten.native_layer_norm.default, aten.rms_norm.default)
def norm(info: OpInfo) -> list:
    """x[..., *normalized_shape]: leading dims shard (statistics are per row; native_layer_norm's
    mean and rstd keep the leading dims); weight and bias stay replicated."""
    x, k = info.args[0], len(arg(info, 1, "normalized_shape"))
    found = [replicated(info)]
    rest = tuple(replicated(info).inputs[1:])
    for d in shardable_dims(x.shape[:x.ndim - k]):
        found.append(Strategy((Shard(d),) + rest, like_out(info, Shard(d))))
    return found


@register(aten.batch_norm.default)
def batch_norm(info: OpInfo) -> list:
    """x[N, C, ...] with frozen statistics (``training=False``: eval mode, running mean and
    variance as constants) is a per-channel affine map: any dim but the channels shards, the
    per-channel tensors stay replicated. In training mode the statistics are taken over the
    batch: no sharded strategy (capture refuses the running-statistics update anyway)."""
    x = info.args[0]
    found = [replicated(info)]
    if arg(info, 5, "training"):
        return found
    rest = tuple(replicated(info).inputs[1:])
    for d in shardable_dims(x.shape):
        if d != 1:
            found.append(Strategy((Shard(d),) + rest, like_out(info, Shard(d))))
    return found
