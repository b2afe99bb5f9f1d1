"""What a policy file compiles to: frozen dataclasses the tier engine executes.

Nothing here knows a policy's name: ``qevict.yaml`` and ``rdkv.yaml`` are two values of
:class:`Policy`, and the engine runs whatever the fields say.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .errors import Span
from .expr import Expr

# ---- budget and its spread ----------------------------------------------------------------


@dataclass(frozen=True)
class Budget:
    """``10%`` of the full-precision KV bytes, an absolute byte count, or a token count."""

    kind: Literal["fraction", "bytes", "tokens"]
    value: float

    def __str__(self) -> str:
        if self.kind == "fraction":
            return f"{self.value * 100:g}% of the full-precision KV bytes"
        if self.kind == "bytes":
            return f"{self.value:,.0f} bytes"
        return f"the bytes of {self.value:,.0f} full-precision tokens"


@dataclass(frozen=True)
class Spread:
    """How the budget is divided over layers and KV heads."""

    kind: Literal["uniform", "pyramid", "proportional"]
    ratio: float = 1.0  # pyramid: first layer's share over the last layer's
    by: Expr | None = None  # proportional: the score whose per-(layer, head) total sets the share


# ---- units ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Granularity:
    """One unit of the cache: a window of ``size`` tokens, one token, or one K channel."""

    kind: Literal["window", "token", "channel"]
    size: int = 1

    def __str__(self) -> str:
        return f"window of {self.size} tokens" if self.kind == "window" else f"one {self.kind}"


@dataclass(frozen=True)
class Protect:
    """Regions that always stay at full precision."""

    sinks: int = 0  # the first N tokens (attention sinks)
    recent: int = 0  # the last N tokens


# ---- actions and tiers ------------------------------------------------------------------


@dataclass(frozen=True)
class Keep:
    dtype: Literal["bf16", "fp16"] = "bf16"


@dataclass(frozen=True)
class Quantize:
    """Asymmetric group-wise integer codes. ``axis="kivi"``: K per channel, V per token."""

    bits: int
    group: int = 32
    axis: Literal["kivi", "token", "channel"] = "kivi"
    symmetric: bool = False


@dataclass(frozen=True)
class Evict:
    """Drop a unit from the attention of the request that evicts it. ``archive``: a quantized
    tier whose copy of the unit is kept for later turns instead of freed: not read by this
    request, but a later request over the same prefix (the next turn of a chat) starts with the
    unit at that tier. None: the unit is gone for good."""

    archive: str | None = None


@dataclass(frozen=True)
class Promote:
    """Rule action: force a unit to the best tier (restoring it from the ledger if needed)."""


@dataclass(frozen=True)
class Demote:
    """Rule action: never hold this unit above the first quantized tier."""


Action = Keep | Quantize | Evict | Promote | Demote


@dataclass(frozen=True)
class Tier:
    name: str
    action: Keep | Quantize | Evict


@dataclass(frozen=True)
class Rule:
    """``when`` a unit's condition holds, ``then`` apply an action before allocation."""

    when: Expr
    then: Action
    span: Span | None = field(default=None, compare=False, repr=False)


# ---- allocation -------------------------------------------------------------------------


@dataclass(frozen=True)
class RankAllocation:
    """Highest ``by`` to the best tier, next to the next tier, each within its budget share.
    ``by_tier`` (``by:`` a mapping): each non-evicting tier fills from its own ranking, best
    tier first (``by`` is then the best tier's); empty: ``by`` ranks for every tier."""

    by: Expr
    shares: tuple[float, ...]  # per non-evicting tier, best first; fractions of the budget
    hysteresis: float = 0.0  # a unit's current tier holds while its score is within this margin
    by_tier: tuple[Expr, ...] = ()

    def rankings(self) -> tuple[Expr, ...]:
        """The ranking of each non-evicting tier, best first; one for all of them without
        ``by_tier``."""
        return self.by_tier or (self.by,)

    def exprs(self) -> tuple[Expr, ...]:
        """The expressions the allocation evaluates: its rankings."""
        return self.rankings()


@dataclass(frozen=True)
class RateDistortion:
    """Minimise sum w_u sigma_u 2^-b_u s.t. bytes <= budget, b_u in ``bits`` (RDKV).

    V units are allocated first over ``v_share`` of the budget, then K units over the V units
    kept (b > 0) with the rest.
    """

    bits: tuple[int, ...]
    v_weight: Expr
    k_weight: Expr
    sigma: Expr
    v_share: float = 0.5
    group: int = 32

    def exprs(self) -> tuple[Expr, ...]:
        """The expressions the allocation evaluates: the weights and sigma."""
        return (self.v_weight, self.k_weight, self.sigma)


@dataclass(frozen=True)
class Schedule:
    after_prefill: bool = True
    # ``after_prefill(defer=true)``: the routing due after a prefill chunk waits for the next
    # decode step, so it runs once after the whole prompt (however it was chunked), with the
    # prompt's question read; until then the chunks stay at full precision
    prefill_defers: bool = False
    every: int | None = None  # decode steps between routing steps
    on_pressure: float | None = None  # route when bytes reach this fraction of the budget


@dataclass(frozen=True)
class Ledger:
    """``write_once``: a unit is quantized at its first demotion and that copy is reused forever."""

    write_once: bool = False


@dataclass(frozen=True)
class Policy:
    name: str
    description: str
    source: str
    budget: Budget
    spread: Spread
    k: Granularity
    v: Granularity
    protect: Protect
    scores: tuple[tuple[str, Expr], ...]
    tiers: tuple[Tier, ...]  # best first; an Evict tier, if any, is last
    rules: tuple[Rule, ...]
    allocate: RankAllocation | RateDistortion
    schedule: Schedule
    ledger: Ledger

    def score(self, name: str) -> Expr:
        return dict(self.scores)[name]

    def expressions(self) -> tuple[Expr, ...]:
        """Every expression the policy evaluates: its scores, rule conditions, the spread's
        weight and the allocation's."""
        spread = () if self.spread.by is None else (self.spread.by,)
        scores = tuple(e for _, e in self.scores)
        return scores + tuple(r.when for r in self.rules) + spread + self.allocate.exprs()

    @property
    def coupled(self) -> bool:
        """True when K and V share units, so one decision moves both."""
        return self.k == self.v
