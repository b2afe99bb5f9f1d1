"""``TierStore``: every layer's units, their tiers, and the routing step that moves them.

Lifecycle per request: ``append`` the prompt's K/V per layer, ``observe`` the prefill signals,
``after_prefill()``; then per decode step ``append`` one token, ``observe`` its attention, and
``route`` when ``schedule_due(step)`` says so. Between routings new tokens stay at full precision
(zone C); the budget is enforced at routing steps: right after ``route()``
``bytes_used() <= budget_bytes()``, or the step's :class:`~tiered_radix.engine.events.StepEvents`
has ``over_budget=True`` (forced content alone exceeded the budget; see ``routing``).

Coupled policies keep one tier per (head, window|token) unit (:mod:`.coupled`); decoupled ones
(RDKV: V per token, K per channel) keep V tokens like coupled token units and K in
:mod:`.decoupled`. Transitions report V units (K channels are re-encoded at each routing).
With ``reader=`` the store keeps tiers, scores and byte counts only and reads rows through the
callback (the SGLang pool holds them; ``append_tokens`` counts new tokens). Tier maps are device
tensors, stacked over layers (:class:`~.coupled.CoupledStack`); ``plan()``
(scores -> tiers) is separate from ``apply()`` (moving data) so each can be timed
(``bench/routing_step.py``). A rank-allocation ``route()`` waits for the device once (to learn
how many units move); the step's record (transitions, bytes) is read from the device lazily.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from tiered_radix.policy.model import Budget, Policy, RateDistortion

from .coupled import CoupledLayer, CoupledStack
from .decoupled import ChannelK, nbytes_layers
from .events import EventLog, StepEvents, Transitions
from .pending import PendingRoutes
from .planner import Plan, plan_route, plan_routes
from .routing import (
    EngineConfigError,
    TierSet,
    full_token_bytes,
    per_layer,
    spread_shares,
    total_budget,
)
from .scores import ScoreEvaluator
from .shard import HeadShard
from .signals import TOKEN_SIGNALS, CacheState, Signals
from .stacked import settle as settle_stacked
from .stacked import stackable
from .units import UnitLayout

_SHARES: dict[tuple, Tensor] = {}


def _fixed_shares(spread, n_layers: int, n_heads: int, device: torch.device) -> Tensor:
    """:func:`~.routing.spread_shares` of a spread that does not follow the scores, made once
    per (spread, shape, device) and shared read-only by every store (a store per request)"""
    key = (spread, n_layers, n_heads, str(device))
    t = _SHARES.get(key)
    if t is None:
        t = _SHARES[key] = spread_shares(spread, n_layers, n_heads, None, device)
    return t


@dataclass
class _Layer:
    v: CoupledLayer  # K and V for coupled policies, V alone for decoupled ones
    k: ChannelK | None = None


class TierStore:
    """The tier engine for one sequence. See the module docstring for the lifecycle.

    Raises:
        EngineConfigError: a layout the engine cannot store (group vs window, K units).
    """

    def __init__(
        self,
        policy: Policy,
        *,
        n_layers: int,
        n_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        max_tokens: int | None = None,
        budget_override: Budget | None = None,
        reader: Callable[[int], tuple[Tensor, Tensor, Tensor]] | None = None,
        shard: HeadShard | None = None,
        history: int | None = None,
    ) -> None:
        self.policy, self.n_layers, self.n_heads, self.head_dim = (
            policy,
            n_layers,
            n_heads,
            head_dim,
        )
        self.device, self.dtype = torch.device(device), dtype
        self.shard = shard or HeadShard.single(n_heads)
        if self.shard.heads_local != n_heads:
            raise ValueError(
                f"the store holds n_heads={n_heads} heads but its shard gives this rank "
                f"{self.shard.heads_local} ({self.shard.heads_total} over {self.shard.world})"
            )
        self.budget = budget_override or policy.budget
        self.tier_set = TierSet.of(policy)
        self.coupled = policy.coupled
        self.layout = UnitLayout.of(policy.v, head_dim)
        if not self.coupled and (policy.k.kind != "channel" or policy.v.kind != "token"):
            raise EngineConfigError(
                "separate K and V units are supported as RDKV's "
                "`units: {k: channel, v: token}`; use one granularity "
                "for both otherwise"
            )
        parts = ("k", "v") if self.coupled else ("v",)
        self.reader = reader
        self.stack = CoupledStack(
            self.tier_set,
            self.layout,
            n_layers,
            n_heads,
            head_dim,
            dtype,
            self.device,
            policy.ledger.write_once,
            parts,
            max_tokens,
            keep_data=reader is None,
        )
        ks: list[ChannelK | None] = [None] * n_layers
        if not self.coupled:  # every layer's K state made at once (stacked buffers, views)
            a: RateDistortion = policy.allocate
            bits = [0] * self.tier_set.offset + list(a.bits)
            ks = ChannelK.layers(
                n_layers, tiers=self.tier_set, bits=bits, group=a.group, n_heads=n_heads,
                head_dim=head_dim, dtype=dtype, device=self.device, keep_data=reader is None,
            )  # fmt: skip
        self.layers = [_Layer(self.stack.layer(li), k) for li, k in enumerate(ks)]
        self.shares = (  # float64 [L, H] budget shares, fixed unless proportional to scores
            None
            if policy.spread.kind == "proportional"
            else self.shard.local(
                _fixed_shares(policy.spread, n_layers, self.shard.heads_total, self.device), 1
            )  # fmt: skip
        )
        self.scores = ScoreEvaluator(
            policy, n_layers, n_heads, cache=self._cache_state,
            gather_heads=self.shard.gather_heads if self.shard.world > 1 else None,
        )  # fmt: skip
        self.events = EventLog(keep=history)  # history: routing steps held (None: all)
        self.step = 0
        self.deferred = False  # a prefill chunk's routing waits for the next decode step

    # -- feeding -------------------------------------------------------------------------
    def append(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Append tokens: ``k, v [H, t, d]`` (prefill or one decode token); they are full."""
        want = (self.n_heads, k.shape[1], self.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise ValueError(
                f"append expects k, v of shape [H={self.n_heads}, t, "
                f"d={self.head_dim}], got {list(k.shape)} and {list(v.shape)}"
            )
        k, v = k.to(self.device), v.to(self.device)
        self.stack.append(layer, {"k": k, "v": v} if self.coupled else {"v": v})
        if self.layers[layer].k is not None:
            self.layers[layer].k.append(k)

    def append_tokens(self, layer: int | None, n: int) -> None:
        """Count ``n`` new full tokens of ``layer`` (``None``: every layer) whose rows live with
        the ``reader``."""
        assert self.reader is not None, "append_tokens is for stores built with reader="
        if layer is None:
            self.stack.count(n)
        else:
            self.stack.append(layer, {}, n)
        if self.coupled:
            return
        if layer is None:
            ChannelK.count_layers([lay.k for lay in self.layers], n)
        else:
            self.layers[layer].k.append(None, n)

    def seed_states(self, tier: Tensor, copied: Tensor) -> None:
        """Start the first units at tiers decided elsewhere, e.g. a prefix a server's radix cache
        lends at the states its holders left (:meth:`~.coupled.CoupledStack.seed`): ``tier``
        ``[L, H, n]`` engine tiers, ``copied`` ``[L, H, n]`` where a ledger copy exists."""
        self.stack.seed(tier, copied)

    def recall(self) -> int:
        """A later turn begins: units evicted under ``evict(archive=T)`` come back at tier
        ``T`` from their archived copies, attended again and ranked with the rest at the next
        routing. Returns the units recalled (0 for a policy without an archive)."""
        return self.stack.recall() if self.coupled else 0

    def archived_bytes(self) -> int:
        """Bytes of archived copies: evicted units' copies kept for a later turn, outside the
        request's budget and :meth:`bytes_used`."""
        return int(self.stack.archived_nbytes())

    def observe(self, layer: int, signals: Signals) -> None:
        """Record one layer's signals and advance cumulative scores (once per step)."""
        self.scores.update(layer, signals)

    def observe_layers(self, signals: Signals) -> None:
        """Every layer's signals at once, stacked over layers (token signals ``[L, H, T']``,
        ``qnorm [L, H, d]``): the same as ``observe(l, ...)`` with each layer's, in one batched
        update where every layer holds the ``T'`` tokens the signals cover (a prefill chunk's
        signals after its last layer), else layer by layer."""
        t = self.stack.n_tokens
        given = {n: getattr(signals, n) for n in (*TOKEN_SIGNALS, "qnorm")}
        given = {n: x for n, x in given.items() if x is not None}
        covers = len(set(t)) == 1 and all(
            x.shape[-1] == t[0] for n, x in given.items() if n in TOKEN_SIGNALS
        )
        if not covers:
            for li in range(self.n_layers):
                self.observe(li, Signals(**{n: x[li] for n, x in given.items()}))
            return
        Signals(**{n: x[0] for n, x in given.items()}).check(self.n_heads, t[0], self.head_dim)
        self.scores.update_layers(signals)

    def observe_attn(self, attn: Tensor) -> None:
        """Every layer's decode-step attention mass at once: ``attn [L, H, T]`` float32 (all
        layers hold ``T`` tokens); the same as ``observe(l, Signals(attn=attn[l]))`` per layer."""
        self._check_all_layers("observe_attn", attn)
        self.scores.update_attn(attn)

    def attn_decay(self) -> float | None:
        """See :meth:`~.scores.ScoreEvaluator.attn_decay`: whether (and at which decay) decode
        steps' attention may be summed elsewhere and folded in with :meth:`fold_attn`."""
        return self.scores.attn_decay()

    def fold_attn(self, acc: Tensor, steps: int, unit: int = 1) -> None:
        """``steps`` decode steps of :meth:`observe_attn` at once: ``acc [L, H, T]`` float32,
        each step's attention summed as ``acc = decay * acc + attn`` (the last step's ``T``
        tokens); ``unit > 1``: ``acc [L, H, ceil(T / unit)]`` per span of ``unit`` tokens, as
        a decode kernel sums it per window (:meth:`~.scores.ScoreEvaluator.fold_attn`)."""
        self._check_all_layers("fold_attn", acc, unit)
        self.scores.fold_attn(acc, steps, unit, self.stack.n_tokens[0])

    def _check_all_layers(self, what: str, x: Tensor, unit: int = 1) -> None:
        """``x`` is ``[L, H, T]`` over layers that all hold ``T`` tokens (``unit > 1``: ``[L,
        H, ceil(T / unit)]``, one entry per span of ``unit`` tokens)."""
        t = self.stack.n_tokens
        n = -(-t[0] // unit)
        if len(set(t)) != 1 or x.shape[2] != n:
            per = "" if unit == 1 else f" per {unit} tokens of {t[0]}"
            raise ValueError(
                f"{what} needs [L, H, T={n}]{per} over equal layers, got {list(x.shape)}"
            )

    def schedule_due(self, decode_step: int) -> bool:
        """After decode step ``decode_step`` (0-based): route every N steps (after steps N-1,
        2N-1, ...) or when bytes reach the ``on_pressure`` fraction of the budget (bytes of all
        ranks: one all-reduce when sharded, so every rank decides the same); and at the first
        decode step after prefill chunks whose routing was deferred (``after_prefill(defer=true)``).
        """
        if self.deferred:
            return True
        s = self.policy.schedule
        if s.every is not None and (decode_step + 1) % s.every == 0:
            return True
        if s.on_pressure is None:
            return False
        return int(self.shard.sum(self._bytes())) >= s.on_pressure * self.budget_bytes()

    def after_prefill(self, reason: str = "after_prefill") -> Transitions | None:
        """Route once if the policy's schedule says ``after_prefill`` (under
        ``after_prefill(defer=true)``: :meth:`defer`); else None. Call it after every prefill
        chunk."""
        s = self.policy.schedule
        if not s.after_prefill:
            return None
        return self.defer() if s.prefill_defers else self.route(reason)

    # -- routing -------------------------------------------------------------------------
    def plan(self) -> Plan:
        """Scores -> new tiers for every layer (device tensors; nothing moves yet)."""
        return plan_route(self)

    def apply(self, plan: Plan, reason: str = "") -> Transitions:
        """Move the data to ``plan``'s tiers; record and return the step's transitions."""
        return self.finish_apply(plan, reason, self.stack.apply(plan.tiers))

    def finish_apply(
        self, plan: Plan, reason: str, m, used=None, over=None, budget: int | None = None
    ) -> Transitions:
        """The rest of :meth:`apply` once the stack moved its units (``m``: its ``Moves``), for
        a routing whose moves were made elsewhere (:mod:`.pending`, stacked over stores);
        ``used`` (int64 0-d) and ``over`` (bool 0-d) where they were computed with other
        stores' (:class:`~.stacked.StackedMoves`, unsharded): this store's bytes and
        over-budget flag. ``budget``: what it is checked and recorded against (default:
        :meth:`budget_bytes`; a routing that lands later: :meth:`landing_budget`)."""
        ev = self.tier_set.evict
        for li, u in enumerate(plan.units):
            self.stack.routed_units[li] = u
        ks = [lay.k for lay in self.layers if lay.k is not None]  # every layer's, or none
        if ks and not ChannelK.apply_layers(ks, plan.k, plan.k_set, plan.tiers):
            for li, k in enumerate(ks):
                kept = plan.v[li] != (-1 if ev is None else ev)
                k.apply(plan.k[li], plan.k_set[li], kept, plan.tiers[li])
        out = Transitions.from_flat(
            self.tier_set.names, ev, m.index, m.shape, m.src, m.dst, m.wrote
        )
        out.promoted, out.written = m.promoted, m.written
        budget = self.budget_bytes() if budget is None else budget
        if used is None:
            used = self._bytes()
            if self.shard.world > 1:  # the record is the whole model's, the same on every rank
                used = self.shard.sum(used)
            over = plan.over | (used > budget)
        self.events.record(
            StepEvents(self.step, reason, out, used, budget, over_budget=over, forced=plan.over)
        )
        self.step += 1
        return out

    def route(self, reason: str) -> Transitions:
        """Run allocation for every layer and move units; returns the transitions."""
        self.deferred = False
        return self.apply(self.plan(), reason)

    def defer(self) -> Transitions:
        """A routing step put off until the next decode step (:meth:`schedule_due` then says
        so): nothing is planned or moved now, the new tokens stay at full precision (so bytes
        may exceed the budget until then); returns no transitions."""
        self.deferred = True
        empty = torch.zeros(0, dtype=torch.long, device=self.device)
        shape = (self.n_layers, self.n_heads, 1)
        return Transitions.from_flat(
            self.tier_set.names, self.tier_set.evict, empty, shape, empty, empty, empty
        )

    @staticmethod
    def route_many(
        stores: list[TierStore], reasons: list[str], *, prefill: bool = False
    ) -> list[Transitions]:
        """:meth:`route` of several stores of one model shape: those of one policy planned
        together (:func:`~.planner.plan_routes`: one pass over their stacked layers where it
        can), each policy's apart; the transitions in ``stores``' order. ``prefill``: they
        route after a prefill chunk (deferred under ``after_prefill(defer=true)``:
        :meth:`defer`)."""
        return TierStore.begin_routes(stores, reasons, prefill=prefill).land()

    @staticmethod
    def begin_routes(
        stores: list[TierStore], reasons: list[str], *, prefill: bool = False
    ) -> PendingRoutes:
        """The first half of :meth:`route_many`, without waiting for the device: the plans and
        the masks of every store's moves, with their counts on their way to the host.
        :meth:`PendingRoutes.land` moves the units (one host read of the counts); until then
        the stores hold their tiers as before and take no other routing. Stores that defer
        this routing (a prefill chunk under ``after_prefill(defer=true)``) are done at once."""
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(stores):
            groups.setdefault(id(s.policy), []).append(i)
        done: dict[int, Transitions] = {}
        plans: dict[int, Plan] = {}
        for idx in groups.values():
            group = [stores[i] for i in idx]
            if prefill and group[0].policy.schedule.prefill_defers:
                done.update((i, s.defer()) for i, s in zip(idx, group, strict=True))
                continue
            plans.update(zip(idx, plan_routes(group), strict=True))
            for s in group:
                s.deferred = False
        return PendingRoutes.begin(stores, plans, reasons, done)

    def settle(
        self,
        layer: Tensor,
        head: Tensor,
        unit: Tensor,
        tier: Tensor,
        copy: Tensor,
        where: Tensor | None = None,
    ) -> None:
        """Units ``(layer, head, unit)`` (int64 ``[m]`` each) that the holder of the rows
        (``reader=``) could not move as the last routing planned now sit at engine ``tier``
        (``[m]``), with a ledger copy where ``copy`` (bool ``[m]``): the store's tiers and
        bytes follow what is stored, and the next plan starts from there. The last step's
        record is marked over budget where a unit stayed above its planned tier. ``where``
        (bool ``[m]``): only those units (the others keep theirs; no host sync to find them)."""
        st = self.stack
        cur = st.tier[layer, head, unit]
        tier = tier.to(st.tier.dtype) if where is None else torch.where(where, tier, cur)
        raised = tier < cur  # a better (costlier) tier than planned
        st.tier[layer, head, unit] = tier
        for copies in st.stores.values():
            has, n = copy, copy.int()
            if where is not None:
                has = torch.where(where, copy, copies.present[layer, head, unit])
                n = torch.where(where, n, copies.write_count[layer, head, unit])
            copies.present[layer, head, unit] = has
            copies.write_count[layer, head, unit] = n
        if self.events.steps:
            self.events.steps[-1].mark_over(raised.any())

    @staticmethod
    def settle_many(stores: list[TierStore], units: list[tuple[Tensor, ...]]) -> None:
        """:meth:`settle` of several stores: ``units[i]`` the ``(layer, head, unit, tier, copy,
        where)`` of store ``i``. Stores that move together (as :meth:`begin_routes` moves
        them: one tier set and shape, rows elsewhere, one rank) settle in one pass."""
        stacks = [s.stack for s in stores]
        if not (stackable(stacks) and all(s.stacks_with_others for s in stores)):
            for s, u in zip(stores, units, strict=True):
                s.settle(*u)
            return
        sizes = [u[0].numel() for u in units]
        ly, h, unit, tier, copy, where = (torch.cat([u[k] for u in units]) for k in range(6))
        raised = settle_stacked(stacks, sizes, ly, h, unit, tier.long(), copy, where)
        for i, s in enumerate(stores):
            if s.events.steps:
                s.events.steps[-1].mark_over(raised[i])

    # -- reading -------------------------------------------------------------------------
    def view(self, layer: int) -> tuple[Tensor, Tensor, Tensor]:
        """What attention reads: float32 ``k_hat, v_hat [H, T, d]`` (full rows, dequantized
        copies, a dropped K channel as 0) and ``kept`` bool ``[H, T]``; evicted rows are NaN.
        A store built with ``reader=`` asks it (the rows live in an external pool)."""
        if self.reader is not None:
            return self.reader(layer)
        lay = self.layers[layer]
        rows, kept = lay.v.view()
        k = rows["k"] if lay.k is None else lay.k.view(kept)
        return k, rows["v"], kept

    def _cache_state(self, layer: int) -> CacheState:
        return CacheState(
            load=lambda: self.view(layer),
            n_tokens=self.stack.n_tokens[layer],
            head_dim=self.head_dim,
            device=self.device,
        )

    def n_tokens(self, layer: int = 0) -> int:
        return self.stack.n_tokens[layer]

    def bytes_used(self) -> int:
        """Exact bytes: full rows, codes with fp16 scale/lo, ledger copies kept (of this
        rank's heads when sharded; a routing step's record holds all ranks')."""
        return int(self._bytes())

    def _bytes(self) -> Tensor:
        """int64 0-d device tensor (no host sync)."""
        total = self.stack.nbytes()
        st = self.stack
        if not self.coupled and len(set(st.n_tokens)) == 1:  # every layer at once
            ev = self.tier_set.evict
            kept = self.layout.token_mask(
                st.tier[:, :, : st.n_units(0)] != (-1 if ev is None else ev), st.n_tokens[0]
            )
            return total + nbytes_layers([lay.k for lay in self.layers], kept)
        for lay in self.layers:
            if lay.k is not None:
                _, kept = lay.v.view()
                total = total + lay.k.nbytes_heads().sum() + lay.k.rows_bytes(kept).sum()
        return total

    def budget_bytes(self, tokens: list[int] | None = None) -> int:
        """The whole model's budget (all ranks' heads when sharded), at ``tokens`` per layer
        (default: those held now)."""
        tokens = self.stack.n_tokens if tokens is None else tokens
        return total_budget(self.budget, tokens, self.shard.heads_total, self.head_dim)

    def landing_budget(self, planned: list[int]) -> int:
        """The bytes a routing planned at ``planned`` tokens per layer may hold when it lands
        after more were decoded (SGLang's overlap order: a step later): the budget it was
        planned for, and the tokens since at full precision, which the next routing places (as
        every token decoded between two routings waits for the next)."""
        late = sum(self.stack.n_tokens) - sum(planned)
        return self.budget_bytes(planned) + late * full_token_bytes(
            self.shard.heads_total, self.head_dim
        )

    def channel_tiers(self, layer: int) -> tuple[Tensor, Tensor]:
        """A decoupled policy's K after the last routing: int64 ``[H, d]`` engine tier per
        channel and bool ``[H, T]`` the channel set (tokens whose K is held per channel)."""
        k = self.layers[layer].k
        assert k is not None, "channel tiers are a decoupled policy's"
        return k.tier, k.in_set

    def tier_bits(self) -> list[int]:
        """A decoupled policy's width of each engine tier (0: evicted, 16: full precision)."""
        k = self.layers[0].k
        assert k is not None, "tier widths are a decoupled policy's"
        return list(k.bits)

    def tiers(self, layer: int) -> Tensor:
        """int64 ``[H, U]`` engine tier index per unit (V tokens for decoupled policies)."""
        return self.stack.tier[layer, :, : self.stack.n_units(layer)]

    @property
    def tier_names(self) -> tuple[str, ...]:
        return self.tier_set.names

    @property
    def stacks_with_others(self) -> bool:
        """Whether its moves may run with other stores' (:mod:`.stacked`, where the stacks are
        :func:`~.stacked.stackable`): a coupled policy on one rank (a decoupled one also moves
        its K channels, a sharded one sums its bytes over the ranks)."""
        return self.coupled and self.shard.world == 1

    def occupancy(self) -> dict[str, int]:
        """Units per tier, over layers and heads (the partial window counts as full)."""
        n, st = len(self.tier_names), self.stack
        units = per_layer([st.n_units(li) for li in range(self.n_layers)], self.device)
        valid = torch.arange(st.capacity, device=self.device) < units
        counts = torch.bincount(st.tier[valid.expand_as(st.tier)], minlength=n)
        return dict(zip(self.tier_names, counts.tolist(), strict=True))
