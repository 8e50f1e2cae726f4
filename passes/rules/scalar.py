"""Sharding rules of ops whose result is a Python number: a tensor's size, element count,
stride or single value.

The number is the same on every rank (``R``) only where the ranks' pieces agree on it: the
size of a dim other than the sharded one, of any dim of an addend (a Partial piece has the
whole shape). ``item()`` (``_local_scalar_dense``) reads the value, which only a replicated
tensor holds whole; strides and the storage offset describe one tensor's memory, not its
pieces': replicated only.
"""
from __future__ import annotations

import torch

from .registry import PARTIALS, R, OpInfo, Strategy, norm_dim, register, replicated, shardable_dims
from autopar.placement import Shard

aten = torch.ops.aten


@register(aten.sym_size.int, aten.sym_numel.default)
def size(info: OpInfo) -> list:
    x = info.args[0]
    found = [replicated(info)] + [Strategy((p,), R) for p in PARTIALS]
    if info.target == aten.sym_size.int:
        dim = norm_dim(info.args[1], x.ndim)
        found += [Strategy((Shard(d),), R) for d in shardable_dims(x.shape) if d != dim]
    return found


@register(aten._local_scalar_dense.default, aten.sym_stride.int, aten.sym_storage_offset.default)
def whole(info: OpInfo) -> list:
    return [replicated(info)]
