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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from sglang.srt.mem_cache.radix_cache import RadixCache
from torch import Tensor

from tiered_radix.engine.events import Transitions
from tiered_radix.policy.model import Policy

from .pool import TieredKVPool
from .reps import Layout, PoolConfigError


@dataclass
class RequestView:
    """One request's windows: ``windows`` int64 ``[n]`` in sequence order, ``borrowed`` bool
    ``[n]`` (read through the request's own references), ``state`` int8 ``[L, H, n]`` (the
    request's state of borrowed windows; owned windows read ``pool.owner_all``)."""

    windows: Tensor
    borrowed: Tensor
    state: Tensor


class _Moves(NamedTuple):
    """Request ``rid``'s transitions as holder moves: pairs ``(ly, h, w)`` (unit ``u``;
    ``b``: borrowed) from state ``old`` to ``new``."""

    rid: str
    view: RequestView
    ly: Tensor
    h: Tensor
    u: Tensor
    w: Tensor
    b: Tensor
    old: Tensor
    new: Tensor


class Settled(NamedTuple):
    """Units of request ``rid`` that a routing left in another holder state than planned
    (the pool was short of blocks, :meth:`~.pool.TieredKVPool.move`): ``(ly, h, u)`` int64
    ``[m]`` each, and the state each reached."""

    rid: str
    ly: Tensor
    h: Tensor
    u: Tensor
    state: Tensor


