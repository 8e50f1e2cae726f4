"""The flight recorder: a collective that cannot complete becomes an error that says what every
rank was last doing.

Every collective of the runtime is issued through ``launch`` and every point-to-point transfer
through ``batch`` (the transfers posted together), which note it in this
process's ring of the last ``RING`` entries: the group (its description, ``dp`` or ``dp:grads``
as the ``Mesh`` names it, and its ranks), the kind, a sequence number (per group for
collectives; per group, kind and peer for transfers, so that the same number names the same
collective on every rank), the label, the bytes, and whether it completed; for the replay of
the issue order (``autopar.runtime.ordering``) also its place in this process's issue order,
the batch it was posted in, and the entries whose wait returned since the entry before it was
issued (an operation issued after a wait depends on the waited one: on NCCL the wait makes the
compute stream wait, and the next operation's stream waits on the compute stream). Noting is a
few attribute writes; nothing is communicated. ``recording()`` keeps every entry a block
issues, where the ring keeps the last ``RING``.

An entry is complete when its work is: on gloo (and the fake group) when its ``wait``
returned, since gloo's wait blocks until then; on NCCL a ``wait`` only makes the current stream
wait for the work, so its completion is read from ``is_completed()``, when it is waited on and
again at each later issue and publication, until it says so.

The mesh's groups carry its timeout (``Mesh(timeout=...)``): a collective whose peer stalled
fails after it, one whose peer died fails at once. The failure raises a ``CollectiveError``
that names this rank, the collective and what every rank was last doing, read from the default
process group's store: a daemon thread per process publishes the newest entries of its ring
there (key ``autopar/flight/<rank>``), at most once every ``PUBLISH_EVERY`` seconds and only
when they changed, and otherwise a heartbeat every ``HEARTBEAT_EVERY`` seconds: a rank that
stalled is still heard from, one that died or froze falls silent ("last heard 12.0 s ago, no
heartbeat since: dead or frozen"). The failing rank's whole ring, with the reports it read,
is dumped as JSON to a file the message names.

A rank that raises in the runtime (``published``: the compiled module's forward, a pipeline's
step, the optimizer step), with an error other than a ``CollectiveError``, posts it to the
store before it propagates (key ``autopar/failed/<rank>``: the error and how many collectives
it had issued on each group), and withdraws it when it next runs or communicates. A failure
message names the ranks whose error stands ("rank 1 raised ValueError: ..."). When the
failing rank's process stays alive (a caller caught the error), its peers would wait in a
collective for the mesh's timeout: gloo can neither abort nor interrupt a collective in flight
(``ProcessGroupGloo.abort`` leaves it waiting), so on gloo an asynchronous collective's
``wait`` waits in slices of ``WAIT_SLICE`` seconds; past the first the publisher thread reads
the peers' errors from the store once every ``PUBLISH_EVERY`` seconds, and a wait for a peer
that raised before issuing this collective, where this rank did not raise alike, fails (in
about two seconds). The runtime's collectives (``comm.AxisComm``) are issued asynchronously
and waited on, synchronous calls included. What cannot wait in slices waits for the timeout:
a collective ``launch``ed synchronously (a pipeline's step loss and gradient norm), and a
transfer (gloo's receive takes a wait's timeout as its own and fails).

Compile communicates only after every rank compiled its part: ``agreed`` has each rank post
"ok" or its error to the store and wait (bounded by the mesh's timeout) until every rank has,
and a rank whose peer failed raises ``PeerError`` naming that rank and its error. Its keys are
numbered by a per-rank count of agreements (``store.add``), the same on every rank that runs
the same program, whether the ranks are processes or threads of one.

There is one recorder per process, as torch's flight recorder for NCCL has: a hang involves
whatever the process was doing, across every module and mesh it runs.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import functools
import json
import os
import tempfile
import threading
import time
import weakref

import torch
import torch.distributed as dist

__all__ = ["CollectiveError", "PeerError", "Recorder", "RECORDER", "Transfer", "Watched", "launch", "batch",
           "recording", "published", "agreed"]

RING = 32            # entries kept per process (all of them go to the dump file)
PUBLISHED = 16       # newest entries a rank publishes to the store
SHOWN = 4            # newest entries per rank the error message prints
PUBLISH_EVERY = 1.0  # seconds between two publications of a ring that changed
HEARTBEAT_EVERY = 2.0  # seconds between two heartbeats of a rank whose ring did not change
READ_ALL_UP_TO = 64  # a failure reads every rank's report up to this world size, else its group's
READ_WITHIN = 10.0   # seconds a failure waits for the store to answer
WAIT_SLICE = datetime.timedelta(seconds=0.5)   # gloo: a handle's wait checks for a peer that raised this often
KEY = "autopar/flight/{}"
ALIVE = "autopar/flight/{}/alive"
FAILED = "autopar/failed/{}"       # a rank's standing error (JSON), "" once withdrawn
FAILED_CHANGES = "autopar/failed"  # counts posts and withdrawals: the watcher reads the errors when it moves
AGREE = "autopar/agree/{}"


class CollectiveError(RuntimeError):
    """A collective or transfer that failed: the mesh's timeout expired, a peer died, or gloo
    saw a mismatch. The message names the group, the collective, its sequence number and what
    every rank was last doing; ``path`` is the JSON dump of this rank's flight recorder."""

    def __init__(self, message: str, path: str | None = None):
        super().__init__(message)
        self.path = path


