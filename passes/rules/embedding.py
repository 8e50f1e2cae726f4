"""Sharding rule of the embedding lookup ``weight[vocab, dim][indices] -> indices.shape + (dim,)``.

Indices sharded along any dim give the output sharded along the same dim (each rank looks up
its own tokens); the weight sharded along its embedding dim (dim 1) gives the output sharded
along its last dim. A lookup commutes with any elementwise reduction across ranks, so a
Partial weight gives the same Partial output.

The weight sharded along the vocabulary (dim 0) is deliberately absent: a rank holding rows
[lo, hi) must mask out-of-range tokens to zero and the results be summed, which is not a
plain run of the op on local pieces; that is the vocab-parallel embedding lowering's job.
"""
from __future__ import annotations

import torch

from .registry import (PARTIALS, R, OpInfo, Strategy, arg, nonempty, register, replicated,
                       shardable_dims, tensor_inputs)
from autopar.placement import Partial, Shard

aten = torch.ops.aten


@register(aten.embedding.default)
def embedding(info: OpInfo) -> list:
    weight, indices = info.args[0], info.args[1]
    found = [replicated(info)]
    found += [Strategy((R, Shard(d)), Shard(d)) for d in shardable_dims(indices.shape)]
    if weight.shape[1] > 1:
        found.append(Strategy((Shard(1), R), Shard(indices.ndim)))
    found += [Strategy((p, R), p) for p in PARTIALS]
    return found


@register(aten.embedding_dense_backward.default)
def embedding_backward(info: OpInfo) -> list:
    grad, indices = info.args[0], info.args[1]
    found = [replicated(info)] + [Strategy((Partial(p), R), Partial(p)) for p in ("sum", "avg")]
    if not arg(info, 4, "scale_grad_by_freq"):
        found += [Strategy((Shard(d), Shard(d)), Partial()) for d in shardable_dims(indices.shape)]
    if grad.shape[-1] > 1:
        found.append(Strategy((Shard(grad.ndim - 1), R), Shard(1)))
    return found


@register(aten._embedding_bag.default)
def embedding_bag(info: OpInfo) -> list:
    """(weight, indices, offsets, ..., mode, ...) -> (out, offset2bag, bag_size, max_indices)."""
    weight, k, mode = info.args[0], len(tensor_inputs(info)), arg(info, 4, "mode", 0)
    found = [replicated(info)]
    if nonempty(weight.shape[1], info.n):   # the kernel refuses an empty table
        found.append(Strategy((Shard(1),) + (R,) * (k - 1), (Shard(1), R, R, Shard(1) if mode == 2 else R)))
    if mode != 2:
        found += [Strategy((Partial(p),) + (R,) * (k - 1), (Partial(p), R, R, R)) for p in ("sum", "avg")]
    return found
