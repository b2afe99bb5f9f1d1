"""NVIDIA kvpress presses on our tasks, written as rows our report reads (see docs/kvpress.md).

Runs in its own venv (kvpress 0.5.5 needs transformers < 5.3; ``bench/kvpress_env.sh``), so it
imports from this package only modules that do not need transformers 5.x (tasks, scoring,
runner's cache reader, report). Each sample is split at its last newline into context and
question (every single-turn task ends with its question on one line); kvpress's pipeline
applies the chat template around both, compresses the context during its prefill, then feeds
the question and decodes greedily. ``--question-in-context`` compresses the whole prompt
instead (the question then steers SnapKV's window, as it does in our engine).

    python -m tiered_radix.eval.kvpress_run --model smollm2-135m --presses snapkv,knorm \\
        --budgets 10%,20% --tasks needle,vt --lengths 2k --samples 3 --out results/kvpress
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .kvpress_engine import KVPressRunError
from .report import build_report, markdown_report, write_json
from .runner import RESULTS, answer_cap, load_results, parse_length, parse_shard, sample_fields
from .scoring import score
from .tasks import Sample, expand_tasks, make_samples

ENGINE = "kvpress"
FULL = "kvpress-full"  # the pipeline without a press: this run's full-KV reference
PRESSES = ("snapkv", "expected", "streaming", "observed", "knorm", "tova", "kivi2")


def compression_ratio(label: str) -> float:
    """Our budget label -> kvpress ``compression_ratio`` (the fraction removed): "10%" -> 0.9."""
    text = label.strip()
    try:
        kept = float(text[:-1]) / 100 if text.endswith("%") else None
    except ValueError:
        kept = None
    if kept is None or not 0 < kept <= 1:
        raise KVPressRunError(
            f"budget {label!r}: kvpress presses take a kept fraction of the context, "
            "e.g. 10% or 20% (above 0%, at most 100%); byte and token budgets have no press "
            "equivalent"
        )
    return round(1.0 - kept, 6)


def cell_key(model: str, policy: str, label: str, s: Sample, seed: int, cap, config: str) -> str:
    digest = hashlib.sha256(config.encode()).hexdigest()[:12]
    return json.dumps([ENGINE, model, policy, digest, label, s.key, seed, cap])


@dataclass(frozen=True)
class Config:
    """One column of the grid: our row's policy name and budget label, the press and ratio."""

    policy: str
    label: str
    press: str | None
    ratio: float


