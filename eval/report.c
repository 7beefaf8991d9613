/* Evaluation reports: a table, and JSON built with Jansson (eval.h). */
#include "eval.h"

#include <jansson.h>
#include <math.h>
#include <stdlib.h>

/* ------------------------------------------------------------- warnings */

#define MAX_WARNINGS 3
#define WARNING_LEN 768

static const char *value_name(float x) { return isnan(x) ? "NaN" : x > 0 ? "+inf" : "-inf"; }

/* The warnings of a run, in lines[]; returns how many. */
static int warnings_of(const kvf_eval_report *r, char lines[MAX_WARNINGS][WARNING_LEN]) {
    int n = 0;
    if (r->nonfinite_values > 0) {
        char *w = lines[n++];
        int o = snprintf(w, WARNING_LEN, "the dump holds %lld NaN or infinite value%s in %d of the %lld tensors read (",
                         (long long)r->nonfinite_values, r->nonfinite_values > 1 ? "s" : "", r->n_nonfinite,
                         (long long)r->tensors_checked);
        for (int role = 0, any = 0; role < KVF_DUMP_ROLES && o < WARNING_LEN; role++)
            if (r->nonfinite_by_role[role]) {
                o += snprintf(w + o, WARNING_LEN - o, "%s%s: %lld", any ? ", " : "", kvf_dump_role_name(role),
                              (long long)r->nonfinite_by_role[role]);
                any = 1;
            }
        const kvf_eval_nonfinite *f = &r->nonfinite[0];
        if (o < WARNING_LEN)
            o += snprintf(w + o, WARNING_LEN - o, "); first: tensor %s, head %d, token %lld, channel %d (%s); "
                          "undefined (null) quality metrics for layer%s",
                          f->tensor, f->head, (long long)f->token, f->channel, value_name(f->first),
                          r->layers > 1 ? "s" : "");
        for (int l = 0, shown = 0; l < r->layers && o < WARNING_LEN; l++)
            if (r->layer_nonfinite && r->layer_nonfinite[l]) {
                if (shown == 8) { o += snprintf(w + o, WARNING_LEN - o, " ..."); break; }
                o += snprintf(w + o, WARNING_LEN - o, "%s %d", shown ? "," : "", l);
                shown++;
            }
        if (o < WARNING_LEN) snprintf(w + o, WARNING_LEN - o, " and overall");
    }
    if (r->warm && !r->has_centroids)
        snprintf(lines[n++], WARNING_LEN,
                 "--warm changed nothing: scheme %s has no k-means (no centroids) to warm-start", r->scheme_id);
    else if (r->warm && r->warm_spans_scored == 0)
        snprintf(lines[n++], WARNING_LEN,
                 "--warm changed no score: %d span%s of %d chunk%s %s warm-started, none scored by a later chunk's "
                 "queries (a layer's first span is encoded cold; a span packed after the last chunk is never scored)",
                 r->warm_spans, r->warm_spans == 1 ? "" : "s", r->chunks, r->chunks == 1 ? "" : "s",
                 r->warm_spans == 1 ? "was" : "were");
    return n;
}

int kvf_eval_print_warnings(const kvf_eval_report *r, FILE *out) {
    char lines[MAX_WARNINGS][WARNING_LEN];
    int n = warnings_of(r, lines);
    for (int i = 0; i < n; i++) fprintf(out, "warning: %s\n", lines[i]);
    return n;
}

/* ---------------------------------------------------------------- table */

/* One number right-aligned in width columns ('f' or 'e', 4 digits), "-" for NaN. */
static void cell(FILE *out, double x, int width, char style) {
    if (isnan(x)) fprintf(out, " %*s", width, "-");
    else if (style == 'f') fprintf(out, " %*.4f", width, x);
    else fprintf(out, " %*.4e", width, x);
}

