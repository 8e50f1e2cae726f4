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

What a plan's runtime keeps, per parameter, is ``precision(plan, param_bytes)``: the plan's
dtypes, not the cluster's. Without ``param_dtype`` everything is in the model's own dtype
(fp32: p, g, K = 4, 4, 8 = 16Ψ under ddp). Under ``param_dtype`` the optimizer owns masters in
``master_dtype`` and forward reads ``param_dtype`` copies (``autopar.sizes.mixed_state_dtypes``:
ZeRO-3 with bf16 compute and fp32 masters keeps (0 + 4 + 12)·Ψ/N = 16Ψ/N, its gathered copies
transient; ZeRO's accounting, ``MIXED_PRECISION``, counts (2 + 2 + 12)·Ψ/N).
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from autopar.sizes import mixed_state_dtypes, state_bytes

from .formulas import N, PSI

__all__ = ["S", "B", "H", "A", "T", "model_state_bytes", "persistent_bytes", "activation_bytes_per_layer",
           "MIXED_PRECISION", "FP32", "Precision", "precision"]

S, B, H, A, T = sp.symbols("s b h a t", positive=True)

# bytes per parameter of (parameter, gradient, optimizer state) as ZeRO's paper counts them
MIXED_PRECISION = (2, 2, 12)   # bf16/fp16 parameters and gradients, fp32 master + Adam m, v
FP32 = (4, 4, 8)               # fp32 parameters and gradients, Adam m, v


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each copy of the parameters and gradients a plan's runtime makes
    (``precision``)."""
    compute: int
    """Forward's parameter copies (ZeRO-3's gathers, ZeRO-1/2's replicas and their all-gather),
    the gradients autograd makes, and the element size the reducer cuts buckets by."""
    reduce: int
    """Gradient sums on the dp axis (buckets' all-reduce / reduce-scatter; a pipeline's
    micro-batch gradients accumulate in it)."""
    states: tuple
    """(p, g, K) for ``autopar.sizes.state_bytes``: what persists, as the runtime keeps it (g:
    the gradient as it lands)."""
    master: int = 0
    """Mixed precision: the optimizer's master copy (part of K); 0 without ``param_dtype``."""

    @property
    def mixed(self) -> bool:
        return self.master > 0

    @property
    def landed(self) -> int:
        """Bytes of a reduced gradient as it lands (``states``' g)."""
        return self.states[1]


def precision(plan, mode: str, param_bytes: int) -> Precision:
    """What ``plan``'s runtime keeps under data-parallel ``mode`` of a model whose parameters
    are ``param_bytes`` each: without ``plan.param_dtype`` everything in the parameters' dtype
    and Adam's m and v beside them, (s, s, 2s); with it, the compute copies in
    ``param_dtype``, sums in ``plan.grad_reduce_dtype``, and ``mixed_state_dtypes``' states,
    Adam's m and v in the master's dtype (``plan.master_dtype``)."""
    if not plan.mixed:
        return Precision(param_bytes, param_bytes, (param_bytes, param_bytes, 2 * param_bytes))
    c, m, r = plan.param_dtype.itemsize, plan.master_dtype.itemsize, plan.grad_reduce_dtype.itemsize
    return Precision(c, r, mixed_state_dtypes(mode, c, m, r, optimizer=2 * m), master=m)


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
