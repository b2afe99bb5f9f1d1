"""A layer-wise free stack's take and give in one launch each (issue 20: a routing's host ops).

``ids [L, n + 1]`` holds each layer's free block ids, the top of layer ``l``'s stack at
``ids[l, top[l] - 1]``; ``top [L]`` the free counts (int64, on the device). A routing takes
blocks for the pairs that need one and gives back those nobody holds, pairs of every layer
mixed in one ``[m]`` list. In PyTorch (``FreeStacks.take`` / ``give``, the twin in
``tiered_radix.adapters.sglang.freelist``) each call is a stable sort for the rank of a pair
among its layer's, gathers, a scatter and counts: ~15-20 launching ops. Here one program per
layer scans the ``m`` pairs in order with a running count, so ranks, blocks and the new top
come out of one launch; the results equal the twin's (pair order within a layer decides which
block a pair gets).
"""

from __future__ import annotations

import torch
import triton

from ._device import triton_runs_on
from ._stack_kernels import _stack_give_kernel, _stack_take_kernel

_BLOCK = 1024  # pairs a program scans per iteration


def _check(ids: torch.Tensor, top: torch.Tensor, ly: torch.Tensor, **masks: torch.Tensor) -> None:
    if not triton_runs_on(ids):
        raise ValueError(
            f"ids is on {ids.device}; the stack kernels need CUDA (CPU under TRITON_INTERPRET=1)."
            " Use FreeStacks.take/give's PyTorch path there."
        )
    if ids.dtype != torch.long or top.dtype != torch.long or ly.dtype != torch.long:
        raise ValueError("ids, top and ly must be int64")
    if ids.dim() != 2 or top.shape != (ids.shape[0],) or not ids.is_contiguous():
        raise ValueError(f"expected contiguous ids [L, n + 1] and top [L]; got "
                         f"{list(ids.shape)}, {list(top.shape)}")  # fmt: skip
    for name, t in masks.items():
        if t.shape != ly.shape or ly.dim() != 1:
            raise ValueError(f"{name} must be [m] like ly; got {list(t.shape)}, {list(ly.shape)}")


def stack_take(
    ids: torch.Tensor, top: torch.Tensor, ly: torch.Tensor, want: torch.Tensor, keep: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block off layer ``ly[i]``'s stack for each pair ``i`` with ``want`` (bool ``[m]``),
    in pair order within a layer, while the layer has more than ``keep`` free: ``got`` bool
    ``[m]`` and the blocks (int64 ``[m]``, 0 where not got). Lowers ``top`` in place."""
    _check(ids, top, ly, want=want)
    m = ly.numel()
    got = torch.empty(m, dtype=torch.bool, device=ids.device)
    block = torch.empty(m, dtype=torch.long, device=ids.device)
    if m:
        _stack_take_kernel[(ids.shape[0],)](
            ids, top, ly.contiguous(), want.contiguous().view(torch.uint8), got.view(torch.uint8),
            block, m, ids.shape[1], int(keep), BLOCK=min(_BLOCK, triton.next_power_of_2(m)),
        )  # fmt: skip
    return got, block


def stack_give(
    ids: torch.Tensor, top: torch.Tensor, ly: torch.Tensor, block: torch.Tensor, mask: torch.Tensor
) -> None:
    """Push ``block[i]`` (int64 ``[m]``) onto layer ``ly[i]``'s stack where ``mask``, in pair
    order within a layer. Raises ``top`` in place."""
    _check(ids, top, ly, block=block, mask=mask)
    m = ly.numel()
    if m:
        _stack_give_kernel[(ids.shape[0],)](
            ids, top, ly.contiguous(), block.contiguous(), mask.contiguous().view(torch.uint8),
            m, ids.shape[1], BLOCK=min(_BLOCK, triton.next_power_of_2(m)),
        )  # fmt: skip
