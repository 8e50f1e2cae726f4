"""Rules of arithmetic shared by the runtime, the passes, the cost model and explain.

Each rule is written once, here, so that what the runtime moves and holds and what the cost
model predicts cannot drift apart. The functions take numbers or sympy symbols alike where
the cost model wants a formula (``cost/`` builds its symbolic expressions from them).

    chunk(size, n)               ceil(size / n): the rows of one rank's shard. Shards follow
                                 FSDP's convention: every rank but the last ones holds
                                 ceil(size/n) rows, the last ranks fewer (or none)
    chunk_range(size, n, i)      [lo, hi) of rank i's rows; local_size(size, n, i) = hi - lo
    padded(size, n)              n · chunk(size, n): what a collective over equal chunks moves
    padded_numel(shape, n)       elements of a tensor split along dim 0 once padded
    RING_FACTOR, ring_bytes      bytes each rank sends in a ring collective of an S-byte buffer
                                 over n ranks: (n−1)/n·S (all-gather, reduce-scatter),
                                 2(n−1)/n·S (all-reduce)
    gather_unit_bytes            what a ZeRO-3 unit's gather holds while in flight
    cut_buckets                  gradients (in the order they become ready) cut into buckets:
                                 the first at 1 MiB, the others at Plan.bucket_bytes
    grad_buckets                 ddp's and ZeRO-1/2's gradient buckets of parameters in order of
                                 first use (the collectives pass cuts them; the cost model prices them)
    gather_units, cut_unit       ZeRO-3's gather units: one per numbered layer, the other
                                 parameters one root unit, each cut at Plan.bucket_bytes
    unit_grad_buckets            ZeRO-3's gradient buckets: its units, last first
    state_bytes                  parameters + gradients + optimizer state of one rank per ZeRO
                                 stage (Rajbhandari et al., "ZeRO", SC'20, section 3)
    inflight_microbatches        micro-batches whose activations a pipeline rank holds at its
                                 peak (Narayanan et al., SC'21, section 2.2)
    batch_split_error            why a batch of B rows does not split into dp ranks x
                                 microbatches equal parts (None when it does)
"""
from __future__ import annotations

import math

__all__ = ["chunk", "chunk_range", "local_size", "padded", "padded_numel", "RING_FACTOR", "ring_bytes",
           "gather_unit_bytes", "cut_buckets", "grad_buckets", "cut_unit", "gather_units", "unit_grad_buckets",
           "state_bytes", "mixed_state_dtypes", "inflight_microbatches", "FIRST_BUCKET_BYTES", "batch_split_error"]

FIRST_BUCKET_BYTES = 1 << 20
"""The first gradient bucket is cut at 1 MiB (or ``Plan.bucket_bytes`` if smaller), so that
communication starts early in backward, as DDP does; later buckets at ``Plan.bucket_bytes``."""


def chunk(size: int, n: int) -> int:
    """Rows of one rank's (full) shard of ``size`` rows over ``n`` ranks: ceil(size / n)."""
    return -(-size // n)


def chunk_range(size: int, n: int, index: int) -> tuple[int, int]:
    """Rank ``index``'s rows [lo, hi) of ``size`` rows split over ``n`` ranks in ceil chunks."""
    c = chunk(size, n)
    lo = min(index * c, size)
    return lo, min(lo + c, size)


def local_size(size: int, n: int, index: int) -> int:
    """Rank ``index``'s share of a dim of ``size`` split over ``n`` ranks (ceil chunks)."""
    lo, hi = chunk_range(size, n, index)
    return hi - lo


def padded(size: int, n: int) -> int:
    """``size`` rounded up to ``n`` equal chunks: what a collective over the chunks moves."""
    return chunk(size, n) * n


def padded_numel(shape: tuple, n: int) -> int:
    """Elements of a tensor of ``shape`` split along dim 0 over ``n`` ranks, padded to equal
    chunks (a 0-d tensor is one row)."""
    rows = shape[0] if len(shape) else 1
    return padded(rows, n) * math.prod(shape[1:])


RING_FACTOR = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2, "all_to_all": 1}
"""Bytes each rank sends in a ring collective, in units of (n−1)/n of the buffer."""


def ring_bytes(kind: str, nbytes, n):
    """Per-rank bytes a ring ``kind`` collective over ``n`` ranks sends for an ``nbytes``
    buffer (the whole gathered / unreduced buffer): RING_FACTOR[kind]·(n−1)/n·nbytes; zero on
    one rank. A point-to-point message (``p2p``) sends its bytes."""
    if kind == "p2p":
        return nbytes
    try:
        factor = RING_FACTOR[kind]
    except KeyError:
        raise ValueError(f"unknown collective {kind!r}; expected p2p or one of {sorted(RING_FACTOR)}") from None
    return factor * nbytes * (n - 1) / n     # in this order sympy keeps 2·Ψ·(N−1)/N whole


