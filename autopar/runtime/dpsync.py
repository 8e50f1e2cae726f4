"""Data-parallel runtime: the parameter and gradient traffic of the ``dp`` axis.

One ``DataParallelSync`` per compiled module serves the graph nodes that the collectives
pass inserted for ddp and ZeRO-1/2/3:

    dp_gather(shard, sync, name)          ZeRO-3: all-gather the full parameter before use;
                                          backward hands its gradient to the reducer
    dp_release(full, sync, name)          ZeRO-3: the gathered parameter's last forward use;
                                          what backward needs of it is gathered again
    dp_bucket_sync(sync, k, values, owners) ddp / ZeRO-1/2: identity forward on bucket k's
                                          parameters; backward reduces their gradients (one node
                                          per bucket: autograd runs it once all are ready)

    dp_unit_start(sync, k) / dp_unit_wait(sync, k)
                                          ZeRO-3: issue / complete unit k's all-gather, placed
                                          by the overlap pass (passes/overlap.py)

ZeRO-3 gathers a unit (one numbered layer) at a time, as one flat all-gather, where the
graph's start and wait nodes say; saved-tensor hooks swap the gathered tensors autograd keeps
for tokens, and backward gathers a unit again when it first needs it, issuing the ones below
ahead within ``prefetch_bytes``.

Gradients are reduced in buckets fixed at compile time (the collectives pass), in reverse
order of first use, each launched asynchronously as soon as all its members are ready
(ddp: all-reduce; ZeRO-2/3: reduce-scatter; each waited on when the next bucket launches,
or when backward ends, and its averaged gradients then land in the parameters' ``.grad``;
ZeRO-2/3 free as they reduce: a bucket's full-size flat buffer is released with it, before
the next bucket's is made, so backward holds one bucket of full gradients besides the shards
(the reduce-scatter works on that scratch buffer in place: ``AxisComm.reduce_scatter_flat``'s
``in_place``, which spares gloo's copy of it); ZeRO-1:
accumulated into a persistent full-gradient buffer, its bucket reduce-scattered, landed when
backward ends). Buckets launch strictly in order on every rank, so ranks issue the same
collectives. Gradients are averaged over the axis, as DDP and FSDP do. A bucket member that
backward does not reach (read only where no gradient flows) sends zeros and lands nothing: its
``.grad`` stays None, as on one device, where an optimizer then leaves it alone. With
``overlap`` off each collective is waited on as soon as it is issued (a bucket as soon as it
fills).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from contextlib import contextmanager
from types import MappingProxyType

import torch
from torch import nn
from torch.autograd import Variable

from ..placement import ShardSpec
from ..sizes import chunk_range, gather_unit_bytes
from .comm import AxisComm

__all__ = ["DataParallelSync", "dp_gather", "dp_release", "dp_bucket_sync", "dp_local_chunk", "dp_unit_start",
           "dp_unit_wait"]


class _Bucket:
    def __init__(self, names: list[str], specs: dict[str, ShardSpec], sharded: bool):
        self.names = names
        sizes = [specs[n].chunk_numel if sharded else specs[n].numel for n in names]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.sizes = sizes
        self.width = sum(sizes)   # per-rank section (sharded) or whole bucket (all-reduce)


class DataParallelSync(nn.Module):
    """Shards, replicas and the bucketed gradient reducer of the ``dp`` axis."""

    def __init__(self, mode: str, comm: AxisComm, specs: dict[str, ShardSpec],
                 buckets: list[list[str]], params: dict[str, nn.Parameter],
                 replicas: dict[str, torch.Tensor], units: list[list[str]] = (), *,
                 overlap: bool = True, prefetch_bytes: int | None = None, reduce_comm: AxisComm | None = None,
                 compute_dtype: torch.dtype | None = None):
        super().__init__()
        self.mode, self.comm, self.specs = mode, comm, specs
        # mixed precision: the parameters are the optimizer's masters; forward reads them in
        # compute_dtype (ZeRO-3 gathers, ZeRO-1/2 replicas, ddp's per-forward cast), gradients
        # are summed in the axis's grad_dtype (comm.summing) and land in the masters' dtype.
        # None: no conversion
        self.compute_dtype = compute_dtype
        self.reduce_comm = reduce_comm or comm      # gradient buckets' group (a second one with overlap)
        # ZeRO-2/3: a bucket's full gradients are freed once reduced (False keeps every bucket to
        # the end of backward: what the memory tests measure against)
        self.free_reduced = True
        # called with a bucket's parameters once their reduced gradients are in .grad: after the
        # next bucket's reduction is issued, so that what it does runs while that one is in flight
        # (Plan(offload=...): their copy to the host)
        self.on_landed = None
        self._unnotified: list[int] = []     # buckets landed, on_landed not yet called
        self.sharded = mode != "ddp"
        # overlap: buckets go out as they fill and are waited on when the next one fills, backward
        # gathers run ahead within prefetch_bytes; off: every collective is waited on where issued
        self.overlap, self.prefetch_bytes = overlap, prefetch_bytes
        self.buckets = [_Bucket(b, specs, self.sharded) for b in buckets]
        self.bucket_of = {n: (i, j) for i, b in enumerate(self.buckets) for j, n in enumerate(b.names)}
        # plain dicts, not registered: the owning module registers the tensors themselves
        self._params = params
        self._replicas = replicas
        self._persistent: dict[int, torch.Tensor] = {}   # ZeRO-1 full-gradient buffers
        self._in_backward = False
        # ZeRO-3: parameters are gathered a unit at a time, the next unit prefetched
        self.units = [_Bucket(u, specs, True) for u in units]
        self.unit_of = {n: i for i, u in enumerate(self.units) for n in u.names}
        self._inflight: dict[int, tuple] = {}     # unit -> (work, buffer) of an issued gather
        self._fwd: dict[int, dict[str, torch.Tensor]] = {}   # gathered, not yet used by forward
        self._fwd_done: set[int] = set()          # units gathered in this forward
        self._gathered: dict[int, str] = {}       # storage ptr of a live gathered param -> name
        self._pending = defaultdict(int)          # unit -> saved views awaiting backward
        self._bwd: dict[int, dict[str, torch.Tensor]] = {}   # re-gathered for backward
        self.saved_in_backward: set[str] = set()  # params backward read (re-gathered), last step
        self._versions: list[int] = []
        # gradient accumulation (a pipeline's micro-batches, dm.no_sync()): while defer is on,
        # gradients accumulate locally, unsharded, and are reduced once, by flush_deferred (the
        # pipeline) or by the next backward without defer (joined in _fill)
        self.defer = False
        self._acc: dict[str, torch.Tensor] = {}
        self._acc_owned: set[str] = set()
        self._summed: dict[str, torch.Tensor] = {}   # add_summed: waiting for their parameter's gradient
        self.events: list[tuple[str, object]] = []
        # ZeRO-3: most bytes of gathers in flight at once (issued, not yet waited on): within the
        # prefetch budget, or one unit where a unit alone is larger (backward takes the units
        # in the reverse order of forward's last use, the order they are issued ahead in)
        self.peak_inflight_bytes = 0
        self._last_use: dict[int, int] = {}      # unit -> when forward last used it
        self._clock = 0
        self.record_versions()

    def extra_repr(self) -> str:
        return (f"mode={self.mode!r}, axis={self.comm.axis!r}, size={self.comm.size}, "
                f"buckets={[len(b.names) for b in self.buckets]}")

    @property
    def replicas(self) -> Mapping[str, torch.Tensor]:
        """ZeRO-1/2: parameter name -> the full replica forward reads (a read-only view; empty
        for ddp and ZeRO-3). The tensors themselves are written in place (``gather_replicas``)."""
        return MappingProxyType(self._replicas)

    @property
    def persistent_grads(self) -> Mapping[int, torch.Tensor]:
        """ZeRO-1: bucket index -> the full-gradient buffer kept between steps (a read-only
        view; empty for other modes, and before the first backward)."""
        return MappingProxyType(self._persistent)

    def rebind(self, name: str, param: nn.Parameter, replica: torch.Tensor | None = None) -> None:
        """Point the reducer at ``param``, the new Parameter object of ``name`` (and, ZeRO-1/2,
        at its new ``replica``): leaving the meta device (``dm.to_empty``) makes new tensors."""
        self._params[name] = param
        if replica is not None:
            self._replicas[name] = replica

    # ---- parameters --------------------------------------------------------------------
    def unit_bytes(self, k: int) -> int:
        """Bytes unit ``k``'s gather holds in flight (``sizes.gather_unit_bytes``)."""
        u = self.units[k]
        dtype = self.compute_dtype or self._params[u.names[0]].dtype
        return gather_unit_bytes(self.comm.size * u.width, self.comm.size, dtype.itemsize)

    def compute(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as forward reads it: in the compute dtype under mixed precision."""
        cd = self.compute_dtype
        return t if cd is None or t.dtype == cd or not t.is_floating_point() else t.to(cd)


    def start_unit(self, k: int) -> None:
        """Forward (graph node ``dp_unit_start``): issue unit ``k``'s gather."""
        if k not in self._inflight and k not in self._fwd and k not in self._fwd_done:
            self._issue(k, "forward")

    def wait_unit(self, k: int) -> None:
        """Forward (graph node ``dp_unit_wait``): unit ``k``'s parameters, gathered, for its uses."""
        if k not in self._fwd and k not in self._fwd_done:
            self._fwd[k] = self._complete(k, "forward")
            self._fwd_done.add(k)

    def _issue(self, k: int, phase: str) -> None:
        """Start the all-gather of unit ``k`` (asynchronously)."""
        u = self.units[k]
        staging = torch.cat([self.compute(self.specs[n].padded_local(self._params[n].detach())) for n in u.names])
        out = staging.new_empty(self.comm.size * u.width)
        work = self.comm.all_gather_flat(out, staging, label=f"unit {k}", async_op=True, phase=phase,
                                         in_place=True)      # out is held until the wait
        self._inflight[k] = (work, out)
        self.peak_inflight_bytes = max(self.peak_inflight_bytes, sum(self.unit_bytes(j) for j in self._inflight))

    def _complete(self, k: int, phase: str) -> dict[str, torch.Tensor]:
        """The full parameters of unit ``k`` (waiting for its prefetch, or gathering now)."""
        if k not in self._inflight:
            self._issue(k, phase)
        work, out = self._inflight.pop(k)
        if work is not None:
            work.wait()
        u, out = self.units[k], out.view(self.comm.size, self.units[k].width)
        # copy-out: each member's rows sit strided in the rank-major buffer (a view when alone)
        return {n: out[:, off:off + size].reshape(-1)[: self.specs[n].numel].view(self.specs[n].shape)
                for n, off, size in zip(u.names, u.offsets, u.sizes)}

    def gather_for_forward(self, name: str) -> torch.Tensor:
        """ZeRO-3 forward: the full parameter, from its unit's gather (issued and waited on by
        the graph's ``dp_unit_start`` / ``dp_unit_wait`` nodes)."""
        k = self.unit_of[name]
        self.wait_unit(k)       # where the overlap pass placed it; a graph without it gathers here
        members = self._fwd[k]
        full = members.pop(name)
        if not members:
            del self._fwd[k]
        return full

    def gather_replicas(self, before_bucket=None) -> None:
        """ZeRO-1/2: after the optimizer updated this rank's rows, all-gather every replica, a
        bucket at a time. Without ``before_bucket`` each bucket's gather is waited on as it is
        issued. With it (``Plan(offload=...)``: ``OptimizerOffload.params_up``, which copies a
        bucket's rows up from the host), it is called with each bucket's shards before the
        bucket is staged, and the gathers are pipelined: bucket b's is issued asynchronously and
        waited on (its replicas written) only after bucket b+1's rows are up and its gather
        issued, so that each copy up runs while the previous bucket's gather is in flight (two
        buckets' gathers in flight at most; every one waited on before this returns). With
        ``overlap`` off each gather is waited on as soon as it is issued."""
        pipelined = before_bucket is not None and self.overlap
        with torch.no_grad():
            inflight = None
            for i, b in enumerate(self.buckets):
                if before_bucket is not None:
                    before_bucket([self._params[n] for n in b.names])
                staging = torch.cat([self.compute(self.specs[n].padded_local(self._params[n])) for n in b.names])
                out = staging.new_empty(self.comm.size * b.width)
                work = self.comm.all_gather_flat(out, staging, label=f"params, bucket {i}", async_op=pipelined,
                                                 phase="optimizer")
                if inflight is not None:
                    self._write_replicas(*inflight)
                inflight = (i, work, out)
                if not pipelined:
                    self._write_replicas(*inflight)
                    inflight = None
            if inflight is not None:
                self._write_replicas(*inflight)
        self.record_versions()

    def _write_replicas(self, i: int, work, out: torch.Tensor) -> None:
        """Wait for bucket ``i``'s replica all-gather (``work``; None: done) and copy each
        member's rows out of the rank-major ``out`` into its replica."""
        if work is not None:
            work.wait()
        b = self.buckets[i]
        out = out.view(self.comm.size, b.width)
        for n, off, size in zip(b.names, b.offsets, b.sizes):
            spec = self.specs[n]
            self._replicas[n].view(-1).copy_(out[:, off:off + size].reshape(-1)[: spec.numel])

    def record_versions(self) -> None:
        self._versions = [p._version for p in self._params.values()]

    def check_fresh(self) -> None:
        """ZeRO-1/2: refuse to run on replicas older than their shards."""
        if self.mode in ("zero1", "zero2") and [p._version for p in self._params.values()] != self._versions:
            raise RuntimeError(
                f"the {self.mode} parameter shards were changed after the last parameter all-gather "
                "(written in place outside an optimizer step?), so the full parameters forward uses "
                "are stale. Call dm.gather_params() after changing the shards (an optimizer's step "
                "does it), or load new values with dm.load_full_state_dict(...).")

    # ---- ZeRO-3 saved-tensor hooks: gather again in backward ------------------------------
    def track(self, name: str, full: torch.Tensor) -> None:
        self._gathered[full.untyped_storage().data_ptr()] = name

    def release(self, full: torch.Tensor) -> None:
        name = self._gathered.pop(full.untyped_storage().data_ptr(), None)
        if name is not None:      # backward needs units in reverse order of their last forward use
            self._clock += 1
            self._last_use[self.unit_of[name]] = self._clock

    def _pack(self, t: torch.Tensor):
        name = self._gathered.get(t.untyped_storage().data_ptr()) if self._gathered else None
        if name is None:
            return t
        self._pending[self.unit_of[name]] += 1
        return (name, t.size(), t.stride(), t.storage_offset())

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        name, size, stride, offset = packed
        k = self.unit_of[name]
        members = self._bwd.get(k)
        if members is None:
            members = self._bwd[k] = self._complete(k, "backward")
            self.saved_in_backward.update(self.units[k].names)
            self._prefetch_backward(k)
        full = members[name]
        self._pending[k] -= 1
        if self._pending[k] <= 0:
            self._bwd.pop(k, None)
        return full.as_strided(size, stride, offset)

    def _prefetch_backward(self, k: int | None) -> None:
        """Backward runs units in reverse order of their last forward use: issue the gathers of
        the next ones while unit ``k`` computes (``None``: at the end of forward, for the first
        ones backward needs), as far as ``prefetch_bytes`` allows (None: one unit), and never
        more than units - 2 ahead (never every unit gathered at once)."""
        if not self.overlap:
            return
        waiting = [j for j, c in self._pending.items()
                   if c > 0 and j != k and j not in self._bwd and j not in self._inflight]
        order = sorted(waiting, key=lambda j: self._last_use.get(j, -1), reverse=True)
        ahead = sum(self.unit_bytes(j) for j in self._inflight)
        most = max(len(self.units) - 2, 0)     # some unit always not gathered, with the one in use
        for j in order:
            if len(self._inflight) + 1 > most:
                return
            if self.prefetch_bytes is None:
                if self._inflight:
                    return
            elif ahead + self.unit_bytes(j) > self.prefetch_bytes:
                return
            self._issue(j, "backward")
            ahead += self.unit_bytes(j)

    @contextmanager
    def forward_scope(self):
        """Around one forward: ZeRO-3 swaps saved gathered parameters for re-gather tokens."""
        self.check_fresh()
        self._summed.clear()        # left by a backward that failed before reaching their buckets
        if self.mode != "zero3":
            yield
            return
        self._drop_inflight()       # a backward prefetch of a forward whose backward never ran
        self._pending.clear()
        self._bwd.clear()
        self._last_use.clear()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._gathered.clear()
            self._fwd.clear()
            self._fwd_done.clear()
            self._drop_inflight()
        if not self.defer and torch.is_grad_enabled():   # backward's first units go out now,
            self._prefetch_backward(None)                   # while the loss computes

    def _drop_inflight(self) -> None:
        """Finish and forget gathers nobody will use (every rank issued them alike)."""
        for work, _ in self._inflight.values():
            if work is not None:
                work.wait()
        self._inflight.clear()

    # ---- gradients ---------------------------------------------------------------------
    def add_summed(self, grads: dict[str, torch.Tensor]) -> None:
        """Gradients of parameters by name, already summed over another axis in the reduce dtype
        (``tp_param_sync``: a replicated parameter read per tp rank), wider than the compute-dtype
        gradients autograd carries. Each joins the gradient autograd then hands this reducer for
        its parameter (autograd carries zeros for the summed reads), so that no compute-dtype
        rounding comes between the sum and the master. A parameter no bucket reduces (a pipeline
        stage on dp=1 reads its master through a cast) has it added to its ``.grad`` at once."""
        for name, g in grads.items():
            if name in self.bucket_of:
                prev = self._summed.get(name)
                self._summed[name] = g if prev is None else prev + g
                continue
            p = self._params[name]
            with torch.no_grad():
                if p.grad is None:
                    p.grad = g.to(p.dtype, copy=True)
                else:
                    p.grad.add_(g)

    def _join_summed(self, name: str, grad):
        """``grad`` from autograd plus what ``add_summed`` holds for ``name``, in the reduce dtype."""
        summed = self._summed.pop(name, None)
        if summed is None:
            return grad
        return summed if grad is None else self.comm.summing(grad) + summed

    def add_grad(self, name: str, grad: torch.Tensor) -> None:
        """ZeRO-3: one parameter's full local gradient is ready (from autograd); its bucket
        goes out once every member's is."""
        if self._summed:
            grad = self._join_summed(name, grad)
        if self.defer:
            self._accumulate(name, grad)
            return
        if not self._in_backward:
            self._begin_backward()
        bi, j = self.bucket_of[name]
        pending = self._state[bi]["grads"]
        pending[j] = grad if pending[j] is None else pending[j] + grad   # two forwards, one backward
        self.events.append(("ready", name))
        if all(g is not None for g in pending):
            self._state[bi]["grads"] = [None] * len(pending)
            self.add_bucket(bi, pending)

    def add_bucket(self, bi: int, grads: list) -> None:
        """Every gradient of bucket ``bi`` is ready (full, local; None = no gradient)."""
        if self._summed:
            grads = [self._join_summed(name, g) for name, g in zip(self.buckets[bi].names, grads)]
        if self.defer:
            for name, g in zip(self.buckets[bi].names, grads):
                self._accumulate(name, g)
            return
        if not self._in_backward:
            self._begin_backward()
        if self._state[bi]["work"] is not None:
            raise RuntimeError(
                f"{', '.join(self.buckets[bi].names)} received a second gradient in one backward after "
                "their bucket was sent: this backward runs through two forwards of the compiled module. "
                "Call backward once per forward (gradients accumulate across backward calls), as with DDP.")
        if self._next == bi:
            self._retire(bi - 1)   # free as you reduce: the previous flat buffer goes before this one is made
        self._fill(bi, grads)
        if len(grads) > 1 or self.mode != "zero3":
            self.events.extend(("ready", name) for name in self.buckets[bi].names)
        self._launch_ready()       # without overlap, each bucket is waited on as it is launched

    def _accumulate(self, name: str, grad) -> None:
        """Sum a micro-batch's gradient into the step's: the first is kept as autograd made it,
        the second makes a buffer of our own, later ones add into it in place."""
        if grad is None:
            return
        grad = self.comm.summing(grad)      # mixed precision: micro-batches accumulate in the reduce dtype
        prev = self._acc.get(name)
        if prev is None:
            self._acc[name] = grad
        elif name in self._acc_owned:
            prev.add_(grad)
        else:
            self._acc[name] = prev + grad
            self._acc_owned.add(name)

    def flush_deferred(self) -> None:
        """Reduce the gradients accumulated while ``defer`` was on: every bucket, in order,
        as one backward would (members without a gradient send zeros)."""
        if not self.buckets:
            return
        acc, self._acc = self._acc, {}
        self._acc_owned.clear()
        self._begin_backward(queue=False)
        for bi, b in enumerate(self.buckets):
            self.add_bucket(bi, [acc.pop(n, None) for n in b.names])
        self._finish_backward()

    def _fill(self, bi: int, grads: list) -> None:
        """Add the bucket's gradients to its flat buffer: rank-major padded chunks when sharded."""
        b, st, n = self.buckets[bi], self._state[bi], self.comm.size
        if self._acc:        # micro-steps under no_sync: their local sums join this reduction
            grads = [_plus(g, self._acc.pop(m, None)) for m, g in zip(b.names, grads)]
            self._acc_owned.difference_update(b.names)
        st["got"] = [had or g is not None for had, g in zip(st["got"], grads)]
        full = [g if g is not None else torch.zeros(self.specs[m].shape, dtype=self._grad_dtype(m),
                                                     device=self._params[m].device)
                for m, g in zip(b.names, grads)]
        if self.sharded:
            flat = torch.cat([self.specs[m].padded_chunks(g) for m, g in zip(b.names, full)], dim=1).view(-1)
        else:
            flat = torch.cat([g.reshape(-1) for g in full])
        flat = self.comm.summing(flat)
        if self.mode == "zero1":
            self._persistent[bi].add_(flat, alpha=1.0 / n)
        elif st["buf"] is None:
            st["buf"] = flat
        else:
            st["buf"].add_(flat)
        st["ready"] = True

    def _grad_dtype(self, name: str) -> torch.dtype:
        """The dtype of a gradient autograd hands the reducer (the compute dtype's, mixed)."""
        return self.compute_dtype or self._params[name].dtype

    def _begin_backward(self, queue: bool = True):
        self._in_backward = True
        self.events = []     # ("ready", param) / ("launch", bucket) in order, for tests
        self._state = [{"buf": None, "ready": False, "work": None, "out": None, "grads": [None] * len(b.names),
                        "got": [False] * len(b.names)} for b in self.buckets]
        self._next = 0
        self._unnotified = []
        if self.mode == "zero1":
            self._prepare_persistent()
        if queue:
            Variable._execution_engine.queue_callback(self._finish_backward)

    def _launch_ready(self, force: bool = False):
        """Send ready buckets strictly in order (every rank issues the same collectives)."""
        while self._next < len(self.buckets):
            bi, st = self._next, self._state[self._next]
            if not st["ready"]:
                if not force:
                    return
                self._fill(bi, st["grads"])   # members without a gradient send zeros
            self._retire(bi - 1)     # free as you reduce: the previous bucket's full gradients go
            buf = self._persistent[bi] if self.mode == "zero1" else st["buf"]
            label = f"grads, bucket {bi}"
            if self.sharded:
                st["out"] = buf.new_empty(self.buckets[bi].width)
                st["work"] = self.reduce_comm.reduce_scatter_flat(st["out"], buf, label=label, async_op=True,
                                                                  phase="backward",
                                                                  in_place=self.mode != "zero1")   # scratch
            else:
                st["work"] = self.reduce_comm.all_reduce_(buf, label=label, async_op=True, phase="backward")
            if st["work"] is None:     # an axis of one rank: nothing to wait for
                st["work"] = _DONE
            if not self.overlap:     # the baseline: wait now
                self._retire(bi)
            self.events.append(("launch", bi))
            self._next += 1
            self._notify_landed()    # the previous bucket's, now that this one is in flight

    def _retire(self, bi: int) -> None:
        """Wait for bucket ``bi``'s reduction (launched), land its gradients (``_land``; ZeRO-1's
        when backward ends) and, under ZeRO-2/3, free its full-size flat buffer: its shard is
        all that remains (the collective's handle is dropped too, as it holds the buffer).
        ddp's buffer becomes the gradients; ZeRO-1's persists."""
        if bi < 0 or not self._state or self._state[bi]["work"] is None:
            return
        st = self._state[bi]
        if st["work"] is not _DONE:
            st["work"].wait()
            st["work"] = _DONE
        if self.mode != "zero1" and not st.get("landed"):
            self._land(bi)
        if self.mode in ("zero2", "zero3") and self.free_reduced:
            st["buf"] = None

    def _land(self, bi: int) -> None:
        """Bucket ``bi``'s reduced gradients, averaged, into its parameters' ``.grad`` (added to
        what is there: gradients accumulate across backward calls), as soon as its reduction
        completes; ``on_landed`` follows once the next bucket's reduction is issued
        (``_notify_landed``), or when backward ends for the last."""
        b, st = self.buckets[bi], self._state[bi]
        result = st["out"] if self.sharded else st["buf"]
        with torch.no_grad():
            result.div_(self.comm.size)
            for name, off, got in zip(b.names, b.offsets, st["got"]):
                if not got:   # backward did not reach it (alike on every rank: one graph): .grad stays as it
                    continue  # was, None as on one device, not a zero that weight decay would act on
                p = self._params[name]
                g = result[off:off + p.numel()].view(p.shape).to(p.dtype)   # mixed precision: to the master's
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)
        st["landed"] = True
        self._unnotified.append(bi)

    def _notify_landed(self) -> None:
        """``on_landed`` for each bucket landed since the last call, in bucket order."""
        while self._unnotified:
            b = self.buckets[self._unnotified.pop(0)]
            if self.on_landed is not None:
                self.on_landed([self._params[name] for name in b.names])

    def _finish_backward(self):
        late = [n for st, b in zip(self._state, self.buckets) if st["work"] is not None
                for n, g in zip(b.names, st["grads"]) if g is not None]
        if late:
            self._state, self._in_backward = [], False
            raise RuntimeError(f"{', '.join(late)} received a second gradient in one backward after their "
                               "bucket was sent: call backward once per forward of the compiled module")
        self._launch_ready(force=True)
        with torch.no_grad():
            for bi, (b, st) in enumerate(zip(self.buckets, self._state)):
                self._retire(bi)        # lands the bucket's gradients, if it has not yet
                self._notify_landed()
                if self.mode == "zero1":
                    self._finish_zero1(bi, b, st)
                    if self.on_landed is not None:
                        self.on_landed([self._params[name] for name in b.names])
        self._state = []
        self._in_backward = False
        # ZeRO-3: a unit re-gathered for a saved tensor that backward never unpacked would
        # otherwise stay whole until the next forward
        self._bwd.clear()
        self._pending.clear()
        self._drop_inflight()

    # ZeRO-1: the full-gradient buffer persists; the rank's own section doubles as its shard
    # gradients. Local gradients enter pre-divided by N; the own section keeps whatever it
    # accumulated before, so after the reduce-scatter it holds prev + mean(local grads).
    def _prepare_persistent(self):
        n = self.comm.size
        for bi, b in enumerate(self.buckets):
            if bi not in self._persistent:
                first = self._params[b.names[0]]
                self._persistent[bi] = torch.zeros(n * b.width, dtype=self.comm.grad_dtype or first.dtype,
                                                   device=first.device)
            own = self._persistent[bi].view(n, b.width)[self.comm.index]
            for name, off in zip(b.names, b.offsets):
                p = self._params[name]
                view = own[off:off + p.numel()]
                if p.grad is not None and p.grad.data_ptr() == view.data_ptr():
                    continue
                prev = p.grad
                view.zero_()
                if prev is not None:
                    view.add_(prev.reshape(-1))

    def _finish_zero1(self, bi, b, st):
        n = self.comm.size
        buf = self._persistent[bi]
        buf.zero_()
        own = buf.view(n, b.width)[self.comm.index]
        own.copy_(st["out"])
        for name, off, got in zip(b.names, b.offsets, st["got"]):
            p = self._params[name]
            if not got and p.grad is None:     # no gradient now nor accumulated before: stays None
                continue
            p.grad = own[off:off + p.numel()].view(p.shape).to(p.dtype)   # the buffer itself unless mixed


