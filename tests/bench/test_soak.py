"""The soak's pieces (bench/soak.py): its workload, its client against a fake OpenAI server,
the checks against recorded metric snapshots, the summary's schema, and the whole soak against
a fake server process (tests/bench/fake_soak_server.py)."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from pathlib import Path

import pytest

pytest.importorskip("aiohttp", reason="the soak's client needs aiohttp (pip install aiohttp)")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import soak  # noqa: E402
from aiohttp import web  # noqa: E402
from fake_soak_server import make_app  # noqa: E402
from serving import soak_checks as checks  # noqa: E402
from serving.soak_client import SoakRun  # noqa: E402
from serving.soak_workload import EXPECTED, SoakScale, burst_points, plan  # noqa: E402
from serving.workload import TokenSizer  # noqa: E402

SMALL = SoakScale(requests=120, clients=4, context=4096, prompt_min=200, prompt_max=3000,
                  burst=16, burst_every=40)  # fmt: skip


def test_the_plan_has_the_requests_kinds_and_bursts_asked_for():
    sizer = TokenSizer()
    sessions, bursts = plan(0, SMALL, sizer)
    turns = [t for s in sessions + [b for g in bursts for b in g] for t in s.turns]
    assert len(turns) == SMALL.requests
    assert [len(g) for g in bursts] == [16, 16]  # 120 // (40 + 16)
    assert all(s.kind == "chat" and len(s.turns) == 1 for g in bursts for s in g)
    kinds = {s.kind for s in sessions}
    assert {"chat", "abort"} <= kinds
    assert any(len(s.turns) > 1 for s in sessions)  # continuations
    for s in sessions:
        first = s.turns[0]
        if s.kind == "too_long":
            assert first.prompt_tokens > SMALL.context
        elif s.kind == "empty":
            assert first.text == "" and first.prompt_tokens == 0
        else:
            assert first.prompt_tokens <= SMALL.prompt_max
            assert sizer.count(first.text) >= SMALL.prompt_min * 0.9
        if s.kind == "abort":
            assert 1 <= first.disconnect_after <= 8 and first.max_tokens > first.disconnect_after
        if s.kind in ("max0", "max1"):
            assert first.max_tokens == int(s.kind[-1])
    assert len({s.turns[0].text for s in sessions if s.kind != "empty"}) == len(
        [s for s in sessions if s.kind != "empty"]
    )  # no two sessions share a prompt
    again = plan(0, SMALL, sizer)
    assert again == (sessions, bursts)  # seeded
    assert plan(1, SMALL, sizer)[0] != sessions
    assert burst_points(sessions, 2) == [len(sessions) // 3, 2 * len(sessions) // 3]


def test_the_mix_over_many_sessions_follows_the_shares():
    scale = SoakScale(requests=3000, clients=4, context=4096, prompt_min=100, prompt_max=200,
                      burst=0)  # fmt: skip
    sessions, bursts = plan(0, scale, TokenSizer())
    assert bursts == []
    share = sum(s.kind == "abort" for s in sessions) / len(sessions)
    assert 0.07 < share < 0.13
    for kind in ("too_long", "empty", "max0", "max1"):
        assert 0.01 < sum(s.kind == kind for s in sessions) / len(sessions) < 0.05


def test_a_scale_whose_prompts_overflow_the_context_is_refused():
    with pytest.raises(ValueError, match="exceed"):
        SoakScale(context=4096, prompt_max=4096)


async def _serve_and_run(app, sessions, bursts, clients, hard_s=60.0):
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]

    class Bar:
        n = 0

        def update(self, k):
            Bar.n += k

    try:
        run = SoakRun(f"http://127.0.0.1:{port}", "default", hard_s, hard_s, Bar())
        return await run.run(sessions, bursts, clients), run, Bar.n
    finally:
        await runner.cleanup()


def test_the_client_sends_every_kind_and_records_what_came_back():
    scale = SoakScale(requests=80, clients=4, context=4096, prompt_min=100, prompt_max=800,
                      burst=8, burst_every=30, abort_share=0.2, odd_share=0.05)  # fmt: skip
    sessions, bursts = plan(0, scale, TokenSizer())
    app, state = make_app(limit_words=3000)  # ~4 characters a token: too_long has ~3.8K words
    records, run, bar = asyncio.run(_serve_and_run(app, sessions, bursts, scale.clients))
    assert len(records) + run.not_sent == scale.requests == bar + run.not_sent
    by = {}
    for r in records:
        by.setdefault(r["kind"], []).append(r)
        assert r["expected"] == (r["status"] in EXPECTED[r["kind"]]), r
    assert all(r["status"] == 400 and r["expected"] for r in by["too_long"])
    assert all(r["status"] == 400 for r in by.get("empty", []))
    aborts = by["abort"]
    assert aborts and all(r["aborted"] and r["expected"] for r in aborts)
    assert state["closed"] == len(aborts)  # the server saw each disconnect
    assert all(r["output_tokens"] == 0 for r in aborts)  # no usage chunk: the stream was cut
    chats = by["chat"]
    assert all(r["status"] == 200 and r["logprobs"] == r["output_tokens"] for r in chats)
    later = [r for r in chats if r["turn"] > 0]
    assert later and all(r["cached_tokens"] > 0 for r in later)  # continuations hit the cache
    assert sum(r["burst"] is not None for r in records) == 16  # 80 // (30 + 8) bursts of 8
    assert all(r["nonfinite"] == 0 for r in records)


def test_a_nan_logprob_is_counted():
    scale = SoakScale(requests=10, clients=2, context=4096, prompt_min=100, prompt_max=200,
                      burst=0, abort_share=0, odd_share=0)  # fmt: skip
    sessions, _ = plan(0, scale, TokenSizer())
    app, _ = make_app(limit_words=3000, nan_for="Which place")  # every follow-up turn
    records, _, _ = asyncio.run(_serve_and_run(app, sessions, [], 2))
    follow = [r for r in records if r["turn"] > 0]
    assert follow and all(r["nonfinite"] == r["output_tokens"] > 0 for r in follow)
    assert all(r["nonfinite"] == 0 for r in records if r["turn"] == 0)


def test_a_stream_cut_before_done_is_an_unexpected_failure():
    scale = SoakScale(requests=10, clients=2, context=4096, prompt_min=100, prompt_max=200,
                      burst=0, abort_share=0, odd_share=0)  # fmt: skip
    sessions, _ = plan(0, scale, TokenSizer())
    app, _ = make_app(limit_words=3000, cut_for="Which place")
    records, _, _ = asyncio.run(_serve_and_run(app, sessions, [], 2))
    follow = [r for r in records if r["turn"] > 0]
    assert follow and all(not r["expected"] and "[DONE]" in r["error"] for r in follow)
    assert all(r["expected"] for r in records if r["turn"] == 0)


METRICS = """# HELP sglang:kv_available_tokens free slots
# TYPE sglang:kv_available_tokens gauge
sglang:kv_available_tokens{model_name="m",tp_rank="0"} %(avail)s
sglang:kv_evictable_tokens{model_name="m",tp_rank="0"} 16.0
sglang:tiered_kv_bytes{model_name="m",tp_rank="0"} %(bytes)s
sglang:tiered_row_blocks_free{model_name="m",tp_rank="0"} %(rows)s
sglang:tiered_ledger_blocks_free{model_name="m",tp_rank="0"} 500.0
sglang:tiered_promotions_total{model_name="m",tp_rank="0"} %(promote)s
sglang:tiered_promotions_created{model_name="m",tp_rank="0"} 1.7e9
sglang:tiered_demotions_total{model_name="m",tp_rank="0"} 100.0
sglang:tiered_borrowed_quantized_total{model_name="m",tp_rank="0"} 10.0
sglang:tiered_over_budget_routings_total{model_name="m",tp_rank="0"} %(over)s
sglang:tiered_evictions_total{model_name="m",tp_rank="0"} 7.0
"""


def snap(avail=1000, bytes=4096, rows=900, promote=50, over=0):
    return checks.parse_prometheus(METRICS % dict(avail=avail, bytes=bytes, rows=rows,
                                                  promote=promote, over=over))  # fmt: skip


def rec(kind="chat", status=200, turn=0, nonfinite=0, aborted=False, expected=True):
    return {"session": 0, "turn": turn, "kind": kind, "burst": None, "status": status,
            "expected": expected, "aborted": aborted, "error": None, "logprobs": 4,
            "nonfinite": nonfinite, "prompt_tokens": 10, "cached_tokens": 5 * turn,
            "output_tokens": 4, "start_s": 0.0, "end_s": 1.0}  # fmt: skip


def test_prometheus_text_sums_label_sets_and_drops_created():
    two = METRICS % dict(avail=1, bytes=2, rows=3, promote=4, over=0)
    two += 'sglang:kv_available_tokens{model_name="m",tp_rank="1"} 5\n'
    s = checks.parse_prometheus(two)
    assert s["sglang:kv_available_tokens"] == 6 and "sglang:tiered_promotions_created" not in s
    assert checks.free_slots(s) == 6 + 16


def test_a_clean_soak_passes_every_check():
    records = [rec(), rec(turn=1), rec("too_long", 400), rec("abort", aborted=True)]
    r = checks.row("qevict", records, snap(), snap(), alive=True)
    assert r["ok"], r["checks"]
    assert (r["requests"], r["aborted"], r["errors_4xx"], r["crashes"]) == (4, 1, 1, 0)
    assert r["free_slots_start"] == r["free_slots_end"] == 1016
    assert r["held_bytes_after_flush"] == 0 and r["continuations_cached_tokens"] == 5


@pytest.mark.parametrize("what, end, kw, failed", [
    ("leaked slots", dict(avail=990), {}, "free_slots_back"),
    ("bytes held after the flush", dict(bytes=8192), {}, "pool_empty_after_flush"),
    ("row blocks not back", dict(rows=899), {}, "pool_empty_after_flush"),
    ("a routing over budget", dict(over=1), {}, "within_budget_after_routings"),
    ("more promotions than demotions and borrowings", dict(promote=111), {},
     "counters_consistent"),
    ("a crash", {}, dict(alive=False), "no_crash"),
])  # fmt: skip
def test_each_failure_fails_its_check_only(what, end, kw, failed):
    records = [rec(), rec("too_long", 400)]
    r = checks.row("qevict", records, snap(), snap(**end), **(dict(alive=True) | kw))
    assert not r["ok"], what
    assert [k for k, v in r["checks"].items() if not v] == [failed], what


def test_request_failures_fail_the_soak():
    nan = checks.row("p", [rec(nonfinite=2)], snap(), snap(), alive=True)
    assert nan["nan_outputs"] == 1 and not nan["checks"]["no_nan"]
    served = checks.row("p", [rec("too_long", 200, expected=False)], snap(), snap(), alive=True)
    assert not served["checks"]["too_long_got_400"]
    assert not served["checks"]["statuses_as_expected"]
    hung = checks.row("p", [rec(status=0, expected=False)], snap(), snap(), alive=True)
    assert hung["timeouts"] == 1 and not hung["checks"]["no_timeouts"]
    blank = checks.row("p", [rec()], snap(), {}, alive=True)  # no metrics at the end
    assert not blank["ok"] and blank["free_slots_end"] is None


def test_the_summary_has_the_issue_schema_and_merges_by_policy(tmp_path):
    meta = {"gpu": "NVIDIA H200", "commit": "abc"}
    a = checks.row("qevict", [rec()], snap(), snap(), alive=True)
    b = checks.row("h2o", [rec()], snap(), snap(), alive=True)
    checks.merge(meta, [a, b], tmp_path)
    a2 = dict(a, requests=99)
    s = checks.merge(meta, [a2], tmp_path)
    checks.check_schema(s)
    on_disk = json.loads((tmp_path / checks.SUMMARY).read_text())
    assert on_disk == s
    assert sorted(r["policy"] for r in s["rows"]) == ["h2o", "qevict"]
    assert next(r for r in s["rows"] if r["policy"] == "qevict")["requests"] == 99
    assert set(checks.ROW_KEYS) <= set(a)
    with pytest.raises(ValueError, match="h2o.nan_outputs"):
        bad = dict(b)
        del bad["nan_outputs"]
        checks.check_schema(dict(meta, rows=[bad]))
    with pytest.raises(ValueError, match="commit"):
        checks.check_schema({"gpu": "x", "rows": []})


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("leak", [0, 7])
def test_the_soak_runs_a_policy_end_to_end_and_catches_a_leak(tmp_path, monkeypatch, leak):
    """bench/soak.py against a fake server process: the summary has the issue's schema and
    the policy's row; a server that keeps slots after a flush fails the free-slot check."""
    fake = [sys.executable, str(ROOT / "tests/bench/fake_soak_server.py"), "--leak", str(leak)]
    monkeypatch.setattr(soak, "server_command", lambda args, p: fake + ["--port", str(args.port)])
    monkeypatch.setattr(soak, "_gpu", lambda: "none")
    out = tmp_path / "soak"
    argv = ["--model", str(tmp_path), "--policies", "qevict", "--requests", "60", "--clients",
            "4", "--burst", "8", "--prompt", "200:2000", "--context", "4096", "--port",
            str(_port()), "--out", str(out), "--commit", "abc", "--no-progress"]  # fmt: skip
    status = soak.main(argv)
    summary = json.loads((out / checks.SUMMARY).read_text())
    checks.check_schema(summary)
    (row,) = summary["rows"]
    assert summary["commit"] == "abc" and row["policy"] == "qevict"
    assert row["requests"] + row["not_sent"] == 60 and row["crashes"] == 0
    assert row["aborted"] == row["by_kind"].get("abort", 0) > 0
    assert row["errors_4xx"] >= row["by_kind"].get("too_long", 0)
    assert row["probe_status"] == [200, 200] and row["flushed"] == [True, True]
    records = (out / "records" / "qevict.jsonl").read_text().splitlines()
    assert len(records) == row["requests"]
    assert row["gpu_peak_mib"] is None  # no nvidia-smi here: not measured, not 0
    if leak:
        assert status == 1 and not row["checks"]["free_slots_back"]
        assert row["free_slots_start"] - row["free_slots_end"] == leak
    else:
        assert status == 0 and row["ok"], row["checks"]


