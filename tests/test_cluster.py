"""Cluster descriptions: preset datasheet numbers, which link an axis rides on, the local
calibration and its cache."""
import dataclasses
import math
import os
import shutil
import time
import warnings

import pytest
import torch

from autopar.cost.calibration import calibrate_local
from autopar.cost import cache, drift
from autopar.cost.cluster import PRESETS, Cluster, Device, Link, cached_local, cited_fields, get_cluster

pytestmark = pytest.mark.timeout(300)

GB = 1e9


def test_a100_preset_has_datasheet_numbers():
    c = get_cluster("dgx-a100-80gb")
    assert c is PRESETS["dgx-a100-80gb"]
    d = c.device
    assert (d.peak_flops, d.mem_bandwidth, d.memory_bytes) == (312e12, 2039 * GB, 80 * 10**9)
    assert (d.matmul_efficiency, d.memory_efficiency) == (0.601, 0.88)
    # the datasheet's fp32 (CUDA cores) and TF32 tensor-core rates, dense
    assert (d.fp32_flops, d.tf32_flops) == (19.5e12, 156e12)
    assert c.gpus_per_node == 8
    assert c.intra == Link("nvlink", 300 * GB, 5e-6)
    assert c.inter == Link("infiniband", 25 * GB, 1e-5)
    assert c.host == Link("pcie", 32 * GB, 1e-5)
    assert "DGX A100 datasheet" in c.source and "A100 Tensor Core GPU datasheet" in c.source


def test_h100_preset_has_datasheet_numbers():
    c = get_cluster("dgx-h100")
    d = c.device
    assert (d.peak_flops, d.mem_bandwidth, d.memory_bytes) == (989e12, 3350 * GB, 80 * 10**9)
    # the A100's fitted efficiency x the published maximum-achievable-matmul ratio 80.1% / 85.9%
    assert d.matmul_efficiency == pytest.approx(0.601 * (792.1 / 989) / (267.9 / 312), abs=1e-3)
    assert d.memory_efficiency == 0.84
    # the H100 whitepaper's SXM5 fp32 (non-tensor) and TF32 tensor rates, dense
    assert (d.fp32_flops, d.tf32_flops) == pytest.approx((66.9e12, 494.7e12))
    assert c.gpus_per_node == 8
    assert c.intra == Link("nvlink", 450 * GB, 5e-6)
    assert c.inter == Link("infiniband", 50 * GB, 1e-5)
    assert c.host == Link("pcie", 64 * GB, 1e-5)
    assert "DGX H100 datasheet" in c.source and "H100 Tensor Core GPU datasheet" in c.source


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_number_has_a_source(name):
    """Every number of a preset (device, links, node size) is cited in its
    ``citations``; efficiencies name a measurement or a fit, not "calibrated elsewhere";
    the local-only fields stay at their defaults; ``source`` lists the citations."""
    c = PRESETS[name]
    cited = dict(c.citations)
    missing = [f for f in cited_fields(c) if not cited.get(f, "").strip()]
    assert not missing, f"{name}: no source for {missing}"
    assert set(cited) <= set(cited_fields(c)), set(cited) - set(cited_fields(c))
    for f in ("device.matmul_efficiency", "device.memory_efficiency"):
        assert "calibrated elsewhere" not in cited[f] and any(ch.isdigit() for ch in cited[f]), cited[f]
    for level in (c.intra, c.inter, c.host):
        assert (level.fits, level.hop, level.hop_interleaved, level.wake, level.skew) == ((), 0.0, 0.0, 0.0, ())
    assert c.shared is None and c.contention == ()
    assert all(text in c.source for text in cited.values())


@pytest.mark.parametrize("name", list(PRESETS))
def test_axis_link_inside_and_across_nodes(name):
    c = PRESETS[name]
    axes = {"pp": 8, "dp": 24, "tp": 8}
    assert c.axis_link(axes, "tp").name == "nvlink"
    assert c.axis_link(axes, "dp") is c.inter and c.inter.name in ("infiniband", "rdma")
    assert c.axis_link(axes, "pp") is c.inter
    assert c.axis_link({"dp": 2, "tp": 4}, "dp") is c.intra   # 8 ranks: one node
    assert c.axis_link({"dp": 2, "tp": 4}, "tp") is c.intra
    assert c.axis_link({"dp": 16}, "dp") is c.inter
    assert c.axis_link({"dp": 16, "tp": 1}, "tp") is c.intra   # size 1: no collective
    assert c.axis_link({"dp": 4, "tp": 3}, "tp") is c.inter    # ranks 6, 7, 8 straddle two nodes


def test_axis_link_accepts_a_mesh():
    from autopar import Mesh
    c = PRESETS["dgx-h100"]
    assert c.axis_link(Mesh(dp=4, tp=8, virtual=True), "dp") is c.inter
    assert c.axis_link(Mesh(dp=4, tp=8, virtual=True), "tp") is c.intra


def test_axis_link_unknown_axis_names_the_axes():
    with pytest.raises(ValueError, match=r"'cp'.*\['dp', 'tp'\]"):
        PRESETS["dgx-h100"].axis_link({"dp": 2, "tp": 4}, "cp")


def test_get_cluster_unknown_name_lists_the_choices():
    with pytest.raises(ValueError) as e:
        get_cluster("dgx-b200")
    msg = str(e.value)
    for word in ("'dgx-b200'", "dgx-a100-80gb", "dgx-h100", "local", "Cluster object"):
        assert word in msg
    with pytest.raises(ValueError, match="Cluster object"):
        get_cluster(8)


def test_get_cluster_returns_a_cluster_object_as_is():
    c = PRESETS["dgx-h100"].with_(name="mine", gpus_per_node=4)
    assert get_cluster(c) is c
    assert (c.gpus_per_node, c.device) == (4, PRESETS["dgx-h100"].device)
    with pytest.raises(ValueError, match="peak_flops"):
        c.with_(peak_flops=1.0)


