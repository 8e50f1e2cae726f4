"""Hugging Face models (GPT-2, Llama) from small random configs (no downloads): parity."""
from __future__ import annotations

import torch
import torch.distributed as dist

import autopar
from autopar.models import lm_loss
from autopar.testing import parity

from .common import MODES

class LogitsOf(torch.nn.Module):
    """A Hugging Face causal LM as tokens -> logits (use_cache off, so export sees no cache)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, tokens):
        return self.lm(input_ids=tokens, use_cache=False).logits


def hf_model(name):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    if name == "gpt2":
        cfg = GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
                         eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return LogitsOf(GPT2LMHeadModel(cfg))
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LogitsOf(LlamaForCausalLM(cfg))


# Adam's eps sets how far it amplifies a gradient that is float noise: at the default 1e-8 a
# gradient of 1e-9 (an element that is zero in exact arithmetic, summed in another order)
# becomes a step of 0.1 lr, and in GPT-2 and Llama enough such elements move to shift the next
# step's gradients by 1e-3 relative. 1e-6 keeps noise below 1e-3 lr, while a gradient of 1e-5
# still takes a full Adam step, so the comparison tests the implementation, not the noise.
HF_ADAM_EPS = 1e-6


def hf_parity_all():
    """Hugging Face GPT-2 and Llama built from small random configs (no downloads)."""
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 97, (4 * world, 17), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return {(name, mode): parity(lambda: hf_model(name), autopar.Mesh(dp=world), autopar.Plan(dp=mode),
                                 (x,), y, lm_loss, eps=HF_ADAM_EPS)
            for name in ("gpt2", "llama") for mode in MODES}


def hf_parity_tp(modes=("ddp",), sps=(False, True)):
    """Hugging Face GPT-2 (fused c_attn, Conv1D addmm) and Llama (grouped-query attention,
    rotary embeddings, RMSNorm, SwiGLU) on Mesh(dp=2, tp=2), tensor and sequence parallel."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 97, (8, 17), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    mesh = autopar.Mesh(dp=2, tp=2)
    return {(name, mode, sp): parity(lambda: hf_model(name), mesh, autopar.Plan(dp=mode, tp=True, sp=sp),
                                     (x,), y, lm_loss, eps=HF_ADAM_EPS)
            for name in ("gpt2", "llama") for mode in modes for sp in sps}
