"""`tiered-radix simulate`: exit codes and messages for bad input, and the files it writes."""

from __future__ import annotations

import json

import pytest

from tiered_radix.cli.main import main
from tiered_radix.sim.trace import synthetic_trace


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    return synthetic_trace(3, steps=24).save(tmp_path_factory.mktemp("trace") / "syn.npz")


def _run(capsys, *argv):
    code = main(["simulate", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_missing_trace_exits_2(capsys, tmp_path):
    code, _, err = _run(capsys, "-p", "full", "--trace", tmp_path / "nope.npz", "--out", tmp_path)
    assert code == 2 and "nope.npz" in err and "not a readable trace" in err
    assert not (tmp_path / "report.json").exists()


def test_corrupt_trace_exits_2(capsys, tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_text("not a zip file")
    code, _, err = _run(capsys, "-p", "full", "--trace", bad, "--out", tmp_path / "o")
    assert code == 2 and "bad.npz" in err


def test_unknown_policy_exits_2(capsys, trace_path, tmp_path):
    code, _, err = _run(capsys, "-p", "qevit", "--trace", trace_path, "--out", tmp_path)
    assert code == 2 and "no policy file 'qevit'" in err and "did you mean 'qevict'" in err


def test_bad_budget_exits_2(capsys, trace_path, tmp_path):
    code, _, err = _run(
        capsys, "-p", "streaming", "--trace", trace_path, "--budget", "ten", "--out", tmp_path
    )
    assert code == 2 and "--budget" in err


def test_writes_report_and_plots(capsys, trace_path, tmp_path):
    out = tmp_path / "res"
    code, stdout, _ = _run(
        capsys,
        "-p",
        "streaming",
        "-p",
        "h2o",
        "--trace",
        trace_path,
        "--budget",
        "10%",
        "--out",
        out,
    )
    assert code == 0
    assert "| streaming |" in stdout and "| h2o |" in stdout
    report = json.loads((out / "report.json").read_text())
    assert [e["policy"] for e in report["policies"]] == ["streaming", "h2o"]
    assert report["budget_override"].startswith("10%")
    assert "| h2o |" in (out / "report.md").read_text()
    for name in ("bytes.png", "occupancy.png", "quality.png"):
        assert (out / name).stat().st_size > 10_000


def test_policy_the_trace_cannot_feed_is_skipped_and_exits_2(capsys, tmp_path):
    v1 = synthetic_trace(3, steps=24, version=1).save(tmp_path / "v1.npz")  # no obs_attn
    code, _, err = _run(capsys, "-p", "streaming", "-p", "snapkv", "--trace", v1, "--out", tmp_path)
    assert code == 2 and "skipped snapkv" in err and "obs_attn" in err
    report = json.loads((tmp_path / "report.json").read_text())
    assert [e["policy"] for e in report["policies"]] == ["streaming"]
    assert report["skipped"][0]["policy"] == "snapkv"
