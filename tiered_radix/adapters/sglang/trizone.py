"""The decode batch's TriZone index lists, built from the pool's blocks for every layer.

The TriZone decode kernel (``kernels/decode.py``) reads one layer of a batch from three zones; the
pool's storage maps onto two of them without copying anything:

- zone A (quantized pages): the ledger pages ``pool.pages[l]`` of windows a request reads in state
  quantized; page ``i`` is at byte ``block * page_bytes`` of the layer's page store;
- zone B (full rows): the row blocks of windows read full or restored. ``rows_k[l]`` is
  ``[F + 2, W, d]``; seen as a ``[(F + 2) * W, H, d]`` pool whose head stride is 0, token ``t`` of
  block ``b`` is slot ``b * W + t`` for every head, so each (request, head) lists its own slots;
- zone C (fresh rows) stays empty: new tokens are written to their window's ``FULL`` block.

Evicted windows are in no list. Units for the side output are ``h * N + j`` (head ``h``, the
request's window ``j``; ``N`` the batch's most windows eagerly, a context's under decode graphs,
:class:`Candidates`' ``n_max``), so ``mass [B, H * N]`` gives the attention mass per (head,
window): the per-window ``attn`` signal, put on the window's first token (window scores sum
their tokens, so they see the same value).

Lists for all layers are built with a handful of batched ops, a run of layers at a time
(:func:`candidate_chunks`: their temporaries stay bounded at any batch), and sliced per layer:
index pointers hold global offsets into shared slot and page tensors. Packed (:class:`Lists`, the
eager path) they cost a host sync for their sizes; the decode graphs take them unpacked
(:class:`Candidates`, fixed shapes) and scatter them into place, with no host sync.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from tiered_radix.engine.routing import to_device
from tiered_radix.formats.layout import K_BITS, V_BITS, TriZoneLayout, k_sections
from tiered_radix.kernels import decode, extend

from .reps import FULL, S_EVICT, S_FULL, S_Q, S_R, Q, R

PAGE_SIZES = (16, 32, 64)  # windows whose ledger pages the kernels read
# entries (layer, request, head, window, row) one :func:`candidates` builds at most: a step's
# lists come a few layers at a time (:func:`candidate_chunks`), so their temporaries stay at a
# few hundred MB whatever the batch (GPU run 32: token units' lists of every layer at once took
# gigabytes a step, and a server sharing the GPU ran out of memory)
CHUNK_ENTRIES = 1 << 23
HEAD_DIMS = (64, 128)


@dataclass
class DecodeBatch:
    """One decode step: a layout per layer, the shared plan, the side output per layer
    (float32 ``[L, B, H * N]``, None when the policy reads no decode attention), ``n`` windows
    per request and ``N = max(n)``."""

    layouts: list[TriZoneLayout]
    plan: decode.DecodePlan
    mass: Tensor | None
    n: list[int]
    n_max: int


def decodes(layout) -> bool:
    """Whether the decode kernel can read a pool of this :class:`~.reps.Layout`: windows of a
    page size it is compiled for, or token units (window 1) with no quantized tier (h2o,
    snapkv, streaming: every kept token a zone B row, listed by its slot, each its own unit)."""
    return layout.window in PAGE_SIZES or (layout.window == 1 and layout.quant is None)


def supported(pool) -> bool:
    """Whether the TriZone kernels can read this pool: :func:`decodes` (the extend kernel
    reads token units' rows as key tiles of 64 one-row windows), a head dim they are compiled
    for."""
    return decodes(pool.layout) and pool.head_dim in HEAD_DIMS


@dataclass
class Lists:
    """One decode step's index lists of every layer, layer-major with global offsets: list
    ``(l, b, h)`` is entry ``(l * B + b) * H + h`` of ``full_ptr`` (row slots ``slots``, units
    ``units``) and holds pages ``page_ptr[4 * that ...]`` (ledger blocks ``pages``, one unit each,
    ``page_unit``). Units are ``h * n_max + j``. ``ahead`` (``lists(ahead=True)``): how many of
    each list's last rows are its last window's future rows (listed, not yet written)."""

    full_ptr: Tensor
    slots: Tensor
    units: Tensor
    page_ptr: Tensor
    pages: Tensor
    page_unit: Tensor
    n: list[int]
    n_max: int
    ahead: Tensor | None = None

    @staticmethod
    def concat(parts: list[Lists]) -> Lists:
        """One :class:`Lists` of ``parts``' layers in order (each part's offsets moved past the
        entries before it)."""

        def ptrs(ps: list[Tensor]) -> Tensor:
            ends = torch.stack([p[-1] for p in ps]).cumsum(0).to(ps[0].dtype)
            moved = [p[:-1] + (ends[i - 1] if i else 0) for i, p in enumerate(ps)]
            return torch.cat([*moved, ends[-1:]])

        def cat(ts: list[Tensor | None]) -> Tensor | None:
            return None if ts[0] is None else torch.cat(ts)

        first = parts[0]
        return Lists(
            ptrs([p.full_ptr for p in parts]), cat([p.slots for p in parts]),
            cat([p.units for p in parts]), ptrs([p.page_ptr for p in parts]),
            cat([p.pages for p in parts]), cat([p.page_unit for p in parts]), first.n,
            first.n_max, cat([p.ahead for p in parts]),
        )  # fmt: skip


@dataclass
class Candidates:
    """One decode step's list entries of every layer before compaction (:func:`candidates`):
    shapes fixed by the batch and ``N`` (no entry count read back by the host), so CUDA-graph
    buffers can take them in place (:meth:`.graph.GraphDecode.load`). Rows: ``listed`` bool
    ``[L, B, H, N, W]`` (window ``j``'s row ``i``), row slot ``slot`` int64 (``[L, B, H, N,
    1]``: ``slot + i``) and unit ``unit`` int64 ``[L, B, H, N]``; pages: ``quant`` bool ``[L,
    B, H, N]`` (window read from its ledger page ``page`` int64, same shape) and
    ``page_counts`` int64 ``[L, B, H, 4]`` (per V width, as ``page_ptr`` counts); ``ahead`` as
    :class:`Lists`'. ``N`` is the batch's most windows (``max(n)``), ``n_max`` numbers the units
    (at least ``N``). ``layers``: the layers these are of (:func:`candidate_chunks`: a few at a
    time), all of them by default."""

    listed: Tensor
    slot: Tensor
    unit: Tensor
    quant: Tensor
    page: Tensor
    page_counts: Tensor
    n: list[int]
    n_max: int
    ahead: Tensor | None = None
    layers: range | None = None

    def compact(self) -> Lists:
        """The listed entries packed (:class:`Lists`; one host sync per mask for the sizes)."""
        W = self.listed.shape[-1]
        i = torch.arange(W, device=self.listed.device)
        slots = (self.slot + i)[self.listed].to(torch.int32)
        units = self.unit[..., None].expand_as(self.listed)[self.listed].to(torch.int32)
        return Lists(
            _indptr(self.listed.sum((-1, -2)).flatten()), slots, units,
            _indptr(self.page_counts.flatten()), self.page[self.quant],
            self.unit[self.quant].to(torch.int32), self.n, self.n_max, self.ahead,
        )  # fmt: skip


@dataclass
class _Batch:
    """What a step's lists share across layers (:func:`_batch`): ``n`` windows a request, ``N =
    max(n)`` the span built, ``n_max`` the units' numbering; the batch's windows ``win`` int64
    ``[B, N]`` (padding: window 0), where each request's windows land in ``[B * N]`` (``pos``,
    of their concatenation ``flat``; ``borrowed`` bool and the request's own states ``mine``
    int8 ``[L, H, sum n]``, the same order), tokens a window holds
    ``ntok`` ``[B, N]``, units ``unit`` ``[H, N]`` (``h * n_max + j``) and, ``ahead``, each
    request's last window ``last`` bool ``[B, N]``."""

    n: list[int]
    N: int
    n_max: int
    win: Tensor
    pos: Tensor
    flat: Tensor
    borrowed: Tensor
    mine: Tensor
    ntok: Tensor
    unit: Tensor
    last: Tensor | None


