"""How many token slots and blocks a tiered pool gets, and every byte they cost.

Slots (:func:`slot_bytes`, SGLang's per-token cell size): SGLang sizes its pool at
``N = available // cell`` tokens. A full-precision pool's cell is one token's K and V rows
(``full``). A tiered pool with a ``fraction`` budget ``f`` spends ``f * full`` a slot on rows and
ledger pages, and its per-slot metadata on top:

- *tables* (:func:`table_kinds`): per (layer, head, window) a block id (int32) and a reference
  count (int32) per representation kind the layout holds, and the owner's state (int8);
- *engine*: what running requests' tier engines hold per (layer, head, token) in device memory
  (:func:`engine_bytes_per_token`: tier maps, ledger-copy masks, score states, the latest
  signals the policy reads again; a ``cumulative`` read only per window is one sum a window),
  counted for every slot: the worst case, a pool whose slots all belong to running
  requests, each holding :data:`~tiered_radix.engine.growth.GROWTH` times its tokens' worth.
  These bytes are not allocated up front: they stay free in what SGLang set aside for the
  pool. What a request holds beyond its tokens' share (a partial last window, a memo's tail of
  at most a window: :func:`engine_bytes_per_request`) is not in it: a few MB at most, taken
  from the memory outside ``mem_fraction_static`` like SGLang's own per-request buffers.

A decoupled policy (RDKV) keeps rows for :data:`DECOUPLED_ROW_SHARE` of its slots (its
requests read rows until their routing, and the radix tree caches prefixes with rows; the rows
of windows a routed request reads from its pages go when new tokens need them, the windows
staying cached without rows: :meth:`.pool.TieredKVPool._unrow_paged`) and a Zone A store of
``ZONE_SLACK * f * full`` bytes a slot for the repacked requests' pages (pages pad each section
to 16 bytes and each V width's last page to ``P`` tokens: more than the engine's byte count for
short requests). Its cell is ``(DECOUPLED_ROW_SHARE + ZONE_SLACK * f) * full`` plus tables and
engine state.

A decode step's index lists and gathered rows, and the decode graphs' fixed buffers
(:func:`.graph.buffer_bytes`), live only while a step runs or are sized by the graphs' batch
and token capacity, not by slots: like SGLang's own activations and CUDA graphs they come out of
the memory outside ``mem_fraction_static``.

So ``N * cell <= available`` holds for rows + codes + metadata (:func:`pool_bytes`, the split the
startup log prints and the tests check against the built pool). Byte and token budgets are
per-request caps with no per-token ratio (``f = 1``). A policy whose metadata per slot is at
least what its budget saves (``(1 - f) * full``) would hold no more tokens than SGLang's own pool:
:func:`check_metadata` refuses it at launch (token units pay their tables per token; window units
share them over the window).

Blocks (:func:`plan_blocks`): ``N`` slots' ``f * N`` tokens of rows per layer, less the NaN trap
and scratch blocks and the padding window's tables, split as ``max(share_full, MIN_FULL_SHARE)``
row blocks and the rest ledger blocks, at least ``MIN_LEDGER_SHARE`` where the layout has a
quantized tier: rank allocation lets budget a better tier leaves unused flow down, so routing
writes ledger copies even when the shares give the quantized tier nothing. A routing short of
ledger (or row) blocks degrades its moves (:meth:`.pool.TieredKVPool.move`) instead of failing.
A full region too small for the tokens in flight (prefill happens at full precision before
routing) is held off by admission and decode retraction (:mod:`.plugin`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tiered_radix.engine.growth import GROWTH
from tiered_radix.engine.routing import TierSet
from tiered_radix.engine.scores import held_state
from tiered_radix.engine.signals import TOKEN_SIGNALS
from tiered_radix.formats.layout import uniform_page_nbytes
from tiered_radix.policy.model import Budget, Policy, RankAllocation

from .reps import Layout, PoolConfigError

MIN_FULL_SHARE = 0.25  # rows for protected / recent / in-flight tokens, whatever the shares say
MIN_LEDGER_SHARE = 0.1  # ledger pages for budget flowing down past a full tier's share
REF_BYTES, OWNER_BYTES = 4, 1  # int32 reference count per kind, int8 owner state per window
TIER_BYTES = 8  # int64 tier per unit (CoupledStack.tier)
COPY_BYTES = 1 + 4  # per quantized tier and unit: present (bool) and write_count (int32)
STATE_BYTES = 4  # float32 per token (or per unit) of each cumulative(...) score state
SIGNAL_BYTES = 4  # float32 per token of each token signal kept (attn, colmass, obs_attn)
WINDOW_SUGGESTIONS = (16, 32, 64)  # window sizes a refused policy is pointed to
SET_BYTES = 1  # bool per token: in a decoupled policy's K channel set (ChannelK.in_set)
ZONE_SLACK = 2.0  # Zone A bytes per budget byte: pages pad sections to 16 bytes, V widths to P
# a decoupled policy's row blocks per slot: the prompts in flight before their routing, the
# tokens since a routing, and the radix tree's prefixes with rows (the rest of a slot's bytes
# is its Zone A share)
DECOUPLED_ROW_SHARE = MIN_FULL_SHARE


@dataclass(frozen=True)
class PoolBlocks:
    full: int  # row blocks per layer ([W, d] K and V of one head)
    quant: int  # ledger blocks per layer
    zone: int = 0  # bytes per layer of a decoupled policy's Zone A store (.zones)


@dataclass(frozen=True)
class PoolBytes:
    """Bytes of a tiered pool of ``slots`` slots (:func:`pool_bytes`)."""

    slots: int
    rows: int  # row blocks, K and V, with the NaN trap and scratch blocks
    codes: int  # ledger pages, with the NaN trap page (decoupled policies: the Zone A store)
    tables: int  # block ids, reference counts, owner states
    engine: int  # running requests' engine state, if every slot were theirs (not allocated)

    @property
    def metadata(self) -> int:
        return self.tables + self.engine

    @property
    def total(self) -> int:
        return self.rows + self.codes + self.metadata

    def describe(self) -> str:
        gib = 1 << 30
        return (
            f"{self.total / gib:.2f} GiB = rows {self.rows / gib:.2f} + codes "
            f"{self.codes / gib:.2f} + metadata {self.metadata / gib:.2f} (tables "
            f"{self.tables / gib:.2f}, engine state {self.engine / gib:.2f}, left unallocated)"
        )


def table_kinds(layout: Layout) -> int:
    """Representation kinds the pool's tables hold: ``FULL, Q, R`` with a quantized tier, else
    ``FULL`` only (an eviction-only policy never makes ``Q`` or ``R``)."""
    return 3 if layout.quant is not None else 1


def block_id_dtype(blocks: PoolBlocks) -> torch.dtype:
    """int32 block ids, int64 for a layer with 2**31 blocks or more."""
    return torch.int32 if max(blocks.full + 2, blocks.quant + 1) < 2**31 else torch.int64


def _id_bytes(blocks: PoolBlocks | None) -> int:
    return 4 if blocks is None else torch.empty(0, dtype=block_id_dtype(blocks)).element_size()


def window_table_bytes(layout: Layout, id_bytes: int = 4) -> int:
    """Table bytes of one (layer, head, window)."""
    return table_kinds(layout) * (id_bytes + REF_BYTES) + OWNER_BYTES


def _unit_size(policy: Policy) -> int:
    return policy.v.size if policy.v.kind == "window" else 1


def _unit_bytes(policy: Policy) -> int:
    """A unit's tier and copy masks (and a decoupled token's channel-set flag), before growth
    (:mod:`tiered_radix.engine.growth`)."""
    per_unit = TIER_BYTES + COPY_BYTES * len(TierSet.of(policy).quantized)
    return per_unit + (0 if policy.coupled else SET_BYTES)


def engine_bytes_per_token(policy: Policy) -> float:
    """Upper bound of a running request's engine state per (layer, head, token), in bytes (see
    the module docstring): tiers and copy masks per unit, the ``cumulative`` sums (per token or
    per unit, :func:`~tiered_radix.engine.scores.held_state`) with their growth, the memos of
    token-level reads of a prompt signal (one value a window), and the latest token signals
    the policy reads again."""
    held = held_state(policy)
    per_unit = _unit_bytes(policy)
    W = _unit_size(policy)
    sums = STATE_BYTES * held.sums_per_token()
    memos = STATE_BYTES * len(held.memos) / W  # allocated once per observation: no growth
    signals = SIGNAL_BYTES * len(held.signals & set(TOKEN_SIGNALS))
    return GROWTH * (per_unit / W + sums) + memos + signals


def engine_bytes_per_request(policy: Policy) -> float:
    """What a running request's engine state may hold per (layer, head) beyond
    :func:`engine_bytes_per_token` times its tokens: its last, partial unit in every per-unit
    tensor (with their growth) and the memos' signal tails
    (:meth:`~tiered_radix.engine.scores.HeldState.tail_tokens`). Not in the slots' reserve: at
    most ``max_running_requests`` times this, times layers and heads (a few MB), comes out of the
    memory outside ``mem_fraction_static``, as SGLang's own per-request buffers do."""
    held = held_state(policy)
    per_unit = _unit_bytes(policy) + STATE_BYTES * held.sums_per_unit()
    return GROWTH * per_unit + STATE_BYTES * held.tail_tokens(_unit_size(policy))


