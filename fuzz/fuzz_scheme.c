/*
 * libFuzzer target: the scheme loader on arbitrary text (runtime/scheme/: the
 * line-index tokenizer, the Lua sandbox, the raw reader, the checks, the
 * canonical text), and for a scheme that loads, its layout and a tiny CPU
 * encode/decode.
 *
 * Oracles besides ASan/UBSan: a failure is KVF_ESCHEME (or KVF_ENOMEM) with a
 * message that starts with "FILE:LINE: ", the file being the text ("fuzz") or
 * a shipped base; a scheme that loads has a canonical text that loads back to
 * the same text and hash; a supported scheme encodes and decodes.
 */
#include "fuzz_common.h"

static int fs_digits(const char *p) {
    int n = 0;
    while (p[n] >= '0' && p[n] <= '9') n++;
    return n;
}

/* "fuzz:N: " or "<builtin>/NAME.lua:N: ". */
static int fs_located(const char *msg) {
    const char *p = NULL;
    if (!strncmp(msg, "fuzz:", 5)) {
        p = msg + 5;
    } else if (!strncmp(msg, "<builtin>/", 10)) {
        const char *colon = strstr(msg, ".lua:");
        if (!colon) return 0;
        p = colon + 5;
    } else {
        return 0;
    }
    int d = fs_digits(p);
    return d > 0 && p[d] == ':' && p[d + 1] == ' ';
}

/* Layout, packed size and a 3-token x 2-head round trip on the CPU backend. */
static void fs_exercise(const kvf_scheme *s) {
    kvf_context *ctx = NULL;
    int rc = kvf_context_create(s, KVF_DEVICE_CPU, &ctx);
    if (rc) {
        FUZZ_CHECK(rc == KVF_ENOTIMPL && ctx == NULL);
        return;
    }
    int d = kvf_scheme_head_dim(s);
    kvf_shape sh = {3, 2, 0, 0};
    size_t n = (size_t)3 * 2 * (size_t)d, bytes = 0;
    FUZZ_CHECK(kvf_packed_size(s, sh.n_tokens, sh.n_heads, &bytes) == KVF_OK);
    uint16_t *k = malloc(n * 2), *v = malloc(n * 2), *ko = malloc(n * 2), *vo = malloc(n * 2);
    uint8_t *packed = malloc(bytes);
    FUZZ_CHECK(k && v && ko && vo && packed);
    kvf_synth_kv(k, sh.n_tokens, sh.n_heads, d, 1);
    kvf_synth_kv(v, sh.n_tokens, sh.n_heads, d, 2);
    kvf_scheme_info info;
    FUZZ_CHECK(kvf_scheme_get_info(s, &info) == KVF_OK);
    /* Mixed precision needs a channel map: each head refines its first channels. */
    uint8_t *map = malloc((size_t)2 * 2 * d);
    FUZZ_CHECK(map != NULL);
    for (int sec = 0; sec < 2; sec++)
        for (int h = 0; h < 2; h++)
            for (int c = 0; c < d; c++)
                map[(sec * 2 + h) * d + c] = c < info.mixed_channels[sec] ? (uint8_t)c : 255;
    kvf_encode_args ea = {0};
    if (info.mixed_channels[0] || info.mixed_channels[1]) ea.channel_map = map;
    FUZZ_CHECK(kvf_encode_ex(ctx, k, v, &sh, &ea, packed, bytes, NULL) == KVF_OK);
    free(map);
    FUZZ_CHECK(kvf_packed_check(s, packed, bytes, sh.n_tokens, sh.n_heads) == KVF_OK);
    /* Keys cached before RoPE are decoded with positions (3 tokens x the scheme's axes). */
    int32_t pos[3 * 4] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
    const int32_t *p = info.rope_placement == 1 ? pos : NULL;
    FUZZ_CHECK(info.rope_axes >= 1 && info.rope_axes <= 4);
    FUZZ_CHECK(kvf_decode(ctx, packed, bytes, &sh, p, ko, vo, NULL) == KVF_OK);
    free(k), free(v), free(ko), free(vo), free(packed);
    kvf_context_destroy(ctx);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static const char empty[1] = "";
    const char *text = data ? (const char *)data : empty;
    kvf_scheme *s = (kvf_scheme *)&s;
    int rc = kvf_scheme_load_string(text, size, "=fuzz", &s);
    if (rc != KVF_OK) {
        FUZZ_CHECK(s == NULL);
        FUZZ_CHECK(rc == KVF_ESCHEME || rc == KVF_ENOMEM);
        if (rc == KVF_ESCHEME && size <= (1u << 20)) FUZZ_CHECK(fs_located(kvf_last_error()));
        return 0;
    }
    FUZZ_CHECK(s != NULL);
    const char *canon = kvf_scheme_canonical(s);
    kvf_scheme *r = NULL;
    FUZZ_CHECK(kvf_scheme_load_string(canon, strlen(canon), "=canonical", &r) == KVF_OK);
    FUZZ_CHECK(strcmp(kvf_scheme_canonical(r), canon) == 0);
    FUZZ_CHECK(kvf_scheme_hash(r) == kvf_scheme_hash(s));
    FUZZ_CHECK(strcmp(kvf_scheme_id(r), kvf_scheme_id(s)) == 0);
    kvf_scheme_free(r);
    fs_exercise(s);
    kvf_scheme_free(s);
    return 0;
}
