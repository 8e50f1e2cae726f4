"""Pipeline-parallel benchmark: autopar against torch.distributed.pipelining, side by side.

    python benchmarks/bench_pp.py [--pp 2 4] [--microbatches 4 8] [--schedules gpipe 1f1b]
                                  [--steps N] [--warmup K]

For every pipeline size p it spawns p local gloo processes (autopar.testing.run, one thread
each; p=4 puts four processes on a 2-core machine, so its times are oversubscribed and are
no fair time comparison) and, for every (micro-batch count m, schedule), trains the SAME
small GPT (no tied weights; same seed, same initial weights by deepcopy of one model, same
sequence of batches, fp32, AdamW) two ways:

    autopar   autopar.compile(model, Mesh(pp=p), example_inputs=(batch,),
                              plan=Plan(pp_schedule=schedule, microbatches=m));
              dm.train_step((x,), y, loss_fn), then dm.optimizer(AdamW) step and zero_grad.
              autopar picks the cut itself (FLOP-balanced, fewest crossing bytes).
    torch     the same model split BY HAND, one nn.Module per rank: the embeddings and the
              first blocks in stage 0, ln_f and the LM head in the last stage, at the block
              boundaries autopar chose (read from dm.ctx.stages[k].params: a block goes to the
              stage holding most of its parameters; if autopar cut inside a block the output
              says so and torch is cut at the nearest block boundary);
              PipelineStage(stage_module, k, p, device=cpu) and ScheduleGPipe / Schedule1F1B
              (n_microbatches=m, loss_fn, the default scale_grads=True); schedule.step(x) on
              the first rank, step(target=y, losses=[]) on the last, step() in between, all
              with return_outputs=False (autopar does not gather the logits either); AdamW
              over the stage's parameters.

Both average the loss over the m micro-batches (autopar scales each micro-batch's loss by
1/m before backward, torch divides the accumulated gradients by m after it).

Measured, per (p, m, schedule):
  time    one step = the whole pipelined forward+backward of all m micro-batches
          (dm.train_step / schedule.step) + optimizer.step() + zero_grad(set_to_none=True).
          All ranks meet at a dist.barrier() before every timed step, outside the timed
          region; each rank keeps its own perf_counter times. The two implementations run
          interleaved (one step of each per round, the order alternating every round) so that
          changes in machine load hit both alike. Reported: the max over ranks of each rank's
          median (and interquartile range, max over ranks of the quartiles), and their
          ratio; "paired ratio" = per round, autopar's step over torch's step of the same
          round (each the max over ranks), median and quartiles over the rounds. The "pipeline
          part" column is the same for the train_step / schedule.step part alone (no
          optimizer). autopar's train_step also broadcasts the loss from the last rank to
          every rank (torch's step does not; the loss stays on the last rank).
  compute the part of the pipeline part spent computing on this rank: the sum over the
          step's forward, backward and loss computations (autopar: dm.timeline, its F and B
          actions, the loss inside the last stage's F; torch: PipelineStage.forward_one_chunk,
          backward_one_chunk and the schedule's loss call, timed by wrappers); max over ranks
          of the per-rank median. The rest of the pipeline part is waiting for the other
          stages (the bubble), the point-to-point calls and the runtime's own work.
  flush   autopar only: the end-of-step gradient flush of its stages
          (DataParallelSync.flush_deferred, timed by a wrapper; with no dp axis it reduces
          over one rank, i.e. it concatenates the accumulated gradients into a bucket buffer
          and hands them back as .grad); max over ranks of the per-rank median.
  bytes   point-to-point bytes SENT by each rank in one step (activations forward, their
          gradients backward), one extra untimed step. autopar: its own counter,
          dm.comm_stats.total(axis="pp") after comm_stats.reset(). torch: COMPUTED from the
          shapes: each message is one micro-batch of the stage's output, (B/m) x seq x dim
          fp32, m of them forward (every rank but the last) and m gradients backward (every
          rank but the first); cross-checked by COUNTING the tensors of the P2POps that
          torch's stage hands to its schedule (PipelineStage.get_fwd_send_ops /
          get_bwd_send_ops wrapped for that step).
  memory  torch.profiler.profile(profile_memory=True) is started before the implementation
          is built (the model is deep-copied inside the window, so its parameters are
          allocations of the window) and covers the build, two steps and a measured third
          step. Every CPU allocation and free of the c10 allocator is an event with its
          address; allocations and frees are matched by address (a block whose address is
          handed out again counts as freed then: gloo's worker thread can drop the last
          reference to a message buffer, and the profiler records no free on that thread).
          The live total of the blocks allocated inside the window is what this
          implementation holds. Reported per rank: "peak" = its maximum during the measured
          step; "state" = its value when that step starts (parameters, AdamW state, buffers
          kept across steps; gradients are None after zero_grad); "drift" = the value after
          the step minus before it (0 in the steady state; the method's error bar).
          gc.collect() runs once after each build. Identical for both implementations.
  check   the mean loss of every step (same batches, same order) for both, from the last
          rank, and the largest parameter difference at the end, max over ranks.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import autopar

CONFIG = {"vocab": 512, "seq": 64, "dim": 256, "heads": 4, "layers": 8}
GLOBAL_BATCH = 16
N_BATCHES = 4          # step k uses batch k % N_BATCHES, the same sequence for both implementations
LR = 1e-3
SEED = 0
IMPLS = ("autopar", "torch")


# ---- the model: a small GPT without tied weights ---------------------------------------------

class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, seq, dim, heads, layers):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)     # untied

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_batches():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(N_BATCHES):
        data = torch.randint(0, CONFIG["vocab"], (GLOBAL_BATCH, CONFIG["seq"] + 1), generator=g)
        out.append((data[:, :-1].contiguous(), data[:, 1:].contiguous()))
    return out


# ---- torch's hand split ------------------------------------------------------------------------

class StageModule(nn.Module):
    """Blocks [lo, hi) of ``model``, with the embeddings if first and ln_f + head if last.
    Parameter names are the full model's (blocks kept under their original index)."""

    def __init__(self, model: GPT, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe = model.wte, model.wpe
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(lo, hi)})
        if last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x):
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        for blk in self.blocks.values():
            x = blk(x)
        if self.last:
            x = self.head(self.ln_f(x))
        return x


