// kvforge kernel template: RTN encode (round to nearest, no smoothing), and
// QuaRot-style RTN when ROT rotates each row by the normalized Hadamard
// transform first (METHODS.md 5).
//
// One lane owns 8 consecutive channels of one (head, token) row (one 16-byte
// load); D/8 lanes cover a row. The quantizer is kvf_quant.cuh's; decode is
// kvf_decode.cuh's. CPU reference: runtime/cpu/ref_quant.c, runtime/cpu/ref_encode.c.
#pragma once
#include "kvf_pipeline.cuh"

namespace kvf_rtn {

constexpr int BLOCK = KVF_BLOCK; // kvf_abi.h: the host sizes grids with it
// Blocks an SM must hold when unrotated: 32 registers, full occupancy on
// archs of 2048 threads an SM such as sm_80 and sm_90 (rtn_int2's encode
// 0.354 ms on the H200; 0.377 ms at 33 registers, 6 blocks). On archs of
// 1536 threads (sm_86, sm_89, sm_12x) ptxas ignores a minimum it cannot
// meet (its own choice, e.g. 36 registers on sm_86/89). The rotated encode
// takes a minimum of 1 block (quarot_int2: 32 registers on sm_80/90; with
// no bound, as before session 10, 30; occupancy is full either way).
constexpr int MIN_BLOCKS = 8;

// The pipeline (METHODS.md 11, kvf_pipeline.cuh): PK outliers a row, PM
// refined channels of PB bits, an anchor of AB bits, FB the carried error.
// Without any (0s) this is the plain RTN encode.
template <int D, int BITS, int G, int MODE, int SFMT, int ROT, int PK, int PM, int PB, int AB, int FB>
__device__ __forceinline__ void encode(const u16 *__restrict__ x, i64 token_stride, i64 head_stride, int n_tokens,
                                       int n_heads, u8 *__restrict__ packed, kvf_quant::stage_planes planes,
                                       int write_header, kvf_header_words hdr, const kvf_pipe_io &pipe) {
    constexpr int LPR = D / 8, LPG = G / 8, ROWS = BLOCK / LPR;
    static_assert(D % G == 0 && G % 8 == 0 && LPG <= 32, "group shape");
    if (write_header && blockIdx.x == 0 && threadIdx.x == 0) kvf_write_header(packed, hdr);
    const int lane = threadIdx.x % LPR;
    const i64 row = (i64)blockIdx.x * ROWS + threadIdx.x / LPR;
    const bool live = row < (i64)n_tokens * n_heads;
    const i64 h = live ? row / n_tokens : 0, t = live ? row % n_tokens : 0;
    u16 raw[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (live) kvf_load8(x + t * token_stride + h * head_stride + lane * 8, raw);
    if (BITS == 16) {
        if (live) kvf_store8((u16 *)(packed + planes.codes) + row * D + lane * 8, raw);
        return;
    }
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = kvf_bf16_to_f32(raw[i]);
    if (ROT) kvf_fwht_row<D>(v, lane);
    // What is quantized: the input, less the anchor's row, plus decay times
    // the carried error.
    float a[8], fb[8];
    if (AB && pipe.anchor.packed) {
        kvf_pipe::anchor8<D, AB, G>(pipe.anchor, (u64)h * pipe.anchor.tokens + (u64)(t % pipe.anchor.tokens), lane * 8, a);
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = __fsub_rn(v[i], a[i]);
    }
    float *const fb_row = FB && pipe.fb ? pipe.fb + row * D + lane * 8 : nullptr;
    if (FB && fb_row && pipe.fb_in && live) {
        const float4 f0 = ((const float4 *)fb_row)[0], f1 = ((const float4 *)fb_row)[1];
        fb[0] = f0.x, fb[1] = f0.y, fb[2] = f0.z, fb[3] = f0.w, fb[4] = f1.x, fb[5] = f1.y, fb[6] = f1.z, fb[7] = f1.w;
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = __fadd_rn(v[i], __fmul_rn(pipe.decay, fb[i]));
    }
    // Outliers: taken out (NaN: no group's scale sees them), kept as given.
    int oidx[PK > 0 ? PK : 1];
    if (PK) {
        kvf_pipe::pick<PK, LPR>(v, lane, oidx);
#pragma unroll
        for (int k = 0; k < PK; k++)
            if (oidx[k] / 8 == lane) {
                const int i = oidx[k] % 8;
                if (live) {
                    packed[pipe.planes.oidx + row * PK + k] = (u8)oidx[k];
                    ((u16 *)(packed + pipe.planes.oval))[row * PK + k] = raw[i];
                }
                v[i] = __int_as_float(0x7fc00000);
            }
    }
    kvf_quant::lane_out o;
    kvf_quant::encode8<BITS, LPG, LPR, MODE, SFMT>(v, o); // every lane joins the shuffles
    if (live) kvf_quant::store_row<D, BITS, G, MODE, SFMT>(packed, planes, row, lane, o);
    if (!PM && !FB) return;
    // What decode returns: y = 0 + r_hat, + the refinement, + the anchor's
    // row, the outliers as given; the carried error is the input minus it.
    float rh[8], y[8], add[8];
    kvf_quant::decode8<BITS, MODE, SFMT>(o.q, o.scale, o.zero, o.tscale, rh);
#pragma unroll
    for (int i = 0; i < 8; i++) y[i] = __fadd_rn(0.0f, rh[i]);
    if (PM) {
        constexpr int MCB = PM * PB / 8, W = MCB > 0 ? (MCB + 3) / 4 : 1;
        __shared__ u32 words[ROWS][W];
        u32 *mine = words[threadIdx.x / LPR];
        for (int w = lane; w < W; w += LPR) mine[w] = 0;
        __syncwarp();
        u8 map[8];
        kvf_pipe::map8<PM>(pipe.map + (u64)h * D, lane * 8, map);
        const u16 s16 = kvf_pipe::refine<PB, LPR>(v, rh, map, add, mine);
        __syncwarp();
        if (live) {
            for (int b = lane; b < MCB; b += LPR)
                packed[pipe.planes.mcode + row * MCB + b] = (u8)(mine[b / 4] >> (8 * (b % 4)));
            if (lane == 0) ((u16 *)(packed + pipe.planes.mscale))[row] = s16;
        }
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (map[i] != 255) y[i] = __fadd_rn(y[i], add[i]);
    }
    if (!FB || !fb_row || !live) return;
    if (AB && pipe.anchor.packed)
#pragma unroll
        for (int i = 0; i < 8; i++) y[i] = __fadd_rn(y[i], a[i]);
#pragma unroll
    for (int k = 0; k < (PK > 0 ? PK : 0); k++)
        if (oidx[k] / 8 == lane) y[oidx[k] % 8] = kvf_bf16_to_f32(raw[oidx[k] % 8]);
    float e[8];
#pragma unroll
    for (int i = 0; i < 8; i++) e[i] = kvf_pipe::carried(kvf_bf16_to_f32(raw[i]), y[i]);
    ((float4 *)fb_row)[0] = make_float4(e[0], e[1], e[2], e[3]);
    ((float4 *)fb_row)[1] = make_float4(e[4], e[5], e[6], e[7]);
}

} // namespace kvf_rtn

#define KVF_RTN_ENCODE_KERNEL(NAME, D, BITS, G, MODE, SFMT, ROT, PK, PM, PB, AB, FB)                   \
    extern "C" __global__ void __launch_bounds__(kvf_rtn::BLOCK,                                   \
                                                 ROT || PK || PM || AB || FB ? 1 : kvf_rtn::MIN_BLOCKS) \
    NAME(const kvf_encode_params p) {                                                              \
        kvf_rtn::encode<D, BITS, G, MODE, SFMT, ROT, PK, PM, PB, AB, FB>(                          \
            p.in.x, p.in.ts, p.in.hs, p.n_tokens, p.n_heads, p.packed, p.planes, p.write_header, p.hdr, p.pipe); \
    }
