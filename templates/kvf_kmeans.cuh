// kvforge kernel template: QVG's semantic smoothing (k-means per span, head
// and stage), QuantWM's QSAC assignment, and the residual quantizer of the
// centroid methods (METHODS.md 3 and 1). CPU reference: runtime/cpu/ref_kmeans.c,
// runtime/cpu/ref_encode.c.
//
// The working vectors of a stage are rows of a source: the BF16 input itself
// (BF = 1: stage 0 of an unrotated single-stage scheme, no copy made), or the
// f32 workspace e [H][N][D] (the rotated input for stage 0, the remaining
// error for later stages). Row (h, t) starts at src + t*ts + h*hs elements
// (the workspace: ts = D, hs = N*D). Distances are f64 sums in channel order,
// centroid sums int64 fixed point: the same numbers as the CPU reference, in
// any launch order, and the same bytes run after run.
#pragma once
#include "kvf_pipeline.cuh"

namespace kvf_kmeans {

constexpr int BLOCK = KVF_BLOCK; // kvf_abi.h: the host sizes grids with it
constexpr double FIX = 1048576.0; // 2^20
#define KVF_INF64 __longlong_as_double(0x7ff0000000000000LL)

// Row (h, t) of a source, and its channels as floats (BF16 to f32 is exact).
template <bool BF>
__device__ __forceinline__ const void *src_row(const void *src, i64 ts, i64 hs, int h, int t) {
    const i64 o = (i64)t * ts + (i64)h * hs;
    return BF ? (const void *)((const u16 *)src + o) : (const void *)((const float *)src + o);
}
template <bool BF> __device__ __forceinline__ float ld1(const void *row, int c) {
    return BF ? kvf_bf16_to_f32(((const u16 *)row)[c]) : ((const float *)row)[c];
}
template <bool BF> __device__ __forceinline__ float2 ld2(const void *row, int c) {
    if (BF) {
        const u32 w = *(const u32 *)((const u16 *)row + c);
        return make_float2(kvf_bf16_lo(w), kvf_bf16_hi(w));
    }
    return *(const float2 *)((const float *)row + c);
}
template <bool BF> __device__ __forceinline__ void ld8(const void *row, int c, float (&v)[8]) {
    if (BF) {
        kvf_load8f((const u16 *)row + c, v);
        return;
    }
    const float4 a = *(const float4 *)((const float *)row + c), b = *(const float4 *)((const float *)row + c + 4);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
template <bool BF> __device__ __forceinline__ void ld16(const void *row, int c, float (&v)[16]) {
    float a[8], b[8];
    ld8<BF>(row, c, a);
    ld8<BF>(row, c + 8, b);
#pragma unroll
    for (int i = 0; i < 8; i++) { v[i] = a[i]; v[8 + i] = b[i]; }
}

__device__ __forceinline__ u64 splitmix64(u64 z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// e = f32(x), rotated by the normalized Hadamard transform when ROT; with the
// pipeline (kvf_pipeline.cuh: AB an anchor, FB the carried error) less the
// anchor's row and plus decay times the carried error, as the reference.
template <int D, int ROT, int AB, int G, int FB>
__device__ __forceinline__ void prep(const u16 *__restrict__ x, i64 ts, i64 hs, int n_tokens, int n_heads, float *e,
                                     const kvf_pipe_io &pipe) {
    constexpr int LPR = D / 8, ROWS = BLOCK / LPR;
    const int lane = threadIdx.x % LPR;
    const i64 row = (i64)blockIdx.x * ROWS + threadIdx.x / LPR;
    const bool live = row < (i64)n_tokens * n_heads;
    const i64 r = live ? row : 0, h = r / n_tokens, t = r % n_tokens;
    float v[8];
    kvf_load8f(x + t * ts + h * hs + lane * 8, v);
    if (ROT) kvf_fwht_row<D>(v, lane);
    if (AB && pipe.anchor.packed) {
        float a[8];
        kvf_pipe::anchor8<D, AB, G>(pipe.anchor, (u64)h * pipe.anchor.tokens + (u64)(t % pipe.anchor.tokens), lane * 8, a);
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = __fsub_rn(v[i], a[i]);
    }
    if (FB && pipe.fb && pipe.fb_in) {
        const float *f = pipe.fb + r * D + lane * 8;
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = __fadd_rn(v[i], __fmul_rn(pipe.decay, f[i]));
    }
    if (!live) return;
    float4 *dst = (float4 *)(e + r * D + lane * 8);
    dst[0] = make_float4(v[0], v[1], v[2], v[3]);
    dst[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// Whether a bf16 row of D values (16-byte aligned) holds no NaN or Inf.
template <int D> __device__ __forceinline__ bool finite_row(const u16 *row) {
    bool ok = true;
#pragma unroll 4
    for (int k = 0; k < D; k += 8) {
        const uint4 v = *(const uint4 *)(row + k);
        const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int e = 0; e < 4; e++) ok &= (w[e] & 0x7f80u) != 0x7f80u && (w[e] & 0x7f800000u) != 0x7f800000u;
    }
    return ok;
}

// Seeded strided sample: centroid j of head h = the row of token (o + j*N/C) % N.
// Warm start (kvf_encode_warm; warm 0: none): rows j < c_warm are instead the
// previous span's table's (warm, c_alloc rows a head), each where it holds no
// NaN or Inf (ref_kmeans.c kvf_ref_kmeans_warm's rule).
template <int D, bool BF>
__device__ __forceinline__ void init(const void *src, i64 ts, i64 hs, int n_tokens, int n_heads, int c_eff,
                                     long long seed, int stage, u16 *cent, int c_alloc, const u16 *warm,
                                     int c_warm) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; // one (h, j, c)
    if (i >= (i64)n_heads * c_eff * D) return;
    const int c = (int)(i % D), j = (int)((i / D) % c_eff), h = (int)(i / ((i64)D * c_eff));
    if (j < c_warm) {
        const u16 *w = warm + ((i64)h * c_alloc + j) * D;
        if (finite_row<D>(w)) {
            cent[((i64)h * c_alloc + j) * D + c] = w[c];
            return;
        }
    }
    const u64 o = splitmix64((u64)seed ^ ((u64)stage << 32) ^ ((u64)h << 40)) % (u64)n_tokens;
    const int t = (int)((o + (u64)j * (u64)n_tokens / (u64)c_eff) % (u64)n_tokens);
    cent[((i64)h * c_alloc + j) * D + c] = kvf_f32_to_bf16(ld1<BF>(src_row<BF>(src, ts, hs, h, t), c));
}

// ------------------------------------------------------------ assignment
//
// Nearest centroid (and QSAC's M nearest by the query-weighted distance) for
// every token, the same index as the CPU reference bit for bit, with the
// distance GEMM on the tensor cores (METHODS.md 3, "exact assignment through
// a tensor-core filter"):
//  1. filter: h_j = N_j / 2 - <a, mu_j> (half the squared distance less
//     |a|^2 / 2) for all j with BF16 mma (a = e, or w*e for QSAC, split
//     a = hi + lo into two BF16 parts, both negated; mu_j is BF16 already),
//     f32 accumulation starting from N_j / 2, so the mma output is h_j. With
//     S = |a| max|mu| >= sum |a_k mu_k|: the split leaves 2^-18 S; each of
//     the 2 x D/16 chained mma adds its 16 exact products and the running
//     sum (|.| <= S + max|N| / 2) within 2^-19 (S + max|N| / 2) (alignment
//     to the largest term, truncated to f32's 24 bits, plus the final
//     rounding: the model measured on V100/T4/A100 by Fasi et al. 2021),
//     2^-15 (S + max|N| / 2) in all at D = 128; the rounding of N_j 2^-25
//     max|N|. The lists hold score keys (score_key: j in the low 8 mantissa
//     bits), within 255 ulp < 2^-15 |h_j| of h_j, |h_j| <= S + max|N| / 2:
//     another 2^-15 (S + max|N| / 2). So |key_j - exact h_j| < 2^-13.9
//     (S + max|N|), and B / 2 with B = KAPPA (S + max|N|), KAPPA = 2^-12,
//     keeps a factor 1.87 to spare (at D = 256, with 32 chained mma: 1.28).
//     |a| max|mu| + max|N| / 2 stays below 2^125 (else the bound is taken as
//     infinite, below), so |h_j| < 2^126: no key is Inf or NaN, and
//     past-the-end centroids (N_j / 2 = 2^126, rows of zeros) key above all;
//  2. every j with key_j <= (M-th smallest key) + B is a candidate (within
//     2B in squared distance): the exact M nearest are among them. Per
//     thread the K smallest keys are kept; a token whose lists may have
//     dropped a candidate is filtered again, collecting every j whose h_j is
//     under its threshold;
//  3. the candidates' f64 distances in channel order, as ref_kmeans.c, pick
//     the result by the CPU's rule.
// Tokens whose bound is not finite (NaN/Inf inputs or centroids, or |a|
// max|mu| + max|N| / 2 >= 2^125) or with more than CAP candidates take a
// full f64 scan with the CPU's sequential rule (NaN handling included).
constexpr int MAX_C = 256;      // centroids a section may have (the u8 index plane)
constexpr int TPW = 16;         // tokens per warp (one m16 tile)
constexpr int CAP = 32;         // candidates per token before the full scan
constexpr float KAPPA = 2.44140625e-4f; // 2^-12

// n8 column tiles a filter step: independent mma chains. 8 for the nearest
// centroid over a BF16 source (one mma a tile and k-step; qvg_int2's encode
// 2.937 -> 2.913 ms against 4 on the H200, means of 3 runs); 4 for QSAC
// (quantwm_int2's encode 1.4% slower with every assignment at 8, its V's
// included; 124 registers then, 121 since session 13, under the cap of 128) and over an f32
// source (two mma a step where the low halves are not zero; qvg_pro_int2's
// encode 37.8 ms at 8 against 37.0 at 4 in two device runs, 128 registers
// against 120; docs/BENCHMARKS.md, session 10).
template <int M, bool BF> __host__ __device__ constexpr int filter_tiles() { return M == 1 && BF ? 8 : 4; }

// Per-warp shared scratch (its size reaches runtime/gpu/context.c through
// assign_cfg); K: the keys a thread keeps per token (assign_lists).
template <int M, int K> struct assign_warp {
    union {
        double cd[TPW][CAP];    // candidates' exact distances
        double scr[MAX_C];      // full scan (after the candidates are done): every centroid's exact distance
    };
    double fd[M], fs[M];        // full scan: the M nearest, their sensitivity scores
    double sv[TPW][M > 1 ? 8 : 1]; // sensitivity scores of the M nearest (filtered path)
    float ls[TPW][4][K];        // each thread's K smallest score keys
    float an[TPW];              // |a| of the token
    float thr[TPW];             // candidate threshold
    int nc[TPW];                // candidates; -1 full scan, -2 filter again
    int off[TPW];               // first candidate of the token in the warp's flat order
    int again[TPW];             // filtered again
    int cj[TPW][CAP];
    int pk[TPW][M > 1 ? 8 : 1]; // the M nearest (filtered path)
    int fj[M];
};

// The most dynamic shared memory a block may opt into on the arch compiled
// for (the CUDA C++ Programming Guide's table of compute capabilities):
// 227 KiB on sm_90, sm_100 and sm_103, 163 KiB on sm_80 and sm_87, 99 KiB on
// sm_86, sm_89 and sm_12x, and 99 KiB assumed for an arch this table does
// not name (sm_88, sm_110, later ones: a smaller block runs, a larger one
// would not). runtime/gpu/context.c checks the device's own figure before any
// launch (a PTX image of another arch, a device below its arch's figure).
__host__ __device__ constexpr int smem_optin_bytes() {
#ifdef __CUDA_ARCH__
    return __CUDA_ARCH__ == 900 || __CUDA_ARCH__ == 1000 || __CUDA_ARCH__ == 1030 ? 232448
           : __CUDA_ARCH__ == 800 || __CUDA_ARCH__ == 870                        ? 166912
                                                                                 : 101376;
#else
    return 101376;
#endif
}

// Centroid row pitch (bf16): conflict-free 8-byte B-fragment loads.
template <int D> __host__ __device__ constexpr int assign_pitch() { return D + 16; }
// One warp's scratch, rounded to 16 bytes.
template <int M, int K> __host__ __device__ constexpr int assign_warp_bytes() {
    return (int)((sizeof(assign_warp<M, K>) + 15) / 16 * 16);
}

// The fast assignment's per-warp scratch (assign_fast): QSAC's only; the
// nearest centroid settles each token in registers and needs none.
template <int M> struct fast_warp {
    float ls[TPW][4][M]; // each thread's M smallest score keys (fast_key)
    double sv[TPW][M];   // sensitivity scores of the M nearest
    int pk[TPW][M];      // the M nearest, ascending (score key)
    int nc[TPW];         // how many of them (0: past the end)
};
template <int M, int K, bool EXACT> __host__ __device__ constexpr int warp_bytes() {
    return EXACT ? assign_warp_bytes<M, K>() : M > 1 ? (int)((sizeof(fast_warp<M>) + 15) / 16 * 16) : 0;
}

// The assignment's block shared memory, byte offsets: MAX_C centroid rows
// (permuted, pitch assign_pitch), N_j / 2 (f32 pairs of columns, twice: a
// float4 per 2 columns), the weights, QSAC's group weight sums, the exact
// norms (nearest centroid only, exact assignment only), the bound's limits
// and the head being assigned (cur[]: 32 bytes in all), then each warp's
// scratch. assign and assign_fast carve their block up by these, and
// assign_smem_with sizes it.
template <int D, int M, bool EXACT = true> struct assign_layout {
    static constexpr int CENT = 0;
    static constexpr int NH = CENT + MAX_C * assign_pitch<D>() * 2;
    static constexpr int WV = NH + MAX_C * 8;
    static constexpr int GW = WV + D * 4;
    static constexpr int NN = GW + 32 * 8;
    static constexpr int LIM = NN + (EXACT && M == 1 ? MAX_C * 8 : 0);
    static constexpr int WARPS = LIM + 32;
};

// The block's shared bytes with `warps` warps' scratch (K keys a list).
template <int D, int M, int K, bool EXACT = true> __host__ __device__ constexpr int assign_smem_with(int warps) {
    return assign_layout<D, M, EXACT>::WARPS + warps * warp_bytes<M, K, EXACT>();
}

// Warps per block with K keys a list: 16 up to D = 128 (the registers stay
// within the launch bounds of 512 threads without a spill on sm_90: 123 for
// the nearest centroid over a BF16 source (8 filter tiles; 120 with 2 keys a
// list, before session 16), 118 over f32 with the low halves (122 before),
// 121 for QSAC (NVRTC 13.0, since session 13's head ranges), whose 9,360
// bytes of scratch a warp make it 221 of 227 KiB; against 8 warps,
// quantwm_int2's encode 4.06 -> 3.85 ms and qvg_pro_int2's 44.3 -> 37.4-37.5
// ms on the H200), 4 at D = 256 (chosen when its centroid rows filled shared
// memory; sm_90 would now hold 8, not measured); fewer where the arch's
// shared memory holds fewer (QSAC with M >= 6 on sm_90, most sections on
// sm_80 and 99 KiB archs; 0: none fits, refused below). test_nvrtc requires
// the assignment kernels to compile without a spill (QSAC M = 8 over an f32
// source included).
template <int D, int M, int K, bool EXACT = true> __host__ __device__ constexpr int assign_warps_with() {
    int w = D <= 128 ? 16 : 4;
    while (w > 0 && assign_smem_with<D, M, K, EXACT>(w) > smem_optin_bytes()) w--;
    return w;
}

// The keys a thread keeps per token: the exact assignment's below; the fast
// one keeps the M smallest (QSAC) or the smallest score with its index (the
// nearest centroid, K = 1: assign_fast).
template <int D, int M, bool EXACT = true> struct assign_lists {
    static constexpr int MF = M <= 8 ? M : 1; // the filter runs for M <= 8; larger M scans fully
    // Per-thread best kept per token: one more than M shows a drop, which
    // sends the tile's filter around again. The nearest centroid keeps 3
    // where that costs no warp a block (every head_dim on sm_90; on sm_80, 2
    // at head_dim 128 and 256, whose 12 and 3 warps would drop to 11 and 2,
    // not measured): with 2, a token whose two candidates fell in one
    // thread's columns was filtered again, the whole tile's tensor work a
    // second time. On the H200 (docs/BENCHMARKS.md, session 16) 3 took the
    // tokens filtered twice from 0.422% to 0.002% (bench layer) and 2.28% to
    // 0.10% (the world-model dump's K and V), and qvg_int2's encode from
    // 2.16-2.18 to 2.13-2.14 ms and 2.39-2.40 to 2.21-2.24 ms.
    static constexpr int K = !EXACT ? MF
                             : M == 1 && assign_warps_with<D, 1, 3>() == assign_warps_with<D, 1, 2>() ? 3
                                                                                                   : MF + 1;
};
template <int D, int M, bool EXACT = true> __host__ __device__ constexpr int assign_warps() {
    return assign_warps_with<D, M, assign_lists<D, M, EXACT>::K, EXACT>();
}
template <int D, int M, bool EXACT = true> __host__ __device__ constexpr int assign_smem_bytes() {
    return assign_smem_with<D, M, assign_lists<D, M, EXACT>::K, EXACT>(assign_warps<D, M, EXACT>());
}

// a = hi + lo + O(2^-18 |a|): both halves as packed BF16 pairs (x0 -> bits 0..15).
__device__ __forceinline__ void split_pair(float x0, float x1, u32 &hi, u32 &lo) {
    hi = kvf_cvt_bf16x2(x0, x1);
    const float h0 = kvf_bf16_lo(hi), h1 = kvf_bf16_hi(hi);
    lo = kvf_cvt_bf16x2(__fsub_rn(x0, h0), __fsub_rn(x1, h1));
}

__device__ __forceinline__ void mma_bf16(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// d = a b + c: the first step of a chain.
__device__ __forceinline__ void mma_bf16_from(float d[4], const u32 a[4], u32 b0, u32 b1, float4 c) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c.x), "f"(c.y), "f"(c.z), "f"(c.w));
}

// Shared centroid rows are stored with each 16-channel k-block permuted so a
// lane's two B registers (channels 2q, 2q+1 and 2q+8, 2q+9) are one 8-byte
// load: position 4q + r holds channel 2q + r (r < 2) or 2q + 6 + r.
__device__ __forceinline__ int kblock_channel(int p) {
    const int q = (p & 15) >> 2, r = p & 3;
    return (p & ~15) + 2 * q + (r < 2 ? r : 6 + r);
}

// A filtered score with its centroid index in the low 8 mantissa bits: one
// float that min/max order (within 255 ulp = 2^-15 relative of the score,
// covered by the bound, see assign). The lists' contents matter only where
// the bound is finite, and there the scores are (a token whose scores may not
// be has an infinite bound and takes the full scan, whatever its lists hold).
__device__ __forceinline__ float score_key(float s, int j) {
    return __uint_as_float((__float_as_uint(s) & 0xffffff00u) | (u32)j);
}
__device__ __forceinline__ int key_index(float key) { return (int)(__float_as_uint(key) & 0xffu); }

// Keep the K smallest keys, ascending (an insertion network of min/max).
template <int K>
__device__ __forceinline__ void keep_k(float (&bs)[K], float key) {
#pragma unroll
    for (int i = 0; i < K; i++) {
        const float t = fmaxf(bs[i], key);
        bs[i] = fminf(bs[i], key);
        key = t;
    }
}

// The CPU's distances (ref_kmeans.c), f64 in channel order. Products of an
// f32 and a bf16 are exact in f64, so the fma is the CPU's multiply-add. The
// row x comes from the source 16 channels per load; the centroid from its
// permuted shared row (kblock_channel): of a 16-channel block's 8 words, word
// 2q holds channels 2q, 2q+1 and word 2q+1 channels 2q+8, 2q+9.
__device__ __forceinline__ void mu16(const u16 *crow, int kb, float (&m)[16]) {
    const uint4 a = *(const uint4 *)(crow + kb * 16), b = *(const uint4 *)(crow + kb * 16 + 8);
    const u32 w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int q = 0; q < 4; q++) {
        m[2 * q] = kvf_bf16_lo(w[2 * q]);
        m[2 * q + 1] = kvf_bf16_hi(w[2 * q]);
        m[2 * q + 8] = kvf_bf16_lo(w[2 * q + 1]);
        m[2 * q + 9] = kvf_bf16_hi(w[2 * q + 1]);
    }
}

