"""Sharding rules of reductions and of the normalizations built on them.

A shard of a dim that is NOT reduced survives (moving left by the reduced dims before it,
unless ``keepdim``). A shard of a reduced dim leaves each rank a partial result: ``sum`` ->
``P(sum)``; ``mean`` -> ``P(avg)``, right only when every rank holds the same number of
elements (the mean of uneven chunks' means is not the mean); ``amax``/``amin`` ->
``P(max)``/``P(min)``, right only when no rank's chunk is empty. Ops whose result needs the
whole reduced dim at once (var, max with indices, argmax, prod, any, softmax, cumsum, an FFT,
layer_norm, rms_norm) do not shard it. Linear reductions (sum, mean, cumsum) pass ``P(sum)``
and ``P(avg)`` through; amax passes ``P(max)`` and amin ``P(min)``.

Normalizations shard the dims their statistics are not taken over: the leading dims of
layer_norm (and its backward, whose weight and bias gradients are then sums over ranks),
the batch of group_norm (and its channels when whole groups fall on each rank), the
channels of batch_norm (and, with frozen statistics, every other dim).
"""
from __future__ import annotations

import torch

from .registry import (R, OpInfo, Strategy, arg, even, like_out, nonempty, norm_dim, register,
                       register_localize, replicated, shardable_dims, tensor_inputs)
from autopar.placement import Partial, Shard
from autopar.sizes import local_size

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
    if info.target in (aten.sum.default, aten.mean.default, aten.any.default, aten.prod.default):
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
          aten.std.correction, aten.var_mean.correction, aten.argmax.default, aten.argmin.default,
          aten.prod.default, aten.prod.dim_int, aten.any.default, aten.any.dim, aten.any.dims)
def whole_dim_reduction(info: OpInfo) -> list:
    """Indices (max.dim, argmax), spreads (var), products and a bool ``any`` (no Partial on
    bools) need the whole reduced dim: shard the others."""
    return reduce_strategies(info, *_dims_keepdim(info))


@register(aten._softmax.default, aten.softmax.int, aten._log_softmax.default,
          aten.log_softmax.int)
def softmax(info: OpInfo) -> list:
    return reduce_strategies(info, arg(info, 1, "dim"), True)


@register(aten._fft_r2c.default, aten._fft_c2r.default)
def fft(info: OpInfo) -> list:
    """Along ``dim`` the transform needs the whole input: shard the others, where no rank's
    piece is empty (the FFT kernels refuse an empty batch)."""
    x = info.args[0]
    return [s for s in reduce_strategies(info, arg(info, 1, "dim"), True)
            if not isinstance(s.inputs[0], Shard) or nonempty(x.shape[s.inputs[0].dim], info.n)]


@register(aten.cumsum.default)
def cumsum(info: OpInfo) -> list:
    return reduce_strategies(info, arg(info, 1, "dim"), True, None, (Partial("sum"), Partial("avg")))


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


@register(aten.native_layer_norm_backward.default)
def layer_norm_backward(info: OpInfo) -> list:
    """(grad_out, input, shape, mean, rstd, weight, bias) -> (d input, d weight, d bias): a
    leading dim shards the rows; each rank's weight and bias gradients are its rows' sums."""
    x, k = info.args[0], len(arg(info, 2, "normalized_shape"))
    found, rest = [replicated(info)], (R,) * (len(tensor_inputs(info)) - 4)
    for d in shardable_dims(x.shape[:x.ndim - k]):
        found.append(Strategy((Shard(d),) * 4 + rest, (Shard(d), Partial(), Partial())))
    return found


@register(aten.native_group_norm.default)
def group_norm(info: OpInfo) -> list:
    """(input[N, C, *], weight, bias, N, C, HxW, group) -> (out, mean[N, group], rstd): the
    batch shards; the channels do when channels and groups divide evenly (each rank holds
    whole groups). ``localize`` rewrites N, C and group."""
    x, groups = info.args[0], arg(info, 6, "group")
    found, k = [replicated(info)], len(tensor_inputs(info)) - 1
    if x.shape[0] > 1:
        found.append(Strategy((Shard(0),) + (R,) * k, like_out(info, Shard(0))))
    if groups > 1 and even(x.shape[1], info.n) and even(groups, info.n):
        found.append(Strategy((Shard(1),) + (Shard(0),) * k, like_out(info, Shard(1))))
    return found


@register(aten.native_group_norm_backward.default)
def group_norm_backward(info: OpInfo) -> list:
    """(grad_out, input, mean, rstd, weight, N, ...): the batch shards; the weight and bias
    gradients are sums over ranks."""
    found = [replicated(info)]
    if info.args[0].shape[0] > 1:
        ins = (Shard(0),) * 4 + (R,) * (len(tensor_inputs(info)) - 4)
        found.append(Strategy(ins, (Shard(0), Partial(), Partial())))
    return found


@register_localize(aten.native_group_norm.default, aten.native_group_norm_backward.default)
def localize_group_norm(info, strategy, n, index):
    """N (and with the channels sharded C and group) at the rank's share."""
    pos = 3 if info.target == aten.native_group_norm.default else 5
    args, kwargs = list(info.args), dict(info.kwargs)
    if strategy.inputs[0] == Shard(0):
        args[pos] = local_size(args[pos], n, index)
    elif strategy.inputs[0] == Shard(1):
        args[pos + 1], args[pos + 3] = args[pos + 1] // n, args[pos + 3] // n
    return tuple(args), kwargs


@register(aten._native_batch_norm_legit.default, aten._native_batch_norm_legit.no_stats,
          aten._native_batch_norm_legit_no_training.default)
def batch_norm_legit(info: OpInfo) -> list:
    """input[N, C, *] with per-channel tensors -> (out, saved mean, saved rstd): the channels
    shard (each rank its channels' statistics, its slice of the running ones); with frozen
    statistics (not training: the saved tensors are empty) every other dim shards too."""
    x, k = info.args[0], len(tensor_inputs(info)) - 1
    training = info.target != aten._native_batch_norm_legit_no_training.default and \
        arg(info, 5 if info.target == aten._native_batch_norm_legit.default else 3, "training")
    saved = Shard(0) if training else R
    found = [replicated(info)]
    if x.ndim > 1 and x.shape[1] > 1:
        found.append(Strategy((Shard(1),) + (Shard(0),) * k, (Shard(1), saved, saved)))
    if not training:
        found += [Strategy((Shard(d),) + (R,) * k, (Shard(d), R, R))
                  for d in shardable_dims(x.shape) if d != 1]
    return found
