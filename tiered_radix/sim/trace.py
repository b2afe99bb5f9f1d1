"""Attention-trace files (format version 2; field by field in ``docs/trace-format.md``).

A trace is one ``.npz`` (loaded with ``allow_pickle=False``) holding a JSON metadata string
``meta`` and, for every recorded layer ``l`` (``meta.layers``), with ``T = prompt_len + steps``:

- ``k_{l}``       ``[H_kv, T, d]``            float16  post-RoPE keys of prompt and decode tokens
- ``v_{l}``       ``[H_kv, T, d]``            float16  values
- ``q_{l}``       ``[steps, H_q, d]``         float16  post-RoPE decode queries; step ``s`` is the
  token at position ``prompt_len + s`` and attends to keys ``0 .. prompt_len + s`` (inclusive)
- ``colmass_{l}`` ``[H_kv, prompt_len]``      float32  prefill column mass: softmax probabilities
  summed over the causal prompt query rows and the GQA group (RDKV's V-token weight)
- ``qnorm_{l}``   ``[H_kv, d]``               float32  prefill query channel L2 norms over the
  prompt rows and the GQA group (RDKV's ``||Q[:, c]||``)
- ``obs_attn_{l}`` ``[H_kv, prompt_len]``     float32  (version 2) like ``colmass`` but summed over
  the last ``min(OBS_WINDOW, prompt_len)`` prompt query rows only (SnapKV's observation window)

Version 1 files (no ``obs_attn``) still load, with ``Trace.obs_attn = None``. Decode attention
probabilities are not stored: readers recompute them from ``q`` and ``k``. Query head ``hq``
reads KV head ``hq // (H_q // H_kv)``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import NamedTuple

import numpy as np

FORMAT_VERSION = 2
OBS_WINDOW = 32  # SnapKV's observation window: the last 32 prompt queries (policy `obs_attn`)
ARRAYS = {
    1: ("k", "v", "q", "colmass", "qnorm"),
    2: ("k", "v", "q", "colmass", "qnorm", "obs_attn"),
}


class TraceError(ValueError):
    """A trace file or object is malformed; the message names the field and what was expected."""


@dataclass(frozen=True)
class TraceMeta:
    """Scalar description of a trace (the ``meta`` JSON). ``extra`` is free-form JSON."""

    model: str
    layers: tuple[int, ...]
    n_heads_q: int
    n_heads_kv: int
    head_dim: int
    prompt_len: int
    steps: int
    sm_scale: float
    prompt: str
    generated_text: str
    prompt_ids: tuple[int, ...]
    generated_ids: tuple[int, ...]
    version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict)

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.steps

    @property
    def group(self) -> int:
        return self.n_heads_q // self.n_heads_kv

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TraceMeta:
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise TraceError(f"meta: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise TraceError(f"meta: expected a JSON object, got {type(raw).__name__}")
        version = raw.get("version")
        if isinstance(version, int) and version > FORMAT_VERSION:
            raise TraceError(
                f"meta.version: trace format {version} is newer than this reader "
                f"({FORMAT_VERSION}); upgrade tiered-radix"
            )
        names = {f.name for f in fields(cls)}
        if unknown := sorted(set(raw) - names):
            raise TraceError(f"meta: unknown fields {unknown}")
        if missing := sorted(n for n in names - set(raw) if n not in ("extra",)):
            raise TraceError(f"meta: missing fields {missing}")
        for name in ("layers", "prompt_ids", "generated_ids"):
            if isinstance(raw[name], list):
                raw[name] = tuple(raw[name])
        return cls(**raw)


def _check_meta(m: TraceMeta) -> None:
    ints = ("n_heads_q", "n_heads_kv", "head_dim", "prompt_len", "steps", "version")
    for name in ints:
        val = getattr(m, name)
        if not isinstance(val, int) or isinstance(val, bool) or val < 0:
            raise TraceError(f"meta.{name}: expected a non-negative int, got {val!r}")
    if m.version not in ARRAYS:
        raise TraceError(f"meta.version: expected one of {sorted(ARRAYS)}, got {m.version}")
    for name in ("n_heads_q", "n_heads_kv", "head_dim", "prompt_len"):
        if getattr(m, name) == 0:
            raise TraceError(f"meta.{name}: must be at least 1")
    if m.n_heads_q % m.n_heads_kv:
        raise TraceError(
            f"meta.n_heads_q: {m.n_heads_q} is not a multiple of n_heads_kv={m.n_heads_kv}"
        )
    if not isinstance(m.sm_scale, (int, float)) or not m.sm_scale > 0:
        raise TraceError(f"meta.sm_scale: expected a positive float, got {m.sm_scale!r}")
    for name in ("model", "prompt", "generated_text"):
        if not isinstance(getattr(m, name), str):
            raise TraceError(f"meta.{name}: expected a string")
    if not isinstance(m.extra, dict):
        raise TraceError(f"meta.extra: expected a JSON object, got {type(m.extra).__name__}")
    ly = m.layers
    if not ly or not all(isinstance(x, int) and x >= 0 for x in ly) or list(ly) != sorted(set(ly)):
        raise TraceError(f"meta.layers: expected strictly increasing layer indices, got {ly!r}")
    for name, n in (("prompt_ids", m.prompt_len), ("generated_ids", m.steps)):
        ids = getattr(m, name)
        if len(ids) != n or not all(isinstance(x, int) for x in ids):
            raise TraceError(f"meta.{name}: expected {n} integer token ids, got {len(ids)}")


@dataclass(frozen=True)
class Trace:
    """One recorded (or synthetic) trace; arrays are tuples aligned with ``meta.layers``.

    ``obs_attn`` is present exactly when ``meta.version >= 2`` (``None`` for a version 1 trace).
    Validated on construction. Raises ``TraceError`` naming the bad field.
    """

    meta: TraceMeta
    k: tuple[np.ndarray, ...]
    v: tuple[np.ndarray, ...]
    q: tuple[np.ndarray, ...]
    colmass: tuple[np.ndarray, ...]
    qnorm: tuple[np.ndarray, ...]
    obs_attn: tuple[np.ndarray, ...] | None = None

    def __post_init__(self) -> None:
        _check_meta(self.meta)
        m = self.meta
        if (self.obs_attn is None) != (m.version == 1):
            raise TraceError(
                f"obs_attn: a version {m.version} trace must "
                + ("not carry obs_attn" if m.version == 1 else "carry obs_attn (one per layer)")
            )
        hkv, hq, d, p, t = m.n_heads_kv, m.n_heads_q, m.head_dim, m.prompt_len, m.total_len
        spec = {
            "k": ((hkv, t, d), np.float16, "[H_kv, T, d]"),
            "v": ((hkv, t, d), np.float16, "[H_kv, T, d]"),
            "q": ((m.steps, hq, d), np.float16, "[steps, H_q, d]"),
            "colmass": ((hkv, p), np.float32, "[H_kv, prompt_len]"),
            "qnorm": ((hkv, d), np.float32, "[H_kv, d]"),
            "obs_attn": ((hkv, p), np.float32, "[H_kv, prompt_len]"),
        }
        for name in ARRAYS[m.version]:
            shape, dtype, doc = spec[name]
            arrays = getattr(self, name)
            if len(arrays) != len(m.layers):
                raise TraceError(
                    f"{name}: {len(arrays)} arrays for {len(m.layers)} layers {list(m.layers)}"
                )
            for layer, a in zip(m.layers, arrays, strict=True):
                key = f"{name}_{layer}"
                if not isinstance(a, np.ndarray) or a.dtype != dtype:
                    got = getattr(a, "dtype", type(a).__name__)
                    raise TraceError(f"{key}: expected {np.dtype(dtype).name}, got {got}")
                if a.shape != shape:
                    raise TraceError(f"{key}: expected shape {shape} {doc}, got {a.shape}")
                if not np.isfinite(a).all():
                    raise TraceError(f"{key}: contains NaN or infinity")
        # Every causal prompt row is a distribution: each KV head collects G * (rows summed).
        masses = [("colmass", self.colmass, "G * prompt_len", m.group * p)]
        if self.obs_attn is not None:
            w = min(OBS_WINDOW, p)
            masses.append(
                ("obs_attn", self.obs_attn, f"G * min({OBS_WINDOW}, prompt_len)", m.group * w)
            )
        for name, arrays, what, want in masses:
            for layer, a in zip(m.layers, arrays, strict=True):
                sums = a.sum(axis=1, dtype=np.float64)
                if (a < 0).any() or not np.allclose(sums, want, rtol=1e-3):
                    raise TraceError(
                        f"{name}_{layer}: each row must be >= 0 and sum to {what} = {want}, "
                        f"got sums {sums.round(3).tolist()}"
                    )

    def index(self, layer: int) -> int:
        """Position of model layer ``layer`` in the per-layer tuples."""
        try:
            return self.meta.layers.index(layer)
        except ValueError:
            have = list(self.meta.layers)
            raise TraceError(f"layer {layer} was not recorded; have {have}") from None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        arrays = {"meta": np.array(self.meta.to_json())}
        for name in ARRAYS[self.meta.version]:
            for layer, a in zip(self.meta.layers, getattr(self, name), strict=True):
                arrays[f"{name}_{layer}"] = a
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:  # a file object stops numpy from appending ".npz"
            np.savez_compressed(f, **arrays)
        return path

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read and validate a trace file.

        Raises:
            TraceError: not an npz, missing/unexpected arrays, or any invalid field.
        """
        try:
            with np.load(path, allow_pickle=False) as z:
                data = {name: z[name] for name in z.files}
        except (OSError, ValueError) as e:
            raise TraceError(f"{path}: not a readable trace .npz ({e})") from None
        if "meta" not in data or data["meta"].dtype.kind != "U" or data["meta"].ndim != 0:
            raise TraceError(f"{path}: missing 'meta' (a JSON string array)")
        meta = TraceMeta.from_json(str(data.pop("meta")))
        _check_meta(meta)
        names = ARRAYS[meta.version]
        want = {f"{n}_{layer}" for n in names for layer in meta.layers}
        if missing := sorted(want - set(data)):
            raise TraceError(f"{path}: missing arrays {missing} for layers {list(meta.layers)}")
        if extra := sorted(set(data) - want):
            raise TraceError(f"{path}: unexpected arrays {extra}")
        per = {n: tuple(data[f"{n}_{layer}"] for layer in meta.layers) for n in names}
        return cls(meta=meta, **per)


