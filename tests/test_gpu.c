/* GPU against the CPU reference: packed bytes identical, decode bit-identical
 * (k-means with assign = "exact": exact()), runs repeatable, strided tensors,
 * precompiled images, query statistics with NaN/Inf rows; the fast k-means
 * assignment (the default) within its contract (gpu_fast_assign). Skipped
 * (and says so) where there is no GPU.
 *
 * KVF_TEST_SMALL=1: the same tests on a few dozen tokens and 2 heads (every
 * kernel still runs, shared-memory loops included), sized for compute-sanitizer
 * racecheck; KVF_TEST_SCHEMES=a,b limits the shipped schemes (and runs
 * gpu_psac_shapes' variants only when it names psac_shapes). */
#include "testutil.h"
#include "gpu/cuda_api.h"
#include "gpu/jit.h"
#include "dump.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static const kvf_cuda_api *cu;
static int small; /* KVF_TEST_SMALL=1: racecheck-sized shapes */
static CUcontext pctx;
static CUdevice dev;
static char skip_reason[600];
static char *cache_dir;

#define CK(call) assert_int_equal(cu->call, CUDA_SUCCESS)

static int setup(void **state) {
    (void)state;
    int n = 0;
    const char *sm = getenv("KVF_TEST_SMALL");
    small = sm && *sm && strcmp(sm, "0") != 0;
    if (small) printf("KVF_TEST_SMALL: a few dozen tokens, 2 heads\n");
    cache_dir = tu_mkdtemp();
    setenv("KVFORGE_CACHE_DIR", cache_dir, 1);
    if (kvf_device_count(&n) != KVF_OK) {
        snprintf(skip_reason, sizeof skip_reason, "%s", kvf_last_error());
        printf("GPU tests skipped: %s\n", skip_reason);
        return 0;
    }
    kvf_cuda_load(&cu);
    if (cu->cuDeviceGet(&dev, 0) || cu->cuDevicePrimaryCtxRetain(&pctx, dev) || cu->cuCtxPushCurrent(pctx)) return -1;
    char name[128] = "";
    cu->cuDeviceGetName(name, sizeof name, dev);
    printf("GPU: %s\n", name);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    if (pctx) {
        CUcontext p;
        cu->cuCtxPopCurrent(&p);
        cu->cuDevicePrimaryCtxRelease(dev);
    }
    tu_rmtree(cache_dir);
    free(cache_dir);
    return 0;
}

#define SKIP_WITHOUT_GPU()                                    \
    do {                                                      \
        if (skip_reason[0]) { printf("skipped: no GPU\n"); skip(); } \
    } while (0)

/* The device's multiprocessors (for shapes whose heads must outnumber them). */
static int sm_count(void) {
    int sms = 0;
    CK(cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev));
    return sms;
}

static CUdeviceptr dalloc(size_t n, int poison) {
    CUdeviceptr p = 0;
    CK(cuMemAlloc(&p, n));
    CK(cuMemsetD8(p, (unsigned char)poison, n));
    return p;
}

/* Random BF16 in [-8, 8) with a few large values: not only synthetic data. */
static void random_bf16(uint16_t *x, size_t n, uint64_t seed) {
    uint64_t s = seed * 2654435761u + 1;
    for (size_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        float v = (float)((s >> 40) & 0xffff) / 4096.0f - 8.0f;
        if (((s >> 20) & 255) == 7) v *= 40.0f;
        x[i] = kvf_f32_to_bf16(v);
    }
}

typedef struct run_case { int64_t tokens; int heads; int token_major; int pad; } run_case;

/* Element count of a tensor with the case's layout and padding. */
static size_t tensor_elems(const run_case *c, int d, kvf_shape *sh) {
    sh->n_tokens = c->tokens;
    sh->n_heads = c->heads;
    if (c->token_major) { /* [N][H][d] (+pad per token) */
        sh->head_stride = d;
        sh->token_stride = (int64_t)c->heads * d + c->pad;
        return (size_t)(sh->token_stride * c->tokens);
    }
    sh->token_stride = d + c->pad; /* [H][N][d] (+pad per token) */
    sh->head_stride = sh->token_stride * c->tokens;
    return (size_t)(sh->head_stride * c->heads);
}

/* Bytes of [off, off+n) that differ. */
static size_t diff_bytes(const uint8_t *a, const uint8_t *b, size_t off, size_t n) {
    size_t k = 0;
    for (size_t i = off; i < off + n; i++) k += a[i] != b[i];
    return k;
}

/* Elements whose bf16 values differ, and by how many units in the last place at most. */
static void diff_bf16(const uint16_t *a, const uint16_t *b, size_t n, size_t *differ, int *max_ulp, double *rel) {
    double e2 = 0, r2 = 0;
    *differ = 0;
    *max_ulp = 0;
    for (size_t i = 0; i < n; i++) {
        if (a[i] == b[i]) continue;
        (*differ)++;
        int u = abs((int)(int16_t)a[i] - (int)(int16_t)b[i]);
        if ((a[i] ^ b[i]) & 0x8000u) u = 1 << 15;
        if (u > *max_ulp) *max_ulp = u;
    }
    for (size_t i = 0; i < n; i++) {
        double x = kvf_bf16_to_f32(a[i]), y = kvf_bf16_to_f32(b[i]);
        e2 += (x - y) * (x - y);
        r2 += y * y;
    }
    *rel = r2 > 0 ? sqrt(e2 / r2) : 0;
}

/* Largest difference between the top-r projectors U U^T (sign-free) of two
 * host copies of statistics: the basis comes from f32 arithmetic in other orders. */
static double projector_diff(const void *a, const void *b, const kvf_qstats_layout *l) {
    const float *ua = (const float *)((const uint8_t *)a + l->u_off), *ub = (const float *)((const uint8_t *)b + l->u_off);
    const int d = l->head_dim, r = l->rank;
    double worst = 0;
    for (int h = 0; h < l->n_heads; h++)
        for (int x = 0; x < d; x++)
            for (int y = 0; y < d; y++) {
                double pa = 0, pb = 0;
                for (int j = 0; j < r; j++) {
                    pa += (double)ua[((size_t)h * d + x) * r + j] * ua[((size_t)h * d + y) * r + j];
                    pb += (double)ub[((size_t)h * d + x) * r + j] * ub[((size_t)h * d + y) * r + j];
                }
                if (fabs(pa - pb) > worst) worst = fabs(pa - pb);
            }
    return worst;
}

/* Host and device query statistics fed the same previous chunk of queries
 * (grouped-query attention: twice as many query heads). */
typedef struct qstats_pair { void *host; CUdeviceptr dev; size_t bytes; } qstats_pair;

static void qstats_prepare(kvf_context *gpu, kvf_context *cpu, int heads, qstats_pair *q) {
    const kvf_scheme *s = kvf_context_scheme(gpu);
    int d = kvf_scheme_head_dim(s), hq = 2 * heads;
    const int64_t nq = small ? 40 : 777;
    assert_int_equal(kvf_qstats_size(s, heads, &q->bytes), KVF_OK);
    q->host = malloc(q->bytes);
    q->dev = dalloc(q->bytes, 0xee);
    assert_int_equal(kvf_qstats_init(cpu, q->host, q->bytes, heads, NULL), KVF_OK);
    assert_int_equal(kvf_qstats_init(gpu, (void *)q->dev, q->bytes, heads, NULL), KVF_OK);
    size_t n = (size_t)nq * hq * d;
    uint16_t *qh = malloc(n * 2);
    kvf_synth_kv(qh, nq, hq, d, 77);
    CUdeviceptr qd = dalloc(n * 2, 0);
    CK(cuMemcpyHtoD(qd, qh, n * 2));
    kvf_shape qs = {nq, hq, 0, 0};
    assert_int_equal(kvf_qstats_update(cpu, q->host, q->bytes, qh, &qs, NULL), KVF_OK);
    assert_int_equal(kvf_qstats_update(gpu, (void *)q->dev, q->bytes, (void *)qd, &qs, NULL), KVF_OK);
    CK(cuCtxSynchronize());
    /* Counts and sums are exact on both sides; the basis comes from f32 arithmetic in other orders. */
    kvf_qstats_layout l;
    assert_int_equal(kvf_qstats_layout_compute(s, heads, &l), KVF_OK);
    uint8_t *back = malloc(q->bytes);
    CK(cuMemcpyDtoH(back, q->dev, q->bytes));
    assert_memory_equal(back, q->host, l.msum_off); /* header and counts */
    assert_memory_equal(back + l.msum_off, (uint8_t *)q->host + l.msum_off, (size_t)heads * d * d * 4);
    if (l.rank > 0) {
        double worst = projector_diff(back, q->host, &l);
        printf("  qstats: counts and sums identical; top-%d projector max |diff| %.2e\n", l.rank, worst);
        assert_true(worst < 1e-3);
    }
    free(back);
    free(qh);
    cu->cuMemFree(qd);
}

/* What a plane mismatch looks like: bytes per plane, the first rows that
 * differ (head, token, and for the index plane both indices), and the input
 * row's kind (finite, or which non-finite/huge values it holds). With
 * KVF_TEST_DUMP=dir both packed buffers go there for a closer look. */
static const char *row_kind(const uint16_t *x, const kvf_shape *sh, int64_t t, int h, int d) {
    const uint16_t *r = x + t * sh->token_stride + h * sh->head_stride;
    int nan = 0, inf = 0, huge = 0;
    for (int i = 0; i < d; i++) {
        uint16_t e = (uint16_t)(r[i] & 0x7fffu);
        nan += e > 0x7f80u;
        inf += e == 0x7f80u;
        huge += e >= 0x7000u && e < 0x7f80u;
    }
    return nan == d ? "NaN row" : nan ? "NaN" : inf ? "Inf" : huge ? "huge" : "finite";
}

/* Differing bytes of one stage's quantizer planes (codes, scales, token
 * scales, zeros, indices, centroids) between two packed buffers. */
static size_t stage_diff(const uint8_t *a, const uint8_t *b, const kvf_stage_layout *g) {
    return diff_bytes(a, b, g->codes_off, g->codes_bytes) + diff_bytes(a, b, g->scales_off, g->scales_bytes) +
           diff_bytes(a, b, g->tscales_off, g->tscales_bytes) + diff_bytes(a, b, g->zeros_off, g->zeros_bytes) +
           diff_bytes(a, b, g->index_off, g->index_bytes) + diff_bytes(a, b, g->centroids_off, g->centroids_bytes);
}

/* Every stage of both sections identical between two packed buffers. */
static void assert_same_stages(const uint8_t *a, const uint8_t *b, const kvf_layout *l) {
    const kvf_section_layout *secs[2] = {&l->key, &l->value};
    for (int t = 0; t < 2; t++)
        for (int st = 0; st < secs[t]->stages || st == 0; st++) assert_int_equal(stage_diff(a, b, &secs[t]->stage[st]), 0);
}

/* PSAC's four planes of the key section identical between two packed buffers. */
static void assert_same_psac(const uint8_t *a, const uint8_t *b, const kvf_section_layout *k) {
    assert_int_equal(diff_bytes(a, b, k->basis_off, k->basis_bytes), 0);
    assert_int_equal(diff_bytes(a, b, k->bscale_off, k->bscale_bytes), 0);
    assert_int_equal(diff_bytes(a, b, k->coef_off, k->coef_bytes), 0);
    assert_int_equal(diff_bytes(a, b, k->cscale_off, k->cscale_bytes), 0);
}

/* Encode on the GPU into dp, first filled with `fill` (so a byte the encoder
 * does not write shows), and copy the packed buffer to host. */
static void gpu_encode(kvf_context *gpu, CUdeviceptr dk, CUdeviceptr dv, const kvf_shape *sh, CUdeviceptr qs,
                       CUdeviceptr dp, size_t packed_bytes, unsigned char fill, uint8_t *host) {
    CK(cuMemsetD8(dp, fill, packed_bytes));
    assert_int_equal(kvf_encode(gpu, (void *)dk, (void *)dv, sh, (void *)qs, (void *)dp, packed_bytes, NULL), KVF_OK);
    CK(cuCtxSynchronize());
    CK(cuMemcpyDtoH(host, dp, packed_bytes));
}

static void report_planes(const uint8_t *pg, const uint8_t *pc, const kvf_stage_layout *g,
                          const kvf_section_layout *sec, int t, int st, const run_case *c, const uint16_t *x,
                          const kvf_shape *sh, int d) {
    const size_t rows = (size_t)c->tokens * (size_t)c->heads; /* >= 1 */
    const struct { const char *name; size_t off, bytes, row_bytes; } pl[] = {
        {"codes", g->codes_off, g->codes_bytes, sec->code_bytes_per_token},
        {"scales", g->scales_off, g->scales_bytes, g->scales_bytes / rows},
        {"tscales", g->tscales_off, g->tscales_bytes, 2},
        {"zeros", g->zeros_off, g->zeros_bytes, g->zeros_bytes / rows},
        {"index", g->index_off, g->index_bytes, 1},
        {"centroids", g->centroids_off, g->centroids_bytes, (size_t)d * 2}};
    printf("  %s stage %d: plane bytes differ:", t ? "V" : "K", st);
    for (size_t i = 0; i < sizeof pl / sizeof pl[0]; i++) {
        size_t b = diff_bytes(pg, pc, pl[i].off, pl[i].bytes);
        if (b) printf(" %s %zu", pl[i].name, b);
    }
    printf("\n");
    for (size_t i = 0; i < sizeof pl / sizeof pl[0]; i++) {
        if (!pl[i].row_bytes || sec->axis != KVF_AXIS_CHANNEL) continue;
        int shown = 0;
        for (size_t o = 0; o < pl[i].bytes && shown < 6; o++) {
            if (pg[pl[i].off + o] == pc[pl[i].off + o]) continue;
            size_t row = o / pl[i].row_bytes;
            if (!strcmp(pl[i].name, "centroids")) {
                printf("    centroids: head %zu centroid %zu\n", row / (size_t)sec->centroids, row % (size_t)sec->centroids);
            } else {
                int h = (int)(row / (size_t)c->tokens);
                int64_t tok = (int64_t)(row % (size_t)c->tokens);
                printf("    %s: head %d token %lld (%s)", pl[i].name, h, (long long)tok, row_kind(x, sh, tok, h, d));
                if (!strcmp(pl[i].name, "index")) printf(": GPU %u, CPU %u", pg[pl[i].off + o], pc[pl[i].off + o]);
                printf("\n");
            }
            shown++;
            o = (row + 1) * pl[i].row_bytes - 1; /* next row */
        }
    }
    const char *dir = getenv("KVF_TEST_DUMP");
    if (dir && *dir) {
        char path[1024];
        size_t total = g->centroids_off + g->centroids_bytes > g->codes_off + g->codes_bytes
                           ? g->centroids_off + g->centroids_bytes : g->codes_off + g->codes_bytes;
        snprintf(path, sizeof path, "%s/gpu_%c%d.bin", dir, t ? 'v' : 'k', st);
        tu_write_file(path, pg, total);
        snprintf(path, sizeof path, "%s/cpu_%c%d.bin", dir, t ? 'v' : 'k', st);
        tu_write_file(path, pc, total);
        snprintf(path, sizeof path, "%s/input_%c.bin", dir, t ? 'v' : 'k');
        tu_write_file(path, x, (size_t)(c->token_major ? sh->token_stride * c->tokens : sh->head_stride * c->heads) * 2);
    }
}

