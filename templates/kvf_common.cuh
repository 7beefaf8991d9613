// kvforge kernel templates: shared device helpers.
// Hand-written; compiled by NVRTC with no CUDA headers (none are needed at
// run time). Number conversions match runtime/core/numfmt.c bit for bit.
#pragma once
#include "kvf_abi.h"

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

// Starts the message of a static_assert that refuses a valid scheme on the
// arch compiled for (not a bug): the host reports such a failed compile as
// KVF_ENOTIMPL instead of KVF_ECOMPILE (runtime/gpu/cuda_api.c, same text).
#define KVF_NOT_ON_THIS_ARCH "[KVF_ENOTIMPL] "

__device__ __forceinline__ float kvf_bf16_to_f32(u16 b) { return __uint_as_float((u32)b << 16); }
// The two bf16 values of a 32-bit word (the lower channel in the low half) as f32.
__device__ __forceinline__ float kvf_bf16_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float kvf_bf16_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }
// Eight bf16 values (one 16-byte load, lowest channel in the low half of .x) as f32.
__device__ __forceinline__ void kvf_bf16x8_to_f32(uint4 w, float *out) {
    const u32 a[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int e = 0; e < 4; e++) {
        out[2 * e] = kvf_bf16_lo(a[e]);
        out[2 * e + 1] = kvf_bf16_hi(a[e]);
    }
}

// Round to nearest even; a NaN is always 0x7FC0 (CPUs and GPUs make NaNs with
// other sign and payload bits: stored planes must not depend on them).
__device__ __forceinline__ u16 kvf_f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)0x7fc0u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

__device__ __forceinline__ float kvf_f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Round to nearest even; finite values saturate to +-65504 (numfmt.c).
__device__ __forceinline__ u16 kvf_f32_to_f16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)(((u >> 16) & 0x8000u) | 0x7e00u);
    if ((u & 0x7fffffffu) != 0x7f800000u) f = fminf(fmaxf(f, -65504.0f), 65504.0f);
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// What the packed format stores for a scale or offset: a NaN is always
// 0x7E00 whatever its sign and payload (docs/FORMAT.md, special values).
__device__ __forceinline__ u16 kvf_stored_f16(float f) { return f != f ? (u16)0x7e00u : kvf_f32_to_f16(f); }

// Decoded values (FORMAT.md's output_bf16): round to nearest even, a NaN is
// always 0x7FC0. The hardware conversion cvt.rn.bf16x2.f32 (sm_80+) gives the
// same bits as kvf_f32_to_bf16 for every non-NaN input, so only NaNs need
// fixing:
// - finite values: both round the f32 to nearest even at bit 16 (the
//   software adds 0x7fff + the kept LSB and truncates, which is RNE on the
//   magnitude bits; a carry out of the mantissa bumps the exponent, and from
//   the largest finite exponent gives 0x7f80 = Inf, which is also what IEEE
//   RNE gives for values at or past max_bf16 + half an ulp);
// - f32 subnormals: cvt has no .ftz here (and NVRTC compiles with
//   --ftz=false), so they are rounded like any other value, as the software
//   does with the same integer add;
// - +-Inf: 0x7f80 / 0xff80 both ways; +-0: 0x0000 / 0x8000 both ways;
// - NaN: the hardware gives its own canonical NaN (0x7fff), which is
//   replaced by 0x7fc0 below (the software gives 0x7fc0 itself). The
//   fix does not look at what cvt produced for a NaN, only at the f32 input,
//   so it does not depend on the hardware's NaN pattern.
// tests/test_gpu.c (decode_special_values) checks it against the CPU.
__device__ __forceinline__ u32 kvf_cvt_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); // first source -> upper half
    return r;
}
// The NaN fix of a pair converted by kvf_cvt_bf16x2.
__device__ __forceinline__ u32 kvf_fix_nan_bf16x2(u32 r, float lo, float hi) {
    r = lo != lo ? (r & 0xffff0000u) | 0x00007fc0u : r;
    r = hi != hi ? (r & 0x0000ffffu) | 0x7fc00000u : r;
    return r;
}
// Whether any of 8 (16) values is a NaN: setp.nan, each testing two
// values, chained into one predicate (4 or 8 of them), from these pieces.
#define KVF_NAN_FIRST "{\n\t.reg .pred p;\n\tsetp.nan.f32 p, %1, %2;\n\t"
#define KVF_NAN_OR(i, j) "setp.nan.or.f32 p, %" #i ", %" #j ", p;\n\t"
#define KVF_NAN_END "selp.u32 %0, 1, 0, p;\n\t}"
__device__ __forceinline__ bool kvf_any_nan8(const float y[8]) {
    u32 r;
    asm(KVF_NAN_FIRST KVF_NAN_OR(3, 4) KVF_NAN_OR(5, 6) KVF_NAN_OR(7, 8) KVF_NAN_END
        : "=r"(r)
        : "f"(y[0]), "f"(y[1]), "f"(y[2]), "f"(y[3]), "f"(y[4]), "f"(y[5]), "f"(y[6]), "f"(y[7]));
    return r != 0;
}
// Two halves of 8 of one lane-row (kvf_decode.cuh's 16-channel lanes).
__device__ __forceinline__ bool kvf_any_nan16(const float a[8], const float b[8]) {
    u32 r;
    asm(KVF_NAN_FIRST KVF_NAN_OR(3, 4) KVF_NAN_OR(5, 6) KVF_NAN_OR(7, 8) KVF_NAN_OR(9, 10) KVF_NAN_OR(11, 12)
            KVF_NAN_OR(13, 14) KVF_NAN_OR(15, 16) KVF_NAN_END
        : "=r"(r)
        : "f"(a[0]), "f"(a[1]), "f"(a[2]), "f"(a[3]), "f"(a[4]), "f"(a[5]), "f"(a[6]), "f"(a[7]), "f"(b[0]),
          "f"(b[1]), "f"(b[2]), "f"(b[3]), "f"(b[4]), "f"(b[5]), "f"(b[6]), "f"(b[7]));
    return r != 0;
}
#undef KVF_NAN_FIRST
#undef KVF_NAN_OR
#undef KVF_NAN_END

