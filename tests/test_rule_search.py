"""The strategy search for ops without a sharding rule (passes/rules/search.py): with a rule
taken out of the registry, the search finds the rule's strategies (those it can express: R,
S(d), P(sum)); an op that mixes every element is found replicate-only; random and mutating
ops are never run; results are cached on disk, and a corrupt cache file is ignored; data
parallelism follows the batch through a searched op, and refuses an op nothing matched."""
import json
import logging

import pytest
import torch
from torch import nn

import autopar
from autopar import meta
from autopar.passes.rules import RULES, OpInfo, strategies_for
from autopar.passes.rules import search
from autopar.placement import Partial, Replicate, Shard

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    """Each test its own cache file and an empty memory."""
    monkeypatch.setenv("AUTOPAR_STRATEGY_CACHE", str(tmp_path / "strategies.json"))
    monkeypatch.setattr(search, "_memory", {})
    monkeypatch.setattr(search, "_disk", [])
    return tmp_path / "strategies.json"


def _expressible(s) -> bool:
    """The search's candidates: every placement R, S(d) or P(sum)."""
    return all(p == Replicate() or isinstance(p, Shard) or p == Partial("sum")
               for p in (*s.inputs, *(s.output if isinstance(s.output, tuple) else (s.output,))))


CALLS = {
    "gelu": (aten.gelu.default, (torch.randn(4, 6, 5),), {}),
    "cumsum": (aten.cumsum.default, (torch.randn(4, 6, 5), 1), {}),
    "mm": (aten.mm.default, (torch.randn(6, 4), torch.randn(4, 5)), {}),
    "gather": (aten.gather.default, (torch.randn(4, 6), 1, torch.randint(0, 4, (4, 5))), {}),
}


@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize("n", [2, 3])
def test_the_search_finds_the_rules_strategies(name, n, monkeypatch):
    op, args, kwargs = CALLS[name]
    info = OpInfo.from_call(op, args, kwargs, n=n)
    ruled = {s for s in strategies_for(info) if _expressible(s)}
    monkeypatch.delitem(RULES, op)      # restored when the test ends
    assert op not in RULES
    searched = strategies_for(info)
    assert set(searched) == ruled, (sorted(map(str, set(searched) - ruled)), sorted(map(str, ruled - set(searched))))


@torch.library.custom_op("autopar_test::mix_rows", mutates_args=())
def mix_rows(x: torch.Tensor) -> torch.Tensor:
    """Every row reads its neighbour and the sum of the whole tensor: no layout is right."""
    return x.roll(1, 0) * x.sum()


@mix_rows.register_fake
def _(x):
    return torch.empty_like(x)


def test_an_op_mixing_every_element_is_replicate_only(caplog):
    info = OpInfo.from_call(torch.ops.autopar_test.mix_rows.default, (torch.randn(6, 4),), n=2)
    with caplog.at_level(logging.INFO, logger="autopar"):
        assert [str(s) for s in search.search(info)] == ["R -> R"]
        assert strategies_for(info) is None      # the callers then replicate or refuse it
    assert "no candidate placement matched" in caplog.text


def test_a_searched_strategy_is_logged_and_cached_on_disk(fresh_cache, monkeypatch, caplog):
    op, args, kwargs = CALLS["gelu"]
    monkeypatch.delitem(RULES, op)
    info = OpInfo.from_call(op, args, kwargs, n=2)
    with caplog.at_level(logging.INFO, logger="autopar"):
        first = strategies_for(info)
    assert "found by search" in caplog.text and "S(0) -> S(0)" in caplog.text
    entries = json.loads(fresh_cache.read_text())["strategies"]
    assert len(entries) == 1
    # a new process (empty memory) reads the file instead of searching again
    monkeypatch.setattr(search, "_memory", {})
    monkeypatch.setattr(search, "_disk", [])
    monkeypatch.setattr(search, "_find", lambda info: pytest.fail("searched again"))
    assert strategies_for(info) == first


def test_a_corrupt_cache_file_is_ignored_with_a_warning(fresh_cache, monkeypatch, caplog):
    fresh_cache.write_text("{not json")
    op, args, kwargs = CALLS["cumsum"]
    monkeypatch.delitem(RULES, op)
    with caplog.at_level(logging.WARNING, logger="autopar"):
        found = strategies_for(OpInfo.from_call(op, args, kwargs, n=2))
    assert "S(0) -> S(0)" in [str(s) for s in found]
    assert "ignoring the strategy-search cache" in caplog.text
    assert json.loads(fresh_cache.read_text())["version"] == 1     # rewritten


def test_random_and_mutating_ops_are_never_run(monkeypatch):
    monkeypatch.setattr(search, "check_strategy", lambda *a, **k: pytest.fail("ran the op"))
    x = torch.rand(4, 6)
    for op, args in ((aten.bernoulli.default, (x,)), (aten.relu_.default, (x.clone(),)),
                     (aten.normal_functional.default, (x,))):
        assert op not in RULES
        assert [str(s) for s in search.search(OpInfo.from_call(op, args, n=2))] == ["R -> R"]


class _RowWise(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return torch.logcumsumexp(self.fc(x), dim=1)     # no rule; each row on its own


class _Everything(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return torch.logsumexp(self.fc(x), dim=(0, 1))   # no rule; mixes the whole batch


def test_data_parallelism_follows_the_batch_through_a_searched_op():
    assert aten.logcumsumexp.default not in RULES
    dm = autopar.compile(_RowWise(), autopar.Mesh(dp=2, virtual=True), example_inputs=(torch.randn(8, 16),),
                         plan=autopar.Plan())
    node = next(n for n in dm.module.graph.nodes if n.target == aten.logcumsumexp.default)
    assert str(node.meta[meta.LAYOUT]) == "dp:S(0)"
    with pytest.raises(NotImplementedError, match=r"aten.logsumexp.default \(node logsumexp\).*"
                                                  r"no candidate placement matched"):
        autopar.compile(_Everything(), autopar.Mesh(dp=2, virtual=True), example_inputs=(torch.randn(8, 16),),
                        plan=autopar.Plan())
