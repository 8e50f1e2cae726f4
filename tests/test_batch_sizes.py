"""Any batch size under every plan, down to one sequence per rank or per micro-batch (Megatron's
usual micro-batch of one); a batch that does not divide is an error naming the axis and what
divides.

At one row the batch's dim has size 1, which sharding rules leave whole; the data-parallel walk
must still mark it (dropout masks are sliced per micro-batch along it, sequence parallelism
keeps to batch activations): the marks at one row are checked against the walk at two rows,
and parity runs with dropout on. Parity tolerance is ``autopar.testing.parity``'s.
"""
import pytest
import torch

import autopar
from autopar import meta
from autopar.capture import capture
from autopar.context import CompileContext
from autopar.models import GPTConfig, Llama, LlamaConfig, TinyGPT, gpt_batch
from autopar.passes import shard
from autopar.runtime import slice_batch

from jobs import batches

C = GPTConfig(layers=2)


def _check(reports):
    for per_rank in reports:
        for r in per_rank:
            assert r["ok"], (f"{r['label']}: loss {r['loss_err']:.3g} grad {r['grad_err']:.3g} "
                             f"param {r['param_err']:.3g} {r['messages']}")


# ---- parity on real processes -----------------------------------------------------------------

@pytest.mark.timeout(200)
def test_one_sequence_per_microbatch_pp2_1f1b(ranks):
    """pp=2, 1F1B, 4 micro-batches of one sequence, with dropout (masks sliced per micro-batch
    along the batch dim the walk marked at one row)."""
    _check(ranks(batches.parity_batches, 2, [({"pp": 2}, dict(pp_schedule="1f1b", microbatches=4), 4,
                                              dict(dropout=0.1))], timeout=150))


@pytest.mark.timeout(200)
def test_one_sequence_per_rank_zero3_dp2(ranks):
    _check(ranks(batches.parity_batches, 2, [({"dp": 2}, dict(dp="zero3"), 2, {})], timeout=150))


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_one_sequence_per_microbatch_or_rank_world2(ranks):
    """Interleaved and zero-bubble pipelines at one sequence per micro-batch; one sequence per
    rank under ddp (dropout); tp=2 with sp (dropout) on one sequence, in float64 (in fp32 its
    rounding, through three Adam steps, reaches the tolerance on some CPUs). (1F1B at 8 micro-batches
    of one sequence: the world-4 test's pp=4.)"""
    configs = [({"pp": 2}, dict(pp_schedule="interleaved", microbatches=4, virtual_stages=2), 4, dict(dropout=0.1)),
               ({"pp": 2}, dict(pp_schedule="zero_bubble", microbatches=4), 4, {}),
               ({"dp": 2}, dict(dp="ddp"), 2, dict(dropout=0.1)),
               ({"tp": 2}, dict(tp=True, sp=True), 1, dict(dropout=0.1, dtype=torch.float64))]
    _check(ranks(batches.parity_batches, 2, configs, timeout=450))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_sequence_per_microbatch_or_rank_world4(ranks):
    """pp=4 1F1B with 8 micro-batches of one sequence; pp=2 x dp=2 under ZeRO-3 with one
    sequence per rank and micro-batch, with dropout; pp=2 x tp=2 with sequence parallelism at
    one sequence per micro-batch. (One sequence per rank under ZeRO-3 alone: the fast tier's
    dp=2.)"""
    configs = [({"pp": 4}, dict(pp_schedule="1f1b", microbatches=8), 8, {}),
               ({"pp": 2, "dp": 2}, dict(dp="zero3", pp_schedule="1f1b", microbatches=4), 8, dict(dropout=0.1)),
               ({"pp": 2, "tp": 2}, dict(tp=True, sp=True, pp_schedule="1f1b", microbatches=4), 4, dict(dropout=0.1))]
    _check(ranks(batches.parity_batches, 4, configs, timeout=550))


# ---- the batch dim at one row ----------------------------------------------------------------

def _marks(model, x, **axes):
    ctx = CompileContext(mesh=autopar.Mesh(virtual=True, **(axes or {"dp": 1})),
                         plan=autopar.Plan(tp=True, sp=True) if "tp" in axes else autopar.Plan())
    gm = shard(capture(model, (x,), {}, ctx), ctx)
    return {n.name: str(s.output) for n in gm.graph.nodes if (s := n.meta.get(meta.STRATEGY, {}).get("dp"))}


