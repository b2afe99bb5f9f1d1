"""TriZone extend (prefill) attention: a chunk's queries over one layer's pool in place.

A layer's storage, as :class:`~tiered_radix.adapters.sglang.pool.TieredKVPool` keeps it:
``rows_k, rows_v [NB, W, d]`` (row blocks of ``W`` full-precision rows, head-agnostic) and
``pages`` uint8 ``[NP, page_bytes]`` (uniform INT-``bits`` TriZone pages, ``layout.py``).
What request ``b``'s KV head ``h`` reads is one window list (:class:`WindowLists`): its row
windows (block id, window index) in position order, then its page windows; evicted windows are
in neither. The chunk's own K/V are already written to their windows' row blocks, so the chunk
is the last row windows of every list.

``plan()`` once per batch (host lists of lengths: one host-to-device copy), ``run()`` per layer
(one launch, varlen over the batch, causal within the chunk, no host sync; with ``qnorm_sq`` it
also writes each query tile's sum of squares per channel, which :func:`qnorm_of` turns into
``qnorm``, e.g. once for every layer; with ``into`` it also fills ``attn`` of the last query
and ``obs_attn`` of the last :data:`OBS_WINDOW` itself, per tile, :func:`tile_splits`),
``signals()`` per layer when the policy reads ``colmass`` (a second launch over the same lists
with ``run()``'s lse: ``colmass`` of all rows, and ``attn``/``obs_attn`` beside it).
:func:`extend_ref` is the PyTorch twin of ``run`` + ``signals``, :func:`chunk_qnorm` that of
``qnorm_of(qnorm_sq)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl
from tiered_radix.kernels._extend_kernels import _extend_attn_kernel, _extend_signals_kernel
from tiered_radix.kernels.decode import IL_MIN_PAGE_CUDA  # the same tl.interleave miscompile
from torch import Tensor

from tiered_radix.formats.layout import uniform_page_nbytes, unpack_uniform_pages

LOG2E = 1.4426950408889634
OBS_WINDOW = 32  # as adapters/transformers/attention.py (SnapKV's observation window)
ROW, PAGE, ABSENT = 0, 1, 2  # window kinds of :func:`window_lists`
IN_RUN = frozenset({"attn", "obs_attn"})  # signals run() computes in its own launch
# signal_splits: a grid of ~4 waves of the H200's 132 SMs at 2 programs each; a split reads at
# least 16 blocks of query rows (its key tile's load amortised), and at most 8 partial sums
SIGNAL_PROGRAMS, SPLIT_MIN_BLOCKS, MAX_SPLITS = 1024, 16, 8


class ExtendInputError(ValueError):
    """A tensor given to plan(), run() or signals() has the wrong shape, dtype or device."""


@dataclass(frozen=True)
class WindowLists:
    """Window lists of one layer (or of every layer, ``[L, ...]``, sliced with :meth:`layer`):
    list ``(b, h)`` is entry ``(b * H + h) * n_max`` on of ``blk``/``win`` (int32 ``[B*H*N]``):
    ``rows[b*H + h]`` row windows (row block id, window index; ascending window), then
    ``pages[b*H + h]`` page windows (page id, window index)."""

    blk: Tensor
    win: Tensor
    rows: Tensor
    pages: Tensor
    n_max: int

    def layer(self, li: int) -> WindowLists:
        """Layer ``li``'s lists of all-layer lists (views, no copy)."""
        return WindowLists(self.blk[li].view(-1), self.win[li].view(-1), self.rows[li].view(-1),
                           self.pages[li].view(-1), self.n_max)  # fmt: skip


