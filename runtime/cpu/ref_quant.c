/*
 * CPU reference of the residual quantizers (docs/FORMAT.md for the RTN
 * formulas, docs/METHODS.md section 2 for two-level scales and groups along
 * tokens): the oracle the GPU kernels are checked against, bit for bit. Every
 * float operation below is a single IEEE binary32 operation (no contraction;
 * fmaf where the format says fma), so another implementation that performs
 * the same operations gets the same bytes.
 *
 * A group is a strided view of the residual of one head: `count` values
 * `x[i * stride]`. Along channels (axis "channel") a group is G consecutive
 * channels of one token (stride 1); along tokens (axis "token", KIVI) it is
 * one channel of up to G consecutive tokens (stride d).
 */
#include "cpu/ref.h"

#include <math.h>
#include <string.h>

/* ------------------------------------------------------------ bytes and bits */

/* Code of channel c sits in byte c*bits/8 at bit (c % (8/bits))*bits, lowest
 * bits first: INT2 channels 0,1,2,3 are bits 0-1, 2-3, 4-5, 6-7 of byte 0. */
static void put_code(uint8_t *row, int c, int bits, unsigned q) {
    int per_byte = 8 / bits, shift = (c % per_byte) * bits;
    unsigned mask = (1u << bits) - 1u;
    uint8_t *b = row + c / per_byte;
    *b = (uint8_t)((*b & ~(mask << shift)) | ((q & mask) << shift));
}

static unsigned get_code(const uint8_t *row, int c, int bits) {
    int per_byte = 8 / bits, shift = (c % per_byte) * bits;
    return (row[c / per_byte] >> shift) & ((1u << bits) - 1u);
}

/* Ternary rows (mode "ternary", kvf_abi.h's KVF_TERNARY_*): the quantizer
 * writes and reads a row's ordinary INT2 codes (0, 1, 2) in a scratch row;
 * these turn that row into the stored one and back. 8 channels make one
 * 13-bit field F = c_0 + 3 c_1 + ... + 3^7 c_7 at bit 13b of the row. */

static void ternary_pack(const uint8_t *codes2, int d, uint8_t *row) {
    memset(row, 0, (size_t)KVF_TERNARY_ROW_BYTES(d));
    for (int b = 0; b < d / 8; b++) {
        uint32_t f = 0;
        for (int i = 7; i >= 0; i--) f = f * 3u + get_code(codes2, 8 * b + i, 2);
        const int bit = KVF_TERNARY_FIELD_BITS * b;
        const uint32_t w = f << (bit % 8); /* at most 13 + 7 bits: 3 bytes */
        for (int k = 0; k < 3 && bit / 8 + k < KVF_TERNARY_ROW_BYTES(d); k++) row[bit / 8 + k] |= (uint8_t)(w >> (8 * k));
    }
}

/* A field of a corrupt cache can exceed 3^8 - 1: its last code is then the
 * quotient F / 3^7 (at most 3, an INT2 code like any other), as the GPU
 * decode computes it. */
static void ternary_unpack(const uint8_t *row, int d, uint8_t *codes2) {
    memset(codes2, 0, (size_t)d / 4);
    for (int b = 0; b < d / 8; b++) {
        const int bit = KVF_TERNARY_FIELD_BITS * b;
        uint32_t w = 0;
        for (int k = 0; k < 3 && bit / 8 + k < KVF_TERNARY_ROW_BYTES(d); k++) w |= (uint32_t)row[bit / 8 + k] << (8 * k);
        uint32_t f = (w >> (bit % 8)) & ((1u << KVF_TERNARY_FIELD_BITS) - 1u);
        for (int i = 0; i < 7; i++, f /= 3u) put_code(codes2, 8 * b + i, 2, f % 3u);
        put_code(codes2, 8 * b + 7, 2, f);
    }
}

/* Where a row's codes are written: the stored row, or for ternary the
 * scratch row that row_codes_done packs into it. */
static uint8_t *row_codes_out(const kvf_section_layout *l, uint8_t *stored, int d, uint8_t *scratch) {
    if (l->mode != KVF_MODE_TERNARY) return stored;
    memset(scratch, 0, (size_t)d / 4);
    return scratch;
}

