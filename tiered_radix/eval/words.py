"""Fixed word lists for the synthetic tasks (no downloads; the order never changes).

Keys are ``adjective-noun`` pairs like RULER's; common/frequent-word tasks draw from ``NOUNS``
and ``ADJECTIVES`` or from made-up syllable words. Haystack filler comes in two kinds: RULER's
``noise`` (five fixed sentences repeated) and seeded ``prose`` (varied short sentences).
"""

from __future__ import annotations

import random

ADJECTIVES = """
able amber ancient bitter bold brave brief bright broad calm cheap clever cold cosy crisp
curly damp dark deep dusty eager early empty fair fancy fast fierce flat fresh gentle giant
glad golden grand green grey happy hardy heavy hollow honest huge humble icy jolly keen kind
large lazy light little lively loud lucky mellow merry mighty misty modern narrow neat noble
odd old pale plain polite proud quick quiet rapid rare rich rough round royal rusty sandy
sharp shiny short silent silver simple sleepy slow small smooth soft solid spare steep stiff
still strong sunny sweet swift tall tame tender thick thin tidy tiny vast warm wet wide wild
wise witty young
""".split()

NOUNS = """
anchor apple arrow badge basket beacon bell blanket bottle bridge brush bucket button cabin
candle canoe carpet castle chair cherry circle cloud compass copper cottage crayon crown
curtain desk diamond dolphin drum eagle engine feather fence fiddle flag flute forest fountain
garden garlic glove goose guitar hammer harbor helmet hill island jacket kettle kitten ladder
lantern lemon letter lizard magnet maple meadow mirror monkey needle oyster paddle palace
parrot pebble pencil pepper piano pillow planet pocket puzzle rabbit ribbon river rocket
saddle sailor scarf shell shovel spoon statue stove tablet teapot thimble ticket tiger tomato
tower trumpet tulip tunnel turtle umbrella valley violin wagon walnut whistle window wizard
""".split()

NOISE_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)

_PLACES = ("garden", "harbour", "library", "kitchen", "railway station", "market", "school")
_VERBS = (
    "was repaired in the spring", "is visited by many people", "needs attention every week",
    "was painted a pale green", "is described in the town records", "has a long history",
    "was moved to a new place", "is looked after by volunteers", "was photographed last year",
)  # fmt: skip

_SYLLABLES = "ba be bi bo bu da de di do du ka ke ki ko ku la le li lo lu ma me mi mo mu".split()


def filler(kind: str, rng: random.Random, n: int) -> list[str]:
    """``n`` haystack sentences of ``kind`` ("noise" or "prose")."""
    if kind == "noise":
        return [NOISE_SENTENCES[i % len(NOISE_SENTENCES)] for i in range(n)]
    if kind == "prose":
        return [
            f"In the {rng.choice(_PLACES)}, the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} "
            f"{rng.choice(_VERBS)}."
            for _ in range(n)
        ]
    raise ValueError(f"unknown haystack kind {kind!r}; expected 'noise' or 'prose'")


def keys(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct ``adjective-noun`` keys."""
    out: list[str] = []
    while len(out) < n:
        key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if key not in out:
            out.append(key)
    return out


def numbers(rng: random.Random, n: int, digits: int = 7) -> list[str]:
    """``n`` distinct ``digits``-digit decimal strings (no leading zero)."""
    out: list[str] = []
    while len(out) < n:
        v = str(rng.randrange(10 ** (digits - 1), 10**digits))
        if v not in out:
            out.append(v)
    return out


def made_up_words(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct pronounceable nonsense words of three syllables."""
    out: list[str] = []
    while len(out) < n:
        w = "".join(rng.choice(_SYLLABLES) for _ in range(3))
        if w not in out:
            out.append(w)
    return out
