/*
 * Input faults on the public API, CPU backend: NaN and Inf in K and V,
 * zero-length chunks, shapes that do not match the scheme or the packed
 * header, NULL and misaligned pointers, a packed cache written by another
 * scheme or format version. Each gets a clear status; nothing is written out
 * of bounds (guard bytes around every buffer, padding inside strided ones);
 * a failing call writes nothing at all; and the other chunks of a cache that
 * holds several (one packed arena, one decoded tensor) stay byte-identical.
 *
 * NaN and Inf are accepted (KVF_OK) with the results docs/FORMAT.md "Special
 * values" gives, confined to the groups that hold them: rejecting them up front
 * would cost a pass over the data and, on a GPU, a synchronisation per encode.
 * In queries given to kvf_qstats_update, a row with a NaN or an Inf is skipped
 * (docs/METHODS.md 4): the statistics are exactly those without it.
 */
#include "safetensors.h"
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#define D 128        /* head_dim of the shipped schemes */
#define GUARD 64     /* guard bytes on each side of a buffer */
#define GUARD_BYTE 0xA7

/* ------------------------------------------------------------- guarded buffers */

/* n usable bytes between two guard zones; the usable bytes are filled with fill. */
typedef struct gbuf {
    uint8_t *base;
    uint8_t *p;
    size_t n;
} gbuf;

static gbuf gb_new(size_t n, uint8_t fill) {
    gbuf g = {malloc(n + 2 * GUARD), NULL, n};
    assert_non_null(g.base);
    memset(g.base, GUARD_BYTE, GUARD);
    memset(g.base + GUARD + n, GUARD_BYTE, GUARD);
    g.p = g.base + GUARD;
    memset(g.p, fill, n);
    return g;
}

static void gb_check_guards(const gbuf *g, const char *what) {
    for (size_t i = 0; i < GUARD; i++)
        if (g->base[i] != GUARD_BYTE || g->base[GUARD + g->n + i] != GUARD_BYTE)
            fail_msg("%s: a guard byte was overwritten (%s the buffer, byte %zu)", what,
                     g->base[i] != GUARD_BYTE ? "before" : "after", i);
}

static void gb_free(gbuf *g) {
    free(g->base);
    g->base = g->p = NULL;
}

/* ------------------------------------------------------------------ fixture */

typedef struct fixture {
    kvf_scheme *s2, *s4;
    kvf_context *c2, *c4;
} fixture;

static int setup(void **state) {
    fixture *fx = calloc(1, sizeof *fx);
    fx->s2 = tu_scheme("rtn_int2");
    fx->s4 = tu_scheme("rtn_int4");
    if (kvf_context_create(fx->s2, KVF_DEVICE_CPU, &fx->c2) ||
        kvf_context_create(fx->s4, KVF_DEVICE_CPU, &fx->c4))
        return -1;
    *state = fx;
    return 0;
}

static int teardown(void **state) {
    fixture *fx = *state;
    kvf_context_destroy(fx->c2);
    kvf_context_destroy(fx->c4);
    kvf_scheme_free(fx->s2);
    kvf_scheme_free(fx->s4);
    free(fx);
    return 0;
}

static size_t packed_size(const kvf_scheme *s, int64_t n, int32_t h) {
    size_t bytes = 0;
    if (kvf_packed_size(s, n, h, &bytes)) fail_msg("packed size: %s", kvf_last_error());
    return bytes;
}

/* Expect status rc and a message containing want. */
static void expect(int got, int rc, const char *want) {
    if (got != rc)
        fail_msg("status %s, expected %s; message: %s", kvf_status_name(got), kvf_status_name(rc),
                 kvf_last_error());
    if (want && !strstr(kvf_last_error(), want))
        fail_msg("message \"%s\" lacks \"%s\"", kvf_last_error(), want);
}

/* Head-major K or V [h][n][D] of synthetic data. */
static uint16_t *synth(int64_t n, int32_t h, uint64_t seed) {
    uint16_t *x = malloc((size_t)n * (size_t)h * D * 2);
    assert_non_null(x);
    tu_synth_kv(x, n, h, D, seed);
    return x;
}

static uint8_t *encode_alone(kvf_context *ctx, const uint16_t *k, const uint16_t *v, int64_t n,
                             int32_t h, size_t *bytes) {
    *bytes = packed_size(kvf_context_scheme(ctx), n, h);
    uint8_t *p = malloc(*bytes);
    kvf_shape sh = {n, h, 0, 0};
    assert_non_null(p);
    expect(kvf_encode(ctx, k, v, &sh, NULL, p, *bytes, NULL), KVF_OK, NULL);
    return p;
}

/* --------------------------------------------------------------- NaN and Inf */

static size_t idx(int32_t head, int64_t tok, int c, int64_t n) {
    return ((size_t)head * (size_t)n + (size_t)tok) * D + (size_t)c;
}

/* Whether element i lies in one of the given (head, token, group of 64) groups. */
static bool in_groups(size_t i, const size_t *marked, int n_marked) {
    for (int m = 0; m < n_marked; m++)
        if (i / 64 == marked[m] / 64) return true;
    return false;
}

