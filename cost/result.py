"""The cost model's answer for one plan (``autopar.estimate``, ``dm.predict``): ``Estimate``, its
predicted step time, memory and bytes per rank, with the formulas and the simulated timeline."""
from __future__ import annotations

from dataclasses import dataclass, field

from autopar.planspec import Plan
from autopar.trace import ChromeTrace

__all__ = ["Estimate"]


@dataclass
class Estimate:
    """A plan's predicted step on one mesh and cluster. Times in seconds, sizes in bytes, per
    rank (the busiest pipeline rank where ranks differ)."""
    plan: Plan
    mesh_axes: dict
    cluster: str
    global_batch: int
    step_time_s: float
    memory_bytes: float
    comm_bytes: float
    bubble_fraction: float
    compute_s: float = 0.0
    exposed_comm_s: float = 0.0
    comm_bytes_by_axis: dict = field(default_factory=dict)
    memory_breakdown: dict = field(default_factory=dict)
    time_breakdown: dict = field(default_factory=dict)
    formulas: list = field(default_factory=list)     # (what, formula, value)
    timeline: list = field(default_factory=list)     # (rank, lane, name, start, end)
    fits: bool = True
    device_memory: float = 0.0
    recompute_layers: dict = field(default_factory=dict)   # layer -> "selective" | "full" (the others keep all)
    host_bytes: float = 0.0          # Plan(offload="optimizer"): bytes over the host link per step (down + up)
    host_memory_bytes: float = 0.0   # Plan(offload="optimizer"): host memory the optimizer's copy and state hold
    caveats: list = field(default_factory=list)   # what of this plan the estimate only approximates, and why

    def explain(self) -> str:
        mesh = ", ".join(f"{k}={v}" for k, v in self.mesh_axes.items())
        lines = [f"estimate: {self.plan} on Mesh({mesh}), cluster {self.cluster}, global batch {self.global_batch}",
                 f"  step time       {self.step_time_s * 1e3:12.3f} ms   (compute {self.compute_s * 1e3:.3f} ms, "
                 f"exposed communication {self.exposed_comm_s * 1e3:.3f} ms, bubble {self.bubble_fraction:.1%})",
                 f"  memory / rank   {self.memory_bytes / 2**30:12.3f} GiB  "
                 f"({'fits' if self.fits else 'DOES NOT FIT'} in {self.device_memory / 2**30:.1f} GiB)",
                 f"  bytes / rank    {self.comm_bytes:14,.0f} B per step"]
        if self.host_bytes:
            lines.append(f"  host link       {self.host_bytes:14,.0f} B per step (gradients down as each bucket is "
                         f"reduced, parameters up after the step, bucket by bucket under ZeRO-1/2's gathers); "
                         f"host memory {self.host_memory_bytes / 2**20:.3f} MiB")
        for k, v in self.memory_breakdown.items():
            lines.append(f"    memory {k:18s} {v / 2**20:14.3f} MiB")
        for k, v in self.comm_bytes_by_axis.items():
            lines.append(f"    bytes  {k:18s} {v:14,.0f} B")
        for k, v in self.time_breakdown.items():
            lines.append(f"    time   {k:18s} {v * 1e3:14.3f} ms")
        lines += [f"  caveat: {c}" for c in self.caveats]
        if self.formulas:
            lines.append("  formulas (symbolic = value):")
            lines += [f"    {what}: {formula} = {value}" for what, formula, value in self.formulas]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()

    def add_lanes(self, trace: ChromeTrace, pid_of=lambda rank: rank) -> None:
        """The predicted step's compute and communication lanes, rank r as process ``pid_of(r)``."""
        for rank, lane, name, start, end in self.timeline:
            pid = pid_of(rank)
            trace.process(pid, f"rank {rank} (predicted): step {self.step_time_s * 1e3:.2f} ms, exposed "
                               f"communication {self.exposed_comm_s * 1e3:.2f} ms", ("compute", "communication"))
            trace.span(pid, 0 if lane == "compute" else 1, name, start, end, f"predicted {lane}")

    def chrome_trace(self) -> dict:
        """The simulated step as a Chrome / Perfetto trace: a compute and a communication lane
        per simulated rank."""
        trace = ChromeTrace()
        self.add_lanes(trace)
        return trace.as_dict()

    def write_chrome_trace(self, path: str) -> None:
        trace = ChromeTrace()
        self.add_lanes(trace)
        trace.write(path)
