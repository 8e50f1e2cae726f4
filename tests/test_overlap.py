"""The overlap pass: collectives split into start and wait, ZeRO-3 gathers issued
ahead within a memory budget, collective matmul, the same order of collectives on every rank
(checked before running), and the measured timeline beside the predicted one.

Parity with the pass on and off runs in test_parity.py, test_tensor_parallel.py and
test_pipeline.py (both ways)."""
import json

import pytest

import autopar
from autopar.models import GPTConfig, TinyGPT, gpt_batch
from autopar.passes.overlap import unit_ahead_bytes
from autopar.runtime.collmatmul import all_gather_matmul, matmul_reduce_scatter
from autopar.runtime.dpsync import dp_gather, dp_unit_start, dp_unit_wait
from autopar.runtime.tpcomm import tp_copy, tp_copy_linear, tp_start, tp_wait

from jobs import errors, overlap, pipeline


def _compile(plan, layers=2, **mesh):
    c = GPTConfig(layers=layers)
    tok, _ = gpt_batch(c, 8)
    return autopar.compile(TinyGPT(c), autopar.Mesh(virtual=True, rank=0, **mesh), example_inputs=(tok,), plan=plan)


def _order(dm):
    return list(dm.module.graph.nodes)


def _unit_positions(dm):
    """unit -> (index of its start, index of its wait, index of its first dp_gather)."""
    nodes = _order(dm)
    pos: dict = {}
    for i, n in enumerate(nodes):
        if n.op != "call_function":
            continue
        if n.target is dp_unit_start:
            pos.setdefault(n.args[1], {})["start"] = i
        elif n.target is dp_unit_wait:
            pos.setdefault(n.args[1], {})["wait"] = i
        elif n.target is dp_gather:
            k = next(k for k, u in enumerate(dm.ctx.gather_units) if n.args[2] in u)
            pos.setdefault(k, {}).setdefault("use", i)
    return pos


def test_zero3_gathers_one_unit_ahead_by_default():
    """Unit k is issued right after unit k-1's wait (FSDP's forward prefetch of one), waited on
    right before its first use; the first unit at the start of forward."""
    dm = _compile(autopar.Plan(dp="zero3"), layers=3, dp=2)
    pos = _unit_positions(dm)
    assert len(pos) == len(dm.ctx.gather_units) == 4          # root + 3 layers
    nodes = _order(dm)
    for k in sorted(pos):
        p = pos[k]
        assert p["start"] < p["wait"] < p["use"]
        i = p["use"] - 1
        while nodes[i].target is dp_unit_start:              # the next unit, issued as this one is waited on
            i -= 1
        assert i == p["wait"]                                # waited on last
        if k:
            assert p["start"] == pos[k - 1]["wait"] + 1        # issued as the unit above is waited on
    dm.module.graph.lint()


def _ahead_after_each_start(dm, sizes):
    """Bytes of gathers issued and not yet waited on, right after each start that is not
    immediately waited on (what the budget bounds)."""
    nodes, inflight, out = _order(dm), set(), []
    for i, n in enumerate(nodes):
        if n.op == "call_function" and n.target is dp_unit_start:
            inflight.add(n.args[1])
            if nodes[i + 1].target is not dp_unit_wait or nodes[i + 1].args[1] != n.args[1]:
                out.append(sum(sizes[k] for k in inflight))
        elif n.op == "call_function" and n.target is dp_unit_wait:
            inflight.discard(n.args[1])
    return out


