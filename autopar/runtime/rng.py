"""Random masks with single-device parity: dropout under any layout draws what one device would.

A dropout mask on one device is ``empty(shape).bernoulli_(1 - p)`` from the default generator,
drawn at the whole batch's shape, one draw per dropout site in the order forward reaches
them. autopar reproduces exactly that stream on every rank, then keeps its own slice:

    before a forward (a pipeline: before a step), every rank draws the mask of every random
    site of the model, in the logical graph's order, at the single-device shape; a site this
    rank runs keeps the slice its layout holds (dp rows, tp / sp shards; a pipeline: one slice
    per micro-batch), the others are drawn and dropped.

So ``torch.manual_seed(s)`` on every rank is all a user does: masks are bitwise the slices of
the single-device model's, and the generator leaves the step in the state one device leaves
it in. A site inside a recomputed region (``RandomMasks.replayed``) keeps no mask through the
step: the draw notes the generator's state before it (``local``: the step's number) and keeps
the mask to its first use (``exact``), and each later use (the recomputation) draws it again
from there, bitwise the same (as Megatron's recomputation restores
the RNG state), so recomputation keeps only what its region saves. The price is that every rank draws the whole model's masks (the draw, not the memory:
each full mask is freed once sliced), a cost that grows with the number of ranks a site is
split over; ``BENCHMARKS.md`` measures it. ``Plan(dropout_rng="local")`` is the scalable
alternative: each rank draws only its slice, from a generator keyed by one number of the
default generator per step, the site and the slice's ranges (ranks holding the same slice,
as the tp ranks of a replicated activation do, draw the same mask; different slices draw
independent ones). It cannot reproduce the single-device stream: training is statistically,
not bitwise, the single-device model's.

Sites: ``aten.dropout`` (the graph node becomes ``rng_dropout``) and dropout inside
``scaled_dot_product_attention`` (``rng_sdpa``: the probabilities from the math kernel, the
mask applied to them, then the product with v, the order the kernel itself runs). In eval
mode (``dm.eval()``) both are the identity / attention without dropout, as on one device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["MaskSite", "LocalSite", "RandomMasks", "draw_masks", "rng_dropout", "rng_sdpa"]


@dataclass(frozen=True)
class MaskSite:
    """One random draw of the single-device forward: site ``index`` in forward order."""
    index: int
    kind: str              # "dropout" | "sdpa"
    p: float               # drop probability
    numel: int             # elements of the single-device mask (the whole batch)
    dtype: torch.dtype


@dataclass(frozen=True)
class LocalSite:
    """What this rank keeps of a site it runs: the single-device mask's shape, and per
    micro-batch the ``(dim, start, stop)`` ranges of its slice (one entry without a pipeline)."""
    shape: tuple[int, ...]
    slices: tuple[tuple[tuple[int, int, int], ...], ...]

    def take(self, full: torch.Tensor, mb: int) -> torch.Tensor:
        out = full
        for dim, lo, hi in self.slices[mb]:
            out = out.narrow(dim, lo, hi - lo)
        return out if out.data_ptr() == full.data_ptr() and out.shape == full.shape else out.clone()


class RandomMasks(nn.Module):
    """The masks of one compiled graph (a submodule of the emitted module, so ``dm.train()`` /
    ``dm.eval()`` switch it). ``sites`` lists every random site of the whole model in draw
    order; ``local`` those this graph runs. ``external``: a pipeline draws for all its stages
    at the start of a step and sets ``microbatch`` before each stage forward."""

    def __init__(self, sites: tuple[MaskSite, ...], local: dict[int, LocalSite], external: bool = False,
                 mode: str = "exact", device: str | torch.device = "cpu"):
        super().__init__()
        self.sites, self.local, self.external, self.mode = tuple(sites), dict(local), external, mode
        self.device = torch.device(device)    # masks are drawn by this device's generator, as one device draws them
        self.masks: dict[tuple[int, int], torch.Tensor] = {}
        # sites inside recomputed regions (``passes/recompute.py``): their masks are not held
        # through the step but drawn again where they are used, from what ``draw_masks`` noted
        self.replayed: set[int] = set()
        self.replay: dict[tuple[int, int], tuple] = {}
        self.microbatch = 0

    def extra_repr(self) -> str:
        return f"sites={len(self.sites)}, local={sorted(self.local)}"

    def mask(self, site: int) -> torch.Tensor:
        key = (site, self.microbatch)
        if key in self.replay:      # a recomputed region's: the draw's own until its first use, then drawn again
            got = self.masks.pop(key, None)
            return got if got is not None else _redraw(self.sites[site], self.local[site], key[1], self.device,
                                                       *self.replay[key])
        try:
            return self.masks[key]
        except KeyError:
            raise RuntimeError(
                f"random site {site} has no mask for micro-batch {self.microbatch}: masks are drawn "
                "by DistributedModule.forward (or a pipeline's train_step) in training mode; a "
                "compiled graph called directly skips the draw") from None

    def before_forward(self) -> None:
        """Without a pipeline: draw this forward's masks (training mode only)."""
        if self.training and not self.external and self.sites:
            draw_masks(self.sites, [self], microbatches=1, mode=self.mode)


