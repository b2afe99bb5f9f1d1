"""End to end on a GPU: ``sglang.launch_server --kv-policy P`` serves a real model; a multi-turn
chat hits the radix cache with tiers active (RDKV too: the tree keeps full-precision windows,
each request repacks its own pages at its routing); a needle question at ~2.7K tokens is
answered.

Needs a CUDA GPU, SGLang 0.5.17 and a model folder in ``$TR_MODEL_PATH`` (on the GPU machine:
``/tmp/models/qwen2.5-0.5b`` after ``../shared/gpu/stage.py --model qwen2.5-0.5b``). Policies:
``$TR_E2E_POLICIES`` (comma separated; default every shipped policy). Results (answers, cache
hits, the backend's tier counters) go to ``$TR_E2E_OUT`` (default ``e2e-results``) as JSON.
``$TR_E2E_TP=2`` serves with ``--tp 2`` (two GPUs) and checks that both ranks routed the same
requests at the same steps over the same whole-model byte counts (the ``tp`` digest of each
rank's stats file). ``$TR_E2E_ARGS`` adds server flags (e.g. ``--disable-cuda-graph
--kv-decode gather``: decode through PyTorch instead of the TriZone kernel).
``$TR_E2E_PORT`` (default 31000) and ``$TR_E2E_MEM`` (``--mem-fraction-static``, default 0.5) let
several of these runs share one GPU, each with its own policies.

Budgets: the checks of answer quality run at ``--kv-budget 50%`` for tiered policies (at 10%
a conversation of a few hundred tokens keeps only its protected sinks and recent window); the
full-KV policy must answer everything.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from gpu_guard import ROOT, model_or_skip

MODEL = model_or_skip()
import torch  # noqa: E402

sys.path.insert(0, str(ROOT / "examples"))
from multiturn_chat import chat  # noqa: E402
from needle_text import question  # noqa: E402

SHIPPED = sorted(p.stem for p in (ROOT / "policies").glob("*.yaml"))
POLICIES = [p for p in os.environ.get("TR_E2E_POLICIES", ",".join(SHIPPED)).split(",") if p]
OUT = Path(os.environ.get("TR_E2E_OUT", "e2e-results"))
TP = int(os.environ.get("TR_E2E_TP", "1"))
EXTRA = shlex.split(os.environ.get("TR_E2E_ARGS", ""))
if TP > torch.cuda.device_count():
    pytest.skip(f"TR_E2E_TP={TP} needs {TP} GPUs", allow_module_level=True)
PORT = int(os.environ.get("TR_E2E_PORT", "31000"))
MEM = os.environ.get("TR_E2E_MEM", "0.5")


def _get(url: str, timeout: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except OSError:
        return 0


def launch(policy: str, budget: str | None, log: Path) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", MODEL, "--port", str(PORT),
        "--enable-cache-report", "--mem-fraction-static", MEM, "--context-length", "8192",
        "--kv-policy", policy, "--tp", str(TP), "--cuda-graph-max-bs-decode", "8",
    ]  # fmt: skip
    if budget:
        cmd += ["--kv-budget", budget]
    cmd += ["--kv-stats", str(log.with_suffix(".stats.json").resolve()), *EXTRA]
    env = dict(os.environ)
    log = log.resolve()
    f = open(log, "w")  # noqa: SIM115 - closed with the process
    # cwd outside the checkout: `python -m` puts cwd first on sys.path, and the source tree's
    # tiered_radix has no `kernels` subpackage (setuptools maps it from the top-level kernels/)
    return subprocess.Popen(
        cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=log.parent.resolve()
    )


def wait_healthy(proc: subprocess.Popen, log: Path, limit: float = 300) -> None:
    t0 = time.time()
    while time.time() - t0 < limit:
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        if _get(f"http://127.0.0.1:{PORT}/health") == 200:
            return
        time.sleep(2)
    raise AssertionError(f"server not healthy after {limit}s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# Needles a policy loses by its own tier decisions, not the server's: through the tier engine
# (the transformers adapter, bench/needle_transformers.py) the same prompt gets the same answer.
LOSES_NEEDLE = {
    "kivi": "kivi keeps only the newest 128 tokens above 2 bits and loses this needle on this "
    "model; the transformers adapter gives the server's answer word for word "
    "(bench/results/needle-transformers-cpu/)",
    "streaming": "at 50% streaming keeps the sinks and the newest half, and the needle sits a "
    "third into the prompt (the transformers adapter loses it too: "
    "bench/results/needle-transformers-cpu/)",
}


@pytest.mark.parametrize("policy", POLICIES)
def test_serves_multiturn_and_needle(policy):
    OUT.mkdir(parents=True, exist_ok=True)
    budget = None if policy == "full" else "50%"
    name = Path(policy).stem  # a shipped name, or a policy file's (TR_E2E_POLICIES=path.yaml)
    log = OUT / (f"{name}.log" if TP == 1 else f"{name}.tp{TP}.log")
    proc = launch(policy, budget, log)
    try:
        wait_healthy(proc, log)
        t0 = time.time()
        rows = chat(f"http://127.0.0.1:{PORT}/v1", max_tokens=40)
        needle = chat(f"http://127.0.0.1:{PORT}/v1", turns=(question(),), max_tokens=24)[0]
        elapsed = time.time() - t0
    finally:
        stop(proc)
    files = [log.with_suffix(".stats.json")]
    if TP > 1:
        files = [log.with_suffix(f".stats.rank{r}.json") for r in range(TP)]
    ranks = [json.loads(f.read_text()) if f.exists() else {} for f in files]
    stats = ranks[0]
    result = {
        "policy": policy, "budget": budget, "tp": TP, "turns": rows, "needle": needle,
        "stats": stats if TP == 1 else ranks, "seconds": elapsed,
    }  # fmt: skip
    (OUT / log.with_suffix(".json").name).write_text(json.dumps(result, indent=1))
    if TP > 1 and policy != "full":
        tp = [r.get("tp", {}) for r in ranks]
        assert all(t.get("routes", 0) > 0 for t in tp), tp
        assert len({t["digest"] for t in tp}) == 1, f"ranks routed differently: {tp}"
        assert len({t["routes"] for t in tp}) == 1, tp
    assert all(r["answer"].strip() for r in rows), rows
    assert all(r["cached"] > 0 for r in rows[1:]), "later turns must hit the radix cache"
    assert needle["prompt"] > 2500
    if policy == "qevict":  # decode replays CUDA graphs (the stats file is as of the last routing)
        assert stats.get("host_s", {}).get("graph_steps", 0) > 0, stats.get("host_s")
    if policy == "full":
        assert "tangerine" in needle["answer"].lower(), needle
        assert "miso" in rows[-1]["answer"].lower(), rows[-1]
        return
    assert stats.get("routes", 0) > 0, "the policy never routed"
    tiers = [p for p in ("demote", "evict") if stats.get(p, 0) > 0]
    assert tiers, f"no demotion or eviction happened: {stats}"
    found = "tangerine" in needle["answer"].lower()
    if not found and policy in LOSES_NEEDLE:
        pytest.xfail(LOSES_NEEDLE[policy])
    assert found, needle
