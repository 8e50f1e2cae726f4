"""Time of one collective on one link: the alpha-beta (latency-bandwidth) model.

A message of n bytes between two ranks costs α + n·β (α: latency per message, β: seconds per
byte = 1 / link bandwidth). The collective algorithms below are those of Thakur, Rabenseifner
and Gropp, "Optimization of Collective Communication Operations in MPICH" (IJHPCA 2005),
section 4, with p ranks and n the bytes of the whole (gathered / unreduced) buffer; the
reduction arithmetic (their γ term) is left out, as it is negligible next to the transfer on
the links we model:

    all_gather       ring                (p−1)·α + (p−1)/p·n·β
                     recursive doubling  log2(p)·α + (p−1)/p·n·β
    reduce_scatter   ring                (p−1)·α + (p−1)/p·n·β
                     recursive halving   log2(p)·α + (p−1)/p·n·β
    all_reduce       ring                2(p−1)·α + 2(p−1)/p·n·β
                     tree (binomial reduce, then broadcast)  2·log2(p)·(α + n·β)
                     Rabenseifner (halving + doubling)       2·log2(p)·α + 2(p−1)/p·n·β
    all_to_all       pairwise exchange   (p−1)·α + (p−1)/p·n·β
    point-to-point   one message         α + n·β

NCCL's ring and (double binary) tree have the same bandwidth terms as ring and Rabenseifner
here; the tree's latency is logarithmic. Bytes moved per rank (the quantity autopar's
counters record) are the β coefficients: (p−1)/p·n for all_gather / reduce_scatter, 2(p−1)/p·n
for all_reduce.
"""
from __future__ import annotations

import sympy as sp

from autopar.sizes import ring_bytes

__all__ = ["ALPHA", "BETA", "NBYTES", "P", "ALGORITHMS", "collective_time", "collective_time_expr",
           "bytes_per_rank_expr", "bytes_per_rank", "pipeline_hop_time", "skew_table"]

ALPHA, BETA, NBYTES, P = sp.symbols("alpha beta n p", positive=True)

_LOG = sp.log(P, 2)
_SENT = {kind: ring_bytes(kind, NBYTES, P) * BETA for kind in ("all_gather", "reduce_scatter", "all_reduce",
                                                                 "all_to_all", "p2p")}
ALGORITHMS: dict[str, dict[str, sp.Expr]] = {
    "all_gather": {"ring": (P - 1) * ALPHA + _SENT["all_gather"],
                   "recursive_doubling": _LOG * ALPHA + _SENT["all_gather"]},
    "reduce_scatter": {"ring": (P - 1) * ALPHA + _SENT["reduce_scatter"],
                       "recursive_halving": _LOG * ALPHA + _SENT["reduce_scatter"]},
    "all_reduce": {"ring": 2 * (P - 1) * ALPHA + _SENT["all_reduce"],
                   "tree": 2 * _LOG * (ALPHA + NBYTES * BETA),
                   "rabenseifner": 2 * _LOG * ALPHA + _SENT["all_reduce"]},
    "all_to_all": {"pairwise": (P - 1) * ALPHA + _SENT["all_to_all"]},
    "p2p": {"direct": ALPHA + _SENT["p2p"]},
}


def collective_time_expr(kind: str, algorithm: str = "ring") -> sp.Expr:
    """The sympy formula of ``kind`` under ``algorithm`` (see the module docstring)."""
    try:
        algos = ALGORITHMS[kind]
    except KeyError:
        raise ValueError(f"unknown collective {kind!r}; expected one of {sorted(ALGORITHMS)}") from None
    if algorithm not in algos:
        algorithm = next(iter(algos)) if algorithm == "ring" else algorithm
    if algorithm not in algos:
        raise ValueError(f"{kind} has no algorithm {algorithm!r}; expected one of {sorted(algos)}")
    return algos[algorithm]


def bytes_per_rank_expr(kind: str) -> sp.Expr:
    """Bytes each rank sends: the β coefficient of the ring (bandwidth-optimal) form,
    ``autopar.sizes.ring_bytes``."""
    return ring_bytes(kind, NBYTES, P)


_LAMBDAS: dict = {}


