"""Functionalisation: a captured program's in-place writes become pure ops.

export's training IR keeps the model's in-place ops as they were written: ``k = x.new_empty(..);
k[..., :d].copy_(a)``, ``y[:, -1:].masked_fill_(..)``, ``flat = k.view(..); flat.mul_(..)``. A
write into a view changes every tensor that shares its storage, which the graph does not show:
a layout pass that gives the view a layout of its own (a slice of a tensor split by tp is a new
local tensor) would send the write into a copy, and the readers of the base would read memory
nobody wrote. So a program with any such write is functionalised by torch's own functionalisation
(``ExportedProgram.run_decompositions({})``, which keeps every op it may keep): each write becomes
its out-of-place op, each write into a view a scatter of the new values into the base (``copy_``
into a slice becomes ``slice_scatter``, ``index_put_`` becomes ``index_put``), and every later
reader reads the new value. What is left are the writes into the program's own inputs and
buffers, which unlifting puts back as ``copy_`` at the end (``autopar.capture`` refuses buffer
writes; ``check_no_writes`` in ``passes`` refuses any other write left after the passes).

Functionalisation also rewrites two kinds of op that carry no write: dropout becomes
``native_dropout`` (it is not among the ops torch keeps), restored here to ``aten.dropout`` so
that the random sites (``autopar.ops.random_site``) and the train/eval switch read the same graph
as an unwritten model's; and ``reshape`` becomes ``view`` where the traced strides allow, put
back as ``reshape`` here (see ``_views_as_reshapes``). A program without writes is left as
export made it.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from . import meta

__all__ = ["writes", "writes_into", "functionalise"]

aten = torch.ops.aten


def writes_into(node: fx.Node) -> list:
    """The arguments ``node`` writes into (an in-place op's ``self``, an ``out=`` tensor), by the
    op's schema: [] for a pure op and for anything that is not an ATen-style operator."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if isinstance(value, fx.Node):
            out.append(value)
    return out


def writes(graph: fx.Graph) -> list:
    """The nodes of ``graph`` that write into one of their arguments, in graph order."""
    return [n for n in graph.nodes if writes_into(n)]


def _restore_dropout(graph: fx.Graph) -> None:
    """``native_dropout(x, p, train)[0]`` whose mask nobody reads becomes ``dropout(x, p, train)``."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.native_dropout.default:
            continue
        items = list(node.users)
        if not all(u.op == "call_function" and u.target is operator.getitem for u in items):
            continue
        if any(u.args[1] != 0 for u in items if u.users):
            continue                       # the mask itself is read: leave the op as it is
        x, p = node.args[0], node.args[1]
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        with graph.inserting_before(node):
            new = graph.call_function(aten.dropout.default, (x, p, bool(train)))
        new.meta = dict(node.meta)
        value = node.meta.get(meta.VAL)
        if isinstance(value, (tuple, list)):
            new.meta[meta.VAL] = value[0]
        for u in items:
            if u.args[1] == 0:
                u.replace_all_uses_with(new)
            graph.erase_node(u)
        graph.erase_node(node)
    graph.lint()


def _copies_as_values(graph: fx.Graph) -> None:
    """``copy(dst, src)`` (functionalisation's form of ``dst.copy_(src)``) is ``src`` cast to
    ``dst``'s dtype and broadcast to its shape: written so, since eager autograd has no
    derivative for ``aten.copy``. ``dst`` then only gave the shape, and its producer (an
    ``empty`` or ``new_empty`` buffer) drops out of the graph when nothing else reads it."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.copy.default:
            continue
        dst, src = node.args[0], node.args[1]
        want, have = dst.meta.get(meta.VAL), src.meta.get(meta.VAL) if isinstance(src, fx.Node) else None
        if not isinstance(want, torch.Tensor) or not isinstance(have, torch.Tensor):
            continue
        value = src
        with graph.inserting_before(node):
            if have.dtype != want.dtype:
                value = graph.call_function(aten._to_copy.default, (value,), {"dtype": want.dtype})
                value.meta[meta.VAL] = have.to(want.dtype)
            if tuple(have.shape) != tuple(want.shape):
                value = graph.call_function(aten.expand.default, (value, list(want.shape)))
                value.meta[meta.VAL] = want
        for k in meta.ORIGIN:
            if k in node.meta and isinstance(value, fx.Node) and value is not src:
                value.meta.setdefault(k, node.meta[k])
        node.replace_all_uses_with(value)
        graph.erase_node(node)
    graph.eliminate_dead_code()
    graph.lint()


def _views_as_reshapes(graph: fx.Graph) -> None:
    """Every ``view`` becomes ``reshape``. Functionalisation writes a ``reshape`` as ``view``
    where the traced strides allowed it, and regenerates views of a written base as ``view``;
    the distributed program's tensors need not have those strides (a local shard, a gathered
    or scattered value is laid out afresh), and ``view`` fails on strides it cannot split. In a
    program without writes nothing can tell a view from a copy, so ``reshape`` (a view where
    the strides allow, a copy where not) means the same everywhere."""
    for node in graph.nodes:
        if node.op == "call_function" and node.target is aten.view.default:
            node.target = aten.reshape.default


_ZEROED = {aten.new_empty.default: aten.new_zeros.default, aten.empty.memory_format: aten.zeros.default,
           aten.empty_like.default: aten.zeros_like.default}


def _empties_as_zeros(graph: fx.Graph) -> None:
    """An ``empty`` buffer that the writes fill (``k = x.new_empty(..)``, then slices of it
    written) becomes a pure op's input once functionalised: the scatters read it, and where
    they leave part of it unwritten, the program's values there would be whatever the memory
    held. Its values are unspecified, so zeros are one right choice, and they make every
    value of the program a function of its inputs, which ``autopar.verify`` compares."""
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _ZEROED:
            node.target = _ZEROED[node.target]
            if node.target is aten.zeros.default and "memory_format" in node.kwargs:
                node.kwargs = {k: v for k, v in node.kwargs.items() if k != "memory_format"}


def functionalise(ep):
    """``ep`` (an ExportedProgram) with its in-place writes made pure (see the module
    docstring); ``ep`` itself when it writes nothing."""
    if not writes(ep.graph):
        return ep
    ep = ep.run_decompositions({})
    _restore_dropout(ep.graph)
    _copies_as_values(ep.graph)
    _views_as_reshapes(ep.graph)
    _empties_as_zeros(ep.graph)
    ep.graph_module.recompile()
    return ep
