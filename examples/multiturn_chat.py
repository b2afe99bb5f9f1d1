"""A multi-turn chat against an SGLang server running a tiered KV policy (OpenAI client).

Start a server, then run this script::

    python -m sglang.launch_server --model-path M --kv-policy qevict --enable-cache-report \\
        --port 30000
    python examples/multiturn_chat.py --port 30000

Each turn sends the whole conversation so far; the radix cache matches the previous turns (their
quantized windows included) and prefills only the new message. The ``cached`` column is SGLang's
``prompt_tokens_details.cached_tokens`` (needs ``--enable-cache-report``): from turn 2 on, most
of the prompt should come from the cache.

``--kv-budget 25%`` / ``--kv-policy NAME`` send the request's own budget and policy (the OpenAI
client's ``extra_body``; the policy must be loaded by the server, ``--kv-policies``). Each turn
prints the KV the request held when it finished (the response's ``usage.kv``): tokens full /
quantized (incl. restored) / evicted, bytes held against bf16, and its demotions, promotions,
evictions and routings.
"""

from __future__ import annotations

import argparse
import sys

SYSTEM = "You are a concise assistant. Answer in one short sentence."
TURNS = (
    "Remember this: my locker code is 4 8 1 5 and my cat is called Miso.",
    "Name three colours of the rainbow.",
    "What is the capital of France?",
    "What is my cat called, and what is my locker code?",
)


def chat(
    base_url: str, turns=TURNS, max_tokens: int = 48, model: str = "default", **kv
) -> list[dict]:
    """Run ``turns`` in one conversation; return per turn the answer, the token counts and the
    request's KV usage (``None`` from a server without a tiered policy). ``kv``: ``kv_budget``
    and ``kv_policy`` for every request (``None``: the server's)."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="none")
    messages = [{"role": "system", "content": SYSTEM}]
    extra = {k: v for k, v in kv.items() if v is not None}
    rows = []
    for text in turns:
        messages.append({"role": "user", "content": text})
        r = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0.0,
            extra_body=extra or None,
        )  # fmt: skip
        answer = r.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": answer})
        details = getattr(r.usage, "prompt_tokens_details", None)
        cached = getattr(details, "cached_tokens", None) or 0
        usage = r.usage.model_dump() if r.usage is not None else {}
        rows.append({"user": text, "answer": answer, "prompt": r.usage.prompt_tokens,
                     "cached": cached, "kv": usage.get("kv")})  # fmt: skip
    return rows


def kv_line(kv: dict | None) -> str:
    """A request's KV usage in one line."""
    if not kv:
        return "(no KV report: not a tiered server)"
    t = kv["tokens_per_state"]
    return (
        f"{kv['policy']} {kv['budget']}: tokens full {t['full'] + t['restored']:.0f} / "
        f"quantized {t['quantized']:.0f} / evicted {t['evicted']:.0f}; "
        f"{kv['bytes_held'] / 2**20:.2f} of {kv['bf16_bytes'] / 2**20:.2f} MiB bf16 "
        f"({100 * kv['held_vs_bf16']:.1f}%); demoted {kv['demotions']}, promoted "
        f"{kv['promotions']}, evicted {kv['evictions']} (head-windows), {kv['routed_steps']} "
        "routings"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--kv-budget", default=None, help="this conversation's budget, e.g. 25%%")
    p.add_argument("--kv-policy", default=None, help="a policy the server loaded")
    a = p.parse_args(argv)
    rows = chat(f"http://{a.host}:{a.port}/v1", max_tokens=a.max_tokens,
                kv_budget=a.kv_budget, kv_policy=a.kv_policy)  # fmt: skip
    print(f"{'turn':>4} {'prompt':>6} {'cached':>6}  answer")
    for i, r in enumerate(rows, 1):
        print(f"{i:>4} {r['prompt']:>6} {r['cached']:>6}  {r['answer'].strip()[:100]}")
        print(f"{'':>19}  KV: {kv_line(r['kv'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
