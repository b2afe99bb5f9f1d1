"""``tiered-radix chat``: a short multi-turn chat whose KV cache is run by a policy.

Runs greedy decoding through the transformers adapter and prints each answer with the tier
occupancy, the KV bytes held against full bf16 KV, and how many tokens were reused from earlier
turns. The default script opens with a ~1,300-token ship's log (so a 10% budget can bind: the
protected sinks and recent window alone are ~100 tokens) and later asks for a fact from it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..policy import load_policy

_PORTS = ("Bergen", "Reykjavik", "Nuuk", "Tromso", "Longyearbyen")
_WEATHER = ("calm seas", "a grey swell", "fog until noon", "a strong westerly", "light rain")


def _ship_log() -> str:
    lines = [
        "Log of the research ship Marigold, which left the port of Bergen on the first of June "
        "to count seabirds along the Arctic coast."
    ]
    for day in range(1, 31):
        port, fixed = _PORTS[day % len(_PORTS)], ("winch", "radar", "galley stove")[day % 3]
        lines.append(
            f"Day {day}: {_WEATHER[day % len(_WEATHER)]}; we sailed {40 + (day * 7) % 55} "
            f"nautical miles towards {port}. The crew counted {120 + (day * 37) % 400} birds, "
            f"mostly puffins and kittiwakes, and repaired the {fixed}."
        )
        if day == 3:
            lines.append(
                "On day 3 the cook, Tomas, found a green glass bottle in the net. The note inside "
                "was signed by Captain Ilse Moreno and asked the finder to plant a tree."
            )
    return "\n".join(lines)


def default_turns() -> list[str]:
    return [
        f"{_ship_log()}\n\nRead the log above. In two sentences, what was the Marigold doing?",
        "Which port did the Marigold leave from?",
        "Write a two-line poem about puffins.",
        "Back to the log: who signed the note in the green glass bottle?",
    ]


def read_turns(path: str) -> list[str]:
    """Turns separated by lines holding only ``---``; without separators, one turn per line."""
    text = Path(path).read_text(encoding="utf-8")
    parts = text.split("\n---\n") if "\n---\n" in f"\n{text}\n" else text.splitlines()
    return [t.strip() for t in parts if t.strip() and t.strip() != "---"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default="smollm2-135m",
                   help="offline model name (fetched if needed) or a HF folder")  # fmt: skip
    p.add_argument("--policy", "-p", default="qevict", help="policy path or shipped name")
    p.add_argument("--budget", help="override the policy's budget, e.g. 10%%")
    p.add_argument("--turns", metavar="FILE",
                   help="user turns: separated by '---' lines, else one per line "
                        "(default: a scripted 4-turn chat)")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=48, help="per answer (default 48)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if available")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")


def _error(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _load(folder: Path, device: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    return tok, model.to(device).eval()


def run(args: argparse.Namespace) -> int:
    """Exit 0, or 2 on an argument, policy, turns-file or model error (checked before loading)."""
    from ..models import ModelError, fetch
    from ..sim.simulate import parse_budget

    if args.max_new_tokens < 1:
        return _error(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.threads is not None and args.threads < 1:
        return _error(f"--threads must be at least 1, got {args.threads}")
    policy = load_policy(args.policy)  # PolicyError -> exit 2 in main
    budget = parse_budget(args.budget) if args.budget else None
    try:
        turns = read_turns(args.turns) if args.turns else default_turns()
    except OSError as e:
        return _error(f"cannot read --turns file: {e}")
    if not turns:
        return _error(f"--turns file {args.turns} holds no turns")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        return _error("--device cuda: this torch build sees no CUDA device; use --device cpu")
    start = time.perf_counter()
    try:
        folder = Path(args.model) if Path(args.model).is_dir() else fetch(args.model)
    except ModelError as e:
        return _error(str(e))
    from ..adapters.transformers import ChatSession

    tok, model = _load(folder, device)
    session = ChatSession(model, tok, policy, budget=budget,
                          max_new_tokens=args.max_new_tokens, progress=True)  # fmt: skip
    c, dtype = session.cache, str(model.dtype).removeprefix("torch.")
    print(f"model {args.model}: {c.n_layers} layers x {c.n_heads} KV heads x {c.head_dim}, "
          f"{device} {dtype}; policy {policy.name}, budget {budget or policy.budget} "
          f"(loaded in {time.perf_counter() - start:.1f} s)")  # fmt: skip
    unit = "windows" if policy.v.kind == "window" else "tokens"
    done, chat_start = [], time.perf_counter()
    for i, text in enumerate(turns, 1):
        print(f"\n[{i}/{len(turns)}] you: {_shorten(text)}", flush=True)
        done.append(session.ask(text))
        print(f"        bot: {done[-1].text or '(empty answer)'}")
        print(f"        kv: {_kv_line(done[-1], unit)}", flush=True)
    _summary(session, done, time.perf_counter() - chat_start, time.perf_counter() - start)
    return 0


def _shorten(text: str, keep: int = 70) -> str:
    if len(text) <= 2 * keep + 20:
        return text
    return f"{text[:keep]} [... {len(text) - 2 * keep:,} characters ...] {text[-keep:]}"


def _kv_line(t, unit: str) -> str:
    occ = " / ".join(f"{k} {v:,}" for k, v in t.occupancy.items())
    over = "; OVER BUDGET (forced content alone exceeds it)" if t.over_budget else ""
    return (
        f"{t.reused_tokens + t.prefill_tokens + t.new_tokens:,} tokens ({t.prefill_tokens:,} "
        f"prefilled, {t.reused_tokens:,} reused, {t.new_tokens} generated) | {unit}: {occ} | "
        f"{_mib(t.bytes_used)} of {_mib(t.full_bytes)} full KV "
        f"({t.bytes_used / t.full_bytes:.1%}; budget {_mib(t.budget_bytes)}){over}"
        f"{_archive(t)} | {t.seconds:.1f} s"
    )


def _archive(t) -> str:
    """The archive (``evict(archive=...)``): held outside the budget, so said apart."""
    if not (t.archived_bytes or t.recalled):
        return ""
    return (
        f" + archived {_mib(t.archived_bytes)} ({t.archived_bytes / t.full_bytes:.1%}, outside "
        f"the budget; {t.recalled:,} units recalled at this turn's start)"
    )


def _held(t) -> str:
    if not t.archived_bytes:
        return ""
    held = t.bytes_used + t.archived_bytes
    return f"; with the archive {_mib(held)} ({1 - held / t.full_bytes:.1%} saved)"


def _summary(session, turns, chat_s: float, total_s: float) -> None:
    last, c = turns[-1], session.cache.store.events.counters
    gen = sum(t.new_tokens for t in turns)
    whole = sum(t.reused_tokens + t.prefill_tokens for t in turns)  # without prefix reuse
    prefilled = sum(t.prefill_tokens for t in turns)
    print(f"\nsummary: {len(turns)} turns, {session.cache.n_tokens():,} tokens cached, {gen} "
          f"generated in {chat_s:.1f} s ({total_s:.1f} s with loading)\n"
          f"  KV {_mib(last.bytes_used)} vs {_mib(last.full_bytes)} full bf16 KV "
          f"({1 - last.bytes_used / last.full_bytes:.1%} saved)"
          f"{_held(last)}\n"
          f"  prefix reuse: {prefilled:,} tokens prefilled in all; re-prefilling the whole "
          f"conversation each turn would have been {whole:,}\n"
          f"  transitions: promote {c['promote']}, demote {c['demote']}, evict {c['evict']}, "
          f"ledger writes {c['ledger_write']}")  # fmt: skip
