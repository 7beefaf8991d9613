/* The methods of docs/METHODS.md on the CPU reference: k-means, QSAC, KIVI's
 * groups along tokens, the Hadamard rotation, progressive stages, two-level
 * scales, PSAC with query statistics, RoPE at decode, every shipped scheme's
 * round trip and footprint. One head and small spans keep it fast. */
#include "testutil.h"
#include "cpu/ref.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ helpers */

/* Uniform in [-1, 1). */
static double rng_sym(uint64_t *st) { return (double)(tu_rng_next(st) >> 11) * 0x1.0p-52 - 1.0; }

static uint16_t *bf16_alloc(size_t n) {
    uint16_t *p = calloc(n, 2);
    assert_non_null(p);
    return p;
}

/* Mixed precision's channel map as a calibration on this very data would give
 * it: per section and head, the channels of largest energy, numbered in
 * channel order (the test stands in for `kvforge calibrate`). */
static void oracle_map(const kvf_scheme *s, const uint16_t *k, const uint16_t *v, int64_t n, int h, uint8_t *map) {
    int d = s->head_dim;
    for (int sec = 0; sec < 2; sec++) {
        double f = s->pipe.mp_fraction[sec];
        int m = f > 0 ? (int)(f * d / 8 + 0.5) * 8 : 0;
        const uint16_t *x = sec ? v : k;
        for (int hh = 0; hh < h; hh++) {
            double e[512] = {0};
            uint8_t pick[512] = {0};
            for (int64_t t = 0; t < n; t++)
                for (int c = 0; c < d; c++) {
                    double a = kvf_bf16_to_f32(x[((size_t)t * h + hh) * d + c]);
                    e[c] += a * a;
                }
            for (int j = 0; j < m; j++) {
                int best = -1;
                for (int c = 0; c < d; c++)
                    if (!pick[c] && (best < 0 || e[c] > e[best])) best = c;
                pick[best] = 1;
            }
            uint8_t *row = map + ((size_t)sec * h + hh) * d;
            for (int c = 0, slot = 0; c < d; c++) row[c] = pick[c] ? (uint8_t)slot++ : 255;
        }
    }
}

static uint8_t *encode_with(const kvf_scheme *s, const uint16_t *k, const uint16_t *v, int64_t n, int h,
                            const void *qstats, size_t *bytes) {
    kvf_shape sh = {n, h, 0, 0};
    assert_int_equal(kvf_packed_size(s, n, h, bytes), KVF_OK);
    uint8_t *p = malloc(*bytes), *map = malloc((size_t)2 * h * s->head_dim);
    assert_non_null(p);
    assert_non_null(map);
    oracle_map(s, k, v, n, h, map);
    kvf_encode_args ea = {.qstats = qstats};
    if (s->pipe.mp_fraction[0] > 0 || s->pipe.mp_fraction[1] > 0) ea.channel_map = map;
    if (kvf_ref_encode_ex(s, k, v, &sh, &ea, p, *bytes)) fail_msg("%s: encode: %s", s->name, kvf_last_error());
    free(map);
    return p;
}

static void decode_with(const kvf_scheme *s, const uint8_t *p, size_t bytes, int64_t n, int h,
                        const int32_t *pos, uint16_t *ko, uint16_t *vo) {
    kvf_shape sh = {n, h, 0, 0};
    if (kvf_ref_decode(s, p, bytes, &sh, pos, ko, vo)) fail_msg("%s: decode: %s", s->name, kvf_last_error());
}

/* sum (x - y)^2 / sum x^2 over n BF16 values. */
static double rel_mse(const uint16_t *x, const uint16_t *y, size_t n) {
    double e = 0, s = 0;
    for (size_t i = 0; i < n; i++) {
        double a = kvf_bf16_to_f32(x[i]), b = kvf_bf16_to_f32(y[i]);
        e += (a - b) * (a - b);
        s += a * a;
    }
    return e / s;
}

/* Relative MSE of K and V after a round trip of synthetic data. */
static void round_trip_error(const kvf_scheme *s, int64_t n, uint64_t seed, const void *qstats, double *ek,
                             double *ev) {
    int d = s->head_dim;
    size_t nel = (size_t)n * d, bytes;
    uint16_t *k = bf16_alloc(nel), *v = bf16_alloc(nel), *ko = bf16_alloc(nel), *vo = bf16_alloc(nel);
    kvf_synth_kv(k, n, 1, d, seed);
    kvf_synth_kv(v, n, 1, d, seed + 1);
    uint8_t *p = encode_with(s, k, v, n, 1, qstats, &bytes);
    decode_with(s, p, bytes, n, 1, NULL, ko, vo);
    *ek = rel_mse(k, ko, nel);
    *ev = rel_mse(v, vo, nel);
    free(k), free(v), free(ko), free(vo), free(p);
}

/* ------------------------------------------------------------ k-means */

/* Four well separated clusters of 16 tokens each (tokens in blocks, as frames
 * of video come): every token of a cluster gets the same index, the clusters
 * get different ones, and each centroid is within bf16 rounding of the mean. */
static void test_kmeans_separable(void **state) {
    (void)state;
    enum { D = 64, PER = 16, K = 4, N = PER * K };
    float e[N * D], mean[K][D] = {{0}};
    uint64_t st = 1;
    for (int i = 0; i < N; i++)
        for (int c = 0; c < D; c++) {
            int k = i / PER;
            float center = (c % K == k) ? 10.0f * (float)(k + 1) : -2.0f * (float)k;
            e[i * D + c] = center + 0.05f * (float)rng_sym(&st);
            mean[k][c] += e[i * D + c] / PER;
        }
    uint16_t cent[K * D];
    assert_int_equal(kvf_ref_kmeans(e, N, D, K, 3, 0, 0, 0, cent, NULL), KVF_OK);
    int idx[K];
    for (int i = 0; i < N; i++) {
        int z = kvf_ref_nearest(e + i * D, cent, K, D);
        if (i % PER == 0) idx[i / PER] = z;
        assert_int_equal(z, idx[i / PER]);
    }
    for (int a = 0; a < K; a++)
        for (int b = a + 1; b < K; b++) assert_int_not_equal(idx[a], idx[b]);
    double worst = 0;
    for (int k = 0; k < K; k++)
        for (int c = 0; c < D; c++) {
            double err = fabs(kvf_bf16_to_f32(cent[idx[k] * D + c]) - mean[k][c]);
            worst = fmax(worst, err / fmax(1.0, fabs(mean[k][c])));
        }
    print_message("separable clusters: worst centroid error %.3g (relative), bf16 step 2^-8 = %.3g\n", worst,
                  0x1.0p-8);
    assert_true(worst < 0x1.0p-8);
}

/* Same seed, same centroids; another seed (or stage, or head) another start.
 * With 0 iterations the centroids are the strided sample of METHODS.md 3,
 * recomputed here independently. */
