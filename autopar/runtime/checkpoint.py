"""Checkpoints that reshard: each rank writes the pieces it owns, and loads the pieces it holds
under any other plan and world size, through ``torch.distributed.checkpoint`` (DCP).

Every stored tensor is split into rectangular boxes of the whole tensor: tensor parallelism
cuts a range of one dim (an interleaved fused projection: one range per part), ZeRO cuts a
range of rows of that, and a rank's piece is the product of those ranges, so each piece is
one box or a few. A ``Pieces`` hands DCP this rank's boxes (its ``_Checkpointable`` protocol:
``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``): on save,
each box is written once (boxes held by several ranks alike, ddp replicas or a weight tied
across pipeline stages, are written by one of them: DCP's de-duplication), and DCP checks
that the boxes of every tensor tile it; on load, DCP reads into each box the overlap of every
saved box with it, so a checkpoint saved under one layout fills any other. The boxes are views
of the live parameters and optimizer state: nothing is gathered, and a rank never builds a
tensor it does not hold (DCP copies one box at a time while writing).

The checkpoint's keys (one flat namespace):
    ``model.<name>``               every parameter and persistent buffer, under the model's
                                   own name (a tied weight under its first name)
    ``optim.state.<name>.<key>``   the optimizer's state of each parameter (AdamW: exp_avg,
                                   exp_avg_sq in the parameter's layout, step a scalar); none
                                   for one it never stepped (frozen, or without a gradient)
    ``optim.param_groups``         hyperparameters of each group, with its parameters' names
    ``autopar.meta``               step, plan, mesh, optimizer class, tied names, the model's class
    ``autopar.rng``                the default generator's state (every rank draws the same stream)
    ``extra.<key>``                whatever the caller passed as ``extra`` (pickled)

``load`` checks the checkpoint against the module before it changes anything (names, shapes,
the optimizer state's presence and class, files present and long enough, every tensor wholly
covered), on every rank, and every rank raises if any rank found a problem.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..placement import ShardSpec, TPParam
from ..sizes import chunk_range

__all__ = ["Pieces", "layout_boxes", "CheckpointError", "Resumed", "save_module", "load_module", "Holding",
           "save_state", "read_metadata", "checkpoint_meta", "EXTRA", "load_flat", "piece_cap", "split_boxes", "FORMAT", "MODEL", "STATE", "GROUPS", "META", "RNG_KEY"]

FORMAT = 1
MODEL, STATE, GROUPS, META, RNG_KEY, EXTRA = "model.", "optim.state.", "optim.param_groups", "autopar.meta", \
    "autopar.rng", "extra."


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this module: what differs, and what to do."""


@dataclass
class Resumed:
    """What ``load`` returns: the step the checkpoint was saved at and the caller's ``extra``."""
    step: int
    extra: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)


# ---- boxes ----------------------------------------------------------------------------------

def layout_boxes(local: torch.Tensor, shape: tuple, tp: TPParam | None = None, tp_n: int = 1, tp_i: int = 0,
                 spec: ShardSpec | None = None) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """This rank's piece ``local`` of a tensor of global ``shape`` as (global offsets, view of
    ``local``) boxes: ``tp`` (its placement over ``tp_n`` ranks, this one ``tp_i``) cuts one dim,
    then ``spec`` (ZeRO over dp) a range of rows of that. Empty boxes are left out."""
    shape = tuple(shape)
    if not shape:
        return [((), local.reshape(()))] if local.numel() == 1 else []
    # per dim: (start in local, start in global, length) segments
    segs = [[(0, 0, n)] for n in shape]
    if tp is not None and tp.sharded and tp_n > 1:
        d, at = tp.placement.dim, 0
        part = shape[d] // tp.groups
        segs[d] = []
        for g in range(tp.groups):
            lo, hi = chunk_range(part, tp_n, tp_i)
            segs[d].append((at, g * part + lo, hi - lo))
            at += hi - lo
    if spec is not None and spec.n > 1:
        r0, r1 = spec.row_range()
        segs[0] = [(max(ls, r0) - r0, gs + max(ls, r0) - ls, min(ls + n, r1) - max(ls, r0))
                   for ls, gs, n in segs[0] if min(ls + n, r1) > max(ls, r0)]
    want = tuple(sum(n for _, _, n in s) for s in segs)
    if tuple(local.shape) != want:
        raise AssertionError(f"a local piece of shape {tuple(local.shape)} for a tensor of shape {shape} "
                             f"(tp {tp}, {spec}): expected {want}")
    boxes = []
    for combo in itertools.product(*segs):
        if any(n == 0 for _, _, n in combo):
            continue
        view = local
        for k, (ls, _, n) in enumerate(combo):
            if ls != 0 or n != view.shape[k]:
                view = view.narrow(k, ls, n)
        boxes.append((tuple(g for _, g, _ in combo), view))
    return boxes