/* The n elements of K and V of a case in its layout (tensor_elems's sh and
 * n): data 0 synthetic, 1 random, 2 with NaN/Inf/huge values, 3 near the
 * filter's 2^125 guard, 4 16 distinct rows a head (each described below). */
static void fill_inputs(const run_case *c, int d, int data, kvf_shape sh, size_t n, uint16_t *k, uint16_t *v) {
    if (data == 1) { random_bf16(k, n, 11 + c->tokens); random_bf16(v, n, 12 + c->tokens); }
    else {
        /* Synthetic data is head-major contiguous: spread it into the layout. */
        uint16_t *tmp = malloc((size_t)c->tokens * c->heads * d * 2 * 2);
        kvf_synth_kv(tmp, c->tokens, c->heads, d, 5);
        kvf_synth_kv(tmp + (size_t)c->tokens * c->heads * d, c->tokens, c->heads, d, 6);
        memset(k, 0x7f, n * 2); memset(v, 0x7f, n * 2);
        for (int h = 0; h < c->heads; h++)
            for (int64_t t = 0; t < c->tokens; t++) {
                size_t src = ((size_t)h * c->tokens + t) * d, dst = t * sh.token_stride + h * sh.head_stride;
                memcpy(k + dst, tmp + src, d * 2);
                memcpy(v + dst, tmp + (size_t)c->tokens * c->heads * d + src, d * 2);
            }
        free(tmp);
    }
    if (data == 2) { /* non-finite and huge inputs: k-means takes its full f64 scans (METHODS.md 3) */
        const uint16_t nan = 0x7fc1, inf = 0x7f80, huge = 0x7149; /* ~1e30 */
        for (int64_t t = 0; t < c->tokens; t += 7) {
            int h = (int)(t % c->heads);
            uint16_t *kr = k + t * sh.token_stride + h * sh.head_stride, *vr = v + t * sh.token_stride + h * sh.head_stride;
            if (t % 21 == 0) for (int i = 0; i < d; i++) kr[i] = nan; /* a whole key row */
            else if (t % 21 == 7) kr[(int)(t % d)] = inf;
            else { vr[(int)(t % d)] = nan; kr[(int)((t + 3) % d)] = huge; }
        }
    }
    if (data == 3) { /* rows near the assignment filter's 2^125 guard (METHODS.md 3), keys and values */
        for (int h = 0; h < c->heads; h++)
            for (int64_t t = 0; t < c->tokens; t++) {
                if (t % 3 == 2) continue; /* an ordinary row */
                /* Head 0: one-hot rows of +-2^62, |a| max|mu| + max|N| / 2 = 1.5 * 2^124: a finite
                 * bound with scores near 2^124. Other heads: 1.5 * 2^62, some two-hot: every
                 * token of the head crosses the guard (the full scan) in the first assignment. */
                const uint16_t big = (uint16_t)((h == 0 ? 0x5e80 : 0x5ec0) | (t % 2 ? 0x8000 : 0));
                for (int kv = 0; kv < 2; kv++) {
                    uint16_t *r = (kv ? v : k) + t * sh.token_stride + h * sh.head_stride;
                    memset(r, 0, (size_t)d * 2);
                    r[(t * 5) % d] = big;
                    if (h != 0 && t % 3 == 1) r[(t * 5 + 1) % d] = big;
                }
            }
    }
    if (data == 4) { /* 16 distinct rows a head (synthetic rows repeated): centroids repeat too, so a
                      * token has many equally near ones, past the filter's keys a thread and into
                      * its second pass (COLLECT, templates/kvf_kmeans.cuh), which data 0-3 reach for
                      * few or no tokens */
        for (int h = 0; h < c->heads; h++)
            for (int64_t t = 16; t < c->tokens; t++) {
                const size_t dst = t * sh.token_stride + h * sh.head_stride, src = (t % 16) * sh.token_stride + h * sh.head_stride;
                memcpy(k + dst, k + src, (size_t)d * 2);
                memcpy(v + dst, v + src, (size_t)d * 2);
            }
    }
}

/* Encode and decode one case on both backends and compare. */
static void compare_case(kvf_context *gpu, kvf_context *cpu, const run_case *c, int data, int verbose) {
    const kvf_scheme *s = kvf_context_scheme(gpu);
    int d = kvf_scheme_head_dim(s);
    kvf_shape sh;
    size_t n = tensor_elems(c, d, &sh), packed_bytes;
    assert_int_equal(kvf_packed_size(s, c->tokens, c->heads, &packed_bytes), KVF_OK);
    uint16_t *k = malloc(n * 2), *v = malloc(n * 2);
    uint16_t *kc = malloc(n * 2), *vc = malloc(n * 2), *kg = malloc(n * 2), *vg = malloc(n * 2);
    uint8_t *pc = malloc(packed_bytes), *pg = malloc(packed_bytes), *pg2 = malloc(packed_bytes);
    fill_inputs(c, d, data, sh, n, k, v);
    qstats_pair q = {0};
    if (kvf_scheme_reads_qstats(s)) qstats_prepare(gpu, cpu, c->heads, &q);
    /* Positions for keys cached before RoPE: 3 axes (frame, row, column). */
    int axes = kvf_rope_sections(s, NULL);
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)c->tokens * axes);
    for (int64_t t = 0; t < c->tokens; t++)
        for (int a = 0; a < axes; a++) pos[t * axes + a] = (int32_t)((t / (a + 1) * 7 + a * 3) % 977);
    CUdeviceptr dpos = dalloc(sizeof(int32_t) * (size_t)c->tokens * axes, 0);
    CK(cuMemcpyHtoD(dpos, pos, sizeof(int32_t) * (size_t)c->tokens * axes));
    const int32_t *hp = s->rope.placement == KVF_ROPE_PRE ? pos : NULL;
    const int32_t *dp_pos = s->rope.placement == KVF_ROPE_PRE ? (const int32_t *)dpos : NULL;

    memcpy(kc, k, n * 2); memcpy(vc, v, n * 2); /* padding keeps its values on the CPU side */
    assert_int_equal(kvf_encode(cpu, k, v, &sh, q.host, pc, packed_bytes, NULL), KVF_OK);
    assert_int_equal(kvf_decode(cpu, pc, packed_bytes, &sh, hp, kc, vc, NULL), KVF_OK);

    CUdeviceptr dk = dalloc(n * 2, 0), dv = dalloc(n * 2, 0), dp = dalloc(packed_bytes, 0xa5);
    CUdeviceptr dk2 = dalloc(n * 2, 0), dv2 = dalloc(n * 2, 0);
    CK(cuMemcpyHtoD(dk, k, n * 2));
    CK(cuMemcpyHtoD(dv, v, n * 2));
    CK(cuMemcpyHtoD(dk2, k, n * 2)); /* so padding holds the same as on the CPU side */
    CK(cuMemcpyHtoD(dv2, v, n * 2));
    const int kmeans = s->key.centroids > 0 || s->value.centroids > 0;
    unsigned long long astats[2][2 * KVF_AS_N];
    const int counted = (data == 3 || data == 4) && kmeans; /* the assignment's statistics of this encode */
    if (counted) assert_int_equal(kvf_context_assign_stats(gpu, 1, astats), KVF_OK);
    gpu_encode(gpu, dk, dv, &sh, q.dev, dp, packed_bytes, 0xa5, pg);
    if (counted) assert_int_equal(kvf_context_assign_stats(gpu, 0, astats), KVF_OK);
    /* QSAC's final assignment (its own program and statistics global since
     * the assignment's 1-D grid) takes every key token of every head once. */
    if (counted && s->key.qsac_candidates > 1 && !kvf_labels_of_last_step(&s->key))
        assert_int_equal(astats[0][KVF_AS_N + KVF_AS_TOKENS], (unsigned long long)c->tokens * (unsigned long long)c->heads);
    /* A row that took f64 distances (full scans aside) had at least two
     * candidates, every other row of the filter's path at least one. */
    for (int t = 0; counted && t < 2; t++)
        for (int k = 0; k < 2; k++) {
            const unsigned long long *a = astats[t] + KVF_AS_N * k;
            assert_true(a[KVF_AS_FULL] + a[KVF_AS_EXACT] <= a[KVF_AS_TOKENS]);
            assert_true(a[KVF_AS_CANDIDATES] >= a[KVF_AS_TOKENS] - a[KVF_AS_FULL] + a[KVF_AS_EXACT]);
        }
    if (data == 3 && kmeans) {
        unsigned long long full = 0;
        for (int t = 0; t < 2; t++) full += astats[t][KVF_AS_FULL] + astats[t][KVF_AS_N + KVF_AS_FULL];
        /* Head 1's tokens at least once (its first assignment), whatever else. */
        if (c->heads > 1) assert_true(full >= (unsigned long long)c->tokens);
        printf("  rows near the filter's 2^125 guard: %llu full scans\n", full);
    }
    if (data == 4 && kmeans) {
        unsigned long long twice = 0, exact = 0;
        for (int t = 0; t < 2; t++) {
            twice += astats[t][KVF_AS_AGAIN] + astats[t][KVF_AS_N + KVF_AS_AGAIN];
            exact += astats[t][KVF_AS_EXACT] + astats[t][KVF_AS_N + KVF_AS_EXACT];
        }
        printf("  16 distinct rows a head: %llu tokens filtered twice, %llu with f64 distances\n", twice, exact);
        if (c->tokens >= 1024) assert_true(twice > 0); /* the full-size cases' first shape */
    }
    /* Bytes between planes are padding nobody writes: compare the planes. */
    kvf_layout l;
    kvf_layout_compute(s, c->tokens, c->heads, &l);
    const kvf_section_layout *secs[2] = {&l.key, &l.value};
    assert_memory_equal(pg, pc, KVF_HEADER_BYTES);
    size_t bad = 0;
    for (int t = 0; t < 2; t++)
        for (int st = 0; st < secs[t]->stages || st == 0; st++) {
            const kvf_stage_layout *g = &secs[t]->stage[st];
            size_t b = stage_diff(pg, pc, g);
            if (b) report_planes(pg, pc, g, secs[t], t, st, c, t ? v : k, &sh, d);
            bad += b;
        }
    assert_int_equal(bad, 0); /* every method but PSAC's factors: identical bytes */
    size_t coef_far = 0;
    if (l.key.psac_rank > 0) {
        const int8_t *cg = (const int8_t *)(pg + l.key.coef_off), *cc = (const int8_t *)(pc + l.key.coef_off);
        for (size_t i = 0; i < l.key.coef_bytes; i++) coef_far += abs(cg[i] - cc[i]) > 1;
        if (verbose)
            printf("  PSAC: basis codes differing %zu of %zu, scales %zu of %zu bytes, coefficients off by more than "
                   "one step %zu of %zu\n",
                   diff_bytes(pg, pc, l.key.basis_off, l.key.basis_bytes), l.key.basis_bytes,
                   diff_bytes(pg, pc, l.key.bscale_off, l.key.bscale_bytes), l.key.bscale_bytes, coef_far,
                   l.key.coef_bytes);
        assert_true(coef_far <= l.key.coef_bytes / 1000);
    }
    assert_int_equal(kvf_decode(gpu, (void *)dp, packed_bytes, &sh, dp_pos, (void *)dk2, (void *)dv2, NULL), KVF_OK);
    CK(cuCtxSynchronize());
    CK(cuMemcpyDtoH(kg, dk2, n * 2));
    CK(cuMemcpyDtoH(vg, dv2, n * 2));
    size_t kd, vd;
    int ku, vu;
    double kr, vr;
    diff_bf16(kg, kc, n, &kd, &ku, &kr);
    diff_bf16(vg, vc, n, &vd, &vu, &vr);
    if (verbose || kd || vd)
        printf("  decode vs CPU: K %zu of %zu differ (max %d ulp, rel %.2e), V %zu differ (max %d ulp)\n", kd, n, ku,
               kr, vd, vu);
    assert_int_equal(vd, 0); /* values: no PSAC, no RoPE: bit-identical */
    if (l.key.psac_rank == 0 && s->rope.placement != KVF_ROPE_PRE) assert_int_equal(kd, 0);
    else assert_true(kr < 2e-3);
    /* Same input, same GPU: the same bytes again. */
    gpu_encode(gpu, dk, dv, &sh, q.dev, dp, packed_bytes, 0x5a, pg2);
    assert_same_stages(pg2, pg, &l);
    if (l.key.psac_rank > 0) assert_same_psac(pg2, pg, &l.key);
    if (l.key.psac_rank > 0 && q.dev) {
        /* The CPU's statistics on the GPU: then PSAC's basis, coefficients
         * and scales, and the decoded keys, are bit-identical too (above,
         * each side used its own eigenvectors). */
        CK(cuMemcpyHtoD(q.dev, q.host, q.bytes));
        gpu_encode(gpu, dk, dv, &sh, q.dev, dp, packed_bytes, 0x5a, pg2);
        size_t kept = 0;
        for (size_t i = 0; i < l.key.cscale_bytes / 2; i++) kept += ((const uint16_t *)(pc + l.key.cscale_off))[i] != 0;
        if (verbose) printf("  PSAC with the CPU's statistics: %zu of %zu tokens keep a correction\n", kept, l.key.cscale_bytes / 2);
        /* The first full-size case, plain data, keeps corrections (small mode's few tokens may not). */
        if (verbose && !small) assert_true(kept > 0);
        assert_same_stages(pg2, pc, &l);
        assert_same_psac(pg2, pc, &l.key);
        assert_int_equal(kvf_decode(gpu, (void *)dp, packed_bytes, &sh, dp_pos, (void *)dk2, (void *)dv2, NULL), KVF_OK);
        CK(cuCtxSynchronize());
        CK(cuMemcpyDtoH(kg, dk2, n * 2));
        diff_bf16(kg, kc, n, &kd, &ku, &kr);
        if (s->rope.placement != KVF_ROPE_PRE) assert_int_equal(kd, 0);
        else assert_true(kr < 2e-3); /* RoPE at decode: sinf/cosf differ from the CPU's by an ulp at times */
    }
    cu->cuMemFree(dk); cu->cuMemFree(dv); cu->cuMemFree(dp); cu->cuMemFree(dk2); cu->cuMemFree(dv2);
    cu->cuMemFree(dpos);
    if (q.dev) cu->cuMemFree(q.dev);
    free(q.host);
    free(pos);
    free(k); free(v); free(kc); free(vc); free(kg); free(vg); free(pc); free(pg); free(pg2);
}

