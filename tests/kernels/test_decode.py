"""TriZone decode kernel vs its torch twin and vs dense float64 attention over the dequantized
cache (rebuilt here from the dense K/V and the plan, independently of the byte layout)."""

from __future__ import annotations

import pytest
import torch
from triton_guard import CUDA, require_triton  # noqa: E402

require_triton()
DEV = "cuda" if CUDA else "cpu"

from tiered_radix.kernels import decode  # noqa: E402
from tiered_radix.kernels.attention_ref import decode_attention_ref  # noqa: E402

from tiered_radix.formats import codecs  # noqa: E402
from tiered_radix.formats.layout import TierPlan, build_trizone  # noqa: E402


def dense_reference(q, k, v, plan, page, v_group, unit_tokens, max_units):
    """float64 attention and mass over the cache as the plan stores it (pages rebuilt here)."""
    bsz, hq, d = q.shape
    hkv = k[0].shape[1]
    grp = hq // hkv
    out = torch.zeros(bsz, hq, d, dtype=torch.float64)
    mass = torch.zeros(bsz, max_units, dtype=torch.float64)
    for r in range(bsz):
        t_r = k[r].shape[0]
        fresh = plan.fresh[r] if plan.fresh else 0
        for h in range(hkv):
            bits = plan.v_bits[r][h].clone().cpu()
            bits[t_r - fresh :] = 16
            kb = None if plan.k_bits is None else plan.k_bits[r][h].cpu()
            kk, vv, pos = [], [], []
            for b in (2, 4, 8, 16):
                tp = torch.nonzero(bits == b).flatten()
                if b == 16 and (kb is None or fresh):
                    full = tp if kb is None else tp[tp >= t_r - fresh]
                    kk.append(k[r][full, h].double().cpu())
                    vv.append(v[r][full, h].double().cpu())
                    pos.append(full)
                    tp = tp[tp < t_r - fresh] if kb is not None else tp[:0]
                for i in range(0, len(tp), page):
                    idx = tp[i : i + page]
                    pad = torch.cat([idx, idx[-1:].expand(page - len(idx))])
                    kp = k[r][pad, h].cpu().T  # [d, P]
                    kq = torch.zeros(d, page, dtype=torch.float64)
                    for c in range(d):
                        cb = b if kb is None else int(kb[c])
                        if cb == 16:
                            kq[c] = kp[c].double()
                        elif cb:
                            kq[c] = codecs.dequantize(codecs.quantize(kp[c], cb, page)).double()
                    vp = v[r][pad, h].cpu()
                    vq = (
                        vp.double()
                        if b == 16
                        else codecs.dequantize(codecs.quantize(vp, b, v_group))
                    )
                    kk.append(kq.T[: len(idx)])
                    vv.append(vq.double()[: len(idx)])
                    pos.append(idx)
            kk, vv, pos = torch.cat(kk), torch.cat(vv), torch.cat(pos)
            qg = q[r, h * grp : (h + 1) * grp].double().cpu()
            p = torch.softmax(qg @ kk.T / d**0.5, -1)
            out[r, h * grp : (h + 1) * grp] = p @ vv
            mass[r].index_add_(0, pos // unit_tokens, p.sum(0))
    return out, mass


def make_case(seed, lens, hkv, grp, d, dtype, bits, k_bits=None, fresh=None, unit_tokens=1):
    g = torch.Generator().manual_seed(seed)
    k = [torch.randn(t, hkv, d, generator=g).to(dtype).to(DEV) for t in lens]
    v = [torch.randn(t, hkv, d, generator=g).to(dtype).to(DEV) for t in lens]
    choice = torch.tensor(bits)
    vb = [choice[torch.randint(0, len(bits), (hkv, t), generator=g)] for t in lens]
    kb = None
    if k_bits is not None:
        kc = torch.tensor(k_bits)
        kb = [kc[torch.randint(0, len(k_bits), (hkv, d), generator=g)] for _ in lens]
    q = torch.randn(len(lens), hkv * grp, d, generator=g).to(dtype).to(DEV)
    return q, k, v, TierPlan(vb, kb, fresh)


CASES = [  # lens, hkv, grp, d, dtype, v bits, k bits, fresh, unit_tokens, page, splits
    ([40, 23], 2, 1, 64, torch.float16, [16], None, None, 1, 16, 2),
    ([48], 1, 4, 128, torch.bfloat16, [2, 0], None, [0], 16, 16, 2),
    ([37, 50], 2, 7, 64, torch.float16, [0, 2, 4, 8, 16], None, [3, 1], 4, 16, 3),
    ([30, 41], 1, 4, 64, torch.bfloat16, [0, 2, 4, 8, 16], [0, 2, 4, 8, 16], [2, 0], 1, 16, 2),
    ([33], 2, 7, 64, torch.float16, [2, 4, 8, 16], [2, 16], [1], 8, 32, 1),
]


# decode.plan(dequant=...): "magic" serves uniform pages and k_path="blocks" (general pages)
DEQUANT = {"convert": {}, "magic": dict(dequant="magic", k_path="blocks")}


def poison(p):
    """NaN in every scratch buffer: a kernel reading an entry nobody wrote shows up as NaN."""
    for buf in (p.part_acc, p.part_ml, p.lse, p.score):
        buf.fill_(float("nan"))


@pytest.mark.parametrize("dequant", DEQUANT)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_decode_matches_twin_and_dense(case, dequant):
    lens, hkv, grp, d, dt, bits, kbits, fresh, unit, page, splits = CASES[case]
    q, k, v, tp = make_case(case, lens, hkv, grp, d, dt, bits, kbits, fresh, unit)
    lay = build_trizone(k, v, tp, page_size=page, v_group=32, unit_tokens=unit)
    p = decode.plan(lay, num_q_heads=hkv * grp, side_output=True, num_splits=splits,
                    **DEQUANT[dequant])  # fmt: skip
    poison(p)
    out = torch.full_like(q, float("nan"))
    mass = torch.zeros(len(lens), lay.max_units, device=DEV)
    decode.run(q, lay, p, out=out, mass=mass)
    ro, rm = decode_attention_ref(q, lay)
    do, dm = dense_reference(q, k, v, tp, page, 32, unit, lay.max_units)
    tol = 2e-2 if dt == torch.bfloat16 else 4e-3
    assert out.isfinite().all()
    torch.testing.assert_close(out.float(), ro, atol=tol, rtol=tol)
    torch.testing.assert_close(ro.double().cpu(), do, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mass.double().cpu(), dm, atol=5e-3, rtol=1e-2)
    torch.testing.assert_close(rm.double().cpu(), dm, atol=1e-5, rtol=1e-5)
    sums = mass.sum(1).cpu()
    torch.testing.assert_close(sums, torch.full_like(sums, hkv * grp), atol=1e-3, rtol=1e-4)
    assert ro.abs().max() > 0.05  # random data, never all zeros


# decode.plan options that bench/decode_attention.py --targets times beside the default; each
# must compute what the default computes ("min": the group's next power of two)
VARIANTS = {
    "k_gather": dict(k_path="gather"),
    "k_gather_w8": dict(k_path="gather", num_warps=8),
    "k_gather_pipeliner_st8": dict(
        k_path="gather", prefetch="pipeliner", num_stages=8, num_warps=8, max_regs=128
    ),
    "k_blocks": dict(k_path="blocks"),
    "k_blocks_16": dict(k_path="blocks", k_block=16),
    "k_blocks_32_w2": dict(k_path="blocks", k_block=32, num_warps=2),
    "k_blocks_shift_r128": dict(k_path="blocks", unpack="shift", max_regs=128),
    # uniform pages through Triton's pipeliner (CASES 1-2), K blocks (CASES 3-4)
    "magic_pipeliner_st8_r128": dict(
        dequant="magic", k_path="blocks", prefetch="pipeliner", num_stages=8, max_regs=128
    ),
    "magic_shift": dict(dequant="magic", k_path="blocks", unpack="shift"),
    "pipeliner_st3": dict(prefetch="pipeliner", num_stages=3),
    "pipeliner_st8_r128": dict(prefetch="pipeliner", num_stages=8, max_regs=128),
    "pipeliner_st11": dict(prefetch="pipeliner", num_stages=11),
    "g_pad_min": dict(g_pad="min"),
    "max_regs": dict(max_regs=128),
}


def _variant(name: str, grp: int) -> dict:
    kw = dict(VARIANTS[name])
    if kw.get("g_pad") == "min":
        kw["g_pad"] = 1 << (grp - 1).bit_length()
    return kw


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_plan_variants_match_twin(case, variant):
    """Every plan variant against the torch twin on the general-path cases (per-channel K:
    CASES 3-4 for k_path="gather") and uniform pages (CASES 1-2 for the prefetch variants)."""
    lens, hkv, grp, d, dt, bits, kbits, fresh, unit, page, splits = CASES[case]
    q, k, v, tp = make_case(case, lens, hkv, grp, d, dt, bits, kbits, fresh, unit)
    lay = build_trizone(k, v, tp, page_size=page, v_group=32, unit_tokens=unit)
    kw = _variant(variant, grp)
    p = decode.plan(lay, num_q_heads=hkv * grp, side_output=True, num_splits=splits, **kw)
    assert all(getattr(p, f) == x for f, x in kw.items() if f != "max_regs") and (
        p.max_regs == kw.get("max_regs"))  # fmt: skip
    poison(p)
    out = torch.full_like(q, float("nan"))
    mass = torch.zeros(len(lens), lay.max_units, device=DEV)
    decode.run(q, lay, p, out=out, mass=mass)
    ro, rm = decode_attention_ref(q, lay)
    tol = 2e-2 if dt == torch.bfloat16 else 4e-3
    assert out.isfinite().all() and mass.isfinite().all()
    torch.testing.assert_close(out.float(), ro, atol=tol, rtol=tol)
    torch.testing.assert_close(mass, rm, atol=5e-3, rtol=1e-2)
    assert ro.abs().max() > 0.05


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d,grp,page", [(64, 7, 16), (128, 4, 32)], ids=["d64g7", "d128g4"])
def test_k_gather_rdkv_pages(d, grp, page, dt):
    """k_path="gather" on RDKV-shaped pages (every V width, K channels at 0/2/4/8/16 bits in
    run-time proportions, the 16-bit channels raw bf16 or fp16) against the twin and the
    section path; several pages a split, so the hoisted geometry serves many pages."""
    lens, hkv = [150, 97], 2
    q, k, v, tp = make_case(40 + d, lens, hkv, grp, d, dt, [0, 2, 4, 8, 16], [0, 2, 4, 8, 16],
                            [4, 0], 1)  # fmt: skip
    lay = build_trizone(k, v, tp, page_size=page, v_group=32, unit_tokens=1)
    assert not lay.k_uniform and set(lay.k_bits_present) == {2, 4, 8, 16}
    ro, _ = decode_attention_ref(q, lay)
    tol = 2e-2 if dt == torch.bfloat16 else 4e-3
    for prefetch, stages in (("pipeliner", 8), ("manual", 2)):
        pg = decode.plan(lay, num_q_heads=hkv * grp, num_splits=2, k_path="gather",
                         prefetch=prefetch, num_stages=stages)  # fmt: skip
        poison(pg)
        out = decode.run(q, lay, pg)
        torch.testing.assert_close(out.float(), ro, atol=tol, rtol=tol)
    ps = decode.plan(lay, num_q_heads=hkv * grp, num_splits=2)
    assert ps.k_path == "sections"
    torch.testing.assert_close(decode.run(q, lay, ps), out, atol=tol, rtol=tol)
    assert ro.abs().max() > 0.05


@pytest.mark.parametrize("dequant", ["convert", "magic"])
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d,grp,page", [(64, 7, 16), (128, 4, 32)], ids=["d64g7", "d128g4"])
def test_k_blocks_rdkv_pages(d, grp, page, dt, dequant):
    """k_path="blocks" (Zone A's uniform path) on RDKV-shaped pages: every V width, K channels
    at 0/2/4/8/16 bits with more 2-bit channels than one block holds (several blocks a width,
    the last one partial), blocks of 16 and 32 channels; 1 split (every list in one program)
    and 3 (splits cut across the V-width lists); output and side output against the twin;
    codes dequantised by conversion or from their bits (dequant)."""
    lens, hkv = [150, 97], 2
    q, k, v, tp = make_case(50 + d, lens, hkv, grp, d, dt, [0, 2, 4, 8, 16],
                            [0, 2, 2, 2, 4, 8, 16], [4, 0], 1)  # fmt: skip
    lay = build_trizone(k, v, tp, page_size=page, v_group=32, unit_tokens=1)
    n = lay.k_table[:, :4]
    assert not lay.k_uniform and int(n[:, 0].min()) > 16 and bool((n[:, 0] % 16 != 0).any())
    ro, rm = decode_attention_ref(q, lay)
    tol = 2e-2 if dt == torch.bfloat16 else 4e-3
    for kc, splits in ((16, 3), (32, 1)):
        p = decode.plan(lay, num_q_heads=hkv * grp, side_output=True, num_splits=splits,
                        k_path="blocks", k_block=kc, dequant=dequant)  # fmt: skip
        assert (p.k_path, p.k_block, p.page_prefetch) == ("blocks", kc, "none" if DEV == "cpu"
                                                          else "l1")  # fmt: skip
        poison(p)
        mass = torch.zeros(len(lens), lay.max_units, device=DEV)
        out = decode.run(q, lay, p, mass=mass)
        torch.testing.assert_close(out.float(), ro, atol=tol, rtol=tol)
        torch.testing.assert_close(mass, rm, atol=5e-3, rtol=1e-2)
    assert ro.abs().max() > 0.05


def windowed_case(seed, lens, hkv, grp, d, dtype, bits, win, fresh):
    """Tier per window of win tokens (QEvict-like): pages and row blocks of one unit."""
    g = torch.Generator().manual_seed(seed)
    k = [torch.randn(t, hkv, d, generator=g).to(dtype).to(DEV) for t in lens]
    v = [torch.randn(t, hkv, d, generator=g).to(dtype).to(DEV) for t in lens]
    choice = torch.tensor(bits)
    vb = [
        choice[torch.randint(0, len(bits), (hkv, -(-t // win)), generator=g)].repeat_interleave(
            win, 1
        )[:, :t]
        for t in lens
    ]
    q = torch.randn(len(lens), hkv * grp, d, generator=g).to(dtype).to(DEV)
    return q, k, v, TierPlan(vb, None, fresh)


WINDOWED = [  # lens, hkv, grp, d, dtype, bits, window = unit, page, splits, pages_per_iter
    ([100, 64], 2, 4, 64, torch.bfloat16, [0, 2, 16], 32, 32, 2, 2),
    ([170], 1, 7, 128, torch.float16, [2, 4, 8, 16, 0], 16, 16, 3, 4),
    ([70, 40], 2, 2, 64, torch.float16, [4, 8, 16], 32, 16, 1, 1),
    ([140], 2, 4, 64, torch.bfloat16, [2, 8, 16], 8, 32, 2, 2),  # 4 units a page: per token
]


@pytest.mark.parametrize("uniform", [True, False], ids=["uniform_path", "general_path"])
@pytest.mark.parametrize("case", range(len(WINDOWED)))
def test_windowed_pages_and_unit_side_output(case, uniform):
    lens, hkv, grp, d, dt, bits, win, page, splits, ppi = WINDOWED[case]
    q, k, v, tp = windowed_case(case, lens, hkv, grp, d, dt, bits, win, [5] * len(lens))
    lay = build_trizone(k, v, tp, page_size=page, v_group=32, unit_tokens=win)
    assert lay.k_uniform and lay.page_ids.numel() > 0
    single = lay.page_unit >= 0
    assert bool(single.any()) if win >= page else bool((~single).any())
    p = decode.plan(lay, num_q_heads=hkv * grp, side_output=True, num_splits=splits,
                    pages_per_iter=ppi, uniform_pages=uniform)  # fmt: skip
    assert p.uniform == uniform and p.pages_per_iter == ppi
    poison(p)
    out = torch.full_like(q, float("nan"))
    mass = torch.zeros(len(lens), lay.max_units, device=DEV)
    decode.run(q, lay, p, out=out, mass=mass)
    ro, rm = decode_attention_ref(q, lay)
    do, dm = dense_reference(q, k, v, tp, page, 32, win, lay.max_units)
    tol = 2e-2 if dt == torch.bfloat16 else 4e-3
    assert out.isfinite().all() and mass.isfinite().all()
    torch.testing.assert_close(out.float(), ro, atol=tol, rtol=tol)
    torch.testing.assert_close(ro.double().cpu(), do, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mass.double().cpu(), dm, atol=5e-3, rtol=1e-2)
    assert ro.abs().max() > 0.05 and (dm > 1e-3).sum() > 2
    if uniform:  # the same pages through Triton's pipeliner (the --targets variants)
        kw = dict(prefetch="pipeliner", num_stages=8, max_regs=128)
        pp = decode.plan(lay, num_q_heads=hkv * grp, side_output=True, num_splits=splits,
                         pages_per_iter=ppi, **kw)  # fmt: skip
        m2 = torch.zeros_like(mass)
        torch.testing.assert_close(decode.run(q, lay, pp, mass=m2), out, atol=tol, rtol=tol)
        torch.testing.assert_close(m2, mass, atol=5e-3, rtol=1e-2)


def with_unread_rows(lay, extra: list[int], unit: int = 0):
    """``lay`` with ``extra[rh]`` more zone-B entries at the end of each list (r, h), pointing at
    NaN rows appended to the pools, and ``full_end`` at each list's real end: what the kernel
    computes must not change (the CUDA-graph decode lists a window's future rows ahead)."""
    import dataclasses

    ptr = lay.full_indptr.long().tolist()
    nan_row = lay.k_pool.shape[0]
    slots, units, new_ptr, end = [], [], [0], []
    for rh, more in enumerate(extra):
        a, b = ptr[rh], ptr[rh + 1]
        slots += [lay.full_slots[a:b], torch.full((more,), nan_row, dtype=torch.int32, device=DEV)]
        units += [lay.full_units[a:b], torch.full((more,), unit, dtype=torch.int32, device=DEV)]
        end.append(new_ptr[-1] + b - a)
        new_ptr.append(end[-1] + more)
    pad = torch.full((1, *lay.k_pool.shape[1:]), float("nan"), dtype=lay.dtype, device=DEV)
    i32 = dict(dtype=torch.int32, device=DEV)
    return dataclasses.replace(
        lay, k_pool=torch.cat([lay.k_pool, pad]), v_pool=torch.cat([lay.v_pool, pad]),
        full_slots=torch.cat(slots), full_units=torch.cat(units),
        full_indptr=torch.tensor(new_ptr, **i32), full_end=torch.tensor(end, **i32),
    )  # fmt: skip


@pytest.mark.parametrize("case", [0, 2])
def test_rows_past_full_end_are_listed_but_never_read(case):
    """Zone-B entries between a list's ``full_end`` and the next list (NaN rows here) change
    neither the output nor the side output, in the kernel and in its reference twin."""
    lens, hkv, grp, d, dt, bits, win, page, splits, ppi = WINDOWED[case]
    q, k, v, tp = windowed_case(case, lens, hkv, grp, d, dt, bits, win, [5] * len(lens))
    lay = build_trizone(k, v, tp, page_size=page, v_group=32, unit_tokens=win)
    more = with_unread_rows(lay, [(3 * i) % 7 + 1 for i in range(len(lens) * hkv)])
    assert more.full_slots.numel() > lay.full_slots.numel()
    outs = []
    for layout in (lay, more):
        p = decode.plan(layout, num_q_heads=hkv * grp, side_output=True, num_splits=splits)
        poison(p)
        out = torch.full_like(q, float("nan"))
        mass = torch.zeros(len(lens), lay.max_units, device=DEV)
        decode.run(q, layout, p, out=out, mass=mass)
        outs.append((out, mass, *decode_attention_ref(q, layout)))
    (o, m, ro, rm), (o2, m2, ro2, rm2) = outs
    assert o2.isfinite().all() and m2.isfinite().all()
    torch.testing.assert_close(o2, o, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(m2, m, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ro2, ro)
    torch.testing.assert_close(rm2, rm)


@pytest.mark.parametrize("dequant", ["convert", "magic"])
@pytest.mark.parametrize("unpack", ["interleave", "shift"])
@pytest.mark.parametrize("d,grp,page", [(64, 7, 16), (128, 4, 32)], ids=["d64g7", "d128g4"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_uniform_path_each_width(bits, d, grp, page, unpack, dequant):
    """The uniform-page specialisation (compile-time geometry of one bit width, 32 // page pages
    an iteration, as plan() picks; codes dequantised by conversion or from their bits) against
    float64 attention and the general page path."""
    lens, hkv = [96, 61], 1
    q, k, v, tp = windowed_case(10 + bits, lens, hkv, grp, d, torch.float16, [bits, 16, 0], 16,
                                [3, 0])  # fmt: skip
    lay = build_trizone(k, v, tp, page_size=page, v_group=32, unit_tokens=16)
    assert lay.k_uniform and lay.v_bits_present == (bits,)
    if DEV == "cuda" and unpack == "interleave" and page < decode.IL_MIN_PAGE_CUDA:
        with pytest.raises(decode.DecodeInputError, match="wrong results on CUDA"):
            decode.plan(lay, num_q_heads=hkv * grp, unpack=unpack)
        return  # (miscompiled by Triton 3.6 on the H200: bench/decode_notes.md, GPU run 7)
    p = decode.plan(lay, num_q_heads=hkv * grp, side_output=True, num_splits=2,
                    uniform_pages=True, unpack=unpack, dequant=dequant)  # fmt: skip
    assert p.uniform and p.pages_per_iter == 32 // page and p.dequant == dequant
    poison(p)
    out = torch.full_like(q, float("nan"))
    mass = torch.zeros(len(lens), lay.max_units, device=DEV)
    decode.run(q, lay, p, out=out, mass=mass)
    do, dm = dense_reference(q, k, v, tp, page, 32, 16, lay.max_units)
    assert out.isfinite().all() and mass.isfinite().all()
    torch.testing.assert_close(out.double().cpu(), do, atol=4e-3, rtol=4e-3)
    torch.testing.assert_close(mass.double().cpu(), dm, atol=5e-3, rtol=1e-2)
    assert do.abs().max() > 0.05 and (dm > 1e-3).sum() > 2
    pg = decode.plan(lay, num_q_heads=hkv * grp, num_splits=2, uniform_pages=False,
                     unpack=unpack)  # fmt: skip
    assert not pg.uniform
    torch.testing.assert_close(decode.run(q, lay, pg), out, atol=2e-3, rtol=2e-3)
    kg = decode.plan(lay, num_q_heads=hkv * grp, num_splits=2, uniform_pages=False,
                     unpack=unpack, k_path="gather")  # fmt: skip
    torch.testing.assert_close(decode.run(q, lay, kg), out, atol=2e-3, rtol=2e-3)


def test_plan_errors():
    q, k, v, tp = make_case(5, [20], 1, 2, 64, torch.float16, [2, 16], None, None, 1)
    lay = build_trizone(k, v, tp, page_size=16)
    with pytest.raises(decode.DecodeInputError, match="power of two"):
        decode.plan(lay, num_q_heads=2, pages_per_iter=3)
    with pytest.raises(decode.DecodeInputError, match="bit widths"):
        decode.plan(lay, num_q_heads=2, v_bits=(2, 3))
    with pytest.raises(decode.DecodeInputError, match="k_path"):
        decode.plan(lay, num_q_heads=2, k_path="bytes")
    with pytest.raises(decode.DecodeInputError, match="prefetch"):
        decode.plan(lay, num_q_heads=2, prefetch="tma")
    with pytest.raises(decode.DecodeInputError, match="k_block"):
        decode.plan(lay, num_q_heads=2, k_path="blocks", k_block=8)
    with pytest.raises(decode.DecodeInputError, match="page_prefetch"):
        decode.plan(lay, num_q_heads=2, k_path="blocks", page_prefetch="tma")
    with pytest.raises(decode.DecodeInputError, match="use 'convert' or 'magic'"):
        decode.plan(lay, num_q_heads=2, dequant="fast")
    with pytest.raises(decode.DecodeInputError, match="uniform pages and k_path='blocks'"):
        decode.plan(lay, num_q_heads=2, uniform_pages=False, dequant="magic")
    assert decode.plan(lay, num_q_heads=2, uniform_pages=False, dequant="magic",
                       k_path="blocks").dequant == "magic"  # fmt: skip
    with pytest.raises(decode.DecodeInputError, match="g_pad"):
        decode.plan(lay, num_q_heads=2, g_pad=1)
    with pytest.raises(decode.DecodeInputError, match="g_pad"):
        decode.plan(lay, num_q_heads=2, g_pad=6)


def test_default_unpack_on_cuda_shifts_where_interleave_is_miscompiled():
    """tl.interleave unpacking is miscompiled on the H200 at 16-token pages (GPU runs 6 and 7)
    and on k_path="blocks" with 16-channel blocks (GPU run 17): there the default is the shift
    unpacking and an explicit interleave is refused; rows-only layouts, larger pages and blocks,
    the other K paths and the CPU keep interleave."""

    def unpack(value, device, page, pages=3, k_path="sections", k_block=32):
        return decode._unpack(value, device, page, pages > 0, k_path, k_block)

    assert unpack(None, "cuda", 16) == "shift"
    assert unpack(None, "cuda", 32) == "interleave"
    assert unpack(None, "cpu", 16) == "interleave"
    assert unpack("shift", "cuda", 64) == "shift"
    assert unpack("interleave", "cuda", 16, pages=0) == "interleave"
    assert unpack(None, "cuda", 32, k_path="blocks", k_block=16) == "shift"
    assert unpack(None, "cuda", 32, k_path="blocks", k_block=32) == "interleave"
    assert unpack(None, "cuda", 32, k_path="sections", k_block=16) == "interleave"
    assert unpack(None, "cpu", 32, k_path="blocks", k_block=16) == "interleave"
    with pytest.raises(decode.DecodeInputError, match="16-token pages gives wrong results"):
        unpack("interleave", "cuda", 16)
    with pytest.raises(decode.DecodeInputError, match="k_block=16 gives wrong results"):
        unpack("interleave", "cuda", 32, k_path="blocks", k_block=16)
    with pytest.raises(decode.DecodeInputError, match="use 'interleave' or 'shift'"):
        unpack("bytes", "cpu", 32)


def test_blocks_default_to_32_channels():
    """k_path="blocks" plans blocks of 32 channels unless told (the fastest blocks row and
    right on the H200 with interleave unpacking: GPU run 17)."""
    q, k, v, tp = make_case(5, [40], 1, 2, 64, torch.float16, [2, 16], None, None, 1)
    lay = build_trizone(k, v, tp, page_size=32)
    p = decode.plan(lay, num_q_heads=2, k_path="blocks")
    assert (p.k_block, p.unpack) == (32, "interleave")
    # the query in permuted channel order, written by run() for the blocks (general pages only)
    g = decode.plan(lay, num_q_heads=2, k_path="blocks", uniform_pages=False)
    assert (g.q_perm.shape, g.q_perm.dtype) == ((lay.batch * lay.num_kv_heads, 16, 64), q.dtype)
    assert decode.plan(lay, num_q_heads=2, uniform_pages=False).q_perm is None
    assert decode.plan(lay, num_q_heads=2, k_path="blocks", k_block=16).k_block == 16


def test_side_output_off_and_accumulates():
    q, k, v, tp = make_case(7, [40], 1, 4, 64, torch.float16, [2, 16], None, [2], 1)
    lay = build_trizone(k, v, tp, page_size=16)
    off = decode.run(q, lay, decode.plan(lay, num_q_heads=4, num_splits=2))
    p = decode.plan(lay, num_q_heads=4, side_output=True, num_splits=2)
    mass = torch.ones(1, lay.max_units, device=DEV)
    on = decode.run(q, lay, p, mass=mass)
    torch.testing.assert_close(on, off)
    _, rm = decode_attention_ref(q, lay)
    torch.testing.assert_close(mass.cpu() - 1, rm.cpu(), atol=2e-3, rtol=1e-2)


def test_input_errors():
    import dataclasses

    q, k, v, tp = make_case(3, [20], 2, 1, 64, torch.float16, [16], None, None, 1)
    lay = build_trizone(k, v, tp, page_size=16)
    p = decode.plan(lay, num_q_heads=2)
    short = dataclasses.replace(lay, full_end=lay.full_indptr[:1])
    with pytest.raises(decode.DecodeInputError, match="full_end"):
        decode.run(q, short, p)
    with pytest.raises(decode.DecodeInputError, match="q must be"):
        decode.run(q[:, :1], lay, p)
    with pytest.raises(decode.DecodeInputError, match="side_output=False"):
        decode.run(q, lay, p, mass=torch.zeros(1, 20, device=DEV))
    with pytest.raises(decode.DecodeInputError, match="multiple"):
        decode.plan(lay, num_q_heads=3)
    with pytest.raises(ValueError, match="v_bits"):
        build_trizone(k, v, TierPlan([torch.full((1, 20), 3)]))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("grp,d", [(4, 128), (7, 64)])
def test_cuda_full_size_and_graph(grp, d):
    hkv, lens = 2, [4096, 1500, 3000]
    q, k, v, tp = make_case(11, lens, hkv, grp, d, torch.bfloat16, [0, 2, 4, 16], None, [5] * 3)
    lay = build_trizone(k, v, tp, page_size=32, unit_tokens=32)
    p = decode.plan(lay, num_q_heads=hkv * grp, side_output=True)
    out = torch.full_like(q, float("nan"))
    mass = torch.zeros(len(lens), lay.max_units, device=DEV)
    decode.run(q, lay, p, out=out, mass=mass)
    ro, rm = decode_attention_ref(q, lay)
    torch.testing.assert_close(out.float(), ro, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(mass, rm, atol=2e-3, rtol=1e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode.run(q, lay, p, out=out, mass=mass)
    mass.zero_()
    out.fill_(float("nan"))
    graph.replay()
    torch.testing.assert_close(out.float(), ro, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(mass, rm, atol=2e-3, rtol=1e-2)


def test_steps_of_any_batch_launch_one_compiled_variant():
    """An eager decode step of a new batch (request count, lengths, split count) compiles no
    new variant of the three kernels: the per-step lists and counts are out of the compiled key
    (tests/kernels/jit_variants.py; the extend kernels' test says why it matters)."""
    from jit_variants import JitVariants

    g = torch.Generator().manual_seed(5)
    with JitVariants() as v:
        for t in range(6):
            lens = torch.randint(20, 90, (int(torch.randint(1, 5, (), generator=g)),),
                                 generator=g).tolist()  # fmt: skip
            q, k, vv, tp = make_case(t, lens, 2, 7, 64, torch.bfloat16, [2, 16])
            lay = build_trizone(k, vv, tp, page_size=32, v_group=32)
            p = decode.plan(lay, num_q_heads=14, side_output=True, num_splits=1 + t % 2)
            decode.run(q, lay, p, mass=torch.zeros(len(lens), lay.max_units, device=DEV))
    for name in ("_decode_split_kernel", "_decode_merge_kernel", "_decode_mass_kernel"):
        assert len(v.specs[name]) == 6
        assert len(v.keys[name]) == 1, v.varying(name)


@pytest.mark.parametrize("grp, d", [(7, 64), (4, 128)])
def test_token_rows_without_pages(grp, d):
    """Token units that hold rows only (the SGLang pool of h2o, snapkv, streaming: page size
    1, every kept token a zone B row, each its own unit): the kernel matches its twin and
    dense attention, mass per token included."""
    lens = [70, 33]
    q, k, v, tp = make_case(31 + grp, lens, 2, grp, d, torch.bfloat16, [16, 0], unit_tokens=1)
    import dataclasses

    # no pages (V at 16 or 0 bits); the pool's page size, its window, is 1
    lay = build_trizone(k, v, tp, page_size=16, v_group=32, unit_tokens=1)
    lay = dataclasses.replace(lay, page_size=1)
    assert lay.page_ids.numel() == 0 and lay.full_slots.numel() > 0
    p = decode.plan(lay, num_q_heads=2 * grp, side_output=True, num_splits=3)
    poison(p)
    out = torch.full_like(q, float("nan"))
    mass = torch.zeros(len(lens), lay.max_units, device=DEV)
    decode.run(q, lay, p, out=out, mass=mass)
    ro, rm = decode_attention_ref(q, lay)
    do, dm = dense_reference(q, k, v, tp, 1, 32, 1, lay.max_units)
    assert out.isfinite().all()
    torch.testing.assert_close(out.float(), ro, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ro.double().cpu(), do, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mass.double().cpu(), dm, atol=5e-3, rtol=1e-2)
    assert (dm > 1e-3).sum() > 10  # the mass reached many single-token units
