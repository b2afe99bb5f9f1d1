"""Issue 18 lab tool: where the chat's fact sits after every routing of the 4-turn main job.

Runs `tiered-radix chat`'s default script on SmolLM2-135M (CPU, float32, greedy) under a policy
and prints, after every routing step, the tier of the window holding "Ilse Moreno" in each
(layer, KV head), then each answer. A measurement, not product code: it wraps
``TierStore.apply`` to read the tiers after each step. docs/fidelity.md, *The main job's turn 4*.

    python bench/h18_turn4_trace.py qevict [10%]
"""

from __future__ import annotations

import sys
import time

import torch

import tiered_radix.engine.store as store_mod
from tiered_radix.adapters.transformers import ChatSession
from tiered_radix.cli.chat import _load, default_turns
from tiered_radix.models import fetch
from tiered_radix.policy import load_policy


def main(policy: str, budget: str | None) -> None:
    torch.set_num_threads(1)
    tok, model = _load(fetch("smollm2-135m"), "cpu")
    session = ChatSession(model, tok, load_policy(policy), budget=budget, max_new_tokens=48)
    turns = default_turns()
    text = tok.decode(session._new_turn_ids(turns[0]))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    at = text.index("Ilse Moreno")
    first = next(i for i, (a, b) in enumerate(enc["offset_mapping"]) if b > at)
    window = first // load_policy(policy).v.size
    print(f"'Ilse Moreno' starts at token {first}: window {window}", flush=True)
    apply = store_mod.TierStore.apply

    def traced(self, plan, reason=""):
        out = apply(self, plan, reason)
        t = torch.stack([self.tiers(li)[:, window] for li in range(self.n_layers)])
        count = {n: int((t == i).sum()) for i, n in enumerate(self.tier_names)}
        print(f"  [{reason}] window {window} over {t.numel()} (layer, head): {count}", flush=True)
        return out

    store_mod.TierStore.apply = traced
    for i, turn in enumerate(turns, 1):
        t0 = time.perf_counter()
        r = session.ask(turn)
        print(f"turn {i}: {r.text!r} ({time.perf_counter() - t0:.0f} s) units {r.occupancy}, "
              f"{r.bytes_used / r.full_bytes:.1%} of full KV", flush=True)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
