"""Parity: a compiled module against the single-device model, and the errors it is measured by.

``scaled_error`` is the one elementwise scaled error, ``max |a - b| / (atol + rtol |b|)``: the
fp32 comparisons of ``parity`` read it with their tolerances, and ``autopar.verify`` with a
tensor-wide scale (``atol`` the reference's largest magnitude, ``rtol`` 0, in float64).
``mixed_error`` is the mixed-precision comparison, in norm, in units of the compute dtype's
epsilon (``MIXED_TOLERANCE``). ``parity`` trains a model on one device and compiled for a mesh,
step beside step, and reports the largest errors (``ParityReport``); ``MixedReference`` is its
single-device reference under a mixed-precision policy. The zoo, the fuzzer and the doctor run
it on the ranks of ``autopar.launch``; ``autopar.testing`` re-exports it for the tests.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from .api import compile as autopar_compile
from .launch import harness_device
from .runtime.module import model_loss

__all__ = ["scaled_error", "mixed_error", "MIXED_TOLERANCE", "MixedReference", "ParityReport", "parity"]


def scaled_error(a: torch.Tensor, b: torch.Tensor, rtol: float = 0.0, atol: float = 0.0, mask=None,
                 dtype: torch.dtype = torch.float32) -> float:
    """The largest elementwise scaled error ``|a - b| / (atol + rtol |b|)``, computed in
    ``dtype``, over the elements where ``mask`` is true (default: all; none at all: 0). A NaN
    gives inf (the largest of the errors would pass a NaN over)."""
    a, b = a.to(dtype), b.to(dtype)
    e = (a - b).abs() / (atol + rtol * b.abs())
    if mask is not None:
        e = e[mask]
    err = float(e.max()) if e.numel() else 0.0
    return err if not math.isnan(err) else float("inf")


class MixedReference:
    """The single-device model under a mixed-precision policy, the reference of a compiled
    module with ``Plan(param_dtype=...)``: ``master`` (the model the optimizer steps, fp32)
    and a copy of it whose floating parameters are in ``dtype``. A step runs forward on the
    copy under ``torch.autocast`` of the inputs' device, with floating inputs cast to
    ``dtype``, and the outputs in ``dtype`` leave it in ``output_dtype`` (None: the masters'
    dtype), the loss computed on them there; backward leaves the copy's gradients in ``dtype``,
    which become the masters' gradients in their own dtype (one device sums nothing); after the
    optimizer steps the masters, ``refresh`` writes them into the copy."""

    def __init__(self, master: torch.nn.Module, dtype: torch.dtype, output_dtype: torch.dtype | None = None):
        self.master, self.dtype = master, dtype
        self.output_dtype = output_dtype or next(iter(master.parameters())).dtype
        self.copy = copy.deepcopy(master)
        with torch.no_grad():
            for p in self.copy.parameters():
                if p.is_floating_point():
                    p.data = p.data.to(dtype)
        self._pairs = list(zip(master.parameters(), self.copy.parameters()))

    def _cast(self, tree):
        return torch.utils._pytree.tree_map(
            lambda x: x.to(self.dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree)

    def forward_backward(self, inputs: tuple, kwargs: dict, loss_of):
        """(outputs, loss) of the copy on the inputs; the masters' ``.grad`` set."""
        args, kw = self._cast((tuple(inputs), dict(kwargs)))
        device = next(iter(self.copy.parameters())).device.type
        with torch.autocast(device, dtype=self.dtype):
            out = self.copy(*args, **kw)
        out = torch.utils._pytree.tree_map(
            lambda x: x.to(self.output_dtype) if isinstance(x, torch.Tensor) and x.dtype == self.dtype else x, out)
        loss = loss_of(out)
        for _, c in self._pairs:
            c.grad = None
        loss.backward()
        for m, c in self._pairs:
            m.grad = None if c.grad is None else c.grad.to(m.dtype)
        return out, loss

    def refresh(self) -> None:
        with torch.no_grad():
            for m, c in self._pairs:
                c.copy_(m)

