"""Compile the TriZone decode kernels for a GPU target without a GPU; report registers and spills.

    python bench/compile_check.py [--arch 90] [-k SUBSTRING] [--json PATH] [--sass]

Every (uniform pages, bit widths, head_dim, side output) configuration that
``decode.plan()`` and ``bench/decode_attention.py`` launch is compiled ahead of time with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` (Triton's bundled ptxas,
no driver), with the argument specialisation the JIT would choose (16-divisible pointers and
ints, ints equal to 1 as constexprs).  Prints per config OK/FAIL, registers, spill stores/loads
(ptxas -v) and shared memory (bytes); the full error of every failing config follows the table.
``--sass`` also disassembles each cubin (Triton's bundled nvdisasm; PTX ``cvt`` counts where it
is missing) and prints the instructions that matter for the page loop (:mod:`sass_counts`).
Needs only triton (no torch): the kernel modules are loaded from kernels/ by path.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import re
import sys
import tempfile
import types
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the JIT's default; silences Triton 3.9
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton.runtime.jit import native_specialize_impl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sass_counts  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = {64: (7, 2), 128: (4, 8)}  # head_dim -> (group, H_kv): Qwen2.5-0.5B, Llama-3.1-8B
MIXES = {  # name -> (V bit widths, K bit widths) present in the plan
    "full": ((), ()),
    "qevict2": ((2,), (2,)),
    "u4": ((4,), (4,)),
    "u8": ((8,), (8,)),
    "rdkv": ((2, 4, 8, 16), (2, 4, 8, 16)),
}
UNIFORM_MIXES = ("qevict2", "u4", "u8")


MODULES = (
    "_dequant",
    "_decode_common",
    "_decode_pages",
    "_decode_split",
    "_decode_merge",
    "_decode_mass",
    "_extend_kernels",
)


def load_kernels() -> list[types.ModuleType]:
    """The decode kernel modules of this checkout, loaded by path in dependency order under
    their package names (no torch import; an installed tiered_radix is not consulted)."""
    for name in ("tiered_radix", "tiered_radix.kernels"):
        if name not in sys.modules:
            sys.modules[name] = types.ModuleType(name)
    out = []
    for mod in MODULES:
        full = f"tiered_radix.kernels.{mod}"
        if full not in sys.modules:
            spec = importlib.util.spec_from_file_location(full, ROOT / "kernels" / f"{mod}.py")
            sys.modules[full] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(sys.modules[full])
        out.append(sys.modules[full])
    return out


def kernel(name: str):
    """The @triton.jit kernel ``name`` from the decode kernel modules."""
    for m in load_kernels():
        if hasattr(m, name):
            return getattr(m, name)
    raise LookupError(f"kernel {name} not found in kernels/_decode_*.py")


@dataclass(frozen=True)
class Config:
    name: str
    kernel: str
    args: dict  # runtime args: "*dtype" pointer strings, ints, floats, None
    constexprs: dict
    num_warps: int
    num_stages: int = 2
    maxnreg: int | None = None


def _split(uniform: bool, mix: str, d: int, side: bool, ppi: int, warps: int | None,
           page: int = 32, il: bool = True, kg: bool = False, upipe: bool = False,
           stages: int = 2, gpad: int = 16, maxnreg: int | None = None, kbl: bool = False,
           kc: int = 16, pf: int = 1, magic: bool = False):  # fmt: skip
    grp, hkv = FAMILIES[d]
    vb, kb = MIXES[mix]
    pages = bool(vb)
    ptr = {n: "*i32" for n in ("perm_ptr", "full_indptr_ptr", "full_end_ptr", "full_slots_ptr",
                               "fresh_indptr_ptr", "fresh_slots_ptr", "page_ntok_ptr",
                               "page_indptr_ptr", "page_ids_ptr", "k_table_ptr")}  # fmt: skip
    args = dict(ptr, q_ptr="*bf16", k_pool="*bf16", v_pool="*bf16", arena8="*u8",
                arena16="*fp16", arenadt="*bf16", page_off_ptr="*i64", part_acc_ptr="*fp32",
                part_ml_ptr="*fp32", score_ptr="*fp32", q_stride_b=grp * hkv * d, q_stride_h=d,
                pool_stride_s=hkv * d, pool_stride_h=d, row_full=4096 * 32 + 0,
                row_fresh=4096 * 32 + 1000, qk_scale=0.127, H_KV=hkv, G=grp, S=33)  # fmt: skip
    cx = dict(DT=tl.bfloat16, D=d, G_PAD=gpad, P=page, VG=32, BLOCK_N=64 if d == 64 else 32,
              MASS=side, VBITS=sum(vb), KBITS=sum(kb))  # fmt: skip
    args.update(page_unit_ptr="*i32", full_units_ptr="*i32", fresh_units_ptr="*i32")
    cx.update(UNIFORM=uniform, PPI=ppi if uniform and pages else 1, IL=il)
    if kg:  # plan(k_path="gather"): general pages, K as one gathered tile
        args["arena32"] = "*i32"
        cx.update(KG=True, RAW_BF16=True)
    cx["UPIPE"] = upipe  # plan(prefetch="pipeliner")
    cx["MAGIC"] = magic  # plan(dequant="magic")
    if kbl:  # plan(k_path="blocks"): K width blocks of kc channels, prefetch pf (0/L1/L2)
        cx.update(KBL=True, KC=kc, PF=pf)
        args["q_perm_ptr"] = "*bf16"  # the query in permuted channel order (decode.run)
    w = warps or 4
    tag = f"{'u' if uniform else 'g'} {mix:7} d{d} {'mass' if side else '-   '} ppi{ppi} w{w}"
    tag += "" if page == 32 and il else f" p{page}{'' if il else ' shift'}"
    tag += (" gather" if kg else "") + (" pipe" if upipe else "")
    tag += f" blocks{kc} pf{pf}" if kbl else ""
    tag += ("" if stages == 2 else f" st{stages}") + ("" if gpad == 16 else f" g{gpad}")
    tag += "" if maxnreg is None else f" r{maxnreg}"
    tag += " magic" if magic else ""
    return Config(f"split {tag}", "_decode_split_kernel", args, cx, w, stages, maxnreg)


def _merge(d: int, s: int) -> Config:
    grp, hkv = FAMILIES[d]
    s_pad = max(2, 1 << (s - 1).bit_length())
    args = dict(part_acc_ptr="*fp32", part_ml_ptr="*fp32", out_ptr="*bf16",
                out_stride_b=grp * hkv * d, out_stride_h=d, lse_ptr="*fp32", H_KV=hkv, G=grp,
                S=s)  # fmt: skip
    cx = dict(D=d, G_PAD=16, S_PAD=s_pad, BLOCK_S=min(s_pad, 16))
    return Config(f"merge d{d} S{s}", "_decode_merge_kernel", args, cx, 4)


def _q_perm(d: int) -> Config:
    """decode.run's permuted query for k_path="blocks" (one small launch before the split)."""
    grp, hkv = FAMILIES[d]
    args = dict(q_ptr="*bf16", q_stride_b=grp * hkv * d, q_stride_h=d, perm_ptr="*i32",
                out_ptr="*bf16", H_KV=hkv, G=grp)  # fmt: skip
    return Config(f"q_perm d{d}", "_q_perm_kernel", args, dict(D=d, G_PAD=16), 4)


