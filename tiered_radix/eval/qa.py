"""Question answering over many documents, RULER's QA family generated instead of downloaded.

RULER builds its QA tasks from SQuAD (one document answers) and HotpotQA (two documents answer
together), the rest of the context being other datasets' documents. Here every document is a
short article about a made-up town: its river, founding year, mayor, trade and twin town, amid
a few sentences of prose. The context is as many such articles as the length holds; the
question is at the end. Two kinds, alternating with the sample index:

- ``lookup`` (SQuAD-like): "Which river flows through the town whose mayor is X?". The question
  names a value inside one article; the answer is another sentence of that article.
- ``bridge`` (HotpotQA-like): "Which river flows through the twin town of A?". Article A names
  its twin town B; the answer is in article B, which the question does not name: a cache that
  keeps only what the question's tokens point at loses it.

Towns, rivers and people are distinct pronounceable names within a sample; no answer is a
substring of another river's name, so RULER's string match credits only the asked-for one.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from .ruler import Filler
from .sample import Sample, TokenCounter, fit, register

KINDS = ("lookup", "bridge")
_SYLLABLES = "ra re ri ro tal tel tor val ven vor sen sol mar mir nel nor kas kel bran dun".split()
_FIRST = ("Agnes", "Bruno", "Clara", "Dario", "Edith", "Felix", "Greta", "Hugo", "Ilse", "Jonas")
_TRADES = (
    "salt works", "glass furnaces", "wool market", "shipyards", "paper mills", "vineyards",
    "copper mines", "clock makers", "cheese cellars", "rope walks",
)  # fmt: skip
TEMPLATE = (
    "Below are articles about towns. Answer the question using the articles.\n\n"
    "{documents}\n\nQuestion: {question}"
)
_QUESTION = {
    "lookup": "Which river flows through the town whose mayor is {mayor}? Answer with the "
    "river's name only.",
    "bridge": "Which river flows through the twin town of {town}? Answer with the river's "
    "name only.",
}


@dataclass(frozen=True)
class Town:
    name: str
    river: str
    founded: int
    mayor: str
    trade: str
    twin: str

    def article(self, index: int, prose: list[str]) -> str:
        facts = [
            f"{self.name} is a town on the river {self.river}.",
            f"It was founded in {self.founded}.",
            f"Its mayor is {self.mayor}.",
            f"The town is known for its {self.trade}.",
            f"Its twin town is {self.twin}.",
        ]
        body = facts[:2] + prose[:1] + facts[2:4] + prose[1:] + facts[4:]
        return f"Document {index}: {self.name}\n" + " ".join(body)


class _Names:
    """Distinct capitalised names of two or three syllables, none a substring of another."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.used = rng, []

    def __call__(self) -> str:
        while True:
            n = self.rng.choice((2, 3))
            w = "".join(self.rng.choice(_SYLLABLES) for _ in range(n))
            if all(w not in u and u not in w for u in self.used):  # lower case: the match is
                self.used.append(w)  # case-blind
                return w.capitalize()


def _town(rng: random.Random, names: _Names, twin: str | None = None) -> Town:
    mayor = f"{rng.choice(_FIRST)} {names()}"
    return Town(names(), names(), rng.randrange(1100, 1900), mayor, rng.choice(_TRADES),
                twin or names())  # fmt: skip


@register("qa")
def qa(rng: random.Random, length: int, index: int, count: TokenCounter) -> Sample:
    kind = KINDS[index % len(KINDS)]
    names = _Names(random.Random(rng.random()))
    asked = _town(rng, names)
    towns = [asked]
    if kind == "bridge":  # the asked town's article names its twin; the twin's holds the answer
        twin = _town(rng, names)
        asked = dataclasses.replace(asked, twin=twin.name)
        towns = [asked, twin]
    depths = [rng.random() for _ in towns]
    others: list[Town] = []  # the other articles, the same for every size (prefix-consistent)
    other_rng, prose = random.Random(rng.random()), Filler("prose", rng)

    def build(n: int) -> str:
        while len(others) < n:
            others.append(_town(other_rng, names))
        docs = list(others[:n])
        for depth, t in sorted(zip(depths, towns, strict=True), key=lambda x: -x[0]):
            docs.insert(round(depth * n), t)
        sents = prose.take(2 * len(docs))
        text = "\n\n".join(t.article(i + 1, sents[2 * i : 2 * i + 2]) for i, t in enumerate(docs))
        question = _QUESTION[kind].format(mayor=asked.mayor, town=asked.name)
        return TEMPLATE.format(documents=text, question=question)

    text, n_docs = fit(build, length, count)
    answer = towns[-1].river
    rivers = [t.river for t in others[:n_docs] + towns]
    meta = {
        "haystack": "articles",
        "kind": kind,
        "depths": depths,
        "depth": depths[-1],
        "documents": n_docs + len(towns),
        "tokens": count(text),
        "keys": [asked.mayor if kind == "lookup" else asked.name],
        "distractors": [r for r in rivers if r != answer],
    }
    return Sample("qa", length, index, (text,), (answer,), "all", 32, meta)