def _fn(kind: str, algorithm: str):
    key = (kind, algorithm)
    if key not in _LAMBDAS:
        _LAMBDAS[key] = sp.lambdify((ALPHA, BETA, NBYTES, P), collective_time_expr(kind, algorithm), "math")
    return _LAMBDAS[key]


def bytes_per_rank(kind: str, nbytes: float, p: int) -> float:
    """Bytes each rank sends in one ``kind`` collective of an ``nbytes`` buffer over ``p`` ranks
    (a point-to-point message: its bytes)."""
    return float(ring_bytes(kind, float(nbytes), p))


def collective_time(kind: str, nbytes: float, p: int, link, algorithm: str = "auto", *,
                    after: float | None = None) -> float:
    """Seconds of one ``kind`` collective of an ``nbytes`` buffer over ``p`` ranks on ``link``
    (anything with ``bandwidth`` in bytes/s and ``latency`` in s). ``algorithm="auto"``
    takes the fastest algorithm the formulas offer, as NCCL's tuner does. A link with measured
    ``fits`` for ``kind`` (the local preset) uses that fit: alpha + beta · bytes sent per rank;
    one with a ``skew`` table (latencies among computing ranks) takes alpha from it at ``after``, the
    seconds each rank computed since the previous collective (1 ms when not given), linear
    between the measured lengths and flat beyond them, at the link's ``skew_scale``
    (``skew_table``: the kind's own points, or the kinds' mean on a link with ``skew_pooled``; its
    shortest point at the link's ``skew_first``)."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    if kind == "p2p":
        p = 2
    fits = [f for f in getattr(link, "fits", ()) if f[0] == kind]
    if fits:       # a measured link: the fit of this collective for the nearest group size
        _, g, a, b = min(fits, key=lambda f: (abs(f[1] - p), -f[1]))
        table = skew_table(link, kind, g)
        if table:
            a = _interpolate(table, 1e-3 if after is None else after) * getattr(link, "skew_scale", 1.0)
        return a + b * bytes_per_rank(kind, nbytes, p)
    alpha, beta = link.latency, 1.0 / link.bandwidth
    names = ALGORITHMS[kind] if algorithm == "auto" else [algorithm]
    return min(_fn(kind, a)(alpha, beta, float(nbytes), float(p)) for a in names)


def skew_table(link, kind: str, g: int) -> list:
    """The sorted (compute seconds, latency) points of ``link``'s skew table for ``kind`` on
    groups of ``g``: the kind's own, or on a link with ``skew_pooled`` the mean over the
    collectives' kinds (p2p apart) of their points at each compute length; the shortest point
    at the link's ``skew_first`` (p2p apart)."""
    skew = getattr(link, "skew", ())
    own = sorted((t, a) for k, gs, t, a in skew if k == kind and gs == g)
    if kind == "p2p" or not own:
        return own
    if getattr(link, "skew_pooled", False):
        at: dict = {}
        for k, gs, t, a in skew:
            if gs == g and k != "p2p":
                at.setdefault(t, []).append(a)
        own = [(t, sum(v) / len(v)) for t, v in sorted(at.items())]
    first = getattr(link, "skew_first", 1.0)
    return own if first == 1.0 else [(own[0][0], own[0][1] * first)] + own[1:]


def pipeline_hop_time(nbytes: float, link, *, after: float | None = None, schedule: str | None = None) -> float:
    """Seconds of one pipeline message of ``nbytes``: the link's measured ``hop`` latency (fitted
    on autopar's own pipelines, when measured; under the interleaved ``schedule`` its
    ``hop_interleaved`` where measured) plus the p2p fit's per-byte time, else the p2p
    collective time."""
    hop = (schedule == "interleaved" and getattr(link, "hop_interleaved", 0.0)) or getattr(link, "hop", 0.0)
    fits = [f for f in getattr(link, "fits", ()) if f[0] == "p2p"]
    if hop and fits:
        return hop + fits[0][3] * float(nbytes)
    return collective_time("p2p", nbytes, 2, link, after=after)


def _interpolate(table: list, x: float) -> float:
    """Piecewise-linear y(x) through sorted (x, y) points, flat beyond the ends."""
    if x <= table[0][0]:
        return table[0][1]
    for (x0, y0), (x1, y1) in zip(table, table[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return table[-1][1]