static const run_case cases[] = {
    {4680, 8, 0, 0},  /* one 480p chunk, head-major */
    {1560, 4, 1, 0},  /* token-major [N][H][d] */
    {37, 3, 0, 8},    /* odd count, padded rows; fewer tokens than centroids */
    {1, 1, 1, 16},    /* a single token */
};
/* The k-means schemes' CPU reference is slow (f64 distances): smaller spans. */
static const run_case small_cases[] = {
    {1560, 2, 0, 0},
    {300, 3, 1, 0},
    {37, 3, 0, 8},
    {1, 1, 1, 16},
};

/* KVF_TEST_SMALL: every scheme, a few dozen tokens (two tiles of the
 * accumulation's 32 tokens, several of k-means' 16), 2 heads. */
static const run_case tiny_cases[] = {
    {48, 2, 0, 0},
    {40, 2, 1, 0},
    {37, 2, 0, 8},
    {1, 1, 1, 16},
};

/* s with assign = "exact" in both sections (kvf_scheme_finalize: its plan,
 * canonical text and id again): the assignment the byte-for-byte comparisons
 * with the CPU reference need. The default, "fast", has its own contract
 * (gpu_fast_assign). */
static kvf_scheme *exact(kvf_scheme *s) {
    s->key.assign = s->value.assign = KVF_ASSIGN_EXACT;
    if (kvf_scheme_finalize(s)) fail_msg("%s: %s", s->name, kvf_last_error());
    return s;
}

/* cs: 4 cases, or NULL for the default set of the scheme's kind. */
static void run_scheme_cases(kvf_scheme *s, const run_case *cs) {
    kvf_context *gpu, *cpu;
    if (kvf_context_create(s, 0, &gpu)) fail_msg("%s: %s", kvf_scheme_id(s), kvf_last_error());
    assert_int_equal(kvf_context_create(s, KVF_DEVICE_CPU, &cpu), KVF_OK);
    if (!cs) cs = small ? tiny_cases : s->key.centroids || s->value.centroids ? small_cases : cases;
    printf("%s on %s:\n", kvf_scheme_id(s), kvf_context_backend(gpu));
    for (size_t i = 0; i < 4; i++) {
        compare_case(gpu, cpu, &cs[i], 0, i == 0); /* synthetic */
        compare_case(gpu, cpu, &cs[i], 1, 0);      /* random */
        if (i == 0) compare_case(gpu, cpu, &cs[i], 2, 0); /* NaN/Inf/huge */
        if (i == 0) compare_case(gpu, cpu, &cs[i], 4, 0); /* 16 distinct rows a head */
        if (i == 2) compare_case(gpu, cpu, &cs[i], 3, 0); /* near the filter's 2^125 guard */
    }
    printf("  agrees with the CPU reference (4 shapes x 2 data sets, NaN/Inf/huge inputs and 16 distinct rows a "
           "head on the first, rows near the filter's 2^125 guard on the third)\n");
    kvf_context_destroy(gpu);
    kvf_context_destroy(cpu);
}

static void run_scheme(kvf_scheme *s) { run_scheme_cases(s, NULL); }

/* KVF_TEST_SCHEMES=a,b limits the shipped schemes run (e.g. under compute-sanitizer). */
static int selected(const char *name) {
    const char *only = getenv("KVF_TEST_SCHEMES");
    if (!only || !*only) return 1;
    size_t n = strlen(name);
    for (const char *p = only; (p = strstr(p, name)); p += n)
        if ((p == only || p[-1] == ',') && (p[n] == 0 || p[n] == ',')) return 1;
    return 0;
}

static void gpu_matches_cpu(void **state) {
    (void)state;
    SKIP_WITHOUT_GPU();
    for (const char *const *name = kvf_builtin_schemes(); *name; name++) {
        if (!selected(*name)) continue;
        kvf_scheme *s = exact(tu_scheme(*name));
        if (s->plan.sec[0].mp_channels || s->plan.sec[1].mp_channels || s->pipe.anchor_every) {
            /* its encode needs a channel map and its stream anchors: gpu_pipeline_stream */
            printf("%s: a stream of the pipeline, in gpu_pipeline_stream\n", *name);
            kvf_scheme_free(s);
            continue;
        }
        run_scheme(s);
        kvf_scheme_free(s);
    }
}

/* Keys cached before RoPE (3D RoPE of a video model), decoded with positions. */
static void gpu_rope_pre(void **state) {
    (void)state;
    SKIP_WITHOUT_GPU();
    const char *texts[2] = {
        "return { base = 'quantwm_int2', name = 'wm_rope', rope = { placement = 'pre', layout = 'half', sections = {16, 24, 24} } }",
        "return { base = 'rtn_int4', name = 'rtn_rope', rope = { placement = 'pre', layout = 'interleaved' } }"};
    for (int i = 0; i < 2; i++) {
        kvf_scheme *s = exact(tu_scheme_text(texts[i]));
        run_scheme(s);
        kvf_scheme_free(s);
    }
}

/* PSAC at the ranks and head sizes the GPU takes besides the shipped rank 8
 * at head_dim 128: ranks below 4 (byte loads of the basis codes and
 * coefficients), 16 and 32 (more coefficient words in registers), head_dim 64 and
 * 256 (statistics tiles, basis blocks). QSAC's scores (kvf_kmeans::
 * sensitivity: a range per group of channels) at key groups of 16 and 128
 * channels besides 64, and over 1 and 4 groups at head_dim 64 and 256. 300
 * tokens: more than the 256 centroids. */
static void gpu_psac_shapes(void **state) {
    (void)state;
    SKIP_WITHOUT_GPU();
    static const run_case psac_cases[] = {{300, 2, 0, 0}, {40, 2, 1, 0}, {37, 2, 0, 8}, {1, 1, 1, 16}};
    const char *texts[] = {
        "return { base = 'quantwm_int2', name = 'wm_d64_r1', head_dim = 64, key = { psac_rank = 1 } }",
        "return { base = 'quantwm_int2', name = 'wm_d64_r2', head_dim = 64, key = { psac_rank = 2 } }",
        "return { base = 'quantwm_int2', name = 'wm_d64_r4', head_dim = 64, key = { psac_rank = 4 } }",
        "return { base = 'quantwm_int2', name = 'wm_d64_r32', head_dim = 64, key = { psac_rank = 32 } }",
        "return { base = 'quantwm_int2', name = 'wm_d128_r32', key = { psac_rank = 32 } }",
        "return { base = 'quantwm_int2', name = 'wm_d256_r16', head_dim = 256, key = { psac_rank = 16 } }",
        "return { base = 'quantwm_int2', name = 'wm_g16', key = { group_size = 16 } }",
        "return { base = 'quantwm_int2', name = 'wm_g128', key = { group_size = 128 } }",
        NULL};
    if (!selected("psac_shapes")) return;
    for (int i = 0; texts[i]; i++) {
        kvf_scheme *s = exact(tu_scheme_text(texts[i]));
        run_scheme_cases(s, small ? tiny_cases : psac_cases);
        kvf_scheme_free(s);
    }
}

typedef struct { const char *text; run_case c; } text_case;

/* Each scheme (Lua text) encoded on the GPU and the CPU at its shape: the
 * same bytes (compare_case on synthetic data). */
static void text_cases_agree(const text_case *cs, size_t n) {
    for (size_t i = 0; i < n; i++) {
        kvf_scheme *s = exact(tu_scheme_text(cs[i].text));
        kvf_context *gpu, *cpu;
        if (kvf_context_create(s, 0, &gpu)) fail_msg("%s: %s", kvf_scheme_id(s), kvf_last_error());
        assert_int_equal(kvf_context_create(s, KVF_DEVICE_CPU, &cpu), KVF_OK);
        compare_case(gpu, cpu, &cs[i].c, 1, 1);
        printf("  %s: %lld tokens x %d heads agree with the CPU reference\n", kvf_scheme_id(s),
               (long long)cs[i].c.tokens, cs[i].c.heads);
        kvf_context_destroy(gpu);
        kvf_context_destroy(cpu);
        kvf_scheme_free(s);
    }
}

/* The Lloyd sums' paths that the shipped shapes may not reach on a given GPU
 * (the token parts follow its multiprocessor count, context.c sum_parts):
 * with more heads than half the multiprocessors each head's tokens are one
 * part, so 8300 tokens take two sorting rounds (kvf_kmeans SUM_SUB = 8192);
 * with 2 centroids one cluster holds at least half of a part's tokens (100
 * or more here), so its run is cut into several 64-token units; with 128
 * centroids the first round's clusters hold about 64 tokens each, so some
 * store their sums as one unit and others take several, and the second
 * round's 108 tokens add to both kinds of row;
 * head_dim 64 and 256 (2 and 8 channels a lane); keys read the BF16 input,
 * the two-stage values the f32 workspace. */
static void gpu_kmeans_sum_shapes(void **state) {
    (void)state;
    SKIP_WITHOUT_GPU();
    const int sms = sm_count();
    const text_case shapes[] = {
        {"return { base = 'qvg_int2', name = 'sum_d64', head_dim = 64, key = { centroids = 2 }, "
         "value = { centroids = 2 } }", {small ? 40 : 8300, small ? 2 : sms / 2 + 1, 0, 0}},
        {"return { base = 'qvg_int2', name = 'sum_d64_c128', head_dim = 64, key = { centroids = 128 }, "
         "value = { centroids = 128 } }", {small ? 40 : 8300, small ? 2 : sms / 2 + 1, 0, 0}},
        {"return { base = 'qvg_int2', name = 'sum_d256', head_dim = 256, key = { centroids = 2 }, "
         "value = { centroids = 2, stages = 2 } }", {small ? 40 : 600, 2, 1, 0}},
    };
    text_cases_agree(shapes, sizeof shapes / sizeof shapes[0]);
}

/* kmeans_labels = "final" with the plain nearest centroid (the shipped schemes
 * take the last Lloyd step's labels, or QSAC for quantwm's keys): the final
 * assignment over the BF16 input (keys) and, with two stages, over the f32
 * workspace (values); and one Lloyd step, whose assignment is then the
 * labels' ("last_step"), beside a final one on the other tensor. 16
 * centroids, so that even KVF_TEST_SMALL's 40 tokens are not each their own
 * centroid (where both label sources agree); test_methods shows the two
 * sources giving different labels on the CPU, which the GPU matches. */
static void gpu_kmeans_labels(void **state) {
    (void)state;
    SKIP_WITHOUT_GPU();
    const text_case cases[] = {
        {"return { base = 'qvg_int2', name = 'final', key = { centroids = 16, kmeans_labels = 'final' }, "
         "value = { centroids = 16, kmeans_labels = 'final', stages = 2 } }", {small ? 40 : 3000, small ? 2 : 5, 1, 0}},
        {"return { base = 'qvg_int2', name = 'one_step', key = { centroids = 16, kmeans_iters = 1 }, "
         "value = { centroids = 16, kmeans_iters = 1, kmeans_labels = 'final' } }", {small ? 40 : 3000, small ? 2 : 5, 1, 0}},
    };
    if (!selected("kmeans_labels")) return;
    text_cases_agree(cases, sizeof cases / sizeof cases[0]);
}

/* The assignments' blocks take equal ranges of all heads' (head, 16-token
 * tile) pairs, about one block a multiprocessor (context.c kmeans_stage).
 * With more heads than multiprocessors and a few tiles a head, a block
 * stages two or three heads in turn (700 tokens) and its first and last head
 * are partial (KVF_TEST_SMALL: 2 tiles a head, one or two heads a block, so
 * racecheck sees the head loop's barriers): QSAC for the keys, the plain
 * nearest for the values. */
static void gpu_assign_ranges(void **state) {
    (void)state;
    SKIP_WITHOUT_GPU();
    const int sms = sm_count();
    const text_case cases[] = {
        {"return { base = 'quantwm_int2', name = 'ranges' }", {small ? 20 : 700, sms + 8, 0, 0}},
    };
    if (!selected("assign_ranges")) return;
    text_cases_agree(cases, sizeof cases / sizeof cases[0]);
}

/* An sm_80 image (PTX for compute_80, which the driver compiles for this
 * GPU): its k-means assignment takes the block geometry of sm_80's 163 KiB of
 * shared memory (12 warps for the plain assignment at head_dim 128, 9 for
 * QSAC, 3 at head_dim 256, instead of sm_90's 16, 16 and 4), and must agree
 * with the CPU as sm_90's does (KVF_TEST_SMALL: tiny_cases[0] for each
 * scheme instead of these shapes). The first case (300 tokens x 3 heads) gives
 * each warp one tile; the second has more heads than multiprocessors, so
 * each block stages two or three heads in turn and its warps loop over their
 * tiles W apart. On a device with
 * less shared memory than sm_80 (sm_86/89/12x) the image is refused instead. */
static void gpu_sm80_geometry(void **state) {
    (void)state;
    SKIP_WITHOUT_GPU();
    const int sms = sm_count();
    int optin = 0;
    CK(cuDeviceGetAttribute(&optin, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev));
    const struct { const char *text; run_case c; } shapes[] = {
        {"return { base = 'quantwm_int2', name = 'wm_sm80' }", {300, 3, 1, 0}},
        {"return { base = 'quantwm_int2', name = 'wm16_sm80', key = { centroids = 16 }, value = { centroids = 16 } }",
         {400, sms + 8, 0, 0}},
        {"return { base = 'qvg_int2', name = 'qvg_d256_sm80', head_dim = 256, key = { centroids = 40 }, "
         "value = { centroids = 40 } }",
         {300, sms + 8, 1, 0}},
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        kvf_scheme *s = exact(tu_scheme_text(shapes[i].text));
        void *image = NULL;
        size_t size = 0;
        const char *origin;
        if (kvf_jit_image(s, "compute_80", 1, &image, &size, &origin))
            fail_msg("%s: %s", kvf_scheme_id(s), kvf_last_error());
        kvf_context *gpu, *cpu;
        int rc = kvf_context_create_from_image(kvf_scheme_canonical(s), image, size, 0, &gpu);
        free(image);
        enum { SM80_OPTIN = 166912 }; /* kvf_kmeans smem_optin_bytes for sm_80: 163 KiB */
        if (optin < SM80_OPTIN) {
            assert_int_equal(rc, KVF_ENOTIMPL);
            assert_non_null(strstr(kvf_last_error(), "bytes of shared memory per block"));
            printf("  %s: compute_80 image refused on a device with %d bytes a block\n", kvf_scheme_id(s), optin);
            kvf_scheme_free(s);
            continue;
        }
        if (rc) fail_msg("%s from compute_80 PTX: %s", kvf_scheme_id(s), kvf_last_error());
        assert_int_equal(kvf_context_create(s, KVF_DEVICE_CPU, &cpu), KVF_OK);
        const run_case c = small ? tiny_cases[0] : shapes[i].c;
        compare_case(gpu, cpu, &c, 0, 1);
        compare_case(gpu, cpu, &c, 1, 0);
        printf("  %s (compute_80 PTX on %s): %lld tokens x %d heads agree with the CPU reference\n", kvf_scheme_id(s),
               kvf_context_backend(gpu), (long long)c.tokens, c.heads);
        kvf_context_destroy(gpu);
        kvf_context_destroy(cpu);
        kvf_scheme_free(s);
    }
}

