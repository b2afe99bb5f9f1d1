"""Per-request budgets and policies on a GPU (issue 22): one server (``--kv-policy qevict
--kv-policies examples/qevict_full70.yaml``), two concurrent OpenAI clients over one shared
~8K-token prefix, A at ``kv_budget`` 10% and B at 50% with the other policy.

Every check of ``bench/per_request_api.py`` must hold: the mixed set ``rdkv,full`` is refused at
launch; each response's ``usage.kv`` is within its budget after its last routing; B holds more
than A; each client's text and KV usage are the same alone and beside the other; a malformed
budget and an unknown policy get 400 naming the accepted values.

Needs what ``test_sglang_e2e.py`` needs (a CUDA GPU, SGLang 0.5.17, ``$TR_MODEL_PATH``); the
responses go to ``$TR_E2E_OUT`` (default ``e2e-results``) ``/per-request-api``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from gpu_guard import ROOT, model_or_skip

MODEL = model_or_skip()

sys.path.insert(0, str(ROOT / "bench"))
import per_request_api  # noqa: E402


def test_two_clients_at_10_and_50_percent_over_one_prefix():
    out = Path(os.environ.get("TR_E2E_OUT", "e2e-results")) / "per-request-api"
    port = os.environ.get("TR_E2E_PORT", "31100")
    summary = per_request_api.main(
        ["--model", MODEL, "--out", str(out), "--port", port,
         "--policies", str(ROOT / "examples" / "qevict_full70.yaml")]
    )  # fmt: skip
    failed = [name for name, ok in summary["checks"].items() if not ok]
    assert not failed, (failed, summary["bytes"])
