"""``--kv-policy`` / ``--kv-budget``: parsing, validation, and the hand-over to scheduler processes.

SGLang drops unknown attributes in ``ServerArgs.from_cli_args`` and starts its scheduler
processes with ``spawn``, so the plugin carries the two values in environment variables that the
children inherit. This is the only module that reads or writes them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tiered_radix.policy import Policy, PolicyError, Span, load_policy
from tiered_radix.policy.model import Budget
from tiered_radix.policy.transformer import parse

ENV_POLICY = "TIERED_RADIX_KV_POLICY"
ENV_BUDGET = "TIERED_RADIX_KV_BUDGET"
BACKEND = "tiered"  # the --radix-cache-backend name the plugin registers


@dataclass(frozen=True)
class KVConfig:
    """A validated ``--kv-policy`` (file path or shipped name) and optional budget override."""

    policy_arg: str
    budget_arg: str | None
    policy: Policy
    budget: Budget  # the override if given, else the policy's own

    @property
    def overridden(self) -> bool:
        return self.budget_arg is not None


def parse_budget(text: str) -> Budget:
    """``"10%"``, ``"2 GiB"``, ``"4096 tokens"`` -> :class:`Budget` (the policy file's syntax).

    Raises:
        PolicyError: at ``--kv-budget:1:col`` with what was expected.
    """
    return parse(text.strip(), "budget", Span("--kv-budget", 1, 1, text.strip()))


def resolve(policy_arg: str, budget_arg: str | None = None) -> KVConfig:
    """Load and validate the policy (and budget override) the user named.

    Raises:
        PolicyError: the policy file or the budget is invalid (message has file:line:col).
    """
    policy = load_policy(policy_arg)
    budget = parse_budget(budget_arg) if budget_arg is not None else policy.budget
    return KVConfig(policy_arg, budget_arg, policy, budget)


def export(cfg: KVConfig | None) -> None:
    """Publish (or, for ``None``, clear) the configuration for processes spawned after this."""
    if cfg is None:
        os.environ.pop(ENV_POLICY, None)
        os.environ.pop(ENV_BUDGET, None)
        return
    os.environ[ENV_POLICY] = cfg.policy_arg
    if cfg.budget_arg is None:
        os.environ.pop(ENV_BUDGET, None)
    else:
        os.environ[ENV_BUDGET] = cfg.budget_arg


def current() -> KVConfig | None:
    """The configuration this process was started with, or ``None`` when tiering is off.

    Raises:
        PolicyError: the exported policy became invalid after the launch validated it.
    """
    arg = os.environ.get(ENV_POLICY)
    return resolve(arg, os.environ.get(ENV_BUDGET)) if arg else None


def describe_error(err: PolicyError, flag: str = "--kv-policy") -> str:
    """The message a launch prints before exiting on a bad policy or budget."""
    return f"error: {flag}: invalid policy\n{err}"
