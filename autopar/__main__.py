"""Command line: ``python -m autopar demo [--world N] [--steps K] [--out DIR]``."""
import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m autopar", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="compile a small GPT with ZeRO-3 on local CPU processes")
    d.add_argument("--world", type=int, default=2, help="processes (1..8)")
    d.add_argument("--steps", type=int, default=5)
    d.add_argument("--out", default="autopar_out", help="where dm.dump() writes the graphs")
    args = ap.parse_args(argv)
    from autopar.demo import main as demo
    return demo(args.world, args.steps, args.out)


if __name__ == "__main__":
    sys.exit(main())
