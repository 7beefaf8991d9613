/* World-model KV dumps: validation of names, shapes, dtypes and metadata. */
#include "dump.h"

#include "internal.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char *const role_names[KVF_DUMP_ROLES] = {"q", "k", "k_pre", "q_pre", "v"};

const char *kvf_dump_role_name(int role) { return role >= 0 && role < KVF_DUMP_ROLES ? role_names[role] : "?"; }

#define MAX_LAYERS KVF_DUMP_MAX_LAYERS
#define MAX_CHUNKS KVF_DUMP_MAX_CHUNKS
#define MAX_HEADS KVF_DUMP_MAX_HEADS
#define MAX_HEAD_DIM KVF_DUMP_MAX_HEAD_DIM
#define MAX_TOKENS KVF_DUMP_MAX_TOKENS

/* --------------------------------------------------------------- metadata */

int kvf_dump_meta_int(const kvf_st_file *f, const char *key, long long lo, long long hi, long long *out) {
    const char *s = kvf_st_meta(f, key);
    if (!s) return kvf_set_error(KVF_EFORMAT, "%s: metadata \"%s\" is missing", kvf_st_label(f), key);
    if (!kvf_parse_int(s, lo, hi, out))
        return kvf_set_error(KVF_EFORMAT, "%s: metadata \"%s\" = \"%.40s\": must be an integer in [%lld, %lld]",
                             kvf_st_label(f), key, s, lo, hi);
    return KVF_OK;
}

static int meta_theta(const kvf_st_file *f, double *out) {
    const char *s = kvf_st_meta(f, "rope_theta");
    if (!s) return kvf_set_error(KVF_EFORMAT, "%s: metadata \"rope_theta\" is missing", kvf_st_label(f));
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end || errno || !isfinite(v) || v <= 0)
        return kvf_set_error(KVF_EFORMAT, "%s: metadata \"rope_theta\" = \"%.40s\": must be a finite number > 0",
                             kvf_st_label(f), s);
    *out = v;
    return KVF_OK;
}

/* "[16, 24, 24]", "16,24,24" or "16 24 24": positive integers. */
static int meta_sections(const kvf_st_file *f, kvf_dump *d) {
    const char *s = kvf_st_meta(f, "rope_sections");
    if (!s) return kvf_set_error(KVF_EFORMAT, "%s: metadata \"rope_sections\" is missing", kvf_st_label(f));
    d->n_sections = 0;
    for (const char *p = s; *p;) {
        if (strchr("[], ", *p)) { p++; continue; }
        long long v = 0;
        const char *q = p;
        while (*q >= '0' && *q <= '9' && q - p < 9) v = v * 10 + (*q++ - '0');
        if (q == p || (*q && !strchr("[], ", *q)) || v < 1 || v > MAX_HEAD_DIM ||
            d->n_sections == KVF_DUMP_MAX_SECTIONS)
            return kvf_set_error(KVF_EFORMAT,
                                 "%s: metadata \"rope_sections\" = \"%.60s\": must list at most %d positive integers",
                                 kvf_st_label(f), s, KVF_DUMP_MAX_SECTIONS);
        d->sections[d->n_sections++] = (int)v;
        p = q;
    }
    return KVF_OK;
}

static int read_metadata(kvf_dump *d) {
    const kvf_st_file *f = d->file;
    long long layers, chunks, qh, kvh, hd, n;
    int rc;
    if ((rc = kvf_dump_meta_int(f, "layers", 1, MAX_LAYERS, &layers)) || (rc = kvf_dump_meta_int(f, "chunks", 1, MAX_CHUNKS, &chunks)) ||
        (rc = kvf_dump_meta_int(f, "q_heads", 1, MAX_HEADS, &qh)) || (rc = kvf_dump_meta_int(f, "kv_heads", 1, MAX_HEADS, &kvh)) ||
        (rc = kvf_dump_meta_int(f, "head_dim", 1, MAX_HEAD_DIM, &hd)) ||
        (rc = kvf_dump_meta_int(f, "tokens_per_chunk", 1, MAX_TOKENS, &n)) || (rc = meta_theta(f, &d->rope_theta)) ||
        (rc = meta_sections(f, d)))
        return rc;
    if (qh % kvh)
        return kvf_set_error(KVF_EFORMAT, "%s: q_heads = %lld is not a multiple of kv_heads = %lld", kvf_st_label(f),
                             qh, kvh);
    d->layers = (int)layers;
    d->chunks = (int)chunks;
    d->q_heads = (int)qh;
    d->kv_heads = (int)kvh;
    d->head_dim = (int)hd;
    d->tokens = n;
    d->q_subsample = kvf_st_meta(f, "q_subsample");
    d->source = kvf_st_meta(f, "source");
    return KVF_OK;
}

/* ---------------------------------------------------------------- tensors */

/* Decimal without leading zeros; advances *p. */
int kvf_dump_parse_index(const char **p, int max, int *out) {
    const char *s = *p;
    long v = 0;
    if (*s < '0' || *s > '9' || (s[0] == '0' && s[1] >= '0' && s[1] <= '9')) return 0;
    while (*s >= '0' && *s <= '9') {
        v = v * 10 + (*s++ - '0');
        if (v >= max) return 0;
    }
    *p = s;
    *out = (int)v;
    return 1;
}

