"""The flight recorder: a collective that cannot complete becomes an error that says what every
rank was last doing.

Every collective and point-to-point transfer of the runtime is issued through ``launch`` (or
``isend``/``irecv``), which notes it in this process's ring of the last ``RING`` entries: the
group (its description, ``dp`` or ``dp:grads`` as the ``Mesh`` names it, and its ranks), the
kind, a sequence number (per group for collectives; per group, kind and peer for transfers, so
that the same number names the same collective on every rank), the label, the bytes, and
whether it completed. Noting is a few attribute writes; nothing is communicated.

The mesh's groups carry its timeout (``Mesh(timeout=...)``): a collective whose peer stalled
fails after it, one whose peer died fails at once. The failure raises a ``CollectiveError``
that names this rank, the collective and what every rank was last doing, read from the default
process group's store: a daemon thread per process publishes the newest entries of its ring
there (key ``autopar/flight/<rank>``), at most once every ``PUBLISH_EVERY`` seconds and only
when they changed, and otherwise a heartbeat every ``HEARTBEAT_EVERY`` seconds: a rank that
stalled is still heard from, one that died or froze falls silent ("last heard 12.0 s ago, no
heartbeat since: dead or frozen"). The failing rank's whole ring, with the reports it read,
is dumped as JSON to a file the message names.

There is one recorder per process, as torch's flight recorder for NCCL has: a hang involves
whatever the process was doing, across every module and mesh it runs.
"""
from __future__ import annotations

import collections
import json
import os
import tempfile
import threading
import time
import weakref

import torch
import torch.distributed as dist

__all__ = ["CollectiveError", "Recorder", "RECORDER", "Watched", "launch", "isend", "irecv"]

RING = 32            # entries kept per process (all of them go to the dump file)
PUBLISHED = 16       # newest entries a rank publishes to the store
SHOWN = 4            # newest entries per rank the error message prints
PUBLISH_EVERY = 1.0  # seconds between two publications of a ring that changed
HEARTBEAT_EVERY = 2.0  # seconds between two heartbeats of a rank whose ring did not change
READ_ALL_UP_TO = 64  # a failure reads every rank's report up to this world size, else its group's
READ_WITHIN = 10.0   # seconds a failure waits for the store to answer
KEY = "autopar/flight/{}"
ALIVE = "autopar/flight/{}/alive"


class CollectiveError(RuntimeError):
    """A collective or transfer that failed: the mesh's timeout expired, a peer died, or gloo
    saw a mismatch. The message names the group, the collective, its sequence number and what
    every rank was last doing; ``path`` is the JSON dump of this rank's flight recorder."""

    def __init__(self, message: str, path: str | None = None):
        super().__init__(message)
        self.path = path


class _Group:
    __slots__ = ("name", "ranks", "seq")

    def __init__(self, name: str, ranks: list[int]):
        self.name, self.ranks, self.seq = name, ranks, {}


class Entry:
    """One collective or transfer as this rank issued it."""
    __slots__ = ("group", "seq", "kind", "label", "nbytes", "peer", "issued", "ended", "state")

    def as_dict(self) -> dict:
        return {"group": self.group.name, "ranks": self.group.ranks, "seq": self.seq, "kind": self.kind,
                "label": self.label, "bytes": self.nbytes, "peer": self.peer, "issued": self.issued,
                "ended": self.ended, "state": self.state}


