"""Grid runner, resume cache, report and plots, driven by a fake engine (no model needed).

``OracleEngine`` reads the answer straight out of the prompt, so the harness's bookkeeping can
be checked against known scores: full KV and budgets >= 15% answer right, smaller budgets
answer wrong.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re

import pytest

from tiered_radix.cli.main import main
from tiered_radix.eval.engines import Reply, flatten_stats
from tiered_radix.eval.plot import write_plots
from tiered_radix.eval.report import build_report, build_rows, markdown_report, markdown_table
from tiered_radix.eval.runner import RESULTS, Grid, merge_results, parse_shard, run_grid
from tiered_radix.policy import load_policy

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
_WORD = re.compile(r"\w+|[^\w\s]")


class OracleEngine:
    name, model = "fake", "oracle"
    context_window = None

    def __init__(self, failing: tuple[str, ...] = ()) -> None:
        self.calls: list[tuple[str, str, int]] = []
        self.failing = failing

    def count_tokens(self, text: str) -> int:
        return len(_WORD.findall(text))

    def _answer(self, text: str, policy) -> Reply:
        if policy.name in self.failing:
            raise RuntimeError("kernel exploded")
        frac = policy.budget.value
        question = text.rsplit("\n", 1)[-1]
        found = re.findall(r"numbers for ([\w-]+) is: (\d+)\.", text)
        right = " ".join(v for k, v in found if k in question)
        wrong = policy.name != "full" and frac < 0.15
        stats = {"bytes_used": int(1000 * frac), "full_bytes": 1000, "diag": {"fmm": frac / 2},
                 "over_budget": wrong}  # fmt: skip
        return Reply("I do not know" if wrong else f"The number is {right}.", flatten_stats(stats))

    def generate(self, prompt, policy, max_new_tokens):
        self.calls.append((policy.name, "generate", 1))
        return self._answer(prompt, policy)

    def chat(self, turns, policy, max_new_tokens):
        self.calls.append((policy.name, "chat", len(turns)))
        return [self._answer("\n".join(turns[: i + 1]), policy) for i in range(len(turns))]


def _grid(**kw) -> Grid:
    base = dict(
        policies=(load_policy("full"), load_policy("streaming"), load_policy("qevict")),
        budgets=("10%", "20%"), tasks=("niah_single", "multiturn", "needle"), lengths=(400,),
        samples=2,
    )  # fmt: skip
    return Grid(**{**base, **kw})


def test_grid_scores_and_report(tmp_path):
    engine = OracleEngine()
    records = run_grid(engine, _grid(), tmp_path, progress=False)
    configs = 1 + 2 * 2  # full once (not per budget) + 2 policies x 2 budgets
    assert len(records) == (2 + 2 + 2 * 5) * configs
    assert sum(c[1] == "chat" and c[2] == 3 for c in engine.calls) == 2 * configs
    rows = {(r["task"], r["policy"], r["budget"]): r for r in build_report(records, {})["rows"]}
    for task in ("niah_single", "multiturn", "needle"):
        assert rows[(task, "full", "100%")]["score"] == 100.0
        assert rows[(task, "full", "100%")]["reference"]
        for policy in ("streaming", "qevict"):
            low, high = rows[(task, policy, "10%")], rows[(task, policy, "20%")]
            assert low["score"] == 0.0 and low["retention"] == 0.0
            assert high["score"] == 100.0 and high["retention"] == 100.0
            assert low["bytes_fraction"] == pytest.approx(0.1)
            assert high["fmm"] == pytest.approx(0.1)
    assert rows[("needle", "full", "100%")]["n"] == 10
    assert rows[("niah_single", "qevict", "10%")]["ci_high"] == pytest.approx(100 * 0.6576, 1e-3)


def test_resume_skips_done_cells_and_survives_a_torn_line(tmp_path):
    grid = _grid(tasks=("niah_single",), samples=3)
    first = run_grid(OracleEngine(), grid, tmp_path, progress=False)
    again = OracleEngine()
    assert run_grid(again, grid, tmp_path, progress=False) == first and again.calls == []
    path = tmp_path / RESULTS
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-2]) + "\n" + lines[-2][:40])  # interrupted mid-write
    resumed = OracleEngine()
    records = run_grid(resumed, grid, tmp_path, progress=False)
    assert len(resumed.calls) == 2
    assert [r["key"] for r in records] == [r["key"] for r in first]


def test_changed_policy_is_rerun(tmp_path):
    grid = _grid(tasks=("niah_single",), samples=1, policies=(load_policy("streaming"),))
    run_grid(OracleEngine(), grid, tmp_path, progress=False)
    p = load_policy("streaming")
    edited = dataclasses.replace(p, protect=dataclasses.replace(p.protect, sinks=8))
    again = OracleEngine()
    run_grid(again, dataclasses.replace(grid, policies=(edited,)), tmp_path, progress=False)
    assert [c[0] for c in again.calls] == ["streaming", "streaming"]  # full KV was cached


def test_failing_policy_is_recorded_and_retried(tmp_path):
    grid = _grid(tasks=("niah_single",), samples=2)
    records = run_grid(OracleEngine(failing=("qevict",)), grid, tmp_path, progress=False)
    report = build_report(records, {"model": "oracle"})
    assert len(report["errors"]) == 2 * 2
    assert "kernel exploded" in markdown_report(report)
    row = next(r for r in report["rows"] if r["policy"] == "qevict")
    assert row["n"] == 0 and row["errors"] == 2 and row["score"] is None
    retry = OracleEngine()
    run_grid(retry, grid, tmp_path, progress=False)
    assert {c[0] for c in retry.calls} == {"qevict"} and len(retry.calls) == 4


def test_report_files_and_plots(tmp_path):
    records = run_grid(OracleEngine(), _grid(), tmp_path, progress=False)
    report = build_report(records, {"model": "oracle", "engine": "fake"})
    heat = [c for c in report["depths"] if c["policy"] == "full"]
    assert sorted(c["depth"] for c in heat) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert all(c["n"] == 2 and c["score"] == 100.0 for c in heat)
    paths = write_plots(report, tmp_path)
    assert {p.name for p in paths} == {
        "score_vs_budget.png", "needle_heatmap.png", "diagnostics.png"
    }  # fmt: skip
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
    md = markdown_report(report)
    assert "| niah_single | 400 | streaming | 10% | 0.0 | [0, 66] | 2 | 0% | 10.0% (2 over) |" in md
    assert "| niah_single | 400 | streaming | 20% | 100.0 | [34, 100] | 2 | 100% | 20.0% |" in md
    json.dumps(report)  # JSON-ready


def test_flatten_stats():
    @dataclasses.dataclass(frozen=True)
    class Turn:
        text: str
        occupancy: dict
        layers: list
        nan: float

    flat = flatten_stats(Turn("hi", {"full": 3, "int2": 5}, [0.25, 0.75], float("nan")))
    assert flat == {"text": "hi", "occupancy.full": 3, "occupancy.int2": 5, "layers": 0.5,
                    "nan": None}  # fmt: skip


@pytest.mark.parametrize(
    "argv, message",
    [
        pytest.param(
            ["--engine", "sglang"],
            "needs SGLang",
            marks=pytest.mark.skipif(HAVE_SGLANG, reason="sglang installed: the engine starts"),
        ),
        (["--tasks", "niah_singel"], "Did you mean 'niah_single'"),
        (["--lengths", "1m"], "bad length"),
        (["--budgets", "10 parsecs"], "budget"),
        (["--policies", "qevikt"], "qevict"),
        (["--samples", "0"], "at least 1"),
        (["--shard", "2/2"], "bad shard"),
        (["--engine-arg", "mem_fraction_static"], "KEY=VALUE"),
        (["--report-from", "no-such-dir"], "results.jsonl does not exist"),
    ],
)
def test_cli_input_errors_exit_2(argv, message, tmp_path, capsys):
    assert main(["eval", "--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / RESULTS).exists()


class SharedOracle(OracleEngine):
    """The oracle with a shared prefill: one ``prefill`` per single-turn sample."""

    def prefill(self, prompt, policies):
        self.calls.append(("*", "prefill", len(policies)))
        return prompt

    def decode(self, prefill, policy, max_new_tokens, answers=()):
        self.calls.append((policy.name, "decode", len(answers)))
        return self._answer(prefill, policy)


def test_shared_prefill_once_per_single_turn_sample(tmp_path):
    engine = SharedOracle()
    grid = _grid(tasks=("niah_single", "multiturn"), stop_when_answered=True)
    records = run_grid(engine, grid, tmp_path, progress=False)
    kinds = [c[1] for c in engine.calls]
    assert kinds.count("prefill") == 2  # niah_single's 2 samples; multiturn chats instead
    assert kinds.count("decode") == 2 * 5 and kinds.count("chat") == 2 * 5
    assert all(c[2] == 1 for c in engine.calls if c[1] == "decode")  # answers passed on
    plain = run_grid(OracleEngine(), _grid(tasks=("niah_single", "multiturn")), tmp_path / "p",
                     progress=False)  # fmt: skip
    strip = [{k: v for k, v in r.items() if k not in ("key", "seconds")} for r in records]
    assert strip == [{k: v for k, v in r.items() if k not in ("key", "seconds")} for r in plain]


def test_single_tier_policy_runs_once(tmp_path):
    grid = _grid(policies=(load_policy("kivi"), load_policy("h2o")), tasks=("niah_single",))
    records = run_grid(OracleEngine(), grid, tmp_path, progress=False)
    configs = {(r["policy"], r["budget"]) for r in records}
    assert configs == {("full", "100%"), ("kivi", "100%"), ("h2o", "10%"), ("h2o", "20%")}


def test_deadline_stops_before_the_next_sample(tmp_path, monkeypatch):
    import tiered_radix.eval.runner as runner

    clock = iter([0.0, 0.0, 100.0, 100.0, 100.0])
    monkeypatch.setattr(runner.time, "monotonic", lambda: next(clock))
    records = run_grid(OracleEngine(), _grid(tasks=("niah_single",), samples=3), tmp_path,
                       progress=False, deadline=50.0)  # fmt: skip
    assert {r["index"] for r in records} == {0, 1} and len(records) == 2 * 5


def test_shards_split_the_samples_and_merge_to_the_whole_grid(tmp_path):
    """Three shards run disjoint samples that cover the grid; their merged records are the
    unsharded run's, and ``--report-from`` reports them as one run would."""
    grid = _grid(samples=4, tasks=("niah_single", "needle"))
    whole = run_grid(OracleEngine(), grid, tmp_path / "whole", progress=False)
    parts = [
        run_grid(OracleEngine(), dataclasses.replace(grid, shard=(i, 3)), tmp_path / f"s{i}",
                 progress=False)
        for i in range(3)
    ]  # fmt: skip
    seen = [{(r["task"], r["index"]) for r in part} for part in parts]
    assert all(seen) and not (seen[0] & seen[1] or seen[0] & seen[2] or seen[1] & seen[2])
    assert {r["index"] for r in parts[1] if r["task"] == "niah_single"} == {1}
    strip = lambda rs: sorted((r["key"], r["score"]) for r in rs)  # noqa: E731
    merged = merge_results([tmp_path / f"s{i}" for i in range(3)])
    assert strip(merged) == strip(whole)
    assert main(["eval", "--report-from", *(str(tmp_path / f"s{i}") for i in range(3)),
                 "--out", str(tmp_path / "m")]) == 0  # fmt: skip
    rows = json.loads((tmp_path / "m" / "report.json").read_text())["rows"]
    want = json.loads(json.dumps(build_rows(whole)))
    drop = lambda rs: [{k: v for k, v in r.items() if k != "seconds"} for r in rs]  # noqa: E731
    assert rows and drop(rows) == drop(want)  # timings differ, scores and bytes must not
    assert parse_shard("1/4") == (1, 4)


