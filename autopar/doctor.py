"""``python -m autopar doctor``: does autopar train correctly on this machine's devices?

One prepared check of the whole platform, for a machine seen for the first time (a GPU node,
a new PyTorch). For each plan of ``CHECKS`` it starts the plan's ranks as local processes,
compiles a small model (the project's Llama: grouped-query attention, rotary positions,
RMSNorm, a gated MLP), trains a few AdamW steps under the plan and against the single-device
model (``autopar.compare.parity``: outputs, loss, gradients, parameters after every step),
then times more steps. The report gives, per plan: the parity verdict and its largest
errors, the step time (median, the device synchronised around every step), and the peak
memory of the device (``torch.cuda.max_memory_allocated``; on a CPU the process's peak
resident set, which includes PyTorch itself). A last check saves a checkpoint under one plan,
resumes it under another, and compares the resumed run with the uninterrupted one.

Where the ranks run:

- with CUDA and at least as many GPUs as a plan's ranks: a GPU each, over NCCL;
- with CUDA and fewer GPUs: the ranks share the GPUs (rank r on GPU r mod count) over gloo,
  CUDA tensors included, so that every device path of the runtime runs on one GPU;
- without CUDA: the CPU over gloo.

``--backend`` overrides the choice. ``--quick`` runs the checks marked quick (two ranks
each). The full set takes about 25 s on a 2-core CPU, and is sized for five minutes on one
GPU (``--quick``: one).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from .api import compile as autopar_compile
from .compare import parity
from .launch import RankPool, harness_device, quiet
from .mesh import Mesh
from .models import lm_loss, small
from .planspec import Plan
from .runtime.timing import now

__all__ = ["Check", "CHECKS", "Row", "run_checks", "table", "main"]


@dataclass(frozen=True)
class Check:
    """One row of the doctor: ``mesh`` (axis sizes) and ``plan``, trained with parity."""
    name: str
    mesh: tuple          # ((axis, size), ...), outermost first
    plan: Plan
    quick: bool = False
    resume: tuple | None = None    # (mesh, plan): a checkpoint saved under ``plan`` resumed under this one

    @property
    def world(self) -> int:
        return math.prod(size for _, size in self.mesh)


BF16 = torch.bfloat16
CHECKS = (
    Check("ddp", (("dp", 2),), Plan(dp="ddp"), quick=True),
    Check("zero1", (("dp", 2),), Plan(dp="zero1")),
    Check("zero2", (("dp", 2),), Plan(dp="zero2")),
    Check("zero3", (("dp", 2),), Plan(dp="zero3"), quick=True),
    Check("tp", (("tp", 2),), Plan(tp=True)),
    Check("tp+sp", (("tp", 2),), Plan(tp=True, sp=True), quick=True),
    Check("collective matmul", (("tp", 2),), Plan(tp=True, sp=True, collective_matmul=True)),
    Check("gpipe", (("pp", 2),), Plan(pp_schedule="gpipe", microbatches=4)),
    Check("1f1b", (("pp", 2),), Plan(pp_schedule="1f1b", microbatches=4), quick=True),
    Check("interleaved", (("pp", 2),), Plan(pp_schedule="interleaved", microbatches=4, virtual_stages=2)),
    Check("zero-bubble", (("pp", 2),), Plan(pp_schedule="zero_bubble", microbatches=4)),
    Check("dp×tp zero3+sp", (("dp", 2), ("tp", 2)), Plan(dp="zero3", tp=True, sp=True)),
    Check("3-D zero1", (("pp", 2), ("dp", 2), ("tp", 2)),
          Plan(dp="zero1", tp=True, sp=True, pp_schedule="1f1b", microbatches=2)),
    Check("bf16 zero3", (("dp", 2),), Plan(dp="zero3", param_dtype=BF16), quick=True),
    Check("bf16 tp+sp", (("tp", 2),), Plan(tp=True, sp=True, param_dtype=BF16)),
    Check("recompute full", (("dp", 2),), Plan(dp="zero2", recompute="full"), quick=True),
    Check("recompute full tp", (("tp", 2),), Plan(tp=True, recompute="full")),
    Check("offload", (("dp", 2),), Plan(dp="zero2", offload="optimizer")),
    Check("resume zero3 → tp", (("dp", 2),), Plan(dp="zero3"), quick=True, resume=((("tp", 2),), Plan(tp=True))),
)
"""What the doctor runs, in order."""

PARITY_STEPS = 3
TIMED_STEPS = 5
BATCH = 8


@dataclass
class Row:
    """What one check found on every rank (the worst of its ranks)."""
    name: str
    world: int
    backend: str
    device: str
    ok: bool
    detail: str = ""                          # parity's errors, or what failed
    step_ms: float | None = None              # median over TIMED_STEPS, rank 0
    peak_mib: float | None = None             # the largest over the ranks
    seconds: float = 0.0                      # the whole check, compile included
    errors: dict = field(default_factory=dict)


def _peak_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024     # Linux: KiB


def _model():
    model, inputs, target, _ = small("tiny-llama", batch=BATCH)
    return model, inputs, target


def _mesh(axes: tuple) -> Mesh:
    return Mesh(**dict(axes))


def _train_step(dm, plan: Plan, inputs, target, opt) -> None:
    opt.zero_grad()
    if plan.pp_schedule is not None:
        dm.train_step(inputs, target, lm_loss)
    else:
        lm_loss(dm(*inputs), target).backward()
    opt.step()


def _timed(dm, plan: Plan, inputs, target, device: torch.device) -> tuple[float, float]:
    """(median step milliseconds, peak MiB) of TIMED_STEPS AdamW steps of ``dm``."""
    opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
    local_in, local_t = dm.shard_batch(inputs), dm.shard_batch(target)
    _train_step(dm, plan, local_in, local_t, opt)       # warm: the optimizer's state allocated
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(TIMED_STEPS):
        t0 = now(device)
        _train_step(dm, plan, local_in, local_t, opt)
        times.append((now(device) - t0) * 1e3)
    return statistics.median(times), _peak_mib(device)


def _parity_job(check: Check) -> dict:
    """One rank's part of a parity check: the report's errors, then the timing."""
    with quiet():
        return _parity(check)


def _parity(check: Check) -> dict:
    device = harness_device()
    model, inputs, target = _model()
    kept = []
    # mixed precision: Adam's eps at 1e-4, as tests/test_mixed.py has it: with 1e-8 Adam turns the
    # bf16 rounding of gradients near zero into whole steps of lr, whose sign differs between
    # two summation orders (the masters' update then differs by up to the tolerance itself)
    adam = {"eps": 1e-4} if check.plan.mixed else {}
    rep = parity(lambda: _model()[0], _mesh(check.mesh), check.plan, inputs, target, lm_loss,
                 steps=PARITY_STEPS, inspect=kept.append, **adam)
    step_ms, peak = _timed(kept[0], check.plan, tuple(x.to(device) for x in inputs), target.to(device), device)
    errors = {"output": rep.output_err, "loss": rep.loss_err, "grad": rep.grad_err, "param": rep.param_err}
    return {"ok": rep.ok, "errors": errors, "messages": list(rep.messages), "step_ms": step_ms, "peak_mib": peak}


def _params(dm) -> dict:
    return {k: v.detach().float().cpu() for k, v in dm.full_state_dict().items()}


def _resume_job(check: Check, path: str) -> dict:
    """Train 2 steps under ``check.plan``, save, train 2 more (the uninterrupted run); then the
    model built from another seed, compiled under the resume plan, loads the checkpoint and
    trains the same 2 steps. The two runs' parameters must agree."""
    with quiet():
        return _resume(check, path)


