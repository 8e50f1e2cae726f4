"""Sharding rules of ops that create a tensor from sizes: zeros, ones, full, arange, new_*.

Their output can be made directly in any layout: each rank creates its own piece, with the
sizes (and arange's bounds) rewritten by ``localize`` to the rank's share. ``new_*`` read
only their input's dtype and device; the rule lets it be laid out in any way.
``arange(end)`` has no start argument to move, so it is only offered replicated; the
``start`` overloads shard (integer bounds only, where the rank's bounds are exact).
``empty`` and ``new_empty`` shard like ``zeros`` (their values are unspecified: any layout of
the output is right once its local shape is; a model fills it afterwards, as DeepSeek-V3's
attention writes the two halves of its keys into one). Random factories (``rand``, ``randn``,
``randperm``) are replicated only: ranks draw alike from the same seed, and the rng pass
arranges per-rank draws for dropout alone; ``empty_strided``'s and ``new_empty_strided``'s
strides are global.
"""
from __future__ import annotations

import torch

from .registry import (R, OpInfo, Strategy, arg, local_size, register, register_localize,
                       replicated, shardable_dims, tensor_inputs, unread, with_arg)
from autopar.placement import Shard
from autopar.sizes import chunk_range

aten = torch.ops.aten
_SIZE_POS = {aten.zeros.default: 0, aten.ones.default: 0, aten.full.default: 0,
             aten.new_zeros.default: 1, aten.new_ones.default: 1, aten.new_full.default: 1,
             aten.empty.memory_format: 0, aten.new_empty.default: 1}
_UNSPECIFIED = (aten.empty.memory_format, aten.new_empty.default)


@register(*(op for op in _SIZE_POS if op not in _UNSPECIFIED), aten.scalar_tensor.default,
          aten.arange.default, aten.arange.start, aten.arange.start_step)
def factory(info: OpInfo) -> list:
    found = [replicated(info)]
    if info.target in (aten.arange.start, aten.arange.start_step):
        if not all(isinstance(a, int) for a in info.args[:3]):
            return found
    elif info.target not in _SIZE_POS:
        return found
    outs = [R] + [Shard(d) for d in shardable_dims(info.out.shape)]
    ins = tensor_inputs(info)
    if not ins:
        return found + [Strategy((), p) for p in outs]
    pairs = [(p, q) for p in unread(ins[0]) for q in outs]
    pairs.sort(key=lambda pq: pq[0] != pq[1])    # first: the output laid out as the input
    return found + [Strategy((p,), q) for p, q in pairs]


register(*_UNSPECIFIED, random=True)(factory)


@register(aten.rand.default, aten.randn.default, aten.randperm.default,
          aten.empty_strided.default, aten.new_empty_strided.default, random=True)
def random_factory(info: OpInfo) -> list:
    return [replicated(info)]


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