def test_parallel_soaks_run_each_policy_on_its_own_server(tmp_path, monkeypatch):
    """``--parallel 2``: two policies at once, each against its own server (port, port + 10),
    started one after the other; one row each, in the order asked, with how it was run."""
    fake = [sys.executable, str(ROOT / "tests/bench/fake_soak_server.py")]
    ports, order = [], []

    def command(args, policy):
        ports.append(args.port)
        order.append(policy)
        return fake + ["--port", str(args.port), "--leak", "3" if policy == "h2o" else "0"]

    monkeypatch.setattr(soak, "server_command", command)
    monkeypatch.setattr(soak, "_gpu", lambda: "none")
    out, base = tmp_path / "soak", _port()
    argv = ["--model", str(tmp_path), "--policies", "qevict,h2o", "--parallel", "2",
            "--requests", "40", "--clients", "4", "--burst", "8", "--prompt", "200:2000",
            "--context", "4096", "--port", str(base), "--out", str(out), "--commit", "abc",
            "--no-progress"]  # fmt: skip
    status = soak.main(argv)
    summary = json.loads((out / checks.SUMMARY).read_text())
    assert ports == [base, base + 10] and order == ["qevict", "h2o"]
    assert [r["policy"] for r in summary["rows"]] == ["qevict", "h2o"]
    by = {r["policy"]: r for r in summary["rows"]}
    assert by["qevict"]["ok"] and not by["h2o"]["ok"] and status == 1  # h2o's server leaks
    assert by["h2o"]["free_slots_start"] - by["h2o"]["free_slots_end"] == 3
    assert all(r["soaked_with"] == ["qevict", "h2o"] for r in summary["rows"])


