"""The device mesh: named axes over the ranks, one process group per axis.

``Mesh(dp=2, tp=2)`` lays the world's ranks out as an array of shape (2, 2), outermost axis
first, so rank = dp_index * 2 + tp_index and the inner axes (tp) are the ranks that sit
closest together (inside a node). A real mesh binds to the initialised default process
group and builds one process group per slice of each axis; a virtual mesh (``virtual=True``)
has no processes and serves planning and graph inspection.

Every group the mesh builds carries its ``timeout``: a collective that cannot complete in that
time (a rank stalled, died, or issued another collective) fails instead of hanging, and the
runtime's flight recorder (``autopar.runtime.flight``) turns the failure into an error that
says what every rank was last doing.
"""
from __future__ import annotations

import datetime
import math
from typing import Optional, Union

AXIS_ROLES = ("pp", "dp", "cp", "tp")
DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)   # how long a collective may wait for its peers

__all__ = ["Mesh", "AXIS_ROLES", "DEFAULT_TIMEOUT", "process_device"]

# (ranks, timeout, description) -> (the default group it was made under, the group). new_group
# is a rendezvous through the store (about 0.1 s on gloo); a mesh of a shape already made in
# this process (a compile per plan, a test per plan) takes the groups of the first. Every rank
# makes every mesh's groups in one order, so every rank hits or misses alike; a new world (after
# destroy_process_group) has another default group and makes its own.
_GROUPS: dict = {}


def process_device():
    """The device this process computes on where no model says: its current CUDA device when
    the default process group is NCCL's (under torchrun, the one ``torch.cuda.set_device``
    chose for the rank; NCCL's collectives take tensors there), else the CPU."""
    import torch
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _new_group(dist, row: list, timeout, desc: str):
    world = dist.distributed_c10d._get_default_group()
    key = (tuple(row), timeout, desc)
    hit = _GROUPS.get(key)
    if hit is not None and hit[0] is world:
        return hit[1]
    group = dist.new_group(row, timeout=timeout, group_desc=desc)
    _GROUPS[key] = (world, group)
    return group


