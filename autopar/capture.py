"""Capture: torch.export the model into its training-IR graph of ATen ops.

The exported program is unlifted to a GraphModule whose parameters and buffers are explicit
``get_attr`` nodes, with a FakeTensor (shape, dtype) in every node's ``meta["val"]``.
export runs the model's Python on fake tensors: control flow on shapes resolves from the
example inputs, and a model built on the meta device captures without allocating memory.
Tied weights (one tensor under two names) become one canonical ``get_attr``.

Mixed precision (``capture(autocast=...)``) exports the model inside ``torch.autocast``, as one
device runs it; a model on the meta device, whose tensors autocast would not cast, is exported
as fake tensors of the device type instead (``_on_device``). The model's own autocast
blocks, which export keeps as ``wrap_with_autocast`` higher-order ops, are inlined, each node
marked with the blocks it ran in (``meta.AUTOCAST``); the autocast pass then inserts the casts.

Exporting is most of a compile's time, and a test suite compiles the same model again and again
in one process (under another plan, or a fresh instance built the same way). With
``AUTOPAR_EXPORT_CACHE=1`` in the environment (the test suite's conftest sets it), ``_exports``
keeps the programs of small models by a digest of what the export reads: the model pickled whole
(every Python attribute, train/eval flags, hooks), the identity of each module's class, each
tensor's type, shape, dtype, device, ``requires_grad``, bytes and which other tensor it is (tied
weights), the example inputs the same way, and the grad mode, the autocast it runs under (the
caller's and mixed precision's, with their dtypes) and the default dtype. A
model that does not pickle, or holds more than ``EXPORT_CACHE_BYTES``, is exported every time. A
program found again is the stored one with the new model's own tensors in its state
(``_rebound``). It is off by default: the digest cannot see a module-level function the forward
calls, which a notebook may redefine between two compiles of identically built models.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import hashlib
import logging
import operator
import os
import pickle
import threading
import traceback
import types
import warnings

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from . import meta
from .context import CompileContext, ParamInfo
from .data_dependent import check_static_sizes
from .functionalize import functionalise, writes, writes_into
from .ops import random_site

log = logging.getLogger("autopar")

__all__ = ["capture", "CaptureError", "ModeCheck", "mode_difference"]


class CaptureError(ValueError):
    """The model could not be captured; the message names the reason and the source line."""


_TORCH_DIR = os.path.dirname(torch.__file__)
EXPORT_LOCK = threading.Lock()
"""torch.export keeps tracing state in globals: two threads exporting (and unlifting) at once
corrupt each other's, as ranks simulated by threads do (autopar.verify), each compiling. A pass
that traces through fx proxies (``fuse_by_partitions``) holds it too: while an export runs, a
proxy's node would take the export's node metadata (``fx.traceback``'s preserved meta)."""
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


def _under(autocast) -> contextlib.AbstractContextManager:
    """``torch.autocast(device_type, dtype)`` for ``autocast`` = (device_type, dtype), else nothing.
    Without its cast cache: an export needs the casts' dtypes, not their reuse."""
    if autocast is None:
        return contextlib.nullcontext()
    device_type, dtype = autocast
    return torch.autocast(device_type, dtype=dtype, cache_enabled=False)


def _export(model: nn.Module, args: tuple, kwargs: dict, autocast=None):
    """The model's functional program (``_functional``), exported under ``autocast``; a model on
    the meta device under ``autocast`` as fake tensors of its device type (``_on_device``)."""
    traced, device = (model, args, kwargs), None
    if autocast is not None and _meta_tensors(model, args, kwargs):
        traced, device = _on_device(autocast[0], model, args, kwargs)
    with _under(autocast):     # functionalisation traces the program again: under the same autocast
        try:
            ep = torch.export.export(*traced, strict=False)
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
        ep = _functional(ep, model)
    return ep if device is None else _bound_on_meta(ep, device, model, args, kwargs)


def _meta_tensors(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether the model or the inputs hold a tensor on the meta device."""
    tensors = [*model.parameters(), *model.buffers(), *torch.utils._pytree.tree_leaves((args, kwargs))]
    return any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in tensors)


def _on_device(device_type: str, model: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """((model, args, kwargs) to export, device) for a model on the meta device (a copy for
    another shape or the other train/eval mode, a model built there) under autocast, which
    casts tensors of its own device type only, and a meta tensor is of none: a copy of the
    model and inputs whose meta tensors are fake tensors of ``device_type`` (no memory either),
    and that device. ``_bound_on_meta`` gives their program back to the model."""
    fakes = FakeTensorMode(allow_non_fake_inputs=True)
    with fakes:
        device = torch.empty(0, device=device_type).device      # with its index, as a tensor's

    def fake(t):
        if not (isinstance(t, torch.Tensor) and t.device.type == "meta"):
            return t
        with fakes:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)

    memo = {id(p): nn.Parameter(fake(p), requires_grad=p.requires_grad) for p in model.parameters()}
    memo.update({id(b): fake(b) for b in model.buffers()})
    args, kwargs = torch.utils._pytree.tree_map(fake, (args, kwargs))
    return (copy.deepcopy(model, memo), args, kwargs), device


def _bound_on_meta(ep, device: torch.device, model: nn.Module, args: tuple, kwargs: dict):
    """The program exported from ``_on_device``'s copy, bound to the model's own tensors and
    inputs, and a device it recorded from them (``arange(.., device=x.device)``) the meta
    device again, as an export of the model itself records it."""
    own = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    ep._state_dict = {k: own[k] for k in ep.state_dict}
    ep._constants = {k: v if (t := _model_tensor(model, k)) is None else t for k, v in ep.constants.items()}
    ep._example_inputs = (args, kwargs)

    def on_meta(a):
        return torch.device("meta") if isinstance(a, torch.device) and a == device else a

    for gm in ep.graph_module.modules():
        if isinstance(gm, fx.GraphModule):      # the program's graph and its blocks' (``_inline_autocast``)
            for node in gm.graph.nodes:
                node.args, node.kwargs = torch.utils._pytree.tree_map(on_meta, (node.args, node.kwargs))
            gm.recompile()
    return ep


def _functional(ep, model: nn.Module):
    """``functionalise(ep)``, its failure an autopar error naming the first write."""
    try:
        with spec_copies_quiet():      # it copies the program, tree specs with it
            return functionalise(ep)
    except Exception as exc:  # torch's functionalisation refused the program: say which write
        first = writes(ep.graph)[0]
        raise CaptureError(
            f"autopar could not make the in-place writes of {type(model).__name__} pure (first: node "
            f"{first.name}, {first.target}).\n"
            f"  reason: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}\n"
            "  fix: write the value out of place (y = x.masked_fill(..), torch.cat / slice_scatter instead of "
            "copy_ into a slice), then compile again") from exc


_QUIET_LOCK = threading.RLock()


@contextlib.contextmanager
def spec_copies_quiet():
    """Copying a captured graph (``copy.deepcopy``) or a context's input/output tree specs
    reconstructs torch's deprecated ``LeafSpec`` class, and torch warns (FutureWarning) about
    its own code: silenced within, nothing else. The warning filters are the process's: threads
    (ranks simulated in one process) take turns here, so that none restores the filters while
    another copies."""
    with _QUIET_LOCK, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*LeafSpec.* is deprecated", category=FutureWarning)
        yield


EXPORT_CACHE_BYTES = 64 << 20
"""models (and example inputs) with more tensor bytes than this are exported on every compile"""
EXPORT_CACHE_ENTRIES = 16
_exports: collections.OrderedDict = collections.OrderedDict()   # digest -> (program, state keys), newest last


class _Digest(pickle.Pickler):
    """Pickles into a running hash; a tensor is its description and a digest of its bytes (a
    tensor met before, by its first ordinal: one tensor under two names is not two equal ones)."""

    class _Sink:
        def __init__(self):
            self.hash = hashlib.blake2b(digest_size=20)
            self.left = EXPORT_CACHE_BYTES

        def write(self, b):
            self.left -= len(b)
            if self.left < 0:      # the model holds a large Python object (a dataset?): not worth a digest
                raise OverflowError("more pickled bytes than EXPORT_CACHE_BYTES")
            self.hash.update(b)

    def __init__(self):
        self.sink = self._Sink()
        super().__init__(self.sink, protocol=pickle.HIGHEST_PROTOCOL)
        self.seen: dict[int, int] = {}
        self.budget = EXPORT_CACHE_BYTES

    def persistent_id(self, obj):
        if not isinstance(obj, torch.Tensor):
            return None
        if id(obj) in self.seen:
            return ("tensor again", self.seen[id(obj)])
        self.seen[id(obj)] = len(self.seen)
        t = obj.detach()
        head = (type(obj).__qualname__, tuple(t.shape), str(t.dtype), t.device.type, bool(obj.requires_grad),
                t.layout is torch.strided)
        if t.device.type == "meta" or t.numel() == 0:
            return head
        self.budget -= t.numel() * t.element_size()
        if self.budget < 0:
            raise OverflowError("more tensor bytes than EXPORT_CACHE_BYTES")
        flat = t.cpu().contiguous().reshape(-1)
        return head + (hashlib.blake2b(flat.view(torch.uint8).numpy().tobytes(), digest_size=20).hexdigest(),)


def _export_key(model: nn.Module, args: tuple, kwargs: dict, autocast=None) -> str | None:
    """The digest ``_exports`` is keyed by (see the module docstring); None when the model or
    inputs do not pickle, or hold more than ``EXPORT_CACHE_BYTES``. A class redefined under the
    same name (a notebook's cell run again) is another class: its identity is in the digest, and
    the stored program holds the class, so that the identity is not reused meanwhile."""
    p = _Digest()
    try:
        p.dump(tuple(id(type(m)) for m in model.modules()))
        p.dump((torch.is_grad_enabled(), str(torch.get_default_dtype()), str(autocast),
                [(d, torch.is_autocast_enabled(d), str(torch.get_autocast_dtype(d))) for d in ("cpu", "cuda")]))
        p.dump((model, args, kwargs))
    except Exception:     # a lambda, a lock, a tensor subclass without bytes, too large: no reuse
        return None
    return p.sink.hash.hexdigest()


def _model_tensor(model: nn.Module, name: str):
    """The tensor the model holds under the qualified ``name``, or None."""
    try:
        t = operator.attrgetter(name)(model)
    except AttributeError:
        return None
    return t if isinstance(t, torch.Tensor) else None


def _stored(ep, model: nn.Module) -> tuple:
    """What ``_exports`` keeps of a program: no tensor of the model (its weights would outlive
    it there, and a census of live tensors would count them), nor the example inputs; the
    module classes whose identities its digest holds."""
    stored = copy.copy(ep)
    stored._graph_module = _own_graph(ep.graph_module)
    stored._state_dict = {}
    stored._constants = {k: None if _model_tensor(model, k) is not None else v for k, v in ep.constants.items()}
    stored._example_inputs = None
    return stored, tuple(ep.state_dict), tuple({type(m) for m in model.modules()})


def _own_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of a program's graph module (its graphs and submodules, the tensors shared): the
    stored program and each compile's get their own, since ``ep.module()`` keeps the
    submodules (a higher-order op's subgraphs) of the program's module, not copies, and the
    passes go on to rewrite what they are given."""
    with spec_copies_quiet():
        return copy.deepcopy(gm, {id(t): t for t in gm.state_dict(keep_vars=True).values()})


def _rebound(stored: tuple, model: nn.Module, args: tuple, kwargs: dict):
    """The stored program with ``model``'s own parameters and buffers (and its non-persistent
    buffers and tensor attributes, which export keeps as constants) in place of the ones it was
    exported with, on these inputs: ``module()`` then registers this model's tensors. A
    constant the forward made itself is the one the same code made before."""
    ep, keys, _ = stored
    own = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    ep = copy.copy(ep)
    ep._graph_module = _own_graph(ep.graph_module)
    ep._state_dict = {k: own[k] for k in keys}
    ep._constants = {k: v if v is not None else _model_tensor(model, k) for k, v in ep.constants.items()}
    ep._example_inputs = (args, kwargs)
    return ep


def _export_once(model: nn.Module, args: tuple, kwargs: dict, autocast=None):
    """``_export``, or, with ``AUTOPAR_EXPORT_CACHE=1``, the program a model with the same
    digest exported before (``_exports``). Not on a thread other than the main one: ranks
    simulated by threads compile one model alike at once, and their programs then run
    backward side by side from one stored program (a crash seen there: an index on the meta
    device in backward); each exports its own, as processes do."""
    if (os.environ.get("AUTOPAR_EXPORT_CACHE", "0") in ("", "0")
            or threading.current_thread() is not threading.main_thread()):
        return _export(model, args, kwargs, autocast)
    key = _export_key(model, args, kwargs, autocast)
    if key is not None and key in _exports:
        _exports.move_to_end(key)
        return _rebound(_exports[key], model, args, kwargs)
    ep = _export(model, args, kwargs, autocast)
    if key is not None:
        _exports[key] = _stored(ep, model)
        while len(_exports) > EXPORT_CACHE_ENTRIES:
            _exports.popitem(last=False)
    return ep


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


_WRAP_WITH_AUTOCAST = torch.ops.higher_order.wrap_with_autocast


def _inline_autocast(gm: fx.GraphModule) -> None:
    """The model's own ``torch.autocast`` blocks, which export keeps as ``wrap_with_autocast``
    higher-order ops calling a submodule, become that submodule's nodes in the graph, each
    marked with the blocks it ran in (``meta.AUTOCAST``, outermost first): every pass sees
    plain ATen ops, and the autocast pass casts them as the block does. A block inside a block
    is inlined in its turn."""
    graph = gm.graph
    while True:
        hop = next((n for n in graph.nodes if n.op == "call_function" and n.target is _WRAP_WITH_AUTOCAST), None)
        if hop is None:
            return
        device_type, dtype, enabled, _cache, body_node, *operands = hop.args
        body = getattr(gm, body_node.target)
        regions = hop.meta.get(meta.AUTOCAST, ()) + (meta.AutocastRegion(str(device_type), dtype, bool(enabled)),)
        env: dict[fx.Node, object] = {}
        given = iter(operands)
        with graph.inserting_before(hop):
            for n in body.graph.nodes:
                if n.op == "placeholder":
                    env[n] = next(given)
                elif n.op == "output":
                    results = torch.utils._pytree.tree_map_only(fx.Node, env.__getitem__, n.args[0])
                elif n.op == "get_attr":      # a block inside this one: its submodule moves up
                    name = _free_attr(gm, n.target.replace(".", "_"))
                    setattr(gm, name, operator.attrgetter(n.target)(body))
                    env[n] = graph.get_attr(name)
                    env[n].meta = dict(n.meta)
                else:
                    env[n] = graph.node_copy(n, env.__getitem__)
                    env[n].meta[meta.AUTOCAST] = regions
        for user in list(hop.users):
            assert user.target is operator.getitem, f"{user.name} reads {hop.name} other than by index"
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(hop)
        if not body_node.users:
            graph.erase_node(body_node)
            if not any(n.op == "get_attr" and n.target == body_node.target for n in graph.nodes):
                delattr(gm, body_node.target)


def _free_attr(gm: fx.GraphModule, name: str) -> str:
    """``name``, or ``name_<i>`` with the first ``i`` that ``gm`` has no attribute of."""
    i, free = 0, name
    while hasattr(gm, free):
        i += 1
        free = f"{name}_{i}"
    return free


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
        written += writes_into(node)
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


def _check_input_writes(gm: fx.GraphModule, model: nn.Module) -> None:
    """Refuse a forward that writes into one of its inputs: each rank runs on its own slice (or
    cast, or padded copy) of the batch, so the write would not reach the tensor the caller
    passed in, as it does on one device. (Writes into the forward's own tensors are made pure
    by ``functionalise``; what is left writes into an input or a buffer.)"""
    for node in gm.graph.nodes:
        for dst in (d for d in writes_into(node) if d.op == "placeholder"):
            raise ValueError(
                f"{type(model).__name__}'s forward writes in place into its input {dst.name!r} (node {node.name}, "
                f"{node.target}). Each rank runs on its own slice or copy of the batch, so the write would not "
                "reach the tensor you passed in as it does on one device. Clone the input before writing "
                f"into it in forward ({dst.name} = {dst.name}.clone()), or return the new value")


_STANDS_FOR_INPUT = (torch.ops.aten.dropout.default, torch.ops.aten.clone.default)
"""ops that ``_signature`` reads as their input: dropout, and the clone that functionalisation
(``autopar.functionalize``) makes of dropout in eval mode"""


def _signature(gm: fx.GraphModule) -> list:
    """The graph's ops with their constant arguments, dropout removed (a dropout node stands
    for its input, as does a clone) and attention's dropout probability left out: what must agree between the
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
        if node.op == "call_function" and node.target in _STANDS_FOR_INPUT:
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
    meanwhile). Every rank computes it alike. ``autocast``: as ``capture``'s."""

    def __init__(self, model: nn.Module, args: tuple, kwargs: dict, gm: fx.GraphModule, autocast=None):
        memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                for p in model.parameters()}
        memo.update({id(b): torch.empty_like(b, device="meta") for b in model.buffers()})
        try:
            self._model = copy.deepcopy(model, memo)
        except Exception as exc:      # a model that does not copy: compared now instead
            self._model = None
            self._answer = mode_difference(model, args, kwargs, gm, autocast=autocast)
            log.debug("autopar: mode check at compile (%s: %s)", type(exc).__name__, exc)
            return
        self._args, self._kwargs = _on_meta(args), _on_meta(kwargs)
        self._signature = _signature(gm)
        self._autocast = autocast
        self._answer: str | None = None

    def __call__(self) -> str:
        if self._answer is None:
            self._answer = mode_difference(self._model, self._args, self._kwargs, signature=self._signature,
                                           autocast=self._autocast)
            self._model = self._args = self._kwargs = None
        return self._answer


def mode_difference(model: nn.Module, args: tuple, kwargs: dict, gm: fx.GraphModule | None = None,
                    signature: list | None = None, autocast=None) -> str:
    """How the model's graph in the other train/eval mode differs from ``gm`` (or its
    ``_signature``), captured in ``model.training``'s mode, beyond dropout; "" when dropout is
    the only difference. Costs one more export (under ``autocast``, as ``capture``'s)."""
    modes = {m: m.training for m in model.modules()}
    try:
        model.train(not model.training)
        with EXPORT_LOCK:
            other = _export(model, tuple(args), dict(kwargs), autocast).module()
    except CaptureError as exc:
        return f"it does not capture ({str(exc).splitlines()[1].strip()})"
    finally:
        for m, t in modes.items():
            m.training = t
    _drop_guards(other)
    _inline_autocast(other)
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
            check_modes: bool = False, exported=None, autocast=None) -> fx.GraphModule:
    """Export ``model`` on ``(args, kwargs)`` (this rank's local batch) into a GraphModule.
    ``check_modes``: give the context a ``ModeCheck`` (``ctx.mode_difference``) that compares
    the other train/eval mode's graph when a compiled module first runs in it. ``exported``:
    the model's own ExportedProgram on these inputs, used instead of exporting again.

    ``autocast``: (device_type, dtype) of mixed precision: the model runs as on one device
    under ``torch.autocast(device_type, dtype)``, so that a forward that needs autocast's casts
    to run at all (an op given an fp32 and a bf16 tensor) captures, and every node's
    ``meta["val"]`` has autocast's dtype. The graph holds the model's ops as written:
    torch.export records them above autocast, which casts below; the autocast pass
    (``passes/autocast.py``) then inserts the casts as graph nodes."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"autopar.compile expects an nn.Module, got {type(model).__name__}")
    with EXPORT_LOCK:
        if exported is None:
            ep = _export_once(model, tuple(args), dict(kwargs), autocast)
        else:
            ep = _functional(_check_exported(exported, model, tuple(args), dict(kwargs)), model)
        with spec_copies_quiet():     # it copies the program's graph, tree specs with it
            gm = ep.module()
    _drop_cycles(gm)
    _drop_guards(gm)
    _inline_autocast(gm)
    _check_buffer_updates(gm, model)
    _check_input_writes(gm, model)
    check_static_sizes(gm, model)
    ctx.captured_training = model.training
    if check_modes:
        ctx.mode_difference = ModeCheck(model, tuple(args), dict(kwargs), gm, autocast)
    _canonicalise_params(gm, model, ctx)
    ctx.in_spec = gm._in_spec
    ctx.out_spec = gm._out_spec
    out_vals = [getattr(a, "meta", {}).get("val") for a in gm.graph.output_node().args[0]]
    ctx.output_dims = tuple(v.dim() if isinstance(v, torch.Tensor) else None for v in out_vals)
    flat, _ = torch.utils._pytree.tree_flatten((tuple(args), dict(kwargs)))
    ctx.input_shapes = tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in flat)
    ctx.constant_inputs = {i: x for i, x in enumerate(flat) if not isinstance(x, torch.Tensor)}
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm
