// kvforge kernel template: the fused decode of every method (METHODS.md 1).
//
// One kernel for both tensor sections: per (head, token) row it unpacks and
// dequantizes every stage, gathers the stage's centroid, adds the PSAC term,
// undoes the Hadamard rotation, applies RoPE to keys cached before RoPE, and
// writes BF16 for the caller's attention. Lane layout: CPL = 8 channels per
// lane as kvf_rtn.cuh (D/8 lanes per row), or 16 where lane_channels allows.
// CPU reference: runtime/cpu/ref_encode.c.
//
// Launch (runtime/gpu/context.c, kvf_decode): one kernel for K and V, grid
// (k_blocks + v_blocks, n_heads), BLOCK threads. blockIdx.y is the head;
// blocks x < k_blocks decode the keys, the others the values (one launch: the
// values' blocks fill the keys' last wave; K+V 1-4% faster than two launches,
// docs/BENCHMARKS.md, session 11). A section's block b of nb takes token
// tiles b, b + nb, ... of TILE = ROWS * RPT tokens, so any nb is correct and
// the host only tunes it. A thread keeps one head: per-head data (plane
// bases, the PSAC basis) is set up once, every index is 32-bit token math (no
// 64-bit division).
//
// Throughput: the kernel writes ~8x the bytes it reads (INT2) and is limited
// by instructions, not by memory, unless each lane-row (8 channels) stays
// near 100 instructions. Hence: RPT rows' loads issued before any arithmetic,
// codes turned into floats with the exponent trick instead of I2F (quarter
// rate), bf16x2 conversions in hardware, one 16-byte store per lane-row.
// qvg_int2's key loop is at about 100 per lane-row; fewer did not help it:
// 16 channels a lane (about 86 per 8 channels, with half the rows a thread)
// decoded it slower (session 15, lane_channels).
#pragma once
#include "kvf_pipeline.cuh"


namespace kvf_decode {

constexpr int BLOCK = KVF_BLOCK; // kvf_abi.h: the host sizes grids with it

// Rows of one thread whose loads are in flight together (all of the same
// head, ROWS tokens apart, so each load instruction of a warp is coalesced).
// runtime/gpu/context.c sizes the grid for 4 (and several tiles per block); a
// different value here changes speed, not results. PSAC keys: 2 rows of 8 or
// 16 channels (at 8 channels 3 rows also fit 64 registers and read as fast
// as 2, quantwm_int2 0.193-0.195 ms; 4 rows under a bound of 3 blocks an SM,
// 79 registers, 0.200-0.203: session 17, run 1; at 16 channels 3 rows
// spill).
//
// Channels per lane (CPL): 8, or 16 as two halves of 8 channels D/2 apart
// (the 8-channel lanes l and l + D/16, so each 16-byte store instruction of
// a warp still writes whole 32-byte sectors). A 16-channel lane-row shares
// its token's addresses, clamps, centroid index, token scale and NaN branch
// over 16 channels (qvg_int2's key loop: about 86 instructions per 8
// channels against 100, counted in the SASS), with half the rows a thread,
// so the same bytes in flight. Measured on the H200 (docs/BENCHMARKS.md,
// session 15), decode K+V against 8 channels everywhere (runs 2-3):
// quantwm_int2 0.205-0.208 -> 0.199-0.203 ms (its values, int8_fp16 scales,
// take 16), but qvg_int2 0.162-0.166 -> 0.166-0.169 and qvg_int4 0.171-0.175
// -> 0.177-0.178 (fp16 scales), rtn_int2 and kivi_int2 the same; 16
// contiguous channels a lane (half a sector a store instruction) read
// rtn_int2 0.150-0.153 -> 0.200-0.202 ms (run 1). So 16 for int8_fp16 scales
// only, where quantwm's values (d = 128, groups of 64 channels, 2 and 4
// bits, 256 centroids) measured faster; other int8_fp16 shapes take it by
// inference. Per-token groups (axis "channel": a group is G channels of one
// token) and no rotation or RoPE, whose lanes mix or keep per-channel data in
// registers. PSAC keys take 16 too since session 17, their basis being in
// shared memory (decode): quantwm_int2's decode K+V 0.199-0.201 -> 0.181-0.183
// ms, quantwm_int4's 0.203-0.205 -> 0.190-0.191 (run 2, 4 rounds; the basis
// in shared memory at 8 channels alone: 0.194-0.195 ms with 2 rows a thread,
// 0.193-0.195 with 3, run 1). Other PSAC shapes take it by inference (not
// run; compiled, sm_90: head_dim 256 at rank <= 8 takes 73-76 registers
// instead of 62-64, ranks 16-32 fewer than before).
template <int D, int BITS, int SFMT, int AXIS, int PSAC_R, int ROT, int ROPE>
__host__ __device__ constexpr int lane_channels() {
    return BITS < 16 && SFMT == KVF_SCALE_INT8_FP16 && AXIS == KVF_AXIS_CHANNEL && !ROT &&
                   ROPE == KVF_DECODE_ROPE_NONE && D % 16 == 0
               ? 16
               : 8;
}
template <int NCENT, int STAGES, int PSAC_R, int CPL = 8>
struct tiling {
    static constexpr int RPT = PSAC_R ? 2 : ((NCENT && STAGES > 2) ? 2 : 4) * 8 / CPL;
};

typedef kvf_section_planes section_planes;
typedef kvf_rope_args rope_args;

// Codes as floats without I2F (a quarter-rate conversion): the code's bits
// are OR-ed into the mantissa of 2^23 at bit P (P + BITS <= 23), which gives
// the float 2^23 + q * 2^P exactly, and subtracting 2^23 (or 2^23 + z * 2^P
// for a small integer z) leaves (q - z) * 2^P exactly: one integer op and one
// float add per code. P is where the code already sits in its 32-bit word
// (codes above bit 23 - BITS are taken from the word shifted down by 16), so
// no shift per code. The scale is multiplied by 2^-P instead, which is exact
// (f16 scales are >= 2^-24, 2^-24 * 2^-16 is a normal f32), and
// fma(S * 2^-P, (q - z) * 2^P, c) is fma(S, q - z, c): the same real product,
// rounded once. So every result is the reference's bit for bit.
__host__ __device__ constexpr int code_shift(int bits, int i) { return (i * bits) & 31; }
__host__ __device__ constexpr bool code_high(int bits, int i) { return code_shift(bits, i) + bits > 23; }
__host__ __device__ constexpr int code_pos(int bits, int i) {
    return code_high(bits, i) ? code_shift(bits, i) - 16 : code_shift(bits, i);
}
constexpr float MAGIC = 8388608.0f; // 2^23
__device__ __forceinline__ float kvf_magic(u32 bits) { return __uint_as_float(0x4b000000u | bits); }
__device__ __forceinline__ float pow2(int e) { return __uint_as_float((u32)(127 + e) << 23); } // -126 <= e <= 127

// A pointer the compiler must take as it is: per-head bases computed once
// stay in registers (otherwise they are re-associated into every row's
// address, which then costs several 64-bit adds instead of one multiply-add).
template <typename T>
__device__ __forceinline__ T *opaque(T *p) {
    asm("mov.b64 %0, %0;" : "+l"(p));
    return p;
}
__device__ __forceinline__ u32 opaque(u32 v) {
    asm("mov.b32 %0, %0;" : "+r"(v));
    return v;
}

// A lane-row's codes: 8 x BITS bits (hi: the upper word at BITS = 8).
struct code_word { u32 lo, hi; };

template <int BITS>
__device__ __forceinline__ code_word load_code_word(const u8 *p) {
    code_word c;
    if (BITS == 2) c.lo = kvf_ldg_u16(p), c.hi = 0;
    else if (BITS == 4) c.lo = kvf_ldg_u32(p), c.hi = 0;
    else {
        const uint2 w = kvf_ldg_u64(p);
        c.lo = w.x, c.hi = w.y;
    }
    return c;
}

// Ternary (kvf_abi.h): the field of the row's 8-channel block b (at row bit
// 13b, in 2 or 3 bytes) as the INT2 code word load_code_word reads (code i
// at bits 2i). F = lo + 81 hi: lut (ternary_lut) turns lo (codes 0-3) and
// hi (codes 4-7) into 4 codes each, one division by 81 and two shared-memory
// reads instead of seven divisions by 3 (the decode is instruction-bound). A
// corrupt field >= 3^8 has hi up to 101, whose last code is hi / 27 = F /
// 3^7 (at most 3), as the CPU reference decodes it.
__device__ __forceinline__ code_word load_ternary_word(const u8 *row, int b, const u8 *lut) {
    const int bit = KVF_TERNARY_FIELD_BITS * b, at = bit >> 3, sh = bit & 7;
    u32 w = kvf_ldg_u8(row + at) | kvf_ldg_u8(row + at + 1) << 8;
    if (sh + KVF_TERNARY_FIELD_BITS > 16) w |= kvf_ldg_u8(row + at + 2) << 16;
    const u32 f = (w >> sh) & ((1u << KVF_TERNARY_FIELD_BITS) - 1u), hi = f / 81u;
    code_word c;
    c.lo = (u32)lut[f - 81u * hi] | (u32)lut[hi] << 8, c.hi = 0;
    return c;
}

// Entry x < 128 of the table above: x's base-3 digits x%3, x/3%3, x/9%3 and
// the quotient x/27 as 2-bit codes (x <= 101: the quotient is at most 3).
__device__ __forceinline__ u8 ternary_lut(u32 x) {
    return (u8)((x % 3u) | (x / 3u % 3u) << 2 | (x / 9u % 3u) << 4 | (x / 27u & 3u) << 6);
}

// 0x4b000000 (2^23) in a register: (w & mask) | exponent is then one LOP3
// (it takes one immediate, the mask) instead of two. ptxas folds any
// constant it can see, so it is built from zero = a kernel argument that is
// 0 at run time (n_tokens >> 31: n_tokens is never negative).
__device__ __forceinline__ u32 magic_reg(u32 zero) {
    return opaque(0x4b000000u | zero); // and NVVM must not re-associate the OR
}

// Code i of a lane-row as 2^23 + q_i * 2^code_pos(BITS, i); e = magic_reg().
template <int BITS>
__device__ __forceinline__ float code_magic(const code_word &c, int i, u32 e) {
    u32 w = BITS == 8 && i >= 4 ? c.hi : c.lo;
    if (code_high(BITS, i)) w >>= 16;
    return __uint_as_float(e | (w & (((1u << BITS) - 1u) << code_pos(BITS, i))));
}

__device__ __forceinline__ float rope_inv_freq(int pair, const rope_args &r) {
    int start = 0, a = 0;
    while (a + 1 < r.n_sections && pair >= start + r.sections[a]) start += r.sections[a++];
    const double frac = 2.0 * (double)(pair - start) / (double)(2 * r.sections[a]);
    return (float)exp2(-frac * r.log2_theta);
}

__device__ __forceinline__ int rope_axis(int pair, const rope_args &r) {
    int start = 0, a = 0;
    while (a + 1 < r.n_sections && pair >= start + r.sections[a]) start += r.sections[a++];
    return a;
}

template <int D, int ROPE>
__device__ __forceinline__ void apply_rope(float y[8], int lane, const int *pos_row, const rope_args &r) {
    if (ROPE == KVF_DECODE_ROPE_HALF) {
        constexpr int LPR = D / 8;
        const bool first = lane < LPR / 2;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const float other = __shfl_xor_sync(0xffffffffu, y[i], LPR / 2);
            const int c = lane * 8 + i, pair = first ? c : c - D / 2;
            const float ang = __fmul_rn((float)pos_row[rope_axis(pair, r)], rope_inv_freq(pair, r));
            const float cs = cosf(ang), sn = sinf(ang);
            const float x1 = first ? y[i] : other, x2 = first ? other : y[i];
            y[i] = first ? __fsub_rn(__fmul_rn(x1, cs), __fmul_rn(x2, sn)) : __fadd_rn(__fmul_rn(x2, cs), __fmul_rn(x1, sn));
        }
    } else if (ROPE == KVF_DECODE_ROPE_INTERLEAVED) {
#pragma unroll
        for (int i = 0; i < 8; i += 2) {
            const int pair = (lane * 8 + i) / 2;
            const float ang = __fmul_rn((float)pos_row[rope_axis(pair, r)], rope_inv_freq(pair, r));
            const float cs = cosf(ang), sn = sinf(ang), x1 = y[i], x2 = y[i + 1];
            y[i] = __fsub_rn(__fmul_rn(x1, cs), __fmul_rn(x2, sn));
            y[i + 1] = __fadd_rn(__fmul_rn(x2, cs), __fmul_rn(x1, sn));
        }
    }
}

