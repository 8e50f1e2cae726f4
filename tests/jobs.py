"""Rank functions for the distributed tests (module level, so spawned processes import them)."""
from __future__ import annotations

import copy
import gc
import json
import os
import tempfile
import time
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
from autopar.models import GPTConfig, TinyGPT, TinyMLP, gpt_batch, lm_loss
from autopar.testing import live_tensor_bytes, optimizer_state_bytes, parity

MODES = ("ddp", "zero1", "zero2", "zero3")


def mse(out, target):
    return F.mse_loss(out, target)


def mlp_batch(batch=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 16, generator=g), torch.randn(batch, 16, generator=g)


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


def _step(dm, opt, inputs, target, loss_fn):
    out = dm(*dm.shard_batch(inputs))
    loss = loss_fn(out, dm.shard_batch(target))
    loss.backward()
    opt.step()
    return loss.detach()


def volume_all():
    return {(model, mode): volume(mode, model) for model in ("mlp", "mlp_nobias", "gpt") for mode in MODES}


def volume(mode, model_name):
    """Bytes this rank moved in one step (second step, after warm-up), by phase and kind.
    ``mlp_nobias`` takes an input that requires grad, so backward reads every weight."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    if model_name == "gpt":
        c = GPTConfig()
        model, (inputs, target), loss_fn = TinyGPT(c), gpt_batch(c, 8), lm_loss
        inputs = (inputs,)
    else:
        model = TinyMLP(bias=model_name != "mlp_nobias")
        x, target = mlp_batch()
        inputs, loss_fn = (x.requires_grad_(model_name == "mlp_nobias"),), mse
    dm = autopar.compile(model, autopar.Mesh(dp=world), example_inputs=inputs,
                         plan=autopar.Plan(dp=mode, bucket_bytes=1024))
    opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
    _step(dm, opt, inputs, target, loss_fn)
    opt.zero_grad()
    dm.comm_stats.reset()
    _step(dm, opt, inputs, target, loss_fn)
    specs = dm._sync.specs
    return {
        "bytes": dict(dm.comm_stats.bytes),
        "calls": dict(dm.comm_stats.calls),
        "total": dm.comm_stats.total(axis="dp"),
        "psi": sum(s.numel for s in specs.values()),
        "psi_padded": sum(s.n * s.chunk_numel for s in specs.values()),
        "read_by_backward": sorted(dm._sync.saved_in_backward),
        "psi_read_padded": sum(specs[n].n * specs[n].chunk_numel for n in dm._sync.saved_in_backward),
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
    return {mode: memory(mode) for mode in MODES}


def _census_sample(i: int) -> int:
    if i:
        time.sleep(0.05)
    return live_tensor_bytes()


def memory(mode):
    """Per-rank bytes held after an optimizer step (before zero_grad), two ways:
    (a) the module's own tensors, (b) a census of every live tensor in the process."""
    world = dist.get_world_size()
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
    census = min(_census_sample(i) for i in range(5)) - base
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


def comm_functions():
    """The autograd-aware collectives and their conjugate backward, with byte counts."""
    from autopar.runtime.comm import AxisComm, CommStats, all_gather, all_reduce, copy_to_axis, reduce_scatter
    world, rank = dist.get_world_size(), dist.get_rank()
    stats = CommStats()
    comm = AxisComm("dp", world, rank, dist.group.WORLD, stats)
    res = {}
    x = torch.arange(6.0).reshape(2, 3).add(10 * rank).requires_grad_()
    y = all_gather(x, comm, dim=1)                       # (2, 3*world)
    (y * torch.arange(y.numel(), dtype=torch.float32).view_as(y)).sum().backward()
    res["ag"], res["ag_grad"] = y.detach(), x.grad.clone()
    z = torch.ones(4 * world, 2).mul(rank + 1).requires_grad_()
    s = reduce_scatter(z, comm, dim=0)                  # (4, 2)
    s.sum().backward()
    res["rs"], res["rs_grad"] = s.detach(), z.grad.clone()
    a = torch.full((3,), float(rank + 1), requires_grad=True)
    r = all_reduce(a, comm)
    (r * 2).sum().backward()
    res["ar"], res["ar_grad"] = r.detach(), a.grad.clone()
    b = torch.ones(3, requires_grad=True)
    c = copy_to_axis(b, comm)
    (c * (rank + 1)).sum().backward()
    res["f_grad"] = b.grad.clone()
    res["bytes"] = dict(stats.bytes)
    return res


