"""The launch's policies: ``--kv-policy`` (the default) and ``--kv-policies`` (more that a request
may name with ``kv_policy``), all served from one pool.

One pool stores every request's windows, whatever policy routes them, so the policies of a
launch must agree on what the pool stores (:func:`pool_shape`): the window, the ledger codec
(bits, V group, K per channel over the window), write-once or not, and where the quantized and
evicted tiers sit among the engine's tiers (a holder's next state is read from them; a policy may
lack the last ones, e.g. never evict). Scores,
shares, protection, schedule and budget may differ. A decoupled policy (RDKV's K channels and V
tokens) repacks each routed request's K/V into private Zone A pages (:mod:`.zones`), a pool of
another kind. A set that does not agree is refused when the launch is built
(:class:`CatalogError`, with each difference), before the model loads.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from tiered_radix.policy import Policy, load_policy

from .reps import Layout


class CatalogError(ValueError):
    """``--kv-policies`` names a policy the launch's pool cannot serve, or a name twice."""


@dataclass(frozen=True)
class Catalog:
    """The policies of one launch by name (their ``policy:`` field); ``default`` serves
    requests that name none."""

    default: Policy
    by_name: tuple[tuple[str, Policy], ...]  # the default first, then in --kv-policies order

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.by_name)

    @property
    def policies(self) -> tuple[Policy, ...]:
        return tuple(p for _, p in self.by_name)

    def get(self, name: str) -> Policy | None:
        return dict(self.by_name).get(name)

    def suggest(self, name: str) -> str | None:
        """The loaded name closest to ``name``, if one is close."""
        close = difflib.get_close_matches(name, self.names, n=1)
        return close[0] if close else None


def entries(arg: str | None) -> list[str]:
    """``--kv-policies``' items: comma-separated shipped names or YAML files; a folder stands
    for every ``*.yaml`` in it, in name order."""
    out = []
    for item in (arg or "").split(","):
        item = item.strip()
        if not item:
            continue
        path = Path(item)
        out += sorted(str(p) for p in path.glob("*.yaml")) if path.is_dir() else [item]
    return out


def load(default: Policy, arg: str | None) -> Catalog:
    """The default policy and those ``--kv-policies`` names (``arg``), checked together.

    Raises:
        PolicyError: one of the files is not a valid policy (file:line:col).
        CatalogError: a policy whose pool differs from the default's (each difference named),
            or two different policies of one name.
    """
    by_name = {default.name: default}
    for item in entries(arg):
        policy = load_policy(item)
        known = by_name.get(policy.name)
        if known is not None and known != policy:
            raise CatalogError(
                f"--kv-policies: two different policies are named '{policy.name}' ({item} and "
                "another); a request names a policy by its `policy:` field, which must be unique"
            )
        diff = differences(default, policy)
        if diff:
            raise CatalogError(
                f"--kv-policies: '{policy.name}' ({item}) cannot share the pool of --kv-policy "
                f"'{default.name}': {'; '.join(diff)}. Policies served together must store "
                "windows alike; launch another server for it"
            )
        by_name[policy.name] = policy
    return Catalog(default, tuple(by_name.items()))


def pool_shape(policy: Policy) -> dict[str, object]:
    """What a pool stores for ``policy``: equal for policies one pool can serve."""
    if not policy.coupled:
        return {"pool": "Zone A pages per routed request (separate K and V units)"}
    lay = Layout.of(policy)
    codec = "none"
    if lay.quant is not None:
        codec = f"INT{lay.quant.bits}, V groups of {lay.v_group}"
    shape = {
        "pool": "shared windows (one `units:` granularity)",
        "window": lay.window,
        "ledger codec": codec,
        "ledger": "none" if lay.quant is None else "write-once" if lay.write_once else "rewritten",
        "tiers": _tier_kinds(lay),
    }
    if lay.evict_index is not None:  # the pool archives evictions for every request, or none
        shape["evicted windows"] = "archived (ledger copy kept)" if lay.archive else "dropped"
    return shape


def _tier_kinds(lay: Layout) -> str:
    """The engine's tiers as kinds (full / quantized / evicted), in order."""
    kinds = []
    for i in range(len(lay.engine_tiers)):
        if i == lay.quant_index:
            kinds.append("quantized")
        elif i == lay.evict_index:
            kinds.append("evicted")
        else:
            kinds.append("full")
    return "/".join(kinds)


def differences(a: Policy, b: Policy) -> list[str]:
    """``"window 32 vs 1"``-style notes for every way ``b``'s pool differs from ``a``'s. ``b``'s
    tiers may stop short of ``a``'s (``full/quantized`` in a ``full/quantized/evicted`` pool:
    it never evicts); every tier it has must sit where ``a``'s of that kind does."""
    sa, sb = pool_shape(a), pool_shape(b)
    if sa["pool"] != sb["pool"]:
        return [f"pool {sa['pool']} vs {sb['pool']}"]
    out = [
        f"{k} {sa[k]} vs {sb[k]}" for k in sa if k != "tiers" and k in sb and sa[k] != sb[k]
    ]  # a policy that never evicts has no "evicted windows"
    if "tiers" in sa and not (sa["tiers"] + "/").startswith(sb["tiers"] + "/"):
        out.append(f"tiers {sa['tiers']} vs {sb['tiers']}")
    return out
