/* The practitioner's pipeline on the CPU reference (runtime/cpu/ref_pipeline.c,
 * ref_encode.c; docs/METHODS.md section 11): outliers kept exactly, the
 * refinement of calibrated channels, anchors, error feedback, the chunk
 * policy's anchors, the sensitivity table and the plan's rules. */
#include "testutil.h"
#include "cpu/ref.h"
#include "calibrate.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { D = 128, H = 2, N = 96 };

static uint16_t *synth(int64_t n, int h, uint64_t seed) {
    uint16_t *x = malloc((size_t)n * h * D * 2);
    kvf_synth_kv(x, n, h, D, seed);
    return x;
}

/* RTN INT2, groups of 64, with the pipeline fields a caller sets. */
static void rtn_scheme(struct kvf_scheme *s) { tu_hand_scheme(s, D, 2, 2, 64, KVF_MODE_AFFINE); }

typedef struct coded {
    uint8_t *packed;
    size_t bytes;
    uint16_t *k, *v; /* decoded */
} coded;

static coded code(const struct kvf_scheme *s, const uint16_t *k, const uint16_t *v, int64_t n,
                  const kvf_encode_args *ea, const kvf_decode_args *da) {
    coded c;
    kvf_shape sh = {n, H, 0, 0};
    assert_int_equal(kvf_packed_size(s, n, H, &c.bytes), KVF_OK);
    c.packed = malloc(c.bytes);
    c.k = malloc((size_t)n * H * D * 2);
    c.v = malloc((size_t)n * H * D * 2);
    const kvf_encode_args none = {0};
    const kvf_decode_args dnone = {0};
    int rc = kvf_ref_encode_ex(s, k, v, &sh, ea ? ea : &none, c.packed, c.bytes);
    if (rc) fail_msg("encode: %s", kvf_last_error());
    rc = kvf_ref_decode_ex(s, c.packed, c.bytes, &sh, da ? da : &dnone, c.k, c.v);
    if (rc) fail_msg("decode: %s", kvf_last_error());
    return c;
}

static void coded_free(coded *c) { free(c->packed), free(c->k), free(c->v); }

static double mse(const uint16_t *a, const uint16_t *b, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++) {
        double e = (double)kvf_bf16_to_f32(a[i]) - kvf_bf16_to_f32(b[i]);
        s += e * e;
    }
    return s / (double)n;
}

/* ------------------------------------------------------------ outliers */

static void outliers_kept_exactly(void **state) {
    (void)state;
    struct kvf_scheme base, s;
    rtn_scheme(&base);
    rtn_scheme(&s);
    s.pipe.outliers[0] = s.pipe.outliers[1] = 3;
    tu_finalize(&s);
    uint16_t *k = synth(N, H, 1), *v = synth(N, H, 2);
    k[5 * D + 7] = 0x7fc1; /* a NaN: taken out first, and kept */
    coded b = code(&base, k, v, N, NULL, NULL), c = code(&s, k, v, N, NULL, NULL);
    size_t n = (size_t)N * H * D;
    /* Every row's 3 values of largest magnitude come back bit for bit. */
    for (int tsec = 0; tsec < 2; tsec++) {
        const uint16_t *x = tsec ? v : k, *y = tsec ? c.v : c.k;
        for (size_t row = 0; row < (size_t)N * H; row++) {
            float r[D];
            uint8_t idx[3];
            for (int ch = 0; ch < D; ch++) r[ch] = kvf_bf16_to_f32(x[row * D + ch]);
            kvf_ref_outliers_pick(r, D, 3, idx);
            for (int i = 0; i < 3; i++) {
                uint16_t want = x[row * D + idx[i]], got = y[row * D + idx[i]];
                if (isnan(kvf_bf16_to_f32(want))) assert_true(isnan(kvf_bf16_to_f32(got)));
                else assert_int_equal(got, want);
            }
        }
    }
    /* The synthetic rows carry two outlier channels of ~20: taking them out
     * shrinks the rest's range, so the error falls a lot. */
    k[5 * D + 7] = b.k[5 * D + 7] = c.k[5 * D + 7] = 0;
    double mb = mse(k, b.k, n), mc = mse(k, c.k, n);
    print_message("outliers: key MSE %.5f -> %.5f, value MSE %.5f -> %.5f\n", mb, mc, mse(v, b.v, n), mse(v, c.v, n));
    assert_true(mc < 0.5 * mb);
    size_t bb, bc;
    kvf_packed_size(&base, N, H, &bb);
    kvf_packed_size(&s, N, H, &bc);
    assert_true(bc >= bb + (size_t)2 * N * H * 3 * 3); /* 3 bytes an outlier, both sections, counted */
    coded_free(&b), coded_free(&c);
    free(k), free(v);
}

