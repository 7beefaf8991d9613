/*
 * The plan: every rule between a scheme's fields, checked once, and what
 * follows from them for the kernels (docs/ARCHITECTURE.md). The loader and
 * kvf_scheme_finalize call kvf_plan_build; the generator prints the plan,
 * the context launches it, the CPU reference and the layout read it, so no
 * other place decides a path, a template argument or which kernels exist.
 */
#include "internal.h"

#include <stdarg.h>

const char *const kvf_role_names[KVF_ROLE_COUNT] = {
    "header", "encode_k", "encode_v", "decode_kv",
    "k_prep", "k_init", "k_assign", "k_assign_qsac", "k_accumulate", "k_finalize", "k_pad", "k_subtract",
    "k_residual",
    "v_prep", "v_init", "v_assign", "v_assign_qsac", "v_accumulate", "v_finalize", "v_pad", "v_subtract",
    "v_residual",
    "qstats_init", "qstats_accumulate", "qstats_eigen", "psac_basis", "psac_encode", "qsac_weights",
};

/* ------------------------------------------------------------------ rules */

typedef struct rules {
    const struct kvf_scheme *s;
    const kvf_plan_blame *blame;
} rules;

static int report(const rules *r, const char *field, const char *msg, const char *other, const char *other_msg) {
    if (r->blame && r->blame->report) return r->blame->report(r->blame->arg, field, msg, other, other_msg);
    const struct kvf_scheme *s = r->s;
    return kvf_set_error(KVF_ESCHEME, "%s: %s: %s", s->source[0] ? s->source : s->name[0] ? s->name : "scheme",
                         field, msg);
}

