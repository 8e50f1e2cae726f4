"""Optimizer offload (Plan(offload="optimizer")) on real processes: parity against the
single-device model, and a census of one step: the bytes that crossed the host link, where
the optimizer's state lives, what the device-side module holds afterwards, and the order in
which the step's reductions, copies and gathers were issued."""
from __future__ import annotations

import torch

import autopar
from autopar.models import GPTConfig, TinyGPT, gpt_batch, lm_loss
from autopar.testing import optimizer_state_bytes, parity

BF16 = torch.bfloat16
ADAM_EPS = 1e-4     # mixed precision: above bf16's gradient noise (autopar.testing.MIXED_TOLERANCE)
OFF = "optimizer"

PLANS = {   # name -> (mesh axes, plan)
    "ddp": ({"dp": 2}, autopar.Plan(dp="ddp", offload=OFF)),
    "zero1": ({"dp": 2}, autopar.Plan(dp="zero1", offload=OFF)),
    # ZeRO-2 in buckets small enough for five of them (fp32 32 kB, bf16 16 kB): the copies and
    # the gathers interleave bucket by bucket
    "zero2": ({"dp": 2}, autopar.Plan(dp="zero2", bucket_bytes=32_000, offload=OFF)),
    "zero3": ({"dp": 2}, autopar.Plan(dp="zero3", offload=OFF)),
    "zero2 bf16": ({"dp": 2}, autopar.Plan(dp="zero2", param_dtype=BF16, bucket_bytes=16_000, offload=OFF)),
    "zero3 bf16": ({"dp": 2}, autopar.Plan(dp="zero3", param_dtype=BF16, offload=OFF)),
    "zero2 tp": ({"dp": 2, "tp": 2}, autopar.Plan(dp="zero2", tp=True, offload=OFF)),
    "pp 1f1b": ({"pp": 2}, autopar.Plan(pp_schedule="1f1b", microbatches=2, offload=OFF)),
}


def _report(rep) -> dict:
    return {"ok": rep.ok, "rank": rep.rank, "errors": (rep.output_err, rep.loss_err, rep.grad_err, rep.param_err,
                                                       rep.noise_param_err),
            "losses": rep.losses, "ref_losses": rep.ref_losses, "messages": rep.messages}


def offload_parity(names, steps: int = 3) -> dict:
    """``parity`` (three AdamW steps) under each named plan of ``PLANS``."""
    c = GPTConfig()
    tok, tgt = gpt_batch(c, 8)
    out = {}
    for name in names:
        axes, plan = PLANS[name]
        extra = {"eps": ADAM_EPS} if plan.mixed else {}
        out[name] = _report(parity(lambda: TinyGPT(c), autopar.Mesh(**axes), plan, (tok,), tgt, lm_loss,
                                   steps=steps, **extra))
    return out


def _storages(tensors) -> dict[int, int]:
    """Distinct storages of ``tensors`` (None skipped): data pointer -> bytes."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}


class _Logged:
    """A collective's handle that notes in ``log`` when it is waited on."""

    def __init__(self, work, log: list, event: tuple):
        self.work, self.log, self.event = work, log, event

    def wait(self):
        out = self.work.wait()
        self.log.append(self.event)
        return out


def _log_order(dm, log: list) -> None:
    """Note in ``log``, in the order they happen: each gradient bucket's reduction issued
    ("reduce", k) and its gradients handed to the offload ("land", k), each parameter copied up
    ("up", name), each replica all-gather issued ("issue", k) and waited on ("wait", k)."""
    sync, off = dm._sync, dm._offload
    bucket = lambda label: int(label.rsplit(" ", 1)[1])
    name_of = {id(p): n for n, p in sync._params.items()}
    index_of = {id(sync._params[b.names[0]]): k for k, b in enumerate(sync.buckets)}
    up, landed, comm, reduce = off.link.up, sync.on_landed, sync.comm, sync.reduce_comm
    gather, scatter = comm.all_gather_flat, reduce.reduce_scatter_flat

    def logged_up(dst, src, *args, **kwargs):
        log.append(("up", name_of[id(dst)]))
        return up(dst, src, *args, **kwargs)

    def logged_landed(params):
        log.append(("land", index_of[id(params[0])]))
        return landed(params)

    def logged_gather(out, inp, label="", async_op=False, phase=None, **kwargs):
        work = gather(out, inp, label=label, async_op=async_op, phase=phase, **kwargs)
        if phase != "optimizer":
            return work
        log.append(("issue", bucket(label)))
        if work is None:
            log.append(("wait", bucket(label)))
            return None
        return _Logged(work, log, ("wait", bucket(label)))

    def logged_scatter(out, inp, label="", async_op=False, phase=None, **kwargs):
        log.append(("reduce", bucket(label)))
        return scatter(out, inp, label=label, async_op=async_op, phase=phase, **kwargs)

    off.link.up, sync.on_landed = logged_up, logged_landed
    comm.all_gather_flat, reduce.reduce_scatter_flat = logged_gather, logged_scatter


