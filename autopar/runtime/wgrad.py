"""Backward split into B (input gradient) and W (weight gradient) for zero-bubble schedules.

A zero-bubble schedule runs a stage's backward in two actions: B computes the gradient of
the stage's input (what the previous stage waits for) and W, later, the gradients of the
weights, filling what would otherwise be bubble. The weight_split pass
(``passes/weight_split.py``) rewrites the matmuls that read a parameter to ``wsplit_matmul``:
during B its backward returns the input gradient only and leaves (x, g) in the module's
``WeightGradStash``; W computes gᵀx and pushes it into the weight's own autograd path
(through the data-parallel reducer or the tensor-parallel layout, exactly as a normal
backward would) with ``torch.autograd.backward`` on the weight's gradient edge.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

__all__ = ["WeightGradStash", "wsplit_matmul"]


class WeightGradStash(nn.Module):
    """Deferred weight-gradient work per micro-batch; ``deferring`` is on during B."""

    def __init__(self):
        super().__init__()
        self.deferring = False
        self.mb = 0
        self._work: dict[int, list] = defaultdict(list)

    def push(self, item) -> None:
        self._work[self.mb].append(item)

    def run(self, mb: int) -> None:
        """W of micro-batch ``mb``: every deferred weight gradient, into its autograd path."""
        items = self._work.pop(mb, [])
        edges, grads = [], []
        with torch.no_grad():
            for x, g, w_edge, b_edge, transposed in items:
                x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
                if w_edge is not None:
                    edges.append(w_edge)
                    grads.append(g2.t() @ x2 if transposed else x2.t() @ g2)
                if b_edge is not None:
                    edges.append(b_edge)
                    grads.append(g2.sum(0))
        if edges:
            torch.autograd.backward(edges, grads, retain_graph=True)


def _edge(t):
    return get_gradient_edge(t) if isinstance(t, torch.Tensor) and t.requires_grad else None


class _WSplitMatmul(torch.autograd.Function):
    """forward: x @ wᵀ + b (``transposed``) or x @ w + b / backward: the input gradient now;
    the weight and bias gradients now, or later from the stash while it is deferring."""

    @staticmethod
    def forward(ctx, x, w, b, stash, transposed):
        y = torch.nn.functional.linear(x, w, b) if transposed else torch.matmul(x, w)
        if b is not None and not transposed:
            y = y + b
        ctx.save_for_backward(x, w)
        ctx.stash, ctx.transposed = stash, transposed
        ctx.w_edge, ctx.b_edge = _edge(w), _edge(b)
        ctx.has_bias = b is not None
        return y

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = (g @ w if ctx.transposed else g @ w.t()) if ctx.needs_input_grad[0] else None
        if ctx.stash.deferring:
            ctx.stash.push((x.detach(), g.detach(), ctx.w_edge, ctx.b_edge, ctx.transposed))
            return gx, None, None, None, None
        x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
        gw = (g2.t() @ x2 if ctx.transposed else x2.t() @ g2) if ctx.needs_input_grad[1] else None
        gb = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None, None


def wsplit_matmul(x, w, b, stash, transposed: bool):
    return _WSplitMatmul.apply(x, w, b, stash, transposed)
