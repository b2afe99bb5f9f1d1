"""From a policy file's YAML tree to a validated :class:`Policy`.

Each top-level key has one method here; the values inside are parsed by the grammar
(:mod:`.transformer`). Every check raises :class:`PolicyError` at the offending spot.
"""

from __future__ import annotations

import re
from pathlib import Path

from .errors import PolicyError, Span, did_you_mean, one_of
from .expr import Call, Expr, Name, Num, is_condition
from .model import (
    Demote,
    Evict,
    Granularity,
    Keep,
    Ledger,
    Policy,
    Promote,
    Protect,
    Quantize,
    RankAllocation,
    RateDistortion,
    Rule,
    Schedule,
    Spread,
    Tier,
)
from .source import Map, Node, Scalar, Seq, extend, load_with_extends, resolve, tree_from_text
from .transformer import parse
from .vocabulary import CONSTANTS, FUNCTIONS, SIGNALS

TOP_KEYS = (
    "policy",
    "description",
    "extends",
    "budget",
    "spread",
    "units",
    "protect",
    "scores",
    "tiers",
    "rules",
    "allocate",
    "schedule",
    "ledger",
)
CHANNEL_SIGNALS = frozenset({"qnorm", "knorm"})
RD_BITS = (0, 2, 4, 8, 16)


def load_policy(path: str | Path) -> Policy:
    """Read, merge (``extends``) and compile a policy file or a shipped policy's name.

    Raises:
        PolicyError: anything wrong with the file, with ``file:line:col`` and a suggestion.
    """
    file = resolve(path)
    return Compiler(str(file)).compile(load_with_extends(file))


def compile_text(text: str, name: str = "<policy>") -> Policy:
    """Compile policy YAML given as a string; ``extends`` resolves from the working directory."""
    return Compiler(name).compile(extend(tree_from_text(text, name), Path.cwd() / name))