static void test_kmeans_seeded(void **state) {
    (void)state;
    enum { D = 128, N = 200, C = 16 };
    uint16_t x[N * D];
    float e[N * D];
    kvf_synth_kv(x, N, 1, D, 3);
    for (int i = 0; i < N * D; i++) e[i] = kvf_bf16_to_f32(x[i]);
    uint16_t a[C * D], b[C * D], c[C * D];
    assert_int_equal(kvf_ref_kmeans(e, N, D, C, 2, 7, 0, 0, a, NULL), KVF_OK);
    assert_int_equal(kvf_ref_kmeans(e, N, D, C, 2, 7, 0, 0, b, NULL), KVF_OK);
    assert_memory_equal(a, b, sizeof a);
    assert_int_equal(kvf_ref_kmeans(e, N, D, C, 2, 8, 0, 0, c, NULL), KVF_OK);
    assert_memory_not_equal(a, c, sizeof a);
    assert_int_equal(kvf_ref_kmeans(e, N, D, C, 2, 7, 1, 0, c, NULL), KVF_OK);
    assert_memory_not_equal(a, c, sizeof a);
    assert_int_equal(kvf_ref_kmeans(e, N, D, C, 2, 7, 0, 1, c, NULL), KVF_OK);
    assert_memory_not_equal(a, c, sizeof a);
    /* The initialisation: token (o + floor(j N / C)) % N, o = splitmix64(seed ^ stage<<32 ^ head<<40) % N. */
    int64_t seed = 12345;
    int stage = 2, head = 3;
    assert_int_equal(kvf_ref_kmeans(e, N, D, C, 0, seed, stage, head, a, NULL), KVF_OK);
    uint64_t o = tu_splitmix((uint64_t)seed ^ ((uint64_t)stage << 32) ^ ((uint64_t)head << 40)) % N;
    for (int j = 0; j < C; j++) {
        uint64_t t = (o + (uint64_t)j * N / C) % N;
        assert_memory_equal(a + j * D, x + t * D, D * 2);
    }
    /* More centroids than tokens: C = n, every token is its own centroid. */
    uint16_t *big = bf16_alloc(256 * D);
    assert_int_equal(kvf_ref_kmeans(e, 5, D, 256, 0, 0, 0, 0, big, NULL), KVF_OK);
    for (int i = 0; i < 5; i++) assert_memory_equal(big + kvf_ref_nearest(e + i * D, big, 5, D) * D, x + i * D, D * 2);
    free(big);
    /* Lloyd iterations lower the k-means objective. */
    double obj[3];
    for (int it = 0; it < 3; it++) {
        assert_int_equal(kvf_ref_kmeans(e, N, D, C, it * 2, 1, 0, 0, a, NULL), KVF_OK);
        obj[it] = 0;
        for (int i = 0; i < N; i++) {
            const uint16_t *mu = a + kvf_ref_nearest(e + i * D, a, C, D) * D;
            for (int k = 0; k < D; k++) obj[it] += pow(e[i * D + k] - kvf_bf16_to_f32(mu[k]), 2);
        }
    }
    print_message("k-means objective after 0, 2, 4 iterations: %.1f %.1f %.1f\n", obj[0], obj[1], obj[2]);
    assert_true(obj[1] < obj[0] && obj[2] <= obj[1]);
}

/* kmeans_labels (METHODS.md 3). kvf_ref_kmeans's last_z is the last Lloyd
 * step's assignment: the nearest of the centroids one step earlier, and each
 * final centroid is the bf16 mean (2^-20 fixed point) of its cluster under it
 * (an empty cluster keeps its centroid). An encode with "last_step" stores
 * those labels beside the final centroids; with "final", the nearest of the
 * final centroids, which differ from them for some tokens of this data (else
 * the option would change nothing here). */
static void test_kmeans_labels(void **state) {
    (void)state;
    enum { D = 128, N = 600, C = 32 };
    uint16_t *k = bf16_alloc(N * D), *v = bf16_alloc(N * D), c1[C * D], c2[C * D];
    float *e = malloc(sizeof(float) * N * D);
    int *z = malloc(sizeof(int) * N);
    assert_non_null(e), assert_non_null(z);
    kvf_synth_kv(k, N, 1, D, 21);
    kvf_synth_kv(v, N, 1, D, 22);
    for (int i = 0; i < N * D; i++) e[i] = kvf_bf16_to_f32(k[i]);
    assert_int_equal(kvf_ref_kmeans(e, N, D, C, 1, 0, 0, 0, c1, NULL), KVF_OK);
    assert_int_equal(kvf_ref_kmeans(e, N, D, C, 2, 0, 0, 0, c2, z), KVF_OK);
    int moved = 0;
    for (int i = 0; i < N; i++) {
        assert_int_equal(z[i], kvf_ref_nearest(e + i * D, c1, C, D));
        moved += z[i] != kvf_ref_nearest(e + i * D, c2, C, D);
    }
    for (int j = 0; j < C; j++) {
        int64_t n = 0, acc[D] = {0};
        for (int i = 0; i < N; i++)
            if (z[i] == j) {
                n++;
                for (int c = 0; c < D; c++) acc[c] += llrint((double)e[i * D + c] * 0x1.0p20);
            }
        for (int c = 0; c < D; c++)
            assert_int_equal(c2[j * D + c], n ? kvf_f32_to_bf16((float)((double)acc[c] / 0x1.0p20 / (double)n))
                                              : c1[j * D + c]);
    }
    print_message("kmeans_labels: %d of %d tokens have another nearest final centroid than their last label\n",
                  moved, N);
    assert_true(moved > 0);
    const char *texts[2] = {
        "return { base = 'qvg_int2', name = 'ls', key = { centroids = 32, kmeans_labels = 'last_step' } }",
        "return { base = 'qvg_int2', name = 'fin', key = { centroids = 32, kmeans_labels = 'final' } }"};
    for (int f = 0; f < 2; f++) {
        kvf_scheme *s = tu_scheme_text(texts[f]);
        kvf_layout L;
        size_t bytes;
        assert_int_equal(kvf_layout_compute(s, N, 1, &L), KVF_OK);
        uint8_t *p = encode_with(s, k, v, N, 1, NULL, &bytes);
        const kvf_stage_layout *st = &L.key.stage[0];
        for (int j = 0; j < C * D; j++) assert_int_equal(kvf_get_u16(p + st->centroids_off + 2 * (size_t)j), c2[j]);
        for (int i = 0; i < N; i++)
            assert_int_equal(p[st->index_off + i], f ? kvf_ref_nearest(e + i * D, c2, C, D) : z[i]);
        free(p);
        kvf_scheme_free(s);
    }
    free(k), free(v), free(e), free(z);
}

/* ------------------------------------------------------------ QSAC */

static void fill_bf16(uint16_t *mu, int d, float v) {
    for (int c = 0; c < d; c++) mu[c] = kvf_f32_to_bf16(v);
}