static void outlier_pick_order(void **state) {
    (void)state;
    float r[8] = {1, -5, 5, 0.5f, NAN, -5, 2, 0};
    uint8_t idx[4];
    kvf_ref_outliers_pick(r, 8, 4, idx);
    assert_int_equal(idx[0], 4); /* NaN first */
    assert_int_equal(idx[1], 1); /* |-5| = |5| = |-5|: the lower channels first */
    assert_int_equal(idx[2], 2);
    assert_int_equal(idx[3], 5);
}

/* ------------------------------------------------------------ mixed precision */

static void refinement_lowers_the_refined_channels_error_only(void **state) {
    (void)state;
    struct kvf_scheme base, s;
    rtn_scheme(&base);
    rtn_scheme(&s);
    s.pipe.mp_fraction[0] = 0.2; /* 25.6 -> 24 channels (a multiple of 8) */
    s.pipe.mp_fraction[1] = 0.1; /* 12.8 -> 16 */
    s.pipe.mp_refine_bits = 2;
    tu_finalize(&s);
    assert_int_equal(s.plan.sec[0].mp_channels, 24);
    assert_int_equal(s.plan.sec[1].mp_channels, 16);
    uint16_t *k = synth(N, H, 3), *v = synth(N, H, 4);
    uint8_t map[2 * H * D];
    for (int t = 0; t < 2; t++)
        for (int h = 0; h < H; h++)
            for (int c = 0, slot = 0; c < D; c++) /* every 5th channel of head 0, every 3rd of head 1 */
                map[(t * H + h) * D + c] = (c % (h ? 3 : 5) == 0 && slot < (t ? 16 : 24)) ? (uint8_t)slot++ : 255;
    kvf_encode_args ea = {.channel_map = map};
    coded b = code(&base, k, v, N, NULL, NULL), c = code(&s, k, v, N, &ea, NULL);
    double in = 0, inb = 0;
    size_t changed_out = 0;
    for (size_t row = 0; row < (size_t)N * H; row++) {
        const int h = (int)(row / N);
        for (int ch = 0; ch < D; ch++) {
            const size_t i = row * D + ch;
            const double x = kvf_bf16_to_f32(k[i]), eb = x - kvf_bf16_to_f32(b.k[i]), ec = x - kvf_bf16_to_f32(c.k[i]);
            if (map[h * D + ch] != 255) in += ec * ec, inb += eb * eb;
            else changed_out += b.k[i] != c.k[i];
        }
    }
    print_message("mixed precision: refined key channels' squared error %.3f -> %.3f\n", inb, in);
    assert_true(in < 0.25 * inb);   /* 2 refinement bits on top of 2 */
    assert_int_equal(changed_out, 0); /* the base codes are the plain scheme's */
    size_t bb, bc;
    kvf_packed_size(&base, N, H, &bb);
    kvf_packed_size(&s, N, H, &bc);
    assert_true(bc > bb);
    /* The map is required, and its slots must be below the refined count. */
    kvf_shape sh = {N, H, 0, 0};
    const kvf_encode_args none = {0};
    assert_int_equal(kvf_ref_encode_ex(&s, k, v, &sh, &none, c.packed, c.bytes), KVF_EINVAL);
    map[3] = 200;
    assert_int_equal(kvf_ref_encode_ex(&s, k, v, &sh, &ea, c.packed, c.bytes), KVF_EINVAL);
    assert_non_null(strstr(kvf_last_error(), "slot 200 of 24"));
    coded_free(&b), coded_free(&c);
    free(k), free(v);
}

/* ------------------------------------------------------------ anchors */