class Recorder:
    """This process's ring of the last ``RING`` collectives, and its publisher thread."""

    def __init__(self):
        self.ring: collections.deque[Entry] = collections.deque(maxlen=RING)
        self.changes = 0
        self._groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._publisher: threading.Thread | None = None
        self._lock = threading.Lock()

    # ---- the collective path: no communication -----------------------------------------------
    def issue(self, group, kind: str, label: str, nbytes: int, peer: int | None = None) -> Entry:
        if group is None:
            group = dist.distributed_c10d._get_default_group()
        g = self._groups.get(group)
        if g is None:
            g = self._groups[group] = _Group(group.group_desc, dist.get_process_group_ranks(group))
        key = None if peer is None else (kind, peer)
        e = Entry()
        e.group, e.seq = g, g.seq.get(key, 0) + 1
        g.seq[key] = e.seq
        e.kind, e.label, e.nbytes, e.peer = kind, label, nbytes, peer
        e.issued, e.ended, e.state = time.time(), None, "issued"
        self.ring.append(e)
        self.changes += 1
        if self._publisher is None:
            self._start_publisher()
        return e

    def complete(self, e: Entry) -> None:
        if e.state == "issued":
            e.state, e.ended = "completed", time.time()
            self.changes += 1

    # ---- publishing ------------------------------------------------------------------------------
    def report(self, n: int = PUBLISHED) -> dict:
        return {"rank": dist.get_rank(), "pid": os.getpid(), "time": time.time(),
                "entries": [e.as_dict() for e in list(self.ring)[-n:]]}

    def publish(self, store) -> None:
        store.set(KEY.format(dist.get_rank()), json.dumps(self.report()))

    def _start_publisher(self) -> None:
        with self._lock:
            if self._publisher is None:
                self._publisher = threading.Thread(target=self._publish_loop, name="autopar-flight", daemon=True)
                self._publisher.start()

    def _publish_loop(self) -> None:
        """Publish the ring when it changed, else a heartbeat (the time) now and then; end when
        the default process group is gone (the next collective, under a new one, starts
        another thread). A store that refuses (gone, or a fake one) is not tried again."""
        published, beat, refused = -1, 0.0, None
        while True:
            time.sleep(PUBLISH_EVERY)
            if not dist.is_initialized():
                self._publisher = None
                return
            store = None
            try:
                store = dist.distributed_c10d._get_default_store()
                changes, now = self.changes, time.time()
                if store is refused or (changes == published and now - beat < HEARTBEAT_EVERY):
                    continue
                if changes != published:
                    self.publish(store)
                else:
                    store.set(ALIVE.format(dist.get_rank()), repr(now))
                published, beat = changes, now
            except Exception:
                refused = store

    # ---- failure -----------------------------------------------------------------------------------
    def failure(self, e: Entry, exc: BaseException) -> CollectiveError | None:
        """Mark ``e`` failed, read every rank's report, dump the ring; the error to raise (None
        on torch's fake process group, whose collectives cannot hang: ``exc`` says it all)."""
        if e.state != "failed":
            e.state, e.ended = "failed", time.time()
            self.changes += 1
        if dist.get_backend() == "fake":
            return None
        rank = dist.get_rank()
        reports, unreachable = self._read_reports(e)
        reports[rank] = self.report()
        path = os.path.join(tempfile.gettempdir(), f"autopar_flight_rank{rank}_pid{os.getpid()}.json")
        try:
            with open(path, "w") as f:
                json.dump({"rank": rank, "error": str(exc), "failed": e.as_dict(),
                           "entries": [x.as_dict() for x in self.ring],
                           "reports": {str(r): rep for r, rep in sorted(reports.items())}}, f, indent=1)
        except OSError:
            path = None
        return CollectiveError(message(rank, e.as_dict(), exc, reports, unreachable, path, self._timeout(e)), path)

    def _timeout(self, e: Entry) -> float | None:
        """The failed collective's group timeout in seconds, where the backend tells it."""
        for group, g in self._groups.items():
            if g is e.group:
                try:
                    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                except Exception:
                    return None
        return None

    def _read_reports(self, e: Entry) -> tuple[dict, str | None]:
        """The other ranks' last reports (None: never published), and why some could not be
        read: the store lives in one rank's process, which may be gone or unreachable (a store
        operation then waits for the store's own timeout, so the reads run on a thread that
        this one leaves behind after ``READ_WITHIN`` seconds)."""
        out: dict = {}
        why: list = []
        reader = threading.Thread(target=self._read_into, args=(e, out, why), daemon=True)
        reader.start()
        reader.join(READ_WITHIN)
        if reader.is_alive():
            return dict(out), f"no answer from the store within {READ_WITHIN:g} s"
        return out, why[0] if why else None

    def _read_into(self, e: Entry, out: dict, why: list) -> None:
        try:
            store = dist.distributed_c10d._get_default_store()
            self.publish(store)                # the final word of this rank
            world, me = dist.get_world_size(), dist.get_rank()
            ranks = range(world) if world <= READ_ALL_UP_TO else e.group.ranks
            for r in ranks:
                if r != me:
                    key, alive = KEY.format(r), ALIVE.format(r)
                    rep = json.loads(store.get(key)) if store.check([key]) else None
                    if rep is not None and store.check([alive]):
                        rep["time"] = max(rep["time"], float(store.get(alive)))
                    out[r] = rep
        except Exception as err:
            why.append(f"{type(err).__name__}: {_first_line(err)}")


RECORDER = Recorder()


class Watched:
    """An asynchronous collective's handle: ``wait`` notes its completion, or raises
    ``CollectiveError`` when it failed."""
    __slots__ = ("_work", "_entry")

    def __init__(self, work, entry: Entry):
        self._work, self._entry = work, entry

    def wait(self, *args) -> bool:
        try:
            ok = self._work.wait(*args)
        except RuntimeError as exc:
            err = RECORDER.failure(self._entry, exc)
            if err is None:
                raise
            raise err from exc
        RECORDER.complete(self._entry)
        return ok

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def get_future(self):
        return self._work.get_future()


def launch(group, kind: str, label: str, nbytes: int, start, *args, peer: int | None = None):
    """Issue a collective by ``start(*args)`` on ``group`` (None: the default group) and note it
    in the recorder. Returns a ``Watched`` handle for an asynchronous one, None once a
    synchronous one completed; a failure raises ``CollectiveError``."""
    e = RECORDER.issue(group, kind, label, nbytes, peer)
    try:
        work = start(*args)
    except RuntimeError as exc:
        err = RECORDER.failure(e, exc)
        if err is None:
            raise
        raise err from exc
    except BaseException:
        e.state, e.ended = "failed", time.time()
        raise
    if work is None:
        RECORDER.complete(e)
        return None
    return Watched(work, e)


