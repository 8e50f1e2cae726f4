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
and the 3-D pp2 x dp2 x tp2 as the source); the slow tier runs the whole matrix of 8 plans.
"""
import os
import pickle
import shutil

import pytest

from jobs import checkpoint as J

FAST = {   # target -> sources, 12 pairs
    "ddp w2": ("pp2 dp2 tp2", "dp2 tp2 sp", "pp2 1f1b"),
    "zero3 w4": ("tp2", "pp2 1f1b", "pp2 dp2 tp2"),
    "tp2": ("zero3 w4", "pp2 1f1b", "pp2 dp2 tp2"),
    "pp2 1f1b": ("zero3 w4", "tp2", "dp2 tp2 sp"),
}


@pytest.fixture(scope="module")
def saved(ranks, tmp_path_factory):
    """plan name -> the directory of a checkpoint saved after 3 steps under it (saved when first asked)."""
    root = tmp_path_factory.mktemp("checkpoints")
    done = {}

    def get(name):
        if name not in done:
            path = str(root / name.replace(" ", "_"))
            ranks(J.save_job, J.world_of(name), name, path, timeout=240)
            done[name] = path
        return done[name]
    return get


def _check(results, target):
    for rank_result in results:
        for source, r in rank_result.items():
            where = f"{source} -> {target}"
            assert r["step"] == J.SPLIT, where
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
    paths = {source: saved(source) for source in J.PLANS}
    _check(ranks(J.resume_job, J.world_of(target), target, paths, timeout=400), target)


# ---- bad checkpoints -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def broken(ranks, tmp_path_factory):
    root = tmp_path_factory.mktemp("broken")
    for what in ("good", "no_optimizer", "other_model", "sgd", "mlp"):
        ranks(J.save_for_bad, 2, str(root), what)
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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_is_refused_on_every_rank_and_changes_nothing(ranks, broken, case):
    results = ranks(J.bad_checkpoint_job, 2, broken, case)
    for rank, r in enumerate(results):
        assert r["error"] is not None, f"rank {rank} loaded the {case} checkpoint"
        kind, text = r["error"]
        assert kind == "CheckpointError", f"rank {rank}: {kind}: {text}"
        for word in BAD[case]:
            assert word in text, f"rank {rank}: {word!r} not in: {text}"
        assert r["untouched"], f"rank {rank}: the {case} checkpoint changed the module or optimizer"
    assert results[0]["error"] == results[1]["error"]       # every rank says the same
