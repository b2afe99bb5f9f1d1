"""Decode under CUDA graphs: the step's index lists, write rows and side output at fixed addresses.

A captured graph replays the kernels it recorded on the tensors it saw at capture, so everything
a decode step's kernels read that changes between steps lives in buffers allocated once, at
capacity (:class:`GraphDecode`), and each step only overwrites their contents:

- index lists per layer (``[L, capacity + 1]``, offsets local to the layer, the last entry a
  dump): the real requests' entries (:func:`.trizone.candidates`, of fixed shapes) are scattered
  to their places without a host sync, and the padded requests of a captured batch size list
  nothing (their output rows are discarded by SGLang). Each list
  ends in its last window's future rows, unread past ``full_end [L, bs * H]`` (the kernel's
  per-list end), so the steps until a new window opens only move ``full_end`` on;
- ``dest [L, bs * H]``: each new token's row in the pool (:meth:`.pool.TieredKVPool.graph_write`),
  padding tokens to the pool's scratch row block;
- ``mass [L, bs, H * N]``: the side output, ``N`` windows per request (the context length's).
  With ``decay`` (the policy's :meth:`~tiered_radix.engine.store.TierStore.attn_decay`) it sums
  the steps since the last fold as ``mass = decay * mass + step`` (``steps`` of them), so the
  engines take them in one fold before routing (or when the batch changes) instead of one
  observation per step. A request's units keep their places while the batch stays the same
  (unit ``h * N + j`` of its row), so lists rebuilt for a new window carry the sum on.

Capacity is in tokens of the batch: a request lists at most its ``seq`` tokens and the ``W - 1``
future rows of its last window per (layer, head) as rows plus pages, so a batch whose
``sum(seq_lens) + W * len(seq_lens) <= tokens`` fits; larger batches run
eagerly (:meth:`GraphDecode.fits`, checked before SGLang picks the graph). ``tokens`` is
``--kv-graph-tokens``, at least one context; by default (:func:`auto_tokens`) every captured
request at full context, within an eighth of the device memory free when the graphs are set up
and never under :data:`GRAPH_TOKENS`: a tiered pool holds several times a bf16 pool's tokens,
so its running batches outgrow a fixed capacity (docs/sglang.md, *CUDA graphs*).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from tiered_radix.kernels import decode

from . import trizone, zone_decode

GRAPH_TOKENS = 1 << 18  # the default capacity's floor
GRAPH_MEMORY_SHARE = 8  # the default capacity takes at most 1/8 of the free device memory
ALL = slice(None)  # every layer of a buffer


def auto_tokens(
    max_bs: int, context_len: int, window: int, token_bytes: int, free: int, fixed: int = 0
) -> int:
    """``--kv-graph-tokens``' default: ``max_bs`` requests of ``context_len`` tokens and a
    window of future rows each, as far as ``1 / GRAPH_MEMORY_SHARE`` of ``free`` device bytes,
    less the ``fixed`` bytes the buffers take whatever their tokens (the side output:
    :func:`mass_bytes`), pays for at ``token_bytes`` a token (:func:`token_bytes`), and at
    least :data:`GRAPH_TOKENS` (``free = 0``, on CPU: exactly that unless the batches need
    less)."""
    want = max_bs * (context_len + window)
    share = max(free // GRAPH_MEMORY_SHARE - fixed, 0)
    return min(want, max(share // max(token_bytes, 1), GRAPH_TOKENS))


def token_bytes(
    layers: int, heads: int, head_dim: int, window: int, max_bs: int, paged: bool = True
) -> int:
    """Bytes of :class:`GraphDecode`'s buffers per token of capacity (:func:`buffer_bytes`' slope,
    rounded up: index lists per layer and head for rows, and for pages if ``paged``)."""
    span = window * 1024
    grow = buffer_bytes(layers, heads, head_dim, window, max_bs, span, window, False, paged)
    base = buffer_bytes(layers, heads, head_dim, window, max_bs, 0, window, False, paged)
    return -(-(grow - base) // span)


def mass_bytes(layers: int, heads: int, max_bs: int, n_max: int) -> int:
    """Bytes of the side output (float32 ``[L, max_bs, H * n_max]``, :func:`unit_count`): 1.5
    GiB for token units at batch 256 and a 32K context on Qwen2.5-0.5B's 24 layers."""
    return 4 * layers * max_bs * heads * n_max


