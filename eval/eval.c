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

typedef struct layer_run {
    const kvf_scheme *s;
    const kvf_dump *d;
    kvf_eval_backend *be;
    kvf_eval_report *rep;
    int threads, key_role, q_role, n_axes;
    int64_t rows;                         /* chunks * tokens: rows of one KV head */
    float *k_ref, *v_ref, *k_hat, *v_hat; /* [kv_heads][rows][d] */
    uint8_t *packed_chunk;                /* [chunks] */
    uint8_t *mask;                        /* [rows] */
    uint16_t *span_k, *span_v, *out_k, *out_v; /* [kv_heads][span * tokens][d] */
    int32_t *span_pos;                    /* [span * tokens][n_axes] */
    float *q;                             /* [q_heads][max_queries][d] */
    uint16_t *q_bf16;
} layer_run;

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}


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
    void *p[] = {r->k_ref, r->v_ref, r->k_hat, r->v_hat, r->packed_chunk, r->mask, r->span_k,
                 r->span_v, r->out_k, r->out_v, r->span_pos, r->q, r->q_bf16};
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
    const size_t span = (size_t)d->kv_heads * r->rep->span * d->tokens * d->head_dim;
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
    r->span_pos = alloc_n((size_t)r->rep->span * d->tokens * r->n_axes, sizeof(int32_t), &ok);
    r->q = alloc_n(q, sizeof(float), &ok);
    r->q_bf16 = alloc_n(q, 2, &ok);
    if (ok) return KVF_OK;
    return kvf_set_error(KVF_ENOMEM, "out of memory for the evaluation buffers (%zu floats per K/V copy)", kv);
}

/* Row of token t (of the whole stream) of KV head h. */
static size_t row(const layer_run *r, int h, int64_t t) { return ((size_t)h * r->rows + t) * r->d->head_dim; }

/* K (post-RoPE) and V of every chunk, as the reference and as the initial cache. */
static void load_layer(layer_run *r, int layer) {
    const kvf_dump *d = r->d;
    const size_t n = (size_t)d->tokens * d->head_dim;
    for (int c = 0; c < d->chunks; c++) {
        const kvf_st_tensor *k = kvf_dump_tensor(d, layer, c, KVF_DUMP_K), *v = kvf_dump_tensor(d, layer, c, KVF_DUMP_V);
        for (int h = 0; h < d->kv_heads; h++) {
            kvf_dump_f32(k, (size_t)h * n, n, r->k_ref + row(r, h, (int64_t)c * d->tokens));
            kvf_dump_f32(v, (size_t)h * n, n, r->v_ref + row(r, h, (int64_t)c * d->tokens));
        }
    }
    const size_t all = (size_t)d->kv_heads * r->rows * d->head_dim;
    memcpy(r->k_hat, r->k_ref, all * sizeof(float));
    memcpy(r->v_hat, r->v_ref, all * sizeof(float));
    memset(r->packed_chunk, 0, (size_t)d->chunks);
}

/* ------------------------------------------------------------ packing */

/* Pack chunks [a, b) as one span and put what decode returns in the cache. */
static int pack_span(layer_run *r, int layer, int a, int b, kvf_eval_sums *bytes) {
    const kvf_dump *d = r->d;
    const int64_t N = d->tokens, span_tokens = (int64_t)(b - a) * N;
    const size_t n = (size_t)N * d->head_dim;
    for (int c = a; c < b; c++) {
        const kvf_st_tensor *k = kvf_dump_tensor(d, layer, c, r->key_role), *v = kvf_dump_tensor(d, layer, c, KVF_DUMP_V);
        for (int h = 0; h < d->kv_heads; h++) {
            size_t at = ((size_t)h * span_tokens + (size_t)(c - a) * N) * d->head_dim;
            kvf_dump_bf16(k, (size_t)h * n, n, r->span_k + at);
            kvf_dump_bf16(v, (size_t)h * n, n, r->span_v + at);
        }
    }
    const int32_t *pos = NULL;
    if (r->key_role == KVF_DUMP_K_PRE) {
        kvf_dump_i32(d->pos, (size_t)a * N * r->n_axes, (size_t)span_tokens * r->n_axes, r->span_pos);
        pos = r->span_pos;
    }
    kvf_shape sh = {span_tokens, d->kv_heads, 0, 0};
    size_t packed;
    int rc = kvf_eval_backend_roundtrip(r->be, r->span_k, r->span_v, &sh, pos, r->n_axes, r->out_k, r->out_v, &packed);
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
    return KVF_OK;
}

