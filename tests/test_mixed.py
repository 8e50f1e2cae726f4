"""Mixed precision (Plan(param_dtype=torch.bfloat16)): the plan fields, the autocast rule, the
dtype of the outputs, the parity comparison against mutated gradients, and on real processes
parity against the single-device model under the same policy, the masters' gradients of
replicated parameters under tp, the dtype of every collective's buffer, bytes by dtype against
the formula, and the model states' memory after a step against ``autopar.sizes.mixed_state_dtypes``.

Parity tolerances are in units of bf16's epsilon (``autopar.testing.MIXED_TOLERANCE``)."""
import copy

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.models import GPTConfig, TinyGPT, gpt_batch, lm_loss
from autopar.sizes import mixed_state_dtypes, padded_numel, ring_bytes, state_bytes
from autopar.testing import MIXED_TOLERANCE, MixedReference, fake_rank, mixed_error

from jobs import mixed

BF16 = torch.bfloat16


# ---- the plan ---------------------------------------------------------------------------------

def test_plan_precision_fields_round_trip_and_refuse_what_is_not_built():
    p = autopar.Plan(dp="zero3", param_dtype=BF16)
    assert str(p) == "Plan(dp='zero3', param_dtype='bfloat16')"
    assert autopar.Plan.parse(str(p)) == p
    assert autopar.Plan.parse("dp=zero2,param_dtype=bf16,reduce_dtype=bf16").reduce_dtype == BF16
    assert p.grad_reduce_dtype == torch.float32          # sums in fp32 unless told otherwise
    assert autopar.Plan().grad_reduce_dtype is None        # no mixed precision: as before
    with pytest.raises(ValueError, match="loss scaling"):
        autopar.Plan(param_dtype=torch.float16)
    with pytest.raises(ValueError, match="needs param_dtype"):
        autopar.Plan(reduce_dtype=torch.float32)
    with pytest.raises(ValueError, match="narrower"):
        autopar.Plan(param_dtype=torch.float32, master_dtype=BF16)
    with pytest.raises(ValueError, match="not a dtype"):
        autopar.Plan(param_dtype="int8")
    with pytest.raises(ValueError, match="backward ring sums"):     # its ring would not honour reduce_dtype
        autopar.Plan(tp=True, sp=True, collective_matmul=True, param_dtype=BF16)
    assert autopar.Plan(tp=True, sp=True, collective_matmul=True, param_dtype=BF16, reduce_dtype=BF16).sp


def test_output_dtype_round_trips_and_needs_param_dtype():
    p = autopar.Plan(param_dtype=BF16, output_dtype=BF16)
    assert str(p) == "Plan(dp='ddp', param_dtype='bfloat16', output_dtype='bfloat16')"
    assert autopar.Plan.parse(str(p)) == p
    assert autopar.Plan.parse("param_dtype=bf16,output_dtype=bf16") == p
    assert p.output_cast_dtype == BF16
    assert autopar.Plan(param_dtype=BF16).output_cast_dtype == torch.float32     # fp32 unless told otherwise
    assert autopar.Plan(param_dtype=BF16, master_dtype=torch.float64).output_cast_dtype == torch.float64
    assert autopar.Plan().output_cast_dtype is None                              # no mixed precision: no cast
    with pytest.raises(ValueError, match="needs param_dtype"):
        autopar.Plan(output_dtype=torch.float32)
    with pytest.raises(ValueError, match="not a dtype"):
        autopar.Plan(param_dtype=BF16, output_dtype="int8")
    with pytest.raises(TypeError, match="takes a torch dtype"):
        autopar.Plan(param_dtype=BF16, output_dtype=3)


# ---- the outputs ------------------------------------------------------------------------------