def isend(tensor, peer: int, group, label: str, tag: int = 0) -> Watched:
    """``dist.isend`` to global rank ``peer`` over ``group``, noted in the recorder."""
    return launch(group, "send", label, tensor.numel() * tensor.element_size(), dist.isend, tensor, peer,
                  group, tag, peer=peer)


def irecv(tensor, peer: int, group, label: str, tag: int = 0) -> Watched:
    """``dist.irecv`` from global rank ``peer`` over ``group``, noted in the recorder."""
    return launch(group, "recv", label, tensor.numel() * tensor.element_size(), dist.irecv, tensor, peer,
                  group, tag, peer=peer)


# ---- the message ------------------------------------------------------------------------------

def message(rank: int, failed: dict, exc: BaseException, reports: dict, unreachable: str | None,
            path: str | None, timeout: float | None = None) -> str:
    """The text of a ``CollectiveError``: the failed collective, then what each rank was last
    doing, oldest entry first, with how the rank stands against the failed collective."""
    now = failed["ended"]
    text = _first_line(exc)
    cause = (" (timed out)" if "timed out" in text.lower() else
             " (a peer closed its connection)" if "closed by peer" in text or "reset by peer" in text else "")
    lines = [f"rank {rank}: {_name(failed)} failed {now - failed['issued']:.1f} s after it was issued{cause}: "
             f"{type(exc).__name__}: {text}",
             "What each rank was last doing (flight recorder, oldest first):"]
    for r in sorted(reports):
        rep = reports[r]
        if rep is None:
            lines.append(f"  rank {r}: no report: it died or stalled before its first collective")
            continue
        silent = max(now - rep["time"], 0.0)
        heard = ("this rank" if r == rank else f"last heard {silent:.1f} s ago" +
                 (", no heartbeat since: dead or frozen" if silent > HEARTBEAT_EVERY + 2 * PUBLISH_EVERY else ""))
        verdict = "" if r == rank else _verdict(failed, rank, r, rep["entries"])
        lines.append(f"  rank {r} ({heard}){': ' + verdict if verdict else ''}")
        lines += [f"    {_name(x)}: {_state(x, now)}" for x in rep["entries"][-SHOWN:]]
    if unreachable:
        lines.append(f"  the other ranks' reports could not be read from the store ({unreachable}); the rank "
                     "that hosts it may have exited")
    if path:
        lines.append(f"This rank's flight recorder: {path}")
    lines.append(f"A collective waits at most the mesh's timeout{f' ({timeout:g} s here)' if timeout else ''}: "
                 "autopar.Mesh(..., timeout=seconds).")
    return "\n".join(lines)


def _name(x: dict) -> str:
    peer = "" if x["peer"] is None else f" {'to' if x['kind'] == 'send' else 'from'} rank {x['peer']}"
    label = f" '{x['label']}'" if x["label"] else ""
    return f"{x['kind']} #{x['seq']}{peer} on {x['group']} {_ranks(x['ranks'])}{label} ({_bytes(x['bytes'])})"


def _state(x: dict, now: float) -> str:
    if x["state"] == "issued":
        return f"issued {now - x['issued']:.1f} s ago, not complete"
    if x["state"] == "completed":
        return f"completed {now - x['ended']:.1f} s ago"
    return f"FAILED after {x['ended'] - x['issued']:.1f} s"


def _verdict(failed: dict, me: int, r: int, entries: list[dict]) -> str:
    """How rank ``r`` stands against this rank's failed collective, from its reported entries
    (empty when ``r`` takes no part in it)."""
    if failed["peer"] is None:
        if r not in failed["ranks"]:
            return ""
        kind, peer = None, None
    else:
        if r != failed["peer"]:
            return ""
        kind, peer = ("recv" if failed["kind"] == "send" else "send"), me
    same = [x for x in entries if x["group"] == failed["group"] and x["ranks"] == failed["ranks"]
            and x["peer"] == peer and (kind is None or x["kind"] == kind)]
    want = f"{kind or failed['kind']} #{failed['seq']}"
    if peer is not None:
        want += f" {'to' if kind == 'send' else 'from'} rank {me}"
    twin = next((x for x in same if x["seq"] == failed["seq"]), None)
    if twin is not None:
        if twin["kind"] != (kind or failed["kind"]) or twin["bytes"] != failed["bytes"]:
            return (f"MISMATCH: its #{twin['seq']} on {failed['group']} is {twin['kind']} '{twin['label']}' "
                    f"({_bytes(twin['bytes'])}) where this rank's is {failed['kind']} '{failed['label']}' "
                    f"({_bytes(failed['bytes'])})")
        return f"issued {want} too, {'not complete' if twin['state'] == 'issued' else twin['state']}"
    if not same:
        return f"did not issue {want}: nothing on {failed['group']} among its last {len(entries)} entries"
    last = max(x["seq"] for x in same)
    if last < failed["seq"]:
        return f"did not issue {want} on {failed['group']}: its last there is #{last}"
    return f"{want} is older than its last {len(entries)} entries"


def _ranks(ranks: list[int]) -> str:
    if len(ranks) <= 8:
        return f"(ranks {ranks})"
    return f"(ranks [{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}], {len(ranks)} in all)"


def _bytes(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