/* An image whose assignment asks for more shared memory than any device
 * allows (its assign_cfg patched in the PTX: the plain assignment's bytes
 * times 2^16 and more) is refused on load, saying what it needs: the check the
 * arch table relies on for devices it does not know. */
static void oversized_assignment_refused(void **state) {
    (void)state;
    SKIP_WITHOUT_GPU();
    kvf_scheme *s = tu_scheme("qvg_int2");
    void *image = NULL;
    size_t size = 0;
    const char *origin;
    assert_int_equal(kvf_jit_image(s, "compute_90", 1, &image, &size, &origin), KVF_OK);
    char *cfg = strstr((char *)image, "_k_assign_cfg[36] = {");
    assert_non_null(cfg);
    char *third = strchr(strchr(strchr(cfg, '{') + 1, ',') + 1, ','); /* ", B2," of bytes B0, B1, B2, B3 */
    assert_non_null(third);
    third += 2;
    assert_true(third[0] >= '0' && third[0] <= '9' && third[1] == ','); /* one digit: B2 < 10 */
    third[0] = '9';                                                      /* >= 9 * 2^16 bytes */
    kvf_context *bad = NULL;
    assert_int_equal(kvf_context_create_from_image(kvf_scheme_canonical(s), image, size, 0, &bad), KVF_ENOTIMPL);
    assert_null(bad);
    assert_non_null(strstr(kvf_last_error(), "bytes of shared memory per block, device 0"));
    free(image);
    kvf_scheme_free(s);
}

/* Query statistics updated on the GPU into a host copy. */
static void gpu_qstats_run(kvf_context *gpu, CUdeviceptr dqs, size_t bytes, int heads, uint16_t *const *chunks,
                           const int64_t *n, int n_chunks, int hq, int d, uint8_t *back) {
    assert_int_equal(kvf_qstats_init(gpu, (void *)dqs, bytes, heads, NULL), KVF_OK);
    for (int i = 0; i < n_chunks; i++) {
        if (n[i] == 0) continue;
        size_t qb = (size_t)n[i] * hq * d * 2;
        CUdeviceptr dq = dalloc(qb, 0);
        CK(cuMemcpyHtoD(dq, chunks[i], qb));
        kvf_shape sh = {n[i], hq, 0, 0};
        assert_int_equal(kvf_qstats_update(gpu, (void *)dqs, bytes, (void *)dq, &sh, NULL), KVF_OK);
        CK(cuCtxSynchronize());
        cu->cuMemFree(dq);
    }
    CK(cuMemcpyDtoH(back, dqs, bytes));
}

/* NaN/Inf in the queries, on the GPU (tests/test_faults.c's
 * test_nan_inf_queries_skipped is the CPU side): the GPU statistics equal the
 * CPU's (header with the skipped count, counts and sums bit for bit; the basis
 * as in qstats_prepare) and, byte for byte, the GPU statistics of the chunks
 * without the lost tokens; an encode with either writes the same bytes. */
static void gpu_qstats_nonfinite(void **state) {
    (void)state;
    SKIP_WITHOUT_GPU();
    kvf_scheme *s = tu_scheme("quantwm_int2");
    kvf_context *gpu, *cpu;
    assert_int_equal(kvf_context_create(s, 0, &gpu), KVF_OK);
    assert_int_equal(kvf_context_create(s, KVF_DEVICE_CPU, &cpu), KVF_OK);
    const int64_t n = 40;
    const int hk = 2, hq = 4, d = kvf_scheme_head_dim(s);
    kvf_qstats_layout l;
    assert_int_equal(kvf_qstats_layout_compute(s, hk, &l), KVF_OK);
    const size_t bytes = l.total_bytes, elems = (size_t)hq * n * d;
    uint16_t *bad[2], *clean[2], *kept[2];
    unsigned char *drop[2];
    uint64_t rows = 0;
    for (int i = 0; i < 2; i++) {
        bad[i] = malloc(elems * 2), clean[i] = malloc(elems * 2), kept[i] = malloc(elems * 2);
        drop[i] = malloc((size_t)hk * n);
        rows += tu_nonfinite_queries(bad[i], n, hq, hk, d, 60 + i, i, drop[i]);
        tu_synth_kv(clean[i], n, hq, d, 60 + i);
    }
    uint8_t *got = malloc(bytes), *want = malloc(bytes), *ref = malloc(bytes), *host = malloc(bytes);
    CUdeviceptr dqs = dalloc(bytes, 0xee);
    const int64_t full[2] = {n, n};
    gpu_qstats_run(gpu, dqs, bytes, hk, bad, full, 2, hq, d, got);
    /* The CPU on the same chunks. */
    assert_int_equal(kvf_qstats_init(cpu, host, bytes, hk, NULL), KVF_OK);
    kvf_shape sh = {n, hq, 0, 0};
    for (int i = 0; i < 2; i++) assert_int_equal(kvf_qstats_update(cpu, host, bytes, bad[i], &sh, NULL), KVF_OK);
    assert_memory_equal(got, host, l.msum_off); /* header (skipped count) and counts */
    assert_memory_equal(got + l.msum_off, host + l.msum_off, (size_t)hk * d * d * 4);
    double worst = projector_diff(got, host, &l);
    assert_true(worst < 1e-3);
    uint64_t skipped = 0;
    assert_int_equal(kvf_qstats_skipped(got, 64, &skipped), KVF_OK);
    assert_int_equal(skipped, rows);
    /* Per KV head, the GPU on the clean chunks without the tokens it lost. */
    for (int h = 0; h < hk; h++) {
        int64_t nk[2];
        for (int i = 0; i < 2; i++) nk[i] = tu_drop_tokens(clean[i], n, hq, d, drop[i] + h * n, kept[i]);
        gpu_qstats_run(gpu, dqs, bytes, hk, kept, nk, 2, hq, d, ref);
        if (h == 0) memcpy(want, ref, bytes);
        else tu_qstats_copy_head(want, ref, &l, h);
    }
    memcpy(want + 24, &rows, 8);
    assert_memory_equal(got, want, bytes);
    printf("  %llu NaN/Inf query rows skipped; statistics equal those without them (GPU), and the CPU's "
           "(projector max |diff| %.2e)\n", (unsigned long long)rows, worst);
    /* Encodes reading either: the same bytes. */
    const int64_t nt = small ? 40 : 300;
    size_t pb, kvn = (size_t)nt * hk * d;
    assert_int_equal(kvf_packed_size(s, nt, hk, &pb), KVF_OK);
    uint16_t *k = malloc(kvn * 2), *v = malloc(kvn * 2);
    random_bf16(k, kvn, 70), random_bf16(v, kvn, 71);
    CUdeviceptr dk = dalloc(kvn * 2, 0), dv = dalloc(kvn * 2, 0), dp = dalloc(pb, 0x11), dw = dalloc(bytes, 0);
    CK(cuMemcpyHtoD(dk, k, kvn * 2));
    CK(cuMemcpyHtoD(dv, v, kvn * 2));
    CK(cuMemcpyHtoD(dqs, got, bytes));
    CK(cuMemcpyHtoD(dw, want, bytes));
    uint8_t *p1 = malloc(pb), *p2 = malloc(pb);
    kvf_shape ksh = {nt, hk, 0, 0};
    assert_int_equal(kvf_encode(gpu, (void *)dk, (void *)dv, &ksh, (void *)dqs, (void *)dp, pb, NULL), KVF_OK);
    CK(cuCtxSynchronize());
    CK(cuMemcpyDtoH(p1, dp, pb));
    CK(cuMemsetD8(dp, 0x11, pb));
    assert_int_equal(kvf_encode(gpu, (void *)dk, (void *)dv, &ksh, (void *)dw, (void *)dp, pb, NULL), KVF_OK);
    CK(cuCtxSynchronize());
    CK(cuMemcpyDtoH(p2, dp, pb));
    assert_memory_equal(p1, p2, pb);
    cu->cuMemFree(dk); cu->cuMemFree(dv); cu->cuMemFree(dp); cu->cuMemFree(dw); cu->cuMemFree(dqs);
    free(k), free(v), free(p1), free(p2), free(got), free(want), free(ref), free(host);
    for (int i = 0; i < 2; i++) free(bad[i]), free(clean[i]), free(kept[i]), free(drop[i]);
    kvf_context_destroy(gpu);
    kvf_context_destroy(cpu);
    kvf_scheme_free(s);
}

/* ------------------------------------------------------- special values */

static uint64_t sv_next(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return *s >> 16;
}

/* f16 patterns for scales, offsets and coefficient scales: zeros of both
 * signs, infinities, NaNs with payloads, subnormals, the largest finite, and
 * plain random bits (3 in 4). */
static uint16_t sv_f16(uint64_t *s) {
    static const uint16_t sp[] = {0x0000, 0x8000, 0x7c00, 0xfc00, 0x7e00, 0xfe01, 0x7c01, 0x0001, 0x83ff,
                                  0x7bff, 0xfbff, 0x3c00, 0x1c00, 0x0400};
    uint64_t r = sv_next(s);
    return (r & 3) ? (uint16_t)(r >> 8) : sp[(r >> 8) % (sizeof sp / sizeof sp[0])];
}

/* bf16 patterns for centroids (and the upper halves of PSAC basis scales):
 * subnormals (1 in 8), zeros, infinities, NaNs, the largest finite, random bits. */
static uint16_t sv_bf16(uint64_t *s) {
    static const uint16_t sp[] = {0x0000, 0x8000, 0x7f80, 0xff80, 0x7fc1, 0xffff, 0x7f7f, 0xff7f, 0x3f80, 0x0080};
    uint64_t r = sv_next(s);
    if ((r & 7) == 0) return (uint16_t)((r >> 8) & 0x807f); /* subnormal or zero */
    if ((r & 7) == 1) return sp[(r >> 8) % (sizeof sp / sizeof sp[0])];
    return (uint16_t)(r >> 8);
}

/* what: 0 random bytes, 1 fp16, 2 bf16, 3 f32 (a special bf16 with random low bits). */
static void sv_fill(uint8_t *p, size_t off, size_t bytes, int what, uint64_t *s) {
    const size_t step = what == 0 ? 1 : what == 3 ? 4 : 2;
    for (size_t i = 0; i + step <= bytes; i += step) {
        if (what == 0) p[off + i] = (uint8_t)sv_next(s);
        else if (what == 3) {
            uint32_t hi = sv_bf16(s), lo = (uint32_t)(sv_next(s) & 0xffffu); /* in this order */
            uint32_t v = hi << 16 | lo;
            memcpy(p + off + i, &v, 4);
        } else {
            uint16_t v = what == 1 ? sv_f16(s) : sv_bf16(s);
            memcpy(p + off + i, &v, 2);
        }
    }
}

/* A packed buffer of hostile plane contents: every plane random or special. */
static void sv_packed(const kvf_scheme *s, const kvf_layout *l, uint8_t *p, uint64_t seed) {
    kvf_packed_header hdr;
    kvf_header_fill(s, l, &hdr);
    memset(p, 0, l->total_bytes);
    memcpy(p, &hdr, sizeof hdr);
    uint64_t r = seed;
    const kvf_section_layout *secs[2] = {&l->key, &l->value};
    for (int t = 0; t < 2; t++) {
        const kvf_section_layout *c = secs[t];
        int int8 = c->scale_format == KVF_SCALE_INT8_FP16;
        for (int st = 0; st < c->stages || st == 0; st++) {
            const kvf_stage_layout *g = &c->stage[st];
            sv_fill(p, g->codes_off, g->codes_bytes, c->bits == 16 ? 2 : 0, &r);
            sv_fill(p, g->scales_off, g->scales_bytes, int8 ? 0 : 1, &r);
            sv_fill(p, g->zeros_off, g->zeros_bytes, int8 ? 0 : 1, &r);
            sv_fill(p, g->tscales_off, g->tscales_bytes, 1, &r);
            for (size_t i = 0; i < g->index_bytes; i++) p[g->index_off + i] = (uint8_t)(sv_next(&r) % (uint64_t)c->centroids);
            sv_fill(p, g->centroids_off, g->centroids_bytes, 2, &r);
        }
        sv_fill(p, c->basis_off, c->basis_bytes, 0, &r); /* int8 codes, -128 included */
        sv_fill(p, c->bscale_off, c->bscale_bytes, 3, &r);
        sv_fill(p, c->coef_off, c->coef_bytes, 0, &r);
        sv_fill(p, c->cscale_off, c->cscale_bytes, 1, &r);
        /* Basis scales of heads 0..5 (of every 7): NaN, +Inf, the largest
         * finite, +0, -0, the smallest subnormal; head 2's token 1 also gets
         * the largest coefficient scale, so cs * s overflows to Inf. */
        static const uint32_t special_scale[6] = {0x7fc00001u, 0x7f800000u, 0x7f7fffffu, 0u, 0x80000000u, 1u};
        for (size_t h = 0; h * 4 < c->bscale_bytes; h++)
            if (h % 7 < 6) memcpy(p + c->bscale_off + h * 4, &special_scale[h % 7], 4);
        if (c->bscale_bytes >= 12 && l->n_tokens > 1) {
            const uint16_t big = 0x7bff; /* 65504 */
            memcpy(p + c->cscale_off + ((size_t)2 * l->n_tokens + 1) * 2, &big, 2);
        }
        if (c->bits == 16) continue;
        /* Every 5th token of head 0: zero scales and offsets, so r_hat = 0 and
         * the centroid sum comes out alone (bf16 subnormals, -0 + 0). With
         * two stages or more, every 7th token of head 0 sums the largest
         * bf16 and 2^119 in stages 0 and 1 (centroid row 0): exactly half an
         * ulp past the largest finite, which rounds to Inf. */
        for (int64_t tk = 0; tk < l->n_tokens; tk++) {
            const kvf_stage_layout *g = &c->stage[0];
            if (tk % 5 == 0 && c->axis != KVF_AXIS_TOKEN) {
                size_t gpt = (size_t)c->groups_per_token, eb = int8 ? 1 : 2;
                memset(p + g->scales_off + (size_t)tk * gpt * eb, 0, gpt * eb);
                if (g->zeros_bytes) memset(p + g->zeros_off + (size_t)tk * gpt * eb, 0, gpt * eb);
                if (c->cscale_bytes) memset(p + c->cscale_off + (size_t)tk * 2, 0, 2);
            }
            if (tk % 7 == 0 && c->centroids > 0 && c->stages >= 2 && c->axis != KVF_AXIS_TOKEN) {
                size_t gpt = (size_t)c->groups_per_token, eb = int8 ? 1 : 2;
                memset(p + g->scales_off + (size_t)tk * gpt * eb, 0, gpt * eb);
                if (g->zeros_bytes) memset(p + g->zeros_off + (size_t)tk * gpt * eb, 0, gpt * eb);
                if (c->cscale_bytes) memset(p + c->cscale_off + (size_t)tk * 2, 0, 2);
                for (int st = 0; st < c->stages; st++) p[c->stage[st].index_off + tk] = 0;
                for (int st = 0; st < c->stages; st++)
                    for (int ch = 0; ch < l->head_dim; ch++) {
                        uint16_t v = st == 0 ? 0x7f7f : st == 1 ? 0x7b00 : 0x0000;
                        memcpy(p + c->stage[st].centroids_off + (size_t)ch * 2, &v, 2);
                    }
            }
        }
    }
}

