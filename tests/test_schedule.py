"""Pipeline schedules: construction, text round trip, validation, lowering, simulation, pictures."""
import json
import xml.etree.ElementTree as ET

import pytest

from autopar.schedule import (
    Action,
    Schedule,
    ScheduleDeadlock,
    build_schedule,
    execute,
    lower,
    simulate,
)
from autopar.cost.pipeline import pipeline_placement

BUILT = [(name, p, m, v) for p in (1, 2, 4) for m in (4, 8)
         for name, v in (("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1), ("interleaved", 2), ("interleaved", 3))
         if not (name == "interleaved" and m % p)]


def idle_time(t):
    return t.schedule.p * t.makespan - sum(end - start for evs in t.events for _, start, end in evs)


@pytest.mark.parametrize("text", ["1F0", "0B3", "2W1", "1SEND_F0", "0RECV_B2", "12SEND_B34", "3RECV_F0"])
def test_action_round_trip(text):
    assert str(Action.parse(text)) == text


@pytest.mark.parametrize("bad", ["", "F0", "1X0", "1F", "-1F0", "1 F0", "1SEND0"])
def test_action_parse_rejects(bad):
    with pytest.raises(ValueError, match="expected <stage><kind><mb>"):
        Action.parse(bad)


@pytest.mark.parametrize("name,p,m,v", BUILT)
def test_built_schedules_validate_and_round_trip(name, p, m, v):
    s = build_schedule(name, p, m, v)
    s.validate()
    assert (s.p, s.v, s.m, s.n_stages) == (p, v, m, p * v)
    back = Schedule.parse(str(s), name=name)
    assert back == s
    assert str(back) == str(s)
    simulate(s)   # no deadlock


def test_schedule_text_format():
    s = build_schedule("1f1b", 2, 3)
    assert str(s) == "rank 0: 0F0 0F1 0B0 0F2 0B1 0B2\nrank 1: 1F0 1B0 1F1 1B1 1F2 1B2"
    assert build_schedule("gpipe", 2, 2).ranks[1] == tuple(map(Action.parse, ["1F0", "1F1", "1B0", "1B1"]))


def test_interleaved_order():
    s = build_schedule("interleaved", 2, 4, v=2)
    assert str(s).splitlines() == [
        "rank 0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"]
    assert s.rank_of(3) == 1


def test_schedule_parse_errors():
    with pytest.raises(ValueError, match="expected 'rank 1: <actions>'"):
        Schedule.parse("rank 0: 0F0 0B0\nrank 2: 1F0 1B0")
    with pytest.raises(ValueError, match="but p=3"):
        Schedule.parse("rank 0: 0F0 0B0\nrank 1: 1F0 1B0", p=3)
    with pytest.raises(ValueError, match="multiple of the rank count"):
        Schedule.parse("rank 0: 0F0 2F0 2B0 0B0\nrank 1: 1F0 1B0")
    s = Schedule.parse("rank 0: 0F0 0B0 0W0\nrank 1: 1F0 1B0 1W0")
    assert (s.name, s.p, s.v, s.m, s.split_backward) == ("custom", 2, 1, 1, True)


@pytest.mark.parametrize("text,match", [
    ("rank 0: 0F0 0F1 0B0\nrank 1: 1F0 1B0 1F1 1B1", "rank 0 lacks 0B1"),
    ("rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F0 1B1 1B0 1F1", r"1B1 comes before 1F1.*move 1B1 after 1F1"),
    ("rank 0: 0F0 0B0 1F0 1B0\nrank 1:", "belongs on rank 1"),
    ("rank 0: 0F0 0F0 0B0\nrank 1: 1F0 1B0", "appears twice"),
    ("rank 0: 0F0 0B0 0W0 0W0\nrank 1: 1F0 1B0 1W0", "appears twice"),
    ("rank 0: 0F0 0W0 0B0\nrank 1: 1F0 1B0 1W0", "0W0 comes before 0B0"),
])
def test_validate_names_first_problem(text, match):
    with pytest.raises(ValueError, match=match):
        Schedule.parse(text).validate()


def test_validate_rejects_w_without_split_and_comm_actions():
    f, b, w = Action(0, "F", 0), Action(0, "B", 0), Action(0, "W", 0)
    with pytest.raises(ValueError, match="W needs split_backward=True"):
        Schedule("custom", 1, 1, 1, False, [[f, b, w]]).validate()
    with pytest.raises(ValueError, match="`lower` adds the sends"):
        Schedule("custom", 1, 1, 1, False, [[f, Action(0, "SEND_F", 0), b]]).validate()
    with pytest.raises(ValueError, match="out of range"):
        Schedule("custom", 1, 1, 1, False, [[f, b, Action(0, "F", 1)]]).validate()
    # p == 1 with two stages on one rank: stage 1's forward needs stage 0's first
    with pytest.raises(ValueError, match="0F0, which it depends on"):
        Schedule.parse("rank 0: 1F0 0F0 1B0 0B0").validate()
    with pytest.raises(ValueError, match="0B0 comes before 1B0"):
        Schedule.parse("rank 0: 0F0 1F0 0B0 1B0").validate()


@pytest.mark.parametrize("args,match", [
    (("interleaved", 4, 6, 2), r"m % p == 0.*use m=8"),
    (("interleaved", 2, 4, 1), "use '1f1b' for v=1"),
    (("1f1b", 4, 2), "fewer micro-batches than stages cannot fill the pipeline; use m >= p or gpipe"),
    (("zero_bubble", 4, 3), "use m >= p or gpipe"),
    (("interleaved", 4, 0, 2), "m >= 1"),
    (("gpipe", 2, 4, 2), "use 'interleaved' for v > 1"),
    (("zero_bubble", 2, 4, 2), "use 'interleaved' for v > 1"),
    (("gpipe", 0, 4), "p >= 1"),
    (("gpipe", 2, 0), "m >= 1"),
    (("pipedream", 2, 4), "unknown schedule 'pipedream'"),
])
def test_build_schedule_errors(args, match):
    with pytest.raises(ValueError, match=match):
        build_schedule(*args)


def test_gpipe_allows_fewer_microbatches_than_stages():
    t = simulate(build_schedule("gpipe", 4, 2))
    assert t.bubble_fraction() == pytest.approx(3 / 5)


def test_lower_inserts_sends_and_recvs():
    progs = lower(build_schedule("1f1b", 2, 2))
    assert " ".join(map(str, progs[0])) == "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1"
    assert " ".join(map(str, progs[1])) == "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1"
    mid = lower(build_schedule("gpipe", 3, 1))[1]
    assert " ".join(map(str, mid)) == "1RECV_F0 1F0 1SEND_F0 1RECV_B0 1B0 1SEND_B0"
    # p == 1: every stage on one rank, nothing to send
    assert lower(build_schedule("interleaved", 1, 2, v=2)) == build_schedule("interleaved", 1, 2, v=2).ranks
    # interleaved: the last stage of rank p-1 sends on to rank 0
    progs = lower(build_schedule("interleaved", 2, 2, v=2))
    assert Action(1, "SEND_F", 0) in progs[1] and Action(2, "RECV_F", 0) in progs[0]
    zb = lower(build_schedule("zero_bubble", 2, 2))
    assert [a for a in zb[0] if a.kind == "W"] == [Action(0, "W", 0), Action(0, "W", 1)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [4, 8])
def test_gpipe_1f1b_bubble_formula(name, p, m):
    t = simulate(build_schedule(name, p, m), {"F": 1, "B": 2})
    assert t.bubble_fraction() == (p - 1) / (m + p - 1)
    assert t.makespan == 3 * (m + p - 1)


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [4, 8])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_bubble_formula(p, m, v):
    # Each rank holds v stages, each 1/v of the work, so one micro-batch costs a rank 3 units as in
    # 1F1B. The fill and drain shrink to (p-1) stage-steps of 3/v each, giving Megatron's
    # (p-1)/(v*m + p-1). The naive formula holds exactly in our simulator (no comm cost).
    t = simulate(build_schedule("interleaved", p, m, v), {"F": 1 / v, "B": 2 / v})
    assert t.bubble_fraction() == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-9)
    assert t.bubble_fraction() < simulate(build_schedule("1f1b", p, m)).bubble_fraction()


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_zero_bubble_is_zb_h1(p, k):
    m = k * p
    zb = simulate(build_schedule("zero_bubble", p, m))            # F = B = W = 1
    ref = simulate(build_schedule("1f1b", p, m), {"F": 1, "B": 2})  # B = the whole backward
    # ZB-H1 (Qi et al. 2023): idle time (p-1)(T_F + T_B - T_W) per rank, a third of 1F1B's
    # (p-1)(T_F + T_B + T_W); as a fraction of the (shorter) makespan that is (p-1)/(3m+p-1).
    assert zb.makespan == 3 * m + p - 1
    assert idle_time(zb) == pytest.approx(idle_time(ref) / 3)
    assert zb.bubble_fraction() == pytest.approx((p - 1) / (3 * m + p - 1))
    assert zb.bubble_fraction() < ref.bubble_fraction()
    # memory: never more than p micro-batches between F and W on a rank (1F1B's first-rank peak)
    for acts in zb.schedule.ranks:
        live = peak = 0
        for a in acts:
            live += {"F": 1, "B": 0, "W": -1}[a.kind]
            peak = max(peak, live)
        assert peak <= p


