"""Where the tiered backends' time goes: :class:`StepTimer` (host seconds per phase, step counts,
device time of graph replays) and :class:`StepProfiler`, the one interface the backends time
through.

:class:`StepProfiler`: a window of decode steps under ``torch.profiler``.

``--kv-profile DIR:START:STEPS`` profiles decode steps ``START`` to ``START + STEPS``
of the scheduler process (counted from its first decode step; a window of two routing periods
holds two routings); ``DIR:START:STEPS:extend`` profiles extend batches instead (counted from the
first one: a prefill's chunks, where the time to first token goes). Host and device, SGLang's own
work in between included; it writes
``DIR/profile-START-END.txt``: the wall time, then the ops and kernels by their own device time
and by their own host time, with the backend's phases (``tr:metadata``, ``tr:route``, ...) as
``record_function`` ranges among them, and within each phase the ops by the ``tiered_radix``
line that issued them (calls, device and host time: where a routing's device work and launches
come from). The whole trace goes to ``DIR/trace-START-END.json.gz`` (Chrome trace format, for
``chrome://tracing`` or Perfetto). Off (the default), the backend pays one integer comparison a
step.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch


class StepProfiler:
    """Starts and stops the profiler at decode step (or extend batch) boundaries
    (:meth:`at_step`); ``spec``: ``DIR:START:STEPS[:extend]``, or ``None`` (off)."""

    def __init__(self, spec: str | None = None) -> None:
        self.prof = None
        self.t0 = 0.0
        self.unit = "decode"  # what START and STEPS count: decode steps or extend batches
        if not spec:
            self.start = self.end = -1
            return
        if spec.endswith(":extend"):
            spec, self.unit = spec[: -len(":extend")], "extend"
        try:
            folder, start, steps = spec.rsplit(":", 2)
            self.dir, self.start = Path(folder), int(start)
            self.end = self.start + int(steps)
        except ValueError:
            raise ValueError(f"--kv-profile {spec!r}: use DIR:START:STEPS[:extend]") from None

    def phase(self, name: str):
        """A labelled range while profiling (a no-op context otherwise)."""
        return torch.autograd.profiler.record_function(f"tr:{name}") if self.prof else nullcontext()

    def at_step(self, step: int, unit: str = "decode") -> None:
        """Decode step (``unit`` ``extend``: extend batch) ``step`` (0-based) is about to
        begin; the window counts its own unit only."""
        if unit != self.unit:
            return
        if step == self.start and self.prof is None:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts, with_stack=True)
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
            f"{self.unit} steps {self.start}-{self.end}: {wall * 1e3:.1f} ms wall, "
            f"{wall * 1e3 / steps:.3f} ms a step (profiler overhead included)",
            "",
            "by own device time:",
            ka.table(sort_by=device, row_limit=40),
            "by own host time:",
            ka.table(sort_by="self_cpu_time_total", row_limit=60),
            "ops in the backend's phases, by the line that issued them (us over the window):",
            self._by_line(),
        ]
        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"{self.start}-{self.end}" + ("-extend" if self.unit == "extend" else "")
        (self.dir / f"profile-{name}.txt").write_text("\n".join(out))
        self.prof.export_chrome_trace(str(self.dir / f"trace-{name}.json.gz"))  # gzipped by torch

    def _by_line(self, limit: int = 40) -> str:
        """Each ``tr:`` phase's ops (the first ATen ops below its Python frames) grouped by
        (phase, op, the innermost ``tiered_radix`` frame above it): calls, device time (the
        op's kernels and its children's) and host time."""
        rows: dict[tuple, list] = defaultdict(lambda: [0, 0.0, 0.0])

        def walk(ev, phase: str, line: str) -> None:
            for c in ev.cpu_children:
                if c.name.startswith("tr:"):
                    continue  # a nested phase has its own rows
                if ".py(" in c.name:  # a Python frame (with_stack): the ops are below it
                    walk(c, phase, c.name if "tiered_radix" in c.name else line)
                    continue
                r = rows[phase, c.name, line.split("tiered_radix")[-1]]
                r[0] += 1
                r[1] += c.device_time_total
                r[2] += c.cpu_time_total

        for e in self.prof.events():
            if e.name.startswith("tr:"):
                walk(e, e.name, "?")
        top = sorted(rows.items(), key=lambda kv: (-kv[1][1], -kv[1][2]))[:limit]
        head = f"{'phase':16s} {'op':28s} {'calls':>6s} {'device us':>10s} {'host us':>10s}  line"
        body = [
            f"{p[:16]:16s} {op[:28]:28s} {n:6d} {dev:10.0f} {host:10.0f}  {line}"
            for (p, op, line), (n, dev, host) in top
        ]
        return "\n".join([head, *body])


class StepTimer:
    """A backend's timing: host seconds per phase (:meth:`phase`, a ``tr:`` range under the
    profiler too), step counts (:meth:`count`), with ``device_times`` the device time of each
    decode graph replay (two CUDA events, read at :meth:`report`: no host sync per step), and
    the ``--kv-profile`` window (``profile``, :class:`StepProfiler`) at decode step starts."""

    def __init__(self, device_times: bool = False, profile: str | None = None) -> None:
        self.host_s: dict[str, float] = defaultdict(float)  # phase -> seconds, or a count
        self.device_s: dict[str, float] = defaultdict(float)  # replay seconds, replays
        self.replay: list | None = [] if device_times else None  # the replay in flight
        self.replays: list[tuple] = []  # ended replays' (start, end) events, read at report()
        self.profiler = StepProfiler(profile)

    @contextmanager
    def phase(self, name: str):
        """Host time of a phase (no device sync: on the GPU, the time to issue its work)."""
        t0 = time.perf_counter()
        try:
            with self.profiler.phase(name):
                yield
        finally:
            self.host_s[name] += time.perf_counter() - t0

    def count(self, name: str) -> None:
        """One more ``name`` (``decode_steps``, ``extend_batches``, ...)."""
        self.host_s[name] += 1

    def decode_step(self) -> None:
        """A decode step is about to begin (the profiler's window opens and closes here)."""
        self.profiler.at_step(int(self.host_s["decode_steps"]))

    def extend_batch(self) -> None:
        """An extend batch is about to begin (a ``:extend`` window opens and closes here)."""
        self.profiler.at_step(int(self.host_s["extend_batches"]), "extend")

    def replay_starts(self) -> None:
        """SGLang launches a decode graph replay next (with ``device_times``: its start mark)."""
        if self.replay is not None:
            self.replay = [torch.cuda.Event(enable_timing=True)]
            self.replay[0].record()

    def replay_launched(self) -> None:
        """After the replay's launch: its end mark."""
        if self.replay is not None and len(self.replay) == 1:
            self.replay.append(torch.cuda.Event(enable_timing=True))
            self.replay[1].record()

    def replay_done(self) -> None:
        """The replayed step's work is over on the host: its marks wait for :meth:`report`."""
        if self.replay is not None and len(self.replay) == 2:
            self.replays.append(tuple(self.replay))
            self.replay = []

    def report(self) -> dict:
        """``host_s`` (rounded), and with ``device_times`` ``device_s``: ``replay`` seconds and
        ``replays`` (one sync per ended replay's end mark, here rather than per step)."""
        out = {"host_s": {k: round(v, 6) for k, v in self.host_s.items()}}
        if self.replay is not None:
            for start, end in self.replays:
                end.synchronize()
                self.device_s["replay"] += start.elapsed_time(end) / 1e3
                self.device_s["replays"] += 1
            self.replays.clear()
            out["device_s"] = {k: round(v, 6) for k, v in self.device_s.items()}
        return out
