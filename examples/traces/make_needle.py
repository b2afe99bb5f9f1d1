"""Build the needle-in-a-haystack prompt of ``smollm2-needle.npz`` and record the trace.

The haystack is deterministic (a seeded shuffle of short factual sentences on several topics),
a RULER-style needle ("The special magic number for <city> is <n>.") sits at ``--depth`` of it,
and the question at the end asks for the number and then a summary of the text, so decoding
first retrieves the needle and then reads the haystack again.

    python examples/traces/make_needle.py --out examples/traces/smollm2-needle.npz
"""

from __future__ import annotations

import argparse
import dataclasses
import random

TOPICS = {
    "garden": ["tomatoes", "roses", "the compost heap", "the apple tree", "the herb bed"],
    "harbour": ["the fishing boats", "the lighthouse", "the ferry", "the old crane", "the pier"],
    "library": ["the reading room", "the map collection", "the archive", "the card index"],
    "kitchen": ["the bread oven", "the spice shelf", "the copper pans", "the long table"],
    "railway": ["the night train", "the signal box", "the freight yard", "the station clock"],
}
VERBS = [
    "was repaired in the spring", "is visited by many people", "needs attention every week",
    "was painted a pale green", "is described in the town records", "has a long history",
    "was moved to a new place", "is looked after by volunteers", "was photographed last year",
]  # fmt: skip


def build_prompt(*, sentences: int, depth: float, seed: int) -> tuple[str, dict]:
    rng = random.Random(seed)
    pool = [
        f"In the {topic}, {thing} {verb}."
        for topic, things in TOPICS.items()
        for thing in things
        for verb in VERBS
    ]
    body = [rng.choice(pool) for _ in range(sentences)]
    number = rng.randrange(1_000_000, 9_999_999)
    city = "Lisbon"
    needle = f"The special magic number for {city} is {number}."
    at = int(depth * len(body))
    body.insert(at, needle)
    question = (
        f"What is the special magic number for {city} mentioned in the text above? "
        "State the number. Then list five places from the text and say what happened to each "
        "of them."
    )
    text = "Read the following text carefully.\n\n" + " ".join(body) + "\n\n" + question
    return text, {"needle": needle, "answer": str(number), "needle_sentence": at}


def needle_span(folder, prompt_ids, needle: str) -> list[int]:
    """``[start, end)`` token positions of the needle sentence inside the prompt."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    ids = list(prompt_ids)
    for text in (" " + needle, needle):
        pat = tok(text, add_special_tokens=False)["input_ids"]
        for i in range(len(ids) - len(pat) + 1):
            if ids[i : i + len(pat)] == pat:
                return [i, i + len(pat)]
    raise SystemExit("needle tokens not found in the prompt")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sentences", type=int, default=150)
    ap.add_argument("--depth", type=float, default=0.4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--layers", default="2,7,17,23")
    ap.add_argument("--out", default="examples/traces/smollm2-needle.npz")
    args = ap.parse_args()

    from tiered_radix.models import fetch
    from tiered_radix.sim.record import record_trace
    from tiered_radix.sim.trace import Trace

    prompt, extra = build_prompt(sentences=args.sentences, depth=args.depth, seed=args.seed)
    folder = fetch(args.model)
    layers = [int(x) for x in args.layers.split(",")]
    out = record_trace(
        folder, prompt, steps=args.steps, layers=layers, out=args.out,
        model_name=args.model, extra=extra,
    )  # fmt: skip
    trace = Trace.load(out)
    span = needle_span(folder, trace.meta.prompt_ids, extra["needle"])
    found = extra["answer"] in trace.meta.generated_text
    extra = {**trace.meta.extra, "needle_tokens": span, "answer_found": found}
    trace = dataclasses.replace(trace, meta=dataclasses.replace(trace.meta, extra=extra))
    trace.save(out)
    meta = trace.meta
    print(f"{out}: prompt_len={meta.prompt_len} steps={meta.steps} layers={list(meta.layers)}")
    print(f"needle: {extra['needle']} tokens [{span[0]}, {span[1]})")
    print(f"generated: {meta.generated_text!r}")
    print("answer found" if found else "answer NOT found")


if __name__ == "__main__":
    main()
