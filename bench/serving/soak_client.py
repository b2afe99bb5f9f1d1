"""The soak's client: its sessions from ``clients`` concurrent clients, and its bursts.

``clients`` workers take sessions in order (:mod:`.soak_workload`); when the sessions taken
reach a burst's point, the burst's sessions all start at once, outside the workers. Chat turns
are streamed ``/v1/chat/completions`` requests with ``logprobs``; an ``abort`` turn closes its
connection after ``disconnect_after`` content chunks; the ``empty`` turn is a non-streamed
``/v1/completions`` request with an empty prompt. Each request records its HTTP status, whether
the status was one its kind may get, the returned logprobs and how many were not finite (NaN,
inf, or null: SGLang's JSON writes NaN as null), the usage SGLang reports (cached prompt
tokens: radix hits) and its error.

Time: no session starts after ``deadline_s``; every request must end by ``hard_s`` (its
timeout is what is left), after which it is recorded as a timeout. A session whose turn failed
sends no more turns (they count as ``not_sent``).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass

import aiohttp

from .soak_workload import EXPECTED, Session, burst_points


@dataclass(frozen=True)
class SoakRecord:
    """One request; ``status`` 0 when no HTTP status came back (a timeout, a refused
    connection)."""

    session: int
    turn: int
    kind: str
    burst: int | None
    status: int
    expected: bool
    aborted: bool
    error: str | None
    logprobs: int
    nonfinite: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    start_s: float
    end_s: float


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


@dataclass
class _Reply:
    status: int = 0
    text: str = ""
    logprobs: int = 0
    nonfinite: int = 0
    usage: dict | None = None
    aborted: bool = False
    done: bool = False  # the stream ended with [DONE]
    error: str | None = None

    def logprob(self, x) -> None:
        self.logprobs += 1
        self.nonfinite += not _finite(x)


async def _stream(resp: aiohttp.ClientResponse, out: _Reply, disconnect_after: int | None):
    chunks = 0
    async for raw in resp.content:
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            out.done = True
            return
        event = json.loads(data)
        if "error" in event or event.get("object") == "error":
            out.error = f"server error event: {str(event)[:300]}"
            return
        for choice in event.get("choices") or ():
            for lp in ((choice.get("logprobs") or {}).get("content")) or ():
                out.logprob(lp.get("logprob"))
            text = (choice.get("delta") or {}).get("content")
            if text:
                out.text += text
                chunks += 1
        out.usage = event.get("usage") or out.usage
        if disconnect_after is not None and chunks >= disconnect_after:
            out.aborted = True
            resp.close()  # the client goes away mid-stream: SGLang aborts the request
            return


async def request(http: aiohttp.ClientSession, base: str, model: str, messages: list[dict],
                  turn, kind: str, timeout_s: float) -> _Reply:  # fmt: skip
    """One turn (see the module docstring); never raises for a server's behaviour."""
    out = _Reply()
    limit = aiohttp.ClientTimeout(total=max(1.0, timeout_s))
    if kind == "empty":
        url, body = f"{base}/v1/completions", {"prompt": turn.text, "logprobs": 1}
    else:
        url = f"{base}/v1/chat/completions"
        body = {"messages": messages, "stream": True, "logprobs": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
    body |= {"model": model, "max_tokens": turn.max_tokens, "temperature": 0.0}
    try:
        async with http.post(url, json=body, timeout=limit) as resp:
            out.status = resp.status
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
            elif kind == "empty":
                reply = await resp.json()
                choice = (reply.get("choices") or [{}])[0]
                out.text = choice.get("text") or ""
                for x in (choice.get("logprobs") or {}).get("token_logprobs") or ():
                    out.logprob(x)
                out.usage = reply.get("usage")
            else:
                await _stream(resp, out, turn.disconnect_after)
                if not (out.done or out.aborted or out.error):
                    out.error = "the stream ended without [DONE]"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
        out.error = f"{type(err).__name__}: {err}"[:300]
        if isinstance(err, asyncio.TimeoutError):
            out.status = 0
    return out


class SoakRun:
    """One soak's sessions against ``base`` (``http://host:port``)."""

    def __init__(self, base: str, model: str, deadline_s: float, hard_s: float, bar) -> None:
        self.base, self.model, self.bar = base.rstrip("/"), model, bar
        self.deadline_s, self.hard_s = deadline_s, hard_s
        self.t0 = time.perf_counter()
        self.records: list[SoakRecord] = []
        self.not_sent = 0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def session(self, http: aiohttp.ClientSession, s: Session) -> None:
        messages: list[dict] = []
        for t, turn in enumerate(s.turns):
            if self.now() >= self.hard_s:
                self.not_sent += len(s.turns) - t
                return
            messages.append({"role": "user", "content": turn.text})
            start = self.now()
            r = await request(http, self.base, self.model, messages, turn, s.kind,
                              self.hard_s - start)  # fmt: skip
            u = r.usage or {}
            ok = r.status in EXPECTED[s.kind] and (r.error is None or r.status != 200)
            self.records.append(SoakRecord(
                s.index, t, s.kind, s.burst, r.status, ok, r.aborted, r.error, r.logprobs,
                r.nonfinite, u.get("prompt_tokens") or 0,
                (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                u.get("completion_tokens") or 0, start, self.now(),
            ))  # fmt: skip
            self.bar.update(1)
            if r.status != 200 or r.error is not None or r.aborted:
                self.not_sent += len(s.turns) - t - 1
                return
            messages.append({"role": "assistant", "content": r.text})

    async def run(self, sessions: list[Session], bursts: list[list[Session]], clients: int):
        queue = list(sessions)
        points = dict(zip(burst_points(sessions, len(bursts)), bursts, strict=True))
        taken = 0
        side: list[asyncio.Task] = []
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as http:

            async def worker() -> None:
                nonlocal taken
                while queue and self.now() < self.deadline_s:
                    s = queue.pop(0)
                    taken += 1
                    for group in [points.pop(taken)] if taken in points else []:
                        side.extend(asyncio.create_task(self.session(http, b)) for b in group)
                    await self.session(http, s)
                self.not_sent += sum(len(s.turns) for s in queue)
                queue.clear()

            await asyncio.gather(*(worker() for _ in range(clients)))
            await asyncio.gather(*side)
        self.not_sent += sum(len(s.turns) for group in points.values() for s in group)
        return [asdict(r) for r in sorted(self.records, key=lambda r: (r.session, r.turn))]