@pytest.mark.parametrize("name", ["gpt", "gpt-tp-sp", "llama", "hf-gpt2"])
def test_the_walk_marks_the_batch_at_one_row_as_at_two(name):
    """Every node's dp placement at one row (dp=1) equals the one at two rows. Hugging Face GPT-2
    merges batch and sequence ([16, h] at one row) and views them apart again, which rules
    alone map onto the 16."""
    if name == "hf-gpt2":
        pytest.importorskip("transformers")
        from jobs.hf import hf_model
        model, tokens = (lambda: hf_model("gpt2")), (lambda b: torch.randint(0, 97, (b, 16)))
    elif name == "llama":
        model, tokens = (lambda: Llama(LlamaConfig(layers=1))), (lambda b: torch.randint(0, 64, (b, 16)))
    else:
        c = GPTConfig(layers=1, dropout=0.1)
        model, tokens = (lambda: TinyGPT(c)), (lambda b: gpt_batch(c, b)[0])
    axes = {"tp": 2} if name == "gpt-tp-sp" else {}
    one, two = _marks(model(), tokens(1), **axes), _marks(model(), tokens(2), **axes)
    # export drops an expand that is a no-op at one row (HF's attention mask): compare the rest
    common = [k for k in two if k in one and not k.startswith("expand")]
    assert len(common) > 0.9 * len(two)
    assert {k: one[k] for k in common} == {k: two[k] for k in common}


def test_cost_model_takes_a_one_sequence_example():
    x, _ = gpt_batch(C, 1)
    est = autopar.estimate(TinyGPT(C), autopar.Mesh(pp=2, virtual=True),
                           autopar.Plan(pp_schedule="1f1b", microbatches=8), example_inputs=(x,), global_batch=8,
                           cluster="dgx-h100")
    assert est.step_time_s > 0
    report = autopar.plan(TinyGPT(C), 4, example_inputs=(x,), global_batch=8, top=2, detail=False,
                          cluster="dgx-h100")
    assert report.candidates


def test_pipeline_of_one_sequence_per_microbatch_compiles():
    x, _ = gpt_batch(C, 8)
    dm = autopar.compile(TinyGPT(C), autopar.Mesh(pp=2, virtual=True), example_inputs=(x,),
                         plan=autopar.Plan(pp_schedule="1f1b", microbatches=8))
    assert dm.ctx.microbatch_rows == 1


# ---- batches that do not divide ---------------------------------------------------------------

def test_batch_that_does_not_divide_by_dp_names_the_axis():
    x, _ = gpt_batch(C, 3)
    for plan in (autopar.Plan(dp="zero3"), "auto"):
        with pytest.raises(ValueError, match=r"3 rows along dim 0, which does not divide by dp=2.*multiple of 2 "
                                             r"\(2 or 4 rows\)"):
            autopar.compile(TinyGPT(C), autopar.Mesh(dp=2, virtual=True), example_inputs=(x,), plan=plan)
    with pytest.raises(ValueError, match=r"1 row along dim 0, which does not divide by dp=2"):
        autopar.estimate(TinyGPT(C), autopar.Mesh(dp=2, virtual=True), autopar.Plan(), example_inputs=(x[:1],),
                         cluster="dgx-h100")
    with pytest.raises(autopar.InfeasiblePlan, match=r"Mesh\(dp=2\): the global batch has 3 rows.*dp=2"):
        autopar.plan(TinyGPT(C), 2, example_inputs=(x,), mesh_axes={"dp": 2}, cluster="dgx-h100")


def test_batch_that_does_not_divide_into_microbatches_names_the_axis():
    x, _ = gpt_batch(C, 12)
    with pytest.raises(ValueError, match=r"12 rows along dim 0 \(6 per dp rank\), which does not divide by "
                                         r"microbatches=4.*multiple of 8.*microbatches that divide 6 \(1, 2, 3, 6\)"):
        autopar.compile(TinyGPT(C), autopar.Mesh(pp=2, dp=2, virtual=True), example_inputs=(x,),
                        plan=autopar.Plan(pp_schedule="gpipe", microbatches=4))
    with pytest.raises(ValueError, match=r"this rank's slice of the batch has 6 rows along dim 0, which does not "
                                         r"divide by microbatches=4"):
        slice_batch(torch.zeros(6, 16), 4, 0, "microbatches")


@torch.library.custom_op("autopar_batch_test::opaque", mutates_args=())
def _opaque(x: torch.Tensor) -> torch.Tensor:
    """An op no sharding rule knows (so the dp walk cannot follow the batch through it)."""
    return x.clone()


@_opaque.register_fake
def _(x):
    return torch.empty_like(x)


class _OpaqueThenDropout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        for lin in self.layers:
            x = torch.nn.functional.dropout(_opaque(lin(x)), 0.1, self.training)
        return x


def test_an_op_the_batch_cannot_be_followed_through_is_refused_in_a_pipeline():
    """A pipeline runs its micro-batches apart: an op reading the batch that autopar cannot show
    keeps samples apart (no rule, and at one row per micro-batch the search has no batch dim to
    split) is refused, naming it; at two rows the search finds the op row-wise and it compiles."""
    with pytest.raises(ValueError, match=r"node opaque .*no sharding rule.*2 micro-batches apart"):
        autopar.compile(_OpaqueThenDropout(), autopar.Mesh(pp=2, virtual=True), example_inputs=(torch.randn(2, 8),),
                        plan=autopar.Plan(pp_schedule="gpipe", microbatches=2))
    autopar.compile(_OpaqueThenDropout(), autopar.Mesh(pp=2, virtual=True), example_inputs=(torch.randn(4, 8),),
                    plan=autopar.Plan(pp_schedule="gpipe", microbatches=2))