def _batch(pool, views, seqs: list[int], n_max: int | None, ahead: bool) -> _Batch:
    """:class:`_Batch` of requests with ``views`` and lengths ``seqs``; no host sync (the window
    counts and lengths are host values, copied from pinned memory)."""
    H, W, dev = pool.head_num, pool.layout.window, pool.device
    n = [int(v.windows.numel()) for v in views]
    N = max(n)  # the span built; units are numbered with n_max (a graph's context, in windows)
    n_max = n_max or N
    assert N <= n_max, f"a request of {N} windows past the {n_max} its units are numbered for"
    win, pos, flat, borrowed = _batch_windows(pool, views, n, N)
    mine = torch.cat([v.state for v in views], 2)  # [L, H, sum n]: one op, not one a run
    j = torch.arange(N, device=dev)
    ntok = (to_device(seqs, dev)[:, None] - j * W).clamp(0, W)  # [B, N]
    unit = torch.arange(H, device=dev)[:, None] * n_max + j  # [H, N]
    last = to_device([x - 1 for x in n], dev)[:, None] == j if ahead else None  # [B, N]
    return _Batch(n, N, n_max, win, pos, flat, borrowed, mine, ntok, unit, last)


def candidates(
    pool, views, seqs: list[int], n_max: int | None = None, ahead: bool = False,
    layers: range | None = None, batch: _Batch | None = None,
) -> Candidates:  # fmt: skip
    """:class:`Candidates` for requests with ``views`` (``RequestView``) and lengths ``seqs``, of
    ``layers`` (default: every layer); ``n_max`` (default: the most windows of a request)
    numbers the units. ``ahead``: each request's last window lists all its ``W`` rows, the ones
    past ``seqs`` too (the next decode steps write there), and ``ahead`` counts them per list.
    ``batch``: the step's :func:`_batch` if already made (:func:`candidate_chunks` makes it once
    for every run of layers). Device ops only, no host sync (the window counts and lengths are
    host values, copied from pinned memory)."""
    H, W, dev = pool.head_num, pool.layout.window, pool.device
    layers = layers or range(pool.layer_num)
    bt = batch or _batch(pool, views, seqs, n_max, ahead)
    L, B, N = len(layers), len(views), bt.N
    at = slice(layers.start, layers.stop)
    st = _states(pool, bt.mine[at], bt.flat, bt.pos, bt.borrowed, B, N, layers)
    blk = pool.block_all[at, :, :, bt.win].permute(0, 1, 3, 2, 4).long()  # [L, K, B, H, N]
    unit = bt.unit.expand(L, B, H, N)

    rows = (st == S_FULL) | (st == S_R)
    quant = pool.layout.quant
    rowblk, pageblk = _blocks_read(pool, st, blk)
    i = torch.arange(W, device=dev)
    tok = rows[..., None] & (i < bt.ntok[None, :, None, :, None])  # [L, B, H, N, W]
    listed, future = tok, None
    if ahead:  # the last window's future rows too (the request's last window is always rows)
        listed = tok | (rows & bt.last[None, :, None, :])[..., None]
        future = (listed & ~tok).sum((-1, -2)).flatten().to(torch.int32)
    qm = st == S_Q
    per_list = torch.zeros(L, B, H, 4, dtype=torch.long, device=dev)
    if quant is not None:
        per_list[..., V_BITS.index(quant.bits)] = qm.sum(-1)
    return Candidates(listed, (rowblk * W)[..., None], unit, qm, pageblk, per_list, bt.n,
                      bt.n_max, future, layers)  # fmt: skip


