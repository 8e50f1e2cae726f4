"""Mixed precision on real processes: parity against the single-device model under the same
policy (``autopar.testing.MixedReference``), the dtype of every collective's buffer as it
runs, bytes by dtype, and the model states' memory after a step."""
from __future__ import annotations

import copy
from collections import defaultdict

import torch
import torch.distributed as dist

import autopar
from autopar.meta import REPLICAS
from autopar.models import GPTConfig, TinyGPT, gpt_batch, lm_loss
from autopar.runtime.comm import AxisComm
from autopar.testing import optimizer_state_bytes, parity

BF16 = torch.bfloat16
ADAM_EPS = 1e-4     # above bf16's gradient noise: see autopar.testing.MIXED_TOLERANCE

PLANS = {   # name -> (mesh axes, plan)
    "ddp": ({"dp": 2}, autopar.Plan(dp="ddp", param_dtype=BF16)),
    "zero1": ({"dp": 2}, autopar.Plan(dp="zero1", param_dtype=BF16)),
    "zero2": ({"dp": 2}, autopar.Plan(dp="zero2", param_dtype=BF16)),
    "zero3": ({"dp": 2}, autopar.Plan(dp="zero3", param_dtype=BF16)),
    "tp": ({"tp": 2}, autopar.Plan(tp=True, param_dtype=BF16)),
    "tp+sp": ({"tp": 2}, autopar.Plan(tp=True, sp=True, param_dtype=BF16)),
    "pp 1f1b": ({"pp": 2}, autopar.Plan(pp_schedule="1f1b", microbatches=2, param_dtype=BF16)),
    "pp x zero2 x tp+sp": ({"pp": 2, "dp": 2, "tp": 2},
                           autopar.Plan(dp="zero2", tp=True, sp=True, pp_schedule="1f1b", microbatches=2,
                                        param_dtype=BF16)),
}


def mixed_parity(names, steps: int = 3):
    """``parity`` under each named plan of ``PLANS`` whose mesh has this world's size."""
    c = GPTConfig()
    tok, tgt = gpt_batch(c, 8)
    out = {}
    for name in names:
        axes, plan = PLANS[name]
        out[name] = parity(lambda: TinyGPT(c), autopar.Mesh(**axes), plan, (tok,), tgt, lm_loss, steps=steps,
                           eps=ADAM_EPS)
    return out


def loss_curves(steps: int = 20):
    """ZeRO-3 bf16 on two ranks against the fp32 model on one device: both loss curves."""
    c = GPTConfig()
    tok, tgt = gpt_batch(c, 8)
    torch.manual_seed(0)
    ref = TinyGPT(c)
    dm = autopar.compile(copy.deepcopy(ref), autopar.Mesh(dp=2), example_inputs=(tok,),
                         plan=autopar.Plan(dp="zero3", param_dtype=BF16))
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    opt = dm.optimizer(torch.optim.AdamW, lr=3e-3)
    fp32, bf16 = [], []
    for _ in range(steps):
        opt_ref.zero_grad()
        loss = lm_loss(ref(tok), tgt)
        loss.backward()
        opt_ref.step()
        fp32.append(float(loss))
        opt.zero_grad()
        local = lm_loss(dm(*dm.shard_batch((tok,))), dm.shard_batch(tgt)).float()
        local.backward()
        opt.step()
        total = local.detach().clone()
        dist.all_reduce(total)
        bf16.append(float(total) / 2)
    return fp32, bf16


def _gpt(axes: dict, plan_text: str):
    """(plan, mesh, the project's GPT compiled for them, tokens, targets) from seed 0."""
    plan = autopar.Plan.parse(plan_text)
    mesh = autopar.Mesh(**axes)
    c = GPTConfig()
    tok, tgt = gpt_batch(c, 8)
    torch.manual_seed(0)
    return plan, mesh, autopar.compile(TinyGPT(c), mesh, example_inputs=(tok,), plan=plan), tok, tgt


def collective_dtypes(axes: dict, plan_text: str):
    """One training step with torch.distributed's collectives wrapped: (axis, kind, phase,
    dtype) of every buffer they were handed, in order; and the module's bytes by dtype."""
    plan, mesh, dm, tok, tgt = _gpt(axes, plan_text)
    opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
    groups = {}
    for axis in axes:
        if axes[axis] > 1:
            for role in (None, "grads"):
                try:
                    groups[id(mesh.group(axis, role) if role else mesh.group(axis))] = axis
                except Exception:
                    pass
    seen = []
    saved = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single", "all_reduce")}

    def wrap(name, fn):
        def call(*args, **kwargs):
            group = kwargs.get("group")
            buf = args[1] if name != "all_reduce" else args[0]     # the send buffer
            phase = "backward" if torch._C._current_autograd_node() is not None else "other"
            seen.append((groups.get(id(group), "?"), name, phase, str(buf.dtype).removeprefix("torch.")))
            return fn(*args, **kwargs)
        return call

    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        dm.comm_stats.reset()
        opt.zero_grad()
        if plan.pp_schedule is not None:
            dm.train_step(dm.shard_batch((tok,)), dm.shard_batch(tgt), lm_loss)
        else:
            lm_loss(dm(*dm.shard_batch((tok,))), dm.shard_batch(tgt)).backward()
        opt.step()
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    return seen, dict(dm.comm_stats.dtype_bytes)


