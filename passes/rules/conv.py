"""Sharding rules of convolutions: ``input[N, C_in, *spatial]`` with ``weight[C_out, C_in, *k]``
(transposed: ``weight[C_in, C_out, *k]``) and ``bias[C_out]``.

A convolution is a matrix product over the channels (and the kernel window): the batch
shards like a product's batch, the output channels like its columns (weight and bias split
along them), the input channels like its contraction (each rank a partial sum, so a bias
must be an addend too); it is linear in the input and in the weight, so one of them Partial
gives the same Partial. Only ungrouped convolutions shard their channels (a rank's channels
would have to be whole groups). The spatial dims need a halo from the neighbouring ranks
and do not shard. The kernels refuse empty channels, so a dim shards only where every rank
holds some of it (``nonempty``: an axis size must be known).

The backward (``convolution_backward``) shards the batch, with the weight and bias
gradients summed over ranks, and the input channels.
"""
from __future__ import annotations

import torch

from .registry import R, OpInfo, Strategy, arg, nonempty, register, replicated, tensor_inputs
from autopar.placement import Partial, Shard

aten = torch.ops.aten
_GROUPS_POS = {aten.convolution.default: 8, aten.conv1d.default: 6, aten.conv2d.default: 6,
               aten.conv3d.default: 6}


@register(*_GROUPS_POS)
def convolution(info: OpInfo) -> list:
    x, w = info.args[0], info.args[1]
    has_bias = len(tensor_inputs(info)) == 3
    transposed = info.target == aten.convolution.default and arg(info, 6, "transposed")
    c = 1 if x.ndim == w.ndim else 0            # conv1d/2d/3d also take an unbatched input
    w_out, w_in = (1, 0) if transposed else (0, 1)
    bias = (lambda p: (p,)) if has_bias else (lambda p: ())
    found = [replicated(info)]
    if c == 1 and nonempty(x.shape[0], info.n):
        found.append(Strategy((Shard(0), R) + bias(R), Shard(0)))
    if arg(info, _GROUPS_POS[info.target], "groups", 1) == 1:
        if nonempty(info.out.shape[c], info.n):
            found.append(Strategy((R, Shard(w_out)) + bias(Shard(0)), Shard(c)))
        if nonempty(x.shape[c], info.n):
            found.append(Strategy((Shard(c), Shard(w_in)) + bias(Partial()), Partial()))
    for kind, b in (("sum", Partial()), ("avg", R)):
        found += [Strategy((Partial(kind), R) + bias(b), Partial(kind)),
                  Strategy((R, Partial(kind)) + bias(b), Partial(kind))]
    return found


@register(aten.convolution_backward.default)
def convolution_backward(info: OpInfo) -> list:
    """(grad_output, input, weight, ...) -> (grad_input, grad_weight, grad_bias)."""
    g, x = info.args[0], info.args[1]
    transposed, groups = arg(info, 7, "transposed"), arg(info, 9, "groups")
    found = [replicated(info)] + [Strategy((Partial(k), R, R), (Partial(k),) * 3) for k in ("sum", "avg")]
    if nonempty(g.shape[0], info.n):
        found.append(Strategy((Shard(0), Shard(0), R), (Shard(0), Partial(), Partial())))
    if groups == 1 and nonempty(x.shape[1], info.n):
        w_in = 0 if transposed else 1
        found.append(Strategy((R, Shard(1), Shard(w_in)), (Shard(1), Shard(w_in), R)))
    return found
