"""Structural tests of the data-parallel passes on toy graphs: what each inserts, where, and with
which layouts (the golden text of whole programs: test_golden.py)."""
import pytest
import torch

import autopar
from autopar import meta
from autopar.runtime.dpsync import dp_bucket_sync, dp_gather, dp_release
from autopar.models import GPTConfig, TinyGPT, TinyMLP, gpt_batch
from autopar.placement import Partial, Replicate, Shard

def _compile(model, inputs, mode, world=2):
    torch.manual_seed(0)
    return autopar.compile(model, autopar.Mesh(dp=world, virtual=True), example_inputs=inputs,
                           plan=autopar.Plan(dp=mode))


def _calls(dm, fn):
    return [n for n in dm.module.graph.nodes if n.op == "call_function" and n.target is fn]


@pytest.mark.parametrize("mode", ["ddp", "zero1", "zero2", "zero3"])
def test_collectives_inserted_per_mode(mode):
    dm = _compile(TinyMLP(), (torch.randn(8, 16),), mode)
    dm.module.graph.lint()
    n_params = 6
    if mode == "zero3":
        gathers, releases = _calls(dm, dp_gather), _calls(dm, dp_release)
        assert len(gathers) == len(releases) == n_params and not _calls(dm, dp_bucket_sync)
        order = list(dm.module.graph.nodes)
        for g in gathers:   # each gather right before its consumer, released right after
            (user,) = [u for u in g.users if u.target is not dp_release]
            assert order.index(g) < order.index(user)
            rel = [u for u in g.users if u.target is dp_release][0]
            assert order.index(rel) == order.index(user) + 1 or order[order.index(rel) - 1].target is dp_release
            assert g.meta[meta.LAYOUT]["dp"] == Replicate() and g.args[0].meta[meta.LAYOUT]["dp"] == Shard(0)
    else:
        (s,) = _calls(dm, dp_bucket_sync)      # 6 small parameters: one bucket
        assert not _calls(dm, dp_gather)
        assert s.meta[meta.COMM].kind == ("all_reduce" if mode == "ddp" else "reduce_scatter")
        assert s.meta[meta.COMM].phase == "backward"
        sync, k, values, owners = s.args
        assert k == 0 and len(values) == n_params
        if mode == "ddp":
            assert [v.target for v in values] == dm.ctx.grad_buckets[0] and owners == []
        else:   # forward reads the full replicas, the gradients go to the shards
            assert all(v.target.startswith("replicas.") for v in values)
            assert [o.target for o in owners] == dm.ctx.grad_buckets[0]
        assert len(s.users) == n_params    # one getitem per parameter feeds its consumers


def test_layouts_follow_the_batch_shard_through_the_gpt():
    c = GPTConfig()
    tok, _ = gpt_batch(c, 4)
    dm = _compile(TinyGPT(c), (tok,), "zero3")
    lay = {n.name: n.meta.get(meta.LAYOUT) for n in dm.module.graph.nodes}
    assert lay["idx"]["dp"] == Shard(0)
    assert lay["arange"]["dp"] == Replicate()             # positions: same on every rank
    assert lay["embedding_1"]["dp"] == Replicate()
    assert lay["add"]["dp"] == Shard(0)                    # broadcast add meets the batch shard
    assert lay["transpose"]["dp"] == Shard(0)              # heads moved, batch stays dim 0
    assert lay["scaled_dot_product_attention"]["dp"] == Shard(0)
    for n in dm.module.graph.nodes:
        if n.op == "call_function" and isinstance(n.meta.get(meta.VAL), torch.Tensor):
            assert n.meta.get(meta.LAYOUT) is not None, n.name


def test_loss_inside_the_model_is_partial():
    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x, y):
            return torch.nn.functional.cross_entropy(self.lin(x).transpose(0, 1).t(), y)

    dm = _compile(WithLoss(), (torch.randn(8, 4), torch.randint(0, 3, (8,))), "ddp")
    out = [n for n in dm.module.graph.nodes if n.op == "output"][0].args[0][0]
    assert out.meta[meta.LAYOUT]["dp"] == Partial("avg")


def test_buckets_reverse_first_use_and_respect_the_size_cap():
    torch.manual_seed(0)
    dm = autopar.compile(TinyMLP(), autopar.Mesh(dp=2, virtual=True), example_inputs=(torch.randn(8, 16),),
                         plan=autopar.Plan(dp="zero2", bucket_bytes=1024))
    buckets = dm.ctx.grad_buckets
    flat = [n for b in buckets for n in b]
    assert flat == ["fc3.bias", "fc3.weight", "fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"]
    assert buckets[0] == ["fc3.bias", "fc3.weight", "fc2.bias"]      # 64 + 448 + 32 B padded, < 1 KiB


def test_emission_for_a_large_virtual_world():
    """256 ranks, no processes: rank 255's shards of the GPT, its units and their bytes."""
    c = GPTConfig(vocab=1000, dim=64, heads=4, layers=3, seq=16)
    tok, _ = gpt_batch(c, 512)
    mesh = autopar.Mesh(dp=256, virtual=True, rank=255)
    dm = autopar.compile(TinyGPT(c), mesh, example_inputs=(tok,), plan=autopar.Plan(dp="zero3"))
    shard = dm.module.get_parameter("wte.weight")       # 1000 rows: 4 per rank, rank 250+ hold none
    assert tuple(shard.shape) == (0, 64)
    assert tuple(dm.module.get_parameter("blocks.0.qkv.weight").shape) == (0, 64)   # 192 rows
    assert dm.ctx.input_shapes[0] == (2, 16)           # 512 sequences over 256 ranks
    units = dm.ctx.gather_units
    assert [u[0] for u in units] == ["wte.weight", "blocks.0.ln1.weight", "blocks.1.ln1.weight",
                                     "blocks.2.ln1.weight"]
    first = [n for n in dm.module.graph.nodes if n.op == "call_function" and n.target is dp_gather][0]
    root = sum(dm._sync.specs[n].padded_numel * 4 for n in units[0])
    assert first.meta[meta.COMM].nbytes == root * 255 / 256
