// kvforge kernel templates: shared device helpers.
// Hand-written; compiled by NVRTC with no CUDA headers (none are needed at
// run time). Number conversions match runtime/numfmt.c bit for bit.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define KVF_MODE_AFFINE 0
#define KVF_MODE_SYMMETRIC 1

// The 64-byte packed-cache header, passed by value and written by one thread.
struct kvf_header_words { u64 w[8]; };

// Where one tensor section's planes start inside the packed buffer.
struct kvf_planes { u64 codes, scales, zeros; };

__device__ __forceinline__ float kvf_bf16_to_f32(u16 b) { return __uint_as_float((u32)b << 16); }

__device__ __forceinline__ u16 kvf_f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x0040u);
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

// Decoded values: a NaN is always 0x7FC0.
__device__ __forceinline__ u16 kvf_output_bf16(float f) { return f != f ? (u16)0x7fc0u : kvf_f32_to_bf16(f); }

// -0 and +0 compare equal and min/max may return either: the format stores +0.
__device__ __forceinline__ float kvf_plus_zero(float f) { return f == 0.0f ? 0.0f : f; }

// Round to nearest even, as a float (rintf); then clamp, a NaN becoming lo.
__device__ __forceinline__ float kvf_rint(float f) {
    float r;
    asm("cvt.rni.f32.f32 %0, %1;" : "=f"(r) : "f"(f));
    return r;
}
__device__ __forceinline__ float kvf_clamp(float r, float lo, float hi) { return fminf(fmaxf(r, lo), hi); }

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

__device__ __forceinline__ void kvf_store8(u16 *p, const u16 v[8]) {
    uint4 w;
    w.x = v[0] | ((u32)v[1] << 16); w.y = v[2] | ((u32)v[3] << 16);
    w.z = v[4] | ((u32)v[5] << 16); w.w = v[6] | ((u32)v[7] << 16);
    *(uint4 *)p = w;
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
        const bool low = !(lane & mask);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float other = __shfl_xor_sync(0xffffffffu, x[i], mask);
            x[i] = low ? __fadd_rn(x[i], other) : __fsub_rn(other, x[i]);
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

// A kernel that writes the packed header (the methods whose encoders run as
// several launches write it first).
#define KVF_HEADER_KERNEL(NAME)                                                     \
    extern "C" __global__ void NAME(u8 *packed, kvf_header_words hdr) {            \
        if (threadIdx.x == 0 && blockIdx.x == 0) kvf_write_header(packed, hdr);    \
    }
