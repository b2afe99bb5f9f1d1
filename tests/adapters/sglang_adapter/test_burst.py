"""A burst of requests larger than the tiered pool (issue 21, failure 2): the scheduler's
admission waits or cuts chunks, decode retracts, routing never raises out of a forward, every
request completes, and the pool's free blocks come back to where they started.

The policy is the one that crashed the H200 server: qevict with ``shares: {full: 100%, int2:
0%}``. Its budget's leftover below one full window still flows down to int2 (rank allocation),
so routing writes ledger copies although the shares give the ledger nothing."""

from __future__ import annotations

import contextlib
from collections import deque
from types import SimpleNamespace

import torch
from sglang_sim import require

require("sglang.srt.managers.schedule_policy")

from test_backend import Harness  # noqa: E402

from tiered_radix.adapters.sglang import plugin  # noqa: E402

FULL100 = """
policy: qevict-full100
budget: 25%
units: window(size=4)
protect: {sinks: 0, recent: 4}
scores:
  score: cumulative(attn, decay=0.99)
tiers:
  full: keep(bf16)
  int2: quantize(bits=2, group=4)
  evicted: evict
allocate: {method: rank, by: score, shares: {full: 100%, int2: 0%}, hysteresis: 10%}
schedule: after_prefill, every(4)
ledger: write_once
"""


