"""The decode graphs' index lists (``graph.GraphDecode.load``): a step's list entries scattered
into the fixed buffers in place, with no host read, hold exactly the packed lists the eager
path builds (``trizone.lists``)."""

from __future__ import annotations

import pytest
import torch
from test_backend import KERNEL_POLICY, Harness

from tiered_radix.adapters.sglang import graph, trizone
from tiered_radix.adapters.sglang.sizing import PoolBlocks

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

# ops whose output size or value the host waits for on CUDA (bench/backend_host_ops.py)
HOST_READS = {"aten::nonzero", "aten::_unique2", "aten::unique_dim", "aten::masked_select",
              "aten::unique_consecutive", "aten::_local_scalar_dense", "aten::item"}  # fmt: skip


def _reads(events) -> list[str]:
    """The host reads among profiled ``events``, less ``torch._assert_async``'s (a read on
    CPU only: on CUDA the check runs on the device)."""

    def checked(e) -> bool:
        while e is not None:
            if e.name == "aten::_assert_async":
                return True
            e = e.cpu_parent
        return False

    return [e.name for e in events if e.name in HOST_READS and not checked(e)]


def _routed_pair():
    """Two requests of different lengths after a prefill and a decode routing (windows read
    full, quantized and evicted), with decode graph buffers for batches up to 4: the pool, the
    buffers, the requests' views and lengths."""
    h = Harness(policy=KERNEL_POLICY, head_dim=64, pages=40, blocks=PoolBlocks(96, 96),
                context=256)  # fmt: skip
    a, b = h.start("a", list(range(1, 91))), h.start("b", list(range(20, 61)))
    h.step([a, b], [a.origin_input_ids, b.origin_input_ids], extend=True)
    for t in range(3):  # KERNEL_POLICY routes every 3 steps
        h.step([a, b], [[60 + t], [80 + t]], extend=False)
    h.backend.flush()
    h.backend.init_cuda_graph_state(4, 4)
    views = [h.backend.tree.views[r.rid] for r in (a, b)]
    seqs = [len(r.origin_input_ids) + 3 for r in (a, b)]
    return h.sim.pool, h.backend.graph, views, seqs


@pytest.mark.parametrize("runs", ["one", "a layer each"])
def test_scattered_lists_are_the_packed_lists(runs):
    """All layers' candidates at once, or one layer a run (:func:`~.trizone.candidate_chunks`
    as a large batch takes them), scatter to the same buffers."""
    pool, g, views, seqs = _routed_pair()
    c = trizone.candidates(pool, views, seqs, g.n_max, ahead=True)
    packed = c.compact()
    assert int(c.quant.sum()) > 0 and int(c.listed.sum()) > 0  # pages and rows both listed
    g.clear(4)
    g.slots.fill_(-7)  # stale entries a step must not read
    if runs == "one":
        g.load(4, c)
    else:
        chunks = list(trizone.candidate_chunks(pool, views, seqs, g.n_max, True, max_entries=1))
        assert [ch.layers for ch in chunks] == [range(i, i + 1) for i in range(pool.layer_num)]
        g.load(4, iter(chunks))
    L, H, B = pool.layer_num, pool.head_num, len(views)
    lists = B * H
    for li in range(L):
        ptr = packed.full_ptr[li * lists : (li + 1) * lists + 1].long()
        first, last = int(ptr[0]), int(ptr[-1])
        local = (ptr - first).to(torch.int32)
        assert torch.equal(g.full_ptr[li, : lists + 1], local)
        assert bool((g.full_ptr[li, lists : 4 * H + 1] == local[-1]).all())  # padding: nothing
        assert torch.equal(g.slots[li, : last - first], packed.slots[first:last])
        assert torch.equal(g.units[li, : last - first], packed.units[first:last])
        want_end = local[1:] - packed.ahead[li * lists : (li + 1) * lists]
        assert torch.equal(g.full_end[li, :lists], want_end)
        pptr = packed.page_ptr[li * lists * 4 : (li + 1) * lists * 4 + 1].long()
        p0, p1 = int(pptr[0]), int(pptr[-1])
        assert torch.equal(g.page_ptr[li, : lists * 4 + 1], (pptr - p0).to(torch.int32))
        assert torch.equal(g.page_off[li, : p1 - p0], packed.pages[p0:p1] * pool.page_bytes)
        assert torch.equal(g.page_unit[li, : p1 - p0], packed.page_unit[p0:p1])
        units = packed.page_unit[p0:p1, None].expand(-1, pool.layout.window)
        assert torch.equal(g.page_units[li, : p1 - p0], units)


