/*
 * Quality evaluation of a scheme on a world-model KV dump (docs/QUALITY.md):
 * the chunks stream causally through the scheme's cache policy, layer by
 * layer, and every chunk's queries are scored against full precision.
 */
#ifndef KVF_EVAL_H
#define KVF_EVAL_H

#include <stdio.h>

#include "dump.h"
#include "kvforge.h"
#include "metrics.h"
#include "recon.h"

typedef struct kvf_eval_options {
    int device;  /* KVF_DEVICE_CPU or a CUDA ordinal */
    int threads; /* metric threads; <= 0: the online CPUs */
    int warm;    /* k-means of each span warm-started from the layer's previous span (kvf_encode_warm) */
    const char *recon_out; /* kvf_eval_run: also write the scheme's cache as a recon file (recon.h) here */
    int strict;  /* a NaN or infinity in a tensor of the dump is an error (KVF_EFORMAT), not a warning */
    /* Mixed precision's sensitivity table (`kvforge calibrate`), or NULL: the
     * one the scheme names (mixed_precision.table). */
    const char *table;
    /* Called after every step (chunk) of every layer, from the calling thread; may be NULL. */
    void (*progress)(void *user, int layer, int layers, int chunk, int chunks);
    void *progress_user;
} kvf_eval_options;

/* A tensor of the dump holding NaN or infinite values: how many, and the
 * first in [heads][tokens][head_dim] order. */
typedef struct kvf_eval_nonfinite {
    char tensor[48];  /* "l{l}.c{c}.{role}" */
    int64_t count;
    int head, channel;
    int64_t token;
    float first;      /* NaN, +inf or -inf */
} kvf_eval_nonfinite;

typedef struct kvf_eval_report {
    char scheme_id[96], scheme_source[512], backend[96], data[512];
    char source[256], q_subsample[32]; /* the dump's metadata ("" when absent) */
    int layers, chunks, q_heads, kv_heads, head_dim;
    int64_t tokens, max_queries;
    int uses_qstats, pre_rope, q_pre_used;
    int warm, has_centroids;         /* warm start asked; a section has k-means (else warm changes nothing) */
    int sink, recent, span;
    int mixed;                       /* mixed precision: a channel map per layer from the table */
    char table[512];                 /* the table read ("" none) */
    int anchor_every, anchor_spans;  /* anchors: the scheme's period in chunks; anchor spans packed */
    double feedback_decay;           /* error feedback (0: off) */
    size_t qstats_bytes;             /* per layer, counted in stored_bytes */
    int peer;                        /* scored from a recon file (kvf_eval_run_peer) */
    char peer_text[256];             /* the recon's "peer" metadata */
    int n_parts;                     /* stored bytes by part, summed over layers */
    char part_name[KVF_RECON_MAX_PARTS][KVF_RECON_PART_NAME];
    double part_bytes[KVF_RECON_MAX_PARTS];
    /* NaN and infinities in the dump's tensors the run read (q, k, v; k_pre
     * and q_pre where the scheme reads them), each counted once. A layer with
     * any has undefined quality metrics (NaN), and so has the overall. */
    int64_t nonfinite_values, tensors_checked;
    int64_t nonfinite_by_role[KVF_DUMP_ROLES];
    int n_nonfinite;                 /* tensors holding some */
    kvf_eval_nonfinite *nonfinite;   /* [n_nonfinite], in reading order */
    int64_t *layer_nonfinite;        /* [layers] */
    /* warm start: spans encoded warm-started (a layer's second and later
     * spans, with k-means), and those a later step's queries scored */
    int warm_spans, warm_spans_scored;
    kvf_eval_metrics overall;
    kvf_eval_metrics *layer;         /* [layers] */
    kvf_eval_metrics *step;          /* [layers][chunks]; chunk 0 has no queries scored */
    double seconds;
} kvf_eval_report;

int kvf_eval_run(const kvf_scheme *s, const kvf_dump *dump, const kvf_eval_options *opt, kvf_eval_report *out);
/* The same streaming and metrics over a peer's recon file of this dump: at
 * every step the history is what the recon holds (chunks marked packed are
 * the decoded ones, the others must equal the dump bit for bit) and the
 * stored bytes are the recon's. opt->device, warm and recon_out are ignored. */
int kvf_eval_run_peer(const kvf_recon *recon, const kvf_dump *dump, const kvf_eval_options *opt, kvf_eval_report *out);
void kvf_eval_report_free(kvf_eval_report *r);

/* A table per layer and overall. */
void kvf_eval_print_table(const kvf_eval_report *r, FILE *out);
/* What is wrong with a run that succeeded, one "warning: ..." line each
 * (non-finite values in the dump; --warm that changed no score); returns how
 * many lines. */
int kvf_eval_print_warnings(const kvf_eval_report *r, FILE *out);
/* JSON text (Jansson) with "overall" and "layers"; malloc'ed, NULL on failure. */
char *kvf_eval_report_json(const kvf_eval_report *r);

#endif
