// kvforge kernel template: the fused decode of every method (METHODS.md 1).
//
// One kernel per tensor section: per (head, token) row it unpacks and
// dequantizes every stage, gathers the stage's centroid, adds the PSAC term,
// undoes the Hadamard rotation, applies RoPE to keys cached before RoPE, and
// writes BF16 for the caller's attention. Lane layout as kvf_rtn.cuh: 8
// channels per lane, D/8 lanes per row. CPU reference: runtime/ref_encode.c.
#pragma once
#include "kvf_quant.cuh"

#define KVF_AXIS_CHANNEL 0
#define KVF_AXIS_TOKEN 1
#define KVF_ROPE_NONE 0
#define KVF_ROPE_HALF 1
#define KVF_ROPE_INTERLEAVED 2

namespace kvf_decode {

constexpr int BLOCK = 256;
constexpr int RPT = 2; // rows per thread: twice the loads in flight (runtime/context.c sizes the grid)

struct section_planes {
    kvf_quant::stage_planes stage[8];
    u64 basis, coef, cscale; // PSAC
};

struct rope_args {
    double log2_theta;
    int n_sections;
    int sections[4];
};

// Per-channel scales (KIVI keys: groups run along tokens).
template <int D, int BITS, int G, int MODE>
__device__ __forceinline__ void load_row_token_axis(const u8 *packed, const kvf_quant::stage_planes &p, i64 h,
                                                    i64 t, int n_tokens, int lane, float out[8]) {
    constexpr int QMAX = (1 << (BITS - 1)) - 1;
    u32 q[8];
    kvf_quant::load_codes<BITS>(packed + p.codes + (h * n_tokens + t) * (D * BITS / 8) + lane * BITS, q);
    const i64 groups = (n_tokens + G - 1) / G;
    const i64 at = ((h * groups + t / G) * D + lane * 8);
    u16 s[8], z[8];
    kvf_load8((const u16 *)(packed + p.scales) + at, s);
    if (MODE == KVF_MODE_AFFINE) kvf_load8((const u16 *)(packed + p.zeros) + at, z);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const float S = kvf_f16_to_f32(s[i]);
        out[i] = MODE == KVF_MODE_AFFINE ? __fmaf_rn(S, (float)q[i], kvf_f16_to_f32(z[i]))
                                         : __fmul_rn(S, (float)((int)q[i] - QMAX));
    }
}

template <int D>
__device__ __forceinline__ float rope_inv_freq(int pair, const rope_args &r) {
    int start = 0, a = 0;
    while (a + 1 < r.n_sections && pair >= start + r.sections[a]) start += r.sections[a++];
    const double frac = 2.0 * (double)(pair - start) / (double)(2 * r.sections[a]);
    return (float)exp2(-frac * r.log2_theta);
}

template <int D>
__device__ __forceinline__ int rope_axis(int pair, const rope_args &r) {
    int start = 0, a = 0;
    while (a + 1 < r.n_sections && pair >= start + r.sections[a]) start += r.sections[a++];
    return a;
}

template <int D, int ROPE>
__device__ __forceinline__ void apply_rope(float y[8], int lane, const int *pos_row, const rope_args &r) {
    if (ROPE == KVF_ROPE_HALF) {
        constexpr int LPR = D / 8;
        const bool first = lane < LPR / 2;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const float other = __shfl_xor_sync(0xffffffffu, y[i], LPR / 2);
            const int c = lane * 8 + i, pair = first ? c : c - D / 2;
            const float ang = __fmul_rn((float)pos_row[rope_axis<D>(pair, r)], rope_inv_freq<D>(pair, r));
            const float cs = cosf(ang), sn = sinf(ang);
            const float x1 = first ? y[i] : other, x2 = first ? other : y[i];
            y[i] = first ? __fsub_rn(__fmul_rn(x1, cs), __fmul_rn(x2, sn)) : __fadd_rn(__fmul_rn(x2, cs), __fmul_rn(x1, sn));
        }
    } else if (ROPE == KVF_ROPE_INTERLEAVED) {
#pragma unroll
        for (int i = 0; i < 8; i += 2) {
            const int pair = (lane * 8 + i) / 2;
            const float ang = __fmul_rn((float)pos_row[rope_axis<D>(pair, r)], rope_inv_freq<D>(pair, r));
            const float cs = cosf(ang), sn = sinf(ang), x1 = y[i], x2 = y[i + 1];
            y[i] = __fsub_rn(__fmul_rn(x1, cs), __fmul_rn(x2, sn));
            y[i + 1] = __fadd_rn(__fmul_rn(x2, cs), __fmul_rn(x1, sn));
        }
    }
}

