/*
 * CPU reference encode and decode of a whole packed cache (docs/METHODS.md
 * section 1): per tensor section and head, the optional rotation, the
 * progressive stages (k-means smoothing with nearest or QSAC assignment, then
 * residual quantization), PSAC for keys, and on decode the sum of the stages,
 * the PSAC correction, the inverse rotation and RoPE. The methods themselves
 * live one per file (ref_quant.c, ref_kmeans.c, ref_hadamard.c, ref_psac.c,
 * ref_qstats.c, ref_rope.c); this file only orders them.
 */
#include "cpu/ref.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ work space */

/* Buffers of one head: f32 [n][d] planes and the k-means results. Encode
 * uses all but y and rhat, which only PSAC's error needs; decode uses y and
 * rhat alone. The others stay NULL. */
typedef struct head_buf {
    float *x0;       /* the input (rotated): E = x0 - y for PSAC */
    float *e;        /* stage input e_s */
    float *y;        /* running decode sum */
    float *r;        /* residual of the stage */
    float *rhat;     /* what decode gets back for it */
    uint16_t *cent;  /* bf16 [C][d] */
    float *w;        /* [d] QSAC weights */
    int *z;          /* [n] the last Lloyd step's labels (kmeans_labels = "last_step") */
} head_buf;

static void head_buf_free(head_buf *b) {
    free(b->x0), free(b->e), free(b->y), free(b->r), free(b->rhat);
    free(b->cent), free(b->w), free(b->z);
    memset(b, 0, sizeof *b);
}

enum { HB_ENCODE = 1, HB_DECODE_SUM = 2 }; /* head_buf_alloc's parts */
enum { HB_ENCODE_PLANES = 3, HB_DECODE_PLANES = 2 }; /* their [n][d] f32 planes: x0, e, r; y, rhat */

/* Bytes of the per-token buffers head_buf_alloc allocates for parts, at
 * most: the f32 planes and the encode's labels (k-means sections only). */
static int64_t head_buf_bytes(int64_t n, int d, int parts) {
    return n * d * (int64_t)sizeof(float) *
               ((parts & HB_ENCODE ? HB_ENCODE_PLANES : 0) + (parts & HB_DECODE_SUM ? HB_DECODE_PLANES : 0)) +
           (parts & HB_ENCODE ? n * (int64_t)sizeof(int) : 0);
}

static int head_buf_alloc(head_buf *b, int64_t n, int d, int centroids, int parts) {
    size_t nd = (size_t)n * (size_t)d * sizeof(float);
    memset(b, 0, sizeof *b);
    int ok = 1;
    if (parts & HB_ENCODE) {
        b->x0 = malloc(nd), b->e = malloc(nd), b->r = malloc(nd);
        b->cent = malloc((size_t)(centroids > 0 ? centroids : 1) * (size_t)d * 2);
        b->w = malloc((size_t)d * sizeof(float));
        b->z = centroids > 0 ? malloc((size_t)n * sizeof(int)) : NULL;
        ok = b->x0 && b->e && b->r && b->cent && b->w && (centroids == 0 || b->z);
    }
    if (parts & HB_DECODE_SUM) {
        b->y = malloc(nd), b->rhat = malloc(nd);
        ok = ok && b->y && b->rhat;
    }
    if (ok) return KVF_OK;
    head_buf_free(b);
    return kvf_set_error(KVF_ENOMEM, "CPU reference: out of memory for %lld tokens", (long long)n);
}

/* What one section needs besides its layout. */
typedef struct section_job {
    const struct kvf_scheme *s;
    const kvf_tensor_cfg *cfg;
    const kvf_layout *L;
    const kvf_section_layout *l;
    const kvf_shape *sh;
} section_job;

static size_t row_of(const kvf_layout *L, int32_t h, int64_t t) {
    return (size_t)h * (size_t)L->n_tokens + (size_t)t;
}

/* ------------------------------------------------------------ heads in parallel */

/* Heads are independent (each writes only its own rows of every plane and
 * reads nothing another head writes), so the heads of both sections are one
 * list of tasks (keys first) on several threads (kvf_parallel_for); the bytes
 * do not depend on how many. KVFORGE_CPU_THREADS sets the count. By default:
 * the CPUs this thread may run on, at most 16, at most one per 2^18 values
 * (a thread costs tens of microseconds to start), and as many as keep the
 * threads' head buffers within 4 GiB. */
enum { CPU_THREADS_DEFAULT_MAX = 16 };
#define CPU_VALUES_PER_THREAD ((int64_t)1 << 18)
#define CPU_BUFFER_BUDGET ((int64_t)4 << 30)

static int cpu_threads(const kvf_layout *L, int n_tasks, int64_t buffer_bytes) {
    const char *env = getenv("KVFORGE_CPU_THREADS");
    int64_t t = 0;
    if (env && *env) { /* anything but a count >= 1 means the default */
        char *end;
        long v = strtol(env, &end, 10);
        if (!*end && v >= 1) t = v > KVF_MAX_THREADS ? KVF_MAX_THREADS : v;
    }
    if (t == 0) {
        const int64_t values = L->n_tokens * L->head_dim * n_tasks;
        t = kvf_cpu_count();
        if (t > CPU_THREADS_DEFAULT_MAX) t = CPU_THREADS_DEFAULT_MAX;
        if (t > values / CPU_VALUES_PER_THREAD) t = values / CPU_VALUES_PER_THREAD;
        if (buffer_bytes > 0 && t > CPU_BUFFER_BUDGET / buffer_bytes) t = CPU_BUFFER_BUDGET / buffer_bytes;
    }
    if (t > n_tasks) t = n_tasks;
    return t < 1 ? 1 : (int)t;
}

