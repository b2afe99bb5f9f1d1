"""Property tests: whatever text a user writes, compiling it raises nothing but PolicyError.

Inputs are random text and mutations of the shipped policy files (characters deleted, duplicated
or replaced, lines swapped, numbers changed, keys renamed or added). Every PolicyError that names
a position must name a line of the text (or the line just past its end).

The bugs fuzzing found (and that are now fixed) are kept as regression inputs at the bottom.
The random text includes control characters, which YAML refuses to read (``PRINTABLE`` is a
historical name: it covers every character but lone surrogates, with controls drawn often).
"""

from __future__ import annotations

import re
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiered_radix import PolicyError, compile_text
from tiered_radix.policy.compiler import TOP_KEYS
from tiered_radix.resources import policies_dir

SHIPPED = sorted(policies_dir().glob("*.yaml"))
TEXTS = [p.read_text(encoding="utf-8") for p in SHIPPED]
# Any character but lone surrogates (which no UTF-8 file can hold); controls, DEL, C1 and BOMs
# drawn often on purpose: YAML refuses most of them, and that must be a PolicyError too.
CONTROLS = "\x00\x07\x08\x0b\x0c\x1b\x7f\x85\x9f\u2028\ufeff\ufffe"
PRINTABLE = st.characters(blacklist_categories=("Cs",)) | st.sampled_from(CONTROLS)
VOCAB = [
    "attn",
    "colmass",
    "qnorm",
    "knorm",
    "sigma",
    "cumulative",
    "window(size=32)",
    "token",
    "channel",
    "keep(bf16)",
    "quantize(bits=2)",
    "evict",
    "rank",
    "rate_distortion",
    "{",
    "}",
    "[",
    "]",
    ":",
    ",",
    "%",
    "(",
    ")",
    "*",
    "-",
    " ",
    "\n",
    "  ",
    "write_once",
    "extends",
]
FUZZ = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def check(text: str) -> None:
    """Compile ``text``; only PolicyError may escape, and its line must lie in the text."""
    try:
        compile_text(text, "fuzz.yaml")
    except PolicyError as e:
        if e.span is not None:
            assert e.span.file == "fuzz.yaml"
            assert 1 <= e.span.line <= len(text.splitlines()) + 1, (e.span, text)
            assert e.span.col >= 1, (e.span, text)
        assert str(e)  # rendering never fails


@FUZZ
@given(st.text(PRINTABLE, max_size=300))
def test_random_text(text: str) -> None:
    check(text)


@FUZZ
@given(st.lists(st.sampled_from(VOCAB + list(TOP_KEYS)), max_size=60))
def test_random_tokens(words: list[str]) -> None:
    check("".join(words))


@st.composite
def mutated(draw) -> str:
    text = draw(st.sampled_from(TEXTS))
    for _ in range(draw(st.integers(1, 4))):
        text = draw(st.sampled_from(MUTATIONS))(draw, text)
    return text


def _delete(draw, text: str) -> str:
    i = draw(st.integers(0, max(len(text) - 1, 0)))
    return text[:i] + text[i + draw(st.integers(1, 8)) :]


def _duplicate(draw, text: str) -> str:
    i = draw(st.integers(0, len(text)))
    j = min(len(text), i + draw(st.integers(1, 40)))
    return text[:j] + text[i:j] + text[j:]


def _replace(draw, text: str) -> str:
    i = draw(st.integers(0, max(len(text) - 1, 0)))
    return text[:i] + draw(st.sampled_from(string.printable[:-2] + "é²∞")) + text[i + 1 :]


def _swap_lines(draw, text: str) -> str:
    lines = text.splitlines(keepends=True)
    i, j = (draw(st.integers(0, len(lines) - 1)) for _ in range(2))
    lines[i], lines[j] = lines[j], lines[i]
    return "".join(lines)


def _change_number(draw, text: str) -> str:
    numbers = list(re.finditer(r"\d+(\.\d+)?", text))
    if not numbers:
        return text
    m = draw(st.sampled_from(numbers))
    new = draw(
        st.sampled_from(
            [
                "0",
                "1",
                "-1",
                "3",
                "100",
                "101",
                "0.5",
                "1e9",
                "99999999999",
                "007",
                "2.",
                ".5",
                "-0",
            ]
        )
    )
    return text[: m.start()] + new + text[m.end() :]


