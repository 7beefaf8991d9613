// kvforge kernel template: RTN encode (round to nearest, no smoothing), and
// QuaRot-style RTN when ROT rotates each row by the normalized Hadamard
// transform first (METHODS.md 5).
//
// One lane owns 8 consecutive channels of one (head, token) row (one 16-byte
// load); D/8 lanes cover a row. The quantizer is kvf_quant.cuh's; decode is
// kvf_decode.cuh's. CPU reference: runtime/cpu/ref_quant.c, runtime/cpu/ref_encode.c.
#pragma once
#include "kvf_quant.cuh"

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

template <int D, int BITS, int G, int MODE, int SFMT, int ROT>
__device__ __forceinline__ void encode(const u16 *__restrict__ x, i64 token_stride, i64 head_stride, int n_tokens,
                                       int n_heads, u8 *__restrict__ packed, kvf_quant::stage_planes planes,
                                       int write_header, kvf_header_words hdr) {
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
    kvf_quant::lane_out o;
    kvf_quant::encode8<BITS, LPG, LPR, MODE, SFMT>(v, o); // every lane joins the shuffles
    if (live) kvf_quant::store_row<D, BITS, G, MODE, SFMT>(packed, planes, row, lane, o);
}

} // namespace kvf_rtn

#define KVF_RTN_ENCODE_KERNEL(NAME, D, BITS, G, MODE, SFMT, ROT)                                   \
    extern "C" __global__ void __launch_bounds__(kvf_rtn::BLOCK, ROT ? 1 : kvf_rtn::MIN_BLOCKS)     \
    NAME(const kvf_encode_params p) {                                                              \
        kvf_rtn::encode<D, BITS, G, MODE, SFMT, ROT>(p.in.x, p.in.ts, p.in.hs, p.n_tokens,         \
                                                     p.n_heads, p.packed, p.planes, p.write_header, p.hdr); \
    }