PIECE_FLOOR = 64 * 1024


def piece_cap(shapes_and_sizes) -> int:
    """The most bytes one stored piece holds: a quarter of the largest tensor (``(shape,
    itemsize)`` pairs), at least ``PIECE_FLOOR``. Loading reads a stored piece whole (DCP's reader
    ``torch.load``s it: its bytes and the tensor made of them, while the previous piece's tensor
    is still referenced), so the transient memory of a load is about three pieces: capped so,
    under one tensor. Smaller pieces cost torch.save's ~1.5 KB of framing each."""
    largest = max((itemsize * math.prod(shape) for shape, itemsize in shapes_and_sizes), default=0)
    return max(largest // 4, PIECE_FLOOR)


def split_boxes(boxes, cap: int):
    """Each box cut into boxes of at most ``cap`` bytes (along dim 0, then dim 1 where one row is
    larger, and so on), in order."""
    out = []
    for off, view in boxes:
        out += _split(tuple(off), view, cap, 0)
    return out


def _split(off, view, cap, dim):
    if view.numel() * view.element_size() <= cap or dim >= view.dim():
        return [(off, view)]
    inner = view.element_size()
    for n in view.shape[dim + 1:]:
        inner *= n
    if inner > cap:          # one slice along dim is too big: cut each slice along the next dim
        return [box for i in range(view.shape[dim])
                for box in _split(off[:dim] + (off[dim] + i,) + off[dim + 1:], view.narrow(dim, i, 1), cap, dim + 1)]
    step = max(1, cap // inner)
    return [(off[:dim] + (off[dim] + i,) + off[dim + 1:], view.narrow(dim, i, min(step, view.shape[dim] - i)))
            for i in range(0, view.shape[dim], step)]


class Pieces:
    """This rank's boxes of one tensor of global ``shape``, for DCP (its ``_Checkpointable``
    protocol: DCP asks it for write items, for the chunks to read, and for each box's tensor).
    ``boxes``: (global offsets, view) pairs, views of the live storage."""

    def __init__(self, shape, boxes: list[tuple[tuple[int, ...], torch.Tensor]], dtype: torch.dtype):
        self.shape, self.boxes, self.dtype = torch.Size(shape), boxes, dtype

    def size(self) -> torch.Size:
        return self.shape

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(off), i), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size(off),
                                                                                 sizes=view.shape),
                                                      properties=TensorProperties.create_from_tensor(view),
                                                      size=self.shape))
                for i, (off, view) in enumerate(self.boxes)]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(off), sizes=view.shape) for off, view in self.boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.index is not None and index.index < len(self.boxes) and \
                torch.Size(self.boxes[index.index][0]) == index.offset:
            return _exact(self.boxes[index.index][1])
        for off, view in self.boxes:
            if torch.Size(off) == index.offset:
                return _exact(view)
        raise ValueError(f"{index.fqn}: this rank holds no box at {tuple(index.offset)}")


