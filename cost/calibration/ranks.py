"""The processes the calibration's probes run on: a pool of local gloo processes kept between
probes (``Ranks``). The only module of the calibration that starts processes."""
from __future__ import annotations

from autopar.launch import RankPool

__all__ = ["Ranks"]


class Ranks:
    """The probes' processes: ``ranks(fn, world, *args)`` runs ``fn`` on a pool of ``world``
    local gloo processes kept between probes (starting torch in fresh processes cost more than
    most probes). One pool at a time: starting another closes the last, so no idle rank shares
    the cores with a probe."""

    def __init__(self):
        self.pool = None

    def __call__(self, fn, world: int, *args, timeout: float = 180.0):
        if self.pool is None or self.pool.world_size != world or not self.pool.alive:
            self.close()
            self.pool = RankPool(world, timeout=300.0)
        return self.pool.run(fn, *args, timeout=timeout)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
