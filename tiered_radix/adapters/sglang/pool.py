"""``TieredKVPool``: SGLang's per-layer MHA pool, stored as refcounted per-(head, window) blocks.

Slots and windows: the pool runs with ``page_size = W`` (the policy's window; 1 for token units),
so SGLang's page ``p`` is logical window ``p`` and slot ``s`` is token ``s % W`` of window
``s // W``. Window 0 (slot 0's page) is SGLang's padding page: writes there are dropped.

Storage per layer (``F`` row blocks and ``Qn`` ledger blocks, index 0 of each is a NaN trap):

- ``rows_k[l], rows_v[l]``: ``dtype [F + 2, W, d]``: the ``FULL`` and ``R`` representations
  (block ``F + 1`` is scratch: a CUDA graph's padding tokens are written there, nobody reads it);
- ``pages[l]``: uint8 ``[Qn + 1, page_bytes]`` ledger copies at the policy's quantized tier, each
  one TriZone page (:mod:`tiered_radix.formats.layout`: K per channel over the window, V per
  token in groups),
  the same codes as the engine's :class:`~tiered_radix.engine.ledger.PartCodec`, so the decode
  kernel reads them in place;
- ``block[l]``: int32 ``[K, H, NW]`` block id of each representation (``reps.FULL/Q/R``), 0 none;
- ``ref[l]``: int32 ``[K, H, NW]`` holders per representation; a block is freed at 0;
- ``owner[l]``: int8 ``[H, NW]`` the owner's state (``reps.S_*``), -1 for a window nobody owns.

``K`` is the representation kinds the layout holds (:func:`.sizing.table_kinds`): 3 with a
quantized tier, 1 (``FULL``) for eviction-only policies, whose windows are never ``Q`` or ``R``.
``block`` and ``owner`` are views of all-layer tensors ``block_all [L, K, H, NW]`` and
``owner_all [L, H, NW]``, so the attention backend gathers every layer at once.

Sizing: :mod:`.sizing` (:func:`.sizing.pool_bytes` is what :meth:`TieredKVPool._create_buffers`
allocates, byte for byte). A transition that finds no free block of the kind it needs does not
fail: :meth:`TieredKVPool.move` degrades it (see there) and returns the states it reached.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from torch import Tensor

from tiered_radix.engine.routing import to_device
from tiered_radix.formats import zone_a
from tiered_radix.formats.layout import (
    uniform_page_nbytes,
    unpack_uniform_pages,
)
from tiered_radix.kernels import moves
from tiered_radix.policy.model import Budget, Policy

from . import reps
from .freelist import DeviceCounts, FreeStacks
from .metrics import BLOCK_KINDS
from .options import KVOptions
from .pages import pack_pages
from .reps import FULL, S_EVICT, S_FULL, S_Q, S_R, Layout, PoolConfigError, Q, R
from .sizing import PoolBlocks, block_id_dtype, check_rows, plan_blocks, pool_bytes, table_kinds
from .zones import ZoneFullError, ZoneStore

log = logging.getLogger(__name__)
# float32 K/V bytes one Zone A pack reads at once (repack): the layers of a request are packed
# together (one pass, not one a layer) up to this, so a long request stays in a bounded copy
_PACK_BYTES = 1 << 30
# float32 K/V bytes one slice of a move's new representations reads at once (``_make``): a
# routing that demotes a whole batch's prompts (64 x 30K tokens: 20.75 GiB in one piece, GPU
# run 23's out-of-memory) is made in slices of this many bytes instead
_MAKE_BYTES = 256 << 20


def _check(ok: Tensor, what: str) -> None:
    """An invariant of the pool, checked on the device without a host sync."""
    torch._assert_async(ok, what)


class PoolFullError(RuntimeError):
    """The tiered pool has no free block of the kind a write or a transition needs."""


class TieredKVPool(MHATokenToKVPool):
    """The tiered pool. Holders (see :mod:`.reps`) move between states with :meth:`move`;
    :meth:`read` is the reference for what the tiered attention backend must gather.
    ``kernels`` (default: on CUDA): moves and releases keep the block tables and free stacks
    with Triton launches (:mod:`tiered_radix.kernels.moves`, :mod:`~tiered_radix.kernels.
    stacks`), else with PyTorch ops, their twin.

    Raises:
        PoolConfigError: the policy's layout is not storable, or ``page_size != W``.
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
        blocks: PoolBlocks | None = None,
        options: KVOptions | None = None,
        kernels: bool | None = None,
        enable_memory_saver: bool = False,
        **kwargs,
    ) -> None:
        self.layout = Layout.of(policy)
        self._kernels = torch.device(device).type == "cuda" if kernels is None else kernels
        if page_size != self.layout.window:
            raise PoolConfigError(
                f"the tiered pool needs --page-size {self.layout.window} (the policy's window), "
                f"got {page_size}"
            )
        self.policy, self.budget = policy, budget or policy.budget
        self.prepared: tuple | None = None  # prepare_write's (loc, dest, keep, layers)
        self.graph_dest: Tensor | None = None  # graph_write's rows [L, bs * H]
        self.v_group = min(self.layout.v_group, head_dim)  # as the engine's V codec groups
        # gathers skip evicted windows and dequantize only quantized ones (two host syncs per
        # read: 2x faster extend on CPU) or read everything without a sync (the GPU's choice:
        # run 9's prefill spent 2.6x run 8's time in extend attention with the syncs)
        self.gather_live = (options or KVOptions()).gather_on(device) == "live"  # --kv-gather
        itemsize = torch.empty(0, dtype=dtype).element_size()
        self.blocks = blocks or plan_blocks(size, head_num, head_dim, itemsize, policy, self.budget)
        check_rows(self.blocks, head_num, policy)  # what the scheduler never lets go must fit
        self._warned_short = False  # the first degraded move is logged (see degraded)
        self._rows_held = 0  # row blocks per layer that moves leave free (rows_held)
        # rows reclaimed from the radix cache (_reclaim_rows): windows demoted, tokens evicted
        self._reclaimed = {
            "cached_windows_demoted": 0, "cached_tokens_evicted": 0, "archived_copies_dropped": 0,
            "paged_windows_unrowed": 0,
        }  # fmt: skip
        self._tree = None  # the radix cache over this pool (attach_tree)
        kwargs.update(enable_alt_stream=False, enable_kv_cache_copy=False)
        kwargs.pop("post_capture_active", None)
        super().__init__(
            size,
            page_size,
            dtype,
            head_num,
            head_dim,
            layer_num,
            device,
            enable_memory_saver,
            **kwargs,
        )
        split = pool_bytes(size, head_num, head_dim, layer_num, itemsize, policy, self.budget,
                           self.blocks)  # fmt: skip
        log.info(
            "tiered-radix pool: max_total_num_tokens=%d, %d row and %d ledger blocks a layer; %s",
            size,
            self.blocks.full,
            self.blocks.quant,
            split.describe(),
        )

    # -- storage ---------------------------------------------------------------------------
    def attach_tree(self, tree) -> None:
        """The radix cache over this pool (:class:`.radix.TieredRadixCache`): where the attention
        backend finds the requests' views, and what :meth:`rows_for_windows` reclaims from."""
        self._tree = tree

    @property
    def tree(self):
        """The attached radix cache, or None."""
        return self._tree

    def _create_buffers(self) -> None:
        L, H, d, W = self.layer_num, self.head_num, self.head_dim, self.layout.window
        F, Qn, dev = self.blocks.full, self.blocks.quant, self.device
        self.n_windows = self.size // W + 1
        self.scratch = F + 1
        self.rows_k_all = torch.full((L, F + 2, W, d), torch.nan, dtype=self.dtype, device=dev)
        self.rows_v_all = torch.full_like(self.rows_k_all, torch.nan)
        self.rows_k, self.rows_v = list(self.rows_k_all.unbind(0)), list(self.rows_v_all.unbind(0))
        self.pages, self.page_bytes, self.pages_all = [], 0, None
        self.zones = None  # a decoupled policy's repacked requests (.zones)
        self.zone_full = 0  # routings whose pages found no room in the Zone A store (repack)
        # a decoupled layout's windows whose slot owner reads them from Zone A pages only (its
        # request routed, or closed): their rows may go when only the owner holds them
        self.paged = None
        if self.layout.tier_bits is not None:
            self.zones = ZoneStore(L, self.blocks.zone, W, self.v_group, self.dtype, dev)
            self.paged = torch.zeros(self.n_windows, dtype=torch.bool, device=dev)
        if self.layout.quant is not None:
            q = self.layout.quant
            self.page_bytes = uniform_page_nbytes(q.bits, W, d, self.v_group)
            self.pages_all = torch.zeros(L, Qn + 1, self.page_bytes, dtype=torch.uint8, device=dev)
            self.pages = list(self.pages_all.unbind(0))
        K, ids = table_kinds(self.layout), block_id_dtype(self.blocks)
        self.block_all = torch.zeros(L, K, H, self.n_windows, dtype=ids, device=dev)
        self.block = list(self.block_all.unbind(0))
        self.ref_all = torch.zeros(L, K, H, self.n_windows, dtype=torch.int32, device=dev)
        self.ref = list(self.ref_all.unbind(0))
        self.owner_all = torch.full((L, H, self.n_windows), -1, dtype=torch.int8, device=dev)
        self.owner = list(self.owner_all.unbind(0))
        self.row_stacks = FreeStacks(L, F, dev, kernel=self._kernels)
        self.q_stacks = FreeStacks(L, Qn, dev, kernel=self._kernels)
        self.free_rows, self.free_q = self.row_stacks.views, self.q_stacks.views  # list-like
        # row blocks holding an R (the others taken hold a FULL), and pairs a move could not
        # bring to their planned state (see move)
        self.tally = DeviceCounts([0, 0], dev)
        self.k_buffer = self.v_buffer = None  # no per-slot rows: stock backends cannot read us
        kinds = (FULL, Q, R)[:K]
        s = torch.tensor([[k in self.layout.reps(st) for k in kinds] for st in reps.STATES])
        self._holds = s.to(dev)  # bool [state, kind]
        self._kinds = torch.tensor(kinds, device=dev)
        quant = self.layout.quant is not None
        self._codes = moves.Codes(
            s.to(dev, torch.uint8), FULL, Q if quant else -1, R if quant else -1, S_R, S_EVICT
        )  # fmt: skip
        # invariant breaks the move kernels counted (moves.move_claim / move_refs), checked on the
        # device after each move (fatal: they stay counted)
        self._broken = torch.zeros(4, dtype=torch.long, device=dev)

    def _clear_buffers(self) -> None:
        del self.rows_k, self.rows_v, self.pages, self.rows_k_all, self.rows_v_all, self.pages_all

    def get_kv_size_bytes(self) -> tuple[int, int]:
        """Bytes of the physical storage: row blocks, and ledger pages (counted with K)."""
        pages = 0 if self.pages_all is None else self.pages_all.nbytes
        pages += 0 if self.zones is None else self.zones.bytes_all.nbytes
        return self.rows_k_all.nbytes + pages, self.rows_v_all.nbytes

    def _no_dense(self, *_args, **_kw):
        raise PoolConfigError(
            "a tiered KV pool has no dense per-slot K/V buffer; stock attention backends "
            "cannot read it (use --attention-backend tiered_triton)"
        )

    get_key_buffer = get_value_buffer = get_kv_buffer = _no_dense
    _get_key_buffer = _get_value_buffer = get_cpu_copy = load_cpu_copy = _no_dense
    move_kv_cache = get_contiguous_buf_infos = _no_dense

    # -- writing ---------------------------------------------------------------------------
    def set_kv_buffer(
        self,
        layer,
        loc: Tensor,
        cache_k: Tensor,
        cache_v: Tensor,
        k_scale=None,
        v_scale=None,
        layer_id_override=None,
        **_kw,
    ) -> None:
        """Write ``cache_k, cache_v [n, H, d]`` at slots ``loc [n]``; a window's first write
        allocates its ``FULL`` blocks for every head, owned (state full) by the slots' owner.
        For the slots given to :meth:`prepare_write` (the same tensor) that is two
        ``index_copy_`` per layer at row indices computed there for every layer."""
        li = layer_id_override if layer_id_override is not None else layer.layer_id
        li -= self.start_layer
        d = self.head_dim
        if self.graph_dest is not None:  # a captured decode step: rows from graph_write
            dest = self.graph_dest[li]
            self.rows_k[li].view(-1, d).index_copy_(0, dest, cache_k.reshape(-1, d).to(self.dtype))
            self.rows_v[li].view(-1, d).index_copy_(0, dest, cache_v.reshape(-1, d).to(self.dtype))
            return
        if self.prepared is None or loc is not self.prepared[0] or li not in self.prepared[3]:
            self.prepare_write(loc, layers=[li])
        _, dest, keep, _ = self.prepared
        if keep is not None:
            cache_k, cache_v = cache_k.index_select(0, keep), cache_v.index_select(0, keep)
        k = cache_k.reshape(-1, d).to(self.dtype)  # [n * H, d]: token-major, as dest is
        v = cache_v.reshape(-1, d).to(self.dtype)
        self.rows_k[li].view(-1, d).index_copy_(0, dest[li], k)
        self.rows_v[li].view(-1, d).index_copy_(0, dest[li], v)

    def prepare_write(
        self, loc: Tensor, layers: list[int] | None = None, starts: list[int] | None = None
    ) -> None:
        """Before a forward whose new tokens go to slots ``loc [n]``: drop padding slots (window
        0), open the windows in ``layers`` (default: all) and compute each layer's row index of
        every (head, token), so :meth:`set_kv_buffer` with this ``loc`` only copies rows. One
        host sync (padding), one more where windows open. ``starts`` (an extend batch's: the
        host knows where its windows begin): the indices of ``loc`` whose token is the first
        of its window, the windows to open; no padding then (checked on the device) and no
        host sync. Undone by :meth:`end_step`."""
        W = self.layout.window
        lo = loc.long() if isinstance(loc, Tensor) else loc.loc.long()  # or a KVWriteLoc
        if starts is None:
            keep = (lo >= W).nonzero().squeeze(1)
            keep, lo = (None, lo) if keep.numel() == lo.numel() else (keep, lo[keep])
            win = lo // W
            self.open_windows(win, layers)
        else:
            keep, win = None, lo // W
            _check((lo >= W).all(), "a padding slot among an extend batch's")
            self.open_windows(win, layers, new=win[to_device(starts, self.device)])
        ly = list(range(self.layer_num)) if layers is None else layers
        # windows first, then layers: indexing the whole tables by a layer list would copy them
        own = self.owner_all.index_select(2, win)[ly]
        _check((own == S_FULL).all(), "a write into a routed window")
        dest = torch.zeros(self.layer_num, self.head_num * lo.numel(), dtype=torch.long,
                           device=self.device)  # fmt: skip
        blocks = self.block_all[:, FULL].index_select(2, win)[ly]  # [len(ly), H, n]
        dest[ly] = (blocks * W + lo % W).transpose(1, 2).flatten(1)  # (token, head) order
        self.prepared = (loc, dest, keep, frozenset(ly))

    def graph_write(self, loc: Tensor, dest: Tensor, starts: list[int] | None = None) -> None:
        """:meth:`prepare_write` for a CUDA graph's decode step: ``dest`` (int64 ``[L, m * H]``,
        ``m >=`` the tokens of ``loc``, fixed address) gets every token's row in (token, head)
        order, padding tokens (window 0, and tokens past ``loc``: the graph's padded requests)
        the scratch block's; :meth:`set_kv_buffer` then writes through ``dest`` until
        :meth:`end_step`. ``starts``: ``loc`` holds the real requests' tokens only (no padding)
        and these of them begin a window (the backend knows from their lengths): no host sync."""
        self.prepare_write(loc, starts=starts)
        _, rows, keep, _ = self.prepared
        dest.fill_(self.scratch * self.layout.window)
        H = self.head_num
        if keep is None:
            dest[:, : rows.shape[1]] = rows
        else:
            at = (keep[:, None] * H + torch.arange(H, device=self.device)).flatten()
            dest[:, at] = rows
        self.prepared, self.graph_dest = None, dest

    def graph_rows(self, dest: Tensor) -> None:
        """A CUDA graph's decode step whose rows ``dest`` (int64 ``[L, m * H]``, fixed address)
        an earlier :meth:`graph_write` filled and the graph's bookkeeping moved on since (every
        request's new token in the row after its last one: no window opened, nothing routed):
        :meth:`set_kv_buffer` writes through ``dest`` until :meth:`end_step`."""
        self.prepared, self.graph_dest = None, dest

    def end_step(self) -> None:
        """Forget :meth:`prepare_write`'s and :meth:`graph_write`'s rows: later writes prepare
        their own."""
        self.prepared = self.graph_dest = None

    def open_windows(
        self, win: Tensor, layers: list[int] | None = None, new: Tensor | None = None
    ) -> None:
        """Give the windows among ``win`` that nobody owns their ``FULL`` blocks (every head),
        owned at state full, in ``layers`` (default: all; the backend opens a decode step's new
        windows in every layer before the forward, so their block ids are known up front).
        Which windows are new is read from the first of ``layers``: a window is opened in all
        layers of a forward, and given back in all of them. One host sync (which are new),
        none where the caller knows them (``new``: distinct windows nobody owns, checked on
        the device)."""
        layers = list(range(self.layer_num)) if layers is None else layers
        if new is None:
            new = torch.unique(win[self.owner[layers[0]][0, win] < 0])
        else:
            _check((self.owner[layers[0]][0, new] < 0).all(), "opening an owned window")
        if not new.numel():
            return
        n = self.head_num * new.numel()
        self._reclaim_rows(n, layers)
        blocks = self._take(self.row_stacks, {li: n for li in layers}, "row")
        if layers == list(range(self.layer_num)):
            lt = torch.arange(self.layer_num, device=self.device)[:, None, None]
        else:
            lt = to_device(layers, self.device)[:, None, None]
        h = torch.arange(self.head_num, device=self.device)[None, :, None]
        self.block_all[lt, FULL, h, new] = blocks.view(len(layers), self.head_num, -1).to(
            self.block_all.dtype
        )
        self.ref_all[lt, FULL, h, new] = 1
        self.owner_all[lt, h, new] = S_FULL
        if self.paged is not None:
            self.paged[new] = False

    def rows_for_windows(self, n: int) -> bool:
        """Whether ``n`` windows can open now (``H`` row blocks each in every layer), after
        evicting radix-cached windows that no running request holds if rows are short."""
        self._reclaim_rows(n * self.head_num, list(range(self.layer_num)))
        return self.windows_free() >= n

    @contextlib.contextmanager
    def rows_held(self, windows: int) -> Iterator[None]:
        """While a forward is prepared: the row blocks of the ``windows`` it opens (``H`` each,
        every layer) are held from :meth:`move`. SGLang's checks count them free before the
        forward (:meth:`holds_decode_tokens`, the admission's); the routing a step lands first,
        or one that the step runs because rows are short, would otherwise let promotions take
        them before :meth:`open_windows` does (GPU run 24: ``PoolFullError`` at batch 64). A
        promotion that finds only held blocks stays quantized, a degraded move."""
        self._rows_held = windows * self.head_num
        try:
            yield
        finally:
            self._rows_held = 0

    def holds_decode_tokens(self, n: int) -> bool:
        """Whether a decode step's ``n`` new tokens find row blocks for the windows they open
        (:meth:`rows_for_windows`: at most one window per ``W`` tokens)."""
        return self.rows_for_windows(-(-n // self.layout.window))

    def windows_free(self) -> int:
        """Windows that can open now without evicting: the scarcest layer's free row blocks,
        ``H`` a window."""
        return min(self.row_stacks.counts()) // self.head_num

    def _short(self, need: int, layers: list[int]) -> int:
        """Row blocks the scarcest of ``layers`` lacks for ``need`` free ones (0 when the
        host's lower bound of the counts says so; else a host read, which waits for the last
        device change of the free lists if its copy has not landed)."""
        if self.row_stacks.floor() >= need:
            return 0
        free = self.row_stacks.counts()
        return max(need - free[li] for li in layers)

    def _reclaim_rows(self, need: int, layers: list[int]) -> None:
        """Before opening windows: while a layer of ``layers`` has fewer than ``need`` free row
        blocks, first demote the rows of radix-cached windows that no running request holds to
        their ledger copies (:meth:`_demote_cached`: the prefix stays cached, at the quantized
        tier), or, in a decoupled layout, take the rows of windows nobody reads from rows
        (:meth:`_unrow_paged`), then evict such windows (SGLang's own eviction, whose frees
        come back here through the allocator), so cached prefixes yield to new tokens instead
        of the forward failing. Locked prefixes are never evicted."""
        tree = self._tree
        if tree is None or self._short(need, layers) <= 0:
            return
        if self.layout.quant is not None:
            self._demote_cached(tree, need, layers)
        if self.paged is not None:
            self._unrow_paged(tree, need, layers)
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        evicted = 0
        for _ in range(16):
            short, before = self._short(need, layers), tree.evictable_size()
            if short <= 0 or before == 0:
                break
            tree.evict(EvictParams(num_tokens=-(-short // self.head_num) * self.layout.window))
            evicted += before - tree.evictable_size()
            if tree.evictable_size() == before:
                break
        if evicted:
            self._reclaimed["cached_tokens_evicted"] += evicted
            log.info("tiered-radix: evicted %d cached tokens for row blocks", evicted)

    def _unrow_paged(self, tree, need: int, layers: list[int]) -> None:
        """A decoupled layout's :meth:`_reclaim_rows`: windows whose slot owner reads them from
        Zone A pages only (:attr:`paged`: its request routed over them, or closed) and that no
        other request holds (one reference: the owner's) lose their rows until the rows
        suffice: those of cached prefixes no running request holds first, in the order SGLang
        would evict them (:meth:`.radix.TieredRadixCache.cold_windows`), then running
        requests' (whose next turn may match them), lowest window first. Their slots stay
        allocated and their radix nodes cached (a running request's prompt stays locked, as
        SGLang keeps it): the owner state becomes evicted, so the tree lends them to nobody
        (:meth:`.radix.TieredRadixCache.match_prefix` stops before them) until a prefill of the
        same tokens gives them rows again (:meth:`adopt_rows`). Windows a request matched and
        has not borrowed yet (:meth:`.radix.TieredRadixCache.matched_windows`) are spared.
        Every layer and head of a decoupled window holds alike (opened, borrowed and released
        together): layer 0's head 0 stands for all. One host sync."""
        short = self._short(need, layers)
        if short <= 0:
            return
        free = self.paged & (self.owner_all[0, 0] == S_FULL) & (self.ref_all[0, FULL, 0] == 1)
        spare = tree.matched_windows()
        if spare.numel():
            free[spare] = False
        cold = list(tree.cold_windows())
        first = torch.cat(cold) if cold else torch.zeros(0, dtype=torch.long, device=self.device)
        first = first[free[first]]
        free[first] = False
        w = torch.cat([first, free.nonzero().squeeze(1)])[: -(-short // self.head_num)]
        if not w.numel():
            return
        ly, h, ww = self.pairs(w)
        self.release(ly, h, ww, torch.full_like(ly, S_FULL))
        self.owner_all[:, :, w] = S_EVICT
        self._reclaimed["paged_windows_unrowed"] += w.numel()
        log.info("tiered-radix: took the rows of %d windows read from Zone A pages", w.numel())

    def mark_paged(self, windows: Tensor) -> None:
        """Their slot owner reads ``windows`` from Zone A pages only from now on (its request
        routed over them, or closed): :meth:`_unrow_paged` may take their rows once nobody
        else holds them."""
        self.paged[windows] = True

    def without_rows(self, windows: Tensor) -> Tensor:
        """bool, per window of ``windows``: its rows are gone (:meth:`_unrow_paged`; or nobody
        owns it), so nobody may borrow it."""
        own = self.owner_all[0, 0, windows]
        return (own < 0) | (own == S_EVICT)

    def rows_taken(self) -> bool:
        """Whether :meth:`_unrow_paged` ever took a window's rows (host count): until then
        every owned window has its rows and the radix cache checks nothing."""
        return self._reclaimed["paged_windows_unrowed"] > 0

    def adopt_rows(self, rowless: Tensor, fresh: Tensor) -> None:
        """Windows ``rowless [n]`` (the radix tree's, rows taken by :meth:`_unrow_paged`) take
        the row blocks of ``fresh [n]`` (a request's prefill of the same tokens, about to be
        freed as their duplicates): block ids and references move, nothing is copied, and
        ``fresh`` is left holding nothing (its release frees no block). Pairs where ``rowless``
        still has rows or ``fresh`` has none are left as they are."""
        own = self.owner_all[0, 0]
        ok = (own[rowless] == S_EVICT) & (own[fresh] == S_FULL) & (rowless != fresh)
        t, f = rowless[ok], fresh[ok]
        self.block_all[:, FULL, :, t] = self.block_all[:, FULL, :, f]
        self.ref_all[:, FULL, :, t] = self.ref_all[:, FULL, :, f]
        self.owner_all[:, :, t] = S_FULL
        self.paged[t] = True  # the tree owns it and reads nothing; a borrower's reference holds
        self.block_all[:, FULL, :, f] = 0
        self.ref_all[:, FULL, :, f] = 0
        self.owner_all[:, :, f] = S_EVICT
        self.paged[f] = False

    def _demote_cached(self, tree, need: int, layers: list[int]) -> None:
        """Cached prefixes' full-precision rows to their ledger copies, the prefix SGLang would
        evict first first (:meth:`.radix.TieredRadixCache.cold_windows`), until every layer of
        ``layers`` has ``need`` free row blocks: the tree moves its own hold of each
        (layer, head, window) it alone reads from rows (``FULL`` or ``R``; a borrower's
        reference would keep the block) to ``Q``, making the ledger copy where the window has
        none (write-once). A request that matches the prefix later borrows it quantized, and its
        own routing may restore it (``R``), as for any demoted window. Stops at the first group
        of prefixes whose ledger copies some layer has no free blocks for: the rest is evicted (a
        move that finds no ledger block would evict the window in place, inside a prefix still
        cached)."""
        demoted, short = 0, self._short(need, layers)
        nodes = iter(tree.cold_windows())
        while short > 0:
            # the next prefixes, oldest first, with a few times the windows the rows lack (most
            # of a routed prefix is quantized or evicted already): one pass, a few host reads
            group, n = [], 0
            for w in nodes:
                group.append(w)
                n += w.numel()
                if n * self.head_num >= 4 * short:
                    break
            if not group:
                break
            w = torch.cat(group)
            ly, h, ww = self.pairs(w)
            st = self.owner_all[:, :, w].long().flatten()  # in pairs' order
            kind = torch.where(st == S_R, R, FULL)
            sole = ((st == S_FULL) | (st == S_R)) & (self.ref_all[ly, kind, h, ww] == 1)
            fresh = sole & (st == S_FULL) & (self.block_all[ly, Q, h, ww] == 0)
            # a cached prefix's rows kept quantized are worth more than archived copies
            self.reclaim_ledger(ly, h, ww, fresh, ly.numel())
            per_layer = torch.bincount(ly[fresh], minlength=self.layer_num).tolist()
            if any(k > f for k, f in zip(per_layer, self.q_stacks.counts(), strict=True)):
                break
            windows = int(sole.view(self.layer_num * self.head_num, -1).any(0).sum())
            if windows:
                ly, h, ww, st = ly[sole], h[sole], ww[sole], st[sole]
                make = {Q: sum(per_layer), R: 0}
                reached = self.move(ly, h, ww, st, torch.full_like(st, S_Q), make)
                self.owner_all[ly, h, ww] = reached.to(self.owner_all.dtype)
                demoted += windows
                short = self._short(need, layers)
        if demoted:
            self._reclaimed["cached_windows_demoted"] += demoted
            log.info("tiered-radix: demoted %d cached windows' rows to the ledger", demoted)

    def reclaim_ledger(self, ly: Tensor, h: Tensor, w: Tensor, may_copy: Tensor, bound: int):
        """Before a move of pairs ``(ly, h, w)`` of which those ``may_copy`` (bool) may need a
        new ledger copy (``bound`` of them at most, a host count): while some layer has fewer
        free ledger blocks than its pairs without a copy, archived windows (owner state
        ``S_A``, read by nobody: ``evict(archive=...)``) let their copies go, those of cached
        prefixes no running request holds first (the prefix SGLang would evict first first),
        then any. A copy a borrower still reads stays until it lets go too. Without an archive,
        or where the host's bound of the free blocks suffices, a no-op (no host sync)."""
        if not self.layout.archive or self.q_stacks.floor() >= bound:
            return
        need = may_copy & (self.block_all[ly, Q, h, w] == 0)
        per_layer = torch.bincount(ly[need], minlength=self.layer_num).tolist()  # host sync

        def short() -> int:
            free = self.q_stacks.counts()
            return max(n - f for n, f in zip(per_layer, free, strict=True))

        tree, dropped = self._tree, 0
        groups = iter(() if tree is None else tree.cold_windows())
        while (lack := short()) > 0:
            group, n = [], 0
            for w in groups:  # a few times the windows lacking: one pass, a few host reads
                group.append(w)
                n += w.numel()
                if n * self.head_num >= 4 * lack:
                    break
            if group:
                w = torch.cat(group)
            else:  # no cached prefix left: archived windows of running requests
                w = (self.owner_all == reps.S_A).flatten(0, 1).any(0).nonzero().squeeze(1)
            ly, h, ww = self.pairs(w)
            archived = (self.owner_all[:, :, w] == reps.S_A).flatten()  # in pairs' order
            ly, h, ww = ly[archived], h[archived], ww[archived]
            self.release(ly, h, ww, torch.full_like(ly, reps.S_A))
            self.owner_all[ly, h, ww] = S_EVICT
            dropped += ly.numel()
            if not group:
                break
        if dropped:
            self._reclaimed["archived_copies_dropped"] += dropped
            log.info("tiered-radix: dropped %d archived ledger copies for routings", dropped)

    @property
    def reclaimed(self) -> dict[str, int]:
        """What new tokens' rows took from the radix cache so far: windows whose rows went to
        the ledger (the prefix stayed cached) and tokens evicted (host counts)."""
        return dict(self._reclaimed)

    def pairs(self, w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Every (layer, head, window) of windows ``w [n]``: int64 ``[L*H*n]`` each, in
        ``[L, H, n]`` order (the order of ``owner_all[:, :, w].flatten()``)."""
        L, H, n = self.layer_num, self.head_num, w.numel()
        ly = torch.arange(L, device=self.device)[:, None, None].expand(L, H, n)
        h = torch.arange(H, device=self.device)[None, :, None].expand(L, H, n)
        return ly.flatten(), h.flatten(), w.expand(L, H, n).flatten()

    def _take(self, free: FreeStacks, counts: dict[int, int], what: str) -> Tensor:
        """``counts[l]`` blocks off layer ``l``'s free stack, in ``counts``' order: int64
        ``[n]``."""
        have = free.counts()
        for li, n in counts.items():
            if n > have[li]:
                raise PoolFullError(
                    f"tiered pool: {n} {what} blocks needed in layer {li}, {have[li]} free; "
                    "lower the load, raise the budget, or let routing demote more before the "
                    "next prefill"
                )
        return free.take_counts(counts)

    def _layer_ids(self, li: int | Tensor, like: Tensor) -> Tensor:
        return li.long() if isinstance(li, Tensor) else torch.full_like(like, li, dtype=torch.long)

    # -- reading ---------------------------------------------------------------------------
    def read(self, layer_id: int, windows: Tensor, state: Tensor | None = None):
        """float32 ``k, v [H, n*W, d]`` of ``windows [n]`` read in ``state`` (int8 ``[H, n]``;
        default: the owner's), and ``kept`` bool ``[H, n*W]``; evicted rows are NaN."""
        li = layer_id - self.start_layer
        state = self.owner[li][:, windows] if state is None else state
        h = torch.arange(self.head_num, device=self.device)[:, None].expand_as(state)
        w = windows[None].expand_as(state)
        k, v = self._rows_of(li, h.flatten(), w.flatten(), state.flatten())
        H, n, W, d = *state.shape, self.layout.window, self.head_dim
        kept = reps.reads(state).repeat_interleave(W, dim=1)
        return k.reshape(H, n * W, d), v.reshape(H, n * W, d), kept

    def read_live(self, layer_id: int, windows: Tensor, state: Tensor, n_tokens: int):
        """:meth:`read` of only the windows some head reads (state not evicted) among
        ``windows [n]`` (the request's, in sequence order; its first ``n_tokens`` tokens):
        float32 ``k, v [H, T', d]``, ``kept [H, T']`` and ``pos`` int64 ``[T']``, each row's token
        position. The last window must be read (attention's newest tokens are in it). One host
        sync more than :meth:`read`; without ``gather_live`` (``--kv-gather all``, the
        default on CUDA) every window, ``pos`` every position, and no sync."""
        W = self.layout.window
        if not self.gather_live:  # every window, no host sync
            k, v, kept = self.read(layer_id, windows, state)
            pos = torch.arange(n_tokens, device=windows.device)
            return k[:, :n_tokens], v[:, :n_tokens], kept[:, :n_tokens], pos
        live = reps.reads(state).any(0).nonzero().squeeze(1)  # host sync
        k, v, kept = self.read(layer_id, windows[live], state[:, live])
        pos = (live[:, None] * W + torch.arange(W, device=live.device)).flatten()
        t = live.numel() * W - (windows.numel() * W - n_tokens)  # the last window's unwritten rows
        return k[:, :t], v[:, :t], kept[:, :t], pos[:t]

    def _rows_of(self, li: int | Tensor, h: Tensor, w: Tensor, state: Tensor):
        """float32 ``k, v [m, W, d]`` of pairs ``(h, w)`` of layers ``li`` (one, or ``[m]``) as
        read in ``state [m]``: rows of the state's block (block 0, the NaN trap, for states
        without rows), ``dequantize(Q)`` where quantized: only those, after one host sync
        (``gather_live``), or every pair's ledger block, selected without a sync."""
        ly = self._layer_ids(li, h)
        blk = self.block_all[ly, :, h, w].long()  # [m, K]
        state = state.long()
        b = torch.where(state == S_FULL, blk[:, FULL], 0)
        if self.layout.quant is not None:  # restored rows exist only with a quantized tier
            b = torch.where(state == S_R, blk[:, R], b)
        k, v = self.rows_k_all[ly, b].float(), self.rows_v_all[ly, b].float()
        if self.layout.quant is not None and not self.gather_live:
            kq, vq = self._unpage(ly, blk[:, Q])
            q = (state == S_Q)[:, None, None]
            k, v = torch.where(q, kq, k), torch.where(q, vq, v)
        elif self.layout.quant is not None:
            q = (state == S_Q).nonzero().squeeze(1)  # dequantize only those
            if q.numel():
                k[q], v[q] = self._unpage(ly[q], blk[q, Q])
        return k, v

    def _unpage(self, ly: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        """float32 ``k, v [m, W, d]``: ``dequantize`` of ledger pages ``b [m]`` of layers
        ``ly [m]``."""
        lay = self.layout
        return unpack_uniform_pages(
            self.pages_all[ly, b], lay.quant.bits, lay.window, self.head_dim, self.v_group
        )

    # -- holders ---------------------------------------------------------------------------
    # Pairs are (layer, head, window); ``li`` is one layer for all pairs or a per-pair tensor.
    # Pairs of one call are unique. Invariants are device-side asserts (no host sync).
    def holds(self, state: Tensor, kind: int) -> Tensor:
        return self._holds[state.long(), kind]

    def _per_kind(self, li, h: Tensor, w: Tensor, state: Tensor):
        """``[m, K]`` index tensors over (pair, representation kind) and which the state
        holds."""
        ly = self._layer_ids(li, h)
        m, K = h.numel(), self._kinds.numel()
        return (
            ly[:, None].expand(m, K),
            self._kinds[None].expand(m, K),
            h[:, None].expand(m, K),
            w[:, None].expand(m, K),
        ), self._holds[state.long()]

    def acquire(self, li: int | Tensor, h: Tensor, w: Tensor, state: Tensor) -> None:
        """One more holder of the representations of ``state [m]`` (they must exist)."""
        idx, hold = self._per_kind(li, h, w, state)
        _check(((self.block_all[idx] > 0) | ~hold).all(), "acquire of a missing representation")
        self.ref_all.index_put_(idx, hold.int(), accumulate=True)

    def release(self, li: int | Tensor, h: Tensor, w: Tensor, state: Tensor) -> None:
        """One holder fewer; representations nobody holds are freed (rows NaN-poisoned) and
        their blocks go back to the free stacks, in (pair, kind) order. No host sync."""
        if self._kernels:
            self._refs(self._layer_ids(li, h), h.long(), w.long(), state.long(), None)
            return
        idx, hold = self._per_kind(li, h, w, state)
        self.ref_all.index_put_(idx, -hold.int(), accumulate=True)
        ref = self.ref_all[idx]
        _check((ref >= 0).all(), "refcount below zero")
        gone = hold & (ref == 0)  # [m, K]
        b = self.block_all[idx].long()
        self.block_all[idx] = torch.where(gone, 0, b).to(self.block_all.dtype)
        ly, kind = idx[0], idx[1]
        rows = gone & (kind != Q)  # a holder frees at most one row block (FULL or R) a pair
        row = torch.where(rows, b, 0).amax(1)  # block 0, the NaN trap, where none is freed
        self.rows_k_all[ly[:, 0], row] = torch.nan
        self.rows_v_all[ly[:, 0], row] = torch.nan
        self.row_stacks.give(ly.flatten(), b.flatten(), rows.flatten())
        if self.layout.quant is not None:
            self.q_stacks.give(ly.flatten(), b.flatten(), (gone & (kind == Q)).flatten())
            self.tally.t[0] -= (gone & (kind == R)).sum()
            self.tally.changed()

    def move(self, li: int | Tensor, h: Tensor, w: Tensor, old: Tensor, new: Tensor,
             make: dict[int, int] | None = None) -> Tensor:  # fmt: skip
        """One holder of pairs ``(h, w) [m]`` (unique) goes from state ``old`` to ``new``:
        missing representations are made (``Q`` from what the holder reads now, write-once;
        ``R`` from ``Q``), then the holder's references move. Pairs whose state stays are
        no-ops. Every layer at once, no host sync: blocks come off the device free stacks.

        A layer short of free blocks for the representations its pairs need makes the first
        pairs (in order) and degrades the rest instead of failing (a ``Q`` that finds no ledger
        block goes to the next tier down, evicted, or stays where the layout has no evicted
        tier; an ``R`` that finds no row block stays quantized), counted in :attr:`degraded`.
        Row blocks held for the forward being prepared (:meth:`rows_held`) are not taken.
        Returns the states reached (int64 ``[m]``: ``new`` unless degraded), which the caller
        records as the holder's. ``make[kind]``: a host bound of the pairs that need a new
        representation of that kind (``Q``, ``R``); none is looked for where it is 0."""
        ly = self._layer_ids(li, h)
        old, new = old.long(), new.long()
        if self._kernels:
            return self._move_kernels(ly, h.long(), w.long(), old, new, make)
        _check(((old != S_EVICT) | (new == S_EVICT)).all(), "an evicted window cannot come back")
        for kind in (Q, R) if self.layout.quant is not None else ():  # Q first: R is from Q
            bound = ly.numel() if make is None else min(make.get(kind, ly.numel()), ly.numel())
            if not bound:
                continue
            need = self._holds[new, kind] & (self.block_all[ly, kind, h, w] == 0)
            stacks, keep = (self.q_stacks, 0) if kind == Q else (self.row_stacks, self._rows_held)
            got, block = stacks.take(ly, need, bound, keep)
            short = need & ~got
            evicts = kind == Q and self.layout.evict_index is not None
            new = torch.where(short, S_EVICT if evicts else old, new)
            self.tally.t[1] += short.sum()
            self._make(kind, ly, h, w, old, block, got)
        self.tally.changed()
        self.acquire(ly, h, w, new)
        self.release(ly, h, w, old)
        return new

    def _move_kernels(self, ly: Tensor, h: Tensor, w: Tensor, old: Tensor, new: Tensor,
                      make: dict[int, int] | None) -> Tensor:  # fmt: skip
        """:meth:`move` with the block bookkeeping in two launches (:mod:`tiered_radix.kernels.
        moves`): blocks claimed (the same ones, in the same order, as the PyTorch path takes),
        the new representations' data made, then the references moved."""
        m, quant = ly.numel(), self.layout.quant is not None
        bound = {k: m if make is None else min(make.get(k, m), m) for k in (Q, R)}
        q, rows = (self.q_stacks.stack() if quant else None), self.row_stacks.stack()
        c = moves.move_claim(
            self.block_all, self._codes, q, rows, ly, h, w, old, new,
            make_q=quant and bound[Q] > 0, make_r=quant and bound[R] > 0,
            keep_rows=self._rows_held, evicts=self.layout.evict_index is not None,
            tally=self.tally.t, err=self._broken,
        )  # fmt: skip
        made = ((Q, self.q_stacks, c.src_q, c.blk_q, c.got_q),
                (R, self.row_stacks, c.src_r, c.blk_r, c.got_r))  # fmt: skip
        for kind, stacks, src, blk, got in made if quant else ():  # Q first: R is from Q
            if bound[kind]:
                stacks.changed(taken=bound[kind])
                for cut in self._make_slices(m):
                    self._make_slice(kind, ly[cut], src[cut], blk[cut], got[cut])
        self._refs(ly, h, w, old, c.reached)
        return c.reached

    def _refs(self, ly: Tensor, h: Tensor, w: Tensor, old: Tensor, new: Tensor | None) -> None:
        """The kernel path's reference moves (:func:`tiered_radix.kernels.moves.move_refs`;
        ``new=None``: a release): freed rows NaN-poisoned, the stacks' and counters' host copies
        queued, the invariants checked on the device."""
        quant = self.layout.quant is not None
        row = moves.move_refs(
            self.block_all, self.ref_all, self._codes, self.q_stacks.stack() if quant else None,
            self.row_stacks.stack(), ly, h, w, old, new, tally=self.tally.t, err=self._broken,
        )  # fmt: skip
        self.rows_k_all[ly, row] = torch.nan
        self.rows_v_all[ly, row] = torch.nan
        self.row_stacks.changed()
        if quant:
            self.q_stacks.changed()
        self.tally.changed()
        _check(self._broken.eq(0).all(), "pool move invariant broken: counts of references to "
               "missing blocks or below zero, evicted windows planned back, restores without a "
               "ledger copy")  # fmt: skip

    def _make_slices(self, m: int) -> list[slice]:
        """Slices of a move's ``m`` pairs whose float32 K/V fit :data:`_MAKE_BYTES` each."""
        step = max(1, _MAKE_BYTES // (2 * 4 * self.layout.window * self.head_dim))
        return [slice(s, s + step) for s in range(0, m, step)]

    @property
    def degraded(self) -> int:
        """Pairs that moves could not bring to their planned state so far (the pool was short of
        blocks; host read of a device counter). The first time it is non-zero it is logged."""
        n = self.tally.host()[1]
        if n and not self._warned_short:
            self._warned_short = True
            log.warning(
                "tiered-radix: %d blocks short in routings; those windows went to the next tier "
                "down (ledger) or stayed quantized (rows): the pool's degraded moves", n,
            )  # fmt: skip
        return n

    def short_possible(self, make: dict[int, int]) -> bool:
        """Whether a move that makes at most ``make[kind]`` new representations of ``Q``/``R``
        might find a layer short of blocks, from host lower bounds of the free counts
        (:meth:`.freelist.FreeStacks.floor`, no wait). Where not, the states it reaches are
        those planned, and nobody needs to compare them."""
        if self.layout.quant is None:
            return False
        return (self.q_stacks.floor() < make[Q]
                or self.row_stacks.floor() < make[R] + self._rows_held)  # fmt: skip

    def _make(self, kind: int, ly: Tensor, h: Tensor, w: Tensor, src: Tensor, block: Tensor,
              got: Tensor) -> None:  # fmt: skip
        """Write representation ``kind`` of the pairs with ``got`` into their new ``block``
        (int64 ``[m]``). Every pair is computed, those without a block write zeros or NaN into
        block 0 (the traps: zeros and NaN already), so the work needs no host sync. The pairs
        go in slices of at most :data:`_MAKE_BYTES` of float32 K/V (a slice count from ``m``,
        known on the host): the temporaries stay bounded however many pairs a routing moves."""
        if kind == Q:  # a pair without its ledger copy reads rows: FULL, or R (restored)
            blk = self.block_all[ly, :, h, w].long()
            src_block = torch.where(src == S_R, blk[:, R], blk[:, FULL])
        else:  # R: dequantize(Q), which the holder has or is about to acquire
            src_block = self.block_all[ly, Q, h, w]
            _check(((src_block > 0) | ~got).all(), "restoring a window without a ledger copy")
            self.tally.t[0] += got.sum()
        for cut in self._make_slices(ly.numel()):
            self._make_slice(kind, ly[cut], src_block[cut], block[cut], got[cut])
        cur = self.block_all[ly, kind, h, w]
        self.block_all[ly, kind, h, w] = torch.where(got, block.to(cur.dtype), cur)

    def _make_slice(self, kind: int, ly: Tensor, src_block: Tensor, block: Tensor,
                    got: Tensor) -> None:  # fmt: skip
        """:meth:`_make`'s data movement for one slice of pairs: ``kind`` ``Q`` packs the rows
        in ``src_block`` into ledger pages ``block``, ``R`` dequantizes the ledger pages in
        ``src_block`` into row blocks ``block`` (all int ``[n]``, layers ``ly [n]``)."""
        if kind == Q:
            k, v = self.rows_k_all[ly, src_block].float(), self.rows_v_all[ly, src_block].float()
            bits, g = self.layout.quant.bits, self.v_group
            self.pages_all[ly, block] = torch.where(got[:, None], pack_pages(k, v, bits, g), 0)
        else:
            k, v = self._unpage(ly, src_block)
            keep = got[:, None, None]
            self.rows_k_all[ly, block] = torch.where(keep, k, torch.nan).to(self.dtype)
            self.rows_v_all[ly, block] = torch.where(keep, v, torch.nan).to(self.dtype)

    # -- decoupled policies: repacking (.zones) -------------------------------------------------
    def read_request(self, rid: str, layer_id: int, windows: Tensor, n_tokens: int):
        """What decoupled request ``rid`` reads in ``layer_id`` over its ``windows [n]`` (its
        first ``n_tokens`` tokens): float32 ``k, v [H, n_tokens, d]`` and ``kept`` (evicted rows
        NaN): its Zone A pages after a routing, its window rows for tokens in no page."""
        k, v, kept = self.read(layer_id, windows)
        k, v, kept = k[:, :n_tokens], v[:, :n_tokens], kept[:, :n_tokens]
        li = layer_id - self.start_layer
        if self.zones is None or self.zones.placed_layer(rid, li) is None:
            return k, v, kept
        kz, vz, listed, kz_kept = self.zones.read(rid, li)
        m = kz.shape[1]
        on = listed[..., None]
        k = torch.cat([torch.where(on, kz, k[:, :m]), k[:, m:]], 1)
        v = torch.cat([torch.where(on, vz, v[:, :m]), v[:, m:]], 1)
        kept = torch.cat([kz_kept, kept[:, m:]], 1)
        on = kept[..., None]
        return torch.where(on, k, torch.nan), torch.where(on, v, torch.nan), kept

    def repack(self, rid: str, windows: Tensor, n_tokens: int,
               decided: list[tuple]) -> Tensor | None:  # fmt: skip
        """A decoupled request's routing: every layer's tokens, as the request reads them now
        (:meth:`read_request`), repacked into Zone A pages (:mod:`.zones`) at the engine's
        decisions ``decided[l] = (v_bits [H, T], k_bits [H, d], in_set [H, T])``; what it held
        before is freed. Returns which of ``windows`` its pages now cover whole (bool ``[n]``:
        every token routed, and none of them kept outside a page in any layer or head, so the
        request reads none of the window's rows; :meth:`.radix.TieredRadixCache.page_out`
        lets go of them), or None where the pages did not land: where the Zone A store has no
        room the routing is degraded, not raised (an exception would end every request the
        scheduler runs): the request keeps reading what it held (its rows at full precision,
        or its last routing's pages) while its engine counts the decided bytes, and
        :attr:`zone_full` counts it (``zone_full_routings`` in the stats)."""
        packed = []
        host = _on_host(decided)  # page lists are built on the host: one copy, not 3 a layer
        H, d = self.head_num, self.head_dim
        group = max(1, _PACK_BYTES // (8 * H * max(n_tokens, 1) * d))  # layers a pack
        for l0 in range(0, len(host), group):
            part = host[l0 : l0 + group]
            kv = [self.read_request(rid, li + self.start_layer, windows, n_tokens)[:2]
                  for li in range(l0, l0 + len(part))]  # fmt: skip
            vb, kb, in_set = (torch.stack(x) for x in zip(*part, strict=True))
            packed += zone_a.pack_layers(
                [k for k, _ in kv], [v for _, v in kv], vb, kb, in_set,
                page_size=self.layout.window, v_group=self.v_group, raw_dtype=self.dtype,
            )  # fmt: skip
        kept = [d[0] > 0 for d in host]  # the decode lists are counted on the host
        try:
            self.zones.put(rid, packed, n_tokens, kept)
        except ZoneFullError as err:
            self.zone_full += 1
            if self.zone_full == 1:
                log.warning("%s: request %s reads what it held (counted in zone_full_routings)",
                            err, rid)  # fmt: skip
            return None
        covered = torch.zeros(windows.numel(), dtype=torch.bool, device=windows.device)
        covered[: n_tokens // self.layout.window] = True
        rows = self.zones.decode_lists(rid)
        if rows is not None and rows.n_rows:
            covered[rows.row_tok.to(windows.device) // self.layout.window] = False
        return covered

    def drop_request(self, rid: str) -> None:
        """Free decoupled request ``rid``'s Zone A pages (its view closed)."""
        if self.zones is not None:
            self.zones.drop(rid)

    def release_pages(self, pages: Tensor) -> None:
        """The allocator freed ``pages`` (= windows): their owner lets go in every layer."""
        pages = torch.unique(pages.long())
        ly, h, w = self.pairs(pages)
        st = self.owner_all[:, :, pages].long().flatten()  # in pairs' order
        st = torch.where(st >= 0, st, S_EVICT)  # nobody owns it: holds nothing
        self.release(ly, h, w, st)
        self.owner_all[:, :, pages] = -1
        if self.paged is not None:
            self.paged[pages] = False

    # -- accounting ------------------------------------------------------------------------
    def blocks_in_use(self) -> dict[int, int]:
        """Blocks held per representation kind (``FULL``, ``R``, ``Q``), over layers and heads,
        from the free lists (no device work: every taken block is one entry of ``block_all``)."""
        F, Qn = self.blocks.full, self.blocks.quant
        rows = sum(F - n for n in self.row_stacks.counts())
        restored = self.tally.host()[0]
        return {
            FULL: rows - restored,
            R: restored,
            Q: sum(Qn - n for n in self.q_stacks.counts()),
        }

    def counts_ready(self) -> bool:
        """Whether :meth:`bytes_used` can be read without waiting for the device (the pinned
        copies of the free and restored counts after their last change are done)."""
        stacks = (self.row_stacks, self.q_stacks)
        return self.tally.ready() and all(s.ready() for s in stacks)

    def bytes_used(self) -> int:
        """Bytes of allocated blocks (rows: K+V of one head-window; ledger: one page)."""
        held = self.blocks_in_use()
        zones = 0 if self.zones is None else self.zones.bytes_used()
        rows = (held[FULL] + held[R]) * 2 * self.rows_k[0][0].nbytes
        return rows + held[Q] * self.page_bytes + zones

    def occupancy(self) -> tuple[dict[str, int], dict[str, int]]:
        """Units per owner state (``reps.STATE_NAMES``; windows nobody owns are not counted) and
        blocks in use per representation (``full``, ``restored`` rows, ``ledger`` pages), summed
        over layers and heads. One histogram of the owner table (its states as bytes: nobody's,
        -1, is bin 255), one host sync for its counts; the blocks come from the free lists (the
        block table, int32 ``[L, K, H, NW]``, is GBs at the allocator's 10x slots: three passes
        over it cost ~1 ms of device time a routing)."""
        own = self.owner_all.view(torch.uint8).flatten()  # int8 [L, H, NW] as bytes
        c = torch.bincount(own, minlength=256)[: len(reps.STATE_NAMES)].tolist()
        held = self.blocks_in_use()
        blocks = zip(BLOCK_KINDS, (held[k] for k in (FULL, R, Q)), strict=True)
        return dict(zip(reps.STATE_NAMES, c, strict=True)), dict(blocks)

    def blocks_free(self) -> tuple[int, int]:
        """Free row blocks and free ledger blocks, over layers."""
        return sum(self.row_stacks.counts()), sum(self.q_stacks.counts())


def _on_host(decided: list[tuple]) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Every layer's ``(v_bits, k_bits, in_set)`` copied to the host in one transfer (one
    wait for the device per routing; Zone A page lists are counted on the host)."""
    parts = [x.reshape(-1).long() for d in decided for x in d]
    flat = torch.cat(parts).cpu() if parts else torch.zeros(0, dtype=torch.long)
    out, i = [], 0
    for d in decided:
        got = []
        for x in d:
            got.append(flat[i : i + x.numel()].view(x.shape).to(x.dtype))
            i += x.numel()
        out.append(tuple(got))
    return out
