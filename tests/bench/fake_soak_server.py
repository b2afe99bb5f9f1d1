"""A fake SGLang server for the soak's CPU tests: streamed chat with logprobs, completions,
``/health``, ``/flush_cache``, ``/metrics``.

Chat: 400 past ``limit_words`` words of messages; otherwise ``max_tokens`` words, each with a
logprob (NaN for a last message holding ``nan_for``), then usage with the words of the longest
earlier message-prefix as cached tokens (none of it, nor [DONE], for one holding ``cut_for``).
Completions: 400 for an empty prompt. ``/metrics``
serves SGLang's free-slot gauges and the tiered series: slots taken by cached conversations
(their words) come back at ``/flush_cache``, except ``leak`` of them.

Run alone: ``python fake_soak_server.py --port N [--leak K]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math

from aiohttp import web

SLOTS = 100_000


def make_app(
    limit_words: int = 3000, nan_for: str | None = None, leak: int = 0, cut_for: str | None = None
):
    state = {"seen": [], "closed": 0, "leaked": 0}

    def words(msgs) -> int:
        return sum(len(m["content"].split()) for m in msgs)

    async def chat(request):
        body = await request.json()
        msgs = body["messages"]
        n = words(msgs)
        if n > limit_words:
            return web.json_response({"object": "error", "message": "longer than context"},
                                     status=400)  # fmt: skip
        cached = max((w for s, w in state["seen"] if msgs[: len(s)] == s), default=0)
        state["seen"].append((msgs, n))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        lp = math.nan if nan_for and nan_for in msgs[-1]["content"] else -0.5
        try:
            for i in range(body["max_tokens"]):
                await asyncio.sleep(0.001)
                ch = {"choices": [{"delta": {"content": f"w{i} "},
                                   "logprobs": {"content": [{"logprob": lp}]}}]}  # fmt: skip
                await resp.write(f"data: {json.dumps(ch)}\n\n".encode())
            if cut_for and cut_for in msgs[-1]["content"]:
                return resp  # a stream that stops without usage or [DONE]
            usage = {"prompt_tokens": n, "completion_tokens": body["max_tokens"],
                     "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionResetError:  # the client disconnected (an abort)
            state["closed"] += 1
        return resp

    async def complete(request):
        body = await request.json()
        if not body["prompt"]:
            return web.json_response({"message": "empty prompt"}, status=400)
        return web.json_response({"choices": [{"text": "x", "logprobs": {"token_logprobs": [0]}}]})

    async def health(_request):
        return web.Response(text="ok")

    async def flush(_request):
        state["leaked"] += leak
        state["seen"].clear()
        return web.Response(text="flushed")

    async def metrics(_request):
        held = sum(w for _, w in state["seen"]) + state["leaked"]
        lab = '{model_name="m",tp_rank="0"}'
        lines = [
            f"sglang:kv_available_tokens{lab} {SLOTS - held}",
            f"sglang:kv_evictable_tokens{lab} 0",
            f"sglang:tiered_kv_bytes{lab} {held * 100}",
            f"sglang:tiered_row_blocks_free{lab} {1000 - held // 10}",
            f"sglang:tiered_ledger_blocks_free{lab} 500",
            f"sglang:tiered_promotions_total{lab} 3",
            f"sglang:tiered_demotions_total{lab} 9",
            f"sglang:tiered_borrowed_quantized_total{lab} 1",
            f"sglang:tiered_over_budget_routings_total{lab} 0",
        ]
        return web.Response(text="\n".join(lines) + "\n")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/health", health)
    app.router.add_post("/flush_cache", flush)
    app.router.add_get("/metrics", metrics)
    return app, state


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--leak", type=int, default=0)
    a, _ = p.parse_known_args()
    web.run_app(make_app(leak=a.leak)[0], host="127.0.0.1", port=a.port, print=None)


if __name__ == "__main__":
    main()
