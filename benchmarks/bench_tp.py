"""Tensor-parallel benchmark: autopar against torch's ``parallelize_module``, side by side.

    python benchmarks/bench_tp.py [--world-sizes 2 4] [--steps N] [--warmup K]

For every world size t it spawns t local gloo processes (autopar.testing.run, one thread
each), all on one ``tp`` axis, and trains the SAME small GPT (same seed, same weights, same
batches, fp32, AdamW) four ways:

    autopar tp       autopar.compile(..., Mesh(tp=t), plan=Plan(tp=True)): the layout is
                     found from the graph
    autopar tp+sp    the same with Plan(tp=True, sp=True)
    torch tp         torch.distributed.tensor.parallel.parallelize_module with the Megatron
                     plan written by hand: q, k, v, fc ColwiseParallel; proj, out
                     RowwiseParallel; the LM head ColwiseParallel(output_layouts=Replicate())
    torch tp+sp      the same with sequence parallelism, as torch's tutorial writes it: each
                     block's input PrepareModuleInput -> Shard(1) DTensor, ln1/ln2/ln_f
                     SequenceParallel, q/k/v/fc ColwiseParallel(input_layouts=Shard(1)),
                     proj/out RowwiseParallel(output_layouts=Shard(1)), the head
                     ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())

The model keeps q, k, v as separate projections (``parallelize_module`` cannot split a fused
qkv projection whose output is split afterwards) and views heads as ``(b, s, -1, hd)`` so
that torch's local tensors carry local heads.

Reported per implementation:
  time      forward + loss + backward + AdamW step + zero_grad after a barrier; max over ranks
            of the per-rank median; the four are timed interleaved (round-robin)
  calls     collectives per step. autopar: its counter (dm.comm_stats); torch: CommDebugMode
            (counts of functional collectives, forward and backward)
  bytes     autopar's counted ring volume per rank per step (torch's CommDebugMode does not
            report bytes)
  act MiB   bytes autograd saves for backward in one forward (saved-tensor hooks, distinct
            storages), per rank: the activation memory TP and SP divide
  param MiB bytes of this rank's parameters
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.testing import saved_activation_bytes

CONFIG = dict(vocab=512, seq=64, dim=128, heads=8, layers=4)
GLOBAL_BATCH = 8
LR = 1e-3
IMPLS = ("autopar tp", "torch tp", "autopar tp+sp", "torch tp+sp")
VERSUS = {"autopar tp": "torch tp", "autopar tp+sp": "torch tp+sp"}


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.hd = dim // heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.proj = nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.ln1(x)
        q, k, v = (p(h).view(b, s, -1, self.hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, seq, dim, heads, layers):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def saved_bytes(fn, params) -> tuple[int, object]:
    """(bytes autograd saves in ``fn``, parameters left out: ``autopar.testing.saved_activation_bytes``;
    ``fn``'s result)."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    box = []
    nbytes = saved_activation_bytes(lambda: box.append(fn()), {p.untyped_storage().data_ptr() for p in local})
    return nbytes, box[0]


class Impl:
    def __init__(self, name, model, tokens):
        self.name = name
        t = dist.get_world_size()
        if name.startswith("autopar"):
            plan = autopar.Plan(tp=True, sp=name.endswith("sp"))
            self.m = autopar.compile(model, autopar.Mesh(tp=t), example_inputs=(tokens,), plan=plan)
            self.opt = self.m.optimizer(torch.optim.AdamW, lr=LR)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Replicate, Shard
            from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                           SequenceParallel, parallelize_module)
            mesh = init_device_mesh("cpu", (t,), mesh_dim_names=("tp",))
            if name == "torch tp":
                plan = {"head": ColwiseParallel(output_layouts=Replicate())}
                for i in range(len(model.blocks)):
                    plan.update({f"blocks.{i}.{p}": ColwiseParallel() for p in ("q", "k", "v", "fc")})
                    plan.update({f"blocks.{i}.{p}": RowwiseParallel() for p in ("proj", "out")})
            else:   # sequence parallel: blocks take and give Shard(1) DTensors
                plan = {"ln_f": SequenceParallel(),
                        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
                for i in range(len(model.blocks)):
                    plan[f"blocks.{i}"] = PrepareModuleInput(
                        input_layouts=(Replicate() if i == 0 else Shard(1),), desired_input_layouts=(Shard(1),),
                        use_local_output=False)
                    plan.update({f"blocks.{i}.{p}": SequenceParallel() for p in ("ln1", "ln2")})
                    plan.update({f"blocks.{i}.{p}": ColwiseParallel(input_layouts=Shard(1))
                                 for p in ("q", "k", "v", "fc")})
                    plan.update({f"blocks.{i}.{p}": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
                                 for p in ("proj", "out")})
            self.m = parallelize_module(model, mesh, plan)
            self.opt = torch.optim.AdamW(self.m.parameters(), lr=LR)

    def step(self, tokens, targets):
        loss = loss_fn(self.m(tokens), targets)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss.detach()

    def param_bytes(self) -> int:
        total = 0
        for p in self.m.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            total += local.numel() * local.element_size()
        return total


def rank_main(steps: int, warmup: int) -> dict:
    torch.manual_seed(0)
    ref = GPT(**CONFIG)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, CONFIG["vocab"], (GLOBAL_BATCH, CONFIG["seq"] + 1), generator=g)
    tokens, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    impls = [Impl(n, copy.deepcopy(ref), tokens) for n in IMPLS]
    times = {n: [] for n in IMPLS}
    losses = {}
    for i in range(warmup + steps):
        for impl in impls:
            dist.barrier()
            t0 = time.perf_counter()
            losses[impl.name] = float(impl.step(tokens, targets))
            if i >= warmup:
                times[impl.name].append(time.perf_counter() - t0)
    out = {"time": {n: statistics.median(v) for n, v in times.items()}, "loss": losses}
    # one more step each: collectives, bytes, saved activations
    from torch.distributed.tensor.debug import CommDebugMode
    calls, nbytes, act, params = {}, {}, {}, {}
    for impl in impls:
        params[impl.name] = impl.param_bytes()
        if impl.name.startswith("autopar"):
            impl.m.comm_stats.reset()
            act[impl.name], logits = saved_bytes(lambda: impl.m(tokens), impl.m.parameters())
            loss_fn(logits, targets).backward()
            impl.opt.zero_grad()
            calls[impl.name] = sum(v for k, v in impl.m.comm_stats.calls.items() if k[0] == "tp")
            nbytes[impl.name] = impl.m.comm_stats.total(axis="tp")
        else:
            mode = CommDebugMode()
            with mode:
                act[impl.name], logits = saved_bytes(lambda: impl.m(tokens), impl.m.parameters())
                loss_fn(logits, targets).backward()
            impl.opt.zero_grad()
            calls[impl.name] = mode.get_total_counts()
            nbytes[impl.name] = None
    out.update(calls=calls, bytes=nbytes, act=act, params=params)
    return out