def layer_chunks(pool, n: list[int], max_entries: int | None = None) -> list[range]:
    """The layers in runs whose candidates (:func:`candidates` of requests with ``n`` windows:
    ``B * H * max(n) * W`` entries a layer) stay within ``max_entries`` (default
    :data:`CHUNK_ENTRIES`), at least one layer a run."""
    per_layer = len(n) * pool.head_num * max(n, default=1) * pool.layout.window
    return _runs(pool.layer_num, per_layer, max_entries)


def _runs(layers: int, per_layer: int, max_entries: int | None) -> list[range]:
    """``layers`` layers in runs of at most ``max_entries`` (default :data:`CHUNK_ENTRIES`)
    entries at ``per_layer`` a layer, at least one layer a run."""
    step = max(1, (max_entries or CHUNK_ENTRIES) // max(per_layer, 1))
    return [range(lo, min(lo + step, layers)) for lo in range(0, layers, step)]


def candidate_chunks(
    pool, views, seqs: list[int], n_max: int | None = None, ahead: bool = False,
    max_entries: int | None = None,
) -> Iterator[Candidates]:  # fmt: skip
    """:func:`candidates` of every layer, a :func:`layer_chunks` run at a time, made as they are
    taken: what one run's temporaries hold is freed before the next is built; what the runs
    share (:func:`_batch`) is made once."""
    bt = _batch(pool, views, seqs, n_max, ahead)
    for layers in layer_chunks(pool, bt.n, max_entries):
        yield candidates(pool, views, seqs, n_max, ahead, layers, bt)


def lists(
    pool, views, seqs: list[int], n_max: int | None = None, ahead: bool = False,
    max_entries: int | None = None,
) -> Lists:  # fmt: skip
    """:class:`Lists` for requests with ``views`` and lengths ``seqs`` (:func:`candidates`,
    packed a :func:`layer_chunks` run at a time)."""
    parts = [c.compact() for c in candidate_chunks(pool, views, seqs, n_max, ahead, max_entries)]
    return parts[0] if len(parts) == 1 else Lists.concat(parts)


def _blocks_read(pool, st: Tensor, blk: Tensor) -> tuple[Tensor, Tensor]:
    """The row block (``FULL``, or ``R`` where restored) and the ledger page each window is
    read from in state ``st`` (``[...]``), given its block ids ``blk`` (``[..., K, ...]`` with
    the kinds at dim 1). Eviction-only layouts hold ``FULL`` blocks only (``K = 1``): no
    restored rows, pages all 0."""
    if pool.layout.quant is None:  # pages all 0: a broadcast view, no memory an entry
        return blk[:, FULL], blk.new_zeros(()).expand_as(blk[:, FULL])
    return torch.where(st == S_FULL, blk[:, FULL], blk[:, R]), blk[:, Q]


def _batch_windows(pool, views, n: list[int], N: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The batch's windows ``win`` int64 ``[B, N]`` (padding: window 0), and where each
    request's windows land in ``[B * N]`` (``pos``) of their concatenation ``flat`` (and
    ``borrowed``, the same order). No host sync."""
    dev, B = pool.device, len(views)
    # every request's windows side by side, then scattered to [B, N]
    flat = torch.cat([v.windows for v in views])
    borrowed = torch.cat([v.borrowed for v in views])
    counts, total = to_device(n, dev), sum(n)
    shift = torch.arange(B, device=dev) * N - (counts.cumsum(0) - counts)
    pos = torch.arange(total, device=dev) + shift.repeat_interleave(counts, output_size=total)
    win = torch.zeros(B * N, dtype=torch.long, device=dev).index_copy_(0, pos, flat).view(B, N)
    return win, pos, flat, borrowed


def _states(
    pool, mine: Tensor, flat: Tensor, pos: Tensor, borrowed: Tensor, B: int, N: int,
    layers: range | None = None,
) -> Tensor:  # fmt: skip
    """The state each request reads its windows in, int8 ``[L, B, H, N]`` of ``layers``
    (default: all; padding: evicted), given :func:`_batch_windows`' placement and the
    requests' own states of those layers ``mine`` (int8 ``[L, H, sum n]``, concatenated). No
    host sync."""
    layers = layers or range(pool.layer_num)
    at = slice(layers.start, layers.stop)
    L, H, dev = len(layers), pool.head_num, pool.device
    read = torch.where(borrowed, mine, pool.owner_all[at, :, flat])  # [L, H, sum n]
    st = torch.full((L, H, B * N), S_EVICT, dtype=torch.int8, device=dev)
    return st.index_copy_(2, pos, read).view(L, H, B, N).transpose(1, 2)


def _window_states(
    pool, views, n: list[int], N: int, layers: range | None = None
) -> tuple[Tensor, Tensor]:
    """The batch's windows ``win`` int64 ``[B, N]`` (padding: window 0) and the state each
    request reads them in, int8 ``[L, B, H, N]`` of ``layers`` (default: all; padding:
    evicted). No host sync."""
    win, pos, flat, borrowed = _batch_windows(pool, views, n, N)
    layers = layers or range(pool.layer_num)
    mine = torch.cat([v.state[layers.start : layers.stop] for v in views], 2)
    return win, _states(pool, mine, flat, pos, borrowed, len(views), N, layers)


def extend_lists(pool, views, layers: range | None = None) -> extend.WindowLists:
    """The extend kernel's window lists of ``layers`` (default: every layer; ``[L, ...]``,
    :meth:`~tiered_radix.kernels.extend.WindowLists.layer` slices one, counted from the range's
    first) for requests with ``views``: per (request, head) the windows read full or restored
    (row blocks ``FULL``/``R``) in window order, then those read quantized (ledger pages);
    evicted windows in neither. Device ops only, no host sync (the window counts are host
    values)."""
    layers = layers or range(pool.layer_num)
    n = [int(v.windows.numel()) for v in views]
    win, st = _window_states(pool, views, n, max(n), layers)
    at = slice(layers.start, layers.stop)
    blk = pool.block_all[at, :, :, win].permute(0, 1, 3, 2, 4)  # [L, K, B, H, N]
    rows = (st == S_FULL) | (st == S_R)
    kind = torch.where(rows, extend.ROW, torch.where(st == S_Q, extend.PAGE, extend.ABSENT))
    return extend.window_lists(kind, *_blocks_read(pool, st, blk))


def extend_runs(pool, n: list[int], max_entries: int | None = None) -> list[range]:
    """The layers in runs whose extend lists (:func:`extend_lists` of requests with ``n``
    windows: ``B * H * max(n)`` windows a layer, a few int64 temporaries each) stay within
    ``max_entries`` (default :data:`CHUNK_ENTRIES`), at least one layer a run: for 32
    token-unit requests of 1K-30K tokens at Qwen-0.5B's shapes (CPU tensors), 1.56 GiB at the
    peak for every layer at once, 0.37 GiB in runs."""
    return _runs(pool.layer_num, len(n) * pool.head_num * max(n, default=1), max_entries)


def k_table(pool, lists: int) -> Tensor:
    """The K sections of ``lists`` lists of the pool's pages (int32 ``[4 * lists, 12]``): every
    channel at the quantized tier's bits, in the V-bits row of those bits."""
    bits = pool.layout.quant.bits if pool.layout.quant else None
    rows = []
    for vb in V_BITS:
        n = [pool.head_dim if b == vb and vb == bits else 0 for b in K_BITS]
        rows.append(n + k_sections(n, pool.layout.window) + [0])
    return torch.tensor(rows, dtype=torch.int32, device=pool.device).repeat(lists, 1)


