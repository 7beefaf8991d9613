/*
 * PSAC (docs/METHODS.md section 4): the stored basis of a head (int8 codes of
 * the query statistics' principal subspace with one scale), and per key token
 * the error's coordinates in it, INT8 with an fp16 scale, kept only where
 * they lower the query-weighted error.
 */
#include "cpu/ref.h"

#include <math.h>
#include <string.h>

/* The stored basis: one scale per head, s = max |u| / 127 (f32; NaN entries
 * left out of the maximum), codes b = clamp(rintf(u / s), -127, 127) (NaN: 0).
 * A maximum that gives no finite positive s stores s = 0 and zero codes. */
void kvf_ref_psac_basis(const float *u, int d, int r, int8_t *b, float *bscale) {
    size_t n = (size_t)d * (size_t)r;
    float amax = 0.0f;
    for (size_t i = 0; i < n; i++)
        if (fabsf(u[i]) > amax) amax = fabsf(u[i]);
    float s = amax / 127.0f;
    if (!(s > 0.0f) || !isfinite(s)) {
        memset(b, 0, n);
        *bscale = 0.0f;
        return;
    }
    for (size_t i = 0; i < n; i++) {
        float q = u[i] / s;
        q = isnan(q) ? 0.0f : rintf(q);
        b[i] = (int8_t)(q < -127.0f ? -127.0f : q > 127.0f ? 127.0f : q);
    }
    *bscale = s;
}

/* C_j = s * sum_c e[c] b[c][j]: the sum in f64 in channel order (each product
 * of an f32 and an int8 is exact), then one f64 product with the scale. */
static void project_error(const float *e, const int8_t *b, float bscale, int d, int r, double *cj) {
    for (int j = 0; j < r; j++) {
        double s = 0;
        for (int c = 0; c < d; c++) s += (double)e[c] * (double)b[(size_t)c * r + j];
        cj[j] = (double)bscale * s;
    }
}

/* max_j |f32(C_j)|, or NaN when some C_j is not finite. */
static float max_abs(const double *cj, int r) {
    float m = 0.0f;
    for (int j = 0; j < r; j++) {
        float a = fabsf((float)cj[j]);
        if (!isfinite(a)) return NAN;
        if (a > m) m = a;
    }
    return m;
}

static int8_t code_of(double cj, float scale) {
    float q = rintf((float)cj / scale);
    q = q < -127.0f ? -127.0f : q > 127.0f ? 127.0f : q;
    return (int8_t)q;
}

static void no_correction(int8_t *coef, int r, uint16_t *scale) {
    memset(coef, 0, (size_t)r);
    *scale = 0;
}

void kvf_ref_psac_encode(const float *e, const int8_t *b, float bscale, const float *lambda, int d, int r,
                         int8_t *coef, uint16_t *scale) {
    double cj[KVF_MAX_PSAC_RANK];
    if (r < 1 || r > KVF_MAX_PSAC_RANK) return;
    project_error(e, b, bscale, d, r, cj);
    float amax = max_abs(cj, r);
    uint16_t cs = kvf_f32_to_f16(amax / 127.0f);
    float csf = kvf_f16_to_f32(cs);
    if (!(csf > 0.0f) || !isfinite(csf)) { /* zero error, fp16 underflow, NaN */
        no_correction(coef, r, scale);
        return;
    }
    /* delta = sum_j lambda_j ((c_hat_j - C_j)^2 - C_j^2): the change of
     * e^T M e when U^T M U = diag(lambda). */
    double delta = 0;
    for (int j = 0; j < r; j++) {
        coef[j] = code_of(cj[j], csf);
        double miss = (double)(csf * (float)coef[j]) - cj[j];
        delta += (double)lambda[j] * (miss * miss - cj[j] * cj[j]);
    }
    if (!(delta < 0)) { /* does not lower the error (or NaN): keep nothing */
        no_correction(coef, r, scale);
        return;
    }
    *scale = cs;
}

/* y[c] += (f32(scale) * bscale) * sum_j coef[j] b[c][j]: the dot product is
 * an exact integer (|sum| <= 64 * 128 * 128 = 2^20, codes of -128 from a
 * hostile cache included, so its float is exact too), added with one fma per
 * channel. */
void kvf_ref_psac_apply(float *y, const int8_t *b, float bscale, const int8_t *coef, uint16_t scale, int d, int r) {
    float s = kvf_f16_to_f32(scale);
    if (s == 0.0f) return; /* no correction stored: y untouched (keeps -0.0) */
    float k = s * bscale;
    for (int c = 0; c < d; c++) {
        int32_t dot = 0;
        for (int j = 0; j < r; j++) dot += (int32_t)coef[j] * (int32_t)b[(size_t)c * r + j];
        y[c] = fmaf(k, (float)dot, y[c]);
    }
}