// A lane-row's NH halves of 8 f32 values (HALF channels apart) as FORMAT.md's
// output_bf16, one 16-byte store a half. The NaN fix runs only for a lane
// that holds a NaN: four setp per 8 values instead of two selects per value
// (the branch is taken by NaN rows only).
template <int NH, int HALF>
__device__ __forceinline__ void store_row(u16 *dst, const float (&y)[NH][8]) {
    static_assert(NH == 1 || NH == 2, "8 or 16 channels a lane");
    u32 w[NH][4];
#pragma unroll
    for (int hf = 0; hf < NH; hf++)
#pragma unroll
        for (int k = 0; k < 4; k++) w[hf][k] = kvf_cvt_bf16x2(y[hf][2 * k], y[hf][2 * k + 1]);
    if (NH == 1 ? kvf_any_nan8(y[0]) : kvf_any_nan16(y[0], y[NH - 1])) {
#pragma unroll
        for (int hf = 0; hf < NH; hf++)
#pragma unroll
            for (int k = 0; k < 4; k++) w[hf][k] = kvf_fix_nan_bf16x2(w[hf][k], y[hf][2 * k], y[hf][2 * k + 1]);
    }
#pragma unroll
    for (int hf = 0; hf < NH; hf++) kvf_st16_stream(dst + HALF * hf, w[hf][0], w[hf][1], w[hf][2], w[hf][3]);
}

// The signed low byte b of w as a float, exactly: w ^ 0x80 holds b + 128 in
// its low byte (0..255), 2^23 + that minus (2^23 + 128) is b.
__device__ __forceinline__ float int8_float(u32 w_biased) {
    return __fsub_rn(kvf_magic(w_biased & 0xffu), MAGIC + 128.0f);
}

// Word k of a row of R int8 PSAC codes (a channel's basis codes, or a
// token's coefficients): codes 4k .. 4k+3, lowest in the low byte, zero past
// R. With R % 4 == 0 one aligned 32-bit load (the planes are 256-byte aligned
// and each row starts at a multiple of R).
template <int R>
__device__ __forceinline__ u32 int8_word(const u8 *p, int k) {
    if (R % 4 == 0) return kvf_ldg_u32(p + 4 * k);
    u32 w = 0;
#pragma unroll
    for (int e = 0; e < 4; e++)
        if (4 * k + e < R) w |= kvf_ldg_u8(p + 4 * k + e) << (8 * e);
    return w;
}

// All CW words of such a row, 8 bytes a load where R % 8 == 0.
template <int R>
__device__ __forceinline__ void int8_row(const u8 *p, u32 (&w)[(R + 3) / 4]) {
#pragma unroll
    for (int k = 0; k < (R + 3) / 4; k++) {
        if (R % 8 == 0) {
            if (k % 2 == 0) {
                const uint2 v = kvf_ldg_u64(p + 4 * k);
                w[k] = v.x;
                w[k + 1] = v.y;
            }
        } else {
            w[k] = int8_word<R>(p, k);
        }
    }
}

