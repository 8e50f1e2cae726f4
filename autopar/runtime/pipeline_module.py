"""The pipeline runtime: this rank's stages and the schedule that drives them.

``PipelineModule.train_step(inputs, targets, loss_fn)`` splits this rank's data-parallel
slice into ``plan.microbatches`` micro-batches and executes the rank's lowered action list
(``autopar.schedule``): F runs a stage on a micro-batch, B its backward (the input gradient
only when the schedule splits backward), W the deferred weight gradients, and SEND/RECV move
activations and their gradients point to point, asynchronously (one tag per (kind, stage,
micro-batch, value), so messages never pair up wrongly). Each micro-batch's loss is scaled by
1/m, so the accumulated gradients are those of the mean loss over the slice.

The transfers are posted in batches (``flight.batch``, ``dist.batch_isend_irecv``), at the
places ``schedule.batch_transfers`` gives: every message is posted at the same point of the
schedule's event-time replay on both sides, so that on NCCL, where a rank's transfers run on
one stream in issue order and each waits for its counterpart, none waits behind a transfer
whose counterpart waits for it (``autopar.runtime.ordering`` replays the order by NCCL's
rules). ``eval_step`` runs its forward-only order the same way, and the tied gradients go in
one batch. On gloo the transfers to a lower rank go over a second group of the pp ranks
(``pp:down``), so that the two directions between two ranks never share a connection
(``_p2p_group``: crossing transfers wait on each other on one gloo connection); on NCCL one
group carries both, in the same order, and two groups only take order away, so the gloo order
is NCCL's with the two groups apart.

Each stage is an ordinary compiled module (dp and tp inside it, as without a pipeline); its
data-parallel gradient reduction is deferred to the end of the step (accumulated over the
micro-batches, as DDP's ``no_sync``), then run once. A parameter held by two stages (tied
embedding and LM head) gets the sum of both stages' gradients.
"""
from __future__ import annotations

import contextlib
import math
import weakref
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from ..meta import RNG, STASH
from ..schedule import Action, Schedule, batch_transfers, lower, simulate
from ..trace import ChromeTrace
from . import flight
from .comm import CommStats, TracedWork
from .module import (CompiledModule, DistributedModule, byte_buckets, cast_inputs, cast_outputs, describe_call,
                     has_loss, model_loss, sum_dtype, post_step_errors, refuse_per_tensor_offload, slice_batch)
from .optim import built_here, check_optimizer
from .rng import draw_masks
from .timing import Spans, now

__all__ = ["PipelineModule", "NCCL_MERGE"]

# The group the runtime makes on gloo alone (``_p2p_group``), mapped to the one its transfers
# take on NCCL: ``ordering.replay(orders, merge=NCCL_MERGE)`` replays a gloo run's order as NCCL's.
NCCL_MERGE = {"pp:down": "pp"}


