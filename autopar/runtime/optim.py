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

An optimizer built directly on a compiled module's parameters (``torch.optim.X(dm.parameters())``,
as FSDP2's users build theirs) is checked too, at its first step: ``guard_shards`` notes each
sharded parameter and why it is sharded, and a step pre-hook registered for every optimizer
(``torch.optim.optimizer.register_optimizer_step_pre_hook``) refuses one that steps any of
them unless its class is elementwise. An elementwise one there is kept correct: its step is
followed by the refresh ``guard_shards`` was given (ZeRO-1/2's replica all-gather), as
``dm.optimizer``'s is. After its first step an optimizer costs two attribute look-ups a step
(its verdict is kept on it); one whose parameter groups change is checked again.
"""
from __future__ import annotations

import threading
import weakref
from typing import Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["ELEMENTWISE", "is_elementwise", "check_optimizer", "PerTensorState", "guard_shards", "built_here",
           "optimizer_state_bytes"]

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
        f"{getattr(cls, '__name__', cls)} is not an elementwise optimizer ({_KNOWN}), and this plan shards the "
        f"parameters ({sharded}): an update that reads a whole tensor's statistic (a norm, row/column moments) "
        f"would see only this rank's shard. Use a plan that keeps parameters whole (Plan(dp='ddp') without tp), "
        f"or {instead}; a class that is elementwise can say so with the attribute autopar_elementwise = True")


_KNOWN = f"autopar knows {', '.join(sorted(c.__name__ for c in ELEMENTWISE))} to be"


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of an optimizer's per-parameter state tensors (Adam's moments; not 0-dim steps)."""
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


# ---- optimizers built on a compiled module's parameters ----------------------------------------

class _Shard:
    """A sharded parameter as ``guard_shards`` noted it: its name, why it is sharded, and the
    refresh a step of it needs (a weak reference to a bound method; None: nothing)."""
    __slots__ = ("name", "why", "refresh")

    def __init__(self, name: str, why: str, refresh):
        self.name, self.why, self.refresh = name, why, refresh


class _Checked:
    """An optimizer's verdict: the number of its parameter groups when checked (None: built by
    ``dm.optimizer``, which checks and refreshes itself) and the refreshes after each step."""
    __slots__ = ("groups", "refresh")

    def __init__(self, groups: int | None, refresh: tuple = ()):
        self.groups, self.refresh = groups, refresh


_SHARDS = WeakIdKeyDictionary()     # parameter -> _Shard
_VERDICT = "_autopar_verdict"       # an optimizer's _Checked, in its __dict__ (Optimizer.__getstate__ leaves it out)
_HOOKS: list = []                   # the global step hooks' handles, registered once per process
_LOCK = threading.Lock()            # ranks run as threads of one process in some harnesses


def guard_shards(shards: dict[str, tuple[torch.nn.Parameter, str]], refresh: Callable[[], None] | None = None) -> None:
    """Note the sharded parameters of a compiled module, ``shards`` (name -> (parameter, why it
    is sharded: "zero3 over dp=2")): an optimizer built on any of them outside ``dm.optimizer``
    is refused at its first step unless it is elementwise, and an elementwise one's every step
    is followed by ``refresh()`` (a bound method, held weakly; ZeRO-1/2's replica all-gather).
    Noting a parameter again replaces what was noted."""
    if not shards:
        return
    ref = weakref.WeakMethod(refresh) if refresh is not None else None
    for name, (p, why) in shards.items():
        _SHARDS[p] = _Shard(name, why, ref)
    if not _HOOKS:
        with _LOCK:
            if not _HOOKS:
                _HOOKS.append(register_optimizer_step_pre_hook(_before_step))
                _HOOKS.append(register_optimizer_step_post_hook(_after_step))


def built_here(opt: torch.optim.Optimizer) -> None:
    """``opt`` was built by ``dm.optimizer``: checked there, its refresh hooked there."""
    opt.__dict__[_VERDICT] = _Checked(None)


def _before_step(opt, args, kwargs) -> None:
    seen = opt.__dict__.get(_VERDICT)
    if seen is not None and (seen.groups is None or seen.groups == len(opt.param_groups)):
        return
    opt.__dict__[_VERDICT] = _Checked(len(opt.param_groups), _check_stock(opt))


def _after_step(opt, args, kwargs) -> None:
    seen = opt.__dict__.get(_VERDICT)
    if seen is not None:
        for ref in seen.refresh:
            refresh = ref()
            if refresh is not None:
                refresh()


def _check_stock(opt: torch.optim.Optimizer) -> tuple:
    """The refreshes an optimizer built outside ``dm.optimizer`` needs after each step; raises
    where it steps a sharded parameter and is not elementwise."""
    found = [_SHARDS[p] for group in opt.param_groups for p in group["params"] if p in _SHARDS]
    if not found:
        return ()
    cls = type(opt)
    if not is_elementwise(cls):
        by_why: dict[str, list[str]] = {}
        for shard in found:
            by_why.setdefault(shard.why, []).append(shard.name)
        listed = "; ".join(f"{why}: {', '.join(names[:4])}" + (f" and {len(names) - 4} more" if len(names) > 4 else "")
                           for why, names in by_why.items())
        raise ValueError(
            f"{cls.__name__} was built directly on the parameters of a compiled module, {len(found)} of which are "
            f"this rank's shards ({listed}), and it is not an elementwise optimizer ({_KNOWN}): a statistic it "
            f"takes of a whole tensor (a norm, LAMB's or LARS's trust ratio, Adafactor's row and column moments) "
            f"would be computed per shard, over this rank's piece only, a different update than one device makes. "
            f"Build it with dm.optimizer({cls.__name__}, ...), which refuses it on sharded parameters or, with "
            f"per_tensor=True, steps full copies of them; or use an elementwise optimizer (AdamW, SGD, ...); a class "
            f"that is elementwise can say so with the attribute autopar_elementwise = True")
    refresh, owners = [], set()
    for shard in found:
        bound = shard.refresh() if shard.refresh is not None else None
        if bound is not None and id(bound.__self__) not in owners:
            owners.add(id(bound.__self__))
            refresh.append(shard.refresh)
    return tuple(refresh)


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
