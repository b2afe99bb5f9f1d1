"""Task generators: determinism, sizes, needle placement, and answers checked by recounting."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from tiered_radix.eval.ruler import NEEDLE
from tiered_radix.eval.tasks import (
    DEPTHS,
    WINDOW_RESERVE,
    TaskError,
    expand_tasks,
    fit,
    make_sample,
    make_samples,
    task_names,
)

_WORD = re.compile(r"\w+|[^\w\s]")


def count(text: str) -> int:
    """A regex tokenizer standing in for the model's (independent of transformers)."""
    return len(_WORD.findall(text))


ALL = task_names()


def test_registry_and_groups():
    assert set(ALL) == {
        "niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe",
        "needle", "multiturn", "distractor", "qa",
    }  # fmt: skip
    assert expand_tasks("ruler,needle,vt") == expand_tasks("ruler") + ["needle"]
    assert expand_tasks("suite") == expand_tasks("ruler") + ["distractor", "multiturn", "qa"]
    with pytest.raises(TaskError, match="Did you mean 'niah_single'"):
        expand_tasks("niah_singel")


@pytest.mark.parametrize("task", ALL)
def test_deterministic_from_seed(task):
    a = make_samples(task, 600, 2, count, seed=3)
    assert a == make_samples(task, 600, 2, count, seed=3)
    b = make_samples(task, 600, 2, count, seed=4)
    assert [s.turns for s in a] != [s.turns for s in b]
    assert a[0].turns != a[1].turns  # samples differ from each other


@pytest.mark.parametrize("task", ["niah_multikey", "distractor", "multiturn", "cwe", "qa"])
def test_window_trims_the_sized_turn_and_keeps_the_draws(task):
    """A 1,500-token cell on a 1,024-token model: the sized turn leaves WINDOW_RESERVE free,
    the label and the drawn facts stay those of the 1,500-token sample (run 15 lost its 32K
    cells: 32,790-token prompts on Qwen2.5's 32,768-token window)."""
    window = 1024
    s = make_sample(task, 1500, 0, count, window=window)
    full = make_sample(task, 1500, 0, count)
    assert s.length == 1500 and s.key == full.key
    assert s.answers == full.answers
    assert count(s.turns[0]) <= window - WINDOW_RESERVE < count(full.turns[0])
    assert make_sample(task, 600, 0, count, window=window) == make_sample(task, 600, 0, count)


@pytest.mark.parametrize("task", ALL)
@pytest.mark.parametrize("length", [500, 1500])
def test_length_within_tolerance(task, length):
    s = make_sample(task, length, 0, count)
    n = count(s.turns[0])
    assert n == s.meta["tokens"]
    assert length * 0.95 <= n <= length, (task, n)


def test_length_with_model_tokenizer():
    transformers = pytest.importorskip("transformers")
    from tiered_radix.models import model_dir

    folder = model_dir("smollm2-135m")
    if not (folder / "tokenizer.json").is_file():
        pytest.skip("smollm2-135m not fetched (tiered-radix model fetch smollm2-135m)")
    tok = transformers.AutoTokenizer.from_pretrained(folder)

    def real(t: str) -> int:
        return len(tok.encode(t, add_special_tokens=False))

    for task in ALL:
        s = make_sample(task, 1024, 0, real)
        assert 1024 * 0.95 <= real(s.turns[0]) <= 1024, task


def _context_fraction(text: str, needle: str) -> float:
    start = text.index("\n") + 1
    end = text.rindex("\n")
    pos = text.index(needle, start)
    return count(text[start:pos]) / count(text[start:end])


@pytest.mark.parametrize("task", ["niah_single", "niah_multikey", "niah_multivalue",
                                  "niah_multiquery", "needle"])  # fmt: skip
def test_needles_present_at_stated_depth(task):
    for s in make_samples(task, 1200, 3, count, seed=1):
        text = s.turns[0]
        values = re.findall(r"special magic numbers for ([\w-]+) is: (\d+)\.", text)
        assert len(values) == len(s.meta["depths"])
        pairs: dict[str, list[str]] = {}
        for key, value in values:
            pairs.setdefault(key, []).append(value)
            assert text.count(NEEDLE.format(key=key, value=value)) == 1
        assert sorted(pairs) == sorted(set(s.meta["keys"]))
        needles = [NEEDLE.format(key=k, value=v) for k, v in values]
        # each stated depth has a needle within 5% of the haystack
        fractions = [_context_fraction(text, n) for n in needles]
        for depth in s.meta["depths"]:
            assert min(abs(f - depth) for f in fractions) < 0.05, (depth, fractions)
        # answers: the asked key's value(s), every one present in the haystack
        question = text[text.rindex("\n") :]
        asked = [k for k in pairs if k in question]
        assert sorted(s.answers) == sorted(v for k in asked for v in pairs[k])


def test_needle_sweep_depths():
    samples = make_samples("needle", 800, 2, count)
    assert [s.meta["depth"] for s in samples] == list(DEPTHS) * 2
    first = samples[0].turns[0]
    assert first[first.index("\n") + 1 :].startswith("One of the special magic numbers")


def test_multikey_answer_is_the_asked_key_only():
    s = make_sample("niah_multikey", 1000, 0, count)
    asked = s.meta["keys"][0]
    assert f"for {asked} mentioned" in s.turns[0]
    assert NEEDLE.format(key=asked, value=s.answers[0]) in s.turns[0]
    assert all(f"for {k} mentioned" not in s.turns[0] for k in s.meta["keys"][1:])