static void test_qsac_choice(void **state) {
    (void)state;
    enum { D = 128, G = 64 };
    float x[D] = {0}, w[D];
    uint16_t cent[3 * D];
    for (int c = 0; c < D; c++) w[c] = 1.0f;
    /* A: one channel off by 1 -> distance 1, residual range 1 in group 0: S = 64 * 1.
     * B: 0.25 everywhere -> distance 8, residual constant: S = 0.
     * C: far away (distance 128 * 4) and constant. */
    fill_bf16(cent, D, 0.0f);
    cent[3] = kvf_f32_to_bf16(1.0f);
    fill_bf16(cent + D, D, 0.25f);
    fill_bf16(cent + 2 * D, D, 2.0f);
    assert_int_equal(kvf_ref_nearest(x, cent, 3, D), 0);
    assert_int_equal(kvf_ref_qsac(x, cent, 3, D, w, 1, G), 0); /* M = 1: the nearest */
    assert_int_equal(kvf_ref_qsac(x, cent, 3, D, w, 2, G), 1); /* B's residual quantizes exactly */
    /* M = 3: B and C both score 0; B comes first in (d_Q, j) order and is kept. */
    assert_int_equal(kvf_ref_qsac(x, cent, 3, D, w, 3, G), 1);
    /* A's range in group 1 instead: the same. Scaling A's range below B's score flips it back:
     * A with channel 3 off by 2^-8 scores 64 * 2^-16, B scores 0: B still. */
    cent[3] = kvf_f32_to_bf16(0x1.0p-8f);
    assert_int_equal(kvf_ref_qsac(x, cent, 3, D, w, 2, G), 1);

    /* Weights move the candidates: A off by 1 on channel 64, B off by 0.5 on channel 1.
     * Unweighted B is nearer (0.25 < 1); with w_1 = 100, d_Q(B) = 25 > d_Q(A) = 1. */
    fill_bf16(cent, D, 0.0f);
    fill_bf16(cent + D, D, 0.0f);
    cent[64] = kvf_f32_to_bf16(1.0f);
    cent[D + 1] = kvf_f32_to_bf16(0.5f);
    assert_int_equal(kvf_ref_nearest(x, cent, 2, D), 1);
    assert_int_equal(kvf_ref_qsac(x, cent, 2, D, w, 1, G), 1);
    w[1] = 100.0f;
    assert_int_equal(kvf_ref_qsac(x, cent, 2, D, w, 1, G), 0);
    /* Score with weights: S_A = (sum of w in group 1) * 1^2 = 64, S_B = (63 + 100) * 0.25 = 40.75:
     * among both candidates B wins on the score although A is nearer by d_Q. */
    assert_int_equal(kvf_ref_qsac(x, cent, 2, D, w, 2, G), 1);
    w[1] = 1000.0f; /* S_B = 1063 * 0.25 = 265.75 > 64: A */
    assert_int_equal(kvf_ref_qsac(x, cent, 2, D, w, 2, G), 0);

    /* w = 1, M = 1 is the nearest centroid on ordinary data. */
    enum { N = 300, C = 32 };
    uint16_t *data = bf16_alloc(N * D), cc[C * D];
    float *e = malloc(sizeof(float) * N * D);
    kvf_synth_kv(data, N, 1, D, 9);
    for (int i = 0; i < N * D; i++) e[i] = kvf_bf16_to_f32(data[i]);
    for (int c = 0; c < D; c++) w[c] = 1.0f;
    assert_int_equal(kvf_ref_kmeans(e, N, D, C, 1, 0, 0, 0, cc, NULL), KVF_OK);
    for (int i = 0; i < N; i++)
        assert_int_equal(kvf_ref_qsac(e + i * D, cc, C, D, w, 1, G), kvf_ref_nearest(e + i * D, cc, C, D));
    free(data), free(e);
}

/* ------------------------------------------------------------ KIVI */

static void test_kivi_token_groups(void **state) {
    (void)state;
    enum { D = 128, N = 70 }; /* groups of 32 tokens: 32, 32, 6 */
    kvf_scheme *kivi = tu_scheme("kivi_int2");
    kvf_scheme *rtn = tu_scheme_text("return { base = 'rtn_int2', name = 'r32', key = { group_size = 32 } }");
    kvf_layout L;
    assert_int_equal(kvf_layout_compute(kivi, N, 1, &L), KVF_OK);
    assert_int_equal(L.key.axis, KVF_AXIS_TOKEN);
    assert_int_equal(L.key.groups_along_tokens, 3);
    assert_int_equal(L.key.stage[0].scales_bytes, 3 * D * 2); /* [H][ceil(N/G)][d] fp16 */
    assert_int_equal(L.key.stage[0].zeros_bytes, 3 * D * 2);
    assert_int_equal(L.value.stage[0].scales_bytes, N * (D / 32) * 2);

    /* Each channel sits at its own offset (+-50) with a small spread along the
     * tokens; channel 5 is constant. */
    uint16_t *k = bf16_alloc(N * D), *v = bf16_alloc(N * D), *ko = bf16_alloc(N * D), *vo = bf16_alloc(N * D);
    uint64_t st = 5;
    double off[D];
    for (int c = 0; c < D; c++) off[c] = 50.0 * rng_sym(&st);
    for (int t = 0; t < N; t++)
        for (int c = 0; c < D; c++)
            k[t * D + c] = kvf_f32_to_bf16(c == 5 ? 100.0f : (float)(off[c] + 0.5 * rng_sym(&st)));
    kvf_synth_kv(v, N, 1, D, 6);
    size_t bytes;
    uint8_t *p = encode_with(kivi, k, v, N, 1, NULL, &bytes);
    decode_with(kivi, p, bytes, N, 1, NULL, ko, vo);
    /* The constant channel costs nothing: scale 0, zero 100, decoded exactly. */
    for (int g = 0; g < 3; g++) {
        assert_int_equal(kvf_get_u16(p + L.key.stage[0].scales_off + (g * D + 5) * 2), 0);
        assert_int_equal(kvf_get_u16(p + L.key.stage[0].zeros_off + (g * D + 5) * 2), 0x5640);
    }
    for (int t = 0; t < N; t++) assert_int_equal(ko[t * D + 5], k[t * D + 5]);
    /* Every key within half a step of its (group, channel) scale, partial last group included. */
    for (int t = 0; t < N; t++)
        for (int c = 0; c < D; c++) {
            double S = kvf_f16_to_f32(kvf_get_u16(p + L.key.stage[0].scales_off + ((t / 32) * D + c) * 2));
            double M = kvf_f16_to_f32(kvf_get_u16(p + L.key.stage[0].zeros_off + ((t / 32) * D + c) * 2));
            double mn = INFINITY, mx = -INFINITY;
            for (int u = t / 32 * 32; u < (t / 32 + 1) * 32 && u < N; u++) {
                mn = fmin(mn, kvf_bf16_to_f32(k[u * D + c]));
                mx = fmax(mx, kvf_bf16_to_f32(k[u * D + c]));
            }
            double x = kvf_bf16_to_f32(k[t * D + c]), err = fabs(x - kvf_bf16_to_f32(ko[t * D + c]));
            double bound = S / 2 + fabs(M - mn) + 3 * fabs(S - (mx - mn) / 3) + 0x1.0p-8 * fabs(x) + 1e-6;
            if (err > bound) fail_msg("token %d channel %d: error %g > %g", t, c, err, bound);
        }
    /* Per-token groups of the same size cannot follow the channel offsets. */
    uint8_t *q = encode_with(rtn, k, v, N, 1, NULL, &bytes);
    uint16_t *kr = bf16_alloc(N * D);
    decode_with(rtn, q, bytes, N, 1, NULL, kr, vo);
    double e_kivi = rel_mse(k, ko, N * D), e_rtn = rel_mse(k, kr, N * D);
    print_message("keys with per-channel offsets: relative MSE KIVI %.3g, per-token RTN %.3g\n", e_kivi, e_rtn);
    assert_true(e_kivi < e_rtn / 100);
    free(k), free(v), free(ko), free(vo), free(kr), free(p), free(q);
    kvf_scheme_free(kivi);
    kvf_scheme_free(rtn);
}

/* ------------------------------------------------------------ Hadamard */

static void test_hadamard(void **state) {
    (void)state;
    static const int dims[3] = {64, 128, 256};
    for (int i = 0; i < 3; i++) {
        int d = dims[i];
        float x[256], y[256], h[256][256];
        uint64_t st = (uint64_t)d;
        for (int c = 0; c < d; c++) x[c] = y[c] = (float)rng_sym(&st);
        kvf_ref_hadamard(y, d);
        kvf_ref_hadamard(y, d);
        for (int c = 0; c < d; c++) assert_true(fabs(y[c] - x[c]) <= 1e-6);
        /* Columns of the normalized matrix: orthonormal, entries +-1/sqrt(d). */
        for (int a = 0; a < d; a++) {
            for (int c = 0; c < d; c++) h[a][c] = c == a ? 1.0f : 0.0f;
            kvf_ref_hadamard(h[a], d);
            for (int c = 0; c < d; c++) assert_true(fabs(fabs(h[a][c]) - 1.0 / sqrt(d)) < 1e-7);
        }
        for (int a = 0; a < d; a++)
            for (int b = a; b < d; b++) {
                double dot = 0;
                for (int c = 0; c < d; c++) dot += (double)h[a][c] * h[b][c];
                assert_true(fabs(dot - (a == b)) < 1e-6);
            }
    }
    float one[128] = {1.0f};
    kvf_ref_hadamard(one, 128);
    assert_true(one[77] == 0.088388347648f);
}

