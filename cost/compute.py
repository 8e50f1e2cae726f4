"""Compute cost of one graph node: floating-point operations of its forward.

The pipeline pass balances stages by these counts (backward costs about twice the forward
of the same node, so forward FLOPs are proportional to a stage's whole work). Sources:
Kaplan et al., "Scaling Laws for Neural Language Models" (2020), section 2.1 (a matmul of an
m×k by a k×n matrix is 2·m·n·k FLOPs); attention scores and their product with V are
2·b·h·s·t·d each (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", SC'21, appendix). Other ops count one operation per output
element, and ops that only reinterpret a tensor (views, transposes, indexing) count nothing.
"""
from __future__ import annotations

import math

import torch

__all__ = ["node_flops", "value_bytes"]

_MATMULS = {"linear", "mm", "bmm", "matmul", "addmm", "baddbmm"}
_FREE = {"view", "_unsafe_view", "reshape", "transpose", "t", "permute", "expand", "unsqueeze",
         "squeeze", "split", "split_with_sizes", "chunk", "unbind", "slice", "select", "alias",
         "detach", "getitem", "contiguous", "flatten", "unflatten", "arange", "zeros", "ones",
         "full", "empty", "lift_fresh_copy", "_to_copy", "clone", "dropout"}


def _op_name(target) -> str:
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0]


def _val(x):
    return x.meta.get("val") if hasattr(x, "meta") else None


def value_bytes(val) -> int:
    """Bytes of a node's value (a tensor, or the tensors of a tuple)."""
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(value_bytes(v) for v in val)
    return 0


def node_flops(node) -> int:
    """Forward FLOPs of an FX node of the captured ATen graph (0 for placeholders, parameters
    and pure views)."""
    if node.op != "call_function":
        return 0
    name = _op_name(node.target)
    out = _val(node)
    if name in _FREE or not isinstance(out, torch.Tensor):
        return 0
    if name in _MATMULS:
        a = _val(node.args[1] if name in ("addmm", "baddbmm") else node.args[0])
        k = a.shape[-1] if isinstance(a, torch.Tensor) and a.dim() else 1
        return 2 * out.numel() * k
    if name in ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                "_scaled_dot_product_efficient_attention"):
        q, k = _val(node.args[0]), _val(node.args[1])
        *batch, s, d = q.shape
        return 4 * math.prod(batch) * s * k.shape[-2] * d
    return out.numel()
