"""Hugging Face transformers adapter: a ``Cache`` driving the tier engine, its attention
function, and a multi-turn chat session (see each module's docstring).

>>> from tiered_radix.adapters.transformers import ChatSession
>>> chat = ChatSession(model, tokenizer, "qevict", budget="10%")
>>> chat.ask("Hello!").text
"""

from .attention import ATTN_NAME, AdapterError, attend, register, tiered_attention_on
from .cache import TieredCache, parse_budget
from .session import ChatSession, Turn, generate, stop_ids

__all__ = [
    "ATTN_NAME", "AdapterError", "ChatSession", "TieredCache", "Turn", "attend", "generate",
    "parse_budget", "register", "stop_ids", "tiered_attention_on",
]  # fmt: skip
