"""Three ways the pipeline replay can share this machine's cores, compared on one calibration and
the same measured hold-out rows (``bench_holdout.py --plans pp`` logs):

    AUTOPAR_CACHE=<dir> python benchmarks/bench_holdout.py --plans pp > run.log   # calibrates first
    AUTOPAR_CACHE=<dir> python benchmarks/replay_ab.py run.log [more.log ...]

* ``moment`` (the cost model's): a busy rank is slowed by the measured contention of the
  processes computing at that moment; each stage keeps the cores it is dealt
  (``pipeline_placement``);
* ``mesh``: every busy rank slowed by the contention of the whole
  mesh, whoever computes;
* ``lent``: as ``moment``, but every idle core goes to whichever stage computes.

The calibration's message latency (``hop``) and wake-up wait (``wake``) are fitted to its
synthetic pipeline's measured step under each replay: the step the ``moment`` fits reproduce is
replayed, and ``mesh`` and ``lent`` refit to it, as the calibration would have. Prints each
variant's fits, and its mean and worst |predicted / measured - 1| over the logs' rows (against
the geometric mean of the logs' measurements of a row), per world and schedule.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import sys

from autopar import holdout
from autopar.cost import estimate, pipeline
from autopar.cost.calibration import link_fits
from autopar.cost.cluster import cached_local

moment = pipeline.pipeline_placement


def mesh(p, world, cores, contention):
    """Every busy rank at the whole mesh's contention, whoever computes."""
    _, placement = moment(p, world, cores, contention)
    return max(1.0, world / cores) / contention(world), placement


def lent(p, world, cores, contention):
    """Every core shared by every stage: an idle stage's cores go to the busy ones."""
    speed, _ = moment(p, world, cores, contention)
    return speed, [(0, float(cores), world / p) for _ in range(p)]


VARIANTS = {"moment": moment, "mesh": mesh, "lent": lent}


def main():
    c = cached_local()
    if c is None:
        raise SystemExit("no local calibration in the cache: run bench_holdout.py with the same AUTOPAR_CACHE first")
    cores, table = c.gpus_per_node, c.contention
    hop, wake = c.intra.hop, c.shared.wake if c.shared else 0.0
    two = link_fits.pipeline_replay(2, cores, table, hop)
    crowded = link_fits.pipeline_replay(2 * cores, cores, table, hop, wake)
    print(f"contention {table}; the synthetic pipeline's measured step: {two * 1e3:.2f} ms on 2 processes, "
          f"{crowded * 1e3:.2f} ms on {2 * cores}")
    runs = [holdout.parse_grid(path) for path in sys.argv[1:]]
    models = holdout.grid_models()
    for name, place in VARIANTS.items():
        h = link_fits.fit_hop(two, 2, cores, table, place=place) if place is not moment else hop
        w = link_fits.fit_hop(crowded, 2 * cores, cores, table, hop=h, place=place) if place is not moment else wake
        estimate.pipeline_placement = place
        cl = dataclasses.replace(c, intra=dataclasses.replace(c.intra, hop=h), inter=dataclasses.replace(c.inter, hop=h),
                                 shared=dataclasses.replace(c.shared, hop=h, wake=w) if c.shared else None)
        errs, by_plan = [], {}
        for world in (2, 4):
            plans = [p for p in holdout.plans(world) if any((world, k, p[0]) in r for r in runs for k, _, _ in models)]
            for (key, plan), e in holdout.predictions(models, plans, cl).items():
                measured = [r[(world, key, plan)][0] for r in runs if (world, key, plan) in r]
                ratio = e.step_time_s * 1e3 / math.exp(statistics.mean(math.log(x) for x in measured))
                errs.append(abs(ratio - 1))
                by_plan.setdefault((world, plan), []).append(ratio)
        print(f"{name}: hop {h * 1e3:.2f} ms, wake {w * 1e3:.2f} ms; {len(errs)} rows, mean |pred/meas - 1| "
              f"{statistics.mean(errs):.1%}, worst {max(errs):.1%}, {sum(x <= 0.25 for x in errs)} within 25%")
        for (world, plan), v in by_plan.items():
            print(f"   world {world} {plan:15s} pred/meas mean {statistics.mean(v):.2f} ({min(v):.2f}..{max(v):.2f})")
    estimate.pipeline_placement = moment


if __name__ == "__main__":
    main()
