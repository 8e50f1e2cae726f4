"""Optimizer offload, ``Plan(offload="optimizer")`` (ZeRO-Offload: Ren et al., "ZeRO-Offload:
Democratizing Billion-Scale Model Training", USENIX ATC 2021): the optimizer's copy of this
rank's parameters and its state live in host memory, and the step runs there.

    HostLink          the device <-> host link: host tensors (pinned where CUDA exists, so that
                      copies are asynchronous DMA), copies down (d2h) and up (h2d), each counted
                      in a ``CommStats`` under ("host", "d2h" | "h2d", phase)
    OptimizerOffload  host copies of this rank's trainable parameters (ZeRO: its rows; ddp: the
                      whole tensors; tp: its slices), in the device parameters' dtype (the fp32
                      masters under mixed precision). ``dm.optimizer`` builds the optimizer over
                      them and hooks its step: before, every device gradient not already down is
                      copied down and every device gradient dropped; after, the updated host
                      copies go up into their device parameters

What overlaps what, in a step:

    down  each gradient bucket's copy runs as soon as its reduction has landed the bucket in
          ``.grad`` and the next bucket's reduction is issued (``early``, from
          ``DataParallelSync.on_landed``), so every bucket's but the last runs while the next
          one is being reduced; the last when backward ends (ZeRO-1: every bucket then, each
          after its own reduction is waited on, while the later ones finish)
    up    ZeRO-1/2: bucket by bucket in the reducer's bucket order (``params_up(params)``, from
          ``DataParallelSync.gather_replicas``), each bucket's replica all-gather issued
          asynchronously right after its rows are up, so that the next bucket's copy runs
          while it is in flight. ddp, ZeRO-3: every parameter at once (nothing to overlap)

The copies are issued where the runtime runs. On the CPU the training thread copies (the
collectives progress on the backend's threads meanwhile): they overlap communication, not
compute, and a copy down delays the rest of backward by its own time. On CUDA they run on a
copy stream of their own (``HostLink.stream``), asynchronous to the host through pinned
memory, so a copy down also overlaps the backward compute queued after it: each copy first
waits for the compute stream's work so far (which wrote what it copies), a gradient copied
down is kept from the allocator until its copy ran (``record_stream``), and the compute
stream waits for a copy up before its next work reads the parameter.

Per step and rank, with E = this rank's trainable elements (ZeRO: its rows of every tensor;
ddp: Ψ):

    down  E x itemsize(gradient as it lands)       up  E x itemsize(device parameter)

The device parameter is the fp32 master under mixed precision, and the reducer lands the
gradients in its dtype: 4 B each way per element, where ZeRO-Offload moves fp16 gradients down
and fp16 parameters up (2 B each way) because it keeps the master on the host only. Here the
master shards stay on the device (the gathers, the replica refresh and ddp's cast read them),
a known difference: twice ZeRO-Offload's link bytes under mixed precision.

What stays on the device: the parameters as the plan keeps them (under mixed precision the
master-dtype shards, beside ZeRO-1/2's compute-dtype replicas) and the gradients until the
step. What moves to the host: the optimizer's state (Adam's moments), its copy of the
parameters and gradients, its step.
"""
from __future__ import annotations

import torch
from torch import nn

from .comm import CommStats

__all__ = ["HostLink", "OptimizerOffload"]


class HostLink:
    """The link between the device that ``device`` names and its host's memory, with the byte
    counter copies across it record into. On CUDA host tensors are pinned and copies
    asynchronous, on the copy stream ``stream`` (``wait`` completes them); on the CPU host and
    device coincide, and a copy is an ordinary one, counted as the device's would be."""

    def __init__(self, device: torch.device, stats: CommStats):
        self.device, self.stats = torch.device(device), stats
        self.host = torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.pinned = self.cuda and torch.cuda.is_available()
        self.stream = torch.cuda.Stream(self.device) if self.pinned else None    # the copies' own

    def host_empty(self, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised host tensor of ``like``'s shape and dtype (pinned on CUDA)."""
        return torch.empty(like.shape, dtype=like.dtype, device=self.host, pin_memory=self.pinned)

    def down(self, dst: torch.Tensor, src: torch.Tensor, phase: str = "optimizer") -> torch.Tensor:
        """Device ``src`` -> host ``dst`` (asynchronous on CUDA: ``wait`` before reading ``dst``)."""
        self.stats.record("host", "d2h", phase, src.numel() * src.element_size(), src.dtype)
        if self.stream is None:
            dst.copy_(src.detach(), non_blocking=self.cuda)
            return dst
        self.stream.wait_stream(torch.cuda.current_stream(self.device))    # the work that wrote src
        with torch.cuda.stream(self.stream):
            dst.copy_(src.detach(), non_blocking=True)
        src.record_stream(self.stream)     # a gradient dropped after this is not reused before its copy ran
        return dst

    def up(self, dst: torch.Tensor, src: torch.Tensor, phase: str = "optimizer") -> torch.Tensor:
        """Host ``src`` -> device ``dst`` (ordered before the device's later work on its stream)."""
        self.stats.record("host", "h2d", phase, dst.numel() * dst.element_size(), dst.dtype)
        if self.stream is None:
            dst.copy_(src, non_blocking=self.cuda)
            return dst
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)    # the work queued before that reads dst
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        compute.wait_stream(self.stream)    # the work queued after it reads the new values
        return dst

    def wait(self) -> None:
        """Complete the copies issued so far (the host is about to read what came down)."""
        if self.stream is not None:
            self.stream.synchronize()
        elif self.cuda:
            torch.cuda.current_stream(self.device).synchronize()


