"""Run-time hangs become errors: a rank that dies, stalls, or issues another collective makes
every other rank raise ``CollectiveError`` within the mesh's timeout, with what each rank was
last doing (the flight recorder); a rank that raises, at compile time or in its forward, makes
the others raise within seconds, naming it and its error. Fresh processes per test where ranks
die or a collective is left behind; the pool of conftest's ``ranks`` fixture where none is."""
import json
import os
import re
import time

import pytest

import autopar
from autopar.runtime import flight
from autopar.testing import run, run_threads
from jobs import hangs

TIMEOUT = 3.0     # the mesh's timeout in these jobs (seconds)
LONG = 30.0       # a mesh's timeout that a rank raising must not make its peers wait out
LAG = 3.0         # seconds a rank that raised alike with its peer resumes after it


def _dump_of(message: str) -> dict:
    """The flight recorder file a message names (removed once read)."""
    path = re.search(r"This rank's flight recorder: (\S+)", message).group(1)
    with open(path) as f:
        dump = json.load(f)
    os.remove(path)
    return dump


def _after(message: str) -> float:
    return float(re.search(r"failed (\d+\.\d) s after it was issued", message).group(1))


@pytest.mark.timeout(90)
def test_a_rank_that_dies_makes_the_others_raise_at_once():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0 of 2 failed") as info:
        run(hangs.killed_rank, 2, TIMEOUT, timeout=60)
    took = time.monotonic() - start
    msg = str(info.value)
    m = re.search(r"CollectiveError: rank 0: all_reduce #(\d+) on dp:grads \(ranks \[0, 1\]\) '[^']*' "
                  r"\([\d.]+ KiB\) failed [\d.]+ s after it was issued \(a peer closed its connection\)", msg)
    assert m, msg
    seq = int(m.group(1))
    assert re.search(rf"rank 1 \(last heard \d+\.\d s ago\): did not issue all_reduce #{seq} on dp:grads: "
                     rf"its last there is #{seq - 1}", msg), msg
    assert _after(msg) < hangs.PUBLISHED + TIMEOUT / 2      # the dead peer is seen at once, not at the timeout
    assert took < 30, f"reported after {took:.0f}s"
    dump = _dump_of(msg)
    assert dump["failed"]["kind"] == "all_reduce" and dump["failed"]["state"] == "failed"
    assert dump["reports"]["1"]["entries"][-1]["seq"] == seq - 1


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_stalled_rank_makes_the_others_raise_within_the_timeout_then_fails_itself():
    r0, r1 = run(hangs.stalled_rank, 2, TIMEOUT, TIMEOUT + 1.0, 2.5, timeout=60)
    m = re.match(r"rank 0: all_reduce #(\d+) on dp:grads \(ranks \[0, 1\]\) .* \(timed out\)", r0["message"])
    assert m, r0["message"]
    seq = int(m.group(1))
    assert TIMEOUT - 0.5 < r0["after"] < TIMEOUT + 3, r0
    heard = re.search(rf"rank 1 \(last heard (\d+\.\d) s ago\): did not issue all_reduce #{seq} on dp:grads",
                      r0["message"])
    assert heard, r0["message"]
    assert float(heard.group(1)) <= flight.HEARTBEAT_EVERY + flight.PUBLISH_EVERY   # stalled, not dead
    # rank 1 wakes up after the timeout: its own all-reduce fails, and it reads rank 0's failure
    assert re.match(rf"rank 1: all_reduce #{seq} on dp:grads \(ranks \[0, 1\]\)", r1["message"]), r1["message"]
    assert "rank 0 (last heard" in r1["message"] and f"issued all_reduce #{seq} too, failed" in r1["message"]
    for r in (r0, r1):
        assert r["path"] and _dump_of(r["message"])["failed"]["seq"] == seq


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_ranks_that_issue_different_collectives_all_raise():
    """Rank 0 gathers the full state dict while rank 1 clips gradients (ZeRO-3): both time out,
    and each names the other's collective at the same sequence number."""
    r0, r1 = run(hangs.mismatched_calls, 2, TIMEOUT, timeout=60)
    for r in (r0, r1):
        assert TIMEOUT - 0.5 < r["after"] < TIMEOUT + 3, r
        _dump_of(r["message"])
    m = re.match(r"rank 0: all_gather #(\d+) on dp \(ranks \[0, 1\]\) 'full: (\d+ tensors)'", r0["message"])
    assert m, r0["message"]
    seq, name = m.groups()
    assert re.search(rf"rank 1 \(last heard \d+\.\d s ago\): MISMATCH: its #{seq} on dp is all_reduce "
                     rf"'grad norm' \(4 B\) where this rank's is all_gather 'full: {name}'", r0["message"]), r0["message"]
    assert re.match(rf"rank 1: all_reduce #{seq} on dp \(ranks \[0, 1\]\) 'grad norm' \(4 B\)", r1["message"])
    assert re.search(rf"rank 0 \(last heard \d+\.\d s ago\): MISMATCH: its #{seq} on dp is all_gather "
                     rf"'full: {name}' .* where this rank's is all_reduce 'grad norm'", r1["message"]), r1["message"]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_pipeline_rank_that_dies_mid_step_makes_its_peer_raise():
    """Rank 0 waits for stage 1's gradients, which travel to the lower rank over the pipeline's
    second group (``pp:down``, PipelineModule._p2p_group); rank 1 dies before sending them."""
    with pytest.raises(RuntimeError, match="rank 0 of 2 failed") as info:
        run(hangs.pipeline_killed_rank, 2, TIMEOUT, timeout=60)
    msg = str(info.value)
    m = re.search(r"CollectiveError: rank 0: recv #(\d+) from rank 1 on pp:down \(ranks \[0, 1\]\) "
                  r"'gradients for 0B1 \[0\]' \(\d+ B\) failed", msg)
    assert m, msg
    seq = int(m.group(1))
    assert "rank 1 (last heard" in msg
    assert f"did not issue send #{seq} to rank 0 on pp:down: its last there is #{seq - 1}" in msg
    assert _after(msg) < hangs.PUBLISHED + TIMEOUT / 2
    _dump_of(msg)


