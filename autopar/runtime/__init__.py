"""What the emitted program calls at run time.

    comm              AxisComm (one mesh axis's process group and byte counter), the
                      autograd-aware collectives and their counters
    dpsync            the dp axis: ZeRO-3 gathers, bucketed gradient reduction (ddp, ZeRO-1/2/3)
    tpcomm            the tp axis: Megatron's f/g, gathers, reduce-scatters, vocabulary parallelism
    collmatmul        all-gather + matmul and matmul + reduce-scatter as ring steps
    flight            the flight recorder: every collective noted; one that fails (timeout, dead
                      peer, mismatch, a peer that raised) raises CollectiveError with what every
                      rank was last doing; compile's agreement through the store (PeerError)
    wgrad             the zero-bubble weight-gradient stash
    recompute         regions of the forward graph recomputed in backward (activation recomputation)
    rng               dropout masks with single-device parity (RandomMasks, rng_dropout, rng_sdpa)
    timeline          measured timelines of a step
    timing            now(device): the clock once the device's queued work has run (every timer)
    optim             which optimizers may step shards; optimizers built on dm.parameters() checked
    offload           Plan(offload="optimizer"): the optimizer's copy and state on the host, the
                      host link's copies counted
    module            CompiledModule (what every compiled module is), DistributedModule
    pipeline_module   PipelineModule: a rank's stages and the schedule that drives them
    emit              the rewritten graph -> this rank's DistributedModule

The runtime imports the IR (autopar.meta, placement, sizes, context, schedule, trace) and
nothing of the passes or the cost model.
"""
from .emit import emit
from .module import CompiledModule, DistributedModule, slice_batch
from .pipeline_module import PipelineModule

__all__ = ["emit", "CompiledModule", "DistributedModule", "PipelineModule", "slice_batch"]