def test_zero_bubble_p4_m8_about_a_third():
    zb = simulate(build_schedule("zero_bubble", 4, 8)).bubble_fraction()
    ref = simulate(build_schedule("1f1b", 4, 8)).bubble_fraction()
    assert zb == pytest.approx(1 / 9) and ref == pytest.approx(3 / 11)
    assert 0.3 < zb / ref < 0.45


def test_costs_and_comm():
    s = build_schedule("1f1b", 2, 2)
    # rank 1: F0 [2,4) B0 [4,6) F1 [6,8) B1 [8,10); rank 0's B1 then runs [10,12)
    assert simulate(s, {"F": 2}).makespan == 12
    slow = simulate(s, comm=0.5)
    assert slow.makespan > simulate(s).makespan
    with pytest.raises(ValueError, match="expected keys from"):
        simulate(s, {"X": 1})
    with pytest.raises(ValueError, match="latency >= 0"):
        simulate(s, comm=-1)


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2), ("zero_bubble", 4, 4, 1),
                                        ("gpipe", 3, 5, 1)])
def test_shared_cores_replay(name, p, m, v):
    """Ranks sharing processors: with one processor each it is the plain replay; on one
    processor (no transfer time) the makespan is exactly the work of all ranks; in between it
    lies between the two, and an action's span is at least its work."""
    s = build_schedule(name, p, m, v)
    work = {a: 1.0 + (a.stage * 7 + a.mb * 3 + len(a.kind)) % 5 / 4 for prog in lower(s) for a in prog}
    dur = work.__getitem__
    plain = execute(s, lower(s), duration=dur, latency=lambda a: 0.25)
    same = execute(s, lower(s), duration=dur, latency=lambda a: 0.25, cores=p)
    assert same.makespan == pytest.approx(plain.makespan)
    assert [[(a, pytest.approx(b), pytest.approx(e)) for a, b, e in evs] for evs in plain.events] == same.events
    total = sum(e - b for evs in plain.events for _, b, e in evs)
    assert execute(s, lower(s), duration=dur, cores=1).makespan == pytest.approx(total)
    half = simulate(s, duration=dur, latency=lambda a: 0.25, cores=p / 2)
    assert plain.makespan <= half.makespan + 1e-9 and half.makespan >= total / (p / 2) - 1e-9
    assert all(e - b >= work[a] - 1e-9 for evs in half.events for a, b, e in evs)
    with pytest.raises(ValueError, match="positive number of processors"):
        execute(s, lower(s), cores=0)