class Compiler:
    def __init__(self, file: str) -> None:
        self.file = file

    def compile(self, root: Map) -> Policy:
        _check_keys(root, TOP_KEYS, "a policy file")
        for required in ("budget", "units", "allocate"):
            if root.get(required) is None:
                raise PolicyError(
                    f"missing required key `{required}`",
                    root.span,
                    expected=f"a top-level `{required}:` entry",
                )
        units = self.units(root.get("units"))
        scores = self.scores(root.get("scores"))
        names = _signals_by_score(scores)
        allocate_node = _need_map(root.get("allocate"), "allocate")
        method = _scalar(allocate_node.get("method"), "allocate.method", allocate_node.span)
        if method.text == "rank":
            tiers = self.tiers(root.get("tiers"), root.span)
            allocate = self.rank(allocate_node, tiers, names, units)
        elif method.text == "rate_distortion":
            if root.get("tiers") is not None:
                raise PolicyError(
                    "`tiers:` conflicts with rate_distortion allocation",
                    next(s for k, s, _ in root.entries if k == "tiers"),
                    suggestion="rate_distortion derives its tiers from "
                    "`allocate.bits`; remove `tiers:`",
                )
            allocate = self.rate_distortion(allocate_node, names, units)
            tiers = _rd_tiers(allocate)
        else:
            raise PolicyError(
                f"unknown allocation method '{method.text}'",
                method.span,
                expected=one_of(("rank", "rate_distortion")),
                suggestion=did_you_mean(method.text, ("rank", "rate_distortion")),
            )
        ledger = self.ledger(root.get("ledger"), tiers)
        policy = Policy(
            name=self.text(root.get("policy"), "policy") or Path(self.file).stem,
            description=" ".join(self.text(root.get("description"), "description").split()),
            source=self.file,
            budget=self.value(root.get("budget"), "budget"),
            spread=self.spread(root.get("spread"), names, units),
            k=units[0],
            v=units[1],
            protect=self.protect(root.get("protect")),
            scores=scores,
            tiers=tiers,
            rules=self.rules(root.get("rules"), names, units, tiers),
            allocate=allocate,
            schedule=self.schedule(root.get("schedule")),
            ledger=ledger,
        )
        _check_layer_reductions(policy, root.span)
        return policy

    # -- helpers -----------------------------------------------------------------------
    def text(self, node: Node | None, where: str) -> str:
        return "" if node is None else _scalar(node, where, None).text

    def value(self, node: Node, start: str):
        s = _scalar(node, start, None)
        return parse(s.text, start, s.span)

    def expr(
        self,
        node: Node,
        where: str,
        names: dict[str, set[str]],
        part: Granularity | None,
        condition: bool = False,
    ) -> Expr:
        e = self.value(node, "expr")
        e = Num(e) if isinstance(e, int | float) else e
        _check_expr(e, names, part, node.span)
        if condition != is_condition(e):
            want = (
                "a condition such as `score < quantile(score, 50%)`"
                if condition
                else "a number-valued expression, not a comparison"
            )
            raise PolicyError(f"`{where}` must be {want}", node.span)
        return e

    def integer(self, node: Node | None, where: str, default: int, low: int = 0) -> int:
        if node is None:
            return default
        s = _scalar(node, where, None)
        if not re.fullmatch(r"-?[0-9]{1,18}", s.text.strip()) or int(s.text) < low:
            raise PolicyError(
                f"`{where}` must be an integer >= {low}, got '{s.text}'",
                s.span,
                expected="decimal digits (at most 18), e.g. 4",
            )
        return int(s.text)

    def fraction(self, node: Node | None, where: str, default: float) -> float:
        if node is None:
            return default
        e = self.value(node, "expr")
        value = e if isinstance(e, int | float) else getattr(e, "value", None)
        if not isinstance(e, int | float | Num) or not 0 <= value <= 1:
            raise PolicyError(
                f"`{where}` must be a fraction in [0, 1] such as 50% or 0.5", node.span
            )
        return float(value)

    # -- one method per key --------------------------------------------------------------
    def units(self, node: Node) -> tuple[Granularity, Granularity]:
        if isinstance(node, Scalar):
            g = self.value(node, "granularity")
            return g, g
        node = _need_map(node, "units")
        _check_keys(node, ("k", "v"), "units")
        for part in ("k", "v"):
            if node.get(part) is None:
                raise PolicyError(
                    f"`units` needs `{part}:`",
                    node.span,
                    expected="units: {k: window(size=32), v: window(size=32)}",
                )
        k, v = (self.value(node.get(p), "granularity") for p in ("k", "v"))
        if v.kind == "channel":
            raise PolicyError(
                "V has no channel granularity",
                node.get("v").span,
                expected="window(size=N) or token",
                suggestion="channel units exist for K only (RDKV)",
            )
        return k, v

    def scores(self, node: Node | None) -> tuple[tuple[str, Expr], ...]:
        if node is None:
            return ()
        node = _need_map(node, "scores")
        out: list[tuple[str, Expr]] = []
        for name, span, value in node.entries:
            if name in SIGNALS or name in CONSTANTS or name in FUNCTIONS:
                raise PolicyError(
                    f"score name '{name}' shadows a built-in name",
                    span,
                    suggestion="pick another name, e.g. 'my_" + name + "'",
                )
            out.append((name, self.expr(value, f"scores.{name}", _signals_by_score(out), None)))
        return tuple(out)

    def tiers(self, node: Node | None, where: Span) -> tuple[Tier, ...]:
        if node is None:
            raise PolicyError(
                "rank allocation needs `tiers:`",
                where,
                expected="tiers: {full: keep(bf16), int2: quantize(bits=2), gone: evict}",
            )
        node = _need_map(node, "tiers")
        if not node.entries:
            raise PolicyError(
                "`tiers:` lists no tiers",
                node.span,
                expected="tiers: {full: keep(bf16), int2: quantize(bits=2), gone: evict}",
            )
        tiers = []
        for name, _, value in node.entries:
            action = self.value(value, "action")
            if isinstance(action, Promote | Demote):
                raise PolicyError(
                    f"tier '{name}' has a rule action",
                    value.span,
                    expected="keep, quantize(...) or evict",
                    suggestion="promote/demote belong in `rules:`",
                )
            tiers.append(Tier(name, action))
        for (name, span, _), tier in zip(node.entries[:-1], tiers[:-1], strict=True):
            if isinstance(tier.action, Evict):
                raise PolicyError(
                    f"tier '{name}' evicts but is not the last tier",
                    span,
                    suggestion="list tiers best first, `evict` last",
                )
        if all(isinstance(t.action, Evict) for t in tiers):
            raise PolicyError("every tier evicts: nothing would be kept", node.span)
        self.archive(tiers[-1].action, node.entries[-1][2].span, tiers)
        return tuple(tiers)

    def archive(self, action, span: Span, tiers: list[Tier]) -> None:
        """``evict(archive=T)``: ``T`` names a quantized tier of the policy."""
        if not isinstance(action, Evict) or action.archive is None:
            return
        quantized = [t.name for t in tiers if isinstance(t.action, Quantize)]
        if action.archive not in quantized:
            raise PolicyError(
                f"evict(archive={action.archive}): no quantized tier '{action.archive}'",
                span,
                expected=one_of(quantized) if quantized else "a quantize(...) tier to archive at",
                suggestion=did_you_mean(action.archive, quantized),
            )

    def rank(
        self,
        node: Map,
        tiers: tuple[Tier, ...],
        names: dict[str, set[str]],
        units: tuple[Granularity, Granularity],
    ) -> RankAllocation:
        _check_keys(node, ("method", "by", "shares", "hysteresis"), "allocate (rank)")
        if units[0] != units[1]:
            raise PolicyError(
                "rank allocation needs K and V to share units",
                node.span,
                suggestion="give `units.k` and `units.v` the same granularity, "
                "or use `method: rate_distortion`",
            )
        if node.get("by") is None:
            raise PolicyError(
                "rank allocation needs `by:`",
                node.span,
                expected="by: score (an expression to rank units by)",
            )
        kept = [t.name for t in tiers if not isinstance(t.action, Evict)]
        by, by_tier = self.rankings(node.get("by"), kept, names, units[1])
        shares = dict.fromkeys(kept, None)
        share_node = node.get("shares")
        if share_node is not None:
            share_node = _need_map(share_node, "allocate.shares")
            for name, value in _tier_entries(share_node, kept):
                shares[name] = self.fraction(value, f"allocate.shares.{name}", 0.0)
        given = sum(v for v in shares.values() if v is not None)
        if given > 1 + 1e-9:
            raise PolicyError(
                f"tier shares add up to {given:.0%}, more than the budget",
                share_node.span,
                expected="shares summing to at most 100%",
            )
        missing = [n for n, v in shares.items() if v is None]
        rest = (1 - given) / len(missing) if missing else 0.0
        hysteresis = self.fraction(node.get("hysteresis"), "allocate.hysteresis", 0.0)
        return RankAllocation(
            by, tuple(rest if v is None else v for v in shares.values()), hysteresis, by_tier
        )

    def rankings(
        self, node: Node, kept: list[str], names: dict[str, set[str]], part: Granularity
    ) -> tuple[Expr, tuple[Expr, ...]]:
        """``allocate.by``: one expression ranking units for every kept tier, or a mapping
        naming each kept tier's own ranking (``by: {full: score, int2: mean_layers(score)}``):
        ``(by, by_tier)``, ``by`` the best tier's and ``by_tier`` empty for one expression."""
        if not isinstance(node, Map):
            return self.expr(node, "allocate.by", names, part), ()
        given = {
            name: self.expr(value, f"allocate.by.{name}", names, part)
            for name, value in _tier_entries(node, kept)
        }
        missing = [n for n in kept if n not in given]
        if missing:
            raise PolicyError(
                f"`allocate.by` ranks tiers one by one but names no ranking for "
                f"{', '.join(repr(n) for n in missing)}",
                node.span,
                expected="a ranking for every kept tier, e.g. "
                + "{"
                + ", ".join(f"{n}: score" for n in kept)
                + "}",
            )
        order = tuple(given[n] for n in kept)
        return order[0], order

    def rate_distortion(
        self, node: Map, names: dict[str, set[str]], units: tuple[Granularity, Granularity]
    ) -> RateDistortion:
        keys = ("method", "bits", "v_weight", "k_weight", "sigma", "v_share", "group")
        _check_keys(node, keys, "allocate (rate_distortion)")
        bits_node = node.get("bits")
        bits = self.bitset(bits_node) if bits_node else RD_BITS
        bad = sorted(set(bits) - set(RD_BITS))
        if bad or len(set(bits)) != len(bits) or len(bits) < 2:
            shown = "{" + ", ".join(map(str, bits)) + "}"
            raise PolicyError(
                f"invalid bit set {shown}" + (f": {bad[0]} bits is not a width" if bad else ""),
                bits_node.span,
                expected="at least two distinct widths from {0, 2, 4, 8, 16}",
            )
        for key in ("v_weight", "sigma"):
            if node.get(key) is None:
                raise PolicyError(f"rate_distortion needs `{key}:`", node.span)
        coupled = units[0] == units[1]
        if coupled and node.get("k_weight") is not None:
            raise PolicyError(
                "`k_weight` conflicts with shared K/V units",
                node.get("k_weight").span,
                suggestion="with one unit for K and V, `v_weight` weighs both; "
                "give K its own granularity (e.g. channel) to weigh it separately",
            )
        if not coupled and node.get("k_weight") is None:
            raise PolicyError(
                "rate_distortion with separate K units needs `k_weight:`",
                node.span,
                expected="k_weight: qnorm * knorm / sqrt(head_dim)",
            )
        v_weight = self.expr(node.get("v_weight"), "allocate.v_weight", names, units[1])
        k_weight = (
            v_weight
            if coupled
            else self.expr(node.get("k_weight"), "allocate.k_weight", names, units[0])
        )
        return RateDistortion(
            bits=tuple(sorted(bits, reverse=True)),
            v_weight=v_weight,
            k_weight=k_weight,
            sigma=self.expr(node.get("sigma"), "allocate.sigma", names, None),
            v_share=self.fraction(node.get("v_share"), "allocate.v_share", 0.5),
            group=self.integer(node.get("group"), "allocate.group", 32, low=1),
        )

    def bitset(self, node: Node) -> tuple[int, ...]:
        """``[0, 2, 4]``, YAML's set form ``{0, 2, 4}``, or the same quoted as one string."""
        if isinstance(node, Scalar):
            return self.value(node, "bitset")
        items = (
            node.items
            if isinstance(node, Seq)
            else [
                Scalar(k, s) if isinstance(v, Scalar) and v.text in ("", "null", "~") else v
                for k, s, v in node.entries
            ]
        )
        return tuple(self.integer(i, "allocate.bits[]", 0) for i in items)

    def spread(self, node: Node | None, names: dict[str, set[str]], units) -> Spread:
        if node is None:
            return Spread("uniform")
        spread = self.value(node, "spread")
        if spread.by is not None:
            _check_expr(spread.by, names, units[1], node.span)
        return spread

    def protect(self, node: Node | None) -> Protect:
        if node is None:
            return Protect()
        node = _need_map(node, "protect")
        _check_keys(node, ("sinks", "recent"), "protect")
        return Protect(
            self.integer(node.get("sinks"), "protect.sinks", 0),
            self.integer(node.get("recent"), "protect.recent", 0),
        )

    def rules(
        self, node: Node | None, names: dict[str, set[str]], units, tiers
    ) -> tuple[Rule, ...]:
        if node is None:
            return ()
        if not isinstance(node, Seq):
            raise PolicyError(
                "`rules` must be a list",
                node.span,
                expected="- {when: CONDITION, then: promote|demote|keep|evict}",
            )
        rules = []
        for item in node.items:
            item = _need_map(item, "a rule")
            _check_keys(item, ("when", "then"), "a rule")
            if item.get("when") is None or item.get("then") is None:
                raise PolicyError("a rule needs `when:` and `then:`", item.span)
            when = self.expr(item.get("when"), "rules[].when", names, units[1], condition=True)
            then = self.value(item.get("then"), "action")
            if isinstance(then, Quantize):
                raise PolicyError(
                    "a rule moves units between tiers",
                    item.get("then").span,
                    expected="promote, demote, keep or evict",
                    suggestion="declare quantized formats in `tiers:`",
                )
            if isinstance(then, Evict) and then.archive is not None:
                raise PolicyError(
                    "a rule's `evict` takes no archive",
                    item.get("then").span,
                    suggestion="archive in the evicting tier: `tiers: {..., gone: "
                    f"evict(archive={then.archive})}}`",
                )
            if isinstance(then, Demote) and not any(isinstance(t.action, Quantize) for t in tiers):
                raise PolicyError(
                    "`demote` needs a quantized tier to demote to", item.get("then").span
                )
            rules.append(Rule(when, then, item.span))
        return tuple(rules)

    def schedule(self, node: Node | None) -> Schedule:
        return Schedule() if node is None else self.value(node, "schedule")

    def ledger(self, node: Node | None, tiers: tuple[Tier, ...]) -> Ledger:
        if node is None:
            return Ledger()
        s = _scalar(node, "ledger", None)
        if s.text not in ("write_once", "none"):
            raise PolicyError(
                f"unknown ledger mode '{s.text}'",
                s.span,
                expected="write_once or none",
                suggestion=did_you_mean(s.text, ("write_once", "none")),
            )
        if s.text == "write_once" and not any(isinstance(t.action, Quantize) for t in tiers):
            raise PolicyError(
                "a write_once ledger needs a quantized tier to record",
                s.span,
                suggestion="add a `quantize(...)` tier or set `ledger: none`",
            )
        return Ledger(write_once=s.text == "write_once")


