"""Batch invariance end to end on a GPU: under each shipped policy (and plain SGLang, the
reference), ``N`` prompts sent as one batch and then one at a time get the same greedy texts, and
the policy moves the same units both ways (issue 21, failure 3); then ``CHATS`` conversations of
three turns each (``chat_turns``: radix hits on their own history, none on another's), every
turn sent as one batch and then one conversation at a time, get the same answers.

The prompts (~1.3K to ~2.6K tokens each, a distinct passphrase at a distinct depth, and distinct
first words so that no two share a radix prefix) are longer than ``--chunked-prefill-size``
(default 1024 here), so sent together they share each prefill batch's token budget: SGLang alone
would cut their chunks at other positions than one at a time. The plugin cuts every chunk at a
routing point (a multiple of the chunk size from the request's token 0, or the prompt's end;
docs/sglang.md, *Batch invariance*), so routing, and with it the tiers, happen at the same
positions both ways. The radix cache is flushed between the two phases.

Needs what ``test_sglang_e2e.py`` needs (a CUDA GPU, SGLang 0.5.17, ``$TR_MODEL_PATH``) and
shares its ``$TR_E2E_PORT`` and ``$TR_E2E_MEM``. Policies: ``$TR_BI_POLICIES`` (comma separated;
default ``none`` (plain SGLang) and every shipped policy), at their own budgets unless
``$TR_BI_BUDGET`` is set; ``$TR_BI_N`` prompts (default 8); ``$TR_BI_CHUNK`` the chunked prefill
size; ``$TR_E2E_ARGS`` more server flags. Texts and counters go to ``$TR_E2E_OUT`` (default
``e2e-results``) as ``batch-<policy>.json``.

Where a kernel's reduction order depends on the batch (GEMMs of another M, decode graphs of
another batch size), outputs may differ in the last bits; plain SGLang's row shows whether the
model's own path is batch invariant on this GPU. On the H100 of GPU run 24 it is not (2 of 8
texts changed: SGLang cuts a batch's chunks elsewhere than a lone request's): its case is then an
``xfail`` naming the prompts, its texts in the JSON. The tiered policies must hold regardless:
identical texts, and identical transition counters (routings planned, demotions, promotions,
evictions) counted from after the server's own warm-up request. GPU run 29 (H100): qevict's
and rdkv's tiers and counters equal both ways, one of qevict's texts not (the float order of
decode graphs of another batch size). ``TR_E2E_ARGS=--enable-deterministic-inference`` runs
the servers with SGLang's batch-invariant GEMMs and the decode kernel's splits fixed
(docs/sglang.md, *Batch invariance*); the JSON records the flags.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (runs on the GPU machine)", allow_module_level=True)
pytest.importorskip("sglang", reason="needs SGLang 0.5.17")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_sglang_e2e as e2e  # noqa: E402  (skips without $TR_MODEL_PATH)
from needle_text import FILLER  # noqa: E402

SHIPPED = sorted(p.stem for p in (e2e.ROOT / "policies").glob("*.yaml"))
DEFAULT = ",".join(["none", *SHIPPED])
POLICIES = [p for p in os.environ.get("TR_BI_POLICIES", DEFAULT).split(",") if p]
BUDGET = os.environ.get("TR_BI_BUDGET")
N = int(os.environ.get("TR_BI_N", "8"))
CHUNK = os.environ.get("TR_BI_CHUNK", "1024")
# the longest a batch may take to answer: a request SGLang never admits fails the case here
# instead of running into the caller's limit (GPU run 32's plain row waited 5 minutes: ALIGN)
REPLY_S = 180
# Under --enable-deterministic-inference SGLang cuts chunked prefills at multiples of a
# "truncation alignment" (4096 by default for its triton and FlashInfer backends) and never
# admits a prompt longer than a chunk whose chunk is shorter than that: it waits in the queue
# and nothing is logged (schedule_policy.PrefillAdder.add_one_req, 0.5.17). The plain row's
# server aligns to the chunk size instead. The tiered backend has no alignment of its own: its
# chunks end at routing points (docs/sglang.md, *Batch invariance*).
ALIGN = {"SGLANG_TRITON_PREFILL_TRUNCATION_ALIGN_SIZE": CHUNK,
         "SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE": CHUNK}  # fmt: skip
FIRST = ["Amber", "Basalt", "Cedar", "Dune", "Ember", "Fjord", "Garnet", "Harbor", "Iris",
         "Juniper", "Kestrel", "Lagoon"]  # fmt: skip
# the stats file's counters compared ("planned": routings that planned, deferred prefill
# chunks' not counted: whether SGLang cut a prompt into 2 or 3 chunks changes nothing their
# tiers depend on) and recorded (how the two runs got there: GPU run 27's qevict batch routed
# 27 times to 23 alone, the same transitions: the routes counter counts deferred chunks too)
COUNTERS = ("planned", "demote", "promote", "evict")
RECORDED = ("routes", "deferred_routings", "dropped_routings", "request_decode_steps",
            "rows_routings")  # fmt: skip


def prompts(n: int) -> list[str]:
    """``n`` needle prompts of 45 to 115 filler sentences (~26 tokens each), each with its own
    passphrase at its own depth, each beginning with its own word."""
    out = []
    for i in range(n):
        hay = FILLER * (45 + (i * 37) % 71)
        cut = len(hay) * (1 + i % 4) // 5
        needle = f"The secret passphrase is {FIRST[i % len(FIRST)].lower()}-{17 * i + 3}. "
        out.append(f"{FIRST[i % len(FIRST)]} archive, volume {i}. " + hay[:cut] + needle
                   + hay[cut:] + "\nWhat is the secret passphrase?")  # fmt: skip
    return out


def generate(texts: list[str], max_tokens: int = 32) -> list[dict]:
    """Greedy completions through SGLang's native ``/generate`` (a list is one batch): each
    output's text, tokens and the request's KV usage report (``meta_info["kv_usage"]``: its
    units per state at its end, its transitions and routings; None under plain SGLang)."""
    body = {"text": texts, "sampling_params": {"temperature": 0, "max_new_tokens": max_tokens}}
    req = urllib.request.Request(
        f"http://127.0.0.1:{e2e.PORT}/generate", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=REPLY_S) as r:
        out = json.loads(r.read())
    return [{"text": x["text"], "tokens": x["meta_info"].get("completion_tokens"),
             "kv": x["meta_info"].get("kv_usage")} for x in out]  # fmt: skip


CHATS = 4  # conversations of the chat case, TURNS turns each
TURNS = ("Here are my notes. {notes} My locker code is {code}. Please remember it.",
         "Summarize the notes in one sentence.", "What is my locker code?")  # fmt: skip


def chat_turns(together: bool) -> list[list[str]]:
    """The chat case: ``CHATS`` conversations of ``TURNS`` (the first ~1.2K tokens of notes and
    a locker code), each turn sent with the conversation so far through the model's chat
    template (a later turn hits the radix cache of the earlier ones). ``together``: every
    conversation's turn ``k`` in one batch; else one conversation at a time. Each
    conversation's answers, turn by turn.

    Each conversation opens with its own system line, so that none reuses another's prefix:
    under a lossy policy a reused prefix is read at the tiers its first owner's routings left,
    and the two orders share different spans (GPU run 33, qevict: the notes' first 1,024 tokens
    batched, 1,056 to 1,536 one at a time), which is the cache's history, not the batch."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(e2e.MODEL)
    history = [[{"role": "system", "content": f"{FIRST[i % len(FIRST)]} desk. You are a "
                 "helpful assistant."}] for i in range(CHATS)]  # fmt: skip
    for turn in TURNS:
        for i in range(CHATS):
            said = turn.format(notes=FILLER * (40 + 9 * i), code=4100 + 37 * i)
            history[i].append({"role": "user", "content": said})
        texts = [tok.apply_chat_template(h, tokenize=False, add_generation_prompt=True)
                 for h in history]  # fmt: skip
        outs = generate(texts) if together else [generate([t])[0] for t in texts]
        for h, out in zip(history, outs, strict=True):
            h.append({"role": "assistant", "content": out["text"]})
    return [[m["content"] for m in h if m["role"] == "assistant"] for h in history]


