"""The conversations of the serving benchmark: long private histories, short new questions.

Every conversation is a pure function of ``(seed, index, scale)``: a ``random.Random`` seeded
with that tuple as a string draws its document, its chat so far, its questions and its output
lengths, so every system gets the same user messages. A conversation's history is a system
prompt, a first user message carrying a document of seeded prose (``words.filler("prose")``)
with one planted fact (``One of the special magic numbers for KEY is: VALUE.``, once, at a
seeded depth), the model's canned acknowledgement and ``PRIOR_EXCHANGES`` short canned
exchanges: ``history_tokens`` in all (measured on the message texts, without the chat
template's few tokens per message). Then come ``turns`` new questions of ~``question_tokens``;
the last one asks for the planted fact (:attr:`Conversation.recall_answer` is its value).

Token counts come from a :class:`TokenSizer`: the model's tokenizer (``transformers``'
``AutoTokenizer`` on the model folder) or, without one (CPU tests), ~4 characters a token.
Documents are sized a sentence at a time from per-sentence counts (a space-led sentence
tokenizes on its own as it does inside the text), so sizing 128 conversations of 24K tokens
takes one batched tokenizer call per conversation.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tiered_radix.eval import words

SYSTEM = "You are a helpful assistant. Answer questions about the user's documents."
DOCUMENT = (
    "Here is a document for our conversation. Read it carefully; I will ask you questions "
    "about it later.\n\n{context}\n\nFor now, reply with OK."
)
FACT = "One of the special magic numbers for {key} is: {value}."
ACK = "OK. I have read the document and I am ready for your questions."
PRIOR_EXCHANGES = (
    ("Which places does the document mention most often?",
     "It mentions gardens, harbours, libraries, kitchens, railway stations, markets and schools "
     "many times, each with a different object and what happened to it."),
    ("Is the document written as a story or as a list of facts?",
     "It reads as a long list of short factual sentences, one event per sentence, with no "
     "story connecting them."),
)  # fmt: skip
QUESTION = (
    "Here is a note from my colleague: {context} Keeping the document in mind, what does it "
    "say about the {adjective} {noun}? Answer in a few sentences."
)
RECALL = (
    "What is the special magic number for {key} mentioned in the document from my first "
    "message? Answer with the number only."
)


@dataclass(frozen=True)
class Scale:
    """The workload's size: conversations, turns each, history and output lengths (tokens)."""

    conversations: int
    turns: int
    history_min: int
    history_max: int
    question_tokens: int
    output_min: int
    output_max: int

    def __post_init__(self) -> None:
        if self.conversations < 1 or self.turns < 1:
            raise ValueError(f"need at least one conversation and one turn: {self}")
        if not 0 < self.history_min <= self.history_max:
            raise ValueError(f"history lengths must satisfy 0 < min <= max: {self}")
        if not 0 < self.output_min <= self.output_max:
            raise ValueError(f"output lengths must satisfy 0 < min <= max: {self}")

    def max_context(self) -> int:
        """Tokens a conversation reaches at its last answer (without template tokens)."""
        return self.history_max + self.turns * (self.question_tokens + self.output_max)


PRESETS = {
    # issue 20: 128 conversations of 6 turns, 12K-24K tokens of history, 128-256 new tokens
    "full": Scale(128, 6, 12_000, 24_000, 100, 128, 256),
    # ~8 H200-minutes for all six systems with their server starts (bench/README.md)
    "quick": Scale(16, 3, 2_000, 4_000, 100, 32, 64),
}


class TokenSizer:
    """Counts tokens: a Hugging Face tokenizer's, or ~4 characters a token without one."""

    def __init__(self, tokenizer=None) -> None:
        self._tok = tokenizer

    @classmethod
    def for_model(cls, model: str | None) -> TokenSizer:
        """The tokenizer at folder ``model`` if it has one and transformers imports, else the
        approximate sizer (the benchmark records which one it used)."""
        if model and Path(model, "tokenizer_config.json").exists():
            try:
                from transformers import AutoTokenizer

                return cls(AutoTokenizer.from_pretrained(model))
            except (ImportError, OSError, ValueError):
                pass
        return cls()

    @property
    def exact(self) -> bool:
        return self._tok is not None

    def count(self, text: str) -> int:
        return self.count_each([text])[0]

    def count_each(self, texts: Sequence[str]) -> list[int]:
        if not texts:
            return []
        if self._tok is None:
            return [max(1, round(len(t) / 4)) for t in texts]
        ids = self._tok(list(texts), add_special_tokens=False)["input_ids"]
        return [len(x) for x in ids]


@dataclass(frozen=True)
class Conversation:
    """One conversation: its history (chat messages), new questions and output lengths.

    ``questions[t]`` is turn ``t``'s user message; ``max_tokens[t]`` its output length;
    ``questions[-1]`` asks for the planted fact, whose value is ``recall_answer``.
    """

    index: int
    history: tuple[dict, ...]
    questions: tuple[str, ...]
    max_tokens: tuple[int, ...]
    recall_key: str
    recall_answer: str
    history_tokens: int

    def document(self) -> str:
        return self.history[1]["content"]


def _sentences(rng: random.Random, sizer: TokenSizer, want: int) -> list[str]:
    """Seeded prose sentences of ~``want`` tokens in all (joined by spaces)."""
    sents: list[str] = []
    total = 0
    while total < want:
        batch = words.filler("prose", rng, max(16, (want - total) // 12 + 1))
        for s, n in zip(batch, sizer.count_each([" " + s for s in batch]), strict=True):
            if total + n > want:
                return sents
            sents.append(s)
            total += n
    return sents


def conversation(seed: int, index: int, scale: Scale, sizer: TokenSizer) -> Conversation:
    """Conversation ``index`` of the workload seeded ``seed`` (see the module docstring)."""
    rng = random.Random(f"serve-multiturn/{seed}/{index}")
    (key,), (value,) = words.keys(rng, 1), words.numbers(rng, 1)
    target = rng.randint(scale.history_min, scale.history_max)
    chat: list[dict] = [{"role": "assistant", "content": ACK}]
    for q, a in PRIOR_EXCHANGES:
        chat += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    fixed = sizer.count_each([SYSTEM] + [m["content"] for m in chat])
    fact = FACT.format(key=key, value=value)
    room = target - sum(fixed) - sizer.count(DOCUMENT.format(context=fact))
    sents = _sentences(rng, sizer, room)
    sents.insert(rng.randint(0, len(sents)), fact)
    document = DOCUMENT.format(context=" ".join(sents))
    history = (
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": document},
        *chat,
    )
    questions = []
    for _ in range(scale.turns - 1):
        adjective, noun = rng.choice(words.ADJECTIVES), rng.choice(words.NOUNS)
        ask = QUESTION.format(context="{context}", adjective=adjective, noun=noun)
        room = scale.question_tokens - sizer.count(ask.format(context=""))
        questions.append(ask.format(context=" ".join(_sentences(rng, sizer, room))))
    questions.append(RECALL.format(key=key))
    outputs = tuple(rng.randint(scale.output_min, scale.output_max) for _ in questions)
    tokens = sum(sizer.count_each([m["content"] for m in history]))
    return Conversation(index, history, tuple(questions), outputs, key, value, tokens)


def workload(seed: int, scale: Scale, sizer: TokenSizer) -> list[Conversation]:
    """The benchmark's conversations, the same for every system."""
    return [conversation(seed, i, scale, sizer) for i in range(scale.conversations)]


def answered(conv: Conversation, text: str) -> bool:
    """Whether an answer to the last turn states the planted value."""
    return conv.recall_answer in text
