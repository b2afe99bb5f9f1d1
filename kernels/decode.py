"""TriZone decode attention: ``plan()`` per batch (may touch the CPU), ``run()`` per layer.

``run()`` launches three kernels with fixed-address buffers and no host sync, so it can be
captured in a CUDA graph: split (one program per (request, KV head, split) reading its pages and
rows once), merge (log-sum-exp over splits), and, when the side output is on, mass (turns the
split kernel's stored logits into probabilities with the merged lse and accumulates them per unit).

The split kernel reads uniform pages (``layout.k_uniform``) with a compile-time page geometry,
several pages an iteration and the next block's bytes in flight; it stores one log2-sum-exp2
per (single-unit tile, head) for the side output instead of every token's logit; the merge runs
one program per query head. (It replaced a first kernel generation, measured against it in
bench/decode_notes.md, which read every page through the general path.)  Options of ``plan()``
choose other page loops for the same layout (``k_path``, ``prefetch``, ``num_stages``,
``max_regs``, ``dequant``); ``bench/decode_attention.py --targets`` times them beside the defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton.language as tl
from tiered_radix.kernels._decode_mass import _decode_mass_kernel
from tiered_radix.kernels._decode_merge import _decode_merge_kernel
from tiered_radix.kernels._decode_split import _decode_split_kernel, _q_perm_kernel

from tiered_radix.formats.layout import TriZoneLayout

LOG2E = 1.4426950408889634
NUM_SMS_DEFAULT = 132


class DecodeInputError(ValueError):
    """A tensor given to plan() or run() has the wrong shape, dtype or device."""


@dataclass(frozen=True)
class DecodePlan:
    """Launch configuration and scratch buffers for one batch (shared by all layers).

    part_acc: float32 [B*H_kv, S, G_pad, d]; part_ml: float32 [B*H_kv, S, 2, G_pad];
    lse: float32 [B*H_kv, G_pad] (log2 domain); score: float32 [rows, G] (side output only);
    q_perm: k_path="blocks" on general pages: the query in each (request, KV head)'s permuted
    K channel order, the layout's dtype [B*H_kv, G_pad, d], written by run() each call (one
    small kernel before the split kernel); else None.
    """

    batch: int
    num_kv_heads: int
    group: int
    head_dim: int
    num_splits: int
    g_pad: int
    v_bits: tuple[int, ...]
    k_bits: tuple[int, ...]
    side_output: bool
    uniform: bool
    pages_per_iter: int
    block_n: int
    num_warps: int
    num_stages: int
    part_acc: torch.Tensor
    part_ml: torch.Tensor
    lse: torch.Tensor
    score: torch.Tensor
    # sub-byte unpacking: "interleave" (tl.interleave, in-thread) or "shift" (shift-and-reshape;
    # what pages under IL_MIN_PAGE_CUDA tokens need on CUDA)
    unpack: str = "interleave"
    # general pages: K read per width section ("sections") or as one gathered tile ("gather")
    k_path: str = "sections"
    # uniform pages: next block prefetched by hand ("manual") or by Triton's pipeliner
    prefetch: str = "manual"
    # register cap of the split kernel (ptxas .maxnreg; None: the compiler's choice)
    max_regs: int | None = None
    # k_path="blocks": channels a K block (16 or 32) and the next page's prefetch ("l1", "l2",
    # "none"; always "none" under the CPU interpreter, which has no inline PTX)
    k_block: int = 32
    page_prefetch: str = "l1"
    # sub-byte codes to float32: "convert" (int -> float conversions) or "magic" (from the bits;
    # uniform pages and k_path="blocks")
    dequant: str = "convert"
    q_perm: torch.Tensor | None = None


def _splits(batch: int, hkv: int, max_rows: int, num_sms: int, per_sm: int = 16) -> int:
    # the page loop is latency-bound (indirect loads): aim at ~per_sm programs per SM
    want = math.ceil(per_sm * num_sms / (batch * hkv))
    cap = max(1, max_rows // 128)  # >= 128 tokens a split, else merging costs more than it saves
    return int(max(1, min(want, cap, 128)))


# tl.interleave unpacking is miscompiled on the H200 under Triton 3.6 in two shapes, both right
# with shift-and-reshape unpacking and under the interpreter (bench/decode_notes.md):
# - pages under 32 tokens (K rows of 4 or 8 bytes): wrong outputs at page_size 16;
# - k_path="blocks" with blocks of 16 channels: wrong outputs; blocks of 32 channels are right.
IL_MIN_PAGE_CUDA = 32
IL_MIN_K_BLOCK_CUDA = 32


def _unpack(unpack: str | None, device_type: str, page_size: int, has_pages: bool,
            k_path: str, k_block: int) -> str:  # fmt: skip
    """The sub-byte unpacking for a plan: ``unpack`` if given and safe, else interleave where
    it compiles right, shift where it does not (see above)."""
    cuda = device_type == "cuda"
    small_page = cuda and page_size < IL_MIN_PAGE_CUDA
    small_block = cuda and k_path == "blocks" and k_block < IL_MIN_K_BLOCK_CUDA
    if unpack is None:
        return "shift" if small_page or small_block else "interleave"
    if unpack not in ("interleave", "shift"):
        raise DecodeInputError(f"unpack={unpack!r}: use 'interleave' or 'shift'")
    if unpack == "interleave" and has_pages and small_page:
        raise DecodeInputError(
            f"unpack='interleave' with {page_size}-token pages gives wrong results on CUDA "
            f"(Triton 3.6, sm_90); use unpack='shift' or pages of >= {IL_MIN_PAGE_CUDA} tokens"
        )
    if unpack == "interleave" and has_pages and small_block:
        raise DecodeInputError(
            f"unpack='interleave' with k_path='blocks' and k_block={k_block} gives wrong "
            f"results on CUDA (Triton 3.6, sm_90); use unpack='shift' or k_block="
            f"{IL_MIN_K_BLOCK_CUDA}"
        )
    return unpack


def plan(
    layout: TriZoneLayout,
    *,
    num_q_heads: int,
    side_output: bool = False,
    num_splits: int | None = None,
    v_bits: tuple[int, ...] | None = None,
    k_bits: tuple[int, ...] | None = None,
    max_rows: int | None = None,
    num_sms: int | None = None,
    pages_per_iter: int | None = None,
    num_warps: int | None = None,
    uniform_pages: bool = True,
    unpack: str | None = None,
    k_path: str = "sections",
    prefetch: str = "manual",
    num_stages: int | None = None,
    g_pad: int | None = None,
    max_regs: int | None = None,
    k_block: int = 32,
    page_prefetch: str = "l1",
    dequant: str = "convert",
) -> DecodePlan:
    """Choose splits and configs for layouts shaped like ``layout``; allocate scratch buffers.

    v_bits / k_bits: bit widths the kernel is compiled for (default: those present in
    ``layout``); pass (2, 4, 8, 16) to serve every layer of a model with one plan.
    max_rows: longest per-head token count (default: from ``layout``, a CPU read).
    pages_per_iter (uniform pages; default 32 // page_size) and num_warps override the
    built-in choices.
    uniform_pages: use the specialised path for ``layout.k_uniform`` layouts (False: the
    general page path, as for per-channel K); bench/compile_check.py compiles every config.
    unpack: ``"interleave"`` or ``"shift"`` (see :class:`DecodePlan`); default
    interleave, but shift on CUDA for pages under :data:`IL_MIN_PAGE_CUDA` tokens and for
    ``k_path="blocks"`` with blocks under :data:`IL_MIN_K_BLOCK_CUDA` channels, where
    interleave is refused (miscompiled by Triton 3.6 on sm_90).
    k_path: how general pages (per-channel K widths, RDKV) read K: ``"sections"`` (default: one
    masked [D, P] pass per K width present, channel counts known at run time) or ``"gather"``
    (one [D, P] tile a page, each (channel, token) code gathered from its 32-bit word; the
    per-channel geometry and the permuted query hoisted out of the page loop) or ``"blocks"``
    (Zone A's uniform path: per K width present, a compile-time loop, the width's channels as
    dense [k_block, P] blocks; the split cuts each (request, head)'s pages across its V-width
    lists; the next page prefetched per ``page_prefetch``).  bench/decode_notes.md compares them.
    prefetch: uniform pages' (and ``k_path="gather"`` pages') next block loaded by hand one
    iteration ahead (``"manual"``, default) or left to Triton's software pipeliner
    (``"pipeliner"``: loads in the iteration that uses them, staged through shared memory by
    asynchronous copies; the page id -> offset -> bytes chain spreads ``num_stages`` over three
    loads, so ``num_stages=8`` keeps two page blocks in flight, 11 three).
    num_stages: the split kernel's Triton ``num_stages`` (default 2).
    g_pad: rows the query group is padded to for ``tl.dot`` (default 16; a power of two >= the
    group; fewer rows, a smaller accumulator, where the Triton version accepts it).
    max_regs: registers a thread of the split kernel may use (``maxnreg``; e.g. 128 for 4
    programs of 4 warps an SM; ptxas spills what does not fit), default uncapped.
    dequant: how K and V codes (2/4/8 bits) become ``code * scale + lo``: ``"convert"``
    (default: ``float(code)`` by an int -> float conversion, which the CUDA guide rates at an
    eighth of the FMA rate) or ``"magic"`` (``1 + code / 2**bits`` built from the code's bits,
    one FMA with the scale and offset rescaled once a group: the same values to float32
    rounding, no conversion; kernels/_dequant.py).  ``"magic"`` serves uniform pages (K and V) and
    ``k_path="blocks"`` (K blocks and V) and is refused with another general ``k_path``; it
    stays opt-in until a GPU run times it (bench/decode_notes.md).
    """
    if k_path not in ("sections", "gather", "blocks"):
        raise DecodeInputError(f"k_path={k_path!r}: use 'sections', 'gather' or 'blocks'")
    if k_block not in (16, 32):
        raise DecodeInputError(f"k_block={k_block}: use 16 or 32")
    if page_prefetch not in ("l1", "l2", "none"):
        raise DecodeInputError(f"page_prefetch={page_prefetch!r}: use 'l1', 'l2' or 'none'")
    if prefetch not in ("manual", "pipeliner"):
        raise DecodeInputError(f"prefetch={prefetch!r}: use 'manual' or 'pipeliner'")
    if dequant not in ("convert", "magic"):
        raise DecodeInputError(f"dequant={dequant!r}: use 'convert' or 'magic'")
    unpack = _unpack(unpack, layout.k_pool.device.type, layout.page_size,
                     bool(layout.page_ids.numel()), k_path, k_block)  # fmt: skip
    hkv, d = layout.num_kv_heads, layout.head_dim
    if num_q_heads % hkv:
        raise DecodeInputError(f"num_q_heads={num_q_heads} is not a multiple of H_kv={hkv}")
    if d not in (64, 128):
        raise DecodeInputError(f"head_dim {d} unsupported: use 64 or 128")
    group = num_q_heads // hkv
    bh = layout.batch * hkv
    dev = layout.k_pool.device
    if max_rows is None:
        ind = layout.full_indptr.cpu()
        pages = layout.page_indptr.cpu().view(-1)
        per = (ind[1:] - ind[:-1]) + (pages[4::4] - pages[0:-1:4]) * layout.page_size
        fr = layout.fresh_indptr.cpu()
        max_rows = int(per.max()) + int((fr[1:] - fr[:-1]).max())
    if num_sms is None:
        num_sms = (
            torch.cuda.get_device_properties(dev).multi_processor_count
            if dev.type == "cuda"
            else NUM_SMS_DEFAULT
        )
    for name, bits in (("v_bits", v_bits), ("k_bits", k_bits)):
        if bits is not None and not set(bits) <= {2, 4, 8, 16}:
            raise DecodeInputError(f"{name}={bits}: bit widths must be among 2, 4, 8, 16")
    uniform = layout.k_uniform and uniform_pages
    if dequant == "magic" and not uniform and k_path != "blocks":
        raise DecodeInputError(
            f"dequant='magic' with k_path={k_path!r} on general pages: it is implemented for "
            "uniform pages and k_path='blocks'; use dequant='convert' or k_path='blocks'"
        )
    # ~32 programs per SM (SGLang's Triton decode: 96% of copy bandwidth at 64 splits for
    # 128K x 8, 73% at 16; the first kernel generation's 16 per SM -> 33 splits, 86%)
    s = num_splits or _splits(layout.batch, hkv, max_rows, num_sms, 32)
    # 1 page (P=32) an iteration: 128 registers at 4 warps, 4 programs per SM (sm_90 compile);
    # 2 pages need 215 (2 programs per SM), 4 spill
    ppi = pages_per_iter or max(1, 32 // layout.page_size)
    if ppi & (ppi - 1):
        raise DecodeInputError(f"pages_per_iter={ppi} must be a power of two")
    if num_warps is None:
        num_warps = 4
    least = max(1, 1 << (group - 1).bit_length())
    if g_pad is None:
        g_pad = max(16, least)
    if g_pad < least or g_pad & (g_pad - 1):
        raise DecodeInputError(f"g_pad={g_pad} must be a power of two >= the group {group}")
    rows = (
        layout.page_ntok.numel() * layout.page_size
        + layout.full_slots.numel()
        + layout.fresh_slots.numel() * hkv
    )
    f32 = dict(dtype=torch.float32, device=dev)
    blocks = k_path == "blocks" and not uniform
    q_perm = torch.zeros(bh, g_pad, d, dtype=layout.dtype, device=dev) if blocks else None
    return DecodePlan(
        batch=layout.batch,
        num_kv_heads=hkv,
        group=group,
        head_dim=d,
        num_splits=s,
        g_pad=g_pad,
        v_bits=tuple(v_bits or layout.v_bits_present),
        k_bits=tuple(k_bits or layout.k_bits_present),
        side_output=side_output,
        uniform=uniform,
        pages_per_iter=ppi,
        block_n=64 if d == 64 else 32,
        num_warps=num_warps,
        num_stages=num_stages or 2,
        part_acc=torch.empty(bh, s, g_pad, d, **f32),
        part_ml=torch.empty(bh, s, 2, g_pad, **f32),
        lse=torch.empty(bh, g_pad, **f32),
        score=torch.empty(max(rows, 1) if side_output else 1, group, **f32),
        unpack=unpack,
        k_path=k_path,
        prefetch=prefetch,
        max_regs=max_regs,
        k_block=k_block,
        page_prefetch=page_prefetch if dev.type == "cuda" else "none",
        dequant=dequant,
        q_perm=q_perm,
    )


def _check(q: torch.Tensor, layout: TriZoneLayout, p: DecodePlan, out, mass) -> None:
    want = (p.batch, p.num_kv_heads * p.group, p.head_dim)
    if tuple(q.shape) != want or q.dtype != layout.dtype or q.stride(-1) != 1:
        raise DecodeInputError(f"q must be {layout.dtype} {list(want)} (last dim contiguous)")
    if (layout.batch, layout.num_kv_heads, layout.head_dim) != (p.batch, p.num_kv_heads, want[2]):
        raise DecodeInputError("layout batch/heads/head_dim differ from the plan's")
    end = layout.full_end
    if end is not None and (end.shape != (p.batch * p.num_kv_heads,) or end.dtype != torch.int32
                            or end.stride(0) != 1):  # fmt: skip
        raise DecodeInputError(f"full_end must be int32 [{p.batch * p.num_kv_heads}], contiguous")
    if not set(layout.v_bits_present) <= set(p.v_bits):
        raise DecodeInputError(f"layout has V bits {layout.v_bits_present}, plan {p.v_bits}")
    if not set(layout.k_bits_present) <= set(p.k_bits):
        raise DecodeInputError(f"layout has K bits {layout.k_bits_present}, plan {p.k_bits}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1):
        raise DecodeInputError("out must have q's shape and dtype")
    if p.side_output:
        if mass is None or mass.dtype != torch.float32 or mass.dim() != 2:
            raise DecodeInputError("side output on: pass mass, float32 [B, max_units]")
        if mass.shape[0] != p.batch or mass.shape[1] < layout.max_units or mass.stride(1) != 1:
            raise DecodeInputError(f"mass must be [{p.batch}, >= {layout.max_units}]")
    elif mass is not None:
        raise DecodeInputError("mass given but the plan was made with side_output=False")


def run(
    q: torch.Tensor,
    layout: TriZoneLayout,
    p: DecodePlan,
    *,
    out: torch.Tensor | None = None,
    mass: torch.Tensor | None = None,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Decode attention of q ``[B, H_q, d]`` over one layer's TriZone cache; graph-safe.

    mass: float32 ``[B, >= max_units]``, accumulated (+=) with each unit's attention
    probability summed over the query heads of the KV group (side output on).
    Returns out ``[B, H_q, d]`` (q's dtype).
    """
    _check(q, layout, p, out, mass)
    out = torch.empty_like(q) if out is None else out
    hkv, bh, s = p.num_kv_heads, p.batch * p.num_kv_heads, p.num_splits
    qk = (sm_scale if sm_scale is not None else p.head_dim**-0.5) * LOG2E
    dt = tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16
    if q.device.type == "cpu":  # the Triton interpreter computes bf16 tl.dot wrongly
        dt = tl.float32
    arena = layout.arena
    row_full = layout.page_ntok.numel() * layout.page_size
    row_fresh = row_full + layout.full_slots.numel()
    if p.uniform and not layout.k_uniform:
        raise DecodeInputError("plan made for a k_uniform layout; this layout has per-channel K")
    full_end = layout.full_ends
    extra = dict(
        page_unit_ptr=layout.page_unit, full_units_ptr=layout.full_units,
        fresh_units_ptr=layout.fresh_units, UNIFORM=p.uniform,
        PPI=p.pages_per_iter if p.uniform and layout.page_ids.numel() else 1,
        IL=p.unpack == "interleave", UPIPE=p.prefetch == "pipeliner",
        MAGIC=p.dequant == "magic",
    )  # fmt: skip
    if p.k_path == "gather" and not p.uniform:
        whole = arena.numel() // 4 * 4  # (pages are multiples of 16 bytes)
        extra.update(arena32=arena[:whole].view(torch.int32), KG=True,
                     RAW_BF16=layout.dtype == torch.bfloat16)  # fmt: skip
    if p.q_perm is not None:  # k_path="blocks" on general pages (plan() made the buffer)
        # the query in each (request, head)'s permuted channel order, once a call: the blocks
        # then read it contiguously (no permutation load and dependent gather a block)
        _q_perm_kernel[(bh,)](q, q.stride(0), q.stride(1), layout.perm, p.q_perm, hkv, p.group,
                              D=p.head_dim, G_PAD=p.g_pad, num_warps=4)  # fmt: skip
        extra.update(KBL=True, KC=p.k_block, q_perm_ptr=p.q_perm,
                     PF={"none": 0, "l1": 1, "l2": 2}[p.page_prefetch])  # fmt: skip
    _decode_split_kernel[(bh, s)](
        q, q.stride(0), q.stride(1), layout.perm,
        layout.k_pool, layout.v_pool, layout.k_pool.stride(0), layout.k_pool.stride(1),
        layout.full_indptr, full_end, layout.full_slots, layout.fresh_indptr, layout.fresh_slots,
        arena, arena.view(torch.float16), arena.view(q.dtype), layout.page_off, layout.page_ntok,
        layout.page_indptr, layout.page_ids, layout.k_table, p.part_acc, p.part_ml, p.score,
        row_full, row_fresh, qk, hkv, p.group, s,
        DT=dt, D=p.head_dim, G_PAD=p.g_pad, P=layout.page_size, VG=layout.v_group,
        BLOCK_N=p.block_n, MASS=p.side_output, VBITS=sum(set(p.v_bits)),
        KBITS=sum(set(p.k_bits)), num_warps=p.num_warps, num_stages=p.num_stages,
        **({} if p.max_regs is None else {"maxnreg": p.max_regs}), **extra,
    )  # fmt: skip
    s_pad = max(2, 1 << (s - 1).bit_length())
    _decode_merge_kernel[(bh * p.group,)](
        p.part_acc, p.part_ml, out, out.stride(0), out.stride(1), p.lse, hkv, p.group, s,
        D=p.head_dim, G_PAD=p.g_pad, S_PAD=s_pad, BLOCK_S=min(s_pad, 16), num_warps=4,
    )  # fmt: skip
    if p.side_output:
        _decode_mass_kernel[(bh, s)](
            p.score, p.lse, mass, mass.stride(0), layout.full_indptr, full_end, layout.full_units,
            layout.fresh_indptr, layout.fresh_units, layout.page_indptr, layout.page_ids,
            layout.page_ntok, layout.page_units, layout.page_unit, row_full, row_fresh, hkv,
            p.group, s, G_PAD=p.g_pad, G_P2=max(2, 1 << (p.group - 1).bit_length()),
            P=layout.page_size, BLOCK_N=p.block_n, NT=16, NBLK=8, num_warps=4,
        )  # fmt: skip
    return out