/* One head of one section, on a worker's buffers. */
typedef int (*head_fn)(const section_job *j, int32_t h, head_buf *b, const void *arg);

typedef struct heads_job {
    const section_job *sec[2]; /* the sections whose heads are tasks, in task order */
    const void *arg[2];        /* fn's argument for each */
    int n_sec, parts, centroids;
    head_fn fn;
    head_buf *bufs; /* [threads]: a worker's */
} heads_job;

static int heads_setup(void *arg, int worker) {
    heads_job *job = arg;
    const kvf_layout *L = job->sec[0]->L;
    return head_buf_alloc(&job->bufs[worker], L->n_tokens, L->head_dim, job->centroids, job->parts);
}

static int heads_run(void *arg, int task, int worker) {
    heads_job *job = arg;
    const int32_t n = job->sec[0]->L->n_heads;
    return job->fn(job->sec[task / n], task % n, &job->bufs[worker], job->arg[task / n]);
}

static void heads_teardown(void *arg, int worker) { head_buf_free(&((heads_job *)arg)->bufs[worker]); }

static int for_each_head(heads_job *job) {
    if (job->n_sec == 0) return KVF_OK;
    const kvf_layout *L = job->sec[0]->L;
    const int n_tasks = job->n_sec * L->n_heads;
    const int threads = cpu_threads(L, n_tasks, head_buf_bytes(L->n_tokens, L->head_dim, job->parts));
    job->bufs = calloc((size_t)threads, sizeof *job->bufs);
    if (!job->bufs) return kvf_set_error(KVF_ENOMEM, "CPU reference: out of memory");
    kvf_tasks t = {n_tasks, threads, job, heads_setup, heads_run, heads_teardown};
    int rc = kvf_parallel_for(&t);
    free(job->bufs);
    return rc;
}

/* ------------------------------------------------------------ BF16 sections */

static void bf16_encode(const section_job *j, const uint16_t *x, uint8_t *packed) {
    int d = j->L->head_dim;
    for (int32_t h = 0; h < j->L->n_heads; h++)
        for (int64_t t = 0; t < j->L->n_tokens; t++) {
            const uint16_t *src = x + t * j->sh->token_stride + h * j->sh->head_stride;
            uint8_t *dst = packed + j->l->stage[0].codes_off + row_of(j->L, h, t) * j->l->code_bytes_per_token;
            for (int c = 0; c < d; c++) kvf_put_u16(dst + 2 * c, src[c]);
        }
}

/* Bits 16: the stored values come back as they are, or through RoPE for keys
 * cached before it. */
static void bf16_decode(const section_job *j, const uint8_t *packed, const int32_t *pos, const float *inv,
                        const int *axis, uint16_t *y) {
    int d = j->L->head_dim, axes = kvf_rope_sections(j->s, NULL);
    float v[KVF_REF_MAX_DIM];
    for (int32_t h = 0; h < j->L->n_heads; h++)
        for (int64_t t = 0; t < j->L->n_tokens; t++) {
            const uint8_t *src = packed + j->l->stage[0].codes_off + row_of(j->L, h, t) * j->l->code_bytes_per_token;
            uint16_t *dst = y + t * j->sh->token_stride + h * j->sh->head_stride;
            if (!pos) {
                for (int c = 0; c < d; c++) dst[c] = kvf_get_u16(src + 2 * c);
                continue;
            }
            for (int c = 0; c < d; c++) v[c] = kvf_bf16_to_f32(kvf_get_u16(src + 2 * c));
            kvf_ref_rope_apply(v, d, j->s->rope.layout, inv, axis, pos + t * axes);
            for (int c = 0; c < d; c++) dst[c] = kvf_f32_to_bf16(v[c]);
        }
}

/* ------------------------------------------------------------ encode */

/* x0 = the head's input in f32, rotated if the scheme says so. */
static void load_head(const section_job *j, const uint16_t *x, int32_t h, head_buf *b) {
    int d = j->L->head_dim;
    for (int64_t t = 0; t < j->L->n_tokens; t++) {
        const uint16_t *src = x + t * j->sh->token_stride + h * j->sh->head_stride;
        float *dst = b->x0 + t * d;
        for (int c = 0; c < d; c++) dst[c] = kvf_bf16_to_f32(src[c]);
        if (j->l->rotation == KVF_ROTATION_HADAMARD) kvf_ref_hadamard(dst, d);
    }
}

/* QSAC weights of head h: the diagonal of M_h, or ones without statistics. */
static int qsac_weights(const void *qstats, int32_t h, int d, float *w) {
    if (qstats) return kvf_ref_qstats_weights(qstats, h, d, w);
    for (int c = 0; c < d; c++) w[c] = 1.0f;
    return KVF_OK;
}