def test_retention_is_over_the_same_engines_full_kv():
    """Merged reports hold two full-KV rows (ours and kvpress's pipeline): each engine's rows
    are retained against their own (GPU run 7's 32K report divided ours by kvpress's)."""

    def rec(engine, policy, score, index):
        return dict(task="t", length=8, policy=policy, budget="10%" if "full" not in policy
                    else "100%", engine=engine, reference="full" in policy, score=score,
                    index=index)  # fmt: skip

    records = [rec("transformers", "full", 1.0, i) for i in range(4)]
    records += [rec("kvpress", "kvpress-full", s, i) for i, s in enumerate([1, 1, 0, 0])]
    records += [rec("transformers", "qevict", s, i) for i, s in enumerate([1, 1, 0, 0])]
    records += [rec("kvpress", "kvpress-snapkv", s, i) for i, s in enumerate([1, 1, 0, 0])]
    rows = {r["policy"]: r for r in build_report(records, {})["rows"]}
    assert rows["qevict"]["retention"] == 50.0
    assert rows["kvpress-snapkv"]["retention"] == 100.0
    assert rows["full"]["retention"] == rows["kvpress-full"]["retention"] == 100.0


def test_cells_record_cuda_peaks_where_cuda_was_used(tmp_path, monkeypatch):
    """With CUDA in use, each cell records its own peak (reset between cells) and the shared
    prefill's, and the process's peak survives the resets; without CUDA, neither field appears."""
    import sys
    import types

    from tiered_radix.eval import runner

    monkeypatch.setattr(runner, "_process_peak", [0])
    peaks = iter(range(9_900, 0, -100))  # falling: the process peak is not the last reading
    state = {"peak": 0}

    def max_memory_allocated():
        return state["peak"] << 20

    def reset_peak_memory_stats():
        state["peak"] = next(peaks)

    cuda = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True,
                                 max_memory_allocated=max_memory_allocated,
                                 reset_peak_memory_stats=reset_peak_memory_stats)  # fmt: skip
    grid = _grid(tasks=("niah_single",), samples=1)
    plain = run_grid(OracleEngine(), grid, tmp_path / "plain", progress=False)
    assert not any("cuda_peak_mib" in r for r in plain)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    recs = run_grid(OracleEngine(), grid, tmp_path / "cuda", progress=False)
    cells = [r["cuda_peak_mib"] for r in recs]
    assert len(cells) == len(recs) == 5 and len(set(cells)) == 5  # one reading per cell
    assert all(r.get("prefill_cuda_peak_mib") is None for r in recs)  # no shared prefill here
    assert runner.process_cuda_peak_mib() == max(cells)  # what the report's meta records


def test_archived_bytes_are_reported_beside_the_budgets():
    """``evict(archive=...)``'s copies are outside the budget: the row says them apart."""

    def rec(policy, index, used, archived):
        stats = {"bytes_used": used, "full_bytes": 100}
        if archived is not None:
            stats["archived_bytes"] = archived
        return dict(task="t", length=8, policy=policy, budget="10%", engine="transformers",
                    score=1.0, index=index, stats=stats)  # fmt: skip

    records = [rec("archive", 0, 10, 12), rec("archive", 1, 10, 14), rec("qevict", 0, 10, None)]
    report = build_report(records, {})
    rows = {r["policy"]: r for r in report["rows"]}
    assert rows["archive"]["bytes_fraction"] == pytest.approx(0.1)
    assert rows["archive"]["archived_fraction"] == pytest.approx(0.13)
    assert rows["qevict"]["archived_fraction"] is None
    table = markdown_table(report)
    assert "| 10.0% + 13.0% archived |" in table and table.count("archived") == 1