def test_a_pool_in_gib_becomes_each_policys_own_slot_count(tmp_path):
    """``--kv-gib``: every policy's ``--max-total-tokens`` is what its own cell size fits in
    the same bytes (more slots for qevict's 10% than for full KV)."""
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 24, "num_key_value_heads": 2, "hidden_size": 896,
        "num_attention_heads": 14}))  # fmt: skip
    args = soak.parse_args(["--model", str(tmp_path), "--kv-gib", "4"])
    full, qevict = soak.pool_tokens(args, "full"), soak.pool_tokens(args, "qevict")
    bf16 = 4 * (1 << 30) // (2 * 24 * 2 * 64 * 2)  # Qwen2.5-0.5B: 12 KiB a token
    assert 0.8 * bf16 < full <= bf16 and qevict > 5 * full
    cmd = soak.server_command(args, "qevict")
    assert cmd[cmd.index("--max-total-tokens") + 1] == str(qevict)
    assert "--max-total-tokens" not in soak.server_command(soak.parse_args([]), "qevict")


def test_the_row_says_which_paths_the_backend_ran():
    """The last stats line of the server log gives the backend's decode/extend paths; SGLang's
    decode lines give the share of steps under CUDA graphs (run 29's h2o: PyTorch, none)."""
    log = "\n".join([
        "[t] Decode batch, #running-req: 32, cuda graph: False, gen throughput (token/s): 17.05",
        "[t] tiered-radix: {'requests': 3, 'decode': 'gather', 'kernel_steps': 0, "
        "'kernel_error': None, 'extend': 'gather', 'host_s': {'route': 1.5}}",
        "[t] Decode batch, #running-req: 8, cuda graph: True, gen throughput (token/s): 900.0",
        "[t] Decode batch, #running-req: 8, cuda graph: True, gen throughput (token/s): 910.0",
        "[t] tiered-radix: {'requests': 1, 'decode': 'kernel', 'kernel_steps': 40, "
        "'kernel_error': None, 'extend': 'kernel', 'device_memory': {'allocated': 9000.5, "
        "'peak_allocated': 30000.0, 'reserved': 48000.0}}",
        "[t] tiered-radix: {'cut off",
    ])  # fmt: skip
    got = soak.backend_paths(log)
    assert got == {"decode": "kernel", "extend": "kernel", "kernel_steps": 40,
                   "kernel_error": None, "decode_log_lines": 3, "graphed_share": 0.667,
                   "graph_tokens": None, "graph_buffers_mib": None,
                   "device_memory": {"allocated": 9000.5, "peak_allocated": 30000.0,
                                     "reserved": 48000.0}}  # fmt: skip
    assert soak.backend_paths("no stats here") is None
    # run 32's h2o server: the graphs' capacity and buffers from its startup line
    line = ("[2026-12-07 15:16:14] tiered-radix: decode CUDA graphs up to batch 256, 8129984 "
            "tokens, 10592.7 MiB of buffers")  # fmt: skip
    got = soak.backend_paths(line + "\n" + log)
    assert (got["graph_tokens"], got["graph_buffers_mib"]) == (8129984, 10592.7)
