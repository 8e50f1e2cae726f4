"""Sharding rules of ops over the trailing spatial dims of ``[N, C, *spatial]`` images:
pooling (and its backward), upsampling, padding, grid sampling, col2im.

Each output pixel reads a window of the input's spatial dims, so those dims do not shard
(a rank would need its neighbours' border pixels); every leading dim (batch, channels) does,
on every tensor input alike. Pooling by average, upsampling, col2im and grid sampling are
linear in the image: a ``P(sum)`` or ``P(avg)`` image gives the same Partial. The kernels
refuse empty images, so a dim shards only where every rank holds some of it (``nonempty``). Padding and
nearest/reflect/replicate copies move elements, so any Partial passes, except that a
constant pad value is added once per rank: a ``P(sum)`` passes only a zero pad.
"""
from __future__ import annotations

import torch

from .registry import (R, OpInfo, Strategy, arg, like_out, nonempty, register, replicated,
                       tensor_inputs)
from autopar.placement import Partial, Shard

aten = torch.ops.aten
_LINEAR = ("sum", "avg")

# op -> (spatial dims, Partial kinds of the first input passing through)
_WINDOW = {
    aten._adaptive_avg_pool2d.default: (2, _LINEAR), aten._adaptive_avg_pool3d.default: (3, _LINEAR),
    aten._adaptive_avg_pool2d_backward.default: (2, _LINEAR),
    aten.avg_pool2d.default: (2, _LINEAR), aten.avg_pool3d.default: (3, _LINEAR),
    aten.avg_pool2d_backward.default: (2, _LINEAR),
    aten.max_pool2d_with_indices.default: (2, ()), aten.max_pool3d_with_indices.default: (3, ()),
    aten.max_pool2d_with_indices_backward.default: (2, _LINEAR),
    aten.upsample_bilinear2d.vec: (2, _LINEAR), aten.upsample_nearest2d.vec: (2, _LINEAR),
    aten.reflection_pad1d.default: (1, ("sum", "avg", "max", "min")),
    aten.reflection_pad2d.default: (2, ("sum", "avg", "max", "min")),
    aten.reflection_pad3d.default: (3, ("sum", "avg", "max", "min")),
    aten.replication_pad2d.default: (2, ("sum", "avg", "max", "min")),
    aten.replication_pad3d.default: (3, ("sum", "avg", "max", "min")),
}


def leading(info: OpInfo, spatial: int, kinds) -> list:
    """Every dim before the last ``spatial`` ones sharded on all tensor inputs alike; the
    first input Partial (the others replicated) for each of ``kinds``."""
    ins = tensor_inputs(info)
    x, k = ins[0], len(ins)
    found = [replicated(info)]
    found += [Strategy((Partial(p),) + (R,) * (k - 1), like_out(info, Partial(p))) for p in kinds]
    for d in range(x.ndim - spatial):
        if nonempty(x.shape[d], info.n):
            found.append(Strategy((Shard(d),) * k, like_out(info, Shard(d))))
    return found


@register(*_WINDOW)
def window(info: OpInfo) -> list:
    return leading(info, *_WINDOW[info.target])


@register(aten.constant_pad_nd.default, aten.pad.default)
def pad(info: OpInfo) -> list:
    """``pad`` lists (before, after) pairs from the last dim backwards; a dim padded by (0, 0)
    is left as it is and shards like a leading dim (Mamba-2 pads a 4-D tensor's sequence dim
    alone, listing zero pairs for the others)."""
    pads = info.args[1]
    mode = arg(info, 2, "mode", "constant") if info.target == aten.pad.default else "constant"
    value = arg(info, 2 if info.target == aten.constant_pad_nd.default else 3, "value", 0) or 0
    kinds = ("sum", "avg", "max", "min") if mode != "constant" or value == 0 else ("avg", "max", "min")
    found = leading(info, len(pads) // 2, kinds)
    x = tensor_inputs(info)[0]
    for i in range(min(len(pads) // 2, x.ndim)):
        d = x.ndim - 1 - i
        if all(isinstance(p, int) and p == 0 for p in pads[2 * i:2 * i + 2]) and nonempty(x.shape[d], info.n):
            found.append(Strategy((Shard(d),), Shard(d)))
    return found


@register(aten.grid_sampler_2d.default)
def grid_sampler(info: OpInfo) -> list:
    """input[N, C, H, W] sampled at grid[N, Ho, Wo, 2]: the batch shards on both, the
    channels on the input alone."""
    x = info.args[0]
    found = [replicated(info)] + [Strategy((Partial(p), R), Partial(p)) for p in _LINEAR]
    if nonempty(x.shape[0], info.n):
        found.append(Strategy((Shard(0), Shard(0)), Shard(0)))
    if nonempty(x.shape[1], info.n):
        found.append(Strategy((Shard(1), R), Shard(1)))
    return found


@register(aten.col2im.default)
def col2im(info: OpInfo) -> list:
    """columns[N, C*kh*kw, L] -> image[N, C, H, W]: only the batch shards (a rank's share of
    the column dim is not whole channels)."""
    x = info.args[0]
    found = [replicated(info)] + [Strategy((Partial(p),), Partial(p)) for p in _LINEAR]
    if x.ndim == 3 and nonempty(x.shape[0], info.n):
        found.append(Strategy((Shard(0),), Shard(0)))
    return found
