"""Checkpoint benchmark: autopar's dm.save/dm.load against FSDP2 + torch.distributed.checkpoint.

    python benchmarks/bench_checkpoint.py [--world-sizes 2 4] [--repeats 15] [--warmup 2] [--dir /tmp] [--no-gc-freeze]

For every world size N it spawns N local gloo processes (autopar.testing.run, one thread
each). In the same process group both sides build the SAME model (same seed, same initial
weights), train it one step on the same batch with AdamW, and then save and load it over and
over:

    autopar zero3   dm = autopar.compile(model, Mesh(dp=N), example_inputs=(x,),
                    plan=Plan(dp="zero3")); opt = dm.optimizer(AdamW)
                      save: dm.save(path)
                      load: dm.load(path)          (into the same dm and optimizer)
    torch FSDP2     fully_shard per transformer block, then the root (torchtitan's order);
                    opt = AdamW(model.parameters())
                      save: msd, osd = get_state_dict(model, opt)
                            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
                      load: msd, osd = get_state_dict(model, opt)
                            dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
                            set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
                    (get_state_dict/set_state_dict are inside the timed region: they are part
                    of a save/load as users call it)

Both write with DCP's default FileSystemWriter (one __<rank>_0.distcp file per rank, every
tensor item through torch.save, fsync of each file and of .metadata: DCP's default
sync_files=True, left as it is on both sides) into a fresh directory under --dir per round;
the directories are removed afterwards. The page cache is left as it is: a load reads the files
its side's save of the same round just wrote.

Rounds: --warmup untimed rounds, then --repeats timed ones; each round runs, in this order,
autopar save, FSDP2 save, autopar load, FSDP2 load (each into/from its own new directory), each
after a dist.barrier() outside the timed region.

Garbage collection: after both sides are built and have stepped, each rank runs gc.collect()
and gc.freeze() (as autopar.testing.RankPool does between jobs). Without it, Python's full
(generation-2) collections, which scan the whole heap of the process (both models, autopar's
compiled program with torch.export's graphs, FSDP2's state) and take 0.2-0.4 s each on this
machine, land on whichever save or load of whichever rank happens to trigger them, and stall
every rank at DCP's next collective: the per-round times then jump from ~0.2 s to ~0.6 s at
random and the medians compare noise (--no-gc-freeze shows it). The time spent in the
collector inside each call is reported either way.

Reported per world size:
  time    wall clock (perf_counter) of the call on each rank; per round the max over ranks (a
          save or load is done when its slowest rank is), then the median over rounds. The
          DCP part (dcp.save / dcp.load; autopar's calls to them are timed by wrapping
          torch.distributed.checkpoint.save/load while dm.save/dm.load run, which includes the
          no_dist dcp.load of its own metadata item on every rank at load) and the rest
          (building the state dicts, get/set_state_dict, autopar's checks and all-gathers);
          separately, the time in os.fsync and in FileSystemReader.read_metadata, how often
          .metadata is read per rank, and the time in Python's garbage collector (medians over
          every round and rank).
  bytes   the size of every file in the checkpoint directory after the save: per rank its
          __<rank>_0.distcp data file, and .metadata (written by the coordinator, rank 0). From
          DCP's metadata (FileSystemReader(path).read_metadata()): the write items stored in
          each rank's file and their tensor payload (the elements of each stored chunk times
          the element size); file bytes minus payload is the per-item serialization overhead
          (torch.save's zip container per tensor item, pickled objects).
  sanity  once per side, after the timed rounds: save, train one more step (every value
          changes), load; then the full parameters (autopar: dm.full_state_dict(); FSDP2:
          DTensor.full_tensor() of every parameter), every optimizer-state tensor this rank
          holds, the optimizer step and (autopar) the RNG state must equal the values at the
          save bitwise.
"""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import autopar
import autopar.testing
from autopar.models import GPTConfig, TinyGPT, gpt_batch, lm_loss

