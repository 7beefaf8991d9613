// kvforge kernel template: QuantWM's query statistics (METHODS.md 4): per KV
// head the running sum of q q^T over finished chunks' queries (grouped-query
// attention: query head j feeds KV head j / group), and the top-r
// eigenvectors of the mean by orthogonal iteration with modified
// Gram-Schmidt. CPU reference: runtime/cpu/ref_qstats.c. A query row (one query
// head's D values of one token) holding a NaN or an Inf is left out of the
// sums and the count and counted in the header's `skipped` (u64 at byte 24).
#pragma once
#include "kvf_common.cuh"

namespace kvf_qstats {

typedef kvf_qstats_planes layout;

// Header and zeros. Thread 0 alone writes the 64 header bytes: were another
// thread to zero one of its words, nothing would order that store and thread
// 0's (even lanes of one warp are not ordered).
__device__ __forceinline__ void init(u8 *qs, u64 total_bytes, layout l) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    for (u64 k = 8 + i; k < total_bytes / 8; k += (u64)gridDim.x * blockDim.x) ((u64 *)qs)[k] = 0;
    if (i == 0) {
        u32 *w = (u32 *)qs;
        for (int k = 5; k < 16; k++) w[k] = 0; // reserved, skipped (bytes 24-31), reserved
        w[0] = 0x5146564bu; w[1] = 2u; w[2] = (u32)l.n_heads; w[3] = (u32)l.d; w[4] = (u32)l.r; // w[1]: KVF_QSTATS_VERSION
    }
}

// Whether the 8 bf16 values of w are finite (NaN and Inf: exponent all ones).
__device__ __forceinline__ bool finite8(uint4 w) {
    const u32 a[4] = {w.x, w.y, w.z, w.w};
    bool ok = true;
    for (int i = 0; i < 4; i++) ok = ok && (a[i] & 0x7f80u) != 0x7f80u && (a[i] & 0x7f800000u) != 0x7f800000u;
    return ok;
}

// Whether a row of D values is all finite (rows are 16-byte aligned: pointer
// and strides are checked on the host).
template <int D>
__device__ __forceinline__ bool row_finite(const u16 *row) {
    bool ok = true;
    for (int i = 0; i < D / 8; i++) ok = ok && finite8(((const uint4 *)row)[i]);
    return ok;
}

// msum[h][a][b] += sum over the group's query heads and the tokens of q_a q_b
// (f64, head then token order). A block takes a 32 x 32 tile of (a, b) and
// each thread a 2 x 2 block of it (ACC_TILE: one staged row serves 32 x 32
// products, and the rows' finiteness is checked once per tile rather than
// once per 16 x 16 tile). Only tiles on or above the diagonal are launched:
// the sum for (b, a) is the one for (a, b) (the products commute exactly, in
// the same order), so an off-diagonal tile adds it to both elements, each to
// its own old value, as the CPU adds its mirrored sums. Rows that are not
// finite load as zeros: their products are +0 and leave the sum as it is (it
// starts at +0 and never becomes -0), as the CPU's skipping. The staged
// values are f64 already (converted once per element, not once per
// product: f32 -> f64 conversions run at a quarter of the f64 fma rate),
// and fma(qa, qb, acc) is the CPU's acc + qa * qb: the product of two bf16
// values is exact in f64.
constexpr int ACC_TILE = KVF_QSTATS_TILE;
// runtime/gpu/context.c launches (acc_grid<D>::TILES, heads) blocks of 256 threads.
template <int D> struct acc_grid {
    static constexpr int SIDE = D / ACC_TILE, TILES = SIDE * (SIDE + 1) / 2;
};
// One round's global loads of a thread: row k = threadIdx.x / 8 of the
// round's T tokens, piece `part` = threadIdx.x % 8 of it: its share of the
// row for the NaN/Inf check (uint4 pieces part, part + 8, ..) and its 4
// values of each tile's 32 columns.
template <int D> struct acc_round {
    uint4 chk[D / 64];
    uint2 a, b;
    bool live;
};

