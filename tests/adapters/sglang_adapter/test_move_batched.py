"""The pool's batched move (device free stacks, every layer at once, no host sync) decides what
the previous per-layer move decided: on random pools and random holder transitions, some of
them short of blocks, the states reached, every table (blocks, references, owners), the rows and
ledger pages, and the free lists (their order included) equal those of the previous algorithm,
kept here as the reference (Python free lists, per-layer counts read by the host)."""

from __future__ import annotations

import pytest
import torch
from sglang_sim import POLICY, POOL_KERNELS, Sim, require

require("sglang.srt.mem_cache.memory_pool")

from tiered_radix.adapters.sglang import pool as pool_module  # noqa: E402
from tiered_radix.adapters.sglang.reps import FULL, S_EVICT, S_FULL, S_Q, S_R, Q, R  # noqa: E402
from tiered_radix.adapters.sglang.sizing import PoolBlocks  # noqa: E402
from tiered_radix.formats.layout import pack_uniform_pages  # noqa: E402


class Reference:
    """The previous ``TieredKVPool.move``/``release`` over a pool's tensors, with Python free
    lists (taken from the pool's stacks when built) and host counters."""

    def __init__(self, pool) -> None:
        self.p = pool
        self.rows = [pool.row_stacks.ids[li, :n].tolist() for li, n in
                     enumerate(pool.row_stacks.counts())]  # fmt: skip
        self.q = [pool.q_stacks.ids[li, :n].tolist() for li, n in
                  enumerate(pool.q_stacks.counts())]  # fmt: skip
        self.restored, self.degraded = pool.tally.host()

    def take(self, free, counts: dict[int, int]) -> torch.Tensor:
        return torch.tensor([free[li].pop() for li, n in counts.items() for _ in range(n)])

    def release(self, ly, h, w, state) -> None:
        p = self.p
        idx, hold = p._per_kind(ly, h, w, state)
        p.ref_all.index_put_(idx, -hold.int(), accumulate=True)
        ref = p.ref_all[idx]
        gone = (hold & (ref == 0)).flatten().nonzero().squeeze(1)
        if not gone.numel():
            return
        lyg, kind, hh, ww = (x.flatten()[gone] for x in idx)
        b = p.block_all[lyg, kind, hh, ww].long()
        p.block_all[lyg, kind, hh, ww] = 0
        row = torch.where(kind == Q, 0, b)
        p.rows_k_all[lyg, row] = torch.nan
        p.rows_v_all[lyg, row] = torch.nan
        for li_, k_, b_ in zip(*torch.stack([lyg, kind, b]).tolist(), strict=True):
            (self.q if k_ == Q else self.rows)[li_].append(b_)
            self.restored -= k_ == R

    def move(self, ly, h, w, old, new):
        p = self.p
        old, new = old.long(), new.long()
        for kind in (Q, R):
            need = p._holds[new, kind] & (p.block_all[ly, kind, h, w] == 0)
            per_layer = torch.bincount(ly[need], minlength=p.layer_num).tolist()
            free = self.q if kind == Q else self.rows
            if any(n > len(f) for n, f in zip(per_layer, free, strict=True)):
                need, new = self.degrade(kind, need, ly, old, new, [len(f) for f in free])
                per_layer = [min(n, len(f)) for n, f in zip(per_layer, free, strict=True)]
            if any(per_layer):
                i = need.nonzero().squeeze(1)
                i = i[torch.sort(ly[i], stable=True).indices]
                self.make(kind, ly[i], h[i], w[i], old[i], per_layer)
        p.acquire(ly, h, w, new)
        self.release(ly, h, w, old)
        return new

    def degrade(self, kind, need, ly, old, new, free):
        i = need.nonzero().squeeze(1)
        i = i[torch.sort(ly[i], stable=True).indices]
        layer = ly[i]
        first = torch.searchsorted(layer, layer, right=False)
        cap = torch.tensor(free)[layer]
        over = i[(torch.arange(i.numel()) - first) >= cap]
        new = new.clone()
        new[over] = S_EVICT if kind == Q else old[over]
        need = need.clone()
        need[over] = False
        self.degraded += int(over.numel())
        return need, new

    def make(self, kind, ly, h, w, src, per_layer) -> None:
        p = self.p
        counts = {li: n for li, n in enumerate(per_layer) if n}
        if kind == Q:
            k, v = p._rows_of(ly, h, w, src)
            b = self.take(self.q, counts)
            p.pages_all[ly, b] = pack_uniform_pages(k, v, p.layout.quant.bits, p.v_group)
        else:
            b = self.take(self.rows, counts)
            self.restored += b.numel()
            k, v = p._unpage(ly, p.block_all[ly, Q, h, w])
            p.rows_k_all[ly, b] = k.to(p.dtype)
            p.rows_v_all[ly, b] = v.to(p.dtype)
        p.block_all[ly, kind, h, w] = b.to(p.block_all.dtype)


