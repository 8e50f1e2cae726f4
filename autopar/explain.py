"""Readable forms of a compiled module: annotated graph text, ``explain()`` and ``dump()``.

Every node prints as one line with its output type and layout, every collective with the
bytes it moves per rank, so a plan can be debugged by reading (and diffing) the text.
``Inspector`` is what a compiled module's ``explain``, ``predict`` and ``dump`` call: the
runtime does not import the front end or the cost model, so compile hands it one.
"""
from __future__ import annotations

import json
import logging
import os
import re

import torch
from torch import fx

from . import meta
from .cost.cluster import cached_local
from .cost.estimate import predict_module, saved_bytes
from .cost.formulas import dp_comm_elements, evaluate, tp_layer_comm_elements
from .cost.memory import model_state_bytes
from .passes.analysis import batch_dependent
from .passes.pipeline import BALANCE_SLACK
from .passes.tensor_parallel import whole_share
from .runtime.optim import optimizer_state_bytes
from .runtime.pipeline_module import PipelineModule
from .runtime.recompute import Recomputed
from .schedule import bubble_formula
from .placement import Layout, Shard
from .sizes import local_size, mixed_state_dtypes, ring_bytes
from .trace import ChromeTrace

__all__ = ["Inspector", "graph_text", "explain", "explain_pipeline", "dump", "dump_pipeline"]


class Inspector:
    """``dm.explain()``, ``dm.predict()`` and ``dm.dump()`` of a compiled module (a
    DistributedModule or a PipelineModule)."""

    def explain(self, dm, cluster=None) -> str:
        return explain_pipeline(dm, cluster) if isinstance(dm, PipelineModule) else explain(dm, cluster)

    def predict(self, dm, cluster="local", global_batch=None, recompute=None):
        return predict_module(dm, cluster, global_batch, recompute)

    def dump(self, dm, path: str, cluster=None) -> list[str]:
        return dump_pipeline(dm, path, cluster) if isinstance(dm, PipelineModule) else dump(dm, path, cluster)

_DT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.int64: "i64",
       torch.int32: "i32", torch.bool: "b8", torch.float64: "f64"}


def _type(val) -> str:
    if isinstance(val, torch.Tensor):
        return f"{_DT.get(val.dtype, str(val.dtype))}[{', '.join(str(s) for s in val.shape)}]"
    if isinstance(val, (tuple, list)):
        return "(" + ", ".join(_type(v) for v in val) + ")"
    return "" if val is None else type(val).__name__


def _target(node: fx.Node) -> str:
    t = node.target
    if node.op == "call_function":
        return str(t) if isinstance(t, torch._ops.OpOverload) else getattr(t, "__name__", str(t))
    return f"{node.op} {t}"


