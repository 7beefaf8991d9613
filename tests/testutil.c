/* Helpers shared by the cmocka tests. */
#include "testutil.h"

#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

const char *tu_src(void) {
    const char *s = getenv("KVF_SRC");
    return s && *s ? s : ".";
}

const char *tu_join(const char *dir, const char *name) {
    static char buf[8][1024];
    static int slot;
    char *b = buf[slot++ & 7];
    int n = snprintf(b, sizeof buf[0], "%s/%s", dir, name);
    if (n < 0 || (size_t)n >= sizeof buf[0]) fail_msg("path too long: %s/%s", dir, name);
    return b;
}

const char *const tu_time_limited_schemes[] = {"concat_churn.lua", "string_compare.lua", "table_shift.lua",
                                               "vararg_copy.lua",  "sort_loop.lua",      "xpcall_error_loop.lua",
                                               NULL};

int tu_listed(const char *name, const char *const *list) {
    for (; list && *list; list++)
        if (!strcmp(name, *list)) return 1;
    return 0;
}

const char *tu_path(const char *rel) { return tu_join(tu_src(), rel); }

int tu_built_program(const char *name, char *buf, size_t len) {
    const char *o = getenv("O");
    snprintf(buf, len, "%s/%s/bin/%s", tu_src(), o && *o ? o : "out", name);
    if (access(buf, X_OK) == 0) return 1;
    printf("skipped: %s not built\n", buf);
    return 0;
}

char *tu_mkdtemp(void) {
    char tmpl[] = "/tmp/kvftest.XXXXXX";
    char *d = mkdtemp(tmpl);
    assert_non_null(d);
    return strdup(d);
}

static int rm_cb(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb; (void)flag; (void)ftw;
    return remove(p);
}

void tu_rmtree(const char *dir) {
    if (dir) nftw(dir, rm_cb, 16, FTW_DEPTH | FTW_PHYS);
}

static void hand_tensor(kvf_tensor_cfg *c, int bits, int group, int mode) {
    c->bits = bits;
    c->group_size = group;
    c->mode = mode;
}

void tu_hand_scheme(struct kvf_scheme *s, int d, int kbits, int vbits, int g, int mode) {
    kvf_scheme_defaults(s);
    strcpy(s->name, "t");
    strcpy(s->source, "<test>");
    s->head_dim = d;
    hand_tensor(&s->key, kbits, g, mode);
    hand_tensor(&s->value, vbits, g, mode);
    tu_finalize(s);
}

void tu_finalize(struct kvf_scheme *s) {
    int rc;
    if (s->head_dim == 64 || s->head_dim == 128 || s->head_dim == 256) {
        rc = kvf_scheme_finalize(s);
    } else {
        /* Tiny head_dims (the CPU reference's arithmetic on small cases) are
         * below what the loader takes: their plan alone is built, by the same
         * rules (1-D RoPE over all pairs). */
        s->rope.n_sections = 1;
        s->rope.sections[0] = s->head_dim / 2;
        rc = kvf_plan_build(s, NULL, &s->plan);
    }
    if (rc) fail_msg("a scheme made by hand: %s", kvf_last_error());
    s->hash = TU_HAND_HASH;
    strcpy(s->id, "t_89abcdef");
}

kvf_scheme *tu_scheme(const char *name) {
    kvf_scheme *s = NULL;
    int rc = kvf_scheme_load_builtin(name, &s);
    if (rc) fail_msg("loading %s: %s", name, kvf_last_error());
    return s;
}

kvf_scheme *tu_scheme_text(const char *text) {
    kvf_scheme *s = NULL;
    int rc = kvf_scheme_load_string(text, strlen(text), "=test", &s);
    if (rc) fail_msg("loading <%s>: %s", text, kvf_last_error());
    return s;
}

void tu_write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(data, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

double tu_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

void tu_synth_kv(uint16_t *x, int64_t n_tokens, int n_heads, int head_dim, uint64_t seed) {
    kvf_synth_kv(x, n_tokens, n_heads, head_dim, seed);
}

uint64_t tu_splitmix(uint64_t x) {
    uint64_t z = x + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

uint64_t tu_rng_next(uint64_t *st) {
    uint64_t z = tu_splitmix(*st);
    *st += 0x9e3779b97f4a7c15ull;
    return z;
}

/* NaN and Inf of every kind: quiet, +Inf, -Inf, negative with a payload, signalling. */
static const uint16_t nonfinite[5] = {0x7fc0, 0x7f80, 0xff80, 0xffc1, 0x7f81};

uint64_t tu_nonfinite_queries(uint16_t *q, int64_t n, int hq, int n_kv, int d, uint64_t seed, int pattern,
                              unsigned char *drop) {
    const int group = hq / n_kv;
    uint64_t rows = 0;
    kvf_synth_kv(q, n, hq, d, seed);
    memset(drop, 0, (size_t)n_kv * (size_t)n);
    for (int h = 0; h < n_kv; h++)
        for (int64_t t = 0; t < n; t++) {
            int bad = pattern == 0 ? t == 0 || t == n / 2 || (t == n - 3 && h == n_kv - 1) : h == 0;
            if (!bad) continue;
            drop[(size_t)h * n + t] = 1;
            for (int g = 0; g < group; g++) {
                int j = h * group + g;
                /* Channels 0 and d-1 (edges of a row), else spread over the row. */
                int c = (int)((t + j) % 3 == 0 ? 0 : (t + j) % 3 == 1 ? d - 1 : (t * 37 + j * 11) % d);
                q[((size_t)j * n + t) * d + c] = nonfinite[(t + j) % 5];
                rows++;
            }
        }
    return rows;
}

int64_t tu_drop_tokens(const uint16_t *q, int64_t n, int hq, int d, const unsigned char *drop, uint16_t *out) {
    int64_t kept = 0;
    for (int64_t t = 0; t < n; t++) kept += !drop[t];
    for (int j = 0; j < hq; j++) {
        uint16_t *o = out + (size_t)j * kept * d;
        for (int64_t t = 0; t < n; t++)
            if (!drop[t]) memcpy(o, q + ((size_t)j * n + t) * d, (size_t)d * 2), o += d;
    }
    return kept;
}

void tu_qstats_copy_head(void *dst, const void *src, const kvf_qstats_layout *l, int h) {
    const size_t d = (size_t)l->head_dim, r = (size_t)l->rank;
    const struct { size_t off, each; } plane[4] = {
        {l->count_off, 8}, {l->msum_off, d * d * 4}, {l->u_off, d * r * 4}, {l->lambda_off, r * 4}};
    for (int p = 0; p < (r ? 4 : 2); p++)
        memcpy((uint8_t *)dst + plane[p].off + h * plane[p].each, (const uint8_t *)src + plane[p].off + h * plane[p].each,
               plane[p].each);
}
