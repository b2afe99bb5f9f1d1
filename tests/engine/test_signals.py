"""Signals of attention over a subset of the cached tokens, put back at their positions."""

from __future__ import annotations

import torch

from tiered_radix.engine.signals import Signals, at_positions


def test_at_positions_puts_each_token_signal_at_its_token_and_zero_elsewhere():
    pos = torch.tensor([0, 1, 4, 5, 6])
    attn = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.0], [0.5, 0.0, 0.25, 0.25, 0.0]])
    qnorm = torch.ones(2, 4)
    sig = Signals(attn=attn, colmass=attn * 3, qnorm=qnorm)
    out = at_positions(sig, pos, 8)
    want = torch.zeros(2, 8)
    want[:, pos] = attn
    assert torch.equal(out.attn, want) and torch.equal(out.colmass, want * 3)
    assert out.obs_attn is None and out.qnorm is qnorm
    out.check(n_heads=2, n_tokens=8, head_dim=4)
    # a shorter signal (T' below the rows read) covers the first positions only
    short = at_positions(Signals(attn=attn[:, :3]), pos, 8)
    assert (
        torch.equal(short.attn[:, [0, 1, 4]], attn[:, :3]) and short.attn.sum() == attn[:, :3].sum()
    )