class PipelineModule(CompiledModule):
    """This rank's pipeline stages (``stages["<k>"]``, each a compiled ``DistributedModule``)."""

    def __init__(self, stages: dict[int, DistributedModule], ctx, schedule: Schedule,
                 stats: CommStats):
        super().__init__(ctx, stats)     # stats: shared with the stages (dp, tp and pp bytes of this rank)
        self.schedule = schedule
        self.stages = nn.ModuleDict({str(k): m for k, m in sorted(stages.items())})
        for st in self.stages.values():
            st.output_boundary = False      # a stage's outputs go on to the next (cast_outputs: the last's, here)
        self.p, self.pp_index = self.mesh.axis_size("pp"), self.mesh.coordinate("pp")
        self._pp_group = self.mesh.group("pp") if "pp" in self.mesh.axes else None
        self._pp_down = self._pp_group       # the group of the transfers to a lower rank: see _p2p_group
        if self._pp_group is not None and self.p > 1 and dist.get_backend(self._pp_group) == "gloo":
            self._pp_down = self.mesh.group("pp", "down")
        names = list(self.mesh.axes)
        self._pp_stride = math.prod(list(self.mesh.axes.values())[names.index("pp") + 1:]) if "pp" in names else 1
        lowered = lower(schedule)
        self._position = [{a: i for i, a in enumerate(acts)} for acts in lowered]   # per pp rank: action -> index
        self._steps = batch_transfers(schedule, lowered)[self.pp_index]      # compute actions and batches
        self._eval_steps = batch_transfers(_forward_only(schedule))[self.pp_index]
        self._holders = {}   # parameter -> stages holding it
        for spec in ctx.stages:
            for name in spec.held:
                self._holders.setdefault(name, []).append(spec.index)
        self.timeline: list[tuple[str, float, float]] = []   # last step: (action, start, end), wall clock
        self._no_sync = False
        # (CompiledModule's variants and _programs: micro-batch shapes -> the PipelineModule compiled for them)

    # ---- addressing ----------------------------------------------------------------------
    def _rank_of_stage(self, stage: int) -> int:
        return self.mesh.rank + (stage % self.p - self.pp_index) * self._pp_stride

    def _p2p_group(self, src: int, dst: int):
        """The group a transfer from global rank ``src`` to ``dst`` goes over: on gloo, the pp
        group to a higher rank and a second group over the same ranks (``pp:down``) to a lower
        one, so that the two directions between two ranks never share a connection. On one gloo
        pair, transfers that cross (1F1B's steady state: a stage's activations out while its
        next stage's gradients come back; the tied gradients' exchange) wait on each other:
        on 2 processes, 24 KB each way at once after 5 ms of compute took 2.69 ms (median of
        60; the send call itself up to 7 ms) on one group and 0.29 ms over the two, as long as
        one way (benchmarks/gloo_crossing.py; BENCHMARKS.md). NCCL keeps one group: its
        transfers are ordered by ``batch_transfers`` so that none waits behind another."""
        return self._pp_group if src < dst else self._pp_down

    def _tag(self, kind: int, stage: int, mb: int, j: int) -> int:
        if j >= 64:
            raise NotImplementedError(f"stage {stage} exchanges more than 64 tensors per micro-batch; "
                                      "autopar's message tags allow 64: cut the model elsewhere")
        return ((kind * self.schedule.n_stages + stage) * self.schedule.m + mb) * 64 + j

    # ---- the step --------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipelined module runs whole training steps: call dm.train_step(inputs, "
                           "targets, loss_fn) (forward and backward over the micro-batches), then "
                           "the optimizer step")

    def _inputs(self, inputs: tuple, kwargs, m: int):
        """The call's leaves per micro-batch, checked against the captured call's structure."""
        flat, spec = self._split(cast_inputs((inputs, dict(kwargs or {})), self.ctx.plan.param_dtype), m)
        if spec != self.ctx.in_spec:
            raise TypeError(f"the pipeline was captured with {describe_call(self.ctx.in_spec)}, but train_step got "
                            f"{describe_call(spec)}; pass the inputs as the example inputs were given (positional "
                            "ones in inputs=, keyword ones in kwargs=, same names)")
        return flat, spec

    @staticmethod
    def _loss(result, target_leaves, t_spec, loss_fn):
        """A micro-batch's loss: ``loss_fn(output, target)`` (``target`` None when no targets were
        given, as a module's ``loss_fn(dm(x), None)``), or the model's own."""
        if loss_fn is not None:
            return loss_fn(result, None if t_spec is None else pytree.tree_unflatten(target_leaves, t_spec))
        return model_loss(result)

    def _split(self, tree, m: int):
        if tree is None:
            return None, None
        leaves, spec = pytree.tree_flatten(tree)
        parts = []
        for i in range(m):
            parts.append([slice_batch(x, m, i, "microbatches") if isinstance(x, torch.Tensor) and x.dim() else x
                          for x in leaves])
        return parts, spec

    @flight.published("train_step")
    def train_step(self, inputs=(), targets=None, loss_fn=None, *, kwargs=None):
        """One step over this rank's data-parallel slice: forward and backward of every
        micro-batch by the schedule; gradients reduced over dp and summed over tied copies.
        Returns the mean loss over the slice (on every rank of the pipeline).

        ``inputs`` (and ``kwargs``) are called as the example inputs were. The loss of a
        micro-batch is ``loss_fn(output, targets)``; without ``loss_fn`` it is the model's own
        (a Hugging Face model called with ``labels=``: ``output.loss``; or a scalar output)."""
        if not isinstance(inputs, tuple):
            inputs = (inputs,)
        m = self.schedule.m
        flat_in, _ = self._inputs(inputs, kwargs, m)
        other = self._other_shape(flat_in[0], inputs, kwargs)
        if other is not None:
            with other.no_sync() if self._no_sync else contextlib.nullcontext():   # accumulating as this one is
                loss = other.train_step(inputs, targets, loss_fn, kwargs=kwargs)
            self.step_time, self.timeline = other.step_time, other.timeline
            return loss
        flat_t, t_spec = self._split(targets, m)
        if self.training and self.ctx.rng_sites:   # every site's mask, in the single-device order
            draw_masks(self.ctx.rng_sites, self._mask_holders(), microbatches=m, mode=self.plan.dropout_rng,
                       mesh=self.mesh, device=self._device())
        state = _StepState()
        for st in self.stages.values():
            st.sync.defer = True
        start = now(self._device(), wall=True)
        self.timeline, state.spans = [], Spans(self._device())
        try:
            for step in self._steps:
                if isinstance(step, Action):
                    self._run(step, state, flat_in, flat_t, t_spec, loss_fn)
                    self._release_sends(state)
                else:
                    self._post(step, state)
            for _, _, works in state.sends:
                for w in works:
                    w.wait()
            state.sends = []
        finally:
            for st in self.stages.values():
                st.sync.defer = False
        self.step_time = now(self._device(), wall=True) - start
        self.timeline = [(name, state.spans.seconds(a), state.spans.seconds(b)) for name, a, b in self.timeline]
        if self._no_sync:      # gradient accumulation: the step after the block reduces the sum
            return self._step_loss(state)
        for k in sorted(self.stages, key=int):          # dp reduction, every stage in one order
            self.stages[k].sync.flush_deferred()
        self._sum_tied_grads()
        return self._step_loss(state)

    def _step_loss(self, state):
        # in one dtype on every rank (a mixed-precision loss may be bf16 on the last stage alone)
        dtype = sum_dtype(self.ctx.params)
        loss = torch.stack([x.to(dtype) for x in state.losses]).sum() if state.losses else \
            torch.zeros((), device=self._device(), dtype=dtype)
        last_rank = self._rank_of_stage(self.schedule.n_stages - 1)
        if self._pp_group is not None and self.p > 1:
            flight.launch(self._pp_group, "broadcast", "the step's loss", loss.numel() * loss.element_size(),
                          dist.broadcast, loss, last_rank, self._pp_group)
        return loss

    @contextmanager
    def no_sync(self):
        """Gradient accumulation over several ``train_step`` calls: inside the block the
        stages' gradients accumulate locally (unsharded), and the first step after it reduces
        their sum over dp once and sums tied copies."""
        prev, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = prev

    @flight.published("eval_step")
    def eval_step(self, inputs=(), targets=None, loss_fn=None, *, kwargs=None):
        """Forward only, without autograd (``torch.no_grad``), over this rank's data-parallel
        slice in micro-batches through the stages (point-to-point, as GPipe's forward). Returns
        the mean loss over the slice on every rank of the pipeline when ``loss_fn`` is given
        or the model computes its own (``labels=``); otherwise the last stage's outputs
        concatenated over the micro-batches (None on the ranks without the last stage).
        Dropout follows the module's mode (``dm.eval()``)."""
        if not isinstance(inputs, tuple):
            inputs = (inputs,)
        m, last = self.schedule.m, self.schedule.n_stages - 1
        flat_in, _ = self._inputs(inputs, kwargs, m)
        flat_t, t_spec = self._split(targets, m)
        own_loss = loss_fn is None and has_loss(self.ctx.out_spec, self.ctx.output_dims)
        other = self._other_shape(flat_in[0], inputs, kwargs)
        if other is not None:
            return other.eval_step(inputs, targets, loss_fn, kwargs=kwargs)
        if self.training and self.ctx.rng_sites:
            draw_masks(self.ctx.rng_sites, self._mask_holders(), microbatches=m, mode=self.plan.dropout_rng,
                       mesh=self.mesh, device=self._device())
        losses, results, s = [], [], _StepState()
        with torch.no_grad():
            for step in self._eval_steps:      # per micro-batch, this rank's stages in order
                if not isinstance(step, Action):
                    self._post(step, s, release=False)
                    continue
                k, mb = step.stage, step.mb
                st, spec = self.stages[str(k)], self.ctx.stages[k]
                key = ("F", k, mb)
                received = self._received(s, key) if key in s.recv else []
                masks = getattr(st.module, RNG, None)
                if masks is not None:
                    masks.microbatch = mb
                out = st(*[flat_in[mb][i] for i in spec.graph_inputs], *received)
                outs = list(out) if isinstance(out, (tuple, list)) else [out]
                if k < last:
                    s.outputs[(k, mb)] = outs
                elif loss_fn is not None or own_loss:
                    result = cast_outputs(pytree.tree_unflatten(outs, self.ctx.out_spec), self.plan)
                    losses.append(self._loss(result, flat_t[mb] if flat_t else None, t_spec, loss_fn) / m)
                else:
                    results.append(cast_outputs(pytree.tree_unflatten(outs, self.ctx.out_spec), self.plan))
            for _, _, works in s.sends:
                for w in works:
                    w.wait()
        if loss_fn is None and not own_loss:
            if not results:
                return None
            return pytree.tree_map(lambda *xs: torch.cat(xs), *results) if len(results) > 1 else results[0]
        return self._step_loss(_StepState(losses=losses))

    def _other_shape(self, first, inputs, kwargs):
        """None where the micro-batch ``first`` has the compiled shapes; else the pipeline for its
        shapes (compiled by ``variants`` on first call and kept, in this module's mode and
        gradient accumulation; see ``autopar.variants``)."""
        shapes = []
        for i, x in enumerate(first):
            want = self.ctx.input_dtypes[i] if i < len(self.ctx.input_dtypes) else None
            if isinstance(x, torch.Tensor) and want is not None and x.dtype != want:
                raise ValueError(f"input {i}: expected dtype {want} (as the example inputs were), got {x.dtype}; "
                                 f"convert it (x.to({want})), or compile again with example inputs of that dtype")
            have = self.ctx.input_shapes[i] if i < len(self.ctx.input_shapes) else None
            if isinstance(x, torch.Tensor) and have is not None and x.dim() != len(have):
                raise ValueError(f"input {i}: a micro-batch of this rank's slice has shape {tuple(x.shape)}, expected "
                                 f"{len(have)} dims (shape {have}, dp={self.mesh.axis_size('dp')}, microbatches="
                                 f"{self.schedule.m}); pass dm.shard_batch(global_batch)")
            shapes.append(tuple(x.shape) if isinstance(x, torch.Tensor) else None)
        shapes = tuple(shapes)
        if shapes == tuple(self.ctx.input_shapes):
            return None
        if shapes not in self._programs:
            if self.variants is None:
                raise ValueError(f"a micro-batch of this rank's slice has shapes {shapes}, expected "
                                 f"{tuple(self.ctx.input_shapes)} (dp={self.mesh.axis_size('dp')}, microbatches="
                                 f"{self.schedule.m}); pass dm.shard_batch(global_batch) with the global batch the "
                                 "module was compiled for")
            self._programs[shapes] = self.variants(self, inputs, dict(kwargs or {}), shapes)
        other = self._programs[shapes]
        if other.training != self.training:
            other.train(self.training)
        return other

    def _run(self, a: Action, s: "_StepState", flat_in, flat_t, t_spec, loss_fn):
        """A compute action: wait for its message, if any (idle time, not compute), then run it."""
        st = self.stages[str(a.stage)]
        spec = self.ctx.stages[a.stage]
        key = (a.kind, a.stage, a.mb)
        got = self._take(s, key) if key in s.recv else None
        t0 = s.spans.mark()    # the span holds the device's work (timing.Spans), resolved after the step
        if a.kind == "F":
            self._forward(a, st, spec, s, got, flat_in, flat_t, t_spec, loss_fn)
        elif a.kind == "B":
            self._backward(a, st, s, got)
        else:
            getattr(st.module, STASH).run(a.mb)
        self.timeline.append((str(a), t0, s.spans.mark()))

    def _post(self, batch: tuple, s: "_StepState", release: bool = True) -> None:
        """Post a batch of ``batch_transfers`` together (``flight.batch``): each receive into
        fresh buffers (a gradient's take the shapes of the stage's outputs: its forward ran
        before, as the gradient is sent after the peer's forward that needs that forward's outputs), each
        send of what a compute action before it produced. ``release``: the sends are dropped
        once the peer is known to have posted their receives (``_release_sends``), else kept
        to the end."""
        transfers, posted = [], []      # posted: (action, receive buffers or None, how many transfers)
        for a in batch:
            st, spec = self.stages[str(a.stage)], self.ctx.stages[a.stage]
            if a.kind == "RECV_F":
                shapes = st.ctx.input_shapes[len(spec.graph_inputs):]
                dtypes = st.ctx.input_dtypes[len(spec.graph_inputs):]
                bufs, more = self._receives(0, a, shapes, dtypes, a.stage - 1)
            elif a.kind == "RECV_B":
                outs = [o for o in s.outputs[(a.stage, a.mb)] if o.is_floating_point()]
                bufs, more = self._receives(1, a, [tuple(o.shape) for o in outs], [o.dtype for o in outs], a.stage + 1)
            elif a.kind == "SEND_F":
                bufs, more = None, self._sends(0, Action(a.stage + 1, "F", a.mb),
                                               [o.detach() for o in s.outputs[(a.stage, a.mb)]], a.stage + 1)
            else:
                bufs, more = None, self._sends(1, Action(a.stage - 1, "B", a.mb), s.input_grads.pop((a.stage, a.mb)),
                                               a.stage - 1)
            transfers += more
            posted.append((a, bufs, len(more)))
        handles = iter(flight.batch(transfers))
        for a, bufs, n in posted:
            works = [next(handles) for _ in range(n)]
            if bufs is not None:
                kind = "activations" if a.kind == "RECV_F" else "gradients"
                s.recv[(a.kind[-1], a.stage, a.mb)] = bufs, self._traced(works, f"recv[pp] {kind} {a}")
                continue
            target = Action(a.stage + 1, "F", a.mb) if a.kind == "SEND_F" else Action(a.stage - 1, "B", a.mb)
            works = self._traced(works, f"send[pp] {'activations' if a.kind == 'SEND_F' else 'gradients'} for {target}")
            recv = Action(target.stage, "RECV_" + target.kind, target.mb)
            s.sends.append(self._matching(recv, works) if release else (None, None, works))

    def _receives(self, kind, a, shapes, dtypes, peer_stage) -> tuple:
        """Fresh buffers for a receive action's tensors, and their transfers from the peer stage's rank."""
        bufs = [torch.empty(sh, dtype=dt, device=self._device()) for sh, dt in zip(shapes, dtypes)]
        src = self._rank_of_stage(peer_stage)
        what = f"{'activations' if kind == 0 else 'gradients'} for {Action(a.stage, 'FB'[kind], a.mb)}"
        group = self._p2p_group(src, self.mesh.rank)
        return bufs, [flight.Transfer("recv", b, src, group, f"{what} [{j}]", self._tag(kind, a.stage, a.mb, j))
                      for j, b in enumerate(bufs)]

    def _sends(self, kind, target: Action, tensors, peer_stage) -> list:
        """The transfers of a send action's tensors to the peer stage's rank (their bytes counted)."""
        dst = self._rank_of_stage(peer_stage)
        tensors = [t.contiguous() for t in tensors]
        self.comm_stats.record("pp", "send", "forward" if kind == 0 else "backward",
                               sum(t.numel() * t.element_size() for t in tensors))
        what = f"{'activations' if kind == 0 else 'gradients'} for {target}"
        group = self._p2p_group(self.mesh.rank, dst)
        return [flight.Transfer("send", t, dst, group, f"{what} [{j}]", self._tag(kind, target.stage, target.mb, j))
                for j, t in enumerate(tensors)]

    def _traced(self, works, name):
        """Under ``record_timeline``, the transfers' handles record completion and blocking waits."""
        trace = self.comm_stats.trace
        if trace is None:
            return works
        device = self._device()
        start = now(device)
        return [TracedWork(w, name, start, trace, device) for w in works]

    @staticmethod
    def _received(s, key):
        """The buffers of a posted receive, once its transfers completed."""
        bufs, works = s.recv.pop(key)
        for w in works:
            w.wait()
        return bufs

    def _take(self, s, key):
        bufs = self._received(s, key)
        kind, stage, mb = key     # what the peer did before it sent this: see _release_sends
        sent_by = Action(stage - 1, "SEND_F", mb) if kind == "F" else Action(stage + 1, "SEND_B", mb)
        peer = self.schedule.rank_of(sent_by.stage)
        s.heard[peer] = max(s.heard.get(peer, -1), self._position[peer][sent_by])
        return bufs

    def _matching(self, recv: Action, works) -> tuple:
        """A send's entry in ``_StepState.sends``: (peer pp rank, index of the receive that
        matches it in the peer's action list, the send's handles)."""
        peer = self.schedule.rank_of(recv.stage)
        return peer, self._position[peer][recv], works

    def _release_sends(self, s) -> None:
        """Wait for the sends the peer has certainly posted the receive of, and drop them: a
        send's handle holds its tensor (a stage's output, or an input's gradient) until waited,
        and on gloo a send is not seen completed before it is waited, so without this every
        micro-batch's would live to the end of the step. A rank runs its lowered actions in
        order and posts a receive no later than its place in the list, so once this rank has
        received a message the peer sent at index j, every receive the peer lists before j is
        posted, and a send matching one of them completes without waiting on the peer's
        compute (the transfer alone). Sends not yet known to be matched are kept."""
        if not s.sends:
            return
        kept = []
        for peer, index, works in s.sends:
            if index < s.heard.get(peer, -1):
                for w in works:
                    w.wait()
            else:
                kept.append((peer, index, works))
        s.sends = kept

    def _mask_holders(self) -> list:
        return [getattr(st.module, RNG) for st in self.stages.values() if hasattr(st.module, RNG)]

    def _forward(self, a, st, spec, s, got, flat_in, flat_t, t_spec, loss_fn):
        args = [flat_in[a.mb][i] for i in spec.graph_inputs]
        masks = getattr(st.module, RNG, None)
        if masks is not None:
            masks.microbatch = a.mb
        received = [t.requires_grad_(True) if t.is_floating_point() else t for t in (got or [])]
        out = st(*args, *received)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        s.inputs[(a.stage, a.mb)] = received
        if a.stage == self.schedule.n_stages - 1:
            result = cast_outputs(pytree.tree_unflatten(outs, self.ctx.out_spec), self.plan)   # as dm(x)'s
            loss = self._loss(result, flat_t[a.mb] if flat_t else None, t_spec, loss_fn)
            s.losses.append(loss.detach() / self.schedule.m)
            s.outputs[(a.stage, a.mb)] = [loss / self.schedule.m]
        else:
            s.outputs[(a.stage, a.mb)] = outs

    def _backward(self, a, st, s, got):
        outs = s.outputs.pop((a.stage, a.mb))
        if a.stage == self.schedule.n_stages - 1:
            grads = [None]
        else:
            got = iter(got)
            grads = [next(got) if o.is_floating_point() else None for o in outs]
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
        stash = getattr(st.module, STASH, None)
        if stash is not None:
            stash.deferring, stash.mb = self.schedule.split_backward, a.mb
        try:
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        finally:
            if stash is not None:
                stash.deferring = False
        received = s.inputs.pop((a.stage, a.mb))
        if a.stage > 0:
            s.input_grads[(a.stage, a.mb)] = [
                (x.grad if x.grad is not None else torch.zeros_like(x)) for x in received if x.is_floating_point()]

    # ---- after the step: tied parameters ----------------------------------------------------
    def _sum_tied_grads(self):
        """A parameter held by several stages (tied weights) gets the sum of their gradients,
        on every holder: added locally, then exchanged between the ranks holding it, every
        parameter's in one batch (a rank sends its sum to every other holder and receives
        theirs: posted together, no transfer waits behind another on NCCL's stream)."""
        transfers, summed = [], []      # summed: (the holders' parameters, this rank's sum, the peers' sums)
        for name, stages in self._holders.items():
            if len(stages) < 2 or not self._trainable(name):
                continue
            mine = [k for k in stages if str(k) in self.stages]
            ranks = sorted({k % self.p for k in stages})
            if not mine:
                continue
            params = [self.stages[str(k)].module.get_parameter(name) for k in mine]
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            local = sum(p.grad for p in params).contiguous()
            bufs = []
            for r in ranks:
                if r == self.pp_index:
                    continue
                peer = self._rank_of_stage(r)
                transfers.append(flight.Transfer("send", local, peer, self._p2p_group(self.mesh.rank, peer),
                                                 f"tied gradient {name}", 9_000_000 + r))
                self.comm_stats.record("pp", "send", "tied", local.numel() * local.element_size())
                bufs.append(torch.empty_like(local))
                transfers.append(flight.Transfer("recv", bufs[-1], peer, self._p2p_group(peer, self.mesh.rank),
                                                 f"tied gradient {name}", 9_000_000 + self.pp_index))
            summed.append((params, local, bufs))
        for w in flight.batch(transfers):
            w.wait()
        for params, local, bufs in summed:
            total = local.clone()
            for b in bufs:
                total += b
            for p in params:
                p.grad.copy_(total)

    def _trainable(self, name):
        info = self.ctx.params.get(name)
        return info is not None and info.requires_grad and not info.is_buffer

    # ---- optimizer and full views ----------------------------------------------------------
    def syncs(self) -> list:
        """Every stage's data-parallel reducer on this rank."""
        return [st.sync for st in self.stages.values()]

    def optimizer(self, cls, *, per_tensor: bool = False, **kwargs) -> torch.optim.Optimizer:
        """As ``DistributedModule.optimizer``, over every stage this rank runs (elementwise
        optimizers only where the stages' parameters are sharded). With ``Plan(offload=
        "optimizer")`` it steps host copies of every stage's parameters (a tied weight held by
        two stages of this rank: a copy each, stepped alike on their summed gradients)."""
        sharded = "; ".join(sorted({st.sharded_by for st in self.stages.values()} - {""}))
        if per_tensor and self.plan.offload is not None:
            raise ValueError(refuse_per_tensor_offload(self.plan))
        if per_tensor:
            raise NotImplementedError("per_tensor=True is not built for pipelines: the full copies would "
                                      "be gathered across stages. Use an elementwise optimizer, or a plan "
                                      "without pp")
        check_optimizer(cls, sharded, per_tensor, per_tensor_built=False)
        if self.plan.offload == "optimizer":
            opt = self._offloaded_optimizer(cls, dict(self.named_parameters()), **kwargs)
        else:
            opt = cls(self.parameters(), **kwargs)
        if self.plan.dp in ("zero1", "zero2") and self.plan.offload is None:   # offload: in its post-hook
            opt.register_step_post_hook(lambda *_: self.gather_params())
        if self.plan.offload is not None:    # after the replica refresh, which bumps the shards' versions
            opt.register_step_post_hook(lambda *_, offload=self._offload: offload.record_versions())
        post_step_errors(opt)
        built_here(opt)
        self._optimizer = weakref.ref(opt)
        return opt

    def gather_params(self) -> None:
        for st in self.stages.values():
            st.gather_params()

    def stage_modules(self) -> list:
        """The stages this rank runs, in stage order."""
        return [self.stages[k] for k in sorted(self.stages, key=int)]

    def after_load(self) -> None:
        """After ``load``: every stage's ``after_load``."""
        for st in self.stage_modules():
            st.after_load()

    def _device(self) -> torch.device:
        """The device this rank's stages live on (what the executor allocates on)."""
        return next(iter(self.stages.values())).device

    def _full_all(self, grads: bool) -> dict[str, torch.Tensor | None]:
        """Every parameter's (``grads``: gradient's) full tensor on every rank, in a few
        collectives: each stage gathers the tensors it owns (the first stage holding them) over
        dp and tp at once (``DistributedModule.full_tensors``), then each pp rank broadcasts which
        of its tensors are present and, flat in buckets, their values."""
        names = [n for n in self.ctx.params if n in self._holders and (not grads or self._trainable(n))]
        owner = {n: self._holders[n][0] for n in names}
        full: dict[str, torch.Tensor | None] = {}
        for sid, st in self.stages.items():
            mine = [n for n in names if str(owner[n]) == sid]
            if grads:
                pieces = {n: st.module.get_parameter(n).grad for n in mine}
            else:
                pieces = {n: st.module.get_parameter(n) if n in st.sync.specs else st.local_tensor(n) for n in mine}
            full.update(st.full_tensors(pieces))
        if self.p == 1 or self._pp_group is None:
            return {n: full[n] for n in names}
        device = self._device()
        by_rank: dict[int, list[str]] = {}
        for n in names:
            by_rank.setdefault(self._rank_of_stage(owner[n]), []).append(n)
        for src, held in sorted(by_rank.items()):
            present = torch.tensor([int(full.get(n) is not None) for n in held], dtype=torch.int32, device=device)
            flight.launch(self._pp_group, "broadcast", f"{len(held)} tensors: present?", present.numel() * 4,
                          dist.broadcast, present, src, self._pp_group)
            sent = [n for n, there in zip(held, present.tolist()) if there]
            for n in held:
                if n not in sent:
                    full[n] = None
            numel = {n: math.prod(self.ctx.params[n].shape) for n in sent}
            for dtype, group in byte_buckets(sent, self.ctx.stored_dtype, numel.get):
                sizes = [numel[n] for n in group]
                owned = group[0] in full
                flat = (torch.cat([full[n].reshape(-1) for n in group]) if owned
                        else torch.empty(sum(sizes), dtype=dtype, device=device))
                flight.launch(self._pp_group, "broadcast", f"{len(group)} tensors", flat.numel() * flat.element_size(),
                              dist.broadcast, flat, src, self._pp_group)
                if not owned:
                    for n, piece in zip(group, flat.split(sizes)):
                        full[n] = piece.view(self.ctx.params[n].shape).clone()
        return {n: full[n] for n in names}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            full = self._full_all(grads=False)
        return {key: full[name] for name in full for key in (name,) + self.ctx.params[name].aliases}

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        with torch.no_grad():
            full = self._full_all(grads=True)
        return {key: full[name] for name in full for key in (name,) + self.ctx.params[name].aliases}

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Fill every stage this rank runs from full tensors (keys of the model's state_dict())."""
        for st in self.stages.values():
            st.load_full_state_dict(state)

    def to_empty(self, *, device=None) -> "PipelineModule":
        """Allocate storage for every stage this rank runs (a model captured on the meta device),
        on ``device`` (default the mesh's, ``Mesh.device``); follow with ``load_full_state_dict``."""
        for st in self.stages.values():
            st.to_empty(device=device)
        return self

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        if norm_type != 2.0:
            raise NotImplementedError("a pipelined module clips by the 2-norm; pass norm_type=2.0")
        dtype = sum_dtype(self.ctx.params)
        total = torch.zeros((), device=self._device(), dtype=dtype)
        for k, st in self.stages.items():
            first = {n: self._holders[n][0] == int(k) for n in st.sync.specs}
            total += st.grad_pow_sum(2.0, skip=lambda n: not first.get(n, True), dtype=dtype)
        if self._pp_group is not None and self.p > 1:
            flight.launch(self._pp_group, "all_reduce", "grad norm", total.element_size(), dist.all_reduce, total,
                          dist.ReduceOp.SUM, self._pp_group)
        norm = total.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.dtype))
        return norm

    # ---- inspection -------------------------------------------------------------------------
    STEP_PARTS = {"action": "_run", "batch": "_post", "tied gradients": "_sum_tied_grads",
                  "loss broadcast": "_step_loss"}

    def instrument(self, part: str, wrap) -> None:
        """Replace one part of this module's step by ``wrap(part)``, for a harness that times
        it (``autopar.phases``, the calibration's runtime probes). The parts: ``"action"`` (one
        compute action: ``fn(action, state, *rest)``), ``"batch"`` (one batch of transfers:
        ``fn(batch, state, release=True)``), ``"tied gradients"`` (the sum over tied copies
        after the schedule: ``fn()``) and ``"loss broadcast"`` (the step's loss to every rank:
        ``fn(state)``). The wrapper must call the part it wraps with the same arguments."""
        if part not in self.STEP_PARTS:
            raise ValueError(f"instrument({part!r}): expected one of {sorted(self.STEP_PARTS)}")
        name = self.STEP_PARTS[part]
        setattr(self, name, wrap(getattr(self, name)))

    def simulate(self, costs=None):
        """The schedule's timeline by the simulator (unit costs unless ``costs`` says otherwise)."""
        return simulate(self.schedule, costs)

    def measured_trace(self) -> dict:
        """Chrome trace of the last step on every rank of the pipeline (collective over pp)."""
        rows = [None] * self.p
        if self._pp_group is not None and self.p > 1:
            dist.all_gather_object(rows, (self.mesh.rank, self.timeline), group=self._pp_group)
        else:
            rows = [(self.mesh.rank, self.timeline)]
        t0 = min((e[1] for _, tl in rows for e in tl), default=0.0)
        trace = ChromeTrace()
        for i, (rank, tl) in enumerate(rows):
            trace.process(i, f"pp rank {i} (rank {rank})")
            for name, a, b in tl:
                trace.span(i, 0, name, a - t0, b - t0, Action.parse(name).kind)
        return trace.as_dict()


def _forward_only(schedule: Schedule) -> Schedule:
    """``eval_step``'s order: per micro-batch, each rank's stages in order (forwards only)."""
    ranks = [[Action(k, "F", mb) for mb in range(schedule.m) for k in range(r, schedule.n_stages, schedule.p)]
             for r in range(schedule.p)]
    return Schedule("forward only", schedule.p, schedule.v, schedule.m, False, tuple(ranks))


class _StepState:
    def __init__(self, losses=None):
        self.recv: dict = {}
        self.sends: list = []      # (peer pp rank, index of its matching receive, handles): _release_sends
        self.heard: dict = {}      # peer pp rank -> index of the latest send of its that was received here
        self.inputs: dict = {}
        self.outputs: dict = {}
        self.input_grads: dict = {}
        self.losses: list = losses if losses is not None else []
        self.spans = Spans()       # train_step's: on the stages' device
