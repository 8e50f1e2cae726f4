"""Data-parallel benchmark: autopar against torch's own implementations, side by side.

    python benchmarks/bench_dp.py [--world-sizes 2 4] [--steps N] [--warmup K]

For every world size N it spawns N local gloo processes (autopar.testing.run, one thread
each) and trains the SAME small GPT (same seed, same initial weights, same batches, fp32,
AdamW) with four implementations:

    autopar ddp     autopar.compile(..., plan=Plan(dp="ddp"))
    torch DDP       torch.nn.parallel.DistributedDataParallel (default buckets)
    autopar zero3   autopar.compile(..., plan=Plan(dp="zero3"))
    torch FSDP2     torch.distributed.fsdp.fully_shard per transformer block, then the root
                    (defaults: blocks reshard after forward, the root does not)

and prints, per implementation: the median step time, the autopar/torch ratio, the bytes
each rank moves per step and the peak per-rank memory. How each figure is measured:

  time    one step = forward + loss + backward + optimizer.step + zero_grad. Before every
          timed step all ranks meet at a barrier (outside the timed region); each rank keeps
          its own wall-clock times; reported: max over ranks of the per-rank median. The
          implementations are timed interleaved (one step of each, round-robin) so that
          drift in machine load hits all four alike.
  bytes   one extra step after timing. autopar: its own counter dm.comm_stats. torch: the
          Python functions of torch.distributed that the implementations call are wrapped
          for that step (FSDP2 in torch 2.13 calls dist.all_gather_single and
          dist.reduce_scatter_single, see torch/distributed/fsdp/_fully_shard/
          _fsdp_collectives.py); DDP's reducer is C++, so a separate DDP instance with a
          comm hook counts each bucket and then runs torch's default allreduce_hook.
          All counts use autopar's ring convention: all_reduce 2(N-1)/N*S,
          all_gather (N-1)/N*S_output, reduce_scatter (N-1)/N*S_input. The same wrapper is
          also active on the autopar step, as a cross-check of autopar's counter.
  memory  torch.profiler(profile_memory=True) is started before the model is built and
          covers build, two warm-up steps and one measured step; every CPU allocation and
          free of the c10 allocator is an event with its address. The live total of the
          blocks allocated inside the window is the bytes this implementation holds;
          reported: its maximum during the measured step ("peak") and its value when that
          step starts ("state": params, grads, optimizer state, persistent comm buffers),
          max over ranks. Identical for all four. gloo's worker thread can free a
          collective's buffers where the profiler does not see it; so in the memory run a
          synchronous collective returns only once gloo released its arguments, a block
          counts as freed when its address is handed out again, and a block gloo allocated
          itself (inside a c10d op) counts as freed when its collective ends. What is left
          shows as "drift" (live total after the measured step minus before it; 0 in the
          steady state): the method's error bar.
          gc.collect() runs once after each implementation is built (--no-gc-after-build
          skips it: autopar.compile leaves the original weights in reference cycles).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import autopar
from autopar.models import GPTConfig, TinyGPT, gpt_batch, lm_loss
from autopar.ops import value_bytes
from autopar.sizes import ring_bytes

IMPLS = ("autopar ddp", "torch DDP", "autopar zero3", "torch FSDP2")
PAIRS = (("autopar ddp", "torch DDP"), ("autopar zero3", "torch FSDP2"))
CONFIG = dict(vocab=512, seq=64, dim=128, heads=4, layers=4, max_seq=64)
GLOBAL_BATCH = 16
N_BATCHES = 4          # the step k uses batch k % N_BATCHES (same sequence for every implementation)
LR = 1e-3
SEED = 0


# ---- byte counting on the torch.distributed Python API ----------------------------------------

KIND = {
    "all_reduce": ("all_reduce", "tensor"),
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "_all_gather_base": ("all_gather", "output_tensor"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "_reduce_scatter_base": ("reduce_scatter", "input"),
    "all_gather": ("all_gather", "tensor_list"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "broadcast": ("broadcast", "tensor"),
    "all_reduce_coalesced": ("all_reduce", "tensors"),
    "all_to_all_single": ("all_to_all", "output"),
}


def ring_volume(kind: str, nbytes: float, n: int) -> float:
    """Per-rank bytes of a collective by autopar's ring convention (``autopar.sizes.ring_bytes``;
    a broadcast sends its bytes)."""
    if n <= 1:
        return 0.0
    return float(nbytes) if kind == "broadcast" else ring_bytes(kind, nbytes, n)


class Counter:
    """Bytes per (phase, kind) and call counts; ``phase`` is set by the step driver."""

    def __init__(self):
        self.phase = "-"
        self.bytes: dict[tuple[str, str], float] = {}
        self.calls: dict[tuple[str, str], int] = {}

    def add(self, kind: str, nbytes: float):
        key = (self.phase, kind)
        self.bytes[key] = self.bytes.get(key, 0.0) + nbytes
        self.calls[key] = self.calls.get(key, 0) + 1

    def total(self) -> float:
        return sum(self.bytes.values())

    def ncalls(self) -> int:
        return sum(self.calls.values())


@contextlib.contextmanager
def wrap_collectives(counter: Counter):
    """Wrap torch.distributed.<collective> (the names FSDP2, DDP hooks and autopar call)."""
    saved = {}
    for name, (kind, arg) in KIND.items():
        orig = getattr(dist, name, None)
        if orig is None:
            continue
        sig = inspect.signature(orig)

        def wrapper(*args, __orig=orig, __sig=sig, __kind=kind, __arg=arg, **kwargs):
            bound = __sig.bind(*args, **kwargs)
            group = bound.arguments.get("group")
            n = dist.get_world_size(group)
            counter.add(__kind, ring_volume(__kind, value_bytes(bound.arguments[__arg]), n))
            return __orig(*args, **kwargs)

        saved[name] = orig
        setattr(dist, name, wrapper)
    try:
        yield counter
    finally:
        for name, orig in saved.items():
            setattr(dist, name, orig)


SYNC_RANGE = "bench::sync_collective"
PHASE_RANGE = "bench::phase"


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return []


@contextlib.contextmanager
def settle_collectives(timeout_s: float = 0.05):
    """Memory runs only: after a synchronous collective returns, wait until gloo's worker
    thread has dropped its references to the tensors, so that the last reference (and the
    free the profiler must see) belongs to the calling thread."""
    saved = {}
    for name in KIND:
        orig = getattr(dist, name, None)
        if orig is None:
            continue
        sig = inspect.signature(orig)

        def wrapper(*args, __orig=orig, __sig=sig, **kwargs):
            bound = __sig.bind(*args, **kwargs)
            ts = [t for v in bound.arguments.values() for t in _tensors(v)]
            base = [t._use_count() for t in ts]
            if bound.arguments.get("async_op", False):
                return __orig(*args, **kwargs)
            with torch.profiler.record_function(SYNC_RANGE):
                result = __orig(*args, **kwargs)
                deadline = time.perf_counter() + timeout_s
                while any(t._use_count() > b for t, b in zip(ts, base)) and time.perf_counter() < deadline:
                    time.sleep(0)
            return result

        saved[name] = orig
        setattr(dist, name, wrapper)
    try:
        yield
    finally:
        for name, orig in saved.items():
            setattr(dist, name, orig)


# ---- the four implementations --------------------------------------------------------------

def fresh_model() -> TinyGPT:
    torch.manual_seed(SEED)
    return TinyGPT(GPTConfig(**CONFIG))


def local_slice(t: torch.Tensor) -> torch.Tensor:
    n, i = dist.get_world_size(), dist.get_rank()
    k = t.shape[0] // n
    return t[i * k:(i + 1) * k]


class Impl:
    """One implementation on this rank, built from the seed; ``step()`` runs its next training
    step (step k uses batch k % N_BATCHES). ``ddp_hook_counter``: DDP only, register a comm hook
    that counts each bucket and then runs torch's default allreduce_hook."""

    def __init__(self, name: str, batches, counter: Counter | None = None,
                 ddp_hook_counter: Counter | None = None, collect: bool = True):
        self.name = name
        self.counters = [counter or Counter()]   # phase bookkeeping for the byte counters
        self.k = 0
        self.losses: list[float] = []
        model = fresh_model()
        self.batches = batches
        if name.startswith("autopar"):
            mesh = autopar.Mesh(dp=dist.get_world_size())
            plan = autopar.Plan(dp=name.split()[1])
            self.module = autopar.compile(model, mesh, example_inputs=(batches[0][0],), plan=plan)
            self.opt = self.module.optimizer(torch.optim.AdamW, lr=LR)
            self.local = [(self.module.shard_batch(x), self.module.shard_batch(y)) for x, y in batches]
        elif name == "torch DDP":
            from torch.nn.parallel import DistributedDataParallel as DDP
            self.module = DDP(model)
            if ddp_hook_counter is not None:
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

                def hook(state, bucket, _c=ddp_hook_counter):
                    buf = bucket.buffer()
                    _c.add("all_reduce", ring_volume("all_reduce", value_bytes(buf), dist.get_world_size()))
                    return allreduce_hook(state, bucket)
                self.module.register_comm_hook(None, hook)
            self.opt = torch.optim.AdamW(self.module.parameters(), lr=LR)
            self.local = [(local_slice(x), local_slice(y)) for x, y in batches]
        elif name == "torch FSDP2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            dmesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for blk in model.blocks:
                fully_shard(blk, mesh=dmesh)
            fully_shard(model, mesh=dmesh)       # wte/head (tied), wpe, ln_f: the root group
            self.module = model
            self.opt = torch.optim.AdamW(model.parameters(), lr=LR)
            self.local = [(local_slice(x), local_slice(y)) for x, y in batches]
        else:
            raise ValueError(name)
        del model
        if collect:
            # autopar.compile leaves the original model's parameters in reference cycles
            # (torch.export's ExportedProgram); a full collection frees them. Done for all four.
            gc.collect()

    def step(self, ranges: bool = False) -> float:
        x, y = self.local[self.k % len(self.local)]
        def phase(name):
            for c in self.counters:
                c.phase = name
        mark = (lambda ph: torch.profiler.record_function(f"{PHASE_RANGE} {ph}")) if ranges \
            else (lambda ph: contextlib.nullcontext())
        t0 = time.perf_counter()
        phase("forward")
        with mark("forward"):
            loss = lm_loss(self.module(x), y)
        t1 = time.perf_counter()
        phase("backward")
        with mark("backward"):
            loss.backward()
        t2 = time.perf_counter()
        phase("optimizer")
        with mark("optimizer"):
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        phase("-")
        self.last_phases = (t1 - t0, t2 - t1, time.perf_counter() - t2)
        self.k += 1
        value = float(loss.detach())
        self.losses.append(value)
        return value


