"""The soak's requests (issue 21): long prompts, continuations, aborts, malformed requests, bursts.

Every session is a pure function of ``(seed, index, scale)``. A session is what one client does
in a row: ``chat`` sends 1-3 turns, each holding the conversation so far (the server's own
answers included), so turns after the first hit the radix cache; ``abort`` streams one long
answer and disconnects after a few chunks (SGLang aborts the request); ``too_long`` sends a
prompt of ``context + 1024`` tokens, which must get HTTP 400; ``empty`` sends an empty
completion prompt and ``max0`` / ``max1`` ask for 0 / 1 new tokens (200 or a clear 400: no
crash). ``abort_share`` of the sessions (10%) abort; ``odd_share`` of them (3% each) are each
malformed kind; the rest chat. Bursts: every ``burst_every`` requests, ``burst`` one-turn chat
sessions are sent together, past the clients' concurrency limit.

Prompt lengths are log-uniform in ``[prompt_min, prompt_max]`` tokens. A prompt is a session
header (so no two sessions share a prefix by accident) and a run of seeded prose sentences cut
from one shared corpus at a seeded offset, sized with a :class:`~.workload.TokenSizer`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from tiered_radix.eval import words

from .workload import TokenSizer

KINDS = ("chat", "abort", "too_long", "empty", "max0", "max1")
EXPECTED = {  # HTTP statuses each kind may get
    "chat": (200,), "abort": (200,), "too_long": (400,),
    "empty": (200, 400), "max0": (200, 400), "max1": (200,),
}  # fmt: skip
ASK = "Summarize the text above in two sentences."
FOLLOW_UP = "Which place in the text is mentioned most often? Answer briefly."


@dataclass(frozen=True)
class SoakScale:
    """The soak's size and mix (see the module docstring)."""

    requests: int = 1000
    clients: int = 32
    context: int = 32768
    prompt_min: int = 1000
    prompt_max: int = 30000
    max_turns: int = 3
    output_min: int = 1
    output_max: int = 64
    abort_share: float = 0.1
    odd_share: float = 0.03
    burst: int = 64
    burst_every: int = 400

    def __post_init__(self) -> None:
        if self.requests < 1 or self.clients < 1 or self.burst < 0:
            raise ValueError(f"need requests >= 1, clients >= 1, burst >= 0: {self}")
        if not 0 < self.prompt_min <= self.prompt_max:
            raise ValueError(f"prompt lengths must satisfy 0 < min <= max: {self}")
        room = self.prompt_max + self.max_turns * (self.output_max + 64) + 256
        if room > self.context:
            raise ValueError(f"prompts of {self.prompt_max} tokens and their turns exceed "
                             f"the {self.context}-token context")  # fmt: skip
        if self.abort_share + 4 * self.odd_share > 1:
            raise ValueError("abort_share + 4 * odd_share must be at most 1")


@dataclass(frozen=True)
class Turn:
    """One request: the user message (``text``: appended to the conversation; for ``empty``
    the completion prompt), its new tokens and, for ``abort``, the chunks read before the
    client disconnects."""

    text: str
    max_tokens: int
    prompt_tokens: int
    disconnect_after: int | None = None


@dataclass(frozen=True)
class Session:
    index: int
    kind: str
    turns: tuple[Turn, ...]
    burst: int | None = None  # the burst it belongs to


class Corpus:
    """Seeded prose sentences with their token counts; prompts are runs of them."""

    def __init__(self, seed: int, sizer: TokenSizer, tokens: int) -> None:
        rng = random.Random(f"soak-corpus/{seed}")
        self.sentences: list[str] = []
        self.counts: list[int] = []
        while sum(self.counts) < tokens:
            batch = words.filler("prose", rng, 512)
            self.sentences += batch
            self.counts += sizer.count_each([" " + s for s in batch])

    def text(self, rng: random.Random, want: int) -> tuple[str, int]:
        """A run of sentences of at most ``want`` tokens from a random offset (wrapping), and
        its token count."""
        i, got, out = rng.randrange(len(self.sentences)), 0, []
        while True:
            n = self.counts[i % len(self.sentences)]
            if got + n > want:
                return " ".join(out), got
            out.append(self.sentences[i % len(self.sentences)])
            got += n
            i += 1


