/* kvf_scheme_get_info: a scheme's fields for callers that cannot read struct kvf_scheme;
 * kvf_rope_sections, shared with the GPU decode's RoPE argument. */
#include "internal.h"

#include <string.h>

_Static_assert(sizeof((kvf_scheme_info *)0)->rope_sections == sizeof(int) * KVF_MAX_ROPE_SECTIONS,
               "kvf_scheme_info.rope_sections holds what kvf_rope_sections writes");

int kvf_scheme_get_info(const kvf_scheme *s, kvf_scheme_info *out) {
    if (!s || !out) return kvf_set_error(KVF_EINVAL, "kvf_scheme_get_info: NULL argument");
    memset(out, 0, sizeof *out);
    out->head_dim = s->head_dim;
    out->key_bits = s->key.bits;
    out->value_bits = s->value.bits;
    out->chunk_tokens = s->chunk.tokens;
    out->chunk_span = s->chunk.span;
    out->chunk_recent = s->chunk.recent;
    out->chunk_sink = s->chunk.sink;
    out->rope_placement = s->rope.placement;
    out->rope_layout = s->rope.layout;
    out->rope_theta = s->rope.theta;
    out->psac_rank = s->key.psac_rank;
    out->key_centroids = s->key.centroids;
    out->key_qsac_candidates = s->key.qsac_candidates;
    out->rope_axes = kvf_rope_sections(s, out->rope_sections);
    const kvf_plan *pl = &s->plan;
    for (int sec = 0; sec < 2; sec++) {
        out->outliers[sec] = pl->sec[sec].outliers;
        out->mixed_channels[sec] = pl->sec[sec].mp_channels;
    }
    out->anchor_every = s->pipe.anchor_every;
    out->anchor_bits = s->pipe.anchor_bits;
    out->feedback_decay = s->pipe.feedback_decay;
    return KVF_OK;
}

int kvf_rope_sections(const struct kvf_scheme *s, int sections[KVF_MAX_ROPE_SECTIONS]) {
    const int n = s->rope.n_sections < 1 ? 1 : s->rope.n_sections;
    if (!sections) return n;
    memset(sections, 0, sizeof(int) * KVF_MAX_ROPE_SECTIONS);
    if (s->rope.n_sections < 1) sections[0] = s->head_dim / 2;
    for (int i = 0; i < s->rope.n_sections && i < KVF_MAX_ROPE_SECTIONS; i++) sections[i] = s->rope.sections[i];
    return n;
}
