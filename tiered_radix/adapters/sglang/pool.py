"""``TieredKVPool``: SGLang's per-layer MHA pool, stored as refcounted per-(head, window) blocks.

Slots and windows: the pool runs with ``page_size = W`` (the policy's window; 1 for token units),
so SGLang's page ``p`` is logical window ``p`` and slot ``s`` is token ``s % W`` of window
``s // W``. Window 0 (slot 0's page) is SGLang's padding page: writes there are dropped.

Storage per layer (``F`` row blocks and ``Qn`` ledger blocks, index 0 of each is a NaN trap):

- ``rows_k[l], rows_v[l]``: ``dtype [F + 1, W, d]``: the ``FULL`` and ``R`` representations;
- ``q_k[l], q_v[l]``: packed ledger copies (:class:`~tiered_radix.engine.ledger.PartCodec` of the
  policy's quantized tier): codes ``uint8``, scale and lo ``fp16``, ``[Qn + 1, ...]``;
- ``block[l]``: int64 ``[3, H, NW]`` block id of each representation (``reps.FULL/Q/R``), 0 none;
- ``ref[l]``: int32 ``[3, H, NW]`` holders per representation; a block is freed at 0;
- ``owner[l]``: int8 ``[H, NW]`` the owner's state (``reps.S_*``), -1 for a window nobody owns.

Sizing: :mod:`.sizing`.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from torch import Tensor

from tiered_radix.engine.codecs import QuantizedTensor
from tiered_radix.engine.ledger import part_codecs
from tiered_radix.policy.model import Budget, Policy

from .reps import FULL, S_EVICT, S_FULL, S_Q, S_R, Layout, PoolConfigError, Q, R
from .sizing import PoolBlocks, plan_blocks


class PoolFullError(RuntimeError):
    """The tiered pool has no free block of the kind a write or a transition needs."""


class TieredKVPool(MHATokenToKVPool):
    """The tiered pool. Holders (see :mod:`.reps`) move between states with :meth:`move`;
    :meth:`read` is the reference for what the tiered attention backend must gather.

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
        enable_memory_saver: bool = False,
        **kwargs,
    ) -> None:
        self.layout = Layout.of(policy)
        if page_size != self.layout.window:
            raise PoolConfigError(
                f"the tiered pool needs --page-size {self.layout.window} (the policy's window), "
                f"got {page_size}"
            )
        self.policy, self.budget = policy, budget or policy.budget
        itemsize = torch.empty(0, dtype=dtype).element_size()
        self.blocks = blocks or plan_blocks(size, head_num, head_dim, itemsize, policy, self.budget)
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

    # -- storage ---------------------------------------------------------------------------
    def _create_buffers(self) -> None:
        L, H, d, W = self.layer_num, self.head_num, self.head_dim, self.layout.window
        F, Qn, dev = self.blocks.full, self.blocks.quant, self.device
        self.n_windows = self.size // W + 1
        self.rows_k = [
            torch.full((F + 1, W, d), torch.nan, dtype=self.dtype, device=dev) for _ in range(L)
        ]
        self.rows_v = [torch.full_like(x, torch.nan) for x in self.rows_k]
        self.codec = {}
        self.q_k, self.q_v = [], []
        if self.layout.quant is not None:
            q = self.layout.quant
            kc, vc = part_codecs(q.bits, q.group, q.axis, W, d)
            self.codec = {"k": kc, "v": vc}
            for store, c in ((self.q_k, kc), (self.q_v, vc)):
                one = c.encode(torch.zeros(1, W, d, device=dev))
                for _ in range(L):
                    store.append(
                        [t.new_zeros(Qn + 1, *t.shape[1:]) for t in (one.codes, one.scale, one.lo)]
                    )
        self.block = [
            torch.zeros(3, H, self.n_windows, dtype=torch.long, device=dev) for _ in range(L)
        ]
        self.ref = [
            torch.zeros(3, H, self.n_windows, dtype=torch.int32, device=dev) for _ in range(L)
        ]
        self.owner = [
            torch.full((H, self.n_windows), -1, dtype=torch.int8, device=dev) for _ in range(L)
        ]
        self.free_rows = [list(range(F, 0, -1)) for _ in range(L)]
        self.free_q = [list(range(Qn, 0, -1)) for _ in range(L)]
        self.k_buffer = self.v_buffer = None  # no per-slot rows: stock backends cannot read us
        s = torch.tensor(
            [
                [k in self.layout.reps(st) for k in (FULL, Q, R)]
                for st in (S_FULL, S_Q, S_R, S_EVICT)
            ]
        )
        self._holds = s.to(dev)  # bool [state, kind]

    def _clear_buffers(self) -> None:
        del self.rows_k, self.rows_v, self.q_k, self.q_v

    def get_kv_size_bytes(self) -> tuple[int, int]:
        """Bytes of the physical storage (row blocks, ledger codes/scales/lo), K and V."""
        k = sum(x.nbytes for x in self.rows_k) + sum(t.nbytes for s in self.q_k for t in s)
        v = sum(x.nbytes for x in self.rows_v) + sum(t.nbytes for s in self.q_v for t in s)
        return k, v

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
        allocates its ``FULL`` blocks for every head, owned (state full) by the slots' owner."""
        li = layer_id_override if layer_id_override is not None else layer.layer_id
        li -= self.start_layer
        W = self.layout.window
        loc = loc.long()
        keep = loc >= W  # window 0 is the padding page
        loc, cache_k, cache_v = loc[keep], cache_k[keep], cache_v[keep]
        win, off = loc // W, loc % W
        new = torch.unique(win[self.owner[li][0, win] < 0])
        if new.numel():
            h, w = torch.meshgrid(
                torch.arange(self.head_num, device=self.device), new, indexing="ij"
            )
            self.block[li][FULL, h, w] = self._take(self.free_rows[li], h.numel(), "row").view(
                h.shape
            )
            self.ref[li][FULL, h, w] = 1
            self.owner[li][:, new] = S_FULL
        assert bool((self.owner[li][:, win] == S_FULL).all()), "write into a routed window"
        b = self.block[li][FULL][:, win]  # [H, n]
        self.rows_k[li][b, off] = cache_k.transpose(0, 1).to(self.dtype)
        self.rows_v[li][b, off] = cache_v.transpose(0, 1).to(self.dtype)

    def _take(self, free: list[int], n: int, what: str) -> Tensor:
        if n > len(free):
            raise PoolFullError(
                f"tiered pool: {n} {what} blocks needed, {len(free)} free; lower the load, "
                "raise the budget, or let routing demote more before the next prefill"
            )
        out = [free.pop() for _ in range(n)]
        return torch.tensor(out, dtype=torch.long, device=self.device)

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
        kept = (state != S_EVICT).repeat_interleave(W, dim=1)
        return k.reshape(H, n * W, d), v.reshape(H, n * W, d), kept

    def _rows_of(self, li: int, h: Tensor, w: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
        """float32 ``[m, W, d]`` K and V of pairs ``(h, w)`` as read in ``state [m]``."""
        W, d = self.layout.window, self.head_dim
        k = torch.full((h.numel(), W, d), torch.nan, device=self.device)
        v = torch.full_like(k, torch.nan)
        for st, kind in ((S_FULL, FULL), (S_R, R)):
            m = state == st
            b = self.block[li][kind, h[m], w[m]]
            k[m], v[m] = self.rows_k[li][b].float(), self.rows_v[li][b].float()
        m = state == S_Q
        if bool(m.any()):
            b = self.block[li][Q, h[m], w[m]]
            k[m], v[m] = self._decode(self.q_k[li], "k", b), self._decode(self.q_v[li], "v", b)
        return k, v

    def _decode(self, store: list[Tensor], part: str, b: Tensor) -> Tensor:
        c = self.codec[part]
        n = self.layout.window if c.along_tokens else self.head_dim
        return c.decode(QuantizedTensor(*(t[b] for t in store), c.bits, c.group, n))

    # -- holders ---------------------------------------------------------------------------
    def holds(self, state: Tensor, kind: int) -> Tensor:
        return self._holds[state.long(), kind]

    def acquire(self, li: int, h: Tensor, w: Tensor, state: Tensor) -> None:
        """One more holder of the representations of ``state [m]`` (they must exist)."""
        for kind in (FULL, Q, R):
            m = self.holds(state, kind)
            assert bool((self.block[li][kind, h[m], w[m]] > 0).all()), "acquire of a missing rep"
            self.ref[li][kind, h[m], w[m]] += 1

    def release(self, li: int, h: Tensor, w: Tensor, state: Tensor) -> None:
        """One holder fewer; representations nobody holds are freed (rows NaN-poisoned)."""
        for kind in (FULL, Q, R):
            m = self.holds(state, kind)
            hm, wm = h[m], w[m]
            self.ref[li][kind, hm, wm] -= 1
            gone = self.ref[li][kind, hm, wm] == 0
            b = self.block[li][kind, hm[gone], wm[gone]]
            assert bool((self.ref[li][kind] >= 0).all()), "refcount below zero"
            if kind == Q:
                self.free_q[li].extend(b.tolist())
            else:
                self.rows_k[li][b] = torch.nan
                self.rows_v[li][b] = torch.nan
                self.free_rows[li].extend(b.tolist())
            self.block[li][kind, hm[gone], wm[gone]] = 0

    def move(self, li: int, h: Tensor, w: Tensor, old: Tensor, new: Tensor) -> None:
        """One holder of pairs ``(h, w) [m]`` (unique) goes from state ``old`` to ``new``:
        missing representations are made (``Q`` from what the holder reads now, write-once;
        ``R`` from ``Q``), then the holder's references move."""
        ch = old != new
        h, w, old, new = h[ch], w[ch], old[ch], new[ch]
        assert not bool((old == S_EVICT).any()), "an evicted window cannot come back"
        for kind in (Q, R):
            need = self.holds(new, kind) & (self.block[li][kind, h, w] == 0)
            if bool(need.any()):
                self._make(li, kind, h[need], w[need], old[need])
        self.acquire(li, h, w, new)
        self.release(li, h, w, old)

    def _make(self, li: int, kind: int, h: Tensor, w: Tensor, src: Tensor) -> None:
        if kind == Q:
            k, v = self._rows_of(li, h, w, src)
            b = self._take(self.free_q[li], h.numel(), "ledger")
            for store, part, x in ((self.q_k[li], "k", k), (self.q_v[li], "v", v)):
                q = self.codec[part].encode(x)
                for t, new in zip(store, (q.codes, q.scale, q.lo), strict=True):
                    t[b] = new
        else:  # R: dequantize(Q), which the holder has or is about to acquire
            qb = self.block[li][Q, h, w]
            assert bool((qb > 0).all()), "restoring a window without a ledger copy"
            b = self._take(self.free_rows[li], h.numel(), "row")
            self.rows_k[li][b] = self._decode(self.q_k[li], "k", qb).to(self.dtype)
            self.rows_v[li][b] = self._decode(self.q_v[li], "v", qb).to(self.dtype)
        self.block[li][kind, h, w] = b

    def release_pages(self, pages: Tensor) -> None:
        """The allocator freed ``pages`` (= windows): their owner lets go in every layer."""
        pages = torch.unique(pages.long())
        for li in range(self.layer_num):
            st = self.owner[li][:, pages]
            owned = st >= 0
            h = torch.arange(self.head_num, device=self.device)[:, None].expand_as(st)
            w = pages[None].expand_as(st)
            self.release(li, h[owned], w[owned], st[owned].long())
            self.owner[li][:, pages] = -1

    # -- accounting ------------------------------------------------------------------------
    def bytes_used(self) -> int:
        """Bytes of allocated blocks (rows: K+V of one head-window; ledger: packed K+V)."""
        F, Qn = self.blocks.full, self.blocks.quant
        rows = sum(F - len(f) for f in self.free_rows)
        q = sum(Qn - len(f) for f in self.free_q)
        row_b = 2 * self.rows_k[0][0].nbytes
        q_b = sum(t[0].nbytes for t in (*self.q_k[0], *self.q_v[0])) if self.q_k else 0
        return rows * row_b + q * q_b
