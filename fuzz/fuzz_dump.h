/*
 * Small synthetic KV dumps (docs/QUALITY.md "Dump format") for the dump
 * target: fuzz_dump.c scores recon inputs against the fixed one (FD_FIXED),
 * mkseeds_dump.c writes the seeds. Deterministic.
 */
#ifndef KVF_FUZZ_DUMP_H
#define KVF_FUZZ_DUMP_H

#include "safetensors.h"

#include "internal.h"

#include <stdio.h>
#include <stdlib.h>

typedef struct fd_cfg {
    int layers, chunks, q_heads, kv_heads, d, queries;
    int64_t tokens;
    int pre;       /* k_pre, q_pre and pos (3 axes) too */
    int nonfinite; /* a NaN in l*.c1.k, -inf in l*.c0.v, +inf in l*.c2.q (where those chunks are) */
} fd_cfg;

/* The dump the recon inputs are scored against: 1 layer, 3 chunks of 4 tokens,
 * 2 query heads on 1 KV head, d = 128, 2 queries per chunk. */
static const fd_cfg FD_FIXED = {1, 3, 2, 1, 128, 2, 4, 0, 0};

/* Write the dump of c to path; KVF_OK or the writer's status. */
static inline int fd_write_dump(const char *path, const fd_cfg *c, uint64_t seed) {
    const int roles = c->pre ? 5 : 3, cells = c->layers * c->chunks;
    static const char *const role[5] = {"q", "k", "v", "k_pre", "q_pre"};
    const size_t kv = (size_t)c->kv_heads * c->tokens * c->d, qn = (size_t)c->q_heads * c->queries * c->d;
    kvf_st_write_tensor *t = calloc((size_t)cells * roles + 1, sizeof *t);
    char (*names)[32] = calloc((size_t)cells * roles + 1, 32);
    uint16_t **data = calloc((size_t)cells * roles, sizeof *data);
    int32_t *pos = malloc((size_t)c->chunks * c->tokens * 3 * sizeof *pos);
    int nt = 0, rc = KVF_ENOMEM;
    if (!t || !names || !data || !pos) goto done;
    for (int l = 0; l < c->layers; l++)
        for (int ch = 0; ch < c->chunks; ch++)
            for (int r = 0; r < roles; r++) {
                int is_q = r == 0 || r == 4;
                size_t n = is_q ? qn : kv;
                uint16_t *x = malloc(n * 2);
                if (!x) goto done;
                data[nt] = x;
                kvf_synth_kv(x, is_q ? c->queries : c->tokens, is_q ? c->q_heads : c->kv_heads, c->d,
                             seed + (uint64_t)nt * 7919);
                if (c->nonfinite && r == 1 && ch == 1) x[5] = 0x7fc0;       /* NaN */
                if (c->nonfinite && r == 2 && ch == 0) x[n - 1] = 0xff80;   /* -inf */
                if (c->nonfinite && r == 0 && ch == 2) x[n / 2 + 3] = 0x7f80; /* +inf */
                snprintf(names[nt], 32, "l%d.c%d.%s", l, ch, role[r]);
                t[nt] = (kvf_st_write_tensor){names[nt], KVF_ST_BF16, 3,
                                              {is_q ? c->q_heads : c->kv_heads, is_q ? c->queries : c->tokens, c->d}, x};
                nt++;
            }
    for (int64_t i = 0; i < (int64_t)c->chunks * c->tokens; i++) {
        pos[3 * i] = (int32_t)(i / c->tokens);
        pos[3 * i + 1] = (int32_t)(i % c->tokens) / 2;
        pos[3 * i + 2] = (int32_t)(i % 2);
    }
    int n_tensors = nt;
    if (c->pre) t[n_tensors++] = (kvf_st_write_tensor){"pos", KVF_ST_I32, 2, {(int64_t)c->chunks * c->tokens, 3}, pos};
    char num[6][16];
    snprintf(num[0], 16, "%d", c->layers);
    snprintf(num[1], 16, "%d", c->chunks);
    snprintf(num[2], 16, "%d", c->q_heads);
    snprintf(num[3], 16, "%d", c->kv_heads);
    snprintf(num[4], 16, "%d", c->d);
    snprintf(num[5], 16, "%lld", (long long)c->tokens);
    const char *meta[] = {"layers", num[0], "chunks", num[1], "q_heads", num[2], "kv_heads", num[3],
                          "head_dim", num[4], "tokens_per_chunk", num[5], "rope_theta", "10000",
                          "rope_sections", "[16, 24, 24]", "q_subsample", "1", "source", "fuzz seed (fuzz_dump.h)"};
    rc = kvf_st_write(path, meta, (int)(sizeof meta / sizeof meta[0] / 2), t, n_tensors);
done:
    for (int i = 0; data && i < nt; i++) free(data[i]);
    free(data);
    free(t);
    free(names);
    free(pos);
    return rc;
}

/* The whole file at path in a malloc'ed buffer (*n bytes), or NULL. */
static inline uint8_t *fd_read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    uint8_t *p = NULL;
    long len = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
    if (len > 0 && fseek(f, 0, SEEK_SET) == 0 && (p = malloc((size_t)len)) && fread(p, 1, (size_t)len, f) != (size_t)len) {
        free(p);
        p = NULL;
    }
    fclose(f);
    *n = p ? (size_t)len : 0;
    return p;
}

#endif
