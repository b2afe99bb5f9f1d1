"""SGLang's prefill CUDA graphs around the tiered attention (``--kv-prefill-graphs``): its
breakable graphs capture the layers between attention calls on a dummy batch (no request ids)
and replay them with every attention call run eagerly on a copy of the batch. The backend's
part of that contract, on CPU (the graphs themselves need CUDA): a capture writes, routes and
keeps nothing, and a replayed extend reads, writes and routes as the eager one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang_sim import require

require("sglang.srt.server_args")

from test_backend import KERNEL_POLICY, Harness, Mode  # noqa: E402

from tiered_radix.adapters.sglang.options import KVOptions  # noqa: E402
from tiered_radix.adapters.sglang.sizing import PoolBlocks  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def harness(kernel: bool) -> Harness:
    options = KVOptions(extend="kernel" if kernel else "exact", decode="gather")
    return Harness(policy=KERNEL_POLICY, head_dim=64, pages=40, blocks=PoolBlocks(96, 96),
                   context=256, options=options)  # fmt: skip


def capture(h: Harness, n: int) -> list[torch.Tensor]:
    """What the graph runner does for a bucket of ``n`` tokens: metadata for its dummy batch,
    then every layer on dummy q/k/v; returns the layers' outputs."""
    fb = SimpleNamespace(
        forward_mode=Mode(True), rids=None, batch_size=1,
        out_cache_loc=torch.zeros(n, dtype=torch.long), seq_lens_cpu=torch.tensor([n]),
        extend_prefix_lens_cpu=[0], extend_seq_lens_cpu=[n],
    )  # fmt: skip
    h.backend.init_forward_metadata(fb)
    g = torch.Generator().manual_seed(n)
    d = h.sim.d
    return [
        h.backend.forward_extend(torch.randn(n, h.hq * d, generator=g),
                                 torch.randn(n, h.sim.H, d, generator=g),
                                 torch.randn(n, h.sim.H, d, generator=g), layer, fb)
        for layer in h.layers
    ]  # fmt: skip


def pool_state(h: Harness) -> list[torch.Tensor]:
    p = h.sim.pool
    return [x.clone() for x in (p.rows_k_all, p.rows_v_all, p.block_all, p.owner_all, p.ref_all)]


def same(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Equal, NaN where NaN (free rows hold NaN)."""
    return torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num())


@pytest.mark.parametrize("kernel", [False, True], ids=["gather", "extend-kernel"])
def test_a_capture_changes_nothing_and_a_replay_is_the_eager_extend(kernel, monkeypatch):
    """Two servers, one eager, one that captured buckets of 64 and 16 tokens first and then
    runs its extends as replays (the layers see a copy of the batch): the capture's layers
    return zeros of the model's shape and leave the pool, the allocator and the backend's
    sessions as they were; then two requests prefill in a batch (a graph replay) and decode,
    and every output and every tier is the eager server's, bit for bit."""
    if kernel:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    eager, graphed = harness(kernel), harness(kernel)
    before, avail = pool_state(graphed), graphed.sim.alloc.available_size()
    for n in (64, 16):
        outs = capture(graphed, n)
        assert all(o.shape == (n, graphed.hq * graphed.sim.d) and not o.any() for o in outs)
    assert all(same(x, y) for x, y in zip(before, pool_state(graphed), strict=True))
    assert graphed.sim.alloc.available_size() == avail and not graphed.backend.sessions
    prompts = {"a": [(3 * j) % 97 + 1 for j in range(70)],
               "b": [(5 * j) % 97 + 1 for j in range(41)]}  # fmt: skip
    pool, prepare, prepared = graphed.sim.pool, graphed.sim.pool.prepare_write, []
    monkeypatch.setattr(pool, "prepare_write", lambda *a, **k: prepared.append(prepare(*a, **k)))
    runs = {}
    for name, h in (("eager", eager), ("graphed", graphed)):
        reqs = [h.start(rid, p) for rid, p in prompts.items()]
        outs = [h.step(reqs, list(prompts.values()), extend=True, graph_copy=name == "graphed")]
        if name == "graphed":  # the rows prepared at the metadata serve every layer's write
            assert len(prepared) == 1
        for t in range(4):  # KERNEL_POLICY routes after the prefill and every 3 steps
            outs.append(h.step(reqs, [[60 + t], [70 + t]], extend=False))
        tiers = [h.backend.sessions[r].store.tiers(li) for r in prompts for li in range(h.sim.L)]
        runs[name] = outs, tiers
    (eo, et), (go, gt) = runs["eager"], runs["graphed"]
    for x, y in zip(eo, go, strict=True):
        for a, b in zip(x, y, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(et, gt, strict=True))
    assert graphed.backend.stats()["routes"] == eager.backend.stats()["routes"] > 2