static void row_codes_done(const kvf_section_layout *l, const uint8_t *scratch, int d, uint8_t *stored) {
    if (l->mode == KVF_MODE_TERNARY) ternary_pack(scratch, d, stored);
}

/* Where a row's codes are read: the stored row, or its INT2 codes unpacked. */
static const uint8_t *row_codes_in(const kvf_section_layout *l, const uint8_t *stored, int d, uint8_t *scratch) {
    if (l->mode != KVF_MODE_TERNARY) return stored;
    ternary_unpack(stored, d, scratch);
    return scratch;
}

/* ------------------------------------------------------------ group statistics */

/* -0 and +0 compare equal and min/max may return either: store +0 so that
 * every implementation writes the same bits. */
static float plus_zero(float f) { return f == 0.0f ? 0.0f : f; }

/* Minimum and maximum of the group's non-NaN values (NaN if all are NaN). */
static void group_range(const float *x, int count, int64_t stride, float *mn, float *mx) {
    float lo = x[0], hi = lo;
    for (int i = 1; i < count; i++) {
        float f = x[i * stride];
        lo = fminf(lo, f); /* fminf/fmaxf return the other operand for a NaN */
        hi = fmaxf(hi, f);
    }
    *mn = plus_zero(lo);
    *mx = plus_zero(hi);
}

/* max |x| over the non-NaN values, from 0. */
static float group_absmax(const float *x, int count, int64_t stride) {
    float a = 0.0f;
    for (int i = 0; i < count; i++) a = fmaxf(a, fabsf(x[i * stride]));
    return a;
}

/* Stored fp16 scales and zeros: a NaN is always 0x7E00, whatever its sign
 * and payload (they differ between CPUs and GPUs). */
static uint16_t stored_f16(float f) { return isnan(f) ? 0x7e00u : kvf_f32_to_f16(f); }

/* A group's stored scale or zero in the section's format (fp16, or FP8
 * E4M3: scale_format "fp8"), and its value back. */
static uint16_t stored_scale(int fp8, float f) { return fp8 ? kvf_f32_to_e4m3(f) : stored_f16(f); }
static float scale_value(int fp8, uint16_t s) { return fp8 ? kvf_e4m3_to_f32((uint8_t)s) : kvf_f16_to_f32(s); }

/* Clamp to [lo, hi]; a NaN becomes lo. */
static float clampf(float r, float lo, float hi) { return fminf(fmaxf(r, lo), hi); }

static int levels_of(int bits) { return (1 << bits) - 1; }
static int qmax_of(int bits) { return (1 << (bits - 1)) - 1; }

/* ------------------------------------------------------------ fp16 scales */

/* Where the codes of element i of a group go: token t0 + i*dt, channel c0 + i*dc. */
typedef struct group_ref {
    const float *x;   /* first value */
    int count;
    int64_t stride;   /* between values, in floats */
    int64_t t0, dt;   /* token of value i: t0 + i*dt */
    int c0, dc;       /* channel of value i: c0 + i*dc */
} group_ref;

static uint8_t *code_row(const kvf_section_layout *l, const kvf_stage_layout *st, uint8_t *packed,
                         size_t row) {
    return packed + st->codes_off + row * l->code_bytes_per_token;
}

/* Affine: x_hat = M + S*q with M = fp16(min), S = fp16((max - min) / (2^b - 1)). */
static void affine_fp16_encode(const group_ref *g, int bits, int fp8, uint8_t *codes0, size_t row_bytes,
                               uint16_t *scale, uint16_t *zero) {
    float levels = (float)levels_of(bits), mn, mx;
    group_range(g->x, g->count, g->stride, &mn, &mx);
    float s = (mx - mn) / levels;
    *scale = stored_scale(fp8, s);
    *zero = stored_scale(fp8, mn);
    float S = scale_value(fp8, *scale), M = scale_value(fp8, *zero);
    for (int i = 0; i < g->count; i++) {
        unsigned q = 0;
        if (S > 0.0f) {
            float d = g->x[i * g->stride] - M;
            float t = d / S;
            q = (unsigned)clampf(rintf(t), 0.0f, levels);
        }
        put_code(codes0 + (size_t)(g->t0 + i * g->dt) * row_bytes, g->c0 + i * g->dc, bits, q);
    }
}

