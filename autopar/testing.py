"""Test helpers: run a function on N local processes (gloo, CPU), simulate a rank of a large
world in this process, measure memory, and compare a compiled module against the
single-device model.

``run(fn, world_size, *args)`` starts one process per rank (forked from a server that has
imported torch and autopar once; spawned where the platform cannot fork), initialises the
default process group (gloo, a free localhost port, ``timeout`` for every collective), calls
``fn(*args)`` on each rank and returns the per-rank results in rank order (``run_threads``: the ranks as
threads of this process, on torch's threaded process group). A rank that raises is reported
with its traceback; ranks still running after ``timeout`` seconds are killed and reported,
so a hang becomes an error. ``RankPool`` keeps such processes alive between calls (a test
suite pays the processes' start once); ``fake_rank`` makes this process one rank of a world
of any size on a process group that moves no data, so a compiled module runs and counts the
bytes its collectives would move.
"""
from __future__ import annotations

import contextlib
import copy
from functools import partial
import datetime
import gc
import io
import logging
import math
import os
import socket
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.autograd.profiler import profile, record_function
from torch.testing._internal.distributed.fake_pg import FakeStore   # registers the "fake" backend
from torch.testing._internal.distributed.multi_threaded_pg import (ProcessLocalGroup, _install_threaded_pg,
                                                                   _uninstall_threaded_pg)

from .api import compile as autopar_compile
from .runtime.module import model_loss

__all__ = ["run", "run_threads", "RankPool", "fake_rank", "parity", "ParityReport", "live_tensor_bytes", "steady_live_bytes",
           "optimizer_state_bytes", "profiled_peak_bytes", "saved_activation_bytes", "mixed_error"]

LOCAL_WORLD_LIMIT = 8


# what every rank imports, done once in the server the ranks are forked from; the last one sets
# what the others made aside from the garbage collector (see there)
_PRELOAD = ["torch", "torch.distributed", "torch.export", "torch._dynamo", "autopar", "autopar.testing",
            "autopar._frozen"]