# ---- a rank that raises ---------------------------------------------------------------------------

def _check_refused(per_rank):
    (t0, m0, s0), (t1, m1, s1) = per_rank
    assert t1 == "CaptureError" and "could not capture TinyMLP" in m1
    assert t0 == "PeerError" and m0.startswith("rank 1 could not compile its part of the program") and \
        m0.endswith(f"CaptureError: {m1}")
    assert max(s0, s1) < 10, (s0, s1)


@pytest.mark.timeout(60)
def test_a_rank_that_fails_to_compile_stops_every_rank_at_once(ranks):
    """Rank 1's capture refuses its example inputs (one feature short): both ranks raise within
    seconds instead of rank 0 waiting out the 30 s timeout, rank 0 naming rank 1 and its error."""
    _check_refused(ranks(hangs.refused_on_one_rank, 2, LONG, timeout=60))


@pytest.mark.timeout(60)
def test_a_rank_that_fails_to_compile_stops_every_rank_at_once_as_threads():
    """The same with the ranks as threads of one process, sharing one store."""
    _check_refused(run_threads(hangs.refused_on_one_rank, 2, LONG, timeout=60))


@pytest.mark.timeout(60)
def test_a_rank_that_raises_in_forward_and_lives_on_makes_its_peer_raise_within_seconds():
    """Rank 1's forward raises and its process carries on (its caller caught the error): rank 0,
    waiting in the backward's gradient all-reduce for it, gives up within seconds of the 30 s
    timeout, naming rank 1 and its error. Before that, both ranks raised alike and rank 1
    resumed ``LAG`` seconds late: rank 0 waited for it (its peer's error stood, but rank 0 had
    raised at the same point)."""
    r0, r1 = run(hangs.raised_in_forward, 2, LONG, LAG, timeout=60)
    assert r1 == {"error": "injected into rank 1's forward"}
    assert r0["waited"] > LAG - 0.5, r0["waited"]
    lines = r0["message"].splitlines()
    m = re.match(r"rank 0: all_reduce #(\d+) on dp:grads \(ranks \[0, 1\]\) '[^']*' \([\d.]+ KiB\) failed [\d.]+ s "
                 r"after it was issued: given up: rank 1 raised in its forward before issuing it$", lines[0])
    assert m, r0["message"]
    assert re.match(r"rank 1 raised in its forward, \d+\.\d s before: RuntimeError: injected into rank 1's forward$",
                    lines[1]), r0["message"]
    assert f"did not issue all_reduce #{m.group(1)} on dp:grads" in r0["message"]
    assert r0["after"] < 10, r0["after"]
    _dump_of(r0["message"])


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_pipeline_rank_that_raises_is_named_when_its_peer_times_out():
    """A transfer cannot wait in slices on gloo: rank 0, waiting for the gradient rank 1 raised
    before sending, times out, and its error names rank 1's."""
    r0, r1 = run(hangs.pipeline_raised, 2, TIMEOUT, timeout=60)
    assert r1 == {"error": "injected into rank 1's stage"}
    assert re.match(r"rank 0: recv #\d+ from rank 1 on pp:down .* \(timed out\)", r0["message"]), r0["message"]
    assert re.search(r"^rank 1 raised in its train_step, \d+\.\d s before: RuntimeError: injected into rank 1's "
                     r"stage$", r0["message"], re.M), r0["message"]
    _dump_of(r0["message"])