def test_distractor_facts_are_near_duplicates_and_only_the_asked_one_scores():
    kinds = set()
    for s in make_samples("distractor", 1200, 6, count, seed=5):
        text, kind = s.turns[0], s.meta["kind"]
        kinds.add(kind)
        facts = re.findall(_DISTRACTOR_FACT[kind], text)
        assert 3 <= len(facts) <= 6 and len(facts) == len(s.meta["depths"])
        projects, vals = [p for p, _ in facts], [v for _, v in facts]
        assert len(set(projects)) == len(projects) and len(set(vals)) == len(vals)
        # near duplicates: one length each, every pair differing in at most two symbols
        for group in (projects, vals):
            assert len({len(x) for x in group}) == 1
            for a in group:
                for b in group:
                    assert sum(x != y for x, y in zip(a, b, strict=True)) <= 2 * 3
        # the question at the end names one project; the answer is its value, no other
        question = text[text.rindex("\n") :]
        asked = [p for p in projects if f"project {p}?" in question]
        assert asked == s.meta["keys"]
        assert s.answers == (vals[projects.index(asked[0])],)
        assert sorted(s.meta["distractors"]) == sorted(v for v in vals if v != s.answers[0])
        assert all(s.answers[0] not in d and d not in s.answers[0] for d in s.meta["distractors"])
        assert not any(v in question for v in vals)
    assert kinds == {"lead", "budget", "code"}


_ARTICLE = re.compile(
    r"Document (\d+): (\w+)\n\2 is a town on the river (\w+)\. .*?Its mayor is (\w+ \w+)\. "
    r".*?Its twin town is (\w+)\."
)


def test_qa_answers_from_one_article_or_two():
    """lookup: the article of the mayor the question names holds the answer; bridge: the
    asked town's article names its twin, whose article holds the answer, and the question
    names neither the twin nor the answer. Every name differs from every other (case-blind)."""
    kinds = set()
    for s in make_samples("qa", 1500, 6, count, seed=2):
        text, kind = s.turns[0], s.meta["kind"]
        kinds.add(kind)
        body, question = text[: text.rindex("Question:")], text[text.rindex("Question:") :]
        docs = _ARTICLE.findall(body)
        assert len(docs) == s.meta["documents"] >= 5
        assert [int(d[0]) for d in docs] == list(range(1, len(docs) + 1))
        town = {name: (river, mayor, twin) for _, name, river, mayor, twin in docs}
        assert len(town) == len(docs)
        rivers = [r for r, _, _ in town.values()]
        surnames = [m.split()[1] for _, m, _ in town.values()]
        lowered = [x.lower() for x in [*town, *rivers, *surnames]]
        assert all(a == b or (a not in b and b not in a) for a in lowered for b in lowered)
        if kind == "lookup":
            (mayor,) = s.meta["keys"]
            assert f"mayor is {mayor}?" in question
            (name,) = [n for n, (_, m, _) in town.items() if m == mayor]
            assert s.answers == (town[name][0],)
        else:
            (asked,) = s.meta["keys"]
            assert f"twin town of {asked}?" in question
            twin = town[asked][2]
            assert twin in town and twin not in question
            assert s.answers == (town[twin][0],)
        assert sorted(s.meta["distractors"]) == sorted(r for r in rivers if r != s.answers[0])
        assert s.answers[0] not in question and body.count(f"river {s.answers[0]}.") == 1
    assert kinds == {"lookup", "bridge"}


_DISTRACTOR_FACT = {
    "lead": r"lead engineer of project (\w+) is (\w+ \w+)\.",
    "budget": r"approved budget of project (\w+) is (\d+) dollars\.",
    "code": r"internal code of project (\w+) is ([A-Z]{2}-\d{4})\.",
}


def test_variable_tracking_chain():
    s = make_sample("vt", 1000, 0, count)
    text = s.turns[0]
    value = re.search(r"assigned the value (\d+)", text).group(1)
    assigns = re.findall(r"VAR (\w+) = (VAR (\w+)|\d+)\.", text)
    resolved = {}
    for name, rhs, ref in assigns:  # follow the chain in text order
        resolved[name] = resolved[ref] if ref else rhs
    assert sorted(n for n, v in resolved.items() if v == value) == sorted(s.answers)
    assert len(s.answers) == 5


def test_common_words_by_recount():
    s = make_sample("cwe", 1000, 0, count)
    listing = s.turns[0].split("\n")[1]
    items = re.findall(r"\d+\. (\w+)", listing)
    assert [int(i) for i in re.findall(r"(\d+)\. ", listing)] == list(range(1, len(items) + 1))
    counts = Counter(items)
    top = [w for w, _ in counts.most_common(10)]
    assert sorted(top) == sorted(s.answers)
    assert min(counts[w] for w in s.answers) > max(
        c for w, c in counts.items() if w not in s.answers
    )


@pytest.mark.parametrize("length", [500, 2000])
def test_frequent_words_by_recount(length):
    s = make_sample("fwe", length, 0, count)
    coded = s.turns[0].split("\n")[1]
    counts = Counter(w for w in coded.split(" ") if w != "....")
    ranked = counts.most_common()
    assert [w for w, _ in ranked[:3]] == list(s.answers)
    assert ranked[0][1] > ranked[1][1] > ranked[2][1] > ranked[3][1]


def test_multiturn_fact_in_first_turn_only():
    s = make_sample("multiturn", 800, 0, count)
    assert len(s.turns) == 3
    (value,) = s.answers
    (key,) = s.meta["keys"]
    assert NEEDLE.format(key=key, value=value) in s.turns[0]
    assert key in s.turns[-1] and value not in s.turns[1] + s.turns[2]


def test_too_short_target_is_a_typed_error():
    with pytest.raises(TaskError, match="too short"):
        make_sample("niah_single", 20, 0, count)
    with pytest.raises(TaskError):
        fit(lambda n: "x " * (100 + n), 50, count)
