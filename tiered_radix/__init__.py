"""tiered-radix: a tiered (full / k-bit quantized / evicted) KV-cache manager driven by policies.

>>> from tiered_radix import load_policy
>>> policy = load_policy("qevict")          # a shipped policy by name, or a path
"""

from .policy import Policy, PolicyError, compile_text, load_policy

__all__ = ["Policy", "PolicyError", "compile_text", "load_policy"]
__version__ = "0.1.0"
