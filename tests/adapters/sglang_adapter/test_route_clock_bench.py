"""bench/route_clock_cpu.py: staggered requests route one phase at a time on the request clock,
together on the server clock (the script's own run, small)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from sglang_sim import require

require("sglang.srt.mem_cache.radix_cache")
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

import route_clock_cpu  # noqa: E402


def test_the_server_clock_routes_staggered_requests_together(tmp_path):
    args = ["--batch", "4", "--layers", "2", "--prompt", "128", "--steps", "8", "--every", "4",
            "--out", str(tmp_path)]  # fmt: skip
    assert route_clock_cpu.main(args) == 0
    rows = {r["clock"]: r for r in json.loads((tmp_path / "route_clock.json").read_text())["rows"]}
    own, server = rows["request"], rows["server"]
    assert own["requests_routed"] == server["requests_routed"] == 4 * 8 // 4
    assert own["steps_with_routing"] == 8 and server["steps_with_routing"] == 2
    assert server["route_ops_per_step"] < own["route_ops_per_step"]
    assert own["over_budget_routings"] == server["over_budget_routings"] == 0


def test_graph_replays_fold_only_the_routed_rows(tmp_path):
    """--graphs: on the request clock each routing folds the one request it routes; the rows
    folded per step stay at the routings', not the batch's. (Both clocks: each runs in its own
    process, so the script's stubbed decode kernel stays out of this one.)"""
    args = ["--batch", "4", "--layers", "2", "--prompt", "128", "--steps", "8", "--every", "4",
            "--graphs", "--clocks", "request", "server", "--out", str(tmp_path)]  # fmt: skip
    assert route_clock_cpu.main(args) == 0
    rows = {r["clock"]: r for r in json.loads((tmp_path / "route_clock.json").read_text())["rows"]}
    row = rows["request"]
    assert rows["server"]["rows_folded_per_step"] <= row["rows_folded_per_step"]
    # one or two requests a routing (a replay's is planned at the next step's flush)
    assert row["requests_routed"] >= 7 and row["steps_with_routing"] >= 6
    assert row["rows_folded_per_step"] <= 1.0  # before the partial folds: ~4 (the batch)
    assert row["metadata_ops_per_step"] > row["route_ops_per_step"] > 0


def test_by_function_refuses_the_interpreted_kernels(capsys):
    """The profiler's stacks over the Triton interpreter outgrow a CPU machine's memory."""
    with pytest.raises(SystemExit) as exit_:
        route_clock_cpu.main(["--by-function", "--stack-kernels"])
    assert exit_.value.code == 2
    assert "PyTorch paths only" in capsys.readouterr().err
