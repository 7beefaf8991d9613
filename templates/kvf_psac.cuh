// kvforge kernel template: QuantWM's PSAC (METHODS.md 4): the remaining key
// error E (after every stage) projected on the query subspace U_r, stored
// INT8 with an fp16 scale per token, kept only where it lowers the
// query-weighted error; and QSAC's channel weights (the diagonal of M_h).
// CPU reference: runtime/ref_psac.c, runtime/ref_qstats.c.
#pragma once
#include "kvf_qstats.cuh"

namespace kvf_psac {

// Stored basis: bf16 of the statistics' U, zeros where a head has no queries yet.
template <int D, int R>
__device__ __forceinline__ void basis(const u8 *qs, kvf_qstats::layout l, int n_heads, u16 *out) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)n_heads * D * R) return;
    const i64 h = i / (D * R);
    const double cnt = qs ? ((const double *)(qs + l.count))[h] : 0.0;
    out[i] = cnt > 0.0 ? kvf_f32_to_bf16(((const float *)(qs + l.u))[i]) : (u16)0;
}

// w_c = M_h[c][c] (all ones before any query), for QSAC.
template <int D>
__device__ __forceinline__ void weights(const u8 *qs, kvf_qstats::layout l, int n_heads, float *w) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)n_heads * D) return;
    const i64 h = i / D, c = i % D;
    const double cnt = qs ? ((const double *)(qs + l.count))[h] : 0.0;
    w[i] = cnt > 0.0 ? (float)__ddiv_rn((double)((const float *)(qs + l.msum))[(h * D + c) * D + c], cnt) : 1.0f;
}

// One thread per (row, j); R consecutive lanes make a row (R a power of two <= 32).
template <int D, int R>
__device__ __forceinline__ void encode(const float *e, int n_tokens, int n_heads, const u8 *qs, kvf_qstats::layout l,
                                       u8 *packed, u64 basis_off, u64 coef_off, u64 cscale_off) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const bool live = i < (i64)n_tokens * n_heads * R;
    const i64 row = live ? i / R : 0, h = row / n_tokens;
    const int j = (int)(i % R);
    const double cnt = qs ? ((const double *)(qs + l.count))[h] : 0.0;
    const u16 *ub = (const u16 *)(packed + basis_off) + h * D * R;
    const float *er = e + row * D;
    double C = 0.0;
    for (int c = 0; c < D; c++) C = __dadd_rn(C, __dmul_rn((double)er[c], (double)kvf_bf16_to_f32(ub[c * R + j])));
    double cmax = fabs(C);
#pragma unroll
    for (int off = R / 2; off > 0; off >>= 1) cmax = fmax(cmax, __shfl_xor_sync(0xffffffffu, cmax, off));
    u16 cs = kvf_stored_f16(__fdiv_rn((float)cmax, 127.0f));
    const float csf = kvf_f16_to_f32(cs);
    const float code = csf > 0.0f ? kvf_clamp(kvf_rint(__fdiv_rn((float)C, csf)), -127.0f, 127.0f) : 0.0f;
    const double chat = (double)__fmul_rn(csf, code);
    const float lam = cnt > 0.0 ? ((const float *)(qs + l.lambda))[h * R + j] : 0.0f;
    const double dc = __dsub_rn(chat, C);
    double delta = __dmul_rn((double)lam, __dsub_rn(__dmul_rn(dc, dc), __dmul_rn(C, C)));
    // Sum over j in order: gather to the row's first lane.
    double total = 0.0;
    for (int k = 0; k < R; k++) total = __dadd_rn(total, __shfl_sync(0xffffffffu, delta, (threadIdx.x & ~(R - 1)) + k));
    const bool keep = cnt > 0.0 && total < 0.0 && csf > 0.0f;
    if (!live) return;
    ((signed char *)(packed + coef_off))[row * R + j] = keep ? (signed char)(int)code : (signed char)0;
    if (j == 0) ((u16 *)(packed + cscale_off))[row] = keep ? cs : (u16)0;
}

} // namespace kvf_psac

#define KVF_PSAC_KERNELS(PREFIX, D, R)                                                                      \
    extern "C" __global__ void PREFIX##_psac_basis(const u8 *qs, kvf_qstats::layout l, int nh, u16 *out) {  \
        kvf_psac::basis<D, R>(qs, l, nh, out);                                                              \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(256)                                                       \
    PREFIX##_psac_encode(const float *e, int n, int nh, const u8 *qs, kvf_qstats::layout l, u8 *packed,     \
                         u64 basis_off, u64 coef_off, u64 cscale_off) {                                     \
        kvf_psac::encode<D, R>(e, n, nh, qs, l, packed, basis_off, coef_off, cscale_off);                  \
    }

#define KVF_QSAC_WEIGHTS_KERNEL(PREFIX, D)                                                                  \
    extern "C" __global__ void PREFIX##_qsac_weights(const u8 *qs, kvf_qstats::layout l, int nh, float *w) { \
        kvf_psac::weights<D>(qs, l, nh, w);                                                                 \
    }