/* ------------------------------------------------------------ progressive stages */

static void test_stages_monotonic(void **state) {
    (void)state;
    double prev = INFINITY;
    for (int st = 1; st <= 4; st++) {
        char text[256];
        snprintf(text, sizeof text,
                 "return { base = 'qvg_int2', name = 's%d', key = { centroids = 16, stages = %d },"
                 " value = { centroids = 16, stages = %d } }", st, st, st);
        kvf_scheme *s = tu_scheme_text(text);
        double ek, ev;
        round_trip_error(s, 256, 40, NULL, &ek, &ev);
        print_message("stages %d: relative MSE K %.4g V %.4g\n", st, ek, ev);
        assert_true(ek < prev);
        prev = ek;
        kvf_layout L;
        assert_int_equal(kvf_layout_compute(s, 256, 1, &L), KVF_OK);
        for (int i = 0; i < KVF_MAX_STAGES; i++) assert_int_equal(L.key.stage[i].index_bytes > 0, i < st);
        kvf_scheme_free(s);
    }
}

/* ------------------------------------------------------------ two-level scales */

/* Residual-like groups (they straddle 0) of widely different ranges: every
 * value within S_g/2 (plus what S_g < s_g may cost and f32 rounding). */
static void check_int8_fp16(int bits, const char *mode) {
    enum { D = 128, N = 60, G = 32 };
    char text[256];
    snprintf(text, sizeof text,
             "return { name = 'i8', key = { bits = %d, group_size = %d, mode = '%s', scale_format = 'int8_fp16' },"
             " value = { bits = %d, group_size = %d, mode = '%s', scale_format = 'int8_fp16' } }",
             bits, G, mode, bits, G, mode);
    kvf_scheme *s = tu_scheme_text(text);
    uint16_t *k = bf16_alloc(N * D), *ko = bf16_alloc(N * D), *vo = bf16_alloc(N * D);
    uint64_t st = (uint64_t)bits;
    for (int t = 0; t < N; t++)
        for (int g = 0; g < D / G; g++) {
            double amp = pow(10.0, 2.0 * rng_sym(&st)), shift = 0.4 * amp * rng_sym(&st);
            for (int c = g * G; c < (g + 1) * G; c++)
                k[t * D + c] = kvf_f32_to_bf16((float)(shift + amp * rng_sym(&st)));
        }
    size_t bytes;
    uint8_t *p = encode_with(s, k, k, N, 1, NULL, &bytes);
    decode_with(s, p, bytes, N, 1, NULL, ko, vo);
    assert_memory_equal(ko, vo, N * D * 2);
    kvf_layout L;
    assert_int_equal(kvf_layout_compute(s, N, 1, &L), KVF_OK);
    const kvf_stage_layout *sl = &L.key.stage[0];
    assert_int_equal(sl->scales_bytes, N * (D / G));
    assert_int_equal(sl->tscales_bytes, N * 2);
    assert_int_equal(sl->zeros_bytes, strcmp(mode, "affine") ? 0 : N * (D / G));
    int levels = (1 << bits) - 1, qmax = (1 << (bits - 1)) - 1;
    double worst = 0;
    for (int t = 0; t < N; t++) {
        float Tf = kvf_f16_to_f32(kvf_get_u16(p + sl->tscales_off + t * 2));
        for (int g = 0; g < D / G; g++) {
            unsigned u = p[sl->scales_off + t * (D / G) + g];
            assert_true(u >= 1 && u <= 127);
            double S = (double)(Tf * (float)u), mn = INFINITY, mx = -INFINITY, a = 0;
            for (int c = g * G; c < (g + 1) * G; c++) {
                double x = kvf_bf16_to_f32(k[t * D + c]);
                mn = fmin(mn, x), mx = fmax(mx, x), a = fmax(a, fabs(x));
            }
            double sg = strcmp(mode, "affine") ? a / qmax : (mx - mn) / levels;
            int steps = strcmp(mode, "affine") ? qmax : levels;
            assert_true(S >= sg * (1 - 0x1.0p-9)); /* S_g >= s_g up to the rounding of T */
            for (int c = g * G; c < (g + 1) * G; c++) {
                double x = kvf_bf16_to_f32(k[t * D + c]), y = kvf_bf16_to_f32(ko[t * D + c]);
                double bound = S / 2 + steps * fmax(0.0, sg - S) + 0x1.0p-20 * (fabs(x) + steps * S) +
                               0x1.0p-8 * fabs(y);
                if (fabs(x - y) > bound)
                    fail_msg("%s INT%d token %d channel %d: x %g x_hat %g error %g > %g (S %g)", mode, bits, t, c,
                             x, y, fabs(x - y), bound, S);
                worst = fmax(worst, fabs(x - y) / (S / 2 + 1e-30));
            }
        }
    }
    print_message("int8_fp16 %s INT%d: worst error %.3f half-steps\n", mode, bits, worst);
    free(k), free(ko), free(vo), free(p);
    kvf_scheme_free(s);
}

static void test_int8_fp16_scales(void **state) {
    (void)state;
    /* Affine INT8 is left out: its zero codes span 0..255 for a group around 0,
     * beyond the int8 zero code of METHODS.md 2 (documented there). */
    for (int b = 2; b <= 8; b *= 2) {
        if (b < 8) check_int8_fp16(b, "affine");
        check_int8_fp16(b, "symmetric");
    }
}

/* ------------------------------------------------------------ query statistics */

/* A statistics buffer written by hand (METHODS.md 4): count 1, M = diag(m),
 * basis = the first r unit vectors with lambda = their m. */
static void *make_qstats(const kvf_scheme *s, int32_t heads, const float *m, int r, size_t *bytes) {
    kvf_qstats_layout l;
    assert_int_equal(kvf_qstats_layout_compute(s, heads, &l), KVF_OK);
    assert_int_equal(kvf_qstats_size(s, heads, bytes), KVF_OK);
    assert_int_equal(*bytes, l.total_bytes);
    uint8_t *q = calloc(1, l.total_bytes);
    assert_non_null(q);
    int d = s->head_dim;
    uint32_t hd[5] = {KVF_QSTATS_MAGIC, KVF_QSTATS_VERSION, (uint32_t)heads, (uint32_t)d, (uint32_t)r};
    memcpy(q, hd, sizeof hd);
    for (int h = 0; h < heads; h++) {
        ((double *)(q + l.count_off))[h] = 1.0;
        float *ms = (float *)(q + l.msum_off) + (size_t)h * d * d;
        float *u = (float *)(q + l.u_off) + (size_t)h * d * r;
        float *lam = (float *)(q + l.lambda_off) + (size_t)h * r;
        for (int c = 0; c < d; c++) ms[c * d + c] = m[c];
        for (int j = 0; j < r; j++) {
            u[j * r + j] = 1.0f;
            lam[j] = m[j];
        }
    }
    return q;
}