// PSAC's integer dot product sum_j c_j b[c][j] as a float, exactly: dp4a
// accumulates onto the bits of 2^23 + 2^22, and |sum| <= 64 * 128 * 128 <
// 2^22 (even for codes of -128 in a hostile cache) keeps the sum inside that
// float's binade, where adding 1 to the bits adds 1 to the value; subtracting
// 2^23 + 2^22 then leaves the sum (one integer op per 4 products, one float op).
constexpr int DOT_BIAS_BITS = 0x4b400000;
constexpr float DOT_BIAS = 12582912.0f; // 2^23 + 2^22

// PK, PM, PB, AB: the pipeline (kvf_pipeline.cuh; outliers, refined channels
// and their bits, the anchor's bits), 0 without it.
template <int D, int BITS, int G, int MODE, int SFMT, int AXIS, int NCENT, int STAGES, int ROT, int PSAC_R, int ROPE,
          int PK, int PM, int PB, int AB>
__device__ __forceinline__ void decode(const u8 *__restrict__ packed, const section_planes &p, int n_tokens,
                                       u16 *__restrict__ y_out, i64 token_stride, i64 head_stride,
                                       const int *__restrict__ positions, const rope_args &rope, u32 bx, u32 nb,
                                       const kvf_anchor_ref &anchor) {
    constexpr int CPL = lane_channels<D, BITS, SFMT, AXIS, PSAC_R, ROT, ROPE>(), NH = CPL / 8; // halves of 8 channels
    static_assert(CPL == 8 || CPL == 16, "8 or 16 channels a lane (tiling's RPT stays >= 1)");
    constexpr int LPR = D / CPL, ROWS = BLOCK / LPR, LPG = G / 8 > 0 ? G / 8 : 1, GROUPS = D / G > 0 ? D / G : 1;
    // CPL = 16: the second half is the 8-channel lane + D/16 (channels D/2
    // on): its output, codes and scale group at these offsets from the first
    // (G is a power of two: G <= D/2 puts it D/(2G) groups on, G = D in the
    // same group).
    constexpr int HALF_CH = D / 2, HALF_CODE = D * BITS / 16, HALF_GROUP = G <= D / 2 ? D / (2 * G) : 0;
    constexpr int RPT = tiling<NCENT, STAGES, PSAC_R, CPL>::RPT, TILE = ROWS * RPT;
    constexpr int CB = kvf_quant::row_code_bytes<D, BITS, MODE>(); // code bytes per row (bits 16: the bf16 row)
    constexpr bool TERN = MODE == KVF_MODE_TERNARY;
    constexpr int QMAX = (1 << (BITS < 16 ? BITS - 1 : 1)) - 1;
    constexpr int R = PSAC_R > 0 ? PSAC_R : 1, CW = (R + 3) / 4;
    static_assert(R <= 64, "PSAC's dot product must stay below 2^22 (DOT_BIAS)");
    constexpr int SCALE_BYTES = SFMT == KVF_SCALE_FP16 ? 2 : 1;
    static_assert(D % 8 == 0 && LPR <= 32 && BLOCK % LPR == 0, "row shape");
    const int lane = threadIdx.x % LPR, sub = threadIdx.x / LPR;
    const u32 n = (u32)n_tokens, h = blockIdx.y;
    // Per-head bases: each row's address is then base + (u64)t * bytes
    // (one wide multiply-add).
    const u64 head_row = (u64)h * n; // row index of (h, token 0)
    u16 *const out_h = opaque(y_out + (i64)h * head_stride + lane * 8);
    const u8 *const codes_h = opaque(packed + p.stage[0].codes + head_row * CB + (TERN ? 0 : lane * BITS));
    const u8 *const scales_h = opaque(packed + p.stage[0].scales + (head_row * GROUPS + lane / LPG) * SCALE_BYTES);
    const u8 *const zeros_h = opaque(packed + p.stage[0].zeros + (head_row * GROUPS + lane / LPG) * SCALE_BYTES);
    const u8 *const tscales_h = opaque(packed + p.stage[0].tscales + head_row * 2);
    const u8 *const cscale_h = opaque(packed + p.cscale + head_row * 2);
    const u8 *const coef_h = opaque(packed + p.coef + head_row * R);
    // KIVI keys: per-channel scales and zeros [H][ceil(N/G)][D] (CPL = 8).
    constexpr int GT = G > 0 ? G : 1;
    const u64 tok_groups = (n + GT - 1) / GT;
    const u8 *const kscales_h = opaque(packed + p.stage[0].scales + ((u64)h * tok_groups * D + lane * 8) * 2);
    const u8 *const kzeros_h = opaque(packed + p.stage[0].zeros + ((u64)h * tok_groups * D + lane * 8) * 2);

    // PSAC basis codes of this head, in shared memory (R <= 64: at most 16
    // KiB at head_dim 256): the 8 channels x CW words of an 8-channel lane l
    // (l < D/8) are BCH 16-byte chunks, stored chunk-major (chunk k at
    // k * D/8 + l), so the 16-byte loads of one chunk by a row's lanes are
    // consecutive, without bank conflicts (the rows of a warp read the same
    // addresses). A 16-channel lane reads lanes l and l + D/16. Read per row
    // (4 loads a half at rank 8), it frees the 16 registers a thread the
    // basis took (session 11's shared basis, whose layout is not recorded,
    // was slower than registers; this form is faster, session 17).
    // The barrier is block-uniform: a block decodes one section and one head.
    constexpr int BCH = 2 * CW;
    constexpr int L8 = D / 8; // 8-channel lanes of a row
    __shared__ uint4 sbasis[PSAC_R ? BCH * L8 : 1];
    if (PSAC_R) {
        const u8 *const basis_head = packed + p.basis + (u64)h * D * R;
        for (int c = threadIdx.x; c < BCH * L8; c += BLOCK) {
            const int k = c / L8, l = c % L8;
            u32 w[4];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int f = 4 * k + e, i = f / CW, wd = f % CW;
                w[e] = int8_word<R>(basis_head + (l * 8 + i) * R, wd);
            }
            sbasis[c] = make_uint4(w[0], w[1], w[2], w[3]);
        }
        __syncthreads();
    }
    // Ternary codes' table (load_ternary_word); block-uniform, as above.
    __shared__ u8 tlut[TERN ? 128 : 1];
    if (TERN) {
        for (int x = threadIdx.x; x < 128; x += BLOCK) tlut[x] = ternary_lut((u32)x);
        __syncthreads();
    }
    const float bscale = PSAC_R ? __uint_as_float(kvf_ldg_u32(packed + p.bscale + (u64)h * 4)) : 0.0f;
    // The pipeline's per-head data: the lane's slots among the refined channels.
    u8 mapl[NH][8];
    if (PM)