/* Decode a host copy of a packed cache on the GPU (outputs first filled with
 * 0x33) and copy K and V (n elements each) back to host. */
static void gpu_decode_host(kvf_context *gpu, const uint8_t *packed, size_t bytes, const kvf_shape *sh, size_t n,
                            uint16_t *k, uint16_t *v) {
    CUdeviceptr dp = dalloc(bytes, 0), dk = dalloc(n * 2, 0x33), dv = dalloc(n * 2, 0x33);
    CK(cuMemcpyHtoD(dp, packed, bytes));
    assert_int_equal(kvf_decode(gpu, (void *)dp, bytes, sh, NULL, (void *)dk, (void *)dv, NULL), KVF_OK);
    CK(cuCtxSynchronize());
    CK(cuMemcpyDtoH(k, dk, n * 2));
    CK(cuMemcpyDtoH(v, dv, n * 2));
    cu->cuMemFree(dp); cu->cuMemFree(dk); cu->cuMemFree(dv);
}

/* Decode of hostile packed bytes: NaN and Inf scales, offsets, centroids and
 * basis entries, subnormals, signed zeros, rounding ties and overflow to Inf
 * in the bf16 output. The GPU (hardware cvt.rn.bf16x2 + NaN fix) must give the
 * CPU reference's bits for every element. */
static void sv_case(kvf_scheme *s, int64_t tokens, int heads, uint64_t seed) {
    kvf_context *gpu, *cpu;
    if (kvf_context_create(s, 0, &gpu)) fail_msg("%s: %s", kvf_scheme_id(s), kvf_last_error());
    assert_int_equal(kvf_context_create(s, KVF_DEVICE_CPU, &cpu), KVF_OK);
    kvf_layout l;
    assert_int_equal(kvf_layout_compute(s, tokens, heads, &l), KVF_OK);
    int d = l.head_dim;
    size_t n = (size_t)tokens * heads * d;
    uint8_t *pk = malloc(l.total_bytes);
    uint16_t *kc = malloc(n * 2), *vc = malloc(n * 2), *kg = malloc(n * 2), *vg = malloc(n * 2);
    sv_packed(s, &l, pk, seed);
    kvf_shape sh = {tokens, heads, 0, 0};
    assert_int_equal(kvf_decode(cpu, pk, l.total_bytes, &sh, NULL, kc, vc, NULL), KVF_OK);
    gpu_decode_host(gpu, pk, l.total_bytes, &sh, n, kg, vg);
    size_t kind[5] = {0}, differ = 0; /* NaN, Inf, subnormal, -0, other */
    for (int t = 0; t < 2; t++) {
        const uint16_t *a = t ? vg : kg, *b = t ? vc : kc;
        /* Bits 16 without RoPE give the stored bits back unchanged (METHODS.md 9). */
        const kvf_tensor_cfg *c = t ? &s->value : &s->key;
        const int raw = c->bits == 16 && !(t == 0 && s->rope.placement == KVF_ROPE_PRE);
        for (size_t i = 0; i < n; i++) {
            uint16_t x = b[i], e = x & 0x7f80u, m = x & 0x7fu;
            kind[e == 0x7f80u && m ? 0 : e == 0x7f80u ? 1 : e == 0 && m ? 2 : x == 0x8000u ? 3 : 4]++;
            if (e == 0x7f80u && m && !raw) assert_int_equal(x, 0x7fc0); /* the CPU's canonical NaN */
            if (a[i] != b[i]) {
                if (differ < 5)
                    printf("  %s element %zu: GPU %04x, CPU %04x\n", t ? "V" : "K", i, a[i], b[i]);
                differ++;
            }
        }
    }
    printf("  %s %lld x %d: NaN %zu, Inf %zu, subnormal %zu, -0 %zu, other %zu; differing %zu\n", kvf_scheme_id(s),
           (long long)tokens, heads, kind[0], kind[1], kind[2], kind[3], kind[4], differ);
    assert_int_equal(differ, 0);
    /* The cases were hit: NaNs always; Infs where a stored value can be Inf
     * and survive (not FP8 RTN rows: E4M3 has no Inf; not rotated symmetric
     * rows: an Inf scale's zero level is NaN, which the inverse rotation
     * spreads over the row). */
    const int fp8_rows = !s->key.centroids && !s->value.centroids && s->key.scale_format == KVF_SCALE_FP8 &&
                         s->value.scale_format == KVF_SCALE_FP8;
    const int rotated_sym = s->key.rotation && s->key.mode != KVF_MODE_AFFINE;
    if (tokens > 1) assert_true(kind[0] > 0 && (kind[1] > 0 || fp8_rows || rotated_sym));
    free(pk); free(kc); free(vc); free(kg); free(vg);
    kvf_context_destroy(gpu);
    kvf_context_destroy(cpu);
}

static void decode_special_values(void **state) {
    (void)state;
    SKIP_WITHOUT_GPU();
    /* Symmetric and 8-bit codes, and bits 16, beside the shipped schemes. */
    static const struct { const char *text; int heads; } extra[] = {
        {"return { base = 'kivi_int2', name = 'sv_sym', key = { mode = 'symmetric', bits = 4, group_size = 16 }, "
         "value = { mode = 'symmetric', bits = 8, group_size = 16 } }", 3},
        /* 8 heads: every special basis scale (sv_packed) */
        {"return { base = 'quantwm_int2', name = 'sv_wm', head_dim = 64, key = { mode = 'symmetric', bits = 8, psac_rank = 16 }, "
         "value = { stages = 3, bits = 4 } }", 8},
        {"return { base = 'rtn_int2', name = 'sv_bf16', key = { bits = 16 }, value = { bits = 4 } }", 3},
    };
    for (const char *const *name = kvf_builtin_schemes(); *name; name++) {
        if (!selected(*name)) continue;
        kvf_scheme *s = tu_scheme(*name);
        sv_case(s, 203, 3, 1);
        sv_case(s, 1, 1, 2);
        kvf_scheme_free(s);
    }
    for (size_t i = 0; i < sizeof extra / sizeof extra[0]; i++) {
        kvf_scheme *s = tu_scheme_text(extra[i].text);
        sv_case(s, 203, extra[i].heads, 3);
        kvf_scheme_free(s);
    }
}

/* Ternary codes (mode "ternary": 8 codes in a 13-bit field, packed across a
 * row's lanes by shuffles) on every encode path and lane shape: the rows
 * path with fp16 and FP8 scales and rotated, head_dim 64 (13-byte rows, odd)
 * and 256 (a row is a whole warp), two-level scales (16 channels a decode
 * lane), and the k-means path with QSAC and with progressive stages. */
static void gpu_ternary(void **state) {
    (void)state;
    SKIP_WITHOUT_GPU();
    const char *texts[] = {
        "return { base = 'rtn_int2', name = 't_rtn', key = { mode = 'ternary' }, "
        "value = { mode = 'ternary', scale_format = 'fp8', group_size = 32 } }",
        "return { base = 'quarot_int2', name = 't_rot', key = { mode = 'ternary' }, value = { mode = 'ternary' } }",
        "return { base = 'rtn_int2', name = 't_d64', head_dim = 64, key = { mode = 'ternary', group_size = 16 }, "
        "value = { mode = 'ternary', scale_format = 'int8_fp16', group_size = 16 } }",
        "return { base = 'rtn_int2', name = 't_d256', head_dim = 256, key = { mode = 'ternary', scale_format = 'fp8' }, "
        "value = { mode = 'ternary', scale_format = 'int8_fp16' } }",
        "return { base = 'quantwm_int2', name = 't_wm', key = { mode = 'ternary', psac_rank = 0 }, "
        "value = { mode = 'ternary' } }",
        "return { base = 'qvg_pro_int2', name = 't_pro', key = { mode = 'ternary' }, value = { mode = 'ternary' } }",
    };
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
        kvf_scheme *s = exact(tu_scheme_text(texts[i]));
        run_scheme(s);
        sv_case(s, 203, 3, 4);
        kvf_scheme_free(s);
    }
}

/* A corrupt cache's centroid index past a 16-row table (the CPU decode
 * refuses it, test_faults.c): the GPU decode reads the table's last row
 * instead of past it, so it gives the CPU's decode of the same cache with
 * those indices set to 15. Head 1 is the last head: past its table lie the
 * other planes, then the end of the buffer. */
static void gpu_corrupt_centroid_index(void **state) {
    (void)state;
    SKIP_WITHOUT_GPU();
    kvf_scheme *s = tu_scheme_text("return { base = 'qvg_int2', name = 'qvg16', key = { centroids = 16 }, "
                                   "value = { centroids = 16, stages = 2 } }");
    kvf_context *gpu, *cpu;
    if (kvf_context_create(s, 0, &gpu)) fail_msg("%s", kvf_last_error());
    assert_int_equal(kvf_context_create(s, KVF_DEVICE_CPU, &cpu), KVF_OK);
    const int64_t tokens = 40;
    const int heads = 2;
    kvf_layout l;
    assert_int_equal(kvf_layout_compute(s, tokens, heads, &l), KVF_OK);
    const size_t n = (size_t)tokens * heads * l.head_dim;
    uint16_t *k = malloc(n * 2), *v = malloc(n * 2), *kc = malloc(n * 2), *vc = malloc(n * 2), *kg = malloc(n * 2),
             *vg = malloc(n * 2);
    uint8_t *bad = malloc(l.total_bytes), *last = malloc(l.total_bytes);
    random_bf16(k, n, 5);
    random_bf16(v, n, 6);
    kvf_shape sh = {tokens, heads, 0, 0};
    assert_int_equal(kvf_encode(cpu, k, v, &sh, NULL, bad, l.total_bytes, NULL), KVF_OK);
    const struct { size_t off; uint8_t index; } corrupt[] = {
        {l.key.stage[0].index_off + tokens + 7, 16},
        {l.key.stage[0].index_off + tokens + 9, 255},
        {l.value.stage[1].index_off + tokens + 3, 200},
        {l.value.stage[0].index_off + 0, 17},
    };
    memcpy(last, bad, l.total_bytes);
    for (size_t i = 0; i < sizeof corrupt / sizeof corrupt[0]; i++) {
        bad[corrupt[i].off] = corrupt[i].index;
        last[corrupt[i].off] = 15;
    }
    assert_int_equal(kvf_decode(cpu, bad, l.total_bytes, &sh, NULL, kc, vc, NULL), KVF_EFORMAT);
    assert_int_equal(kvf_decode(cpu, last, l.total_bytes, &sh, NULL, kc, vc, NULL), KVF_OK);
    gpu_decode_host(gpu, bad, l.total_bytes, &sh, n, kg, vg);
    assert_memory_equal(kg, kc, n * 2);
    assert_memory_equal(vg, vc, n * 2);
    printf("  corrupt centroid indices 16, 255, 200, 17 of 16: the GPU decodes the last row, as the CPU with 15\n");
    free(k); free(v); free(kc); free(vc); free(kg); free(vg); free(bad); free(last);
    kvf_context_destroy(gpu);
    kvf_context_destroy(cpu);
    kvf_scheme_free(s);
}

static double ms_since(const struct timespec *t0) {
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (t1.tv_sec - t0->tv_sec) * 1e3 + (t1.tv_nsec - t0->tv_nsec) / 1e6;
}

static void context_from_cache_and_image(void **state) {
    (void)state;
    SKIP_WITHOUT_GPU();
    kvf_scheme *s = tu_scheme("rtn_int4");
    kvf_context *a, *b, *img_ctx, *cpu;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    assert_int_equal(kvf_context_create(s, 0, &a), KVF_OK);
    double cold = ms_since(&t0);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    assert_int_equal(kvf_context_create(s, 0, &b), KVF_OK);
    double warm = ms_since(&t0);
    printf("context create: %s %.1f ms, then %s %.1f ms\n", kvf_context_origin(a), cold, kvf_context_origin(b), warm);
    assert_string_equal(kvf_context_origin(b), "disk-cache");
    /* A precompiled image loads with no NVRTC involved. */
    void *image;
    size_t size;
    const char *origin;
    assert_int_equal(kvf_jit_image(s, kvf_context_backend(a), 0, &image, &size, &origin), KVF_OK);
    assert_int_equal(kvf_context_create_from_image(kvf_scheme_canonical(s), image, size, 0, &img_ctx), KVF_OK);
    assert_string_equal(kvf_context_origin(img_ctx), "image");
    assert_int_equal(kvf_context_create(s, KVF_DEVICE_CPU, &cpu), KVF_OK);
    run_case c = {small ? 40 : 300, 2, 0, 0};
    compare_case(img_ctx, cpu, &c, 1, 0);
    /* An image of another scheme is refused by name. */
    kvf_scheme *other = tu_scheme("rtn_int2");
    kvf_context *bad;
    assert_int_equal(kvf_context_create_from_image(kvf_scheme_canonical(other), image, size, 0, &bad), KVF_ECUDA);
    assert_non_null(strstr(kvf_last_error(), "not in the image"));
    free(image);
    /* An image of another packed format (its PTX with kvf_format_version 1),
     * or of a kvforge from before the version global, is refused. */
    assert_int_equal(kvf_jit_image(s, kvf_context_backend(a), 1, &image, &size, &origin), KVF_OK);
    char *ver = strstr((char *)image, "kvf_format_version = 2;");
    assert_non_null(ver);
    ver[strlen("kvf_format_version = ")] = '1';
    assert_int_equal(kvf_context_create_from_image(kvf_scheme_canonical(s), image, size, 0, &bad), KVF_EFORMAT);
    assert_non_null(strstr(kvf_last_error(), "implements packed format version 1, this library reads version 2"));
    ver[strlen("kvf_format_versio")] = 'm'; /* the global renamed away */
    assert_int_equal(kvf_context_create_from_image(kvf_scheme_canonical(s), image, size, 0, &bad), KVF_EFORMAT);
    assert_non_null(strstr(kvf_last_error(), "has no kvf_format_version"));
    ver[strlen("kvf_format_versio")] = 'n';
    ver[strlen("kvf_format_version = ")] = '2';
    /* Launched otherwise (an image made with another templates/kvf_abi.h),
     * or from before that global: refused too. */
    char want[128];
    const unsigned abi_now = kvf_kernel_abi(), abi_other = abi_now ^ 1u; /* one digit differs in the PTX's decimal */
    snprintf(want, sizeof want, "kvf_kernel_abi = %u;", abi_now);
    char *abi = strstr((char *)image, want);
    assert_non_null(abi);
    char digits[32];
    snprintf(digits, sizeof digits, "%u", abi_other);
    if (strlen(digits) != strlen(want) - strlen("kvf_kernel_abi = ;"))
        fail_msg("ABI %u and %u differ in length", abi_now, abi_other);
    memcpy(abi + strlen("kvf_kernel_abi = "), digits, strlen(digits));
    assert_int_equal(kvf_context_create_from_image(kvf_scheme_canonical(s), image, size, 0, &bad), KVF_EFORMAT);
    snprintf(want, sizeof want, "implements kernel interface version %u, this library launches version %u",
             abi_other, abi_now);
    assert_non_null(strstr(kvf_last_error(), want));
    abi[strlen("kvf_kernel_ab")] = 'j';
    assert_int_equal(kvf_context_create_from_image(kvf_scheme_canonical(s), image, size, 0, &bad), KVF_EFORMAT);
    assert_non_null(strstr(kvf_last_error(), "has no kvf_kernel_abi"));
    free(image);
    kvf_context_destroy(a); kvf_context_destroy(b); kvf_context_destroy(img_ctx); kvf_context_destroy(cpu);
    kvf_scheme_free(s); kvf_scheme_free(other);
}