def test_zero3_prefetch_budget_places_starts():
    """A budget of 0 issues each gather right before its wait; with a budget, the gathers
    issued ahead never exceed it and as many units as fit go out early; however large the
    budget, never every unit at once (at most units - 2 ahead of the one in use)."""
    probe = _compile(autopar.Plan(dp="zero3"), layers=3, dp=2)
    sizes = unit_ahead_bytes(probe.ctx)
    layer = max(sizes)
    dm = _compile(autopar.Plan(dp="zero3", prefetch_bytes=0), layers=3, dp=2)
    assert all(p["start"] == p["wait"] - 1 for p in _unit_positions(dm).values())
    assert _ahead_after_each_start(dm, sizes) == []
    for budget in (layer, 2 * layer):
        dm = _compile(autopar.Plan(dp="zero3", prefetch_bytes=budget), layers=3, dp=2)
        ahead = _ahead_after_each_start(dm, sizes)
        assert ahead and max(ahead) <= budget, (budget, ahead)
        assert max(ahead) > budget - layer          # not stingier than the budget needs
    dm = _compile(autopar.Plan(dp="zero3", prefetch_bytes=10 * sum(sizes)), layers=3, dp=2)
    pos = _unit_positions(dm)                       # 4 units: at most 2 in flight beside the one in use
    for k, p in pos.items():
        in_flight = [j for j, q in pos.items() if j != k and q["start"] < p["wait"] < q["wait"]]
        assert len(in_flight) <= len(pos) - 2, (k, in_flight)
    assert pos[1]["wait"] < pos[3]["start"] < pos[2]["wait"]    # ... and as far as that allows
    # a model of two units gets no prefetch by default: one ahead would gather everything
    two = _compile(autopar.Plan(dp="zero3"), layers=1, dp=2)
    assert all(p["start"] == p["wait"] - 1 for p in _unit_positions(two).values())


def test_overlap_off_waits_at_once():
    dm = _compile(autopar.Plan(dp="zero3", tp=True, sp=True, overlap=False), dp=2, tp=2)
    nodes = _order(dm)
    starts = [i for i, n in enumerate(nodes) if n.op == "call_function" and n.target in (dp_unit_start, tp_start)]
    assert starts
    for i in starts:
        nxt = nodes[i + 1]
        assert nxt.target in (dp_unit_wait, tp_wait) and (nxt.args[0] is nodes[i] or nxt.args[1] == nodes[i].args[1])


def test_tp_waits_right_before_first_use():
    """tp+sp: every forward collective is a tp_start right after its input and a tp_wait right
    before its first reader; nothing else of the tp axis is synchronous in forward."""
    dm = _compile(autopar.Plan(tp=True, sp=True), tp=2)
    nodes = _order(dm)
    index = {n: i for i, n in enumerate(nodes)}
    starts = [n for n in nodes if n.op == "call_function" and n.target is tp_start]
    assert len(starts) == 2 * 2 * 2 + 1        # per layer 2 gathers + 2 reduce-scatters, and the head's gather
    for s in starts:
        assert index[s] == index[s.args[1]] + 1 or nodes[index[s] - 1].target is tp_start
        (w,) = s.users
        assert w.target is tp_wait
        first = min(index[u] for u in w.users)
        assert index[w] == first - 1
    assert not any(n.op == "call_function" and getattr(n.target, "__name__", "") in
                   ("tp_all_reduce", "tp_gather", "tp_reduce_scatter") for n in nodes)


