"""Capture: torch.export the model into its training-IR graph of ATen ops.

The exported program is unlifted to a GraphModule whose parameters and buffers are explicit
``get_attr`` nodes, with a FakeTensor (shape, dtype) in every node's ``meta["val"]``.
export runs the model's Python on fake tensors: control flow on shapes resolves from the
example inputs, and a model built on the meta device captures without allocating memory.
Tied weights (one tensor under two names) become one canonical ``get_attr``.
"""
from __future__ import annotations

import types

import operator
import os
import threading
import copy
import logging
import traceback
import warnings
import contextlib

import torch
from torch import fx, nn

from . import meta
from .context import CompileContext, ParamInfo
from .ops import random_site

log = logging.getLogger("autopar")

__all__ = ["capture", "CaptureError", "ModeCheck", "mode_difference"]


class CaptureError(ValueError):
    """The model could not be captured; the message names the reason and the source line."""


_TORCH_DIR = os.path.dirname(torch.__file__)
# torch.export keeps tracing state in globals: two threads exporting (and unlifting) at once
# corrupt each other's, as ranks simulated by threads do (autopar.verify), each compiling
_EXPORT_LOCK = threading.Lock()
_OWN_FILES = {os.path.abspath(__file__), os.path.join(os.path.dirname(os.path.abspath(__file__)), "api.py")}


def _user_frame(exc: BaseException):
    """Innermost traceback frame in the model's code (not torch's, not autopar's capture)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(_TORCH_DIR) and not f.filename.startswith("<")
              and os.path.abspath(f.filename) not in _OWN_FILES]
    return frames[-1] if frames else None


def _fix_for(exc: BaseException) -> str:
    text = f"{type(exc).__name__} {exc}"
    if "data-dependent" in text or "GuardOnDataDependent" in text:
        return ("the line branches on a tensor's values, which a traced graph cannot do; branch on "
                "shapes or Python constants instead, or express it with torch.where / torch.cond")
    if "Unsupported" in text or "not supported" in text:
        return "rewrite the construct at that line with plain tensor operations"
    return "make the model's forward runnable on the example inputs, then compile again"


def _export(model: nn.Module, args: tuple, kwargs: dict):
    try:
        return torch.export.export(model, args, kwargs, strict=False)
    except Exception as exc:  # re-raised with the user's line and a fix
        frame = _user_frame(exc)
        where = (f"{frame.filename}:{frame.lineno}: {frame.line}" if frame
                 else "(no line of the model's own code in the traceback)")
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CaptureError(
            f"autopar could not capture {type(model).__name__} with torch.export.\n"
            f"  reason: {type(exc).__name__}: {reason}\n"
            f"  at {where}\n"
            f"  fix: {_fix_for(exc)}") from exc


@contextlib.contextmanager
def spec_copies_quiet():
    """Copying a captured graph (``copy.deepcopy``) or a context's input/output tree specs
    reconstructs torch's deprecated ``LeafSpec`` class, and torch warns (FutureWarning) about
    its own code: silenced within, nothing else."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*LeafSpec.* is deprecated", category=FutureWarning)
        yield


def _check_exported(ep, model: nn.Module, args: tuple, kwargs: dict):
    """``ep`` if it is an export of ``model`` itself on inputs of these shapes; else an error."""
    if not isinstance(ep, torch.export.ExportedProgram):
        raise TypeError(f"exported must be a torch.export.ExportedProgram, got {type(ep).__name__}")
    own = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    foreign = [k for k, t in ep.state_dict.items() if own.get(k) is not t]
    if foreign:
        raise ValueError(f"exported holds {foreign[0]!r}, which is not the model's own tensor: export the model "
                         "you compile (torch.export.export(model, ...)), or copy the two together, "
                         "copy.deepcopy((model, exported))")
    flat, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    users = set(ep.graph_signature.user_inputs)
    got = [tuple(n.meta[meta.VAL].shape) for n in ep.graph.nodes
           if n.op == "placeholder" and n.name in users and isinstance(n.meta.get(meta.VAL), torch.Tensor)]
    shapes = [tuple(x.shape) for x in flat if isinstance(x, torch.Tensor)]
    if spec != ep.call_spec.in_spec or shapes != got:
        raise ValueError(f"exported was made on inputs of shapes {got}, the example inputs have {shapes}: export "
                         "on the example inputs (the global batch), or leave exported out")
    return ep


