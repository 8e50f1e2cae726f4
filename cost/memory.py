"""Memory per rank as formulas: model states per ZeRO stage, activations per transformer
layer, and the micro-batches a pipeline schedule keeps in flight.

Model states (Rajbhandari et al., "ZeRO", SC'20, section 3 and figure 1): with Ψ parameters
held as ``param_bytes`` each, gradients as ``grad_bytes`` and K bytes of optimizer state per
parameter (mixed-precision Adam: fp32 master copy, momentum and variance, K = 12; plain
fp32 Adam: K = 8), over N data-parallel ranks:

    ddp    (p + g + K)·Ψ
    zero1  (p + g)·Ψ + K·Ψ/N
    zero2  p·Ψ + (g + K)·Ψ/N
    zero3  (p + g + K)·Ψ/N

Activations of one transformer layer (Korthikanti et al., "Reducing Activation Recomputation
in Large Transformer Models", MLSys 2023, section 4 and table 2), for sequence s, micro-batch
b, hidden h, a heads, tensor-parallel size t, in 16-bit with dropout (bytes):

    no parallelism                 s·b·h·(34 + 5·a·s/h)
    tensor parallel                s·b·h·(10 + 24/t + 5·a·s/(h·t))
    tensor + sequence parallel     s·b·h/t·(34 + 5·a·s/h)
    selective recomputation        the 5·a·s/h term is recomputed, not stored
    full recomputation             2·s·b·h (only the layer's input; /t with sequence parallel)

Flash attention (Dao et al., 2022) never materialises the a·s² scores, which removes the
5·a·s/h term as selective recomputation does.

The micro-batches a pipeline schedule keeps in flight are ``autopar.sizes.inflight_microbatches``.
"""
from __future__ import annotations

import sympy as sp

from autopar.sizes import state_bytes

from .formulas import N, PSI

__all__ = ["S", "B", "H", "A", "T", "model_state_bytes", "persistent_bytes", "activation_bytes_per_layer",
           "MIXED_PRECISION", "FP32"]

S, B, H, A, T = sp.symbols("s b h a t", positive=True)

# bytes per parameter of (parameter, gradient, optimizer state)
MIXED_PRECISION = (2, 2, 12)   # bf16/fp16 parameters and gradients, fp32 master + Adam m, v
FP32 = (4, 4, 8)               # fp32 parameters and gradients, Adam m, v


def model_state_bytes(mode: str, dtypes: tuple[int, int, int] = FP32) -> sp.Expr:
    """Per-rank bytes of parameters + gradients + optimizer state (formula in the module
    docstring; ``autopar.sizes.state_bytes``) as a sympy expression in Ψ and N."""
    return state_bytes(mode, PSI, N, dtypes)


def persistent_bytes(mode: str, psi, n, dtypes: tuple[int, int, int] = FP32, padded_psi=None):
    """Bytes one rank holds between steps (gradients set to None): ``state_bytes`` without the
    gradients (parameters, ZeRO-3's as padded shards; optimizer state, sharded from ZeRO-1 on)
    plus ZeRO-1's persistent full-gradient buffer (padded)."""
    p, g, k = dtypes
    pad = psi if padded_psi is None else padded_psi
    return state_bytes(mode, psi, n, (p, 0, k), padded_psi=pad) + (g * pad if mode == "zero1" else 0)


def activation_bytes_per_layer(*, tp: bool = False, sp_: bool = False, recompute: str = "none",
                               flash: bool = False) -> sp.Expr:
    """Korthikanti et al.'s table 2 (see the module docstring) as a sympy expression in s, b,
    h, a, t. ``recompute`` is ``none``, ``selective`` or ``full``."""
    t = T if tp else 1
    if recompute == "full":
        return 2 * S * B * H / (t if sp_ else 1)
    quadratic = 0 if (flash or recompute == "selective") else 5 * A * S / H
    if recompute not in ("none", "selective"):
        raise ValueError(f"recompute={recompute!r}: expected none, selective or full")
    if sp_:
        return S * B * H / t * (34 + quadratic)
    return S * B * H * (10 + 24 / t + quadratic / t)
