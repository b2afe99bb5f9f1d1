"""The serving benchmark's workload (bench/serving/workload.py): seeded, sized, one planted fact."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from serving.workload import PRESETS, Scale, TokenSizer, answered, conversation, workload  # noqa: E402

SMALL = Scale(conversations=4, turns=4, history_min=1500, history_max=3000, question_tokens=100,
              output_min=16, output_max=48)  # fmt: skip


class WordTokenizer:
    """A stand-in Hugging Face tokenizer: one token per whitespace-separated word."""

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [t.split() for t in texts]}


def _all_text(conv) -> str:
    return "\n".join([m["content"] for m in conv.history] + list(conv.questions))


def test_deterministic_per_seed():
    sizer = TokenSizer()
    a, b = workload(7, SMALL, sizer), workload(7, SMALL, sizer)
    assert a == b
    c = workload(8, SMALL, sizer)
    assert [x.document() for x in a] != [x.document() for x in c]
    assert len({x.document() for x in a}) == len(a)  # every conversation its own history


@pytest.mark.parametrize(
    "sizer", [TokenSizer(), TokenSizer(WordTokenizer())], ids=["approx", "words"]
)
def test_token_lengths(sizer):
    for conv in workload(0, SMALL, sizer):
        measured = sum(sizer.count_each([m["content"] for m in conv.history]))
        assert measured == conv.history_tokens
        # within a sentence (~15 tokens) of a target drawn in [min, max]
        assert SMALL.history_min - 40 <= conv.history_tokens <= SMALL.history_max
        assert len(conv.questions) == SMALL.turns
        for q in conv.questions[:-1]:
            assert 0.8 * SMALL.question_tokens <= sizer.count(q) <= SMALL.question_tokens
        assert all(SMALL.output_min <= n <= SMALL.output_max for n in conv.max_tokens)
        assert len(conv.max_tokens) == SMALL.turns


def test_history_spreads_over_the_range():
    convs = workload(1, Scale(32, 2, 1000, 4000, 50, 8, 8), TokenSizer())
    lengths = [c.history_tokens for c in convs]
    assert min(lengths) < 2000 and max(lengths) > 3000


def test_recall_answer_planted_once_and_asked_last():
    for conv in workload(3, SMALL, TokenSizer()):
        text = _all_text(conv)
        assert text.count(conv.recall_answer) == 1
        assert conv.document().count(conv.recall_answer) == 1
        assert text.count(conv.recall_key) == 2  # the fact, and the last question
        assert conv.recall_key in conv.questions[-1]
        assert all(conv.recall_key not in q for q in conv.questions[:-1])
        assert answered(conv, f"It is {conv.recall_answer}.")
        assert not answered(conv, "I do not know.")


def test_history_is_a_chat():
    conv = conversation(0, 0, SMALL, TokenSizer())
    roles = [m["role"] for m in conv.history]
    assert roles[:2] == ["system", "user"] and roles[-1] == "assistant"
    assert all(
        a != b for a, b in zip(roles[1:], roles[2:], strict=False)
    )  # user and assistant alternate


def test_presets_fit_the_model_context():
    assert PRESETS["full"].conversations == 128 and PRESETS["full"].turns == 6
    assert (PRESETS["full"].history_min, PRESETS["full"].history_max) == (12_000, 24_000)
    for scale in PRESETS.values():
        assert scale.max_context() + 1024 <= 32_768  # serve_multiturn.py's context length


def test_bad_scale():
    with pytest.raises(ValueError):
        Scale(1, 1, 500, 100, 10, 1, 1)
    with pytest.raises(ValueError):
        Scale(0, 1, 100, 100, 10, 1, 1)


def test_sizer_without_model_folder_is_approximate(tmp_path):
    assert not TokenSizer.for_model(str(tmp_path)).exact
    assert not TokenSizer.for_model(None).exact
