"""The ``node.meta`` keys autopar's passes read and write, declared in one place.

Values stored under these keys are frozen dataclasses or plain values, so a graph's
annotations can be printed, compared and diffed.
"""
VAL = "val"                 # torch.export's FakeTensor (shape, dtype) of the node's output
LAYOUT = "autopar_layout"   # autopar.placement.Layout of the node's output
PARAM = "autopar_param"     # canonical parameter name (original model's qualified name) of a get_attr
COMM = "autopar_comm"       # autopar.comm.CommInfo of a collective node (kind, axis, bytes)
SOURCE = "stack_trace"      # torch.export's source location of the node
STRATEGY = "autopar_strategy"  # {mesh axis: passes.rules.Strategy} the shard pass chose for a node
LOWER = "autopar_lower"     # name of the tp lowering that replaces an op (vocabulary parallelism)
