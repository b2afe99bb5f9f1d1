"""A CPU stand-in for SGLang's scheduler around the real pool, allocator and radix cache.

A helper module (not a conftest) so its name cannot collide with tests/conftest.py.

Test modules import SGLang through ``require`` (skips when sglang is missing; fails instead when
``TIERED_RADIX_REQUIRE_SGLANG=1``, as CI sets it); nothing else here imports sglang until a fixture
runs. K/V are a deterministic function of (layer, token, position) so any two requests with the
same prefix write the same values and references are easy to build.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType, SimpleNamespace

import pytest
import torch

SKIP_REASON = (
    "sglang is not importable: install it with docs/sglang.md, 'Running the tests' "
    "(set TIERED_RADIX_REQUIRE_SGLANG=1 to fail instead of skipping)"
)


def require(module: str) -> ModuleType:
    """Import an SGLang module for a test module: skip without sglang, unless CI asks to fail."""
    if os.environ.get("TIERED_RADIX_REQUIRE_SGLANG") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=SKIP_REASON)


# The pool's bookkeeping paths a Sim (CPU tensors) can run: PyTorch, and the Triton kernels where
# they run under the interpreter (tests/conftest.py picks it on machines without CUDA; on a CUDA
# machine the kernels are tested on CUDA tensors instead).
POOL_KERNELS = (False, True) if os.environ.get("TRITON_INTERPRET") == "1" else (False,)

# qevict's shape at test size: windows of 4 tokens, INT2 in groups of 4, write-once ledger.
POLICY = """
policy: tiny-qevict
budget: 50%
units: window(size=4)
protect: {sinks: 0, recent: 4}
scores:
  score: cumulative(attn, decay=0.99)
tiers:
  full: keep(bf16)
  int2: quantize(bits=2, group=4)
  evicted: evict
allocate: {method: rank, by: score, shares: {full: 50%, int2: 50%}}
schedule: after_prefill
ledger: write_once
"""


class Sim:
    """Start, extend, finish and abort requests the way the scheduler drives the cache."""

    def __init__(
        self,
        *,
        layers=2,
        heads=2,
        head_dim=8,
        pages=40,
        blocks=None,
        vocab=100,
        policy=POLICY,
        context=512,
        kv_heads: slice | None = None,
        options=None,
        kv=None,
        requests: int = 16,  # request slots (ReqToTokenPool)
        kernels: bool | None = None,  # the pool's Triton bookkeeping (default: CUDA only)
    ):
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        from tiered_radix.adapters.sglang.pool import TieredKVPool
        from tiered_radix.adapters.sglang.radix import TieredRadixCache
        from tiered_radix.adapters.sglang.reps import Layout
        from tiered_radix.policy import compile_text

        self.policy = compile_text(policy)
        # kv_heads: a tensor-parallel rank's slice of the model's ``heads`` (the pool holds it)
        kv_heads = kv_heads or slice(0, heads)
        heads_total, heads = heads, kv_heads.stop - kv_heads.start
        self.W, self.L, self.H, self.d = Layout.of(self.policy).window, layers, heads, head_dim
        size = pages * self.W
        self.pool = TieredKVPool(
            size,
            self.W,
            torch.bfloat16,
            heads,
            head_dim,
            layers,
            "cpu",
            policy=self.policy,
            blocks=blocks,
            options=options,
            kernels=kernels,
        )
        self.alloc = PagedTokenToKVPoolAllocator(
            size, self.W, torch.bfloat16, "cpu", self.pool, need_sort=False
        )
        self.r2t = ReqToTokenPool(requests, context, "cpu", False)
        params = CacheInitParams(False, self.r2t, self.alloc, self.W)
        # kv: the launch's KVConfig (policies a request may name, default budget)
        self.cache = TieredRadixCache(params, policy=self.policy, kv=kv)
        g = torch.Generator().manual_seed(0)
        emb = torch.randn(2, layers, vocab, heads_total, head_dim, generator=g)
        pos = torch.randn(2, layers, context, heads_total, head_dim, generator=g)
        self.emb, self.pos = emb[..., kv_heads, :], pos[..., kv_heads, :]
        self.reqs: dict[str, SimpleNamespace] = {}

    def kv(self, layer: int, tokens: list[int], start: int = 0) -> tuple[torch.Tensor, ...]:
        """float32 ``k, v [n, H, d]`` of ``tokens`` at positions ``start...``."""
        t = torch.tensor(tokens)
        p = torch.arange(start, start + len(tokens))
        return tuple(self.emb[i, layer, t] + self.pos[i, layer, p] for i in (0, 1))

    def match(self, rid: str, tokens: list[int], custom_params: dict | None = None,
              max_prefix: int | None = None):  # fmt: skip
        """Match the prefix in the tree and lock it; the request's row maps the matched slots.
        ``custom_params``: the request's (``kv_budget``, ``kv_policy``), as SGLang's ``Req``
        carries them to the match; ``max_prefix``: match at most this many tokens (SGLang
        matches all but a prompt's last token, whose logits the prefill must compute)."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        asking = SimpleNamespace(
            rid=rid, sampling_params=SimpleNamespace(custom_params=custom_params)
        )
        key = RadixKey(list(tokens[:max_prefix]))
        m = self.cache.match_prefix(MatchPrefixParams(key=key, req=asking))
        n = len(m.device_indices)
        self.cache.inc_lock_ref(m.last_device_node)
        req = SimpleNamespace(
            rid=rid,
            origin_input_ids=list(tokens),
            output_ids=[],
            req_pool_idx=self.r2t.free_slots.pop(),
            cache_protected_len=n,
            last_node=m.last_device_node,
            extra_key=None,
            priority=0,
            prefix_indices=m.device_indices,
            prefix_len=n,
        )
        self.r2t.req_to_token[req.req_pool_idx, :n] = m.device_indices.int()
        return req

    def start(self, rid: str, tokens: list[int]) -> SimpleNamespace:
        """Match the prefix, borrow it, allocate and write the rest (a prefill)."""
        req = self.match(rid, tokens)
        self.cache.open_view(req, req.prefix_len)
        self.reqs[rid] = req
        self._write(req, tokens[req.prefix_len :], req.prefix_len)
        return req

    def extend(self, rid: str, tokens: list[int]) -> None:
        """Decode steps: append ``tokens`` as outputs."""
        req = self.reqs[rid]
        start = len(req.origin_input_ids) + len(req.output_ids)
        req.output_ids += list(tokens)
        self._write(req, tokens, start)

    def _write(self, req, tokens: list[int], start: int) -> None:
        if not tokens:
            return
        W, end = self.W, start + len(tokens)
        row = self.r2t.req_to_token[req.req_pool_idx]
        have = -(-start // W) * W  # slots up to here are allocated (page-aligned)
        if end > have:
            new = self.alloc.alloc(-(-(end - have) // W) * W)
            if new is None:
                raise MemoryError("allocator is out of pages")
            row[have : have + new.numel()] = new.int()
        loc = row[start:end].long()
        for li in range(self.L):
            k, v = self.kv(li, tokens, start)
            self.pool.set_kv_buffer(None, loc, k, v, layer_id_override=li)
        self.cache.sync_view(req, end)

    def finish(self, rid: str, insert: bool = True) -> None:
        req = self.reqs.pop(rid)
        n = len(req.origin_input_ids) + len(req.output_ids)
        self.cache.cache_finished_req(req, is_insert=insert, kv_len_to_handle=n)
        self.r2t.free_slots.append(req.req_pool_idx)

    def tokens(self, rid: str) -> list[int]:
        req = self.reqs[rid]
        return req.origin_input_ids + req.output_ids
