/*
 * The practitioner's pipeline on the CPU (docs/METHODS.md section 11): the
 * outliers a row keeps exactly, the refinement of the calibrated channels
 * (mixed precision), and the rows of the anchor a span is coded against.
 * ref_encode.c orders them around the quantizer; the GPU templates repeat
 * this arithmetic operation for operation.
 */
#include "cpu/ref.h"

#include <math.h>
#include <string.h>

/* |x| with NaN above every number (it is taken out first and kept exactly). */
static float magnitude(float x) { return isnan(x) ? INFINITY : fabsf(x); }

void kvf_ref_outliers_pick(const float *r, int d, int k, uint8_t *idx) {
    uint8_t taken[KVF_REF_MAX_DIM];
    memset(taken, 0, (size_t)d);
    for (int i = 0; i < k; i++) {
        int best = -1;
        float bm = 0.0f;
        for (int c = 0; c < d; c++) {
            if (taken[c]) continue;
            const float m = magnitude(r[c]);
            if (best < 0 || m > bm) best = c, bm = m; /* ties: the lower channel */
        }
        taken[best] = 1;
        idx[i] = (uint8_t)best;
    }
}

static int refine_qmax(int bits) { return (1 << (bits - 1)) - 1; }

void kvf_ref_refine_encode(const float *r, const float *rhat, const uint8_t *map, int d, int m, int bits,
                           uint8_t *codes, uint16_t *scale, float *add) {
    const int qmax = refine_qmax(bits);
    float diff[KVF_REF_MAX_DIM], a = 0.0f;
    for (int c = 0; c < d; c++) {
        diff[c] = 0.0f;
        if (map[c] == 255) continue;
        /* An outlier (r is NaN there), or a row that is not finite: nothing to refine. */
        const float v = r[c] - rhat[c];
        if (isfinite(v)) diff[c] = v;
        a = fmaxf(a, fabsf(diff[c]));
    }
    const uint16_t s16 = kvf_f32_to_f16(a / (float)qmax);
    const float S = kvf_f16_to_f32(s16);
    *scale = s16;
    memset(codes, 0, (size_t)m * (size_t)bits / 8);
    for (int c = 0; c < d; c++) {
        if (map[c] == 255) continue;
        const int slot = map[c];
        int q = 0;
        if (S > 0.0f) {
            float n = rintf(diff[c] / S);
            q = (int)fminf(fmaxf(n, (float)-qmax), (float)qmax);
        }
        const unsigned code = (unsigned)(q + qmax);
        const int bit = slot * bits;
        codes[bit / 8] |= (uint8_t)(code << (bit % 8));
        add[c] = S * (float)q;
    }
}

void kvf_ref_refine_decode(const uint8_t *codes, uint16_t scale, const uint8_t *map, int d, int bits, float *add) {
    const int qmax = refine_qmax(bits);
    const float S = kvf_f16_to_f32(scale);
    for (int c = 0; c < d; c++) {
        if (map[c] == 255) continue;
        const int bit = map[c] * bits;
        const unsigned code = (codes[bit / 8] >> (bit % 8)) & ((1u << bits) - 1u);
        add[c] = S * (float)((int)code - qmax);
    }
}

int kvf_ref_anchor_rows(const struct kvf_scheme *anchor, const uint8_t *packed, int64_t n_tokens, int32_t n_heads,
                        int32_t h, int t, float *rows) {
    kvf_layout L;
    int rc = kvf_layout_compute(anchor, n_tokens, n_heads, &L);
    if (rc) return rc;
    const kvf_section_layout *l = t ? &L.value : &L.key;
    const int d = anchor->head_dim;
    if (l->bits == 16) {
        const uint8_t *src = packed + l->stage[0].codes_off + (size_t)h * (size_t)n_tokens * (size_t)d * 2;
        for (size_t i = 0; i < (size_t)n_tokens * (size_t)d; i++) rows[i] = kvf_bf16_to_f32(kvf_get_u16(src + 2 * i));
        return KVF_OK;
    }
    kvf_ref_quant_decode(l, &l->stage[0], n_tokens, h, d, packed, rows);
    return KVF_OK;
}
