/* Quality evaluation (eval/): the metrics on hand-computed cases, the
 * safetensors reader and the dump validation on good and malformed files,
 * and whole runs on synthetic dumps written here (and on the committed dump
 * eval/worldmodel/kv_small.safetensors when it exists). */
#include "testutil.h"

#include "calibrate.h"
#include "dump.h"
#include "eval.h"
#include "metrics.h"
#include "cli_args.h"
#include "safetensors.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char *tmp_dir;

static int setup(void **state) {
    (void)state;
    tmp_dir = tu_mkdtemp();
    setenv("KVFORGE_CACHE_DIR", tmp_dir, 1);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    tu_rmtree(tmp_dir);
    free(tmp_dir);
    return 0;
}

static const char *tmp_file(const char *name) { return tu_join(tmp_dir, name); }

#define assert_error_has(rc, code, needle)                                                        \
    do {                                                                                          \
        int rc_ = (rc);                                                                           \
        if (rc_ != (code) || !strstr(kvf_last_error(), (needle)))                                 \
            fail_msg("expected %s with \"%s\", got %s: %s", kvf_status_name(code), (needle),      \
                     kvf_status_name(rc_), kvf_last_error());                                     \
    } while (0)

/* ============================================================ metrics */

static kvf_attn_sums attend(const float *q, int64_t nq, const float *kr, const float *vr, const float *kh,
                            const float *vh, int64_t n, int d) {
    kvf_attn_sums s = {0};
    assert_int_equal(kvf_metric_attention(q, nq, kr, vr, kh, vh, n, d, &s), KVF_OK);
    return s;
}

/* q = e0 picks key 0 (logit 1 against 0.5 and 0); lowering key 0 to 0.4
 * moves the top-1 to key 1, lowering it to 0.9 does not. */
static void test_top1_known(void **state) {
    (void)state;
    const float q[2] = {1, 0};
    const float k[3][2] = {{1, 0}, {0.5f, 0}, {0, 1}}, v[3][2] = {{1, 0}, {0, 1}, {1, 1}};
    const float flip[3][2] = {{0.4f, 0}, {0.5f, 0}, {0, 1}}, keep[3][2] = {{0.9f, 0}, {0.5f, 0}, {0, 1}};
    double l[3];
    kvf_metric_logits(q, 1, &k[0][0], 3, 2, 1.0, l);
    assert_int_equal(kvf_metric_argmax(l, 3), 0);
    kvf_attn_sums s = attend(q, 1, &k[0][0], &v[0][0], &flip[0][0], &v[0][0], 3, 2);
    assert_true(s.queries == 1 && s.top1_shifted == 1.0);
    s = attend(q, 1, &k[0][0], &v[0][0], &keep[0][0], &v[0][0], 3, 2);
    assert_true(s.queries == 1 && s.top1_shifted == 0.0);
    /* ties go to the lowest index */
    const double tie[4] = {1, 3, 3, 2};
    assert_int_equal(kvf_metric_argmax(tie, 4), 1);
}

static void test_top5_overlap(void **state) {
    (void)state;
    /* d = 1, q = 1: the logits are the keys. Reference top 5 = {0,1,2,3,4};
     * cached top 5 = {0,1,2,5,6}: overlap 3/5, top-1 unchanged. */
    const float q[1] = {1};
    const float kr[7] = {9, 8, 7, 6, 5, 4, 3}, kh[7] = {9, 8, 7, 0, 0, 6, 5}, v[7] = {0};
    kvf_attn_sums s = attend(q, 1, kr, v, kh, v, 7, 1);
    assert_float_equal(s.top5_overlap, 0.6, 1e-12);
    assert_true(s.top1_shifted == 0.0);

    int64_t a[KVF_TOPK], b[KVF_TOPK];
    const double ref[7] = {9, 8, 7, 6, 5, 4, 3}, hat[7] = {9, 8, 7, 0, 0, 6, 5};
    assert_int_equal(kvf_metric_topk(ref, 7, 5, a), 5);
    assert_int_equal(kvf_metric_topk(hat, 7, 5, b), 5);
    const int64_t want_b[5] = {0, 1, 2, 5, 6};
    for (int i = 0; i < 5; i++) assert_int_equal(b[i], want_b[i]);
    assert_float_equal(kvf_metric_topk_overlap(a, b, 5), 0.6, 1e-12);
    /* equal logits: the lowest indices, in order */
    const double flat[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    assert_int_equal(kvf_metric_topk(flat, 8, 5, b), 5);
    for (int i = 0; i < 5; i++) assert_int_equal(b[i], i);
    assert_int_equal(kvf_metric_topk(ref, 7, 0, a), 0);
    /* fewer keys than 5: overlap over min(5, n) */
    const double two[2] = {0, 1};
    assert_int_equal(kvf_metric_topk(two, 2, 5, a), 2);
    assert_true(a[0] == 1 && a[1] == 0);
    const float k2r[2] = {0, 1}, k2h[2] = {1, 0}, v2[2] = {0};
    s = attend(q, 1, k2r, v2, k2h, v2, 2, 1);
    assert_true(s.top1_shifted == 1.0 && s.top5_overlap == 1.0);
}

static void fill(float *x, size_t n, uint64_t seed) {
    for (size_t i = 0; i < n; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        x[i] = (float)((double)(seed >> 11) * 0x1.0p-53 * 2.0 - 1.0);
    }
}

static void test_attention_identical(void **state) {
    (void)state;
    enum { NQ = 37, N = 50, D = 16 };
    float *q = malloc(NQ * D * 4), *k = malloc(N * D * 4), *v = malloc(N * D * 4);
    fill(q, NQ * D, 1);
    fill(k, N * D, 2);
    fill(v, N * D, 3);
    kvf_attn_sums s = attend(q, NQ, k, v, k, v, N, D);
    assert_true(s.queries == NQ && s.top1_shifted == 0 && s.top5_overlap == NQ && s.err_sq == 0 && s.ref_sq > 0);
    free(q);
    free(k);
    free(v);
}

/* q = 0: uniform attention, the output is the mean of the values:
 * ref [2, 3], cached [2, 4]: relative error 1 / sqrt(13). */
static void test_attention_output_hand(void **state) {
    (void)state;
    const float q[2] = {0, 0}, k[2][2] = {{1, 0}, {0, 1}};
    const float vr[2][2] = {{1, 2}, {3, 4}}, vh[2][2] = {{1, 2}, {3, 6}};
    double p[2] = {0.3, 0.3}, o[2];
    kvf_metric_softmax(p, 2);
    assert_float_equal(p[0], 0.5, 1e-15);
    kvf_metric_attend(p, 1, &vr[0][0], 2, 2, o);
    assert_true(o[0] == 2 && o[1] == 3);
    kvf_eval_step st = {1, 1, 2, 1, q, 2, 2, &k[0][0], &vr[0][0], &k[0][0], &vh[0][0], NULL, 1};
    kvf_eval_sums sums = {0};
    assert_int_equal(kvf_eval_step_run(&st, &sums), KVF_OK);
    kvf_eval_metrics m;
    kvf_eval_finish(&sums, &m);
    assert_float_equal(m.attn_out_rel_err, 1.0 / sqrt(13.0), 1e-12);
    assert_true(m.top1_shift == 0 && m.top5_overlap == 1);
    assert_true(isnan(m.key_mse) && isnan(m.qk_err)); /* nothing packed */
}

static void test_qk_err_hand(void **state) {
    (void)state;
    const float e[2] = {1, 2};
    const double M[4] = {2, 1, 1, 3};
    assert_float_equal(kvf_metric_quad(e, M, 2), 18.0, 1e-12); /* 2 + 2*2 + 3*4 */
    double m[4] = {0};
    const float qs[2][2] = {{1, 0}, {0, 1}};
    kvf_metric_qq_add(&qs[0][0], 2, 2, m);
    assert_true(m[0] == 1 && m[1] == 0 && m[2] == 0 && m[3] == 1);

    /* Through a step: queries e0 and e1, M = diag(1/2, 1/2); key 0 packed
     * with error (2, 2): e^T M e = 4, key MSE 4; key 1 not packed. */
    const float kr[2][2] = {{1, 1}, {0, 0}}, kh[2][2] = {{3, 3}, {0, 0}}, v[2][2] = {{0, 0}, {0, 0}};
    const uint8_t packed[2] = {1, 0};
    kvf_eval_step st = {1, 1, 2, 2, &qs[0][0], 2, 2, &kr[0][0], &v[0][0], &kh[0][0], &v[0][0], packed, 1};
    kvf_eval_sums sums = {0};
    assert_int_equal(kvf_eval_step_run(&st, &sums), KVF_OK);
    kvf_eval_metrics mm;
    kvf_eval_finish(&sums, &mm);
    assert_float_equal(mm.qk_err, 4.0, 1e-12);
    assert_float_equal(mm.key_mse, 4.0, 1e-12);
    assert_float_equal(mm.value_mse, 0.0, 0);
    assert_true(mm.key_tokens == 1 && mm.kv_values == 2);
}

/* Query heads 0,1 read KV head 0 and heads 2,3 KV head 1 (GQA): only KV
 * head 1's keys are disturbed, so half of the queries move. */
static void test_gqa_mapping(void **state) {
    (void)state;
    enum { HQ = 4, HKV = 2, N = 3, D = 2 };
    const float q[HQ][1][D] = {{{1, 0}}, {{1, 0}}, {{1, 0}}, {{1, 0}}};
    const float kr[HKV][N][D] = {{{1, 0}, {0.5f, 0}, {0, 1}}, {{1, 0}, {0.5f, 0}, {0, 1}}};
    const float kh[HKV][N][D] = {{{1, 0}, {0.5f, 0}, {0, 1}}, {{0.4f, 0}, {0.5f, 0}, {0, 1}}};
    const float v[HKV][N][D] = {{{1, 0}, {0, 1}, {1, 1}}, {{1, 0}, {0, 1}, {1, 1}}};
    for (int threads = 1; threads <= 3; threads++) {
        kvf_eval_step st = {HQ, HKV, D, 1, &q[0][0][0], N, N, &kr[0][0][0], &v[0][0][0], &kh[0][0][0], &v[0][0][0],
                            NULL, threads};
        kvf_eval_sums s = {0};
        assert_int_equal(kvf_eval_step_run(&st, &s), KVF_OK);
        assert_true(s.queries == 4 && s.top1_shifted == 2);
    }
}

/* ========================================================= safetensors */

/* 8-byte length, header text, then data. */
static size_t make_file(uint8_t *buf, const char *header, const void *data, size_t data_len) {
    uint64_t h = strlen(header);
    memcpy(buf, &h, 8);
    memcpy(buf + 8, header, h);
    if (data_len) memcpy(buf + 8 + h, data, data_len);
    return 8 + h + data_len;
}

static void test_safetensors_hand_file(void **state) {
    (void)state;
    const char *header = "{\"__metadata__\":{\"source\":\"hand\"},"
                         "\"b\":{\"dtype\":\"I32\",\"shape\":[2],\"data_offsets\":[4,12]},"
                         "\"a\":{\"dtype\":\"BF16\",\"shape\":[1,2],\"data_offsets\":[0,4]},"
                         "\"e\":{\"dtype\":\"F32\",\"shape\":[0,3],\"data_offsets\":[12,12]}}";
    uint8_t data[12];
    const uint16_t bf[2] = {0x3f80, 0xc000}; /* 1.0, -2.0 */
    const int32_t i32[2] = {7, -9};
    memcpy(data, bf, 4);
    memcpy(data + 4, i32, 8);
    uint8_t buf[1024];
    size_t n = make_file(buf, header, data, sizeof data);
    const char *path = tmp_file("hand.safetensors");
    tu_write_file(path, buf, n);

    kvf_st_file *f;
    assert_int_equal(kvf_st_open(path, &f), KVF_OK);
    assert_int_equal(kvf_st_count(f), 3);
    assert_string_equal(kvf_st_at(f, 0)->name, "a"); /* sorted */
    assert_string_equal(kvf_st_meta(f, "source"), "hand");
    assert_null(kvf_st_meta(f, "nothing"));
    const kvf_st_tensor *a = kvf_st_find(f, "a"), *b = kvf_st_find(f, "b"), *e = kvf_st_find(f, "e");
    assert_non_null(a);
    assert_non_null(b);
    assert_non_null(e);
    assert_null(kvf_st_find(f, "c"));
    assert_true(a->dtype == KVF_ST_BF16 && a->ndim == 2 && a->shape[0] == 1 && a->shape[1] == 2 && a->n_elements == 2);
    float af[2];
    kvf_dump_f32(a, 0, 2, af);
    assert_true(af[0] == 1.0f && af[1] == -2.0f);
    int32_t bi[2];
    kvf_dump_i32(b, 0, 2, bi);
    assert_true(bi[0] == 7 && bi[1] == -9);
    assert_true(e->n_elements == 0 && e->n_bytes == 0);
    kvf_st_close(f);
}

typedef struct bad_case { const char *header; size_t data_len; const char *message; } bad_case;

static void test_safetensors_malformed(void **state) {
    (void)state;
    static const bad_case cases[] = {
        {"{\"a\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[0,4]}", 4, "not valid JSON"},
        {"[1, 2]", 0, "must be a JSON object"},
        {"{\"a\":{\"dtype\":\"BF16\",\"shape\":[4],\"data_offsets\":[0,8]}}", 4, "\"a\": data_offsets [0, 8] run past the end"},
        {"{\"a\":{\"dtype\":\"BF17\",\"shape\":[2],\"data_offsets\":[0,4]}}", 4, "\"a\": unknown dtype \"BF17\""},
        {"{\"a\":{\"dtype\":\"BF16\",\"shape\":[3],\"data_offsets\":[0,4]}}", 4, "\"a\": 3 BF16 elements need 6 bytes"},
        {"{\"a\":{\"dtype\":\"BF16\",\"shape\":[-2],\"data_offsets\":[0,4]}}", 4, "\"a\": shape[0] must be a non-negative"},
        {"{\"a\":{\"dtype\":\"BF16\",\"shape\":[2.0],\"data_offsets\":[0,4]}}", 4, "\"a\": shape[0]"},
        {"{\"a\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[4,0]}}", 4, "begin > end"},
        {"{\"a\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[0]}}", 4, "\"a\": \"data_offsets\" must be"},
        {"{\"a\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[0,4],\"x\":1}}", 4, "unknown field \"x\""},
        {"{\"a\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[0,4]},"
         "\"a\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[0,4]}}", 4, "duplicate"},
        {"{\"a\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[0,4]},"
         "\"b\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[2,6]}}", 8, "\"a\" and \"b\" overlap"},
        {"{\"a\":{\"dtype\":\"BF16\",\"shape\":[4294967296,4294967296,4294967296],\"data_offsets\":[0,4]}}", 4,
         "overflows"},
        {"{\"__metadata__\":{\"n\":3}}", 0, "__metadata__[\"n\"] must be a string"},
        {"{\"a\":[1]}", 0, "\"a\": entry must be an object"},
        {"{\"a\\u0001b\":{\"dtype\":\"X\",\"shape\":[],\"data_offsets\":[0,0]}}", 0, "\"a\\x01b\": unknown dtype"},
    };
    uint8_t buf[1024], zeros[16] = {0};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        size_t n = make_file(buf, cases[i].header, zeros, cases[i].data_len);
        kvf_st_file *f = (kvf_st_file *)1;
        int rc = kvf_st_parse(buf, n, "bad.safetensors", &f);
        if (rc != KVF_EFORMAT || !strstr(kvf_last_error(), cases[i].message) ||
            !strstr(kvf_last_error(), "bad.safetensors"))
            fail_msg("case %zu: expected KVF_EFORMAT with \"%s\", got %s: %s", i, cases[i].message,
                     kvf_status_name(rc), kvf_last_error());
        assert_null(f);
    }
    /* the length prefix itself */
    assert_error_has(kvf_st_parse(buf, 5, "short", &(kvf_st_file *){0}), KVF_EFORMAT, "too short");
    uint64_t huge = 1000;
    memcpy(buf, &huge, 8);
    assert_error_has(kvf_st_parse(buf, 100, "x", &(kvf_st_file *){0}), KVF_EFORMAT, "runs past the end of the file");
    huge = 1ull << 62;
    memcpy(buf, &huge, 8);
    assert_error_has(kvf_st_parse(buf, 100, "x", &(kvf_st_file *){0}), KVF_EFORMAT, "exceeds");
    assert_error_has(kvf_st_open(tmp_file("none"), &(kvf_st_file *){0}), KVF_EIO, "cannot open");
    tu_write_file(tmp_file("empty"), "", 0);
    assert_error_has(kvf_st_open(tmp_file("empty"), &(kvf_st_file *){0}), KVF_EFORMAT, "too short");
}

