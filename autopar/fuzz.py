"""fuzz: random models under every plan, each compared with the single-device model.

Differential testing of generated programs, as C compilers are tested with Csmith and deep-
learning compilers with NNSmith: a seed draws a valid model from the op families real models
use (``autopar.fuzz_models``: attention with grouped kv heads, q/k norms per head and across
the width, rotary embeddings, causal and sliding-window masks, fused projections parted by
``split``/``view``/``chunk``, gated MLPs with norms over grouped inner widths, Mamba-style
convolutions and scans along the sequence, in-place writes into views, gathers and scatters,
top-k routers, tied weights and buffers) with sizes that divide unevenly (3 heads, 7 positions
over 2 ranks), and each plan of ``PLANS`` runs it on threaded ranks under ``autopar.verify``,
which compares every node's value and gradient, and the parameters' gradients, with the
single-device graph. A cell's verdict is

    correct   verify found every value within tolerance;
    refused   compile (or capture) declined with an autopar error naming the cause
              (ValueError, TypeError, NotImplementedError raised by autopar's own code);
    crashed   another exception, or one raised inside torch: a bug, but a loud one;
    wrong     verify found a value off: a silently wrong program, the one verdict that must
              never happen.

``shrink`` reduces a model that is wrong (or crashes) to a minimal one that still is: it drops
blocks and turns each choice to its simplest value while the verdict stays the same, and
``source`` prints it as a standalone module (the block classes it uses and one constructor
call). ``python -m autopar fuzz --minutes N`` runs open-ended; the tests run a fixed-seed
budget.

Pipelines (``PIPELINE_PLANS``) run on local processes, their send and receive needing them
(``verify``'s threaded ranks have none): the model trains one SGD step on a ``RankPool``
under ``autopar.compare.parity``, whose loss, gradients and parameters after the step are
compared with the single-device model's, within the same tolerance.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import random
import re
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from . import fuzz_models
from .compare import parity
from .launch import RankPool, quiet
from .mesh import Mesh
from .planspec import Plan
from .verification import verify

__all__ = ["Spec", "Verdict", "PLANS", "FAMILIES", "generate", "build", "example", "source", "check", "shrink",
           "run", "Summary"]

PLANS = {
    "zero3": ("dp=2", "dp=zero3"),
    "tp": ("tp=2", "tp"),
    "tp+sp": ("tp=2", "tp,sp"),
    "dp×tp": ("dp=2,tp=2", "dp=zero3,tp,sp"),
}
"""plan name -> (mesh, plan text): each generated model runs under each, on threaded ranks"""

PIPELINE_PLANS = {
    "1f1b": ({"pp": 2}, "pp_schedule=1f1b,microbatches=2"),
}
"""plan name -> (mesh axes, plan text): the pipelines, on processes"""
PIPELINE_TIMEOUT = 10.0
"""the pipelines' mesh timeout (seconds): a transfer whose peer failed waits this long"""

DTYPE = torch.float64
TOL = 1e-9
"""the models run in float64 and are compared within this scaled error: rounding differences of
two summation orders are then ~1e-13 (float32's ~1e-4 would blur with a small real error), and a
value that is wrong is off by far more than either"""

BATCH = 4
"""rows of the global batch: even over dp=2 (an uneven batch is refused, and not what this tests)"""

# Each family's choices, the simplest first (the shrinker moves a choice towards the front).
FAMILIES = {
    "Attention": dict(fused=[False, "split", "view"], qk_norm=["none", "head", "full"],
                      qk_kind=["rms", "rms_torch", "layer"],
                      rope=["none", "table", "gather"], kernel=["sdpa", "explicit", "alibi"], causal=[True, False],
                      window=[0, 3], bias=[False, True], heads=[2, 4, 3], kv=["mha", "gqa", "mqa"],
                      head_dim=[4, 8, 6]),
    "MLP": dict(gated=[False, True], fused=[False, True], act=["relu", "silu", "gelu"],
                inner_norm=["none", "rms", "layer", "group"], groups=[2, 4, 3], bias=[False, True],
                ffn=[16, 24, 20, 12]),
    "SeqMixer": dict(kernel=[2, 3, 4], scan=["cumsum", "cummax", "logcumsumexp", "decay"], norm=["none", "rms", "group"],
                     groups=[2, 4], inner=[8, 16, 12, 10]),
    "Writes": dict(mode=["slice_mul", "masked_fill", "first_token", "new_empty", "add_relu", "view_write"],
                   width=[8, 12, 16, 10]),
    "Index": dict(mode=["gather", "index_select", "scatter_add", "shift", "take_seq"]),
    "MoE": dict(experts=[2, 4, 3], top_k=[1, 2], form=["dense", "stacked"], ffn=[8, 12, 16]),
}
"""block family -> its choices; a generated block draws one value of each"""

