"""Physical representations of one (layer, KV head, window) and the states a holder reads them in.

A window of the SGLang pool can exist physically as:

- ``FULL``: the original rows, as the model wrote them;
- ``Q``: the ledger copy at the policy's quantized tier (packed codes, fp16 scale and lo);
- ``R``: rows restored from ``Q`` (``dequantize(Q)``): what a promotion gives back. It is not
  ``FULL``: a request that demoted and promoted a window reads ``dequantize(Q)`` even if another
  reader still holds the original rows, so its output does not depend on other requests.

A *holder* (the window's owner, i.e. the request that allocated its slots or the radix tree after
insertion, or a request that borrowed it from the tree) reads each window in one *state*; a state
holds a set of representations, each of which carries one reference per holder. This module is
the pure state algebra; :mod:`.pool` stores the blocks and counts the references.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tiered_radix.engine.routing import TierSet
from tiered_radix.policy.model import Policy, Quantize


class PoolConfigError(ValueError):
    """The policy asks for a layout the tiered SGLang pool cannot store yet."""


# Representation kinds (indices into the pool's per-kind tables).
FULL, Q, R = 0, 1, 2
# Holder states. ``S_A`` (archived, ``evict(archive=...)``): an owner that evicted the window
# keeps its ledger copy, reading nothing; a request that later borrows it reads it quantized.
S_FULL, S_Q, S_R, S_EVICT, S_A = 0, 1, 2, 3, 4
STATE_REPS: dict[int, tuple[int, ...]] = {
    S_FULL: (FULL,), S_Q: (Q,), S_R: (R,), S_EVICT: (), S_A: (Q,)
}  # fmt: skip
STATE_NAMES = ("full", "quantized", "restored", "evicted", "archived")
STATES = tuple(range(len(STATE_NAMES)))


def reads(state: Tensor) -> Tensor:
    """bool: where a holder in ``state`` attends to the window (not evicted, not archived)."""
    return (state != S_EVICT) & (state != S_A)


def lent(state: Tensor) -> Tensor:
    """The state a borrower takes of a window its owner holds in ``state``: an archived
    window is lent quantized (its copy), every other as held."""
    return torch.where(state == S_A, S_Q, state)


@dataclass(frozen=True)
class Layout:
    """What the pool needs from a policy: window size, the quantized tier, the ledger mode."""

    window: int
    quant: Quantize | None  # the one quantized tier, if any
    write_once: bool
    engine_tiers: tuple[str, ...]  # engine tier names (index 0 is full precision)
    quant_index: int | None  # engine index of the quantized tier
    evict_index: int | None
    v_group: int  # V values per quantization group (along d); K's group is the window
    # a decoupled (RDKV) policy's width per engine tier: its windows are full rows until a
    # request's routing repacks it into Zone A pages (.zones); None for coupled policies
    tier_bits: tuple[int, ...] | None = None
    archive: bool = False  # evict(archive=<the quantized tier>): owners archive (S_A)

    @classmethod
    def of(cls, policy: Policy) -> Layout:
        if not policy.coupled:
            return cls._decoupled(policy)
        if policy.v.kind == "channel":
            raise PoolConfigError("channel units need separate K and V units; not supported")
        tiers = TierSet.of(policy)
        if len(tiers.quantized) > 1:
            raise PoolConfigError(
                f"policy '{policy.name}' has {len(tiers.quantized)} quantized tiers; the tiered "
                "SGLang pool keeps one ledger copy per window (use one quantize(...) tier)"
            )
        qi = tiers.first_quantized
        quant = tiers.tiers[qi].action if qi is not None else None
        window = policy.v.size if policy.v.kind == "window" else 1
        v_group = 0
        if quant is not None:
            if quant.axis != "kivi" or quant.group < window:
                raise PoolConfigError(
                    f"policy '{policy.name}': the tiered SGLang pool stores ledger copies as "
                    "decode-kernel pages (K per channel over the whole window, V per token): use "
                    f"quantize(bits={quant.bits}, group>={window}, axis=kivi) (got "
                    f"group={quant.group}, axis={quant.axis})"
                )
            v_group = quant.group
        return cls(
            window, quant, policy.ledger.write_once, tiers.names, qi, tiers.evict, v_group,
            archive=tiers.archive is not None,
        )  # fmt: skip

    @classmethod
    def _decoupled(cls, policy: Policy) -> Layout:
        """RDKV (``units: {k: channel, v: token}``): windows of ``allocate.group`` tokens (a
        Zone A page, the K quantization group), V groups of as many values along ``d``."""
        if policy.k.kind != "channel" or policy.v.kind != "token":
            raise PoolConfigError(
                f"policy '{policy.name}' uses separate K and V units ({policy.k}, {policy.v}); "
                "the tiered SGLang pool stores them as RDKV's `units: {k: channel, v: token}`"
            )
        tiers, a = TierSet.of(policy), policy.allocate
        bits = (0,) * tiers.offset + tuple(a.bits)
        return cls(a.group, None, False, tiers.names, None, tiers.evict, a.group, bits)

    def reps(self, state: int) -> tuple[int, ...]:
        """Representations a holder in ``state`` keeps (write-once: ``R`` keeps its ``Q``)."""
        if state == S_R and self.write_once:
            return (R, Q)
        return STATE_REPS[state]

    def state_tiers(self) -> tuple[int, ...]:
        """The engine tier of a unit held in each state (:data:`STATES`; restored rows are
        full, an archived unit is evicted; 0 for a state this layout never produces)."""
        ev = self.evict_index if self.evict_index is not None else 0
        return (0, self.quant_index or 0, 0, ev, ev)

    def next_state(self, state: int, engine_tier: int, owner: bool = True) -> int:
        """The holder's state after the engine moves its unit to ``engine_tier``. Under an
        archive an owner evicts into ``S_A`` (a borrower's copy is the owner's to keep)."""
        if state == S_EVICT:
            return S_EVICT  # evicted data is gone: it stays evicted
        if engine_tier == self.evict_index:
            return S_A if self.archive and owner else S_EVICT
        if engine_tier == self.quant_index:
            return S_Q
        assert engine_tier == 0, f"unknown engine tier {engine_tier}"
        return S_FULL if state == S_FULL else S_R