/* Symmetric: x_hat = S*(code - qmax) with S = fp16(max|x| / qmax), qmax = 2^(b-1) - 1. */
static void symmetric_fp16_encode(const group_ref *g, int bits, int fp8, uint8_t *codes0, size_t row_bytes,
                                  uint16_t *scale) {
    int qmax = qmax_of(bits);
    float s = group_absmax(g->x, g->count, g->stride) / (float)qmax;
    *scale = stored_scale(fp8, s);
    float S = scale_value(fp8, *scale);
    for (int i = 0; i < g->count; i++) {
        int q = 0;
        if (S > 0.0f) q = (int)clampf(rintf(g->x[i * g->stride] / S), (float)-qmax, (float)qmax);
        put_code(codes0 + (size_t)(g->t0 + i * g->dt) * row_bytes, g->c0 + i * g->dc, bits,
                 (unsigned)(q + qmax));
    }
}

static float fp16_decode_one(int mode, int bits, float S, float M, unsigned q) {
    if (mode == KVF_MODE_AFFINE) return fmaf(S, (float)q, M);
    return S * (float)((int)q - qmax_of(bits));
}

/* One fp16 or FP8 group: encode, storing its scale and zero at the given bytes. */
static void fp16_group_encode(const kvf_section_layout *l, const group_ref *g, uint8_t *codes0,
                              uint8_t *scale_at, uint8_t *zero_at) {
    uint16_t scale, zero;
    const int fp8 = l->scale_format == KVF_SCALE_FP8;
    if (l->mode == KVF_MODE_AFFINE) {
        affine_fp16_encode(g, l->bits, fp8, codes0, l->code_bytes_per_token, &scale, &zero);
        if (fp8) *zero_at = (uint8_t)zero;
        else kvf_put_u16(zero_at, zero);
    } else {
        symmetric_fp16_encode(g, l->bits, fp8, codes0, l->code_bytes_per_token, &scale);
    }
    if (fp8) *scale_at = (uint8_t)scale;
    else kvf_put_u16(scale_at, scale);
}

/* Axis channel, fp16 or FP8: FORMAT.md's RTN, groups of G channels of one token. */
static void channel_fp16_encode(const kvf_section_layout *l, const kvf_stage_layout *st, int64_t n,
                                int32_t h, int d, const float *r, uint8_t *packed) {
    size_t gpt = (size_t)l->groups_per_token, sb = l->scale_format == KVF_SCALE_FP8 ? 1 : 2;
    uint8_t scratch[KVF_REF_MAX_DIM / 4];
    for (int64_t t = 0; t < n; t++) {
        size_t row = (size_t)h * (size_t)n + (size_t)t;
        uint8_t *stored = code_row(l, st, packed, row), *codes = row_codes_out(l, stored, d, scratch);
        for (int g = 0; g < l->groups_per_token; g++) {
            int c0 = g * l->group_size;
            group_ref gr = {r + t * d + c0, l->group_size, 1, 0, 0, c0, 1};
            size_t at = (row * gpt + (size_t)g) * sb;
            fp16_group_encode(l, &gr, codes, packed + st->scales_off + at, packed + st->zeros_off + at);
        }
        row_codes_done(l, scratch, d, stored);
    }
}

static void channel_fp16_decode(const kvf_section_layout *l, const kvf_stage_layout *st, int64_t n,
                                int32_t h, int d, const uint8_t *packed, float *rhat) {
    size_t gpt = (size_t)l->groups_per_token;
    bool affine = l->mode == KVF_MODE_AFFINE;
    const int fp8 = l->scale_format == KVF_SCALE_FP8;
    uint8_t scratch[KVF_REF_MAX_DIM / 4];
    for (int64_t t = 0; t < n; t++) {
        size_t row = (size_t)h * (size_t)n + (size_t)t;
        const uint8_t *codes = row_codes_in(l, packed + st->codes_off + row * l->code_bytes_per_token, d, scratch);
        for (int g = 0; g < l->groups_per_token; g++) {
            const size_t at = (row * gpt + (size_t)g) * (fp8 ? 1 : 2);
            const uint8_t *sp = packed + st->scales_off + at, *zp = packed + st->zeros_off + at;
            float S = scale_value(fp8, fp8 ? *sp : kvf_get_u16(sp));
            float M = affine ? scale_value(fp8, fp8 ? *zp : kvf_get_u16(zp)) : 0.0f;
            for (int c = g * l->group_size; c < (g + 1) * l->group_size; c++)
                rhat[t * d + c] = fp16_decode_one(l->mode, l->bits, S, M, get_code(codes, c, l->bits));
        }
    }
}