def _context():
    """The processes' start method: ``forkserver`` where the platform has it, with torch,
    torch.export and autopar imported once in the server (a rank forked from it starts in a
    fraction of a second; ``spawn`` imports them again in every process, seconds each), else
    ``spawn``. Nothing runs on a tensor in the server before it forks (no thread pool to
    break); what the imports made is frozen out of the garbage collector's generations there
    (``autopar._frozen``: else every rank's full collection walks it; two slow test files, with
    the zoo's transformers classes preloaded too, ran 1.3x slower); and each rank gets the
    caller's environment as it is at the call (``_init``), as a spawned one would."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def harness_device() -> torch.device:
    """The device the parity harness runs on: ``AUTOPAR_TEST_DEVICE=cuda`` (with CUDA present)
    puts each rank on GPU ``rank % device_count`` under NCCL (``AUTOPAR_TEST_BACKEND=gloo``:
    over gloo, as ranks sharing one GPU must); otherwise the CPU with gloo."""
    if os.environ.get("AUTOPAR_TEST_DEVICE", "cpu") == "cuda" and torch.cuda.is_available():
        rank = dist.get_rank() if dist.is_initialized() else 0
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def _init(rank: int, world: int, port: int, timeout: float, env: dict) -> None:
    if os.environ != env:      # the caller's environment now, not the fork server's when it started
        os.environ.clear()
        os.environ.update(env)
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cuda = os.environ.get("AUTOPAR_TEST_DEVICE", "cpu") == "cuda" and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    backend = os.environ.get("AUTOPAR_TEST_BACKEND") or ("nccl" if cuda else "gloo")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout))


def _call(rank, seq, fn, args, results) -> None:
    try:
        result = fn(*args)
        buf = io.BytesIO()   # plain bytes: tensors shared by handle die with this process
        torch.save(result, buf)
        results.put((rank, seq, True, buf.getvalue()))
    except BaseException:   # reported to the parent with the rank's traceback
        results.put((rank, seq, False, traceback.format_exc()))


def _worker(rank, world, port, timeout, env, fn, args, results):
    try:
        _init(rank, world, port, timeout, env)
        _call(rank, 0, fn, args, results)
    except BaseException:
        results.put((rank, 0, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _pool_worker(rank, world, port, timeout, env, tasks, results):
    try:
        _init(rank, world, port, timeout, env)
    except BaseException:
        results.put((rank, 0, False, traceback.format_exc()))
        return
    while True:
        job = tasks.get()
        if job is None:
            break
        seq, fn, args = job
        _call(rank, seq, fn, args, results)
        # what survives a job (modules, caches) is set aside from later collections: the
        # collection compile runs (for export's cycles) then scans only the new job's objects
        gc.collect()
        gc.freeze()
    dist.destroy_process_group()


def _check_world(world_size: int) -> None:
    if world_size > LOCAL_WORLD_LIMIT:
        raise ValueError(f"world_size={world_size}: local CPU runs are limited to {LOCAL_WORLD_LIMIT} processes; "
                         "use a virtual Mesh or autopar.testing.fake_rank for larger worlds")


def _collect(procs, results, world_size: int, seq: int, timeout: float):
    """The per-rank results of job ``seq``, in rank order (see ``run`` for the errors)."""
    deadline = time.monotonic() + timeout + 30
    done, errors = {}, {}
    while len(done) + len(errors) < world_size and time.monotonic() < deadline:
        if not results.empty():
            rank, got_seq, ok, value = results.get()
            if got_seq != seq and ok:
                continue
            if ok:
                done[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors[rank] = value
                break
        elif not any(p.is_alive() for p in procs) and results.empty():
            break
        else:
            time.sleep(0.02)
    if errors:
        rank = min(errors)
        raise RuntimeError(f"rank {rank} of {world_size} failed:\n{errors[rank]}")
    missing = [r for r in range(world_size) if r not in done]
    dead = {r: procs[r].exitcode for r in missing if procs[r].exitcode not in (None, -9)}
    if dead:
        raise RuntimeError(f"ranks {sorted(dead)} of {world_size} exited (codes {list(dead.values())}) "
                           "without a result; their stderr above says why")
    if missing:
        raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f}s "
                           "(a collective that some rank never reached?)")
    return [done[r] for r in range(world_size)]


def _stop(procs, grace: float) -> None:
    for p in procs:
        p.join(timeout=grace)
    for p in procs:
        if p.is_alive():
            p.kill()


def run(fn, world_size: int, *args, timeout: float = 180.0):
    """Run ``fn(*args)`` on ``world_size`` fresh local processes; return the results in rank
    order. ``fn`` must be importable (defined at module level)."""
    _check_world(world_size)
    ctx = _context()
    results = ctx.SimpleQueue()
    port = _free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, timeout, env, fn, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        out = _collect(procs, results, world_size, 0, timeout)
    except BaseException:
        _stop(procs, 0.5)
        raise
    _stop(procs, 5)
    return out


def run_threads(fn, world_size: int, *args, timeout: float = 180.0):
    """Run ``fn(*args)`` on ``world_size`` threads of this process, each a rank of torch's
    threaded process group (collectives hand tensors between the threads); return the results
    in rank order. One process: a patch made here reaches every rank and nothing is pickled.
    The group has no point-to-point transfers (pipelines and collective matmuls need ``run``),
    and the ranks share this process's random generator. A rank that raises is reported with
    its traceback (the others, waiting in a collective, are woken); ranks still running after
    ``timeout`` seconds are woken and reported."""
    _check_world(world_size)
    if dist.is_initialized():
        raise RuntimeError("run_threads makes this process's threads the ranks, but it already has a default "
                           "process group; call it outside torchrun, or use run(...)")
    results, errors = [None] * world_size, {}
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    world = _install_threaded_pg()
    store = dist.HashStore()

    def rank_main(rank):
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
            results[rank] = fn(*args)
        except BaseException as exc:      # reported below with the rank's traceback
            errors[rank] = (exc, traceback.format_exc())
            ProcessLocalGroup.exception_handle(exc)    # wakes the ranks waiting in a collective
        finally:
            if dist.distributed_c10d._world is world and dist.is_initialized():
                dist.destroy_process_group()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True, name=f"autopar-rank{r}")
               for r in range(world_size)]
    deadline = time.monotonic() + timeout
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(deadline - time.monotonic(), 0))
        stuck = [r for r, t in enumerate(threads) if t.is_alive()]
        if stuck:
            ProcessLocalGroup.exception_handle(TimeoutError())
            for t in threads:
                t.join(5)
    finally:
        ProcessLocalGroup.reset()
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    failed = {r: e for r, e in errors.items() if not isinstance(e[0], SystemExit)}   # SystemExit: woken
    if failed:
        rank = min(failed)
        raise RuntimeError(f"rank {rank} of {world_size} failed:\n{failed[rank][1]}") from failed[rank][0]
    if stuck:
        raise TimeoutError(f"ranks {stuck} of {world_size} did not finish within {timeout:.0f}s "
                           "(a collective that some rank never reached?)")
    return results


class RankPool:
    """``world_size`` local processes with their process group, kept alive between calls:
    ``pool.run(fn, *args)`` is ``run(fn, world_size, *args)`` without starting processes
    (nor warming torch up) again. Jobs share the processes, so a job must not depend on
    another's leftovers (seeds, environment variables set after the pool started). A job that
    fails or times out closes the pool (its ranks may sit in a collective); ``close()`` ends
    it. ``timeout`` bounds each collective of every job."""

    def __init__(self, world_size: int, timeout: float = 600.0):
        _check_world(world_size)
        self.world_size = world_size
        ctx = _context()
        self._tasks = [ctx.SimpleQueue() for _ in range(world_size)]
        self._results = ctx.SimpleQueue()
        port = _free_port()
        env = dict(os.environ)
        self._procs = [ctx.Process(target=_pool_worker, args=(r, world_size, port, timeout, env, self._tasks[r],
                                                               self._results), daemon=True)
                       for r in range(world_size)]
        for p in self._procs:
            p.start()
        self._seq = 0

    @property
    def alive(self) -> bool:
        return self._procs is not None and all(p.is_alive() for p in self._procs)

    def run(self, fn, *args, timeout: float = 180.0):
        if not self.alive:
            raise RuntimeError(f"this RankPool of {self.world_size} ranks is closed (a job failed or it was "
                               "closed); start another")
        self._seq += 1
        for q in self._tasks:
            q.put((self._seq, fn, args))
        try:
            return _collect(self._procs, self._results, self.world_size, self._seq, timeout)
        except BaseException:
            self.close(grace=0.5)
            raise

    def close(self, grace: float = 5.0) -> None:
        if self._procs is None:
            return
        for p, q in zip(self._procs, self._tasks):
            if p.is_alive():
                q.put(None)
        _stop(self._procs, grace)
        self._procs = None


@contextlib.contextmanager
def quiet():
    """Within the block autopar logs errors only and Python's warnings are ignored (a table's
    notes, not the log's); the logger's level and the warning filters are restored after."""
    logger = logging.getLogger("autopar")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore")
            yield
    finally:
        logger.setLevel(level)


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


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of an optimizer's per-parameter state tensors (Adam's moments; not 0-dim steps)."""
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


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


