"""Pipeline parallelism on real processes: parity of every schedule, point-to-point bytes, the
measured bubble, full views across stages, the recorded timeline."""
from __future__ import annotations

import copy
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
from autopar.models import GPTConfig, TinyGPT, gpt_batch, lm_loss
from autopar.testing import parity

from .common import report

class SkipMLP(torch.nn.Module):
    """A long skip connection: the first activation is read again by the last layer, so a
    pipeline passes it through every stage in between."""

    def __init__(self, d=24, layers=6):
        super().__init__()
        self.inp = torch.nn.Linear(d, d)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(layers))
        self.out = torch.nn.Linear(d, d)

    def forward(self, x):
        x0 = torch.tanh(self.inp(x))
        h = x0
        for lin in self.layers:
            h = h + torch.tanh(lin(h))
        return self.out(h + x0)


def parity_pp(configs):
    """Parity of pipelined plans: ``configs`` = [(model, mesh axes, plan kwargs), ...]."""
    torch.set_num_threads(1)
    out = []
    for model, axes, kw in configs:
        mesh = autopar.Mesh(**axes)
        plan = autopar.Plan(**kw)
        if model == "gpt":
            c = GPTConfig(layers=4)
            x, t = gpt_batch(c, 16)
            rep = parity(lambda: TinyGPT(c), mesh, plan, (x,), t, lm_loss)
        else:
            torch.manual_seed(1)
            x, t = torch.randn(16, 24), torch.randn(16, 24)
            rep = parity(lambda: SkipMLP(), mesh, plan, (x,), t, F.mse_loss)
        out.append(report(rep, f"{model} {mesh} {plan}"))
    return out


class HeavyMLP(torch.nn.Module):
    """Identical wide layers: stages of equal, measurable compute (for the bubble)."""

    def __init__(self, d=768, layers=8):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(d))
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(layers))

    def forward(self, x):
        x = x * self.scale      # the first matmul's input carries a gradient: equal backward work per stage
        for lin in self.layers:
            x = torch.tanh(lin(x))
        return x


def pp_bubble(schedules, m=4, rows=256, d=768, steps=9):
    """Measured per-rank timeline of pipelined steps: bubble = 1 - busy / makespan per rank,
    makespan from the first compute start to the last compute end over the pipeline's ranks
    (one wall clock: the processes share the machine). The least of ``steps`` steps after a
    warm-up step is kept."""
    p = dist.get_world_size()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= p:     # one core per stage: no migrations between the two
        os.sched_setaffinity(0, {cpus[dist.get_rank()]})
    try:
        return _bubbles(schedules, m, rows, d, steps)
    finally:
        os.sched_setaffinity(0, cpus)      # the process may run other jobs next


def _bubbles(schedules, m, rows, d, steps):
    p = dist.get_world_size()
    torch.manual_seed(0)
    x, t = torch.randn(rows * m, d), torch.randn(rows * m, d)
    out = {}
    for name in schedules:
        dm = autopar.compile(HeavyMLP(d), autopar.Mesh(pp=p), example_inputs=(x,),
                             plan=autopar.Plan(pp_schedule=name, microbatches=m))
        opt = torch.optim.SGD(dm.parameters(), lr=1e-4)
        samples = []
        for step in range(steps + 1):
            dist.barrier()
            opt.zero_grad()
            dm.train_step((x,), t, F.mse_loss)
            opt.step()
            rows_ = [None] * p
            dist.all_gather_object(rows_, dm.timeline)
            if step == 0:
                continue
            start = min(a for tl in rows_ for _, a, _ in tl)
            end = max(b for tl in rows_ for _, _, b in tl)
            bubbles = [1 - sum(b - a for _, a, b in tl) / (end - start) for tl in rows_]
            samples.append({"bubble": sum(bubbles) / p, "per_rank": bubbles, "makespan": end - start})
        samples.sort(key=lambda r: r["bubble"])
        # the least disturbed step: on two shared cores another process only ever adds idle
        # time (a rank waiting for a core), never removes the schedule's own
        best = dict(samples[0])
        best["all"] = [r["bubble"] for r in samples]
        path = tempfile.mkdtemp() if dist.get_rank() == 0 else None
        files = dm.dump(path or tempfile.mkdtemp())      # collective over pp: the measured trace
        with open(next(f for f in files if f.endswith("/trace.json"))) as f:
            best["trace"] = json.load(f)
        out[name] = best
    return out


def pp_bytes(m=4):
    """Bytes a pipelined GPT sends point to point in one step, with what the formula needs."""
    torch.set_num_threads(1)
    c = GPTConfig(layers=4)
    x, t = gpt_batch(c, 8)
    dm = autopar.compile(TinyGPT(c), autopar.Mesh(pp=dist.get_world_size()), example_inputs=(x,),
                         plan=autopar.Plan(pp_schedule="1f1b", microbatches=m))
    dm.train_step((x,), t, lm_loss)
    dm.comm_stats.reset()
    dm.train_step((x,), t, lm_loss)
    return {"bytes": {k: v for k, v in dm.comm_stats.bytes.items() if k[0] == "pp"},
            "calls": {k: v for k, v in dm.comm_stats.calls.items() if k[0] == "pp"},
            "residual_bytes": 8 * c.seq * c.dim * 4, "stage_sends": [s.send_bytes for s in dm.ctx.stages]}


