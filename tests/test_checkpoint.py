"""Checkpoints that reshard (``dm.save`` / ``dm.load``, ``autopar.checkpoint``), on real processes.

Resume parity: one device trains 6 AdamW steps without interruption; a compiled module trains
3 under plan A, saves, and a module compiled under plan B (another world size) loads and trains
the last 3. Steps 4-6's losses and the final parameters must be the single-device run's. The
model has dropout (the generator's state must resume with the step), a vocabulary of 67 (uneven
over 2, 4 and 8 ranks) and an LM head tied to the embedding (across stages under pp).

Tolerance: a resumed run computes what the uninterrupted one does in another summation order
(other ranks, other splits), no more. Losses agree within 1e-5 relative; parameters within
1e-4 absolute + 1e-3 relative (AdamW at lr 1e-2 turns the float differences of another
summation order into parameter differences up to about 6e-4 relative over 6 steps); the
attention key bias, whose gradient is float noise (softmax is shift invariant), moves by about
lr a step either way and is held to 2 lr a step. A wrong or missing optimizer state moves every
parameter by about lr (scaled error ~50), a wrong dropout mask changes the loss by ~1e-2.

The default suite runs 12 pairs of the most different plans (dp sharded over 4, tp, a pipeline,
and dp2 x tp2 with sp as the source); the slow tier runs the rest of the whole matrix of 8 plans (every pair
but those 12), the 3-D pp2 x dp2 x tp2 among them.
"""
import os
import pickle
import shutil

import pytest
import torch

from jobs.common import saved_checkpoints
from jobs import checkpoint as J

FAST = {   # target -> sources, 12 pairs (the 8-process 3-D plan, slow to save, is in the slow tier's matrix)
    "ddp w2": ("zero3 w4", "dp2 tp2 sp", "pp2 1f1b"),
    "zero3 w4": ("tp2", "pp2 1f1b", "dp2 tp2 sp"),
    "tp2": ("zero3 w4", "pp2 1f1b", "dp2 tp2 sp"),
    "pp2 1f1b": ("zero3 w4", "tp2", "dp2 tp2 sp"),
}


@pytest.fixture(scope="module")
def saved(ranks, tmp_path_factory):
    """plan name -> the directory of a checkpoint saved after 3 steps under it (saved when first asked)."""
    return saved_checkpoints(ranks, tmp_path_factory.mktemp("checkpoints"), J.save_job, J.world_of)


def _check(results, target):
    for rank_result in results:
        for source, r in rank_result.items():
            where = f"{source} -> {target}"
            assert r["step"] == J.SPLIT, where
            assert source == "torch" or r["extra"] == {"saved under": source}, where
            assert r["loss_err"] < 1e-5, f"{where}: losses {r['losses']} vs {r['ref']}"
            assert r["param_err"] < 1.0, f"{where}: {r['worst']} off by {r['param_err']:.2f} x (1e-4 + 1e-3 |p|)"
            assert r["noise_err"] < 1.0, f"{where}: the attention key bias moved {r['noise_err']:.2f} x 2 lr per step"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("target", list(FAST))
def test_resume_under_another_plan_and_world(ranks, saved, target):
    paths = {source: saved(source) for source in FAST[target]}
    _check(ranks(J.resume_job, J.world_of(target), target, paths, timeout=300), target)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("target", list(J.PLANS))
def test_resume_full_matrix(ranks, saved, target):
    # the pairs the default suite resumes (FAST) are not run twice
    paths = {source: saved(source) for source in J.PLANS if source not in FAST.get(target, ())}
    _check(ranks(J.resume_job, J.world_of(target), target, paths, timeout=400), target)


# ---- bad checkpoints -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def broken(ranks, tmp_path_factory):
    root = tmp_path_factory.mktemp("broken")
    ranks(J.save_for_bad, 2, str(root))
    for case in ("truncated", "missing_file", "uncovered"):
        shutil.copytree(root / "good", root / case)
    data = sorted(f for f in os.listdir(root / "truncated") if f.endswith(".distcp"))
    victim = root / "truncated" / data[-1]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    os.remove(root / "missing_file" / data[-1])
    md_path = root / "uncovered" / ".metadata"     # a tensor of which one rank's pieces are not recorded
    md = pickle.loads(md_path.read_bytes())
    entry = md.state_dict_metadata["model.blocks.0.fc.weight"]
    entry.chunks = entry.chunks[:1]
    md_path.write_bytes(pickle.dumps(md))
    (root / "empty").mkdir()
    return str(root)