def _rd_tiers(rd: RateDistortion) -> tuple[Tier, ...]:
    def action(b: int):
        return Keep() if b == 16 else Evict() if b == 0 else Quantize(b, rd.group)

    return tuple(Tier(f"b{b}", action(b)) for b in rd.bits)


def _scalar(node: Node | None, where: str, parent: Span | None) -> Scalar:
    if node is None:
        raise PolicyError(f"missing `{where}`", parent)
    if not isinstance(node, Scalar):
        raise PolicyError(
            f"`{where}` must be a single value, not a "
            f"{'list' if isinstance(node, Seq) else 'mapping'}",
            node.span,
        )
    return node


def _tier_entries(node: Map, kept: list[str]):
    """``(name, value)`` of each entry of ``node``, every name one of the ``kept`` tiers (else a
    :class:`PolicyError` at the entry)."""
    for name, span, value in node.entries:
        if name not in kept:
            raise _unknown(f"no tier named '{name}'", name, span, kept)
        yield name, value


def _unknown(message: str, name: str, span: Span, known) -> PolicyError:
    """The error for a ``name`` that is none of ``known``: where, which are, the nearest."""
    return PolicyError(message, span, expected=one_of(known), suggestion=did_you_mean(name, known))


def _need_map(node: Node, where: str) -> Map:
    if not isinstance(node, Map):
        raise PolicyError(f"`{where}` must be a mapping (key: value lines)", node.span)
    return node


