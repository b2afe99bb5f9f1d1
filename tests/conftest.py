"""Test-wide setup: on a machine without CUDA, Triton kernels run in the interpreter.

This must happen before anything imports triton, so it lives here rather than in test modules.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
