"""Sharding rules of ops that read or write at computed positions: gather/scatter, advanced
indexing, index_select/index_add, sort/topk, histc.

The positions are data, so a dim along which they point shards only where each rank's
positions stay inside its own piece: any dim other than the indexed one, sharded alike on
the tensor and its index (and ``src``). The other way round, a replicated tensor read at
sharded positions (``gather``, ``index_select``, ``x[idx]``) gives the output sharded like
the positions; rows added at sharded positions (``index_add`` of a source split along
``dim``) give each rank an addend of the result, right when ``self`` is an addend too.
Selecting and copying commute with every reduction across ranks (a Partial passes); adding
commutes with sums and averages; ``amax``/``amin`` scatters with max/min.

``sort``/``argsort``/``topk`` need the whole sorted dim; ``histc`` over a fixed range counts each
rank's elements, so its counts add (``P(sum)``). ``nonzero`` and ``masked_scatter`` depend on
the positions of every true element of the whole mask: replicated only.
"""
from __future__ import annotations

import torch

from .registry import (PARTIALS, R, OpInfo, Strategy, TensorMeta, arg, inplace, like_out,
                       norm_dim, register, replicated, shardable_dims)
from autopar.placement import Partial, Shard

aten = torch.ops.aten
_SCATTER_PARTIALS = {"sum": ("sum", "avg"), "amax": ("max",), "amin": ("min",)}


def _aligned(m: TensorMeta, dim: int, ndim: int, size: int):
    """``Shard`` of ``m``'s dim aligned (from the right) with dim ``dim`` of an ``ndim``-dim
    shape when ``m`` has it at full ``size``, else R (``m`` broadcasts along it)."""
    d = dim - (ndim - m.ndim)
    return Shard(d) if d >= 0 and m.shape[d] == size else R


@register(aten.gather.default)
def gather(info: OpInfo) -> list:
    x, dim, index = info.args[0], norm_dim(info.args[1], info.args[0].ndim), info.args[2]
    found = [replicated(info)] + [Strategy((p, R), p) for p in PARTIALS]
    if index.shape[dim] > 1:
        found.append(Strategy((R, Shard(dim)), Shard(dim)))
    found += [Strategy((Shard(d), Shard(d)), Shard(d)) for d in shardable_dims(index.shape)
              if d != dim and x.shape[d] == index.shape[d]]
    return found


@register(aten.scatter.src, aten.scatter.value, aten.scatter_add.default,
          aten.scatter_reduce.two)
def scatter(info: OpInfo) -> list:
    """(self, dim, index[, src]): another dim shards alike on all; Partials where the
    reduction of the scatter commutes with the one across ranks."""
    x, dim, index = info.args[0], norm_dim(info.args[1], info.args[0].ndim), info.args[2]
    src = info.args[3] if isinstance(arg(info, 3, "src"), TensorMeta) else None
    k = 3 if src is not None else 2
    found = [replicated(info)]
    for d in shardable_dims(x.shape):
        if d != dim and index.shape[d] == x.shape[d] and (src is None or src.shape[d] == x.shape[d]):
            found.append(Strategy((Shard(d),) * k, Shard(d)))
    if info.target == aten.scatter.value:      # the value is written alike on every rank
        return found + [Strategy((Partial(p), R), Partial(p)) for p in ("avg", "max", "min")]
    kinds = {aten.scatter.src: ("sum", "avg", "max", "min"), aten.scatter_add.default: ("sum", "avg"),
             aten.scatter_reduce.two: _SCATTER_PARTIALS.get(arg(info, 4, "reduce"), ())}[info.target]
    return found + [Strategy((Partial(p), R, Partial(p)), Partial(p)) for p in kinds]


@register(aten.index_select.default, aten.index_add.default)
def index_select_add(info: OpInfo) -> list:
    """index_select(self, dim, index) / index_add(self, dim, index, source): other dims shard
    alike; index_select reads a replicated self at sharded positions, index_add adds sharded
    source rows into an addend of self."""
    x, dim, index = info.args[0], norm_dim(info.args[1], info.args[0].ndim), info.args[2]
    add = info.target == aten.index_add.default
    found = [replicated(info)]
    for d in shardable_dims(x.shape):
        if d != dim and (not add or info.args[3].shape[d] == x.shape[d]):
            found.append(Strategy((Shard(d), R) + (Shard(d),) * add, Shard(d)))
    rows = index.ndim == 1 and index.shape[0] > 1
    if not add:
        found += [Strategy((p, R), p) for p in PARTIALS]
        if rows:
            found.append(Strategy((R, Shard(0)), Shard(dim)))
        return found
    found += [Strategy((Partial(p), R, Partial(p)), Partial(p)) for p in ("sum", "avg")]
    if rows:
        found.append(Strategy((Partial(), Shard(0), Shard(dim)), Partial()))
    return found


