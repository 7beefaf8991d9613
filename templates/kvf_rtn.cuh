// kvforge kernel template: RTN (round-to-nearest) quantization.
//
// Per token and head, channels are cut into groups of G; each group gets an
// fp16 scale (and, affine, an fp16 offset) and b-bit codes. The formulas and
// the packed layout are docs/FORMAT.md's; runtime/ref_rtn.c is the CPU
// reference they must match (packed bytes identical, decode bit-identical).
//
// Thread mapping: one thread owns 8 consecutive channels of one (head, token)
// row (one 16-byte load); D/8 threads cover a row, G/8 threads a group, and a
// group's min/max is a shuffle reduction across those lanes.
#pragma once
#include "kvf_common.cuh"

namespace kvf_rtn {

constexpr int VEC = 8;
constexpr int BLOCK = 256;

template <int D, int BITS, int G, int MODE>
struct cfg {
    static constexpr int lanes_per_row = D / VEC;
    static constexpr int lanes_per_group = G / VEC;
    static constexpr int rows_per_block = BLOCK / lanes_per_row;
    static constexpr int groups = D / G;
    static constexpr int code_bytes = D * BITS / 8;
    static_assert(D % G == 0 && G % VEC == 0 && lanes_per_group <= 32, "group shape");
    static_assert(BITS == 2 || BITS == 4 || BITS == 8 || BITS == 16, "bits");
};

__device__ __forceinline__ void load8(const u16 *p, u16 v[VEC]) {
    uint4 w = *(const uint4 *)p;
    u32 a[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; i++) { v[2 * i] = (u16)(a[i] & 0xffffu); v[2 * i + 1] = (u16)(a[i] >> 16); }
}

__device__ __forceinline__ void store8(u16 *p, const u16 v[VEC]) {
    uint4 w;
    w.x = v[0] | ((u32)v[1] << 16); w.y = v[2] | ((u32)v[3] << 16);
    w.z = v[4] | ((u32)v[5] << 16); w.w = v[6] | ((u32)v[7] << 16);
    *(uint4 *)p = w;
}

// Store the 8 codes of one thread: code i at bit i*BITS of a little-endian word.
template <int BITS>
__device__ __forceinline__ void store_codes(u8 *dst, const u32 q[VEC]) {
    u64 word = 0;
#pragma unroll
    for (int i = 0; i < VEC; i++) word |= (u64)q[i] << (i * BITS);
    if (BITS == 2) *(u16 *)dst = (u16)word;
    else if (BITS == 4) *(u32 *)dst = (u32)word;
    else *(u64 *)dst = word;
}

template <int BITS>
__device__ __forceinline__ void load_codes(const u8 *src, u32 q[VEC]) {
    u64 word = BITS == 2 ? (u64)*(const u16 *)src : BITS == 4 ? (u64)*(const u32 *)src : *(const u64 *)src;
#pragma unroll
    for (int i = 0; i < VEC; i++) q[i] = (u32)(word >> (i * BITS)) & ((1u << BITS) - 1u);
}

template <int D, int BITS, int G, int MODE>
__device__ __forceinline__ void encode(const u16 *__restrict__ x, i64 token_stride, i64 head_stride,
                                       int n_tokens, int n_heads, u8 *__restrict__ packed,
                                       kvf_planes planes, int write_header, kvf_header_words hdr) {
    typedef cfg<D, BITS, G, MODE> C;
    if (write_header && blockIdx.x == 0 && threadIdx.x == 0) kvf_write_header(packed, hdr);
    const int lane = threadIdx.x % C::lanes_per_row;
    const i64 row = (i64)blockIdx.x * C::rows_per_block + threadIdx.x / C::lanes_per_row;
    const i64 n_rows = (i64)n_tokens * n_heads;
    const bool live = row < n_rows;
    const i64 h = live ? row / n_tokens : 0, t = live ? row % n_tokens : 0;
    u16 raw[VEC] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (live) load8(x + t * token_stride + h * head_stride + lane * VEC, raw);
    if (BITS == 16) {
        if (live) store8((u16 *)(packed + planes.codes) + row * D + lane * VEC, raw);
        return;
    }
    float v[VEC];
#pragma unroll
    for (int i = 0; i < VEC; i++) v[i] = kvf_bf16_to_f32(raw[i]);
    constexpr int qmax_a = (1 << BITS) - 1, qmax_s = (1 << (BITS - 1)) - 1;
    u32 q[VEC];
    u16 scale_h, zero_h = 0;
    if (MODE == KVF_MODE_AFFINE) {
        // fminf/fmaxf drop NaNs; the group's extremes as the reference has them.
        float mn = v[0], mx = v[0];
#pragma unroll
        for (int i = 1; i < VEC; i++) { mn = fminf(mn, v[i]); mx = fmaxf(mx, v[i]); }
        mn = kvf_plus_zero(kvf_group_min<C::lanes_per_group>(mn));
        mx = kvf_plus_zero(kvf_group_max<C::lanes_per_group>(mx));
        scale_h = kvf_stored_f16(__fdiv_rn(__fsub_rn(mx, mn), (float)qmax_a));
        zero_h = kvf_stored_f16(mn);
        const float S = kvf_f16_to_f32(scale_h), M = kvf_f16_to_f32(zero_h);
#pragma unroll
        for (int i = 0; i < VEC; i++)
            q[i] = S > 0.0f ? (u32)kvf_clamp(kvf_rint(__fdiv_rn(__fsub_rn(v[i], M), S)), 0.0f, (float)qmax_a) : 0u;
    } else {
        float a = 0.0f;
#pragma unroll
        for (int i = 0; i < VEC; i++) a = fmaxf(a, fabsf(v[i]));
        a = kvf_group_max<C::lanes_per_group>(a);
        scale_h = kvf_stored_f16(__fdiv_rn(a, (float)qmax_s));
        const float S = kvf_f16_to_f32(scale_h);
#pragma unroll
        for (int i = 0; i < VEC; i++) {
            int qi = S > 0.0f ? (int)kvf_clamp(kvf_rint(__fdiv_rn(v[i], S)), (float)-qmax_s, (float)qmax_s) : 0;
            q[i] = (u32)(qi + qmax_s);
        }
    }
    if (!live) return;
    store_codes<BITS>(packed + planes.codes + row * C::code_bytes + lane * (VEC * BITS / 8), q);
    if (lane % C::lanes_per_group == 0) {
        const i64 g = row * C::groups + lane / C::lanes_per_group;
        ((u16 *)(packed + planes.scales))[g] = scale_h;
        if (MODE == KVF_MODE_AFFINE) ((u16 *)(packed + planes.zeros))[g] = zero_h;
    }
}

template <int D, int BITS, int G, int MODE>
__device__ __forceinline__ void decode(const u8 *__restrict__ packed, kvf_planes planes, int n_tokens,
                                       int n_heads, u16 *__restrict__ y, i64 token_stride, i64 head_stride) {
    typedef cfg<D, BITS, G, MODE> C;
    const int lane = threadIdx.x % C::lanes_per_row;
    const i64 row = (i64)blockIdx.x * C::rows_per_block + threadIdx.x / C::lanes_per_row;
    if (row >= (i64)n_tokens * n_heads) return;
    const i64 h = row / n_tokens, t = row % n_tokens;
    u16 *dst = y + t * token_stride + h * head_stride + lane * VEC;
    u16 out[VEC];
    if (BITS == 16) {
        load8((const u16 *)(packed + planes.codes) + row * D + lane * VEC, out);
        store8(dst, out);
        return;
    }
    u32 q[VEC];
    load_codes<BITS>(packed + planes.codes + row * C::code_bytes + lane * (VEC * BITS / 8), q);
    const i64 g = row * C::groups + lane / C::lanes_per_group;
    const float S = kvf_f16_to_f32(((const u16 *)(packed + planes.scales))[g]);
    if (MODE == KVF_MODE_AFFINE) {
        const float M = kvf_f16_to_f32(((const u16 *)(packed + planes.zeros))[g]);
#pragma unroll
        for (int i = 0; i < VEC; i++) out[i] = kvf_output_bf16(__fmaf_rn(S, (float)q[i], M));
    } else {
        constexpr int qmax_s = (1 << (BITS - 1)) - 1;
#pragma unroll
        for (int i = 0; i < VEC; i++) out[i] = kvf_output_bf16(__fmul_rn(S, (float)((int)q[i] - qmax_s)));
    }
    store8(dst, out);
}

} // namespace kvf_rtn

