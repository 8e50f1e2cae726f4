"""autopar's graph passes: each ``(GraphModule, CompileContext) -> GraphModule``. A pass edits
the graph and lints it; it does not regenerate the module's Python code (``recompile``): no
intermediate module runs, and the emitted rank module (``runtime.emit``) and the pipeline's
stage modules generate theirs once, when they are built.

``for_plan(plan)`` is the ordered list a graph goes through under a plan (the pipeline pass,
which cuts the graph into stages first, and the order check, which compares ranks and
rewrites nothing, are called by the compile driver apart from it, as is autocast, which
runs on the whole logical graph under mixed precision before anything else; so is the write
check, which after the list refuses any in-place write left in a rank's program):

    shard               layouts: one placement per mesh axis on every node
    collectives         the communication the layouts need (dp gathers / buckets, tp redistributions)
    localize            global sizes in ops rewritten to this rank's
    rng                 random sites (dropout) draw the single-device mask and keep this rank's slice
    sequence_parallel   (sp) each sequence-sharded pointwise region fused into one node
    overlap             collectives as start / wait, placed to overlap compute
    weight_split        (a schedule that splits backward) weight gradients deferred to W
    recompute           (recompute) layers or attention cores recomputed in backward
"""
from .autocast import autocast
from .shard import shard
from .collectives import collectives
from .localize import localize
from .rng import rng, find_sites
from .sequence_parallel import sequence_parallel
from .pipeline import pipeline, stage_bounds
from .overlap import overlap
from .weight_split import weight_split
from .recompute import recompute
from .order_check import check_collective_order
from .write_check import check_no_writes

__all__ = ["for_plan", "autocast", "shard", "collectives", "localize", "rng", "find_sites", "sequence_parallel", "pipeline", "stage_bounds",
           "overlap", "weight_split", "recompute", "check_collective_order", "check_no_writes"]


def for_plan(plan) -> list:
    """The passes a graph (a whole model, or one pipeline stage) goes through under ``plan``,
    in order: layouts first (collectives and localize read them), localize on the final
    graph, then the sequence-parallel regions become one node each (they hold localized ops),
    overlap on the final order of the nodes, the weight-gradient split (it rewrites the
    matmuls overlap left in place), and recomputation last (its regions hold the final nodes)."""
    out = [shard, collectives, localize, rng]
    if plan.sp:
        out.append(sequence_parallel)
    out.append(overlap)
    if plan.split_backward:
        out.append(weight_split)
    if plan.recompute != "none":
        out.append(recompute)
    return out