def test_shared_replay_with_placement():
    """Ranks placed on groups of cores: each stage of 1F1B on a core of its own, standing for two
    lockstep replicas, runs at half speed whenever it computes (its bubbles free its core for
    nobody): the plain replay of doubled work. Stages 0-1 and 2-3 of four sharing a core each
    lie between that and a core per stage."""
    s = build_schedule("1f1b", 2, 4)
    dur = {"F": 1.0, "B": 2.0}
    lat = lambda a: 0.3      # noqa: E731
    halved = simulate(s, duration=lambda a: dur[a.kind], latency=lat, placement=[(0, 1.0, 2.0), (1, 1.0, 2.0)])
    doubled = simulate(s, duration=lambda a: 2 * dur[a.kind], latency=lat)
    assert halved.makespan == pytest.approx(doubled.makespan)
    s4 = build_schedule("zero_bubble", 4, 4)
    d4 = {"F": 1.0, "B": 1.0, "W": 1.0}
    own = simulate(s4, duration=lambda a: d4[a.kind], latency=lat).makespan
    paired = simulate(s4, duration=lambda a: d4[a.kind], latency=lat,
                      placement=[(0, 1.0, 1.0), (0, 1.0, 1.0), (1, 1.0, 1.0), (1, 1.0, 1.0)]).makespan
    assert own < paired < simulate(s4, duration=lambda a: 2 * d4[a.kind], latency=lat).makespan
    slower = simulate(s, duration=lambda a: dur[a.kind], latency=lat, placement=[(0, 1.0, 2.0), (1, 1.0, 2.0)],
                      speed=0.5)
    assert slower.makespan == pytest.approx(simulate(s, duration=lambda a: 4 * dur[a.kind], latency=lat).makespan)


