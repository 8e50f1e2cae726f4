"""autopar's cost model: symbolic (sympy) formulas, numbers only when evaluated.

``cost`` depends on nothing distributed: it speaks of sizes, ranks and dtypes.
"""
from .formulas import (B, H, N, PSI, S, T, dp_comm_elements, evaluate, tp_layer_comm_elements,
                       zero_memory_bytes)

__all__ = ["N", "PSI", "B", "S", "H", "T", "dp_comm_elements", "tp_layer_comm_elements",
           "zero_memory_bytes", "evaluate"]
