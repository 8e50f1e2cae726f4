"""Sharding rules of ops that move elements without computing: views, permutes, split/cat.

view/reshape group the input and output dims into runs of equal size product
(``(b, s, h) -> (b*s, h)`` is ``[b, s] -> [b*s]`` and ``[h] -> [h]``). Within a run, only the
outermost input dim may carry a shard, and it lands on the outermost output dim when every
rank's piece is a whole number of inner rows on both sides, with the chunk sizes of the
ceil convention: merging ``(b, s)`` keeps ``S(0)`` when ``b`` divides evenly; splitting
``h -> (nh, hd)`` keeps ``S(2)`` on ``nh`` when ``nh`` divides evenly (the attention head
split). That depends on the axis size, so the rule reads ``info.n``.

Partial values pass through all of these ops unchanged (they act on each addend alike).
``getitem`` picks one output of a multi-output op; its input placement is a tuple in which
only the picked entry matters (the others are ``None``).
"""
from __future__ import annotations

import operator

import torch

from .registry import (PARTIALS, R, OpInfo, Strategy, TensorMeta, arg, like_out, local_size,
                       norm_dim, prod, register, register_localize, replicated,
                       shardable_dims, tensor_inputs, with_arg)
from autopar.placement import Partial, Shard
from autopar.sizes import chunk_range

aten = torch.ops.aten



def moves(info: OpInfo, dim_map) -> list:
    """All-R, Partial pass-through, and ``S(d) -> S(dim_map[d])`` for each shardable input dim
    ``d`` in ``dim_map`` (every tensor input sharded alike)."""
    k = len(tensor_inputs(info))
    found = [replicated(info)] + [Strategy((p,) * k, like_out(info, p)) for p in PARTIALS]
    x = tensor_inputs(info)[0]
    for d in shardable_dims(x.shape):
        if d in dim_map:
            found.append(Strategy((Shard(d),) * k, like_out(info, Shard(dim_map[d]))))
    return found


def dim_groups(a, b) -> list:
    """A reshape from shape ``a`` to shape ``b`` as runs ``(in_dims, out_dims)`` of equal size
    product, size-1 dims left out (none when ``a`` has a dim of size 0)."""
    if 0 in a:
        return []
    ia, ib = [d for d, s in enumerate(a) if s != 1], [d for d, s in enumerate(b) if s != 1]
    groups, p, q = [], 0, 0
    while p < len(ia) and q < len(ib):
        ga, gb, pa, pb = [ia[p]], [ib[q]], a[ia[p]], b[ib[q]]
        p, q = p + 1, q + 1
        while pa != pb:
            if pa < pb:
                ga.append(ia[p]); pa *= a[ia[p]]; p += 1
            else:
                gb.append(ib[q]); pb *= b[ib[q]]; q += 1
        groups.append((ga, gb))
    return groups


def _keeps_chunks(a, ga, b, gb, n) -> bool:
    """Each rank's piece of ``a[ga[0]]`` (with its inner dims) is its piece of ``b[gb[0]]``."""
    if n is None:
        return a[ga[0]] == b[gb[0]]
    inner_a, inner_b = prod(a[d] for d in ga[1:]), prod(b[d] for d in gb[1:])
    return all(local_size(a[ga[0]], n, i) * inner_a == local_size(b[gb[0]], n, i) * inner_b
               for i in range(n))


@register(aten.view.default, aten.reshape.default, aten._unsafe_view.default,
          aten.flatten.using_ints, aten.unflatten.int, aten.squeeze.default, aten.squeeze.dim,
          aten.squeeze.dims, aten.unsqueeze.default)
def view(info: OpInfo) -> list:
    a, b = info.args[0].shape, info.out.shape
    return moves(info, {ga[0]: gb[0] for ga, gb in dim_groups(a, b)
                        if _keeps_chunks(a, ga, b, gb, info.n)})