/* Axis token (KIVI keys): per channel c, groups of G consecutive tokens
 * [gG, min(n, (g+1)G)); scale and zero per (group, channel): [H][ceil(n/G)][d]. */
static void token_fp16_encode(const kvf_section_layout *l, const kvf_stage_layout *st, int64_t n,
                              int32_t h, int d, const float *r, uint8_t *packed) {
    int64_t G = l->group_size, ng = l->groups_along_tokens;
    uint8_t *codes0 = code_row(l, st, packed, (size_t)h * (size_t)n);
    for (int64_t g = 0; g < ng; g++) {
        int64_t t0 = g * G, count = n - t0 < G ? n - t0 : G;
        for (int c = 0; c < d; c++) {
            group_ref gr = {r + t0 * d + c, (int)count, d, t0, 1, c, 0};
            size_t at = (((size_t)h * (size_t)ng + (size_t)g) * (size_t)d + (size_t)c) * 2;
            fp16_group_encode(l, &gr, codes0, packed + st->scales_off + at, packed + st->zeros_off + at);
        }
    }
}

static void token_fp16_decode(const kvf_section_layout *l, const kvf_stage_layout *st, int64_t n,
                              int32_t h, int d, const uint8_t *packed, float *rhat) {
    int64_t G = l->group_size, ng = l->groups_along_tokens;
    bool affine = l->mode == KVF_MODE_AFFINE;
    for (int64_t t = 0; t < n; t++) {
        size_t row = (size_t)h * (size_t)n + (size_t)t;
        const uint8_t *codes = packed + st->codes_off + row * l->code_bytes_per_token;
        size_t base = ((size_t)h * (size_t)ng + (size_t)(t / G)) * (size_t)d;
        for (int c = 0; c < d; c++) {
            size_t at = (base + (size_t)c) * 2;
            float S = kvf_f16_to_f32(kvf_get_u16(packed + st->scales_off + at));
            float M = affine ? kvf_f16_to_f32(kvf_get_u16(packed + st->zeros_off + at)) : 0.0f;
            rhat[t * d + c] = fp16_decode_one(l->mode, l->bits, S, M, get_code(codes, c, l->bits));
        }
    }
}

/* ------------------------------------------------------------ two-level scales */

/* Per group: the first-level scale s_g (METHODS.md 2) and, affine, the min. */
static float group_scale(const kvf_section_layout *l, const float *x, float *mn) {
    float mx;
    if (l->mode == KVF_MODE_AFFINE) {
        group_range(x, l->group_size, 1, mn, &mx);
        return (mx - *mn) / (float)levels_of(l->bits);
    }
    *mn = 0.0f;
    return group_absmax(x, l->group_size, 1) / (float)qmax_of(l->bits);
}

/* Group scale code u_g and effective scale S_g = Tf * u_g. */
static unsigned group_scale_code(float s, float Tf) {
    return Tf > 0.0f ? (unsigned)clampf(ceilf(s / Tf), 1.0f, 127.0f) : 0u;
}

/* One token of int8_fp16: token scale T, then per group u_g, z_g and the codes. */
static void int8_token_encode(const kvf_section_layout *l, const float *x, uint8_t *codes,
                              uint8_t *ucodes, uint8_t *tscale, uint8_t *zcodes) {
    int gpt = l->groups_per_token, G = l->group_size, L = levels_of(l->bits), qmax = qmax_of(l->bits);
    float s[256], mn[256], smax = 0.0f; /* groups_per_token <= head_dim / 16 <= 16 */
    for (int g = 0; g < gpt; g++) {
        s[g] = group_scale(l, x + g * G, &mn[g]);
        smax = fmaxf(smax, s[g]);
    }
    uint16_t T = stored_f16(smax / 127.0f);
    float Tf = kvf_f16_to_f32(T);
    kvf_put_u16(tscale, T);
    for (int g = 0; g < gpt; g++) {
        unsigned u = group_scale_code(s[g], Tf);
        float S = Tf * (float)u;
        ucodes[g] = (uint8_t)u;
        if (l->mode == KVF_MODE_AFFINE) {
            int z = S > 0.0f ? (int)clampf(rintf(-mn[g] / S), -128.0f, 127.0f) : 0;
            zcodes[g] = (uint8_t)(int8_t)z;
            for (int c = g * G; c < (g + 1) * G; c++) {
                unsigned q = S > 0.0f ? (unsigned)clampf(rintf(x[c] / S + (float)z), 0.0f, (float)L) : 0u;
                put_code(codes, c, l->bits, q);
            }
        } else {
            for (int c = g * G; c < (g + 1) * G; c++) {
                int q = S > 0.0f ? (int)clampf(rintf(x[c] / S), (float)-qmax, (float)qmax) : 0;
                put_code(codes, c, l->bits, (unsigned)(q + qmax));
            }
        }
    }
}