/* After chunk t is finished: pack the span the chunk policy lets go, if any
 * (kvf_chunk_policy: the library's one statement of it). */
static int pack_ready(layer_run *r, int layer, int t, kvf_eval_sums *bytes) {
    kvf_chunk_step st;
    int rc = kvf_chunk_policy(r->s, t, &st);
    if (rc || !st.pack_chunks) return rc;
    return pack_span(r, layer, (int)st.pack_first, (int)(st.pack_first + st.pack_chunks), bytes);
}

/* ------------------------------------------------------------ one step */

static int score_step(layer_run *r, int layer, int c, kvf_eval_sums *out) {
    const kvf_dump *d = r->d;
    const kvf_st_tensor *q = kvf_dump_tensor(d, layer, c, KVF_DUMP_Q);
    const int64_t nq = q->shape[1], n_keys = (int64_t)(c + 1) * d->tokens;
    kvf_dump_f32(q, 0, (size_t)d->q_heads * nq * d->head_dim, r->q);
    for (int64_t t = 0; t < n_keys; t++) r->mask[t] = r->packed_chunk[t / d->tokens];
    kvf_eval_step st = {d->q_heads, d->kv_heads, d->head_dim, nq, r->q, n_keys, r->rows,
                        r->k_ref, r->v_ref, r->k_hat, r->v_hat, r->mask, r->threads};
    int rc = kvf_eval_step_run(&st, out);
    return rc ? kvf_wrap_error(rc, "layer %d, chunk %d", layer, c) : KVF_OK;
}

static int update_qstats(layer_run *r, int layer, int c) {
    const kvf_dump *d = r->d;
    const kvf_st_tensor *q = kvf_dump_tensor(d, layer, c, r->q_role);
    kvf_dump_bf16(q, 0, (size_t)d->q_heads * q->shape[1] * d->head_dim, r->q_bf16);
    kvf_shape sh = {q->shape[1], d->q_heads, 0, 0};
    int rc = kvf_eval_backend_qstats_update(r->be, r->q_bf16, &sh);
    return rc ? kvf_wrap_error(rc, "layer %d, chunk %d: query statistics", layer, c) : KVF_OK;
}

/* ------------------------------------------------------------ one layer */

/* Adds the layer's sums to *overall. */
static int run_layer(layer_run *r, int layer, kvf_eval_sums *overall) {
    kvf_eval_report *rep = r->rep;
    const kvf_dump *d = r->d;
    kvf_eval_sums total = {0}, bytes = {0}, *steps = calloc((size_t)d->chunks, sizeof *steps);
    if (!steps) return kvf_set_error(KVF_ENOMEM, "out of memory for %d steps", d->chunks);
    load_layer(r, layer);
    kvf_eval_backend_new_layer(r->be);
    int rc = KVF_OK;
    if (rep->uses_qstats) {
        size_t qs = 0;
        if ((rc = kvf_eval_backend_qstats_init(r->be, d->kv_heads, &qs))) rc = kvf_wrap_error(rc, "layer %d", layer);
        rep->qstats_bytes = qs;
    }
    for (int c = 0; c < d->chunks && !rc; c++) {
        if (c > 0) rc = score_step(r, layer, c, &steps[c]);
        if (!rc) rc = pack_ready(r, layer, c, &bytes);
        if (!rc && rep->uses_qstats) rc = update_qstats(r, layer, c);
    }
    if (!rc) {
        const double chunk_bf16 = 4.0 * (double)d->kv_heads * d->tokens * d->head_dim;
        for (int c = 0; c < d->chunks; c++) {
            kvf_eval_sums_add(&total, &steps[c]);
            kvf_eval_finish(&steps[c], &rep->step[(size_t)layer * d->chunks + c]);
            if (!r->packed_chunk[c]) bytes.stored_bytes += chunk_bf16;
        }
        bytes.bf16_bytes = chunk_bf16 * d->chunks;
        if (rep->uses_qstats) bytes.stored_bytes += (double)rep->qstats_bytes;
        kvf_eval_sums_add(&total, &bytes);
        kvf_eval_finish(&total, &rep->layer[layer]);
        kvf_eval_sums_add(overall, &total);
    }
    free(steps);
    return rc;
}