def test_shared_replay_slows_only_while_ranks_compute_together():
    """Two stages on two cores that slow each other 1.5x while both compute (the measured
    contention of two processes): GPipe with one micro-batch never computes on both at once
    and replays as if each were alone; 1F1B with four overlaps its ranks in the steady state
    only, so it lies strictly between the replay alone and the replay slowed throughout."""
    contention = {1: 1.0, 2: 1.5}
    speed, placement = pipeline_placement(2, 2, 2, lambda k: contention[k])
    assert speed(1) == 1.0 and speed(2) == pytest.approx(1 / 1.5)
    dur = {"F": 1.0, "B": 2.0}
    lat = lambda a: 0.1      # noqa: E731
    one = build_schedule("gpipe", 2, 1)
    assert simulate(one, duration=lambda a: dur[a.kind], latency=lat, placement=placement,
                           speed=speed).makespan == pytest.approx(simulate(one, duration=lambda a: dur[a.kind],
                                                                           latency=lat).makespan)
    s = build_schedule("1f1b", 2, 4)
    shared = simulate(s, duration=lambda a: dur[a.kind], latency=lat, placement=placement, speed=speed).makespan
    alone = simulate(s, duration=lambda a: dur[a.kind], latency=lat).makespan
    throughout = simulate(s, duration=lambda a: 1.5 * dur[a.kind], latency=lat).makespan
    assert alone < shared < throughout


def test_a_pipeline_without_replicas_shares_every_core():
    """Four stages of one rank each on two cores (pp=4 on 4 processes) are one group of two
    cores: the kernel runs whichever ranks compute on whichever core is free, so GPipe with two
    micro-batches, which never computes on more than two ranks at once, replays as if each rank
    had a core of its own; 1F1B with eight, four computing at once in its steady state, is
    slower than that. Stages with replicas keep a core of their own per pair of stages. (The
    slowdown of k processes computing at once: time-sharing alone, k / 2 beyond two.)"""
    speed, place = pipeline_placement(4, 4, 2, lambda k: max(1.0, k / 2))
    assert place == [(0, 2.0, 1.0)] * 4
    dur = {"F": 1.0, "B": 2.0}
    lat = lambda a: 0.1      # noqa: E731
    two = build_schedule("gpipe", 4, 2)
    alone = simulate(two, duration=lambda a: dur[a.kind], latency=lat)
    busy = [sum(b <= t < e for evs in alone.events for _, b, e in evs) for t in
            sorted({b for evs in alone.events for _, b, _ in evs})]
    assert max(busy) == 2       # the premise, read off the replay with a core each
    assert simulate(two, duration=lambda a: dur[a.kind], latency=lat, placement=place,
                           speed=speed).makespan == pytest.approx(alone.makespan)
    eight = build_schedule("1f1b", 4, 8)
    assert simulate(eight, duration=lambda a: dur[a.kind], latency=lat, placement=place,
                           speed=speed).makespan > simulate(eight, duration=lambda a: dur[a.kind],
                                                            latency=lat).makespan * 1.2
    assert pipeline_placement(4, 8, 2, lambda k: max(1.0, k / 2))[1] == [(0, 1.0, 2.0), (0, 1.0, 2.0), (1, 1.0, 2.0),
                                                              (1, 1.0, 2.0)]


def test_rendezvous_moves_a_message_sent_before_its_receive_only_on_a_free_processor():
    """Gloo sends an unbound buffer once the receiver's notice that its receive is posted has
    arrived; a send issued first is written later by the sender's event-loop thread, which needs
    a processor. Two stages of two replicas each, one core a stage (four processes on two
    cores): 1F1B with 2 micro-batches posts stage 1's receive of F1 as its B0 starts (the
    runtime posts the receives before the next compute action), after stage 0 sent F1, and B0
    takes both processors, so F1's message moves only once B0 has ended, its latency after
    that: F1 starts B0's end + latency. GPipe posts every receive before its send and is
    unchanged; so is 1F1B on cores enough for every process."""
    dur = {"F": 1.0, "B": 2.0}
    lat = 0.3
    place = [(0, 1.0, 2.0), (1, 1.0, 2.0)]

    def replay(name, rendezvous, placement=place):
        return simulate(build_schedule(name, 2, 2), duration=lambda a: dur[a.kind], latency=lambda a: lat,
                               placement=placement, rendezvous=rendezvous)

    plain, met = replay("1f1b", False), replay("1f1b", True)
    ev = {str(a): (b, e) for a, b, e in met.events[1]}
    assert ev["1F1"][0] == pytest.approx(ev["1B0"][1] + lat)
    assert {str(a): b for a, b, _ in plain.events[1]}["1F1"] == pytest.approx(ev["1B0"][1])
    assert met.makespan == pytest.approx(plain.makespan + lat)
    assert replay("gpipe", True).makespan == pytest.approx(replay("gpipe", False).makespan)
    roomy = [(0, 4.0, 2.0), (1, 4.0, 2.0)]      # a processor stays free for the event-loop thread
    assert replay("1f1b", True, roomy).makespan == pytest.approx(replay("1f1b", False, roomy).makespan)


