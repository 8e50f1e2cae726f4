"""Optimizers over sharded parameters: which are safe, and a per-tensor mode for the rest.

An optimizer whose update of each element reads only that element's parameter, gradient and
state (SGD, Adam, AdamW, ...) computes the same update on a shard as on the whole tensor, so
it runs unchanged on ZeRO's and tensor parallelism's shards. One that reads a statistic of
the whole tensor (LAMB's and LARS's trust ratio, Adafactor's row and column moments, Muon's
orthogonalisation, L-BFGS's global line search) would compute it per shard: a different,
silently wrong update. ``dm.optimizer`` therefore refuses those on sharded parameters,
unless ``per_tensor=True``: then the optimizer runs on full copies of the parameters (each
step gathers the full gradients, steps every full tensor on every rank, and writes this
rank's shard back), which costs the full parameters, gradients and optimizer state on every
rank, and a gather of the gradients per step.
"""
from __future__ import annotations

import torch

__all__ = ["ELEMENTWISE", "is_elementwise", "check_optimizer", "PerTensorState"]

ELEMENTWISE = frozenset(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adadelta", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop")
    if hasattr(torch.optim, name))
"""torch.optim classes whose update is elementwise (each element's update reads only that element)."""


def is_elementwise(cls) -> bool:
    """True for the optimizers of ``ELEMENTWISE`` (the class itself: a subclass may change
    the update), or a class that declares ``autopar_elementwise = True``."""
    return cls in ELEMENTWISE or getattr(cls, "autopar_elementwise", False) is True


def check_optimizer(cls, sharded: str, per_tensor: bool, per_tensor_built: bool = True) -> None:
    """Refuse ``cls`` where ``sharded`` (what splits the parameters; "" = nothing) unless it is
    elementwise or ``per_tensor`` steps whole copies."""
    if not sharded or per_tensor or is_elementwise(cls):
        return
    instead = ("dm.optimizer(cls, per_tensor=True, ...), which steps full copies of the parameters on every "
               "rank (full parameter, gradient and state memory per rank)" if per_tensor_built else
               "an elementwise optimizer")
    raise ValueError(
        f"{getattr(cls, '__name__', cls)} is not an elementwise optimizer (autopar knows "
        f"{', '.join(sorted(c.__name__ for c in ELEMENTWISE))} to be), and this plan shards the parameters "
        f"({sharded}): an update that reads a whole tensor's statistic (a norm, row/column moments) would see "
        f"only this rank's shard. Use a plan that keeps parameters whole (Plan(dp='ddp') without tp), or "
        f"{instead}; a class that is elementwise can say so with the attribute autopar_elementwise = True")


class PerTensorState:
    """``per_tensor=True``: full copies of the trainable parameters that the optimizer steps.
    ``full(name, tensor)`` gathers a local piece to the whole tensor (collective), ``local(name,
    full)`` cuts this rank's piece of a full tensor (no communication)."""

    def __init__(self, params: dict[str, torch.nn.Parameter], full, local):
        self.params, self._full, self._local = params, full, local
        with torch.no_grad():
            self.copies = {name: torch.nn.Parameter(full(name, p.detach())) for name, p in params.items()}

    def before_step(self) -> None:
        """Move every gradient to its full copy (gathered), leaving the shard's gradient None."""
        with torch.no_grad():
            for name, p in self.params.items():
                g = self._full(name, p.grad) if p.grad is not None else None
                self.copies[name].grad = g
                p.grad = None

    def after_step(self) -> None:
        """Write this rank's piece of every stepped full copy into the shard."""
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(self._local(name, self.copies[name].detach()))