NEXT = {S_FULL: (S_FULL, S_Q, S_EVICT), S_Q: (S_Q, S_R, S_EVICT), S_R: (S_R, S_Q, S_EVICT),
        S_EVICT: (S_EVICT,)}  # fmt: skip


def pools(seed: int, quant: int, kernels: bool = False):
    """Two equal pools (same writes), every window of 3 requests opened in every layer; the
    first keeps its tables with the move kernels where ``kernels``."""
    out = []
    for k in (kernels, False):
        sim = Sim(layers=3, blocks=PoolBlocks(full=70, quant=quant), kernels=k)
        g = torch.Generator().manual_seed(seed)
        for r in range(3):
            sim.start(f"r{r}", torch.randint(1, 99, (21,), generator=g).tolist())
        out.append(sim.pool)
    return out


def random_move(pool, g: torch.Generator):
    """Unique (layer, head, window) pairs of opened windows, their owner states and next
    states along the holders' state machine."""
    L, H, NW = pool.owner_all.shape
    open_ = (pool.owner_all >= 0).flatten().nonzero().squeeze(1)
    pick = open_[torch.randperm(open_.numel(), generator=g)[: int(0.6 * open_.numel())]]
    ly, h, w = pick // (H * NW), pick // NW % H, pick % NW
    old = pool.owner_all[ly, h, w].long()
    new = torch.tensor([NEXT[s][int(torch.randint(len(NEXT[s]), (1,), generator=g))]
                        for s in old.tolist()])  # fmt: skip
    return ly, h, w, old, new


def free_ids(stacks) -> list[list[int]]:
    """Each layer's free block ids, bottom of the stack first."""
    return [stacks.ids[li, :n].tolist() for li, n in enumerate(stacks.counts())]


def same_stacks(a, b) -> None:
    """Pools ``a`` and ``b`` hold the same free stacks (order included) and counters."""
    for kind in ("row_stacks", "q_stacks"):
        assert free_ids(getattr(a, kind)) == free_ids(getattr(b, kind)), kind
    assert a.tally.host() == b.tally.host()


def same(a, b) -> None:
    for name in ("block_all", "ref_all", "owner_all", "pages_all"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None and y is None) or torch.equal(x, y), name  # no pages: no ledger
    for name in ("rows_k_all", "rows_v_all"):
        x, y = getattr(a, name), getattr(b, name)
        assert torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num())


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("quant", [200, 9])  # plenty of ledger blocks, and short of them
@pytest.mark.parametrize("slice_pairs", [None, 3])  # made at once, or 3 pairs a slice
@pytest.mark.parametrize("kernels", POOL_KERNELS, ids=["torch", "kernels"][: len(POOL_KERNELS)])
def test_batched_move_equals_the_per_layer_move(seed: int, quant: int, slice_pairs, kernels,
                                                monkeypatch):  # fmt: skip
    new_pool, old_pool = pools(seed, quant, kernels)
    if slice_pairs:  # the bound on a make's float32 K/V bytes, down to 3 pairs' worth
        pair_bytes = 2 * 4 * new_pool.layout.window * new_pool.head_dim
        monkeypatch.setattr(pool_module, "_MAKE_BYTES", slice_pairs * pair_bytes)
    ref = Reference(old_pool)
    g = torch.Generator().manual_seed(100 + seed)
    for _ in range(4):
        ly, h, w, old, new = random_move(new_pool, g)
        got = new_pool.move(ly, h, w, old, new)
        want = ref.move(ly, h, w, old, new)
        assert torch.equal(got, want)
        for p, s in ((new_pool, got), (old_pool, want)):
            p.owner_all[ly, h, w] = s.to(torch.int8)
        same(new_pool, old_pool)
        assert free_ids(new_pool.row_stacks) == ref.rows
        assert free_ids(new_pool.q_stacks) == ref.q
        assert new_pool.tally.host() == [ref.restored, ref.degraded]
    if quant == 9:
        assert ref.degraded > 0  # the short case was exercised
    assert new_pool.blocks_in_use()[FULL] >= 0


