// kvforge kernel template: KIVI's per-channel key quantization (groups run
// along the tokens of one channel, METHODS.md 2). One thread owns 8
// consecutive channels of one (head, token group); the last group may be
// partial. Decode is kvf_decode.cuh's (AXIS = token). CPU reference:
// runtime/cpu/ref_quant.c (axis token).
#pragma once
#include "kvf_quant.cuh"

namespace kvf_kivi {

constexpr int BLOCK = KVF_BLOCK; // kvf_abi.h: the host sizes grids with it

template <int D, int BITS, int G, int MODE>
__device__ __forceinline__ void encode(const u16 *__restrict__ x, i64 ts, i64 hs, int n_tokens, int n_heads,
                                       u8 *__restrict__ packed, kvf_quant::stage_planes p, int write_header,
                                       kvf_header_words hdr) {
    constexpr int LPR = D / 8, L = (1 << BITS) - 1, QMAX = (1 << (BITS - 1)) - 1;
    if (write_header && blockIdx.x == 0 && threadIdx.x == 0) kvf_write_header(packed, hdr);
    const i64 groups = (n_tokens + G - 1) / G;
    const i64 item = (i64)blockIdx.x * (BLOCK / LPR) + threadIdx.x / LPR; // (h, g)
    if (item >= groups * n_heads) return;
    const int lane = threadIdx.x % LPR;
    const i64 h = item / groups, g = item % groups;
    const int t0 = (int)(g * G), t1 = min(n_tokens, t0 + G);
    float mn[8], mx[8], a[8];
    for (int t = t0; t < t1; t++) {
        float v[8];
        kvf_load8f(x + t * ts + h * hs + lane * 8, v);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            mn[i] = t == t0 ? v[i] : fminf(mn[i], v[i]);
            mx[i] = t == t0 ? v[i] : fmaxf(mx[i], v[i]);
            a[i] = fmaxf(t == t0 ? 0.0f : a[i], fabsf(v[i]));
        }
    }
    u16 sh[8], zh[8];
    float S[8], M[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        if (MODE == KVF_MODE_AFFINE) {
            mn[i] = kvf_plus_zero(mn[i]);
            mx[i] = kvf_plus_zero(mx[i]);
            sh[i] = kvf_stored_f16(__fdiv_rn(__fsub_rn(mx[i], mn[i]), (float)L));
            zh[i] = kvf_stored_f16(mn[i]);
            M[i] = kvf_f16_to_f32(zh[i]);
        } else {
            sh[i] = kvf_stored_f16(__fdiv_rn(a[i], (float)QMAX));
            zh[i] = 0;
            M[i] = 0.0f;
        }
        S[i] = kvf_f16_to_f32(sh[i]);
    }
    const i64 at = (h * groups + g) * D + lane * 8;
    kvf_store8((u16 *)(packed + p.scales) + at, sh);
    if (MODE == KVF_MODE_AFFINE) kvf_store8((u16 *)(packed + p.zeros) + at, zh);
    for (int t = t0; t < t1; t++) {
        float v[8];
        u32 q[8];
        kvf_load8f(x + t * ts + h * hs + lane * 8, v);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            if (MODE == KVF_MODE_AFFINE)
                q[i] = S[i] > 0.0f ? (u32)kvf_clamp(kvf_rint(__fdiv_rn(__fsub_rn(v[i], M[i]), S[i])), 0.0f, (float)L) : 0u;
            else
                q[i] = (u32)((S[i] > 0.0f ? (int)kvf_clamp(kvf_rint(__fdiv_rn(v[i], S[i])), (float)-QMAX, (float)QMAX) : 0) + QMAX);
        }
        kvf_quant::store_codes<BITS>(packed + p.codes + (h * n_tokens + t) * (D * BITS / 8) + lane * BITS, q);
    }
}

} // namespace kvf_kivi

#define KVF_KIVI_ENCODE_KERNEL(NAME, D, BITS, G, MODE)                                             \
    extern "C" __global__ void __launch_bounds__(kvf_kivi::BLOCK)                                  \
    NAME(const kvf_encode_params p) {                                                              \
        kvf_kivi::encode<D, BITS, G, MODE>(p.in.x, p.in.ts, p.in.hs, p.n_tokens, p.n_heads, p.packed, p.planes, \
                                           p.write_header, p.hdr);                                 \
    }
