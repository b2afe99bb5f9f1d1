"""The serving benchmark's systems: one KV byte target to each system's server flags
(bench/serving/servers.py), and the pool SGLang logs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from serving.servers import KVGeometry, ServerOptions, System, pool_from_log, server_command  # noqa: E402

QWEN = KVGeometry(layers=24, kv_heads=2, head_dim=64)  # Qwen2.5-0.5B: 12 KiB a bf16 token
GIB = 1 << 30


def _flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_geometry_from_config(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"num_hidden_layers": 24, "num_key_value_heads": 2, "num_attention_heads": 14, '
        '"hidden_size": 896}'
    )
    assert KVGeometry.of_model(tmp_path) == QWEN
    assert QWEN.bytes_per_token() == 12 * 1024 and QWEN.bytes_per_token(1) == 6 * 1024


def test_a_model_folder_without_config_stops_the_run_with_its_reason(tmp_path, capsys):
    import serve_multiturn

    with pytest.raises(ValueError, match="no config.json there"):
        KVGeometry.of_model(tmp_path)
    argv = ["--model", str(tmp_path), "--out", str(tmp_path / "o"), "--dry-run"]
    with pytest.raises(SystemExit, match="serve_multiturn.py: --model .*: no config.json"):
        serve_multiturn.main(argv)


@pytest.mark.parametrize(
    "spec, tokens",
    [("bf16", GIB // 12288), ("hicache", GIB // 12288), ("fp8", GIB // 6144)],
)  # fmt: skip
def test_same_bytes_for_every_plain_system(spec, tokens):
    system = System.parse(spec)
    assert system.pool_tokens(GIB, QWEN) == tokens
    itemsize = 1 if system.kind == "fp8" else 2
    spent = tokens * QWEN.bytes_per_token(itemsize)
    assert GIB - QWEN.bytes_per_token() < spent <= GIB


@pytest.mark.parametrize("spec", ["qevict@10%", "qevict@25%", "rdkv@10%"])
def test_a_tiered_pool_gets_the_slots_its_cell_size_fits(spec):
    """The plugin's own cell size (rows and pages at the budget, plus tables and engine state)
    divides the bytes: fewer than 1/f times bf16's slots, more than bf16's; a decoupled policy
    (RDKV: rows for a quarter of its slots and a Zone A store at twice the budget) more than
    bf16's too, up to ``1 / (DECOUPLED_ROW_SHARE + ZONE_SLACK * f)`` times."""
    from tiered_radix.adapters.sglang.config import parse_budget
    from tiered_radix.adapters.sglang.sizing import DECOUPLED_ROW_SHARE, ZONE_SLACK, cell_bytes
    from tiered_radix.policy import load_policy

    system = System.parse(spec)
    cell = cell_bytes(load_policy(system.kind), parse_budget(system.budget), 24, 2, 64, 2)
    tokens = system.pool_tokens(GIB, QWEN)
    assert tokens == GIB // cell
    f = float(system.fraction())
    policy = load_policy(system.kind)
    if not policy.coupled:
        data = DECOUPLED_ROW_SHARE + ZONE_SLACK * f
        assert GIB // 12288 < tokens and 0.7 * GIB / (12288 * data) < tokens < GIB / (12288 * data)
    else:
        assert GIB // 12288 < tokens < GIB / (12288 * f)