static void test_nan_inf_contained(void **state) {
    fixture *fx = *state;
    const int64_t n = 12;
    const int32_t h = 3;
    const size_t elems = (size_t)n * h * D;
    uint16_t *k = synth(n, h, 21), *v = synth(n, h, 22);
    uint16_t *k_bad = malloc(elems * 2), *v_bad = malloc(elems * 2);
    memcpy(k_bad, k, elems * 2);
    memcpy(v_bad, v, elems * 2);
    size_t mk[3] = {idx(1, 5, 3, n), idx(0, 7, 100, n), idx(2, 11, 64, n)};
    size_t mv[2] = {idx(2, 2, 10, n), idx(0, 0, 127, n)};
    k_bad[mk[0]] = 0x7fc0; /* NaN */
    k_bad[mk[1]] = 0x7f80; /* +Inf */
    k_bad[mk[2]] = 0xffc1; /* negative NaN with a payload */
    v_bad[mv[0]] = 0xff80; /* -Inf */
    v_bad[mv[1]] = 0x7f80;

    for (int which = 0; which < 2; which++) {
        kvf_context *ctx = which ? fx->c4 : fx->c2;
        size_t bytes;
        uint8_t *clean = encode_alone(ctx, k, v, n, h, &bytes);
        gbuf p = gb_new(bytes, 0x11);
        kvf_shape sh = {n, h, 0, 0};
        expect(kvf_encode(ctx, k_bad, v_bad, &sh, NULL, p.p, bytes, NULL), KVF_OK, NULL);
        gb_check_guards(&p, "packed");
        expect(kvf_packed_check(kvf_context_scheme(ctx), p.p, bytes, n, h), KVF_OK, NULL);

        gbuf ko = gb_new(elems * 2, 0), vo = gb_new(elems * 2, 0);
        gbuf kc = gb_new(elems * 2, 0), vc = gb_new(elems * 2, 0);
        expect(kvf_decode(ctx, p.p, bytes, &sh, NULL, ko.p, vo.p, NULL), KVF_OK, NULL);
        expect(kvf_decode(ctx, clean, bytes, &sh, NULL, kc.p, vc.p, NULL), KVF_OK, NULL);
        gb_check_guards(&ko, "K out");
        gb_check_guards(&vo, "V out");
        /* Outside the marked groups: the same values as without NaN/Inf. */
        const uint16_t *k1 = (uint16_t *)ko.p, *k0 = (uint16_t *)kc.p;
        const uint16_t *v1 = (uint16_t *)vo.p, *v0 = (uint16_t *)vc.p;
        int changed_k = 0, changed_v = 0;
        for (size_t i = 0; i < elems; i++) {
            if (in_groups(i, mk, 3)) changed_k += k1[i] != k0[i];
            else if (k1[i] != k0[i]) fail_msg("K element %zu changed outside the NaN/Inf groups", i);
            if (in_groups(i, mv, 2)) changed_v += v1[i] != v0[i];
            else if (v1[i] != v0[i]) fail_msg("V element %zu changed outside the NaN/Inf groups", i);
        }
        assert_true(changed_k > 0 && changed_v > 0);
        /* FORMAT.md: a NaN is left out of min and max (its group keeps a finite
         * scale) and decodes to M; an Inf makes its affine group NaN (Inf * 0). */
        assert_false(isnan(kvf_bf16_to_f32(k1[mk[0] + 1])));
        assert_false(isnan(kvf_bf16_to_f32(k1[mk[0]])));
        assert_int_equal(k1[mk[1]], 0x7fc0);
        assert_int_equal(k1[mk[1] - 1], 0x7fc0);
        assert_int_equal(v1[mv[0]], 0x7fc0);
        /* The packed bytes outside the marked rows are those of the clean encode. */
        kvf_layout L;
        assert_int_equal(kvf_layout_compute(kvf_context_scheme(ctx), n, h, &L), KVF_OK);
        assert_memory_equal(p.p, clean, L.key.stage[0].codes_off); /* header and padding */
        free(clean);
        gb_free(&p), gb_free(&ko), gb_free(&vo), gb_free(&kc), gb_free(&vc);
    }
    free(k), free(v), free(k_bad), free(v_bad);
}

/* ------------------------------------------------------- NaN and Inf in Q */

/*
 * Query statistics fed two chunks with non-finite rows (tu_nonfinite_queries:
 * whole tokens, one KV head's tokens, every token of a KV head) equal, byte
 * for byte, per KV head the statistics of the same chunks without the tokens
 * that head lost; the header counts the skipped rows; an encode with them
 * writes the same packed bytes. test_gpu's gpu_qstats_nonfinite is the GPU twin.
 */
static void test_nan_inf_queries_skipped(void **state) {
    (void)state;
    kvf_scheme *s = tu_scheme("quantwm_int2");
    kvf_context *c;
    expect(kvf_context_create(s, KVF_DEVICE_CPU, &c), KVF_OK, NULL);
    const int64_t n = 24;
    const int hk = 2, hq = 4;
    kvf_qstats_layout l;
    expect(kvf_qstats_layout_compute(s, hk, &l), KVF_OK, NULL);
    assert_true(l.rank > 0);
    const size_t bytes = l.total_bytes, elems = (size_t)hq * n * D;
    uint16_t *bad[2], *clean[2], *kept_q = malloc(elems * 2);
    unsigned char drop[2][hk * n];
    uint64_t rows = 0;
    for (int i = 0; i < 2; i++) {
        bad[i] = malloc(elems * 2), clean[i] = malloc(elems * 2);
        rows += tu_nonfinite_queries(bad[i], n, hq, hk, D, 40 + i, i, drop[i]);
        tu_synth_kv(clean[i], n, hq, D, 40 + i);
    }
    gbuf got = gb_new(bytes, 0), want = gb_new(bytes, 0), ref = gb_new(bytes, 0);
    expect(kvf_qstats_init(c, got.p, bytes, hk, NULL), KVF_OK, NULL);
    kvf_shape sh = {n, hq, 0, 0};
    for (int i = 0; i < 2; i++) expect(kvf_qstats_update(c, got.p, bytes, bad[i], &sh, NULL), KVF_OK, NULL);
    gb_check_guards(&got, "qstats");
    /* Per KV head, the same updates on the clean chunks without its lost tokens. */
    for (int h = 0; h < hk; h++) {
        expect(kvf_qstats_init(c, ref.p, bytes, hk, NULL), KVF_OK, NULL);
        for (int i = 0; i < 2; i++) {
            kvf_shape kept = {tu_drop_tokens(clean[i], n, hq, D, drop[i] + h * n, kept_q), hq, 0, 0};
            if (kept.n_tokens > 0) expect(kvf_qstats_update(c, ref.p, bytes, kept_q, &kept, NULL), KVF_OK, NULL);
        }
        if (h == 0) memcpy(want.p, ref.p, bytes);
        else tu_qstats_copy_head(want.p, ref.p, &l, h);
    }
    memcpy(want.p + 24, &rows, 8); /* the header's skipped counter */
    assert_memory_equal(got.p, want.p, bytes);
    uint64_t skipped = 0;
    expect(kvf_qstats_skipped(got.p, 64, &skipped), KVF_OK, NULL);
    assert_int_equal(skipped, rows);
    assert_int_equal(rows, 2 * hq + 2 + 2 * n); /* tu_nonfinite_queries' two patterns */
    const double *count = (const double *)(got.p + l.count_off);
    assert_true(count[0] == (double)(2 * (n - 2))); /* the second chunk gave KV head 0 nothing */
    assert_true(count[1] == (double)(2 * (n - 3) + 2 * n));
    const float *f = (const float *)(got.p + l.msum_off);
    for (size_t i = 0; i < (l.total_bytes - l.msum_off) / 4; i++) assert_true(isfinite(f[i]));
    expect(kvf_qstats_skipped(got.p, 63, &skipped), KVF_ERANGE, "header is 64");
    got.p[4] = 1;
    expect(kvf_qstats_skipped(got.p, 64, &skipped), KVF_EFORMAT, "version 1");
    got.p[4] = 2;

    /* The encode that reads them: the same bytes. */
    const int64_t nk = 40;
    uint16_t *k = synth(nk, hk, 50), *v = synth(nk, hk, 51);
    size_t pb = packed_size(s, nk, hk);
    uint8_t *p1 = malloc(pb), *p2 = malloc(pb);
    kvf_shape ksh = {nk, hk, 0, 0};
    expect(kvf_encode(c, k, v, &ksh, got.p, p1, pb, NULL), KVF_OK, NULL);
    expect(kvf_encode(c, k, v, &ksh, want.p, p2, pb, NULL), KVF_OK, NULL);
    assert_memory_equal(p1, p2, pb);
    free(k), free(v), free(p1), free(p2), free(kept_q);
    for (int i = 0; i < 2; i++) free(bad[i]), free(clean[i]);
    gb_free(&got), gb_free(&want), gb_free(&ref);
    kvf_context_destroy(c);
    kvf_scheme_free(s);
}

