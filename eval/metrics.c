/* Attention-level quality metrics (see metrics.h and docs/QUALITY.md). */
#include "metrics.h"

#include "internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define QUERY_BLOCK 16 /* queries whose logit rows are computed together */

/* ------------------------------------------------------------ primitives */

/* f32 dot product with 8 partial sums (vectorizes without -ffast-math). */
static float dot(const float *a, const float *b, int d) {
    float acc[8] = {0};
    int c = 0;
    for (; c + 8 <= d; c += 8)
        for (int i = 0; i < 8; i++) acc[i] += a[c + i] * b[c + i];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; c < d; c++) s += a[c] * b[c];
    return s;
}

void kvf_metric_logits(const float *q, int nb, const float *k, int64_t n, int d, double scale, double *out) {
    for (int64_t j = 0; j < n; j++) {
        const float *kj = k + j * d;
        for (int b = 0; b < nb; b++) out[b * n + j] = scale * (double)dot(q + (size_t)b * d, kj, d);
    }
}

int64_t kvf_metric_argmax(const double *l, int64_t n) {
    int64_t best = 0;
    for (int64_t j = 1; j < n; j++)
        if (l[j] > l[best]) best = j;
    return best;
}

int kvf_metric_topk(const double *l, int64_t n, int k, int64_t *idx) {
    if (k > KVF_TOPK) k = KVF_TOPK;
    if (k > n) k = (int)n;
    if (k <= 0) return 0;
    double val[KVF_TOPK];
    int m = 0;
    for (int64_t j = 0; j < n; j++) {
        if (m == k && !(l[j] > val[k - 1])) continue; /* equals keep the earlier index */
        int p = m < k ? m++ : k - 1;
        while (p > 0 && val[p - 1] < l[j]) {
            val[p] = val[p - 1];
            idx[p] = idx[p - 1];
            p--;
        }
        val[p] = l[j];
        idx[p] = j;
    }
    return m;
}

double kvf_metric_topk_overlap(const int64_t *a, const int64_t *b, int k) {
    if (k <= 0) return 1.0;
    int common = 0;
    for (int i = 0; i < k; i++)
        for (int j = 0; j < k; j++)
            if (a[i] == b[j]) { common++; break; }
    return (double)common / k;
}

void kvf_metric_softmax(double *p, int64_t n) {
    if (n <= 0) return;
    double mx = p[kvf_metric_argmax(p, n)], sum = 0;
    for (int64_t j = 0; j < n; j++) sum += p[j] = exp(p[j] - mx);
    for (int64_t j = 0; j < n; j++) p[j] /= sum;
}

void kvf_metric_attend(const double *p, int nb, const float *v, int64_t n, int d, double *out) {
    memset(out, 0, (size_t)nb * d * sizeof *out);
    for (int64_t j = 0; j < n; j++) {
        const float *vj = v + j * d;
        for (int b = 0; b < nb; b++) {
            double w = p[b * n + j], *o = out + (size_t)b * d;
            for (int c = 0; c < d; c++) o[c] += w * vj[c];
        }
    }
}

void kvf_metric_qq_add(const float *q, int64_t n, int d, double *m) {
    for (int64_t i = 0; i < n; i++) {
        const float *x = q + i * d;
        for (int a = 0; a < d; a++) {
            double xa = x[a], *row = m + (size_t)a * d;
            for (int b = a; b < d; b++) row[b] += xa * x[b];
        }
    }
}

double kvf_metric_quad(const float *e, const double *m, int d) {
    double s = 0; /* sum_a e_a (M_aa e_a + 2 sum_{b > a} M_ab e_b): half the products */
    for (int a = 0; a < d; a++) {
        const double *row = m + (size_t)a * d;
        double y = 0;
        for (int b = a + 1; b < d; b++) y += row[b] * e[b];
        s += e[a] * (row[a] * e[a] + 2.0 * y);
    }
    return s;
}

double kvf_metric_sq_err(const float *a, const float *b, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++) {
        double t = (double)a[i] - (double)b[i];
        s += t * t;
    }
    return s;
}

/* ------------------------------------------------ one query head, all keys */

/* Top-1 and top-5 of one query's reference and cached logit rows. */
static void compare_rows(const double *ref, const double *hat, int64_t n, kvf_attn_sums *out) {
    int64_t a[KVF_TOPK], b[KVF_TOPK];
    int k = kvf_metric_topk(ref, n, KVF_TOPK, a);
    kvf_metric_topk(hat, n, KVF_TOPK, b);
    out->top1_shifted += a[0] != b[0];
    out->top5_overlap += kvf_metric_topk_overlap(a, b, k);
}

