/*
 * PSAC of one key token (docs/METHODS.md section 4): the error's coordinates
 * in the stored bf16 basis of the query statistics' principal subspace, INT8
 * with an fp16 scale, kept only where they lower the query-weighted error.
 */
#include "ref.h"

#include <math.h>
#include <string.h>

#define PSAC_MAX_RANK 1024

/* C_j = sum_c e[c] U[c][j], f64 in channel order, U the bf16 basis. */
static void project_error(const float *e, const uint16_t *ubf, int d, int r, double *cj) {
    for (int j = 0; j < r; j++) {
        double s = 0;
        for (int c = 0; c < d; c++) s += (double)e[c] * (double)kvf_bf16_to_f32(ubf[(size_t)c * r + j]);
        cj[j] = s;
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

void kvf_ref_psac_encode(const float *e, const uint16_t *ubf, const float *lambda, int d, int r, int8_t *coef,
                         uint16_t *scale) {
    double cj[PSAC_MAX_RANK];
    if (r < 1 || r > PSAC_MAX_RANK) return;
    project_error(e, ubf, d, r, cj);
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

void kvf_ref_psac_apply(float *y, const uint16_t *ubf, const int8_t *coef, uint16_t scale, int d, int r) {
    float s = kvf_f16_to_f32(scale);
    if (s == 0.0f) return; /* no correction stored: y untouched (keeps -0.0) */
    for (int j = 0; j < r; j++) {
        float c_hat = s * (float)coef[j];
        for (int c = 0; c < d; c++) y[c] = fmaf(c_hat, kvf_bf16_to_f32(ubf[(size_t)c * r + j]), y[c]);
    }
}
