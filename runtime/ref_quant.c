/*
 * CPU reference of RTN (round to nearest) quantization: the oracle the GPU
 * kernels are checked against, bit for bit. docs/FORMAT.md states the same
 * formulas; every float operation below is a single IEEE binary32 operation
 * (no contraction; fmaf where the format says fma) so another implementation
 * that performs the same operations gets the same bytes.
 */
#include "internal.h"

#include <math.h>
#include <string.h>

/* ------------------------------------------------------------ bytes and bits */

static void put_u16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)(v & 0xffu);
    p[1] = (uint8_t)(v >> 8);
}

static uint16_t get_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

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

/* ------------------------------------------------------------ one group */

/* -0 and +0 compare equal and min/max may return either: store +0 so that
 * every implementation writes the same bits. */
static float plus_zero(float f) { return f == 0.0f ? 0.0f : f; }

/* Minimum and maximum of the group's non-NaN values (NaN if all are NaN). */
static void group_range(const uint16_t *x, int g, float *mn, float *mx) {
    float lo = kvf_bf16_to_f32(x[0]), hi = lo;
    for (int c = 1; c < g; c++) {
        float f = kvf_bf16_to_f32(x[c]);
        lo = fminf(lo, f); /* fminf/fmaxf return the other operand for a NaN */
        hi = fmaxf(hi, f);
    }
    *mn = plus_zero(lo);
    *mx = plus_zero(hi);
}

/* Stored fp16 scales and zeros: a NaN is always 0x7E00, whatever its sign
 * and payload (they differ between CPUs and GPUs). */
static uint16_t stored_f16(float f) { return isnan(f) ? 0x7e00u : kvf_f32_to_f16(f); }

/* Decoded values: a NaN is always 0x7FC0, for the same reason. */
static uint16_t output_bf16(float f) { return isnan(f) ? 0x7fc0u : kvf_f32_to_bf16(f); }

/* Clamp to [lo, hi]; a NaN becomes lo. */
static float clampf(float r, float lo, float hi) { return fminf(fmaxf(r, lo), hi); }

/* Affine: x_hat = M + S*q with M = fp16(min), S = fp16((max - min) / (2^b - 1)). */
static void affine_encode_group(const uint16_t *x, int g, int bits, uint8_t *codes, int c0,
                                uint16_t *scale, uint16_t *zero) {
    float levels = (float)((1 << bits) - 1), mn, mx;
    group_range(x, g, &mn, &mx);
    float s = (mx - mn) / levels;
    *scale = stored_f16(s);
    *zero = stored_f16(mn);
    float S = kvf_f16_to_f32(*scale), M = kvf_f16_to_f32(*zero);
    for (int c = 0; c < g; c++) {
        unsigned q = 0;
        if (S > 0.0f) {
            float d = kvf_bf16_to_f32(x[c]) - M;
            float t = d / S;
            q = (unsigned)clampf(rintf(t), 0.0f, levels);
        }
        put_code(codes, c0 + c, bits, q);
    }
}

/* Symmetric: x_hat = S*(code - qmax) with S = fp16(max|x| / qmax), qmax = 2^(b-1) - 1. */
static void symmetric_encode_group(const uint16_t *x, int g, int bits, uint8_t *codes, int c0,
                                   uint16_t *scale) {
    int qmax = (1 << (bits - 1)) - 1;
    float a = 0.0f;
    for (int c = 0; c < g; c++) a = fmaxf(a, fabsf(kvf_bf16_to_f32(x[c])));
    float s = a / (float)qmax;
    *scale = stored_f16(s);
    float S = kvf_f16_to_f32(*scale);
    for (int c = 0; c < g; c++) {
        int q = 0;
        if (S > 0.0f) q = (int)clampf(rintf(kvf_bf16_to_f32(x[c]) / S), (float)-qmax, (float)qmax);
        put_code(codes, c0 + c, bits, (unsigned)(q + qmax));
    }
}

/* ------------------------------------------------------------ one token row */

/* Byte offsets of row r (= head * n_tokens + token) in each plane of a section. */
typedef struct row_offs {
    size_t codes, scales, zeros;
} row_offs;

static row_offs section_row(const kvf_section_layout *l, size_t r) {
    size_t gb = (size_t)l->groups_per_token * 2; /* one fp16 per group */
    row_offs o = {l->codes_off + r * l->code_bytes_per_token, l->scales_off + r * gb,
                  l->zeros_off + r * gb};
    return o;
}

static void encode_row(const kvf_section_layout *l, int head_dim, const uint16_t *x,
                       uint8_t *packed, row_offs o) {
    uint8_t *codes = packed + o.codes;
    if (l->bits == 16) {
        for (int c = 0; c < head_dim; c++) put_u16(codes + 2 * c, x[c]);
        return;
    }
    for (int g = 0; g < l->groups_per_token; g++) {
        int c0 = g * l->group_size;
        uint16_t scale, zero;
        if (l->mode == KVF_MODE_AFFINE) {
            affine_encode_group(x + c0, l->group_size, l->bits, codes, c0, &scale, &zero);
            put_u16(packed + o.zeros + 2 * g, zero);
        } else {
            symmetric_encode_group(x + c0, l->group_size, l->bits, codes, c0, &scale);
        }
        put_u16(packed + o.scales + 2 * g, scale);
    }
}

