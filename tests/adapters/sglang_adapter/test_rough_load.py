"""A rough load on CPU, for every shipped policy (issue 21: "no exception escapes the scheduler
for any valid policy and any load"): the GPU soak's kinds of traffic, played through the real
pool, allocator, radix cache and attention backend by a scheduler stand-in.

Seeded random sessions arrive in bursts: prompts of 1 to ~300 tokens, 1-3 turns whose later
prompts extend the earlier ones (radix hits), ``max_new_tokens`` of 1 (finished by its prefill)
to 12, some requests aborted mid-decode, on a pool small enough that admission cuts chunks,
the tree gives cached slots back and decode retracts requests; every chunk and every prefilled
prompt that goes on decoding is inserted into the tree as SGLang does (``cache_unfinished_req``:
where the tree held those tokens, the request's duplicates are freed). After it: nothing
raised, every request finished or was aborted, every forward's outputs finite, no routing over
the budget, promotions within demotions and borrowed copies, and once the tree's cache is
dropped the allocator, the row and ledger blocks, Zone A and every reference count are back
where they started. Also: decode routings landing one step late (SGLang's overlap
scheduler), rdkv with a Zone A store too small for its repacks, a launch serving two policies
at per-request budgets, and the three ways rows ran out that this load found (each failing
before its fix).
Locally, more seeds: ``RoughLoad(harness(name, late), sessions(seed, n=24)).run()``.
"""

from __future__ import annotations

import contextlib
import random
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from sglang_sim import require

require("sglang.srt.managers.schedule_policy")

from test_backend import KERNEL_POLICY, Harness  # noqa: E402
from test_batch_invariance import ARCHIVED, SHIPPED, policy_text  # noqa: E402
from test_burst import Adder, evict, retract, take_chunk  # noqa: E402

from tiered_radix.adapters.sglang import plugin  # noqa: E402
from tiered_radix.adapters.sglang.options import KVOptions  # noqa: E402
from tiered_radix.adapters.sglang.reps import Layout  # noqa: E402
from tiered_radix.adapters.sglang.sizing import (  # noqa: E402
    PoolBlocks,
    min_row_windows,
    plan_blocks,
)
from tiered_radix.policy import compile_text  # noqa: E402

HEAD_DIM = 32
CHUNK = 96  # --chunked-prefill-size
SLOTS = 24  # request slots (SGLang's ReqToTokenPool); more sessions than slots wait


@dataclass(frozen=True)
class Turn:
    """One request: its whole prompt (the session's history and a new message), how many
    tokens it may generate, and the decode step it is aborted at (None: it runs out)."""

    rid: str
    prompt: list[int]
    max_new: int
    abort_at: int | None