int kvf_metric_attention(const float *q, int64_t nq, const float *k_ref, const float *v_ref, const float *k_hat,
                         const float *v_hat, int64_t n, int d, kvf_attn_sums *out) {
    if (nq <= 0 || n <= 0) return KVF_OK;
    size_t rows = (size_t)QUERY_BLOCK * (size_t)n;
    double *lr = malloc(rows * sizeof *lr), *lh = malloc(rows * sizeof *lh);
    double *or_ = malloc((size_t)QUERY_BLOCK * d * sizeof *or_), *oh = malloc((size_t)QUERY_BLOCK * d * sizeof *oh);
    int rc = lr && lh && or_ && oh ? KVF_OK : kvf_set_error(KVF_ENOMEM, "metrics: out of memory for %lld keys", (long long)n);
    const double scale = 1.0 / sqrt((double)d);
    for (int64_t i0 = 0; i0 < nq && !rc; i0 += QUERY_BLOCK) {
        int nb = nq - i0 < QUERY_BLOCK ? (int)(nq - i0) : QUERY_BLOCK;
        const float *qb = q + i0 * d;
        kvf_metric_logits(qb, nb, k_ref, n, d, scale, lr);
        kvf_metric_logits(qb, nb, k_hat, n, d, scale, lh);
        for (int b = 0; b < nb; b++) {
            compare_rows(lr + b * n, lh + b * n, n, out);
            kvf_metric_softmax(lr + b * n, n);
            kvf_metric_softmax(lh + b * n, n);
        }
        kvf_metric_attend(lr, nb, v_ref, n, d, or_);
        kvf_metric_attend(lh, nb, v_hat, n, d, oh);
        for (int i = 0; i < nb * d; i++) {
            double e = oh[i] - or_[i];
            out->err_sq += e * e;
            out->ref_sq += or_[i] * or_[i];
        }
        out->queries += nb;
    }
    free(lr);
    free(lh);
    free(or_);
    free(oh);
    return rc;
}

/* ------------------------------------------------------ sums and means */

void kvf_eval_sums_add(kvf_eval_sums *acc, const kvf_eval_sums *x) {
    acc->queries += x->queries;
    acc->top1_shifted += x->top1_shifted;
    acc->top5_overlap += x->top5_overlap;
    acc->attn_rel_err += x->attn_rel_err;
    acc->kv_values += x->kv_values;
    acc->key_sq_err += x->key_sq_err;
    acc->value_sq_err += x->value_sq_err;
    acc->key_tokens += x->key_tokens;
    acc->qk_err += x->qk_err;
    acc->bf16_bytes += x->bf16_bytes;
    acc->stored_bytes += x->stored_bytes;
    acc->bf16_held += x->bf16_held;
    acc->stored_held += x->stored_held;
}

static double ratio(double num, double den) { return den > 0 ? num / den : NAN; }

void kvf_eval_finish(const kvf_eval_sums *s, kvf_eval_metrics *m) {
    m->top1_shift = ratio(s->top1_shifted, s->queries);
    m->top5_overlap = ratio(s->top5_overlap, s->queries);
    m->attn_out_rel_err = ratio(s->attn_rel_err, s->queries);
    m->key_mse = ratio(s->key_sq_err, s->kv_values);
    m->value_mse = ratio(s->value_sq_err, s->kv_values);
    m->qk_err = ratio(s->qk_err, s->key_tokens);
    m->compression = ratio(s->bf16_bytes, s->stored_bytes);
    m->compression_held = ratio(s->bf16_held, s->stored_held);
    m->queries = s->queries;
    m->kv_values = s->kv_values;
    m->key_tokens = s->key_tokens;
    m->bf16_bytes = s->bf16_bytes;
    m->stored_bytes = s->stored_bytes;
}

/* ------------------------------------------------------ one streaming step */

typedef struct kv_sums { double kv_values, key_sq_err, value_sq_err, key_tokens, qk_err; } kv_sums;

typedef struct step_job {
    const kvf_eval_step *st;
    kvf_attn_sums *attn; /* [q_heads] */
    kv_sums *kv;         /* [kv_heads] */
} step_job;

static int attention_task(const kvf_eval_step *st, int j, kvf_attn_sums *out) {
    int h = j / (st->q_heads / st->kv_heads);
    size_t kv = (size_t)h * st->kv_rows * st->d;
    return kvf_metric_attention(st->q + (size_t)j * st->nq * st->d, st->nq, st->k_ref + kv, st->v_ref + kv,
                                st->k_hat + kv, st->v_hat + kv, st->n_keys, st->d, out);
}

