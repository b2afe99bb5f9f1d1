"""``--kv-policy`` / ``--kv-budget`` / ``--kv-policies`` and the ``--kv-*`` options: parsing,
validation, and the hand-over to scheduler processes.

SGLang drops unknown attributes in ``ServerArgs.from_cli_args`` and starts its scheduler
processes with ``spawn``, so the plugin carries the launch's :class:`KVConfig` (policy argument,
budget argument, :class:`~.options.KVOptions`) as one JSON value in the environment variable
:data:`ENV`, which the children inherit. This is the only module that reads or writes it; each
process loads the policy once (:func:`current` caches it).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from tiered_radix.policy import Policy, PolicyError, Span, load_policy
from tiered_radix.policy.model import Budget
from tiered_radix.policy.transformer import parse

from .catalog import Catalog, load
from .options import KVOptions

ENV = "TIERED_RADIX_KV"  # the whole launch configuration, JSON (not a switch of its own)
BACKEND = "tiered"  # the --radix-cache-backend name the plugin registers


@dataclass(frozen=True)
class KVConfig:
    """A validated ``--kv-policy`` (file path or shipped name), optional budget override, the
    launch's ``--kv-*`` options, and ``--kv-policies`` (more policies a request may name,
    :mod:`.catalog`)."""

    policy_arg: str
    budget_arg: str | None
    policy: Policy
    budget: Budget  # the override if given, else the policy's own
    options: KVOptions = field(default_factory=KVOptions)
    policies_arg: str | None = None
    catalog: Catalog | None = None  # None: the default policy alone

    def served(self) -> Catalog:
        """Every policy a request may name, the default first."""
        return self.catalog or Catalog(self.policy, ((self.policy.name, self.policy),))

    def budget_for(self, policy: Policy) -> Budget:
        """A request's budget when it names none: ``--kv-budget`` if given, else the policy's."""
        return self.budget if self.overridden else policy.budget

    @property
    def overridden(self) -> bool:
        return self.budget_arg is not None


def parse_budget(text: str) -> Budget:
    """``"10%"``, ``"2 GiB"``, ``"4096 tokens"`` -> :class:`Budget` (the policy file's syntax).

    Raises:
        PolicyError: at ``--kv-budget:1:col`` with what was expected.
    """
    return parse(text.strip(), "budget", Span("--kv-budget", 1, 1, text.strip()))


def resolve(
    policy_arg: str,
    budget_arg: str | None = None,
    options: KVOptions | None = None,
    policies_arg: str | None = None,
) -> KVConfig:
    """Load and validate the policy (and budget override) the user named, and the policies of
    ``--kv-policies``.

    Raises:
        PolicyError: a policy file or the budget is invalid (message has file:line:col).
        CatalogError: ``--kv-policies`` names a policy the default's pool cannot serve.
    """
    policy = load_policy(policy_arg)
    budget = parse_budget(budget_arg) if budget_arg is not None else policy.budget
    catalog = load(policy, policies_arg) if policies_arg else None
    opts = options or KVOptions()
    return KVConfig(policy_arg, budget_arg, policy, budget, opts, policies_arg, catalog)


_current: tuple[str, KVConfig] | None = None  # (the exported text, what it resolved to)


def export(cfg: KVConfig | None) -> None:
    """Publish (or, for ``None``, clear) the configuration for processes spawned after this."""
    global _current
    if cfg is None:
        os.environ.pop(ENV, None)
        return
    text = json.dumps({
        "policy": cfg.policy_arg, "budget": cfg.budget_arg, "options": cfg.options.to_dict(),
        "policies": cfg.policies_arg,
    })  # fmt: skip
    os.environ[ENV] = text
    _current = text, cfg


def current() -> KVConfig | None:
    """The configuration this process was started with, or ``None`` when tiering is off. The
    policy is compiled once per exported configuration, not at every call.

    Raises:
        PolicyError: the exported policy became invalid after the launch validated it.
    """
    global _current
    text = os.environ.get(ENV)
    if not text:
        return None
    if _current is None or _current[0] != text:
        got = json.loads(text)
        opts = KVOptions.from_dict(got["options"])
        _current = text, resolve(got["policy"], got["budget"], opts, got.get("policies"))
    return _current[1]


def describe_error(err: PolicyError, flag: str = "--kv-policy") -> str:
    """The message a launch prints before exiting on a bad policy or budget."""
    return f"error: {flag}: invalid policy\n{err}"
