"""autopar: compile a single-device PyTorch model into a distributed training program.

    mesh = autopar.Mesh(dp=4)
    dm = autopar.compile(model, mesh, example_inputs=(tokens,), plan=autopar.Plan(dp="zero3"))
    loss = loss_fn(dm(*dm.shard_batch((tokens,))), dm.shard_batch(targets)); loss.backward()
    opt = dm.optimizer(torch.optim.AdamW, lr=3e-4); opt.step()
"""
import importlib

from . import cost, models, passes
from .api import compile, estimate, plan
from .capture import CaptureError
from .data_dependent import DataDependentShapeError
from .cost.estimate import Estimate
from .cost.planner import InfeasiblePlan, PlanReport
from .mesh import Mesh
from .placement import Layout, Partial, Replicate, Shard
from .planspec import Plan
from .runtime import CompiledModule, DistributedModule
from .tuning import TuneReport, tune
from .verification import Divergence, VerifyReport, verify

__all__ = ["Mesh", "Plan", "compile", "CompiledModule", "DistributedModule", "Shard", "Replicate", "Partial",
           "Layout", "CaptureError", "DataDependentShapeError", "testing", "passes", "cost", "estimate", "Estimate", "plan", "PlanReport",
           "InfeasiblePlan", "models", "verify", "VerifyReport", "Divergence", "tune", "TuneReport"]


def __getattr__(name: str):
    """``autopar.testing``, the test harness, is imported on first use: ``import autopar`` does not
    load it (the library launches its ranks with ``autopar.launch``), and ``autopar.testing.run(...)``
    works after ``import autopar`` alone."""
    if name == "testing":
        return importlib.import_module(".testing", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
