"""The serving benchmark's client loop against a fake OpenAI-compatible streaming server
(tests/bench/fake_openai.py) on 127.0.0.1, and the whole benchmark with fake servers."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from pathlib import Path

import pytest

pytest.importorskip("aiohttp", reason="the benchmark's client needs aiohttp (pip install aiohttp)")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from aiohttp import web  # noqa: E402
from fake_openai import STATE, make_app  # noqa: E402
from serving.client import Load, run_load  # noqa: E402
from serving.workload import Scale, TokenSizer, workload  # noqa: E402

SCALE = Scale(conversations=6, turns=3, history_min=200, history_max=400, question_tokens=40,
              output_min=4, output_max=8)  # fmt: skip


async def _serve(app: web.Application, body):
    # a hung handler ends when its client gives up, not at the default 60 s shutdown timeout
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        return await body(f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


def _run(load: Load, convs=None, delay_s: float = 0.002):
    app = make_app(delay_s)
    convs = convs or workload(0, SCALE, TokenSizer())

    async def body(url):
        return await run_load(url, convs, load, progress=False)

    return asyncio.run(_serve(app, body)), app[STATE], convs


def test_saturation_streams_every_turn():
    recs, state, convs = _run(Load("saturation", concurrency=3))
    assert len(recs) == len(convs) * SCALE.turns == state["requests"]
    assert all(r["ok"] for r in recs), [r["error"] for r in recs if not r["ok"]]
    assert state["max_inflight"] <= 3  # conversations in flight, one request each
    by = {(r["conversation"], r["turn"]): r for r in recs}
    for conv in convs:
        for t, n in enumerate(conv.max_tokens):
            r = by[conv.index, t]
            assert r["output_tokens"] == n
            assert 0 < r["ttft_s"] < r["end_s"] - r["start_s"] + 1e-6
            assert r["tpot_s"] is not None and 0 < r["tpot_s"] < 1
            if t == 0:
                assert r["cached_tokens"] == 0 and r["prior_tokens"] == 0
            else:  # the fake radix cache holds the previous turn's prompt
                prev = by[conv.index, t - 1]
                assert r["cached_tokens"] == prev["prompt_tokens"]
                assert r["prior_tokens"] == prev["prompt_tokens"] + prev["output_tokens"]
                assert r["start_s"] >= prev["end_s"]  # turns of a conversation in order
        last = by[conv.index, SCALE.turns - 1]
        assert last["recalled"] is True and conv.recall_answer in last["answer"]
        assert all(by[conv.index, t]["recalled"] is None for t in range(SCALE.turns - 1))


def test_poisson_arrivals_spread_out():
    load = Load("poisson", concurrency=64, rate=20.0, seed=1)
    starts = load.start_times(6)
    assert starts == Load("poisson", concurrency=64, rate=20.0, seed=1).start_times(6)
    assert starts[0] == 0 and all(b > a for a, b in zip(starts, starts[1:], strict=False))
    recs, _, _ = _run(load)
    first = sorted(r["start_s"] for r in recs if r["turn"] == 0)
    assert all(f >= s - 0.01 for f, s in zip(first, starts, strict=True))  # none before its arrival
    assert all(r["ok"] for r in recs)


def test_request_timeout_fails_the_conversation_and_the_run_ends():
    convs = workload(0, SCALE, TokenSizer())
    hung = convs[1]
    qs = list(hung.questions)
    qs[1] = "HANG " + qs[1]
    convs[1] = type(hung)(hung.index, hung.history, tuple(qs), hung.max_tokens, hung.recall_key,
                          hung.recall_answer, hung.history_tokens)  # fmt: skip
    recs, _, _ = _run(Load("saturation", concurrency=6, request_timeout_s=0.5), convs)
    bad = [r for r in recs if not r["ok"]]
    assert [(r["conversation"], r["turn"]) for r in bad] == [(1, 1), (1, 2)]
    assert "Timeout" in bad[0]["error"] and "earlier turn failed" in bad[1]["error"]
    assert sum(r["ok"] for r in recs) == len(recs) - 2


def test_run_timeout_records_unsent_turns():
    load = Load("saturation", concurrency=1, run_timeout_s=0.3)
    recs, _, convs = _run(load, delay_s=0.05)  # a turn takes 0.2-0.4 s
    assert len(recs) == len(convs) * SCALE.turns
    unsent = [r for r in recs if not r["ok"]]
    assert unsent and all("run timeout" in r["error"] for r in unsent)


def test_load_validation():
    with pytest.raises(ValueError):
        Load("poisson", concurrency=4)
    with pytest.raises(ValueError):
        Load("burst", concurrency=4)
    assert Load("saturation", concurrency=8).label == "saturation:8"
    assert Load("poisson", concurrency=8, rate=0.5).label == "poisson:0.5"


def _qwen_config(folder: Path) -> Path:
    """A model folder with Qwen2.5-0.5B's config alone (the benchmark reads its KV shape)."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 24, "num_key_value_heads": 2, "num_attention_heads": 14,
         "hidden_size": 896}))  # fmt: skip
    return folder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_benchmark_end_to_end_with_fake_servers(tmp_path, monkeypatch):
    """main(): one fake server per system, a system that fails to start, records, summary with
    the issue's fields, the plot, and a second call that adds rows to the same summary."""
    import serve_multiturn

    fake = str(Path(__file__).with_name("fake_openai.py"))

    def command(system, kv_bytes, geometry, opts):
        cmd = [sys.executable, fake, "--port", str(opts.port)]
        return (
            cmd
            + (["--fail"] if system.kind == "fp8" else [])
            + (["--tiered"] if system.kind == "qevict" else [])
        )

    monkeypatch.setattr(serve_multiturn, "server_command", command)
    model = _qwen_config(tmp_path / "model")
    out = tmp_path / "out"
    common = ["--model", str(model), "--scale", "conversations=3,turns=2,history=200:300,"
              "output=4:6,question=30", "--rate", "50", "--concurrency", "2",
              "--port", str(_free_port()), "--out", str(out), "--no-progress",
              "--start-timeout", "60", "--commit", "abc"]  # fmt: skip
    assert serve_multiturn.main(common + ["--systems", "bf16,fp8"]) == 0
    assert serve_multiturn.main(common + ["--systems", "qevict@10%", "--warmup", "0"]) == 0
    summary = json.loads((out / "serve-summary.json").read_text())
    assert summary["kv_bytes"] == 16_000 * 12_288 and summary["commit"] == "abc"
    assert {"gpu", "commit", "model", "kv_bytes", "rows"} <= summary.keys()
    rows = {(r["name"], r["arrival"]): r for r in summary["rows"]}
    assert set(rows) == {(n, a) for n in ("bf16", "fp8", "qevict@10%")
                         for a in ("saturation:2", "poisson:50")}  # fmt: skip
    for (name, _), row in rows.items():
        if name == "fp8":
            assert "exited 3" in row["error"] and "refusing to start" in row["error"]
            continue
        for key in ("output_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p99_ms",
                    "hit_rate", "recall"):  # fmt: skip
            assert row[key] is not None, (name, key)
        assert row["errors"] == 0 and row["recall"] == 1.0 and row["hit_rate"] > 0
        assert row["pool"]["tokens"] == 1234 and row["max_total_num_tokens"] == 1234
        assert row["memory_usage_gb"]["kvcache"] == 0.183
    # the warm-up's conversations, then the cache emptied before each arrival mode
    warmed = rows["bf16", "poisson:50"]
    assert warmed["warmup_errors"] == 0 and warmed["warmup_s"] >= 0
    assert rows["bf16", "poisson:50"]["flushed"] is True
    assert rows["bf16", "saturation:2"]["flushed"] is True
    assert rows["qevict@10%", "poisson:50"]["flushed"] is None  # --warmup 0: a new server's cache
    assert "warmup_s" not in rows["qevict@10%", "poisson:50"]
    assert summary["warmup_conversations"] == 0  # the last call's
    hits = [rows["bf16", a]["hit_rate"] for a in ("poisson:50", "saturation:2")]
    assert hits[0] == hits[1]  # the second mode's first turns found no earlier answers
    assert rows["qevict@10%", "saturation:2"]["budget"] == "10%"
    # the tiered server's stats after each load, only the keys the benchmark keeps
    stats = rows["qevict@10%", "saturation:2"]["tiered"]
    assert stats["routes"] > 0 and stats["host_s"] == {"route": 0.1} and "peak_tokens" not in stats
    assert "tiered" not in rows["bf16", "saturation:2"]
    from serving.servers import KVGeometry, System

    qevict = System.parse("qevict@10%").pool_tokens(16_000 * 12_288, KVGeometry(24, 2, 64))
    assert rows["qevict@10%", "saturation:2"]["pool_tokens_flag"] == qevict
    assert rows["bf16", "saturation:2"]["pool_tokens_flag"] == 16_000
    lines = (out / "records" / "bf16.saturation-2.jsonl").read_text().splitlines()
    assert len(lines) == 3 * 2
    assert (out / "serve.png").stat().st_size > 0


