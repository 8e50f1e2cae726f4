"""Random masks with single-device parity: dropout under any layout draws what one device would.

A dropout mask on one device is ``empty(shape).bernoulli_(1 - p)`` from the default generator
of the device the model runs on, drawn at the whole batch's shape, one draw per dropout site in
the order forward reaches them. autopar reproduces exactly that stream on every rank, then
keeps its own slice:

    before a forward (a pipeline: before a step), every rank draws the mask of every random
    site of the model, in the logical graph's order, at the single-device shape; a site this
    rank runs keeps the slice its layout holds (dp rows, tp / sp shards; a pipeline: one slice
    per micro-batch), the others are drawn and dropped.

One stream per mesh, whatever each rank seeded. At each draw rank 0 of the module's mesh
broadcasts its default generator's state on the device the masks are drawn on (the CPU's is
about 5 KB, a GPU's 16 bytes; one collective on ``Mesh.world_group``, through the flight
recorder, and none for a model without random sites), and every rank draws from a private
generator set to that state. So ranks seeded per rank (``torch.manual_seed(seed + rank)``, the
usual idiom for per-rank data randomness) still agree on every mask, as tensor parallelism
needs: an activation replicated over tp ranks must be dropped alike. A rank whose own default
generator was in rank 0's state is then set to the private generator's end state; a rank
seeded otherwise keeps its own stream untouched (its randomness is the user's). With
``torch.manual_seed(s)`` on every rank, masks are bitwise the slices of the single-device
model's, and the generator leaves the step in the state one device leaves it in; with
per-rank seeds that holds for rank 0, seeded as the single-device model is.

A site inside a recomputed region (``RandomMasks.replayed``) keeps no mask through the step: the
draw notes the private generator's state before it (``local``: the slice's key) and keeps the
mask to its first use (``exact``), and each later use (the recomputation) draws it again from
there, bitwise the same (as Megatron's recomputation restores the RNG state), so recomputation
keeps only what its region saves.

Two modes (``Plan.dropout_rng``). ``exact``: masks bitwise the single-device model's, and
attention with dropout runs the math form (``rng_sdpa``: the probabilities, times the mask,
times v), since a fused kernel draws its own mask. Every rank draws the whole model's masks
(the draw, not the memory: each full mask is freed once sliced), a cost that grows with the
number of ranks a site is split over; ``BENCHMARKS.md`` measures it. ``local``, the scalable
alternative (Megatron's RNG tracker): one number of the agreed stream keys the step, and each
slice is drawn alone from a generator keyed by (that number, the site, the slice's ranges).
Ranks holding the same slice (the tp ranks of a replicated activation) draw one mask, different
slices (shards) independent ones, and a recomputation draws the same again. Attention keeps
torch's fused kernel (flash / memory-efficient on a GPU): ``scaled_dot_product_attention`` with
its ``dropout_p``, run with the device's default generator seeded by the slice's key and
restored after. Training is then statistically, not bitwise, the single-device model's.

Sites: ``aten.dropout`` (the graph node becomes ``rng_dropout``) and dropout inside
``scaled_dot_product_attention`` (``rng_sdpa``). Masks live on the module's device (its index
included: ``cuda:3`` draws from ``cuda:3``'s generator). In eval mode (``dm.eval()``) both are
the identity / attention without dropout, as on one device.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from . import flight

__all__ = ["MaskSite", "LocalSite", "RandomMasks", "draw_masks", "agreed_generator", "local_key", "rng_dropout",
           "rng_sdpa"]


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
    at the start of a step and sets ``microbatch`` before each stage forward. ``mesh``: the
    compiled module's, whose rank 0 gives the stream every rank draws from (None: this
    process's own generator, as one device)."""

    def __init__(self, sites: tuple[MaskSite, ...], local: dict[int, LocalSite], external: bool = False,
                 mode: str = "exact", mesh=None):
        super().__init__()
        self.sites, self.local, self.external, self.mode = tuple(sites), dict(local), external, mode
        self.mesh = mesh
        self.device = torch.device("cpu")     # set by each draw to the module's device
        # (site, micro-batch) -> this rank's mask (booleans); ``local`` attention: the slice's key
        self.masks: dict[tuple[int, int], torch.Tensor | int] = {}
        # sites inside recomputed regions (``passes/recompute.py``): their masks are not held
        # through the step but drawn again where they are used, from what ``draw_masks`` noted
        self.replayed: set[int] = set()
        self.replay: dict[tuple[int, int], tuple] = {}
        self.microbatch = 0

    def extra_repr(self) -> str:
        return f"sites={len(self.sites)}, local={sorted(self.local)}, mode={self.mode}"

    def mask(self, site: int) -> torch.Tensor | int:
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

    def before_forward(self, device: str | torch.device | None = None) -> None:
        """Without a pipeline: draw this forward's masks on ``device`` (the module's; None: as
        the last draw) in training mode only."""
        if self.training and not self.external and self.sites:
            draw_masks(self.sites, [self], microbatches=1, mode=self.mode, mesh=self.mesh,
                       device=device if device is not None else self.device)


