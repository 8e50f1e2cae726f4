"""``python -m autopar demo``: compile a small GPT with ``plan="auto"`` (the planner picks the
data-parallel mode for this machine's calibrated cost model) on local CPU processes, train a
few steps beside the single-device model, and show parity, bytes and memory."""
from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

from .api import compile as autopar_compile
from .cost.calibration import calibrate_local
from .cost.cluster import cached_local
from .cost.formulas import dp_comm_elements, evaluate
from .cost.memory import model_state_bytes
from .launch import run
from .mesh import Mesh
from .sizes import ring_bytes
from .models import GPTConfig, TinyGPT, gpt_batch, lm_loss
from .runtime.optim import optimizer_state_bytes


def _rank_main(steps: int, out_dir: str):
    world, rank = dist.get_world_size(), dist.get_rank()
    c = GPTConfig()
    tokens, targets = gpt_batch(c, 4 * world)
    torch.manual_seed(0)
    ref = TinyGPT(c)
    dm = autopar_compile(copy.deepcopy(ref), Mesh(dp=world), example_inputs=(tokens,), plan="auto")
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
    x, y = dm.shard_batch(tokens), dm.shard_batch(targets)
    rows = []
    for step in range(steps):
        dm.comm_stats.reset()
        loss = lm_loss(dm(x), y)
        loss.backward()
        opt.step()
        ref_loss = lm_loss(ref(tokens), targets)
        ref_loss.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        moved = dm.comm_stats.total(axis="dp")
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        full = dm.full_state_dict()
        diff = {k: float((full[k] - v).abs().max()) for k, v in ref.state_dict().items()}
        # the attention key bias has a zero gradient in exact arithmetic; Adam turns its float
        # noise into lr-sized steps on both sides, so it is shown apart
        rest = max(d for k, d in diff.items() if not k.endswith("qkv.bias"))
        rows.append((step, float(mean) / world, float(ref_loss.detach()), max(diff.values()), rest, moved))
        opt.zero_grad()
    psi = sum(s.numel for s in dm.sync.specs.values())
    psi_pad = sum(s.padded_numel for s in dm.sync.specs.values())
    held = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in dm.parameters()}
    held.update({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in dm.sync.replicas.values()})
    mem = sum(held.values()) + sum(p.numel() * 4 for p in dm.parameters()) + optimizer_state_bytes(opt)
    paths = dm.dump(os.path.join(out_dir, f"rank{rank}")) if rank == 0 else []
    return {"rows": rows, "psi": psi, "psi_pad": psi_pad, "plan": str(dm.plan), "mode": dm.plan.dp, "mem": mem,
            "why": next((n for n in dm.ctx.notes if "auto" in n), ""),
            "read": sum(dm.sync.specs[n].padded_numel for n in dm.sync.saved_in_backward)
            if dm.plan.dp == "zero3" else 0,
            "paths": paths}


def main(world: int = 2, steps: int = 5, out_dir: str = "autopar_out") -> int:
    print(f"autopar demo: TinyGPT on {world} local CPU processes (gloo), plan='auto'")
    if cached_local() is None:      # the ranks read it; they cannot measure it themselves
        print("calibrating this machine for the cost model (once; cached in ~/.cache/autopar) ...")
        calibrate_local()
    res = run(_rank_main, world, steps, out_dir, timeout=300)
    r0 = res[0]
    print(f"plan picked: {r0['plan']}   Ψ = {r0['psi']:,} parameters ({r0['psi_pad']:,} padded to {world} shards)")
    print(f"  {r0['why']}\n")
    print("step   loss (autopar)   loss (1 device)   max |Δparam|   except key bias   bytes moved (rank 0)")
    for step, loss, ref, perr, rest, nbytes in r0["rows"]:
        print(f"{step:>4}   {loss:>14.6f}   {ref:>15.6f}   {perr:>12.2e}   {rest:>15.2e}   {nbytes:>12,.0f}")
    n, mode = world, r0["mode"]
    psi = r0["psi"] if mode == "ddp" else r0["psi_pad"]
    formula = dp_comm_elements(mode)
    line = (f"\nbytes per step ({mode}): formula {formula} x 4 B = {evaluate(formula, Psi=psi, N=n) * 4:,.0f}; "
            f"measured {r0['rows'][-1][5]:,.0f}")
    if mode == "zero3":
        exact = ring_bytes("all_gather", (2 * r0["psi_pad"] + r0["read"]) * 4, n)
        line += f" = (2Ψ + Ψ read by backward)(N−1)/N x 4 B = {exact:,.0f}"
    print(line)
    print("per-rank memory after a step (params + grads + AdamW state):")
    for rank, r in enumerate(res):
        mem = model_state_bytes(mode)
        print(f"  rank {rank}: {r['mem']:,} B   (formula {mem} = "
              f"{evaluate(mem, Psi=r0['psi'], N=n):,.0f} B; uneven shards differ by a row)")
    ok = all(abs(l - ref) <= 1e-4 * abs(ref) + 1e-5 and rest <= 1e-4 for _, l, ref, _, rest, _ in r0["rows"])
    print(f"\nparity with the single-device run: {'OK' if ok else 'MISMATCH'}")
    print("graphs of every pass and explain(): " + ", ".join(r0["paths"]))
    return 0 if ok else 1
