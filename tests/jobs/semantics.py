"""Training semantics: dropout with single-device masks, train/eval modes, gradient
accumulation, optimizers."""
from __future__ import annotations

import contextlib
import copy

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
from autopar.models import GPTConfig, TinyGPT, TinyMLP, gpt_batch, lm_loss
from autopar.testing import parity

from .common import mlp_batch, mse

DROPOUT_PLANS = (   # (name, mesh axes, plan, layers)
    ("ddp", {"dp": 2}, autopar.Plan(dp="ddp"), 2),
    ("zero3", {"dp": 2}, autopar.Plan(dp="zero3"), 2),
    ("tp", {"tp": 2}, autopar.Plan(tp=True), 2),
    ("tp+sp", {"tp": 2}, autopar.Plan(tp=True, sp=True), 2),
    ("pp 1f1b", {"pp": 2}, autopar.Plan(pp_schedule="1f1b", microbatches=2), 4),
)


def dropout_parity(names=None):
    out = {}
    for name, axes, plan, layers in DROPOUT_PLANS:
        if names is not None and name not in names:
            continue
        c = GPTConfig(layers=layers, dropout=0.1)
        tok, tgt = gpt_batch(c, 8)
        out[name] = parity(lambda: TinyGPT(c), autopar.Mesh(**axes), plan, (tok,), tgt, lm_loss)
    return out


class _Bernoulli(TorchDispatchMode):
    """Records every mask the single-device model draws (``bernoulli_``), in order."""

    def __init__(self):
        super().__init__()
        self.masks = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.bernoulli_.float, torch.ops.aten.bernoulli.p):
            self.masks.append(out.clone())
        return out