// f(kb, xv, mv) for each 16-channel block kb of row x (from the source) and
// of the permuted shared centroid row crow, in channel order; U: the loop's
// unroll factor.
template <int D, bool BF, int U = 1, typename F>
__device__ __forceinline__ void row_blocks(const void *x, const u16 *crow, F &&f) {
#pragma unroll U
    for (int kb = 0; kb < D / 16; kb++) {
        float xv[16], mv[16];
        ld16<BF>(x, kb * 16, xv);
        mu16(crow, kb, mv);
        f(kb, xv, mv);
    }
}

// ||mu||^2, the CPU's value (kvf_ref_centroid_norms): f64 in channel order.
template <int D> __device__ __forceinline__ double norm2(const u16 *crow) {
    double nn = 0.0;
#pragma unroll 1
    for (int kb = 0; kb < D / 16; kb++) {
        float mv[16];
        mu16(crow, kb, mv);
#pragma unroll
        for (int i = 0; i < 16; i++) nn = __fma_rn((double)mv[i], (double)mv[i], nn);
    }
    return nn;
}

// nn - 2 <x, mu> with nn = ||mu||^2 (norm2): kvf_ref_nearest_normed's value.
template <int D, bool BF>
__device__ __forceinline__ double plain_dist(const void *x, const u16 *crow, double nn) {
    double dot = 0.0;
    row_blocks<D, BF>(x, crow, [&](int, const float (&xv)[16], const float (&mv)[16]) {
#pragma unroll
        for (int i = 0; i < 16; i++) dot = __fma_rn((double)xv[i], (double)mv[i], dot);
    });
    return __dsub_rn(nn, __dmul_rn(2.0, dot));
}

// An f32 estimate of plain_dist, for the certified pick (assign): products
// by FFMA over 4 chains, so each product meets at most n = D / 4 + 2 <= 66
// roundings. With u = 2^-24, |estimate - (nn - 2 <x, mu>)| <= u nn +
// 2 gamma_n sum |x_c mu_c| + u (nn + 2 |x| |mu|) (1 + 2^-13) < 2^-16.9 (nn +
// |x| |mu|) (gamma_n = n u / (1 - n u); 2 gamma_66 + 2u < 2^-16.9), plus
// 2^-140 for subnormal products and sums; the CPU's
// f64 value is within 2^-45 (nn + |x| |mu|) of the exact one. So both lie
// within E = 2^-15 (max N + |x| max |mu|) + 2^-101 of each other, with
// room to spare (cert_margin). Rows reach it only with a finite filter
// bound: |x| max |mu| + max N / 2 < 2^125, so nothing here overflows.
template <int D, bool BF>
__device__ __forceinline__ float plain_dist_f32(const void *x, const u16 *crow, double nn) {
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    row_blocks<D, BF>(x, crow, [&](int, const float (&xv)[16], const float (&mv)[16]) {
#pragma unroll
        for (int i = 0; i < 16; i++) acc[i & 3] = __fmaf_rn(xv[i], mv[i], acc[i & 3]);
    });
    const float dot = __fadd_rn(__fadd_rn(acc[0], acc[1]), __fadd_rn(acc[2], acc[3]));
    return __fmaf_rn(-2.0f, dot, __double2float_rn(nn));
}

// 2E (plain_dist_f32), rounded up, for a row with |a| = an (sqrtf of an f32
// sum of squares: within 2^-17 of |x|, so an * 1.0001 >= |x|) and the head's
// cmax >= max |mu|, nmax >= max N (assign rounds both up). Two candidates
// whose estimates differ by more than 2E have the CPU's distances in the
// same strict order.
__device__ __forceinline__ float cert_margin(float an, float cmax, float nmax) {
    return __fadd_ru(__fmul_ru(0x1p-14f, __fmaf_ru(__fmul_ru(an, 1.0001f), cmax, nmax)), 0x1p-100f);
}

template <int D, bool BF>
__device__ __forceinline__ double weighted_dist(const void *x, const u16 *crow, const float *w) {
    double acc = 0.0;
    row_blocks<D, BF>(x, crow, [&](int kb, const float (&xv)[16], const float (&mv)[16]) {
#pragma unroll
        for (int i = 0; i < 16; i++) {
            const double d = __dsub_rn((double)xv[i], (double)mv[i]);
            acc = __dadd_rn(acc, __dmul_rn((double)w[kb * 16 + i], __dmul_rn(d, d)));
        }
    });
    return acc;
}