/* kvf_encode_warm on the GPU: the same bytes as the CPU reference's warm
 * start, for the nearest centroid over the BF16 input (qvg_int2), QSAC and
 * PSAC (quantwm_int2, with statistics) and four stages over the f32
 * workspace (qvg_pro_int2; the CPU's statistics on both sides, as
 * compare_case's second encode); a previous span with fewer tokens than
 * centroids and one with more, each with a NaN in one row and an Inf in
 * another (rows the warm start does not take); and other centroids than a
 * cold start's (the warm start took). A previous span on the device that
 * overlaps the output is refused. */
static void gpu_warm_start(void **state) {
    (void)state;
    SKIP_WITHOUT_GPU();
    const char *names[] = {"qvg_int2", "quantwm_int2", "qvg_pro_int2"};
    const int heads = small ? 2 : 3;
    const int64_t n = small ? 40 : 900, prev_ns[2] = {small ? 20 : 200, small ? 40 : 1000};
    for (int i = 0; i < 3; i++) {
        if (!selected(names[i]) && !selected("warm_start")) continue;
        kvf_scheme *s = exact(tu_scheme(names[i]));
        kvf_context *gpu, *cpu;
        if (kvf_context_create(s, 0, &gpu)) fail_msg("%s: %s", names[i], kvf_last_error());
        assert_int_equal(kvf_context_create(s, KVF_DEVICE_CPU, &cpu), KVF_OK);
        const int d = kvf_scheme_head_dim(s);
        qstats_pair q = {0};
        const int stats = kvf_scheme_reads_qstats(s);
        if (stats) { /* the CPU's statistics on both sides: PSAC's basis from the same eigenvectors */
            qstats_prepare(gpu, cpu, heads, &q);
            CK(cuMemcpyHtoD(q.dev, q.host, q.bytes));
        }
        const size_t nel = (size_t)n * heads * d;
        uint16_t *k = malloc(nel * 2), *v = malloc(nel * 2);
        random_bf16(k, nel, 100 + i), random_bf16(v, nel, 200 + i);
        CUdeviceptr dk = dalloc(nel * 2, 0), dv = dalloc(nel * 2, 0);
        CK(cuMemcpyHtoD(dk, k, nel * 2));
        CK(cuMemcpyHtoD(dv, v, nel * 2));
        kvf_shape sh = {n, heads, 0, 0};
        kvf_layout L;
        assert_int_equal(kvf_layout_compute(s, n, heads, &L), KVF_OK);
        size_t bytes = L.total_bytes;
        uint8_t *pc = malloc(bytes), *pg = malloc(bytes), *cold = malloc(bytes);
        CUdeviceptr dp = dalloc(bytes, 0);
        assert_int_equal(kvf_encode(cpu, k, v, &sh, q.host, cold, bytes, NULL), KVF_OK);
        for (int pi = 0; pi < 2; pi++) {
            const int64_t pn = prev_ns[pi];
            const size_t pel = (size_t)pn * heads * d;
            uint16_t *kp = malloc(pel * 2), *vp = malloc(pel * 2);
            kvf_synth_kv(kp, pn, heads, d, 300 + pi), kvf_synth_kv(vp, pn, heads, d, 400 + pi);
            kvf_shape psh = {pn, heads, 0, 0};
            size_t pb;
            assert_int_equal(kvf_packed_size(s, pn, heads, &pb), KVF_OK);
            uint8_t *prev = malloc(pb);
            assert_int_equal(kvf_encode(cpu, kp, vp, &psh, q.host, prev, pb, NULL), KVF_OK);
            kvf_layout PL; /* a NaN in key row 1 of head 0, an Inf in value row 2 of the last head: not taken */
            assert_int_equal(kvf_layout_compute(s, pn, heads, &PL), KVF_OK);
            kvf_put_u16(prev + PL.key.stage[0].centroids_off + (size_t)(1 * d + 3) * 2, 0x7fc0);
            kvf_put_u16(prev + PL.value.stage[0].centroids_off + (((size_t)(heads - 1) * PL.value.centroids + 2) * d) * 2,
                        0x7f80);
            CUdeviceptr dprev = dalloc(pb, 0);
            CK(cuMemcpyHtoD(dprev, prev, pb));
            assert_int_equal(kvf_encode_warm(cpu, k, v, &sh, q.host, prev, pb, pn, pc, bytes, NULL), KVF_OK);
            CK(cuMemsetD8(dp, 0xa5, bytes));
            if (kvf_encode_warm(gpu, (void *)dk, (void *)dv, &sh, (void *)q.dev, (void *)dprev, pb, pn, (void *)dp, bytes,
                                NULL))
                fail_msg("%s: %s", names[i], kvf_last_error());
            CK(cuCtxSynchronize());
            CK(cuMemcpyDtoH(pg, dp, bytes));
            assert_same_stages(pg, pc, &L);
            if (L.key.psac_rank > 0) assert_same_psac(pg, pc, &L.key);
            assert_memory_not_equal(pc + L.key.stage[0].centroids_off, cold + L.key.stage[0].centroids_off,
                                    L.key.stage[0].centroids_bytes);
            printf("  %s: %lld tokens x %d heads, warm from %lld tokens: GPU = CPU, centroids not a cold start's\n",
                   kvf_scheme_id(s), (long long)n, heads, (long long)pn);
            if (pi == 0) { /* the output inside the previous span's buffer */
                assert_int_equal(kvf_encode_warm(gpu, (void *)dk, (void *)dv, &sh, NULL, (void *)dprev, pb, pn,
                                                 (void *)(dprev + 16), bytes, NULL),
                                 KVF_EINVAL);
                assert_int_equal(kvf_encode_warm(gpu, (void *)dk, (void *)dv, &sh, NULL, (void *)dprev, pb - 1, pn,
                                                 (void *)dp, bytes, NULL),
                                 KVF_ERANGE);
                /* misaligned (refused before any launch, so the size it claims is not read) */
                assert_int_equal(kvf_encode_warm(gpu, (void *)dk, (void *)dv, &sh, NULL, (void *)(dprev + 8), pb, pn,
                                                 (void *)dp, bytes, NULL),
                                 KVF_EINVAL);
                assert_non_null(strstr(kvf_last_error(), "16-byte aligned"));
            }
            free(kp), free(vp), free(prev);
            cu->cuMemFree(dprev);
        }
        free(k), free(v), free(pc), free(pg), free(cold);
        cu->cuMemFree(dk), cu->cuMemFree(dv), cu->cuMemFree(dp);
        if (stats) { free(q.host); cu->cuMemFree(q.dev); }
        kvf_context_destroy(gpu);
        kvf_context_destroy(cpu);
        kvf_scheme_free(s);
    }
}

/* ------------------------------------------------------- fast assignment */

/* The contract of the fast assignment (assign = "fast", the default;
 * docs/METHODS.md 3, "fast assignment") against the CPU reference, over all
 * the cases of a scheme together: of the index planes' entries (every
 * k-means stage of K and V), at most FAST_INDEX differ from the CPU's; each
 * tensor's reconstruction MSE (both packed buffers decoded on the CPU, against
 * the input's finite values) within FAST_MSE of the CPU's, relatively. */
#define FAST_INDEX 0.005
#define FAST_MSE 0.005

typedef struct fast_tally {
    uint64_t entries, differ; /* index plane entries, and those whose index differs */
    double sse_g[2], sse_c[2]; /* K, V: squared errors of the GPU's and the CPU's bytes, decoded */
} fast_tally;

/* Squared error of y against x over the rows of sh (d channels each) where
 * x is finite. */
static double row_sq_err(const uint16_t *x, const uint16_t *y, const kvf_shape *sh, int d) {
    double e = 0;
    for (int h = 0; h < sh->n_heads; h++)
        for (int64_t t = 0; t < sh->n_tokens; t++)
            for (int c = 0; c < d; c++) {
                const size_t i = (size_t)(t * sh->token_stride + h * sh->head_stride + c);
                const double a = kvf_bf16_to_f32(x[i]), b = kvf_bf16_to_f32(y[i]);
                if (isfinite(a)) e += (b - a) * (b - a);
            }
    return e;
}

/* Adds one case to the tally: its input k, v (n elements in sh's layout,
 * explicit strides), and the packed buffers of the GPU (pg) and the CPU (pc),
 * decoded on the CPU (pos: keys cached before RoPE, else NULL). Returns the
 * case's share of differing indices. */
static double fast_tally_add(kvf_context *cpu, const uint16_t *k, const uint16_t *v, const kvf_shape *sh, size_t n,
                             const int32_t *pos, const uint8_t *pg, const uint8_t *pc, size_t bytes, fast_tally *ft) {
    const kvf_scheme *s = kvf_context_scheme(cpu);
    const int d = kvf_scheme_head_dim(s);
    kvf_layout l;
    assert_int_equal(kvf_layout_compute(s, sh->n_tokens, sh->n_heads, &l), KVF_OK);
    const kvf_section_layout *secs[2] = {&l.key, &l.value};
    uint64_t entries = 0, differ = 0;
    for (int t = 0; t < 2; t++)
        for (int st = 0; st < secs[t]->stages && secs[t]->centroids > 0; st++) {
            const kvf_stage_layout *g = &secs[t]->stage[st];
            entries += g->index_bytes;
            differ += diff_bytes(pg, pc, g->index_off, g->index_bytes);
        }
    ft->entries += entries;
    ft->differ += differ;
    const uint16_t *in[2] = {k, v};
    uint16_t *out[2][2]; /* [GPU, CPU][K, V] */
    for (int b = 0; b < 2; b++)
        for (int t = 0; t < 2; t++) {
            out[b][t] = malloc(n * 2);
            memcpy(out[b][t], in[t], n * 2); /* rows the decode does not write: the input's */
        }
    assert_int_equal(kvf_decode(cpu, pg, bytes, sh, pos, out[0][0], out[0][1], NULL), KVF_OK);
    assert_int_equal(kvf_decode(cpu, pc, bytes, sh, pos, out[1][0], out[1][1], NULL), KVF_OK);
    for (int t = 0; t < 2; t++) {
        ft->sse_g[t] += row_sq_err(in[t], out[0][t], sh, d);
        ft->sse_c[t] += row_sq_err(in[t], out[1][t], sh, d);
    }
    for (int b = 0; b < 2; b++)
        for (int t = 0; t < 2; t++) free(out[b][t]);
    return entries ? (double)differ / (double)entries : 0.0;
}

/* The tally against the contract's bounds (label: what it gathered). */
static void fast_tally_check(const char *label, const fast_tally *ft) {
    const double share = ft->entries ? (double)ft->differ / (double)ft->entries : 0.0;
    double rel[2];
    for (int t = 0; t < 2; t++) rel[t] = ft->sse_c[t] > 0 ? (ft->sse_g[t] - ft->sse_c[t]) / ft->sse_c[t] : 0.0;
    printf("  %s: %llu of %llu indices differ from the CPU's (%.4f%%, bound %.1f%%); MSE change K %+.4f%%, "
           "V %+.4f%% (bound %.1f%%)\n",
           label, (unsigned long long)ft->differ, (unsigned long long)ft->entries, 100.0 * share, 100.0 * FAST_INDEX,
           100.0 * rel[0], 100.0 * rel[1], 100.0 * FAST_MSE);
    assert_true(ft->entries > 0);
    assert_true(share <= FAST_INDEX);
    for (int t = 0; t < 2; t++) assert_true(fabs(rel[t]) <= FAST_MSE);
}

/* One input (host k, v: n elements in sh's layout, explicit strides) encoded
 * by the fast assignment on the GPU, twice: the same bytes (the second into a
 * buffer filled otherwise), with no full scan, second filter or f64 distance
 * in its statistics. With ft, also encoded on the CPU and tallied (the CPU's
 * query statistics on both sides: PSAC then differs only where the
 * assignment does). Returns the case's share of differing indices (0 without
 * ft). */
static double fast_case(kvf_context *gpu, kvf_context *cpu, const uint16_t *k, const uint16_t *v, const kvf_shape *sh,
                        size_t n, fast_tally *ft) {
    const kvf_scheme *s = kvf_context_scheme(gpu);
    assert_int_equal(s->plan.sec[0].exact | s->plan.sec[1].exact, 0);
    const int64_t tokens = sh->n_tokens;
    const int heads = sh->n_heads;
    size_t bytes;
    assert_int_equal(kvf_packed_size(s, tokens, heads, &bytes), KVF_OK);
    kvf_layout l;
    assert_int_equal(kvf_layout_compute(s, tokens, heads, &l), KVF_OK);
    qstats_pair q = {0};
    if (kvf_scheme_reads_qstats(s)) {
        qstats_prepare(gpu, cpu, heads, &q);
        CK(cuMemcpyHtoD(q.dev, q.host, q.bytes));
    }
    uint8_t *pg = malloc(bytes), *pg2 = malloc(bytes), *pc = malloc(bytes);
    CUdeviceptr dk = dalloc(n * 2, 0), dv = dalloc(n * 2, 0), dp = dalloc(bytes, 0);
    CK(cuMemcpyHtoD(dk, k, n * 2));
    CK(cuMemcpyHtoD(dv, v, n * 2));
    unsigned long long st[2][2 * KVF_AS_N];
    assert_int_equal(kvf_context_assign_stats(gpu, 1, st), KVF_OK);
    gpu_encode(gpu, dk, dv, sh, q.dev, dp, bytes, 0xa5, pg);
    assert_int_equal(kvf_context_assign_stats(gpu, 0, st), KVF_OK);
    unsigned long long assigned = 0;
    for (int t = 0; t < 2; t++)
        for (int m = 0; m < 2; m++) {
            const unsigned long long *a = st[t] + KVF_AS_N * m;
            assert_true(a[KVF_AS_FULL] == 0 && a[KVF_AS_AGAIN] == 0 && a[KVF_AS_EXACT] == 0);
            assert_true(a[KVF_AS_CANDIDATES] >= a[KVF_AS_TOKENS]);
            assigned += a[KVF_AS_TOKENS];
        }
    assert_true(assigned > 0);
    gpu_encode(gpu, dk, dv, sh, q.dev, dp, bytes, 0x5a, pg2);
    assert_same_stages(pg2, pg, &l);
    if (l.key.psac_rank > 0) assert_same_psac(pg2, pg, &l.key);
    double share = 0;
    if (ft) {
        const int axes = kvf_rope_sections(s, NULL);
        int32_t *pos = malloc(sizeof(int32_t) * (size_t)tokens * axes);
        for (int64_t t = 0; t < tokens; t++)
            for (int a = 0; a < axes; a++) pos[t * axes + a] = (int32_t)((t / (a + 1) * 7 + a * 3) % 977);
        assert_int_equal(kvf_encode(cpu, k, v, sh, q.host, pc, bytes, NULL), KVF_OK);
        share = fast_tally_add(cpu, k, v, sh, n, s->rope.placement == KVF_ROPE_PRE ? pos : NULL, pg, pc, bytes, ft);
        free(pos);
    }
    cu->cuMemFree(dk); cu->cuMemFree(dv); cu->cuMemFree(dp);
    if (q.dev) cu->cuMemFree(q.dev);
    free(q.host);
    free(pg); free(pg2); free(pc);
    return share;
}

