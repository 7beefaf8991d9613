/* Reconstruction files (recon.h): validation of metadata, names, dtypes, shapes and values. */
#include "recon.h"

#include "internal.h"

#include <stdlib.h>
#include <string.h>

static const char *const role_names[KVF_RECON_ROLES] = {"k", "v", "packed"};

/* A byte count per part at most 2^53: sums of a few thousand stay exact in a double. */
#define MAX_PART_BYTES (1ll << 53)

/* --------------------------------------------------------------- metadata */

static int meta_text(const kvf_recon *r, const char *key, int required, const char **out) {
    const char *s = kvf_st_meta(r->file, key);
    if (!s && required)
        return kvf_set_error(KVF_EFORMAT, "%s: metadata \"%s\" is missing", kvf_st_label(r->file), key);
    *out = s ? s : "";
    return KVF_OK;
}

/* "codes,scales,ids": 1..KVF_RECON_MAX_PARTS names of [a-z0-9_], 1..31 characters each. */
static int read_parts(kvf_recon *r) {
    const char *s;
    int rc = meta_text(r, "stored_bytes_parts", 1, &s);
    if (rc) return rc;
    r->n_parts = 0;
    for (const char *p = s;;) {
        size_t n = strspn(p, "abcdefghijklmnopqrstuvwxyz0123456789_");
        if (n == 0 || n >= KVF_RECON_PART_NAME || r->n_parts == KVF_RECON_MAX_PARTS || (p[n] && p[n] != ',')) {
            char pn[128];
            return kvf_set_error(KVF_EFORMAT,
                                 "%s: metadata \"stored_bytes_parts\" = \"%s\": must be 1..%d comma-separated names "
                                 "of 1..%d characters [a-z0-9_]",
                                 kvf_st_label(r->file), kvf_st_printable(s, pn, sizeof pn), KVF_RECON_MAX_PARTS,
                                 KVF_RECON_PART_NAME - 1);
        }
        memcpy(r->part[r->n_parts], p, n);
        r->part[r->n_parts++][n] = 0;
        if (!p[n]) break;
        p += n + 1;
    }
    return KVF_OK;
}

static int read_metadata(kvf_recon *r) {
    const kvf_st_file *f = r->file;
    const char *format = kvf_st_meta(f, "format");
    if (!format || strcmp(format, KVF_RECON_FORMAT)) {
        char pn[128];
        return kvf_set_error(KVF_EFORMAT, "%s: metadata \"format\" is %s%s%s, expected \"%s\" (not a recon file?)",
                             kvf_st_label(f), format ? "\"" : "", format ? kvf_st_printable(format, pn, sizeof pn) : "missing",
                             format ? "\"" : "", KVF_RECON_FORMAT);
    }
    long long layers, chunks, kvh, hd, n, sink, recent, span;
    int rc;
    if ((rc = kvf_dump_meta_int(f, "layers", 1, KVF_DUMP_MAX_LAYERS, &layers)) ||
        (rc = kvf_dump_meta_int(f, "chunks", 1, KVF_DUMP_MAX_CHUNKS, &chunks)) ||
        (rc = kvf_dump_meta_int(f, "kv_heads", 1, KVF_DUMP_MAX_HEADS, &kvh)) ||
        (rc = kvf_dump_meta_int(f, "head_dim", 1, KVF_DUMP_MAX_HEAD_DIM, &hd)) ||
        (rc = kvf_dump_meta_int(f, "tokens_per_chunk", 1, KVF_DUMP_MAX_TOKENS, &n)) ||
        (rc = kvf_dump_meta_int(f, "sink", 0, KVF_DUMP_MAX_CHUNKS, &sink)) ||
        (rc = kvf_dump_meta_int(f, "recent", 0, KVF_DUMP_MAX_CHUNKS, &recent)) ||
        (rc = kvf_dump_meta_int(f, "span", 1, KVF_DUMP_MAX_CHUNKS, &span)) ||
        (rc = meta_text(r, "name", 1, &r->name)) || (rc = meta_text(r, "peer", 0, &r->peer)) ||
        (rc = meta_text(r, "dump", 0, &r->dump)) || (rc = read_parts(r)))
        return rc;
    if (!*r->name) return kvf_set_error(KVF_EFORMAT, "%s: metadata \"name\" is empty", kvf_st_label(f));
    r->layers = (int)layers;
    r->chunks = (int)chunks;
    r->kv_heads = (int)kvh;
    r->head_dim = (int)hd;
    r->tokens = n;
    r->sink = (int)sink;
    r->recent = (int)recent;
    r->span = (int)span;
    return KVF_OK;
}