/* The previous span's centroid table of this section, stage and head as the
 * warm start of kvf_ref_kmeans_warm: its first rows (as many as both spans
 * have centroids: min(C, either span's tokens)) into warm (bf16), their
 * count in *c_warm; 0 without a warm start. */
static void warm_rows(const section_job *j, const kvf_warm_src *w, int stage, int32_t h, int c_eff, uint16_t *warm,
                      int *c_warm) {
    *c_warm = 0;
    if (!w || !w->packed) return;
    const kvf_section_layout *pl = j->cfg == &j->s->key ? &w->L.key : &w->L.value;
    int d = j->L->head_dim, C = j->l->centroids;
    int rows = w->L.n_tokens < c_eff ? (int)w->L.n_tokens : c_eff;
    const uint8_t *table = w->packed + pl->stage[stage].centroids_off + (size_t)h * (size_t)C * (size_t)d * 2;
    for (size_t i = 0; i < (size_t)rows * (size_t)d; i++) warm[i] = kvf_get_u16(table + 2 * i);
    *c_warm = rows;
}

/* k-means of one stage: centroid table and indices of head h, residual r. */
static int smooth_stage(const section_job *j, int stage, int32_t h, const void *qstats, const kvf_warm_src *w,
                        head_buf *b, uint8_t *packed) {
    const kvf_stage_layout *st = &j->l->stage[stage];
    int64_t n = j->L->n_tokens;
    int d = j->L->head_dim, C = j->l->centroids, Ceff = n < C ? (int)n : C, c_warm;
    /* "last_step": the labels are the last Lloyd step's (never with QSAC:
     * scheme.c); "final": a final assignment. The table starts from the
     * previous span's where there is a warm start (b->r is free until the
     * residual below). */
    bool last = kvf_labels_of_last_step(j->cfg);
    uint16_t *warm = (uint16_t *)b->r;
    warm_rows(j, w, stage, h, Ceff, warm, &c_warm); /* Ceff rows: within b->r's n rows */
    int rc = kvf_ref_kmeans_warm(b->e, n, d, C, j->cfg->kmeans_iters, j->cfg->seed, stage, h, warm, c_warm, b->cent,
                                 last ? b->z : NULL);
    if (rc) return rc;
    bool qsac = stage == 0 && j->cfg->qsac_candidates > 1;
    if (qsac && (rc = qsac_weights(qstats, h, d, b->w))) return rc;
    uint8_t *table = packed + st->centroids_off + (size_t)h * (size_t)C * (size_t)d * 2;
    for (int k = 0; k < C; k++) /* rows past the n tokens repeat row 0 */
        for (int c = 0; c < d; c++) kvf_put_u16(table + ((size_t)k * d + c) * 2, b->cent[(size_t)(k < Ceff ? k : 0) * d + c]);
    double norms[KVF_REF_MAX_CENTROIDS]; /* of the final table, once for every token */
    if (!qsac && !last) kvf_ref_centroid_norms(b->cent, Ceff, d, norms);
    for (int64_t t = 0; t < n; t++) {
        const float *et = b->e + t * d;
        int z = last   ? b->z[t]
                : qsac ? kvf_ref_qsac(et, b->cent, Ceff, d, b->w, j->cfg->qsac_candidates, j->l->group_size)
                       : kvf_ref_nearest_normed(et, b->cent, norms, Ceff, d);
        packed[st->index_off + row_of(j->L, h, t)] = (uint8_t)z;
        const uint16_t *mu = b->cent + (size_t)z * d;
        for (int c = 0; c < d; c++) b->r[t * d + c] = et[c] - kvf_bf16_to_f32(mu[c]);
    }
    return KVF_OK;
}

/* y += stage's centroid of every token of head h, read back from packed. */
static void add_centroids(const section_job *j, int stage, const uint8_t *packed, int32_t h, float *y) {
    const kvf_stage_layout *st = &j->l->stage[stage];
    int64_t n = j->L->n_tokens;
    int d = j->L->head_dim, C = j->l->centroids;
    const uint8_t *table = packed + st->centroids_off + (size_t)h * (size_t)C * (size_t)d * 2;
    for (int64_t t = 0; t < n; t++) {
        const uint8_t *mu = table + (size_t)packed[st->index_off + row_of(j->L, h, t)] * (size_t)d * 2;
        for (int c = 0; c < d; c++) y[t * d + c] = y[t * d + c] + kvf_bf16_to_f32(kvf_get_u16(mu + 2 * c));
    }
}

/* y = ((0 + mu_0) + mu_1 ...) + r_hat (METHODS.md 1): decode's sum, and on
 * encode what PSAC's error E = x0 - y is taken from. */
static void sum_stages(const section_job *j, int32_t h, const uint8_t *packed, head_buf *b) {
    int64_t n = j->L->n_tokens, nd = n * j->L->head_dim;
    int d = j->L->head_dim;
    memset(b->y, 0, (size_t)nd * sizeof(float));
    for (int s = 0; s < j->l->stages && j->l->centroids > 0; s++) add_centroids(j, s, packed, h, b->y);
    kvf_ref_quant_decode(j->l, &j->l->stage[0], n, h, d, packed, b->rhat);
    for (int64_t i = 0; i < nd; i++) b->y[i] = b->y[i] + b->rhat[i];
}