def test_collective_matmul_replaces_the_pairs():
    """collective_matmul: per layer, the all-gathers before qkv and fc become all_gather_matmul
    and the reduce-scatters after proj and out become matmul_reduce_scatter."""
    dm = _compile(autopar.Plan(tp=True, sp=True, collective_matmul=True), tp=2)
    targets = [n.target for n in _order(dm) if n.op == "call_function"]
    assert targets.count(all_gather_matmul) == 4 and targets.count(matmul_reduce_scatter) == 4
    assert sum(1 for n in _order(dm) if n.target is tp_start) == 1     # the head's gather stays
    with pytest.raises(ValueError, match="collective_matmul=True\\) needs tp=True and sp=True"):
        autopar.Plan(tp=True, collective_matmul=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_collective_order_mismatch_is_an_error_not_a_hang(ranks):
    """Ranks compiling different models: every rank gets a ValueError naming the group and the
    first collective that differs, before any step (ddp, zero3 and tp)."""
    per_rank = ranks(errors.order_mismatch, 2, timeout=240)
    for rank, out in enumerate(per_rank):
        for name in ("ddp", "zero3", "tp"):
            msg = out[name]
            assert msg is not None, f"rank {rank}: {name} compiled although the ranks' models differ"
            axis = "tp" if name == "tp" else "dp"
            assert f"ranks of {axis} group [0, 1] would issue different collectives" in msg
            assert "at collective #" in msg and "Running would hang there" in msg
        assert out["after"]


@pytest.mark.slow
@pytest.mark.timing
@pytest.mark.timeout(300)
def test_dump_writes_measured_and_predicted_timeline(ranks, local_cluster, tmp_path):
    """After record_timeline, dump writes timeline.json: a compute and a communication lane per
    rank, measured, and the cost model's predicted lanes of the same plan (by the calibrated
    local preset) beside them."""
    per_rank = ranks(overlap.timeline_and_dump, 2, str(tmp_path), {"dp": "zero3"}, timeout=240)
    for r in per_rank:
        assert r["n_timelines"] == 2
        comm = [e for e in r["events"] if e[0] == "comm"]
        assert len(comm) == r["calls"]        # every collective of the step is on the lane
        assert all(0 <= a <= b <= r["duration"] + 1e-3 for _, _, a, b in r["events"])
        assert 0 <= r["exposed"] <= r["duration"]
        lanes = {lane for lane, *_ in r["lanes"]}
        assert lanes == {"compute", "comm"}
    assert "timeline.json" in per_rank[0]["files"]
    trace = json.loads((tmp_path / "timeline.json").read_text())
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert any(n.startswith("rank 0 (measured)") for n in names) and any(n.startswith("rank 1 (measured)") for n in names)
    cats = {e.get("cat") for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"measured compute", "measured comm"} <= cats
    assert any(n.startswith("rank 0 (predicted)") for n in names)
    assert {"predicted compute", "predicted comm"} <= cats


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_prefetch_stays_within_the_memory_budget(ranks):
    """ZeRO-3 on 4 layers with prefetch budgets of 0, one and two layer units and None (one
    unit ahead): the gathers in flight at once (issued, not yet waited on) never exceed the
    budget (or one unit, when a unit is larger), and the measured peak of a step's allocations
    (median of 5 steps) grows by no more than the budget over no prefetch (within that run's
    step-to-step spread)."""
    out = ranks(overlap.prefetch_memory, 2, (0, 1, 2, None), timeout=300)
    for r in out:
        # the profiler's peak of a step varies from step to step here (gloo frees a gathered
        # unit's buffers from its own thread, a moment after the wait: some steps hold one more
        # unit), and a run's 5 steps can all fall on one side: the comparison allows the largest
        # step-to-step spread of the runs
        spread = max(max(g["peaks"]) - min(g["peaks"]) for g in r.values())
        base = r[0]["peak"] + spread
        for m, got in r.items():
            largest = max(got["units"])
            budget = got["budget"] if got["budget"] is not None else largest
            assert got["inflight"] <= max(budget, largest), (m, got)   # a unit over budget goes alone
            if budget:
                assert got["peak"] <= base + budget, (m, got["peak"], base, budget)
        assert r[0]["inflight"] <= max(r[0]["units"])          # no prefetch: one gather at a time
        assert r[2]["inflight"] > r[1]["inflight"]               # the larger budget is used


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pipeline_timeline_shows_the_transfers(ranks, tmp_path):
    per_rank = ranks(pipeline.pipeline_timeline, 2, str(tmp_path / "d"), timeout=240)
    for r in per_rank:
        assert r["n"] == 2
        assert {"send[pp]", "recv[pp]"} <= set(r["names"]), r["names"]
    assert "timeline.json" in per_rank[0]["files"] and "trace.json" in per_rank[0]["files"]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_different_plans_on_the_ranks_are_an_error(ranks):
    for msg in ranks(errors.order_mismatch_plans, 2, timeout=150):
        assert msg is not None and "at collective #0 on dp" in msg and "overlap=False" in msg, msg


def test_megatron_f_backward_all_reduce_runs_under_the_weight_gradient():
    """tp: Megatron's f before each column product is fused with it (tp_copy_linear: the input
    gradient's all-reduce goes out before the weight gradient is computed); off, it is not."""
    on = [n.target for n in _order(_compile(autopar.Plan(tp=True), tp=2)) if n.op == "call_function"]
    off = [n.target for n in _order(_compile(autopar.Plan(tp=True, overlap=False), tp=2)) if n.op == "call_function"]
    assert on.count(tp_copy_linear) == 4 and tp_copy not in on          # qkv and fc of 2 layers
    assert off.count(tp_copy) == 4 and tp_copy_linear not in off
