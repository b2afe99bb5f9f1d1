"""bench/reclaim_cpu.py: multi-turn chat over a row-starved pool, demote-then-evict against
evict only (the script's own run, small)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sglang_sim import require

require("sglang.srt.mem_cache.radix_cache")
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

import reclaim_cpu  # noqa: E402


def test_later_turns_keep_their_prefix_when_cached_rows_are_demoted(tmp_path, capsys):
    args = ["--convs", "5", "--history", "160", "--row-prompts", "1.6", "--out", str(tmp_path)]
    assert reclaim_cpu.main(args) == 0
    out = json.loads((tmp_path / "reclaim.json").read_text())
    rows = {r["mode"]: r for r in out["rows"]}
    demote, evict = rows["demote"], rows["evict"]
    assert demote["cached_windows_demoted"] > 0 and demote["cached_tokens_evicted"] == 0
    assert evict["cached_windows_demoted"] == 0 and evict["cached_tokens_evicted"] > 0
    assert demote["hit_rate"] > 0.9 > 0.5 > evict["hit_rate"]
    assert demote["later_turn_prompt_tokens"] == evict["later_turn_prompt_tokens"]
