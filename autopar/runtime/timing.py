"""Clocks that time device work: ``now(device)`` reads the clock once the work this thread has
queued on ``device`` has run.

CUDA runs kernels asynchronously: a host clock read right after a launch measures the launch,
not the work, so a step timed by bare ``time.perf_counter()`` calls reads as a few hundred
microseconds whatever it computes, and the work lands in whichever later span first waits for
it. ``now`` first synchronises the device's current stream, the stream this thread's compute
runs on and that a waited collective or a joined copy stream feeds, so a span between two
``now`` calls holds exactly the work queued between them, and the time a collective blocked
that stream counts as blocked. (``torch.cuda.synchronize`` would wait for every stream,
collectives still in flight on NCCL's included: a span that starts with it swallows the
communication the compute was overlapping, and the wait after it would read as free.) On the
CPU the work is done when the call returns, and ``now`` is the clock alone.

Every duration the runtime measures of its own work (a step, a pipeline action, a collective
under ``record_timeline``, a tuning candidate's steps) reads ``now``; the host-side clocks
that measure no device work (the flight recorder's hang detection, the test harness's
deadlines) read ``time`` directly (``tests/test_device_generic.py`` lists them).
"""
from __future__ import annotations

import time

import torch

__all__ = ["now", "Spans"]


def now(device=None, *, wall: bool = False) -> float:
    """Seconds on ``time.perf_counter`` (``wall=True``: ``time.time``, comparable between the
    processes of several hosts as far as their clocks agree) once the work queued on
    ``device``'s current stream has run; ``device`` None or a CPU: the clock alone."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return time.time() if wall else time.perf_counter()


class Spans:
    """Marks on one step's timeline of device work, read without stalling the device: on CUDA a
    mark records an event on the current stream, and ``seconds`` turns it into the wall clock
    (``time.time``) once the event ran, from one origin read with ``now`` when the spans began;
    on the CPU a mark is the wall clock itself. A pipeline marks every action of every step
    this way: a ``now`` per action would hold the host back until the device caught up, and the
    host could no longer queue the next action's kernels while the device runs this one's."""

    def __init__(self, device=None):
        self.cuda = device is not None and torch.device(device).type == "cuda"
        if self.cuda:
            self._wall = now(device, wall=True)
            self._origin = self.mark()

    def mark(self):
        if not self.cuda:
            return time.time()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, mark) -> float:
        """A mark as ``time.time`` seconds (on CUDA, waiting for its event)."""
        if not self.cuda:
            return mark
        mark.synchronize()
        return self._wall + self._origin.elapsed_time(mark) / 1e3
