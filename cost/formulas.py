"""Communication volume and memory of the data-parallel modes, as sympy expressions.

Ψ is the parameter count, N the data-parallel group size. Sources: Rajbhandari et al.,
"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (SC'20), section 7
(communication) and figure 1 (memory, written there for mixed precision with K = 12).
"""
from __future__ import annotations

import sympy as sp

PSI, N = sp.symbols("Psi N", positive=True)

B, S, H, T = sp.symbols("b s h t", positive=True)

__all__ = ["PSI", "N", "B", "S", "H", "T", "dp_comm_elements", "tp_layer_comm_elements",
           "zero_memory_bytes", "evaluate"]


def dp_comm_elements(mode: str) -> sp.Expr:
    """Elements each rank sends per training step (ring algorithms).

    ddp:          all-reduce of the gradients                      2Ψ(N−1)/N
    zero1, zero2: reduce-scatter of gradients + all-gather of params  Ψ(N−1)/N + Ψ(N−1)/N
    zero3:        all-gather in forward, again in backward, reduce-scatter  3Ψ(N−1)/N
    """
    k = {"ddp": 2, "zero1": 2, "zero2": 2, "zero3": 3}[mode]
    return k * PSI * (N - 1) / N


def tp_layer_comm_elements(sp_: bool = False) -> sp.Expr:
    """Elements each rank sends per transformer layer per training step on the tp axis.

    Megatron tensor parallelism (Shoeybi et al., "Megatron-LM", 2019, section 3: f and g):
    2 all-reduces of the b·s·h activations in forward, 2 in backward, each 2(t−1)/t·bsh on a
    ring: 8·b·s·h·(t−1)/t. Sequence parallelism (Korthikanti et al., "Reducing Activation
    Recomputation in Large Transformer Models", 2022, section 4.2.2) replaces each
    all-reduce by a reduce-scatter and an all-gather of (t−1)/t·bsh each: the same volume
    (plus, as there, one all-gather per column input in backward when those inputs are kept
    as sequence shards: 2·b·s·h·(t−1)/t more, not counted here).
    """
    return 8 * B * S * H * (T - 1) / T


def zero_memory_bytes(mode: str, param_bytes: int = 4, grad_bytes: int = 4,
                      optim_bytes: int = 8) -> sp.Expr:
    """Per-rank bytes of parameters + gradients + optimizer state after a step.

    With fp32 parameters and gradients and Adam's two fp32 moments (4 + 4 + 8 bytes):
    ddp 16Ψ, zero1 8Ψ + 8Ψ/N, zero2 4Ψ + 12Ψ/N, zero3 16Ψ/N.
    """
    p, g, o = param_bytes * PSI, grad_bytes * PSI, optim_bytes * PSI
    return {"ddp": p + g + o, "zero1": p + g + o / N, "zero2": p + (g + o) / N,
            "zero3": (p + g + o) / N}[mode]


def evaluate(expr: sp.Expr, **values) -> float:
    """Number of ``expr`` with ``Psi=..., N=...``."""
    return float(expr.subs({sp.Symbol(k, positive=True): v for k, v in values.items()}))