/* PSAC of head h: the stored basis and per-token coefficients of E = x0 - y.
 * Without statistics, or before any query of this head, the planes stay 0. */
static int psac_head(const section_job *j, int32_t h, const void *qstats, head_buf *b, uint8_t *packed) {
    const kvf_section_layout *l = j->l;
    int d = j->L->head_dim, r = l->psac_rank;
    const float *u = NULL, *lambda = NULL;
    int have = qstats ? kvf_ref_qstats_basis(qstats, h, d, r, &u, &lambda) : 0;
    if (have <= 0) return have; /* 0: no basis; < 0: an error status */
    int8_t *basis = (int8_t *)(packed + l->basis_off + (size_t)h * (size_t)d * (size_t)r);
    float bscale;
    kvf_ref_psac_basis(u, d, r, basis, &bscale);
    kvf_put_f32(packed + l->bscale_off + (size_t)h * 4, bscale);
    float *E = b->r; /* the residual buffer is free now */
    for (int64_t t = 0; t < j->L->n_tokens; t++) {
        size_t row = row_of(j->L, h, t);
        for (int c = 0; c < d; c++) E[c] = b->x0[t * d + c] - b->y[t * d + c];
        uint16_t cs;
        kvf_ref_psac_encode(E, basis, bscale, lambda, d, r, (int8_t *)(packed + l->coef_off + row * (size_t)r), &cs);
        kvf_put_u16(packed + l->cscale_off + row * 2, cs);
    }
    return KVF_OK;
}

/* The pipeline's inputs of one section (METHODS.md 11). */
typedef struct pipe_in {
    const struct kvf_scheme *anchor_s; /* the anchor scheme, with anchor */
    const uint8_t *anchor;             /* the anchor span, or NULL */
    int64_t anchor_tokens;
    float *fb;                         /* the section's carried error [H][N][d], or NULL */
    int fb_in;                         /* read it (else zeros) */
    const uint8_t *map;                /* the section's channel map [H][d], or NULL */
} pipe_in;

/* The anchor's rows of head h, or NULL without an anchor (*rc set on failure). */
static float *anchor_rows(const section_job *j, const pipe_in *p, int32_t h, int *rc) {
    *rc = KVF_OK;
    if (!p || !p->anchor) return NULL;
    float *rows = malloc((size_t)p->anchor_tokens * (size_t)j->L->head_dim * sizeof(float));
    if (!rows) {
        *rc = kvf_set_error(KVF_ENOMEM, "CPU reference: out of memory for the anchor's rows");
        return NULL;
    }
    *rc = kvf_ref_anchor_rows(p->anchor_s, p->anchor, p->anchor_tokens, j->L->n_heads, h, j->cfg == &j->s->key ? 0 : 1,
                              rows);
    if (*rc) { free(rows); return NULL; }
    return rows;
}

/* What the pipeline adds to decode's sum y of token t of head h, in decode's
 * order: the refinement of the calibrated channels, the anchor's row, then
 * the outliers' exact values (METHODS.md 11). */
static void pipeline_finish(const section_job *j, const pipe_in *p, int32_t h, int64_t t, const uint8_t *packed,
                            const float *ref, const float *radd, float *y) {
    const kvf_section_layout *l = j->l;
    const int d = j->L->head_dim;
    const size_t row = row_of(j->L, h, t);
    if (l->mp_channels) {
        const uint8_t *map = packed + l->mmap_off + (size_t)h * (size_t)d;
        for (int c = 0; c < d; c++)
            if (map[c] != 255) y[c] = y[c] + radd[c];
    }
    if (ref) {
        const float *a = ref + (size_t)(t % p->anchor_tokens) * (size_t)d;
        for (int c = 0; c < d; c++) y[c] = y[c] + a[c];
    }
    for (int i = 0; i < l->outliers; i++)
        y[packed[l->oidx_off + row * (size_t)l->outliers + (size_t)i]] =
            kvf_bf16_to_f32(kvf_get_u16(packed + l->oval_off + (row * (size_t)l->outliers + (size_t)i) * 2));
}