static void test_qstats_layout(void **state) {
    (void)state;
    kvf_scheme *s = tu_scheme("quantwm_int2");
    kvf_qstats_layout l;
    assert_int_equal(kvf_qstats_layout_compute(s, 8, &l), KVF_OK);
    assert_int_equal(l.rank, 8);
    assert_int_equal(l.count_off, 256);
    assert_int_equal(l.msum_off, 512);
    assert_int_equal(l.u_off, 512 + 8 * 128 * 128 * 4);
    assert_int_equal(l.lambda_off, l.u_off + 8 * 128 * 8 * 4);
    assert_int_equal(l.total_bytes, l.lambda_off + 256);
    float m[128];
    for (int c = 0; c < 128; c++) m[c] = 1.0f;
    size_t bytes;
    uint8_t *q = make_qstats(s, 8, m, 8, &bytes);
    assert_int_equal(kvf_qstats_check(s, q, bytes, 8), KVF_OK);
    assert_int_equal(kvf_qstats_check(s, q, bytes, 0), KVF_OK);
    assert_int_equal(kvf_qstats_check(s, q, bytes - 1, 8), KVF_ERANGE);
    assert_int_equal(kvf_qstats_check(s, q, 63, 8), KVF_ERANGE);
    assert_int_equal(kvf_qstats_check(s, q, bytes, 4), KVF_EFORMAT);
    assert_non_null(strstr(kvf_last_error(), "n_heads"));
    kvf_scheme *qvg = tu_scheme("qvg_int2"); /* psac_rank 0: another rank */
    assert_int_equal(kvf_qstats_check(qvg, q, bytes, 8), KVF_EFORMAT);
    assert_non_null(strstr(kvf_last_error(), "rank"));
    static const size_t offs[4] = {0, 4, 12, 20};
    static const char *const what[4] = {"magic", "version", "head_dim", "reserved"};
    for (int i = 0; i < 4; i++) {
        q[offs[i]] ^= 1;
        assert_int_equal(kvf_qstats_check(s, q, bytes, 8), KVF_EFORMAT);
        if (!strstr(kvf_last_error(), what[i])) fail_msg("%s: %s", what[i], kvf_last_error());
        q[offs[i]] ^= 1;
    }
    /* Encode checks what it is given. */
    uint16_t x[4 * 128] = {0};
    kvf_shape sh = {4, 1, 0, 0};
    size_t pb;
    assert_int_equal(kvf_packed_size(s, 4, 1, &pb), KVF_OK);
    uint8_t *p = malloc(pb);
    assert_int_equal(kvf_ref_encode(s, x, x, &sh, q, p, pb), KVF_EFORMAT); /* 8 heads, not 1 */
    assert_non_null(strstr(kvf_last_error(), "n_heads"));
    free(p);
    kvf_scheme *rtn = tu_scheme("rtn_int2");
    size_t rb;
    assert_int_equal(kvf_qstats_size(rtn, 1, &rb), KVF_OK);
    assert_int_equal(rb, 256 + 256 + 128 * 128 * 4); /* no basis at rank 0 */
    free(q);
    kvf_scheme_free(s);
    kvf_scheme_free(qvg);
    kvf_scheme_free(rtn);
}

/* ------------------------------------------------------------ PSAC, QSAC with statistics */

/* e^T M e over all tokens, M = diag(m). */
static double weighted_error(const uint16_t *k, const uint16_t *ko, int n, int d, const float *m) {
    double acc = 0;
    for (int i = 0; i < n * d; i++) {
        double e = kvf_bf16_to_f32(k[i]) - kvf_bf16_to_f32(ko[i]);
        acc += m[i % d] * e * e;
    }
    return acc;
}

static void test_quantwm_with_stats(void **state) {
    (void)state;
    enum { D = 128, N = 300, R = 8 };
    kvf_scheme *s = tu_scheme_text("return { base = 'quantwm_int2', name = 'qw', key = { centroids = 32 },"
                                   " value = { centroids = 32 } }");
    float m[D];
    for (int c = 0; c < D; c++) m[c] = c < R ? 50.0f - 5.0f * (float)c : 0.1f; /* queries live in 8 channels */
    size_t qb, bytes;
    void *q = make_qstats(s, 1, m, R, &qb);
    uint16_t *k = bf16_alloc(N * D), *v = bf16_alloc(N * D), *k0 = bf16_alloc(N * D), *k1 = bf16_alloc(N * D),
             *vo = bf16_alloc(N * D);
    kvf_synth_kv(k, N, 1, D, 21);
    kvf_synth_kv(v, N, 1, D, 22);
    uint8_t *cold = encode_with(s, k, v, N, 1, NULL, &bytes);
    uint8_t *warm = encode_with(s, k, v, N, 1, q, &bytes);
    decode_with(s, cold, bytes, N, 1, NULL, k0, vo);
    decode_with(s, warm, bytes, N, 1, NULL, k1, vo);
    kvf_layout L;
    assert_int_equal(kvf_layout_compute(s, N, 1, &L), KVF_OK);
    /* Cold start: basis, its scale, coefficients and scales all zero. Warm:
     * U = the first R unit vectors, stored as codes 127 with scale 1/127. */
    for (size_t i = 0; i < L.key.basis_bytes; i++) assert_int_equal(cold[L.key.basis_off + i], 0);
    for (size_t i = 0; i < L.key.bscale_bytes; i++) assert_int_equal(cold[L.key.bscale_off + i], 0);
    for (size_t i = 0; i < L.key.cscale_bytes; i++) assert_int_equal(cold[L.key.cscale_off + i], 0);
    assert_int_equal(L.key.basis_bytes, D * R);
    assert_int_equal(L.key.bscale_bytes, 4);
    for (int c = 0; c < D; c++)
        for (int j = 0; j < R; j++) assert_int_equal((int8_t)warm[L.key.basis_off + c * R + j], c == j ? 127 : 0);
    assert_true(kvf_get_f32(warm + L.key.bscale_off) == 1.0f / 127.0f);
    int kept = 0;
    for (int t = 0; t < N; t++) kept += kvf_get_u16(warm + L.key.cscale_off + t * 2) != 0;
    double e0 = weighted_error(k, k0, N, D, m), e1 = weighted_error(k, k1, N, D, m);
    print_message("QuantWM keys, query-weighted error e^T M e: cold start %.4g, with statistics %.4g "
                  "(PSAC kept on %d of %d tokens); plain MSE %.4g -> %.4g\n",
                  e0, e1, kept, N, rel_mse(k, k0, N * D), rel_mse(k, k1, N * D));
    assert_true(kept > 0);
    assert_true(e1 < 0.5 * e0);
    /* Values read no statistics: identical with and without. */
    assert_memory_equal(cold + L.value.stage[0].codes_off, warm + L.value.stage[0].codes_off,
                        L.total_bytes - L.value.stage[0].codes_off);
    free(q), free(k), free(v), free(k0), free(k1), free(vo), free(cold), free(warm);
    kvf_scheme_free(s);
}

/* ------------------------------------------------------------ RoPE at decode */

