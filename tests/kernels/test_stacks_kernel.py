"""The free-stack take/give kernels against ``FreeStacks``' PyTorch path, state for state.

On CPU the kernels run under ``TRITON_INTERPRET=1``; on CUDA too at a routing's sizes.
"""

from __future__ import annotations

import pytest
import torch
from triton_guard import CUDA, require_triton  # noqa: E402

require_triton()

from tiered_radix.kernels.stacks import stack_take  # noqa: E402

from tiered_radix.adapters.sglang.freelist import FreeStacks  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"


def pairs(g, m, n_layers):
    """A routing's pair list: layers mixed, not sorted."""
    return torch.randint(0, n_layers, (m,), generator=g), torch.rand(m, generator=g)


@pytest.mark.parametrize("m", (1, 37, 1500, 2500))  # 2500: three scan iterations a program
@pytest.mark.parametrize("keep", (0, 3))
def test_take_and_give_equal_the_pytorch_stacks(m, keep):
    n_layers, n = 4, 300  # a layer runs short of blocks at the larger m
    g = torch.Generator().manual_seed(m + keep)
    twin = FreeStacks(n_layers, n, "cpu", kernel=False)
    fast = FreeStacks(n_layers, n, DEVICE, kernel=True)
    held, short = [], False
    for _ in range(3):  # take, give back part of it, take again: the stacks' order matters
        ly, r = pairs(g, m, n_layers)
        want = r < 0.7
        got_t, block_t = twin.take(ly, want, keep=keep)
        got_k, block_k = fast.take(ly.to(DEVICE), want.to(DEVICE), keep=keep)
        assert torch.equal(got_k.cpu(), got_t) and torch.equal(block_k.cpu(), block_t)
        assert torch.equal(fast.top.t.cpu(), twin.top.t)
        held.append((ly, block_t, got_t))
        short |= bool((want & ~got_t).any())
        ly, block, got = held[torch.randint(0, len(held), (1,), generator=g).item()]
        back = got & (torch.rand(got.shape, generator=g) < 0.5)
        twin.give(ly, block, back)
        fast.give(ly.to(DEVICE), block.to(DEVICE), back.to(DEVICE))
        assert torch.equal(fast.top.t.cpu(), twin.top.t)
        top = twin.top.t.tolist()
        for li in range(n_layers):  # the live part of each stack; the rest is never read
            assert torch.equal(fast.ids[li, : top[li]].cpu(), twin.ids[li, : top[li]])
    assert short == (m >= 1500)  # the larger cases run layers out of blocks
    assert any(bool(got.any()) for _, _, got in held)
    assert fast.counts() == twin.counts()


def test_a_layer_short_of_blocks_takes_what_it_has_in_pair_order():
    ids = torch.tensor([[3, 2, 1, 0], [9, 8, 7, 0]], device=DEVICE)  # tops at index 2
    top = torch.tensor([3, 1], device=DEVICE)
    ly = torch.tensor([0, 1, 0, 1, 0, 0], device=DEVICE)
    want = torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.bool, device=DEVICE)
    got, block = stack_take(ids, top, ly, want, keep=1)
    assert got.tolist() == [True, False, False, False, True, False]
    assert block.tolist() == [1, 0, 0, 0, 2, 0]  # layer 1 keeps its one block
    assert top.tolist() == [1, 1]


def test_bad_arguments_are_refused():
    def zeros(n, dtype=torch.long):
        return torch.zeros(n, dtype=dtype, device=DEVICE)

    ids, top, want = zeros((2, 5)), zeros(2), torch.ones(3, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="int64"):
        stack_take(ids, top, zeros(3, torch.int32), want)
    with pytest.raises(ValueError, match=r"want must be \[m\]"):
        stack_take(ids, top, zeros(3), torch.ones(4, dtype=torch.bool, device=DEVICE))