def report(t: int, results: list) -> str:
    rows = [f"\ntp = {t} ({t} processes), GPT {CONFIG}, batch {GLOBAL_BATCH}, fp32, AdamW",
            "| impl | median step ms | autopar/torch | collectives/step | bytes/rank/step | saved activations MiB | params MiB |",
            "|---|---|---|---|---|---|---|"]
    for n in IMPLS:
        ms = max(r["time"][n] for r in results)
        ratio = f"{ms / max(r['time'][VERSUS[n]] for r in results):.2f}x" if n in VERSUS else ""
        b = results[0]["bytes"][n]
        rows.append(f"| {n} | {ms * 1e3:.1f} | {ratio} | {results[0]['calls'][n]} | "
                    f"{'n/a' if b is None else f'{b:,.0f}'} | {results[0]['act'][n] / 2**20:.2f} | "
                    f"{results[0]['params'][n] / 2**20:.2f} |")
    rows.append("last losses: " + ", ".join(f"{n} {results[0]['loss'][n]:.6f}" for n in IMPLS))
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args(argv)
    from autopar.testing import run
    print(f"torch {torch.__version__}; 1 thread per rank; gloo")
    for t in a.world_sizes:
        print(report(t, run(rank_main, t, a.steps, a.warmup, timeout=900)))


if __name__ == "__main__":
    sys.exit(main())
