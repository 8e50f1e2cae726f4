"""Sharding rules: for each ATen op, the layouts it can run in along one mesh axis.

``registry`` holds the table and its data types; one file per op family fills it by
decorator (importing them here is what registers them); ``validate`` checks every rule
by brute force on small tensors. Usage::

    info = OpInfo.from_node(node)            # node.meta["val"] carries FakeTensors
    for s in strategies_for(info, n=4):      # None: the op has no rule
        print(s)                             # e.g. "S(0),R -> S(0)"
"""
from .registry import (LOCALIZERS, RULES, OpInfo, Strategy, TensorMeta, format_placement, local_size, localize,
                       register, register_localize, rule_for, shrink, strategies_for, tensor_inputs)
from . import (attention, conv, embedding, factory, index, loss, matrix, moe, pointwise,  # noqa: F401
               reduction, scalar, spatial, view)
from . import search  # noqa: F401  (registers the strategy search for ops without a rule)

__all__ = ["TensorMeta", "OpInfo", "Strategy", "RULES", "LOCALIZERS", "register", "format_placement",
           "register_localize", "rule_for", "strategies_for", "localize", "local_size", "tensor_inputs",
           "shrink"]