class OptimizerOffload:
    """Host copies of ``params`` (name -> device parameter) that the optimizer steps.

    ``grads_down`` (the step's pre-hook) gives each host copy its device gradient and drops the
    device's; ``params_up`` (after the step: a bucket at a time, then the rest) writes each
    host copy into its device parameter once per step. A device parameter changed outside the
    step (``load_full_state_dict``, a user's in-place edit) is noticed by its version counter
    and copied down again before the next step."""

    def __init__(self, params: dict[str, nn.Parameter], link: HostLink):
        self.link = link
        self.device_params = params
        self.host_params: dict[str, nn.Parameter] = {}
        self._grads: dict[str, torch.Tensor] = {}     # persistent host gradient buffers
        with torch.no_grad():
            for name, p in params.items():
                h = nn.Parameter(link.down(link.host_empty(p), p, phase="setup"))
                self.host_params[name] = h
                self._grads[name] = link.host_empty(p)
        link.wait()
        self._versions: dict[str, int] = {}
        self.record_versions()
        self._name_of = {id(p): name for name, p in params.items()}
        self._early: dict[str, tuple] = {}    # name -> (device gradient, its version, host copy)
        self._stale: set[str] = set()         # stepped on the host, not yet copied up

    def early(self, params: list) -> None:
        """A bucket's reduced gradients landed in these device parameters' ``.grad`` while
        backward goes on (``DataParallelSync.on_landed``, called once the next bucket's
        reduction is issued): their copies down run now, while that reduction is in flight.
        ``grads_down`` takes a copy whose gradient is still the same tensor at the same version;
        a gradient changed since (a second backward, a pipeline's tied sum) is copied again
        there."""
        with torch.no_grad():
            for p in params:
                name = self._name_of.get(id(p))
                if name is None or p.grad is None:
                    continue
                h = self.host_params[name]
                dst = self._grads[name] if h.grad is None else self.link.host_empty(p.grad)
                self._early[name] = (p.grad, p.grad._version, self.link.down(dst, p.grad))

    def parameters(self) -> list[nn.Parameter]:
        """The host copies, in the order of the device parameters: what the optimizer steps."""
        return list(self.host_params.values())

    def record_versions(self) -> None:
        """Note the device parameters as the step left them (after ZeRO-1/2's replica refresh,
        which bumps the version of shards that are views of their replicas)."""
        self._versions = {name: p._version for name, p in self.device_params.items()}

    def grads_down(self) -> None:
        """Before the step: every device gradient to its host copy (added to a host gradient the
        optimizer's ``zero_grad`` left in place, as torch accumulates), the device's dropped."""
        with torch.no_grad():
            for name, p in self.device_params.items():
                h = self.host_params[name]
                if p._version != self._versions.get(name):      # changed outside the step
                    self.link.down(h, p, phase="refresh")
                g = p.grad
                early = self._early.pop(name, None)
                if g is None:
                    continue
                if early is not None and early[0] is g and early[1] == g._version:
                    host = early[2]          # came down while backward ran
                elif h.grad is None:
                    host = self.link.down(self._grads[name], g)
                else:
                    host = self.link.down(self.link.host_empty(g), g)
                if h.grad is None:
                    h.grad = host
                elif host is not h.grad:
                    h.grad.add_(host)
                p.grad = None
        self._early.clear()
        self._stale = set(self.device_params)
        self.link.wait()

    def params_up(self, params: list | None = None) -> None:
        """After the step: the host copies of ``params`` (device parameters: one bucket, just
        before its all-gather reads them) into their device parameters; ``None``: every one
        not yet up in this step. Each goes up once per step."""
        names = self.device_params if params is None else [self._name_of.get(id(p)) for p in params]
        with torch.no_grad():
            for name in names:
                if name in self._stale:
                    self._stale.discard(name)
                    self.link.up(self.device_params[name], self.host_params[name].detach())

    def host_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Host memory held: the parameter copies, the gradient buffers and (given the
        optimizer) its per-parameter state tensors."""
        out = {"parameters": sum(h.numel() * h.element_size() for h in self.host_params.values()),
               "gradients": sum(g.numel() * g.element_size() for g in self._grads.values())}
        if optimizer is not None:
            out["optimizer state"] = sum(v.numel() * v.element_size() for s in optimizer.state.values()
                                         for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        return out

    def step_bytes(self) -> tuple[int, int]:
        """(down, up) bytes one step moves: every gradient (in its parameter's dtype, as the
        reducer lands it) down, every parameter up."""
        nbytes = sum(p.numel() * p.element_size() for p in self.device_params.values())
        return nbytes, nbytes
