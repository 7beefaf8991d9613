/*
 * Attention-level quality metrics (docs/QUALITY.md "Metrics"): small pure
 * functions on host float arrays, and the metrics of one (layer, chunk) step.
 * Vectors are rows of d floats; matrices are row-major.
 */
#ifndef KVF_EVAL_METRICS_H
#define KVF_EVAL_METRICS_H

#include <stddef.h>
#include <stdint.h>

#define KVF_TOPK 5

/* ------------------------------------------------------------ primitives */

/* out[b * n + j] = scale * <q_b, k_j> for nb queries q [nb][d] and n keys k [n][d]. */
void kvf_metric_logits(const float *q, int nb, const float *k, int64_t n, int d, double scale, double *out);
/* Index of the largest of n >= 1 logits; the lowest index among equals. */
int64_t kvf_metric_argmax(const double *logits, int64_t n);
/* The min(k, n) largest logits' indices in descending order of logit (the
 * lower index first among equals), k <= KVF_TOPK; returns how many. */
int kvf_metric_topk(const double *logits, int64_t n, int k, int64_t *idx);
/* |a ∩ b| / k for two sets of k distinct indices. */
double kvf_metric_topk_overlap(const int64_t *a, const int64_t *b, int k);
/* Softmax of n logits in place (the maximum subtracted first). */
void kvf_metric_softmax(double *p, int64_t n);
/* out[b][c] = sum_j p[b * n + j] * v[j][c] for nb rows of n probabilities. */
void kvf_metric_attend(const double *p, int nb, const float *v, int64_t n, int d, double *out);
/* Sum of q q^T over n rows q [n][d], added to the upper triangle (b >= a) of
 * m [d][d], the part kvf_metric_quad reads; the rest is left as it is. */
void kvf_metric_qq_add(const float *q, int64_t n, int d, double *m);
/* e^T M e for one vector e [d] and a symmetric M [d][d] (its upper triangle is read). */
double kvf_metric_quad(const float *e, const double *m, int d);
/* Sum of squared differences of n floats. */
double kvf_metric_sq_err(const float *a, const float *b, size_t n);

/* ------------------------------------------------ one query head, all keys */

typedef struct kvf_attn_sums {
    double queries;      /* query rows seen */
    double top1_shifted; /* rows whose argmax key changed */
    double top5_overlap; /* sum over rows of |top5_ref ∩ top5| / min(5, n) */
    double err_sq;       /* sum over rows of ||o - o_ref||^2 */
    double ref_sq;       /* sum over rows of ||o_ref||^2 */
} kvf_attn_sums;

/* nq queries q [nq][d] of one head against n reference keys/values and the
 * same n keys/values as the cache returns them (all [n][d]), logits scaled
 * by 1/sqrt(d). Adds to *out; KVF_ENOMEM on allocation failure. */
int kvf_metric_attention(const float *q, int64_t nq, const float *k_ref, const float *v_ref, const float *k_hat,
                         const float *v_hat, int64_t n, int d, kvf_attn_sums *out);

/* ------------------------------------------------------ one streaming step */

/* Sums behind every metric; means are ratios of sums (kvf_eval_finish). */
typedef struct kvf_eval_sums {
    double queries, top1_shifted, top5_overlap; /* per query row */
    double attn_rel_err;                        /* per step: relative error times the step's queries */
    double kv_values, key_sq_err, value_sq_err; /* per packed value (token x head x channel) */
    double key_tokens, qk_err;                  /* per packed key token x KV head: e^T M e */
    double bf16_bytes, stored_bytes;            /* the cache at the end of the stream */
    /* What the cache holds after each step (its packed spans, the chunks it
     * keeps in BF16, query statistics, the carried error) and the BF16 history
     * at that step, each summed over the steps: a span policy holds its open
     * span in BF16, which the end of the stream does not show. */
    double bf16_held, stored_held;
} kvf_eval_sums;

typedef struct kvf_eval_metrics {
    double top1_shift, top5_overlap, attn_out_rel_err; /* NaN when no queries */
    double key_mse, value_mse, qk_err;                 /* NaN when nothing was packed */
    double compression;                                /* NaN when no bytes */
    double compression_held;                           /* bf16_held / stored_held; NaN when not known (a peer) */
    double queries, kv_values, key_tokens;             /* the weights */
    double bf16_bytes, stored_bytes;
} kvf_eval_metrics;

void kvf_eval_sums_add(kvf_eval_sums *acc, const kvf_eval_sums *x);
void kvf_eval_finish(const kvf_eval_sums *s, kvf_eval_metrics *m);

/*
 * The queries of one chunk against every key they attend to. Keys and values
 * are [kv_heads][kv_rows][d] (a KV head's n_keys rows first); `packed` [n_keys]
 * marks the tokens the cache returned decoded from packed bytes (NULL: none),
 * the others must be equal in *_ref and *_hat. Query head j reads KV head
 * j / (q_heads / kv_heads). M of KV head h = mean of q q^T over the queries of
 * its query heads.
 */
typedef struct kvf_eval_step {
    int q_heads, kv_heads, d;
    int64_t nq;      /* queries per head */
    const float *q;  /* [q_heads][nq][d] */
    int64_t n_keys, kv_rows;
    const float *k_ref, *v_ref, *k_hat, *v_hat;
    const uint8_t *packed;
    int threads;     /* worker threads (<= 1: the calling thread) */
} kvf_eval_step;

/* Adds the step's sums (not the bytes) to *out. Deterministic whatever the
 * thread count (per-head sums reduced in head order). */
int kvf_eval_step_run(const kvf_eval_step *st, kvf_eval_sums *out);

#endif