def _fraction(budget: Budget) -> float:
    return budget.value if budget.kind == "fraction" else 1.0


def slot_bytes(
    policy: Policy, budget: Budget, layers: int, heads: int, head_dim: int, itemsize: int
) -> float:
    """Bytes one allocator slot costs (SGLang's cell size for a tiered pool): the budget's rows
    and pages, tables and engine state (see the module docstring)."""
    full = 2 * layers * heads * head_dim * itemsize
    lh = layers * heads
    lay = Layout.of(policy)
    tables = lh * window_table_bytes(lay) / lay.window
    data = _fraction(budget) * full
    if lay.tier_bits is not None:  # rows for a share of the slots, and the Zone A store
        data = DECOUPLED_ROW_SHARE * full + ZONE_SLACK * data
    return data + tables + lh * engine_bytes_per_token(policy)


def check_metadata(
    policy: Policy, budget: Budget, layers: int, heads: int, head_dim: int, itemsize: int
) -> None:
    """Refuse a fraction budget whose pool would hold no more tokens than SGLang's own.

    Raises:
        PoolConfigError: metadata per slot >= what the budget saves per slot.
    """
    f = _fraction(budget)
    if f >= 1 or not policy.coupled:  # decoupled: a fixed row share and the Zone A store
        return
    full = 2 * layers * heads * head_dim * itemsize
    meta = slot_bytes(policy, budget, layers, heads, head_dim, itemsize) - f * full
    if meta >= (1 - f) * full:
        W = _unit_size(policy)
        wider = [f"window(size={s})" for s in WINDOW_SUGGESTIONS if s > W]
        units = f"use {' or '.join(wider)} units, or " if wider else "use "
        raise PoolConfigError(
            f"policy '{policy.name}': its metadata costs {meta:.0f} bytes a token slot (block "
            f"tables and engine state), at least the {(1 - f) * full:.0f} bytes its "
            f"{f:.0%} budget saves of a {full} byte full-precision token, so the tiered pool "
            f"would hold no more tokens than SGLang's own. Units of {W} token(s) pay their "
            f"tables per unit: {units}a smaller budget fraction"
        )


