"""One request's KV usage, read from the pool: what its view holds now and what its routings
moved. Reported in the response's ``meta_info["kv_usage"]`` (OpenAI API: ``usage.kv``) when the
request finishes.

Every number comes from the pool's state, not from the tier engine's plan: the holder states
of the request's windows (:meth:`~.radix.TieredRadixCache.states_all`, after any degraded move),
and the representations each state references (:meth:`~.reps.Layout.reps`) at the pool's
block sizes. A window two requests share counts in both reports (each holds its references).
A decoupled (RDKV) request holds its Zone A pages and the rows it reads outside them
(:func:`report_pages`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tiered_radix.formats.layout import V_BITS

from .reps import FULL, S_A, S_FULL, S_Q, S_R, STATE_NAMES, STATES, Q, R, reads

KEY = "kv_usage"  # the report's name in meta_info (OpenAI API: usage.kv)
# moves counted per (layer, head, window) a routing changed: [demotions, promotions, evictions]
MOVES = ("demotions", "promotions", "evictions")


def moves_of(old: Tensor, new: Tensor) -> Tensor:
    """int64 ``[3]`` on the device (no host sync): demotions (full or restored to quantized),
    promotions (quantized to full or restored) and evictions among holder moves ``old -> new``
    (int ``[m]`` each, the states the pool reached)."""
    return move_flags(old, new).sum(0)


def _flag_rule(old: Tensor, new: Tensor) -> Tensor:
    """The rule :func:`move_flags` looks up: int64 ``[m, 3]`` demotion (full or restored to
    quantized), promotion (quantized to full or restored), eviction (to evicted or archived)."""
    rows = (old == S_FULL) | (old == S_R)
    demote = rows & (new == S_Q)
    promote = (old == S_Q) & ((new == S_FULL) | (new == S_R))
    evict = reads(old) & ~reads(new)
    return torch.stack([demote, promote, evict], 1).long()


_ALL = torch.tensor(STATES)
_FLAGS = _flag_rule(_ALL.repeat_interleave(len(STATES)), _ALL.repeat(len(STATES))).view(
    len(STATES), len(STATES), len(MOVES)
)  # [old, new, kind]: every pair of holder states, computed once
_FLAGS_ON: dict[torch.device, Tensor] = {}


def move_flags(old: Tensor, new: Tensor) -> Tensor:
    """int64 ``[m, 3]``: which of :func:`moves_of`'s kinds each move ``old -> new`` is (a
    batch of requests' moves summed per request by slices): one lookup in the table of every
    state pair (:func:`_flag_rule`'s), not a dozen device ops a routing."""
    table = _FLAGS_ON.get(old.device)
    if table is None:
        table = _FLAGS_ON[old.device] = _FLAGS.to(old.device)
    return table[old.long(), new.long()]


def state_bytes(pool) -> list[int]:
    """Bytes one (layer, head, window) unit holds in each holder state (:data:`.reps.STATES`),
    at the pool's sizes: rows (K and V of a window) for full and restored, a ledger page for
    quantized, archived (and restored under a write-once ledger, which keeps it), nothing for
    evicted."""
    rows = 2 * pool.rows_k[0][0].nbytes  # one row block of K and one of V: [W, d] each
    size = {FULL: rows, R: rows, Q: pool.page_bytes}
    return [sum(size[k] for k in pool.layout.reps(st)) for st in STATES]


def report(pool, states: Tensor, n_tokens: int, moved: Tensor | None, routes: int,
           budget_bytes: int, request: dict) -> dict:  # fmt: skip
    """The usage of a request whose windows ``states`` (int8 ``[L, H, n]``) hold ``n_tokens``
    tokens; ``moved`` its :func:`moves_of` sum, ``routes`` its routings, ``budget_bytes`` what
    its budget allows at ``n_tokens``, ``request`` its policy and budget as asked. One host sync.

    ``tokens`` per state are token-equivalents, ``W * units / (L * H)``: exact where every layer
    and head agree (the last window counts whole). ``bf16_bytes``: the same tokens' K and V at
    the model's precision in every layer and head (a plain SGLang pool's bytes)."""
    L, H, n = states.shape
    W, k = pool.layout.window, len(STATES)
    units = torch.bincount(states.long().flatten(), minlength=k)[:k]
    counts = torch.cat([units, moved if moved is not None else units.new_zeros(3)]).tolist()
    units, moves = counts[:k], counts[k:]
    per = [u * b for u, b in zip(units, state_bytes(pool), strict=True)]
    archived = per[S_A]  # kept for a later turn, read by nobody: not the request's bytes
    held = sum(per) - archived
    bf16 = n_tokens * 2 * L * H * pool.head_dim * pool.rows_k[0].element_size()
    return {
        **request,
        "tokens": n_tokens,
        "tokens_per_state": {
            name: round(W * u / (L * H), 2) for name, u in zip(STATE_NAMES, units, strict=True)
        },
        "units_per_state": dict(zip(STATE_NAMES, units, strict=True)),
        "bytes_held": held,
        "archived_bytes": archived,
        "bf16_bytes": bf16,
        "held_vs_bf16": round(held / bf16, 4) if bf16 else None,
        "budget_bytes": budget_bytes,
        **dict(zip(MOVES, moves, strict=True)),
        "routed_steps": routes,
    }


def report_pages(pool, placed: list | None, rows_windows: int, n_tokens: int, routes: int,
                 budget_bytes: int, request: dict) -> dict:  # fmt: skip
    """:func:`report`'s fields for a decoupled request: its Zone A pages (``placed``: its
    :class:`~.zones.Placed` layers, None before a routing landed) and the ``rows_windows``
    windows it reads rows of (every layer and head; the last one counts whole). Tokens per
    state: ``full`` its rows' and its 16-bit pages' tokens, ``quantized`` its 2/4/8-bit pages',
    ``evicted`` those its routing dropped; ``tokens_per_width`` the pages' tokens by V width
    (and ``rows``). Token-equivalents over layers and heads, as :func:`report`'s. Host reads
    of the page lists (host tensors) and one of the kept masks."""
    L, H = pool.layer_num, pool.head_num
    per_width, paged_bytes, evicted, routed = torch.zeros(len(V_BITS), dtype=torch.long), 0, 0, 0
    for p in placed or []:
        z = p.zone
        width = torch.arange(len(V_BITS)).repeat(H).repeat_interleave(z.pages.flatten())
        per_width.index_add_(0, width, (z.page_tok >= 0).sum(1))
        paged_bytes += z.nbytes
        evicted += int((~p.kept).sum())
        routed = p.n_tokens
    lh = L * H
    paged = per_width.tolist()
    rows = max(0, n_tokens * lh - sum(paged) - evicted) if placed else n_tokens * lh
    row_bytes = rows_windows * lh * 2 * pool.rows_k[0][0].nbytes
    held = paged_bytes + row_bytes
    bf16 = n_tokens * 2 * lh * pool.head_dim * pool.rows_k[0].element_size()
    units = {name: 0 for name in STATE_NAMES}
    units["full"] = rows + paged[V_BITS.index(16)]
    units["quantized"] = sum(paged) - paged[V_BITS.index(16)]
    units["evicted"] = evicted
    return {
        **request,
        "tokens": n_tokens,
        "tokens_per_state": {k: round(u / lh, 2) for k, u in units.items()},
        "units_per_state": units,  # token units of every layer and head
        "tokens_per_width": {
            "rows": round(rows / lh, 2),
            **{str(b): round(t / lh, 2) for b, t in zip(V_BITS, paged, strict=True)},
        },
        "tokens_routed": routed,
        "bytes_held": held,
        "archived_bytes": 0,
        "bf16_bytes": bf16,
        "held_vs_bf16": round(held / bf16, 4) if bf16 else None,
        "budget_bytes": budget_bytes,
        **dict.fromkeys(MOVES, 0),
        "routed_steps": routes,
    }
