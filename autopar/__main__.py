"""Command line.

    python -m autopar demo [--world N] [--steps K] [--out DIR]
    python -m autopar plan --model gpt3-175b --cluster dgx-a100-80gb --world 1024 --batch 1536
    python -m autopar calibrate [--force]
    python -m autopar verify --model tiny-gpt --mesh dp=2,tp=2 --plan "dp=zero3,tp,sp"
    python -m autopar zoo [--archs llama,mixtral] [--plans zero3,tp] [--steps 2]
    python -m autopar fuzz --minutes 60 [--seed 0] [--plans tp,tp+sp] [--out fuzz_out]
    python -m autopar doctor [--quick] [--only zero3,1f1b] [--backend gloo|nccl] [--json out.json]
"""
import argparse
import sys
import time

import torch

from .api import plan as find_plan
from .cost.calibration import calibrate_local
from .cost.planner import InfeasiblePlan
from .demo import main as demo
from .models import NAMED, SMALL, named, small
from .planspec import Plan
from .verification import verify
from . import doctor, fuzz, zoo


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m autopar", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="compile a small GPT with plan='auto' on local CPU processes")
    d.add_argument("--world", type=int, default=2, help="processes (1..8)")
    d.add_argument("--steps", type=int, default=5)
    d.add_argument("--out", default="autopar_out", help="where dm.dump() writes the graphs")
    p = sub.add_parser("plan", help="plan a named model size on a cluster preset and print the candidates")
    p.add_argument("--model", default="gpt3-175b", choices=sorted(NAMED), help="a named model size")
    p.add_argument("--cluster", default="dgx-a100-80gb", help="dgx-a100-80gb, dgx-h100 or local")
    p.add_argument("--world", type=int, default=1024, help="devices")
    p.add_argument("--batch", type=int, default=1536, help="global batch (sequences per step)")
    p.add_argument("--layers", type=int, default=None, help="override the model's depth")
    p.add_argument("--top", type=int, default=10, help="candidates to show")
    p.add_argument("--flash", action="store_true", help="attention as a fused kernel (no a*s^2 scores kept)")
    p.add_argument("--trace", default=None, help="write the chosen plan's predicted step as a Chrome trace here")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"),
                   help="bf16: mixed precision (bf16 compute, fp32 masters: Plan(param_dtype=torch.bfloat16)); "
                        "fp32: the fp32 model as it is")
    cal = sub.add_parser("calibrate", help="measure this machine for the cost model's local preset (cached)")
    cal.add_argument("--force", action="store_true", help="measure again even if cached")
    v = sub.add_parser("verify", help="run a plan on simulated ranks and compare every node with one device")
    v.add_argument("--model", default="tiny-gpt", choices=SMALL, help="a small model")
    v.add_argument("--mesh", default="dp=2", help="axis=size pairs, outermost first, e.g. dp=2,tp=2")
    v.add_argument("--plan", default="dp=ddp", help="Plan(...) as str(plan) prints it, or fields: dp=zero3,tp,sp")
    v.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    v.add_argument("--tol", type=float, default=None, help="largest scaled error accepted (default 1e-4 in fp32)")
    v.add_argument("--spawn", action="store_true", help="ranks as processes (default: threads of this process)")
    z = sub.add_parser("zoo", help="train Hugging Face architectures under every parallelism against one device")
    z.add_argument("--archs", default=None, help=f"comma-separated, of: {','.join(a.name for a in zoo.ARCHS)}")
    z.add_argument("--plans", default=None, help=f"comma-separated, of: {','.join(zoo.PLANS)}")
    z.add_argument("--steps", type=int, default=zoo.STEPS, help="AdamW steps per cell")
    f = sub.add_parser("fuzz", help="random models under every plan against one device (autopar.fuzz)")
    f.add_argument("--minutes", type=float, default=1.0, help="how long to generate models")
    f.add_argument("--seed", type=int, default=0, help="the first model's seed (the next ones follow)")
    f.add_argument("--plans", default=None, help=f"comma-separated, of: {','.join((*fuzz.PLANS, *fuzz.PIPELINE_PLANS))}")
    f.add_argument("--out", default="fuzz_out", help="where each failure's shrunk model is written as a module")
    f.add_argument("--no-shrink", action="store_true", help="report failures without shrinking them")
    sub.add_parser("doctor", add_help=False,
                   help="train every plan a few steps on this machine's devices against one device (autopar.doctor)")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["doctor"]:
        return doctor.main(argv[1:])
    args = ap.parse_args(argv)
    if args.cmd == "fuzz":
        return _fuzz(args)
    if args.cmd == "zoo":
        return _zoo(args)
    if args.cmd == "verify":
        return _verify(args)
    if args.cmd == "calibrate":
        c = calibrate_local(force=args.force)
        print(c.source)
        print(c.device)
        for level in ("intra", "shared"):
            if getattr(c, level) is not None:
                print(f"{level}: {getattr(c, level)}")
        return 0
    if args.cmd == "demo":
        return demo(args.world, args.steps, args.out)
    return _plan(args)


