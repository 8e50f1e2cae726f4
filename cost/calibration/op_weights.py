"""``Device.op_weights``: how much framework time each op name costs, relative to the others.

The local preset's ``op_overhead`` is fitted on the calibration's probe pipelines (GPTs of
h = 8), so it is the dispatch of the *average op of that probe's layer*: 4 linears, 2 layer
norms, an attention call, a GeLU, 2 adds and 12 views. Models are made of other mixes: a
Llama layer is 54 ops, 20 of them views and most of the rest cheap pointwise ops (mul, add,
rsqrt, neg), and at one probe op each it is predicted ~40% over its measured forward
actions (0.83 ms predicted, 0.55 ms of CPU per stage action measured on the machine of
BENCHMARKS.md). Here each
op is timed on its own, forward and backward, on tensors small enough that only its dispatch
counts (2 x 4 x 8), and weighed by the mean of the probe layer's ops: the probe's layers weigh
what they did (the fit's slope is unchanged) and other mixes what their ops cost.

Each sample maps a tensor to one of a stable shape so the op can be chained: the time of 24
applications less that of 4, forward and then backward (``sum().backward()``), over 20, each
chain's fastest of rounds that go through every op in turn (a chain the scheduler interrupted
only reads longer). A sample that needs other ops around its own (``cat`` of two slices) has
their measured time taken off.
"""
from __future__ import annotations

import operator
import statistics
import time

import torch
import torch.nn.functional as F

from autopar.ops import VIEWS

from ..compute import OTHER_OP, VIEW_OP

__all__ = ["measure_op_weights", "SAMPLES", "SHAPE"]

SHAPE = (2, 4, 8)
_SHORT, _LONG = 4, 24       # applications per chain: the difference is the ops' own time
_ROUNDS = 25


