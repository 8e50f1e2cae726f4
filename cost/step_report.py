"""The formulas an estimate shows (``Estimate.formulas``): each of the step's main terms as
(what, formula, value), and the host link's totals under ``Plan(offload="optimizer")``."""
from __future__ import annotations

from autopar.planspec import Plan
from autopar.schedule import bubble_formula

from .compute import GROUP_TIME_FORMULA, dispatch_ops, group_time
from .formulas import dp_comm_elements, tp_layer_comm_elements
from .memory import Precision, model_state_bytes
from .offload import host_bytes_per_element, host_link_bytes, host_link_formula
from .profile import GroupCost, is_layer
from .step_layout import StepLayout
from .step_time import StepEnd

__all__ = ["host_link_totals", "step_formulas"]


def host_link_totals(s: StepLayout, syncs: list) -> tuple:
    """``Plan(offload="optimizer")``: (bytes over the host link per step, host memory the
    optimizer's copy and state hold, the formula) of the busiest rank."""
    pr, S, p, c = s.pr, s.S, s.p, s.c
    per_rank_host = [sum(sum(host_link_bytes(syncs[k].opt_elements, pr)) for k in range(S) if k % p == r)
                     for r in range(p)]
    host_bytes = max(per_rank_host)
    host_memory = max(sum(host_bytes_per_element(pr) * syncs[k].opt_elements for k in range(S)
                          if k % p == r) for r in range(p))
    formula = ("host link bytes / step (offload)", f"{host_link_formula(s.plan.dp, pr)} (gradients "
               f"down as they land, parameters up; ZeRO's Psi/N padded"
               f"{'; fp32 masters stay on the device, so 4 B each way' if pr.mixed else ''})",
               f"{host_bytes:,.0f} B over {c.host.name} at {c.host.bandwidth / 1e9:.1f} GB/s")
    return host_bytes, host_memory, formula


def step_formulas(s: StepLayout, end: StepEnd, st: float, act: float, psi_total: int, by_axis: dict,
                  bubble: float, host_formula) -> list:
    """(what, formula, value) of the step's main terms, evaluated."""
    plan, c, pr, mode, slow = s.plan, s.c, s.pr, s.plan.dp, s.slow
    lay = _first_layer(s.groups)
    out = [("forward compute / layer / micro-batch",
            GROUP_TIME_FORMULA + (" (x slowdown of ranks sharing cores)" if slow > 1 else ""),
            f"{lay.dense_flops:,.0f} FLOP, {lay.attention_flops:,.0f} FLOP, {lay.attention_heads:,.0f} "
            f"slices, {lay.pointwise_bytes:,.0f} B, {lay.ops} ops"
            + (f" (weighing {dispatch_ops(lay, c.device):.1f} by their measured dispatch)"
               if c.device.op_weights else "")
            + f" -> {group_time(lay, c) * 1e3:.4g} ms"
            + (f" x {slow:.2f}" if slow > 1 else "")),
           _precision_formula(plan, pr, lay, c),
           (f"model states ({mode}, {_precision_name(plan, pr)}"
            f"{', optimizer state on the host' if plan.offload else ''})",
            str(model_state_bytes(mode, end.pr_device.states)), f"{st:,.0f} B at Psi={psi_total:,} (sharded "
            f"terms padded to N equal chunks), N={s.n}")]
    if host_formula is not None:
        out.append(host_formula)
    out.append(("activations", f"saved per micro-batch x in-flight ({plan.pp_schedule or 'no pipeline'})",
                f"{act:,.0f} B"))
    if s.t > 1:
        out.append(("tp bytes / layer / micro-batch", f"{tp_layer_comm_elements()} x element bytes (+ sp re-gather)",
                    f"{sum(b for _, b, _ in lay.tp_forward):,.0f} B fwd"))
    if s.n > 1:
        out.append((f"dp elements / step ({mode})", str(dp_comm_elements(mode)), f"{by_axis.get('dp', 0):,.0f} B"))
    if s.p > 1:
        out.append(("bubble", bubble_formula(plan.pp_schedule, s.p, s.m, s.v) + " for equal stages;",
                    f"{bubble:.4f} replayed with these stages' times and transfers"))
    return out


def _first_layer(groups):
    return next((g for g in groups if is_layer(g.name)), groups[0])


def _precision_name(plan: Plan, pr: Precision) -> str:
    """The plan's precision in words: ``mixed precision: bfloat16 compute, float32 masters,
    float32 sums``, or without ``param_dtype`` the model's own (``float32 throughout``)."""
    def name(dtype):
        return str(dtype).removeprefix("torch.")
    if plan.mixed:
        return (f"mixed precision: {name(plan.param_dtype)} compute, {name(plan.master_dtype)} masters, "
                f"{name(plan.grad_reduce_dtype)} sums")
    return {4: "float32", 2: "16-bit", 8: "float64"}.get(pr.compute, f"{pr.compute}-byte") + " throughout"


def _precision_formula(plan: Plan, pr: Precision, g: GroupCost, c) -> tuple:
    """(what, formula, value) of the bytes per element each copy is priced at and the matmul peak
    of the dtype the layers compute in."""
    dtype = g.matmul_dtype
    peak = c.device.matmul_peak(dtype)
    return (f"precision ({_precision_name(plan, pr)})",
            "bytes/element: compute copies & gathers, gradient sums, (p, g, K) kept; matmul peak of the compute dtype",
            f"{pr.compute} B, {pr.reduce} B, {pr.states}; {str(dtype or 'bf16').removeprefix('torch.')} matmuls at "
            f"{peak / 1e12:.4g} TFLOP/s peak x {c.device.matmul_efficiency}")