def _exact(view: torch.Tensor) -> torch.Tensor:
    """``view`` (detached) over a storage of exactly its bytes, sharing its memory, when it is
    contiguous: DCP's writer clones a tensor whose storage is larger than itself and keeps the
    clone to the end of the file, which would hold a copy of every piece cut from a larger
    tensor (a ZeRO-1/2 shard of its replica, a piece of a split tensor)."""
    view = view.detach()
    if not view.is_contiguous() or view.untyped_storage().nbytes() == view.nbytes or view.device.type == "meta":
        return view
    start = view.storage_offset() * view.element_size()
    storage = view.untyped_storage()[start:start + view.nbytes]
    return torch.empty(0, dtype=view.dtype, device=view.device).set_(storage, 0, view.shape)


def _lookup(state_dict, index: MetadataIndex):
    obj = state_dict[index.fqn]
    if isinstance(obj, Pieces):
        return obj.__get_tensor_shard__(index)
    return None


class _SavePlanner(DefaultSavePlanner):
    """DCP's planner (de-duplication of replicated boxes, the check that boxes tile every
    tensor) over a flat dict whose values may be ``Pieces``."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex):
        found = _lookup(self.state_dict, index)
        return found if found is not None else super().lookup_object(index)

    def create_global_plan(self, all_plans):
        # autopar's own record also rides in DCP's metadata (its planner_data, unused without
        # flattening), so that a load reads it with the metadata it reads anyway
        plans, md = super().create_global_plan(all_plans)
        if isinstance(self.state_dict.get(META), dict):
            md = dataclasses.replace(md, planner_data={"autopar": self.state_dict[META]})
        return plans, md


class _LoadPlanner(DefaultLoadPlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        # as DefaultLoadPlanner's, without its pass that allocates meta tensors (which would
        # replace every value it does not know, a Pieces, by None): nothing here is on meta
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        found = _lookup(self.state_dict, index)
        return found if found is not None else super().lookup_tensor(index)


# ---- what a module holds ----------------------------------------------------------------------

@dataclass
class Holding:
    """One tensor this rank holds: its checkpoint name, global shape and layout."""
    name: str
    shape: tuple
    local: torch.Tensor
    tp: TPParam | None = None
    tp_n: int = 1
    tp_i: int = 0
    spec: ShardSpec | None = None

    cap: int = 1 << 62       # the most bytes of one stored piece (``piece_cap``)

    def pieces(self, tensor: torch.Tensor | None = None) -> Pieces:
        """``tensor`` (default: the holding's own; else a tensor of the same local shape, as an
        optimizer's state of it) as boxes of the global tensor, each at most ``cap`` bytes."""
        t = self.local if tensor is None else tensor
        boxes = layout_boxes(t, self.shape, self.tp, self.tp_n, self.tp_i, self.spec)
        return Pieces(self.shape, split_boxes(boxes, self.cap), t.dtype)


def _stage_holdings(st) -> list[Holding]:
    """Every parameter and persistent buffer one compiled module (a stage) holds."""
    out = []
    tp_comm, specs = st.tp_comm, st.sync.specs
    tp_n, tp_i = (tp_comm.size, tp_comm.index) if tp_comm is not None else (1, 0)
    for name, info in st.ctx.params.items():
        if not info.persistent:
            continue
        trainable = name in specs
        local = st.module.get_parameter(name) if trainable else st.local_tensor(name)
        tp = st.ctx.tp_params.get(name) if tp_comm is not None else None
        out.append(Holding(name, info.shape, local, tp, tp_n, tp_i, specs.get(name) if trainable else None))
    return out


def _holdings(dm) -> dict[str, list[Holding]]:
    """name -> every holding of it on this rank (a weight tied across two stages this rank runs:
    two), each cut into pieces of at most ``piece_cap`` of the whole model (its fp32 state included)."""
    cap = piece_cap((info.shape, max(dm.ctx.stored_dtype(name).itemsize, 4)) for name, info in dm.ctx.params.items())
    out: dict[str, list[Holding]] = {}
    for st in dm.stage_modules():
        for h in _stage_holdings(st):
            h.cap = cap
            out.setdefault(h.name, []).append(h)
    return out


def _optimizer_params(dm, optimizer, holdings) -> dict[int, Holding]:
    """id(tensor the optimizer steps) -> the holding whose layout it has: the shard itself, its
    host copy (``Plan(offload=...)``), or a full copy (``per_tensor=True``: one whole box)."""
    by_local = {id(h.local): h for hs in holdings.values() for h in hs}
    out = {}
    offload = dm.offload
    if offload is not None:
        for qual, host in offload.host_params.items():
            h = by_local.get(id(offload.device_params[qual]))
            if h is not None:
                out[id(host)] = Holding(h.name, h.shape, host, h.tp, h.tp_n, h.tp_i, h.spec, h.cap)
    per_tensor = dm.per_tensor_state
    if per_tensor is not None:
        for name, copy in per_tensor.copies.items():
            cap = next((h.cap for hs in holdings.values() for h in hs), Holding.cap)
            out[id(copy)] = Holding(name, tuple(copy.shape), copy, cap=cap)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in out and id(p) in by_local:
                out[id(p)] = by_local[id(p)]
            if id(p) not in out:
                raise CheckpointError(f"the optimizer steps a tensor of shape {tuple(p.shape)} that is none of "
                                      "this module's parameters; build it with dm.optimizer(...)")
    return out


# ---- save ---------------------------------------------------------------------------------------

def _step_of(optimizer) -> int:
    for state in optimizer.state.values():
        s = state.get("step")
        if s is not None:
            return int(float(s))
    return 0


def _state_dict(dm, optimizer, step, extra) -> dict:
    holdings = _holdings(dm)
    sd: dict[str, Any] = {MODEL + name: hs[0].pieces() for name, hs in holdings.items()}
    aliases = {name: list(info.aliases) for name, info in dm.ctx.params.items() if info.aliases}
    meta = checkpoint_meta(mesh=str(dm.mesh), plan=repr(dm.plan), aliases=aliases, model_class=dm.ctx.model_class,
                           model_config=dm.ctx.model_config)
    if optimizer is not None:
        owner = _optimizer_params(dm, optimizer, holdings)
        groups, seen = [], set()
        for group in optimizer.param_groups:
            names = []
            for p in group["params"]:
                h = owner[id(p)]
                names.append(h.name)
                if h.name in seen:          # a tied weight's second copy: the same state
                    continue
                seen.add(h.name)
                for key, value in optimizer.state.get(p, {}).items():
                    sd[f"{STATE}{h.name}.{key}"] = _state_value(h, p, value)
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(dict.fromkeys(names))})
        if len(dm.stage_modules()) != 1 or dm.mesh.axis_size("pp") > 1:
            groups = _union_groups(groups)     # a pipeline rank's optimizer holds its own stages' parameters
        sd[GROUPS] = groups
        meta["groups"] = [g["params"] for g in groups]
        meta["optimizer"] = type(optimizer).__name__
        meta["step"] = _step_of(optimizer)
    if step is not None:
        meta["step"] = int(step)
    sd[META] = meta
    sd[RNG_KEY] = _rng_state(dm)
    for key, value in (extra or {}).items():
        sd[EXTRA + key] = value
    return sd


