"""TieredKVPool on the CPU: writes, reads per state, demote/promote/evict, exact bytes, sizing."""

from __future__ import annotations

import pytest
import torch
from sglang_sim import Sim, require

require("sglang.srt.mem_cache.memory_pool")

from tiered_radix.adapters.sglang.pool import PoolFullError, TieredKVPool  # noqa: E402
from tiered_radix.adapters.sglang.reps import (  # noqa: E402
    S_EVICT,
    S_FULL,
    S_Q,
    S_R,
    PoolConfigError,
    Q,
    R,
)
from tiered_radix.adapters.sglang.sizing import PoolBlocks, plan_blocks  # noqa: E402
from tiered_radix.formats import codecs  # noqa: E402
from tiered_radix.policy import load_policy  # noqa: E402
from tiered_radix.policy.model import Budget  # noqa: E402


def written(sim: Sim, tokens: list[int]):
    """A request's windows after prefill, and the bf16 reference rows ``[H, T, d]`` per layer."""
    req = sim.start("a", tokens)
    view = sim.cache.views["a"]
    ref = [
        tuple(x.transpose(0, 1).bfloat16().float() for x in sim.kv(li, tokens))
        for li in range(sim.L)
    ]
    return req, view.windows, ref


@pytest.fixture
def sim():
    return Sim()


def test_write_then_read_is_the_written_rows(sim):
    toks = list(range(1, 14))  # 13 tokens: 3 full windows and a partial one
    _, w, ref = written(sim, toks)
    for li in range(sim.L):
        k, v, kept = sim.pool.read(li, w)
        assert torch.equal(k[:, :13], ref[li][0]) and torch.equal(v[:, :13], ref[li][1])
        assert bool(kept.all())
        assert torch.isnan(k[:, 13:]).all()  # slots of the partial window never written


def test_padding_page_writes_are_dropped(sim):
    before = [len(f) for f in sim.pool.free_rows]
    loc = torch.arange(0, 4)
    k = torch.randn(4, sim.H, sim.d)
    sim.pool.set_kv_buffer(None, loc, k, k, layer_id_override=0)
    assert [len(f) for f in sim.pool.free_rows] == before
    assert bool((sim.pool.owner[0][:, 0] == -1).all())


def test_demote_promote_evict_read_what_the_codec_and_nan_say(sim):
    toks = list(range(1, 13))
    _, w, ref = written(sim, toks)
    pool, W, li = sim.pool, sim.W, 1
    h = torch.tensor([0, 1, 0])
    win = torch.stack([w[0], w[1], w[2]])
    full = torch.full((3,), S_FULL)
    q_free = len(pool.free_q[li])
    pool.move(li, h, win, full, torch.full((3,), S_Q))
    pool.owner[li][h, win] = S_Q
    assert len(pool.free_q[li]) == q_free - 3  # one ledger block per (head, window)
    k, v, _ = pool.read(li, w)
    for hi, u in ((0, 0), (1, 1), (0, 2)):
        rows_k = ref[li][0][hi, u * W : (u + 1) * W]
        rows_v = ref[li][1][hi, u * W : (u + 1) * W]
        # independent reference: K per channel (groups of W tokens), V per token (groups of 4)
        want_k = codecs.dequantize(codecs.quantize(rows_k.T, 2, 4)).T
        want_v = codecs.dequantize(codecs.quantize(rows_v, 2, 4))
        assert torch.equal(k[hi, u * W : (u + 1) * W], want_k)
        assert torch.equal(v[hi, u * W : (u + 1) * W], want_v)
        assert not torch.equal(want_k, rows_k)  # 2-bit codes really lose information
    # untouched (head 1, window 0) still reads the original rows
    assert torch.equal(k[1, :W], ref[li][0][1, :W])
    # promote (0, window 0): restored rows = bf16(dequant(copy)); no new ledger write
    deq = k[0, :W].clone()
    pool.move(li, h[:1], win[:1], torch.tensor([S_Q]), torch.tensor([S_R]))
    pool.owner[li][0, w[0]] = S_R
    k2, _, _ = pool.read(li, w)
    assert torch.equal(k2[0, :W], deq.bfloat16().float())
    assert len(pool.free_q[li]) == q_free - 3
    # demote again: the write-once copy is reused, R's rows go back
    rows_free = len(pool.free_rows[li])
    pool.move(li, h[:1], win[:1], torch.tensor([S_R]), torch.tensor([S_Q]))
    pool.owner[li][0, w[0]] = S_Q
    assert len(pool.free_q[li]) == q_free - 3 and len(pool.free_rows[li]) == rows_free + 1
    # evict (1, window 1): NaN and not kept, its ledger block is free again
    pool.move(li, h[1:2], win[1:2], torch.tensor([S_Q]), torch.tensor([S_EVICT]))
    pool.owner[li][1, w[1]] = S_EVICT
    k3, v3, kept = pool.read(li, w)
    assert torch.isnan(k3[1, W : 2 * W]).all() and torch.isnan(v3[1, W : 2 * W]).all()
    assert not bool(kept[1, W : 2 * W].any()) and bool(kept[0].all())
    assert len(pool.free_q[li]) == q_free - 2


