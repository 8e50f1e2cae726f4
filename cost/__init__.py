"""autopar's cost model: what a plan costs, predicted without running it.

    formulas, comm, compute, memory   sympy formulas (bytes, alpha-beta times, rooflines, memory)
    cluster, cache                    hardware descriptions and presets; the local preset's cache
    calibration                       measuring this machine for the local preset (runs processes)
    profile                           what one rank computes, keeps and sends, read from the graph
    lm_head                           an LM head whole or split along the vocabulary: priced, chosen
    offload                           Plan(offload="optimizer"): the host link and the step on the host
    estimate                          a plan's step composed from those (result, profile_cache,
                                      step_parts, step_layout, step_time, step_report, data_parallel,
                                      single_stage, pipeline: the schedule replayed, peak_memory)
    planner                           the search over plans

Numbers only at evaluation time; ``autopar.sizes`` holds the arithmetic the runtime shares.
"""
from .formulas import B, H, N, PSI, S, T, dp_comm_elements, evaluate, tp_layer_comm_elements
from .memory import model_state_bytes

__all__ = ["N", "PSI", "B", "S", "H", "T", "dp_comm_elements", "tp_layer_comm_elements", "model_state_bytes",
           "evaluate"]
