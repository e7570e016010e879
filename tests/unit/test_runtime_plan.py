"""Rank layout, groups, stage split and batch partition of agent.runtime.plan (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.runtime.plan import (
    Coord,
    Plan,
    batch_rows,
    coord_of,
    dp_groups,
    pp_groups,
    rank_of,
    replica_rows,
    stage_layers,
    tp_groups,
    validate,
)
from tessera.errors import SpecError

plans = st.builds(Plan, dp=st.integers(1, 4), tp=st.integers(1, 4), pp=st.integers(1, 4), micro_batches=st.integers(1, 4))


@given(plans)
def test_layout_is_a_bijection_with_tp_fastest(plan):
    ranks = [rank_of(plan, coord_of(plan, r)) for r in range(plan.world_size)]
    assert ranks == list(range(plan.world_size))
    assert coord_of(plan, 0) == Coord(0, 0, 0)
    if plan.tp > 1:
        assert coord_of(plan, 1) == Coord(dp=0, tp=1, pp=0)


@given(plans)
def test_each_group_kind_partitions_the_world(plan):
    for groups, size in ((tp_groups(plan), plan.tp), (dp_groups(plan), plan.dp), (pp_groups(plan), plan.pp)):
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(plan.world_size))
        assert all(len(g) == size for g in groups)


@given(plans)
def test_groups_vary_only_their_own_axis(plan):
    for g in tp_groups(plan):
        cs = [coord_of(plan, r) for r in g]
        assert len({(c.dp, c.pp) for c in cs}) == 1 and [c.tp for c in cs] == list(range(plan.tp))
    for g in pp_groups(plan):
        cs = [coord_of(plan, r) for r in g]
        assert len({(c.dp, c.tp) for c in cs}) == 1 and [c.pp for c in cs] == list(range(plan.pp))


@given(st.integers(1, 12), st.integers(1, 12))
def test_stage_layers_contiguous_nonempty(layers, pp):
    if layers < pp:
        with pytest.raises(ValueError):
            stage_layers(layers, pp)
        return
    stages = stage_layers(layers, pp)
    assert [i for s in stages for i in s] == list(range(layers))
    assert all(len(s) >= 1 for s in stages)
    assert max(map(len, stages)) - min(map(len, stages)) <= 1


@given(plans, st.integers(1, 4))
def test_batch_rows_cover_global_batch_once(plan, k):
    batch = plan.dp * plan.micro_batches * k
    rows = [i for d in range(plan.dp) for m in range(plan.micro_batches) for i in range(batch)[batch_rows(plan, batch, d, m)]]
    assert rows == list(range(batch))
    for d in range(plan.dp):
        r = replica_rows(plan, batch, d)
        assert r.start == batch_rows(plan, batch, d, 0).start
        assert r.stop == batch_rows(plan, batch, d, plan.micro_batches - 1).stop


def test_from_dict_defaults_and_errors():
    assert Plan.from_dict(None) == Plan(1, 1, 1, 1)
    assert Plan.from_dict({"dp": 2}).world_size == 2
    with pytest.raises(SpecError) as e:
        Plan.from_dict({"dp": 0})
    assert e.value.field == "workload.plan.dp"
    with pytest.raises(SpecError) as e:
        Plan.from_dict({"ep": 2})
    assert e.value.field == "workload.plan.ep"


@pytest.mark.parametrize(
    "plan,kw,field",
    [
        (Plan(dp=2), dict(world_size=1), "workload.plan"),
        (Plan(dp=3), dict(world_size=3), "workload.batch_size"),
        (Plan(tp=3), dict(world_size=3), "workload.plan.tp"),
        (Plan(pp=3), dict(world_size=3, layers=2), "workload.plan.pp"),
    ],
)
def test_validate_names_the_field(plan, kw, field):
    args = dict(layers=2, heads=4, hidden=32, batch_size=8, world_size=1) | kw
    with pytest.raises(SpecError) as e:
        validate(plan, **args)
    assert e.value.field == field


def test_validate_accepts_fitting_plan():
    validate(Plan(dp=2, tp=2, pp=2, micro_batches=2), layers=2, heads=4, hidden=32, batch_size=8, world_size=8)