def _resume(check: Check, path: str) -> dict:
    device = harness_device()
    t0 = time.perf_counter()
    mesh, plan = check.resume

    def trained(m, axes, p):
        _, inputs, target = _model()
        inputs, target = tuple(x.to(device) for x in inputs), target.to(device)
        dm = autopar_compile(m.to(device), _mesh(axes), example_inputs=inputs, plan=p)
        opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
        return dm, opt, dm.shard_batch(inputs), dm.shard_batch(target)

    dm, opt, x, y = trained(_model()[0], check.mesh, check.plan)
    for _ in range(2):
        _train_step(dm, check.plan, x, y, opt)
    dm.save(path, step=2)
    for _ in range(2):
        _train_step(dm, check.plan, x, y, opt)
    want = _params(dm)
    dm2, opt2, x, y = trained(small("tiny-llama", batch=BATCH, seed=123)[0], mesh, plan)
    resumed = dm2.load(path)
    for _ in range(2):
        _train_step(dm2, plan, x, y, opt2)
    got = _params(dm2)
    worst = max(float((got[k] - want[k]).abs().max() / (want[k].abs().max() + 1e-12)) for k in want)
    messages = [] if resumed.step == 2 else [f"load returned step {resumed.step}, saved 2"]
    now(device)
    return {"ok": not messages and worst < 1e-5, "errors": {"param": worst}, "messages": messages,
            "step_ms": None, "peak_mib": _peak_mib(device), "seconds": time.perf_counter() - t0}


def _where(world: int, backend: str | None) -> tuple[str, str]:
    """(backend, device description) for ``world`` ranks on this machine."""
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        chosen = backend or ("nccl" if count >= world else "gloo")
        names = sorted({torch.cuda.get_device_name(i) for i in range(min(count, world))})
        share = "" if count >= world else f" ({world} ranks sharing {count})"
        return chosen, f"cuda × {min(count, world)}: {', '.join(names)}{share}"
    return backend or "gloo", f"cpu ({os.cpu_count()} cores)"