def checkpoint_meta(**fields) -> dict:
    """``autopar.meta``: what a checkpoint records besides tensors (``fields`` over the defaults)."""
    meta = {"format": FORMAT, "step": 0, "mesh": "", "plan": "", "optimizer": None, "groups": [], "aliases": {},
            "world": dist.get_world_size() if dist.is_initialized() else 1, "model_class": "",
            "model_config": None}
    meta.update(fields)
    return meta


def _union_groups(groups: list[dict]) -> list[dict]:
    """Every rank's parameter groups with the names of every rank's (one all-gather of the
    names): what the checkpoint records, the same on every rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return groups
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, [g["params"] for g in groups])
    if len({len(x) for x in every}) != 1:
        raise CheckpointError(f"the ranks' optimizers have different numbers of parameter groups "
                              f"({[len(x) for x in every]}); build them alike on every rank")
    return [{**g, "params": list(dict.fromkeys(n for names in every for n in names[i]))}
            for i, g in enumerate(groups)]


def _state_value(h: Holding, p: torch.Tensor, value):
    """One optimizer state entry: in the parameter's layout when it has the parameter's shape,
    else as it is (a scalar step: every rank holds the same)."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == p.shape:
        return h.pieces(value)
    return value


def _rng_state(dm) -> dict:
    state = {"cpu": torch.get_rng_state()}
    device = dm.device
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def save_state(sd: dict, path: str, no_dist: bool = False) -> Metadata:
    """Write a flat dict (values: ``Pieces``, tensors, picklable objects) with DCP. A checkpoint
    already at ``path`` is replaced (as ``torch.save`` replaces a file; its ``.metadata`` names
    only the new files), without DCP's warning that it does so."""
    os.makedirs(path, exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint", category=UserWarning)
        if no_dist:         # DCP's note that it saves in one process: that is the intent
            warnings.simplefilter("ignore", UserWarning)
        return dcp.save(sd, storage_writer=FileSystemWriter(path), planner=_SavePlanner(), no_dist=no_dist)


def load_flat(path: str, keys=None, md: Metadata | None = None) -> dict:
    """Whole tensors and objects of the checkpoint at ``path`` (``keys``: these only; default
    every one), read in this process alone: the full tensors, as one device holds them."""
    md = md if md is not None else read_metadata(path)[0]
    sd = {}
    for key in (keys if keys is not None else md.state_dict_metadata):
        entry = md.state_dict_metadata[key]
        sd[key] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype, device="cpu") \
            if isinstance(entry, TensorStorageMetadata) else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(sd, storage_reader=FileSystemReader(path), planner=_LoadPlanner(), no_dist=True)
    return sd


