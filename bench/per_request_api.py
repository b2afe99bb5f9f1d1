"""Per-request KV budgets and policies through the OpenAI API on one GPU server (issue 22).

1. Asks for ``--kv-policy qevict --kv-policies rdkv,full`` (``--refused``): the launch must stop
   before loading the model, naming why (rdkv repacks routed requests into private Zone A
   pages, full has token units); its message goes to ``refused.txt``.
2. Starts one server with ``--kv-policy qevict --kv-policies <--policies>`` (default
   ``examples/qevict_full70.yaml``, which stores windows as qevict does).
3. Over one shared ~8K-token prefix (``--prefix-tokens``, cached first at full precision by a
   one-token request) sends client A (``kv_budget`` 10%, the default policy) and client B
   (``kv_budget`` 50%, ``kv_policy`` the second loaded policy): each alone, then both at once
   (the radix cache flushed and the prefix cached again before each phase), greedy, a fixed
   number of tokens (``ignore_eos``) ending right after a routing (``--max-tokens`` 49: qevict
   routes at decode steps 0, 15, 31, 47).
4. Checks: every response's ``usage.kv`` holds at most its budget's bytes (plus the last,
   partial window at full precision, ``--slack-windows``); B holds more than A; each request
   gives the same text and the same KV usage alone and beside the other (isolation); a
   malformed budget and an unknown policy get 400 naming the accepted values; A's question
   streamed (``stream_options.include_usage``) reports ``usage.kv`` in its usage chunk.

Writes to ``--out`` (default ``bench/results/per-request-api``): ``responses.json`` (the real
response bodies), ``streamed.json``, ``errors.json`` (the 400 bodies), ``refused.txt``,
``summary.json`` (the checks), ``server.log``. Exit status 0 when every check passes.

    python3 -P bench/per_request_api.py --model /tmp/models/qwen2.5-0.5b
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `serving`, also under python -P
from serving.servers import Server  # noqa: E402

FACT = "Crate {i} in hold {h} carries {n} barrels of {good}, logged by deckhand {who}."
GOODS = ("olive oil", "salted cod", "indigo", "copper nails", "rye", "tallow", "pepper")
CREW = ("Ansel", "Bryn", "Corin", "Dagny", "Emrys", "Faye", "Gideon")
QUESTIONS = {
    "A": "Which goods does crate 17 carry, and who logged it? Answer in one sentence.",
    "B": "How many barrels are in crate 230, and in which hold? Answer in one sentence.",
}


def manifest(lines: int) -> str:
    """A ship's manifest of ``lines`` crates."""
    rows = ["You are the purser of the merchant ship Halcyon. The manifest follows."]
    for i in range(lines):
        rows.append(FACT.format(i=i, h=1 + i % 4, n=3 + (i * 7) % 40, good=GOODS[i % 7],
                                who=CREW[(i * 3) % 7]))  # fmt: skip
    return "\n".join(rows)


def prefix(tokens: int, model: str) -> tuple[str, int]:
    """A manifest of about ``tokens`` tokens of ``model``'s tokenizer, and its exact count (run
    16 sized it at a guessed 19 tokens a line: 11,132 tokens, past the server's window)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    count = lambda text: len(tok(text)["input_ids"])  # noqa: E731
    per_line = count(manifest(200)) / 200
    text = manifest(int(tokens / per_line))
    return text, count(text)


def post(url: str, body: dict, timeout: float = 600) -> tuple[int, dict]:
    """(HTTP status, the JSON body, or ``{"text": ...}`` for a plain-text one)."""
    head = {"Content-Type": "application/json"}
    req = urllib.request.Request(url, json.dumps(body).encode(), head)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    try:
        return status, json.loads(raw or b"{}")
    except ValueError:
        return status, {"text": raw.decode(errors="replace")}


def chat(base: str, text: str, question: str, max_tokens: int, **kv) -> tuple[int, dict]:
    """One chat completion; ``kv`` (kv_budget, kv_policy) as top-level fields, which is what
    the OpenAI client's ``extra_body`` sends."""
    body = {"model": "default", "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "system", "content": text},
                         {"role": "user", "content": question}], **kv}  # fmt: skip
    return post(base + "/v1/chat/completions", body)


def stream_chat(base: str, text: str, question: str, max_tokens: int, **kv) -> dict:
    """:func:`chat` streamed, asking for the usage chunk: its status, text and last usage."""
    body = {"model": "default", "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": text},
                         {"role": "user", "content": question}], **kv}  # fmt: skip
    head = {"Content-Type": "application/json"}
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(), head)
    parts, usage = [], None
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: ") :])
            for choice in event.get("choices") or []:
                parts.append((choice.get("delta") or {}).get("content") or "")
            usage = event.get("usage") or usage
    return {"status": r.status, "text": "".join(parts), "usage": usage}


def fresh_prefix(base: str, text: str) -> dict:
    """Flush the radix cache, then cache the shared prefix: one token, so no decode step routes
    it (qevict defers its prompt's routing to the first decode step): full precision."""
    status, _ = post(base + "/flush_cache", {})
    code, body = chat(base, text, "Ready?", 1)
    return {"flush": status, "seed": code, "seed_usage": body.get("usage")}


def run_phase(base: str, text: str, clients: dict, max_tokens: int) -> dict:
    """The ``clients`` (name -> kv fields) at once over a freshly cached prefix."""
    seeded = fresh_prefix(base, text)
    out, threads = {}, []
    for name, kv in clients.items():

        def go(name=name, kv=kv):
            out[name] = chat(base, text, QUESTIONS[name], max_tokens, **kv)

        threads.append(threading.Thread(target=go))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"seeded": seeded, **{n: {"status": s, "body": b} for n, (s, b) in out.items()}}


