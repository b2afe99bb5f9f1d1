"""The move kernels' launchers refuse what they cannot run on. Their results are checked against
the pool's PyTorch path in ``tests/adapters/sglang_adapter/test_move_batched.py`` (SGLang's pool
is the twin), under the interpreter on CPU and compiled on CUDA."""

from __future__ import annotations

import pytest
import torch
from triton_guard import require_triton

require_triton()

from tiered_radix.kernels.moves import Codes, Stack, move_claim, move_refs  # noqa: E402

L, K, H, NW, m = 2, 3, 2, 5, 4
# the refusals below are checked after the launchers' device check: on a CUDA machine the
# tensors live there (a CPU one would be refused first, for its device)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def parts(dtype=torch.long, device=DEV):
    holds = torch.zeros(5, K, dtype=torch.uint8, device=device)
    codes = Codes(holds, full=0, q=1, r=2, restored=2, evicted=3)
    stack = Stack(torch.zeros(L, 9, dtype=torch.long, device=device),
                  torch.zeros(L, dtype=torch.long, device=device))  # fmt: skip
    pairs = [torch.zeros(m, dtype=dtype, device=device) for _ in range(5)]
    return codes, stack, pairs


def zeros(*shape, dtype=torch.long):
    return torch.zeros(*shape, dtype=dtype, device=DEV)


def claim(block, pairs, codes, stack):
    return move_claim(block, codes, stack, stack, *pairs, make_q=True, make_r=True, keep_rows=0,
                      evicts=True, tally=zeros(2), err=zeros(4))  # fmt: skip


def test_pairs_must_be_int64():
    codes, stack, pairs = parts(torch.int32)
    block = zeros(L, K, H, NW, dtype=torch.int32)
    with pytest.raises(ValueError, match="int64"):
        claim(block, pairs, codes, stack)


def test_the_table_must_be_contiguous_and_4d():
    codes, stack, pairs = parts()
    for block in (zeros(L, K, H, NW * 2, dtype=torch.int32)[..., ::2],
                  zeros(L, K, H * NW, dtype=torch.int32)):  # fmt: skip
        with pytest.raises(ValueError, match="contiguous"):
            move_refs(block, torch.zeros_like(block), codes, stack, stack, *pairs[:4], None,
                      tally=zeros(2), err=zeros(4))  # fmt: skip


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # on a CUDA machine too: CPU tables are refused
    codes, stack, pairs = parts(device="cpu")
    block = torch.zeros(L, K, H, NW, dtype=torch.int32)
    with pytest.raises(ValueError, match="kernels=False"):
        claim(block, pairs, codes, stack)