# ---- parity -------------------------------------------------------------------------------------

class MixedReference:
    """The single-device model under a mixed-precision policy, the reference of a compiled
    module with ``Plan(param_dtype=...)``: ``master`` (the model the optimizer steps, fp32)
    and a copy of it whose floating parameters are in ``dtype``. A step runs forward on the
    copy under ``torch.autocast`` of the inputs' device, with floating inputs cast to
    ``dtype``, and the outputs in ``dtype`` leave it in ``output_dtype`` (None: the masters'
    dtype), the loss computed on them there; backward leaves the copy's gradients in ``dtype``,
    which become the masters' gradients in their own dtype (one device sums nothing); after the
    optimizer steps the masters, ``refresh`` writes them into the copy."""

    def __init__(self, master: torch.nn.Module, dtype: torch.dtype, output_dtype: torch.dtype | None = None):
        self.master, self.dtype = master, dtype
        self.output_dtype = output_dtype or next(iter(master.parameters())).dtype
        self.copy = copy.deepcopy(master)
        with torch.no_grad():
            for p in self.copy.parameters():
                if p.is_floating_point():
                    p.data = p.data.to(dtype)
        self._pairs = list(zip(master.parameters(), self.copy.parameters()))

    def _cast(self, tree):
        return torch.utils._pytree.tree_map(
            lambda x: x.to(self.dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree)

    def forward_backward(self, inputs: tuple, kwargs: dict, loss_of):
        """(outputs, loss) of the copy on the inputs; the masters' ``.grad`` set."""
        args, kw = self._cast((tuple(inputs), dict(kwargs)))
        device = next(iter(self.copy.parameters())).device.type
        with torch.autocast(device, dtype=self.dtype):
            out = self.copy(*args, **kw)
        out = torch.utils._pytree.tree_map(
            lambda x: x.to(self.output_dtype) if isinstance(x, torch.Tensor) and x.dtype == self.dtype else x, out)
        loss = loss_of(out)
        for _, c in self._pairs:
            c.grad = None
        loss.backward()
        for m, c in self._pairs:
            m.grad = None if c.grad is None else c.grad.to(m.dtype)
        return out, loss

    def refresh(self) -> None:
        with torch.no_grad():
            for m, c in self._pairs:
                c.copy_(m)

@dataclass
class ParityReport:
    """Largest mismatches of a compiled module against the single-device model."""
    rank: int
    output_err: float = 0.0
    loss_err: float = 0.0
    grad_err: float = 0.0          # max |g - g_ref| / (atol + rtol |g_ref|): <= 1 passes (mixed: mixed_error)
    param_err: float = 0.0         # same, for parameters after the optimizer steps (mixed: their updates)
    noise_param_err: float = 0.0   # |Δp| / bound for elements whose gradient is float noise
    noise_elements: int = 0
    noise_by_param: dict = field(default_factory=dict)
    losses: list = field(default_factory=list)
    ref_losses: list = field(default_factory=list)
    messages: list = field(default_factory=list)
    step_bytes: dict = field(default_factory=dict)
    """(axis, kind, phase) -> bytes this rank's collectives moved in the first step (forward,
    backward and optimizer step; the gathers of the comparison itself left out)"""
    inspected: object = None       # what parity's ``inspect`` returned for the compiled module

    @property
    def ok(self) -> bool:
        return max(self.output_err, self.loss_err, self.grad_err, self.param_err, self.noise_param_err) <= 1.0


def _bytes_now(stats) -> dict:
    return dict(stats.bytes) if stats is not None else {}


def _bytes_since(stats, mark: dict) -> dict:
    """Bytes per (axis, kind, phase) that ``stats`` counted since ``mark = _bytes_now(stats)``."""
    return {k: b - mark.get(k, 0.0) for k, b in _bytes_now(stats).items() if b - mark.get(k, 0.0) > 0}


def _scaled_err(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float, mask=None) -> float:
    e = (a.float() - b.float()).abs() / (atol + rtol * b.float().abs())
    if mask is not None:
        e = e[mask]
    err = float(e.max()) if e.numel() else 0.0
    return err if not math.isnan(err) else float("inf")     # max() of the report would pass a NaN over


MIXED_TOLERANCE = {"loss": 4, "output": 4, "grad": 8, "update": 16}
"""Mixed-precision parity, in units of the compute dtype's epsilon (bf16: 2^-7), each a bound
on a relative difference: the loss within 4 eps of the reference's; each output and gradient
tensor within 4 and 8 eps of the reference tensor in norm, ``|x - x_ref| <= k eps |x_ref|``
(``mixed_error``); each master tensor's update over the steps (``p - p_0``) within 16 eps of
the reference's, in norm. bf16 rounds every op's result to 8 significant bits, and the
distributed program rounds partial results (a rank's slice of the batch, a tp rank's partial
sum) that one device keeps unrounded, so the two differ by a few eps. Measured on the
project's GPT on CPU (every plan of ``tests/jobs/mixed.py``, 3 AdamW steps): outputs up to 1.0
eps, gradients up to 3.7 eps (tp + sp, a layer norm's bias: the smallest gradients), updates up
to 8.3 eps (pp x ZeRO-2 x tp + sp), the loss 0.01 eps. A gradient 10% off is 12.8 eps; one
with 38% of its elements zeroed, about 80. An elementwise bound cannot tell these apart:
rounding moves single elements by up to 5.9 eps of the tensor's largest element, a 10% scale
moves the largest by 12.8 and a zeroed small element hardly at all. Adam normalises each
element's step to about ``lr`` whatever its gradient's size, so an element whose gradient is
rounding noise steps in a random direction: mixed parity runs Adam with an ``eps`` above that
noise (the tests pass eps=1e-4) so that the update compares the gradients; and a gradient's
scale hardly shows in the update, which is why the gradients are compared tightly."""


def mixed_error(kind: str, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, floor: float = 0.0) -> float:
    """``|a - b| / max(|b|, floor)`` (norms) over ``MIXED_TOLERANCE[kind]`` eps of ``dtype``: <= 1
    passes. ``floor``: the norm below which a reference is rounding noise (parity passes one eps
    of the model's largest gradient element for gradients). A shape mismatch or a non-finite
    value fails (inf)."""
    if a.shape != b.shape:
        return float("inf")
    a, b = a.detach().float(), b.detach().float()
    off, ref = float((a - b).norm()), max(float(b.norm()), floor)
    if not (math.isfinite(off) and math.isfinite(ref)):
        return float("inf")
    if ref == 0.0:
        return 0.0 if off == 0.0 else float("inf")
    return off / ref / (MIXED_TOLERANCE[kind] * torch.finfo(dtype).eps)


def _to_device(tree, device):
    return torch.utils._pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, tree)


