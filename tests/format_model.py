#!/usr/bin/env python3
# Independent pure-Python model of docs/FORMAT.md version 2 (RTN), stdlib only.
# Prints the digests that test_golden in tests/test_ref.c pins: python3 tests/format_model.py
# With --check (make test) it compares them with the digests pinned there and fails on any difference.
import struct, math, sys, os, re
M64 = (1 << 64) - 1
def splitmix(st):
    st[0] = (st[0] + 0x9e3779b97f4a7c15) & M64
    z = st[0]
    z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & M64
    z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & M64
    return z ^ (z >> 31)
def golden(n, g, seed):
    st = [seed]; x = []
    for i in range(0, n, g):
        e = 110 + splitmix(st) % 28
        for c in range(g):
            r = splitmix(st)
            x.append(((r & 1) << 15) | ((e - (r >> 1) % 8) << 7) | ((r >> 8) % 128))
    return x
f32 = lambda v: struct.unpack('<f', struct.pack('<f', v))[0]
bf2f = lambda b: struct.unpack('<f', struct.pack('<I', b << 16))[0]
def f2bf(f):
    u = struct.unpack('<I', struct.pack('<f', f))[0]
    if (u & 0x7fffffff) > 0x7f800000: return 0x7fc0  # every NaN (FORMAT.md)
    u = (u + 0x7fff + ((u >> 16) & 1)) & 0xffffffff
    return u >> 16
def f2h(f):
    if abs(f) >= 65520.0: f = math.copysign(65504.0, f)
    return struct.unpack('<H', struct.pack('<e', f))[0]
h2f = lambda h: struct.unpack('<e', struct.pack('<H', h))[0]
al = lambda x: (x + 255) // 256 * 256
def encode(d, G, N, H, kb, vb, mode, k, v, hsh):
    rows = N * H
    secs = []; off = 64
    for b in (kb, vb):
        cb = d * b // 8; ng = d // G if b < 16 else 0
        co = al(off); off = co + rows * cb
        so = zo = None
        if b < 16:
            so = al(off); off = so + rows * ng * 2
            if mode == 0: zo = al(off); off = zo + rows * ng * 2
        secs.append((b, cb, ng, co, so, zo))
    total = al(off)
    out = bytearray(total)
    struct.pack_into('<IIQQIIQBB', out, 0, 0x3146564b, 2, hsh, N, H, d, total, kb, vb)
    for (b, cb, ng, co, so, zo), x in zip(secs, (k, v)):
        for r in range(rows):
            row = x[r * d:(r + 1) * d]
            if b == 16:
                for c in range(d): struct.pack_into('<H', out, co + r * cb + 2 * c, row[c])
                continue
            for g in range(ng):
                vals = [bf2f(row[g * G + c]) for c in range(G)]
                if mode == 0:
                    L = (1 << b) - 1
                    mn, mx = min(vals), max(vals)
                    s = f32(f32(mx - mn) / L)
                    sh, mh = f2h(s), f2h(mn); S, M = h2f(sh), h2f(mh)
                    qs = [int(min(max(round(f32(f32(xv - M) / S)), 0), L)) if S > 0 else 0 for xv in vals]
                    struct.pack_into('<H', out, zo + (r * ng + g) * 2, mh)
                else:
                    qm = (1 << (b - 1)) - 1
                    a = max(abs(xv) for xv in vals)
                    s = f32(a / qm); sh = f2h(s); S = h2f(sh)
                    qs = [int(min(max(round(f32(xv / S)), -qm), qm)) + qm if S > 0 else qm for xv in vals]
                struct.pack_into('<H', out, so + (r * ng + g) * 2, sh)
                for c, q in enumerate(qs):
                    j = g * G + c
                    out[co + r * cb + j * b // 8] |= q << ((j % (8 // b)) * b)
    return bytes(out), secs
def decode(buf, secs, d, G, N, H, mode):
    res = []
    for (b, cb, ng, co, so, zo) in secs:
        y = []
        for r in range(N * H):
            if b == 16:
                y += [struct.unpack_from('<H', buf, co + r * cb + 2 * c)[0] for c in range(d)]; continue
            for g in range(ng):
                S = h2f(struct.unpack_from('<H', buf, so + (r * ng + g) * 2)[0])
                M = h2f(struct.unpack_from('<H', buf, zo + (r * ng + g) * 2)[0]) if mode == 0 else 0.0
                for c in range(G):
                    j = g * G + c
                    q = (buf[co + r * cb + j * b // 8] >> ((j % (8 // b)) * b)) & ((1 << b) - 1)
                    f = f32(S * q + M) if mode == 0 else f32(S * (q - ((1 << (b - 1)) - 1)))
                    y.append(f2bf(f))
        res.append(struct.pack('<%dH' % len(y), *y))
    return res
def fnv(h, data):
    for byte in data: h = ((h ^ byte) * 0x100000001b3) & M64
    return h
N, H, d, G = 96, 3, 128, 64
k = golden(N * H * d, 64, 100); v = golden(N * H * d, 64, 200)
got = {}
for kb, vb, mode in ((2, 2, 0), (4, 2, 0), (8, 16, 0), (2, 4, 1)):
    buf, secs = encode(d, G, N, H, kb, vb, mode, k, v, 0x0123456789abcdef)
    ko, vo = decode(buf, secs, d, G, N, H, mode)
    got[(kb, vb, mode)] = (fnv(0xcbf29ce484222325, buf), fnv(fnv(0xcbf29ce484222325, ko), vo))
    print("K%dV%d %s: packed %016x decoded %016x" % ((kb, vb, "symmetric" if mode else "affine") + got[(kb, vb, mode)]))
if "--check" in sys.argv[1:]:
    src = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "test_ref.c")).read()
    pinned = {(int(a), int(b), 1 if m == "SYMMETRIC" else 0): (int(p, 16), int(q, 16)) for a, b, m, p, q in
              re.findall(r"\{(\d+), (\d+), KVF_MODE_(AFFINE|SYMMETRIC), 0x([0-9a-f]+)ull, 0x([0-9a-f]+)ull\}", src)}
    if pinned != got:
        sys.exit("format_model: the digests of docs/FORMAT.md's model differ from those tests/test_ref.c pins: %r" % pinned)
    print("format_model: the %d cases pinned in tests/test_ref.c agree" % len(got))
