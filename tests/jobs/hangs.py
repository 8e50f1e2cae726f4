"""Run-time hangs on real processes: a rank that dies, stalls or issues another collective makes
the others raise ``CollectiveError`` within the mesh's timeout, never hang.

A job that expects the error catches it and returns what it says (``_failed``), so that the
test reads every rank's message; a rank that dies takes its result with it, and the test reads
the survivor's error from ``autopar.testing.run``'s report instead.
"""
from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

import autopar
from autopar.models import TinyMLP
from autopar.runtime.flight import CollectiveError

from .common import mlp_batch, mse, step
from .data_parallel import WideMLP

PUBLISHED = 1.5     # seconds a rank waits before dying or stalling: its ring has been published


def _ddp(timeout: float, plan: str = "ddp"):
    torch.set_num_threads(1)
    x, y = mlp_batch()
    dm = autopar.compile(TinyMLP(), autopar.Mesh(dp=2, timeout=timeout), example_inputs=(x,),
                         plan=autopar.Plan(dp=plan))
    opt = torch.optim.SGD(dm.parameters(), lr=0.1)
    step(dm, opt, (x,), y, mse)
    dist.barrier()          # the ranks start the measured part together (compile times differ)
    return dm, opt, x, y


def _failed(exc: CollectiveError, start: float) -> dict:
    return {"message": str(exc), "after": time.monotonic() - start, "path": exc.path}


def _made_on_every_rank(out):
    """``out`` once every rank has made its error: rank 0's process hosts the store that an
    error reads the other ranks' reports from, so each rank notes in it that its message is
    made and rank 0 returns (and its process may end) only after all have, within 30 s."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"hangs/made/{dist.get_rank()}", "1")
    if dist.get_rank() == 0:
        store.wait([f"hangs/made/{r}" for r in range(dist.get_world_size())], datetime.timedelta(seconds=30))
    return out


def killed_rank(timeout: float):
    """Rank 1 dies after its forward, before the backward's gradient all-reduce."""
    dm, opt, x, y = _ddp(timeout)
    opt.zero_grad()
    out = dm(*dm.shard_batch((x,)))
    if dist.get_rank() == 1:
        time.sleep(PUBLISHED)
        os._exit(1)
    mse(out, dm.shard_batch(y)).backward()      # rank 0 raises here
    return "finished"


def stalled_rank(timeout: float, stall: float, linger: float):
    """Rank 1 stalls ``stall`` seconds (longer than the timeout) before its next step; rank 0
    then stays up ``linger`` seconds (the store lives in its process) so that rank 1's own
    error can read rank 0's report."""
    dm, opt, x, y = _ddp(timeout)
    if dist.get_rank() == 1:
        time.sleep(stall)
    start = time.monotonic()
    try:
        opt.zero_grad()
        step(dm, opt, (x,), y, mse)
    except CollectiveError as exc:
        out = _failed(exc, start)
        if dist.get_rank() == 0:
            time.sleep(linger)
        return out
    return None


def mismatched_calls(timeout: float):
    """After a ZeRO-3 step, rank 0 gathers the full state dict while rank 1 clips gradients:
    an all-gather and an all-reduce meet on the dp group."""
    dm, opt, x, y = _ddp(timeout, "zero3")
    start = time.monotonic()
    try:
        if dist.get_rank() == 0:
            dm.full_state_dict()
        else:
            dm.clip_grad_norm_(1.0)
    except CollectiveError as exc:
        return _made_on_every_rank(_failed(exc, start))
    return None