// QSAC's score S of one candidate (ref_kmeans.c sensitivity_score); gw[g] is
// the group's weight sum, the CPU's per-group f64 sum in channel order.
template <int D, int G, bool BF>
__device__ __forceinline__ double sensitivity(const void *x, const u16 *crow, const double *gw) {
    double score = 0.0;
    float lo = 0.0f, hi = 0.0f;
    row_blocks<D, BF, 2>(x, crow, [&](int kb, const float (&xv)[16], const float (&mv)[16]) {
#pragma unroll
        for (int i = 0; i < 16; i++) {
            const int c = kb * 16 + i;
            const float r = __fsub_rn(xv[i], mv[i]);
            lo = c % G == 0 ? r : fminf(lo, r);
            hi = c % G == 0 ? r : fmaxf(hi, r);
            if (c % G == G - 1) {
                const double range = (double)__fsub_rn(hi, lo);
                score = __dadd_rn(score, __dmul_rn(gw[c / G], __dmul_rn(range, range)));
            }
        }
    });
    return score;
}

// The CPU's exact distance of row x to centroid j (its permuted shared row
// crow): QSAC's weighted distance (M > 1, weights w), else the nearest
// centroid's |mu_j|^2 - 2 <x, mu_j> with |mu_j|^2 = nn[j] (norm2; nn exists
// only for M = 1).
template <int D, int M, bool BF>
__device__ __forceinline__ double exact_dist(const void *x, const u16 *crow, const float *w, const double *nn,
                                             int j) {
    if constexpr (M > 1) return weighted_dist<D, BF>(x, crow, w);
    else return plain_dist<D, BF>(x, crow, nn[j]);
}

// One pass of the filter over all centroids for the warp's 16 tokens (rows g
// and g+8 of the thread); nh[k] = (n_2k, n_2k+1, n_2k, n_2k+1) with n_j =
// N_j / 2, the start of the accumulators of columns 2k, 2k+1 (rows g and
// g+8: one 16-byte load), and ah/al hold -a. COLLECT = 0: keep each row's
// K smallest keys over the thread's columns. COLLECT = 1: append every j
// with h_j <= thr of a row marked `again` to that row's candidates.
template <int D, int K, int M, int FNU, bool COLLECT>
__device__ __forceinline__ void filter(bool lo, const u32 (&ah)[D / 16][4], const u32 (&al)[D / 16][4],
                                       const u16 *cs, const float4 *nh, int cp, int g, int q, float (&bs0)[K],
                                       float (&bs1)[K], assign_warp<M, K> &wa) {
    constexpr int DP = assign_pitch<D>();
    const float neg = __int_as_float(0xff800000);
    const float thr0 = COLLECT && wa.again[g] ? wa.thr[g] : neg, thr1 = COLLECT && wa.again[g + 8] ? wa.thr[g + 8] : neg;
    for (int nt = 0; nt < cp / 8; nt += FNU) {
        float acc[FNU][4]; // rows g, g+8 x columns 2q, 2q+1 of each 8: h_j = N_j / 2 - <a, mu_j>
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++)
#pragma unroll
            for (int u = 0; u < FNU; u++) {
                const uint2 b = *(const uint2 *)(cs + ((nt + u) * 8 + g) * DP + ks * 16 + q * 4);
                if (ks == 0) {
                    mma_bf16_from(acc[u], ah[0], b.x, b.y, nh[(nt + u) * 4 + q]);
                } else {
                    mma_bf16(acc[u], ah[ks], b.x, b.y);
                }
                if (lo) mma_bf16(acc[u], al[ks], b.x, b.y); // warp-uniform: some e is not BF16
            }
#pragma unroll
        for (int u = 0; u < FNU; u++)
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const int j = (nt + u) * 8 + q * 2 + i;
                const float s0 = acc[u][i], s1 = acc[u][2 + i];
                if (COLLECT) {
                    if (s0 <= thr0) { const int k = atomicAdd(&wa.nc[g], 1); if (k < CAP) wa.cj[g][k] = j; }
                    if (s1 <= thr1) { const int k = atomicAdd(&wa.nc[g + 8], 1); if (k < CAP) wa.cj[g + 8][k] = j; }
                } else {
                    keep_k<K>(bs0, score_key(s0, j));
                    keep_k<K>(bs1, score_key(s1, j));
                }
            }
    }
}

// The candidate bound B of a token with |a| = an (see above), plus an
// absolute term for BF16/f32 subnormals the tensor cores may flush; +Inf
// where a score |h_j| <= an cmax + nmax / 2 might reach 2^125 (the token then
// takes the full scan).
__device__ __forceinline__ float filter_bound(float an, float cmax, float nmax) {
    const float b = __fadd_rn(__fmul_rn(KAPPA, __fmaf_rn(an, cmax, nmax)),
                              __fmul_rn(2e-36f, __fadd_rn(__fadd_rn(an, cmax), 1.0f)));
    return __fmaf_rn(an, cmax, __fmul_rn(0.5f, nmax)) < 0x1p125f ? b : __int_as_float(0x7f800000);
}

// The nearest centroid of one row (M = 1), from its quad's lists (lanes 4g ..
// 4g + 3 hold its keys over disjoint columns; every lane of the quad gets the
// same answer): true, with j the centroid, when the general path would find
// exactly one candidate (so pick it without an f64 distance), or when the
// row is past the end (nothing to write); false when that path must decide
// (a bound that is not finite, a list that may have dropped a candidate, or
// more than one candidate). The threshold is the general path's, bit for bit.
template <int K>
__device__ __forceinline__ bool quick_pick(const float (&bs)[K], float an, float cmax, float nmax, bool live,
                                           int &j) {
    float top = bs[0]; // each list is ascending
    top = fminf(top, __shfl_xor_sync(0xffffffffu, top, 1));
    top = fminf(top, __shfl_xor_sync(0xffffffffu, top, 2));
    j = key_index(top);
    const float b = filter_bound(an, cmax, nmax), thr = __fadd_rn(top, b); // 2B in squared distance
    // Keys within the threshold over the quad's lists: exactly 1 also says no
    // list may have dropped one (a list whose K-th key is within holds K >= 2).
    int within = 0;
#pragma unroll
    for (int i = 0; i < K; i++) within += bs[i] <= thr;
    within += __shfl_xor_sync(0xffffffffu, within, 1);
    within += __shfl_xor_sync(0xffffffffu, within, 2);
    const bool finite = thr - thr == 0.0f && b - b == 0.0f; // c_eff >= 1 whenever a tile runs
    return !live || (finite && within == 1);
}

// Bits 0, 4, .., 28 of a ballot (one per quad) as bits 0 .. 7.
__device__ __forceinline__ u32 quad_rows(u32 b) {
    b &= 0x11111111u;
    b = (b | b >> 3) & 0x03030303u;
    b = (b | b >> 6) & 0x000f000fu;
    return (b | b >> 12) & 0xffu;
}

// Block blockIdx.x + E's first pair of the (head, tile) pairs (assign: E = 1
// gives this block's end), from the special registers each time it is needed
// (asm volatile: not held in registers across the tile loop, as blockIdx.y,
// the head before session 13, was not; the assignment is at its register
// cap, and QSAC at M = 8 spilled otherwise).
template <int E> __device__ __forceinline__ i64 range_at(int n_heads, int tiles) {
    u32 b, n;
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(b));
    asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(n));
    return (i64)n_heads * tiles * (b + E) / n;
}