def mesh_mismatch():
    try:
        autopar.Mesh(dp=dist.get_world_size() * 2)
    except ValueError as e:
        return str(e)
    return None


def stale_shards():
    """ZeRO-2 with a stock optimizer: forward refuses stale replicas instead of running."""
    x, y = mlp_batch()
    dm = autopar.compile(TinyMLP(), autopar.Mesh(dp=dist.get_world_size()), example_inputs=(x,),
                         plan=autopar.Plan(dp="zero2"))
    opt = torch.optim.SGD(dm.parameters(), lr=0.1)
    mse(dm(dm.shard_batch(x)), dm.shard_batch(y)).backward()
    opt.step()
    try:
        dm(dm.shard_batch(x))
    except RuntimeError as e:
        return str(e)
    return None


def clip_all():
    return {mode: clip_and_grads(mode) for mode in MODES}


def clip_and_grads(mode):
    """clip_grad_norm_ returns the true global norm and clips like the single-device model."""
    torch.manual_seed(0)
    ref = TinyMLP()
    x, y = mlp_batch()
    import copy
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


def dump_and_explain(mode, out_dir):
    world = dist.get_world_size()
    c = GPTConfig()
    tok, tgt = gpt_batch(c, 8)
    torch.manual_seed(0)
    dm = autopar.compile(TinyGPT(c), autopar.Mesh(dp=world), example_inputs=(tok,), plan=autopar.Plan(dp=mode))
    before = dm.explain()
    opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
    dm.comm_stats.reset()
    _step(dm, opt, (tok,), tgt, lm_loss)
    after = dm.explain()
    files = dm.dump(f"{out_dir}/rank{dist.get_rank()}")
    return before, after, files


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
    import copy
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


