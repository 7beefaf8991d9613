// kvforge kernel template: the group quantizer shared by every method.
//
// One lane holds 8 consecutive channels of one row (token, head); G/8 lanes
// make a group, D/8 lanes a row. Formats (docs/FORMAT.md, METHODS.md 2):
// fp16 or FP8 E4M3 scale + offset (affine) or scale (symmetric); or QuantWM's
// two-level int8 group scale under an fp16 token scale, with an int8 zero
// code (affine). runtime/cpu/ref_quant.c is the CPU reference.
#pragma once
#include "kvf_common.cuh"

namespace kvf_quant {

// What one lane contributes to the planes of its row.
struct lane_out {
    u32 q[8];    // codes
    u16 scale;   // fp16 scale, or u8 group scale code (int8_fp16)
    u16 zero;    // fp16 offset, or int8 zero code (int8_fp16, as u16 low byte)
    u16 tscale;  // fp16 token scale (int8_fp16)
    u32 tern;    // ternary: bits 16*lane .. 16*lane+15 of the row's packed codes
};

// Code bytes of a row: D codes of BITS bits, or ternary's 13-bit fields.
template <int D, int BITS, int MODE>
__host__ __device__ constexpr int row_code_bytes() {
    return MODE == KVF_MODE_TERNARY ? KVF_TERNARY_ROW_BYTES(D) : D * BITS / 8;
}

// Ternary (kvf_abi.h): this lane's 16 bits of the row's packed codes. Its
// 8 codes (0..2) make the field F = c_0 + 3 c_1 + ... + 3^7 c_7 at row bit
// 13*lane; lane j stores row bits 16j .. 16j+15, which lie in the fields of
// lanes a = 16j/13 .. a+2, so every lane of the warp joins three shuffles.
// A row's LPR lanes are consecutive lanes of one warp (LPR divides 32:
// head_dim 64, 128 or 256).
template <int LPR>
__device__ __forceinline__ u32 ternary_piece(const u32 (&q)[8]) {
    static_assert(32 % LPR == 0, "a row's lanes in one warp");
    const int wl = (int)(threadIdx.x & 31u), lane = wl % LPR, first = wl - lane;
    u32 f = 0;
#pragma unroll
    for (int i = 7; i >= 0; i--) f = f * 3u + q[i];
    const int a = 16 * lane / KVF_TERNARY_FIELD_BITS, s = 16 * lane - KVF_TERNARY_FIELD_BITS * a;
    u64 w = 0;
#pragma unroll
    for (int k = 0; k < 3; k++) {
        const u32 fk = __shfl_sync(0xffffffffu, f, first + min(a + k, LPR - 1));
        if (a + k < LPR) w |= (u64)fk << (KVF_TERNARY_FIELD_BITS * k);
    }
    return (u32)(w >> s) & 0xffffu;
}

// Symmetric codes of 8 values under the effective scale S, for both scale
// formats: clamp(rint(v / S), -QMAX, QMAX) + QMAX, or QMAX where S is 0.
template <int BITS>
__device__ __forceinline__ void codes_symmetric(const float (&v)[8], float S, u32 (&q)[8]) {
    constexpr int QMAX = (1 << (BITS - 1)) - 1;
    float n[8];
    if (S > 0.0f) kvf_rint_div8<false>(v, S, n);
#pragma unroll
    for (int i = 0; i < 8; i++) q[i] = (u32)((S > 0.0f ? (int)kvf_clamp(n[i], (float)-QMAX, (float)QMAX) : 0) + QMAX);
}

// Quantize 8 values of a lane. LPR = lanes per row, LPG = lanes per group.
template <int BITS, int LPG, int LPR, int MODE, int SFMT>
__device__ __forceinline__ void encode8_codes(const float (&v)[8], lane_out &o) {
    constexpr int L = (1 << BITS) - 1, QMAX = (1 << (BITS - 1)) - 1;
    float mn = v[0], mx = v[0], a = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) { mn = fminf(mn, v[i]); mx = fmaxf(mx, v[i]); a = fmaxf(a, fabsf(v[i])); }
    if (MODE == KVF_MODE_AFFINE) {
        mn = kvf_plus_zero(kvf_group_min<LPG>(mn));
        mx = kvf_plus_zero(kvf_group_max<LPG>(mx));
    } else {
        a = kvf_group_max<LPG>(a);
    }
    const float s = MODE == KVF_MODE_AFFINE ? __fdiv_rn(__fsub_rn(mx, mn), (float)L) : __fdiv_rn(a, (float)QMAX);
    o.tscale = 0;
    if (SFMT == KVF_SCALE_FP16 || SFMT == KVF_SCALE_FP8) {
        // One scale (and zero) a group, stored as fp16 or FP8 E4M3.
        o.scale = SFMT == KVF_SCALE_FP8 ? (u16)kvf_f32_to_e4m3(s) : kvf_stored_f16(s);
        const float S = SFMT == KVF_SCALE_FP8 ? kvf_e4m3_to_f32(o.scale) : kvf_f16_to_f32(o.scale);
        if (MODE == KVF_MODE_AFFINE) {
            o.zero = SFMT == KVF_SCALE_FP8 ? (u16)kvf_f32_to_e4m3(mn) : kvf_stored_f16(mn);
            const float M = SFMT == KVF_SCALE_FP8 ? kvf_e4m3_to_f32(o.zero) : kvf_f16_to_f32(o.zero);
            float d[8], n[8];
#pragma unroll
            for (int i = 0; i < 8; i++) d[i] = __fsub_rn(v[i], M);
            if (S > 0.0f) kvf_rint_div8<false>(d, S, n);
#pragma unroll
            for (int i = 0; i < 8; i++) o.q[i] = S > 0.0f ? (u32)kvf_clamp(n[i], 0.0f, (float)L) : 0u;
        } else {
            o.zero = 0;
            codes_symmetric<BITS>(v, S, o.q);
        }
        return;
    }
    // Two-level: the token scale is the largest group scale over 127.
    // From 0, so NaN group scales (groups of only NaNs) are left out, as on the CPU.
    const float smax = kvf_group_max<LPR>(fmaxf(0.0f, s));
    o.tscale = kvf_stored_f16(__fdiv_rn(smax, 127.0f));
    const float T = kvf_f16_to_f32(o.tscale);
    const float u = T > 0.0f ? kvf_clamp(ceilf(__fdiv_rn(s, T)), 1.0f, 127.0f) : 0.0f;
    o.scale = (u16)u;
    const float S = __fmul_rn(T, u);
    if (MODE == KVF_MODE_AFFINE) {
        const float z = S > 0.0f ? kvf_clamp(kvf_rint(__fdiv_rn(-mn, S)), -128.0f, 127.0f) : 0.0f;
        o.zero = (u16)(u8)(signed char)(int)z;
        float n[8];
        if (S > 0.0f) kvf_rint_div8<true>(v, S, n, z);
#pragma unroll
        for (int i = 0; i < 8; i++) o.q[i] = S > 0.0f ? (u32)kvf_clamp(n[i], 0.0f, (float)L) : 0u;
    } else {
        o.zero = 0;
        codes_symmetric<BITS>(v, S, o.q);
    }
}

