"""The plan: which mesh axis does what.

A ``Plan`` is a value: a frozen dataclass, validated on construction, whose ``str`` is a
round-trip form (``Plan.parse(str(plan)) == plan``). Fields that later capabilities add
default to "off" so that an older plan keeps its meaning.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, fields
from typing import Optional, Union

import torch

from .placement import parse_placement
from .schedule import SCHEDULES as PP_SCHEDULES, Schedule

__all__ = ["Plan", "DP_MODES", "RECOMPUTE", "OFFLOAD", "PP_SCHEDULES", "DTYPES", "dtype_name"]

DP_MODES = ("ddp", "zero1", "zero2", "zero3")
RECOMPUTE = ("none", "selective", "full")
OFFLOAD = (None, "optimizer")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}
"""The floating dtypes a plan's precision fields take, by name (also: fp32, bf16, fp16, fp64)."""
_SHORT = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64", "float": "float32",
          "half": "float16", "double": "float64"}
_DTYPE_FIELDS = ("param_dtype", "reduce_dtype", "master_dtype", "output_dtype")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def _as_dtype(field: str, value):
    if value is None or isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str):
        name = _SHORT.get(value.strip().removeprefix("torch."), value.strip().removeprefix("torch."))
        if name not in DTYPES:
            raise ValueError(f"Plan({field}={value!r}) is not a dtype autopar knows; expected one of "
                             f"{', '.join(DTYPES)} (or torch.bfloat16, ...)")
        dtype = DTYPES[name]
    else:
        raise TypeError(f"Plan({field}={value!r}) takes a torch dtype (torch.bfloat16) or its name, got "
                        f"{type(value).__name__}")
    if dtype is not None and dtype not in DTYPES.values():
        raise ValueError(f"Plan({field}={dtype}) is not a floating dtype; expected one of {', '.join(DTYPES)}")
    return dtype


