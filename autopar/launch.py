"""The process launcher: run a function on N local processes (gloo, CPU; or one GPU each), or
on N threads of this process, each a rank of a process group.

``run(fn, world_size, *args)`` starts one process per rank (forked from a server that has
imported torch and autopar once; spawned where the platform cannot fork), initialises the
default process group (gloo, a free localhost port, ``timeout`` for every collective), calls
``fn(*args)`` on each rank and returns the per-rank results in rank order (``run_threads``: the ranks as
threads of this process, on torch's threaded process group). A rank that raises is reported
with its traceback; ranks still running after ``timeout`` seconds are killed and reported,
so a hang becomes an error. ``RankPool`` keeps such processes alive between calls (a test
suite, the zoo and the fuzzer pay the processes' start once). ``harness_device`` is the
device those ranks run on; ``quiet`` silences autopar's log and Python's warnings in a block.

The library's own runs (``verify``, the zoo, the fuzzer, the doctor) launch ranks with it;
``autopar.testing``, the test harness, re-exports it.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import io
import logging
import os
import socket
import threading
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run", "run_threads", "RankPool", "quiet", "harness_device", "LOCAL_WORLD_LIMIT"]

LOCAL_WORLD_LIMIT = 8


# what every rank imports, done once in the server the ranks are forked from (the test harness
# too: the test suite's jobs import it); the last one sets what the others made aside from the
# garbage collector (see there)
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
    # torch's threaded process group lives in torch.testing._internal, which importing autopar
    # does not load: imported here, by the one function that runs on it
    from torch.testing._internal.distributed.multi_threaded_pg import (ProcessLocalGroup, _install_threaded_pg,
                                                                       _uninstall_threaded_pg)
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