static void decode_row(const kvf_section_layout *l, int head_dim, const uint8_t *packed,
                       row_offs o, uint16_t *y) {
    const uint8_t *codes = packed + o.codes;
    if (l->bits == 16) {
        for (int c = 0; c < head_dim; c++) y[c] = get_u16(codes + 2 * c);
        return;
    }
    int qmax = (1 << (l->bits - 1)) - 1;
    for (int g = 0; g < l->groups_per_token; g++) {
        float S = kvf_f16_to_f32(get_u16(packed + o.scales + 2 * g));
        float M = l->mode == KVF_MODE_AFFINE ? kvf_f16_to_f32(get_u16(packed + o.zeros + 2 * g)) : 0.0f;
        for (int c = g * l->group_size; c < (g + 1) * l->group_size; c++) {
            unsigned q = get_code(codes, c, l->bits);
            float f = l->mode == KVF_MODE_AFFINE ? fmaf(S, (float)q, M) : S * (float)((int)q - qmax);
            y[c] = output_bf16(f);
        }
    }
}

/* ------------------------------------------------------------ sections */

static void encode_section(const kvf_layout *L, const kvf_section_layout *l, const uint16_t *x,
                           const kvf_shape *sh, uint8_t *packed) {
    for (int32_t h = 0; h < L->n_heads; h++)
        for (int64_t t = 0; t < L->n_tokens; t++) {
            size_t r = (size_t)h * (size_t)L->n_tokens + (size_t)t;
            encode_row(l, L->head_dim, x + t * sh->token_stride + h * sh->head_stride, packed,
                       section_row(l, r));
        }
}

static void decode_section(const kvf_layout *L, const kvf_section_layout *l, const uint8_t *packed,
                           const kvf_shape *sh, uint16_t *y) {
    for (int32_t h = 0; h < L->n_heads; h++)
        for (int64_t t = 0; t < L->n_tokens; t++) {
            size_t r = (size_t)h * (size_t)L->n_tokens + (size_t)t;
            decode_row(l, L->head_dim, packed, section_row(l, r),
                       y + t * sh->token_stride + h * sh->head_stride);
        }
}

/* Checks shared by encode and decode: scheme, layout, shape. */
static int prepare(const struct kvf_scheme *s, const kvf_shape *shape, kvf_layout *L,
                   kvf_shape *sh) {
    int rc = kvf_shape_resolve(shape, s->head_dim, sh);
    if (!rc) rc = kvf_layout_compute(s, sh->n_tokens, sh->n_heads, L);
    return rc;
}

int kvf_ref_encode(const struct kvf_scheme *s, const uint16_t *k, const uint16_t *v,
                   const kvf_shape *shape, const void *qstats, uint8_t *packed, size_t packed_bytes) {
    (void)qstats; /* RTN reads no query statistics */
    if (!s || !k || !v || !shape || !packed)
        return kvf_set_error(KVF_EINVAL, "kvf_ref_encode: NULL argument");
    kvf_layout L;
    kvf_shape sh;
    int rc = prepare(s, shape, &L, &sh);
    if (rc) return rc;
    if (packed_bytes < L.total_bytes)
        return kvf_set_error(KVF_ERANGE,
                             "packed buffer is %zu bytes, %zu needed for %lld tokens x %d heads",
                             packed_bytes, L.total_bytes, (long long)L.n_tokens, (int)L.n_heads);

    memset(packed, 0, L.total_bytes); /* padding between planes is zero */
    kvf_packed_header hdr;
    kvf_header_fill(s, &L, &hdr);
    memcpy(packed, &hdr, sizeof hdr);
    encode_section(&L, &L.key, k, &sh, packed);
    encode_section(&L, &L.value, v, &sh, packed);
    return KVF_OK;
}

int kvf_ref_decode(const struct kvf_scheme *s, const uint8_t *packed, size_t packed_bytes,
                   const kvf_shape *shape, const int32_t *positions, uint16_t *k_out, uint16_t *v_out) {
    (void)positions; /* RTN schemes cache no pre-RoPE keys */
    if (!s || !packed || !shape || !k_out || !v_out)
        return kvf_set_error(KVF_EINVAL, "kvf_ref_decode: NULL argument");
    kvf_layout L;
    kvf_shape sh;
    int rc = prepare(s, shape, &L, &sh);
    if (!rc) rc = kvf_packed_check(s, packed, packed_bytes, sh.n_tokens, sh.n_heads);
    if (rc) return rc;
    if (packed_bytes < L.total_bytes)
        return kvf_set_error(KVF_ERANGE, "packed buffer is %zu bytes, its header says %zu",
                             packed_bytes, L.total_bytes);
    decode_section(&L, &L.key, packed, &sh, k_out);
    decode_section(&L, &L.value, packed, &sh, v_out);
    return KVF_OK;
}