def _plus(a, b):
    return b if a is None else a if b is None else a + b


class _Done:
    """A collective already waited on."""

    @staticmethod
    def wait() -> bool:
        return True


_DONE = _Done()


# ---- the functions the emitted graph calls -------------------------------------------------

class _Zero3Gather(torch.autograd.Function):
    """forward: all-gather the parameter's shards / backward: bucketed reduce-scatter (reducer)."""

    @staticmethod
    def forward(ctx, shard, sync, name):
        ctx.sync, ctx.name = sync, name
        full = sync.gather_for_forward(name)
        sync.track(name, full)
        return full

    @staticmethod
    def backward(ctx, g):
        ctx.sync.add_grad(ctx.name, g)
        return None, None, None


class _BucketSync(torch.autograd.Function):
    """forward: identity on a bucket's full parameters / backward: one bucketed all-reduce (ddp)
    or reduce-scatter (ZeRO-1/2) of their gradients into the owners' ``.grad`` (reducer). One
    autograd node per bucket: autograd runs it when every member's gradient is ready."""

    @staticmethod
    def forward(ctx, sync, bucket, n_values, *tensors):
        ctx.sync, ctx.bucket, ctx.n_tensors = sync, bucket, len(tensors)
        ctx.set_materialize_grads(False)   # a member the loss does not reach: None, so it lands no gradient
        return tuple(sync.compute(v.detach()) for v in tensors[:n_values])   # mixed precision: ddp casts here

    @staticmethod
    def backward(ctx, *grads):
        ctx.sync.add_bucket(ctx.bucket, list(grads))
        return (None, None, None) + (None,) * ctx.n_tensors