def pp_clip_and_state(plan_kwargs):
    """clip_grad_norm_, full_grads and load/full_state_dict of a pipelined module against the
    single-device model (the norm over every stage, tied weight counted once)."""
    torch.set_num_threads(1)
    c = GPTConfig(layers=4)
    x, t = gpt_batch(c, 8)
    torch.manual_seed(0)
    ref = TinyGPT(c)
    mesh = autopar.Mesh(pp=2, dp=dist.get_world_size() // 2)
    dm = autopar.compile(copy.deepcopy(ref), mesh, example_inputs=(x,), plan=autopar.Plan(**plan_kwargs))
    lm_loss(ref(x), t).backward()
    norm_ref = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1))
    dm.train_step((dm.shard_batch(x),), dm.shard_batch(t), lm_loss)
    norm = float(dm.clip_grad_norm_(0.1))
    grads = dm.full_grads()
    grad_err = max(float((grads[k] - p.grad).abs().max()) for k, p in ref.named_parameters())
    state = dm.full_state_dict()
    dm.load_full_state_dict({k: v * 2 for k, v in state.items()})
    again = dm.full_state_dict()
    load_err = max(float((again[k] - 2 * state[k]).abs().max()) for k in state)
    with torch.device("meta"):
        lazy = TinyGPT(c)
    pm = autopar.compile(lazy, mesh, example_inputs=(torch.empty_like(x, device="meta"),),
                         plan=autopar.Plan(**plan_kwargs))
    pm.to_empty(device="cpu")
    pm.load_full_state_dict(ref.state_dict())
    loaded = pm.full_state_dict()
    meta_err = max(float((loaded[k] - v).abs().max()) for k, v in ref.state_dict().items())
    return {"norm": norm, "norm_ref": norm_ref, "grad_err": grad_err, "load_err": load_err,
            "keys": sorted(state) == sorted(ref.state_dict()), "meta_err": meta_err}


def pipeline_timeline(out_dir):
    """1F1B on pp=2: a recorded train_step's lanes hold the point-to-point transfers; dump
    writes timeline.json beside the schedule files."""
    torch.set_num_threads(1)
    c = GPTConfig(layers=4)
    x, t = gpt_batch(c, 8)
    torch.manual_seed(0)
    pm = autopar.compile(TinyGPT(c), autopar.Mesh(pp=2), example_inputs=(x,),
                         plan=autopar.Plan(pp_schedule="1f1b", microbatches=4))
    pm.train_step((x,), t, lm_loss)
    with pm.record_timeline():
        pm.train_step((x,), t, lm_loss)
    files = pm.dump(out_dir) if dist.get_rank() == 0 else []
    if dist.get_rank():
        pm.dump(out_dir + "_1")        # collective over pp: every rank dumps
    tl = pm.timelines[dist.get_rank()]
    return {"names": sorted({name.split(" ")[0] for k, name, *_ in tl.events if k == "comm"}),
            "n": len(pm.timelines), "files": [os.path.basename(f) for f in files]}


def pp_directions(plan_kwargs):
    """(kind, group, source, destination) of every transfer this rank issued in one training
    step of a GPT (tied embedding and head: their gradients exchanged after the schedule)
    pipelined over every rank under ``plan_kwargs``, as the flight recorder noted them."""
    from autopar.runtime import flight
    torch.set_num_threads(1)
    c = GPTConfig(layers=4)
    x, t = gpt_batch(c, 8)
    me = dist.get_rank()
    dm = autopar.compile(TinyGPT(c), autopar.Mesh(pp=dist.get_world_size()), example_inputs=(x,),
                         plan=autopar.Plan(**plan_kwargs))
    with flight.recording() as tape:
        dm.train_step((x,), t, lm_loss)
    return [(e.kind, e.group.name) + ((me, e.peer) if e.kind == "send" else (e.peer, me))
            for e in tape if e.peer is not None]


class _BatchStatisticFirst(torch.nn.Module):
    """A statistic over the batch in the first stage only: its micro-batches would change it,
    so that stage is refused and the others compile."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (torch.nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        h = self.a(x)
        h = h - h.mean(0, keepdim=True)
        h = self.b(torch.relu(h))
        return self.d(torch.relu(self.c(torch.relu(h))))


def one_stage_refused(timeout: float):
    """(error type, message, seconds) of compiling ``_BatchStatisticFirst`` under 1F1B with a
    mesh timeout of ``timeout`` seconds, on every rank."""
    start = time.perf_counter()
    try:
        autopar.compile(_BatchStatisticFirst(), autopar.Mesh(pp=2, timeout=timeout), example_inputs=(torch.randn(8, 16),),
                        plan=autopar.Plan(pp_schedule="1f1b", microbatches=2))
        return None, "", time.perf_counter() - start
    except Exception as exc:
        return type(exc).__name__, str(exc), time.perf_counter() - start
