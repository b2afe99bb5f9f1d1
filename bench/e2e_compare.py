"""Compare the answers of two ``tests/gpu/test_sglang_e2e.py`` runs, policy by policy.

Issue 19 asks that the extend kernel leave outputs unchanged against the path before it: run
the end-to-end test twice on one machine, once as launched (``--kv-extend kernel``) and once
with ``TR_E2E_ARGS="--kv-extend sdpa"`` (each with its own ``TR_E2E_OUT``), then::

    python bench/e2e_compare.py e2e-kernel e2e-sdpa [--out compare.json]

Prints, per policy present in both folders, whether every chat turn's answer and the needle's
answer are the same text (greedy decoding), and the first differing answer otherwise, and the
server's tier counters (routings, demotions, promotions, evictions) of both runs beside each
other: equal counters say the tier decisions matched too (reported, not required: the two
paths' attention sums differ in rounding). ``--policies a,b`` names the policies expected: one
missing from either folder (its server failed or a timeout cut it: GPU run 23's rdkv) is
reported as missing. Exit status 1 when any answer differs, an expected policy is missing, or
a folder has no results.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def answers(result: dict) -> list[str]:
    """The chat turns' answers, then the needle's, in the test's order."""
    return [t["answer"] for t in result["turns"]] + [result["needle"]["answer"]]


COUNTERS = ("routes", "demote", "promote", "evict")


def counters(result: dict) -> dict:
    """The server's tier counters in a result (its stats as of the last routing)."""
    stats = result.get("stats") or {}
    return {k: stats.get(k) for k in COUNTERS}


def compare(a: Path, b: Path, expected: list[str] = ()) -> dict:
    """Per policy in both folders: ``{"same": bool, "answers": n, "first_diff": ...}``; per
    ``expected`` policy absent from either: ``{"same": False, "missing": [folder names]}``."""
    left = {p.stem: json.loads(p.read_text()) for p in sorted(a.glob("*.json"))
            if not p.name.endswith(".stats.json")}  # fmt: skip
    right = {p.stem: json.loads(p.read_text()) for p in sorted(b.glob("*.json"))
             if not p.name.endswith(".stats.json")}  # fmt: skip
    out = {}
    for policy in sorted(left.keys() & right.keys()):
        x, y = answers(left[policy]), answers(right[policy])
        diff = [(i, u, v) for i, (u, v) in enumerate(zip(x, y, strict=False)) if u != v]
        out[policy] = {"same": not diff and len(x) == len(y), "answers": len(x),
                       "first_diff": list(diff[0]) if diff else None,
                       "counters": [counters(left[policy]), counters(right[policy])]}  # fmt: skip
    for policy in expected:
        missing = [f.name for f, got in ((a, left), (b, right)) if policy not in got]
        if missing:
            out[policy] = {"same": False, "missing": missing}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--policies", default="", help="comma separated: the policies both runs "
                   "should have answered for (missing ones fail)")  # fmt: skip
    args = p.parse_args()
    result = compare(args.a, args.b, [x for x in args.policies.split(",") if x])
    for policy, r in result.items():
        if "missing" in r:
            print(f"{policy}: MISSING in {', '.join(r['missing'])}")
            continue
        print(f"{policy}: {r['answers']} answers, {'same' if r['same'] else 'DIFFER'}"
              + (f"; first difference {r['first_diff']}" if r["first_diff"] else ""))  # fmt: skip
        left, right = r["counters"]
        print(f"  tier counters {args.a.name}: {left}, {args.b.name}: {right}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0 if result and all(r["same"] for r in result.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