def dp_bucket_sync(sync: DataParallelSync, bucket: int, values: list, owners: list) -> tuple:
    """The bucket's parameters as forward reads them (``values``: ddp's parameters, ZeRO-1/2's
    replicas); their gradients go, reduced, to ``owners`` (ZeRO-1/2's shards)."""
    return _BucketSync.apply(sync, bucket, len(values), *values, *owners)


def dp_gather(shard: torch.Tensor, sync: DataParallelSync, name: str) -> torch.Tensor:
    return _Zero3Gather.apply(shard, sync, name)


def dp_release(full: torch.Tensor, sync: DataParallelSync, name: str) -> None:
    sync.release(full)


def dp_unit_start(sync: DataParallelSync, unit: int) -> None:
    """ZeRO-3: issue the all-gather of gather unit ``unit`` (placed by the overlap pass)."""
    sync.start_unit(unit)


def dp_unit_wait(sync: DataParallelSync, unit: int) -> None:
    """ZeRO-3: wait for unit ``unit``'s gather before its first use."""
    sync.wait_unit(unit)


def dp_local_chunk(x: torch.Tensor, dim: int, n: int, index: int) -> torch.Tensor:
    """Rank ``index``'s ceil-chunk of a replicated ``x`` along ``dim`` (Replicate -> Shard, no
    communication; backward is narrow's: the gradient of this rank's part)."""
    lo, hi = chunk_range(x.shape[dim], n, index)
    return x.narrow(dim, lo, hi - lo)
