"""The order of collectives and transfers replayed under NCCL's rules (autopar.runtime.ordering):
the replay on orders written out by hand, an order that posts each transfer alone and the
receives one compute action ahead (it deadlocks: the replay says where), the batches ``schedule.batch_transfers`` plans
for every schedule and for random action lists, and the order the runtime really issues, recorded
by the flight recorder: on processes for a few pipelines and the collective matmul's rings, and on
torch's fake process group (the runtime's own code, moving no data) for every schedule x pp x
micro-batches and a 3-D mesh.
"""
import random

import pytest
import torch
import torch.distributed as dist

from autopar.runtime import flight
from autopar.runtime.ordering import OrderDeadlock, check, replay
from autopar.runtime.pipeline_module import NCCL_MERGE
from autopar.schedule import (COMPUTE, Action, Schedule, ScheduleDeadlock, batch_transfers, build_schedule, lower,
                              simulate)
from autopar.testing import fake_rank

from jobs import ordering as jobs


# ---- orders written out --------------------------------------------------------------------------

def _orders(text: dict) -> dict:
    """Per rank, entries from tokens: "send 1 x" / "recv 0 x" (to / from global rank 1 / 0,
    label x) or "all_reduce g" on group g, all on the group named by a "@group" suffix (default
    "pp"), over the ranks of the dict; "wait n": the host waits on the rank's n-th entry before
    the next; "[ ... ]" around tokens: one batch."""
    ranks = sorted(text)
    out = {}
    for r, tokens in text.items():
        entries, after, batch, batches = [], [], None, 0
        for tok in tokens:
            if tok == "[":
                batches += 1
                batch = batches
                continue
            if tok == "]":
                batch = None
                continue
            words = tok.split()
            if words[0] == "wait":
                after.append(int(words[1]))
                continue
            group = words[-1][1:] if words[-1].startswith("@") else "pp"
            words = [w for w in words if not w.startswith("@")]
            peer = int(words[1]) if words[0] in ("send", "recv") else None
            label = " ".join(words[2:] if peer is not None else words[1:])
            entries.append({"group": group, "ranks": ranks, "kind": words[0], "peer": peer, "label": label,
                            "index": len(entries), "batch": batch, "after": after})
            after = []
        out[r] = entries
    return out


def test_sends_first_on_both_sides_deadlock_and_a_batch_does_not():
    """NCCL's send waits for its receive (rendezvous): two ranks that both send before they
    receive wait for each other; posted as one batch each, they do not."""
    heads = replay(_orders({0: ["send 1 a", "recv 1 b"], 1: ["send 0 b", "recv 0 a"]}))
    assert [(h.rank, h.ops) for h in heads] == [(0, ("send #1 to rank 1 'a'",)), (1, ("send #1 to rank 0 'b'",))]
    assert "rank 1's recv #1 from rank 0 'a' is behind its send #1 to rank 0 'b' on pp [0, 1]" in heads[0].waits[0]
    assert replay(_orders({0: ["[", "send 1 a", "recv 1 b", "]"], 1: ["[", "recv 0 a", "send 0 b", "]"]})) == []
    assert replay(_orders({0: ["send 1 a", "recv 1 b"], 1: ["recv 0 a", "send 0 b"]})) == []


def test_collectives_in_two_orders_deadlock_and_a_mismatch_is_named():
    """Collectives on two communicators issued in opposite orders deadlock; so does a transfer
    whose counterpart is never issued; another kind at the same place is an error."""
    crossed = {0: ["all_reduce x @a", "all_reduce y @b"], 1: ["all_reduce y @b", "all_reduce x @a"]}
    assert replay(_orders(crossed)) == []        # two streams each: nothing waits on the host
    waited = {0: ["all_reduce x @a", "wait 0", "all_reduce y @b"], 1: ["all_reduce y @b", "wait 0", "all_reduce x @a"]}
    heads = replay(_orders(waited))
    assert {(h.rank, h.communicator) for h in heads} == {(0, "a [0, 1]"), (1, "b [0, 1]"), (0, "b [0, 1]"),
                                                         (1, "a [0, 1]")}
    assert any("the host waited on all_reduce #1 'x' on a [0, 1] before issuing it" in w
               for h in heads for w in h.waits)
    lonely = replay(_orders({0: ["send 1 a"], 1: []}))
    assert lonely[0].waits == ("rank 1 never issues its counterpart of send #1 to rank 1 'a'",)
    with pytest.raises(ValueError, match="collective #1 on pp \\[0, 1\\] is all_reduce 'x' on rank 0 but broadcast"):
        replay(_orders({0: ["all_reduce x"], 1: ["broadcast x"]}))