def draw_masks(sites, holders: list[RandomMasks], microbatches: int, mode: str = "exact") -> None:
    """``exact``: draw every site's single-device mask in order; each holder that runs a site
    keeps its slices (per micro-batch) as booleans, one byte an element (``rng_dropout``
    scales them by 1 / (1 - p) as the single-device kernel does, where they are used). ``local``: one number from the default generator keys this step; each slice a
    holder runs is drawn alone from a generator seeded by (that number, site, slice)."""
    for h in holders:
        h.masks, h.replay = {}, {}
    device = holders[0].device if holders else torch.device("cpu")
    if mode == "local":
        step = int(torch.randint(0, 2 ** 62, (1,), device="cpu"))   # a host number: the CPU generator
        for h in holders:
            for index, local in h.local.items():
                for mb in range(len(local.slices)):
                    if index in h.replayed:
                        h.replay[(index, mb)] = ("local", step)
                    else:
                        h.masks[(index, mb)] = _draw_local(sites[index], local, mb, device, step)
        return
    for site in sites:
        users = [h for h in holders if site.index in h.local]
        if not users:   # another rank's site: drawn only to advance the generator alike
            torch.empty(site.numel, dtype=site.dtype, device=device).bernoulli_(1 - site.p)
            continue
        state = _generator_state(device) if any(site.index in h.replayed for h in users) else None
        shape = users[0].local[site.index].shape
        full = torch.empty(shape, dtype=site.dtype, device=device).bernoulli_(1 - site.p).bool()
        for h in users:
            local = h.local[site.index]
            for mb in range(len(local.slices)):
                if site.index in h.replayed:      # kept to its first use only (``mask``)
                    h.replay[(site.index, mb)] = ("exact", state)
                h.masks[(site.index, mb)] = local.take(full, mb)


def _draw_local(site: MaskSite, local: LocalSite, mb: int, device, step: int) -> torch.Tensor:
    """``local`` mode: the slice of micro-batch ``mb`` alone, from a generator keyed by the step's
    number, the site and the slice's ranges."""
    ranges = local.slices[mb]
    shape = list(local.shape)
    for dim, lo, hi in ranges:
        shape[dim] = hi - lo
    g = torch.Generator(device=device).manual_seed(hash((step, site.index, ranges)) & (2 ** 63 - 1))
    return torch.empty(shape, dtype=site.dtype, device=device).bernoulli_(1 - site.p, generator=g).bool()


def _generator_state(device: torch.device) -> torch.Tensor:
    """The default generator's state on ``device`` (where ``draw_masks`` draws)."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _redraw(site: MaskSite, local: LocalSite, mb: int, device, how: str, key) -> torch.Tensor:
    """A replayed site's mask, drawn again as ``draw_masks`` drew it: ``exact``, the
    single-device mask from a generator set to the default one's state before that draw
    (bitwise the same draw), then this rank's slice; ``local``, the slice from its key."""
    if how == "local":
        return _draw_local(site, local, mb, device, key)
    g = torch.Generator(device=device)
    g.set_state(key)
    full = torch.empty(local.shape, dtype=site.dtype, device=device).bernoulli_(1 - site.p, generator=g).bool()
    return local.take(full, mb)


class _Dropout(torch.autograd.Function):
    """``x`` times the kept elements scaled by 1 / (1 - p), as the single-device kernel
    computes it (the mask in the site's dtype, divided, times ``x``: bitwise its result);
    backward saves the mask as it is kept, one byte an element, not the scaled copy."""

    @staticmethod
    def forward(ctx, x, mask, p, dtype):
        ctx.save_for_backward(mask)
        ctx.p, ctx.dtype = p, dtype
        return x * _scaled(mask, p, dtype)

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        return g * _scaled(mask, ctx.p, ctx.dtype), None, None, None


def _scaled(mask: torch.Tensor, p: float, dtype: torch.dtype) -> torch.Tensor:
    return mask.to(dtype).div_(1 - p)


def rng_dropout(x: torch.Tensor, masks: RandomMasks, site: int) -> torch.Tensor:
    """``aten.dropout(x, p, train=True)`` with this rank's slice of the single-device mask; the
    identity in eval mode."""
    if not masks.training:
        return x
    s = masks.sites[site]
    return _Dropout.apply(x, masks.mask(site), s.p, s.dtype)


def rng_sdpa(q, k, v, attn_mask, masks: RandomMasks, site: int, p: float, is_causal: bool = False,
             scale=None, enable_gqa: bool = False):
    """``scaled_dot_product_attention`` with attention dropout ``p`` (training) as the math
    kernel computes it: softmax probabilities, times the mask, times v. Eval mode: no dropout."""
    if not masks.training:
        return torch.ops.aten.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal, scale=scale,
                                                           enable_gqa=enable_gqa)
    # the probabilities alone: an empty value dim makes the kernel's own product free (a tensor
    # of its own, not a view of v: autograd would keep v's whole storage for it)
    empty = v.new_empty((*v.shape[:-1], 0))
    _, probs = torch.ops.aten._scaled_dot_product_attention_math(q, k, empty, attn_mask, 0.0, is_causal,
                                                                 scale=scale, enable_gqa=enable_gqa)
    if enable_gqa and v.shape[-3] != q.shape[-3]:
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    s = masks.sites[site]
    return torch.matmul(_Dropout.apply(probs, masks.mask(site), s.p, s.dtype), v)