static int encode_head(const section_job *j, const uint16_t *x, int32_t h, const void *qstats,
                       const kvf_warm_src *w, const pipe_in *p, head_buf *b, uint8_t *packed) {
    const kvf_section_layout *l = j->l;
    const int64_t n = j->L->n_tokens, nd = n * j->L->head_dim;
    const int d = j->L->head_dim;
    const float decay = (float)j->s->pipe.feedback_decay;
    int rc;
    float *ref = anchor_rows(j, p, h, &rc);
    if (rc) return rc;
    float *fb = p && p->fb ? p->fb + (size_t)h * (size_t)nd : NULL;
    load_head(j, x, h, b);
    /* What is quantized: the input, less the anchor's row, plus decay times
     * the carried error (each an f32 operation, in this order). */
    memcpy(b->e, b->x0, (size_t)nd * sizeof(float));
    for (int64_t t = 0; t < n && (ref || (fb && p->fb_in)); t++)
        for (int c = 0; c < d; c++) {
            float v = b->e[t * d + c];
            if (ref) v = v - ref[(t % p->anchor_tokens) * d + c];
            if (fb && p->fb_in) v = v + decay * fb[t * d + c];
            b->e[t * d + c] = v;
        }
    /* QVG-Pro as QVG's code: every stage smooths the remaining residual with
     * its own centroids; only the last residual is quantized (METHODS.md 1). */
    float *r = b->e;
    for (int s = 0; s < l->stages && l->centroids > 0 && !rc; s++) {
        rc = smooth_stage(j, s, h, qstats, w, b, packed);
        if (s + 1 < l->stages) memcpy(b->e, b->r, (size_t)nd * sizeof(float));
        r = b->r;
    }
    /* Outliers: taken out of the residual (NaN: no group's scale sees them)
     * and kept as the input gives them. */
    for (int64_t t = 0; t < n && l->outliers && !rc; t++) {
        const size_t row = row_of(j->L, h, t);
        uint8_t *idx = packed + l->oidx_off + row * (size_t)l->outliers;
        kvf_ref_outliers_pick(r + t * d, d, l->outliers, idx);
        const uint16_t *src = x + t * j->sh->token_stride + h * j->sh->head_stride;
        for (int i = 0; i < l->outliers; i++) {
            kvf_put_u16(packed + l->oval_off + (row * (size_t)l->outliers + (size_t)i) * 2, src[idx[i]]);
            r[t * d + idx[i]] = NAN;
        }
    }
    if (!rc) kvf_ref_quant_encode(l, &l->stage[0], n, h, d, r, packed);
    if (!rc && l->psac_rank > 0) {
        sum_stages(j, h, packed, b); /* y as decode gets it */
        rc = psac_head(j, h, qstats, b, packed);
    }
    if (!rc && (l->mp_channels || ref || fb)) {
        sum_stages(j, h, packed, b);
        const uint8_t *map = l->mp_channels ? p->map + (size_t)h * (size_t)d : NULL;
        if (map) memcpy(packed + l->mmap_off + (size_t)h * (size_t)d, map, (size_t)d);
        float radd[KVF_REF_MAX_DIM];
        for (int64_t t = 0; t < n; t++) {
            const size_t row = row_of(j->L, h, t);
            float *y = b->y + t * d;
            if (map) {
                uint16_t sc;
                kvf_ref_refine_encode(r + t * d, b->rhat + t * d, map, d, l->mp_channels, l->mp_bits,
                                      packed + l->mcode_off + row * (size_t)l->mp_channels * (size_t)l->mp_bits / 8, &sc,
                                      radd);
                kvf_put_u16(packed + l->mscale_off + row * 2, sc);
            }
            pipeline_finish(j, p, h, t, packed, ref, radd, y);
            if (fb) /* what is not finite carries nothing (METHODS.md 11) */
                for (int c = 0; c < d; c++) {
                    const float e = b->x0[t * d + c] - y[c];
                    fb[t * d + c] = isfinite(e) ? e : 0.0f;
                }
        }
    }
    free(ref);
    return rc;
}

typedef struct encode_arg {
    const uint16_t *x;
    const void *qstats;
    const kvf_warm_src *warm; /* NULL: the strided sample */
    const pipe_in *pipe;
    uint8_t *packed;
} encode_arg;

static int encode_pool_head(const section_job *j, int32_t h, head_buf *b, const void *arg) {
    const encode_arg *a = arg;
    return encode_head(j, a->x, h, a->qstats, a->warm, a->pipe, b, a->packed);
}

/* Both sections: a BF16 one is copied, the others' heads go to the threads. */
static int encode_sections(const section_job *const sec[2], const encode_arg arg[2]) {
    heads_job job = {.fn = encode_pool_head};
    for (int t = 0; t < 2; t++) {
        if (sec[t]->l->bits == 16) {
            bf16_encode(sec[t], arg[t].x, arg[t].packed);
            continue;
        }
        job.sec[job.n_sec] = sec[t];
        job.arg[job.n_sec++] = &arg[t];
        const kvf_section_layout *l = sec[t]->l;
        const int sum = l->psac_rank > 0 || l->mp_channels || (arg[t].pipe && (arg[t].pipe->anchor || arg[t].pipe->fb));
        job.parts |= HB_ENCODE | (sum ? HB_DECODE_SUM : 0);
        if (sec[t]->l->centroids > job.centroids) job.centroids = sec[t]->l->centroids;
    }
    return for_each_head(&job);
}

/* ------------------------------------------------------------ decode */