def window_lists(kind: Tensor, row_blk: Tensor, page_blk: Tensor) -> WindowLists:
    """Window lists from per-window kinds (``ROW``/``PAGE``/``ABSENT``) ``kind [..., B, H, N]``
    (window ``j`` of request ``b``, head ``h``) and the block ids ``row_blk``/``page_blk`` (same
    shape): a stable sort by kind per list, on the device, without a host sync."""
    key = kind.to(torch.int8)
    order = torch.sort(key, dim=-1, stable=True).indices
    blk = torch.where(key == ROW, row_blk, page_blk).gather(-1, order).to(torch.int32)
    lead = kind.shape[:-3]
    flat = lead + (-1,)
    return WindowLists(
        blk.reshape(flat), order.to(torch.int32).reshape(flat),
        (key == ROW).sum(-1, dtype=torch.int32).reshape(flat),
        (key == PAGE).sum(-1, dtype=torch.int32).reshape(flat), kind.shape[-1],
    )  # fmt: skip


@dataclass(frozen=True)
class ExtendPlan:
    """One extend batch: request ``b``'s queries are rows ``q_start[b] : q_start[b] + q_len[b]``
    of q (the last ``q_len`` of its ``seq_len`` tokens); tiles (``tile_b``, ``tile_m``: request
    and first query token) of ``block_m`` tokens, the tiles whose last query is furthest first.
    int32 device tensors; host sizes."""

    batch: int
    group: int
    g_pad: int
    block_m: int
    n_tiles: int
    t_max: int
    tiles_max: int  # the most tiles of one request
    q_start: Tensor
    q_len: Tensor
    seq_len: Tensor
    tile_b: Tensor
    tile_m: Tensor
    q_lens: tuple[int, ...]
    seqs: tuple[int, ...]