class _OwnLoss(torch.nn.Module):
    """Logits and the model's own loss, computed in the graph (autocast puts it in fp32)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 5)

    def forward(self, x, y):
        logits = self.fc(x)
        return logits, F.cross_entropy(logits, y)


def test_outputs_leave_in_fp32_unless_the_plan_keeps_bf16():
    """The logits computed in bf16 leave the module in fp32, differentiably, so that a loss the
    caller computes on them runs in fp32; ``output_dtype=torch.bfloat16`` keeps them in bf16;
    the model's own loss, which autocast computed in fp32 inside the graph, stays fp32 either
    way, its value unchanged."""
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randint(0, 5, (4,))
    model = _OwnLoss()
    with fake_rank(1):
        got = {}
        for od in (None, BF16):
            dm = autopar.compile(copy.deepcopy(model), autopar.Mesh(dp=1), example_inputs=(x, y),
                                 plan=autopar.Plan(param_dtype=BF16, output_dtype=od))
            logits, own = dm(x, y)
            mine = F.cross_entropy(logits, y)
            (mine + own).backward()
            got[od] = logits, own, mine, dm.full_grads()["fc.weight"]
    logits, own, mine, grad = got[None]
    assert (logits.dtype, own.dtype, mine.dtype, grad.dtype) == (torch.float32,) * 4
    kept, own_kept, mine_kept, _ = got[BF16]
    assert (kept.dtype, own_kept.dtype, mine_kept.dtype) == (BF16, torch.float32, BF16)
    assert torch.equal(logits, kept.float()) and torch.equal(own, own_kept)
    assert float(mine.detach()) != float(mine.detach().to(BF16))    # not a bf16-rounded loss
    ref = MixedReference(model, BF16)             # the same policy on one device
    out, loss = ref.forward_backward((x, y), {}, lambda o: F.cross_entropy(o[0], y) + o[1])
    assert out[0].dtype == torch.float32 and torch.equal(out[0], logits)
    assert mixed_error("grad", grad, model.fc.weight.grad, BF16) <= 1


@pytest.mark.timeout(300)
def test_pipeline_hands_the_loss_fp32_outputs(ranks):
    """1F1B on two stages: the last stage's outputs reach ``loss_fn`` in fp32, as ``dm(x)``'s do,
    in ``train_step`` and in ``eval_step``; the first stage's rank calls no ``loss_fn``. Without a
    loss, ``eval_step`` returns the logits (fp32, the slice's rows) on the last stage's rank."""
    (first, _, none), (trained, evaluated, logits) = ranks(mixed.pipeline_output_dtypes, 2, timeout=240)
    assert first == [] and trained == evaluated == ["float32", "float32"], (first, trained, evaluated)
    c = GPTConfig()
    assert none is None and logits == ("float32", (8, c.seq, c.vocab)), (none, logits)


# ---- the parity comparison --------------------------------------------------------------------

def test_mixed_parity_fails_a_gradient_ten_percent_off_or_with_elements_zeroed():
    """The comparison against what bf16 rounding really produces: the GPT's gradients on one
    device under the bf16 policy, from the whole batch (the reference) and from its two halves
    averaged in fp32 (what two dp ranks hand the masters), pass for every parameter; the
    halves' gradient scaled by 1.1, or with 38% of its elements zeroed, or with one NaN, fails
    for every parameter, as an output 10% off does."""
    c = GPTConfig()
    tok, tgt = gpt_batch(c, 8)
    torch.manual_seed(0)
    ref = MixedReference(TinyGPT(c), BF16)

    def grads(rows):
        out, _ = ref.forward_backward((tok[rows],), {}, lambda o: lm_loss(o, tgt[rows]))
        return out, {k: p.grad.clone() for k, p in ref.master.named_parameters()}

    out, whole = grads(slice(0, 8))
    halves = [grads(slice(0, 4))[1], grads(slice(4, 8))[1]]
    eps = torch.finfo(BF16).eps
    floor = eps * max(float(g.abs().max()) for g in whole.values())
    pick = torch.Generator().manual_seed(0)
    for k, want in whole.items():
        got = (halves[0][k] + halves[1][k]) / 2
        assert mixed_error("grad", got, want, BF16, floor) <= 1, k
        zeroed = got.masked_fill(torch.rand(got.shape, generator=pick) < 0.38, 0.0)
        nan = got.flatten().clone()
        nan[0] = float("nan")
        for bad in (got * 1.1, zeroed, nan.view_as(got)):
            assert mixed_error("grad", bad, want, BF16, floor) > 1, k
    assert mixed_error("output", out * 1.1, out, BF16) > 1
    assert mixed_error("grad", got[:1], want, BF16) == float("inf")     # a shape mismatch


# ---- the autocast rule ------------------------------------------------------------------------

class _Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 5)
        self.ln = torch.nn.LayerNorm(8)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.fc(self.ln(x)).softmax(-1), y)


def test_autocast_pass_casts_what_torch_autocast_casts_on_this_device():
    """The loss's input is cast to fp32 (CPU autocast's fp32 list), layer_norm, linear and
    softmax stay in bf16; the graph's output dtype equals autocast's on the same copy."""
    x, y = torch.randn(4, 8), torch.randint(0, 5, (4,))
    model = _Head()
    dm = autopar.compile(model, autopar.Mesh(dp=1, virtual=True, rank=0), example_inputs=(x, y),
                         plan=autopar.Plan(param_dtype=BF16))
    text = dict(dm.ctx.snapshots)["autocast"]
    casts = [line for line in text.splitlines() if "= aten._to_copy" in line]
    assert len(casts) == 1 and "f32" in casts[0], text
    nodes = {n.target: n for n in dm.module.graph.nodes if n.op == "call_function"}
    aten = torch.ops.aten
    assert nodes[aten.layer_norm.default].meta["val"].dtype == BF16
    assert nodes[aten.linear.default].meta["val"].dtype == BF16
    assert nodes[aten.cross_entropy_loss.default].meta["val"].dtype == torch.float32
    ref = _Head()
    ref.load_state_dict(model.state_dict())
    with torch.autocast("cpu", dtype=BF16):
        want = ref.to(BF16)(x.to(BF16), y)
    assert want.dtype == nodes[aten.cross_entropy_loss.default].meta["val"].dtype


# ---- real processes ---------------------------------------------------------------------------

def _check(reports, name):
    for r in (rep[name] for rep in reports):
        assert r.ok, (f"{name} rank {r.rank}: output {r.output_err:.3g} loss {r.loss_err:.3g} grad {r.grad_err:.3g} "
                      f"master update {r.param_err:.3g} (1 = the tolerance {MIXED_TOLERANCE}) {r.messages}")
        assert r.ref_losses[-1] < r.ref_losses[0]


@pytest.mark.timeout(300)
def test_zero3_bf16_matches_one_device_under_the_same_policy(ranks):
    _check(ranks(mixed.mixed_parity, 2, ["zero3", "tp+sp"], timeout=240), "zero3")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_plan_in_bf16_matches_one_device_under_the_same_policy(ranks):
    names = ["ddp", "zero1", "zero2", "zero3", "tp", "tp+sp", "pp 1f1b"]
    reports = ranks(mixed.mixed_parity, 2, names, timeout=500)
    for name in names:
        _check(reports, name)
    _check(ranks(mixed.mixed_parity, 8, ["pp x zero2 x tp+sp"], timeout=500), "pp x zero2 x tp+sp")


def _fp32_sum_of_addends(every) -> torch.Tensor:
    """What the masters of ``ln_f`` should receive, computed here from the ranks' addends: per dp
    coordinate, the tp ranks' bf16 partial gradients summed in fp32, micro-batch after micro-batch;
    averaged over dp (two addends at most: exact in any order)."""
    by_dp: dict = {}
    for dp, sent in every:
        if sent:
            by_dp.setdefault(dp, []).append(sent)
    sums = []
    for ranks_sent in by_dp.values():
        per_mb = [sum(parts[1:], parts[0]) for parts in zip(*ranks_sent)]
        sums.append(sum(per_mb[1:], per_mb[0]))
    return sum(sums[1:], sums[0]) / len(sums)


def _check_masters_hold_the_fp32_sum(out):
    """Every rank holding ``ln_f`` has its masters' gradients equal to ``_fp32_sum_of_addends``."""
    every = out[0][0]
    want = _fp32_sum_of_addends(every)
    assert want.dtype == torch.float32
    assert not torch.equal(want, want.to(BF16).float())     # the sum has bits bf16 would drop
    for (dp, sent), (_, grads) in zip(every, out):
        if sent:
            got = torch.cat([grads["ln_f.weight"], grads["ln_f.bias"]])
            assert got.dtype == torch.float32
            assert torch.equal(got, want), float((got - want).abs().max())


