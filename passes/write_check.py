"""write_check: after the passes, no op of a rank's program writes into a tensor in place.

A write is kept correct only where its readers share the written storage. capture makes the
model's program pure (``autopar.functionalize``: every in-place op and every write into a view
becomes an out-of-place op whose result the later readers read), refuses writes into the
model's inputs and buffers, and the passes insert only pure ops and runtime callables. So a
write found here would be one whose readers may read another storage (a copy made by a
redistribution, a stage boundary, a sequence-parallel region): it is refused, naming the node,
rather than run as a program that might read memory nobody wrote.
"""
from __future__ import annotations

from torch import fx

from autopar.context import CompileContext
from autopar.functionalize import writes_into

__all__ = ["check_no_writes"]


def check_no_writes(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    """``gm`` unchanged when none of its nodes writes into an argument; else an error naming
    the first such node and what it writes."""
    for node in gm.graph.nodes:
        written = writes_into(node)
        if written:
            where = node.meta.get("stack_trace", "").strip().splitlines()
            raise NotImplementedError(
                f"node {node.name} ({node.target}) writes in place into {written[0].name} after autopar's "
                f"passes (plan {ctx.plan}); under this layout its readers may read another copy of that "
                f"tensor, so the program could read values nobody wrote. "
                + (f"The write comes from: {where[-1].strip()}. " if where else "")
                + "Write the value out of place in the model (y = x.masked_fill(...), torch.cat or "
                  "slice_scatter instead of a copy_ into a slice), then compile again")
    return gm