def _samples() -> list:
    """(op name as ``autopar.ops.op_name`` spells it, x -> y of a chainable shape, ops per call,
    {other op name: count per call} whose time is taken off), in an order where those others
    come first."""
    d = SHAPE[-1]
    w = torch.randn(d, d, requires_grad=True)
    b = torch.randn(d, requires_grad=True)
    y = torch.randn(*SHAPE, requires_grad=True)
    wb = torch.randn(SHAPE[0], d, d, requires_grad=True)
    mask = torch.rand(*SHAPE) > 0.5
    idx = torch.arange(SHAPE[0] * SHAPE[1]).view(SHAPE[:2])
    aten = torch.ops.aten
    return [
        # views and the like: no arithmetic, a dispatch and an alias
        ("view", lambda x: x.view(x.shape), 1, {}),
        ("reshape", lambda x: x.reshape(x.shape), 1, {}),
        ("transpose", lambda x: x.transpose(0, 1), 1, {}),
        ("permute", lambda x: x.permute(1, 0, 2), 1, {}),
        ("expand", lambda x: x.expand(x.shape), 1, {}),
        ("slice", lambda x: aten.slice.Tensor(x, -1, 0, x.shape[-1]), 1, {}),
        ("getitem", lambda x: operator.getitem((x, x), 0), 1, {}),
        ("split", lambda x: x.split(x.shape[-1], -1)[0], 1, {"getitem": 1}),
        ("chunk", lambda x: x.chunk(1, -1)[0], 1, {"getitem": 1}),
        ("contiguous", lambda x: x.contiguous(), 1, {}),
        # pointwise, unary and binary
        ("neg", lambda x: -x, 1, {}),
        ("exp", torch.exp, 1, {}),
        ("log", torch.log, 1, {}),
        ("tanh", torch.tanh, 1, {}),
        ("sigmoid", torch.sigmoid, 1, {}),
        ("relu", F.relu, 1, {}),
        ("gelu", F.gelu, 1, {}),
        ("silu", F.silu, 1, {}),
        ("sqrt", torch.sqrt, 1, {}),
        ("rsqrt", torch.rsqrt, 1, {}),
        ("sin", torch.sin, 1, {}),
        ("cos", torch.cos, 1, {}),
        ("pow", lambda x: x.pow(2), 1, {}),
        ("add", lambda x: x + y, 1, {}),
        ("sub", lambda x: x - y, 1, {}),
        ("mul", lambda x: x * y, 1, {}),
        ("div", lambda x: x / y, 1, {}),
        ("where", lambda x: torch.where(mask, x, y), 1, {}),
        ("masked_fill", lambda x: x.masked_fill(mask, 0.0), 1, {}),
        ("clone", lambda x: x.clone(), 1, {}),
        ("_to_copy", lambda x: x.double().float(), 2, {}),
        ("dropout", lambda x: F.dropout(x, 0.1, True), 1, {}),
        # reductions and normalisations
        ("mean", lambda x: x.mean(-1, keepdim=True), 1, {}),
        ("sum", lambda x: x.sum(-1, keepdim=True), 1, {}),
        ("amax", lambda x: x.amax(-1, keepdim=True), 1, {}),
        ("softmax", lambda x: x.softmax(-1), 1, {}),
        ("log_softmax", lambda x: x.log_softmax(-1), 1, {}),
        ("layer_norm", lambda x: F.layer_norm(x, (d,), b, b), 1, {}),
        ("rms_norm", lambda x: F.rms_norm(x, (d,), b), 1, {}),
        ("cat", lambda x: torch.cat([aten.slice.Tensor(x, -1, 0, d // 2), aten.slice.Tensor(x, -1, d // 2, d)], -1),
         1, {"slice": 2}),
        # matmuls, attention, lookups
        ("linear", lambda x: F.linear(x, w, b), 1, {}),
        ("matmul", lambda x: x @ w, 1, {}),
        ("bmm", lambda x: torch.bmm(x, wb), 1, {}),
        ("scaled_dot_product_attention", lambda x: F.scaled_dot_product_attention(x, x, x, is_causal=True), 1, {}),
        ("embedding", lambda x: F.embedding(idx, x.reshape(-1, d)), 1, {"reshape": 1}),
    ]


SAMPLES = tuple(name for name, *_ in _samples())


def _chain(fn, n: int, x: torch.Tensor) -> tuple:
    """(forward seconds, backward seconds) of ``n`` applications of ``fn`` from ``x``."""
    t0 = time.perf_counter()
    for _ in range(n):
        x = fn(x)
    t1 = time.perf_counter()
    x.sum().backward()
    return t1 - t0, time.perf_counter() - t1


def _raw_seconds(rounds: int = _ROUNDS) -> dict:
    """op name -> (forward, backward) seconds of one op of each sample (its helpers' taken off)."""
    samples = _samples()
    got = {name: [] for name, *_ in samples}     # each round's (short forward, short backward, long ...)
    for r in range(rounds + 2):                  # two warm-up rounds
        for name, fn, per, _ in samples:
            x = torch.rand(*SHAPE).add_(0.5).requires_grad_()
            timed = _chain(fn, _SHORT, x) + _chain(fn, _LONG, x)
            if r >= 2:
                got[name].append(timed)
    out = {}
    for name, _, per, helpers in samples:        # helpers come first, so their time is known
        # each chain's fastest round: a chain of microseconds that the scheduler interrupted
        # only reads longer, and a difference of single timings goes below zero for the
        # linear's forward in most rounds on a busy machine
        fs, bs, fl, bl = (min(t[i] for t in got[name]) for i in range(4))
        f, b = (fl - fs) / (_LONG - _SHORT) / per, (bl - bs) / (_LONG - _SHORT) / per
        f -= sum(k * out[h][0] for h, k in helpers.items())
        b -= sum(k * out[h][1] for h, k in helpers.items())
        out[name] = (max(f, 0.0), max(b, 0.0))
    return out


def weights(raw: dict, mix: dict) -> tuple:
    """``Device.op_weights`` from ``raw`` (op name -> (forward, backward) seconds) relative to the
    mean op of ``mix`` (op name -> count: the probe layer's ops), with ``VIEW_OP`` and
    ``OTHER_OP`` for the ops the table lacks (the median view, the median other op). An op of
    ``mix`` the table lacks counts in the mean at its class's median."""
    views = [v for n, v in raw.items() if n in VIEWS]
    others = [v for n, v in raw.items() if n not in VIEWS]
    default = {VIEW_OP: tuple(statistics.median(x[i] for x in views) for i in (0, 1)),
               OTHER_OP: tuple(statistics.median(x[i] for x in others) for i in (0, 1))}

    def seconds(name):
        return raw.get(name, default[VIEW_OP if name in VIEWS else OTHER_OP])

    count = sum(mix.values())
    mean = [sum(k * seconds(n)[i] for n, k in mix.items()) / max(count, 1) for i in (0, 1)]
    if count == 0 or min(mean) <= 0:
        raise ValueError(f"op weights: the probe's ops {mix} have no measured time ({mean}); expected a layer's ops")
    table = {**raw, **default}
    return tuple((n, round(f / mean[0], 4), round(b / mean[1], 4)) for n, (f, b) in table.items())


def measure_op_weights(mix: dict, rounds: int = _ROUNDS) -> tuple:
    """``Device.op_weights`` measured on this process (one thread), relative to ``mix``."""
    return weights(_raw_seconds(rounds), mix)
