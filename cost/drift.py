"""Whether this machine still runs at the speed its local preset was measured at.

The local preset (``cost.calibration``) is measured once and cached. On a shared machine (a
virtual machine whose cores other tenants use) the speed moves by factors over hours: here the
per-op dispatch cost the calibration measured went from 6.0 to 13.5 us and the per-stage-pass
cost from 0.35 to 1.13 ms between two calibrations two hours apart, and the estimates made from
the older one came out at 0.3-0.5 of the steps then measured (benchmarks/bench_holdout.py;
BENCHMARKS.md, bench_holdout.py).

So the calibration also times a small reference workload (``fingerprint``: a loop of tiny
adds, which is Python and dispatch, and a 256 x 256 matmul, one thread) and stores it with the
preset; reading the preset times it again, once per process while the machine is otherwise
idle, and warns when either moved by more than ``STALE_FACTOR``: predictions from the preset
are then off by about as much, and ``python -m autopar calibrate`` measures the machine again.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Optional

import torch

__all__ = ["fingerprint", "drift", "machine_idle", "stale_warning", "STALE_FACTOR"]

STALE_FACTOR = 1.5
_ADDS = 200          # tiny adds per timed loop (about 1 ms)
_REPS = 7            # timed loops / matmuls per part; the fastest is kept


def fingerprint() -> tuple:
    """((part, seconds), ...): this process's time, on one thread, per tiny add (``dispatch``)
    and per 256 x 256 fp32 matmul (``matmul``), each the fastest of ``_REPS`` timings (about
    15 ms in all). The fastest, not the median: each timing (a millisecond or less) fits in a
    scheduler's time slice, so the fastest is the machine's speed even while other processes
    share the core (the cost model charges that sharing separately)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b, c = torch.ones(16), torch.ones(16), torch.empty(16)
        x, y, z = torch.randn(256, 256), torch.randn(256, 256), torch.empty(256, 256)

        def adds():
            for _ in range(_ADDS):
                torch.add(a, b, out=c)

        def mm():
            torch.mm(x, y, out=z)

        out = []
        for part, op, per in (("dispatch", adds, _ADDS), ("matmul", mm, 1)):
            op()
            times = []
            for _ in range(_REPS):
                t0 = time.perf_counter()
                op()
                times.append(time.perf_counter() - t0)
            out.append((part, min(times) / per))
        return tuple(out)
    finally:
        torch.set_num_threads(threads)


def machine_idle() -> bool:
    """Whether the machine is quiet enough for the reference workload to say how fast it is:
    a 1-minute load average of at most half the cores plus one (this process). A busy machine
    reads slow for another reason, which the cost model charges as contention; it is not
    checked then."""
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):      # no load average on this platform
        return False
    return load <= (os.cpu_count() or 1) / 2 + 1


def drift(recorded: tuple, now: tuple) -> dict:
    """part -> now / recorded (above 1: slower now) for the parts both fingerprints have."""
    then = dict(recorded)
    return {part: s / then[part] for part, s in now if then.get(part)}


def stale_warning(recorded: tuple, measured_at: str = "", now: Optional[tuple] = None) -> Optional[str]:
    """The warning to give when this machine now runs a part of ``recorded`` (the preset's
    fingerprint) more than ``STALE_FACTOR`` slower or faster, else None. A first reading
    outside the bound is taken twice more and the median kept (one unlucky reading is not a
    slower machine)."""
    if not recorded:
        return None
    readings = [now or fingerprint()]
    ratios = drift(recorded, readings[0])
    if not any(r > STALE_FACTOR or r < 1 / STALE_FACTOR for r in ratios.values()):
        return None
    readings += [fingerprint() for _ in range(2)]
    ratios = {part: statistics.median(drift(recorded, r)[part] for r in readings) for part in ratios}
    moved = {part: r for part, r in ratios.items() if r > STALE_FACTOR or r < 1 / STALE_FACTOR}
    if not moved:
        return None
    said = ", ".join(f"{part} {r:.2f}x {'slower' if r > 1 else 'faster'}" for part, r in moved.items())
    when = f" (measured {measured_at})" if measured_at else ""
    return (f"the local preset{when} no longer matches this machine: its reference workload now runs {said} "
            f"than at calibration (bound {STALE_FACTOR}x), so step times predicted from it are off by about "
            "as much; run `python -m autopar calibrate` to measure the machine again")
