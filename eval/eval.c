/*
 * The streaming evaluation (docs/QUALITY.md "Metrics"): per layer, chunk
 * c = 0..C-1: score chunk c's queries against the cache of chunks < c plus
 * chunk c's own exact K/V, then pack the spans the chunk policy lets go, then
 * add chunk c's queries to the query statistics.
 */
#include "eval.h"

#include "backend.h"
#include "internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* A scheme's cache at every step, kept to be written as a recon file (recon.h). */
typedef struct recon_out {
    uint16_t **k, **v; /* [layers * chunks]; step c: [kv_heads][c * tokens][d] */
    uint8_t **packed;  /* [layers * chunks]; step c: [c] */
    int64_t *bytes;    /* [layers][RECON_OUT_PARTS] */
} recon_out;

/* packed spans (anchors included), BF16 chunks, the query statistics, and
 * error feedback's carried error: what a layer holds at the stream's end */
#define RECON_OUT_PARTS 4
static const char *const recon_out_parts[RECON_OUT_PARTS] = {"packed", "bf16", "qstats", "feedback"};

typedef struct layer_run {
    const kvf_scheme *s; /* NULL when scoring a recon */
    const kvf_dump *d;
    const kvf_recon *recon; /* the peer's cache, or NULL: the scheme's */
    recon_out *rout;        /* where the scheme's cache is kept for a recon file, or NULL */
    kvf_eval_backend *be;
    kvf_eval_report *rep;
    const kvf_eval_options *opt;
    int threads, key_role, q_role, n_axes;
    int spans;                            /* spans packed in the current layer */
    uint8_t *seen;                        /* [chunks][KVF_DUMP_ROLES]: counted in the current layer */
    int *entry;                           /* [chunks][KVF_DUMP_ROLES]: its rep->nonfinite index, or -1 */
    int64_t rows;                         /* chunks * tokens: rows of one KV head */
    float *k_ref, *v_ref, *k_hat, *v_hat; /* [kv_heads][rows][d] */
    uint8_t *packed_chunk;                /* [chunks] */
    uint8_t *mask;                        /* [rows] */
    uint16_t *span_k, *span_v, *out_k, *out_v; /* [kv_heads][span * tokens][d] */
    int32_t *span_pos;                    /* [span * tokens][n_axes] */
    uint8_t *map;                         /* [2][kv_heads][d]: mixed precision's channel map, or NULL */
    float *q;                             /* [q_heads][max_queries][d] */
    uint16_t *q_bf16;
    uint16_t *cmp_a, *cmp_b;              /* [tokens][d]: a recon's exact chunk against the dump's */
} layer_run;

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}


static void copy_text(char *dst, size_t cap, const char *src);

/* -------------------------------------------------------------- checks */

static int check_rope(const kvf_scheme *s, const kvf_dump *d) {
    const char *lbl = kvf_st_label(d->file);
    if (!d->pos)
        return kvf_set_error(KVF_EFORMAT, "%s: scheme %s caches keys before RoPE: the dump needs a \"pos\" tensor", lbl,
                             s->name);
    if (d->pos_axes != kvf_rope_sections(s, NULL))
        return kvf_set_error(KVF_EFORMAT, "%s: \"pos\" has %d position axes, scheme %s's RoPE uses %d", lbl,
                             d->pos_axes, s->name, kvf_rope_sections(s, NULL));
    if (fabs(d->rope_theta - s->rope.theta) > 1e-9 * s->rope.theta)
        return kvf_set_error(KVF_EFORMAT, "%s: rope_theta = %g, scheme %s has rope.theta = %g", lbl, d->rope_theta,
                             s->name, s->rope.theta);
    for (int i = 0; i < s->rope.n_sections; i++)
        if (d->n_sections != s->rope.n_sections || d->sections[i] != s->rope.sections[i])
            return kvf_set_error(KVF_EFORMAT, "%s: rope_sections differ from scheme %s's rope.sections", lbl, s->name);
    for (int l = 0; l < d->layers; l++)
        for (int c = 0; c < d->chunks; c++)
            if (!kvf_dump_tensor(d, l, c, KVF_DUMP_K_PRE))
                return kvf_set_error(KVF_EFORMAT,
                                     "%s: scheme %s caches keys before RoPE: tensor \"l%d.c%d.k_pre\" is missing", lbl,
                                     s->name, l, c);
    return KVF_OK;
}

static int check_inputs(const kvf_scheme *s, const kvf_dump *d) {
    if (d->head_dim != s->head_dim)
        return kvf_set_error(KVF_EINVAL, "%s: head_dim = %d, scheme %s has head_dim = %d", kvf_st_label(d->file),
                             d->head_dim, s->name, s->head_dim);
    return s->rope.placement == KVF_ROPE_PRE ? check_rope(s, d) : KVF_OK;
}

/* The queries the statistics see: pre-RoPE ones for "pre" schemes when the
 * dump has them everywhere. */