def _expected_slice(mask, kind, axes, plan, mb, m):
    """This rank's part of a single-device mask, written from the plan (independently of
    autopar's slicing): dp rows (a pipeline: micro-batch ``mb`` of the dp slice), heads
    under tp, sequence positions under sp."""
    mesh = autopar.Mesh(**axes)
    n, d = mesh.axis_size("dp"), mesh.coordinate("dp")
    t, ti = mesh.axis_size("tp"), mesh.coordinate("tp")
    rows = mask.shape[0] // (n * m)
    out = mask[d * (mask.shape[0] // n) + mb * rows:][:rows]
    if kind == "sdpa" and plan.tp:      # (batch, heads, L, S): heads split
        h = out.shape[1] // t
        out = out[:, ti * h:(ti + 1) * h]
    elif kind == "dropout" and plan.sp:   # (batch, seq, hidden): sequence split
        s = out.shape[1] // t
        out = out[:, ti * s:(ti + 1) * s]
    return out


def _dropout_gpt(name):
    """(axes, plan, the single-device GPT with dropout 0.1, its compiled copy, tokens, targets)."""
    _, axes, plan, layers = next(p for p in DROPOUT_PLANS if p[0] == name)
    c = GPTConfig(layers=layers, dropout=0.1)
    tok, tgt = gpt_batch(c, 8)
    torch.manual_seed(0)
    ref = TinyGPT(c)
    dm = autopar.compile(copy.deepcopy(ref), autopar.Mesh(**axes), example_inputs=(tok,), plan=plan)
    return axes, plan, ref, dm, tok, tgt


def dropout_masks(name):
    """Every mask this rank holds equals (bitwise) its slice of the single-device model's mask
    drawn from the same seed; and the generator ends the forward in the single-device state."""
    axes, plan, ref, dm, tok, tgt = _dropout_gpt(name)
    torch.manual_seed(7)
    with _Bernoulli() as rec:
        ref(tok)
    after_ref = torch.rand(3)
    torch.manual_seed(7)
    if plan.pp_schedule is not None:
        dm.train_step(dm.shard_batch((tok,)), dm.shard_batch(tgt), lm_loss)
        holders = [st.module.rng_masks for st in dm.stages.values() if hasattr(st.module, "rng_masks")]
        m = plan.microbatches
    else:
        dm(*dm.shard_batch((tok,)))
        holders, m = [dm.module.rng_masks], 1
    after_dm = torch.rand(3)
    checked = []
    for h in holders:
        for (site, mb), local in h.masks.items():
            kind = dm.ctx.rng_sites[site].kind
            want = _expected_slice(rec.masks[site].bool(), kind, axes, plan, mb, m)
            checked.append((site, mb, kind, tuple(local.shape), bool(torch.equal(local, want))))
    return {"checked": checked, "sites": len(rec.masks), "generator_state_equal": bool(torch.equal(after_ref, after_dm))}


def _err(a, b):
    return float((a - b).abs().max() / (b.abs().max() + 1e-12))


def eval_mode(name):
    """Train a step, switch to eval: outputs (no_grad) equal the single-device model's in eval
    mode with no backward machinery run; back to train, the next step still matches."""
    axes, plan, ref, dm, tok, tgt = _dropout_gpt(name)
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), dm.optimizer(torch.optim.SGD, lr=0.1)
    x, y = dm.shard_batch((tok,)), dm.shard_batch(tgt)
    pipelined = plan.pp_schedule is not None
    res = {"train_loss_err": [], "train_losses": []}

    def train_step(seed):
        torch.manual_seed(seed)
        loss_ref = lm_loss(ref(tok), tgt)
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        torch.manual_seed(seed)
        if pipelined:
            loss = dm.train_step(x, y, lm_loss)
        else:
            loss = lm_loss(dm(*x), y)
            loss.backward()
            if "dp" in axes:
                loss = loss.detach().clone()
                torch.distributed.all_reduce(loss)
                loss /= axes["dp"]
        opt.step()
        opt.zero_grad()
        res["train_loss_err"].append(_err(loss.detach(), loss_ref.detach()))
        res["train_losses"].append((float(loss.detach()), float(loss_ref.detach())))

    train_step(1)
    ref.eval()
    dm.eval()
    dm.comm_stats.reset()
    with torch.no_grad():
        out_ref = ref(tok)
        if pipelined:
            res["eval_loss_err"] = _err(dm.eval_step(x, y, lm_loss), lm_loss(out_ref, tgt))
        else:
            out = dm(*x)
            res["eval_out_err"] = _err(out, dm.shard_batch(out_ref))
            res["eval_out_grad_fn"] = out.grad_fn is not None
            # a second eval forward draws nothing and gives the same output: dropout is off
            res["eval_repeatable"] = bool(torch.equal(out, dm(*x)))
    res["eval_backward_bytes"] = dm.comm_stats.total(phase="backward")
    sync = dm._sync if not pipelined else None
    if sync is not None:
        res["zero3_state_left"] = len(sync._pending) + len(sync._bwd) + len(sync._inflight) + len(sync._gathered)
    ref.train()
    dm.train()
    train_step(2)
    return res


class _TrainOnlyScale(torch.nn.Module):
    """A forward that differs between modes beyond dropout."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        x = self.fc(x)
        return x * 2.0 if self.training else x


def accumulation(mode, world_axes=None):
    """Four micro-steps, three under no_sync: gradients equal the single-device model's over
    the four micro-batches, and the dp reduction runs once (its bytes by the formula)."""
    torch.manual_seed(0)
    ref = TinyMLP()
    axes = world_axes or {"dp": 2}
    plan = autopar.Plan(dp=mode) if mode != "1f1b" else autopar.Plan(pp_schedule="1f1b", microbatches=2)
    xs = [mlp_batch(8, seed=s) for s in range(4)]
    dm = autopar.compile(copy.deepcopy(ref), autopar.Mesh(**axes), example_inputs=(xs[0][0],), plan=plan)
    for x, y in xs:
        mse(ref(x), y).backward()
    dm.comm_stats.reset()
    for i, (x, y) in enumerate(xs):
        ctx = dm.no_sync() if i < 3 else contextlib.nullcontext()
        with ctx:
            if mode == "1f1b":
                dm.train_step(dm.shard_batch((x,)), dm.shard_batch(y), mse)
            else:
                mse(dm(*dm.shard_batch((x,))), dm.shard_batch(y)).backward()
    grads = dm.full_grads()
    n = axes.get("dp", 1)
    psi = sum(p.numel() for p in ref.parameters())
    # ZeRO pads each tensor's rows to n equal chunks
    psi_padded = sum(-(-p.shape[0] // n) * n * p[0].numel() for p in ref.parameters())
    return {"grad_err": max(_err(grads[k], p.grad) for k, p in ref.named_parameters()),
            "reduce_bytes": dm.comm_stats.total(axis="dp", kind="all_reduce" if mode in ("ddp", "1f1b") else
                                               "reduce_scatter", phase="backward"),
            "calls": sum(v for (a, k, p), v in dm.comm_stats.calls.items()
                         if a == "dp" and k in ("all_reduce", "reduce_scatter") and p == "backward"),
            "psi": psi, "psi_padded": psi_padded, "n": n,
            "psi_here": sum(p.numel() for p in dm.parameters())}   # a pipeline rank: its stage's


def _train(model, opt, sched, x, y, steps, shard=None):
    losses = []
    for _ in range(steps):
        xi, yi = (x, y) if shard is None else (shard((x,))[0], shard(y))
        loss = mse(model(xi), yi)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(float(loss.detach()))
    return losses


class _ForcedAdafactor(torch.optim.Adafactor):
    """Adafactor declared elementwise (it is not): the negative control of the refusal."""
    autopar_elementwise = True


def optimizers(name):
    """Non-elementwise optimizers with per_tensor=True, and LR schedulers, against one device."""
    plan, axes, cls, kwargs, sched = {
        "adafactor zero3 per_tensor": (autopar.Plan(dp="zero3"), {"dp": 2}, torch.optim.Adafactor, {"lr": 0.01}, None),
        "adafactor zero2 per_tensor": (autopar.Plan(dp="zero2"), {"dp": 2}, torch.optim.Adafactor, {"lr": 0.01}, None),
        "adafactor tp per_tensor": (autopar.Plan(tp=True), {"tp": 2}, torch.optim.Adafactor, {"lr": 0.01}, None),
        "adamw zero2 + lambda lr": (autopar.Plan(dp="zero2"), {"dp": 2}, torch.optim.AdamW, {"lr": 0.01},
                                    lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s))),
        "adafactor zero3 forced elementwise": (autopar.Plan(dp="zero3"), {"dp": 2}, _ForcedAdafactor, {"lr": 0.01},
                                               None),
        "sgd zero3 + onecycle": (autopar.Plan(dp="zero3"), {"dp": 2}, torch.optim.SGD, {"lr": 0.01, "momentum": 0.9},
                                 lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=10)),
    }[name]
    torch.manual_seed(0)
    ref = TinyMLP()
    x, y = mlp_batch(8)
    dm = autopar.compile(copy.deepcopy(ref), autopar.Mesh(**axes), example_inputs=(x,), plan=plan)
    opt_ref = cls(ref.parameters(), **kwargs)
    opt = dm.optimizer(cls, per_tensor="per_tensor" in name, **kwargs)
    ref_losses = _train(ref, opt_ref, sched(opt_ref) if sched else None, x, y, 4)
    losses = _train(dm, opt, sched(opt) if sched else None, x, y, 4, shard=dm.shard_batch)
    return {**_against(dm, ref, axes, losses, ref_losses), "is_instance": isinstance(opt, cls),
            "lr": [g["lr"] for g in opt.param_groups], "ref_lr": [g["lr"] for g in opt_ref.param_groups]}


class TrustRatio(torch.optim.Optimizer):
    """A LAMB-like optimizer: each tensor steps ``lr * ||w|| / ||u|| * u`` with ``u = g + wd * w``,
    the layer-wise trust ratio of LAMB (You et al., "Large Batch Optimization for Deep Learning",
    ICLR 2020) without its moments; the two norms are statistics of the whole tensor."""

    def __init__(self, params, lr=0.01, weight_decay=0.01):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = p.grad + group["weight_decay"] * p
                w, u = p.norm(), update.norm()
                ratio = (w / u) if float(w) > 0 and float(u) > 0 else 1.0
                p.sub_(group["lr"] * ratio * update)


class _ForcedTrustRatio(TrustRatio):
    """The trust-ratio optimizer declared elementwise (it is not): the negative control."""
    autopar_elementwise = True


STOCK = {   # name -> (plan, mesh axes, optimizer class, its kwargs)
    "sgd zero3": (autopar.Plan(dp="zero3"), {"dp": 2}, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adamw zero3": (autopar.Plan(dp="zero3"), {"dp": 2}, torch.optim.AdamW, {"lr": 0.01}),
    "adamw zero2": (autopar.Plan(dp="zero2"), {"dp": 2}, torch.optim.AdamW, {"lr": 0.01}),
    "adamw zero1": (autopar.Plan(dp="zero1"), {"dp": 2}, torch.optim.AdamW, {"lr": 0.01}),
    "adamw tp": (autopar.Plan(tp=True), {"tp": 2}, torch.optim.AdamW, {"lr": 0.01}),
    "trust ratio zero3": (autopar.Plan(dp="zero3"), {"dp": 2}, TrustRatio, {"lr": 0.05}),
    "trust ratio tp": (autopar.Plan(tp=True), {"tp": 2}, TrustRatio, {"lr": 0.05}),
    "trust ratio zero3 forced elementwise": (autopar.Plan(dp="zero3"), {"dp": 2}, _ForcedTrustRatio, {"lr": 0.05}),
}


def stock_optimizer(name, steps=4):
    """An optimizer built directly on ``dm.parameters()`` (not ``dm.optimizer``) against the
    same class on one device: {"error": the refusal's message} where its first step raises,
    else the largest parameter error after ``steps`` steps and both runs' losses."""
    plan, axes, cls, kwargs = STOCK[name]
    torch.manual_seed(0)
    ref = TinyMLP()
    x, y = mlp_batch(8)
    dm = autopar.compile(copy.deepcopy(ref), autopar.Mesh(**axes), example_inputs=(x,), plan=plan)
    opt_ref, opt = cls(ref.parameters(), **kwargs), cls(dm.parameters(), **kwargs)
    ref_losses = _train(ref, opt_ref, None, x, y, steps)
    try:
        losses = _train(dm, opt, None, x, y, steps, shard=dm.shard_batch)
    except ValueError as e:
        return {"error": str(e)}
    return _against(dm, ref, axes, losses, ref_losses)


def _against(dm, ref, axes: dict, losses: list, ref_losses: list) -> dict:
    """The step losses (this rank's slice's, averaged over dp) and the largest parameter error
    of ``dm`` against the single-device ``ref``."""
    n = axes.get("dp", 1)
    if n > 1:   # this rank's loss is its slice's: the step's loss is their mean
        t = torch.tensor(losses)
        torch.distributed.all_reduce(t)
        losses = (t / n).tolist()
    full = dm.full_state_dict()
    return {"param_err": max(_err(full[k], p.detach()) for k, p in ref.named_parameters()),
            "losses": losses, "ref_losses": ref_losses}


def uneven_sequence_dropout():
    """tp+sp on 15 positions over tp=2 (shards of 8 and 7), dropout 0.1: parity."""
    c = GPTConfig(seq=15, dropout=0.1)
    tok, tgt = gpt_batch(c, 8)
    return parity(lambda: TinyGPT(c), autopar.Mesh(tp=2), autopar.Plan(tp=True, sp=True), (tok,), tgt, lm_loss)


def local_masks(axes):
    """Plan(dropout_rng="local"): each rank's masks (attention: the key its fused kernel is
    seeded with), twice from one seed, and the drop rate of the dropout masks."""
    plan = autopar.Plan(dropout_rng="local", **({"tp": True} if "tp" in axes else {}))
    c = GPTConfig(dropout=0.25)
    tok, tgt = gpt_batch(c, 8)
    torch.manual_seed(0)
    dm = autopar.compile(TinyGPT(c), autopar.Mesh(**axes), example_inputs=(tok,), plan=plan)
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        loss = lm_loss(dm(*dm.shard_batch((tok,))), dm.shard_batch(tgt))
        loss.backward()
        runs.append({k[0]: v.clone() if isinstance(v, torch.Tensor) else v
                     for k, v in dm.module.rng_masks.masks.items()})
    zeros = torch.cat([(~m).float().reshape(-1) for m in runs[0].values() if isinstance(m, torch.Tensor)])
    kinds = {s.index: s.kind for s in dm.ctx.rng_sites}
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, {k: v for k, v in runs[0].items()})

    def same(a, b):
        return bool(torch.equal(a, b)) if isinstance(a, torch.Tensor) else a == b
    return {"repeatable": all(same(runs[0][k], runs[1][k]) for k in runs[0]),
            "drop_rate": float(zeros.mean()), "elements": zeros.numel(), "loss": float(loss.detach()),
            "kinds": kinds, "same_as_rank": {r: {k: same(v, g[k]) for k, v in runs[0].items()}
                                             for r, g in enumerate(gathered)}}