// -0 and +0 compare equal and min/max may return either: the format stores +0.
__device__ __forceinline__ float kvf_plus_zero(float f) { return f == 0.0f ? 0.0f : f; }

// Round to nearest even, as a float (rintf); then clamp, a NaN becoming lo.
__device__ __forceinline__ float kvf_rint(float f) {
    float r;
    asm("cvt.rni.f32.f32 %0, %1;" : "=f"(r) : "f"(f));
    return r;
}
__device__ __forceinline__ float kvf_clamp(float r, float lo, float hi) { return fminf(fmaxf(r, lo), hi); }

// FP8 E4M3 (runtime/core/numfmt.c, the same integer steps): round to
// nearest even, +-448 for larger values and infinities, 0x7F for a NaN.
__device__ __forceinline__ u8 kvf_f32_to_e4m3(float f) {
    const u32 u = __float_as_uint(f), sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return 0x7fu;
    if (a >= 0x43e00000u) return (u8)(sign | 0x7eu);
    const int e = (int)(a >> 23) - 127;
    if (e < -6) return (u8)(sign | (u32)kvf_rint(__fmul_rn(__uint_as_float(a), 512.0f)));
    u32 r = (a >> 20) & 7u, rem = a & 0xfffffu;
    int ee = e;
    if (rem > 0x80000u || (rem == 0x80000u && (r & 1u))) r++;
    if (r == 8u) r = 0, ee++;
    if (ee > 8 || (ee == 8 && r == 7u)) return (u8)(sign | 0x7eu);
    return (u8)(sign | ((u32)(ee + 7) << 3) | r);
}
__device__ __forceinline__ float kvf_e4m3_to_f32(u32 c) {
    const u32 sign = (c & 0x80u) << 24, exp = (c >> 3) & 15u, man = c & 7u;
    if ((c & 0x7fu) == 0x7fu) return __uint_as_float(0x7fc00000u | sign);
    if (exp == 0) return __uint_as_float(sign | __float_as_uint(__fmul_rn((float)man, 0.001953125f)));
    return __uint_as_float(sign | ((exp + 120u) << 23) | (man << 20));
}