@pytest.mark.timeout(300)
def test_replicated_parameters_reach_the_masters_as_the_fp32_sum_of_the_bf16_partials(ranks):
    """tp + sp on two ranks, bf16: the final norm's weight and bias are read per rank (each its
    sequence shard), so each rank's gradient is a bf16 partial. Their fp32 sum, computed here
    from the addends as the ranks sent them, is what the fp32 masters hold, bit for bit, not
    its bf16 rounding."""
    _check_masters_hold_the_fp32_sum(ranks(mixed.replicated_grad_sums, 2, {"tp": 2}, "tp,sp,param_dtype=bf16",
                                           timeout=240))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("axes, plan", [
    ({"dp": 2, "tp": 2}, "dp=zero3,tp,sp,param_dtype=bf16"),
    ({"dp": 2, "tp": 2}, "dp=zero1,tp,sp,param_dtype=bf16"),
    ({"pp": 2, "tp": 2}, "pp_schedule='1f1b',microbatches=2,tp,sp,param_dtype=bf16"),
], ids=["zero3", "zero1", "pp"])
def test_replicated_parameters_reach_the_masters_unrounded_under_every_reducer(ranks, axes, plan):
    """As above on four ranks, where the sums reach the masters through ZeRO-3's and ZeRO-1's
    reducers (averaged over dp) and through a pipeline stage's casts (dp=1, two micro-batches
    accumulated in fp32)."""
    _check_masters_hold_the_fp32_sum(ranks(mixed.replicated_grad_sums, 4, axes, plan, timeout=500))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bf16_loss_curve_stays_near_fp32_over_twenty_steps(ranks):
    fp32, bf16 = ranks(mixed.loss_curves, 2, timeout=240)[0]
    assert fp32[-1] < 0.8 * fp32[0] and bf16[-1] < 0.8 * bf16[0]     # both train
    # bf16 rounds the loss itself to 8 bits (4 eps relative at most) and the two runs' steps
    # differ by rounding; over 20 steps of lr 3e-3 we allow 2% of the loss, step by step
    for a, b in zip(fp32, bf16):
        assert abs(a - b) <= 0.02 * a, (fp32, bf16)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("reduce", ["fp32", "bf16"])
