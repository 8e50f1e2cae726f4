"""Command line.

    python -m autopar demo [--world N] [--steps K] [--out DIR]
    python -m autopar plan --model gpt3-175b --cluster dgx-a100-80gb --world 1024 --batch 1536
    python -m autopar calibrate [--force]
"""
import argparse
import sys
import time

from .api import plan as find_plan
from .cost.calibration import calibrate_local
from .cost.planner import InfeasiblePlan
from .demo import main as demo
from .models import NAMED, named


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
    cal = sub.add_parser("calibrate", help="measure this machine for the cost model's local preset (cached)")
    cal.add_argument("--force", action="store_true", help="measure again even if cached")
    args = ap.parse_args(argv)
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


def _plan(args) -> int:
    t0 = time.perf_counter()
    model, example = named(args.model, layers=args.layers)
    try:
        report = find_plan(model, args.world, example_inputs=example, cluster=args.cluster,
                           global_batch=args.batch, top=args.top, flash_attention=args.flash)
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


if __name__ == "__main__":
    sys.exit(main())