// rint(fl(x / S)) for S > 0, given r = fl(1 / S) (__frcp_rn, once per
// scale): y = fl(x r) is within 2^-22 |y| (+ 2^-149 if subnormal) of fl(x / S)
// (three roundings of 2^-24 each), so where no half-integer lies within
// 2^-21 |y| + 2^-140 of y both round to rint(y); otherwise (about one value
// in 10^6, and every NaN, Inf or huge quotient) the division itself. The
// margin is computed with a factor 2 to spare, which covers its own
// rounding; y - rint(y) is exact (Sterbenz). tests/test_rint_div.c repeats
// this arithmetic on the CPU against the division, half of its values within
// 32 ulp of a half-integer quotient (change it with kvf_rint_mul and
// kvf_rint_mul_add). kvf_rint_mul is the fast path of one value: n =
// rint(y), y = fl(x r); true only where the division's result is n (the
// test is sufficient, not exact). kvf_rint_mul_add the same for
// rint(fl(fl(x / S) + z)), t = fl(y + z).
__device__ __forceinline__ bool kvf_rint_mul(float x, float r, float &n) {
    const float y = __fmul_rn(x, r);
    n = kvf_rint(y);
    return fabsf(__fsub_rn(y, n)) < __fsub_rn(0.5f, __fmaf_rn(fabsf(y), 0x1p-21f, 0x1p-140f));
}
__device__ __forceinline__ bool kvf_rint_mul_add(float x, float r, float z, float &n) {
    const float y = __fmul_rn(x, r), t = __fadd_rn(y, z);
    n = kvf_rint(t);
    const float m = __fmaf_rn(fabsf(y), 0x1p-21f, __fmaf_rn(fabsf(t), 0x1p-22f, 0x1p-140f));
    return fabsf(__fsub_rn(t, n)) < __fsub_rn(0.5f, m);
}
// rint(fl(x_i / S)) (ADD = false; z is not read) or rint(fl(fl(x_i / S) + z)) for an
// integer z, |z| <= 256 (ADD = true: the sum's rounding moves t by up to
// 2^-24 |t|, which kvf_rint_mul_add's margin covers) of 8 values, S > 0
// (r = fl(1 / S) computed once): every value's fast path, and where any of
// them misses its margin, the division for all 8 (the same integers
// wherever the fast path holds): one branch a lane, not one a value.
// With ADD a zero may come out with the other sign (x / S just below -z +
// 1/2 in magnitude): the callers clamp to [0, L] and keep the code as u32.
template <bool ADD>
__device__ __forceinline__ void kvf_rint_div8(const float (&x)[8], float S, float (&n)[8], float z = 0.0f) {
    const float r = __frcp_rn(S);
    bool ok = true;
#pragma unroll
    for (int i = 0; i < 8; i++) ok &= ADD ? kvf_rint_mul_add(x[i], r, z, n[i]) : kvf_rint_mul(x[i], r, n[i]);
    if (ok) return;
#pragma unroll
    for (int i = 0; i < 8; i++) n[i] = kvf_rint(ADD ? __fadd_rn(__fdiv_rn(x[i], S), z) : __fdiv_rn(x[i], S));
}

