/*
 * Writes the seed corpora of the packed-cache targets: real packed caches
 * (fuzz/corpus/packed/, encoded on the CPU from synthetic video-like K/V) for
 * the schemes fuzz_packed.c reads, and BF16 inputs for fuzz_roundtrip.c
 * (fuzz/corpus/roundtrip/), some with NaN, Inf, subnormals and signed zeros.
 * Deterministic: running it again gives the same files.
 *
 *   out/fuzz/mkseeds fuzz/corpus
 */
#include "fuzz_common.h" /* fuzz_scheme_source, fuzz_load_scheme */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static _Noreturn void die(const char *what) {
    fprintf(stderr, "mkseeds: %s: %s\n", what, kvf_last_error());
    exit(1);
}

static void write_file(const char *dir, const char *name, const void *p, size_t n) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, n, f) != n || fclose(f) != 0) {
        perror(path);
        exit(1);
    }
}

static void packed_seed(const char *dir, kvf_scheme *s, int64_t n, int32_t h, uint64_t seed) {
    kvf_context *ctx;
    size_t bytes, elems = (size_t)n * (size_t)h * (size_t)s->head_dim;
    if (kvf_context_create(s, KVF_DEVICE_CPU, &ctx) || kvf_packed_size(s, n, h, &bytes))
        die(s->name);
    uint16_t *k = malloc(elems * 2), *v = malloc(elems * 2);
    uint8_t *p = malloc(bytes);
    kvf_synth_kv(k, n, h, s->head_dim, seed);
    kvf_synth_kv(v, n, h, s->head_dim, seed + 1);
    kvf_shape sh = {n, h, 0, 0};
    if (kvf_encode(ctx, k, v, &sh, NULL, p, bytes, NULL)) die("encode");
    char name[128];
    snprintf(name, sizeof name, "%s_%lldx%d.bin", s->name, (long long)n, (int)h);
    write_file(dir, name, p, bytes);
    free(k), free(v), free(p);
    kvf_context_destroy(ctx);
}

/* fuzz_roundtrip input: scheme, tokens-1, heads-1, then little-endian BF16 values. */
static void roundtrip_seed(const char *dir, const char *name, int scheme, int n, int h, int d,
                           int special) {
    size_t elems = (size_t)n * (size_t)h * (size_t)d;
    uint16_t *x = malloc(2 * elems * 2);
    kvf_synth_kv(x, n, h, d, 7);
    kvf_synth_kv(x + elems, n, h, d, 8);
    static const uint16_t specials[] = {0x7fc0, 0xffc1, 0x7f80, 0xff80, 0x8000, 0x0000,
                                        0x0001, 0x8001, 0x7f7f, 0xff7f, 0x3380, 0x477f};
    for (size_t i = 0; special && i < 2 * elems; i += 5)
        x[i] = specials[(i / 5) % (sizeof specials / sizeof specials[0])];
    size_t n_bytes = 3 + 2 * elems * 2;
    uint8_t *b = malloc(n_bytes);
    b[0] = (uint8_t)scheme, b[1] = (uint8_t)(n - 1), b[2] = (uint8_t)(h - 1);
    for (size_t i = 0; i < 2 * elems; i++) {
        b[3 + 2 * i] = (uint8_t)(x[i] & 0xff);
        b[4 + 2 * i] = (uint8_t)(x[i] >> 8);
    }
    write_file(dir, name, b, n_bytes);
    free(x), free(b);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: mkseeds CORPUS_DIR (writes CORPUS_DIR/packed and /roundtrip)\n");
        return 2;
    }
    char packed[900], roundtrip[900];
    snprintf(packed, sizeof packed, "%s/packed", argv[1]);
    snprintf(roundtrip, sizeof roundtrip, "%s/roundtrip", argv[1]);
    kvf_scheme *s[FUZZ_SCHEMES];
    for (int i = 0; i < FUZZ_SCHEMES; i++)
        if (fuzz_load_scheme(i, &s[i])) die(fuzz_scheme_source[i]);
    static const struct { int64_t n; int32_t h; } shapes[] = {{1, 1}, {3, 2}, {17, 3}, {64, 2}};
    for (int i = 0; i < FUZZ_SCHEMES; i++)
        for (size_t j = 0; j < sizeof shapes / sizeof shapes[0]; j++)
            if (s[i]->head_dim * shapes[j].n * shapes[j].h <= 128 * 64 * 2)
                packed_seed(packed, s[i], shapes[j].n, shapes[j].h, 100 + j);
    roundtrip_seed(roundtrip, "rtn_int2_2x2", 0, 2, 2, 128, 0);
    roundtrip_seed(roundtrip, "rtn_int4_1x1_special", 1, 1, 1, 128, 1);
    roundtrip_seed(roundtrip, "sym_d64_3x2_special", 2, 3, 2, 64, 1);
    roundtrip_seed(roundtrip, "bf16_d256_1x1_special", 3, 1, 1, 256, 1);
    roundtrip_seed(roundtrip, "cent16_d64_8x2", 4, 8, 2, 64, 0);
    roundtrip_seed(roundtrip, "cent16_d64_3x2_special", 4, 3, 2, 64, 1);
    for (int i = 0; i < FUZZ_SCHEMES; i++) kvf_scheme_free(s[i]);
    return 0;
}