def block_split(stages, model: GPT) -> tuple[list[tuple[int, int]], list[str]]:
    """Per stage the block range [lo, hi) that torch gets, from autopar's stage parameters:
    a block goes to the stage that holds most of its parameter elements. Notes say where the
    split differs from autopar's (a cut inside a block, embeddings/head elsewhere)."""
    numel = {n: p.numel() for n, p in model.named_parameters()}
    layers, p = len(model.blocks), len(stages)
    owner, notes = [], []
    for i in range(layers):
        per = [sum(numel[n] for n in s.params if n.startswith(f"blocks.{i}.")) for s in stages]
        holders = [k for k, v in enumerate(per) if v]
        if len(holders) > 1:
            notes.append(f"autopar cut inside block {i} (its parameters in stages {holders}); torch is cut "
                         f"at the nearest block boundary (the block goes to stage {per.index(max(per))})")
        owner.append(per.index(max(per)))
    if owner != sorted(owner):
        notes.append(f"autopar's blocks are not in stage order ({owner}); torch uses them in order")
        owner = sorted(owner)
    ranges, lo = [], 0
    for k in range(p):
        hi = lo + owner.count(k)
        ranges.append((lo, hi))
        lo = hi
    for name, want in (("wte.weight", 0), ("wpe.weight", 0), ("ln_f.weight", p - 1), ("head.weight", p - 1)):
        where = [s.index for s in stages if name in s.params]
        if where != [want]:
            notes.append(f"autopar has {name} in stage(s) {where}; torch keeps it in stage {want}")
    return ranges, notes


def describe_split(stages, ranges, m: int) -> list[str]:
    out = []
    for s, (lo, hi) in zip(stages, ranges):
        blocks = sorted({int(n.split(".")[1]) for n in s.params if n.startswith("blocks.")})
        extra = [n.rsplit(".", 1)[0] for n in s.params if not n.startswith("blocks.") and n.endswith("weight")]
        span = f"blocks {blocks[0]}-{blocks[-1]}" if blocks else "no blocks"
        sends = (f"sends {len(s.outputs)} value(s), {s.send_bytes:,} B per micro-batch at m={m}"
                 if s.send_bytes else "sends nothing")
        out.append(f"stage {s.index}: autopar {', '.join(extra + [span])}, {s.flops / 1e9:.2f} GFLOP forward "
                   f"per micro-batch at m={m}, {sends} | torch blocks {lo}-{hi - 1}")
    return out


