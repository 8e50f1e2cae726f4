"""Mixed precision captures the program one device runs under ``torch.autocast``: a forward
that runs only with autocast's casts (the project's Llama: its fp32 rotary tables make q and k
fp32 in front of attention, whose v is bf16), at another input shape and in the other
train/eval mode (captured from copies on the meta device), from a model built on the meta
device, and a model's own autocast blocks. The reference is the single-device model under
the same policy (``autopar.testing.MixedReference``)."""
import copy

import pytest
import torch
from torch import nn

import autopar
from autopar import meta
from autopar.capture import CaptureError
from autopar.models import small
from autopar.testing import MIXED_TOLERANCE, MixedReference

from jobs import mixed_capture

BF16 = torch.bfloat16
MESH = autopar.Mesh(dp=1, virtual=True, rank=0)
aten = torch.ops.aten


def _one_device(model, x, loss, target, train: bool = True):
    """The logits of ``model`` on one device under bf16 autocast (bf16 parameters, fp32 buffers)."""
    ref = MixedReference(copy.deepcopy(model), BF16)
    ref.copy.train(train)
    out, _ = ref.forward_backward((x,), {}, lambda o: loss(o, target[:, :o.shape[1]]))
    return out.detach()


def test_llama_captures_in_bf16_and_computes_what_one_device_computes_under_autocast():
    """Attention gets q and k cast to bf16 (autocast's casts, as graph nodes), and the compiled
    module's logits are the single-device model's under autocast, bit for bit: one rank runs
    the same ops in the same dtypes."""
    model, (tok,), target, loss = small("tiny-llama")
    dm = autopar.compile(copy.deepcopy(model), MESH, example_inputs=(tok,), plan=autopar.Plan(param_dtype=BF16))
    attention = [n for n in dm.module.graph.nodes if n.target is aten.scaled_dot_product_attention.default]
    assert len(attention) == model.config.layers
    for n in attention:
        q, k, v = n.args[:3]
        assert [a.meta[meta.VAL].dtype for a in (q, k, v)] == [BF16] * 3
        assert q.target is aten._to_copy.default and k.target is aten._to_copy.default    # from fp32
        assert q.args[0].meta[meta.VAL].dtype == torch.float32
    assert torch.equal(dm(tok), _one_device(model, tok, loss, target))


def test_another_shape_the_other_mode_and_a_meta_model_capture_too():
    """A new sequence length and eval mode are captured from copies on the meta device, whose
    tensors autocast does not cast: their logits are still the single-device model's, and a
    model built on the meta device captures the real one's graph."""
    model, (tok,), target, loss = small("tiny-llama")
    plan = autopar.Plan(param_dtype=BF16)
    dm = autopar.compile(copy.deepcopy(model), MESH, example_inputs=(tok,), plan=plan)
    short = tok[:, :8]
    assert torch.equal(dm(short), _one_device(model, short, loss, target))
    dm.eval()
    assert torch.equal(dm(tok), _one_device(model, tok, loss, target, train=False))
    on_meta = autopar.compile(copy.deepcopy(model).to("meta"), MESH, example_inputs=(tok,), plan=plan)
    assert dict(on_meta.ctx.snapshots)["autocast"] == dict(dm.ctx.snapshots)["autocast"]


class _Blocks(nn.Module):
    """Autocast blocks of its own: an fp32 island with a bf16 block inside, entered only when
    autocast is on (as Hugging Face's ``maybe_autocast``); else one bf16 block."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        if torch.is_autocast_enabled("cpu"):
            with torch.autocast("cpu", enabled=False):
                y = h.float() @ h.float().T
                with torch.autocast("cpu", dtype=BF16):
                    z = y @ y
        else:
            with torch.autocast("cpu", dtype=BF16):
                z = h @ h.T
        return self.b(h).sum() + z.float().sum() * 1e-3


@pytest.mark.parametrize("param_dtype", [None, BF16])
def test_a_models_own_autocast_blocks_become_plain_nodes_cast_as_the_block_casts(param_dtype):
    torch.manual_seed(0)
    model, x = _Blocks(), torch.randn(4, 8)
    dm = autopar.compile(copy.deepcopy(model), MESH, example_inputs=(x,), plan=autopar.Plan(param_dtype=param_dtype))
    nodes = list(dm.module.graph.nodes)
    assert not [n for n in nodes if n.target is torch.ops.higher_order.wrap_with_autocast]
    matmuls = [n for n in nodes if n.target is aten.matmul.default]
    if param_dtype is None:
        (mm,) = matmuls
        assert [str(b) for b in mm.meta[meta.AUTOCAST]] == ["autocast(cpu, bfloat16, enabled=True)"]
        assert mm.meta[meta.VAL].dtype == BF16 and mm.args[0].target is aten._to_copy.default
        want = model(x)
    else:
        island, inner = matmuls
        assert island.meta[meta.VAL].dtype == torch.float32 and inner.meta[meta.VAL].dtype == BF16
        assert [b.enabled for b in inner.meta[meta.AUTOCAST]] == [False, True]
        ref = MixedReference(copy.deepcopy(model), BF16)
        want, _ = ref.forward_backward((x,), {}, lambda o: o)
    assert torch.equal(dm(x).detach(), want.detach())


def test_the_export_cache_tells_a_capture_under_autocast_from_one_without(monkeypatch):
    """The same bf16 model is captured under autocast (mixed precision), then without (its own
    dtypes), where attention's fp32 q and bf16 v do not run: the second is exported again, and
    refused, rather than handed the first's program."""
    monkeypatch.setenv("AUTOPAR_EXPORT_CACHE", "1")
    model, (tok,), _, _ = small("tiny-llama")
    for p in model.parameters():
        p.data = p.data.to(BF16)
    autopar.compile(copy.deepcopy(model), MESH, example_inputs=(tok,), plan=autopar.Plan(param_dtype=BF16))
    with pytest.raises(CaptureError, match="same dtype"):
        autopar.compile(copy.deepcopy(model), MESH, example_inputs=(tok,), plan=autopar.Plan())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(mixed_capture.PLANS))
def test_llama_in_bf16_matches_one_device_under_the_same_policy(ranks, name):
    """Two ranks, three AdamW steps, within ``MIXED_TOLERANCE`` of one device under autocast."""
    for rep in ranks(mixed_capture.llama_parity, 2, name, timeout=240):
        assert rep.ok, (name, MIXED_TOLERANCE, rep.messages)