def test_every_collective_runs_in_the_dtype_its_plan_says(ranks, reduce):
    """ZeRO-2 x tp+sp on 4 ranks, as the buffers handed to torch.distributed show: parameters
    gathered in bf16; gradient sums (dp reduce-scatter, tp all-reduce of replicated parameters'
    and inputs' gradients, sp's reduce-scatter of gradients) in the reduce dtype; tp's
    activation collectives in bf16."""
    plan = f"dp=zero2,tp,sp,param_dtype=bf16,reduce_dtype={reduce}"
    seen, by_dtype = ranks(mixed.collective_dtypes, 4, {"dp": 2, "tp": 2}, plan, timeout=240)[0]
    want = "float32" if reduce == "fp32" else "bfloat16"
    kinds = {(axis, kind, phase, dtype) for axis, kind, phase, dtype in seen}
    # gradient buckets: a reduce-scatter, which on gloo runs as an all-reduce of the bucket's
    # scratch buffer in place (AxisComm.reduce_scatter_flat(in_place=True))
    assert {("dp", "reduce_scatter_single", "backward", want), ("dp", "all_reduce", "backward", want)} & kinds, kinds
    assert not {k for k in kinds if k[0] == "dp" and k[2] == "backward" and k[3] != want}, kinds
    assert ("dp", "all_gather_single", "other", "bfloat16") in kinds, kinds       # replicas after the step
    assert ("tp", "all_reduce", "backward", want) in kinds, kinds                 # norms' / biases' gradients
    assert ("tp", "reduce_scatter_single", "backward", want) in kinds, kinds      # sp: gradient of a gather
    assert ("tp", "all_gather_single", "other", "bfloat16") in kinds, kinds       # activations
    for axis, kind, phase, dtype in kinds:
        summing = kind in ("reduce_scatter_single", "all_reduce") and phase == "backward"
        assert dtype == (want if summing else "bfloat16"), (axis, kind, phase, dtype)
    assert by_dtype[("dp", "reduce_scatter", "backward", want)] > 0


@pytest.mark.timeout(300)
def test_zero_bytes_by_dtype_equal_the_formula(ranks):
    """ZeRO-2 bf16 on 2 ranks: the replicas' all-gather after the step moves bf16, (N-1)/N of
    2 bytes per padded parameter; the gradient reduce-scatter fp32, 4 bytes."""
    seen, by_dtype = ranks(mixed.collective_dtypes, 2, {"dp": 2}, "dp=zero2,param_dtype=bf16", timeout=240)[0]
    cfg = autopar.models.GPTConfig()
    model = autopar.models.TinyGPT(cfg)
    padded = sum(padded_numel(tuple(p.shape), 2) for p in model.parameters())
    assert by_dtype[("dp", "all_gather", "optimizer", "bfloat16")] == ring_bytes("all_gather", 2 * padded, 2)
    assert by_dtype[("dp", "reduce_scatter", "backward", "float32")] == ring_bytes("reduce_scatter", 4 * padded, 2)
    assert not [k for k in by_dtype if k[3] not in ("bfloat16", "float32")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["ddp", "zero1", "zero2", "zero3"])
def test_model_states_after_a_bf16_step_equal_the_formula(ranks, mode):
    by_kind, state, psi, padded = ranks(mixed.model_state_bytes_after_step, 2, mode, timeout=240)[0]
    assert all(k.split()[1] == ("bfloat16" if k.startswith("replica") else "float32") for k in by_kind), by_kind
    held = sum(by_kind.values()) + state
    # the formula on the runtime's padded shards: (p + g)·Ψ and K·Ψ/N terms as sizes.state_bytes has them
    want = state_bytes(mode, psi, 2, mixed_state_dtypes(mode), padded_psi=padded)
    assert held == pytest.approx(float(want), rel=0.01), (by_kind, state, psi, padded)
