"""Activation recomputation benchmark: autopar's Plan(recompute=...) against torch's checkpointing.

    python benchmarks/bench_memory.py [--steps N] [--warmup K] [--parts full selective]

World size 2: two local gloo processes (autopar.testing.run, one thread each). Two parts, each
one spawned run, each training the SAME model (bench_dp's TinyGPT: vocab 512, seq 64, dim 128,
4 heads, 4 layers; same seed, same initial weights, same batches, global batch 16, AdamW(lr=1e-3))
under ZeRO-3 / FSDP2 on Mesh(dp=2), timed interleaved (one step of each, round-robin):

  part "full": dropout 0 (attention runs torch's fused CPU kernel, which keeps no a·s² scores)
    autopar zero3               Plan(dp="zero3")                                (bench_dp's row)
    autopar zero3 + full        Plan(dp="zero3", recompute="full"): each block keeps its input
                                and runs again in backward (passes/recompute.py)
    autopar zero3 + full, overlap off
                                the same with Plan(overlap=False): every collective waited on
                                where it is issued, nothing in flight. On gloo an asynchronous
                                collective holds a staging copy while in flight (all_gather_into_tensor
                                a flat output it copies out of, reduce_scatter_tensor a clone of its
                                input it all-reduces), about a unit each; FSDP2 on the CPU has no
                                collective in flight at its peak (benchmarks/peak_attribution.py
                                lists the blocks live at each peak by the op that allocated them)
    torch FSDP2                 fully_shard per transformer block, then the root  (bench_dp's row)
    torch FSDP2 + ckpt          each block wrapped by checkpoint_wrapper(CheckpointImpl.NO_REENTRANT)
                                before fully_shard (torchtitan's order); the wrapped blocks sharded

  part "selective": dropout 0.1 (hidden and attention): attention runs the math form on both
  sides and keeps its a·s² probabilities and dropout mask
    autopar zero3               Plan(dp="zero3")
    autopar zero3 + selective   Plan(dp="zero3", recompute="selective"): each block's attention
                                core (scores, softmax, dropout, product with V) recomputed
    autopar zero3 + selective, local rng
                                the same with dropout_rng="local" (draws only this rank's slice of
                                each mask, as torch does; the default "exact" draws the
                                single-device mask on every rank, bench_dropout.py)
    torch FSDP2                 as in part full
    torch FSDP2 + SAC           each block wrapped in _SACBlock: torch.utils.checkpoint(block, x,
                                use_reentrant=False, context_fn=create_selective_checkpoint_contexts
                                (attention_policy)): the ops whose output is a·s²-shaped (found with
                                a TorchDispatchMode: bmm q·kᵀ, the mask add, _safe_softmax,
                                empty_like + bernoulli_ + div_ of the dropout mask, mul by it, and
                                the s×s causal mask ops) MUST_RECOMPUTE, all else PREFER_SAVE

autopar draws its dropout masks its own way (single-device exact by default) and torch draws
its own, and the interleaved rows take turns on the one default generator, so with dropout the
losses of all rows differ: printed as a sanity check only.

Reported per implementation:
  time    forward + loss + backward + optimizer.step + zero_grad(set_to_none=True) after a
          barrier (outside the timed region); max over ranks of the per-rank median (IQR: max
          over ranks of the quartiles). autopar/torch: over the torch row with the same kind of
          recomputation; /no-rc: over the same implementation without recomputation.
  memory  bench_dp's method (torch.profiler(profile_memory=True) from before the model is built
          through the 3rd step; live total of the CPU blocks allocated in that window, matched
          by address): "peak" during the 3rd step, "state" when it starts, "drift" the method's
          error bar; max over ranks. peak - state: what the step adds (activations, gathered
          units, gradients, the optimizer's temporaries).
  recomputation, checked: autopar's Recomputed regions count the backward recomputations they
          run; torch's blocks count their forward calls (2 per step under checkpointing).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import gc
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import autopar
import autopar.testing
from autopar.models import GPTConfig, TinyGPT, gpt_batch, lm_loss
from autopar.runtime.recompute import Recomputed

# benchmarks/ is the script's folder: the helpers and the model of bench_dp
from bench_dp import PHASE_RANGE, interleaved, local_slice, profiled, run_parts  # noqa: E402
from bench_dp import CONFIG, GLOBAL_BATCH, N_BATCHES  # noqa: E402

WORLD = 2
LR = 1e-3
SEED = 0
DROPOUT = {"full": 0.0, "selective": 0.1}
LOCAL_RNG = "autopar zero3 + selective, local rng"
FULL_SYNC = "autopar zero3 + full, overlap off"
PARTS = {
    "full": ("autopar zero3", "autopar zero3 + full", FULL_SYNC, "torch FSDP2", "torch FSDP2 + ckpt"),
    "selective": ("autopar zero3", "autopar zero3 + selective", LOCAL_RNG, "torch FSDP2", "torch FSDP2 + SAC"),
}
VERSUS = {"autopar zero3": "torch FSDP2", "autopar zero3 + full": "torch FSDP2 + ckpt", FULL_SYNC: "torch FSDP2 + ckpt",
          "autopar zero3 + selective": "torch FSDP2 + SAC", LOCAL_RNG: "torch FSDP2 + SAC"}
NO_RECOMPUTE = {"autopar zero3 + full": "autopar zero3", "autopar zero3 + selective": "autopar zero3",
                LOCAL_RNG: "autopar zero3", "torch FSDP2 + ckpt": "torch FSDP2",
                "torch FSDP2 + SAC": "torch FSDP2"}


# ---- torch's selective activation checkpoint ------------------------------------------------------

def attention_policy(seq: int, seen: collections.Counter, cached: dict):
    """SAC policy: recompute every op whose output has a·s² shape (..., seq, seq) -- on CPU with
    dropout, SDPA decomposes (CompositeImplicit) into bmm, add, _safe_softmax, empty_like,
    bernoulli_, div_, mul and bmm; the first seven produce (b·h or b, h, s, s) tensors, and the
    causal mask (ones, tril, where) is (s, s) -- and save everything else. The attention output
    (the second bmm, a·s·d) is saved, as autopar's selective region's output is kept. ``seen``
    counts the ops marked for recomputation in forward (by name); ``cached`` gets the bytes of
    each saved output that is a new tensor (aliases no input: not a view, not in place), by
    storage address: what the cache holds beyond its inputs, for the report."""
    from torch.utils.checkpoint import CheckpointPolicy

    def policy(ctx, op, *args, **kwargs):
        out = ctx.op_output
        s2 = isinstance(out, torch.Tensor) and out.dim() >= 2 and tuple(out.shape[-2:]) == (seq, seq)
        if not ctx.is_recompute:
            if s2:
                seen[str(op)] += 1
            elif isinstance(out, torch.Tensor):
                inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
                if out.untyped_storage().data_ptr() not in inputs:
                    cached[out.untyped_storage().data_ptr()] = out.untyped_storage().nbytes()
        return CheckpointPolicy.MUST_RECOMPUTE if s2 else CheckpointPolicy.PREFER_SAVE
    return policy


class _SACBlock(nn.Module):
    """A transformer block under torch's selective activation checkpoint (non-reentrant)."""

    def __init__(self, block: nn.Module, seq: int):
        super().__init__()
        self.block = block
        self.seen: collections.Counter = collections.Counter()
        self.cached: dict[int, int] = {}
        self.policy = attention_policy(seq, self.seen, self.cached)

    def forward(self, x):
        self.cached.clear()          # this forward's (a recomputation calls the block, not this)
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
        # allow_cache_entry_mutation: the hidden dropouts' masks are saved, and a mask is made in
        # place (empty_like, then bernoulli_ and div_ on it), so its cached empty_like is mutated;
        # recomputation returns the finished mask for all three, which is what backward needs.
        # The attention mask is recomputed: checkpoint restores the RNG state, and it is the
        # block's first draw (the saved hidden masks draw nothing again), so it is the same mask
        # (checked: the block's gradients are bitwise those without checkpointing)
        ctx = functools.partial(create_selective_checkpoint_contexts, self.policy, allow_cache_entry_mutation=True)
        return checkpoint(self.block, x, use_reentrant=False, context_fn=ctx)


