"""A multi-turn chat against an SGLang server running a tiered KV policy (OpenAI client).

Start a server, then run this script::

    python -m sglang.launch_server --model-path M --kv-policy qevict --enable-cache-report \\
        --port 30000
    python examples/multiturn_chat.py --port 30000

Each turn sends the whole conversation so far; the radix cache matches the previous turns (their
quantized windows included) and prefills only the new message. The ``cached`` column is SGLang's
``prompt_tokens_details.cached_tokens`` (needs ``--enable-cache-report``): from turn 2 on, most
of the prompt should come from the cache.
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


def chat(base_url: str, turns=TURNS, max_tokens: int = 48, model: str = "default") -> list[dict]:
    """Run ``turns`` in one conversation; return per turn the answer and the token counts."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="none")
    messages = [{"role": "system", "content": SYSTEM}]
    rows = []
    for text in turns:
        messages.append({"role": "user", "content": text})
        r = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0.0
        )
        answer = r.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": answer})
        details = getattr(r.usage, "prompt_tokens_details", None)
        cached = getattr(details, "cached_tokens", None) or 0
        rows.append(
            {"user": text, "answer": answer, "prompt": r.usage.prompt_tokens, "cached": cached}
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--max-tokens", type=int, default=48)
    a = p.parse_args(argv)
    rows = chat(f"http://{a.host}:{a.port}/v1", max_tokens=a.max_tokens)
    print(f"{'turn':>4} {'prompt':>6} {'cached':>6}  answer")
    for i, r in enumerate(rows, 1):
        print(f"{i:>4} {r['prompt']:>6} {r['cached']:>6}  {r['answer'].strip()[:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
