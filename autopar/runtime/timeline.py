"""Measured timelines: what each rank's thread and its collectives did during a step.

``dm.record_timeline()`` records, for whatever runs inside it (one training step), every
collective from issue to completion and every wait that blocked the rank's thread
(``CommStats.trace``). From those, per rank:

    compute lane      the recorded span minus the blocked waits: the thread computing (or
                      issuing work)
    comm lane         each collective, issue -> completion (an asynchronous one completes when
                      its future fires, or at the latest when its wait returns)
    exposed_comm_s    the union of the blocked waits: communication no compute covered

``MeasuredTimeline.add_lanes`` draws them in a ``ChromeTrace``; ``dm.dump`` lays them beside the
cost model's predicted lanes of the same plan.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch.distributed as dist

from ..trace import ChromeTrace
from .timing import now

__all__ = ["MeasuredTimeline", "record"]


def _union(spans) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


@dataclass
class MeasuredTimeline:
    """One rank's recorded span; ``events`` are (kind, name, start, end) in seconds from the
    start of the recording, kind "comm" or "wait"."""
    rank: int
    duration_s: float
    events: list = field(default_factory=list)

    @classmethod
    def from_trace(cls, rank: int, start: float, end: float, trace: list) -> "MeasuredTimeline":
        return cls(rank, end - start, [(k, name, a - start, b - start) for k, name, a, b in trace])

    @property
    def exposed_comm_s(self) -> float:
        """Seconds the rank's thread was blocked waiting on communication."""
        return sum(b - a for a, b in _union((a, b) for k, _, a, b in self.events if k == "wait"))

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

    def add_lanes(self, trace: ChromeTrace, pid: int) -> None:
        """This rank's measured compute and communication lanes as process ``pid`` of ``trace``."""
        trace.process(pid, f"rank {self.rank} (measured): step {self.duration_s * 1e3:.2f} ms, exposed "
                           f"communication {self.exposed_comm_s * 1e3:.2f} ms", ("compute", "communication"))
        for lane, name, a, b in self.lanes():
            trace.span(pid, 0 if lane == "compute" else 1, name, a, b, f"measured {lane}")


@contextmanager
def record(owner):
    """Record ``owner``'s collectives (``owner.comm_stats``) while the block runs, then share
    every rank's MeasuredTimeline (a collective over the world: every rank records the same step) as
    ``owner.timelines``, in rank order. Its ends wait for the device (``timing.now``): the span
    holds the block's device work, not only its launches."""
    stats = owner.comm_stats
    trace: list = []
    device = owner.device
    start = now(device)
    stats.trace = trace
    try:
        yield
    finally:
        end = now(device)
        stats.trace = None
    mine = MeasuredTimeline.from_trace(owner.mesh.rank, start, end, trace)
    if not owner.mesh.virtual and dist.is_initialized() and dist.get_world_size() > 1:
        rows: list = [None] * dist.get_world_size()
        dist.all_gather_object(rows, mine)
        owner.timelines = rows
    else:
        owner.timelines = [mine]