def layout(pool, li: int, batch: int, **zones) -> TriZoneLayout:
    """Layer ``li``'s TriZone view of the pool for ``batch`` requests, with index lists
    ``zones`` (``full_indptr, full_slots, full_units, page_indptr, page_off, page_ntok,
    page_units, page_unit, page_ids, k_table, perm, max_units``, optionally ``full_end``); zone
    C stays empty."""
    H, W, d, dev = pool.head_num, pool.layout.window, pool.head_dim, pool.device
    quant = pool.layout.quant
    rk, rv = pool.rows_k[li], pool.rows_v[li]
    shape, stride = (rk.shape[0] * W, H, d), (d, 0, 1)
    has = (quant.bits,) if quant and zones["page_off"].numel() else ()
    return TriZoneLayout(
        k_pool=rk.as_strided(shape, stride), v_pool=rv.as_strided(shape, stride),
        fresh_indptr=torch.zeros(batch + 1, dtype=torch.int32, device=dev),
        fresh_slots=torch.zeros(0, dtype=torch.int32, device=dev),
        fresh_units=torch.zeros(0, dtype=torch.int32, device=dev),
        arena=pool.pages[li].view(-1) if pool.pages else torch.zeros(16, dtype=torch.uint8,
                                                                       device=dev),
        batch=batch, num_kv_heads=H, head_dim=d, page_size=W, v_group=pool.v_group or 8,
        v_bits_present=has, k_bits_present=has, k_uniform=True, bytes_kv=0, bytes_side=0,
        **zones,
    )  # fmt: skip