static void anchors_code_the_difference(void **state) {
    (void)state;
    struct kvf_scheme base, s, a;
    rtn_scheme(&base);
    rtn_scheme(&s);
    s.pipe.anchor_every = 4;
    s.pipe.anchor_bits = 8;
    tu_finalize(&s);
    assert_int_equal(kvf_anchor_scheme_of(&s, &a), KVF_OK);
    assert_int_equal(a.key.bits, 8);
    assert_int_equal(a.plan.sec[0].anchor_bits, 0);
    /* A chunk and a later one close to it (a static scene's tokens). */
    uint16_t *k0 = synth(N, H, 5), *v0 = synth(N, H, 6), *k1 = malloc((size_t)N * H * D * 2),
             *v1 = malloc((size_t)N * H * D * 2);
    uint16_t *noise = synth(N, H, 7);
    for (size_t i = 0; i < (size_t)N * H * D; i++) {
        k1[i] = kvf_f32_to_bf16(kvf_bf16_to_f32(k0[i]) + 0.05f * kvf_bf16_to_f32(noise[i]));
        v1[i] = kvf_f32_to_bf16(kvf_bf16_to_f32(v0[i]) + 0.05f * kvf_bf16_to_f32(noise[i]));
    }
    coded anc = code(&a, k0, v0, N, NULL, NULL);
    kvf_encode_args ea = {.anchor = anc.packed, .anchor_bytes = anc.bytes, .anchor_n_tokens = N};
    kvf_decode_args da = {.anchor = anc.packed, .anchor_bytes = anc.bytes, .anchor_n_tokens = N};
    coded b = code(&base, k1, v1, N, NULL, NULL), c = code(&s, k1, v1, N, &ea, &da);
    size_t n = (size_t)N * H * D;
    print_message("anchors: key MSE %.5f -> %.5f against the anchor\n", mse(k1, b.k, n), mse(k1, c.k, n));
    assert_true(mse(k1, c.k, n) < 0.1 * mse(k1, b.k, n));
    assert_true(mse(v1, c.v, n) < 0.1 * mse(v1, b.v, n));
    /* Decoded without its anchor the span is the difference alone. */
    kvf_shape sh = {N, H, 0, 0};
    const kvf_decode_args none = {0};
    uint16_t *dk = malloc(n * 2), *dv = malloc(n * 2);
    assert_int_equal(kvf_ref_decode_ex(&s, c.packed, c.bytes, &sh, &none, dk, dv), KVF_OK);
    assert_true(mse(k1, dk, n) > 10 * mse(k1, c.k, n));
    /* An anchor of the wrong size, or not an anchor span, is refused. */
    kvf_decode_args small = da;
    small.anchor_bytes = 100;
    assert_int_equal(kvf_ref_decode_ex(&s, c.packed, c.bytes, &sh, &small, dk, dv), KVF_ERANGE);
    kvf_decode_args wrong = {.anchor = b.packed, .anchor_bytes = b.bytes, .anchor_n_tokens = N};
    int rc = kvf_ref_decode_ex(&s, c.packed, c.bytes, &sh, &wrong, dk, dv);
    assert_true(rc == KVF_EFORMAT || rc == KVF_ERANGE);
    /* A scheme without anchors has no anchor scheme and takes no anchor. */
    assert_int_equal(kvf_ref_decode_ex(&base, b.packed, b.bytes, &sh, &da, dk, dv), KVF_EINVAL);
    free(dk), free(dv);
    coded_free(&anc), coded_free(&b), coded_free(&c);
    free(k0), free(v0), free(k1), free(v1), free(noise);
}

/* ------------------------------------------------------------ error feedback */