/* ------------------------------------------------------ sizes, shapes, strides */

/* A failing encode into a guarded packed buffer writes nothing at all. */
static void encode_fails(kvf_context *ctx, const void *k, const void *v, const kvf_shape *sh,
                         size_t bytes, size_t give, int rc, const char *want) {
    gbuf p = gb_new(bytes, 0x3C);
    expect(kvf_encode(ctx, k, v, sh, NULL, p.p, give, NULL), rc, want);
    gb_check_guards(&p, "packed");
    for (size_t i = 0; i < bytes; i++)
        if (p.p[i] != 0x3C) fail_msg("a failing encode wrote packed byte %zu", i);
    gb_free(&p);
}

/* A failing decode into guarded outputs writes nothing at all. */
static void decode_fails(kvf_context *ctx, const void *packed, size_t give, const kvf_shape *sh,
                         size_t out_bytes, int rc, const char *want) {
    gbuf ko = gb_new(out_bytes, 0x5D), vo = gb_new(out_bytes, 0x5D);
    expect(kvf_decode(ctx, packed, give, sh, NULL, ko.p, vo.p, NULL), rc, want);
    gb_check_guards(&ko, "K out");
    gb_check_guards(&vo, "V out");
    for (size_t i = 0; i < out_bytes; i++)
        if (ko.p[i] != 0x5D || vo.p[i] != 0x5D) fail_msg("a failing decode wrote output byte %zu", i);
    gb_free(&ko), gb_free(&vo);
}