# pp=2, 1F1B, 4 micro-batches, each transfer posted alone on one group (as NCCL has it) with
# the receives of the next compute action posted before the sends of the one about to run, as
# the flight recorder saw a runtime that posted them so.
OLD_1F1B = {
    0: ["send 1F0", "recv 0B0", "send 1F1", "wait 1", "wait 0", "recv 0B1", "send 1F2", "wait 3", "wait 2",
        "recv 0B2", "send 1F3", "recv 0B3", "wait 5", "wait 4", "wait 7", "wait 6", "broadcast"],
    1: ["recv 1F0", "wait 0", "recv 1F1", "send 0B0", "wait 1", "recv 1F2", "send 0B1", "wait 3", "wait 2",
        "recv 1F3", "send 0B2", "wait 5", "wait 4", "send 0B3", "wait 6", "wait 7", "broadcast"],
}


def _old_order() -> dict:
    def token(r, tok):
        kind, _, what = tok.partition(" ")
        if kind in ("wait", "broadcast"):
            return tok if kind == "wait" else "broadcast the step's loss"
        return f"{kind} {1 - r} {'activations' if what[1] == 'F' else 'gradients'} for {what} [0]"
    return _orders({r: [token(r, tok) for tok in toks] for r, toks in OLD_1F1B.items()})


def test_receives_posted_a_compute_action_ahead_deadlock_1f1b_and_the_replay_says_where():
    """After the first activations matched, rank 0 waits in the receive of 0B0's gradients and
    rank 1 in that of 1F1's activations, each ahead of the send the other waits for."""
    with pytest.raises(OrderDeadlock) as info:
        check(_old_order())
    heads = {h.rank: h for h in info.value.heads}
    assert heads[0].ops == ("recv #1 from rank 1 'gradients for 0B0 [0]'",)
    assert heads[1].ops == ("recv #2 from rank 0 'activations for 1F1 [0]'",)
    assert heads[0].waits == ("rank 1's send #1 to rank 0 'gradients for 0B0 [0]' is behind its recv #2 from "
                              "rank 0 'activations for 1F1 [0]' on pp [0, 1]",)
    assert "rank 0 on pp [0, 1]: [recv #1 from rank 1 'gradients for 0B0 [0]'] waits:" in str(info.value)


# ---- the planned batches ---------------------------------------------------------------------------

def _planned(schedule: Schedule) -> dict:
    """What ``batch_transfers`` plans, as the runtime issues it: per pp rank a batch per tuple,
    a wait on a compute action's receive before the entry after it."""
    orders = {}
    for r, steps in enumerate(batch_transfers(schedule)):
        entries, index, after = [], {}, []
        for n, step in enumerate(steps):
            if isinstance(step, Action):
                kind = "RECV_F" if step.kind == "F" else "RECV_B"
                recv = Action(step.stage, kind, step.mb)
                if recv in index and step.kind != "W":
                    after.append(index[recv])
                continue
            for a in step:
                peer = schedule.rank_of(a.stage + (1 if a.kind in ("SEND_F", "RECV_B") else -1))
                index[a] = len(entries)
                entries.append({"group": "pp", "ranks": list(range(schedule.p)), "peer": peer, "label": str(a),
                                "kind": "send" if a.kind.startswith("SEND") else "recv", "index": len(entries),
                                "batch": n, "after": after})
                after = []
        orders[r] = entries
    return orders