static int q_role_of(const kvf_scheme *s, const kvf_dump *d) {
    if (s->rope.placement != KVF_ROPE_PRE) return KVF_DUMP_Q;
    for (int l = 0; l < d->layers; l++)
        for (int c = 0; c < d->chunks; c++)
            if (!kvf_dump_tensor(d, l, c, KVF_DUMP_Q_PRE)) return KVF_DUMP_Q;
    return KVF_DUMP_Q_PRE;
}

/* ------------------------------------------------------------ buffers */

static void free_run(layer_run *r) {
    void *p[] = {r->k_ref, r->v_ref, r->k_hat, r->v_hat, r->packed_chunk, r->mask, r->span_k, r->span_v,
                 r->out_k, r->out_v, r->span_pos, r->q, r->q_bf16, r->cmp_a, r->cmp_b, r->seen, r->entry, r->map};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) free(p[i]);
}

static void *alloc_n(size_t n, size_t size, int *ok) {
    void *p = n && size ? calloc(n, size) : NULL;
    if (n && size && !p) *ok = 0;
    return p;
}

static int alloc_run(layer_run *r) {
    const kvf_dump *d = r->d;
    const size_t kv = (size_t)d->kv_heads * r->rows * d->head_dim;
    /* a recon brings its decoded history: no span buffers, two chunk buffers to compare */
    const size_t span = r->recon ? 0 : (size_t)d->kv_heads * r->rep->span * d->tokens * d->head_dim;
    const size_t chunk = r->recon ? (size_t)d->tokens * d->head_dim : 0;
    const size_t q = (size_t)d->q_heads * r->rep->max_queries * d->head_dim;
    int ok = 1;
    r->k_ref = alloc_n(kv, sizeof(float), &ok);
    r->v_ref = alloc_n(kv, sizeof(float), &ok);
    r->k_hat = alloc_n(kv, sizeof(float), &ok);
    r->v_hat = alloc_n(kv, sizeof(float), &ok);
    r->packed_chunk = alloc_n((size_t)d->chunks, 1, &ok);
    r->mask = alloc_n((size_t)r->rows, 1, &ok);
    r->span_k = alloc_n(span, 2, &ok);
    r->span_v = alloc_n(span, 2, &ok);
    r->out_k = alloc_n(span, 2, &ok);
    r->out_v = alloc_n(span, 2, &ok);
    r->span_pos = alloc_n(r->recon ? 0 : (size_t)r->rep->span * d->tokens * r->n_axes, sizeof(int32_t), &ok);
    r->q = alloc_n(q, sizeof(float), &ok);
    r->q_bf16 = alloc_n(q, 2, &ok);
    r->cmp_a = alloc_n(chunk, 2, &ok);
    r->cmp_b = alloc_n(chunk, 2, &ok);
    r->seen = alloc_n((size_t)d->chunks * KVF_DUMP_ROLES, 1, &ok);
    r->entry = alloc_n((size_t)d->chunks * KVF_DUMP_ROLES, sizeof(int), &ok);
    r->map = alloc_n(r->rep->mixed ? (size_t)2 * d->kv_heads * d->head_dim : 0, 1, &ok);
    if (ok) return KVF_OK;
    return kvf_set_error(KVF_ENOMEM, "out of memory for the evaluation buffers (%zu floats per K/V copy)", kv);
}

/* Row of token t (of the whole stream) of KV head h. */
static size_t row(const layer_run *r, int h, int64_t t) { return ((size_t)h * r->rows + t) * r->d->head_dim; }

/* ------------------------------------------------- non-finite values */

/* Head h's slice (n values, as floats f or BF16 b) of the tensor of (layer,
 * chunk, role), just read: its NaN and infinities counted, the first one's
 * place kept. Under strict, the first one is an error. */
static int check_slice(layer_run *r, int layer, int chunk, int role, int h, const float *f, const uint16_t *b,
                       size_t n) {
    size_t first = 0;
    const size_t count = f ? kvf_count_nonfinite_f32(f, n, &first) : kvf_count_nonfinite_bf16(b, n, &first);
    if (!count) return KVF_OK;
    const kvf_dump *d = r->d;
    kvf_eval_report *rep = r->rep;
    const int64_t token = (int64_t)(first / (size_t)d->head_dim);
    const int channel = (int)(first % (size_t)d->head_dim);
    const float x = f ? f[first] : kvf_bf16_to_f32(b[first]);
    const char *what = isnan(x) ? "NaN" : x > 0 ? "+inf" : "-inf";
    const kvf_st_tensor *t = kvf_dump_tensor(d, layer, chunk, role);
    if (r->opt && r->opt->strict)
        return kvf_set_error(KVF_EFORMAT,
                             "%s: tensor \"%s\" holds %zu non-finite value%s in head %d (first: %s at token %lld, "
                             "channel %d); strict: non-finite values are an error",
                             kvf_st_label(d->file), t->name, count, count > 1 ? "s" : "", h, what, (long long)token,
                             channel);
    int *e = &r->entry[(size_t)chunk * KVF_DUMP_ROLES + role];
    if (*e < 0) {
        kvf_eval_nonfinite *grown = realloc(rep->nonfinite, (size_t)(rep->n_nonfinite + 1) * sizeof *grown);
        if (!grown) return kvf_set_error(KVF_ENOMEM, "out of memory counting non-finite values");
        rep->nonfinite = grown;
        kvf_eval_nonfinite *nf = &grown[rep->n_nonfinite];
        memset(nf, 0, sizeof *nf);
        copy_text(nf->tensor, sizeof nf->tensor, t->name);
        nf->head = h;
        nf->token = token;
        nf->channel = channel;
        nf->first = x;
        *e = rep->n_nonfinite++;
    }
    rep->nonfinite[*e].count += (int64_t)count;
    rep->nonfinite_values += (int64_t)count;
    rep->nonfinite_by_role[role] += (int64_t)count;
    rep->layer_nonfinite[layer] += (int64_t)count;
    return KVF_OK;
}