template <int D>
__device__ __forceinline__ void acc_load(const u16 *__restrict__ q, i64 ts, i64 hs, int n_tokens, int j, int t0,
                                         int ta, int tb, acc_round<D> &in) {
    const int k = threadIdx.x / 8, part = threadIdx.x % 8, tt = t0 + k;
    in.live = tt < n_tokens;
    const u16 *row = q + (i64)min(tt, n_tokens - 1) * ts + (i64)j * hs; // rows are 16-byte aligned (host check)
#pragma unroll
    for (int i = 0; i < D / 64; i++) in.chk[i] = ((const uint4 *)row)[part + 8 * i];
    in.a = *(const uint2 *)(row + ta + part * 4);
    in.b = *(const uint2 *)(row + tb + part * 4);
}

// Four bf16 values (lowest first) as f64, or zeros.
__device__ __forceinline__ void bf16x4_f64(uint2 w, bool ok, double *out) {
    const u32 v[2] = {w.x, w.y};
#pragma unroll
    for (int e = 0; e < 2; e++) {
        out[2 * e] = ok ? (double)kvf_bf16_lo(v[e]) : 0.0;
        out[2 * e + 1] = ok ? (double)kvf_bf16_hi(v[e]) : 0.0;
    }
}

template <int D>
__device__ __forceinline__ void accumulate(const u16 *__restrict__ q, i64 ts, i64 hs, int n_tokens, int group,
                                           u8 *qs, layout l) {
    constexpr int T = ACC_TILE; // also the tokens staged per round
    static_assert(D % 64 == 0 && D <= 256, "head_dim is 64, 128 or 256");
    static_assert(T == 32, "256 threads: 8 per staged row (4 columns each), 2 x 2 of the tile each");
    if (gridDim.x != (unsigned)acc_grid<D>::TILES || blockDim.x != 256) __trap(); // the launch disagrees with this file
    __shared__ __align__(16) double qa[T][T], qb[T][T];
    int ya = 0, xb = blockIdx.x; // tile (ya, ya + xb'): row ya of the upper triangle
    while (xb >= acc_grid<D>::SIDE - ya) xb -= acc_grid<D>::SIDE - ya++;
    const int h = blockIdx.y, ta = ya * T, tb = (ya + xb) * T;
    const int a = 2 * (threadIdx.x / 16), b = 2 * (threadIdx.x % 16);
    const int k = threadIdx.x / 8, part = threadIdx.x % 8;
    double acc[2][2] = {{0.0, 0.0}, {0.0, 0.0}};
    int used = 0; // a row of this thread's staging was finite
    // Rounds: query heads h*group.. in order, then T tokens at a time (the
    // CPU's order); each round's loads are issued before the previous
    // round's products.
    const int per_head = (n_tokens + T - 1) / T, rounds = per_head * group;
    acc_round<D> in;
    if (rounds > 0) acc_load<D>(q, ts, hs, n_tokens, h * group, 0, ta, tb, in);
    for (int r = 0; r < rounds; r++) {
        const int t0 = (r % per_head) * T;
        { // stage: a row that holds a NaN or an Inf (or is past the end) loads as zeros
            bool f = in.live;
#pragma unroll
            for (int i = 0; i < D / 64; i++) f = f && finite8(in.chk[i]);
            const unsigned m = __ballot_sync(0xffffffffu, f) >> (threadIdx.x % 32 / 8 * 8); // the row's 8 lanes
            const bool ok = (m & 0xffu) == 0xffu;
            used |= ok;
            double va[4], vb[4];
            bf16x4_f64(in.a, ok, va);
            bf16x4_f64(in.b, ok, vb);
            *(double2 *)&qa[k][part * 4] = make_double2(va[0], va[1]);
            *(double2 *)&qa[k][part * 4 + 2] = make_double2(va[2], va[3]);
            *(double2 *)&qb[k][part * 4] = make_double2(vb[0], vb[1]);
            *(double2 *)&qb[k][part * 4 + 2] = make_double2(vb[2], vb[3]);
        }
        __syncthreads();
        if (r + 1 < rounds) acc_load<D>(q, ts, hs, n_tokens, h * group + (r + 1) / per_head, ((r + 1) % per_head) * T, ta, tb, in);
        const int n = min(T, n_tokens - t0);
        for (int kk = 0; kk < n; kk++) {
            const double2 x = *(const double2 *)&qa[kk][a], y = *(const double2 *)&qb[kk][b];
            acc[0][0] = __fma_rn(x.x, y.x, acc[0][0]);
            acc[0][1] = __fma_rn(x.x, y.y, acc[0][1]);
            acc[1][0] = __fma_rn(x.y, y.x, acc[1][0]);
            acc[1][1] = __fma_rn(x.y, y.y, acc[1][1]);
        }
        __syncthreads();
    }
    // A head that got no finite row keeps its sums as they are, bit for bit
    // (the CPU skips it; adding +0 would turn a -0 into +0).
    if (!__syncthreads_or(used)) return;
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int c = 0; c < 2; c++) {
            float *m = (float *)(qs + l.msum) + (i64)h * D * D;
            float *ab = m + (i64)(ta + a + i) * D + tb + b + c, *ba = m + (i64)(tb + b + c) * D + ta + a + i;
            *ab = (float)__dadd_rn((double)*ab, acc[i][c]);
            if (ta != tb) *ba = (float)__dadd_rn((double)*ba, acc[i][c]);
        }
}

