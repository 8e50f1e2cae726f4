"""Any batch and sequence length at run time: a module compiled at one shape trains and
evaluates at others (each new shape compiled once, on the same parameters and optimizer state),
step by step against the single-device model; ranks called with different shapes get an error,
not a hang."""
import pytest
import torch

import autopar
from autopar.models import GPTConfig, TinyGPT, gpt_batch
from autopar.testing import fake_rank
from jobs import shapes


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["zero3", "tp+sp", pytest.param("ddp", marks=pytest.mark.slow),
                                  pytest.param("zero2", marks=pytest.mark.slow),
                                  pytest.param("tp", marks=pytest.mark.slow),
                                  pytest.param("pp 1f1b", marks=pytest.mark.slow)])
def test_training_through_new_batch_sizes_and_sequence_lengths_matches_one_device(ranks, name):
    """Six steps at (8, 16), (4, 16), (8, 8), (8, 16), (4, 12), (4, 8) (rows, tokens), dropout
    on, then eval at (4, 10): loss, gradients and parameters of every step and the eval output
    (a pipeline: its eval_step loss) against the single-device model; one program per new shape."""
    for r in ranks(shapes.train_shapes, 2, name, timeout=240):
        assert max(r["errs"].values()) <= 1.0, r
        assert r["programs"] == 5      # (4, 16), (8, 8), (4, 12), (4, 8) and eval's (4, 10)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", ["dp x tp", "dp x pp"])
def test_training_through_new_shapes_on_a_2d_mesh(ranks, name):
    """ZeRO-3 with tp and sp; ZeRO-2 with an interleaved pipeline of 4 stages on 2 ranks."""
    for r in ranks(shapes.train_shapes, 4, name, timeout=360):
        assert max(r["errs"].values()) <= 1.0, r


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["ddp", pytest.param("dp x tp", marks=pytest.mark.slow)])
def test_a_batch_that_does_not_divide_by_dp_is_an_error_on_every_rank(ranks, name):
    world = 4 if name == "dp x tp" else 2
    for r in ranks(shapes.uneven_batch, world, name, timeout=240):
        by_shard_batch, by_hand = r["errors"]
        assert "5 rows along dim 0, which does not divide by dp=2" in by_shard_batch
        assert "different input shapes (rank 0: ((3, 16),)" in by_hand and "(2, 16)" in by_hand
        assert r["loss"] > 0        # the ranks are in step: the next batch trains


def test_a_new_shape_keeps_the_modules_parameters_and_caches_its_program():
    c = GPTConfig(layers=1)
    tok, _ = gpt_batch(c, 4)
    with fake_rank(2, 0):
        dm = autopar.compile(TinyGPT(c), autopar.Mesh(dp=2), example_inputs=(tok,), plan=autopar.Plan(dp="zero3"))
        dm(dm.shard_batch(tok[:, :8]))
        dm(dm.shard_batch(tok[:, :8]))
        assert list(dm._programs) == [((2, 8),)]
        program = dm._programs[((2, 8),)]
        own = dict(dm.module.named_parameters())
        assert all(p is own[n] for n, p in program.named_parameters())
        assert "input shapes (this rank): ((2, 16),) as compiled; also compiled on first call: ((2, 8),)" \
            in dm.explain()
        with pytest.raises(ValueError, match=r"input 0: expected this rank's slice of the batch with 2 dims"):
            dm(tok[0])
        with pytest.raises(ValueError, match=r"expected dtype torch.int64"):
            dm(dm.shard_batch(tok).float())