def _arg(a) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (tuple, list)):
        inner = ", ".join(_arg(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    return repr(a)


def graph_text(gm: fx.GraphModule) -> str:
    """One line per node: ``name: type  layout = op(args)   # collective bytes``."""
    lines = []
    for node in gm.graph.nodes:
        if node.op == "output":
            lines.append(f"return {_arg(node.args[0])}")
            continue
        typ = _type(node.meta.get(meta.VAL)) or ("module" if node.op == "get_attr" else "")
        head = f"{node.name}: {typ}"
        lay = node.meta.get(meta.LAYOUT)
        if isinstance(lay, tuple):   # a multi-output node: one layout per output
            head += "  (" + ", ".join(str(x) for x in lay) + ")"
        elif lay is not None:
            head += f"  {lay}"
        args = ", ".join([_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()])
        body = f"self.{node.target}" if node.op == "get_attr" else f"{_target(node)}({args})"
        line = f"{head:<44} = {body}" if node.op != "placeholder" else f"{head:<44} = input"
        if meta.COMM in node.meta:
            line += f"    # {node.meta[meta.COMM]}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def _mb(x: float) -> str:
    return f"{x:,.0f} B ({x / 2**20:.3f} MiB)"


def _shapes_section(dm) -> list[str]:
    """The input shapes the module runs: the compiled ones (what the rest of explain describes)
    and those compiled since, on first call (``autopar.variants``)."""
    others = list(dm.programs)
    line = f"  input shapes (this rank): {tuple(dm.ctx.input_shapes)} as compiled"
    return [line + (f"; also compiled on first call: {', '.join(str(s) for s in others)}" if others else "")]


def explain(dm, cluster=None) -> str:
    """The plan on this rank: its notes, parameters, collectives and bytes per step against the
    formula, memory held against the formula, and the cost model's predicted step."""
    ctx, sync = dm.ctx, dm.sync
    mode, n = dm.plan.dp, dm.mesh.axis_size("dp")
    lines = [f"autopar plan: {dm.plan} on {dm.mesh} (this is rank {dm.mesh.rank})"]
    lines += [f"  {note}" for note in ctx.notes]
    lines += _shapes_section(dm)
    psi = sum(s.numel for s in sync.specs.values())
    psi_pad = sum(s.padded_numel for s in sync.specs.values()) if mode != "ddp" else psi
    lines.append(f"\nparameters: Ψ = {psi:,} trainable elements in {len(sync.specs)} tensors"
                 + (f" ({psi_pad:,} with padding to {n} equal shards)" if psi_pad != psi else ""))
    if dm.plan.tp:
        lines += _tp_section(dm)
    lines += _recompute_section(dm)
    # collectives in the graph and in backward
    lines.append("\ncollectives (per step, this rank):")
    for node in dm.module.graph.nodes:
        if meta.COMM in node.meta:
            what = node.args[-1] if isinstance(node.args[-1], str) else node.name   # the parameter
            lines.append(f"  {what:<28} {node.meta[meta.COMM]}")
    kind = "all_reduce" if mode == "ddp" else "reduce_scatter"
    if mode == "zero3":   # the other modes' buckets are graph nodes, listed above
        for i, b in enumerate(sync.buckets):
            lines.append(f"  bucket {i:<21} backward {kind}[dp] of {len(b.names)} gradients: {', '.join(b.names)}")
    if mode in ("zero1", "zero2"):
        lines.append(f"  optimizer step             all_gather[dp] of the updated shards, {len(sync.buckets)} buckets")
    # volume against the formula
    formula = dp_comm_elements(mode)
    # bytes per element the parameter gathers and the gradient sums move (mixed precision:
    # the compute dtype and the reduce dtype; else both the parameters' own)
    item = next((ctx.params[x].dtype.itemsize for x in sync.specs), 4)
    gi, ri = item, (dm.plan.grad_reduce_dtype.itemsize if dm.plan.mixed else item)
    grads_part = ring_bytes("all_reduce" if mode == "ddp" else "reduce_scatter", psi_pad, n)
    predicted = (evaluate(formula, Psi=psi_pad, N=n) - grads_part) * gi + grads_part * ri
    if dm.plan.mixed:
        lines.append(f"\nbytes per step on dp: formula {formula}, the parameter gathers x {gi} B "
                     f"({_dtype(dm.plan.param_dtype)}), the gradient sums x {ri} B "
                     f"({_dtype(dm.plan.grad_reduce_dtype)}) = {_mb(predicted)}")
    else:
        lines.append(f"\nbytes per step on dp: formula {formula} x {item} B = {_mb(predicted)}")
    measured = dm.comm_stats.total(axis="dp")
    if mode == "zero3":
        lines.append("  (3Ψ counts a backward re-gather of every parameter; autopar gathers again only what "
                     "backward reads, so a table or bias that backward never reads costs 2Ψ_i(N−1)/N)")
    if measured:
        by = {k: v for k, v in dm.comm_stats.bytes.items() if k[0] == "dp"}
        lines.append(f"  measured since the counters were last reset: {_mb(measured)} "
                     "(dm.comm_stats.reset() before a step measures that step)")
        for (axis, k, phase), v in sorted(by.items()):
            dtypes = ", ".join(f"{_mb(b)} {d}" for (a, kk, ph, d), b in sorted(dm.comm_stats.dtype_bytes.items())
                               if (a, kk, ph) == (axis, k, phase))
            lines.append(f"    {phase:<10} {k:<15} {_mb(v)} in {dm.comm_stats.calls[(axis, k, phase)]} calls ({dtypes})")
        if mode == "zero3":
            extra = sum(sync.specs[x].padded_numel for x in sync.saved_in_backward)
            exact = ring_bytes("all_gather", (psi_pad + extra) * gi, n) + ring_bytes("reduce_scatter", psi_pad * ri, n)
            how = (f"((Ψ + Ψ_read_by_backward) x {gi} B + Ψ x {ri} B) (N−1)/N" if gi != ri else
                   f"(2Ψ + Ψ_read_by_backward) (N−1)/N x {item} B")
            lines.append(f"    exact for this graph: {how} = {_mb(exact)} (Ψ_read_by_backward = {extra:,})")
    else:
        lines.append("  measured: no step run yet")
    # memory
    if dm.plan.mixed:
        dts = mixed_state_dtypes(mode, dm.plan.param_dtype.itemsize, dm.plan.master_dtype.itemsize,
                                 dm.plan.grad_reduce_dtype.itemsize)
        lines.append(f"\nper-rank memory of parameters + gradients + AdamW state (mixed precision: "
                     f"{_dtype(dm.plan.param_dtype)} copies forward reads, {dts[0]} B/param persistent; gradients "
                     f"{dts[1]} B; {_dtype(dm.plan.master_dtype)} master + m + v {dts[2]} B):")
        mem = model_state_bytes(mode, dts)
    else:
        lines.append("\nper-rank memory of parameters + gradients + AdamW state (fp32):")
        mem = model_state_bytes(mode)
    lines.append(f"  formula {mem} = {_mb(evaluate(mem, Psi=psi_pad, N=n))}")
    if dm.plan.offload == "optimizer":    # what stays: parameters, gradients, and under mixed precision the masters
        p_b, g_b, k_b = mixed_state_dtypes(mode, dm.plan.param_dtype.itemsize, dm.plan.master_dtype.itemsize,
                                           dm.plan.grad_reduce_dtype.itemsize) if dm.plan.mixed else (4, 4, 8)
        kept = dm.plan.master_dtype.itemsize if dm.plan.mixed else 0
        mem = model_state_bytes(mode, (p_b, g_b, kept))
        lines.append(f"  on the device with the optimizer offloaded ({k_b - kept} B/param of state on the host"
                     + (f"; the {_dtype(dm.plan.master_dtype)} master shards stay" if kept else "")
                     + f"): {mem} = {_mb(evaluate(mem, Psi=psi_pad, N=n))}")
    seen: set = set()
    by_dtype: dict = {}

    def held(tensors) -> int:   # bytes of storages not counted yet (shards can be views of replicas)
        total = 0
        for t in tensors:
            st = t.untyped_storage()
            if t.device.type != "meta" and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
                by_dtype[_dtype(t.dtype)] = by_dtype.get(_dtype(t.dtype), 0) + st.nbytes()
        return total

    params = held(list(dm.parameters()) + list(sync.replicas.values()))
    params_by_dtype = dict(by_dtype)
    grads = held([p.grad for p in dm.parameters() if p.grad is not None] + list(sync.persistent_grads.values()))
    opt = dm.built_optimizer
    line = f"  held now: parameters {_mb(params)}" + (
        f" ({', '.join(f'{_mb(b)} {d}' for d, b in sorted(params_by_dtype.items()))})"
        if len(params_by_dtype) > 1 else "") + \
        f", gradients {_mb(grads)}"
    if opt is not None and dm.offload is not None:
        line += f", optimizer state none (on the host, below); total {_mb(params + grads)}"
    elif opt is not None:
        state = optimizer_state_bytes(opt)
        line += f", optimizer state {_mb(state)}; total {_mb(params + grads + state)}"
    else:
        line += " (no dm.optimizer(...) built yet)"
    lines.append(line)
    lines += offload_section(dm) if cluster is not False else []    # a pipeline's stage: the pipeline's section
    lines += _dtype_section(dm)
    lines += predicted_section(dm, cluster)
    return "\n".join(lines)


def _recompute_section(dm) -> list:
    """Per recomputed region: its layer and kind, what forward keeps for it (its activation
    inputs, with bytes; parameters are kept by reference, or as ZeRO-3 re-gather tokens), what
    backward runs again, and the cost model's bytes of the layer without recomputation."""
    regions = [(node, dm.module.get_submodule(node.target)) for node in dm.module.graph.nodes
               if node.op == "call_module" and isinstance(dm.module.get_submodule(node.target), Recomputed)]
    if dm.plan.recompute == "none" and not regions:
        return []
    head = f"\nactivation recomputation (recompute={dm.plan.recompute!r}): {len(regions)} regions"
    if not regions:
        return [head + ": nothing to recompute (no numbered layer, or no attention core that keeps a·s² "
                "scores: a fused attention kernel keeps none)"]
    batch = batch_dependent(dm.module.graph)
    groups = {g.name: g for g in dm.ctx.profile.groups} if dm.ctx.profile is not None else {}
    share = 1 / dm.mesh.axis_size("dp")
    out = [head + "; per region what forward keeps for backward, and what backward runs again:"]
    for node, mod in regions:
        kept = [a for a in node.all_input_nodes if a in batch and isinstance(a.meta.get(meta.VAL), torch.Tensor)]
        nbytes = sum(_local_bytes(a, dm.mesh) for a in kept)
        ops = [n for n in mod.region.graph.nodes if n.op in ("call_function", "call_module")]
        line = (f"  {mod.layer:<12} {mod.kind:<9} keeps {_mb(nbytes)}: "
                + ", ".join(f"{a.name} {_type(a.meta[meta.VAL])} {a.meta.get(meta.LAYOUT, '')}".rstrip() for a in kept)
                + f"; recomputes {len(ops)} ops ({', '.join(_target(n) for n in ops[:4])}{', ...' if len(ops) > 4 else ''})")
        g = groups.get(mod.layer)
        if g is not None:
            line += (f"; the layer keeps {saved_bytes(g, 'none') * share:,.0f} B without recomputation, "
                     f"{saved_bytes(g, mod.kind) * share:,.0f} B with (cost model)")
        out.append(line)
    return out


def _local_bytes(node: fx.Node, mesh) -> int:
    """Bytes of this rank's piece of a node's value (its global shape divided along the mesh
    axes its layout shards)."""
    val, lay = node.meta[meta.VAL], node.meta.get(meta.LAYOUT)
    n = val.numel()
    if isinstance(lay, Layout):
        for axis, pl in lay.placements:
            if isinstance(pl, Shard):
                n = n * local_size(val.shape[pl.dim], mesh.axis_size(axis), mesh.coordinate(axis)) // val.shape[pl.dim]
    return n * val.element_size()


def offload_section(dm) -> list:
    """``Plan(offload="optimizer")``: what lives on the host, the bytes one step moves over the
    host link (from this rank's tensors: gradients down, parameters up), the host memory held,
    and what ``dm.offload_stats`` measured."""
    if dm.plan.offload is None:
        return []
    off = dm.offload
    if off is None:
        return ["\noptimizer offload: the optimizer's state and step go to the host once dm.optimizer(...) is built"]
    down, up = off.step_bytes()
    elements = sum(p.numel() for p in off.device_params.values())
    opt = dm.built_optimizer
    held = off.host_bytes(opt)
    link = off.link
    itemsize = next(iter(off.device_params.values())).element_size() if off.device_params else 0
    out = [f"\noptimizer offload: the optimizer's copy of this rank's {elements:,} elements "
           f"({len(off.device_params)} tensors), their gradients and the optimizer state live on the host "
           f"({link.host}{', pinned' if link.pinned else ''}); the step runs there",
           f"  host link per step: gradients down {_mb(down)}, parameters up {_mb(up)} (E x {itemsize} B each way: "
           "the device parameters' dtype" + (", the fp32 masters under mixed precision" if dm.plan.mixed else "") + ")",
           _offload_overlap(dm),
           f"  host memory held: {_mb(sum(held.values()))} ("
           + ", ".join(f"{k} {_mb(v)}" for k, v in held.items()) + ")"]
    for (axis, kind, phase), b in sorted(dm.offload_stats.bytes.items()):
        out.append(f"  measured {phase:<10} {kind:<4} {_mb(b)} in {dm.offload_stats.calls[(axis, kind, phase)]} copies")
    return out


def _offload_overlap(dm) -> str:
    """What the host link's copies overlap, as the runtime issues them (``autopar.runtime.offload``;
    the cost model prices the same, ``cost.offload``)."""
    buckets = sum(len(s.buckets) for s in dm.syncs())
    if not buckets:
        down = "no gradient bucket is reduced here, so the gradients go down in the step, before it"
    elif dm.plan.dp == "zero1":
        down = (f"the gradients of each of the {buckets} buckets go down when backward ends, each once its "
                "reduction is waited on, while the later ones finish")
    else:
        down = (f"each of the {buckets} gradient buckets goes down once the next bucket's reduction is issued, "
                "while it is in flight (the last when backward ends)")
    if dm.plan.dp in ("zero1", "zero2"):
        up = ("after the step the parameters come up bucket by bucket, each bucket's replica all-gather issued "
              "as soon as its rows are up, while the next bucket's copy runs")
    else:
        up = "after the step every parameter comes up at once (no gather follows)"
    return f"  overlap: {down}; {up}"


def _dtype_section(dm) -> list:
    """Every axis's measured bytes by collective, phase and dtype (mixed precision: what moves
    in the compute dtype, what sums in the reduce dtype)."""
    rows = sorted((k, b) for k, b in dm.comm_stats.dtype_bytes.items() if b)
    if not rows:
        return []
    out = ["\nbytes by dtype since the counters were last reset (axis, collective, phase):"]
    if dm.plan.mixed:
        out[0] += (f" compute {_dtype(dm.plan.param_dtype)}, gradient sums {_dtype(dm.plan.grad_reduce_dtype)}")
    out += [f"  {axis:<3} {kind:<15} {phase:<10} {dtype:<9} {_mb(b)}" for (axis, kind, phase, dtype), b in rows]
    return out


def _dtype(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def predicted_section(dm, cluster) -> list:
    """The cost model's prediction (``dm.predict``), each cost as its formula and its number;
    without a cluster, the local preset if it was calibrated before (nothing is measured here)."""
    if cluster is False:       # a pipeline stage: the pipeline's own section predicts the step
        return []
    c = cluster if cluster is not None else cached_local()
    if c is None:
        return ["\npredicted step: dm.explain(cluster='local' | 'dgx-h100' | 'dgx-a100-80gb') prints the cost "
                "model's prediction (the local preset needs `python -m autopar calibrate` once: about a minute)"]
    try:
        est = dm.predict(c)
    except Exception as exc:
        return [f"\npredicted step: unavailable ({type(exc).__name__}: {exc})"]
    return ["\npredicted (cost model, dm.predict()):"] + ["  " + x for x in est.explain().splitlines()]


def _tp_section(dm) -> list:
    t = dm.mesh.axis_size("tp")
    out = [f"\ntensor parallel over tp={t}" + (" with sequence parallelism" if dm.plan.sp else "")
           + ": parameter layouts found from the graph"]
    for name, p in dm.ctx.tp_params.items():
        if p.sharded or p.reason.startswith(("read by more", "Plan")):
            out.append(f"  {name:<36} {str(p):<22} {p.reason}")
    whole = sum(1 for p in dm.ctx.tp_params.values() if not p.sharded)
    kept = whole_share(dm.ctx)
    out.append(f"  ({whole} other parameters replicated, {kept.share:.0%} of the trainable parameter bytes; "
               f"largest: {kept.describe()})")
    out.append(f"  per transformer layer per step: {tp_layer_comm_elements()} elements "
               "(2 collectives of b·s·h forward, 2 backward)")
    by = {k: v for k, v in dm.comm_stats.bytes.items() if k[0] == "tp"}
    for (axis, k, phase), v in sorted(by.items()):
        out.append(f"    measured {phase:<10} {k:<15} {_mb(v)} in {dm.comm_stats.calls[(axis, k, phase)]} calls")
    return out


def dump(dm, path: str, cluster=None) -> list[str]:
    """Write every pass's graph, the emitted code and explain() under ``path``; after
    ``dm.record_timeline()``, timeline.json too (measured and predicted lanes per rank)."""
    os.makedirs(path, exist_ok=True)
    for old in os.listdir(path):   # a previous dump's files, so the folder shows this compile only
        if re.fullmatch(r"\d\d_\w+\.(txt|py)|explain\.txt|schedule\.(txt|svg)|(schedule_)?trace\.json|timeline\.json",
                        old):
            os.remove(os.path.join(path, old))
    written = []
    for i, (name, text) in enumerate(dm.ctx.snapshots):
        fn = os.path.join(path, f"{i:02d}_{name}.{'py' if name.endswith('emit') else 'txt'}")
        with open(fn, "w") as f:
            f.write(text)
        written.append(fn)
    fn = os.path.join(path, "explain.txt")
    with open(fn, "w") as f:
        f.write(dm.explain(cluster) + "\n")
    written.append(fn)
    if getattr(dm, "timelines", None):
        written.append(_write_timeline(dm, path, cluster))
    return written


def _write_timeline(dm, path: str, cluster) -> str:
    """timeline.json: the recorded step of every rank (process 2r) and the cost model's
    prediction of the same plan beside it (process 2r + 1; given ``cluster``, or the local
    preset when calibrated)."""
    trace = ChromeTrace()
    for tl in dm.timelines:
        tl.add_lanes(trace, 2 * tl.rank)
    c = cluster if cluster is not None else cached_local()
    if c is not None:
        try:
            dm.predict(c).add_lanes(trace, lambda rank: 2 * rank + 1)
        except Exception as exc:     # the measured lanes are worth writing without a prediction
            logging.getLogger("autopar").warning("autopar: no predicted timeline (%s: %s)", type(exc).__name__, exc)
    fn = os.path.join(path, "timeline.json")
    trace.write(fn)
    return fn


# ---- pipelines ---------------------------------------------------------------------------------

def explain_pipeline(pm, cluster=None) -> str:
    """``explain`` of a pipelined module: the stages, the schedule and its bubble, what was
    sent, the predicted step, then every stage's own ``explain``."""
    ctx, s = pm.ctx, pm.schedule
    lines = [f"autopar plan: {pm.plan} on {pm.mesh} (this is rank {pm.mesh.rank}, pp index {pm.pp_index})"]
    lines += [f"  {note}" for note in ctx.notes]
    lines += _shapes_section(pm)
    lines.append(f"\npipeline: {len(ctx.stages)} stages over pp={s.p} ({s.v} per rank), {s.m} micro-batches of "
                 f"{ctx.microbatch_rows} rows; cut by forward FLOPs within {BALANCE_SLACK:.0%} of the best "
                 "balance, then where the fewest activation bytes cross")
    for spec in ctx.stages:
        lines.append(f"  rank {spec.index % s.p}: {spec}")
    sim = pm.simulate()
    lines.append(f"\nschedule {s.name} (this rank: {' '.join(str(a) for a in s.ranks[pm.pp_index])})")
    lines.append(f"  simulated bubble (unit costs) {sim.bubble_fraction():.4f}; formula {bubble_formula(s.name, s.p, s.m, s.v)}")
    if pm.timeline:
        busy = sum(b - a for _, a, b in pm.timeline)
        lines.append(f"  last step on this rank: {pm.step_time * 1e3:.1f} ms, busy {busy * 1e3:.1f} ms "
                     f"({1 - busy / pm.step_time:.3f} idle)")
    sent = {k: v for k, v in (pm.comm_stats.bytes.items() if pm.comm_stats else []) if k[0] == "pp"}
    for (axis, k, phase), v in sorted(sent.items()):
        lines.append(f"  sent point to point, {phase}: {_mb(v)} in {pm.comm_stats.calls[(axis, k, phase)]} messages")
    lines += offload_section(pm)
    lines += predicted_section(pm, cluster)
    for k, st in pm.stages.items():
        lines.append(f"\n---- stage {k} ----")
        lines.append(st.explain(cluster=False))
    return "\n".join(lines)


def dump_pipeline(pm, path: str, cluster=None) -> list[str]:
    """``dump`` plus the schedule (text, SVG picture of the simulated timeline) and a Chrome trace
    of the last measured step (trace.json, every pipeline rank; collective over pp)."""
    written = dump(pm, path, cluster)
    sim = pm.simulate()
    files = {"schedule.txt": f"{pm.schedule}\n\nsimulated (unit costs):\n{sim.to_text()}\n",
             "schedule.svg": sim.to_svg(),
             "schedule_trace.json": json.dumps(sim.chrome_trace())}
    trace = pm.measured_trace()
    if any(e.get("ph") == "X" for e in trace["traceEvents"]):
        files["trace.json"] = json.dumps(trace)
    for name, text in files.items():
        fn = os.path.join(path, name)
        with open(fn, "w") as f:
            f.write(text)
        written.append(fn)
    return written
