"""What autopar knows about an ATen op from its name: its class, its forward FLOPs, its bytes.

The pipeline pass balances stages by ``node_flops``; the cost model's profile sorts ops into
the classes of its roofline (matmuls, attention, the rest) and its table of saved tensors.
Both read the classes below, so that an op is, for instance, attention in both or in neither.

FLOPs (Kaplan et al., "Scaling Laws for Neural Language Models", 2020, section 2.1): a matmul
of an m×k by a k×n matrix is 2·m·n·k; attention's scores and their product with V are
2·b·h·s·t·d each (Narayanan et al., SC'21, appendix); other ops one per output element; ops
that only reinterpret or create a tensor (views, indexing, factories, copies) nothing.
"""
from __future__ import annotations

import math

import torch
from torch import fx

__all__ = ["op_name", "dropout_p", "random_site", "MATMULS", "VIEWS", "FREE", "ATTENTION", "NORMS", "LOSSES", "KEEP_INPUT", "KEEP_OUTPUT", "KEEP_OPERANDS",
           "node_flops", "value_bytes"]

MATMULS = frozenset({"linear", "mm", "bmm", "matmul", "addmm", "baddbmm"})
VIEWS = frozenset({"view", "_unsafe_view", "reshape", "transpose", "t", "permute", "expand", "unsqueeze",
                   "squeeze", "split", "split_with_sizes", "chunk", "unbind", "slice", "select", "alias",
                   "detach", "getitem", "contiguous", "flatten", "unflatten", "movedim", "narrow", "as_strided"})
"""Ops whose result aliases an input (or, for ``contiguous``, usually does): no arithmetic."""
FREE = VIEWS | frozenset({"arange", "zeros", "ones", "full", "empty", "lift_fresh_copy", "_to_copy", "clone",
                          "dropout"})
"""Ops counted as no FLOPs: views, factories and copies (and dropout's mask, a copy's cost)."""
ATTENTION = frozenset({"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                       "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu"})
NORMS = frozenset({"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm", "batch_norm"})
LOSSES = frozenset({"cross_entropy", "cross_entropy_loss", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss",
                    "tp_vocab_cross_entropy"})
KEEP_INPUT = frozenset({"gelu", "silu", "pow", "sin", "cos", "log", "abs", "square"})
"""Pointwise ops whose backward formula reads their input (autograd's derivatives.yaml; a sum,
a mean and a negation read none; a product and a quotient are ``KEEP_OPERANDS``)."""
KEEP_OUTPUT = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax", "exp", "sigmoid", "tanh", "rsqrt",
                         "relu", "sqrt"})
"""Ops whose backward formula reads their output."""
KEEP_OPERANDS = frozenset({"mul", "div"})
"""Products and quotients: the gradient of one operand reads the other, so autograd keeps an
operand only when the other one needs a gradient (``x * cos`` keeps ``cos``, not ``x``; a
quotient's divisor is kept for the dividend's gradient)."""


def op_name(target) -> str:
    """``aten.linear.default`` -> ``linear``; a Python function -> its name."""
    return getattr(target, "__name__", str(target)).split(".")[0]


def _val(x):
    return x.meta.get("val") if isinstance(x, fx.Node) else None


def value_bytes(val) -> int:
    """Bytes of a node's value (a tensor, or the tensors of a tuple)."""
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(value_bytes(v) for v in val)
    return 0


def node_flops(node: fx.Node) -> int:
    """Forward FLOPs of a node of the captured ATen graph (0 for placeholders, parameters and
    the ``FREE`` ops)."""
    if node.op != "call_function":
        return 0
    name = op_name(node.target)
    if name in FREE:
        return 0
    if name in ATTENTION:
        q, k = _val(node.args[0]), _val(node.args[1])
        *batch, s, d = q.shape
        return 4 * math.prod(batch) * s * k.shape[-2] * d
    out = _val(node)
    if not isinstance(out, torch.Tensor):
        return 0
    if name in MATMULS:
        a = _val(node.args[1] if name in ("addmm", "baddbmm") else node.args[0])
        k = a.shape[-1] if isinstance(a, torch.Tensor) and a.dim() else 1
        return 2 * out.numel() * k
    return out.numel()


def dropout_p(node: fx.Node) -> float:
    """The drop probability of a dropout or attention node (its ``p`` / ``dropout_p``)."""
    if node.target is torch.ops.aten.dropout.default:
        return float(node.args[1])
    return float(node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0))


def random_site(node: fx.Node) -> str | None:
    """``"dropout"`` or ``"sdpa"`` for a node that draws a dropout mask (training, p > 0), else
    None: the sites whose masks autopar reproduces (``passes/rng.py``), and what the train and
    eval graphs may differ in (``autopar.capture``)."""
    if node.op != "call_function":
        return None
    if node.target is torch.ops.aten.dropout.default:
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        return "dropout" if train and dropout_p(node) > 0 else None
    if node.target is torch.ops.aten.scaled_dot_product_attention.default:
        return "sdpa" if dropout_p(node) > 0 else None
    return None
