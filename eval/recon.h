/*
 * Reconstruction files ("recon", docs/QUALITY.md "Scoring a peer's cache"):
 * what a cache returned for the history at every streaming step of a dump, and
 * the bytes it stored, so that another system's cache (a peer) is scored by the
 * same streaming and metric code as kvforge's schemes. A safetensors file:
 *   l{l}.s{c}.k       BF16 [kv_heads, c * N, head_dim]  keys of chunks 0..c-1 (post-RoPE)
 *                                                      as the cache returned them when
 *                                                      chunk c's queries attended
 *   l{l}.s{c}.v       BF16 [kv_heads, c * N, head_dim]  the values, likewise
 *   l{l}.s{c}.packed  U8 [c]                           1: the chunk came from stored
 *                                                      (compressed) bytes, 0: kept exact
 *   l{l}.stored_bytes I64 [parts]                       bytes stored at the end of the
 *                                                      stream, by part
 * for every layer l and step 1 <= c < chunks, with "__metadata__" strings
 * format ("kvforge-recon 1"), layers, chunks, kv_heads, head_dim,
 * tokens_per_chunk, sink, recent, span, name, stored_bytes_parts (the parts'
 * names, comma-separated), and optionally peer and dump (free text).
 */
#ifndef KVF_EVAL_RECON_H
#define KVF_EVAL_RECON_H

#include "dump.h"

#define KVF_RECON_FORMAT "kvforge-recon 1"
#define KVF_RECON_MAX_PARTS 8
#define KVF_RECON_PART_NAME 32

enum kvf_recon_role { KVF_RECON_K, KVF_RECON_V, KVF_RECON_PACKED, KVF_RECON_ROLES };

typedef struct kvf_recon {
    kvf_st_file *file;
    int layers, chunks, kv_heads, head_dim;
    int64_t tokens;
    int sink, recent, span;            /* the policy the cache ran with (reported, not applied) */
    const char *name, *peer, *dump;    /* metadata; peer and dump "" when absent */
    int n_parts;
    char part[KVF_RECON_MAX_PARTS][KVF_RECON_PART_NAME];
    const kvf_st_tensor **t;           /* [layers][chunks][KVF_RECON_ROLES]; step 0 is empty */
    const kvf_st_tensor **bytes;       /* [layers] */
    uint8_t **flags;                   /* [layers][chunks]: the packed flags, read at open (step 0: NULL) */
    int64_t *part_bytes;               /* [layers][KVF_RECON_MAX_PARTS]: stored_bytes, read at open */
} kvf_recon;

/* Open and validate (names, dtypes, shapes, metadata, packed flags 0 or 1,
 * byte counts >= 0); the file stays open until kvf_recon_close. */
int kvf_recon_open(const char *path, kvf_recon **out);
/* The same over bytes in memory (not copied), for tests and fuzzing. */
int kvf_recon_parse(const void *bytes, size_t len, const char *label, kvf_recon **out);
void kvf_recon_close(kvf_recon *r);

/* The recon was made from a dump of this shape (layers, chunks, KV heads,
 * head_dim, tokens per chunk), else KVF_EFORMAT naming both files. */
int kvf_recon_check_dump(const kvf_recon *r, const kvf_dump *d);

const kvf_st_tensor *kvf_recon_tensor(const kvf_recon *r, int layer, int step, int role);
/* Step's packed flags (step bytes, 0 or 1), or NULL out of range. */
const uint8_t *kvf_recon_flags(const kvf_recon *r, int layer, int step);
/* Sum of the layer's stored byte parts; part i's bytes in *parts (may be NULL). */
double kvf_recon_layer_bytes(const kvf_recon *r, int layer, double *parts);

#endif
