"""autopar's cost model: symbolic (sympy) formulas, numbers only when evaluated.

``cost`` depends on nothing distributed: it speaks of sizes, ranks and dtypes.
"""
from .formulas import (N, PSI, dp_comm_elements, zero_memory_bytes, evaluate)

__all__ = ["N", "PSI", "dp_comm_elements", "zero_memory_bytes", "evaluate"]
