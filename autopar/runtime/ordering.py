"""Whether an issue order would deadlock on NCCL: every rank's collectives and transfers,
replayed under NCCL's rules.

On gloo a transfer waits only for its peer, so an order that NCCL cannot run still runs
here; this replay says, from the order the runtime issued (``flight.recording()``), whether
NCCL would. Its rules:

- per rank and per communicator (process group), one stream that runs what was issued on it
  in issue order, one item at a time: a collective, a transfer, or a batch;
- a collective completes when every member of the communicator has it at the head of its
  stream; the n-th collective on a communicator is the same on every member (another kind is
  a mismatch);
- the k-th send from rank A to rank B on a communicator matches the k-th receive on B from A
  there; each blocks its stream until both are at the heads of their streams (rendezvous:
  large messages do);
- a batch (``batch_isend_irecv``) is posted together: one item, all its transfers in flight at
  once, complete when each matched (a batch over several groups: one such item on each);
- an operation issued after the host waited on another depends on it (on NCCL the wait makes
  the compute stream wait, and the next operation's stream waits on the compute stream): it
  starts only once the waited one completed.

The replay advances every head it can until none can; what is left is the deadlock: per rank,
the head of each stream that did not finish and what it waits for (``Head``). Merging groups
(``merge``) replays an order as it would run with those groups as one communicator: the
pipeline's gloo-only second group (``PipelineModule`` puts its transfers to a lower rank on
``pp:down`` on gloo, on ``pp`` itself on NCCL) is replayed as ``merge={"pp:down": "pp"}``.
Merging only adds order, so an order clean merged is clean apart too.

Input: per global rank, its entries in issue order as ``Entry.as_dict`` gives them (``group``,
``ranks``, ``kind``, ``peer``, ``label``, ``index``, ``batch``, ``after``); ``index`` defaults
to the position in the list, ``batch`` to None (alone), ``after`` to nothing waited.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Head", "OrderDeadlock", "replay", "check"]


@dataclass(frozen=True)
class Head:
    """A stream that cannot go on: ``rank``'s head item on ``communicator`` (its operations
    not yet done, ``ops``) and why (``waits``, one line per operation or dependency)."""
    rank: int
    communicator: str
    ops: tuple[str, ...]
    waits: tuple[str, ...]

    def __str__(self) -> str:
        return (f"rank {self.rank} on {self.communicator}: [{', '.join(self.ops)}] waits: " +
                "; ".join(self.waits))


class OrderDeadlock(RuntimeError):
    """The order would deadlock on NCCL: ``heads`` are the blocked streams' heads."""

    def __init__(self, heads: list[Head]):
        self.heads = heads
        super().__init__("the issue order would deadlock on NCCL; the blocked streams' heads:\n" +
                         "\n".join(f"  {h}" for h in heads))


@dataclass
class _Op:
    rank: int
    kind: str
    peer: int | None
    label: str
    key: tuple                 # what matches it: see _Replay._add
    done: bool = False

    def __str__(self) -> str:
        where = "" if self.peer is None else f" {'to' if self.kind == 'send' else 'from'} rank {self.peer}"
        label = f" '{self.label}'" if self.label else ""
        return f"{self.kind} #{self.key[-1]}{where}{label}"


@dataclass
class _Item:
    stream: tuple
    position: int
    ops: list = field(default_factory=list)
    deps: dict = field(default_factory=dict)     # stream -> last position waited on there
    batch: int | None = None


