"""LM heads under tensor parallelism, on real processes and on a simulated rank: the vocabulary split
of tied and untied heads (parity with one device), and the bytes one training step moves."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
from autopar.models import GPTConfig, TinyGPT, gpt_batch, lm_loss
from autopar.testing import parity

from autopar.zoo import ADAM_EPS


class NllGPT(torch.nn.Module):
    """The small GPT with its loss in the graph as log_softmax + nll_loss, ignoring label -100."""

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.gpt = TinyGPT(c)

    def forward(self, idx, targets):
        logits = self.gpt(idx)
        logp = F.log_softmax(logits.reshape(-1, logits.shape[-1]), dim=-1)
        return F.nll_loss(logp, targets.reshape(-1), ignore_index=-100)


class UntiedGPT(TinyGPT):
    """The small GPT with a head of its own (not tied to the embedding)."""

    def __init__(self, c: GPTConfig):
        super().__init__(c)
        self.head = torch.nn.Linear(c.dim, c.vocab, bias=False)


def ignored(targets: torch.Tensor) -> torch.Tensor:
    """``targets`` with a few labels set to -100 (ignored by the loss), unevenly across rows."""
    out = targets.clone()
    out[0, :5] = -100
    out[1, -3:] = -100
    return out


def _plan(**kw):
    return autopar.Plan(tp=True, vocab_parallel=True, **kw)


def parity_small_heads():
    """tp = world size: the tied head with its loss in the graph as log_softmax + nll_loss (with
    ignored labels), and the untied head whose logits the graph returns."""
    t = dist.get_world_size()
    c = GPTConfig()
    tok, tgt = gpt_batch(c, 8)
    mesh = autopar.Mesh(tp=t)
    return {"nll": parity(lambda: NllGPT(c), mesh, _plan(), (tok, ignored(tgt)), None, lambda loss, _: loss),
            "untied": parity(lambda: UntiedGPT(c), mesh, _plan(), (tok,), tgt, lm_loss)}


def parity_tied_logits(sp: bool):
    """tp = world size: TinyGPT's tied head split, the logits gathered at the output."""
    c = GPTConfig()
    tok, tgt = gpt_batch(c, 8)
    return {("tied", sp): parity(lambda: TinyGPT(c), autopar.Mesh(tp=dist.get_world_size()), _plan(sp=sp),
                                 (tok,), tgt, lm_loss)}


def hf_lm(name: str) -> torch.nn.Module:
    """A Hugging Face causal LM from a tiny random config (96 words, 32 features, 2 layers) with
    its LM head tied to the embedding (``tie_word_embeddings``); Llama's table has a padding row, and
    8 query heads share 4 key/value heads (tp up to 4)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    if name == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True))
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32,
                                        pad_token_id=0, tie_word_embeddings=True))


class Labelled(torch.nn.Module):
    """A Hugging Face causal LM called the Hugging Face way, ``lm(input_ids=..., labels=...)``: its
    shifted cross-entropy (label -100 ignored) is in the graph. Returns the loss, and with
    ``logits=True`` the logits beside it (as the ModelOutput does)."""

    def __init__(self, lm, logits: bool = False):
        super().__init__()
        self.lm, self.logits = lm, logits

    def forward(self, input_ids, labels):
        out = self.lm(input_ids=input_ids, labels=labels, use_cache=False)
        return (out.loss, out.logits) if self.logits else out.loss


def hf_batch(rows: int, seed: int = 0) -> tuple:
    """(input_ids, labels) of ``rows`` sequences of 16 tokens, some labels -100."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 96, (rows, 16), generator=g)
    return ids, ignored(ids)


def parity_hf(names=("gpt2", "llama"), sps=(False, True)):
    """GPT-2 and Llama with tied embeddings trained with ``labels=`` (the loss in the graph, some
    labels -100), their head split along the vocabulary; tp = world size."""
    batch = hf_batch(4)
    return {(name, sp): parity(lambda: Labelled(hf_lm(name)), autopar.Mesh(tp=dist.get_world_size()), _plan(sp=sp),
                               batch, None, lambda loss, _: loss, eps=ADAM_EPS)
            for name in names for sp in sps}


def parity_dp_tp():
    """Mesh(dp=2, tp=2): the small GPT's tied head split, its logits gathered at the output (a loss
    in the graph returns each dp rank's own mean, which parity cannot compare as an output)."""
    c = GPTConfig()
    tok, tgt = gpt_batch(c, 8)
    return {"dp x tp": parity(lambda: TinyGPT(c), autopar.Mesh(dp=2, tp=2), _plan(), (tok,), tgt, lm_loss)}


def parity_pipeline_tied():
    """Mesh(pp=2, tp=2): the tied table in both stages (the lookup in the first, the head in the
    last), split along the vocabulary in both, its two gradients summed after the step."""
    c = GPTConfig(layers=2)
    tok, tgt = gpt_batch(c, 8)
    plan = _plan(pp_schedule="1f1b", microbatches=2)
    return {"pp x tp": parity(lambda: TinyGPT(c), autopar.Mesh(pp=2, tp=2), plan, (tok,), tgt, lm_loss)}


# ---- bytes on a simulated rank ----------------------------------------------------------------

def _bytes(dm, inputs: tuple, loss_fn) -> dict:
    """(kind, phase) -> bytes the tp axis moved in the second training step."""
    opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
    for i in range(2):
        dm.comm_stats.reset()
        out = dm(*dm.shard_batch(inputs))
        loss_fn(out).backward()
        opt.step()
        opt.zero_grad()
    return {(k, p): v for (a, k, p), v in dm.comm_stats.bytes.items() if a == "tp" and v}


def head_bytes(model: str, vocab_parallel: bool, sp: bool = False) -> dict:
    """Bytes per (kind, phase) of one step of ``model`` (tiny: TinyGPT, logits returned; nll: its
    loss in the graph; gpt2 / llama: ``hf_lm``'s, called with labels, returning loss and logits)
    on Mesh(tp=world)."""
    t = dist.get_world_size()
    plan = autopar.Plan(tp=True, sp=sp, vocab_parallel=vocab_parallel)
    mesh = autopar.Mesh(tp=t)
    c = GPTConfig()
    tok, tgt = gpt_batch(c, 8)
    torch.manual_seed(0)
    if model == "tiny":
        dm = autopar.compile(TinyGPT(c), mesh, example_inputs=(tok,), plan=plan)
        return _bytes(dm, (tok,), lambda out: lm_loss(out, tgt))
    if model == "nll":
        dm = autopar.compile(NllGPT(c), mesh, example_inputs=(tok, ignored(tgt)), plan=plan)
        return _bytes(dm, (tok, ignored(tgt)), lambda out: out)
    batch = hf_batch(4)
    dm = autopar.compile(Labelled(hf_lm(model), logits=True), mesh, example_inputs=batch, plan=plan)
    return _bytes(dm, batch, lambda out: out[0])