static void feedback_cancels_the_error_over_time(void **state) {
    (void)state;
    struct kvf_scheme base, s;
    rtn_scheme(&base);
    rtn_scheme(&s);
    s.pipe.feedback_decay = 0.8;
    tu_finalize(&s);
    /* A static scene: the same chunk, slightly perturbed, again and again. */
    enum { T = 8 };
    uint16_t *x0 = synth(N, H, 8), *noise = synth(N, H, 9);
    size_t n = (size_t)N * H * D;
    float *fb = calloc(2 * n, sizeof(float));
    double *sum_b = calloc(n, sizeof(double)), *sum_c = calloc(n, sizeof(double)), *sum_x = calloc(n, sizeof(double));
    for (int t = 0; t < T; t++) {
        uint16_t *k = malloc(n * 2);
        for (size_t i = 0; i < n; i++)
            k[i] = kvf_f32_to_bf16(kvf_bf16_to_f32(x0[i]) + 0.02f * (float)(t % 3) * kvf_bf16_to_f32(noise[i]));
        kvf_encode_args ea = {.feedback = fb, .feedback_in = t > 0};
        coded b = code(&base, k, k, N, NULL, NULL), c = code(&s, k, k, N, &ea, NULL);
        for (size_t i = 0; i < n; i++) {
            sum_x[i] += kvf_bf16_to_f32(k[i]);
            sum_b[i] += kvf_bf16_to_f32(b.k[i]);
            sum_c[i] += kvf_bf16_to_f32(c.k[i]);
            /* The carried error is the input minus what decode returns
             * (before its BF16 rounding). */
            if (i < 64) assert_true(fabs(fb[i] - (kvf_bf16_to_f32(k[i]) - kvf_bf16_to_f32(c.k[i]))) <=
                                    0.01 * fabs(kvf_bf16_to_f32(c.k[i])) + 1e-6);
        }
        coded_free(&b), coded_free(&c);
        free(k);
    }
    /* The error of the mean over time: a delta-sigma loop pushes it down. */
    double eb = 0, ec = 0;
    for (size_t i = 0; i < n; i++) {
        eb += (sum_b[i] - sum_x[i]) * (sum_b[i] - sum_x[i]);
        ec += (sum_c[i] - sum_x[i]) * (sum_c[i] - sum_x[i]);
    }
    print_message("error feedback: squared error of the sum over %d chunks %.1f -> %.1f\n", T, eb, ec);
    assert_true(ec < 0.3 * eb);
    free(fb), free(sum_b), free(sum_c), free(sum_x), free(x0), free(noise);
}

/* A NaN or Inf input carries no error: the carried error stays finite, 0 at
 * that value, and the next chunk's same token decodes as without it. */
static void feedback_keeps_nonfinite_in_its_chunk(void **state) {
    (void)state;
    struct kvf_scheme s;
    rtn_scheme(&s);
    s.pipe.feedback_decay = 0.8;
    tu_finalize(&s);
    size_t n = (size_t)N * H * D;
    uint16_t *x = synth(N, H, 21), *bad = malloc(n * 2);
    memcpy(bad, x, n * 2);
    bad[5] = 0x7fc1;  /* NaN */
    bad[300] = 0xff80; /* -Inf */
    float *fb = calloc(2 * n, sizeof(float)), *fb_clean = calloc(2 * n, sizeof(float));
    kvf_encode_args ea = {.feedback = fb}, ec = {.feedback = fb_clean};
    coded b = code(&s, bad, x, N, &ea, NULL), c = code(&s, x, x, N, &ec, NULL);
    for (size_t i = 0; i < 2 * n; i++) assert_true(isfinite(fb[i]));
    assert_true(fb[5] == 0.0f && fb[300] == 0.0f);
    coded_free(&b), coded_free(&c);
    /* The next chunk from either carried error: the poisoned groups aside
     * (the values beside a NaN or Inf in its group of 64), the same. */
    ea.feedback_in = ec.feedback_in = 1;
    b = code(&s, x, x, N, &ea, NULL);
    c = code(&s, x, x, N, &ec, NULL);
    for (size_t i = 0; i < n; i++) {
        assert_false(isnan(kvf_bf16_to_f32(b.k[i])));
        if (i / 64 != 5 / 64 && i / 64 != 300 / 64) assert_int_equal(b.k[i], c.k[i]);
    }
    coded_free(&b), coded_free(&c);
    free(x), free(bad), free(fb), free(fb_clean);
}

/* ------------------------------------------------------------ the policy */

static void policy_marks_anchors(void **state) {
    (void)state;
    kvf_scheme *s = tu_scheme_text("return { chunk = { span = 2, sink = 1 } }");
    s->pipe.anchor_every = 6;
    s->pipe.anchor_bits = 16;
    s->pipe.feedback_decay = 0.5;
    assert_int_equal(kvf_scheme_finalize(s), KVF_OK);
    /* Spans start at chunks 1, 3, 5, 7, ...; anchors every 3 spans. */
    const struct { int t, first, anchor, anchor_first, fb_in, warm_first; } want[] = {
        {2, 1, 1, -1, 0, -1}, {4, 3, 0, 1, 0, -1}, {6, 5, 0, 1, 1, 3}, {8, 7, 1, -1, 0, -1}, {10, 9, 0, 7, 0, -1},
        {12, 11, 0, 7, 1, 9},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        kvf_chunk_step st;
        assert_int_equal(kvf_chunk_policy(s, want[i].t, &st), KVF_OK);
        assert_int_equal(st.pack_first, want[i].first);
        assert_int_equal(st.anchor, want[i].anchor);
        assert_int_equal(st.anchor_first, want[i].anchor_first);
        assert_int_equal(st.feedback_in, want[i].fb_in);
        assert_int_equal(st.warm_first, want[i].warm_first);
    }
    kvf_scheme_free(s);
}