/* ---------------------------------------------------------------- tensors */

static const kvf_st_tensor **slot(const kvf_recon *r, int layer, int step, int role) {
    return &r->t[((size_t)layer * r->chunks + step) * KVF_RECON_ROLES + role];
}

/* "l{l}.s{c}.{k,v,packed}" with 1 <= c < chunks, or "l{l}.stored_bytes" (*step = 0, *role = -1). */
static int parse_name(const kvf_recon *r, const char *name, int *layer, int *step, int *role) {
    const char *p = name;
    if (*p++ != 'l' || !kvf_dump_parse_index(&p, r->layers, layer) || *p++ != '.') return 0;
    if (!strcmp(p, "stored_bytes")) {
        *step = 0;
        *role = -1;
        return 1;
    }
    if (*p++ != 's' || !kvf_dump_parse_index(&p, r->chunks, step) || *step < 1 || *p++ != '.') return 0;
    for (int i = 0; i < KVF_RECON_ROLES; i++)
        if (!strcmp(p, role_names[i])) { *role = i; return 1; }
    return 0;
}

static int shape_error(const kvf_recon *r, const kvf_st_tensor *t, const char *want) {
    char got[160];
    int o = snprintf(got, sizeof got, "[");
    for (int i = 0; i < t->ndim && o < 120; i++)
        o += snprintf(got + o, sizeof got - o, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
    snprintf(got + o, sizeof got - o, "]");
    return kvf_set_error(KVF_EFORMAT, "%s: tensor \"%s\": shape %s, expected %s", kvf_st_label(r->file), t->name, got,
                         want);
}

static int check_dtype(const kvf_recon *r, const kvf_st_tensor *t, kvf_st_dtype want) {
    if (t->dtype == want) return KVF_OK;
    return kvf_set_error(KVF_EFORMAT, "%s: tensor \"%s\": dtype %s, expected %s", kvf_st_label(r->file), t->name,
                         kvf_st_dtype_name(t->dtype), kvf_st_dtype_name(want));
}

static int check_history(kvf_recon *r, const kvf_st_tensor *t, int layer, int step, int role) {
    char want[160];
    if (role == KVF_RECON_PACKED) {
        int rc = check_dtype(r, t, KVF_ST_U8);
        if (rc) return rc;
        if (t->ndim != 1 || t->shape[0] != step) {
            snprintf(want, sizeof want, "[%d] (one flag per chunk before step %d)", step, step);
            return shape_error(r, t, want);
        }
        /* read once here (step bytes, which the file holds): scoring needs them */
        uint8_t *flags = malloc((size_t)step);
        if (!flags) return kvf_set_error(KVF_ENOMEM, "%s: out of memory for tensor \"%s\"", kvf_st_label(r->file), t->name);
        r->flags[(size_t)layer * r->chunks + step] = flags;
        int rc_ = kvf_st_read(t, 0, (size_t)step, flags);
        if (rc_) return rc_;
        for (int i = 0; i < step; i++)
            if (flags[i] > 1)
                return kvf_set_error(KVF_EFORMAT, "%s: tensor \"%s\": element %d is %u, must be 0 (exact) or 1 (packed)",
                                     kvf_st_label(r->file), t->name, i, flags[i]);
        return KVF_OK;
    }
    int rc = check_dtype(r, t, KVF_ST_BF16);
    if (rc) return rc;
    if (t->ndim != 3 || t->shape[0] != r->kv_heads || t->shape[1] != (int64_t)step * r->tokens ||
        t->shape[2] != r->head_dim) {
        snprintf(want, sizeof want, "[kv_heads = %d, %d chunks x %lld tokens = %lld, head_dim = %d]", r->kv_heads, step,
                 (long long)r->tokens, (long long)step * r->tokens, r->head_dim);
        return shape_error(r, t, want);
    }
    return KVF_OK;
}

static int check_bytes(kvf_recon *r, const kvf_st_tensor *t, int layer) {
    int rc = check_dtype(r, t, KVF_ST_I64);
    if (rc) return rc;
    if (t->ndim != 1 || t->shape[0] != r->n_parts) {
        char want[80];
        snprintf(want, sizeof want, "[%d] (one count per name of stored_bytes_parts)", r->n_parts);
        return shape_error(r, t, want);
    }
    int64_t *parts = r->part_bytes + (size_t)layer * KVF_RECON_MAX_PARTS;
    if ((rc = kvf_st_read(t, 0, 8 * (size_t)r->n_parts, parts))) return rc;
    for (int i = 0; i < r->n_parts; i++) {
        const int64_t b = parts[i];
        if (b < 0 || b > MAX_PART_BYTES)
            return kvf_set_error(KVF_EFORMAT, "%s: tensor \"%s\": part \"%s\" = %lld bytes, must be in [0, 2^53]",
                                 kvf_st_label(r->file), t->name, r->part[i], (long long)b);
    }
    return KVF_OK;
}

static int index_tensors(kvf_recon *r) {
    const kvf_st_file *f = r->file;
    size_t n = kvf_st_count(f), need = (size_t)r->layers * ((size_t)(r->chunks - 1) * KVF_RECON_ROLES + 1);
    if (need > n) {
        /* name the first one missing, when looking for it is cheap */
        char name[48];
        for (int l = 0; need <= (1u << 16) && l < r->layers; l++) {
            snprintf(name, sizeof name, "l%d.stored_bytes", l);
            if (!kvf_st_find(f, name)) return kvf_set_error(KVF_EFORMAT, "%s: tensor \"%s\" is missing", kvf_st_label(f), name);
            for (int c = 1; c < r->chunks; c++)
                for (int i = 0; i < KVF_RECON_ROLES; i++) {
                    snprintf(name, sizeof name, "l%d.s%d.%s", l, c, role_names[i]);
                    if (!kvf_st_find(f, name))
                        return kvf_set_error(KVF_EFORMAT, "%s: tensor \"%s\" is missing", kvf_st_label(f), name);
                }
        }
        return kvf_set_error(KVF_EFORMAT, "%s: %d layers x %d chunks need %zu tensors, the file has %zu",
                             kvf_st_label(f), r->layers, r->chunks, need, n);
    }
    r->t = calloc((size_t)r->layers * r->chunks * KVF_RECON_ROLES, sizeof *r->t);
    r->bytes = calloc((size_t)r->layers, sizeof *r->bytes);
    r->flags = calloc((size_t)r->layers * r->chunks, sizeof *r->flags);
    r->part_bytes = calloc((size_t)r->layers * KVF_RECON_MAX_PARTS, sizeof *r->part_bytes);
    if (!r->t || !r->bytes || !r->flags || !r->part_bytes) return kvf_set_error(KVF_ENOMEM, "%s: out of memory indexing tensors", kvf_st_label(f));
    for (size_t i = 0; i < n; i++) {
        const kvf_st_tensor *t = kvf_st_at(f, i);
        int layer, step, role, rc;
        if (!parse_name(r, t->name, &layer, &step, &role)) {
            char pn[128];
            return kvf_set_error(KVF_EFORMAT,
                                 "%s: unexpected tensor \"%s\" (expected l{0..%d}.s{1..%d}.{k,v,packed} or "
                                 "l{0..%d}.stored_bytes)",
                                 kvf_st_label(f), kvf_st_printable(t->name, pn, sizeof pn), r->layers - 1,
                                 r->chunks - 1, r->layers - 1);
        }
        if (role < 0) {
            r->bytes[layer] = t;
            rc = check_bytes(r, t, layer);
        } else {
            *slot(r, layer, step, role) = t;
            rc = check_history(r, t, layer, step, role);
        }
        if (rc) return rc;
    }
    for (int l = 0; l < r->layers; l++) {
        if (!r->bytes[l])
            return kvf_set_error(KVF_EFORMAT, "%s: tensor \"l%d.stored_bytes\" is missing", kvf_st_label(f), l);
        for (int c = 1; c < r->chunks; c++)
            for (int i = 0; i < KVF_RECON_ROLES; i++)
                if (!*slot(r, l, c, i))
                    return kvf_set_error(KVF_EFORMAT, "%s: tensor \"l%d.s%d.%s\" is missing", kvf_st_label(f), l, c,
                                         role_names[i]);
    }
    return KVF_OK;
}

/* ---------------------------------------------------------------- open */

static int finish_open(kvf_recon *r, kvf_recon **out) {
    int rc = read_metadata(r);
    if (!rc) rc = index_tensors(r);
    if (rc) { kvf_recon_close(r); return rc; }
    *out = r;
    return KVF_OK;
}

int kvf_recon_open(const char *path, kvf_recon **out) {
    if (!out) return kvf_set_error(KVF_EINVAL, "kvf_recon_open: out is NULL");
    *out = NULL;
    kvf_recon *r = calloc(1, sizeof *r);
    if (!r) return kvf_set_error(KVF_ENOMEM, "out of memory opening %s", path ? path : "(null)");
    int rc = kvf_st_open(path, &r->file);
    if (rc) { free(r); return rc; }
    return finish_open(r, out);
}

int kvf_recon_parse(const void *bytes, size_t len, const char *label, kvf_recon **out) {
    if (!out) return kvf_set_error(KVF_EINVAL, "kvf_recon_parse: out is NULL");
    *out = NULL;
    kvf_recon *r = calloc(1, sizeof *r);
    if (!r) return kvf_set_error(KVF_ENOMEM, "out of memory parsing %s", label ? label : "<memory>");
    int rc = kvf_st_parse(bytes, len, label, &r->file);
    if (rc) { free(r); return rc; }
    return finish_open(r, out);
}

void kvf_recon_close(kvf_recon *r) {
    if (!r) return;
    for (size_t i = 0; r->flags && i < (size_t)r->layers * r->chunks; i++) free(r->flags[i]);
    free(r->flags);
    free(r->part_bytes);
    free(r->t);
    free(r->bytes);
    kvf_st_close(r->file);
    free(r);
}

int kvf_recon_check_dump(const kvf_recon *r, const kvf_dump *d) {
    if (!r || !d) return kvf_set_error(KVF_EINVAL, "kvf_recon_check_dump: NULL argument");
    const struct { const char *what; long long recon, dump; } dims[] = {
        {"layers", r->layers, d->layers},       {"chunks", r->chunks, d->chunks},
        {"kv_heads", r->kv_heads, d->kv_heads}, {"head_dim", r->head_dim, d->head_dim},
        {"tokens_per_chunk", r->tokens, d->tokens},
    };
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
        if (dims[i].recon != dims[i].dump)
            return kvf_set_error(KVF_EFORMAT, "%s: %s = %lld, but the dump %s has %s = %lld (a recon of another dump?)",
                                 kvf_st_label(r->file), dims[i].what, dims[i].recon, kvf_st_label(d->file),
                                 dims[i].what, dims[i].dump);
    return KVF_OK;
}

const uint8_t *kvf_recon_flags(const kvf_recon *r, int layer, int step) {
    if (!r || layer < 0 || layer >= r->layers || step < 1 || step >= r->chunks) return NULL;
    return r->flags[(size_t)layer * r->chunks + step];
}

const kvf_st_tensor *kvf_recon_tensor(const kvf_recon *r, int layer, int step, int role) {
    if (!r || layer < 0 || layer >= r->layers || step < 1 || step >= r->chunks || role < 0 || role >= KVF_RECON_ROLES)
        return NULL;
    return *slot(r, layer, step, role);
}

double kvf_recon_layer_bytes(const kvf_recon *r, int layer, double *parts) {
    double sum = 0;
    for (int i = 0; i < r->n_parts; i++) {
        const int64_t b = r->part_bytes[(size_t)layer * KVF_RECON_MAX_PARTS + i];
        if (parts) parts[i] = (double)b;
        sum += (double)b;
    }
    return sum;
}