def test_slowdown_of_ranks_sharing_the_machine():
    """The local preset's measured slowdown, linear between the measured process counts and in
    proportion beyond the last; the fair share without a measurement; 1 on GPU presets."""
    base = PRESETS["dgx-h100"].with_(name="local", gpus_per_node=2)
    c = dataclasses.replace(base, contention=((2, 1.1), (4, 2.4)))
    assert c.slowdown(1) == 1.0 and c.slowdown(2) == pytest.approx(1.1) and c.slowdown(4) == pytest.approx(2.4)
    assert c.slowdown(3) == pytest.approx(1.75) and c.slowdown(8) == pytest.approx(4.8)
    assert base.slowdown(1) == 1.0 and base.slowdown(2) == 1.0 and base.slowdown(6) == 3.0
    assert PRESETS["dgx-h100"].slowdown(64) == 1.0


def test_contention_is_the_ranks_shared_throughput():
    """The contention probe's slowdown with k processes is k loops over the sum of the ranks'
    rates (their harmonic mean over the loop alone), not the mean of each rank's pace: three
    ranks at 2x alone and one starved at 4x share 2 cores at 4 / (3/2 + 1/4) = 2.29x (their
    mean would say 2.5x); ranks alike read their common slowdown; never below 1."""
    from autopar.cost.calibration.host_fits import slowdowns
    alone = 1e-3
    got = dict(slowdowns(alone, {4: [2e-3, 2e-3, 2e-3, 4e-3], 2: [1.05e-3, 1.05e-3], 1: [0.9e-3]}))
    assert got[4] == pytest.approx(4 / (3 / 2 + 1 / 4)) and got[2] == pytest.approx(1.05) and got[1] == 1.0


def test_contention_keeps_the_median_of_its_readings():
    """Several readings of k processes at once: each the ranks' shared throughput, the median of
    them kept, so that one reading taken while something else ran on the machine moves nothing."""
    from autopar.cost.calibration.host_fits import slowdowns
    alone = 1e-3
    readings = {4: [[2.2e-3] * 4, [2.8e-3] * 4, [2.1e-3, 2.1e-3, 2.1e-3, 2.4e-3]], 2: [[1.1e-3] * 2, [1.2e-3] * 2, [1e-3] * 2]}
    got = dict(slowdowns(alone, readings))
    assert got[4] == pytest.approx(2.2) and got[2] == pytest.approx(1.1)



def test_compute_probes_read_their_inputs_from_a_pool_beyond_the_cache():
    """The matmul, pointwise and attention probes take each call's inputs from the next copy of
    a pool of at least ``POOL_BYTES``, distinct tensors in turn, so that no call reads what
    the last one left in the core's cache."""
    import torch
    from autopar.cost.calibration.compute_probes import POOL_BYTES, input_pool, rotating
    pool = input_pool(lambda: (torch.zeros(256, 256), torch.zeros(64)))
    per = 256 * 256 * 4 + 64 * 4
    assert len(pool) * per >= POOL_BYTES - per and len({id(e[0]) for e in pool}) == len(pool)
    seen = []
    call = rotating(pool, lambda a, b: seen.append(id(a)))
    for _ in range(len(pool) + 1):
        call()
    assert seen[:len(pool)] == [id(e[0]) for e in pool] and seen[-1] == seen[0]

def test_skew_table_sets_the_latency_by_the_compute_before():
    """A link of ranks sharing cores takes a small collective's latency from its table at the
    compute that preceded it: linear between the measured lengths, flat beyond them, 1 ms
    when not given; the bandwidth term stays the fit's."""
    from autopar.cost.comm import collective_time
    fits = (("all_reduce", 2, 5e-4, 1e-9),)
    skew = (("all_reduce", 2, 2e-4, 1e-3), ("all_reduce", 2, 1e-3, 2e-3), ("all_reduce", 2, 4e-3, 5e-3))
    plain, crowded = Link("gloo", 1e9, 1e-4, fits=fits), Link("gloo", 1e9, 1e-4, fits=fits, skew=skew)
    moved = 2 * (2 - 1) / 2 * 4096
    assert collective_time("all_reduce", 4096, 2, plain, after=4e-3) == pytest.approx(5e-4 + 1e-9 * moved)
    for after, alpha in ((None, 2e-3), (1e-4, 1e-3), (6e-4, 1.5e-3), (2.5e-3, 3.5e-3), (1.0, 5e-3)):
        assert collective_time("all_reduce", 4096, 2, crowded, after=after) == pytest.approx(alpha + 1e-9 * moved)


def test_skew_scale_sets_the_tables_level_on_the_runtimes_own_steps():
    """``Link.skew_scale`` multiplies every latency the skew table gives (its shape along the
    compute kept), not the bandwidth term; the calibration's scale is what its tp stacks'
    collectives blocked a rank for over the table's latency of their kinds after the CPU
    work between them (``skew_scale``), 1 where either is missing; a scale that is not a
    positive finite number is refused."""
    from autopar.cost.calibration.link_fits import skew_scale
    from autopar.cost.comm import collective_time
    fits = (("all_reduce", 2, 5e-4, 1e-9), ("all_gather", 2, 4e-4, 1e-9))
    skew = (("all_reduce", 2, 2e-4, 1e-3), ("all_reduce", 2, 1e-3, 2e-3),
            ("all_gather", 2, 2e-4, 6e-4), ("all_gather", 2, 1e-3, 1e-3))
    link = Link("gloo", 1e9, 1e-4, fits=fits, skew=skew)
    scaled = dataclasses.replace(link, skew_scale=0.75)
    moved = 2 * (2 - 1) / 2 * 4096
    assert collective_time("all_reduce", 4096, 2, scaled, after=6e-4) == pytest.approx(0.75 * 1.5e-3 + 1e-9 * moved)
    # after 6e-4 s of CPU work the table says 1.5 ms (all-reduce) and 0.8 ms (all-gather)
    blocked = 0.9e-3
    # (the probe's collectives are of 4 bytes: their bandwidth term, 4 ns here, is within rel=1e-4)
    assert skew_scale(link, blocked, 6e-4, ["all_reduce"]) == pytest.approx((blocked / 1.5e-3, 1.5e-3), rel=1e-4)
    assert skew_scale(link, blocked, 6e-4, ["all_gather", "all_reduce"])[0] == pytest.approx(blocked / 1.15e-3, rel=1e-4)
    assert skew_scale(link, 0.0, 6e-4, ["all_reduce"])[0] == 1.0
    assert skew_scale(Link("gloo", 1e9, 1e-4, fits=fits), blocked, 6e-4, ["all_reduce"])[0] == 1.0
    for bad in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match="skew_scale"):
            Link("gloo", 1e9, 1e-4, skew_scale=bad)


