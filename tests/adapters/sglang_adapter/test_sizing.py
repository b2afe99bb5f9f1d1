"""Pool sizing counts every byte (issue 21, failure 1): for every shipped policy, the slots
SGLang gets from the plugin's cell size fit rows + codes + metadata in the bytes it set aside,
and the pool built on the CPU allocates exactly what :func:`~.sizing.pool_bytes` predicts."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from sglang_sim import require

require("sglang.srt.mem_cache.memory_pool")

from tiered_radix.adapters.sglang import plugin, sizing  # noqa: E402
from tiered_radix.adapters.sglang.pool import TieredKVPool  # noqa: E402
from tiered_radix.adapters.sglang.reps import Layout, PoolConfigError  # noqa: E402
from tiered_radix.engine.store import TierStore  # noqa: E402
from tiered_radix.policy import compile_text, load_policy  # noqa: E402
from tiered_radix.policy.model import Budget  # noqa: E402

POLICIES = sorted(p.stem for p in (Path(__file__).parents[3] / "policies").glob("*.yaml"))
GIB = 1 << 30
H200 = 139 * GIB
# (layers, KV heads, head dim, bytes an element, weight bytes): Qwen2.5-0.5B, SmolLM2-135M
MODELS = {"qwen2.5-0.5b": (24, 2, 64, 2, 0.99 * GIB), "smollm2-135m": (30, 3, 64, 2, 0.27 * GIB)}


def kvc(heads: int, dtype=torch.bfloat16):
    return SimpleNamespace(
        kv_cache_dtype=dtype, model_config=SimpleNamespace(get_num_kv_heads=lambda tp: heads)
    )


def slots(policy_name: str, available: int, L: int, H: int, d: int, itemsize: int, mp) -> int:
    """SGLang's pool size: ``available // cell`` with the plugin's cell-size hook, page-aligned."""
    mp.setattr(plugin, "attn_tp_size", lambda: 1)
    policy = load_policy(policy_name)
    current = SimpleNamespace(policy=policy, budget=policy.budget)
    mp.setattr(plugin.config, "current", lambda: current)
    dtype = {2: torch.bfloat16, 1: torch.float8_e4m3fn}[itemsize]
    cell = plugin.cell_size(2 * L * H * d * itemsize, None, kvc(H, dtype), L)
    W = Layout.of(policy).window
    return available // cell // W * W


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_fits_the_bytes_sglang_set_aside(policy, model, monkeypatch):
    """On an H200 at mem_fraction_static 0.3-0.9 and contexts 4K-128K (SGLang's request table,
    ``max_running_requests x context`` int32, comes off first): the slots fit rows, codes and
    metadata; fraction budgets hold more tokens than SGLang's own pool, 100% nearly as many;
    a decoupled policy (rows for a share of its slots, and its Zone A share) more, by
    ``1 / (DECOUPLED_ROW_SHARE + ZONE_SLACK * f)`` less its engine state; and the
    rows hold what the scheduler never lets go (``check_rows``: the launch is not refused)."""
    L, H, d, isz, weights = MODELS[model]
    p = load_policy(policy)
    for frac in (0.3, 0.5, 0.7, 0.9):
        for context in (4096, 32768, 131072):
            available = int(frac * H200 - weights - 4096 * context * 4)
            n = slots(policy, available, L, H, d, isz, monkeypatch)
            split = sizing.pool_bytes(n, H, d, L, isz, p, p.budget)
            assert split.total <= available, (frac, context, split)
            sizing.check_rows(sizing.plan_blocks(n, H, d, isz, p, p.budget), H, p)
            stock = available // (2 * L * H * d * isz)
            f = p.budget.value if p.budget.kind == "fraction" else 1.0
            assert n > context
            if not p.coupled:
                data = sizing.DECOUPLED_ROW_SHARE + sizing.ZONE_SLACK * f
                assert n > stock and 0.7 * stock / data < n < stock / data, (n, stock)
            else:
                assert n > stock if f < 1 else n > 0.8 * stock, (n, stock)
            assert split.total > 0.9 * available  # the cell is not padded either


@pytest.mark.parametrize("policy", POLICIES)
def test_the_built_pool_allocates_what_the_sizing_says(policy, monkeypatch):
    """A pool built on the CPU from the hook's slots (2 layers, 2 KV heads, d 64, 8 MiB set
    aside): its tensors' bytes are exactly rows + codes + tables of :func:`pool_bytes`, and
    those with the engine's share fit the 8 MiB."""
    L, H, d, available = 2, 2, 64, 8 << 20
    n = slots(policy, available, L, H, d, 2, monkeypatch)
    p = load_policy(policy)
    W = Layout.of(p).window
    pool = TieredKVPool(n, W, torch.bfloat16, H, d, L, "cpu", policy=p)
    tensors = [pool.rows_k_all, pool.rows_v_all, pool.block_all, pool.ref_all, pool.owner_all]
    tensors += [pool.pages_all] if pool.pages_all is not None else []
    tensors += [pool.zones.bytes_all] if pool.zones is not None else []  # decoupled: Zone A
    built = sum(t.nbytes for t in tensors)
    split = sizing.pool_bytes(n, H, d, L, 2, p, p.budget)
    assert built + split.engine <= available
    assert built == split.rows + split.codes + split.tables
    assert sum(pool.get_kv_size_bytes()) == split.rows + split.codes