static void test_zero_length_chunks(void **state) {
    fixture *fx = *state;
    uint16_t *k = synth(4, 2, 1), *v = synth(4, 2, 2);
    size_t bytes = packed_size(fx->s2, 4, 2), got = 77;
    const struct { kvf_shape sh; const char *want; } bad[] = {
        {{0, 2, 0, 0}, "shape.n_tokens = 0: must be >= 1"},
        {{-5, 2, 0, 0}, "shape.n_tokens = -5: must be >= 1"},
        {{4, 0, 0, 0}, "shape.n_heads = 0: must be >= 1"},
        {{4, -1, 0, 0}, "shape.n_heads = -1: must be >= 1"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        encode_fails(fx->c2, k, v, &bad[i].sh, bytes, bytes, KVF_EINVAL, bad[i].want);
        uint8_t *p = encode_alone(fx->c2, k, v, 4, 2, &got);
        decode_fails(fx->c2, p, got, &bad[i].sh, 4 * 2 * D * 2, KVF_EINVAL, bad[i].want);
        free(p);
    }
    expect(kvf_packed_size(fx->s2, 0, 2, &got), KVF_EINVAL, "n_tokens = 0: must be >= 1");
    expect(kvf_packed_size(fx->s2, 4, 0, &got), KVF_EINVAL, "n_heads = 0: must be >= 1");
    kvf_footprint fp;
    expect(kvf_footprint_of(fx->s2, 0, 1, &fp), KVF_EINVAL, "n_tokens");
    uint8_t hdr[KVF_HEADER_BYTES] = {0};
    expect(kvf_packed_check(fx->s2, hdr, sizeof hdr, 0, 1), KVF_EINVAL, "n_tokens");
    expect(kvf_packed_check(fx->s2, hdr, 0, 4, 2), KVF_ERANGE, "0 bytes given");
    free(k), free(v);
}

/* A corrupt centroid index (past a 16-centroid table) is refused by the CPU
 * decode, naming the plane, head and token, before anything is written; the
 * largest valid index decodes. */
static void test_corrupt_centroid_index(void **state) {
    (void)state;
    kvf_scheme *s = tu_scheme_text("return { base = 'qvg_int2', name = 'qvg16', key = { centroids = 16 }, "
                                   "value = { centroids = 16, stages = 2 } }");
    kvf_context *ctx;
    assert_int_equal(kvf_context_create(s, KVF_DEVICE_CPU, &ctx), KVF_OK);
    const int64_t n = 40;
    const int32_t h = 2;
    uint16_t *k = synth(n, h, 11), *v = synth(n, h, 12);
    size_t bytes;
    uint8_t *p = encode_alone(ctx, k, v, n, h, &bytes);
    kvf_layout L;
    assert_int_equal(kvf_layout_compute(s, n, h, &L), KVF_OK);
    kvf_shape sh = {n, h, 0, 0};
    const size_t out = (size_t)n * h * D * 2;
    uint8_t *kix = p + L.key.stage[0].index_off, *vix = p + L.value.stage[1].index_off;
    kix[n + 7] = 15; /* the last centroid: valid */
    gbuf ko = gb_new(out, 0), vo = gb_new(out, 0);
    expect(kvf_decode(ctx, p, bytes, &sh, NULL, ko.p, vo.p, NULL), KVF_OK, NULL);
    gb_check_guards(&ko, "K out");
    gb_check_guards(&vo, "V out");
    gb_free(&ko), gb_free(&vo);
    kix[n + 7] = 16;
    decode_fails(ctx, p, bytes, &sh, out, KVF_EFORMAT, "key stage 0, head 1, token 7 stores centroid 16 of 16");
    kix[n + 7] = 0;
    vix[3] = 255;
    decode_fails(ctx, p, bytes, &sh, out, KVF_EFORMAT, "value stage 1, head 0, token 3 stores centroid 255 of 16");
    free(p), free(k), free(v);
    kvf_context_destroy(ctx);
    kvf_scheme_free(s);
}

/* K and V laid out for another head_dim, or strides that overlap. */
static void test_shape_mismatch(void **state) {
    fixture *fx = *state;
    const int64_t n = 6;
    const int32_t h = 2;
    uint16_t *k = synth(n, h, 3), *v = synth(n, h, 4);
    size_t bytes = packed_size(fx->s2, n, h), out = (size_t)n * h * D * 2;
    const struct { kvf_shape sh; const char *want; } bad[] = {
        /* a tensor of head_dim 64: tokens 64 elements apart */
        {{n, h, 64, 0}, "shape.token_stride = 64: tokens overlap (must be >= head_dim = 128)"},
        {{n, h, 64, n * 64}, "token_stride = 64: tokens overlap"},
        /* token-major with heads 64 apart */
        {{n, h, h * 64, 64}, "shape.head_stride = 64: heads overlap (must be >= head_dim = 128)"},
        {{1, h, 0, 100}, "shape.head_stride = 100: heads overlap"},
        {{n, h, D, D * (n - 1)}, "shape.head_stride"},
        {{n, h, -D, 0}, "shape.token_stride = -128: must be >= 0"},
        {{n, h, 0, -1}, "shape.head_stride = -1: must be >= 0"},
        {{INT64_MAX / 4, h, 0, 0}, "overflows"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        encode_fails(fx->c2, k, v, &bad[i].sh, bytes, (size_t)-1, KVF_EINVAL, bad[i].want);
        uint8_t *p = encode_alone(fx->c2, k, v, n, h, &bytes);
        decode_fails(fx->c2, p, bytes, &bad[i].sh, out, KVF_EINVAL, bad[i].want);
        free(p);
    }
    /* Too small a packed buffer for the shape. */
    kvf_shape sh = {n, h, 0, 0};
    encode_fails(fx->c2, k, v, &sh, bytes, bytes - 1, KVF_ERANGE, "packed buffer has");
    uint8_t *p = encode_alone(fx->c2, k, v, n, h, &bytes);
    decode_fails(fx->c2, p, bytes - 1, &sh, out, KVF_ERANGE, "packed buffer has");
    decode_fails(fx->c2, p, 10, &sh, out, KVF_ERANGE, "packed buffer has 10 bytes");
    /* Token and head counts that are not those of the packed cache (the
     * buffer is large enough for the shape asked for: the header says no). */
    uint8_t *big = calloc(1, bytes * 2);
    memcpy(big, p, bytes);
    kvf_shape more = {n + 1, h, 0, 0}, fewer = {n - 1, h, 0, 0}, heads = {n, h + 1, 0, 0};
    decode_fails(fx->c2, big, bytes * 2, &more, (size_t)(n + 1) * h * D * 2, KVF_EFORMAT,
                 "n_tokens is 6, expected 7");
    decode_fails(fx->c2, big, bytes * 2, &fewer, out, KVF_EFORMAT, "n_tokens is 6, expected 5");
    decode_fails(fx->c2, big, bytes * 2, &heads, (size_t)n * (h + 1) * D * 2, KVF_EFORMAT,
                 "n_heads is 2, expected 3");
    /* A cache of a head_dim-64 scheme read by the head_dim-128 one. */
    const char *d64 = "return { base = 'rtn_int2', name = 'rtn_int2_d64', head_dim = 64 }";
    kvf_scheme *s64 = tu_scheme_text(d64);
    kvf_context *c64;
    assert_int_equal(kvf_context_create(s64, KVF_DEVICE_CPU, &c64), KVF_OK);
    size_t b64 = packed_size(s64, n, h);
    uint8_t *p64 = calloc(1, bytes > b64 ? bytes : b64);
    uint16_t *k64 = malloc((size_t)n * h * 64 * 2);
    tu_synth_kv(k64, n, h, 64, 5);
    assert_int_equal(kvf_encode(c64, k64, k64, &sh, NULL, p64, b64, NULL), KVF_OK);
    decode_fails(fx->c2, p64, bytes > b64 ? bytes : b64, &sh, out, KVF_EFORMAT,
                 "written by scheme hash");
    expect(kvf_packed_check(fx->s2, p64, b64, n, h), KVF_EFORMAT, "(rtn_int2)");
    kvf_context_destroy(c64);
    kvf_scheme_free(s64);
    free(k), free(v), free(p), free(big), free(p64), free(k64);
}

static void test_null_pointers(void **state) {
    fixture *fx = *state;
    uint16_t *k = synth(2, 1, 6), *v = synth(2, 1, 7);
    size_t bytes = packed_size(fx->s2, 2, 1), got;
    kvf_shape sh = {2, 1, 0, 0};
    uint8_t *p = encode_alone(fx->c2, k, v, 2, 1, &bytes);
    gbuf q = gb_new(bytes, 0x22), ko = gb_new(2 * D * 2, 0x33), vo = gb_new(2 * D * 2, 0x33);
    expect(kvf_encode(NULL, k, v, &sh, NULL, q.p, bytes, NULL), KVF_EINVAL, "NULL");
    expect(kvf_encode(fx->c2, NULL, v, &sh, NULL, q.p, bytes, NULL), KVF_EINVAL, "NULL");
    expect(kvf_encode(fx->c2, k, NULL, &sh, NULL, q.p, bytes, NULL), KVF_EINVAL, "NULL");
    expect(kvf_encode(fx->c2, k, v, NULL, NULL, q.p, bytes, NULL), KVF_EINVAL, "NULL");
    expect(kvf_encode(fx->c2, k, v, &sh, NULL, NULL, bytes, NULL), KVF_EINVAL, "NULL");
    expect(kvf_decode(NULL, p, bytes, &sh, NULL, ko.p, vo.p, NULL), KVF_EINVAL, "NULL");
    expect(kvf_decode(fx->c2, NULL, bytes, &sh, NULL, ko.p, vo.p, NULL), KVF_EINVAL, "NULL");
    expect(kvf_decode(fx->c2, p, bytes, NULL, NULL, ko.p, vo.p, NULL), KVF_EINVAL, "NULL");
    expect(kvf_decode(fx->c2, p, bytes, &sh, NULL, NULL, vo.p, NULL), KVF_EINVAL, "NULL");
    expect(kvf_decode(fx->c2, p, bytes, &sh, NULL, ko.p, NULL, NULL), KVF_EINVAL, "NULL");
    for (size_t i = 0; i < bytes; i++) assert_int_equal(q.p[i], 0x22);
    for (size_t i = 0; i < ko.n; i++) assert_true(ko.p[i] == 0x33 && vo.p[i] == 0x33);
    gb_check_guards(&q, "packed"), gb_check_guards(&ko, "K"), gb_check_guards(&vo, "V");
    expect(kvf_packed_size(NULL, 2, 1, &got), KVF_EINVAL, "NULL");
    expect(kvf_packed_size(fx->s2, 2, 1, NULL), KVF_EINVAL, "NULL");
    expect(kvf_packed_check(NULL, p, bytes, 2, 1), KVF_EINVAL, "NULL");
    expect(kvf_packed_check(fx->s2, NULL, bytes, 2, 1), KVF_EINVAL, "NULL");
    expect(kvf_footprint_of(fx->s2, 2, 1, NULL), KVF_EINVAL, "NULL");
    kvf_context *c = (kvf_context *)1;
    expect(kvf_context_create(NULL, KVF_DEVICE_CPU, &c), KVF_EINVAL, "NULL");
    expect(kvf_context_create(fx->s2, KVF_DEVICE_CPU, NULL), KVF_EINVAL, "NULL");
    assert_null(kvf_context_scheme(NULL));
    kvf_context_destroy(NULL);
    free(k), free(v), free(p);
    gb_free(&q), gb_free(&ko), gb_free(&vo);
}

/* On the CPU a packed buffer may sit at any address and strides may be any
 * (non-overlapping) values; BF16 pointers must be 2-byte aligned. (The GPU
 * path requires 16 bytes and strides of 8: context.c check_device_args.) */
static void test_host_alignment(void **state) {
    fixture *fx = *state;
    const int64_t n = 5;
    const int32_t h = 3;
    size_t bytes, elems = (size_t)n * h * D;
    uint16_t *k = synth(n, h, 8), *v = synth(n, h, 9);
    uint8_t *ref = encode_alone(fx->c4, k, v, n, h, &bytes);
    kvf_shape sh = {n, h, 0, 0};
    for (size_t off = 1; off < 16; off += 2) {
        gbuf p = gb_new(bytes + 16, 0);
        expect(kvf_encode(fx->c4, k, v, &sh, NULL, p.p + off, bytes, NULL), KVF_OK, NULL);
        assert_memory_equal(p.p + off, ref, bytes);
        gbuf ko = gb_new(elems * 2 + 16, 0), vo = gb_new(elems * 2 + 16, 0);
        /* 2-byte aligned, not 16: fine on the CPU */
        expect(kvf_decode(fx->c4, p.p + off, bytes, &sh, NULL, ko.p + 2, vo.p + 6, NULL), KVF_OK, NULL);
        gb_check_guards(&p, "packed"), gb_check_guards(&ko, "K"), gb_check_guards(&vo, "V");
        gb_free(&ko), gb_free(&vo);
        /* odd BF16 pointers: refused before anything is read or written */
        gbuf ok = gb_new(elems * 2 + 2, 0x44);
        expect(kvf_decode(fx->c4, p.p + off, bytes, &sh, NULL, ok.p + 1, ok.p + 1, NULL),
               KVF_EINVAL, "2-byte aligned");
        for (size_t i = 0; i < ok.n; i++) assert_int_equal(ok.p[i], 0x44);
        gb_free(&ok);
        gb_free(&p);
    }
    uint8_t *odd = malloc(elems * 2 + 1);
    memcpy(odd + 1, k, elems * 2);
    encode_fails(fx->c4, odd + 1, v, &sh, bytes, bytes, KVF_EINVAL, "2-byte aligned");
    encode_fails(fx->c4, k, odd + 1, &sh, bytes, bytes, KVF_EINVAL, "2-byte aligned");
    /* Strides that are not multiples of 8, with padding that stays untouched. */
    kvf_shape pad = {n, h, D + 3, (int64_t)n * (D + 3) + 5};
    size_t span = (size_t)((n - 1) * pad.token_stride + (h - 1) * pad.head_stride + D);
    gbuf kp = gb_new(span * 2, 0), vp = gb_new(span * 2, 0);
    uint16_t *ks = (uint16_t *)kp.p, *vs = (uint16_t *)vp.p;
    for (int32_t j = 0; j < h; j++)
        for (int64_t t = 0; t < n; t++) {
            memcpy(ks + t * pad.token_stride + j * pad.head_stride, k + idx(j, t, 0, n), D * 2);
            memcpy(vs + t * pad.token_stride + j * pad.head_stride, v + idx(j, t, 0, n), D * 2);
        }
    uint8_t *p2 = malloc(bytes);
    expect(kvf_encode(fx->c4, ks, vs, &pad, NULL, p2, bytes, NULL), KVF_OK, NULL);
    assert_memory_equal(p2, ref, bytes);
    gbuf ko = gb_new(span * 2, 0xEE), vo = gb_new(span * 2, 0xEE);
    expect(kvf_decode(fx->c4, p2, bytes, &pad, NULL, ko.p, vo.p, NULL), KVF_OK, NULL);
    gb_check_guards(&ko, "K"), gb_check_guards(&vo, "V");
    /* every element outside the rows is padding: still 0xEE */
    uint16_t *kd = (uint16_t *)ko.p;
    bool *row = calloc(span, 1);
    for (int32_t j = 0; j < h; j++)
        for (int64_t t = 0; t < n; t++)
            memset(row + t * pad.token_stride + j * pad.head_stride, 1, D);
    for (size_t i = 0; i < span; i++)
        if (!row[i] && kd[i] != 0xEEEE) fail_msg("padding element %zu written", i);
    free(row), free(odd), free(p2), free(k), free(v), free(ref);
    gb_free(&kp), gb_free(&vp), gb_free(&ko), gb_free(&vo);
}

/* A cache written by another scheme or another format version. */
static void test_other_scheme_or_version(void **state) {
    fixture *fx = *state;
    const int64_t n = 7;
    const int32_t h = 2;
    size_t b2, b4, out = (size_t)n * h * D * 2;
    uint16_t *k = synth(n, h, 10), *v = synth(n, h, 11);
    uint8_t *p2 = encode_alone(fx->c2, k, v, n, h, &b2);
    uint8_t *p4 = encode_alone(fx->c4, k, v, n, h, &b4);
    kvf_shape sh = {n, h, 0, 0};
    char want[160];
    snprintf(want, sizeof want, "written by scheme hash %016llx, this scheme is %016llx (rtn_int4)",
             (unsigned long long)kvf_scheme_hash(fx->s2), (unsigned long long)kvf_scheme_hash(fx->s4));
    uint8_t *big = calloc(1, b4);
    memcpy(big, p2, b2);
    decode_fails(fx->c4, big, b4, &sh, out, KVF_EFORMAT, want);
    decode_fails(fx->c2, p4, b4, &sh, out, KVF_EFORMAT, "(rtn_int2)");

    /* Header fields, one at a time: version, magic, bits, sizes, reserved. */
    static const struct { size_t off; uint8_t x; const char *want; } field[] = {
        {4, 0x02, "format version 0, this library reads version 2"},
        {4, 0x03, "format version 1, this library reads version 2"}, /* a cache of kvforge before the int8 PSAC basis */
        {7, 0x80, "format version 2147483650"},
        {0, 0xff, "not a kvforge packed cache: magic"},
        {40, 0x06, "key_bits is 4, expected 2"},
        {41, 0x0a, "value_bits is 8, expected 2"},
        {32, 0x01, "total_bytes"},
        {28, 0x80, "head_dim"},
        {42, 0x01, "reserved bytes are not zero"},
        {63, 0x80, "reserved bytes are not zero"},
    };
    for (size_t i = 0; i < sizeof field / sizeof field[0]; i++) {
        uint8_t *c = malloc(b2);
        memcpy(c, p2, b2);
        c[field[i].off] ^= field[i].x;
        decode_fails(fx->c2, c, b2, &sh, out, KVF_EFORMAT, field[i].want);
        expect(kvf_packed_check(fx->s2, c, KVF_HEADER_BYTES, n, h), KVF_EFORMAT, field[i].want);
        free(c);
    }
    /* Not a cache at all: zeros, text, and a bare header without planes. */
    uint8_t *zeros = calloc(1, b2);
    decode_fails(fx->c2, zeros, b2, &sh, out, KVF_EFORMAT, "not a kvforge packed cache");
    memcpy(zeros, "return { name = 'not a cache' }", 31);
    decode_fails(fx->c2, zeros, b2, &sh, out, KVF_EFORMAT, "magic");
    decode_fails(fx->c2, p2, KVF_HEADER_BYTES, &sh, out, KVF_ERANGE, "packed buffer has 64 bytes");
    free(zeros), free(big), free(p2), free(p4), free(k), free(v);
}

/* --------------------------------------------- several chunks in one cache */

#define CHUNKS 4

/*
 * One packed arena with CHUNKS spans back to back (rtn_int2 and rtn_int4
 * alternating, each span at an odd offset from the last), and one decoded
 * tensor [H][CHUNKS * N][D] whose chunk c is the token range [c N, (c+1) N).
 * Failing calls on chunk 2 leave the arena and the tensor byte-identical; a
 * successful call on chunk 2 changes only chunk 2's bytes.
 */
typedef struct cache {
    int64_t n;
    int32_t h;
    size_t off[CHUNKS + 1], bytes[CHUNKS];
    gbuf arena, kt, vt;
    uint16_t *k[CHUNKS], *v[CHUNKS];
} cache;

static kvf_context *chunk_ctx(const fixture *fx, int c) { return c % 2 ? fx->c4 : fx->c2; }

static kvf_shape chunk_view(const cache *m) {
    kvf_shape sh = {m->n, m->h, D, CHUNKS * m->n * D};
    return sh;
}

static size_t view_off(const cache *m, int c) { return (size_t)c * (size_t)m->n * D; }

static void cache_fill(const fixture *fx, cache *m) {
    m->off[0] = 0;
    for (int c = 0; c < CHUNKS; c++) {
        m->bytes[c] = packed_size(kvf_context_scheme(chunk_ctx(fx, c)), m->n, m->h);
        m->off[c + 1] = m->off[c] + m->bytes[c] + 3;
    }
    m->arena = gb_new(m->off[CHUNKS], 0x99);
    size_t t_bytes = (size_t)CHUNKS * m->n * m->h * D * 2;
    m->kt = gb_new(t_bytes, 0x77);
    m->vt = gb_new(t_bytes, 0x77);
    kvf_shape sh = {m->n, m->h, 0, 0}, view = chunk_view(m);
    for (int c = 0; c < CHUNKS; c++) {
        m->k[c] = synth(m->n, m->h, 100 + c);
        m->v[c] = synth(m->n, m->h, 200 + c);
        expect(kvf_encode(chunk_ctx(fx, c), m->k[c], m->v[c], &sh, NULL, m->arena.p + m->off[c],
                          m->bytes[c], NULL), KVF_OK, NULL);
        expect(kvf_decode(chunk_ctx(fx, c), m->arena.p + m->off[c], m->bytes[c], &view, NULL,
                          (uint16_t *)m->kt.p + view_off(m, c), (uint16_t *)m->vt.p + view_off(m, c),
                          NULL), KVF_OK, NULL);
    }
}

typedef struct snapshot {
    uint8_t *arena, *kt, *vt;
} snapshot;

static snapshot snap(const cache *m) {
    snapshot s = {malloc(m->arena.n), malloc(m->kt.n), malloc(m->vt.n)};
    memcpy(s.arena, m->arena.p, m->arena.n);
    memcpy(s.kt, m->kt.p, m->kt.n);
    memcpy(s.vt, m->vt.p, m->vt.n);
    return s;
}

static void snap_free(snapshot *s) { free(s->arena), free(s->kt), free(s->vt); }

/* Bytes of the decoded tensor that belong to chunk c (tokens [c N, (c+1) N) of every head). */
static bool tensor_byte_in_chunk(const cache *m, size_t byte, int c) {
    size_t elem = byte / 2, tok = elem / D % ((size_t)CHUNKS * m->n);
    return tok / (size_t)m->n == (size_t)c;
}

/* Everything is as in s, except (when c >= 0) the bytes of chunk c. */
static void same_except(const cache *m, const snapshot *s, int c, const char *what) {
    gb_check_guards(&m->arena, what), gb_check_guards(&m->kt, what), gb_check_guards(&m->vt, what);
    for (size_t i = 0; i < m->arena.n; i++) {
        bool mine = c >= 0 && i >= m->off[c] && i < m->off[c] + m->bytes[c];
        if (!mine && m->arena.p[i] != s->arena[i])
            fail_msg("%s: packed arena byte %zu changed (chunk %d's span is %zu..%zu)", what, i, c,
                     c >= 0 ? m->off[c] : 0, c >= 0 ? m->off[c] + m->bytes[c] : 0);
    }
    for (size_t i = 0; i < m->kt.n; i++) {
        bool mine = c >= 0 && tensor_byte_in_chunk(m, i, c);
        if (!mine && (m->kt.p[i] != s->kt[i] || m->vt.p[i] != s->vt[i]))
            fail_msg("%s: decoded tensor byte %zu changed", what, i);
    }
}

static void test_other_chunks_intact(void **state) {
    fixture *fx = *state;
    cache m = {.n = 9, .h = 3};
    cache_fill(fx, &m);
    snapshot s0 = snap(&m);
    const int c = 2;
    kvf_context *ctx = chunk_ctx(fx, c), *other = chunk_ctx(fx, c + 1);
    uint8_t *span = m.arena.p + m.off[c];
    uint16_t *kv = (uint16_t *)m.kt.p + view_off(&m, c), *vv = (uint16_t *)m.vt.p + view_off(&m, c);
    kvf_shape sh = {m.n, m.h, 0, 0}, view = chunk_view(&m);
    kvf_shape zero = {0, m.h, 0, 0}, wide = {4 * m.n, m.h, 0, 0}, overlap = {m.n, m.h, 64, 0};
    kvf_shape wide_view = {m.n + 1, m.h, D, CHUNKS * m.n * D};

    /* Failing encodes into chunk 2's span. */
    expect(kvf_encode(ctx, m.k[c], m.v[c], &zero, NULL, span, m.bytes[c], NULL), KVF_EINVAL, NULL);
    expect(kvf_encode(ctx, m.k[c], m.v[c], &overlap, NULL, span, m.bytes[c], NULL), KVF_EINVAL, NULL);
    expect(kvf_encode(ctx, m.k[c], m.v[c], &sh, NULL, span, m.bytes[c] - 1, NULL), KVF_ERANGE, NULL);
    expect(kvf_encode(ctx, m.k[c], m.v[c], &wide, NULL, span, m.bytes[c], NULL), KVF_ERANGE, NULL);
    expect(kvf_encode(ctx, NULL, m.v[c], &sh, NULL, span, m.bytes[c], NULL), KVF_EINVAL, NULL);
    expect(kvf_encode(ctx, (uint8_t *)m.k[c] + 1, m.v[c], &sh, NULL, span, m.bytes[c], NULL),
           KVF_EINVAL, NULL);
    same_except(&m, &s0, -1, "failing encodes");

    /* Failing decodes of chunk 2 into its view of the tensor. */
    expect(kvf_decode(other, span, m.off[CHUNKS] - m.off[c], &view, NULL, kv, vv, NULL),
           KVF_EFORMAT, "written by scheme hash");
    expect(kvf_decode(ctx, span, m.bytes[c] - 1, &view, NULL, kv, vv, NULL), KVF_ERANGE, NULL);
    expect(kvf_decode(ctx, span, m.off[CHUNKS] - m.off[c], &wide_view, NULL, kv, vv, NULL),
           KVF_EFORMAT, "n_tokens");
    expect(kvf_decode(ctx, m.arena.p + m.off[c] + 3, m.bytes[c], &view, NULL, kv, vv, NULL),
           KVF_EFORMAT, "magic");
    expect(kvf_decode(ctx, span, m.bytes[c], &zero, NULL, kv, vv, NULL), KVF_EINVAL, NULL);
    kvf_shape tm_overlap = {m.n, m.h, D, D}; /* heads on top of each other */
    expect(kvf_decode(ctx, span, m.bytes[c], &tm_overlap, NULL, kv, vv, NULL), KVF_EINVAL, NULL);
    same_except(&m, &s0, -1, "failing decodes");

    /* Chunk 2 encoded again from data with NaN and Inf, and decoded: only its
     * span and its tokens change. */
    size_t elems = (size_t)m.n * m.h * D;
    uint16_t *k_bad = malloc(elems * 2);
    memcpy(k_bad, m.k[c], elems * 2);
    for (size_t i = 0; i < elems; i += 97) k_bad[i] = i % 2 ? 0x7fc0 : 0xff80;
    expect(kvf_encode(ctx, k_bad, m.v[c], &sh, NULL, span, m.bytes[c], NULL), KVF_OK, NULL);
    expect(kvf_decode(ctx, span, m.bytes[c], &view, NULL, kv, vv, NULL), KVF_OK, NULL);
    same_except(&m, &s0, c, "chunk 2 rewritten");
    assert_memory_not_equal(span, s0.arena + m.off[c], m.bytes[c]);
    /* ...and back: the cache is as it was. */
    expect(kvf_encode(ctx, m.k[c], m.v[c], &sh, NULL, span, m.bytes[c], NULL), KVF_OK, NULL);
    expect(kvf_decode(ctx, span, m.bytes[c], &view, NULL, kv, vv, NULL), KVF_OK, NULL);
    same_except(&m, &s0, -1, "chunk 2 restored");

    free(k_bad);
    snap_free(&s0);
    for (int i = 0; i < CHUNKS; i++) free(m.k[i]), free(m.v[i]);
    gb_free(&m.arena), gb_free(&m.kt), gb_free(&m.vt);
}

/* Runs kvf_bench with args (output into log): its exit status must be status
 * and the first line of its output (the refusal, or the data line) hold want. */
static void bench_expect(const char *bin, const char *args, const char *log, int status, const char *want) {
    char cmd[4096], line[1024] = "";
    snprintf(cmd, sizeof cmd, "'%s' %s > '%s' 2>&1", bin, args, log);
    int st = system(cmd);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != status) fail_msg("kvf_bench %s: status %d, want exit %d", args, st, status);
    FILE *f = fopen(log, "r");
    assert_non_null(f);
    assert_non_null(fgets(line, sizeof line, f));
    fclose(f);
    if (!strstr(line, want)) fail_msg("kvf_bench %s: \"%s\", want \"%s\"", args, line, want);
}

/* A valid dump (eval/dump.h) of one layer, one chunk, one head and 2 tokens
 * of head_dim 64, zeros, written by eval's safetensors writer: the bench's
 * layer has d = 128. */
static void write_dump_d64(const char *path) {
    static const uint16_t zeros[2 * 64];
    const char *meta[] = {"layers", "1", "chunks", "1", "q_heads", "1", "kv_heads", "1", "head_dim", "64",
                          "tokens_per_chunk", "2", "rope_theta", "10000", "rope_sections", "[32]"};
    const kvf_st_write_tensor t[3] = {{"l0.c0.q", KVF_ST_BF16, 3, {1, 2, 64}, zeros},
                                      {"l0.c0.k", KVF_ST_BF16, 3, {1, 2, 64}, zeros},
                                      {"l0.c0.v", KVF_ST_BF16, 3, {1, 2, 64}, zeros}};
    assert_int_equal(kvf_st_write(path, meta, 8, t, 3), KVF_OK);
}

/* The benchmark's command line (bench/bench.c): a bad argument is refused
 * before any GPU work, with exit status 2 and the argument named; so is a
 * --data file the bench cannot use, with the file named. */
static void test_bench_arguments(void **state) {
    (void)state;
    char bin[1200], args[3000], want[1200];
    if (!tu_built_program("kvf_bench", bin, sizeof bin)) skip();
    char *dir = tu_mkdtemp();
    const char *log = tu_join(dir, "bench.txt");
    const struct { const char *args, *want; } cases[] = {
        {"--heads 0", "needs an integer in range: --heads"},
        {"--heads 48x qvg_int2", "needs an integer in range: --heads"},
        {"--tokens", "needs an integer in range: --tokens"},
        {"--reps 257", "needs an integer in range: --reps"},
        {"--warmup 3", "unknown option: --warmup"},
        {"--no-probe --heads 0", "needs an integer in range: --heads"}, /* --no-probe is an option */
        {"qvg_int2 qvg_int3", "no shipped scheme of that name: qvg_int3"},
        {"--data", "needs a file: --data"},
        {"--data --no-probe qvg_int2", "needs a file: --data"},
        {"--data /nonexistent qvg_int2", "cannot use --data: /nonexistent: cannot open"},
        {"--assign approx qvg_int2", "needs fast, exact or both: --assign"},
        {"qvg_int2 --assign", "needs fast, exact or both: --assign"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) bench_expect(bin, cases[i].args, log, 2, cases[i].want);

    /* Files that are not dumps the bench can use: not safetensors at all, a
     * dump of head_dim 64. The message names the file and what is wrong. */
    const char *makefile = tu_path("Makefile");
    snprintf(args, sizeof args, "--data '%s'", makefile);
    snprintf(want, sizeof want, "cannot use --data: %s: header length", makefile);
    bench_expect(bin, args, log, 2, want);
    char d64[1100];
    snprintf(d64, sizeof d64, "%s", tu_join(dir, "d64.safetensors"));
    write_dump_d64(d64);
    snprintf(args, sizeof args, "--data '%s'", d64);
    snprintf(want, sizeof want, "cannot use --data: %s: head_dim 64, the bench's layer has d = 128", d64);
    bench_expect(bin, args, log, 2, want);

    /* The shipped dump is accepted: the data line first, then "no GPU" (exit
     * 0) where there is none; where there is one, a short run (tokens past
     * the dump's 2 x 4680 so they wrap, heads past its 2). */
    const char *dump = tu_path("eval/worldmodel/kv_small.safetensors");
    FILE *f = fopen(dump, "rb");
    if (f) {
        fclose(f);
        snprintf(args, sizeof args, "--data '%s' --tokens 10000 --heads 3 --reps 1 --no-probe rtn_int2", dump);
        snprintf(want, sizeof want, "data: %s (layer 0, K/V heads tiled h %% 2, tokens t %% 9360: 2 chunks x 4680)",
                 dump);
        bench_expect(bin, args, log, 0, want);
    } else {
        printf("skipped --data %s: it does not exist\n", dump);
    }
    bench_expect(bin, "--tokens 64 --heads 1 --reps 1 --no-probe rtn_int2", log, 0, "data: synthetic (kvf_synth_kv)");
    tu_rmtree(dir);
    free(dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_nan_inf_contained),
        cmocka_unit_test(test_nan_inf_queries_skipped),
        cmocka_unit_test(test_zero_length_chunks),
        cmocka_unit_test(test_shape_mismatch),
        cmocka_unit_test(test_null_pointers),
        cmocka_unit_test(test_host_alignment),
        cmocka_unit_test(test_other_scheme_or_version),
        cmocka_unit_test(test_corrupt_centroid_index),
        cmocka_unit_test(test_other_chunks_intact),
        cmocka_unit_test(test_bench_arguments),
    };
    return cmocka_run_group_tests_name("faults", tests, setup, teardown);
}