def unit_count(pool, context_len: int) -> int:
    """A request's units per head at ``context_len`` (``n_max``: units are ``h * n_max + j``):
    its windows, or its tokens over a decoupled pool (units are tokens there,
    :mod:`.zone_decode`)."""
    return context_len if pool.zones is not None else -(-context_len // pool.layout.window)


def capacity(context_len: int, tokens: int) -> int:
    """Tokens a captured batch can hold (``tokens``, ``--kv-graph-tokens``; at least one
    context)."""
    return max(tokens, context_len)


def buffer_bytes(
    layers: int, heads: int, head_dim: int, window: int, max_bs: int, tokens: int,
    context_len: int, side_output: bool, paged: bool = True,
) -> int:  # fmt: skip
    """Device bytes of :class:`GraphDecode`'s buffers (sized by batch and token capacity, not by
    the pool's slots: they come out of the memory SGLang keeps for CUDA graphs). ``paged``:
    the pool has pages to list (:func:`lists_pages`)."""
    L, H, W, d = layers, heads, window, head_dim
    lists, n_max = max_bs * H, -(-context_len // W)
    rows = H * tokens + 1  # with the dump entry
    pages = (H * (-(-tokens // W) + max_bs) if paged else 0) + 1
    i32 = 4 * (
        L * (lists + 1) + L * lists + 2 * L * rows + L * (4 * lists + 1)
        + L * pages + L * pages * W + 2 * pages + 4 * lists * 12 + lists * d
    )  # fmt: skip
    i64 = 8 * (L * pages + L * lists)  # page offsets, dest
    mass = 4 * L * max_bs * H * n_max if side_output else 0
    return i32 + i64 + mass


def lists_pages(pool) -> bool:
    """Whether a pool's decode lists hold pages: a decoupled pool's (Zone A), or a coupled one
    with a quantized tier."""
    return pool.zones is not None or pool.layout.quant is not None


class GraphDecode:
    """Fixed-address decode state for batch sizes up to ``max_bs`` (one set of buffers: a
    batch size uses their first rows), ``tokens`` tokens a batch, requests of up to
    ``context_len`` tokens; ``splits``: the kernel's splits per list (``--kv-graph-splits``;
    ``None``: :meth:`_splits` of the batch size)."""

    def __init__(
        self, pool, max_bs: int, tokens: int, context_len: int, side_output: bool,
        decay: float | None = None, splits: int | None = None,
    ):  # fmt: skip
        L, H, W, d = pool.layer_num, pool.head_num, pool.layout.window, pool.head_dim
        dev = pool.device
        self.pool, self.max_bs, self.tokens, self.side_output = pool, max_bs, tokens, side_output
        self.splits = splits
        self.decay = decay if side_output else None
        # per request row of the batch: steps summed in its mass (with decay) since it was
        # last folded (:meth:`folded`) or the lists changed without a carry
        self.row_steps: list[int] = []
        self.bs = 0  # the batch size of the last load() or clear()
        self.context_len = context_len
        # a decoupled pool's requests read Zone A pages of their own, per layer (.zone_decode):
        # units are tokens, each (request, head) ends up to 4 pages short (one per V width),
        # and pages, K sections and channel orders are per layer
        self.decoupled = pool.zones is not None
        self.n_max = unit_count(pool, context_len)  # units h * n_max + j
        per_list = 4 if self.decoupled else 1
        self.rows = H * tokens
        # a pool without a quantized tier (h2o, snapkv, streaming) lists no page: its page
        # buffers hold the dump entry alone (at token units they were most of the buffers)
        paged = lists_pages(pool)
        self.pages = H * (-(-tokens // W) + per_list * max_bs) if paged else 0
        i32 = dict(dtype=torch.int32, device=dev)
        self.full_ptr = torch.zeros(L, max_bs * H + 1, **i32)
        self.full_end = torch.zeros(L, max_bs * H, **i32)
        # a layer's row and page buffers end in a dump entry: what a step does not list is
        # scattered there (:meth:`load`: fixed shapes, no host sync)
        self.slots = torch.zeros(L, self.rows + 1, **i32)
        self.units = torch.zeros(L, self.rows + 1, **i32)
        self.page_ptr = torch.zeros(L, max_bs * H * 4 + 1, **i32)
        self.page_off = torch.zeros(L, self.pages + 1, dtype=torch.long, device=dev)
        self.page_unit = torch.zeros(L, self.pages + 1, **i32)
        self.page_units = torch.zeros(L, self.pages + 1, W, **i32)
        self.page_ids = torch.arange(self.pages + 1, **i32)
        if self.decoupled:
            self.page_ntok = torch.full((L, self.pages + 1), W, **i32)
            self.k_table = torch.zeros(L, max_bs * H * 4, 12, **i32)
            self.perm = torch.arange(d, **i32).repeat(L, max_bs * H, 1)
        else:
            self.page_ntok = torch.full((self.pages + 1,), W, **i32)
            self.k_table = trizone.k_table(pool, max_bs * H)
            self.perm = torch.arange(d, **i32).repeat(max_bs * H, 1)
        self.mass = (
            torch.zeros(L, max_bs, H * self.n_max, dtype=torch.float32, device=dev)
            if side_output
            else None
        )
        self.dest = torch.zeros(L, max_bs * H, dtype=torch.long, device=dev)
        self.batches: dict[int, trizone.DecodeBatch] = {}
        self.score: Tensor | None = None  # the side output's logits, shared by every plan

    def fits(self, seq_lens: list[int]) -> bool:
        """Whether a batch with these lengths fits the buffers (each request lists at most its
        tokens and its last window's future rows per layer and head)."""
        W = self.pool.layout.window
        return len(seq_lens) <= self.max_bs and sum(seq_lens) + W * len(seq_lens) <= self.tokens

    def batch(self, bs: int, num_q_heads: int) -> trizone.DecodeBatch:
        """The :class:`~.trizone.DecodeBatch` of captured size ``bs`` over the buffers (made
        once; its plan is for requests of ``context_len`` tokens, split :meth:`_splits` ways
        or the ``splits`` it was made with)."""
        if bs in self.batches:
            return self.batches[bs]
        if self.decoupled:
            return self._batch_decoupled(bs, num_q_heads)
        pool, H = self.pool, self.pool.head_num
        lays = [
            trizone.layout(
                pool,
                li,
                bs,
                full_indptr=self.full_ptr[li, : bs * H + 1],
                full_end=self.full_end[li, : bs * H],
                full_slots=self.slots[li],
                full_units=self.units[li],
                page_indptr=self.page_ptr[li, : bs * H * 4 + 1],
                page_off=self.page_off[li],
                page_ntok=self.page_ntok,
                page_units=self.page_units[li],
                page_unit=self.page_unit[li],
                page_ids=self.page_ids,
                k_table=self.k_table[: bs * H * 4],
                perm=self.perm[: bs * H],
                max_units=H * self.n_max,
            )
            for li in range(pool.layer_num)
        ]
        quant = pool.layout.quant
        bits = (quant.bits,) if quant else ()
        splits = self.splits or self._splits(bs)
        plan = decode.plan(
            lays[0], num_q_heads=num_q_heads, side_output=self.side_output, v_bits=bits,
            k_bits=bits, max_rows=self.context_len, num_splits=splits,
        )  # fmt: skip
        return self._keep(bs, lays, plan)

    def _keep(self, bs: int, lays, plan) -> trizone.DecodeBatch:
        if self.side_output:  # every batch size's plan needs the same rows: share one buffer
            if self.score is None or self.score.shape != plan.score.shape:
                self.score = plan.score
            plan = dataclasses.replace(plan, score=self.score)
        mass = self.mass[:, :bs] if self.side_output else None
        out = trizone.DecodeBatch(lays, plan, mass, [0] * bs, self.n_max)
        self.batches[bs] = out
        return out

    def _batch_decoupled(self, bs: int, num_q_heads: int) -> trizone.DecodeBatch:
        """:meth:`batch` over a decoupled pool: every layer's own page buffers."""
        pool, H = self.pool, self.pool.head_num
        lays = [
            zone_decode.layout(
                pool, li, bs, full_indptr=self.full_ptr[li, : bs * H + 1],
                full_end=self.full_end[li, : bs * H], full_slots=self.slots[li],
                full_units=self.units[li], page_indptr=self.page_ptr[li, : bs * H * 4 + 1],
                page_off=self.page_off[li], page_ntok=self.page_ntok[li],
                page_units=self.page_units[li], page_unit=self.page_unit[li],
                page_ids=self.page_ids, k_table=self.k_table[li, : bs * H * 4],
                perm=self.perm[li, : bs * H], max_units=H * self.n_max,
            )
            for li in range(pool.layer_num)
        ]  # fmt: skip
        splits = self.splits or self._splits(bs)
        plan = zone_decode.plan(lays[0], num_q_heads, self.side_output, self.context_len, splits)
        return self._keep(bs, lays, plan)

    def _splits(self, bs: int) -> int:
        """Splits per list: ~2 programs per SM over the batch's lists, at most 128 and at least
        128 tokens of context a split. A budget lists a fraction of the context, so the plan's
        own choice (~32 programs per SM, for full rows) splits it too finely: the H200 sweep
        (bench/results/sglang-run10) ran Qwen 32K x 8 at qevict 10% in 0.062 ms a layer with 16
        splits, 0.101 ms with 128; at batch 1, 128 and 64 splits were best."""
        dev = torch.device(self.pool.device)
        cuda = dev.type == "cuda"
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if cuda else 132
        want = -(-2 * sms // (bs * self.pool.head_num))
        return max(1, min(128, want, self.context_len // 128))

    def clear(self, bs: int) -> None:
        """Every request of ``bs`` lists nothing (a capture: all of them are padding)."""
        H, self.bs = self.pool.head_num, bs
        self.full_ptr[:, : bs * H + 1] = 0
        self.full_end[:, : bs * H] = 0
        self.page_ptr[:, : bs * H * 4 + 1] = 0
        self._zero_mass(bs)
        self.row_steps = [0] * bs

    @property
    def steps(self) -> int:
        """The most steps any row's side output sums, not folded yet (0: nothing to fold)."""
        return max(self.row_steps, default=0)

    def load(self, bs: int, ls, carry: bool = False) -> None:
        """Take one step's lists (``len(n) <= bs`` requests, units numbered with ``n_max``,
        built with ``ahead``: each list ends in its last window's future rows) into the buffers
        of batch size ``bs``; the rest of ``bs`` lists nothing. ``ls``: a coupled pool's
        :class:`~.trizone.Candidates`, or several of them covering every layer in runs
        (:func:`~.trizone.candidate_chunks`), each scattered into place (no host sync); or a
        decoupled pool's :class:`~.zone_decode.ZoneLists`. ``carry``: the same requests in the
        same order as the last step (a window opened), so the side output not folded yet stays
        and this step's adds to it (:meth:`_start_mass`)."""
        self.bs = bs
        if not self.decoupled:
            for c in [ls] if isinstance(ls, trizone.Candidates) else ls:
                self._check(bs, c)
                self._scatter(bs, c, len(c.n) * self.pool.head_num)
            self._start_mass(bs, carry)
            return
        self._check(bs, ls)
        lists = len(ls.n) * self.pool.head_num
        local, at = self._place(ls.full_ptr, lists, self.rows, ls.slots.numel())
        self.slots.view(-1).index_copy_(0, at, ls.slots)
        self.units.view(-1).index_copy_(0, at, ls.units)
        self._row_ends(bs, local, ls.ahead)
        self._load_pages(bs, ls, lists)
        self._start_mass(bs, carry)

    def _check(self, bs: int, ls) -> None:
        assert ls.n_max == self.n_max and len(ls.n) <= bs and ls.ahead is not None

    def _start_mass(self, bs: int, carry: bool) -> None:
        """The side output before a step with new lists: summed on (``carry`` and a decayed sum
        pending: ``mass = decay * mass``, as :meth:`advance`) or from 0."""
        if carry and self.decay is not None and self.steps:
            self._next_mass(bs)
            return
        self._zero_mass(bs)
        self.row_steps = [1] * bs

    def _next_mass(self, bs: int) -> None:
        """One step more in the side output of batch size ``bs``: summed on with ``decay``
        (``mass = decay * mass``, the kernel adds the step), or from 0 where nothing folds."""
        if self.decay is None:
            self._zero_mass(bs)
        elif self.decay != 1.0:
            self.mass[:, :bs] *= self.decay
        self.row_steps = [n + 1 for n in self.row_steps]

    def _row_ends(self, bs: int, local: Tensor, ahead: Tensor, at: slice = ALL) -> None:
        """The row lists' pointers of batch size ``bs`` from each layer's ``local`` ones (``[L,
        lists + 1]``, the layers ``at``), their written ends (less ``ahead``, the future rows
        each list holds); the padded requests' lists empty."""
        L, lists = local.shape[0], local.shape[1] - 1
        _pad(self.full_ptr[at], local, bs * self.pool.head_num + 1)
        self.full_end[at, :lists] = local[:, 1:] - ahead.view(L, lists)
        self.full_end[at, lists : bs * self.pool.head_num] = local[:, -1:]

    def _scatter(self, bs: int, c: trizone.Candidates, lists: int) -> None:
        """:meth:`load` of a coupled pool's candidates of ``c.layers``: each listed row and page
        goes to its position in its layer's list (a running count over the layer's candidates,
        which are in list order), the others to the layer's dump entry. Device ops only."""
        H, W = self.pool.head_num, self.pool.layout.window
        layers = c.layers or range(self.pool.layer_num)
        at, L = slice(layers.start, layers.stop), len(layers)
        listed = c.listed.reshape(L, -1)
        counts = c.listed.sum((-1, -2)).view(L, lists)
        local = _local_ptr(counts)
        over = "decode lists over the graph capacity"
        torch._assert_async((local[:, -1] <= self.rows).all(), over)
        pos = _positions(listed, self.rows)
        i = torch.arange(W, device=listed.device)
        slots, units = self.slots[at].view(-1), self.units[at].view(-1)
        slots.index_copy_(0, pos, (c.slot + i).reshape(-1).to(torch.int32))
        unit = c.unit[..., None].expand(*c.unit.shape, W)
        units.index_copy_(0, pos, unit.reshape(-1).to(torch.int32))
        self._row_ends(bs, local, c.ahead, at)
        plocal = _local_ptr(c.page_counts.view(L, lists * 4))
        if self.pages:  # a pool without pages lists none (:func:`lists_pages`): nothing to place
            torch._assert_async((plocal[:, -1] <= self.pages).all(), over)
            pos = _positions(c.quant.reshape(L, -1), self.pages)
            off = c.page.reshape(-1) * self.pool.page_bytes
            self.page_off[at].view(-1).index_copy_(0, pos, off)
            unit = c.unit.reshape(-1).to(torch.int32)
            self.page_unit[at].view(-1).index_copy_(0, pos, unit)
            self.page_units[at].view(-1, W).index_copy_(0, pos, unit[:, None].expand(-1, W))
        _pad(self.page_ptr[at], plocal, bs * H * 4 + 1)

    def _load_pages(self, bs: int, ls: zone_decode.ZoneLists, lists: int) -> None:
        """:meth:`load`'s zone A over a decoupled pool: every layer's pages, K sections and
        channel orders (padded lists read no page: their K sections stay as they were)."""
        W = self.pool.layout.window
        local, at = self._place(ls.page_ptr, lists * 4, self.pages, ls.page_off.numel())
        self.page_off.view(-1).index_copy_(0, at, ls.page_off)
        self.page_ntok.view(-1).index_copy_(0, at, ls.page_ntok)
        self.page_unit.view(-1).index_copy_(0, at, ls.page_unit)
        self.page_units.view(-1, W).index_copy_(0, at, ls.page_units)
        _pad(self.page_ptr, local, bs * self.pool.head_num * 4 + 1)
        self.k_table[:, : lists * 4] = ls.k_table
        self.perm[:, :lists] = ls.perm

    def nbytes(self) -> int:
        """Device bytes of the buffers."""
        ts = [self.full_ptr, self.full_end, self.slots, self.units, self.page_ptr, self.page_off,
              self.page_unit, self.page_units, self.page_ntok, self.page_ids, self.k_table,
              self.perm, self.dest] + ([] if self.mass is None else [self.mass])  # fmt: skip
        return sum(t.nbytes for t in ts)

    def advance(self, raw: int) -> None:
        """The next decode step of the same ``raw`` requests when none of them opens a window and
        nothing was routed since :meth:`load`: each new token goes to the row after the last
        one (``dest += 1``), which its list already holds (listed ahead): the list's end moves
        on by one. Two device ops (three with a decayed side output), no host sync."""
        lists = raw * self.pool.head_num
        self.dest[:, :lists] += 1
        self.full_end[:, :lists] += 1
        self._next_mass(self.bs)

    def pending(self) -> trizone.DecodeBatch | None:
        """The batch whose ``mass`` holds steps not folded into the engines yet (``steps`` of
        them, summed with ``decay``), or None."""
        return self.batches.get(self.bs) if self.decay is not None and self.steps else None

    def folded(self, rows: list[int] | None = None) -> None:
        """The engines of batch ``rows`` (default: all) took their summed steps: those rows
        start again from 0 (a device op each), the others keep summing."""
        if rows is None or len(rows) >= len(self.row_steps):
            self._zero_mass(self.bs)
            self.row_steps = [0] * self.bs
            return
        for b in rows:
            if self.mass is not None:
                self.mass[:, b].zero_()
            self.row_steps[b] = 0

    def _zero_mass(self, bs: int) -> None:
        """The side output accumulates (+=): each step of batch size ``bs`` starts from 0."""
        if self.mass is not None:
            self.mass[:, :bs] = 0

    def _place(self, ptr: Tensor, lists: int, cap: int, nnz: int) -> tuple[Tensor, Tensor]:
        """A layer-major global index pointer (``L * lists + 1``) as per-layer local ones
        ``[L, lists + 1]``, and each of its ``nnz`` entries' flat index in an ``[L, cap]``
        buffer."""
        dev = ptr.device
        layer = torch.arange(self.pool.layer_num, device=dev)
        ptr = ptr.long()
        first = ptr[layer[:, None] * lists + torch.arange(lists + 1, device=dev)]
        local = first - first[:, :1]
        torch._assert_async((local[:, -1] <= cap).all(), "decode lists over the graph capacity")
        ly = torch.repeat_interleave(layer, local[:, -1], output_size=nnz)
        # rows of cap + 1 entries: the buffers end each layer in a dump entry
        return local, ly * (cap + 1) + torch.arange(nnz, device=dev) - first[ly, 0]


def _local_ptr(counts: Tensor) -> Tensor:
    """int64 ``[L, lists + 1]``: each layer's index pointer over its lists' ``counts``."""
    out = counts.new_zeros(counts.shape[0], counts.shape[1] + 1)
    out[:, 1:] = counts.cumsum(1)
    return out


def _positions(listed: Tensor, cap: int) -> Tensor:
    """int64 ``[L * M]``: for each of ``listed``'s (bool ``[L, M]``, each layer's candidates in
    list order) its flat index in an ``[L, cap + 1]`` buffer: the layer's running count where
    listed and within ``cap``, else the layer's dump entry ``cap``."""
    pos = listed.cumsum(1) - 1
    keep = listed & (pos < cap)
    layer = torch.arange(listed.shape[0], device=listed.device)[:, None] * (cap + 1)
    return (layer + torch.where(keep, pos, cap)).reshape(-1)


def _pad(buf: Tensor, local: Tensor, width: int) -> None:
    """``buf[:, :width]`` = ``local``, then its last offset (requests past it list nothing)."""
    n = local.shape[1]
    buf[:, :n] = local.to(buf.dtype)
    buf[:, n:width] = local[:, -1:].to(buf.dtype)
