"""Where a Triton kernel of this package can run."""

from __future__ import annotations

import os

import torch


def triton_runs_on(t: torch.Tensor) -> bool:
    """A CUDA tensor, or any tensor under ``TRITON_INTERPRET=1`` (Triton's CPU interpreter, the
    kernels' CPU tests)."""
    return t.device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"