def _custom(p: int, m: int) -> Schedule:
    """A user's action list: GPipe with the backward in reverse micro-batch order."""
    text = "\n".join(f"rank {r}: " + " ".join([f"{r}F{i}" for i in range(m)] + [f"{r}B{i}" for i in reversed(range(m))])
                     for r in range(p))
    return Schedule.parse(text)


def _matrix():
    """(schedule, pp, micro-batches, virtual stages) of every schedule the runtime builds, for
    pp in 2, 4, 8 and micro-batches 1, pp, 2 pp where the schedule takes them."""
    for p in (2, 4, 8):
        for m in (1, p, 2 * p):
            for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1), ("custom", 1)):
                if m < p and name not in ("gpipe", "custom"):
                    continue
                yield name, p, m, v


def _schedule(name, p, m, v) -> Schedule:
    return _custom(p, m) if name == "custom" else build_schedule(name, p, m, v)


def test_planned_batches_of_every_schedule_run_on_nccl():
    """Every schedule x pp x micro-batches, as the plan orders it: clean; the same transfers,
    each posted alone in the planned order, deadlock for 1F1B: the batches are what makes the
    difference."""
    for name, p, m, v in _matrix():
        s = _schedule(name, p, m, v)
        assert replay(_planned(s)) == [], (name, p, m, v)
        # every transfer of the lowered program is in exactly one batch
        planned = sorted(str(a) for steps in batch_transfers(s) for x in steps if isinstance(x, tuple) for a in x)
        assert planned == sorted(str(a) for prog in lower(s) for a in prog if a.kind not in COMPUTE)
    alone = {r: [dict(e, batch=None) for e in entries] for r, entries in _planned(build_schedule("1f1b", 2, 4)).items()}
    heads = replay(alone)       # in 1F1B's steady state both ranks send first, then receive
    assert [h.ops for h in heads] == [("send #3 to rank 1 '0SEND_F2'",), ("send #2 to rank 0 '1SEND_B1'",)]


def _random_schedule(rng: random.Random, p: int, m: int, split: bool) -> Schedule | None:
    """A random action list: each rank's F, B (and W) of its micro-batches shuffled under their
    order on one micro-batch; None when it deadlocks even with buffered sends."""
    ranks = []
    for r in range(p):
        kinds = ("F", "B", "W") if split else ("F", "B")
        left = {mb: list(kinds) for mb in range(m)}
        acts = []
        while left:
            mb = rng.choice(sorted(left))
            acts.append(Action(r, left[mb].pop(0), mb))
            if not left[mb]:
                del left[mb]
        ranks.append(acts)
    s = Schedule("random", p, 1, m, split, tuple(ranks))
    try:
        simulate(s)
    except ScheduleDeadlock:
        return None
    return s


def test_planned_batches_of_random_action_lists_run_on_nccl():
    """Any action list that runs with buffered sends runs on NCCL as planned (the induction in
    ``batch_transfers``'s docstring, tried on 300 random lists)."""
    rng, tried = random.Random(0), 0
    while tried < 300:
        s = _random_schedule(rng, rng.choice((2, 3, 4)), rng.choice((1, 2, 3, 5)), rng.random() < 0.5)
        if s is not None:
            tried += 1
            assert replay(_planned(s)) == [], str(s)


# ---- the flight recorder ----------------------------------------------------------------------------

class _Work:
    """A stand-in for an NCCL work: ``wait`` returns at once (it only orders streams),
    ``is_completed`` once the device finished."""

    def __init__(self):
        self.done = False

    def wait(self, *args):
        return True

    def is_completed(self):
        return self.done