BAD = {   # case -> what the error must say
    "truncated": ["truncated", ".distcp"],
    "missing_file": ["missing", ".distcp"],
    "uncovered": ["blocks.0.fc.weight", "cover only part"],
    "other_model": ["blocks.0.fc.weight", "shape (96, 24)", "(64, 16)"],
    "mlp": ["wte.weight", "is not in the checkpoint", "fc1.weight"],
    "no_optimizer": ["no optimizer state", "optimizer=None"],
    "sgd": ["SGD", "AdamW"],
    "empty": [".metadata"],
    "nowhere": ["no checkpoint at"],
}


@pytest.fixture(scope="module")
def refused(ranks, broken):
    return ranks(J.bad_checkpoint_job, 2, broken, list(BAD))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_is_refused_on_every_rank_and_changes_nothing(refused, case):
    results = [r[case] for r in refused]
    for rank, r in enumerate(results):
        assert r["error"] is not None, f"rank {rank} loaded the {case} checkpoint"
        kind, text = r["error"]
        assert kind == "CheckpointError", f"rank {rank}: {kind}: {text}"
        for word in BAD[case]:
            assert word in text, f"rank {rank}: {word!r} not in: {text}"
        assert r["untouched"], f"rank {rank}: the {case} checkpoint changed the module or optimizer"
    assert results[0]["error"] == results[1]["error"]       # every rank says the same


# ---- to and from plain PyTorch, Hugging Face, mixed precision ----------------------------------------

def _train_plain(model, opt, steps):
    losses = []
    for step in steps:
        x, y = J.batch(step)
        opt.zero_grad()
        loss = J.lm_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.timeout(300)
@pytest.mark.parametrize("source", ["dp2 tp2 sp", pytest.param("pp2 dp2 tp2", marks=pytest.mark.slow)])
def test_a_sharded_checkpoint_resumes_as_a_plain_torch_model(saved, source):
    """Saved under dp2 x tp2 (ZeRO-2, sp) or pp2 x dp2 x tp2 (ZeRO-3, sp, 1F1B), loaded on one
    process into a plain TinyGPT and torch's AdamW (to_torch), trained on: the uninterrupted
    run's losses and weights."""
    import torch

    from autopar.checkpoint import to_torch
    ref_losses, ref_params = J.reference()
    model = J.model()
    opt = torch.optim.AdamW(model.parameters(), lr=J.LR)
    out = to_torch(saved(source), model, opt)
    assert out["step"] == J.SPLIT and set(out["optim"]["state"]) == {n for n, _ in model.named_parameters()}
    assert "head.weight" in out["model"] and out["model"]["head.weight"] is out["model"]["wte.weight"]   # tied
    torch.set_rng_state(out["rng"]["cpu"])
    losses = _train_plain(model, opt, range(J.SPLIT, J.STEPS))
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses[J.SPLIT:])) < 1e-5, (losses, ref_losses)
    for k, v in model.state_dict().items():
        bound = 1e-4 + 1e-3 * ref_params[k].abs()
        bound = torch.where(J._noise_mask(k, v), torch.full_like(v, 2 * J.LR * (J.STEPS - J.SPLIT)), bound)
        assert bool(((v - ref_params[k]).abs() <= bound).all()), k


@pytest.mark.timeout(300)
def test_a_plain_torch_checkpoint_resumes_under_a_pipeline_and_tp(ranks, tmp_path):
    """The other way: 3 steps of plain PyTorch, from_torch, then dp2 x tp2 + sp and pp2 load it and
    train on."""
    import torch

    from autopar.checkpoint import from_torch
    model = J.model()
    opt = torch.optim.AdamW(model.parameters(), lr=J.LR)
    torch.manual_seed(1)
    _train_plain(model, opt, range(J.SPLIT))
    from_torch(model, opt, str(tmp_path / "torch"))
    for target in ("dp2 tp2 sp", "pp2 1f1b"):
        _check(ranks(J.resume_job, J.world_of(target), target, {"torch": str(tmp_path / "torch")}), target)


@pytest.mark.timeout(300)
def test_export_safetensors_loads_with_from_pretrained(ranks, tmp_path):
    """A transformers GPT-2 trained and saved under tp2; export_safetensors writes what
    GPT2LMHeadModel.from_pretrained loads: the trained weights, bitwise."""
    import torch
    from transformers import GPT2LMHeadModel

    from autopar.checkpoint import export_safetensors
    full = ranks(J.hf_save_job, 2, str(tmp_path / "ck"))[0]
    files = export_safetensors(str(tmp_path / "ck"), str(tmp_path / "hf"))
    assert sorted(os.path.basename(f) for f in files) == ["config.json", "model.safetensors"]
    hf = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"))
    mine = hf.state_dict()
    for k, v in full.items():
        assert k.startswith("lm.")
        assert torch.equal(mine[k[len("lm."):]], v), k
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()     # tied again