def build(
    pool,
    views,
    seqs: list[int],
    num_q_heads: int,
    side_output: bool = True,
    splits: int | None = None,
) -> DecodeBatch:
    """Index lists of every layer for requests with ``views`` (``RequestView``) and lengths
    ``seqs``; ``num_q_heads`` query heads (GQA over ``pool.head_num``). ``side_output``: the
    kernel accumulates each window's attention mass (``mass``; None when off). The plan takes
    the kernel's uniform-page path: the pool's ledger pages have one bit width."""
    L, H, W, d, dev = pool.layer_num, pool.head_num, pool.layout.window, pool.head_dim, pool.device
    B = len(views)
    ls = lists(pool, views, seqs)
    n_pages = ls.pages.numel()
    common = dict(
        full_slots=ls.slots, full_units=ls.units, page_off=ls.pages * pool.page_bytes,
        page_ntok=torch.full_like(ls.page_unit, W),
        page_units=ls.page_unit[:, None].expand(n_pages, W).contiguous(), page_unit=ls.page_unit,
        page_ids=torch.arange(n_pages, dtype=torch.int32, device=dev), k_table=k_table(pool, B * H),
        perm=torch.arange(d, dtype=torch.int32, device=dev).repeat(B * H, 1),
        max_units=H * ls.n_max,
    )  # fmt: skip
    layouts = [
        layout(
            pool,
            li,
            B,
            full_indptr=ls.full_ptr[li * B * H : (li + 1) * B * H + 1],
            page_indptr=ls.page_ptr[li * B * H * 4 : (li + 1) * B * H * 4 + 1],
            **common,
        )
        for li in range(L)
    ]
    quant = pool.layout.quant
    bits = (quant.bits,) if quant else ()
    plan = decode.plan(
        layouts[0], num_q_heads=num_q_heads, side_output=side_output, v_bits=bits, k_bits=bits,
        max_rows=max(seqs), num_splits=splits,
    )  # fmt: skip
    mass = torch.zeros(L, B, H * ls.n_max, dtype=torch.float32, device=dev) if side_output else None
    return DecodeBatch(layouts, plan, mass, ls.n, ls.n_max)