def check_bytes(kv: dict, slack_windows: int, window: int) -> dict:
    per_token = kv["bf16_bytes"] / kv["tokens"]
    allowed = kv["budget_bytes"] + slack_windows * window * per_token
    held, budget = kv["bytes_held"], kv["budget_bytes"]
    return {"bytes_held": held, "budget_bytes": budget, "allowed": int(allowed),
            "held_vs_budget": round(held / budget, 4), "ok": held <= allowed}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=os.environ.get("TR_MODEL_PATH", "/tmp/models/qwen2.5-0.5b"))
    p.add_argument("--out", default="bench/results/per-request-api")
    p.add_argument("--port", type=int, default=31100)
    p.add_argument("--mem", type=float, default=0.5)
    p.add_argument("--policies", default="examples/qevict_full70.yaml")
    p.add_argument("--refused", default="rdkv,full")
    p.add_argument("--budgets", default="10%,50%")
    p.add_argument("--prefix-tokens", type=int, default=8192)
    p.add_argument("--max-tokens", type=int, default=49)
    p.add_argument("--slack-windows", type=int, default=1)
    # a fixed split count: the decode kernel's float order is the same at batch 1 and 2
    p.add_argument(
        "--server-args", default="--kv-graph-splits 16", help="more server flags, one string"
    )
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    policies = ",".join(str(Path(x).resolve()) if Path(x).exists() else x
                        for x in a.policies.split(","))  # fmt: skip
    summary: dict = {"argv": sys.argv, "checks": {}}

    refused = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", a.model,
         "--kv-policy", "qevict", "--kv-policies", a.refused],
        capture_output=True, text=True, cwd="/tmp", timeout=300,
    )  # fmt: skip
    (out / "refused.txt").write_text(f"exit {refused.returncode}\n{refused.stderr[-4000:]}")
    summary["checks"]["mixed_set_refused"] = refused.returncode == 2 and "cannot share" in (
        refused.stderr
    )

    from tiered_radix.policy import load_policy

    second = load_policy(policies.split(",")[0]).name
    window = load_policy("qevict").v.size
    ba, bb = a.budgets.split(",")
    clients = {"A": {"kv_budget": ba}, "B": {"kv_budget": bb, "kv_policy": second}}
    extra = ["--kv-policy", "qevict", "--kv-policies", policies, *a.server_args.split()]
    text, n_prefix = prefix(a.prefix_tokens, a.model)
    summary["prefix_tokens"] = n_prefix
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", a.model,
           "--port", str(a.port), "--mem-fraction-static", str(a.mem),
           "--context-length", str(n_prefix + 2048), "--enable-cache-report",
           *extra]  # fmt: skip
    server = Server(cmd, a.port, out / "server.log")
    server.start()
    try:
        server.wait_healthy(600)
        phases = {
            "A alone": run_phase(server.url, text, {"A": clients["A"]}, a.max_tokens),
            "B alone": run_phase(server.url, text, {"B": clients["B"]}, a.max_tokens),
            "A and B": run_phase(server.url, text, clients, a.max_tokens),
        }
        streamed = stream_chat(server.url, text, QUESTIONS["A"], a.max_tokens, kv_budget=ba)
        errors = {
            "bad budget": chat(server.url, text[:2000], "Hi", 4, kv_budget="lots"),
            "unknown policy": chat(server.url, text[:2000], "Hi", 4, kv_policy="h2o"),
        }
    finally:
        server.stop()
    (out / "responses.json").write_text(json.dumps(phases, indent=1))
    (out / "errors.json").write_text(json.dumps(errors, indent=1))
    (out / "streamed.json").write_text(json.dumps(streamed, indent=1))

    checks = summary["checks"]
    got = {}
    for phase, res in phases.items():
        for name in clients:
            if name in res:
                r = res[name]
                checks[f"{phase}: {name} answered"] = r["status"] == 200
                got[(phase, name)] = r["body"] if r["status"] == 200 else None
    kvs = {k: (b or {}).get("usage", {}).get("kv") for k, b in got.items()}
    summary["bytes"] = {}
    for (phase, name), kv in kvs.items():
        if kv is None:
            checks[f"{phase}: {name} reports usage.kv"] = False
            continue
        c = check_bytes(kv, a.slack_windows, window)
        summary["bytes"][f"{phase}: {name}"] = c | {"policy": kv["policy"], "budget": kv["budget"],
                                                   "held_vs_bf16": kv["held_vs_bf16"]}  # fmt: skip
        checks[f"{phase}: {name} within budget"] = c["ok"]
    both = kvs.get(("A and B", "A")), kvs.get(("A and B", "B"))
    if all(both):
        checks["B (higher budget) holds more than A"] = (
            both[1]["bytes_held"] > both[0]["bytes_held"]
        )
    for name in clients:
        alone, beside = got.get((f"{name} alone", name)), got.get(("A and B", name))
        if alone and beside:
            ta, tb = (x["choices"][0]["message"]["content"] for x in (alone, beside))
            checks[f"{name}: same text alone and beside"] = ta == tb
            ka, kb = alone["usage"]["kv"], beside["usage"]["kv"]
            checks[f"{name}: same KV usage alone and beside"] = ka == kb
    skv = (streamed.get("usage") or {}).get("kv")
    checks["streamed: the usage chunk reports usage.kv at A's budget"] = bool(
        skv and skv["budget"] == ba
    )
    for what, (status, body) in errors.items():
        msg = json.dumps(body)
        names = "'8192 tokens'" if what == "bad budget" else f"'{second}'"
        checks[f"{what}: 400 naming the accepted values"] = status == 400 and names in msg
    summary["ok"] = all(checks.values())
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
