"""`tiered-radix eval`: run policies x budgets x tasks x lengths on a model and report scores.

Writes ``OUT/results.jsonl`` (one line per cell, the resume cache), ``OUT/report.json``,
``OUT/report.md`` and PNG plots, and prints the table. Exit codes: 0 every cell ran; 1 some
cells failed (reported, the others scored); 2 invalid input or an engine that cannot start.

Several processes (or GPUs) split one grid with ``--shard I/N`` (samples ``I, I+N, ...``), each
into its own folder; ``--report-from DIR...`` then merges their ``results.jsonl`` (and those of
``python -m tiered_radix.eval.kvpress_run``) into ``OUT`` and writes one report, running nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from ..policy import PolicyError, load_policy


class UsageError(ValueError):
    pass


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", default="transformers", choices=["transformers", "sglang"])
    p.add_argument("--model", default="smollm2-135m", help="registry name or model folder")
    p.add_argument(
        "--model-path", default=None, metavar="DIR", help="a Hugging Face folder (beats --model)"
    )
    p.add_argument(
        "--policies",
        nargs="+",
        default=["full"],
        metavar="POLICY",
        help="policy files or shipped names; full KV is always run as the reference",
    )
    p.add_argument(
        "--budgets",
        default="",
        help="comma-separated budgets, e.g. 5%%,10%%,20%% (default: each policy's own)",
    )
    p.add_argument(
        "--tasks",
        default="ruler,needle,multiturn",
        help="task names or groups (ruler), comma-separated",
    )
    p.add_argument("--lengths", default="1k", help="target prompt lengths in tokens, e.g. 1k,2k")
    p.add_argument(
        "--samples", type=int, default=4, help="samples per task and length (needle: per depth)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max-new-tokens", type=int, default=None, help="cap on every task's answer length"
    )
    p.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="start no new sample after this many minutes (counted from launch); reports are "
        "still written from what finished",
    )
    p.add_argument(
        "--attention",
        choices=["exact", "fast"],
        default=None,
        help="exact: the adapter's float32 attention (default on CPU); fast: sdpa prefill and "
        "batched-matmul decode (default on CUDA)",
    )
    p.add_argument(
        "--no-shared-prefill",
        dest="shared_prefill",
        action="store_false",
        help="prefill every (policy, budget) separately instead of once per sample",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        metavar="N",
        help="--engine transformers: prefill prompts in chunks of N tokens, routing after each, "
        "as a server's chunked prefill does (implies --no-shared-prefill)",
    )
    p.add_argument(
        "--stop-when-answered",
        action="store_true",
        help="end a decode once the text holds every answer string (scores cannot change)",
    )
    p.add_argument(
        "--no-diagnostics", dest="diagnostics", action="store_false", help="skip FMM/LIR/churn"
    )
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="--engine sglang: a sglang.Engine argument, e.g. attention_backend=triton "
        "mem_fraction_static=0.5 (repeat the flag)",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (1 is fastest on a busy host)"
    )
    p.add_argument(
        "--shard",
        default="0/1",
        metavar="I/N",
        help="run samples I, I+N, I+2N, ... only (split a grid over N processes)",
    )
    p.add_argument(
        "--report-from",
        nargs="+",
        default=None,
        metavar="DIR",
        help="run nothing: merge these folders' results.jsonl into --out and report them",
    )
    p.add_argument("--out", default="eval-results", help="folder for results and reports")


def run(args: argparse.Namespace) -> int:
    start = time.monotonic()
    if args.report_from:
        return report_from(args)
    from ..eval import EngineError, Grid, TaskError, TransformersEngine, expand_tasks, run_grid
    from ..eval.runner import parse_length, parse_shard, process_cuda_peak_mib

    try:
        if args.samples < 1:
            raise UsageError(f"--samples must be at least 1, got {args.samples}")
        tasks = expand_tasks(args.tasks)
        lengths = [parse_length(x) for x in args.lengths.split(",") if x.strip()]
        budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
        policies = [load_policy(p) for p in args.policies]
        configs_check(budgets)
        if args.model_path is not None and not Path(args.model_path).is_dir():
            raise UsageError(f"--model-path {args.model_path!r} is not a folder")
        if args.max_minutes is not None and args.max_minutes <= 0:
            raise UsageError(f"--max-minutes must be positive, got {args.max_minutes}")
        shard = parse_shard(args.shard)
        engine_kwargs = parse_engine_args(args.engine_arg)
    except (UsageError, TaskError, PolicyError, ValueError) as e:
        print(f"tiered-radix eval: {e}", file=sys.stderr)
        return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        if args.engine == "sglang":
            from ..eval.sglang_engine import SGLangEngine

            engine = SGLangEngine(args.model_path or args.model, engine_kwargs=engine_kwargs)
        else:
            engine = TransformersEngine(
                args.model_path or args.model,
                device=args.device,
                dtype=args.dtype,
                attention=args.attention,
                diagnostics=args.diagnostics,
                prefill_chunk=args.prefill_chunk,
            )
    except EngineError as e:
        print(f"tiered-radix eval: {e}", file=sys.stderr)
        return 2
    grid = Grid(
        tuple(policies),
        tuple(budgets),
        tuple(tasks),
        tuple(lengths),
        args.samples,
        args.seed,
        args.max_new_tokens,
        args.shared_prefill and not args.prefill_chunk,
        args.stop_when_answered,
        shard,
    )
    deadline = None if args.max_minutes is None else start + 60 * args.max_minutes
    records = run_grid(engine, grid, args.out, deadline=deadline)
    meta = {
        "engine": engine.name,
        "model": args.model_path or args.model,
        "attention": "fast" if getattr(engine, "fast", False) else "exact",
        "shared_prefill": args.shared_prefill and not args.prefill_chunk,
        "prefill_chunk": args.prefill_chunk,
        "stop_when_answered": args.stop_when_answered,
        "max_minutes": args.max_minutes,
        "samples_run": _samples_run(records),
        "wall_minutes": round((time.monotonic() - start) / 60, 2),
        "adapter_hash": getattr(engine, "adapter_hash", None),
        "device": args.device,
        "dtype": args.dtype,
        "tasks": tasks,
        "lengths": lengths,
        "samples": args.samples,
        "seed": args.seed,
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "budgets": budgets or "each policy's own",
        "host_cpus": os.cpu_count(),
        "shard": args.shard,
        "cuda_peak_mib": process_cuda_peak_mib(),
    }
    return write_reports(records, meta, Path(args.out))


def _samples_run(records: list[dict]) -> int:
    """Distinct (task, length, sample) among ``records``."""
    return len({(r["task"], r["length"], r["index"]) for r in records})


def report_from(args: argparse.Namespace) -> int:
    """``--report-from DIR...``: one report over the merged records (no model is loaded). The
    meta is the first folder's (its report.json), with the folders and the merged sample count."""
    import json

    from ..eval.runner import RESULTS, merge_results

    dirs = [Path(d) for d in args.report_from]
    try:
        records = merge_results(dirs)
    except FileNotFoundError as e:
        print(f"tiered-radix eval: {e}", file=sys.stderr)
        return 2
    first = dirs[0] / "report.json"
    meta = json.loads(first.read_text()).get("meta", {}) if first.is_file() else {}
    meta |= {
        "merged_from": [str(d) for d in dirs],
        "samples_run": _samples_run(records),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / RESULTS, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return write_reports(records, meta, out)


def write_reports(records: list[dict], meta: dict, out: Path) -> int:
    """report.json, report.md and the plots of ``records`` in ``out``; prints the table."""
    from ..eval.report import build_report, markdown_report, markdown_table, write_json

    report = build_report(records, meta)
    write_json(report, out / "report.json")
    (out / "report.md").write_text(markdown_report(report))
    try:
        from ..eval.plot import write_plots
    except ImportError as e:  # matplotlib missing (e.g. a GPU image): the tables still stand
        print(f"tiered-radix eval: no plots ({e}); run `tiered-radix eval` again to plot")
        plots = []
    else:
        plots = write_plots(report, out)
    print(markdown_table(report))
    print(
        f"\nwrote {out}/results.jsonl, report.json, report.md, {', '.join(p.name for p in plots)}"
    )
    return 1 if report["errors"] else 0


def parse_engine_args(items: list[str]) -> dict:
    """``["mem_fraction_static=0.5", "attention_backend=triton"]`` -> a dict; numbers and
    true/false become numbers and booleans.

    Raises:
        UsageError: an item without ``=``.
    """
    out: dict = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise UsageError(f"--engine-arg {item!r}: use KEY=VALUE, e.g. mem_fraction_static=0.5")
        low = value.lower()
        if low in ("true", "false"):
            out[key] = low == "true"
            continue
        try:
            out[key] = int(value)
        except ValueError:
            try:
                out[key] = float(value)
            except ValueError:
                out[key] = value
    return out


def configs_check(budgets: list[str]) -> None:
    from ..sim.simulate import parse_budget

    for b in budgets:
        parse_budget(b)  # raises PolicyError with a caret under the bad spot
