"""Dropout draws from one random stream per mesh, rank 0's, whatever each rank seeded: parity
with one device under per-rank seeds (tp, sp, ZeRO, a pipeline), the generator's end state,
the local mode's fused attention, and what a model without dropout pays (nothing)."""
import copy
import time

import pytest
import torch
from torch.overrides import TorchFunctionMode

import autopar
from autopar.models import GPTConfig, TinyGPT, TinyMLP, gpt_batch
from autopar.runtime import flight
from autopar.runtime.rng import LocalSite, MaskSite, RandomMasks, rng_sdpa
from autopar.testing import fake_rank, run_threads
from jobs import rng as jobs


# ---- per-rank seeds, exact mode: parity with one device -------------------------------------------

@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["tp+sp", "zero3", "pp 1f1b", pytest.param("tp", marks=pytest.mark.slow)])
def test_ranks_seeded_apart_match_one_device(ranks, name):
    """Rank r seeded ``1000 + step + r``, one device ``1000 + step``: GPT with hidden and
    attention dropout 0.1 trains as on one device (outputs, losses, gradients, parameters)."""
    for rep in ranks(jobs.seeded_apart_parity, 2, name, timeout=240):
        assert rep.ok, (f"{name} rank {rep.rank}: out {rep.output_err:.3g} loss {rep.loss_err:.3g} "
                        f"grad {rep.grad_err:.3g} param {rep.param_err:.3g} {rep.messages}")
        assert rep.loss_err < 0.01


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["tp", pytest.param("pp 1f1b", marks=pytest.mark.slow)])
def test_generator_ends_the_step_as_one_device_or_as_the_rank_left_it(ranks, name):
    """Every rank seeded alike: each ends the step in the single-device model's state, bitwise.
    Seeded apart: rank 0 (seeded as the single device) ends in its state, rank 1 keeps its own
    stream untouched."""
    for r in ranks(jobs.end_states, 2, name, timeout=240):
        assert r["alike_is_one_device"], r
        if r["rank"] == 0:
            assert r["apart_is_one_device"], r
        else:
            assert r["apart_is_untouched"] and not r["apart_is_one_device"], r


# ---- local mode: fused attention ---------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_local_mode_agrees_across_tp_ranks_seeded_apart_and_keeps_torchs_attention(ranks):
    """Plan(tp=True, dropout_rng='local'), rank r seeded 5 + r: both tp ranks return the same
    output, the same again from the same seeds; attention is torch's own
    ``scaled_dot_product_attention`` with its dropout (fused where the device has a kernel),
    never the math form autopar calls in exact mode."""
    res = ranks(jobs.local_seeded_apart, 2, "tp", timeout=240)
    for r in res:
        assert r["same_as_rank0"] and r["repeatable"] and r["finite"], r
        assert r["calls"] and {p for _, p in r["calls"]} == {0.25}, r["calls"]
        assert not [c for c, _ in r["calls"] if "math" in c], r["calls"]


class _Calls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _local_masks(key_site: int, b=2, h=4, lq=64, lk=64, p=0.3):
    """A RandomMasks in local mode holding site ``key_site``'s key for one attention site."""
    site = MaskSite(0, "sdpa", p, b * h * lq * lk, torch.float32)
    masks = RandomMasks((site,), {0: LocalSite((b, h, lq, lk), ((),))}, mode="local")
    masks.masks = {(0, 0): key_site}
    return masks