#pragma unroll
        for (int hf = 0; hf < NH; hf++) kvf_pipe::map8<PM>(packed + p.pipe.mmap + (u64)h * D, lane * 8 + hf * HALF_CH, mapl[hf]);

    // Centroid indices one tile ahead: a row's centroid gather depends on its
    // index, so loading the indices of the block's next tile while this one
    // is decoded takes one global-load latency out of each tile's chain
    // (where the indices take at most 4 registers: more cost occupancy).
    constexpr bool AHEAD = NCENT && STAGES * RPT <= 4;
    u32 next_idx[RPT][NCENT ? STAGES : 1];
    const auto load_idx = [&](u32 t0n) {
#pragma unroll
        for (int u = 0; u < RPT; u++) {
            const u32 tu = min(t0n + (u32)(u * ROWS + sub), n - 1);
#pragma unroll
            for (int s = 0; s < STAGES; s++) next_idx[u][s] = kvf_ldg_u8(packed + p.stage[s].index + head_row + tu);
        }
    };
    if (AHEAD && bx * (u32)TILE < n) load_idx(bx * (u32)TILE);

    // nb * TILE <= n + TILE - 1 (runtime/gpu/context.c): no u32 overflow.
    for (u32 t0 = bx * (u32)TILE; t0 < n; t0 += nb * (u32)TILE) {
        // Rows past the end run on the last token (every lane of a row joins
        // the shuffles of ROT and RoPE) and store nothing.
        u32 t[RPT];
        bool live[RPT];
#pragma unroll
        for (int u = 0; u < RPT; u++) {
            const u32 tu = t0 + (u32)(u * ROWS + sub);
            live[u] = tu < n;
            t[u] = live[u] ? tu : n - 1;
        }
        // Output rows: ROWS tokens apart.
        u16 *dst = out_h + (i64)(t0 + sub) * token_stride;

        if (BITS == 16) { // stored bf16: as it is, or through RoPE (keys cached before RoPE)
            uint4 raw[RPT];
#pragma unroll
            for (int u = 0; u < RPT; u++) raw[u] = kvf_ldg16(codes_h + (u64)t[u] * CB);
#pragma unroll
            for (int u = 0; u < RPT; u++, dst += ROWS * token_stride) {
                if (!ROPE) {
                    if (live[u]) kvf_st16(dst, raw[u].x, raw[u].y, raw[u].z, raw[u].w);
                    continue;
                }
                float y[1][8];
                kvf_bf16x8_to_f32(raw[u], y[0]);
                apply_rope<D, ROPE>(y[0], lane, positions + (u64)t[u] * rope.n_sections, rope);
                if (live[u]) store_row<1, 0>(dst, y);
            }
            continue;
        }

        // ---- every load of the RPT rows first
        code_word cw[RPT][NH];
        u32 sc[RPT][NH], zr[RPT][NH], ts[RPT];
        uint4 s8[RPT], z8[RPT];
        u32 idx[RPT][STAGES];
        u32 cs[RPT];
        u32 coefw[RPT][CW];
#pragma unroll
        for (int u = 0; u < RPT; u++) {
#pragma unroll
            for (int hf = 0; hf < NH; hf++)
                cw[u][hf] = TERN ? load_ternary_word(codes_h + (u64)t[u] * CB, lane + hf * (D / 16), tlut)
                                 : load_code_word<BITS>(codes_h + (u64)t[u] * CB + hf * HALF_CODE);
            if (AXIS == KVF_AXIS_TOKEN) {
                const u64 at = (u64)(t[u] / GT) * (D * 2);
                s8[u] = kvf_ldg16(kscales_h + at);
                if (MODE == KVF_MODE_AFFINE) z8[u] = kvf_ldg16(kzeros_h + at);
            } else {
#pragma unroll
                for (int hf = 0; hf < NH; hf++) {
                    if (hf && !HALF_GROUP) { // the same group
                        sc[u][hf] = sc[u][0];
                        if (MODE == KVF_MODE_AFFINE) zr[u][hf] = zr[u][0];
                        continue;
                    }
                    const u64 at = ((u64)t[u] * GROUPS + hf * HALF_GROUP) * SCALE_BYTES;
                    if (SFMT == KVF_SCALE_FP16) {
                        sc[u][hf] = kvf_ldg_u16(scales_h + at);
                        if (MODE == KVF_MODE_AFFINE) zr[u][hf] = kvf_ldg_u16(zeros_h + at);
                    } else {
                        sc[u][hf] = kvf_ldg_u8(scales_h + at);
                        if (MODE == KVF_MODE_AFFINE) zr[u][hf] = kvf_ldg_u8(zeros_h + at);
                    }
                }
                if (SFMT == KVF_SCALE_INT8_FP16) ts[u] = kvf_ldg_u16(tscales_h + (u64)t[u] * 2);
            }
            if (NCENT) {
#pragma unroll
                for (int s = 0; s < STAGES; s++) {
                    idx[u][s] = AHEAD ? next_idx[u][s] // token t[u]'s, loaded a tile ahead
                                      : kvf_ldg_u8(packed + p.stage[s].index + head_row + t[u]);
                    // A corrupt cache's index past a table of fewer than 256 rows
                    // reads its last row, not past it (the CPU decode refuses it).
                    if (NCENT < 256) idx[u][s] = min(idx[u][s], (u32)(NCENT - 1));
                }
            }
            if (PSAC_R) {
                cs[u] = kvf_ldg_u16(cscale_h + (u64)t[u] * 2);
                const u8 *cp = coef_h + (u64)t[u] * R;
                int8_row<R>(cp, coefw[u]);
            }
        }
        // Centroid rows, then the next tile's indices.
        uint4 mu[RPT][NCENT ? STAGES : 1][NH];
        if (NCENT) {
#pragma unroll
            for (int u = 0; u < RPT; u++)
#pragma unroll
                for (int s = 0; s < STAGES; s++)
#pragma unroll
                    for (int hf = 0; hf < NH; hf++)
                        mu[u][s][hf] = kvf_ldg16_keep(packed + p.stage[s].centroids +
                                                      (((u64)h * NCENT + idx[u][s]) * D + lane * 8 + hf * HALF_CH) * 2);
            if (AHEAD && t0 + nb * (u32)TILE < n) load_idx(t0 + nb * (u32)TILE);
        }

        // ---- arithmetic and store, row by row
#pragma unroll
        for (int u = 0; u < RPT; u++, dst += ROWS * token_stride) {
            float yh[NH][8]; // the lane-row's halves of 8 channels
            const u32 ex = magic_reg(n >> 31);
            // r' = the reference's r_hat except that it is never -0:
            //   affine fp16:  r' = fma(S, q, M + 0)           (reference: fma(S, q, M))
            //   otherwise:    r' = fma(S, (float)(q - z), +0) (reference: S * (float)(q - z))
            // (with the 2^P scaling of code_magic, which changes nothing).
            // The reference then computes y = (((0 + mu_0) + mu_1) ...) + r_hat;
            // here y = ((mu_0 + mu_1) ...) + r' (or y = r' without centroids).
            // Bit-identical (NaN payloads aside, and every NaN is written
            // 0x7FC0), because:
            // - S, M are f16 values (or T * u, exact in f32) and q, z small
            //   integers, so a nonzero S*(q - z) (+ M) is a multiple of 2^-24
            //   and never rounds to 0: fma with a +0 addend rounds as the
            //   multiply does, and a zero result is +0 (RN gives -0 for a sum
            //   only when both addends are -0, and M + 0 is never -0), which
            //   is what 0 + r_hat gives; so without centroids y = r' equals
            //   0 + r_hat.
            // - The prefix (0 + mu_0) + ... differs from mu_0 + ... only by a
            //   -0 where the reference has +0 (all mu -0), and adding r'
            //   (never -0) maps both to the same value: x + r' for x = +-0 is
            //   r' when r' != 0 and +0 when r' = +0; and where r_hat = -0
            //   (r' = +0) the reference's P + (-0) is P, or +0 for P = +0.
            if (AXIS == KVF_AXIS_TOKEN) {
                const u32 sa[4] = {s8[u].x, s8[u].y, s8[u].z, s8[u].w};
                const u32 za[4] = {z8[u].x, z8[u].y, z8[u].z, z8[u].w};
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    const int P = code_pos(BITS, i);
                    const float m = code_magic<BITS>(cw[u][0], i, ex);
                    const float S0 = kvf_f16_to_f32((u16)(sa[i / 2] >> (16 * (i & 1)))), S = P ? __fmul_rn(S0, pow2(-P)) : S0;
                    if (MODE == KVF_MODE_AFFINE) {
                        const float M = __fadd_rn(kvf_f16_to_f32((u16)(za[i / 2] >> (16 * (i & 1)))), 0.0f);
                        yh[0][i] = __fmaf_rn(S, __fsub_rn(m, MAGIC), M);
                    } else {
                        yh[0][i] = __fmaf_rn(S, __fsub_rn(m, MAGIC + (float)(QMAX << P)), 0.0f);
                    }
                }
            } else if (SFMT == KVF_SCALE_FP16 || SFMT == KVF_SCALE_FP8) {
                // (FP8 E4M3 values are multiples of 2^-9, fp16 ones of 2^-24:
                // the argument below holds for both.)
#pragma unroll
                for (int hf = 0; hf < NH; hf++) {
                    const float S = SFMT == KVF_SCALE_FP8 ? kvf_e4m3_to_f32(sc[u][hf]) : kvf_f16_to_f32((u16)sc[u][hf]);
                    const float M = MODE == KVF_MODE_AFFINE
                                        ? __fadd_rn(SFMT == KVF_SCALE_FP8 ? kvf_e4m3_to_f32(zr[u][hf])
                                                                          : kvf_f16_to_f32((u16)zr[u][hf]), 0.0f)
                                        : 0.0f;
#pragma unroll
                    for (int i = 0; i < 8; i++) {
                        const int P = code_pos(BITS, i);
                        const float m = code_magic<BITS>(cw[u][hf], i, ex), SP = P ? __fmul_rn(S, pow2(-P)) : S;
                        yh[hf][i] = MODE == KVF_MODE_AFFINE ? __fmaf_rn(SP, __fsub_rn(m, MAGIC), M)
                                                            : __fmaf_rn(SP, __fsub_rn(m, MAGIC + (float)(QMAX << P)), 0.0f);
                    }
                }
            } else {
                // S = T * (float)u_g; q - z with z the int8 zero code (or QMAX):
                // (m - 2^23) - z * 2^P = (q - z) * 2^P, one fma, exact (an
                // integer times 2^P below 2^24 in magnitude).
#pragma unroll
                for (int hf = 0; hf < NH; hf++) {
                    const float S = __fmul_rn(kvf_f16_to_f32((u16)ts[u]), __fsub_rn(kvf_magic(sc[u][hf] & 0xffu), MAGIC));
                    const float zf = MODE == KVF_MODE_AFFINE ? int8_float(zr[u][hf] ^ 0x80u) : (float)QMAX;
#pragma unroll
                    for (int i = 0; i < 8; i++) {
                        const int P = code_pos(BITS, i);
                        const float m = code_magic<BITS>(cw[u][hf], i, ex), SP = P ? __fmul_rn(S, pow2(-P)) : S;
                        yh[hf][i] = __fmaf_rn(SP, __fmaf_rn(zf, -pow2(P), __fsub_rn(m, MAGIC)), 0.0f);
                    }
                }
            }
            if (NCENT) {
#pragma unroll
                for (int hf = 0; hf < NH; hf++) {
                    float c[8];
#pragma unroll
                    for (int s = 0; s < STAGES; s++) {
                        const u32 a[4] = {mu[u][s][hf].x, mu[u][s][hf].y, mu[u][s][hf].z, mu[u][s][hf].w};
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            const float lo = kvf_bf16_lo(a[e]), hi = kvf_bf16_hi(a[e]);
                            c[2 * e] = s ? __fadd_rn(c[2 * e], lo) : lo;
                            c[2 * e + 1] = s ? __fadd_rn(c[2 * e + 1], hi) : hi;
                        }
                    }
#pragma unroll
                    for (int i = 0; i < 8; i++) yh[hf][i] = __fadd_rn(c[i], yh[hf][i]);
                }
            }
            if (PSAC_R) {
                // y[i] += (cs * s) * sum_j c_j b[i][j]: one fma per channel
                // with the exact integer dot product, as kvf_ref_psac_apply;
                // skipped when the coefficient scale is 0 (+0 or -0: the
                // reference tests the f32 value).
                const float csf = kvf_f16_to_f32((u16)cs[u]);
                if (csf != 0.0f) {
                    const float k = __fmul_rn(csf, bscale);
                    // (taken here, not above the loop: there the address, live
                    // across RoPE's calls, cost a RoPE-pre shape 20 bytes of
                    // spills, test_nvrtc)
                    const u32 sbasis_lane = (u32)__cvta_generic_to_shared(&sbasis[lane]);
#pragma unroll
                    for (int hf = 0; hf < NH; hf++) {
                        int acc[8];
#pragma unroll
                        for (int i = 0; i < 8; i++) acc[i] = DOT_BIAS_BITS;
#pragma unroll
                        for (int kc = 0; kc < BCH; kc++) {
                            // (volatile: read per row, not hoisted into registers)
                            const uint4 bw = kvf_lds16(sbasis_lane + (kc * L8 + hf * (D / 16)) * 16);
                            const u32 b[4] = {bw.x, bw.y, bw.z, bw.w};
#pragma unroll
                            for (int e = 0; e < 4; e++) {
                                const int f = 4 * kc + e, i = f / CW, wd = f % CW;
                                acc[i] = __dp4a((int)coefw[u][wd], (int)b[e], acc[i]);
                            }
                        }
#pragma unroll
                        for (int i = 0; i < 8; i++)
                            yh[hf][i] = __fmaf_rn(k, __fsub_rn(__int_as_float(acc[i]), DOT_BIAS), yh[hf][i]);
                    }
                }
            }
            if (PM || AB || PK) {
                // The pipeline, in the reference's order: the refinement of the
                // calibrated channels, the anchor's row, the outliers as given.
                const u64 row = head_row + t[u];
                if (PM) {
                    constexpr int MCB = PM * PB / 8;
                    const float S = kvf_f16_to_f32((u16)kvf_ldg_u16(packed + p.pipe.mscale + row * 2));
                    const u8 *codes = packed + p.pipe.mcode + row * MCB;
#pragma unroll
                    for (int hf = 0; hf < NH; hf++)
#pragma unroll
                        for (int i = 0; i < 8; i++)
                            if (mapl[hf][i] != 255) yh[hf][i] = __fadd_rn(yh[hf][i], kvf_pipe::refined<PB>(codes, mapl[hf][i], S));
                }
                if (AB && anchor.packed) {
                    const u64 arow = (u64)h * anchor.tokens + t[u] % (u32)anchor.tokens;
#pragma unroll
                    for (int hf = 0; hf < NH; hf++) {
                        float a[8];
                        kvf_pipe::anchor8<D, AB, G>(anchor, arow, lane * 8 + hf * HALF_CH, a);
#pragma unroll
                        for (int i = 0; i < 8; i++) yh[hf][i] = __fadd_rn(yh[hf][i], a[i]);
                    }
                }
#pragma unroll
                for (int q = 0; q < (PK > 0 ? PK : 0); q++) {
                    // A corrupt channel past the row is clamped (the CPU decode refuses it).
                    const int c = min((int)kvf_ldg_u8(packed + p.pipe.oidx + row * PK + q), D - 1);
                    const float val = kvf_bf16_to_f32((u16)kvf_ldg_u16(packed + p.pipe.oval + (row * PK + q) * 2));
#pragma unroll
                    for (int hf = 0; hf < NH; hf++) {
                        const int ci = c - hf * HALF_CH - lane * 8;
#pragma unroll
                        for (int i = 0; i < 8; i++)
                            if (ci == i) yh[hf][i] = val;
                    }
                }
            }
            if (ROT) kvf_fwht_row<D>(yh[0], lane); // CPL = 8
            if (ROPE) apply_rope<D, ROPE>(yh[0], lane, positions + (u64)t[u] * rope.n_sections, rope);
            if (live[u]) store_row<NH, HALF_CH>(dst, yh);
        }
    }
}

