"""bench/e2e_compare.py: two end-to-end runs' answers compared policy by policy (issue 19's
kernel-against-SDPA check)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import e2e_compare  # noqa: E402


def _write(folder: Path, policy: str, answers: list[str], needle: str, demote: int) -> None:
    folder.mkdir(exist_ok=True)
    result = {"turns": [{"answer": a} for a in answers], "needle": {"answer": needle},
              "stats": {"routes": 3, "demote": demote, "promote": 0, "evict": 4}}  # fmt: skip
    (folder / f"{policy}.json").write_text(json.dumps(result))
    (folder / f"{policy}.stats.json").write_text("{}")  # the server's stats file: not a result


def test_same_answers_pass_and_a_different_one_is_named(tmp_path, capsys, monkeypatch):
    a, b = tmp_path / "kernel", tmp_path / "sdpa"
    _write(a, "qevict", ["Hi.", "Miso."], "tangerine", 10)
    _write(b, "qevict", ["Hi.", "Miso."], "tangerine", 11)
    _write(a, "rdkv", ["Hi.", "Miso."], "tangerine", 5)
    _write(b, "rdkv", ["Hi.", "Soup."], "tangerine", 5)
    _write(a, "only_here", ["x"], "y", 0)  # in one folder only: not compared
    out = e2e_compare.compare(a, b)
    assert set(out) == {"qevict", "rdkv"}
    assert out["qevict"]["same"] and out["qevict"]["answers"] == 3
    assert (
        out["qevict"]["counters"][0]["demote"] == 10
        and out["qevict"]["counters"][1]["demote"] == 11
    )
    assert not out["rdkv"]["same"] and out["rdkv"]["first_diff"] == [1, "Miso.", "Soup."]
    monkeypatch.setattr(
        sys, "argv", ["e2e_compare.py", str(a), str(b), "--out", str(tmp_path / "c.json")]
    )
    assert e2e_compare.main() == 1
    assert "rdkv: 3 answers, DIFFER" in capsys.readouterr().out
    assert json.loads((tmp_path / "c.json").read_text())["qevict"]["same"]


def test_all_same_exits_0_and_nothing_to_compare_exits_1(tmp_path, monkeypatch):
    a, b = tmp_path / "kernel", tmp_path / "sdpa"
    _write(a, "qevict", ["Hi."], "tangerine", 1)
    _write(b, "qevict", ["Hi."], "tangerine", 1)
    monkeypatch.setattr(sys, "argv", ["e2e_compare.py", str(a), str(b)])
    assert e2e_compare.main() == 0
    (tmp_path / "empty").mkdir()
    monkeypatch.setattr(sys, "argv", ["e2e_compare.py", str(a), str(tmp_path / "empty")])
    assert e2e_compare.main() == 1


def test_an_expected_policy_missing_from_a_run_fails(tmp_path, capsys, monkeypatch):
    a, b = tmp_path / "kernel", tmp_path / "sdpa"
    _write(a, "qevict", ["Hi."], "tangerine", 1)
    _write(b, "qevict", ["Hi."], "tangerine", 1)
    _write(b, "rdkv", ["Hi."], "tangerine", 1)  # the kernel run's rdkv server never answered
    out = e2e_compare.compare(a, b, ["qevict", "rdkv"])
    assert out["qevict"]["same"] and out["rdkv"] == {"same": False, "missing": ["kernel"]}
    argv = ["e2e_compare.py", str(a), str(b), "--policies", "qevict,rdkv"]
    monkeypatch.setattr(sys, "argv", argv)
    assert e2e_compare.main() == 1
    assert "rdkv: MISSING in kernel" in capsys.readouterr().out
