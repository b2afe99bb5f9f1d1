"""`tiered-radix policy explain`: a policy in plain language, with what its budget buys."""

from __future__ import annotations

from dataclasses import dataclass

from ..adapters.sglang import sizing
from ..adapters.sglang.reps import PoolConfigError
from ..formats.codecs import unit_nbytes
from ..policy import Policy
from ..policy.expr import Name, to_text
from ..policy.model import Evict, Keep, Quantize, RankAllocation, Tier
from ..policy.vocabulary import FUNCTIONS, SIGNALS


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    kv_heads: int
    head_dim: int

    @property
    def full_bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * tier_bytes_per_token(Keep(), self.head_dim)


LLAMA_8B = ModelShape("Llama-3.1-8B", 32, 8, 128)


def tier_bytes_per_token(action: Keep | Quantize | Evict, head_dim: int) -> float:
    """K + V bytes one token costs in one KV head at this tier (metadata amortised)."""
    if isinstance(action, Evict):
        return 0.0
    if isinstance(action, Keep):
        return 2 * unit_nbytes(head_dim, 16, head_dim)
    g = action.group
    k = unit_nbytes(head_dim * g, action.bits, g) / g  # K per channel: groups along g tokens
    v = unit_nbytes(head_dim, action.bits, min(g, head_dim))  # V per token: groups along d
    return k + v


def _kib(n: float) -> str:
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n:.0f} B"


def _tier_line(t: Tier, d: int) -> str:
    full = tier_bytes_per_token(Keep(), d)
    cost = tier_bytes_per_token(t.action, d)
    if isinstance(t.action, Keep):
        what = f"keep at full precision ({t.action.dtype})"
    elif isinstance(t.action, Quantize):
        axis = {
            "kivi": "K per channel, V per token",
            "token": "K and V per token",
            "channel": "K and V per channel",
        }[t.action.axis]
        what = f"quantize to {t.action.bits}-bit codes, groups of {t.action.group} ({axis})"
    elif t.action.archive is not None:
        what = f"evict; its {t.action.archive} copy kept for the next turn (in no budget)"
    else:
        what = "evict (never read again)"
    return f"  {t.name:<10} {what:<62} {cost:6.1f} B/token ({cost / full:.1%} of full)"


def steady_state_mix(policy: Policy, d: int) -> list[tuple[str, float]]:
    """Share of tokens in each tier when a rank policy's budget is fully used (no protection)."""
    alloc = policy.allocate
    if policy.budget.kind != "fraction" or not isinstance(alloc, RankAllocation):
        return []
    full, left, mix = tier_bytes_per_token(Keep(), d), 1.0, []
    spare = 0.0
    for tier, share in zip(policy.tiers, (*alloc.shares, 0.0), strict=False):
        if isinstance(tier.action, Evict):
            mix.append((tier.name, left))
            break
        money = (share + spare) * policy.budget.value * full
        take = min(left, money / tier_bytes_per_token(tier.action, d))
        spare = (money - take * tier_bytes_per_token(tier.action, d)) / (policy.budget.value * full)
        mix.append((tier.name, take))
        left -= take
    return mix


def explain(policy: Policy, shape: ModelShape = LLAMA_8B) -> str:
    d = shape.head_dim
    out = [f"{policy.name} ({policy.source})"]
    if policy.description:
        out.append(f"  {policy.description}")
    if policy.coupled:
        out.append(f"\nUnits: K and V together, each unit a {policy.k} (one decision moves both).")
    else:
        out.append(
            f"\nUnits: V in units of {policy.v}, K in units of {policy.k}, decided separately."
        )
    p = policy.protect
    if p.sinks or p.recent:
        out.append(
            f"Protected at full precision: the first {p.sinks} tokens (attention sinks) "
            f"and the last {p.recent} tokens."
        )
    out.append("\nScores:")
    for name, e in policy.scores:
        out.append(f"  {name} = {to_text(e)}")
    exprs = [e for _, e in policy.scores] + list(policy.allocate.exprs())
    used = sorted({n.id for e in exprs for n in e.walk() if isinstance(n, Name)} & set(SIGNALS))
    fns = sorted({n.fn for e in exprs for n in e.walk() if hasattr(n, "fn")})
    out += [f"    {s}: {SIGNALS[s]}" for s in used]
    out += [f"    {f}(): {FUNCTIONS[f].doc}" for f in fns]
    out.append(f"\nTiers, best first (bytes per token per KV head, d={d}):")
    out += [_tier_line(t, d) for t in policy.tiers]
    out.append("\nAllocation: " + _allocation_text(policy))
    for r in policy.rules:
        out.append(f"  rule: when {to_text(r.when)} then {type(r.then).__name__.lower()}")
    full = shape.full_bytes_per_token
    out.append(f"\nBudget: {policy.budget}.")
    if policy.budget.kind == "fraction":
        per_head = policy.budget.value * tier_bytes_per_token(Keep(), d)
        out.append(
            f"  = {per_head:.1f} B/token per KV head; for {shape.name} ({shape.layers} "
            f"layers x {shape.kv_heads} KV heads x d={d}): "
            f"{_kib(policy.budget.value * full)}/token of {_kib(full)} at full precision."
        )
    mix = steady_state_mix(policy, d)
    if mix:
        out.append(
            "  With the budget in use: "
            + ", ".join(f"{share:.1%} of tokens {name}" for name, share in mix)
            + "."
        )
    out.append(_server_text(policy, shape))
    out.append(f"Spread over layers and heads: {_spread_text(policy)}.")
    out.append("Routing runs: " + _schedule_text(policy) + ".")
    out.append(
        "Ledger: "
        + (
            "write-once (a unit is quantized at its first demotion; later "
            "demotions and promotions reuse that copy, so error never compounds)."
            if policy.ledger.write_once
            else "none (units are re-quantized from full precision at each demotion)."
        )
    )
    return "\n".join(out)


