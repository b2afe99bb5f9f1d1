"""``TieredRadixCache``: SGLang's radix cache over a :class:`~.pool.TieredKVPool`, with per-request
views of refcounted window representations (design 2 of shared/notes/prefix-sharing.md).

Who holds what (see :mod:`.reps` for representations and states):

- The *owner* of a window is whoever owns its slots in SGLang's allocator: the request that
  allocated them, and after ``insert`` the tree (the request keeps driving the owner state until
  it finishes, so a chunked prompt inserted mid-flight still shrinks when it is routed). The
  owner's state lives in ``pool.owner``; the tree caches exactly the state its last driver left.
- A request that matched a prefix *borrows* those windows: :meth:`open_view` takes one reference
  per representation at the tree's state, and the request's own routing then moves only its own
  references. Nobody else's routing touches them, so what a request reads depends only on its
  prompt, the precision at which the matched prefix was cached, its policy and its scores.
- When slots go back to the allocator (radix eviction, duplicates at insert, aborts, retraction:
  every path ends in the allocator's page release), the pool drops the owner's references
  (:meth:`_attach`); representations are freed when nobody holds them.

Engine units map to windows in sequence order: unit ``u`` of a request is window
``req_to_token[req, u * W] // W``.

Per request (:mod:`.request_kv`): when SGLang matches a request's prefix the cache reads the
request's ``kv_policy`` / ``kv_budget`` from its sampling parameters (:meth:`request_kv` gives
them to the attention backend, which builds the request's tier engine with them); a view counts
its routings and the moves the pool made for it, and when the request finishes its usage, read
from the pool (:mod:`.usage`), goes into the response (``meta_info["kv_usage"]``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from torch import Tensor

from tiered_radix.engine.events import Transitions
from tiered_radix.engine.routing import to_device, total_budget
from tiered_radix.policy.model import Policy

from . import usage
from .config import KVConfig
from .pool import TieredKVPool
from .reps import S_EVICT, STATES, Layout, PoolConfigError, Q, R, lent
from .request_kv import RequestError, RequestKV, resolve

log = logging.getLogger(__name__)


@dataclass
class RequestView:
    """One request's windows: ``windows`` int64 ``[n]`` in sequence order, ``borrowed`` bool
    ``[n]`` (read through the request's own references), ``state`` int8 ``[L, H, n]`` (the
    request's state of borrowed windows; owned windows read ``pool.owner_all``);
    ``n_borrowed`` how many are borrowed (a host count: routing needs no read of ``borrowed``
    to know that the request shares no window); ``paged`` (decoupled layouts) those its pages
    cover; ``moved`` int64 ``[3]`` the moves its routings made (:func:`.usage.moves_of`),
    ``routes`` their count; ``remaps`` how often an insert replaced some of its windows by the
    tree's (:meth:`TieredRadixCache.cache_unfinished_req`): index lists built before a remap
    name rows that SGLang freed as duplicates."""

    windows: Tensor
    borrowed: Tensor
    state: Tensor
    n_borrowed: int = 0
    # decoupled layouts: windows the request's Zone A pages cover whole (bool [n], page_out):
    # it reads none of their rows, and holds no reference to a borrowed one's
    paged: Tensor | None = None
    routes: int = 0
    remaps: int = 0
    # the routings' move counts not summed yet: (int64 [R, 3] of R requests routed together,
    # this request's row); summed when read, so a routing adds none of its own ops per request
    moves: list[tuple[Tensor, int]] = field(default_factory=list)

    def count_moves(self, sums: Tensor, row: int) -> None:
        """A routing's moves of this request: row ``row`` of ``sums`` (int64 ``[R, 3]``)."""
        self.moves.append((sums, row))
        if len(self.moves) > 64:  # bounded: a long request's earlier routings summed
            self.moves = [(self.moved[None], 0)]

    @property
    def moved(self) -> Tensor | None:
        """int64 ``[3]``: the moves its routings made (:func:`.usage.moves_of`), or None."""
        if not self.moves:
            return None
        return torch.stack([s[r] for s, r in self.moves]).sum(0)


class _Moves(NamedTuple):
    """Request ``rid``'s transitions as holder moves: pairs ``(ly, h, w)`` (unit ``u``;
    ``b``: borrowed, ``None`` where the request borrows no window) to engine tier ``dst``."""

    rid: str
    view: RequestView
    ly: Tensor
    h: Tensor
    u: Tensor
    w: Tensor
    b: Tensor | None
    dst: Tensor


class Settled(NamedTuple):
    """Units of request ``rid`` that a routing may have left in another holder state than
    planned (the pool was short of blocks, :meth:`~.pool.TieredKVPool.move`): ``(ly, h, u)``
    int64 ``[m]`` each, the state each reached, and ``off`` (bool ``[m]``) those that did."""

    rid: str
    ly: Tensor
    h: Tensor
    u: Tensor
    state: Tensor
    off: Tensor


class TieredRadixCache(RadixCache):
    """Raises:
    PoolConfigError: the allocator's pool is not a :class:`TieredKVPool` for this policy."""

    def __init__(self, params, *, policy: Policy, kv: KVConfig | None = None) -> None:
        # the launch's policies and defaults, for each request's kv_policy / kv_budget
        self.kv = kv or KVConfig(policy.name, None, policy, policy.budget)
        self.asked: dict[str, RequestKV] = {}  # requests that named a policy or budget
        super().__init__(params)
        pool = self.token_to_kv_pool_allocator.get_kvcache()
        if not isinstance(pool, TieredKVPool):
            raise PoolConfigError(f"the tiered radix cache needs a TieredKVPool, got {type(pool)}")
        self.pool, self.layout, self.policy = pool, Layout.of(policy), policy
        self.decoupled = self.layout.tier_bits is not None  # RDKV: requests repack (.zones)
        self.views: dict[str, RequestView] = {}
        # decoupled layouts: requests' matched prefixes not borrowed yet (match_prefix to
        # open_view), which the pool's row reclaim spares; and whether SGLang's own re-match
        # inside cache_unfinished_req runs (it must see the whole inserted key)
        self._matched: dict[str, tuple[object, Tensor]] = {}
        self._inserting = False
        # the attention backend's pending work on the views (a replayed decode step's routing),
        # given the ids of the requests whose views close next
        self._before_close: Callable[[list[str]], None] | None = None
        self._after_reset: Callable[[], None] | None = None  # the backend's, after reset()
        n_tiers = len(self.layout.engine_tiers)
        self._next = None  # decoupled windows never move: their requests repack (.zones)
        if not self.decoupled:  # [borrower?, holder state, engine tier] -> the next
            self._next = torch.tensor(
                [
                    [[self.layout.next_state(st, t, owner) for t in range(n_tiers)]
                     for st in STATES]
                    for owner in (True, False)
                ],
                dtype=torch.long,
                device=pool.device,
            )  # fmt: skip
        pool.attach_tree(self)  # the attention backend (same scheduler process) finds us there
        self._attach(self.token_to_kv_pool_allocator)

    def connect(self, before_close: Callable[[list[str]], None], after_reset: Callable[[], None]):
        """The attention backend's hooks: ``before_close(rids)``, its pending work on the views
        of requests about to close (a replayed decode step's routing), and ``after_reset()``,
        after :meth:`reset` emptied the tree."""
        self._before_close, self._after_reset = before_close, after_reset

    def _attach(self, alloc) -> None:
        """Every page the allocator takes back first releases its owner's representations."""
        if hasattr(alloc, "_release_page_ids"):  # paged allocator: all frees end here
            release = alloc._release_page_ids

            def release_pages(*page_ids: Tensor) -> None:
                self.pool.release_pages(torch.cat([p.flatten() for p in page_ids]))
                release(*page_ids)

            alloc._release_page_ids = release_pages
        else:  # page size 1: slot == page
            free = alloc.free

            def free_slots(index: Tensor) -> None:
                if alloc.is_not_in_free_group and index.numel():
                    self.pool.release_pages(index)
                free(index)

            alloc.free = free_slots

    # -- per-request policy and budget ------------------------------------------------------
    def match_prefix(self, params):
        """SGLang's match; a request matched with its ``Req`` (every time it is scheduled)
        also gives its ``kv_policy`` / ``kv_budget`` (:meth:`request_kv`). In a decoupled
        layout the match ends before the first window whose rows the pool took
        (:meth:`~.pool.TieredKVPool._unrow_paged`): matched again on the key cut there, so
        SGLang splits the node and the request prefills from that window on, exactly; and a
        request's matched windows are spared by the pool's row reclaim until it borrows them
        (:meth:`matched_windows`)."""
        req = getattr(params, "req", None)
        if req is not None:
            self._note(req)
        got = super().match_prefix(params)
        if not self.decoupled or self._inserting:
            return got
        if self.pool.rows_taken() and len(got.device_indices):
            w = self._prefix_windows(got.device_indices)
            rowless = self.pool.without_rows(w)
            first = int(torch.cat([rowless, rowless.new_ones(1)]).int().argmax())  # host sync
            if first < w.numel():
                key = params.key
                cut = RadixKey(key.token_ids, key.extra_key, key.is_bigram, first * self.page_size)
                got = super().match_prefix(dataclasses.replace(params, key=cut))
        if req is not None and len(got.device_indices):
            self._matched[req.rid] = (req, self._prefix_windows(got.device_indices))
        elif req is not None:
            self._matched.pop(req.rid, None)
        return got

    def _prefix_windows(self, indices: Tensor) -> Tensor:
        """The windows of a matched prefix's slots (page aligned), on the pool's device."""
        return (indices[:: self.layout.window].long() // self.layout.window).to(self.pool.device)

    def matched_windows(self) -> Tensor:
        """Windows of prefixes matched for requests that have not borrowed them yet (a
        finished or aborted request's entry is dropped here): int64 ``[m]``, maybe repeated."""
        for rid, (req, _) in list(self._matched.items()):
            finished = getattr(req, "finished", None)
            if callable(finished) and finished():
                del self._matched[rid]
        parts = [w for _, w in self._matched.values()]
        dev = self.pool.device
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=dev)

    def _note(self, req) -> None:
        sp = getattr(req, "sampling_params", None)
        try:  # checked when the request arrived (plugin: 400); a bad value here keeps defaults
            kv = resolve(getattr(sp, "custom_params", None), self.kv)
        except RequestError as err:
            log.error("tiered-radix: request %s: %s; serving it with the launch's", req.rid, err)
            return
        if kv.asked:
            self.asked[req.rid] = kv
        else:
            self.asked.pop(req.rid, None)

    def request_kv(self, rid: str) -> RequestKV:
        """The policy and budget request ``rid`` runs with: its own, or the launch's."""
        kv = self.asked.get(rid)
        if kv is None:
            kv = RequestKV(self.kv.policy, self.kv.budget, False)
        return kv

    def usage(self, rid: str, n_tokens: int) -> dict | None:
        """Request ``rid``'s KV usage now (:func:`.usage.report`), its first ``n_tokens``
        tokens; ``None`` without a view. One host sync."""
        view = self.views.get(rid)
        if view is None:
            return None
        kv, pool = self.request_kv(rid), self.pool
        budget = total_budget(kv.budget, [n_tokens] * pool.layer_num, pool.head_num, pool.head_dim)
        n = -(-n_tokens // self.layout.window)
        if pool.zones is not None:  # decoupled: its pages, and the rows it reads outside them
            placed = pool.zones.placed_layers(rid)
            rows = n - int(view.paged[:n].sum()) if placed else n
            return usage.report_pages(pool, placed, rows, n_tokens, view.routes, budget,
                                      kv.describe())  # fmt: skip
        states = self.states_all(rid)[:, :, :n]
        return usage.report(pool, states, n_tokens, view.moved, view.routes, budget,
                            kv.describe())  # fmt: skip

    def _report(self, req, n_tokens: int) -> None:
        """The finished request's usage into SGLang's per-token ``customized_info`` (its last
        output token's entry), which SGLang sends with the output as ``meta_info["kv_usage"]``
        (the plugin turns SGLang's per-token list back into the one report)."""
        out = len(getattr(req, "output_ids_through_stop", None) or req.output_ids or [])
        # the KV its tokens needed: the prompt's and every output token's but the last, whose
        # KV SGLang's overlap loop writes only where it ran the request a step past its end
        # (alone, not when a prefill came next in a batch): the report is the same either way
        needed = len(req.origin_input_ids) + out - 1
        report = self.usage(req.rid, min(n_tokens, needed)) if out else None
        if report is None:
            return
        info = dict(getattr(req, "customized_info", None) or {})
        info[usage.KEY] = [None] * (out - 1) + [report]
        req.customized_info = info

    # -- views -----------------------------------------------------------------------------
    def _windows(self, req, start: int, end: int) -> Tensor:
        W = self.layout.window
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        return (row[start:end:W].long() // W).to(self.pool.device)

    def open_view(self, req, prefix_len: int) -> RequestView:
        """Borrow the matched prefix (``req_to_token[req, :prefix_len]``, page aligned)."""
        assert prefix_len % self.layout.window == 0
        self._matched.pop(req.rid, None)
        decoupled = self.decoupled
        if prefix_len == 0:  # nothing matched, nothing to borrow: no device work
            dev, L, H = self.pool.device, self.pool.layer_num, self.pool.head_num
            w = torch.empty(0, dtype=torch.long, device=dev)
            st = self.pool.owner_all.new_empty(L, H, 0)
            none = torch.empty(0, dtype=torch.bool, device=dev)
            view = RequestView(w, none, st, paged=none.clone() if decoupled else None)
            self.views[req.rid] = view
            return view
        w = self._windows(req, 0, prefix_len)
        st = lent(self.pool.owner_all[:, :, w])  # [L, H, n]; an archived window quantized
        torch._assert_async((st >= 0).all(), "borrowing a window nobody owns")
        if decoupled:
            torch._assert_async((st != S_EVICT).all(), "borrowing a window without rows")
        self.pool.acquire(*self.pool.pairs(w), st.flatten())
        none = torch.zeros_like(w, dtype=torch.bool)
        view = RequestView(w, ~none, st, w.numel(), paged=none if decoupled else None)
        self.views[req.rid] = view
        return view

    def sync_view(self, req, n_tokens: int) -> RequestView:
        """Append the request's own windows up to ``n_tokens`` (after its KV was written)."""
        view = self.views[req.rid]
        W, n = self.layout.window, view.windows.numel()
        if n_tokens <= n * W:  # most decode steps: the last window is not full yet
            return view
        new = self._windows(req, n * W, n_tokens)  # at least one window
        H = self.pool.head_num
        view.windows = torch.cat([view.windows, new])
        view.borrowed = torch.cat([view.borrowed, torch.zeros_like(new, dtype=torch.bool)])
        if view.paged is not None:
            view.paged = torch.cat([view.paged, torch.zeros_like(new, dtype=torch.bool)])
        L = self.pool.layer_num
        view.state = torch.cat([view.state, view.state.new_full((L, H, new.numel()), -1)], 2)
        return view

    def cold_windows(self) -> Iterator[Tensor]:
        """The windows of every cached prefix that no running request holds (nodes with no
        lock), one int64 tensor a node, in the order SGLang's eviction strategy would take them
        (least recently used first, for the default): what the pool demotes to the ledger
        before it evicts prefixes for rows (:meth:`.pool.TieredKVPool.rows_for_windows`)."""
        nodes, stack = [], list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.lock_ref == 0 and len(node.value):
                nodes.append(node)
        nodes.sort(key=self.eviction_strategy.get_priority)
        W, dev = self.layout.window, self.pool.device
        return ((n.value[::W].long() // W).to(dev) for n in nodes)  # read as far as needed

    def states(self, rid: str, layer_id: int) -> Tensor:
        """int8 ``[H, n]``: how request ``rid`` reads each of its windows in ``layer_id``."""
        view = self.views[rid]
        li = layer_id - self.pool.start_layer
        return torch.where(view.borrowed, view.state[li], self.pool.owner[li][:, view.windows])

    def states_all(self, rid: str) -> Tensor:
        """int8 ``[L, H, n]``: :meth:`states` of every layer."""
        view = self.views[rid]
        return torch.where(view.borrowed, view.state, self.pool.owner_all[:, :, view.windows])

    def read(self, rid: str, layer_id: int) -> tuple[Tensor, Tensor, Tensor]:
        """What request ``rid`` attends to: float32 ``k, v [H, n*W, d]``, ``kept [H, n*W]``."""
        return self.pool.read(layer_id, self.views[rid].windows, self.states(rid, layer_id))

    def read_live(self, rid: str, layer_id: int, n_tokens: int):
        """:meth:`read` of the windows request ``rid`` reads in some head (its first ``n_tokens``
        tokens), with each row's token position: see :meth:`.pool.TieredKVPool.read_live`."""
        view = self.views[rid]
        return self.pool.read_live(layer_id, view.windows, self.states(rid, layer_id), n_tokens)

    def route(self, rid: str, transitions: Transitions) -> list[Settled]:
        """Apply the tier engine's transitions (unit ``u`` = the request's ``u``-th window)."""
        return self.route_many([(rid, transitions)])

    def route_many(self, routed: list[tuple[str, Transitions]]) -> list[Settled]:
        """:meth:`route` of several requests at once: their moves go to the pool in one
        :meth:`~.pool.TieredKVPool.move`. A window two of them hold (a shared prefix) moves
        once per holder in request order, as one route after the other would (the pool's
        pairs of one move are unique: repeats go to later rounds; one host sync to count
        them). Holders take the states the pool reached: where it was short of blocks and
        degraded a move, the returned :class:`Settled` list says which units of which request
        ended elsewhere than planned (as masks: no host sync), so their engines learn. It is
        empty where the host's bounds of the free blocks show that no layer can be short
        (:meth:`~.pool.TieredKVPool.short_possible`).

        Requests that borrow no window (``n_borrowed``, a host count) are gathered, looked up
        and written back together (their pairs are all owner moves); only borrowers' pairs
        read and write their own view's states per request."""
        dev = self.pool.device
        for rid, _ in routed:
            self.views[rid].routes += 1
        live = [(rid, t) for rid, t in routed if len(t)]
        if not live:
            return []
        views = [self.views[rid] for rid, _ in live]
        ly, h, u, dst, which = Transitions.gather([t for _, t in live], dev,
                                                  "layer", "head", "unit", "dst")  # fmt: skip
        sizes = [len(t) for _, t in live]
        if len(live) == 1:
            w = views[0].windows[u]
        else:  # each pair's window: its request's u-th, all requests' windows side by side
            starts = list(itertools.accumulate([v.windows.numel() for v in views], initial=0))
            w = torch.cat([v.windows for v in views])[u + to_device(starts[:-1], dev)[which]]
        parts = [
            _Moves(rid, v, *cols, v.borrowed[cols[2]] if v.n_borrowed else None, d)
            for (rid, _), v, *cols, d in zip(
                live, views, *(x.split(sizes) for x in (ly, h, u, w, dst)), strict=True
            )
        ]
        if self.layout.archive:  # archived copies yield to the copies this routing makes
            lay = self.layout
            copies = (dst == lay.quant_index) | (dst == lay.evict_index)
            bound = sum(ly.numel() if t.written is None else t.written for _, t in routed)
            self.pool.reclaim_ledger(ly, h, w, copies, bound)
        old = self.pool.owner_all[ly, h, w]
        borrowed = 0  # or [m]: borrowed pairs move by the borrower's table (never archive)
        if any(p.b is not None for p in parts):  # borrowed pairs: the view's states
            split = zip(parts, old.split(sizes), strict=True)
            old = torch.cat([self._holder_old(p, o) for p, o in split])
            own = [torch.zeros_like(p.u, dtype=torch.bool) if p.b is None else p.b for p in parts]
            borrowed = torch.cat(own).long()
        new = self._next[borrowed, old.long(), dst].to(old.dtype)
        # a ledger copy is made only where the engine writes one, restored rows only where it
        # promotes (host counts, the pairs' number where unknown): at most that many blocks
        m, ts = ly.numel(), [t for _, t in routed]
        make = {Q: sum(m if t.written is None else t.written for t in ts),
                R: sum(m if t.promoted is None else t.promoted for t in ts)}  # fmt: skip
        short = self.pool.short_possible(make)  # host bounds: no wait
        got = new.long()
        for sel in self._rounds(parts, ly, h, w):
            if sel is None:
                got = self.pool.move(ly, h, w, old, new, make=make)
            else:
                got[sel] = self.pool.move(ly[sel], h[sel], w[sel], old[sel], new[sel], make=make)
        reached = got.to(new.dtype)
        self._record(parts, ly, h, w, old, reached, sizes, which)
        if not short:
            return []
        off = reached != new  # the pool may have been short of blocks: masks of where
        each = zip(parts, reached.split(sizes), off.split(sizes), strict=True)
        return [Settled(p.rid, p.ly, p.h, p.u, r, o) for p, r, o in each]

    def _holder_old(self, p: _Moves, owner_old: Tensor) -> Tensor:
        """The states request ``p`` holds its pairs at: the view's for borrowed windows, the
        owner's (``owner_old``) for its own."""
        if p.b is None:
            return owner_old
        return torch.where(p.b, p.view.state[p.ly, p.h, p.u], owner_old)

    def _record(self, parts: list[_Moves], ly, h, w, old, reached, sizes: list[int],
                which: Tensor) -> None:  # fmt: skip
        """The states the pool reached (``reached``, over the concatenated pairs) become each
        holder's: owner states in one write for requests that borrow nothing, per request
        (in request order) for borrowers; each view counts its moves (:func:`.usage.moves_of`,
        summed per request)."""
        owner = self.pool.owner_all
        each = list(zip(parts, reached.split(sizes), strict=True))
        if not any(p.b is not None for p in parts):
            owner[ly, h, w] = reached  # every pair is its owner's, none twice
        else:
            for p, r in each:
                if p.b is None:
                    owner[p.ly, p.h, p.w] = r
                    continue
                p.view.state[p.ly, p.h, p.u] = torch.where(p.b, r, p.view.state[p.ly, p.h, p.u])
                owner[p.ly, p.h, p.w] = torch.where(p.b, owner[p.ly, p.h, p.w], r)
        flags = usage.move_flags(old, reached)  # [m, 3]
        sums = flags.new_zeros(len(parts), 3).index_add_(0, which, flags)  # per request
        for k, p in enumerate(parts):
            p.view.count_moves(sums, k)

    def _rounds(self, parts: list, ly: Tensor, h: Tensor, w: Tensor) -> list[Tensor | None]:
        """Index sets of the concatenated pairs with no pair twice, each pair's holders in
        request order; ``[None]`` (all at once) where no request borrows a window (a window
        has one holder among them then; the host knows it without a sync)."""
        if len(parts) == 1 or not any(p.view.n_borrowed for p in parts):
            return [None]
        key = (ly * self.pool.head_num + h) * self.pool.owner_all.shape[2] + w
        sk, order = torch.sort(key, stable=True)
        pos = torch.arange(key.numel(), device=key.device)
        start = torch.ones_like(sk, dtype=torch.bool)
        start[1:] = sk[1:] != sk[:-1]
        first = torch.cummax(torch.where(start, pos, 0), 0).values
        nth = torch.empty_like(pos).scatter_(0, order, pos - first)  # holder's rank on the pair
        rounds = int(nth.max()) + 1  # host sync
        return [None] if rounds == 1 else [(nth == r).nonzero().squeeze(1) for r in range(rounds)]

    def page_out(self, rid: str, covered: Tensor) -> None:
        """A decoupled request's routing placed pages that cover its windows ``covered`` (bool
        ``[n]`` over its view, :meth:`~.pool.TieredKVPool.repack`): it reads none of their rows
        from now on. It releases its reference to those it borrowed (a window only the tree holds
        then may lose its rows under pressure, :meth:`~.pool.TieredKVPool._unrow_paged`), and
        those it owns are marked paged in the pool (the tree that caches them keeps their rows
        until then). Later routings read covered windows from their pages too (Zone A repacks
        what the request reads). Counted in the view's routings. One host sync."""
        view = self.views[rid]
        view.routes += 1  # a decoupled request's routings are its repacks that landed
        new = covered[: view.windows.numel()] & ~view.paged
        lend = (new & view.borrowed).nonzero().squeeze(1)
        if lend.numel():
            w = view.windows[lend]
            self.pool.release(*self.pool.pairs(w), view.state[:, :, lend].flatten())
            view.state[:, :, lend] = S_EVICT
        self.pool.mark_paged(view.windows[new & ~view.borrowed])
        view.paged = view.paged | new

    def close_view(self, rid: str) -> None:
        """Release the request's borrowed references (owned windows stay with their owner) and
        a decoupled request's Zone A pages; its own windows are then read by nobody but their
        borrowers (decoupled: paged, their rows free to go once only the tree holds them)."""
        self.asked.pop(rid, None)
        self._matched.pop(rid, None)
        self.pool.drop_request(rid)
        view = self.views.pop(rid, None)
        if view is None:
            return
        w = view.windows[view.borrowed]
        self.pool.release(*self.pool.pairs(w), view.state[:, :, view.borrowed].flatten())
        if view.paged is not None:
            self.pool.mark_paged(view.windows[~view.borrowed])

    # -- SGLang entry points ---------------------------------------------------------------
    def cache_finished_req(self, req, is_insert: bool = True, *, kv_len_to_handle: int):
        if self._before_close is not None:
            self._before_close([req.rid])
        self._report(req, kv_len_to_handle)
        self.close_view(req.rid)
        return super().cache_finished_req(req, is_insert, kv_len_to_handle=kv_len_to_handle)

    def cache_unfinished_req(self, req, chunked=False):
        view = self.views.get(req.rid)
        self._inserting = True  # SGLang re-matches the inserted key: all of it
        try:
            super().cache_unfinished_req(req, chunked)
        finally:
            self._inserting = False
        if view is None:
            return
        # Duplicates of a tree prefix were freed and replaced by the tree's slots: borrow those
        # (a window the request's pages cover it reads from them: no reference).
        now = self._windows(req, 0, view.windows.numel() * self.layout.window)
        moved = (now != view.windows) & ~view.borrowed
        if bool(moved.any()):
            st = self.pool.owner_all[:, :, now[moved]]
            if view.paged is not None:
                st = torch.where(view.paged[moved], S_EVICT, st).to(st.dtype)
            self.pool.acquire(*self.pool.pairs(now[moved]), st.flatten())
            view.state[:, :, moved] = st
            view.windows, view.borrowed = now, view.borrowed | moved
            view.n_borrowed = int(view.borrowed.sum())
            view.remaps += 1  # its duplicates' rows are freed: lists naming them are stale

    def insert(self, params):
        """SGLang's insert. In a decoupled layout where the pool took rows of cached windows, the
        tree's row-less windows on the inserted key first adopt the rows of the request's own
        windows for the same tokens (:meth:`~.pool.TieredKVPool.adopt_rows`), which SGLang
        then frees as duplicates: the prefix is cached with rows again, and every slot it frees
        is one the request allocated."""
        if self.decoupled and self.pool.rows_taken() and params.value is not None:
            had = super().match_prefix(MatchPrefixParams(key=params.key))  # SGLang's, uncut
            n = min(len(had.device_indices), len(params.value))
            if n:
                W = self.layout.window
                tree = had.device_indices[:n:W].long() // W
                mine = params.value[:n:W].long() // W
                self.pool.adopt_rows(tree.to(self.pool.device), mine.to(self.pool.device))
        return super().insert(params)

    def reset(self) -> None:
        """Empty the tree (SGLang's ``flush_cache``, and ``__init__``). SGLang then clears the
        allocator, which frees no page through it: the windows the tree held are given back to
        the pool here, or pages handed out again would find them owned (routed ones fail the
        pool's write check; full ones keep their rows forever)."""
        if getattr(self, "_before_close", None) is not None:
            self._before_close(list(getattr(self, "views", {})))
        for rid in list(getattr(self, "views", {})):
            self.close_view(rid)
        # SGLang flushes only when idle: no request waits with the settings it asked for (a
        # request aborted while waiting leaves its entry until here)
        getattr(self, "asked", {}).clear()
        getattr(self, "_matched", {}).clear()
        pool = getattr(self, "pool", None)
        if pool is not None:  # windows opened in every layer and head: layer 0, head 0 says
            owned = (pool.owner_all[0, 0] >= 0).nonzero().squeeze(1)
            if owned.numel():
                pool.release_pages(owned)
        super().reset()
        if getattr(self, "_after_reset", None) is not None:
            self._after_reset()
