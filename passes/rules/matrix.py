"""Sharding rules of matrix products, each described by an einsum-like string.

From ``"Bmk,kn->Bmn"`` the strategies follow generically, one per letter:
  * a letter of the output (batch ``B``, rows ``m``, columns ``n``): shard it in the output
    and in every operand holding it at full size; operands that lack it (or broadcast it
    from size 1) stay replicated;
  * a contraction letter (``k``): shard it in every operand holding it, the others
    replicated; each rank then holds a partial product, so the output is ``P(sum)``;
  * a product is linear in each operand: one operand ``P(sum)`` or ``P(avg)``, the others
    replicated, gives the same Partial.
An additive term (``addmm``'s and ``linear``'s bias, ``None`` in the operand list) is aligned
to the output's trailing letters. Where the output is a ``P(sum)`` the bias must be one too
(a replicated bias would be added on every rank); an average tolerates a replicated bias.
"""
from __future__ import annotations

import torch

from .registry import R, OpInfo, Strategy, register, replicated, tensor_inputs
from autopar.placement import Partial, Shard

aten = torch.ops.aten
_BATCH = "ABCDEFGHIJ"


def einsum_strategies(info: OpInfo, terms: list, out_letters: str) -> list:
    """Strategies of a product whose tensor inputs (in strategy order) have the letters
    ``terms`` (``None`` = an additive bias) and whose output has ``out_letters``."""
    ins, out = tensor_inputs(info), info.out.shape
    letters = [t if t is not None else out_letters[len(out_letters) - x.ndim:]
               for t, x in zip(terms, ins)]
    found = [replicated(info)]
    for c in dict.fromkeys("".join(out_letters) + "".join(t for t in terms if t)):
        if c in out_letters:
            size = out[out_letters.index(c)]
            pl = [Shard(t.index(c)) if c in t and x.shape[t.index(c)] == size else R
                  for t, x in zip(letters, ins)]
            output = Shard(out_letters.index(c))
        else:                                   # contracted: each rank a partial product
            size = next(x.shape[t.index(c)] for t, x in zip(letters, ins) if c in t)
            pl = [Shard(t.index(c)) if c in t else Partial() if term is None else R
                  for t, term in zip(letters, terms)]
            output = Partial()
        if size > 1:
            found.append(Strategy(tuple(pl), output))
    for i, t in enumerate(terms):              # linear in each factor
        if t is None:
            continue
        for kind, bias in (("sum", Partial()), ("avg", R)):
            pl = [Partial(kind) if j == i else bias if u is None else R for j, u in enumerate(terms)]
            found.append(Strategy(tuple(pl), Partial(kind)))
    return found


@register(aten.mm.default)
def mm(info: OpInfo) -> list:
    return einsum_strategies(info, ["mk", "kn"], "mn")


@register(aten.bmm.default)
def bmm(info: OpInfo) -> list:
    return einsum_strategies(info, ["bmk", "bkn"], "bmn")


@register(aten.addmm.default)
def addmm(info: OpInfo) -> list:
    return einsum_strategies(info, [None, "mk", "kn"], "mn")


@register(aten.baddbmm.default)
def baddbmm(info: OpInfo) -> list:
    return einsum_strategies(info, [None, "bmk", "bkn"], "bmn")


@register(aten.linear.default)
def linear(info: OpInfo) -> list:
    """x[..., k] @ weight[n, k]^T (+ bias[n]) -> [..., n]."""
    batch = _BATCH[:info.args[0].ndim - 1]
    terms = [batch + "k", "nk"] + [None] * (len(tensor_inputs(info)) - 2)
    return einsum_strategies(info, terms, batch + "n")


@register(aten.matmul.default)
def matmul(info: OpInfo) -> list:
    """torch.matmul's cases: dot, vector-matrix, matrix-vector, batched with broadcasting."""
    a, b = info.args[0].ndim, info.args[1].ndim
    batch = _BATCH[:max(a, b, 2) - 2]
    ta = "k" if a == 1 else batch[len(batch) - (a - 2):] + "mk"
    tb = "k" if b == 1 else batch[len(batch) - (b - 2):] + "kn"
    out = batch + ("m" if a > 1 else "") + ("n" if b > 1 else "")
    return einsum_strategies(info, [ta, tb], out)


@register(aten.einsum.default)
def einsum(info: OpInfo) -> list:
    """``torch.einsum(equation, operands)`` with one letter per dim (no ``...``), each at most
    once in an operand: the generic product rule over its letters. Other equations (an
    ellipsis, a diagonal ``ii``) keep only the replicated strategy."""
    equation = info.args[0].replace(" ", "")
    ins = tensor_inputs(info)
    lhs, arrow, out = equation.partition("->")
    terms = lhs.split(",")
    if not arrow:       # implicit output: the letters that occur once, in alphabetical order
        out = "".join(sorted(c for c in set(lhs) if c.isalpha() and lhs.count(c) == 1))
    if ("." in equation or len(terms) != len(ins) or any(len(set(t)) != len(t) or len(t) != x.ndim
                                                          for t, x in zip(terms, ins))
            or len(set(out)) != len(out)):
        return [replicated(info)]
    return einsum_strategies(info, terms, out)


@register(aten._cdist_forward.default)
def cdist(info: OpInfo) -> list:
    """Distances between the rows of x1[..., P, M] and x2[..., R, M] -> [..., P, R]: the batch
    and either operand's rows shard; the features M do not (a p-norm is no sum of addends)."""
    x1, x2 = info.args[0], info.args[1]
    nd, found = info.out.ndim, [replicated(info)]
    for d in range(nd - 2):
        size = info.out.shape[d]
        pl = tuple(Shard(d - (nd - x.ndim)) if d - (nd - x.ndim) >= 0 and x.shape[d - (nd - x.ndim)] == size
                   else R for x in (x1, x2))
        if size > 1:
            found.append(Strategy(pl, Shard(d)))
    if x1.shape[-2] > 1:
        found.append(Strategy((Shard(x1.ndim - 2), R), Shard(nd - 2)))
    if x2.shape[-2] > 1:
        found.append(Strategy((R, Shard(x2.ndim - 2)), Shard(nd - 1)))
    return found


@register(aten._pdist_forward.default)
def pdist(info: OpInfo) -> list:
    """The condensed distances between all pairs of rows: every output reads two rows."""
    return [replicated(info)]