class _Replay:
    def __init__(self, orders: dict, merge: dict | None):
        self.merge = dict(merge or {})
        self.streams: dict[int, dict[tuple, list[_Item]]] = {}
        self.head: dict[int, dict[tuple, int]] = {}
        self.where: dict[tuple, _Op] = {}           # match key of an op -> the op
        self.item_of: dict[int, _Item] = {}          # id(op) -> its item
        for rank, entries in sorted(orders.items()):
            self._load(int(rank), entries)

    def _communicator(self, e: dict) -> tuple:
        return self.merge.get(e["group"], e["group"]), tuple(e["ranks"])

    def _load(self, rank: int, entries: list) -> None:
        streams = self.streams.setdefault(rank, {})
        self.head[rank] = {}
        counts: dict[tuple, int] = {}
        located: dict[int, tuple] = {}     # entry index -> (stream, position)
        waited: dict[tuple, int] = {}      # stream -> last position waited on, so far
        batch, parts = None, {}            # the batch being read, and its item on each stream
        for n, e in enumerate(entries):
            index = e.get("index", n)
            for i in e.get("after") or ():
                if i in located:           # an entry from before the order began: long complete
                    s, pos = located[i]
                    waited[s] = max(waited.get(s, -1), pos)
            stream = self._communicator(e)
            items = streams.setdefault(stream, [])
            self.head[rank].setdefault(stream, 0)
            b = e.get("batch")
            if b is None or b != batch:
                batch, parts = b, {}
            item = parts.get(stream) if b is not None else None
            if item is None:
                item = _Item(stream, len(items), deps=dict(waited), batch=b)
                items.append(item)
                parts[stream] = item
            located[index] = (stream, item.position)
            op = self._add(rank, stream, e, counts)
            item.ops.append(op)
            self.item_of[id(op)] = item

    def _add(self, rank: int, stream: tuple, e: dict, counts: dict) -> _Op:
        """A transfer's key names its pair's k-th message one way on the communicator (the same
        on both sides); a collective's, the communicator's n-th collective."""
        kind, peer = e["kind"], e.get("peer")
        if peer is None:
            n = counts[(stream,)] = counts.get((stream,), 0) + 1
            key = ("coll", stream, rank, n)
        else:
            src, dst = (rank, peer) if kind == "send" else (peer, rank)
            n = counts[(stream, kind, peer)] = counts.get((stream, kind, peer), 0) + 1
            key = (kind, stream, src, dst, n)
        op = _Op(rank, kind, peer, e.get("label", ""), key)
        self.where[key] = op
        return op

    # ---- the replay -------------------------------------------------------------------------------
    def _current(self, rank: int, stream: tuple) -> _Item | None:
        items = self.streams.get(rank, {}).get(stream, [])
        pos = self.head[rank][stream] if rank in self.head and stream in self.head[rank] else 0
        return items[pos] if pos < len(items) else None

    def _ready(self, rank: int, item: _Item) -> bool:
        return all(self.head[rank][s] > pos for s, pos in item.deps.items())

    def _at_head(self, op: _Op | None) -> bool:
        if op is None:
            return False
        item = self.item_of[id(op)]
        return self._current(op.rank, item.stream) is item and self._ready(op.rank, item)

    def _partners(self, op: _Op) -> list:
        """The operations ``op`` completes together with (None where one was never issued)."""
        if op.peer is not None:
            kind, stream, src, dst, n = op.key
            return [self.where.get(("recv" if kind == "send" else "send", stream, src, dst, n))]
        _, stream, _, n = op.key
        return [self.where.get(("coll", stream, r, n)) for r in stream[1] if r != op.rank]

    def run(self) -> list[Head]:
        progress = True
        while progress:
            progress = False
            for rank, streams in self.streams.items():
                for stream in streams:
                    item = self._current(rank, stream)
                    while item is not None and self._ready(rank, item):
                        for op in item.ops:
                            if not op.done:
                                partners = self._partners(op)
                                if all(self._at_head(p) for p in partners):
                                    self._check_kinds(op, partners)
                                    for x in [op, *partners]:
                                        x.done = True
                        if not all(op.done for op in item.ops):
                            break
                        self.head[rank][stream] += 1
                        progress = True
                        item = self._current(rank, stream)
        return self._blocked()

    @staticmethod
    def _check_kinds(op: _Op, partners: list) -> None:
        if op.peer is None:
            for p in partners:
                if p.kind != op.kind:
                    raise ValueError(f"collective #{op.key[-1]} on {op.key[1][0]} {list(op.key[1][1])} is {op.kind} "
                                     f"'{op.label}' on rank {op.rank} but {p.kind} '{p.label}' on rank {p.rank}: "
                                     "every member must issue the same collectives in one order")

    # ---- the report -------------------------------------------------------------------------------
    def _blocked(self) -> list[Head]:
        heads = []
        for rank, streams in self.streams.items():
            for stream in streams:
                item = self._current(rank, stream)
                if item is None:
                    continue
                pending = [op for op in item.ops if not op.done]
                waits = [self._dependency(rank, s, pos) for s, pos in sorted(item.deps.items())
                         if self.head[rank][s] <= pos]
                if not waits:
                    waits = [self._why(op, len(pending) > 1) for op in pending]
                heads.append(Head(rank, _name(stream), tuple(map(str, pending)), tuple(waits)))
        return heads

    def _dependency(self, rank: int, stream: tuple, pos: int) -> str:
        item = self.streams[rank][stream][pos]
        return (f"the host waited on {', '.join(map(str, item.ops))} on {_name(stream)} before issuing it, "
                "which is not complete")

    def _why(self, op: _Op, named: bool) -> str:
        out = []
        for p in self._partners(op):
            if p is None:
                continue
            item = self.item_of[id(p)]
            now = self._current(p.rank, item.stream)
            if now is item:
                out.append(f"rank {p.rank}'s {p} is at its head but waits on the host's earlier waits")
            else:
                ahead = ", ".join(str(x) for x in now.ops if not x.done) if now is not None else "nothing"
                out.append(f"rank {p.rank}'s {p} is behind its {ahead} on {_name(item.stream)}")
        missing = [p for p in self._partners(op) if p is None]
        if missing:
            who = f"rank {op.peer}" if op.peer is not None else "a member"
            out.append(f"{who} never issues its counterpart of {op}")
        return (f"{op}: " if named else "") + "; ".join(out)


def _name(stream: tuple) -> str:
    return f"{stream[0]} {list(stream[1])}"


def replay(orders: dict, merge: dict | None = None) -> list[Head]:
    """Replay ``orders`` (global rank -> its entries in issue order) under NCCL's rules; the
    heads of the streams left blocked, empty when every operation completes. ``merge`` maps a
    group's name to the communicator it shares on NCCL. Raises ValueError for a collective
    issued as another kind on some member."""
    return _Replay(orders, merge).run()


def check(orders: dict, merge: dict | None = None) -> None:
    """``replay``, raising ``OrderDeadlock`` (naming each blocked stream's head) when the order
    would deadlock on NCCL."""
    heads = replay(orders, merge)
    if heads:
        raise OrderDeadlock(heads)
