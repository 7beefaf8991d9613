// kvforge kernel template: the practitioner's pipeline (METHODS.md 11), the
// parts the row encodes (kvf_rtn.cuh), the k-means path (kvf_kmeans.cuh) and
// the decode (kvf_decode.cuh) share: the anchor's rows, the outliers a row
// keeps exactly, the refinement of the calibrated channels. A lane holds 8
// channels of one row, D/8 lanes a row, as in kvf_quant.cuh. Every operation
// is the CPU reference's (runtime/cpu/ref_pipeline.c, ref_encode.c), in its
// order, so the bytes and the decoded values agree bit for bit.
#pragma once
#include "kvf_quant.cuh"

namespace kvf_pipe {

// The carried error of one value: x - y, or 0 where that is not finite
// (METHODS.md 11: a NaN or Inf stays in its span; ref_encode.c).
__device__ __forceinline__ float carried(float x, float y) {
    const float e = __fsub_rn(x, y);
    return fabsf(e) <= 3.40282347e38f ? e : 0.0f;
}

// 8 channels (lane * 8 + c0 ..) of the anchor's row `arow` (head h's row t %
// tokens: the caller's index) as f32: BF16 rows at 16 bits, else RTN affine
// with fp16 scale and zero per group of G (kvf_scheme_anchor's scheme):
// fma(S, q, M) as the reference's decode.
template <int D, int AB, int G>
__device__ __forceinline__ void anchor8(const kvf_anchor_ref &a, u64 arow, int c0, float (&out)[8]) {
    if (AB == 16) {
        kvf_bf16x8_to_f32(kvf_ldg16(a.packed + a.codes + (arow * D + c0) * 2), out);
        return;
    }
    constexpr int GROUPS = D / G;
    const u64 g = arow * GROUPS + c0 / G;
    const float S = kvf_f16_to_f32((u16)kvf_ldg_u16(a.packed + a.scales + g * 2));
    const float M = kvf_f16_to_f32((u16)kvf_ldg_u16(a.packed + a.zeros + g * 2));
    u64 w = AB == 4 ? (u64)kvf_ldg_u32(a.packed + a.codes + arow * (D / 2) + c0 / 2) : 0;
    if (AB == 8) {
        const uint2 v = kvf_ldg_u64(a.packed + a.codes + arow * D + c0);
        w = (u64)v.x | ((u64)v.y << 32);
    }
#pragma unroll
    for (int i = 0; i < 8; i++) out[i] = __fmaf_rn(S, (float)(u32)((w >> (i * AB)) & ((1u << AB) - 1u)), M);
}

__device__ __forceinline__ float magnitude(float x) { return x != x ? __int_as_float(0x7f800000) : fabsf(x); }

// The K channels of the row of largest magnitude (a NaN above every number,
// ties to the lower channel), largest first, known to every lane of the row:
// K rounds of a max over the row's LPR lanes. v: the lane's 8 values.
template <int K, int LPR>
__device__ __forceinline__ void pick(const float (&v)[8], int lane, int (&idx)[K > 0 ? K : 1]) {
    u32 taken = 0;
#pragma unroll
    for (int k = 0; k < K; k++) {
        float bm = -1.0f;
        int bc = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const float m = magnitude(v[i]);
            if (!(taken >> i & 1u) && m > bm) bm = m, bc = lane * 8 + i;
        }
#pragma unroll
        for (int off = LPR / 2; off > 0; off >>= 1) {
            const float om = __shfl_xor_sync(0xffffffffu, bm, off);
            const int oc = __shfl_xor_sync(0xffffffffu, bc, off);
            if (om > bm || (om == bm && oc < bc)) bm = om, bc = oc;
        }
        idx[k] = bc;
        if (bc / 8 == lane) taken |= 1u << (bc % 8);
    }
}

// The refinement of a row's calibrated channels (the reference's
// kvf_ref_refine_encode): r the lane's residual (NaN at outliers), rhat what
// decode gets for it, map the lane's 8 slots (255: not refined). Returns the
// row's fp16 scale; sets add[i] for the refined channels; ORs each code into
// the row's words in shared memory (zeroed by the caller).
template <int PB, int LPR>
__device__ __forceinline__ u16 refine(const float (&r)[8], const float (&rhat)[8], const u8 (&map)[8], float (&add)[8],
                                      u32 *words) {
    constexpr int QMAX = (1 << ((PB > 1 ? PB : 2) - 1)) - 1;
    float diff[8], a = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        diff[i] = 0.0f;
        if (map[i] == 255) continue;
        const float v = __fsub_rn(r[i], rhat[i]);
        if ((__float_as_uint(v) & 0x7f800000u) != 0x7f800000u) diff[i] = v; // finite
        a = fmaxf(a, fabsf(diff[i]));
    }
    a = kvf_group_max<LPR>(a);
    const u16 s16 = kvf_f32_to_f16(__fdiv_rn(a, (float)QMAX));
    const float S = kvf_f16_to_f32(s16);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        add[i] = 0.0f;
        if (map[i] == 255) continue;
        const int q = S > 0.0f ? (int)kvf_clamp(kvf_rint(__fdiv_rn(diff[i], S)), (float)-QMAX, (float)QMAX) : 0;
        const int bit = map[i] * PB;
        atomicOr(words + bit / 32, (u32)(q + QMAX) << (bit % 32));
        add[i] = __fmul_rn(S, (float)q);
    }
    return s16;
}

// What decode adds to refined channel slot `slot` of a row (codes: the row's
// refinement bytes; S its scale as f32).
template <int PB>
__device__ __forceinline__ float refined(const u8 *codes, int slot, float S) {
    constexpr int QMAX = (1 << ((PB > 1 ? PB : 2) - 1)) - 1;
    const int bit = slot * PB;
    const u32 code = (kvf_ldg_u8(codes + bit / 8) >> (bit % 8)) & ((1u << PB) - 1u);
    return __fmul_rn(S, (float)((int)code - QMAX));
}

// A lane's 8 map bytes (channels c0 ..), clamped to the refined count so a
// corrupt map cannot read past a row (the CPU decode refuses it).
template <int PM>
__device__ __forceinline__ void map8(const u8 *map_head, int c0, u8 (&m)[8]) {
    const uint2 w = kvf_ldg_u64(map_head + c0);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const u8 b = (u8)(((i < 4 ? w.x : w.y) >> (8 * (i % 4))) & 0xffu);
        m[i] = b == 255 ? 255 : (u8)min((int)b, PM > 0 ? PM - 1 : 0);
    }
}

} // namespace kvf_pipe
