"""The names a policy expression may use: signals, constants and functions.

This table is the language's side of a contract: the tier engine implements every name here
(``tiered_radix.engine.scores``), and a test checks that both sides list the same names. Adding a
scorer means one entry here and one function there.
"""

from __future__ import annotations

from dataclasses import dataclass

# Per-unit measurements the engine collects from attention and from the cache itself.
SIGNALS: dict[str, str] = {
    "attn": "attention probability mass a token receives from the newest decode query, summed over "
    "the query heads of its KV group",
    "colmass": "RDKV's total-variation weight: sum over prompt queries tau of a[tau, t], "
    "after prefill",
    "obs_attn": "attention mass a token receives from the last 32 prompt queries (SnapKV's "
    "observation window), after prefill",
    "qnorm": "per K channel c: ||Q[:, c]|| over prompt queries of the KV group",
    "knorm": "per K channel c: ||K[:, c]|| over the cached tokens",
    "key_norm": "per token: ||k_t||, the L2 norm of its key",
    "sigma": "the unit's value spread (standard deviation of its entries): RDKV's sigma_u",
    "recency": "tokens generated since the unit's newest token (0 for the newest)",
    "position": "the unit's first token position in the sequence",
}

CONSTANTS: dict[str, str] = {
    "head_dim": "the attention head dimension d",
    "seq_len": "the current sequence length",
}


@dataclass(frozen=True)
class Function:
    """Arity and keyword arguments of a function callable from a policy expression."""

    doc: str
    min_args: int
    max_args: int
    kwargs: tuple[str, ...] = ()


FUNCTIONS: dict[str, Function] = {
    "cumulative": Function(
        "running sum over decode steps, older mass multiplied by `decay` "
        "each step (QEvict's cumulative scoring; decay=1 is H2O)",
        1,
        1,
        ("decay",),
    ),
    "sum_heads": Function("sum over the KV heads of a layer (one decision for all heads)", 1, 1),
    "mean_heads": Function("mean over the KV heads of a layer", 1, 1),
    "max_heads": Function("max over the KV heads of a layer", 1, 1),
    "sum_layers": Function(
        "sum over the layers, per KV head (one decision for every layer; not inside cumulative)",
        1,
        1,
    ),
    "mean_layers": Function("mean over the layers, per KV head (not inside cumulative)", 1, 1),
    "max_layers": Function("max over the layers, per KV head (not inside cumulative)", 1, 1),
    "sum_window": Function("sum of a per-token value over the tokens of each unit", 1, 1),
    "mean_window": Function("mean of a per-token value over the tokens of each unit", 1, 1),
    "max_window": Function("max of a per-token value over the tokens of each unit", 1, 1),
    "pool_max": Function(
        "max-pool a per-token value along the sequence (SnapKV's clustering)", 1, 1, ("size",)
    ),
    "quantile": Function("the q-quantile of a value over the units of one (layer, KV head)", 2, 2),
    "min": Function("elementwise minimum", 2, 2),
    "max": Function("elementwise maximum", 2, 2),
    "clip": Function("clamp to [lo, hi]", 3, 3),
    "log": Function("natural logarithm (of max(x, 1e-30))", 1, 1),
    "exp": Function("exponential", 1, 1),
    "sqrt": Function("square root (of max(x, 0))", 1, 1),
    "abs": Function("absolute value", 1, 1),
}
