"""The calibration's runtime probes: small models compiled by ``autopar.compile`` and stepped on
every rank of a pool, their actions and steps timed as the runtime runs them. GPTs of next to
no arithmetic as pipelines (``op_overhead_probe``: framework time per op, pass and message,
what a message costs a schedule, what ends a schedule), and the synthetic stack under every
dp mode and under tensor parallelism (``sync_probe``, ``shared_step_probe``: the runtime's host
work). What is fitted to them is ``host_fits``' and ``link_fits``'."""
from __future__ import annotations

import collections
import functools
import statistics
import time
import warnings

import torch
import torch.distributed as dist

from autopar.api import compile as autopar_compile
from autopar.mesh import Mesh
from autopar.models import GPTConfig, TinyGPT, gpt_batch
from autopar.planspec import Plan

from ..estimate import Profiles
from ..pipeline import partition
from .stack import SYNC_BLOCKS, SYNC_DIM, SYNC_ROWS, Stack

__all__ = ["op_overhead_probe", "sync_probe", "shared_step_probe", "compiled_step", "probe_layer_ops", "OP_PIPELINES",
           "HOP_PIPELINES", "TAIL_PIPELINES", "WAKE_PIPELINES", "PROBE_VOCAB", "SYNC_MODES", "SYNC_STEPS",
           "SHARED_STEPS"]

OP_PIPELINES = ((2, "1f1b", 8), (2, "zero_bubble", 8), (10, "1f1b", 8), (10, "zero_bubble", 8))   # (layers, schedule, h)
HOP_PIPELINES = ((2, "1f1b", 16), (4, "1f1b", 16), (4, "interleaved", 16))    # those fit_runtime_hop replays
# (layers, schedule, h, seq): with the 1F1B hop pipelines, those fit_tail fits (the other rank
# waiting longer at the end: longer actions; widths and lengths none of the hold-out grid's)
TAIL_PIPELINES = ((4, "1f1b", 128, 24), (8, "1f1b", 80, 40))
# (layers, schedule, h): those fit_runtime_wake replays, one stage a process on 2 x cores processes
WAKE_PIPELINES = ((4, "1f1b", 16), (8, "1f1b", 16))
PROBE_VOCAB = 16       # the probe GPTs' vocabulary unless a pipeline gives one (its tied embedding)
SYNC_MODES = ("ddp", "zero1", "zero2", "zero3")
SYNC_STEPS = 25         # rounds of the dp runtime probe (``sync_probe``)
SHARED_STEPS = 9        # rounds of the probe of ranks sharing cores (``shared_step_probe``)


def probe_layer_ops() -> dict:
    """Op name -> count of one layer of the op_overhead probe's GPTs (h = 8): the mix
    ``Device.op_weights`` are relative to, so the probe's layers weigh what they count."""
    c = GPTConfig(vocab=PROBE_VOCAB, seq=8, dim=8, heads=2, layers=2, max_seq=8)
    x, _ = gpt_batch(c, 2)
    layer = next(g for g in Profiles(TinyGPT(c), (x,), blocks_once=False).base.groups if g.name.startswith("blocks"))
    return dict(layer.op_names)


def op_overhead_probe(pipelines: tuple, steps: int = 25) -> list:
    """On each rank of pipelines of as many stages as processes (2 unless the wake probe's;
    micro-batches of 2 sequences of 8 tokens,
    or of ``seq``) of GPTs of ``(layers, schedule, h[, seq[, vocab, heads]])`` each (vocabulary 16,
    2 heads unless given), all compiled first, then stepped in turn, round
    after round, each step after a barrier (a disturbance of the machine falls on all alike):
    per pipeline (thread CPU seconds of this
    rank's F, B (and W) actions per micro-batch, median of ``steps`` rounds after 3; (op name ->
    count of the ops the profile counts in its stage per micro-batch, its matmuls with a
    parameter weight); CPU seconds per transfer posted (a batch's over its transfers);
    {kind: median thread CPU seconds of one action of that kind}; the mean wall seconds of
    the step's schedule, ``train_step``'s own timer; this rank's pipeline index; per step, the
    wall time its schedule's last action ended and the seconds from then to ``train_step``'s
    return, for ``tails``). Under the interleaved schedule each rank runs two stages.

    The schedule's mean, not its median: the hop fitted to it is a latency the estimate adds to
    every step, and a run takes the sum of its steps. On the machine of BENCHMARKS.md a
    message's latency is heavy-tailed (a step of gloo p2p or collectives after a barrier has a
    median well under its mean, 2.7 and 5.1 ms for five 100 KB all-reduces: benchmarks/gloo_tail.py),
    so a median fits the hop of the usual step and the estimate misses the slow ones (fitted to
    medians, the hold-out grid's 1F1B read 0.87-0.92 of its measured steps by plan: BENCHMARKS.md,
    bench_holdout.py; ``autopar.holdout.step_time``). The actions' CPU times stay medians: they
    are the work, which the tail does not add to."""
    torch.set_num_threads(1)
    clock = _ActionClock()
    runs = [_probe_pipeline(clock, *pipeline) for pipeline in pipelines]
    got = [{k: [] for k in ("compute", "message", "F", "B", "W", "schedule", "tail")} for _ in runs]
    for i in range(steps + 3):
        for k, (step, _, _) in enumerate(runs):
            clock.reset()
            dist.barrier()
            schedule, end, past = step()
            if i >= 3:
                g, spent, count = got[k], clock.spent, clock.count
                g["compute"].append(spent["compute"] / _MICROBATCHES)
                g["message"].append(spent["message"] / max(count["message"], 1))
                for kind in ("F", "B", "W"):
                    g[kind].append(spent[kind] / max(count[kind], 1))      # one action's
                g["schedule"].append(schedule)
                g["tail"].append((end, past))
    dist.barrier()
    return [(statistics.median(g["compute"]), ops, statistics.median(g["message"]),
             {kind: statistics.median(g[kind]) for kind in ("F", "B", "W")}, statistics.mean(g["schedule"]), stage,
             g["tail"])
            for g, (_, ops, stage) in zip(got, runs)]


