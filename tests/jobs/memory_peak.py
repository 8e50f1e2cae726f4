"""Peak memory during a training step (forward + backward + optimizer step), per rank: what
lives between steps (the census after zero_grad) plus the profiler's peak of what the step
allocates on top (``autopar.measure.peak_of``, which compiles and measures the step as the
hold-out harness does)."""
from __future__ import annotations

import dataclasses
import gc

import torch
import torch.distributed as dist

import autopar
from autopar.measure import STEPS, collectives_settled, compiled_body, peak_of
from autopar.models import GPTConfig, TinyGPT, gpt_batch, lm_loss
from autopar.testing import saved_activation_bytes

# parameters dominate this GPT's memory (the gradients are what ZeRO-2 frees as it reduces)
PARAM_HEAVY = GPTConfig(vocab=128, seq=8, dim=128, heads=4, layers=4, max_seq=8)
PARAM_HEAVY_BATCH = 4
BUCKET_BYTES = 256 << 10


def prepared(config, batch, axes, kw, *, hold_reduced=False, seed=0):
    """(body: forward, backward, optimizer step; dm; opt) of ``TinyGPT(config)`` under ``kw``."""
    torch.manual_seed(seed)
    model = TinyGPT(config)
    return compiled_body(model, gpt_batch(config, batch), axes, kw, hold_reduced=hold_reduced)


def dp_peaks(modes=("ddp", "zero1", "zero2", "zero3")) -> dict:
    """The param-heavy GPT at dp = world under each mode (small buckets), and ZeRO-2 again with
    the reducer holding every bucket to the end of backward."""
    torch.set_num_threads(1)
    world = dist.get_world_size()
    out = {}
    for mode in modes:
        body, dm, opt = prepared(PARAM_HEAVY, PARAM_HEAVY_BATCH, {"dp": world},
                                 {"dp": mode, "bucket_bytes": BUCKET_BYTES})
        out[mode] = peak_of(body, opt, dm)
        out[mode]["psi"] = sum(p.numel() for p in TinyGPT(PARAM_HEAVY).parameters())
        del body, dm, opt
        gc.collect()
    body, dm, opt = prepared(PARAM_HEAVY, PARAM_HEAVY_BATCH, {"dp": world},
                             {"dp": "zero2", "bucket_bytes": BUCKET_BYTES}, hold_reduced=True)
    out["zero2 holding"] = peak_of(body, opt, dm)
    return out


def saved_bytes_per_layer_all(config, batch, cases) -> list:
    """``saved_bytes_per_layer`` of each (mesh axes, plan kwargs), in one process."""
    return [saved_bytes_per_layer(config, batch, axes, kw) for axes, kw in cases]


def saved_bytes_per_layer(config, batch, axes, kw) -> dict:
    """Bytes autograd saves for backward in one forward of the compiled GPT, and the same with
    one more layer (the difference is one layer's), parameters excluded."""
    torch.set_num_threads(1)
    out = {}
    for layers in (config.layers, config.layers + 1):
        c = GPTConfig(**{**config.__dict__, "layers": layers})
        body, dm, opt = prepared(c, batch, axes, kw)
        x, _ = gpt_batch(c, batch)
        lx = dm.shard_batch((x,))
        params = {p.untyped_storage().data_ptr() for p in dm.parameters()}
        params |= {b.untyped_storage().data_ptr() for b in dm.buffers()}
        out[layers] = saved_activation_bytes(lambda m=dm: m(*lx), exclude=params)
        del body, dm, opt
        gc.collect()
    return out


# activations dominate this GPT's memory (what recomputation trades for compute)
ACTIVATION_HEAVY = GPTConfig(vocab=64, seq=32, dim=64, heads=4, layers=2, max_seq=32, dropout=0.1)
ACTIVATION_HEAVY_BATCH = 16


def plan_peaks(cases, config=ACTIVATION_HEAVY, batch=ACTIVATION_HEAVY_BATCH, steps: int = STEPS) -> dict:
    """The step's peak of each (name, mesh axes, plan kwargs), each compiled alone in turn
    (``steps`` profiled steps each, ``peak_of``)."""
    torch.set_num_threads(1)
    out = {}
    for name, axes, kw in cases:
        body, dm, opt = prepared(config, batch, axes, kw)
        out[name] = peak_of(body, opt, dm, steps)
        out[name]["recomputed"] = sorted((m.layer, m.kind) for m in dm.modules() if hasattr(m, "recomputes"))
        del body, dm, opt
        gc.collect()
    return out


def depth_peaks(cases, depths, config, batch, steps: int = 2) -> dict:
    """``plan_peaks`` of the same GPT at each number of layers in ``depths`` (depth -> name ->
    peak), collectives settled (``collectives_settled``): the peaks of two depths differ by
    what each layer holds, to the byte, and a plan's steps agree to the byte (``steps``
    profiled steps each; 2: a step where the profiler missed a free reads higher, and the
    smaller is kept)."""
    with collectives_settled():
        return {n: plan_peaks(cases, dataclasses.replace(config, layers=n), batch, steps) for n in depths}


def auto_plan_peak(cluster, config=ACTIVATION_HEAVY, batch=ACTIVATION_HEAVY_BATCH) -> dict:
    """``compile(plan="auto")`` for ``cluster`` on this world's dp axis: the plan it chose and
    the step's measured peak."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, t = gpt_batch(config, batch)
    dm = autopar.compile(TinyGPT(config), autopar.Mesh(dp=dist.get_world_size()), example_inputs=(x,),
                         plan="auto", cluster=cluster)
    opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
    lx, lt = dm.shard_batch((x,)), dm.shard_batch(t)

    def body():
        loss = lm_loss(dm(*lx), lt)
        loss.backward()
        del loss
        opt.step()
    out = peak_of(body, opt, dm)
    out["plan"] = str(dm.plan)
    out["recomputed"] = sorted((m.layer, m.kind) for m in dm.modules() if hasattr(m, "recomputes"))
    return out


def microbatch_peaks(kw, counts, rows: int, config) -> dict:
    """The step's peak (``peak_of``) of ``TinyGPT(config)`` on pp = world under plan ``kw`` at
    each number of micro-batches in ``counts``, every micro-batch ``rows`` rows (the global
    batch grows with the count)."""
    torch.set_num_threads(1)
    out = {}
    for m in counts:
        body, dm, opt = prepared(config, m * rows, {"pp": dist.get_world_size()}, {**kw, "microbatches": m})
        out[m] = peak_of(body, opt, dm)
        del body, dm, opt
        gc.collect()
    return out