def test_a_pooled_skew_table_prices_every_kind_at_the_kinds_mean():
    """On a link with ``skew_pooled`` (the 2-process link, whose level the tp probe reads on
    the runtime's own steps) every collective kind of a group size takes the mean of the kinds'
    points at each compute length, at ``skew_scale``; p2p keeps its own table, and a link
    without the flag each kind its own. The calibration's scale is then taken against that
    mean, so the probe's all-reduces and a tp+sp step's all-gathers and reduce-scatters are
    priced at one level."""
    from autopar.cost.calibration.link_fits import skew_scale
    from autopar.cost.comm import collective_time
    fits = (("all_reduce", 2, 5e-4, 1e-9), ("all_gather", 2, 4e-4, 1e-9), ("reduce_scatter", 2, 4e-4, 1e-9),
            ("p2p", 2, 1e-4, 1e-9))
    skew = (("all_reduce", 2, 2e-4, 1e-3), ("all_reduce", 2, 1e-3, 2e-3),
            ("all_gather", 2, 2e-4, 0.7e-3), ("all_gather", 2, 1e-3, 1.3e-3),
            ("reduce_scatter", 2, 2e-4, 1.3e-3), ("reduce_scatter", 2, 1e-3, 2.7e-3),
            ("p2p", 2, 2e-4, 0.2e-3), ("p2p", 2, 1e-3, 0.4e-3))
    own = Link("gloo", 1e9, 1e-4, fits=fits, skew=skew)
    pooled = dataclasses.replace(own, skew_pooled=True)
    # the kinds' mean: 1.0 ms after 0.2 ms of compute, 2.0 ms after 1 ms; 1.5 ms half-way
    # a ring's bytes each rank sends on 2 ranks: 2(N-1)/N of the buffer for an all-reduce, (N-1)/N otherwise
    for kind, moved in (("all_reduce", 4096), ("all_gather", 2048), ("reduce_scatter", 2048)):
        assert collective_time(kind, 4096, 2, pooled, after=6e-4) == pytest.approx(1.5e-3 + 1e-9 * moved)
        assert collective_time(kind, 4096, 2, dataclasses.replace(pooled, skew_scale=0.8), after=1e-3) == \
            pytest.approx(0.8 * 2.0e-3 + 1e-9 * moved)
    assert collective_time("all_gather", 4096, 2, own, after=6e-4) == pytest.approx(1.0e-3 + 1e-9 * 2048)
    assert collective_time("reduce_scatter", 4096, 2, own, after=6e-4) == pytest.approx(2.0e-3 + 1e-9 * 2048)
    assert collective_time("p2p", 4096, 2, pooled, after=6e-4) == collective_time("p2p", 4096, 2, own, after=6e-4)
    # the probe's all-reduces blocked 1.2 ms after 0.6 ms of CPU work: 1.2 / 1.5 on the pooled
    # link, 1.2 / 1.5 on the all-reduce's own table too (its points happen to be the mean here at
    # 0.6 ms), but 1.2 / 1.0 against the all-gather's own
    assert skew_scale(pooled, 1.2e-3, 6e-4, ["all_reduce"])[0] == pytest.approx(0.8, rel=1e-4)
    assert skew_scale(own, 1.2e-3, 6e-4, ["all_gather"])[0] == pytest.approx(1.2, rel=1e-4)


def _shared_cores_cluster(shared: Link):
    """A local-like preset of 2 cores whose 4 ranks share them over ``shared``: contention 2.5
    at 4 processes, host work per tensor 10 us (ddp) and 200 us (ZeRO-3)."""
    own = Link("own-core", 1e9, 2e-4)
    base = PRESETS["dgx-h100"]
    device = dataclasses.replace(base.device, sync_overhead=(("ddp", 1e-5), ("zero3", 2e-4)))
    return base.with_(name="local", device=device, gpus_per_node=2, intra=own, inter=own,
                      contention=((2, 1.0), (4, 2.5)), shared=shared)


def test_zero3s_host_work_on_shared_cores_is_fitted_where_the_model_grows_as_its_steps_did():
    """ZeRO-3's host work per tensor on ranks sharing cores (``Cluster.shared_sync``, fitted by
    ``shared_sync_factor``): the factor on its charge at the contention at which the cost
    model's ZeRO-3 step of the calibration's synthetic stack on 4 processes of 2 cores grows
    from 2 to 8 blocks as the slowest rank's measured step did. Planted: the measured steps
    are the model's own at 0.6 (one rank; the other 10% quicker), recovered within 1%; steps
    that do not grow leave the charge whole (1). The factor moves only a mesh of more ranks
    than cores, only under its mode, by the host work it scales: sync_overhead x tensors x
    contention x (1 - factor), written here."""
    import autopar
    from autopar.cost.calibration.host_fits import shared_sync_factor, stack_growth
    from autopar.cost.calibration.stack import SYNC_BLOCKS, Stack
    from autopar.cost.estimate import Profiles, evaluate_plan
    kinds = ("all_reduce", "all_gather", "reduce_scatter")
    shared = Link("shared", 1e9, 1e-4, fits=tuple((k, 4, 5e-4, 1e-9) for k in kinds))
    cluster = _shared_cores_cluster(shared)
    lo, hi = SYNC_BLOCKS
    growth = stack_growth(cluster, 4, "zero3")
    slowest = {("zero3", lo): 0.05, ("zero3", hi): 0.05 + growth(0.6)}
    quicker = {key: 0.9 * t for key, t in slowest.items()}
    factor, measured, at_one = shared_sync_factor(cluster, 4, [quicker, slowest])
    assert factor == pytest.approx(0.6, rel=0.01)
    assert measured == pytest.approx(growth(0.6)) and at_one == pytest.approx(growth(1.0))
    assert at_one > measured
    assert shared_sync_factor(cluster, 4, [{key: 0.05 for key in slowest}])[0] == 1.0
    # the charge it moves: 8 blocks of 12 tensors
    prof = Profiles(Stack(8, hi), (torch.randn(4, 8),), blocks_once=False)
    fitted = dataclasses.replace(cluster, shared_sync=(("zero3", 0.6),))
    step = {(c.shared_sync, mode, world): evaluate_plan(prof, {"dp": world}, autopar.Plan(dp=mode), c, 4 * world).step_time_s
            for c in (cluster, fitted) for mode in ("ddp", "zero3") for world in (2, 4)}
    assert step[((), "zero3", 4)] - step[(fitted.shared_sync, "zero3", 4)] == pytest.approx(2e-4 * 12 * hi * 2.5 * 0.4, rel=1e-3)
    for mode, world in (("ddp", 4), ("zero3", 2), ("ddp", 2)):
        assert step[((), mode, world)] == step[(fitted.shared_sync, mode, world)]
    with pytest.raises(ValueError, match="shared_sync"):
        cluster.with_(shared_sync=(("zero3", 0.0),))


