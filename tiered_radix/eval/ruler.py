"""RULER-style synthetic tasks, regenerated locally: needles, variable tracking, word counts.

Templates follow RULER (Hsieh et al., 2024) in spirit; values are 7-digit numbers, keys are
``adjective-noun`` pairs, haystacks are RULER's repeated ``noise`` sentences or seeded ``prose``.
Every generator has the :data:`tasks.Generator` signature ``(rng, length, index, count)``.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from . import words
from .sample import DEPTHS, Sample, TokenCounter, fit, register

NIAH = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize "
    "it. I will quiz you about the numbers afterwards.\n{context}\n{question}"
)
NEEDLE = "One of the special magic numbers for {key} is: {value}."


class Filler:
    """Haystack sentences, prefix-consistent: ``take(n)`` is a prefix of ``take(n + 1)``."""

    def __init__(self, kind: str, rng: random.Random) -> None:
        self.kind, self.rng, self.sents = kind, random.Random(rng.random()), []

    def take(self, n: int) -> list[str]:
        if n > len(self.sents):
            self.sents += words.filler(self.kind, self.rng, max(n - len(self.sents), 64))
        return self.sents[:n]


def haystack(filler: Filler, inserts: list[tuple[float, str]]) -> Callable[[int], str]:
    """``build(n)``: ``n`` filler sentences with each ``(depth, text)`` at sentence ``depth*n``."""

    def build(n: int) -> str:
        sents = filler.take(n)
        for depth, text in sorted(inserts, key=lambda t: -t[0]):
            sents.insert(round(depth * n), text)
        return " ".join(sents)

    return build


def _niah(
    rng: random.Random,
    length: int,
    index: int,
    count: TokenCounter,
    *,
    task: str,
    kind: str,
    needles: list[tuple[str, str]],
    depths: list[float],
    question: str,
    answers: list[str],
    max_new_tokens: int,
) -> Sample:
    build = haystack(
        Filler(kind, rng),
        [(d, NEEDLE.format(key=k, value=v)) for d, (k, v) in zip(depths, needles, strict=True)],
    )
    text, n = fit(lambda n: NIAH.format(context=build(n), question=question), length, count)
    meta = {
        "haystack": kind,
        "depths": depths,
        "depth": depths[0],
        "sentences": n,
        "tokens": count(text),
        "keys": [k for k, _ in needles],
    }
    return Sample(task, length, index, (text,), tuple(answers), "all", max_new_tokens, meta)


def _ask(key: str) -> str:
    return (
        f"What is the special magic number for {key} mentioned in the provided text? "
        "Answer with the number only."
    )


@register("niah_single")
def niah_single(rng: random.Random, length: int, index: int, count: TokenCounter) -> Sample:
    (key,), (value,), depth = words.keys(rng, 1), words.numbers(rng, 1), rng.random()
    return _niah(
        rng,
        length,
        index,
        count,
        task="niah_single",
        kind="noise",
        needles=[(key, value)],
        depths=[depth],
        question=_ask(key),
        answers=[value],
        max_new_tokens=32,
    )


@register("needle")
def needle(rng: random.Random, length: int, index: int, count: TokenCounter) -> Sample:
    (key,), (value,) = words.keys(rng, 1), words.numbers(rng, 1)
    depth = DEPTHS[index % len(DEPTHS)]
    return _niah(
        rng,
        length,
        index,
        count,
        task="needle",
        kind="prose",
        needles=[(key, value)],
        depths=[depth],
        question=_ask(key),
        answers=[value],
        max_new_tokens=32,
    )


@register("niah_multikey")
def niah_multikey(rng: random.Random, length: int, index: int, count: TokenCounter) -> Sample:
    ks, vs = words.keys(rng, 4), words.numbers(rng, 4)
    depths = [rng.random() for _ in ks]
    return _niah(
        rng,
        length,
        index,
        count,
        task="niah_multikey",
        kind="prose",
        needles=list(zip(ks, vs, strict=True)),
        depths=depths,
        question=_ask(ks[0]),
        answers=[vs[0]],
        max_new_tokens=32,
    )


@register("niah_multivalue")
def niah_multivalue(rng: random.Random, length: int, index: int, count: TokenCounter) -> Sample:
    (key,), vs = words.keys(rng, 1), words.numbers(rng, 4)
    question = (
        f"What are all the special magic numbers for {key} mentioned in the provided "
        "text? Answer with the numbers only."
    )
    return _niah(
        rng,
        length,
        index,
        count,
        task="niah_multivalue",
        kind="prose",
        needles=[(key, v) for v in vs],
        depths=[rng.random() for _ in vs],
        question=question,
        answers=vs,
        max_new_tokens=64,
    )


@register("niah_multiquery")
def niah_multiquery(rng: random.Random, length: int, index: int, count: TokenCounter) -> Sample:
    ks, vs = words.keys(rng, 4), words.numbers(rng, 4)
    question = (
        f"What are all the special magic numbers for {', '.join(ks[:-1])} and {ks[-1]} "
        "mentioned in the provided text? Answer with the numbers only."
    )
    return _niah(
        rng,
        length,
        index,
        count,
        task="niah_multiquery",
        kind="prose",
        needles=list(zip(ks, vs, strict=True)),
        depths=[rng.random() for _ in ks],
        question=question,
        answers=vs,
        max_new_tokens=64,
    )


@register("vt")
def variable_tracking(rng: random.Random, length: int, index: int, count: TokenCounter) -> Sample:
    names = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)) for _ in range(5)]
    (value,) = words.numbers(rng, 1, digits=5)
    chain = [f"VAR {names[0]} = {value}."] + [
        f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:], strict=False)
    ]
    depths = sorted(rng.random() for _ in chain)
    build = haystack(Filler("noise", rng), list(zip(depths, chain, strict=True)))
    template = (
        "Memorize and track the chain of variable assignments hidden in the following "
        "text.\n\n{context}\nQuestion: Find all variables that are assigned the value "
        f"{value} in the text above. Answer with the variable names only."
    )
    text, n = fit(lambda n: template.format(context=build(n)), length, count)
    meta = {"haystack": "noise", "depths": depths, "sentences": n, "tokens": count(text)}
    return Sample("vt", length, index, (text,), tuple(names), "all", 48, meta)