def _compared(out, loss_fn):
    """The output parity compares: the output itself, or a model-computed loss's ``logits``."""
    return out if loss_fn is not None or isinstance(out, torch.Tensor) else getattr(out, "logits", None)


def parity(model_fn, mesh, plan, inputs: tuple, target, loss_fn, *, kwargs=None, exported=None, steps: int = 3,
           lr: float = 1e-3,
           rtol: float = 1e-4, atol: float = 1e-5, noise_floor: float = 1e-5,
           optimizer=torch.optim.AdamW, device=None, inspect=None, seed_per_rank: bool = False,
           **optimizer_kwargs) -> ParityReport:
    """Train ``model_fn()`` for ``steps`` optimizer steps (AdamW unless ``optimizer`` says
    otherwise, with ``optimizer_kwargs``) on the global batch on one device and
    compiled for ``mesh``/``plan`` on this rank's slice; compare outputs, loss, gradients
    (gathered) and parameters after every step. Both forwards of a step start from the same
    ``torch.manual_seed``, so a model with dropout draws the same masks.

    ``kwargs`` are keyword inputs of the global batch. With ``loss_fn=None`` the loss is the
    model's own (``output.loss``: a Hugging Face model called with ``labels=``; ``target`` is
    then None) and the outputs compared are its ``logits``. ``exported``: the ExportedProgram
    of the model ``model_fn()`` returns, on the global batch (``compile(exported=...)``).

    Mixed precision (``plan.param_dtype``): the reference is the single-device model under the
    same policy (``MixedReference``), and the errors are scaled by ``MIXED_TOLERANCE`` (see
    there); ``rtol``/``atol``/``noise_floor`` are the fp32 comparison's.

    Tolerances are scaled errors |x - x_ref| / (atol + rtol |x_ref|), fp32. Adam divides by
    sqrt(v): a gradient that is mathematically zero (an attention key bias) is float noise
    whose sign and size differ between the two summation orders, and Adam turns it into a
    step of about lr. Elements whose reference gradient stays below ``noise_floor`` times
    the model's largest gradient at every step are therefore checked against Adam's step
    bound (|Δp| <= 4 lr per step) instead of the tight tolerance; the report counts them.

    ``seed_per_rank``: each rank seeds its steps ``1000 + step + rank`` (the per-rank seeding
    idiom), the single-device model ``1000 + step`` as rank 0 does: dropout still matches, the
    mesh drawing from rank 0's stream (``autopar.runtime.rng``).

    ``device``: where the model and batch live (default ``harness_device()``: the CPU, or with
    ``AUTOPAR_TEST_DEVICE=cuda`` this rank's GPU).

    ``inspect(dm)``, if given, is called on the compiled module before training; the report
    keeps its result (``inspected``) and the first step's bytes per collective (``step_bytes``).
    """
    torch.manual_seed(0)
    device = torch.device(device) if device is not None else harness_device()
    ref = model_fn().to(device)
    move = partial(_to_device, device=device)
    inputs, target, kwargs = move(tuple(inputs)), move(target), move(dict(kwargs or {}))
    model, exported = copy.deepcopy((ref, exported))     # the program stays the copy's own
    dm = autopar_compile(model, mesh, example_inputs=inputs, example_kwargs=kwargs, plan=plan, exported=exported)
    rep = ParityReport(rank=dist.get_rank() if dist.is_initialized() else 0)
    if inspect is not None:
        rep.inspected = inspect(dm)
    mixed = MixedReference(ref, plan.param_dtype, plan.output_cast_dtype) if plan.param_dtype is not None else None
    initial = {k: p.detach().clone() for k, p in ref.named_parameters()} if mixed else {}
    opt_ref = optimizer(ref.parameters(), lr=lr, **optimizer_kwargs)
    opt = dm.optimizer(optimizer, lr=lr, **optimizer_kwargs)
    names = dict(ref.named_parameters())
    noisy = {k: torch.ones_like(p, dtype=torch.bool) for k, p in names.items()}
    moved = {k: torch.zeros_like(p, dtype=torch.bool) for k, p in names.items()}
    local_in, local_kw, local_t = dm.shard_batch(inputs), dm.shard_batch(kwargs), dm.shard_batch(target)

    def loss_of(out, t):
        return model_loss(out) if loss_fn is None else loss_fn(out, t)

    stats = dm.comm_stats
    for step in range(steps):
        mark = _bytes_now(stats)
        opt_ref.zero_grad()
        torch.manual_seed(1000 + step)     # dropout: one device and every rank draw from one seed
        if mixed is None:
            out_ref = ref(*inputs, **kwargs)
            loss_ref = loss_of(out_ref, target)
            loss_ref.backward()
        else:
            out_ref, loss_ref = mixed.forward_backward(inputs, kwargs, lambda out: loss_of(out, target))
        opt.zero_grad()
        torch.manual_seed(1000 + step + (rep.rank if seed_per_rank else 0))
        if plan.pp_schedule is not None:   # a pipeline runs whole steps; it returns the slice's loss
            loss = dm.train_step(local_in, local_t, loss_fn, kwargs=local_kw)
        else:
            out = dm(*local_in, **local_kw)
            loss = loss_of(out, local_t)
            loss.backward()
            got, want = _compared(out, loss_fn), _compared(out_ref, loss_fn)
            if want is not None and mixed is not None:
                rep.output_err = max(rep.output_err, mixed_error("output", got.detach(),
                                                                 dm.shard_batch(want.detach()), plan.param_dtype))
            elif want is not None:
                rep.output_err = max(rep.output_err, _scaled_err(got.detach(), dm.shard_batch(want.detach()),
                                                                 rtol, atol))
        if step == 0:
            rep.step_bytes = _bytes_since(stats, mark)
        gl = loss.detach().clone()
        if mesh.axis_size("dp") > 1:
            dist.all_reduce(gl, group=mesh.group("dp"))
            gl /= mesh.axis_size("dp")
        rep.losses.append(float(gl))
        rep.ref_losses.append(float(loss_ref.detach()))
        if mixed is not None:
            eps = torch.finfo(plan.param_dtype).eps
            rep.loss_err = max(rep.loss_err, _scaled_err(gl, loss_ref.detach(), MIXED_TOLERANCE["loss"] * eps, 0.0))
        else:
            rep.loss_err = max(rep.loss_err, _scaled_err(gl, loss_ref.detach(), rtol, atol))
        grads = dm.full_grads()
        gmax = max((float(p.grad.abs().max()) for p in names.values() if p.grad is not None and p.numel()),
                   default=0.0)
        for k, p in names.items():
            if p.grad is None:    # frozen, unused by forward, or cut off from the loss: none on one device
                if grads.get(k) is not None:
                    rep.messages.append(f"step {step}: {k} has a gradient, which it has not on one device "
                                        "(frozen, or not reached from the loss)")
                    rep.grad_err = float("inf")
                continue
            noisy[k] &= p.grad.abs() <= noise_floor * gmax
            moved[k] |= p.grad != 0   # exact zeros are deterministic: they stay in the tight check
            if grads.get(k) is None:
                rep.messages.append(f"step {step}: no gradient for {k}")
                rep.grad_err = float("inf")
                continue
            if mixed is not None:
                rep.grad_err = max(rep.grad_err, mixed_error("grad", grads[k], p.grad, plan.param_dtype,
                                                             torch.finfo(plan.param_dtype).eps * gmax))
            else:
                rep.grad_err = max(rep.grad_err, _scaled_err(grads[k], p.grad, rtol, 1e-6))
        opt_ref.step()
        if mixed is not None:
            mixed.refresh()
        mark = _bytes_now(stats)
        opt.step()
        if step == 0:
            for k, b in _bytes_since(stats, mark).items():
                rep.step_bytes[k] = rep.step_bytes.get(k, 0.0) + b
        full = dm.full_state_dict()
        lacking = [k for k in names if k not in full]
        if lacking:
            rep.messages.append(f"step {step}: full_state_dict() lacks {', '.join(lacking)}")
            rep.param_err = float("inf")
            names = {k: p for k, p in names.items() if k in full}
        if mixed is not None:
            for k, p in names.items():
                if not p.requires_grad:   # frozen: no master, kept in the dtype forward reads, never changed
                    if not torch.equal(full[k], p.detach().to(full[k].dtype)):
                        rep.messages.append(f"step {step}: the frozen {k} changed")
                        rep.param_err = float("inf")
                    continue
                if full[k].dtype != p.dtype:
                    rep.messages.append(f"step {step}: the master of {k} is {full[k].dtype}, expected {p.dtype}")
                    rep.param_err = float("inf")
                rep.param_err = max(rep.param_err, mixed_error("update", full[k].float() - initial[k].float(),
                                                               p.detach().float() - initial[k].float(),
                                                               plan.param_dtype))
            continue
        for k, p in names.items():
            noisy[k] &= moved[k]
            rep.param_err = max(rep.param_err, _scaled_err(full[k], p.detach(), rtol, atol, ~noisy[k]))
            bound = 4 * lr * (step + 1)
            diff = (full[k] - p.detach()).abs()[noisy[k]]
            if diff.numel():
                rep.noise_param_err = max(rep.noise_param_err, float(diff.max()) / bound)
    rep.noise_by_param = {k: int(m.sum()) for k, m in noisy.items() if int(m.sum())}
    rep.noise_elements = sum(rep.noise_by_param.values())
    return rep