MODEL_CHOICES = dict(tied=[False, True], positions=[False, True], scale=[1.0, 0.5],
                     final_norm=["none", "rms", "layer", "rms_torch"], residual=["pre", "post", "parallel"],
                     loss=["mean_square", "cross_entropy"])
"""the model's own choices; ``loss``: verify's mean square of the logits, or the model's
cross-entropy against target tokens (the LM head's vocabulary-parallel loss under tp)"""
NORMS = ["none", "rms", "layer", "rms_torch"]
DIMS = dict(hidden=[16, 24, 12, 20], seq=[8, 6, 7], vocab=[32, 40, 37])
MAX_BLOCKS = 3


# ---- the model a seed draws ------------------------------------------------------------------

@dataclass(frozen=True)
class Spec:
    """A generated model: its sizes, model-level choices and blocks (family, choices, the pre-norm
    before it). ``build(spec)`` makes it, ``source(spec)`` prints it."""
    seed: int
    hidden: int
    seq: int
    vocab: int
    model: tuple
    """(name, value) pairs of ``MODEL_CHOICES``"""
    blocks: tuple
    """(family, ((name, value), ...), pre-norm kind) per block"""

    def families(self) -> list:
        return [b[0] for b in self.blocks]

    def describe(self) -> str:
        blocks = "; ".join(f"{fam}({', '.join(f'{k}={v!r}' for k, v in kw)}) after {norm}"
                           for fam, kw, norm in self.blocks)
        model = ", ".join(f"{k}={v!r}" for k, v in self.model)
        return (f"seed {self.seed}: hidden {self.hidden}, seq {self.seq}, vocab {self.vocab}, {model}; "
                f"blocks: {blocks}")


def generate(seed: int) -> Spec:
    """The model of ``seed``: 1 to ``MAX_BLOCKS`` blocks of random families and choices."""
    rng = random.Random(seed)
    dims = {k: rng.choice(v) for k, v in DIMS.items()}
    model = {k: rng.choice(v) for k, v in MODEL_CHOICES.items() if k != "loss"}
    blocks = tuple((fam, tuple((k, rng.choice(v)) for k, v in FAMILIES[fam].items()), rng.choice(NORMS))
                   for fam in (rng.choice(list(FAMILIES)) for _ in range(rng.randint(1, MAX_BLOCKS))))
    model["loss"] = rng.choice(MODEL_CHOICES["loss"])
    return Spec(seed, dims["hidden"], dims["seq"], dims["vocab"], tuple(model.items()), blocks)


def _divisor(n: int, want: int) -> int:
    return want if n % want == 0 else 2 if n % 2 == 0 else 1


