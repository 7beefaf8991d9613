// kvforge kernel template: QVG's semantic smoothing (k-means per span, head
// and stage), QuantWM's QSAC assignment, and the residual quantizer of the
// centroid methods (METHODS.md 3 and 1). CPU reference: runtime/ref_kmeans.c,
// runtime/ref_encode.c.
//
// The working vectors e (f32 [H][N][D]) live in a workspace: the rotated input
// for stage 0, the remaining error for later stages. Distances are f64 sums in
// channel order, centroid sums int64 fixed point: the same numbers as the CPU
// reference, in any launch order, and the same bytes run after run.
#pragma once
#include "kvf_quant.cuh"

namespace kvf_kmeans {

constexpr int BLOCK = 256;
constexpr double FIX = 1048576.0; // 2^20
#define KVF_INF64 __longlong_as_double(0x7ff0000000000000LL)

struct ws_args {
    float *e;          // [H][N][D]
    int *idx;          // [H][N] assignment of the last Lloyd step
    long long *acc;    // [H][C][D] fixed-point sums
    int *cnt;          // [H][C]
};

__device__ __forceinline__ u64 splitmix64(u64 z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// e = f32(x), rotated by the normalized Hadamard transform when ROT.
template <int D, int ROT>
__device__ __forceinline__ void prep(const u16 *__restrict__ x, i64 ts, i64 hs, int n_tokens, int n_heads, float *e) {
    constexpr int LPR = D / 8, ROWS = BLOCK / LPR;
    const int lane = threadIdx.x % LPR;
    const i64 row = (i64)blockIdx.x * ROWS + threadIdx.x / LPR;
    const bool live = row < (i64)n_tokens * n_heads;
    const i64 r = live ? row : 0, h = r / n_tokens, t = r % n_tokens;
    float v[8];
    kvf_load8f(x + t * ts + h * hs + lane * 8, v);
    if (ROT) kvf_fwht_row<D>(v, lane);
    if (!live) return;
    float4 *dst = (float4 *)(e + r * D + lane * 8);
    dst[0] = make_float4(v[0], v[1], v[2], v[3]);
    dst[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// Seeded strided sample: centroid j of head h = e of token (o + j*N/C) % N.
template <int D>
__device__ __forceinline__ void init(const float *e, int n_tokens, int n_heads, int c_eff, long long seed, int stage,
                                     u16 *cent, int c_alloc) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; // one (h, j, c)
    if (i >= (i64)n_heads * c_eff * D) return;
    const int c = (int)(i % D), j = (int)((i / D) % c_eff), h = (int)(i / ((i64)D * c_eff));
    const u64 o = splitmix64((u64)seed ^ ((u64)stage << 32) ^ ((u64)h << 40)) % (u64)n_tokens;
    const i64 t = (i64)((o + (u64)j * (u64)n_tokens / (u64)c_eff) % (u64)n_tokens);
    cent[((i64)h * c_alloc + j) * D + c] = kvf_f32_to_bf16(e[((i64)h * n_tokens + t) * D + c]);
}

// f64 distance pieces, channel order (the CPU reference does the same).
template <int D>
__device__ __forceinline__ double plain_dist(const float *es, const u16 *ct, int j, int c_eff, double norm) {
    double dot = 0.0;
#pragma unroll 8
    for (int c = 0; c < D; c++) dot = __dadd_rn(dot, __dmul_rn((double)es[c], (double)kvf_bf16_to_f32(ct[c * c_eff + j])));
    return __dsub_rn(norm, __dmul_rn(2.0, dot));
}

template <int D>
__device__ __forceinline__ double weighted_dist(const float *es, const u16 *ct, int j, int c_eff, const float *w) {
    double acc = 0.0;
#pragma unroll 8
    for (int c = 0; c < D; c++) {
        const double d = __dsub_rn((double)es[c], (double)kvf_bf16_to_f32(ct[c * c_eff + j]));
        acc = __dadd_rn(acc, __dmul_rn((double)w[c], __dmul_rn(d, d)));
    }
    return acc;
}

// Block-wide argmin of (dist, j), ties to the lowest j. Uses red[] scratch.
__device__ __forceinline__ int block_argmin(double d, int j, double *red_d, int *red_j) {
    for (int off = 16; off > 0; off >>= 1) {
        double od = __shfl_down_sync(0xffffffffu, d, off);
        int oj = __shfl_down_sync(0xffffffffu, j, off);
        if (od < d || (od == d && oj < j)) { d = od; j = oj; }
    }
    const int warp = threadIdx.x / 32;
    if ((threadIdx.x & 31) == 0) { red_d[warp] = d; red_j[warp] = j; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < BLOCK / 32; w++)
            if (red_d[w] < red_d[0] || (red_d[w] == red_d[0] && red_j[w] < red_j[0])) { red_d[0] = red_d[w]; red_j[0] = red_j[w]; }
    }
    __syncthreads();
    const int best = red_j[0];
    __syncthreads();
    return best;
}

// Assignment: one block per (head, tile of TOK tokens); thread j owns centroid j
// (C <= 256). Centroids are staged channel-major in shared memory. QSAC > 1
// scores the M nearest by weighted distance with the residual ranges.
template <int D, int G, int QSAC>
__device__ __forceinline__ void assign(const float *e, int n_tokens, int c_eff, const u16 *cent, int c_alloc,
                                       int *idx_ws, u8 *idx_plane, const float *weights) {
    constexpr int TOK = 16;
    extern __shared__ __align__(16) unsigned char smem[];
    u16 *ct = (u16 *)smem;                                   // [D][c_eff]
    float *es = (float *)(smem + (size_t)D * 256 * 2);       // [D]
    float *w = es + D;                                       // [D]
    double *red_d = (double *)(w + D);                       // [8]
    int *red_j = (int *)(red_d + 8);                         // [8]
    double *cand_d = (double *)(red_j + 8);                  // [QSAC] scores
    int *cand_j = (int *)(cand_d + 256);                     // [QSAC]
    const int h = blockIdx.y, j = threadIdx.x;
    const u16 *ch = cent + (i64)h * c_alloc * D;
    for (int i = threadIdx.x; i < c_eff * D; i += BLOCK) ct[(i % D) * c_eff + i / D] = ch[i];
    if (QSAC > 1)
        for (int c = threadIdx.x; c < D; c += BLOCK) w[c] = weights ? weights[(i64)h * D + c] : 1.0f;
    __syncthreads();
    double norm = 0.0;
    if (j < c_eff)
        for (int c = 0; c < D; c++) {
            const double m = (double)kvf_bf16_to_f32(ct[c * c_eff + j]);
            norm = __dadd_rn(norm, __dmul_rn(m, m));
        }
    const int t0 = blockIdx.x * TOK;
    for (int t = t0; t < min(t0 + TOK, n_tokens); t++) {
        const float *er = e + ((i64)h * n_tokens + t) * D;
        for (int c = threadIdx.x; c < D; c += BLOCK) es[c] = er[c];
        __syncthreads();
        int best;
        if (QSAC <= 1) {
            const double d = j < c_eff ? plain_dist<D>(es, ct, j, c_eff, norm) : KVF_INF64;
            best = block_argmin(d, j < c_eff ? j : 0x7fffffff, red_d, red_j);
        } else {
            double d = j < c_eff ? weighted_dist<D>(es, ct, j, c_eff, w) : KVF_INF64;
            const int m = min(QSAC, c_eff);
            for (int k = 0; k < m; k++) { // the m nearest, in (d_Q, j) order
                const int pick = block_argmin(d, j < c_eff ? j : 0x7fffffff, red_d, red_j);
                if (j == pick) d = KVF_INF64;
                if (threadIdx.x == 0) cand_j[k] = pick;
                __syncthreads();
            }
            if (threadIdx.x < m) { // score S of candidate k (METHODS.md 3)
                const int cj = cand_j[threadIdx.x];
                double score = 0.0;
                for (int g = 0; g < D / G; g++) {
                    float lo = 0.0f, hi = 0.0f;
                    double wsum = 0.0;
                    for (int c = g * G; c < (g + 1) * G; c++) {
                        const float r = __fsub_rn(es[c], kvf_bf16_to_f32(ct[c * c_eff + cj]));
                        lo = c == g * G ? r : fminf(lo, r);
                        hi = c == g * G ? r : fmaxf(hi, r);
                        wsum = __dadd_rn(wsum, (double)w[c]);
                    }
                    const double range = (double)__fsub_rn(hi, lo);
                    score = __dadd_rn(score, __dmul_rn(wsum, __dmul_rn(range, range)));
                }
                cand_d[threadIdx.x] = score;
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                int b = 0;
                for (int k = 1; k < m; k++)
                    if (cand_d[k] < cand_d[b]) b = k;
                red_j[0] = cand_j[b];
            }
            __syncthreads();
            best = red_j[0];
        }
        if (threadIdx.x == 0) {
            if (idx_ws) idx_ws[(i64)h * n_tokens + t] = best;
            if (idx_plane) idx_plane[(i64)h * n_tokens + t] = (u8)best;
        }
        __syncthreads();
    }
}

// Lloyd update, step 1: fixed-point sums of each cluster's members.
template <int D>
__device__ __forceinline__ void accumulate(const float *e, const int *idx, int n_tokens, int n_heads, int c_eff,
                                           long long *acc, int *cnt) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; // one (h, t, c)
    if (i >= (i64)n_heads * n_tokens * D) return;
    const int c = (int)(i % D);
    const i64 ht = i / D, h = ht / n_tokens;
    const int z = idx[ht];
    const long long v = __double2ll_rn(__dmul_rn((double)e[i], FIX));
    atomicAdd((unsigned long long *)&acc[(h * c_eff + z) * D + c], (unsigned long long)v);
    if (c == 0) atomicAdd(&cnt[h * c_eff + z], 1);
}

// Step 2: means to bf16 (empty clusters keep theirs); sums reset for the next step.
template <int D>
__device__ __forceinline__ void finalize(int n_heads, int c_eff, long long *acc, int *cnt, u16 *cent, int c_alloc) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; // one (h, j, c)
    if (i >= (i64)n_heads * c_eff * D) return;
    const int c = (int)(i % D);
    const i64 hj = i / D, h = hj / c_eff, j = hj % c_eff;
    const int n = cnt[hj];
    if (n > 0)
        cent[(h * c_alloc + j) * D + c] = kvf_f32_to_bf16((float)__ddiv_rn(__ddiv_rn((double)acc[i], FIX), (double)n));
}