def test_the_stacks_collective_level_is_fitted_where_the_models_tp_step_grows_as_its_steps_did():
    """The level of the shared link's skew table on the calibration's synthetic stacks
    (``shared_skew_scale``): the ``Link.skew_scale`` at which the cost model's ``Plan(tp=True)``
    step of the stack on ``Mesh(tp=4)`` of 2 cores grows from 2 to 8 blocks as the slowest
    rank's measured step did. Planted at 0.7 and recovered within 1%; out-of-range growth is
    held to [1/4, 2]. With a flat table of alpha a, what the scale moves is a x (1 - scale) per
    tp collective: each of a block's two MLP halves all-reduces once forward and once backward,
    4 a block, written here. ZeRO-3's factor is read with the stacks' collectives at that level
    (``shared_sync_factor(scale=...)``)."""
    from autopar.cost.calibration.host_fits import shared_skew_scale, shared_sync_factor, stack_growth
    from autopar.cost.calibration.stack import SYNC_BLOCKS
    kinds = ("all_reduce", "all_gather", "reduce_scatter")
    alpha = 2e-3
    skew = tuple((k, g, t, alpha) for k in kinds for g in (2, 4) for t in (2e-4, 1e-3, 4e-3))
    shared = Link("shared", 1e9, 1e-4, fits=tuple((k, g, 5e-4, 1e-9) for k in kinds for g in (2, 4)), skew=skew)
    cluster = _shared_cores_cluster(shared)
    lo, hi = SYNC_BLOCKS
    growth = stack_growth(cluster, 4, "tp", "skew_scale")
    assert growth(1.0) - growth(0.7) == pytest.approx(alpha * 0.3 * 4 * (hi - lo), rel=1e-6)
    slowest = {("tp", lo): 0.05, ("tp", hi): 0.05 + growth(0.7)}
    quicker = {key: 0.9 * t for key, t in slowest.items()}
    scale, measured, at_one = shared_skew_scale(cluster, 4, [quicker, slowest])
    assert scale == pytest.approx(0.7, rel=0.01)
    assert measured == pytest.approx(growth(0.7)) and at_one == pytest.approx(growth(1.0))
    assert shared_skew_scale(cluster, 4, [{("tp", lo): 0.05, ("tp", hi): 0.05 + growth(0.1)}])[0] == 0.25
    assert shared_skew_scale(cluster, 4, [{("tp", lo): 0.05, ("tp", hi): 0.05 + 10 * growth(1.0)}])[0] == 2.0
    assert shared_skew_scale(cluster, 4, [{key: 0.05 for key in slowest}])[0] == 1.0
    # ZeRO-3's factor read with the stacks' collectives at that level: a planted factor recovered,
    # where the table as measured would read the collectives' excess as host work
    scaled = dataclasses.replace(cluster, shared=dataclasses.replace(shared, skew_scale=0.7))
    z = stack_growth(scaled, 4, "zero3")
    steps = [{("zero3", lo): 0.05, ("zero3", hi): 0.05 + z(0.6)}]
    assert shared_sync_factor(cluster, 4, steps, scale=0.7)[0] == pytest.approx(0.6, rel=0.01)
    assert shared_sync_factor(cluster, 4, steps)[0] < 0.5