/* "l{layer}.c{chunk}.{role}" with layer < layers and chunk < chunks. */
static int parse_name(const kvf_dump *d, const char *name, int *layer, int *chunk, int *role) {
    const char *p = name;
    if (*p++ != 'l' || !kvf_dump_parse_index(&p, d->layers, layer) || *p++ != '.' || *p++ != 'c' ||
        !kvf_dump_parse_index(&p, d->chunks, chunk) || *p++ != '.')
        return 0;
    for (int r = 0; r < KVF_DUMP_ROLES; r++)
        if (!strcmp(p, role_names[r])) { *role = r; return 1; }
    return 0;
}

static int shape_error(const kvf_dump *d, const kvf_st_tensor *t, const char *want) {
    char got[160];
    int o = snprintf(got, sizeof got, "[");
    for (int i = 0; i < t->ndim && o < 120; i++) o += snprintf(got + o, sizeof got - o, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
    snprintf(got + o, sizeof got - o, "]");
    return kvf_set_error(KVF_EFORMAT, "%s: tensor \"%s\": shape %s, expected %s", kvf_st_label(d->file), t->name, got,
                         want);
}

static int check_dtype(const kvf_dump *d, const kvf_st_tensor *t, kvf_st_dtype want) {
    if (t->dtype == want) return KVF_OK;
    return kvf_set_error(KVF_EFORMAT, "%s: tensor \"%s\": dtype %s, expected %s", kvf_st_label(d->file), t->name,
                         kvf_st_dtype_name(t->dtype), kvf_st_dtype_name(want));
}

static int check_kv_tensor(const kvf_dump *d, const kvf_st_tensor *t, int role) {
    int rc = check_dtype(d, t, KVF_ST_BF16);
    if (rc) return rc;
    int heads = role == KVF_DUMP_Q || role == KVF_DUMP_Q_PRE ? d->q_heads : d->kv_heads;
    char want[120];
    if (role == KVF_DUMP_Q || role == KVF_DUMP_Q_PRE) {
        if (t->ndim != 3 || t->shape[0] != heads || t->shape[1] < 1 || t->shape[1] > MAX_TOKENS ||
            t->shape[2] != d->head_dim) {
            snprintf(want, sizeof want, "[q_heads = %d, Nq (1..%d), head_dim = %d]", heads, MAX_TOKENS, d->head_dim);
            return shape_error(d, t, want);
        }
    } else if (t->ndim != 3 || t->shape[0] != heads || t->shape[1] != d->tokens || t->shape[2] != d->head_dim) {
        snprintf(want, sizeof want, "[kv_heads = %d, tokens_per_chunk = %lld, head_dim = %d]", heads,
                 (long long)d->tokens, d->head_dim);
        return shape_error(d, t, want);
    }
    return KVF_OK;
}

static int check_pos(kvf_dump *d, const kvf_st_tensor *t) {
    int rc = check_dtype(d, t, KVF_ST_I32);
    if (rc) return rc;
    if (t->ndim != 2 || t->shape[0] != (int64_t)d->chunks * d->tokens || t->shape[1] < 1 ||
        t->shape[1] > KVF_DUMP_MAX_SECTIONS) {
        char want[120];
        snprintf(want, sizeof want, "[chunks * tokens_per_chunk = %lld, axes (1..%d)]",
                 (long long)d->chunks * d->tokens, KVF_DUMP_MAX_SECTIONS);
        return shape_error(d, t, want);
    }
    d->pos = t;
    d->pos_axes = (int)t->shape[1];
    return KVF_OK;
}

static const kvf_st_tensor **slot(const kvf_dump *d, int layer, int chunk, int role) {
    return &d->t[((size_t)layer * d->chunks + chunk) * KVF_DUMP_ROLES + role];
}

static int index_tensors(kvf_dump *d) {
    const kvf_st_file *f = d->file;
    size_t n = kvf_st_count(f), cells = (size_t)d->layers * d->chunks;
    if (cells * 3 > n)
        return kvf_set_error(KVF_EFORMAT, "%s: %d layers x %d chunks need %zu q/k/v tensors, the file has %zu",
                             kvf_st_label(f), d->layers, d->chunks, cells * 3, n);
    d->t = calloc(cells * KVF_DUMP_ROLES, sizeof *d->t);
    if (!d->t) return kvf_set_error(KVF_ENOMEM, "%s: out of memory indexing tensors", kvf_st_label(f));
    for (size_t i = 0; i < n; i++) {
        const kvf_st_tensor *t = kvf_st_at(f, i);
        int layer, chunk, role, rc;
        if (!strcmp(t->name, "pos")) rc = check_pos(d, t);
        else if (parse_name(d, t->name, &layer, &chunk, &role)) {
            *slot(d, layer, chunk, role) = t;
            rc = check_kv_tensor(d, t, role);
        } else {
            char pn[128];
            rc = kvf_set_error(KVF_EFORMAT,
                               "%s: unexpected tensor \"%s\" (expected pos or l{0..%d}.c{0..%d}.{q,k,k_pre,q_pre,v})",
                               kvf_st_label(f), kvf_st_printable(t->name, pn, sizeof pn), d->layers - 1, d->chunks - 1);
        }
        if (rc) return rc;
    }
    return KVF_OK;
}

/* q, k, v everywhere; q_pre with the queries of q. */
static int check_complete(const kvf_dump *d) {
    static const int required[3] = {KVF_DUMP_Q, KVF_DUMP_K, KVF_DUMP_V};
    for (int l = 0; l < d->layers; l++)
        for (int c = 0; c < d->chunks; c++) {
            for (int i = 0; i < 3; i++)
                if (!*slot(d, l, c, required[i]))
                    return kvf_set_error(KVF_EFORMAT, "%s: tensor \"l%d.c%d.%s\" is missing", kvf_st_label(d->file), l,
                                         c, role_names[required[i]]);
            const kvf_st_tensor *q = *slot(d, l, c, KVF_DUMP_Q), *qp = *slot(d, l, c, KVF_DUMP_Q_PRE);
            if (qp && qp->shape[1] != q->shape[1])
                return kvf_set_error(KVF_EFORMAT, "%s: tensor \"%s\" has %lld queries, \"%s\" has %lld",
                                     kvf_st_label(d->file), qp->name, (long long)qp->shape[1], q->name,
                                     (long long)q->shape[1]);
        }
    return KVF_OK;
}

static int finish_open(kvf_dump *d, kvf_dump **out) {
    int rc = read_metadata(d);
    if (!rc) rc = index_tensors(d);
    if (!rc) rc = check_complete(d);
    if (rc) { kvf_dump_close(d); return rc; }
    *out = d;
    return KVF_OK;
}

int kvf_dump_open(const char *path, kvf_dump **out) {
    if (!out) return kvf_set_error(KVF_EINVAL, "kvf_dump_open: out is NULL");
    *out = NULL;
    kvf_dump *d = calloc(1, sizeof *d);
    if (!d) return kvf_set_error(KVF_ENOMEM, "out of memory opening %s", path ? path : "(null)");
    int rc = kvf_st_open(path, &d->file);
    if (rc) { free(d); return rc; }
    return finish_open(d, out);
}

int kvf_dump_parse(const void *bytes, size_t len, const char *label, kvf_dump **out) {
    if (!out) return kvf_set_error(KVF_EINVAL, "kvf_dump_parse: out is NULL");
    *out = NULL;
    kvf_dump *d = calloc(1, sizeof *d);
    if (!d) return kvf_set_error(KVF_ENOMEM, "out of memory parsing %s", label ? label : "<memory>");
    int rc = kvf_st_parse(bytes, len, label, &d->file);
    if (rc) { free(d); return rc; }
    return finish_open(d, out);
}

void kvf_dump_close(kvf_dump *d) {
    if (!d) return;
    free(d->t);
    kvf_st_close(d->file);
    free(d);
}

const kvf_st_tensor *kvf_dump_tensor(const kvf_dump *d, int layer, int chunk, int role) {
    if (!d || layer < 0 || layer >= d->layers || chunk < 0 || chunk >= d->chunks || role < 0 || role >= KVF_DUMP_ROLES)
        return NULL;
    return *slot(d, layer, chunk, role);
}

int kvf_dump_bf16(const kvf_st_tensor *t, size_t first, size_t n, uint16_t *out) {
    return kvf_st_read(t, first * 2, n * 2, out);
}

int kvf_dump_f32(const kvf_st_tensor *t, size_t first, size_t n, float *out) {
    /* The BF16 bytes land in the upper half of out, then widen in place from
     * the front: element i is read (at byte 2n + 2i) before out[i] (bytes
     * 4i..4i+3) is written, and 4i + 3 < 2n + 2(i + 1) for every i < n - 1, so
     * no element is overwritten before it is read. */
    uint8_t *bytes = (uint8_t *)out;
    int rc = kvf_st_read(t, first * 2, n * 2, bytes + n * 2);
    for (size_t i = 0; i < n; i++) {
        const uint8_t *p = bytes + n * 2 + i * 2;
        uint32_t u = ((uint32_t)p[0] | (uint32_t)p[1] << 8) << 16;
        memcpy(&out[i], &u, 4);
    }
    return rc;
}

int kvf_dump_i32(const kvf_st_tensor *t, size_t first, size_t n, int32_t *out) {
    return kvf_st_read(t, first * 4, n * 4, out);
}

size_t kvf_count_nonfinite_f32(const float *x, size_t n, size_t *first) {
    size_t count = 0;
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i]) && count++ == 0 && first) *first = i;
    return count;
}

size_t kvf_count_nonfinite_bf16(const uint16_t *x, size_t n, size_t *first) {
    size_t count = 0;
    for (size_t i = 0; i < n; i++)
        if ((x[i] & 0x7f80u) == 0x7f80u && count++ == 0 && first) *first = i; /* exponent all ones */
    return count;
}