def test_servers_started_together(tmp_path, monkeypatch):
    """--start-together: every server launched before any is waited for, every one healthy
    before the first load, each on its own port, the loads one system at a time, each server
    stopped after its own loads; a server that fails to start only costs its own rows."""
    import serve_multiturn
    from serving.servers import Server

    fake = str(Path(__file__).with_name("fake_openai.py"))
    events: list[tuple[str, int]] = []

    def command(system, kv_bytes, geometry, opts):
        return [sys.executable, fake, "--port", str(opts.port)] + (
            ["--fail"] if system.kind == "fp8" else []
        )

    def spy(name):
        original = getattr(Server, name)

        def wrapped(self, *a, **k):
            events.append((name, self.port))
            return original(self, *a, **k)

        monkeypatch.setattr(Server, name, wrapped)

    for name in ("start", "wait_healthy", "flush_cache", "stop"):
        spy(name)
    monkeypatch.setattr(serve_multiturn, "server_command", command)
    model = _qwen_config(tmp_path / "model")
    out, port = tmp_path / "out", _free_port()
    argv = ["--model", str(model), "--scale", "conversations=2,turns=2,history=200:300,"
            "output=4:6,question=30", "--concurrency", "2", "--port", str(port),
            "--out", str(out), "--no-progress", "--start-timeout", "60", "--commit", "abc",
            "--systems", "bf16,fp8,hicache", "--start-together"]  # fmt: skip
    assert serve_multiturn.main(argv) == 0
    ports = [port, port + 10, port + 20]
    starts = [p for e, p in events if e == "start"]
    assert starts == ports
    first_load = next(i for i, (e, _) in enumerate(events) if e == "flush_cache")
    assert max(i for i, (e, _) in enumerate(events) if e in ("start", "wait_healthy")) < first_load
    # bf16 is stopped before hicache's loads begin
    stop_bf16 = events.index(("stop", port))
    assert stop_bf16 < events.index(("flush_cache", port + 20))
    rows = {r["name"]: r for r in json.loads((out / "serve-summary.json").read_text())["rows"]}
    assert rows["bf16"]["started_together"] and rows["bf16"]["errors"] == 0
    assert rows["hicache"]["recall"] == 1.0 and rows["hicache"]["gpu_released"] is None
    assert "exited 3" in rows["fp8"]["error"]
    assert _flag(rows["hicache"]["command"], "--port") == str(port + 20)


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_help(capsys):
    import serve_multiturn

    with pytest.raises(SystemExit) as exit_:
        serve_multiturn.parse_args(["--help"])
    assert exit_.value.code == 0
    assert "qevict@10%" in capsys.readouterr().out


