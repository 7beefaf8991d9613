/* Helpers shared by the cmocka tests. */
#ifndef KVF_TESTUTIL_H
#define KVF_TESTUTIL_H
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include "internal.h"

/* Source tree root (KVF_SRC, else "."), for schemes/ and tests/ data. */
const char *tu_src(void);
/* tu_src()/rel into a static buffer (rotating, 8 slots). */
const char *tu_path(const char *rel);
/* Fresh private temporary directory (mkdtemp); removed by tu_rmtree. */
char *tu_mkdtemp(void);
void tu_rmtree(const char *dir);
/* Deterministic synthetic BF16 K/V with video-like statistics. */
void tu_synth_kv(uint16_t *x, int64_t n_tokens, int n_heads, int head_dim, uint64_t seed);
/* splitmix64: the tests' deterministic generator (one step). */
uint64_t tu_rng_next(uint64_t *state);
/* Load a shipped scheme by name, failing the test on error. */
kvf_scheme *tu_scheme(const char *name);
#endif