static void int8_token_decode(const kvf_section_layout *l, const uint8_t *codes, const uint8_t *ucodes,
                              const uint8_t *tscale, const uint8_t *zcodes, float *y) {
    int G = l->group_size, qmax = qmax_of(l->bits);
    float Tf = kvf_f16_to_f32(kvf_get_u16(tscale));
    for (int g = 0; g < l->groups_per_token; g++) {
        float S = Tf * (float)ucodes[g];
        int z = l->mode == KVF_MODE_AFFINE ? (int)(int8_t)zcodes[g] : qmax;
        for (int c = g * G; c < (g + 1) * G; c++)
            y[c] = S * (float)((int)get_code(codes, c, l->bits) - z);
    }
}

static void channel_int8_encode(const kvf_section_layout *l, const kvf_stage_layout *st, int64_t n,
                                int32_t h, int d, const float *r, uint8_t *packed) {
    size_t gpt = (size_t)l->groups_per_token;
    uint8_t scratch[KVF_REF_MAX_DIM / 4];
    for (int64_t t = 0; t < n; t++) {
        size_t row = (size_t)h * (size_t)n + (size_t)t;
        uint8_t *stored = code_row(l, st, packed, row);
        int8_token_encode(l, r + t * d, row_codes_out(l, stored, d, scratch), packed + st->scales_off + row * gpt,
                          packed + st->tscales_off + row * 2, packed + st->zeros_off + row * gpt);
        row_codes_done(l, scratch, d, stored);
    }
}

static void channel_int8_decode(const kvf_section_layout *l, const kvf_stage_layout *st, int64_t n,
                                int32_t h, int d, const uint8_t *packed, float *rhat) {
    size_t gpt = (size_t)l->groups_per_token;
    uint8_t scratch[KVF_REF_MAX_DIM / 4];
    for (int64_t t = 0; t < n; t++) {
        size_t row = (size_t)h * (size_t)n + (size_t)t;
        int8_token_decode(l, row_codes_in(l, packed + st->codes_off + row * l->code_bytes_per_token, d, scratch),
                          packed + st->scales_off + row * gpt, packed + st->tscales_off + row * 2,
                          packed + st->zeros_off + row * gpt, rhat + t * d);
    }
}

/* ------------------------------------------------------------ dispatch */

void kvf_ref_quant_encode(const kvf_section_layout *l, const kvf_stage_layout *st, int64_t n,
                          int32_t h, int d, const float *r, uint8_t *packed) {
    if (l->axis == KVF_AXIS_TOKEN) token_fp16_encode(l, st, n, h, d, r, packed); /* fp16 only (the plan's rule) */
    else if (l->scale_format == KVF_SCALE_INT8_FP16) channel_int8_encode(l, st, n, h, d, r, packed);
    else channel_fp16_encode(l, st, n, h, d, r, packed);
}

void kvf_ref_quant_decode(const kvf_section_layout *l, const kvf_stage_layout *st, int64_t n,
                          int32_t h, int d, const uint8_t *packed, float *rhat) {
    if (l->axis == KVF_AXIS_TOKEN) token_fp16_decode(l, st, n, h, d, packed, rhat);
    else if (l->scale_format == KVF_SCALE_INT8_FP16) channel_int8_decode(l, st, n, h, d, packed, rhat);
    else channel_fp16_decode(l, st, n, h, d, packed, rhat);
}
