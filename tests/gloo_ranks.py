"""Run a function on ``world`` gloo ranks (spawned CPU processes) and collect their results:
the tensor-parallel tests' harness. ``fn(rank)`` runs inside an initialised default process
group and must be a module-level function (it is pickled into the children)."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_ranks(fn: Callable[[int], Any], world: int, tmp: Path) -> list[Any]:
    """``[fn(0), ..., fn(world - 1)]``, each computed on its own rank; ``tmp``: a fresh folder."""
    mp.spawn(_rank_main, args=(fn, world, f"file://{tmp}/pg", str(tmp)), nprocs=world, join=True)
    return [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(world)]


def _rank_main(rank: int, fn, world: int, init: str, out: str) -> None:
    torch.set_num_threads(1)  # several ranks on a 2-core CI machine
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    try:
        torch.save(fn(rank), f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()
