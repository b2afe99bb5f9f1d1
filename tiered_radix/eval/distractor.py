"""Near-duplicate distractors: facts of one kind about look-alike projects, one question at the end.

Each sample picks one attribute (the lead engineer, the budget or the project code) and 3 to 6
projects whose names differ from each other in one syllable (``Kadelo``, ``Kadilo``,
``Kudelo``); each project gets a fact stating that attribute, with values that are near
duplicates too (names differing in one syllable of the surname, numbers or codes in one
digit). The facts sit at random depths in prose; the question at the end names one project.
A policy that keeps "a fact about a project" is not enough: it must keep the fact about *that*
project, which only the question's own tokens identify.

Values have one length per sample and differ from each other, so no value contains another and
RULER's string match credits only the asked-for one.
"""

from __future__ import annotations

import random

from . import words
from .ruler import Filler, haystack
from .sample import Sample, TokenCounter, fit, register

KINDS = ("lead", "budget", "code")
_FACT = {
    "lead": "The lead engineer of project {project} is {value}.",
    "budget": "The approved budget of project {project} is {value} dollars.",
    "code": "The internal code of project {project} is {value}.",
}
_QUESTION = {
    "lead": "Who is the lead engineer of project {project}? Answer with the full name only.",
    "budget": "What is the approved budget of project {project}? Answer with the number only.",
    "code": "What is the internal code of project {project}? Answer with the code only.",
}
_FIRST = ("Anna", "Marta", "Jonas", "Pavel", "Ines", "Tomas", "Lena", "Oskar")
_SURNAME_SYLLABLES = "ber der ker ler mer ner ser ter".split()
_LETTERS = "ABCDEFGHJKLMNPRSTUVWXYZ"
TEMPLATE = (
    "Below are notes from a company's project reviews. Several projects have similar names; "
    "read carefully.\n{context}\n{question}"
)


def _variants(rng: random.Random, n: int, base: list[str], alphabet: list[str]) -> list[list[str]]:
    """``n`` distinct near-duplicates of ``base`` (a list of symbols): each differs from
    ``base`` in at most one position, so any two differ in at most two."""
    out = [list(base)]
    while len(out) < n:
        v = list(base)
        v[rng.randrange(len(v))] = rng.choice(alphabet)
        if v not in out:
            out.append(v)
    rng.shuffle(out)
    return out


def projects(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct capitalised three-syllable names, pairwise near-duplicates."""
    syl = words._SYLLABLES
    base = [rng.choice(syl) for _ in range(3)]
    return ["".join(v).capitalize() for v in _variants(rng, n, base, syl)]


def values(rng: random.Random, kind: str, n: int) -> list[str]:
    """``n`` distinct values of ``kind``, one length, pairwise near-duplicates."""
    if kind == "lead":
        first = rng.choice(_FIRST)
        base = [rng.choice(_SURNAME_SYLLABLES) for _ in range(3)]
        return [
            f"{first} {''.join(v).capitalize()}"
            for v in _variants(rng, n, base, _SURNAME_SYLLABLES)
        ]
    if kind == "budget":
        lead, rest = str(rng.randrange(1, 10)), list(str(rng.randrange(100_000, 1_000_000)))
        return [lead + "".join(v) for v in _variants(rng, n, rest, list("0123456789"))]
    letters = [rng.choice(_LETTERS) for _ in range(2)]
    base = [*letters, "-", *str(rng.randrange(1000, 10000))]
    out = _variants(rng, n, base[3:], list("0123456789"))
    return ["".join(letters) + "-" + "".join(v) for v in out]


@register("distractor")
def distractor(rng: random.Random, length: int, index: int, count: TokenCounter) -> Sample:
    kind = KINDS[index % len(KINDS)]
    n = rng.randint(3, 6)
    names = projects(rng, n)
    vals = values(rng, kind, n)
    asked = rng.randrange(n)
    depths = [rng.random() for _ in range(n)]
    facts = [_FACT[kind].format(project=p, value=v) for p, v in zip(names, vals, strict=True)]
    build = haystack(Filler("prose", rng), list(zip(depths, facts, strict=True)))
    question = _QUESTION[kind].format(project=names[asked])
    text, sentences = fit(
        lambda k: TEMPLATE.format(context=build(k), question=question), length, count
    )
    meta = {
        "haystack": "prose",
        "kind": kind,
        "depths": depths,
        "depth": depths[asked],
        "sentences": sentences,
        "tokens": count(text),
        "keys": [names[asked]],
        "distractors": [v for i, v in enumerate(vals) if i != asked],
    }
    return Sample("distractor", length, index, (text,), (vals[asked],), "all", 32, meta)
