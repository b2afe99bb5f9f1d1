"""The policy language: YAML files whose expressions are parsed by ``grammar/policy.lark``."""

from .compiler import compile_text, load_policy
from .errors import PolicyError, Span
from .model import Policy
from .source import shipped_names

__all__ = ["Policy", "PolicyError", "Span", "compile_text", "load_policy", "shipped_names"]