@dataclass
class ParityReport:
    """Largest mismatches of a compiled module against the single-device model."""
    rank: int
    output_err: float = 0.0
    loss_err: float = 0.0
    grad_err: float = 0.0          # max |g - g_ref| / (atol + rtol |g_ref|): <= 1 passes (mixed: mixed_error)
    param_err: float = 0.0         # same, for parameters after the optimizer steps (mixed: their updates)
    noise_param_err: float = 0.0   # |Δp| / bound for elements whose gradient is float noise
    noise_elements: int = 0
    noise_by_param: dict = field(default_factory=dict)
    losses: list = field(default_factory=list)
    ref_losses: list = field(default_factory=list)
    messages: list = field(default_factory=list)
    step_bytes: dict = field(default_factory=dict)
    """(axis, kind, phase) -> bytes this rank's collectives moved in the first step (forward,
    backward and optimizer step; the gathers of the comparison itself left out)"""
    inspected: object = None       # what parity's ``inspect`` returned for the compiled module

    @property
    def ok(self) -> bool:
        return max(self.output_err, self.loss_err, self.grad_err, self.param_err, self.noise_param_err) <= 1.0


def _bytes_now(stats) -> dict:
    return dict(stats.bytes) if stats is not None else {}


def _bytes_since(stats, mark: dict) -> dict:
    """Bytes per (axis, kind, phase) that ``stats`` counted since ``mark = _bytes_now(stats)``."""
    return {k: b - mark.get(k, 0.0) for k, b in _bytes_now(stats).items() if b - mark.get(k, 0.0) > 0}


MIXED_TOLERANCE = {"loss": 4, "output": 4, "grad": 8, "update": 16}
"""Mixed-precision parity, in units of the compute dtype's epsilon (bf16: 2^-7), each a bound
on a relative difference: the loss within 4 eps of the reference's; each output and gradient
tensor within 4 and 8 eps of the reference tensor in norm, ``|x - x_ref| <= k eps |x_ref|``
(``mixed_error``); each master tensor's update over the steps (``p - p_0``) within 16 eps of
the reference's, in norm. bf16 rounds every op's result to 8 significant bits, and the
distributed program rounds partial results (a rank's slice of the batch, a tp rank's partial
sum) that one device keeps unrounded, so the two differ by a few eps. Measured on the
project's GPT on CPU (every plan of ``tests/jobs/mixed.py``, 3 AdamW steps): outputs up to 1.0
eps, gradients up to 3.7 eps (tp + sp, a layer norm's bias: the smallest gradients), updates up
to 8.3 eps (pp x ZeRO-2 x tp + sp), the loss 0.01 eps. A gradient 10% off is 12.8 eps; one
with 38% of its elements zeroed, about 80. An elementwise bound cannot tell these apart:
rounding moves single elements by up to 5.9 eps of the tensor's largest element, a 10% scale
moves the largest by 12.8 and a zeroed small element hardly at all. Adam normalises each
element's step to about ``lr`` whatever its gradient's size, so an element whose gradient is
rounding noise steps in a random direction: mixed parity runs Adam with an ``eps`` above that
noise (the tests pass eps=1e-4) so that the update compares the gradients; and a gradient's
scale hardly shows in the update, which is why the gradients are compared tightly."""


def mixed_error(kind: str, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, floor: float = 0.0) -> float:
    """``|a - b| / max(|b|, floor)`` (norms) over ``MIXED_TOLERANCE[kind]`` eps of ``dtype``: <= 1
    passes. ``floor``: the norm below which a reference is rounding noise (parity passes one eps
    of the model's largest gradient element for gradients). A shape mismatch or a non-finite
    value fails (inf)."""
    if a.shape != b.shape:
        return float("inf")
    a, b = a.detach().float(), b.detach().float()
    off, ref = float((a - b).norm()), max(float(b.norm()), floor)
    if not (math.isfinite(off) and math.isfinite(ref)):
        return float("inf")
    if ref == 0.0:
        return 0.0 if off == 0.0 else float("inf")
    return off / ref / (MIXED_TOLERANCE[kind] * torch.finfo(dtype).eps)


def _to_device(tree, device):
    return torch.utils._pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, tree)


def _compared(out, loss_fn):
    """The output parity compares: the output itself, or a model-computed loss's ``logits``."""
    return out if loss_fn is not None or isinstance(out, torch.Tensor) else getattr(out, "logits", None)


