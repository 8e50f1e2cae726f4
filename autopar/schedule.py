"""Pipeline-parallel schedules as plain action lists, and a simulator that checks them.

A schedule says, for every rank on the pipeline axis, in which order it runs the forward
(F), backward (B) and, when the backward is split, weight-gradient (W) pass of each
(stage, micro-batch). Keeping it as data rather than as code in the runtime lets us build the
classic schedules (GPipe, 1F1B, interleaved 1F1B, zero-bubble ZB-H1), print and parse them,
insert the point-to-point sends/receives (``lower``), group them into the batches a rank posts
together (``batch_transfers``), and replay them in event time (``simulate``) to catch deadlocks
and measure the bubble before any process is started.
Timelines render as SVG, ASCII or a Chrome trace.
"""
from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from xml.sax.saxutils import escape

from .trace import ChromeTrace

__all__ = ["KINDS", "COMPUTE", "SCHEDULES", "Action", "Schedule", "ScheduleDeadlock", "Timeline",
           "build_schedule", "bubble_formula", "execute", "lower", "batch_transfers", "simulate", "matching_send",
           "matching_recv", "action_costs", "deadlock_message"]

KINDS = ("F", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B")
COMPUTE = ("F", "B", "W")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
_ACTION_RE = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|W)(\d+)")
_RANK_RE = re.compile(r"rank\s+(\d+)\s*:(.*)")


@dataclass(frozen=True)
class Action:
    """One step of one rank: ``kind`` of (``stage``, micro-batch ``mb``); prints as ``1F0``."""
    stage: int
    kind: str
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"

    @classmethod
    def parse(cls, text: str) -> Action:
        match = _ACTION_RE.fullmatch(text.strip())
        if not match:
            raise ValueError(f"cannot parse action {text!r}: expected <stage><kind><mb> with kind "
                             f"in {KINDS}, e.g. '1F0' or '0RECV_B2'")
        return cls(int(match.group(1)), match.group(2), int(match.group(3)))