static void test_rope_pre(void **state) {
    (void)state;
    enum { D = 128, N = 40 };
    kvf_scheme *pre = tu_scheme_text("return { base = 'rtn_int2', name = 'p', rope = { placement = 'pre' } }");
    kvf_scheme *none = tu_scheme_text("return { base = 'rtn_int2', name = 'p' }");
    uint16_t *k = bf16_alloc(N * D), *v = bf16_alloc(N * D), *k1 = bf16_alloc(N * D), *v1 = bf16_alloc(N * D),
             *k2 = bf16_alloc(N * D), *v2 = bf16_alloc(N * D);
    kvf_synth_kv(k, N, 1, D, 31);
    kvf_synth_kv(v, N, 1, D, 32);
    size_t bytes;
    uint8_t *p = encode_with(pre, k, v, N, 1, NULL, &bytes), *q = encode_with(none, k, v, N, 1, NULL, &bytes);
    kvf_shape sh = {N, 1, 0, 0};
    assert_int_equal(kvf_ref_decode(pre, p, bytes, &sh, NULL, k1, v1), KVF_EINVAL);
    assert_non_null(strstr(kvf_last_error(), "positions"));
    /* Position 0 rotates by nothing: the same values as without RoPE. */
    int32_t pos[N] = {0};
    decode_with(pre, p, bytes, N, 1, pos, k1, v1);
    decode_with(none, q, bytes, N, 1, NULL, k2, v2);
    assert_memory_equal(k1, k2, N * D * 2);
    assert_memory_equal(v1, v2, N * D * 2);
    /* Other positions rotate the keys (norm kept), never the values. */
    for (int t = 0; t < N; t++) pos[t] = 3 * t + 1;
    decode_with(pre, p, bytes, N, 1, pos, k1, v1);
    assert_memory_equal(v1, v2, N * D * 2);
    assert_memory_not_equal(k1, k2, N * D * 2);
    for (int t = 0; t < N; t++) {
        double n1 = 0, n2 = 0;
        for (int c = 0; c < D; c++) {
            n1 += pow(kvf_bf16_to_f32(k1[t * D + c]), 2);
            n2 += pow(kvf_bf16_to_f32(k2[t * D + c]), 2);
        }
        assert_true(fabs(sqrt(n1) - sqrt(n2)) < 0.02 * sqrt(n2));
    }
    /* BF16 keys cached before RoPE: position 0 gives the stored bits back, others rotate. */
    kvf_scheme *b16 = tu_scheme_text("return { name = 'b', key = { bits = 16 }, rope = { placement = 'pre' } }");
    uint8_t *r = encode_with(b16, k, v, N, 1, NULL, &bytes);
    memset(pos, 0, sizeof pos);
    decode_with(b16, r, bytes, N, 1, pos, k1, v1);
    assert_memory_equal(k1, k, N * D * 2);
    pos[1] = 5;
    decode_with(b16, r, bytes, N, 1, pos, k1, v1);
    assert_memory_equal(k1, k, D * 2);
    assert_memory_not_equal(k1 + D, k + D, D * 2);
    free(r);
    kvf_scheme_free(b16);
    free(k), free(v), free(k1), free(v1), free(k2), free(v2), free(p), free(q);
    kvf_scheme_free(pre);
    kvf_scheme_free(none);
}

/* Several heads and token-major strides give the same bytes as head-major
 * input, for every kind of plane (centroids, PSAC, groups along tokens,
 * rotation, two-level scales). */
static void test_heads_and_strides(void **state) {
    (void)state;
    enum { D = 128, N = 50, H = 3 };
    static const char *const texts[] = {
        "return { base = 'quantwm_int2', name = 'a', key = { centroids = 8, stages = 2 }, value = { centroids = 8 } }",
        "return { base = 'kivi_int2', name = 'b', key = { mode = 'symmetric', group_size = 16 } }",
        "return { base = 'quarot_int2', name = 'c', value = { bits = 16 }, rope = { placement = 'pre', sections = { 16, 24, 24 } } }",
    };
    float m[D];
    for (int c = 0; c < D; c++) m[c] = 1.0f + (float)(c % 7);
    uint16_t *k = bf16_alloc(N * H * D), *v = bf16_alloc(N * H * D), *kt = bf16_alloc(N * H * D),
             *vt = bf16_alloc(N * H * D), *ko = bf16_alloc(N * H * D), *vo = bf16_alloc(N * H * D),
             *kto = bf16_alloc(N * H * D), *vto = bf16_alloc(N * H * D);
    kvf_synth_kv(k, N, H, D, 70);
    kvf_synth_kv(v, N, H, D, 71);
    for (int h = 0; h < H; h++)
        for (int t = 0; t < N; t++) {
            memcpy(kt + (t * H + h) * D, k + (h * N + t) * D, D * 2);
            memcpy(vt + (t * H + h) * D, v + (h * N + t) * D, D * 2);
        }
    int32_t pos[N * 3];
    for (int i = 0; i < N * 3; i++) pos[i] = i % 17;
    for (int i = 0; i < 3; i++) {
        kvf_scheme *s = tu_scheme_text(texts[i]);
        size_t qb, bytes;
        void *q = make_qstats(s, H, m, s->key.psac_rank, &qb);
        uint8_t *a = encode_with(s, k, v, N, H, q, &bytes);
        uint8_t *b = malloc(bytes);
        kvf_shape tm = {N, H, H * D, D};
        assert_int_equal(kvf_ref_encode(s, kt, vt, &tm, q, b, bytes), KVF_OK);
        assert_memory_equal(a, b, bytes);
        decode_with(s, a, bytes, N, H, pos, ko, vo);
        assert_int_equal(kvf_ref_decode(s, b, bytes, &tm, pos, kto, vto), KVF_OK);
        for (int h = 0; h < H; h++)
            for (int t = 0; t < N; t++) {
                assert_memory_equal(kto + (t * H + h) * D, ko + (h * N + t) * D, D * 2);
                assert_memory_equal(vto + (t * H + h) * D, vo + (h * N + t) * D, D * 2);
            }
        double ek = rel_mse(k, ko, N * H * D), ev = rel_mse(v, vo, N * H * D);
        print_message("%s, %d heads: relative MSE K %.3g V %.3g%s\n", s->name, H, ek, ev,
                      i == 2 ? " (K after RoPE: not comparable)" : "");
        if (i < 2) assert_true(ek < 1.0 && ev < 1.0);
        if (i == 2) assert_memory_equal(vo, v, N * H * D * 2); /* bits 16: kept as they are */
        free(q), free(a), free(b);
        kvf_scheme_free(s);
    }
    free(k), free(v), free(kt), free(vt), free(ko), free(vo), free(kto), free(vto);
}

/* ------------------------------------------------------------ shipped schemes */

static void test_shipped_round_trips(void **state) {
    (void)state;
    enum { N = 1024 };
    double rtn_k = 0, rtn4_k = 0, qvg_k = 0, qvg4_k = 0;
    print_message("%-14s %10s %10s   (1 head, %d synthetic tokens with outlier channels)\n", "scheme", "rel.MSE K",
                  "rel.MSE V", N);
    for (const char *const *name = kvf_builtin_schemes(); *name; name++) {
        kvf_scheme *s = tu_scheme(*name);
        double ek, ev, ek2, ev2;
        round_trip_error(s, N, 50, NULL, &ek, &ev);
        round_trip_error(s, N, 50, NULL, &ek2, &ev2); /* deterministic */
        assert_true(ek == ek2 && ev == ev2);
        print_message("%-14s %10.4g %10.4g\n", *name, ek, ev);
        int bits = s->key.bits;
        assert_true(ek < (bits == 2 ? 1.2 : 0.05));
        assert_true(ev < (bits == 2 ? 1.2 : 0.05));
        if (!strcmp(*name, "rtn_int2")) rtn_k = ek;
        if (!strcmp(*name, "rtn_int4")) rtn4_k = ek;
        if (!strcmp(*name, "qvg_int2")) qvg_k = ek;
        if (!strcmp(*name, "qvg_int4")) qvg4_k = ek;
        kvf_scheme_free(s);
    }
    assert_true(qvg_k < 0.5 * rtn_k);
    assert_true(qvg4_k < rtn4_k);
}

/* A packed cache names the scheme that wrote it: another scheme refuses it. */
static void test_other_scheme_rejected(void **state) {
    (void)state;
    enum { D = 128, N = 64 };
    kvf_scheme *a = tu_scheme("qvg_int2"), *b = tu_scheme("quantwm_int2");
    uint16_t *k = bf16_alloc(N * D), *ko = bf16_alloc(N * D);
    kvf_synth_kv(k, N, 1, D, 60);
    size_t bytes, bb;
    uint8_t *p = encode_with(a, k, k, N, 1, NULL, &bytes);
    assert_int_equal(kvf_packed_size(b, N, 1, &bb), KVF_OK);
    uint8_t *big = calloc(1, bb > bytes ? bb : bytes);
    memcpy(big, p, bytes);
    kvf_shape sh = {N, 1, 0, 0};
    assert_int_equal(kvf_ref_decode(b, big, bb > bytes ? bb : bytes, &sh, NULL, ko, ko), KVF_EFORMAT);
    assert_non_null(strstr(kvf_last_error(), "written by scheme hash"));
    assert_non_null(strstr(kvf_last_error(), "quantwm_int2"));
    free(k), free(ko), free(p), free(big);
    kvf_scheme_free(a);
    kvf_scheme_free(b);
}

