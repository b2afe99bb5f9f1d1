"""Copy store / write-once ledger: codec layouts, write-once enforcement, accounting."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_radix.engine.ledger import CopyStore, LedgerError, part_codecs
from tiered_radix.formats import codecs


def test_part_codecs_layout():
    k, v = part_codecs(2, 32, "kivi", 32, 64)
    assert (k.along_tokens, k.group) == (True, 32) and (v.along_tokens, v.group) == (False, 32)
    k, v = part_codecs(4, 64, "kivi", 16, 32)  # group clipped to the window / head_dim
    assert (k.group, v.group) == (16, 32)
    k, v = part_codecs(2, 32, "kivi", 1, 64)  # token units: K along d, one token has no groups
    assert not k.along_tokens and k.group == 32
    k, v = part_codecs(2, 32, "token", 32, 64)
    assert not k.along_tokens and not v.along_tokens
    k, v = part_codecs(2, 32, "channel", 32, 64)
    assert k.along_tokens and v.along_tokens


@settings(max_examples=25, deadline=None)
@given(
    bits=st.sampled_from([2, 4, 8]),
    w=st.sampled_from([1, 4, 8]),
    u=st.integers(1, 6),
    axis=st.sampled_from(["kivi", "token", "channel"]),
    seed=st.integers(0, 999),
)
def test_write_read_matches_codec_per_unit(bits, w, u, axis, seed):
    h, d = 2, 16
    g = torch.Generator().manual_seed(seed)
    kc, vc = part_codecs(bits, 8, axis, w, d)
    store = CopyStore({"k": kc, "v": vc}, h, w, d, torch.device("cpu"), write_once=True)
    blocks = {p: torch.randn(h, u, w, d, generator=g) * 3 + 1 for p in ("k", "v")}
    mask = torch.rand(h, u, generator=g) < 0.6
    mask[0, 0] = True
    store.write(mask, blocks)
    got = store.read(u)
    for p, c in (("k", kc), ("v", vc)):
        for hh, uu in mask.nonzero().tolist():
            x = blocks[p][hh, uu]
            x = x.T if c.along_tokens else x  # independent: quantize one unit with the codec
            ref = codecs.dequantize(codecs.quantize(x, bits, c.group))
            ref = ref.T if c.along_tokens else ref
            assert torch.equal(got[p][hh, uu], ref)
    per = codecs.quantized_nbytes(w * d, bits, kc.group) + codecs.quantized_nbytes(
        w * d, bits, vc.group
    )
    assert store.unit_nbytes == per
    assert store.nbytes() == int(mask.sum()) * per
    assert torch.equal(store.held(u), mask)
    assert torch.equal(store.write_count[:, :u], mask.int())


def test_write_once_refuses_a_second_write_and_drop_keeps_count():
    kc, vc = part_codecs(2, 4, "kivi", 4, 8)
    store = CopyStore({"k": kc, "v": vc}, 1, 4, 8, torch.device("cpu"), write_once=True)
    blocks = {p: torch.randn(1, 3, 4, 8) for p in ("k", "v")}
    m = torch.tensor([[True, False, True]])
    store.write(m, blocks)
    with pytest.raises(LedgerError):
        store.write(torch.tensor([[False, False, True]]), blocks)
    store.drop(torch.tensor([[True, False, False]]))
    assert store.held(3).tolist() == [[False, False, True]]
    assert store.nbytes() == store.unit_nbytes
    with pytest.raises(LedgerError):  # a dropped entry is still never rewritten
        store.write(torch.tensor([[True, False, False]]), blocks)


def test_without_write_once_a_unit_can_be_rewritten_and_grows():
    kc, vc = part_codecs(4, 4, "kivi", 4, 8)
    store = CopyStore({"k": kc, "v": vc}, 1, 4, 8, torch.device("cpu"), write_once=False)
    for n in (2, 5, 11):  # capacity grows with the unit count
        blocks = {p: torch.randn(1, n, 4, 8) + n for p in ("k", "v")}
        store.write(torch.ones(1, n, dtype=torch.bool), blocks)
        err = (store.read(n)["v"] - blocks["v"]).abs().max()
        assert float(err) < 0.5
    assert int(store.write_count[0, 0]) == 3


def test_room_reserved_up_front_equals_grown_room():
    kc, vc = part_codecs(4, 8, "kivi", 4, 8)
    for keep in (True, False):
        grown = CopyStore({"k": kc, "v": vc}, 2, 4, 8, torch.device("cpu"), True, n_layers=3,
                          keep_data=keep)  # fmt: skip
        grown.grow(5)
        made = CopyStore({"k": kc, "v": vc}, 2, 4, 8, torch.device("cpu"), True, n_layers=3,
                         keep_data=keep, units=5)  # fmt: skip
        assert made.capacity == grown.capacity == 5
        for a, b in [(made.present, grown.present), (made.write_count, grown.write_count)]:
            assert a.dtype == b.dtype and torch.equal(a, b)
        assert made.data.keys() == grown.data.keys()
        for p in made.data:
            assert all(torch.equal(x, y) for x, y in zip(made.data[p], grown.data[p], strict=True))
