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
/* dir/name into a static buffer (rotating, 8 slots shared with tu_path);
 * fails the test if it does not fit. */
const char *tu_join(const char *dir, const char *name);
/* tu_join(tu_src(), rel). */
const char *tu_path(const char *rel);
/* tests/schemes_bad files that run until the loader's CPU time limit stops
 * them (NULL-terminated): test_scheme checks its cases against this list,
 * test_fuzz_replay leaves them out. */
extern const char *const tu_time_limited_schemes[];
/* Whether name is in a NULL-terminated list (NULL: an empty list). */
int tu_listed(const char *name, const char *const *list);
/* The path of a program `make` built (O/bin/NAME, O from the environment,
 * default out) into buf; 0 where it is not there, after printing that the
 * test is skipped (the caller then calls skip()). */
int tu_built_program(const char *name, char *buf, size_t len);
/* Fresh private temporary directory (mkdtemp); removed by tu_rmtree. */
char *tu_mkdtemp(void);
void tu_rmtree(const char *dir);
/* Deterministic synthetic BF16 K/V with video-like statistics. */
void tu_synth_kv(uint16_t *x, int64_t n_tokens, int n_heads, int head_dim, uint64_t seed);
/* splitmix64: the tests' deterministic generator (one step). */
uint64_t tu_rng_next(uint64_t *state);
/* splitmix64's output for state x (tu_rng_next without the state): a hash of x. */
uint64_t tu_splitmix(uint64_t x);
/* The hash of every scheme made by hand (its id is "t_89abcdef"). */
#define TU_HAND_HASH 0x0123456789abcdefull
/* A scheme filled by hand (no loader), finalized: name "t", head_dim d, K
 * and V of kbits and vbits bits in channel groups of g with the same mode,
 * the other fields at their defaults (fp16 scales, no centroids, QSAC, PSAC,
 * stages or RoPE, kmeans_iters 2). */
void tu_hand_scheme(struct kvf_scheme *s, int d, int kbits, int vbits, int g, int mode);
/* kvf_scheme_finalize after changing a hand-made scheme's fields, failing
 * the test on error; the hash and id stay TU_HAND_HASH's. */
void tu_finalize(struct kvf_scheme *s);
/* Load a shipped scheme by name, failing the test on error. */
kvf_scheme *tu_scheme(const char *name);
/* Load a scheme from Lua text (chunk name "=test", so its source is "test"), failing the test on error. */
kvf_scheme *tu_scheme_text(const char *text);
/* Write n bytes to path (created or truncated), failing the test on a short write. */
void tu_write_file(const char *path, const void *data, size_t n);
/* CLOCK_MONOTONIC in seconds. */
double tu_now_s(void);
/*
 * Non-finite query tests (test_faults, test_gpu): q [hq][n][d] = the synthetic
 * queries tu_synth_kv(seed) gives, with a NaN or an Inf in some rows. drop
 * [n_kv][n] gets 1 where KV head h loses token t (every query head of its
 * group holds a non-finite value at t). Pattern 0: tokens 0 and n/2 in every
 * query head, token n-3 in the last KV head's only; pattern 1: every token of
 * KV head 0. Returns the number of query rows made non-finite.
 */
uint64_t tu_nonfinite_queries(uint16_t *q, int64_t n, int hq, int n_kv, int d, uint64_t seed, int pattern,
                              unsigned char *drop);
/* out [hq][kept][d] = q [hq][n][d] without the tokens t with drop[t]; returns kept. */
int64_t tu_drop_tokens(const uint16_t *q, int64_t n, int hq, int d, const unsigned char *drop, uint16_t *out);
/* Copy KV head h's count, sums, basis and lambda from one statistics buffer to another. */
void tu_qstats_copy_head(void *dst, const void *src, const kvf_qstats_layout *l, int h);
#endif
