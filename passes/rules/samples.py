"""Default sample calls for the validator: every registered op on small concrete tensors.

Shapes mix sizes divisible by 2 and 3 (4, 6, 12) with uneven ones (3, 5, 7), so the rules'
uneven-shard cases are exercised on axes of 2 and 3 ranks. Values are positive where the op
needs it (rsqrt, log, a divisor). An in-place op gets tensors of its own (the validator runs
it once per strategy on them). Another library's op (a rule registered by name) gets its
sample when the library is installed: ``resolve`` imports the module that defines the op.
"""
from __future__ import annotations

import importlib
import operator

import torch

aten = torch.ops.aten

PROVIDERS = {"transformers.grouped_mm_fallback.default": "transformers.integrations.moe"}
"""op name -> the module whose import defines the op"""


def resolve(name: str):
    """The op named ``name`` (``namespace.op.overload``), importing its ``PROVIDERS`` module
    if need be; None when that library is not installed."""
    ns, op, overload = name.split(".")
    for attempt in range(2):
        try:
            return getattr(getattr(getattr(torch.ops, ns), op), overload)
        except AttributeError:
            if attempt or name not in PROVIDERS:
                return None
            try:
                importlib.import_module(PROVIDERS[name])
            except ImportError:
                return None


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
        (aten.einsum.default, ("bsh,ehf->bsef", [t(2, 5, 4), t(3, 4, 6)]), {}),
        (aten.einsum.default, ("bsef,efh,bse->bsh", [t(2, 3, 4, 6), t(4, 6, 5), t(2, 3, 4)]), {}),
        (aten.einsum.default, ("ij,jk", [t(6, 4), t(4, 7)]), {}),
        (aten.einsum.default, ("ii->i", [t(4, 4)]), {}),
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
        (aten.tensor_split.indices, (x, [2, 5], 1), {}), (aten.tensor_split.indices, (t(4, 6, 7), [7], -1), {}),
        (aten.tensor_split.indices, (x3, [1]), {}), (aten.tensor_split.sections, (x, 3, 2), {}),
        (aten.tensor_split.sections, (t(5, 7), 2, 1), {}),
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
        (aten.scaled_dot_product_attention.default, (t(2, 4, 6, 8), t(2, 2, 6, 8), t(2, 2, 6, 8)),
         {"is_causal": True, "enable_gqa": True}),
        (aten.scaled_dot_product_attention.default, (t(2, 6, 5, 4), t(2, 3, 5, 4), t(2, 3, 5, 4), t(5, 5)),
         {"enable_gqa": True}),
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
    return S + _core_samples(t, pos, mask, idx, x, x3) + _external_samples(t, idx)


