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

from .registry import PARTIALS, R, OpInfo, Strategy, register, replicated, shardable_dims
from autopar.placement import Shard

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