// One tensor section's decode configuration (the generated file names one for
// the keys and one for the values; KVF_DECODE_KERNEL joins them).
//
// MIN_BLOCKS_AS_KEY: the blocks an SM must hold when the section is the
// keys: 4 (at most 64 registers a thread) for PSAC of rank <= 8 over one
// stage at head_dim <= 128, without rotation or RoPE: joined, quantwm_int2's
// two sections took 80 registers (3 blocks) and decoded 10% slower than as
// two launches, where each alone took 64. 0, no bound, otherwise: a bound of
// 1 or 4 raises RTN's 40 registers to 48, and larger PSAC shapes (rank 16-32,
// head_dim 256, two stages, RoPE, Hadamard) spilled under it with the basis
// in registers (test_nvrtc compiles them; with the shared basis, session 17,
// head_dim 256 at rank 8 would fit it: not changed, not run).
template <int D, int BITS, int G, int MODE, int SFMT, int AXIS, int NCENT, int STAGES, int ROT, int PSAC_R, int ROPE,
          int PK, int PM, int PB, int AB>
struct section {
    static constexpr int MIN_BLOCKS_AS_KEY =
        PSAC_R > 0 && PSAC_R <= 8 && STAGES == 1 && D <= 128 && !ROT && ROPE == KVF_DECODE_ROPE_NONE ? 4 : 0;
    __device__ __forceinline__ static void run(const u8 *__restrict__ packed, const section_planes &p, int n_tokens,
                                               u16 *__restrict__ y_out, i64 token_stride, i64 head_stride,
                                               const int *__restrict__ positions, const rope_args &rope, u32 bx,
                                               u32 nb, const kvf_anchor_ref &anchor) {
        decode<D, BITS, G, MODE, SFMT, AXIS, NCENT, STAGES, ROT, PSAC_R, ROPE, PK, PM, PB, AB>(
            packed, p, n_tokens, y_out, token_stride, head_stride, positions, rope, bx, nb, anchor);
    }
};

} // namespace kvf_decode

