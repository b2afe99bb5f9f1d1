"""Instruction counts of a compiled Triton kernel's SASS (or PTX), for bench/compile_check.py.

The page loop of a split kernel is its first outermost loop that issues an MMA (``HMMA``): loops
are found from backward branches, so prologue loops without MMAs (the page prefetch) and the
zone B/C row loops after it are left out.  Counts are static (each instruction once, nested
loop bodies included once); the classes are the sm_90 pipes that bound a page:
conversions (``I2F``/``I2FP``/``F2F``/``F2FP``/``F2I``: 16 results a clock an SM, by the CUDA
guide's table; sm_90's pipe for ``I2FP``/``F2FP`` is not documented), FP32 (``FFMA``/``FADD``/
``FMUL``/...: 128), integer ALU (``LOP3``/``SHF``/``PRMT``/``IADD3``/...: 64), ``IMAD`` (64, on
the FMA pipe), ``HMMA`` and memory.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")
TARGET = re.compile(r"`\((\.L_x_\d+)\)")
LABEL = re.compile(r"^(\.L_x_\d+):")
CLASSES = {
    "i2f": {"I2F", "I2FP"},
    "f2f": {"F2F"},
    "f2fp": {"F2FP"},
    "f2i": {"F2I", "F2IP", "I2I", "I2IP"},
    "fp32": {"FFMA", "FADD", "FMUL", "FMNMX", "FSEL", "FSETP", "FCHK", "HFMA2", "HADD2", "HMUL2"},
    "alu": {"IADD3", "LOP3", "SHF", "LEA", "PRMT", "SGXT", "ISETP", "SEL", "VIADD", "IABS",
            "BFE", "BFI", "IMNMX", "VIMNMX", "POPC", "FLO", "BMSK", "IADD"},
    "imad": {"IMAD", "IMUL"},
    "mma": {"HMMA"},
    "mem": {"LDG", "LDS", "LDSM", "STS", "STSM", "LDGSTS", "STG", "LD", "ST", "LDL", "STL",
            "CCTL", "ATOMG", "RED"},
}  # fmt: skip
CVT = ("i2f", "f2f", "f2fp", "f2i")


def nvdisasm(cubin: bytes) -> str | None:
    """SASS text of a cubin by Triton's bundled nvdisasm, or None where it is missing."""
    try:
        import triton

        tool = triton.knobs.nvidia.nvdisasm.path
    except Exception:  # noqa: BLE001 - an older Triton without the knob: no SASS
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        Path(f.name).write_bytes(cubin)
        try:
            return subprocess.run([tool, "-c", f.name], capture_output=True, text=True,
                                  check=True).stdout  # fmt: skip
        except (OSError, subprocess.CalledProcessError):
            return None


def parse(sass: str) -> list[tuple[int, str, str | None]]:
    """(address, opcode, branch target label or None) of every instruction; label addresses
    are recorded as ("label", ...) entries in place."""
    out, pending = [], []
    for line in sass.splitlines():
        m = LABEL.match(line.strip())
        if m:
            pending.append(m[1])
            continue
        m = INSTR.search(line)
        if m:
            addr = int(m[1], 16)
            out += [(addr, "label:" + lab, None) for lab in pending]
            pending = []
            t = TARGET.search(line) if m[2] == "BRA" else None
            out.append((addr, m[2], t[1] if t else None))
    return out


def _classes(ops: list[str]) -> dict[str, int]:
    got = {name: sum(op in members for op in ops) for name, members in CLASSES.items()}
    got["total"] = len(ops)
    got["cvt"] = sum(got[c] for c in CVT)
    return got


def counts(sass: str) -> dict:
    """Whole-kernel and page-loop instruction classes (see the module doc); the page loop's
    nested loops (K blocks by width, the prefetch) as their own static sizes."""
    ins = parse(sass)
    where = {op[6:]: a for a, op, _ in ins if op.startswith("label:")}
    code = [(a, op, t) for a, op, t in ins if not op.startswith("label:")]
    loops = sorted((where[t], a) for a, op, t in code if t in where and where[t] <= a)
    outer = [lp for lp in loops if not any(o != lp and o[0] <= lp[0] and lp[1] <= o[1]
                                           for o in loops)]  # fmt: skip

    def ops_in(lo, hi):
        return [op for a, op, _ in code if lo <= a <= hi]

    out = {"kernel": _classes([op for _, op, _ in code])}
    page = next((lp for lp in outer if "HMMA" in ops_in(*lp)), None)
    if page is not None:
        out["page_loop"] = _classes(ops_in(*page))
        inner = [lp for lp in loops if lp != page and page[0] <= lp[0] and lp[1] <= page[1]]
        out["nested"] = [_classes(ops_in(*lp)) for lp in inner]
    return out


PTX_CVT = re.compile(r"^\s*(?:@%p\d+\s+)?cvt\.([a-z0-9.]+)", re.M)


def ptx_counts(ptx: str) -> dict[str, int]:
    """``cvt`` instructions of a PTX text by type (e.g. ``rn.f32.s32``): the fallback where no
    nvdisasm is available (static, whole kernel)."""
    got: dict[str, int] = {}
    for kind in PTX_CVT.findall(ptx):
        got[kind] = got.get(kind, 0) + 1
    return got