/* ============================================================ dumps */

typedef struct synth_cfg {
    int layers, chunks, tokens, kv_heads, q_heads, queries, d;
    double q_align; /* queries = q_align * a key + noise */
} synth_cfg;

static double gauss(uint64_t *st) {
    double u = ((tu_splitmix((*st)++) >> 11) + 0.5) * 0x1.0p-53, v = ((tu_splitmix((*st)++) >> 11) + 0.5) * 0x1.0p-53;
    return sqrt(-2 * log(u)) * cos(2 * M_PI * v);
}

/* Everything a synthetic dump holds, in memory. */
typedef struct synth_dump {
    synth_cfg c;
    uint16_t **k, **v, **q; /* [layers * chunks] */
    int32_t *pos;
    char meta_text[8][32];
} synth_dump;

/* Queries of chunk c lean towards keys of chunks <= c of their KV head. */
static void synth_queries(const synth_dump *s, int l, int c, uint16_t *q) {
    const synth_cfg *g = &s->c;
    uint64_t st = tu_splitmix(((uint64_t)l << 32) ^ ((uint64_t)c << 16) ^ 0x51ull);
    for (int j = 0; j < g->q_heads; j++) {
        int h = j / (g->q_heads / g->kv_heads);
        for (int i = 0; i < g->queries; i++) {
            uint64_t pick = tu_splitmix(st++) % ((uint64_t)(c + 1) * g->tokens);
            const uint16_t *kc = s->k[l * g->chunks + (int)(pick / g->tokens)];
            const uint16_t *key = kc + ((size_t)h * g->tokens + pick % g->tokens) * g->d;
            for (int x = 0; x < g->d; x++) {
                double val = g->q_align * kvf_bf16_to_f32(key[x]) + gauss(&st);
                q[((size_t)j * g->queries + i) * g->d + x] = kvf_f32_to_bf16((float)val);
            }
        }
    }
}

static synth_dump *synth_make(const synth_cfg *c) {
    synth_dump *s = calloc(1, sizeof *s);
    s->c = *c;
    int cells = c->layers * c->chunks;
    s->k = calloc(cells, sizeof *s->k);
    s->v = calloc(cells, sizeof *s->v);
    s->q = calloc(cells, sizeof *s->q);
    size_t kv = (size_t)c->kv_heads * c->tokens * c->d, qn = (size_t)c->q_heads * c->queries * c->d;
    for (int i = 0; i < cells; i++) {
        s->k[i] = malloc(kv * 2);
        s->v[i] = malloc(kv * 2);
        s->q[i] = malloc(qn * 2);
        tu_synth_kv(s->k[i], c->tokens, c->kv_heads, c->d, 1000 + 2 * (uint64_t)i);
        tu_synth_kv(s->v[i], c->tokens, c->kv_heads, c->d, 1001 + 2 * (uint64_t)i);
    }
    for (int l = 0; l < c->layers; l++)
        for (int ch = 0; ch < c->chunks; ch++) synth_queries(s, l, ch, s->q[l * c->chunks + ch]);
    s->pos = malloc((size_t)c->chunks * c->tokens * 3 * sizeof *s->pos);
    for (int t = 0; t < c->chunks * c->tokens; t++) {
        s->pos[3 * t] = t / 64;
        s->pos[3 * t + 1] = (t % 64) / 8;
        s->pos[3 * t + 2] = t % 8;
    }
    return s;
}

static void synth_free(synth_dump *s) {
    for (int i = 0; i < s->c.layers * s->c.chunks; i++) {
        free(s->k[i]);
        free(s->v[i]);
        free(s->q[i]);
    }
    free(s->k);
    free(s->v);
    free(s->q);
    free(s->pos);
    free(s);
}

/* Tweaks of the file written, for the validation tests. */
typedef struct synth_write_opts {
    const char *drop;          /* a tensor name left out */
    const char *wrong_dtype;   /* a tensor written as F32 (same bytes count x2) */
    const char *wrong_shape;   /* a tensor whose first dimension is 1 too many */
    const char *extra;         /* an extra tensor name */
    const char *meta_key, *meta_value; /* one metadata value replaced ("" = removed) */
} synth_write_opts;

static void synth_write(const synth_dump *s, const char *path, const synth_write_opts *o) {
    const synth_cfg *c = &s->c;
    static const synth_write_opts none = {0};
    if (!o) o = &none;
    int cells = c->layers * c->chunks, nt = 0;
    kvf_st_write_tensor *t = calloc((size_t)cells * 4 + 2, sizeof *t);
    char (*names)[32] = calloc((size_t)cells * 4 + 2, 32);
    size_t big = (size_t)c->q_heads * c->queries * c->d;
    if ((size_t)c->kv_heads * c->tokens * c->d > big) big = (size_t)c->kv_heads * c->tokens * c->d;
    uint8_t *scratch = calloc(big * 4 + 64, 1);
    for (int l = 0; l < c->layers; l++)
        for (int ch = 0; ch < c->chunks; ch++)
            for (int r = 0; r < 4; r++) {
                static const char *role[4] = {"q", "k", "k_pre", "v"};
                snprintf(names[nt], 32, "l%d.c%d.%s", l, ch, role[r]);
                if (o->drop && !strcmp(o->drop, names[nt])) continue;
                int i = l * c->chunks + ch;
                kvf_st_write_tensor *w = &t[nt];
                w->name = names[nt];
                w->dtype = KVF_ST_BF16;
                w->ndim = 3;
                w->shape[0] = r == 0 ? c->q_heads : c->kv_heads;
                w->shape[1] = r == 0 ? c->queries : c->tokens;
                w->shape[2] = c->d;
                w->data = r == 0 ? s->q[i] : r == 3 ? s->v[i] : s->k[i];
                if (o->wrong_dtype && !strcmp(o->wrong_dtype, names[nt])) {
                    w->dtype = KVF_ST_F32;
                    w->data = scratch;
                }
                if (o->wrong_shape && !strcmp(o->wrong_shape, names[nt])) {
                    w->shape[0]++;
                    w->data = scratch;
                }
                nt++;
            }
    t[nt] = (kvf_st_write_tensor){"pos", KVF_ST_I32, 2, {(int64_t)c->chunks * c->tokens, 3}, s->pos};
    nt++;
    if (o->extra) t[nt++] = (kvf_st_write_tensor){o->extra, KVF_ST_U8, 1, {4}, scratch};
    char num[6][16];
    snprintf(num[0], 16, "%d", c->layers);
    snprintf(num[1], 16, "%d", c->chunks);
    snprintf(num[2], 16, "%d", c->q_heads);
    snprintf(num[3], 16, "%d", c->kv_heads);
    snprintf(num[4], 16, "%d", c->d);
    snprintf(num[5], 16, "%d", c->tokens);
    const char *meta[20] = {"layers", num[0], "chunks", num[1], "q_heads", num[2], "kv_heads", num[3],
                            "head_dim", num[4], "tokens_per_chunk", num[5], "rope_theta", "10000.0",
                            "rope_sections", "[16, 24, 24]", "q_subsample", "1", "source", "synthetic (test_eval)"};
    int n_meta = 10;
    for (int i = 0; i < 10 && o->meta_key; i++)
        if (!strcmp(meta[2 * i], o->meta_key)) {
            if (*o->meta_value) meta[2 * i + 1] = o->meta_value;
            else {
                meta[2 * i] = meta[18];
                meta[2 * i + 1] = meta[19];
                n_meta--;
            }
        }
    assert_int_equal(kvf_st_write(path, meta, n_meta, t, nt), KVF_OK);
    free(t);
    free(names);
    free(scratch);
}

