"""``TieredCache``: a transformers ``Cache`` whose storage is a :class:`TierStore`.

How the model's conventions map onto the engine (tested with transformers 5.12.1 and torch 2.13
on CPU, Llama-architecture models: a random tiny Llama in the tests and SmolLM2-135M):

- GQA: the store holds the ``H = num_key_value_heads`` KV heads; :mod:`.attention` lets query
  head ``i`` read KV head ``i // (Hq // H)`` (``repeat_kv``'s order) and sums a group's
  probabilities into the ``attn`` signal of its KV head.
- RoPE: keys are cached post-RoPE, as ``DynamicCache`` caches them. Evicted tokens keep their
  slot, so ``get_seq_length()`` counts every token ever appended and new tokens get their true
  absolute positions; nothing is re-rotated.
- Mask and positions: batch 1 without padding (a batch raises). The attention function builds
  the causal mask itself (query row ``i`` of ``tq`` sits at position ``T - tq + i``) and masks
  evicted tokens per KV head; transformers builds no mask for a custom attention name, so an
  ``attention_mask`` argument (``generate`` passes all ones) is not read. Position ids are the
  model's default ``arange(t) + get_seq_length()``.
- dtype: the store keeps full rows in the model's dtype (float32 on CPU), so under the ``full``
  policy K/V are the model's own and logits match plain transformers to float32 rounding
  (attention sums in another order than sdpa). ``bytes_used`` counts full rows at 2 bytes per
  element (the policy's ``keep(bf16)`` tier) whatever the storage dtype. The byte figures are the
  engine's accounting: attention reads ``view()``, a float32 copy of the layer rebuilt per step,
  so host memory is not what this adapter saves (the SGLang path's kernels read codes directly).
- Signals per prefill chunk (a later chat turn is one): ``colmass``/``obs_attn`` cover the chunk's
  queries over every cached token and replace the previous chunk's; ``qnorm`` is the chunk's.
- Steps: a forward of several tokens (or the first forward) is a prefill chunk, one token a decode
  step. A step ends when the next forward reaches layer 0 or :meth:`TieredCache.finish_step` is
  called; then the store routes if the policy's schedule says so (``after_prefill`` after every
  prefill chunk, so after each chat turn's prompt; ``every(N)`` on a global decode-step count).
  ``model.generate(past_key_values=cache)`` therefore works too (greedy; no beam search or
  cropping: those raise).
- Models with sliding-window or linear-attention layers are refused (:class:`AdapterError`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from tiered_radix.engine.events import Transitions
from tiered_radix.engine.signals import PREFILL_SIGNALS, Signals, policy_reads
from tiered_radix.engine.store import TierStore
from tiered_radix.policy import Policy, load_policy
from tiered_radix.policy.errors import Span
from tiered_radix.policy.model import Budget
from tiered_radix.policy.transformer import parse

from .attention import AdapterError, hand_over


def parse_budget(text: str) -> Budget:
    """``"10%"``, ``"64 MiB"``, ``"2048 tokens"`` -> :class:`Budget` (raises ``PolicyError``)."""
    return parse(text.strip(), "budget", Span("--budget", 1, 1, text.strip()))


class TieredLayer(CacheLayerMixin):
    """One model layer's view of the shared store (what ``Cache.update`` dispatches to)."""

    is_sliding = False

    def __init__(self, cache: TieredCache, index: int) -> None:
        super().__init__()
        self.cache, self.index = cache, index
        self.kept: torch.Tensor | None = None

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """Append ``[1, H, t, d]`` keys/values; return the store's view ``[1, H, T, d]``."""
        if key_states.shape[0] != 1:
            raise AdapterError(f"the tiered cache runs batch 1, got {key_states.shape[0]}")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        store = self.cache.begin(self.index, key_states)
        store.append(self.index, key_states[0], value_states[0])
        k, v, self.kept = store.view(self.index)
        self.keys, self.values = k[None].to(key_states.dtype), v[None].to(value_states.dtype)
        hand_over(self)
        return self.keys, self.values

    def needs(self, tq: int) -> frozenset[str]:
        return self.cache.prefill_needs if self.cache.phase == "prefill" else frozenset()

    def observe(self, signals: Signals) -> None:
        self.cache.store.observe(self.index, signals)
        self.keys = self.values = None  # the view is rebuilt at the next update; don't hold it

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        store = self.cache.store
        return 0 if store is None else store.n_tokens(self.index)

    def get_max_cache_shape(self) -> int:
        return -1

    def _unsupported(self, *args, **kwargs):
        raise AdapterError("the tiered cache supports greedy/sampled decoding only (no beams/crop)")

    reorder_cache = crop = batch_repeat_interleave = batch_select_indices = _unsupported
    offload = prefetch = reset = _unsupported


