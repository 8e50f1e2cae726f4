"""autocast: mixed precision's per-op dtypes, as explicit casts in the logical graph.

Under ``Plan(param_dtype=...)`` capture exports the model with its floating parameters and
inputs in ``param_dtype`` (the program FSDP's mixed-precision policy runs), inside
``torch.autocast(device, param_dtype)`` as the single-device model runs (an op given an fp32
buffer and a bf16 activation runs only with autocast's casts). torch.export records the ops
above autocast, so the graph holds none of its casts, while every node's ``meta["val"]`` has
the dtype autocast gave it; this pass makes the casts explicit. (A program functionalised for
its in-place writes, ``autopar.functionalize``, was traced again below autocast and holds its
casts already: an op whose inputs are in autocast's dtype gets none here.) Some ops lose
accuracy there: a loss, and on GPUs softmax, norms, exponentials and reductions. For those
autopar follows ``torch.autocast`` of the device the module runs on, and does not keep a
list of its own: for every op of the graph it asks ``torch.autocast`` itself, by running the
op on fake tensors of that device inside ``torch.autocast(device, param_dtype)``. Where the
output dtype under autocast differs from the op's own, autocast cast its floating inputs to
that dtype (its fp32 list: to float32; its lower-precision list: to ``param_dtype``), and the
pass inserts the same casts (``aten._to_copy``) as nodes in front of the op. The graph then
computes what the single-device model computes under the same policy, without autocast at
run time, and every later pass (layouts, collectives, the pipeline cut) sees the casts.

On CPU (torch 2.13) that casts the losses (cross_entropy, nll_loss, mse_loss, ...) to fp32;
softmax and layer_norm stay in bf16 (their CPU kernels accumulate in fp32). On CUDA autocast
also puts softmax, log_softmax, layer_norm, group_norm, exp, log, pow, sum, cumsum, ... in fp32.

The model's own ``torch.autocast`` blocks, inlined by capture (``meta.AUTOCAST``), are followed
the same way, with or without ``param_dtype``: an op in a block casts as that block's autocast
does for the module's device type, and not at all in a block that turns autocast off.
"""
from __future__ import annotations

import copy

import torch
from torch import fx, nn
from torch._guards import detect_fake_mode
from torch.utils import _pytree as pytree

from ..context import CompileContext
from ..meta import AUTOCAST, VAL, VAL_LOCK
from ..runtime.module import cast_inputs

__all__ = ["autocast", "AutocastError", "compute_copy", "compute_source"]

_CAST = torch.ops.aten._to_copy.default
_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)   # what autocast casts (never fp64)


class AutocastError(RuntimeError):
    """An op whose dtypes could not be worked out after a cast upstream."""