def test_local_attention_dropout_rate_key_and_backward():
    """The local mode's attention with q = k = 0 (uniform probabilities 1/L) and v the identity:
    the output is the kept mask scaled by 1 / (L (1 - p)), so its zeros are the dropped
    elements. Their rate is p (within 5 binomial standard deviations); the same key drops the
    same elements, another key others; the default generator is left as it was; backward
    uses forward's mask (v's gradient for an all-ones upstream is the output's column sums)."""
    b, h, L, p = 2, 4, 64, 0.3
    q = torch.zeros(b, h, L, 8)
    v = torch.eye(L).expand(b, h, L, L).clone().requires_grad_(True)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    with _Calls() as rec:
        out = rng_sdpa(q, q, v, None, _local_masks(17, b, h, L, L, p), 0, p)
    assert torch.equal(torch.get_rng_state(), before)
    assert any("aten.scaled_dot_product_attention" in n for n in rec.names), rec.names
    assert not any("_scaled_dot_product_attention_math" in n for n in rec.names), rec.names
    dropped = (out == 0).float()
    assert abs(float(dropped.mean()) - p) < 5 * (p * (1 - p) / dropped.numel()) ** 0.5, float(dropped.mean())
    kept = out[out != 0]
    assert torch.allclose(kept, torch.full_like(kept, 1 / (L * (1 - p))))
    again = rng_sdpa(q, q, v, None, _local_masks(17, b, h, L, L, p), 0, p)
    other = rng_sdpa(q, q, v, None, _local_masks(18, b, h, L, L, p), 0, p)
    assert torch.equal(out, again) and not torch.equal((out == 0), (other == 0))
    out.backward(torch.ones_like(out))
    assert torch.allclose(v.grad, out.detach().sum(-2, keepdim=True).transpose(-1, -2).expand_as(v))


# ---- what it costs: one broadcast per draw, none without dropout -----------------------------------

def _broadcasts(model, x, steps=2) -> list[int]:
    """The random-state broadcasts (in the flight recorder) of each of ``steps`` forwards."""
    counts = []
    with fake_rank(2, 0):
        dm = autopar.compile(model, autopar.Mesh(tp=2), example_inputs=(x,), plan=autopar.Plan(tp=True))
        for _ in range(steps):
            start = time.time()
            dm(x)
            counts.append(sum(1 for e in flight.RECORDER.ring if e.issued >= start and e.kind == "broadcast"
                              and e.label.startswith("random state")))
    return counts


def test_the_random_state_is_broadcast_once_per_forward_and_never_without_dropout():
    c = GPTConfig(dropout=0.1)
    tok, _ = gpt_batch(c, 4)
    assert _broadcasts(TinyGPT(c), tok) == [1, 1]
    assert _broadcasts(TinyGPT(GPTConfig()), tok) == [0, 0]
    assert _broadcasts(TinyMLP(), torch.randn(4, 16)) == [0, 0]


def _threaded_rank(model, tok):
    import torch.distributed as dist
    dm = autopar.compile(model, autopar.Mesh(tp=2), example_inputs=(tok,), plan=autopar.Plan(tp=True))
    if dist.get_rank() == 0:
        torch.manual_seed(3)
    dist.barrier()
    return dm(tok).detach()


def test_threaded_ranks_draw_one_stream():
    """Threads as ranks (one generator between them, as ``autopar.verify`` runs them) compile
    and run a model with dropout; both tp ranks drop alike."""
    c = GPTConfig(dropout=0.1)
    tok, _ = gpt_batch(c, 4)
    torch.manual_seed(0)
    model = TinyGPT(c)
    outs = run_threads(lambda: _threaded_rank(copy.deepcopy(model), tok), 2, timeout=120)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("recompute", ["selective", pytest.param("full", marks=pytest.mark.slow)])
def test_local_mode_recomputation_draws_the_same_masks_again(ranks, recompute):
    """Plan(dropout_rng='local') with recomputation: the recomputed attention (its kernel seeded
    by the slice's key again) and dropout give the loss and gradients of the plan without."""
    base = ranks(jobs.local_recomputed, 2, "none", timeout=240)
    again = ranks(jobs.local_recomputed, 2, recompute, timeout=240)
    for a, b in zip(base, again):
        assert b["recomputed"] > 0 and a["recomputed"] == 0
        assert torch.equal(a["loss"], b["loss"])
        for k, g in a["grads"].items():
            assert torch.allclose(g, b["grads"][k], rtol=1e-5, atol=1e-7), k
