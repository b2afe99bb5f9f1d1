"""Decoupled policies (RDKV: V per token, K per channel) under SGLang. Each request's K and V
live in its own tier engine, its *arena*, not in the pool's shared window blocks.

RDKV's result belongs to one request, not to a window. Every V token has its own width, and a K
channel's width holds over all of a head's kept tokens. So no window exists that two requests
could share (docs/sglang.md, *RDKV*):

- :class:`ArenaKVPool` keeps SGLang's slot accounting: the allocator's ``N0 / f`` slots, as for
  window policies. It holds no rows. It leaves the budget's bytes unallocated where SGLang set
  them aside for the pool, and each request's :class:`~tiered_radix.engine.store.TierStore`
  (its arena) takes its bytes from there through the device's caching allocator.
  :meth:`ArenaKVPool.bytes_used` sums the stores.
- :class:`ArenaCache` is SGLang's ``ChunkCache``: no prefix is shared. Every turn of a chat is
  prefilled in full and planned again. Finishing, aborting or retracting a request drops its
  store, since every one of those paths ends in ``cache_finished_req``.
- :class:`ArenaAttnBackend` does, per request and layer:
  - the new K/V go to the request's store;
  - attention runs over ``store.view(layer)``: full rows, dequantized codes, a dropped K channel
    read as 0, evicted tokens masked. It uses the transformers adapter's ``attend`` (float32) or
    ``attend_sdpa``;
  - the signals go back to the store.

  After the last layer, requests route at the policy's schedule, and each store moves its own
  data. Decode runs eagerly, in PyTorch, with no CUDA graphs.

A request served here reads what the tier engine would read holding the same tokens: its
outputs are those of a :class:`TierStore` driven directly, step by step
(tests/adapters/sglang_adapter/test_arena.py).
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.chunk_cache import ChunkCache
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from torch import Tensor

from tiered_radix.engine.attention import attend
from tiered_radix.engine.signals import PREFILL_SIGNALS, policy_reads
from tiered_radix.engine.store import TierStore
from tiered_radix.policy.model import Budget, Policy

from .backend import (
    CHUNK_ELEMS,
    RouteDigest,
    Session,
    _Req,
    batch_rows,
    due_routings,
    extend_attention,
    tp_shard,
)
from .options import KVOptions
from .profile import StepTimer
from .reps import STATE_NAMES, PoolConfigError
from .sizing import pool_bytes
from .stats import BackendStats

log = logging.getLogger(__name__)


class ArenaKVPool(MHATokenToKVPool):
    """SGLang's KV pool for a decoupled policy: slots, and the requests' stores (``sessions``).

    Raises:
        PoolConfigError: a coupled policy (its pool is :class:`~.pool.TieredKVPool`), or
            ``page_size != 1``.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str,
        *,
        policy: Policy,
        budget: Budget | None = None,
        enable_memory_saver: bool = False,
        **kwargs,
    ) -> None:
        if policy.coupled:
            raise PoolConfigError(f"policy '{policy.name}' has coupled units: use TieredKVPool")
        if page_size != 1:
            raise PoolConfigError(f"a decoupled policy needs --page-size 1, got {page_size}")
        self.policy, self.budget = policy, budget or policy.budget
        self.sessions: dict[str, Session] = {}  # rid -> the request's tier engine (its arena)
        kwargs.update(enable_alt_stream=False, enable_kv_cache_copy=False)
        kwargs.pop("post_capture_active", None)
        super().__init__(size, page_size, dtype, head_num, head_dim, layer_num, device,
                         enable_memory_saver, **kwargs)  # fmt: skip
        itemsize = torch.empty(0, dtype=dtype).element_size()
        split = pool_bytes(size, head_num, head_dim, layer_num, itemsize, policy, self.budget)
        log.info("tiered-radix pool: max_total_num_tokens=%d, one arena per request; %s",
                 size, split.describe())  # fmt: skip

    def _create_buffers(self) -> None:
        self.k_buffer = self.v_buffer = None  # the rows live in the requests' stores

    def _clear_buffers(self) -> None:
        pass

    def get_kv_size_bytes(self) -> tuple[int, int]:
        """The K and V bytes left to the stores: the budget's share of every slot's full rows
        (a fraction budget ``f`` over ``N0 / f`` slots: ``N0`` tokens' worth)."""
        frac = self.budget.value if self.budget.kind == "fraction" else 1.0
        per = int(frac * self.size) * self.full_bytes_per_token() // 2  # K, and as much V
        return per, per

    def _no_dense(self, *_args, **_kw):
        raise PoolConfigError(
            "a decoupled (RDKV) pool keeps each request's K/V in its own tier engine; stock "
            "attention backends cannot read it (use --attention-backend tiered_triton)"
        )

    get_key_buffer = get_value_buffer = get_kv_buffer = set_kv_buffer = _no_dense
    _get_key_buffer = _get_value_buffer = get_cpu_copy = load_cpu_copy = _no_dense
    move_kv_cache = get_contiguous_buf_infos = _no_dense

    def close(self, rid: str) -> None:
        """Drop request ``rid``'s store (its bytes go back to the device's allocator)."""
        self.sessions.pop(rid, None)

    # -- accounting (the same interface as TieredKVPool's, for stats.py) -------------------
    def full_bytes_per_token(self) -> int:
        """K and V of one token at the pool's dtype, over every layer and head."""
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.layer_num * self.head_num * self.head_dim * itemsize

    def holds_decode_tokens(self, n: int) -> bool:
        """Whether the arenas can take a decode step's ``n`` new tokens at full precision
        (decoded tokens stay full until the next routing) and stay within the bytes SGLang set
        aside for the pool (``get_kv_size_bytes``). One host sync."""
        return self.bytes_used() + n * self.full_bytes_per_token() <= sum(self.get_kv_size_bytes())

    def bytes_used(self) -> int:
        """Bytes the requests' stores hold (one host sync)."""
        parts = [s.store._bytes() for s in self.sessions.values()]
        return int(torch.stack(parts).sum()) if parts else 0

    def occupancy(self) -> tuple[dict[str, int], dict[str, int]]:
        """V units (layer, head, token) of every store by state (``reps.STATE_NAMES``: the
        full-precision tier is ``full``, every quantized width ``quantized``), and no blocks."""
        units = dict.fromkeys(STATE_NAMES, 0)
        for s in self.sessions.values():
            tiers = s.store.tier_set
            for name, n in s.store.occupancy().items():
                i = tiers.names.index(name)
                state = "full" if i == 0 else "evicted" if i == tiers.evict else "quantized"
                units[state] += n
        return units, {}

    def blocks_free(self) -> tuple[int, int]:
        """Free row and ledger blocks: none, the stores allocate as they grow."""
        return 0, 0