# benchmarks/ is the script's folder: bench_dp's slicing of the global batch
from bench_dp import local_slice  # noqa: E402

CONFIG = dict(vocab=512, seq=32, dim=256, heads=4, layers=4, max_seq=32)
GLOBAL_BATCH = 8
LR = 1e-3
SEED = 0
SIDES = ("autopar zero3", "torch FSDP2")
OPS = ("save", "load")


def fresh_model() -> TinyGPT:
    torch.manual_seed(SEED)
    return TinyGPT(GPTConfig(**CONFIG))


class Probe:
    """While active (one save or load of one side), wraps, for timing only:
    torch.distributed.checkpoint.save/load (autopar's checkpoint module and this script call
    them as ``dcp.save``/``dcp.load``, looked up at call time; calls with ``no_dist=True``,
    autopar's one-process read of its own ``autopar.meta`` item, are kept apart), os.fsync
    (DCP's FileSystemWriter calls it per data file and for .metadata) and
    FileSystemReader.read_metadata (each read and unpickling of .metadata)."""

    def __init__(self):
        self.dcp = 0.0          # dcp.save / dcp.load over the process group
        self.dcp_local = 0.0    # dcp.load(..., no_dist=True)
        self.fsync = 0.0
        self.md_reads = 0
        self.md_s = 0.0
        self.gc = 0.0           # Python's cyclic garbage collector, on this rank's main thread
        self.gc_full = 0        # of which generation-2 (full) collections
        self._gc_t = None

    def _on_gc(self, phase, info):
        if phase == "start":
            self._gc_t = time.perf_counter()
        elif self._gc_t is not None:
            self.gc += time.perf_counter() - self._gc_t
            self.gc_full += info.get("generation") == 2
            self._gc_t = None

    def __enter__(self):
        from torch.distributed.checkpoint import FileSystemReader
        gc.callbacks.append(self._on_gc)
        self._saved = (dcp.save, dcp.load, os.fsync, FileSystemReader.read_metadata)

        def timed(orig, add):
            def wrapper(*args, **kwargs):
                t = time.perf_counter()
                try:
                    return orig(*args, **kwargs)
                finally:
                    add(time.perf_counter() - t, kwargs)
            return wrapper

        def add_dcp(dt, kw):
            if kw.get("no_dist"):
                self.dcp_local += dt
            else:
                self.dcp += dt

        def add_fsync(dt, kw):
            self.fsync += dt

        def add_md(dt, kw):
            self.md_reads += 1
            self.md_s += dt
        save, load, fsync, read_md = self._saved
        dcp.save, dcp.load = timed(save, add_dcp), timed(load, add_dcp)
        os.fsync = timed(fsync, add_fsync)
        FileSystemReader.read_metadata = timed(read_md, add_md)
        return self

    def __exit__(self, *exc):
        from torch.distributed.checkpoint import FileSystemReader
        gc.callbacks.remove(self._on_gc)
        dcp.save, dcp.load, os.fsync, FileSystemReader.read_metadata = self._saved

    def parts(self) -> dict:
        return {"dcp": self.dcp, "dcp_local": self.dcp_local, "fsync": self.fsync, "md_reads": self.md_reads,
                "md_s": self.md_s, "gc": self.gc, "gc_full": self.gc_full}


class AutoparSide:
    def __init__(self, x, y):
        self.dm = autopar.compile(fresh_model(), autopar.Mesh(dp=dist.get_world_size()), example_inputs=(x,),
                                  plan=autopar.Plan(dp="zero3"))
        self.opt = self.dm.optimizer(torch.optim.AdamW, lr=LR)
        self.x, self.y = self.dm.shard_batch(x), self.dm.shard_batch(y)

    def step(self):
        self.opt.zero_grad(set_to_none=True)
        loss = lm_loss(self.dm(self.x), self.y)
        loss.backward()
        self.opt.step()
        return float(loss.detach())

    def save(self, path):
        self.dm.save(path)

    def load(self, path):
        self.dm.load(path)

    def snapshot(self):
        full = {k: v.detach().clone() for k, v in self.dm.full_state_dict().items()}
        return full, _opt_snapshot(self.opt), torch.get_rng_state()


