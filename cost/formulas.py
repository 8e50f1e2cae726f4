"""Communication volume per step of the data-parallel modes and of a tensor-parallel layer,
as sympy expressions (memory per ZeRO stage: ``cost.memory.model_state_bytes``).

Ψ is the parameter count, N the data-parallel group size. Source: Rajbhandari et al.,
"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (SC'20), section 7.
"""
from __future__ import annotations

import sympy as sp

from autopar.sizes import ring_bytes

PSI, N = sp.symbols("Psi N", positive=True)

B, S, H, T = sp.symbols("b s h t", positive=True)

__all__ = ["PSI", "N", "B", "S", "H", "T", "dp_comm_elements", "tp_layer_comm_elements", "evaluate"]


def dp_comm_elements(mode: str) -> sp.Expr:
    """Elements each rank sends per training step (ring algorithms).

    ddp:          all-reduce of the gradients                      2Ψ(N−1)/N
    zero1, zero2: reduce-scatter of gradients + all-gather of params  Ψ(N−1)/N + Ψ(N−1)/N
    zero3:        all-gather in forward, again in backward, reduce-scatter  3Ψ(N−1)/N
    """
    kinds = {"ddp": ("all_reduce",), "zero1": ("reduce_scatter", "all_gather"),
             "zero2": ("reduce_scatter", "all_gather"), "zero3": ("all_gather", "all_gather", "reduce_scatter")}
    if mode not in kinds:
        raise ValueError(f"unknown data-parallel mode {mode!r}; expected ddp, zero1, zero2 or zero3")
    return sum(ring_bytes(kind, PSI, N) for kind in kinds[mode])


def tp_layer_comm_elements() -> sp.Expr:
    """Elements each rank sends per transformer layer per training step on the tp axis.

    Megatron tensor parallelism (Shoeybi et al., "Megatron-LM", 2019, section 3: f and g):
    2 all-reduces of the b·s·h activations in forward, 2 in backward, each 2(t−1)/t·bsh on a
    ring: 8·b·s·h·(t−1)/t. Sequence parallelism (Korthikanti et al., "Reducing Activation
    Recomputation in Large Transformer Models", 2022, section 4.2.2) replaces each
    all-reduce by a reduce-scatter and an all-gather of (t−1)/t·bsh each: the same volume
    (plus, as there, one all-gather per column input in backward when those inputs are kept
    as sequence shards: 2·b·s·h·(t−1)/t more, not counted here).
    """
    return 4 * ring_bytes("all_reduce", B * S * H, T)


def evaluate(expr: sp.Expr, **values) -> float:
    """Number of ``expr`` with ``Psi=..., N=...``."""
    return float(expr.subs({sp.Symbol(k, positive=True): v for k, v in values.items()}))
