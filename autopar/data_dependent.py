"""Data-dependent sizes: tensors whose sizes the captured graph can only name by a symbol.

``torch.nonzero``, a boolean-mask index (``x[mask]``), ``masked_select``, ``unique`` and sizes
read out of a tensor (``.tolist()`` or ``.item()`` fed to ``split``, ``view`` or a factory: a
mixture-of-experts layer's tokens per expert) give tensors whose sizes depend on the values.
torch.export accepts them, naming each such size by an *unbacked* symbol (``u0``).

autopar refuses them when it captures the model (``check_static_sizes``), with the node whose
size depends on the data, where the symbol comes from (its op and the model's line) and how to
write the step with fixed sizes. Everything after capture works on sizes: a sharding rule keeps
a shard only where the ranks' chunks line up, a collective moves a known number of bytes, the
pipeline cuts where the micro-batch's rows cross, the cost model prices FLOPs and memory.

Why not carry the symbols through: along tp or pp every rank would compute the same sizes, but
the rules and the cost model would still have none to read. Under data parallelism it is
worse: each rank's ``nonzero`` sees only its own rows, so its sizes differ between ranks and
its positions are positions within the rank's rows. The program is then right only where those
positions index tensors of the same rows and no count mixes ranks, and an auxiliary
load-balancing loss that divides by the tokens routed to each expert would read this rank's
count, not the batch's. Rules written per op cannot show that, so autopar does not guess.

A value read out of a tensor that never becomes a size (``x * mask.sum().item()``) is not a
data-dependent size: it stays, and the sharding rules judge the op that reads it.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from . import meta

__all__ = ["DataDependentShapeError", "check_static_sizes", "data_dependent_size"]

aten = torch.ops.aten
_TORCH_DIR = os.path.dirname(torch.__file__)

_WHAT = {   # op -> what its output is, for the message
    aten.nonzero.default: "the positions of the true elements of a tensor (torch.nonzero / torch.where(mask))",
    aten.index.Tensor: "the elements a boolean mask selects (x[mask])",
    aten.masked_select.default: "the elements a boolean mask selects (torch.masked_select)",
    aten.item.default: "a tensor's value read as a Python number (.item() / .tolist())",
    aten._local_scalar_dense.default: "a tensor's value read as a Python number (.item() / .tolist())",
    aten._unique2.default: "the distinct values of a tensor (torch.unique)",
    aten.unique_dim.default: "the distinct values of a tensor (torch.unique)",
    aten.unique_consecutive.default: "the distinct values of a tensor (torch.unique_consecutive)",
    aten.repeat_interleave.Tensor: "copies counted by a tensor (torch.repeat_interleave with tensor repeats)",
}
FIX = ("write the step with sizes fixed by the inputs' shapes: run every expert on every token and "
       "weigh its output by the routing mask (torch.where(mask, out, 0) or a one-hot weight), or give "
       "each expert a fixed capacity of tokens (torch.topk over the routing scores); a transformers "
       "mixture-of-experts model does either with experts_implementation='batched_mm' (each token "
       "gathers its experts' weights) or 'grouped_mm'")


class DataDependentShapeError(NotImplementedError):
    """The model computes a tensor whose size depends on tensor values; the message names the
    node, where its size comes from, and how to write the step with fixed sizes."""


def _symbols(val) -> set:
    """Unbacked symbols in the sizes of the tensors of a node's value (not in scalars)."""
    if isinstance(val, torch.Tensor):
        return set(free_unbacked_symbols(list(val.shape)))
    if isinstance(val, (list, tuple)):
        return set().union(*(_symbols(v) for v in val)) if val else set()
    return set()


def _defines(val) -> set:
    """Unbacked symbols anywhere in a node's value: a tensor's sizes, or a scalar it is."""
    if isinstance(val, (list, tuple)):
        return set().union(*(_defines(v) for v in val)) if val else set()
    if isinstance(val, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
        return set(free_unbacked_symbols(val))
    return set()


def _line(node: fx.Node) -> str:
    """The model's source line that made ``node`` (its stack trace's last frame outside torch)."""
    lines = str(node.meta.get(meta.SOURCE) or "").strip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        text = lines[i].strip()
        if text.startswith('File "') and not text[6:].startswith(_TORCH_DIR):
            path, _, rest = text[6:].partition('", line ')
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f" at {path}:{rest.split(',')[0]}" + (f": {code}" if code else "")
    return ""


def data_dependent_size(gm: fx.GraphModule) -> Optional[tuple]:
    """``(node, symbol, origin)``: the first node whose tensor sizes hold an unbacked symbol, one
    such symbol, and the first node whose value holds it (where it comes from); None when every
    size is known."""
    defined: dict = {}
    for node in gm.graph.nodes:
        val = node.meta.get(meta.VAL)
        for s in _defines(val):
            defined.setdefault(s, node)
        found = sorted(_symbols(val), key=str)
        if found:
            return node, found[0], defined.get(found[0], node)
    return None


def check_static_sizes(gm: fx.GraphModule, model) -> None:
    """Refuse a graph with a data-dependent size (the module docstring says why)."""
    found = data_dependent_size(gm)
    if found is None:
        return
    node, sym, origin = found
    val = node.meta[meta.VAL]
    shapes = ", ".join(str(tuple(v.shape)) for v in (val if isinstance(val, (list, tuple)) else [val])
                       if isinstance(v, torch.Tensor))
    what = _WHAT.get(origin.target, "a value whose size depends on its inputs' values")
    source = (f"{sym} is the output of node {origin.name} ({origin.target}): {what}{_line(origin)}"
              if origin is not node else f"{what}{_line(origin)}")
    raise DataDependentShapeError(
        f"autopar cannot compile {type(model).__name__}: node {node.name} ({node.target}) has "
        f"{'shape' if isinstance(val, torch.Tensor) else 'outputs of shapes'} {shapes}, a size that depends on "
        f"tensor values, not on the inputs' shapes: {source}. autopar needs every size when it compiles (to lay "
        "tensors out across the mesh, move them, cut pipeline stages and price the plan), and this one "
        "is known only at run time (under data parallelism it differs between ranks, each routing its "
        f"own rows). Fix: {FIX}.")
