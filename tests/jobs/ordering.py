"""The issue order of real steps, for the NCCL ordering replay (tests/test_nccl_order.py): each
job compiles a small model, runs steps inside ``flight.recording()`` and returns the entries it
issued as data, as a rank of a process pool or as one fake rank after another in one process
(``fake_orders``: torch's fake process group moves no data, so the runtime runs its real code,
transfers and waits included, for a world of any size; not being gloo, it takes the pipeline's
one pp group, as NCCL does)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import autopar
from autopar.models import GPTConfig, TinyGPT, gpt_batch, lm_loss
from autopar.runtime import flight
from autopar.runtime.collmatmul import all_gather_matmul, matmul_reduce_scatter
from autopar.runtime.comm import AxisComm, CommStats
from autopar.testing import fake_rank, quiet

CONFIG = GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=4, max_seq=8)


class TiedMLP(torch.nn.Module):
    """``layers`` square linear layers with tanh, the first and the last sharing their weight
    (as a tied embedding and head: the pipeline sums its gradients over the two stages)."""

    def __init__(self, layers: int, d: int = 8):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(layers))
        self.layers[-1].weight = self.layers[0].weight

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def mse(out, target):
    return ((out - target) ** 2).mean()


def _example(model: str, axes: dict, plan: dict):
    """(module, inputs, targets, loss) of ``model`` ("mlp": ``TiedMLP``; "gpt": TinyGPT, for tp),
    with a layer per stage and two more, and two samples per micro-batch on each dp rank."""
    stages = axes.get("pp", 1) * plan.get("virtual_stages", 1)
    batch = 2 * plan.get("microbatches", 1) * axes.get("dp", 1)
    if model == "mlp":
        g = torch.Generator().manual_seed(0)
        return (TiedMLP(stages + 2), torch.randn(batch, 8, generator=g), torch.randn(batch, 8, generator=g), mse)
    c = GPTConfig(vocab=CONFIG.vocab, seq=CONFIG.seq, dim=CONFIG.dim, heads=CONFIG.heads,
                  layers=max(CONFIG.layers, stages + 2), max_seq=CONFIG.max_seq)
    x, t = gpt_batch(c, batch)
    return TinyGPT(c), x, t, lm_loss


def step_order(model: str, axes: dict, plan: dict, eval_step: bool = True) -> list[dict]:
    """This rank's entries, in issue order, over one ``train_step`` and, with ``eval_step``, one
    ``eval_step`` of ``model`` (see ``_example``; tied weights: their gradients exchanged after
    the schedule) on a mesh of ``axes`` under ``autopar.Plan(**plan)``."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    module, x, t, loss = _example(model, axes, plan)
    with quiet():
        dm = autopar.compile(module, autopar.Mesh(**axes), example_inputs=(x,), plan=autopar.Plan(**plan))
    lx, lt = dm.shard_batch((x,)), dm.shard_batch(t)
    with flight.recording() as tape:
        dm.train_step(lx, lt, loss)
        if eval_step:
            dm.eval_step(lx, lt, loss)
    return [e.as_dict() for e in tape]


def fake_orders(model: str, axes: dict, plan: dict, eval_step: bool = True) -> dict[int, list[dict]]:
    """``step_order`` of every rank of the mesh, each run as that rank of torch's fake process
    group, one after another in this process."""
    world = 1
    for n in axes.values():
        world *= n
    orders = {}
    for rank in range(world):
        with fake_rank(world, rank):
            orders[rank] = step_order(model, axes, plan, eval_step)
    return orders


def ring_order(tp: int) -> list[dict]:
    """This rank's entries over both collective matmuls, forward and backward, on a tp group of
    every rank (sequence-sharded input, as the plan's collective matmul feeds them)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    group = dist.new_group(list(range(dist.get_world_size())), group_desc="tp")
    comm = AxisComm("tp", tp, dist.get_rank(), group, CommStats())
    x = torch.randn(2, 4, 8, requires_grad=True)              # this rank's shard of 4 * tp positions
    w1 = torch.randn(6, 8, requires_grad=True)
    w2 = torch.randn(8, 6, requires_grad=True)
    with flight.recording() as tape:
        h = all_gather_matmul(x, w1, None, comm, 1, size=4 * tp)
        y = matmul_reduce_scatter(h, w2, None, comm, 1)
        y.sum().backward()
    return [e.as_dict() for e in tape]


def fake_ring_orders(tp: int) -> dict[int, list[dict]]:
    """``ring_order`` of every rank of a tp group of ``tp``, as fake ranks one after another."""
    orders = {}
    for rank in range(tp):
        with fake_rank(tp, rank):
            orders[rank] = ring_order(tp)
    return orders