def test_read_live_skips_the_windows_every_head_evicted(sim):
    """``read_live`` returns exactly ``read``'s rows of the windows some head still reads, with
    their token positions, and cuts the last window at the tokens written."""
    toks = list(range(1, 15))  # 14 tokens: 3 full windows and 2 tokens of a fourth
    _, w, _ = written(sim, toks)
    pool, W, li = sim.pool, sim.W, 0
    evict = torch.tensor([S_EVICT])
    for h, u in ((0, 1), (1, 1), (1, 2)):  # window 1 by both heads, window 2 by head 1 only
        pool.move(li, torch.tensor([h]), w[u : u + 1], torch.tensor([S_FULL]), evict)
        pool.owner[li][h, w[u]] = S_EVICT
    k, v, kept = pool.read(li, w)
    lk, lv, lkept, pos = pool.read_live(li, w, pool.owner[li][:, w], 14)
    want = torch.tensor([*range(0, W), *range(2 * W, 3 * W), 3 * W, 3 * W + 1])
    assert torch.equal(pos, want)
    assert torch.equal(lkept, kept[:, pos]) and not bool(lkept[1, W : 2 * W].any())
    live = lkept[..., None].expand_as(lk)
    assert torch.equal(lk[live], k[:, pos][live]) and torch.equal(lv[live], v[:, pos][live])


def test_read_live_without_live_gathers_is_read(sim):
    """With ``gather_live`` off (the CUDA default) ``read_live`` is ``read`` cut at the tokens
    written, every position listed, and quantized rows come out as with it on."""
    toks = list(range(1, 15))
    _, w, _ = written(sim, toks)
    pool, W, li = sim.pool, sim.W, 0
    pool.move(
        li, torch.tensor([0, 1]), w[1:3], torch.tensor([S_FULL] * 2), torch.tensor([S_EVICT, S_Q])
    )
    pool.owner[li][0, w[1]], pool.owner[li][1, w[2]] = S_EVICT, S_Q
    state = pool.owner[li][:, w]
    live = pool.read(li, w, state)
    pool.gather_live = False
    k, v, kept, pos = pool.read_live(li, w, state, 14)
    assert torch.equal(pos, torch.arange(14))
    for got, want in zip((k, v, kept), live, strict=True):
        torch.testing.assert_close(got, want[:, :14], equal_nan=True)
    assert bool(kept[1, 2 * W : 3 * W].all()) and not bool(kept[0, W : 2 * W].any())