def offload_census(name: str) -> dict:
    """Two steps under ``PLANS[name]``; the second measured: the host link's bytes by (kind,
    phase), this rank's coordinates and trainable elements, where the optimizer's parameters
    and state live, the bytes the device-side module holds after the step by kind, and (ZeRO-2
    without tp) the order of the step's reductions, copies and gathers (``_log_order``)."""
    axes, plan = PLANS[name]
    mesh = autopar.Mesh(**axes)
    c = GPTConfig()
    tok, tgt = gpt_batch(c, 8)
    torch.manual_seed(0)
    dm = autopar.compile(TinyGPT(c), mesh, example_inputs=(tok,), plan=plan)
    opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
    order: list = []
    for step in range(2):
        if step == 1:
            dm.offload_stats.reset()
            if plan.dp == "zero2" and not plan.tp:
                _log_order(dm, order)
        opt.zero_grad()
        if plan.pp_schedule is not None:
            dm.train_step(dm.shard_batch((tok,)), dm.shard_batch(tgt), lm_loss)
        else:
            lm_loss(dm(*dm.shard_batch((tok,))), dm.shard_batch(tgt)).backward()
        down_in_backward = dm.offload_stats.total(kind="d2h")   # each bucket's went down as it was reduced
        opt.step()
    trainable = [p for p in dm.parameters() if p.requires_grad]
    syncs = [st._sync for st in dm.stages.values()] if plan.pp_schedule is not None else [dm._sync]
    replicas = [r for s in syncs for r in s._replicas.values()]
    persistent = [t for s in syncs for t in s._persistent.values()]
    device = {"parameters": _storages(trainable), "replicas": _storages(replicas),
              "gradients": _storages([p.grad for p in dm.parameters()]), "persistent": _storages(persistent),
              "buffers": _storages(list(dm.buffers()))}
    every_device_storage = set().union(*(d.keys() for d in device.values()))
    seen, held = set(), {}
    for kind in ("parameters", "replicas", "gradients", "persistent"):   # a shard may be a view of its replica
        fresh = {k: v for k, v in device[kind].items() if k not in seen}
        seen |= fresh.keys()
        held[kind] = sum(fresh.values())
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    opt_params = [p for g in opt.param_groups for p in g["params"]]
    off = dm._offload
    return {
        "bytes": {(k, ph): b for (_, k, ph), b in dm.offload_stats.bytes.items()},
        "order": order,
        "buckets": [list(b.names) for b in dm._sync.buckets] if plan.pp_schedule is None else [],
        "down_in_backward": down_in_backward,
        "dp_index": mesh.coordinate("dp"), "dp": mesh.axis_size("dp"),
        "elements": sum(p.numel() for p in trainable),
        "element_size": trainable[0].element_size(),
        "host": str(off.link.host), "pinned": off.link.pinned,
        "state_devices": sorted({str(v.device) for v in state}),
        "state_bytes": optimizer_state_bytes(opt),
        "optimizer_steps_host_copies": [id(p) for p in opt_params] == [id(h) for h in off.parameters()],
        "shared_with_device": len((_storages(opt_params) | _storages(state)).keys() & every_device_storage),
        "grads_left_on_device": sum(p.grad is not None for p in dm.parameters()),
        "held": held,
        "host_held": off.host_bytes(opt),
        "explain": dm.explain(cluster="dgx-a100-80gb"),
    }


def offload_checks(name: str) -> dict:
    """The fast tier's run: parity and the census under one plan."""
    return {"parity": offload_parity([name])[name], "census": offload_census(name)}
