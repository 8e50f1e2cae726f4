"""Data parallelism (ddp, ZeRO-1/2/3) on each rank: parity, bytes, memory, clipping, uneven
shards, meta-device models, gradient accumulation, dumps."""
from __future__ import annotations

import copy
import gc
import weakref

import torch
import torch.distributed as dist

import autopar
import autopar.api
from autopar.models import GPTConfig, TinyGPT, TinyMLP, gpt_batch, lm_loss
from autopar.testing import live_tensor_bytes, optimizer_state_bytes, parity, steady_live_bytes

from .common import MODES, mlp_batch, mse, step

def parity_all(overlap: bool = True):
    """Every dp mode on the MLP (uneven 7-row layer), the bias-free MLP and the small GPT
    (``overlap``: the plan's overlap pass on or off)."""
    world = dist.get_world_size()
    mesh = autopar.Mesh(dp=world)
    out = {}
    x, y = mlp_batch()
    c = GPTConfig()
    tok, tgt = gpt_batch(c, 8)
    for mode in MODES:
        plan = autopar.Plan(dp=mode, overlap=overlap)
        out[("mlp", mode)] = parity(TinyMLP, mesh, plan, (x,), y, mse)
        out[("gpt", mode)] = parity(lambda: TinyGPT(c), mesh, plan, (tok,), tgt, lm_loss)
    return out


def parity_world8():
    """Eight ranks: the 7-row layer leaves rank 7 without rows (an empty shard)."""
    mesh = autopar.Mesh(dp=dist.get_world_size())
    x, y = mlp_batch(16)
    c = GPTConfig()
    tok, tgt = gpt_batch(c, 8)
    out = {("mlp", m): parity(TinyMLP, mesh, autopar.Plan(dp=m), (x,), y, mse) for m in MODES}
    out[("gpt", "zero3")] = parity(lambda: TinyGPT(c), mesh, autopar.Plan(dp="zero3"), (tok,), tgt, lm_loss)
    return out


def volume_all():
    return {(model, mode): volume(mode, model) for model in ("mlp", "mlp_nobias", "gpt") for mode in MODES}