class FSDP2Side:
    def __init__(self, x, y):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        model = fresh_model()
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)            # wte/head (tied), wpe, ln_f: the root group
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR)
        self.x, self.y = local_slice(x), local_slice(y)

    def step(self):
        self.opt.zero_grad(set_to_none=True)
        loss = lm_loss(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()
        return float(loss.detach())

    def save(self, path):
        from torch.distributed.checkpoint.state_dict import get_state_dict
        msd, osd = get_state_dict(self.model, self.opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

    def load(self, path):
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        msd, osd = get_state_dict(self.model, self.opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    def snapshot(self):
        full = {name: p.detach().full_tensor().clone() for name, p in self.model.named_parameters()}
        return full, _opt_snapshot(self.opt), None


def _opt_snapshot(opt) -> list[dict]:
    """Every optimizer-state value this rank holds (local shards of DTensors), in parameter order."""
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            st = {}
            for k, v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    v = v.to_local() if hasattr(v, "to_local") else v
                    v = v.detach().clone()
                st[k] = v
            out.append(st)
    return out


def _equal(a, b) -> tuple[bool, str]:
    """Bitwise equality of two snapshots: (equal, the first difference)."""
    (fa, oa, ra), (fb, ob, rb) = a, b
    if fa.keys() != fb.keys():
        return False, "parameter names differ"
    for k in fa:
        if not torch.equal(fa[k].view(torch.uint8), fb[k].view(torch.uint8)):
            return False, f"parameter {k}"
    if len(oa) != len(ob):
        return False, "optimizer parameter count"
    for i, (x, y) in enumerate(zip(oa, ob)):
        if x.keys() != y.keys():
            return False, f"optimizer state keys of parameter {i}"
        for k in x:
            if isinstance(x[k], torch.Tensor):
                if x[k].shape != y[k].shape or not torch.equal(x[k].reshape(-1).view(torch.uint8),
                                                               y[k].reshape(-1).view(torch.uint8)):
                    return False, f"optimizer state {k} of parameter {i}"
            elif x[k] != y[k]:
                return False, f"optimizer state {k} of parameter {i}"
    if ra is not None and not torch.equal(ra, rb):
        return False, "RNG state"
    return True, ""


def _files(path: str) -> dict:
    """Bytes of every file in a checkpoint directory, and per data file the write items it
    holds and their tensor payload (from DCP's metadata)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    sizes = {name: os.path.getsize(os.path.join(path, name)) for name in sorted(os.listdir(path))}
    md = FileSystemReader(path).read_metadata()
    items: dict[str, int] = {}
    tensor_items: dict[str, int] = {}
    payload: dict[str, int] = {}
    chunk_bytes = {}
    boxes = {}
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            boxes[fqn] = sorted((tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks)
            el = torch.empty((), dtype=entry.properties.dtype).element_size()
            for c in entry.chunks:
                n = 1
                for s in c.sizes:
                    n *= s
                chunk_bytes[(fqn, tuple(c.offsets))] = n * el
    for index, info in md.storage_data.items():
        f = info.relative_path
        items[f] = items.get(f, 0) + 1
        key = (index.fqn, tuple(index.offset) if index.offset is not None else None)
        if key in chunk_bytes:
            tensor_items[f] = tensor_items.get(f, 0) + 1
            payload[f] = payload.get(f, 0) + chunk_bytes[key]
    return {"sizes": sizes, "items": items, "tensor_items": tensor_items, "payload": payload,
            "keys": sorted(md.state_dict_metadata), "boxes": boxes}


# ---- one rank ----------------------------------------------------------------------------------

def rank_main(repeats: int, warmup: int, root: str, freeze: bool = True) -> dict:
    torch.set_num_threads(1)
    # DCP's plan exchange unpickles pytree specs through a deprecated path (a FutureWarning per rank)
    warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**CONFIG)
    x, y = gpt_batch(cfg, GLOBAL_BATCH, seed=0)
    sides = {SIDES[0]: AutoparSide(x, y), SIDES[1]: FSDP2Side(x, y)}
    losses = {name: side.step() for name, side in sides.items()}
    if freeze:
        # what exists now (both models, autopar's compiled program and torch.export's graphs,
        # FSDP2's state) is set aside from later collections, as autopar.testing.RankPool does
        # between jobs: else a full collection, which scans that whole heap (0.2-0.4 s here),
        # lands on whichever save or load happens to trigger it, on any rank
        gc.collect()
        gc.freeze()

    times = {(s, op): [] for s in SIDES for op in OPS}
    parts = {(s, op): [] for s in SIDES for op in OPS}
    files = {}
    for r in range(warmup + repeats):
        paths = {s: os.path.join(root, f"w{world}_round{r:03d}_{s.split()[1]}") for s in SIDES}
        for op in OPS:
            for s in SIDES:
                dist.barrier()
                with Probe() as probe:
                    t = time.perf_counter()
                    getattr(sides[s], op)(paths[s])
                    dt = time.perf_counter() - t
                if r >= warmup:
                    times[(s, op)].append(dt)
                    parts[(s, op)].append(probe.parts())
                if op == "save":
                    dist.barrier()
                    if rank == 0:
                        f = _files(paths[s])
                        files.setdefault(s, f)
                        if f["sizes"] != files[s]["sizes"]:
                            files[s].setdefault("varied", []).append(f["sizes"])
        dist.barrier()
        if rank == 0:
            for p in paths.values():
                shutil.rmtree(p, ignore_errors=True)

    # sanity: save, one more step, load: everything back, bitwise
    sanity = {}
    for s in SIDES:
        side = sides[s]
        path = os.path.join(root, f"w{world}_sanity_{s.split()[1]}")
        before = side.snapshot()
        side.save(path)
        side.step()
        changed = not _equal(before, side.snapshot())[0]
        side.load(path)
        ok, where = _equal(before, side.snapshot())
        sanity[s] = {"changed": changed, "equal": ok, "where": where}
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
    return {"rank": rank, "times": times, "parts": parts, "files": files, "sanity": sanity, "losses": losses}


# ---- the report --------------------------------------------------------------------------------

def _med_of_max(results, key, what="times") -> float:
    n = len(results[0][what][key])
    return statistics.median(max(r[what][key][i] for r in results) for i in range(n))


def _parts(results, key) -> dict:
    """Medians over every (round, rank) of the parts of one side's save or load (``Probe``); "rest"
    = the call's time minus its dcp.save/dcp.load calls (building or applying the state dicts,
    checks, autopar's all-gathers)."""
    rows = []
    for r in results:
        for dt, p in zip(r["times"][key], r["parts"][key]):
            rows.append({**p, "rest": dt - p["dcp"] - p["dcp_local"]})
    return {k: statistics.median(row[k] for row in rows) for k in rows[0]}


def _range_of_max(results, key) -> tuple[float, float]:
    per_round = [max(r["times"][key][i] for r in results) for i in range(len(results[0]["times"][key]))]
    return min(per_round), max(per_round)


def report(n: int, results: list[dict], repeats: int) -> tuple[str, dict]:
    lines = []
    a, t = SIDES
    med = {(s, op): _med_of_max(results, (s, op)) for s in SIDES for op in OPS}
    files = results[0]["files"]
    lines.append(f"world size N={n}  ({repeats} timed rounds; time = median over rounds of the max over ranks)")
    lines.append("| figure | autopar zero3 | torch FSDP2 (+ get/set_state_dict) | autopar/FSDP2 |")
    lines.append("|---|---|---|---|")
    for op in OPS:
        lo_a, hi_a = _range_of_max(results, (a, op))
        lo_t, hi_t = _range_of_max(results, (t, op))
        lines.append(f"| {op} s (min-max over rounds) | {med[(a, op)]:.3f} ({lo_a:.3f}-{hi_a:.3f}) | "
                     f"{med[(t, op)]:.3f} ({lo_t:.3f}-{hi_t:.3f}) | {med[(a, op)] / med[(t, op)]:.2f}x |")
    part = {key: _parts(results, key) for key in med}
    for s_ in SIDES:
        p = part[(s_, "save")]
        part[(s_, "save")]["text"] = f"{p['dcp']:.3f} / {p['fsync']:.3f} / {p['rest']:.3f}; {p['gc']:.3f}"
        p = part[(s_, "load")]
        part[(s_, "load")]["text"] = (f"{p['dcp']:.3f} / {p['dcp_local']:.3f} / {p['rest']:.3f}; "
                                      f"{p['md_reads']:.0f}x, {p['md_s']:.3f}; {p['gc']:.3f}")
    lines.append(f"| save parts s: dcp.save / its fsyncs / the rest; Python GC | {part[(a, 'save')]['text']} | "
                 f"{part[(t, 'save')]['text']} | |")
    lines.append(f"| load parts s: dcp.load / no_dist dcp.load / the rest; .metadata reads, s; Python GC | "
                 f"{part[(a, 'load')]['text']} | {part[(t, 'load')]['text']} | |")
    summary = {"n": n, "med": med, "part": part, "bytes": {}}
    for r in range(n):
        f = f"__{r}_0.distcp"
        ba, bt = files[a]["sizes"].get(f, 0), files[t]["sizes"].get(f, 0)
        summary["bytes"][r] = (ba, bt)
        lines.append(f"| rank {r} data file {f}, bytes | {ba:,} | {bt:,} | {ba / bt:.4f}x |")
    for r in range(n):
        f = f"__{r}_0.distcp"
        pa, pt = files[a]["payload"].get(f, 0), files[t]["payload"].get(f, 0)
        ia, it = files[a]["items"].get(f, 0), files[t]["items"].get(f, 0)
        ta, tt = files[a]["tensor_items"].get(f, 0), files[t]["tensor_items"].get(f, 0)
        oa = (files[a]["sizes"].get(f, 0) - pa)
        ot = (files[t]["sizes"].get(f, 0) - pt)
        lines.append(f"| rank {r}: write items (tensors) / tensor payload bytes / file - payload | "
                     f"{ia} ({ta}) / {pa:,} / {oa:,} | {it} ({tt}) / {pt:,} / {ot:,} | |")
    ma, mt = files[a]["sizes"].get(".metadata", 0), files[t]["sizes"].get(".metadata", 0)
    summary["meta"] = (ma, mt)
    lines.append(f"| .metadata bytes (rank 0 writes it) | {ma:,} | {mt:,} | {ma / mt:.2f}x |")
    ta = sum(files[a]["sizes"].values())
    tt = sum(files[t]["sizes"].values())
    lines.append(f"| whole directory bytes | {ta:,} | {tt:,} | {ta / tt:.4f}x |")
    lines.append(f"| keys in the checkpoint (tensor keys) | {len(files[a]['keys'])} ({len(files[a]['boxes'])}) | "
                 f"{len(files[t]['keys'])} ({len(files[t]['boxes'])}) | |")
    for s in SIDES:
        if files[s].get("varied"):
            lines.append(f"NOTE: {s}'s file sizes varied between rounds: {files[s]['varied']}")
    full = {key: sum(p["gc_full"] for r in results for p in r["parts"][key]) for key in med}
    lines.append("full (generation-2) garbage collections inside the timed calls, all ranks and rounds: " +
                 ", ".join(f"{s_} {op} {full[(s_, op)]}" for s_ in SIDES for op in OPS))
    lines.append("")
    only_a = [k for k in files[a]["keys"] if k not in files[t]["keys"]]
    only_t = [k for k in files[t]["keys"] if k not in files[a]["keys"]]
    common = [k for k in files[a]["boxes"] if k in files[t]["boxes"]]
    same = [k for k in common if files[a]["boxes"][k] == files[t]["boxes"][k]]
    lines.append(f"keys only in autopar's checkpoint: {', '.join(only_a) or '-'}")
    lines.append(f"keys only in FSDP2's: {', '.join(only_t) or '-'}")
    lines.append(f"tensor keys in both: {len(common)}, stored as the same chunks (offsets, sizes): {len(same)}"
                 + ("" if len(same) == len(common) else
                    "; differing: " + ", ".join(k for k in common if k not in same)[:400]))
    loss = {s: statistics.fmean(r["losses"][s] for r in results) for s in SIDES}
    lines.append("loss of the one training step (mean over ranks; same data and weights, should agree): " +
                 ", ".join(f"{s} {v:.6f}" for s, v in loss.items()))
    for s in SIDES:
        ok = all(r["sanity"][s]["equal"] for r in results)
        changed = all(r["sanity"][s]["changed"] for r in results)
        where = "; ".join(f"rank {r['rank']}: {r['sanity'][s]['where']}" for r in results
                          if not r["sanity"][s]["equal"])
        lines.append(f"sanity {s}: save, one more step (values changed: {changed}), load -> "
                     f"{'bitwise equal to the saved state on every rank' if ok else 'DIFFERS: ' + where}")
        summary.setdefault("sanity", {})[s] = ok
    return "\n".join(lines), summary


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=15, help="timed rounds (save and load of each side)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds before them")
    ap.add_argument("--dir", default="/tmp", help="where the temporary checkpoint directories go")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--no-gc-freeze", action="store_true",
                    help="leave the heap built before the rounds to Python's collector (its full "
                         "collections, 0.2-0.4 s each here, then land on random saves and loads)")
    args = ap.parse_args(argv)

    psi = sum(p.numel() for p in fresh_model().parameters())
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores, gloo, CPU, 1 thread per rank; "
          f"TinyGPT {CONFIG} (Ψ = {psi:,} parameters, tied wte/head counted once), fp32, AdamW(lr={LR}), "
          f"one step on a global batch of {GLOBAL_BATCH}; autopar Plan(dp='zero3') vs FSDP2 fully_shard "
          f"per block + root with get_state_dict/set_state_dict")
    print(f"checkpoints under {args.dir} (page cache as it is; DCP's FileSystemWriter defaults on both sides, "
          f"fsync included); {args.warmup} warm-up + {args.repeats} timed rounds of: autopar save, FSDP2 save, "
          f"autopar load, FSDP2 load, each after a barrier, each into/from a fresh directory; "
          + ("no gc.freeze()" if args.no_gc_freeze else "gc.collect(); gc.freeze() once after building both sides"))
    print(f"1-minute load average before the run: {os.getloadavg()[0]:.2f}")
    print()
    start = time.perf_counter()
    summaries = []
    root = tempfile.mkdtemp(prefix="bench_checkpoint_", dir=args.dir)
    try:
        for n in args.world_sizes:
            t = time.perf_counter()
            results = autopar.testing.run(rank_main, n, args.repeats, args.warmup, root, not args.no_gc_freeze,
                                          timeout=args.timeout)
            text, summary = report(n, results, args.repeats)
            summaries.append(summary)
            print(text)
            print(f"(N={n} took {time.perf_counter() - t:.0f}s)")
            print()
            sys.stdout.flush()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"total {time.perf_counter() - start:.0f}s; load average after: {os.getloadavg()[0]:.2f}")
    return summaries


if __name__ == "__main__":
    main()
