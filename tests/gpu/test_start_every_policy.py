"""Every shipped policy starts on the GPU (issue 21, failure 1): ``sglang.Engine(kv_policy=P,
mem_fraction_static=0.5, context_length=32768)`` comes up, generates, and its pool holds at
least one whole context, with the sizing's byte split for its slots (``bench/issue21_gpu.py
start`` records the same for all policies in one file).

Needs a CUDA GPU, SGLang 0.5.17 and a model folder in ``$TR_MODEL_PATH`` (as
``test_sglang_e2e.py``). One engine at a time, ~1 minute each.
"""

from __future__ import annotations

import sys

import pytest
from gpu_guard import ROOT, model_or_skip

MODEL = model_or_skip()
sys.path.insert(0, str(ROOT / "bench"))
import issue21_gpu  # noqa: E402

SHIPPED = sorted(p.stem for p in (ROOT / "policies").glob("*.yaml"))


@pytest.mark.parametrize("policy", SHIPPED)
def test_the_policy_starts_at_half_the_memory_with_a_32k_context(policy):
    rec = issue21_gpu.start(MODEL, policy)
    assert rec["ok"], f"{rec.get('error')}\n{rec.get('trace')}"
    assert rec["max_total_num_tokens"] >= 32768, rec
    split = rec["split_gib"]
    assert split["total"] > 0 and split["rows"] > 0, rec
    assert rec["text"].strip(), rec  # it generated