def _constructor(spec: Spec, index: int) -> tuple[str, dict]:
    """The block class and the literal arguments of block ``index`` (choices made consistent:
    kv heads dividing heads, groups dividing the width, a window only where a mask is built)."""
    fam, kw, _ = spec.blocks[index]
    c, h, s = dict(kw), spec.hidden, spec.seq
    if fam == "Attention":
        heads = c["heads"]
        kv = {"mha": heads, "gqa": heads // 2 if heads % 2 == 0 else 1, "mqa": 1}[c["kv"]]
        return fam, dict(hidden=h, heads=heads, kv_heads=kv, head_dim=c["head_dim"], fused=c["fused"],
                         qk_norm=c["qk_norm"], qk_kind=c["qk_kind"], rope=c["rope"], kernel=c["kernel"],
                         causal=c["causal"], window=c["window"] if c["kernel"] != "sdpa" else 0, bias=c["bias"],
                         seq=s)
    if fam == "MLP":
        return fam, dict(hidden=h, ffn=c["ffn"], gated=c["gated"], fused=c["fused"] and c["gated"], act=c["act"],
                         inner_norm=c["inner_norm"], groups=_divisor(c["ffn"], c["groups"]), bias=c["bias"])
    if fam == "SeqMixer":
        return fam, dict(hidden=h, inner=c["inner"], kernel=c["kernel"], scan=c["scan"], norm=c["norm"],
                         groups=_divisor(c["inner"], c["groups"]))
    if fam == "Writes":
        return fam, dict(hidden=h, width=c["width"], mode=c["mode"], heads=2)
    if fam == "Index":
        return fam, dict(hidden=h, mode=c["mode"], seq=s, seed=spec.seed + index)
    if fam == "MoE":
        return fam, dict(hidden=h, ffn=c["ffn"], experts=c["experts"], top_k=min(c["top_k"], c["experts"]),
                         form=c["form"])
    raise ValueError(f"unknown block family {fam!r}; the fuzzer has {', '.join(FAMILIES)}")


def _model_args(spec: Spec) -> dict:
    m = dict(spec.model)
    return dict(vocab=spec.vocab, hidden=spec.hidden, seq=spec.seq, norms=[b[2] for b in spec.blocks],
                final_norm=m["final_norm"], tied=m["tied"], positions=m["positions"], scale=m["scale"],
                residual=m["residual"])


def build(spec: Spec) -> torch.nn.Module:
    """The model of ``spec``, its weights drawn from ``torch.manual_seed(spec.seed)``, in ``DTYPE``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        blocks = [getattr(fuzz_models, cls)(**kw) for cls, kw in map(lambda i: _constructor(spec, i),
                                                                      range(len(spec.blocks)))]
        return fuzz_models.FuzzModel(blocks=blocks, **_model_args(spec)).to(DTYPE)


def example(spec: Spec) -> tuple:
    """The global batch: ``BATCH`` rows of ``spec.seq`` tokens (and as many target tokens, for
    a model that computes its cross-entropy)."""
    g = torch.Generator().manual_seed(spec.seed)
    tokens = torch.randint(0, spec.vocab, (BATCH, spec.seq), generator=g)
    if dict(spec.model)["loss"] == "mean_square":
        return (tokens,)
    return tokens, torch.randint(0, spec.vocab, (BATCH, spec.seq), generator=g)


def _own_loss(loss):
    """verify's ``loss_fn`` for a model that returns its loss: the loss itself."""
    return loss


def _loss_fn(spec: Spec):
    return None if dict(spec.model)["loss"] == "mean_square" else _own_loss


# ---- the standalone module of a model --------------------------------------------------------------

def _chunks() -> dict:
    """``fuzz_models``' top-level definitions: name -> source text."""
    text = inspect.getsource(fuzz_models)
    out = {}
    for m in re.finditer(r"^(class|def) (\w+).*?(?=^(?:class|def) |\Z)", text, re.S | re.M):
        out[m.group(2)] = m.group(0).rstrip() + "\n"
    return out


def source(spec: Spec, plan: Optional[str] = None) -> str:
    """``spec`` as a standalone module: imports, the classes it uses, ``build()`` and ``example()``,
    and how to check it under ``plan``: ``verify`` for a plan of ``PLANS``; for a pipeline
    (``PIPELINE_PLANS``, run on processes) the fuzzer's own ``check`` of ``spec``."""
    chunks = _chunks()
    calls = [_constructor(spec, i) for i in range(len(spec.blocks))]
    want, todo = set(), ["FuzzModel"] + [cls for cls, _ in calls]
    while todo:        # the classes used, and those their text names
        name = todo.pop()
        if name in want:
            continue
        want.add(name)
        todo += [n for n in chunks if n not in want and re.search(rf"\b{n}\b", chunks[name])]
    args = ", ".join(f"{k}={v!r}" for k, v in _model_args(spec).items())
    blocks = ",\n        ".join(f"{cls}({', '.join(f'{k}={v!r}' for k, v in kw.items())})" for cls, kw in calls)
    mesh, text = PLANS.get(plan, ("dp=2", "dp=zero3"))
    lines = [f'"""A model the autopar fuzzer generated ({spec.describe()})."""',
             "import math", "", "import torch", "import torch.nn as nn", "import torch.nn.functional as F", "", ""]
    lines += ["\n\n".join(chunks[n] for n in chunks if n in want), "",
              "def build():",
              f"    torch.manual_seed({spec.seed})",
              f"    blocks = [\n        {blocks},\n    ]",
              f"    return FuzzModel(blocks=blocks, {args}).to({DTYPE})", "", "",
              "def example():",
              f"    g = torch.Generator().manual_seed({spec.seed})",
              f"    tokens = torch.randint(0, {spec.vocab}, ({BATCH}, {spec.seq}), generator=g)"]
    if _loss_fn(spec) is None:
        lines += ["    return (tokens,)", "", ""]
    else:
        lines += [f"    return tokens, torch.randint(0, {spec.vocab}, ({BATCH}, {spec.seq}), generator=g)", "", "",
                  "def own_loss(loss):", "    return loss", "", ""]
    loss = "" if _loss_fn(spec) is None else ", loss_fn=own_loss"
    lines += ['if __name__ == "__main__":', "    import autopar"]
    if plan in PIPELINE_PLANS:
        lines += ["    from autopar import fuzz", f"    print(fuzz.check(fuzz.{spec!r}, {plan!r}))", ""]
    else:
        lines += [f"    print(autopar.verify(build(), {mesh!r}, {text!r}, example_inputs=example(){loss}, tol={TOL:g}))",
                  ""]
    return "\n".join(lines)


# ---- one cell: a model under a plan --------------------------------------------------------------------

@dataclass
class Verdict:
    """One (model, plan) cell."""
    seed: int
    plan: str
    kind: str
    """correct, refused, crashed or wrong"""
    detail: str = ""
    """the refusal, the crash or the divergence, in one line"""
    error_type: str = ""
    seconds: float = 0.0
    trace: str = ""
    """a crash's traceback (the rank's, for an error raised on a rank)"""

    def __str__(self) -> str:
        return f"seed {self.seed} under {self.plan}: {self.kind}" + (f": {self.detail}" if self.detail else "")


_OURS = tuple(str(Path(p).resolve()) for p in (Path(__file__).parent, Path(__file__).parent.parent / "passes"))
REFUSALS = (ValueError, TypeError, NotImplementedError)


def _root(exc: BaseException) -> BaseException:
    """The error a rank raised, out of ``run_threads``' report of it."""
    while exc.__cause__ is not None and re.match(r"rank \d+ of \d+ failed", str(exc)):
        exc = exc.__cause__
    return exc


def _raised_by_us(exc: BaseException) -> bool:
    """Whether the innermost frame of ``exc``'s traceback is autopar's (or its passes')."""
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and str(Path(frames[-1].filename).resolve()).startswith(_OURS)


def _one_line(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def _classified(exc: BaseException) -> tuple:
    """(kind, detail, error type, traceback) of an exception a cell raised."""
    root = _root(exc)
    refused = isinstance(root, REFUSALS) and _raised_by_us(root)
    trace = "" if refused else "".join(traceback.format_exception(root))
    return ("refused" if refused else "crashed"), _one_line(root), type(root).__name__, trace


def _mean_square(out, target):
    return out.pow(2).mean()


def _pipeline_rank(spec: Spec, plan: str, tol: float) -> tuple:
    """One rank of a pipeline cell (a ``RankPool`` job): (kind, detail, error type, traceback)."""
    axes, text = PIPELINE_PLANS[plan]
    try:
        with quiet():
            mesh = Mesh(timeout=PIPELINE_TIMEOUT, **axes)
            own = _loss_fn(spec) is not None
            rep = parity(lambda: build(spec), mesh, Plan.parse(text), example(spec), None,
                         None if own else _mean_square, steps=1, lr=0.1, optimizer=torch.optim.SGD, rtol=tol,
                         atol=tol * 1e-3, noise_floor=0.0)
        if rep.ok:
            return "correct", "", "", ""
        return ("wrong", f"rank {rep.rank}: loss {rep.loss_err:.3g}, gradients {rep.grad_err:.3g}, parameters "
                f"{rep.param_err:.3g} (scaled errors over the tolerance) {'; '.join(rep.messages)}".strip(), "", "")
    except Exception as exc:       # the verdict: refused or crashed
        return _classified(exc)


_POOLS: dict = {}
"""world size -> the RankPool the pipeline cells of that size run on, kept between cells"""


def _pipeline_check(spec: Spec, plan: str, tol: float) -> tuple:
    """Every rank's verdict of a pipeline cell, put together: wrong if a rank found the values
    off, else the error of a rank that raised first-hand (not a peer's ``PeerError``)."""
    world = math.prod(PIPELINE_PLANS[plan][0].values())
    pool = _POOLS.get(world)
    if pool is None or not pool.alive:
        pool = _POOLS[world] = RankPool(world, timeout=PIPELINE_TIMEOUT)
    try:
        got = pool.run(_pipeline_rank, spec, plan, tol, timeout=4 * PIPELINE_TIMEOUT)
    except Exception as exc:          # the pool itself failed (a rank died): a crash
        return "crashed", _one_line(exc), type(exc).__name__, str(exc)
    if any(g[0] != "correct" for g in got):
        pool.close()               # a cell that failed may leave a collective behind: a fresh pool next
        _POOLS.pop(world, None)
    for kind in ("wrong", "crashed", "refused"):
        first = ([g for g in got if g[0] == kind and g[2] not in _SECOND_HAND] or
                 [g for g in got if g[0] == kind])
        if first:
            return first[0]
    return got[0]


_SECOND_HAND = ("PeerError", "CollectiveError")
"""errors a rank raises because another failed: the other's error is the verdict"""


def check(spec: Spec, plan: str, tol: float = TOL, timeout: float = 120.0) -> Verdict:
    """Run ``spec``'s model under ``plan`` (a key of ``PLANS`` or ``PIPELINE_PLANS``) against
    the single-device model, within scaled error ``tol``; the cell's verdict (module docstring)."""
    t0 = time.perf_counter()
    if plan in PIPELINE_PLANS:
        kind, detail, etype, trace = _pipeline_check(spec, plan, tol)
        return Verdict(spec.seed, plan, kind, detail, etype, time.perf_counter() - t0, trace)
    mesh, text = PLANS[plan]
    try:
        with quiet():
            report = verify(build(spec), mesh, text, example_inputs=example(spec), loss_fn=_loss_fn(spec), tol=tol,
                            spawn=False, timeout=timeout)
        kind, detail, etype, trace = ("correct", "", "", "") if report.ok else ("wrong", str(report), "", "")
    except Exception as exc:          # the verdict: refused or crashed, by who raised what
        kind, detail, etype, trace = _classified(exc)
    return Verdict(spec.seed, plan, kind, detail, etype, time.perf_counter() - t0, trace)


# ---- shrinking -----------------------------------------------------------------------------------------

def _same_failure(a: Verdict, b: Verdict) -> bool:
    return a.kind == b.kind and (a.kind == "wrong" or a.error_type == b.error_type)


def _smaller(spec: Spec):
    """Specs one step simpler than ``spec``: a block dropped, a choice moved to its simplest value."""
    if len(spec.blocks) > 1:
        for i in range(len(spec.blocks)):
            yield dataclasses.replace(spec, blocks=spec.blocks[:i] + spec.blocks[i + 1:])
    for i, (fam, kw, norm) in enumerate(spec.blocks):
        if norm != NORMS[0]:
            yield dataclasses.replace(spec, blocks=spec.blocks[:i] + ((fam, kw, NORMS[0]),) + spec.blocks[i + 1:])
        for j, (k, v) in enumerate(kw):
            choices = FAMILIES[fam][k]
            for simpler in choices[:choices.index(v)]:
                kw2 = kw[:j] + ((k, simpler),) + kw[j + 1:]
                yield dataclasses.replace(spec, blocks=spec.blocks[:i] + ((fam, kw2, norm),) + spec.blocks[i + 1:])
    for j, (k, v) in enumerate(spec.model):
        choices = MODEL_CHOICES[k]
        for simpler in choices[:choices.index(v)]:
            yield dataclasses.replace(spec, model=spec.model[:j] + ((k, simpler),) + spec.model[j + 1:])
    for dim in ("hidden", "seq", "vocab"):
        choices = DIMS[dim]
        for simpler in choices[:choices.index(getattr(spec, dim))]:
            yield dataclasses.replace(spec, **{dim: simpler})


def shrink(spec: Spec, plan: str, failing: Optional[Verdict] = None, budget: int = 200, log=None) -> tuple:
    """The smallest model ``_smaller`` reaches from ``spec`` that fails under ``plan`` as
    ``failing`` does (greedy: the first simpler model that still fails is taken, until none
    does or ``budget`` checks are spent). Returns (spec, its verdict)."""
    failing = failing or check(spec, plan)
    if failing.kind not in ("wrong", "crashed"):
        raise ValueError(f"shrink takes a failing model; {failing}")
    tried = 0
    progress = True
    while progress and tried < budget:
        progress = False
        for smaller in _smaller(spec):
            tried += 1
            v = check(smaller, plan)
            if _same_failure(v, failing):
                spec, failing, progress = smaller, v, True
                if log:
                    log(f"  shrunk to {len(spec.blocks)} block(s): {spec.describe()}")
                break
            if tried >= budget:
                break
    return spec, failing


# ---- a campaign ----------------------------------------------------------------------------------------

@dataclass
class Summary:
    """What a run found: every verdict, the families generated, and the failures."""
    verdicts: list = field(default_factory=list)
    families: Counter = field(default_factory=Counter)
    models: int = 0
    seconds: float = 0.0

    def counts(self) -> Counter:
        return Counter(v.kind for v in self.verdicts)

    def failures(self) -> list:
        return [v for v in self.verdicts if v.kind in ("wrong", "crashed")]

    def table(self) -> str:
        kinds = ("correct", "refused", "crashed", "wrong")
        by_plan = {p: Counter(v.kind for v in self.verdicts if v.plan == p) for p in dict.fromkeys(
            v.plan for v in self.verdicts)}
        rows = [f"{'plan':8s} " + " ".join(f"{k:>8s}" for k in kinds)]
        rows += [f"{p:8s} " + " ".join(f"{c[k]:8d}" for k in kinds) for p, c in by_plan.items()]
        total = self.counts()
        rows.append(f"{'all':8s} " + " ".join(f"{total[k]:8d}" for k in kinds))
        rate = self.models / (self.seconds / 60) if self.seconds else 0.0
        rows.append(f"{self.models} models in {self.seconds:.0f} s ({rate:.1f} models a minute, "
                    f"{len(self.verdicts)} cells); blocks: " + ", ".join(f"{k} {n}" for k, n in sorted(
                        self.families.items())))
        return "\n".join(rows)


def run(seeds=None, plans=None, minutes: Optional[float] = None, log=None, stop_at_wrong: bool = False) -> Summary:
    """Check each model of ``seeds`` (an iterable; default 0, 1, 2, ...) under each of ``plans``
    (default every plan of ``PLANS`` and ``PIPELINE_PLANS``), until the seeds run out or ``minutes`` pass (or, with
    ``stop_at_wrong``, a verdict is wrong)."""
    plans = list(plans or (*PLANS, *PIPELINE_PLANS))
    seeds = iter(seeds) if seeds is not None else iter(range(10 ** 9))
    out = Summary()
    t0 = time.perf_counter()
    for seed in seeds:
        if minutes is not None and time.perf_counter() - t0 > minutes * 60:
            break
        spec = generate(seed)
        out.models += 1
        out.families.update(spec.families())
        for plan in plans:
            v = check(spec, plan)
            out.verdicts.append(v)
            if log and v.kind != "correct":
                log(str(v))
            if stop_at_wrong and v.kind == "wrong":
                out.seconds = time.perf_counter() - t0
                return out
    out.seconds = time.perf_counter() - t0
    return out