/* PSAC correction, inverse rotation, RoPE, BF16 out, for every token of head h. */
static void finish_head(const section_job *j, int32_t h, const uint8_t *packed, const int32_t *pos,
                        const float *inv, const int *axis, head_buf *b, uint16_t *out) {
    const kvf_section_layout *l = j->l;
    int d = j->L->head_dim, r = l->psac_rank, axes = kvf_rope_sections(j->s, NULL);
    const int8_t *basis = r > 0 ? (const int8_t *)(packed + l->basis_off + (size_t)h * (size_t)d * (size_t)r) : NULL;
    const float bscale = r > 0 ? kvf_get_f32(packed + l->bscale_off + (size_t)h * 4) : 0.0f;
    for (int64_t t = 0; t < j->L->n_tokens; t++) {
        size_t row = row_of(j->L, h, t);
        float *y = b->y + t * d;
        if (r > 0) /* skips a token whose coefficient scale is 0 */
            kvf_ref_psac_apply(y, basis, bscale, (const int8_t *)(packed + l->coef_off + row * (size_t)r),
                               kvf_get_u16(packed + l->cscale_off + row * 2), d, r);
        if (l->rotation == KVF_ROTATION_HADAMARD) kvf_ref_hadamard(y, d);
        if (pos) kvf_ref_rope_apply(y, d, j->s->rope.layout, inv, axis, pos + t * axes);
        uint16_t *dst = out + t * j->sh->token_stride + h * j->sh->head_stride;
        for (int c = 0; c < d; c++) dst[c] = kvf_f32_to_bf16(y[c]);
    }
}

typedef struct decode_arg {
    const uint8_t *packed;
    const int32_t *pos;
    uint16_t *out;
    const pipe_in *pipe; /* the anchor, or NULL */
    /* RoPE's frequencies and axes depend on the channel only: once per section. */
    int axis[KVF_REF_MAX_DIM / 2];
    float inv[KVF_REF_MAX_DIM / 2];
} decode_arg;

static int decode_pool_head(const section_job *j, int32_t h, head_buf *b, const void *arg) {
    const decode_arg *a = arg;
    const kvf_section_layout *l = j->l;
    int rc;
    float *ref = anchor_rows(j, a->pipe, h, &rc);
    if (rc) return rc;
    sum_stages(j, h, a->packed, b);
    if (l->mp_channels || ref || l->outliers) {
        const int d = j->L->head_dim;
        const uint8_t *map = l->mp_channels ? a->packed + l->mmap_off + (size_t)h * (size_t)d : NULL;
        float radd[KVF_REF_MAX_DIM];
        for (int64_t t = 0; t < j->L->n_tokens; t++) {
            const size_t row = row_of(j->L, h, t);
            if (map)
                kvf_ref_refine_decode(a->packed + l->mcode_off + row * (size_t)l->mp_channels * (size_t)l->mp_bits / 8,
                                      kvf_get_u16(a->packed + l->mscale_off + row * 2), map, d, l->mp_bits, radd);
            pipeline_finish(j, a->pipe, h, t, a->packed, ref, radd, b->y + t * d);
        }
    }
    free(ref);
    finish_head(j, h, a->packed, a->pos, a->inv, a->axis, b, a->out);
    return KVF_OK;
}

/* Both sections: a BF16 one is copied, the others' heads go to the threads. */
static int decode_sections(const section_job *const sec[2], decode_arg arg[2]) {
    heads_job job = {.fn = decode_pool_head, .parts = HB_DECODE_SUM};
    for (int t = 0; t < 2; t++) {
        if (arg[t].pos) kvf_ref_rope_table(sec[t]->L->head_dim, &sec[t]->s->rope, arg[t].inv, arg[t].axis);
        if (sec[t]->l->bits == 16) {
            bf16_decode(sec[t], arg[t].packed, arg[t].pos, arg[t].inv, arg[t].axis, arg[t].out);
            continue;
        }
        job.sec[job.n_sec] = sec[t];
        job.arg[job.n_sec++] = &arg[t];
    }
    return for_each_head(&job);
}

/* ------------------------------------------------------------ entry points */

/* Checks shared by encode and decode: scheme, layout, shape. */
static int prepare(const struct kvf_scheme *s, const kvf_shape *shape, kvf_layout *L, kvf_shape *sh) {
    int rc = kvf_shape_resolve(shape, s->head_dim, sh);
    if (!rc) rc = kvf_layout_compute(s, sh->n_tokens, sh->n_heads, L);
    if (!rc && s->head_dim > KVF_REF_MAX_DIM)
        rc = kvf_set_error(KVF_ENOTIMPL, "head_dim = %d: the CPU reference handles at most %d", s->head_dim,
                           KVF_REF_MAX_DIM);
    return rc;
}

static section_job job_of(const struct kvf_scheme *s, const kvf_layout *L, const kvf_shape *sh, bool key) {
    section_job j = {s, key ? &s->key : &s->value, L, key ? &L->key : &L->value, sh};
    return j;
}

/* Statistics given to encode: their header must match the scheme and shape. */
static int check_qstats(const struct kvf_scheme *s, const void *qstats, int32_t n_heads) {
    kvf_qstats_layout ql;
    int rc = kvf_qstats_layout_compute(s, n_heads, &ql);
    if (!rc) rc = kvf_qstats_check(s, qstats, ql.total_bytes, n_heads);
    return rc ? kvf_wrap_error(rc, "kvf_ref_encode") : KVF_OK;
}

int kvf_ref_encode(const struct kvf_scheme *s, const uint16_t *k, const uint16_t *v,
                   const kvf_shape *shape, const void *qstats, uint8_t *packed, size_t packed_bytes) {
    return kvf_ref_encode_warm(s, k, v, shape, qstats, NULL, 0, 0, packed, packed_bytes);
}

