/*
 * `kvforge calibrate`: the sensitivity table of calibrated mixed precision
 * (docs/METHODS.md section 11, docs/FORMAT.md "Sensitivity table") from a KV
 * dump. Per layer, KV head and channel c:
 *   key score   E[q_c^2] * E[e_c^2]
 *   value score E[e_c^2]
 * where e is the scheme's quantization error on that channel (each
 * calibration chunk encoded and decoded alone, without mixed precision) and
 * q the queries of the KV head's query heads. A key error e changes a
 * query's logit by q . e / sqrt(d): its variance is the sum over channels of
 * E[q_c^2] E[e_c^2] / d for errors independent of the queries, so the key
 * score is each channel's share of the logit noise. A value error reaches
 * the output through the attention weights, the same for every channel of
 * a head, so the value score is the error itself. Fisher information would
 * weight by the loss's curvature, which a dump of K, V and Q does not give;
 * this is its attention-level stand-in.
 */
#include "calibrate.h"

#include "internal.h"

#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The scheme whose error is measured: the given one without its mixed
 * precision (the refinement is what the table decides), so the table does
 * not depend on itself. */
static int base_scheme(const kvf_scheme *s, struct kvf_scheme *b) {
    *b = *s;
    memset(b->pipe.mp_fraction, 0, sizeof b->pipe.mp_fraction);
    b->pipe.mp_table[0] = 0;
    /* Anchors and carried error need a stream; a chunk on its own is coded as it is. */
    b->pipe.anchor_every = 0;
    b->pipe.feedback_decay = 0;
    /* Keys cached before RoPE are stored, and refined, before RoPE: their
     * error is measured there (decode without RoPE), as the queries before it. */
    b->rope.placement = KVF_ROPE_NONE;
    return kvf_scheme_finalize(b);
}

static json_t *scores_json(const double *score, int layers, int heads, int d) {
    json_t *all = json_array();
    for (int l = 0; l < layers; l++) {
        json_t *lj = json_array();
        for (int h = 0; h < heads; h++) {
            json_t *hj = json_array();
            for (int c = 0; c < d; c++) json_array_append_new(hj, json_real(score[((size_t)l * heads + h) * d + c]));
            json_array_append_new(lj, hj);
        }
        json_array_append_new(all, lj);
    }
    return all;
}

