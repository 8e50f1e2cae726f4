"""Mixed precision (bf16) benchmark: autopar against torch's own implementations, side by side.

    python benchmarks/bench_mixed.py [--steps N] [--warmup K] [--parts zero3 tp]

World size 2: two local gloo processes (autopar.testing.run, one thread each). Two parts, each
one spawned run, each training the SAME model (same seed, same initial weights, same batches,
AdamW(lr=1e-3)) four ways, timed interleaved (one step of each, round-robin):

  part "zero3": TinyGPT of bench_dp (vocab 512, seq 64, dim 128, 4 heads, 4 layers), global
  batch 16, Mesh(dp=2)
    autopar zero3 fp32   Plan(dp="zero3")                              (bench_dp's row)
    torch FSDP2 fp32     fully_shard per transformer block, then the root (bench_dp's row)
    autopar zero3 bf16   Plan(dp="zero3", param_dtype=torch.bfloat16): the optimizer steps fp32
                         master shards; ZeRO-3 gathers bf16 params, reduce-scatters gradients in
                         fp32 (reduce_dtype defaults to the master dtype)
    torch FSDP2 bf16     as FSDP2 fp32 with mp_policy=MixedPrecisionPolicy(param_dtype=bf16,
                         reduce_dtype=fp32) on every fully_shard call: fp32 sharded params (what
                         AdamW steps), bf16 all-gathers, fp32 reduce-scatters

  part "tp": bench_tp's GPT (separate q/k/v: parallelize_module cannot split TinyGPT's fused
  qkv), vocab 512, seq 64, dim 128, 8 heads, 4 layers, global batch 8, Mesh(tp=2)
    autopar tp fp32      Plan(tp=True)                                 (bench_tp's row)
    torch tp fp32        parallelize_module with bench_tp's Megatron plan (bench_tp's row)
    autopar tp bf16      Plan(tp=True, param_dtype=torch.bfloat16): fp32 masters owned by
                         dm.optimizer, bf16 compute
    torch tp bf16        the same plan on model.to(torch.bfloat16), with fp32 master weights
                         written out here: AdamW steps fp32 copies of each rank's local
                         parameters; after backward each bf16 gradient is cast into its
                         master's .grad, and after the step the masters are copied back into
                         the bf16 parameters (torch._foreach_copy_)

Reported per implementation:
  time    forward + loss + backward + optimizer.step + zero_grad(set_to_none=True) after a
          barrier (outside the timed region); max over ranks of the per-rank median (IQR: max
          over ranks of the quartiles); autopar/torch = this median over the torch
          implementation's of the same precision; bf16/fp32 = this median over the same
          implementation's fp32 median
  bytes   per rank, one extra step after timing, autopar's ring convention (all_reduce
          2(N-1)/N*S, all_gather (N-1)/N*S_out, reduce_scatter (N-1)/N*S_in), split by dtype.
          autopar: its own counter, dm.comm_stats.bytes / .dtype_bytes. torch: counted by
          wrapping what it calls: FSDP2 calls the Python functions dist.all_gather_single /
          dist.reduce_scatter_single (wrapped as bench_dp does), DTensor calls functional
          collectives (torch.ops._c10d_functional.*, counted by a TorchDispatchMode).
          The same wrappers are active on the autopar step, as a cross-check of its counter.
          Checked (assert): autopar's bf16 ZeRO-3 all-gather bytes are exactly half of its
          fp32 all-gather bytes, all in bfloat16, and its reduce-scatter bytes equal fp32's.
  memory  bench_dp's method (torch.profiler(profile_memory=True) from before the model is built
          through the 3rd step; live total of the CPU blocks allocated in that window, matched
          by address): "peak" during the 3rd step, "state" when it starts (after the previous
          step's zero_grad(set_to_none=True): no gradients), "drift" the method's error bar;
          max over ranks. Against the model-state formula printed with each row.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
import autopar.testing
from autopar.models import GPTConfig, TinyGPT, gpt_batch, lm_loss
from autopar.ops import value_bytes

# benchmarks/ is the script's folder: the helpers and models of the other benchmarks
from bench_dp import KIND, PHASE_RANGE, interleaved, local_slice, profiled, ring_volume, run_parts  # noqa: E402
from bench_dp import CONFIG as DP_CONFIG, GLOBAL_BATCH as DP_BATCH, N_BATCHES  # noqa: E402
from bench_tp import CONFIG as TP_CONFIG, GLOBAL_BATCH as TP_BATCH, GPT, loss_fn  # noqa: E402

WORLD = 2
LR = 1e-3
SEED = 0
BF16 = torch.bfloat16
PARTS = {
    "zero3": ("autopar zero3 fp32", "torch FSDP2 fp32", "autopar zero3 bf16", "torch FSDP2 bf16"),
    "tp": ("autopar tp fp32", "torch tp fp32", "autopar tp bf16", "torch tp bf16"),
}


def versus(name: str) -> str | None:
    """The torch implementation an autopar row is compared with (same parallelism, same precision)."""
    if not name.startswith("autopar"):
        return None
    kind = name.split()[1]
    return name.replace("autopar", "torch").replace(kind, "FSDP2" if kind == "zero3" else kind)


def fp32_of(name: str) -> str | None:
    return name.replace("bf16", "fp32") if name.endswith("bf16") else None


# ---- byte counting, split by dtype --------------------------------------------------------------

def _dtype_of(val) -> str:
    ts = [val] if isinstance(val, torch.Tensor) else [t for t in val if isinstance(t, torch.Tensor)]
    return str(ts[0].dtype).removeprefix("torch.") if ts else "?"


class DtypeCounter:
    """Ring bytes per (phase, kind, dtype) and call counts; ``phase`` is set by the step driver."""

    def __init__(self):
        self.phase = "-"
        self.bytes: dict[tuple[str, str, str], float] = {}
        self.calls = 0

    def add(self, kind: str, nbytes: float, dtype: str):
        key = (self.phase, kind, dtype)
        self.bytes[key] = self.bytes.get(key, 0.0) + nbytes
        self.calls += 1

    def total(self) -> float:
        return sum(self.bytes.values())


@contextlib.contextmanager
def wrap_dist(counter: DtypeCounter):
    """bench_dp's wrapper of the torch.distributed Python collectives (what FSDP2 and autopar
    call), recording the dtype as well."""
    saved = {}
    for name, (kind, arg) in KIND.items():
        orig = getattr(dist, name, None)
        if orig is None:
            continue
        sig = inspect.signature(orig)

        def wrapper(*args, __orig=orig, __sig=sig, __kind=kind, __arg=arg, **kwargs):
            bound = __sig.bind(*args, **kwargs)
            n = dist.get_world_size(bound.arguments.get("group"))
            val = bound.arguments[__arg]
            counter.add(__kind, ring_volume(__kind, value_bytes(val), n), _dtype_of(val))
            return __orig(*args, **kwargs)

        saved[name] = orig
        setattr(dist, name, wrapper)
    try:
        yield counter
    finally:
        for name, orig in saved.items():
            setattr(dist, name, orig)


class FuncolBytes(TorchDispatchMode):
    """Counts the functional collectives DTensor issues (torch.ops._c10d_functional.*), as
    torch's CommDebugMode finds them (it counts calls, not bytes): lets DTensor desugar first,
    then sees the plain-tensor collectives, forward and backward. One process group of the
    whole world here (tp = world size)."""

    def __init__(self, counter: DtypeCounter):
        super().__init__()
        self.counter = counter
        f = torch.ops._c10d_functional
        self.kinds = {f.all_reduce: ("all_reduce", "in"), f.all_gather_into_tensor: ("all_gather", "out"),
                      f.reduce_scatter_tensor: ("reduce_scatter", "in"),
                      f.all_to_all_single: ("all_to_all", "out")}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor
        if any(t is DTensor or issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        kind = self.kinds.get(getattr(func, "_overloadpacket", None))
        if kind is not None:
            val = args[0] if kind[1] == "in" else out
            self.counter.add(kind[0], ring_volume(kind[0], value_bytes(val), dist.get_world_size()), _dtype_of(val))
        return out


# ---- the implementations ---------------------------------------------------------------------

class MasterAdamW:
    """fp32 master weights for a bf16 model (torch tp bf16): AdamW steps fp32 copies of this
    rank's local parameters (a DTensor's local shard, a plain parameter as it is); ``step`` casts
    each bf16 gradient into its master's ``.grad``, steps, and copies the masters back."""

    def __init__(self, params, lr: float):
        self.params = [p for p in params if p.requires_grad]
        with torch.no_grad():
            self.local = [getattr(p, "_local_tensor", p) for p in self.params]
            self.masters = [t.detach().float().clone() for t in self.local]
        self.opt = torch.optim.AdamW(self.masters, lr=lr)

    def step(self):
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                g = p.grad
                m.grad = None if g is None else getattr(g, "_local_tensor", g).float()
        self.opt.step()
        with torch.no_grad():
            torch._foreach_copy_(self.local, self.masters)

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            p.grad = None
        self.opt.zero_grad(set_to_none=set_to_none)

    def state_tensors(self):
        return self.masters