/* Whether (chunk, role) is read for the first time in this layer (then marked). */
static int first_read(layer_run *r, int chunk, int role) {
    uint8_t *s = &r->seen[(size_t)chunk * KVF_DUMP_ROLES + role];
    if (*s) return 0;
    *s = 1;
    r->rep->tensors_checked++;
    return 1;
}

static void new_layer_counts(layer_run *r) {
    const size_t cells = (size_t)r->d->chunks * KVF_DUMP_ROLES;
    memset(r->seen, 0, cells);
    for (size_t i = 0; i < cells; i++) r->entry[i] = -1;
}

/* The quality metrics of m undefined (what NaN inputs make them). */
static void undefine(kvf_eval_metrics *m) {
    m->top1_shift = m->top5_overlap = m->attn_out_rel_err = NAN;
    m->key_mse = m->value_mse = m->qk_err = NAN;
}

/* K (post-RoPE) and V of every chunk, as the reference and as the initial cache. */
static int load_layer(layer_run *r, int layer) {
    const kvf_dump *d = r->d;
    const size_t n = (size_t)d->tokens * d->head_dim;
    int rc = KVF_OK;
    for (int c = 0; c < d->chunks && !rc; c++) {
        const kvf_st_tensor *k = kvf_dump_tensor(d, layer, c, KVF_DUMP_K), *v = kvf_dump_tensor(d, layer, c, KVF_DUMP_V);
        first_read(r, c, KVF_DUMP_K);
        first_read(r, c, KVF_DUMP_V);
        for (int h = 0; h < d->kv_heads && !rc; h++) {
            float *kr = r->k_ref + row(r, h, (int64_t)c * d->tokens), *vr = r->v_ref + row(r, h, (int64_t)c * d->tokens);
            if (!(rc = kvf_dump_f32(k, (size_t)h * n, n, kr)) && !(rc = kvf_dump_f32(v, (size_t)h * n, n, vr)) &&
                !(rc = check_slice(r, layer, c, KVF_DUMP_K, h, kr, NULL, n)))
                rc = check_slice(r, layer, c, KVF_DUMP_V, h, vr, NULL, n);
        }
    }
    if (rc) return rc;
    const size_t all = (size_t)d->kv_heads * r->rows * d->head_dim;
    memcpy(r->k_hat, r->k_ref, all * sizeof(float));
    memcpy(r->v_hat, r->v_ref, all * sizeof(float));
    memset(r->packed_chunk, 0, (size_t)d->chunks);
    return KVF_OK;
}

/* ------------------------------------------------------------ packing */

/* Pack chunks [a, b) as one span (what the policy says of it: sp) and put
 * what decode returns in the cache. */
static int pack_span(layer_run *r, int layer, int a, int b, const kvf_eval_span *sp, kvf_eval_sums *bytes) {
    const kvf_dump *d = r->d;
    const int64_t N = d->tokens, span_tokens = (int64_t)(b - a) * N;
    const size_t n = (size_t)N * d->head_dim;
    int rc = KVF_OK;
    for (int c = a; c < b && !rc; c++) {
        const kvf_st_tensor *k = kvf_dump_tensor(d, layer, c, r->key_role), *v = kvf_dump_tensor(d, layer, c, KVF_DUMP_V);
        const int check = first_read(r, c, r->key_role); /* k_pre: not read before */
        for (int h = 0; h < d->kv_heads && !rc; h++) {
            size_t at = ((size_t)h * span_tokens + (size_t)(c - a) * N) * d->head_dim;
            if (!(rc = kvf_dump_bf16(k, (size_t)h * n, n, r->span_k + at)) &&
                !(rc = kvf_dump_bf16(v, (size_t)h * n, n, r->span_v + at)) && check)
                rc = check_slice(r, layer, c, r->key_role, h, NULL, r->span_k + at, n);
        }
    }
    const int32_t *pos = NULL;
    if (!rc && r->key_role == KVF_DUMP_K_PRE) {
        rc = kvf_dump_i32(d->pos, (size_t)a * N * r->n_axes, (size_t)span_tokens * r->n_axes, r->span_pos);
        pos = r->span_pos;
    }
    if (rc) return rc;
    kvf_shape sh = {span_tokens, d->kv_heads, 0, 0};
    size_t packed;
    rc = kvf_eval_backend_roundtrip(r->be, sp, r->span_k, r->span_v, &sh, pos, r->n_axes, r->out_k, r->out_v, &packed);
    if (rc) return kvf_wrap_error(rc, "layer %d, chunks %d..%d", layer, a, b - 1);
    for (int h = 0; h < d->kv_heads; h++)
        for (int64_t t = 0; t < span_tokens; t++) {
            size_t src = ((size_t)h * span_tokens + t) * d->head_dim, dst = row(r, h, (int64_t)a * N + t);
            for (int c = 0; c < d->head_dim; c++) {
                r->k_hat[dst + c] = kvf_bf16_to_f32(r->out_k[src + c]);
                r->v_hat[dst + c] = kvf_bf16_to_f32(r->out_v[src + c]);
            }
        }
    memset(r->packed_chunk + a, 1, (size_t)(b - a));
    bytes->stored_bytes += (double)packed;
    /* a layer's second and later spans start from the previous one's k-means;
     * packed after chunk b - 1, the span is scored from step b on */
    if (r->rep->warm && r->rep->has_centroids && r->spans > 0) {
        r->rep->warm_spans++;
        if (b < d->chunks) r->rep->warm_spans_scored++;
    }
    r->spans++;
    return KVF_OK;
}