def _core_samples(t, pos, mask, idx, x, x3) -> list:
    """The rest of PyTorch's core ATen opset and the ops the Hugging Face zoo reaches."""
    def unit(*shape):       # inside (-1, 1): acos, asin, atanh
        return torch.tanh(t(*shape))

    ln = aten.native_layer_norm.default(x, [8], t(8), t(8), 1e-5)
    gx = t(4, 6, 5)
    gn = aten.native_group_norm.default(gx, t(6), t(6), 4, 6, 5, 3, 1e-5)
    img = t(2, 3, 6, 6)
    pooled, where = aten.max_pool2d_with_indices.default(img, [2, 2])
    bags = torch.tensor([0, 2, 4])
    return [
        # pointwise, in-place forms and the rest of the core unary/binary ops
        (aten.add_.Tensor, (t(4, 6, 8), t(8)), {}), (aten.add_.Tensor, (t(3, 5), t(3, 5)), {"alpha": 2}),
        (aten.div_.Tensor, (t(4, 6), pos(6)), {}), (aten.div_.Tensor, (t(3, 5), 2.0), {}),
        (aten.masked_fill_.Scalar, (t(4, 6, 8), mask(6, 8), 0.0), {}),
        (aten.fill.Scalar, (x, 2.0), {}), (aten.fill_.Tensor, (t(3, 5), torch.tensor(1.5)), {}),
        (aten.copy.default, (x, t(4, 6, 8)), {}), (aten.copy.default, (x3, t(5).double()), {}),
        (aten.copy_.default, (t(4, 6, 8), t(4, 6, 8)), {}), (aten.copy_.default, (t(3, 5), t(5)), {}),
        (aten.to.device, (x, torch.device("cpu"), torch.float64), {}),
        (aten.atan.default, (x,), {}), (aten.asinh.default, (x3,), {}), (aten.expm1.default, (x,), {}),
        (aten.ceil.default, (x3,), {}), (aten.floor.default, (x,), {}), (aten.round.default, (x,), {}),
        (aten.trunc.default, (x3,), {}), (aten.sign.default, (x,), {}),
        (aten.clamp.default, (x, -0.5, 0.5), {}), (aten.clamp.default, (x3,), {"min": 0.0}),
        (aten.clamp.Tensor, (x3, t(3, 1), t(5) + 2), {}), (aten.hardtanh.default, (x,), {}),
        (aten.acos.default, (unit(4, 6),), {}), (aten.asin.default, (unit(3, 5),), {}),
        (aten.atanh.default, (unit(4, 6),), {}), (aten.acosh.default, (pos(3, 5) + 1,), {}),
        (aten.cosh.default, (x,), {}), (aten.sinh.default, (x3,), {}), (aten.tan.default, (x3,), {}),
        (aten.log10.default, (pos(4, 6),), {}), (aten.log1p.default, (pos(3, 5),), {}),
        (aten.log2.default, (pos(6, 4),), {}),
        (aten.atan2.default, (x, t(8)), {}), (aten.atan2.out, (x3, t(3, 5)), {"out": torch.empty(3, 5)}),
        (aten.div.Tensor_mode, (x, pos(8)), {"rounding_mode": "floor"}),
        (aten.div.Scalar_mode, (x3, 0.3), {"rounding_mode": "trunc"}),
        (aten.floor_divide.default, (idx(10, 4, 6), 3), {}), (aten.floor_divide.default, (x, pos(8)), {}),
        (aten.fmod.Tensor, (x, pos(8)), {}), (aten.fmod.Scalar, (x3, 0.7), {}),
        (aten.remainder.Tensor, (x3, pos(3, 5)), {}), (aten.remainder.Scalar, (x, 0.5), {}),
        (aten.pow.Scalar, (2.0, x3), {}), (aten.square.default, (x,), {}),
        (aten.elu.default, (x,), {}), (aten.leaky_relu.default, (x3, 0.1), {}),
        (aten.isinf.default, (x / torch.where(mask(4, 6, 8), 0.0, 1.0),), {}),
        (aten.isnan.default, (torch.where(mask(3, 5), float("nan"), x3),), {}),
        (aten.bitwise_and.Tensor, (idx(8, 4, 6), idx(8, 6)), {}), (aten.bitwise_and.Scalar, (idx(8, 3, 5), 3), {}),
        (aten.bitwise_or.Tensor, (idx(8, 3, 5), idx(8, 3, 5)), {}), (aten.bitwise_or.Scalar, (idx(8, 4, 6), 2), {}),
        (aten.bitwise_xor.Tensor, (mask(4, 6), mask(4, 6)), {}), (aten.bitwise_xor.Scalar, (idx(8, 3, 5), 5), {}),
        (aten.bitwise_not.default, (idx(8, 4, 6),), {}), (aten.__and__.Tensor, (mask(4, 6), mask(6)), {}),
        (aten.logical_and.default, (mask(4, 6), mask(4, 6)), {}), (aten.logical_or.default, (x3, mask(3, 5)), {}),
        (aten.logical_xor.default, (mask(3, 5), mask(5)), {}),
        (aten.empty_like.default, (x,), {}),
        (aten.where.ScalarOther, (mask(6, 8), x, 0.0), {}), (aten.where.ScalarSelf, (mask(3, 5), -1.0, x3), {}),
        (aten.max.other, (x, t(8)), {}), (aten.min.other, (x3, t(3, 1)), {}),
        (aten.detach_.default, (t(4, 6),), {}),
        # reductions, scans, FFTs and normalizations
        (aten.any.default, (mask(4, 6),), {}), (aten.any.dim, (mask(4, 6, 8), 1), {}),
        (aten.any.dims, (mask(3, 5), [0], True), {}),
        (aten.argmax.default, (x, 1), {}), (aten.argmax.default, (x3,), {}),
        (aten.argmin.default, (x, -1, True), {}),
        (aten.prod.default, (x3,), {}), (aten.prod.dim_int, (x, 1), {}),
        (aten.cumsum.default, (x, 1), {}), (aten.cumsum.default, (x3, 0), {"dtype": torch.float64}),
        (aten.cumsum.default, (t(6), 0), {}),
        (aten._fft_r2c.default, (x, [2], 0, True), {}),
        (aten._fft_c2r.default, (torch.complex(t(4, 6, 5), t(4, 6, 5)), [2], 0, 8), {}),
        (aten.native_layer_norm_backward.default,
         (t(4, 6, 8), x, [8], ln[1], ln[2], t(8), t(8), [True, True, True]), {}),
        (aten.native_group_norm.default, (gx, t(6), t(6), 4, 6, 5, 3, 1e-5), {}),
        (aten.native_group_norm.default, (t(6, 4, 3), None, None, 6, 4, 3, 2, 1e-5), {}),
        (aten.native_group_norm_backward.default,
         (t(4, 6, 5), gx, gn[1], gn[2], t(6), 4, 6, 5, 3, [True, True, True]), {}),
        (aten._native_batch_norm_legit.default,
         (x, t(6), t(6), torch.zeros(6), torch.ones(6), True, 0.1, 1e-5), {}),
        (aten._native_batch_norm_legit.default,
         (x, None, None, t(6), pos(6), False, 0.1, 1e-5), {}),
        (aten._native_batch_norm_legit.no_stats, (t(5, 3), t(3), t(3), True, 0.1, 1e-5), {}),
        (aten._native_batch_norm_legit_no_training.default, (t(6, 4), t(4), t(4), t(4), pos(4), 0.1, 1e-5), {}),
        # views and data movement
        (aten.numpy_T.default, (t(6, 4),), {}), (aten.broadcast_to.default, (t(4, 1, 8), [4, 6, 8]), {}),
        (aten.stack.default, ([x, t(4, 6, 8)], 1), {}), (aten.stack.default, ([x3, x3], -1), {}),
        (aten.flip.default, (x, [1]), {}), (aten.flip.default, (x3, [0, 1]), {}),
        (aten.diff.default, (x,), {}), (aten.diff.default, (x3, 2, 0, t(1, 5), t(2, 5)), {}),
        (aten.repeat_interleave.self_int, (x3, 2, 1), {}), (aten.repeat_interleave.self_int, (t(6), 2), {}),
        (aten.repeat_interleave.self_int, (t(6, 4), 2, 0), {}), (aten.repeat_interleave.self_int, (t(5, 3), 3, 0), {}),
        (aten.repeat.default, (t(4, 3), [2, 1, 2]), {}), (aten.repeat.default, (x3, [1, 2]), {}),
        (aten.diagonal.default, (t(3, 4, 5), 0, 0, 2), {}), (aten.diagonal.default, (t(6, 6, 4), 1), {}),
        (aten.as_strided.default, (t(4, 6), [3, 2], [1, 4]), {}),
        (aten.select_scatter.default, (x, t(4, 8), 1, 2), {}),
        (aten.slice_scatter.default, (x, t(4, 6, 3), 2, 1, 4), {}),
        (aten.slice_scatter.default, (x3, t(2, 5), 0, 1), {}),
        # indexing, gather/scatter, sorting
        (aten.gather.default, (x, 1, idx(6, 4, 5, 8)), {}), (aten.gather.default, (x3, 0, idx(3, 3, 5)), {}),
        (aten.scatter.src, (t(4, 6, 8), 1, idx(6, 4, 3, 8), t(4, 3, 8)), {}),
        (aten.scatter.value, (t(3, 5), 1, idx(5, 3, 2), 1.5), {}),
        (aten.scatter_add.default, (t(4, 6), 0, idx(4, 3, 6), t(3, 6)), {}),
        (aten.scatter_reduce.two, (t(4, 6), 1, idx(6, 4, 6), t(4, 6), "amax"), {}),
        (aten.scatter_reduce.two, (t(3, 5), 0, idx(3, 3, 5), t(3, 5), "sum"), {"include_self": False}),
        (aten.index_add.default, (t(6, 4), 0, idx(6, 5), t(5, 4)), {}),
        (aten.index_add.default, (t(3, 8), 1, idx(8, 6), t(3, 6)), {"alpha": 2}),
        (aten.index.Tensor, (x, [idx(4, 5)]), {}), (aten.index.Tensor, (x, [None, idx(6, 3, 2)]), {}),
        (aten.index.Tensor, (x, [idx(4, 5), None, idx(8, 5)]), {}),
        (aten.index.Tensor, (t(10, 8), [idx(10, 4, 6)]), {}),
        (aten.index_put.default, (t(6, 8), [idx(6, 4)], t(4, 8)), {}),
        (aten.index_put.default, (t(5, 4), [None, idx(4, 3)], t(3), True), {}),
        (aten.index_put_.default, (t(6, 8), [idx(6, 4)], t(4, 8)), {}),
        (aten.index_select.default, (x, 1, idx(6, 5)), {}), (aten.index_select.default, (x3, 0, idx(3, 4)), {}),
        (aten.sort.default, (x, 1), {}), (aten.sort.default, (x3,), {}),
        (aten.sort.stable, (x,), {"stable": True, "dim": 1}), (aten.sort.stable, (x3,), {"stable": True}),
        (aten.argsort.default, (x, 1), {}), (aten.argsort.default, (x3, 0, True), {}),
        (aten.argsort.stable, (x,), {"stable": True, "dim": 2, "descending": True}),
        (aten.topk.default, (x, 3, 1), {}), (aten.topk.default, (x3, 2), {}),
        (aten.histc.default, (t(4, 6), 10, -2, 2), {}), (aten.histc.default, (x3, 5), {}),
        (aten.nonzero.default, (mask(4, 6),), {}),
        (aten.masked_scatter.default, (t(4, 6), mask(4, 6), t(24)), {}),
        # convolutions
        (aten.convolution.default, (img, t(4, 3, 3, 3), t(4), [1, 1], [1, 1], [1, 1], False, [0, 0], 1), {}),
        (aten.convolution.default, (t(2, 4, 3, 3), t(4, 3, 2, 2), None, [1, 1], [0, 0], [1, 1], True, [0, 0], 1), {}),
        (aten.convolution.default, (t(3, 4, 6), t(4, 2, 3), t(4), [1], [0], [1], False, [0], 2), {}),
        (aten.conv1d.default, (t(2, 4, 7), t(6, 4, 3)), {}), (aten.conv2d.default, (img, t(5, 3, 3, 3), t(5)), {}),
        (aten.conv2d.default, (t(3, 5, 5), t(2, 3, 3, 3)), {}),
        (aten.conv3d.default, (t(2, 2, 4, 4, 4), t(3, 2, 2, 2, 2)), {}),
        (aten.convolution_backward.default, (t(2, 4, 6, 6), img, t(4, 3, 3, 3), [4], [1, 1], [1, 1], [1, 1],
                                             False, [0, 0], 1, [True, True, True]), {}),
        # pooling, upsampling, padding
        (aten._adaptive_avg_pool2d.default, (img, [2, 3]), {}),
        (aten._adaptive_avg_pool3d.default, (t(2, 3, 4, 4, 4), [2, 2, 2]), {}),
        (aten._adaptive_avg_pool2d_backward.default, (t(2, 3, 2, 3), img), {}),
        (aten.avg_pool2d.default, (img, [2, 2]), {}), (aten.avg_pool3d.default, (t(3, 2, 4, 4, 4), [2, 2, 2]), {}),
        (aten.avg_pool2d_backward.default, (t(2, 3, 3, 3), img, [2, 2], [2, 2], [0, 0], False, True, None), {}),
        (aten.max_pool2d_with_indices.default, (img, [2, 2]), {}),
        (aten.max_pool3d_with_indices.default, (t(2, 3, 4, 4, 4), [2, 2, 2]), {}),
        (aten.max_pool2d_with_indices_backward.default,
         (t(*pooled.shape), img, [2, 2], [2, 2], [0, 0], [1, 1], False, where), {}),
        (aten.upsample_bilinear2d.vec, (t(2, 3, 4, 4), None, False, [2.0, 2.0]), {}),
        (aten.upsample_nearest2d.vec, (t(3, 2, 4, 4), [8, 8], None), {}),
        (aten.reflection_pad1d.default, (t(3, 5, 6), [2, 1]), {}),
        (aten.reflection_pad2d.default, (img, [1, 1, 2, 0]), {}),
        (aten.reflection_pad3d.default, (t(2, 3, 4, 4, 4), [1] * 6), {}),
        (aten.replication_pad2d.default, (img, [1, 2, 1, 0]), {}),
        (aten.replication_pad3d.default, (t(2, 3, 4, 4, 4), [1] * 6), {}),
        (aten.constant_pad_nd.default, (x, [1, 2]), {}), (aten.constant_pad_nd.default, (x3, [0, 1, 1, 0], 1.5), {}),
        (aten.pad.default, (x, [1, 1], "constant", 0.0), {}), (aten.pad.default, (t(2, 3, 5), [2, 1], "reflect"), {}),
        (aten.pad.default, (t(4, 6, 3, 2), [0, 0, 0, 0, 0, 2, 0, 0], "constant", 0.0), {}),   # Mamba-2's sequence pad
        (aten.grid_sampler_2d.default, (t(2, 3, 5, 5), unit(2, 4, 4, 2), 0, 0, False), {}),
        (aten.col2im.default, (t(2, 12, 9), [4, 4], [2, 2], [1, 1], [0, 0], [1, 1]), {}),
        # embedding backward and bags, distances
        (aten.embedding_dense_backward.default, (x, idx(10, 4, 6), 10, -1, False), {}),
        (aten._embedding_bag.default, (t(10, 4), idx(10, 6), bags, False, 0), {}),
        (aten._embedding_bag.default, (t(10, 4), idx(10, 6), bags, False, 0, False, pos(6)), {}),
        (aten._embedding_bag.default, (t(10, 4), idx(10, 6), bags, False, 1), {}),
        (aten._embedding_bag.default, (t(10, 5), idx(10, 6), bags, False, 2), {}),
        (aten._cdist_forward.default, (t(2, 5, 4), t(2, 6, 4), 2.0, None), {}),
        (aten._pdist_forward.default, (t(5, 4), 2.0), {}),
        # numbers read from a tensor
        (aten.sym_size.int, (x, 1), {}), (aten.sym_numel.default, (x3,), {}),
        (aten.sym_stride.int, (x, 0), {}), (aten.sym_storage_offset.default, (x,), {}),
        (aten._local_scalar_dense.default, (torch.tensor(2.5),), {}),
        # factories with unspecified or random values
        (aten.empty.memory_format, ([4, 6],), {}), (aten.empty_strided.default, ([3, 5], [5, 1]), {}),
        (aten.new_empty.default, (x, [4, 6, 5]), {}), (aten.new_empty.default, (x3, [7, 3]), {}),
        (aten.new_empty_strided.default, (x3, [3, 5], [5, 1]), {}),
        (aten.rand.default, ([4, 6],), {}), (aten.randn.default, ([3, 5],), {}),
        (aten.randperm.default, (7,), {}),
    ]


def _external_samples(t, idx) -> list:
    """Samples of other libraries' ops (by name), where the library is installed."""
    grouped_mm = resolve("transformers.grouped_mm_fallback.default")
    if grouped_mm is None:
        return []
    return [(grouped_mm, (t(7, 6), t(3, 6, 4), torch.tensor([2, 5, 7])), {}),
            (grouped_mm, (t(6, 5), t(4, 5, 6), torch.tensor([0, 3, 3, 6])), {})]