def test_candidates_span_the_batch_and_number_units_by_the_graph():
    """A step's candidates span the batch's longest request, not the graph's context (token
    units at a 32K context listed 32K positions a request: GPU run 32's gigabytes a step);
    their units keep the graph's numbering ``h * n_max + j``."""
    pool, g, views, seqs = _routed_pair()
    c = trizone.candidates(pool, views, seqs, g.n_max, ahead=True)
    most = max(int(v.windows.numel()) for v in views)
    assert most < g.n_max and c.listed.shape[3] == most
    H = pool.head_num
    want = torch.arange(H)[:, None] * g.n_max + torch.arange(most)
    assert torch.equal(c.unit[0, 0], want)


@pytest.mark.parametrize("spare", [0, -1])
def test_packed_lists_in_layer_runs_are_the_lists_of_all_layers(spare):
    """Runs of one layer (its entries exactly the limit, or the limit under them) pack to the
    lists of all layers at once."""
    pool, g, views, seqs = _routed_pair()
    n = [int(v.windows.numel()) for v in views]
    whole = trizone.lists(pool, views, seqs, g.n_max, ahead=True, max_entries=1 << 30)
    per_layer = len(n) * pool.head_num * max(n) * pool.layout.window
    max_entries = per_layer + spare
    runs = trizone.layer_chunks(pool, n, max_entries)
    assert runs == [range(i, i + 1) for i in range(pool.layer_num)]
    assert trizone.layer_chunks(pool, n, 2 * per_layer)[0] == range(min(2, pool.layer_num))
    parts = trizone.lists(pool, views, seqs, g.n_max, ahead=True, max_entries=max_entries)
    for f in ("full_ptr", "slots", "units", "page_ptr", "pages", "page_unit", "ahead"):
        a, b = getattr(whole, f), getattr(parts, f)
        assert a.dtype == b.dtype and torch.equal(a, b), f


def test_extend_lists_in_layer_runs_are_the_lists_of_all_layers():
    """The extend kernel's window lists built a run of layers at a time (as an extend batch
    takes them, :meth:`~.trizone.ExtendBatch.lists_of`) equal every layer's built at once; the
    batch holds one run's at a time."""
    pool, g, views, seqs = _routed_pair()
    n = [int(v.windows.numel()) for v in views]
    whole = trizone.extend_lists(pool, views)
    assert int(whole.rows.sum()) > 0 and int(whole.pages.sum()) > 0  # rows and pages listed
    per_layer = len(n) * pool.head_num * max(n)
    assert trizone.extend_runs(pool, n, per_layer) == [
        range(i, i + 1) for i in range(pool.layer_num)
    ]
    assert trizone.extend_runs(pool, n, 2 * per_layer)[0] == range(min(2, pool.layer_num))
    assert trizone.extend_runs(pool, n) == [range(pool.layer_num)]  # a small batch: one run
    eb = trizone.build_extend(pool, views, [1, 1], seqs, 7, frozenset())
    eb.runs = trizone.extend_runs(pool, n, per_layer)
    for li in range(pool.layer_num):
        a, b = whole.layer(li), eb.lists_of(li)
        assert eb.run == range(li, li + 1) and eb.held.blk.shape[0] == 1
        for f in ("blk", "win", "rows", "pages"):
            assert torch.equal(getattr(a, f), getattr(b, f)), (li, f)


def test_a_list_rebuild_reads_nothing_back():
    """Building a step's candidates and scattering them: no op whose result the host waits for
    (the packed lists need one per mask)."""
    from torch.profiler import ProfilerActivity, profile

    pool, g, views, seqs = _routed_pair()
    with profile(activities=[ProfilerActivity.CPU]) as p:
        g.load(4, trizone.candidates(pool, views, seqs, g.n_max, ahead=True))
        g.load(4, trizone.candidate_chunks(pool, views, seqs, g.n_max, True, max_entries=1))
    assert not _reads(p.events())
    with profile(activities=[ProfilerActivity.CPU]) as p:
        trizone.lists(pool, views, seqs, g.n_max, ahead=True)
    assert _reads(p.events())  # the check can fail: packing reads the sizes back


def test_positions_past_the_capacity_go_to_the_dump_entry():
    listed = torch.tensor([[True, False, True, True], [False, True, True, False]])
    at = graph._positions(listed, cap=2)  # a [2, 3] buffer: entries 0, 1, then the dump
    assert at.tolist() == [0, 2, 1, 2, 5, 3, 4, 5]


