"""autopar's graph passes: each ``(GraphModule, CompileContext) -> GraphModule``, run in order
by ``autopar.compile``."""
from .shard import shard
from .collectives import collectives
from .localize import localize
from .sequence_parallel import sequence_parallel
from .pipeline import pipeline
from .overlap import overlap

__all__ = ["shard", "collectives", "localize", "sequence_parallel", "pipeline", "overlap"]