/* After chunk t is finished: pack the span the chunk policy lets go, if any
 * (kvf_chunk_policy: the library's one statement of it). */
static int pack_ready(layer_run *r, int layer, int t, kvf_eval_sums *bytes) {
    kvf_chunk_step st;
    int rc = kvf_chunk_policy(r->s, t, &st);
    if (rc || !st.pack_chunks) return rc;
    const kvf_eval_span sp = {.anchor = st.anchor, .against = st.anchor_first >= 0, .feedback_in = st.feedback_in,
                              .warm = st.warm_chunks > 0};
    if (st.anchor) r->rep->anchor_spans++;
    return pack_span(r, layer, (int)st.pack_first, (int)(st.pack_first + st.pack_chunks), &sp, bytes);
}

/* ------------------------------------------------------ recon files */

/* Step c of a peer: the history (chunks < c) is what its recon holds. A chunk
 * it marks exact must be the dump's own bits (the metrics count its errors as
 * zero and leave it out of key/value MSE). */
static int load_history(layer_run *r, int layer, int c) {
    const kvf_dump *d = r->d;
    const kvf_recon *rc = r->recon;
    const kvf_st_tensor *t[2] = {kvf_recon_tensor(rc, layer, c, KVF_RECON_K), kvf_recon_tensor(rc, layer, c, KVF_RECON_V)};
    const uint8_t *flags = kvf_recon_flags(rc, layer, c);
    const size_t n = (size_t)d->tokens * d->head_dim;
    memset(r->packed_chunk, 0, (size_t)d->chunks);
    memcpy(r->packed_chunk, flags, (size_t)c);
    for (int h = 0; h < d->kv_heads; h++)
        for (int i = 0; i < c; i++) {
            const size_t src = ((size_t)h * c + i) * n, dst = row(r, h, (int64_t)i * d->tokens);
            for (int x = 0; x < 2; x++) {
                float *hat = x ? r->v_hat : r->k_hat;
                const float *ref = x ? r->v_ref : r->k_ref;
                int err;
                if (r->packed_chunk[i]) {
                    if ((err = kvf_dump_f32(t[x], src, n, hat + dst))) return err;
                    continue;
                }
                const kvf_st_tensor *dt = kvf_dump_tensor(d, layer, i, x ? KVF_DUMP_V : KVF_DUMP_K);
                if ((err = kvf_dump_bf16(t[x], src, n, r->cmp_a)) || (err = kvf_dump_bf16(dt, (size_t)h * n, n, r->cmp_b)))
                    return err;
                if (memcmp(r->cmp_a, r->cmp_b, n * 2))
                    return kvf_set_error(KVF_EFORMAT,
                                         "%s: tensor \"%s\": chunk %d (KV head %d) is marked exact (packed = 0) but "
                                         "differs from the dump's \"%s\"",
                                         kvf_st_label(rc->file), t[x]->name, i, h, dt->name);
                memcpy(hat + dst, ref + dst, n * sizeof(float));
            }
        }
    return KVF_OK;
}

/* Step c of a scheme, kept for its recon file: chunks it returned decoded as
 * they were decoded (BF16 again, exactly), the others the dump's bits. */
static int snapshot_step(layer_run *r, int layer, int c) {
    const kvf_dump *d = r->d;
    const size_t n = (size_t)d->tokens * d->head_dim, all = (size_t)d->kv_heads * c * n, at = (size_t)layer * d->chunks + c;
    uint16_t *k = malloc(all * 2), *v = malloc(all * 2);
    uint8_t *flags = malloc((size_t)c);
    r->rout->k[at] = k;
    r->rout->v[at] = v;
    r->rout->packed[at] = flags;
    if (!k || !v || !flags) return kvf_set_error(KVF_ENOMEM, "out of memory keeping layer %d, step %d for the recon file", layer, c);
    memcpy(flags, r->packed_chunk, (size_t)c);
    for (int h = 0; h < d->kv_heads; h++)
        for (int i = 0; i < c; i++) {
            const size_t dst = ((size_t)h * c + i) * n, src = row(r, h, (int64_t)i * d->tokens);
            if (!flags[i]) {
                int rc = kvf_dump_bf16(kvf_dump_tensor(d, layer, i, KVF_DUMP_K), (size_t)h * n, n, k + dst);
                if (rc || (rc = kvf_dump_bf16(kvf_dump_tensor(d, layer, i, KVF_DUMP_V), (size_t)h * n, n, v + dst)))
                    return rc;
                continue;
            }
            for (size_t e = 0; e < n; e++) {
                k[dst + e] = kvf_f32_to_bf16(r->k_hat[src + e]);
                v[dst + e] = kvf_f32_to_bf16(r->v_hat[src + e]);
            }
        }
    return KVF_OK;
}