static const synth_cfg small_cfg = {1, 3, 64, 2, 4, 32, 128, 0.05};

static void test_dump_valid(void **state) {
    (void)state;
    synth_dump *s = synth_make(&small_cfg);
    const char *path = tmp_file("ok.safetensors");
    synth_write(s, path, NULL);
    kvf_dump *d;
    assert_int_equal(kvf_dump_open(path, &d), KVF_OK);
    assert_true(d->layers == 1 && d->chunks == 3 && d->q_heads == 4 && d->kv_heads == 2 && d->head_dim == 128 &&
                d->tokens == 64 && d->pos_axes == 3 && d->n_sections == 3 && d->sections[2] == 24);
    assert_float_equal(d->rope_theta, 10000.0, 0);
    assert_string_equal(d->source, "synthetic (test_eval)");
    const kvf_st_tensor *k = kvf_dump_tensor(d, 0, 2, KVF_DUMP_K);
    assert_non_null(k);
    uint16_t x[8];
    kvf_dump_bf16(k, 64 * 128 + 5, 8, x); /* head 1, token 0, channel 5 */
    assert_memory_equal(x, s->k[2] + 64 * 128 + 5, sizeof x);
    assert_null(kvf_dump_tensor(d, 0, 0, KVF_DUMP_Q_PRE));
    assert_null(kvf_dump_tensor(d, 0, 3, KVF_DUMP_K));
    kvf_dump_close(d);
    synth_free(s);
}