// Reduce over the `width` consecutive lanes of a group (width a power of two).
template <int WIDTH>
__device__ __forceinline__ float kvf_group_max(float v) {
#pragma unroll
    for (int off = WIDTH / 2; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}
template <int WIDTH>
__device__ __forceinline__ float kvf_group_min(float v) {
#pragma unroll
    for (int off = WIDTH / 2; off > 0; off >>= 1) v = fminf(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

// Eight consecutive bf16 values: one 16-byte load or store.
__device__ __forceinline__ void kvf_load8(const u16 *p, u16 v[8]) {
    uint4 w = *(const uint4 *)p;
    u32 a[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; i++) { v[2 * i] = (u16)(a[i] & 0xffffu); v[2 * i + 1] = (u16)(a[i] >> 16); }
}

// 16-byte stores and loads, each one PTX instruction, from one body a kind
// (only the instruction and its cache qualifier differ).
// Stores: always vectorized (a uint4 built from values chosen per element is
// otherwise split into four 4-byte stores). p: global memory, 16-byte
// aligned. The "memory" clobber keeps the compiler from moving other loads
// and stores across it.
#define KVF_ST16(NAME, OP)                                                                           \
    __device__ __forceinline__ void NAME(void *p, u32 a, u32 b, u32 c, u32 d) {                      \
        asm volatile(OP " [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d) : "memory"); \
    }
// Loads (volatile: issued where written, not sunk to their use or hoisted
// out of a loop).
#define KVF_LD16(NAME, OP, ADDR, C)                                                                   \
    __device__ __forceinline__ uint4 NAME(ADDR p) {                                                 \
        uint4 w;                                                                                     \
        asm volatile(OP " {%0, %1, %2, %3}, [%4];" : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w) : C(p)); \
        return w;                                                                                    \
    }
KVF_ST16(kvf_st16, "st.global.v4.b32")
// Data that no thread writes during the kernel (the non-coherent path: ld.global.nc).
KVF_LD16(kvf_ldg16, "ld.global.nc.v4.u32", const void *, "l")
// Shared memory at a 32-bit shared address (__cvta_generic_to_shared).
KVF_LD16(kvf_lds16, "ld.shared.v4.u32", u32, "r")
// The decode's two cache hints: its BF16 output is written once, so
// store_row's stores stream (st.global.cs, evict first); its centroid rows are
// read by every row of a head, so their loads ask L1 to keep them
// (evict_last). A/B on the H200 (docs/BENCHMARKS.md, session 16): qvg_int2's
// decode 0.164-0.168 -> 0.162-0.164 ms, and the decode time at or below the
// plain forms' in 15 of 16 pairs (4 schemes, 4 rounds; session 11: the
// fraction of copy higher in 11 of 12 pairs).
KVF_ST16(kvf_st16_stream, "st.global.cs.v4.b32")
KVF_LD16(kvf_ldg16_keep, "ld.global.nc.L1::evict_last.v4.u32", const void *, "l")
#undef KVF_ST16
#undef KVF_LD16

// Smaller loads of read-only data, zero-extended to 32 bits (u64: two words).
// volatile: they stay where they are written (a decode issues every load of
// its rows before any arithmetic; NVVM would otherwise sink a load into the
// branch that uses it and expose its latency there).
__device__ __forceinline__ u32 kvf_ldg_u8(const void *p) {
    u32 v;
    asm volatile("ld.global.nc.u8 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ u32 kvf_ldg_u16(const void *p) {
    u32 v;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ u32 kvf_ldg_u32(const void *p) {
    u32 v;
    asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ uint2 kvf_ldg_u64(const void *p) {
    uint2 v;
    asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

__device__ __forceinline__ void kvf_store8(u16 *p, const u16 v[8]) {
    kvf_st16(p, v[0] | ((u32)v[1] << 16), v[2] | ((u32)v[3] << 16), v[4] | ((u32)v[5] << 16),
             v[6] | ((u32)v[7] << 16));
}

__device__ __forceinline__ void kvf_load8f(const u16 *p, float f[8]) {
    u16 v[8];
    kvf_load8(p, v);
#pragma unroll
    for (int i = 0; i < 8; i++) f[i] = kvf_bf16_to_f32(v[i]);
}

// The normalized Walsh-Hadamard transform of one row of D channels held as 8
// consecutive channels per lane over D/8 consecutive lanes (METHODS.md 5):
// butterflies of stride < 8 inside the lane, the rest across lanes, each
// element getting exactly the (a + b) or (a - b) the CPU reference computes.
template <int D>
__device__ __forceinline__ void kvf_fwht_row(float x[8], int lane) {
#pragma unroll
    for (int len = 1; len < 8; len <<= 1)
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (!(i & len)) {
                float a = x[i], b = x[i + len];
                x[i] = __fadd_rn(a, b);
                x[i + len] = __fsub_rn(a, b);
            }
#pragma unroll
    for (int len = 8; len < D; len <<= 1) {
        const int mask = len / 8;
        // The low lane keeps a + b, the high one b - a: fma(x, +-1, other)
        // is exactly that sum or difference (x * +-1 is exact, one rounding),
        // signed zeros included (IEEE defines b - a as b + (-a)), in one
        // instruction instead of two predicated ones.
        const float sgn = (lane & mask) ? -1.0f : 1.0f;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float other = __shfl_xor_sync(0xffffffffu, x[i], mask);
            x[i] = __fmaf_rn(x[i], sgn, other);
        }
    }
    const float norm = D == 64 ? 0.125f : D == 128 ? 0.088388347648f : 0.0625f;
#pragma unroll
    for (int i = 0; i < 8; i++) x[i] = __fmul_rn(x[i], norm);
}

__device__ __forceinline__ void kvf_write_header(u8 *packed, const kvf_header_words &h) {
    u64 *p = (u64 *)packed;
#pragma unroll
    for (int i = 0; i < 8; i++) p[i] = h.w[i];
}

// The packed format version the module's kernels read and write (the
// generator writes kvf_abi.h's KVF_FORMAT_VERSION here). A context
// reads it on load and refuses an image of another format: a kernel image
// exported by an older kvforge would otherwise misread the caches.
#define KVF_FORMAT_VERSION_GLOBAL(V) extern "C" __device__ unsigned kvf_format_version = V;
// How the host launches these kernels (a hash of kvf_abi.h, runtime/core/abi.c),
// checked on load the same way: an image exported by a kvforge whose
// parameter structs or tile constants differ is refused rather than run
// wrongly.
#define KVF_KERNEL_ABI_GLOBAL(V) extern "C" __device__ unsigned kvf_kernel_abi = V;

// A kernel that writes the packed header (the methods whose encoders run as
// several launches write it first).
#define KVF_HEADER_KERNEL(NAME)                                                     \
    extern "C" __global__ void NAME(const kvf_header_params p) {                   \
        if (threadIdx.x == 0 && blockIdx.x == 0) kvf_write_header(p.packed, p.hdr); \
    }