def test_server_flags():
    opts = ServerOptions(model="/m", port=1234, hicache_gb=40)
    cmd = {s: server_command(System.parse(s), GIB, QWEN, opts)
           for s in ("bf16", "fp8", "hicache", "qevict@10%", "rdkv@10%")}  # fmt: skip
    for spec, c in cmd.items():
        assert c[1:3] == ["-m", "sglang.launch_server"] and "--enable-cache-report" in c
        assert _flag(c, "--max-total-tokens") == str(System.parse(spec).pool_tokens(GIB, QWEN))
        assert _flag(c, "--port") == "1234" and _flag(c, "--model-path") == "/m"
    assert _flag(cmd["bf16"], "--attention-backend") == "triton"
    assert _flag(cmd["fp8"], "--kv-cache-dtype") == "fp8_e4m3"
    assert "--enable-hierarchical-cache" in cmd["hicache"]
    assert _flag(cmd["hicache"], "--hicache-size") == "40"
    assert _flag(cmd["qevict@10%"], "--kv-policy") == "qevict"
    assert _flag(cmd["qevict@10%"], "--kv-budget") == "10%"
    assert "--attention-backend" not in cmd["rdkv@10%"]  # the plugin picks it
    assert "--kv-policy" not in cmd["bf16"] + cmd["fp8"] + cmd["hicache"]


def test_a_tiered_system_takes_the_plugins_options():
    """``qevict@10%+kv-route-clock=server+kv-device-times``: the same pool, and the server gets
    ``--kv-route-clock server --kv-device-times``; the name says them (logs, rows, the plot)."""
    system = System.parse("qevict@10%+kv-route-clock=server+kv-device-times")
    assert system.name == "qevict@10%+kv-route-clock=server+kv-device-times"
    assert system.label == "qevict" and system.budget == "10%"
    assert system.pool_tokens(GIB, QWEN) == System.parse("qevict@10%").pool_tokens(GIB, QWEN)
    cmd = server_command(system, GIB, QWEN, ServerOptions(model="/m"))
    assert _flag(cmd, "--kv-route-clock") == "server" and "--kv-device-times" in cmd
    assert _flag(cmd, "--kv-budget") == "10%"


@pytest.mark.parametrize(
    "bad",
    [
        "fp16",
        "qevict",
        "bf16@10%",
        "qevict@2GiB",
        "rdkv@0%",
        "no/such.yaml@10%",
        "bf16+kv-route-clock=server",
        "qevict@10%+route-clock=server",
        "qevict@10%+kv-x=",
    ],
)
def test_bad_systems(bad):
    with pytest.raises(ValueError):
        System.parse(bad)


def test_a_policy_file_is_a_tiered_system(tmp_path, monkeypatch):
    """A user's own policy file serves with ``--kv-policy`` at its absolute path (servers run in
    the output folder), is named by its file's stem, and sizes its pool as the shipped policies
    do: a file equal to the shipped qevict gets qevict's slots."""
    from tiered_radix.resources import policies_dir

    (tmp_path / "mine.yaml").write_text((policies_dir() / "qevict.yaml").read_text())
    monkeypatch.chdir(tmp_path)
    system = System.parse("mine.yaml@10%")
    assert system.tiered and system.name == "mine@10%" and system.label == "mine"
    cmd = server_command(system, GIB, QWEN, ServerOptions(model="/m"))
    assert _flag(cmd, "--kv-policy") == str(tmp_path / "mine.yaml")
    assert _flag(cmd, "--kv-budget") == "10%" and "--attention-backend" not in cmd
    assert system.pool_tokens(GIB, QWEN) == System.parse("qevict@10%").pool_tokens(GIB, QWEN)
    with pytest.raises(ValueError, match="budget"):
        System.parse("mine.yaml")


def test_pool_from_log():
    log = (
        "[2026-12-02] Load weight end.\n"
        "[2026-12-02] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 87381, "
        "K size: 0.50 GB, V size: 0.50 GB\n"
    )
    assert pool_from_log(log) == {"dtype": "torch.bfloat16", "tokens": 87381, "bytes": GIB}
    one = "KV Cache is allocated. dtype: torch.float8_e4m3fn, #tokens: 10, KV size: 0.25 GB"
    assert pool_from_log(one)["bytes"] == GIB // 4
    assert pool_from_log("no pool here") is None