def usage_differs(a: dict | None, b: dict | None) -> dict:
    """The fields of two requests' KV usage reports that differ: ``{field: (a, b)}``."""
    a, b = a or {}, b or {}
    return {k: (a.get(k), b.get(k)) for k in sorted({*a, *b}) if a.get(k) != b.get(k)}


def flush(wait_s: float = 60.0) -> None:
    """``/flush_cache``, which SGLang refuses (400) while a request is still in its scheduler:
    right after the responses, the overlap loop may still hold the last batch (GPU run 28's
    qevict and rdkv cases failed there)."""
    end = time.time() + wait_s
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{e2e.PORT}/flush_cache", timeout=60).read()
            return
        except urllib.error.HTTPError as err:
            if err.code != 400 or time.time() > end:
                raise
            time.sleep(0.5)


def counters(stats: Path) -> dict[str, int]:
    s = json.loads(stats.read_text()) if stats.exists() else {}
    out = {k: int(s.get(k, 0)) for k in (*RECORDED, *COUNTERS) if k != "planned"}
    return out | {"planned": out["routes"] - out["deferred_routings"]}


def launch(policy: str, log: Path):
    cmd = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", e2e.MODEL,
        "--port", str(e2e.PORT), "--mem-fraction-static", e2e.MEM, "--context-length", "8192",
        "--chunked-prefill-size", CHUNK, "--cuda-graph-max-bs-decode", "16",
    ]  # fmt: skip
    if policy != "none":
        cmd += ["--kv-policy", policy] + (["--kv-budget", BUDGET] if BUDGET else [])
        cmd += ["--kv-stats", str(log.resolve().with_suffix(".stats.json"))]
    else:  # SGLang's Hopper default, FA3, is not in the staged wheels (run 23 died on it)
        cmd += ["--attention-backend", "triton"]
    cmd += e2e.EXTRA
    f = open(log.resolve(), "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=os.environ | ALIGN,
                            cwd=log.resolve().parent)  # fmt: skip


