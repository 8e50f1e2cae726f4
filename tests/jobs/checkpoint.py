"""Checkpoint jobs: train, save under one plan; load under another, train on, compare with one
device trained without interruption."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import autopar
from autopar.models import GPTConfig, TinyGPT, TinyMLP, gpt_batch, lm_loss

# a GPT with dropout (the RNG state must resume), 4 layers (pp=4 interleaved: 8 stages of
# half a layer's weight each is too fine; 2 per rank of 4 layers), a vocabulary of 67 (uneven
# over 2, 4 and 8) and its LM head tied to the embedding (across pipeline stages)
CONFIG = GPTConfig(vocab=67, seq=8, dim=16, heads=2, layers=4, max_seq=8, dropout=0.1)
BATCH, LR, STEPS, SPLIT = 8, 1e-2, 6, 3

PLANS = {   # name -> (mesh axes, plan)
    "ddp w2": ({"dp": 2}, dict(dp="ddp")),
    "zero3 w4": ({"dp": 4}, dict(dp="zero3")),
    "tp2": ({"tp": 2}, dict(tp=True)),
    "dp2 tp2 sp": ({"dp": 2, "tp": 2}, dict(dp="zero2", tp=True, sp=True)),
    "pp2 1f1b": ({"pp": 2}, dict(pp_schedule="1f1b", microbatches=2)),
    "pp2 dp2 tp2": ({"pp": 2, "dp": 2, "tp": 2}, dict(dp="zero3", tp=True, sp=True, pp_schedule="1f1b",
                                                       microbatches=2)),
    "zero1 w4": ({"dp": 4}, dict(dp="zero1")),
    "pp4 interleaved": ({"pp": 4}, dict(pp_schedule="interleaved", microbatches=4, virtual_stages=2)),
}
MORE = {    # not in the matrix: each resumed from and into one other plan
    "zero2 offload w2": ({"dp": 2}, dict(dp="zero2", offload="optimizer")),
    "zero3 tp2 per_tensor": ({"dp": 2, "tp": 2}, dict(dp="zero3", tp=True)),
}
OPTIMIZER = {"zero3 tp2 per_tensor": {"per_tensor": True}}    # full copies stepped on every rank


def world_of(name: str) -> int:
    n = 1
    for v in {**PLANS, **MORE}[name][0].values():
        n *= v
    return n


def model():
    torch.manual_seed(0)
    return TinyGPT(CONFIG)


def batch(step: int):
    return gpt_batch(CONFIG, BATCH, seed=100 + step)


def reference():
    """One device, STEPS steps without interruption: the losses and the final parameters."""
    ref = model()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    torch.manual_seed(1)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        loss = lm_loss(ref(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in ref.state_dict().items()}


def _noise_mask(name: str, v: torch.Tensor) -> torch.Tensor:
    """Elements whose gradient is float noise: the attention key bias (softmax is invariant to a
    shift of the scores along the keys, so its gradient is zero up to rounding, whose sign a
    change of summation order flips, and AdamW moves such an element by about lr either way)."""
    mask = torch.zeros_like(v, dtype=torch.bool)
    if name.endswith("qkv.bias"):
        d = CONFIG.dim
        mask[d:2 * d] = True
    return mask


def compiled(name: str):
    axes, kw = {**PLANS, **MORE}[name]
    x, _ = batch(0)
    return autopar.compile(model(), autopar.Mesh(**axes), example_inputs=(x,), plan=autopar.Plan(**kw))


def train(dm, opt, steps) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step)
        opt.zero_grad()
        if dm.plan.pp_schedule is not None:
            loss = dm.train_step(dm.shard_batch(x), dm.shard_batch(y), lm_loss).detach()
        else:
            loss = lm_loss(dm(dm.shard_batch(x)), dm.shard_batch(y))
            loss.backward()
            loss = loss.detach()
        opt.step()
        if dm.mesh.axis_size("dp") > 1:
            dist.all_reduce(loss, group=dm.mesh.group("dp"))
            loss /= dm.mesh.axis_size("dp")
        losses.append(float(loss))
    return losses


def save_job(name: str, path: str):
    """Train SPLIT steps under plan ``name``, save."""
    dm = compiled(name)
    opt = dm.optimizer(torch.optim.AdamW, lr=LR, **OPTIMIZER.get(name, {}))
    torch.manual_seed(1)
    losses = train(dm, opt, range(SPLIT))
    dm.save(path, extra={"saved under": name})
    return losses


def resume_job(name: str, paths: dict):
    """Under plan ``name``: for each saved checkpoint, load it, train the remaining steps, and
    compare losses and parameters with the uninterrupted single-device run."""
    ref_losses, ref_params = reference()
    dm = compiled(name)
    opt = dm.optimizer(torch.optim.AdamW, lr=LR, **OPTIMIZER.get(name, {}))
    out = {}
    for source, path in paths.items():
        torch.manual_seed(12345)          # the load must restore the generator
        resumed = dm.load(path)
        losses = train(dm, opt, range(resumed.step, STEPS))
        full = dm.full_state_dict()
        param_err, noise_err, worst = 0.0, 0.0, ""
        for k, v in ref_params.items():
            diff = (full[k] - v).abs()
            scaled = diff / (1e-4 + 1e-3 * v.abs())
            noise = _noise_mask(k, v)
            if (~noise).any() and float(scaled[~noise].max()) > param_err:
                param_err, worst = float(scaled[~noise].max()), k
            if noise.any():
                noise_err = max(noise_err, float(diff[noise].max()) / (2 * LR * (STEPS - SPLIT)))
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses[SPLIT:]))
        out[source] = {"step": resumed.step, "extra": resumed.extra, "losses": losses, "ref": ref_losses[SPLIT:], "loss_err": loss_err,
                       "param_err": param_err, "worst": worst, "noise_err": noise_err}
    return out


def save_twice_job(path: str) -> dict:
    """Save after one step and again, at the same path, after a second; load into a new module:
    the warnings the second save raised, and whether the load gave the second one."""
    import warnings
    dm = compiled("ddp w2")
    opt = dm.optimizer(torch.optim.AdamW, lr=LR)
    train(dm, opt, range(1))
    dm.save(path)
    train(dm, opt, range(1, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm.save(path)
    other = compiled("ddp w2")
    other.optimizer(torch.optim.AdamW, lr=LR)
    resumed = other.load(path)
    mine, theirs = dm.full_state_dict(), other.full_state_dict()
    return {"warnings": [str(w.message) for w in caught], "step": resumed.step,
            "same": all(torch.equal(mine[k], theirs[k]) for k in mine)}


def fused_resume_job(path: str) -> dict:
    """ZeRO-2 over 2 ranks with fused AdamW (which keeps ``step`` on the parameters' device):
    one module trains STEPS steps without interruption; another trains SPLIT, saves, and a
    third loads into a fresh fused AdamW and trains the rest. The load goes through
    ``Optimizer.load_state_dict`` (its post-hook fires) and leaves each ``step`` where torch's
    own load puts a fused optimizer's (float32, on its parameter's device)."""
    axes, plan = {"dp": 2}, autopar.Plan(dp="zero2")
    x, _ = batch(0)

    def build():
        dm = autopar.compile(model(), autopar.Mesh(**axes), example_inputs=(x,), plan=plan)
        return dm, dm.optimizer(torch.optim.AdamW, lr=LR, fused=True)
    whole, opt = build()
    torch.manual_seed(1)
    train(whole, opt, range(STEPS))
    first, opt = build()
    torch.manual_seed(1)
    train(first, opt, range(SPLIT))
    first.save(path)
    resumed, opt = build()
    hooked = []
    opt.register_load_state_dict_post_hook(lambda o: hooked.append(True))
    step = resumed.load(path).step
    steps = [(s["step"].dtype, s["step"].device == p.device) for p, s in opt.state.items()]
    train(resumed, opt, range(step, STEPS))
    mine, ref = resumed.full_state_dict(), whole.full_state_dict()
    return {"hooked": hooked == [True], "steps": steps, "fused": all(g["fused"] for g in opt.param_groups),
            "err": max(float((mine[k] - ref[k]).abs().max()) for k in ref)}


# ---- bad checkpoints -----------------------------------------------------------------------------

def _snapshot(dm, opt):
    params = {k: v.clone() for k, v in dm.full_state_dict().items()}
    state = {id(p): {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
             for p, s in opt.state.items()}
    return params, state, torch.get_rng_state()


def _same(a, b) -> bool:
    (pa, sa, ra), (pb, sb, rb) = a, b
    return (all(torch.equal(pa[k], pb[k]) for k in pa) and sa.keys() == sb.keys() and
            all(all(torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k] for k in x)
                for x, y in ((sa[i], sb[i]) for i in sa)) and torch.equal(ra, rb))


def bad_checkpoint_job(root: str, cases: list):
    """Load each broken checkpoint of ``cases`` (made by the test under ``root``) under zero3 w2:
    every rank must raise, and leave the module, the optimizer and the generator as they were."""
    dm = autopar.compile(model(), autopar.Mesh(dp=2), example_inputs=(batch(0)[0],), plan=autopar.Plan(dp="zero3"))
    opt = dm.optimizer(torch.optim.AdamW, lr=LR)
    torch.manual_seed(1)
    train(dm, opt, range(1))
    out = {}
    for case in cases:
        before = _snapshot(dm, opt)
        try:
            dm.load(f"{root}/{case}")
        except Exception as e:     # noqa: BLE001 - the test checks the type and text
            error = (type(e).__name__, str(e))
        else:
            error = None
        out[case] = {"error": error, "untouched": _same(before, _snapshot(dm, opt))}
        train(dm, opt, range(1, 2))     # the module still trains after a refused load
    return out


def save_for_bad(root: str):
    """The checkpoints the bad-checkpoint cases start from: ``good`` (zero3 w2, with AdamW),
    ``no_optimizer`` (the model alone), ``other_model`` (a wider GPT), ``sgd`` (another optimizer),
    ``mlp`` (another model)."""
    for what in ("good", "no_optimizer", "other_model", "sgd", "mlp"):
        _save_for_bad(root, what)


def _save_for_bad(root: str, what: str):
    if what == "mlp":
        torch.manual_seed(0)
        x = torch.randn(8, 16)
        dm = autopar.compile(TinyMLP(), autopar.Mesh(dp=2), example_inputs=(x,), plan=autopar.Plan(dp="zero3"))
        dm.optimizer(torch.optim.AdamW, lr=LR)
        dm.save(f"{root}/{what}")
        return
    cfg = CONFIG if what != "other_model" else GPTConfig(vocab=67, seq=8, dim=24, heads=2, layers=4, max_seq=8)
    torch.manual_seed(0)
    dm = autopar.compile(TinyGPT(cfg), autopar.Mesh(dp=2), example_inputs=(batch(0)[0],),
                         plan=autopar.Plan(dp="zero3"))
    opt = dm.optimizer(torch.optim.SGD if what == "sgd" else torch.optim.AdamW, lr=LR,
                       **({"momentum": 0.9} if what == "sgd" else {}))
    torch.manual_seed(1)
    train(dm, opt, range(1))
    dm.save(f"{root}/{what}", optimizer=None if what == "no_optimizer" else opt)


# ---- PyTorch and Hugging Face ------------------------------------------------------------------------

def hf_save_job(path: str):
    """A transformers GPT-2 (wrapped to return logits) under tp2, one step, saved; its full weights."""
    from jobs.hf import hf_model
    torch.manual_seed(0)
    m = hf_model("gpt2")
    x = torch.randint(0, 97, (4, 16))
    dm = autopar.compile(m, autopar.Mesh(tp=2), example_inputs=(x,), plan=autopar.Plan(tp=True))
    opt = dm.optimizer(torch.optim.AdamW, lr=LR)
    lm_loss(dm(x), x).backward()
    opt.step()
    dm.save(path)
    return {k: v.clone() for k, v in dm.full_state_dict().items()}


def mixed_save_job(path: str):
    """ZeRO-2 with bf16 compute and fp32 masters, one step, saved; the masters as the module has them."""
    dm = autopar.compile(model(), autopar.Mesh(dp=2), example_inputs=(batch(0)[0],),
                         plan=autopar.Plan(dp="zero2", param_dtype=torch.bfloat16))
    opt = dm.optimizer(torch.optim.AdamW, lr=LR)
    torch.manual_seed(1)
    train(dm, opt, range(1))
    dm.save(path)
    return {k: v.clone() for k, v in dm.full_state_dict().items()}


# ---- memory during save and load --------------------------------------------------------------------

class Layers(torch.nn.Module):
    """Equal square layers: the model is many times its largest tensor."""

    def __init__(self, width=512, depth=8):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@contextlib.contextmanager
def _works_kept():
    """Every collective handle waited on within is kept alive until the end (and freed here, on
    this thread). Under tracemalloc, a handle freed on gloo's worker thread crashes the process
    (SIGSEGV, Python 3.11): freeing its tensors takes the GIL on that thread, which makes a new
    Python thread state there, and tracemalloc, tracing that allocation, reads a thread state
    that is not there yet (``traceback_new``). Without the handles kept, about one run in four
    of this job crashes so, in a loop."""
    work = torch._C._distributed_c10d.Work
    wait, kept = work.wait, []

    def keep(self, *args, **kwargs):
        kept.append(self)
        return wait(self, *args, **kwargs)
    work.wait = keep
    try:
        yield
    finally:
        work.wait = wait
        kept.clear()


def memory_job(path: str, load_plan: str):
    """Peak memory above this rank's own pieces while it saves (ZeRO-3 over the world) and while it
    loads under ``load_plan``: tensor storage (the profiler's allocator records) plus Python
    objects (tracemalloc), each measured around the call alone."""
    import tracemalloc

    from autopar.testing import profiled_peak_bytes
    world = dist.get_world_size()
    x = torch.randn(8, 512)

    def one_step(dm):
        opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
        dm(dm.shard_batch(x)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return opt

    def peak(fn):
        """Each measured in a run of its own (their sum bounds the peak of the sum): tensors by
        the profiler, then Python objects by tracemalloc with the collectives' handles kept
        (``_works_kept``)."""
        tensors = profiled_peak_bytes(fn)
        with _works_kept():
            tracemalloc.start()
            fn()
            python = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        return tensors, python

    torch.manual_seed(0)
    dm = autopar.compile(Layers(), autopar.Mesh(dp=world), example_inputs=(x,), plan=autopar.Plan(dp="zero3"))
    one_step(dm)
    save = peak(lambda: dm.save(path))
    own_save = sum(p.numel() * p.element_size() for p in dm.parameters()) * 3     # weights, exp_avg, exp_avg_sq
    torch.manual_seed(0)
    plan = {"ddp": autopar.Plan(dp="ddp"), "zero3": autopar.Plan(dp="zero3")}[load_plan]
    dm2 = autopar.compile(Layers(), autopar.Mesh(dp=world), example_inputs=(x,), plan=plan)
    one_step(dm2)
    dist.barrier()
    load = peak(lambda: dm2.load(path))
    tensor_bytes = 512 * 512 * 4
    import os
    return {"save": save, "load": load, "tensor": tensor_bytes, "own": own_save,
            "metadata": os.path.getsize(os.path.join(path, ".metadata")),
            "model": 8 * tensor_bytes}