class TieredRadixCache(RadixCache):
    """Raises:
    PoolConfigError: the allocator's pool is not a :class:`TieredKVPool` for this policy."""

    def __init__(self, params, *, policy: Policy) -> None:
        super().__init__(params)
        pool = self.token_to_kv_pool_allocator.get_kvcache()
        if not isinstance(pool, TieredKVPool):
            raise PoolConfigError(f"the tiered radix cache needs a TieredKVPool, got {type(pool)}")
        self.pool, self.layout, self.policy = pool, Layout.of(policy), policy
        self.views: dict[str, RequestView] = {}
        # the attention backend's pending work on the views (a replayed decode step's routing)
        self.before_close: Callable[[], None] | None = None
        n_tiers = len(self.layout.engine_tiers)
        self._next = None  # decoupled windows never move: their requests repack (.zones)
        if self.layout.tier_bits is None:  # [holder state, engine tier] -> the next state
            self._next = torch.tensor(
                [[self.layout.next_state(st, t) for t in range(n_tiers)] for st in range(4)],
                dtype=torch.long,
                device=pool.device,
            )
        pool.tree = self  # the attention backend (same scheduler process) finds the views here
        self._attach(self.token_to_kv_pool_allocator)

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

    # -- views -----------------------------------------------------------------------------
    def _windows(self, req, start: int, end: int) -> Tensor:
        W = self.layout.window
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        return (row[start:end:W].long() // W).to(self.pool.device)

    def open_view(self, req, prefix_len: int) -> RequestView:
        """Borrow the matched prefix (``req_to_token[req, :prefix_len]``, page aligned)."""
        assert prefix_len % self.layout.window == 0
        w = self._windows(req, 0, prefix_len)
        st = self.pool.owner_all[:, :, w]  # [L, H, n]
        torch._assert_async((st >= 0).all(), "borrowing a window nobody owns")
        self.pool.acquire(*self._triples(w), st.flatten())
        view = RequestView(w, torch.ones_like(w, dtype=torch.bool), st)
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
        L = self.pool.layer_num
        view.state = torch.cat([view.state, view.state.new_full((L, H, new.numel()), -1)], 2)
        return view

    def _triples(self, w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Flat (layer, head, window) of every layer and head of windows ``w [n]``: ``[L*H*n]``
        each, in ``[L, H, n]`` order."""
        L, H, n, dev = self.pool.layer_num, self.pool.head_num, w.numel(), self.pool.device
        ly = torch.arange(L, device=dev)[:, None, None].expand(L, H, n)
        h = torch.arange(H, device=dev)[None, :, None].expand(L, H, n)
        return ly.flatten(), h.flatten(), w.expand(L, H, n).flatten()

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
        ended elsewhere than planned (empty otherwise: no host sync), so their engines learn."""
        dev, parts = self.pool.device, []
        for rid, t in routed:
            if not len(t):
                continue
            view = self.views[rid]
            ly, h, u, dst = t.on(dev, "layer", "head", "unit", "dst")
            w, b = view.windows[u], view.borrowed[u]
            old = torch.where(b, view.state[ly, h, u], self.pool.owner_all[ly, h, w])
            new = self._next[old.long(), dst].to(old.dtype)
            parts.append(_Moves(rid, view, ly, h, u, w, b, old, new))
        if not parts:
            return []
        ly, h, w, old, new = (
            torch.cat([getattr(p, f) for p in parts]) for f in "ly h w old new".split()
        )
        degraded = self.pool.degraded
        got = new.long()
        for sel in self._rounds(parts, ly, h, w):
            if sel is None:
                got = self.pool.move(ly, h, w, old, new)
            else:
                got[sel] = self.pool.move(ly[sel], h[sel], w[sel], old[sel], new[sel])
        short = self.pool.degraded != degraded
        owner, settled, at = self.pool.owner_all, [], 0
        for p in parts:  # in request order, like route after route
            reached = got[at : at + p.new.numel()].to(p.new.dtype)
            at += p.new.numel()
            if short and bool((reached != p.new).any()):  # host sync only after a shortage
                off = (reached != p.new).nonzero().squeeze(1)
                settled.append(Settled(p.rid, p.ly[off], p.h[off], p.u[off], reached[off]))
            p.view.state[p.ly, p.h, p.u] = torch.where(p.b, reached, p.view.state[p.ly, p.h, p.u])
            owner[p.ly, p.h, p.w] = torch.where(p.b, owner[p.ly, p.h, p.w], reached)
        return settled

    def _rounds(self, parts: list, ly: Tensor, h: Tensor, w: Tensor) -> list[Tensor | None]:
        """Index sets of the concatenated pairs with no pair twice, each pair's holders in
        request order; ``[None]`` (all at once) for one request, whose pairs are unique."""
        if len(parts) == 1:
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

    def close_view(self, rid: str) -> None:
        """Release the request's borrowed references (owned windows stay with their owner) and
        a decoupled request's Zone A pages."""
        self.pool.drop_request(rid)
        view = self.views.pop(rid, None)
        if view is None:
            return
        w = view.windows[view.borrowed]
        self.pool.release(*self._triples(w), view.state[:, :, view.borrowed].flatten())

    # -- SGLang entry points ---------------------------------------------------------------
    def cache_finished_req(self, req, is_insert: bool = True, *, kv_len_to_handle: int):
        if self.before_close is not None:
            self.before_close()
        self.close_view(req.rid)
        return super().cache_finished_req(req, is_insert, kv_len_to_handle=kv_len_to_handle)

    def cache_unfinished_req(self, req, chunked=False):
        view = self.views.get(req.rid)
        super().cache_unfinished_req(req, chunked)
        if view is None:
            return
        # Duplicates of a tree prefix were freed and replaced by the tree's slots: borrow those.
        now = self._windows(req, 0, view.windows.numel() * self.layout.window)
        moved = (now != view.windows) & ~view.borrowed
        if bool(moved.any()):
            st = self.pool.owner_all[:, :, now[moved]]
            self.pool.acquire(*self._triples(now[moved]), st.flatten())
            view.state[:, :, moved] = st
            view.windows, view.borrowed = now, view.borrowed | moved

    def reset(self) -> None:
        """Empty the tree (SGLang's ``flush_cache``, and ``__init__``). SGLang then clears the
        allocator, which frees no page through it: the windows the tree held are given back to
        the pool here, or pages handed out again would find them owned (routed ones fail the
        pool's write check; full ones keep their rows forever)."""
        if getattr(self, "before_close", None) is not None:
            self.before_close()
        for rid in list(getattr(self, "views", {})):
            self.close_view(rid)
        pool = getattr(self, "pool", None)
        if pool is not None:  # windows opened in every layer and head: layer 0, head 0 says
            owned = (pool.owner_all[0, 0] >= 0).nonzero().squeeze(1)
            if owned.numel():
                pool.release_pages(owned)
        super().reset()