// Blocks over ranges of the (head, 16-token tile) pairs. M = 1: nearest centroid; M > 1:
// QSAC over the M nearest by the weighted distance (weights[h][D], or ones).
// stats (optional, [5]): tokens, candidates, full scans, second filters, and
// rows that took their candidates' f64 distances (more than M candidates, not
// settled by the certified pick; full scans not counted): the order of
// runtime/internal.h's KVF_AS_*, which reads them.
template <int D, int G, int M, bool BF>
__device__ __forceinline__ void assign(const void *__restrict__ src, i64 ts, i64 hs, int n_tokens, int n_heads,
                                       int c_eff, const u16 *__restrict__ cent, int c_alloc, int *idx_ws,
                                       u8 *idx_plane, const float *__restrict__ weights, unsigned long long *stats) {
    constexpr int W = assign_warps<D, M>(), DP = assign_pitch<D>(), KS = D / 16;
    constexpr int MF = assign_lists<D, M>::MF, K = assign_lists<D, M>::K;
    constexpr int WB = assign_warp_bytes<M, K>(), SMEM = assign_smem_bytes<D, M>();
    static_assert(W >= 1, KVF_NOT_ON_THIS_ARCH
                  "assign: the centroid rows of this head_dim need more shared memory than this GPU arch has");
    // A BF16 source is its own high half: no low half, no second mma (plain distances only;
    // QSAC's w * x is not BF16).
    constexpr bool NO_LO = BF && M == 1;
    constexpr bool CERT = BF && M == 1; // the certified pick (below)
    extern __shared__ __align__(16) unsigned char smem[];
    u32 have;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
    if (have < (u32)SMEM) __trap(); // the launch's size disagrees with this file
    using L = assign_layout<D, M>;
    u16 *cs = (u16 *)(smem + L::CENT);          // [MAX_C][DP]
    float4 *nh = (float4 *)(smem + L::NH);      // [MAX_C / 2] N_j / 2 in f32 (N_j: |mu|^2, or sum w mu^2 for QSAC),
                                                // 2^126 past c_eff; pairs of columns, twice (filter)
    float *wv = (float *)(smem + L::WV);        // [D]
    double *gw = (double *)(smem + L::GW);      // [32] QSAC: weight sum of each group
    double *nn64 = (double *)(smem + L::NN);    // [MAX_C] M = 1: |mu_j|^2 (norm2), for the exact distances
    u32 *lim = (u32 *)(smem + L::LIM);          // [0] max |mu|, [1] max |N| (f32 bits)
    volatile int *cur = (volatile int *)(lim + 2); // [0] the head being assigned, [1] the end of its tiles here,
                                                   // [2] the tiles of a head
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, q = lane & 3;
    // At L::WARPS + warp * WB; written from the end, the form whose SASS ran on the H200.
    assign_warp<M, K> &wa = *(assign_warp<M, K> *)(smem + (SMEM - (W - warp) * WB));
    constexpr int FNU = filter_tiles<M, BF>(), CB = 8 * FNU; // n8 tiles and columns a filter step
    // This block's share of the (head, 16-token tile) pairs of all heads: a
    // contiguous range, so each block (runtime/gpu/context.c launches about one an
    // SM) has about the same number of tiles whatever the head count. It
    // stages each head of its range once, for that head's tiles. The head and
    // its end are read from cur[] where used (volatile: no register holds
    // them across the tile loop).
    const int tiles = (n_tokens + TPW - 1) / TPW, cp = (c_eff + CB - 1) & ~(CB - 1);
    if (tiles == 0) return;
    for (int h = (int)(range_at<0>(n_heads, tiles) / tiles);;) {
        __syncthreads(); // no warp reads the previous head's rows, or cur[], any more
        // The head's staging below from a thread index read here (asm volatile):
        // its addresses are not hoisted out of the head loop into registers
        // held across the tile loop (that spilled at the register cap).
        int tx;
        asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tx));
        const u16 *ch = cent + (i64)h * c_alloc * D;
        for (int i = tx; i < cp * (D / 16); i += W * 32) { // one 16-channel k-block, permuted
            const int j = i / (D / 16), c16 = (i % (D / 16)) * 16;
            uint4 a = make_uint4(0u, 0u, 0u, 0u), b = a;
            if (j < c_eff) { a = *(const uint4 *)(ch + (i64)j * D + c16); b = *(const uint4 *)(ch + (i64)j * D + c16 + 8); }
            *(uint4 *)(cs + j * DP + c16) = make_uint4(a.x, b.x, a.y, b.y);
            *(uint4 *)(cs + j * DP + c16 + 8) = make_uint4(a.z, b.z, a.w, b.w);
        }
        for (int c = tx; c < D; c += W * 32) wv[c] = (M > 1 && weights) ? weights[(i64)h * D + c] : 1.0f;
        if (tx < 2) lim[tx] = 0u;
        if (tx == 0) {
            cur[0] = h;
            cur[2] = tiles;
            cur[1] = (int)min(range_at<1>(n_heads, tiles) - (i64)h * tiles, (i64)tiles);
        }
        __syncthreads();
        if (M > 1 && tx < D / G) { // ref_kmeans.c sensitivity_score's wg: channel order from 0
            double s = 0.0;
            for (int c = tx * G; c < (tx + 1) * G; c++) s = __dadd_rn(s, (double)wv[c]);
            gw[tx] = s;
        }
        if (M == 1)
            for (int j = tx; j < c_eff; j += W * 32) nn64[j] = norm2<D>(cs + j * DP);
        // The filter's N_j and the bound's limits: 8 threads per centroid, f64
        // partial sums (any order: only the exact distances below need the CPU's).
        for (int i = tx; i < cp * 8; i += W * 32) {
            const int j = i / 8, c0 = (i % 8) * (D / 8);
            double nn = 0.0, nw = 0.0;
            if (j < c_eff)
                for (int c8 = c0; c8 < c0 + D / 8; c8 += 8) {
                    u16 m8[8];
                    kvf_load8(cs + j * DP + c8, m8);
#pragma unroll
                    for (int k = 0; k < 8; k++) {
                        const double m = (double)kvf_bf16_to_f32(m8[k]);
                        nn = __fma_rn(m, m, nn);
                        if (M > 1) nw = __fma_rn((double)wv[kblock_channel(c8 + k)], __dmul_rn(m, m), nw);
                    }
                }
#pragma unroll
            for (int o = 1; o < 8; o <<= 1) {
                nn = __dadd_rn(nn, __shfl_xor_sync(0xffffffffu, nn, o));
                nw = __dadd_rn(nw, __shfl_xor_sync(0xffffffffu, nw, o));
            }
            const double nj = M > 1 ? nw : nn;
            if (i % 8 == 0) {
                float *np = (float *)&nh[j / 2] + (j & 1);
                np[0] = np[2] = j < c_eff ? __fmul_rn((float)nj, 0.5f) : 0x1p126f;
                if (j < c_eff) {
                    atomicMax(&lim[0], __float_as_uint(fabsf((float)sqrt(nn))));
                    atomicMax(&lim[1], __float_as_uint(fabsf((float)nj)));
                }
            }
        }
        __syncthreads();
        // Round the limits up a little: the bound must not be below the truth.
        const float cmax = __fmul_rn(__uint_as_float(lim[0]), 1.0001f), nmax = __fmul_rn(__uint_as_float(lim[1]), 1.0001f);

        // Each warp takes the head's tiles of the range W apart. No __syncthreads
        // below (the next head's, above, is reached by every warp).
        for (int tile = (int)max(range_at<0>(n_heads, cur[2]) - (i64)cur[0] * cur[2], (i64)0) + warp; tile < cur[1];
             tile += W) {
            const int tw0 = tile * TPW;
            // A fragments (m16n8k16, row-major): rows g and g+8, columns 2q.. of each half of each k-step.
            u32 ah[KS][4], al[KS][4];
            float ss0 = 0.0f, ss1 = 0.0f;
            bool any_lo = false;
            {
                const void *r0 = src_row<BF>(src, ts, hs, cur[0], min(tw0 + g, n_tokens - 1));
                const void *r1 = src_row<BF>(src, ts, hs, cur[0], min(tw0 + g + 8, n_tokens - 1));
#pragma unroll
                for (int ks = 0; ks < KS; ks++)
#pragma unroll
                    for (int half = 0; half < 2; half++) {
                        const int c = ks * 16 + half * 8 + q * 2;
                        if (NO_LO) { // the pairs are the A registers as they are
                            const u32 w0 = *(const u32 *)((const u16 *)r0 + c), w1 = *(const u32 *)((const u16 *)r1 + c);
                            ah[ks][half * 2] = w0;
                            ah[ks][half * 2 + 1] = w1;
                            const float a0 = kvf_bf16_lo(w0), b0 = kvf_bf16_hi(w0);
                            const float a1 = kvf_bf16_lo(w1), b1 = kvf_bf16_hi(w1);
                            ss0 = __fmaf_rn(a0, a0, __fmaf_rn(b0, b0, ss0));
                            ss1 = __fmaf_rn(a1, a1, __fmaf_rn(b1, b1, ss1));
                            continue;
                        }
                        float2 x0 = ld2<BF>(r0, c), x1 = ld2<BF>(r1, c);
                        if (M > 1) {
                            x0.x = __fmul_rn(x0.x, wv[c]); x0.y = __fmul_rn(x0.y, wv[c + 1]);
                            x1.x = __fmul_rn(x1.x, wv[c]); x1.y = __fmul_rn(x1.y, wv[c + 1]);
                        }
                        ss0 = __fmaf_rn(x0.x, x0.x, __fmaf_rn(x0.y, x0.y, ss0));
                        ss1 = __fmaf_rn(x1.x, x1.x, __fmaf_rn(x1.y, x1.y, ss1));
                        split_pair(x0.x, x0.y, ah[ks][half * 2], al[ks][half * 2]);
                        split_pair(x1.x, x1.y, ah[ks][half * 2 + 1], al[ks][half * 2 + 1]);
                        any_lo |= (al[ks][half * 2] | al[ks][half * 2 + 1]) != 0u;
                    }
            }
            const bool lo = NO_LO ? false : __any_sync(0xffffffffu, any_lo);
#pragma unroll
            for (int ks = 0; ks < KS; ks++) // the filter takes -a (its sums start from N_j / 2)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    ah[ks][i] ^= 0x80008000u;
                    if (!NO_LO) al[ks][i] ^= 0x80008000u;
                }
            ss0 = __fadd_rn(ss0, __shfl_xor_sync(0xffffffffu, ss0, 1));
            ss0 = __fadd_rn(ss0, __shfl_xor_sync(0xffffffffu, ss0, 2));
            ss1 = __fadd_rn(ss1, __shfl_xor_sync(0xffffffffu, ss1, 1));
            ss1 = __fadd_rn(ss1, __shfl_xor_sync(0xffffffffu, ss1, 2));
            const float an0 = sqrtf(ss0), an1 = sqrtf(ss1);
            float bs0[K], bs1[K]; // score keys (score_key)
