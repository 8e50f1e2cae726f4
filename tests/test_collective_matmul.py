"""Collective matmul (autopar.runtime.collmatmul): values, gradients and byte counts against plain torch
on the whole tensors and against the non-decomposed collectives (2 and 4 gloo ranks)."""
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.runtime.collmatmul import all_gather_matmul, matmul_reduce_scatter
from autopar.runtime.comm import AxisComm, CommStats, all_gather, reduce_scatter
from autopar.sizes import ring_bytes
from autopar.testing import run

pytestmark = pytest.mark.timeout(120)

TOL = dict(rtol=1e-5, atol=1e-5)
S_LOCAL = 3   # rows of the decomposed dim per rank
# (x shape with "S" for the whole decomposed dim, dim, with bias)
CASES = [((2, "S", 8), 1, True), (("S", 2, 8), 0, False), ((2, 3, "S", 8), -2, True)]


def _shape(spec, world, last=None):
    shape = [S_LOCAL * world if d == "S" else d for d in spec]
    if last is not None:
        shape[-1] = last
    return shape


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _grads(*ts):
    return [None if t is None else t.grad for t in ts]


def _comm(world, rank):
    stats = CommStats()
    return AxisComm("tp", world, rank, dist.group.WORLD, stats), stats


def _counters(stats):
    return dict(stats.bytes), dict(stats.calls)


def all_gather_matmul_job(spec, dim, with_bias):
    """Column-parallel linear on a sequence-sharded x: out features split over the ranks."""
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    out_local = 5
    X = torch.randn(_shape(spec, world))
    W = torch.randn(out_local * world, X.shape[-1])
    B = torch.randn(out_local * world) if with_bias else None
    Y_ref = F.linear(X, W, B)
    G = torch.randn_like(Y_ref)
    d = dim % X.dim()
    rows, cols = slice(rank * S_LOCAL, (rank + 1) * S_LOCAL), slice(rank * out_local, (rank + 1) * out_local)
    g_local = G[..., cols]

    res = {}
    for name in ("decomposed", "plain"):
        x = _leaf(X.narrow(d, rows.start, S_LOCAL))
        w = _leaf(W[cols])
        b = _leaf(B[cols]) if with_bias else None
        comm, stats = _comm(world, rank)
        if name == "decomposed":
            y = all_gather_matmul(x, w, b, comm, dim, size=X.shape[d])
        else:
            y = F.linear(all_gather(x, comm, d), w, b)
        (y * g_local).sum().backward()
        res[name] = dict(y=y.detach(), grads=_grads(x, w, b), counters=_counters(stats))

    Xr, Wr = _leaf(X), _leaf(W)
    Br = _leaf(B) if with_bias else None
    (F.linear(Xr, Wr, Br) * G).sum().backward()
    res["ref"] = dict(y=Y_ref[..., cols], grads=[Xr.grad.narrow(d, rows.start, S_LOCAL), Wr.grad[cols],
                                                 Br.grad[cols] if with_bias else None])
    res["x_bytes"] = X.numel() * X.element_size()
    return res


def matmul_reduce_scatter_job(spec, dim, with_bias):
    """Row-parallel linear whose output is reduce-scattered along the sequence: in features split."""
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(1)
    in_local, out = 4, 6
    X = torch.randn(_shape(spec, world, last=in_local * world))
    W = torch.randn(out, X.shape[-1])
    B = torch.randn(out) if with_bias else None
    Y_ref = F.linear(X, W, B)
    G = torch.randn_like(Y_ref)
    d = dim % X.dim()
    start, cols = rank * S_LOCAL, slice(rank * in_local, (rank + 1) * in_local)
    g_local = G.narrow(d, start, S_LOCAL)

    res = {}
    for name in ("decomposed", "plain"):
        x = _leaf(X[..., cols])
        w = _leaf(W[:, cols])
        b = _leaf(B) if with_bias else None
        comm, stats = _comm(world, rank)
        if name == "decomposed":
            y = matmul_reduce_scatter(x, w, b, comm, dim)
        else:
            y = reduce_scatter(F.linear(x, w), comm, d)
            y = y + b if with_bias else y
        (y * g_local).sum().backward()
        res[name] = dict(y=y.detach(), grads=_grads(x, w, b), counters=_counters(stats))

    Xr, Wr = _leaf(X), _leaf(W)
    Br = _leaf(B) if with_bias else None
    (F.linear(Xr, Wr, Br) * G).sum().backward()
    # the replicated bias: this rank's addend is the sum over its own output shard
    own_b = g_local.reshape(-1, out).sum(0) if with_bias else None
    res["ref"] = dict(y=Y_ref.narrow(d, start, S_LOCAL), grads=[Xr.grad[..., cols], Wr.grad[:, cols], own_b])
    res["whole_bias_grad"] = Br.grad if with_bias else None
    res["y_bytes"] = Y_ref.numel() * Y_ref.element_size()
    return res


