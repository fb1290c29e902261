"""`MambaShard`: which Mamba2 heads and B/C groups a rank holds."""

from __future__ import annotations

import dataclasses

import pytest

from replayserve.builtin.tiny import tiny_config
from replayserve.ssm.layout import MambaShard


@pytest.mark.parametrize(("heads", "groups", "world", "expected"), [
    (8, 2, 2, [(0,), (1,)]),  # whole groups
    (8, 2, 4, [(0,), (0,), (1,), (1,)]),  # two ranks per group: each keeps it
    (6, 3, 2, [(0, 0, 1), (1, 2, 2)]),  # heads straddle group 1: one group copy per head
    (8, 4, 2, [(0, 1), (2, 3)]),
    (12, 4, 2, [(0, 1), (2, 3)]),
    (12, 2, 4, [(0,), (0,), (1,), (1,)]),  # 3 heads of a 6-head group per rank
])
def test_groups_follow_the_heads(heads: int, groups: int, world: int, expected: list[tuple[int, ...]]) -> None:
    model = dataclasses.replace(tiny_config(), mamba_num_heads=heads, n_groups=groups)
    shards = [MambaShard.of(model, r, world) for r in range(world)]
    assert [s.groups for s in shards] == expected
    per_group = heads // groups
    for s in shards:
        local_per_group = s.num_heads // s.num_groups
        for h in range(s.num_heads):  # a local head reads its model group through its local group
            assert s.groups[h // local_per_group] == (s.head_start + h) // per_group


def test_channels_and_rows_partition_the_model_once_groups_divide() -> None:
    model = tiny_config()
    shards = [MambaShard.of(model, r, 2) for r in range(2)]
    assert sorted(c for s in shards for c in s.conv_channels(model)) == list(range(model.conv_dim))
    rows = 2 * model.mamba_intermediate_size + 2 * model.n_groups * model.ssm_state_size + model.mamba_num_heads
    assert sorted(r for s in shards for r in s.in_proj_rows(model)) == list(range(rows))
