"""Measured timelines: what each rank's thread and its collectives did during a step.

``dm.record_timeline()`` records, for whatever runs inside it (one training step), every
collective from issue to completion and every wait that blocked the rank's thread
(``CommStats.trace``). From those, per rank:

    compute lane      the recorded span minus the blocked waits: the thread computing (or
                      issuing work)
    comm lane         each collective, issue -> completion (an asynchronous one completes when
                      its future fires, or at the latest when its wait returns)
    exposed_comm_s    the union of the blocked waits: communication no compute covered

``chrome_trace`` lays the measured lanes of every rank beside the cost model's predicted
lanes of the same plan (``Estimate.timeline``) for Perfetto / chrome://tracing.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["Timeline", "chrome_trace", "record"]


def _union(spans) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


@dataclass
class Timeline:
    """One rank's recorded span; ``events`` are (kind, name, start, end) in seconds from the
    start of the recording, kind "comm" or "wait"."""
    rank: int
    duration_s: float
    events: list = field(default_factory=list)

    @classmethod
    def from_trace(cls, rank: int, start: float, end: float, trace: list) -> "Timeline":
        return cls(rank, end - start, [(k, name, a - start, b - start) for k, name, a, b in trace])

    @property
    def exposed_comm_s(self) -> float:
        """Seconds the rank's thread was blocked waiting on communication."""
        return sum(b - a for a, b in _union((a, b) for k, _, a, b in self.events if k == "wait"))

    @property
    def comm_s(self) -> float:
        """Seconds at least one collective was in flight."""
        return sum(b - a for a, b in _union((a, b) for k, _, a, b in self.events if k == "comm"))

    def lanes(self) -> list[tuple[str, str, float, float]]:
        """(lane, name, start, end): compute spans between the blocked waits, then each
        collective on the communication lane."""
        out, t = [], 0.0
        for a, b in _union((a, b) for k, _, a, b in self.events if k == "wait"):
            if a > t:
                out.append(("compute", "compute", t, a))
            t = max(t, b)
        if t < self.duration_s:
            out.append(("compute", "compute", t, self.duration_s))
        out += [("comm", name, a, b) for k, name, a, b in self.events if k == "comm"]
        return out


def chrome_trace(measured: list[Timeline], predicted=None) -> dict:
    """Measured lanes of every rank (processes "rank r (measured)") and, if given, an
    ``Estimate``'s predicted lanes ("rank r (predicted)"), each from its own time zero."""
    events: list[dict] = []

    def process(pid: int, title: str) -> None:
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": title}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for tid, lane in ((0, "compute"), (1, "communication")):
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": lane}})

    for tl in measured:
        pid = 2 * tl.rank
        process(pid, f"rank {tl.rank} (measured): step {tl.duration_s * 1e3:.2f} ms, exposed communication "
                     f"{tl.exposed_comm_s * 1e3:.2f} ms")
        for lane, name, a, b in tl.lanes():
            events.append({"name": name, "ph": "X", "pid": pid, "tid": 0 if lane == "compute" else 1,
                           "ts": a * 1e6, "dur": max(b - a, 0.0) * 1e6, "cat": f"measured {lane}"})
    if predicted is not None:
        for rank, lane, name, a, b in predicted.timeline:
            pid = 2 * rank + 1
            if not any(e.get("pid") == pid for e in events):
                process(pid, f"rank {rank} (predicted): step {predicted.step_time_s * 1e3:.2f} ms, exposed "
                             f"communication {predicted.exposed_comm_s * 1e3:.2f} ms")
            events.append({"name": name, "ph": "X", "pid": pid, "tid": 0 if lane == "compute" else 1,
                           "ts": a * 1e6, "dur": max(b - a, 0.0) * 1e6, "cat": f"predicted {lane}"})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


@contextmanager
def record(owner):
    """Record ``owner``'s collectives (``owner.comm_stats``) while the block runs, then share
    every rank's Timeline (a collective over the world: every rank records the same step) as
    ``owner.timelines``, in rank order."""
    import torch.distributed as dist
    stats = owner.comm_stats
    trace: list = []
    stats.trace = trace
    start = time.perf_counter()
    try:
        yield
    finally:
        end = time.perf_counter()
        stats.trace = None
    mine = Timeline.from_trace(owner.mesh.rank, start, end, trace)
    if not owner.mesh.virtual and dist.is_initialized() and dist.get_world_size() > 1:
        rows: list = [None] * dist.get_world_size()
        dist.all_gather_object(rows, mine)
        owner.timelines = rows
    else:
        owner.timelines = [mine]
