"""TriZone extend kernels (interpreted on CPU, compiled on CUDA) vs their PyTorch twin, and the
twin vs the transformers adapter's ``attend`` (the signal definitions) over the same rows: a
batch of requests of different prefix and chunk lengths whose prefix windows are full rows,
INT-k pages or evicted per head, in one launch."""

from __future__ import annotations

import pytest
import torch
from triton_guard import CUDA, require_triton

require_triton()
DEV = "cuda" if CUDA else "cpu"
# float32 dots under the interpreter; on the GPU the dots take bf16 operands (dequantized keys
# and probabilities rounded to bf16)
TOL = 2e-2 if CUDA else 1e-3

from tiered_radix.kernels import extend  # noqa: E402

from tiered_radix.engine.attention import attend  # noqa: E402
from tiered_radix.formats.layout import pack_uniform_pages  # noqa: E402


def make_batch(prefix, chunk, *, H=2, G=2, d=64, W=16, bits=2, v_group=16, seed=0,
               dtype=torch.bfloat16, p_page=0.35, p_evict=0.25, dev=DEV):  # fmt: skip
    """Random storage and window lists: request b has prefix[b] old tokens and chunk[b] new
    ones; prefix windows wholly before the chunk are rows / pages / absent at random per head;
    the chunk's windows (and the partial one it continues) are rows in every head. Unused rows
    and rows past each request's length are NaN, as in the pool."""
    g = torch.Generator().manual_seed(seed)
    B = len(prefix)
    seqs = [p + c for p, c in zip(prefix, chunk, strict=True)]
    N = max(-(-s // W) for s in seqs)
    n_rows = 1 + B * H * N  # block 0: the NaN trap
    rows_k = torch.randn(n_rows, W, d, generator=g)
    rows_v = torch.randn(n_rows, W, d, generator=g)
    rows_k[0] = rows_v[0] = float("nan")
    pk, pv = torch.randn(B * H * N, W, d, generator=g), torch.randn(B * H * N, W, d, generator=g)
    pk = pk * torch.rand(B * H * N, 1, d, generator=g) * 3  # per-channel spread, as real K
    pages = None  # no pages asked for: the store has none (token units)
    if p_page > 0:
        pages = pack_uniform_pages(pk, pv, bits, v_group)
        pages = torch.cat([torch.zeros_like(pages[:1]), pages])  # page 0: never listed
    kind = torch.full((B, H, N), extend.ABSENT, dtype=torch.int8)
    row_blk = torch.zeros(B, H, N, dtype=torch.long)
    page_blk = torch.zeros(B, H, N, dtype=torch.long)
    perm = torch.randperm(n_rows - 1, generator=g) + 1
    pperm = torch.randperm(B * H * N, generator=g) + 1
    i = 0
    for b in range(B):
        n, first_new = -(-seqs[b] // W), prefix[b] // W
        for h in range(H):
            for j in range(n):
                row_blk[b, h, j], page_blk[b, h, j] = perm[i], pperm[i]
                i += 1
                u = float(torch.rand((), generator=g))
                if j >= first_new or u >= p_page + p_evict:
                    kind[b, h, j] = extend.ROW
                elif u < p_page:
                    kind[b, h, j] = extend.PAGE
            last = int(row_blk[b, h, n - 1])
            rows_k[last, seqs[b] - (n - 1) * W :] = float("nan")
            rows_v[last, seqs[b] - (n - 1) * W :] = float("nan")
    used = row_blk[kind == extend.ROW].unique()
    free = torch.ones(n_rows, dtype=torch.bool)
    free[used] = False
    rows_k[free] = rows_v[free] = float("nan")
    q = torch.randn(sum(chunk), H * G, d, generator=g) * 2
    st = extend.LayerStore(rows_k.to(dtype).to(dev), rows_v.to(dtype).to(dev),
                           None if pages is None else pages.to(dev), bits, v_group)  # fmt: skip
    ls = extend.window_lists(kind.to(dev), row_blk.to(dev), page_blk.to(dev))
    p = extend.plan(list(chunk), seqs, G, dev)
    return q.to(dtype).to(dev), st, ls, p, kind


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6))


CASES = {
    "mixed": ([0, 70, 33, 5, 96], [40, 20, 1, 33, 48]),
    "long": ([150, 0], [70, 130]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("G", [1, 3])
def test_kernel_matches_its_twin(case, G):
    prefix, chunk = CASES[case]
    q, st, ls, p, kind = make_batch(prefix, chunk, G=G, seed=len(case) + G)
    assert bool((kind == extend.PAGE).any()) and bool((kind == extend.ABSENT).any())
    scale = 64**-0.5
    out = torch.full_like(q, float("nan"))  # poisoned: every row must be written
    lse = torch.full(q.shape[:2], float("nan"), device=q.device)
    qsq = torch.zeros(p.batch, p.tiles_max, 2, 64, device=q.device)
    out, lse = extend.run(q, st, ls, p, 2, sm_scale=scale, out=out, lse=lse, qnorm_sq=qsq)
    qnorm = extend.chunk_qnorm(q, p, 2)
    torch.testing.assert_close(extend.qnorm_of(qsq), qnorm, rtol=1e-5, atol=1e-5)
    out2, lse2 = extend.run(q, st, ls, p, 2, sm_scale=scale)  # the qnorm changes nothing else
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
    need = frozenset({"attn", "obs_attn", "colmass"})
    bufs = {n: torch.full((p.batch, 2, p.t_max + 3), float("nan"), device=q.device) for n in need}
    sig = extend.signals(q, lse, st, ls, p, 2, need, sm_scale=scale, into=bufs)
    ro, rl, rs = extend.extend_ref(q, st, ls, p, 2, sm_scale=scale, need=need)
    assert not out.isnan().any() and not lse.isnan().any()
    assert rel(out, ro) < 1e-2, rel(out, ro)
    torch.testing.assert_close(lse, rl, rtol=TOL, atol=TOL)
    for n in need:
        assert sig[n] is bufs[n] and not sig[n].isnan().any()
        got = sig[n][..., : p.t_max]
        assert rel(got, rs[n]) < TOL, (n, rel(got, rs[n]))
        assert not sig[n][..., p.t_max :].any()


def test_signals_into_buffers_the_caller_zeroed_equal_zeroed_here():
    """``zeroed=True`` (every layer's buffers zeroed at once by the caller) writes what the
    default (zeroing each call's buffers) does; positions in no list keep what the buffers held,
    so the zeroing is the caller's."""
    q, st, ls, p, _ = make_batch([20, 0], [40, 17], seed=6)
    scale, need = 64**-0.5, frozenset({"attn", "obs_attn", "colmass"})
    _, lse = extend.run(q, st, ls, p, 2, sm_scale=scale)
    here = extend.signals(q, lse, st, ls, p, 2, need, sm_scale=scale)
    zeros = {n: torch.zeros(p.batch, 2, p.t_max, device=q.device) for n in need}
    given = extend.signals(q, lse, st, ls, p, 2, need, sm_scale=scale, into=zeros, zeroed=True)
    for n in need:
        assert torch.equal(given[n], here[n])
    ones = {n: torch.ones(p.batch, 2, p.t_max, device=q.device) for n in need}
    left = extend.signals(q, lse, st, ls, p, 2, need, sm_scale=scale, into=ones, zeroed=True)
    assert all(bool((left[n] == 1).any()) for n in need)  # positions in no list: not zeroed


@pytest.mark.parametrize("need", [{"attn"}, {"obs_attn"}, {"colmass", "attn"}])
def test_only_the_signals_asked_for_are_computed(need):
    q, st, ls, p, _ = make_batch([20, 0], [40, 17], seed=5)
    scale = 64**-0.5
    _, lse = extend.run(q, st, ls, p, 2, sm_scale=scale)
    sig = extend.signals(q, lse, st, ls, p, 2, frozenset(need), sm_scale=scale)
    _, _, rs = extend.extend_ref(q, st, ls, p, 2, sm_scale=scale, need=frozenset(need))
    assert set(sig) == need
    for n in need:
        assert rel(sig[n], rs[n]) < TOL
    assert extend.signals(q, lse, st, ls, p, 2, frozenset({"qnorm"}), sm_scale=scale) == {}


def test_twin_and_kernel_match_attend_on_the_gathered_rows():
    """The signal definitions: ``attend`` over each request's rows (evicted ones not kept)
    gives the same outputs, ``attn``, ``obs_attn``, ``colmass`` and ``qnorm``."""
    q, st, ls, p, _ = make_batch([40, 3], [50, 29], G=2, seed=9)
    scale = 64**-0.5
    need = frozenset({"attn", "obs_attn", "colmass"})
    qsq = torch.zeros(p.batch, p.tiles_max, 2, 64, device=q.device)
    out, lse = extend.run(q, st, ls, p, 2, sm_scale=scale, qnorm_sq=qsq)
    sig = extend.signals(q, lse, st, ls, p, 2, need, sm_scale=scale)
    qn = extend.chunk_qnorm(q, p, 2)
    torch.testing.assert_close(extend.qnorm_of(qsq), qn, rtol=1e-5, atol=1e-5)
    q0 = 0
    for b, (tq, seq) in enumerate(zip(p.q_lens, p.seqs, strict=True)):
        kv = [extend.gather_kv(st, ls, b, h, 2, seq) for h in range(2)]
        k, v, kept = (torch.stack(x) for x in zip(*kv, strict=True))
        qb = q[q0 : q0 + tq].transpose(0, 1)
        o, s = attend(qb, k, v, kept, scale, need=need | {"qnorm"})
        assert rel(out[q0 : q0 + tq].transpose(0, 1), o) < 1e-2
        for name in need:
            assert rel(sig[name][b, :, :seq], getattr(s, name)) < TOL, name
        torch.testing.assert_close(qn[b], s.qnorm, rtol=1e-3, atol=1e-3)
        q0 += tq


def test_window_lists_sort_rows_before_pages_in_window_order():
    kind = torch.tensor([[[0, 2, 1, 0, 1, 0]]], dtype=torch.int8)
    rb = torch.arange(6)[None, None] + 10
    pb = torch.arange(6)[None, None] + 20
    ls = extend.window_lists(kind, rb, pb)
    assert ls.rows.tolist() == [3] and ls.pages.tolist() == [2]
    assert ls.win.tolist()[:5] == [0, 3, 5, 2, 4]
    assert ls.blk.tolist()[:5] == [10, 13, 15, 22, 24]


@pytest.mark.parametrize("G", [1, 7])
def test_token_rows_without_pages_match_the_twin(G):
    """Windows of one token with no pages (the SGLang pool of h2o, snapkv, streaming): a key
    tile is 64 one-row windows; outputs, lse and every signal match the twin, evicted tokens
    in the prefix included."""
    prefix, chunk = [0, 70, 33], [40, 20, 9]
    q, st, ls, p, kind = make_batch(prefix, chunk, G=G, W=1, p_page=0.0, p_evict=0.5,
                                    seed=5 + G)  # fmt: skip
    assert st.pages is None
    assert bool((kind == extend.ABSENT).any()) and not bool((kind == extend.PAGE).any())
    scale = 64**-0.5
    out, lse = extend.run(q, st, ls, p, 2, sm_scale=scale)
    need = frozenset({"attn", "obs_attn", "colmass"})
    sig = extend.signals(q, lse, st, ls, p, 2, need, sm_scale=scale)
    ro, rl, rs = extend.extend_ref(q, st, ls, p, 2, sm_scale=scale, need=need)
    assert not out.isnan().any() and rel(out, ro) < 1e-2, rel(out, ro)
    torch.testing.assert_close(lse, rl, rtol=TOL, atol=TOL)
    for n in need:
        assert rel(sig[n][..., : p.t_max], rs[n]) < TOL, n


def test_bad_inputs_are_refused():
    q, st, ls, p, _ = make_batch([0], [20])
    with pytest.raises(extend.ExtendInputError, match="q must be"):
        extend.run(q[:5], st, ls, p, 2, sm_scale=1.0)
    with pytest.raises(extend.ExtendInputError, match="q_lens"):
        extend.plan([5], [4], 2, "cpu")
    with pytest.raises(extend.ExtendInputError, match="lists for"):
        extend.run(q, st, ls, extend.plan([20], [20], 4, q.device), 1, sm_scale=1.0)
    with pytest.raises(extend.ExtendInputError, match="qnorm_sq"):
        extend.run(q, st, ls, p, 2, sm_scale=1.0, qnorm_sq=torch.zeros(1, 1, 2, 32))


@pytest.mark.parametrize("block_m, ppi, unpack", [(32, 1, None), (16, 2, None), (16, 1, "shift")])
def test_tile_variants_match_the_twin(block_m, ppi, unpack):
    """The benchmark's variants (32-token tiles, two pages an iteration) and the shift
    unpacking that 16-token pages take on CUDA."""
    q, st, ls, _, _ = make_batch([70, 0], [50, 33], G=3, seed=4)
    p = extend.plan([50, 33], [120, 33], 3, q.device, block_m=block_m)
    assert p.tiles_max == -(-50 // block_m)
    qsq = torch.full((p.batch, p.tiles_max + 1, 2, 64), 0.0, device=q.device)
    qsq[:, -1] = 7.0  # past the plan's tiles: left as given
    out, lse = extend.run(q, st, ls, p, 2, sm_scale=0.125, ppi=ppi, unpack=unpack, qnorm_sq=qsq)
    assert bool((qsq[:, -1] == 7.0).all())
    qn = extend.qnorm_of(qsq[:, :-1])
    torch.testing.assert_close(qn, extend.chunk_qnorm(q, p, 2), rtol=1e-5, atol=1e-5)
    need = frozenset({"attn", "colmass"})
    sig = extend.signals(q, lse, st, ls, p, 2, need, sm_scale=0.125, unpack=unpack)
    ro, _, rs = extend.extend_ref(q, st, ls, p, 2, sm_scale=0.125, need=need)
    assert rel(out, ro) < 1e-2
    assert all(rel(sig[n], rs[n]) < TOL for n in need)


@pytest.mark.parametrize("runs", [(2, 3), (3, 1)])
def test_split_rows_sum_to_the_signals_of_one_program(runs):
    """Each request's query rows read in ``runs[b]`` runs, each writing partial sums to its own
    row of the buffers; their totals are the signals (up to float order), the last queries'
    ``obs_attn`` and ``attn`` included where the observation window spans two runs (16-token
    blocks). A request's totals are the same bits alone as in the batch."""
    q, st, ls, _, _ = make_batch([70, 0], [90, 130], G=3, seed=8)
    p = extend.plan([90, 130], [160, 130], 3, q.device, block_m=16)
    need = frozenset({"attn", "obs_attn", "colmass"})
    _, lse = extend.run(q, st, ls, p, 2, sm_scale=0.125)
    one = extend.signals(q, lse, st, ls, p, 2, need, sm_scale=0.125)
    sp = extend.SignalSplits.of(list(runs), q.device)
    parts = {n: torch.full((sum(runs), 2, p.t_max), 5.0, device=q.device) for n in need}
    got = extend.signals(q, lse, st, ls, p, 2, need, sm_scale=0.125, into=parts, splits=sp)
    _, _, rs = extend.extend_ref(q, st, ls, p, 2, sm_scale=0.125, need=need)
    for n in need:
        assert got[n] is parts[n]
        torch.testing.assert_close(sp.total(got[n]), one[n], rtol=1e-5, atol=1e-6)
        assert rel(sp.total(got[n]), rs[n]) < TOL
    # every run of request 0 holds a part of colmass; its prefix keys see its 90 queries (6
    # blocks): the last 32 (rows 58-89) are in the last run of 3 blocks (2 runs), in the last
    # two runs of 2 blocks (3 runs: both write parts of obs_attn)
    assert all(bool(got["colmass"][r].any()) for r in range(runs[0]))
    holding = (got["obs_attn"][: runs[0], :, :70] != 0).sum(0)
    assert bool((holding[holding > 0] == runs[0] - 1).all()) and bool(holding.any())
    # request 1 alone (its own plan, lists, lse) in runs[1] runs: its totals, bit for bit
    H, N = 2, ls.n_max
    mine = extend.WindowLists(ls.blk.view(2, H * N)[1], ls.win.view(2, H * N)[1],
                              ls.rows.view(2, H)[1], ls.pages.view(2, H)[1], N)  # fmt: skip
    p1 = extend.plan([130], [130], 3, q.device, block_m=16)
    q1 = q[90:].contiguous()
    _, lse1 = extend.run(q1, st, mine, p1, 2, sm_scale=0.125)
    sp1 = extend.SignalSplits.of([runs[1]], q.device)
    alone = extend.signals(q1, lse1, st, mine, p1, 2, need, sm_scale=0.125, splits=sp1)
    for n in need:
        assert torch.equal(sp1.total(alone[n])[0], sp.total(got[n])[1, :, :130])
    with pytest.raises(extend.ExtendInputError, match="buffer must be"):
        extend.signals(q, lse, st, ls, p, 2, need, sm_scale=0.125, into=one, splits=sp)
    with pytest.raises(extend.ExtendInputError, match="splits for 1 requests"):
        extend.signals(q, lse, st, ls, p, 2, need, sm_scale=0.125, splits=sp1)


def test_signal_splits_fill_a_small_grid_only_for_colmass():
    """A request alone decides its runs: an 8K-token chunk (Qwen's 2 KV heads, 32-token
    windows: 256 key-tile programs) 4, a 4K chunk with no prefix 8; a chunk over a 30K prefix
    (938 programs) 1, as a policy without colmass, and a chunk too short for 16 blocks a run."""
    col = frozenset({"colmass", "obs_attn"})
    p = extend.plan([8192, 4096, 8192, 600], [8192, 4096, 30000, 600], 7, "cpu")
    assert extend.signal_splits(p, 32, 2, col).n == (4, 8, 1, 2)
    assert extend.signal_splits(p, 32, 2, frozenset({"attn", "obs_attn"})).n == (1, 1, 1, 1)
    sp = extend.signal_splits(p, 32, 2, col)
    assert sp.rows == 15 and sp.most == 8
    assert sp.table.tolist() == [0, 4, 12, 13, 4, 8, 1, 2]
    with pytest.raises(extend.ExtendInputError, match="at least 1"):
        extend.SignalSplits.of([2, 0], "cpu")


def test_plan_tiles_are_every_tile_once_the_furthest_first():
    p = extend.plan([40, 100, 5], [40, 300, 5], 2, "cpu", block_m=16)
    tiles = list(zip(p.tile_b.tolist(), p.tile_m.tolist(), strict=True))
    want = {(b, m) for b, q in enumerate([40, 100, 5]) for m in range(0, q, 16)}
    assert sorted(tiles) == sorted(want) and p.n_tiles == len(want) and p.tiles_max == 7
    seqs, q_lens = [40, 300, 5], [40, 100, 5]
    last = [seqs[b] - q_lens[b] + min(m + 16, q_lens[b]) for b, m in tiles]
    assert last == sorted(last, reverse=True)


def test_batches_of_any_shape_launch_one_compiled_variant():
    """The server's batches change every step (requests, lengths, tiles, list lengths, layer
    slices of the shared buffers); each of them compiling a new variant of the kernels costs
    seconds in front of a first token (run 19's serving benchmark: 57 s of extend host time over
    38 batches). The arguments that change with the batch are kept out of the compiled key, so
    one set of constexprs (dtype, page format, which signals) is one variant for every batch."""
    from jit_variants import JitVariants

    L, H = 3, 2
    g = torch.Generator().manual_seed(3)
    with JitVariants() as v:
        for t in range(9):
            B = int(torch.randint(1, 7, (), generator=g))
            prefix = torch.randint(0, 100, (B,), generator=g).tolist()
            chunk = torch.randint(1, 70, (B,), generator=g).tolist()
            q, st, ls, p, _ = make_batch(prefix, chunk, H=H, W=32, seed=t)
            stacked = (torch.stack([x] * L) for x in (ls.blk, ls.win, ls.rows, ls.pages))
            every = extend.WindowLists(*stacked, ls.n_max)
            splits = extend.signal_splits(p, 32, H, frozenset({"colmass"}))
            sig = torch.zeros(L, splits.rows, H, p.t_max, device=DEV)
            qsq = torch.zeros(L, B, p.tiles_max, H, q.shape[-1], device=DEV)
            li = t % L
            _, lse = extend.run(q, st, every.layer(li), p, H, sm_scale=0.125, qnorm_sq=qsq[li])
            extend.signals(q, lse, st, every.layer(li), p, H, frozenset({"attn", "colmass"}),
                           sm_scale=0.125, into={"attn": sig[li], "colmass": sig[(li + 1) % L]},
                           zeroed=True, splits=splits)  # fmt: skip
            # qevict's reads, filled by the attention launch itself (its other variant)
            tiles = extend.tile_splits(p, frozenset({"attn", "obs_attn"}))
            own = torch.zeros(L, tiles.rows, H, p.t_max, device=DEV)
            extend.run(q, st, every.layer(li), p, H, sm_scale=0.125, splits=tiles,
                       into={"attn": own[li], "obs_attn": own[(li + 1) % L]})  # fmt: skip
    for name, variants in (("_extend_attn_kernel", 2), ("_extend_signals_kernel", 1)):
        assert len(v.specs[name]) == 9 * variants
        assert len(v.keys[name]) == variants, v.varying(name)


@pytest.mark.parametrize("need", [{"attn", "obs_attn"}, {"obs_attn"}, {"attn"}])
@pytest.mark.parametrize("block_m", [None, 16])
def test_run_fills_attn_and_obs_attn_in_its_own_launch(need, block_m):
    """``run(into=...)``: a tile holding observed query rows sums their probabilities with its
    final lse in the same launch, each into its own row (chunks shorter than the observation
    window, not aligned to a tile, several tiles); the rows' total equals the twin's signals
    and the signals pass's, and the outputs and lse are run()'s without them."""
    prefix, chunk = [0, 70, 33, 5, 96], [40, 20, 1, 33, 48]
    q, st, ls, _, _ = make_batch(prefix, chunk, G=3, seed=9)
    seqs = [a + b for a, b in zip(prefix, chunk, strict=True)]
    p = extend.plan(chunk, seqs, 3, q.device, block_m=block_m)
    scale, need = 64**-0.5, frozenset(need)
    splits = extend.tile_splits(p, need)
    if "obs_attn" in need:  # some requests' observed rows span several tiles
        assert max(splits.n) > 1 and min(splits.n) == 1
    into = {n: torch.zeros(splits.rows, 2, p.t_max, device=q.device) for n in need}
    out, lse = extend.run(q, st, ls, p, 2, sm_scale=scale, into=into, splits=splits)
    out0, lse0 = extend.run(q, st, ls, p, 2, sm_scale=scale)
    assert torch.equal(out, out0) and torch.equal(lse, lse0)
    _, _, rs = extend.extend_ref(q, st, ls, p, 2, sm_scale=scale, need=need)
    two = extend.signals(q, lse, st, ls, p, 2, need, sm_scale=scale)
    for n in need:
        got = splits.total(into[n])
        assert got.shape == rs[n].shape
        assert rel(got, rs[n]) < TOL, (n, rel(got, rs[n]))
        torch.testing.assert_close(got, two[n], rtol=TOL, atol=1e-5)


def test_run_refuses_signals_it_does_not_fill():
    q, st, ls, p, _ = make_batch([20, 0], [40, 17], seed=5)
    buf = torch.zeros(p.batch, 2, p.t_max, device=q.device)
    with pytest.raises(extend.ExtendInputError, match="tile_splits"):
        extend.run(q, st, ls, p, 2, sm_scale=0.1, into={"colmass": buf},
                   splits=extend.tile_splits(p, frozenset({"attn"})))  # fmt: skip
    with pytest.raises(extend.ExtendInputError, match="tile_splits"):
        extend.run(q, st, ls, p, 2, sm_scale=0.1, into={"attn": buf})