def run_checks(checks=CHECKS, *, backend: str | None = None, timeout: float = 300.0, log=print) -> list[Row]:
    """Run ``checks`` (each on a pool of its world's processes, kept between checks of one
    world); a check that fails to run is a row that says why, and the others still run."""
    cuda = torch.cuda.is_available()
    env = {"AUTOPAR_TEST_DEVICE": "cuda" if cuda else "cpu"}
    saved = {k: os.environ.get(k) for k in ("AUTOPAR_TEST_DEVICE", "AUTOPAR_TEST_BACKEND")}
    pools: dict[tuple, RankPool] = {}
    rows = []
    try:
        for check in checks:
            chosen, device = _where(check.world, backend)
            os.environ.update(env, AUTOPAR_TEST_BACKEND=chosen)
            key = (check.world, chosen)
            t0 = time.perf_counter()
            row = Row(check.name, check.world, chosen, device, ok=False)
            try:
                pool = pools.get(key)
                if pool is None or not pool.alive:
                    for other in pools.values():     # one pool at a time: the devices' memory
                        other.close()
                    pools.clear()
                    pool = pools[key] = RankPool(check.world, timeout=timeout)
                if check.resume is not None:
                    with tempfile.TemporaryDirectory(prefix="autopar-doctor-") as path:
                        results = pool.run(_resume_job, check, os.path.join(path, "ckpt"), timeout=timeout)
                else:
                    results = pool.run(_parity_job, check, timeout=timeout)
                row.ok = all(r["ok"] for r in results)
                row.errors = {k: max(r["errors"][k] for r in results) for k in results[0]["errors"]}
                messages = sorted({m for r in results for m in r["messages"]})
                row.detail = "; ".join(messages[:2]) or ", ".join(f"{k} {v:.2g}" for k, v in row.errors.items())
                row.step_ms = results[0]["step_ms"]
                row.peak_mib = max(r["peak_mib"] for r in results)
            except Exception as exc:      # reported in the row: the next checks still run
                last = str(exc).strip().splitlines()
                row.detail = f"{type(exc).__name__}: {last[-1] if last else ''}"[:300]
            row.seconds = time.perf_counter() - t0
            rows.append(row)
            log(_line(row))
    finally:
        for pool in pools.values():
            pool.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return rows


def _line(row: Row) -> str:
    step = f"{row.step_ms:8.1f}" if row.step_ms is not None else "       —"
    peak = f"{row.peak_mib:9.1f}" if row.peak_mib is not None else "        —"
    verdict = "ok  " if row.ok else "FAIL"
    return f"{row.name:<24} {row.world:>5} {row.backend:<5} {verdict} {step} {peak} {row.seconds:6.1f}  {row.detail}"


def header() -> str:
    lines = [f"autopar doctor: torch {torch.__version__}, Python {platform.python_version()}, "
             f"{platform.machine()}",
             f"  CUDA: {torch.version.cuda or 'none'}"
             + (f", {torch.cuda.device_count()} device(s): {torch.cuda.get_device_name(0)}"
                if torch.cuda.is_available() else " (no device: ranks on the CPU)"),
             f"  backends: gloo {dist.is_gloo_available()}, nccl {dist.is_nccl_available()}",
             f"  model: the project's Llama (autopar.models.small('tiny-llama')), global batch {BATCH}; "
             f"parity over {PARITY_STEPS} AdamW steps, then {TIMED_STEPS} timed",
             f"{'check':<24} {'ranks':>5} {'comm':<5} {'':4} {'step ms':>8} {'peak MiB':>9} {'time s':>6}  "
             "errors (scaled; <= 1 passes) or what failed"]
    return "\n".join(lines)


def table(rows: list[Row]) -> str:
    return "\n".join([header(), *(_line(r) for r in rows)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m autopar doctor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the quick checks only (about a minute)")
    ap.add_argument("--only", default=None, help="comma-separated check names, of: "
                    + ", ".join(c.name for c in CHECKS))
    ap.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                    help="the ranks' process-group backend (default: nccl with a GPU per rank, else gloo)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a check's collectives may wait")
    ap.add_argument("--json", default=None, help="also write the rows here as JSON")
    args = ap.parse_args(argv)
    checks = [c for c in CHECKS if c.quick] if args.quick else list(CHECKS)
    if args.only:
        names = [n.strip() for n in args.only.split(",")]
        unknown = [n for n in names if n not in {c.name for c in CHECKS}]
        if unknown:
            raise SystemExit(f"unknown doctor check(s) {unknown}; checks: {', '.join(c.name for c in CHECKS)}")
        checks = [c for c in CHECKS if c.name in names]
    t0 = time.perf_counter()
    print(header(), flush=True)
    rows = run_checks(checks, backend=args.backend, timeout=args.timeout,
                      log=lambda line: print(line, flush=True))
    failed = [r.name for r in rows if not r.ok]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} checks passed in {time.perf_counter() - t0:.0f} s"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([asdict(r) for r in rows], fh, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