class PeerError(RuntimeError):
    """Another rank failed where every rank goes on together (compile): ``rank`` is the first
    that did, ``error`` its error as "Type: message"."""

    def __init__(self, message: str, rank: int, error: str):
        super().__init__(message)
        self.rank, self.error = rank, error


class _PeerRaised(RuntimeError):
    """The cause of a collective abandoned because a peer raised before issuing it."""


class _Group:
    __slots__ = ("name", "ranks", "seq", "sliced", "nccl")

    def __init__(self, name: str, ranks: list[int], backend: str):
        self.name, self.ranks, self.seq = name, ranks, {}
        self.sliced, self.nccl = backend == "gloo", backend == "nccl"

    def position(self, kind: str | None = None, peer: int | None = None) -> str:
        """The key of a sequence on this group in ``Recorder.positions``."""
        return f"{self.name} {self.ranks}" + ("" if peer is None else f" {kind} {peer}")


class Entry:
    """One collective or transfer as this rank issued it: ``index`` is its place in this
    process's issue order, ``batch`` the number of the ``batch`` it was posted in (None: alone),
    ``after`` the indices of the entries whose wait returned since the previous entry's issue."""
    __slots__ = ("group", "seq", "kind", "label", "nbytes", "peer", "issued", "ended", "state", "index", "batch",
                 "after")

    def as_dict(self) -> dict:
        return {"group": self.group.name, "ranks": self.group.ranks, "seq": self.seq, "kind": self.kind,
                "label": self.label, "bytes": self.nbytes, "peer": self.peer, "issued": self.issued,
                "ended": self.ended, "state": self.state, "index": self.index, "batch": self.batch,
                "after": list(self.after)}