def parity(model_fn, mesh, plan, inputs: tuple, target, loss_fn, *, kwargs=None, exported=None, steps: int = 3,
           lr: float = 1e-3,
           rtol: float = 1e-4, atol: float = 1e-5, noise_floor: float = 1e-5,
           optimizer=torch.optim.AdamW, device=None, inspect=None, seed_per_rank: bool = False,
           **optimizer_kwargs) -> ParityReport:
    """Train ``model_fn()`` for ``steps`` optimizer steps (AdamW unless ``optimizer`` says
    otherwise, with ``optimizer_kwargs``) on the global batch on one device and
    compiled for ``mesh``/``plan`` on this rank's slice; compare outputs, loss, gradients
    (gathered) and parameters after every step. Both forwards of a step start from the same
    ``torch.manual_seed``, so a model with dropout draws the same masks.

    ``kwargs`` are keyword inputs of the global batch. With ``loss_fn=None`` the loss is the
    model's own (``output.loss``: a Hugging Face model called with ``labels=``; ``target`` is
    then None) and the outputs compared are its ``logits``. ``exported``: the ExportedProgram
    of the model ``model_fn()`` returns, on the global batch (``compile(exported=...)``).

    Mixed precision (``plan.param_dtype``): the reference is the single-device model under the
    same policy (``MixedReference``), and the errors are scaled by ``MIXED_TOLERANCE`` (see
    there); ``rtol``/``atol``/``noise_floor`` are the fp32 comparison's.

    Tolerances are scaled errors |x - x_ref| / (atol + rtol |x_ref|), fp32. Adam divides by
    sqrt(v): a gradient that is mathematically zero (an attention key bias) is float noise
    whose sign and size differ between the two summation orders, and Adam turns it into a
    step of about lr. Elements whose reference gradient stays below ``noise_floor`` times
    the model's largest gradient at every step are therefore checked against Adam's step
    bound (|Δp| <= 4 lr per step) instead of the tight tolerance; the report counts them.

    ``seed_per_rank``: each rank seeds its steps ``1000 + step + rank`` (the per-rank seeding
    idiom), the single-device model ``1000 + step`` as rank 0 does: dropout still matches, the
    mesh drawing from rank 0's stream (``autopar.runtime.rng``).

    ``device``: where the model and batch live (default ``harness_device()``: the CPU, or with
    ``AUTOPAR_TEST_DEVICE=cuda`` this rank's GPU).

    ``inspect(dm)``, if given, is called on the compiled module before training; the report
    keeps its result (``inspected``) and the first step's bytes per collective (``step_bytes``).
    """
    torch.manual_seed(0)
    device = torch.device(device) if device is not None else harness_device()
    ref = model_fn().to(device)
    move = partial(_to_device, device=device)
    inputs, target, kwargs = move(tuple(inputs)), move(target), move(dict(kwargs or {}))
    model, exported = copy.deepcopy((ref, exported))     # the program stays the copy's own
    dm = autopar_compile(model, mesh, example_inputs=inputs, example_kwargs=kwargs, plan=plan, exported=exported)
    rep = ParityReport(rank=dist.get_rank() if dist.is_initialized() else 0)
    if inspect is not None:
        rep.inspected = inspect(dm)
    mixed = MixedReference(ref, plan.param_dtype, plan.output_cast_dtype) if plan.param_dtype is not None else None
    initial = {k: p.detach().clone() for k, p in ref.named_parameters()} if mixed else {}
    opt_ref = optimizer(ref.parameters(), lr=lr, **optimizer_kwargs)
    opt = dm.optimizer(optimizer, lr=lr, **optimizer_kwargs)
    names = dict(ref.named_parameters())
    noisy = {k: torch.ones_like(p, dtype=torch.bool) for k, p in names.items()}
    moved = {k: torch.zeros_like(p, dtype=torch.bool) for k, p in names.items()}
    local_in, local_kw, local_t = dm.shard_batch(inputs), dm.shard_batch(kwargs), dm.shard_batch(target)

    def loss_of(out, t):
        return model_loss(out) if loss_fn is None else loss_fn(out, t)

    stats = dm.comm_stats
    for step in range(steps):
        mark = _bytes_now(stats)
        opt_ref.zero_grad()
        torch.manual_seed(1000 + step)     # dropout: one device and every rank draw from one seed
        if mixed is None:
            out_ref = ref(*inputs, **kwargs)
            loss_ref = loss_of(out_ref, target)
            loss_ref.backward()
        else:
            out_ref, loss_ref = mixed.forward_backward(inputs, kwargs, lambda out: loss_of(out, target))
        opt.zero_grad()
        torch.manual_seed(1000 + step + (rep.rank if seed_per_rank else 0))
        if plan.pp_schedule is not None:   # a pipeline runs whole steps; it returns the slice's loss
            loss = dm.train_step(local_in, local_t, loss_fn, kwargs=local_kw)
        else:
            out = dm(*local_in, **local_kw)
            loss = loss_of(out, local_t)
            loss.backward()
            got, want = _compared(out, loss_fn), _compared(out_ref, loss_fn)
            if want is not None and mixed is not None:
                rep.output_err = max(rep.output_err, mixed_error("output", got.detach(),
                                                                 dm.shard_batch(want.detach()), plan.param_dtype))
            elif want is not None:
                rep.output_err = max(rep.output_err, scaled_error(got.detach(), dm.shard_batch(want.detach()),
                                                                  rtol, atol))
        if step == 0:
            rep.step_bytes = _bytes_since(stats, mark)
        gl = loss.detach().clone()
        if mesh.axis_size("dp") > 1:
            dist.all_reduce(gl, group=mesh.group("dp"))
            gl /= mesh.axis_size("dp")
        rep.losses.append(float(gl))
        rep.ref_losses.append(float(loss_ref.detach()))
        if mixed is not None:
            eps = torch.finfo(plan.param_dtype).eps
            rep.loss_err = max(rep.loss_err, scaled_error(gl, loss_ref.detach(), MIXED_TOLERANCE["loss"] * eps, 0.0))
        else:
            rep.loss_err = max(rep.loss_err, scaled_error(gl, loss_ref.detach(), rtol, atol))
        grads = dm.full_grads()
        gmax = max((float(p.grad.abs().max()) for p in names.values() if p.grad is not None and p.numel()),
                   default=0.0)
        for k, p in names.items():
            if p.grad is None:    # frozen, unused by forward, or cut off from the loss: none on one device
                if grads.get(k) is not None:
                    rep.messages.append(f"step {step}: {k} has a gradient, which it has not on one device "
                                        "(frozen, or not reached from the loss)")
                    rep.grad_err = float("inf")
                continue
            noisy[k] &= p.grad.abs() <= noise_floor * gmax
            moved[k] |= p.grad != 0   # exact zeros are deterministic: they stay in the tight check
            if grads.get(k) is None:
                rep.messages.append(f"step {step}: no gradient for {k}")
                rep.grad_err = float("inf")
                continue
            if mixed is not None:
                rep.grad_err = max(rep.grad_err, mixed_error("grad", grads[k], p.grad, plan.param_dtype,
                                                             torch.finfo(plan.param_dtype).eps * gmax))
            else:
                rep.grad_err = max(rep.grad_err, scaled_error(grads[k], p.grad, rtol, 1e-6))
        opt_ref.step()
        if mixed is not None:
            mixed.refresh()
        mark = _bytes_now(stats)
        opt.step()
        if step == 0:
            for k, b in _bytes_since(stats, mark).items():
                rep.step_bytes[k] = rep.step_bytes.get(k, 0.0) + b
        full = dm.full_state_dict()
        lacking = [k for k in names if k not in full]
        if lacking:
            rep.messages.append(f"step {step}: full_state_dict() lacks {', '.join(lacking)}")
            rep.param_err = float("inf")
            names = {k: p for k, p in names.items() if k in full}
        if mixed is not None:
            for k, p in names.items():
                if not p.requires_grad:   # frozen: no master, kept in the dtype forward reads, never changed
                    if not torch.equal(full[k], p.detach().to(full[k].dtype)):
                        rep.messages.append(f"step {step}: the frozen {k} changed")
                        rep.param_err = float("inf")
                    continue
                if full[k].dtype != p.dtype:
                    rep.messages.append(f"step {step}: the master of {k} is {full[k].dtype}, expected {p.dtype}")
                    rep.param_err = float("inf")
                rep.param_err = max(rep.param_err, mixed_error("update", full[k].float() - initial[k].float(),
                                                               p.detach().float() - initial[k].float(),
                                                               plan.param_dtype))
            continue
        for k, p in names.items():
            noisy[k] &= moved[k]
            rep.param_err = max(rep.param_err, scaled_error(full[k], p.detach(), rtol, atol, ~noisy[k]))
            bound = 4 * lr * (step + 1)
            diff = (full[k] - p.detach()).abs()[noisy[k]]
            if diff.numel():
                rep.noise_param_err = max(rep.noise_param_err, float(diff.max()) / bound)
    rep.noise_by_param = {k: int(m.sum()) for k, m in noisy.items() if int(m.sum())}
    rep.noise_elements = sum(rep.noise_by_param.values())
    return rep