# the tiny qevict without its quantized tier: one representation kind (FULL) in the tables
EVICT_ONLY = (
    POLICY.replace("  int2: quantize(bits=2, group=4)\n", "")
    .replace("full: 50%, int2: 50%", "full: 50%")
    .replace("ledger: write_once\n", "")
)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("policy", ["qevict", "evict-only"])
def test_move_kernels_release_like_the_pytorch_pool(seed: int, policy: str):
    """Moves, then releases of the holders (a request's windows going back), through the move
    kernels and through PyTorch: the same tables, rows, free stacks and counters; an
    eviction-only layout (one representation kind) included."""
    if True not in POOL_KERNELS:
        pytest.skip("CPU tables on a CUDA machine: test_move_kernels_on_the_device runs there")
    kw = {} if policy == "qevict" else {"policy": EVICT_ONLY}
    sims = [Sim(layers=3, blocks=PoolBlocks(full=70, quant=20), kernels=k, **kw)
            for k in (True, False)]  # fmt: skip
    for sim in sims:
        g = torch.Generator().manual_seed(seed)
        for r in range(3):
            sim.start(f"r{r}", torch.randint(1, 99, (21,), generator=g).tolist())
    fast, twin = (s.pool for s in sims)
    assert (fast.pages_all is None) == (policy == "evict-only")  # no ledger without int2
    g = torch.Generator().manual_seed(10 + seed)
    for _ in range(3):
        ly, h, w, old, new = random_move(fast, g)
        if policy != "qevict":
            new = torch.where(new == S_EVICT, S_EVICT, old)  # FULL or evicted only
        got = [p.move(ly, h, w, old, new) for p in (fast, twin)]
        assert torch.equal(*got)
        for p in (fast, twin):
            p.owner_all[ly, h, w] = got[0].to(torch.int8)
    ly, h, w, *_ = random_move(fast, g)
    state = fast.owner_all[ly, h, w].long()
    for p in (fast, twin):
        p.release(ly, h, w, state)
        p.owner_all[ly, h, w] = -1
    same(fast, twin)
    same_stacks(fast, twin)
    assert fast.bytes_used() == twin.bytes_used()


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def device_pools(seed: int, quant: int) -> list:
    """Pools on :data:`DEVICE` (CUDA where there is one: the kernels compiled; else the
    interpreter), with and without the move kernels: windows 1-15 opened and written alike."""
    from tiered_radix.adapters.sglang.pool import TieredKVPool
    from tiered_radix.policy import compile_text

    policy, out = compile_text(POLICY), []
    W, H, d, L, size = 4, 2, 8, 3, 64 * 4
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, 15 * W, H, d, generator=g).to(DEVICE, torch.bfloat16)
    v = torch.randn(L, 15 * W, H, d, generator=g).to(DEVICE, torch.bfloat16)
    for kernels in (True, False):
        pool = TieredKVPool(size, W, torch.bfloat16, H, d, L, DEVICE, policy=policy,
                            blocks=PoolBlocks(full=70, quant=quant), kernels=kernels)  # fmt: skip
        pool.open_windows(torch.arange(1, 16, device=DEVICE))
        loc = torch.arange(W, 16 * W, device=DEVICE)
        for li in range(L):
            pool.set_kv_buffer(None, loc, k[li], v[li], layer_id_override=li)
        out.append(pool)
    return out


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("quant", [200, 9])
def test_move_kernels_on_the_device(seed: int, quant: int):
    """The move kernels where the server runs them (CUDA; the interpreter on a CPU machine):
    the same states, tables, rows, pages, stacks and counters as the PyTorch pool."""
    fast, twin = device_pools(seed, quant)
    g = torch.Generator().manual_seed(20 + seed)
    for _ in range(4):
        ly, h, w, old, new = (t.to(DEVICE) for t in random_move(fast, g))
        got = [p.move(ly, h, w, old, new) for p in (fast, twin)]
        assert torch.equal(*got)
        for p in (fast, twin):
            p.owner_all[ly, h, w] = got[0].to(torch.int8)
    same(fast, twin)
    same_stacks(fast, twin)
    if quant == 9:
        assert twin.tally.host()[1] > 0  # some moves were short of ledger blocks
