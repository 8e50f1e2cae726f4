"""Activation recomputation on real processes: the compiled module with recompute against the
same plan without (bitwise: the recomputation repeats the forward's ops on the same inputs
and masks), against the single-device model (``parity``), the collectives it issues, and the
bytes autograd keeps per layer."""
from __future__ import annotations

import gc

import torch
import torch.distributed as dist

import autopar
from autopar.models import GPTConfig, TinyGPT, gpt_batch, lm_loss
from autopar.testing import parity

DROPOUT = GPTConfig(dropout=0.1)


def _trained(config, axes, kw, steps, batch, cluster=None):
    """Outputs, losses, gradients and parameters (this rank's) over ``steps`` AdamW steps, and
    the module's collective calls of the last step by (axis, kind, phase)."""
    torch.manual_seed(0)
    model = TinyGPT(config)
    x, t = gpt_batch(config, batch)
    plan = autopar.Plan(**kw)
    dm = autopar.compile(model, autopar.Mesh(**axes), example_inputs=(x,), plan=plan)
    opt = dm.optimizer(torch.optim.AdamW, lr=1e-2)
    lx, lt = dm.shard_batch((x,)), dm.shard_batch(t)
    rec = {"out": [], "loss": [], "grads": [], "params": []}
    for s in range(steps):
        torch.manual_seed(100 + s)
        opt.zero_grad(set_to_none=True)
        dm.comm_stats.reset()
        if plan.pp_schedule:
            loss = dm.train_step(lx, lt, lm_loss)
        else:
            out = dm(*lx)
            rec["out"].append(out.detach().clone())
            loss = lm_loss(out, lt)
            loss.backward()
        rec["loss"].append(loss.detach().clone())
        rec["grads"].append({n: p.grad.clone() for n, p in dm.named_parameters() if p.grad is not None})
        opt.step()
        rec["params"].append({n: p.detach().clone() for n, p in dm.named_parameters()})
    rec["calls"] = {f"{a}/{k}/{ph}": c for (a, k, ph), c in dm.comm_stats.calls.items()}
    rec["recomputes"] = sorted((m.layer, m.kind, m.recomputes) for m in dm.modules() if hasattr(m, "recomputes"))
    rec["units"] = len(dm._sync.units) if hasattr(dm, "_sync") else 0
    rec["bytes"] = {a: dm.comm_stats.total(axis=a) for a in ("dp", "tp", "pp")}
    if cluster is not None:
        rec["predicted"] = dict(dm.predict(cluster).comm_bytes_by_axis)
    return rec


def _equal(a, b) -> list[str]:
    """Where two records differ (empty: bitwise equal)."""
    bad = []
    for key in ("out", "loss"):
        bad += [f"{key} step {i}" for i, (x, y) in enumerate(zip(a[key], b[key])) if not torch.equal(x, y)]
    for key in ("grads", "params"):
        for i, (x, y) in enumerate(zip(a[key], b[key])):
            if x.keys() != y.keys():
                bad.append(f"{key} step {i}: names differ")
            bad += [f"{key} step {i} {n}" for n in x if n in y and not torch.equal(x[n], y[n])]
    return bad


def bitwise(cases, steps: int = 2, batch: int = 8, config=DROPOUT, cluster=None) -> dict:
    """Per (name, mesh axes, plan kwargs): the differences between the plan with and without
    ``recompute`` (kwargs' own value), the collective calls of both, the recomputations run,
    and the bytes per axis of the last step (with ``cluster``: also the cost model's)."""
    torch.set_num_threads(1)
    out = {}
    for name, axes, kw in cases:
        base = _trained(config, axes, {**kw, "recompute": "none"}, steps, batch)
        mine = _trained(config, axes, kw, steps, batch, cluster)
        out[name] = {"diff": _equal(base, mine), "calls": base["calls"], "calls_rc": mine["calls"],
                     "recomputes": mine["recomputes"], "units": mine["units"], "bytes": mine["bytes"],
                     "predicted": mine.get("predicted")}
        gc.collect()
    dist.barrier()
    return out


def explained(axes, kw, config=DROPOUT, batch: int = 8) -> str:
    """``dm.explain()`` of the GPT compiled under ``kw``."""
    torch.manual_seed(0)
    x, _ = gpt_batch(config, batch)
    dm = autopar.compile(TinyGPT(config), autopar.Mesh(**axes), example_inputs=(x,), plan=autopar.Plan(**kw))
    return dm.explain(cluster=False)


def recompute_parity(cases, config=DROPOUT, steps: int = 3) -> dict:
    """``parity`` (against the single-device model) of each (name, mesh axes, plan kwargs)."""
    torch.set_num_threads(1)
    tok, tgt = gpt_batch(config, 8)
    out = {}
    for name, axes, kw in cases:
        rep = parity(lambda: TinyGPT(config), autopar.Mesh(**axes), autopar.Plan(**kw), (tok,), tgt, lm_loss,
                     steps=steps)
        out[name] = {"ok": rep.ok, "errors": (rep.output_err, rep.loss_err, rep.grad_err, rep.param_err),
                     "messages": rep.messages}
    return out
