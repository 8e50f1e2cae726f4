"""The model zoo's slow tier, third part: the architectures of the current open-weight releases
(``autopar.zoo.ARCHS`` from ``test_zoo.NEWER`` on: Gemma 3, SmolLM3, GLM-4, ERNIE 4.5, Qwen3-MoE,
DeepSeek-V3, gpt-oss, Mamba, Mamba-2, LFM2, ModernBERT, T5Gemma, the Whisper encoder, DINOv2)
under ZeRO-3, tp, tp+sp and 1F1B, one architecture per test, and a few of them under dp x tp.
Each cell is parity with the single-device model and the volume checks of ``zoo.volume_check``
(bytes per step against the plan's formula, the parameter bytes a rank holds). A separate file so
that pytest-xdist runs it beside the other two parts; see tests/test_zoo.py."""
import pytest
import torch

from autopar import zoo
from autopar.runtime.tpcomm import tp_gather

from test_zoo import NEW_PART, cells_of, check_cells, check_every_two_process_plan, world_plans

DP_BY_TP_NEW = ["gemma3", "deepseek_v3", "mamba2", "modernbert", "whisper"]
"""under Mesh(dp=2, tp=2): sliding-window attention with q/k norms, latent attention with a
sigmoid-routed mixture of experts, a state-space scan, a fused-qkv encoder and an audio encoder"""


def test_the_new_architectures_cover_new_families():
    """State-space and hybrid models, audio, and the new rows of each earlier family, each
    built from its transformers config class."""
    fams = {}
    for name in NEW_PART:
        fams.setdefault(zoo.arch(name).family, []).append(name)
    assert len(NEW_PART) >= 14
    assert {"decoder", "moe", "state-space", "encoder", "encoder-decoder", "vision", "audio"} <= set(fams)
    assert set(DP_BY_TP_NEW) <= set(NEW_PART)


def _stepped():
    """A model of two tensors (10 rows of 16 elements, 1 row of 4) that ran one step, and a
    third (2 rows of 2) that forward never read (no .grad)."""
    m = torch.nn.ModuleDict({"w": torch.nn.Linear(16, 10, bias=False), "b": torch.nn.Linear(4, 1, bias=False),
                             "unused": torch.nn.Linear(2, 2, bias=False)})
    (m["w"].weight.sum() + m["b"].weight.sum()).backward()
    return m


PSI = 10 * 16 * 4 + 1 * 4 * 4 + 2 * 2 * 4          # 672 bytes


@pytest.mark.parametrize("step,held,ok", [
    # ZeRO-3 at N = 2: forward gathers and reduce-scatters of Psi/2, backward gathers at most that
    ({("dp", "all_gather", "forward"): PSI / 2, ("dp", "all_gather", "backward"): PSI / 2,
      ("dp", "reduce_scatter", "backward"): PSI / 2}, PSI / 2, True),
    ({("dp", "all_gather", "forward"): PSI / 2, ("dp", "reduce_scatter", "backward"): PSI / 2}, PSI / 2, True),
    # padding: b's one row is padded to two (16 bytes); the unused tensor may be left out
    ({("dp", "all_gather", "forward"): (PSI + 16) / 2, ("dp", "reduce_scatter", "backward"): (PSI - 16) / 2},
     PSI / 2, True),
    ({("dp", "all_gather", "forward"): (PSI + 200) / 2, ("dp", "reduce_scatter", "backward"): PSI / 2}, PSI / 2, False),
    ({("dp", "all_gather", "forward"): PSI / 2, ("dp", "reduce_scatter", "backward"): (PSI - 100) / 2}, PSI / 2, False),
    ({("dp", "all_gather", "forward"): PSI / 2}, PSI / 2, False),                         # no gradient reduction
    ({("dp", "all_gather", "forward"): PSI, ("dp", "reduce_scatter", "backward"): PSI / 2}, PSI / 2, False),
    ({("dp", "all_reduce", "backward"): PSI}, PSI, False),                                # ddp under a zero3 plan
    ({}, PSI / 2, False),                                                                 # communicates nothing
    ({("dp", "all_gather", "forward"): PSI / 2, ("dp", "reduce_scatter", "backward"): PSI / 2,
      ("tp", "all_reduce", "forward"): 8.0}, PSI / 2, False),                             # an axis the mesh lacks
])
def test_volume_check_zero3(step, held, ok):
    """The ZeRO-3 column's formula: Psi (N-1)/N forward and reduce-scatter (the 16 bytes of the
    unused tensor may be left out), at most that in backward gathers, each tensor's padding to N
    equal row blocks allowed, and nothing else."""
    problem, note = zoo.volume_check("zero3", _stepped(), step, zoo.Holdings(int(held)))
    assert (problem == "") == ok, problem
    assert note == ""


