"""The benchmark's client: conversations against an OpenAI-compatible server, streamed.

Each turn is one streamed ``/v1/chat/completions`` request holding the whole conversation so
far (history, earlier questions and the server's own answers); the next turn starts when the
answer is complete. Conversations arrive by :class:`Load`: ``poisson`` starts conversation
``i`` at the ``i``-th arrival of a Poisson process of ``rate`` conversations a second (seeded);
``saturation`` starts them all at once. Either way at most ``concurrency`` conversations are in
flight (a semaphore; the wait is not part of any request's latency). Every request has a
timeout and the run has one: what has not finished by then is cancelled and recorded as failed,
so a run always ends.

Per request (:class:`TurnRecord`): TTFT (send to first content token), TPOT ((last - first
token time) / (output tokens - 1)), and the usage chunk SGLang sends with
``stream_options.include_usage``: prompt, output and cached tokens (``prompt_tokens_details.
cached_tokens``, present with ``--enable-cache-report``).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import aiohttp

from .workload import Conversation, answered


@dataclass(frozen=True)
class Load:
    """How conversations arrive: ``mode`` ``poisson`` (``rate`` a second) or ``saturation``;
    at most ``concurrency`` in flight; per-request and whole-run time limits (seconds)."""

    mode: str
    concurrency: int
    rate: float | None = None
    seed: int = 0
    request_timeout_s: float = 300.0
    run_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.mode not in ("poisson", "saturation"):
            raise ValueError(f"unknown arrival mode {self.mode!r}: poisson or saturation")
        if self.mode == "poisson" and not (self.rate and self.rate > 0):
            raise ValueError("poisson arrivals need a positive rate")
        if self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")

    @property
    def label(self) -> str:
        return (
            f"poisson:{self.rate:g}" if self.mode == "poisson" else f"saturation:{self.concurrency}"
        )

    def start_times(self, n: int) -> list[float]:
        """Seconds after the run's start at which each of ``n`` conversations arrives."""
        if self.mode == "saturation":
            return [0.0] * n
        rng, t, out = random.Random(f"arrivals/{self.seed}"), 0.0, []
        for _ in range(n):
            out.append(t)
            t += rng.expovariate(self.rate)
        return out


@dataclass(frozen=True)
class TurnRecord:
    """One request; times in seconds from the run's start (``start_s``, ``end_s``)."""

    conversation: int
    turn: int
    ok: bool
    error: str | None
    start_s: float
    end_s: float
    ttft_s: float | None
    tpot_s: float | None
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    prior_tokens: int
    recalled: bool | None
    answer: str


@dataclass(frozen=True)
class _Reply:
    text: str
    ttft_s: float | None
    tpot_s: float | None
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


async def stream_chat(
    session: aiohttp.ClientSession, url: str, payload: dict, timeout_s: float
) -> _Reply:
    """One streamed chat completion. Raises on an HTTP error, a server error event or a
    timeout."""
    sent = time.perf_counter()
    first = last = None
    chunks, usage, parts = 0, {}, []
    limit = aiohttp.ClientTimeout(total=timeout_s)
    async with session.post(url, json=payload, timeout=limit) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event or event.get("object") == "error":
                raise RuntimeError(f"server error: {str(event)[:300]}")
            for choice in event.get("choices") or ():
                text = (choice.get("delta") or {}).get("content")
                if text:
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
                    chunks += 1
                    parts.append(text)
            if event.get("usage"):
                usage = event["usage"]
    out = usage.get("completion_tokens") or chunks
    details = usage.get("prompt_tokens_details") or {}
    return _Reply(
        text="".join(parts),
        ttft_s=None if first is None else first - sent,
        tpot_s=(last - first) / (out - 1) if first is not None and out > 1 else None,
        prompt_tokens=usage.get("prompt_tokens") or 0,
        cached_tokens=details.get("cached_tokens") or 0,
        output_tokens=out,
    )