#pragma unroll
            for (int i = 0; i < K; i++) bs0[i] = bs1[i] = __int_as_float(0x7f800000);
            if (M <= 8) filter<D, K, M, FNU, false>(lo, ah, al, cs, nh, cp, g, q, bs0, bs1, wa);
            // Rows (bit r: token tw0 + r) left to the general path below. The
            // nearest centroid settles most rows in registers first: a row whose
            // quad's lists hold exactly one key within the threshold, and none of
            // which may have dropped one, has that key's centroid as its only
            // candidate: the general path's answer for it, without shared memory.
            u32 slow = 0xffffu;
            if (M == 1) {
                int j0, j1;
                const bool done0 = quick_pick<K>(bs0, an0, cmax, nmax, tw0 + g < n_tokens, j0);
                const bool done1 = quick_pick<K>(bs1, an1, cmax, nmax, tw0 + g + 8 < n_tokens, j1);
                slow = quad_rows(__ballot_sync(0xffffffffu, !done0)) | quad_rows(__ballot_sync(0xffffffffu, !done1)) << 8;
                // Token `lane` (< TPW) of the tile: its row's pick, from the row's quad.
                const int r0 = __shfl_sync(0xffffffffu, j0, 4 * (lane & 7)), r1 = __shfl_sync(0xffffffffu, j1, 4 * (lane & 7));
                if (lane < TPW && !(slow >> lane & 1) && tw0 + lane < n_tokens) {
                    const i64 o = (i64)cur[0] * n_tokens + tw0 + lane;
                    const int j = lane < 8 ? r0 : r1;
                    if (idx_ws) idx_ws[o] = j;
                    if (idx_plane) idx_plane[o] = (u8)j;
                    if (stats) {
                        atomicAdd(&stats[0], 1ull);
                        atomicAdd(&stats[1], 1ull);
                    }
                }
                if (!slow) continue; // warp-uniform; nothing of the warp's scratch was touched
            }
            if (q == 0) { wa.an[g] = an0; wa.an[g + 8] = an1; }
            if (M <= 8) {
#pragma unroll
                for (int i = 0; i < K; i++) {
                    wa.ls[g][q][i] = bs0[i];
                    wa.ls[g + 8][q][i] = bs1[i];
                }
            }
            __syncwarp();
            // Candidates of token `lane`: within B of the M-th smallest key (2B in squared distance).
            if (lane < TPW) {
                const int t = tw0 + lane;
                int n = slow >> lane & 1 ? -1 : 0; // 0: settled above
                wa.again[lane] = 0;
                if (M <= 8 && n < 0) {
                    float top[MF];
#pragma unroll
                    for (int i = 0; i < MF; i++) top[i] = __int_as_float(0x7f800000);
                    for (int qq = 0; qq < 4; qq++)
                        for (int i = 0; i < K; i++) keep_k<MF>(top, wa.ls[lane][qq][i]);
                    const float b = filter_bound(wa.an[lane], cmax, nmax);
                    const float thr = __fadd_rn(top[MF - 1], b); // 2B in squared distance
                    wa.thr[lane] = thr;
                    if (thr - thr == 0.0f && b - b == 0.0f && c_eff >= MF) { // finite
                        n = 0;
                        for (int qq = 0; qq < 4 && n >= 0; qq++) {
                            if (wa.ls[lane][qq][K - 1] <= thr) n = -2; // this thread's list may have dropped one
                            for (int i = 0; i < K && n >= 0; i++)
                                if (wa.ls[lane][qq][i] <= thr) wa.cj[lane][n++] = key_index(wa.ls[lane][qq][i]);
                        }
                        if (n == -2 && t < n_tokens) { wa.again[lane] = 1; n = 0; }
                    }
                }
                wa.nc[lane] = t < n_tokens ? n : 0;
            }
            __syncwarp();
            if (M <= 8 && __any_sync(0xffffffffu, lane < TPW && wa.again[lane])) {
                filter<D, K, M, FNU, true>(lo, ah, al, cs, nh, cp, g, q, bs0, bs1, wa);
                __syncwarp();
                if (lane < TPW && wa.nc[lane] > CAP) wa.nc[lane] = -1;
                __syncwarp();
            }
            // Distances of the candidates of the rows with `mine` > 0 of them (row
            // `lane`), spread over the lanes (offsets by a scan): the f32 estimates
            // (plain_dist_f32) when EST, else the CPU's f64 values.
            auto distances = [&](int mine, bool est) {
                int off = mine;
#pragma unroll
                for (int o = 1; o < TPW; o <<= 1) {
                    const int v = __shfl_up_sync(0xffffffffu, off, o);
                    if (lane >= o) off += v;
                }
                const int total = __shfl_sync(0xffffffffu, off, TPW - 1);
                if (lane < TPW) wa.off[lane] = mine ? off - mine : 0x7fffffff; // rows without: never found below
                __syncwarp();
                for (int f = lane; f < total; f += 32) {
                    int tl = 0; // the last token whose first candidate is at or before f
                    for (int i = 1; i < TPW; i++)
                        if (wa.off[i] <= f) tl = i;
                    const int k = f - wa.off[tl];
                    const void *x = src_row<BF>(src, ts, hs, cur[0], tw0 + tl);
                    const int j = wa.cj[tl][k];
                    if constexpr (CERT)
                        if (est) { wa.cd[tl][k] = (double)plain_dist_f32<D, BF>(x, cs + j * DP, nn64[j]); continue; }
                    wa.cd[tl][k] = exact_dist<D, M, BF>(x, cs + j * DP, wv, nn64, j);
                }
                __syncwarp();
            };
            // A token with exactly MF candidates needs no distance: they are its MF
            // nearest (for the nearest centroid, the answer; for QSAC their order
            // matters only to break a tie of scores, settled below). The nearest
            // centroid over a BF16 source first compares f32 estimates: a row whose
            // smallest estimate is below every other by more than 2E (cert_margin)
            // has the CPU's answer there (its f64 distances in the same strict
            // order), the `pick` of lane `lane`; only the other rows take the f64
            // distances. On the H200 (docs/BENCHMARKS.md, session 21) this took
            // qvg_int2's encode from 2.120-2.132 to 2.092-2.106 ms; over the f32
            // workspace (qvg_pro_int2's later stages) the same made its encode 2%
            // slower, so those rows take the f64 distances directly.
            int pick = -1;
            if constexpr (CERT) {
                distances(lane < TPW && wa.nc[lane] > 1 ? wa.nc[lane] : 0, true);
                if (lane < TPW && wa.nc[lane] > 1) {
                    const int n = wa.nc[lane];
                    int b = 0;
                    float bd = (float)wa.cd[lane][0];
                    for (int k = 1; k < n; k++) {
                        const float d = (float)wa.cd[lane][k];
                        if (d < bd) { bd = d; b = k; }
                    }
                    const float lim = __fadd_ru(bd, cert_margin(wa.an[lane], cmax, nmax));
                    bool sure = lim - lim == 0.0f; // finite (so is every estimate it is compared with)
                    for (int k = 0; k < n && sure; k++) sure = k == b || (float)wa.cd[lane][k] > lim;
                    if (sure) pick = wa.cj[lane][b];
                }
                const int rest = lane < TPW && wa.nc[lane] > 1 && pick < 0 ? wa.nc[lane] : 0;
                if (__any_sync(0xffffffffu, rest > 0)) distances(rest, false);
            } else {
                distances(lane < TPW && wa.nc[lane] > MF ? wa.nc[lane] : 0, false);
            }
            // The CPU's rule over the candidates: the smallest (distance, j); for QSAC
            // the M smallest (distance, j), then the first smallest sensitivity score.
            // Both are independent of the candidates' order.
            if (lane < TPW && wa.nc[lane] > 0) {
                const int n = wa.nc[lane];
                if (M > 1 && n == MF) { // the MF nearest, unordered
                    for (int i = 0; i < MF; i++) wa.pk[lane][i] = wa.cj[lane][i];
                } else if (M == 1 && pick >= 0) {
                    wa.pk[lane][0] = pick;
                } else if (M == 1) {
                    int bj = wa.cj[lane][0];
                    double bd = n > 1 ? wa.cd[lane][0] : 0.0;
                    for (int k = 1; k < n; k++) {
                        const double d = wa.cd[lane][k];
                        const int j = wa.cj[lane][k];
                        if (d < bd || (d == bd && j < bj)) { bd = d; bj = j; }
                    }
                    wa.pk[lane][0] = bj;
                } else {
                    double td[MF];
                    int tj[MF];
#pragma unroll
                    for (int i = 0; i < MF; i++) { td[i] = KVF_INF64; tj[i] = 0x7fffffff; }
                    for (int k = 0; k < n; k++) {
                        double d = wa.cd[lane][k];
                        int j = wa.cj[lane][k];
#pragma unroll
                        for (int i = 0; i < MF; i++)
                            if (d < td[i] || (d == td[i] && j < tj[i])) {
                                const double od = td[i];
                                const int oj = tj[i];
                                td[i] = d; tj[i] = j; d = od; j = oj;
                            }
                    }
#pragma unroll
                    for (int i = 0; i < MF; i++) wa.pk[lane][i] = tj[i];
                }
            }
            __syncwarp();
            if (M > 1 && M <= 8) {
                for (int i = lane; i < TPW * MF; i += 32) {
                    const int tl = i / MF, k = i % MF;
                    if (wa.nc[tl] <= 0) continue;
                    const void *x = src_row<BF>(src, ts, hs, cur[0], tw0 + tl);
                    wa.sv[tl][k] = sensitivity<D, G, BF>(x, cs + wa.pk[tl][k] * DP, gw);
                }
                __syncwarp();
                if (lane < TPW && wa.nc[lane] > 0) {
                    int b = 0;
                    for (int k = 1; k < MF; k++)
                        if (wa.sv[lane][k] < wa.sv[lane][b]) b = k;
                    // Unordered: the pick is the order's only if one score is strictly the smallest.
                    bool unique = wa.nc[lane] > MF || wa.sv[lane][b] == wa.sv[lane][b];
                    for (int k = 0; k < MF && unique; k++) unique = k == b || wa.sv[lane][k] > wa.sv[lane][b];
                    if (!unique) { // rare: the CPU's order (distance, then j), then its rule over it
                        const void *x = src_row<BF>(src, ts, hs, cur[0], tw0 + lane);
                        double td[MF];
                        int tk[MF];
                        for (int k = 0; k < MF; k++) {
                            double d = weighted_dist<D, BF>(x, cs + wa.pk[lane][k] * DP, wv);
                            int kk = k, i = k;
                            for (; i > 0 && (d < td[i - 1] || (d == td[i - 1] && wa.pk[lane][kk] < wa.pk[lane][tk[i - 1]])); i--) {
                                td[i] = td[i - 1];
                                tk[i] = tk[i - 1];
                            }
                            td[i] = d;
                            tk[i] = kk;
                        }
                        b = tk[0];
                        for (int i = 1; i < MF; i++)
                            if (wa.sv[lane][tk[i]] < wa.sv[lane][b]) b = tk[i];
                    }
                    wa.pk[lane][0] = wa.pk[lane][b];
                }
                __syncwarp();
            }
            if (lane < TPW && wa.nc[lane] > 0) {
                const i64 o = (i64)cur[0] * n_tokens + tw0 + lane;
                if (idx_ws) idx_ws[o] = wa.pk[lane][0];
                if (idx_plane) idx_plane[o] = (u8)wa.pk[lane][0];
            }
            if (stats && lane < TPW && tw0 + lane < n_tokens && (slow >> lane & 1)) {
                atomicAdd(&stats[0], 1ull);
                atomicAdd(&stats[wa.nc[lane] >= 0 ? 1 : 2], (unsigned long long)(wa.nc[lane] >= 0 ? wa.nc[lane] : 1));
                if (wa.again[lane]) atomicAdd(&stats[3], 1ull);
                // the rows that took their candidates' f64 distances above
                if (wa.nc[lane] > MF && !(CERT && pick >= 0)) atomicAdd(&stats[4], 1ull);
            }
            // Full scans, one token at a time: every distance, then ref_kmeans.c's
            // sequential rules verbatim (a NaN distance never wins, except at j = 0).
            for (u32 full = __ballot_sync(0xffffffffu, lane < TPW && wa.nc[lane] == -1); full; full &= full - 1) {
                const int tl = __ffs(full) - 1;
                const void *x = src_row<BF>(src, ts, hs, cur[0], tw0 + tl);
                for (int j = lane; j < c_eff; j += 32)
                    wa.scr[j] = exact_dist<D, M, BF>(x, cs + j * DP, wv, nn64, j);
                __syncwarp();
                int best = 0;
                if (M == 1) {
                    if (lane == 0) {
                        double bd = wa.scr[0];
                        for (int j = 1; j < c_eff; j++)
                            if (wa.scr[j] < bd) { bd = wa.scr[j]; best = j; }
                    }
                } else {
                    const int m = min(M, c_eff);
                    if (lane == 0) { // keep_best
                        int nb = 0;
                        for (int j = 0; j < c_eff; j++) {
                            const double d = wa.scr[j];
                            int pos = nb;
                            while (pos > 0 && d < wa.fd[pos - 1]) pos--;
                            if (pos >= m) continue;
                            for (int i = (nb < m ? nb : m - 1); i > pos; i--) { wa.fd[i] = wa.fd[i - 1]; wa.fj[i] = wa.fj[i - 1]; }
                            wa.fd[pos] = d;
                            wa.fj[pos] = j;
                            if (nb < m) nb++;
                        }
                    }
                    __syncwarp();
                    for (int k = lane; k < m; k += 32) wa.fs[k] = sensitivity<D, G, BF>(x, cs + wa.fj[k] * DP, gw);
                    __syncwarp();
                    if (lane == 0) {
                        best = wa.fj[0];
                        double bs = wa.fs[0];
                        for (int k = 1; k < m; k++)
                            if (wa.fs[k] < bs) { bs = wa.fs[k]; best = wa.fj[k]; }
                    }
                }
                if (lane == 0) {
                    const i64 o = (i64)cur[0] * n_tokens + tw0 + tl;
                    if (idx_ws) idx_ws[o] = best;
                    if (idx_plane) idx_plane[o] = (u8)best;
                }
                __syncwarp();
            }
            __syncwarp(); // the warp's scratch is reused by its next tile
        } // tiles
        h = cur[0] + 1; // read before the next head's barrier, above, lets thread 0 write it
        if ((i64)h * cur[2] >= range_at<1>(n_heads, cur[2])) break;
    } // heads
}

// ------------------------------------------------------------ fast assignment
//
// assign = "fast" (the scheme's default; METHODS.md 3, "fast assignment"):
// the filter's tensor-core scores h_j (above) decide alone. No bound, no
// candidate list, no second filter pass, no f64 distance and no full scan,
// so nothing costs more where distances nearly tie. The nearest centroid is
// the token's smallest f32 h_j, ties to the smaller j (the CPU's rule, on
// these numbers); QSAC's M nearest are the token's M smallest score keys
// (fast_key: h_j to 2^-15, ties to the smaller j) in that order, and of
// them the first with the smallest sensitivity score (the CPU's rule and its
// f64 scores, M x D/G terms a token). Each index comes from a fixed sequence
// of operations on the token's row and its head's centroids: the same
// index run after run on one GPU, in any launch order. Where scores are not
// finite (NaN or Inf inputs, |a| max|mu| near 2^127) the index is some
// centroid below c_eff, not necessarily the CPU's.

// A score key with j in its low 8 mantissa bits such that equal truncated
// scores order by j ascending for either sign (j at s >= 0, 255 - j below).
__device__ __forceinline__ float fast_key(float s, int j) {
    const u32 b = __float_as_uint(s);
    return __uint_as_float((b & 0xffffff00u) | ((u32)j ^ ((u32)((int)b >> 31) & 0xffu)));
}
__device__ __forceinline__ int fast_key_index(float key) {
    const u32 b = __float_as_uint(key);
    return (int)((b ^ (u32)((int)b >> 31)) & 0xffu);
}

// The filter's tile loop (filter, above) calling f(j, s0, s1) for each of
// the thread's columns j, in ascending order: s0, s1 are h_j of rows g, g+8.
template <int D, int FNU, typename F>
__device__ __forceinline__ void filter_scores(bool lo, const u32 (&ah)[D / 16][4], const u32 (&al)[D / 16][4],
                                              const u16 *cs, const float4 *nh, int cp, int g, int q, F &&f) {
    constexpr int DP = assign_pitch<D>();
    for (int nt = 0; nt < cp / 8; nt += FNU) {
        float acc[FNU][4];
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++)
#pragma unroll
            for (int u = 0; u < FNU; u++) {
                const uint2 b = *(const uint2 *)(cs + ((nt + u) * 8 + g) * DP + ks * 16 + q * 4);
                if (ks == 0) mma_bf16_from(acc[u], ah[0], b.x, b.y, nh[(nt + u) * 4 + q]);
                else mma_bf16(acc[u], ah[ks], b.x, b.y);
                if (lo) mma_bf16(acc[u], al[ks], b.x, b.y); // warp-uniform: some e is not BF16
            }
#pragma unroll
        for (int u = 0; u < FNU; u++)
#pragma unroll
            for (int i = 0; i < 2; i++) f((nt + u) * 8 + q * 2 + i, acc[u][i], acc[u][2 + i]);
    }
}