_MICROBATCHES = 4       # the probe pipelines' micro-batches (of 2 sequences each)


class _ActionClock:
    """Thread CPU seconds of a compiled pipeline's actions and transfers since the last
    ``reset``: ``spent`` per kind of compute action (F, B, W), all compute and the messages;
    ``count`` of the actions of each kind and of the messages."""

    def __init__(self):
        self.spent = {"compute": 0.0, "message": 0.0, "F": 0.0, "B": 0.0, "W": 0.0}
        self.count = {"message": 0, "F": 0, "B": 0, "W": 0}

    def reset(self) -> None:
        self.spent.update(compute=0.0, message=0.0, F=0.0, B=0.0, W=0.0)
        self.count.update(message=0, F=0, B=0, W=0)

    def watch(self, dm) -> None:
        """Time the actions and the batches of transfers (a batch's CPU time counted per
        message) of the compiled pipeline ``dm`` (``PipelineModule.instrument``)."""
        spent, count = self.spent, self.count

        def timed(run_action, a, *args, **kwargs):
            c0 = time.thread_time()
            try:
                return run_action(a, *args, **kwargs)
            finally:
                took = time.thread_time() - c0
                compute = a.kind in ("F", "B", "W")
                spent["compute" if compute else "message"] += took
                count[a.kind if compute else "message"] += 1
                if compute:
                    spent[a.kind] += took

        def timed_post(post, batch, *args, **kwargs):     # a batch of transfers: its CPU time per message
            c0 = time.thread_time()
            try:
                return post(batch, *args, **kwargs)
            finally:
                spent["message"] += time.thread_time() - c0
                count["message"] += len(batch)

        dm.instrument("action", lambda run_action: functools.partial(timed, run_action))
        dm.instrument("batch", lambda post: functools.partial(timed_post, post))


