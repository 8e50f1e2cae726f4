"""The autograd-aware collectives: values, conjugate backward and byte counts (2 and 4 ranks)."""
import pytest
import torch

from autopar.placement import ShardSpec
from autopar.sizes import ring_bytes
from jobs import collectives


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_collectives_and_their_conjugates(ranks, world):
    res = ranks(collectives.comm_functions, world, timeout=60)
    for rank, r in enumerate(res):
        # all_gather along dim 1: blocks of every rank side by side
        expected = torch.cat([torch.arange(6.0).reshape(2, 3) + 10 * k for k in range(world)], dim=1)
        assert torch.equal(r["ag"], expected)
        # backward = reduce_scatter(sum): world ranks each contribute the same weight pattern
        w = torch.arange(2 * 3 * world, dtype=torch.float32).view(2, 3 * world)
        assert torch.equal(r["ag_grad"], world * w[:, 3 * rank:3 * rank + 3])
        # reduce_scatter of ones*(k+1) over k: sum = world(world+1)/2 on this rank's 4 rows
        assert torch.equal(r["rs"], torch.full((4, 2), world * (world + 1) / 2))
        assert torch.equal(r["rs_grad"], torch.ones(4 * world, 2))      # backward = all_gather
        assert torch.equal(r["ar"], torch.full((3,), world * (world + 1) / 2))
        assert torch.equal(r["ar_grad"], torch.full((3,), 2.0))          # g: identity backward
        assert torch.equal(r["f_grad"], torch.full((3,), world * (world + 1) / 2))  # f: all-reduce
        b = r["bytes"]
        n = world
        assert b[("dp", "all_gather", "forward")] == ring_bytes("all_gather", 2 * 3 * n * 4, n)
        assert b[("dp", "all_gather", "backward")] == ring_bytes("all_gather", 4 * 2 * n * 4, n)
        assert b[("dp", "reduce_scatter", "forward")] == ring_bytes("reduce_scatter", 4 * 2 * n * 4, n)
        assert b[("dp", "reduce_scatter", "backward")] == ring_bytes("reduce_scatter", 2 * 3 * n * 4, n)
        assert b[("dp", "all_reduce", "backward")] == ring_bytes("all_reduce", 12, n)


def test_ring_bytes_formulas():
    assert ring_bytes("all_reduce", 1000, 4) == 1500
    assert ring_bytes("all_gather", 1000, 4) == 750
    assert ring_bytes("reduce_scatter", 1000, 1) == 0


def test_shard_spec_uneven_rows():
    specs = [ShardSpec((7, 3), 4, i) for i in range(4)]
    assert [s.local_shape for s in specs] == [(2, 3), (2, 3), (2, 3), (1, 3)]
    assert specs[0].chunk_numel == 6
    full = torch.arange(21.0).view(7, 3)
    chunks = specs[0].padded_chunks(full)
    assert chunks.shape == (4, 6) and torch.equal(chunks[3], torch.tensor([18., 19., 20., 0., 0., 0.]))
    gathered = torch.cat([s.padded_local(s.local_of(full)) for s in specs])
    assert torch.equal(specs[0].unpad(gathered), full)
    tiny = [ShardSpec((3,), 4, i) for i in range(4)]
    assert [s.local_shape for s in tiny] == [(1,), (1,), (1,), (0,)]