@register(aten.transpose.int, aten.t.default, aten.permute.default, aten.numpy_T.default)
def permute(info: OpInfo) -> list:
    nd = info.args[0].ndim
    if info.target == aten.permute.default:
        perm = [norm_dim(d, nd) for d in info.args[1]]
    elif info.target == aten.numpy_T.default:
        perm = list(reversed(range(nd)))
    else:
        d0, d1 = (norm_dim(arg(info, 1, "dim0"), nd), norm_dim(arg(info, 2, "dim1"), nd)) \
            if info.target == aten.transpose.int else (0, min(1, nd - 1))
        perm = list(range(nd))
        perm[d0], perm[d1] = perm[d1], perm[d0]
    return moves(info, {src: dst for dst, src in enumerate(perm)})


@register(aten.expand.default, aten.broadcast_to.default)
def expand(info: OpInfo) -> list:
    x, out = info.args[0], info.out.shape
    off = len(out) - x.ndim
    return moves(info, {d: d + off for d in range(x.ndim) if x.shape[d] == out[d + off]})


@register(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
          aten.tensor_split.indices, aten.tensor_split.sections, aten.slice.Tensor, aten.cat.default)
def along_other_dims(info: OpInfo) -> list:
    """Splitting, slicing or concatenating along ``dim`` keeps a shard of any other dim (the
    batch's, when Mamba's scan splits its sequence with ``tensor_split``)."""
    nd = tensor_inputs(info)[0].ndim
    pos = 1 if info.target in (aten.cat.default, aten.slice.Tensor) else 2
    dim = norm_dim(arg(info, pos, "dim", 0), nd)
    return moves(info, {d: d for d in range(nd) if d != dim})


@register(aten.stack.default)
def stack(info: OpInfo) -> list:
    """Stacking along a new ``dim`` keeps a shard of any input dim, moved past the new one."""
    nd = tensor_inputs(info)[0].ndim
    dim = norm_dim(arg(info, 1, "dim", 0), nd + 1)
    return moves(info, {d: d + (d >= dim) for d in range(nd)})


@register(aten.flip.default, aten.diff.default, aten.repeat_interleave.self_int)
def along_dims(info: OpInfo) -> list:
    """Ops along some dims (flip's ``dims``, diff's and repeat_interleave's ``dim``; no dim:
    the flattened tensor) keep a shard of the others; diff's prepend/append shard alike.
    Repeating each row ``r`` times keeps the shard of ``dim`` itself where every rank's ``r``
    copies of its rows are its ceil chunk of the output (the MoE token-per-expert copy)."""
    nd = info.args[0].ndim
    if info.target == aten.flip.default:
        dims = info.args[1]
    else:
        dim = arg(info, 2, "dim", -1 if info.target == aten.diff.default else None)
        dims = range(nd) if dim is None else [dim]
    dims = {norm_dim(d, nd) for d in dims}
    found = moves(info, {d: d for d in range(nd) if d not in dims})
    if info.target == aten.diff.default:     # differences: linear, but not monotone
        found = [s for s in found if s.output not in (Partial("max"), Partial("min"))]
    if info.target == aten.repeat_interleave.self_int and len(dims) == 1 and nd > 0:
        (d,), x, r = dims, info.args[0], info.args[1]
        if x.shape[d] > 1 and _keeps_chunks((x.shape[d], r), [0, 1], (x.shape[d] * r,), [0], info.n):
            found.append(Strategy((Shard(d),), Shard(d)))
    return found


@register(aten.repeat.default)
def repeat(info: OpInfo) -> list:
    """A dim repeated once keeps its shard (leading dims may be added)."""
    nd, reps = info.args[0].ndim, info.args[1]
    off = len(reps) - nd
    return moves(info, {d: d + off for d in range(nd) if reps[d + off] == 1})


@register(aten.diagonal.default)
def diagonal(info: OpInfo) -> list:
    """The dims other than ``dim1``/``dim2`` keep their shard; the diagonal becomes the last dim."""
    nd = info.args[0].ndim
    pair = {norm_dim(arg(info, 2, "dim1", 0), nd), norm_dim(arg(info, 3, "dim2", 1), nd)}
    return moves(info, {d: i for i, d in enumerate(d for d in range(nd) if d not in pair)})


