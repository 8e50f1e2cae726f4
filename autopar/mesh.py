"""The device mesh: named axes over the ranks, one process group per axis.

``Mesh(dp=2, tp=2)`` lays the world's ranks out as an array of shape (2, 2), outermost axis
first, so rank = dp_index * 2 + tp_index and the inner axes (tp) are the ranks that sit
closest together (inside a node). A real mesh binds to the initialised default process
group and builds the per-axis groups with ``torch.distributed.device_mesh``; a virtual mesh
(``virtual=True``) has no processes and serves planning and graph inspection.
"""
from __future__ import annotations

import math
from typing import Optional

AXIS_ROLES = ("pp", "dp", "cp", "tp")

__all__ = ["Mesh", "AXIS_ROLES"]


class Mesh:
    """Axis name -> size, outermost first. Names are roles: ``dp``, ``tp``, ``pp``, ``cp``."""

    def __init__(self, *, virtual: bool = False, rank: Optional[int] = None, **axes: int):
        if not axes:
            raise ValueError("Mesh needs at least one axis, e.g. Mesh(dp=4)")
        for name, size in axes.items():
            if name not in AXIS_ROLES:
                raise ValueError(f"unknown mesh axis {name!r}: axis names are roles, one of {AXIS_ROLES}")
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"mesh axis {name}={size!r}: sizes must be positive integers")
        self.axes: dict[str, int] = dict(axes)
        self.virtual = virtual
        self._device_mesh = None
        self._channels: dict = {}
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
        from torch.distributed.device_mesh import init_device_mesh
        self._device_mesh = init_device_mesh("cuda" if dist.get_backend() == "nccl" else "cpu",
                                             tuple(self.axes.values()), mesh_dim_names=tuple(self.axes))

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
        if self._device_mesh is None:
            return None
        if not channel:
            return self._device_mesh.get_group(axis)
        key = (axis, channel)
        if key not in self._channels:
            import torch.distributed as dist
            ranks = self._device_mesh.mesh.movedim(list(self.axes).index(axis), -1).reshape(-1, self.axes[axis])
            mine = None
            for row in ranks.tolist():          # every rank creates every group, in one order
                g = dist.new_group(row)
                if self.rank in row:
                    mine = g
            self._channels[key] = mine
        return self._channels[key]

    @property
    def device_mesh(self):
        """The ``torch.distributed.device_mesh.DeviceMesh`` this mesh built (None if virtual)."""
        return self._device_mesh

    def _axes_str(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.axes.items())

    def __repr__(self) -> str:
        return f"Mesh({self._axes_str()}{', virtual=True' if self.virtual else ''})"