static void table_row(FILE *out, const char *label, const kvf_eval_metrics *m) {
    fprintf(out, "%-8s", label);
    cell(out, m->top1_shift, 12, 'f');
    cell(out, m->top5_overlap, 12, 'f');
    cell(out, m->attn_out_rel_err, 16, 'e');
    cell(out, m->key_mse, 12, 'e');
    cell(out, m->value_mse, 12, 'e');
    cell(out, m->qk_err, 12, 'e');
    if (isnan(m->compression)) fprintf(out, " %12s", "-");
    else fprintf(out, " %11.3fx", m->compression);
    fputc('\n', out);
}

void kvf_eval_print_table(const kvf_eval_report *r, FILE *out) {
    if (r->peer) {
        fprintf(out, "peer:    %s (%s)\n", r->scheme_id, r->scheme_source);
        if (*r->peer_text) fprintf(out, "         %s\n", r->peer_text);
    } else {
        fprintf(out, "scheme:  %s (%s)\n", r->scheme_id, r->scheme_source);
    }
    fprintf(out, "data:    %s: %d layers x %d chunks x %lld tokens, %d query heads / %d KV heads, d = %d, "
                 "up to %lld queries per chunk and head\n",
            r->data, r->layers, r->chunks, (long long)r->tokens, r->q_heads, r->kv_heads, r->head_dim,
            (long long)r->max_queries);
    if (*r->source || *r->q_subsample)
        fprintf(out, "         source: %s; q_subsample: %s\n", *r->source ? r->source : "-",
                *r->q_subsample ? r->q_subsample : "-");
    fprintf(out, "policy:  sink %d, recent %d, span %d chunks; ", r->sink, r->recent, r->span);
    if (r->peer)
        fprintf(out, "as the peer ran it; history as the recon file holds it\n");
    else if (r->uses_qstats)
        fprintf(out, "keys cached %s; query statistics from %s queries, %zu bytes per layer (counted)\n",
                r->pre_rope ? "before RoPE (k_pre, decoded with pos)" : "after RoPE (k)",
                r->q_pre_used ? "pre-RoPE (q_pre)" : "post-RoPE (q)", r->qstats_bytes);
    else
        fprintf(out, "keys cached %s; no query statistics\n",
                r->pre_rope ? "before RoPE (k_pre, decoded with pos)" : "after RoPE (k)");
    if (r->warm)
        fprintf(out, "         k-means warm-started from the layer's previous span%s\n",
                !r->has_centroids ? " (asked; the scheme has no k-means, so nothing changes)"
                : r->warm_spans_scored ? "" : " (asked; no warm-started span was scored)");
    if (r->anchor_every || r->feedback_decay > 0 || r->mixed) {
        fprintf(out, "         pipeline:");
        if (r->anchor_every) fprintf(out, " an anchor every %d chunks (%d anchor spans);", r->anchor_every, r->anchor_spans);
        if (r->feedback_decay > 0) fprintf(out, " error feedback, decay %g;", r->feedback_decay);
        if (r->mixed) fprintf(out, " channel maps from %s", r->table);
        fprintf(out, "\n");
    }
    fprintf(out, "backend: %s, %.2f s\n", r->backend, r->seconds);
    if (r->nonfinite_values)
        fprintf(out, "inputs:  %lld NaN or infinite values in %d of %lld tensors read: quality metrics undefined "
                     "(\"-\") where they entered\n",
                (long long)r->nonfinite_values, r->n_nonfinite, (long long)r->tensors_checked);
    fprintf(out, "stored:  ");
    for (int i = 0; i < r->n_parts; i++)
        fprintf(out, "%s%s %.0f B", i ? ", " : "", r->part_name[i], r->part_bytes[i]);
    fprintf(out, "%s\n", r->n_parts ? " (all layers, end of stream)" : "-");
    if (!isnan(r->overall.compression_held))
        fprintf(out, "held:    %.3fx of BF16 on average over the steps (BF16 bytes over the bytes the cache holds, "
                     "each summed over the steps)\n",
                r->overall.compression_held);
    fputc('\n', out);
    fprintf(out, "%-8s %12s %12s %16s %12s %12s %12s %12s\n", "layer", "top1_shift", "top5_overlap", "attn_out_rel_err",
            "key_mse", "value_mse", "qk_err", "compression");
    char label[16];
    for (int l = 0; l < r->layers; l++) {
        snprintf(label, sizeof label, "%d", l);
        table_row(out, label, &r->layer[l]);
    }
    table_row(out, "overall", &r->overall);
}

