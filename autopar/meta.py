"""The ``node.meta`` keys autopar's passes read and write, and the names of the attributes the
emitted module holds, declared in one place.

Values stored under these keys are frozen dataclasses or plain values, so a graph's
annotations can be printed, compared and diffed.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["VAL", "LAYOUT", "PARAM", "COMM", "SOURCE", "STRATEGY", "LOWER", "FLASH", "CommInfo",
           "SYNC", "COMM_TP", "REPLICAS", "STASH", "RNG_SITE", "RNG", "KV_HEADS", "VAL_LOCK", "ORIGIN",
           "AUTOCAST", "AutocastRegion"]

VAL_LOCK = threading.RLock()
"""held while a pass computes new ``VAL`` fake tensors by running ops on the graph's: torch's
fake tensor mode is not thread-safe, and ranks simulated by threads (``autopar.verify``)
compile programs that share one mode (the export cache hands them one captured program)"""

# ---- node.meta keys ------------------------------------------------------------------------------
VAL = "val"                 # torch.export's FakeTensor (shape, dtype) of the node's output
LAYOUT = "autopar_layout"   # autopar.placement.Layout of the node's output
PARAM = "autopar_param"     # canonical parameter name (original model's qualified name) of a get_attr
COMM = "autopar_comm"       # CommInfo of a collective node (kind, axis, bytes)
SOURCE = "stack_trace"      # torch.export's source location of the node
ORIGIN = (SOURCE, "nn_module_stack")   # where a node came from: a node inserted in its place takes these
STRATEGY = "autopar_strategy"  # {mesh axis: passes.rules.Strategy} the shard pass chose for a node
LOWER = "autopar_lower"     # name of the tp lowering that replaces an op (vocabulary parallelism)
RNG_SITE = "autopar_rng_site"  # index of a random site (dropout) in the single-device forward's draw order
FLASH = "autopar_flash"     # cost model: an attention node runs as a fused kernel (no a·s² scores kept)
KV_HEADS = "autopar_kv_heads"  # an index_select reading each tp rank's k/v heads (passes/kv_heads.py): dim of the heads
AUTOCAST = "autopar_autocast"  # the model's own torch.autocast blocks a node ran in: AutocastRegions, outermost first

# ---- attributes of the emitted module that graph nodes read (get_attr) ---------------------------
SYNC = "sync_dp"            # the runtime's DataParallelSync of the dp axis
COMM_TP = "comm_tp"         # the runtime's AxisComm of the tp axis
REPLICAS = "replicas"       # ZeRO-1/2: submodule holding the full parameter replicas
RNG = "rng_masks"           # the runtime's RandomMasks: this graph's slices of the dropout masks
STASH = "wgrad_stash"       # zero-bubble: the WeightGradStash of the deferred weight gradients


@dataclass(frozen=True)
class CommInfo:
    """What a collective node of the graph does, for dumps and explain()."""
    kind: str          # all_gather | reduce_scatter | all_reduce
    axis: str
    nbytes: float      # per rank, per call
    phase: str = "forward"
    then: str = ""     # what else it causes (its conjugate in backward, its bucket)

    def __str__(self) -> str:
        then = f"; {self.then}" if self.then else ""
        return f"{self.phase} {self.kind}[{self.axis}] {self.nbytes:,.0f} B/rank{then}"


@dataclass(frozen=True)
class AutocastRegion:
    """A ``with torch.autocast(device_type, dtype, enabled=...)`` block of the model's forward:
    capture inlines the ``wrap_with_autocast`` higher-order op torch.export makes of it, and
    marks each node it held (``AUTOCAST``), so that the autocast pass casts it as that block
    does."""
    device_type: str
    dtype: object      # torch.dtype
    enabled: bool

    def __str__(self) -> str:
        return f"autocast({self.device_type}, {str(self.dtype).removeprefix('torch.')}, enabled={self.enabled})"
