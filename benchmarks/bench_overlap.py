"""ZeRO-3 communication overlap: autopar zero3 (overlap on / off) against torch FSDP2, side by side.

    python benchmarks/bench_overlap.py [--dim 64] [--layers 4] [--seq 32] [--batch 16] [--rounds 60]

One spawned run of 2 local gloo processes (autopar.testing.run; one thread per rank, each rank
pinned to its own core when the machine has 2 or more). Every rank builds, in this order:

    autopar zero3 overlap | overlap, prefetch 2 units | no overlap
        autopar.compile(TinyGPT(cfg), Mesh(dp=2), example_inputs=(x,), plan=Plan(dp="zero3",
        overlap=True|False [, prefetch_bytes=2 layer units])); opt = dm.optimizer(AdamW, lr=1e-3).
    torch FSDP2
        torch.distributed.fsdp.fully_shard on each model.blocks[i], then on the root model,
        default settings (prefetch, reshard_after_forward: blocks reshard, the root does not),
        with mesh=init_device_mesh("cpu", (2,)) (gloo process group); torch.optim.AdamW(lr=1e-3).

All start from the same weights (a seed-0 TinyGPT's state dict, loaded into every model) and train
on the same global batch (gpt_batch(cfg, batch), seed 0) every step; rank r feeds rows
r*B/2:(r+1)*B/2 (what dm.shard_batch gives; checked). One step = zero_grad(set_to_none=True),
forward, cross-entropy, backward, optimizer.step.

  losses  each implementation runs 3 warm-up steps right after it is built; the per-rank losses of
          those 3 identical steps must agree with FSDP2's to 1e-5.
  memory  measured right after the warm-up steps, before the next implementation is built
          (the method of autopar.predict_local.measured_memory): "state" = a census of every live tensor
          storage in the process after zero_grad + gc (min of 3 samples) minus the same census
          taken before the implementation was built; "peak" = state + the profiler's allocator
          peak (allocated - freed, [memory] events) during one step body (forward, backward,
          optimizer.step; zero_grad outside), median of 3 such steps; max over ranks.
  time    interleaved rounds: each round runs one step of every implementation (order rotated
          every round), each after a barrier (outside the timed region). Per implementation: the
          max over ranks of the per-rank median (IQR: max over ranks of the quartiles); "ratio to
          FSDP2" = median / FSDP2's median; "paired ratio" = the median over rounds of
          (this round's step time / FSDP2's step time in the same round), a step's time being
          the max over ranks.
  exposed then rounds // 2 more interleaved rounds of the autopar variants under
          dm.record_timeline(): per rank the median of the exposed communication (the union of
          the waits that blocked the rank's thread), max over ranks, against overlap off.
"""
from __future__ import annotations

import argparse
import gc
import os
import shlex
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

import autopar
import autopar.testing
from autopar.models import GPTConfig, TinyGPT, gpt_batch, lm_loss
from autopar.testing import profiled_peak_bytes, steady_live_bytes

from bench_dp import quiet_stderr  # noqa: E402  (benchmarks/ is the script's folder)

LR = 1e-3
SEED = 0
WORLD = 2
FSDP = "torch FSDP2"
LOSS_TOL = 1e-5


def autopar_variants(cfg: GPTConfig, x: torch.Tensor) -> list[tuple[str, dict]]:
    """(label, extra Plan kwargs): the overlap pass with its default prefetch (one unit ahead),
    with a budget of two layer units, and off."""
    from autopar.passes.overlap import unit_ahead_bytes
    probe = autopar.compile(TinyGPT(cfg), autopar.Mesh(dp=WORLD, virtual=True, rank=0), example_inputs=(x,),
                            plan=autopar.Plan(dp="zero3"))
    two = 2 * max(unit_ahead_bytes(probe.ctx))
    return [(ON, {"overlap": True}),
            (ON2, {"overlap": True, "prefetch_bytes": two}),
            (OFF, {"overlap": False})]


ON, ON2, OFF = "autopar zero3 overlap", "autopar zero3 overlap, prefetch 2 units", "autopar zero3 no overlap"


