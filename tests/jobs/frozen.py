"""Frozen and unused parameters jobs: a small model with parameters that take no gradient, trained
under a plan and compared with the same model trained on one device; checkpoints saved under one
plan and loaded under another.

The model (``Frozen``) has
    ``pos``                 a frozen table added to the activations (requires_grad=False), as
                            Whisper's encoder position embedding;
    ``blocks.1.fc1.weight`` a frozen weight of a product that tensor parallelism splits (its bias
                            trains), on the second stage of a two-stage pipeline;
    ``unused``              a trainable parameter forward never reads (as DINOv2's mask token
                            without a mask), which capture leaves out of the graph;
    ``detached``            a trainable parameter forward reads only through ``detach()``, so that
                            no gradient reaches it (its gradient bucket holds it all the same);
    ``gain``                a persistent buffer.
One device keeps no gradient and no optimizer state for the first four, so AdamW (weight decay
0.01) leaves them as they are; a zero gradient in their place would shrink ``unused`` and
``detached``.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.testing import parity

FROZEN = ("pos", "blocks.1.fc1.weight")
UNUSED = ("unused",)
CUT_OFF = ("detached",)
NO_GRAD = FROZEN + UNUSED + CUT_OFF
BATCH, SEQ, D_IN, DIM, HIDDEN, D_OUT = 8, 4, 6, 8, 16, 5
LR, STEPS = 1e-2, 3

PLANS = {   # name -> (mesh axes, plan)
    "ddp": ({"dp": 2}, dict(dp="ddp")),
    "zero1": ({"dp": 2}, dict(dp="zero1")),
    "zero2": ({"dp": 2}, dict(dp="zero2")),
    "zero3": ({"dp": 2}, dict(dp="zero3")),
    "tp": ({"tp": 2}, dict(tp=True)),
    "tp sp": ({"tp": 2}, dict(tp=True, sp=True)),
    "1f1b": ({"pp": 2}, dict(pp_schedule="1f1b", microbatches=2)),
    "gpipe": ({"pp": 2}, dict(pp_schedule="gpipe", microbatches=4)),
    "pp2 dp2 zero3": ({"pp": 2, "dp": 2}, dict(dp="zero3", pp_schedule="1f1b", microbatches=2)),
}


def world_of(name: str) -> int:
    return math.prod(PLANS[name][0].values())


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, h):
        return h + self.fc2(F.gelu(self.fc1(h)))


class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, DIM)
        self.pos = nn.Parameter(0.5 * torch.randn(SEQ, DIM), requires_grad=False)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.blocks[1].fc1.weight.requires_grad_(False)
        self.unused = nn.Parameter(torch.randn(3, DIM))
        self.detached = nn.Parameter(1.0 + 0.1 * torch.randn(DIM))
        self.register_buffer("gain", 1.0 + 0.1 * torch.randn(DIM))
        self.out = nn.Linear(DIM, D_OUT)

    def forward(self, x):
        h = self.inp(x) + self.pos
        for block in self.blocks:
            h = block(h)
        return self.out(h * self.gain * self.detached.detach())


def model(seed: int = 0) -> Frozen:
    torch.manual_seed(seed)
    return Frozen()


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, SEQ, D_IN, generator=g), torch.randn(BATCH, SEQ, D_OUT, generator=g)


def compiled(name: str, seed: int = 0):
    axes, kw = PLANS[name]
    x, _ = batch(0)
    return autopar.compile(model(seed), autopar.Mesh(**axes), example_inputs=(x,), plan=autopar.Plan(**kw))


def reference(steps: int):
    """One device, ``steps`` AdamW steps: per step the output, loss and gradients (None where
    there is none), and the state dict after the last."""
    ref = model()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    record = []
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        out = ref(x)
        loss = F.mse_loss(out, y)
        loss.backward()
        record.append({"out": out.detach(), "loss": float(loss.detach()),
                       "grads": {k: None if p.grad is None else p.grad.clone() for k, p in ref.named_parameters()}})
        opt.step()
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    return record, state, {k for k, p in ref.named_parameters() if p in opt.state}


def _canonical(qualified: str) -> str:
    """A compiled module's parameter name as the model's (``stages.0.module.pos`` -> ``pos``)."""
    return qualified.split("module.", 1)[1] if "module." in qualified else qualified


def _step(dm, x, y) -> tuple[float, torch.Tensor | None]:
    """One forward and backward on this rank's slice: the global mean loss, and the output slice
    (None under a pipeline, which returns the loss alone)."""
    out = None
    if dm.plan.pp_schedule is not None:
        total = dm.train_step(dm.shard_batch((x,)), dm.shard_batch(y), F.mse_loss).detach().clone()
    else:
        out = dm(dm.shard_batch(x))
        loss = F.mse_loss(out, dm.shard_batch(y))
        loss.backward()
        total, out = loss.detach().clone(), out.detach()
    if dm.mesh.axis_size("dp") > 1:
        dist.all_reduce(total, group=dm.mesh.group("dp"))
        total /= dm.mesh.axis_size("dp")
    return float(total), out


def _scaled(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> float:
    return float(((a - b).abs() / (atol + rtol * b.abs())).max()) if b.numel() else 0.0


def _state_errors(full: dict, want: dict) -> tuple[list, float, str]:
    """(keys of ``want`` missing from ``full``, the largest scaled difference of the others
    (1e-4 + 1e-3 |p|), its key)."""
    missing = sorted(set(want) - set(full))
    err, worst = 0.0, ""
    for k, v in want.items():
        if k in full:
            e = _scaled(full[k].float(), v.float(), 1e-4, 1e-3) if full[k].shape == v.shape else math.inf
            if e > err:
                err, worst = e, k
    return missing, err, worst


def _no_grad_report(dm, opt) -> dict:
    """Of this rank's tensors of the frozen and unused parameters: which have a gradient, which
    optimizer state, which require grad."""
    held = [(_canonical(q), p) for q, p in dm.named_parameters() if _canonical(q) in NO_GRAD]
    return {"held": sorted({k for k, _ in held}),
            "with_grad": sorted({k for k, p in held if p.grad is not None}),
            "with_state": sorted({k for k, p in held if opt.state.get(p)}),
            "trainable_frozen": sorted({k for k, p in held if k in FROZEN and p.requires_grad})}


def _communicated(dm) -> list[str]:
    """The collectives of this rank's emitted graphs that read a frozen parameter, or the unused
    one (gradient reductions of the dp and tp axes, ZeRO gathers: autopar's runtime functions)."""
    found = []
    for st in (dm.stages.values() if hasattr(dm, "stages") else [dm]):
        for node in st.module.graph.nodes:
            if node.op == "get_attr" and node.target in FROZEN + UNUSED:
                found += [f"{node.target} -> {u.name}" for u in node.users if u.op == "call_function"
                          and getattr(u.target, "__module__", "").startswith("autopar.runtime")]
    return found


def _dp_grad_bytes(dm) -> float:
    """Bytes this rank sent reducing gradients over dp in the last backward."""
    return sum(dm.comm_stats.total("dp", kind, "backward") for kind in ("all_reduce", "reduce_scatter"))


def expected_dp_grad_bytes(name: str, shapes: dict) -> float:
    """The gradient reduction of a step over dp=2 of the parameters ``shapes`` (name -> shape):
    ddp all-reduces each (2 (N-1)/N of its bytes), ZeRO reduce-scatters each padded to whole
    rows on every rank ((N-1)/N of N ceil(rows / N) rows)."""
    axes, kw = PLANS[name]
    n = axes.get("dp", 1)
    if n == 1:
        return 0.0
    total = 0.0
    for shape in shapes.values():
        rows, row = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
        if kw["dp"] == "ddp":
            total += 2 * (n - 1) / n * 4 * rows * row
        else:
            total += (n - 1) / n * 4 * n * -(-rows // n) * row
    return total


def train_job(name: str) -> dict:
    """Train STEPS steps under plan ``name`` beside the single-device record: per step the
    errors of output, loss and gradients, the gradients present where one device has none, the
    dp bytes of the gradient reduction; after the last step, the state dict and optimizer state."""
    record, want_state, ref_stepped = reference(STEPS)
    dm = compiled(name)
    opt = dm.optimizer(torch.optim.AdamW, lr=LR)
    out = {"loss_err": 0.0, "out_err": 0.0, "grad_err": 0.0, "grad_worst": "", "extra_grads": [],
           "missing_grads": [], "dp_bytes": []}
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        dm.comm_stats.reset()
        loss, got = _step(dm, x, y)
        out["dp_bytes"].append(_dp_grad_bytes(dm))
        ref = record[step]
        out["loss_err"] = max(out["loss_err"], abs(loss - ref["loss"]) / abs(ref["loss"]))
        if got is not None:
            out["out_err"] = max(out["out_err"], _scaled(got, dm.shard_batch(ref["out"]), 1e-6, 1e-4))
        grads = dm.full_grads()
        for k, g in ref["grads"].items():
            mine = grads.get(k)
            if g is None:
                if mine is not None:
                    out["extra_grads"].append(f"step {step}: {k}")
            elif mine is None:
                out["missing_grads"].append(f"step {step}: {k}")
            else:
                e = _scaled(mine, g, 1e-6, 1e-4)
                if e > out["grad_err"]:
                    out["grad_err"], out["grad_worst"] = e, k
        if step == 0:
            out["no_grad"] = _no_grad_report(dm, opt)
        opt.step()
    out["no_grad_after"] = _no_grad_report(dm, opt)
    out["communicated"] = _communicated(dm)
    out["ref_stepped"] = sorted(ref_stepped)
    out["stepped"] = sorted({_canonical(q) for q, p in dm.named_parameters() if opt.state.get(p)})
    full = dm.full_state_dict()
    out["missing"], out["state_err"], out["state_worst"] = _state_errors(full, want_state)
    first = model()      # the frozen ones and the unused one, exactly as they started
    out["changed"] = sorted(k for k in NO_GRAD if k in full and not torch.equal(full[k], first.state_dict()[k]))
    # every trainable parameter this rank's stages read is reduced (``detached`` too: zeros, as DDP
    # sends for a parameter without a gradient); the frozen ones and the one forward never reads are not
    held = {_canonical(q) for q, _ in dm.named_parameters()}
    trained = {k: tuple(p.shape) for k, p in first.named_parameters()
               if p.requires_grad and k not in UNUSED and k in held}
    out["want_dp_bytes"] = expected_dp_grad_bytes(name, trained)
    return out


SPLIT = 2   # checkpoints: saved after 2 steps, resumed for the third


def save_job(name: str, path: str) -> None:
    """Train SPLIT steps under ``name``, save."""
    dm = compiled(name)
    opt = dm.optimizer(torch.optim.AdamW, lr=LR)
    for step in range(SPLIT):
        opt.zero_grad()
        _step(dm, *batch(step))
        opt.step()
    dm.save(path)


def resume_job(name: str, paths: dict) -> dict:
    """Under ``name``, a module built from a model of other values (every parameter, frozen,
    unused, and the buffer differ): for each source's checkpoint, load it, compare every key
    of the model's state dict with one device's after SPLIT steps, train the last step and
    compare again with one device's after STEPS."""
    record, want_final, _ = reference(STEPS)
    _, want_split, _ = reference(SPLIT)
    out = {}
    for source, path in paths.items():
        dm = compiled(name, seed=7)
        opt = dm.optimizer(torch.optim.AdamW, lr=LR)
        resumed = dm.load(path)
        r = {"step": resumed.step}
        r["missing"], r["load_err"], r["load_worst"] = _state_errors(dm.full_state_dict(), want_split)
        r["no_grad"] = _no_grad_report(dm, opt)
        for step in range(SPLIT, STEPS):
            opt.zero_grad()
            loss, _ = _step(dm, *batch(step))
            r["loss_err"] = abs(loss - record[step]["loss"]) / abs(record[step]["loss"])
            opt.step()
        _, r["final_err"], r["final_worst"] = _state_errors(dm.full_state_dict(), want_final)
        r["no_grad_after"] = _no_grad_report(dm, opt)
        out[source] = r
    return out


def tools_job() -> dict:
    """``autopar.testing.parity`` on this model under ZeRO-3 and the pipeline (every rank)."""
    x, y = batch(0)
    out = {}
    for name in ("zero3", "1f1b"):
        axes, kw = PLANS[name]
        rep = parity(model, autopar.Mesh(**axes), autopar.Plan(**kw), (x,), y, F.mse_loss, steps=2, lr=LR)
        out[name] = {"ok": rep.ok, "messages": rep.messages, "errors": (rep.output_err, rep.loss_err, rep.grad_err,
                                                                        rep.param_err, rep.noise_param_err)}
    return out
