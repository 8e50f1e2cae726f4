"""The model zoo: Hugging Face ``transformers`` architectures from tiny random configs.

Every entry builds a model of its family from the library's own config class, shrunk to a few
thousand parameters (nothing is downloaded), and a batch it is called with the Hugging Face
way: ``model(input_ids=..., labels=...)`` returning ``.loss`` for language models (causal,
masked, sequence-to-sequence; state-space ones too), ``model(pixel_values=..., labels=...)`` for
a vision classifier, ``model(input_features=..., labels=...)`` for an audio one (Whisper's
encoder). ``python -m autopar zoo`` trains each under the plans of ``PLANS`` against the
single-device model (``autopar.compare.parity``), checks what each step moved and what each
rank holds against the plan's formula (``volume_check``), and prints the table docs/hugging-face.md shows.

``transformers`` is a test extra; this module imports it when a model is built.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .compare import parity
from .launch import RankPool, quiet
from .mesh import Mesh, process_device
from .passes.tensor_parallel import whole_share
from .planspec import Plan
from .runtime.comm import CommStats
from .runtime.dpsync import dp_gather
from .runtime.tpcomm import tp_gather

__all__ = ["Arch", "ARCHS", "PLANS", "build", "batch", "arch", "Cell", "run_cell", "run", "table", "plan_world",
           "Holdings", "volume_check", "run_cells", "tp_weight_gathers"]

VOCAB = 96
HIDDEN = 32
HEADS = 4
SEQ = 16
MEL_BINS = 8
FRAMES = 16
"""an audio example: MEL_BINS log-mel channels over FRAMES frames (Whisper's encoder halves them)"""

# config fields a tiny model sets when its config class has them (the families name them
# differently; each name that the class knows is set, the others are left alone)
_TINY = {
    "vocab_size": VOCAB, "hidden_size": HIDDEN, "n_embd": HIDDEN, "d_model": HIDDEN, "dim": HIDDEN,
    "num_hidden_layers": 1, "n_layer": 1, "n_layers": 1, "num_layers": 1,
    "num_attention_heads": HEADS, "n_head": HEADS, "n_heads": HEADS, "num_heads": HEADS,
    "num_key_value_heads": 2, "head_dim": HIDDEN // HEADS,
    "intermediate_size": 64, "ffn_hidden_size": 64, "ffn_dim": 64, "d_ff": 64, "hidden_dim": 64, "n_inner": 64,
    "max_position_embeddings": 64, "n_positions": 64, "n_ctx": 64, "seq_length": 64,
    "cross_attention_hidden_size": HIDDEN,
    "rotary_dim": 4, "partial_rotary_factor": 0.5,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 0,
    # dropout off: parity with dropout is its own test (tests/test_semantics.py)
    "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "resid_pdrop": 0.0,
    "embd_pdrop": 0.0, "attn_pdrop": 0.0, "dropout": 0.0, "attention_dropout": 0.0,
    "activation_dropout": 0.0, "hidden_dropout": 0.0, "dropout_rate": 0.0, "classifier_dropout": 0.0,
    "ffn_dropout": 0.0, "resid_dropout": 0.0, "embed_dropout": 0.0, "emb_dropout": 0.0,
    "attn_dropout": 0.0, "qa_dropout": 0.0, "seq_classif_dropout": 0.0,
    "use_cache": False, "tie_word_embeddings": True,
}


@dataclass(frozen=True)
class Arch:
    """One architecture of the zoo."""
    name: str
    model: str
    """the transformers class"""
    config: str
    kind: str = "causal"
    """causal | masked | seq2seq | vision | audio"""
    overrides: dict = field(default_factory=dict)
    family: str = "decoder"
    """decoder | moe | state-space | encoder | encoder-decoder | vision | audio (the grouping of docs/hugging-face.md's table)"""


def _moe(**kw):
    # experts as ordinary parameters, routed per token: transformers' "batched_mm" experts gather
    # each token's expert weights (index by expert id), which data parallelism splits like any
    # per-token op; its "grouped_mm" sorts all tokens of the batch by expert, which a batch
    # shard cannot follow op by op (autopar refuses it under dp, naming the sort)
    return {"num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32, "_experts_implementation": "batched_mm", **kw}


ARCHS = [
    Arch("gpt2", "GPT2LMHeadModel", "GPT2Config"),
    Arch("gpt_neox", "GPTNeoXForCausalLM", "GPTNeoXConfig", overrides={"rotary_pct": 0.5}),
    Arch("gptj", "GPTJForCausalLM", "GPTJConfig"),
    Arch("gpt_neo", "GPTNeoForCausalLM", "GPTNeoConfig",
         overrides={"attention_types": [[["global", "local"], 1]], "window_size": 8}),
    Arch("gpt_bigcode", "GPTBigCodeForCausalLM", "GPTBigCodeConfig", overrides={"multi_query": True}),
    Arch("codegen", "CodeGenForCausalLM", "CodeGenConfig"),
    Arch("opt", "OPTForCausalLM", "OPTConfig", overrides={"word_embed_proj_dim": HIDDEN}),
    Arch("bloom", "BloomForCausalLM", "BloomConfig"),
    Arch("falcon", "FalconForCausalLM", "FalconConfig", overrides={"new_decoder_architecture": True,
                                                                     "num_kv_heads": 2}),
    Arch("phi", "PhiForCausalLM", "PhiConfig"),
    Arch("phi3", "Phi3ForCausalLM", "Phi3Config"),
    Arch("llama", "LlamaForCausalLM", "LlamaConfig"),
    Arch("mistral", "MistralForCausalLM", "MistralConfig"),
    Arch("qwen2", "Qwen2ForCausalLM", "Qwen2Config"),
    Arch("qwen3", "Qwen3ForCausalLM", "Qwen3Config"),
    Arch("gemma", "GemmaForCausalLM", "GemmaConfig"),
    Arch("gemma2", "Gemma2ForCausalLM", "Gemma2Config"),
    Arch("olmo", "OlmoForCausalLM", "OlmoConfig"),
    Arch("olmo2", "Olmo2ForCausalLM", "Olmo2Config"),
    Arch("starcoder2", "Starcoder2ForCausalLM", "Starcoder2Config"),
    Arch("stablelm", "StableLmForCausalLM", "StableLmConfig"),
    Arch("cohere", "CohereForCausalLM", "CohereConfig"),
    Arch("granite", "GraniteForCausalLM", "GraniteConfig"),
    Arch("persimmon", "PersimmonForCausalLM", "PersimmonConfig"),
    Arch("nemotron", "NemotronForCausalLM", "NemotronConfig"),
    Arch("glm", "GlmForCausalLM", "GlmConfig"),
    Arch("helium", "HeliumForCausalLM", "HeliumConfig"),
    Arch("mixtral", "MixtralForCausalLM", "MixtralConfig", overrides=_moe(), family="moe"),
    Arch("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig", overrides=_moe(), family="moe"),
    Arch("olmoe", "OlmoeForCausalLM", "OlmoeConfig", overrides=_moe(), family="moe"),
    Arch("granitemoe", "GraniteMoeForCausalLM", "GraniteMoeConfig", overrides=_moe(), family="moe"),
    Arch("bert", "BertForMaskedLM", "BertConfig", kind="masked", family="encoder"),
    Arch("roberta", "RobertaForMaskedLM", "RobertaConfig", kind="masked", family="encoder",
         overrides={"pad_token_id": 1}),
    Arch("distilbert", "DistilBertForMaskedLM", "DistilBertConfig", kind="masked", family="encoder"),
    Arch("electra", "ElectraForMaskedLM", "ElectraConfig", kind="masked", family="encoder",
         overrides={"embedding_size": HIDDEN}),
    Arch("albert", "AlbertForMaskedLM", "AlbertConfig", kind="masked", family="encoder",
         overrides={"embedding_size": 16}),
    Arch("t5", "T5ForConditionalGeneration", "T5Config", kind="seq2seq", family="encoder-decoder",
         overrides={"d_kv": HIDDEN // HEADS, "num_decoder_layers": 1, "decoder_start_token_id": 0}),
    Arch("bart", "BartForConditionalGeneration", "BartConfig", kind="seq2seq", family="encoder-decoder",
         overrides={"encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": HEADS,
                    "decoder_attention_heads": HEADS, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64}),
    Arch("vit", "ViTForImageClassification", "ViTConfig", kind="vision", family="vision",
         overrides={"image_size": 16, "patch_size": 4, "num_channels": 3, "num_labels": 10}),
    # the architectures of the current open-weight releases
    Arch("gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig", overrides={"sliding_window": 8}),
    Arch("smollm3", "SmolLM3ForCausalLM", "SmolLM3Config"),
    Arch("glm4", "Glm4ForCausalLM", "Glm4Config"),
    Arch("ernie4_5", "Ernie4_5ForCausalLM", "Ernie4_5Config"),
    Arch("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", overrides=_moe(), family="moe"),
    Arch("deepseek_v3", "DeepseekV3ForCausalLM", "DeepseekV3Config", family="moe", overrides=_moe(
        # multi-head latent attention (low-rank q and kv, a rotary part and a plain part per head)
        # and a sigmoid router over one group of routed experts next to a shared expert
        n_routed_experts=4, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=0,
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, qk_head_dim=8,
        v_head_dim=8, head_dim=4, num_key_value_heads=HEADS)),
    Arch("gpt_oss", "GptOssForCausalLM", "GptOssConfig", overrides=_moe(sliding_window=8), family="moe"),
    Arch("mamba", "MambaForCausalLM", "MambaConfig", family="state-space",
         overrides={"state_size": 4, "time_step_rank": 2, "expand": 2}),
    Arch("mamba2", "Mamba2ForCausalLM", "Mamba2Config", family="state-space",
         overrides={"num_heads": 4, "head_dim": 16, "n_groups": 1, "state_size": 8, "chunk_size": 8,
                    "time_step_rank": 2, "expand": 2}),
    Arch("lfm2", "Lfm2ForCausalLM", "Lfm2Config", family="state-space",
         # a short gated convolution layer, then an attention layer
         overrides={"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"], "full_attn_idxs": [1],
                    "block_auto_adjust_ff_dim": False}),
    Arch("modernbert", "ModernBertForMaskedLM", "ModernBertConfig", kind="masked", family="encoder",
         overrides={"local_attention": 8, "cls_token_id": 1, "sep_token_id": 2}),
    Arch("t5gemma", "T5GemmaForConditionalGeneration", "T5GemmaConfig", kind="seq2seq",
         family="encoder-decoder"),
    Arch("whisper", "WhisperForAudioClassification", "WhisperConfig", kind="audio", family="audio",
         overrides={"encoder_layers": 1, "encoder_attention_heads": HEADS, "encoder_ffn_dim": 64,
                    "num_mel_bins": MEL_BINS, "max_source_positions": FRAMES // 2, "classifier_proj_size": 16,
                    "num_labels": 10}),
    Arch("dinov2", "Dinov2ForImageClassification", "Dinov2Config", kind="vision", family="vision",
         overrides={"image_size": 16, "patch_size": 4, "num_channels": 3, "num_labels": 10, "mlp_ratio": 2}),
]

PLANS = {
    "zero3": ({"dp": 2}, {"dp": "zero3"}),
    "tp": ({"tp": 2}, {"tp": True}),
    "tp+sp": ({"tp": 2}, {"tp": True, "sp": True}),
    "pp 1f1b": ({"pp": 2}, {"pp_schedule": "1f1b", "microbatches": 2}),
    "dp x tp": ({"dp": 2, "tp": 2}, {"tp": True}),
}
"""plan name -> (Mesh axes, Plan fields): the zoo's columns."""


def plan_world(plan: str) -> int:
    """Processes the zoo plan ``plan`` runs on (its mesh's size)."""
    return math.prod(PLANS[plan][0].values())


def arch(name: str) -> Arch:
    for a in ARCHS:
        if a.name == name:
            return a
    raise KeyError(f"no architecture {name!r} in the zoo; it has {', '.join(a.name for a in ARCHS)}")


def build(a: Arch | str, seed: int = 0) -> torch.nn.Module:
    """The architecture's model from a tiny random config (``torch.manual_seed(seed)`` first)."""
    import transformers
    a = arch(a) if isinstance(a, str) else a
    cfg = getattr(transformers, a.config)()
    _shrink(cfg, {**_TINY, **a.overrides}, set(a.overrides))
    cls = getattr(transformers, a.model)
    torch.manual_seed(seed)
    try:      # PyTorch's fused attention where the family supports it, its own matmuls otherwise
        cfg._attn_implementation = "sdpa"
        model = cls(cfg)
    except ValueError:
        cfg._attn_implementation = "eager"
        torch.manual_seed(seed)
        model = cls(cfg)
    return model.train()


def _shrink(cfg, values: dict, forced: set) -> None:
    """Set each of ``values`` that ``cfg`` knows (or that ``forced`` names), and the tiny fields
    of its sub-configs (an encoder-decoder's ``encoder``/``decoder`` configs)."""
    known = set(cfg.to_dict()) | set(getattr(type(cfg), "attribute_map", {}))
    for k, v in values.items():
        if k in known or k in forced:
            setattr(cfg, k, v)
    for k in sorted(known):
        sub = getattr(cfg, k, None)
        if sub is not cfg and hasattr(sub, "to_dict") and hasattr(sub, "model_type"):
            _shrink(sub, _TINY, set())


def batch(a: Arch | str, rows: int, seed: int = 0) -> dict:
    """The keyword arguments of one call on ``rows`` examples, labels included."""
    a = arch(a) if isinstance(a, str) else a
    g = torch.Generator().manual_seed(seed)
    if a.kind == "vision":
        return {"pixel_values": torch.randn(rows, 3, 16, 16, generator=g),
                "labels": torch.randint(0, 10, (rows,), generator=g)}
    if a.kind == "audio":
        return {"input_features": torch.randn(rows, MEL_BINS, FRAMES, generator=g),
                "labels": torch.randint(0, 10, (rows,), generator=g)}
    ids = torch.randint(3, VOCAB, (rows, SEQ), generator=g)
    if a.kind == "causal":
        return {"input_ids": ids, "labels": ids.clone()}
    if a.kind == "masked":
        # the same number of masked positions in every row: the loss (a mean over the labelled
        # tokens of a slice) then weighs every row alike on one device and on any dp slice
        labels = torch.full_like(ids, -100)
        pick = torch.zeros(ids.shape, dtype=torch.bool)
        pick.scatter_(1, torch.rand(ids.shape, generator=g).argsort(1)[:, :SEQ // 4], True)
        labels[pick] = ids[pick]
        masked = ids.masked_fill(pick, 4)
        return {"input_ids": masked, "labels": labels}
    labels = torch.randint(3, VOCAB, (rows, SEQ // 2), generator=g)
    return {"input_ids": ids, "labels": labels}


ROWS = 4
"""the global batch: 2 rows per data-parallel rank, or per micro-batch of a 2-stage pipeline"""
STEPS = 2
ADAM_EPS = 1e-6
"""AdamW's eps in the zoo: a gradient that is zero in exact arithmetic (an attention key's bias)
is float noise that differs with the summation order, and eps = 1e-8 would turn it into a step
of about lr; at 1e-6 such noise moves a weight by under 1e-3 lr while a real gradient of 1e-5
still takes a full step, so parity tests the program, not the noise"""
CELL_TIMEOUT = 60.0
"""seconds a collective of one cell may wait (a cell that hangs fails alone)"""


@dataclass(frozen=True)
class Cell:
    """One (architecture, plan) of the zoo: parity held, or why not in one line."""
    arch: str
    plan: str
    ok: bool
    why: str = ""
    seconds: float = 0.0
    note: str = ""
    """beside a ✓: what the plan leaves undone and the compile warned about"""


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else ""
    return f"{type(exc).__name__}: {line}"[:200]


_EXPORTED: dict = {}
"""architecture -> (model, its ExportedProgram on the zoo's batch): each process exports an
architecture once for every plan without a pipeline (a pipeline captures one micro-batch)"""


def _model_and_program(a: Arch, pipelined: bool):
    if pipelined:
        return build(a), None
    if a.name not in _EXPORTED:
        model = build(a)
        _EXPORTED.clear()            # one architecture at a time: the cells of one run it in a row
        _EXPORTED[a.name] = (model, torch.export.export(model, (), batch(a, ROWS), strict=False))
    return copy.deepcopy(_EXPORTED[a.name])    # the copy's program refers to the copy's tensors


def run_cell(a: Arch | str, plan: str, steps: int = STEPS) -> Cell:
    """Train ``a`` under the zoo plan ``plan`` on this rank's process group (world = the
    plan's mesh size) next to the single-device model; the Hugging Face call with
    ``labels=``, the model's own loss. Every rank returns the same verdict."""
    a = arch(a) if isinstance(a, str) else a
    axes, fields = PLANS[plan]
    t0 = time.perf_counter()
    note = ""
    try:
        mesh = Mesh(timeout=CELL_TIMEOUT, **axes)
        model, program = _model_and_program(a, "pp_schedule" in fields)
        rep = parity(lambda: model, mesh, Plan(**fields), (), None, None, kwargs=batch(a, ROWS), exported=program,
                     steps=steps, eps=ADAM_EPS, inspect=_holdings)
        ok, why = rep.ok, ("" if rep.ok else
                           f"parity off on rank {rep.rank}: output {rep.output_err:.3g}, loss {rep.loss_err:.3g}, "
                           f"grad {rep.grad_err:.3g}, param {rep.param_err:.3g} (scaled errors; <= 1 passes)")
        if ok:
            why, note = volume_check(plan, model, rep.step_bytes, rep.inspected)
            ok = not why
    except Exception as exc:      # the cell's verdict: the error in one line
        ok, why = False, _one_line(exc)
    every = torch.tensor([float(ok)], device=process_device())     # every rank, failed or not, agrees on the verdict
    dist.all_reduce(every, op=dist.ReduceOp.MIN)
    if ok and not every.item():
        ok, why = False, "parity off, or a volume check failed, on another rank"
    return Cell(a.name, plan, ok, why, time.perf_counter() - t0, note if ok else "")


TP_HELD = 0.75
"""under tp=2 a rank holds under this share of the trainable parameter bytes: a transformer's
products hold nearly all of them and tp halves each (embeddings, norms and biases aside)"""


@dataclass(frozen=True)
class Holdings:
    """What a compiled module keeps on this rank, for the volume check."""
    param_bytes: int
    """trainable parameter bytes this rank holds (its shards)"""
    gathered_weights: tuple = ()
    """parameters that a forward collective all-gathers whole along tp"""
    kept_whole: str = ""
    """tp's own account of the parameters it leaves whole"""
    warned: bool = False
    """the compile warned that tp keeps much of the model whole (``ctx.notes``)"""


def _holdings(dm) -> Holdings:
    params = [p for p in dm.parameters() if p.requires_grad]
    gathered, kept, warned = (), "", False
    if isinstance(getattr(dm, "module", None), torch.fx.GraphModule) and dm.mesh.axis_size("tp") > 1:
        gathered = tuple(tp_weight_gathers(dm.module))
        kept = whole_share(dm.ctx, top=2).describe()
        warned = any(n.startswith("warning: tensor parallelism keeps") for n in dm.ctx.notes)
    return Holdings(_nbytes(params), gathered, kept, warned)


_ALONG = {torch.ops.aten.t.default, torch.ops.aten.view.default, torch.ops.aten.reshape.default,
          torch.ops.aten.transpose.int, torch.ops.aten.permute.default, torch.ops.aten._to_copy.default,
          torch.ops.aten.unsqueeze.default, torch.ops.aten.alias.default, torch.ops.aten.detach.default,
          dp_gather}
"""ops that leave a parameter a parameter (a view, a cast, ZeRO-3's gather of its own shard)"""


def tp_weight_gathers(gm: torch.fx.GraphModule) -> list:
    """The parameters of ``gm`` that a ``tp_gather`` node makes whole (through views of them)."""
    params = {n for n, _ in gm.named_parameters()}
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not tp_gather:
            continue
        src = node.args[0]
        while isinstance(src, torch.fx.Node) and src.op == "call_function" and src.target in _ALONG:
            src = src.args[0]
        if isinstance(src, torch.fx.Node) and src.op == "get_attr" and src.target in params:
            out.append(src.target)
    return out


def volume_check(plan: str, model: torch.nn.Module, step: dict, held: Holdings) -> tuple[str, str]:
    """Bytes one step moved on this rank (``step``: (axis, kind, phase) -> bytes) and the
    parameter bytes it holds (``held``) against the plan's formula, written from the algorithms
    (Psi = the single-device ``model``'s trainable parameter bytes): ``(problem, note)``, each
    one line or "". A problem fails the cell; a note (tp keeps much whole, and the compile said
    so) is shown beside its ✓. ``model`` has run a step: a parameter whose ``.grad`` is None
    there (forward does not read it) has no gradient to reduce, so the lower bounds leave it out.

    zero3    forward all-gathers every parameter and backward reduce-scatters every gradient,
             (N-1)/N Psi each; backward gathers again the parameters it reads (at most the
             same): between 2 and 3 Psi (N-1)/N, plus each tensor's padding to N equal shards
             of rows (at most N - 1 rows of dim 0 a tensor)
    ddp      all-reduce of the gradients of what the rank holds: 2 (N-1)/N of its bytes
    tp       forward gathers no parameter whole, a rank holds part of Psi, the layers'
             collectives move bytes, and a rank holds well under Psi (TP_HELD at tp=2: the
             products are split) or the compile warned why not
    pp       each stage holds a part of Psi and sends activations (or their gradients)
    """
    axes, fields = PLANS[plan]
    trainable = [p for p in model.parameters() if p.requires_grad]
    counted = CommStats()
    counted.bytes.update(step)
    sent = counted.total        # (axis, kind=None, phase=None) -> the step's bytes, summed over what is unnamed
    stray = sorted({ax for (ax, _, _), b in step.items() if b and ax not in axes})
    if stray:
        return f"bytes moved on mesh axes the plan lacks: {', '.join(stray)}", ""
    problem = ""
    if axes.get("dp", 1) > 1:
        problem = _dp_volume(axes["dp"], fields.get("dp") == "zero3", trainable, sent, held)
    if not problem and axes.get("tp", 1) > 1:
        problem, note = _tp_volume(trainable, sent, held)
        if problem or note:
            return problem, note
    if not problem and axes.get("pp", 1) > 1:
        problem = _pp_volume(trainable, sent, held)
    return problem, ""


def _kib(b: float) -> str:
    return f"{b / 2**10:.1f} KiB"


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _dp_volume(n: int, zero3: bool, trainable: list, sent, held: Holdings) -> str:
    psi, ring = _nbytes(trainable), (n - 1) / n
    unused = _nbytes(p for p in trainable if p.grad is None)
    if zero3:
        pad = sum((n - 1) * (p[:1].numel() if p.dim() else 1) * p.element_size() for p in trainable)
        lo, hi = (psi - unused) * ring, (psi + pad) * ring
        fwd, bwd = sent("dp", "all_gather", "forward"), sent("dp", "all_gather", "backward")
        rs = sent("dp", "reduce_scatter")
        if not (lo <= fwd <= hi and lo <= rs <= hi and bwd <= hi) or sent("dp") != fwd + bwd + rs:
            return (f"ZeRO-3 moved {_kib(fwd)} in forward gathers, {_kib(rs)} in gradient reduce-scatters, "
                    f"{_kib(bwd)} in backward gathers, {_kib(sent('dp'))} in all; each should be "
                    f"Psi (N-1)/N = {_kib(psi * ring)} (the last at most)")
        return ""
    lo, hi = 2 * (held.param_bytes - unused) * ring, 2 * held.param_bytes * ring
    if not lo <= sent("dp", "all_reduce") <= hi or sent("dp") != sent("dp", "all_reduce"):
        return (f"dp moved {_kib(sent('dp'))} ({_kib(sent('dp', 'all_reduce'))} in all-reduces); the gradients' "
                f"all-reduce is 2 (N-1)/N of the rank's {_kib(held.param_bytes)} = {_kib(hi)}")
    return ""


def _tp_volume(trainable: list, sent, held: Holdings) -> tuple[str, str]:
    psi = _nbytes(trainable)
    if held.gathered_weights:
        return f"tp all-gathers whole weights in forward: {', '.join(held.gathered_weights[:3])}", ""
    if held.param_bytes >= psi:
        return f"tp splits no parameter (kept whole: {held.kept_whole})", ""
    if not sent("tp"):
        return "tp moved no bytes", ""
    if held.param_bytes >= TP_HELD * psi:
        share = f"a tp rank holds {held.param_bytes / psi:.0%} of the parameter bytes (kept whole: {held.kept_whole})"
        return (f"{share}, and the compile did not warn", "") if not held.warned else ("", share)
    return "", ""


def _pp_volume(trainable: list, sent, held: Holdings) -> str:
    if held.param_bytes >= _nbytes(trainable):
        return f"a pipeline stage holds every parameter ({_kib(held.param_bytes)})"
    if not sent("pp"):
        return "the pipeline sent nothing between its stages"
    return ""


def run_cells(names: list, plans: list, steps: int) -> list:
    """The cells, quiet (autopar's warnings and Python's are the table's notes, not the log's),
    the process's logging and warning filters restored after: a pool runs other jobs too."""
    torch.set_num_threads(1)
    with quiet():
        return [run_cell(n, p, steps) for n in names for p in plans]


def run(names=None, plans=None, steps: int = STEPS, log=None) -> list:
    """Every (architecture, plan) cell on local processes: one pool per world size."""
    names = names or [a.name for a in ARCHS]
    plans = plans or list(PLANS)
    by_world = {}
    for p in plans:
        by_world.setdefault(plan_world(p), []).append(p)
    cells = {}
    for world, ps in sorted(by_world.items()):
        pool = RankPool(world, timeout=CELL_TIMEOUT)
        try:
            for n in names:
                got = pool.run(run_cells, [n], ps, steps, timeout=CELL_TIMEOUT * 2 * len(ps) + 120)[0]
                for c in got:
                    cells[(c.arch, c.plan)] = c
                    if log:
                        log(f"{c.arch:12s} {c.plan:8s} {'ok' if c.ok else c.why} ({c.seconds:.1f} s)")
                if not pool.alive:
                    pool = RankPool(world, timeout=CELL_TIMEOUT)
        finally:
            pool.close()
    return [cells[(n, p)] for n in names for p in plans]


def table(cells: list) -> str:
    """The zoo as a Markdown table (architecture x plan: ✓, or ✗ with a numbered reason below;
    a ✓ with a lettered note where the plan holds parity but leaves part of its work undone)."""
    names = list(dict.fromkeys(c.arch for c in cells))
    plans = list(dict.fromkeys(c.plan for c in cells))
    at = {(c.arch, c.plan): c for c in cells}
    reasons: list = []
    notes: list = []
    lines = ["| architecture | family | " + " | ".join(plans) + " |",
             "|---|---|" + "---|" * len(plans)]
    for n in names:
        row = []
        for p in plans:
            c = at[(n, p)]
            if c.ok and c.note:
                if c.note not in notes:
                    notes.append(c.note)
                row.append(f"✓ ({chr(ord('a') + notes.index(c.note))})")
            elif c.ok:
                row.append("✓")
            else:
                if c.why not in reasons:
                    reasons.append(c.why)
                row.append(f"✗ ({reasons.index(c.why) + 1})")
        lines.append(f"| {n} | {arch(n).family} | " + " | ".join(row) + " |")
    held = sum(c.ok for c in cells)
    lines.append("")
    lines.append(f"{held} of {len(cells)} cells hold parity and the volume checks.")
    for i, why in enumerate(reasons, 1):
        lines.append(f"{i}. {why}")
    for i, note in enumerate(notes):
        lines.append(f"{chr(ord('a') + i)}. {note}")
    return "\n".join(lines)
