/* The chunk policy (kvforge.h kvf_chunk_policy): the one place that says
 * which chunks of a layer's stream are packed together, and when. The
 * evaluation (eval/eval.c) and the Python cache (python/kvforge/cache.py)
 * both ask it. */
#include "internal.h"

#include <string.h>

int kvf_chunk_policy(const kvf_scheme *s, int64_t t, kvf_chunk_step *out) {
    if (!s || !out) return kvf_set_error(KVF_EINVAL, "kvf_chunk_policy: NULL argument");
    if (t < 0) return kvf_set_error(KVF_EINVAL, "kvf_chunk_policy: chunk %lld: must be >= 0", (long long)t);
    memset(out, 0, sizeof *out);
    out->pack_first = out->warm_first = -1;
    const int64_t span = s->chunk.span, recent = s->chunk.recent, sink = s->chunk.sink;
    out->sink = t < sink;
    /* Span k (chunks sink + k span .. sink + (k + 1) span - 1) is packed once
     * its last chunk has left the recent window: after chunk last + recent. */
    const int64_t last = t - recent;
    out->anchor_first = -1;
    if (last < sink || (last - sink + 1) % span) return KVF_OK;
    out->pack_first = last - span + 1;
    out->pack_chunks = (int32_t)span;
    const int64_t k = (out->pack_first - sink) / span;
    /* Anchors every `every` chunks (a multiple of span: the plan's rule), the
     * stream's first span among them; a span between two is coded against the
     * last one before it. The span after an anchor starts a new chain of
     * carried error. The warm start reads a span of the same scheme only. */
    const int64_t per = s->pipe.anchor_every > 0 ? s->pipe.anchor_every / span : 0;
    const int prev_is_anchor = per > 0 && k >= 1 && (k - 1) % per == 0;
    if (per > 0 && k % per == 0) {
        out->anchor = 1;
    } else if (per > 0) {
        out->anchor_first = sink + (k - k % per) * span;
        out->anchor_chunks = (int32_t)span;
    }
    out->feedback_in = s->pipe.feedback_decay > 0 && k >= 1 && !out->anchor && !prev_is_anchor;
    if (k >= 1 && !out->anchor && !prev_is_anchor) {
        out->warm_first = out->pack_first - span;
        out->warm_chunks = (int32_t)span;
    }
    return KVF_OK;
}
