/*
 * Shared by the libFuzzer targets (fuzz/fuzz_*.c) and by tests/test_fuzz_replay.c,
 * which includes the targets to run the corpus and every saved crash in the
 * ordinary test suite. A failed check aborts under libFuzzer (a finding); the
 * replay test defines FUZZ_FAIL to fail the cmocka test instead.
 */
#ifndef KVF_FUZZ_COMMON_H
#define KVF_FUZZ_COMMON_H

#include "internal.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef FUZZ_FAIL
#define FUZZ_FAIL(what) (fprintf(stderr, "fuzz check failed: %s\n", what), abort())
#endif

#define FUZZ_STR2(x) #x
#define FUZZ_STR(x) FUZZ_STR2(x)
/* Oracle: a property every input must keep (not an assert: always compiled in). */
#define FUZZ_CHECK(cond)                                                              \
    do {                                                                              \
        if (!(cond)) FUZZ_FAIL(__FILE__ ":" FUZZ_STR(__LINE__) ": " #cond);           \
    } while (0)

/* The schemes of the packed-cache targets, in their order (a seed's header
 * holds its scheme's hash; fuzz_roundtrip's first byte picks one by index):
 * the shipped rtn_int2 and rtn_int4; two RTN variants for the other code paths
 * (symmetric, 8 and 16 bits, head_dim 64 and 256); the centroid methods'
 * planes (16 centroids, so a stored index can be out of range; two value
 * stages), PSAC's basis codes, basis scales and coefficients, two-level
 * int8_fp16 scales; and KIVI's groups along tokens. fuzz_packed.c reads all
 * of them, fuzz_roundtrip.c the first FUZZ_ROUNDTRIP_SCHEMES (KIVI's CPU
 * encode adds nothing there), mkseeds.c writes seeds for them. A name is a
 * shipped scheme, a text starts with "return". */
#define FUZZ_SCHEMES 6
#define FUZZ_ROUNDTRIP_SCHEMES 5
static const char *const fuzz_scheme_source[FUZZ_SCHEMES] = {
    "rtn_int2",
    "rtn_int4",
    "return { name = 'fz_sym_d64', head_dim = 64,\n"
    "  key = { bits = 4, mode = 'symmetric', group_size = 32 },\n"
    "  value = { bits = 8, group_size = 16 } }\n",
    "return { name = 'fz_bf16_d256', head_dim = 256, key = { bits = 16 },\n"
    "  value = { bits = 2, mode = 'symmetric', group_size = 256 } }\n",
    "return { base = 'quantwm_int2', name = 'fz_cent16', head_dim = 64,\n"
    "  key = { centroids = 16, psac_rank = 4 },\n"
    "  value = { centroids = 16, stages = 2 } }\n",
    "return { base = 'kivi_int2', name = 'fz_kivi' }\n",
};

/* Scheme i of fuzz_scheme_source. */
static inline int fuzz_load_scheme(int i, kvf_scheme **s) {
    const char *src = fuzz_scheme_source[i];
    return strncmp(src, "return", 6) ? kvf_scheme_load_builtin(src, s)
                                     : kvf_scheme_load_string(src, strlen(src), "=fuzz", s);
}

/* Whether every stored centroid index of a packed cache of scheme s (n tokens,
 * h heads; the whole cache present) is below the centroid count: the CPU
 * decode refuses the cache otherwise (runtime/cpu/ref_encode.c). */
static inline int fuzz_indices_ok(const kvf_scheme *s, const uint8_t *data, int64_t n, int32_t h) {
    kvf_layout L;
    if (kvf_layout_compute(s, n, h, &L) != KVF_OK) return 1;
    const kvf_section_layout *sec[2] = {&L.key, &L.value};
    for (int t = 0; t < 2; t++) {
        if (sec[t]->centroids <= 0 || sec[t]->centroids >= 256) continue;
        for (int st = 0; st < sec[t]->stages; st++)
            for (size_t i = 0; i < sec[t]->stage[st].index_bytes; i++) {
                if (data[sec[t]->stage[st].index_off + i] >= sec[t]->centroids) return 0;
            }
    }
    return 1;
}

/* A buffer of n bytes filled with a pattern, to see afterwards what a call wrote. */
static inline uint8_t *fuzz_patterned(size_t n, uint8_t pattern) {
    uint8_t *p = malloc(n ? n : 1);
    if (!p) abort();
    memset(p, pattern, n);
    return p;
}

static inline int fuzz_all_equal(const uint8_t *p, size_t n, uint8_t pattern) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != pattern) return 0;
    return 1;
}

#endif