def volume(mode, model_name, batch=8):
    """Bytes this rank moved in one step (second step, after warm-up), by phase and kind.
    ``mlp_nobias`` takes an input that requires grad, so backward reads every weight."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    if model_name == "gpt":
        c = GPTConfig()
        model, (inputs, target), loss_fn = TinyGPT(c), gpt_batch(c, batch), lm_loss
        inputs = (inputs,)
    else:
        model = TinyMLP(bias=model_name != "mlp_nobias")
        x, target = mlp_batch()
        inputs, loss_fn = (x.requires_grad_(model_name == "mlp_nobias"),), mse
    dm = autopar.compile(model, autopar.Mesh(dp=world), example_inputs=inputs,
                         plan=autopar.Plan(dp=mode, bucket_bytes=1024))
    opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
    step(dm, opt, inputs, target, loss_fn)
    opt.zero_grad()
    dm.comm_stats.reset()
    step(dm, opt, inputs, target, loss_fn)
    specs = dm._sync.specs
    return {
        "bytes": dict(dm.comm_stats.bytes),
        "calls": dict(dm.comm_stats.calls),
        "total": dm.comm_stats.total(axis="dp"),
        "psi": sum(s.numel for s in specs.values()),
        "psi_padded": sum(s.padded_numel for s in specs.values()),
        "read_by_backward": sorted(dm._sync.saved_in_backward),
        "psi_read_padded": sum(specs[n].padded_numel for n in dm._sync.saved_in_backward),
        "events": list(dm._sync.events),
        "n_buckets": len(dm._sync.buckets),
        "explain": dm.explain(),
    }


class WideMLP(torch.nn.Module):
    """Parameters dominate activations, so memory tests see the ZeRO terms clearly."""

    def __init__(self, d=128, layers=4):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(layers))

    def forward(self, x):
        for lin in self.layers:
            x = torch.tanh(lin(x))
        return x


def memory_all():
    # what the imports made is set aside from the collector: each census (gc.get_objects) then
    # walks only what the jobs made, and a tensor made before is in neither the base nor a census
    gc.collect()
    gc.freeze()
    return {mode: memory(mode) for mode in MODES}


def memory(mode):
    """Per-rank bytes held after an optimizer step (before zero_grad), two ways:
    (a) the module's own tensors, (b) a census of every live tensor in the process."""
    world = dist.get_world_size()
    # compile frees the original weights export leaves in reference cycles before it returns
    # for models of COLLECT_BYTES or more (a full collection); this small one takes that path
    autopar.api.COLLECT_BYTES = 0
    torch.manual_seed(0)
    x = torch.randn(4 * world, 128)
    target = torch.randn(4 * world, 128)
    gc.collect()
    base = live_tensor_bytes()
    model = WideMLP()
    dm = autopar.compile(model, autopar.Mesh(dp=world), example_inputs=(x,), plan=autopar.Plan(dp=mode))
    original = weakref.ref(model.layers[0].weight)
    del model          # the compiled module must not keep the original alive, even before a gc pass
    original_alive = original() is not None
    gc.collect()
    opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
    local_x, local_t = dm.shard_batch(x), dm.shard_batch(target)
    out = dm(local_x)
    after_forward = live_tensor_bytes() - base
    sync = dm._sync      # ZeRO-3: the gathers issued for backward as forward ended, and the unit sizes
    ahead_after_forward = sum(sync.unit_bytes(k) for k in sync._inflight) if mode == "zero3" else 0
    unit_bytes = [sync.unit_bytes(k) for k in range(len(sync.units))] if mode == "zero3" else [0]
    loss = mse(out, local_t)
    del out
    loss.backward()
    del loss
    opt.step()
    # a synchronous gloo collective returns once its data has arrived, but gloo's worker thread
    # may drop its reference to the buffers a moment later (they stay visible to the census
    # until then): the steady state is the smallest of a few samples, and a real leak persists
    census = steady_live_bytes() - base
    sync = dm._sync
    storages = {}
    for p in dm.parameters():
        storages[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
        if p.grad is not None:
            storages[p.grad.untyped_storage().data_ptr()] = p.grad.untyped_storage().nbytes()
    for t in list(sync._replicas.values()) + list(sync._persistent.values()):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    psi = sum(s.numel for s in sync.specs.values())
    return {
        "psi": psi,
        "module_bytes": sum(storages.values()),
        "opt_bytes": optimizer_state_bytes(opt),
        "census": census,
        "after_forward": after_forward,
        "ahead_after_forward": ahead_after_forward,
        "unit_bytes": unit_bytes,
        "local_batch_bytes": local_x.numel() * 4 * 2,
        "original_alive": original_alive,
    }


def clip_all():
    return {mode: clip_and_grads(mode) for mode in MODES}


def clip_and_grads(mode):
    """clip_grad_norm_ returns the true global norm and clips like the single-device model."""
    torch.manual_seed(0)
    ref = TinyMLP()
    x, y = mlp_batch()
    dm = autopar.compile(copy.deepcopy(ref), autopar.Mesh(dp=dist.get_world_size()), example_inputs=(x,),
                         plan=autopar.Plan(dp=mode))
    mse(ref(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    mse(dm(dm.shard_batch(x)), dm.shard_batch(y)).backward()
    norm = dm.clip_grad_norm_(0.05)
    grads = dm.full_grads()
    err = max(float((grads[k] - p.grad).abs().max()) for k, p in ref.named_parameters())
    # the max-norm too (max_norm large: measures without clipping)
    ref_inf = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9, norm_type=float("inf"))
    inf = dm.clip_grad_norm_(1e9, norm_type=float("inf"))
    err = max(err, abs(float(ref_inf) - float(inf)))
    return float(ref_norm), float(norm), err


def uneven_shards():
    """A 7-row parameter over the axis: shard shapes and the gathered full tensor."""
    world = dist.get_world_size()
    x, _ = mlp_batch()
    torch.manual_seed(0)
    model = TinyMLP()
    full = model.fc2.weight.detach().clone()
    dm = autopar.compile(model, autopar.Mesh(dp=world), example_inputs=(x,), plan=autopar.Plan(dp="zero3"))
    shard = dm.module.get_parameter("fc2.weight")
    gathered = dm.full_state_dict()["fc2.weight"]
    return tuple(shard.shape), bool(torch.equal(gathered, full))


def meta_materialise():
    """A model built on the meta device compiles without memory, then loads real weights."""
    torch.manual_seed(0)
    real = TinyMLP()
    x, y = mlp_batch()
    out = {}
    for mode in MODES:
        with torch.device("meta"):
            model = TinyMLP()
        dm = autopar.compile(model, autopar.Mesh(dp=dist.get_world_size()),
                             example_inputs=(torch.empty(8, 16, device="meta"),), plan=autopar.Plan(dp=mode))
        dm.to_empty(device="cpu")
        dm.load_full_state_dict(real.state_dict())
        local = dm.shard_batch(x)
        opt = dm.optimizer(torch.optim.SGD, lr=0.1)
        mse(dm(local), dm.shard_batch(y)).backward()
        opt.step()
        out[mode] = (float((dm(local) - real(local)).abs().max()), dm.full_state_dict())
    return out


def accumulation_all():
    """Two backward passes (micro-batches, no zero_grad between) accumulate into the same
    gradients as one pass over the whole batch; a backward through two forwards is refused
    (its bucket went out with the first forward's gradients, as DDP refuses)."""
    world = dist.get_world_size()
    x, y = mlp_batch(8 * world)
    out = {}
    for mode in MODES:
        torch.manual_seed(0)
        ref = TinyMLP()
        mse(ref(x), y).backward()
        dm = autopar.compile(copy.deepcopy(ref), autopar.Mesh(dp=world), example_inputs=(x[: 4 * world],),
                             plan=autopar.Plan(dp=mode))
        lx, ly = x.view(2, 4 * world, 16), y.view(2, 4 * world, 16)
        for m in range(2):   # the global batch as two micro-batches, each rank its slice of each
            (mse(dm(dm.shard_batch(lx[m])), dm.shard_batch(ly[m])) / 2).backward()
        grads = dm.full_grads()
        err = max(float((grads[k] - p.grad).abs().max()) for k, p in ref.named_parameters())
        with torch.no_grad():   # evaluation: no autograd graph, ZeRO-3 still gathers
            local = dm.shard_batch(lx[0])
            err = max(err, float((dm(local) - ref(local)).abs().max()))
        try:
            a = dm(dm.shard_batch(lx[0]))
            b = dm(dm.shard_batch(lx[1]))
            (mse(a, dm.shard_batch(ly[0])) + mse(b, dm.shard_batch(ly[1]))).backward()
            grads = dm.full_grads()   # accepted: ref + 2 ref (the two unscaled halves)
            twice = max(float((grads[k] - 3 * p.grad).abs().max()) for k, p in ref.named_parameters())
        except RuntimeError as e:
            twice = str(e)
        out[mode] = (err, twice)
    return out


def dump_and_explain(mode, out_dir):
    world = dist.get_world_size()
    c = GPTConfig()
    tok, tgt = gpt_batch(c, 8)
    torch.manual_seed(0)
    dm = autopar.compile(TinyGPT(c), autopar.Mesh(dp=world), example_inputs=(tok,), plan=autopar.Plan(dp=mode))
    before = dm.explain()
    opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
    dm.comm_stats.reset()
    step(dm, opt, (tok,), tgt, lm_loss)
    after = dm.explain()
    files = dm.dump(f"{out_dir}/rank{dist.get_rank()}")
    return before, after, files
