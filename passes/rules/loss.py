"""Sharding rules of loss functions: each sample's loss is independent of the others'.

Sharding a non-class dim of the input alike on the target gives, per ``reduction``: none
(0) -> the per-sample losses sharded; mean (1) -> ``P(avg)``; sum (2) -> ``P(sum)``.
``P(avg)`` is right when every rank averages over the same count: the sharded dim divides
evenly, no class weights (a weighted mean divides by the rank's own weight total), and as
many ignored targets (``ignore_index``) on every rank -- the rule cannot see target values,
so with ignored targets the caller must reduce with the counts (a sum and a count).

The class dim sharded is vocab-parallel cross-entropy (a max and a sum across ranks inside
the softmax), not a plain run of the op on local pieces: it is that lowering's job.
"""
from __future__ import annotations

import torch

from .registry import R, OpInfo, Strategy, arg, even, register, replicated, shardable_dims
from autopar.placement import Partial, Shard

aten = torch.ops.aten


def _reduced(info: OpInfo, size: int, reduction_pos: int, weighted: bool):
    reduction = arg(info, reduction_pos, "reduction", 1)
    if reduction == 2:
        return Partial("sum")
    if reduction == 1:
        return Partial("avg") if even(size, info.n) and not weighted else None
    return True


@register(aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default)
def class_loss(info: OpInfo) -> list:
    """input ``(N, C, d1, ...)`` with target ``(N, d1, ...)`` (class indices) or of the
    input's shape (probabilities); an unbatched ``(C,)`` input only replicates."""
    x, target = info.args[0], info.args[1]
    weighted = arg(info, 2, "weight") is not None
    found = [replicated(info)]
    for d in shardable_dims(x.shape) if x.ndim > 1 else []:
        if d == 1:
            continue
        td = d if target.ndim == x.ndim or d == 0 else d - 1
        out = _reduced(info, x.shape[d], 3, weighted)
        if out is not None:
            out = Shard(d if d == 0 else d - 1) if out is True else out
            found.append(Strategy((Shard(d), Shard(td)) + (R,) * weighted, out))
    return found


@register(aten.mse_loss.default)
def mse_loss(info: OpInfo) -> list:
    x, target = info.args[0], info.args[1]
    found = [replicated(info)]
    for d in shardable_dims(x.shape) if x.shape == target.shape else []:
        out = _reduced(info, x.shape[d], 2, False)
        if out is not None:
            found.append(Strategy((Shard(d), Shard(d)), Shard(d) if out is True else out))
    return found
