"""Sharding rules of ops that create a tensor from sizes: zeros, ones, full, arange, new_*.

Their output can be made directly in any layout: each rank creates its own piece, with the
sizes (and arange's bounds) rewritten by ``localize`` to the rank's share. ``new_*`` read
only their input's dtype and device; the rule lists it replicated.
``arange(end)`` has no start argument to move, so it is only offered replicated; the
``start`` overloads shard (integer bounds only, where the rank's bounds are exact).
"""
from __future__ import annotations

import torch

from .registry import (OpInfo, Strategy, arg, local_size, register, register_localize,
                       replicated, shardable_dims, with_arg)
from autopar.placement import Shard
from autopar.sizes import chunk_range

aten = torch.ops.aten
_SIZE_POS = {aten.zeros.default: 0, aten.ones.default: 0, aten.full.default: 0,
             aten.new_zeros.default: 1, aten.new_ones.default: 1, aten.new_full.default: 1}


@register(*_SIZE_POS, aten.scalar_tensor.default, aten.arange.default, aten.arange.start,
          aten.arange.start_step)
def factory(info: OpInfo) -> list:
    found = [replicated(info)]
    if info.target in (aten.arange.start, aten.arange.start_step):
        if not all(isinstance(a, int) for a in info.args[:3]):
            return found
    elif info.target not in _SIZE_POS:
        return found
    rest = replicated(info).inputs
    return found + [Strategy(rest, Shard(d)) for d in shardable_dims(info.out.shape)]


@register_localize(*_SIZE_POS)
def localize_size(info: OpInfo, strategy: Strategy, n: int, index: int):
    pos = _SIZE_POS[info.target]
    size = list(info.out.shape)
    if isinstance(strategy.output, Shard):
        size[strategy.output.dim] = local_size(size[strategy.output.dim], n, index)
    return with_arg(info, pos, "size", size)


@register_localize(aten.arange.start, aten.arange.start_step)
def localize_arange(info: OpInfo, strategy: Strategy, n: int, index: int):
    if not isinstance(strategy.output, Shard):
        return info.args, dict(info.kwargs)
    start, step = info.args[0], arg(info, 2, "step", 1)
    lo, hi = chunk_range(info.out.shape[0], n, index)
    args, kwargs = with_arg(info, 0, "start", start + lo * step)
    return with_arg(OpInfo(info.target, args, kwargs, info.out), 1, "end", start + hi * step)