// Zero the sums and counts before a Lloyd update.
template <int D>
__device__ __forceinline__ void reset(int n_heads, int c_eff, long long *acc, int *cnt) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; // one (h, j, c)
    if (i >= (i64)n_heads * c_eff * D) return;
    acc[i] = 0;
    if (i % D == 0) cnt[i / D] = 0;
}

// Rows c_eff..C-1 (span shorter than the centroid count) repeat row 0.
template <int D>
__device__ __forceinline__ void pad(int n_heads, int c_eff, int c_alloc, u16 *cent) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; // one (h, j >= c_eff, c)
    const int extra = c_alloc - c_eff;
    if (i >= (i64)n_heads * extra * D) return;
    const int c = (int)(i % D);
    const i64 hj = i / D, h = hj / extra, j = c_eff + hj % extra;
    cent[(h * c_alloc + j) * D + c] = cent[(h * c_alloc) * D + c];
}

// A stage that is not the last: e <- e - mu[z] (QVG-Pro smooths again).
template <int D, int NCENT>
__device__ __forceinline__ void subtract(float *e, int n_tokens, int n_heads, const u8 *__restrict__ packed,
                                         kvf_quant::stage_planes p) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; // one (row, c)
    if (i >= (i64)n_tokens * n_heads * D) return;
    const i64 row = i / D, h = row / n_tokens;
    const int c = (int)(i % D);
    const u16 mu = ((const u16 *)(packed + p.centroids))[(h * NCENT + packed[p.index + row]) * D + c];
    e[i] = __fsub_rn(e[i], kvf_bf16_to_f32(mu));
}

