"""The probes' synthetic workload: a stack of blocks of linear layers with pointwise ops
between them (``Stack``), the sizes the contention probe loops it at and those the runtime
probes compile it at, and its forward + backward timed in a loop (``stack_seconds``)."""
from __future__ import annotations

import time

import torch

__all__ = ["Block", "Stack", "stack_seconds", "STACK_DIM", "STACK_BLOCKS", "STACK_ROWS", "SYNC_DIM", "SYNC_ROWS",
           "SYNC_BLOCKS", "TENSORS_PER_BLOCK"]

STACK_DIM, STACK_BLOCKS, STACK_ROWS = 96, 4, 128     # the contention probe's stack
SYNC_DIM, SYNC_ROWS, SYNC_BLOCKS = 8, 4, (2, 8)      # the dp runtime probe's stacks (rows a rank), and their depths
TENSORS_PER_BLOCK = 12


class Block(torch.nn.Module):
    """Two residual halves of (LayerNorm, Linear d -> 2d, GeLU, Linear 2d -> d): 12 parameter
    tensors, as many as a transformer layer has."""

    def __init__(self, dim: int):
        super().__init__()
        self.halves = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(dim), torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(),
                                torch.nn.Linear(2 * dim, dim)) for _ in range(2))

    def forward(self, x):
        for half in self.halves:
            x = x + half(x)
        return x


class Stack(torch.nn.Module):
    """The probes' synthetic workload: ``blocks`` of ``Block`` on rows of width ``dim``, matmuls
    with pointwise ops between them; no attention, no embedding: none of the models the cost
    model's predictions are checked on."""

    def __init__(self, dim: int, blocks: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(dim) for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def stack_seconds(seconds: float, start=None) -> float:
    """Seconds per forward + backward of the contention probe's stack (``STACK_BLOCKS`` blocks,
    d = ``STACK_DIM``, ``STACK_ROWS`` rows), looped for about ``seconds`` after 5 untimed ones
    (and after ``start()``, where given: the ranks' barrier)."""
    torch.manual_seed(0)
    model = Stack(STACK_DIM, STACK_BLOCKS)
    x = torch.randn(STACK_ROWS, STACK_DIM)

    def fb():
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    for _ in range(5):
        fb()
    if start is not None:
        start()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fb()
        n += 1
    return (time.perf_counter() - t0) / n
