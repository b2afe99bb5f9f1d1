"""What the host-memory benches share: each way of a step measured in a fresh process, its peak
resident memory over what was resident before the step (CPU tensors of the GPU's shapes).

A bench script defines ``WAYS`` and a ``one(way, ...)`` that returns a row; its ``main`` takes
the batch options (:func:`batch_args`), runs each way in a child process of itself (``--one
WAY``, :func:`run_ways`) and writes the rows. Used by ``decode_lists_memory.py`` and
``routing_memory.py``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path


def rss_bytes() -> int:
    """This process's resident memory now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_bytes() -> int:
    """This process's peak resident memory so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def batch_args(p: argparse.ArgumentParser, ways: tuple[str, ...], batch: int) -> None:
    """``--batch`` requests of ``--min``-``--max`` tokens, ``--out`` folder, and the hidden
    ``--one WAY`` a child process runs."""
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--min", type=int, default=1000)
    p.add_argument("--max", type=int, default=30000)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--one", choices=ways, help=argparse.SUPPRESS)  # a child process's way


def lengths(args: argparse.Namespace) -> list[int]:
    """The batch's prompt lengths, evenly spaced from ``--min`` to ``--max``."""
    step = (args.max - args.min) // max(args.batch - 1, 1)
    return [args.min + i * step for i in range(args.batch)]


def run_ways(script: str, ways: tuple[str, ...], argv: list[str]) -> list[dict]:
    """Each way's row, from ``script --one WAY *argv`` in a fresh process (its last stdout
    line, JSON)."""
    rows = []
    for way in ways:
        cmd = [sys.executable, script, "--one", way, *argv]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    return rows