def _lm_loss(out, target):
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def _probe_pipeline(clock: _ActionClock, layers: int, schedule: str, dim: int, seq: int = 8, vocab: int = PROBE_VOCAB,
                    heads: int = 2) -> tuple:
    """(step, (op name -> count of the ops the profile counts in this rank's stage, its matmuls
    with a parameter weight), this rank's pipeline index) of a GPT of ``layers`` layers of width
    ``dim`` compiled as a pipeline of one stage a process under ``schedule``, its actions timed
    by ``clock``. ``step()`` returns the schedule's seconds (``train_step``'s own timer), the
    wall time its last action ended and the seconds from then to ``train_step``'s return."""
    m = _MICROBATCHES
    c = GPTConfig(vocab=vocab, seq=seq, dim=dim, heads=heads, layers=layers, max_seq=seq)
    torch.manual_seed(0)
    x, t = gpt_batch(c, 8)
    dm = autopar_compile(TinyGPT(c), Mesh(pp=dist.get_world_size()), example_inputs=(x,),
                         plan=Plan(pp_schedule=schedule, microbatches=m,
                                   virtual_stages=2 if schedule == "interleaved" else 1))
    opt = dm.optimizer(torch.optim.SGD, lr=1e-3)
    lx, lt = dm.shard_batch((x,)), dm.shard_batch(t)
    clock.watch(dm)

    def step():
        opt.zero_grad(set_to_none=True)
        dm.train_step(lx, lt, _lm_loss)
        done = time.time()
        opt.step()
        end = max((b for _, _, b in dm.timeline), default=done)     # the schedule's last action's end
        return dm.step_time, end, done - end

    groups = Profiles(TinyGPT(c), (x[: 8 // m],)).base.groups
    # the pipeline pass's even split, one stage a process
    starts = partition([float(g.ops) for g in groups], dist.get_world_size()) + [len(groups)]
    stage = min(int(k) for k in dm.stages)      # this rank's pipeline index
    mine = groups[starts[stage]:starts[stage + 1]]
    names = sum((collections.Counter(g.op_names) for g in mine), collections.Counter())
    return step, (dict(names), sum(g.weight_matmuls for g in mine)), stage


def _stack_inputs(world: int):
    """A probe rank's set-up (one thread, torch.distributed's deprecation warnings off), then
    per size of ``SYNC_BLOCKS``: (blocks, the world's batch of the synthetic stack, seeded)."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    for blocks in SYNC_BLOCKS:
        torch.manual_seed(0)
        yield blocks, torch.randn(SYNC_ROWS * world, SYNC_DIM)


def sync_probe(modes: tuple, steps: int) -> dict:
    """Run on every rank (a job of ``Ranks``' pool): (mode, blocks) -> thread CPU seconds of a
    training step (zero_grad, forward, backward, AdamW step) of the synthetic stack of
    ``SYNC_BLOCKS`` blocks (d = 8, 4 rows a rank: no arithmetic to speak of) compiled by
    autopar on the dp axis of the world under each of ``modes``; ("adam", blocks): a plain
    AdamW step over the same parameters, their gradients set. Thread CPU time: the rank's own
    work, not its waits on collectives (gloo's threads carry those); the median over ``steps``
    rounds, each stepping every model once."""
    world, steps_of = dist.get_world_size(), {}
    for blocks, x in _stack_inputs(world):
        model = Stack(SYNC_DIM, blocks)
        model(x).square().mean().backward()
        steps_of[("adam", blocks)] = torch.optim.AdamW(model.parameters(), lr=1e-3).step
        for mode in modes:
            steps_of[(mode, blocks)] = compiled_step(Stack(SYNC_DIM, blocks), world, mode, x)
        steps_of[("tp", blocks)] = compiled_step(Stack(SYNC_DIM, blocks), world, "tp", x)
    # round-robin, one step of each per round: a disturbance of the machine falls on all alike
    for step in steps_of.values():
        for _ in range(3):
            step()
    times = {key: [] for key in steps_of}
    walls = {key: [] for key in steps_of if key[0] == "tp"}
    for _ in range(steps):
        for key, step in steps_of.items():
            if key in walls:    # the ranks lined up: the wall time is the step's, not a wait for a late peer
                dist.barrier()
            c0, t0 = time.thread_time(), time.perf_counter()
            step()
            times[key].append(time.thread_time() - c0)
            if key in walls:
                walls[key].append(time.perf_counter() - t0)
    dist.barrier()
    out = {key: statistics.median(ts) for key, ts in times.items()}
    out.update({("tp wall", key[1]): statistics.median(ts) for key, ts in walls.items()})
    for blocks in SYNC_BLOCKS:     # the collectives a tp step issues, as the module counts them
        stats = steps_of[("tp", blocks)].stats
        stats.reset()
        steps_of[("tp", blocks)]()
        out[("tp collectives", blocks)] = sum(n for (axis, _, _), n in stats.calls.items() if axis == "tp")
    out[("tp kinds",)] = sorted(steps_of[("tp", SYNC_BLOCKS[-1])].stats.calls)     # (axis, kind, phase)
    return out


def compiled_step(model, world: int, mode: str, x):
    """A training step of ``model`` compiled on the dp axis of ``world`` ranks under ``mode``
    (``"tp"``: on its tp axis, ``Plan(tp=True)``)."""
    if mode == "tp":
        dm = autopar_compile(model, Mesh(tp=world), example_inputs=(x,), plan=Plan(tp=True))
    else:
        dm = autopar_compile(model, Mesh(dp=world), example_inputs=(x,), plan=Plan(dp=mode))
    opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
    lx = dm.shard_batch((x,))

    def step():
        opt.zero_grad(set_to_none=True)
        dm(*lx).square().mean().backward()
        opt.step()

    step.stats = dm.comm_stats      # calls and bytes per (axis, kind, phase)
    return step


def shared_step_probe(modes: tuple, steps: int) -> dict:
    """Run on every rank of the pool of ranks sharing cores: (mode, blocks) -> the median wall
    seconds of a training step of the synthetic stack of ``SYNC_BLOCKS`` blocks compiled by
    autopar on all the ranks under each of ``modes`` (``compiled_step``; ``"tp"``: on the tp
    axis), each step after a barrier, round-robin over ``steps`` rounds."""
    world, steps_of = dist.get_world_size(), {}
    for blocks, x in _stack_inputs(world):
        for mode in modes:
            steps_of[(mode, blocks)] = compiled_step(Stack(SYNC_DIM, blocks), world, mode, x)
    for step in steps_of.values():
        for _ in range(2):
            step()
    walls = {key: [] for key in steps_of}
    for _ in range(steps):
        for key, step in steps_of.items():
            dist.barrier()
            t0 = time.perf_counter()
            step()
            walls[key].append(time.perf_counter() - t0)
    dist.barrier()
    return {key: statistics.median(ts) for key, ts in walls.items()}