@register(aten.as_strided.default)
def as_strided(info: OpInfo) -> list:
    """Reads the storage by explicit strides: a piece's storage is not the whole's."""
    return [replicated(info)]


@register(aten.select_scatter.default, aten.slice_scatter.default)
def scatter_into(info: OpInfo) -> list:
    """``self`` with ``src`` written at a position (a slice) of ``dim``: both shard alike along
    any other dim; both Partial alike (each position holds one of them)."""
    x, src = info.args[0], info.args[1]
    dim = norm_dim(arg(info, 2, "dim", 0), x.ndim)
    found = [replicated(info)] + [Strategy((p, p), p) for p in PARTIALS]
    for d in shardable_dims(x.shape):
        ds = d - (d > dim) if info.target == aten.select_scatter.default else d
        if d != dim and src.shape[ds] == x.shape[d]:
            found.append(Strategy((Shard(d), Shard(ds)), Shard(d)))
    return found


@register(aten.select.int, aten.unbind.int)
def select(info: OpInfo) -> list:
    nd = info.args[0].ndim
    dim = norm_dim(arg(info, 1, "dim", 0), nd)
    return moves(info, {d: d - (d > dim) for d in range(nd) if d != dim})


@register(operator.getitem)
def getitem(info: OpInfo) -> list:
    values, i = info.args
    if not (isinstance(values, tuple) and isinstance(values[i], TensorMeta)):
        return [replicated(info)]
    shards = [Shard(d) for d in shardable_dims(values[i].shape)]
    return [Strategy((tuple(p if j == i else None for j in range(len(values))),), p)
            for p in (R, *PARTIALS, *shards)]


@register(aten.tril.default, aten.triu.default)
def triangle(info: OpInfo) -> list:
    """Any dim may shard: ``localize`` moves the diagonal by the rank's first row (or column)."""
    return moves(info, {d: d for d in range(info.args[0].ndim)})


@register_localize(aten.tril.default, aten.triu.default)
def localize_triangle(info, strategy, n, index):
    x, diagonal = info.args[0], arg(info, 1, "diagonal", 0)
    if isinstance(strategy.output, Shard) and strategy.output.dim >= x.ndim - 2:
        d = strategy.output.dim
        first = chunk_range(x.shape[d], n, index)[0]
        diagonal += first if d == x.ndim - 2 else -first
    return with_arg(info, 1, "diagonal", diagonal)


def _local_out(info: OpInfo, strategy: Strategy, n: int, index: int) -> list:
    out = list(info.out.shape)
    if isinstance(strategy.output, Shard):
        out[strategy.output.dim] = local_size(out[strategy.output.dim], n, index)
    return out


@register_localize(aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                   aten.expand.default, aten.broadcast_to.default)
def localize_sizes(info, strategy, n, index):
    return with_arg(info, 1, "size", _local_out(info, strategy, n, index))


@register_localize(aten.unflatten.int)
def localize_unflatten(info, strategy, n, index):
    dim = norm_dim(arg(info, 1, "dim"), info.args[0].ndim)
    k = len(arg(info, 2, "sizes"))
    return with_arg(info, 2, "sizes", _local_out(info, strategy, n, index)[dim:dim + k])


@register_localize(aten.split.Tensor, aten.split_with_sizes.default)
def localize_split(info, strategy, n, index):
    """A split along the sharded dim happens only on an interleaved (grouped) shard, which the
    tensor-parallel pass sets up for fused projections: every part is split evenly, so each
    rank's part is ``size / n``."""
    x = info.args[0]
    dim = norm_dim(arg(info, 2, "dim", 0), x.ndim)
    if strategy.inputs[0] != Shard(dim):
        return info.args, dict(info.kwargs)
    name = "split_size" if info.target == aten.split.Tensor else "split_sizes"
    sizes = arg(info, 1, name)
    local = [s // n for s in sizes] if isinstance(sizes, (list, tuple)) else sizes // n
    return with_arg(info, 1, name, local)