def tp_plan(model):
    """bench_tp's hand-written Megatron plan (plain tp)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    plan = {"head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(len(model.blocks)):
        plan.update({f"blocks.{i}.{p}": ColwiseParallel() for p in ("q", "k", "v", "fc")})
        plan.update({f"blocks.{i}.{p}": RowwiseParallel() for p in ("proj", "out")})
    return plan


def fresh_model(part: str):
    torch.manual_seed(SEED)
    return TinyGPT(GPTConfig(**DP_CONFIG)) if part == "zero3" else GPT(**TP_CONFIG)


class Impl:
    """One implementation on this rank, built from the seed; ``step()`` runs its next training
    step (step k uses batch k % len(batches))."""

    def __init__(self, name: str, part: str, batches):
        self.name, self.k, self.losses = name, 0, []
        self.counters: list = []
        model = fresh_model(part)
        dtype = BF16 if name.endswith("bf16") else None
        if name.startswith("autopar"):
            mesh = autopar.Mesh(dp=WORLD) if part == "zero3" else autopar.Mesh(tp=WORLD)
            plan = autopar.Plan(dp="zero3", param_dtype=dtype) if part == "zero3" else \
                autopar.Plan(tp=True, param_dtype=dtype)
            self.module = autopar.compile(model, mesh, example_inputs=(batches[0][0],), plan=plan)
            self.opt = self.module.optimizer(torch.optim.AdamW, lr=LR)
            self.local = [(self.module.shard_batch(x), self.module.shard_batch(y)) for x, y in batches] \
                if part == "zero3" else batches
        elif name.startswith("torch FSDP2"):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            dmesh = init_device_mesh("cpu", (WORLD,))
            kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)} if dtype else {}
            for blk in model.blocks:
                fully_shard(blk, mesh=dmesh, **kw)
            fully_shard(model, mesh=dmesh, **kw)        # wte/head (tied), wpe, ln_f: the root group
            self.module = model
            self.opt = torch.optim.AdamW(model.parameters(), lr=LR)
            self.local = [(local_slice(x), local_slice(y)) for x, y in batches]
        elif name.startswith("torch tp"):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.parallel import parallelize_module
            if dtype:
                model = model.to(dtype)
            mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
            self.module = parallelize_module(model, mesh, tp_plan(model))
            self.opt = MasterAdamW(self.module.parameters(), LR) if dtype else \
                torch.optim.AdamW(self.module.parameters(), lr=LR)
            self.local = batches
        else:
            raise ValueError(name)
        self.loss = lm_loss if part == "zero3" else loss_fn
        del model
        gc.collect()     # as bench_dp: the original weights of autopar.compile's capture, for all alike

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
            loss = self.loss(self.module(x), y)
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
        value = float(loss.detach().float())
        self.losses.append(value)
        return value

    def local_params(self) -> tuple[int, int]:
        """(elements, bytes) of this rank's parameters as the module holds them (autopar: the
        masters the optimizer steps; torch tp bf16: the bf16 parameters, not the masters)."""
        n = b = 0
        for p in self.module.parameters():
            t = getattr(p, "_local_tensor", p)
            n, b = n + t.numel(), b + t.numel() * t.element_size()
        return n, b


def profiled_build(name: str, part: str, batches) -> tuple[Impl, dict]:
    """bench_dp.profiled for these implementations: build and run 3 steps under the
    memory profiler, measure the third."""
    return profiled(lambda: Impl(name, part, batches))


# ---- one rank ----------------------------------------------------------------------------------

def rank_main(part: str, steps: int, warmup: int) -> dict:
    names = PARTS[part]
    if part == "zero3":
        cfg = GPTConfig(**DP_CONFIG)
        batches = [gpt_batch(cfg, DP_BATCH, seed=s) for s in range(N_BATCHES)]
    else:   # bench_tp's batch
        g = torch.Generator().manual_seed(1)
        data = torch.randint(0, TP_CONFIG["vocab"], (TP_BATCH, TP_CONFIG["seq"] + 1), generator=g)
        batches = [(data[:, :-1].contiguous(), data[:, 1:].contiguous())]
    impls, mem = {}, {}
    for name in names:
        dist.barrier()
        impls[name], mem[name] = profiled_build(name, part, batches)
    times, phases = interleaved(impls, names, warmup, steps)

    counted = {}
    for name in names:                               # bytes: one more step of each, counted
        impl = impls[name]
        wrapped = DtypeCounter()
        impl.counters = [wrapped]
        if name.startswith("autopar"):
            impl.module.comm_stats.reset()
        dist.barrier()
        with wrap_dist(wrapped), FuncolBytes(wrapped):
            impl.step()
        impl.counters = []
        own = None
        if name.startswith("autopar"):
            s = impl.module.comm_stats
            axis = "dp" if part == "zero3" else "tp"
            own = {"dtype": {f"{a}:{p}/{k}/{d}": b for (a, k, p, d), b in s.dtype_bytes.items() if b},
                   "by_kind": {k: s.total(axis=axis, kind=k) for k in {k for (_, k, _) in s.bytes}},
                   "total": s.total(), "calls": sum(s.calls.values())}
        counted[name] = {"own": own, "wrapped": wrapped.total(), "wrapped_calls": wrapped.calls,
                         "wrapped_by": {f"{p}/{k}/{d}": b for (p, k, d), b in wrapped.bytes.items()}}
    psi = sum(p.numel() for p in fresh_model(part).parameters())     # unique (tied counted once)
    return {"times": times, "phases": phases, "mem": mem, "counted": counted, "psi": psi,
            "local": {name: impls[name].local_params() for name in names},
            "losses": {name: impls[name].losses for name in names}}


# ---- the report --------------------------------------------------------------------------------

def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def state_formula(name: str, psi: int, psi_local: int) -> tuple[float, float, str]:
    """(model states with gradients, expected state at a step's start (no gradients), text)."""
    if "zero3" in name or "FSDP2" in name:
        # fp32 params or fp32 master shards 4 + fp32 grad shards 4 + AdamW m, v 8, all over N
        full = 16 * psi / WORLD
        return full, 12 * psi / WORLD, "16Ψ/N (4 params/masters + 4 grads + 8 m,v; fp32 shards)"
    if name == "torch tp bf16":
        # bf16 params 2 + bf16 grads 2 + fp32 masters 4 + fp32 grads 4 (cast per step) + m,v 8
        return 20 * psi_local, 14 * psi_local, "20Ψ_t (2 bf16 params + 2 bf16 grads + 4 masters + 4 master grads + 8 m,v)"
    return 16 * psi_local, 12 * psi_local, "16Ψ_t (4 params/masters + 4 grads + 8 m,v; fp32)"


def report(part: str, results: list[dict], steps: int, warmup: int) -> tuple[str, dict]:
    names = PARTS[part]
    psi = results[0]["psi"]
    lines = []
    med = {n: max(statistics.median(r["times"][n]) for r in results) for n in names}
    q = {}
    for n in names:
        rq = [statistics.quantiles(r["times"][n], n=4) for r in results]
        q[n] = (max(x[0] for x in rq), max(x[2] for x in rq))
    peak = {n: max(r["mem"][n]["peak"] for r in results) for n in names}
    state = {n: max(r["mem"][n]["state"] for r in results) for n in names}
    drift = {n: max(abs(r["mem"][n]["drift"]) for r in results) for n in names}
    counted = results[0]["counted"]
    cfg = DP_CONFIG if part == "zero3" else TP_CONFIG
    batch = DP_BATCH if part == "zero3" else TP_BATCH
    mesh = "Mesh(dp=2)" if part == "zero3" else "Mesh(tp=2)"
    lines.append(f"part {part}: {mesh}, {'TinyGPT' if part == 'zero3' else 'bench_tp GPT'} {cfg}, "
                 f"global batch {batch}, AdamW(lr={LR}); Ψ = {psi:,} parameters; "
                 f"{warmup} warm-up + {steps} timed steps each, interleaved")
    lines.append("| impl | median step ms (IQR) | autopar/torch | bf16/fp32 | bytes/rank/step (own counter) | "
                 "bytes/rank/step (wrapper) | peak MiB | state MiB (expected) | model states formula MiB | "
                 "mem drift MiB |")
    lines.append("|" + "---|" * 10)
    summary = {"med": med, "peak": peak, "state": state, "counted": counted, "psi": psi}
    for n in names:
        v = versus(n)
        ratio = f"{med[n] / med[v]:.2f}x" if v else ""
        f = fp32_of(n)
        vs32 = f"{med[n] / med[f]:.2f}x" if f else ""
        c = counted[n]
        own = f"{c['own']['total']:,.0f}" if c["own"] else "n/a"
        psi_local = results[0]["local"][n][0]
        full, expect, _ = state_formula(n, psi, psi_local)
        lines.append(f"| {n} | {med[n] * 1e3:.1f} ({q[n][0] * 1e3:.1f}-{q[n][1] * 1e3:.1f}) | {ratio} | {vs32} | "
                     f"{own} | {c['wrapped']:,.0f} | {_mib(peak[n])} | {_mib(state[n])} ({_mib(expect)}) | "
                     f"{_mib(full)} | {_mib(drift[n])} |")
    lines.append("")
    lines.append("median ms per phase (max over ranks): forward / backward / optimizer.step+zero_grad")
    for n in names:
        ph = [max(statistics.median(p[k] for p in r["phases"][n]) for r in results) for k in range(3)]
        lines.append(f"  {n:18s} {ph[0] * 1e3:7.1f} / {ph[1] * 1e3:7.1f} / {ph[2] * 1e3:7.1f}")
    lines.append("")
    lines.append("model states formula per row (Ψ_t = this rank's parameter elements under tp; "
                 "'expected state' = the formula without gradients: zero_grad(set_to_none=True) ran before):")
    for n in names:
        psi_local = results[0]["local"][n][0]
        _, _, text = state_formula(n, psi, psi_local)
        extra = f"Ψ/N = {psi / WORLD:,.0f}" if part == "zero3" else f"Ψ_t = {psi_local:,}"
        lines.append(f"  {n:18s} {text}; {extra}")
    lines.append("")
    lines.append("bytes by axis:phase/kind/dtype (own counter for autopar, entries of 0 bytes left out; "
                 "wrapper for torch; calls counted):")
    for n in names:
        c = counted[n]
        if c["own"]:
            by = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(c["own"]["dtype"].items()))
            lines.append(f"  {n:18s} {c['own']['calls']:3d} calls: {by}")
        else:
            by = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(c["wrapped_by"].items()))
            by = by.replace("forward", "dp:forward" if part == "zero3" else "tp:forward").replace(
                "backward", "dp:backward" if part == "zero3" else "tp:backward")
            lines.append(f"  {n:18s} {c['wrapped_calls']:3d} calls: {by}")
    lines.append("  (cross-check, wrapper on the autopar steps: " + ", ".join(
        f"{n} {counted[n]['wrapped']:,.0f} in {counted[n]['wrapped_calls']} calls" for n in names
        if n.startswith("autopar")) + ")")
    if part == "zero3":
        a32, a16 = counted["autopar zero3 fp32"]["own"], counted["autopar zero3 bf16"]["own"]
        g32, g16 = a32["by_kind"]["all_gather"], a16["by_kind"]["all_gather"]
        assert g16 * 2 == g32, f"autopar zero3 bf16 all-gather bytes {g16} are not half of fp32's {g32}"
        bf16_gather = sum(v for k, v in a16["dtype"].items() if k.endswith("/all_gather/bfloat16"))
        assert bf16_gather == g16, f"autopar zero3 bf16 all-gathers not all in bfloat16: {a16['dtype']}"
        rs32, rs16 = a32["by_kind"]["reduce_scatter"], a16["by_kind"]["reduce_scatter"]
        assert rs16 == rs32, f"autopar zero3 bf16 reduce-scatter bytes {rs16} != fp32's {rs32} (fp32 reduce)"
        lines.append(f"checked: autopar zero3 bf16 all-gather bytes {g16:,.0f} = fp32's {g32:,.0f} / 2 exactly, "
                     f"all bfloat16; reduce-scatter {rs16:,.0f} = fp32's (reduced in float32)")
    lines.append("")
    losses = {n: statistics.fmean(r["losses"][n][-1] for r in results) for n in names}
    lines.append(f"global mean loss after the last of {len(results[0]['losses'][names[0]])} steps "
                 "(same data, same initial weights): " + ", ".join(f"{n} {v:.6f}" for n, v in losses.items()))
    summary["losses"] = losses
    return "\n".join(lines), summary


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", nargs="+", choices=tuple(PARTS), default=list(PARTS))
    ap.add_argument("--steps", type=int, default=20, help="timed steps per implementation")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before timing "
                    "(after the 3 profiled steps that follow construction)")
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores, gloo, world size {WORLD}, 1 thread per rank; "
          f"AdamW(lr={LR})")
    print("time: wall clock of forward+loss+backward+optimizer.step+zero_grad after a barrier; max over ranks "
          "of the per-rank median (IQR: max over ranks of the quartiles)")
    print("bytes: per rank, one step, ring volume: all_reduce 2(N-1)/N*S, all_gather (N-1)/N*S_out, "
          "reduce_scatter (N-1)/N*S_in. 'own counter' = dm.comm_stats (autopar); 'wrapper' = wrapped "
          "torch.distributed collectives (FSDP2, autopar) + a dispatch mode over DTensor's functional "
          "collectives (torch tp)")
    print("memory: bench_dp's profiler method: peak of the live CPU blocks during the 3rd step, "
          "state when it starts; max over ranks")
    print()
    return run_parts(rank_main, WORLD, args, report)


if __name__ == "__main__":
    main()
