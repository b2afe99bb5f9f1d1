"""`tiered-radix simulate`: replay a trace through one or more policies and compare them.

Writes ``OUT/report.json``, ``OUT/report.md`` and ``OUT/{bytes,occupancy,quality}.png`` and prints
the comparison table. Exit codes: 0 every policy ran; 2 a bad trace, policy or budget (nothing
written), or a policy that cannot run on this trace (the others are still reported).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..policy import PolicyError, load_policy
from ..sim.plot import write_plots
from ..sim.report import build_report, markdown_report, markdown_table, write_json
from ..sim.simulate import SimError, parse_budget, simulate
from ..sim.trace import Trace, TraceError


def run(args: argparse.Namespace) -> int:
    try:
        trace = Trace.load(args.trace)
        budget = parse_budget(args.budget) if args.budget else None
        policies = [load_policy(p) for p in args.policy]
    except (TraceError, PolicyError) as e:
        print(f"tiered-radix simulate: {e}", file=sys.stderr)
        return 2
    results, skipped = [], []
    for policy in policies:
        try:
            results.append(simulate(policy, trace, budget, progress=True))
        except SimError as e:
            print(f"tiered-radix simulate: skipped {policy.name}: {e}", file=sys.stderr)
            skipped.append((policy.name, str(e)))
    report = build_report(
        results,
        trace.meta,
        trace_path=str(args.trace),
        budget_override=None if budget is None else str(budget),
        skipped=skipped,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(report, out / "report.json")
    (out / "report.md").write_text(markdown_report(report))
    if results:
        write_plots(report, out)
    print(markdown_table(report))
    print(f"\nwrote {out}/report.json, report.md" + (" and plots" if results else ""))
    return 2 if skipped else 0
