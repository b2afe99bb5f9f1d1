"""Issue 18 lab tool: which prompt tokens an RDKV-style policy keeps, per V width.

For ``niah_single`` samples (SmolLM2-135M, CPU, float32) each policy prefills the prompt through
a :class:`ChatSession`, routes (one decode step, so a deferred routing runs too), and the V
width of every prompt token in every (layer, KV head) is read from the store. Printed per
policy: the share of (layer, head, token) kept (V > 0 bits) and at 16 bits for the needle's
digits, the question (the prompt's last 64 tokens) and the sinks (first 4), then the greedy answer
to the sample (``--answer``). A measurement, not product code. docs/fidelity.md, *RDKV*.

    python bench/rdkv_keep_probe.py --samples 2 --length 2k rdkv \
        examples/ablation/rdkv_protect.yaml
"""

from __future__ import annotations

import argparse

import torch

from tiered_radix.adapters.transformers import ChatSession
from tiered_radix.cli.chat import _load
from tiered_radix.eval.runner import parse_length
from tiered_radix.eval.tasks import make_sample
from tiered_radix.models import fetch
from tiered_radix.policy import load_policy


def needle_tokens(tok, ids: list[int], answer: str) -> list[int]:
    text = tok.decode(ids)
    at = text.rindex(answer) if answer in text else -1
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    return [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < at + len(answer) and b > at]


def shares(store, n_prompt: int, groups: dict[str, list[int]]) -> dict[str, tuple[float, float]]:
    bits = torch.tensor(store.tier_bits())
    v = torch.stack([bits[store.tiers(li)][:, :n_prompt] for li in range(store.n_layers)])
    return {
        name: (float((v[..., idx] > 0).float().mean()), float((v[..., idx] == 16).float().mean()))
        for name, idx in groups.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("policies", nargs="+")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--length", default="2k")
    ap.add_argument("--task", default="niah_single")
    ap.add_argument("--answer", action="store_true", help="also decode each answer (slower)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok, model = _load(fetch("smollm2-135m"), "cpu")
    count = lambda s: len(tok(s)["input_ids"])  # noqa: E731
    for i in range(args.samples):
        s = make_sample(args.task, parse_length(args.length), i, count)
        for name in args.policies:
            session = ChatSession(model, tok, load_policy(name), max_new_tokens=1)
            ids = session._new_turn_ids(s.turns[0])
            session.ask_ids(ids)
            n = len(ids)
            groups = {
                "needle": needle_tokens(tok, ids, s.answers[0]),
                "last64": list(range(n - 64, n)),
                "sinks": list(range(4)),
                "all": list(range(n)),
            }
            got = shares(session.cache.store, n, groups)
            text = ""
            if args.answer:
                text = ChatSession(model, tok, load_policy(name), max_new_tokens=24).ask(s.turns[0])
                text = repr(text.text[-60:])
            cols = "  ".join(f"{k} {a:.2f}/{b:.2f}" for k, (a, b) in got.items())
            print(f"#{i} n={n} {name:45s} kept/16bit: {cols} {text}", flush=True)


if __name__ == "__main__":
    main()