class ArenaCache(ChunkCache):
    """SGLang's chunk cache (no prefix sharing) over an :class:`ArenaKVPool`: a request that
    leaves (finished, aborted, retracted) drops its store with its slots.

    Raises:
        PoolConfigError: the allocator's pool is not an :class:`ArenaKVPool`.
    """

    def __init__(self, params) -> None:
        super().__init__(params)
        pool = self.token_to_kv_pool_allocator.get_kvcache()
        if not isinstance(pool, ArenaKVPool):
            raise PoolConfigError(f"the arena cache needs an ArenaKVPool, got {type(pool)}")
        self.pool = pool

    def cache_finished_req(self, req, is_insert: bool = True, *, kv_len_to_handle: int):
        self.pool.close(req.rid)
        return super().cache_finished_req(req, is_insert, kv_len_to_handle=kv_len_to_handle)

    def reset(self) -> None:
        self.pool.sessions.clear()
        super().reset()


class ArenaAttnBackend(AttentionBackend):
    """``--attention-backend tiered_triton`` over an :class:`ArenaKVPool` (see the module
    docstring).

    Raises:
        PoolConfigError: the model runner's pool is not an :class:`ArenaKVPool`.
    """

    def __init__(self, runner, options: KVOptions | None = None) -> None:
        super().__init__()
        options = options or KVOptions()
        pool = runner.token_to_kv_pool
        if not isinstance(pool, ArenaKVPool):
            raise PoolConfigError(f"a decoupled policy needs an ArenaKVPool, got {type(pool)}")
        self.pool, self.policy, self.budget = pool, pool.policy, pool.budget
        self.sessions = pool.sessions
        self.layers = pool.layer_num
        self.last_layer = pool.start_layer + pool.layer_num - 1
        self.prefill_needs = frozenset(policy_reads(self.policy) & set(PREFILL_SIGNALS))
        self.extend_attend = extend_attention(pool.device, options)
        self.chunk_elems = CHUNK_ELEMS.get(torch.device(pool.device).type, 1 << 22)
        self.batch: list[_Req] = []
        self.extend = False
        self.counters = BackendStats(path=options.stats)
        self.timer = StepTimer()  # host seconds per phase (the tiered backend's phases)
        self._timed = self.timer.phase
        # --tp: every rank plans over all heads (TieredAttnBackend's docstring)
        self.shard, self.tp = tp_shard(runner, pool.head_num), None
        if self.shard is not None:
            self.counters.rank, self.tp = self.shard.rank, RouteDigest(self.shard)

    # -- per batch -------------------------------------------------------------------------
    def init_forward_metadata(self, fb) -> None:
        self.batch = []
        rows = batch_rows(fb)
        if rows is None:
            return
        self.extend = fb.forward_mode.is_extend()
        seqs, prefix, new = rows
        start = 0
        for rid, seq, pre, tq in zip(fb.rids, seqs, prefix, new, strict=True):
            self.batch.append(_Req(rid, self._session(rid, pre), start, tq, seq))
            start += tq
        self.timer.count("extend_batches" if self.extend else "decode_steps")

    def _session(self, rid: str, prefix_len: int) -> Session:
        """The request's store, holding exactly its ``prefix_len`` earlier tokens; an extend
        from position 0 opens one.

        Raises:
            AssertionError: the store holds another number of tokens (a matched prefix, which
                the chunk cache never gives, or a decode step of an unknown request).
        """
        sess = self.sessions.get(rid)
        if self.extend and prefix_len == 0:
            sess = self.sessions[rid] = Session(self._store())
        if sess is None or sess.store.n_tokens(0) != prefix_len:
            held = None if sess is None else sess.store.n_tokens(0)
            raise AssertionError(f"request {rid} at position {prefix_len}: its store holds {held}")
        return sess

    def _store(self) -> TierStore:
        p = self.pool
        return TierStore(
            self.policy, n_layers=self.layers, n_heads=p.head_num, head_dim=p.head_dim,
            dtype=p.dtype, device=p.device, budget_override=self.budget, shard=self.shard,
        )  # fmt: skip

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1  # padding SGLang may ask for; this backend never captures graphs

    # -- per layer -------------------------------------------------------------------------
    def forward_extend(self, q, k, v, layer, fb, save_kv_cache: bool = True, **_kw):
        return self._forward(q, k, v, layer)

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache: bool = True, **_kw):
        return self._forward(q, k, v, layer)

    def _forward(self, q: Tensor, k: Tensor, v: Tensor, layer) -> Tensor:
        if getattr(layer, "logit_cap", 0) or (getattr(layer, "sliding_window_size", -1) or -1) > 0:
            raise NotImplementedError("tiered_triton: logit caps and sliding windows unsupported")
        hq, dv, d = layer.tp_q_head_num, layer.v_head_dim, layer.qk_head_dim
        li = layer.layer_id - self.pool.start_layer
        q3 = q.reshape(-1, hq, d)
        k3 = k.reshape(-1, self.pool.head_num, d)
        v3 = v.reshape(-1, self.pool.head_num, dv)
        out = q3.new_empty(q3.shape[0], hq, dv)
        need = self.prefill_needs if self.extend else frozenset()
        fn = self.extend_attend if self.extend else attend
        with self._timed("extend_attend" if self.extend else "decode_gather"):
            for r in self.batch:
                rows = slice(r.start, r.start + r.tq)
                store = r.session.store
                store.append(li, k3[rows].transpose(0, 1), v3[rows].transpose(0, 1))
                kk, vv, kept = store.view(li)
                qi = q3[rows].transpose(0, 1)
                o, signals = fn(qi, kk, vv, kept, float(layer.scaling), need=need,
                                chunk_elems=self.chunk_elems)  # fmt: skip
                out[rows] = o.transpose(0, 1).to(out.dtype)
                store.observe(li, signals)
        if layer.layer_id == self.last_layer:
            with self._timed("route_extend" if self.extend else "route"):
                self._route_due()
        return out.reshape(-1, hq * dv)

    # -- routing ---------------------------------------------------------------------------
    def _route_due(self) -> None:
        tokens = sum(s.store.n_tokens(0) for s in self.sessions.values())
        self.counters.forward_done(self.pool, tokens)
        due = due_routings(self.batch, self.extend)
        # each store moves its own data; one planning pass over all of them
        stores = [r.session.store for r, _ in due]
        moves = TierStore.route_many(stores, [why for _, why in due], prefill=self.extend)
        if self.tp is not None:
            for r, why in due:
                self.tp.add(r.rid, why, r.session.store)
        self.counters.routed(moves, self.pool.device, stores)
        self.counters.publish(self.stats, bool(due))

    def stats(self) -> dict:
        """:meth:`~.stats.BackendStats.snapshot` of the stores, and ``host_s`` (host seconds
        per phase, as :meth:`~.backend.TieredAttnBackend.stats` reports them)."""
        out = self.counters.snapshot(self.pool, len(self.sessions), "gather", None)
        out |= self.timer.report()
        if self.tp is not None:
            out["tp"] = self.tp.record()
        return out