@dataclass(frozen=True)
class Plan:
    dp: str = "ddp"
    """Data-parallel mode over the ``dp`` axis: ``ddp`` (replicated parameters, gradient
    all-reduce), ``zero1`` (optimizer state sharded), ``zero2`` (also gradients), ``zero3``
    (also parameters, gathered around each use)."""
    tp: bool = False
    """Tensor (Megatron) parallelism over the ``tp`` axis."""
    sp: bool = False
    """Sequence parallelism of the pointwise regions between tensor-parallel blocks (needs tp)."""
    tp_layout: tuple = ()
    """Overrides of the tensor-parallel layout: ``((name pattern, placement), ...)``, e.g.
    ``(("*.fc.weight", "S(0)"), ("head.weight", "R"))``; patterns match parameter names (as in
    ``model.named_parameters()``) with fnmatch, placements are ``S(<dim>)`` or ``R``. The
    layout of everything else is found from the graph around them."""
    vocab_parallel: Optional[bool] = None
    """How tensor parallelism lays out an LM head (a product over a vocabulary: tied to the
    embedding, or feeding a cross-entropy, or shaped like a table the graph looks up;
    ``passes/lm_head.py``): True splits it along the vocabulary (a tied lookup vocab-parallel, the
    logits split, a cross-entropy in the graph vocab-parallel, logits that leave the graph
    gathered), False keeps it whole on every rank, None lets the cost model of the compile's
    cluster take the faster."""
    pp_schedule: Optional[str] = None
    """Pipeline schedule over the ``pp`` axis: one of ``gpipe``, ``1f1b``, ``interleaved``,
    ``zero_bubble``, or a user's own action list in the printed form of
    ``autopar.schedule.Schedule`` (``"rank 0: 0F0 0F1 0B0 0B1\nrank 1: ..."``); None means
    no pipeline."""
    microbatches: int = 1
    """Micro-batches per step for the pipeline schedule (the dp slice of the batch is split
    into this many equal parts along dim 0)."""
    virtual_stages: int = 1
    """Stages per rank of the ``pp`` axis (``interleaved`` needs 2 or more: rank r runs stages
    r, r + p, r + 2p, ...); the graph is cut into pp × virtual_stages stages."""
    stage_memory_bytes: Optional[int] = None
    """Upper limit on one pipeline stage's memory (parameters, gradients and optimizer state
    under the dp mode, plus the activations of its in-flight micro-batches); None: no limit."""
    bucket_bytes: int = 25 << 20
    """Largest gradient bucket (bytes) of the bucketed backward collectives; the first bucket
    is cut at 1 MiB so that communication starts early (as DDP does). ZeRO-3 also cuts its
    gather units (one per numbered layer) at this size."""
    overlap: bool = True
    """Run the overlap pass: every collective is an asynchronous start and a wait, starts as
    early and waits as late as dependencies and ``prefetch_bytes`` allow (ZeRO-3 gathers issued
    ahead, gradient buckets reduced while backward runs). False: each collective is waited on
    as soon as it starts (the baseline the overlap is measured against)."""
    prefetch_bytes: Optional[int] = None
    """ZeRO-3: the most bytes of gathered parameters issued ahead of their use, in forward and
    in backward (on top of the unit in use); None: one unit ahead, as FSDP does; 0: none."""
    collective_matmul: bool = False
    """Tensor parallel with sp: run each all-gather + column-parallel matmul and each
    row-parallel matmul + reduce-scatter as ring steps, the matmul of one chunk overlapping the
    transfer of the next (``autopar.runtime.collmatmul``)."""
    dropout_rng: str = "exact"
    """How dropout draws its masks (``autopar.runtime.rng``). Either way the masks come from one
    stream per mesh, whatever each rank seeded: rank 0's default generator, its state broadcast
    at each draw (a rank seeded as rank 0 is advanced as one device would be; a rank seeded
    otherwise, ``torch.manual_seed(seed + rank)``, keeps its own stream for its own use).
    ``exact``: masks bitwise equal to the single-device model's; every rank draws the whole
    model's masks and keeps its slice, and attention with dropout runs the math form (the
    probabilities times the mask). ``local``: each rank draws only its slice, from a generator
    keyed by one number of the stream per step, the site and the slice (slices held by several
    ranks get one mask, shards independent ones), and attention keeps its fused kernel
    (flash / memory-efficient) seeded by that key: statistically, not bitwise, the
    single-device model's masks, and the generator ends the step elsewhere than one device's."""
    param_dtype: Optional[torch.dtype] = None
    """Mixed precision: the dtype forward and backward compute in (``torch.bfloat16``). The
    optimizer then owns the parameters in ``master_dtype`` (this rank's shards under ZeRO; the
    full copy under ddp); forward reads ``param_dtype`` copies of them (ZeRO-3 gathers them in
    ``param_dtype``, ZeRO-1/2 keep ``param_dtype`` replicas, ddp casts once per forward), the
    model's floating inputs are cast to it, and ops follow ``torch.autocast`` of the device the
    module runs on (``passes/autocast.py``). None: the model's own dtypes, no master copy."""
    reduce_dtype: Optional[torch.dtype] = None
    """The dtype gradients are summed in on every axis (dp buckets; tp's all-reduces of the
    gradients of replicated parameters and inputs, and the reduce-scatters of sp's); None: the
    master dtype under ``param_dtype`` (fp32 sums of bf16 gradients), else the gradients' own."""
    master_dtype: torch.dtype = torch.float32
    """The dtype of the optimizer's copy of the parameters under ``param_dtype``."""
    output_dtype: Optional[torch.dtype] = None
    """Mixed precision: the dtype the module's floating outputs computed in ``param_dtype`` leave
    it in (cast differentiably at its boundary, as FSDP2's ``MixedPrecisionPolicy(output_dtype)``;
    a pipeline's last stage alike, before the loss), so that a loss computed on them runs in
    that dtype. Outputs already in another dtype (a loss the model computes, which autocast puts
    in fp32) keep it. None: ``master_dtype`` (fp32 logits, as the single-device fp32 model gives);
    ``torch.bfloat16`` keeps them in the compute dtype."""
    recompute: Union[str, int] = "none"
    """Activation recomputation (``passes/recompute.py``): ``"none"``; ``"selective"``, the
    attention core of each layer (scores, softmax, dropout, the product with V) is recomputed
    in backward instead of kept (Korthikanti et al., 2023); ``"full"``, each numbered layer
    keeps only its inputs and runs its forward again in backward; or a budget in bytes per rank:
    per layer, the cost model chooses what to keep so that the predicted peak fits, the
    cheapest recomputation first (selective before full)."""
    offload: Optional[str] = None
    """``"optimizer"``: the optimizer's state and step live in host memory (ZeRO-Offload): this
    rank's gradients go down to the host, the step runs there, the updated parameters come
    back. None: everything stays on the device."""

    def __post_init__(self):
        for name in _DTYPE_FIELDS:
            object.__setattr__(self, name, _as_dtype(name, getattr(self, name)))
        if self.master_dtype is None:
            raise ValueError("Plan(master_dtype=None): the optimizer's copy needs a dtype; leave the default "
                             "(torch.float32)")
        if self.param_dtype == torch.float16:
            raise ValueError("Plan(param_dtype=torch.float16) needs dynamic loss scaling (fp16's range underflows "
                             "gradients), which autopar does not implement; use param_dtype=torch.bfloat16 (same "
                             "bytes, fp32's range, no scaling)")
        if self.param_dtype is not None and torch.finfo(self.master_dtype).bits < torch.finfo(self.param_dtype).bits:
            raise ValueError(f"Plan(master_dtype={dtype_name(self.master_dtype)}) is narrower than "
                             f"param_dtype={dtype_name(self.param_dtype)}: the master copy must hold at least "
                             "the compute precision")
        if self.reduce_dtype is not None and self.param_dtype is None:
            raise ValueError(f"Plan(reduce_dtype={dtype_name(self.reduce_dtype)}) needs param_dtype: without mixed "
                             "precision gradients are summed in their own dtype")
        if self.output_dtype is not None and self.param_dtype is None:
            raise ValueError(f"Plan(output_dtype={dtype_name(self.output_dtype)}) needs param_dtype: without mixed "
                             "precision the outputs are in the model's own dtypes")
        if self.dp not in DP_MODES:
            raise ValueError(f"Plan(dp={self.dp!r}) is not a data-parallel mode; expected one of {DP_MODES}")
        if not isinstance(self.tp, bool) or not isinstance(self.sp, bool):
            raise TypeError(f"Plan tp and sp take True/False, got tp={self.tp!r} sp={self.sp!r}")
        if self.sp and not self.tp:
            raise ValueError("Plan(sp=True) needs tp=True: sequence parallelism shards the regions "
                             "between tensor-parallel blocks")
        if isinstance(self.tp_layout, list):
            object.__setattr__(self, "tp_layout", tuple(tuple(x) for x in self.tp_layout))
        for item in self.tp_layout:
            if not (isinstance(item, tuple) and len(item) == 2 and all(isinstance(x, str) for x in item)):
                raise TypeError(f"Plan tp_layout takes ((name pattern, placement), ...) pairs of strings, "
                                f"got {item!r}; e.g. tp_layout=(('*.fc.weight', 'S(0)'),)")
            if item[1].strip().startswith("P"):
                raise ValueError(f"Plan tp_layout {item!r}: a parameter is stored whole (R) or split "
                                 "(S(dim)), not Partial")
            parse_placement(item[1])
        if self.tp_layout and not self.tp:
            raise ValueError("Plan(tp_layout=...) needs tp=True")
        if not (self.vocab_parallel is None or isinstance(self.vocab_parallel, bool)):
            raise TypeError(f"Plan(vocab_parallel={self.vocab_parallel!r}) takes True, False or None (the cost "
                            "model chooses)")
        if self.vocab_parallel is not None and not self.tp:
            raise ValueError("Plan(vocab_parallel=...) needs tp=True: it lays out the LM head along the tp axis")
        if self.pp_schedule is not None and self.pp_schedule not in PP_SCHEDULES:
            self._check_custom_schedule()
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ValueError(f"Plan(microbatches={self.microbatches!r}) must be a positive integer")
        if not isinstance(self.virtual_stages, int) or self.virtual_stages < 1:
            raise ValueError(f"Plan(virtual_stages={self.virtual_stages!r}) must be a positive integer")
        if self.pp_schedule is None and (self.microbatches != 1 or self.virtual_stages != 1):
            raise ValueError("Plan(microbatches=..., virtual_stages=...) need a pipeline schedule: set "
                             f"pp_schedule to one of {PP_SCHEDULES}")
        if self.pp_schedule == "interleaved" and self.virtual_stages < 2:
            raise ValueError("Plan(pp_schedule='interleaved') needs virtual_stages >= 2 (stages per rank); "
                             "with one stage per rank use '1f1b'")
        if self.pp_schedule in ("gpipe", "1f1b", "zero_bubble") and self.virtual_stages != 1:
            raise ValueError(f"Plan(pp_schedule={self.pp_schedule!r}) runs one stage per rank, got "
                             f"virtual_stages={self.virtual_stages}; use pp_schedule='interleaved' for more")
        if self.stage_memory_bytes is not None and (not isinstance(self.stage_memory_bytes, int)
                                                    or self.stage_memory_bytes < 1):
            raise ValueError(f"Plan(stage_memory_bytes={self.stage_memory_bytes!r}) must be a positive "
                             "integer or None")
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 1:
            raise ValueError(f"Plan(bucket_bytes={self.bucket_bytes!r}) must be a positive integer")
        if not isinstance(self.overlap, bool) or not isinstance(self.collective_matmul, bool):
            raise TypeError(f"Plan overlap and collective_matmul take True/False, got overlap={self.overlap!r} "
                            f"collective_matmul={self.collective_matmul!r}")
        if self.prefetch_bytes is not None and (not isinstance(self.prefetch_bytes, int) or self.prefetch_bytes < 0):
            raise ValueError(f"Plan(prefetch_bytes={self.prefetch_bytes!r}) must be a non-negative integer "
                             "(bytes) or None (one unit ahead)")
        if self.prefetch_bytes is not None and self.dp != "zero3":
            raise ValueError(f"Plan(prefetch_bytes={self.prefetch_bytes}) sets how far ZeRO-3 gathers parameters "
                             f"ahead, but dp={self.dp!r} keeps them whole; use dp='zero3' or drop prefetch_bytes")
        if self.dropout_rng not in ("exact", "local"):
            raise ValueError(f"Plan(dropout_rng={self.dropout_rng!r}): expected 'exact' (the single-device "
                             "masks) or 'local' (each rank draws only its slice)")
        if self.collective_matmul and self.param_dtype is not None and self.grad_reduce_dtype != self.param_dtype:
            raise ValueError(f"Plan(collective_matmul=True, param_dtype={dtype_name(self.param_dtype)}): the collective "
                             "matmul's backward ring sums gradient partials in the compute dtype, not in "
                             f"reduce_dtype={dtype_name(self.grad_reduce_dtype)}; drop collective_matmul, or set "
                             f"reduce_dtype={dtype_name(self.param_dtype)} to sum in the compute dtype everywhere")
        if isinstance(self.recompute, bool) or not (self.recompute in RECOMPUTE or (
                isinstance(self.recompute, int) and self.recompute > 0)):
            raise ValueError(f"Plan(recompute={self.recompute!r}): expected one of {RECOMPUTE} or a memory "
                             "budget in bytes per rank (a positive integer)")
        if self.recompute != "none" and self.split_backward:
            raise ValueError(f"Plan(recompute={self.recompute!r}) with a schedule that splits backward "
                             f"({self.pp_schedule if self.pp_schedule in PP_SCHEDULES else 'custom, with W actions'}): "
                             "the deferred weight gradients would have to recompute the layer a second time; "
                             "use pp_schedule='1f1b' or 'interleaved' with recompute, or recompute='none'")
        if self.offload not in OFFLOAD:
            raise ValueError(f"Plan(offload={self.offload!r}): expected one of {OFFLOAD}")
        if self.collective_matmul and not self.sp:
            raise ValueError("Plan(collective_matmul=True) needs tp=True and sp=True: it decomposes the "
                             "sequence-parallel all-gather / reduce-scatter around the tp matmuls")

    def _check_custom_schedule(self) -> None:
        if not isinstance(self.pp_schedule, str) or "rank" not in self.pp_schedule:
            raise ValueError(f"Plan(pp_schedule={self.pp_schedule!r}) is unknown; expected one of "
                             f"{PP_SCHEDULES}, None, or a schedule's text form ('rank 0: 0F0 0F1 0B0 ...')")
        s = Schedule.parse(self.pp_schedule)
        s.validate()
        if (s.m, s.v) != (self.microbatches, self.virtual_stages):
            raise ValueError(f"the custom schedule runs {s.m} micro-batches and {s.v} stages per rank, but "
                             f"the plan says microbatches={self.microbatches}, virtual_stages="
                             f"{self.virtual_stages}; make them agree")

    @property
    def mixed(self) -> bool:
        """Mixed precision: compute in ``param_dtype``, the optimizer's masters in ``master_dtype``."""
        return self.param_dtype is not None

    @property
    def grad_reduce_dtype(self) -> Optional[torch.dtype]:
        """The dtype gradient sums run in (None: the gradients' own)."""
        if self.param_dtype is None:
            return None
        return self.reduce_dtype or self.master_dtype

    @property
    def output_cast_dtype(self) -> Optional[torch.dtype]:
        """The dtype outputs computed in ``param_dtype`` are returned in (None: no cast)."""
        if self.param_dtype is None:
            return None
        return self.output_dtype or self.master_dtype

    @property
    def split_backward(self) -> bool:
        """The schedule runs each backward as B (input gradient) and W (weight gradients,
        deferred): zero-bubble, or a custom action list with W actions."""
        if self.pp_schedule is None or self.pp_schedule in PP_SCHEDULES:
            return self.pp_schedule == "zero_bubble"
        return Schedule.parse(self.pp_schedule).split_backward

    def check_mesh(self, mesh) -> None:
        """A ValueError unless every axis this plan uses is in ``mesh`` (an ``autopar.Mesh``)
        and every axis of ``mesh`` larger than 1 has a role in the plan."""
        used = self.axes_used()
        for axis in used:
            if axis != "dp" and axis not in mesh.axes:
                raise ValueError(f"{self} uses mesh axis {axis!r}, but {mesh} has none; add it to the mesh "
                                 f"(e.g. Mesh(dp=..., {axis}=2)) or drop it from the plan")
        for axis, size in mesh.axes.items():
            if axis not in used and size > 1:
                raise ValueError(f"{mesh} has axis {axis}={size}, which {self} gives no role; "
                                 f"set the plan's {axis} field or make the axis size 1")

    def axes_used(self) -> tuple[str, ...]:
        """The mesh axes this plan gives a role to."""
        used = ["dp"]
        if self.tp:
            used.append("tp")
        if self.pp_schedule is not None:
            used.append("pp")
        return tuple(used)

    def __str__(self) -> str:
        parts = []
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "master_dtype" and self.param_dtype is None:
                continue      # only meaningful with param_dtype
            if f.name == "dp" or v != f.default:
                parts.append(f"{f.name}={dtype_name(v)!r}" if isinstance(v, torch.dtype) else f"{f.name}={v!r}")
        return f"Plan({', '.join(parts)})"

    @classmethod
    def parse(cls, text: str) -> "Plan":
        """Inverse of ``str(plan)``; also reads the fields alone, separated by commas, a bare
        name meaning True: ``"dp=zero3,tp,sp"`` (the command line's short form)."""
        if not text.strip().startswith("Plan("):
            return cls(**_short_fields(text))
        tree = ast.parse(text.strip(), mode="eval").body
        if not (isinstance(tree, ast.Call) and getattr(tree.func, "id", None) == "Plan" and not tree.args):
            raise ValueError(f"cannot parse plan {text!r}: expected Plan(field=value, ...)")
        return cls(**{kw.arg: ast.literal_eval(kw.value) for kw in tree.keywords})


def _short_fields(text: str) -> dict:
    """``"dp=zero3,tp,sp"`` -> ``{"dp": "zero3", "tp": True, "sp": True}``: values as Python
    literals where they read as one, else as text."""
    names = {f.name for f in fields(Plan)}
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = (x.strip() for x in part.partition("="))
        if name not in names:
            raise ValueError(f"cannot parse plan {text!r}: {name!r} is not a Plan field; fields: "
                             f"{', '.join(sorted(names))} (e.g. 'dp=zero3,tp,sp', or Plan(...) as str(plan) prints it)")
        try:
            out[name] = ast.literal_eval(value) if sep else True
        except (ValueError, SyntaxError):
            out[name] = value
    return out