def draw_masks(sites, holders: list[RandomMasks], microbatches: int, mode: str = "exact", mesh=None,
               device: str | torch.device | None = None) -> None:
    """Draw one step's masks for ``holders`` on ``device`` (default: the first holder's), from
    the stream of ``mesh``'s rank 0 (``agreed_generator``; every rank of ``mesh`` calls this
    together). ``exact``: every site's single-device mask in order; each holder that runs a
    site keeps its slices (per micro-batch) as booleans, one byte an element (``rng_dropout``
    scales them by 1 / (1 - p) as the single-device kernel does, where they are used).
    ``local``: one number of the CPU stream keys this step; each dropout slice a holder runs is
    drawn alone from a generator seeded by (that number, site, slice), and an attention site
    keeps that key for the fused kernel (``rng_sdpa``)."""
    device = torch.device(device) if device is not None else holders[0].device if holders else torch.device("cpu")
    for h in holders:
        h.masks, h.replay, h.device = {}, {}, device
    if mode == "local":
        with agreed_generator(mesh, torch.device("cpu")) as (g, _):   # a host number: the CPU stream
            step = int(torch.randint(0, 2 ** 62, (1,), generator=g))
        for h in holders:
            for index, local in h.local.items():
                for mb in range(len(local.slices)):
                    if sites[index].kind == "sdpa":
                        h.masks[(index, mb)] = local_key(step, index, local.slices[mb])
                    elif index in h.replayed:
                        h.replay[(index, mb)] = ("local", step)
                    else:
                        h.masks[(index, mb)] = _draw_local(sites[index], local, mb, device, step)
        return
    with agreed_generator(mesh, device) as (g, alike):
        # a rank that keeps its own stream stops after its last site: the rest would advance g only
        last = max((s.index for s in sites if any(s.index in h.local for h in holders)), default=-1)
        for site in sites:
            if site.index > last and not alike:
                break
            users = [h for h in holders if site.index in h.local]
            if not users:   # another rank's site: drawn only to advance the stream alike
                torch.empty(site.numel, dtype=site.dtype, device=device).bernoulli_(1 - site.p, generator=g)
                continue
            state = g.get_state() if any(site.index in h.replayed for h in users) else None
            shape = users[0].local[site.index].shape
            full = torch.empty(shape, dtype=site.dtype, device=device).bernoulli_(1 - site.p, generator=g).bool()
            for h in users:
                local = h.local[site.index]
                for mb in range(len(local.slices)):
                    if site.index in h.replayed:      # kept to its first use only (``mask``)
                        h.replay[(site.index, mb)] = ("exact", state)
                    h.masks[(site.index, mb)] = local.take(full, mb)


@contextlib.contextmanager
def agreed_generator(mesh, device: torch.device):
    """``(generator, alike)``: a private generator on ``device`` in the state of the default
    generator of ``mesh``'s rank 0 there (one broadcast over ``mesh.world_group()``; None, a
    virtual mesh or a one-rank mesh: this rank's own state, nothing communicated), and whether
    this rank's default generator is in that state too. On leaving, an ``alike`` rank's default
    generator takes the private one's end state (the stream one device draws from, advanced as
    one device advances it); any other rank's keeps its own."""
    device = torch.device(device)
    own = _default_generator(device).get_state()
    state = own
    if mesh is not None and not mesh.virtual and mesh.size > 1:
        group = mesh.world_group()
        on = device if dist.get_backend(group) == "nccl" else torch.device("cpu")   # nccl moves GPU tensors only
        buf = own.to(on, copy=True)
        flight.launch(group, "broadcast", f"random state ({device})", buf.numel(), dist.broadcast,
                      buf, 0, group, True).wait()
        state = buf.cpu()
    g = torch.Generator(device=device)
    g.set_state(state)
    alike = state is own or torch.equal(state, own)
    yield g, alike
    if alike:
        _default_generator(device).set_state(g.get_state())


