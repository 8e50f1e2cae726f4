"""The step of a plan without a pipeline: one stage, its compute and communication lanes.

The compute lane runs forward, backward and the optimizer step; the communication lane the
data-parallel collectives, overlapped with compute as the runtime does with the overlap pass
(ZeRO-3 prefetches the next unit's gather; gradient buckets are reduced while backward goes
on; ZeRO-1/2's replica gathers follow the step), or each waited on when issued
(``Plan(overlap=False)``). Under ``Plan(offload="optimizer")`` the host link's copies join the
compute lane (``cost.offload.HostCopies``).
"""
from __future__ import annotations

import math

__all__ = ["single_stage_time", "busy_union"]


def single_stage_time(F, B, gf, gb, red, tail, opt, mode, n, timeline, simulate, overlap=True, copies=None):
    """One stage, two streams: returns (step, compute busy, exposed communication, bubble=0).
    ``F``, ``B``: each group's forward and backward; ``gf``, ``gb``: ZeRO-3's forward and
    backward gathers per group; ``red``: the reductions each group's backward completes;
    ``tail``: ZeRO-1/2's replica gathers after the step; ``opt``: the optimizer step;
    ``timeline``: the lanes' spans are appended to it. With the overlap pass, ZeRO-3
    gathers go one unit ahead and gradient buckets are reduced while backward goes on (ZeRO-1
    too); without it, each collective is waited on when issued. ``simulate=False``: the
    closed form of the overlapped lanes (no timeline).

    ``copies`` (``Plan(offload="optimizer")``, ``cost.offload.HostCopies``): each bucket's
    gradients go down on the compute lane when the next bucket launches (the last, and all of
    ZeRO-1's, when backward ends, each after its own reduction); after the step on the host
    (``opt``) the parameters come up a bucket at a time on the compute lane, ZeRO-1/2's
    all-gather of each bucket (its share of ``tail``) on the communication lane after it."""
    down, up = (list(copies.down), list(copies.up)) if copies is not None else ([], [])
    gathers = copies.gathers(tail) if copies is not None else []
    if not overlap:
        return _serial(F, B, gf, gb, red, tail, opt, mode, n, timeline, copies, down, up, gathers)
    if not simulate:
        return _closed_form(F, B, gf, gb, red, tail, opt, mode, copies, down)
    return _overlapped(F, B, gf, gb, red, tail, opt, mode, n, timeline, copies, down, up, gathers)


def _serial(F, B, gf, gb, red, tail, opt, mode, n, timeline, copies, down, up, gathers) -> tuple:
    """Every collective waited on when issued: the lanes one after another."""
    compute = sum(F) + sum(B) + opt
    step = compute + sum(gf) + sum(gb) + sum(red) + tail + sum(down) + sum(up)
    t = 0.0
    for i in range(len(F)):
        for lane, name, d in (("comm", f"all_gather unit {i}", gf[i] if mode == "zero3" else 0.0),
                              ("compute", f"F {i}", F[i])):
            if d:
                timeline.append((0, lane, name, t, t + d))
                t += d
    for i in reversed(range(len(B))):
        for lane, name, d in (("comm", f"all_gather unit {i} (backward)", gb[i] if mode == "zero3" else 0.0),
                              ("compute", f"B {i}", B[i]), ("comm", f"reduce grads {i}", red[i] if n > 1 else 0.0),
                              ("compute", f"grads down {i}", sum(d for g, d in zip(copies.group, down) if g == i)
                               if copies is not None else 0.0)):
            if d:
                timeline.append((0, lane, name, t, t + d))
                t += d
    timeline.append((0, "compute", "optimizer", t, t + opt))
    t += opt
    for k, (u, g) in enumerate(zip(up, gathers)):
        timeline.append((0, "compute", f"params up, bucket {k}", t, t + u))
        if g:
            timeline.append((0, "comm", f"all_gather params, bucket {k}", t + u, t + u + g))
        t += u + g
    if tail and copies is None:
        timeline.append((0, "comm", "all_gather params", t, t + tail))
    return step, compute, step - compute, 0.0