class PrefillStats(NamedTuple):
    """Per-layer prefill signals, float32: ``colmass [H_kv, P]``, ``qnorm [H_kv, d]``,
    ``obs_attn [H_kv, P]``."""

    colmass: np.ndarray
    qnorm: np.ndarray
    obs_attn: np.ndarray


def prefill_stats(
    q: np.ndarray, k: np.ndarray, sm_scale: float, *, obs_window: int = OBS_WINDOW
) -> PrefillStats:
    """Column mass, query channel norms and observation-window mass of a causal prefill.

    ``q [P, H_q, d]`` and ``k [P, H_kv, d]`` (any float dtype, computed in float32) are the
    prompt's post-RoPE queries and keys. ``obs_attn`` sums the softmax rows of the last
    ``min(obs_window, P)`` queries only (query row ``tau`` sees keys ``<= tau``). Memory stays
    linear in ``P``: both masses walk the query rows in chunks, never a ``[P, P]`` matrix.
    """
    import torch

    from tiered_radix.kernels.colmass_ref import channel_norms, column_mass_ref

    qt, kt = (
        torch.from_numpy(np.asarray(q, np.float32)),
        torch.from_numpy(np.asarray(k, np.float32)),
    )
    colmass = column_mass_ref(qt, kt, scale=sm_scale, causal=True, q_offset=0)
    first = max(0, qt.shape[0] - obs_window)
    obs = column_mass_ref(qt[first:], kt, scale=sm_scale, causal=True, q_offset=first)
    qnorm, _ = channel_norms(qt, kt)
    return PrefillStats(colmass.numpy(), qnorm.numpy(), obs.numpy())