// The fast assignment: assign's blocks, head ranges, staging and filter, then
// the picks above. stats (optional): tokens and their candidates (M each;
// the full scans, second filters and f64 rows stay 0).
template <int D, int G, int M, bool BF>
__device__ __forceinline__ void assign_fast(const void *__restrict__ src, i64 ts, i64 hs, int n_tokens, int n_heads,
                                            int c_eff, const u16 *__restrict__ cent, int c_alloc, int *idx_ws,
                                            u8 *idx_plane, const float *__restrict__ weights,
                                            unsigned long long *stats) {
    static_assert(M >= 1 && M <= 8, "the fast assignment keeps at most 8 keys (plan.c takes the exact one past that)");
    constexpr int W = assign_warps<D, M, false>(), DP = assign_pitch<D>(), KS = D / 16;
    constexpr int WB = warp_bytes<M, M, false>(), SMEM = assign_smem_bytes<D, M, false>();
    static_assert(W >= 1, KVF_NOT_ON_THIS_ARCH
                  "assign: the centroid rows of this head_dim need more shared memory than this GPU arch has");
    constexpr bool NO_LO = BF && M == 1; // as assign
    extern __shared__ __align__(16) unsigned char smem[];
    u32 have;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
    if (have < (u32)SMEM) __trap(); // the launch's size disagrees with this file
    using L = assign_layout<D, M, false>;
    u16 *cs = (u16 *)(smem + L::CENT);     // [MAX_C][DP], as assign
    float4 *nh = (float4 *)(smem + L::NH); // as assign
    float *wv = (float *)(smem + L::WV);   // [D]
    double *gw = (double *)(smem + L::GW); // [32] QSAC: weight sum of each group
    volatile int *cur = (volatile int *)(smem + L::LIM); // as assign's cur[]
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, q = lane & 3;
    fast_warp<M> &wa = *(fast_warp<M> *)(smem + L::WARPS + warp * WB); // QSAC only
    constexpr int FNU = filter_tiles<M, BF>(), CB = 8 * FNU;
    const int tiles = (n_tokens + TPW - 1) / TPW, cp = (c_eff + CB - 1) & ~(CB - 1);
    if (tiles == 0) return;
    for (int h = (int)(range_at<0>(n_heads, tiles) / tiles);;) {
        __syncthreads(); // no warp reads the previous head's rows, or cur[], any more
        int tx;
        asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tx));
        const u16 *ch = cent + (i64)h * c_alloc * D;
        for (int i = tx; i < cp * (D / 16); i += W * 32) { // one 16-channel k-block, permuted (kblock_channel)
            const int j = i / (D / 16), c16 = (i % (D / 16)) * 16;
            uint4 a = make_uint4(0u, 0u, 0u, 0u), b = a;
            if (j < c_eff) { a = *(const uint4 *)(ch + (i64)j * D + c16); b = *(const uint4 *)(ch + (i64)j * D + c16 + 8); }
            *(uint4 *)(cs + j * DP + c16) = make_uint4(a.x, b.x, a.y, b.y);
            *(uint4 *)(cs + j * DP + c16 + 8) = make_uint4(a.z, b.z, a.w, b.w);
        }
        for (int c = tx; c < D; c += W * 32) wv[c] = (M > 1 && weights) ? weights[(i64)h * D + c] : 1.0f;
        if (tx == 0) {
            cur[0] = h;
            cur[2] = tiles;
            cur[1] = (int)min(range_at<1>(n_heads, tiles) - (i64)h * tiles, (i64)tiles);
        }
        __syncthreads();
        if (M > 1 && tx < D / G) { // ref_kmeans.c sensitivity_score's wg: channel order from 0
            double s = 0.0;
            for (int c = tx * G; c < (tx + 1) * G; c++) s = __dadd_rn(s, (double)wv[c]);
            gw[tx] = s;
        }
        // N_j / 2, as assign: 8 threads per centroid, f64 partial sums, one rounding to f32.
        for (int i = tx; i < cp * 8; i += W * 32) {
            const int j = i / 8, c0 = (i % 8) * (D / 8);
            double nj = 0.0;
            if (j < c_eff)
                for (int c8 = c0; c8 < c0 + D / 8; c8 += 8) {
                    u16 m8[8];
                    kvf_load8(cs + j * DP + c8, m8);
#pragma unroll
                    for (int k = 0; k < 8; k++) {
                        const double m = (double)kvf_bf16_to_f32(m8[k]);
                        nj = M > 1 ? __fma_rn((double)wv[kblock_channel(c8 + k)], __dmul_rn(m, m), nj) : __fma_rn(m, m, nj);
                    }
                }
#pragma unroll
            for (int o = 1; o < 8; o <<= 1) nj = __dadd_rn(nj, __shfl_xor_sync(0xffffffffu, nj, o));
            if (i % 8 == 0) {
                float *np = (float *)&nh[j / 2] + (j & 1);
                np[0] = np[2] = j < c_eff ? __fmul_rn((float)nj, 0.5f) : 0x1p126f;
            }
        }
        __syncthreads();

        for (int tile = (int)max(range_at<0>(n_heads, cur[2]) - (i64)cur[0] * cur[2], (i64)0) + warp; tile < cur[1];
             tile += W) {
            const int tw0 = tile * TPW;
            u32 ah[KS][4], al[KS][4]; // A fragments of -a, as assign
            bool any_lo = false;
            {
                const void *r0 = src_row<BF>(src, ts, hs, cur[0], min(tw0 + g, n_tokens - 1));
                const void *r1 = src_row<BF>(src, ts, hs, cur[0], min(tw0 + g + 8, n_tokens - 1));
#pragma unroll
                for (int ks = 0; ks < KS; ks++)
#pragma unroll
                    for (int half = 0; half < 2; half++) {
                        const int c = ks * 16 + half * 8 + q * 2;
                        if (NO_LO) {
                            ah[ks][half * 2] = *(const u32 *)((const u16 *)r0 + c);
                            ah[ks][half * 2 + 1] = *(const u32 *)((const u16 *)r1 + c);
                            continue;
                        }
                        float2 x0 = ld2<BF>(r0, c), x1 = ld2<BF>(r1, c);
                        if (M > 1) {
                            x0.x = __fmul_rn(x0.x, wv[c]); x0.y = __fmul_rn(x0.y, wv[c + 1]);
                            x1.x = __fmul_rn(x1.x, wv[c]); x1.y = __fmul_rn(x1.y, wv[c + 1]);
                        }
                        split_pair(x0.x, x0.y, ah[ks][half * 2], al[ks][half * 2]);
                        split_pair(x1.x, x1.y, ah[ks][half * 2 + 1], al[ks][half * 2 + 1]);
                        any_lo |= (al[ks][half * 2] | al[ks][half * 2 + 1]) != 0u;
                    }
            }
            const bool lo = NO_LO ? false : __any_sync(0xffffffffu, any_lo);
#pragma unroll
            for (int ks = 0; ks < KS; ks++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    ah[ks][i] ^= 0x80008000u;
                    if (!NO_LO) al[ks][i] ^= 0x80008000u;
                }
            if constexpr (M == 1) {
                // Each row's smallest (h_j, j) over the thread's columns, then over its quad.
                float b0 = __int_as_float(0x7f800000), b1 = b0;
                int j0 = 0, j1 = 0;
                filter_scores<D, FNU>(lo, ah, al, cs, nh, cp, g, q, [&](int j, float s0, float s1) {
                    if (s0 < b0) { b0 = s0; j0 = j; } // ascending j: the first of equal scores stays
                    if (s1 < b1) { b1 = s1; j1 = j; }
                });
#pragma unroll
                for (int o = 1; o < 4; o <<= 1) {
                    const float c0 = __shfl_xor_sync(0xffffffffu, b0, o), c1 = __shfl_xor_sync(0xffffffffu, b1, o);
                    const int k0 = __shfl_xor_sync(0xffffffffu, j0, o), k1 = __shfl_xor_sync(0xffffffffu, j1, o);
                    if (c0 < b0 || (c0 == b0 && k0 < j0)) { b0 = c0; j0 = k0; }
                    if (c1 < b1 || (c1 == b1 && k1 < j1)) { b1 = c1; j1 = k1; }
                }
                // Token `lane` (< TPW) of the tile: its row's pick, from the row's quad.
                const int r0 = __shfl_sync(0xffffffffu, j0, 4 * (lane & 7)), r1 = __shfl_sync(0xffffffffu, j1, 4 * (lane & 7));
                if (lane < TPW && tw0 + lane < n_tokens) {
                    const i64 o = (i64)cur[0] * n_tokens + tw0 + lane;
                    int j = lane < 8 ? r0 : r1;
                    j = j < c_eff ? j : 0; // a past-the-end column wins only over scores that are not finite
                    if (idx_ws) idx_ws[o] = j;
                    if (idx_plane) idx_plane[o] = (u8)j;
                    if (stats) {
                        atomicAdd(&stats[0], 1ull);
                        atomicAdd(&stats[1], 1ull);
                    }
                }
            } else {
                float bs0[M], bs1[M]; // each row's M smallest keys over the thread's columns
#pragma unroll
                for (int i = 0; i < M; i++) bs0[i] = bs1[i] = __int_as_float(0x7f800000);
                filter_scores<D, FNU>(lo, ah, al, cs, nh, cp, g, q, [&](int j, float s0, float s1) {
                    keep_k<M>(bs0, fast_key(s0, j));
                    keep_k<M>(bs1, fast_key(s1, j));
                });
#pragma unroll
                for (int i = 0; i < M; i++) {
                    wa.ls[g][q][i] = bs0[i];
                    wa.ls[g + 8][q][i] = bs1[i];
                }
                __syncwarp();
                if (lane < TPW) { // the token's M nearest over its quad's lists, ascending
                    float top[M];
#pragma unroll
                    for (int i = 0; i < M; i++) top[i] = __int_as_float(0x7f800000);
                    for (int qq = 0; qq < 4; qq++)
                        for (int i = 0; i < M; i++) keep_k<M>(top, wa.ls[lane][qq][i]);
                    const int m = min(M, c_eff); // ref_kmeans.c kvf_ref_qsac: min(M, centroids)
                    int n = 0;
                    for (int i = 0; i < M; i++) {
                        const int j = fast_key_index(top[i]);
                        if (j < c_eff && n < m) wa.pk[lane][n++] = j;
                    }
                    if (n == 0) wa.pk[lane][n++] = 0; // scores that are not finite only
                    wa.nc[lane] = tw0 + lane < n_tokens ? n : 0;
                }
                __syncwarp();
                for (int i = lane; i < TPW * M; i += 32) {
                    const int tl = i / M, k = i % M;
                    if (k >= wa.nc[tl]) continue;
                    const void *x = src_row<BF>(src, ts, hs, cur[0], tw0 + tl);
                    wa.sv[tl][k] = sensitivity<D, G, BF>(x, cs + wa.pk[tl][k] * DP, gw);
                }
                __syncwarp();
                if (lane < TPW && wa.nc[lane] > 0) { // the first smallest score, in the keys' order
                    int b = 0;
                    for (int k = 1; k < wa.nc[lane]; k++)
                        if (wa.sv[lane][k] < wa.sv[lane][b]) b = k;
                    const i64 o = (i64)cur[0] * n_tokens + tw0 + lane;
                    if (idx_ws) idx_ws[o] = wa.pk[lane][b];
                    if (idx_plane) idx_plane[o] = (u8)wa.pk[lane][b];
                    if (stats) {
                        atomicAdd(&stats[0], 1ull);
                        atomicAdd(&stats[1], (unsigned long long)wa.nc[lane]);
                    }
                }
                __syncwarp(); // the warp's scratch is reused by its next tile
            }
        } // tiles
        h = cur[0] + 1; // read before the next head's barrier, above, lets thread 0 write it
        if ((i64)h * cur[2] >= range_at<1>(n_heads, cur[2])) break;
    } // heads
}

// Lloyd update, step 1: each cluster's fixed-point sums and count. One block
// of SUM_THREADS per (part of the tokens, head) owns its part's sums (the
// finalize step adds the parts). The block sorts its tokens by cluster,
// SUM_SUB at a time (a counting sort in shared memory), and cuts each
// cluster's run into units of at most SUM_SEG tokens; each warp takes units
// and adds their rows in registers, a row per step (lane i: channels
// i * D/32 ..), then adds the unit's sums to the part's with 64-bit integer
// atomics, or, where the unit is its cluster's only one in the part's first
// round, stores them. So the part's rows need zeros first only where their
// cluster has no unit or several in that round (zeroed after the sort; the
// bench's parts hold about 30 tokens a cluster: one unit). Storing instead
// of zeroing the part's rows (256 KiB at 256 centroids and head_dim 128)
// and adding to them took about 0.022 ms off each launch (0.116 ms before;
// the encodes' difference over their 4 launches) on the H200
// (docs/BENCHMARKS.md, session 12).
// The value added is ref_kmeans.c's fixed_point(e), an integer of at most
// 2^36 (fixed_point below), summed in f64: sums of up to SUM_SEG of them are
// exact in any order, and so are the integer additions.
constexpr int SUM_THREADS = 1024, SUM_SUB = 8192, SUM_SEG = 64;
constexpr int SUM_UNITS = MAX_C + SUM_SUB / SUM_SEG; // units of a round at most
static_assert(SUM_SUB <= 65536 && (double)SUM_SEG * 68719476736.0 < 9007199254740992.0,
              "u16 offsets; SUM_SEG sums of 2^36 are exact in f64");

