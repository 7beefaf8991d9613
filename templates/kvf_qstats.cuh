// kvforge kernel template: QuantWM's query statistics (METHODS.md 4): per KV
// head the running sum of q q^T over finished chunks' queries (grouped-query
// attention: query head j feeds KV head j / group), and the top-r
// eigenvectors of the mean by orthogonal iteration with modified
// Gram-Schmidt. CPU reference: runtime/ref_qstats.c.
#pragma once
#include "kvf_common.cuh"

namespace kvf_qstats {

struct layout { u64 count, msum, u, lambda; int n_heads, d, r; };

// Header and zeros.
__device__ __forceinline__ void init(u8 *qs, u64 total_bytes, layout l) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    for (u64 k = i; k < total_bytes / 8; k += (u64)gridDim.x * blockDim.x) ((u64 *)qs)[k] = 0;
    if (i == 0) {
        u32 *w = (u32 *)qs;
        w[0] = 0x5146564bu; w[1] = 1u; w[2] = (u32)l.n_heads; w[3] = (u32)l.d; w[4] = (u32)l.r;
    }
}

// msum[h][a][b] += sum over the group's query heads and the tokens of q_a q_b
// (f64, head then token order), one thread per (a, b) of a 16 x 16 tile.
template <int D>
__device__ __forceinline__ void accumulate(const u16 *__restrict__ q, i64 ts, i64 hs, int n_tokens, int group,
                                           u8 *qs, layout l) {
    __shared__ float qa[32][16], qb[32][16];
    const int h = blockIdx.z, ta = blockIdx.y * 16, tb = blockIdx.x * 16;
    const int a = threadIdx.x / 16, b = threadIdx.x % 16;
    double acc = 0.0;
    for (int j = h * group; j < (h + 1) * group; j++)
        for (int t0 = 0; t0 < n_tokens; t0 += 32) {
            for (int k = threadIdx.x; k < 32 * 16; k += 256) {
                const int tt = t0 + k / 16, c = k % 16;
                qa[k / 16][c] = tt < n_tokens ? kvf_bf16_to_f32(q[tt * ts + j * hs + ta + c]) : 0.0f;
                qb[k / 16][c] = tt < n_tokens ? kvf_bf16_to_f32(q[tt * ts + j * hs + tb + c]) : 0.0f;
            }
            __syncthreads();
            const int n = min(32, n_tokens - t0);
            for (int k = 0; k < n; k++) acc = __dadd_rn(acc, __dmul_rn((double)qa[k][a], (double)qb[k][b]));
            __syncthreads();
        }
    float *m = (float *)(qs + l.msum) + ((i64)h * D + ta + a) * D + tb + b;
    *m = (float)__dadd_rn((double)*m, acc);
}

// Deterministic block sum of one value per thread (256 threads).
__device__ __forceinline__ float block_sum(float v, float *red) {
    red[threadIdx.x] = v;
    __syncthreads();
    for (int s = 128; s > 0; s >>= 1) {
        if (threadIdx.x < s) red[threadIdx.x] = __fadd_rn(red[threadIdx.x], red[threadIdx.x + s]);
        __syncthreads();
    }
    const float r = red[0];
    __syncthreads();
    return r;
}

// Modified Gram-Schmidt on the columns of z [D][R] (shared), into u.
template <int D, int R>
__device__ __forceinline__ void mgs(float *z, float *red) {
    const int c = threadIdx.x;
    for (int j = 0; j < R; j++) {
        for (int k = 0; k < j; k++) {
            const float dot = block_sum(c < D ? __fmul_rn(z[c * R + j], z[c * R + k]) : 0.0f, red);
            if (c < D) z[c * R + j] = __fsub_rn(z[c * R + j], __fmul_rn(dot, z[c * R + k]));
            __syncthreads();
        }
        float nrm = sqrtf(block_sum(c < D ? __fmul_rn(z[c * R + j], z[c * R + j]) : 0.0f, red));
        if (!(nrm > 0.0f)) { // a zero column: the unit vector e_j instead, made orthogonal
            if (c < D) z[c * R + j] = c == j ? 1.0f : 0.0f;
            __syncthreads();
            for (int k = 0; k < j; k++) {
                const float dot = block_sum(c < D ? __fmul_rn(z[c * R + j], z[c * R + k]) : 0.0f, red);
                if (c < D) z[c * R + j] = __fsub_rn(z[c * R + j], __fmul_rn(dot, z[c * R + k]));
                __syncthreads();
            }
            nrm = sqrtf(block_sum(c < D ? __fmul_rn(z[c * R + j], z[c * R + j]) : 0.0f, red));
        }
        if (c < D) z[c * R + j] = __fdiv_rn(z[c * R + j], nrm);
        __syncthreads();
    }
}