static void recon_out_free(recon_out *o, size_t cells) {
    if (!o) return;
    for (size_t i = 0; i < cells; i++) {
        if (o->k) free(o->k[i]);
        if (o->v) free(o->v[i]);
        if (o->packed) free(o->packed[i]);
    }
    free(o->k);
    free(o->v);
    free(o->packed);
    free(o->bytes);
    free(o);
}

static recon_out *recon_out_new(const kvf_dump *d) {
    const size_t cells = (size_t)d->layers * d->chunks;
    recon_out *o = calloc(1, sizeof *o);
    if (!o) return NULL;
    o->k = calloc(cells, sizeof *o->k);
    o->v = calloc(cells, sizeof *o->v);
    o->packed = calloc(cells, sizeof *o->packed);
    o->bytes = calloc((size_t)d->layers * RECON_OUT_PARTS, sizeof *o->bytes);
    if (o->k && o->v && o->packed && o->bytes) return o;
    recon_out_free(o, 0);
    return NULL;
}

static int write_recon(const recon_out *o, const kvf_dump *d, const kvf_eval_report *rep, const char *path) {
    const int per_layer = 3 * (d->chunks - 1) + 1, n = d->layers * per_layer;
    kvf_st_write_tensor *t = calloc((size_t)n, sizeof *t);
    char (*names)[48] = calloc((size_t)n, sizeof *names);
    if (!t || !names) {
        free(t);
        free(names);
        return kvf_set_error(KVF_ENOMEM, "%s: out of memory writing the recon file", path);
    }
    int nt = 0;
    for (int l = 0; l < d->layers; l++) {
        for (int c = 1; c < d->chunks; c++) {
            const size_t at = (size_t)l * d->chunks + c;
            const int64_t rows = (int64_t)c * d->tokens;
            snprintf(names[nt], sizeof names[nt], "l%d.s%d.k", l, c);
            t[nt] = (kvf_st_write_tensor){names[nt], KVF_ST_BF16, 3, {d->kv_heads, rows, d->head_dim}, o->k[at]};
            nt++;
            snprintf(names[nt], sizeof names[nt], "l%d.s%d.v", l, c);
            t[nt] = (kvf_st_write_tensor){names[nt], KVF_ST_BF16, 3, {d->kv_heads, rows, d->head_dim}, o->v[at]};
            nt++;
            snprintf(names[nt], sizeof names[nt], "l%d.s%d.packed", l, c);
            t[nt] = (kvf_st_write_tensor){names[nt], KVF_ST_U8, 1, {c}, o->packed[at]};
            nt++;
        }
        snprintf(names[nt], sizeof names[nt], "l%d.stored_bytes", l);
        t[nt] = (kvf_st_write_tensor){names[nt], KVF_ST_I64, 1, {RECON_OUT_PARTS}, o->bytes + (size_t)l * RECON_OUT_PARTS};
        nt++;
    }
    char num[8][24], peer[1024];
    snprintf(num[0], sizeof num[0], "%d", d->layers);
    snprintf(num[1], sizeof num[1], "%d", d->chunks);
    snprintf(num[2], sizeof num[2], "%d", d->kv_heads);
    snprintf(num[3], sizeof num[3], "%d", d->head_dim);
    snprintf(num[4], sizeof num[4], "%lld", (long long)d->tokens);
    snprintf(num[5], sizeof num[5], "%d", rep->sink);
    snprintf(num[6], sizeof num[6], "%d", rep->recent);
    snprintf(num[7], sizeof num[7], "%d", rep->span);
    snprintf(peer, sizeof peer, "kvforge %s, scheme %s (%s), %s", KVF_VERSION_STRING, rep->scheme_id,
             rep->scheme_source, rep->backend);
    const char *meta[] = {"format", KVF_RECON_FORMAT, "layers", num[0], "chunks", num[1], "kv_heads", num[2],
                          "head_dim", num[3], "tokens_per_chunk", num[4], "sink", num[5], "recent", num[6],
                          "span", num[7], "name", rep->scheme_id, "peer", peer, "dump", rep->data,
                          "stored_bytes_parts", "packed,bf16,qstats,feedback"};
    int rc = kvf_st_write(path, meta, (int)(sizeof meta / sizeof meta[0] / 2), t, nt);
    free(t);
    free(names);
    return rc;
}

/* ------------------------------------------------------------ one step */

