"""The autograd-aware collectives of the runtime and their conjugates, and collective matmul
against plain torch on the whole tensors, on real processes."""
from __future__ import annotations

import torch
import torch.distributed as dist

import torch.nn.functional as F

from autopar.runtime.collmatmul import all_gather_matmul, matmul_reduce_scatter
from autopar.runtime.comm import AxisComm, CommStats, all_gather, all_reduce, copy_to_axis, reduce_scatter

def comm_functions():
    """The autograd-aware collectives and their conjugate backward, with byte counts."""
    world, rank = dist.get_world_size(), dist.get_rank()
    stats = CommStats()
    comm = AxisComm("dp", world, rank, dist.group.WORLD, stats)
    res = {}
    x = torch.arange(6.0).reshape(2, 3).add(10 * rank).requires_grad_()
    y = all_gather(x, comm, dim=1)                       # (2, 3*world)
    (y * torch.arange(y.numel(), dtype=torch.float32).view_as(y)).sum().backward()
    res["ag"], res["ag_grad"] = y.detach(), x.grad.clone()
    z = torch.ones(4 * world, 2).mul(rank + 1).requires_grad_()
    s = reduce_scatter(z, comm, dim=0)                  # (4, 2)
    s.sum().backward()
    res["rs"], res["rs_grad"] = s.detach(), z.grad.clone()
    a = torch.full((3,), float(rank + 1), requires_grad=True)
    r = all_reduce(a, comm)
    (r * 2).sum().backward()
    res["ar"], res["ar_grad"] = r.detach(), a.grad.clone()
    b = torch.ones(3, requires_grad=True)
    c = copy_to_axis(b, comm)
    (c * (rank + 1)).sum().backward()
    res["f_grad"] = b.grad.clone()
    res["bytes"] = dict(stats.bytes)
    return res


# ---- collective matmul ----------------------------------------------------------------------------

S_LOCAL = 3   # rows of the decomposed dim per rank
# (x shape with "S" for the whole decomposed dim, dim, with bias)
CASES = [((2, "S", 8), 1, True), (("S", 2, 8), 0, False), ((2, 3, "S", 8), -2, True)]


def _shape(spec, world, last=None):
    shape = [S_LOCAL * world if d == "S" else d for d in spec]
    if last is not None:
        shape[-1] = last
    return shape


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _grads(*ts):
    return [None if t is None else t.grad for t in ts]


def _comm(world, rank):
    stats = CommStats()
    return AxisComm("tp", world, rank, dist.group.WORLD, stats), stats


def _counters(stats):
    return dict(stats.bytes), dict(stats.calls)


def all_gather_matmul_job(spec, dim, with_bias):
    """Column-parallel linear on a sequence-sharded x: out features split over the ranks."""
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    out_local = 5
    X = torch.randn(_shape(spec, world))
    W = torch.randn(out_local * world, X.shape[-1])
    B = torch.randn(out_local * world) if with_bias else None
    Y_ref = F.linear(X, W, B)
    G = torch.randn_like(Y_ref)
    d = dim % X.dim()
    rows, cols = slice(rank * S_LOCAL, (rank + 1) * S_LOCAL), slice(rank * out_local, (rank + 1) * out_local)
    g_local = G[..., cols]

    res = {}
    for name in ("decomposed", "plain"):
        x = _leaf(X.narrow(d, rows.start, S_LOCAL))
        w = _leaf(W[cols])
        b = _leaf(B[cols]) if with_bias else None
        comm, stats = _comm(world, rank)
        if name == "decomposed":
            y = all_gather_matmul(x, w, b, comm, dim, size=X.shape[d])
        else:
            y = F.linear(all_gather(x, comm, d), w, b)
        (y * g_local).sum().backward()
        res[name] = dict(y=y.detach(), grads=_grads(x, w, b), counters=_counters(stats))

    Xr, Wr = _leaf(X), _leaf(W)
    Br = _leaf(B) if with_bias else None
    (F.linear(Xr, Wr, Br) * G).sum().backward()
    res["ref"] = dict(y=Y_ref[..., cols], grads=[Xr.grad.narrow(d, rows.start, S_LOCAL), Wr.grad[cols],
                                                 Br.grad[cols] if with_bias else None])
    res["x_bytes"] = X.numel() * X.element_size()
    return res


def matmul_reduce_scatter_job(spec, dim, with_bias):
    """Row-parallel linear whose output is reduce-scattered along the sequence: in features split."""
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(1)
    in_local, out = 4, 6
    X = torch.randn(_shape(spec, world, last=in_local * world))
    W = torch.randn(out, X.shape[-1])
    B = torch.randn(out) if with_bias else None
    Y_ref = F.linear(X, W, B)
    G = torch.randn_like(Y_ref)
    d = dim % X.dim()
    start, cols = rank * S_LOCAL, slice(rank * in_local, (rank + 1) * in_local)
    g_local = G.narrow(d, start, S_LOCAL)

    res = {}
    for name in ("decomposed", "plain"):
        x = _leaf(X[..., cols])
        w = _leaf(W[:, cols])
        b = _leaf(B) if with_bias else None
        comm, stats = _comm(world, rank)
        if name == "decomposed":
            y = matmul_reduce_scatter(x, w, b, comm, dim)
        else:
            y = reduce_scatter(F.linear(x, w), comm, d)
            y = y + b if with_bias else y
        (y * g_local).sum().backward()
        res[name] = dict(y=y.detach(), grads=_grads(x, w, b), counters=_counters(stats))

    Xr, Wr = _leaf(X), _leaf(W)
    Br = _leaf(B) if with_bias else None
    (F.linear(Xr, Wr, Br) * G).sum().backward()
    # the replicated bias: this rank's addend is the sum over its own output shard
    own_b = g_local.reshape(-1, out).sum(0) if with_bias else None
    res["ref"] = dict(y=Y_ref.narrow(d, start, S_LOCAL), grads=[Xr.grad[..., cols], Wr.grad[:, cols], own_b])
    res["whole_bias_grad"] = Br.grad if with_bias else None
    res["y_bytes"] = Y_ref.numel() * Y_ref.element_size()
    return res


def cases_job(job):
    return [job(*case) for case in CASES]
