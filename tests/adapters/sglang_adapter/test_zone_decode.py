"""The decode batch's lists over a decoupled (RDKV) pool (``zone_decode.lists``), gathered from
each routed request's lists made at its routing, equal those built the plain way: per request and
layer from its placed Zone A pages (``_lists_ref``, the loop the adapter ran before), every field
and dtype, for batches of routed and unrouted requests, with and without rows listed ahead, with
the units numbered by the longest request or by a graph's ``n_max``."""

from __future__ import annotations

import pytest
import torch
from sglang_sim import require

require("sglang.srt.mem_cache.radix_cache")

from test_rdkv import Server, _prompt  # noqa: E402

from tiered_radix.adapters.sglang import zone_decode  # noqa: E402
from tiered_radix.adapters.sglang.reps import FULL  # noqa: E402
from tiered_radix.policy import compile_text  # noqa: E402
from tiered_radix.resources import policies_dir  # noqa: E402

# the shipped rdkv (protected tokens: kept rows outside the pages) at 40% (K channels of several
# widths), re-planned every 3 decode steps (a second routing repacks)
POLICY = compile_text(
    (policies_dir() / "rdkv.yaml")
    .read_text()
    .replace("budget: 10%", "budget: 40%")
    .replace("schedule: after_prefill(defer=true)", "schedule: after_prefill(defer=true), every(3)")
)


def _layer_ref(p, H: int) -> dict:
    """One placed layer's lists as the adapter built them per layer (``p``: ``Placed``)."""
    z, n = p.zone, p.n_tokens
    tok = z.page_tok
    head = torch.repeat_interleave(torch.arange(H), z.pages.sum(1))
    in_page = torch.zeros(H, n, dtype=torch.bool)
    for i in range(tok.shape[0]):
        t = tok[i][tok[i] >= 0]
        in_page[head[i], t] = True
    return dict(
        off=z.page_off + p.base, ntok=(tok >= 0).sum(1).to(torch.int32), tok=tok,
        counts=z.pages.reshape(-1), k_table=z.k_table, perm=z.perm.to(torch.int32),
        rows=p.kept & ~in_page, n=n,
    )  # fmt: skip


