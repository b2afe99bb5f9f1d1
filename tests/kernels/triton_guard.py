"""Skip a kernel test module when Triton cannot run here.

tests/conftest.py has already chosen the interpreter on machines without CUDA.
"""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()


def require_triton() -> None:
    pytest.importorskip("triton", reason="Triton is not installed")
    if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA and TRITON_INTERPRET is not 1", allow_module_level=True)