def test_dry_run_starts_nothing(tmp_path, capsys):
    import serve_multiturn

    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 24, "num_key_value_heads": 2, "num_attention_heads": 14,
         "hidden_size": 896}))  # fmt: skip
    out = tmp_path / "out"
    argv = ["--model", str(tmp_path), "--dry-run", "--out", str(out), "--kv-gib", "1"]
    assert serve_multiturn.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    cmds = {ln.split()[0]: ln.split() for ln in lines[1:]}
    assert set(cmds) == {"bf16", "fp8", "hicache", "qevict@10%", "qevict@25%", "rdkv@10%"}
    flag = {k: int(v[v.index("--max-total-tokens") + 1]) for k, v in cmds.items()}
    assert flag["fp8"] == 2 * flag["bf16"] == 2 * (1 << 30) // 12288
    from serving.servers import KVGeometry, System

    qevict = System.parse("qevict@10%").pool_tokens(1 << 30, KVGeometry(24, 2, 64))
    assert flag["qevict@10%"] == qevict  # the plugin's cell size, tables and engine state in
    assert not out.exists()


def test_a_client_bug_is_recorded_not_lost(monkeypatch):
    from serving import client

    def broken(conv, text):
        raise KeyError("boom")

    monkeypatch.setattr(client, "answered", broken)  # called on each last turn
    recs, _, convs = _run(Load("saturation", concurrency=3))
    last = [r for r in recs if r["turn"] == SCALE.turns - 1]
    assert len(last) == len(convs) and not any(r["ok"] for r in last)
    assert all("client error: KeyError" in r["error"] for r in last)
    assert all(r["ok"] for r in recs if r["turn"] < SCALE.turns - 1)