def _default_generator(device: torch.device) -> torch.Generator:
    """The default generator of ``device`` (a GPU's by its index; the current one without)."""
    if device.type == "cuda":
        torch.cuda.init()
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


def local_key(step: int, site: int, ranges) -> int:
    """``local`` mode: the seed of a slice, from the step's number, the site and the slice's
    ``(dim, start, stop)`` ranges (ranks holding the same slice get the same key)."""
    return hash((step, site, tuple(ranges))) & (2 ** 63 - 1)


def _draw_local(site: MaskSite, local: LocalSite, mb: int, device, step: int) -> torch.Tensor:
    """``local`` mode: the slice of micro-batch ``mb`` alone, from a generator keyed by the step's
    number, the site and the slice's ranges."""
    ranges = local.slices[mb]
    shape = list(local.shape)
    for dim, lo, hi in ranges:
        shape[dim] = hi - lo
    g = torch.Generator(device=device).manual_seed(local_key(step, site.index, ranges))
    return torch.empty(shape, dtype=site.dtype, device=device).bernoulli_(1 - site.p, generator=g).bool()


def _redraw(site: MaskSite, local: LocalSite, mb: int, device, how: str, key) -> torch.Tensor:
    """A replayed site's mask, drawn again as ``draw_masks`` drew it: ``exact``, the
    single-device mask from a generator set to the stream's state before that draw (bitwise
    the same draw), then this rank's slice; ``local``, the slice from its key."""
    if how == "local":
        return _draw_local(site, local, mb, device, key)
    g = torch.Generator(device=device)
    g.set_state(key)
    full = torch.empty(local.shape, dtype=site.dtype, device=device).bernoulli_(1 - site.p, generator=g).bool()
    return local.take(full, mb)


def _keyed(device: torch.device, key: int, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` drawing from ``device``'s default generator seeded by ``key``
    (a fused kernel takes no generator of its own); the generator's state is restored after,
    so the draw leaves the user's stream alone. Its backward reuses the forward's mask (a
    fused kernel saves its seed and offset; the math form its mask)."""
    gen = _default_generator(device)
    saved = gen.get_state()
    gen.manual_seed(key)
    try:
        return fn(*args, **kwargs)
    finally:
        gen.set_state(saved)


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
    """``scaled_dot_product_attention`` with attention dropout ``p`` (training). ``exact``: as
    the math kernel computes it, softmax probabilities, times this rank's slice of the
    single-device mask, times v. ``local``: torch's own kernel (fused where the device has one)
    with the device's default generator seeded by the slice's key, and restored after. Eval
    mode: no dropout."""
    if not masks.training:
        return torch.ops.aten.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal, scale=scale,
                                                           enable_gqa=enable_gqa)
    if masks.mode == "local":
        return _keyed(q.device, masks.mask(site), torch.ops.aten.scaled_dot_product_attention, q, k, v, attn_mask,
                      p, is_causal, scale=scale, enable_gqa=enable_gqa)
    # the probabilities alone: an empty value dim makes the kernel's own product free (a tensor
    # of its own, not a view of v: autograd would keep v's whole storage for it)
    empty = v.new_empty((*v.shape[:-1], 0))
    _, probs = torch.ops.aten._scaled_dot_product_attention_math(q, k, empty, attn_mask, 0.0, is_causal,
                                                                 scale=scale, enable_gqa=enable_gqa)
    if enable_gqa and v.shape[-3] != q.shape[-3]:
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    s = masks.sites[site]
    return torch.matmul(_Dropout.apply(probs, masks.mask(site), s.p, s.dtype), v)
