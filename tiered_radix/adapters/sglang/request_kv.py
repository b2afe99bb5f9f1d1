"""A request's own KV policy and budget: ``kv_policy`` and ``kv_budget``.

Where a request carries them (docs/sglang.md, *Per-request budgets*):

- OpenAI API: top-level fields (the client's ``extra_body={"kv_budget": "25%"}``) or inside
  ``custom_params``;
- SGLang's native API and ``sglang.Engine.generate``: ``sampling_params={"kv_budget": ...}``
  or ``sampling_params={"custom_params": {"kv_budget": ...}}``; ``Engine.generate`` also takes
  ``kv_budget=`` / ``kv_policy=``.

The plugin moves them all into ``SamplingParams.custom_params`` (:func:`into_custom`), which
SGLang carries to the scheduler's ``Req``; it checks them where SGLang checks sampling
parameters (:func:`resolve` raises :class:`RequestError`, a ``ValueError``: SGLang answers 400
with the message). In the scheduler the radix cache reads them from the ``Req`` when it matches
the request's prefix, and the attention backend builds the request's tier engine with them.

``kv_policy`` names a policy loaded at launch (``--kv-policy`` or ``--kv-policies``, by its
``policy:`` field); ``kv_budget`` uses the policy file's budget syntax (``25%``, ``2 GiB``,
``8192 tokens``). Absent, they are the launch's: the default policy, and ``--kv-budget`` if
given, else the policy's own budget.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tiered_radix.policy import Policy, PolicyError, Span
from tiered_radix.policy.model import Budget
from tiered_radix.policy.transformer import parse

from .config import KVConfig

BUDGET, POLICY = "kv_budget", "kv_policy"
KEYS = (BUDGET, POLICY)
BUDGET_FORMS = (
    "a percentage of the full-precision KV bytes ('25%'), a byte count ('2 GiB'; B, KB, MB, GB, "
    "KiB, MiB, GiB) or a token count ('8192 tokens')"
)


class RequestError(ValueError):
    """A request's ``kv_budget`` or ``kv_policy`` that the server cannot serve; the message
    names what it accepts."""


@dataclass(frozen=True)
class RequestKV:
    """The policy and budget one request's tier engine runs with."""

    policy: Policy
    budget: Budget
    asked: bool  # the request named a policy or a budget (else the launch's defaults)

    def describe(self) -> dict[str, str]:
        return {"policy": self.policy.name, "budget": _budget_text(self.budget)}


def _budget_text(b: Budget) -> str:
    if b.kind == "fraction":
        return f"{b.value * 100:g}%"
    if b.kind == "bytes":
        return f"{b.value:.0f} B"
    return f"{b.value:.0f} tokens"


def parse_budget(value: object) -> Budget:
    """``kv_budget`` -> :class:`Budget`.

    Raises:
        RequestError: not a string in the budget syntax (the message names the forms).
    """
    if not isinstance(value, str):
        raise RequestError(f"kv_budget {value!r} must be a string: {BUDGET_FORMS}")
    text = value.strip()
    try:
        return parse(text, "budget", Span("kv_budget", 1, 1, text))
    except PolicyError as err:
        problem = str(err).splitlines()[0].split(": ", 1)[-1]
        raise RequestError(f"kv_budget {value!r}: {problem}; use {BUDGET_FORMS}") from None


def resolve(params: Mapping | None, cfg: KVConfig) -> RequestKV:
    """The policy and budget of a request whose ``custom_params`` are ``params``.

    Raises:
        RequestError: ``kv_policy`` is not a loaded policy's name (the message lists them), or
            ``kv_budget`` is malformed.
    """
    params = params or {}
    catalog = cfg.served()
    name = params.get(POLICY)
    policy = cfg.policy
    if name is not None:
        policy = catalog.get(name) if isinstance(name, str) else None
        if policy is None:
            hint = catalog.suggest(name) if isinstance(name, str) else None
            raise RequestError(
                f"kv_policy {name!r} is not loaded on this server; it serves "
                f"{', '.join(repr(n) for n in catalog.names)}"
                + (f" (did you mean {hint!r}?)" if hint else "")
                + "; launch with --kv-policies to load more"
            )
    given = params.get(BUDGET)
    budget = parse_budget(given) if given is not None else cfg.budget_for(policy)
    return RequestKV(policy, budget, name is not None or given is not None)


def into_custom(sampling: Mapping | None, extra: Mapping | None = None) -> dict | None:
    """``sampling`` (a sampling-parameter dict) with ``kv_budget`` / ``kv_policy`` found at its
    top level or in ``extra`` (an OpenAI request's extra fields, an Engine call's keywords)
    moved into its ``custom_params``; an explicit ``custom_params`` value wins. ``None`` when
    there is nothing to move (``sampling`` is then used as it is)."""
    found = {k: v for src in (extra or {}, sampling or {}) for k, v in src.items()
             if k in KEYS and v is not None}  # fmt: skip
    if not found:
        return None
    out = {k: v for k, v in (sampling or {}).items() if k not in KEYS}
    out["custom_params"] = found | dict(out.get("custom_params") or {})
    return out