// z = M u with M = msum / count (f32), serial over b in channel order.
template <int D, int R>
__device__ __forceinline__ void mat_u(const float *msum, double cnt, const float *u, float *z) {
    for (int o = threadIdx.x; o < D * R; o += 256) {
        const int a = o / R, j = o % R;
        double acc = 0.0;
        for (int b = 0; b < D; b++)
            acc = __dadd_rn(acc, __dmul_rn((double)(float)__ddiv_rn((double)msum[a * D + b], cnt), (double)u[b * R + j]));
        z[o] = (float)acc;
    }
    __syncthreads();
}

// Add `added` queries to the count, then refresh U and lambda (one block per head).
template <int D, int R>
__device__ __forceinline__ void eigen(u8 *qs, layout l, double added) {
    constexpr int RA = R > 0 ? R : 1;
    __shared__ float u[D * RA], z[D * RA], red[256], lam[RA];
    const int h = blockIdx.x;
    double *count = (double *)(qs + l.count) + h;
    const double before = *count, now = __dadd_rn(before, added);
    __syncthreads();
    if (threadIdx.x == 0) *count = now;
    if (R == 0 || !(now > 0.0)) return;
    const double cnt = now;
    const float *msum = (const float *)(qs + l.msum) + (i64)h * D * D;
    float *ug = (float *)(qs + l.u) + (i64)h * D * R;
    int iters;
    if (before > 0.0) {
        for (int i = threadIdx.x; i < D * R; i += 256) u[i] = ug[i];
        iters = 6;
    } else {
        for (int i = threadIdx.x; i < D * R; i += 256) {
            const int r = i / R, j = i % R;
            u[i] = __fadd_rn(r == j ? 1.0f : 0.0f, __fdiv_rn(__fmul_rn(0.01f, (float)((r * 7 + j * 13) % 17 - 8)), 8.0f));
        }
        __syncthreads();
        mgs<D, R>(u, red);
        iters = 24;
    }
    __syncthreads();
    for (int it = 0; it < iters; it++) {
        mat_u<D, R>(msum, cnt, u, z);
        mgs<D, R>(z, red);
        for (int i = threadIdx.x; i < D * R; i += 256) u[i] = z[i];
        __syncthreads();
    }
    // Rayleigh quotients, then columns sorted by descending lambda (stable).
    mat_u<D, R>(msum, cnt, u, z);
    for (int j = 0; j < R; j++) {
        const float v = block_sum(threadIdx.x < D ? __fmul_rn(u[threadIdx.x * R + j], z[threadIdx.x * R + j]) : 0.0f, red);
        if (threadIdx.x == 0) lam[j] = v;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int order[RA];
        for (int j = 0; j < R; j++) order[j] = j;
        for (int j = 1; j < R; j++) // insertion sort: stable
            for (int k = j; k > 0 && lam[order[k]] > lam[order[k - 1]]; k--) { int t = order[k]; order[k] = order[k - 1]; order[k - 1] = t; }
        float *lg = (float *)(qs + l.lambda) + (i64)h * R;
        for (int j = 0; j < R; j++) lg[j] = lam[order[j]];
        for (int j = 0; j < R; j++) red[j] = (float)order[j];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < D * R; i += 256) ug[i] = u[(i / R) * R + (int)red[i % R]];
}

} // namespace kvf_qstats

#define KVF_QSTATS_KERNELS(PREFIX, D, R)                                                               \
    extern "C" __global__ void PREFIX##_qstats_init(u8 *qs, u64 total, kvf_qstats::layout l) {          \
        kvf_qstats::init(qs, total, l);                                                                \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256)                                                  \
    PREFIX##_qstats_accumulate(const u16 *q, i64 ts, i64 hs, int n, int group, u8 *qs, kvf_qstats::layout l) { \
        kvf_qstats::accumulate<D>(q, ts, hs, n, group, qs, l);                                         \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256)                                                  \
    PREFIX##_qstats_eigen(u8 *qs, kvf_qstats::layout l, double added) {                                \
        kvf_qstats::eigen<D, R>(qs, l, added);                                                         \
    }
