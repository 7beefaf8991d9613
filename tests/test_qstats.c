/* Query statistics, orthogonal iteration, PSAC and RoPE of the CPU reference
 * (runtime/cpu/ref_qstats.c, ref_psac.c, ref_rope.c; docs/METHODS.md 4 and 6). */
#include "testutil.h"
#include "cpu/ref.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ helpers */

/* A scheme filled by hand (tu_hand_scheme: RTN INT2, channel groups of
 * min(d, 64)): head_dim d, key.psac_rank r, RoPE theta 10000. */
static void make_scheme(struct kvf_scheme *s, int d, int r) {
    tu_hand_scheme(s, d, 2, 2, d < 64 ? d : 64, KVF_MODE_AFFINE);
    s->key.psac_rank = r;
    s->rope.theta = 10000.0;
    tu_finalize(s);
}

static double rng_unit(uint64_t *st) { return ((double)(tu_rng_next(st) >> 11) + 0.5) * 0x1.0p-53; }

static double rng_gauss(uint64_t *st) {
    double u = rng_unit(st), v = rng_unit(st);
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

/* A fresh, initialised statistics buffer (16-byte aligned). */
static void *new_qstats(const struct kvf_scheme *s, int32_t h, size_t *bytes) {
    assert_int_equal(kvf_qstats_size(s, h, bytes), KVF_OK);
    void *q = aligned_alloc(256, *bytes);
    assert_non_null(q);
    memset(q, 0xa5, *bytes);
    assert_int_equal(kvf_ref_qstats_init(s, q, *bytes, h), KVF_OK);
    return q;
}

static kvf_qstats_layout layout_of(const struct kvf_scheme *s, int32_t h) {
    kvf_qstats_layout l;
    assert_int_equal(kvf_qstats_layout_compute(s, h, &l), KVF_OK);
    return l;
}

static double count_of(const void *q, const kvf_qstats_layout *l, int h) {
    double c;
    memcpy(&c, (const uint8_t *)q + l->count_off + 8 * (size_t)h, 8);
    return c;
}

static const float *msum_of(const void *q, const kvf_qstats_layout *l, int h) {
    return (const float *)((const uint8_t *)q + l->msum_off) + (size_t)h * l->head_dim * l->head_dim;
}

static void update_ok(const struct kvf_scheme *s, void *q, size_t bytes, const uint16_t *x, const kvf_shape *sh) {
    int rc = kvf_ref_qstats_update(s, q, bytes, x, sh);
    if (rc) fail_msg("update: %s", kvf_last_error());
}

/* Modified Gram-Schmidt on the c columns of a rows x c matrix (f64, column j = v[i*c + j]). */
static void orthonormalize_columns(double *v, int rows, int c) {
    for (int j = 0; j < c; j++) {
        for (int k = 0; k < j; k++) {
            double dot = 0;
            for (int i = 0; i < rows; i++) dot += v[i * c + j] * v[i * c + k];
            for (int i = 0; i < rows; i++) v[i * c + j] -= dot * v[i * c + k];
        }
        double nn = 0;
        for (int i = 0; i < rows; i++) nn += v[i * c + j] * v[i * c + j];
        for (int i = 0; i < rows; i++) v[i * c + j] /= sqrt(nn);
    }
}

/* Random orthogonal n x n matrix (f64, column j = q[i*n + j]): MGS of a Gaussian matrix. */
static void random_orthogonal(double *q, int n, uint64_t *st) {
    for (int i = 0; i < n * n; i++) q[i] = rng_gauss(st);
    orthonormalize_columns(q, n, n);
}

/* Eigenvalues with a gap after the r-th: 10, 9.2, ... (r of them) then the
 * bulk in [0.05, 1]. */
static void gapped_spectrum(double *lam, int d, int r, uint64_t *st) {
    for (int j = 0; j < d; j++) lam[j] = j < r ? 10.0 - 0.8 * j : 0.05 + 0.95 * rng_unit(st);
}

/* m = Q diag(lam) Q^T (f64). */
static void compose(const double *q, const double *lam, int d, double *m) {
    for (int i = 0; i < d; i++)
        for (int j = 0; j < d; j++) {
            double s = 0;
            for (int k = 0; k < d; k++) s += q[i * d + k] * lam[k] * q[j * d + k];
            m[i * d + j] = s;
        }
}

/* Cyclic Jacobi eigensolver (f64) of a symmetric n x n matrix: vals
 * descending, vecs[i*n + j] = component i of eigenvector j. */
static void jacobi_eigen(const double *m, int n, double *vals, double *vecs) {
    double *a = malloc(sizeof(double) * n * n), *v = malloc(sizeof(double) * n * n);
    assert_true(a && v);
    memcpy(a, m, sizeof(double) * n * n);
    double frob = 0;
    for (int i = 0; i < n * n; i++) v[i] = (i / n == i % n), frob += a[i] * a[i];
    for (int sweep = 0; sweep < 100; sweep++) {
        double off = 0;
        for (int p = 0; p < n; p++)
            for (int q = p + 1; q < n; q++) off += a[p * n + q] * a[p * n + q];
        if (off <= 1e-30 * frob) break;
        for (int p = 0; p < n; p++)
            for (int q = p + 1; q < n; q++) {
                double apq = a[p * n + q];
                if (fabs(apq) < 1e-300) continue;
                double th = (a[q * n + q] - a[p * n + p]) / (2 * apq);
                double t = (th >= 0 ? 1.0 : -1.0) / (fabs(th) + sqrt(th * th + 1));
                double c = 1 / sqrt(t * t + 1), s = t * c;
                for (int k = 0; k < n; k++) { /* columns p, q */
                    double kp = a[k * n + p], kq = a[k * n + q];
                    a[k * n + p] = c * kp - s * kq, a[k * n + q] = s * kp + c * kq;
                    kp = v[k * n + p], kq = v[k * n + q];
                    v[k * n + p] = c * kp - s * kq, v[k * n + q] = s * kp + c * kq;
                }
                for (int k = 0; k < n; k++) { /* rows p, q */
                    double pk = a[p * n + k], qk = a[q * n + k];
                    a[p * n + k] = c * pk - s * qk, a[q * n + k] = s * pk + c * qk;
                }
            }
    }
    /* Sort descending (selection on the diagonal). */
    int *idx = malloc(sizeof(int) * n);
    for (int j = 0; j < n; j++) idx[j] = j;
    for (int j = 0; j < n; j++)
        for (int k = j + 1; k < n; k++)
            if (a[idx[k] * n + idx[k]] > a[idx[j] * n + idx[j]]) { int t = idx[j]; idx[j] = idx[k]; idx[k] = t; }
    for (int j = 0; j < n; j++) {
        vals[j] = a[idx[j] * n + idx[j]];
        for (int i = 0; i < n; i++) vecs[i * n + j] = v[i * n + idx[j]];
    }
    /* Self-check: M v = lambda v. */
    for (int j = 0; j < n; j++)
        for (int i = 0; i < n; i++) {
            double s = 0;
            for (int k = 0; k < n; k++) s += m[i * n + k] * vecs[k * n + j];
            assert_true(fabs(s - vals[j] * vecs[i * n + j]) < 1e-9 * (1 + fabs(vals[0])));
        }
    free(a), free(v), free(idx);
}

/* ||U U^T - V V^T||_F: U f32 [d][r], V the first r columns of vecs [d][d]. */
static double subspace_distance(const float *u, const double *vecs, int d, int r) {
    double s = 0;
    for (int i = 0; i < d; i++)
        for (int j = 0; j < d; j++) {
            double pu = 0, pv = 0;
            for (int k = 0; k < r; k++) {
                pu += (double)u[i * r + k] * u[j * r + k];
                pv += vecs[i * d + k] * vecs[j * d + k];
            }
            s += (pu - pv) * (pu - pv);
        }
    return sqrt(s);
}

/* max |U^T U - I|. */
static double orthonormality_error(const float *u, int d, int r) {
    double worst = 0;
    for (int a = 0; a < r; a++)
        for (int b = 0; b < r; b++) {
            double s = 0;
            for (int i = 0; i < d; i++) s += (double)u[i * r + a] * u[i * r + b];
            worst = fmax(worst, fabs(s - (a == b)));
        }
    return worst;
}

/* M = msum / count of head h in f64. */
static void true_m(const void *q, const kvf_qstats_layout *l, int h, double *m) {
    int d = l->head_dim;
    const float *ms = msum_of(q, l, h);
    double c = count_of(q, l, h);
    for (int i = 0; i < d * d; i++) m[i] = ms[i] / c;
}

/* Queries q = Q diag(sqrt(lam)) g (bf16), head-major [H][n][d]. */
static void draw_queries(uint16_t *x, int n, int h, int d, const double *q, const double *lam, uint64_t *st) {
    double *g = malloc(sizeof(double) * d);
    for (int64_t t = 0; t < (int64_t)n * h; t++) {
        for (int k = 0; k < d; k++) g[k] = rng_gauss(st) * sqrt(lam[k]);
        for (int i = 0; i < d; i++) {
            double s = 0;
            for (int k = 0; k < d; k++) s += q[i * d + k] * g[k];
            x[t * d + i] = kvf_f32_to_bf16((float)s);
        }
    }
    free(g);
}

/* Rayleigh quotients of a basis of the top-r subspace: descending, inside
 * [lambda_r, lambda_1] of the eigensolver, summing to the subspace's trace.
 * (Orthogonal iteration converges to the subspace; inside it, columns of
 * close eigenvalues need not be single eigenvectors yet.) */
static void check_lambda(const float *lam, const double *vals, int r) {
    double sum = 0, want = 0, tol = 1e-5 * vals[0];
    for (int j = 0; j < r; j++) {
        if (j) assert_true(lam[j] <= lam[j - 1]);
        assert_true(lam[j] <= vals[0] + tol && lam[j] >= vals[r - 1] - tol);
        sum += lam[j], want += vals[j];
    }
    if (!(fabs(sum - want) < 1e-5 * want)) fail_msg("sum of lambda %.9g, of the top eigenvalues %.9g", sum, want);
}

/* Check the stored basis of head h against a full eigensolver of the stored M. */
static void check_basis(const void *qs, const kvf_qstats_layout *l, int h, double tol) {
    int d = l->head_dim, r = l->rank;
    double *m = malloc(sizeof(double) * d * d), *vecs = malloc(sizeof(double) * d * d), *vals = malloc(sizeof(double) * d);
    true_m(qs, l, h, m);
    jacobi_eigen(m, d, vals, vecs);
    const float *u, *lam;
    assert_int_equal(kvf_ref_qstats_basis(qs, h, d, r, &u, &lam), 1);
    double dist = subspace_distance(u, vecs, d, r);
    if (!(dist < tol)) fail_msg("head %d: ||UU^T - VV^T|| = %.3g (tolerance %.1g)", h, dist, tol);
    assert_true(orthonormality_error(u, d, r) < 1e-5);
    check_lambda(lam, vals, r);
    free(m), free(vecs), free(vals);
}

/* ------------------------------------------------------------ layout, init, check */

static void test_layout(void **state) {
    (void)state;
    struct kvf_scheme s;
    make_scheme(&s, 64, 8);
    kvf_qstats_layout l = layout_of(&s, 2);
    assert_int_equal(l.count_off, 256);
    assert_int_equal(l.msum_off, 512);
    assert_int_equal(l.u_off, 512 + 2 * 64 * 64 * 4);
    assert_int_equal(l.lambda_off, l.u_off + 2 * 64 * 8 * 4);
    assert_int_equal(l.total_bytes, l.lambda_off + 256);
    size_t b;
    assert_int_equal(kvf_qstats_size(&s, 2, &b), KVF_OK);
    assert_int_equal(b, l.total_bytes);
    /* Rank 0: count and sums only (QSAC weights). */
    make_scheme(&s, 128, 0);
    l = layout_of(&s, 3);
    assert_int_equal(l.u_off, 0);
    assert_int_equal(l.lambda_off, 0);
    assert_int_equal(l.total_bytes, 512 + 3 * 128 * 128 * 4);
    /* Errors. */
    assert_int_equal(kvf_qstats_size(&s, 0, &b), KVF_EINVAL);
    assert_int_equal(kvf_qstats_size(NULL, 1, &b), KVF_EINVAL);
    assert_int_equal(kvf_qstats_size(&s, 1, NULL), KVF_EINVAL);
    s.key.psac_rank = 128; /* the plan refuses it: no scheme reaches the statistics with it */
    assert_int_equal(kvf_scheme_finalize(&s), KVF_ESCHEME);
    assert_non_null(strstr(kvf_last_error(), "psac_rank"));
}

static void test_init(void **state) {
    (void)state;
    struct kvf_scheme s;
    make_scheme(&s, 64, 8);
    size_t bytes;
    void *q = new_qstats(&s, 3, &bytes);
    uint32_t hdr[16];
    memcpy(hdr, q, 64);
    assert_int_equal(hdr[0], 0x5146564bu);
    assert_memory_equal(q, "KVFQ", 4);
    assert_int_equal(hdr[1], 2); /* version 2: skipped-row counter at byte 24 */
    assert_int_equal(hdr[2], 3);
    assert_int_equal(hdr[3], 64);
    assert_int_equal(hdr[4], 8);
    for (int i = 5; i < 16; i++) assert_int_equal(hdr[i], 0);
    kvf_qstats_layout l = layout_of(&s, 3);
    for (size_t i = 64; i < bytes; i++) assert_int_equal(((uint8_t *)q)[i], 0); /* counts, sums, U, lambda */
    float w[64];
    const float *u, *lam;
    for (int h = 0; h < 3; h++) {
        assert_true(count_of(q, &l, h) == 0.0);
        assert_int_equal(kvf_ref_qstats_weights(q, h, 64, w), KVF_OK);
        for (int c = 0; c < 64; c++) assert_true(w[c] == 1.0f);
        assert_int_equal(kvf_ref_qstats_basis(q, h, 64, 8, &u, &lam), 0); /* cold start: no basis */
    }
    assert_int_equal(kvf_qstats_check(&s, q, bytes, 3), KVF_OK);
    assert_int_equal(kvf_qstats_check(&s, q, bytes, 0), KVF_OK);
    /* Too small, misaligned. */
    assert_int_equal(kvf_ref_qstats_init(&s, q, bytes - 1, 3), KVF_ERANGE);
    assert_int_equal(kvf_ref_qstats_init(&s, (uint8_t *)q + 8, bytes - 8, 1), KVF_EINVAL);
    free(q);
}

static void test_check(void **state) {
    (void)state;
    struct kvf_scheme s, other;
    make_scheme(&s, 64, 8);
    size_t bytes;
    void *q = new_qstats(&s, 2, &bytes);
    assert_int_equal(kvf_qstats_check(&s, q, bytes - 1, 2), KVF_ERANGE);
    assert_int_equal(kvf_qstats_check(&s, q, 63, 2), KVF_ERANGE);
    assert_int_equal(kvf_qstats_check(&s, q, bytes, 4), KVF_EFORMAT);
    assert_non_null(strstr(kvf_last_error(), "n_heads"));
    make_scheme(&other, 64, 4);
    assert_int_equal(kvf_qstats_check(&other, q, bytes, 2), KVF_EFORMAT);
    assert_non_null(strstr(kvf_last_error(), "psac_rank"));
    make_scheme(&other, 128, 8);
    assert_int_equal(kvf_qstats_check(&other, q, bytes, 2), KVF_EFORMAT);
    assert_non_null(strstr(kvf_last_error(), "head_dim"));
    uint8_t *b = q;
    b[40] = 1; /* reserved */
    assert_int_equal(kvf_qstats_check(&s, q, bytes, 2), KVF_EFORMAT);
    b[40] = 0;
    b[20] = 1; /* the reserved word before the skipped counter */
    assert_int_equal(kvf_qstats_check(&s, q, bytes, 2), KVF_EFORMAT);
    b[20] = 0;
    b[24] = 5; /* the skipped counter (any value is valid) */
    assert_int_equal(kvf_qstats_check(&s, q, bytes, 2), KVF_OK);
    b[24] = 0;
    b[4] = 1; /* version 1 (no skipped counter): refused, with what to do */
    assert_int_equal(kvf_qstats_check(&s, q, bytes, 2), KVF_EFORMAT);
    assert_non_null(strstr(kvf_last_error(), "version 1"));
    assert_non_null(strstr(kvf_last_error(), "kvf_qstats_init"));
    b[4] = 3; /* a future version */
    assert_int_equal(kvf_qstats_check(&s, q, bytes, 2), KVF_EFORMAT);
    b[4] = 2;
    b[0] ^= 1; /* magic */
    assert_int_equal(kvf_qstats_check(&s, q, bytes, 2), KVF_EFORMAT);
    assert_non_null(strstr(kvf_last_error(), "KVFQ"));
    uint16_t x[64] = {0};
    kvf_shape sh = {1, 2, 0, 0};
    assert_int_equal(kvf_ref_qstats_update(&s, q, bytes, x, &sh), KVF_EFORMAT);
    free(q);
}

/* ------------------------------------------------------------ accumulation */

/* d = 8, one head: small integers (exact in bf16, f32 and f64). */
static void test_update_hand(void **state) {
    (void)state;
    struct kvf_scheme s;
    make_scheme(&s, 8, 2);
    size_t bytes;
    void *q = new_qstats(&s, 1, &bytes);
    kvf_qstats_layout l = layout_of(&s, 1);
    static const float a[3][8] = {{1, 2, 0, 0, 0, 0, 0, -1}, {0, 3, 1, 0, 0, 0, 2, 0}, {-2, 0, 0, 4, 1, 0, 0, 0}};
    static const float b[2][8] = {{1, 1, 1, 1, 1, 1, 1, 1}, {0, 0, 0, 0, 0, 5, 0, 0}};
    uint16_t x[3 * 8];
    double want[64] = {0};
    for (int t = 0; t < 3; t++)
        for (int i = 0; i < 8; i++) {
            x[t * 8 + i] = kvf_f32_to_bf16(a[t][i]);
            for (int j = 0; j < 8; j++) want[i * 8 + j] += a[t][i] * a[t][j];
        }
    kvf_shape sh = {3, 1, 0, 0};
    update_ok(&s, q, bytes, x, &sh);
    assert_true(count_of(q, &l, 0) == 3.0);
    for (int i = 0; i < 64; i++) assert_true(msum_of(q, &l, 0)[i] == (float)want[i]);
    for (int t = 0; t < 2; t++)
        for (int i = 0; i < 8; i++) {
            x[t * 8 + i] = kvf_f32_to_bf16(b[t][i]);
            for (int j = 0; j < 8; j++) want[i * 8 + j] += b[t][i] * b[t][j];
        }
    sh.n_tokens = 2;
    update_ok(&s, q, bytes, x, &sh);
    assert_true(count_of(q, &l, 0) == 5.0);
    for (int i = 0; i < 64; i++) assert_true(msum_of(q, &l, 0)[i] == (float)want[i]);
    float w[8];
    assert_int_equal(kvf_ref_qstats_weights(q, 0, 8, w), KVF_OK);
    for (int c = 0; c < 8; c++) assert_true(w[c] == (float)(want[c * 8 + c] / 5.0));
    const float *u, *lam;
    assert_int_equal(kvf_ref_qstats_basis(q, 0, 8, 2, &u, &lam), 1);
    assert_true(orthonormality_error(u, 8, 2) < 1e-6);
    assert_true(lam[0] >= lam[1] && lam[1] > 0);
    free(q);
}

/* 8 query heads onto 2 KV heads, token-major queries [N][Hq][d]. */
static void test_gqa(void **state) {
    (void)state;
    enum { D = 8, HQ = 8, H = 2, N = 5 };
    struct kvf_scheme s;
    make_scheme(&s, D, 0);
    size_t bytes;
    void *q = new_qstats(&s, H, &bytes);
    kvf_qstats_layout l = layout_of(&s, H);
    uint16_t x[N * HQ * D];
    uint64_t st = 7;
    for (int i = 0; i < N * HQ * D; i++) x[i] = kvf_f32_to_bf16((float)(rng_gauss(&st) * 3.0));
    kvf_shape sh = {N, HQ, HQ * D, D};
    update_ok(&s, q, bytes, x, &sh);
    for (int h = 0; h < H; h++) {
        assert_true(count_of(q, &l, h) == (double)N * (HQ / H));
        for (int i = 0; i < D; i++)
            for (int j = 0; j < D; j++) {
                double want = 0;
                for (int qh = h * (HQ / H); qh < (h + 1) * (HQ / H); qh++)
                    for (int t = 0; t < N; t++)
                        want += (double)kvf_bf16_to_f32(x[(t * HQ + qh) * D + i]) *
                                kvf_bf16_to_f32(x[(t * HQ + qh) * D + j]);
                assert_true(msum_of(q, &l, h)[i * D + j] == (float)want);
            }
    }
    /* 6 query heads do not map onto 4 KV heads. */
    void *q4 = new_qstats(&s, 4, &bytes);
    sh.n_heads = 6;
    sh.token_stride = 6 * D;
    assert_int_equal(kvf_ref_qstats_update(&s, q4, bytes, x, &sh), KVF_EINVAL);
    assert_non_null(strstr(kvf_last_error(), "multiple"));
    free(q), free(q4);
}

/* Fewer queries than r: the basis stays orthonormal, the top columns span the
 * queries, the rest have lambda ~ 0 (zero columns replaced by unit vectors). */
static void test_rank_deficient(void **state) {
    (void)state;
    enum { D = 64, R = 8, N = 3 };
    struct kvf_scheme s;
    make_scheme(&s, D, R);
    size_t bytes;
    void *q = new_qstats(&s, 1, &bytes);
    uint16_t x[N * D];
    uint64_t st = 11;
    for (int i = 0; i < N * D; i++) x[i] = kvf_f32_to_bf16((float)rng_gauss(&st));
    kvf_shape sh = {N, 1, 0, 0};
    update_ok(&s, q, bytes, x, &sh);
    const float *u, *lam;
    assert_int_equal(kvf_ref_qstats_basis(q, 0, D, R, &u, &lam), 1);
    assert_true(orthonormality_error(u, D, R) < 1e-5);
    for (int j = 0; j < R; j++) {
        assert_true(isfinite(lam[j]));
        if (j < N) assert_true(lam[j] > 0.01f);
        else assert_true(fabsf(lam[j]) < 1e-5f * lam[0]);
    }
    /* Each query lies in the span of the first N columns. */
    for (int t = 0; t < N; t++) {
        double nx = 0, np = 0;
        for (int i = 0; i < D; i++) nx += (double)kvf_bf16_to_f32(x[t * D + i]) * kvf_bf16_to_f32(x[t * D + i]);
        for (int j = 0; j < N; j++) {
            double c = 0;
            for (int i = 0; i < D; i++) c += (double)kvf_bf16_to_f32(x[t * D + i]) * u[i * R + j];
            np += c * c;
        }
        assert_true(fabs(np - nx) < 1e-5 * nx);
    }
    /* Warm updates with more of the same: still fine. */
    for (int k = 0; k < 3; k++) update_ok(&s, q, bytes, x, &sh);
    assert_int_equal(kvf_ref_qstats_basis(q, 0, D, R, &u, &lam), 1);
    assert_true(orthonormality_error(u, D, R) < 1e-5);
    for (int j = N; j < R; j++) assert_true(fabsf(lam[j]) < 1e-5f * lam[0]);
    /* All-zero queries: M = 0, every column is zero and becomes e_0, e_1, ... */
    assert_int_equal(kvf_ref_qstats_init(&s, q, bytes, 1), KVF_OK);
    memset(x, 0, sizeof x);
    update_ok(&s, q, bytes, x, &sh);
    assert_int_equal(kvf_ref_qstats_basis(q, 0, D, R, &u, &lam), 1);
    for (int i = 0; i < D; i++)
        for (int j = 0; j < R; j++) assert_true(u[i * R + j] == (i == j ? 1.0f : 0.0f));
    for (int j = 0; j < R; j++) assert_true(lam[j] == 0.0f);
    free(q);
}

/* ------------------------------------------------------------ orthogonal iteration */

/* The perturbed identity of METHODS.md 4, orthonormalized (f64, then f32). */
static void perturbed_identity(float *u, int d, int r) {
    double *v = malloc(sizeof(double) * d * r);
    for (int i = 0; i < d; i++)
        for (int j = 0; j < r; j++) v[i * r + j] = (i == j) + 0.01 * (((i * 7 + j * 13) % 17) - 8) / 8.0;
    orthonormalize_columns(v, d, r);
    for (int i = 0; i < d * r; i++) u[i] = (float)v[i];
    free(v);
}

/* 24 iterations from the cold start on random SPD matrices with a gap. */
static void test_orthogonal_vs_jacobi(void **state) {
    (void)state;
    enum { R = 8 };
    static const int dims[2] = {64, 128};
    for (int di = 0; di < 2; di++)
        for (uint64_t seed = 1; seed <= 3; seed++) {
            int d = dims[di];
            uint64_t st = seed * 1000 + (uint64_t)d;
            double *q = malloc(sizeof(double) * d * d), *lam = malloc(sizeof(double) * d);
            double *m = malloc(sizeof(double) * d * d), *vecs = malloc(sizeof(double) * d * d);
            double *vals = malloc(sizeof(double) * d);
            float *mf = malloc(sizeof(float) * d * d), *u = malloc(sizeof(float) * d * R), lf[R];
            random_orthogonal(q, d, &st);
            gapped_spectrum(lam, d, R, &st);
            compose(q, lam, d, m);
            for (int i = 0; i < d * d; i++) mf[i] = (float)m[i];
            for (int i = 0; i < d * d; i++) m[i] = mf[i]; /* the matrix the iteration sees */
            jacobi_eigen(m, d, vals, vecs);
            perturbed_identity(u, d, R);
            kvf_ref_orthogonal_iteration(mf, d, R, 24, u, lf);
            double dist = subspace_distance(u, vecs, d, R);
            if (!(dist < 1e-3)) fail_msg("d %d seed %d: ||UU^T - VV^T|| = %.3g", d, (int)seed, dist);
            assert_true(orthonormality_error(u, d, R) < 1e-5);
            check_lambda(lf, vals, R);
            free(q), free(lam), free(m), free(vecs), free(vals), free(mf), free(u);
        }
}

/* The same through kvf_ref_qstats_update: queries drawn from a gapped
 * covariance; the basis of the stored M against Jacobi. */
static void test_update_basis(void **state) {
    (void)state;
    enum { R = 8, H = 2 };
    static const int dims[2] = {64, 128};
    for (int di = 0; di < 2; di++) {
        int d = dims[di], n = 8 * d;
        uint64_t st = 99 + (uint64_t)d;
        struct kvf_scheme s;
        make_scheme(&s, d, R);
        size_t bytes;
        void *qs = new_qstats(&s, H, &bytes);
        kvf_qstats_layout l = layout_of(&s, H);
        double *q = malloc(sizeof(double) * d * d), *lam = malloc(sizeof(double) * d);
        uint16_t *x = malloc(sizeof(uint16_t) * n * H * d);
        random_orthogonal(q, d, &st);
        gapped_spectrum(lam, d, R, &st);
        draw_queries(x, n, H, d, q, lam, &st);
        kvf_shape sh = {n, H, 0, 0};
        update_ok(&s, qs, bytes, x, &sh);
        for (int h = 0; h < H; h++) check_basis(qs, &l, h, 1e-3);
        free(qs), free(q), free(lam), free(x);
    }
}

/* Rotate the top directions of q towards the bulk by angle a (columns k and r + k). */
static void drift(double *q, int d, int r, double a) {
    for (int k = 0; k < r; k++)
        for (int i = 0; i < d; i++) {
            double x = q[i * d + k], y = q[i * d + r + k];
            q[i * d + k] = cos(a) * x - sin(a) * y;
            q[i * d + r + k] = sin(a) * x + cos(a) * y;
        }
}

/* 6 warm iterations from the previous basis follow a slowly changing matrix. */
static void test_warm_start(void **state) {
    (void)state;
    enum { D = 128, R = 8 };
    uint64_t st = 5;
    double *q = malloc(sizeof(double) * D * D), lam[D], *m = malloc(sizeof(double) * D * D);
    double *vecs = malloc(sizeof(double) * D * D), vals[D];
    float *mf = malloc(sizeof(float) * D * D), u[D * R], cold[D * R], lf[R];
    random_orthogonal(q, D, &st);
    gapped_spectrum(lam, D, R, &st);
    compose(q, lam, D, m);
    for (int i = 0; i < D * D; i++) mf[i] = (float)m[i];
    perturbed_identity(u, D, R);
    kvf_ref_orthogonal_iteration(mf, D, R, 24, u, lf);
    for (int step = 0; step < 5; step++) {
        drift(q, D, R, 0.05);
        compose(q, lam, D, m);
        for (int i = 0; i < D * D; i++) mf[i] = (float)m[i], m[i] = mf[i];
        jacobi_eigen(m, D, vals, vecs);
        double before = subspace_distance(u, vecs, D, R);
        kvf_ref_orthogonal_iteration(mf, D, R, 6, u, lf);
        double after = subspace_distance(u, vecs, D, R);
        if (!(after < 1e-3)) fail_msg("step %d: warm distance %.3g (was %.3g)", step, after, before);
        assert_true(before > 0.05); /* the matrix did move */
        /* 6 iterations from the cold start do not get there. */
        perturbed_identity(cold, D, R);
        kvf_ref_orthogonal_iteration(mf, D, R, 6, cold, lf);
        assert_true(subspace_distance(cold, vecs, D, R) > after);
    }
    /* Through update: a second chunk from the drifted distribution (warm). */
    struct kvf_scheme s;
    make_scheme(&s, D, R);
    size_t bytes;
    void *qs = new_qstats(&s, 1, &bytes);
    kvf_qstats_layout l = layout_of(&s, 1);
    int n = 4 * D;
    uint16_t *x = malloc(sizeof(uint16_t) * n * D);
    kvf_shape sh = {n, 1, 0, 0};
    for (int chunk = 0; chunk < 4; chunk++) {
        draw_queries(x, n, 1, D, q, lam, &st);
        update_ok(&s, qs, bytes, x, &sh);
        check_basis(qs, &l, 0, 1e-3);
        drift(q, D, R, 0.05);
    }
    free(q), free(m), free(vecs), free(mf), free(qs), free(x);
}

/* ------------------------------------------------------------ PSAC */

static double quad(const double *m, const double *e, int d) {
    double s = 0;
    for (int i = 0; i < d; i++)
        for (int j = 0; j < d; j++) s += e[i] * m[i * d + j] * e[j];
    return s;
}

/* U = the first r unit vectors, stored: codes 127 on the diagonal, scale 1/127. */
static void unit_basis(int d, int r, int8_t *b, float *bscale) {
    float u[64 * 8] = {0};
    assert_true(d * r <= 64 * 8);
    for (int j = 0; j < r; j++) u[j * r + j] = 1.0f;
    kvf_ref_psac_basis(u, d, r, b, bscale);
    assert_true(*bscale == 1.0f / 127.0f);
    for (int i = 0; i < d * r; i++) assert_int_equal(b[i], i / r == i % r ? 127 : 0);
}

/* The stored basis (METHODS.md 4): one scale per head from the largest |u|,
 * codes rounded to nearest (ties to even) and clamped; NaN entries are left
 * out of the maximum and get code 0; a basis without a finite positive scale
 * is stored as zeros. */
static void test_psac_basis_codes(void **state) {
    (void)state;
    enum { D = 4, R = 2 };
    float u[D * R] = {0.5f, -1.0f, 0.25f, 1.0f / 254.0f, NAN, -0.75f, 0.0f, -0.0f}, s;
    int8_t b[D * R];
    kvf_ref_psac_basis(u, D, R, b, &s);
    assert_true(s == 1.0f / 127.0f);
    /* 0.5 and 1/254 fall on exact ties (63.5, 0.5): to even. */
    const int want[D * R] = {64, -127, 32, 0, 0, -95, 0, 0};
    for (int i = 0; i < D * R; i++) assert_int_equal(b[i], want[i]);
    assert_int_equal(b[0], 64); /* 63.5 to even */
    /* Zero, Inf and all-NaN bases store nothing. */
    const float bad[3] = {0.0f, INFINITY, NAN};
    for (int k = 0; k < 3; k++) {
        for (int i = 0; i < D * R; i++) u[i] = i == 3 ? bad[k] : (k == 1 ? 0.5f : bad[k]);
        memset(b, 0x55, sizeof b);
        s = -1.0f;
        kvf_ref_psac_basis(u, D, R, b, &s);
        assert_true(s == 0.0f);
        for (int i = 0; i < D * R; i++) assert_int_equal(b[i], 0);
    }
}

/* The GPU decode's exact dot product (templates/kvf_decode.cuh, DOT_BIAS):
 * integer sums added to the bits of the float 2^23 + 2^22 give that float plus
 * the sum, for every sum PSAC can produce (|sum| <= 64 * 128 * 128 = 2^20),
 * so subtracting 2^23 + 2^22 leaves the sum exactly. */
static void test_psac_dot_bias(void **state) {
    (void)state;
    /* The constants as the library's embedded template states them. */
    const kvf_embedded_file *t = kvf_find_embedded(kvf_embedded_templates, "kvf_decode.cuh");
    assert_non_null(t);
    const char *pb = strstr(t->data, "constexpr int DOT_BIAS_BITS = "), *pf = strstr(t->data, "constexpr float DOT_BIAS = ");
    assert_non_null(pb);
    assert_non_null(pf);
    const uint32_t bias_bits = (uint32_t)strtoul(pb + strlen("constexpr int DOT_BIAS_BITS = "), NULL, 0);
    const float stated = strtof(pf + strlen("constexpr float DOT_BIAS = "), NULL);
    assert_true(bias_bits == 0x4b400000u);
    float bias;
    memcpy(&bias, &bias_bits, 4);
    assert_true(bias == 12582912.0f);
    assert_true(stated == bias); /* the float the kernel subtracts is the one its bits start from */
    for (int32_t dot = -(1 << 20); dot <= (1 << 20); dot++) {
        uint32_t u = bias_bits + (uint32_t)dot;
        float f;
        memcpy(&f, &u, 4);
        if (f - bias != (float)dot) fail_msg("sum %d comes out as %.1f", dot, (double)(f - bias));
    }
}

static void test_psac_hand(void **state) {
    (void)state;
    enum { D = 8, R = 2 };
    int8_t b[D * R];
    float bs;
    unit_basis(D, R, b, &bs);
    float e[D] = {3.0f, -1.5f, 0.25f, 7.0f, 0, 0, 0, 0}, lam[R] = {2.0f, 1.0f};
    int8_t c[R];
    uint16_t cs;
    kvf_ref_psac_encode(e, b, bs, lam, D, R, c, &cs);
    /* C_j = s * 127 e_j in f64. */
    const double c0 = (double)bs * 127.0 * 3.0, c1 = (double)bs * 127.0 * -1.5;
    assert_int_equal(cs, kvf_f32_to_f16((float)c0 / 127.0f));
    float csf = kvf_f16_to_f32(cs);
    assert_int_equal(c[0], (int)fminf(127.0f, rintf((float)c0 / csf)));
    assert_int_equal(c[1], (int)rintf((float)c1 / csf));
    /* Decode: y[k] = fma(f32(cs) * s, sum_j c_j b[k][j], y[k]). */
    float y[D] = {-0.0f, 1, 2, 3, 4, 5, 6, 7}, want[D];
    memcpy(want, y, sizeof y);
    for (int k = 0; k < D; k++) {
        int dot = 0;
        for (int j = 0; j < R; j++) dot += c[j] * b[k * R + j];
        want[k] = fmaf(csf * bs, (float)dot, want[k]);
    }
    kvf_ref_psac_apply(y, b, bs, c, cs, D, R);
    assert_memory_equal(y, want, sizeof y);
    assert_true(fabsf(y[0] - 3.0f) < 0.02f && fabsf(y[1] + 1.5f - 1.0f) < 0.02f);
    assert_true(y[2] == 2.0f && y[7] == 7.0f); /* outside the basis: + 0 */
}

/* PSAC lowers the full quadratic form e^T M e, with the true M of the
 * statistics, on random errors of several magnitudes. */
static void test_psac_lowers_error(void **state) {
    (void)state;
    enum { D = 64, R = 8, N = 512, T = 300 };
    uint64_t st = 21;
    struct kvf_scheme s;
    make_scheme(&s, D, R);
    size_t bytes;
    void *qs = new_qstats(&s, 1, &bytes);
    kvf_qstats_layout l = layout_of(&s, 1);
    double *q = malloc(sizeof(double) * D * D), lam[D], *m = malloc(sizeof(double) * D * D);
    uint16_t *x = malloc(sizeof(uint16_t) * N * D);
    random_orthogonal(q, D, &st);
    gapped_spectrum(lam, D, R, &st);
    draw_queries(x, N, 1, D, q, lam, &st);
    kvf_shape sh = {N, 1, 0, 0};
    update_ok(&s, qs, bytes, x, &sh);
    true_m(qs, &l, 0, m);
    const float *u, *lf;
    assert_int_equal(kvf_ref_qstats_basis(qs, 0, D, R, &u, &lf), 1);
    int8_t b[D * R];
    float bs;
    kvf_ref_psac_basis(u, D, R, b, &bs);
    assert_true(bs > 0.0f);
    double total_before = 0, total_after = 0;
    int kept = 0;
    for (int t = 0; t < T; t++) {
        double mag = pow(10.0, -3.0 + 5.0 * rng_unit(&st));
        float e[D], y[D] = {0};
        double e0[D], e1[D];
        for (int i = 0; i < D; i++) e[i] = (float)(mag * rng_gauss(&st)), e0[i] = e[i];
        int8_t c[R];
        uint16_t cs;
        kvf_ref_psac_encode(e, b, bs, lf, D, R, c, &cs);
        kvf_ref_psac_apply(y, b, bs, c, cs, D, R); /* x_hat_0 = 0: y is the correction */
        for (int i = 0; i < D; i++) e1[i] = e0[i] - y[i];
        double before = quad(m, e0, D), after = quad(m, e1, D);
        if (cs) {
            kept++;
            if (!(after < before)) fail_msg("token %d: e^T M e %.6g -> %.6g", t, before, after);
        } else {
            assert_true(after == before);
        }
        total_before += before / (mag * mag), total_after += after / (mag * mag);
    }
    assert_int_equal(kept, T);
    /* The top-8 directions hold most of M's trace: most of the error goes. */
    assert_true(total_after < 0.5 * total_before);
    free(qs), free(q), free(m), free(x);
}

/* Where U holds eigenvectors (M diagonal, U unit vectors, stored as codes 127
 * with scale f32(1/127), which is 1 within 2^-24) delta is the change of e^T M e. */
static void test_psac_delta_exact(void **state) {
    (void)state;
    enum { D = 16, R = 4 };
    uint64_t st = 33;
    double m[D * D] = {0};
    float lam[R];
    int8_t b[D * R];
    float bs;
    unit_basis(D, R, b, &bs);
    for (int i = 0; i < D; i++) m[i * D + i] = i < R ? 8.0 - i : 0.5;
    for (int j = 0; j < R; j++) lam[j] = (float)m[j * D + j];
    for (int t = 0; t < 100; t++) {
        float e[D], y[D] = {0};
        double e0[D], e1[D];
        for (int i = 0; i < D; i++) e[i] = (float)rng_gauss(&st), e0[i] = e[i];
        int8_t c[R];
        uint16_t cs;
        kvf_ref_psac_encode(e, b, bs, lam, D, R, c, &cs);
        assert_int_not_equal(cs, 0);
        kvf_ref_psac_apply(y, b, bs, c, cs, D, R);
        for (int i = 0; i < D; i++) e1[i] = e0[i] - y[i];
        double delta = 0, csf = kvf_f16_to_f32(cs);
        for (int j = 0; j < R; j++) {
            double cj = (double)bs * 127.0 * e[j], miss = (double)(float)(csf * c[j]) - cj;
            delta += lam[j] * (miss * miss - cj * cj);
        }
        assert_true(delta < 0);
        assert_true(fabs(delta - (quad(m, e1, D) - quad(m, e0, D))) < 1e-6 * quad(m, e0, D));
    }
}

/* The keep rule: delta >= 0 (or NaN) stores nothing. With lambda >= 0 and
 * round-to-nearest codes every term of delta is <= 0 (|c_hat - C| <= |C|), so
 * a nonzero correction can only be refused with lambdas forced here. */
static void test_psac_refuses(void **state) {
    (void)state;
    enum { D = 8, R = 2 };
    int8_t b[D * R];
    float bs;
    unit_basis(D, R, b, &bs);
    int8_t c[R];
    uint16_t cs;
    float e[D] = {3.0f, 1.0f};
    /* Kept with positive lambda. */
    float lam[R] = {1.0f, 1.0f};
    kvf_ref_psac_encode(e, b, bs, lam, D, R, c, &cs);
    assert_int_not_equal(cs, 0);
    /* lambda = 0: delta = 0, no gain. */
    lam[0] = lam[1] = 0.0f;
    memset(c, 0x55, sizeof c);
    kvf_ref_psac_encode(e, b, bs, lam, D, R, c, &cs);
    assert_int_equal(cs, 0);
    assert_int_equal(c[0], 0);
    assert_int_equal(c[1], 0);
    /* Mixed signs: the gain on column 0 weighs less than the loss on column 1. */
    lam[0] = 0.01f, lam[1] = -1.0f;
    kvf_ref_psac_encode(e, b, bs, lam, D, R, c, &cs);
    assert_int_equal(cs, 0);
    lam[0] = 1.0f, lam[1] = -0.01f;
    kvf_ref_psac_encode(e, b, bs, lam, D, R, c, &cs);
    assert_int_not_equal(cs, 0);
    /* Zero error, fp16 underflow of the scale, NaN. */
    lam[0] = lam[1] = 1.0f;
    float zero[D] = {0}, tiny[D] = {1e-7f, -1e-7f}, nan_e[D] = {NAN, 1.0f};
    kvf_ref_psac_encode(zero, b, bs, lam, D, R, c, &cs);
    assert_int_equal(cs, 0);
    kvf_ref_psac_encode(tiny, b, bs, lam, D, R, c, &cs);
    assert_int_equal(cs, 0);
    kvf_ref_psac_encode(nan_e, b, bs, lam, D, R, c, &cs);
    assert_int_equal(cs, 0);
    assert_int_equal(c[0], 0);
    /* Apply with scale 0 leaves y alone, signed zeros included. */
    float y[D] = {-0.0f, -0.0f, 1, 2, 3, 4, 5, 6}, y0[D];
    memcpy(y0, y, sizeof y);
    int8_t junk[R] = {5, -3};
    kvf_ref_psac_apply(y, b, bs, junk, 0, D, R);
    assert_memory_equal(y, y0, sizeof y);
}

/* ------------------------------------------------------------ RoPE */

static kvf_rope_cfg rope_cfg(int layout, int n_sections, const int *sections, double theta) {
    kvf_rope_cfg r;
    memset(&r, 0, sizeof r);
    r.placement = KVF_ROPE_PRE;
    r.layout = layout;
    r.theta = theta;
    r.n_sections = n_sections;
    for (int a = 0; a < n_sections; a++) r.sections[a] = sections[a];
    return r;
}

static void pair_of(int layout, int d, int p, int *c0, int *c1) {
    if (layout == KVF_ROPE_INTERLEAVED) *c0 = 2 * p, *c1 = 2 * p + 1;
    else *c0 = p, *c1 = p + d / 2;
}

/* f64 RoPE with sections (p_a, d_a = 2 n_a). */
static void rope_f64(const float *x, double *y, int d, int layout, int n_sec, const int *sec, double theta,
                     const int32_t *pos) {
    int first = 0;
    for (int a = 0; a < n_sec; a++) {
        for (int pa = 0; pa < sec[a]; pa++) {
            int c0, c1;
            pair_of(layout, d, first + pa, &c0, &c1);
            double ang = pos[a] * pow(theta, -2.0 * pa / (2.0 * sec[a]));
            y[c0] = x[c0] * cos(ang) - x[c1] * sin(ang);
            y[c1] = x[c0] * sin(ang) + x[c1] * cos(ang);
        }
        first += sec[a];
    }
}

static void random_vec(float *x, int d, uint64_t *st) {
    for (int i = 0; i < d; i++) x[i] = (float)(2.0 * rng_unit(st) - 1.0);
}

static void test_rope_hand(void **state) {
    (void)state;
    float x[4] = {1, 2, 3, 4};
    int32_t pos = 1;
    kvf_rope_cfg r = rope_cfg(KVF_ROPE_HALF, 1, (int[]){2}, 10000.0);
    kvf_ref_rope(x, 4, &r, &pos);
    /* pair 0 (ch 0, 2) turns by 1 rad, pair 1 (ch 1, 3) by 10000^(-1/2) = 0.01. */
    assert_true(fabs(x[0] - (cos(1.0) - 3 * sin(1.0))) < 1e-6);
    assert_true(fabs(x[2] - (sin(1.0) + 3 * cos(1.0))) < 1e-6);
    assert_true(fabs(x[1] - (2 * cos(0.01) - 4 * sin(0.01))) < 1e-6);
    assert_true(fabs(x[3] - (2 * sin(0.01) + 4 * cos(0.01))) < 1e-6);
    float z[4] = {1, 2, 3, 4};
    r.layout = KVF_ROPE_INTERLEAVED; /* pairs (0, 1) and (2, 3) */
    kvf_ref_rope(z, 4, &r, &pos);
    assert_true(fabs(z[0] - (cos(1.0) - 2 * sin(1.0))) < 1e-6);
    assert_true(fabs(z[1] - (sin(1.0) + 2 * cos(1.0))) < 1e-6);
    assert_true(fabs(z[2] - (3 * cos(0.01) - 4 * sin(0.01))) < 1e-6);
    assert_true(fabs(z[3] - (3 * sin(0.01) + 4 * cos(0.01))) < 1e-6);
}

static void test_rope_identity_and_norms(void **state) {
    (void)state;
    enum { D = 64 };
    uint64_t st = 3;
    static const int one[1] = {32}, three[3] = {8, 12, 12};
    for (int layout = 0; layout < 2; layout++)
        for (int ns = 0; ns < 3; ns++) {
            int n_sec = ns == 2 ? 3 : ns; /* 0 (read as 1), 1, 3 */
            kvf_rope_cfg r = rope_cfg(layout, n_sec, n_sec == 3 ? three : one, 10000.0);
            float x[D], y[D];
            random_vec(x, D, &st);
            memcpy(y, x, sizeof x);
            int32_t zero[3] = {0, 0, 0};
            kvf_ref_rope(y, D, &r, zero);
            assert_memory_equal(x, y, sizeof x); /* position 0 is the identity */
            for (int trial = 0; trial < 50; trial++) {
                int32_t pos[3] = {(int32_t)(tu_rng_next(&st) % 20000), (int32_t)(tu_rng_next(&st) % 100),
                                  (int32_t)(tu_rng_next(&st) % 100)};
                random_vec(x, D, &st);
                memcpy(y, x, sizeof x);
                kvf_ref_rope(y, D, &r, pos);
                for (int p = 0; p < D / 2; p++) {
                    int c0, c1;
                    pair_of(layout, D, p, &c0, &c1);
                    double n0 = (double)x[c0] * x[c0] + (double)x[c1] * x[c1];
                    double n1 = (double)y[c0] * y[c0] + (double)y[c1] * y[c1];
                    assert_true(fabs(n1 - n0) <= 1e-6 * n0 + 1e-12);
                }
            }
        }
}

/* One section: the standard 1D RoPE formula in f64, within 1e-5. */
static void test_rope_1d(void **state) {
    (void)state;
    enum { D = 128 };
    uint64_t st = 4;
    int sec = D / 2;
    for (int layout = 0; layout < 2; layout++) {
        kvf_rope_cfg r = rope_cfg(layout, 1, &sec, 10000.0);
        for (int32_t pos = 0; pos <= 40; pos++) {
            float x[D], y[D];
            double want[D];
            random_vec(x, D, &st);
            memcpy(y, x, sizeof x);
            kvf_ref_rope(y, D, &r, &pos);
            for (int p = 0; p < D / 2; p++) { /* written out: theta^(-2p/d) */
                int c0, c1;
                pair_of(layout, D, p, &c0, &c1);
                double ang = pos * pow(10000.0, -2.0 * p / D);
                want[c0] = x[c0] * cos(ang) - x[c1] * sin(ang);
                want[c1] = x[c0] * sin(ang) + x[c1] * cos(ang);
            }
            for (int c = 0; c < D; c++)
                if (fabs(y[c] - want[c]) > 1e-5) fail_msg("layout %d pos %d ch %d: %.9g vs %.9g", layout, pos, c, y[c], want[c]);
        }
    }
}

/* Half and interleaved are the same rotation on permuted channels. */
static void test_rope_half_vs_interleaved(void **state) {
    (void)state;
    enum { D = 64 };
    uint64_t st = 8;
    static const int three[3] = {8, 12, 12};
    for (int ns = 1; ns <= 3; ns += 2) {
        kvf_rope_cfg half = rope_cfg(KVF_ROPE_HALF, ns, ns == 3 ? three : (int[]){32}, 500000.0);
        kvf_rope_cfg inter = half;
        inter.layout = KVF_ROPE_INTERLEAVED;
        for (int trial = 0; trial < 20; trial++) {
            float h[D], in[D];
            random_vec(h, D, &st);
            for (int p = 0; p < D / 2; p++) in[2 * p] = h[p], in[2 * p + 1] = h[p + D / 2];
            int32_t pos[3] = {(int32_t)(tu_rng_next(&st) % 5000), (int32_t)(tu_rng_next(&st) % 64),
                              (int32_t)(tu_rng_next(&st) % 64)};
            kvf_ref_rope(h, D, &half, pos);
            kvf_ref_rope(in, D, &inter, pos);
            for (int p = 0; p < D / 2; p++) {
                assert_memory_equal(&in[2 * p], &h[p], sizeof(float));
                assert_memory_equal(&in[2 * p + 1], &h[p + D / 2], sizeof(float));
            }
        }
    }
}

/* Three sections (t, h, w): each uses its own position and its own d_a. */
static void test_rope_sections(void **state) {
    (void)state;
    enum { D = 16 };
    static const int sec[3] = {2, 3, 3};
    uint64_t st = 12;
    for (int layout = 0; layout < 2; layout++) {
        kvf_rope_cfg r = rope_cfg(layout, 3, sec, 100.0);
        float x[D], y[D];
        double want[D];
        int32_t pos[3] = {7, 3, 11};
        random_vec(x, D, &st);
        memcpy(y, x, sizeof x);
        kvf_ref_rope(y, D, &r, pos);
        rope_f64(x, want, D, layout, 3, sec, 100.0, pos);
        for (int c = 0; c < D; c++) assert_true(fabs(y[c] - want[c]) < 1e-5);
        /* Only axis 0 moves: the pairs of sections 1 and 2 stay put. */
        int32_t pos0[3] = {5, 0, 0};
        memcpy(y, x, sizeof x);
        kvf_ref_rope(y, D, &r, pos0);
        for (int p = 0; p < D / 2; p++) {
            int c0, c1;
            pair_of(layout, D, p, &c0, &c1);
            if (p < 2) assert_true(y[c0] != x[c0] || y[c1] != x[c1]);
            else assert_true(y[c0] == x[c0] && y[c1] == x[c1]);
        }
        /* Section 1 at position 3 equals 1D RoPE of d_a = 6 on its pairs. */
        int32_t pos1[3] = {0, 3, 0};
        memcpy(y, x, sizeof x);
        kvf_ref_rope(y, D, &r, pos1);
        for (int pa = 0; pa < 3; pa++) {
            int c0, c1;
            pair_of(layout, D, 2 + pa, &c0, &c1);
            double ang = 3 * pow(100.0, -2.0 * pa / 6.0);
            assert_true(fabs(y[c0] - (x[c0] * cos(ang) - x[c1] * sin(ang))) < 1e-6);
            assert_true(fabs(y[c1] - (x[c0] * sin(ang) + x[c1] * cos(ang))) < 1e-6);
        }
    }
}

/* ------------------------------------------------------------ public API (CPU) */

static void test_api_cpu(void **state) {
    (void)state;
    enum { D = 64, H = 2, HQ = 4, N = 6 };
    struct kvf_scheme s, other;
    make_scheme(&s, D, 0);
    kvf_context *ctx = NULL;
    int rc = kvf_context_create(&s, KVF_DEVICE_CPU, &ctx);
    if (rc) fail_msg("context: %s", kvf_last_error());
    size_t bytes;
    assert_int_equal(kvf_qstats_size(&s, H, &bytes), KVF_OK);
    void *q = aligned_alloc(256, bytes);
    assert_int_equal(kvf_qstats_init(NULL, q, bytes, H, NULL), KVF_EINVAL);
    assert_int_equal(kvf_qstats_init(ctx, NULL, bytes, H, NULL), KVF_EINVAL);
    assert_int_equal(kvf_qstats_init(ctx, q, bytes - 1, H, NULL), KVF_ERANGE);
    assert_int_equal(kvf_qstats_init(ctx, q, bytes, 0, NULL), KVF_EINVAL);
    assert_int_equal(kvf_qstats_init(ctx, q, bytes, H, NULL), KVF_OK);
    uint16_t x[N * HQ * D];
    uint64_t st = 1;
    for (int i = 0; i < N * HQ * D; i++) x[i] = kvf_f32_to_bf16((float)rng_gauss(&st));
    kvf_shape sh = {N, HQ, 0, 0};
    assert_int_equal(kvf_qstats_update(ctx, q, bytes, NULL, &sh, NULL), KVF_EINVAL);
    assert_int_equal(kvf_qstats_update(ctx, q, bytes, x, NULL, NULL), KVF_EINVAL);
    assert_int_equal(kvf_qstats_update(ctx, q, bytes - 1, x, &sh, NULL), KVF_ERANGE);
    assert_int_equal(kvf_qstats_update(ctx, q, bytes, x, &sh, NULL), KVF_OK);
    kvf_qstats_layout l = layout_of(&s, H);
    assert_true(count_of(q, &l, 0) == N * 2 && count_of(q, &l, 1) == N * 2);
    float w[D];
    assert_int_equal(kvf_ref_qstats_weights(q, 1, D, w), KVF_OK);
    for (int c = 0; c < D; c++) {
        double want = 0;
        for (int qh = 2; qh < 4; qh++)
            for (int t = 0; t < N; t++) want += pow(kvf_bf16_to_f32(x[(qh * N + t) * D + c]), 2);
        assert_true(w[c] == (float)((double)(float)want / (2 * N)));
    }
    /* Three query heads onto two KV heads. */
    sh.n_heads = 3;
    assert_int_equal(kvf_qstats_update(ctx, q, bytes, x, &sh, NULL), KVF_EINVAL);
    /* A buffer of another scheme. */
    make_scheme(&other, D, 4);
    size_t ob;
    void *oq = new_qstats(&other, H, &ob);
    sh.n_heads = HQ;
    assert_int_equal(kvf_qstats_update(ctx, oq, ob, x, &sh, NULL), KVF_EFORMAT);
    assert_non_null(strstr(kvf_last_error(), "psac_rank"));
    /* Never initialised. */
    memset(oq, 0, ob);
    assert_int_equal(kvf_qstats_update(ctx, oq, ob, x, &sh, NULL), KVF_EFORMAT);
    assert_non_null(strstr(kvf_last_error(), "kvf_qstats_init"));
    free(q), free(oq);
    kvf_context_destroy(ctx);
}

/* With a PSAC rank. */
static void test_api_psac(void **state) {
    (void)state;
    /* Eight strong channels (variances 100 .. 9) over a bulk of 1: a clear gap
     * after the 8th eigenvalue, with enough samples that the noise stays below it. */
    enum { D = 64, R = 8, N = 512 };
    struct kvf_scheme s;
    make_scheme(&s, D, R);
    kvf_context *ctx = NULL;
    int rc = kvf_context_create(&s, KVF_DEVICE_CPU, &ctx);
    if (rc) fail_msg("context: %s", kvf_last_error());
    size_t bytes;
    assert_int_equal(kvf_qstats_size(&s, 1, &bytes), KVF_OK);
    void *q = aligned_alloc(256, bytes);
    assert_int_equal(kvf_qstats_init(ctx, q, bytes, 1, NULL), KVF_OK);
    static uint16_t x[N * D];
    uint64_t st = 2;
    for (int i = 0; i < N * D; i++) x[i] = kvf_f32_to_bf16((float)(rng_gauss(&st) * (i % D < 8 ? 10 - i % D : 1)));
    kvf_shape sh = {N, 1, 0, 0};
    assert_int_equal(kvf_qstats_update(ctx, q, bytes, x, &sh, NULL), KVF_OK);
    kvf_qstats_layout l = layout_of(&s, 1);
    check_basis(q, &l, 0, 1e-3);
    free(q);
    kvf_context_destroy(ctx);
}

/* Same inputs, same bytes. */
static void test_determinism(void **state) {
    (void)state;
    enum { D = 64, R = 8, N = 100 };
    struct kvf_scheme s;
    make_scheme(&s, D, R);
    uint16_t x[N * 2 * D];
    uint64_t st = 9;
    for (int i = 0; i < N * 2 * D; i++) x[i] = kvf_f32_to_bf16((float)rng_gauss(&st));
    kvf_shape sh = {N, 2, 0, 0};
    size_t b1, b2;
    void *q1 = new_qstats(&s, 2, &b1), *q2 = new_qstats(&s, 2, &b2);
    for (int k = 0; k < 3; k++) update_ok(&s, q1, b1, x, &sh), update_ok(&s, q2, b2, x, &sh);
    assert_memory_equal(q1, q2, b1);
    free(q1), free(q2);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layout),
        cmocka_unit_test(test_init),
        cmocka_unit_test(test_check),
        cmocka_unit_test(test_update_hand),
        cmocka_unit_test(test_gqa),
        cmocka_unit_test(test_rank_deficient),
        cmocka_unit_test(test_orthogonal_vs_jacobi),
        cmocka_unit_test(test_update_basis),
        cmocka_unit_test(test_warm_start),
        cmocka_unit_test(test_psac_basis_codes),
        cmocka_unit_test(test_psac_dot_bias),
        cmocka_unit_test(test_psac_hand),
        cmocka_unit_test(test_psac_lowers_error),
        cmocka_unit_test(test_psac_delta_exact),
        cmocka_unit_test(test_psac_refuses),
        cmocka_unit_test(test_rope_hand),
        cmocka_unit_test(test_rope_identity_and_norms),
        cmocka_unit_test(test_rope_1d),
        cmocka_unit_test(test_rope_half_vs_interleaved),
        cmocka_unit_test(test_rope_sections),
        cmocka_unit_test(test_api_cpu),
        cmocka_unit_test(test_api_psac),
        cmocka_unit_test(test_determinism),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