class Mesh:
    """Axis name -> size, outermost first. Names are roles: ``dp``, ``tp``, ``pp``, ``cp``.
    ``timeout`` (seconds or a ``timedelta``) bounds every collective on the mesh's groups."""

    def __init__(self, *, virtual: bool = False, rank: Optional[int] = None,
                 timeout: Union[float, datetime.timedelta] = DEFAULT_TIMEOUT, **axes: int):
        if not axes:
            raise ValueError("Mesh needs at least one axis, e.g. Mesh(dp=4)")
        for name, size in axes.items():
            if name not in AXIS_ROLES:
                raise ValueError(f"unknown mesh axis {name!r}: axis names are roles, one of {AXIS_ROLES}")
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"mesh axis {name}={size!r}: sizes must be positive integers")
        self.axes: dict[str, int] = dict(axes)
        self.virtual = virtual
        if not isinstance(timeout, datetime.timedelta):
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
                raise TypeError(f"Mesh timeout={timeout!r}: expected seconds or a datetime.timedelta")
            timeout = datetime.timedelta(seconds=timeout)
        if timeout.total_seconds() <= 0:
            raise ValueError(f"Mesh timeout={timeout}: a collective's timeout must be positive")
        self.timeout = timeout
        self._device_mesh = None
        self._groups: dict = {}     # (axis, channel) -> this rank's group
        if virtual:
            self.rank = 0 if rank is None else rank
            if not 0 <= self.rank < self.size:
                raise ValueError(f"virtual mesh rank {self.rank} is outside 0..{self.size - 1}")
            return
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                f"Mesh({self._axes_str()}) binds to the default process group, but none is initialised. "
                "Run under torchrun (and call torch.distributed.init_process_group), use "
                "autopar.testing.run(...), or pass virtual=True for planning without processes.")
        world = dist.get_world_size()
        if world != self.size:
            raise ValueError(
                f"Mesh({self._axes_str()}) has {self.size} ranks but the world size is {world}; "
                f"choose axis sizes whose product is {world} (e.g. Mesh(dp={world})).")
        if rank is not None and rank != dist.get_rank():
            raise ValueError(f"rank={rank} given for a real mesh, but this process is rank {dist.get_rank()}")
        self.rank = dist.get_rank()
        for axis in self.axes:
            self._groups[(axis, "")] = self._new_groups(axis, "")

    # ---- shape -------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return math.prod(self.axes.values())

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.axes)

    def axis_size(self, axis: str) -> int:
        """Size of ``axis``; an axis the mesh lacks counts as size 1."""
        return self.axes.get(axis, 1)

    def coordinate(self, axis: str) -> int:
        """This rank's index along ``axis`` (0 if the mesh lacks it)."""
        if axis not in self.axes:
            return 0
        inner = math.prod(list(self.axes.values())[list(self.axes).index(axis) + 1:])
        return (self.rank // inner) % self.axes[axis]

    def group(self, axis: str, channel: str = ""):
        """The process group of this rank's slice along ``axis`` (None for a virtual mesh).
        A ``channel`` name gives a second group over the same ranks (created on first use,
        by every rank at the same point of the program: ``torch.distributed.new_group`` is
        collective), so that its collectives do not queue behind the first group's: the
        gradient reductions use one, as FSDP puts them on a stream of their own."""
        if axis not in self.axes:
            raise ValueError(f"mesh {self} has no axis {axis!r}")
        if self.virtual:
            return None
        key = (axis, channel)
        if key not in self._groups:
            self._groups[key] = self._new_groups(axis, channel)
        return self._groups[key]

    def world_group(self):
        """The process group of all the mesh's ranks (None for a virtual mesh), described as
        ``mesh``, under the mesh's timeout: what the whole mesh agrees on goes over it (the
        random stream of dropout, ``autopar.runtime.rng``). A group of its own, not the default
        group (whose timeout is the launcher's) nor an axis's (its collectives would queue
        behind that axis's); created on first use, by every rank at the same point of the
        program (``torch.distributed.new_group`` is collective)."""
        if self.virtual:
            return None
        key = ("", "mesh")
        if key not in self._groups:
            import torch.distributed as dist
            self._groups[key] = _new_group(dist, list(range(self.size)), self.timeout, "mesh")
        return self._groups[key]

    def _ranks(self):
        import torch
        return torch.arange(self.size).reshape(tuple(self.axes.values()))

    def _new_groups(self, axis: str, channel: str):
        """Every slice's group along ``axis`` (every rank creates every group, in one order:
        ``new_group`` is collective), described as ``axis`` or ``axis:channel``; this rank's."""
        import torch.distributed as dist
        rows = self._ranks().movedim(list(self.axes).index(axis), -1).reshape(-1, self.axes[axis])
        mine = None
        for row in rows.tolist():
            g = _new_group(dist, row, self.timeout, f"{axis}:{channel}" if channel else axis)
            if self.rank in row:
                mine = g
        return mine

    @property
    def device(self):
        """The device this rank computes on where its model does not say (a model built on the
        meta device): ``process_device()``, its current CUDA device when the default process
        group is NCCL's, else the CPU."""
        return process_device()

    @property
    def device_mesh(self):
        """A ``torch.distributed.device_mesh.DeviceMesh`` over the mesh's groups (None if virtual)."""
        if self._device_mesh is None and not self.virtual:
            import torch.distributed as dist
            from torch.distributed.device_mesh import DeviceMesh
            self._device_mesh = DeviceMesh.from_group(
                [self._groups[(a, "")] for a in self.axes], self.device.type,
                mesh=self._ranks(), mesh_dim_names=tuple(self.axes))
        return self._device_mesh

    def _axes_str(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.axes.items())

    def __repr__(self) -> str:
        timeout = "" if self.timeout == DEFAULT_TIMEOUT else f", timeout={self.timeout.total_seconds():g}"
        return f"Mesh({self._axes_str()}{', virtual=True' if self.virtual else ''}{timeout})"