/* A rule on one field of a tensor section: "<sec>.<name>". */
static int bad(const rules *r, const char *sec, const char *name, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int bad(const rules *r, const char *sec, const char *name, const char *fmt, ...) {
    char field[64], msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(field, sizeof field, "%s%s%s", sec, *sec ? "." : "", name);
    return report(r, field, msg, NULL, NULL);
}

/* A rule tying two fields of a section: each with the message that blames it. */
static int conflict(const rules *r, const char *sec, const char *a, const char *msg_a, const char *b,
                    const char *msg_b) {
    char fa[64], fb[64];
    snprintf(fa, sizeof fa, "%s.%s", sec, a);
    snprintf(fb, sizeof fb, "%s.%s", sec, b);
    return report(r, fa, msg_a, fb, msg_b);
}

static int is_pow2(int x) { return x > 0 && (x & (x - 1)) == 0; }

/* Groups: where they run and what they may hold. */
static int check_groups(const rules *r, const char *sec, const kvf_tensor_cfg *t) {
    const struct kvf_scheme *s = r->s;
    const long long span = (long long)s->chunk.tokens * s->chunk.span;
    if (t->bits == 16) return KVF_OK; /* rows kept as they are: no groups */
    if (t->axis == KVF_AXIS_CHANNEL && s->head_dim % t->group_size)
        return bad(r, sec, "group_size", "must divide head_dim (%d) when axis = \"channel\" (got %d)", s->head_dim,
                   t->group_size);
    if (t->axis == KVF_AXIS_TOKEN && t->centroids != 0)
        return bad(r, sec, "centroids",
                   "must be 0 when axis = \"token\" (per-channel groups quantize the values themselves, without "
                   "smoothing) (got %d)", t->centroids);
    if (t->axis == KVF_AXIS_TOKEN && t->scale_format != KVF_SCALE_FP16)
        return bad(r, sec, "scale_format",
                   "must be \"fp16\" when axis = \"token\" (its scales are per channel and group of tokens) (got \"%s\")",
                   t->scale_format == KVF_SCALE_FP8 ? "fp8" : "int8_fp16");
    if (t->scale_format == KVF_SCALE_INT8_FP16 && s->head_dim / t->group_size > 256)
        return bad(r, sec, "group_size", "at most 256 groups per token with two-level scales (got %d)",
                   t->group_size);
    if (t->centroids > span)
        return bad(r, sec, "centroids",
                   "must be <= chunk.tokens * chunk.span (%lld): k-means needs a token per centroid (got %d)", span,
                   t->centroids);
    if (t->rotation == KVF_ROTATION_HADAMARD && !is_pow2(s->head_dim))
        return bad(r, sec, "rotation", "\"hadamard\" needs a power-of-two head_dim (got %d)", s->head_dim);
    return KVF_OK;
}

/* The methods a section combines. */
static int check_methods(const rules *r, const char *sec, const kvf_tensor_cfg *t, int is_key) {
    const struct kvf_scheme *s = r->s;
    if (t->mode == KVF_MODE_TERNARY && t->bits != 2)
        return bad(r, sec, "mode",
                   "\"ternary\" stores the three levels of symmetric INT2: it needs bits = 2 (got bits = %d)",
                   t->bits);
    if (t->mode == KVF_MODE_TERNARY && t->axis != KVF_AXIS_CHANNEL)
        return bad(r, sec, "mode", "\"ternary\" packs the codes of a row: it needs axis = \"channel\" (got \"token\")");
    if (t->bits == 16 && t->centroids > 0)
        return bad(r, sec, "centroids", "must be 0 when bits = 16 (BF16 values are kept as they are) (got %d)",
                   t->centroids);
    if (t->centroids == 0 && t->qsac_candidates > 1)
        return bad(r, sec, "qsac_candidates", "must be 1 when centroids = 0 (QSAC chooses among centroids) (got %d)",
                   t->qsac_candidates);
    if (t->qsac_candidates > t->centroids && t->centroids > 0)
        return bad(r, sec, "qsac_candidates", "must be <= centroids (%d) (got %d)", t->centroids, t->qsac_candidates);
    if (t->kmeans_labels == KVF_LABELS_LAST_STEP && t->centroids > 0 && t->kmeans_iters == 0)
        return conflict(r, sec, "kmeans_labels",
                        "must be \"final\" when kmeans_iters = 0 (\"last_step\" takes the labels of the last Lloyd "
                        "step) (got \"last_step\")",
                        "kmeans_iters",
                        "must be >= 1 when kmeans_labels = \"last_step\" (the labels of the last Lloyd step) (got 0)");
    if (t->kmeans_labels == KVF_LABELS_LAST_STEP && t->qsac_candidates > 1) {
        char got[200];
        snprintf(got, sizeof got,
                 "must be 1 when kmeans_labels = \"last_step\" (QSAC is a final assignment: set kmeans_labels = "
                 "\"final\") (got %d)", t->qsac_candidates);
        return conflict(r, sec, "kmeans_labels",
                        "must be \"final\" when qsac_candidates > 1 (QSAC is the final assignment) (got \"last_step\")",
                        "qsac_candidates", got);
    }
    if (t->stages > 1 && t->centroids == 0)
        return bad(r, sec, "stages",
                   "must be 1 when centroids = 0 (progressive stages smooth each residual with centroids) (got %d)",
                   t->stages);
    if (!is_key && t->psac_rank != 0)
        return bad(r, sec, "psac_rank", "must be 0 in value: values get no PSAC (got %d)", t->psac_rank);
    if (t->psac_rank >= s->head_dim)
        return bad(r, sec, "psac_rank", "must be < head_dim (%d) (got %d)", s->head_dim, t->psac_rank);
    if (t->bits == 16 && t->psac_rank > 0)
        return bad(r, sec, "psac_rank",
                   "must be 0 when bits = 16 (there is no quantization error to compensate) (got %d)", t->psac_rank);
    return KVF_OK;
}

/* The pipeline's options: where they apply and what they combine with. */
static int check_pipeline(const rules *r) {
    const struct kvf_scheme *s = r->s;
    const kvf_pipeline_cfg *p = &s->pipe;
    const int anchors = p->anchor_every > 0, feedback = p->feedback_decay > 0;
    for (int t = 0; t < 2; t++) {
        const char *sec = t ? "value" : "key";
        const kvf_tensor_cfg *c = t ? &s->value : &s->key;
        const int k = p->outliers[t], mp = p->mp_fraction[t] > 0;
        if (!k && !mp && !anchors && !feedback) continue;
        const char *what = k ? "outliers" : mp ? "mixed_precision" : anchors ? "anchors" : "error_feedback";
        char field[64];
        snprintf(field, sizeof field, "%s.%s", what, !k && !mp ? (anchors ? "every" : "decay") : sec);
        if (c->bits == 16)
            return report(r, field, "applies to quantized sections only (this section has bits = 16)", NULL, NULL);
        if (c->axis == KVF_AXIS_TOKEN)
            return report(r, field, "needs groups along channels (this section has axis = \"token\")", NULL, NULL);
        if (c->rotation != KVF_ROTATION_NONE)
            return report(r, field, "cannot be combined with rotation = \"hadamard\" (the pipeline works on "
                                    "the values as stored)", NULL, NULL);
        if (c->psac_rank > 0)
            return report(r, field, "cannot be combined with key.psac_rank > 0 (PSAC fits the error the pipeline "
                                    "changes)", NULL, NULL);
        if (feedback && c->stages > 1)
            return report(r, "error_feedback.decay",
                          "needs stages = 1 (the carried error is taken from the one stage's reconstruction)", NULL,
                          NULL);
        if (k >= s->head_dim)
            return bad(r, "outliers", sec, "must be below head_dim (%d) (got %d)", s->head_dim, k);
        if (mp) {
            const int m = (int)(p->mp_fraction[t] * s->head_dim / 8 + 0.5) * 8;
            if (m < 8)
                return bad(r, "mixed_precision", t ? "value_fraction" : "key_fraction",
                           "refines %g x head_dim channels, rounded to a multiple of 8: none (got %g)",
                           p->mp_fraction[t], p->mp_fraction[t]);
            if (m >= s->head_dim)
                return bad(r, "mixed_precision", t ? "value_fraction" : "key_fraction",
                           "leaves no channel at the base precision (%d of %d refined) (got %g)", m, s->head_dim,
                           p->mp_fraction[t]);
        }
    }
    if (anchors && p->anchor_every % s->chunk.span)
        return bad(r, "anchors", "every", "must be a multiple of chunk.span (%d): anchors are whole spans (got %d)",
                   s->chunk.span, p->anchor_every);
    return KVF_OK;
}

static int check_rope(const rules *r) {
    const struct kvf_scheme *s = r->s;
    int sum = 0;
    for (int k = 0; k < s->rope.n_sections; k++) sum += s->rope.sections[k];
    if (sum != s->head_dim / 2)
        return bad(r, "rope", "sections", "must add up to head_dim / 2 (%d) frequency pairs (got %d)",
                   s->head_dim / 2, sum);
    return KVF_OK;
}

/* What the kernels of templates/ cannot do although the scheme is valid: the
 * CPU backend runs it, a GPU context and the generator refuse it. */
static void check_gpu(const struct kvf_scheme *s, kvf_plan *p) {
    const int r = s->key.psac_rank;
    p->gpu_status = KVF_ENOTIMPL;
    if (r > 0 && (r > 32 || !is_pow2(r)))
        snprintf(p->gpu_reason, sizeof p->gpu_reason,
                 "key.psac_rank = %d: the GPU PSAC kernel needs a power of two up to 32 (the CPU backend, "
                 "KVF_DEVICE_CPU, takes any rank)", r);
    /* The statistics kernel holds U and M U of a head in static shared
     * memory (2 x d x r f32, within 48 KB). */
    else if (r > 0 && s->head_dim * r > 4096)
        snprintf(p->gpu_reason, sizeof p->gpu_reason,
                 "key.psac_rank = %d with head_dim = %d: the GPU statistics kernel needs head_dim x psac_rank <= "
                 "4096 (the CPU backend, KVF_DEVICE_CPU, takes any rank)", r, s->head_dim);
    else if (s->value.qsac_candidates > 1)
        snprintf(p->gpu_reason, sizeof p->gpu_reason,
                 "value.qsac_candidates = %d: the GPU encoder runs QSAC for keys only (the CPU backend, "
                 "KVF_DEVICE_CPU, has it for values, with w = 1)", s->value.qsac_candidates);
    else
        p->gpu_status = KVF_OK;
}

/* ------------------------------------------------------------- derivation */

static int path_of(const kvf_tensor_cfg *t) {
    if (t->bits == 16) return KVF_PATH_ROWS;
    if (t->axis == KVF_AXIS_TOKEN) return KVF_PATH_TOKEN_GROUPS;
    if (t->centroids > 0 || t->psac_rank > 0 || t->stages > 1) return KVF_PATH_KMEANS;
    return KVF_PATH_ROWS;
}

/* A section's template arguments. Bits 16 keeps rows as they are: its other
 * fields are not read and take fixed values (the layout's), so they cannot
 * make two equal sections differ. */
static void section_of(const struct kvf_scheme *s, const kvf_tensor_cfg *t, int is_key, kvf_section_plan *o) {
    const int q = t->bits < 16;
    memset(o, 0, sizeof *o);
    o->path = path_of(t);
    o->bits = t->bits;
    o->group = q ? t->group_size : 8;
    o->mode = q ? t->mode : KVF_MODE_AFFINE;
    o->scale_format = q ? t->scale_format : KVF_SCALE_FP16;
    o->axis = q ? t->axis : KVF_AXIS_CHANNEL;
    o->centroids = q ? t->centroids : 0;
    o->stages = q ? t->stages : 1;
    o->rotation = q ? t->rotation : KVF_ROTATION_NONE;
    o->psac_rank = q ? t->psac_rank : 0;
    o->decode_rope = !is_key || s->rope.placement != KVF_ROPE_PRE ? KVF_DECODE_ROPE_NONE
                     : s->rope.layout == KVF_ROPE_INTERLEAVED     ? KVF_DECODE_ROPE_INTERLEAVED
                                                                  : KVF_DECODE_ROPE_HALF;
    /* Values choose the nearest centroid (QSAC for values is the CPU's alone: check_gpu). */
    o->qsac = is_key && q ? t->qsac_candidates : 1;
    o->bf16_source = o->rotation != KVF_ROTATION_HADAMARD && o->stages == 1;
    /* The fast assignment keeps at most 8 keys a list: QSAC over more
     * candidates takes the exact one (docs/METHODS.md 3, fast assignment). */
    o->exact = q && (t->assign == KVF_ASSIGN_EXACT || o->qsac > 8);
    o->kmeans_owner = is_key ? 0 : 1;
    /* A decode block loads its next tile's centroid indices while it decodes
     * this one, and its head's PSAC basis once: more tiles a block help
     * there (docs/BENCHMARKS.md, decode tiles). */
    o->decode_tiles = o->centroids > 0 || o->psac_rank > 0 ? 4 : 2;
    const kvf_pipeline_cfg *pp = &s->pipe;
    const int sec = is_key ? 0 : 1;
    if (q) {
        o->outliers = pp->outliers[sec];
        o->mp_channels = pp->mp_fraction[sec] > 0 ? (int)(pp->mp_fraction[sec] * s->head_dim / 8 + 0.5) * 8 : 0;
        o->mp_bits = o->mp_channels ? pp->mp_refine_bits : 0;
        o->anchor_bits = pp->anchor_every > 0 ? pp->anchor_bits : 0;
        o->feedback = pp->feedback_decay > 0;
        /* A reference or a carried error changes what is quantized: the
         * k-means path prepares it in its f32 workspace. */
        if (o->anchor_bits || o->feedback) o->bf16_source = 0;
    }
}

/* The value section runs the key section's k-means kernels where their
 * template arguments (QSAC aside: values never run it) are equal, so NVRTC
 * compiles them once. */
static int same_kmeans(const kvf_section_plan *k, const kvf_section_plan *v) {
    return k->path == KVF_PATH_KMEANS && v->path == KVF_PATH_KMEANS && k->rotation == v->rotation &&
           k->group == v->group && k->bits == v->bits && k->mode == v->mode && k->scale_format == v->scale_format &&
           k->centroids == v->centroids && k->bf16_source == v->bf16_source && k->outliers == v->outliers &&
           k->mp_channels == v->mp_channels && k->mp_bits == v->mp_bits && k->anchor_bits == v->anchor_bits &&
           k->feedback == v->feedback && k->exact == v->exact;
}

static void kernels_of(kvf_plan *p) {
    memset(p->has, 0, sizeof p->has);
    p->has[KVF_R_HEADER] = p->has[KVF_R_DECODE] = 1;
    p->has[KVF_R_QSTATS_INIT] = p->has[KVF_R_QSTATS_ACCUMULATE] = p->has[KVF_R_QSTATS_EIGEN] = 1;
    for (int t = 0; t < 2; t++) {
        const kvf_section_plan *c = &p->sec[t];
        if (c->path != KVF_PATH_KMEANS) { p->has[KVF_R_ENCODE_K + t] = 1; continue; }
        for (int r = KVF_R_K_PREP; r <= KVF_R_K_RESIDUAL; r++) p->has[r + t * KVF_R_SECTION_STRIDE] = 1;
        /* QSAC only where it chooses among more than one centroid. */
        p->has[KVF_R_K_ASSIGN_QSAC + t * KVF_R_SECTION_STRIDE] = c->qsac > 1;
    }
    if (p->sec[0].psac_rank > 0) p->has[KVF_R_PSAC_BASIS] = p->has[KVF_R_PSAC_ENCODE] = 1;
    if (p->sec[0].qsac > 1) p->has[KVF_R_QSAC_WEIGHTS] = 1;
    for (int r = 0; r < KVF_ROLE_COUNT; r++) {
        const int v_kmeans = r >= KVF_R_V_PREP && r <= KVF_R_V_RESIDUAL;
        p->served_by[r] = (unsigned char)(v_kmeans && p->sec[1].kmeans_owner == 0 ? r - KVF_R_SECTION_STRIDE : r);
    }
    int n = 0;
    p->unit_program[KVF_UNIT_REST] = (signed char)n++;
    p->unit_program[KVF_UNIT_KMEANS_K] = (signed char)(p->has[KVF_R_K_ASSIGN] ? n++ : -1);
    p->unit_program[KVF_UNIT_KMEANS_V] =
        (signed char)(p->has[KVF_R_V_ASSIGN] && p->sec[1].kmeans_owner == 1 ? n++ : -1);
    p->unit_program[KVF_UNIT_QSAC] = (signed char)(p->has[KVF_R_K_ASSIGN_QSAC] ? n++ : -1);
    p->n_programs = n;
}

int kvf_plan_build(const struct kvf_scheme *s, const kvf_plan_blame *blame, kvf_plan *out) {
    if (!s || !out) return kvf_set_error(KVF_EINVAL, "kvf_plan_build: NULL argument");
    const rules r = {s, blame};
    int rc = KVF_OK;
    for (int t = 0; t < 2 && !rc; t++) {
        const char *sec = t ? "value" : "key";
        const kvf_tensor_cfg *c = t ? &s->value : &s->key;
        if (!(rc = check_methods(&r, sec, c, t == 0))) rc = check_groups(&r, sec, c);
    }
    if (!rc) rc = check_rope(&r);
    if (!rc) rc = check_pipeline(&r);
    if (rc) return rc;
    memset(out, 0, sizeof *out);
    section_of(s, &s->key, 1, &out->sec[0]);
    section_of(s, &s->value, 0, &out->sec[1]);
    if (same_kmeans(&out->sec[0], &out->sec[1])) out->sec[1].kmeans_owner = 0;
    out->reads_qstats = s->key.qsac_candidates > 1 || s->key.psac_rank > 0;
    kernels_of(out);
    check_gpu(s, out);
    return KVF_OK;
}

void kvf_kernel_name(const struct kvf_scheme *s, int role, char *buf, size_t len) {
    snprintf(buf, len, "kvf_%s_%s", s->id, kvf_role_names[s->plan.served_by[role]]);
}
