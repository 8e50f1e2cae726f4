"""Sharding rule of ``scaled_dot_product_attention(q, k, v, attn_mask, ...)``.

q is ``(..., L, E)``, k ``(..., S, E)``, v ``(..., S, Ev)``, the output ``(..., L, Ev)``.
Attention is independent across the leading (batch, head) dims, so sharding one of them
alike on q, k, v (and on the mask where it has that dim) shards the output there. Under
``enable_gqa`` k/v carry fewer heads than q (grouped-query attention: q head ``j`` reads k/v head
``j // (m / n)``); the heads shard alike when both counts divide by the axis size, so that every
rank's q heads read exactly its k/v heads (Megatron's split; with fewer k/v heads than ranks,
``passes/kv_heads.py`` gives each rank its k/v heads before the op). Each query row is
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
        if q.shape[d] == k.shape[d] == v.shape[d] > 1 or (d == q.ndim - 3 and _grouped_heads(info, q, k, v)):
            found.append(Strategy((Shard(d),) * 3 + mask_at(d), Shard(d)))
    if not arg(info, 5, "is_causal", False) and q.shape[-2] > 1:
        found.append(Strategy((Shard(q.ndim - 2), R, R) + mask_at(q.ndim - 2), Shard(q.ndim - 2)))
    found += [Strategy((R, R, Partial(kind)) + (R,) * has_mask, Partial(kind))
              for kind in ("sum", "avg")]
    return found


def _grouped_heads(info: OpInfo, q, k, v) -> bool:
    """enable_gqa with m q heads over n k/v heads, both dividing by the axis size (then each
    rank's m/t q heads are the groups of its n/t k/v heads)."""
    m, n, t = q.shape[-3], k.shape[-3], info.n
    return (bool(arg(info, 99, "enable_gqa", False)) and t is not None and k.shape[-3] == v.shape[-3]
            and m % n == 0 and m % t == 0 and n % t == 0)
