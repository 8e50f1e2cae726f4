"""Chrome / Perfetto traces: the one writer behind every timeline autopar draws.

A trace is processes (a rank, measured or predicted), each with named threads (its lanes:
compute, communication), holding complete events with a start and a duration. Times are
given in seconds and written in microseconds; Perfetto and chrome://tracing open the result.
Used by the simulated schedule (``autopar.schedule``), the measured step
(``autopar.runtime``) and the cost model's predicted step (``autopar.cost.estimate``).
"""
from __future__ import annotations

import json

__all__ = ["ChromeTrace"]


class ChromeTrace:
    """Processes, their lanes and their spans, in the Chrome trace event format."""

    def __init__(self):
        self.events: list[dict] = []
        self._processes: set[int] = set()

    def process(self, pid: int, name: str, lanes=("compute",)) -> None:
        """Declare process ``pid`` (shown as ``name``, sorted by pid) with one thread per lane
        (thread id = the lane's position). Declaring a process twice keeps the first."""
        if pid in self._processes:
            return
        self._processes.add(pid)
        self.events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}})
        self.events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                            "args": {"sort_index": pid}})
        if len(lanes) > 1:
            for tid, lane in enumerate(lanes):
                self.events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                                    "args": {"name": lane}})

    def span(self, pid: int, tid: int, name: str, start_s: float, end_s: float, cat: str = "",
             args: dict | None = None) -> None:
        """A complete event on lane ``tid`` of process ``pid`` from ``start_s`` to ``end_s``."""
        event = {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": start_s * 1e6,
                 "dur": max(end_s - start_s, 0.0) * 1e6, "cat": cat}
        if args:
            event["args"] = args
        self.events.append(event)

    def as_dict(self) -> dict:
        return {"traceEvents": self.events, "displayTimeUnit": "ms"}

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.as_dict(), f)
