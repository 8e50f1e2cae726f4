"""autopar.verify: correct plans verify to float noise, and a broken sharding rule or a broken
backward is found and named.

The ranks are threads of this process (torch's threaded process group), so a monkeypatch of a
rule or of the runtime reaches every rank. The node a broken rule produced is found
independently: compiled on a fake process group, it is the first node whose strategy is one
the broken rule added.
"""
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar import meta, zoo
from autopar.models import small
from autopar.passes.rules import RULES
from autopar.passes.rules.pointwise import partial_strategy
from autopar.runtime import tpcomm
from autopar.testing import fake_rank, run_threads

aten = torch.ops.aten
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gpt(batch=4):
    return small("tiny-gpt", batch=batch)


def _verify(mesh, plan, **kw):
    model, inputs, target, loss_fn = _gpt()
    return autopar.verify(model, mesh, plan, example_inputs=inputs, target=target, loss_fn=loss_fn,
                          timeout=60, **kw)


@pytest.mark.timeout(120)
def test_zero3_on_two_ranks_verifies():
    rep = _verify(autopar.Mesh(dp=2, virtual=True), autopar.Plan(dp="zero3"))
    assert rep.ok, str(rep)
    assert rep.ranks == "threads" and not rep.skipped
    assert rep.nodes_checked == 77 and rep.gradients_checked == 75     # every node of the captured graph
    assert rep.largest_scaled_error < 1e-5
    assert str(rep).startswith("verified: 77 nodes, forward and gradient")


@pytest.mark.timeout(120)
def test_tensor_and_sequence_parallel_verifies():
    rep = _verify("dp=1,tp=2", "Plan(dp='ddp', tp=True, sp=True)")
    assert rep.ok, str(rep)
    assert not rep.skipped         # the fused regions are entered, the moved biases found
    assert rep.nodes_checked == 77 and rep.largest_scaled_error < 1e-5


def _broken_add(injected: list):
    """aten.add's rule, also claiming P(sum) + R -> P(sum): it forgets that the replicated
    term is then added on every rank."""
    correct = RULES[aten.add.Tensor]

    def rule(info):
        extra = [partial_strategy(info, "sum", {0}), partial_strategy(info, "sum", {1})]
        injected.extend(extra)
        return correct(info) + extra
    return rule


@pytest.mark.timeout(120)
def test_a_broken_sharding_rule_is_found_and_named(monkeypatch):
    injected = []
    monkeypatch.setitem(RULES, aten.add.Tensor, _broken_add(injected))
    model, inputs, target, loss_fn = _gpt()
    with fake_rank(2, 0):       # where the broken strategy was used: the first node that took one
        dm = autopar.compile(model, autopar.Mesh(tp=2), example_inputs=inputs, plan=autopar.Plan(tp=True))
        broken = [n for n in dm.module.graph.nodes if n.meta.get(meta.STRATEGY, {}).get("tp") in injected]
    assert broken, "the planner did not choose the broken strategy: the test no longer tests anything"
    rep = autopar.verify(model, "tp=2", autopar.Plan(tp=True), example_inputs=inputs, target=target,
                         loss_fn=loss_fn, timeout=60)
    d = rep.first_divergence
    assert not rep.ok and d is not None
    # tp moved linear_1's bias after it: the logical linear_1 is measured at that add, the node
    # the broken rule laid out P(sum)
    assert (d.node, d.at, d.phase, d.layout) == ("linear_1", broken[0].name, "forward", "tp:P(sum)")
    assert d.at == "add_tensor" and d.error > 0.1
    assert str(rep).startswith("diverges at node linear_1 (aten.linear.default, measured at add_tensor) "
                               "layout tp:P(sum): scaled error")


@pytest.mark.timeout(120)
def test_a_broken_backward_is_found_in_the_gradient(monkeypatch):
    """Megatron's f fused with the column product forgets its all-reduce: forward is right, the
    gradient of the product's input is one rank's addend."""
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        return g.matmul(weight), g2.t().matmul(x.reshape(-1, x.shape[-1])), g2.sum(0), None
    monkeypatch.setattr(tpcomm._CopyLinear, "backward", staticmethod(backward))
    rep = _verify("tp=2", autopar.Plan(tp=True))
    d = rep.first_divergence
    assert not rep.ok and d.phase == "gradient"
    # backward order: the last column product's input (block 1's MLP) is the first one reached
    assert (d.node, d.layout, d.collective) == ("layer_norm_3", "tp:R", "linear_6_f")
    assert "tp ranks 0 and 1 hold different values" in d.detail
    assert "in its gradient" in str(rep) and "fed by linear_6_f (backward all_reduce[tp]" in str(rep)