/* The k-means schemes with the fast assignment (their default) against the
 * CPU reference on the data sets of compare_case: synthetic and random on
 * four shapes, 16 distinct rows a head (many equal centroids: ties, which
 * both sides give to the smaller index) on the first, all under the
 * contract's bounds; NaN/Inf/huge inputs and rows near the filter's 2^125
 * guard (where the contract does not hold) give the same bytes run after run
 * as every case does. "qvg_pro2" is qvg_pro_int2 with two stages and two
 * Lloyd steps a stage (its CPU reference in a fraction of the time): its
 * second stages assign over the f32 workspace (the mma's low halves). */
static void gpu_fast_assign(void **state) {
    (void)state;
    SKIP_WITHOUT_GPU();
    static const struct { const char *name, *text; } schemes[] = {
        {"qvg_int2", NULL},
        {"qvg_int4", NULL},
        {"quantwm_int2", NULL},
        {"quantwm_int4", NULL},
        {"qvg_pro_int2", "return { base = 'qvg_pro_int2', name = 'qvg_pro2', key = { stages = 2, kmeans_iters = 2 }, "
                         "value = { stages = 2, kmeans_iters = 2 } }"},
    };
    static const run_case fast_cases[] = {{1560, 2, 0, 0}, {300, 3, 1, 0}, {37, 3, 0, 8}, {1, 1, 1, 16}};
    for (size_t i = 0; i < sizeof schemes / sizeof schemes[0]; i++) {
        if (!selected(schemes[i].name)) continue;
        kvf_scheme *s = schemes[i].text ? tu_scheme_text(schemes[i].text) : tu_scheme(schemes[i].name);
        kvf_context *gpu, *cpu;
        if (kvf_context_create(s, 0, &gpu)) fail_msg("%s: %s", kvf_scheme_id(s), kvf_last_error());
        assert_int_equal(kvf_context_create(s, KVF_DEVICE_CPU, &cpu), KVF_OK);
        printf("%s (fast assignment) on %s:\n", kvf_scheme_id(s), kvf_context_backend(gpu));
        const int d = kvf_scheme_head_dim(s);
        const run_case *cs = small ? tiny_cases : fast_cases;
        fast_tally ft = {0};
        for (int c = 0; c < 4; c++) {
            static const int sets[] = {0, 1, 4, 2, 3};
            for (int di = 0; di < 5; di++) {
                const int data = sets[di];
                if ((data == 4 || data == 2) && c != 0) continue; /* as run_scheme_cases */
                if (data == 3 && c != 2) continue;
                kvf_shape sh;
                const size_t n = tensor_elems(&cs[c], d, &sh);
                uint16_t *k = malloc(n * 2), *v = malloc(n * 2);
                fill_inputs(&cs[c], d, data, sh, n, k, v);
                const int contract = data == 0 || data == 1 || data == 4;
                const double share = fast_case(gpu, cpu, k, v, &sh, n, contract ? &ft : NULL);
                if (contract)
                    printf("  %lld tokens x %d heads, data %d: %.4f%% of indices differ\n", (long long)cs[c].tokens,
                           cs[c].heads, data, 100.0 * share);
                free(k);
                free(v);
            }
        }
        fast_tally_check(kvf_scheme_id(s), &ft);
        kvf_context_destroy(gpu);
        kvf_context_destroy(cpu);
        kvf_scheme_free(s);
    }
}

/* K and V of layer 0, chunk c of a dump ([kv_heads][N][d] in the file):
 * each head's first `tokens` rows, head-major ([kv_heads][tokens][d]). */
static void dump_chunk(const kvf_dump *dump, int c, int64_t tokens, uint16_t *k, uint16_t *v) {
    const kvf_st_tensor *tk = kvf_dump_tensor(dump, 0, c, KVF_DUMP_K), *tv = kvf_dump_tensor(dump, 0, c, KVF_DUMP_V);
    assert_non_null(tk);
    assert_non_null(tv);
    assert_true(tokens <= dump->tokens);
    const size_t d = (size_t)dump->head_dim;
    for (int h = 0; h < dump->kv_heads; h++) {
        kvf_dump_bf16(tk, (size_t)h * dump->tokens * d, (size_t)tokens * d, k + (size_t)h * tokens * d);
        kvf_dump_bf16(tv, (size_t)h * dump->tokens * d, (size_t)tokens * d, v + (size_t)h * tokens * d);
    }
}

/* The same contract on the committed world-model dump
 * (eval/worldmodel/kv_small.safetensors: real keys and values, whose
 * assignment the exact path settles with f64 distances far more often than
 * synthetic data's): each chunk of layer 0 a span, qvg_int2 and quantwm_int2. */
static void gpu_fast_assign_dump(void **state) {
    (void)state;
    SKIP_WITHOUT_GPU();
    const char *path = tu_path("eval/worldmodel/kv_small.safetensors");
    kvf_dump *dump;
    if (kvf_dump_open(path, &dump)) fail_msg("%s: %s", path, kvf_last_error());
    const char *const names[] = {"qvg_int2", "quantwm_int2"};
    for (int i = 0; i < 2; i++) {
        if (!selected(names[i])) continue;
        kvf_scheme *s = tu_scheme(names[i]);
        assert_int_equal(dump->head_dim, kvf_scheme_head_dim(s));
        kvf_context *gpu, *cpu;
        if (kvf_context_create(s, 0, &gpu)) fail_msg("%s: %s", kvf_scheme_id(s), kvf_last_error());
        assert_int_equal(kvf_context_create(s, KVF_DEVICE_CPU, &cpu), KVF_OK);
        const int d = dump->head_dim, heads = dump->kv_heads;
        const int64_t tokens = small ? 48 : dump->tokens;
        const kvf_shape sh = {tokens, heads, d, tokens * d}; /* dump_chunk's layout */
        const size_t n = (size_t)tokens * heads * d;
        fast_tally ft = {0};
        for (int c = 0; c < dump->chunks; c++) {
            uint16_t *k = malloc(n * 2), *v = malloc(n * 2);
            dump_chunk(dump, c, tokens, k, v);
            const double share = fast_case(gpu, cpu, k, v, &sh, n, &ft);
            printf("  %s chunk %d (%lld tokens x %d heads): %.4f%% of indices differ\n", path, c, (long long)tokens,
                   heads, 100.0 * share);
            free(k);
            free(v);
        }
        fast_tally_check(kvf_scheme_id(s), &ft);
        kvf_context_destroy(gpu);
        kvf_context_destroy(cpu);
        kvf_scheme_free(s);
    }
    kvf_dump_close(dump);
}

static void bad_arguments_refused(void **state) {
    (void)state;
    SKIP_WITHOUT_GPU();
    kvf_scheme *s = tu_scheme("rtn_int2");
    kvf_context *g;
    assert_int_equal(kvf_context_create(s, 0, &g), KVF_OK);
    kvf_shape sh = {64, 2, 0, 0};
    size_t bytes;
    kvf_packed_size(s, 64, 2, &bytes);
    CUdeviceptr k = dalloc(64 * 2 * 128 * 2 + 64, 0), p = dalloc(bytes + 64, 0);
    assert_int_equal(kvf_encode(g, (void *)(k + 2), (void *)k, &sh, NULL, (void *)p, bytes, NULL), KVF_EINVAL);
    assert_non_null(strstr(kvf_last_error(), "aligned"));
    assert_int_equal(kvf_encode(g, (void *)k, (void *)k, &sh, NULL, (void *)p, bytes - 1, NULL), KVF_ERANGE);
    kvf_shape odd = {64, 2, 132, 0};
    assert_int_equal(kvf_encode(g, (void *)k, (void *)k, &odd, NULL, (void *)p, bytes, NULL), KVF_EINVAL);
    kvf_context *none = (kvf_context *)1;
    assert_int_equal(kvf_context_create(s, 99, &none), KVF_ENODEV);
    assert_null(none);
    cu->cuMemFree(k); cu->cuMemFree(p);
    kvf_context_destroy(g);
    kvf_scheme_free(s);
}

/* ------------------------------------------------------------ the pipeline */

/* Planes of a section that both sides write (padding between them is not). */
static size_t pipe_plane_diffs(const kvf_section_layout *l, const uint8_t *a, const uint8_t *b) {
    size_t k = 0;
    const kvf_stage_layout *st = &l->stage[0];
    const size_t off[] = {st->codes_off, st->scales_off, st->tscales_off, st->zeros_off, st->index_off,
                          st->centroids_off, l->oidx_off, l->oval_off, l->mmap_off, l->mcode_off, l->mscale_off};
    const size_t n[] = {st->codes_bytes, st->scales_bytes, st->tscales_bytes, st->zeros_bytes, st->index_bytes,
                        st->centroids_bytes, l->oidx_bytes, l->oval_bytes, l->mmap_bytes, l->mcode_bytes, l->mscale_bytes};
    for (size_t i = 0; i < sizeof off / sizeof off[0]; i++) k += diff_bytes(a, b, off[i], n[i]);
    return k;
}

/* A stream of three spans on both sides: an anchor (the anchor scheme), then
 * two spans coded against it, the second carrying the first's error: packed
 * planes, the carried error and the decoded K/V of the GPU equal to the CPU
 * reference's, byte for byte. Over an RTN and a k-means base, each option
 * alone and all together (METHODS.md 11). */
static void gpu_pipeline_matches_cpu(void **state) {
    (void)state;
    SKIP_WITHOUT_GPU();
    const int H = 3, D = 128;
    const int64_t N = small ? 40 : 1500;
    const size_t n = (size_t)N * H * D;
    uint16_t *k = malloc(n * 2 * 3), *v = malloc(n * 2 * 3), *ko = malloc(n * 2), *vo = malloc(n * 2),
             *kg = malloc(n * 2), *vg = malloc(n * 2);
    float *fb_cpu = calloc(2 * n, sizeof(float)), *fb_gpu = malloc(2 * n * sizeof(float));
    kvf_synth_kv(k, N, H, D, 71);
    kvf_synth_kv(v, N, H, D, 72);
    for (size_t i = 0; i < 2 * n; i++) { /* later chunks: the first, moved a little */
        k[n + i] = kvf_f32_to_bf16(kvf_bf16_to_f32(k[i % n]) * 1.01f + 0.03f * (float)((i * 7) % 13));
        v[n + i] = kvf_f32_to_bf16(kvf_bf16_to_f32(v[i % n]) * 0.99f - 0.02f * (float)((i * 5) % 11));
    }
    k[n + 17] = 0x7fc1; /* a NaN in a coded span: an outlier where the scheme keeps them */
    uint8_t *map = malloc(2 * (size_t)H * D);
    for (int t = 0; t < 2; t++)
        for (int h = 0; h < H; h++)
            for (int c = 0, slot = 0; c < D; c++)
                map[(t * H + h) * D + c] = (c % 4 == h % 4 && slot < (t ? 16 : 24)) ? (uint8_t)slot++ : 255;
    CUdeviceptr dk = dalloc(n * 2, 0), dv = dalloc(n * 2, 0), dko = dalloc(n * 2, 0x55), dvo = dalloc(n * 2, 0x55),
                dfb = dalloc(2 * n * sizeof(float), 0), dmap = dalloc(2 * (size_t)H * D, 0);
    CK(cuMemcpyHtoD(dmap, map, 2 * (size_t)H * D));
    kvf_shape sh = {N, H, 0, 0};
    for (int base = 0; base < 2; base++)
        for (int opt = 0; opt < 5; opt++) {
            struct kvf_scheme s, as;
            tu_hand_scheme(&s, D, 2, 2, 64, KVF_MODE_AFFINE);
            if (base) s.key.centroids = s.value.centroids = 32;
            s.key.assign = s.value.assign = KVF_ASSIGN_EXACT; /* byte for byte (exact()) */
            if (opt == 0 || opt == 4) s.pipe.outliers[0] = s.pipe.outliers[1] = 2;
            if (opt == 1 || opt == 4) s.pipe.mp_fraction[0] = 0.2, s.pipe.mp_fraction[1] = 0.125, s.pipe.mp_refine_bits = 2;
            s.pipe.anchor_every = 4, s.pipe.anchor_bits = opt == 4 ? 4 : 8; /* every case has an anchor */
            if (opt == 3 || opt == 4) s.pipe.feedback_decay = 0.75;
            tu_finalize(&s);
            assert_int_equal(kvf_anchor_scheme_of(&s, &as), KVF_OK);
            kvf_context *cg = NULL, *ag = NULL;
            if (kvf_context_create(&s, 0, &cg) || kvf_context_create(&as, 0, &ag))
                fail_msg("base %d option %d: %s", base, opt, kvf_last_error());
            size_t ab, pb;
            kvf_packed_size(&as, N, H, &ab);
            kvf_packed_size(&s, N, H, &pb);
            uint8_t *apc = malloc(ab), *ppc = malloc(pb), *ppg = malloc(pb);
            CUdeviceptr dap = dalloc(ab, 0x33), dpp = dalloc(pb, 0x33);
            /* The anchor: chunk 0, on both sides; the GPU's bytes equal the CPU's. */
            assert_int_equal(kvf_ref_encode(&as, k, v, &sh, NULL, apc, ab), KVF_OK);
            CK(cuMemcpyHtoD(dk, k, n * 2));
            CK(cuMemcpyHtoD(dv, v, n * 2));
            assert_int_equal(kvf_encode(ag, (void *)dk, (void *)dv, &sh, NULL, (void *)dap, ab, NULL), KVF_OK);
            CK(cuCtxSynchronize());
            uint8_t *apg = malloc(ab);
            CK(cuMemcpyDtoH(apg, dap, ab));
            kvf_layout AL, L;
            kvf_layout_compute(&as, N, H, &AL);
            kvf_layout_compute(&s, N, H, &L);
            assert_int_equal(pipe_plane_diffs(&AL.key, apc, apg) + pipe_plane_diffs(&AL.value, apc, apg), 0);
            memset(fb_cpu, 0, 2 * n * sizeof(float));
            CK(cuMemsetD8(dfb, 0, 2 * n * sizeof(float)));
            for (int span = 1; span <= 2; span++) {
                const uint16_t *ks = k + (size_t)span * n, *vs = v + (size_t)span * n;
                kvf_encode_args ec = {.anchor = apc, .anchor_bytes = ab, .anchor_n_tokens = N, .feedback = fb_cpu,
                                      .feedback_in = span == 2, .channel_map = map};
                kvf_encode_args eg = {.anchor = (void *)dap, .anchor_bytes = ab, .anchor_n_tokens = N,
                                      .feedback = (float *)dfb, .feedback_in = span == 2, .channel_map = (uint8_t *)dmap};
                kvf_decode_args dc = {.anchor = apc, .anchor_bytes = ab, .anchor_n_tokens = N};
                kvf_decode_args dg = {.anchor = (void *)dap, .anchor_bytes = ab, .anchor_n_tokens = N};
                if (kvf_ref_encode_ex(&s, ks, vs, &sh, &ec, ppc, pb) ||
                    kvf_ref_decode_ex(&s, ppc, pb, &sh, &dc, ko, vo))
                    fail_msg("CPU: %s", kvf_last_error());
                CK(cuMemcpyHtoD(dk, ks, n * 2));
                CK(cuMemcpyHtoD(dv, vs, n * 2));
                if (kvf_encode_ex(cg, (void *)dk, (void *)dv, &sh, &eg, (void *)dpp, pb, NULL) ||
                    kvf_decode_ex(cg, (void *)dpp, pb, &sh, &dg, (void *)dko, (void *)dvo, NULL))
                    fail_msg("GPU: %s", kvf_last_error());
                CK(cuCtxSynchronize());
                CK(cuMemcpyDtoH(ppg, dpp, pb));
                CK(cuMemcpyDtoH(kg, dko, n * 2));
                CK(cuMemcpyDtoH(vg, dvo, n * 2));
                CK(cuMemcpyDtoH(fb_gpu, dfb, 2 * n * sizeof(float)));
                const size_t planes = diff_bytes(ppc, ppg, 0, 64) + pipe_plane_diffs(&L.key, ppc, ppg) +
                                      pipe_plane_diffs(&L.value, ppc, ppg);
                size_t dk_n = 0, dv_n = 0, dfb_n = 0;
                for (size_t i = 0; i < n; i++) dk_n += ko[i] != kg[i], dv_n += vo[i] != vg[i];
                const int fb_on = s.pipe.feedback_decay > 0;
                for (size_t i = 0; i < 2 * n && fb_on; i++) dfb_n += memcmp(&fb_cpu[i], &fb_gpu[i], 4) != 0;
                printf("  pipeline base %s option %d span %d: planes %zu bytes apart, decode K %zu / V %zu values, "
                       "carried error %zu values\n", base ? "kmeans" : "rtn", opt, span, planes, dk_n, dv_n, dfb_n);
                assert_int_equal(planes, 0);
                assert_int_equal(dk_n + dv_n, 0);
                assert_int_equal(dfb_n, 0);
            }
            cu->cuMemFree(dap), cu->cuMemFree(dpp);
            free(apc), free(apg), free(ppc), free(ppg);
            kvf_context_destroy(cg), kvf_context_destroy(ag);
        }
    cu->cuMemFree(dk), cu->cuMemFree(dv), cu->cuMemFree(dko), cu->cuMemFree(dvo), cu->cuMemFree(dfb), cu->cuMemFree(dmap);
    free(k), free(v), free(ko), free(vo), free(kg), free(vg), free(fb_cpu), free(fb_gpu), free(map);
}

