"""The decode/TTFT benchmark's launch settings and stats reading (bench/sglang_decode.py), without
a GPU: every tiered kind's engine keywords (GPU run 18's ``tiered_serial`` TTFT run overlapped,
because only the decode path set ``kv_overlap``), and the stats read from ``/server_info``."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import sglang_decode  # noqa: E402


def _args(**kw) -> SimpleNamespace:
    base = dict(model="/m", policy="qevict", budget=None, chunk=None, load_format="auto",
                graph_max_bs=16, graph_tokens=None)  # fmt: skip
    return SimpleNamespace(**(base | kw))


def test_every_tiered_kind_says_its_overlap_and_plain_says_nothing():
    want = {"tiered": True, "tiered_overlap": True, "tiered_step": True, "tiered_serial": False,
            "tiered_pg": True}  # fmt: skip
    for kind, overlap in want.items():
        kw = sglang_decode._engine_kwargs(kind, _args(), 30000)
        assert kw["kv_overlap"] is overlap and kw["kv_policy"] == "qevict", kind
        assert "attention_backend" not in kw  # the plugin selects its own
        assert kw.get("kv_prefill_graphs", False) is (kind == "tiered_pg"), kind
    plain = sglang_decode._engine_kwargs("plain", _args(budget="25%"), 30000)
    assert "kv_overlap" not in plain and "kv_policy" not in plain and "kv_budget" not in plain
    assert plain["context_length"] == 30512 and plain["attention_backend"] == "triton"
    tiered = sglang_decode._engine_kwargs("tiered", _args(budget="25%", chunk=2048), 8192)
    assert tiered["kv_budget"] == "25%" and tiered["chunked_prefill_size"] == 2048
    assert "kv_graph_tokens" not in tiered  # the plugin's default
    big = sglang_decode._engine_kwargs("tiered", _args(graph_tokens=2_000_000), 30000)
    assert big["kv_graph_tokens"] == 2_000_000
    assert "kv_graph_tokens" not in sglang_decode._engine_kwargs("plain", _args(graph_tokens=9), 9)


class _Engine:
    def __init__(self, states):
        self.states = states

    def get_server_info(self) -> dict:
        return {"version": "0.5.17", "internal_states": self.states}


def test_stats_come_from_server_info():
    st = {"host_s": {"route": 0.5, "decode_steps": 10}, "device_s": {"replay": 0.02, "replays": 9}}
    engine = _Engine([{"memory_usage": {}, "tiered_radix": st}])
    assert sglang_decode._stats(engine) == st
    assert sglang_decode._host_s(engine) == {"route": 0.5, "decode_steps": 10,
                                             "replay_device": 0.02, "replays_steps": 9}  # fmt: skip
    assert sglang_decode._stats(_Engine([{"memory_usage": {}}])) == {}  # plain SGLang
    assert sglang_decode._host_s(_Engine([])) == {}


def test_per_step_divides_decode_phases_by_steps_and_extend_phases_by_batches():
    before = {"route": 1.0, "metadata_extend": 0.2, "decode_steps": 10, "extend_batches": 2}
    after = {"route": 1.5, "metadata_extend": 0.26, "decode_steps": 110, "extend_batches": 5}
    out = sglang_decode._per_step(before, after)
    assert out["route"] == 5.0 and out["metadata_extend"] == 20.0
    assert out["decode_steps"] == 100 and out["extend_batches"] == 3