def cases_job(job):
    return [job(*case) for case in CASES]


@functools.lru_cache(maxsize=None)
def _results(kind, world):
    job = all_gather_matmul_job if kind == "ag" else matmul_reduce_scatter_job
    return run(cases_job, world, job, timeout=90)


def _check_against_ref(r):
    torch.testing.assert_close(r["decomposed"]["y"], r["ref"]["y"], **TOL)
    for got, ref, plain in zip(r["decomposed"]["grads"], r["ref"]["grads"], r["plain"]["grads"]):
        assert (got is None) == (ref is None) == (plain is None)
        if ref is not None:
            torch.testing.assert_close(got, ref, **TOL)
            torch.testing.assert_close(got, plain, **TOL)


@pytest.mark.parametrize("world", [2, 4])
def test_all_gather_matmul_matches_reference(world):
    for rank_results in _results("ag", world):
        for r in rank_results:
            _check_against_ref(r)


@pytest.mark.parametrize("world", [2, 4])
def test_matmul_reduce_scatter_matches_reference(world):
    per_rank = _results("rs", world)
    for i, (_, _, with_bias) in enumerate(CASES):
        for rank_results in per_rank:
            _check_against_ref(rank_results[i])
        if with_bias:   # the ranks' addends sum to the whole bias gradient
            total = sum(rank_results[i]["decomposed"]["grads"][2] for rank_results in per_rank)
            torch.testing.assert_close(total, per_rank[0][i]["whole_bias_grad"], **TOL)


@pytest.mark.parametrize("world", [2, 4])
def test_byte_counters_equal_the_ring_collectives(world):
    for rank_results in _results("ag", world):
        for r in rank_results:
            nbytes, calls = r["decomposed"]["counters"]
            assert (nbytes, calls) == r["plain"]["counters"]
            ring = ring_bytes("all_gather", r["x_bytes"], world)
            assert nbytes == {("tp", "all_gather", "forward"): ring, ("tp", "reduce_scatter", "backward"): ring}
            assert set(calls.values()) == {1}
    for rank_results in _results("rs", world):
        for r in rank_results:
            nbytes, calls = r["decomposed"]["counters"]
            assert (nbytes, calls) == r["plain"]["counters"]
            ring = ring_bytes("all_gather", r["y_bytes"], world)
            assert nbytes == {("tp", "reduce_scatter", "forward"): ring, ("tp", "all_gather", "backward"): ring}
            assert set(calls.values()) == {1}


def test_one_rank_is_plain_linear():
    torch.manual_seed(2)
    comm = AxisComm("tp", 1, 0, None, CommStats())
    x, w, b = torch.randn(2, 5, 4), torch.randn(3, 4), torch.randn(3)
    for fn in (all_gather_matmul, matmul_reduce_scatter):
        leaves = [_leaf(t) for t in (x, w, b)]
        ref = [_leaf(t) for t in (x, w, b)]
        fn(*leaves, comm, 1).sum().backward()
        F.linear(*ref).sum().backward()
        for got, want in zip(_grads(*leaves), _grads(*ref)):
            torch.testing.assert_close(got, want, **TOL)
    assert not comm.stats.calls


def test_bad_shapes_raise_before_any_communication():
    # group None with two ranks: any communication would raise RuntimeError, not ValueError
    comm = AxisComm("tp", 2, 0, None, CommStats())
    x, w, b = torch.randn(2, 3, 8), torch.randn(5, 8), torch.randn(5)
    bad = [
        (all_gather_matmul, (x, w, b, comm, 1), {"size": 7}, r"equal shards of the whole length 7.*found a shard of 3"),
        (all_gather_matmul, (x, w, b, comm, 1), {"size": 8}, r"\(4 per rank\), found a shard of 3"),
        (matmul_reduce_scatter, (x, w, b, comm, 1), {}, r"x.shape\[1\] divisible by tp=2.*found 3"),
        (all_gather_matmul, (x, torch.randn(5, 7), b, comm, 1), {}, r"weight of shape \[out, 8\].*found \(5, 7\)"),
        (matmul_reduce_scatter, (torch.randn(2, 4, 8), w, torch.randn(4), comm, 1), {},
         r"bias of shape \(5,\), found \(4,\)"),
        (all_gather_matmul, (x, w, b, comm, 2), {}, r"non-last dim.*found dim=2"),
        (matmul_reduce_scatter, (torch.randn(8), w, b, comm, 0), {}, r"at least 2 dims.*found shape \(8,\)"),
    ]
    for fn, args, kwargs, msg in bad:
        with pytest.raises(ValueError, match=msg):
            fn(*args, **kwargs)
    assert not comm.stats.calls
    with pytest.raises(RuntimeError, match="virtual"):   # valid shapes get as far as the group
        all_gather_matmul(x, w, b, comm, 1, size=6)