static void test_dump_invalid(void **state) {
    (void)state;
    synth_dump *s = synth_make(&small_cfg);
    static const struct { synth_write_opts o; int code; const char *msg; } cases[] = {
        {{.drop = "l0.c1.v"}, KVF_EFORMAT, "tensor \"l0.c1.v\" is missing"},
        {{.wrong_dtype = "l0.c2.k"}, KVF_EFORMAT, "\"l0.c2.k\": dtype F32, expected BF16"},
        {{.wrong_shape = "l0.c0.q"}, KVF_EFORMAT, "\"l0.c0.q\": shape [5, 32, 128], expected [q_heads = 4"},
        {{.wrong_shape = "l0.c1.k_pre"}, KVF_EFORMAT, "\"l0.c1.k_pre\": shape [3, 64, 128]"},
        {{.extra = "l0.c3.k"}, KVF_EFORMAT, "unexpected tensor \"l0.c3.k\""},
        {{.extra = "l00.c1.k"}, KVF_EFORMAT, "unexpected tensor \"l00.c1.k\""},
        {{.extra = "l0.c1.kk"}, KVF_EFORMAT, "unexpected tensor"},
        {{.extra = "pos"}, KVF_EFORMAT, "\"pos\": dtype U8, expected I32"},
        {{.meta_key = "layers", .meta_value = ""}, KVF_EFORMAT, "metadata \"layers\" is missing"},
        {{.meta_key = "chunks", .meta_value = "3x"}, KVF_EFORMAT, "metadata \"chunks\" = \"3x\""},
        {{.meta_key = "kv_heads", .meta_value = "3"}, KVF_EFORMAT, "not a multiple of kv_heads"},
        {{.meta_key = "rope_theta", .meta_value = "-1"}, KVF_EFORMAT, "rope_theta"},
        {{.meta_key = "rope_sections", .meta_value = "16;24"}, KVF_EFORMAT, "rope_sections"},
        {{.meta_key = "chunks", .meta_value = "4000"}, KVF_EFORMAT, "need 12000 q/k/v tensors"},
        {{.meta_key = "tokens_per_chunk", .meta_value = "32"}, KVF_EFORMAT, "expected [kv_heads = 2, tokens_per_chunk = 32"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *path = tmp_file("bad.safetensors");
        synth_write(s, path, &cases[i].o);
        kvf_dump *d = (kvf_dump *)1;
        int rc = kvf_dump_open(path, &d);
        if (rc != cases[i].code || !strstr(kvf_last_error(), cases[i].msg))
            fail_msg("case %zu: expected \"%s\", got %s: %s", i, cases[i].msg, kvf_status_name(rc), kvf_last_error());
        assert_null(d);
    }
    synth_free(s);
}

/* Random byte changes in the header and the length must give an error or a
 * valid dump, never a crash (a small stand-in for the fuzzer). */
static void test_dump_corrupted(void **state) {
    (void)state;
    synth_cfg c = {1, 2, 8, 1, 1, 2, 64, 0.0};
    synth_dump *s = synth_make(&c);
    const char *path = tmp_file("small.safetensors");
    synth_write(s, path, NULL);
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    uint8_t *good = malloc(1 << 20), *bad = malloc(1 << 20);
    size_t n = fread(good, 1, 1 << 20, f);
    fclose(f);
    uint64_t hlen;
    memcpy(&hlen, good, 8);
    uint64_t st = 7;
    int ok = 0;
    for (int iter = 0; iter < 3000; iter++) {
        memcpy(bad, good, n);
        int flips = 1 + (int)(tu_splitmix(st++) % 4);
        for (int i = 0; i < flips; i++) {
            size_t at = (size_t)(tu_splitmix(st++) % (8 + hlen));
            static const char pool[] = "0123456789[]{}\",:-e. BF16I32";
            bad[at] = tu_splitmix(st++) & 1 ? (uint8_t)pool[tu_splitmix(st++) % (sizeof pool - 1)] : (uint8_t)tu_splitmix(st++);
        }
        size_t len = tu_splitmix(st++) % 8 == 0 ? (size_t)(tu_splitmix(st++) % n) : n;
        kvf_dump *d;
        if (kvf_dump_parse(bad, len, "fuzz", &d) == KVF_OK) {
            ok++;
            kvf_dump_close(d);
        }
    }
    printf("corrupted headers: %d of 3000 still valid dumps\n", ok);
    free(good);
    free(bad);
    synth_free(s);
}

/* ============================================================ runs */

static kvf_eval_report run_eval_opt(const kvf_scheme *s, const char *path, int device, int warm) {
    kvf_dump *d;
    assert_int_equal(kvf_dump_open(path, &d), KVF_OK);
    kvf_eval_options opt = {.device = device, .warm = warm};
    kvf_eval_report r;
    int rc = kvf_eval_run(s, d, &opt, &r);
    if (rc) fail_msg("kvf_eval_run: %s: %s", kvf_status_name(rc), kvf_last_error());
    kvf_dump_close(d);
    return r;
}

static kvf_eval_report run_eval(const kvf_scheme *s, const char *path, int device) {
    return run_eval_opt(s, path, device, 0);
}

static double packed_bytes(const kvf_scheme *s, int64_t tokens, int heads) {
    size_t b;
    assert_int_equal(kvf_packed_size(s, tokens, heads, &b), KVF_OK);
    return (double)b;
}

static void print_metrics(const char *name, const kvf_eval_metrics *m) {
    printf("%-10s top1_shift %.4f top5_overlap %.4f attn_out_rel_err %.4e key_mse %.4e value_mse %.4e qk_err %.4e "
           "compression %.3fx\n",
           name, m->top1_shift, m->top5_overlap, m->attn_out_rel_err, m->key_mse, m->value_mse, m->qk_err,
           m->compression);
}

/* A JSON report's metrics object (overall or a layer's) holds every metric as a number. */
static void assert_metrics_json(json_t *m) {
    static const char *const keys[] = {"top1_shift", "top5_overlap", "attn_out_rel_err", "key_mse", "value_mse",
                                       "qk_err", "compression"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        if (!json_is_number(json_object_get(m, keys[i]))) fail_msg("report: \"%s\" is not a number", keys[i]);
}

static void test_int4_beats_int2(void **state) {
    (void)state;
    synth_dump *sd = synth_make(&small_cfg);
    const char *path = tmp_file("e2e.safetensors");
    synth_write(sd, path, NULL);
    kvf_scheme *s2 = tu_scheme("rtn_int2"), *s4 = tu_scheme("rtn_int4");
    kvf_eval_report r2 = run_eval(s2, path, KVF_DEVICE_CPU), r4 = run_eval(s4, path, KVF_DEVICE_CPU);
    const kvf_eval_metrics *a = &r2.overall, *b = &r4.overall;
    print_metrics("rtn_int2", a);
    print_metrics("rtn_int4", b);
    assert_true(b->top1_shift < a->top1_shift);
    assert_true(b->top5_overlap > a->top5_overlap);
    assert_true(b->attn_out_rel_err < a->attn_out_rel_err);
    assert_true(b->key_mse < a->key_mse);
    assert_true(b->value_mse < a->value_mse);
    assert_true(b->qk_err < a->qk_err);
    assert_true(a->top1_shift > 0 && a->top5_overlap < 1 && b->attn_out_rel_err > 0);
    /* INT2 stores fewer bytes: every chunk packed at the end of the stream */
    const double bf16 = 3.0 * 4 * 2 * 64 * 128;
    assert_float_equal(a->compression, bf16 / (3 * packed_bytes(s2, 64, 2)), 1e-12);
    assert_float_equal(b->compression, bf16 / (3 * packed_bytes(s4, 64, 2)), 1e-12);
    assert_true(a->compression > b->compression);
    /* weights: chunks 1 and 2 score 4 heads x 32 queries; chunk c sees c packed chunks */
    assert_true(a->queries == 2 * 4 * 32 && a->key_tokens == (1 + 2) * 64 * 2 && a->kv_values == a->key_tokens * 128);
    /* one layer: the layer is the overall */
    assert_memory_equal(&r2.layer[0], &r2.overall, sizeof r2.overall);

    char *json = kvf_eval_report_json(&r2);
    assert_non_null(json);
    json_error_t err;
    json_t *root = json_loads(json, 0, &err);
    assert_non_null(root);
    json_t *ov = json_object_get(root, "overall");
    assert_metrics_json(ov);
    assert_float_equal(json_number_value(json_object_get(ov, "top1_shift")), a->top1_shift, 1e-9);
    json_t *layers = json_object_get(root, "layers");
    assert_int_equal(json_array_size(layers), 1);
    json_t *l0 = json_array_get(layers, 0);
    assert_int_equal(json_integer_value(json_object_get(l0, "layer")), 0);
    assert_metrics_json(l0);
    assert_int_equal(json_array_size(json_object_get(l0, "chunks")), 2);
    json_decref(root);
    free(json);
    kvf_eval_print_table(&r2, stdout);

    kvf_eval_report_free(&r2);
    kvf_eval_report_free(&r4);
    kvf_scheme_free(s2);
    kvf_scheme_free(s4);
    synth_free(sd);
}

/* BF16 "quantization": nothing changes. */
static void test_bf16_scheme_exact(void **state) {
    (void)state;
    synth_dump *sd = synth_make(&small_cfg);
    const char *path = tmp_file("bf16.safetensors");
    synth_write(sd, path, NULL);
    kvf_scheme *s = tu_scheme_text("return { base = 'rtn_int2', key = { bits = 16 }, value = { bits = 16 } }");
    kvf_eval_report r = run_eval(s, path, KVF_DEVICE_CPU);
    const kvf_eval_metrics *m = &r.overall;
    assert_true(m->top1_shift == 0 && m->top5_overlap == 1 && m->attn_out_rel_err == 0 && m->key_mse == 0 &&
                m->value_mse == 0 && m->qk_err == 0);
    assert_true(m->compression < 1.0); /* the header and alignment cost bytes */
    kvf_eval_report_free(&r);
    kvf_scheme_free(s);
    synth_free(sd);
}

/* sink, recent and span decide what is packed when (docs/QUALITY.md). */
static void test_chunk_policy(void **state) {
    (void)state;
    synth_cfg c = small_cfg;
    c.chunks = 4;
    c.layers = 2;
    synth_dump *sd = synth_make(&c);
    const char *path = tmp_file("policy.safetensors");
    synth_write(sd, path, NULL);
    const double B = 4.0 * 2 * 64 * 128; /* BF16 bytes of one chunk's K and V */

    /* sink 1, recent 1: chunk 1 is packed after step 2, chunk 2 after step 3;
     * chunks 0 and 3 stay BF16. Only step 3 sees a packed chunk. */
    kvf_scheme *s = tu_scheme_text("return { base = 'rtn_int2', chunk = { sink = 1, recent = 1 } }");
    kvf_eval_report r = run_eval(s, path, KVF_DEVICE_CPU);
    for (int l = 0; l < 2; l++) {
        assert_float_equal(r.layer[l].compression, 4 * B / (2 * packed_bytes(s, 64, 2) + 2 * B), 1e-12);
        assert_true(r.layer[l].key_tokens == 64 * 2);
        assert_true(r.step[l * 4 + 1].kv_values == 0 && r.step[l * 4 + 2].kv_values == 0 &&
                    r.step[l * 4 + 3].key_tokens == 64 * 2);
        assert_true(isnan(r.step[l * 4 + 1].key_mse) && r.step[l * 4 + 1].attn_out_rel_err == 0);
    }
    assert_float_equal(r.overall.compression, r.layer[0].compression, 1e-12);
    /* held after steps 0..3: B, 2B, 2B + P (chunk 1 packed), 2B + 2P */
    const double P1 = packed_bytes(s, 64, 2);
    assert_float_equal(r.overall.compression_held, 10 * B / (7 * B + 3 * P1), 1e-12);
    assert_true(r.overall.queries == 2 * 3 * 4 * 32);
    kvf_eval_report_free(&r);
    kvf_scheme_free(s);

    /* span 2: chunks 0-1 packed after step 1, chunks 2-3 after step 3. */
    s = tu_scheme_text("return { base = 'rtn_int2', chunk = { span = 2 } }");
    r = run_eval(s, path, KVF_DEVICE_CPU);
    assert_float_equal(r.layer[0].compression, 4 * B / (2 * packed_bytes(s, 128, 2)), 1e-12);
    /* the open span is BF16: held after steps 0..3: B, P2, P2 + B, 2 P2 */
    const double P2 = packed_bytes(s, 128, 2);
    assert_float_equal(r.layer[0].compression_held, 10 * B / (2 * B + 4 * P2), 1e-12);
    assert_true(r.layer[0].compression_held < r.layer[0].compression);
    assert_true(r.step[1].key_tokens == 0 && r.step[2].key_tokens == 128 * 2 && r.step[3].key_tokens == 128 * 2);
    kvf_eval_report_free(&r);
    kvf_scheme_free(s);

    /* span 3 over 4 chunks: chunks 0-2 packed after step 2, chunk 3 never. */
    s = tu_scheme_text("return { base = 'rtn_int2', chunk = { span = 3 } }");
    r = run_eval(s, path, KVF_DEVICE_CPU);
    assert_float_equal(r.layer[1].compression, 4 * B / (packed_bytes(s, 192, 2) + B), 1e-12);
    assert_true(r.step[3].key_tokens == 192 * 2);
    kvf_eval_report_free(&r);
    kvf_scheme_free(s);
    synth_free(sd);
}

/* Squared errors of chunk c's K and V of layer l after decoding `packed`
 * (one chunk, all KV heads), added to sum[0] (K) and sum[1] (V). */
static void add_sq_err(kvf_context *ctx, const synth_dump *sd, int l, int c, const void *packed, size_t bytes,
                       double sum[2]) {
    const synth_cfg *g = &sd->c;
    const size_t n = (size_t)g->kv_heads * g->tokens * g->d;
    uint16_t *k = malloc(n * 2), *v = malloc(n * 2);
    kvf_shape sh = {g->tokens, g->kv_heads, 0, 0};
    assert_int_equal(kvf_decode(ctx, packed, bytes, &sh, NULL, k, v, NULL), KVF_OK);
    const uint16_t *rk = sd->k[l * g->chunks + c], *rv = sd->v[l * g->chunks + c];
    for (size_t i = 0; i < n; i++) {
        double ek = (double)kvf_bf16_to_f32(rk[i]) - kvf_bf16_to_f32(k[i]);
        double ev = (double)kvf_bf16_to_f32(rv[i]) - kvf_bf16_to_f32(v[i]);
        sum[0] += ek * ek;
        sum[1] += ev * ev;
    }
    free(k);
    free(v);
}

/* --warm: each span's k-means starts from the previous span of its layer
 * (kvf_encode_warm). A layer's first span is encoded cold, and a scheme
 * without k-means gives the cold run's numbers. */
static void test_warm_start(void **state) {
    (void)state;
    synth_cfg c = small_cfg;
    c.chunks = 4;
    c.layers = 2;
    synth_dump *sd = synth_make(&c);
    const char *path = tmp_file("warm.safetensors");
    synth_write(sd, path, NULL);
    /* 16 centroids for 64 tokens a chunk: the start matters */
    kvf_scheme *s = tu_scheme_text("return { base = 'qvg_int2', key = { centroids = 16 }, value = { centroids = 16 } }");
    kvf_eval_report cold = run_eval_opt(s, path, KVF_DEVICE_CPU, 0), warm = run_eval_opt(s, path, KVF_DEVICE_CPU, 1);
    assert_true(!cold.warm && warm.warm && warm.has_centroids);
    print_metrics("cold", &cold.overall);
    print_metrics("warm", &warm.overall);
    for (int l = 0; l < 2; l++) {
        /* step 1 sees chunk 0 packed, the layer's first span: cold in both runs */
        assert_memory_equal(&cold.step[l * 4 + 1], &warm.step[l * 4 + 1], sizeof cold.step[0]);
        for (int t = 2; t < 4; t++)
            if (cold.step[l * 4 + t].key_mse == warm.step[l * 4 + t].key_mse ||
                cold.step[l * 4 + t].value_mse == warm.step[l * 4 + t].value_mse)
                fail_msg("layer %d, step %d: the warm start changed nothing", l, t);
    }
    /* Step 2 of layer 1 is chunk 0 encoded cold and chunk 1 warm-started from
     * chunk 0's packed cache, through the API. */
    kvf_context *ctx;
    assert_int_equal(kvf_context_create(s, KVF_DEVICE_CPU, &ctx), KVF_OK);
    size_t bytes;
    assert_int_equal(kvf_packed_size(s, c.tokens, c.kv_heads, &bytes), KVF_OK);
    uint8_t *p0 = malloc(bytes), *p1 = malloc(bytes);
    kvf_shape sh = {c.tokens, c.kv_heads, 0, 0};
    const int l = 1;
    assert_int_equal(kvf_encode(ctx, sd->k[l * 4], sd->v[l * 4], &sh, NULL, p0, bytes, NULL), KVF_OK);
    assert_int_equal(kvf_encode_warm(ctx, sd->k[l * 4 + 1], sd->v[l * 4 + 1], &sh, NULL, p0, bytes, c.tokens, p1,
                                     bytes, NULL),
                     KVF_OK);
    double sum[2] = {0, 0};
    add_sq_err(ctx, sd, l, 0, p0, bytes, sum);
    add_sq_err(ctx, sd, l, 1, p1, bytes, sum);
    const double values = 2.0 * c.kv_heads * c.tokens * c.d;
    const kvf_eval_metrics *m = &warm.step[l * 4 + 2];
    assert_true(m->kv_values == values);
    assert_float_equal(m->key_mse, sum[0] / values, 1e-12 * m->key_mse);
    assert_float_equal(m->value_mse, sum[1] / values, 1e-12 * m->value_mse);
    free(p0);
    free(p1);
    kvf_context_destroy(ctx);
    /* the report says so */
    char *json = kvf_eval_report_json(&warm);
    json_error_t err;
    json_t *root = json_loads(json, 0, &err);
    assert_non_null(root);
    assert_true(json_is_true(json_object_get(json_object_get(root, "policy"), "warm_start")));
    json_decref(root);
    free(json);
    kvf_eval_report_free(&cold);
    kvf_eval_report_free(&warm);
    kvf_scheme_free(s);

    /* no k-means: the same numbers */
    s = tu_scheme("rtn_int2");
    cold = run_eval_opt(s, path, KVF_DEVICE_CPU, 0);
    warm = run_eval_opt(s, path, KVF_DEVICE_CPU, 1);
    assert_false(warm.has_centroids);
    assert_memory_equal(&cold.overall, &warm.overall, sizeof cold.overall);
    kvf_eval_report_free(&cold);
    kvf_eval_report_free(&warm);
    kvf_scheme_free(s);
    synth_free(sd);
}

static void test_mismatch_errors(void **state) {
    (void)state;
    synth_dump *sd = synth_make(&small_cfg);
    const char *path = tmp_file("mm.safetensors");
    synth_write(sd, path, NULL);
    kvf_dump *d;
    assert_int_equal(kvf_dump_open(path, &d), KVF_OK);
    kvf_eval_options opt = {.device = KVF_DEVICE_CPU, .threads = 1};
    kvf_eval_report r;
    kvf_scheme *s = tu_scheme_text("return { base = 'rtn_int2', head_dim = 64 }");
    assert_error_has(kvf_eval_run(s, d, &opt, &r), KVF_EINVAL, "head_dim = 128, scheme scheme has head_dim = 64");
    kvf_scheme_free(s);
    s = tu_scheme_text("return { base = 'rtn_int2', rope = { placement = 'pre', theta = 500.0 } }");
    int rc = kvf_eval_run(s, d, &opt, &r);
    assert_true(rc != KVF_OK && strstr(kvf_last_error(), "RoPE"));
    kvf_scheme_free(s);
    kvf_dump_close(d);
    synth_free(sd);
}

/* The GPU gives the CPU's numbers (RTN decode is bit-identical; so are
 * QVG's encode and decode, also warm-started, with assign = "exact"). */
static void test_gpu_matches_cpu(void **state) {
    (void)state;
    int n = 0;
    if (kvf_device_count(&n) != KVF_OK || n == 0) {
        printf("skipped: no GPU (%s)\n", kvf_last_error());
        skip();
    }
    synth_dump *sd = synth_make(&small_cfg);
    const char *path = tmp_file("gpu.safetensors");
    synth_write(sd, path, NULL);
    kvf_scheme *s = tu_scheme("rtn_int2");
    kvf_eval_report c = run_eval(s, path, KVF_DEVICE_CPU), g = run_eval(s, path, 0);
    printf("GPU backend: %s\n", g.backend);
    assert_memory_equal(&c.overall, &g.overall, sizeof c.overall);
    kvf_eval_report_free(&c);
    kvf_eval_report_free(&g);
    kvf_scheme_free(s);
    s = tu_scheme_text("return { base = 'qvg_int2', key = { centroids = 16, assign = 'exact' }, "
                       "value = { centroids = 16, assign = 'exact' } }");
    c = run_eval_opt(s, path, KVF_DEVICE_CPU, 1);
    g = run_eval_opt(s, path, 0, 1);
    assert_memory_equal(&c.overall, &g.overall, sizeof c.overall);
    kvf_eval_report_free(&c);
    kvf_eval_report_free(&g);
    kvf_scheme_free(s);
    synth_free(sd);
}

/* `kvforge eval --json` through the command line (the binary `make test` built). */
static void test_cli_json(void **state) {
    (void)state;
    char bin[1200], cmd[4096];
    if (!tu_built_program("kvforge", bin, sizeof bin)) skip();
    synth_dump *sd = synth_make(&small_cfg);
    const char *path = tmp_file("cli.safetensors"), *json_path = tmp_file("cli.json");
    synth_write(sd, path, NULL);
    json_error_t err;
    for (int warm = 0; warm < 2; warm++) {
        snprintf(cmd, sizeof cmd, "'%s' eval --scheme qvg_int2 --data '%s' --json --threads 2%s > '%s'", bin, path,
                 warm ? " --warm" : "", json_path);
        assert_int_equal(system(cmd), 0);
        json_t *root = json_load_file(json_path, 0, &err);
        if (!root) fail_msg("%s: %s", json_path, err.text);
        json_t *ov = json_object_get(root, "overall");
        assert_metrics_json(ov);
        assert_string_equal(json_string_value(json_object_get(root, "backend")), "CPU reference");
        assert_int_equal(json_array_size(json_object_get(root, "layers")), 1);
        assert_true(json_is_boolean(json_object_get(json_object_get(root, "policy"), "warm_start")));
        assert_int_equal(json_is_true(json_object_get(json_object_get(root, "policy"), "warm_start")), warm);
        json_decref(root);
    }
    /* a bad dump: exit status 1 and the tensor named on stderr */
    synth_write_opts bad = {.wrong_dtype = "l0.c1.v"};
    synth_write(sd, path, &bad);
    snprintf(cmd, sizeof cmd, "'%s' eval --scheme rtn_int4 --data '%s' > '%s' 2>&1", bin, path, json_path);
    int status = system(cmd);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 1);
    FILE *f = fopen(json_path, "r");
    char line[1024] = "";
    assert_non_null(fgets(line, sizeof line, f));
    fclose(f);
    assert_non_null(strstr(line, "\"l0.c1.v\": dtype F32, expected BF16"));
    synth_free(sd);
}

/* ============================================================ recon files (peers) */

/* The metrics of a and b equal bit for bit (NaN included), but for the held
 * ratio when b is a peer's (its recon has the bytes at the end only: NaN). */
static void assert_same_metrics(const kvf_eval_metrics *a, const kvf_eval_metrics *b, int peer) {
    kvf_eval_metrics x = *a;
    if (peer) {
        assert_true(isnan(b->compression_held));
        x.compression_held = b->compression_held;
    }
    assert_memory_equal(&x, b, sizeof x);
}

/* Every metric of two reports equal bit for bit (NaN included): overall, per layer, per step. */
static void assert_same_report(const kvf_eval_report *a, const kvf_eval_report *b) {
    assert_int_equal(a->layers, b->layers);
    assert_int_equal(a->chunks, b->chunks);
    assert_same_metrics(&a->overall, &b->overall, b->peer && !a->peer);
    for (int l = 0; l < a->layers; l++) assert_same_metrics(&a->layer[l], &b->layer[l], b->peer && !a->peer);
    assert_memory_equal(a->step, b->step, (size_t)a->layers * a->chunks * sizeof *a->step);
}

/* A scheme's cache written as a recon file (--write-recon) and scored as a
 * peer gives exactly the scheme's numbers: the peer path is the scheme path. */
static void test_recon_matches_scheme(void **state) {
    (void)state;
    synth_cfg c = small_cfg;
    c.layers = 2;
    c.chunks = 4;
    synth_dump *sd = synth_make(&c);
    const char *path = tmp_file("recon_dump.safetensors"), *rpath = tmp_file("recon.safetensors");
    synth_write(sd, path, NULL);
    static const char *const schemes[] = {
        "return { base = 'rtn_int2' }",
        "return { base = 'qvg_int2' }",
        "return { base = 'kivi_int2' }",                               /* recent = 1: exact chunks in the history */
        "return { base = 'quantwm_int2', chunk = { sink = 1, span = 2 } }", /* query statistics, sink, span */
        "return { base = 'rtn_int4', name = 'pre', rope = { placement = 'pre', sections = {16, 24, 24} } }",
        /* the pipeline: anchor spans (chunks 0 and 2), the carried error, a channel map */
        "return { base = 'stable_int2', anchors = { every = 2, bits = 8 } }",
    };
    const char *table = tmp_file("recon_table.json");
    kvf_dump *d;
    assert_int_equal(kvf_dump_open(path, &d), KVF_OK);
    for (size_t i = 0; i < sizeof schemes / sizeof schemes[0]; i++) {
        kvf_scheme *s = tu_scheme_text(schemes[i]);
        kvf_eval_options opt = {.device = KVF_DEVICE_CPU, .threads = 2, .recon_out = rpath};
        if (i == 5) {
            kvf_eval_report none;
            assert_int_equal(kvf_eval_run(s, d, &opt, &none), KVF_EINVAL); /* no table */
            assert_non_null(strstr(kvf_last_error(), "kvforge calibrate"));
            if (kvf_calibrate(s, d, 0, 2, table, NULL, NULL)) fail_msg("%s", kvf_last_error());
            opt.table = table;
        }
        kvf_eval_report a, b;
        int rc = kvf_eval_run(s, d, &opt, &a);
        if (rc) fail_msg("%s: %s", schemes[i], kvf_last_error());
        kvf_recon *r;
        if (kvf_recon_open(rpath, &r)) fail_msg("%s", kvf_last_error());
        assert_int_equal(r->n_parts, 4);
        assert_int_equal(r->sink, a.sink);
        assert_int_equal(r->span, a.span);
        assert_string_equal(r->name, a.scheme_id);
        opt.threads = 1; /* the metrics do not depend on it */
        rc = kvf_eval_run_peer(r, d, &opt, &b);
        if (rc) fail_msg("%s: peer: %s", schemes[i], kvf_last_error());
        print_metrics(a.scheme_id, &a.overall);
        assert_same_report(&a, &b);
        assert_true(b.peer && !a.peer);
        assert_true(a.overall.stored_bytes > 0 && a.overall.kv_values > 0);
        for (int p = 0; p < 4; p++) assert_true(a.part_bytes[p] == b.part_bytes[p]);
        if (i == 2) assert_true(a.part_bytes[1] > 0); /* KIVI's recent chunk */
        if (i == 3) assert_true(a.part_bytes[2] > 0); /* QuantWM's statistics */
        if (i == 5) { /* per layer: one span of carried error (f32 K and V); two anchors of four spans */
            assert_true(a.part_bytes[3] == 2.0 * 4 * c.layers * c.kv_heads * c.tokens * c.d);
            assert_int_equal(a.anchor_spans, 2 * c.layers);
            assert_string_equal(a.table, table);
        } else {
            assert_true(a.part_bytes[3] == 0);
        }
        kvf_eval_report_free(&a);
        kvf_eval_report_free(&b);
        kvf_recon_close(r);
        kvf_scheme_free(s);
    }
    kvf_dump_close(d);
    synth_free(sd);
}

/* Tweaks of a hand-made recon file (the dump's own K/V as the history). */
typedef struct recon_opts {
    int flag;                      /* the packed flag of every chunk (0 or 1) */
    const char *drop;              /* a tensor left out */
    const char *wrong_dtype;       /* a tensor written as F32 */
    const char *wrong_shape;       /* a tensor one element longer in its last dimension */
    const char *extra;             /* an extra tensor */
    int bad_flag;                  /* l0.s2.packed[1] = 2 */
    int64_t bytes0;                /* l0.stored_bytes[0] */
    int flip;                      /* flip a bit of l0.s2.k's chunk 1, head 1 */
    const char *meta_key, *meta_value; /* one metadata value replaced ("" = removed) */
} recon_opts;

static void recon_write(const synth_dump *sd, const char *path, const recon_opts *o) {
    const synth_cfg *c = &sd->c;
    const size_t n = (size_t)c->tokens * c->d;
    int nt = 0, cap = c->layers * (3 * c->chunks + 2);
    kvf_st_write_tensor *t = calloc((size_t)cap, sizeof *t);
    char (*names)[40] = calloc((size_t)cap, 40);
    void **owned = calloc((size_t)cap, sizeof *owned);
    int64_t *bytes = calloc((size_t)c->layers * 2, sizeof *bytes);
    for (int l = 0; l < c->layers; l++) {
        for (int st = 1; st < c->chunks; st++) {
            for (int x = 0; x < 3; x++) {
                static const char *const role[3] = {"k", "v", "packed"};
                snprintf(names[nt], 40, "l%d.s%d.%s", l, st, role[x]);
                if (o->drop && !strcmp(o->drop, names[nt])) continue;
                kvf_st_write_tensor *w = &t[nt];
                w->name = names[nt];
                if (x < 2) {
                    uint16_t *h = malloc((size_t)c->kv_heads * st * n * 2);
                    for (int hd = 0; hd < c->kv_heads; hd++)
                        for (int i = 0; i < st; i++) {
                            const uint16_t *src = (x ? sd->v : sd->k)[l * c->chunks + i] + (size_t)hd * n;
                            memcpy(h + ((size_t)hd * st + i) * n, src, n * 2);
                        }
                    if (o->flip && l == 0 && st == 2 && x == 0) h[((size_t)1 * st + 1) * n + 3] ^= 1;
                    *w = (kvf_st_write_tensor){names[nt], KVF_ST_BF16, 3, {c->kv_heads, (int64_t)st * c->tokens, c->d}, h};
                } else {
                    uint8_t *f = malloc((size_t)st);
                    memset(f, o->flag, (size_t)st);
                    if (o->bad_flag && l == 0 && st == 2) f[1] = 2;
                    *w = (kvf_st_write_tensor){names[nt], KVF_ST_U8, 1, {st}, f};
                }
                owned[nt] = (void *)w->data;
                if (o->wrong_dtype && !strcmp(o->wrong_dtype, names[nt])) {
                    static const float zeros[4];
                    w->dtype = KVF_ST_F32;
                    w->shape[w->ndim - 1] = x < 2 ? c->d / 2 : 1; /* the K/V bytes; a flag's: one float */
                    if (x == 2) w->data = zeros;
                }
                if (o->wrong_shape && !strcmp(o->wrong_shape, names[nt])) {
                    w->shape[w->ndim - 1] -= 1;
                }
                nt++;
            }
        }
        snprintf(names[nt], 40, "l%d.stored_bytes", l);
        bytes[2 * l] = l == 0 ? o->bytes0 : 1000;
        bytes[2 * l + 1] = 24;
        if (!(o->drop && !strcmp(o->drop, names[nt]))) {
            t[nt] = (kvf_st_write_tensor){names[nt], KVF_ST_I64, 1, {2}, bytes + 2 * l};
            nt++;
        }
    }
    uint8_t extra[4] = {0};
    if (o->extra) t[nt++] = (kvf_st_write_tensor){o->extra, KVF_ST_U8, 1, {4}, extra};
    char num[5][16];
    snprintf(num[0], 16, "%d", c->layers);
    snprintf(num[1], 16, "%d", c->chunks);
    snprintf(num[2], 16, "%d", c->kv_heads);
    snprintf(num[3], 16, "%d", c->d);
    snprintf(num[4], 16, "%d", c->tokens);
    const char *meta[] = {"format", "kvforge-recon 1", "layers", num[0], "chunks", num[1], "kv_heads", num[2],
                          "head_dim", num[3], "tokens_per_chunk", num[4], "sink", "0", "recent", "0", "span", "1",
                          "name", "hand", "stored_bytes_parts", "codes,extra_1", "peer", "test_eval"};
    int n_meta = (int)(sizeof meta / sizeof meta[0] / 2);
    for (int i = 0; i < n_meta && o->meta_key; i++)
        if (!strcmp(meta[2 * i], o->meta_key)) {
            if (*o->meta_value) meta[2 * i + 1] = o->meta_value;
            else {
                meta[2 * i] = meta[2 * (n_meta - 1)];
                meta[2 * i + 1] = meta[2 * (n_meta - 1) + 1];
                n_meta--;
            }
            break;
        }
    assert_int_equal(kvf_st_write(path, meta, n_meta, t, nt), KVF_OK);
    for (int i = 0; i < cap; i++) free(owned[i]);
    free(owned);
    free(t);
    free(names);
    free(bytes);
}

/* A lossless peer (the dump's own K/V, marked packed): zero errors, its bytes
 * as it declares them; marked exact: nothing counted as packed. */
static void test_recon_lossless(void **state) {
    (void)state;
    synth_dump *sd = synth_make(&small_cfg);
    const char *path = tmp_file("ll_dump.safetensors"), *rpath = tmp_file("ll.safetensors");
    synth_write(sd, path, NULL);
    kvf_dump *d;
    assert_int_equal(kvf_dump_open(path, &d), KVF_OK);
    for (int flag = 0; flag < 2; flag++) {
        recon_opts o = {.flag = flag, .bytes0 = 4000};
        recon_write(sd, rpath, &o);
        kvf_recon *r;
        if (kvf_recon_open(rpath, &r)) fail_msg("%s", kvf_last_error());
        kvf_eval_options opt = {.device = KVF_DEVICE_CPU, .threads = 1};
        kvf_eval_report rep;
        if (kvf_eval_run_peer(r, d, &opt, &rep)) fail_msg("%s", kvf_last_error());
        const kvf_eval_metrics *m = &rep.overall;
        assert_true(m->top1_shift == 0 && m->top5_overlap == 1 && m->attn_out_rel_err == 0);
        assert_true(m->stored_bytes == 4024 && m->bf16_bytes == 3.0 * 4 * 2 * 64 * 128);
        assert_true(rep.n_parts == 2 && !strcmp(rep.part_name[1], "extra_1") && rep.part_bytes[0] == 4000);
        /* steps 1 and 2 see 1 and 2 packed chunks of 64 tokens x 2 heads */
        if (flag) assert_true(m->key_tokens == 3 * 64 * 2 && m->key_mse == 0 && m->qk_err == 0);
        else assert_true(m->key_tokens == 0 && isnan(m->key_mse));
        char *js = kvf_eval_report_json(&rep);
        assert_non_null(js);
        assert_non_null(strstr(js, "\"kind\": \"peer\""));
        assert_non_null(strstr(js, "\"extra_1\": 24"));
        free(js);
        kvf_eval_report_free(&rep);
        kvf_recon_close(r);
    }
    kvf_dump_close(d);
    synth_free(sd);
}

static void test_recon_malformed(void **state) {
    (void)state;
    synth_dump *sd = synth_make(&small_cfg);
    const char *path = tmp_file("bad_dump.safetensors"), *rpath = tmp_file("bad.safetensors");
    synth_write(sd, path, NULL);
    kvf_dump *d;
    assert_int_equal(kvf_dump_open(path, &d), KVF_OK);
    const struct { recon_opts o; const char *msg; } bad[] = {
        {{.drop = "l0.s2.v"}, "tensor \"l0.s2.v\" is missing"},
        {{.drop = "l0.stored_bytes"}, "\"l0.stored_bytes\" is missing"},
        {{.wrong_dtype = "l0.s1.k"}, "\"l0.s1.k\": dtype F32, expected BF16"},
        {{.wrong_dtype = "l0.s2.packed"}, "\"l0.s2.packed\": dtype F32, expected U8"},
        {{.wrong_shape = "l0.s2.v"}, "\"l0.s2.v\": shape [2, 128, 127], expected [kv_heads = 2, 2 chunks x 64"},
        {{.wrong_shape = "l0.s1.packed"}, "\"l0.s1.packed\": shape [0], expected [1]"},
        {{.extra = "l0.s3.k"}, "unexpected tensor \"l0.s3.k\""},
        {{.extra = "l0.s0.k"}, "unexpected tensor \"l0.s0.k\""},
        {{.extra = "notes"}, "unexpected tensor \"notes\""},
        {{.bad_flag = 1}, "\"l0.s2.packed\": element 1 is 2, must be 0 (exact) or 1 (packed)"},
        {{.bytes0 = -5}, "part \"codes\" = -5 bytes"},
        {{.meta_key = "format", .meta_value = ""}, "metadata \"format\" is missing, expected \"kvforge-recon 1\""},
        {{.meta_key = "format", .meta_value = "kvforge-recon 2"}, "\"format\" is \"kvforge-recon 2\""},
        {{.meta_key = "name", .meta_value = ""}, "metadata \"name\" is missing"},
        {{.meta_key = "span", .meta_value = "0"}, "\"span\" = \"0\": must be an integer in [1, 65536]"},
        {{.meta_key = "stored_bytes_parts", .meta_value = "codes,,x"}, "\"stored_bytes_parts\" = \"codes,,x\""},
        {{.meta_key = "stored_bytes_parts", .meta_value = "Codes,x"}, "must be 1..8 comma-separated names"},
        {{.meta_key = "stored_bytes_parts", .meta_value = "codes"}, "\"l0.stored_bytes\": shape [2], expected [1]"},
        {{.meta_key = "chunks", .meta_value = "9"}, "tensor \"l0.s3.k\" is missing"},
        {{.meta_key = "chunks", .meta_value = "65536"}, "1 layers x 65536 chunks need 196606 tensors, the file has 7"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        recon_opts o = bad[i].o;
        o.flag = 1;
        if (!o.bytes0) o.bytes0 = 10;
        recon_write(sd, rpath, &o);
        kvf_recon *r = (kvf_recon *)1;
        int rc = kvf_recon_open(rpath, &r);
        if (rc != KVF_EFORMAT || !strstr(kvf_last_error(), bad[i].msg))
            fail_msg("case %zu: status %d, message \"%s\", expected \"%s\"", i, rc, kvf_last_error(), bad[i].msg);
        assert_null(r);
    }
    /* valid alone, but not a recon of this dump */
    recon_opts other = {.flag = 1, .bytes0 = 10, .meta_key = "tokens_per_chunk", .meta_value = "32"};
    synth_cfg half = small_cfg;
    half.tokens = 32;
    synth_dump *sd2 = synth_make(&half);
    recon_write(sd2, rpath, &other);
    kvf_recon *r;
    assert_int_equal(kvf_recon_open(rpath, &r), KVF_OK);
    kvf_eval_options opt = {.device = KVF_DEVICE_CPU, .threads = 1};
    kvf_eval_report rep;
    assert_error_has(kvf_eval_run_peer(r, d, &opt, &rep), KVF_EFORMAT, "tokens_per_chunk = 32, but the dump");
    kvf_recon_close(r);
    synth_free(sd2);
    /* a chunk marked exact that is not the dump's */
    recon_opts flip = {.flag = 0, .bytes0 = 10, .flip = 1};
    recon_write(sd, rpath, &flip);
    assert_int_equal(kvf_recon_open(rpath, &r), KVF_OK);
    assert_error_has(kvf_eval_run_peer(r, d, &opt, &rep), KVF_EFORMAT,
                     "\"l0.s2.k\": chunk 1 (KV head 1) is marked exact (packed = 0) but differs from the dump's "
                     "\"l0.c1.k\"");
    kvf_recon_close(r);
    /* a dump is not a recon */
    assert_error_has(kvf_recon_open(path, &r), KVF_EFORMAT, "metadata \"format\" is missing");
    kvf_dump_close(d);
    synth_free(sd);
}

/* `kvforge eval --write-recon` then `--peer` through the command line; option errors. */
static void test_cli_peer(void **state) {
    (void)state;
    char bin[1200], cmd[4096];
    if (!tu_built_program("kvforge", bin, sizeof bin)) skip();
    synth_dump *sd = synth_make(&small_cfg);
    const char *path = tmp_file("clip.safetensors"), *rpath = tmp_file("clip_recon.safetensors");
    const char *a = tmp_file("clip_a.json"), *b = tmp_file("clip_b.json"), *e = tmp_file("clip_err.txt");
    synth_write(sd, path, NULL);
    snprintf(cmd, sizeof cmd, "'%s' eval --scheme rtn_int2 --data '%s' --json --threads 2 --write-recon '%s' > '%s'",
             bin, path, rpath, a);
    assert_int_equal(system(cmd), 0);
    snprintf(cmd, sizeof cmd, "'%s' eval --peer '%s' --data '%s' --json > '%s'", bin, rpath, path, b);
    assert_int_equal(system(cmd), 0);
    json_error_t err;
    json_t *ja = json_load_file(a, 0, &err), *jb = json_load_file(b, 0, &err);
    assert_non_null(ja);
    assert_non_null(jb);
    assert_string_equal(json_string_value(json_object_get(ja, "kind")), "scheme");
    assert_string_equal(json_string_value(json_object_get(jb, "kind")), "peer");
    /* the peer's held ratio is unknown (null); the scheme's is a number */
    assert_true(json_is_real(json_object_get(json_object_get(ja, "overall"), "compression_held")));
    assert_true(json_is_null(json_object_get(json_object_get(jb, "overall"), "compression_held")));
    json_object_del(json_object_get(ja, "overall"), "compression_held");
    json_object_del(json_object_get(jb, "overall"), "compression_held");
    json_t *la = json_object_get(ja, "layers"), *lb = json_object_get(jb, "layers");
    for (size_t i = 0; i < json_array_size(la) && i < json_array_size(lb); i++) {
        json_object_del(json_array_get(la, i), "compression_held");
        json_object_del(json_array_get(lb, i), "compression_held");
    }
    assert_true(json_equal(json_object_get(ja, "overall"), json_object_get(jb, "overall")));
    assert_true(json_equal(la, lb));
    assert_true(json_equal(json_object_get(ja, "stored_bytes_parts"), json_object_get(jb, "stored_bytes_parts")));
    json_decref(ja);
    json_decref(jb);
    static const struct { const char *args, *msg; } bad[] = {
        {"--peer R --data D --gpu", "--peer takes no --gpu"},
        {"--peer R --data D --warm", "--peer takes no --warm"},
        {"--peer R --scheme rtn_int2 --data D", "one of --scheme or --peer"},
        {"--peer R", "one of --scheme or --peer"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(cmd, sizeof cmd, "'%s' eval %s > '%s' 2>&1", bin, bad[i].args, e);
        int status = system(cmd);
        assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 2);
        char text[4096] = "";
        FILE *f = fopen(e, "r");
        size_t n = fread(text, 1, sizeof text - 1, f);
        text[n] = 0;
        fclose(f);
        if (!strstr(text, bad[i].msg)) fail_msg("'%s': \"%s\" not in: %s", bad[i].args, bad[i].msg, text);
    }
    /* the dump given as the recon: exit 1 and why */
    snprintf(cmd, sizeof cmd, "'%s' eval --peer '%s' --data '%s' > '%s' 2>&1", bin, path, path, e);
    int status = system(cmd);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 1);
    char text[4096] = "";
    FILE *f = fopen(e, "r");
    size_t n = fread(text, 1, sizeof text - 1, f);
    text[n] = 0;
    fclose(f);
    assert_non_null(strstr(text, "(not a recon file?)"));
    synth_free(sd);
}

/* ============================================================ what is wrong with a run */

/* Element (head, token, channel) of a [heads][tokens][d] BF16 tensor set to x. */
static void poke(uint16_t *t, int tokens, int d, int head, int token, int channel, float x) {
    t[((size_t)head * tokens + token) * d + channel] = kvf_f32_to_bf16(x);
}

static kvf_eval_report run_path(const kvf_scheme *s, const char *path, const kvf_eval_options *opt, int *rc) {
    kvf_dump *d;
    assert_int_equal(kvf_dump_open(path, &d), KVF_OK);
    kvf_eval_report r;
    *rc = kvf_eval_run(s, d, opt, &r);
    kvf_dump_close(d);
    return r;
}

/* Run the CLI (cmd, stdout and stderr to files); returns the exit status and
 * stderr's text in err. */
static int run_cli(const char *cmd, const char *out_path, const char *err_path, char *err, size_t cap) {
    char line[4096];
    snprintf(line, sizeof line, "%s > '%s' 2> '%s'", cmd, out_path, err_path);
    int status = system(line);
    FILE *f = fopen(err_path, "r");
    assert_non_null(f);
    size_t n = fread(err, 1, cap - 1, f);
    err[n] = 0;
    fclose(f);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* NaN and infinities in K, V and Q: counted per tensor as read, the first
 * one's place kept, the metrics they enter undefined (not a perfect score),
 * the JSON and the warning say so; strict makes them an error. */
static void test_nonfinite(void **state) {
    (void)state;
    synth_cfg c = small_cfg; /* 3 chunks of 64 tokens, 2 KV heads, 4 query heads, 32 queries */
    c.layers = 2;
    synth_dump *sd = synth_make(&c);
    const char *path = tmp_file("nan.safetensors");
    synth_write(sd, path, NULL);
    kvf_scheme *s = tu_scheme("rtn_int2");
    kvf_eval_options opt = {.device = KVF_DEVICE_CPU, .threads = 2};
    int rc;
    kvf_eval_report clean = run_path(s, path, &opt, &rc);
    assert_int_equal(rc, KVF_OK);
    assert_int_equal(clean.nonfinite_values, 0);
    assert_int_equal(clean.n_nonfinite, 0);
    /* per layer: k and v of 3 chunks, q of chunks 1 and 2 (chunk 0's queries score nothing) */
    assert_int_equal(clean.tensors_checked, 2 * 8);
    FILE *null = fopen("/dev/null", "w");
    assert_int_equal(kvf_eval_print_warnings(&clean, null), 0);
    fclose(null);

    /* layer 1 only: v of chunk 0 (-inf), k of chunk 1 (two NaN), q of chunk 2 (+inf) */
    const int ch = c.chunks;
    poke(sd->v[1 * ch + 0], c.tokens, c.d, 1, 7, 9, -INFINITY);
    poke(sd->k[1 * ch + 1], c.tokens, c.d, 0, 3, 5, NAN);
    poke(sd->k[1 * ch + 1], c.tokens, c.d, 1, 60, 127, NAN);
    poke(sd->q[1 * ch + 2], c.queries, c.d, 2, 31, 0, INFINITY);
    synth_write(sd, path, NULL);
    kvf_eval_report r = run_path(s, path, &opt, &rc);
    assert_int_equal(rc, KVF_OK);
    assert_int_equal(r.nonfinite_values, 4);
    assert_int_equal(r.n_nonfinite, 3);
    assert_int_equal(r.nonfinite_by_role[KVF_DUMP_K], 2);
    assert_int_equal(r.nonfinite_by_role[KVF_DUMP_V], 1);
    assert_int_equal(r.nonfinite_by_role[KVF_DUMP_Q], 1);
    assert_int_equal(r.layer_nonfinite[0], 0);
    assert_int_equal(r.layer_nonfinite[1], 4);
    /* in reading order: layer 1's K/V of chunk 0, then chunk 1, then chunk 2's queries */
    const kvf_eval_nonfinite *nf = r.nonfinite;
    assert_string_equal(nf[0].tensor, "l1.c0.v");
    assert_true(nf[0].count == 1 && nf[0].head == 1 && nf[0].token == 7 && nf[0].channel == 9);
    assert_true(isinf(nf[0].first) && nf[0].first < 0);
    assert_string_equal(nf[1].tensor, "l1.c1.k");
    assert_true(nf[1].count == 2 && nf[1].head == 0 && nf[1].token == 3 && nf[1].channel == 5 && isnan(nf[1].first));
    assert_string_equal(nf[2].tensor, "l1.c2.q");
    assert_true(nf[2].count == 1 && nf[2].head == 2 && nf[2].token == 31 && nf[2].channel == 0 && nf[2].first > 0);
    /* layer 0 scored as before; layer 1 and the overall undefined, not perfect */
    assert_memory_equal(&r.layer[0], &clean.layer[0], sizeof r.layer[0]);
    assert_true(isnan(r.layer[1].top1_shift) && isnan(r.layer[1].attn_out_rel_err) && isnan(r.layer[1].key_mse));
    assert_true(isnan(r.overall.top1_shift) && isnan(r.overall.top5_overlap) && isnan(r.overall.value_mse));
    assert_true(isnan(r.step[1 * ch + 2].top1_shift));
    assert_float_equal(r.overall.compression, clean.overall.compression, 0);
    char *json = kvf_eval_report_json(&r);
    json_error_t err;
    json_t *root = json_loads(json, 0, &err);
    assert_non_null(root);
    json_t *jn = json_object_get(root, "nonfinite");
    assert_int_equal(json_integer_value(json_object_get(jn, "values")), 4);
    assert_int_equal(json_integer_value(json_object_get(jn, "tensors_checked")), 16);
    assert_int_equal(json_integer_value(json_object_get(json_object_get(jn, "by_role"), "k")), 2);
    json_t *t1 = json_array_get(json_object_get(jn, "tensors"), 1);
    assert_string_equal(json_string_value(json_object_get(t1, "tensor")), "l1.c1.k");
    assert_int_equal(json_integer_value(json_object_get(t1, "count")), 2);
    assert_string_equal(json_string_value(json_object_get(json_object_get(t1, "first"), "value")), "NaN");
    assert_true(json_is_null(json_object_get(json_object_get(root, "overall"), "top1_shift")));
    assert_int_equal(json_integer_value(json_object_get(json_array_get(json_object_get(root, "layers"), 1), "nonfinite")), 4);
    assert_true(json_is_real(json_object_get(json_array_get(json_object_get(root, "layers"), 0), "top1_shift")));
    const char *w = json_string_value(json_array_get(json_object_get(root, "warnings"), 0));
    assert_non_null(w);
    assert_non_null(strstr(w, "4 NaN or infinite values in 3 of the 16 tensors read"));
    assert_non_null(strstr(w, "first: tensor l1.c0.v, head 1, token 7, channel 9 (-inf)"));
    json_decref(root);
    free(json);
    kvf_eval_report_free(&r);

    /* strict: an error naming the first one */
    opt.strict = 1;
    r = run_path(s, path, &opt, &rc);
    assert_error_has(rc, KVF_EFORMAT, "tensor \"l1.c0.v\" holds 1 non-finite value in head 1 (first: -inf at token 7");

    /* the command line: exit 0 with the warning, --strict exit 1 */
    char bin[1200], cmd[4096], text[8192];
    if (tu_built_program("kvforge", bin, sizeof bin)) {
        const char *out = tmp_file("nan_out.json"), *errp = tmp_file("nan_err.txt");
        snprintf(cmd, sizeof cmd, "'%s' eval --scheme rtn_int2 --data '%s' --json", bin, path);
        assert_int_equal(run_cli(cmd, out, errp, text, sizeof text), 0);
        if (!strstr(text, "warning: the dump holds 4 NaN or infinite values") || !strstr(text, "l1.c0.v"))
            fail_msg("no warning on stderr: %s", text);
        json_t *j = json_load_file(out, 0, &err);
        assert_non_null(j);
        assert_int_equal(json_integer_value(json_object_get(json_object_get(j, "nonfinite"), "values")), 4);
        json_decref(j);
        snprintf(cmd, sizeof cmd, "'%s' eval --scheme rtn_int2 --data '%s' --strict", bin, path);
        assert_int_equal(run_cli(cmd, out, errp, text, sizeof text), 1);
        if (!strstr(text, "l1.c0.v") || !strstr(text, "strict")) fail_msg("no error on stderr: %s", text);
    }
    kvf_eval_report_free(&clean);
    kvf_scheme_free(s);
    synth_free(sd);
}

/* --warm where no warm-started span is ever scored says so: a scheme
 * without k-means, one chunk, two chunks (the second span, warm, is packed
 * after the last chunk); four chunks score two warm spans of three. */
static void test_warm_unscored(void **state) {
    (void)state;
    kvf_scheme *qvg = tu_scheme_text("return { base = 'qvg_int2', key = { centroids = 16 }, value = { centroids = 16 } }");
    kvf_scheme *rtn = tu_scheme("rtn_int2");
    kvf_eval_options opt = {.device = KVF_DEVICE_CPU, .threads = 2, .warm = 1};
    static const struct { int chunks, rtn, spans, scored; const char *says; } cases[] = {
        {1, 0, 0, 0, "--warm changed no score: 0 spans of 1 chunk were warm-started"},
        {2, 0, 1, 0, "--warm changed no score: 1 span of 2 chunks was warm-started, none scored"},
        {4, 0, 3, 2, NULL},
        {4, 1, 0, 0, "--warm changed nothing: scheme rtn_int2_"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        synth_cfg c = small_cfg;
        c.chunks = cases[i].chunks;
        synth_dump *sd = synth_make(&c);
        const char *path = tmp_file("warm1.safetensors");
        synth_write(sd, path, NULL);
        int rc;
        kvf_eval_report r = run_path(cases[i].rtn ? rtn : qvg, path, &opt, &rc);
        if (rc) fail_msg("%s", kvf_last_error());
        assert_int_equal(r.warm_spans, cases[i].spans);
        assert_int_equal(r.warm_spans_scored, cases[i].scored);
        char *json = kvf_eval_report_json(&r);
        json_error_t err;
        json_t *root = json_loads(json, 0, &err);
        assert_non_null(root);
        json_t *pol = json_object_get(root, "policy"), *warn = json_object_get(root, "warnings");
        assert_int_equal(json_integer_value(json_object_get(pol, "warm_spans_scored")), cases[i].scored);
        if (cases[i].says) {
            assert_int_equal(json_array_size(warn), 1);
            const char *w = json_string_value(json_array_get(warn, 0));
            if (!strstr(w, cases[i].says)) fail_msg("case %zu: \"%s\" not in \"%s\"", i, cases[i].says, w);
        } else {
            assert_int_equal(json_array_size(warn), 0);
        }
        json_decref(root);
        free(json);
        kvf_eval_report_free(&r);
        synth_free(sd);
    }
    char bin[1200], cmd[4096], text[8192];
    if (tu_built_program("kvforge", bin, sizeof bin)) {
        synth_cfg c = small_cfg;
        c.chunks = 1;
        synth_dump *sd = synth_make(&c);
        const char *path = tmp_file("warm_cli.safetensors");
        synth_write(sd, path, NULL);
        snprintf(cmd, sizeof cmd, "'%s' eval --scheme qvg_int2 --data '%s' --warm", bin, path);
        assert_int_equal(run_cli(cmd, tmp_file("warm_out.txt"), tmp_file("warm_err.txt"), text, sizeof text), 0);
        if (!strstr(text, "warning: --warm changed no score")) fail_msg("no warning on stderr: %s", text);
        synth_free(sd);
    }
    kvf_scheme_free(qvg);
    kvf_scheme_free(rtn);
}

/* A dump truncated or changed after it was opened: an error (KVF_EIO), not
 * SIGBUS; a FIFO, a device and a directory are refused at once. */
static void test_file_changes(void **state) {
    (void)state;
    synth_dump *sd = synth_make(&small_cfg);
    char path[1024];
    snprintf(path, sizeof path, "%s", tmp_file("trunc.safetensors"));
    synth_write(sd, path, NULL);
    kvf_scheme *s = tu_scheme("rtn_int2");
    kvf_eval_options opt = {.device = KVF_DEVICE_CPU, .threads = 1};
    kvf_eval_report r;
    /* truncated between open and read */
    kvf_dump *d;
    assert_int_equal(kvf_dump_open(path, &d), KVF_OK);
    FILE *f = fopen(path, "rb");
    fseek(f, 0, SEEK_END);
    const long len = ftell(f);
    fclose(f);
    assert_int_equal(truncate(path, len / 2), 0);
    assert_error_has(kvf_eval_run(s, d, &opt, &r), KVF_EIO, "the file changed while read: tensor \"l0.c");
    /* kvf_st_read itself: the bytes past the end zeroed */
    const kvf_st_tensor *last = kvf_dump_tensor(d, 0, 2, KVF_DUMP_V);
    uint16_t buf[8] = {1, 2, 3, 4, 5, 6, 7, 8}, zero[8] = {0};
    assert_error_has(kvf_dump_bf16(last, 0, 8, buf), KVF_EIO, "now ends at byte");
    assert_memory_equal(buf, zero, sizeof buf);
    assert_error_has(kvf_st_read(last, last->n_bytes - 2, 4, buf), KVF_EINVAL, "outside");
    kvf_dump_close(d);

    /* changed in place (same size, new contents and time): caught after the layer */
    synth_write(sd, path, NULL);
    assert_int_equal(kvf_dump_open(path, &d), KVF_OK);
    int fd = open(path, O_WRONLY);
    assert_true(fd >= 0);
    assert_int_equal(pwrite(fd, "\0\0", 2, len - 2), 2);
    const struct timespec times[2] = {{0, UTIME_OMIT}, {12345, 0}};
    assert_int_equal(futimens(fd, times), 0);
    close(fd);
    assert_error_has(kvf_eval_run(s, d, &opt, &r), KVF_EIO, "the file changed while read");
    kvf_dump_close(d);

    /* a file shorter than its header says: refused when opened */
    synth_write(sd, path, NULL);
    assert_int_equal(truncate(path, len - 1), 0);
    assert_error_has(kvf_dump_open(path, &d), KVF_EFORMAT, "run past the end of the data");

    /* not regular files: never waited on (a FIFO with no writer) */
    const char *fifo = tmp_file("fifo");
    assert_int_equal(mkfifo(fifo, 0600), 0);
    alarm(20); /* a blocking open would hang here: the alarm fails the test */
    assert_error_has(kvf_dump_open(fifo, &d), KVF_EIO, "is a FIFO (named pipe), not a regular file");
    assert_error_has(kvf_dump_open("/dev/null", &d), KVF_EIO, "is a character device, not a regular file");
    assert_error_has(kvf_dump_open(tmp_dir, &d), KVF_EIO, "is a directory, not a regular file");
    kvf_recon *rec;
    assert_error_has(kvf_recon_open(fifo, &rec), KVF_EIO, "is a FIFO");
    alarm(0);
    kvf_scheme_free(s);
    synth_free(sd);
}

/* `kvforge eval`'s option parser (eval/cli_args.c), as the CLI and the fuzzer call it. */
static int parse_line(const char *line, kvf_eval_args *a, char *err, size_t cap) {
    static char buf[1024]; /* the parsed strings point into it after the return */
    char *argv[32];
    int argc = 0;
    snprintf(buf, sizeof buf, "eval %s", line);
    for (char *t = strtok(buf, " "); t && argc < 31; t = strtok(NULL, " ")) argv[argc++] = t;
    argv[argc] = NULL;
    FILE *f = fmemopen(err, cap, "w");
    int rc = kvf_eval_parse_args(argc, argv, a, f);
    fclose(f);
    return rc;
}

static void test_eval_args(void **state) {
    (void)state;
    kvf_eval_args a;
    char err[1024];
    assert_int_equal(parse_line("--scheme rtn_int2 --data D --json --threads 3 --warm --strict -q", &a, err, sizeof err), 0);
    assert_string_equal(a.scheme, "rtn_int2");
    assert_string_equal(a.data, "D");
    assert_true(a.json && a.threads == 3 && a.warm && a.strict && a.quiet && !a.gpu && !a.peer && !a.help);
    assert_int_equal(parse_line("--data=D -p R", &a, err, sizeof err), 0);
    assert_true(a.peer && !strcmp(a.peer, "R") && !strcmp(a.data, "D"));
    assert_int_equal(parse_line("--bogus --help", &a, err, sizeof err), 2);
    assert_int_equal(parse_line("--help --bogus", &a, err, sizeof err), 2);
    assert_int_equal(parse_line("--help", &a, err, sizeof err), 0);
    assert_true(a.help);
    static const struct { const char *line, *msg; } bad[] = {
        {"--scheme s --data D --bogus", "unknown option '--bogus'"},
        {"--scheme s --data D -x", "unknown option '-x'"},
        {"--scheme s --data", "option '--data' needs a value"},
        {"--scheme s -d", "option '-d' needs a value"},
        {"--scheme s --data D --json=yes", "option '--json' takes no value"},
        {"--scheme s --data D --data E", "option '--data' given twice"},
        {"--scheme s --data D --threads 0", "--threads '0': must be an integer in 1..256"},
        {"--scheme s --data D --threads 2 --threads 2", "option '--threads' given twice"},
        {"--scheme s --data D extra", "unexpected argument 'extra'"},
        {"--scheme s", "--data and one of --scheme or --peer are required"},
        {"--scheme= --data D", "option '--scheme' needs a value, not an empty one"},
        {"--peer R --data D --write-recon X", "--peer takes no --write-recon"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        memset(err, 0, sizeof err);
        int rc = parse_line(bad[i].line, &a, err, sizeof err);
        if (rc != 2 || !strstr(err, bad[i].msg)) fail_msg("'%s': rc %d, \"%s\" not in: %s", bad[i].line, rc, bad[i].msg, err);
    }
}

/* A dump whose texts are long, multi-byte UTF-8: the report's copies are cut
 * at a character boundary, so the JSON report builds. */
static void test_report_utf8_cut(void **state) {
    (void)state;
    synth_dump *sd = synth_make(&small_cfg);
    const char *path = tmp_file("utf8.safetensors");
    char source[800] = "x";
    for (int i = 0; i < 150; i++) strcat(source, "\xc3\xa9\xe2\x82\xac"); /* é€: 2 + 3 bytes */
    synth_write_opts o = {.meta_key = "source", .meta_value = source};
    synth_write(sd, path, &o);
    kvf_scheme *s = tu_scheme("rtn_int2");
    kvf_eval_report r = run_eval(s, path, KVF_DEVICE_CPU);
    assert_true(strlen(r.source) < sizeof r.source && strlen(r.source) > 200);
    char *js = kvf_eval_report_json(&r);
    assert_non_null(js);
    free(js);
    kvf_eval_report_free(&r);
    kvf_scheme_free(s);
    synth_free(sd);
}

/* The committed world-model dump, when it exists. */
static void test_committed_dump(void **state) {
    (void)state;
    const char *path = tu_path("eval/worldmodel/kv_small.safetensors");
    FILE *f = fopen(path, "rb");
    if (!f) {
        printf("skipped: %s does not exist yet\n", path);
        skip();
    }
    fclose(f);
    kvf_scheme *s2 = tu_scheme("rtn_int2"), *s4 = tu_scheme("rtn_int4");
    kvf_eval_report r2 = run_eval(s2, path, KVF_DEVICE_CPU), r4 = run_eval(s4, path, KVF_DEVICE_CPU);
    kvf_eval_print_table(&r2, stdout);
    kvf_eval_print_table(&r4, stdout);
    assert_true(r2.overall.queries > 0 && r2.overall.key_tokens > 0);
    assert_true(r4.overall.attn_out_rel_err < r2.overall.attn_out_rel_err);
    assert_true(r4.overall.key_mse < r2.overall.key_mse && r4.overall.qk_err < r2.overall.qk_err);
    assert_true(r2.overall.compression > r4.overall.compression);
    kvf_eval_report_free(&r2);
    kvf_eval_report_free(&r4);
    kvf_scheme_free(s2);
    kvf_scheme_free(s4);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_top1_known),
        cmocka_unit_test(test_top5_overlap),
        cmocka_unit_test(test_attention_identical),
        cmocka_unit_test(test_attention_output_hand),
        cmocka_unit_test(test_qk_err_hand),
        cmocka_unit_test(test_gqa_mapping),
        cmocka_unit_test(test_safetensors_hand_file),
        cmocka_unit_test(test_safetensors_malformed),
        cmocka_unit_test(test_dump_valid),
        cmocka_unit_test(test_dump_invalid),
        cmocka_unit_test(test_dump_corrupted),
        cmocka_unit_test(test_int4_beats_int2),
        cmocka_unit_test(test_bf16_scheme_exact),
        cmocka_unit_test(test_chunk_policy),
        cmocka_unit_test(test_warm_start),
        cmocka_unit_test(test_mismatch_errors),
        cmocka_unit_test(test_gpu_matches_cpu),
        cmocka_unit_test(test_cli_json),
        cmocka_unit_test(test_recon_matches_scheme),
        cmocka_unit_test(test_recon_lossless),
        cmocka_unit_test(test_recon_malformed),
        cmocka_unit_test(test_cli_peer),
        cmocka_unit_test(test_nonfinite),
        cmocka_unit_test(test_warm_unscored),
        cmocka_unit_test(test_file_changes),
        cmocka_unit_test(test_eval_args),
        cmocka_unit_test(test_report_utf8_cut),
        cmocka_unit_test(test_committed_dump),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