def sessions(seed: int, n: int = 14) -> list[list[tuple[int, int, int | None, int]]]:
    """Per session its turns: (new prompt tokens, max_new_tokens, abort step, first token)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        turns = []
        for t in range(rng.choice((1, 1, 2, 3))):
            new = rng.choice((1, 3, rng.randint(20, 120), rng.randint(120, 300)))
            if t:  # a later turn's message
                new = rng.randint(1, 60)
            max_new = rng.choice((1, 2, rng.randint(3, 12)))
            abort = rng.randint(0, max_new - 2) if rng.random() < 0.15 and max_new > 1 else None
            turns.append((new, max_new, abort, rng.randint(1, 99)))
        out.append(turns)
    return out


class RoughLoad:
    """SGLang's loop around the harness, as ``test_burst.serve`` plays it (the admission hooks,
    chunked requests, the tree's eviction before each allocation, decode retracting the newest
    request), with sessions: a session's next turn arrives once its last one finished, its
    prompt the last one's prompt, outputs and a new message (a radix hit)."""

    def __init__(self, h: Harness, plan: list[list[tuple[int, int, int | None, int]]],
                 asks: dict[int, dict] | None = None) -> None:  # fmt: skip
        """``asks``: a session's ``custom_params`` (its ``kv_budget`` / ``kv_policy``)."""
        self.h, self.plan, self.asks = h, plan, asks or {}
        self.next_turn = [0] * len(plan)
        self.history: list[list[int]] = [[] for _ in plan]
        self.waiting: deque[Turn] = deque()
        self.turns: dict[str, Turn] = {}
        self.state: dict[str, SimpleNamespace] = {}
        self.running: list[SimpleNamespace] = []
        self.generated: dict[str, int] = {}
        self.finished: dict[str, str] = {}  # rid -> "length" | "abort"
        self.routings: dict[str, list[str]] = {}  # rid -> its engine's routings' reasons
        self.retracted = 0
        self.forwards = 0
        for s in range(len(plan)):  # the first turns arrive as one burst
            self._arrive(s)

    def _arrive(self, s: int) -> None:
        k = self.next_turn[s]
        if k == len(self.plan[s]):
            return
        new, max_new, abort, first = self.plan[s][k]
        msg = [(first + 7 * j) % 99 + 1 for j in range(new)]
        turn = Turn(f"s{s}t{k}", self.history[s] + msg, max_new, abort)
        self.next_turn[s] += 1
        self.turns[turn.rid] = turn
        self.waiting.append(turn)

    def _finish(self, req, why: str) -> None:
        turn = self.turns[req.rid]
        self.running.remove(req)
        steps = self.h.backend.sessions[req.rid].store.events.steps
        self.routings[req.rid] = [e.reason for e in steps]
        self.h.finish(req)
        del self.state[req.rid]
        self.finished[req.rid] = why
        s = int(req.rid[1 : req.rid.index("t")])
        self.history[s] = list(req.tokens)
        self._arrive(s)
        assert len(req.tokens) <= len(turn.prompt) + turn.max_new

    def _forward(self, batch, new, extend: bool) -> None:
        outs = self.h.step(batch, new, extend=extend)
        self.forwards += 1
        for li, o in enumerate(outs):
            assert torch.isfinite(o).all(), (self.forwards, li, [r.rid for r in batch])

    def run(self, rounds: int = 4000) -> RoughLoad:
        h, sim = self.h, self.h.sim
        W, chunked, held = sim.W, None, False
        for _ in range(rounds):
            if not self.waiting and not self.running:
                return self
            adder = Adder(sim, CHUNK, running=len(self.running))
            batch, new = [], []
            fresh = [t for t in self.waiting if t.rid != chunked]
            if held and self.running:  # after a retraction: until a running request ends
                fresh = []
            order = [self.turns[chunked]] if chunked else []
            order += fresh
            prev, chunked = chunked, None
            for turn in order:
                req = self.state.get(turn.rid)
                if req is None:
                    if not sim.r2t.free_slots:  # every request slot taken: it waits
                        break
                    ask = self.asks.get(int(turn.rid[1 : turn.rid.index("t")]))
                    req = h.start(turn.rid, turn.prompt, ask, max_prefix=len(turn.prompt) - 1)
                    self.state[turn.rid] = req
                part = take_chunk(adder, req, turn.prompt, turn.rid == prev)
                if part is None:
                    chunked = turn.rid if turn.rid == prev else None  # parked, or not admitted
                    break
                batch.append(req)
                new.append(part)
                if len(req.tokens) + len(part) < len(turn.prompt):
                    chunked = turn.rid  # cut: the next batch continues it first
                    break
            if batch:
                evict(sim, sum(len(t) + W for t in new))
                self._forward(batch, new, extend=True)
                for req in batch:
                    # SGLang inserts a chunk, or a prefilled prompt that goes on decoding, into
                    # the tree (others match it; where the tree held the tokens already, the
                    # request's duplicates are freed and it reads the tree's windows)
                    req.get_fill_ids = lambda req=req: list(req.tokens)
                    if len(req.tokens) == len(self.turns[req.rid].prompt):
                        self.waiting.remove(self.turns[req.rid])
                        self.running.append(req)
                        self.generated[req.rid] = 1  # the prefill's logits give token 1
                        if self.turns[req.rid].max_new == 1:
                            self._finish(req, "length")
                            held = False
                        else:
                            sim.cache.cache_unfinished_req(req)
                    else:
                        sim.cache.cache_unfinished_req(req, chunked=True)
                continue
            held = self._decode(held)
        raise AssertionError(f"not done after {rounds} rounds: {len(self.waiting)} waiting")

    def _decode(self, held: bool) -> bool:
        sim, W = self.h.sim, self.h.sim.W

        def needed(_selected=None) -> int:  # SGLang's: a page for each request at a boundary
            return W * sum(len(r.tokens) % W == 0 for r in self.running)

        step = SimpleNamespace(
            token_to_kv_pool_allocator=sim.alloc, new_tokens_required_next_decode=needed
        )

        def slots(_self, selected_indices=None):  # SGLang's own check: logical slots
            evict(sim, needed())
            return sim.alloc.available_size() >= needed()

        # SGLang's retraction: the newest request back to the queue while the step does not
        # fit, always keeping one
        while len(self.running) > 1 and not plugin.check_decode_mem(slots, step):
            req = self.running.pop()
            retract(sim, req)
            del self.state[req.rid]
            self.waiting.appendleft(self.turns[req.rid])
            self.retracted, held = self.retracted + 1, True
        if not self.running:
            return held
        batch = list(self.running)
        self._forward(batch, [[(len(r.tokens) * 7) % 97 + 1] for r in batch], extend=False)
        for req in batch:
            turn = self.turns[req.rid]
            done = self.generated[req.rid]  # tokens generated before this step's
            self.generated[req.rid] = done + 1
            if turn.abort_at is not None and done - 1 >= turn.abort_at:
                self._finish(req, "abort")  # the client went away: SGLang finishes it
                held = False
            elif done + 1 >= turn.max_new:
                self._finish(req, "length")
                held = False
        return held