/* ------------------------------------------------------------ warm start */

/* kvf_encode_warm on a CPU context: packed bytes of n tokens x h heads. */
static uint8_t *encode_warm_with(kvf_context *c, const uint16_t *k, const uint16_t *v, int64_t n, int h,
                                 const uint8_t *prev, size_t prev_bytes, int64_t prev_n, size_t *bytes) {
    kvf_shape sh = {n, h, 0, 0};
    assert_int_equal(kvf_packed_size(kvf_context_scheme(c), n, h, bytes), KVF_OK);
    uint8_t *p = malloc(*bytes);
    assert_non_null(p);
    if (kvf_encode_warm(c, k, v, &sh, NULL, prev, prev_bytes, prev_n, p, *bytes, NULL))
        fail_msg("encode_warm: %s", kvf_last_error());
    return p;
}

/* Row j of head h's stage-0 table of one section. */
static const uint8_t *table_row(const uint8_t *p, const kvf_section_layout *l, int h, int j, int d) {
    return p + l->stage[0].centroids_off + ((size_t)h * l->centroids + j) * d * 2;
}

/* With no Lloyd step the table is its start: the previous span's first rows
 * (as many as it has centroids: 100 of its tokens, or all 256), then the
 * strided sample's, row for row those of a cold start; a previous row with a
 * NaN or an Inf is not taken (the sample's row instead). */
static void test_warm_start_table(void **state) {
    (void)state;
    enum { D = 128, H = 2, N = 300 };
    kvf_scheme *s = tu_scheme_text("return { base = 'qvg_int2', name = 'warm0', key = { kmeans_iters = 0, "
                                   "kmeans_labels = 'final' }, value = { kmeans_iters = 0, kmeans_labels = 'final' } }");
    kvf_context *c;
    assert_int_equal(kvf_context_create(s, KVF_DEVICE_CPU, &c), KVF_OK);
    uint16_t *k = bf16_alloc((size_t)N * H * D), *v = bf16_alloc((size_t)N * H * D);
    uint16_t *kp = bf16_alloc((size_t)N * H * D), *vp = bf16_alloc((size_t)N * H * D);
    kvf_synth_kv(k, N, H, D, 70), kvf_synth_kv(v, N, H, D, 71);
    kvf_synth_kv(kp, N, H, D, 72), kvf_synth_kv(vp, N, H, D, 73);
    size_t cb;
    uint8_t *cold = encode_with(s, k, v, N, H, NULL, &cb);
    kvf_layout L;
    assert_int_equal(kvf_layout_compute(s, N, H, &L), KVF_OK);
    const int64_t prev_ns[2] = {100, N};
    for (int i = 0; i < 2; i++) {
        const int64_t pn = prev_ns[i];
        size_t pb, wb;
        kvf_layout PL;
        assert_int_equal(kvf_layout_compute(s, pn, H, &PL), KVF_OK);
        /* the previous span: its first pn tokens of kp, vp (head-major strides of N tokens) */
        kvf_shape psh = {pn, H, D, (int64_t)N * D};
        assert_int_equal(kvf_packed_size(s, pn, H, &pb), KVF_OK);
        uint8_t *prev = malloc(pb);
        assert_int_equal(kvf_encode(c, kp, vp, &psh, NULL, prev, pb, NULL), KVF_OK);
        /* rows 5 of head 1's keys and 7 of head 0's values: one NaN, one -Inf */
        kvf_put_u16((uint8_t *)table_row(prev, &PL.key, 1, 5, D) + 2 * 17, 0x7fc0);
        kvf_put_u16((uint8_t *)table_row(prev, &PL.value, 0, 7, D) + 2 * 100, 0xff80);
        uint8_t *warm = encode_warm_with(c, k, v, N, H, prev, pb, pn, &wb);
        const int from_prev = pn < 256 ? (int)pn : 256;
        for (int t = 0; t < 2; t++) {
            const kvf_section_layout *l = t ? &L.value : &L.key, *pl = t ? &PL.value : &PL.key;
            for (int h = 0; h < H; h++)
                for (int j = 0; j < 256; j++) {
                    const int poisoned = (t == 0 && h == 1 && j == 5) || (t == 1 && h == 0 && j == 7);
                    assert_memory_equal(table_row(warm, l, h, j, D),
                                        j < from_prev && !poisoned ? table_row(prev, pl, h, j, D)
                                                                   : table_row(cold, l, h, j, D),
                                        D * 2);
                }
        }
        /* and the indices are the nearest of that table: not the cold start's */
        assert_memory_not_equal(warm + L.key.stage[0].index_off, cold + L.key.stage[0].index_off, L.key.stage[0].index_bytes);
        free(prev), free(warm);
    }
    free(k), free(v), free(kp), free(vp), free(cold);
    kvf_context_destroy(c);
    kvf_scheme_free(s);
}

/* With Lloyd steps (the shipped schemes: the nearest centroid, QSAC and PSAC,
 * four stages): a warm start gives other centroids than a cold one and the
 * same bytes twice (32 centroids over 400 tokens). How good it is depends on
 * the data: from an unrelated span (independent synthetic tokens, here) the
 * round trip may be worse than a cold start's (its centroids fit other
 * tokens); from the same span's own centroids it goes on from there, as good
 * as a cold start within 2%. */
static void test_warm_start_lloyd(void **state) {
    (void)state;
    enum { D = 128, N = 400 };
    const char *names[] = {"qvg_int2", "quantwm_int2", "qvg_pro_int2"};
    for (int i = 0; i < 3; i++) {
        char text[200]; /* 32 centroids: about 12 tokens a cluster */
        snprintf(text, sizeof text, "return { base = '%s', name = 'w32', key = { centroids = 32 }, "
                 "value = { centroids = 32 } }", names[i]);
        kvf_scheme *s = tu_scheme_text(text);
        kvf_context *c;
        assert_int_equal(kvf_context_create(s, KVF_DEVICE_CPU, &c), KVF_OK);
        uint16_t *k = bf16_alloc(N * D), *v = bf16_alloc(N * D), *ko = bf16_alloc(N * D), *vo = bf16_alloc(N * D);
        uint16_t *kp = bf16_alloc(N * D), *vp = bf16_alloc(N * D);
        kvf_synth_kv(k, N, 1, D, 80), kvf_synth_kv(v, N, 1, D, 81);
        kvf_synth_kv(kp, N, 1, D, 82), kvf_synth_kv(vp, N, 1, D, 83);
        size_t pb, cb, wb, wb2;
        uint8_t *prev = encode_with(s, kp, vp, N, 1, NULL, &pb), *cold = encode_with(s, k, v, N, 1, NULL, &cb);
        uint8_t *warm = encode_warm_with(c, k, v, N, 1, prev, pb, N, &wb);
        uint8_t *again = encode_warm_with(c, k, v, N, 1, prev, pb, N, &wb2);
        uint8_t *self = encode_warm_with(c, k, v, N, 1, cold, cb, N, &wb2);
        kvf_layout L;
        assert_int_equal(kvf_layout_compute(s, N, 1, &L), KVF_OK);
        assert_memory_equal(warm, again, wb);
        assert_memory_not_equal(warm + L.key.stage[0].centroids_off, cold + L.key.stage[0].centroids_off,
                                L.key.stage[0].centroids_bytes);
        double e[3][2];
        const uint8_t *ps[3] = {cold, warm, self};
        for (int w = 0; w < 3; w++) {
            decode_with(s, ps[w], wb, N, 1, NULL, ko, vo);
            e[w][0] = rel_mse(k, ko, N * D), e[w][1] = rel_mse(v, vo, N * D);
        }
        print_message("  %s: rel. MSE K / V: cold %.4f / %.4f, warm from another span %.4f / %.4f, from its own "
                      "centroids %.4f / %.4f\n",
                      names[i], e[0][0], e[0][1], e[1][0], e[1][1], e[2][0], e[2][1]);
        assert_true(e[2][0] <= 1.02 * e[0][0] && e[2][1] <= 1.02 * e[0][1]);
        free(k), free(v), free(ko), free(vo), free(kp), free(vp), free(prev), free(cold), free(warm), free(again);
        free(self);
        kvf_context_destroy(c);
        kvf_scheme_free(s);
    }
}