def configurations(presses: Sequence[str], labels: Sequence[str], in_context: bool) -> list:
    """The reference first, then every press at every budget (``kivi2`` once, at "100%" like
    our shipped ``kivi``: its bytes are what 2-bit codes cost, no budget binds it)."""
    for name in presses:
        if name not in PRESSES:
            close = difflib.get_close_matches(name, PRESSES, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise KVPressRunError(f"unknown press '{name}'.{hint} Presses: {', '.join(PRESSES)}")
    suffix = "+q" if in_context else ""
    out = [Config(FULL, "100%", None, 0.0)]
    for name in presses:
        budgets = ["100%"] if name == "kivi2" else labels
        for b in budgets:
            ratio = 0.0 if name == "kivi2" else compression_ratio(b)
            out.append(Config(f"kvpress-{name}{suffix}", b, name, ratio))
    return out


def record(
    s: Sample,
    c: Config,
    *,
    model: str,
    seed: int,
    max_new: int,
    key: str,
    prediction: str | None,
    stats: dict[str, Any],
    seconds: float,
    error: str | None = None,
) -> dict[str, Any]:
    """One results.jsonl row, with the fields and meaning ``runner.run_cell`` gives them."""
    rec: dict[str, Any] = {
        "key": key,
        "seed": seed,
        **sample_fields(
            s,
            engine=ENGINE,
            model=model,
            policy=c.policy,
            budget=c.label,
            reference=c.policy == FULL,
            max_new=max_new,
        ),  # fmt: skip
        "seconds": seconds,
    }
    if error is not None or prediction is None:
        return {**rec, "error": error or "no prediction"}
    rec.update(prediction=prediction, score=score(prediction, s.answers, s.metric), stats=stats)
    return rec


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tiered_radix.eval.kvpress_run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = p.add_argument
    add("--model", required=True, help="registry name (fetched) or Hugging Face folder")
    add("--name", default=None, help="model name written in the rows (default: --model)")
    add("--presses", default=",".join(PRESSES[:5]), help=f"from {', '.join(PRESSES)}")
    add("--budgets", default="10%,20%", help="kept fractions of the context")
    add("--tasks", default="needle,vt")
    add("--lengths", default="2k")
    add("--samples", type=int, default=3, help="per task and length (needle: per depth)")
    add("--seed", type=int, default=0)
    add("--max-new-tokens", type=int, default=None, help="caps each task's answer length")
    add("--question-in-context", action="store_true", help="compress the question too")
    add("--device", default="cpu")
    add("--dtype", default="float32")
    add("--threads", type=int, default=None)
    add("--max-minutes", type=float, default=None, help="start no sample after this")
    add("--shard", default="0/1", metavar="I/N", help="samples I, I+N, ... only")
    add("--out", required=True)
    return p.parse_args(argv)


def run(engine, samples: Sequence[Sample], configs: Sequence[Config], args) -> list[dict]:
    """Every cell not yet in ``OUT/results.jsonl`` (same key rule as ``runner.run_grid``);
    samples outer, so a cut run has every configuration on its first samples."""
    path = Path(args.out) / RESULTS
    path.parent.mkdir(parents=True, exist_ok=True)
    done = {r["key"]: r for r in load_results(path) if "error" not in r}
    cap, records, start = args.max_new_tokens, [], time.monotonic()
    with open(path, "a") as f:
        for s in tqdm(samples, desc="kvpress", unit="sample"):
            if args.max_minutes and time.monotonic() - start > 60 * args.max_minutes:
                print(f"kvpress_run: --max-minutes {args.max_minutes} reached", file=sys.stderr)
                break
            max_new = answer_cap(s, cap)
            keys = {}
            for c in configs:
                what = f"{c.press}/{c.ratio}/{args.question_in_context}/{args.dtype}"
                keys[c] = cell_key(engine.model, c.policy, c.label, s, args.seed, cap, what)
            records += [done[k] for k in keys.values() if k in done]
            todo = {c: (c.press, c.ratio) for c, k in keys.items() if k not in done}
            if not todo:
                continue
            t0, answers, err = time.perf_counter(), {}, None
            try:
                answers = engine.answer(
                    s.prompt, todo, max_new, in_context=args.question_in_context
                )
            except Exception as e:  # noqa: BLE001  (one failing sample must not end the run)
                err = f"{type(e).__name__}: {e}"
            seconds = (time.perf_counter() - t0) / len(todo)  # one shared prefill per group
            for c in todo:
                text, stats = answers.get(c, (None, {}))
                rec = record(s, c, model=engine.model, seed=args.seed, max_new=max_new,
                             key=keys[c], prediction=text, stats=stats, seconds=seconds,
                             error=err)  # fmt: skip
                f.write(json.dumps(rec) + "\n")
                records.append(rec)
            f.flush()
    return records


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 0: every cell ran; 1: some failed (listed in the report); 2: bad input."""
    args = parse_args(argv)
    try:
        labels = [b.strip() for b in args.budgets.split(",") if b.strip()]
        configs = configurations(args.presses.split(","), labels, args.question_in_context)
        tasks = expand_tasks(args.tasks)
        if "multiturn" in tasks:
            raise KVPressRunError("multiturn has no kvpress equivalent (one context, one answer)")
        lengths = [parse_length(x) for x in args.lengths.split(",")]
        first, every = parse_shard(args.shard)
        from .kvpress_engine import KVPressEngine

        engine = KVPressEngine(
            args.model, device=args.device, dtype=args.dtype, threads=args.threads
        )
    except (KVPressRunError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.name:
        engine.model = args.name
    samples = [
        s
        for t in tasks
        for n in lengths
        for s in make_samples(
            t, n, args.samples, engine.count_tokens, args.seed, engine.context_window
        )
        if s.index % every == first
    ]
    samples.sort(key=lambda s: s.index)  # index outer: a cut run has every task and length
    records = run(engine, samples, configs, args)
    question = "compressed with the context" if args.question_in_context else "after compression"
    meta = {
        "engine": ENGINE, "model": engine.model, **engine.versions, "seed": args.seed,
        "samples": args.samples, "lengths": lengths, "question": question,
        "device": args.device, "dtype": args.dtype, "shard": args.shard,
    }  # fmt: skip
    report = build_report(records, meta)
    write_json(report, Path(args.out) / "report.json")
    (Path(args.out) / "report.md").write_text(markdown_report(report))
    print(markdown_report(report))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