SMALL_ZONE = "rdkv+small-zone"  # rdkv whose Zone A store holds 16 KiB a layer: repacks find
# no room and the request reads what it held (zone_full_routings)


def harness(
    name: str, late: bool = False, rows: int | None = None, options: KVOptions | None = None
) -> Harness:
    """The policy on a pool of 80 windows' slots a layer: a few of the longest prompts, with
    the fewest full-precision rows a launch accepts or more (``sizing.check_rows``); ``rows``:
    that many windows of rows a layer instead. ``late``: SGLang's overlap scheduler runs, so a
    decode routing lands one step late (and is dropped for requests that finish, abort or are
    retracted before it lands). ``options``: the launch's ``--kv-*`` flags."""
    text = policy_text(name.replace("+small-zone", ""))
    policy = compile_text(text)
    W = Layout.of(policy).window
    kw = dict(policy=text, head_dim=HEAD_DIM, pages=max(80, 2400 // W), requests=SLOTS,
              overlap_schedule=late)  # fmt: skip
    b = plan_blocks(kw["pages"] * W, 2, HEAD_DIM, 2, policy, policy.budget)
    if rows is not None or b.full < 2 * min_row_windows(policy):
        b = PoolBlocks(2 * (rows or min_row_windows(policy)), b.quant, b.zone)  # 2 KV heads
    if name == SMALL_ZONE:
        b = PoolBlocks(b.full, b.quant, 1 << 14)
    return Harness(blocks=b, options=options, **kw)


@pytest.mark.parametrize("late", [False, True], ids=["serial", "late-landing"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", [*SHIPPED, ARCHIVED, SMALL_ZONE])
def test_a_rough_load_completes_and_gives_everything_back(name, seed, late, monkeypatch):
    monkeypatch.setattr(plugin, "route_stride", lambda: CHUNK, raising=False)
    check_rough_load(harness(name, late), name, seed)


@pytest.mark.parametrize("name", [*SHIPPED, ARCHIVED])
def test_a_rough_load_on_the_server_clock(name, monkeypatch):
    """``--kv-route-clock server`` (every running request routes at the server's every-N
    steps) under the same load, routings landing late: everything completes and comes back."""
    monkeypatch.setattr(plugin, "route_stride", lambda: CHUNK, raising=False)
    check_rough_load(harness(name, True, options=KVOptions(route_clock="server")), name, 2)


def check_rough_load(h: Harness, name: str, seed: int) -> None:
    """:class:`RoughLoad` of :func:`sessions` ``seed`` on ``h``: every turn finished (or
    aborted as planned), no routing over its budget, promotions explained, and once the tree's
    cache is dropped the allocator, blocks, Zone A bytes and reference counts as they were."""
    sim = h.sim
    free0, avail0 = sim.pool.blocks_free(), sim.alloc.available_size()
    zone0 = None if sim.pool.zones is None else sim.pool.zones.bytes_used()
    plan = sessions(seed)
    load = RoughLoad(h, plan).run()
    want = {f"s{s}t{k}" for s, turns in enumerate(plan) for k in range(len(turns))}
    assert set(load.finished) == want  # every turn of every session ran, in order
    aborted = {rid for rid, why in load.finished.items() if why == "abort"}
    assert aborted == {rid for rid in want if load.turns[rid].abort_at is not None}
    stats = h.backend.stats()
    assert stats["over_budget_routings"] == 0
    if name == SMALL_ZONE and seed == 1:  # this load's repacks outgrow 16 KiB
        assert stats["zone_full_routings"] > 0
    assert stats["promote"] <= stats["demote"] + stats["borrowed_quantized"]
    if name == "rdkv":  # rows for a quarter of the slots: paged windows gave theirs (5, 72)
        assert sim.pool.reclaimed["paged_windows_unrowed"] > 0
    assert sim.cache.views == {}  # every request's view closed
    evict(sim, 1 << 20)  # the tree's cache gives everything back
    assert sim.alloc.available_size() == avail0
    assert sim.pool.blocks_free() == free0
    assert bool((sim.pool.ref_all == 0).all()) and bool((sim.pool.owner_all == -1).all())
    if zone0 is not None:
        assert sim.pool.zones.bytes_used() == zone0


def test_a_deferred_prompt_longer_than_the_rows_is_prefilled_in_routed_pieces(monkeypatch):
    """qevict routes once after the whole prompt (``after_prefill(defer=true)``), so a prompt
    sits at full precision until then. One of more windows than the pool has row blocks, with
    nothing else running, used to fail the forward of the chunk that ran out of rows
    (``PoolFullError``, the scheduler gone). Now the request routes when a chunk's windows
    lack rows (``rows short``), its next chunk is cut to what that freed, and its last
    routing still waits for the whole prompt (``decode step 0``)."""
    monkeypatch.setattr(plugin, "route_stride", lambda: CHUNK, raising=False)
    h = harness("qevict", rows=9)
    W, rows = h.sim.W, h.sim.pool.windows_free()
    load = RoughLoad(h, [[((rows + 3) * W + 5, 4, None, 7)]]).run()
    assert load.finished == {"s0t0": "length"}
    reasons = load.routings["s0t0"]
    assert "rows short" in reasons and h.backend.stats()["rows_routings"] >= 1
    assert reasons[len(reasons) - reasons[::-1].index("rows short") :][0] == "decode step 0"
    assert not any(r.startswith("after prefill") for r in reasons)  # deferred, not per chunk


def test_a_replayed_decode_step_short_of_rows_routes_first(monkeypatch):
    """The same under decode CUDA graphs (the server's decode): a prompt that fills every row
    block, deferred, then a replayed step whose token opens a window. Its routing (due at this
    first decode step anyway) runs before the step's rows are taken, instead of the step's
    metadata failing."""
    from tiered_radix.adapters.sglang import backend

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(backend.decode, "run", lambda q, layout, plan, **kw: torch.zeros_like(q))
    policy = KERNEL_POLICY.replace("after_prefill, every(3)", "after_prefill(defer=true), every(3)")
    h = Harness(policy=policy, head_dim=64, pages=40, blocks=PoolBlocks(2 * 6, 64), context=256)
    assert h.sim.pool.windows_free() == 6
    h.backend.init_cuda_graph_state(1, 1)
    h.capture(1)
    req = h.start("a", [(5 * j) % 97 + 1 for j in range(6 * 16)])  # every row block
    h.step([req], [req.origin_input_ids], extend=True)
    assert h.sim.pool.windows_free() == 0
    for t in range(4):
        h.replay([req], [[60 + t]], 1)
        h.backend.flush()
    reasons = [e.reason for e in h.backend.sessions["a"].store.events.steps]
    assert reasons[0] == "rows short" and h.backend.stats()["rows_routings"] == 1
    assert h.sim.pool.windows_free() > 0


@pytest.mark.parametrize("graphs", [False, True])
def test_a_decode_steps_new_windows_are_held_while_it_lands_a_routing(monkeypatch, graphs):
    """What SGLang's decode check counted free stays free until the step's windows open: the
    step's metadata processes a replayed step before it (``flush``: its routing lands the one
    pending and plans the next) and may route for rows, both while the rows of the windows it
    opens are held from moves (``pool.rows_held``), eagerly and as a graph replay (an eager
    step's own routing lands at its last layer, after its windows opened). Two requests, one of
    whose next token opens a window: held for 1."""
    from tiered_radix.adapters.sglang import backend

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(backend.decode, "run", lambda q, layout, plan, **kw: torch.zeros_like(q))
    h = Harness(policy=KERNEL_POLICY, head_dim=64, pages=40, context=256)
    W, pool = h.sim.W, h.sim.pool
    if graphs:
        h.backend.init_cuda_graph_state(2, 2)
        h.capture(2)
    reqs = [h.start("a", [(5 * j) % 97 + 1 for j in range(2 * W)]),  # next token: a new window
            h.start("b", [(3 * j) % 89 + 1 for j in range(2 * W + 3)])]  # fmt: skip
    h.step(reqs, [r.origin_input_ids for r in reqs], extend=True)
    events, flush, rows_held, open_windows = [], h.backend.flush, pool.rows_held, pool.open_windows

    @contextlib.contextmanager
    def spy_held(windows):
        events.append(("hold", windows))
        with rows_held(windows):
            yield
        events.append("release")

    def spy(name, fn):
        def call(*a, **k):
            events.append(name)
            return fn(*a, **k)

        return call

    monkeypatch.setattr(pool, "rows_held", spy_held)
    monkeypatch.setattr(pool, "open_windows", spy("open", open_windows))
    monkeypatch.setattr(h.backend, "flush", spy("flush", flush))
    if graphs:
        h.replay(reqs, [[60], [61]], 2)
    else:
        h.step(reqs, [[60], [61]], extend=False)
    assert events == [("hold", 1), "flush", "open", "release"]
    assert h.sim.cache.views["a"].windows.numel() == 3  # the new window opened


def test_a_rough_load_of_per_request_budgets_and_policies(monkeypatch):
    """The same load on a launch serving two policies (``--kv-policy qevict --kv-policies
    examples/qevict_full70.yaml``), each session asking for one of them at its own budget (5% to
    50%; some ask nothing: the launch's): sessions at different budgets borrow each other's
    cached prefixes. Everything completes and comes back, no routing over its budget."""
    from test_request_kv import launch

    monkeypatch.setattr(plugin, "route_stride", lambda: CHUNK, raising=False)
    root = Path(__file__).parents[3]
    texts = [(root / f).read_text() for f in ("policies/qevict.yaml",
                                                 "examples/qevict_full70.yaml")]  # fmt: skip
    h = Harness(policy=texts[0], kv=launch(*texts), head_dim=HEAD_DIM, pages=200, requests=SLOTS)
    sim = h.sim
    free0, avail0 = sim.pool.blocks_free(), sim.alloc.available_size()
    plan = sessions(3)
    rng = random.Random(3)
    asks = {}
    for s in range(len(plan)):
        ask = {"kv_budget": rng.choice(("5%", "10%", "25%", "50%"))}
        if rng.random() < 0.5:
            ask["kv_policy"] = rng.choice(("qevict", "qevict-full70"))
        if rng.random() < 0.8:
            asks[s] = ask
    assert len({tuple(sorted(a.items())) for a in asks.values()}) > 3
    load = RoughLoad(h, plan, asks).run()
    assert len(load.finished) == sum(len(t) for t in plan)
    stats = h.backend.stats()
    assert stats["over_budget_routings"] == 0
    assert stats["promote"] <= stats["demote"] + stats["borrowed_quantized"]
    evict(sim, 1 << 20)
    assert sim.alloc.available_size() == avail0 and sim.pool.blocks_free() == free0
    assert bool((sim.pool.ref_all == 0).all()) and bool((sim.pool.owner_all == -1).all())


def test_a_decode_step_short_of_rows_routes_the_held_back_prompt(monkeypatch):
    """A request decodes into a new window while the rows are full of another request's
    prompt, chunked and held back this round (parked: its routing waits for its last chunk).
    SGLang keeps its last running request, so the step must find rows: the held-back prompt
    routes (``rows short``), not only the batch's request, whose own tokens are all protected."""
    monkeypatch.setattr(plugin, "route_stride", lambda: CHUNK, raising=False)
    h = harness("qevict", rows=9)  # the fewest a launch accepts: two requests' protection + 1
    load = RoughLoad(h, [[(30, 12, None, 3)], [(300, 2, None, 5)]]).run()
    assert set(load.finished.values()) == {"length"}
    assert load.routings["s1t0"].count("rows short") >= 1


def test_a_step_short_of_rows_lands_the_pending_routing_before_it_routes_again(monkeypatch):
    """Under the overlap scheduler a replayed step's routing is planned at the next step's
    metadata and stays pending there; when that step's new window then finds no free rows, the
    rows-short routing of the same request lands the pending one first (a store takes no
    routing while its own is pending), so both move, in order. Here the deferred first routing
    (decode step 0) is pending when step 1's token opens a window the full rows cannot hold."""
    from tiered_radix.adapters.sglang import backend

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(backend.decode, "run", lambda q, layout, plan, **kw: torch.zeros_like(q))
    policy = KERNEL_POLICY.replace("after_prefill, every(3)", "after_prefill(defer=true), every(3)")
    h = Harness(policy=policy, head_dim=64, pages=40, blocks=PoolBlocks(2 * 6, 64), context=256,
                overlap_schedule=True)  # fmt: skip
    h.backend.init_cuda_graph_state(1, 1)
    h.capture(1)
    req = h.start("a", [(5 * j) % 97 + 1 for j in range(6 * 16 - 1)])  # every row block
    h.step([req], [req.origin_input_ids], extend=True)
    assert h.sim.pool.windows_free() == 0
    h.replay([req], [[60]], 1)  # step 0: its token fills the last window; its routing is due
    h.replay([req], [[61]], 1)  # step 1's metadata: step 0's routing pending, then rows short
    reasons = [e.reason for e in h.backend.sessions["a"].store.events.steps]
    assert reasons[:2] == ["decode step 0", "rows short"], reasons
    assert h.backend.landing is None and h.sim.pool.windows_free() > 0
    assert h.backend.stats()["rows_routings"] == 1