def test_a_decoupled_pool_keeps_a_share_of_the_slots_rows_and_the_zone_share(monkeypatch):
    """RDKV: row blocks for ``DECOUPLED_ROW_SHARE`` of the slots' (layer, head, window)s, and a
    Zone A store of ``ZONE_SLACK`` times the budget's bytes a layer."""
    p, L, H, d, available = load_policy("rdkv"), 2, 2, 64, 8 << 20
    n = slots("rdkv", available, L, H, d, 2, monkeypatch)
    W = Layout.of(p).window
    pool = TieredKVPool(n, W, torch.bfloat16, H, d, L, "cpu", policy=p)
    rows = int(sizing.DECOUPLED_ROW_SHARE * n) // W
    assert pool.blocks.full == rows * H and pool.windows_free() == rows
    share = sizing.ZONE_SLACK * 0.1 * n * H * d * 2 * 2
    fixed = 2 * 2 * W * d * 2 + H * sizing.window_table_bytes(pool.layout)  # traps, window 0
    assert pool.zones.bytes_all.shape == (L, pytest.approx(share - fixed, abs=16))


@pytest.mark.parametrize("T", [3, 200, 1100])
@pytest.mark.parametrize("policy", ["qevict", "snapkv", "h2o", "streaming", "kivi", "rdkv"])
def test_the_engine_share_bounds_a_store_holding_every_slot(policy, T):
    """A request's tier engine (rows held elsewhere, as in the SGLang pool) after a prefill of
    ``T`` tokens and 40 decode steps with routing holds no more device bytes per (layer, head)
    than :func:`~.sizing.engine_bytes_per_token` counts for its tokens, plus
    :func:`~.sizing.engine_bytes_per_request`."""
    from tiered_radix.engine.signals import Signals, policy_reads

    p, L, H, d = load_policy(policy), 2, 2, 64
    rows = torch.randn(2, H, T + 40, d, generator=torch.Generator().manual_seed(1))

    def read(li: int):  # the pool's rows (a decoupled policy's plan reads K norms, spreads)
        t = store.n_tokens(li)
        return rows[0, :, :t], rows[1, :, :t], torch.ones(H, t, dtype=torch.bool)

    store = TierStore(p, n_layers=L, n_heads=H, head_dim=d, budget_override=p.budget,
                      reader=read)  # fmt: skip
    store.append_tokens(None, T)
    g = torch.Generator().manual_seed(0)
    for li in range(L):
        a = torch.rand(H, T, generator=g)
        extra = {n: a for n in ("colmass", "obs_attn") if n in policy_reads(p)}
        if "qnorm" in policy_reads(p):
            extra["qnorm"] = torch.rand(H, d, generator=g)
        store.observe(li, Signals(attn=a, **extra))  # as the backend asks attention for them
    store.after_prefill()
    for step in range(40):
        store.append_tokens(None, 1)
        store.observe_attn(torch.rand(L, H, T + step + 1, generator=g))
        if store.schedule_due(step):
            store.route(f"decode {step}")
    held = store.stack.tier.nbytes
    held += sum(s.present.nbytes + s.write_count.nbytes for s in store.stack.stores.values())
    held += sum(store.scores.held_bytes().values())
    if not p.coupled:  # the channel set (tiers per channel and counts do not grow)
        held += sum(store.channel_tiers(li)[1].nbytes for li in range(L))
    bound = sizing.engine_bytes_per_token(p) * L * H * (T + 40)
    bound += sizing.engine_bytes_per_request(p) * L * H  # a partial window, a memo's tail
    assert 0 < held <= bound


def test_a_policy_whose_metadata_eats_its_savings_is_refused(monkeypatch):
    """Token units with a quantized tier over fp8 heads of 16: the tables and engine state of a
    token cost more than the 90% its budget saves. Refused at launch, pointing to windows; the
    same policy over windows of 32 starts."""
    tokens = """
policy: tok
budget: 10%
units: {UNITS}
scores:
  s: cumulative(attn, decay=0.9)
tiers:
  full: keep(bf16)
  int2: quantize(bits=2, group=32, axis=kivi)
  evicted: evict
allocate: {method: rank, by: s, shares: {full: 50%, int2: 50%}}
schedule: after_prefill
"""
    p = compile_text(tokens.replace("{UNITS}", "token"))
    monkeypatch.setattr(plugin, "attn_tp_size", lambda: 1)
    current = SimpleNamespace(policy=p, budget=p.budget)
    monkeypatch.setattr(plugin.config, "current", lambda: current)
    with pytest.raises(PoolConfigError, match=r"no more tokens.*window\(size=32\)"):
        plugin.cell_size(2 * 24 * 2 * 16, None, kvc(2, torch.float8_e4m3fn), 24)
    w = compile_text(tokens.replace("{UNITS}", "window(size=32)"))
    sizing.check_metadata(w, Budget("fraction", 0.1), 24, 2, 16, 1)


