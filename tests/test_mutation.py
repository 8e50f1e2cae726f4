"""In-place writes and writes into views: the captured program is made pure, so every plan
keeps the single-device meaning (real processes against the single-device model), and what
cannot be kept (writes into the model's inputs, a write left after the passes) is refused
naming the node."""
import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import autopar
from autopar import passes
from autopar.context import CompileContext
from autopar.functionalize import writes
from autopar.testing import fake_rank
from jobs import mutation


# ---- the mutation matrix: every pattern under every plan, against one device ----------------------

@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["tp+sp", "zero3", pytest.param("ddp", marks=pytest.mark.slow),
                                  pytest.param("tp", marks=pytest.mark.slow),
                                  pytest.param("zero2", marks=pytest.mark.slow),
                                  pytest.param("pp 1f1b", marks=pytest.mark.slow),
                                  pytest.param("pp zero-bubble", marks=pytest.mark.slow)])
def test_every_write_pattern_trains_as_on_one_device(ranks, name):
    """``WritingNet`` (one block per pattern of ``mutation.PATTERNS``: DeepSeek-V3's keys
    filled into ``new_empty``, ``index_put_``, ``masked_fill_`` on a slice, a write through a
    view, writes into a base read through an earlier view, a slice assignment) against the
    single-device model: outputs, loss, gradients and parameters after three AdamW steps."""
    for r in ranks(mutation.mutation_parity, 2, name, timeout=240):
        assert r["ok"], (name, r)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_every_write_pattern_trains_as_on_one_device_on_a_2d_mesh(ranks):
    for r in ranks(mutation.mutation_parity, 4, "dp x tp", timeout=360):
        assert r["ok"], r


# ---- the program as compiled ------------------------------------------------------------------

def _compiled(model, plan, axes, x):
    with fake_rank(2, 0):
        return autopar.compile(model, autopar.Mesh(**axes), example_inputs=(x,), plan=plan)


@pytest.mark.parametrize("axes,plan", [({"tp": 2}, autopar.Plan(tp=True, sp=True)), ({"dp": 2}, autopar.Plan(dp="zero3"))])
def test_the_compiled_program_writes_nothing_in_place(axes, plan):
    """The model writes in place in every block; the rank's program holds no write, and the
    writes into views became scatters into their bases."""
    model = mutation.WritingNet()
    x, _ = mutation.batch()
    assert writes(torch.export.export(model, (x,), strict=False).graph), "the model's own program writes"
    dm = _compiled(model, plan, axes, x)
    assert not writes(dm.module.graph)
    targets = {n.target for n in dm.module.graph.nodes}
    assert torch.ops.aten.slice_scatter.default in targets and torch.ops.aten.index_put.default in targets


class _DropoutAndWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.drop = nn.Linear(16, 16), nn.Dropout(0.25)

    def forward(self, x):
        h = self.lin(x)
        h[:, :4].mul_(2.0)
        return self.drop(h)


def test_dropout_stays_a_random_site_and_eval_runs_after_functionalisation():
    """Functionalisation turns dropout into ``native_dropout`` (and into a clone in eval mode);
    the program keeps ``aten.dropout`` so that its masks are the single-device ones, and the
    compiled module switches to eval mode as an unwritten model's does."""
    x = torch.randn(8, 16)
    dm = _compiled(_DropoutAndWrite(), autopar.Plan(dp="ddp"), {"dp": 2}, x)
    targets = [n.target for n in dm.module.graph.nodes]
    assert torch.ops.aten.native_dropout.default not in targets
    assert len(dm.ctx.rng_sites) == 1
    assert dm.ctx.mode_difference() == ""


class _WritesInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        x[:, 0] = 0.0
        return self.lin(x)


@pytest.mark.parametrize("axes,plan", [({"dp": 2}, autopar.Plan()), ({"tp": 2}, autopar.Plan(tp=True))])
def test_a_write_into_an_input_is_refused_naming_it(axes, plan):
    with pytest.raises(ValueError, match=r"_WritesInput's forward writes in place into its input 'x' \(node .*copy_.*"
                                         r"x = x\.clone\(\)"):
        _compiled(_WritesInput(), plan, axes, torch.randn(8, 16))


class _WritesBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("seen", torch.zeros(16))

    def forward(self, x):
        self.seen.add_(x.sum(0))
        return self.lin(x)


def test_a_write_into_a_buffer_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"updates the buffers seen"):
        _compiled(_WritesBuffer(), autopar.Plan(), {"dp": 2}, torch.randn(8, 16))


def test_a_write_left_after_the_passes_is_refused_naming_the_node():
    """The check after the passes, on a graph that still writes (as a pass that inserted an
    in-place op would leave it): an error naming the node and the tensor it writes."""
    g = fx.Graph()
    x = g.placeholder("x")
    h = g.call_function(torch.ops.aten.relu.default, (x,))
    w = g.call_function(torch.ops.aten.add_.Tensor, (h, x))
    g.output(g.call_function(torch.ops.aten.mul.Tensor, (h, w)))
    gm = fx.GraphModule(nn.Module(), g)
    ctx = CompileContext(mesh=autopar.Mesh(tp=2, virtual=True), plan=autopar.Plan(tp=True))
    with pytest.raises(NotImplementedError, match=r"node add__tensor \(aten\.add_\.Tensor\) writes in place into relu_default"):
        passes.check_no_writes(gm, ctx)
    w.target = torch.ops.aten.add.Tensor       # the same program written out of place: nothing to refuse
    assert passes.check_no_writes(gm, ctx) is gm
