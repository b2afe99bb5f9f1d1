"""The moves a routing's holder transitions count as (``usage.move_flags``): one table lookup
that must say what the rule says, for every pair of holder states."""

from __future__ import annotations

import torch
from sglang_sim import require

require("sglang.srt.mem_cache.memory_pool")

from tiered_radix.adapters.sglang.reps import S_A, S_EVICT, S_FULL, S_Q, S_R, STATES  # noqa: E402
from tiered_radix.adapters.sglang.usage import _flag_rule, move_flags, moves_of  # noqa: E402


def test_the_table_says_what_the_rule_says_for_every_state_pair():
    g = torch.Generator().manual_seed(0)
    old = torch.randint(0, len(STATES), (500,), generator=g)
    new = torch.randint(0, len(STATES), (500,), generator=g)
    assert torch.equal(move_flags(old, new), _flag_rule(old, new))
    assert torch.equal(move_flags(old.int(), new.to(torch.int8)), _flag_rule(old, new))


def test_moves_count_demotions_promotions_and_evictions():
    old = torch.tensor([S_FULL, S_R, S_Q, S_Q, S_FULL, S_Q, S_R, S_FULL])
    new = torch.tensor([S_Q, S_Q, S_FULL, S_R, S_EVICT, S_A, S_R, S_FULL])
    assert move_flags(old, new).tolist() == [
        [1, 0, 0], [1, 0, 0], [0, 1, 0], [0, 1, 0], [0, 0, 1], [0, 0, 1], [0, 0, 0], [0, 0, 0]
    ]  # fmt: skip
    assert moves_of(old, new).tolist() == [2, 2, 2]