def save_module(dm, path: str, optimizer=None, step=None, extra=None) -> Metadata:
    """``dm.save``: this rank's pieces of the parameters, buffers and optimizer state, the step,
    the RNG state and ``extra``. Every rank must call it."""
    with torch.no_grad():
        return save_state(_state_dict(dm, optimizer, step, extra), path,
                          no_dist=not dist.is_initialized())


# ---- load ---------------------------------------------------------------------------------------

class _ReadReader(FileSystemReader):
    """DCP's file reader, given the metadata the checks already read (not read a second time)."""

    def __init__(self, path: str, md: Metadata):
        super().__init__(path)
        self._md = md

    def read_metadata(self, *args, **kwargs) -> Metadata:
        self._md.storage_meta = getattr(self._md, "storage_meta", None) or StorageMeta()
        self._md.storage_meta.load_id = self.load_id
        return self._md


def read_metadata(path: str) -> tuple[Metadata, dict]:
    """DCP's metadata of the checkpoint at ``path`` and autopar's own (``autopar.meta``)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint at {path!r}: expected the directory dm.save(path) wrote")
    try:
        md = FileSystemReader(path).read_metadata()
    except FileNotFoundError:
        raise CheckpointError(f"{path!r} has no .metadata file: not a checkpoint, or its save did not finish "
                              "(DCP writes .metadata last); save it again") from None
    except Exception as e:
        raise CheckpointError(f"{path!r}: its .metadata cannot be read ({type(e).__name__}: {e}); the checkpoint "
                              "is damaged: save it again") from None
    problems = _check_files(path, md)
    if problems:
        raise CheckpointError("\n  ".join(problems))
    meta = md.planner_data.get("autopar") if isinstance(md.planner_data, dict) else None
    if meta is None and META in md.state_dict_metadata:
        box = {META: None}
        with warnings.catch_warnings():     # DCP's note that it reads in one process: that is the intent here
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(box, storage_reader=FileSystemReader(path), planner=_LoadPlanner(), no_dist=True)
        meta = box[META]
    return md, meta or {}


def _check_files(path: str, md: Metadata) -> list[str]:
    """Every data file present and as long as the metadata says (a truncated file is found
    here, before anything is read)."""
    need: dict[str, tuple[int, str]] = {}
    for index, info in (md.storage_data or {}).items():
        end = info.offset + info.length
        if end > need.get(info.relative_path, (0, ""))[0]:
            need[info.relative_path] = (end, index.fqn)
    problems = []
    for rel, (end, fqn) in sorted(need.items()):
        full = os.path.join(path, rel)
        if not os.path.exists(full):
            problems.append(f"data file {rel} is missing (it holds {fqn}, among others): the checkpoint is "
                            "incomplete; copy every __*.distcp file of the save")
        elif os.path.getsize(full) < end:
            problems.append(f"data file {rel} is truncated: {os.path.getsize(full)} bytes, the metadata needs "
                            f"{end} (for {fqn}); the checkpoint is damaged: save it again")
    return problems


def _covered(md: TensorStorageMetadata) -> bool:
    return sum(math.prod(c.sizes) for c in md.chunks) >= math.prod(md.size)


def _agree(problems: list[str], what: str, device=None) -> None:
    """Raise on every rank when any rank found a problem (an all-reduce of a flag on ``device``,
    the process group's; then, only if one did, an all-gather of the messages), so that no rank
    goes on into a collective another has left."""
    found = [problems]
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([len(problems)], dtype=torch.int64, device=device)   # one small collective when all is well
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not int(flag):
            return
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, problems)
    lines = []
    for rank, ps in enumerate(found):
        for p in ps or ():
            line = p if len(found) == 1 else f"rank {rank}: {p}"
            if p not in {q for q in (x for other in found[:rank] for x in (other or ()))}:
                lines.append(line)
    if lines:
        raise CheckpointError(f"{what}:\n  " + "\n  ".join(lines[:20]) +
                              (f"\n  ... and {len(lines) - 20} more" if len(lines) > 20 else "") +
                              "\nnothing was loaded: the module and optimizer are as they were")


def load_module(dm, path: str, optimizer=None) -> Resumed:
    """``dm.load``: check the checkpoint at ``path`` against the module (and ``optimizer``), then
    read into every piece this rank holds, refresh what derives from them (ZeRO-1/2 replicas,
    full copies of ``per_tensor``), and restore the RNG state. Every rank must call it."""
    problems, md, meta = [], None, {}
    try:
        md, meta = read_metadata(path)
    except CheckpointError as e:
        problems.append(str(e))
    holdings = _holdings(dm)
    owner = _optimizer_params(dm, optimizer, holdings) if optimizer is not None else {}
    if md is not None:
        problems += _check_model(md, dm, holdings)
        if optimizer is not None:
            problems += _check_optimizer(md, meta, optimizer, owner)
    _agree(problems, f"cannot load the checkpoint {path!r} into this module", dm.device)

    sd: dict[str, Any] = {MODEL + name: hs[0].pieces() for name, hs in holdings.items()}
    loaded: dict[int, dict] = {}     # id(parameter) -> its state as loaded (none: never stepped when saved)
    if optimizer is not None:
        seen = set()
        for group in optimizer.param_groups:
            for p in group["params"]:
                h = owner[id(p)]
                if h.name in seen or not _state_keys(md, h.name):
                    continue
                seen.add(h.name)
                state = loaded[id(p)] = dict(optimizer.state.get(p, {}))    # its tensors read into in place
                for key in _state_keys(md, h.name):
                    entry = md.state_dict_metadata[f"{STATE}{h.name}.{key}"]
                    sd[f"{STATE}{h.name}.{key}"] = _state_target(h, p, state, key, entry)
        sd[GROUPS] = None
    sd[RNG_KEY] = None
    for key in md.state_dict_metadata:
        if key.startswith(EXTRA):
            sd[key] = None
    with torch.no_grad():
        dcp.load(sd, storage_reader=_ReadReader(path, md), planner=_LoadPlanner(), no_dist=not dist.is_initialized())
        for hs in holdings.values():              # a weight tied across two stages of this rank
            for h in hs[1:]:
                h.local.copy_(hs[0].local)
        if optimizer is not None:
            _finish_optimizer(optimizer, owner, loaded, sd, md)
            _restore_optimizer(optimizer, loaded, sd[GROUPS])
    dm.after_load()
    rng = sd[RNG_KEY] or {}
    if "cpu" in rng:
        torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and dm.device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], dm.device)
    return Resumed(step=int(meta.get("step", 0)), meta=meta,
                   extra={k[len(EXTRA):]: v for k, v in sd.items() if k.startswith(EXTRA)})


def _state_keys(md: Metadata, name: str) -> list[str]:
    prefix = f"{STATE}{name}."
    return [k[len(prefix):] for k in md.state_dict_metadata if k.startswith(prefix) and "." not in k[len(prefix):]]


def _state_target(h: Holding, p, state: dict, key: str, entry):
    """Where optimizer state ``key`` of ``p`` is read into: its existing tensor, or a new one
    (a fresh optimizer has no state yet) in the layout the checkpoint says."""
    if isinstance(entry, BytesStorageMetadata):
        return None
    current = state.get(key)
    if tuple(entry.size) == tuple(h.shape) and len(entry.size) > 0:
        if not isinstance(current, torch.Tensor) or current.shape != p.shape:
            current = torch.zeros_like(p, dtype=entry.properties.dtype, memory_format=torch.contiguous_format)
            state[key] = current
        return h.pieces(current)
    if not isinstance(current, torch.Tensor) or tuple(current.shape) != tuple(entry.size):
        # a scalar (the step) is read on the host; Optimizer.load_state_dict then moves it where
        # the optimizer keeps it (_restore_optimizer)
        current = torch.zeros(tuple(entry.size), dtype=entry.properties.dtype, device="cpu")
        state[key] = current
    return current


def _finish_optimizer(optimizer, owner, loaded: dict, sd, md) -> None:
    """Non-tensor state entries of ``loaded`` (id(parameter) -> its state) from the loaded
    dict; a tied weight's second copy takes the first's state."""
    first: dict[str, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            h = owner[id(p)]
            if h.name in first:
                if id(first[h.name]) in loaded:
                    loaded[id(p)] = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                     for k, v in loaded[id(first[h.name])].items()}
                continue
            first[h.name] = p
            for key in _state_keys(md, h.name):
                if isinstance(md.state_dict_metadata[f"{STATE}{h.name}.{key}"], BytesStorageMetadata):
                    loaded[id(p)][key] = sd[f"{STATE}{h.name}.{key}"]


def _restore_optimizer(optimizer, loaded: dict, groups_sd: list[dict]) -> None:
    """Hand the loaded state (id(parameter) -> state; a parameter absent never stepped) and the
    saved hyperparameters to ``optimizer.load_state_dict``, so that torch's rules place them
    (``step`` on the parameter's device where the optimizer is fused or capturable, on the host
    otherwise; every other tensor on the parameter's device, floating ones in its dtype) and
    the optimizer's load hooks run. A tensor already where the rules put it is kept, not copied.
    The saved groups' parameter names are this checkpoint's, not the optimizer's: each group
    keeps its own parameters (and names)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    index = {id(p): i for i, p in enumerate(params)}
    groups = [{**{k: v for k, v in group.items() if k != "params"},
               **{k: v for k, v in saved.items() if k not in ("params", "param_names")},
               "params": [index[id(p)] for p in group["params"]]}
              for group, saved in zip(optimizer.param_groups, groups_sd)]
    optimizer.load_state_dict({"state": {index[i]: state for i, state in loaded.items()}, "param_groups": groups})


def _check_model(md: Metadata, dm, holdings) -> list[str]:
    problems = []
    saved = {k[len(MODEL):]: v for k, v in md.state_dict_metadata.items() if k.startswith(MODEL)}
    missing = [n for n in holdings if n not in saved]
    for name in missing:
        aliases = [a for a in dm.ctx.params[name].aliases if a in saved]
        if aliases:      # saved under another of its tied names (a model whose first name differs)
            continue
        problems.append(f"{name} is not in the checkpoint (a checkpoint of another model? it holds "
                        f"{len(saved)} tensors, e.g. {', '.join(sorted(saved)[:3])})")
    for name, hs in holdings.items():
        entry = saved.get(name)
        if entry is None:
            continue
        if isinstance(entry, BytesStorageMetadata):
            problems.append(f"{name} is stored as an object, not a tensor")
            continue
        if tuple(entry.size) != tuple(hs[0].shape):
            problems.append(f"{name} has shape {tuple(entry.size)} in the checkpoint, this model's is "
                            f"{tuple(hs[0].shape)} (a checkpoint of another model or configuration)")
        elif not _covered(entry):
            problems.append(f"{name}: the checkpoint's pieces cover only part of it (a save under another "
                            "world size whose files are not all here?)")
    known = {a for name, info in dm.ctx.params.items() for a in (name,) + info.aliases}
    extra = sorted(set(saved) - known)
    if extra:
        problems.append(f"the checkpoint holds tensors this model does not have: {', '.join(extra[:5])}"
                        f"{' ...' if len(extra) > 5 else ''} (a checkpoint of another model)")
    return problems


def _check_optimizer(md: Metadata, meta: dict, optimizer, owner) -> list[str]:
    if GROUPS not in md.state_dict_metadata:
        return ["the checkpoint has no optimizer state (saved without an optimizer); load the model alone "
                "with dm.load(path, optimizer=None), or resume from a checkpoint saved with one"]
    problems = []
    cls = type(optimizer).__name__
    if meta.get("optimizer") and meta["optimizer"] != cls:
        problems.append(f"the checkpoint's optimizer state is {meta['optimizer']}'s, this optimizer is a {cls}; "
                        f"build dm.optimizer(torch.optim.{meta['optimizer']}, ...) to resume")
    groups = [list(dict.fromkeys(owner[id(p)].name for p in g["params"])) for g in optimizer.param_groups]
    if "groups" in meta and len(meta["groups"]) != len(groups):
        problems.append(f"the checkpoint's optimizer has {len(meta['groups'])} parameter groups, this one "
                        f"{len(groups)}; build the optimizer with the same groups")
    elif "groups" in meta:
        for i, (saved, mine) in enumerate(zip(meta["groups"], groups)):
            other = [n for n in mine if n not in saved]
            if other:
                problems.append(f"parameter group {i} of this optimizer holds {', '.join(other[:3])}, which group "
                                f"{i} of the checkpoint's does not; build the optimizer with the same groups")
    names = {h.name for h in owner.values()}
    # a parameter without state in the checkpoint is one the optimizer never stepped (frozen, unused by
    # forward, or without a gradient so far): torch's optimizers keep no state for it, and it loads without
    for name in sorted(names):
        for key in _state_keys(md, name):
            entry = md.state_dict_metadata[f"{STATE}{name}.{key}"]
            h = next(h for h in owner.values() if h.name == name)
            if isinstance(entry, TensorStorageMetadata) and len(entry.size) > 0 and \
                    tuple(entry.size) != tuple(h.shape):
                problems.append(f"optimizer state {key} of {name} has shape {tuple(entry.size)}, the parameter "
                                f"{tuple(h.shape)}")
    return problems