def test_skew_first_scales_the_tables_shortest_point_and_is_read_on_the_stacks_tp_steps():
    """``Link.skew_first`` multiplies the skew table's shortest compute point (every kind but
    p2p, the pooled mean on a pooled link); between it and the next point the latency is the
    line between the two, from the next point on the table as measured, written here. The
    calibration reads it (``shared_skew_first``) where the cost model's ``Plan(tp=True)`` step
    of the synthetic stack on ``Mesh(tp=4)`` of 2 cores grows from 2 to 8 blocks as the slowest
    rank's measured step did: planted at 0.4, recovered within 1%, held to [1/8, 2], 1 where
    nothing grows; the ZeRO-3 fit is not moved by it (``shared_sync_factor`` reads the
    stacks at ``skew_scale``)."""
    from autopar.cost.calibration.host_fits import shared_skew_first, stack_growth
    from autopar.cost.calibration.stack import SYNC_BLOCKS
    from autopar.cost.comm import collective_time, skew_table
    kinds = ("all_reduce", "all_gather", "reduce_scatter")
    points = {2e-4: 2e-3, 1e-3: 3e-3, 4e-3: 5e-3}
    skew = tuple((k, 4, t, a) for k in kinds + ("p2p",) for t, a in points.items())
    fits = tuple((k, 4, 5e-4, 0.0) for k in kinds + ("p2p",))
    link = Link("shared", 1e9, 1e-4, fits=fits, skew=skew)
    half = dataclasses.replace(link, skew_first=0.5)
    along = ((1e-4, 1e-3), (2e-4, 1e-3), (6e-4, (1e-3 + 3e-3) / 2), (1e-3, 3e-3), (2.5e-3, 4e-3), (8e-3, 5e-3))
    for after, want in along:
        for kind in kinds:
            assert collective_time(kind, 4096, 4, half, after=after) == pytest.approx(want, rel=1e-9), (kind, after)
        assert collective_time("p2p", 4096, 4, half, after=after) == collective_time("p2p", 4096, 4, link, after=after)
    pooled = dataclasses.replace(half, skew_pooled=True)
    want = ((2e-4, 1e-3), (1e-3, 3e-3), (4e-3, 5e-3))
    assert skew_table(pooled, "all_gather", 4) == [(t, pytest.approx(a)) for t, a in want]
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="skew_first"):
            Link("gloo", 1e9, 1e-4, skew_first=bad)
    # read on the stacks' tp steps
    cluster = _shared_cores_cluster(link)
    lo, hi = SYNC_BLOCKS
    growth = stack_growth(cluster, 4, "tp", "skew_first")
    assert growth(1.0) > growth(0.4) > 0
    slowest = {("tp", lo): 0.05, ("tp", hi): 0.05 + growth(0.4)}
    quicker = {key: 0.9 * t for key, t in slowest.items()}
    first, measured, at_one = shared_skew_first(cluster, 4, [quicker, slowest])
    assert first == pytest.approx(0.4, rel=0.01)
    assert measured == pytest.approx(growth(0.4)) and at_one == pytest.approx(growth(1.0))
    assert shared_skew_first(cluster, 4, [{("tp", lo): 0.05, ("tp", hi): 0.05 + 0.01 * growth(1.0)}])[0] == 0.125
    assert shared_skew_first(cluster, 4, [{("tp", lo): 0.05, ("tp", hi): 0.05 + 10 * growth(1.0)}])[0] == 2.0
    assert shared_skew_first(cluster, 4, [{key: 0.05 for key in slowest}])[0] == 1.0


def test_the_runtime_hop_fit_recovers_a_known_message_latency(caplog):
    """The calibration's fit of a pipeline message's cost (``fit_runtime_hop``) against a
    closed form: GPipe on 2 stages of equal F and B, m micro-batches, a message latency h
    and no contention lasts (m + 1)(F + B) + 2h, F and B each with a message's CPU time (h no
    longer than F: each receive is posted before its send, and the rendezvous delays nothing)."""
    from autopar.cost.calibration import link_fits
    m, f, b, msg, h = 4, 9e-4, 1.2e-3, 1e-4, 6.5e-4
    per_stage = [{"F": f, "B": b, "W": 0.0}] * 2
    measured = (m + 1) * (f + msg + b + msg) + 2 * h
    alone = ((2, 1.0), (4, 1.0))      # no slowdown: the replay runs each rank at full speed
    assert link_fits.fit_runtime_hop([("gpipe", per_stage, [msg, msg], measured)], 2, alone) == pytest.approx(h, rel=1e-6)
    # the median of several pipelines' fits; one that no latency up to 50 ms explains is left
    # out, with a warning; none at all fits 0
    two = [("gpipe", per_stage, [msg, msg], measured + 2 * d) for d in (0.0, 2e-4, 4e-4)]
    assert link_fits.fit_runtime_hop(two, 2, alone) == pytest.approx(h + 2e-4, rel=1e-6)
    with caplog.at_level("WARNING"):
        assert link_fits.fit_runtime_hop([("gpipe", per_stage, [msg, msg], 1.0)], 2, alone) == 0.0
    assert "no hop fitted" in caplog.text
    assert link_fits.fit_runtime_hop([("gpipe", per_stage, [msg, msg], 1e-4)], 2, alone) == 0.0


def test_the_interleaved_hop_is_fitted_on_interleaved_pipelines_and_used_for_them():
    """An interleaved pipeline (2 stages a rank: 4 stages, the probe's replay) is replayed with
    its 4 stages, and the fit inverts the replay: a schedule made with latency h fits h. The
    calibration fits each schedule on its own pipelines (``schedules``), and the estimate's
    message time takes ``hop_interleaved`` for the interleaved schedule only."""
    from autopar.cost.calibration import link_fits
    from autopar.cost.comm import pipeline_hop_time
    from autopar.schedule import build_schedule, simulate
    f, b, msg, h = 4e-4, 7e-4, 1e-4, 1.3e-3
    per_stage = [{"F": f, "B": b, "W": 0.0}] * 4
    alone = ((2, 1.0), (4, 1.0))
    sched = build_schedule("interleaved", 2, 4, 2)
    measured = simulate(sched, duration=lambda a: (f if a.kind == "F" else b) + msg,
                               latency=lambda a: h, rendezvous=True).makespan
    replays = [("interleaved", per_stage, [msg] * 4, measured),
               ("1f1b", per_stage[:2], [msg] * 2, (4 + 1) * (f + b + 2 * msg) + 2 * 5e-4)]
    assert link_fits.fit_runtime_hop(replays, 2, alone, ("interleaved",)) == pytest.approx(h, rel=1e-6)
    one = link_fits.fit_runtime_hop(replays, 2, alone, ("1f1b",))
    assert 0 <= one < h and one != pytest.approx(h)
    link = Link("gloo", 1e9, 1e-4, fits=(("p2p", 2, 1e-4, 1e-9),), hop=5e-4, hop_interleaved=h)
    assert pipeline_hop_time(1000, link, schedule="interleaved") == pytest.approx(h + 1e-6)
    for schedule in ("1f1b", "zero_bubble", None):
        assert pipeline_hop_time(1000, link, schedule=schedule) == pytest.approx(5e-4 + 1e-6)
    assert pipeline_hop_time(1000, dataclasses.replace(link, hop_interleaved=0.0),
                             schedule="interleaved") == pytest.approx(5e-4 + 1e-6)