def _random_key(draw, text: str) -> str:
    lines = text.splitlines(keepends=True)
    i = draw(st.integers(0, len(lines)))
    indent = draw(st.sampled_from(["", "  ", "    "]))
    key = draw(
        st.sampled_from(
            [
                *TOP_KEYS,
                "k",
                "v",
                "by",
                "bits",
                "shares",
                "when",
                "then",
                "method",
                "sinks",
                "recent",
                "full",
                "budgte",
                "v_weight",
            ]
        )
    )
    value = draw(st.sampled_from(VOCAB + ["", "10%", "[1, 2]", "{a: 1}", "qevict", "- x"]))
    return "".join(lines[:i] + [f"{indent}{key}: {value}\n"] + lines[i:])


MUTATIONS = [_delete, _duplicate, _replace, _swap_lines, _change_number, _random_key]


@FUZZ
@given(mutated())
def test_mutated_shipped_policies(text: str) -> None:
    check(text)


def test_mutations_reach_the_compiler() -> None:
    """Guard against a fuzzer that only ever feeds YAML syntax errors: mutants fail late too."""
    late = 0
    for i in range(40):
        text = TEXTS[i % len(TEXTS)]
        line = text.splitlines()[-1]
        try:
            compile_text(text.replace(line, line + "x"), "fuzz.yaml")
        except PolicyError as e:
            late += "YAML" not in e.message
    assert late >= 20


# ---- bugs fuzzing found, since fixed: each input once raised something other than PolicyError --

BASE = (
    "budget: 10%\nunits: token\ntiers:\n  full: keep(bf16)\n  evicted: evict\n"
    "allocate:\n  method: rank\n  by: position\n"
)
KNOWN_BUGS = {
    # 1. yaml.reader.ReaderError is a YAMLError but not a MarkedYAMLError: it escaped.
    "control_character": (BASE + "description: a\x07b\n", "character U+0007 is not allowed"),
    # 2. Compiler.integer: str.isdigit accepts '²' and lstrip drops every '-'; int() then failed.
    "superscript_integer": (BASE + "protect:\n  sinks: ²\n", "must be an integer >= 0"),
    "double_minus_integer": (BASE + "protect:\n  sinks: --5\n", "must be an integer >= 0"),
    # 3. The transformer's not_ and proportional left a bare int in the tree: .walk() failed.
    "not_number": (BASE + "rules:\n  - when: not 1\n    then: promote\n", None),
    "proportional_number": (BASE + "spread: proportional(2)\n", None),
    # 4. int() refuses more than 4300 digits: ValueError inside the transformer (VisitError),
    #    wherever the grammar has a number or an INT.
    "huge_integer": (BASE.replace("10%", "9" * 5000 + " B"), "is too long"),
    "huge_window": (BASE.replace("token", "window(size=" + "9" * 5000 + ")"), "is too long"),
    "huge_every": (BASE + "schedule: every(" + "9" * 5000 + ")\n", "is too long"),
    # 5. A too-long `extends` name: Path.is_file raised OSError(ENAMETOOLONG).
    "long_extends_name": ("extends: " + "a" * 300 + "\n" + BASE, "no policy file"),
    # 6. Deeply nested YAML: the recursive composer/_convert hit RecursionError.
    "deep_yaml": (BASE + "description: " + "[" * 600 + "]" * 600 + "\n", "nests too deeply"),
}


@pytest.mark.parametrize("name", list(KNOWN_BUGS))
def test_known_bug(name: str) -> None:
    text, message = KNOWN_BUGS[name]
    try:
        check(text)
        compile_text(text, "fuzz.yaml")
    except PolicyError as e:
        assert message is not None and message in e.message, e.message
    except Exception as e:  # a short report: formatting a RecursionError's traceback takes seconds
        pytest.fail(f"{type(e).__name__}: {str(e)[:200]}", pytrace=False)
    else:
        assert message is None, f"compiled, but should raise '{message}'"
