"""The model zoo (``autopar.zoo``, ``python -m autopar zoo``): Hugging Face architectures from
tiny random configs, called the Hugging Face way (``labels=`` -> ``.loss``), trained under
ZeRO-3, tp, tp+sp, a 1F1B pipeline and dp x tp against the single-device model
(``autopar.testing.parity``: outputs, loss, gathered gradients and parameters after AdamW
steps). The fast tier runs a few rows; the slow tier every architecture."""
import pytest

from autopar import zoo

FAST = ["llama", "mixtral"]
"""a decoder LM whose loss shifts its labels with a pad, and a mixture of experts"""


def cells_of(ranks, names, plans, world):
    got = ranks(zoo.run_cells, world, names, plans, zoo.STEPS, timeout=60 + 40 * len(names) * len(plans))
    for rank_cells in got[1:]:            # every rank reaches the same verdicts
        assert [(c.arch, c.plan, c.ok) for c in rank_cells] == [(c.arch, c.plan, c.ok) for c in got[0]]
    return {(c.arch, c.plan): c for c in got[0]}


def world_plans(world):
    return [p for p in zoo.PLANS if zoo.plan_world(p) == world]


def check_cells(cells):
    bad = [f"{a} under {p}: {c.why}" for (a, p), c in cells.items() if not c.ok]
    assert not bad, "cells without parity or failing a volume check:\n" + "\n".join(bad)


@pytest.mark.timeout(300)
def test_zoo_fast_rows(ranks):
    """The labels= Llama and Mixtral under ZeRO-3, tp+sp and the 1F1B pipeline."""
    check_cells(cells_of(ranks, FAST, ["zero3", "tp+sp", "pp 1f1b"], 2))


DP_BY_TP = ["gpt2", "falcon", "llama", "gemma2", "qwen3", "mixtral", "qwen2_moe", "bert", "t5", "vit"]
"""the architectures the slow tier runs on Mesh(dp=2, tp=2): a fused Conv1D qkv, multi-query
attention, grouped-query attention with rotary embeddings, eager attention with soft-capping,
q/k norms, two MoE routers, an encoder, an encoder-decoder and a vision model (four processes
a cell cost what two of the other columns do; ``python -m autopar zoo`` runs the whole column)"""

# The slow tier's cells run one architecture per job, as ``zoo.run`` does (a rank pool sets what
# a job leaves aside from garbage collection, so each compile's collection scans one
# architecture's objects, not the whole zoo's), and one architecture per test, so that pytest-xdist
# (``--dist loadfile``, files with more tests first) starts the zoo's files first on both
# workers: every architecture under ZeRO-3, tp, tp+sp and 1F1B is split between this file (the
# first SPLIT architectures of ``zoo.ARCHS``, and the dp x tp column, whose four processes a cell
# cost about what two of the other columns do), tests/test_zoo_second_half.py (the rest up to
# NEWER) and tests/test_zoo_new.py (the architectures from NEWER on, with their dp x tp cells).
SPLIT = 16
NEWER = [a.name for a in zoo.ARCHS].index("gemma3")
FIRST_PART = [a.name for a in zoo.ARCHS[:SPLIT]]
SECOND_PART = [a.name for a in zoo.ARCHS[SPLIT:NEWER]]
NEW_PART = [a.name for a in zoo.ARCHS[NEWER:]]


def check_every_two_process_plan(ranks, name):
    """One architecture under ZeRO-3, tp, tp+sp and 1F1B (a row of the table in docs/hugging-face.md)."""
    check_cells(cells_of(ranks, [name], world_plans(2), 2))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", FIRST_PART)
def test_zoo_every_two_process_plan(ranks, name):
    check_every_two_process_plan(ranks, name)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", DP_BY_TP)
def test_zoo_dp_by_tp(ranks, name):
    """Ten architectures, one of each kind of block, under tp on Mesh(dp=2, tp=2)."""
    check_cells(cells_of(ranks, [name], world_plans(4), 4))


def test_zoo_covers_the_families():
    """At least 30 architectures: decoder LMs, mixtures of experts, encoders, an
    encoder-decoder and a vision model, each built from its transformers config class."""
    fams = {}
    for a in zoo.ARCHS:
        fams.setdefault(a.family, []).append(a.name)
    assert len(zoo.ARCHS) >= 30
    assert len(fams["decoder"]) >= 20 and len(fams["moe"]) >= 2 and fams["encoder"]
    assert fams["encoder-decoder"] and fams["vision"]
    assert len({a.model for a in zoo.ARCHS}) == len(zoo.ARCHS)
