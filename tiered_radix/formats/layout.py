"""TriZone: the storage format of one layer's mixed-precision KV cache, and a torch builder.

Three zones per (request r, KV head h), read by one decode kernel in one pass::

    zone A  quantized pages (P tokens of one KV head, one V bit width each)   arena: uint8 [bytes]
            page = one contiguous, 16-byte aligned span:
            +-------------+-------------+-------------+--------------+---------+--------+
            | K2 codes    | K4 codes    | K8 codes    | K16 raw      | K scale | K lo   |  K part
            | [n2, P/4]   | [n4, P/2]   | [n8, P]     | [n16, P] dt  | [nq] f16| [nq]f16|  (channels
            +-------------+-------------+-------------+--------------+---------+--------+  permuted)
            | V codes [P, d*vb/8]  | V scale [P, d/g] f16 | V lo [P, d/g] f16 |  V part, vb in 2/4/8
            | V raw [P, d] dt                                               |  V part, vb = 16
            K is quantized per channel (group = the page's P tokens), V per token (group g along d),
            with the engine codec, bit-exact.  Each section is padded to 16 bytes.
    zone B  full-precision rows of one head        pool k_pool/v_pool [slots, H_kv, d] dt
            listed per (r, h): full_indptr [B*H_kv+1] -> full_slots, full_units; optional
            full_end [B*H_kv]: list (r, h) is read up to full_end, not full_indptr[rh+1]
    zone C  fresh full-precision rows (tokens generated since the last routing), all heads
            listed per r: fresh_indptr [B+1] -> fresh_slots, fresh_units

K channels of a page are permuted per (r, h) so channels of equal bit width are contiguous
(``perm[r*H_kv+h, i]`` = original channel at permuted position i; channels of bit width 0, dropped,
come last and are never read).  Pages are listed per (r, h) and V bit width:
``page_indptr [B*H_kv*4 + 1]`` over ``page_ids``, list index
``(r*H_kv + h)*4 + {2:0, 4:1, 8:2, 16:3}[v_bits]``.
``k_table [B*H_kv*4, 12]`` int32 gives, per list, the K channel counts (n2, n4, n8, n16) and the
byte offsets of the K sections inside a page (o2, o4, o8, o16, o_scale, o_lo) and the K part's
size (where V starts).  Evicted units are absent from every list.  Units (``*_units``, int32) index
the per-request side-output buffer ``mass [B, max_units]``: token position // unit_tokens;
``page_unit [n_pages]`` is the unit shared by all valid tokens of a page, -1 when they differ.
``k_uniform``: every page's K channels have the page's V bit width (no ``k_bits`` in the plan),
so a page's geometry is a compile-time function of (bits, P, d, v_group).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tiered_radix.formats import codecs

V_BITS = (2, 4, 8, 16)
K_BITS = (2, 4, 8, 16)  # 0 = dropped channel


def pad16(n: int) -> int:
    return (n + 15) // 16 * 16


def k_sections(n: Sequence[int], page_size: int) -> list[int]:
    """K section offsets of a page: [o2, o4, o8, o16, o_scale, o_lo, k_bytes] (bytes)."""
    n2, n4, n8, n16 = n
    offs, o = [], 0
    for cnt, b in ((n2, 2), (n4, 4), (n8, 8), (n16, 16)):
        offs.append(o)
        o += pad16(cnt * page_size * b // 8)
    nq = n2 + n4 + n8
    offs += [o, o + pad16(2 * nq), o + 2 * pad16(2 * nq)]
    return offs


def v_sections(v_bits: int, page_size: int, d: int, v_group: int) -> list[int]:
    """V section offsets relative to the V part: [o_code, o_scale, o_lo, v_bytes] (bytes)."""
    if v_bits == 16:
        return [0, 0, 0, pad16(page_size * d * 2)]
    c = pad16(page_size * d * v_bits // 8)
    m = pad16(2 * page_size * d // v_group)
    return [0, c, c + m, c + 2 * m]


@dataclass(frozen=True)
class TierPlan:
    """Per-unit precision of every request, input of :func:`build_trizone`.

    v_bits: per request, int tensor [H_kv, T_r] in {0, 2, 4, 8, 16}: the token's V bit width
        (0 evicted, 16 full precision).  Window policies repeat one value over a window.
    k_bits: None (a token's K has its V bit width: uniform pages; 16-bit tokens go to zone B) or,
        per request, int tensor [H_kv, d] in {0, 2, 4, 8, 16}: K bit width per channel for every
        kept token (RDKV); then 16-bit V tokens are pages too.
    fresh: per request, how many trailing tokens are fresh (zone C, full precision, all heads).
    """

    v_bits: Sequence[torch.Tensor]
    k_bits: Sequence[torch.Tensor] | None = None
    fresh: Sequence[int] | None = None


@dataclass(frozen=True)
class TriZoneLayout:
    """One layer's TriZone cache (see the module docstring for every tensor)."""

    k_pool: torch.Tensor  # [slots, H_kv, d] dt
    v_pool: torch.Tensor  # [slots, H_kv, d] dt
    full_indptr: torch.Tensor  # [B*H_kv + 1] int32
    full_slots: torch.Tensor  # [nnz_b] int32
    full_units: torch.Tensor  # [nnz_b] int32
    fresh_indptr: torch.Tensor  # [B + 1] int32
    fresh_slots: torch.Tensor  # [nnz_c] int32
    fresh_units: torch.Tensor  # [nnz_c] int32
    arena: torch.Tensor  # [bytes] uint8, 16-byte aligned pages
    page_off: torch.Tensor  # [n_pages] int64 byte offset
    page_ntok: torch.Tensor  # [n_pages] int32 valid tokens (<= P)
    page_units: torch.Tensor  # [n_pages, P] int32 (-1 for padding tokens)
    page_unit: torch.Tensor  # [n_pages] int32: the page's one unit, -1 if its tokens span several
    page_indptr: torch.Tensor  # [B*H_kv*4 + 1] int32
    page_ids: torch.Tensor  # [n_listed] int32
    k_table: torch.Tensor  # [B*H_kv*4, 12] int32
    perm: torch.Tensor  # [B*H_kv, d] int32
    batch: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    v_group: int
    max_units: int
    v_bits_present: tuple[int, ...]
    k_bits_present: tuple[int, ...]
    k_uniform: bool
    bytes_kv: int  # bytes of K/V data + indices the kernel reads, without the side output
    bytes_side: int  # extra bytes read for the side output (units)
    # [B*H_kv] int32: where list (r, h) of zone B stops being read (default: full_indptr[1:]);
    # entries from there to the next list are listed but unread (a CUDA-graph decode step lists
    # its last window's future rows ahead and moves the ends one row a step)
    full_end: torch.Tensor | None = None

    @property
    def full_ends(self) -> torch.Tensor:
        """[B*H_kv] int32: where each zone-B list stops being read (``full_end``, else the next
        list's start)."""
        return self.full_indptr[1:] if self.full_end is None else self.full_end

    @property
    def dtype(self) -> torch.dtype:
        return self.k_pool.dtype


def _perm_and_counts(kb: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    order = {2: 0, 4: 1, 8: 2, 16: 3, 0: 4}
    key = torch.tensor([order[int(b)] for b in kb.tolist()])
    perm = torch.sort(key, stable=True).indices
    return perm, [int((kb == b).sum()) for b in K_BITS]


def pack_pages(
    x_k: torch.Tensor,
    x_v: torch.Tensor,
    n: Sequence[int],
    vb: int,
    v_group: int,
    raw_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Byte image uint8 ``[pages, page_bytes]`` of permuted K ``x_k [pages, P, d]`` (channel
    counts ``n`` per width of :data:`K_BITS`, in that order) and V ``x_v [pages, P, d]`` at
    ``vb`` bits. Quantized sections take any float input; raw (16-bit) sections are stored in
    ``raw_dtype`` (default: the input's dtype)."""
    pages, p, d = x_k.shape
    raw_dtype = raw_dtype or x_k.dtype
    ks = k_sections(n, p)
    vs = v_sections(vb, p, d, v_group)
    out = torch.zeros(pages, ks[6] + vs[3], dtype=torch.uint8, device=x_k.device)
    kt = x_k.transpose(1, 2)  # [pages, d, P]: K quantized per channel along tokens
    c0, scales, los = 0, [], []
    for i, (cnt, b) in enumerate(zip(n, K_BITS, strict=True)):
        seg = kt[:, c0 : c0 + cnt]
        c0 += cnt
        if cnt == 0:
            continue
        if b == 16:
            raw = seg.to(raw_dtype).contiguous().view(torch.uint8).reshape(pages, -1)
        else:
            q = codecs.quantize(seg, b, p)
            raw = q.codes.reshape(pages, -1)
            scales.append(q.scale.reshape(pages, -1))
            los.append(q.lo.reshape(pages, -1))
        out[:, ks[i] : ks[i] + raw.shape[1]] = raw
    if scales:
        for o, parts in ((ks[4], scales), (ks[5], los)):
            raw = torch.cat(parts, 1).contiguous().view(torch.uint8)
            out[:, o : o + raw.shape[1]] = raw
    vo = ks[6]
    if vb == 16:
        raw = x_v.to(raw_dtype).contiguous().view(torch.uint8).reshape(pages, -1)
        out[:, vo : vo + raw.shape[1]] = raw
    else:
        q = codecs.quantize(x_v, vb, v_group)
        for o, t in ((vs[0], q.codes), (vs[1], q.scale), (vs[2], q.lo)):
            raw = t.contiguous().view(torch.uint8).reshape(pages, -1)
            out[:, vo + o : vo + o + raw.shape[1]] = raw
    return out


def build_trizone(
    k: Sequence[torch.Tensor],
    v: Sequence[torch.Tensor],
    plan: TierPlan,
    *,
    page_size: int = 32,
    v_group: int = 32,
    unit_tokens: int = 1,
) -> TriZoneLayout:
    """Pack dense per-request K/V ``[T_r, H_kv, d]`` (bf16/fp16) under ``plan`` into TriZone.

    Raises:
        ValueError: on shapes, dtypes or bit widths that the format cannot hold.
    """
    if len(k) != len(v) or len(k) != len(plan.v_bits) or not k:
        raise ValueError("k, v and plan.v_bits need one entry per request (at least one)")
    dt, dev = k[0].dtype, k[0].device
    _, hkv, d = k[0].shape
    if dt not in (torch.float16, torch.bfloat16):
        raise ValueError(f"K/V must be float16 or bfloat16, got {dt}")
    if page_size not in (16, 32, 64) or d % v_group or v_group % 8:
        raise ValueError("page_size must be 16/32/64 and v_group a multiple of 8 dividing d")
    bsz = len(k)
    fresh = list(plan.fresh) if plan.fresh is not None else [0] * bsz
    k_rows, v_rows, slot_base = [torch.zeros(1, hkv, d, dtype=dt, device=dev)], [], 1
    v_rows.append(k_rows[0].clone())
    full_ind, full_sl, full_un = [0], [], []
    fr_ind, fr_sl, fr_un = [0], [], []
    pages, page_off, page_ntok, page_units = [], [], [], []
    page_ind, page_ids, k_table, perms = [0], [], [], []
    off, bytes_kv, bytes_side = 0, 0, 0
    vbp, kbp = set(), set()
    max_units = 0
    for r in range(bsz):
        kr, vr, vbits = k[r], v[r], plan.v_bits[r].to("cpu")
        t_r = kr.shape[0]
        if kr.shape != vr.shape or kr.shape[1:] != (hkv, d) or vbits.shape != (hkv, t_r):
            raise ValueError(f"request {r}: K/V [T, {hkv}, {d}] and v_bits [{hkv}, T] expected")
        bad = set(vbits.unique().tolist()) - {0, 2, 4, 8, 16}
        if bad:
            raise ValueError(f"request {r}: v_bits values {sorted(bad)} not in 0/2/4/8/16")
        max_units = max(max_units, -(-t_r // unit_tokens))
        pos = torch.arange(t_r)
        is_fresh = pos >= t_r - fresh[r]
        # every token full in some head, or fresh, gets a pool slot (all heads, like SGLang)
        in_pool = is_fresh | (vbits == 16).any(0) if plan.k_bits is None else is_fresh
        slot_of = torch.full((t_r,), -1, dtype=torch.long)
        slot_of[in_pool] = torch.arange(int(in_pool.sum())) + slot_base
        slot_base += int(in_pool.sum())
        k_rows.append(kr[in_pool.to(dev)])
        v_rows.append(vr[in_pool.to(dev)])
        fp = pos[is_fresh]
        fr_sl.append(slot_of[fp])
        fr_un.append(fp // unit_tokens)
        fr_ind.append(fr_ind[-1] + len(fp))
        bytes_kv += len(fp) * hkv * (4 * d + 4)
        for h in range(hkv):
            vb_h = vbits[h].clone()
            vb_h[is_fresh] = 0
            if plan.k_bits is None:
                fpos = pos[vb_h == 16]
                full_sl.append(slot_of[fpos])
                full_un.append(fpos // unit_tokens)
                bytes_kv += len(fpos) * (4 * d + 4)
                vb_h[vb_h == 16] = 0
                perm = torch.arange(d)
            else:
                kb = plan.k_bits[r][h].to("cpu")
                if set(kb.tolist()) - {0, 2, 4, 8, 16}:
                    raise ValueError(f"request {r} head {h}: k_bits must be in 0/2/4/8/16")
                perm, n_fixed = _perm_and_counts(kb)
                fpos = pos[:0]
            full_ind.append(full_ind[-1] + len(fpos))
            perms.append(perm)
            for vb in V_BITS:
                n = [d if b == vb else 0 for b in K_BITS] if plan.k_bits is None else n_fixed
                ks = k_sections(n, page_size)
                k_table.append(n + ks + [0])
                tp = pos[vb_h == vb]
                npg = -(-len(tp) // page_size)
                if npg:
                    vbp.add(vb)
                    kbp.update(b for b, c in zip(K_BITS, n, strict=True) if c)
                    idx = torch.cat([tp, tp[-1:].expand(npg * page_size - len(tp))])
                    xk = kr[idx.to(dev), h][:, perm.to(dev)].reshape(npg, page_size, d)
                    xv = vr[idx.to(dev), h].reshape(npg, page_size, d)
                    img = pack_pages(xk, xv, n, vb, v_group)
                    pages.append(img.reshape(-1))
                    ids = torch.arange(npg) + len(page_off)
                    page_off += [off + i * img.shape[1] for i in range(npg)]
                    off += img.numel()
                    ntok = (len(tp) - torch.arange(npg) * page_size).clamp(max=page_size)
                    page_ntok.append(ntok)
                    un = torch.full((npg * page_size,), -1, dtype=torch.long)
                    un[: len(tp)] = tp // unit_tokens
                    page_units.append(un.reshape(npg, page_size))
                    page_ids.append(ids)
                    bytes_kv += _page_read_bytes(n, vb, page_size, d, v_group, len(tp), npg)
                    bytes_side += 4 * len(tp)
                page_ind.append(page_ind[-1] + npg)
    bytes_side += 4 * (sum(len(x) for x in full_un) + sum(len(x) for x in fr_un) * hkv)

    def i32(parts, empty_shape=(0,)):
        if not parts:
            return torch.zeros(empty_shape, dtype=torch.int32, device=dev)
        return torch.cat([torch.as_tensor(p).reshape(-1, *empty_shape[1:]) for p in parts]).to(
            device=dev, dtype=torch.int32
        )

    arena = torch.cat(pages) if pages else torch.zeros(16, dtype=torch.uint8, device=dev)
    pu = i32(page_units, (0, page_size))
    valid = pu >= 0
    umin = torch.where(valid, pu, torch.iinfo(torch.int32).max).amin(1) if len(pu) else pu[:, 0]
    umax = torch.where(valid, pu, -1).amax(1) if len(pu) else pu[:, 0]
    return TriZoneLayout(
        k_pool=torch.cat(k_rows).contiguous(),
        v_pool=torch.cat(v_rows).contiguous(),
        full_indptr=i32([full_ind]),
        full_slots=i32(full_sl),
        full_units=i32(full_un),
        fresh_indptr=i32([fr_ind]),
        fresh_slots=i32(fr_sl),
        fresh_units=i32(fr_un),
        arena=arena,
        page_off=torch.tensor(page_off, dtype=torch.int64, device=dev),
        page_ntok=i32(page_ntok),
        page_units=pu,
        page_unit=torch.where(umin == umax, umin, -1).to(torch.int32),
        page_indptr=i32([page_ind]),
        page_ids=i32(page_ids),
        k_table=i32([k_table], (0, 12)),
        perm=i32(perms, (0, d)),
        batch=bsz,
        num_kv_heads=hkv,
        head_dim=d,
        page_size=page_size,
        v_group=v_group,
        max_units=max_units,
        v_bits_present=tuple(sorted(vbp)),
        k_bits_present=tuple(sorted(kbp)),
        k_uniform=plan.k_bits is None,
        bytes_kv=bytes_kv,
        bytes_side=bytes_side,
    )


def _page_read_bytes(n, vb, p, d, g, ntok, npg) -> int:
    """Bytes the kernel loads for npg pages holding ntok valid tokens (16-byte page indices too)."""
    k = sum(c * p * b // 8 for c, b in zip(n, K_BITS, strict=True)) + 4 * sum(n[:3])
    v = ntok * (d * vb // 8 + (0 if vb == 16 else 4 * d // g))
    return npg * (k + 16) + v


# -- uniform pages one at a time: the SGLang pool's ledger blocks ---------------------------------
def uniform_page_nbytes(bits: int, page_size: int, d: int, v_group: int) -> int:
    """Bytes of one page whose K channels and V tokens all have ``bits`` (2, 4 or 8)."""
    n = [d if b == bits else 0 for b in K_BITS]
    return k_sections(n, page_size)[6] + v_sections(bits, page_size, d, v_group)[3]


def pack_uniform_pages(k: torch.Tensor, v: torch.Tensor, bits: int, v_group: int) -> torch.Tensor:
    """uint8 ``[n, uniform_page_nbytes]``: K/V ``[n, P, d]`` as TriZone pages at ``bits``
    (K per channel over the page's P tokens, V per token in groups of ``v_group``)."""
    n = [k.shape[2] if b == bits else 0 for b in K_BITS]
    return pack_pages(k, v, n, bits, v_group)


def unpack_uniform_pages(
    img: torch.Tensor, bits: int, page_size: int, d: int, v_group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_uniform_pages`: float32 ``k, v [n, P, d]`` (``dequantize``)."""
    m, p = img.shape[0], page_size
    ks = k_sections([d if b == bits else 0 for b in K_BITS], p)
    vs = v_sections(bits, p, d, v_group)
    o = ks[K_BITS.index(bits)]

    def f16(at: int, count: int) -> torch.Tensor:
        return img[:, at : at + 2 * count].contiguous().view(torch.float16)

    kq = codecs.QuantizedTensor(
        img[:, o : o + d * p * bits // 8].reshape(m, d, p * bits // 8),
        f16(ks[4], d).reshape(m, d, 1), f16(ks[5], d).reshape(m, d, 1), bits, p, p,
    )  # fmt: skip
    vo, ng = ks[6], d // v_group
    vq = codecs.QuantizedTensor(
        img[:, vo : vo + p * d * bits // 8].reshape(m, p, d * bits // 8),
        f16(vo + vs[1], p * ng).reshape(m, p, ng), f16(vo + vs[2], p * ng).reshape(m, p, ng),
        bits, v_group, d,
    )  # fmt: skip
    return codecs.dequantize(kq).transpose(1, 2), codecs.dequantize(vq)


def unpack_pages(
    img: torch.Tensor,
    n: Sequence[int],
    vb: int,
    page_size: int,
    d: int,
    v_group: int,
    raw_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_pages`: float32 ``k, v [m, P, d]`` of pages ``img [m, bytes]``,
    K in the pages' permuted channel order (channels past ``sum(n)``, dropped, read 0)."""
    m, p = img.shape[0], page_size
    ks, vs = k_sections(n, p), v_sections(vb, p, d, v_group)
    k = torch.zeros(m, d, p, dtype=torch.float32, device=img.device)  # [m, channel, token]

    def f16(at: int, count: int) -> torch.Tensor:
        return img[:, at : at + 2 * count].contiguous().view(torch.float16)

    c0, nq = 0, 0
    for i, (cnt, b) in enumerate(zip(n, K_BITS, strict=True)):
        if cnt and b == 16:
            size = cnt * p * torch.empty(0, dtype=raw_dtype).element_size()
            raw = img[:, ks[i] : ks[i] + size].contiguous().view(raw_dtype)
            k[:, c0 : c0 + cnt] = raw.reshape(m, cnt, p).float()
        elif cnt:
            q = codecs.QuantizedTensor(
                img[:, ks[i] : ks[i] + cnt * p * b // 8].reshape(m, cnt, p * b // 8),
                f16(ks[4] + 2 * nq, cnt).reshape(m, cnt, 1),
                f16(ks[5] + 2 * nq, cnt).reshape(m, cnt, 1), b, p, p,
            )  # fmt: skip
            k[:, c0 : c0 + cnt] = codecs.dequantize(q)
            nq += cnt
        c0 += cnt
    vo = ks[6]
    if vb == 16:
        size = p * d * torch.empty(0, dtype=raw_dtype).element_size()
        v = img[:, vo : vo + size].contiguous().view(raw_dtype).reshape(m, p, d).float()
    else:
        ng = d // v_group
        vq = codecs.QuantizedTensor(
            img[:, vo : vo + p * d * vb // 8].reshape(m, p, d * vb // 8),
            f16(vo + vs[1], p * ng).reshape(m, p, ng), f16(vo + vs[2], p * ng).reshape(m, p, ng),
            vb, v_group, d,
        )  # fmt: skip
        v = codecs.dequantize(vq)
    return k.transpose(1, 2), v