int kvf_calibrate(const kvf_scheme *s, const kvf_dump *d, int first_chunk, int n_chunks, const char *out_path,
                  kvf_calibrate_progress progress, void *progress_arg) {
    if (!s || !d || !out_path) return kvf_set_error(KVF_EINVAL, "kvf_calibrate: NULL argument");
    if (!s->plan.sec[0].mp_channels && !s->plan.sec[1].mp_channels)
        return kvf_set_error(KVF_EINVAL, "scheme %s has no mixed precision: only a scheme with mixed_precision reads "
                             "a sensitivity table, and its table measures its own error", s->name);
    if (d->head_dim != s->head_dim)
        return kvf_set_error(KVF_EINVAL, "%s: head_dim = %d, scheme %s has head_dim = %d", kvf_st_label(d->file),
                             d->head_dim, s->name, s->head_dim);
    if (n_chunks <= 0) n_chunks = d->chunks - first_chunk;
    if (first_chunk < 0 || n_chunks < 1 || first_chunk + n_chunks > d->chunks)
        return kvf_set_error(KVF_EINVAL, "calibration chunks %d..%d: the dump has %d", first_chunk,
                             first_chunk + n_chunks - 1, d->chunks);
    struct kvf_scheme b;
    int rc = base_scheme(s, &b);
    if (rc) return rc;
    const int L = d->layers, H = d->kv_heads, Hq = d->q_heads, D = d->head_dim;
    const int64_t N = d->tokens;
    const int pre = s->rope.placement == KVF_ROPE_PRE;
    const size_t n = (size_t)H * (size_t)N * (size_t)D;
    size_t bytes;
    if ((rc = kvf_packed_size(&b, N, H, &bytes))) return rc;
    uint16_t *k = malloc(n * 2), *v = malloc(n * 2), *ko = malloc(n * 2), *vo = malloc(n * 2);
    uint8_t *packed = malloc(bytes);

    double *ek = calloc((size_t)L * H * D, sizeof(double)), *ev = calloc((size_t)L * H * D, sizeof(double)),
           *q2 = calloc((size_t)L * H * D, sizeof(double));
    double *qcount = calloc((size_t)L * H, sizeof(double));
    float *qf = NULL;
    if (!k || !v || !ko || !vo || !packed || !ek || !ev || !q2 || !qcount)
        rc = kvf_set_error(KVF_ENOMEM, "out of memory for the calibration");
    kvf_shape sh = {N, H, 0, 0};
    for (int l = 0; l < L && !rc; l++) {
        for (int c = first_chunk; c < first_chunk + n_chunks && !rc; c++) {
            const kvf_st_tensor *kt = kvf_dump_tensor(d, l, c, pre ? KVF_DUMP_K_PRE : KVF_DUMP_K);
            const kvf_st_tensor *vt = kvf_dump_tensor(d, l, c, KVF_DUMP_V);
            const kvf_st_tensor *qt = kvf_dump_tensor(d, l, c, pre ? KVF_DUMP_Q_PRE : KVF_DUMP_Q);
            if (!kt || !vt || !qt) {
                rc = kvf_set_error(KVF_EFORMAT, "%s: layer %d chunk %d lacks the %s, values or queries",
                                   kvf_st_label(d->file), l, c, pre ? "pre-RoPE keys" : "keys");
                break;
            }
            kvf_dump_bf16(kt, 0, n, k);
            kvf_dump_bf16(vt, 0, n, v);
            if ((rc = kvf_ref_encode(&b, k, v, &sh, NULL, packed, bytes)) ||
                (rc = kvf_ref_decode(&b, packed, bytes, &sh, NULL, ko, vo))) {
                rc = kvf_wrap_error(rc, "calibration, layer %d chunk %d", l, c);
                break;
            }
            for (int h = 0; h < H; h++)
                for (int64_t t = 0; t < N; t++)
                    for (int ch = 0; ch < D; ch++) {
                        const size_t i = ((size_t)h * N + (size_t)t) * D + (size_t)ch;
                        const size_t at = ((size_t)l * H + (size_t)h) * D + (size_t)ch;
                        const double x = kvf_bf16_to_f32(k[i]), y = kvf_bf16_to_f32(ko[i]);
                        const double a = kvf_bf16_to_f32(v[i]), bb = kvf_bf16_to_f32(vo[i]);
                        if (isfinite(x - y)) ek[at] += (x - y) * (x - y);
                        if (isfinite(a - bb)) ev[at] += (a - bb) * (a - bb);
                    }
            const int64_t nq = qt->shape[1];
            free(qf);
            qf = malloc((size_t)Hq * (size_t)nq * (size_t)D * sizeof(float));
            if (!qf) { rc = kvf_set_error(KVF_ENOMEM, "out of memory for the queries"); break; }
            kvf_dump_f32(qt, 0, (size_t)Hq * nq * D, qf);
            for (int hq = 0; hq < Hq; hq++) {
                const int h = hq / (Hq / H); /* grouped-query attention: query head hq reads KV head h */
                for (int64_t t = 0; t < nq; t++) {
                    const float *row = qf + ((size_t)hq * nq + (size_t)t) * D;
                    int finite = 1;
                    for (int ch = 0; ch < D; ch++) finite &= isfinite(row[ch]) != 0;
                    if (!finite) continue;
                    for (int ch = 0; ch < D; ch++) q2[((size_t)l * H + h) * D + ch] += (double)row[ch] * row[ch];
                    qcount[(size_t)l * H + h] += 1;
                }
            }
            if (progress) progress(progress_arg, l * n_chunks + (c - first_chunk) + 1, L * n_chunks);
        }
    }
    if (!rc) {
        const double per = (double)n_chunks * (double)N;
        double *ks = malloc((size_t)L * H * D * sizeof(double)), *vs = malloc((size_t)L * H * D * sizeof(double));
        if (!ks || !vs) rc = kvf_set_error(KVF_ENOMEM, "out of memory for the scores");
        for (size_t i = 0; !rc && i < (size_t)L * H * D; i++) {
            const double qn = qcount[i / (size_t)D];
            ks[i] = (qn > 0 ? q2[i] / qn : 1.0) * ek[i] / per;
            vs[i] = ev[i] / per;
        }
        if (!rc) {
            json_t *root = json_object();
            json_object_set_new(root, "format", json_string("kvforge-sensitivity"));
            json_object_set_new(root, "version", json_integer(1));
            json_object_set_new(root, "head_dim", json_integer(D));
            json_object_set_new(root, "kv_heads", json_integer(H));
            json_object_set_new(root, "layers", json_integer(L));
            json_object_set_new(root, "scheme", json_string(kvf_scheme_id(s)));
            json_object_set_new(root, "measured_with", json_string(kvf_scheme_canonical(&b)));
            json_object_set_new(root, "data", json_string(kvf_st_label(d->file)));
            json_object_set_new(root, "data_source", json_string(d->source ? d->source : ""));
            json_t *ch = json_array();
            for (int c = first_chunk; c < first_chunk + n_chunks; c++) json_array_append_new(ch, json_integer(c));
            json_object_set_new(root, "chunks", ch);
            json_object_set_new(root, "measure", json_string("key: E[q_c^2] * E[e_c^2]; value: E[e_c^2]; e the "
                                                             "scheme's quantization error without mixed precision"));
            json_object_set_new(root, "key", scores_json(ks, L, H, D));
            json_object_set_new(root, "value", scores_json(vs, L, H, D));
            char *text = json_dumps(root, JSON_INDENT(1) | JSON_REAL_PRECISION(9));
            json_decref(root);
            rc = text ? kvf_write_file(out_path, text, strlen(text)) : kvf_set_error(KVF_ENOMEM, "out of memory");
            free(text);
        }
        free(ks), free(vs);
    }
    free(k), free(v), free(ko), free(vo), free(packed), free(ek), free(ev), free(q2), free(qcount), free(qf);
    (void)pre;
    return rc;
}