def _zoo(args) -> int:
    names = args.archs.split(",") if args.archs else None
    plans = args.plans.split(",") if args.plans else None
    for n in names or []:
        zoo.arch(n)                      # an unknown name fails before any process starts
    for p in plans or []:
        if p not in zoo.PLANS:
            raise SystemExit(f"unknown zoo plan {p!r}; the zoo has {', '.join(zoo.PLANS)}")
    t0 = time.perf_counter()
    cells = zoo.run(names, plans, args.steps, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(zoo.table(cells))
    print(f"\n({time.perf_counter() - t0:.0f} s, {args.steps} AdamW steps per cell)")
    return 0 if all(c.ok for c in cells) else 1


def _fuzz(args) -> int:
    import os
    known = (*fuzz.PLANS, *fuzz.PIPELINE_PLANS)
    plans = args.plans.split(",") if args.plans else list(known)
    for p in plans:
        if p not in known:
            raise SystemExit(f"unknown fuzz plan {p!r}; the fuzzer has {', '.join(known)}")
    log = lambda line: print(line, file=sys.stderr, flush=True)   # noqa: E731
    summary = fuzz.run(range(args.seed, 10 ** 9), plans, minutes=args.minutes, log=log)
    print(summary.table())
    failures = summary.failures()
    seen = set()
    for v in failures:
        kind = (v.plan, v.kind, v.error_type)
        if args.no_shrink or kind in seen:      # one shrunk model per plan and kind of failure
            continue
        seen.add(kind)
        log(f"shrinking {v}")
        spec, got = fuzz.shrink(fuzz.generate(v.seed), v.plan, v, log=log)
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"seed{v.seed}_{v.plan.replace('×', 'x').replace('+', '_')}.py")
        with open(path, "w") as fh:
            fh.write(fuzz.source(spec, v.plan))
        print(f"\n{got}\n  shrunk: {spec.describe()}\n  module: {path}")
    return 1 if failures else 0


def _plan(args) -> int:
    t0 = time.perf_counter()
    model, example = named(args.model, layers=args.layers, dtype=torch.float32)
    try:
        report = find_plan(model, args.world, example_inputs=example, cluster=args.cluster,
                           global_batch=args.batch, top=args.top, flash_attention=args.flash,
                           param_dtype=torch.bfloat16 if args.precision == "bf16" else None)
    except InfeasiblePlan as exc:
        print(f"autopar plan: {exc}", file=sys.stderr)
        return 2
    print(f"{args.model} on {args.world} x {args.cluster}, global batch {args.batch} "
          f"(planned in {time.perf_counter() - t0:.1f} s, capture included)\n")
    print(report.explain())
    if report.estimate is not None:
        print("\n" + report.estimate.explain())
        if args.trace:
            report.estimate.write_chrome_trace(args.trace)
            print(f"\npredicted timeline: {args.trace} (open in Perfetto / chrome://tracing)")
    return 0


def _verify(args) -> int:
    t0 = time.perf_counter()
    model, inputs, target, loss_fn = small(args.model, batch=args.batch)
    try:
        plan = Plan.parse(args.plan)
    except (TypeError, ValueError, SyntaxError) as exc:
        print(f"autopar verify: cannot read --plan {args.plan!r}: {exc}", file=sys.stderr)
        return 2
    try:
        report = verify(model, args.mesh, plan, example_inputs=inputs, target=target, loss_fn=loss_fn,
                        tol=args.tol, spawn=True if args.spawn else None)
    except (ValueError, TypeError, NotImplementedError) as exc:
        print(f"autopar verify: {exc}", file=sys.stderr)
        return 2
    print(f"{args.model}, batch {args.batch}, {plan} on {report.mesh}: ranks as {report.ranks} "
          f"({time.perf_counter() - t0:.1f} s)")
    for name, why in report.skipped.items():
        print(f"  not compared: {name}: {why}")
    print(report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