static int score_step(layer_run *r, int layer, int c, kvf_eval_sums *out) {
    const kvf_dump *d = r->d;
    const kvf_st_tensor *q = kvf_dump_tensor(d, layer, c, KVF_DUMP_Q);
    const int64_t nq = q->shape[1], n_keys = (int64_t)(c + 1) * d->tokens;
    const size_t per_head = (size_t)nq * d->head_dim;
    int rc = kvf_dump_f32(q, 0, (size_t)d->q_heads * per_head, r->q);
    if (!rc && first_read(r, c, KVF_DUMP_Q))
        for (int h = 0; h < d->q_heads && !rc; h++)
            rc = check_slice(r, layer, c, KVF_DUMP_Q, h, r->q + h * per_head, NULL, per_head);
    if (rc) return rc;
    for (int64_t t = 0; t < n_keys; t++) r->mask[t] = r->packed_chunk[t / d->tokens];
    kvf_eval_step st = {d->q_heads, d->kv_heads, d->head_dim, nq, r->q, n_keys, r->rows,
                        r->k_ref, r->v_ref, r->k_hat, r->v_hat, r->mask, r->threads};
    rc = kvf_eval_step_run(&st, out);
    return rc ? kvf_wrap_error(rc, "layer %d, chunk %d", layer, c) : KVF_OK;
}

static int update_qstats(layer_run *r, int layer, int c) {
    const kvf_dump *d = r->d;
    const kvf_st_tensor *q = kvf_dump_tensor(d, layer, c, r->q_role);
    const size_t per_head = (size_t)q->shape[1] * d->head_dim;
    int rc = kvf_dump_bf16(q, 0, (size_t)d->q_heads * per_head, r->q_bf16);
    if (!rc && first_read(r, c, r->q_role))
        for (int h = 0; h < d->q_heads && !rc; h++)
            rc = check_slice(r, layer, c, r->q_role, h, NULL, r->q_bf16 + h * per_head, per_head);
    if (rc) return rc;
    kvf_shape sh = {q->shape[1], d->q_heads, 0, 0};
    rc = kvf_eval_backend_qstats_update(r->be, r->q_bf16, &sh);
    return rc ? kvf_wrap_error(rc, "layer %d, chunk %d: query statistics", layer, c) : KVF_OK;
}

/* ------------------------------------------------------------ one layer */

/* After step c of a scheme: what its cache holds (the spans packed so far,
 * the chunks up to c it keeps in BF16, the query statistics, the carried
 * error) and the BF16 history, added to the sums over the steps. A peer's
 * recon has its bytes at the end only: it leaves both at 0. */
static double chunk_bf16_bytes(const kvf_dump *d) { return 4.0 * (double)d->kv_heads * d->tokens * d->head_dim; }

static void add_held(const layer_run *r, int c, kvf_eval_sums *bytes) {
    const double chunk_bf16 = chunk_bf16_bytes(r->d);
    double held = bytes->stored_bytes + (double)kvf_eval_backend_state_bytes(r->be) +
                  (r->rep->uses_qstats ? (double)r->rep->qstats_bytes : 0);
    for (int i = 0; i <= c; i++)
        if (!r->packed_chunk[i]) held += chunk_bf16;
    bytes->stored_held += held;
    bytes->bf16_held += chunk_bf16 * (c + 1);
}

