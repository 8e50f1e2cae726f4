"""Collective matmul (autopar.runtime.collmatmul): values, gradients and byte counts against plain torch
on the whole tensors and against the non-decomposed collectives (2 and 4 gloo ranks)."""
import pytest
import torch
import torch.nn.functional as F

from autopar.runtime.collmatmul import all_gather_matmul, matmul_reduce_scatter
from autopar.runtime.comm import AxisComm, CommStats
from autopar.sizes import ring_bytes

from jobs import collectives

pytestmark = pytest.mark.timeout(120)

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def results(ranks):
    """(kind, world) -> per-rank results of every case."""
    return {(kind, world): ranks(collectives.cases_job, world, job, timeout=90)
            for kind, job in (("ag", collectives.all_gather_matmul_job), ("rs", collectives.matmul_reduce_scatter_job))
            for world in (2, 4)}


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _grads(*ts):
    return [None if t is None else t.grad for t in ts]


def _check_against_ref(r):
    torch.testing.assert_close(r["decomposed"]["y"], r["ref"]["y"], **TOL)
    for got, ref, plain in zip(r["decomposed"]["grads"], r["ref"]["grads"], r["plain"]["grads"]):
        assert (got is None) == (ref is None) == (plain is None)
        if ref is not None:
            torch.testing.assert_close(got, ref, **TOL)
            torch.testing.assert_close(got, plain, **TOL)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_all_gather_matmul_matches_reference(results, world):
    for rank_results in results[("ag", world)]:
        for r in rank_results:
            _check_against_ref(r)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_matmul_reduce_scatter_matches_reference(results, world):
    per_rank = results[("rs", world)]
    for i, (_, _, with_bias) in enumerate(collectives.CASES):
        for rank_results in per_rank:
            _check_against_ref(rank_results[i])
        if with_bias:   # the ranks' addends sum to the whole bias gradient
            total = sum(rank_results[i]["decomposed"]["grads"][2] for rank_results in per_rank)
            torch.testing.assert_close(total, per_rank[0][i]["whole_bias_grad"], **TOL)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_byte_counters_equal_the_ring_collectives(results, world):
    for rank_results in results[("ag", world)]:
        for r in rank_results:
            nbytes, calls = r["decomposed"]["counters"]
            assert (nbytes, calls) == r["plain"]["counters"]
            ring = ring_bytes("all_gather", r["x_bytes"], world)
            assert nbytes == {("tp", "all_gather", "forward"): ring, ("tp", "reduce_scatter", "backward"): ring}
            assert set(calls.values()) == {1}
    for rank_results in results[("rs", world)]:
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