def test_a_batch_is_noted_op_by_op_and_nccl_completion_comes_from_the_work():
    """``flight.batch`` notes each transfer (sequence numbers per kind and peer as alone, the
    bytes) under one batch number; the next entry lists what was waited on before it. An entry
    on NCCL waited on stays incomplete until its work says it completed; on gloo the wait
    completes it."""
    with fake_rank(2, 0):
        group = dist.new_group([0, 1], group_desc="pp")
        with flight.recording() as tape:
            handles = flight.batch([flight.Transfer("send", torch.zeros(3), 1, group, "a"),
                                    flight.Transfer("recv", torch.zeros(2), 1, group, "b"),
                                    flight.Transfer("send", torch.zeros(1), 1, group, "c")])
            handles[1].wait()
            after = flight.launch(group, "send", "d", 4, dist.isend, torch.zeros(1), 1, group, 0, peer=1)   # alone
        got = [(e.kind, e.seq, e.nbytes, e.label) for e in tape]
        assert got == [("send", 1, 12, "a"), ("recv", 1, 8, "b"), ("send", 2, 4, "c"), ("send", 3, 4, "d")]
        assert len({e.batch for e in tape[:3]}) == 1 and tape[3].batch is None
        assert tape[3].after == (tape[1].index,) and tape[1].state == "completed"    # fake: as gloo
        work, entry = _Work(), tape[3]
        entry.group.nccl = True
        try:
            flight.Watched(work, entry).wait()
            assert entry.state == "issued"
            work.done = True
            flight.RECORDER.settle()
            assert entry.state == "completed"
        finally:
            entry.group.nccl = False
        after.wait()


# ---- the runtime's order: processes ------------------------------------------------------------------

def _normalized(entries: list) -> list:
    """Entries without what differs between runs (times, the process's counters), and the
    gloo-only group as the one it stands for (the fake group, like NCCL, has one pp group)."""
    index = {e["index"]: n for n, e in enumerate(entries)}
    batches = {}
    return [(NCCL_MERGE.get(e["group"], e["group"]), e["ranks"], e["kind"], e["peer"], e["label"], e["bytes"],
             None if e["batch"] is None else batches.setdefault(e["batch"], len(batches)),
             sorted(index[i] for i in e["after"] if i in index)) for e in entries]


@pytest.mark.timeout(120)
def test_a_1f1b_step_on_processes_runs_on_nccl_and_fake_ranks_issue_the_same(ranks):
    """pp=2, 1F1B, 4 micro-batches on two gloo processes: a training step and an evaluation
    step, the tied weights' gradients exchanged: clean, with the gloo-only group merged as NCCL
    has it (and apart); each rank sends its 4 activations or gradients and the tied gradient,
    and receives as many; and the fake process group issues the same order, waits included."""
    plan = dict(pp_schedule="1f1b", microbatches=4)
    real = dict(enumerate(ranks(jobs.step_order, 2, "mlp", {"pp": 2}, plan, timeout=90)))
    check(real, merge=NCCL_MERGE)
    check(real)
    for r, entries in real.items():
        train = entries[:[e["kind"] for e in entries].index("broadcast")]
        assert sum(e["kind"] == "send" for e in train) == sum(e["kind"] == "recv" for e in train) == 5, r
        assert sum(e["batch"] is not None for e in entries) == sum(e["peer"] is not None for e in entries)
    fake = jobs.fake_orders("mlp", {"pp": 2}, plan)
    assert {r: _normalized(e) for r, e in fake.items()} == {r: _normalized(e) for r, e in real.items()}


@pytest.mark.timeout(120)
def test_collective_matmul_rings_on_processes_and_fake_ranks_run_on_nccl(ranks):
    """Both rings (all-gather and reduce-scatter) forward and backward at tp=2 on two gloo
    processes (the next and the previous rank are one: each step a send and a receive between
    the same two ranks), and at tp=2 and 4 as fake ranks: clean, each step one batch."""
    real = dict(enumerate(ranks(jobs.ring_order, 2, 2, timeout=60)))
    check(real)
    assert {r: _normalized(e) for r, e in jobs.fake_ring_orders(2).items()} == \
        {r: _normalized(e) for r, e in real.items()}
    for tp in (2, 4):
        orders = jobs.fake_ring_orders(tp)
        check(orders)
        for entries in orders.values():     # 4 rings of tp - 1 steps, each a send and a receive
            assert len(entries) == 4 * 2 * (tp - 1) and len({e["batch"] for e in entries}) == 4 * (tp - 1)