class Impl:
    """One implementation on this rank; ``step()`` runs one training step and returns its loss."""

    def __init__(self, name: str, extra, cfg: GPTConfig, state: dict, x: torch.Tensor, t: torch.Tensor):
        self.name = name
        world, rank = dist.get_world_size(), dist.get_rank()
        k = x.shape[0] // world
        model = TinyGPT(cfg)
        model.load_state_dict(state)
        if extra is not None:        # autopar
            dm = autopar.compile(model, autopar.Mesh(dp=world), example_inputs=(x,),
                                 plan=autopar.Plan(dp="zero3", **extra))
            kw = ", ".join(f"{k}={v!r}" for k, v in {"dp": "zero3", **extra}.items())
            self.plan = f"Plan({kw}) = {dm.plan}"
            self.module = dm
            self.opt = dm.optimizer(torch.optim.AdamW, lr=LR)
            self.lx, self.lt = dm.shard_batch((x,)), dm.shard_batch(t)
            if not (torch.equal(self.lx[0], x[rank * k:(rank + 1) * k])
                    and torch.equal(self.lt, t[rank * k:(rank + 1) * k])):
                raise AssertionError("dm.shard_batch does not give rows r*B/N:(r+1)*B/N")
        else:                        # torch FSDP2
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh("cpu", (world,))
            for blk in model.blocks:
                fully_shard(blk, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.plan = "fully_shard(blocks[i], mesh=cpu mesh) + fully_shard(model)"
            self.module = model
            self.opt = torch.optim.AdamW(model.parameters(), lr=LR)
            self.lx = (x[rank * k:(rank + 1) * k],)
            self.lt = t[rank * k:(rank + 1) * k]
        del model
        gc.collect()     # autopar.compile leaves the original weights in reference cycles
        self.losses: list[float] = []

    def body(self):
        loss = lm_loss(self.module(*self.lx), self.lt)
        loss.backward()
        self.opt.step()
        self.losses.append(float(loss.detach()))

    def step(self):
        self.opt.zero_grad(set_to_none=True)
        self.body()


def rank_main(cfg_kw: dict, batch: int, rounds: int, warmup: int) -> dict:
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    cpus = sorted(os.sched_getaffinity(0))
    pinned = None
    if len(cpus) >= world:           # one core per rank
        os.sched_setaffinity(0, {cpus[rank]})
        pinned = cpus[rank]
    cfg = GPTConfig(**cfg_kw)
    x, t = gpt_batch(cfg, batch, seed=SEED)
    torch.manual_seed(SEED)
    ref = TinyGPT(cfg)
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    psi = sum(p.numel() for p in ref.parameters())      # unique (the tied weight once)
    del ref

    specs = autopar_variants(cfg, x) + [(FSDP, None)]
    impls: dict[str, Impl] = {}
    mem: dict[str, dict] = {}
    errors: dict[str, str] = {}
    build_s: dict[str, float] = {}
    for name, extra in specs:
        dist.barrier()
        gc.collect()
        before = steady_live_bytes(3)
        t0 = time.perf_counter()
        try:
            impl = Impl(name, extra, cfg, state, x, t)
        except Exception:
            if extra is not None:
                raise
            errors[name] = traceback.format_exc()     # FSDP2 could not be built: report, no fallback
            continue
        build_s[name] = time.perf_counter() - t0
        for _ in range(warmup):
            dist.barrier()
            impl.step()
        # memory: what lives between steps, plus the most one step allocates on top
        impl.opt.zero_grad(set_to_none=True)
        gc.collect()
        held = steady_live_bytes(3) - before
        extra_peaks = []
        for _ in range(3):
            impl.opt.zero_grad(set_to_none=True)
            dist.barrier()
            with quiet_stderr():
                extra_peaks.append(profiled_peak_bytes(impl.body))
        mem[name] = {"state": held, "step_peaks": extra_peaks, "peak": held + sorted(extra_peaks)[1]}
        impls[name] = impl

    names = list(impls)
    gc.collect()
    times = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            dist.barrier()
            t0 = time.perf_counter()
            impls[n].step()
            times[n].append(time.perf_counter() - t0)
    # exposed communication: the same steps again, recorded (autopar's timeline: the union of
    # the waits that blocked the rank's thread), interleaved as above
    auto = [n for n in names if n != FSDP]
    exposed = {n: [] for n in auto}
    recorded = {n: [] for n in auto}
    for r in range(max(rounds // 2, 3)):
        for n in auto[r % len(auto):] + auto[:r % len(auto)]:
            dist.barrier()
            with impls[n].module.record_timeline():
                impls[n].step()
            tl = impls[n].module.timelines[rank]
            exposed[n].append(tl.exposed_comm_s)
            recorded[n].append(tl.duration_s)
    dist.barrier()
    return {"rank": rank, "pinned": pinned, "psi": psi, "times": times, "mem": mem, "build_s": build_s,
            "exposed": exposed, "recorded": recorded,
            "losses": {n: impls[n].losses for n in names}, "plans": {n: impls[n].plan for n in names},
            "errors": errors}


# ---- the report --------------------------------------------------------------------------------

def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def report(results: list[dict], rounds: int, warmup: int) -> str:
    names = list(results[0]["times"])
    lines = []
    med = {n: max(statistics.median(r["times"][n]) for r in results) for n in names}
    iqr = {}
    for n in names:
        qs = [statistics.quantiles(r["times"][n], n=4) for r in results]
        iqr[n] = (max(q[0] for q in qs), max(q[2] for q in qs))
    per_round = {n: [max(r["times"][n][k] for r in results) for k in range(rounds)] for n in names}
    peak = {n: max(r["mem"][n]["peak"] for r in results) for n in names}
    held = {n: max(r["mem"][n]["state"] for r in results) for n in names}
    has_fsdp = FSDP in names

    def loss_diff(a, b, upto):
        return max(abs(r["losses"][a][k] - r["losses"][b][k]) for r in results for k in range(upto))

    lines.append("| implementation | step ms (IQR) | ratio to FSDP2 | paired ratio | peak MiB | losses agree |")
    lines.append("|---|---|---|---|---|---|")
    for n in names:
        if has_fsdp and n != FSDP:
            ratio = f"{med[n] / med[FSDP]:.2f}x"
            pr = [a / b for a, b in zip(per_round[n], per_round[FSDP])]
            q = statistics.quantiles(pr, n=4)
            paired = f"{statistics.median(pr):.2f}x ({q[0]:.2f}-{q[2]:.2f})"
            d = loss_diff(n, FSDP, warmup)
            agree = f"{'yes' if d <= LOSS_TOL else 'NO'} (max abs diff {d:.1e})"
        elif n == FSDP:
            ratio, paired, agree = "1.00x", "1.00x", "reference"
        else:
            ratio, paired, agree = "n/a", "n/a", "n/a (no FSDP2)"
        lines.append(f"| {n} | {med[n] * 1e3:.2f} ({iqr[n][0] * 1e3:.2f}-{iqr[n][1] * 1e3:.2f}) | {ratio} | "
                     f"{paired} | {_mib(peak[n])} | {agree} |")
    lines.append("")
    lines.append("| autopar variant | exposed communication ms (recorded steps) | / no overlap | step ms | "
                 "/ no overlap (paired) |")
    lines.append("|---|---|---|---|---|")
    exp = {n: max(statistics.median(r["exposed"][n]) for r in results) for n in results[0]["exposed"]}
    for n in exp:
        pr = [a / b for a, b in zip(per_round[n], per_round[OFF])]
        lines.append(f"| {n} | {exp[n] * 1e3:.2f} | {exp[n] / exp[OFF]:.2f} | {med[n] * 1e3:.2f} | "
                     f"{med[n] / med[OFF]:.2f} ({statistics.median(pr):.2f}) |")
    lines.append("(exposed: per rank the median over the recorded steps of the union of the waits that "
                 "blocked the rank's thread, max over ranks)")
    lines.append("")
    psi = results[0]["psi"]
    n_world = len(results)
    lines.append(f"Ψ = {psi:,} parameters; 3Ψ·4/N (params + AdamW moments, sharded) = {_mib(3 * psi * 4 / n_world)} MiB")
    lines.append("memory detail (max over ranks): state MiB = census between steps; per-step allocator "
                 "peaks of the 3 profiled steps (rank 0), MiB")
    for n in names:
        sp = ", ".join(_mib(b) for b in results[0]["mem"][n]["step_peaks"])
        lines.append(f"  {n:26s} state {_mib(held[n])}  step peaks [{sp}]  -> peak {_mib(peak[n])}")
    lines.append("per-rank losses of the warm-up steps (rank 0 | rank 1):")
    for n in names:
        cols = " | ".join(" ".join(f"{v:.7f}" for v in r["losses"][n][:warmup]) for r in results)
        lines.append(f"  {n:26s} {cols}")
    if has_fsdp:
        total = len(results[0]["losses"][FSDP])
        for n in names:
            if n != FSDP:
                lines.append(f"  {n}: max abs loss diff to FSDP2 over all {total} steps (warm-up, profiled, "
                             f"timed) {loss_diff(n, FSDP, total):.1e}")
    lines.append("per-rank median step ms: " + "; ".join(
        f"{n} " + "/".join(f"{statistics.median(r['times'][n]) * 1e3:.2f}" for r in results) for n in names))
    lines.append("build s (rank 0): " + ", ".join(f"{n} {s:.1f}" for n, s in results[0]["build_s"].items()))
    lines.append("plans: " + "; ".join(f"{n}: {p}" for n, p in results[0]["plans"].items()))
    lines.append(f"pinned cores: {[r['pinned'] for r in results]}")
    for n, err in results[0]["errors"].items():
        lines.append(f"{n} could not be built on this machine (left out, nothing in its place):\n{err}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=67)
    ap.add_argument("--batch", type=int, default=16, help="global batch (divisible by 2)")
    ap.add_argument("--rounds", type=int, default=60, help="timed interleaved rounds")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps after building (loss check)")
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    if args.batch % WORLD:
        ap.error(f"--batch {args.batch} does not divide by {WORLD}")
    cfg_kw = dict(vocab=args.vocab, seq=args.seq, dim=args.dim, heads=args.heads, layers=args.layers,
                  max_seq=args.seq)
    print("$ " + shlex.join(["python"] + (sys.argv if argv is None else [sys.argv[0]] + list(argv))))
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores, gloo, {WORLD} processes x 1 thread; "
          f"TinyGPT(GPTConfig({', '.join(f'{k}={v}' for k, v in cfg_kw.items())})), global batch {args.batch}, "
          f"fp32, AdamW(lr={LR}); {args.warmup} warm-up + 3 profiled + {args.rounds} timed rounds, interleaved")
    print()
    sys.stdout.flush()
    start = time.perf_counter()
    results = autopar.testing.run(rank_main, WORLD, cfg_kw, args.batch, args.rounds, args.warmup,
                                  timeout=args.timeout)
    print(report(results, args.rounds, args.warmup))
    print(f"total {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
