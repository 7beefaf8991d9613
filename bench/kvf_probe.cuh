// kvforge benchmark probe (bench/bench.c), not a scheme's kernel: an INT2
// decode's bytes with no arithmetic to speak of, a reference a decode is
// measured against beside the copy and write ceilings (docs/BENCHMARKS.md).
// Embedded in kvf_bench only (Makefile), compiled by NVRTC with the
// library's templates as include files.
//
// Per row (token, head) at head_dim 128 it reads what qvg_int2's decode
// reads: 32 bytes of codes and 8 of group scales and zeros (2 groups of 64,
// FP16 scale and zero); with GATHER also a 1-byte centroid index and that
// centroid's 256-byte BF16 row from the head's 64 KiB table. It writes the
// row's 256 bytes. Lanes, rows a thread and load order as kvf_decode.cuh (16
// lanes a row, 16-byte stores, every load of a thread's rows issued first);
// one tile a block; K and V in one launch (blockIdx.z). The only arithmetic,
// a shift, a multiply and an xor a word, uses what was loaded; the values
// written mean nothing.
#include "kvf_common.cuh"

namespace kvf_probe {

constexpr int BLOCK = 256, LPR = 16, ROWS = BLOCK / LPR, RPT = 4, TILE = ROWS * RPT;
constexpr int CODE_BYTES = 32, SZ_BYTES = 8, ROW_BYTES = 256, TABLE_ROWS = 256;

template <bool GATHER>
__device__ __forceinline__ void mix(const u8 *__restrict__ codes, const u8 *__restrict__ sz,
                                    const u8 *__restrict__ idx, const u8 *__restrict__ table, u8 *__restrict__ out,
                                    u32 n) {
    const int lane = threadIdx.x % LPR, sub = threadIdx.x / LPR;
    const u64 head = (u64)blockIdx.z * gridDim.y + blockIdx.y, base = head * n; // over K's heads, then V's
    const u32 t0 = blockIdx.x * (u32)TILE;
    u32 c[RPT], s[RPT], ix[RPT];
    uint4 m[RPT];
#pragma unroll
    for (int u = 0; u < RPT; u++) {
        const u64 r = base + min(t0 + (u32)(u * ROWS + sub), n - 1);
        c[u] = kvf_ldg_u16(codes + r * CODE_BYTES + lane * 2);
        s[u] = kvf_ldg_u32(sz + r * SZ_BYTES + (lane / 8) * 4);
        if (GATHER) ix[u] = kvf_ldg_u8(idx + r);
    }
    if (GATHER) {
#pragma unroll
        for (int u = 0; u < RPT; u++) m[u] = kvf_ldg16(table + (head * TABLE_ROWS + ix[u]) * ROW_BYTES + lane * 16);
    }
#pragma unroll
    for (int u = 0; u < RPT; u++) {
        const u32 t = t0 + (u32)(u * ROWS + sub);
        if (t >= n) continue;
        u32 w[4];
#pragma unroll
        for (int k = 0; k < 4; k++) w[k] = (((c[u] >> (4 * k)) & 15u) * 0x00010001u) ^ s[u];
        if (GATHER) w[0] += m[u].x, w[1] += m[u].y, w[2] += m[u].z, w[3] += m[u].w;
        kvf_st16(out + (base + t) * ROW_BYTES + lane * 16, w[0], w[1], w[2], w[3]);
    }
}

} // namespace kvf_probe

// The launch geometry and the planes' sizes, read by the bench from the
// module (so they are stated once, here): BLOCK, TILE, CODE_BYTES, SZ_BYTES,
// ROW_BYTES, TABLE_ROWS.
extern "C" __device__ const unsigned kvf_probe_geometry[6] = {kvf_probe::BLOCK,      kvf_probe::TILE,
                                                              kvf_probe::CODE_BYTES, kvf_probe::SZ_BYTES,
                                                              kvf_probe::ROW_BYTES,  kvf_probe::TABLE_ROWS};

// Grid (ceil(n / TILE), heads, 2), BLOCK threads. n: tokens; the planes are
// [2][heads][n] rows of CODE_BYTES, SZ_BYTES, 1 (idx) and ROW_BYTES (out);
// table [2][heads][TABLE_ROWS][ROW_BYTES].
extern "C" __global__ void __launch_bounds__(kvf_probe::BLOCK)
kvf_probe_int2(const u8 *codes, const u8 *sz, const u8 *idx, const u8 *table, u8 *out, u32 n) {
    kvf_probe::mix<false>(codes, sz, idx, table, out, n);
}

extern "C" __global__ void __launch_bounds__(kvf_probe::BLOCK)
kvf_probe_int2_gather(const u8 *codes, const u8 *sz, const u8 *idx, const u8 *table, u8 *out, u32 n) {
    kvf_probe::mix<true>(codes, sz, idx, table, out, n);
}