def autograd_saved_per_block(part: str) -> int:
    """Bytes autograd saves for one block's backward without checkpointing (this rank's batch;
    new tensors only: not the parameters, not the block's input): SAC's cache against it."""
    blk = fresh_model(part).blocks[0]
    skip = {p.untyped_storage().data_ptr() for p in blk.parameters()}
    x = torch.randn(GLOBAL_BATCH // WORLD, CONFIG["seq"], CONFIG["dim"], requires_grad=True)
    skip.add(x.untyped_storage().data_ptr())
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        blk(x)
    return sum(saved.values())


# ---- the implementations ---------------------------------------------------------------------

def fresh_model(part: str) -> TinyGPT:
    torch.manual_seed(SEED)
    return TinyGPT(GPTConfig(**CONFIG, dropout=DROPOUT[part]))


class Impl:
    """One implementation on this rank, built from the seed; ``step()`` runs its next training
    step (step k uses batch k % N_BATCHES)."""

    def __init__(self, name: str, part: str, batches):
        self.name, self.k, self.losses = name, 0, []
        model = fresh_model(part)
        self.block_calls = [0]           # forward calls of the original blocks (recomputations included)
        if name.startswith("autopar"):
            kind = name.split("+")[1].split(",")[0].strip() if "+" in name else "none"
            plan = autopar.Plan(dp="zero3", recompute=kind, dropout_rng="local" if name == LOCAL_RNG else "exact",
                                overlap=name != FULL_SYNC)
            self.module = autopar.compile(model, autopar.Mesh(dp=WORLD), example_inputs=(batches[0][0],), plan=plan)
            self.opt = self.module.optimizer(torch.optim.AdamW, lr=LR)
            self.local = [(self.module.shard_batch(x), self.module.shard_batch(y)) for x, y in batches]
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            for blk in model.blocks:
                blk.register_forward_pre_hook(lambda *_: self.block_calls.__setitem__(0, self.block_calls[0] + 1))
            # wrap each block before sharding it: fully_shard then manages the wrapper's parameters
            # (the block's), and its hooks run around the checkpointed forward and its recomputation
            if name == "torch FSDP2 + ckpt":
                from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                                         checkpoint_wrapper)
                for i in range(len(model.blocks)):
                    model.blocks[i] = checkpoint_wrapper(model.blocks[i], checkpoint_impl=CheckpointImpl.NO_REENTRANT)
            elif name == "torch FSDP2 + SAC":
                for i in range(len(model.blocks)):
                    model.blocks[i] = _SACBlock(model.blocks[i], CONFIG["seq"])
            dmesh = init_device_mesh("cpu", (WORLD,))
            for blk in model.blocks:
                fully_shard(blk, mesh=dmesh)
            fully_shard(model, mesh=dmesh)           # wte/head (tied), wpe, ln_f: the root group
            self.module = model
            self.opt = torch.optim.AdamW(model.parameters(), lr=LR)
            self.local = [(local_slice(x), local_slice(y)) for x, y in batches]
        del model
        gc.collect()     # as bench_dp: the original weights of autopar.compile's capture, for all alike

    def step(self, ranges: bool = False) -> float:
        x, y = self.local[self.k % len(self.local)]
        mark = (lambda ph: torch.profiler.record_function(f"{PHASE_RANGE} {ph}")) if ranges \
            else (lambda ph: contextlib.nullcontext())
        t0 = time.perf_counter()
        with mark("forward"):
            loss = lm_loss(self.module(x), y)
        t1 = time.perf_counter()
        with mark("backward"):
            loss.backward()
        t2 = time.perf_counter()
        with mark("optimizer"):
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        self.last_phases = (t1 - t0, t2 - t1, time.perf_counter() - t2)
        self.k += 1
        value = float(loss.detach())
        self.losses.append(value)
        return value

    def recomputations(self) -> tuple[int, int]:
        """(recomputations, regions or blocks) counted over this implementation's steps so far."""
        if self.name.startswith("autopar"):
            regions = [m for m in self.module.module.modules() if isinstance(m, Recomputed)]
            return sum(m.recomputes for m in regions), len(regions)
        return self.block_calls[0] - self.k * CONFIG["layers"], CONFIG["layers"]

    def sac_ops(self) -> tuple[dict, int]:
        """The ops the SAC policy marked MUST_RECOMPUTE in the first block, per forward, and the
        bytes of new tensors its cache kept in the last forward."""
        if self.name != "torch FSDP2 + SAC":
            return {}, 0
        blk = self.module.blocks[0]
        return {op: n // self.k for op, n in sorted(blk.seen.items())}, sum(blk.cached.values())


def profiled_build(name: str, part: str, batches) -> tuple[Impl, dict]:
    """bench_dp.profiled for these implementations: build and run 3 steps under the
    memory profiler, measure the third."""
    return profiled(lambda: Impl(name, part, batches))


# ---- one rank ----------------------------------------------------------------------------------

def rank_main(part: str, steps: int, warmup: int) -> dict:
    torch.set_num_threads(1)
    names = PARTS[part]
    cfg = GPTConfig(**CONFIG)
    batches = [gpt_batch(cfg, GLOBAL_BATCH, seed=s) for s in range(N_BATCHES)]
    impls, mem = {}, {}
    for name in names:
        dist.barrier()
        impls[name], mem[name] = profiled_build(name, part, batches)
    sac_ops = {name: impls[name].sac_ops() for name in names}   # 3 profiled steps
    times, phases = interleaved(impls, names, warmup, steps)
    psi = sum(p.numel() for p in fresh_model(part).parameters())     # unique (tied counted once)
    return {"times": times, "phases": phases, "mem": mem, "psi": psi, "sac_ops": sac_ops,
            "recomputed": {name: impls[name].recomputations() for name in names},
            "autograd_saved": autograd_saved_per_block(part),
            "steps_run": {name: impls[name].k for name in names},
            "losses": {name: impls[name].losses for name in names}}


# ---- the report --------------------------------------------------------------------------------

def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def report(part: str, results: list[dict], steps: int, warmup: int) -> tuple[str, dict]:
    names = PARTS[part]
    psi = results[0]["psi"]
    med = {n: max(statistics.median(r["times"][n]) for r in results) for n in names}
    q = {}
    for n in names:
        rq = [statistics.quantiles(r["times"][n], n=4) if len(r["times"][n]) > 1 else [0, 0, 0] for r in results]
        q[n] = (max(x[0] for x in rq), max(x[2] for x in rq))
    peak = {n: max(r["mem"][n]["peak"] for r in results) for n in names}
    state = {n: max(r["mem"][n]["state"] for r in results) for n in names}
    drift = {n: max(abs(r["mem"][n]["drift"]) for r in results) for n in names}
    lines = [f"part {part}: Mesh(dp={WORLD}), TinyGPT {dict(CONFIG, dropout=DROPOUT[part])}, global batch "
             f"{GLOBAL_BATCH}, AdamW(lr={LR}); Ψ = {psi:,} parameters; {warmup} warm-up + {steps} timed "
             "steps each, interleaved"]
    lines.append("| impl | median step ms (IQR) | autopar/torch time | autopar/torch peak | /no-rc time | "
                 "/no-rc peak | peak MiB | state MiB | peak - state MiB | mem drift MiB |")
    lines.append("|" + "---|" * 10)
    for n in names:
        v, b = VERSUS.get(n), NO_RECOMPUTE.get(n)
        lines.append(
            f"| {n} | {med[n] * 1e3:.1f} ({q[n][0] * 1e3:.1f}-{q[n][1] * 1e3:.1f}) | "
            f"{f'{med[n] / med[v]:.2f}x' if v in med else ''} | {f'{peak[n] / peak[v]:.2f}x' if v in peak else ''} | "
            f"{f'{med[n] / med[b]:.2f}x' if b in med else ''} | {f'{peak[n] / peak[b]:.2f}x' if b in peak else ''} | "
            f"{_mib(peak[n])} | {_mib(state[n])} | {_mib(peak[n] - state[n])} | {_mib(drift[n])} |")
    lines.append("")
    lines.append("median ms per phase (max over ranks): forward / backward / optimizer.step+zero_grad")
    for n in names:
        ph = [max(statistics.median(p[k] for p in r["phases"][n]) for r in results) for k in range(3)]
        lines.append(f"  {n:38s} {ph[0] * 1e3:7.1f} / {ph[1] * 1e3:7.1f} / {ph[2] * 1e3:7.1f}")
    lines.append("")
    lines.append("recomputations (rank 0, over all steps run): " + "; ".join(
        f"{n} {results[0]['recomputed'][n][0]} in {results[0]['steps_run'][n]} steps "
        f"({results[0]['recomputed'][n][1]} {'regions' if n.startswith('autopar') else 'blocks'})"
        for n in names))
    for n in names:
        ops, cached = results[0]["sac_ops"][n]
        if ops:
            lines.append(f"{n}: ops marked MUST_RECOMPUTE per block forward: " +
                         ", ".join(f"{op} {k}" for op, k in ops.items()))
            lines.append(f"{n}: the SAC cache of one block forward keeps {_mib(cached)} MiB of new tensors "
                         "(saved op outputs that alias no input), rank 0; without checkpointing autograd saves "
                         f"{_mib(results[0]['autograd_saved'])} MiB for one block (new tensors, this rank's batch)")
    lines.append("")
    for a in names:
        t = VERSUS.get(a)
        if a.startswith("autopar") and "+" in a and t in med:
            ratio = med[a] / med[t]
            lines.append(f"goal, {a} against {t}: time {ratio:.2f}x ({'<=' if ratio <= 0.8 else '>'} 0.8), "
                         f"peak {_mib(peak[a])} against {_mib(peak[t])} MiB "
                         f"({'equal or lower' if peak[a] <= peak[t] else 'higher'}): "
                         f"{'met' if ratio <= 0.8 and peak[a] <= peak[t] else 'not met'}")
    lines.append("")
    losses = {n: statistics.fmean(r["losses"][n][-1] for r in results) for n in names}
    lines.append(f"global mean loss after the last of {len(results[0]['losses'][names[0]])} steps "
                 f"({'dropout: every row draws other masks (the interleaved rows take turns on the one default generator, and torch draws its own way), so they differ' if DROPOUT[part] else 'no dropout: should agree'}): "
                 + ", ".join(f"{n} {v:.6f}" for n, v in losses.items()))
    return "\n".join(lines), {"med": med, "peak": peak, "state": state, "drift": drift, "losses": losses}


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
    print("memory: bench_dp's profiler method: peak of the live CPU blocks during the 3rd step, "
          "state when it starts; max over ranks")
    print()
    return run_parts(rank_main, WORLD, args, report)


if __name__ == "__main__":
    main()
