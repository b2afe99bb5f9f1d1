"""The shipped RDKV policy over a chunked prefill: one routing after the whole prompt, on the
signals of the whole prompt (``cumulative(colmass)`` and ``sqrt(cumulative(qnorm ^ 2))`` sum
the chunks' contributions; ``obs_attn`` is the last 32 prompt queries', which the last chunk
holds), so a server that chunks the prompt decides what one forward does."""

from __future__ import annotations

import pytest
import torch

from tiered_radix import load_policy
from tiered_radix.engine.attention import attend
from tiered_radix.engine.signals import PREFILL_SIGNALS, policy_reads
from tiered_radix.engine.store import TierStore
from tiered_radix.policy.compiler import compile_text
from tiered_radix.resources import policies_dir

L, H, HQ, D, T = 2, 2, 4, 32, 192


def _qkv(seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(L, HQ, T, D, generator=g)
    k = torch.randn(L, H, T, D, generator=g) + torch.randn(1, 1, 1, D, generator=g)
    v = torch.randn(L, H, T, D, generator=g)
    return q, k.bfloat16().float(), v.bfloat16().float()


def _prefill(policy, chunks: list[int], seed: int) -> TierStore:
    """Feed the prompt in ``chunks`` (attention over what the store holds, as an adapter
    does), calling ``after_prefill`` after each; then the first decode step's routing, if the
    schedule deferred it."""
    q, k, v = _qkv(seed)
    need = frozenset(policy_reads(policy) & set(PREFILL_SIGNALS))  # what an adapter computes
    store = TierStore(policy, n_layers=L, n_heads=H, head_dim=D, dtype=torch.bfloat16)
    pos = 0
    for n in chunks:
        for li in range(L):
            store.append(li, k[li, :, pos : pos + n], v[li, :, pos : pos + n])
            kk, vv, kept = store.view(li)
            _, sig = attend(q[li, :, pos : pos + n], kk, vv, kept, D**-0.5, need=need)
            store.observe(li, sig)
        store.after_prefill(f"after prefill {pos}")
        pos += n
    if store.schedule_due(0):
        store.route("decode step 0")
    return store


def _unprotected():
    """The shipped RDKV without its protected tokens: at this test's 192 tokens the 68
    protected ones alone hold more than 10% of the bytes, so only this one can show the
    budget kept."""
    text = (policies_dir() / "rdkv.yaml").read_text()
    return compile_text(text.replace("protect:\n  sinks: 4\n  recent: 64\n", ""))


@pytest.mark.parametrize("chunks", [[64, 128], [96, 32, 64], [32] * 6])
@pytest.mark.parametrize("shipped", [True, False], ids=["shipped", "unprotected"])
def test_chunked_prefill_decides_the_tiers_of_one_forward(chunks, shipped):
    """One routing (at the first decode step), the same V tiers, K channel tiers and channel
    set as the prompt in one forward, layer by layer."""
    rdkv = load_policy("rdkv") if shipped else _unprotected()
    assert (rdkv.protect.sinks > 0) == shipped
    one, split = _prefill(rdkv, [T], 0), _prefill(rdkv, chunks, 0)
    assert one.step == split.step == 1 and not split.deferred
    for li in range(L):
        assert torch.equal(split.tiers(li), one.tiers(li))
        for a, b in zip(split.channel_tiers(li), one.channel_tiers(li), strict=True):
            assert torch.equal(a, b)
    assert split.bytes_used() == one.bytes_used()
    if not shipped:
        assert one.bytes_used() <= one.budget_bytes()


def test_the_weights_are_the_whole_prompts():
    """After three chunks the evaluated weights equal one forward's (the per-chunk signals
    alone, what the policy read before, do not: the last chunk's colmass misses the first
    chunks' queries)."""
    from tiered_radix.engine.units import UnitLayout

    rdkv = load_policy("rdkv")
    text = (policies_dir() / "rdkv.yaml").read_text()
    last = compile_text(
        text.replace("cumulative(colmass)", "colmass")
        .replace("sqrt(cumulative(qnorm ^ 2))", "qnorm")
    )  # fmt: skip
    one, split = _prefill(rdkv, [T], 1), _prefill(rdkv, [64] * 3, 1)
    naive = _prefill(last, [64] * 3, 1)
    chan = UnitLayout("channel", 1, D)
    a = rdkv.allocate
    for li in range(L):
        for expr, lay in ((a.v_weight, one.layout), (a.k_weight, chan)):
            want = one.scores.evaluate(li, expr, lay)
            torch.testing.assert_close(split.scores.evaluate(li, expr, lay), want)
        got = naive.scores.evaluate(li, last.allocate.v_weight, naive.layout)
        assert not torch.allclose(got, one.scores.evaluate(li, a.v_weight, one.layout))
