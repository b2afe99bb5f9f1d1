"""Evaluating policy expressions per unit: scores, rule conditions, RD weights, spread shares.

``evaluate(layer, expr, part)`` returns ``[H, U]`` for the units of ``part`` (a
:class:`~tiered_radix.engine.units.UnitLayout`). Evaluation is bottom-up at one *level*:

- unit level (the default): per-token signals that add up (``attn``, ``colmass``, ``obs_attn``,
  ``key_norm``) are summed over each unit's tokens; ``sigma`` is the standard deviation of the
  unit's V entries (of ``K[:, c]`` over kept tokens for a channel); ``position`` is the unit's
  first token, ``recency`` counts tokens after its last one. Functions then act per unit.
- token level: inside ``sum_window``/``mean_window``/``max_window`` and ``pool_max`` the argument
  is evaluated per token, then reduced over each unit (``pool_max``'s result is summed).
- ``cumulative(x, decay)`` keeps its running sum per token (per channel for channel signals),
  advanced by :meth:`ScoreEvaluator.update` once per call (once per decode step, or once after
  prefill): ``state = decay * state + x``; at unit level it is summed over the unit's tokens.
  Because the sum is linear, a ``cumulative`` that is only ever read at unit level keeps one
  running sum per window instead (``state_u = decay * state_u + sum of x over u's tokens``):
  the same value, 1/W of the memory (:func:`held_state`).
- ``*_heads`` reduce over the KV heads and broadcast back; ``quantile(x, q)`` is the q-quantile
  over the units of each (layer, head).

Signals from the caller that were never observed raise :class:`SignalError` when used, except
inside ``cumulative`` (nothing accumulated yet is 0). ``colmass``/``obs_attn`` are 0 for tokens
generated after the prompt. The latest value of a signal is kept between calls only when an
expression reads it outside a ``cumulative`` argument (qevict reads ``attn`` only through
``cumulative(attn)``: it keeps none). A token-level function of one prompt signal read at unit
level over windows (qevict's ``pool_max(obs_attn, size=7)``) is kept as its windows' values
once the signal is observed, the windows whose value no later token can change, with the
signal's last tokens for the others (recomputed at each evaluation): the same values as from
the whole signal, at 1/W of its memory (:func:`held_state`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from tiered_radix.policy.expr import BinOp, Call, Expr, Name, Num, UnaryOp
from tiered_radix.policy.model import Policy

from .growth import grown
from .signals import CacheState, SignalError, Signals, pad_tokens
from .units import UnitLayout

ADDITIVE = ("attn", "colmass", "obs_attn", "key_norm")
CHANNEL = ("qnorm", "knorm")
OBSERVED = ("attn", "colmass", "obs_attn", "qnorm")
_BIN = {
    "+": torch.add,
    "-": torch.sub,
    "*": torch.mul,
    "/": torch.div,
    "^": torch.pow,
    "<": torch.lt,
    "<=": torch.le,
    ">": torch.gt,
    ">=": torch.ge,
    "==": torch.eq,
    "!=": torch.ne,
    "and": torch.logical_and,
    "or": torch.logical_or,
}
_UNARY = {
    "log": lambda x: x.clamp(min=1e-30).log(),
    "exp": torch.exp,
    "sqrt": lambda x: x.clamp(min=0).sqrt(),
    "abs": torch.abs,
}
_UNSET = object()
_HEADS = {"sum_heads": "sum", "mean_heads": "mean", "max_heads": "amax"}
_WINDOW = {"sum_window": "sum", "mean_window": "mean", "max_window": "max"}
_LAYERS = {"sum_layers": "sum", "mean_layers": "mean", "max_layers": "amax"}
_TOKEN_LEVEL = (*_WINDOW, "pool_max")  # functions that evaluate their argument per token


PROMPT_SIGNALS = ("colmass", "obs_attn")  # observed over the prompt only (0 afterwards)
_ELEMENTWISE = (*_UNARY, "min", "max", "clip")


@dataclass(frozen=True)
class HeldState:
    """What a :class:`ScoreEvaluator` keeps between calls for a policy, per (layer, head).

    ``grain``: each ``cumulative`` node's tokens per running sum: the unit size where it is
    read only at unit level over token units (one sum per unit), 1 where some expression reads
    it per token (inside ``*_window``, ``pool_max`` or another ``cumulative``'s argument), 0
    for a node over K channels (one sum per channel). ``signals``: the observed signals whose
    latest value is kept (read outside any ``cumulative`` argument and any memo). ``memos``:
    token-level functions of one prompt signal read at unit level over windows (qevict's
    ``pool_max(obs_attn, size=7)``), kept as one value a window once the signal is observed
    (:class:`_Memo`), with the signal's last tokens (at most a window and the reach)."""

    grain: dict[Call, int]
    signals: frozenset[str]
    memos: dict[Call, str] = field(default_factory=dict)  # call -> the prompt signal it reads

    def sums_per_token(self) -> float:
        """float32 running sums per token (channel states, ``[H, d]``, are not per token)."""
        return sum(1 / g for g in self.grain.values() if g)

    def sums_per_unit(self) -> int:
        """float32 running sums kept per unit (``grain`` > 1)."""
        return sum(1 for g in self.grain.values() if g > 1)

    def tail_tokens(self, unit: int) -> int:
        """The most signal tokens the memos keep beside their windows' values, per (layer,
        head) and request: a window less one and the function's reach, per memo."""
        return sum(unit - 1 + sum(_reach(call)) for call in self.memos)


def held_state(policy: Policy) -> HeldState:
    """See :class:`HeldState`: which ``cumulative`` sums are kept per unit, which token-level
    reads of a prompt signal are kept per unit, and which latest signals are kept, from where
    the policy's expressions read them."""
    scores = dict(policy.scores)
    unit = UnitLayout.of(policy.v, 0).size
    token_read: dict[Call, bool] = {}
    latest: set[str] = set()
    memos: dict[Call, str] = {}

    def visit(e: Expr, token: bool, inside: bool) -> None:
        if isinstance(e, Name):
            if e.id in scores:
                visit(scores[e.id], token, inside)
            elif e.id in OBSERVED and not inside:
                latest.add(e.id)
            return
        if isinstance(e, Call) and e.fn == "cumulative":
            token_read[e] = token_read.get(e, False) or token
            visit(e.args[0], True, True)  # the argument is evaluated per token (or channel)
            return
        if isinstance(e, Call) and e.fn in _TOKEN_LEVEL and not token and unit > 1:
            signal = _one_prompt_signal(e.args[0], scores)
            if signal is not None:
                memos[e] = signal
                return
        inner = token or (isinstance(e, Call) and e.fn in _TOKEN_LEVEL)
        for child in e.children():
            visit(child, inner, inside)

    for e in policy.expressions():
        visit(e, False, False)
    grain = {}
    for node, token in token_read.items():
        channel = any(isinstance(n, Name) and n.id in CHANNEL for n in node.args[0].walk())
        grain[node] = 0 if channel else (1 if token else unit)
    return HeldState(grain, frozenset(latest), memos)


def _one_prompt_signal(e: Expr, scores: dict[str, Expr]) -> str | None:
    """The prompt signal ``e`` reads if it reads exactly one and otherwise only constants,
    through arithmetic and elementwise functions (its per-token value is the signal's, mapped
    token by token); else None."""
    names: set[str] = set()

    def ok(x: Expr) -> bool:
        if isinstance(x, Num):
            return True
        if isinstance(x, Name):
            if x.id in scores:
                return ok(scores[x.id])
            names.add(x.id)
            return x.id in PROMPT_SIGNALS
        if isinstance(x, Call) and x.fn not in _ELEMENTWISE:
            return False
        return all(ok(c) for c in x.children())

    if not ok(e) or len(names) != 1:
        return None
    return names.pop()


@dataclass(frozen=True)
class _Memo:
    """One layer's unit-level values of a memoized call (:class:`HeldState`): ``units [H, n]``
    for the windows whose value no later token changes (every token a value depends on was
    observed), and the signal's ``tail [H, t_obs - start]`` from token ``start``, the first one
    the later windows' values read (at most a window and the function's reach), from which
    they are recomputed at each evaluation."""

    units: Tensor
    tail: Tensor
    start: int
    t_obs: int


class _Ctx:
    """Where an expression is evaluated: one layer (values ``[H, X]``) or a group of layers with
    equal token counts (``layer`` a tuple, ``cache`` a list, values ``[G, H, X]``)."""

    def __init__(
        self, layer, cache, layout: UnitLayout, token_level: bool, *, n_tokens=None, bound=None
    ):
        self.layer, self.cache, self.layout, self.token_level = layer, cache, layout, token_level
        self.stacked = isinstance(layer, tuple)
        self.bound: dict[str, Tensor] | None = bound
        if cache is None:  # a memo's run of ``n_tokens`` tokens: its signal ``bound``, no cache
            self.n_tokens, self.head_dim = n_tokens, 0
            self.device = next(iter(bound.values())).device
        else:
            first = cache[0] if self.stacked else cache
            self.n_tokens, self.head_dim, self.device = first.n_tokens, first.head_dim, first.device
        self.lead = (len(layer),) if self.stacked else ()

    def at_tokens(self) -> _Ctx:
        if not self.layout.over_tokens:
            raise SignalError("a per-token function was used on channel units")
        return _Ctx(
            self.layer, self.cache, self.layout, True, n_tokens=self.n_tokens, bound=self.bound
        )

    def each(self, fn: Callable[[int, CacheState], Tensor]) -> Tensor:
        """``fn(layer, cache)`` for this layer, or stacked over the group's layers."""
        if not self.stacked:
            return fn(self.layer, self.cache)
        return torch.stack([fn(li, c) for li, c in zip(self.layer, self.cache, strict=True)])

    def shape(self, n_heads: int, x: Tensor) -> tuple[int, ...]:
        return (*self.lead, n_heads, x.shape[-1])


class ScoreEvaluator:
    """Evaluates a policy's expressions for ``n_layers`` layers of ``n_heads`` KV heads.

    ``cache(layer) -> CacheState`` supplies the engine-derived signals; ``evaluate`` and
    ``update`` also accept an explicit ``cache=``. ``gather_heads(x, dim)``: when the evaluator
    holds a shard of the model's KV heads (tensor parallelism), every rank's ``x`` concatenated
    along ``dim`` (a collective: every rank evaluates the same expressions in the same order), so
    ``*_heads`` reduce over all of them; None: ``n_heads`` are all the heads.
    """

    def __init__(
        self,
        policy: Policy,
        n_layers: int,
        n_heads: int,
        *,
        cache: Callable[[int], CacheState] | None = None,
        gather_heads: Callable[[Tensor, int], Tensor] | None = None,
    ) -> None:
        self.policy, self.n_layers, self.n_heads = policy, n_layers, n_heads
        self._gather_heads = gather_heads
        self._scores = dict(policy.scores)
        self._cache_fn = cache
        self._observed: list[dict[str, Tensor]] = [{} for _ in range(n_layers)]
        # cumulative state per node: float32 [L, H, capacity] per token or per unit (its
        # grain: zeros past each layer's tokens, so unit sums need no padding), or [L, H, d]
        # per channel
        self._state: dict[Call, Tensor] = {}
        self._attn_decay: float | None | object = _UNSET
        held = held_state(policy)
        self._grain, self._latest, self._memos = held.grain, held.signals, held.memos
        self._cumulative = list(held.grain)
        self._unit = UnitLayout.of(policy.v, 0)
        self._memo: list[dict[Call, _Memo]] = [{} for _ in range(n_layers)]

    # -- public ------------------------------------------------------------------------------
    def update(self, layer: int, signals: Signals, *, cache: CacheState | None = None) -> None:
        """Record ``signals`` as the layer's latest and advance every ``cumulative``."""
        cache = self._cache(layer, cache)
        signals.check(self.n_heads, cache.n_tokens, cache.head_dim)
        for name in OBSERVED:
            if getattr(signals, name) is not None:
                self._observed[layer][name] = getattr(signals, name).float()
        for node in self._cumulative:
            self._update_node(node, layer, signals, cache)
        self._settle((layer,), {n for n in PROMPT_SIGNALS if getattr(signals, n) is not None})

    def _update_node(self, node: Call, layer: int, signals: Signals, cache: CacheState) -> None:
        channel = self._uses(node.args[0], CHANNEL)
        layout = UnitLayout("channel" if channel else "token", 1, cache.head_dim)
        if any(getattr(signals, n) is None and self._uses(node.args[0], (n,)) for n in OBSERVED):
            return  # accumulate only what this step observed
        x = self._eval(node.args[0], _Ctx(layer, cache, layout, not channel))
        x = torch.broadcast_to(x.float(), (self.n_heads, x.shape[-1]))
        self._accumulate(node, layer, x)

    def update_layers(self, signals: Signals) -> None:
        """:meth:`update` of every layer at once, ``signals`` stacked over layers (token signals
        ``[L, H, T]`` covering every layer's ``T`` tokens, ``qnorm [L, H, d]``): the latest kept
        per layer (views), every ``cumulative`` advanced for all layers at once (its argument
        evaluated over the stacked layers, as :meth:`evaluate_layers` does: the same values as
        layer by layer)."""
        given = {
            n: getattr(signals, n).float() for n in OBSERVED if getattr(signals, n) is not None
        }
        for name, x in given.items():
            assert x.shape[:2] == (self.n_layers, self.n_heads), (name, x.shape, self.n_layers)
            for li in range(self.n_layers):
                self._observed[li][name] = x[li]
        every = tuple(range(self.n_layers))
        for node in self._cumulative:
            arg = node.args[0]
            if any(n not in given and self._uses(arg, (n,)) for n in OBSERVED):
                continue  # accumulate only what this step observed
            if isinstance(arg, Name) and arg.id in given and arg.id not in self._scores:
                x = given[arg.id]  # the signal itself: no evaluation
            else:
                channel = self._uses(arg, CHANNEL)
                caches = [self._cache(li, None) for li in every]
                layout = UnitLayout("channel" if channel else "token", 1, caches[0].head_dim)
                x = self._eval(arg, _Ctx(every, caches, layout, not channel)).float()
                x = torch.broadcast_to(x, (self.n_layers, self.n_heads, x.shape[-1]))
            self._accumulate(node, slice(None), x)
        self._settle(every, set(given), stacked=given)

    def update_attn(self, attn: Tensor) -> None:
        """:meth:`update` of every layer with ``Signals(attn=attn[l])``, ``attn [L, H, T]``
        (one decode step's attention mass of all layers): ``cumulative(attn, ...)`` advances in
        one batched op; any other accumulated expression takes the per-layer path."""
        L, H, t = attn.shape
        assert (L, H) == (self.n_layers, self.n_heads), (attn.shape, self.n_layers)
        attn = attn.float()
        for li in range(L):
            self._observed[li]["attn"] = attn[li]
        for node in self._cumulative:
            if node.args[0] == Name("attn"):
                self._accumulate(node, slice(None), attn)
                continue
            for li in range(L):
                self._update_node(node, li, Signals(attn=attn[li]), self._cache(li, None))
        self._settle(range(L))

    def attn_decay(self) -> float | None:
        """The decay ``g`` when decode steps advance no state but ``cumulative(attn, decay=g)``
        (one ``g``; ``attn`` read nowhere else, and no ``cumulative`` that advances on every
        call, like one of ``position``): then ``k`` steps of attention can be summed on the
        device, ``acc = sum_i g^(k-i) attn_i``, and folded in at once (:meth:`fold_attn`),
        leaving every state as ``k`` calls of :meth:`update_attn` would. None otherwise, and for
        policies that read no ``attn``."""
        if self._attn_decay is not _UNSET:
            return self._attn_decay
        self._attn_decay = self._fold_decay()
        return self._attn_decay

    def _fold_decay(self) -> float | None:
        attn, others = Name("attn"), tuple(n for n in OBSERVED if n != "attn")
        if any(n.args[0] != attn and not self._uses(n.args[0], others) for n in self._cumulative):
            return None  # a cumulative that advances on every decode step, whatever it observes
        nodes = [n for e in self.policy.expressions() for n in self._walk(e)]
        reads = sum(n == attn for n in nodes)  # attn anywhere, or as cumulative(attn, ...)
        folded = [
            n for n in nodes if isinstance(n, Call) and n.fn == "cumulative" and n.args[0] == attn
        ]
        decays = {_const(n.kwarg("decay", Num(1.0))) for n in folded}
        return decays.pop() if reads and reads == len(folded) and len(decays) == 1 else None

    def fold_attn(self, acc: Tensor, steps: int, unit: int = 1, n_tokens: int = 0) -> None:
        """``steps`` decode steps of attention at once: ``acc [L, H, T]`` float32 is
        ``sum_i g^(steps-i) attn_i`` over them (``g`` = :meth:`attn_decay`, which must not be
        None): each ``cumulative(attn)`` state becomes ``g^steps * state + acc``.

        ``unit > 1``: ``acc [L, H, n]`` is the mass of each span of ``unit`` tokens of the
        ``n_tokens`` (a decode kernel's side output per window), taken as all at the span's
        first token: a state kept per policy unit of that size adds it as it is (no per-token
        tensor), one kept per token gets it at each span's first token."""
        decay = self.attn_decay()
        if decay is None:
            raise SignalError("this policy's decode attention cannot be folded (attn_decay)")
        L, H, t = acc.shape
        assert (L, H) == (self.n_layers, self.n_heads), (acc.shape, self.n_layers)
        acc, tokens = acc.float(), None
        for node in self._cumulative:
            if node.args[0] != Name("attn"):
                continue
            if unit > 1 and self._grain[node] > 1 and self._unit.size == unit:  # per unit
                self._accumulate(node, slice(None), acc, decay**steps, summed=True)
                continue
            if unit > 1 and tokens is None:  # each span's mass at its first token
                tokens = acc.new_zeros(L, H, n_tokens)
                tokens[..., ::unit] = acc
            self._accumulate(node, slice(None), acc if unit == 1 else tokens, decay**steps)

    def evaluate(
        self, layer: int, expr: Expr, part: UnitLayout, *, cache: CacheState | None = None
    ) -> Tensor:
        """float32 (bool for conditions) ``[H, U]`` for the units of ``part``."""
        cache = self._cache(layer, cache)
        out = self._eval(expr, _Ctx(layer, cache, part, False))
        return torch.broadcast_to(out, (self.n_heads, part.n_units(cache.n_tokens)))

    def caches(self, layers: Sequence[int]) -> list[CacheState]:
        """The cache of each of ``layers``, to pass to several :meth:`evaluate_layers` calls:
        a layer's rows are read once for all of them (the reads are lazy and kept)."""
        return [self._cache(li, None) for li in layers]

    def evaluate_layers(
        self,
        layers: Sequence[int],
        expr: Expr,
        part: UnitLayout,
        *,
        caches: Sequence[CacheState] | None = None,
    ) -> Tensor:
        """``[G, H, U]`` for ``layers`` (they hold the same number of tokens) in one pass of
        batched ops: what :meth:`evaluate` gives per layer, stacked. ``caches``: the layers'
        (:meth:`caches`), shared with other calls while the rows stay as they are."""
        layers = tuple(layers)
        caches = list(caches) if caches is not None else self.caches(layers)
        assert len({c.n_tokens for c in caches}) == 1, "layers with different token counts"
        out = self._eval(expr, _Ctx(layers, caches, part, False))
        u = part.n_units(caches[0].n_tokens)
        return torch.broadcast_to(out, (len(layers), self.n_heads, u))

    def held_bytes(self) -> dict[str, int]:
        """Device bytes this evaluator keeps between calls: ``sums`` (the ``cumulative``
        states), ``signals`` (latest token signals; per-channel ones, ``[H, d]``, not counted),
        ``memos`` (:class:`HeldState`)."""
        token = [x for obs in self._observed for n, x in obs.items() if n not in CHANNEL]
        memos = [t for m in self._memo for x in m.values() for t in (x.units, x.tail)]
        return {
            "sums": sum(t.nbytes for t in self._state.values()),
            "signals": sum(t.nbytes for t in token),
            "memos": sum(t.nbytes for t in memos),
        }

    def observed(self, layer: int, name: str) -> Tensor | None:
        return self._observed[layer].get(name)

    # -- evaluation ------------------------------------------------------------------------
    def _accumulate(
        self, node: Call, layers, x: Tensor, decay: float | None = None, summed: bool = False
    ) -> None:
        """``state = decay * state + x`` for ``node`` at ``layers`` (an index or a slice),
        ``x [..., H, T]`` per token (per channel), summed per unit first where the node's
        state is kept per unit (``summed``: ``x`` is per unit already). ``decay``: the node's
        own unless given."""
        if self._grain[node] > 1 and not summed:  # kept per unit: the policy's windows
            x = self._unit.aggregate(x)
        n = x.shape[-1]
        if decay is None:
            decay = _const(node.kwarg("decay", Num(1.0)))
        _advance(self._buffer(node, n, x.device)[layers, :, :n], decay, x)

    def _settle(self, layers, observed=(), stacked: dict[str, Tensor] | None = None) -> None:
        """Memoize the prompt signals ``observed`` just now (:meth:`_remember`), then drop the
        latest token signals of ``layers`` that no expression reads again (the cumulative sums
        and memos have taken them in); per-channel ones (``[H, d]``) stay. ``stacked``: the
        signals of every layer at once (``[L, H, T]``, ``layers`` all of them), memoized in
        one pass of batched ops rather than layer by layer."""
        for call, signal in self._memos.items():
            if signal not in observed:
                continue
            if stacked is not None:
                self._remember(tuple(layers), call, stacked[signal])
            else:
                for li in layers:
                    self._remember(li, call, self._observed[li][signal])
        for li in layers:
            obs = self._observed[li]
            for name in [n for n in obs if n not in self._latest and n not in CHANNEL]:
                del obs[name]

    def _remember(self, layers: int | tuple[int, ...], call: Call, x: Tensor) -> None:
        """The memo of ``call`` (a token-level function of one prompt signal) from the signal's
        latest ``x [H, T_obs]`` at layer ``layers`` (or ``x [G, H, T_obs]`` at a tuple of
        them, in one pass): the windows every token of whose value lies in ``x`` (none past
        ``T_obs``: they are the same at any later length) and the tail of ``x`` the later
        windows' values need."""
        lay, t_obs = self._unit, x.shape[-1]
        left, right = _reach(call)
        u_det = max(0, t_obs - right) // lay.size
        ctx = _Ctx(layers, None, lay, False, n_tokens=t_obs, bound={self._memos[call]: x.float()})
        start = max(0, u_det * lay.size - left)  # the first token a later window reads
        m = _Memo(self._call(call, ctx)[..., :u_det].clone(), x[..., start:].float().clone(),
                  start, t_obs)  # fmt: skip
        if isinstance(layers, int):
            self._memo[layers][call] = m
            return
        for i, li in enumerate(layers):
            self._memo[li][call] = _Memo(m.units[i], m.tail[i], start, t_obs)

    def _memoized(self, call: Call, c: _Ctx) -> Tensor:
        """``call`` at unit level from its memo (:class:`_Memo`): the kept windows, then the
        later ones computed from the signal's tail over tokens ``[start, T)`` (its value 0
        past the prompt, as :func:`~.signals.pad_tokens` gives it). Stacked layers whose memos
        have the same shape (observed at the same length: the usual case) are evaluated in one
        pass over their memos stacked."""
        if c.stacked:
            ms = [self._memo[li].get(call) for li in c.layer]
            if None not in ms and len({(m.start, m.t_obs, m.units.shape[-1]) for m in ms}) == 1:
                units = torch.stack([m.units for m in ms])
                m = _Memo(units, torch.stack([m.tail for m in ms]), ms[0].start, ms[0].t_obs)
                return self._from_memo(call, m, c.layer, c)
        return c.each(lambda li, _cache: self._from_memo(call, self._memo[li].get(call), li, c))

    def _from_memo(self, call: Call, m: _Memo | None, layers, c: _Ctx) -> Tensor:
        """:meth:`_memoized` of one memo (one layer's, or stacked layers')."""
        if m is None:
            raise SignalError(
                f"the policy uses signal '{self._memos[call]}' but layer {layers} never "
                f"received it: pass Signals({self._memos[call]}=...) to observe() first"
            )
        W = c.layout.size
        assert c.n_tokens >= m.t_obs, (c.n_tokens, m.t_obs)
        if c.n_tokens == m.units.shape[-1] * W:  # no window after the kept ones
            return m.units.clone()
        # from a window boundary: zeros before the tail reach no later window's value
        first = m.start // W * W
        tail = F.pad(m.tail, (m.start - first, 0))
        n, bound = c.n_tokens - first, {self._memos[call]: tail}
        sub = _Ctx(layers, None, c.layout, False, n_tokens=n, bound=bound)
        later = self._call(call, sub)[..., m.units.shape[-1] - first // W :]
        return torch.cat([m.units, later], -1)

    def _buffer(self, node: Call, n: int, device) -> Tensor:
        buf = self._state.get(node)
        if buf is None or buf.shape[-1] < n:
            cap = n if buf is None else grown(buf.shape[-1], n)
            new = torch.zeros(self.n_layers, self.n_heads, cap, device=device)
            if buf is not None:
                new[..., : buf.shape[-1]] = buf
            buf = self._state[node] = new
        return buf

    def _cache(self, layer: int, cache: CacheState | None) -> CacheState:
        if cache is None and self._cache_fn is None:
            raise SignalError("ScoreEvaluator needs the layer's cache (pass cache=...)")
        return cache if cache is not None else self._cache_fn(layer)

    def _eval(self, e: Expr, c: _Ctx) -> Tensor:
        if isinstance(e, Num):
            return torch.full((), float(e.value), device=c.device)  # a fill: no host copy
        if isinstance(e, Name):
            if e.id in self._scores:
                return self._eval(self._scores[e.id], c)
            return self._name(e.id, c)
        if isinstance(e, BinOp):
            left, right = self._eval(e.left, c), self._eval(e.right, c)
            return _BIN[e.op](left, right)
        if isinstance(e, UnaryOp):
            x = self._eval(e.operand, c)
            return torch.logical_not(x) if e.op == "not" else -x
        assert isinstance(e, Call), e
        return self._call(e, c)

    def _name(self, name: str, c: _Ctx) -> Tensor:
        lay, t = c.layout, c.n_tokens
        if name == "head_dim":
            return torch.full((), float(c.head_dim), device=c.device)
        if name == "seq_len":
            return torch.full((), float(t), device=c.device)
        if not lay.over_tokens:
            if name == "qnorm":
                return c.each(lambda li, _: self._need(li, "qnorm"))
            if name == "knorm":
                return c.each(lambda _, cache: cache.knorm())
            if name == "sigma":
                return c.each(lambda _, cache: cache.channel_sigma())
            raise SignalError(f"signal '{name}' is per token; it has no value per K channel")
        if name in CHANNEL:
            raise SignalError(f"signal '{name}' is per K channel; it has no value per token")
        if name == "sigma":
            at = lay if not c.token_level else UnitLayout("token", 1, 0)
            return c.each(lambda _, cache: _unit_sigma(cache, at))
        if name in ("position", "recency"):
            if not c.token_level:
                first, last = lay.first_token(t, c.device), lay.last_token(t, c.device)
                return first.float() if name == "position" else (t - 1 - last).float()
            pos = torch.arange(t, device=c.device).float()
            return pos if name == "position" else t - 1 - pos
        if name == "key_norm":
            x = c.each(lambda _, cache: cache.key_norm())
        elif c.bound is not None and name in c.bound:  # a memo's run of tokens
            x = pad_tokens(c.bound[name], t)
        else:
            x = c.each(lambda li, _: pad_tokens(self._need(li, name), t))
        return x if c.token_level else lay.aggregate(x)

    def _need(self, layer: int, name: str) -> Tensor:
        x = self._observed[layer].get(name)
        if x is None:
            raise SignalError(
                f"the policy uses signal '{name}' but layer {layer} never received "
                f"it: pass Signals({name}=...) to observe() before routing"
            )
        return x

    def _call(self, e: Call, c: _Ctx) -> Tensor:
        fn, args = e.fn, e.args
        lay = c.layout
        if (
            e in self._memos
            and not c.token_level
            and c.bound is None
            and lay.over_tokens
            and (lay.size == self._unit.size)
        ):
            return self._memoized(e, c)
        if fn == "cumulative":
            return self._running(e, c)
        if fn in _HEADS:
            x = self._eval(args[0], c).float()
            x = torch.broadcast_to(x, c.shape(self.n_heads, x))
            if self._gather_heads is not None:
                x = self._gather_heads(x, -2)
            return getattr(x, _HEADS[fn])(-2, keepdim=True)
        if fn in _LAYERS:
            return self._over_layers(e, c)
        if fn in _WINDOW:
            x = self._tokens(args[0], c)
            u = c.layout.aggregate(x, _WINDOW[fn])
            return c.layout.expand(u, c.n_tokens) if c.token_level else u
        if fn == "pool_max":
            size = int(_const(e.kwarg("size", Num(7))))
            x = self._tokens(args[0], c)
            y = F.max_pool1d(x.reshape(-1, 1, x.shape[-1]), size, 1, size // 2)
            y = y[..., : x.shape[-1]].reshape(x.shape)
            return y if c.token_level else c.layout.aggregate(y)
        if fn == "quantile":
            x = self._eval(args[0], c).float()
            x = torch.broadcast_to(x, c.shape(self.n_heads, x))
            return torch.quantile(x, _const(args[1]), dim=-1, keepdim=True)
        vals = [self._eval(a, c) for a in args]
        if fn == "min":
            return torch.minimum(*vals)
        if fn == "max":
            return torch.maximum(*vals)
        if fn == "clip":
            return torch.maximum(torch.minimum(vals[0], vals[2]), vals[1])
        return _UNARY[fn](vals[0].float())

    def _over_layers(self, e: Call, c: _Ctx) -> Tensor:
        """``e``'s argument over every layer (they must hold the same tokens), reduced over
        the layers per KV head and broadcast to ``c``'s layers."""
        every = tuple(range(self.n_layers))
        if c.stacked and c.layer == every:
            whole = c
        else:
            own = dict(zip(c.layer, c.cache, strict=True)) if c.stacked else {c.layer: c.cache}
            caches = [own[li] if li in own else self._cache(li, None) for li in every]
            if len({x.n_tokens for x in caches}) != 1:
                raise SignalError(
                    f"{e.fn}() reduces over every layer, but the layers hold different numbers "
                    "of tokens (route after a step has reached every layer)"
                )
            whole = _Ctx(every, caches, c.layout, c.token_level)
        x = self._eval(e.args[0], whole).float()
        x = torch.broadcast_to(x, whole.shape(self.n_heads, x))
        out = getattr(x, _LAYERS[e.fn])(0)
        return out.expand(*c.lead, *out.shape) if c.stacked else out

    def _tokens(self, e: Expr, c: _Ctx) -> Tensor:
        x = self._eval(e, c.at_tokens()).float()
        return torch.broadcast_to(x, (*c.lead, self.n_heads, c.n_tokens))

    def _running(self, e: Call, c: _Ctx) -> Tensor:
        """The running state of ``e`` at ``c``'s layers: per token (summed per unit unless at
        token level), per unit (its grain, :func:`held_state`) or per channel."""
        lay, g = c.layout, self._grain[e]
        n = c.head_dim if not lay.over_tokens else c.n_tokens
        if lay.over_tokens and not c.token_level:
            n = lay.n_units(n) * lay.size  # zeros past the last token: whole windows, no pad
        if g > 1:  # kept per unit: read at unit level of units of g tokens only
            assert lay.over_tokens and not c.token_level and lay.size == g, (lay, g)
            n //= g
        buf = self._state.get(e)
        if buf is None:
            buf = torch.zeros(self.n_layers, self.n_heads, n, device=c.device)
        if c.stacked:
            first, last = c.layer[0], c.layer[-1]
            contiguous = c.layer == tuple(range(first, last + 1))
            buf = buf[first : last + 1] if contiguous else buf[list(c.layer)]
        else:
            buf = buf[c.layer]
        state = F.pad(buf, (0, n - buf.shape[-1])) if buf.shape[-1] < n else buf[..., :n]
        if g > 1 or not lay.over_tokens or c.token_level:
            return state
        return lay.aggregate(state)

    def _walk(self, e: Expr):
        for n in e.walk():
            yield n
            if isinstance(n, Name) and n.id in self._scores:
                yield from self._walk(self._scores[n.id])

    def _uses(self, e: Expr, names: tuple[str, ...]) -> bool:
        return any(isinstance(n, Name) and n.id in names for n in self._walk(e))


IMPLEMENTED_FUNCTIONS = frozenset(
    {
        "cumulative",
        "pool_max",
        "quantile",
        "min",
        "max",
        "clip",
        *_HEADS,
        *_LAYERS,
        *_WINDOW,
        *_UNARY,
    }
)
IMPLEMENTED_SIGNALS = frozenset({*ADDITIVE, *CHANNEL, "sigma", "recency", "position"})
IMPLEMENTED_CONSTANTS = frozenset({"head_dim", "seq_len"})


def _unit_sigma(cache: CacheState, lay: UnitLayout) -> Tensor:
    """``[H, U]``: standard deviation of each unit's V entries (kept tokens only)."""
    v = torch.nan_to_num(cache.v.float(), nan=0.0)
    w = cache.kept.float()
    t, d = v.shape[1], v.shape[2]
    n = lay.aggregate(w).clamp(min=1) * d
    mean = lay.aggregate(v.sum(-1) * w) / n
    dev = ((v - lay.expand(mean, t)[..., None]) ** 2).sum(-1) * w
    return (lay.aggregate(dev) / n).sqrt()


def _reach(call: Call) -> tuple[int, int]:
    """Tokens before and after a token whose value a token-level function reads: ``pool_max``'s
    window, none for ``*_window`` (it reads the unit's own tokens)."""
    if call.fn != "pool_max":
        return 0, 0
    size = int(_const(call.kwarg("size", Num(7))))
    return size // 2, size - 1 - size // 2


def _advance(state: Tensor, decay: float, x: Tensor) -> None:
    """``state = decay * state + x`` in place (no multiply at decay 1: the same values)."""
    if decay != 1.0:
        state.mul_(decay)
    state.add_(x)


def _const(e: Expr) -> float:
    """Fold a constant expression (numbers and arithmetic) to a float."""
    if isinstance(e, Num):
        return float(e.value)
    if isinstance(e, UnaryOp) and e.op == "-":
        return -_const(e.operand)
    if isinstance(e, BinOp) and e.op in ("+", "-", "*", "/", "^"):
        return float(_BIN[e.op](torch.tensor(_const(e.left)), torch.tensor(_const(e.right))))
    raise SignalError("this argument must be a number (e.g. decay=0.99, size=7, 50%)")
