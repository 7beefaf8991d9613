/* Temporal anchors (docs/METHODS.md section 11): the scheme an anchor span is
 * stored with, and the checks of the anchor a span is coded against. */
#include "internal.h"

#include <stdlib.h>
#include <string.h>

/* The anchor scheme of s into *a (a struct, finalized): RTN at the anchor's
 * bits, fp16 scale and zero per group of s's size (BF16 rows at 16), the same
 * head_dim, RoPE and chunk policy, no other method. */
int kvf_anchor_scheme_of(const struct kvf_scheme *s, struct kvf_scheme *a) {
    if (!s || !s->pipe.anchor_every)
        return kvf_set_error(KVF_EINVAL, "scheme %s has no anchors", s ? s->name : "(NULL)");
    kvf_scheme_defaults(a);
    snprintf(a->name, sizeof a->name, "%.40s_anchor", s->name);
    snprintf(a->source, sizeof a->source, "%s", s->source);
    a->head_dim = s->head_dim;
    a->rope = s->rope;
    a->chunk = s->chunk;
    for (int t = 0; t < 2; t++) {
        kvf_tensor_cfg *c = t ? &a->value : &a->key;
        const kvf_tensor_cfg *src = t ? &s->value : &s->key;
        c->bits = s->pipe.anchor_bits;
        c->group_size = src->group_size;
        c->mode = KVF_MODE_AFFINE;
        c->scale_format = KVF_SCALE_FP16;
    }
    return kvf_scheme_finalize(a);
}

int kvf_scheme_anchor(const kvf_scheme *s, kvf_scheme **anchor) {
    if (!s || !anchor) return kvf_set_error(KVF_EINVAL, "kvf_scheme_anchor: NULL argument");
    *anchor = NULL;
    struct kvf_scheme *a = malloc(sizeof *a);
    if (!a) return kvf_set_error(KVF_ENOMEM, "out of memory for an anchor scheme");
    int rc = kvf_anchor_scheme_of(s, a);
    if (rc) { free(a); return rc; }
    *anchor = a;
    return KVF_OK;
}

int kvf_pipeline_args_check(const struct kvf_scheme *s, const kvf_layout *L, const void *packed, size_t packed_bytes,
                            const void *anchor, size_t anchor_bytes, int64_t anchor_n_tokens,
                            struct kvf_scheme *anchor_s, kvf_layout *AL, const char *fn) {
    if (!anchor) return KVF_OK;
    int rc = kvf_anchor_scheme_of(s, anchor_s);
    if (rc) return kvf_wrap_error(rc, "%s: an anchor was given", fn);
    if (anchor_n_tokens < 1)
        return kvf_set_error(KVF_EINVAL, "%s: the anchor has %lld tokens: at least 1", fn, (long long)anchor_n_tokens);
    if ((rc = kvf_layout_compute(anchor_s, anchor_n_tokens, L->n_heads, AL))) return kvf_wrap_error(rc, "%s", fn);
    if (anchor_bytes < AL->total_bytes)
        return kvf_set_error(KVF_ERANGE, "%s: the anchor has %zu bytes, %zu needed for %lld tokens x %d heads", fn,
                             anchor_bytes, AL->total_bytes, (long long)anchor_n_tokens, (int)L->n_heads);
    const uintptr_t a = (uintptr_t)anchor, o = (uintptr_t)packed; /* two buffers: compared as addresses */
    if (a < o + packed_bytes && o < a + AL->total_bytes)
        return kvf_set_error(KVF_EINVAL, "%s: the anchor overlaps the packed output", fn);
    return KVF_OK;
}