/* What kvf_encode_warm refuses, and where it is kvf_encode. */
static void test_warm_start_args(void **state) {
    (void)state;
    enum { D = 128, N = 64 };
    kvf_scheme *s = tu_scheme("qvg_int2"), *other = tu_scheme("qvg_int4"), *rtn = tu_scheme("rtn_int2");
    kvf_context *c, *cr;
    assert_int_equal(kvf_context_create(s, KVF_DEVICE_CPU, &c), KVF_OK);
    assert_int_equal(kvf_context_create(rtn, KVF_DEVICE_CPU, &cr), KVF_OK);
    uint16_t *k = bf16_alloc(N * D);
    kvf_synth_kv(k, N, 1, D, 90);
    size_t pb, ob, b;
    uint8_t *prev = encode_with(s, k, k, N, 1, NULL, &pb), *oprev = encode_with(other, k, k, N, 1, NULL, &ob);
    assert_int_equal(kvf_packed_size(s, N, 1, &b), KVF_OK);
    uint8_t *p = malloc(b);
    kvf_shape sh = {N, 1, 0, 0};
    /* NULL prev: kvf_encode's bytes */
    assert_int_equal(kvf_encode_warm(c, k, k, &sh, NULL, NULL, 0, 0, p, b, NULL), KVF_OK);
    assert_memory_equal(p, prev, b);
    assert_int_equal(kvf_encode_warm(c, k, k, &sh, NULL, prev, pb - 1, N, p, b, NULL), KVF_ERANGE);
    assert_non_null(strstr(kvf_last_error(), "previous span"));
    assert_int_equal(kvf_encode_warm(c, k, k, &sh, NULL, prev, pb, 0, p, b, NULL), KVF_EINVAL);
    assert_int_equal(kvf_encode_warm(c, k, k, &sh, NULL, prev, pb, N - 1, p, b, NULL), KVF_EFORMAT); /* its header's tokens */
    assert_int_equal(kvf_encode_warm(c, k, k, &sh, NULL, oprev, ob, N, p, b, NULL), KVF_EFORMAT);
    assert_non_null(strstr(kvf_last_error(), "scheme hash"));
    assert_int_equal(kvf_encode_warm(c, k, k, &sh, NULL, p, b, N, p, b, NULL), KVF_EINVAL);
    assert_non_null(strstr(kvf_last_error(), "overlaps"));
    /* no centroids: the previous span changes nothing */
    size_t rb;
    uint8_t *rprev = encode_with(rtn, k, k, N, 1, NULL, &rb), *r = malloc(rb);
    assert_int_equal(kvf_encode_warm(cr, k, k, &sh, NULL, rprev, rb, N, r, rb, NULL), KVF_OK);
    assert_memory_equal(r, rprev, rb);
    free(k), free(prev), free(oprev), free(p), free(rprev), free(r);
    kvf_context_destroy(c), kvf_context_destroy(cr);
    kvf_scheme_free(s), kvf_scheme_free(other), kvf_scheme_free(rtn);
}

/* Bytes per token per head (K and V, everything stored) and the compression
 * against BF16, from kvf_footprint_of; the table of docs/METHODS.md "Sizes". */
static void test_footprint_table(void **state) {
    (void)state;
    static const int64_t spans[2] = {4680, 37440};
    FILE *md = fopen(tu_path("docs/METHODS.md"), "rb");
    assert_non_null(md);
    static char methods_md[1 << 18];
    methods_md[fread(methods_md, 1, sizeof methods_md - 1, md)] = 0;
    fclose(md);
    print_message("| scheme | bytes/token/head, 4680 | ratio, 4680 | bytes/token/head, 37440 | ratio, 37440 |\n");
    print_message("|---|---|---|---|---|\n");
    for (const char *const *name = kvf_builtin_schemes(); *name; name++) {
        kvf_scheme *s = tu_scheme(*name);
        kvf_footprint f[2];
        for (int i = 0; i < 2; i++) {
            assert_int_equal(kvf_footprint_of(s, spans[i], 1, &f[i]), KVF_OK);
            kvf_layout L;
            assert_int_equal(kvf_layout_compute(s, spans[i], 1, &L), KVF_OK);
            assert_int_equal(f[i].packed_bytes, L.total_bytes);
            assert_int_equal(f[i].bf16_bytes, (size_t)spans[i] * 128 * 4);
        }
        char row[200];
        snprintf(row, sizeof row, "| %s | %.2f | %.2fx | %.2f | %.2fx |", *name, (double)f[0].packed_bytes / 4680,
                 f[0].compression, (double)f[1].packed_bytes / 37440, f[1].compression);
        print_message("%s\n", row);
        /* docs/METHODS.md section 10 states every shipped scheme's sizes: the same row. */
        if (!strstr(methods_md, row)) fail_msg("docs/METHODS.md section 10 lacks the row \"%s\"", row);
        if (!strcmp(*name, "rtn_int2")) assert_int_equal(f[1].packed_bytes, 256 + 2 * 37440 * 40);
        kvf_scheme_free(s);
    }
    /* Planes add up: qvg_int2 at 37440 tokens x 1 head, per tensor: codes 32 B, scales and zeros
     * 4 + 4 B, index 1 B per token; 256 x 128 bf16 centroids. */
    kvf_scheme *q = tu_scheme("qvg_int2");
    kvf_layout L;
    assert_int_equal(kvf_layout_compute(q, 37440, 1, &L), KVF_OK);
    const kvf_stage_layout *st = &L.key.stage[0];
    assert_int_equal(st->codes_bytes, 37440 * 32);
    assert_int_equal(st->scales_bytes, 37440 * 4);
    assert_int_equal(st->zeros_bytes, 37440 * 4);
    assert_int_equal(st->index_bytes, 37440);
    assert_int_equal(st->centroids_bytes, 256 * 128 * 2);
    assert_true(st->codes_off < st->scales_off && st->scales_off < st->zeros_off && st->zeros_off < st->index_off &&
                st->index_off < st->centroids_off && st->centroids_off < L.value.stage[0].codes_off);
    assert_int_equal(st->codes_off, KVF_PLANE_ALIGN); /* key codes: the first plane after the header */
    kvf_scheme_free(q);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kmeans_separable),
        cmocka_unit_test(test_kmeans_seeded),
        cmocka_unit_test(test_kmeans_labels),
        cmocka_unit_test(test_qsac_choice),
        cmocka_unit_test(test_kivi_token_groups),
        cmocka_unit_test(test_hadamard),
        cmocka_unit_test(test_stages_monotonic),
        cmocka_unit_test(test_int8_fp16_scales),
        cmocka_unit_test(test_qstats_layout),
        cmocka_unit_test(test_quantwm_with_stats),
        cmocka_unit_test(test_rope_pre),
        cmocka_unit_test(test_heads_and_strides),
        cmocka_unit_test(test_shipped_round_trips),
        cmocka_unit_test(test_other_scheme_rejected),
        cmocka_unit_test(test_warm_start_table),
        cmocka_unit_test(test_warm_start_lloyd),
        cmocka_unit_test(test_warm_start_args),
        cmocka_unit_test(test_footprint_table),
    };
    return cmocka_run_group_tests_name("methods", tests, NULL, NULL);
}