// Deterministic block sum of one value per thread (256 threads): a fixed
// shuffle tree per warp, then the 8 warp sums in order, read by every thread
// (two barriers instead of a shared-memory tree's nine).
__device__ __forceinline__ float block_sum(float v, float *red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_down_sync(0xffffffffu, v, o));
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
    __syncthreads();
    float r = red[0];
#pragma unroll
    for (int w = 1; w < 8; w++) r = __fadd_rn(r, red[w]);
    __syncthreads(); // red is reused by the next sum
    return r;
}

// Column j of z [D][R] (shared) minus its projections on columns 0..j-1, in
// order; returns its norm. Thread c reads and writes row c of z only.
template <int D, int R>
__device__ __forceinline__ float mgs_column(float *z, int j, float *red) {
    static_assert(D <= 256, "a row of z per thread");
    const int c = threadIdx.x;
    for (int k = 0; k < j; k++) {
        const float dot = block_sum(c < D ? __fmul_rn(z[c * R + j], z[c * R + k]) : 0.0f, red);
        if (c < D) z[c * R + j] = __fsub_rn(z[c * R + j], __fmul_rn(dot, z[c * R + k]));
    }
    return sqrtf(block_sum(c < D ? __fmul_rn(z[c * R + j], z[c * R + j]) : 0.0f, red));
}

// Modified Gram-Schmidt on the columns of z [D][R] (shared), in place.
template <int D, int R>
__device__ __forceinline__ void mgs(float *z, float *red) {
    const int c = threadIdx.x;
    for (int j = 0; j < R; j++) {
        float nrm = mgs_column<D, R>(z, j, red);
        if (!(nrm > 0.0f)) { // a zero column: the unit vector e_j instead, made orthogonal
            if (c < D) z[c * R + j] = c == j ? 1.0f : 0.0f;
            __syncthreads();
            nrm = mgs_column<D, R>(z, j, red);
        }
        if (c < D) z[c * R + j] = __fdiv_rn(z[c * R + j], nrm);
        __syncthreads();
    }
}