# ---- the runtime's order: every schedule, fake ranks ----------------------------------------------------

def _plan(name, p, m, v) -> dict:
    if name == "custom":
        return dict(pp_schedule=str(_custom(p, m)), microbatches=m)
    return dict(pp_schedule=name, microbatches=m, **({"virtual_stages": v} if v > 1 else {}))


def _check_runtime(name, p, m, v) -> None:
    """The runtime's order for a schedule, training and evaluation step, on fake ranks: clean,
    and each rank's training step sends once per send of its lowered action list (and its
    tied gradient), in batches."""
    orders = jobs.fake_orders("mlp", {"pp": p}, _plan(name, p, m, v))
    check(orders, merge=NCCL_MERGE)
    lowered = lower(_schedule(name, p, m, v))
    for r, entries in orders.items():
        train = entries[:[e["kind"] for e in entries].index("broadcast")]
        sends = [e for e in train if e["kind"] == "send" and "tied" not in e["label"]]
        assert len(sends) == sum(a.kind.startswith("SEND") for a in lowered[r]), (name, p, m, v, r)
        assert all(e["batch"] is not None for e in train), (name, p, m, v, r)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("p", [2, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_every_schedule_as_fake_ranks_runs_on_nccl(p):
    """Every schedule (and a user's action list) x micro-batches 1, pp, 2 pp (where the schedule
    takes them), interleaved with 2 stages per rank: the runtime's order is clean."""
    for name, q, m, v in _matrix():
        if q == p:
            _check_runtime(name, p, m, v)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_3d_mesh_with_collective_matmul_runs_on_nccl():
    """dp=2 x tp=2 x pp=2 (8 ranks), 1F1B and interleaved, tp with sequence parallelism and the
    collective matmul: tp's rings and collectives, the pipeline's transfers and dp's gradient
    reductions, as fake ranks: clean."""
    for plan in (dict(pp_schedule="1f1b", microbatches=4),
                 dict(pp_schedule="interleaved", microbatches=4, virtual_stages=2)):
        orders = jobs.fake_orders("gpt", {"dp": 2, "tp": 2, "pp": 2},
                                  dict(plan, tp=True, sp=True, collective_matmul=True, dp="zero2"))
        check(orders, merge=NCCL_MERGE)
        assert any(e["group"] == "tp" and e["batch"] is not None for e in orders[0])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_3d_mesh_on_processes_runs_on_nccl(ranks):
    """The same mesh (1F1B) on 8 gloo processes: clean, and as the fake ranks issue it."""
    plan = dict(pp_schedule="1f1b", microbatches=4, tp=True, sp=True, collective_matmul=True, dp="zero2")
    axes = {"dp": 2, "tp": 2, "pp": 2}
    real = dict(enumerate(ranks(jobs.step_order, 8, "gpt", axes, plan, timeout=500)))
    check(real, merge=NCCL_MERGE)
    fake = jobs.fake_orders("gpt", axes, plan)
    assert {r: _normalized(e) for r, e in fake.items()} == {r: _normalized(e) for r, e in real.items()}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name,p,m,v", [("interleaved", 2, 4, 2), ("zero_bubble", 4, 4, 1), ("custom", 2, 4, 1),
                                        ("gpipe", 4, 1, 1)])
def test_other_schedules_on_processes_run_on_nccl(ranks, name, p, m, v):
    """A few schedules on gloo processes: clean, and as the fake ranks issue them."""
    real = dict(enumerate(ranks(jobs.step_order, p, "mlp", {"pp": p}, _plan(name, p, m, v), timeout=500)))
    check(real, merge=NCCL_MERGE)
    fake = jobs.fake_orders("mlp", {"pp": p}, _plan(name, p, m, v))
    assert {r: _normalized(e) for r, e in fake.items()} == {r: _normalized(e) for r, e in real.items()}
