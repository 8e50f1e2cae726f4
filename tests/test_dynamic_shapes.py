"""Data-dependent sizes (``autopar/data_dependent.py``): a mixture-of-experts block that routes
its tokens with ``torch.nonzero``, a boolean mask or token counts read with ``.tolist()``
captures with torch.export (unbacked sizes, ``u0``), and autopar refuses it at capture under
every plan, with an error naming the node, where the size comes from (op and source line) and
how to route with fixed sizes, never a raw torch exception. A number read from a tensor that
never becomes a size is not refused, and a pipeline that cannot cut around one says why.
Compiled on a fake process group of 2 ranks (``autopar.testing.fake_rank``)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.data_dependent import DataDependentShapeError, data_dependent_size
from autopar.testing import fake_rank

aten = torch.ops.aten


class TokenMoE(nn.Module):
    """A router picks one expert per token; ``routing`` says how the tokens reach it:
    ``nonzero``   idx = nonzero(choice == e); y.index_add(0, idx, expert(h[idx]))
    ``mask``      y[choice == e] = expert(h[choice == e])
    ``counts``    tokens sorted by expert, split by the counts per expert read with .tolist()
    ``weighted``  every expert on every token, weighted by the one-hot routing (fixed sizes)."""

    def __init__(self, routing: str, dim=16, experts=4, hidden=32):
        super().__init__()
        self.routing = routing
        self.router = nn.Linear(dim, experts, bias=False)
        self.up = nn.ModuleList(nn.Linear(dim, hidden) for _ in range(experts))
        self.down = nn.ModuleList(nn.Linear(hidden, dim) for _ in range(experts))
        self.out = nn.Linear(dim, dim)

    def expert(self, e, h):
        return self.down[e](F.relu(self.up[e](h)))

    def forward(self, x):
        b, t, d = x.shape
        h = x.reshape(b * t, d)
        choice = self.router(h).argmax(-1)
        y = torch.zeros_like(h)
        if self.routing == "counts":
            order = torch.argsort(choice)
            sizes = F.one_hot(choice, len(self.up)).sum(0).tolist()
            parts = h[order].split(sizes)
            y = y.index_copy(0, order, torch.cat([self.expert(e, p) for e, p in enumerate(parts)]))
        for e in range(len(self.up)):
            if self.routing == "nonzero":
                idx = torch.nonzero(choice == e).squeeze(-1)
                y = y.index_add(0, idx, self.expert(e, h[idx]))
            elif self.routing == "mask":
                m = choice == e
                y[m] = self.expert(e, h[m])
            elif self.routing == "weighted":
                y = y + (choice == e).unsqueeze(-1).to(h.dtype) * self.expert(e, h)
        return self.out(y.reshape(b, t, d))


PLANS = {   # (Mesh axes, Plan fields) at world 2
    "ddp": ({"dp": 2}, {"dp": "ddp"}),
    "zero3": ({"dp": 2}, {"dp": "zero3"}),
    "tp": ({"tp": 2}, {"tp": True}),
    "1f1b": ({"pp": 2}, {"pp_schedule": "1f1b", "microbatches": 2}),
}
WHERE = {   # routing -> (the node named, its op, what the error says the size is)
    "nonzero": ("node nonzero (aten.nonzero.default) has shape (u0, 1)", "positions of the true elements",
                "idx = torch.nonzero(choice == e)"),
    "mask": ("node index (aten.index.Tensor) has shape (u0, 16)", "elements a boolean mask selects",
             "y[m] = self.expert(e, h[m])"),
    "counts": ("node split_with_sizes (aten.split_with_sizes.default) has outputs of shapes (u0, 16), (u1, 16)",
               "read as a Python number (.item() / .tolist())",
               "sizes = F.one_hot(choice, len(self.up)).sum(0).tolist()"),
}


def _batch():
    return torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(0))


def _compile(model, plan):
    axes, fields = PLANS[plan]
    with fake_rank(2, 0):
        return autopar.compile(model, autopar.Mesh(**axes), example_inputs=(_batch(),), plan=autopar.Plan(**fields))


@pytest.mark.parametrize("routing", sorted(WHERE))
@pytest.mark.parametrize("plan", sorted(PLANS))
def test_a_data_dependent_size_is_refused_with_the_node_its_source_and_a_fix(routing, plan):
    with pytest.raises(DataDependentShapeError) as e:
        _compile(TokenMoE(routing), plan)
    msg = str(e.value)
    node, what, line = WHERE[routing]
    assert msg.startswith("autopar cannot compile TokenMoE: node ") and node in msg, msg
    assert what in msg and f"test_dynamic_shapes.py:" in msg and line in msg, msg
    assert "known only at run time" in msg and "experts_implementation='batched_mm'" in msg, msg
    assert isinstance(e.value, NotImplementedError) and autopar.DataDependentShapeError is DataDependentShapeError


def test_the_estimate_refuses_it_too():
    with pytest.raises(DataDependentShapeError, match=r"node nonzero \(aten.nonzero.default\)"):
        autopar.estimate(TokenMoE("nonzero"), autopar.Mesh(dp=2, virtual=True), autopar.Plan(dp="ddp"),
                         example_inputs=(_batch(),), cluster="dgx-h100")


def test_the_fixed_size_routing_compiles_under_every_plan():
    for plan in PLANS:
        _compile(TokenMoE("weighted"), plan)


def test_the_size_and_where_it_comes_from():
    gm = torch.export.export(TokenMoE("counts"), (_batch(),), strict=False).module()
    node, sym, origin = data_dependent_size(gm)
    assert node.target == aten.split_with_sizes.default and str(sym) == "u0"
    assert origin.target == aten.item.default
    assert data_dependent_size(torch.export.export(TokenMoE("weighted"), (_batch(),), strict=False).module()) is None


class _Scaled(nn.Module):
    """A number read from the batch scales the output: a value, never a size."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x) * (x > 0).sum().item()


def test_a_number_read_from_a_tensor_is_not_a_data_dependent_size():
    _compile(_Scaled(), "tp")       # every tp rank reads the same batch: the same number
    with pytest.raises(ValueError, match=r"node sum_1 \(aten.sum.default\).*mixes samples of its batch"):
        _compile(_Scaled(), "ddp")   # a count over the whole batch: each dp rank would count its own rows


class _FlatScaled(nn.Module):
    """The same on the tokens of the batch flattened: no value between two ops is a batch of rows."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x.reshape(-1, 16))
        return (h * (h[:, 0] > 0).sum().item()).reshape(x.shape)


def test_a_pipeline_with_no_cut_around_a_number_says_which_values_cross():
    with pytest.raises(ValueError, match=r"no cut splits the graph into 2 pipeline stages with only batch "
                                         r"activations crossing it.*: item \(aten.item.default: SymInt\), "
                                         r"reshape \(aten.reshape.default: \(12, 16\)\)"):
        _compile(_FlatScaled(), "1f1b")