def synthetic_trace(
    seed: int,
    *,
    layers: tuple[int, ...] = (0, 1),
    n_heads_q: int = 4,
    n_heads_kv: int = 2,
    head_dim: int = 32,
    prompt_len: int = 192,
    steps: int = 48,
    n_windows: int = 3,
    window: int = 16,
    version: int = FORMAT_VERSION,
) -> Trace:
    """A random but structured trace for tests (no model needed).

    Per KV head, keys and queries are noise plus components along orthonormal directions:
    a sink direction (key 0 and every query), a slowly rotating position pair (recency: the
    logit falls with distance), and one direction per heavy window of ``window`` prompt tokens.
    A window's direction is on in prefill queries right after it and in two separate decode
    intervals, so its attention mass rises, falls and reactivates. ``meta.extra`` records
    ``windows`` (``[start, end)`` token spans) and ``active`` (per window, two ``[s0, s1)`` decode
    step intervals). ``version=1`` builds an old-format trace (no ``obs_attn``).
    """
    rng = np.random.default_rng(seed)
    d, p, t = head_dim, prompt_len, prompt_len + steps
    assert d >= 3 + n_windows and p >= 2 * window * (n_windows + 1) and steps >= 6 * n_windows
    amp = np.sqrt(5.0 * np.sqrt(d))  # a matching key/query component adds ~5 to the logit
    omega = np.pi / (2 * t)  # cos(omega * distance) decreases over the whole trace
    slots = rng.choice(np.arange(1, p // (2 * window)), n_windows, replace=False)
    starts = np.sort(slots) * 2 * window  # windows never touch each other
    windows = [[int(s), int(s) + window] for s in starts]
    # Decode steps form 2 * n_windows slots; each window is on in one slot of the first half and
    # one of the second half (a shuffled order), never two windows at once.
    slot = steps // (2 * n_windows)
    second = n_windows + rng.permutation(n_windows)
    while n_windows > 1 and second[-1] == n_windows:  # keep an off slot before every return
        second = n_windows + rng.permutation(n_windows)
    active = [
        [[w * slot, w * slot + slot - 1], [int(j) * slot, int(j) * slot + slot - 1]]
        for w, j in enumerate(second)
    ]
    pos = np.arange(t)
    kk, vv, qq, stats = [], [], [], []
    for _ in layers:
        basis = np.linalg.qr(rng.standard_normal((d, d)))[0].T  # rows are orthonormal directions
        sink, rot_c, rot_s, win_dirs = basis[0], basis[1], basis[2], basis[3 : 3 + n_windows]
        rot = np.cos(omega * pos)[:, None] * rot_c + np.sin(omega * pos)[:, None] * rot_s
        k = rng.standard_normal((n_heads_kv, t, d)) + amp * rot
        k[:, 0] += 1.6 * amp * sink
        q = rng.standard_normal((t, n_heads_q, d)) + (amp * rot + amp * sink)[:, None]
        for w, (s0, s1) in enumerate(windows):
            k[:, s0:s1] += amp * win_dirs[w]
            q[s1 : s1 + window] += amp * win_dirs[w]
            for a, b in active[w]:
                q[p + a : p + b] += 1.2 * amp * win_dirs[w]
        sm = 1.0 / np.sqrt(d)
        stats.append(prefill_stats(q[:p], k[:, :p].transpose(1, 0, 2), sm))
        kk.append(k.astype(np.float16))
        vv.append(rng.standard_normal((n_heads_kv, t, d)).astype(np.float16))
        qq.append(q[p:].astype(np.float16))
    meta = TraceMeta(
        model="synthetic", layers=tuple(layers), n_heads_q=n_heads_q, n_heads_kv=n_heads_kv,
        head_dim=d, prompt_len=p, steps=steps, sm_scale=float(1.0 / np.sqrt(d)),
        prompt="", generated_text="", prompt_ids=tuple(int(x) for x in rng.integers(0, 1000, p)),
        generated_ids=tuple(int(x) for x in rng.integers(0, 1000, steps)),
        extra={"source": "synthetic", "seed": seed, "windows": windows, "active": active},
    )  # fmt: skip
    cm, qn, obs = (tuple(x) for x in zip(*stats, strict=True))
    if version == 1:
        return Trace(dataclasses.replace(meta, version=1), tuple(kk), tuple(vv), tuple(qq), cm, qn)
    return Trace(meta, tuple(kk), tuple(vv), tuple(qq), cm, qn, obs)