def _check_keys(node: Map, allowed: tuple[str, ...], where: str) -> None:
    for key, span, _ in node.entries:
        if key not in allowed:
            raise _unknown(f"unknown key '{key}' in {where}", key, span, allowed)


def _check_expr(
    e: Expr, scores: dict[str, set[str]], part: Granularity | None, where: Span
) -> None:
    """Names exist, calls have the right arity, channel signals only on channel units."""
    known = set(SIGNALS) | set(CONSTANTS) | set(scores)
    for node in e.walk():
        span = node.span or where
        if isinstance(node, Name) and node.id not in known:
            raise PolicyError(
                f"unknown name '{node.id}'",
                span,
                expected="a signal (" + ", ".join(SIGNALS) + "), a constant or a "
                "score defined above",
                suggestion=did_you_mean(node.id, known),
            )
        used: set[str] = set()
        if isinstance(node, Name) and part is not None:
            used = {node.id} if node.id in SIGNALS else scores.get(node.id, set())
        for signal in sorted(used):
            if (signal in CHANNEL_SIGNALS) != (part.kind == "channel"):
                unit = "channel" if part.kind == "channel" else "token/window"
                via = "" if signal == node.id else f" (used by score '{node.id}')"
                raise PolicyError(
                    f"signal '{signal}'{via} does not apply to {unit} units",
                    span,
                    suggestion="qnorm and knorm are per K channel; the other signals are per token",
                )
        if isinstance(node, Call):
            fn = FUNCTIONS.get(node.fn)
            if fn is None:
                raise PolicyError(
                    f"unknown function '{node.fn}'",
                    span,
                    expected=one_of(FUNCTIONS),
                    suggestion=did_you_mean(node.fn, FUNCTIONS),
                )
            if not fn.min_args <= len(node.args) <= fn.max_args:
                n = fn.min_args if fn.min_args == fn.max_args else f"{fn.min_args} to {fn.max_args}"
                raise PolicyError(
                    f"{node.fn}() takes {n} positional argument(s), got {len(node.args)}",
                    span,
                    expected=fn.doc,
                )
            for key, _ in node.kwargs:
                if key not in fn.kwargs:
                    raise PolicyError(
                        f"{node.fn}() has no argument '{key}'",
                        span,
                        expected=one_of(fn.kwargs) if fn.kwargs else "no keyword arguments",
                        suggestion=did_you_mean(key, fn.kwargs),
                    )