# ---- memory: the profiler's allocation events ---------------------------------------------------

@contextlib.contextmanager
def quiet_stderr():
    """Kineto prints a line to fd 2 at every profiler start/stop; keep the report readable."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def allocation_events(prof, paths: bool = False) -> list[tuple]:
    """(time ns, address, signed bytes, implied free time ns or None) of every CPU
    allocation/free the profiler recorded, and with ``paths`` the names of the enclosing
    events (outermost first) as a fifth element. A block allocated inside a c10d op (gloo's
    own copy of a collective's buffer, held by its Work) is freed by gloo's worker thread, which
    the profiler does not see: its implied free time is the end of the enclosing synchronous
    collective (``settle_collectives`` waited for gloo there), or for an asynchronous one the
    end of the enclosing step phase (the latest it can be; the caller waited for the work)."""
    out = []
    stack = [(node, None, None, False, ()) for node in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, sync_end, phase_end, in_c10d, path = stack.pop()
        name = node.name or ""
        if name == SYNC_RANGE:
            sync_end = node.end_time_ns
        elif name.startswith(PHASE_RANGE):
            phase_end = node.end_time_ns
        in_c10d = in_c10d or name.startswith("c10d::")
        if "Allocation" in str(node.tag) and node.extra_fields.device.type == "cpu":
            nb = node.extra_fields.alloc_size
            implied = (sync_end or phase_end) if (in_c10d and nb > 0) else None
            out.append((node.start_time_ns, node.extra_fields.ptr, nb, implied) + ((path,) if paths else ()))
        elif paths:
            path = path + (name,)
        stack.extend((c, sync_end, phase_end, in_c10d, path) for c in node.children)
    out.sort(key=lambda e: e[0])
    return out


def live_totals(events, t0: int, t1: int, at_peak: bool = False) -> dict:
    """Live bytes of the blocks allocated in the window: at t0, their peak in [t0, t1], at t1
    (with ``at_peak``, also "live": index into ``events`` -> bytes of every block live at the
    peak, and "peak_ns": when it was reached).

    Frees match allocations by address. A free the profiler missed is implied (a) when the
    same address is allocated again, (b) at the implied time of a gloo-internal copy."""
    timeline = []                                    # (time, order, kind, ptr, bytes, alloc id)
    for i, (t, ptr, nb, implied) in enumerate(e[:4] for e in events):
        timeline.append((t, 1, "alloc" if nb > 0 else "free", ptr, nb, i))
        if implied is not None:
            timeline.append((implied, 0, "implied", ptr, nb, i))
    timeline.sort(key=lambda e: (e[0], e[1]))
    live: dict[int, tuple[int, int]] = {}           # ptr -> (alloc id, bytes)
    running, state, peak, implied_bytes = 0, None, 0, 0
    snapshot, peak_ns = {}, t0
    for t, _, kind, ptr, nb, i in timeline:
        if t >= t0 and state is None:
            state = peak = running
            snapshot, peak_ns = (dict(live.values()) if at_peak else {}), t
        if t > t1:
            break
        if kind == "alloc":
            if ptr in live:                          # address reused: its free went unrecorded
                implied_bytes += live[ptr][1]
                running -= live.pop(ptr)[1]
            live[ptr] = (i, nb)
            running += nb
        elif kind == "free":
            if ptr in live:                          # (frees of blocks from before the window: ignored)
                running -= live.pop(ptr)[1]
        elif ptr in live and live[ptr][0] == i:      # implied free of that very allocation
            implied_bytes += nb
            running -= live.pop(ptr)[1]
        if state is not None and running > peak:
            peak = running
            if at_peak:
                snapshot, peak_ns = dict(live.values()), t
    if state is None:
        state = peak = running
    out = {"state": state, "peak": peak, "drift": running - state, "implied": implied_bytes}
    if at_peak:
        out.update(live=snapshot, peak_ns=peak_ns)
    return out


def profiled_build(name: str, batches, collect: bool = True) -> tuple[Impl, dict]:
    """Build ``name`` and run 3 steps under the memory profiler; measure the third
    (``profiled``)."""
    return profiled(lambda: Impl(name, batches, collect=collect))


def profiled(build) -> tuple:
    """``build()`` an implementation and run 3 steps of it under the memory profiler; measure
    the third: (the implementation, ``live_totals`` of the measured step).

    Allocations and frees are matched by address. The profiler records a free only on a
    thread that carries its state; gloo's worker thread, which can drop the last reference
    to a collective's buffers after the work finished, frees them unrecorded. Hence
    ``settle_collectives`` (a synchronous collective returns only once gloo let go of its
    arguments, so the caller frees them) and the implied frees of ``live_totals``; what is
    left shows as "drift" (live total at the end of the measured step minus at its start,
    0 in the steady state), printed as the method's error bar.
    """
    from torch.profiler import ProfilerActivity, profile, record_function
    gc.collect()
    with quiet_stderr(), settle_collectives(), \
            profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        impl = build()
        impl.step(ranges=True)                        # optimizer state, lazy init, DDP bucket rebuild
        impl.step(ranges=True)
        with record_function("bench::measured_step"):
            impl.step(ranges=True)
    mark = next(e for e in prof.profiler.kineto_results.events() if e.name() == "bench::measured_step")
    return impl, live_totals(allocation_events(prof), mark.start_ns(), mark.end_ns())


def run_parts(rank_main, world: int, args, report) -> dict:
    """Each of ``args.parts`` as one spawned run of ``rank_main(part, args.steps, args.warmup)`` on
    ``world`` ranks, reported by ``report(part, results, steps, warmup) -> (text, summary)``
    and printed as it completes: the summaries by part."""
    start = time.perf_counter()
    summaries = {}
    for part in args.parts:
        t = time.perf_counter()
        results = autopar.testing.run(rank_main, world, part, args.steps, args.warmup, timeout=args.timeout)
        text, summaries[part] = report(part, results, args.steps, args.warmup)
        print(text)
        print(f"(part {part} took {time.perf_counter() - t:.0f}s)")
        print()
        sys.stdout.flush()
    print(f"total {time.perf_counter() - start:.0f}s")
    return summaries


def interleaved(impls: dict, names, warmup: int, steps: int) -> tuple[dict, dict]:
    """``warmup`` untimed steps, then ``steps`` timed rounds of one step of each of ``names``
    (round-robin, each after a barrier): (seconds per step, per-phase seconds) by name."""
    for _ in range(warmup):
        for name in names:
            dist.barrier()
            impls[name].step()
    times = {name: [] for name in names}
    phases = {name: [] for name in names}
    for _ in range(steps):                           # interleaved, one step of each
        for name in names:
            dist.barrier()
            t = time.perf_counter()
            impls[name].step()
            times[name].append(time.perf_counter() - t)
            phases[name].append(impls[name].last_phases)
    return times, phases


# ---- one rank ----------------------------------------------------------------------------------

def rank_main(steps: int, warmup: int, collect: bool = True) -> dict:
    rank = dist.get_rank()
    cfg = GPTConfig(**CONFIG)
    batches = [gpt_batch(cfg, GLOBAL_BATCH, seed=s) for s in range(N_BATCHES)]
    out = {"rank": rank}
    impls, mem = {}, {}
    for name in IMPLS:
        dist.barrier()
        impls[name], mem[name] = profiled_build(name, batches, collect)
    times, phases = interleaved(impls, IMPLS, warmup, steps)

    # bytes: one more step of each, counted
    counted = {}
    for name in ("autopar ddp", "autopar zero3", "torch FSDP2"):
        impl = impls[name]
        wrapped = Counter()
        impl.counters = [wrapped]
        if name.startswith("autopar"):
            impl.module.comm_stats.reset()
        dist.barrier()
        with wrap_collectives(wrapped):
            impl.step()
        own = None
        if name.startswith("autopar"):
            stats = impl.module.comm_stats
            own = {"total": stats.total(axis="dp"),
                   "by": {f"{p}/{k}": b for (a, k, p), b in stats.bytes.items() if a == "dp"},
                   "calls": sum(stats.calls.values())}
        counted[name] = {"own": own, "wrapped": wrapped.total(), "wrapped_calls": wrapped.ncalls(),
                         "wrapped_by": {f"{p}/{k}": b for (p, k), b in wrapped.bytes.items()}}
    hook = Counter()
    ddp_count = Impl("torch DDP", batches, ddp_hook_counter=hook)
    ddp_count.step()                                # DDP rebuilds its buckets after iteration 1
    hook.bytes.clear(); hook.calls.clear()
    wrapped = Counter()
    ddp_count.counters = [hook, wrapped]
    dist.barrier()
    with wrap_collectives(wrapped):
        ddp_count.step()
    counted["torch DDP"] = {"own": {"total": hook.total(), "calls": hook.ncalls(),
                                    "by": {f"{p}/{k}": b for (p, k), b in hook.bytes.items()}},
                            "wrapped": wrapped.total(), "wrapped_calls": wrapped.ncalls(),
                            "wrapped_by": {f"{p}/{k}": b for (p, k), b in wrapped.bytes.items()}}
    del ddp_count
    impls["torch DDP"].step()       # uncounted: every timed instance has now run the same steps

    psi = sum(p.numel() for p in fresh_model().parameters())   # unique (tied counted once)
    out.update(times=times, phases=phases, mem=mem, counted=counted, psi=psi,
               losses={name: impls[name].losses for name in IMPLS})
    return out


# ---- the report --------------------------------------------------------------------------------

def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def report(n: int, results: list[dict], steps: int, warmup: int) -> tuple[str, dict]:
    lines = []
    psi = results[0]["psi"]
    med = {name: max(statistics.median(r["times"][name]) for r in results) for name in IMPLS}
    q = {}
    for name in IMPLS:
        rank_q = [statistics.quantiles(r["times"][name], n=4) if len(r["times"][name]) > 1 else [0, 0, 0]
                  for r in results]
        q[name] = (max(x[0] for x in rank_q), max(x[2] for x in rank_q))
    peak = {name: max(r["mem"][name]["peak"] for r in results) for name in IMPLS}
    state = {name: max(r["mem"][name]["state"] for r in results) for name in IMPLS}
    drift = {name: max(abs(r["mem"][name]["drift"]) for r in results) for name in IMPLS}
    counted = results[0]["counted"]
    ratio = {}
    for a, t in PAIRS:
        ratio[a] = med[a] / med[t]
    f2 = 2 * psi * (n - 1) / n * 4
    f3 = 3 * psi * (n - 1) / n * 4

    lines.append(f"world size N={n}  (Ψ = {psi:,} parameters; 2Ψ(N-1)/N·4 = {f2:,.0f} B, "
                 f"3Ψ(N-1)/N·4 = {f3:,.0f} B)")
    hdr = ("| impl | median step ms (IQR) | autopar/torch | bytes/rank/step (own counter) | "
           "bytes/rank/step (dist wrapper) | formula | peak MiB | state MiB | mem drift MiB |")
    lines.append(hdr)
    lines.append("|" + "---|" * 9)
    for name in IMPLS:
        c = counted[name]
        own = c["own"]["total"] if c["own"] else None
        formula = f"2Ψ: {f2:,.0f}" if "ddp" in name.lower() else f"3Ψ: {f3:,.0f}"
        r = f"{ratio[name]:.2f}x" if name in ratio else ""
        own_s = f"{own:,.0f}" if own is not None else "n/a"
        if name == "torch DDP":
            own_s += " (comm hook)"
        lines.append(f"| {name} | {med[name] * 1e3:.1f} ({q[name][0] * 1e3:.1f}-{q[name][1] * 1e3:.1f}) | {r} | "
                     f"{own_s} | {c['wrapped']:,.0f} | {formula} | {_mib(peak[name])} | {_mib(state[name])} | "
                     f"{_mib(drift[name])} |")
    lines.append("")
    lines.append("median ms per phase (max over ranks): forward / backward / optimizer.step+zero_grad")
    for name in IMPLS:
        ph = [max(statistics.median(p[k] for p in r["phases"][name]) for r in results) for k in range(3)]
        lines.append(f"  {name:14s} {ph[0] * 1e3:7.1f} / {ph[1] * 1e3:7.1f} / {ph[2] * 1e3:7.1f}")
    lines.append("")
    lines.append("bytes by phase/kind (dist wrapper; calls counted):")
    for name in IMPLS:
        c = counted[name]
        by = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(c["wrapped_by"].items()))
        own_by = ""
        if c["own"] and name.startswith("autopar"):
            own_by = "   [autopar counter: " + ", ".join(
                f"{k} {v:,.0f}" for k, v in sorted(c["own"]["by"].items())) + f"; {c['own']['calls']} calls]"
        lines.append(f"  {name:14s} {c['wrapped_calls']:3d} calls: {by}{own_by}")
    lines.append("")
    losses = {name: [statistics.fmean(r["losses"][name][k] for r in results)
                     for k in range(len(results[0]["losses"][name]))] for name in IMPLS}
    last = {name: losses[name][-1] for name in IMPLS}
    ref = last["torch DDP"]
    lines.append("global mean loss after the last step (same data, same initial weights; should agree): " +
                 ", ".join(f"{name} {v:.6f}" for name, v in last.items()) +
                 f"  (max |diff| {max(abs(v - ref) for v in last.values()):.2e})")
    summary = {"n": n, "psi": psi, "med": med, "ratio": ratio, "peak": peak, "state": state, "drift": drift,
               "counted": counted, "f2": f2, "f3": f3}
    return "\n".join(lines), summary


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=30, help="timed steps per implementation")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before timing "
                    "(after the 3 profiled steps that follow construction)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--no-gc-after-build", action="store_true",
                    help="skip the gc.collect() after building each implementation (autopar then "
                         "still holds the original model's weights in uncollected cycles)")
    args = ap.parse_args(argv)

    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores, gloo, 1 thread per rank; "
          f"TinyGPT {CONFIG}, global batch {GLOBAL_BATCH}, fp32, AdamW(lr={LR}); "
          f"{args.warmup} warm-up + {args.steps} timed steps per implementation, interleaved")
    print("time: wall clock of forward+backward+optimizer.step+zero_grad after a barrier; "
          "max over ranks of the per-rank median (IQR: max over ranks of the quartiles)")
    print("bytes: per rank, one step, ring volume: all_reduce 2(N-1)/N*S, all_gather (N-1)/N*S_out, "
          "reduce_scatter (N-1)/N*S_in. 'own counter' = dm.comm_stats for autopar, a counting DDP "
          "comm hook for DDP; 'dist wrapper' = wrapped torch.distributed collectives (FSDP2 and "
          "the DDP hook call them; autopar too, as a cross-check)")
    print("memory: torch.profiler(profile_memory=True) from before the model is built through the "
          "3rd step; live total of the CPU blocks allocated in that window (allocs/frees matched by "
          "address): peak during the 3rd step, 'state' = the total when it starts, 'drift' = "
          "total after it minus before (unrecorded frees; error bar); max over ranks; "
          + ("no gc.collect() after building" if args.no_gc_after_build else
             "gc.collect() once after building each implementation"))
    print()
    start = time.perf_counter()
    summaries = []
    for n in args.world_sizes:
        t = time.perf_counter()
        results = autopar.testing.run(rank_main, n, args.steps, args.warmup,
                                        not args.no_gc_after_build, timeout=args.timeout)
        text, summary = report(n, results, args.steps, args.warmup)
        summaries.append(summary)
        print(text)
        print(f"(N={n} took {time.perf_counter() - t:.0f}s)")
        print()
        sys.stdout.flush()
    print(f"total {time.perf_counter() - start:.0f}s")
    return summaries


if __name__ == "__main__":
    main()