class _Run:
    """One run's state: the session, the clock, the records so far, the progress bar."""

    def __init__(self, session, url: str, model: str, load: Load, ignore_eos: bool, bar):
        self.session, self.url, self.model, self.load = session, url, model, load
        self.ignore_eos, self.bar = ignore_eos, bar
        self.t0 = time.perf_counter()
        self.records: dict[int, list[TurnRecord]] = {}

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def payload(self, messages: list[dict], max_tokens: int) -> dict:
        return {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": self.ignore_eos,
        }

    def add(self, rec: TurnRecord) -> None:
        self.records.setdefault(rec.conversation, []).append(rec)
        self.bar.update(1)

    async def conversation(self, conv: Conversation, sem: asyncio.Semaphore) -> None:
        async with sem:
            messages, prior = list(conv.history), 0
            for t, (question, n) in enumerate(zip(conv.questions, conv.max_tokens, strict=True)):
                messages.append({"role": "user", "content": question})
                start = self.now()
                try:
                    r = await stream_chat(
                        self.session, self.url, self.payload(messages, n),
                        self.load.request_timeout_s,
                    )  # fmt: skip
                except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError) as e:
                    self.add(_failed(conv.index, t, f"{type(e).__name__}: {e}", start, self.now()))
                    return
                last = t == len(conv.questions) - 1
                self.add(
                    TurnRecord(
                        conv.index, t, True, None, start, self.now(), r.ttft_s, r.tpot_s,
                        r.prompt_tokens, r.cached_tokens, r.output_tokens, prior,
                        answered(conv, r.text) if last else None, r.text,
                    )
                )  # fmt: skip
                messages.append({"role": "assistant", "content": r.text})
                prior = r.prompt_tokens + r.output_tokens


def _failed(conv: int, turn: int, error: str, start: float, end: float) -> TurnRecord:
    return TurnRecord(conv, turn, False, error, start, end, None, None, 0, 0, 0, 0, None, "")


async def run_load(
    base_url: str,
    conversations: Sequence[Conversation],
    load: Load,
    *,
    model: str = "default",
    ignore_eos: bool = True,
    progress: bool = True,
) -> list[dict]:
    """Every conversation's turns against ``base_url`` (``http://host:port``), arriving by
    ``load``; one record (a dict of :class:`TurnRecord`) per turn, failed and unsent ones
    included, ordered by conversation and turn."""
    from tqdm import tqdm

    total = sum(len(c.questions) for c in conversations)
    sem = asyncio.Semaphore(load.concurrency)
    bar = tqdm(total=total, desc=load.label, unit="req", disable=not progress, mininterval=2)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        run = _Run(session, base_url.rstrip("/") + "/v1/chat/completions", model, load,
                   ignore_eos, bar)  # fmt: skip

        crashed: dict[int, str] = {}  # a bug in this loop, recorded instead of lost in a task

        async def arrive(conv: Conversation, at: float) -> None:
            await asyncio.sleep(max(0.0, at - run.now()))
            try:
                await run.conversation(conv, sem)
            except Exception as err:  # noqa: BLE001
                crashed[conv.index] = f"client error: {type(err).__name__}: {err}"

        starts = load.start_times(len(conversations))
        tasks = [
            asyncio.create_task(arrive(c, s)) for c, s in zip(conversations, starts, strict=True)
        ]
        _, pending = await asyncio.wait(tasks, timeout=load.run_timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    bar.close()
    out = []
    for conv in conversations:
        recs = run.records.get(conv.index, [])
        out += [asdict(r) for r in recs]
        end = run.now()
        for t in range(len(recs), len(conv.questions)):
            why = "an earlier turn failed" if recs and not recs[-1].ok else "run timeout"
            why = crashed.get(conv.index, f"not sent: {why}")
            out.append(asdict(_failed(conv.index, t, why, end, end)))
    return out
