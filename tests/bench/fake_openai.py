"""A tiny OpenAI-compatible streaming chat server for the serving benchmark's CPU tests.

``/v1/chat/completions`` (stream only) answers with ``max_tokens`` canned words, ``delay_s``
apart; a message asking for "the special magic number for KEY" is answered with the number the
conversation's document gives for KEY first. Usage: prompt tokens are the words of all
messages; cached tokens are the words of the longest earlier prompt that is a message-prefix
of this one (a radix cache that never evicts). ``/health``, ``/server_info``, ``/flush_cache``
(empties the cache) as SGLang has them. ``app[STATE]["max_inflight"]`` counts concurrent streams.
A message containing ``HANG`` never gets an answer (timeouts).

Run alone: ``python fake_openai.py --port N [--fail] [--tiered]`` (``--fail``: exit 3 at once,
a server that does not start; ``--tiered``: ``/server_info`` carries tiered stats).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys

from aiohttp import web


def _words(messages) -> int:
    return sum(len(m["content"].split()) for m in messages)


STATE = web.AppKey("state", dict)


def make_app(delay_s: float = 0.002, tiered: bool = False) -> web.Application:
    state = {"seen": [], "inflight": 0, "max_inflight": 0, "requests": 0}

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        messages, n = body["messages"], int(body["max_tokens"])
        prompt = _words(messages)
        cached = max((_words(s) for s in state["seen"] if messages[: len(s)] == s), default=0)
        state["seen"].append(messages)
        asked = re.search(r"special magic number for (\S+) ", messages[-1]["content"])
        if asked:
            doc = " ".join(m["content"] for m in messages)
            found = re.search(rf"for {re.escape(asked.group(1))} is: (\d+)", doc)
            tokens = [found.group(1) if found else "unknown"] + ["."] * (n - 1)
        else:
            tokens = [f"w{i} " for i in range(n)]
        state["requests"] += 1
        state["inflight"] += 1
        state["max_inflight"] = max(state["max_inflight"], state["inflight"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            if "HANG" in messages[-1]["content"]:
                await asyncio.sleep(3600)
            for tok in tokens:
                await asyncio.sleep(delay_s)
                chunk = {"object": "chat.completion.chunk",
                         "choices": [{"index": 0, "delta": {"content": tok}}]}  # fmt: skip
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            details = {"cached_tokens": cached} if cached else None  # SGLang: None when 0
            usage = {"prompt_tokens": prompt, "completion_tokens": n,
                     "prompt_tokens_details": details}  # fmt: skip
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
        finally:
            state["inflight"] -= 1
        return resp

    async def health(_request):
        return web.Response(text="ok")

    async def info(_request):
        usage = {"weight": 0.9, "kvcache": 0.183, "graph": {"decode": 0.1}}
        states = {"memory_usage": usage}
        if tiered:  # the tiered backend's stats (plugin: Scheduler.get_internal_state)
            states["tiered_radix"] = {"cached_tokens_evicted": 0, "routes": state["requests"],
                                      "host_s": {"route": 0.1}, "peak_tokens": 7}  # fmt: skip
        return web.json_response({"max_total_num_tokens": 1234, "internal_states": [states]})

    async def flush(_request):
        state["seen"].clear()
        return web.Response(text="flushed")

    app = web.Application()
    app[STATE] = state
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    app.router.add_get("/server_info", info)
    app.router.add_post("/flush_cache", flush)
    return app


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--fail", action="store_true")
    p.add_argument("--tiered", action="store_true", help="/server_info has tiered stats")
    a, _ = p.parse_known_args()
    if a.fail:
        print("fake server: refusing to start", flush=True)
        return 3
    print("KV Cache is allocated. dtype: torch.bfloat16, #tokens: 1234, K size: 0.01 GB, "
          "V size: 0.01 GB", flush=True)  # fmt: skip
    web.run_app(make_app(tiered=a.tiered), host="127.0.0.1", port=a.port, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