class LogitsOf(torch.nn.Module):
    """A Hugging Face causal LM as tokens -> logits (use_cache off, so export sees no cache)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, tokens):
        return self.lm(input_ids=tokens, use_cache=False).logits


def hf_model(name):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    if name == "gpt2":
        cfg = GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
                         eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return LogitsOf(GPT2LMHeadModel(cfg))
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LogitsOf(LlamaForCausalLM(cfg))


def hf_parity_all():
    """Hugging Face GPT-2 and Llama built from small random configs (no downloads)."""
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 97, (4 * world, 17), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return {(name, mode): parity(lambda: hf_model(name), autopar.Mesh(dp=world), autopar.Plan(dp=mode),
                                 (x,), y, lm_loss, eps=HF_ADAM_EPS)
            for name in ("gpt2", "llama") for mode in MODES}


# Adam's eps sets how far it amplifies a gradient that is float noise: at the default 1e-8 a
# gradient of 1e-9 (an element that is zero in exact arithmetic, summed in another order)
# becomes a step of 0.1 lr, and in GPT-2 and Llama enough such elements move to shift the next
# step's gradients by 1e-3 relative. 1e-6 keeps noise below 1e-3 lr, while a gradient of 1e-5
# still takes a full Adam step, so the comparison tests the implementation, not the noise.
HF_ADAM_EPS = 1e-6


def parity_world8():
    """Eight ranks: the 7-row layer leaves rank 7 without rows (an empty shard)."""
    mesh = autopar.Mesh(dp=dist.get_world_size())
    x, y = mlp_batch(16)
    c = GPTConfig()
    tok, tgt = gpt_batch(c, 8)
    out = {("mlp", m): parity(TinyMLP, mesh, autopar.Plan(dp=m), (x,), y, mse) for m in MODES}
    out[("gpt", "zero3")] = parity(lambda: TinyGPT(c), mesh, autopar.Plan(dp="zero3"), (tok,), tgt, lm_loss)
    return out


# ---- tensor parallelism ----------------------------------------------------------------------

def tp_mesh(tp: int):
    world = dist.get_world_size()
    return autopar.Mesh(dp=world // tp, tp=tp) if world > tp else autopar.Mesh(tp=tp)


def parity_tp(tp: int, sp: bool, modes=("ddp",), models=("mlp", "gpt"), plan_kw=None):
    """MLP and GPT under tensor (and sequence) parallelism, with each dp mode in ``modes``
    (``plan_kw``: more Plan fields, e.g. overlap=False, collective_matmul=True)."""
    plan_kw = plan_kw or {}
    mesh = tp_mesh(tp)
    out = {}
    x, y = mlp_batch()
    c = GPTConfig()
    tok, tgt = gpt_batch(c, 8)
    for mode in modes:
        plan = autopar.Plan(dp=mode, tp=True, sp=sp, **plan_kw)
        if "mlp" in models:
            out[("mlp", mode)] = parity(TinyMLP, mesh, plan, (x,), y, mse)
        if "gpt" in models:
            out[("gpt", mode)] = parity(lambda: TinyGPT(c), mesh, plan, (tok,), tgt, lm_loss)
    return out


def hf_parity_tp(modes=("ddp",), sps=(False, True)):
    """Hugging Face GPT-2 (fused c_attn, Conv1D addmm) and Llama (grouped-query attention,
    rotary embeddings, RMSNorm, SwiGLU) on Mesh(dp=2, tp=2), tensor and sequence parallel."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 97, (8, 17), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    mesh = autopar.Mesh(dp=2, tp=2)
    return {(name, mode, sp): parity(lambda: hf_model(name), mesh, autopar.Plan(dp=mode, tp=True, sp=sp),
                                     (x,), y, lm_loss, eps=HF_ADAM_EPS)
            for name in ("gpt2", "llama") for mode in modes for sp in sps}


def tp_volume(sp: bool):
    """Bytes the tp axis moved in one training step of the GPT with 1 and with 2 layers: their
    difference is one layer's traffic. Also the batch, sequence and width for the formula."""
    t = dist.get_world_size()
    out = {}
    for layers in (1, 2):
        c = GPTConfig(layers=layers)
        tok, tgt = gpt_batch(c, 8)
        torch.manual_seed(0)
        dm = autopar.compile(TinyGPT(c), autopar.Mesh(tp=t), example_inputs=(tok,),
                             plan=autopar.Plan(tp=True, sp=sp))
        opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
        _step(dm, opt, (tok,), tgt, lm_loss)
        dm.comm_stats.reset()
        _step(dm, opt, (tok,), tgt, lm_loss)
        out[layers] = {"total": dm.comm_stats.total(axis="tp"), "bytes": dict(dm.comm_stats.bytes),
                       "calls": dict(dm.comm_stats.calls)}
    out["bsh"] = (8, c.seq, c.dim)
    return out