def plan(q_lens: list[int], seqs: list[int], group: int, device, block_m: int | None = None):
    """:class:`ExtendPlan` for requests with ``q_lens`` new tokens and ``seqs`` tokens in all
    (host lists); ``group`` query heads per KV head. ``block_m`` (tokens a tile): default
    ``128 // g_pad`` tokens (at least 16), so a tile is ~128 query rows."""
    if len(q_lens) != len(seqs) or any(q > s or q < 1 for q, s in zip(q_lens, seqs, strict=True)):
        raise ExtendInputError(f"q_lens {q_lens} must be in 1..seqs {seqs}")
    g_pad = 1 << (group - 1).bit_length()
    bm = block_m or max(16, 128 // g_pad)
    if bm & (bm - 1):
        raise ExtendInputError(f"block_m={bm} must be a power of two")
    starts, tiles, s = [], [], 0
    for b, (q, seq) in enumerate(zip(q_lens, seqs, strict=True)):
        starts.append(s)
        s += q
        tiles.extend((seq - q + min(m0 + bm, q), b, m0) for m0 in range(0, q, bm))
    # the tiles that read the most keys (their last query's position) launch first, so the
    # long ones do not trail at the end of the grid
    tiles.sort(key=lambda x: -x[0])
    tb, tm = [b for _, b, _ in tiles], [m0 for _, _, m0 in tiles]
    host = torch.tensor([starts, list(q_lens), list(seqs)], dtype=torch.int32)
    tiles = torch.tensor([tb, tm], dtype=torch.int32)
    both = torch.cat([host.flatten(), tiles.flatten()])
    if torch.device(device).type == "cuda":  # pinned: the copy does not wait for the device
        both = both.pin_memory()
    both = both.to(device, non_blocking=True)
    B, T = len(q_lens), len(tb)
    return ExtendPlan(
        B, group, g_pad, bm, T, max(seqs), -(-max(q_lens) // bm), both[:B], both[B : 2 * B],
        both[2 * B : 3 * B],
        both[3 * B : 3 * B + T], both[3 * B + T :], tuple(q_lens), tuple(seqs),
    )  # fmt: skip


@dataclass(frozen=True)
class LayerStore:
    """One layer's storage: row blocks ``rows_k, rows_v [NB, W, d]`` and uniform pages
    ``pages`` uint8 ``[NP, page_bytes]`` at ``bits`` with V groups of ``v_group`` (``pages``
    None: no quantized tier)."""

    rows_k: Tensor
    rows_v: Tensor
    pages: Tensor | None = None
    bits: int = 2
    v_group: int = 32


def _dt(q: Tensor):
    if q.device.type == "cpu":  # the Triton interpreter computes bf16 tl.dot wrongly
        return tl.float32
    return tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16


def _check(q: Tensor, st: LayerStore, ls: WindowLists, p: ExtendPlan, hkv: int) -> None:
    n = sum(p.q_lens)
    if q.dim() != 3 or q.shape[0] != n or q.shape[1] != hkv * p.group or q.stride(-1) != 1:
        raise ExtendInputError(f"q must be [{n}, {hkv * p.group}, d] (last dim contiguous)")
    if q.dtype != st.rows_k.dtype:
        raise ExtendInputError(f"q is {q.dtype}, the rows {st.rows_k.dtype}")
    if not (st.rows_k.is_contiguous() and st.rows_v.is_contiguous()):
        raise ExtendInputError("rows_k/rows_v must be contiguous [NB, W, d]")
    if ls.rows.numel() != p.batch * hkv or ls.blk.numel() != p.batch * hkv * ls.n_max:
        raise ExtendInputError(f"lists for {ls.rows.numel()} (request, head) pairs, want "
                               f"{p.batch} x {hkv} of {ls.n_max} windows")  # fmt: skip
    W, d = st.rows_k.shape[1:]
    rows_only = W == 1 and st.pages is None  # token units: every key row its own window
    if d not in (64, 128) or W & (W - 1) or (W < 16 and not rows_only):
        raise ExtendInputError(f"head_dim {d} / window {W} unsupported (64 or 128; 2^k >= 16, "
                               "or 1 without pages)")  # fmt: skip
    if st.pages is not None:
        if st.pages.shape[1] != uniform_page_nbytes(st.bits, W, d, st.v_group):
            raise ExtendInputError("pages are not uniform TriZone pages of these bits/window")


def run(q: Tensor, st: LayerStore, ls: WindowLists, p: ExtendPlan, num_kv_heads: int, *,
        sm_scale: float, out: Tensor | None = None, lse: Tensor | None = None,
        wpi: int | None = None, ppi: int | None = None, num_warps: int | None = None,
        unpack: str | None = None, qnorm_sq: Tensor | None = None,
        into: dict[str, Tensor] | None = None,
        splits: SignalSplits | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Attention of q ``[n, H_q, d]`` (``p``'s requests' new tokens) over their window lists;
    returns out ``[n, H_q, d]`` (q's dtype) and lse float32 ``[n, H_q]`` (log2 domain, for
    :func:`signals`). ``wpi``/``ppi``: row/page windows an iteration (default 64 tokens' worth /
    1 page); ``unpack``: ``"interleave"`` or ``"shift"`` (default: interleave, shift for pages
    under 32 tokens on CUDA). ``qnorm_sq``: float32 ``[B, >= p.tiles_max, H_kv, d]`` (the last
    three dims contiguous) that gets, at ``[b, j, h]``, the sum of q^2 per channel over request
    ``b``'s ``j``-th tile of ``p.block_m`` tokens and KV group ``h``'s query heads; entries of
    tiles a request does not have are left as they are (zero them: :func:`qnorm_of` sums them).

    ``into``: ``attn`` and/or ``obs_attn`` buffers (float32 ``[splits.rows, H_kv, >= t_max]``,
    zeroed by the caller) that the same launch fills, as :func:`signals` would, with
    ``splits`` = :func:`tile_splits`: each tile holding observed query rows writes its partial
    sums to its own row (:meth:`SignalSplits.total` adds them). ``colmass`` needs every query
    row's lse first: :func:`signals`."""
    _check(q, st, ls, p, num_kv_heads)
    n, hq, d = q.shape
    W = st.rows_k.shape[1]
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(n, hq, dtype=torch.float32, device=q.device) if lse is None else lse
    if qnorm_sq is not None:
        _check_qsq(qnorm_sq, p, num_kv_heads, d)
    into = into or {}
    if set(into) - IN_RUN or (into and splits is None):
        raise ExtendInputError(f"run() fills {sorted(IN_RUN)} with tile_splits(), got "
                               f"{sorted(into)}")  # fmt: skip
    for name, x in into.items():
        if x.shape[:2] != (splits.rows, num_kv_heads) or x.shape[2] < p.t_max or x.stride(2) != 1:
            raise ExtendInputError(f"{name} buffer must be float32 [{splits.rows}, "
                                   f"{num_kv_heads}, >= {p.t_max}]")  # fmt: skip
    some = next(iter(into.values()), lse)
    pages = st.pages is not None and st.pages.numel() > 0
    arena = _arena(st, pages)
    il = _il(unpack, q, W)
    _extend_attn_kernel[(p.n_tiles, num_kv_heads)](
        q, q.stride(0), q.stride(1), out, out.stride(0), out.stride(1), lse, st.rows_k, st.rows_v,
        arena, arena.view(torch.float16), st.pages.shape[1] if pages else 16, ls.blk, ls.win,
        ls.rows, ls.pages, ls.n_max, p.tile_b, p.tile_m, p.q_start, p.q_len, p.seq_len,
        sm_scale * LOG2E, num_kv_heads, p.group, lse if qnorm_sq is None else qnorm_sq,
        0 if qnorm_sq is None else qnorm_sq.stride(0), into.get("obs_attn", some),
        into.get("attn", some), some.stride(0) if into else 0, some.stride(1) if into else 0,
        splits.table if into else p.q_len,
        DT=_dt(q), D=d, G_PAD=p.g_pad, BLOCK_M=p.block_m, W=W, WPI=wpi or max(1, 64 // W),
        PPI=ppi or 1, VB=st.bits, VG=st.v_group, PAGES=pages, IL=il, QNORM=qnorm_sq is not None,
        OBS="obs_attn" in into, LAST="attn" in into, OBS_WINDOW=OBS_WINDOW,
        num_warps=num_warps or (4 if d == 64 else 8), num_stages=2,
    )  # fmt: skip
    return out, lse


def tile_splits(p: ExtendPlan, need: frozenset[str]) -> SignalSplits:
    """:class:`SignalSplits` for the signals :func:`run` fills itself (``need`` within
    :data:`IN_RUN`): request ``b``'s observed query rows (its last :data:`OBS_WINDOW` for
    ``obs_attn``, else its last) lie in ``n[b]`` tiles of ``p.block_m`` tokens, one row each.
    By the request's own length only: its signals do not depend on its batch."""
    first = OBS_WINDOW if "obs_attn" in need else 1
    n = [(q - 1) // p.block_m - max(q - first, 0) // p.block_m + 1 for q in p.q_lens]
    return SignalSplits.of(n, p.q_len.device)


def _check_qsq(x: Tensor, p: ExtendPlan, hkv: int, d: int) -> None:
    B, T = p.batch, p.tiles_max
    ok = x.dim() == 4 and x.shape[0] == B and x.shape[1] >= T and x.shape[2:] == (hkv, d)
    if not (ok and x.dtype == torch.float32 and x.stride()[1:] == (hkv * d, d, 1)):
        raise ExtendInputError(f"qnorm_sq must be float32 [{B}, >= {T}, {hkv}, {d}] with its "
                               "last three dims contiguous")  # fmt: skip


def _arena(st: LayerStore, pages: bool) -> Tensor:
    """The page bytes, or (no pages: never read) a byte view of the rows, so no allocation."""
    return st.pages.view(-1) if pages else st.rows_k.view(-1).view(torch.uint8)


def qnorm_of(qnorm_sq: Tensor) -> Tensor:
    """float32 ``[..., B, H_kv, d]``: ``qnorm`` (:func:`chunk_qnorm`) from :func:`run`'s
    per-tile sums ``[..., B, tiles, H_kv, d]`` (any leading dims: every layer's at once)."""
    return qnorm_sq.sum(-3).sqrt()


def _il(unpack: str | None, q: Tensor, W: int) -> bool:
    small_cuda = q.device.type == "cuda" and W < IL_MIN_PAGE_CUDA
    if unpack is None:
        return not small_cuda
    if unpack not in ("interleave", "shift"):
        raise ExtendInputError(f"unpack={unpack!r}: use 'interleave' or 'shift'")
    if unpack == "interleave" and small_cuda:
        raise ExtendInputError(f"interleave unpacking needs pages of >= {IL_MIN_PAGE_CUDA} tokens")
    return unpack == "interleave"


def signals(q: Tensor, lse: Tensor, st: LayerStore, ls: WindowLists, p: ExtendPlan,
            num_kv_heads: int, need: frozenset[str], *, sm_scale: float,
            into: dict[str, Tensor] | None = None, unpack: str | None = None,
            num_warps: int | None = None, zeroed: bool = False,
            splits: SignalSplits | None = None) -> dict[str, Tensor]:  # fmt: skip
    """The signals in ``need`` (``attn``, ``obs_attn``, ``colmass``) of :func:`run`'s attention
    (its ``lse``), each float32 ``[B, H_kv, >= t_max]`` at token positions, summed over the
    query heads of each KV group (positions in no list: 0). ``into``: buffers to fill (zeroed
    here, unless ``zeroed``: the caller zeroed them, e.g. every layer's at once); ``attn``: the
    last query row; ``obs_attn``: the last :data:`OBS_WINDOW`; ``colmass``: every row. One
    launch for all of them. ``splits`` (:func:`signal_splits`; default: none): request ``b``'s
    query rows are read in ``splits.n[b]`` runs, each writing its partial sums to its own row of
    the buffers, ``[splits.rows, H_kv, >= t_max]``; :meth:`SignalSplits.total` adds them."""
    need = frozenset(need) & {"attn", "obs_attn", "colmass"}
    _check(q, st, ls, p, num_kv_heads)
    if not need:
        return {}
    W, d = st.rows_k.shape[1:]
    sp = splits or signal_splits(p, W, num_kv_heads, frozenset())
    if len(sp.n) != p.batch:
        raise ExtendInputError(f"splits for {len(sp.n)} requests, the plan has {p.batch}")
    shape = (sp.rows, num_kv_heads, p.t_max)
    into = dict(into or {})
    for name in need:
        if name not in into:
            into[name] = torch.zeros(shape, dtype=torch.float32, device=q.device)
        else:
            x = into[name]
            if x.shape[:2] != shape[:2] or x.shape[2] < p.t_max or x.stride(2) != 1:
                raise ExtendInputError(f"{name} buffer must be float32 [{shape[0]}, {shape[1]}, "
                                       f">= {p.t_max}]")  # fmt: skip
            if not zeroed:
                x.zero_()
    some = next(iter(into[n] for n in need))
    ptr = {n: into.get(n, some) for n in ("colmass", "obs_attn", "attn")}
    pages = st.pages is not None and st.pages.numel() > 0
    arena = _arena(st, pages)
    wpi = max(1, 64 // W)
    tiles = -(-ls.n_max // wpi)
    B = p.batch
    _extend_signals_kernel[(B * tiles * sp.most, num_kv_heads)](
        q, q.stride(0), q.stride(1), lse, st.rows_k, st.rows_v, arena, arena.view(torch.float16),
        st.pages.shape[1] if pages else 16, ls.blk, ls.win, ls.rows, ls.pages, ls.n_max,
        p.q_start, p.q_len, p.seq_len, ptr["colmass"], ptr["obs_attn"], ptr["attn"],
        some.stride(0), some.stride(1), sp.table[:B], sp.table[B:], sm_scale * LOG2E,
        num_kv_heads, p.group, tiles, sp.most,
        DT=_dt(q), D=d, G_PAD=p.g_pad, BLOCK_M=p.block_m, W=W, WPI=wpi, VB=st.bits,
        VG=st.v_group, PAGES=pages, IL=_il(unpack, q, W), COLMASS="colmass" in need,
        OBS="obs_attn" in need, LAST="attn" in need, OBS_WINDOW=OBS_WINDOW,
        num_warps=num_warps or (4 if d == 64 else 8), num_stages=2,
    )  # fmt: skip
    return {n: into[n] for n in need}


@dataclass(frozen=True)
class SignalSplits:
    """How :func:`signals` splits each request's query rows: request ``b`` in ``n[b]`` runs,
    whose partial sums are rows ``off[b] : off[b] + n[b]`` of the signal buffers (``rows`` in
    all, ``most`` runs at most). ``table``: int32 device ``[2 B]``, ``off`` then ``n`` (the
    kernel's); ``run_rows`` int64 ``[most, B]``: run ``s``'s row, ``off[b] + min(s, n[b] - 1)``,
    and ``run_on`` float32 ``[most, B, 1, 1]``: whether ``s < n[b]`` (:meth:`total`'s, most > 1)."""

    n: tuple[int, ...]
    rows: int
    most: int
    table: Tensor
    run_rows: Tensor
    run_on: Tensor

    @classmethod
    def of(cls, n: list[int], device) -> SignalSplits:
        """``n[b]`` runs for request ``b`` (host ints >= 1); one host-to-device copy."""
        if not n or min(n) < 1:
            raise ExtendInputError(f"runs per request {n} must be at least 1 each")
        B, most = len(n), max(n)
        off = [sum(n[:b]) for b in range(B)]
        rows = [o + min(s, k - 1) for s in range(most) for o, k in zip(off, n, strict=True)]
        on = [int(s < k) for s in range(most) for k in n]
        host = torch.tensor(off + list(n) + rows + on, dtype=torch.int32)
        if torch.device(device).type == "cuda":  # pinned: the copy does not wait for the device
            host = host.pin_memory()
        dev = host.to(device, non_blocking=True)
        if most == 1:  # total() adds nothing
            return cls(tuple(n), sum(n), 1, dev[: 2 * B], dev[2 * B : 3 * B], dev[3 * B :])
        at = dev[2 * B :].view(2, most, B)
        run_on = at[1].float()[:, :, None, None]
        return cls(tuple(n), sum(n), most, dev[: 2 * B], at[0].long(), run_on)

    def total(self, x: Tensor) -> Tensor:
        """``x [..., rows, H, T]`` -> each request's sum of its runs ``[..., B, H, T]``, added in
        run order (``x`` itself without splits): a request's signals do not depend on the
        other requests of its batch, nor on how many runs they take."""
        if self.most == 1:
            return x
        acc = x.index_select(-3, self.run_rows[0])
        for s in range(1, self.most):  # after a request's runs: + 0.0, exact
            acc.addcmul_(x.index_select(-3, self.run_rows[s]), self.run_on[s])
        return acc


def signal_splits(p: ExtendPlan, window: int, num_kv_heads: int, need: frozenset[str],
                  programs: int = SIGNAL_PROGRAMS) -> SignalSplits:  # fmt: skip
    """:class:`SignalSplits` for :func:`signals` over windows of ``window`` tokens, each request
    by its own sizes only (its signals do not depend on its batch). Without ``colmass`` one run
    (a program reads a few rows); with it, a program reads every query row after its keys, so a
    request with few key tiles has few programs, the longest (a chunk's first keys) reading all
    the chunk's rows: runs bring the request alone to about ``programs`` programs, each run
    at least :data:`SPLIT_MIN_BLOCKS` blocks of rows, at most :data:`MAX_SPLITS` runs."""
    n, wpi = [], max(1, 64 // window)
    for q, seq in zip(p.q_lens, p.seqs, strict=True):
        wins = -(-seq // window)
        tiles = -(-wins // wpi) * num_kv_heads
        blocks = -(-q // p.block_m)
        n.append(max(1, min(MAX_SPLITS, programs // tiles, blocks // SPLIT_MIN_BLOCKS)))
    if "colmass" not in need:
        n = [1] * p.batch
    return SignalSplits.of(n, p.q_len.device)


def chunk_qnorm(q: Tensor, p: ExtendPlan, num_kv_heads: int) -> Tensor:
    """float32 ``[B, H_kv, d]``: per request, the L2 norm per channel of its queries over its
    tokens and the query heads of each KV group (``colmass_ref.channel_norms``' ``qn``)."""
    n, hq, d = q.shape
    req = torch.repeat_interleave(
        torch.arange(p.batch, device=q.device), p.q_len.long(), output_size=n
    )
    sq = q.float().square().view(n, num_kv_heads, hq // num_kv_heads, d).sum(2)
    return torch.zeros(p.batch, num_kv_heads, d, device=q.device).index_add_(0, req, sq).sqrt()


# -- the PyTorch twin ----------------------------------------------------------------------------
def gather_kv(st: LayerStore, ls: WindowLists, b: int, h: int, H: int, seq: int):
    """float32 ``k, v [seq, d]`` and ``kept`` bool ``[seq]`` that list ``(b, h)`` reads
    (windows in no list: zeros, not kept; pages dequantized)."""
    W, d = st.rows_k.shape[1:]
    n = -(-seq // W)
    k = torch.zeros(n, W, d, device=st.rows_k.device)
    v = torch.zeros_like(k)
    kept = torch.zeros(n, W, dtype=torch.bool, device=k.device)
    li = b * H + h
    base, nr, npg = li * ls.n_max, int(ls.rows[li]), int(ls.pages[li])
    blk, win = ls.blk[base : base + nr + npg].long(), ls.win[base : base + nr + npg].long()
    k[win[:nr]], v[win[:nr]] = st.rows_k[blk[:nr]].float(), st.rows_v[blk[:nr]].float()
    if npg:
        kq, vq = unpack_uniform_pages(st.pages[blk[nr:]], st.bits, W, d, st.v_group)
        k[win[nr:]], v[win[nr:]] = kq, vq
    kept[win] = True
    k, v, kept = k.view(-1, d)[:seq], v.view(-1, d)[:seq], kept.view(-1)[:seq]
    return k.masked_fill(~kept[:, None], 0.0), v.masked_fill(~kept[:, None], 0.0), kept


def extend_ref(q: Tensor, st: LayerStore, ls: WindowLists, p: ExtendPlan, num_kv_heads: int, *,
               sm_scale: float, need: frozenset[str] = frozenset()):  # fmt: skip
    """:func:`run` and :func:`signals` in float32 PyTorch, request by request: out float32
    ``[n, H_q, d]``, lse ``[n, H_q]`` (log2) and the signals of ``need`` ``[B, H_kv, t_max]``."""
    n, hq, d = q.shape
    H, G = num_kv_heads, p.group
    out = torch.zeros(n, hq, d, device=q.device)
    lse = torch.zeros(n, hq, device=q.device)
    sig = {x: torch.zeros(p.batch, H, p.t_max, device=q.device)
           for x in need & {"attn", "obs_attn", "colmass"}}  # fmt: skip
    q0 = 0
    for b, (tq, seq) in enumerate(zip(p.q_lens, p.seqs, strict=True)):
        for h in range(H):
            k, v, kept = gather_kv(st, ls, b, h, H, seq)
            qb = q[q0 : q0 + tq, h * G : (h + 1) * G].float().transpose(0, 1)  # [G, tq, d]
            s = qb @ k.T * sm_scale  # [G, tq, seq]
            qpos = seq - tq + torch.arange(tq, device=q.device)
            see = kept[None, :] & (torch.arange(seq, device=q.device)[None, :] <= qpos[:, None])
            s = s.masked_fill(~see[None], float("-inf"))
            pr = torch.softmax(s, -1)
            out[q0 : q0 + tq, h * G : (h + 1) * G] = (pr @ v).transpose(0, 1)
            lse[q0 : q0 + tq, h * G : (h + 1) * G] = (torch.logsumexp(s, -1) * LOG2E).T
            if "colmass" in sig:
                sig["colmass"][b, h, :seq] = pr.sum((0, 1))
            if "obs_attn" in sig:
                sig["obs_attn"][b, h, :seq] = pr[:, -OBS_WINDOW:].sum((0, 1))
            if "attn" in sig:
                sig["attn"][b, h, :seq] = pr[:, -1].sum(0)
        q0 += tq
    return out, lse, sig