/* MSE and e^T M e over the packed tokens of KV head h. */
static int kv_task(const kvf_eval_step *st, int h, kv_sums *out) {
    if (!st->packed) return KVF_OK;
    const int d = st->d, group = st->q_heads / st->kv_heads;
    const size_t kv = (size_t)h * st->kv_rows * d;
    double *m = calloc((size_t)d * d, sizeof *m);
    float *e = malloc((size_t)d * sizeof *e);
    if (!m || !e) {
        free(m);
        free(e);
        return kvf_set_error(KVF_ENOMEM, "metrics: out of memory for M");
    }
    for (int j = h * group; j < (h + 1) * group; j++) kvf_metric_qq_add(st->q + (size_t)j * st->nq * d, st->nq, d, m);
    const double inv = st->nq > 0 ? 1.0 / ((double)st->nq * group) : 0.0;
    for (int a = 0; a < d; a++)
        for (int b = a; b < d; b++) m[(size_t)a * d + b] *= inv;
    for (int64_t t = 0; t < st->n_keys; t++) {
        if (!st->packed[t]) continue;
        const float *kr = st->k_ref + kv + t * d, *kh = st->k_hat + kv + t * d;
        out->key_sq_err += kvf_metric_sq_err(kh, kr, d);
        out->value_sq_err += kvf_metric_sq_err(st->v_hat + kv + t * d, st->v_ref + kv + t * d, d);
        out->kv_values += d;
        for (int c = 0; c < d; c++) e[c] = kh[c] - kr[c];
        out->qk_err += kvf_metric_quad(e, m, d);
        out->key_tokens += 1;
    }
    free(m);
    free(e);
    return KVF_OK;
}

/* Task t: query head t's attention sums, then KV head t - q_heads's. */
static int step_task(void *arg, int t, int worker) {
    (void)worker;
    step_job *job = arg;
    const kvf_eval_step *st = job->st;
    return t < st->q_heads ? attention_task(st, t, &job->attn[t])
                           : kv_task(st, t - st->q_heads, &job->kv[t - st->q_heads]);
}

/* ||O_hat - O||_F / ||O||_F from the squared norms: 0 when equal, infinite
 * when the reference output is 0 and the cached one is not. */
static double rel_err(double err_sq, double ref_sq) {
    if (err_sq == 0) return 0.0;
    return ref_sq > 0 ? sqrt(err_sq / ref_sq) : INFINITY;
}

static int check_step(const kvf_eval_step *st) {
    if (!st || !st->q || !st->k_ref || !st->v_ref || !st->k_hat || !st->v_hat)
        return kvf_set_error(KVF_EINVAL, "kvf_eval_step_run: NULL tensor");
    if (st->q_heads < 1 || st->kv_heads < 1 || st->q_heads % st->kv_heads || st->d < 1 || st->nq < 0 ||
        st->n_keys < 0 || st->kv_rows < st->n_keys)
        return kvf_set_error(KVF_EINVAL, "kvf_eval_step_run: bad shape (%d query heads, %d KV heads, d = %d)",
                             st->q_heads, st->kv_heads, st->d);
    return KVF_OK;
}

int kvf_eval_step_run(const kvf_eval_step *st, kvf_eval_sums *out) {
    int rc = check_step(st);
    if (rc) return rc;
    step_job job = {st, calloc((size_t)st->q_heads, sizeof(kvf_attn_sums)),
                    calloc((size_t)st->kv_heads, sizeof(kv_sums))};
    if (!job.attn || !job.kv) rc = kvf_set_error(KVF_ENOMEM, "kvf_eval_step_run: out of memory");
    else {
        kvf_tasks t = {st->q_heads + st->kv_heads, st->threads, &job, NULL, step_task, NULL};
        rc = kvf_parallel_for(&t);
    }
    if (!rc) {
        kvf_attn_sums a = {0};
        for (int j = 0; j < st->q_heads; j++) {
            a.queries += job.attn[j].queries;
            a.top1_shifted += job.attn[j].top1_shifted;
            a.top5_overlap += job.attn[j].top5_overlap;
            a.err_sq += job.attn[j].err_sq;
            a.ref_sq += job.attn[j].ref_sq;
        }
        out->queries += a.queries;
        out->top1_shifted += a.top1_shifted;
        out->top5_overlap += a.top5_overlap;
        if (a.queries > 0) out->attn_rel_err += a.queries * rel_err(a.err_sq, a.ref_sq);
        for (int h = 0; h < st->kv_heads; h++) {
            out->kv_values += job.kv[h].kv_values;
            out->key_sq_err += job.kv[h].key_sq_err;
            out->value_sq_err += job.kv[h].value_sq_err;
            out->key_tokens += job.kv[h].key_tokens;
            out->qk_err += job.kv[h].qk_err;
        }
    }
    free(job.attn);
    free(job.kv);
    return rc;
}