def _mass(d: int) -> Config:
    grp, hkv = FAMILIES[d]
    args = {n: "*i32" for n in ("full_indptr_ptr", "full_end_ptr", "full_units_ptr",
                                "fresh_indptr_ptr", "fresh_units_ptr", "page_indptr_ptr",
                                "page_ids_ptr", "page_ntok_ptr", "page_units_ptr")}  # fmt: skip
    args.update(
        score_ptr="*fp32",
        lse_ptr="*fp32",
        mass_ptr="*fp32",
        mass_stride=4096,
        row_full=4096 * 32,
        row_fresh=4096 * 32 + 1000,
        H_KV=hkv,
        G=grp,
        S=33,
    )
    args["page_unit_ptr"] = "*i32"
    g_p2 = max(2, 1 << (grp - 1).bit_length())
    cx = dict(G_PAD=16, P=32, G_P2=g_p2, BLOCK_N=64 if d == 64 else 32, NT=16, NBLK=8)
    return Config(f"mass d{d}", "_decode_mass_kernel", args, cx, 4)


def _extend(
    d: int,
    pages: bool,
    page: int = 32,
    signals: str | None = None,
    warps: int | None = None,
    qnorm: bool = False,
    fused: str | None = None,
) -> Config:
    """The extend kernels (``kernels/extend.py``): attention (``qnorm``: with its per-tile sums
    of q^2, as rdkv runs it; ``fused``: with the signals the launch writes itself, "attn" = the
    last query only, "obs" = obs_attn, as qevict's and snapkv's prefill run it), or the signals
    pass (``signals``: "attn" = the last query only, "snap" = obs_attn and colmass, split in
    runs)."""
    grp, hkv = FAMILIES[d]
    g_pad = 1 << (grp - 1).bit_length()
    il = page >= 32
    ptr = {n: "*i32" for n in ("ent_blk", "ent_win", "n_rows", "n_pages", "q_start", "q_len",
                               "seq_len")}  # fmt: skip
    args = dict(ptr, q_ptr="*bf16", lse_ptr="*fp32", rows_k="*bf16", rows_v="*bf16",
                arena8="*u8", arena16="*fp16", q_st=grp * hkv * d, q_sh=d,
                page_bytes=1088 if d == 64 else 2176, list_stride=960, qk_scale=0.18,
                H_KV=hkv, G=grp)  # fmt: skip
    cx = dict(DT=tl.bfloat16, D=d, G_PAD=g_pad, BLOCK_M=max(16, 128 // g_pad), W=page,
              WPI=max(1, 64 // page), VB=2, VG=min(page, 32), PAGES=pages, IL=il)  # fmt: skip
    w = warps or (4 if d == 64 else 8)
    tag = f"d{d} p{page} {'pages' if pages else 'rows '} w{w}"
    if signals is None:
        args.update(out_ptr="*bf16", o_st=grp * hkv * d, o_sh=d, tile_b="*i32", tile_m="*i32",
                    qsq_ptr="*fp32", qsq_sb=512 * hkv * d, obs_ptr="*fp32", attn_ptr="*fp32",
                    sig_sr=2 * 30720, sig_sh=30720, sig_off="*i32")  # fmt: skip
        cx.update(PPI=1, QNORM=qnorm, OBS=fused == "obs", LAST=fused == "attn", OBS_WINDOW=32)
        tag += (" qnorm" if qnorm else "") + (f" +{fused}" if fused else "")
        return Config(f"extend {tag}", "_extend_attn_kernel", args, cx, w)
    args.update(colmass_ptr="*fp32", obs_ptr="*fp32", attn_ptr="*fp32", sig_sr=2 * 30720,
                sig_sh=30720, split_off="*i32", split_n="*i32", TILES=480, S_MAX=8)  # fmt: skip
    snap = signals == "snap"
    cx.update(COLMASS=snap, OBS=snap, LAST=not snap, OBS_WINDOW=32)
    return Config(f"extend-signals {signals} {tag}", "_extend_signals_kernel", args, cx, w)


def dequant_configs(d: int) -> list[Config]:
    """plan(dequant=...) on the --targets rows of head_dim d, each config under "convert" then
    "magic": qevict's uniform pages (default, max_regs=128, pipeliner depth 8) and rdkv's served
    plan (k_path="blocks", blocks of 32 channels, 128 registers; side output off and on)."""
    out = []
    for kw in (dict(), dict(maxnreg=128), dict(upipe=True, stages=8, maxnreg=128)):
        out += [_split(True, "qevict2", d, False, 1, None, magic=m, **kw) for m in (False, True)]
    for side in (False, True):
        out += [_split(False, "rdkv", d, side, 1, 4, kbl=True, kc=32, maxnreg=128, magic=m)
                for m in (False, True)]  # fmt: skip
    return out


def register_budget_configs(d: int) -> list[Config]:
    """The served plans (qevict's uniform pages, rdkv's blocks of 32 channels; magic dequant)
    under tighter register caps than 128: 96 fits 5 programs of 4 warps an SM, 80 six, against
    4 at 128 (run 31: resident warps x latency binds rdkv's pages), at the price of spills."""
    out = []
    for r in (96, 80):
        out += [_split(True, "qevict2", d, side, 1, None, maxnreg=r, magic=True)
                for side in (False, True)]  # fmt: skip
        out += [_split(False, "rdkv", d, side, 1, 4, kbl=True, kc=32, maxnreg=r, magic=True)
                for side in (False, True)]  # fmt: skip
    return out


def configs() -> list[Config]:
    out = []
    for d in (64, 128):
        for side in (False, True):
            out += [_split(False, m, d, side, 1, None) for m in MIXES]
            out += [_split(True, m, d, side, 1, None) for m in UNIFORM_MIXES]
        # bench/decode_attention.py tuning rows: 2 pages an iteration at 4 and 8 warps
        out += [_split(True, "qevict2", d, False, 2, w) for w in (4, 8)]
        # 16-token pages, where the kernel failed on the H200 (run 6): interleave vs shift
        for il in (True, False):
            out += [_split(False, m, d, True, 1, None, 16, il) for m in ("u4", "rdkv")]
            out += [_split(True, m, d, True, 2, None, 16, il) for m in ("qevict2", "u4")]
        # the variants bench/decode_attention.py --targets times beside the default, and the
        # neighbours that decided them (bench/decode_notes.md)
        gmin = 1 << (FAMILIES[d][0] - 1).bit_length()
        for side in (False, True):
            out += [_split(False, "rdkv", d, side, 1, w, kg=True) for w in (4, 8)]
            out += [_split(False, "rdkv", d, side, 1, 4, kg=True, upipe=True, stages=st)
                    for st in (3, 8)]  # fmt: skip
            out += [_split(True, "qevict2", d, side, 1, None, maxnreg=128)]
            out += [_split(True, "qevict2", d, side, 1, None, upipe=True, stages=st, maxnreg=r)
                    for st, r in ((3, None), (8, None), (8, 128), (11, None))]  # fmt: skip
        out.append(_split(True, "qevict2", d, False, 1, None, gpad=gmin))
        out.append(_split(True, "qevict2", d, False, 1, None, upipe=True, stages=3, gpad=gmin))
        out.append(_split(True, "qevict2", d, False, 1, 2))
        out += [_split(True, "qevict2", d, False, 2, w, upipe=True, stages=3) for w in (4, 8)]
        out.append(_split(True, "qevict2", d, False, 2, 4, upipe=True, stages=8, maxnreg=128))
        out += [_split(False, "rdkv", d, False, 1, 4, kg=True, maxnreg=r) for r in (128, 168)]
        out += [_split(False, "rdkv", d, side, 1, 8, kg=True, maxnreg=128) for side in (0, 1)]
        out += [_split(False, "rdkv", d, False, 1, 8, kg=True, upipe=True, stages=st, maxnreg=128)
                for st in (3, 8)]  # fmt: skip
        # k_path="blocks" (RDKV's Zone A path): the adapter's plan (side output), the bench rows
        for side in (False, True):
            out += [_split(False, "rdkv", d, side, 1, w, kbl=True, kc=kc, pf=pf)
                    for w, kc, pf in ((4, 16, 1), (4, 16, 2), (4, 16, 0), (4, 32, 1), (2, 16, 1),
                                      (8, 16, 1))]  # fmt: skip
            out.append(_split(False, "rdkv", d, side, 1, 4, kbl=True, maxnreg=128))
        out.append(_split(False, "rdkv", d, True, 1, 4, 16, False, kbl=True))  # 16-token pages
        out.append(_split(False, "rdkv", d, False, 1, 4, 32, False, kbl=True, maxnreg=128))
        out.append(_split(False, "rdkv", d, False, 1, 4, kbl=True, stages=1, maxnreg=128))
        out += [c for c in dequant_configs(d) if c not in out]
        out += register_budget_configs(d)
        out += [_merge(d, s) for s in (4, 64)]
        out.append(_mass(d))
        out.append(_q_perm(d))
        for page in (16, 32):
            out += [_extend(d, pages, page) for pages in (False, True)]
            out += [_extend(d, True, page, sig) for sig in ("attn", "snap")]
            out.append(_extend(d, False, page, qnorm=True))  # rdkv's prefill: rows, qnorm
            out += [_extend(d, True, page, fused=f) for f in ("attn", "obs")]  # fused signals
            out.append(_extend(d, False, page, "snap"))
        out += [_extend(d, True, 32, None, 4 if d == 128 else 8)]  # the other warp count
    return out


def specialise(fn, cfg: Config):
    """(signature, constexprs, attrs) as the JIT builds them for these arguments."""
    sig, cx, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            val = cfg.constexprs.get(p.name, p.default)
            sig[p.name], cx[(i,)] = "constexpr", val
            continue
        val = cfg.args.get(p.name, p.default)
        if isinstance(val, str):  # a pointer (PyTorch allocations are 16-byte aligned)
            ty, attr = val, "D"
        else:
            ty, attr = native_specialize_impl(BaseBackend, val, False, True, True)
        sig[p.name] = ty
        if ty == "constexpr":
            cx[(i,)] = val
        elif attr:
            attrs[(i,)] = BaseBackend.parse_attr(attr)
    return sig, cx, attrs


PTXAS = re.compile(r"Used (\d+) registers")
SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _chain(e: BaseException) -> str:
    """An exception and its causes, innermost (the root cause) first."""
    parts = []
    while e is not None:
        parts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    return "\n\n".join(reversed(parts))


def compile_one(cfg: Config, arch: int, sass: bool = False) -> dict:
    fn = kernel(cfg.kernel)
    log = io.StringIO()
    try:  # (a config missing a kernel argument fails in specialise: reported like the rest)
        sig, cx, attrs = specialise(fn, cfg)
        src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs)
        with contextlib.redirect_stdout(log):
            k = triton.compile(
                src,
                target=GPUTarget("cuda", arch, 32),
                options=dict(
                    num_warps=cfg.num_warps,
                    num_stages=cfg.num_stages,
                    **({} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg}),
                ),
            )
    except Exception as e:  # noqa: BLE001 - every failure is reported, the sweep goes on
        return dict(name=cfg.name, ok=False, error=_chain(e))
    text = log.getvalue()
    regs, spill = PTXAS.search(text), SPILL.search(text)
    out = dict(name=cfg.name, ok=True, regs=int(regs[1]) if regs else None,
               spill_st=int(spill[1]) if spill else None,
               spill_ld=int(spill[2]) if spill else None, shared=k.metadata.shared)  # fmt: skip
    if sass:
        out["ptx_cvt"] = sass_counts.ptx_counts(k.asm["ptx"])
        text = sass_counts.nvdisasm(k.asm["cubin"])
        if text is not None:
            out["sass"] = sass_counts.counts(text)
    return out


def print_sass(rows: list[dict]) -> None:
    """The --sass table: per config, the page loop's static instruction classes (nested loops
    once), its nested loops' totals, and the whole kernel's conversions (SASS, else PTX cvt)."""
    cols = ("total", "cvt", "i2f", "f2fp", "fp32", "alu", "imad", "mma", "mem")
    print(f"\n{'page loop (SASS, static)':44} " + " ".join(f"{c:>5}" for c in cols)
          + "  nested loops: total/cvt; kernel cvt")  # fmt: skip
    for r in rows:
        if not r.get("ok"):
            continue
        sc = r.get("sass")
        if sc is None:
            print(f"{r['name']:44} no nvdisasm; PTX cvt: {r.get('ptx_cvt')}")
            continue
        page = sc.get("page_loop", {})
        nested = " ".join(f"{x['total']}/{x['cvt']}" for x in sc.get("nested", []))
        print(f"{r['name']:44} " + " ".join(f"{page.get(c, 0):5}" for c in cols)
              + f"  [{nested}] {sc['kernel']['cvt']}")  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90 = H100/H200)")
    ap.add_argument("-k", default="", help="only configs whose name contains this")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument(
        "--sass",
        action="store_true",
        help="also count the page loop's SASS instructions (conversions, FMA, int)",
    )
    ap.add_argument(
        "--dequant",
        action="store_true",
        help="only the plan(dequant=...) configs, convert then magic (with --sass)",
    )
    args = ap.parse_args(argv)
    knobs = triton.knobs
    knobs.nvidia.dump_ptxas_log = True  # ptxas -v output: registers and spills
    knobs.compilation.always_compile = True
    knobs.cache.dir = tempfile.mkdtemp(prefix="trizone-compile-check-")
    print(f"triton {triton.__version__}, target sm_{args.arch}")
    print(f"{'config':44} {'status':6} {'regs':>5} {'spill st/ld':>12} {'smem':>7}")
    rows = []
    todo = [c for d in (64, 128) for c in dequant_configs(d)] if args.dequant else configs()
    for cfg in todo:
        if args.k not in cfg.name:
            continue
        r = compile_one(cfg, args.arch, args.sass)
        rows.append(r)
        if r["ok"]:
            spill = f"{r['spill_st']}/{r['spill_ld']}"
            print(f"{r['name']:44} {'OK':6} {r['regs']:5} {spill:>12} {r['shared']:7}", flush=True)
        else:
            print(f"{r['name']:44} FAIL   {r['error'].splitlines()[0][:70]}", flush=True)
    if args.sass:
        print_sass(rows)
    failed: dict[str, list[str]] = {}
    for r in rows:
        if not r["ok"]:
            failed.setdefault(r["error"], []).append(r["name"].strip())
    for err, names in failed.items():  # each distinct error once, root cause first
        print(f"\n==== {len(names)} config(s): {'; '.join(names)}\n{err}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            dict(triton=triton.__version__, arch=args.arch, rows=rows), indent=1))  # fmt: skip
    return int(any(not r["ok"] for r in rows))


if __name__ == "__main__":
    sys.exit(main())