# ---- without processes ---------------------------------------------------------------------------

def test_mesh_timeout():
    assert autopar.Mesh(dp=2, virtual=True).timeout.total_seconds() == 300
    mesh = autopar.Mesh(dp=2, virtual=True, timeout=5)
    assert mesh.timeout.total_seconds() == 5 and repr(mesh) == "Mesh(dp=2, virtual=True, timeout=5)"
    with pytest.raises(ValueError, match="must be positive"):
        autopar.Mesh(dp=2, virtual=True, timeout=0)
    with pytest.raises(TypeError, match="seconds or a datetime.timedelta"):
        autopar.Mesh(dp=2, virtual=True, timeout="5s")


def _entry(seq, kind="all_reduce", label="b", nbytes=16, state="completed", group="dp", peer=None):
    return {"group": group, "ranks": [0, 1, 2], "seq": seq, "kind": kind, "label": label, "bytes": nbytes,
            "peer": peer, "issued": 100.0, "ended": None if state == "issued" else 101.0, "state": state}


def test_message_says_how_each_rank_stands():
    """The verdicts, from reports written here: a rank behind, a rank that issued another
    collective at the same number, a rank that never reported, and a rank outside the group."""
    failed = dict(_entry(3, state="failed"), ended=105.0)
    reports = {0: {"time": 105.0, "entries": [_entry(2), failed]},
               1: {"time": 104.0, "entries": [_entry(2)]},
               2: {"time": 103.0, "entries": [_entry(3, kind="all_gather", label="full w", nbytes=64)]},
               3: None, 4: {"time": 90.0, "entries": []}}
    msg = flight.message(0, failed, RuntimeError("Timed out waiting 3000ms"), reports, None, "/tmp/f.json", 3.0)
    lines = msg.splitlines()
    assert lines[0] == ("rank 0: all_reduce #3 on dp (ranks [0, 1, 2]) 'b' (16 B) failed 5.0 s after it was "
                        "issued (timed out): RuntimeError: Timed out waiting 3000ms")
    assert "  rank 1 (last heard 1.0 s ago): did not issue all_reduce #3 on dp: its last there is #2" in lines
    assert ("  rank 2 (last heard 2.0 s ago): MISMATCH: its #3 on dp is all_gather 'full w' (64 B) where this "
            "rank's is all_reduce 'b' (16 B)") in lines
    assert "  rank 3: no report: it died or stalled before its first collective" in lines
    assert "  rank 4 (last heard 15.0 s ago, no heartbeat since: dead or frozen)" in lines   # not in the group
    assert "    all_reduce #3 on dp (ranks [0, 1, 2]) 'b' (16 B): FAILED after 5.0 s" in lines
    assert lines[-1] == "A collective waits at most the mesh's timeout (3 s here): autopar.Mesh(..., timeout=seconds)."
    # a transfer: only its peer is judged, by the matching direction
    send = dict(_entry(4, kind="send", peer=1, state="failed"), ended=105.0)
    reports = {1: {"time": 104.0, "entries": [_entry(4, kind="recv", peer=0, state="issued")]},
               2: {"time": 104.0, "entries": []}}
    msg = flight.message(0, send, RuntimeError("x"), reports, "DistNetworkError: Connection refused", None)
    assert "rank 1 (last heard 1.0 s ago): issued recv #4 from rank 0 too, not complete" in msg
    assert "rank 2 (last heard 1.0 s ago)\n" in msg
    assert "reports could not be read from the store (DistNetworkError: Connection refused)" in msg
    # a rank whose error stands is named under the first line
    raised = {2: {"error": "ValueError: bad input", "in": "forward", "time": 103.0, "positions": {}}}
    msg = flight.message(0, failed, RuntimeError("x"), {}, None, None, raised=raised)
    assert msg.splitlines()[1] == "rank 2 raised in its forward, 2.0 s before: ValueError: bad input"