def model_state_bytes_after_step(mode: str):
    """Bytes of every tensor a ZeRO stage keeps after a bf16 step (parameters, gradients,
    buffers, optimizer state, the sync's persistent buffers: distinct storages), with Ψ and
    the padded Ψ."""
    c = GPTConfig()
    tok, tgt = gpt_batch(c, 8)
    torch.manual_seed(0)
    model = TinyGPT(c)
    psi = sum(p.numel() for p in model.parameters())
    dm = autopar.compile(model, autopar.Mesh(dp=2), example_inputs=(tok,),
                         plan=autopar.Plan(dp=mode, param_dtype=BF16))
    opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
    lm_loss(dm(*dm.shard_batch((tok,))), dm.shard_batch(tgt)).backward()
    opt.step()
    seen, by_kind = set(), defaultdict(int)

    def count(kind, t):
        if t is None or t.untyped_storage().data_ptr() in seen:
            return
        seen.add(t.untyped_storage().data_ptr())
        by_kind[f"{kind} {str(t.dtype).removeprefix('torch.')}"] += t.untyped_storage().nbytes()

    for p in dm.parameters():
        count("master", p)
    for p in dm.parameters():
        count("grad", p.grad)
    for t in dm._sync._persistent.values():
        count("grad", t)
    for name, b in dm.named_buffers():
        if name.startswith(f"module.{REPLICAS}."):
            count("replica", b)
    state = optimizer_state_bytes(opt)
    padded = sum(spec.padded_numel for spec in dm._sync.specs.values())
    return dict(by_kind), state, psi, padded



def replicated_grad_sums(axes: dict, plan_text: str):
    """One bf16 step; at the tp all-reduce of ``ln_f``'s gradients (``tp_param_sync``'s group of
    the final norm's weight and bias, one flat buffer), this rank's addends as sent: its
    compute-dtype partial gradients, widened, one per micro-batch. Returns every rank's (dp
    coordinate, addends; none where the rank holds no ``ln_f``: an earlier pipeline stage) and
    this rank's full master gradients of ``ln_f``."""
    plan, mesh, dm, tok, tgt = _gpt(axes, plan_text)
    sent = []
    all_reduce = AxisComm.all_reduce_

    def spy(self, t, label="", *args, **kwargs):
        if self.axis == "tp" and label == "grads of 2 replicated parameters read per rank":
            sent.append(t.detach().clone())
        return all_reduce(self, t, label, *args, **kwargs)

    AxisComm.all_reduce_ = spy
    try:
        if plan.pp_schedule is not None:
            dm.train_step(dm.shard_batch((tok,)), dm.shard_batch(tgt), lm_loss)
        else:
            lm_loss(dm(*dm.shard_batch((tok,))), dm.shard_batch(tgt)).backward()
    finally:
        AxisComm.all_reduce_ = all_reduce
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (mesh.coordinate("dp"), sent))
    grads = dm.full_grads()
    return every, {k: grads.get(k) for k in ("ln_f.weight", "ln_f.bias")}


def pipeline_output_dtypes():
    """1F1B bf16 on two stages: the dtypes of the outputs ``loss_fn`` receives, one per
    micro-batch, in ``train_step`` and in ``eval_step`` (on the last stage's rank), and the
    dtype and shape of what ``eval_step`` returns without a loss (the logits; None elsewhere)."""
    c = GPTConfig()
    tok, tgt = gpt_batch(c, 8)
    torch.manual_seed(0)
    dm = autopar.compile(TinyGPT(c), autopar.Mesh(pp=2), example_inputs=(tok,),
                         plan=autopar.Plan(pp_schedule="1f1b", microbatches=2, param_dtype=BF16))
    seen = []

    def loss_fn(out, target):
        seen.append(str(out.dtype).removeprefix("torch."))
        return lm_loss(out, target)

    dm.train_step(dm.shard_batch((tok,)), dm.shard_batch(tgt), loss_fn)
    trained = list(seen)
    seen.clear()
    dm.eval_step(dm.shard_batch((tok,)), dm.shard_batch(tgt), loss_fn)
    out = dm.eval_step(dm.shard_batch((tok,)))     # no loss: the logits themselves, on the last stage's rank
    return trained, seen, None if out is None else (str(out.dtype).removeprefix("torch."), tuple(out.shape))