def _drop_cycles(gm: fx.GraphModule) -> None:
    """``ExportedProgram.module()`` binds train/eval methods to the module it returns, a
    reference cycle that holds the module (and the weights it shares with the model) until a
    garbage collection: they go, so the graph and the weights are freed as soon as they are
    dropped. autopar never switches the captured graph's mode (the compiled module has its own)."""
    for name in ("train", "eval"):
        if isinstance(gm.__dict__.get(name), types.MethodType):
            del gm.__dict__[name]


def _drop_guards(gm: fx.GraphModule) -> None:
    """export's input guard module is replaced by autopar's own input check (clearer errors)."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")


def _canonicalise_params(gm: fx.GraphModule, model: nn.Module, ctx: CompileContext) -> None:
    """One get_attr per distinct tensor, named by its first qualified name in ``model``."""
    first_name: dict[int, str] = {}
    aliases: dict[int, list[str]] = {}
    tensors = list(model.named_parameters(remove_duplicate=False)) + \
        list(model.named_buffers(remove_duplicate=False))
    for name, t in tensors:
        first_name.setdefault(id(t), name)
        aliases.setdefault(id(t), []).append(name)
    param_ids = {id(p) for p in model.parameters()}
    state_keys = set(model.state_dict(keep_vars=True))
    canonical_node: dict[str, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.op != "get_attr":
            continue
        t = operator.attrgetter(node.target)(gm)
        if not isinstance(t, torch.Tensor) or id(t) not in first_name:
            continue  # a lifted constant: stays as it is
        name = first_name[id(t)]
        if name not in ctx.params:
            ctx.params[name] = ParamInfo(
                name=name, shape=tuple(t.shape), dtype=t.dtype,
                requires_grad=bool(t.requires_grad) and id(t) in param_ids,
                is_buffer=id(t) not in param_ids,
                aliases=tuple(a for a in aliases[id(t)] if a != name),
                persistent=any(a in state_keys for a in aliases[id(t)]))
        keep = canonical_node.get(name)
        if keep is None:
            node.target = name
            node.meta[meta.PARAM] = name
            canonical_node[name] = node
        else:
            node.replace_all_uses_with(keep)
            gm.graph.erase_node(node)
    for name, node in canonical_node.items():
        if not node.users:
            gm.graph.erase_node(node)
            ctx.notes.append(f"parameter {name} is not used by forward")


_MUTATES_STATS = {torch.ops.aten.batch_norm.default: (5, (3, 4)),      # training flag, running stats
                  torch.ops.aten.instance_norm.default: (5, (3, 4))}


def _check_buffer_updates(gm: fx.GraphModule, model: nn.Module) -> None:
    """Refuse a forward that writes buffers (BatchNorm's running statistics in training mode):
    each rank would update them from its own slice of the batch."""
    found: dict[str, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        written = []
        if node.target in _MUTATES_STATS:
            flag, stats = _MUTATES_STATS[node.target]
            if len(node.args) > flag and node.args[flag]:
                written = [node.args[i] for i in stats if len(node.args) > i and node.args[i] is not None]
        schema = getattr(node.target, "_schema", None)
        if schema is not None:
            written += [a for a, s in zip(node.args, schema.arguments)
                        if s.alias_info is not None and s.alias_info.is_write]
        for a in written:
            if isinstance(a, fx.Node) and a.op == "get_attr":
                found.setdefault(a.target, node)
    if found:
        node = next(iter(found.values()))
        raise ValueError(
                f"{type(model).__name__}'s forward updates the buffers {', '.join(sorted(found))} (first: node "
                f"{node.name}, {node.target}): running statistics, as BatchNorm keeps in training mode. Under "
                "data parallelism or micro-batches each rank would update them from its own slice of the batch, "
                "so they would drift from the single-device model's. Put those layers in eval mode before "
                "compiling (bn.eval() freezes their statistics), or use LayerNorm / GroupNorm instead")


def _signature(gm: fx.GraphModule) -> list:
    """The graph's ops with their constant arguments, dropout removed (a dropout node stands
    for its input) and attention's dropout probability left out: what must agree between the
    train and eval graphs for autopar to switch modes at run time."""
    index: dict = {}
    out = []

    def norm(a):
        if isinstance(a, fx.Node):
            return ("%", index.get(a, a.name))
        if isinstance(a, torch.device):
            return "device"
        if isinstance(a, (list, tuple)):
            return tuple(norm(x) for x in a)
        return repr(a)

    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.dropout.default:
            index[node] = index.get(node.args[0], node.args[0].name)
            continue
        args = list(node.args)
        if node.op == "call_function" and node.target is torch.ops.aten.scaled_dot_product_attention.default:
            args = args[:4] + ["p"] + args[5:]
        index[node] = len(out)
        out.append((node.op, str(node.target), norm(tuple(args)),
                    norm(tuple((k, v) for k, v in node.kwargs.items() if k != "dropout_p"))))
    return out


def _on_meta(tree):
    return torch.utils._pytree.tree_map(
        lambda x: torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x, tree)


class ModeCheck:
    """How the model's graph in the other train/eval mode differs from the captured one beyond
    dropout ("" when dropout is the only difference, which the runtime switches: see
    ``autopar.runtime.rng``). Worked out on first call, the first time a compiled module runs
    in the other mode, by one more export of a copy of the model whose parameters, buffers and
    example inputs are on the meta device (no memory, and the user's model may be freed
    meanwhile). Every rank computes it alike."""

    def __init__(self, model: nn.Module, args: tuple, kwargs: dict, gm: fx.GraphModule):
        memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                for p in model.parameters()}
        memo.update({id(b): torch.empty_like(b, device="meta") for b in model.buffers()})
        try:
            self._model = copy.deepcopy(model, memo)
        except Exception as exc:      # a model that does not copy: compared now instead
            self._model = None
            self._answer = mode_difference(model, args, kwargs, gm)
            log.debug("autopar: mode check at compile (%s: %s)", type(exc).__name__, exc)
            return
        self._args, self._kwargs = _on_meta(args), _on_meta(kwargs)
        self._signature = _signature(gm)
        self._answer: str | None = None

    def __call__(self) -> str:
        if self._answer is None:
            self._answer = mode_difference(self._model, self._args, self._kwargs, signature=self._signature)
            self._model = self._args = self._kwargs = None
        return self._answer


def mode_difference(model: nn.Module, args: tuple, kwargs: dict, gm: fx.GraphModule | None = None,
                    signature: list | None = None) -> str:
    """How the model's graph in the other train/eval mode differs from ``gm`` (or its
    ``_signature``), captured in ``model.training``'s mode, beyond dropout; "" when dropout is
    the only difference. Costs one more export."""
    modes = {m: m.training for m in model.modules()}
    try:
        model.train(not model.training)
        with _EXPORT_LOCK:
            other = _export(model, tuple(args), dict(kwargs)).module()
    except CaptureError as exc:
        return f"it does not capture ({str(exc).splitlines()[1].strip()})"
    finally:
        for m, t in modes.items():
            m.training = t
    _drop_guards(other)
    if not model.training and any(random_site(n) for n in other.graph.nodes):
        return "its training graph draws dropout masks that the eval-mode capture has no sites for"
    a, b = (signature if signature is not None else _signature(gm)), _signature(other)
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"op {i} of the graph is {x[1]}{x[2]} in one mode and {y[1]}{y[2]} in the other"
    if len(a) != len(b):
        return f"the graphs have {len(a)} and {len(b)} ops"
    return ""


def capture(model: nn.Module, args: tuple, kwargs: dict, ctx: CompileContext,
            check_modes: bool = False, exported=None) -> fx.GraphModule:
    """Export ``model`` on ``(args, kwargs)`` (this rank's local batch) into a GraphModule.
    ``check_modes``: give the context a ``ModeCheck`` (``ctx.mode_difference``) that compares
    the other train/eval mode's graph when a compiled module first runs in it. ``exported``:
    the model's own ExportedProgram on these inputs, used instead of exporting again."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"autopar.compile expects an nn.Module, got {type(model).__name__}")
    with _EXPORT_LOCK:
        if exported is None:
            ep = _export(model, tuple(args), dict(kwargs))
        else:
            ep = _check_exported(exported, model, tuple(args), dict(kwargs))
        gm = ep.module()
    _drop_cycles(gm)
    _drop_guards(gm)
    _check_buffer_updates(gm, model)
    ctx.captured_training = model.training
    if check_modes:
        ctx.mode_difference = ModeCheck(model, tuple(args), dict(kwargs), gm)
    _canonicalise_params(gm, model, ctx)
    ctx.in_spec = gm._in_spec
    ctx.out_spec = gm._out_spec
    flat, _ = torch.utils._pytree.tree_flatten((tuple(args), dict(kwargs)))
    ctx.input_shapes = tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in flat)
    ctx.constant_inputs = {i: x for i, x in enumerate(flat) if not isinstance(x, torch.Tensor)}
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm
