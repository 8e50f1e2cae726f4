"""New input shapes at run time: one compiled module trained on batches of other sizes and
sequence lengths, step by step beside the single-device model."""
from __future__ import annotations

import copy

import torch

import autopar
from autopar.models import GPTConfig, TinyGPT, gpt_batch, lm_loss
from autopar.testing import scaled_error

PLANS = {   # name -> (mesh axes, plan)
    "ddp": ({"dp": 2}, autopar.Plan()),
    "zero2": ({"dp": 2}, autopar.Plan(dp="zero2")),
    "zero3": ({"dp": 2}, autopar.Plan(dp="zero3")),
    "tp": ({"tp": 2}, autopar.Plan(tp=True)),
    "tp+sp": ({"tp": 2}, autopar.Plan(tp=True, sp=True)),
    "dp x tp": ({"dp": 2, "tp": 2}, autopar.Plan(dp="zero3", tp=True, sp=True)),
    "pp 1f1b": ({"pp": 2}, autopar.Plan(pp_schedule="1f1b", microbatches=2)),
    "dp x pp": ({"dp": 2, "pp": 2}, autopar.Plan(dp="zero2", pp_schedule="interleaved", virtual_stages=2,
                                                  microbatches=2)),
}

C = GPTConfig(layers=2, seq=16, dropout=0.1)
STEPS = ((8, 16), (4, 16), (8, 8), (8, 16), (4, 12), (4, 8))
"""(global batch rows, sequence length) of each training step: the compiled shape first, then a
smaller batch, a shorter sequence, the compiled shape again, and both changed"""


def _batch(rows: int, seq: int, seed: int):
    tok, tgt = gpt_batch(C, rows, seed=seed)
    return tok[:, :seq].contiguous(), tgt[:, :seq].contiguous()


def train_shapes(name: str) -> dict:
    """Compile at (8, 16), train through ``STEPS`` with SGD (momentum) against the single-device model
    (dropout on: the masks of every shape are the single-device model's), then evaluate at
    another batch (4 rows of 10 tokens); the scaled errors of each step's loss, gradients and parameters."""
    torch.set_num_threads(1)
    axes, plan = PLANS[name]
    mesh = autopar.Mesh(**axes)
    torch.manual_seed(0)
    ref = TinyGPT(C)
    tok, _ = _batch(*STEPS[0], seed=0)
    dm = autopar.compile(copy.deepcopy(ref), mesh, example_inputs=(tok,), plan=plan)
    # SGD with momentum: Adam would turn a gradient that is float noise (an attention key's bias)
    # into a full step, and the comparison would read the noise, not the program
    opt = dm.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    names = dict(ref.named_parameters())
    errs = {"loss": 0.0, "grad": 0.0, "param": 0.0, "eval": 0.0}
    for step, (rows, seq) in enumerate(STEPS):
        tok, tgt = _batch(rows, seq, seed=step)
        opt_ref.zero_grad()
        opt.zero_grad()
        torch.manual_seed(100 + step)
        loss_ref = lm_loss(ref(tok), tgt)
        loss_ref.backward()
        torch.manual_seed(100 + step)
        if plan.pp_schedule is not None:      # a pipeline runs whole steps
            loss = dm.train_step(dm.shard_batch(tok), dm.shard_batch(tgt), lm_loss)
        else:
            loss = lm_loss(dm(dm.shard_batch(tok)), dm.shard_batch(tgt))
            loss.backward()
        got = loss.detach().clone()
        if mesh.axis_size("dp") > 1:
            torch.distributed.all_reduce(got, group=mesh.group("dp"))
            got /= mesh.axis_size("dp")
        errs["loss"] = max(errs["loss"], scaled_error(got, loss_ref.detach(), 1e-4, 1e-5))
        grads = dm.full_grads()
        errs["grad"] = max(errs["grad"], max(scaled_error(grads[k], p.grad, 1e-4, 1e-6) for k, p in names.items()))
        opt_ref.step()
        opt.step()
        full = dm.full_state_dict()
        errs["param"] = max(errs["param"], max(scaled_error(full[k], p.detach(), 1e-4, 1e-5)
                                               for k, p in names.items()))
    ref.eval()
    dm.eval()
    tok, tgt = _batch(4, 10, seed=99)
    with torch.no_grad():
        if plan.pp_schedule is not None:     # the pipeline's evaluation: the mean loss over the slice
            got = dm.eval_step(dm.shard_batch(tok), dm.shard_batch(tgt), lm_loss)
            if mesh.axis_size("dp") > 1:
                torch.distributed.all_reduce(got, group=mesh.group("dp"))
                got /= mesh.axis_size("dp")
            errs["eval"] = scaled_error(got, lm_loss(ref(tok), tgt), 1e-4, 1e-5)
        else:
            errs["eval"] = scaled_error(dm(dm.shard_batch(tok)), dm.shard_batch(ref(tok)), 1e-4, 1e-5)
    return {"errs": errs, "programs": len(dm.programs)}


def uneven_batch(name: str) -> dict:
    """A global batch that does not divide by dp (5 rows on 2 ranks): every rank gets the error
    naming both shapes, and the module then trains a batch that divides."""
    torch.set_num_threads(1)
    axes, plan = PLANS[name]
    torch.manual_seed(0)
    dm = autopar.compile(TinyGPT(C), autopar.Mesh(**axes), example_inputs=(_batch(8, 16, 0)[0],), plan=plan)
    tok, tgt = _batch(5, 16, seed=1)
    errors = []
    for local in (lambda: dm.shard_batch(tok),                   # shard_batch refuses the split
                  lambda: tok[:3] if torch.distributed.get_rank() == 0 else tok[3:]):   # split by hand
        try:
            dm(local())
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    tok, tgt = _batch(4, 16, seed=2)
    loss = lm_loss(dm(dm.shard_batch(tok)), dm.shard_batch(tgt))
    loss.backward()
    return {"errors": errors, "loss": float(loss.detach())}
