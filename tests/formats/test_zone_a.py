"""Zone A pack: the batched pack writes the bytes and lists of the per-(head, V width) reference
(the loop it replaced, kept here), and unpack reads back what was packed."""

from __future__ import annotations

import pytest
import torch

from tiered_radix.formats import zone_a
from tiered_radix.formats.codecs import dequantize, quantize
from tiered_radix.formats.layout import K_BITS, V_BITS, k_sections, pack_pages

_ORDER = {2: 0, 4: 1, 8: 2, 16: 3, 0: 4}


def _pack_ref(k, v, v_bits, k_bits, in_set, *, page_size, v_group, raw_dtype):
    """The per-(head, V width) pack before it was batched (commit 356e1a1)."""
    H, T, d = k.shape
    dev, P = k.device, page_size
    imgs, offs, toks, table, perms, counts = [], [], [], [], [], []
    pages = torch.zeros(H, len(V_BITS), dtype=torch.long)
    off = 0
    for h in range(H):
        kb = k_bits[h]
        perm = torch.sort(torch.tensor([_ORDER[int(b)] for b in kb]), stable=True).indices
        n = [int((kb == b).sum()) for b in K_BITS]
        perms.append(perm)
        counts.append(n)
        kh = k[h][:, perm.to(dev)]
        for i, vb in enumerate(V_BITS):
            table.append(n + k_sections(n, P) + [0])
            tp = ((v_bits[h] == vb) & in_set[h]).nonzero().squeeze(1)
            npg = -(-tp.numel() // P)
            if not npg:
                continue
            idx = torch.cat([tp, tp[-1:].expand(npg * P - tp.numel())])
            xk = kh[idx.to(dev)].reshape(npg, P, d)
            xv = v[h][idx.to(dev)].reshape(npg, P, d)
            img = pack_pages(xk, xv, n, vb, v_group, raw_dtype)
            imgs.append(img.reshape(-1))
            offs += [off + j * img.shape[1] for j in range(npg)]
            off += img.numel()
            pt = torch.full((npg * P,), -1, dtype=torch.long)
            pt[: tp.numel()] = tp
            toks.append(pt.view(npg, P))
            pages[h, i] = npg
    return zone_a.ZoneA(
        img=torch.cat(imgs) if imgs else torch.zeros(0, dtype=torch.uint8, device=dev),
        page_off=torch.tensor(offs, dtype=torch.long),
        page_tok=torch.cat(toks) if toks else torch.zeros(0, P, dtype=torch.long),
        pages=pages, k_table=torch.tensor(table, dtype=torch.int32), perm=torch.stack(perms),
        k_counts=counts,
    )  # fmt: skip


def _inputs(seed, H, T, d, *, p_set=0.7, k_choices=(0, 2, 4, 8, 16), v_choices=(0, 2, 4, 8, 16)):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(H, T, d, generator=g).to(torch.bfloat16)
    v = torch.randn(H, T, d, generator=g).to(torch.bfloat16)
    vc, kc = torch.tensor(v_choices), torch.tensor(k_choices)
    vb = vc[torch.randint(len(vc), (H, T), generator=g)]
    kb = kc[torch.randint(len(kc), (H, d), generator=g)]
    in_set = (torch.rand(H, T, generator=g) < p_set) & (vb > 0)
    return k, v, vb, kb, in_set


CASES = [
    dict(seed=0, H=2, T=300, d=64),
    dict(seed=1, H=3, T=97, d=32, p_set=0.2),
    dict(seed=2, H=4, T=64, d=64, k_choices=(16,), v_choices=(16,)),  # raw only
    dict(seed=3, H=2, T=200, d=64, k_choices=(2, 0), v_choices=(2,)),  # one width, drops
    dict(seed=4, H=2, T=50, d=32, p_set=0.0),  # nothing kept: no pages
    dict(seed=5, H=1, T=1, d=32),
]


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("raw_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("device", DEVICES)
def test_pack_writes_the_reference_pages_bit_for_bit(case, raw_dtype, device):
    k, v, vb, kb, in_set = _inputs(**case)
    k, v = k.to(device), v.to(device)  # the lists stay on the host, as repack passes them
    kw = dict(page_size=32, v_group=32, raw_dtype=raw_dtype)
    got, ref = zone_a.pack(k, v, vb, kb, in_set, **kw), _pack_ref(k, v, vb, kb, in_set, **kw)
    assert got.img.device == k.device and torch.equal(got.img, ref.img)
    for name in ("page_off", "page_tok", "pages", "k_table", "perm"):
        a, b = getattr(got, name), getattr(ref, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert got.k_counts == ref.k_counts


def test_unpack_reads_the_packed_tokens_back():
    H, T, d, P, g = 2, 130, 64, 32, 32
    k, v, vb, kb, in_set = _inputs(7, H, T, d)
    z = zone_a.pack(k, v, vb, kb, in_set, page_size=P, v_group=g, raw_dtype=torch.bfloat16)
    kk, vv, listed = zone_a.unpack(z, z.img, T, page_size=P, v_group=g, raw_dtype=torch.bfloat16)
    assert torch.equal(listed, in_set)
    for h in range(H):
        t = in_set[h].nonzero().squeeze(1)
        for b in (2, 4, 8):  # V of the kept tokens at width b: the codec's values
            tb = t[vb[h, t] == b]
            if tb.numel():
                want = dequantize(quantize(v[h, tb], b, g))
                assert torch.equal(vv[h, tb], want)
        t16 = t[vb[h, t] == 16]
        assert torch.equal(vv[h, t16], v[h, t16].float())
        raw = kb[h] == 16
        assert torch.equal(kk[h][:, raw][t], k[h][:, raw][t].float())
        assert (kk[h][:, kb[h] == 0][t] == 0).all()
    assert vv[~in_set].isnan().all()


def test_pack_layers_packs_each_layer_as_the_reference_does():
    kw = dict(page_size=32, v_group=32, raw_dtype=torch.bfloat16)
    layers = [_inputs(10 + li, 2, 150, 64, p_set=0.0 if li == 1 else 0.6) for li in range(4)]
    ks, vs, vbs, kbs, sets = zip(*layers, strict=True)
    got = zone_a.pack_layers(ks, vs, torch.stack(vbs), torch.stack(kbs), torch.stack(sets), **kw)
    assert len(got) == 4
    for z, (k, v, vb, kb, in_set) in zip(got, layers, strict=True):
        ref = _pack_ref(k, v, vb, kb, in_set, **kw)
        assert torch.equal(z.img, ref.img)
        for name in ("page_off", "page_tok", "pages", "k_table", "perm"):
            assert torch.equal(getattr(z, name), getattr(ref, name)), name
        assert z.k_counts == ref.k_counts


@pytest.mark.parametrize("page_size", [8, 16, 64])
def test_pack_at_other_page_sizes_writes_the_reference_pages(page_size):
    k, v, vb, kb, in_set = _inputs(20 + page_size, 2, 173, 64)
    kw = dict(page_size=page_size, v_group=16, raw_dtype=torch.float16)
    got, ref = zone_a.pack(k, v, vb, kb, in_set, **kw), _pack_ref(k, v, vb, kb, in_set, **kw)
    assert torch.equal(got.img, ref.img) and torch.equal(got.page_off, ref.page_off)
    assert torch.equal(got.page_tok, ref.page_tok) and torch.equal(got.k_table, ref.k_table)