// ref_kmeans.c's fixed_point(e) = llrint(clamp(e * 2^20, +-2^36)), NaN -> 0,
// as an f64 integer: the clamp of e at +-2^16 is the clamp of e * 2^20 (a
// power of two: exact), and fma(e, 2^20, 1.5 * 2^52) rounds the exact e * 2^20
// (|.| <= 2^36) to an integer, ties to even as llrint; subtracting 1.5 * 2^52
// is exact.
__device__ __forceinline__ double fixed_point(float e) {
    constexpr double MAGIC = 6755399441055744.0; // 1.5 * 2^52
    e = e == e ? fminf(fmaxf(e, -65536.0f), 65536.0f) : 0.0f;
    return __dsub_rn(__fma_rn((double)e, FIX, MAGIC), MAGIC);
}

// A lane's 32-bit words of a row (16-byte aligned from 4 words: rows are, check_device_args).
template <int W> __device__ __forceinline__ void ld_words(const u32 *p, u32 (&w)[W]) {
    static_assert(W == 1 || W == 2 || W % 4 == 0, "1, 2 or a multiple of 4 words");
    if constexpr (W == 1) {
        w[0] = p[0];
    } else if constexpr (W == 2) {
        const uint2 a = *(const uint2 *)p;
        w[0] = a.x;
        w[1] = a.y;
    } else {
#pragma unroll
        for (int i = 0; i < W / 4; i++) {
            const uint4 a = ((const uint4 *)p)[i];
            w[4 * i] = a.x; w[4 * i + 1] = a.y; w[4 * i + 2] = a.z; w[4 * i + 3] = a.w;
        }
    }
}

template <int D, bool BF>
__device__ __forceinline__ void accumulate(const void *__restrict__ src, i64 ts, i64 hs, const int *__restrict__ idx,
                                           int n_tokens, int c_eff, int chunk, long long *acc, int *cnt) {
    constexpr int CPL = D / 32;                 // channels a lane
    constexpr int W = BF ? CPL / 2 : CPL;       // their 32-bit words
    constexpr int U = 16 / W > 0 ? 16 / W : 1;  // rows in flight a lane
    constexpr int PER = SUM_SUB / SUM_THREADS;  // tokens a thread sorts
    static_assert(D % 64 == 0 && SUM_SUB % SUM_THREADS == 0, "head_dim is 64, 128 or 256");
    constexpr int CPW = MAX_C / 32;             // clusters a lane of the scan
    __shared__ int cursor[MAX_C], total[MAX_C], next, units;
    __shared__ unsigned char direct[MAX_C];     // 1: the cluster's only unit of the first round stores its sums
    __shared__ u32 unit[SUM_UNITS];             // cluster << 16 | first position of the unit
    __shared__ unsigned short order[SUM_SUB];   // sub-chunk offsets of its tokens, by cluster
    if (blockDim.x != SUM_THREADS) __trap();    // the launch's size disagrees with this file
    const int h = blockIdx.y, nh = gridDim.y, part = blockIdx.x, lane = threadIdx.x % 32;
    const int t_begin = min(n_tokens, part * chunk), t_end = min(n_tokens, t_begin + chunk);
    const int *ih = idx + (i64)h * n_tokens;
    long long *ap = acc + ((i64)part * nh + h) * c_eff * D;
    if (t_begin >= t_end) // a part without tokens: zero sums
        for (int i = threadIdx.x; i < c_eff * D / 2; i += SUM_THREADS) ((longlong2 *)ap)[i] = make_longlong2(0, 0);
    for (int j = threadIdx.x; j < MAX_C; j += SUM_THREADS) total[j] = 0;
    for (int s0 = t_begin; s0 < t_end; s0 += SUM_SUB) {
        const int ns = min(SUM_SUB, t_end - s0);
        for (int j = threadIdx.x; j < MAX_C; j += SUM_THREADS) cursor[j] = 0;
        if (threadIdx.x == 0) next = 0;
        __syncthreads(); // (the first round: also total[] zeroed before the scan adds to it)
        int z[PER];
#pragma unroll
        for (int k = 0; k < PER; k++) {
            const int i = threadIdx.x + k * SUM_THREADS;
            z[k] = i < ns ? ih[s0 + i] : -1;
            if (z[k] >= 0) atomicAdd(&cursor[z[k]], 1);
        }
        __syncthreads();
        if (threadIdx.x < 32) { // exclusive scans of the counts and units, CPW clusters a lane
            int c[CPW], sum = 0, nu = 0;
#pragma unroll
            for (int i = 0; i < CPW; i++) {
                c[i] = cursor[lane * CPW + i];
                sum += c[i];
                nu += (c[i] + SUM_SEG - 1) / SUM_SEG;
            }
            int incl = sum, uincl = nu;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int y = __shfl_up_sync(0xffffffffu, incl, o), yu = __shfl_up_sync(0xffffffffu, uincl, o);
                if (lane >= o) incl += y, uincl += yu;
            }
            int run = incl - sum, urun = uincl - nu;
            for (int i = 0; i < CPW; i++) {
                const int j = lane * CPW + i;
                cursor[j] = run;
                total[j] += c[i];
                direct[j] = s0 == t_begin && c[i] > 0 && c[i] <= SUM_SEG;
                for (int p = run; p < run + c[i]; p += SUM_SEG) unit[urun++] = (u32)j << 16 | (u32)p;
                run += c[i];
            }
            if (lane == 31) units = urun;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < PER; k++)
            if (z[k] >= 0) order[atomicAdd(&cursor[z[k]], 1)] = (unsigned short)(threadIdx.x + k * SUM_THREADS);
        if (s0 == t_begin) // the rows the first round does not store: zeros for the atomics
            for (int i = threadIdx.x; i < c_eff * D / 2; i += SUM_THREADS)
                if (!direct[i / (D / 2)]) ((longlong2 *)ap)[i] = make_longlong2(0, 0);
        __syncthreads(); // cluster j's tokens end at order[cursor[j]]; the zeros are written
        for (;;) {
            int ui = 0;
            if (lane == 0) ui = atomicAdd(&next, 1);
            ui = __shfl_sync(0xffffffffu, ui, 0);
            if (ui >= units) break;
            const int j = (int)(unit[ui] >> 16), b = (int)(unit[ui] & 0xffffu), e = min(b + SUM_SEG, cursor[j]);
            double sum[CPL];
#pragma unroll
            for (int c = 0; c < CPL; c++) sum[c] = 0.0;
            for (int k = b; k < e; k += U) {
                u32 w[U][W];
#pragma unroll
                for (int u = 0; u < U; u++) { // every load before any use
                    if (k + u < e) {
                        const void *row = src_row<BF>(src, ts, hs, h, s0 + order[k + u]);
                        ld_words(BF ? (const u32 *)((const u16 *)row + lane * CPL)
                                    : (const u32 *)((const float *)row + lane * CPL),
                                 w[u]);
                    } else {
#pragma unroll
                        for (int i = 0; i < W; i++) w[u][i] = 0u; // +0.0 in either format: adds 0
                    }
                }
#pragma unroll
                for (int u = 0; u < U; u++)
#pragma unroll
                    for (int i = 0; i < W; i++) {
                        if (BF) {
                            sum[2 * i] = __dadd_rn(sum[2 * i], fixed_point(kvf_bf16_lo(w[u][i])));
                            sum[2 * i + 1] = __dadd_rn(sum[2 * i + 1], fixed_point(kvf_bf16_hi(w[u][i])));
                        } else {
                            sum[i] = __dadd_rn(sum[i], fixed_point(__uint_as_float(w[u][i])));
                        }
                    }
            }
            unsigned long long *o = (unsigned long long *)(ap + (i64)j * D + lane * CPL);
            if (direct[j]) {
#pragma unroll
                for (int c = 0; c < CPL; c += 2)
                    *(longlong2 *)(o + c) = make_longlong2((long long)sum[c], (long long)sum[c + 1]);
            } else {
#pragma unroll
                for (int c = 0; c < CPL; c++) atomicAdd(o + c, (unsigned long long)(long long)sum[c]);
            }
        }
        __syncthreads(); // the next round reuses the sort, and adds after this round's stores
    }
    if (threadIdx.x < c_eff) cnt[((i64)part * nh + h) * c_eff + threadIdx.x] = total[threadIdx.x];
}

// Step 2: the parts' sums, means to bf16 (empty clusters keep theirs).
template <int D>
__device__ __forceinline__ void finalize(int n_heads, int c_eff, int parts, const long long *acc, const int *cnt,
                                         u16 *cent, int c_alloc) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; // one (h, j, c)
    if (i >= (i64)n_heads * c_eff * D) return;
    const int c = (int)(i % D);
    const i64 hj = i / D, h = hj / c_eff, j = hj % c_eff, part_stride = (i64)n_heads * c_eff;
    long long sum = 0;
    int n = 0;
    for (int p = 0; p < parts; p++) {
        sum += acc[(p * part_stride + hj) * D + c];
        n += cnt[p * part_stride + hj];
    }
    if (n > 0)
        cent[(h * c_alloc + j) * D + c] = kvf_f32_to_bf16((float)__ddiv_rn(__ddiv_rn((double)sum, FIX), (double)n));
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

// Residual quantizer of a stage: r = e - mu[z]; planes; e_out <- e - (mu + r_hat)
// (e_out: the f32 workspace, PSAC's input; the source itself when that is the workspace).
// RES_RPT rows per thread, ROWS apart, every load issued before any use: the
// centroid is a gather behind the index load, two latencies a batch. 2 rows
// (56-72 registers on sm_90 since session 10's quantizer; 48-70 before) ran
// faster than 4 (72-91 registers: fewer blocks per SM) for qvg_int2 and
// quantwm_int2, the same for qvg_pro_int2, and faster than 1 on the H200
// (docs/BENCHMARKS.md, session 9).
// Launch bounds (KVF_RES_BOUNDS_<BF>, below): over a BF16 source 4 blocks an
// SM (at most 64 registers: qvg_int2's 66 -> 64 without a spill, so 4 blocks
// of 256 threads an SM instead of 3: qvg_int2's encode 2.19 -> 2.15 ms on the
// H200, docs/BENCHMARKS.md session 14); over the f32 workspace no minimum
// (qvg_pro_int2's 72 registers would spill at 64).
constexpr int RES_RPT = 2;
template <int D, int BITS, int G, int MODE, int SFMT, int NCENT, int WRITE_E, bool BF, int PK, int PM, int PB, int AB,
          int FB>