def test_the_wake_is_fitted_on_pipelines_where_a_woken_rank_can_find_every_core_taken(caplog):
    """``Link.wake`` (a rank its message woke waits that long for a core when every one is
    taken) is fitted on 4-stage pipelines on 4 processes sharing 2 cores, one stage a process:
    the estimate places those as one group of both cores, where 3 or 4 ranks compute at once
    and a woken rank waits. The fit inverts the replay: a schedule made with wake w fits w, from
    the ranks' results in any order (each row names its stage), each middle stage's actions
    carrying two messages' CPU time (a receive and a send per pass), the ends' one. The
    synthetic pipeline probe's 2 stages of 2 replicas each are placed as a core per stage, where
    no wake ever meets a full group: its replay does not move with the wake, so it could only
    fit 0."""
    from autopar.cost.calibration import link_fits
    from autopar.cost.pipeline import pipeline_placement
    from autopar.cost.cluster import slowdown
    from autopar.schedule import build_schedule, simulate
    f, b, msg, hop, w = 6e-4, 7e-4, 1.3e-4, 4e-4, 1.5e-3
    shared = ((2, 1.0), (4, 2.0))           # time-sharing alone: 4 processes on 2 cores at half speed
    speed, placement = pipeline_placement(4, 4, 2, lambda k: slowdown(shared, 2, k))
    msgs = [1, 2, 2, 1]
    measured = simulate(build_schedule("1f1b", 4, 4), duration=lambda a: (f if a.kind == "F" else b)
                               + msgs[a.stage] * msg, latency=lambda a: hop, speed=speed, placement=placement,
                               wake=w, rendezvous=True).makespan
    # op_overhead_probe's row per rank: (compute, ops, message CPU, {kind: action CPU}, schedule, stage, tail)
    rows = [[(0.0, None, msg, {"F": f, "B": b, "W": 0.0}, measured - 1e-5 * (3 - s), s, [])] for s in (2, 0, 3, 1)]
    assert link_fits.fit_runtime_wake(rows, 2, shared, hop) == pytest.approx(w, rel=1e-3)
    none = simulate(build_schedule("1f1b", 4, 4), duration=lambda a: (f if a.kind == "F" else b)
                           + msgs[a.stage] * msg, latency=lambda a: hop, speed=speed, placement=placement,
                           rendezvous=True).makespan
    assert measured > none + w          # the wake is on the schedule's path more than once
    at_none = [[(0.0, None, msg, {"F": f, "B": b, "W": 0.0}, none, s, [])] for s in range(4)]
    assert link_fits.fit_runtime_wake(at_none, 2, shared, hop) == pytest.approx(0.0, abs=1e-9)
    with caplog.at_level("WARNING"):
        slow = [[(0.0, None, msg, {"F": f, "B": b, "W": 0.0}, 10.0, s, [])] for s in range(4)]
        assert link_fits.fit_runtime_wake(slow, 2, shared, hop) == 0.0
    assert "no wake fitted" in caplog.text
    # the synthetic probe's shape: 2 stages of 2 replicas on 4 processes, 2 cores
    assert len({link_fits.pipeline_replay(4, 2, shared, hop, x) for x in (0.0, 1e-3, 5e-3)}) == 1


def test_the_schedule_tail_is_a_line_through_the_probes_excess_by_the_wait():
    """``tails`` pairs the two ranks' steps of each 1F1B probe pipeline: the wait is how long
    the first rank to end its schedule waited for the last, the time past the schedule the last
    one's. ``fit_tail`` fits a + b x wait through each pipeline's mean time past less the
    estimate's own p2p time of the tied exchange (its vocab x h embedding) and the loss
    broadcast; a falling line is flat at the mean, a negative intercept goes through 0."""
    from autopar.cost.calibration import link_fits
    from autopar.cost.estimate import loss_broadcast_time, tied_exchange_time
    pipes = ((2, "1f1b", 16), (4, "interleaved", 16), (4, "1f1b", 128, 24), (8, "1f1b", 80, 40))
    # per rank, per pipeline: 7 fields, the last the steps' (schedule end, time past it)
    steps = {0: [(10.0, 5e-4), (20.0, 6e-4)], 2: [(30.0, 1e-3), (40.0, 1e-3)], 3: [(50.0, 2e-3), (60.0, 3e-3)]}
    other = {0: [(10.0 - 1e-3, 9.0), (20.0 - 2e-3, 9.0)], 2: [(30.0 - 2e-3, 9.0), (40.0 - 4e-3, 9.0)],
             3: [(50.0 + 5e-3, 1e-3), (60.0 + 3e-3, 1e-3)]}
    per_rank = [[(0,) * 6 + (steps.get(k, []),) for k in range(4)], [(0,) * 6 + (other.get(k, []),) for k in range(4)]]
    tails = link_fits.tails(pipes, per_rank)
    assert [t[0] for t in tails] == [pipes[0], pipes[2], pipes[3]]       # 1F1B only
    expect = [(1.5e-3, 5.5e-4), (3e-3, 1e-3), (4e-3, 1e-3)]       # third: the other rank ended last
    for (_, wait, past), (w, t) in zip(tails, expect):
        assert wait == pytest.approx(w) and past == pytest.approx(t)
    link = Link("gloo", 1e9, 1e-4, fits=(("p2p", 2, 1e-4, 1e-9),))

    def excess(pipe, past):
        vocab = pipe[5] if len(pipe) > 5 else 16
        return past - tied_exchange_time(4.0 * vocab * pipe[2], link) - loss_broadcast_time(2, link)

    xs = [w for w, _ in expect]
    ys = [excess(p, t) for p, (_, t) in zip((pipes[0], pipes[2], pipes[3]), expect)]
    mx, my = sum(xs) / 3, sum(ys) / 3
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a, slope = link_fits.fit_tail(tails, link)
    assert slope == pytest.approx(b) and a == pytest.approx(my - b * mx) and b > 0 and a > 0
    falling = [(pipes[0], 1e-3, 3e-3), (pipes[2], 3e-3, 1e-3)]
    a, slope = link_fits.fit_tail(falling, link)
    assert slope == 0.0 and a == pytest.approx((excess(pipes[0], 3e-3) + excess(pipes[2], 1e-3)) / 2)
    modeled = [p - excess(q, p) for q, p in ((pipes[0], 0.0), (pipes[2], 0.0))]     # the estimate's p2p
    steep = [(pipes[0], 1e-3, modeled[0] + 1e-4), (pipes[2], 3e-3, modeled[1] + 2e-3)]   # crosses 0 at 0.9 ms
    a, slope = link_fits.fit_tail(steep, link)
    assert a == 0.0 and slope == pytest.approx((1e-3 * 1e-4 + 3e-3 * 2e-3) / (1e-3 ** 2 + 3e-3 ** 2))
    assert link_fits.fit_tail(tails[:1], link) == ()