/* A layer's stream of 40 spans as the chunk policy runs it (anchor spans,
 * spans coded against the last anchor, the error carried from span to span,
 * a channel map): at every span the GPU's packed planes, decoded K/V and
 * carried error equal the CPU reference's, byte for byte. Every shipped
 * scheme with the pipeline (anchors every 8 spans here, so that the stream
 * crosses several), and the pipeline over QVG's k-means at its FP8 budget. */
static void gpu_pipeline_stream(void **state) {
    (void)state;
    SKIP_WITHOUT_GPU();
    const int H = 2, D = 128, SPANS = small ? 12 : 40;
    const int64_t N = small ? 24 : 600;
    const size_t n = (size_t)N * H * D;
    uint16_t *base_k = malloc(n * 2), *base_v = malloc(n * 2), *k = malloc(n * 2), *v = malloc(n * 2),
             *ko = malloc(n * 2), *vo = malloc(n * 2), *kg = malloc(n * 2), *vg = malloc(n * 2);
    float *fb_cpu = calloc(2 * n, sizeof(float)), *fb_gpu = malloc(2 * n * sizeof(float));
    uint8_t *map = malloc(2 * (size_t)H * D);
    kvf_synth_kv(base_k, N, H, D, 81);
    kvf_synth_kv(base_v, N, H, D, 82);
    CUdeviceptr dk = dalloc(n * 2, 0), dv = dalloc(n * 2, 0), dko = dalloc(n * 2, 0x55), dvo = dalloc(n * 2, 0x55),
                dfb = dalloc(2 * n * sizeof(float), 0), dmap = dalloc(2 * (size_t)H * D, 0);
    const char *texts[] = {NULL, /* the shipped ones first */
                           "return { base = 'qvg7_int2', name = 'qvg7_pipe', chunk = { span = 1 },"
                           " key = { assign = 'exact' }, value = { assign = 'exact' }, outliers = { key = 1, value = 1 },"
                           " anchors = { every = 8, bits = 8 }, error_feedback = { decay = 0.7 },"
                           " mixed_precision = { key_fraction = 0.125, value_fraction = 0.0625 } }",
                           /* and over ternary codes, on the rows path */
                           "return { base = 'stable_int2', name = 'stable_tern', key = { mode = 'ternary' },"
                           " value = { mode = 'ternary' }, anchors = { every = 8, bits = 8 } }"};
    const char *const *names = kvf_builtin_schemes();
    for (int which = 0; which < 3; which++)
        for (const char *const *name = names; which ? name == names : *name != NULL; name++) {
            kvf_scheme *s;
            if (which) {
                s = tu_scheme_text(texts[which]);
            } else {
                kvf_scheme *b = tu_scheme(*name);
                const int pipe = b->pipe.anchor_every || b->pipe.feedback_decay > 0 || b->pipe.outliers[0] ||
                                 b->plan.sec[0].mp_channels;
                kvf_scheme_free(b);
                if (!pipe || !selected(*name)) continue;
                char text[160];
                snprintf(text, sizeof text, "return { base = '%s', anchors = { every = 8, bits = 8 } }", *name);
                s = tu_scheme_text(text);
            }
            kvf_scheme *as;
            assert_int_equal(kvf_scheme_anchor(s, &as), KVF_OK);
            kvf_context *cg, *ag;
            if (kvf_context_create(s, 0, &cg) || kvf_context_create(as, 0, &ag)) fail_msg("%s: %s", s->name, kvf_last_error());
            for (int t = 0; t < 2; t++) /* each head refines its own channels */
                for (int h = 0; h < H; h++)
                    for (int c = 0, slot = 0; c < D; c++)
                        map[(t * H + h) * D + c] =
                            ((c * 5 + h) % 8 < 3 && slot < s->plan.sec[t].mp_channels) ? (uint8_t)slot++ : 255;
            CK(cuMemcpyHtoD(dmap, map, 2 * (size_t)H * D));
            size_t ab, pb;
            kvf_packed_size(as, N, H, &ab);
            kvf_packed_size(s, N, H, &pb);
            kvf_layout AL, L;
            kvf_layout_compute(as, N, H, &AL);
            kvf_layout_compute(s, N, H, &L);
            uint8_t *apc = malloc(ab), *apg = malloc(ab), *ppc = malloc(pb), *ppg = malloc(pb);
            CUdeviceptr dap = dalloc(ab, 0x33), dpp = dalloc(pb, 0x33);
            kvf_shape sh = {N, H, 0, 0};
            size_t worst = 0;
            int anchors = 0, carried = 0;
            for (int t = 0; t < SPANS; t++) {
                kvf_chunk_step st;
                assert_int_equal(kvf_chunk_policy(s, t, &st), KVF_OK);
                assert_int_equal(st.pack_first, t); /* span 1, no recent or sink chunks */
                for (size_t i = 0; i < n; i++) { /* the scene drifts a little from span to span */
                    const float w = 0.004f * (float)t, wob = 0.05f * (float)(((i * 31 + (size_t)t * 7) % 17) - 8);
                    k[i] = kvf_f32_to_bf16(kvf_bf16_to_f32(base_k[i]) * (1.0f + w) + wob);
                    v[i] = kvf_f32_to_bf16(kvf_bf16_to_f32(base_v[i]) * (1.0f - w) - wob);
                }
                CK(cuMemcpyHtoD(dk, k, n * 2));
                CK(cuMemcpyHtoD(dv, v, n * 2));
                size_t planes, dk_n = 0, dv_n = 0, dfb_n = 0;
                if (st.anchor) {
                    anchors++;
                    if (kvf_ref_encode(as, k, v, &sh, NULL, apc, ab) ||
                        kvf_encode(ag, (void *)dk, (void *)dv, &sh, NULL, (void *)dap, ab, NULL))
                        fail_msg("%s span %d (anchor): %s", s->name, t, kvf_last_error());
                    CK(cuCtxSynchronize());
                    CK(cuMemcpyDtoH(apg, dap, ab));
                    planes = diff_bytes(apc, apg, 0, 64) + pipe_plane_diffs(&AL.key, apc, apg) +
                             pipe_plane_diffs(&AL.value, apc, apg);
                } else {
                    carried += st.feedback_in;
                    const int against = st.anchor_first >= 0;
                    assert_true(against); /* the stream starts with an anchor */
                    kvf_encode_args ec = {.anchor = apc, .anchor_bytes = ab, .anchor_n_tokens = N, .feedback = fb_cpu,
                                          .feedback_in = st.feedback_in, .channel_map = map};
                    kvf_encode_args eg = {.anchor = (void *)dap, .anchor_bytes = ab, .anchor_n_tokens = N,
                                          .feedback = (float *)dfb, .feedback_in = st.feedback_in,
                                          .channel_map = (uint8_t *)dmap};
                    if (!s->plan.sec[0].mp_channels && !s->plan.sec[1].mp_channels) ec.channel_map = NULL, eg.channel_map = NULL;
                    if (s->pipe.feedback_decay <= 0) ec.feedback = NULL, eg.feedback = NULL;
                    kvf_decode_args dc = {.anchor = apc, .anchor_bytes = ab, .anchor_n_tokens = N};
                    kvf_decode_args dg = {.anchor = (void *)dap, .anchor_bytes = ab, .anchor_n_tokens = N};
                    if (kvf_ref_encode_ex(s, k, v, &sh, &ec, ppc, pb) || kvf_ref_decode_ex(s, ppc, pb, &sh, &dc, ko, vo))
                        fail_msg("%s span %d, CPU: %s", s->name, t, kvf_last_error());
                    if (kvf_encode_ex(cg, (void *)dk, (void *)dv, &sh, &eg, (void *)dpp, pb, NULL) ||
                        kvf_decode_ex(cg, (void *)dpp, pb, &sh, &dg, (void *)dko, (void *)dvo, NULL))
                        fail_msg("%s span %d, GPU: %s", s->name, t, kvf_last_error());
                    CK(cuCtxSynchronize());
                    CK(cuMemcpyDtoH(ppg, dpp, pb));
                    CK(cuMemcpyDtoH(kg, dko, n * 2));
                    CK(cuMemcpyDtoH(vg, dvo, n * 2));
                    planes = diff_bytes(ppc, ppg, 0, 64) + pipe_plane_diffs(&L.key, ppc, ppg) +
                             pipe_plane_diffs(&L.value, ppc, ppg);
                    for (size_t i = 0; i < n; i++) dk_n += ko[i] != kg[i], dv_n += vo[i] != vg[i];
                    if (ec.feedback) {
                        CK(cuMemcpyDtoH(fb_gpu, dfb, 2 * n * sizeof(float)));
                        for (size_t i = 0; i < 2 * n; i++) dfb_n += memcmp(&fb_cpu[i], &fb_gpu[i], 4) != 0;
                    }
                }
                const size_t all = planes + dk_n + dv_n + dfb_n;
                if (all) printf("  %s span %d: planes %zu bytes, decode K %zu / V %zu, carried error %zu apart\n",
                                s->name, t, planes, dk_n, dv_n, dfb_n);
                if (all > worst) worst = all;
            }
            printf("%s: %d spans (%d anchors, %d carrying the error) of %lld tokens x %d heads: GPU %s the CPU "
                   "reference\n", s->name, SPANS, anchors, carried, (long long)N, H,
                   worst ? "differs from" : "byte for byte equal to");
            assert_int_equal(worst, 0);
            assert_true(anchors >= (SPANS + 7) / 8);
            cu->cuMemFree(dap), cu->cuMemFree(dpp);
            free(apc), free(apg), free(ppc), free(ppg);
            kvf_context_destroy(cg), kvf_context_destroy(ag);
            kvf_scheme_free(as);
            kvf_scheme_free(s);
        }
    cu->cuMemFree(dk), cu->cuMemFree(dv), cu->cuMemFree(dko), cu->cuMemFree(dvo), cu->cuMemFree(dfb), cu->cuMemFree(dmap);
    free(base_k), free(base_v), free(k), free(v), free(ko), free(vo), free(kg), free(vg), free(fb_cpu), free(fb_gpu);
    free(map);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(gpu_matches_cpu),
        cmocka_unit_test(gpu_rope_pre),
        cmocka_unit_test(gpu_psac_shapes),
        cmocka_unit_test(gpu_kmeans_sum_shapes),
        cmocka_unit_test(gpu_kmeans_labels),
        cmocka_unit_test(gpu_assign_ranges),
        cmocka_unit_test(gpu_sm80_geometry),
        cmocka_unit_test(oversized_assignment_refused),
        cmocka_unit_test(gpu_qstats_nonfinite),
        cmocka_unit_test(decode_special_values),
        cmocka_unit_test(gpu_corrupt_centroid_index),
        cmocka_unit_test(context_from_cache_and_image),
        cmocka_unit_test(gpu_warm_start),
        cmocka_unit_test(bad_arguments_refused),
        cmocka_unit_test(gpu_ternary),
        cmocka_unit_test(gpu_pipeline_matches_cpu),
        cmocka_unit_test(gpu_pipeline_stream),
        cmocka_unit_test(gpu_fast_assign),
        cmocka_unit_test(gpu_fast_assign_dump),
    };
    const char *only = getenv("KVF_TEST_ONLY"); /* one test by name, e.g. on a short device run */
    if (only && *only) cmocka_set_test_filter(only);
    return cmocka_run_group_tests_name("gpu", tests, setup, teardown);
}