// encode8_codes, and for ternary the lane's piece of the packed row: every
// lane of the warp calls it (shuffles), live row or not.
template <int BITS, int LPG, int LPR, int MODE, int SFMT>
__device__ __forceinline__ void encode8(const float (&v)[8], lane_out &o) {
    encode8_codes<BITS, LPG, LPR, MODE, SFMT>(v, o);
    o.tern = MODE == KVF_MODE_TERNARY ? ternary_piece<LPR>(o.q) : 0u;
}

// Dequantize 8 codes. scale/zero/tscale are the stored plane values.
template <int BITS, int MODE, int SFMT>
__device__ __forceinline__ void decode8(const u32 q[8], u16 scale, u16 zero, u16 tscale, float out[8]) {
    constexpr int QMAX = (1 << (BITS - 1)) - 1;
    if (SFMT == KVF_SCALE_FP16 || SFMT == KVF_SCALE_FP8) {
        const float S = SFMT == KVF_SCALE_FP8 ? kvf_e4m3_to_f32(scale) : kvf_f16_to_f32(scale);
        if (MODE == KVF_MODE_AFFINE) {
            const float M = SFMT == KVF_SCALE_FP8 ? kvf_e4m3_to_f32(zero) : kvf_f16_to_f32(zero);
#pragma unroll
            for (int i = 0; i < 8; i++) out[i] = __fmaf_rn(S, (float)q[i], M);
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) out[i] = __fmul_rn(S, (float)((int)q[i] - QMAX));
        }
        return;
    }
    const float S = __fmul_rn(kvf_f16_to_f32(tscale), (float)(scale & 0xffu));
    const int z = MODE == KVF_MODE_AFFINE ? (int)(signed char)(u8)zero : QMAX;
#pragma unroll
    for (int i = 0; i < 8; i++) out[i] = __fmul_rn(S, (float)((int)q[i] - z));
}

// Codes of 8 channels: code i at bit i*BITS of a little-endian word.
template <int BITS>
__device__ __forceinline__ void store_codes(u8 *dst, const u32 q[8]) {
    u64 word = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) word |= (u64)q[i] << (i * BITS);
    if (BITS == 2) *(u16 *)dst = (u16)word;
    else if (BITS == 4) *(u32 *)dst = (u32)word;
    else *(u64 *)dst = word;
}

// Plane offsets of one stage of one tensor section (docs/METHODS.md 7).
typedef kvf_stage_planes stage_planes;

// Write a lane's codes and, from the group's first lane, its plane entries.
template <int D, int BITS, int G, int MODE, int SFMT>
__device__ __forceinline__ void store_row(u8 *packed, const stage_planes &p, i64 row, int lane, const lane_out &o) {
    constexpr int LPG = G / 8, GROUPS = D / G, CB = row_code_bytes<D, BITS, MODE>();
    if (MODE == KVF_MODE_TERNARY) {
        u8 *const dst = packed + p.codes + row * CB;
        if (2 * lane < CB) dst[2 * lane] = (u8)o.tern;
        if (2 * lane + 1 < CB) dst[2 * lane + 1] = (u8)(o.tern >> 8);
    } else {
        store_codes<BITS>(packed + p.codes + row * CB + lane * BITS, o.q);
    }
    if (lane % LPG) return;
    const i64 g = row * GROUPS + lane / LPG;
    if (SFMT == KVF_SCALE_FP16) {
        ((u16 *)(packed + p.scales))[g] = o.scale;
        if (MODE == KVF_MODE_AFFINE) ((u16 *)(packed + p.zeros))[g] = o.zero;
    } else if (SFMT == KVF_SCALE_FP8) {
        packed[p.scales + g] = (u8)o.scale;
        if (MODE == KVF_MODE_AFFINE) packed[p.zeros + g] = (u8)o.zero;
    } else {
        packed[p.scales + g] = (u8)o.scale;
        if (MODE == KVF_MODE_AFFINE) packed[p.zeros + g] = (u8)o.zero;
        if (lane == 0) ((u16 *)(packed + p.tscales))[row] = o.tscale;
    }
}

} // namespace kvf_quant