/* ----------------------------------------------------------------- JSON */

/* A number, or null where it is undefined (NaN: nothing to average) or infinite. */
static json_t *num(double x) { return isfinite(x) ? json_real(x) : json_null(); }

/* The seven metrics; with_bytes adds the compression (not per step). */
static json_t *metrics_json(const kvf_eval_metrics *m, int with_bytes) {
    json_t *o = json_pack("{s:o, s:o, s:o, s:o, s:o, s:o, s:I, s:I, s:I}", "top1_shift", num(m->top1_shift),
                          "top5_overlap", num(m->top5_overlap), "attn_out_rel_err", num(m->attn_out_rel_err),
                          "key_mse", num(m->key_mse), "value_mse", num(m->value_mse), "qk_err", num(m->qk_err),
                          "queries", (json_int_t)m->queries, "packed_values", (json_int_t)m->kv_values,
                          "packed_key_tokens", (json_int_t)m->key_tokens);
    if (o && with_bytes &&
        (json_object_set_new(o, "compression", num(m->compression)) ||
         json_object_set_new(o, "compression_held", num(m->compression_held)) ||
         json_object_set_new(o, "bf16_bytes", json_integer((json_int_t)m->bf16_bytes)) ||
         json_object_set_new(o, "stored_bytes", json_integer((json_int_t)m->stored_bytes)))) {
        json_decref(o);
        return NULL;
    }
    return o;
}

static json_t *layer_json(const kvf_eval_report *r, int l) {
    json_t *o = metrics_json(&r->layer[l], 1), *steps = json_array();
    if (!o || !steps || json_object_set_new(o, "layer", json_integer(l)) ||
        json_object_set_new(o, "nonfinite", json_integer(r->layer_nonfinite ? (json_int_t)r->layer_nonfinite[l] : 0)))
        goto fail;
    for (int c = 1; c < r->chunks; c++) {
        json_t *s = metrics_json(&r->step[(size_t)l * r->chunks + c], 0);
        if (!s || json_object_set_new(s, "chunk", json_integer(c)) || json_array_append_new(steps, s)) goto fail;
    }
    if (json_object_set_new(o, "chunks", steps)) { steps = NULL; goto fail; }
    return o;
fail:
    json_decref(steps);
    json_decref(o);
    return NULL;
}

/* {"values", "tensors_checked", "by_role": {...}, "tensors": [{tensor, count, first: {...}}]} */
static json_t *nonfinite_json(const kvf_eval_report *r) {
    json_t *o = json_pack("{s:I, s:I}", "values", (json_int_t)r->nonfinite_values, "tensors_checked",
                          (json_int_t)r->tensors_checked);
    json_t *roles = json_object(), *list = json_array();
    for (int i = 0; roles && i < KVF_DUMP_ROLES; i++)
        if (json_object_set_new(roles, kvf_dump_role_name(i), json_integer((json_int_t)r->nonfinite_by_role[i])))
            goto fail;
    for (int i = 0; list && i < r->n_nonfinite; i++) {
        const kvf_eval_nonfinite *f = &r->nonfinite[i];
        json_t *e = json_pack("{s:s, s:I, s:{s:i, s:I, s:i, s:s}}", "tensor", f->tensor, "count", (json_int_t)f->count,
                              "first", "head", f->head, "token", (json_int_t)f->token, "channel", f->channel, "value",
                              value_name(f->first));
        if (json_array_append_new(list, e)) goto fail;
    }
    if (!o || !roles || !list) goto fail;
    json_object_set_new(o, "by_role", roles);
    json_object_set_new(o, "tensors", list);
    return o;
fail:
    json_decref(o);
    json_decref(roles);
    json_decref(list);
    return NULL;
}