int kvf_ref_encode_warm(const struct kvf_scheme *s, const uint16_t *k, const uint16_t *v, const kvf_shape *shape,
                        const void *qstats, const uint8_t *prev, size_t prev_bytes, int64_t prev_n_tokens,
                        uint8_t *packed, size_t packed_bytes) {
    const kvf_encode_args args = {.qstats = qstats, .prev = prev, .prev_bytes = prev_bytes,
                                  .prev_n_tokens = prev_n_tokens};
    return kvf_ref_encode_ex(s, k, v, shape, &args, packed, packed_bytes);
}

/* The pipeline's inputs of both sections from an encode's or decode's
 * arguments (anchor checked, header included). */
static int pipe_inputs(const struct kvf_scheme *s, const kvf_layout *L, const void *packed, size_t packed_bytes,
                       const void *anchor, size_t anchor_bytes, int64_t anchor_n_tokens, struct kvf_scheme *anchor_s,
                       pipe_in pipe[2], const char *fn) {
    kvf_layout AL;
    memset(pipe, 0, 2 * sizeof *pipe);
    int rc = kvf_pipeline_args_check(s, L, packed, packed_bytes, anchor, anchor_bytes, anchor_n_tokens, anchor_s, &AL,
                                     fn);
    if (!rc && anchor) rc = kvf_packed_check(anchor_s, anchor, anchor_bytes, anchor_n_tokens, L->n_heads);
    if (rc) return anchor ? kvf_wrap_error(rc, "%s: the anchor", fn) : rc;
    for (int t = 0; t < 2 && anchor; t++) {
        pipe[t].anchor_s = anchor_s;
        pipe[t].anchor = anchor;
        pipe[t].anchor_tokens = anchor_n_tokens;
    }
    return KVF_OK;
}

int kvf_ref_encode_ex(const struct kvf_scheme *s, const uint16_t *k, const uint16_t *v, const kvf_shape *shape,
                      const kvf_encode_args *args, uint8_t *packed, size_t packed_bytes) {
    if (!s || !k || !v || !shape || !packed || !args)
        return kvf_set_error(KVF_EINVAL, "kvf_ref_encode: NULL argument");
    kvf_layout L;
    kvf_shape sh;
    int rc = prepare(s, shape, &L, &sh);
    if (rc) return rc;
    if (packed_bytes < L.total_bytes)
        return kvf_set_error(KVF_ERANGE,
                             "packed buffer is %zu bytes, %zu needed for %lld tokens x %d heads",
                             packed_bytes, L.total_bytes, (long long)L.n_tokens, (int)L.n_heads);
    if (args->qstats && (rc = check_qstats(s, args->qstats, sh.n_heads))) return rc;
    kvf_warm_src warm = {args->prev, {0}};
    if (args->prev) {
        if ((rc = kvf_warm_check(s, args->prev, args->prev_bytes, args->prev_n_tokens, sh.n_heads, packed,
                                 L.total_bytes, &warm.L)) ||
            (rc = kvf_packed_check(s, args->prev, args->prev_bytes, args->prev_n_tokens, sh.n_heads)))
            return kvf_wrap_error(rc, "kvf_encode_warm: the previous span's packed cache");
    }
    if ((L.key.mp_channels || L.value.mp_channels) && !args->channel_map)
        return kvf_set_error(KVF_EINVAL, "kvf_encode: scheme %s refines calibrated channels (mixed_precision): the "
                                         "channel map is required (kvf_mixed_map)", s->name);
    for (int t = 0; t < 2 && args->channel_map; t++) {
        const int m = t ? L.value.mp_channels : L.key.mp_channels;
        const size_t hd = (size_t)L.n_heads * (size_t)s->head_dim;
        for (size_t i = 0; i < hd && m; i++) {
            const uint8_t e = args->channel_map[(size_t)t * hd + i];
            if (e != 255 && e >= m)
                return kvf_set_error(KVF_EINVAL, "kvf_encode: channel map (%s, head %zu, channel %zu): slot %d of %d",
                                     t ? "value" : "key", i / (size_t)s->head_dim, i % (size_t)s->head_dim, e, m);
        }
    }
    struct kvf_scheme anchor_s;
    pipe_in pipe[2];
    if ((rc = pipe_inputs(s, &L, packed, L.total_bytes, args->anchor, args->anchor_bytes, args->anchor_n_tokens,
                          &anchor_s, pipe, "kvf_encode")))
        return rc;
    const size_t nd = (size_t)L.n_heads * (size_t)L.n_tokens * (size_t)s->head_dim;
    for (int t = 0; t < 2; t++) {
        if (s->pipe.feedback_decay > 0 && args->feedback) {
            pipe[t].fb = args->feedback + (size_t)t * nd;
            pipe[t].fb_in = args->feedback_in;
        }
        if (args->channel_map) pipe[t].map = args->channel_map + (size_t)t * (size_t)L.n_heads * (size_t)s->head_dim;
    }

    memset(packed, 0, L.total_bytes); /* padding between planes is zero */
    kvf_packed_header hdr;
    kvf_header_fill(s, &L, &hdr);
    memcpy(packed, &hdr, sizeof hdr);
    section_job jk = job_of(s, &L, &sh, true), jv = job_of(s, &L, &sh, false);
    const section_job *sec[2] = {&jk, &jv};
    /* values: no QSAC, no PSAC */
    const encode_arg arg[2] = {{k, args->qstats, &warm, &pipe[0], packed}, {v, NULL, &warm, &pipe[1], packed}};
    return encode_sections(sec, arg);
}