/* ------------------------------------------------------------ the run */

static void describe(kvf_eval_report *rep, const kvf_scheme *s, const kvf_dump *d, kvf_eval_backend *be) {
    snprintf(rep->scheme_id, sizeof rep->scheme_id, "%s", kvf_scheme_id(s));
    snprintf(rep->scheme_source, sizeof rep->scheme_source, "%s", s->source);
    snprintf(rep->backend, sizeof rep->backend, "%s", kvf_eval_backend_describe(be));
    snprintf(rep->data, sizeof rep->data, "%s", kvf_st_label(d->file));
    snprintf(rep->source, sizeof rep->source, "%s", d->source ? d->source : "");
    snprintf(rep->q_subsample, sizeof rep->q_subsample, "%s", d->q_subsample ? d->q_subsample : "");
    rep->layers = d->layers;
    rep->chunks = d->chunks;
    rep->q_heads = d->q_heads;
    rep->kv_heads = d->kv_heads;
    rep->head_dim = d->head_dim;
    rep->tokens = d->tokens;
    rep->uses_qstats = kvf_scheme_reads_qstats(s);
    rep->pre_rope = s->rope.placement == KVF_ROPE_PRE;
    rep->sink = s->chunk.sink;
    rep->recent = s->chunk.recent;
    rep->span = s->chunk.span > 0 ? s->chunk.span : 1;
    rep->has_centroids = s->key.centroids > 0 || s->value.centroids > 0;
    for (int l = 0; l < d->layers; l++)
        for (int c = 0; c < d->chunks; c++) {
            int64_t nq = kvf_dump_tensor(d, l, c, KVF_DUMP_Q)->shape[1];
            if (nq > rep->max_queries) rep->max_queries = nq;
        }
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
    layer_run r = {.s = s, .d = d, .be = be, .rep = rep, .threads = opt->threads > 0 ? opt->threads : kvf_cpu_count(),
                   .key_role = rep->pre_rope ? KVF_DUMP_K_PRE : KVF_DUMP_K, .q_role = q_role_of(s, d),
                   .n_axes = kvf_rope_sections(s, NULL), .rows = (int64_t)d->chunks * d->tokens};
    rep->q_pre_used = r.q_role == KVF_DUMP_Q_PRE;
    rep->layer = calloc((size_t)d->layers, sizeof *rep->layer);
    rep->step = calloc((size_t)d->layers * d->chunks, sizeof *rep->step);
    if (!rep->layer || !rep->step) rc = kvf_set_error(KVF_ENOMEM, "out of memory for the report");
    if (!rc) rc = alloc_run(&r);
    kvf_eval_sums overall = {0};
    for (int l = 0; l < d->layers && !rc; l++) rc = run_layer(&r, l, &overall);
    free_run(&r);
    kvf_eval_backend_close(be);
    if (rc) { kvf_eval_report_free(rep); return rc; }
    kvf_eval_finish(&overall, &rep->overall);
    rep->seconds = now_s() - t0;
    return KVF_OK;
}

void kvf_eval_report_free(kvf_eval_report *r) {
    if (!r) return;
    free(r->layer);
    free(r->step);
    r->layer = r->step = NULL;
}
