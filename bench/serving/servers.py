"""The systems compared, their server flags for one KV byte target, and their server processes.

Same KV memory for all (``kv_bytes``): SGLang's ``--max-total-tokens T`` caps the token slots
of the pool it sizes from free memory (``--mem-fraction-static`` leaves room for more), so each
system's ``T`` is the token count its pool fits in ``kv_bytes``, with ``c`` = the model's bf16
KV bytes a token (``2 * layers * kv_heads * head_dim * 2``; 12 KiB for Qwen2.5-0.5B):

- ``bf16``: ``T = kv_bytes / c``;
- ``fp8`` (``--kv-cache-dtype fp8_e4m3``): ``T = kv_bytes / (c / 2)``, twice the tokens;
- ``hicache`` (``--enable-hierarchical-cache --hicache-size G``): the bf16 device pool,
  ``T = kv_bytes / c``, plus ``G`` GB of host memory as the second tier (not counted in
  ``kv_bytes``: it is the point of HiCache);
- tiered (``--kv-policy P --kv-budget f``): the plugin's cell size (``sizing.cell_bytes``) is
  ``c * f`` for the row blocks and ledger pages plus each slot's tables and engine state, and
  the pool spends exactly that per slot (``sizing.pool_bytes``), so ``T = kv_bytes / cell``:
  fewer than ``1/f`` times the slots (qevict 10% on Qwen2.5-0.5B: ~6.5x).

SGLang rounds ``T`` down to its page size. The pool bytes SGLang logs (``KV Cache is allocated
... K size ... V size``, from each pool's ``get_kv_size_bytes``; 10 MB resolution) are
recorded as ``pool_bytes`` to check the mapping.

A :class:`Server` is one ``python -m sglang.launch_server`` process: started with its log in a
file, waited for on ``/health``, stopped by its PID (SIGINT, then SIGKILL), never by name.
:class:`GpuMemory` polls ``nvidia-smi`` for the device's used memory while a server runs; its
peak minus the reading before the launch is the server's peak GPU memory (the benchmark is the
GPU's only user). With servers started together (``--start-together``) it sums instead what
``nvidia-smi`` lists for the server's own processes (the launcher and its descendants, from
``/proc``); where the listed PIDs are not this machine's (a container's PID namespace), the
peak is None rather than a wrong number.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

KINDS = ("bf16", "fp8", "hicache", "qevict", "rdkv")
TIERED = ("qevict", "rdkv")


@dataclass(frozen=True)
class KVGeometry:
    """The model's KV shape: layers, KV heads and head dim."""

    layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of_model(cls, folder: str | Path) -> KVGeometry:
        """From a Hugging Face folder's ``config.json``.

        Raises:
            ValueError: no such file (the message says what ``--model`` must be).
        """
        path = Path(folder, "config.json")
        if not path.is_file():
            raise ValueError(f"--model {folder}: no config.json there (a Hugging Face folder)")
        cfg = json.loads(path.read_text())
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        return cls(cfg["num_hidden_layers"], heads, head_dim)

    def bytes_per_token(self, itemsize: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * itemsize

    def tiered_cell(self, policy, budget) -> int:
        """Bytes one slot of a tiered pool for compiled ``policy`` at ``budget`` costs: the
        plugin's own cell size (``sizing.cell_bytes``: the budget's rows and pages plus tables
        and engine state), bf16 rows."""
        from tiered_radix.adapters.sglang.sizing import cell_bytes

        return cell_bytes(policy, budget, self.layers, self.kv_heads, self.head_dim, 2)


@dataclass(frozen=True)
class System:
    """One system: ``kind`` (one of :data:`KINDS`, or the path of a policy file: a user's own
    tiered policy) and, for tiered kinds, a ``budget`` fraction (``"10%"``) and ``kv_options``:
    the plugin's ``--kv-*`` options for its server, ``(name, value)`` pairs (``("kv-route-clock",
    "server")``; value None: a switch)."""

    kind: str
    budget: str | None = None
    kv_options: tuple[tuple[str, str | None], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS and not self.policy_file:
            raise ValueError(
                f"unknown system {self.kind!r}: one of {', '.join(KINDS)}, or a policy file"
            )
        if self.policy_file and not Path(self.kind).is_file():
            raise ValueError(f"no policy file {self.kind}")
        if self.tiered != (self.budget is not None):
            raise ValueError(
                f"{self.kind}: a budget is for (and needed by) {', '.join(TIERED)} and policy files"
            )
        if self.budget is not None:
            self.fraction()  # validates
        if self.kv_options and not self.tiered:
            raise ValueError(f"{self.kind}: --kv-* options are for tiered systems")

    @classmethod
    def parse(cls, spec: str) -> System:
        """``bf16``, ``fp8``, ``hicache``, ``qevict@10%``, ``rdkv@25%``, ``path/x.yaml@10%``
        (the path resolved: servers run in the output folder); a tiered system may add the
        plugin's options, ``qevict@10%+kv-route-clock=server`` (``+kv-NAME=VALUE``, or
        ``+kv-NAME`` for a switch), passed to its server as ``--kv-NAME VALUE``."""
        head, *extra = spec.strip().split("+")
        kind, _, budget = head.partition("@")
        if kind.endswith((".yaml", ".yml")):
            kind = str(Path(kind).resolve())
        options = []
        for item in extra:
            name, eq, value = item.partition("=")
            if not name.startswith("kv-") or (eq and not value):
                raise ValueError(f"{spec}: '+{item}' is not a +kv-NAME=VALUE option")
            options.append((name, value if eq else None))
        return cls(kind, budget or None, tuple(options))

    @property
    def policy_file(self) -> bool:
        return self.kind.endswith((".yaml", ".yml"))

    @property
    def tiered(self) -> bool:
        """Served with ``--kv-policy`` (a shipped tiered policy or a policy file)."""
        return self.kind in TIERED or self.policy_file

    @property
    def label(self) -> str:
        """The kind, or a policy file's name without its folder and suffix."""
        return Path(self.kind).stem if self.policy_file else self.kind

    @property
    def name(self) -> str:
        """The spec it was parsed from, less a policy file's folder and suffix."""
        base = self.label if self.budget is None else f"{self.label}@{self.budget}"
        return base + "".join(f"+{k}" if v is None else f"+{k}={v}" for k, v in self.kv_options)

    def kv_flags(self) -> list[str]:
        """``kv_options`` as server arguments: ``--kv-NAME VALUE`` (or ``--kv-NAME``)."""
        return [x for k, v in self.kv_options for x in ([f"--{k}"] + ([] if v is None else [v]))]

    def fraction(self) -> Fraction:
        """The budget as a fraction of full KV (1 for untiered systems)."""
        if self.budget is None:
            return Fraction(1)
        if not self.budget.endswith("%"):
            raise ValueError(f"{self.name}: only percent budgets have a per-token size")
        f = Fraction(self.budget[:-1]) / 100
        if not 0 < f <= 1:
            raise ValueError(f"{self.name}: budget outside (0%, 100%]")
        return f

    def pool_tokens(self, kv_bytes: int, geometry: KVGeometry) -> int:
        """``--max-total-tokens`` for a pool of ``kv_bytes`` (see the module docstring)."""
        if self.tiered:
            return int(kv_bytes // self.tiered_cell(geometry))
        return int(kv_bytes // geometry.bytes_per_token(1 if self.kind == "fp8" else 2))

    def tiered_cell(self, geometry: KVGeometry) -> int:
        """Bytes one slot of the tiered pool costs: the plugin's own cell size
        (``sizing.cell_bytes``: the budget's rows and pages plus tables and engine state)."""
        from tiered_radix.adapters.sglang.config import parse_budget
        from tiered_radix.policy import load_policy

        return geometry.tiered_cell(load_policy(self.kind), parse_budget(self.budget))


@dataclass(frozen=True)
class ServerOptions:
    """Flags shared by every system's server."""

    model: str
    port: int = 31100
    context_length: int = 32768
    mem_fraction: float = 0.85
    graph_max_bs: int = 32
    hicache_gb: float = 40.0
    extra: tuple[str, ...] = ()


def server_command(system: System, kv_bytes: int, geometry: KVGeometry, opts: ServerOptions):
    """The ``launch_server`` argument list of ``system`` for a ``kv_bytes`` pool."""
    cmd = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", opts.model,
        "--host", "127.0.0.1", "--port", str(opts.port), "--enable-cache-report",
        "--context-length", str(opts.context_length),
        "--mem-fraction-static", str(opts.mem_fraction),
        "--max-total-tokens", str(system.pool_tokens(kv_bytes, geometry)),
        "--cuda-graph-max-bs-decode", str(opts.graph_max_bs),
    ]  # fmt: skip
    if system.tiered:  # the plugin picks page size and attention backend
        cmd += ["--kv-policy", system.kind, "--kv-budget", system.budget, *system.kv_flags()]
    else:  # FA3 (SGLang's Hopper default) is not in the staged wheels
        cmd += ["--attention-backend", "triton"]
    if system.kind == "fp8":
        cmd += ["--kv-cache-dtype", "fp8_e4m3"]
    if system.kind == "hicache":
        cmd += ["--enable-hierarchical-cache", "--hicache-size", f"{opts.hicache_gb:g}"]
    return cmd + list(opts.extra)


_ALLOCATED = re.compile(
    r"KV Cache is allocated\. dtype: (\S+), #tokens: (\d+), "
    r"(?:K size: ([\d.]+) GB, V size: ([\d.]+) GB|KV size: ([\d.]+) GB)"
)


def pool_from_log(text: str) -> dict | None:
    """The device KV pool SGLang logged: dtype, tokens, bytes (GiB resolution 0.01)."""
    found = _ALLOCATED.findall(text)
    if not found:
        return None
    dtype, tokens, k, v, kv = found[-1]
    gib = float(kv) if kv else float(k) + float(v)
    return {"dtype": dtype, "tokens": int(tokens), "bytes": int(gib * (1 << 30))}


def _http(url: str, data: bytes | None = None, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, data=data, timeout=timeout) as r:
            return r.status, r.read()
    except OSError:
        return 0, b""


class ServerError(RuntimeError):
    """A server exited or did not become healthy; the message ends with its log's tail."""


class Server:
    """One SGLang server process (see the module docstring)."""

    def __init__(self, cmd: list[str], port: int, log: Path) -> None:
        self.cmd, self.port, self.log = cmd, port, log
        self.proc: subprocess.Popen | None = None
        self._log_file = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The launcher's PID, None before :meth:`start`."""
        return None if self.proc is None else self.proc.pid

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log, "w")  # noqa: SIM115 - closed in stop()
        # cwd outside the checkout: `python -m` puts cwd first on sys.path, and the source
        # tree's tiered_radix has no `kernels` subpackage (the installed one has)
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log_file, stderr=subprocess.STDOUT, cwd=self.log.parent
        )

    def log_tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def wait_healthy(self, limit_s: float) -> float:
        """Seconds until ``/health`` answered 200. Raises :class:`ServerError`."""
        t0 = time.time()
        while time.time() - t0 < limit_s:
            if self.proc.poll() is not None:
                raise ServerError(f"server exited {self.proc.returncode}:\n{self.log_tail()}")
            if _http(self.url + "/health")[0] == 200:
                return time.time() - t0
            time.sleep(1)
        raise ServerError(f"server not healthy after {limit_s:.0f}s:\n{self.log_tail()}")

    def info(self) -> dict:
        status, body = _http(self.url + "/server_info", timeout=30)
        return json.loads(body) if status == 200 else {}

    def metrics(self) -> str:
        """The ``/metrics`` text (Prometheus; SGLang's ``--enable-metrics``), "" if none."""
        status, body = _http(self.url + "/metrics", timeout=30)
        return body.decode(errors="replace") if status == 200 else ""

    def healthy(self) -> bool:
        """The process runs and ``/health`` answers 200."""
        alive = self.proc is not None and self.proc.poll() is None
        return alive and _http(self.url + "/health", timeout=30)[0] == 200

    def flush_cache(self) -> bool:
        """Empty the radix cache (between two runs on one server)."""
        # waits up to 30 s for requests still running (aborted ones after a run timeout)
        return _http(self.url + "/flush_cache?timeout=30", data=b"", timeout=60)[0] == 200

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


def _nvidia_smi(query: str, what: str) -> str | None:
    try:
        return subprocess.run(
            ["nvidia-smi", f"--query-{query}={what}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_used_mib() -> int | None:
    """Used memory of the visible GPUs (MiB, summed), or None without nvidia-smi."""
    out = _nvidia_smi("gpu", "memory.used")
    try:
        return None if out is None else sum(int(x) for x in out.split())
    except ValueError:
        return None


def process_tree(pid: int, proc: Path = Path("/proc")) -> set[int]:
    """``pid`` and its descendants, from ``/proc/<pid>/stat``'s parent field (Linux)."""
    children: dict[int, list[int]] = {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # exited meanwhile
            continue
        fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in tree:
            tree.add(p)
            todo += children.get(p, [])
    return tree


def gpu_used_by(pids: set[int]) -> int | None:
    """MiB the GPU's compute processes among ``pids`` hold (summed); None without nvidia-smi
    or when none of them is listed."""
    out = _nvidia_smi("compute-apps", "pid,used_memory")
    if out is None:
        return None
    used = [line.split(",") for line in out.strip().splitlines() if "," in line]
    try:
        mine = [int(m) for p, m in used if int(p) in pids]
    except ValueError:  # "[N/A]" and the like
        return None
    return sum(mine) if mine else None


class GpuMemory:
    """Polls :func:`gpu_used_mib` in a thread; ``peak_mib`` is the peak over the baseline.
    ``pid``: a callable giving a server's launcher PID (None until it runs); then the poll is
    :func:`gpu_used_by` over its :func:`process_tree`, the baseline 0 and the peak None until
    one of its processes is listed."""

    def __init__(self, every_s: float = 0.5, pid=None) -> None:
        self.every_s, self._pid = every_s, pid
        self.baseline = gpu_used_mib() if pid is None else 0
        self._peak = self.baseline if pid is None else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _used(self) -> int | None:
        if self._pid is None:
            return gpu_used_mib()
        pid = self._pid()
        return None if pid is None else gpu_used_by(process_tree(pid))

    def _poll(self) -> None:
        while not self._stop.wait(self.every_s):
            used = self._used()
            if used is not None and (self._peak is None or used > self._peak):
                self._peak = used

    def __enter__(self) -> GpuMemory:
        if self.baseline is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def wait_released(self, limit_s: float = 30.0, slack_mib: int = 512) -> bool | None:
        """After the server stopped: wait until the GPU is back near the baseline (a server's
        child processes free their memory a little after it exits), so the next server's
        baseline is clean. None without nvidia-smi."""
        if self.baseline is None:
            return None
        t0 = time.time()
        while time.time() - t0 < limit_s:
            used = gpu_used_mib()
            if used is not None and used <= self.baseline + slack_mib:
                return True
            time.sleep(1)
        return False

    @property
    def peak_mib(self) -> int | None:
        if self.baseline is None or self._peak is None:
            return None
        return self._peak - self.baseline
