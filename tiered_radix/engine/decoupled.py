"""One layer of a decoupled (RDKV) policy: V per token, K per channel over the kept tokens.

V tokens live in a V-only :class:`~tiered_radix.engine.coupled.CoupledLayer` (token units, the
write-once ledger applies to them). K is held here:

- ``k_full [H, capacity, d]``: full K rows of tokens outside the channel set (protected, fresh,
  forced by a rule) and, for tokens in the set, the channels at 16 bits; NaN elsewhere.
- ``in_set [H, T]``: tokens whose K is held per channel (routable tokens whose V was kept at
  the last routing); ``tier [H, d]``: each channel's engine tier.
- per quantized tier ``j``: codes of ``K^T [H, d, N]`` over the set's tokens in position order
  (``index [H, N]``), groups of ``group`` tokens, the last group padded with the head's last
  set token (an edge value: it changes neither min nor max). Only channels at tier ``j`` count.
- a channel at 0 bits is dropped: its K reads as 0 for the set's tokens (RDKV's zeroed channel).

K channel copies are not ledger entries: the set changes between routings, so each routing
re-encodes K from what the layer holds (full rows, or the previous codes; a dropped channel stays
0). K groups follow Zone A (:func:`zone_a_order`): the set's tokens by V tier, then position,
each V tier's run padded to ``group``, so a group is one TriZone page's K part and the SGLang
pool's pages (:mod:`tiered_radix.formats.zone_a`) hold these codes bit for bit. Bytes per channel
of a head with ``n_j`` set tokens at V tier ``j``: ``2 sum n_j`` at 16 bits,
``quantized_nbytes(sum ceil(n_j / group) * group, bits, group)`` when quantized, 0 when dropped.

Without data (``keep_data=False``, a store whose rows live in the SGLang pool) the layer keeps
the tiers, the set and its counts: what the byte counts need.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from tiered_radix.formats import codecs

from .growth import grown
from .ledger import zero_padded
from .routing import TierSet


def channel_cost(n_set: Tensor, bits: list[int], group: int) -> Tensor:
    """float64 ``[H, len(bits)]``: bytes of one channel over the set's tokens per width, with
    ``n_set [H, J]`` the set's tokens per V tier (each V tier's run padded to ``group``)."""
    n = n_set.double()
    padded = (torch.ceil(n / group) * group).sum(-1)
    n = n.sum(-1)
    cols = [
        torch.zeros_like(n) if b == 0 else 2 * n if b == 16 else padded * b / 8 + 4 * padded / group
        for b in bits
    ]
    return torch.stack(cols, -1)


def set_counts(v_tier: Tensor, in_set: Tensor, n_tiers: int) -> Tensor:
    """int64 ``[..., J]``: the K channel set's tokens (``in_set`` bool ``[..., T]``) per V tier
    (``v_tier [..., >= T]``, its first ``T``), what :func:`channel_cost` prices."""
    counts = torch.zeros(*in_set.shape[:-1], n_tiers, dtype=torch.long, device=in_set.device)
    vt = v_tier[..., : in_set.shape[-1]].clamp(0, n_tiers - 1)
    return counts.scatter_add_(-1, vt, in_set.long())


def zone_a_order(v_tier: Tensor, in_set: Tensor, n_tiers: int, group: int):
    """The set's tokens as K groups are made of them: per head, by V tier then position, each
    tier's run padded to a multiple of ``group`` with its last token (Zone A's pages,
    :mod:`tiered_radix.formats.zone_a`). Returns ``index`` int64 ``[H, N]`` (token of each slot),
    ``valid`` bool ``[H, N]`` (slots that are not padding) and ``counts`` int64 ``[H, J]`` (set
    tokens per V tier)."""
    H, T = in_set.shape
    dev = in_set.device
    vt = v_tier.clamp(0, n_tiers - 1)
    counts = set_counts(vt, in_set, n_tiers)
    pos = torch.arange(T, device=dev)
    key = torch.where(in_set, vt * T + pos, n_tiers * T)
    order = torch.sort(key, dim=1).indices  # set tokens by (tier, position), then the rest
    padded = -(-counts // group) * group
    pend = padded.cumsum(1)
    n = int(pend[:, -1].max()) if H else 0
    slot = torch.arange(n, device=dev).expand(H, -1)
    tier = torch.searchsorted(pend, slot.contiguous(), right=True).clamp(max=n_tiers - 1)
    within = slot - (pend - padded).gather(1, tier)
    c = counts.gather(1, tier)
    src = (counts.cumsum(1) - counts).gather(1, tier) + within.clamp(max=(c - 1).clamp(min=0))
    valid = (within < c) & (slot < pend[:, -1:])
    index = order.gather(1, src.clamp(0, max(T - 1, 0)))
    return index, valid, counts


class KStart(NamedTuple):
    """The state of layers' K before their first token and routing, stacked over ``L`` layers
    in one buffer each (a new request's store makes them all at once; each layer holds views):
    ``set`` bool ``[L, H, 0]``, ``tier`` int64 ``[L, H, d]`` (all full), ``index`` int64 and
    ``valid`` bool ``[L, H, 0]``, ``n_set`` int64 ``[L, H, J]``."""

    set: Tensor
    tier: Tensor
    index: Tensor
    valid: Tensor
    n_set: Tensor

    @staticmethod
    def new(n_layers: int, n_heads: int, head_dim: int, n_tiers: int, device) -> KStart:
        lh = (n_layers, n_heads)
        return KStart(
            torch.empty(*lh, 0, dtype=torch.bool, device=device),
            torch.zeros(*lh, head_dim, dtype=torch.long, device=device),
            torch.empty(*lh, 0, dtype=torch.long, device=device),
            torch.empty(*lh, 0, dtype=torch.bool, device=device),
            torch.zeros(*lh, n_tiers, dtype=torch.long, device=device),
        )

    def layer(self, li: int) -> KStart:
        return KStart(*(x[li] for x in self))


def _with_room(held: Tensor, capacity: int) -> Tensor:
    """bool ``[..., capacity]``: the set ``held [..., t]`` followed by room (False)."""
    return zero_padded(held, (*held.shape[:-1], capacity - held.shape[-1]), held.dim() - 1)


def _padded(x: Tensor, extra: tuple[int, int], value) -> Tensor:
    """``x [H, T]`` followed by ``value`` for ``extra`` ``(H, n)`` more tokens."""
    return torch.cat([x, x.new_full(extra, value)], 1)


def nbytes_layers(layers: list[ChannelK], kept: Tensor) -> Tensor:
    """int64 0-d: the sum over ``layers`` (of equal token counts) of each layer's
    :meth:`ChannelK.nbytes_heads` and :meth:`ChannelK.rows_bytes` of its ``kept[l]``
    (bool ``[L, H, T]``), in one pass over the stacked layers."""
    n_set = torch.stack([k.n_set for k in layers])  # [L, H, J]
    tier = torch.stack([k.tier for k in layers])  # [L, H, d]
    in_set = torch.stack([k.in_set for k in layers])  # [L, H, T]
    k0 = layers[0]
    per = channel_cost(n_set.flatten(0, 1), k0.bits, k0.group)  # [L*H, J]
    chan = per.gather(1, tier.flatten(0, 1)).sum(1).round().long()
    rows = (kept & ~in_set).sum(2) * 2 * k0.head_dim
    return chan.sum() + rows.sum()


class ChannelK:
    def __init__(
        self,
        tiers: TierSet,
        bits: list[int],
        group: int,
        n_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        keep_data: bool = True,
        start: KStart | None = None,
    ) -> None:
        """``start``: this layer's views of :meth:`KStart.new` over several layers (see
        :meth:`layers`); by default its own."""
        self.tiers, self.bits, self.group = tiers, bits, group  # bits[j]: width of engine tier j
        self.n_heads, self.head_dim, self.dtype, self.device = n_heads, head_dim, dtype, device
        self.keep_data = keep_data  # False: tiers, set and byte counts only (rows live elsewhere)
        self.k_full = torch.empty(n_heads, 0, head_dim, dtype=dtype, device=device)
        if start is None:
            start = KStart.new(1, n_heads, head_dim, len(tiers.names), device).layer(0)
        # the set over a buffer of capacity (False past ``n_tokens``): a decode step's new token
        # is counted, not copied (no device work until the buffer doubles)
        self._set, self.tier, self.index, self.valid, self.n_set = start
        self._n = 0
        self.codes: dict[int, codecs.QuantizedTensor] = {}

    @classmethod
    def layers(cls, n_layers: int, **kw) -> list[ChannelK]:
        """``n_layers`` layers' K (``kw``: :meth:`__init__`'s arguments but ``start``), their
        starting state in one stacked :class:`KStart`."""
        start = KStart.new(n_layers, kw["n_heads"], kw["head_dim"], len(kw["tiers"].names),
                           kw["device"])  # fmt: skip
        return [cls(**kw, start=start.layer(li)) for li in range(n_layers)]

    @staticmethod
    def count_layers(layers: list[ChannelK], n: int) -> None:
        """``append(None, n)`` of every layer (without data): where every layer holds as many
        tokens and every set must grow, the sets grow into one buffer ``[L, H, 2t]`` (each
        layer a view; the same sets and capacities as layer by layer)."""
        t0 = layers[0]._n if layers else 0
        t = t0 + n
        if not layers or any(k._n != t0 or t <= k._set.shape[1] or k.keep_data for k in layers):
            for k in layers:
                k.append(None, n)
            return
        grown = layers[0]._set.new_zeros(len(layers), layers[0].n_heads, 2 * t)
        if t0:
            grown[:, :, :t0] = torch.stack([k.in_set for k in layers])
        for k, s in zip(layers, grown, strict=True):
            k._set, k._n = s, t

    @property
    def n_tokens(self) -> int:
        return self._n

    @property
    def in_set(self) -> Tensor:
        """bool ``[H, T]``: tokens whose K is held per channel."""
        return self._set[:, : self._n]

    def _set_to(self, new_set: Tensor) -> None:
        """The set after a routing (``new_set [H, T]`` over :attr:`n_tokens`), in a buffer with
        room for as many tokens again (the decode steps after the routing append without
        device work)."""
        self._set = _with_room(new_set, grown(self._n, self._n + 1))

    def append(self, k: Tensor | None, n: int | None = None) -> None:
        """``k [H, t, d]`` new tokens (outside the set until the next routing); without data
        (``keep_data=False``) ``k`` is None and ``n`` counts them."""
        n = k.shape[1] if k is not None else n
        t = self.n_tokens + n
        if self.keep_data:
            if t > self.k_full.shape[1]:
                pad = grown(self.k_full.shape[1], t) - self.k_full.shape[1]
                fill = self.k_full.new_full((self.n_heads, pad, self.head_dim), torch.nan)
                self.k_full = torch.cat([self.k_full, fill], 1)
            self.k_full[:, self.n_tokens : t] = k.to(self.dtype)
        if t > self._set.shape[1]:
            self._set = _with_room(self.in_set, grown(self._set.shape[1], t))
        self._n = t

    def view(self, kept: Tensor) -> Tensor:
        """float32 ``[H, T, d]`` K as attention reads it; NaN where ``kept[H, T]`` is False."""
        t = self.n_tokens
        k = self.k_full[:, :t].float()
        in_set = self.in_set
        if self.index.shape[1]:
            n, d = self.index.shape[1], self.head_dim
            vals = torch.zeros(self.n_heads, n, d, device=self.device)  # dropped channels: 0
            for j, q in self.codes.items():
                on = (self.tier == j)[:, None, :]
                vals = torch.where(on, codecs.dequantize(q)[..., :n].transpose(1, 2), vals)
            idx = torch.where(self.valid, self.index, t)[..., None].expand(-1, -1, d)
            dense = torch.zeros(self.n_heads, t + 1, d, device=self.device)
            dense = dense.scatter(1, idx, vals)[:, :t]
            from_set = torch.where((self.tier == 0)[:, None, :], k, dense)
            k = torch.where(in_set[..., None], from_set, k)
        return torch.where(kept[..., None], k, torch.nan)

    def apply(self, new_tier: Tensor, new_set: Tensor, kept: Tensor, v_tier: Tensor) -> None:
        """Re-encode K for channel tiers ``new_tier[H, d]`` over ``new_set[H, T]``, grouped as
        :func:`zone_a_order` says from the tokens' V tiers ``v_tier[H, T]``; tokens not
        ``kept[H, T]`` are evicted (their rows poisoned). ``T`` may be short of
        :attr:`n_tokens` (a routing that lands late, under SGLang's overlap scheduler): the
        tokens appended since are full and kept, outside the set."""
        J = len(self.tiers.names)
        t = new_set.shape[1]
        if t < self._n:
            extra = (self.n_heads, self._n - t)
            new_set = _padded(new_set, extra, False)
            kept, v_tier = _padded(kept[:, :t], extra, True), _padded(v_tier[:, :t], extra, 0)
        if not self.keep_data:  # the counts alone: Zone A's slot order is for data
            self.n_set, self.tier = set_counts(v_tier, new_set, J), new_tier
            self._set_to(new_set)
            return
        index, valid, counts = zone_a_order(v_tier[:, : self.n_tokens], new_set, J, self.group)
        cur = self.view(kept)  # what the layer holds now, before anything is freed
        self.codes = {}
        if index.shape[1]:
            x = torch.nan_to_num(cur.gather(1, index[..., None].expand(-1, -1, self.head_dim)))
            for j in self.tiers.quantized:
                if bool((new_tier == j).any()):
                    self.codes[j] = codecs.quantize(x.transpose(1, 2), self.bits[j], self.group)
        self.index, self.valid, self.n_set = index, valid, counts
        self.tier = new_tier
        self._set_to(new_set)
        keep_row = kept & ~new_set
        full_chan = new_set[..., None] & (new_tier == 0)[:, None, :]
        rows = torch.where(keep_row[..., None] | full_chan, cur, torch.nan)
        self.k_full[:, : self.n_tokens] = rows.to(self.dtype)

    @staticmethod
    def apply_layers(
        layers: list[ChannelK], new_tier: list[Tensor], new_set: list[Tensor], v_tier: Tensor
    ) -> bool:
        """:meth:`apply` of every layer at once (``new_tier[l]``, ``new_set[l]`` per layer,
        ``v_tier [L, H, >= T]``) where no layer keeps data and all hold as many tokens: their
        set counts per V tier, channel tiers and sets over the stacked layers (as :meth:`apply`
        without data).
        Returns False, having done nothing, otherwise."""
        k0 = layers[0] if layers else None
        if k0 is None or any(k.keep_data or k._n != k0._n for k in layers):
            return False
        sets = torch.stack(new_set)  # [L, H, T], T < n: tokens appended since the plan, outside
        counts = set_counts(v_tier, sets, len(k0.tiers.names))
        room = _with_room(sets, 2 * k0._n)
        for k, c, tier, s in zip(layers, counts, torch.stack(new_tier), room, strict=True):
            k.n_set, k.tier, k._set = c, tier, s
        return True

    def nbytes_heads(self) -> Tensor:
        """int64 ``[H]`` bytes of K: full rows outside the set plus the channel encodings."""
        per = channel_cost(self.n_set, self.bits, self.group)  # [H, J]
        chan = per.gather(1, self.tier).sum(1)
        return chan.round().long()

    def rows_bytes(self, kept: Tensor) -> Tensor:
        """int64 ``[H]`` bytes of full K rows of kept tokens outside the set."""
        return (kept & ~self.in_set).sum(1) * 2 * self.head_dim
