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
//
// Two more kernels tell the byte mix from the probe's form
// (docs/journal/benchmarks.md, entry d1237b7): the same codes, scales and
// rows with no thread doing both (of every SPLIT + 1 blocks, SPLIT write one
// tile's rows each and one reads those tiles' codes and scales with 16- and
// 8-byte loads), and the rows' 16-byte stores alone (one a thread, the
// fastest store kernel measured there).
#include "kvf_common.cuh"

namespace kvf_probe {

constexpr int BLOCK = 256, LPR = 16, ROWS = BLOCK / LPR, RPT = 4, TILE = ROWS * RPT;
constexpr int CODE_BYTES = 32, SZ_BYTES = 8, ROW_BYTES = 256, TABLE_ROWS = 256, SPLIT = 8;

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

// kvf_probe_int2's bytes, readers and writers in separate blocks: block x is
// the writer of tile (x / (SPLIT + 1)) * SPLIT + x % (SPLIT + 1), or for
// x % (SPLIT + 1) == SPLIT the reader of that group's SPLIT tiles.
__device__ __forceinline__ void split(const u8 *__restrict__ codes, const u8 *__restrict__ sz, u8 *__restrict__ out,
                                      u32 n) {
    const u64 head = (u64)blockIdx.z * gridDim.y + blockIdx.y, base = head * n;
    const u32 grp = blockIdx.x / (SPLIT + 1), role = blockIdx.x % (SPLIT + 1);
    if (role < SPLIT) {
        const int lane = threadIdx.x % LPR, sub = threadIdx.x / LPR;
        const u32 t0 = (grp * SPLIT + role) * (u32)TILE;
#pragma unroll
        for (int u = 0; u < RPT; u++) {
            const u32 t = t0 + (u32)(u * ROWS + sub);
            if (t < n) kvf_st16(out + (base + t) * ROW_BYTES + lane * 16, t, t ^ 1u, t ^ 2u, t ^ 3u);
        }
        return;
    }
    const u32 r0 = grp * SPLIT * (u32)TILE, r1 = min(r0 + SPLIT * (u32)TILE, n);
    if (r0 >= r1) return;
    u32 acc = 0;
    const u8 *c = codes + (base + r0) * CODE_BYTES; // 32-byte rows: 16-byte aligned
    for (u32 i = threadIdx.x; i < (r1 - r0) * (CODE_BYTES / 16); i += BLOCK) {
        const uint4 v = kvf_ldg16(c + (u64)i * 16);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    const u8 *z = sz + (base + r0) * SZ_BYTES; // 8-byte rows: 8-byte aligned
    for (u32 i = threadIdx.x; i < (r1 - r0) * (SZ_BYTES / 8); i += BLOCK) {
        const uint2 v = kvf_ldg_u64(z + (u64)i * 8);
        acc ^= v.x ^ v.y;
    }
    if (acc == 0x9e3779b9u) out[(base + r0) * ROW_BYTES] = 1; // keeps the loads; the value means nothing
}

} // namespace kvf_probe

// The launch geometry and the planes' sizes, read by the bench from the
// module (so they are stated once, here): BLOCK, TILE, CODE_BYTES, SZ_BYTES,
// ROW_BYTES, TABLE_ROWS, SPLIT.
extern "C" __device__ const unsigned kvf_probe_geometry[7] = {
    kvf_probe::BLOCK,     kvf_probe::TILE,       kvf_probe::CODE_BYTES, kvf_probe::SZ_BYTES,
    kvf_probe::ROW_BYTES, kvf_probe::TABLE_ROWS, kvf_probe::SPLIT};

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

// Grid (ceil(ceil(n / TILE) / SPLIT) * (SPLIT + 1), heads, 2), BLOCK threads;
// the planes as above (idx and table unused).
extern "C" __global__ void __launch_bounds__(kvf_probe::BLOCK)
kvf_probe_int2_split(const u8 *codes, const u8 *sz, const u8 *idx, const u8 *table, u8 *out, u32 n) {
    (void)idx, (void)table;
    kvf_probe::split(codes, sz, out, n);
}

// The rows' stores alone: grid (ceil(n * ROW_BYTES / 16 / BLOCK), heads, 2),
// one 16-byte store a thread over [2][heads][n] rows of ROW_BYTES.
extern "C" __global__ void __launch_bounds__(kvf_probe::BLOCK)
kvf_probe_write(const u8 *codes, const u8 *sz, const u8 *idx, const u8 *table, u8 *out, u32 n) {
    (void)codes, (void)sz, (void)idx, (void)table;
    const u64 head = (u64)blockIdx.z * gridDim.y + blockIdx.y;
    const u64 i = (u64)blockIdx.x * kvf_probe::BLOCK + threadIdx.x; // 16-byte piece of the head's rows
    if (i < (u64)n * (kvf_probe::ROW_BYTES / 16))
        kvf_st16(out + head * n * kvf_probe::ROW_BYTES + i * 16, (u32)i, 1u, 2u, 3u);
}