def _closed_form(F, B, gf, gb, red, tail, opt, mode, copies, down) -> tuple:
    """The overlapped lanes' closed form: ZeRO-3's gathers hidden behind the compute they
    precede, the reductions but the last behind backward."""
    compute = sum(F) + sum(B) + opt
    if mode == "zero3":
        fwd = gf[0] + sum(max(f, g) for f, g in zip(F, gf[1:] + [0.0]))
        bwd = sum(max(b, g) for b, g in zip(B, gb))
    else:
        fwd, bwd = sum(F), sum(B)
    # the copies down on the compute lane (the last after the final reduction); up pipelined with the gathers
    after = copies.up_tail(tail) if copies is not None else tail
    step = fwd + bwd + red[0] + sum(down) + opt + after
    return step, compute, step - compute, 0.0


def _overlapped(F, B, gf, gb, red, tail, opt, mode, n, timeline, copies, down, up, gathers) -> tuple:
    """The overlapped lanes in event time: ZeRO-3's gathers one unit ahead (at most two
    gathered at once), each bucket's reduction as backward completes it on a process group
    of its own, the host link's copies where the runtime issues them."""
    comp_t = comm_t = red_t = 0.0
    red_end: dict = {}
    f_end: list = []
    # forward: gather unit i while unit i-1 computes (at most two gathered at once), then compute it
    for i in range(len(F)):
        ready = 0.0
        if mode == "zero3":
            start = max(comm_t, f_end[i - 2] if i >= 2 else 0.0)
            comm_t = ready = start + gf[i]
            timeline.append((0, "comm", f"all_gather unit {i}", start, comm_t))
        s0 = max(comp_t, ready)
        comp_t = s0 + F[i]
        f_end.append(comp_t)
        timeline.append((0, "compute", f"F {i}", s0, comp_t))
    # backward: reverse, re-gather (ZeRO-3), compute, reduce the layer's gradients
    ready = comp_t
    for i in reversed(range(len(B))):
        if mode == "zero3" and gb[i]:
            start = max(comm_t, ready - (B[i + 1] if i + 1 < len(B) else 0.0))
            comm_t = start + gb[i]
            timeline.append((0, "comm", f"all_gather unit {i} (backward)", start, comm_t))
            s0 = max(comp_t, comm_t)
        else:
            s0 = comp_t
        comp_t = s0 + B[i]
        ready = comp_t
        timeline.append((0, "compute", f"B {i}", s0, comp_t))
        if n > 1:       # the runtime reduces on a process group of its own: beside the gathers
            start = max(red_t, comp_t)
            red_t = start + red[i]
            timeline.append((0, "comm", f"{'all_reduce' if mode == 'ddp' else 'reduce_scatter'} grads {i}",
                             start, red_t))
        red_end[i] = red_t
        if copies is not None and copies.early:   # bucket k launches here: bucket k-1 lands, its copy goes down
            for k in (k for k, g in enumerate(copies.group) if g == i and k > 0):
                timeline.append((0, "compute", f"grads down, bucket {k - 1}", comp_t, comp_t + down[k - 1]))
                comp_t += down[k - 1]
    s0 = max(comp_t, comm_t, red_t)
    if copies is not None:    # the last bucket (ZeRO-1: every one) lands when its reduction ends
        t = comp_t
        for k in range(len(down) - 1 if copies.early else 0, len(down)):
            start = max(t, red_end.get(copies.group[k], 0.0))
            t = start + down[k]
            timeline.append((0, "compute", f"grads down, bucket {k}", start, t))
        s0 = max(t, s0)
    comp_t = s0 + opt
    timeline.append((0, "compute", "optimizer", s0, comp_t))
    if copies is not None:    # a bucket's copy up, then its gather while the next bucket's copy runs
        a = b = comp_t
        for k, (u, g) in enumerate(zip(up, gathers)):
            timeline.append((0, "compute", f"params up, bucket {k}", a, a + u))
            a += u
            if g:
                start = max(a, b)
                b = start + g
                timeline.append((0, "comm", f"all_gather params, bucket {k}", start, b))
        comp_t = max(a, b)
    elif tail:
        timeline.append((0, "comm", "all_gather params", comp_t, comp_t + tail))
        comp_t += tail
    compute = sum(F) + sum(B) + opt
    return comp_t, compute, comp_t - compute, 0.0


def busy_union(intervals) -> float:
    """Seconds covered by the union of ``(start, end)`` intervals: how long some lane of them
    was busy (ZeRO-3's gathers and its reductions run on process groups of their own, side
    by side)."""
    covered, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > end:
            covered += b - max(a, end)
            end = b
    return covered