def test_a_pipeline_step_adds_the_measured_tail_at_its_replayed_wait():
    """A link's ``tail`` (a, b) adds a + b x wait to a pipeline plan's step, the wait being how
    long the first pp rank to end the estimate's replayed schedule waits for the last (read
    here off the estimate's own timeline); plans without a pipeline are unchanged."""
    import autopar
    from autopar.cost.estimate import Profiles, evaluate_plan
    from autopar.models import GPTConfig, TinyGPT, gpt_batch
    c = GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=2, max_seq=8)
    torch_x, _ = gpt_batch(c, 8)
    prof = Profiles(TinyGPT(c), (torch_x,))
    base = get_cluster("dgx-a100-80gb")
    a, b = 3e-4, 0.25
    tailed = base.with_(intra=dataclasses.replace(base.intra, tail=(a, b)),
                        inter=dataclasses.replace(base.inter, tail=(a, b)))
    plan = autopar.Plan(pp_schedule="1f1b", microbatches=4)
    without, with_tail = (evaluate_plan(prof, {"pp": 2}, plan, cl, 8) for cl in (base, tailed))
    ends = {}
    for r, lane, name, _, t1 in without.timeline:
        if lane == "compute" and name[:1].isdigit():
            ends[r] = max(ends.get(r, 0.0), t1)
    wait = max(ends.values()) - min(ends.values())
    assert len(ends) == 2 and wait > 0
    assert with_tail.step_time_s - without.step_time_s == pytest.approx(a + b * wait, rel=1e-6)
    assert any(name == "pipeline schedule tail" for name, *_ in with_tail.formulas)
    dp = [evaluate_plan(prof, {"dp": 2}, autopar.Plan(), cl, 8).step_time_s for cl in (base, tailed)]
    assert dp[0] == dp[1]


def test_invalid_numbers_are_refused():
    with pytest.raises(ValueError, match="bandwidth"):
        Link("nvlink", 0.0, 1e-6)
    for bad in ((1e-3,), (-1e-3, 0.1), (1e-3, float("nan"))):
        with pytest.raises(ValueError, match="tail"):
            Link("gloo", 1e9, 1e-4, tail=bad)
    with pytest.raises(ValueError, match="matmul_efficiency"):
        dataclasses.replace(PRESETS["dgx-h100"].device, matmul_efficiency=1.5)


@pytest.mark.slow
@pytest.mark.timing
def test_calibrate_local_measures_plausible_numbers(local_cluster):
    c, seconds = local_cluster
    assert seconds < 120
    assert isinstance(c, Cluster) and isinstance(c.device, Device) and c.name == "local"
    d = c.device
    for value in (d.peak_flops, d.mem_bandwidth, d.memory_bytes, c.host.bandwidth):
        assert value > 0 and math.isfinite(value)
    assert 0 < d.matmul_efficiency <= 1 and 0 < d.memory_efficiency <= 1
    assert d.fp32_flops is None and d.tf32_flops is None      # the measured rate prices every dtype
    assert 0 < d.attention_efficiency <= 1 and 0 <= d.attention_overhead < 1e-3
    assert 0 < d.op_overhead < 1e-3 and 0 < d.step_overhead < 1e-2
    assert 0 <= d.pass_overhead < 1e-2 and 0 < d.message_overhead < 1e-2
    # the dp runtime's host work per tensor, every mode (ZeRO-3 lays out gathered units and hooks
    # saved tensors: more than ddp's bucket flattening)
    sync = dict(d.sync_overhead)
    assert set(sync) == {"ddp", "zero1", "zero2", "zero3"} and all(0 <= v < 1e-2 for v in sync.values())
    assert sync["zero3"] > sync["ddp"]
    # the tp runtime's host work per collective, and every kind's latency among computing ranks
    assert 0 <= d.collective_overhead < 1e-2 and "collective_overhead" in c.source
    assert 0.1 < c.intra.skew_scale < 10 and "skew_scale" in c.source
    assert {(k, g) for k, g, _, _ in c.intra.skew} >= {("all_reduce", 2), ("p2p", 2)}
    assert c.gpus_per_node >= 1
    kinds = {(k, g) for k, g, _, _ in c.intra.fits}
    assert {("all_reduce", 2), ("all_gather", 2), ("reduce_scatter", 2), ("p2p", 2)} <= kinds
    assert all(a > 0 and b > 0 for _, _, a, b in c.intra.fits)
    if 2 * c.gpus_per_node <= 8:     # ranks sharing cores: measured with twice as many processes
        assert c.shared is not None and ("all_reduce", 2 * c.gpus_per_node) in {(k, g) for k, g, _, _ in c.shared.fits}
        # the latency of each kind after each compute length, and the compute slowdown
        assert {(k, g) for k, g, _, _ in c.shared.skew} >= {("all_reduce", 2), ("p2p", 2)}
        assert all(a >= 0 for *_, a in c.shared.skew)
        assert dict(c.contention)[2 * c.gpus_per_node] >= 1.0
        assert c.slowdown(2 * c.gpus_per_node) == dict(c.contention)[2 * c.gpus_per_node]
        # ZeRO-3's host work there, a share of the contention fitted on its own steps (their
        # collectives at the level the same stacks' tp steps read); the link's level as measured
        # but at its shortest point, read on the same tp steps
        assert c.shared.skew_scale == 1.0 and "x the shared link's skew table" in c.source
        assert 0.125 <= c.shared.skew_first <= 2.0 and "shared skew_first" in c.source
        assert c.intra.skew_first == 1.0
        assert [m for m, _ in c.shared_sync] == ["zero3"] and 0.125 <= dict(c.shared_sync)["zero3"] <= 2.0
        assert "shared_sync: zero3" in c.source
    assert c.intra == c.inter and c.intra.name == "gloo-tcp"
    assert 0.0 <= c.intra.overlap_loss <= 1.0 and "overlap_loss" in c.source
    assert c.shared is None or (0.0 <= c.shared.overlap_loss <= 1.0 and "(ranks sharing cores)" in c.source)
    # what a message costs autopar's own pipelines, the same on ranks sharing cores
    assert 0.0 <= c.intra.hop < 1e-2 and "autopar's own 2-stage 1F1B pipelines" in c.source
    assert c.shared is None or c.shared.hop == c.intra.hop
    assert 0.0 <= c.intra.hop_interleaved < 1e-2 and "hop_interleaved" in c.source
    assert c.shared is None or c.shared.hop_interleaved == c.intra.hop_interleaved
    # what the exchanges after a pipeline's schedule cost the rank that ends it last
    # (a: seconds, b: seconds per second waited)
    assert len(c.intra.tail) == 2 and 0 <= c.intra.tail[0] < 1e-2 and 0 <= c.intra.tail[1] < 2.0
    assert "tail:" in c.source
    assert c.shared is None or c.shared.tail == c.intra.tail
    assert 1e-6 <= c.intra.latency <= 1e-2
    assert 1e7 <= c.intra.bandwidth <= 1e11
    assert c.host == Link("host-memory", d.mem_bandwidth, 1e-7)
    assert "calibrate_local" in c.source
    # the reference workload the cache's reader times again (cost.drift)
    assert [part for part, _ in c.fingerprint] == ["dispatch", "matmul"]
    assert all(0 < s < 1e-1 for _, s in c.fingerprint) and "fingerprint" in c.source


