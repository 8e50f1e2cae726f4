"""Rules for ops real models reach (new_empty, tensor_split, a per-sample arange index, sort, a
fused q/k/v viewed as (3, heads, head_dim)) on real processes: small models and tiny Hugging Face
configs trained against the single-device model (``autopar.testing.parity``)."""
from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar import zoo
from autopar.testing import parity

from .common import mse


class FusedQKV(nn.Module):
    """Attention whose fused projection is unpacked as ModernBERT's: ``view(b, s, 3, heads, hd)``."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.wqkv = nn.Linear(dim, 3 * dim)
        self.wo = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.wqkv(x).view(b, s, 3, self.heads, d // self.heads).transpose(1, 3).unbind(dim=2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)     # (b, heads, s, hd)
        return x + self.wo(a.transpose(1, 2).reshape(b, s, d))


def fused_qkv_batch(dim=32):
    g = torch.Generator().manual_seed(3)
    return torch.randn(4, 6, dim, generator=g), torch.randn(4, 6, dim, generator=g)


@contextlib.contextmanager
def autopar_warnings():
    """The messages autopar logs at WARNING or above within the block, in a list."""
    got = []

    class Keep(logging.Handler):
        def emit(self, record):
            got.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logging.getLogger("autopar").addHandler(handler)
    try:
        yield got
    finally:
        logging.getLogger("autopar").removeHandler(handler)


def fused_qkv_parity(heads: int, dim: int):
    """tp over the whole world; the placement tp gave the fused weight; the warnings logged."""
    x, y = fused_qkv_batch(dim)
    with autopar_warnings() as warnings:
        mesh = autopar.Mesh(tp=torch.distributed.get_world_size())
        rep = parity(lambda: FusedQKV(dim, heads), mesh, autopar.Plan(tp=True), (x,), y, mse)
    return rep, warnings


# --- tiny Hugging Face models -------------------------------------------------------------------

def _deepseek_v3():
    import transformers
    cfg = transformers.DeepseekV3Config(
        vocab_size=zoo.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4, v_head_dim=8,
        qk_nope_head_dim=8, first_k_dense_replace=1, max_position_embeddings=64, use_cache=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(cfg).train()


def _t5gemma():
    import transformers
    side = dict(vocab_size=zoo.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                query_pre_attn_scalar=8, sliding_window=8, pad_token_id=0, eos_token_id=2, bos_token_id=1,
                use_cache=False, dropout_rate=0.0, attention_dropout=0.0)
    cfg = transformers.T5GemmaConfig(encoder=dict(side), decoder=dict(side), vocab_size=zoo.VOCAB,
                                     dropout_rate=0.0, attention_dropout=0.0)
    cfg._attn_implementation = "eager"         # T5Gemma has no sdpa path
    torch.manual_seed(0)
    return transformers.T5GemmaForConditionalGeneration(cfg).train()


_ZOO = {   # name -> (zoo.Arch: the zoo's tiny config and batch, with these overrides)
    "modernbert": zoo.Arch("modernbert", "ModernBertForMaskedLM", "ModernBertConfig", kind="masked",
                           overrides={"global_attn_every_n_layers": 1, "local_attention": 8}),
    "modernbert_3_heads": zoo.Arch("modernbert", "ModernBertForMaskedLM", "ModernBertConfig", kind="masked",
                                   overrides={"global_attn_every_n_layers": 1, "local_attention": 8,
                                              "hidden_size": 24, "num_attention_heads": 3, "head_dim": 8}),
    "mamba": zoo.Arch("mamba", "MambaForCausalLM", "MambaConfig",
                      overrides={"state_size": 4, "expand": 2, "conv_kernel": 4, "time_step_rank": 4}),
    "mixtral_grouped_mm": zoo.Arch("mixtral", "MixtralForCausalLM", "MixtralConfig", family="moe", overrides={
        **zoo.arch("mixtral").overrides, "_experts_implementation": "grouped_mm"}),
}
_BUILT = {"deepseek_v3": (_deepseek_v3, "causal"), "t5gemma": (_t5gemma, "seq2seq")}


def hf_model(name: str):
    """``(build, batch)``: the model's constructor and its global batch (``labels=`` included)."""
    if name in _ZOO:
        a = _ZOO[name]
        return (lambda: zoo.build(a)), zoo.batch(a, zoo.ROWS)
    build, kind = _BUILT[name]
    return build, zoo.batch(zoo.Arch(name, "", "", kind=kind), zoo.ROWS)


def hf_parity(name: str, plan: str):
    """``name`` trained under the zoo plan ``plan`` against one device: (ok, summary, warnings)."""
    axes, fields = zoo.PLANS[plan]
    build, batch = hf_model(name)
    torch.manual_seed(0)
    model = build()
    with autopar_warnings() as warnings:
        rep = parity(lambda: model, autopar.Mesh(**axes), autopar.Plan(**fields), (), None, None, kwargs=batch,
                     steps=zoo.STEPS, eps=zoo.ADAM_EPS)
    summary = (f"rank {rep.rank}: output {rep.output_err:.3g}, loss {rep.loss_err:.3g}, grad {rep.grad_err:.3g}, "
               f"param {rep.param_err:.3g} {rep.messages}")
    return rep.ok, summary, warnings