char *kvf_eval_report_json(const kvf_eval_report *r) {
    json_t *layers = json_array();
    for (int l = 0; layers && l < r->layers; l++)
        if (json_array_append_new(layers, layer_json(r, l))) { json_decref(layers); layers = NULL; }
    if (!layers) return NULL;
    json_t *root = json_pack(
        "{s:s, s:s, s:s, s:s, s:f, s:{s:i, s:i, s:i, s:i, s:i, s:I, s:I, s:s, s:s}, s:{s:i, s:i, s:i, s:s, s:s, s:I, s:b}, s:o, s:o}",
        "scheme", r->scheme_id, "scheme_source", r->scheme_source, "data", r->data, "backend", r->backend,
        "seconds", r->seconds, "dump", "layers", r->layers, "chunks", r->chunks, "q_heads", r->q_heads, "kv_heads",
        r->kv_heads, "head_dim", r->head_dim, "tokens_per_chunk", (json_int_t)r->tokens, "max_queries",
        (json_int_t)r->max_queries, "source", r->source, "q_subsample", r->q_subsample, "policy", "sink", r->sink, "recent", r->recent, "span", r->span, "keys",
        r->pre_rope ? "k_pre" : "k", "query_statistics", !r->uses_qstats ? "none" : r->q_pre_used ? "q_pre" : "q",
        "qstats_bytes_per_layer", (json_int_t)(r->uses_qstats ? r->qstats_bytes : 0), "warm_start", r->warm, "overall",
        metrics_json(&r->overall, 1), "layers", layers);
    if (!root) return NULL;
    json_t *parts = json_object();
    for (int i = 0; parts && i < r->n_parts; i++)
        if (json_object_set_new(parts, r->part_name[i], json_integer((json_int_t)r->part_bytes[i]))) {
            json_decref(parts);
            parts = NULL;
        }
    char lines[MAX_WARNINGS][WARNING_LEN];
    const int n_warn = warnings_of(r, lines);
    json_t *warnings = json_array();
    for (int i = 0; warnings && i < n_warn; i++)
        if (json_array_append_new(warnings, json_string(lines[i]))) { json_decref(warnings); warnings = NULL; }
    json_t *policy = json_object_get(root, "policy");
    if (!warnings || json_object_set_new(root, "warnings", warnings) ||
        json_object_set_new(root, "nonfinite", nonfinite_json(r)) ||
        json_object_set_new(policy, "warm_spans", json_integer(r->warm_spans)) ||
        json_object_set_new(policy, "warm_spans_scored", json_integer(r->warm_spans_scored)) ||
        json_object_set_new(policy, "anchor_every", json_integer(r->anchor_every)) ||
        json_object_set_new(policy, "anchor_spans", json_integer(r->anchor_spans)) ||
        json_object_set_new(policy, "feedback_decay", json_real(r->feedback_decay)) ||
        json_object_set_new(policy, "table", r->mixed ? json_string(r->table) : json_null())) {
        json_decref(parts);
        json_decref(root);
        return NULL;
    }
    if (!parts || json_object_set_new(root, "stored_bytes_parts", parts) ||
        json_object_set_new(root, "kind", json_string(r->peer ? "peer" : "scheme")) ||
        (r->peer && json_object_set_new(root, "peer", json_string(r->peer_text)))) {
        json_decref(root);
        return NULL;
    }
    char *text = json_dumps(root, JSON_INDENT(2) | JSON_REAL_PRECISION(10));
    json_decref(root);
    return text;
}