@pytest.mark.parametrize("units", ["windows", "tokens"])
@pytest.mark.parametrize("side_output", [False, True])
def test_graph_buffers_are_what_buffer_bytes_says(side_output, units):
    """The decode graphs' fixed buffers (outside the pool: SGLang's CUDA-graph memory) are
    exactly :func:`~.graph.buffer_bytes`; token units with no quantized tier (h2o's shape)
    keep no page buffers but the dump entry, and their side output is
    :func:`~.graph.mass_bytes` of a unit a token."""
    from sglang_sim import Sim
    from test_backend import KERNEL_POLICY, TOKEN_POLICY

    from tiered_radix.adapters.sglang import graph

    if units == "windows":
        sim = Sim(policy=KERNEL_POLICY, head_dim=64, pages=30, blocks=sizing.PoolBlocks(64, 64))
    else:
        sim = Sim(policy=TOKEN_POLICY, head_dim=64, pages=400, blocks=sizing.PoolBlocks(1024, 8))
    paged = graph.lists_pages(sim.pool)
    assert paged == (units == "windows")
    g = graph.GraphDecode(sim.pool, 4, 1000, 300, side_output, 0.9 if side_output else None)
    held = sum(t.nbytes for t in vars(g).values() if isinstance(t, torch.Tensor))
    want = graph.buffer_bytes(sim.L, sim.H, 64, sim.W, 4, 1000, 300, side_output, paged)
    assert held == want
    n_max = graph.unit_count(sim.pool, 300)
    assert n_max == (300 if units == "tokens" else -(-300 // sim.W))
    assert (g.mass is None) != side_output
    assert not side_output or g.mass.nbytes == graph.mass_bytes(sim.L, sim.H, 4, n_max)
    if not paged:  # page lists of the dump entry alone
        assert g.page_off.shape == (sim.L, 1) and g.page_units.shape == (sim.L, 1, 1)


@pytest.mark.parametrize("policy", POLICIES)
def test_the_startup_log_prints_the_split_and_max_total_num_tokens(policy, monkeypatch, caplog):
    """Every shipped policy's pool logs, once built, its slots (SGLang's
    ``max_total_num_tokens``) and the byte split (rows, codes, metadata) of
    :func:`~.sizing.pool_bytes` for them."""
    L, H, d = 2, 2, 64
    n = slots(policy, 8 << 20, L, H, d, 2, monkeypatch)
    p = load_policy(policy)
    with caplog.at_level("INFO", logger="tiered_radix.adapters.sglang"):
        pool = TieredKVPool(n, Layout.of(p).window, torch.bfloat16, H, d, L, "cpu", policy=p)
    lines = [r.getMessage() for r in caplog.records if "tiered-radix pool" in r.getMessage()]
    assert len(lines) == 1, lines
    split = sizing.pool_bytes(n, H, d, L, 2, p, p.budget, pool.blocks)
    assert f"max_total_num_tokens={n}," in lines[0]
    assert lines[0].endswith(split.describe())
    assert all(w in lines[0] for w in ("rows", "codes", "metadata"))


@pytest.mark.parametrize(
    "window, suggested",
    [
        (1, "window(size=16) or window(size=32) or window(size=64) units, or a smaller"),
        (32, "use window(size=64) units, or a smaller"),
        (64, "tables per unit: use a smaller budget"),
    ],
)
def test_a_refused_policy_is_pointed_to_wider_windows_only(window, suggested):
    """At a 98% budget (2% saved) a policy's metadata outweighs the savings at any unit: the
    refusal names only windows wider than the policy's own."""
    units = "token" if window == 1 else f"window(size={window})"
    text = f"""
policy: wide
budget: 98%
units: {units}
scores:
  s: cumulative(attn, decay=0.9)
tiers:
  full: keep(bf16)
  int2: quantize(bits=2, group={max(32, window)}, axis=kivi)
  evicted: evict
allocate: {{method: rank, by: s, shares: {{full: 50%, int2: 50%}}}}
schedule: after_prefill
"""
    p = compile_text(text)
    with pytest.raises(PoolConfigError, match="no more tokens") as err:
        sizing.check_metadata(p, p.budget, 24, 2, 16, 1)
    assert suggested in str(err.value)