def _lists_ref(pool, rids, views, seqs, n_max=None, ahead=False) -> dict:
    """Per request and layer, with Python loops: zone B every token in no page and kept (before
    its routing: every token) up to its end, zone A its pages per (head, V width)."""
    L, H, W, d = pool.layer_num, pool.head_num, pool.layout.window, pool.head_dim
    T = n_max or max(seqs)
    per = []
    for r in rids:
        got = pool.zones.placed.get(r)
        per.append(None if got is None else [_layer_ref(p, H) for p in got])
    ends = [-(-s // W) * W if ahead else s for s in seqs]
    full_n, slots, units, page_n = [], [], [], []
    off, ntok, punits, tables, perms = [], [], [], [], []
    for li in range(L):
        blk = pool.block_all[li, FULL]  # [H, windows]
        tl, pl = [], []
        for b, v in enumerate(views):
            lay = None if per[b] is None else per[b][li]
            for h in range(H):
                read = torch.ones(ends[b], dtype=torch.bool)
                if lay is not None:
                    read[: lay["n"]] = lay["rows"][h]
                t = torch.arange(ends[b])[read]
                full_n.append(t.numel())
                slots.append(blk[h, v.windows[t // W]].long() * W + t % W)
                units.append(h * T + t)
            if lay is None:
                page_n.append(torch.zeros(H * 4, dtype=torch.long))
                tl.append(torch.zeros(H * 4, 12, dtype=torch.int32))
                pl.append(torch.arange(d, dtype=torch.int32).expand(H, d))
                continue
            page_n.append(lay["counts"])
            head = torch.repeat_interleave(torch.arange(H), lay["counts"].view(H, 4).sum(1))
            off.append(lay["off"])
            ntok.append(lay["ntok"])
            punits.append(torch.where(lay["tok"] >= 0, head[:, None] * T + lay["tok"], -1))
            tl.append(lay["k_table"])
            pl.append(lay["perm"])
        tables.append(torch.cat(tl))
        perms.append(torch.cat(pl))
    ptr = torch.zeros(len(full_n) + 1, dtype=torch.int32)
    ptr[1:] = torch.tensor(full_n).cumsum(0)
    page_ptr = torch.zeros(L * len(views) * H * 4 + 1, dtype=torch.int32)
    page_ptr[1:] = torch.cat(page_n).cumsum(0)
    pu = torch.cat(punits).to(torch.int32) if punits else torch.zeros(0, W, dtype=torch.int32)
    valid = pu >= 0
    lo = torch.where(valid, pu, torch.iinfo(torch.int32).max).amin(1)
    hi = torch.where(valid, pu, -1).amax(1)
    B = len(views)
    ahead_n = torch.tensor([e - s for e, s in zip(ends, seqs, strict=True)])
    return dict(
        full_ptr=ptr, slots=torch.cat(slots).to(torch.int32),
        units=torch.cat(units).to(torch.int32), page_ptr=page_ptr,
        page_off=torch.cat(off) if off else torch.zeros(0, dtype=torch.long),
        page_ntok=torch.cat(ntok) if ntok else torch.zeros(0, dtype=torch.int32),
        page_units=pu, page_unit=torch.where(lo == hi, lo, -1).to(torch.int32),
        k_table=torch.stack(tables), perm=torch.stack(perms),
        ahead=ahead_n[None, :, None].expand(L, B, H).flatten().to(torch.int32) if ahead else None,
    )  # fmt: skip


def _same(got: zone_decode.ZoneLists, want: dict) -> None:
    for name, x in want.items():
        y = getattr(got, name)
        if x is None:
            assert y is None, name
            continue
        assert y.dtype == x.dtype and y.shape == x.shape, (name, y.dtype, x.dtype, y.shape, x.shape)
        assert torch.equal(y, x), name


@pytest.fixture(scope="module")
def served():
    """Four requests: ``a`` and ``c`` routed at their first decode step and decoded since (``a``
    re-planned at its fourth), ``b`` a prompt not routed yet, ``d`` routed with no token since."""
    srv = Server(policy=POLICY)
    reqs = {r: srv.admit(r) for r in "abcd"}
    srv.forward([reqs["a"], reqs["c"]], [_prompt(50, 400), _prompt(51, 260)], extend=True)
    for t in range(5):  # routes at decode steps 0 and 3
        srv.forward([reqs["a"], reqs["c"]], [[t + 1], [t + 2]], extend=False)
    srv.forward([reqs["b"], reqs["d"]], [_prompt(52, 97), _prompt(53, 300)], extend=True)
    srv.forward([reqs["d"]], [[9]], extend=False)  # d routes
    srv.forward([reqs["d"]], [[10]], extend=False)
    assert [srv.pool.zones.holds(r) for r in "abcd"] == [True, False, True, True]
    assert len(srv.session("a").store.events.steps) == 2  # routed twice
    lists = [srv.pool.zones.decode_lists(r) for r in "acd"]
    assert all(g.row_n.sum() > 0 and g.pages.sum() > 0 for g in lists)  # rows and pages
    return srv, reqs


@pytest.mark.parametrize("order", ["abcd", "b", "a", "dca", "cbda"])
@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("n_max", [None, 1000])
def test_gathered_lists_equal_the_per_request_loop(served, order, ahead, n_max):
    srv, reqs = served
    rids = list(order)
    views = [srv.cache.views[r] for r in rids]
    seqs = [len(reqs[r].tokens) for r in rids]
    got = zone_decode.lists(srv.pool, rids, views, seqs, n_max, ahead=ahead)
    want = _lists_ref(srv.pool, rids, views, seqs, n_max, ahead)
    _same(got, want)
    assert got.n == [n_max or max(seqs)] * len(rids) and got.n_max == (n_max or max(seqs))
    assert (got.page_off.numel() > 0) == any(srv.pool.zones.holds(r) for r in rids)
    assert torch.equal(got.page_ptr_host.to(torch.int32), got.page_ptr)


def test_a_layers_pages_are_sliced_from_the_host_pointer(served):
    """``ZoneLists.layer_pages`` with the host copy of ``page_ptr`` slices what it slices from
    the device one."""
    srv, reqs = served
    rids = ["a", "b", "c"]
    views = [srv.cache.views[r] for r in rids]
    ls = zone_decode.lists(srv.pool, rids, views, [len(reqs[r].tokens) for r in rids])
    H = srv.pool.head_num
    no_host = zone_decode.ZoneLists(**{**ls.__dict__, "page_ptr_host": None})
    for li in range(srv.pool.layer_num):
        a, b = ls.layer_pages(li, 3, H), no_host.layer_pages(li, 3, H)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert a["page_off"].numel() > 0