class Adder:
    """The part of SGLang's ``PrefillAdder`` the admission hook reads: one prefill batch."""

    def __init__(self, sim, chunk: int, running: int) -> None:
        self.token_to_kv_pool_allocator, self.rem_chunk_tokens = sim.alloc, chunk
        # SGLang's rem_total_tokens: free and evictable slots, less a window of decode for
        # each running request
        free = sim.alloc.available_size() + sim.cache.evictable_size()
        self.rem_total_tokens = free - sim.W * (running + 1)
        self.can_run_list: list = []
        self.running_batch = SimpleNamespace(is_empty=lambda: not running)
        self.W = sim.W

    @contextlib.contextmanager
    def _lock_node(self, _node):
        yield

    def admit(self, _self, req, *_a, **_k):
        """SGLang's admission: the whole extend, or a window-aligned chunk of the rest, within
        the chunk and the allocator's free slots (with what the tree can evict)."""
        n = len(req.full_untruncated_fill_ids) - len(req.prefix_indices)
        if n > self.rem_chunk_tokens:
            n = self.rem_chunk_tokens // self.W * self.W
            if n <= 0:
                return "OTHER"
        if n > self.rem_total_tokens:
            n = self.rem_total_tokens // self.W * self.W
            if n <= 0:
                return "NO_TOKEN"
        self.rem_total_tokens -= -(-n // self.W) * self.W
        req.extend_range = SimpleNamespace(length=n)
        self.can_run_list.append(req)
        self.rem_chunk_tokens -= n
        return "CONTINUE"

    def admit_chunked(self, _self, req):
        """SGLang's ``add_chunked_req``: always admitted, cut to what is left of the chunk
        and the free slots (the chunk alone where nothing is left)."""
        n = len(req.full_untruncated_fill_ids) - len(req.prefix_indices)
        rem = min(self.rem_chunk_tokens, self.rem_total_tokens)
        n = min(n, (rem if rem > 0 else self.rem_chunk_tokens) // self.W * self.W)
        self.rem_total_tokens -= n
        req.extend_range = SimpleNamespace(length=n)
        self.can_run_list.append(req)
        self.rem_chunk_tokens -= n
        return "CONTINUE"


def take_chunk(adder, req, prompt: list[int], continuing: bool) -> list[int] | None:
    """SGLang's admission of ``req``'s next chunk of ``prompt`` through the plugin's hooks
    (``continuing``: it is the chunked request, ``add_chunked_req``; else ``add_one_req``):
    the chunk's tokens, or None where it was not admitted (parked, or the round is over)."""
    have = len(req.tokens)
    req.full_untruncated_fill_ids = prompt
    req.prefix_indices = [0] * have
    if continuing:
        plugin.add_chunked_req(adder.admit_chunked, adder, req)
        if req not in adder.can_run_list:  # parked: no chunk this round
            return None
    elif plugin.add_one_req(adder.admit, adder, req, False, None) not in ("CONTINUE", None):
        return None
    return prompt[have : have + req.extend_range.length]


def retract(sim, req) -> None:
    """SGLang's retraction of a running request: its slots back to the tree uncached, its
    request slot freed (it prefills again from the queue)."""
    req.output_ids = req.tokens[len(req.origin_input_ids) :]
    sim.cache.cache_finished_req(req, is_insert=False, kv_len_to_handle=len(req.tokens))
    sim.r2t.free_slots.append(req.req_pool_idx)


def evict(sim, tokens: int) -> None:
    """SGLang's tree eviction before allocating: enough cached slots for ``tokens``."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    short = tokens - sim.alloc.available_size()
    if short > 0:
        sim.cache.evict(EvictParams(num_tokens=short))


def serve(h: Harness, prompts: dict[str, list[int]], out_len: int, chunk: int) -> dict:
    """A scheduler stand-in over the harness: prefill batches admitted through the plugin's
    ``add_one_req`` hook (chunked), decode steps guarded by its ``check_decode_mem`` hook
    (retracting the newest request, as SGLang does, which then prefills again from the
    queue). Returns per-request generated token counts and how many retractions happened."""
    sim, W = h.sim, h.sim.W
    waiting, running, done, retracted, chunked = deque(prompts), [], {}, 0, None
    held = False
    state: dict[str, SimpleNamespace] = {}
    for _ in range(2000):
        if not waiting and not running:
            break
        adder = Adder(sim, chunk, running=len(running))
        batch, new = [], []
        # SGLang's order: the chunked request's next chunk (always admitted), then new
        # requests until one does not fit or is cut (it becomes the next chunked request)
        # after a retraction SGLang raises its new-token ratio (each running request reserves
        # its remaining output), which holds new requests back until requests finish
        fresh = [r for r in waiting if r != chunked] if not held else []
        order = ([chunked] if chunked else []) + fresh
        prev, chunked = chunked, None
        for rid in order:
            req = state.get(rid)
            if req is None:
                req = state[rid] = h.start(rid, prompts[rid])
            part = take_chunk(adder, req, prompts[rid], rid == prev)
            if part is None:
                chunked = rid if rid == prev else None  # parked, or not admitted
                break
            batch.append(req)
            new.append(part)
            if len(req.tokens) + len(part) < len(prompts[rid]):
                chunked = rid  # cut: the next prefill batch continues it first
                break
        if batch:
            evict(sim, sum(len(t) + W for t in new))
            h.step(batch, new, extend=True)
            for req in batch:
                if len(req.tokens) == len(prompts[req.rid]):
                    waiting.remove(req.rid)
                    running.append(req)
            continue
        # decode: SGLang's check, then retract the newest request until the step fits
        step = SimpleNamespace(
            token_to_kv_pool_allocator=sim.alloc,
            new_tokens_required_next_decode=lambda idx: W * len(running),  # noqa: B023
        )

        def slots(_self, selected_indices=None):  # SGLang's own check: logical slots
            evict(sim, W * len(running))  # noqa: B023
            return sim.alloc.available_size() >= W * len(running)  # noqa: B023

        while running and not plugin.check_decode_mem(slots, step):
            req = running.pop()
            retract(sim, req)
            del state[req.rid]
            waiting.appendleft(req.rid)
            retracted, held = retracted + 1, True
        if not running:
            continue
        h.step(running, [[(len(r.tokens) * 7) % 97 + 1] for r in running], extend=False)
        for req in list(running):
            if len(req.tokens) - len(prompts[req.rid]) >= out_len:
                running.remove(req)
                done[req.rid] = len(req.tokens) - len(prompts[req.rid])
                h.finish(req)
                held = False
    return {"done": done, "retracted": retracted, "waiting": list(waiting)}


def test_a_burst_over_a_full100_policy_completes_without_a_pool_error():
    """12 prompts of 11 windows each against a pool whose rows hold ~15 windows (and the
    sizing's ledger room): nothing raises, every request finishes its tokens, and once the
    tree's cache is dropped every row and ledger block is free again."""
    h = Harness(policy=FULL100, pages=60)
    sim = h.sim
    free0 = sim.pool.blocks_free()
    prompts = {f"r{i}": [(i * 13 + j * 7) % 97 + 1 for j in range(44)] for i in range(12)}
    got = serve(h, prompts, out_len=8, chunk=32)
    assert got["waiting"] == [] and got["done"] == dict.fromkeys(prompts, 8)
    routed = h.backend.stats()
    assert routed["routes"] > 12  # every prefill routed, and decode steps too
    assert routed["degraded_moves"] > 0  # the pool was short of ledger pages...
    assert routed["over_budget_routings"] == 0  # ...and degraded downwards: within the budget
    assert routed["promote"] <= routed["demote"] + routed["borrowed_quantized"]
    evict(sim, 1 << 20)  # the tree's cache gives everything back
    assert sim.pool.blocks_free() == free0
    assert bool((sim.pool.ref_all == 0).all()) and bool((sim.pool.owner_all == -1).all())
    assert torch.isnan(sim.pool.rows_k_all).all()