@dataclass(frozen=True)
class Schedule:
    """Per rank, the compute actions (F/B/W) in execution order; stage s lives on rank s % p."""
    name: str
    p: int
    v: int
    m: int
    split_backward: bool
    ranks: tuple

    def __post_init__(self):
        object.__setattr__(self, "ranks", tuple(tuple(acts) for acts in self.ranks))

    @property
    def n_stages(self) -> int:
        return self.p * self.v

    def rank_of(self, stage: int) -> int:
        return stage % self.p

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(map(str, acts)) for r, acts in enumerate(self.ranks))

    @classmethod
    def parse(cls, text: str, name: str = "custom", p: int | None = None, v: int | None = None) -> Schedule:
        """Inverse of ``str``: one ``rank r: 0F0 0B0 ...`` line per rank, ranks in order."""
        lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
        ranks = []
        for i, line in enumerate(lines):
            match = _RANK_RE.fullmatch(line)
            if not match or int(match.group(1)) != i:
                raise ValueError(f"schedule line {i + 1} is {line!r}: expected 'rank {i}: <actions>' "
                                 "(one line per rank, ranks in order 0, 1, ...)")
            ranks.append(tuple(Action.parse(tok) for tok in match.group(2).split()))
        if p is not None and p != len(ranks):
            raise ValueError(f"schedule text has {len(ranks)} rank lines but p={p}: give one line per rank")
        acts = [a for acts in ranks for a in acts]
        if not acts:
            raise ValueError("schedule text holds no actions: expected lines like 'rank 0: 0F0 0B0'")
        p = len(ranks)
        n_stages = max(a.stage for a in acts) + 1
        if v is None:
            if n_stages % p:
                raise ValueError(f"schedule text uses {n_stages} stages on {p} ranks: the stage count "
                                 "must be a multiple of the rank count (pass v= explicitly)")
            v = n_stages // p
        m = max(a.mb for a in acts) + 1
        return cls(name, p, v, m, any(a.kind == "W" for a in acts), tuple(ranks))

    def validate(self) -> None:
        """Raise ValueError naming the first problem: a missing, duplicate, misplaced or misordered action."""
        if self.p < 1 or self.v < 1 or self.m < 1 or len(self.ranks) != self.p:
            raise ValueError(f"schedule {self.name!r} has p={self.p}, v={self.v}, m={self.m} and "
                             f"{len(self.ranks)} rank lists: expected p, v, m >= 1 and p rank lists")
        kinds = COMPUTE if self.split_backward else ("F", "B")
        position = {}
        for r, acts in enumerate(self.ranks):
            for i, a in enumerate(acts):
                where = f"schedule {self.name!r}, rank {r}, position {i}: {a}"
                if a.kind not in kinds:
                    raise ValueError(f"{where} has kind {a.kind!r}; expected one of {kinds} (compute "
                                     "only; `lower` adds the sends/receives" +
                                     ("; W needs split_backward=True)" if a.kind == "W" else ")"))
                if not (0 <= a.stage < self.n_stages and 0 <= a.mb < self.m):
                    raise ValueError(f"{where} is out of range: expected stage < {self.n_stages}, mb < {self.m}")
                if self.rank_of(a.stage) != r:
                    raise ValueError(f"{where} belongs on rank {self.rank_of(a.stage)} (stage s lives "
                                     f"on rank s % p): move it there")
                if a in position:
                    raise ValueError(f"{where} appears twice: keep exactly one")
                position[a] = i
        for s in range(self.n_stages):
            for mb in range(self.m):
                self._check_order(s, mb, kinds, position)

    def _check_order(self, s, mb, kinds, position) -> None:
        r = self.rank_of(s)
        need = [Action(s, k, mb) for k in kinds]
        # same-rank data dependencies (only when p == 1): F(s-1) feeds F(s), B(s+1) feeds B(s)
        if s > 0 and self.rank_of(s - 1) == r:
            need.insert(0, Action(s - 1, "F", mb))
        for a in need:
            if a not in position:
                raise ValueError(f"schedule {self.name!r}, rank {self.rank_of(a.stage)} lacks {a}: "
                                 f"every stage needs one of each of {kinds} per micro-batch")
        pairs = list(itertools.pairwise(need))
        if s + 1 < self.n_stages and self.rank_of(s + 1) == r:
            pairs.append((Action(s + 1, "B", mb), Action(s, "B", mb)))
        for first, then in pairs:
            if position.get(first, -1) > position[then]:
                raise ValueError(f"schedule {self.name!r}, rank {r}: {then} comes before {first}, "
                                 f"which it depends on: move {then} after {first}")