__device__ __forceinline__ void residual(const void *src, i64 ts, i64 hs, float *e_out, int n_tokens, int n_heads,
                                         u8 *__restrict__ packed, kvf_quant::stage_planes p, const kvf_bf16_src &in,
                                         const kvf_pipe_io &pipe) {
    constexpr int LPR = D / 8, LPG = G / 8, ROWS = BLOCK / LPR;
    constexpr bool PIPE = PK || PM || FB;
    const int lane = threadIdx.x % LPR;
    const i64 rows = (i64)n_tokens * n_heads, row0 = (i64)blockIdx.x * ROWS * RES_RPT + threadIdx.x / LPR;
    float v[RES_RPT][8], mu[RES_RPT][8];
    int z[RES_RPT];
#pragma unroll
    for (int k = 0; k < RES_RPT; k++) {
        const i64 row = row0 + k * ROWS, r = row < rows ? row : 0;
        ld8<BF>(src_row<BF>(src, ts, hs, (int)(r / n_tokens), (int)(r % n_tokens)), lane * 8, v[k]);
        z[k] = NCENT ? packed[p.index + r] : 0;
    }
#pragma unroll
    for (int k = 0; k < RES_RPT; k++) {
        const i64 row = row0 + k * ROWS, r = row < rows ? row : 0;
        if (NCENT) kvf_load8f((const u16 *)(packed + p.centroids) + ((r / n_tokens) * NCENT + z[k]) * D + lane * 8, mu[k]);
        else
#pragma unroll
            for (int i = 0; i < 8; i++) mu[k][i] = 0.0f;
    }
#pragma unroll
    for (int k = 0; k < RES_RPT; k++) {
        const i64 r = row0 + k * ROWS, rr = r < rows ? r : 0;
        const i64 h = rr / n_tokens, t = rr % n_tokens;
        float res[8];
#pragma unroll
        for (int i = 0; i < 8; i++) res[i] = NCENT ? __fsub_rn(v[k][i], mu[k][i]) : v[k][i];
        // Outliers of the residual, kept as the input gives them.
        u16 raw[8];
        int oidx[PK > 0 ? PK : 1];
        if (PK || FB) kvf_load8(in.x + t * in.ts + h * in.hs + lane * 8, raw);
        if (PK) {
            kvf_pipe::pick<PK, LPR>(res, lane, oidx);
#pragma unroll
            for (int q = 0; q < PK; q++)
                if (oidx[q] / 8 == lane) {
                    if (r < rows) {
                        packed[pipe.planes.oidx + r * PK + q] = (u8)oidx[q];
                        ((u16 *)(packed + pipe.planes.oval))[r * PK + q] = raw[oidx[q] % 8];
                    }
                    res[oidx[q] % 8] = __int_as_float(0x7fc00000);
                }
        }
        kvf_quant::lane_out o;
        kvf_quant::encode8<BITS, LPG, LPR, MODE, SFMT>(res, o); // shuffles: every lane takes part
        if (r < rows) kvf_quant::store_row<D, BITS, G, MODE, SFMT>(packed, p, r, lane, o);
        if (WRITE_E && r < rows) {
            float rh[8], w[8];
            kvf_quant::decode8<BITS, MODE, SFMT>(o.q, o.scale, o.zero, o.tscale, rh);
#pragma unroll
            for (int i = 0; i < 8; i++) w[i] = __fsub_rn(v[k][i], NCENT ? __fadd_rn(mu[k][i], rh[i]) : rh[i]);
            float4 *er = (float4 *)(e_out + r * D + lane * 8);
            er[0] = make_float4(w[0], w[1], w[2], w[3]);
            er[1] = make_float4(w[4], w[5], w[6], w[7]);
        }
        if (!PIPE || (!PM && !FB)) continue;
        // The pipeline's refinement and carried error (kvf_rtn::encode's
        // order): y = (0 + mu) + r_hat, + the refinement, + the anchor's row,
        // the outliers as given.
        float rh[8], y[8], add[8];
        kvf_quant::decode8<BITS, MODE, SFMT>(o.q, o.scale, o.zero, o.tscale, rh);
#pragma unroll
        for (int i = 0; i < 8; i++) y[i] = __fadd_rn(NCENT ? __fadd_rn(0.0f, mu[k][i]) : 0.0f, rh[i]);
        if (PM) {
            constexpr int MCB = PM * PB / 8, W = MCB > 0 ? (MCB + 3) / 4 : 1;
            __shared__ u32 words[ROWS][W];
            u32 *mine = words[threadIdx.x / LPR];
            for (int w = lane; w < W; w += LPR) mine[w] = 0;
            __syncwarp();
            u8 map[8];
            kvf_pipe::map8<PM>(pipe.map + (u64)h * D, lane * 8, map);
            const u16 s16 = kvf_pipe::refine<PB, LPR>(res, rh, map, add, mine);
            __syncwarp();
            if (r < rows) {
                for (int b = lane; b < MCB; b += LPR) packed[pipe.planes.mcode + r * MCB + b] = (u8)(mine[b / 4] >> (8 * (b % 4)));
                if (lane == 0) ((u16 *)(packed + pipe.planes.mscale))[r] = s16;
            }
            __syncwarp(); // the next row's zeroing waits for these reads
#pragma unroll
            for (int i = 0; i < 8; i++)
                if (map[i] != 255) y[i] = __fadd_rn(y[i], add[i]);
        }
        if (FB && pipe.fb && r < rows) {
            if (AB && pipe.anchor.packed) {
                float a[8];
                kvf_pipe::anchor8<D, AB, G>(pipe.anchor, (u64)h * pipe.anchor.tokens + (u64)(t % pipe.anchor.tokens),
                                            lane * 8, a);
#pragma unroll
                for (int i = 0; i < 8; i++) y[i] = __fadd_rn(y[i], a[i]);
            }
#pragma unroll
            for (int q = 0; q < (PK > 0 ? PK : 0); q++)
                if (oidx[q] / 8 == lane) y[oidx[q] % 8] = kvf_bf16_to_f32(raw[oidx[q] % 8]);
            float e[8];
#pragma unroll
            for (int i = 0; i < 8; i++) e[i] = kvf_pipe::carried(kvf_bf16_to_f32(raw[i]), y[i]);
            float4 *fr = (float4 *)(pipe.fb + r * D + lane * 8);
            fr[0] = make_float4(e[0], e[1], e[2], e[3]);
            fr[1] = make_float4(e[4], e[5], e[6], e[7]);
        }
    }
}

} // namespace kvf_kmeans

// The residual's launch bounds by BF (a literal 0 or 1, as gen.c writes it).
#define KVF_RES_BOUNDS_0 __launch_bounds__(kvf_kmeans::BLOCK)
#define KVF_RES_BOUNDS_1 __launch_bounds__(kvf_kmeans::BLOCK, 4)

// BF: stage 0 reads the BF16 input directly (runtime/gpu/context.c reads it from
// assign_cfg); the generator sets it for unrotated single-stage sections.
// EXACT: the assignments agree with the CPU bit for bit (assign), else the
// fast assignment (assign_fast); the section's assign field (plan.c).
#define KVF_KMEANS_KERNELS(PREFIX, D, ROT, G, QSAC, BITS, MODE, SFMT, NCENT, BF, PK, PM, PB, AB, FB, EXACT)              \
    extern "C" __global__ void __launch_bounds__(kvf_kmeans::BLOCK)                                            \
    PREFIX##_prep(const kvf_kmeans_prep_params p) {                                                            \
        kvf_kmeans::prep<D, ROT, AB, G, FB>(p.in.x, p.in.ts, p.in.hs, p.n, p.nh, p.e, p.pipe);                 \
    }                                                                                                          \
    extern "C" __global__ void PREFIX##_init(const kvf_kmeans_init_params p) {                                 \
        kvf_kmeans::init<D, BF>(p.src.p, p.src.ts, p.src.hs, p.n, p.nh, p.c_eff, p.seed, p.stage, p.cent,     \
                                p.c_alloc, p.warm, p.c_warm);                                                  \
    }                                                                                                          \
    /* What runtime/gpu/launch.c launches the k-means kernels with (kvf_abi.h */                             \
    /* KVF_AC_*): the assignment's dynamic shared bytes (plain, QSAC), threads */                            \
    /* per block (plain, QSAC) and tokens per block (plain, QSAC), whether    */                            \
    /* stage 0 reads the BF16 input, the residual's rows per thread, the sums' */                           \
    /* block size.                                                             */                            \
    extern "C" __device__ const int PREFIX##_assign_cfg[KVF_AC_COUNT] = {                                     \
        kvf_kmeans::assign_smem_bytes<D, 1, EXACT>(), kvf_kmeans::assign_smem_bytes<D, QSAC, EXACT>(),         \
        kvf_kmeans::assign_warps<D, 1, EXACT>() * 32, kvf_kmeans::assign_warps<D, QSAC, EXACT>() * 32,          \
        kvf_kmeans::assign_warps<D, 1, EXACT>() * kvf_kmeans::TPW,                                             \
        kvf_kmeans::assign_warps<D, QSAC, EXACT>() * kvf_kmeans::TPW, BF, kvf_kmeans::RES_RPT,                 \
        kvf_kmeans::SUM_THREADS};                                                                              \
    /* Filter statistics, counted while [0] != 0 (bench/bench.c sets it):       */                      \
    /* kvf_abi.h's KVF_AS_* (assign's stats). QSAC's are its own.                */                      \
    extern "C" __device__ unsigned long long PREFIX##_assign_stats[1 + KVF_AS_N] = {};                       \
    extern "C" __global__ void __launch_bounds__(kvf_kmeans::assign_warps<D, 1, EXACT>() * 32, 1)              \
    PREFIX##_assign(const kvf_kmeans_assign_params p) {                                                        \
        if constexpr (EXACT)                                                                                   \
            kvf_kmeans::assign<D, G, 1, BF>(p.src.p, p.src.ts, p.src.hs, p.n, p.nh, p.c_eff, p.cent, p.c_alloc, \
                                            p.idx_ws, p.idx_plane, 0,                                          \
                                            PREFIX##_assign_stats[0] ? PREFIX##_assign_stats + 1 : 0);        \
        else                                                                                                   \
            kvf_kmeans::assign_fast<D, G, 1, BF>(p.src.p, p.src.ts, p.src.hs, p.n, p.nh, p.c_eff, p.cent,      \
                                                 p.c_alloc, p.idx_ws, p.idx_plane, 0,                          \
                                                 PREFIX##_assign_stats[0] ? PREFIX##_assign_stats + 1 : 0);   \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(kvf_kmeans::SUM_THREADS, 1)                                   \
    PREFIX##_accumulate(const kvf_kmeans_accumulate_params p) {                                                \
        kvf_kmeans::accumulate<D, BF>(p.src.p, p.src.ts, p.src.hs, p.idx, p.n, p.c_eff, p.chunk, p.acc, p.cnt); \
    }                                                                                                          \
    extern "C" __global__ void PREFIX##_finalize(const kvf_kmeans_finalize_params p) {                         \
        kvf_kmeans::finalize<D>(p.nh, p.c_eff, p.parts, p.acc, p.cnt, p.cent, p.c_alloc);                      \
    }                                                                                                          \
    extern "C" __global__ void PREFIX##_pad(const kvf_kmeans_pad_params p) {                                   \
        kvf_kmeans::pad<D>(p.nh, p.c_eff, p.c_alloc, p.cent);                                                  \
    }                                                                                                          \
    extern "C" __global__ void PREFIX##_subtract(const kvf_kmeans_subtract_params p) {                         \
        kvf_kmeans::subtract<D, (NCENT > 0 ? NCENT : 1)>(p.e, p.n, p.nh, p.packed, p.planes);                  \
    }                                                                                                          \
    extern "C" __global__ void KVF_RES_BOUNDS_##BF                                                            \
    PREFIX##_residual(const kvf_kmeans_residual_params p) {                                                    \
        if (p.write_e)                                                                                         \
            kvf_kmeans::residual<D, BITS, G, MODE, SFMT, NCENT, 1, BF, PK, PM, PB, AB, FB>(                    \
                p.src.p, p.src.ts, p.src.hs, p.e_out, p.n, p.nh, p.packed, p.planes, p.in, p.pipe);           \
        else                                                                                                   \
            kvf_kmeans::residual<D, BITS, G, MODE, SFMT, NCENT, 0, BF, PK, PM, PB, AB, FB>(                    \
                p.src.p, p.src.ts, p.src.hs, p.e_out, p.n, p.nh, p.packed, p.planes, p.in, p.pipe);           \
    }

// QSAC's assignment (keys with qsac_candidates > 1 only). It needs nothing of
// KVF_KMEANS_KERNELS of the same PREFIX (runtime/gpu/context.c reads its launch
// shape from that one's assign_cfg), so the JIT compiles it as a program of
// its own (gen/gen.c); its filter statistics are its own global, as above.
#define KVF_KMEANS_QSAC_KERNEL(PREFIX, D, G, QSAC, BF, EXACT)                                                 \
    extern "C" __device__ unsigned long long PREFIX##_assign_qsac_stats[1 + KVF_AS_N] = {};                  \
    extern "C" __global__ void __launch_bounds__(kvf_kmeans::assign_warps<D, QSAC, EXACT>() * 32, 1)           \
    PREFIX##_assign_qsac(const kvf_kmeans_assign_params p) {                                                   \
        if constexpr (EXACT)                                                                                   \
            kvf_kmeans::assign<D, G, QSAC, BF>(p.src.p, p.src.ts, p.src.hs, p.n, p.nh, p.c_eff, p.cent,        \
                                               p.c_alloc, 0, p.idx_plane, p.weights,                           \
                                               PREFIX##_assign_qsac_stats[0] ? PREFIX##_assign_qsac_stats + 1 : 0); \
        else                                                                                                   \
            kvf_kmeans::assign_fast<D, G, QSAC, BF>(p.src.p, p.src.ts, p.src.hs, p.n, p.nh, p.c_eff, p.cent,   \
                                                    p.c_alloc, 0, p.idx_plane, p.weights,                      \
                                                    PREFIX##_assign_qsac_stats[0] ? PREFIX##_assign_qsac_stats + 1 \
                                                                                  : 0);                        \
    }