def test_the_default_capacity_holds_every_captured_request_at_full_context_when_memory_allows():
    """``--kv-graph-tokens``' default: ``max_bs`` full contexts (and a window each) when an eighth
    of the free memory pays for them; capped by that eighth; never under the fixed floor."""
    per, ctx, W = graph.token_bytes(24, 2, 64, 32, 32), 26_092, 32
    want = 32 * (ctx + W)  # the serving benchmark's 32 conversations at its context length
    assert graph.auto_tokens(32, ctx, W, per, free=39 << 30) == want
    tight = want * per  # an eighth of this pays for an eighth of the batches' tokens
    assert graph.auto_tokens(32, ctx, W, per, free=tight) == max(want // 8, graph.GRAPH_TOKENS)
    big = graph.auto_tokens(160, 131_072, W, per, free=64 << 30)
    assert big == (64 << 30) // graph.GRAPH_MEMORY_SHARE // per < 160 * (131_072 + W)
    assert graph.auto_tokens(32, ctx, W, per, free=0) == graph.GRAPH_TOKENS  # CPU: the floor
    assert graph.auto_tokens(2, 64, 16, per, free=0) == 2 * (64 + 16)  # small batches: their need
    # h2o's shape at batch 256: row lists only (no quantized tier), 8 bytes a token, layer and
    # head; the side output's 1.5 GiB come off the share first
    tok = graph.token_bytes(24, 2, 64, 1, 256, paged=False)
    assert tok == 24 * 2 * 8 < graph.token_bytes(24, 2, 64, 1, 256) // 2
    mass = graph.mass_bytes(24, 2, 256, 32768)
    assert mass == 3 << 29
    share = (32 << 30) // graph.GRAPH_MEMORY_SHARE
    assert graph.auto_tokens(256, 32768, 1, tok, 32 << 30, mass) == (share - mass) // tok
    assert graph.auto_tokens(256, 32768, 1, tok, 8 << 30, mass) == graph.GRAPH_TOKENS


@pytest.mark.parametrize("tokens", [0, 1, 31, 32, 1000, 26_092, 1 << 20])
def test_token_bytes_bounds_what_the_buffers_grow_by(tokens):
    """What :func:`~.graph.token_bytes` charges a token of capacity is at least what the
    buffers grow by (so the default capacity stays within its share of free memory), and
    over it by less than the rounding up (a byte a token) and one window's worth."""
    L, H, d, W, bs = 24, 2, 64, 32, 32
    per = graph.token_bytes(L, H, d, W, bs)
    grown = graph.buffer_bytes(L, H, d, W, bs, tokens, W, False) - graph.buffer_bytes(
        L, H, d, W, bs, 0, W, False
    )
    assert grown <= per * tokens + per * W  # a partial last window's page entry
    assert per * tokens - grown < tokens + per * W


def test_the_backend_sizes_its_graphs_by_default_and_by_flag():
    """No ``--kv-graph-tokens``: the graphs hold the captured batches' full contexts (here, on
    CPU with no free-memory reading, within the floor); with it, exactly what it says."""
    from tiered_radix.adapters.sglang.options import KVOptions

    h = Harness(policy=KERNEL_POLICY, head_dim=64, pages=30, blocks=PoolBlocks(64, 64), context=64)
    h.backend.init_cuda_graph_state(4, 4)
    assert h.backend.graph.tokens == 4 * (64 + h.sim.W)
    assert h.backend.graph_fits([64] * 4)
    h = Harness(policy=KERNEL_POLICY, head_dim=64, pages=30, blocks=PoolBlocks(64, 64), context=64,
                options=KVOptions(graph_tokens=100))  # fmt: skip
    h.backend.init_cuda_graph_state(4, 4)
    assert h.backend.graph.tokens == 100 and not h.backend.graph_fits([64] * 4)


def test_the_split_count_follows_the_batch_size_unless_batch_invariant():
    """At a server's context (32K) the captured batches' plans split each list by batch size
    (a lone request ~128 ways, one of 8 fewer: its attention sums in another order); the
    options of ``--enable-deterministic-inference`` split every batch size alike."""
    from tiered_radix.adapters.sglang.options import DETERMINISTIC_SPLITS, KVOptions

    def splits(options: KVOptions) -> list[int]:
        h = Harness(policy=KERNEL_POLICY, head_dim=64, pages=30, blocks=PoolBlocks(64, 64),
                    context=32768, options=options)  # fmt: skip
        h.backend.init_cuda_graph_state(8, 8)
        return [h.backend.graph.batch(bs, h.hq).plan.num_splits for bs in (1, 8)]

    one, eight = splits(KVOptions(graph_tokens=4096))
    assert one > eight
    fixed = KVOptions(graph_tokens=4096).batch_invariant()
    assert splits(fixed) == [DETERMINISTIC_SPLITS] * 2
