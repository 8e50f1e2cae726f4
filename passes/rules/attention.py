"""Sharding rule of ``scaled_dot_product_attention(q, k, v, attn_mask, ...)``.

q is ``(..., L, E)``, k ``(..., S, E)``, v ``(..., S, Ev)``, the output ``(..., L, Ev)``.
Attention is independent across the leading (batch, head) dims, so sharding one of them
alike on q, k, v (and on the mask where it has that dim) shards the output there; heads are
only sharded when q and k/v have the same number (grouped-query attention with fewer k/v
heads would need each rank's q heads to match its k/v groups). Each query row is
independent too: without a causal flag (whose mask depends on the row's global position),
q sharded along L with k, v replicated gives the output sharded along L. The output is
linear in v: a Partial v with q, k replicated gives the same Partial.

Dropout inside attention draws random numbers: as for ``dropout``, arranging the RNG
across ranks is the lowering's job.
"""
from __future__ import annotations

import torch

from .registry import R, OpInfo, Strategy, arg, register, replicated, tensor_inputs
from autopar.placement import Partial, Shard

aten = torch.ops.aten


@register(aten.scaled_dot_product_attention.default)
def sdpa(info: OpInfo) -> list:
    q, k, v = info.args[:3]
    mask = arg(info, 3, "attn_mask")
    has_mask = len(tensor_inputs(info)) == 4

    def mask_at(d):   # the mask broadcasts against the (..., L, S) scores
        md = d - (q.ndim - mask.ndim) if has_mask else -1
        return (Shard(md) if md >= 0 and mask.shape[md] == q.shape[d] else R,) if has_mask else ()

    found = [replicated(info)]
    for d in range(q.ndim - 2):
        if q.shape[d] == k.shape[d] == v.shape[d] > 1:
            found.append(Strategy((Shard(d),) * 3 + mask_at(d), Shard(d)))
    if not arg(info, 5, "is_causal", False) and q.shape[-2] > 1:
        found.append(Strategy((Shard(q.ndim - 2), R, R) + mask_at(q.ndim - 2), Shard(q.ndim - 2)))
    found += [Strategy((R, R, Partial(kind)) + (R,) * has_mask, Partial(kind))
              for kind in ("sum", "avg")]
    return found
