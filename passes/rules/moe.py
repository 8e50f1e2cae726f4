"""Sharding rule of the grouped matrix product of mixture-of-experts layers, an op of
Hugging Face ``transformers`` (``torch.ops.transformers.grouped_mm_fallback``, its eager
fallback for ``torch._grouped_mm``):

    grouped_mm_fallback(input[S, K], weight[E, K, N], offs[E]) -> out[S, N]
    out[offs[e-1]:offs[e]] = input[offs[e-1]:offs[e]] @ weight[e]

(the tokens sorted by expert, ``offs`` the running count of tokens per expert). Across the
experts it is a product like ``mm``: the output features ``N`` shard with the weight's (each
expert column-parallel), the contracted ``K`` with input and weight alike gives a partial
product (row-parallel, ``P(sum)``), and it is linear in input and in weight. The token dim
does not shard: ``offs`` holds global positions in the token list, which a rank's slice of
it does not start at (the offsets would have to be rebased per rank, and they are data).

The op exists only once ``transformers`` is imported, and autopar never imports it: the rule
is registered under the op's name, ``str(op)``, which the registry matches when a captured
graph carries the op. Nothing needs to happen when (or whether) the library loads.
"""
from __future__ import annotations

from .registry import R, OpInfo, Strategy, register, replicated
from autopar.placement import Partial, Shard

GROUPED_MM = "transformers.grouped_mm_fallback.default"


@register(GROUPED_MM)
def grouped_mm(info: OpInfo) -> list:
    x, w = info.args[0], info.args[1]
    found = [replicated(info)]
    if w.shape[2] > 1:
        found.append(Strategy((R, Shard(2), R), Shard(1)))
    if x.shape[1] > 1:
        found.append(Strategy((Shard(1), Shard(1), R), Partial()))
    for kind in ("sum", "avg"):
        found += [Strategy((Partial(kind), R, R), Partial(kind)), Strategy((R, Partial(kind), R), Partial(kind))]
    return found
