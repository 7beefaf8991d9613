/*
 * QVG's semantic smoothing and QuantWM's QSAC (docs/METHODS.md section 3):
 * k-means over one head's token vectors with a seeded strided initialisation,
 * Lloyd iterations with f64 distances and int64 fixed-point centroid sums, the
 * nearest-centroid rule, and the quantization-sensitivity-aware choice among
 * the M nearest centroids. Distances and scores are f64 sums in channel order;
 * the products (f32 x bf16) in the distances are exact in f64, so a GPU that
 * contracts them into fma gets the same sums.
 */
#include "cpu/ref.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define FIX_ONE 1048576.0     /* 2^20: fixed-point unit of the centroid sums */
#define FIX_MAX 68719476736.0 /* 2^36: |e| * 2^20 is clamped here (|e| <= 2^16), so
                                 2^26 tokens cannot overflow an int64 sum */

/* ---------------------------------------------------------------- init */

/* splitmix64 of x: Steele, Lea and Flood's mixer after one gamma step (the
 * first output of a generator seeded with x). */
static uint64_t splitmix64(uint64_t x) {
    uint64_t z = x + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Centroid j = token (o + floor(j*n/c)) % n, rounded to bf16. */
static void strided_init(const float *e, int64_t n, int d, int c, int64_t seed, int stage, int head,
                         uint16_t *cent) {
    uint64_t un = (uint64_t)n;
    uint64_t o = splitmix64((uint64_t)seed ^ ((uint64_t)stage << 32) ^ ((uint64_t)head << 40)) % un;
    for (int j = 0; j < c; j++) {
        uint64_t t = (o + (uint64_t)j * un / (uint64_t)c) % un;
        for (int k = 0; k < d; k++) cent[(size_t)j * d + k] = kvf_f32_to_bf16(e[t * d + k]);
    }
}

/* ---------------------------------------------------------------- distances */

void kvf_ref_centroid_norms(const uint16_t *cent, int c, int d, double *norms) {
    for (int j = 0; j < c; j++) {
        double nn = 0.0;
        for (int k = 0; k < d; k++) {
            double m = (double)kvf_bf16_to_f32(cent[(size_t)j * d + k]);
            nn += m * m;
        }
        norms[j] = nn;
    }
}

/* argmin_j ||mu_j||^2 - 2 <x, mu_j>; ties (and NaN distances) keep the lower j. */
int kvf_ref_nearest_normed(const float *x, const uint16_t *cent, const double *norms, int c, int d) {
    int best = 0;
    double best_d = 0.0;
    for (int j = 0; j < c; j++) {
        double dot = 0.0;
        const uint16_t *mu = cent + (size_t)j * d;
        for (int k = 0; k < d; k++) dot += (double)x[k] * (double)kvf_bf16_to_f32(mu[k]);
        double dist = norms[j] - 2.0 * dot;
        if (j == 0 || dist < best_d) best = j, best_d = dist;
    }
    return best;
}

int kvf_ref_nearest(const float *x, const uint16_t *cent, int c, int d) {
    double norms[KVF_REF_MAX_CENTROIDS];
    if (c > KVF_REF_MAX_CENTROIDS) c = KVF_REF_MAX_CENTROIDS;
    kvf_ref_centroid_norms(cent, c, d, norms);
    return kvf_ref_nearest_normed(x, cent, norms, c, d);
}

/* ---------------------------------------------------------------- Lloyd */

/* e * 2^20 rounded to an integer (ties to even), clamped to +-2^36; NaN -> 0. */
static int64_t fixed_point(float e) {
    double v = (double)e * FIX_ONE;
    if (v != v) return 0;
    if (v > FIX_MAX) v = FIX_MAX;
    if (v < -FIX_MAX) v = -FIX_MAX;
    return llrint(v);
}

typedef struct lloyd_work {
    int *z;          /* [n] assignment */
    double *norms;   /* [c] */
    int64_t *acc;    /* [c][d] */
    int64_t *count;  /* [c] */
} lloyd_work;

static void lloyd_step(const float *e, int64_t n, int d, int c, uint16_t *cent, lloyd_work *w) {
    kvf_ref_centroid_norms(cent, c, d, w->norms);
    for (int64_t i = 0; i < n; i++) w->z[i] = kvf_ref_nearest_normed(e + i * d, cent, w->norms, c, d);
    memset(w->acc, 0, (size_t)c * (size_t)d * sizeof *w->acc);
    memset(w->count, 0, (size_t)c * sizeof *w->count);
    for (int64_t i = 0; i < n; i++) {
        int64_t *a = w->acc + (size_t)w->z[i] * d;
        for (int k = 0; k < d; k++) a[k] += fixed_point(e[i * d + k]);
        w->count[w->z[i]]++;
    }
    for (int j = 0; j < c; j++) {
        if (w->count[j] == 0) continue; /* an empty cluster keeps its centroid */
        for (int k = 0; k < d; k++) {
            double mean = (double)w->acc[(size_t)j * d + k] / FIX_ONE / (double)w->count[j];
            cent[(size_t)j * d + k] = kvf_f32_to_bf16((float)mean);
        }
    }
}

int kvf_ref_kmeans(const float *e, int64_t n, int d, int c, int iters, int64_t seed, int stage,
                   int head, uint16_t *cent, int *last_z) {
    return kvf_ref_kmeans_warm(e, n, d, c, iters, seed, stage, head, NULL, 0, cent, last_z);
}

int kvf_ref_kmeans_warm(const float *e, int64_t n, int d, int c, int iters, int64_t seed, int stage,
                        int head, const uint16_t *warm, int c_warm, uint16_t *cent, int *last_z) {
    if (c > n) c = (int)n;
    strided_init(e, n, d, c, seed, stage, head, cent);
    for (int j = 0; warm && j < c_warm && j < c; j++) { /* a previous row with a NaN or Inf is not taken */
        const uint16_t *w = warm + (size_t)j * d;
        int finite = 1;
        for (int k = 0; k < d; k++) finite &= (w[k] & 0x7f80u) != 0x7f80u;
        if (finite) memcpy(cent + (size_t)j * d, w, (size_t)d * sizeof *cent);
    }
    if (iters <= 0) return KVF_OK;
    lloyd_work w = {last_z ? last_z : malloc((size_t)n * sizeof(int)), malloc((size_t)c * sizeof(double)),
                    malloc((size_t)c * (size_t)d * sizeof(int64_t)), malloc((size_t)c * sizeof(int64_t))};
    int rc = (w.z && w.norms && w.acc && w.count) ? KVF_OK
                                                  : kvf_set_error(KVF_ENOMEM, "k-means: out of memory");
    for (int it = 0; !rc && it < iters; it++) lloyd_step(e, n, d, c, cent, &w);
    if (!last_z) free(w.z); /* else the caller's: the last step's labels */
    free(w.norms), free(w.acc), free(w.count);
    return rc;
}

/* ---------------------------------------------------------------- QSAC */

/* d_Q = sum_c w_c (x_c - mu_c)^2, f64, channel order, no contraction. */
static double weighted_dist(const float *x, const uint16_t *mu, const float *w, int d) {
    double acc = 0.0;
    for (int k = 0; k < d; k++) {
        double t = (double)x[k] - (double)kvf_bf16_to_f32(mu[k]);
        double t2 = t * t;
        acc += (double)w[k] * t2;
    }
    return acc;
}

/* S = sum_g (sum_{c in g} w_c) R_g^2, R_g the f32 range of r = x - mu over group g. */
static double sensitivity_score(const float *x, const uint16_t *mu, const float *w, int d, int group) {
    double score = 0.0;
    for (int c0 = 0; c0 < d; c0 += group) {
        float lo = x[c0] - kvf_bf16_to_f32(mu[c0]), hi = lo;
        double wg = 0.0;
        for (int k = c0; k < c0 + group; k++) {
            float r = x[k] - kvf_bf16_to_f32(mu[k]);
            lo = fminf(lo, r);
            hi = fmaxf(hi, r);
            wg += (double)w[k];
        }
        double R = (double)(hi - lo);
        double R2 = R * R;
        score += wg * R2;
    }
    return score;
}

/* Insert (dist, j) into the sorted list of the m best (ascending dist, then j). */
static void keep_best(double *bd, int *bj, int *nb, int m, double dist, int j) {
    int pos = *nb;
    while (pos > 0 && dist < bd[pos - 1]) pos--; /* equal distances: the earlier j stays first */
    if (pos >= m) return;
    int last = *nb < m ? *nb : m - 1;
    for (int i = last; i > pos; i--) bd[i] = bd[i - 1], bj[i] = bj[i - 1];
    bd[pos] = dist, bj[pos] = j;
    if (*nb < m) (*nb)++;
}

int kvf_ref_qsac(const float *x, const uint16_t *cent, int c, int d, const float *w, int m, int group_size) {
    if (m > c) m = c;
    if (m < 1) m = 1;
    double bd[KVF_REF_MAX_CENTROIDS];
    int bj[KVF_REF_MAX_CENTROIDS] = {0}, nb = 0;
    for (int j = 0; j < c; j++) keep_best(bd, bj, &nb, m, weighted_dist(x, cent + (size_t)j * d, w, d), j);
    int best = bj[0];
    double best_s = 0.0;
    for (int i = 0; i < nb; i++) {
        double s = sensitivity_score(x, cent + (size_t)bj[i] * d, w, d, group_size);
        if (i == 0 || s < best_s) best = bj[i], best_s = s;
    }
    return best;
}
