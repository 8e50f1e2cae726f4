"""The time of a plan's step laid out (``cost.step_layout.StepLayout``): what each stage runs
after backward (``step_end``: the optimizer step, the host link's copies, the data-parallel
runtime's work, ZeRO-1/2's replica gathers), and the step of one stage
(``time_single_stage``) or of a pipeline (``time_pipeline``)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from .comm import pipeline_hop_time
from .data_parallel import StageSync, has_reducer, replica_gathers, sync_time
from .memory import Precision
from .offload import device_precision, flow_time, host_copies, host_step_time
from .pipeline import loss_broadcast_time, pipeline_time, refill_time, schedule_tail_time, schedule_wait, \
    tied_exchange_time
from .single_stage import busy_union, single_stage_time
from .step_layout import StepLayout
from .step_parts import optimizer_time, saved_bytes

__all__ = ["StepEnd", "step_end", "Timing", "time_single_stage", "time_pipeline"]


@dataclass
class StepEnd:
    """Per stage: the optimizer step (on the host under offload), the host link's copies
    (``cost.offload.HostCopies``; None without offload), the data-parallel runtime's host work
    (``sync``), ZeRO-1/2's replica gathers after the step (``tail``); and the bytes per element
    the device keeps (``pr_device``: without the optimizer state under offload)."""
    opt_time: list
    copies: list
    pr_device: Precision
    sync: list
    tail: list


def step_end(s: StepLayout, syncs: list) -> StepEnd:
    """What each stage runs besides its passes (``StepEnd``)."""
    c, plan, mode, slow = s.c, s.plan, s.plan.dp, s.slow
    if plan.offload == "optimizer":    # the step on the host; the host link's copies around it (cost.offload)
        opt_time = [host_step_time(x.opt_elements, x.tensors, s.pr, c) * slow for x in syncs]
        copies = [host_copies(x.host_buckets, mode, s.pr, c, slow) for x in syncs]
        pr_device = device_precision(s.pr)
    else:
        opt_time = [optimizer_time(x.states, x.tensors, c) * slow for x in syncs]
        copies, pr_device = [None] * s.S, s.pr
    # the runtime's host work per tensor, at the contention's slowdown (on ranks sharing cores, at
    # the mode's measured share of it, ``Cluster.shared_sync``)
    host_slow = slow * (dict(getattr(c, "shared_sync", ())).get(mode, 1.0) if s.world > c.gpus_per_node else 1.0)
    sync = [sync_time(mode, x.tensors, c) * host_slow if has_reducer(mode, s.n, s.S > 1) else 0.0 for x in syncs]
    # ZeRO-1/2: the updated shards all-gathered after the optimizer step
    tail_parts = [replica_gathers(x.tail_buckets, s.n, s.link_dp, c, opt_time[k] / slow, slow)
                  for k, x in enumerate(syncs)]
    if plan.offload == "optimizer":     # each bucket's copy up pipelined with that bucket's own gather
        copies = [dataclasses.replace(x, gather_parts=tuple(parts)) for x, parts in zip(copies, tail_parts)]
    return StepEnd(opt_time, copies, pr_device, sync, [sum(parts) for parts in tail_parts])


# ---- time --------------------------------------------------------------------------------------------

@dataclass
class Timing:
    """The step's time: its length, the compute and exposed communication in it, the bubble,
    the busiest stage's forward and backward, and what the host link's copies down and up add
    (under offload)."""
    step: float
    compute: float
    exposed: float
    bubble: float
    forward: float
    backward: float
    host_exposed: Optional[tuple] = None


def time_single_stage(s: StepLayout, x: StageSync, end: StepEnd, timeline: list, formulas: list,
                      simulate: bool) -> Timing:
    """One stage's step (``single_stage_time``) with the stage's pass cost beyond its ops, a
    link's measured ``overlap_loss``, and what the host link's copies add."""
    plan, n, dev, cslow = s.plan, s.n, s.c.device, s.cslow
    # a stage's pass (a module call forward and backward) has a cost beyond its ops
    F, B = list(s.F), list(s.B)
    F[0] += dev.pass_overhead * (1 - dev.backward_pass_share) * cslow
    B[0] += end.sync[0] + dev.pass_overhead * dev.backward_pass_share * cslow   # the bucket bookkeeping runs inside backward

    def one_stage(copies, lanes, overlap=plan.overlap):
        return single_stage_time(F, B, x.forward_gathers, x.backward_gathers, x.reductions, end.tail[0],
                                 end.opt_time[0], plan.dp, n, lanes, simulate, overlap, copies)

    step, compute, exposed, bubble = one_stage(end.copies[0], timeline)
    loss = s.link_dp.overlap_loss if n > 1 and plan.overlap else 0.0
    if loss:     # collectives overlapped with compute that still delay it (measured, local preset)
        if simulate:     # the compute lane's work, then the communication's lanes as they ran
            serial = sum(t1 - t0 for _, lane, _, t0, t1 in timeline if lane == "compute") + \
                busy_union([(t0, t1) for _, lane, _, t0, t1 in timeline if lane == "comm"])
        else:            # the closed form has no lanes: each collective in turn
            serial = one_stage(end.copies[0], [], False)[0]
        hidden = max(0.0, serial - step)
        formulas.append(("overlap on shared cores", "step = overlapped + overlap_loss x (compute + "
                         "communication busy - overlapped)",
                         f"{step:.4g} s + {loss:.2f} x {hidden:.4g} s = {step + loss * hidden:.4g} s"))
        step, exposed = step + loss * hidden, exposed + loss * hidden
    host_exposed = None
    if end.copies[0] is not None:     # what the copies down, then up, add: the step without them
        no_down = dataclasses.replace(end.copies[0], down=(0.0,) * len(end.copies[0].down))
        no_copies = dataclasses.replace(no_down, up=(0.0,) * len(no_down.up))
        without = [one_stage(y, [])[0] for y in (no_down, no_copies)]
        host_exposed = (step - without[0], without[0] - without[1])
    tp_exposed = sum(s.tpf) + sum(s.tpb)
    return Timing(step, compute - tp_exposed, exposed + tp_exposed, bubble, s.stage_sum(F, 0) * s.m,
                   s.stage_sum(B, 0) * s.m, host_exposed)


def _stage_actions(s: StepLayout, syncs: list) -> tuple:
    """(F, B, W, cache refill) seconds of each pipeline stage's actions for one micro-batch: its
    groups' passes, the stage pass's own cost and its messages' host work, a split backward's
    host work, a time-shared core's cache refill (``refill_time``), ZeRO-3's gathers (prefetched
    with the overlap pass, else waited on)."""
    S, dev, cslow, plan = s.S, s.c.device, s.cslow, s.plan
    msgs = [(k > 0) + (k < S - 1) for k in range(S)]     # a receive and a send per pass
    Fs = [s.stage_sum(s.F, k) + (dev.pass_overhead * (1 - dev.backward_pass_share) + msgs[k] * dev.message_overhead)
          * cslow for k in range(S)]
    Bs = [s.stage_sum(s.B, k) + (dev.pass_overhead * dev.backward_pass_share + msgs[k] * dev.message_overhead)
          * cslow for k in range(S)]
    Ws = [s.stage_sum(s.W, k) for k in range(S)]
    if plan.split_backward:     # splitting W out of backward costs host work of its own (measured on
        #                         the local preset: per W action, and per matmul whose weight gradient W
        #                         defers), part of it in the forward (each deferring matmul's autograd
        #                         function), the rest in B and W
        split = [(dev.split_pass_overhead + dev.split_op_overhead * sum(g.weight_matmuls for g in s.stage_groups[k]))
                 * cslow for k in range(S)]
        share = dev.split_forward_share
        Fs = [f + x * share for f, x in zip(Fs, split)]
        Bs, Ws = [b + x * (1 - share) for b, x in zip(Bs, split)], [w + x * (1 - share) for w, x in zip(Ws, split)]
    refills = [0.0] * S
    if s.shared is not None:     # an action on a time-shared core refills the cache (refill_time)
        load: dict = {}
        for grp, _, procs in s.shared[1]:
            load[grp] = load.get(grp, 0.0) + procs
        for k in range(S):
            grp, cores, _ = s.shared[1][k % s.p]
            if load[grp] > cores:
                refills[k] = refill_time(syncs[k].psi, sum(saved_bytes(g, s.kinds.get(g.name, "none"))
                                                           for g in s.stage_groups[k]), s.pr.compute, s.c)
        Fs, Bs = [f + x for f, x in zip(Fs, refills)], [b + x for b, x in zip(Bs, refills)]
        if plan.split_backward:
            Ws = [w + x for w, x in zip(Ws, refills)]
    if plan.dp == "zero3":    # each micro-batch gathers the stage's units again (prefetched, or not)
        both = max if plan.overlap else (lambda a, b: a + b)
        Fs = [both(Fs[k], sum(syncs[k].forward_gathers)) for k in range(S)]
        Bs = [both(Bs[k], sum(syncs[k].backward_gathers)) for k in range(S)]
    return Fs, Bs, Ws, refills


def time_pipeline(s: StepLayout, syncs: list, end: StepEnd, p2p_bytes: list, tied_bytes: float, timeline: list,
                  formulas: list, simulate: bool) -> Timing:
    """A pipeline's step: the schedule replayed (``pipeline_time``) with the stages' actions and
    transfers, then the deferred data-parallel reduction, the optimizer step and ZeRO-1/2's
    gathers, the tied gradients' exchange and the loss broadcast."""
    plan, c, S, p, m = s.plan, s.c, s.S, s.p, s.m
    Fs, Bs, Ws, refills = _stage_actions(s, syncs)
    hop = [pipeline_hop_time(p2p_bytes[k], s.link_pp, after=sum(s.f_stage[k]), schedule=plan.pp_schedule)
           for k in range(S)]
    pipe, bubble, busy = pipeline_time(plan, p, m, s.v, Fs, Bs, Ws, hop, timeline, simulate, s.shared,
                                       wake=getattr(s.link_pp, "wake", 0.0) if s.shared else 0.0, slow=s.slow)
    # after the last micro-batch: deferred dp reduction, tied gradients, optimizer, ZeRO gathers
    reduce_t, tail_t = [sum(x.reductions) for x in syncs], list(end.tail)
    if plan.offload == "optimizer":   # each bucket's copy down once its reduction lands it; the copies
        reduce_t = [flow_time(syncs[k].reductions[::-1], end.copies[k].down_by_group(len(s.stage_groups[k]))[::-1])
                    for k in range(S)]            # up pipelined with the gathers (cost.offload)
        tail_t = [end.copies[k].up_tail(end.tail[k]) for k in range(S)]
    after = [reduce_t[k] + end.opt_time[k] + tail_t[k] + end.sync[k] for k in range(S)]
    per_rank_after = [sum(after[k] for k in range(S) if k % p == r) for r in range(p)]
    # past its schedule a pipeline's ranks wait in these exchanges rather than compute, so
    # where ranks share cores they too ride the link as measured with a core per rank (the
    # shared link's fits are of ranks that all computed just before)
    link_tail = c.axis_link(s.axes, "pp")
    tied_t = tied_exchange_time(tied_bytes, link_tail)
    # the mean loss broadcast from the last stage over the pipeline's ranks (a binomial tree)
    loss_t = loss_broadcast_time(p, link_tail)
    # the rank that ends the schedule last meets the others after they waited for it, and
    # those exchanges then cost it more (measured, local preset: Link.tail)
    wait = schedule_wait(timeline, p, Bs, hop)
    late_t = schedule_tail_time(link_tail, wait)
    step = pipe + max(per_rank_after) + tied_t + loss_t + late_t
    if any(refills):
        formulas.append(("cache refill on a time-shared core", "per F, B (and W) action: 2 x (stage parameters "
                         "+ micro-batch activations) / (bandwidth x memory_eff)",
                         ", ".join(f"stage {k} {x * 1e3:.3g} ms" for k, x in enumerate(refills))))
    if late_t:
        a, b = link_tail.tail
        formulas.append(("pipeline schedule tail", "late = a + b x the other ranks' wait for the last",
                         f"{a * 1e3:.3g} ms + {b:.3g} x {wait * 1e3:.3g} ms = {late_t * 1e3:.3g} ms"))
    for r in range(p):      # after the schedule: the deferred reduction, the optimizer, the gathers
        mine = [k for k in range(S) if k % p == r]
        up = "params up + all_gather" if plan.offload == "optimizer" else "all_gather params"
        _lanes(timeline, r, pipe, (("dp reduction (deferred)", "comm", sum(reduce_t[k] + end.sync[k] for k in mine)),
                                   ("schedule tail", "comm", late_t), ("tied gradients", "comm", tied_t),
                                   ("loss broadcast", "comm", loss_t),
                                   ("optimizer", "compute", sum(end.opt_time[k] for k in mine)),
                                   (up, "comm", sum(tail_t[k] for k in mine))))
    tp_exposed = m * max(sum(s.tpf[a:b]) + sum(s.tpb[a:b]) for a, b in s.bounds)
    exposed = tp_exposed + max(per_rank_after) - min(end.opt_time) + tied_t + loss_t + late_t
    worst_r = max(range(p), key=lambda r: per_rank_after[r])
    host_exposed = tuple(sum(x[k] - y[k] for k in range(S) if k % p == worst_r)
                         for x, y in ((reduce_t, [sum(sy.reductions) for sy in syncs]), (tail_t, end.tail)))
    return Timing(step, busy - tp_exposed, exposed, bubble, max(s.stage_sum(s.F, k) for k in range(S)) * m,
                   max(s.stage_sum(s.B, k) for k in range(S)) * m, host_exposed)


def _lanes(timeline: list, rank: int, t0: float, spans) -> None:
    """``spans`` ((label, lane, seconds) each) one after another on ``rank`` from ``t0``."""
    for label, lane, dur in spans:
        if dur:
            timeline.append((rank, lane, label, t0, t0 + dur))
            t0 += dur


