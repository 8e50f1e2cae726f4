"""Placements, layouts and plans print compactly and parse back exactly."""
import pytest

import autopar
from autopar.placement import Layout, Partial, Replicate, Shard, parse_layout, parse_placement


@pytest.mark.parametrize("p, text", [(Shard(0), "S(0)"), (Shard(-1), "S(-1)"), (Replicate(), "R"),
                                     (Partial(), "P(sum)"), (Partial("avg"), "P(avg)")])
def test_placement_round_trip(p, text):
    assert str(p) == text and parse_placement(text) == p


def test_layout_round_trip():
    lay = Layout.of(dp=Shard(0), tp=Replicate())
    assert str(lay) == "dp:S(0) tp:R"
    assert parse_layout(str(lay)) == lay
    assert lay["dp"] == Shard(0) and lay.replace("tp", Partial()) == parse_layout("dp:S(0) tp:P(sum)")
    with pytest.raises(ValueError):
        parse_placement("Q")
    with pytest.raises(ValueError):
        Partial("prod")


def test_dtensor_converters():
    from torch.distributed.tensor import placement_types as pt
    from autopar.placement import from_dtensor_placement, to_dtensor_placement
    for p in (Shard(1), Replicate(), Partial("sum")):
        assert from_dtensor_placement(to_dtensor_placement(p)) == p
    assert to_dtensor_placement(Shard(2)) == pt.Shard(2)


@pytest.mark.parametrize("plan", [autopar.Plan(), autopar.Plan(dp="zero3"),
                                  autopar.Plan(dp="zero1", bucket_bytes=4096),
                                  autopar.Plan(dp="zero2", tp=True, sp=True, pp_schedule="1f1b", microbatches=8)])
def test_plan_round_trip(plan):
    assert autopar.Plan.parse(str(plan)) == plan


def test_plan_str_is_readable_and_defaults_off():
    assert str(autopar.Plan(dp="zero3")) == "Plan(dp='zero3')"
    p = autopar.Plan()
    assert (p.tp, p.sp, p.pp_schedule, p.microbatches) == (False, False, None, 1)
    with pytest.raises(ValueError, match="sp=True\\) needs tp=True"):
        autopar.Plan(sp=True)


def test_mesh_coordinates():
    m = autopar.Mesh(pp=2, dp=2, tp=2, virtual=True, rank=5)      # 5 = (1, 0, 1)
    assert (m.coordinate("pp"), m.coordinate("dp"), m.coordinate("tp")) == (1, 0, 1)
    assert m.size == 8 and m.names == ("pp", "dp", "tp") and m.axis_size("cp") == 1
    assert repr(m) == "Mesh(pp=2, dp=2, tp=2, virtual=True)"
