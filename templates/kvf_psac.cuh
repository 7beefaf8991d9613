// kvforge kernel template: QuantWM's PSAC (METHODS.md 4): the remaining key
// error E (after every stage) projected on the query subspace U_r, stored
// INT8 with an fp16 scale per token, kept only where it lowers the
// query-weighted error; and QSAC's channel weights (the diagonal of M_h).
// CPU reference: runtime/cpu/ref_psac.c, runtime/cpu/ref_qstats.c.
#pragma once
#include "kvf_qstats.cuh"

namespace kvf_psac {

// The stored basis of head blockIdx.x (any block size that is a multiple of
// 32, up to 1024): s = max |u| / 127 over the head's D x R entries (fmaxf from
// 0 leaves NaNs out, as the reference's comparison does; a maximum is the
// same in any order), codes clamp(rint(u / s), -127, 127), NaN: 0. Where the
// head has no queries yet, or s is not finite and positive: zero codes, s = 0.
template <int D, int R>
__device__ __forceinline__ void basis(const u8 *qs, kvf_qstats::layout l, u8 *packed, u64 basis_off, u64 bscale_off) {
    constexpr int N = D * R;
    __shared__ float warp_max[32];
    const int h = blockIdx.x;
    const double cnt = qs ? ((const double *)(qs + l.count))[h] : 0.0;
    const float *u = cnt > 0.0 ? (const float *)(qs + l.u) + (i64)h * N : nullptr;
    float m = 0.0f;
    if (u)
        for (int i = threadIdx.x; i < N; i += blockDim.x) m = fmaxf(m, fabsf(u[i]));
    m = kvf_group_max<32>(m);
    if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
    __syncthreads();
    for (int w = 0; w < (int)blockDim.x / 32; w++) m = fmaxf(m, warp_max[w]);
    const float s = __fdiv_rn(m, 127.0f);
    const bool ok = u && s > 0.0f && s <= 3.40282347e38f;
    signed char *b = (signed char *)(packed + basis_off) + (i64)h * N;
    for (int i = threadIdx.x; i < N; i += blockDim.x) {
        const float q = ok ? __fdiv_rn(u[i], s) : 0.0f;
        b[i] = (signed char)(int)(q != q ? 0.0f : kvf_clamp(kvf_rint(q), -127.0f, 127.0f));
    }
    if (threadIdx.x == 0) ((float *)(packed + bscale_off))[h] = ok ? s : 0.0f;
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

// Most rows (tokens, one per thread) per block of the PSAC encode; any
// block size up to this is correct (runtime/gpu/context.c launches this many).
constexpr int ENCODE_ROWS = KVF_PSAC_ENCODE_ROWS;

// One thread per row of one head (blockIdx.y): C_j = s * sum_c e[c] b[c][j],
// the sum in channel order in f64, as the reference, JC coordinates at a
// time, with the head's basis codes as f64 in shared memory (read by every
// thread at the same address: broadcast). fma is exact here: e[c] (f32)
// times an int8 code needs at most 31 significand bits, so the product is
// exact in f64 and fma rounds once where dmul (exact) then dadd rounded once.
// The row's e is read 16 bytes at a time, once per JC coordinates (not once
// per coordinate), and converted to f64 once per channel.
template <int D, int R>
__device__ __forceinline__ void encode(const float *e, int n_tokens, const u8 *qs, kvf_qstats::layout l, u8 *packed,
                                       u64 basis_off, u64 bscale_off, u64 coef_off, u64 cscale_off) {
    constexpr int JC = R < 8 ? R : 8;
    static_assert(D % 4 == 0 && R % JC == 0, "shape");
    __shared__ double ush[D * JC];
    const int h = blockIdx.y, t = blockIdx.x * blockDim.x + threadIdx.x;
    const bool live = t < n_tokens;
    const i64 row = (i64)h * n_tokens + (live ? t : n_tokens - 1);
    const double cnt = qs ? ((const double *)(qs + l.count))[h] : 0.0;
    const signed char *ub = (const signed char *)(packed + basis_off) + (i64)h * D * R;
    const double bscale = (double)((const float *)(packed + bscale_off))[h];
    const float4 *er = (const float4 *)(e + row * D);
    double C[R];
#pragma unroll
    for (int j0 = 0; j0 < R; j0 += JC) {
        __syncthreads(); // the previous coordinates' basis has been read
        for (int i = threadIdx.x; i < D * JC; i += blockDim.x)
            ush[i] = (double)ub[(i / JC) * R + j0 + i % JC];
        __syncthreads();
        double acc[JC];
#pragma unroll
        for (int j = 0; j < JC; j++) acc[j] = 0.0;
#pragma unroll 2
        for (int c4 = 0; c4 < D / 4; c4++) {
            const float4 v = __ldg(er + c4);
            const float x[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const double xd = (double)x[k];
                const double *u = ush + (4 * c4 + k) * JC;
#pragma unroll
                for (int j = 0; j < JC; j++) acc[j] = __fma_rn(xd, u[j], acc[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < JC; j++) C[j0 + j] = __dmul_rn(bscale, acc[j]);
    }
    // The scale from max_j |C_j| (fmax skips NaNs; NaN only if all are).
    double cmax = fabs(C[0]);
#pragma unroll
    for (int j = 1; j < R; j++) cmax = fmax(cmax, fabs(C[j]));
    const u16 cs = kvf_stored_f16(__fdiv_rn((float)cmax, 127.0f));
    const float csf = kvf_f16_to_f32(cs);
    // delta = sum_j lambda_j ((c_hat_j - C_j)^2 - C_j^2), j in order.
    double total = 0.0;
    u32 words[(R + 3) / 4];
#pragma unroll
    for (int k = 0; k < (R + 3) / 4; k++) words[k] = 0;
#pragma unroll
    for (int j = 0; j < R; j++) {
        const float code = csf > 0.0f ? kvf_clamp(kvf_rint(__fdiv_rn((float)C[j], csf)), -127.0f, 127.0f) : 0.0f;
        const double chat = (double)__fmul_rn(csf, code);
        const float lam = cnt > 0.0 ? ((const float *)(qs + l.lambda))[h * R + j] : 0.0f;
        const double dc = __dsub_rn(chat, C[j]);
        total = __dadd_rn(total, __dmul_rn((double)lam, __dsub_rn(__dmul_rn(dc, dc), __dmul_rn(C[j], C[j]))));
        words[j / 4] |= ((u32)(int)code & 0xffu) << (8 * (j % 4));
    }
    const bool keep = cnt > 0.0 && total < 0.0 && csf > 0.0f;
    if (!live) return;
    u8 *coef = packed + coef_off + row * R;
    if (R % 4 == 0) {
#pragma unroll
        for (int k = 0; k < R / 4; k++) ((u32 *)coef)[k] = keep ? words[k] : 0u;
    } else {
#pragma unroll
        for (int j = 0; j < R; j++) coef[j] = keep ? (u8)(words[0] >> (8 * j)) : (u8)0;
    }
    ((u16 *)(packed + cscale_off))[row] = keep ? cs : (u16)0;
}

} // namespace kvf_psac

#define KVF_PSAC_KERNELS(PREFIX, D, R)                                                                      \
    extern "C" __global__ void PREFIX##_psac_basis(const kvf_psac_basis_params p) {                         \
        kvf_psac::basis<D, R>(p.qs, p.l, p.packed, p.basis_off, p.bscale_off);                              \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(kvf_psac::ENCODE_ROWS)                                     \
    PREFIX##_psac_encode(const kvf_psac_encode_params p) {                                                  \
        kvf_psac::encode<D, R>(p.e, p.n, p.qs, p.l, p.packed, p.basis_off, p.bscale_off, p.coef_off,        \
                               p.cscale_off);                                                               \
    }

#define KVF_QSAC_WEIGHTS_KERNEL(PREFIX, D)                                                                  \
    extern "C" __global__ void PREFIX##_qsac_weights(const kvf_qsac_weights_params p) {                     \
        kvf_psac::weights<D>(p.qs, p.l, p.nh, p.w);                                                         \
    }