/* Adds the layer's sums to *overall. */
static int run_layer(layer_run *r, int layer, kvf_eval_sums *overall) {
    kvf_eval_report *rep = r->rep;
    const kvf_dump *d = r->d;
    kvf_eval_sums total = {0}, bytes = {0}, *steps = calloc((size_t)d->chunks, sizeof *steps);
    if (!steps) return kvf_set_error(KVF_ENOMEM, "out of memory for %d steps", d->chunks);
    new_layer_counts(r);
    r->spans = 0;
    int rc = load_layer(r, layer);
    if (!rc && r->map && (rc = kvf_mixed_map(r->s, r->opt->table, layer, d->kv_heads, r->map)))
        rc = kvf_wrap_error(rc, "layer %d: mixed precision's channel map", layer);
    if (!rc && r->be) rc = kvf_eval_backend_new_layer(r->be, r->map, d->kv_heads);
    if (!rc && rep->uses_qstats) {
        size_t qs = 0;
        if ((rc = kvf_eval_backend_qstats_init(r->be, d->kv_heads, &qs))) rc = kvf_wrap_error(rc, "layer %d", layer);
        rep->qstats_bytes = qs;
    }
    for (int c = 0; c < d->chunks && !rc; c++) {
        if (c > 0 && r->recon) rc = load_history(r, layer, c);
        if (c > 0 && !rc && r->rout) rc = snapshot_step(r, layer, c);
        if (c > 0 && !rc) rc = score_step(r, layer, c, &steps[c]);
        if (!rc && !r->recon) rc = pack_ready(r, layer, c, &bytes);
        if (!rc && !r->recon) add_held(r, c, &bytes);
        if (!rc && rep->uses_qstats) rc = update_qstats(r, layer, c);
        if (!rc && r->opt && r->opt->progress) r->opt->progress(r->opt->progress_user, layer, d->layers, c, d->chunks);
    }
    /* what was read is the file as opened: a change since would mix two files */
    if (!rc) rc = kvf_st_check_unchanged(d->file);
    if (!rc && r->recon) rc = kvf_st_check_unchanged(r->recon->file);
    if (!rc) {
        const double chunk_bf16 = chunk_bf16_bytes(d);
        double parts[KVF_RECON_MAX_PARTS] = {0};
        if (r->recon) {
            bytes.stored_bytes = kvf_recon_layer_bytes(r->recon, layer, parts);
        } else {
            parts[0] = bytes.stored_bytes; /* the packed spans */
            for (int c = 0; c < d->chunks; c++)
                if (!r->packed_chunk[c]) parts[1] += chunk_bf16;
            parts[2] = rep->uses_qstats ? (double)rep->qstats_bytes : 0;
            parts[3] = (double)kvf_eval_backend_state_bytes(r->be);
            bytes.stored_bytes += parts[1] + parts[2] + parts[3];
            for (int i = 0; r->rout && i < RECON_OUT_PARTS; i++)
                r->rout->bytes[(size_t)layer * RECON_OUT_PARTS + i] = (int64_t)parts[i];
        }
        for (int i = 0; i < rep->n_parts; i++) rep->part_bytes[i] += parts[i];
        for (int c = 0; c < d->chunks; c++) {
            kvf_eval_sums_add(&total, &steps[c]);
            kvf_eval_finish(&steps[c], &rep->step[(size_t)layer * d->chunks + c]);
        }
        bytes.bf16_bytes = chunk_bf16 * d->chunks;
        kvf_eval_sums_add(&total, &bytes);
        kvf_eval_finish(&total, &rep->layer[layer]);
        kvf_eval_sums_add(overall, &total);
        if (rep->layer_nonfinite[layer]) { /* NaN in, no score out (what the sums give is not one) */
            undefine(&rep->layer[layer]);
            for (int c = 0; c < d->chunks; c++) undefine(&rep->step[(size_t)layer * d->chunks + c]);
        }
    }
    free(steps);
    return rc;
}

/* ------------------------------------------------------------ the run */

/* src into dst[cap], cut (when too long) at a UTF-8 character boundary: the
 * texts come from the files' JSON (valid UTF-8) and go into JSON again. */
static void copy_text(char *dst, size_t cap, const char *src) {
    size_t n = strlen(src);
    if (n >= cap) {
        n = cap - 1;
        while (n > 0 && ((unsigned char)src[n] & 0xC0) == 0x80) n--; /* src[n] is where the cut falls */
    }
    memcpy(dst, src, n);
    dst[n] = 0;
}

static void describe_dump(kvf_eval_report *rep, const kvf_dump *d) {
    copy_text(rep->data, sizeof rep->data, kvf_st_label(d->file));
    copy_text(rep->source, sizeof rep->source, d->source ? d->source : "");
    copy_text(rep->q_subsample, sizeof rep->q_subsample, d->q_subsample ? d->q_subsample : "");
    rep->layers = d->layers;
    rep->chunks = d->chunks;
    rep->q_heads = d->q_heads;
    rep->kv_heads = d->kv_heads;
    rep->head_dim = d->head_dim;
    rep->tokens = d->tokens;
    for (int l = 0; l < d->layers; l++)
        for (int c = 0; c < d->chunks; c++) {
            int64_t nq = kvf_dump_tensor(d, l, c, KVF_DUMP_Q)->shape[1];
            if (nq > rep->max_queries) rep->max_queries = nq;
        }
}

static void describe(kvf_eval_report *rep, const kvf_scheme *s, const kvf_dump *d, kvf_eval_backend *be) {
    copy_text(rep->scheme_id, sizeof rep->scheme_id, kvf_scheme_id(s));
    copy_text(rep->scheme_source, sizeof rep->scheme_source, s->source);
    copy_text(rep->backend, sizeof rep->backend, kvf_eval_backend_describe(be));
    describe_dump(rep, d);
    rep->uses_qstats = kvf_scheme_reads_qstats(s);
    rep->pre_rope = s->rope.placement == KVF_ROPE_PRE;
    rep->sink = s->chunk.sink;
    rep->recent = s->chunk.recent;
    rep->span = s->chunk.span > 0 ? s->chunk.span : 1;
    rep->has_centroids = s->key.centroids > 0 || s->value.centroids > 0;
    rep->mixed = s->plan.sec[0].mp_channels > 0 || s->plan.sec[1].mp_channels > 0;
    rep->anchor_every = s->pipe.anchor_every;
    rep->feedback_decay = s->pipe.feedback_decay;
    rep->n_parts = RECON_OUT_PARTS;
    for (int i = 0; i < RECON_OUT_PARTS; i++) copy_text(rep->part_name[i], sizeof rep->part_name[i], recon_out_parts[i]);
}