def test_volume_check_tp():
    """tp: a rank that holds everything, or gathers a weight whole in forward, or moves nothing
    fails; one that holds over 3/4 passes only where the compile warned, with a note."""
    m, moved = _stepped(), {("tp", "all_reduce", "forward"): 512.0}
    check = lambda step, held: zoo.volume_check("tp", m, step, held)
    assert check(moved, zoo.Holdings(400)) == ("", "")
    assert check({}, zoo.Holdings(400))[0] == "tp moved no bytes"
    assert check(moved, zoo.Holdings(PSI, warned=True))[0].startswith("tp splits no parameter")
    assert check(moved, zoo.Holdings(400, gathered_weights=("w.weight",)))[0].startswith("tp all-gathers whole")
    assert "did not warn" in check(moved, zoo.Holdings(600))[0]
    problem, note = check(moved, zoo.Holdings(600, kept_whole="w.weight", warned=True))
    assert problem == "" and note.startswith("a tp rank holds 89%")


def test_volume_check_dp_by_tp_and_pipeline():
    """dp x tp: the ddp all-reduce is 2 (N-1)/N of what the rank holds, less the gradients that
    do not exist; a pipeline stage holds part of Psi and sends something."""
    m = _stepped()
    tp = {("tp", "all_reduce", "forward"): 512.0}
    assert zoo.volume_check("dp x tp", m, {**tp, ("dp", "all_reduce", "backward"): 400.0}, zoo.Holdings(400))[0] == ""
    assert zoo.volume_check("dp x tp", m, {**tp, ("dp", "all_reduce", "backward"): 384.0}, zoo.Holdings(400))[0] == ""
    assert zoo.volume_check("dp x tp", m, {**tp, ("dp", "all_reduce", "backward"): 420.0}, zoo.Holdings(400))[0]
    assert zoo.volume_check("dp x tp", m, {**tp, ("dp", "all_reduce", "backward"): 200.0}, zoo.Holdings(400))[0]
    assert zoo.volume_check("pp 1f1b", m, {("pp", "send", "forward"): 64.0}, zoo.Holdings(400))[0] == ""
    assert zoo.volume_check("pp 1f1b", m, {}, zoo.Holdings(400))[0]
    assert zoo.volume_check("pp 1f1b", m, {("pp", "send", "forward"): 64.0}, zoo.Holdings(PSI))[0]


def test_weight_gathers_are_found_through_views():
    """``zoo.tp_weight_gathers`` names a parameter that a tp all-gather makes whole, through a
    transpose and a view of it, and not an activation's gather."""
    root = torch.nn.Module()
    root.w = torch.nn.Parameter(torch.randn(4, 6))
    g = torch.fx.Graph()
    x, w = g.placeholder("x"), g.get_attr("w")
    wt = g.call_function(torch.ops.aten.view.default, (g.call_function(torch.ops.aten.t.default, (w,)), [6, 4]))
    gw = g.call_function(tp_gather, (wt, None, 1, 8, False))
    gx = g.call_function(tp_gather, (x, None, 1, 8, False))
    g.output((gw, gx))
    assert zoo.tp_weight_gathers(torch.fx.GraphModule(root, g)) == ["w"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", NEW_PART)
def test_zoo_every_two_process_plan(ranks, name):
    check_every_two_process_plan(ranks, name)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", DP_BY_TP_NEW)
def test_zoo_dp_by_tp(ranks, name):
    check_cells(cells_of(ranks, [name], world_plans(4), 4))