template <int D, int BITS, int G, int MODE, int SFMT, int AXIS, int NCENT, int STAGES, int ROT, int PSAC_R, int ROPE>
__device__ __forceinline__ void decode(const u8 *__restrict__ packed, const section_planes &p, int n_tokens,
                                       int n_heads, u16 *__restrict__ y_out, i64 token_stride, i64 head_stride,
                                       const int *__restrict__ positions, rope_args rope, i64 block_row) {
    constexpr int LPR = D / 8;
    const int lane = threadIdx.x % LPR;
    const i64 row = block_row + threadIdx.x / LPR;
    const bool live = row < (i64)n_tokens * n_heads;
    // Rows past the end still run (shuffles need every lane), on row 0.
    const i64 r = live ? row : 0, h = r / n_tokens, t = r % n_tokens;
    u16 *dst = y_out + t * token_stride + h * head_stride + lane * 8;
    float y[8];
    if (BITS == 16) {
        u16 raw[8];
        kvf_load8((const u16 *)(packed + p.stage[0].codes) + r * D + lane * 8, raw);
        if (live) kvf_store8(dst, raw);
        return;
    }
    // y = ((0 + mu_0) + mu_1 ...) + r_hat: every stage's centroid, then the
    // one quantized residual (stage 0's planes), as the CPU reference adds.
#pragma unroll
    for (int i = 0; i < 8; i++) y[i] = 0.0f;
    if (NCENT) {
#pragma unroll
        for (int s = 0; s < STAGES; s++) {
            const int idx = packed[p.stage[s].index + r];
            float mu[8];
            kvf_load8f((const u16 *)(packed + p.stage[s].centroids) + (h * NCENT + idx) * D + lane * 8, mu);
#pragma unroll
            for (int i = 0; i < 8; i++) y[i] = __fadd_rn(y[i], mu[i]);
        }
    }
    {
        float part[8];
        if (AXIS == KVF_AXIS_TOKEN) load_row_token_axis<D, BITS, G, MODE>(packed, p.stage[0], h, t, n_tokens, lane, part);
        else kvf_quant::load_row<D, BITS, G, MODE, SFMT>(packed, p.stage[0], r, lane, part);
#pragma unroll
        for (int i = 0; i < 8; i++) y[i] = __fadd_rn(y[i], part[i]);
    }
    if (PSAC_R) {
        const u16 cs = ((const u16 *)(packed + p.cscale))[r];
        if (cs) {
            const float csf = kvf_f16_to_f32(cs);
            const signed char *coef = (const signed char *)(packed + p.coef) + r * PSAC_R;
            // The lane's 8 channels x R basis entries are contiguous: 16-byte loads.
            const uint4 *bv = (const uint4 *)((const u16 *)(packed + p.basis) + (h * D + lane * 8) * PSAC_R);
            u16 ub[8 * (PSAC_R > 0 ? PSAC_R : 1)];
#pragma unroll
            for (int k = 0; k < PSAC_R; k++) {
                const uint4 w = bv[k];
                ub[8 * k + 0] = (u16)w.x; ub[8 * k + 1] = (u16)(w.x >> 16);
                ub[8 * k + 2] = (u16)w.y; ub[8 * k + 3] = (u16)(w.y >> 16);
                ub[8 * k + 4] = (u16)w.z; ub[8 * k + 5] = (u16)(w.z >> 16);
                ub[8 * k + 6] = (u16)w.w; ub[8 * k + 7] = (u16)(w.w >> 16);
            }
#pragma unroll
            for (int j = 0; j < PSAC_R; j++) {
                const float c = __fmul_rn(csf, (float)coef[j]);
#pragma unroll
                for (int i = 0; i < 8; i++) y[i] = __fmaf_rn(c, kvf_bf16_to_f32(ub[i * PSAC_R + j]), y[i]);
            }
        }
    }
    if (ROT) kvf_fwht_row<D>(y, lane);
    if (ROPE) apply_rope<D, ROPE>(y, lane, positions + t * rope.n_sections, rope);
    if (!live) return;
    u16 out[8];
#pragma unroll
    for (int i = 0; i < 8; i++) out[i] = kvf_output_bf16(y[i]);
    kvf_store8(dst, out);
}

} // namespace kvf_decode

#define KVF_DECODE_KERNEL(NAME, D, BITS, G, MODE, SFMT, AXIS, NCENT, STAGES, ROT, PSAC_R, ROPE)          \
    extern "C" __global__ void __launch_bounds__(kvf_decode::BLOCK)                                       \
    NAME(const u8 *__restrict__ packed, kvf_decode::section_planes planes, int n_tokens, int n_heads,     \
         u16 *__restrict__ y, i64 token_stride, i64 head_stride, const int *__restrict__ positions,       \
         kvf_decode::rope_args rope) {                                                                    \
        constexpr int ROWS = kvf_decode::BLOCK / (D / 8);                                                 \
        _Pragma("unroll") for (int u = 0; u < kvf_decode::RPT; u++)                                       \
            kvf_decode::decode<D, BITS, G, MODE, SFMT, AXIS, NCENT, STAGES, ROT, PSAC_R, ROPE>(           \
                packed, planes, n_tokens, n_heads, y, token_stride, head_stride, positions, rope,         \
                ((i64)blockIdx.x * kvf_decode::RPT + u) * ROWS);                                          \
    }