static void describe_peer(kvf_eval_report *rep, const kvf_recon *rc, const kvf_dump *d) {
    copy_text(rep->scheme_id, sizeof rep->scheme_id, rc->name);
    copy_text(rep->scheme_source, sizeof rep->scheme_source, kvf_st_label(rc->file));
    copy_text(rep->backend, sizeof rep->backend, "peer (the recon file's decoded cache)");
    copy_text(rep->peer_text, sizeof rep->peer_text, rc->peer);
    describe_dump(rep, d);
    rep->peer = 1;
    rep->sink = rc->sink;
    rep->recent = rc->recent;
    rep->span = rc->span;
    rep->n_parts = rc->n_parts;
    for (int i = 0; i < rc->n_parts; i++) copy_text(rep->part_name[i], sizeof rep->part_name[i], rc->part[i]);
}

/* Every layer of r (set up), into r->rep; frees r's buffers. */
static int run_layers(layer_run *r) {
    kvf_eval_report *rep = r->rep;
    const kvf_dump *d = r->d;
    int rc = KVF_OK;
    rep->layer = calloc((size_t)d->layers, sizeof *rep->layer);
    rep->step = calloc((size_t)d->layers * d->chunks, sizeof *rep->step);
    rep->layer_nonfinite = calloc((size_t)d->layers, sizeof *rep->layer_nonfinite);
    if (!rep->layer || !rep->step || !rep->layer_nonfinite) rc = kvf_set_error(KVF_ENOMEM, "out of memory for the report");
    if (!rc) rc = alloc_run(r);
    kvf_eval_sums overall = {0};
    for (int l = 0; l < d->layers && !rc; l++) rc = run_layer(r, l, &overall);
    free_run(r);
    if (!rc) kvf_eval_finish(&overall, &rep->overall);
    if (!rc && rep->nonfinite_values) undefine(&rep->overall);
    return rc;
}

int kvf_eval_run(const kvf_scheme *s, const kvf_dump *d, const kvf_eval_options *opt, kvf_eval_report *rep) {
    if (!s || !d || !opt || !rep) return kvf_set_error(KVF_EINVAL, "kvf_eval_run: NULL argument");
    memset(rep, 0, sizeof *rep);
    int rc = check_inputs(s, d);
    if (rc) return rc;
    const double t0 = now_s();
    kvf_eval_backend *be;
    if ((rc = kvf_eval_backend_open(s, opt->device, opt->warm, &be))) return rc;
    describe(rep, s, d, be);
    rep->warm = opt->warm != 0;
    if (rep->mixed) {
        const char *table = opt->table ? opt->table : s->pipe.mp_table;
        if (!table[0]) {
            kvf_eval_backend_close(be);
            return kvf_set_error(KVF_EINVAL, "scheme %s refines calibrated channels (mixed_precision) and names no "
                                 "sensitivity table: give one (kvforge eval --table; kvforge calibrate writes it)",
                                 s->name);
        }
        copy_text(rep->table, sizeof rep->table, table);
    }
    layer_run r = {.s = s, .d = d, .be = be, .rep = rep, .opt = opt, .threads = opt->threads > 0 ? opt->threads : kvf_cpu_count(),
                   .key_role = rep->pre_rope ? KVF_DUMP_K_PRE : KVF_DUMP_K, .q_role = q_role_of(s, d),
                   .n_axes = kvf_rope_sections(s, NULL), .rows = (int64_t)d->chunks * d->tokens};
    rep->q_pre_used = r.q_role == KVF_DUMP_Q_PRE;
    if (opt->recon_out && !(r.rout = recon_out_new(d)))
        rc = kvf_set_error(KVF_ENOMEM, "out of memory for the recon file's tensors");
    if (!rc) rc = run_layers(&r);
    kvf_eval_backend_close(be);
    if (!rc && r.rout) rc = write_recon(r.rout, d, rep, opt->recon_out);
    recon_out_free(r.rout, (size_t)d->layers * d->chunks);
    if (rc) { kvf_eval_report_free(rep); return rc; }
    rep->seconds = now_s() - t0;
    return KVF_OK;
}

int kvf_eval_run_peer(const kvf_recon *recon, const kvf_dump *d, const kvf_eval_options *opt, kvf_eval_report *rep) {
    if (!recon || !d || !opt || !rep) return kvf_set_error(KVF_EINVAL, "kvf_eval_run_peer: NULL argument");
    memset(rep, 0, sizeof *rep);
    int rc = kvf_recon_check_dump(recon, d);
    if (rc) return rc;
    const double t0 = now_s();
    describe_peer(rep, recon, d);
    layer_run r = {.d = d, .recon = recon, .rep = rep, .opt = opt, .threads = opt->threads > 0 ? opt->threads : kvf_cpu_count(),
                   .key_role = KVF_DUMP_K, .q_role = KVF_DUMP_Q, .rows = (int64_t)d->chunks * d->tokens};
    if ((rc = run_layers(&r))) { kvf_eval_report_free(rep); return rc; }
    rep->seconds = now_s() - t0;
    return KVF_OK;
}

void kvf_eval_report_free(kvf_eval_report *r) {
    if (!r) return;
    free(r->layer);
    free(r->step);
    free(r->nonfinite);
    free(r->layer_nonfinite);
    r->layer = r->step = NULL;
    r->nonfinite = NULL;
    r->layer_nonfinite = NULL;
    r->n_nonfinite = 0;
}
