/*
 * libFuzzer target: the CPU encoder on arbitrary BF16 values (NaN, Inf,
 * subnormals, signed zeros: docs/FORMAT.md "Special values"), then the
 * decoder. Bytes 0-2 pick the scheme (fuzz_packed.c's RTN four, then its
 * 16-centroid QuantWM variant: k-means, two stages, int8_fp16 scales; PSAC
 * stays off without query statistics), the tokens (1..8) and heads (1..4);
 * the rest are the K then V values, repeated as needed.
 *
 * Oracles: encode succeeds and writes a header kvf_packed_check accepts and
 * nothing past the packed size; encoding twice gives the same bytes; decode
 * succeeds; 16-bit sections come back bit for bit; a group of finite values
 * of magnitude <= 60000 decodes to finite values (with centroids, whose
 * means mix a head's tokens: when every value of the head is). The same
 * again for V and K swapped, encoded with the k-means warm-started from the
 * first encode (kvf_encode_warm: its centroids may hold anything the values
 * did).
 */
#include "fuzz_common.h"

#include <math.h>

static kvf_context *fr_contexts(int i) {
    static kvf_context *ctx[FUZZ_ROUNDTRIP_SCHEMES];
    if (!ctx[0]) {
        for (int j = 0; j < FUZZ_ROUNDTRIP_SCHEMES; j++) {
            kvf_scheme *s = NULL;
            FUZZ_CHECK(fuzz_load_scheme(j, &s) == KVF_OK);
            FUZZ_CHECK(kvf_context_create(s, KVF_DEVICE_CPU, &ctx[j]) == KVF_OK);
            kvf_scheme_free(s);
        }
    }
    return ctx[i];
}

static int fr_tame(const uint16_t *x, size_t n) {
    for (size_t i = 0; i < n; i++) {
        float f = kvf_bf16_to_f32(x[i]);
        if (!isfinite(f) || fabsf(f) > 60000.0f) return 0;
    }
    return 1;
}

/* Finite in, finite out, for each group of a quantized section (head-major
 * [heads][n][d]; with centroids: for the whole head, as a centroid is a mean
 * over the head's tokens). */
static void fr_check_section(const kvf_tensor_cfg *c, int d, const uint16_t *x, const uint16_t *y, size_t n,
                             size_t heads) {
    const size_t rows = n * heads, hd = n * (size_t)d;
    if (c->bits == 16) {
        FUZZ_CHECK(!memcmp(x, y, rows * (size_t)d * 2));
        return;
    }
    int head_tame = 0;
    for (size_t r = 0; r < rows; r++) {
        if (c->centroids && r % n == 0) head_tame = fr_tame(x + r / n * hd, hd);
        for (int g0 = 0; g0 < d; g0 += c->group_size) {
            const uint16_t *xg = x + r * (size_t)d + g0, *yg = y + r * (size_t)d + g0;
            const int tame = c->centroids ? head_tame : fr_tame(xg, (size_t)c->group_size);
            for (int i = 0; tame && i < c->group_size; i++)
                FUZZ_CHECK(isfinite(kvf_bf16_to_f32(yg[i])));
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 3) return 0;
    kvf_context *ctx = fr_contexts(data[0] % FUZZ_ROUNDTRIP_SCHEMES);
    const struct kvf_scheme *s = kvf_context_scheme(ctx);
    int d = s->head_dim;
    kvf_shape sh = {1 + data[1] % 8, 1 + data[2] % 4, 0, 0};
    size_t elems = (size_t)sh.n_tokens * (size_t)sh.n_heads * (size_t)d, bytes = 0;
    const uint8_t *src = data + 3;
    size_t src_n = size - 3;
    uint16_t *kv = malloc(2 * elems * 2), *ko = malloc(elems * 2), *vo = malloc(elems * 2);
    FUZZ_CHECK(kv && ko && vo);
    for (size_t i = 0; i < 2 * elems; i++)
        kv[i] = src_n >= 2 ? (uint16_t)(src[(2 * i) % (src_n - src_n % 2)] |
                                        src[(2 * i) % (src_n - src_n % 2) + 1] << 8)
                           : 0;
    FUZZ_CHECK(kvf_packed_size(s, sh.n_tokens, sh.n_heads, &bytes) == KVF_OK);
    uint8_t *p1 = fuzz_patterned(bytes + 64, 0x5A), *p2 = fuzz_patterned(bytes, 0xC3);
    FUZZ_CHECK(kvf_encode(ctx, kv, kv + elems, &sh, NULL, p1, bytes + 64, NULL) == KVF_OK);
    FUZZ_CHECK(fuzz_all_equal(p1 + bytes, 64, 0x5A));
    FUZZ_CHECK(kvf_packed_check(s, p1, bytes, sh.n_tokens, sh.n_heads) == KVF_OK);
    FUZZ_CHECK(kvf_encode(ctx, kv, kv + elems, &sh, NULL, p2, bytes, NULL) == KVF_OK);
    FUZZ_CHECK(!memcmp(p1, p2, bytes));
    FUZZ_CHECK(kvf_decode(ctx, p1, bytes, &sh, NULL, ko, vo, NULL) == KVF_OK);
    fr_check_section(&s->key, d, kv, ko, (size_t)sh.n_tokens, (size_t)sh.n_heads);
    fr_check_section(&s->value, d, kv + elems, vo, (size_t)sh.n_tokens, (size_t)sh.n_heads);
    uint8_t *p3 = fuzz_patterned(bytes + 64, 0x3C);
    FUZZ_CHECK(kvf_encode_warm(ctx, kv + elems, kv, &sh, NULL, p1, bytes, sh.n_tokens, p3, bytes + 64, NULL) == KVF_OK);
    FUZZ_CHECK(fuzz_all_equal(p3 + bytes, 64, 0x3C));
    FUZZ_CHECK(kvf_packed_check(s, p3, bytes, sh.n_tokens, sh.n_heads) == KVF_OK);
    FUZZ_CHECK(kvf_decode(ctx, p3, bytes, &sh, NULL, ko, vo, NULL) == KVF_OK);
    fr_check_section(&s->key, d, kv + elems, ko, (size_t)sh.n_tokens, (size_t)sh.n_heads);
    fr_check_section(&s->value, d, kv, vo, (size_t)sh.n_tokens, (size_t)sh.n_heads);
    free(kv), free(ko), free(vo), free(p1), free(p2), free(p3);
    return 0;
}