def test_gpu_memory_peak_over_baseline(monkeypatch):
    import time

    from serving import servers

    readings = iter([1000, 1200, 5000, 3000, 4000] + [1300] * 100)
    current = {"v": 1000}

    def fake():
        current["v"] = next(readings, 1300)
        return current["v"]

    monkeypatch.setattr(servers, "gpu_used_mib", fake)
    with servers.GpuMemory(every_s=0.001) as mem:
        while current["v"] != 1300:
            time.sleep(0.005)
    assert mem.baseline == 1000 and mem.peak_mib == 4000
    assert mem.wait_released(limit_s=1) is True


def test_gpu_memory_without_nvidia_smi(monkeypatch):
    from serving import servers

    monkeypatch.setattr(servers, "gpu_used_mib", lambda: None)
    with servers.GpuMemory() as mem:
        pass
    assert mem.peak_mib is None and mem.wait_released() is None


def test_process_tree_from_proc(tmp_path):
    """The launcher and its descendants, from each process's parent field; a command name
    with spaces and parentheses does not shift the fields."""
    from serving.servers import process_tree

    for pid, ppid, comm in [(1, 0, "init"), (10, 1, "python"), (11, 10, "sglang::scheduler (0)"),
                            (12, 11, "x"), (20, 1, "other"), (21, 20, "y")]:  # fmt: skip
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({comm}) S {ppid} 1 1 0 -1\n")
    (tmp_path / "self").mkdir()  # not a PID: skipped
    assert process_tree(10, tmp_path) == {10, 11, 12}
    assert process_tree(20, tmp_path) == {20, 21}
    assert process_tree(99, tmp_path) == {99}


def test_gpu_used_by_sums_the_listed_processes(monkeypatch):
    from serving import servers

    listing = {"out": "10, 1500\n11, 2500\n30, 9000\n"}
    monkeypatch.setattr(servers, "_nvidia_smi", lambda query, what: listing["out"])
    assert servers.gpu_used_by({10, 11, 12}) == 4000
    assert servers.gpu_used_by({12}) is None  # none of them listed: unknown, not 0
    listing["out"] = "10, [N/A]\n"
    assert servers.gpu_used_by({10}) is None
    monkeypatch.setattr(servers, "_nvidia_smi", lambda query, what: None)
    assert servers.gpu_used_by({10}) is None


def test_gpu_memory_of_one_server_started_beside_others(monkeypatch):
    """With a PID the peak is the server's own processes' (baseline 0), None until listed."""
    import time

    from serving import servers

    readings = iter([None, 700, 2100, 1800] + [1800] * 100)
    seen = []

    def fake(pids):
        seen.append(pids)
        return next(readings, 1800)

    monkeypatch.setattr(servers, "gpu_used_by", fake)
    monkeypatch.setattr(servers, "process_tree", lambda pid: {pid, pid + 1})
    pid = {"v": None}
    with servers.GpuMemory(every_s=0.001, pid=lambda: pid["v"]) as mem:
        time.sleep(0.02)
        assert mem.peak_mib is None and not seen  # not launched yet: nothing polled
        pid["v"] = 40
        while len(seen) < 6:
            time.sleep(0.005)
    assert seen[0] == {40, 41} and mem.baseline == 0 and mem.peak_mib == 2100


def test_a_tiered_rows_line_says_its_eager_steps_and_routing_time():
    """The line printed after each load: a tiered server's decode steps run without graphs
    and its routing host seconds after the common figures (run 22's serving ran 580 of 1,388
    steps eagerly, which only its log said)."""
    import serve_multiturn

    row = {"output_tok_s": 605.0, "ttft_p50_s": 0.169, "errors": 0}
    assert "eager_steps" not in serve_multiturn._brief(row)
    row["tiered"] = {"host_s": {"graph_too_long": 580.0, "decode_steps": 1388.0, "route": 6.07}}
    line = serve_multiturn._brief(row)
    assert line.startswith("output_tok_s=605, ttft_p50_s=0.169")
    assert line.endswith("eager_steps=580/1388, route_s=6.07")