def saved_activation_bytes(fn, exclude) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn`` runs, leaving
    out the storages in ``exclude`` (parameters: saved by reference, not activations)."""
    seen, total, held = set(exclude), [0], []

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            held.append(st)    # alive until the count is done, so no address is reused meanwhile
            total[0] += st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total[0]


def tp_activation_memory():
    """Per-layer bytes saved for backward (the difference between the GPT with 2 and with 1
    layers), on one device and per rank under tp and tp+sp."""
    t = dist.get_world_size()
    out = {}
    for layers in (1, 2):
        c = GPTConfig(layers=layers)
        tok, _ = gpt_batch(c, 8)
        torch.manual_seed(0)
        ref = TinyGPT(c)
        params = {p.untyped_storage().data_ptr() for p in ref.parameters()}
        out[("single", layers)] = saved_activation_bytes(lambda: ref(tok), params)
        for name, sp in (("tp", False), ("tp+sp", True)):
            dm = autopar.compile(TinyGPT(c), autopar.Mesh(tp=t), example_inputs=(tok,),
                                 plan=autopar.Plan(tp=True, sp=sp))
            params = {p.untyped_storage().data_ptr() for p in dm.parameters()}
            out[(name, layers)] = saved_activation_bytes(lambda: dm(tok), params)
    out["sbh"] = (c.seq, 8, c.dim)
    return {k: (out[(k, 2)] - out[(k, 1)]) for k in ("single", "tp", "tp+sp")} | {"sbh": out["sbh"]}


class GPTWithLoss(torch.nn.Module):
    """The small GPT with its loss in the graph (what vocabulary parallelism needs)."""

    def __init__(self, c):
        super().__init__()
        self.gpt = TinyGPT(c)

    def forward(self, idx, targets):
        return lm_loss(self.gpt(idx), targets)


def parity_vocab_parallel():
    """Tied embedding/LM head split along the vocabulary (67 rows: uneven over 2 and 4) and
    the cross-entropy computed on the split logits; tp and tp+sp, tp = world size."""
    t = dist.get_world_size()
    c = GPTConfig()
    tok, tgt = gpt_batch(c, 8)
    out = {}
    for sp in (False, True):
        out[sp] = parity(lambda: GPTWithLoss(c), autopar.Mesh(tp=t), autopar.Plan(tp=True, sp=sp),
                         (tok, tgt), tgt, lambda loss, _: loss)
        torch.manual_seed(0)
        dm = autopar.compile(GPTWithLoss(c), autopar.Mesh(tp=t), example_inputs=(tok, tgt),
                             plan=autopar.Plan(tp=True, sp=sp))
        out[("table", sp)] = tuple(dm.module.get_parameter("gpt.wte.weight").shape)
    return out


class CumsumMLP(torch.nn.Module):
    """A column-parallel product feeding an op the rule registry has no rule for (cumsum)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        return self.b(torch.cumsum(self.a(x), -1))