// z = M u with M = msum / count (f32), serial over b in channel order. One
// thread per row a and JC columns at a time (JC independent f64 chains), so
// each M[a][b] is divided once per JC columns, not once per column. fma is
// the dadd + dmul of the sum: the product of two f32 values is exact in f64.
template <int D, int R>
__device__ __forceinline__ void mat_u(const float *msum, double cnt, const float *u, float *z) {
    constexpr int JC = R <= 0 ? 1 : R < 8 ? R : 8;
    for (int o = threadIdx.x; o < D * (R / JC); o += blockDim.x) {
        const int a = o % D, j0 = o / D * JC;
        const float *ma = msum + (i64)a * D;
        double acc[JC];
#pragma unroll
        for (int j = 0; j < JC; j++) acc[j] = 0.0;
        for (int b = 0; b < D; b++) {
            const double m = (double)(float)__ddiv_rn((double)ma[b], cnt);
#pragma unroll
            for (int j = 0; j < JC; j++) acc[j] = __fma_rn(m, (double)u[b * R + j0 + j], acc[j]);
        }
#pragma unroll
        for (int j = 0; j < JC; j++) z[a * R + j0 + j] = (float)acc[j];
    }
    __syncthreads();
}

// Add the chunk's finite query rows to the count and the others to the
// header's `skipped`, then refresh U and lambda (one block per KV head); a head
// that got no row keeps its count, U and lambda.
template <int D, int R>
__device__ __forceinline__ void eigen(u8 *qs, layout l, const u16 *__restrict__ q, i64 ts, i64 hs, int n_tokens,
                                      int group) {
    constexpr int RA = R > 0 ? R : 1; // R, or 1 at R = 0 (its code past the early return is dead: no division by 0)
    __shared__ float u[D * RA], z[D * RA], red[256], lam[RA];
    if (blockDim.x != 256) __trap(); // block_sum and the row-per-thread steps assume 256 threads
    __shared__ unsigned long long used_sh;
    const int h = blockIdx.x;
    if (threadIdx.x == 0) used_sh = 0;
    __syncthreads();
    const long long rows = (long long)n_tokens * group;
    unsigned long long mine = 0;
    for (long long i = threadIdx.x; i < rows; i += 256) // rows of heads h*group.., then tokens
        mine += row_finite<D>(q + (i % n_tokens) * ts + (h * group + i / n_tokens) * hs);
    atomicAdd(&used_sh, mine); // integer: the same total in any order
    __syncthreads();
    const unsigned long long used = used_sh;
    double *count = (double *)(qs + l.count) + h;
    const double before = *count, now = __dadd_rn(before, (double)used);
    __syncthreads();
    if (threadIdx.x == 0) {
        if (used > 0) *count = now;
        if (used < (unsigned long long)rows) atomicAdd((unsigned long long *)(qs + 24), (unsigned long long)rows - used);
    }
    if (R == 0 || used == 0 || !(now > 0.0)) return;
    const double cnt = now;
    const float *msum = (const float *)(qs + l.msum) + (i64)h * D * D;
    float *ug = (float *)(qs + l.u) + (i64)h * D * R;
    int iters;
    if (before > 0.0) {
        for (int i = threadIdx.x; i < D * R; i += 256) u[i] = ug[i];
        iters = 6;
    } else {
        for (int i = threadIdx.x; i < D * R; i += 256) {
            const int r = i / RA, j = i % RA;
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
    for (int i = threadIdx.x; i < D * R; i += 256) ug[i] = u[(i / RA) * RA + (int)red[i % RA]];
}

} // namespace kvf_qstats

#define KVF_QSTATS_KERNELS(PREFIX, D, R)                                                               \
    extern "C" __global__ void PREFIX##_qstats_init(const kvf_qstats_init_params p) {                  \
        kvf_qstats::init(p.qs, p.total, p.l);                                                          \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256)                                                  \
    PREFIX##_qstats_accumulate(const kvf_qstats_update_params p) {                                     \
        kvf_qstats::accumulate<D>(p.q.x, p.q.ts, p.q.hs, p.n, p.group, p.qs, p.l);                     \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256)                                                  \
    PREFIX##_qstats_eigen(const kvf_qstats_update_params p) {                                          \
        kvf_qstats::eigen<D, R>(p.qs, p.l, p.q.x, p.q.ts, p.q.hs, p.n, p.group);                       \
    }