// Residual quantizer of a stage: r = e - mu[z]; planes; e <- e - (mu + r_hat).
template <int D, int BITS, int G, int MODE, int SFMT, int NCENT, int WRITE_E>
__device__ __forceinline__ void residual(float *e, int n_tokens, int n_heads, u8 *__restrict__ packed,
                                         kvf_quant::stage_planes p) {
    constexpr int LPR = D / 8, LPG = G / 8, ROWS = BLOCK / LPR;
    const int lane = threadIdx.x % LPR;
    const i64 row = (i64)blockIdx.x * ROWS + threadIdx.x / LPR;
    const bool live = row < (i64)n_tokens * n_heads;
    const i64 r = live ? row : 0, h = r / n_tokens;
    float *er = e + r * D + lane * 8;
    float v[8], mu[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    const float4 a = ((const float4 *)er)[0], b = ((const float4 *)er)[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    float res[8];
    if (NCENT) kvf_load8f((const u16 *)(packed + p.centroids) + (h * NCENT + packed[p.index + r]) * D + lane * 8, mu);
#pragma unroll
    for (int i = 0; i < 8; i++) res[i] = NCENT ? __fsub_rn(v[i], mu[i]) : v[i];
    kvf_quant::lane_out o;
    kvf_quant::encode8<BITS, LPG, LPR, MODE, SFMT>(res, o);
    if (!live) return;
    kvf_quant::store_row<D, BITS, G, MODE, SFMT>(packed, p, r, lane, o);
    if (WRITE_E) {
        float rh[8];
        kvf_quant::decode8<BITS, MODE, SFMT>(o.q, o.scale, o.zero, o.tscale, rh);
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = __fsub_rn(v[i], NCENT ? __fadd_rn(mu[i], rh[i]) : rh[i]);
        ((float4 *)er)[0] = make_float4(v[0], v[1], v[2], v[3]);
        ((float4 *)er)[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
}

} // namespace kvf_kmeans

#define KVF_KMEANS_KERNELS(PREFIX, D, ROT, G, QSAC, BITS, MODE, SFMT, NCENT)                                  \
    extern "C" __global__ void __launch_bounds__(kvf_kmeans::BLOCK)                                            \
    PREFIX##_prep(const u16 *x, i64 ts, i64 hs, int n, int nh, float *e) {                                     \
        kvf_kmeans::prep<D, ROT>(x, ts, hs, n, nh, e);                                                         \
    }                                                                                                          \
    extern "C" __global__ void PREFIX##_init(const float *e, int n, int nh, int c_eff, long long seed,         \
                                             int stage, u16 *cent, int c_alloc) {                              \
        kvf_kmeans::init<D>(e, n, nh, c_eff, seed, stage, cent, c_alloc);                                      \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(kvf_kmeans::BLOCK)                                            \
    PREFIX##_assign(const float *e, int n, int c_eff, const u16 *cent, int c_alloc, int *idx_ws, u8 *idx_plane) { \
        kvf_kmeans::assign<D, G, 1>(e, n, c_eff, cent, c_alloc, idx_ws, idx_plane, 0);                         \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(kvf_kmeans::BLOCK)                                            \
    PREFIX##_assign_qsac(const float *e, int n, int c_eff, const u16 *cent, int c_alloc, u8 *idx_plane,       \
                         const float *weights) {                                                               \
        kvf_kmeans::assign<D, G, QSAC>(e, n, c_eff, cent, c_alloc, 0, idx_plane, weights);                     \
    }                                                                                                          \
    extern "C" __global__ void PREFIX##_accumulate(const float *e, const int *idx, int n, int nh, int c_eff,   \
                                                   long long *acc, int *cnt) {                                 \
        kvf_kmeans::accumulate<D>(e, idx, n, nh, c_eff, acc, cnt);                                             \
    }                                                                                                          \
    extern "C" __global__ void PREFIX##_finalize(int nh, int c_eff, long long *acc, int *cnt, u16 *cent,       \
                                                 int c_alloc) {                                                \
        kvf_kmeans::finalize<D>(nh, c_eff, acc, cnt, cent, c_alloc);                                           \
    }                                                                                                          \
    extern "C" __global__ void PREFIX##_reset(int nh, int c_eff, long long *acc, int *cnt) {                   \
        kvf_kmeans::reset<D>(nh, c_eff, acc, cnt);                                                             \
    }                                                                                                          \
    extern "C" __global__ void PREFIX##_pad(int nh, int c_eff, int c_alloc, u16 *cent) {                       \
        kvf_kmeans::pad<D>(nh, c_eff, c_alloc, cent);                                                          \
    }                                                                                                          \
    extern "C" __global__ void PREFIX##_subtract(float *e, int n, int nh, const u8 *packed,                    \
                                                 kvf_quant::stage_planes p) {                                  \
        kvf_kmeans::subtract<D, (NCENT > 0 ? NCENT : 1)>(e, n, nh, packed, p);                                 \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(kvf_kmeans::BLOCK)                                            \
    PREFIX##_residual(float *e, int n, int nh, u8 *packed, kvf_quant::stage_planes p, int write_e) {           \
        if (write_e) kvf_kmeans::residual<D, BITS, G, MODE, SFMT, NCENT, 1>(e, n, nh, packed, p);              \
        else kvf_kmeans::residual<D, BITS, G, MODE, SFMT, NCENT, 0>(e, n, nh, packed, p);                      \
    }