@pytest.mark.slow
@pytest.mark.timing
def test_calibrate_local_reads_its_cache(local_cluster):
    first, _ = local_cluster
    start = time.perf_counter()
    again = calibrate_local()
    assert time.perf_counter() - start < 1.0
    assert again == first


def test_local_preset_is_read_from_the_cache_never_measured(tmp_path, monkeypatch):
    """get_cluster('local') reads what `python -m autopar calibrate` stored; without it, it says
    so instead of measuring (a lookup starts no processes)."""
    monkeypatch.setenv("AUTOPAR_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="python -m autopar calibrate"):
        get_cluster("local")
    assert cached_local() is None
    mine = PRESETS["dgx-h100"].with_(name="local", contention=((2, 1.1),))
    cache.store_local(dataclasses.asdict(mine))
    assert (tmp_path / "local_cluster.json").exists()
    assert get_cluster("local") == mine == cached_local(str(tmp_path / "local_cluster.json"))


def test_a_preset_that_other_calibration_code_measured_reads_as_missing(tmp_path, monkeypatch):
    """The cache keys a preset by the digest of the code that measured it: after a change to how
    a field is fitted, the old preset is not read (get_cluster says why and how to measure
    again), and the next calibration's entry replaces it. A change to the calibration's
    sources changes the digest."""
    monkeypatch.setenv("AUTOPAR_CACHE", str(tmp_path))
    mine = dataclasses.asdict(PRESETS["dgx-h100"].with_(name="local"))
    monkeypatch.setattr(cache, "_CODE", ["0123456789ab"])
    cache.store_local(mine)
    monkeypatch.setattr(cache, "_CODE", [])
    assert cached_local() is None
    with pytest.raises(ValueError, match=r"other calibration code measured it \(0123456789ab; this autopar's "
                       rf"is {cache.code_digest()}\): how a field is measured or fitted has changed since: run that once"):
        get_cluster("local")
    cache.store_local(mine)
    assert list(cache._read(cache.cache_path())) == [cache._key()]
    assert get_cluster("local") == Cluster.from_dict(mine)
    # the digest reads the sources: an exact copy of them digests alike, one with a line added
    # to the calibration otherwise
    here = cache.code_digest()
    copy = tmp_path / "cost"
    shutil.copytree(os.path.dirname(cache.__file__), copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(cache, "__file__", str(copy / "cache.py"))
    monkeypatch.setattr(cache, "_CODE", [])
    assert cache.code_digest() == here
    local = copy / "calibration" / "local.py"
    local.write_text(local.read_text() + "\n# a change\n")
    monkeypatch.setattr(cache, "_CODE", [])
    assert cache.code_digest() != here


def test_a_preset_read_on_a_machine_that_has_changed_speed_warns_once(tmp_path, monkeypatch):
    """The cached preset records a reference workload's time; the first read in a process times
    it again (on an idle machine) and warns, naming what moved and how to measure again, when the machine runs it
    more than STALE_FACTOR slower (here: recorded 20x faster than this machine can run it). A
    second read of the same preset does not warn again; a fingerprint that matches is silent."""
    now = drift.fingerprint()
    assert drift.stale_warning(now, now=now) is None
    fast = tuple((part, s / 20) for part, s in now)
    message = drift.stale_warning(fast, "2026-01-01T00:00")
    assert "dispatch" in message and "matmul" in message and "slower" in message
    assert "2026-01-01T00:00" in message and "python -m autopar calibrate" in message
    monkeypatch.setenv("AUTOPAR_CACHE", str(tmp_path))
    monkeypatch.setattr(drift, "machine_idle", lambda: True)     # the test suite keeps the machine busy
    mine = PRESETS["dgx-h100"].with_(name="local", fingerprint=fast, source="measured on here at 2026-01-01T00:00 by x")
    cache.store_local(dataclasses.asdict(mine))
    with pytest.warns(RuntimeWarning, match="no longer matches this machine"):
        assert get_cluster("local") == mine
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert get_cluster("local") == mine