// KEY, VALUE: kvf_decode::section types (typedefs in the generated file).
// v_blocks is gridDim.x - k_blocks, passed all the same: derived in the
// kernel it cost quantwm_int2's decode a 4-byte spill (NVRTC 13.0, sm_90).
#define KVF_DECODE_KERNEL(NAME, KEY, VALUE)                                                                       \
    extern "C" __global__ void __launch_bounds__(kvf_decode::BLOCK, KEY::MIN_BLOCKS_AS_KEY)                       \
    NAME(const kvf_decode_params p) {                                                                             \
        const u8 *__restrict__ packed = p.packed;                                                                 \
        const int *__restrict__ positions = p.positions;                                                          \
        if (blockIdx.x < p.blocks[0]) {                                                                           \
            u16 *__restrict__ out = p.out[0];                                                                     \
            KEY::run(packed, p.planes[0], p.n_tokens, out, p.ts, p.hs, positions, p.rope, blockIdx.x, p.blocks[0],  \
                     p.anchor[0]);                                                                                \
        } else {                                                                                                  \
            u16 *__restrict__ out = p.out[1];                                                                     \
            VALUE::run(packed, p.planes[1], p.n_tokens, out, p.ts, p.hs, positions, p.rope,                       \
                       blockIdx.x - p.blocks[0], p.blocks[1], p.anchor[1]);                                       \
        }                                                                                                         \
    }
