"""Hugging Face models (GPT-2, Llama) from small random configs (no downloads), returning logits."""
from __future__ import annotations

import torch


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