def _indptr(counts: Tensor) -> Tensor:
    out = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=counts.device)
    out[1:] = counts.cumsum(0)
    return out


def window_attn(batch: DecodeBatch, window: int) -> Tensor:
    """float32 ``[L, B, H, N * W]``: each request's mass per (head, window) of every layer at the
    window's first token (request ``b`` uses its first ``seq_b`` tokens)."""
    L, B, HN = batch.mass.shape
    H = HN // batch.n_max
    out = batch.mass.new_zeros(L, B, H, batch.n_max * window)
    out[..., ::window] = batch.mass.view(L, B, H, batch.n_max)
    return out


@dataclass
class ExtendBatch:
    """One extend forward through the extend kernel: the plan, the window lists (built a run of
    layers at a time as the layers come, :meth:`lists_of`), and per layer the signals the
    policy reads (``sig[name]`` float32 ``[L, rows, H, T_max]`` at token positions, each
    request's partial sums in ``splits.n[b]`` rows, :meth:`signals`; ``qnorm_sq`` the attention
    kernel's per-tile sums of q^2, float32 ``[L, B, tiles, H, d]``, :meth:`qnorm`), filled by
    :func:`extend_layer`. ``in_run``: the attention launch fills the signals itself
    (``attn``/``obs_attn`` without ``colmass``: one launch a layer, not two). ``pool``,
    ``views``: what the lists are read from; ``runs``: :func:`extend_runs`."""

    plan: extend.ExtendPlan
    need: frozenset[str]
    sig: dict[str, Tensor]
    qnorm_sq: Tensor | None
    splits: extend.SignalSplits
    in_run: bool
    pool: object
    views: list
    runs: list[range]
    run: range | None = None  # the run whose lists are held
    held: extend.WindowLists | None = None  # its lists, ``[len(run), ...]``

    def lists_of(self, li: int) -> extend.WindowLists:
        """Layer ``li``'s window lists: the run holding it is built when first asked for (the
        run before is let go: one run's lists and temporaries at a time)."""
        if self.run is None or li not in self.run:
            self.run = next(r for r in self.runs if li in r)
            self.held = None  # freed before the next run's are built
            self.held = extend_lists(self.pool, self.views, self.run)
        return self.held.layer(li - self.run.start)

    def signals(self) -> dict[str, Tensor]:
        """float32 ``[L, B, H, T_max]`` per signal: every layer's at once (after the last
        layer; the runs' partial sums added where the kernel split a request's rows)."""
        return {n: self.splits.total(x) for n, x in self.sig.items()}

    def qnorm(self) -> Tensor | None:
        """float32 ``[L, B, H, d]``: every layer's ``qnorm`` at once (after the last layer)."""
        return None if self.qnorm_sq is None else extend.qnorm_of(self.qnorm_sq)


