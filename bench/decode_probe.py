"""Which change makes the v2 decode kernel right at 16-token pages on the GPU (GPU run 6: five
v2 tests failed there, bench/decode_notes.md)? Runs those tests' bodies under plan variants and
prints a pass/fail matrix with each failure's first line.

    PYTHONPATH=/tmp/site:/tmp/trsite python3 bench/decode_probe.py [--out DIR]

Variants: the default plan; ``num_stages=1`` (Triton's loop pipelining off, against the
kernel's own prefetch); ``unpack="shift"`` (v1's shift-and-reshape instead of tl.interleave);
both; ``pages_per_iter=1`` (the uniform path one page an iteration), alone and with the shift
unpacking. Needs a CUDA GPU (or TRITON_INTERPRET=1, where everything passes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "kernels"))

import test_decode as t  # noqa: E402
from tiered_radix.kernels import decode  # noqa: E402

CASES = {  # the failing ids of run 6, as calls of their test bodies
    "twin_dense[3-2]": lambda: t.test_decode_matches_twin_and_dense(3, 2),
    "windowed[1-general]": lambda: t.test_windowed_pages_and_unit_side_output(1, False),
    "windowed[2-general]": lambda: t.test_windowed_pages_and_unit_side_output(2, False),
    "uniform[2-d64g7]": lambda: t.test_uniform_path_each_width(2, 64, 7, 16, "interleave"),
    "uniform[4-d64g7]": lambda: t.test_uniform_path_each_width(4, 64, 7, 16, "interleave"),
    "control uniform[8-d64g7]": lambda: t.test_uniform_path_each_width(8, 64, 7, 16, "interleave"),
    "control windowed[0-general]": lambda: t.test_windowed_pages_and_unit_side_output(0, False),
}
VARIANTS = {
    "default": {},
    "num_stages=1": {"num_stages": 1},
    "unpack=shift": {"unpack": "shift"},
    "both": {"num_stages": 1, "unpack": "shift"},
    "ppi=1": {"pages_per_iter": 1},
    "ppi=1+shift": {"pages_per_iter": 1, "unpack": "shift"},
}


def run(over: dict) -> dict[str, str]:
    plan, launch = decode.plan, decode.run

    def patched(*a, **kw):
        p = plan(*a, **{**kw, **({"unpack": over["unpack"]} if "unpack" in over else {})})
        return dataclasses.replace(p, num_stages=over.get("num_stages", p.num_stages))

    def patched_run(q, layout, p, **kw):  # at launch, so the tests' plan checks still hold
        ppi = over.get("pages_per_iter", p.pages_per_iter)
        return launch(q, layout, dataclasses.replace(p, pages_per_iter=ppi), **kw)

    decode.plan, decode.run = patched, patched_run
    try:
        out = {}
        for name, case in CASES.items():
            try:
                case()
                out[name] = "pass"
            except Exception as e:  # noqa: BLE001  (the matrix records every outcome)
                out[name] = "FAIL " + (str(e).strip().splitlines() or [type(e).__name__])[0][:90]
        return out
    finally:
        decode.plan, decode.run = plan, launch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for decode_probe.json")
    a = ap.parse_args()
    res = {v: run(over) for v, over in VARIANTS.items()}
    print(f"{'case':28s} " + " ".join(f"{v:>14s}" for v in VARIANTS))
    for name in CASES:
        print(f"{name:28s} " + " ".join(f"{res[v][name][:14]:>14s}" for v in VARIANTS))
    for v, rows in res.items():
        for name, r in rows.items():
            if r != "pass":
                print(f"{v} / {name}: {r}")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "decode_probe.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
