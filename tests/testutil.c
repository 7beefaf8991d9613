/* Helpers shared by the cmocka tests. */
#include "testutil.h"

#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

const char *tu_src(void) {
    const char *s = getenv("KVF_SRC");
    return s && *s ? s : ".";
}

const char *tu_path(const char *rel) {
    static char buf[8][1024];
    static int slot;
    char *b = buf[slot++ & 7];
    snprintf(b, sizeof buf[0], "%s/%s", tu_src(), rel);
    return b;
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

kvf_scheme *tu_scheme(const char *name) {
    kvf_scheme *s = NULL;
    int rc = kvf_scheme_load_builtin(name, &s);
    if (rc) fail_msg("loading %s: %s", name, kvf_last_error());
    return s;
}

void tu_synth_kv(uint16_t *x, int64_t n_tokens, int n_heads, int head_dim, uint64_t seed) {
    kvf_synth_kv(x, n_tokens, n_heads, head_dim, seed);
}

uint64_t tu_rng_next(uint64_t *st) {
    uint64_t z = (*st += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
