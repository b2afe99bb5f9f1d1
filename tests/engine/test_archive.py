"""``evict(archive=T)``: an evicted unit keeps its tier-``T`` copy for a later turn, outside the
request's bytes; :meth:`TierStore.recall` brings it back at ``T``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_store import run, signals

from tiered_radix.engine.stacked import StackedMoves
from tiered_radix.engine.store import TierStore
from tiered_radix.formats import codecs
from tiered_radix.policy.compiler import compile_text

ROOT = Path(__file__).resolve().parents[2]
QEVICT = (ROOT / "policies" / "qevict.yaml").read_text()


def archiving(write_once: bool = True) -> object:
    text = QEVICT.replace("evicted: evict", "evicted: evict(archive=int2)")
    if not write_once:
        text = text.replace("ledger: write_once", "ledger: none")
    return compile_text(text)


def plain(write_once: bool = True) -> object:
    text = QEVICT if write_once else QEVICT.replace("ledger: write_once", "ledger: none")
    return compile_text(text)


def test_the_language_names_a_quantized_tier():
    """(Its errors are goldens: tests/policy_errors/archive_*.yaml.)"""
    assert archiving().tiers[-1].action.archive == "int2"
    assert archiving().tiers[-1].action != plain().tiers[-1].action


def _routed(policy, seed=0, prompt=2048):
    return run(
        policy, layers=2, heads=2, d=16, prompt=prompt, steps=0, seed=seed, dtype=torch.float32
    )


@pytest.mark.parametrize("write_once", [True, False])
def test_evicted_units_keep_their_copy_outside_the_budget(write_once):
    a, b = _routed(archiving(write_once)), _routed(plain(write_once))
    ev, q = a.tier_set.evict, a.tier_set.archive
    # the archive changes no decision and no attended byte
    for li in range(a.n_layers):
        assert torch.equal(a.tiers(li), b.tiers(li))
        ka, va, kept_a = a.view(li)
        kb, vb, kept_b = b.view(li)
        assert torch.equal(kept_a, kept_b)
        assert torch.equal(ka[kept_a], kb[kept_b]) and torch.equal(va[kept_a], vb[kept_b])
    assert a.bytes_used() == b.bytes_used() <= a.budget_bytes()
    assert b.archived_bytes() == 0
    gone = a.stack.tier[:, :, : a.stack.max_units()] == ev
    assert gone.any()
    present = a.stack.stores[q].present[:, :, : a.stack.max_units()]
    assert bool(present[gone].all())  # every evicted unit is archived
    assert a.archived_bytes() == int(gone.sum()) * a.stack.stores[q].unit_nbytes


def test_recall_reads_the_archived_copy():
    store = _routed(archiving())
    q, ev = store.tier_set.archive, store.tier_set.evict
    before = store.stack.tier.clone()
    rows = {li: store.view(li) for li in range(store.n_layers)}
    n = store.recall()
    gone = before == ev
    assert n == int(gone.sum()) > 0
    assert bool((store.stack.tier[gone] == q).all()) and store.archived_bytes() == 0
    for li in range(store.n_layers):
        k, v, kept = store.view(li)
        was = rows[li][2]
        assert torch.equal(k[was], rows[li][0][was])  # what was attended is unchanged
        back = kept & ~was
        assert back.any()
        # a recalled token reads its INT2 copy: the codec's K over its window, V per token
        assert torch.isfinite(k[back]).all() and torch.isfinite(v[back]).all()
    assert store.recall() == 0  # nothing left to recall


def test_recalled_copy_is_the_quantized_original():
    """The archived copy is the codec's INT2 of the unit's original rows (write-once ledger)."""
    p = archiving()
    g = torch.Generator().manual_seed(3)
    h, d, t = 2, 16, 640
    store = TierStore(p, n_layers=1, n_heads=h, head_dim=d, dtype=torch.float32)
    k, v = torch.randn(h, t, d, generator=g), torch.randn(h, t, d, generator=g)
    store.append(0, k, v)
    store.observe(0, signals(g, torch.ones(h, t, dtype=torch.bool), d, True))
    store.after_prefill()
    if store.deferred:
        store.route("after prefill")
    gone = store.tiers(0) == store.tier_set.evict
    store.recall()
    k_hat, v_hat, kept = store.view(0)
    W = store.layout.size
    hh, u = gone.nonzero()[0].tolist()
    s = slice(u * W, (u + 1) * W)
    ref_k = codecs.dequantize(codecs.quantize(k[hh, s].T.contiguous(), 2, 32)).T
    ref_v = codecs.dequantize(codecs.quantize(v[hh, s].contiguous(), 2, 16))
    assert torch.allclose(k_hat[hh, s], ref_k) and torch.allclose(v_hat[hh, s], ref_v)
    assert bool(kept[hh, s].all())


def _rowless(p, g, t):
    s = TierStore(p, n_layers=2, n_heads=2, head_dim=16, dtype=torch.float32,
                  reader=lambda li: None)  # fmt: skip
    s.append_tokens(None, t)
    return s


@pytest.mark.parametrize("write_once", [True, False])
def test_stacked_moves_archive_as_each_stack_does(write_once):
    """Stores without rows (the SGLang pool's) moving together archive as each alone does."""
    p = archiving(write_once)
    g = torch.Generator().manual_seed(5)
    together = [_rowless(p, g, t) for t in (320, 480)]
    alone = [_rowless(p, g, t) for t in (320, 480)]
    news = []
    for s in together:
        tiers = s.stack.tier[:, :, : s.stack.max_units()].clone()
        tiers[:, :, :4] = s.tier_set.evict  # the first four windows of every head
        tiers[:, :, 4:6] = s.tier_set.archive  # two demoted
        news.append(tiers)
    m = StackedMoves([s.stack for s in together], news)
    m.finish(m.counts.tolist(), [True, True])
    for s, new in zip(alone, news, strict=True):
        s.stack.apply(new)
    q = together[0].tier_set.archive
    for a, b in zip(together, alone, strict=True):
        assert torch.equal(a.stack.tier, b.stack.tier)
        assert torch.equal(a.stack.stores[q].present, b.stack.stores[q].present)
        assert bool(a.stack.stores[q].present[:, :, :6].all())
        assert a.archived_bytes() == b.archived_bytes() == 16 * a.stack.stores[q].unit_nbytes
    assert [int(x) for x in m.nbytes()] == [s.bytes_used() for s in alone]
