"""Strategy search: the strategies of an op that has no sharding rule, found by running it.

``strategies_for`` hands an op without a rule to ``search``, which lists candidate
strategies along one mesh axis and keeps those the brute-force validator
(``check.check_strategy``) finds right on simulated ranks, at the node's own shapes and
with random data, on axes of 2 and 3 ranks and of the node's axis size:

  candidates   each tensor input R, S(d) for each of its dims of size > 1, or P(sum) when
               floating; every combination while there are at most ``MAX_COMBINATIONS``,
               else each input placed alone (the others R), every input sharded on its dim
               of one size (one "role": the batch of 4, the features of 32; its first or its
               last such dim), and P(sum) on all floating inputs together. The output's
               placement is derived, not guessed: the op runs on meta tensors at each rank's
               local shapes; an output that keeps its full shape may be R or (floating)
               P(sum), one cut along a single dim by the ceil convention is S(d).
  data         floats N(0, 1) (half precision runs in fp32); integers in [0, m), m the
               smallest dim of the inputs, so that they are valid indices; bools random.
  refused      (all-Replicate only, never run) ops that draw random numbers, mutate an
               argument, return values of data-dependent shape or unspecified values
               (``empty``), read a multi-output value or have no tensor input, and calls of
               more than ``MAX_ELEMENTS`` elements in all.
  result       all-Replicate first, then every candidate that matched (logged at info
               level as found by search); just all-Replicate when none did.
  cache        per (op, torch version, the arguments' shapes, dtypes and values, axis size):
               in memory and in a JSON file, ``$AUTOPAR_STRATEGY_CACHE`` or
               ``~/.cache/autopar/strategies.json``; an unreadable file is ignored with a
               warning (and replaced on the next write).

A strategy found this way is right for the shapes it was run at (the cache key) and was
checked on one random draw: an op whose correctness under a layout depends on the values
(e.g. indices that stay inside one rank's rows) can pass on data that happens to comply.
A rule in the family files is the durable answer; the search keeps an op without one from
being replicated (or refused under data parallelism) when a layout is evidently right.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import tempfile
from typing import Optional

import torch

from autopar.placement import Partial, Replicate, Shard, parse_placement

from .registry import (RANDOM, OpInfo, Strategy, TensorMeta, fake_tensors, out_meta, format_placement,
                       local_shape, localize, prod, register_search, replicated, shardable_dims,
                       shrink, tensor_inputs)
from .check import check_strategy

__all__ = ["search", "cache_path", "MAX_ELEMENTS", "MAX_COMBINATIONS"]

log = logging.getLogger("autopar")
R = Replicate()
MAX_ELEMENTS = 1 << 16
"""Elements of the inputs and output together above which a call is not searched."""
MAX_COMBINATIONS = 64
"""Input placement combinations enumerated in full; above it, the role-wise candidates."""
_VERSION = 1
_memory: dict = {}
_disk: list = []        # [dict] once the file was read


def cache_path() -> str:
    env = os.environ.get("AUTOPAR_STRATEGY_CACHE")
    return env or os.path.join(os.path.expanduser("~"), ".cache", "autopar", "strategies.json")


@register_search
def search(info: OpInfo) -> list:
    """All-Replicate, then the strategies of ``info``'s op (with no rule) that the validator
    finds right along an axis of ``info.n`` ranks (and of 2 and 3)."""
    rep = replicated(info)
    reason = _refused(info)
    if reason is not None:
        log.debug("autopar: %s is not searched for strategies: %s", info.target, reason)
        return [rep]
    key = _key(info)
    found = _memory.get(key)
    if found is None:
        found = _read(key)
    if found is None:
        found = _find(info)
        _write(key, found)
        if found:
            log.info("autopar: %s has no sharding rule; strategies found by search (n=%s): %s",
                     info.target, info.n, "; ".join(map(str, found)))
        else:
            log.info("autopar: %s has no sharding rule and no candidate placement matched in the "
                     "strategy search (n=%s): replicated", info.target, info.n)
    _memory[key] = found
    return [rep] + found


def _refused(info: OpInfo) -> Optional[str]:
    op = info.target
    if not isinstance(op, torch._ops.OpOverload):
        return "not an operator overload"
    tags = set(op.tags)
    if op in RANDOM or torch.Tag.nondeterministic_seeded in tags or "empty" in str(op):
        return "its values are random or unspecified"
    if op._schema.is_mutable:
        return "it mutates an argument"
    if torch.Tag.dynamic_output_shape in tags:
        return "its output shape depends on the data"
    ins = tensor_inputs(info)
    if not ins or any(isinstance(m, tuple) for m in ins):
        return "no tensor input, or a multi-output value as input"
    outs = info.out if isinstance(info.out, tuple) else (info.out,)
    if not outs or not all(isinstance(m, TensorMeta) for m in outs):
        return "its output is not a tensor"
    if sum(prod(m.shape) for m in ins + list(outs)) > MAX_ELEMENTS:
        return f"more than {MAX_ELEMENTS} elements"
    return None


# --- candidates ---------------------------------------------------------------------------

def _choices(m: TensorMeta) -> list:
    return [R] + [Shard(d) for d in shardable_dims(m.shape)] + (
        [Partial()] if m.dtype.is_floating_point else [])


def _combinations(ins: list) -> list:
    """Input placement combinations, all-Replicate left out."""
    choices = [_choices(m) for m in ins]
    if prod(len(c) for c in choices) <= MAX_COMBINATIONS:
        combos = list(itertools.product(*choices))
    else:
        combos = [tuple(c if j == i else R for j in range(len(ins)))
                  for i, cs in enumerate(choices) for c in cs[1:]]
        for size in sorted({s for m in ins for s in m.shape if s > 1}):
            dims = [[d for d, s in enumerate(m.shape) if s == size] for m in ins]
            for pick in (min, max):
                combos.append(tuple(Shard(pick(ds)) if ds else R for ds in dims))
        combos.append(tuple(Partial() if m.dtype.is_floating_point else R for m in ins))
    return [c for c in dict.fromkeys(combos) if any(p != R for p in c)]


def _outputs(info: OpInfo, ins: tuple, ns) -> list:
    """Output placements consistent with the local output shapes of every rank for each
    axis size in ``ns``, found by running the op on meta tensors."""
    full = info.out if isinstance(info.out, tuple) else (info.out,)
    options = [None] * len(full)
    for n in ns:
        for i in range(n):
            probe = Strategy(ins, tuple(R for _ in full) if isinstance(info.out, tuple) else R)
            local = shrink(info.with_n(n), probe, n, i)
            args, kwargs = localize(local, probe, n, i)
            try:
                out = out_meta(info.target(*fake_tensors(args), **fake_tensors(kwargs)))
            except Exception:       # the local pieces do not even make a call
                return []
            out = out if isinstance(out, tuple) else (out,)
            if len(out) != len(full):
                return []
            for j, (o, f) in enumerate(zip(out, full)):
                fits = _fits(o, f, n, i)
                options[j] = fits if options[j] is None else [p for p in options[j] if p in fits]
    if isinstance(info.out, tuple):
        return list(itertools.product(*options))
    return options[0]


def _fits(local, full: TensorMeta, n: int, i: int) -> list:
    if not isinstance(local, TensorMeta) or local.dtype != full.dtype or local.ndim != full.ndim:
        return []
    if local.shape == full.shape:
        return [R, Partial()] if full.dtype.is_floating_point else [R]
    cut = [d for d in range(full.ndim) if local.shape[d] != full.shape[d]]
    if len(cut) == 1 and local.shape == local_shape(full.shape, Shard(cut[0]), n, i):
        return [Shard(cut[0])]
    return []


# --- running ------------------------------------------------------------------------------

def _find(info: OpInfo) -> list:
    ins = tensor_inputs(info)
    ns = sorted({2, 3} | ({info.n} if info.n and info.n > 1 else set()))
    args, kwargs = _data(info, ins)
    found = []
    for k, combo in enumerate(_combinations(ins)):
        for out in _outputs(info, combo, ns):
            s = Strategy(combo, out)
            if all(check_strategy(info.target, args, kwargs, info.with_n(n), s, n, seed=k) is None
                   for n in ns):
                found.append(s)
    return found


def _data(info: OpInfo, ins: list):
    """Random concrete arguments in place of the TensorMeta ones."""
    g = torch.Generator().manual_seed(0)
    high = min([s for m in ins for s in m.shape if s > 0] or [1])

    def make(v):
        if isinstance(v, TensorMeta):
            if v.dtype.is_floating_point:
                dtype = torch.float32 if v.dtype.itemsize < 4 else v.dtype
                return torch.randn(v.shape, generator=g, dtype=dtype)
            if v.dtype.is_complex:
                return torch.randn(v.shape, generator=g, dtype=v.dtype)
            if v.dtype == torch.bool:
                return torch.rand(v.shape, generator=g) > 0.5
            return torch.randint(0, high, v.shape, generator=g, dtype=v.dtype)
        if isinstance(v, list):
            return [make(x) for x in v]
        if isinstance(v, torch.device):
            return torch.device("cpu")
        return v
    return tuple(make(a) for a in info.args), {k: make(v) for k, v in info.kwargs.items()}


# --- the cache ----------------------------------------------------------------------------

def _key(info: OpInfo) -> str:
    def norm(v):
        if isinstance(v, TensorMeta):
            return str(v)
        if isinstance(v, (list, tuple)):
            return [norm(x) for x in v]
        if isinstance(v, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
            return str(v)
        return v
    return repr((str(info.target), torch.__version__, norm(list(info.args)),
                 sorted((k, norm(v)) for k, v in info.kwargs.items()), info.n))


def _encode(s: Strategy) -> list:
    out = [str(p) for p in s.output] if isinstance(s.output, tuple) else str(s.output)
    return [[format_placement(p) for p in s.inputs], out]


def _decode(entry) -> Strategy:
    ins, out = entry
    out = tuple(parse_placement(p) for p in out) if isinstance(out, list) else parse_placement(out)
    return Strategy(tuple(parse_placement(p) for p in ins), out)


def _load() -> dict:
    """The file's entries (read once); {} with a warning when it cannot be read."""
    if _disk:
        return _disk[0]
    path, entries = cache_path(), {}
    if os.path.exists(path):
        try:
            with open(path) as f:
                data = json.load(f)
            if not isinstance(data, dict) or data.get("version") != _VERSION:
                raise ValueError(f"expected version {_VERSION}")
            entries = data["strategies"]
            for found in entries.values():
                [_decode(e) for e in found]
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("autopar: ignoring the strategy-search cache %s, which cannot be read "
                        "(%s: %s); it is rewritten on the next search", path, type(e).__name__, e)
            entries = {}
    _disk[:] = [entries]
    return entries


def _read(key: str) -> Optional[list]:
    found = _load().get(key)
    return None if found is None else [_decode(e) for e in found]


def _write(key: str, found: list) -> None:
    """Add the entry and write the file atomically (another process's entries are kept)."""
    entries = _load()
    entries[key] = [_encode(s) for s in found]
    path = cache_path()
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        try:
            with open(path) as f:
                current = json.load(f)["strategies"]
            entries.update({k: v for k, v in current.items() if k not in entries})
        except (OSError, ValueError, KeyError, TypeError):
            pass
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", suffix=".tmp")
        os.chmod(tmp, 0o644)           # as a plain open() would make it, not mkstemp's 0600
        with os.fdopen(fd, "w") as f:
            json.dump({"version": _VERSION, "strategies": entries}, f, indent=0, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("autopar: cannot write the strategy-search cache %s (%s); results are kept "
                    "in memory only", path, e)