def test_shared_replay_reports_deadlock():
    s = Schedule.parse("rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F1 1B1 1F0 1B0")
    with pytest.raises(ScheduleDeadlock, match="rank 0 waits at 0RECV_B0"):
        execute(s, lower(s), cores=1)


def test_deadlock_names_ranks_and_actions():
    s = Schedule.parse("rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F1 1B1 1F0 1B0")
    s.validate()   # each rank is locally fine; together they wait on each other
    with pytest.raises(ScheduleDeadlock) as err:
        simulate(s)
    msg = str(err.value)
    assert "rank 0 waits at 0RECV_B0" in msg and "rank 1 is stuck at 1RECV_F1" in msg
    assert "rank 1 waits at 1RECV_F1, which needs 0SEND_F1 that rank 0 never reaches" in msg
    assert "Reorder" in msg


def test_missing_send_is_reported():
    s = build_schedule("gpipe", 2, 1)
    progs = [list(prog) for prog in lower(s)]
    progs[0].remove(Action(0, "SEND_F", 0))
    with pytest.raises(ScheduleDeadlock, match="rank 1 waits at 1RECV_F0, but no rank ever executes its "
                                               "matching 0SEND_F0: add it to rank 0"):
        execute(s, progs)
    with pytest.raises(ValueError, match="expected one of"):
        execute(s, [[Action(0, "X", 0)], []])


def test_timeline_events_and_rank_bubble():
    t = simulate(build_schedule("gpipe", 2, 2))
    assert [(str(a), s, e) for a, s, e in t.events[1]] == [("1F0", 1, 2), ("1F1", 2, 3),
                                                          ("1B0", 3, 5), ("1B1", 5, 7)]
    assert t.makespan == 9
    assert t.rank_bubble(0) == pytest.approx(3 / 9) and t.rank_bubble(1) == pytest.approx(3 / 9)


@pytest.mark.parametrize("name,p,m,v", [("zero_bubble", 4, 8, 1), ("interleaved", 2, 4, 2), ("1f1b", 2, 4, 1)])
def test_svg(name, p, m, v):
    t = simulate(build_schedule(name, p, m, v))
    root = ET.fromstring(t.to_svg())
    ns = "{http://www.w3.org/2000/svg}"
    actions = [r for r in root.iter(ns + "rect") if r.get("class") == "action"]
    assert len(actions) == sum(len(evs) for evs in t.events)
    texts = [x.text for x in root.iter(ns + "text")]
    assert any(f"p={p} v={v} m={m}" in (x or "") and "bubble" in x for x in texts)
    assert ("F0s0" if v > 1 else "F0") in texts
    fills = {r.get("fill") for r in actions}
    assert len(fills) == (3 if name == "zero_bubble" else 2)


def test_text_grid():
    text = simulate(build_schedule("zero_bubble", 2, 2)).to_text()
    assert text.splitlines()[1:] == ["rank 0: F0 F1 .  B0 W0 B1 W1",
                                     "rank 1: .  F0 B0 F1 B1 W0 W1"]
    text = simulate(build_schedule("1f1b", 2, 2)).to_text()
    assert text.splitlines()[1:] == ["rank 0: F0 F1 .  .  B0 -- .  B1 --",
                                     "rank 1: .  F0 B0 -- F1 B1 -- .  ."]
    wrapped = simulate(build_schedule("1f1b", 2, 8)).to_text(width=30)
    assert all(len(line) <= 30 for line in wrapped.splitlines()[1:])
    assert "t = 0 .." in wrapped and wrapped.count("rank 1:") > 1


def test_chrome_trace():
    t = simulate(build_schedule("interleaved", 2, 4, v=2))
    trace = json.loads(json.dumps(t.chrome_trace()))
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"]
    assert sorted(e["pid"] for e in meta) == [0, 1] and meta[0]["args"]["name"] == "rank 0"
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 2 * 2 * 4 * 2 and {e["pid"] for e in xs} == {0, 1}
    first = next(e for e in xs if e["name"] == "1F0")
    assert (first["cat"], first["ts"], first["dur"], first["tid"]) == ("F", 1000.0, 1000.0, 0)
