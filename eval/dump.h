/*
 * World-model KV dumps (a safetensors file, docs/QUALITY.md "Dump format"):
 * per layer l and chunk c the BF16 tensors
 *   l{l}.c{c}.q      [q_heads, Nq, head_dim]   queries (after RoPE; Nq may be a subsample)
 *   l{l}.c{c}.k      [kv_heads, N, head_dim]   keys after RoPE
 *   l{l}.c{c}.k_pre  [kv_heads, N, head_dim]   keys before RoPE (optional)
 *   l{l}.c{c}.q_pre  [q_heads, Nq, head_dim]   queries before RoPE (optional)
 *   l{l}.c{c}.v      [kv_heads, N, head_dim]   values
 * and pos (int32 [chunks * N, axes], optional), with "__metadata__" strings
 * layers, chunks, q_heads, kv_heads, head_dim, tokens_per_chunk, rope_theta,
 * rope_sections, q_subsample, source. kvf_dump_open validates all of it.
 */
#ifndef KVF_EVAL_DUMP_H
#define KVF_EVAL_DUMP_H

#include "safetensors.h"

#define KVF_DUMP_MAX_SECTIONS 8
/* Bounds that keep every product of them in range and reject absurd headers. */
#define KVF_DUMP_MAX_LAYERS 4096
#define KVF_DUMP_MAX_CHUNKS 65536
#define KVF_DUMP_MAX_HEADS 4096
#define KVF_DUMP_MAX_HEAD_DIM 4096
#define KVF_DUMP_MAX_TOKENS (1 << 24)

enum kvf_dump_role { KVF_DUMP_Q, KVF_DUMP_K, KVF_DUMP_K_PRE, KVF_DUMP_Q_PRE, KVF_DUMP_V, KVF_DUMP_ROLES };

typedef struct kvf_dump {
    kvf_st_file *file;
    int layers, chunks, q_heads, kv_heads, head_dim;
    int64_t tokens;        /* N, tokens per chunk */
    double rope_theta;
    int n_sections, sections[KVF_DUMP_MAX_SECTIONS];
    const char *q_subsample, *source; /* metadata strings as written */
    int pos_axes;          /* 0 when there is no pos tensor */
    const kvf_st_tensor *pos;
    const kvf_st_tensor **t; /* [layers][chunks][KVF_DUMP_ROLES], NULL where absent */
} kvf_dump;

/* Open and validate (the file stays open until kvf_dump_close; its data is
 * read when asked, kvf_st_open). */
int kvf_dump_open(const char *path, kvf_dump **out);
/* The same over bytes in memory (not copied), for tests and fuzzing. */
int kvf_dump_parse(const void *bytes, size_t len, const char *label, kvf_dump **out);
void kvf_dump_close(kvf_dump *d);

/* The role's name in a tensor's name ("q", "k", "k_pre", "q_pre", "v"; "?" out of range). */
const char *kvf_dump_role_name(int role);
/* The tensor of a role at (layer, chunk), or NULL when absent. */
const kvf_st_tensor *kvf_dump_tensor(const kvf_dump *d, int layer, int chunk, int role);

/* Copies out of the file (kvf_st_read): BF16 elements [first, first + n)
 * as uint16 or as float, int32 elements as int32. KVF_EIO when the file
 * was truncated while open (out zeroed where nothing was read). */
int kvf_dump_bf16(const kvf_st_tensor *t, size_t first, size_t n, uint16_t *out);
int kvf_dump_f32(const kvf_st_tensor *t, size_t first, size_t n, float *out);
int kvf_dump_i32(const kvf_st_tensor *t, size_t first, size_t n, int32_t *out);
/* How many of x[0..n) are NaN or infinite; the index of the first in *first
 * (untouched when there is none; first may be NULL). */
size_t kvf_count_nonfinite_f32(const float *x, size_t n, size_t *first);
size_t kvf_count_nonfinite_bf16(const uint16_t *x, size_t n, size_t *first);

/* Shared with recon.c: a metadata value that must be a plain decimal in
 * [lo, hi] (KVF_EFORMAT naming the key otherwise), and a decimal index
 * without leading zeros below max at *p (advanced; 0 when there is none). */
int kvf_dump_meta_int(const kvf_st_file *f, const char *key, long long lo, long long hi, long long *out);
int kvf_dump_parse_index(const char **p, int max, int *out);

#endif