def compute_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Mixed precision: a copy of ``model`` whose floating parameters are in ``dtype`` (its
    buffers are the model's own, as FSDP's mixed-precision policy leaves buffers): the program
    capture records. A model on the meta device stays there."""
    memo = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(p.detach().to(dtype) if p.is_floating_point() else p.detach(),
                                   requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b
    return copy.deepcopy(model, memo)


def compute_source(model: nn.Module, args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple:
    """(model, args, kwargs) as capture takes them under ``Plan(param_dtype=dtype)``: the
    model's ``compute_copy`` and its example inputs cast as ``DistributedModule.forward``
    casts them (``runtime.module.cast_inputs``); the cost model profiles this program too."""
    args, kwargs = cast_inputs((tuple(args), dict(kwargs)), dtype)
    return compute_copy(model, dtype), args, kwargs


def autocast(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    """Insert the casts ``torch.autocast(ctx.device_type, ctx.plan.param_dtype)`` makes (in the
    model's own autocast blocks, the block's), and bring every node's ``meta["val"]`` up to
    date with them. A no-op without ``param_dtype`` and without blocks."""
    dtype = ctx.plan.param_dtype
    if dtype is None and not any(AUTOCAST in n.meta for n in gm.graph.nodes):
        return gm
    vals = [n.meta.get(VAL) for n in gm.graph.nodes]
    mode = detect_fake_mode([v for v in pytree.tree_leaves(vals) if isinstance(v, torch.Tensor)])
    if mode is None:
        raise AutocastError("the captured graph carries no fake values to work out dtypes from")
    device = torch.device(ctx.device_type)
    casts = 0
    captured = {n: _in_dtypes(n) for n in gm.graph.nodes}   # what each value was computed from
    with VAL_LOCK, mode:
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node not in captured:
                continue
            if _in_dtypes(node) != captured[node]:     # a cast upstream changed an input's dtype
                _refresh(node)
            want = _policy(node, dtype, ctx.device_type)
            if want is not None and isinstance(node.target, torch._ops.OpOverload) and node.target is not _CAST:
                casts += _follow_autocast(gm, node, want, device)
    if dtype is None:
        ctx.notes.append(f"{casts} casts where the model's torch.autocast blocks change an op's dtype")
    else:
        ctx.notes.append(f"mixed precision: compute in {_name(dtype)}, optimizer masters in "
                         f"{_name(ctx.plan.master_dtype)}, gradient sums in {_name(ctx.plan.grad_reduce_dtype)}; "
                         f"{casts} casts where torch.autocast({ctx.device_type}) changes an op's dtype")
    gm.graph.lint()
    return gm


def _policy(node: fx.Node, dtype, device_type: str):
    """The dtype autocast computes ``node`` in on ``device_type``: the plan's ``dtype``, unless
    a block of the model's own for that device type says otherwise (the innermost); None where
    autocast is off."""
    for block in node.meta.get(AUTOCAST, ()):
        if block.device_type == device_type:
            dtype = block.dtype if block.enabled else None
    return dtype


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _val(a):
    return a.meta.get(VAL) if isinstance(a, fx.Node) else a


def _in_dtypes(node: fx.Node) -> tuple:
    return tuple(getattr(_val(a), "dtype", None) for a in pytree.tree_leaves((node.args, node.kwargs)))


def _run(target, args, kwargs, device=None):
    """``target`` on the fake values of its inputs (moved to ``device`` when given)."""
    def fake(a):
        v = _val(a)
        if device is not None and isinstance(v, torch.Tensor):
            return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device)
        return v
    return target(*pytree.tree_map(fake, tuple(args)), **pytree.tree_map(fake, dict(kwargs)))


def _refresh(node: fx.Node) -> None:
    try:
        node.meta[VAL] = _run(node.target, node.args, node.kwargs)
    except Exception as exc:
        raise AutocastError(f"node {node.name} ({node.target}) does not run on its inputs' new dtypes after "
                            f"mixed precision's casts upstream: {type(exc).__name__}: {exc}") from exc


def _first_float(v):
    for t in pytree.tree_leaves(v):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t
    return None


def _follow_autocast(gm: fx.GraphModule, node: fx.Node, dtype: torch.dtype, device: torch.device) -> int:
    """Cast ``node``'s floating inputs as ``torch.autocast`` would; the number of casts."""
    try:
        natural = _first_float(_run(node.target, node.args, node.kwargs, device))
    except Exception:       # mixed input dtypes that only autocast's casts reconcile
        natural = None
    try:
        with torch.autocast(device.type, dtype=dtype):
            under = _first_float(_run(node.target, node.args, node.kwargs, device))
    except Exception:
        return 0
    if under is None or (natural is not None and natural.dtype == under.dtype):
        return 0
    want, count = under.dtype, 0
    cache: dict[fx.Node, fx.Node] = {}

    def cast(a):
        nonlocal count
        v = _val(a)
        if not (isinstance(a, fx.Node) and isinstance(v, torch.Tensor) and v.dtype in _ELIGIBLE and v.dtype != want):
            return a
        if a not in cache:
            with gm.graph.inserting_before(node):
                c = gm.graph.call_function(_CAST, (a,), {"dtype": want})
            c.meta[VAL] = _CAST(v, dtype=want)
            c.meta["stack_trace"] = node.meta.get("stack_trace")
            c.meta["autocast"] = f"{_name(v.dtype)} -> {_name(want)} for {node.target}"
            cache[a] = c
            count += 1
        return cache[a]

    node.args = pytree.tree_map_only(fx.Node, cast, node.args)
    node.kwargs = pytree.tree_map_only(fx.Node, cast, node.kwargs)
    _refresh(node)
    return count
