"""A repeated block profiled once: the planner's profiles capture the first two blocks of a
model's stack and extend them to the full depth; the result must be the whole model's profile,
group by group and field by field (FLOPs, bytes, saved activations, tp collectives, parameter
names and shapes), for every tp size and with sequence parallelism."""
import dataclasses

import pytest
import torch

from autopar.cost.estimate import Profiles
from autopar.cost.profile import repeated_stack, truncated
from autopar.models import GPTConfig, Llama, LlamaConfig, TinyGPT
from jobs.hf import LogitsOf, hf_model


def _model(name):
    tokens = (torch.zeros(8, 16, dtype=torch.long),)
    if name == "gpt":
        with torch.device("meta"):
            return TinyGPT(GPTConfig(layers=6)), tokens
    if name == "llama":
        with torch.device("meta"):
            return Llama(LlamaConfig(layers=5)), tokens
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig as HFLlamaConfig, LlamaForCausalLM
    if name == "hf gpt2":
        lm = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=4, n_head=4))
    else:
        lm = LlamaForCausalLM(HFLlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    return LogitsOf(lm), tokens


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["gpt", "llama", pytest.param("hf gpt2", marks=pytest.mark.slow),
                                  pytest.param("hf llama", marks=pytest.mark.slow)])
def test_block_once_profile_equals_the_whole_model_profile(name):
    model, inputs = _model(name)
    once = Profiles(model, inputs)
    whole = Profiles(model, inputs, blocks_once=False)
    assert once.stack is not None and once.stack[1] == len(whole.base.layers)
    assert len(once._ctx.params) < len(whole._ctx.params)           # it did capture fewer blocks
    for tp, sp in ((1, False), (2, False), (2, True)):
        a, b = once.get(tp, sp), whole.get(tp, sp)
        assert [g.name for g in a.groups] == [g.name for g in b.groups]
        for ga, gb in zip(a.groups, b.groups):
            for f in dataclasses.fields(gb):
                assert getattr(ga, f.name) == getattr(gb, f.name), (name, tp, sp, gb.name, f.name)
        assert a.shapes == b.shapes and sorted(a.tied) == sorted(b.tied) and a.rows == b.rows and a.heads == b.heads


def test_the_stack_is_found_and_cut_without_copying_blocks():
    assert repeated_stack(hf_model("llama")) is None     # 2 layers: nothing to cut
    with torch.device("meta"):
        gpt = TinyGPT(GPTConfig(layers=4))
    path, n = repeated_stack(gpt)
    assert (path, n) == ("blocks", 4)
    short = truncated(gpt, path)
    assert len(short.blocks) == 2 and len(gpt.blocks) == 4 and short.wte is gpt.wte