class Recorder:
    """This process's ring of the last ``RING`` collectives, and its publisher thread."""

    def __init__(self):
        self.ring: collections.deque[Entry] = collections.deque(maxlen=RING)
        self.changes = 0
        self._groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._publisher: threading.Thread | None = None
        self._lock = threading.Lock()
        self.waiting: Entry | None = None    # gloo: the entry a wait is past its first slice on
        self._peers: tuple = (None, {})      # (that entry, rank -> its standing error): the watcher's read
        self._watched = None                 # (FAILED_CHANGES, entry) the watcher last read at
        self._raised: dict[int, dict] = {}   # rank of this process -> positions at its last error
        self._standing: set[int] = set()     # ranks of this process whose posted error stands
        self.count = 0                       # entries issued by this process: the next one's index
        self.batches = 0                     # batches posted by this process: the last one's number
        self._waited: list[int] = []         # indices of the entries waited on since the last issue
        self._unsettled: list[tuple] = []    # NCCL: (entry, work) waited on, not yet seen completed
        self._tapes: list[list] = []         # the lists of the open recording() blocks

    # ---- the collective path: no communication -----------------------------------------------
    def issue(self, group, kind: str, label: str, nbytes: int, peer: int | None = None,
              batch: int | None = None) -> Entry:
        if self._standing:
            self.resume()
        if self._unsettled:
            self.settle()
        if group is None:
            group = dist.distributed_c10d._get_default_group()
        g = self._groups.get(group)
        if g is None:
            g = self._groups[group] = _Group(group.group_desc, dist.get_process_group_ranks(group),
                                             dist.get_backend(group))
        key = None if peer is None else (kind, peer)
        e = Entry()
        e.group, e.seq = g, g.seq.get(key, 0) + 1
        g.seq[key] = e.seq
        e.kind, e.label, e.nbytes, e.peer = kind, label, nbytes, peer
        e.issued, e.ended, e.state = time.time(), None, "issued"
        e.index, e.batch, e.after = self.count, batch, tuple(self._waited)
        self.count += 1
        self._waited = []
        self.ring.append(e)
        for tape in self._tapes:
            tape.append(e)
        self.changes += 1
        if self._publisher is None:
            self._start_publisher()
        return e

    def complete(self, e: Entry) -> None:
        if e.state == "issued":
            e.state, e.ended = "completed", time.time()
            self.changes += 1

    def waited(self, e: Entry, work) -> None:
        """A wait for ``e`` returned: what is issued next depends on it. Complete on gloo; on
        NCCL once ``work.is_completed()`` says so (now, or at a later ``settle``)."""
        self._waited.append(e.index)
        if not e.group.nccl:
            self.complete(e)
        elif work is None or work.is_completed():
            self.complete(e)
        else:
            with self._lock:
                self._unsettled.append((e, work))
                del self._unsettled[:-RING]      # older ones have left the ring: nobody reads them

    def settle(self) -> None:
        """NCCL: complete the waited entries whose work completed since."""
        with self._lock:
            pending, self._unsettled = self._unsettled, []
        kept = []
        for e, work in pending:
            try:
                done = work.is_completed()
            except RuntimeError:     # it failed: its wait or the watchdog says how
                done = False
            if done:
                self.complete(e)
            elif e.state == "issued":
                kept.append((e, work))
        with self._lock:
            self._unsettled[:0] = kept

    def positions(self) -> dict[str, int]:
        """How many collectives this process issued on each group (and transfers, per kind and
        peer), keyed by ``_Group.position``: the same key names the same sequence on every rank."""
        return {g.position(*(key or (None, None))): seq for g in list(self._groups.values())
                for key, seq in list(g.seq.items())}

    # ---- a rank that raised --------------------------------------------------------------------
    def raised(self, exc: BaseException, where: str) -> None:
        """Post this rank's error ``exc``, raised in its ``where``, to the store for its peers
        (once: the calls around the one that raised see it again)."""
        if getattr(exc, "_autopar_posted", False) or not _store_shared():
            return
        with contextlib.suppress(AttributeError):
            exc._autopar_posted = True
        rank, store = dist.get_rank(), dist.distributed_c10d._get_default_store()
        info = {"error": f"{type(exc).__name__}: {_first_line(exc)}", "in": where, "time": time.time(),
                "positions": self.positions()}
        self._raised[rank] = info["positions"]
        self._standing.add(rank)
        ring = json.dumps(self.report())       # the ring as it stands, for the peers' messages
        _bounded(lambda: (store.set(FAILED.format(rank), json.dumps(info)), store.add(FAILED_CHANGES, 1),
                          store.set(KEY.format(rank), ring)))

    def resume(self) -> None:
        """This rank runs again: withdraw its standing error."""
        rank = dist.get_rank() if dist.is_initialized() else None
        if rank in self._standing:
            self._standing.discard(rank)
            store = dist.distributed_c10d._get_default_store()
            _bounded(lambda: (store.set(FAILED.format(rank), ""), store.add(FAILED_CHANGES, 1)))

    @property
    def standing(self) -> bool:
        """Whether an error this process posted for its peers still stands (``resume``
        withdraws it)."""
        return bool(self._standing)

    @contextlib.contextmanager
    def tape(self):
        """Within the block, every entry this process issues is also appended, in issue order,
        to the list the block receives (``recording``)."""
        tape: list[Entry] = []
        self._tapes.append(tape)
        try:
            yield tape
        finally:
            self._tapes.remove(tape)

    def _watch(self, store) -> None:
        """While a wait is past its first slice: the peers' standing errors, read again when one
        was posted or withdrawn, or the wait is another's."""
        e = self.waiting
        if e is None:
            return
        at = (int(store.add(FAILED_CHANGES, 0)), e)
        if at == self._watched:
            return
        peers = {}
        if at[0]:        # some rank has posted an error since the store began
            world, me = dist.get_world_size(), dist.get_rank()
            for r in (range(world) if world <= READ_ALL_UP_TO else e.group.ranks):
                raw = store.get(FAILED.format(r)) if r != me and store.check([FAILED.format(r)]) else b""
                if raw:
                    peers[r] = json.loads(raw)
        self._watched, self._peers = at, (e, peers)

    def blame(self, e: Entry) -> tuple[int, dict] | None:
        """A peer whose standing error was raised before it issued ``e`` (so it will not), where
        this rank did not raise at the same point (then both are on their way back): (its rank,
        its error); None if none is known."""
        seen, peers = self._peers
        if seen is not e:
            return None
        me = dist.get_rank()
        for r, info in sorted(peers.items()):
            if e.peer is None and r in e.group.ranks:
                theirs = mine = e.group.position()
            elif e.peer == r:       # a transfer: its counterpart on the peer
                theirs = e.group.position("recv" if e.kind == "send" else "send", me)
                mine = e.group.position(e.kind, r)
            else:
                continue
            issued = info["positions"].get(theirs, 0)
            alike = me in self._raised and self._raised[me].get(mine, 0) == issued
            if issued < e.seq and not alike:
                return r, info
        return None

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
        """Publish the ring when it changed, else a heartbeat (the time) now and then, and
        while a wait is past its first slice read the peers' errors (``_watch``); end when the
        default process group is gone (the next collective, under a new one, starts another
        thread). A store that refuses (gone, or a fake one) is not tried again."""
        published, beat, refused = -1, 0.0, None
        while True:
            time.sleep(PUBLISH_EVERY)
            if not dist.is_initialized():
                self._publisher = None
                return
            store = None
            try:
                store = dist.distributed_c10d._get_default_store()
                if store is refused:
                    continue
                changes, now = self.changes, time.time()
                if changes != published:
                    self.publish(store)
                    published, beat = changes, now
                elif now - beat >= HEARTBEAT_EVERY:
                    store.set(ALIVE.format(dist.get_rank()), repr(now))
                    beat = now
                if self.waiting is not None:
                    self._watch(store)
                if self._unsettled:
                    self.settle()
            except Exception:
                refused = store

    # ---- failure -----------------------------------------------------------------------------------
    def failure(self, e: Entry, exc: BaseException) -> CollectiveError | None:
        """Mark ``e`` failed, read every rank's report, dump the ring; the error to raise (None
        on torch's fake process group, whose collectives cannot hang: ``exc`` says it all)."""
        if e.state != "failed":
            e.state, e.ended = "failed", time.time()
            self.changes += 1
        if self._unsettled:
            self.settle()
        if dist.get_backend() == "fake":
            return None
        rank = dist.get_rank()
        reports, raised, unreachable = self._read_reports(e)
        reports[rank] = self.report()
        path = os.path.join(tempfile.gettempdir(), f"autopar_flight_rank{rank}_pid{os.getpid()}.json")
        try:
            with open(path, "w") as f:
                json.dump({"rank": rank, "error": str(exc), "failed": e.as_dict(),
                           "entries": [x.as_dict() for x in self.ring],
                           "reports": {str(r): rep for r, rep in sorted(reports.items())},
                           "raised": {str(r): x for r, x in sorted(raised.items())}}, f, indent=1)
        except OSError:
            path = None
        return CollectiveError(message(rank, e.as_dict(), exc, reports, unreachable, path, self._timeout(e), raised),
                               path)

    def _timeout(self, e: Entry) -> float | None:
        """The failed collective's group timeout in seconds, where the backend tells it."""
        for group, g in self._groups.items():
            if g is e.group:
                try:
                    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                except Exception:
                    return None
        return None

    def _read_reports(self, e: Entry) -> tuple[dict, dict, str | None]:
        """The other ranks' last reports (None: never published), their standing errors, and
        why some could not be read: the store lives in one rank's process, which may be gone or
        unreachable (a store operation then waits for the store's own timeout, so the reads run
        on a thread that this one leaves behind after ``READ_WITHIN`` seconds)."""
        out: dict = {}
        raised: dict = {}
        why: list = []
        reader = threading.Thread(target=self._read_into, args=(e, out, raised, why), daemon=True)
        reader.start()
        reader.join(READ_WITHIN)
        if reader.is_alive():
            return dict(out), dict(raised), f"no answer from the store within {READ_WITHIN:g} s"
        return out, raised, why[0] if why else None

    def _read_into(self, e: Entry, out: dict, raised: dict, why: list) -> None:
        try:
            store = dist.distributed_c10d._get_default_store()
            self.publish(store)                # the final word of this rank
            world, me = dist.get_world_size(), dist.get_rank()
            ranks = range(world) if world <= READ_ALL_UP_TO else e.group.ranks
            for r in ranks:
                if r != me:
                    key, alive, failed = KEY.format(r), ALIVE.format(r), FAILED.format(r)
                    rep = json.loads(store.get(key)) if store.check([key]) else None
                    if rep is not None and store.check([alive]):
                        rep["time"] = max(rep["time"], float(store.get(alive)))
                    out[r] = rep
                    error = store.get(failed) if store.check([failed]) else b""
                    if error:
                        raised[r] = json.loads(error)
        except Exception as err:
            why.append(f"{type(err).__name__}: {_first_line(err)}")