def test_bytes_used_and_kv_size_from_first_principles(sim):
    _, w, _ = written(sim, list(range(1, 13)))  # 3 windows x 2 heads x 2 layers at full
    W, d, H = sim.W, sim.d, sim.H
    row = 2 * W * d * 2  # K and V rows of one head-window in bf16
    # one ledger page: K and V each hold codes (8 B), fp16 scales and lows (16 B each), every
    # section padded to 16 bytes (the decode kernel's page format)
    q = 2 * (16 + 16 + 16)
    assert sim.pool.bytes_used() == sim.L * 3 * H * row
    sim.pool.move(0, torch.tensor([0]), w[:1], torch.tensor([S_FULL]), torch.tensor([S_Q]))
    assert sim.pool.bytes_used() == (sim.L * 3 * H - 1) * row + q
    F, Qn = sim.pool.blocks.full, sim.pool.blocks.quant
    k, v = sim.pool.get_kv_size_bytes()
    assert k + v == sim.L * ((F + 2) * row + (Qn + 1) * q)  # rows: the NaN trap and scratch


def test_sizing_gives_more_slots_in_the_same_bytes():
    qevict = load_policy("qevict")
    H, d, size = 8, 128, 32 * 1000
    b = plan_blocks(size, H, d, 2, qevict, Budget("fraction", 0.1))
    row, q = 2 * 32 * d * 2, 2 * (32 * d * 2 // 8 + 4 * (32 * d // 32))
    # bytes per layer: 10% of the full-precision pool, less the NaN traps (a row block and a
    # page), the scratch row block and the padding window's tables (3 kinds x 8 B + 1 a head)
    phys = 0.1 * size * H * d * 2 * 2 - (2 * row + q + H * 25)
    assert b == PoolBlocks(int(0.5 * phys // row), int(0.5 * phys // q))
    assert (b.full + 2) * row + (b.quant + 1) * q + H * 25 <= 0.1 * size * H * d * 2 * 2


def test_a_full_only_share_still_gets_ledger_room():
    """``shares: {full: 100%, int2: 0%}``: rank allocation lets the budget a full window does
    not fill flow down to int2, so the ledger keeps ``MIN_LEDGER_SHARE`` of the bytes (the
    issue-21 crash had one ledger block a layer)."""
    from tiered_radix.adapters.sglang.sizing import MIN_LEDGER_SHARE
    from tiered_radix.policy import compile_text

    p = compile_text(FULL_ONLY)
    b = plan_blocks(32 * 1000, 8, 128, 2, p, Budget("fraction", 0.1))
    row, q = 2 * 32 * 128 * 2, 2 * (32 * 128 * 2 // 8 + 4 * (32 * 128 // 32))
    assert b.quant * q >= 0.99 * MIN_LEDGER_SHARE * (b.full * row + b.quant * q)
    assert b.full * row >= 0.89 * (b.full * row + b.quant * q)


FULL_ONLY = """
policy: full-only
budget: 10%
units: window(size=32)
scores:
  s: cumulative(attn, decay=0.99)
tiers:
  full: keep(bf16)
  int2: quantize(bits=2, group=32)
  evicted: evict
allocate: {method: rank, by: s, shares: {full: 100%, int2: 0%}}
schedule: after_prefill
ledger: write_once
"""


def test_unsupported_layouts_are_typed_errors():
    import dataclasses

    from tiered_radix.policy.model import Granularity

    rdkv = load_policy("rdkv")
    with pytest.raises(PoolConfigError, match="--page-size 32"):  # RDKV: a Zone A page
        TieredKVPool(64, 1, torch.bfloat16, 2, 8, 1, "cpu", policy=rdkv)
    other = dataclasses.replace(rdkv, v=Granularity("window", 32))  # separate, not RDKV's
    with pytest.raises(PoolConfigError, match="separate K and V"):
        TieredKVPool(64, 32, torch.bfloat16, 2, 8, 1, "cpu", policy=other)
    with pytest.raises(PoolConfigError, match="--page-size 32"):
        TieredKVPool(64, 1, torch.bfloat16, 2, 8, 1, "cpu", policy=load_policy("qevict"))


def test_stock_backends_cannot_read_a_tiered_pool(sim):
    with pytest.raises(PoolConfigError, match="tiered_triton"):
        sim.pool.get_key_buffer(0)


def test_out_of_row_blocks_is_a_pool_full_error():
    sim = Sim(blocks=PoolBlocks(full=10, quant=4))  # 2 heads: five windows' worth
    with pytest.raises(PoolFullError, match="row blocks needed"):
        sim.start("a", list(range(1, 25)))  # six windows written at once


@pytest.mark.parametrize("held", [False, True])
def test_rows_held_for_a_forwards_windows_are_not_taken_by_promotions(held):
    """Two windows' rows are free in every layer, as SGLang's decode check counted them; then
    the step lands a routing that promotes a window before its two new windows open. Unheld
    (GPU run 24, batch 64), the promotion takes a row and the windows do not fit:
    ``PoolFullError`` out of the forward. Held for the forward (``rows_held``), the promotion
    stays quantized (a degraded move, as a short pool's) and the windows open."""
    sim = Sim(blocks=PoolBlocks(full=10, quant=4))
    _, w, _ = written(sim, list(range(1, 13)))  # 3 windows x 2 heads: 6 of 10 row blocks
    pool, li, h = sim.pool, 0, torch.zeros(1, dtype=torch.long)
    got = pool.move(li, h, w[:1], torch.tensor([S_FULL]), torch.tensor([S_Q]))
    pool.owner[li][h, w[:1]] = got.to(torch.int8)
    pool.free_rows[li].pop()  # layer 0 back to 4 free rows, as every other layer
    assert pool.windows_free() == 2 and pool.degraded == 0
    with pool.rows_held(2 if held else 0):
        assert pool.short_possible({Q: 0, R: 1}) == held
        back = pool.move(li, h, w[:1], torch.tensor([S_Q]), torch.tensor([S_R]))
        assert back.tolist() == ([S_Q] if held else [S_R])
        assert pool.degraded == int(held)
        if not held:
            with pytest.raises(PoolFullError, match="row blocks needed in layer 0"):
                sim.start("b", list(range(40, 48)))  # the step's two new windows
            return
        sim.start("b", list(range(40, 48)))
    assert pool.windows_free() == 0 and sim.cache.views["b"].windows.numel() == 2


def test_rows_that_cannot_hold_what_the_scheduler_never_lets_go_are_refused_at_launch():
    """POLICY protects the 4 newest tokens (windows of 4): a request holds up to 2 windows of
    them (they may start mid-window). SGLang never retracts its last running request nor a
    chunked prompt midway, and routing frees neither's protected windows: with one window to
    extend into, 5 windows a layer. Fewer are refused, saying what to change."""
    with pytest.raises(PoolConfigError, match="rows hold 4 window.*needs 5.*mem-fraction"):
        Sim(blocks=PoolBlocks(full=8, quant=4))
    assert Sim(blocks=PoolBlocks(full=10, quant=4)).pool.windows_free() == 5


def test_a_move_short_of_blocks_degrades_instead_of_failing():
    """One free ledger block a layer and three windows to quantize: the first is quantized,
    the others go to the next tier down (evicted), and ``move`` says so; a promotion with no
    free row block stays quantized. Nothing raises and every block is accounted for."""
    sim = Sim(blocks=PoolBlocks(full=10, quant=1))
    _, w, _ = written(sim, list(range(1, 13)))  # 3 windows x 2 heads: 6 of 10 row blocks
    pool, li = sim.pool, 0
    h, win = torch.zeros(3, dtype=torch.long), w[:3]
    got = pool.move(li, h, win, torch.full((3,), S_FULL), torch.full((3,), S_Q))
    assert got.tolist() == [S_Q, S_EVICT, S_EVICT] and pool.degraded == 2
    pool.owner[li][h, win] = got.to(torch.int8)
    assert len(pool.free_q[li]) == 0 and len(pool.free_rows[li]) == 4 + 3
    while pool.free_rows[li]:  # no row left to restore into
        pool.free_rows[li].pop()
    back = pool.move(li, h[:1], win[:1], torch.tensor([S_Q]), torch.tensor([S_R]))
    assert back.tolist() == [S_Q] and pool.degraded == 3
    k, _, kept = pool.read(li, win)
    assert bool(kept[0, : sim.W].all()) and not bool(kept[0, sim.W :].any())
    assert not torch.isnan(k[0, : sim.W]).any()  # the quantized window still reads its codes