// Instantiation macros used by generated files: one extern "C" kernel per
// (tensor section, direction) with the section's configuration baked in.
#define KVF_RTN_ENCODE_KERNEL(NAME, D, BITS, G, MODE)                                              \
    extern "C" __global__ void __launch_bounds__(kvf_rtn::BLOCK)                                   \
    NAME(const u16 *__restrict__ x, i64 token_stride, i64 head_stride, int n_tokens, int n_heads,  \
         u8 *__restrict__ packed, kvf_planes planes, int write_header, kvf_header_words hdr) {     \
        kvf_rtn::encode<D, BITS, G, MODE>(x, token_stride, head_stride, n_tokens, n_heads, packed, \
                                          planes, write_header, hdr);                              \
    }

#define KVF_RTN_DECODE_KERNEL(NAME, D, BITS, G, MODE)                                              \
    extern "C" __global__ void __launch_bounds__(kvf_rtn::BLOCK)                                   \
    NAME(const u8 *__restrict__ packed, kvf_planes planes, int n_tokens, int n_heads,              \
         u16 *__restrict__ y, i64 token_stride, i64 head_stride) {                                 \
        kvf_rtn::decode<D, BITS, G, MODE>(packed, planes, n_tokens, n_heads, y, token_stride,      \
                                          head_stride);                                            \
    }