@pytest.mark.timeout(60)
def test_plans_it_cannot_run_are_refused():
    model, inputs, target, loss_fn = _gpt()
    with pytest.raises(NotImplementedError, match="without a pipeline"):
        autopar.verify(model, "pp=2", autopar.Plan(pp_schedule="gpipe", microbatches=2), example_inputs=inputs)
    with pytest.raises(ValueError, match="send point to point"):
        autopar.verify(model, "tp=2", "Plan(dp='ddp', tp=True, sp=True, collective_matmul=True)",
                       example_inputs=inputs, spawn=False)
    with pytest.raises(ValueError, match="concrete plan"):
        autopar.verify(model, "dp=2", "auto", example_inputs=inputs)


def _all_reduce_once():
    t = torch.ones(2)
    dist.all_reduce(t)
    return t


def _all_reduce_unless_rank1():
    if dist.get_rank() == 1:
        raise KeyError("rank 1 gives up")
    t = torch.ones(2)
    dist.all_reduce(t)     # rank 1 never joins: woken when it fails
    return t


@pytest.mark.timeout(60)
def test_threaded_ranks_collect_and_report():
    assert [float(t.sum()) for t in run_threads(_all_reduce_once, 3)] == [6.0, 6.0, 6.0]
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed:(.|\n)*rank 1 gives up"):
        run_threads(_all_reduce_unless_rank1, 2, timeout=20)


def test_plans_read_in_short_form():
    assert autopar.Plan.parse("dp=zero3,tp,sp") == autopar.Plan(dp="zero3", tp=True, sp=True)
    assert autopar.Plan.parse("dp=zero1, bucket_bytes=1024") == autopar.Plan(dp="zero1", bucket_bytes=1024)
    with pytest.raises(ValueError, match="'tpp' is not a Plan field"):
        autopar.Plan.parse("dp=zero3,tpp")


@pytest.mark.slow      # a subprocess: python's and torch's start-up (kept out of the fast tier's budget)
@pytest.mark.timeout(120)
def test_cli_verifies_a_plan():
    out = subprocess.run([sys.executable, "-m", "autopar", "verify", "--model", "tiny-mlp", "--mesh", "dp=2",
                          "--plan", "dp=zero2"], cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ranks as threads" in out.stdout
    assert out.stdout.strip().splitlines()[-1].startswith("verified: 12 nodes, forward and gradient")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_processes_give_the_same_report_as_threads():
    plan = autopar.Plan(tp=True, sp=True)
    threads, procs = _verify("tp=2", plan), _verify("tp=2", plan, spawn=True)
    assert (threads.ranks, procs.ranks) == ("threads", "processes")
    assert threads.ok and procs.ok
    assert (threads.nodes_checked, threads.gradients_checked) == (procs.nodes_checked, procs.gradients_checked)
    assert set(threads.errors) == set(procs.errors)
    assert procs.largest_scaled_error < 1e-5


@pytest.mark.timeout(120)
@pytest.mark.parametrize("plan", ["tp,sp", pytest.param("dp=zero3", marks=pytest.mark.slow)])
def test_a_model_that_fills_an_empty_buffer_and_averages_across_tp_verifies(plan):
    """Hugging Face DeepSeek-V3's attention fills keys made by ``new_empty`` slice by slice (a
    functionalised write: every value defined), and its low-rank norms leave a tp partial
    average, whose gradient each rank holds a 1/tp share of."""
    mesh = "dp=2" if plan.startswith("dp") else "tp=2"
    rep = autopar.verify(zoo.build("deepseek_v3"), mesh, plan, example_inputs=(),
                         example_kwargs=zoo.batch("deepseek_v3", 4), loss_fn=lambda out: out.loss)
    assert rep.ok, str(rep)