@pytest.mark.parametrize("policy", POLICIES)
def test_texts_are_the_same_in_a_batch_and_alone(policy):
    e2e.OUT.mkdir(parents=True, exist_ok=True)
    log = e2e.OUT / f"batch-{policy}.log"
    stats = log.resolve().with_suffix(".stats.json")
    stats.unlink(missing_ok=True)
    texts = prompts(N)
    proc = launch(policy, log)
    try:
        e2e.wait_healthy(proc, log)
        # SGLang's own warm-up request (before the server reports ready) routed too: count
        # from here (GPU run 24 compared the batch's counters, warm-up included, with the lone
        # requests')
        before = counters(stats)
        t0 = time.time()
        together = generate(texts)
        # the stats file is rewritten after each routing that planned and at flush_cache (so
        # counters that move between routings, e.g. request_decode_steps, are read current)
        flush()
        after_batch = counters(stats)
        alone = [generate([t])[0] for t in texts]
        flush()
        after_alone = counters(stats)
        elapsed = time.time() - t0
        chats_together = chat_turns(together=True)
        flush()
        chats_alone = chat_turns(together=False)
    finally:
        e2e.stop(proc)
    batch_all = {k: after_batch[k] - before[k] for k in after_batch}
    alone_all = {k: after_alone[k] - after_batch[k] for k in after_alone}
    batch_counts, alone_counts = ({k: c[k] for k in COUNTERS} for c in (batch_all, alone_all))
    pairs = list(zip(together, alone, strict=True))
    differ = [i for i, (a, b) in enumerate(pairs) if a["text"] != b["text"]]
    chat_differ = [(i, k) for i in range(CHATS) for k in range(len(TURNS))
                   if chats_together[i][k] != chats_alone[i][k]]  # fmt: skip
    # each request's tiers at its end, its transitions and routings: the same both ways
    kv_differ = {i: d for i, (a, b) in enumerate(pairs) if (d := usage_differs(a["kv"], b["kv"]))}
    result = {
        "policy": policy, "budget": BUDGET, "chunk": int(CHUNK), "n": N, "differ": differ,
        "kv_differ": kv_differ, "together": together, "alone": alone,
        "counters_together": batch_counts,
        "counters_alone": alone_counts, "recorded_together": batch_all,
        "recorded_alone": alone_all, "seconds": elapsed,
        "server_args": os.environ.get("TR_E2E_ARGS", ""), "server_env": ALIGN,
        "chat_differ": chat_differ, "chats_together": chats_together, "chats_alone": chats_alone,
    }  # fmt: skip
    (e2e.OUT / f"batch-{policy}.json").write_text(json.dumps(result, indent=1))
    if policy == "none" and (differ or chat_differ):  # the reference: SGLang's own path
        pytest.xfail(f"plain SGLang's texts change with the batch: needles {differ} of {N}, "
                     f"chat turns {chat_differ}")  # fmt: skip
    assert not differ, [(i, together[i]["text"], alone[i]["text"]) for i in differ]
    assert not chat_differ, [(i, k, chats_together[i][k], chats_alone[i][k])
                             for i, k in chat_differ]  # fmt: skip
    if policy != "none":
        assert batch_counts["planned"] > 0, "the policy never routed"
        assert all(a["kv"] for a, _ in pairs), "a request came back without its KV usage"
        assert not kv_differ, kv_differ
        assert batch_counts == alone_counts, (batch_counts, alone_counts)