class TieredCache(Cache):
    """A batch-1 transformers cache backed by one :class:`TierStore` for all layers.

    ``policy``: a :class:`Policy`, a shipped name or a path; ``config``: the model's config;
    ``budget`` replaces the policy's (``Budget`` or text such as ``"10%"``).

    Raises:
        AdapterError: a model with non-global attention layers.
        PolicyError: an unknown policy or a malformed budget.
    """

    def __init__(self, policy: Policy | str, config, *, budget: Budget | str | None = None):
        self.policy = load_policy(policy) if isinstance(policy, str) else policy
        self.budget = parse_budget(budget) if isinstance(budget, str) else budget
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
        if kinds != {"full_attention"}:
            raise AdapterError(
                f"{cfg.model_type}: layer types {sorted(kinds)}; the tiered cache handles "
                "global attention layers only (full_attention)"
            )
        self.n_layers = cfg.num_hidden_layers
        self.n_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.prefill_needs = frozenset(policy_reads(self.policy) & set(PREFILL_SIGNALS))
        self.store: TierStore | None = None
        self.phase: str | None = None  # "prefill" | "decode" while a forward is open
        self.decode_steps = self.prefills = 0
        super().__init__(layers=[TieredLayer(self, i) for i in range(self.n_layers)])

    def begin(self, layer: int, key_states: torch.Tensor) -> TierStore:
        """Called by each layer's ``update``; layer 0 closes the previous step, opens a new one."""
        if layer == 0:
            self.finish_step()
            if self.store is None:
                self.store = TierStore(
                    self.policy, n_layers=self.n_layers, n_heads=self.n_heads,
                    head_dim=self.head_dim, dtype=key_states.dtype, device=key_states.device,
                    budget_override=self.budget,
                )  # fmt: skip
            first = self.store.n_tokens(0) == 0
            self.phase = "prefill" if first or key_states.shape[2] > 1 else "decode"
        assert self.store is not None and self.phase is not None, "layer 0 runs first"
        return self.store

    def finish_step(self) -> Transitions | None:
        """Route if the open step's schedule says so (idempotent); returns the transitions."""
        phase, self.phase = self.phase, None
        if phase == "prefill":
            self.prefills += 1
            if self.policy.schedule.after_prefill:
                return self.store.after_prefill(f"after prefill {self.prefills}")
        elif phase == "decode":
            step, self.decode_steps = self.decode_steps, self.decode_steps + 1
            if self.store.schedule_due(step):
                return self.store.route(f"decode step {step}")
        return None

    def new_turn(self) -> int:
        """A later turn of the conversation begins: units the policy archived when it evicted
        them (``evict(archive=...)``) are recalled at their archive tier, so the turn's prompt
        attends to them and its routing ranks them (:meth:`TierStore.recall`). Returns the
        units recalled."""
        return 0 if self.store is None else self.store.recall()

    # -- accounting ------------------------------------------------------------------------
    def n_tokens(self) -> int:
        return 0 if self.store is None else self.store.n_tokens(0)

    def full_bytes(self) -> int:
        """Bytes of the same tokens' K and V at 2 bytes per element (bf16 full KV)."""
        return 2 * 2 * self.n_layers * self.n_heads * self.head_dim * self.n_tokens()

    def bytes_used(self) -> int:
        return 0 if self.store is None else self.store.bytes_used()

    def archived_bytes(self) -> int:
        """Archived copies of evicted units, kept for later turns outside the budget."""
        return 0 if self.store is None else self.store.archived_bytes()

    def budget_bytes(self) -> int:
        return 0 if self.store is None else self.store.budget_bytes()

    def occupancy(self) -> dict[str, int]:
        return {} if self.store is None else self.store.occupancy()