@pytest.mark.timeout(300)
def test_mixed_precision_saves_the_fp32_masters(ranks, tmp_path):
    import torch

    from autopar.checkpoint import to_torch
    masters = ranks(J.mixed_save_job, 2, str(tmp_path / "ck"))[0]
    out = to_torch(str(tmp_path / "ck"))
    for k, v in masters.items():
        assert v.dtype == torch.float32 and torch.equal(out["model"][k], v), k
    assert all(t.dtype == torch.float32 for s in out["optim"]["state"].values() for n, t in s.items() if n != "step")


# ---- memory -------------------------------------------------------------------------------------------

@pytest.mark.timeout(300)
@pytest.mark.parametrize("load_plan", ["zero3", "ddp"])
def test_save_and_load_hold_no_more_than_one_tensor_beyond_the_shard(ranks, tmp_path, load_plan):
    """Eight 256x256 layers under ZeRO-3 over 2 ranks: each rank holds half of each tensor, its
    weights and AdamW's two moments (the live state before the call). Saving, and loading under
    ZeRO-3 or ddp (which holds whole tensors: its own pieces are the whole model), may add at most
    one tensor (256 KiB) of transient memory: tensor storage plus Python objects, measured."""
    results = ranks(J.memory_job, 2, str(tmp_path / "ck"), load_plan)
    for r in results:
        for what in ("save", "load"):
            tensors, python = r[what]
            assert tensors + python <= r["tensor"] + 64 * 1024, \
                (f"{what}: {tensors} B of tensors + {python} B of Python objects at the peak ({r['metadata']} B of metadata), "
                 f"one tensor is {r['tensor']} B, the model {r['model']} B")
    if load_plan == "zero3":     # export, on this process: one whole tensor at a time, never the model
        import tracemalloc

        from autopar.checkpoint import export_safetensors
        from autopar.testing import profiled_peak_bytes
        tracemalloc.start()
        tensors = profiled_peak_bytes(lambda: export_safetensors(str(tmp_path / "ck"), str(tmp_path / "st"), prefix=""))
        python = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        one = results[0]["tensor"]
        assert tensors + python <= 2 * one + 64 * 1024, f"export: {tensors} + {python} B at the peak, one tensor is {one} B"
        assert os.path.getsize(tmp_path / "st" / "model.safetensors") > results[0]["model"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_offload_and_per_tensor_optimizers_resume(ranks, saved, tmp_path):
    """The optimizer's state on the host (Plan(offload="optimizer")) and on full copies
    (dm.optimizer(..., per_tensor=True)) saves and loads in the parameters' layout too."""
    for name in ("zero2 offload w2", "zero3 tp2 per_tensor"):
        ranks(J.save_job, J.world_of(name), name, str(tmp_path / name.replace(" ", "_")), timeout=240)
    offload, per_tensor = (str(tmp_path / n.replace(" ", "_")) for n in ("zero2 offload w2", "zero3 tp2 per_tensor"))
    _check(ranks(J.resume_job, 2, "zero2 offload w2", {"zero3 tp2 per_tensor": per_tensor, "tp2": saved("tp2")}),
           "zero2 offload w2")
    _check(ranks(J.resume_job, 4, "zero3 tp2 per_tensor", {"zero2 offload w2": offload, "zero3 w4": saved("zero3 w4")}),
           "zero3 tp2 per_tensor")


@pytest.mark.timeout(300)
def test_fused_adamw_resumes_through_optimizer_load_state_dict(ranks, tmp_path):
    """dm.load restores the optimizer through Optimizer.load_state_dict: each step lands where
    torch puts a fused optimizer's (float32 on its parameter's device; on CUDA a step left on
    the host fails the fused kernel), and the resumed run is the uninterrupted one's."""
    for r in ranks(J.fused_resume_job, 2, str(tmp_path / "fused")):
        assert r["hooked"] and r["fused"], r
        assert r["steps"] and all(s == (torch.float32, True) for s in r["steps"]), r
        assert r["err"] < 1e-6, r


@pytest.mark.timeout(300)
def test_saving_over_a_checkpoint_replaces_it_without_a_warning(ranks, tmp_path):
    """A checkpoint written again at the same path (a run that keeps its latest one there) is
    replaced, and DCP's warning that it overwrites (which the caller cannot act on) is not
    shown: the second one, saved after another step, is what loads."""
    for r in ranks(J.save_twice_job, 2, str(tmp_path / "latest")):
        assert r["warnings"] == [] and r["step"] == 2 and r["same"], r