/* Every stored centroid index below the scheme's centroid count: a corrupt
 * cache with a larger index would read past the head's table (with fewer than
 * 256 centroids), so it is refused before anything is written. */
static int check_indices(const kvf_layout *L, const kvf_section_layout *l, const uint8_t *packed, const char *tensor) {
    if (l->centroids <= 0 || l->centroids >= 256) return KVF_OK; /* every byte is a valid index */
    for (int s = 0; s < l->stages; s++) {
        const uint8_t *ix = packed + l->stage[s].index_off;
        for (size_t i = 0; i < l->stage[s].index_bytes; i++)
            if (ix[i] >= l->centroids)
                return kvf_set_error(KVF_EFORMAT,
                                     "packed cache is corrupt: %s stage %d, head %lld, token %lld stores centroid %d "
                                     "of %d",
                                     tensor, s, (long long)(i / (size_t)L->n_tokens),
                                     (long long)(i % (size_t)L->n_tokens), ix[i], l->centroids);
    }
    return KVF_OK;
}

/* Every stored outlier channel below head_dim and every refinement slot below
 * the refined count: a corrupt cache with another would write or read past
 * a row (the GPU decode clamps them instead). */
static int check_outliers(const kvf_layout *L, const kvf_section_layout *l, const uint8_t *packed,
                          const char *tensor) {
    for (size_t i = 0; i < l->oidx_bytes; i++)
        if (packed[l->oidx_off + i] >= L->head_dim)
            return kvf_set_error(KVF_EFORMAT, "packed cache is corrupt: %s outlier %zu stores channel %d of %d", tensor,
                                 i, packed[l->oidx_off + i], L->head_dim);
    for (size_t i = 0; i < l->mmap_bytes; i++)
        if (packed[l->mmap_off + i] != 255 && packed[l->mmap_off + i] >= l->mp_channels)
            return kvf_set_error(KVF_EFORMAT, "packed cache is corrupt: %s channel map entry %zu is slot %d of %d",
                                 tensor, i, packed[l->mmap_off + i], l->mp_channels);
    return KVF_OK;
}

int kvf_ref_decode(const struct kvf_scheme *s, const uint8_t *packed, size_t packed_bytes,
                   const kvf_shape *shape, const int32_t *positions, uint16_t *k_out, uint16_t *v_out) {
    const kvf_decode_args args = {.positions = positions};
    return kvf_ref_decode_ex(s, packed, packed_bytes, shape, &args, k_out, v_out);
}

int kvf_ref_decode_ex(const struct kvf_scheme *s, const uint8_t *packed, size_t packed_bytes, const kvf_shape *shape,
                      const kvf_decode_args *args, uint16_t *k_out, uint16_t *v_out) {
    if (!s || !packed || !shape || !k_out || !v_out || !args)
        return kvf_set_error(KVF_EINVAL, "kvf_ref_decode: NULL argument");
    const int32_t *positions = args->positions;
    bool rope = s->rope.placement == KVF_ROPE_PRE;
    if (rope && !positions)
        return kvf_set_error(KVF_EINVAL,
                             "kvf_ref_decode: scheme %s caches keys before RoPE (rope.placement = \"pre\"): "
                             "positions are required",
                             s->name);
    kvf_layout L;
    kvf_shape sh;
    int rc = prepare(s, shape, &L, &sh);
    if (!rc) rc = kvf_packed_check(s, packed, packed_bytes, sh.n_tokens, sh.n_heads);
    if (rc) return rc;
    if (packed_bytes < L.total_bytes)
        return kvf_set_error(KVF_ERANGE, "packed buffer is %zu bytes, its header says %zu",
                             packed_bytes, L.total_bytes);
    if ((rc = check_indices(&L, &L.key, packed, "key")) || (rc = check_indices(&L, &L.value, packed, "value")))
        return rc;
    if ((rc = check_outliers(&L, &L.key, packed, "key")) || (rc = check_outliers(&L, &L.value, packed, "value")))
        return rc;
    struct kvf_scheme anchor_s;
    pipe_in pipe[2];
    if ((rc = pipe_inputs(s, &L, packed, L.total_bytes, args->anchor, args->anchor_bytes, args->anchor_n_tokens,
                          &anchor_s, pipe, "kvf_decode")))
        return rc;
    section_job jk = job_of(s, &L, &sh, true), jv = job_of(s, &L, &sh, false);
    const section_job *sec[2] = {&jk, &jv};
    decode_arg arg[2] = {{.packed = packed, .pos = rope ? positions : NULL, .out = k_out, .pipe = &pipe[0]},
                         {.packed = packed, .pos = NULL, .out = v_out, .pipe = &pipe[1]}};
    return decode_sections(sec, arg);
}