RECORDER = Recorder()


class Watched:
    """An asynchronous collective's handle: ``wait`` notes that it was waited on (and, on gloo,
    its completion: ``Recorder.waited``), or raises ``CollectiveError`` when it failed."""
    __slots__ = ("_work", "_entry")

    def __init__(self, work, entry: Entry):
        self._work, self._entry = work, entry

    def wait(self, *args) -> bool:
        try:
            sliced = self._entry.group.sliced and self._entry.peer is None and not args
            ok = self._wait_in_slices() if sliced else self._work.wait(*args)
        except RuntimeError as exc:
            err = RECORDER.failure(self._entry, exc)
            if err is None:
                raise
            raise err from exc
        RECORDER.waited(self._entry, self._work)
        return ok

    def _wait_in_slices(self) -> bool:
        """Wait ``WAIT_SLICE`` at a time; between slices, give up if a peer raised before issuing
        this collective (``Recorder.blame``, from what the publisher thread reads meanwhile)."""
        e = self._entry
        try:
            while True:
                try:
                    if self._work.wait(WAIT_SLICE):
                        return True
                except RuntimeError:
                    if self._work.is_completed():      # it failed: not a slice that ran out
                        raise
                RECORDER.waiting = e
                blamed = RECORDER.blame(e)
                if blamed is not None:
                    rank, info = blamed
                    raise _PeerRaised(f"given up: rank {rank} raised in its {info['in']} before issuing it")
        finally:
            if RECORDER.waiting is e:
                RECORDER.waiting = None

    def is_completed(self) -> bool:
        done = self._work.is_completed()
        if done and self._entry.group.nccl:
            RECORDER.complete(self._entry)
        return done

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
    if work is None:        # synchronous: waited on by the call
        RECORDER.waited(e, None)
        return None
    return Watched(work, e)


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One transfer of a ``batch``: ``kind`` "send" or "recv", ``tensor`` to or from global
    rank ``peer`` over ``group``."""
    kind: str
    tensor: torch.Tensor
    peer: int
    group: object
    label: str
    tag: int = 0


def batch(transfers: list[Transfer]) -> list[Watched]:
    """Post ``transfers`` together (``dist.batch_isend_irecv``: on NCCL one group of operations,
    all in flight at once, so that none waits on the stream behind another of the batch; gloo
    issues them one by one), noting each in the recorder under one batch number. Transfers over
    several groups (gloo's second pp group) are posted as one call per group, groups in order of
    first appearance. Returns a handle per transfer, in order; on NCCL one work stands for the
    whole batch, and each transfer's handle waits for it."""
    if not transfers:
        return []
    RECORDER.batches += 1
    number = RECORDER.batches
    entries = [RECORDER.issue(t.group, t.kind, t.label, t.tensor.numel() * t.tensor.element_size(), t.peer, number)
               for t in transfers]
    groups: list[tuple] = []      # (group, indices of its transfers)
    for i, t in enumerate(transfers):
        at = next((idx for g, idx in groups if g is t.group), None)
        if at is None:
            groups.append((t.group, [i]))
        else:
            at.append(i)
    handles: list = [None] * len(transfers)
    for group, idx in groups:
        host = _host_staged(group, [transfers[i] for i in idx])
        ops = [dist.P2POp(dist.isend if transfers[i].kind == "send" else dist.irecv, host[k],
                          transfers[i].peer, group, transfers[i].tag) for k, i in enumerate(idx)]
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as exc:
            for i in idx[1:]:
                entries[i].state, entries[i].ended = "failed", time.time()
            err = RECORDER.failure(entries[idx[0]], exc)
            if err is None:
                raise
            raise err from exc
        assert len(works) in (1, len(idx)), (len(works), len(idx))
        for k, i in enumerate(idx):
            work = works[k if len(works) == len(idx) else 0]
            staged = host[k] is not transfers[i].tensor and transfers[i].kind == "recv"
            handles[i] = _Staged(work, entries[i], host[k], transfers[i].tensor) if staged else \
                Watched(work, entries[i])
    return handles


def _host_staged(group, transfers: list[Transfer]) -> list[torch.Tensor]:
    """The tensors a batch over ``group`` hands the backend: gloo moves host memory only (its
    point-to-point reads and writes the tensor's pointer as host memory), so on gloo a device
    tensor travels through a host copy: a send's copied down before it is posted, a receive's
    lands in a host buffer copied up when it is waited on (``_Staged``). On the CPU, and on
    NCCL, the tensors themselves."""
    if all(t.tensor.device.type == "cpu" for t in transfers) or dist.get_backend(group) != "gloo":
        return [t.tensor for t in transfers]
    return [t.tensor if t.tensor.device.type == "cpu" else
            t.tensor.to("cpu") if t.kind == "send" else torch.empty_like(t.tensor, device="cpu")
            for t in transfers]


class _Staged(Watched):
    """A receive into a device tensor over gloo (``_host_staged``): waiting copies the host
    buffer it landed in up to the device tensor, once."""
    __slots__ = ("_host", "_into")

    def __init__(self, work, entry: Entry, host: torch.Tensor, into: torch.Tensor):
        super().__init__(work, entry)
        self._host, self._into = host, into

    def wait(self, *args) -> bool:
        ok = super().wait(*args)
        if self._host is not None:
            self._into.copy_(self._host)
            self._host = None
        return ok


@contextlib.contextmanager
def recording():
    """Within the block, every entry this process issues is also appended, in issue order, to
    the list the block receives (the ring keeps the last ``RING``): the issue order that
    ``autopar.runtime.ordering`` replays (``Entry.as_dict`` gives each as data)."""
    with RECORDER.tape() as tape:
        yield tape


# ---- failing together -------------------------------------------------------------------------

def published(where: str):
    """Decorate a runtime entry point (``where``: "forward", "train_step", ...): an error it
    raises, other than a ``CollectiveError``, is posted for the peers before it propagates
    (``Recorder.raised``); entering it again withdraws this rank's standing error. A method of a
    module on a virtual mesh posts nothing."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(self, *args, **kwargs):
            if RECORDER.standing:
                RECORDER.resume()
            try:
                return fn(self, *args, **kwargs)
            except CollectiveError:
                raise
            except Exception as exc:
                if not getattr(getattr(self, "mesh", None), "virtual", False):
                    RECORDER.raised(exc, where)
                raise
        return call
    return wrap


@contextlib.contextmanager
def agreed(mesh):
    """Around the part of compile each rank does alone (capture and passes, before anything is
    communicated): on leaving it, every rank of ``mesh`` posts its outcome and waits for every
    other's (``agree``); this rank's own error propagates as it is, and a rank whose own part
    went well raises ``PeerError`` if another's failed."""
    try:
        yield
    except Exception as exc:
        with contextlib.suppress(Exception):     # this rank's own error is the one to raise
            agree(mesh, exc)
        raise
    agree(mesh)


def agree(mesh, error: BaseException | None = None) -> None:
    """Post this rank's outcome (``error``, None for "ok") under the next agreement's keys and
    wait, for at most the mesh's timeout, until every rank has; then, if some rank failed, the
    ranks that did not raise ``PeerError`` naming the first to fail (the ranks wait for each
    other once more, so that the store's host outlives the others' reads). Nothing to do on
    a virtual mesh, a world of one, or the fake process group."""
    if mesh.virtual or not _store_shared():
        return
    store, rank, world = dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
    base = AGREE.format(store.add(AGREE.format(f"count/{rank}"), 1))   # the same on every rank
    text = None if error is None else f"{type(error).__name__}: {error}"
    if text is not None and store.add(f"{base}/failed", 1) == 1:
        store.set(f"{base}/first", f"{rank}\n{text}")
    store.set(f"{base}/{rank}", text or "")
    if not _all_arrive(store, f"{base}/posted", world, mesh.timeout):
        if text is None:
            missing = [r for r in range(world) if not store.check([f"{base}/{r}"])]
            raise TimeoutError(f"ranks {missing} did not finish compiling within the mesh's timeout "
                               f"({mesh.timeout.total_seconds():g} s): they died, stalled, or are not compiling "
                               "this program; this rank compiled")
        return
    failed = int(store.add(f"{base}/failed", 0))
    if not failed:
        return
    first, first_error = store.get(f"{base}/first").decode().split("\n", 1)
    _all_arrive(store, f"{base}/read", world, datetime.timedelta(seconds=READ_WITHIN))
    if text is None:
        more = f" ({failed - 1} more failed too)" if failed > 1 else ""
        raise PeerError(f"rank {first} could not compile its part of the program, so no rank can run it{more}: "
                        f"{first_error}", int(first), first_error)


def _all_arrive(store, key: str, world: int, timeout: datetime.timedelta) -> bool:
    """A barrier through the store: whether every rank arrived at ``key`` within ``timeout``."""
    if store.add(key, 1) == world:
        store.set(f"{key}/all", "")
    try:
        store.wait([f"{key}/all"], timeout)
        return True
    except dist.DistStoreError:
        return False


def _store_shared() -> bool:
    """Whether this rank has peers that share the default store (not the fake group's)."""
    return dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake"


def _bounded(fn) -> None:
    """``fn()`` (store operations) on a thread this one waits for at most ``READ_WITHIN``
    seconds: a store whose host is gone may not answer before its own timeout. Its errors are
    dropped: posting is a courtesy to the peers, never a reason to fail."""
    def run():
        with contextlib.suppress(Exception):
            fn()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(READ_WITHIN)


# ---- the message ------------------------------------------------------------------------------

def message(rank: int, failed: dict, exc: BaseException, reports: dict, unreachable: str | None,
            path: str | None, timeout: float | None = None, raised: dict | None = None) -> str:
    """The text of a ``CollectiveError``: the failed collective, the ranks whose error stands
    (``raised``: rank -> what ``Recorder.raised`` posted), then what each rank was last doing,
    oldest entry first, with how the rank stands against the failed collective."""
    now = failed["ended"]
    text = _first_line(exc)
    if isinstance(exc, _PeerRaised):      # its text says it all
        cause, what = "", text
    else:
        cause = (" (timed out)" if "timed out" in text.lower() else
                 " (a peer closed its connection)" if "closed by peer" in text or "reset by peer" in text else "")
        what = f"{type(exc).__name__}: {text}"
    lines = [f"rank {rank}: {_name(failed)} failed {now - failed['issued']:.1f} s after it was issued{cause}: {what}"]
    lines += [f"rank {r} raised in its {x['in']}, {max(now - x['time'], 0.0):.1f} s before: {x['error']}"
              for r, x in sorted((raised or {}).items())]
    lines.append("What each rank was last doing (flight recorder, oldest first):")
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
