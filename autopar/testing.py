"""Test helpers: run a function on N local processes (gloo, CPU), simulate a rank of a large
world in this process, measure memory, and compare a compiled module against the
single-device model.

The launcher is ``autopar.launch``'s, re-exported here: ``run(fn, world_size, *args)`` runs
``fn`` on one fresh process per rank (``run_threads``: on threads of this process, on torch's
threaded process group) and returns the per-rank results in rank order, ``RankPool`` keeps
such processes alive between calls (a test suite pays the processes' start once). The parity
harness is ``autopar.compare``'s, re-exported too: ``parity`` trains a model on one device and
compiled for a mesh and reports the largest errors, ``scaled_error`` and ``mixed_error`` are
what it measures them by. Here alone: ``fake_rank`` makes this process one rank of a world of
any size on a process group that moves no data, so a compiled module runs and counts the
bytes its collectives would move (torch's fake process group, from ``torch.testing._internal``,
which the library itself does not import); and the memory census (live tensors, a profiled
peak, what autograd saves).
"""
from __future__ import annotations

import contextlib
import gc
import time

import torch
import torch.distributed as dist
from torch.autograd.profiler import profile, record_function
from torch.testing._internal.distributed.fake_pg import FakeStore   # registers the "fake" backend

from .compare import MIXED_TOLERANCE, MixedReference, ParityReport, mixed_error, parity, scaled_error
from .launch import LOCAL_WORLD_LIMIT, RankPool, harness_device, quiet, run, run_threads
from .runtime.optim import optimizer_state_bytes

__all__ = ["run", "run_threads", "RankPool", "quiet", "harness_device", "fake_rank", "parity", "ParityReport",
           "MixedReference", "MIXED_TOLERANCE", "scaled_error", "mixed_error", "live_tensor_bytes",
           "steady_live_bytes", "optimizer_state_bytes", "profiled_peak_bytes", "saved_activation_bytes",
           "LOCAL_WORLD_LIMIT"]


@contextlib.contextmanager
def fake_rank(world_size: int, rank: int = 0):
    """Within the block this process is rank ``rank`` of ``world_size`` on torch's fake
    process group: collectives return at once and move no data (their results are garbage),
    so a compiled module builds its mesh, runs its steps and counts the bytes each collective
    would move, for a world of any size and without processes. Meshes built inside run on it."""
    if dist.is_initialized():
        raise RuntimeError("fake_rank needs a process without a default process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ---- memory census ---------------------------------------------------------------------------

def live_tensor_bytes(collect: bool = True) -> int:
    """Bytes of every distinct tensor storage reachable from Python objects in this process
    (after a garbage collection, unless ``collect`` is false)."""
    if collect:
        gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        try:
            if not issubclass(type(obj), torch.Tensor) or obj.device.type == "meta":
                continue
            st = obj.untyped_storage()
            key = st.data_ptr()
        except Exception:  # fake tensors of traced graphs hold no memory
            continue
        if key and key not in seen:
            seen.add(key)
            total += st.nbytes()
    return total


def steady_live_bytes(samples: int = 5, pause: float = 0.05) -> int:
    """``live_tensor_bytes`` in the steady state: the smallest of a few samples ``pause``
    apart. A synchronous gloo collective returns once its data has arrived, but gloo's worker
    thread may drop its reference to the buffers a moment later; a real leak persists."""
    gc.collect()
    out = []
    for i in range(samples):
        if i:
            time.sleep(pause)
        out.append(live_tensor_bytes(collect=False))
    return min(out)


def profiled_peak_bytes(fn, before=None) -> int:
    """Peak of (allocated - freed) bytes of tensor storage while ``fn`` runs, from the
    profiler's allocator records ([memory] events): the CPU has no allocator peak counter.
    The profiler does not see a free of a block allocated before it started, so what ``fn``
    frees of older tensors is not subtracted; ``before`` (e.g. the previous training step)
    runs inside the window first, so that what ``fn`` frees of its allocations is seen, and
    the peak is taken from where ``fn`` starts."""
    with profile(profile_memory=True, use_kineto=True) as prof:
        if before is not None:
            before()
        with record_function(_MEASURED):
            fn()
    events = prof.kineto_results.events()
    start = next((e.start_ns() for e in events if e.name() == _MEASURED), 0) if before is not None else 0
    cur = peak = 0
    for e in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        if e.start_ns() < start:      # ``before``: its allocations are seen, so fn's frees of them count
            continue
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


_MEASURED = "autopar::measured"


def saved_activation_bytes(fn, exclude=()) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn`` runs, leaving
    out the storages whose data pointers are in ``exclude`` (parameters: saved by reference,
    not activations); a DTensor counts its local tensor."""
    seen, total, held = set(exclude), [0], []

    def pack(t):
        st = getattr(t, "_local_tensor", t).untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            held.append(st)    # alive until the count is done, so no address is reused meanwhile
            total[0] += st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total[0]
