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

__all__ = ["ALPHA", "BETA", "NBYTES", "P", "ALGORITHMS", "collective_time", "collective_time_expr",
           "bytes_per_rank_expr", "bytes_per_rank"]

ALPHA, BETA, NBYTES, P = sp.symbols("alpha beta n p", positive=True)

_LOG = sp.log(P, 2)
ALGORITHMS: dict[str, dict[str, sp.Expr]] = {
    "all_gather": {"ring": (P - 1) * ALPHA + (P - 1) / P * NBYTES * BETA,
                   "recursive_doubling": _LOG * ALPHA + (P - 1) / P * NBYTES * BETA},
    "reduce_scatter": {"ring": (P - 1) * ALPHA + (P - 1) / P * NBYTES * BETA,
                       "recursive_halving": _LOG * ALPHA + (P - 1) / P * NBYTES * BETA},
    "all_reduce": {"ring": 2 * (P - 1) * ALPHA + 2 * (P - 1) / P * NBYTES * BETA,
                   "tree": 2 * _LOG * (ALPHA + NBYTES * BETA),
                   "rabenseifner": 2 * _LOG * ALPHA + 2 * (P - 1) / P * NBYTES * BETA},
    "all_to_all": {"pairwise": (P - 1) * ALPHA + (P - 1) / P * NBYTES * BETA},
    "p2p": {"direct": ALPHA + NBYTES * BETA},
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
    """Bytes each rank sends: the β coefficient of the ring (bandwidth-optimal) form."""
    return sp.expand(collective_time_expr(kind, "ring")).coeff(BETA)


_LAMBDAS: dict = {}
_SENT = {k: sp.lambdify((NBYTES, P), bytes_per_rank_expr(k), "math") for k in ("all_reduce", "all_gather",
                                                                                 "reduce_scatter", "all_to_all")}


def _fn(kind: str, algorithm: str):
    key = (kind, algorithm)
    if key not in _LAMBDAS:
        _LAMBDAS[key] = sp.lambdify((ALPHA, BETA, NBYTES, P), collective_time_expr(kind, algorithm), "math")
    return _LAMBDAS[key]


def bytes_per_rank(kind: str, nbytes: float, p: int) -> float:
    """Bytes each rank sends in one ``kind`` collective of an ``nbytes`` buffer over ``p`` ranks
    (a point-to-point message: its bytes)."""
    return float(nbytes) if kind == "p2p" else _SENT[kind](float(nbytes), float(p))


def collective_time(kind: str, nbytes: float, p: int, link, algorithm: str = "auto") -> float:
    """Seconds of one ``kind`` collective of an ``nbytes`` buffer over ``p`` ranks on ``link``
    (anything with ``bandwidth`` in bytes/s and ``latency`` in s). ``algorithm="auto"``
    takes the fastest algorithm the formulas offer, as NCCL's tuner does. A link with measured
    ``fits`` for ``kind`` (the local preset) uses that fit: alpha + beta · bytes sent per rank."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    if kind == "p2p":
        p = 2
    fits = [f for f in getattr(link, "fits", ()) if f[0] == kind]
    if fits:       # a measured link: the fit of this collective for the nearest group size
        _, _, a, b = min(fits, key=lambda f: (abs(f[1] - p), -f[1]))
        return a + b * bytes_per_rank(kind, nbytes, p)
    alpha, beta = link.latency, 1.0 / link.bandwidth
    names = ALGORITHMS[kind] if algorithm == "auto" else [algorithm]
    return min(_fn(kind, a)(alpha, beta, float(nbytes), float(p)) for a in names)
