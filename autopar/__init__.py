"""autopar: compile a single-device PyTorch model into a distributed training program.

    mesh = autopar.Mesh(dp=4)
    dm = autopar.compile(model, mesh, example_inputs=(tokens,), plan=autopar.Plan(dp="zero3"))
    loss = loss_fn(dm(*dm.shard_batch((tokens,))), dm.shard_batch(targets)); loss.backward()
    opt = dm.optimizer(torch.optim.AdamW, lr=3e-4); opt.step()
"""



from . import cost, models, passes
from .api import compile
from .estimate import Estimate, estimate
from .planner import InfeasiblePlan, PlanReport, plan
from .capture import CaptureError
from .mesh import Mesh
from .placement import Layout, Partial, Replicate, Shard
from .plan import Plan
from .runtime import DistributedModule
from . import testing

__all__ = ["Mesh", "Plan", "compile", "DistributedModule", "Shard", "Replicate", "Partial",
           "Layout", "CaptureError", "testing", "passes", "cost", "estimate", "Estimate", "plan", "PlanReport",
           "InfeasiblePlan", "models"]