/* ------------------------------------------------------------ the table */

static char *tmp_dir;
static const char *tu_tmpdir(void) {
    if (!tmp_dir) tmp_dir = tu_mkdtemp();
    return tmp_dir;
}
static int teardown(void **state) {
    (void)state;
    if (tmp_dir) tu_rmtree(tmp_dir), free(tmp_dir), tmp_dir = NULL;
    return 0;
}

static const char *write_table(const char *name, const char *text) {
    static char path[4][512];
    static int k;
    char *p = path[k++ % 4];
    snprintf(p, 512, "%s/%s", tu_tmpdir(), name);
    tu_write_file(p, text, strlen(text));
    return p;
}

/* A table of 1 layer, 2 KV heads, head_dim 128: score = channel for head 0,
 * 128 - channel for head 1 (values: all 1, so the lowest channels by ties). */
static const char *good_table(void) {
    static char text[16384];
    size_t n = 0;
    n += (size_t)snprintf(text + n, sizeof text - n,
                          "{\"format\":\"kvforge-sensitivity\",\"version\":1,\"head_dim\":128,\"kv_heads\":2,"
                          "\"layers\":1,\"key\":[[");
    for (int h = 0; h < 2; h++) {
        n += (size_t)snprintf(text + n, sizeof text - n, "%s[", h ? "," : "");
        for (int c = 0; c < 128; c++) n += (size_t)snprintf(text + n, sizeof text - n, "%s%d", c ? "," : "", h ? 128 - c : c);
        n += (size_t)snprintf(text + n, sizeof text - n, "]");
    }
    n += (size_t)snprintf(text + n, sizeof text - n, "]],\"value\":[[");
    for (int h = 0; h < 2; h++) {
        n += (size_t)snprintf(text + n, sizeof text - n, "%s[", h ? "," : "");
        for (int c = 0; c < 128; c++) n += (size_t)snprintf(text + n, sizeof text - n, "%s1", c ? "," : "");
        n += (size_t)snprintf(text + n, sizeof text - n, "]");
    }
    snprintf(text + n, sizeof text - n, "]]}");
    return text;
}

