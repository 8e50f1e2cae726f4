"""Activation recomputation at run time: a region of the forward graph that keeps only its inputs.

The recompute pass (``passes/recompute.py``) makes each region one ``call_module`` node whose
module is a ``Recomputed``: forward runs the region without recording an autograd graph and
saves nothing but its tensor inputs; backward runs the region again, with gradients, from
those inputs and back-propagates through it (torch's reentrant checkpoint, applied to a piece
of the captured graph instead of a module of the model).

What the region's inputs are decides what stays in memory: a whole layer keeps the layer's
input (and references to its parameters), the attention core keeps q, k, v. Saving goes
through ``ctx.save_for_backward``, so the saved-tensor hooks of the step apply: under ZeRO-3
the gathered parameters a region takes are saved as re-gather tokens, and backward gathers
each unit once, for the recomputation and its gradients alike.

Dropout in a region reads this forward's masks (``RandomMasks``): a region notes the masks
(the region's own sites are replayed: drawn again from the generator state noted before
their draw, not held through the step) and micro-batch it ran with and replays with the same
ones, so the recomputation is bitwise the forward it repeats (a pipeline's backward runs while another
micro-batch is current; a second forward before this backward has drawn new masks). Under
sequence parallelism the recomputation saves column inputs as sequence shards, gathered
again by their backward, as forward does (``tpcomm.SavedRegather``).
"""
from __future__ import annotations

from contextlib import ExitStack

import torch
from torch import fx, nn

from .rng import RandomMasks

__all__ = ["Recomputed"]


class Recomputed(nn.Module):
    """One region of the forward graph, recomputed in backward. ``layer``: the numbered layer it
    belongs to; ``kind``: ``"full"`` (the layer) or ``"selective"`` (its attention core)."""

    def __init__(self, region: fx.GraphModule, layer: str, kind: str):
        super().__init__()
        self.region, self.layer, self.kind = region, layer, kind
        self.recomputes = 0          # backward recomputations run (tests and explain)

    def extra_repr(self) -> str:
        return f"layer={self.layer!r}, kind={self.kind!r}"

    def forward(self, *args):
        if not torch.is_grad_enabled() or not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return self.region(*args)      # nothing to differentiate: no backward to recompute for
        return _Recompute.apply(self, *args)


class _Recompute(torch.autograd.Function):
    """forward: the region without autograd, its tensor inputs saved / backward: the region
    again from them, with gradients, then its backward."""

    @staticmethod
    def forward(ctx, holder: Recomputed, *args):
        ctx.holder = holder
        ctx.tensor_at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_at))
        # the masks as they are (a replayed site's own mask is not kept: it is drawn again)
        ctx.masks = [(m, ({k: v for k, v in m.masks.items() if k not in m.replay}, dict(m.replay)), m.microbatch)
                     for m in args if isinstance(m, RandomMasks)]
        out = holder.region(*args)
        return tuple(out) if isinstance(out, (tuple, list)) else out

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved_tensors     # ZeRO-3: the region's unit is gathered again here, once
        args = list(ctx.others)
        for i, t in zip(ctx.tensor_at, saved):
            x = t.detach()
            x.requires_grad_(ctx.needs_input_grad[i + 1] and x.is_floating_point())
            args[i] = x
        replay = [(m, (m.masks, m.replay), m.microbatch) for m, _, _ in ctx.masks]
        try:
            for m, (masks, again), mb in ctx.masks:
                m.masks, m.replay, m.microbatch = masks, again, mb
            with torch.enable_grad(), ExitStack() as scopes:
                for a in ctx.others:   # sequence parallelism: column inputs saved as shards, as in forward
                    if getattr(a, "regather", None) is not None:
                        scopes.enter_context(a.regather.scope())
                out = ctx.holder.region(*args)
        finally:
            for m, (masks, again), mb in replay:
                m.masks, m.replay, m.microbatch = masks, again, mb
        ctx.holder.recomputes += 1
        outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None,) + tuple(a.grad if isinstance(a, torch.Tensor) and a.requires_grad else None for a in args)