def build_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """Build one of SCHEDULES for p ranks, m micro-batches and v stages per rank."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: expected one of {SCHEDULES}")
    for label, val in (("p", p), ("m", m), ("v", v)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{name} schedule needs {label} >= 1 (an int), got {label}={val!r}")
    if name == "interleaved":
        if v < 2:
            raise ValueError(f"interleaved needs v >= 2 stages per rank, got v={v}: use '1f1b' for v=1")
        if m % p:
            raise ValueError(f"interleaved needs m % p == 0 (micro-batches in groups of p), got m={m}, "
                             f"p={p}: use m={(m // p + 1) * p} or '1f1b'")
    elif v != 1:
        raise ValueError(f"{name} runs one stage per rank, got v={v}: use 'interleaved' for v > 1")
    if name != "gpipe" and m < p:
        raise ValueError(f"{name} with m={m} < p={p}: fewer micro-batches than stages cannot fill "
                         f"the pipeline; use m >= p or gpipe")
    ranks = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "zero_bubble": _zero_bubble}.get(name)
    ranks = _interleaved(p, m, v) if ranks is None else ranks(p, m)
    return Schedule(name, p, v, m, name == "zero_bubble", ranks)


def _gpipe(p, m):
    return [[Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)] for r in range(p)]


def _one_f_one_b(p, m):
    fwd = [[Action(r, "F", i) for i in range(m)] for r in range(p)]
    bwd = [[Action(r, "B", i) for i in range(m)] for r in range(p)]
    return [_warmup_steady_cooldown(fwd[r], bwd[r], min(p - r - 1, m)) for r in range(p)]


def _interleaved(p, m, v):
    ranks = []
    for r in range(p):
        mbs = [(k // (p * v)) * p + k % p for k in range(m * v)]
        fwd = [Action(((k // p) % v) * p + r, "F", mb) for k, mb in enumerate(mbs)]
        bwd = [Action((v - 1 - (k // p) % v) * p + r, "B", mb) for k, mb in enumerate(mbs)]
        ranks.append(_warmup_steady_cooldown(fwd, bwd, min((p - r - 1) * 2 + (v - 1) * p, m * v)))
    return ranks


def _warmup_steady_cooldown(fwd, bwd, warmup):
    """``warmup`` forwards, then alternate forward/backward, then the remaining backwards."""
    order = list(fwd[:warmup])
    for i, f in enumerate(fwd[warmup:]):
        order += [f, bwd[i]]
    return order + list(bwd[len(fwd) - warmup:])


def _zero_bubble(p, m):
    """ZB-H1 (Qi et al. 2023) by list scheduling in unit-time steps over all ranks at once.

    Each rank runs its F and B in 1F1B order; a W fills any step in which the next F/B cannot
    run yet, and is forced before an F that would put more than p micro-batches between F and W
    (the first rank's 1F1B peak, which ZB-H1 keeps). B then no longer waits on W, so the backward
    chain drains faster and the pipeline's idle time is a third of 1F1B's when F = B = W.
    """
    seqs = [[(a.kind, a.mb) for a in acts] for acts in _one_f_one_b(p, m)]
    done, pos, order, step = set(), [0] * p, [[] for _ in range(p)], 0
    while len(done) < 3 * p * m:
        picks = [_zb_pick(r, p, m, done, seqs[r][pos[r]] if pos[r] < len(seqs[r]) else None)
                 for r in range(p)]
        if not any(picks):
            raise RuntimeError(f"zero_bubble generator stalled at step {step} (p={p}, m={m}): a bug")
        for r, pick in enumerate(picks):
            if pick:
                done.add((r, *pick))   # visible to every rank from the next step on
                order[r].append(Action(r, *pick))
                pos[r] += pick[0] != "W"
        step += 1
    return order


def _zb_pick(r, p, m, done, nxt):
    if nxt is not None:
        kind, mb = nxt
        if kind == "F":
            ready = r == 0 or (r - 1, "F", mb) in done
            ready = ready and sum((r, "F", i) in done and (r, "W", i) not in done for i in range(m)) < p
        else:
            ready = (r, "F", mb) in done and (r == p - 1 or (r + 1, "B", mb) in done)
        if ready:
            return nxt
    w_ready = [mb for mb in range(m) if (r, "B", mb) in done and (r, "W", mb) not in done]
    return ("W", w_ready[0]) if w_ready else None


def bubble_formula(name: str, p: int, m: int, v: int = 1) -> str:
    """The closed-form bubble fraction of schedule ``name`` with equal stages, as formula =
    number: (p−1)/(m+p−1) for GPipe and 1F1B, (p−1)/(v·m+p−1) interleaved (Narayanan et al.,
    SC'21, section 2.2), (p−1)/(3m+p−1) for zero-bubble ZB-H1 with F = B = W (Qi et al., ICLR
    2024); a custom action list has none."""
    if name in ("gpipe", "1f1b"):
        return f"(p−1)/(m+p−1) = {p - 1}/({m}+{p - 1}) = {(p - 1) / (m + p - 1):.4f}"
    if name == "interleaved":
        return f"(p−1)/(v·m+p−1) = {p - 1}/({v}·{m}+{p - 1}) = {(p - 1) / (v * m + p - 1):.4f}"
    if name == "zero_bubble":
        return f"ZB-H1 with F = B = W: (p−1)/(3m+p−1) = {p - 1}/(3·{m}+{p - 1}) = {(p - 1) / (3 * m + p - 1):.4f}"
    return "(a custom schedule: no closed form)"


def lower(schedule: Schedule) -> tuple:
    """Per rank, the compute actions with the point-to-point sends/receives they need."""
    last = schedule.n_stages - 1
    programs = []
    for acts in schedule.ranks:
        prog = []
        for a in acts:
            s, mb = a.stage, a.mb
            if a.kind == "F":
                remote_in = s > 0 and schedule.rank_of(s - 1) != schedule.rank_of(s)
                remote_out = s < last and schedule.rank_of(s + 1) != schedule.rank_of(s)
                prog += [Action(s, "RECV_F", mb)] * remote_in + [a] + [Action(s, "SEND_F", mb)] * remote_out
            elif a.kind == "B":
                remote_in = s < last and schedule.rank_of(s + 1) != schedule.rank_of(s)
                remote_out = s > 0 and schedule.rank_of(s - 1) != schedule.rank_of(s)
                prog += [Action(s, "RECV_B", mb)] * remote_in + [a] + [Action(s, "SEND_B", mb)] * remote_out
            else:
                prog.append(a)
        programs.append(tuple(prog))
    return tuple(programs)


def batch_transfers(schedule: Schedule, programs=None) -> tuple:
    """Per rank, its lowered program (``programs``, default ``lower(schedule)``) with the
    transfers grouped into the batches it posts together (``batch_isend_irecv``): a tuple of
    steps, each a compute action or a tuple of SEND/RECV actions.

    NCCL runs a rank's transfers on a communicator in issue order, and a transfer holds its
    stream until the peer's counterpart runs, so the order must never put a transfer ahead of
    one its counterpart waits for. The program is replayed in event time (``execute``, its
    default costs); a message sent at time T is posted at T on both sides: each rank has one
    batch per time T, holding its sends at T and the receives of its peers' sends at T. A rank
    posts its batches in time order, each as early as that allows: after the batch before it
    and after the compute that produced its sends, if any (a receive alone is then posted
    before the computes that run while its message is on its way; the one that needs it comes
    after, as it starts after T). Why no rank can wait for ever, by induction over the times:
    once every batch before T completed, every compute placed before a batch at T can run (its
    receives were at earlier times), so every rank's batch at T reaches the head of its stream,
    and each transfer there meets its counterpart in the peer's batch at T."""
    programs = lower(schedule) if programs is None else programs
    ends = {a: end for evs in execute(schedule, programs).events for a, _, end in evs}

    def sent_at(x: Action) -> float:
        send = x if x.kind.startswith("SEND") else matching_send(x)
        return ends[Action(send.stage, send.kind[-1], send.mb)]

    out = []
    for prog in programs:
        by_time: dict[float, list] = {}
        for a in prog:
            if a.kind not in COMPUTE:
                by_time.setdefault(sent_at(a), []).append(a)
        times, steps, done = sorted(by_time), [], set()
        for a in [x for x in prog if x.kind in COMPUTE] + [None]:
            while times and all(Action(x.stage, x.kind[-1], x.mb) in done
                                for x in by_time[times[0]] if x.kind.startswith("SEND")):
                steps.append(tuple(by_time[times.pop(0)]))
            if a is not None:
                steps.append(a)
                done.add(a)
        out.append(tuple(steps))
    return tuple(out)


class ScheduleDeadlock(RuntimeError):
    """The lowered schedule cannot finish: some ranks wait on receives that never arrive."""


@dataclass
class Timeline:
    """Where each compute action ran, per rank: (action, start, end)."""
    schedule: Schedule
    events: list
    makespan: float

    def rank_bubble(self, r: int) -> float:
        busy = sum(end - start for _, start, end in self.events[r])
        return (self.makespan - busy) / self.makespan if self.makespan else 0.0

    def bubble_fraction(self) -> float:
        # idle / total rather than 1 - busy / total: exact (correctly rounded) for integer costs
        total = self.schedule.p * self.makespan
        busy = sum(end - start for evs in self.events for _, start, end in evs)
        return (total - busy) / total if total else 0.0

    def _label(self, a: Action) -> str:
        return f"{a.kind}{a.mb}" + (f"s{a.stage}" if self.schedule.v > 1 else "")

    def _title(self) -> str:
        s = self.schedule
        return f"{s.name}: p={s.p} v={s.v} m={s.m}, bubble {self.bubble_fraction():.1%}"

    def to_svg(self, scale: float = 40.0, row: float = 30.0) -> str:
        """Rank x time picture: one row per rank, one rect (class "action") per compute action."""
        s, left, top = self.schedule, 60.0, 40.0
        colors = {"F": "#5b9bd5", "B": "#8fd18b" if s.split_backward else "#2e8b57", "W": "#f4a261"}
        width, height = left + self.makespan * scale + 20, top + s.p * row + 50
        out = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:g}" height="{height:g}" '
                f'font-family="monospace" font-size="11">'),
               f'<text x="{left:g}" y="20" font-size="14">{escape(self._title())}</text>']
        for r, evs in enumerate(self.events):
            y = top + r * row
            out.append(f'<text x="5" y="{y + row / 2 + 4:g}">rank {r}</text>')
            for a, start, end in evs:
                x, w = left + start * scale, (end - start) * scale
                out.append(f'<rect class="action" x="{x:g}" y="{y:g}" width="{w:g}" height="{row - 4:g}" '
                           f'fill="{colors[a.kind]}" stroke="#333"><title>{a} [{start:g}, {end:g})</title></rect>')
                out.append(f'<text x="{x + w / 2:g}" y="{y + row / 2 + 2:g}" text-anchor="middle">'
                           f'{self._label(a)}</text>')
        kinds = COMPUTE if s.split_backward else ("F", "B")
        names = {"F": "forward", "B": "input grad" if s.split_backward else "backward", "W": "weight grad"}
        for i, k in enumerate(kinds):
            x, y = left + i * 120, top + s.p * row + 15
            out.append(f'<rect class="legend" x="{x:g}" y="{y:g}" width="14" height="14" fill="{colors[k]}"/>')
            out.append(f'<text x="{x + 20:g}" y="{y + 11:g}">{k}: {names[k]}</text>')
        return "\n".join(out + ["</svg>"])

    def to_text(self, width: int = 160) -> str:
        """ASCII grid: one row per rank, one cell per time unit ("F0"; "--" continues an action
        longer than a unit; "." idle). The unit is the shortest action, exact for unit costs
        (F=1, B=2, ...); rows longer than ``width`` characters wrap into blocks."""
        cell = max([len(self._label(a)) for evs in self.events for a, _, _ in evs] + [1])
        unit = min((e - s for evs in self.events for _, s, e in evs if e > s), default=1.0)
        n = math.ceil(self.makespan / unit - 1e-9)
        grid = [self._row(evs, unit, n, cell) for evs in self.events]
        per_line = max(1, (width - len(f"rank {len(grid) - 1}: ")) // (cell + 1))
        lines = [self._title()]
        for lo in range(0, max(n, 1), per_line):
            if n > per_line:
                lines.append(f"t = {lo * unit:g} ..")
            lines += [f"rank {r}: " + " ".join(row[lo:lo + per_line]).rstrip() for r, row in enumerate(grid)]
        return "\n".join(lines)

    def _row(self, evs, unit, n, cell) -> list:
        cells = ["."] * n
        for a, start, end in evs:
            first = int(start / unit + 1e-9)
            for t in range(first, min(n, math.ceil(end / unit - 1e-9))):
                cells[t] = self._label(a) if t == first and cells[t] in (".", "-") else cells[t]
                cells[t] = "-" if cells[t] == "." else cells[t]
        return [c.ljust(cell, "-" if c == "-" else " ") for c in cells]

    def chrome_trace(self) -> dict:
        """Chrome/Perfetto trace: one process lane per rank, 1 time unit = 1 ms."""
        trace = ChromeTrace()
        for r in range(self.schedule.p):
            trace.process(r, f"rank {r}")
        for r, evs in enumerate(self.events):
            for a, start, end in evs:
                trace.span(r, 0, str(a), start * 1e-3, end * 1e-3, a.kind, {"stage": a.stage, "mb": a.mb})
        return trace.as_dict()


def simulate(schedule: Schedule, costs: dict | None = None, comm: float = 0.0, *,
             duration=None, latency=None, **sharing) -> Timeline:
    """Validate, lower and replay ``schedule`` in event time. ``costs`` overrides the per-kind
    durations (default F=1, B=2, or B=1 and W=1 when the backward is split); a message arrives
    ``comm`` after its send. ``duration(action)`` / ``latency(send_action)``, when given, set
    each compute action's duration and each message's transfer time (the cost model's
    per-stage times). ``sharing``: ``cores``, ``wake``, ``placement``, ``speed``,
    ``rendezvous`` for ranks that share processors (``execute``). Raises ScheduleDeadlock if
    the ranks cannot all finish."""
    schedule.validate()
    return execute(schedule, lower(schedule), costs, comm, duration=duration, latency=latency, **sharing)


def matching_send(recv: Action) -> Action:
    """The send whose message the receive ``recv`` waits for."""
    if recv.kind == "RECV_F":
        return Action(recv.stage - 1, "SEND_F", recv.mb)
    return Action(recv.stage + 1, "SEND_B", recv.mb)


def matching_recv(send: Action) -> Action:
    """The receive that waits for the send ``send``'s message (``matching_send``'s inverse)."""
    if send.kind == "SEND_F":
        return Action(send.stage + 1, "RECV_F", send.mb)
    return Action(send.stage - 1, "RECV_B", send.mb)


def action_costs(schedule: Schedule, costs: dict | None) -> dict:
    """Duration per compute kind: F=1, B=2 (B=1 and W=1 when backward is split), or ``costs``."""
    full = {"F": 1.0, "B": 1.0 if schedule.split_backward else 2.0, "W": 1.0}
    for kind, val in (costs or {}).items():
        if kind not in COMPUTE or not isinstance(val, (int, float)) or val < 0:
            raise ValueError(f"cost {kind!r}={val!r}: expected keys from {COMPUTE} with numbers >= 0, "
                             "e.g. costs={'F': 1, 'B': 2}")
        full[kind] = float(val)
    return full


def execute(schedule: Schedule, programs, costs: dict | None = None, comm: float = 0.0, *,
            duration=None, latency=None, cores: float | None = None, wake: float = 0.0, placement=None,
            speed=1.0, rendezvous: bool = False) -> Timeline:
    """Replay already-lowered per-rank ``programs`` (see ``lower``) in event time: the one
    interpreter of an action list's timing, shared by the simulator (``simulate``), the NCCL
    batches (``batch_transfers``) and the cost model's pipeline (``autopar.cost.pipeline``).
    The runtime (``autopar.runtime.pipeline_module``) runs the same lowered programs in the
    batches ``batch_transfers`` cuts, with tensors instead of durations: it waits on real
    messages, so it has no clock to share with this replay.

    A compute action takes ``duration(action)`` (default: ``costs`` per kind, see
    ``action_costs``); a message arrives ``latency(send)`` (default ``comm``) after its send.
    By default each rank has a processor of its own. Ranks that share ``cores`` processors, as
    processes on one CPU do, advance at min(1, cores / k) while k of them compute at once
    (processor sharing, the scheduler's fair share); a rank waiting for a message takes no
    processor, and one woken by its message while every processor is taken waits ``wake`` more
    for one.

    ``placement``, when given, is per rank (group, processors of the group, processes per
    rank) and replaces ``cores``: ranks of one group share that group's processors alone, each
    rank standing for that many processes computing in lockstep (its replicas along the other
    mesh axes), so a busy rank advances at min(1, processors / (processes x busy ranks of its
    group)). Every rate is multiplied by ``speed`` (a number, or a function of the processes
    computing at that moment).

    ``rendezvous``: messages move as gloo moves them, a send only once its receive is posted,
    the receives posted one compute action ahead (those between a compute action and the next
    when that action starts; one before a rank's first compute action when the rank reaches
    it). A send whose receive was posted before it travels from the send; one sent first waits
    in the sender's process until the receiver's notice that its receive is posted arrives, and
    the sender's event-loop thread, not the thread that sent, then writes it (gloo's tcp
    transport: ``Pair::send`` of an unbound buffer, ``onNotifyRecvReady`` on the event-loop
    thread), so it travels from the post only while some processor is free for that thread:
    while every processor computes, it stands still. The runtime posts its receives in the
    batches of ``batch_transfers``; this option prices the one-action-ahead posting, the order
    the cost model's calibration measured.

    Raises ScheduleDeadlock if the ranks cannot all finish."""

    cost = action_costs(schedule, costs)
    took = duration or (lambda a: cost[a.kind])
    travel = latency or (lambda a: comm)
    if comm < 0:
        raise ValueError(f"comm={comm!r}: expected a latency >= 0")
    cores = len(programs) if cores is None else cores
    if not cores > 0:
        raise ValueError(f"cores={cores!r}: expected a positive number of processors")
    _check_programs(schedule, programs)
    if cores >= len(programs) and placement is None and not rendezvous and speed == 1.0:
        return _own_processors(schedule, programs, took, travel)
    n = len(programs)
    pc, events = [0] * n, [[] for _ in programs]
    arrival: dict = {}
    left: dict = {}              # rank -> (action, start, work left) while it computes
    blocked: set = set()         # ranks asleep on a message not yet arrived
    resume: dict = {}            # rank -> when it gets a processor after its message woke it
    posted: set = set()          # rendezvous: receives posted
    waiting: dict = {}           # rendezvous: receive not yet posted -> its send, sent
    flying: dict = {}            # rendezvous: send -> latency left, moving only while a processor is free
    processors = cores if placement is None else sum({g: c for g, c, _ in placement}.values())
    now, eps = 0.0, 1e-15

    def post(recv) -> None:
        if recv in posted:
            return
        posted.add(recv)
        send = waiting.pop(recv, None)
        if send is not None:     # sent before: the sender's event-loop thread writes it now
            flying[send] = travel(send)

    while True:
        moved = True
        while moved:     # until no rank moves: a message sent now may wake a rank the pass went by
            moved = False
            for r, prog in enumerate(programs):      # run each idle rank up to its next compute or blocked receive
                while r not in left and pc[r] < len(prog):
                    a = prog[pc[r]]
                    if a.kind in COMPUTE:
                        left[r] = (a, now, took(a))
                        moved = True
                        if rendezvous:    # the runtime posts the receives before the next compute action now
                            for b in prog[pc[r] + 1:]:
                                if b.kind in COMPUTE:
                                    break
                                # a gradient's buffer takes the shapes of the forward's outputs: not
                                # posted before that forward ran
                                if b.kind.startswith("RECV") and not (b.kind == "RECV_B" and a.kind == "F"
                                                                      and (a.stage, a.mb) == (b.stage, b.mb)):
                                    post(b)
                        break
                    if a.kind.startswith("SEND"):
                        recv = matching_recv(a)
                        if not rendezvous or recv in posted:
                            arrival[a] = now + travel(a)
                        else:
                            waiting[recv] = a
                    elif r in resume:
                        if resume[r] > now + eps:
                            break
                        del resume[r]
                    elif rendezvous and a not in posted:
                        post(a)
                        continue
                    elif arrival.get(matching_send(a), math.inf) > now + eps:
                        blocked.add(r)
                        break
                    elif r in blocked:
                        blocked.discard(r)
                        full = (len(left) >= cores if placement is None else
                                sum(placement[q][2] for q in left if placement[q][0] == placement[r][0])
                                >= placement[r][1])
                        if wake and full:
                            resume[r] = now + wake
                            break
                    pc[r] += 1
                    moved = True
        if not left:
            waits = [resume[r] if r in resume else arrival.get(matching_send(prog[pc[r]]), math.inf)
                     for r, prog in enumerate(programs) if pc[r] < len(prog)]
            if flying:       # every processor free: the messages in flight move
                step = min([min(flying.values())] + [t - now for t in waits if t < math.inf])
                now += step
                _land(flying, arrival, step, now, eps)
                continue
            if not waits:
                break
            if min(waits) == math.inf:
                stuck = [r for r, prog in enumerate(programs) if pc[r] < len(prog)]
                raise ScheduleDeadlock(deadlock_message(schedule, programs, pc, stuck,
                                                         {a: q for q, pr in enumerate(programs) for a in pr
                                                          if a.kind.startswith("SEND")}))
            now = min(waits)
            continue
        if placement is None:
            pace = speed(len(left)) if callable(speed) else speed
            rates = dict.fromkeys(left, min(1.0, cores / len(left)) * pace)
        else:
            busy: dict = {}
            for r in left:
                busy[placement[r][0]] = busy.get(placement[r][0], 0) + placement[r][2]
            pace = speed(sum(busy.values())) if callable(speed) else speed
            rates = {r: min(1.0, placement[r][1] / busy[placement[r][0]]) * pace for r in left}
        step = min(w / rates[r] for r, (_, _, w) in left.items())
        pending = [t for t in list(arrival.values()) + list(resume.values()) if t > now + eps]
        step = min([step] + [t - now for t in pending])
        free = (len(left) if placement is None else sum(busy.values())) < processors - eps
        if flying and free:
            step = min([step] + list(flying.values()))
        now += step
        if flying and free:
            _land(flying, arrival, step, now, eps)
        for r in list(left):
            a, start, w = left[r]
            w -= step * rates[r]
            if w <= eps * max(1.0, now):
                events[r].append((a, start, now))
                del left[r]
                pc[r] += 1
            else:
                left[r] = (a, start, w)
    return Timeline(schedule, events, now)


def _land(flying: dict, arrival: dict, step: float, now: float, eps: float) -> None:
    """Move the messages in flight by ``step`` seconds; those with no latency left arrive now."""
    for a in list(flying):
        flying[a] -= step
        if flying[a] <= eps * max(1.0, now):
            arrival[a] = now
            del flying[a]


def _own_processors(schedule: Schedule, programs, took, travel) -> Timeline:
    """``execute`` with a processor per rank: no rank slows another, so each rank runs ahead
    until it waits for a message that has not been sent, on its own clock. The same timeline
    as the shared replay with as many processors as ranks (tests/test_schedule.py checks
    it), in time linear in the actions, which the planner's detailed estimates of long
    schedules need."""
    clock, pc = [0.0] * len(programs), [0] * len(programs)
    arrival, events = {}, [[] for _ in programs]
    progress = True
    while progress:
        progress = False
        for r, prog in enumerate(programs):
            while pc[r] < len(prog):
                a = prog[pc[r]]
                if a.kind in COMPUTE:
                    d = took(a)
                    events[r].append((a, clock[r], clock[r] + d))
                    clock[r] += d
                elif a.kind.startswith("SEND"):
                    arrival[a] = clock[r] + travel(a)
                elif matching_send(a) in arrival:
                    clock[r] = max(clock[r], arrival[matching_send(a)])
                else:
                    break
                pc[r] += 1
                progress = True
    stuck = [r for r, prog in enumerate(programs) if pc[r] < len(prog)]
    if stuck:
        sent_by = {a: r for r, prog in enumerate(programs) for a in prog if a.kind.startswith("SEND")}
        raise ScheduleDeadlock(deadlock_message(schedule, programs, pc, stuck, sent_by))
    return Timeline(schedule, events, max(clock, default=0.0))


def _check_programs(schedule: Schedule, programs) -> None:
    """Every action of a known kind, and every receive's send somewhere in the programs."""
    sent_by = {a: r for r, prog in enumerate(programs) for a in prog if a.kind.startswith("SEND")}
    for r, prog in enumerate(programs):
        for a in prog:
            if a.kind not in KINDS:
                raise ValueError(f"rank {r} has action {a} of kind {a.kind!r}: expected one of {KINDS}")
            if a.kind.startswith("RECV") and matching_send(a) not in sent_by:
                raise ScheduleDeadlock(f"rank {r} waits at {a}, but no rank ever executes its matching "
                                       f"{matching_send(a)}: add it to rank "
                                       f"{schedule.rank_of(matching_send(a).stage)} or drop the receive")


def deadlock_message(schedule, programs, pc, stuck, sent_by) -> str:
    """Which ranks wait at which receive, for a send that never comes."""
    lines = []
    for r in stuck:
        recv = programs[r][pc[r]]
        send = matching_send(recv)
        q = sent_by[send]
        lines.append(f"rank {r} waits at {recv}, which needs {send} that rank {q} never reaches "
                     f"(rank {q} is stuck at {programs[q][pc[q]]})")
    return (f"schedule {schedule.name!r} deadlocks: " + "; ".join(lines) +
            ". Reorder the ranks' actions so every receive's matching send comes first "
            "(e.g. start from build_schedule('1f1b', ...))")