LAYER_REDUCTIONS = frozenset({"sum_layers", "mean_layers", "max_layers"})


def _check_layer_reductions(p: Policy, where: Span) -> None:
    """No ``*_layers`` call inside ``cumulative(...)``, directly or through a score: a running
    state advances one layer at a time as each layer's attention arrives, when the other layers'
    values of that step do not exist yet (reduce the running state instead:
    ``mean_layers(cumulative(attn))``)."""
    scores = dict(p.scores)

    def calls(e: Expr, seen: frozenset[str] = frozenset()):
        for n in e.walk():
            yield n
            if isinstance(n, Name) and n.id in scores and n.id not in seen:
                yield from calls(scores[n.id], seen | {n.id})

    for e in p.expressions():
        for run in (n for n in calls(e) if isinstance(n, Call) and n.fn == "cumulative"):
            inner = next(
                (n for n in calls(run.args[0]) if isinstance(n, Call) and n.fn in LAYER_REDUCTIONS),
                None,
            )
            if inner is not None:
                raise PolicyError(
                    f"{inner.fn}() inside cumulative(): the running state advances one layer "
                    "at a time, before the other layers of the step are seen",
                    inner.span or run.span or where,
                    suggestion=f"reduce the running state instead: {inner.fn}(cumulative(...))",
                )


def _signals_by_score(scores) -> dict[str, set[str]]:
    """Each score's name to the signals it reads, through the scores it uses."""
    out: dict[str, set[str]] = {}
    for name, e in scores:
        ids = {n.id for n in e.walk() if isinstance(n, Name)}
        out[name] = (ids & set(SIGNALS)).union(*(out.get(i, set()) for i in ids))
    return out