static void table_picks_and_refuses(void **state) {
    (void)state;
    struct kvf_scheme s;
    rtn_scheme(&s);
    s.pipe.mp_fraction[0] = 0.125; /* 16 */
    s.pipe.mp_fraction[1] = 0.0625; /* 8 */
    s.pipe.mp_refine_bits = 4;
    tu_finalize(&s);
    uint8_t map[2 * 2 * 128];
    const char *path = write_table("t.json", good_table());
    assert_int_equal(kvf_mixed_map(&s, path, 0, 2, map), KVF_OK);
    for (int c = 0; c < 128; c++) {
        assert_int_equal(map[c], c >= 112 ? c - 112 : 255);        /* head 0: the 16 highest channels */
        assert_int_equal(map[128 + c], c < 16 ? c : 255);          /* head 1: scores 128 - c: channels 0..15 */
        assert_int_equal(map[256 + c], c < 8 ? c : 255);            /* values, all tied: the lowest 8 */
    }
    /* Refused, naming the file and the field. */
    struct { const char *text; int rc; const char *msg; } bad[] = {
        {"{", KVF_EFORMAT, "t1.json:"},
        {"{\"format\":\"other\"}", KVF_EFORMAT, "\"format\""},
        {"{\"format\":\"kvforge-sensitivity\",\"version\":2,\"head_dim\":128,\"kv_heads\":2,\"layers\":1}", KVF_EFORMAT, "version 2"},
        {"{\"format\":\"kvforge-sensitivity\",\"version\":1,\"head_dim\":64,\"kv_heads\":2,\"layers\":1}", KVF_EFORMAT, "head_dim 64"},
        {"{\"format\":\"kvforge-sensitivity\",\"version\":1,\"head_dim\":128,\"kv_heads\":3,\"layers\":1}", KVF_EFORMAT, "kv_heads 3"},
        {"{\"format\":\"kvforge-sensitivity\",\"version\":1,\"head_dim\":128,\"kv_heads\":2,\"layers\":1,\"key\":[[[1]]]}", KVF_EFORMAT, "key[0] must be an array of 2"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char name[32];
        snprintf(name, sizeof name, "t%zu.json", i + 1);
        const char *p = write_table(name, bad[i].text);
        int rc = kvf_mixed_map(&s, p, 0, 2, map);
        if (rc != bad[i].rc || !strstr(kvf_last_error(), bad[i].msg))
            fail_msg("case %zu: %d %s", i, rc, kvf_last_error());
    }
    assert_int_equal(kvf_mixed_map(&s, path, 1, 2, map), KVF_EFORMAT); /* layer 1 of 1 */
    char missing[600];
    snprintf(missing, sizeof missing, "%s/none.json", tu_tmpdir());
    assert_int_equal(kvf_mixed_map(&s, missing, 0, 2, map), KVF_EIO);
    assert_non_null(strstr(kvf_last_error(), "none.json"));
    assert_int_equal(kvf_mixed_map(&s, tu_tmpdir(), 0, 2, map), KVF_EIO); /* a directory */
    /* A negative score. */
    char neg[16384];
    snprintf(neg, sizeof neg, "%s", good_table());
    char *c5 = strstr(neg, ",5,");
    memmove(c5 + 2, c5 + 1, strlen(c5));
    c5[1] = '-';
    assert_int_equal(kvf_mixed_map(&s, write_table("neg.json", neg), 0, 2, map), KVF_EFORMAT);
    assert_non_null(strstr(kvf_last_error(), "key[0][0][5]"));
}

/* ------------------------------------------------------------ calibration */

/* The table of the committed world-model dump (1 layer, 2 KV heads, chunk 0)
 * reads back through kvf_mixed_map, and one channel's scores are what the
 * measure says, recomputed here. */
static void calibration_table(void **state) {
    (void)state;
    kvf_dump *d;
    assert_int_equal(kvf_dump_open(tu_path("eval/worldmodel/kv_small.safetensors"), &d), KVF_OK);
    kvf_scheme *s = tu_scheme_text("return { base = 'rtn_int2', mixed_precision = { key_fraction = 0.2, value_fraction = 0.1 } }");
    char path[600];
    snprintf(path, sizeof path, "%s/sens.json", tu_tmpdir());
    assert_int_equal(kvf_calibrate(s, d, 0, 1, path, NULL, NULL), KVF_OK);
    uint8_t map[2 * 2 * 128];
    assert_int_equal(kvf_mixed_map(s, path, 0, 2, map), KVF_OK);
    int refined[2] = {0, 0};
    for (int t = 0; t < 2; t++)
        for (int i = 0; i < 2 * 128; i++) refined[t] += map[t * 256 + i] != 255;
    assert_int_equal(refined[0], 2 * 24);
    assert_int_equal(refined[1], 2 * 16);
    /* Channel 5 of KV head 1: E[e^2] of the values, and E[q^2] E[e^2] of the keys. */
    const int64_t N = d->tokens;
    const size_t n = (size_t)2 * N * 128;
    uint16_t *k = malloc(n * 2), *v = malloc(n * 2), *ko = malloc(n * 2), *vo = malloc(n * 2);
    size_t bytes;
    kvf_scheme *b = tu_scheme("rtn_int2");
    kvf_packed_size(b, N, 2, &bytes);
    uint8_t *p = malloc(bytes);
    kvf_dump_bf16(kvf_dump_tensor(d, 0, 0, KVF_DUMP_K), 0, n, k);
    kvf_dump_bf16(kvf_dump_tensor(d, 0, 0, KVF_DUMP_V), 0, n, v);
    kvf_shape sh = {N, 2, 0, 0};
    assert_int_equal(kvf_ref_encode(b, k, v, &sh, NULL, p, bytes), KVF_OK);
    assert_int_equal(kvf_ref_decode(b, p, bytes, &sh, NULL, ko, vo), KVF_OK);
    double ek = 0, ev = 0, q2 = 0, nq = 0;
    for (int64_t t = 0; t < N; t++) {
        const size_t i = ((size_t)N + (size_t)t) * 128 + 5;
        ek += pow(kvf_bf16_to_f32(k[i]) - kvf_bf16_to_f32(ko[i]), 2);
        ev += pow(kvf_bf16_to_f32(v[i]) - kvf_bf16_to_f32(vo[i]), 2);
    }
    const kvf_st_tensor *qt = kvf_dump_tensor(d, 0, 0, KVF_DUMP_Q);
    const int64_t Nq = qt->shape[1];
    const int group = d->q_heads / d->kv_heads;
    float *q = malloc((size_t)d->q_heads * Nq * 128 * sizeof(float));
    kvf_dump_f32(qt, 0, (size_t)d->q_heads * Nq * 128, q);
    for (int hq = group; hq < 2 * group; hq++)
        for (int64_t t = 0; t < Nq; t++) q2 += pow(q[((size_t)hq * Nq + (size_t)t) * 128 + 5], 2), nq += 1;
    FILE *f = fopen(path, "rb");
    char *text = calloc(1, 1 << 22);
    size_t got = fread(text, 1, (1 << 22) - 1, f);
    fclose(f);
    assert_true(got > 100);
    /* The scores of (layer 0, head 1, channel 5): the 6th number of head 1's row. */
    const char *kv[2] = {"\"key\"", "\"value\""};
    const double want[2] = {(q2 / nq) * ek / (double)N, ev / (double)N};
    for (int t = 0; t < 2; t++) {
        const char *at = strstr(text, kv[t]);
        assert_non_null(at);
        at = strchr(at, '[');          /* layers */
        at = strchr(at + 1, '[');      /* layer 0 */
        at = strchr(at + 1, '[');      /* head 0 */
        at = strchr(at + 1, '[');      /* head 1 */
        double x = 0;
        for (int c = 0; c <= 5; c++) {
            at++;
            x = strtod(at, (char **)&at);
        }
        print_message("calibration: %s score of head 1 channel 5: %.6g (recomputed %.6g)\n", t ? "value" : "key", x,
                      want[t]);
        assert_true(fabs(x - want[t]) <= 1e-6 * fabs(want[t]) + 1e-12);
    }
    free(text), free(q), free(p), free(k), free(v), free(ko), free(vo);
    kvf_scheme_free(b);
    kvf_scheme_free(s);
    kvf_dump_close(d);
}

/* ------------------------------------------------------------ rules */

static void rules_refuse_what_does_not_combine(void **state) {
    (void)state;
    const struct { const char *set; int value; const char *msg; } cases[] = {
        {"bits16", 0, "bits = 16"}, {"token", 0, "axis = \"token\""}, {"rot", 0, "hadamard"},
        {"psac", 0, "psac_rank"}, {"mp_all", 0, "leaves no channel"}, {"mp_none", 0, "none"},
        {"anchor_span", 0, "multiple of chunk.span"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct kvf_scheme s;
        rtn_scheme(&s);
        const char *w = cases[i].set;
        s.pipe.outliers[0] = 2;
        if (!strcmp(w, "bits16")) s.key.bits = 16;
        if (!strcmp(w, "token")) s.key.axis = KVF_AXIS_TOKEN;
        if (!strcmp(w, "rot")) s.key.rotation = KVF_ROTATION_HADAMARD;
        if (!strcmp(w, "psac")) s.key.centroids = 16, s.key.psac_rank = 4;
        if (!strcmp(w, "mp_all")) s.pipe.outliers[0] = 0, s.pipe.mp_fraction[0] = 0.99, s.pipe.mp_refine_bits = 2;
        if (!strcmp(w, "mp_none")) s.pipe.outliers[0] = 0, s.pipe.mp_fraction[0] = 0.01, s.pipe.mp_refine_bits = 2;
        if (!strcmp(w, "anchor_span")) s.chunk.span = 2, s.pipe.anchor_every = 3, s.pipe.anchor_bits = 8;
        int rc = kvf_scheme_finalize(&s);
        if (rc != KVF_ESCHEME || !strstr(kvf_last_error(), cases[i].msg))
            fail_msg("case %s: %d %s", w, rc, kvf_last_error());
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(outlier_pick_order),
        cmocka_unit_test(outliers_kept_exactly),
        cmocka_unit_test(refinement_lowers_the_refined_channels_error_only),
        cmocka_unit_test(anchors_code_the_difference),
        cmocka_unit_test(feedback_cancels_the_error_over_time),
        cmocka_unit_test(feedback_keeps_nonfinite_in_its_chunk),
        cmocka_unit_test(policy_marks_anchors),
        cmocka_unit_test(table_picks_and_refuses),
        cmocka_unit_test(calibration_table),
        cmocka_unit_test(rules_refuse_what_does_not_combine),
    };
    return cmocka_run_group_tests(tests, NULL, teardown);
}