def split_key(stages, ranges) -> tuple:
    return tuple(ranges), tuple((s.params, len(s.outputs)) for s in stages)


# ---- the two implementations -------------------------------------------------------------------

class Impl:
    """One implementation on this rank. ``step()`` runs its next training step (step k uses
    batch k % N_BATCHES); ``last_times`` = (whole step, pipeline part, compute) in seconds."""

    def __init__(self, name: str, ref: GPT, batches, m: int, schedule: str, ranges=None):
        self.name, self.m, self.batches, self.k = name, m, batches, 0
        self.losses: list[float] = []
        p, rank = dist.get_world_size(), dist.get_rank()
        self.first, self.last_rank = rank == 0, rank == p - 1
        model = copy.deepcopy(ref)
        if name == "autopar":
            self.dm = autopar.compile(model, autopar.Mesh(pp=p), example_inputs=(batches[0][0],),
                                      plan=autopar.Plan(pp_schedule=schedule, microbatches=m))
            self.opt = self.dm.optimizer(torch.optim.AdamW, lr=LR)
            self.stages = self.dm.ctx.stages
            self.flush = 0.0       # this step's end-of-step gradient flush (summed over stages)
            for st in self.dm.stages.values():
                st._sync.flush_deferred = self._timed(st._sync.flush_deferred, "flush")
        else:
            if ranges is None:      # the first autopar build on this rank says where to cut
                raise ValueError("torch needs the block ranges")
            lo, hi = ranges[rank]
            self.module = StageModule(model, lo, hi, first=rank == 0, last=rank == p - 1)
            self.stage = PipelineStage(self.module, rank, p, device=torch.device("cpu"))
            cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
            self.schedule = cls(self.stage, n_microbatches=m, loss_fn=loss_fn)
            self.opt = torch.optim.AdamW(self.module.parameters(), lr=LR)
            self._compute = 0.0     # this step's forward/backward/loss compute on this rank
            self.stage.forward_one_chunk = self._timed(self.stage.forward_one_chunk)
            self.stage.backward_one_chunk = self._timed(self.stage.backward_one_chunk)
            self.schedule._compute_loss = self._timed(self.schedule._compute_loss)
        del model
        self.last_times = (0.0, 0.0, 0.0)

    def _timed(self, fn, attr: str = "_compute"):
        """``fn`` that adds its wall time to ``self.<attr>``."""
        def inner(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, attr, getattr(self, attr) + time.perf_counter() - t)
        return inner

    def step(self) -> None:
        x, y = self.batches[self.k % len(self.batches)]
        t0 = time.perf_counter()
        if self.name == "autopar":
            self.flush = 0.0
            loss = self.dm.train_step((x,), y, loss_fn)
            compute = sum(b - a for _, a, b in self.dm.timeline)
        else:
            self._compute = 0.0
            losses = []
            if self.first:
                self.schedule.step(x, return_outputs=False)
            elif self.last_rank:
                self.schedule.step(target=y, losses=losses, return_outputs=False)
            else:
                self.schedule.step(return_outputs=False)
            loss = torch.stack(losses).mean() if losses else None
            compute = self._compute
        t1 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.last_times = (time.perf_counter() - t0, t1 - t0, compute)
        self.k += 1
        if self.last_rank:
            self.losses.append(float(loss.detach()))

    def named_params(self) -> dict[str, torch.Tensor]:
        """This rank's parameters under the full model's names."""
        mods = self.dm.stages.values() if self.name == "autopar" else [self]
        return {n: t.detach() for st in mods for n, t in st.module.named_parameters()}

    def count_send_bytes(self) -> int:
        """One step with torch's send ops counted (the P2POps the stage returns)."""
        sent = [0]
        orig = (self.stage.get_fwd_send_ops, self.stage.get_bwd_send_ops)

        def wrap(fn):
            def inner(*args, **kwargs):
                ops = fn(*args, **kwargs)
                sent[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
                return ops
            return inner
        self.stage.get_fwd_send_ops, self.stage.get_bwd_send_ops = (wrap(f) for f in orig)
        try:
            self.step()
        finally:
            del self.stage.get_fwd_send_ops, self.stage.get_bwd_send_ops   # back to the class methods
        return sent[0]


# ---- memory: the profiler's allocation events --------------------------------------------------

MEASURED = "bench_pp::measured_step"


@contextlib.contextmanager
def _quiet_fd2():
    """Kineto writes a line to fd 2 whenever a profiler starts or stops."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _cpu_allocations(prof) -> list[tuple[int, int, int]]:
    """(time ns, address, signed bytes) of every CPU allocation (+) and free (-), in time order."""
    from torch._C._profiler import _EventType
    out, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        node = todo.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            out.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
        todo.extend(node.children)
    out.sort(key=lambda e: e[0])
    return out


def live_totals(events, t0: int, t1: int) -> dict:
    """Live bytes of the blocks allocated in the profiled window: at t0, the peak in
    [t0, t1], and at t1. A free matches the live block at its address; an allocation at the
    address of a live block first frees that block (its free went unrecorded)."""
    live: dict[int, int] = {}
    total, state, peak = 0, None, 0
    for t, ptr, nb in events:
        if t > t1:
            break
        if state is None and t >= t0:
            state = peak = total
        if nb > 0:
            total += nb - live.pop(ptr, 0)
            live[ptr] = nb
        elif ptr in live:        # frees of blocks allocated before the window are not ours
            total -= live.pop(ptr)
        if state is not None:
            peak = max(peak, total)
    if state is None:
        state = peak = total
    return {"state": state, "peak": peak, "drift": total - state}


def profiled_build(name, ref, batches, m, schedule, ranges=None) -> tuple[Impl, dict]:
    """Build ``name`` and run 3 steps under the memory profiler; the third is measured."""
    from torch.profiler import ProfilerActivity, profile, record_function
    gc.collect()
    dist.barrier()
    with _quiet_fd2(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        impl = Impl(name, ref, batches, m, schedule, ranges)
        gc.collect()       # autopar.compile collects itself; the same for torch's build
        impl.step()
        impl.step()
        dist.barrier()
        with record_function(MEASURED):
            impl.step()
    mark = next(e for e in prof.profiler.kineto_results.events() if e.name() == MEASURED)
    return impl, live_totals(_cpu_allocations(prof), mark.start_ns(), mark.end_ns())


# ---- one rank ----------------------------------------------------------------------------------

def run_config(ref, batches, m: int, schedule: str, steps: int, warmup: int) -> dict:
    p, rank = dist.get_world_size(), dist.get_rank()
    impls, mem = {}, {}
    impls["autopar"], mem["autopar"] = profiled_build("autopar", ref, batches, m, schedule)
    stages = impls["autopar"].stages
    ranges, notes = block_split(stages, ref)
    impls["torch"], mem["torch"] = profiled_build("torch", ref, batches, m, schedule, ranges)
    for _ in range(warmup):
        for name in IMPLS:
            dist.barrier()
            impls[name].step()
    times = {name: [] for name in IMPLS}
    pipe = {name: [] for name in IMPLS}
    compute = {name: [] for name in IMPLS}
    flush = []
    for i in range(steps):
        for name in (IMPLS if i % 2 == 0 else IMPLS[::-1]):
            dist.barrier()
            impls[name].step()
            total, part, busy = impls[name].last_times
            times[name].append(total)
            pipe[name].append(part)
            compute[name].append(busy)
            if name == "autopar":
                flush.append(impls[name].flush)
    # bytes: one more step of each
    dm = impls["autopar"].dm
    dm.comm_stats.reset()
    dist.barrier()
    impls["autopar"].step()
    ap_bytes = {f"{ph}": dm.comm_stats.total(axis="pp", phase=ph) for ph in ("forward", "backward")}
    dist.barrier()
    torch_counted = impls["torch"].count_send_bytes()
    mb_rows = GLOBAL_BATCH // m
    msg = mb_rows * CONFIG["seq"] * CONFIG["dim"] * 4
    torch_computed = m * msg * ((rank < p - 1) + (rank > 0))
    # agreement
    a, t = impls["autopar"].named_params(), impls["torch"].named_params()
    if set(a) != set(t):
        raise RuntimeError(f"rank {rank}: the two implementations hold different parameters: "
                           f"autopar only {sorted(set(a) - set(t))}, torch only {sorted(set(t) - set(a))}")
    pdiff = max((a[n] - t[n]).abs().max().item() for n in a)
    return {"times": times, "pipe": pipe, "compute": compute, "flush": flush, "mem": mem,
            "bytes": {"autopar": sum(ap_bytes.values()), "autopar_by": ap_bytes,
                      "torch_computed": torch_computed, "torch_counted": torch_counted, "msg": msg},
            "losses": {name: impls[name].losses for name in IMPLS}, "param_diff": pdiff,
            "split": describe_split(stages, ranges, m), "split_key": split_key(stages, ranges), "notes": notes,
            "stage_params": sum(v.numel() for v in t.values())}


def rank_main(configs, steps: int, warmup: int) -> list[dict]:
    torch.manual_seed(SEED)
    ref = GPT(**CONFIG)
    batches = make_batches()
    out = []
    for m, schedule in configs:
        t = time.perf_counter()
        res = run_config(ref, batches, m, schedule, steps, warmup)
        res.update(m=m, schedule=schedule, wall=time.perf_counter() - t)
        out.append(res)
        gc.collect()
    return out


# ---- the report --------------------------------------------------------------------------------

def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def _med_iqr(per_rank: list[list[float]]) -> tuple[float, float, float]:
    qs = [statistics.quantiles(v, n=4) if len(v) > 1 else [v[0]] * 3 for v in per_rank]
    return (max(statistics.median(v) for v in per_rank), max(q[0] for q in qs), max(q[2] for q in qs))


def report(p: int, results: list[list[dict]], oversubscribed: bool) -> str:
    lines = []
    n_params = sum(p_.numel() for p_ in GPT(**CONFIG).parameters())
    over = (f", OVERSUBSCRIBED: {p} processes on {os.cpu_count()} cores, the times are no fair comparison"
            if oversubscribed else "")
    lines.append(f"pp = {p} ({p} processes{over}), GPT {CONFIG} untied, {n_params:,} parameters, "
                 f"global batch {GLOBAL_BATCH}, fp32, AdamW(lr={LR})")
    first = results[0][0]
    lines.append("split (the same block boundaries for every m and schedule unless noted):")
    lines += ["  " + s for s in first["split"]]
    for cfg_i in range(len(results[0])):
        notes = sorted({n for r in results for n in r[cfg_i]["notes"]})
        c = results[0][cfg_i]
        if c["split_key"] != first["split_key"]:
            notes = c["split"] + notes
        if notes:
            lines.append(f"  m={c['m']} {c['schedule']}: " + "; ".join(notes))
    configs = [[r[i] for r in results] for i in range(len(results[0]))]   # per config, per rank

    lines.append("")
    lines.append("| m | schedule | autopar step ms (IQR) | torch step ms (IQR) | autopar/torch | "
                 "paired ratio (IQR) | pipeline part ms autopar / torch | compute ms autopar / torch | "
                 "autopar grad flush ms |")
    lines.append("|" + "---|" * 9)
    for rs in configs:
        med = {n: _med_iqr([r["times"][n] for r in rs]) for n in IMPLS}
        pipe = {n: _med_iqr([r["pipe"][n] for r in rs])[0] for n in IMPLS}
        busy = {n: _med_iqr([r["compute"][n] for r in rs])[0] for n in IMPLS}
        flush = _med_iqr([r["flush"] for r in rs])[0]
        # the same round's steps: max over ranks of autopar's over max over ranks of torch's
        paired = [max(a) / max(t) for a, t in zip(zip(*[r["times"]["autopar"] for r in rs]),
                                                  zip(*[r["times"]["torch"] for r in rs]))]
        pq = statistics.quantiles(paired, n=4) if len(paired) > 1 else [paired[0]] * 3
        lines.append(f"| {rs[0]['m']} | {rs[0]['schedule']} | {med['autopar'][0] * 1e3:.0f} "
                     f"({med['autopar'][1] * 1e3:.0f}-{med['autopar'][2] * 1e3:.0f}) | "
                     f"{med['torch'][0] * 1e3:.0f} ({med['torch'][1] * 1e3:.0f}-{med['torch'][2] * 1e3:.0f}) | "
                     f"{med['autopar'][0] / med['torch'][0]:.2f}x | "
                     f"{statistics.median(paired):.2f}x ({pq[0]:.2f}-{pq[2]:.2f}) | "
                     f"{pipe['autopar'] * 1e3:.0f} / {pipe['torch'] * 1e3:.0f} | "
                     f"{busy['autopar'] * 1e3:.0f} / {busy['torch'] * 1e3:.0f} | {flush * 1e3:.1f} |")

    lines.append("")
    lines.append("| m | schedule | p2p bytes sent per rank per step: autopar (dm.comm_stats) | "
                 "torch, computed | torch, counted send ops |")
    lines.append("|" + "---|" * 5)
    for rs in configs:
        cols = [" / ".join(f"{r['bytes'][k]:,.0f}" for r in rs) for k in ("autopar", "torch_computed", "torch_counted")]
        lines.append(f"| {rs[0]['m']} | {rs[0]['schedule']} | " + " | ".join(cols) + " |")

    lines.append("")
    lines.append("| m | schedule | peak MiB autopar | peak MiB torch | state MiB autopar | state MiB torch | "
                 "drift MiB autopar / torch |")
    lines.append("|" + "---|" * 7)
    for rs in configs:
        def col(impl, key, rs=rs):
            return " / ".join(_mib(r["mem"][impl][key]) for r in rs)
        drift = [max(abs(r["mem"][n]["drift"]) for r in rs) for n in IMPLS]
        lines.append(f"| {rs[0]['m']} | {rs[0]['schedule']} | {col('autopar', 'peak')} | {col('torch', 'peak')} | "
                     f"{col('autopar', 'state')} | {col('torch', 'state')} | "
                     f"{_mib(drift[0])} / {_mib(drift[1])} |")
    lines.append("(bytes and memory: per rank, rank 0 / rank 1 / ...; parameters per rank: " +
                 " / ".join(f"{r['stage_params']:,} = {_mib(4 * r['stage_params'])} MiB" for r in configs[0]) + ")")

    lines.append("")
    lines.append("losses (mean over the global batch, from the last rank), first and last step; max |diff| "
                 "over all steps; max |parameter diff| at the end (max over ranks):")
    for rs in configs:
        la, lt = rs[-1]["losses"]["autopar"], rs[-1]["losses"]["torch"]
        dmax = max(abs(x - y) for x, y in zip(la, lt))
        pd = max(r["param_diff"] for r in rs)
        lines.append(f"  m={rs[0]['m']} {rs[0]['schedule']:5s}: first autopar {la[0]:.6f} torch {lt[0]:.6f}; "
                     f"last ({len(la)} steps) autopar {la[-1]:.6f} torch {lt[-1]:.6f}; max |diff| {dmax:.1e}; "
                     f"param |diff| {pd:.1e}  ({rs[0]['wall']:.0f}s)")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline sizes (processes)")
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"], choices=["gpipe", "1f1b"])
    ap.add_argument("--steps", type=int, default=15, help="timed steps per implementation and config")
    ap.add_argument("--warmup", type=int, default=2,
                    help="untimed steps before timing (after the 3 profiled steps that follow the build)")
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args(argv)
    configs = [(m, s) for m in args.microbatches for s in args.schedules]
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores, gloo, 1 thread per process, fp32; "
          f"{args.warmup} warm-up + {args.steps} timed steps per implementation and config, interleaved")
    print("time: forward+backward of all micro-batches + AdamW step + zero_grad after a barrier; max over ranks "
          "of the per-rank median (IQR: max over ranks of the quartiles); paired ratio: per round autopar/torch "
          "(max over ranks each), median (IQR) over rounds; pipeline part: train_step / schedule.step alone; "
          "compute: its forward/backward/loss computation (autopar dm.timeline, torch wrapped stage calls)")
    print("bytes: point-to-point bytes sent by each rank in one step; autopar: dm.comm_stats; torch: computed "
          "from the stage output shape (m activations forward, m gradients backward), and counted from "
          "torch's send P2POps")
    print("memory: torch.profiler(profile_memory=True) from before the build through the 3rd step; live total "
          "of the CPU blocks allocated in that window; peak during the 3rd step, state when it starts, "
          "drift = after minus before")
    print()
    start = time.perf_counter()
    for p in args.pp:
        t = time.perf_counter()
        results = autopar.testing.run(rank_main, p, configs, args.steps, args.warmup, timeout=args.timeout)
        print(report(p, results, oversubscribed=p > (os.cpu_count() or 1)))
        print(f"(pp={p} took {time.perf_counter() - t:.0f}s)")
        print()
        sys.stdout.flush()
    print(f"total {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
