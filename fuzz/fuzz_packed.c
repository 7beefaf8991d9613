/*
 * libFuzzer target: the packed-cache reader on arbitrary bytes. The input is a
 * whole packed cache (header and planes, packed_bytes = the input size), read
 * by kvf_packed_check and by the CPU decode (kvf_decode on a CPU context, i.e.
 * runtime/cpu/ref_quant.c, ref_encode.c) for a few fixed schemes: the shipped
 * rtn_int2 and rtn_int4, two variants that reach the other RTN code paths
 * (symmetric, 8 and 16 bits, head_dim 64 and 256), and two that reach the
 * other methods' planes (centroids and their indices, two stages, PSAC,
 * int8_fp16 scales, KIVI): fuzz_scheme_source in fuzz_common.h.
 *
 * The shape is the header's own when it is small, else 3 tokens x 2 heads;
 * the scheme is the one whose hash the header holds, else one picked by size.
 * Output buffers are exactly the tensor's size (ASan sees a write past them).
 * Oracles: decode fails exactly when the header check fails, the buffer is
 * too small or a stored centroid index is out of range, and then writes nothing; a decode that succeeds gives the same
 * values head-major and token-major.
 */
#include "fuzz_common.h"

typedef struct fp_scheme {
    kvf_scheme *s;
    kvf_context *ctx;
} fp_scheme;

static fp_scheme *fp_schemes(void) {
    static fp_scheme sch[FUZZ_SCHEMES];
    static int ready;
    if (ready) return sch;
    for (int i = 0; i < FUZZ_SCHEMES; i++) {
        FUZZ_CHECK(fuzz_load_scheme(i, &sch[i].s) == KVF_OK);
        FUZZ_CHECK(kvf_context_create(sch[i].s, KVF_DEVICE_CPU, &sch[i].ctx) == KVF_OK);
    }
    ready = 1;
    return sch;
}

/* Decode into exact buffers with the given strides; 0xA5 where nothing was written. */
static int fp_decode(const fp_scheme *f, const uint8_t *data, size_t size, const kvf_shape *sh,
                     size_t elems, uint16_t **k, uint16_t **v) {
    *k = (uint16_t *)fuzz_patterned(elems * 2, 0xA5);
    *v = (uint16_t *)fuzz_patterned(elems * 2, 0xA5);
    return kvf_decode(f->ctx, data, size, sh, NULL, *k, *v, NULL);
}

static void fp_read(const fp_scheme *f, const uint8_t *data, size_t size, int64_t n, int32_t h) {
    int d = kvf_scheme_head_dim(f->s);
    size_t elems = (size_t)n * (size_t)h * (size_t)d, total = 0;
    FUZZ_CHECK(kvf_packed_size(f->s, n, h, &total) == KVF_OK);
    int check = kvf_packed_check(f->s, data, size, n, h);
    kvf_shape hm = {n, h, 0, 0};
    uint16_t *k, *v;
    int rc = fp_decode(f, data, size, &hm, elems, &k, &v);
    int want = size < total ? KVF_ERANGE : check;
    if (want == KVF_OK && !fuzz_indices_ok(f->s, data, n, h)) want = KVF_EFORMAT;
    FUZZ_CHECK(rc == want);
    if (rc != KVF_OK) {
        FUZZ_CHECK(fuzz_all_equal((uint8_t *)k, elems * 2, 0xA5));
        FUZZ_CHECK(fuzz_all_equal((uint8_t *)v, elems * 2, 0xA5));
    } else {
        /* token-major [N][H][d] gives the same values */
        kvf_shape tm = {n, h, (int64_t)h * d, d};
        uint16_t *k2, *v2;
        FUZZ_CHECK(fp_decode(f, data, size, &tm, elems, &k2, &v2) == KVF_OK);
        for (int64_t t = 0; t < n; t++)
            for (int32_t j = 0; j < h; j++) {
                size_t a = ((size_t)j * (size_t)n + (size_t)t) * (size_t)d;
                size_t b = ((size_t)t * (size_t)h + (size_t)j) * (size_t)d;
                FUZZ_CHECK(!memcmp(k + a, k2 + b, (size_t)d * 2));
                FUZZ_CHECK(!memcmp(v + a, v2 + b, (size_t)d * 2));
            }
        free(k2), free(v2);
    }
    free(k), free(v);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static const uint8_t none[1] = {0};
    fp_scheme *sch = fp_schemes();
    if (!data) data = none;
    /* The header's shape when it is small enough to decode quickly. */
    int64_t n = 3;
    int32_t h = 2;
    int pick = (int)(size % FUZZ_SCHEMES);
    if (size >= KVF_HEADER_BYTES) {
        uint64_t hash = kvf_get_u64(data + 8), hn = kvf_get_u64(data + 16);
        uint32_t hh = kvf_get_u32(data + 24);
        for (int i = 0; i < FUZZ_SCHEMES; i++)
            if (kvf_scheme_hash(sch[i].s) == hash) pick = i;
        if (hn >= 1 && hn <= 4096 && hh >= 1 && hh <= 64 && hn * hh <= 4096) {
            n = (int64_t)hn;
            h = (int32_t)hh;
        }
    }
    /* Every scheme's header check, at the header's shape and at a fixed one. */
    for (int i = 0; i < FUZZ_SCHEMES; i++) {
        int a = kvf_packed_check(sch[i].s, data, size, n, h);
        int b = kvf_packed_check(sch[i].s, data, size, 17, 3);
        FUZZ_CHECK(a == KVF_OK || a == KVF_EFORMAT || a == KVF_ERANGE);
        FUZZ_CHECK(b == KVF_OK || b == KVF_EFORMAT || b == KVF_ERANGE);
        FUZZ_CHECK(a != KVF_OK || i == pick);
    }
    fp_read(&sch[pick], data, size, n, h);
    return 0;
}
