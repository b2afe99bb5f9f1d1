"""`tiered-radix chat`: argument errors exit 2 before any model is loaded; a real run (slow)."""

from __future__ import annotations

import re

import pytest

from tiered_radix.cli.chat import default_turns, read_turns
from tiered_radix.cli.main import main
from tiered_radix.models import get_spec
from tiered_radix.models.fetch import export_verifies
from tiered_radix.models.paths import model_dir


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-new-tokens", "0"], "at least 1"),
        (["--threads", "0"], "at least 1"),
        (["--policy", "no_such_policy"], "no_such_policy"),
        (["--budget", "ten percent"], "budget"),
        (["--turns", "/nonexistent/turns.txt"], "cannot read"),
        (["--model", "no-such-model"], "unknown model"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys):
    assert main(["chat", *argv]) == 2
    assert message in capsys.readouterr().err


def test_argparse_errors_exit_2():
    with pytest.raises(SystemExit) as e:
        main(["chat", "--max-new-tokens", "many"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["chat", "--device", "tpu"])
    assert e.value.code == 2


def test_empty_turns_file_exits_2(tmp_path, capsys):
    f = tmp_path / "turns.txt"
    f.write_text("\n  \n")
    assert main(["chat", "--turns", str(f)]) == 2
    assert "no turns" in capsys.readouterr().err


def test_turns_file_formats(tmp_path):
    lines = tmp_path / "lines.txt"
    lines.write_text("first question\n\nsecond question\n")
    assert read_turns(str(lines)) == ["first question", "second question"]
    blocks = tmp_path / "blocks.txt"
    blocks.write_text("a long\ndocument\n---\nquestion two\n---\n")
    assert read_turns(str(blocks)) == ["a long\ndocument", "question two"]
    turns = default_turns()
    assert len(turns) == 4 and "Ilse Moreno" in turns[0] and "bottle" in turns[-1]


@pytest.mark.slow
def test_real_chat_with_smollm2(capsys):
    if not export_verifies(model_dir("smollm2-135m"), get_spec("smollm2-135m")):
        pytest.skip("smollm2-135m is not fetched (tiered-radix model fetch smollm2-135m)")
    assert main(["chat", "--policy", "qevict", "--max-new-tokens", "12", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    kv = re.findall(r"kv: ([\d,]+) tokens \(([\d,]+) prefilled, ([\d,]+) reused", out)
    assert len(kv) == 4 and out.count("bot: ") == 4
    total, prefilled, reused = (int(x.replace(",", "")) for x in kv[1])
    assert reused == int(kv[0][0].replace(",", "")) and prefilled < 40  # only turn 2 prefilled
    shares = [float(x) for x in re.findall(r"full KV \(([\d.]+)%", out)]
    assert shares[0] < 15.0  # the first turn (the long log) is held near the 10% budget
    assert "int2" in out and "saved" in out