def pipeline_killed_rank(timeout: float):
    """1F1B over two stages: rank 1 (the last stage) dies in its forward of micro-batch 1 of
    the second step; rank 0 waits for a gradient that never comes."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = mlp_batch()
    dm = autopar.compile(WideMLP(d=16), autopar.Mesh(pp=2, timeout=timeout), example_inputs=(x,),
                         plan=autopar.Plan(pp_schedule="1f1b", microbatches=2))
    opt = torch.optim.SGD(dm.parameters(), lr=0.1)
    dm.train_step((x,), y, mse)
    opt.step()
    opt.zero_grad()
    dist.barrier()
    if dist.get_rank() == 1:
        calls = []

        def die(module, args):
            calls.append(1)
            if len(calls) == 2:
                time.sleep(PUBLISHED)
                os._exit(1)
        for stage in dm.stages.values():
            stage.register_forward_pre_hook(die)
    dm.train_step((x,), y, mse)      # rank 0 raises here
    return "finished"


# ---- a rank that raises: its peers fail fast, naming it --------------------------------------------

def refused_on_one_rank(timeout: float):
    """Rank 1's example inputs are one feature short, which its capture refuses; rank 0's are
    right. (error type, message, seconds in compile) on every rank."""
    x, _ = mlp_batch()
    if dist.get_rank() == 1:
        x = x[:, :-1]
    start = time.monotonic()
    try:
        autopar.compile(TinyMLP(), autopar.Mesh(dp=2, timeout=timeout), example_inputs=(x,),
                        plan=autopar.Plan(dp="ddp"))
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return None, "", time.monotonic() - start


def raised_in_forward(timeout: float, lag: float):
    """First both ranks' forwards raise alike (a wrong dtype) and both go on, rank 1 ``lag``
    seconds later, which rank 0 waits out in the gradient all-reduce: its peer's error stood,
    but it had raised alike. Then rank 1's forward alone raises (a hook on its graph) and rank
    1 carries on, its process alive; rank 0 goes on to the backward's gradient all-reduce,
    which rank 1 never issues. Rank 1 stays up until rank 0 has its error, and rank 0 (whose
    process hosts the store) until rank 1 has seen that."""
    dm, opt, x, y = _ddp(timeout)
    store = dist.distributed_c10d._get_default_store()
    try:
        dm(*dm.shard_batch((x.double(),)))
    except ValueError:
        pass
    if dist.get_rank() == 1:
        time.sleep(lag)
    start = time.monotonic()
    opt.zero_grad()
    step(dm, opt, (x,), y, mse)
    waited = time.monotonic() - start
    start = time.monotonic()

    def peer():
        opt.zero_grad()
        step(dm, opt, (x,), y, mse)
    out = _rank1_raises(store, [dm.module], "forward", lambda: dm(*dm.shard_batch((x,))), peer, start)
    return out if dist.get_rank() == 1 or out is None else dict(out, waited=waited)


def _rank1_raises(store, modules: list, where: str, call, peer, start: float):
    """Rank 1 runs ``call`` with a hook that raises in the forward of each of ``modules`` and
    carries on, its process alive; rank 0 runs ``peer``, which waits for a collective rank 1
    never issues. Rank 1 stays up until rank 0 has its error, and rank 0 (whose process hosts
    the store) until rank 1 has seen that. Rank 1 returns its error, rank 0 what it raised
    (``_failed``) or None."""
    if dist.get_rank() == 1:
        def broken(module, args):
            raise RuntimeError(f"injected into rank 1's {where}")
        for m in modules:
            m.register_forward_pre_hook(broken)
        out = None
        try:
            call()
        except RuntimeError as exc:
            out = {"error": str(exc)}
        store.wait(["hangs/raised/made"], datetime.timedelta(seconds=30))
        store.set("hangs/raised/seen", "1")
        return out
    try:
        peer()
        out = None
    except CollectiveError as exc:
        out = _failed(exc, start)
    store.set("hangs/raised/made", "1")
    store.wait(["hangs/raised/seen"], datetime.timedelta(seconds=30))
    return out


def pipeline_raised(timeout: float):
    """1F1B over two stages: rank 1 (the last stage) raises in its first forward of the second
    step and carries on; rank 0 waits for a gradient it will not send."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = mlp_batch()
    dm = autopar.compile(WideMLP(d=16), autopar.Mesh(pp=2, timeout=timeout), example_inputs=(x,),
                         plan=autopar.Plan(pp_schedule="1f1b", microbatches=2))
    store = dist.distributed_c10d._get_default_store()
    dm.train_step((x,), y, mse)
    dist.barrier()
    start = time.monotonic()
    run = lambda: dm.train_step((x,), y, mse)     # noqa: E731
    return _rank1_raises(store, list(dm.stages.values()), "stage", run, run, start)
