"""A window of decode steps under ``torch.profiler``, for finding where a step's time goes.

``$TIERED_RADIX_PROFILE=DIR:START:STEPS`` profiles decode steps ``START`` to ``START + STEPS``
of the scheduler process (counted from its first decode step; a window of two routing periods
holds two routings), host and device, SGLang's own work in between included, and writes
``DIR/profile-START-END.txt``: the wall time, then the ops and kernels by their own device time
and by their own host time, with the backend's phases (``tr:metadata``, ``tr:route``, ...) as
``record_function`` ranges among them. Off (the default), the backend pays one integer
comparison a step.
"""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch

PROFILE_ENV = "TIERED_RADIX_PROFILE"


class StepProfiler:
    """Starts and stops the profiler at decode step boundaries (:meth:`at_step`)."""

    def __init__(self, spec: str | None = None) -> None:
        spec = os.environ.get(PROFILE_ENV, "") if spec is None else spec
        self.prof = None
        self.t0 = 0.0
        if not spec:
            self.start = self.end = -1
            return
        try:
            folder, start, steps = spec.rsplit(":", 2)
            self.dir, self.start = Path(folder), int(start)
            self.end = self.start + int(steps)
        except ValueError:
            raise ValueError(f"${PROFILE_ENV}={spec!r}: use DIR:START:STEPS") from None

    def phase(self, name: str):
        """A labelled range while profiling (a no-op context otherwise)."""
        return torch.autograd.profiler.record_function(f"tr:{name}") if self.prof else nullcontext()

    def at_step(self, step: int) -> None:
        """Decode step ``step`` (0-based) is about to begin."""
        if step == self.start and self.prof is None:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()
            self.t0 = time.perf_counter()
        elif step == self.end and self.prof is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            wall = time.perf_counter() - self.t0
            self.prof.__exit__(None, None, None)
            self._write(wall)
            self.prof = None

    def _write(self, wall: float) -> None:
        ka = self.prof.key_averages()
        steps = self.end - self.start
        device = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        out = [
            f"decode steps {self.start}-{self.end}: {wall * 1e3:.1f} ms wall, "
            f"{wall * 1e3 / steps:.3f} ms a step (profiler overhead included)",
            "",
            "by own device time:",
            ka.table(sort_by=device, row_limit=40),
            "by own host time:",
            ka.table(sort_by="self_cpu_time_total", row_limit=60),
        ]
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / f"profile-{self.start}-{self.end}.txt").write_text("\n".join(out))