def _index_dims(x: TensorMeta, indices: list):
    """How ``x[indices]`` lays out its output: ``(map, first, shape)`` with ``map`` taking each
    dim of ``x`` not indexed to its output dim, and the indices' broadcast ``shape`` placed
    from output dim ``first`` (where the indexed dims were when adjacent, else in front)."""
    pos = [i for i, t in enumerate(indices) if t is not None]
    shape = tuple(torch.broadcast_shapes(*(indices[i].shape for i in pos)))
    rest = [d for d in range(x.ndim) if d not in pos]
    if pos == list(range(pos[0], pos[-1] + 1)):
        first = pos[0]
        return {d: d if d < first else d - len(pos) + len(shape) for d in rest}, first, shape
    return {d: len(shape) + i for i, d in enumerate(rest)}, 0, shape


def _plain(indices) -> bool:
    """Integer index tensors only (a bool mask's output size depends on its values)."""
    return isinstance(indices, list) and any(t is not None for t in indices) and all(
        t is None or (isinstance(t, TensorMeta) and not t.dtype.is_floating_point
                      and t.dtype != torch.bool) for t in indices)


@register(aten.index.Tensor)
def index(info: OpInfo) -> list:
    """``x[indices]``: a dim not indexed keeps its shard; the indices sharded alike (those
    that broadcast along the dim replicated) with ``x`` replicated shard the output there."""
    x, indices = info.args[0], info.args[1]
    ts = [t for t in indices if t is not None]
    found = [replicated(info)] + [Strategy((p,) + (R,) * len(ts), p) for p in PARTIALS]
    if not _plain(indices):
        return found
    dmap, first, shape = _index_dims(x, indices)
    found += [Strategy((Shard(d),) + (R,) * len(ts), Shard(o)) for d, o in dmap.items() if x.shape[d] > 1]
    for j in shardable_dims(shape):
        found.append(Strategy((R,) + tuple(_aligned(t, j, len(shape), shape[j]) for t in ts),
                              Shard(first + j)))
    return found


@register(aten.index_put.default)
def index_put(info: OpInfo) -> list:
    """``x[indices] = values`` (``+=`` with ``accumulate``): a dim of ``x`` not indexed shards,
    and ``values`` with it where it has that dim of ``x[indices]`` at full size."""
    x, indices, values = info.args[0], info.args[1], info.args[2]
    k = sum(t is not None for t in indices)
    kinds = ("sum", "avg") if arg(info, 3, "accumulate", False) else ("sum", "avg", "max", "min")
    found = [replicated(info)] + [Strategy((Partial(p),) + (R,) * k + (Partial(p),), Partial(p))
                                  for p in kinds]
    if not arg(info, 3, "accumulate", False):   # a value written alike on every rank
        found += [Strategy((Partial(p),) + (R,) * (k + 1), Partial(p)) for p in ("avg", "max", "min")]
    if not _plain(indices):
        return found
    dmap, first, shape = _index_dims(x, indices)
    nd = x.ndim - k + len(shape)
    for d, o in dmap.items():
        if x.shape[d] > 1:
            found.append(Strategy((Shard(d),) + (R,) * k + (_aligned(values, o, nd, x.shape[d]),),
                                  Shard(d)))
    return found


register(aten.index_put_.default)(inplace(index_put))


@register(aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable,
          aten.topk.default)
def sort_topk(info: OpInfo) -> list:
    """Values and indices along ``dim`` need the whole dim: shard the others (the positions in
    ``dim`` a rank returns are then the global ones). Sorting along the batch's dim is an order
    over all of it: data parallelism refuses it (transformers' ``grouped_mm`` experts sort the
    tokens of the whole batch by expert; its ``batched_mm`` experts keep them apart)."""
    x = info.args[0]
    dim = norm_dim(arg(info, 2 if info.target == aten.topk.default else 1, "dim", -1), x.ndim)
    return [replicated(info)] + [Strategy((Shard(d),), like_out(info, Shard(d)))
                                 for d in shardable_dims(x.shape) if d != dim]


@register(aten.histc.default)
def histc(info: OpInfo) -> list:
    """Counts over a fixed range add up across ranks; with ``min == max`` the range is the
    data's own, which each rank would see differently."""
    x, lo, hi = info.args[0], arg(info, 2, "min", 0), arg(info, 3, "max", 0)
    found = [replicated(info)]
    if lo < hi:
        found += [Strategy((Shard(d),), Partial()) for d in shardable_dims(x.shape)]
    return found


@register(aten.nonzero.default, aten.masked_scatter.default)
def data_dependent(info: OpInfo) -> list:
    return [replicated(info)]