def gather_unit_bytes(padded_elements: int, n: int, element_size: int) -> int:
    """Bytes a ZeRO-3 unit's all-gather holds while in flight: the gathered unit (its padded
    elements) and this rank's send buffer, (N + 1)/N of the unit."""
    return (n + 1) * (padded_elements // n) * element_size


def cut_buckets(sizes, bucket_bytes: int, first_bytes: int = FIRST_BUCKET_BYTES, breaks=()) -> list[list[int]]:
    """Consecutive items (``sizes``: their bytes, in the order their gradients become ready)
    grouped into buckets, as item indices: a bucket closes before an item that would take it
    past its cap (the first bucket's min(first_bytes, bucket_bytes), the others'
    bucket_bytes) or at an index in ``breaks`` (a dtype change); an item larger than the cap
    gets a bucket of its own."""
    buckets, cur, cur_bytes, cap = [], [], 0, min(first_bytes, bucket_bytes)
    for i, size in enumerate(sizes):
        if cur and (cur_bytes + size > cap or i in breaks):
            buckets.append(cur)
            cur, cur_bytes, cap = [], 0, bucket_bytes
        cur.append(i)
        cur_bytes += size
    return buckets + [cur] if cur else buckets



def _cut_named(names: list, nbytes, bucket_bytes: int, first_bytes: int, dtypes=None) -> list[list]:
    """``names`` cut by ``cut_buckets`` over their bytes (``nbytes[name]``), one dtype each
    (``dtypes[name]``; None: one dtype for all)."""
    breaks = ({i for i in range(1, len(names)) if dtypes[names[i]] != dtypes[names[i - 1]]}
              if dtypes is not None else ())
    cuts = cut_buckets([nbytes[x] for x in names], bucket_bytes, first_bytes, breaks)
    return [[names[i] for i in bucket] for bucket in cuts]


def grad_buckets(order, nbytes, bucket_bytes: int, dtypes=None) -> list[list]:
    """ddp's and ZeRO-1/2's gradient buckets, as parameter names: the parameters of ``order``
    (the order of first use) in reverse, the order their gradients become ready, cut by
    ``cut_buckets`` over their bytes (``nbytes[name]``: the collective's, padded where it
    moves equal chunks), the first bucket at ``FIRST_BUCKET_BYTES`` (so that communication
    starts early in backward), the others at ``bucket_bytes``, one dtype each (``dtypes[name]``;
    None: one dtype for all)."""
    return _cut_named(list(reversed(order)), nbytes, bucket_bytes, FIRST_BUCKET_BYTES, dtypes)


def cut_unit(members, nbytes, bucket_bytes: int, dtypes=None) -> list[list]:
    """One of ZeRO-3's units (``members``, in order of first use) cut where it passes
    ``bucket_bytes`` (``nbytes[name]``: each member's padded bytes) or changes dtype."""
    return _cut_named(list(members), nbytes, bucket_bytes, bucket_bytes, dtypes)


def gather_units(order, nbytes, bucket_bytes: int, key, dtypes=None) -> list[list]:
    """ZeRO-3's gather units, as parameter names in order of first use: the parameters of
    ``order`` (the order of first use) grouped by ``key(name)`` (the numbered layer they sit
    in, as wrapping every transformer block; None: the root unit of the others), each group
    cut by ``cut_unit``. Each unit is one all-gather in forward, one in backward if backward
    reads any of it, and its gradients one reduce-scatter."""
    by_key: dict = {}
    for name in order:
        by_key.setdefault(key(name) or "", []).append(name)
    units = [unit for members in by_key.values() for unit in cut_unit(members, nbytes, bucket_bytes, dtypes)]
    position = {name: i for i, name in enumerate(order)}
    return sorted(units, key=lambda u: position[u[0]])   # prefetch follows first use


def unit_grad_buckets(units) -> list[list]:
    """ZeRO-3's gradient buckets: its gather ``units`` (``gather_units``), last unit first, each
    unit's members last first (the order their gradients become ready)."""
    return [list(reversed(u)) for u in reversed(units)]

def state_bytes(mode: str, psi, n, dtypes=(4, 4, 8), padded_psi=None):
    """Per-rank bytes of parameters + gradients + optimizer state after a step, with ``psi``
    parameters held as (parameter, gradient, optimizer-state) ``dtypes`` bytes each over ``n``
    data-parallel ranks (ZeRO, section 3 and figure 1):

        ddp    (p + g + K)·Ψ
        zero1  (p + g)·Ψ + K·Ψ/N
        zero2  p·Ψ + (g + K)·Ψ/N
        zero3  (p + g + K)·Ψ/N

    ``padded_psi``: the elements the shards cover once padded to equal chunks (the runtime's
    shards: Ψ/N becomes padded_psi/N); default Ψ. Works on sympy symbols."""
    p, g, k = dtypes
    pad = psi if padded_psi is None else padded_psi
    if mode == "ddp":
        return (p + g + k) * psi
    if mode == "zero1":
        return (p + g) * psi + k * pad / n
    if mode == "zero2":
        return p * psi + (g + k) * pad / n
    if mode == "zero3":
        return (p + g + k) * pad / n
    raise ValueError(f"unknown data-parallel mode {mode!r}; expected ddp, zero1, zero2 or zero3")


def mixed_state_dtypes(mode: str, compute: int = 2, master: int = 4, reduce: int | None = None,
                       optimizer: int = 8) -> tuple[int, int, int]:
    """Bytes per parameter of (parameter copy forward reads, gradient, optimizer state) that
    autopar's runtime keeps under ``Plan(param_dtype=...)``, for ``state_bytes``: the
    optimizer state holds the master (``master`` bytes, fp32: 4) beside Adam's m and v
    (``optimizer``, 8); gradients land in the master's dtype, except ZeRO-1's persistent
    full-gradient buffer, kept in the ``reduce`` dtype (default the master's); a persistent
    copy in the compute dtype (``compute``, bf16: 2) exists only for ZeRO-1/2's replicas (ddp
    casts once per forward, ZeRO-3 gathers per use: transient). So

        ddp    (4 + 12)·Ψ = 16Ψ          zero1  (2 + 4)·Ψ + 12·Ψ/N
        zero2  2·Ψ + (4 + 12)·Ψ/N        zero3  (4 + 12)·Ψ/N = 16Ψ/N

    against ZeRO's (2 + 2 + K)·Ψ with K = 12 (section 3): autopar keeps reduced gradients in
    fp32 (the precision their fp32 sum bought) and no bf16 copy where none is read."""
    reduce = master if reduce is None else reduce
    p = compute if mode in ("zero1", "zero2") else 0
    g = reduce if mode == "zero1" else master
    return p, g, master + optimizer


def inflight_microbatches(schedule: str | None, p: int, m: int, v: int = 1, stage: int = 0) -> float:
    """Micro-batches whose activations rank ``stage`` of the pipeline holds at its peak, in
    units of one micro-batch through that rank's layers. No pipeline: 1. GPipe: m (every forward
    runs before the first backward). 1F1B and zero-bubble (ZB-H1 keeps 1F1B's bound):
    min(m, p − stage). Interleaved: the first rank holds (1 + (p−1)/(p·v))·p of them (Narayanan
    et al., section 2.2.2; Korthikanti et al., section 4.2.3). A custom schedule (its action
    list) is bounded like 1F1B."""
    if schedule is None:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved":
        return min(float(m), p * (1 + (p - 1) / (p * v)))
    return float(min(m, p - stage))


def batch_split_error(rows: int, dp: int = 1, microbatches: int = 1) -> str | None:
    """Why a global batch of ``rows`` rows does not split into ``dp`` ranks x ``microbatches``
    micro-batches of equal rows, naming the axis that does not divide and what would; None when
    it splits. The parts must be equal, not merely ceil chunks as tensor shards are: a step's
    loss is the mean of the parts' mean losses, which weighs every sample alike only when every
    part holds as many rows (3 rows over dp=2 would weigh the third twice as much as the others)."""
    if rows % dp:
        return (f"the global batch has {_rows(rows)} along dim 0, which does not divide by dp={dp}: every "
                "data-parallel rank must hold as many rows, for the mean of their losses to weigh every "
                f"sample alike. Use a global batch that is a multiple of {dp} ({_near(rows, dp)} rows)")
    per, m = rows // dp, microbatches
    if per % m:
        share = f" ({per} per dp rank)" if dp > 1 else ""
        divisors = [d for d in range(1, per + 1) if per % d == 0]
        divisors = sorted(sorted(divisors, key=lambda d: abs(d - m))[:4])
        return (f"the global batch has {_rows(rows)} along dim 0{share}, which does not divide by "
                f"microbatches={m}: every micro-batch must hold as many rows, for the mean of their losses "
                f"to weigh every sample alike. Use a global batch that is a multiple of {dp * m} (dp x "
                f"microbatches = {dp} x {m}: {_near(rows, dp * m)} rows), or microbatches that divide {per} "
                f"({', '.join(map(str, divisors))})")
    return None


def _rows(rows: int) -> str:
    return f"{rows} row" if rows == 1 else f"{rows} rows"


def _near(rows: int, k: int) -> str:
    """The multiples of ``k`` nearest ``rows`` (below and above), in words."""
    below = rows // k * k
    return f"{below} or {below + k}" if below else str(k)