def plan_blocks(
    size: int, head_num: int, head_dim: int, itemsize: int, policy: Policy, budget: Budget
) -> PoolBlocks:
    """Blocks per layer for ``size`` logical slots (see the module docstring)."""
    lay = Layout.of(policy)
    W = lay.window
    row_bytes = 2 * W * head_dim * itemsize
    if lay.tier_bits is not None:  # a share of the slots' rows; Zone A: the budget's bytes
        fixed = 2 * row_bytes + head_num * window_table_bytes(lay)  # traps, padding window
        zone = ZONE_SLACK * _fraction(budget) * size * head_num * head_dim * 2 * itemsize
        rows = max(1, int(DECOUPLED_ROW_SHARE * size) // W) * head_num
        return PoolBlocks(rows, 0, max(16, int(zone - fixed) // 16 * 16))
    q_bytes = (
        uniform_page_nbytes(lay.quant.bits, W, head_dim, min(lay.v_group, head_dim))
        if lay.quant is not None
        else 0
    )  # one ledger page
    fixed = 2 * row_bytes + q_bytes + head_num * window_table_bytes(lay)  # traps, padding window
    phys = _fraction(budget) * size * head_num * head_dim * 2 * itemsize - fixed  # per layer
    if lay.quant is None:
        return PoolBlocks(max(1, int(phys // row_bytes)), 0)
    a = policy.allocate
    share = (
        a.shares[0]
        if isinstance(a, RankAllocation) and lay.engine_tiers[0] in (t.name for t in policy.tiers)
        else 0.0
    )
    share = min(max(share, MIN_FULL_SHARE), 1 - MIN_LEDGER_SHARE)
    return PoolBlocks(
        max(1, int(share * phys // row_bytes)), max(1, int((1 - share) * phys // q_bytes))
    )


def min_row_windows(policy: Policy) -> int:
    """Row windows a layer needs so that SGLang's scheduler always makes progress: it never
    retracts its last running request, nor a chunked prompt midway, and both keep their
    protected tokens at full precision (the sinks' windows, the recent tokens' windows and one
    more where they start mid-window) whatever routing frees; and one window for the next
    tokens. A window pool with fewer rows is refused (:func:`check_rows`)."""
    W, prot = Layout.of(policy).window, policy.protect
    sinks = -(-prot.sinks // W) if prot.sinks else 0
    recent = -(-prot.recent // W) + 1 if prot.recent else 0
    return 2 * (sinks + recent) + 1


def check_rows(blocks: PoolBlocks, head_num: int, policy: Policy) -> None:
    """Refuse a window pool whose row blocks (:func:`plan_blocks`) hold fewer windows a layer
    than the scheduler needs to make progress (:func:`min_row_windows`), with what to change.

    Raises:
        PoolConfigError: the rows are too few.
    """
    lay = Layout.of(policy)
    have, need = blocks.full // head_num, min_row_windows(policy)
    if have < need:
        raise PoolConfigError(
            f"the tiered pool's full-precision rows hold {have} window(s) of {lay.window} tokens "
            f"a layer; it needs {need} (the protected tokens of a running request and of a "
            "chunked prompt, and a window to extend into): raise --mem-fraction-static or the "
            "budget, or protect fewer tokens"
        )


def pool_bytes(
    size: int,
    head_num: int,
    head_dim: int,
    layer_num: int,
    itemsize: int,
    policy: Policy,
    budget: Budget,
    blocks: PoolBlocks | None = None,
) -> PoolBytes:
    """The byte split of a pool of ``size`` slots: a :class:`~.pool.TieredKVPool` (``blocks``:
    its own, default :func:`plan_blocks`) allocates ``rows + codes + tables`` exactly (a
    decoupled policy's ``codes`` are its Zone A store)."""
    L, H, d = layer_num, head_num, head_dim
    engine = int(L * H * size * engine_bytes_per_token(policy))
    lay = Layout.of(policy)
    blocks = blocks or plan_blocks(size, H, d, itemsize, policy, budget)
    W = lay.window
    rows = L * (blocks.full + 2) * 2 * W * d * itemsize
    codes = 0
    if lay.quant is not None:
        codes = L * (blocks.quant + 1) * uniform_page_nbytes(lay.quant.bits, W, d,
                                                             min(lay.v_group, d))  # fmt: skip
    if lay.tier_bits is not None:
        codes = L * (-(-max(blocks.zone, 16) // 16) * 16)  # .zones.ZoneStore's size
    tables = L * H * (size // W + 1) * window_table_bytes(lay, _id_bytes(blocks))
    return PoolBytes(size, rows, codes, tables, engine)


def cell_bytes(policy, budget, layers, heads, head_dim, itemsize) -> int:
    """:func:`slot_bytes` rounded up: SGLang's ``N = available // cell`` then fits."""
    return math.ceil(slot_bytes(policy, budget, layers, heads, head_dim, itemsize))