def _server_text(policy: Policy, shape: ModelShape) -> str:
    """What a token slot of SGLang's pool costs under ``--kv-policy`` (bf16 rows), and how many
    tokens the pool holds against a bf16 pool of the same bytes (``adapters/sglang/sizing.py``)."""
    L, H, d = shape.layers, shape.kv_heads, shape.head_dim
    full = 2 * L * H * d * 2
    try:
        sizing.check_metadata(policy, policy.budget, L, H, d, 2)
    except PoolConfigError as e:
        return f"In an SGLang server (--kv-policy): refused at launch: {e}"
    cell = sizing.cell_bytes(policy, policy.budget, L, H, d, 2)
    split = sizing.pool_bytes(1 << 20, H, d, L, 2, policy, policy.budget)
    meta = (split.tables + split.engine) / split.slots
    rows = (
        ""
        if policy.coupled
        else " (every slot keeps its full-precision rows: the budget bounds what a routed "
        "request reads, not the pool's memory; docs/sglang.md, RDKV on the shared pool)"
    )
    return (
        f"In an SGLang server (--kv-policy): a token slot costs {_kib(cell)} of which "
        f"{_kib(meta)} block tables and running requests' engine state, so the pool holds "
        f"{full / cell:.1f}x the tokens of a bf16 pool of the same bytes{rows}."
    )


def _allocation_text(policy: Policy) -> str:
    a = policy.allocate
    if isinstance(a, RankAllocation):
        kept = [t.name for t in policy.tiers if not isinstance(t.action, Evict)]
        shares = ", ".join(
            f"{n} up to {s:.0%} of the budget" for n, s in zip(kept, a.shares, strict=True)
        )
        tail = ", the rest evicted" if isinstance(policy.tiers[-1].action, Evict) else ""
        how = f"rank units by `{to_text(a.by)}`, highest first:"
        if a.by_tier:  # each tier fills from its own ranking
            ranks = "; ".join(
                f"{n} takes the highest `{to_text(e)}`"
                for n, e in zip(kept, a.by_tier, strict=True)
            )
            how = f"tier by tier, best first, each from its own ranking ({ranks}):"
        return (
            f"{how} {shares}{tail}; a unit keeps "
            f"its tier while its score is within {a.hysteresis:.0%} (hysteresis)."
        )
    bits = ", ".join(map(str, a.bits))
    order = (
        "one allocation over the shared K/V units"
        if policy.coupled
        else f"V units first over {a.v_share:.0%} of the budget, then K units over the kept V "
        "units with the rest"
    )
    return (
        f"rate-distortion: minimise sum w_u * sigma_u * 2^-b_u over b in {{{bits}}} "
        f"by Lagrangian reverse water-filling; {order}. w(V) = {to_text(a.v_weight)}, "
        f"w(K) = {to_text(a.k_weight)}, sigma = {to_text(a.sigma)}."
    )


def _spread_text(policy: Policy) -> str:
    s = policy.spread
    if s.kind == "uniform":
        return "uniform (every layer and KV head gets the same share)"
    if s.kind == "pyramid":
        return f"pyramid (the first layer gets {s.ratio:g}x the last layer's share, linearly)"
    return f"proportional to the per-(layer, head) total of {to_text(s.by)}"


def _schedule_text(policy: Policy) -> str:
    s = policy.schedule
    parts = ["after prefill"] if s.after_prefill else []
    if s.after_prefill and s.prefill_defers:
        parts = ["once after the whole prompt (at the first decode step after prefill, "
                 "however the prompt was chunked)"]  # fmt: skip
    if s.every:
        parts.append(f"every {s.every} decode steps")
    if s.on_pressure:
        parts.append(f"when bytes reach {s.on_pressure:.0%} of the budget")
    return ", ".join(parts) or "never (the policy only sets the initial tiers)"
