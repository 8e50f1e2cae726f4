"""Default sample calls for the validator: every registered op on small concrete tensors.

Shapes mix sizes divisible by 2 and 3 (4, 6, 12) with uneven ones (3, 5, 7), so the rules'
uneven-shard cases are exercised on axes of 2 and 3 ranks. Values are positive where the op
needs it (rsqrt, log, a divisor).
"""
from __future__ import annotations

import operator

import torch

aten = torch.ops.aten


def default_samples(seed: int = 0) -> list:
    """``[(op, args, kwargs), ...]``, deterministic."""
    g = torch.Generator().manual_seed(seed)

    def t(*shape):
        return torch.randn(shape, generator=g)

    def pos(*shape):
        return torch.rand(shape, generator=g) + 0.5

    def mask(*shape):
        return torch.rand(shape, generator=g) > 0.5

    def idx(high, *shape):
        return torch.randint(0, high, shape, generator=g)

    x, x3 = t(4, 6, 8), t(3, 5)
    S = [
        # pointwise: broadcasting, scalars, Partial-friendly forms
        (aten.add.Tensor, (x, t(8)), {}), (aten.add.Tensor, (x3, t(3, 5)), {}),
        (aten.add.Tensor, (x, t(6, 1)), {"alpha": -2}), (aten.add.Tensor, (x, 1.5), {}),
        (aten.add.Scalar, (x, 2.0), {}), (aten.sub.Tensor, (x3, t(3, 1)), {}),
        (aten.sub.Tensor, (x, t(4, 6, 8)), {"alpha": 2}), (aten.sub.Scalar, (x, 1), {}),
        (aten.mul.Tensor, (x, t(6, 1)), {}), (aten.mul.Tensor, (x, -2.0), {}),
        (aten.mul.Scalar, (x3, 3.0), {}), (aten.div.Tensor, (x, pos(8)), {}),
        (aten.div.Tensor, (x, -0.5), {}), (aten.div.Scalar, (x3, 4.0), {}),
        (aten.rsub.Scalar, (x, 1.0), {}), (aten.neg.default, (x,), {}),
        (aten.exp.default, (x3,), {}), (aten.relu.default, (x,), {}),
        (aten.sigmoid.default, (x,), {}), (aten.tanh.default, (x3,), {}),
        (aten.rsqrt.default, (pos(4, 6),), {}), (aten.sqrt.default, (pos(3, 5),), {}),
        (aten.log.default, (pos(4, 6),), {}), (aten.reciprocal.default, (pos(6, 4),), {}),
        (aten.abs.default, (x,), {}), (aten.sin.default, (x3,), {}), (aten.cos.default, (x3,), {}),
        (aten.erf.default, (x,), {}), (aten.pow.Tensor_Scalar, (x, 2), {}),
        (aten.pow.Tensor_Tensor, (pos(4, 6), t(6)), {}), (aten.gelu.default, (x,), {}),
        (aten.gelu.default, (x3,), {"approximate": "tanh"}), (aten.silu.default, (x,), {}),
        (aten.dropout.default, (x, 0.0, True), {}), (aten.native_dropout.default, (x, 0.0, True), {}),
        (aten.maximum.default, (x, t(8)), {}), (aten.minimum.default, (x3, t(5)), {}),
        (aten.logical_not.default, (mask(4, 6),), {}),
        (aten.eq.Scalar, (idx(3, 4, 6), 1), {}), (aten.eq.Tensor, (idx(3, 4, 6), idx(3, 6)), {}),
        (aten.ne.Scalar, (idx(3, 4, 6), 1), {}), (aten.ne.Tensor, (idx(3, 3, 5), idx(3, 3, 5)), {}),
        (aten.lt.Scalar, (x, 0.0), {}), (aten.lt.Tensor, (x, t(8)), {}),
        (aten.le.Scalar, (x3, 0.0), {}), (aten.le.Tensor, (x3, t(3, 1)), {}),
        (aten.gt.Scalar, (x, 0.0), {}), (aten.gt.Tensor, (x, t(6, 8)), {}),
        (aten.ge.Scalar, (x3, 0.0), {}), (aten.ge.Tensor, (x3, t(5)), {}),
        (aten.zeros_like.default, (x,), {}), (aten.ones_like.default, (x3,), {}),
        (aten.full_like.default, (x, 3.0), {}),
        (aten.clone.default, (x,), {}), (aten.contiguous.default, (x,), {}),
        (aten.alias.default, (x3,), {}), (aten.detach.default, (x,), {}),
        (aten.lift_fresh_copy.default, (x3,), {}),
        (aten._to_copy.default, (x,), {"dtype": torch.float64}),
        (aten._to_copy.default, (x3,), {"dtype": torch.int64}),
        (aten._to_copy.default, (x,), {"dtype": torch.bfloat16}),
        (aten.to.dtype, (x, torch.float64), {}), (aten.to.dtype_layout, (x3,), {"dtype": torch.float64}),
        (aten.masked_fill.Scalar, (x, mask(6, 8), float("-inf")), {}),
        (aten.masked_fill.Scalar, (x, mask(4, 6, 8), 0.0), {}),
        (aten.masked_fill.Tensor, (x3, mask(3, 5), torch.tensor(2.0)), {}),
        (aten.type_as.default, (x, t(4, 6, 8).double()), {}),
        (aten.type_as.default, (x3, torch.zeros(2, dtype=torch.float16)), {}),
        (aten._assert_tensor_metadata.default, (x,), {"dtype": torch.float32}),
        (aten._assert_tensor_metadata.default, (idx(3, 4, 6),), {"dtype": torch.int64}),
        (aten.where.self, (mask(6, 8), x, t(8)), {}), (aten.where.self, (mask(3, 5), x3, t(3, 5)), {}),
        # matrix products
        (aten.mm.default, (t(6, 4), t(4, 8)), {}), (aten.mm.default, (t(3, 5), t(5, 7)), {}),
        (aten.bmm.default, (t(4, 6, 8), t(4, 8, 6)), {}),
        (aten.addmm.default, (t(8), t(6, 4), t(4, 8)), {}),
        (aten.addmm.default, (t(6, 1), t(6, 12), t(12, 3)), {"beta": 0.5, "alpha": 2.0}),
        (aten.baddbmm.default, (t(4, 6, 6), t(4, 6, 8), t(4, 8, 6)), {}),
        (aten.linear.default, (x, t(12, 8), t(12)), {}), (aten.linear.default, (x3, t(7, 5)), {}),
        (aten.linear.default, (t(6), t(4, 6)), {}),
        (aten.matmul.default, (t(6), t(6)), {}), (aten.matmul.default, (t(6), t(6, 4)), {}),
        (aten.matmul.default, (x, t(8)), {}), (aten.matmul.default, (t(2, 3, 6, 4), t(4, 5)), {}),
        (aten.matmul.default, (t(2, 1, 6, 4), t(3, 4, 5)), {}),
        # views and data movement
        (aten.view.default, (x, [4, 6, 2, 4]), {}), (aten.view.default, (x, [24, 8]), {}),
        (aten.view.default, (t(6, 4), [4, 6]), {}), (aten.view.default, (t(4, 12), [4, 4, 3]), {}),
        (aten.reshape.default, (x, [4, -1]), {}), (aten.reshape.default, (t(3, 4, 5), [12, 5]), {}),
        (aten.reshape.default, (t(6, 4, 3), [2, 3, 12]), {}),
        (aten._unsafe_view.default, (x, [4, 48]), {}),
        (aten.flatten.using_ints, (x, 1, 2), {}), (aten.flatten.using_ints, (t(3, 4, 2),), {}),
        (aten.unflatten.int, (x, -1, [2, 4]), {}), (aten.unflatten.int, (t(12, 5), 0, [6, -1]), {}),
        (aten.squeeze.default, (t(4, 1, 6),), {}), (aten.squeeze.dim, (t(4, 1, 6), 1), {}),
        (aten.squeeze.dims, (t(1, 6, 1, 3), [0, 2]), {}), (aten.unsqueeze.default, (x, 1), {}),
        (aten.transpose.int, (x, 1, 2), {}), (aten.transpose.int, (x3, 0, -1), {}),
        (aten.t.default, (t(6, 4),), {}), (aten.permute.default, (x, [2, 0, 1]), {}),
        (aten.expand.default, (t(4, 1, 8), [4, 6, 8]), {}),
        (aten.expand.default, (t(6, 8), [4, -1, -1]), {}),
        (aten.split.Tensor, (t(4, 6, 9), 3, -1), {}), (aten.split.Tensor, (x3, 2), {}),
        (aten.split_with_sizes.default, (x, [2, 4], 1), {}), (aten.chunk.default, (x, 2), {}),
        (aten.cat.default, ([x, t(4, 3, 8)], 1), {}), (aten.cat.default, ([x3, x3, t(3, 2)], -1), {}),
        (aten.slice.Tensor, (x, 2, 0, 4), {}), (aten.slice.Tensor, (x, 1, 1, None, 2), {}),
        (aten.select.int, (x, 1, 2), {}), (aten.select.int, (x3, -1, 0), {}),
        (aten.tril.default, (t(2, 6, 6),), {}), (aten.tril.default, (t(5, 7), 1), {}),
        (aten.triu.default, (t(6, 4), -1), {}),
        (aten.unbind.int, (t(3, 4, 6),), {}),
        (operator.getitem, ((x, t(4, 6), t(6, 3)), 2), {}), (operator.getitem, ((x3, x), 0), {}),
        # reductions and normalizations
        (aten.sum.default, (x,), {}), (aten.sum.dim_IntList, (x, [1]), {}),
        (aten.sum.dim_IntList, (x, [-1], True), {}), (aten.sum.dim_IntList, (x3, [0]), {}),
        (aten.mean.default, (x,), {}), (aten.mean.dim, (x, [-1], True), {}),
        (aten.mean.dim, (x3, [0]), {}), (aten.mean.dim, (t(6, 5), [0, 1]), {}),
        (aten.amax.default, (x, [1]), {}), (aten.amax.default, (x3, [0]), {}),
        (aten.amin.default, (x, [0], True), {}), (aten.amin.default, (t(4, 5), [0]), {}),
        (aten.max.dim, (x, 1), {}), (aten.min.dim, (x3, -1, True), {}),
        (aten.var.dim, (t(6, 6, 4), [-1]), {}), (aten.std.dim, (x3, [0]), {}),
        (aten.var.correction, (t(6, 3, 6), [1]), {"correction": 0, "keepdim": True}),
        (aten.std.correction, (x3, [1]), {}), (aten.var_mean.correction, (t(6, 3, 6), [1]), {}),
        (aten._softmax.default, (x, -1, False), {}), (aten.softmax.int, (x3, 0), {}),
        (aten._log_softmax.default, (x, 1, False), {}), (aten.log_softmax.int, (x, -1), {}),
        (aten.layer_norm.default, (x, [8], t(8), t(8), 1e-5, False), {}),
        (aten.layer_norm.default, (x, [6, 8]), {}),
        (aten.native_layer_norm.default, (x, [8], t(8), t(8), 1e-5), {}),
        (aten.rms_norm.default, (x, [8], t(8), 1e-6), {}), (aten.rms_norm.default, (x3, [5]), {}),
        (aten.batch_norm.default, (x, t(6), t(6), t(6), pos(6), False, 0.1, 1e-5, False), {}),
        (aten.batch_norm.default, (t(6, 4), None, None, t(4), pos(4), False, 0.1, 1e-5, False), {}),
        (aten.batch_norm.default, (x, t(6), t(6), None, None, True, 0.1, 1e-5, False), {}),
        # embedding, attention, losses
        (aten.embedding.default, (t(10, 8), idx(10, 4, 6)), {}),
        (aten.embedding.default, (t(7, 3), idx(7, 5)), {}),
        (aten.scaled_dot_product_attention.default, (t(2, 4, 6, 8), t(2, 4, 6, 8), t(2, 4, 6, 8)),
         {"is_causal": True}),
        (aten.scaled_dot_product_attention.default,
         (t(2, 3, 6, 4), t(2, 3, 5, 4), t(2, 3, 5, 2), t(6, 5)), {}),
        (aten.scaled_dot_product_attention.default,
         (t(4, 6, 8), t(4, 6, 8), t(4, 6, 8), mask(4, 1, 6)), {}),
        (aten.cross_entropy_loss.default, (t(6, 5), idx(5, 6)), {}),
        (aten.cross_entropy_loss.default, (t(6, 5), idx(5, 6), None, 2), {}),
        (aten.cross_entropy_loss.default, (t(3, 5), idx(5, 3), pos(5), 0), {}),
        (aten.cross_entropy_loss.default, (t(4, 5, 6), idx(5, 4, 6)), {}),
        (aten.cross_entropy_loss.default, (t(6, 5), torch.softmax(t(6, 5), -1)),
         {"label_smoothing": 0.1}),
        (aten.nll_loss.default, (torch.log_softmax(t(6, 5), -1), idx(5, 6)), {}),
        (aten.nll_loss.default, (t(3, 5), idx(5, 3), pos(5), 2), {}),
        (aten.nll_loss_nd.default, (t(4, 5, 6), idx(5, 4, 6), None, 0), {}),
        (aten.mse_loss.default, (x, t(4, 6, 8)), {}), (aten.mse_loss.default, (x3, t(3, 5), 0), {}),
        # factories
        (aten.zeros.default, ([4, 6],), {}), (aten.ones.default, ([3, 5],), {}),
        (aten.full.default, ([4, 6], 2.0), {}), (aten.new_zeros.default, (x, [4, 6]), {}),
        (aten.new_ones.default, (x3, [5, 3]), {}), (aten.new_full.default, (x, [6, 4], 1.5), {}),
        (aten.scalar_tensor.default, (2.0,), {}), (aten.arange.default, (6,), {}),
        (aten.arange.start, (2, 9), {}), (aten.arange.start_step, (1, 20, 3), {}),
    ]
    return S