class RowThenColumn(torch.nn.Module):
    """A row-parallel product read directly by a column-parallel one: g, then f."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16, bias=False), torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.c(self.b(F.gelu(self.a(x))))


def parity_small_tp():
    x, y = mlp_batch()
    mesh, plan = autopar.Mesh(tp=dist.get_world_size()), autopar.Plan(tp=True)
    return {"cumsum": parity(CumsumMLP, mesh, plan, (x,), y, mse),
            "row_then_column": parity(RowThenColumn, mesh, plan, (x,), y, mse)}


# ---- pipeline parallelism ------------------------------------------------------------------------

class SkipMLP(torch.nn.Module):
    """A long skip connection: the first activation is read again by the last layer, so a
    pipeline passes it through every stage in between."""

    def __init__(self, d=24, layers=6):
        super().__init__()
        self.inp = torch.nn.Linear(d, d)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(layers))
        self.out = torch.nn.Linear(d, d)

    def forward(self, x):
        x0 = torch.tanh(self.inp(x))
        h = x0
        for lin in self.layers:
            h = h + torch.tanh(lin(h))
        return self.out(h + x0)


def _report(rep, label):
    return {"label": label, "ok": rep.ok, "loss_err": rep.loss_err, "grad_err": rep.grad_err,
            "param_err": rep.param_err, "losses": rep.losses, "ref_losses": rep.ref_losses,
            "messages": rep.messages}


def parity_pp(configs):
    """Parity of pipelined plans: ``configs`` = [(model, mesh axes, plan kwargs), ...]."""
    torch.set_num_threads(1)
    out = []
    for model, axes, kw in configs:
        mesh = autopar.Mesh(**axes)
        plan = autopar.Plan(**kw)
        if model == "gpt":
            c = GPTConfig(layers=4)
            x, t = gpt_batch(c, 16)
            rep = parity(lambda: TinyGPT(c), mesh, plan, (x,), t, _lm)
        else:
            torch.manual_seed(1)
            x, t = torch.randn(16, 24), torch.randn(16, 24)
            rep = parity(lambda: SkipMLP(), mesh, plan, (x,), t, F.mse_loss)
        out.append(_report(rep, f"{model} {mesh} {plan}"))
    return out


def _lm(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class HeavyMLP(torch.nn.Module):
    """Identical wide layers: stages of equal, measurable compute (for the bubble)."""

    def __init__(self, d=768, layers=8):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(d))
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(layers))

    def forward(self, x):
        x = x * self.scale      # the first matmul's input carries a gradient: equal backward work per stage
        for lin in self.layers:
            x = torch.tanh(lin(x))
        return x


def pp_bubble(schedules, m=4, rows=256, d=768, steps=9):
    """Measured per-rank timeline of pipelined steps: bubble = 1 - busy / makespan per rank,
    makespan from the first compute start to the last compute end over the pipeline's ranks
    (one wall clock: the processes share the machine). The median of ``steps`` steps after a
    warm-up step is kept."""
    torch.set_num_threads(1)
    p = dist.get_world_size()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= p:     # one core per stage: no migrations between the two
        os.sched_setaffinity(0, {cpus[dist.get_rank()]})
    torch.manual_seed(0)
    x, t = torch.randn(rows * m, d), torch.randn(rows * m, d)
    out = {}
    for name in schedules:
        dm = autopar.compile(HeavyMLP(d), autopar.Mesh(pp=p), example_inputs=(x,),
                             plan=autopar.Plan(pp_schedule=name, microbatches=m))
        opt = torch.optim.SGD(dm.parameters(), lr=1e-4)
        samples = []
        for step in range(steps + 1):
            dist.barrier()
            opt.zero_grad()
            dm.train_step((x,), t, F.mse_loss)
            opt.step()
            rows_ = [None] * p
            dist.all_gather_object(rows_, dm.timeline)
            if step == 0:
                continue
            start = min(a for tl in rows_ for _, a, _ in tl)
            end = max(b for tl in rows_ for _, _, b in tl)
            bubbles = [1 - sum(b - a for _, a, b in tl) / (end - start) for tl in rows_]
            samples.append({"bubble": sum(bubbles) / p, "per_rank": bubbles, "makespan": end - start})
        samples.sort(key=lambda r: r["bubble"])
        best = dict(samples[len(samples) // 2])      # the median step
        best["all"] = [r["bubble"] for r in samples]
        path = tempfile.mkdtemp() if dist.get_rank() == 0 else None
        files = dm.dump(path or tempfile.mkdtemp())      # collective over pp: the measured trace
        with open(next(f for f in files if f.endswith("/trace.json"))) as f:
            best["trace"] = json.load(f)
        out[name] = best
    return out


def pp_bytes(m=4):
    """Bytes a pipelined GPT sends point to point in one step, with what the formula needs."""
    torch.set_num_threads(1)
    c = GPTConfig(layers=4)
    x, t = gpt_batch(c, 8)
    dm = autopar.compile(TinyGPT(c), autopar.Mesh(pp=dist.get_world_size()), example_inputs=(x,),
                         plan=autopar.Plan(pp_schedule="1f1b", microbatches=m))
    dm.train_step((x,), t, _lm)
    dm.comm_stats.reset()
    dm.train_step((x,), t, _lm)
    return {"bytes": {k: v for k, v in dm.comm_stats.bytes.items() if k[0] == "pp"},
            "calls": {k: v for k, v in dm.comm_stats.calls.items() if k[0] == "pp"},
            "residual_bytes": 8 * c.seq * c.dim * 4, "stage_sends": [s.send_bytes for s in dm.ctx.stages]}


def pp_clip_and_state(plan_kwargs):
    """clip_grad_norm_, full_grads and load/full_state_dict of a pipelined module against the
    single-device model (the norm over every stage, tied weight counted once)."""
    torch.set_num_threads(1)
    c = GPTConfig(layers=4)
    x, t = gpt_batch(c, 8)
    torch.manual_seed(0)
    ref = TinyGPT(c)
    mesh = autopar.Mesh(pp=2, dp=dist.get_world_size() // 2)
    dm = autopar.compile(copy.deepcopy(ref), mesh, example_inputs=(x,), plan=autopar.Plan(**plan_kwargs))
    _lm(ref(x), t).backward()
    norm_ref = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1))
    dm.train_step((dm.shard_batch(x),), dm.shard_batch(t), _lm)
    norm = float(dm.clip_grad_norm_(0.1))
    grads = dm.full_grads()
    grad_err = max(float((grads[k] - p.grad).abs().max()) for k, p in ref.named_parameters())
    state = dm.full_state_dict()
    dm.load_full_state_dict({k: v * 2 for k, v in state.items()})
    again = dm.full_state_dict()
    load_err = max(float((again[k] - 2 * state[k]).abs().max()) for k in state)
    return {"norm": norm, "norm_ref": norm_ref, "grad_err": grad_err, "load_err": load_err,
            "keys": sorted(state) == sorted(ref.state_dict())}


# ---- predictions against measurements (issue 5) -------------------------------------------------

PREDICT_CONFIG = GPTConfig(vocab=67, seq=32, dim=64, heads=4, layers=4, max_seq=32)
PREDICT_BATCH = 16
# (name, mesh axes, plan keyword arguments): the plans of the earlier issues at world 4
PREDICT_PLANS = (
    ("ddp", {"dp": 4}, {"dp": "ddp"}),
    ("zero1", {"dp": 4}, {"dp": "zero1"}),
    ("zero2", {"dp": 4}, {"dp": "zero2"}),
    ("zero3", {"dp": 4}, {"dp": "zero3"}),
    ("tp", {"dp": 2, "tp": 2}, {"dp": "ddp", "tp": True}),
    ("tp+sp", {"dp": 2, "tp": 2}, {"dp": "zero2", "tp": True, "sp": True}),
    ("pp 1f1b", {"pp": 2, "dp": 2}, {"dp": "ddp", "pp_schedule": "1f1b", "microbatches": 4}),
    ("pp interleaved", {"pp": 2, "dp": 2}, {"dp": "zero1", "pp_schedule": "interleaved", "microbatches": 4,
                                            "virtual_stages": 2}),
    ("pp zero_bubble", {"pp": 4}, {"dp": "ddp", "pp_schedule": "zero_bubble", "microbatches": 4}),
)


def profiled_peak_bytes(fn) -> int:
    """Peak of (allocated - freed) bytes of tensor storage while ``fn`` runs, from the
    profiler's allocator records ([memory] events): the CPU has no allocator peak counter."""
    from torch.autograd.profiler import profile as _profile
    with _profile(profile_memory=True, use_kineto=True) as prof:
        fn()
    events = sorted((e for e in prof.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def measured_plans(names=None, steps=7, extra=()):
    """Bytes per step, peak memory and step time of each plan in PREDICT_PLANS (and ``extra``
    (name, axes, plan kwargs) ones) on this rank."""
    torch.set_num_threads(1)
    out = {}
    for name, axes, kw in tuple(PREDICT_PLANS) + tuple(extra):
        if names is not None and name not in names:
            continue
        out[name] = measured_plan(axes, kw, steps)
    return out


def measured_plan(axes, kw, steps):
    c = PREDICT_CONFIG
    torch.manual_seed(0)
    model = TinyGPT(c)
    x, t = gpt_batch(c, PREDICT_BATCH)
    plan = autopar.Plan(**kw)
    dm = autopar.compile(model, autopar.Mesh(**axes), example_inputs=(x,), plan=plan)
    del model
    opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
    lx, lt = dm.shard_batch((x,)), dm.shard_batch(t)

    def body():
        if plan.pp_schedule:
            dm.train_step(lx, lt, _lm)
        else:
            loss = _lm(dm(*lx), lt)
            loss.backward()
            del loss
        opt.step()

    def step():
        opt.zero_grad(set_to_none=True)
        body()

    for _ in range(2):
        step()
    dm.comm_stats.reset()
    step()
    nbytes = dm.comm_stats.total()
    by_axis = {a: dm.comm_stats.total(axis=a) for a in ("dp", "tp", "pp")}
    # peak: what lives between steps (after zero_grad: parameters, optimizer state, persistent
    # buffers) plus the most the step allocates on top; the profiler cannot see frees of blocks
    # allocated before it started, so nothing older than the census is freed inside the window
    opt.zero_grad(set_to_none=True)
    gc.collect()
    base = min(_census_sample(i) for i in range(3))
    peaks = [base + profiled_peak_bytes(body) for _ in range(3)]   # the steady state: the median of three
    peak = sorted(peaks)[1]
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    dist.barrier()
    return {"bytes": nbytes, "by_axis": by_axis, "peak": peak, "peaks": peaks, "base": base, "times": times}


def auto_plan_uncalibrated():
    """compile(plan='auto') in a rank (a daemonic process) with no cached calibration."""
    x, _ = mlp_batch()
    try:
        autopar.compile(TinyMLP(), autopar.Mesh(dp=dist.get_world_size()), example_inputs=(x,))
    except ValueError as exc:
        return str(exc)
    return "compiled"


# ---- issue 6: the overlap pass ---------------------------------------------------------------

def order_mismatch():
    """Rank 1 compiles a GPT with one layer more than rank 0's, under ddp, zero3 and tp: each
    compile must fail on every rank with the first differing collective, never hang."""
    torch.set_num_threads(1)
    c = GPTConfig(layers=2 + dist.get_rank())
    tok, _ = gpt_batch(c, 8)
    out = {}
    for name, mesh, plan in (("ddp", autopar.Mesh(dp=2), autopar.Plan(dp="ddp")),
                             ("zero3", autopar.Mesh(dp=2), autopar.Plan(dp="zero3")),
                             ("tp", autopar.Mesh(tp=2), autopar.Plan(tp=True))):
        try:
            autopar.compile(TinyGPT(c), mesh, example_inputs=(tok,), plan=plan)
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    # the ranks are still in step: a matching compile and a step run
    c = GPTConfig(layers=2)
    tok, tgt = gpt_batch(c, 8)
    dm = autopar.compile(TinyGPT(c), autopar.Mesh(dp=2), example_inputs=(tok,), plan=autopar.Plan(dp="zero3"))
    lm_loss(dm(*dm.shard_batch((tok,))), dm.shard_batch(tgt)).backward()
    out["after"] = True
    return out


def timeline_and_dump(out_dir, plan_kw):
    """Record one step's timeline, dump it (measured and predicted lanes) and report what a
    test checks: per rank, the lanes, exposed communication and the collectives counted."""
    torch.set_num_threads(1)
    c = GPTConfig(layers=2)
    tok, tgt = gpt_batch(c, 8)
    torch.manual_seed(0)
    dm = autopar.compile(TinyGPT(c), autopar.Mesh(dp=dist.get_world_size()), example_inputs=(tok,),
                         plan=autopar.Plan(**plan_kw))
    opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
    _step(dm, opt, (tok,), tgt, lm_loss)
    dm.comm_stats.reset()
    with dm.record_timeline():
        _step(dm, opt, (tok,), tgt, lm_loss)
    calls = sum(dm.comm_stats.calls.values())
    files = dm.dump(out_dir) if dist.get_rank() == 0 else []
    tl = dm.timelines[dist.get_rank()]
    return {"calls": calls, "events": tl.events, "lanes": tl.lanes(), "exposed": tl.exposed_comm_s,
            "duration": tl.duration_s, "n_timelines": len(dm.timelines), "files": [os.path.basename(f) for f in files]}


def prefetch_memory(multiples, steps=5):
    """ZeRO-3 on a GPT with 4 layers: for prefetch budgets of ``multiples`` of the largest
    unit's in-flight bytes (None: the default, one unit ahead), the most gather bytes in flight
    at once (the runtime's count), the unit sizes, and the measured peak of a step's
    allocations (profiler, median of ``steps``)."""
    torch.set_num_threads(1)
    c = GPTConfig(layers=4, dim=64, heads=4)
    tok, tgt = gpt_batch(c, 8)
    out = {}
    layer = None
    for m in multiples:
        budget = None if m is None else m * (layer or 0)
        torch.manual_seed(0)
        dm = autopar.compile(TinyGPT(c), autopar.Mesh(dp=dist.get_world_size()), example_inputs=(tok,),
                             plan=autopar.Plan(dp="zero3", prefetch_bytes=budget))
        units = [dm._sync.unit_bytes(k) for k in range(len(dm._sync.units))]
        if layer is None:
            layer = max(units)
            if m:
                raise ValueError("the first budget multiple must be 0 or None (it measures the unit size)")
        lx, lt = dm.shard_batch((tok,)), dm.shard_batch(tgt)

        def body():
            lm_loss(dm(*lx), lt).backward()
        body()
        for p in dm.parameters():
            p.grad = None
        gc.collect()
        dm._sync.peak_inflight_bytes = 0
        peaks = []
        for _ in range(steps):
            peaks.append(profiled_peak_bytes(body))
            for p in dm.parameters():
                p.grad = None
        out[m] = {"budget": budget, "inflight": dm._sync.peak_inflight_bytes, "units": units,
                  "peak": sorted(peaks)[len(peaks) // 2], "peaks": peaks}
    return out


def pipeline_timeline(out_dir):
    """1F1B on pp=2: a recorded train_step's lanes hold the point-to-point transfers; dump
    writes timeline.json beside the schedule files."""
    torch.set_num_threads(1)
    c = GPTConfig(layers=4)
    x, t = gpt_batch(c, 8)
    torch.manual_seed(0)
    pm = autopar.compile(TinyGPT(c), autopar.Mesh(pp=2), example_inputs=(x,),
                         plan=autopar.Plan(pp_schedule="1f1b", microbatches=4))
    pm.train_step((x,), t, _lm)
    with pm.record_timeline():
        pm.train_step((x,), t, _lm)
    files = pm.dump(out_dir) if dist.get_rank() == 0 else []
    if dist.get_rank():
        pm.dump(out_dir + "_1")        # collective over pp: every rank dumps
    tl = pm.timelines[dist.get_rank()]
    return {"names": sorted({name.split(" ")[0] for k, name, *_ in tl.events if k == "comm"}),
            "n": len(pm.timelines), "files": [os.path.basename(f) for f in files]}


def order_mismatch_plans():
    """The ranks pass different plans (overlap on one, off on the other): the compile fails on
    both with the first differing collective (here the plan itself), before any group is made."""
    torch.set_num_threads(1)
    c = GPTConfig(layers=2)
    tok, _ = gpt_batch(c, 8)
    try:
        autopar.compile(TinyGPT(c), autopar.Mesh(dp=2), example_inputs=(tok,),
                        plan=autopar.Plan(dp="zero2", overlap=dist.get_rank() == 0))
        return None
    except ValueError as exc:
        return str(exc)