def build_extend(pool, views, q_lens: list[int], seqs: list[int], group: int,
                 need: frozenset[str]) -> ExtendBatch:  # fmt: skip
    """:class:`ExtendBatch` of requests with ``views``, ``q_lens`` new tokens of ``seqs``;
    ``group`` query heads per KV head; ``need``: the signals to compute (``attn``,
    ``obs_attn``, ``colmass``, ``qnorm``)."""
    L, H, dev = pool.layer_num, pool.head_num, pool.device
    p = extend.plan(q_lens, seqs, group, dev)
    names = need & {"attn", "obs_attn", "colmass"}
    in_run = bool(names) and names <= extend.IN_RUN
    if in_run:
        splits = extend.tile_splits(p, names)
    else:
        splits = extend.signal_splits(p, pool.layout.window, H, need)
    sig = {  # zeroed once for every layer (extend_layer's launches fill them)
        n: torch.zeros(L, splits.rows, H, p.t_max, dtype=torch.float32, device=dev) for n in names
    }
    qsq = None
    if "qnorm" in need:  # zeroed: requests with fewer tiles leave theirs
        qsq = torch.zeros(L, p.batch, p.tiles_max, H, pool.head_dim, dtype=torch.float32,
                          device=dev)  # fmt: skip
    runs = extend_runs(pool, [int(v.windows.numel()) for v in views])
    return ExtendBatch(p, frozenset(need), sig, qsq, splits, in_run, pool, list(views), runs)


def extend_layer(pool, eb: ExtendBatch, li: int, q: Tensor, sm_scale: float) -> Tensor:
    """Layer ``li``'s extend attention of q ``[n, H_q, d]`` over the pool in place (the batch's
    new K/V already written), its signals into ``eb``; returns out ``[n, H_q, d]`` (pool dtype)."""
    quant = pool.layout.quant
    st = extend.LayerStore(
        pool.rows_k[li], pool.rows_v[li], pool.pages[li] if pool.pages else None,
        quant.bits if quant else 2, pool.v_group or 8,
    )  # fmt: skip
    H, ls = pool.head_num, eb.lists_of(li)
    qsq = None if eb.qnorm_sq is None else eb.qnorm_sq[li]
    into = {n: x[li] for n, x in eb.sig.items()}
    if eb.in_run:  # one launch: the tiles of observed rows sum their own probabilities
        out, _ = extend.run(q, st, ls, eb.plan, H, sm_scale=sm_scale, qnorm_sq=qsq, into=into,
                            splits=eb.splits)  # fmt: skip
        return out
    out, lse = extend.run(q, st, ls, eb.plan, H, sm_scale=sm_scale, qnorm_sq=qsq)
    if into:
        extend.signals(q, lse, st, ls, eb.plan, H, eb.need, sm_scale=sm_scale, into=into,
                       zeroed=True, splits=eb.splits)  # fmt: skip
    return out