def _length(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def _prompt(rng: random.Random, corpus: Corpus, index: int, want: int) -> tuple[str, int]:
    body, n = corpus.text(rng, want)
    return f"Session {index}. Read this text.\n\n{body}\n\n{ASK}", n


def _kind(rng: random.Random, scale: SoakScale) -> str:
    x = rng.random()
    if x < scale.abort_share:
        return "abort"
    for i, kind in enumerate(("too_long", "empty", "max0", "max1")):
        if x < scale.abort_share + (i + 1) * scale.odd_share:
            return kind
    return "chat"


def session(seed: int, index: int, scale: SoakScale, corpus: Corpus, kind: str | None = None,
            burst: int | None = None) -> Session:  # fmt: skip
    """Session ``index`` (its kind drawn unless given; see the module docstring)."""
    rng = random.Random(f"soak/{seed}/{index}")
    kind = kind or _kind(rng, scale)
    out_len = rng.randint(scale.output_min, scale.output_max)
    if kind == "too_long":
        text, n = _prompt(rng, corpus, index, scale.context + 1024)
        return Session(index, kind, (Turn(text, 16, n),), burst)
    if kind == "empty":
        return Session(index, kind, (Turn("", 8, 0),), burst)
    text, n = _prompt(rng, corpus, index, _length(rng, scale.prompt_min, scale.prompt_max))
    if kind in ("max0", "max1"):
        return Session(index, kind, (Turn(text, int(kind[-1]), n),), burst)
    if kind == "abort":
        turn = Turn(text, 256, n, disconnect_after=rng.randint(1, 8))
        return Session(index, kind, (turn,), burst)
    turns = [Turn(text, out_len, n)]
    for _ in range(rng.randint(1, scale.max_turns) - 1):
        turns.append(Turn(FOLLOW_UP, rng.randint(scale.output_min, scale.output_max), 16))
    return Session(index, kind, tuple(turns), burst)


def corpus_tokens(scale: SoakScale) -> int:
    """The corpus covers the longest prompt (the too-long ones) twice over."""
    return 2 * (scale.context + 1024)


def plan(
    seed: int, scale: SoakScale, sizer: TokenSizer
) -> tuple[list[Session], list[list[Session]]]:
    """The clients' sessions and the bursts, ``scale.requests`` requests in all: a burst of
    ``scale.burst`` one-turn chats after every ``burst_every`` requests of the clients'
    sessions (at least one burst when ``burst`` > 0 and the requests leave room)."""
    corpus = Corpus(seed, sizer, corpus_tokens(scale))
    sessions: list[Session] = []
    bursts: list[list[Session]] = []
    total, index = 0, 0
    n_bursts = 0
    if scale.burst and scale.requests > scale.burst:
        n_bursts = max(1, scale.requests // (scale.burst_every + scale.burst))
    budget = scale.requests - n_bursts * scale.burst
    while total < budget:
        s = session(seed, index, scale, corpus)
        s = Session(s.index, s.kind, s.turns[: budget - total], None)
        sessions.append(s)
        total, index = total + len(s.turns), index + 1
    for b in range(n_bursts):
        group = [session(seed, index + i, scale, corpus, "chat", b) for i in range(scale.burst)]
        bursts.append([Session(s.index, s.kind, s.turns[:1], b) for s in group])
        index += scale.burst
    return sessions, bursts


def burst_points(sessions: list[Session], n_bursts: int) -> list[int]:
    """Session positions at which each burst starts: evenly over the clients' sessions."""
    return [(b + 1) * len(sessions) // (n_bursts + 1) for b in range(n_bursts)]
