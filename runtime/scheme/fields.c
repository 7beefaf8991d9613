/*
 * The scheme's fields: the table of every field a scheme may set (name, kind,
 * range, where it lives in struct kvf_scheme), field access by flat id, the
 * value checks and the "must be ..." they print, the defaults, and the
 * canonical text a checked scheme is written as (and hashed).
 */
#include "scheme_impl.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#define THETA_MAX 1e12 /* kvf_sch_describe() spells it out */

static const int bits_set[] = {2, 4, 8, 16, 0};
static const int group_set[] = {16, 32, 64, 128, 256, 0};
static const int head_dim_set[] = {64, 128, 256, 0};
static const char *const axis_names[] = {"channel", "token", NULL};
static const char *const mode_names[] = {"affine", "symmetric", "ternary", NULL};
static const char *const scale_names[] = {"fp16", "int8_fp16", "fp8", NULL};
static const char *const placement_names[] = {"none", "pre", "post", NULL};
static const char *const layout_names[] = {"half", "interleaved", NULL};
static const char *const rotation_names[] = {"none", "hadamard", NULL};
static const char *const labels_names[] = {"final", "last_step", NULL};
static const char *const assign_names[] = {"fast", "exact", NULL};

#define SO(m) offsetof(struct kvf_scheme, m)
#define TO(m) offsetof(kvf_tensor_cfg, m)
/* Top level, in canonical order (base is not written, nor a pipeline section
 * that is absent). */
static const kvf_sch_field top_fields[N_TOP] = {
    {"name", F_NAME, SO(name), 1, NAME_MAX_LEN, NULL, NULL},
    {"base", F_BASE, 0, 1, NAME_MAX_LEN, NULL, NULL},
    {"head_dim", F_INT, SO(head_dim), 64, 256, head_dim_set, NULL},
    {"key", F_SECTION, SO(key), S_KEY, S_KEY, NULL, NULL},
    {"value", F_SECTION, SO(value), S_VALUE, S_VALUE, NULL, NULL},
    {"rope", F_SECTION, SO(rope), S_ROPE, S_ROPE, NULL, NULL},
    {"chunk", F_SECTION, SO(chunk), S_CHUNK, S_CHUNK, NULL, NULL},
    {"outliers", F_SECTION, 0, S_OUTLIERS, S_OUTLIERS, NULL, NULL},
    {"anchors", F_SECTION, 0, S_ANCHORS, S_ANCHORS, NULL, NULL},
    {"error_feedback", F_SECTION, 0, S_FEEDBACK, S_FEEDBACK, NULL, NULL},
    {"mixed_precision", F_SECTION, 0, S_MIXED, S_MIXED, NULL, NULL},
};
/* Nested sections: sorted by name (the canonical text relies on it). */
static const kvf_sch_field tensor_fields[N_TENSOR] = {
    {"assign", F_ENUM, TO(assign), 0, 0, NULL, assign_names},
    {"axis", F_ENUM, TO(axis), 0, 0, NULL, axis_names},
    {"bits", F_INT, TO(bits), 2, 16, bits_set, NULL},
    {"centroids", F_INT, TO(centroids), 0, 256, NULL, NULL},
    {"group_size", F_INT, TO(group_size), 16, 256, group_set, NULL},
    {"kmeans_iters", F_INT, TO(kmeans_iters), 0, 100, NULL, NULL},
    {"kmeans_labels", F_ENUM, TO(kmeans_labels), 0, 0, NULL, labels_names},
    {"mode", F_ENUM, TO(mode), 0, 0, NULL, mode_names},
    {"psac_rank", F_INT, TO(psac_rank), 0, KVF_MAX_PSAC_RANK, NULL, NULL},
    {"qsac_candidates", F_INT, TO(qsac_candidates), 1, 256, NULL, NULL},
    {"rotation", F_ENUM, TO(rotation), 0, 0, NULL, rotation_names},
    {"scale_format", F_ENUM, TO(scale_format), 0, 0, NULL, scale_names},
    {"seed", F_I64, TO(seed), 0, (int64_t)1 << 53, NULL, NULL},
    {"stages", F_INT, TO(stages), 1, 8, NULL, NULL},
};
static const kvf_sch_field rope_fields[N_ROPE] = {
    {"layout", F_ENUM, offsetof(kvf_rope_cfg, layout), 0, 0, NULL, layout_names},
    {"placement", F_ENUM, offsetof(kvf_rope_cfg, placement), 0, 0, NULL, placement_names},
    /* n_sections, then sections[]: an array of 1..KVF_MAX_ROPE_SECTIONS pair counts */
    {"sections", F_SECTIONS, offsetof(kvf_rope_cfg, n_sections), 1, 128, NULL, NULL},
    {"theta", F_NUM, offsetof(kvf_rope_cfg, theta), 0, 0, NULL, NULL},
};
static const kvf_sch_field chunk_fields[N_CHUNK] = {
    {"recent", F_INT, offsetof(kvf_chunk_cfg, recent), 0, 64, NULL, NULL},
    {"sink", F_INT, offsetof(kvf_chunk_cfg, sink), 0, 64, NULL, NULL},
    {"span", F_INT, offsetof(kvf_chunk_cfg, span), 1, 64, NULL, NULL},
    {"tokens", F_INT, offsetof(kvf_chunk_cfg, tokens), 1, 1048576, NULL, NULL},
};

#define PO(m) offsetof(kvf_pipeline_cfg, m)
static const int anchor_bits_set[] = {4, 8, 16, 0};
static const int refine_bits_set[] = {2, 4, 8, 0};
static const kvf_sch_field outlier_fields[N_OUTLIERS] = {
    {"key", F_INT, PO(outliers[0]), 0, 32, NULL, NULL},
    {"value", F_INT, PO(outliers[1]), 0, 32, NULL, NULL},
};
static const kvf_sch_field anchor_fields[N_ANCHORS] = {
    {"bits", F_INT, PO(anchor_bits), 4, 16, anchor_bits_set, NULL},
    {"every", F_INT, PO(anchor_every), 1, 100000, NULL, NULL},
};
static const kvf_sch_field feedback_fields[N_FEEDBACK] = {
    {"decay", F_FRAC, PO(feedback_decay), 0, 0, NULL, NULL},
};
static const kvf_sch_field mixed_fields[N_MIXED] = {
    {"key_fraction", F_FRAC, PO(mp_fraction[0]), 0, 0, NULL, NULL},
    {"refine_bits", F_INT, PO(mp_refine_bits), 2, 8, refine_bits_set, NULL},
    {"table", F_PATH, PO(mp_table), 0, 0, NULL, NULL},
    {"value_fraction", F_FRAC, PO(mp_fraction[1]), 0, 0, NULL, NULL},
};

enum {
    FIRST_KEY = N_TOP, FIRST_VALUE = FIRST_KEY + N_TENSOR, FIRST_ROPE = FIRST_VALUE + N_TENSOR,
    FIRST_CHUNK = FIRST_ROPE + N_ROPE, FIRST_OUTLIERS = FIRST_CHUNK + N_CHUNK,
    FIRST_ANCHORS = FIRST_OUTLIERS + N_OUTLIERS, FIRST_FEEDBACK = FIRST_ANCHORS + N_ANCHORS,
    FIRST_MIXED = FIRST_FEEDBACK + N_FEEDBACK
};
const kvf_sch_section kvf_sch_sections[N_SECTIONS] = {
    {"", 0, top_fields, N_TOP, 0, 0},
    {"key", SO(key), tensor_fields, N_TENSOR, FIRST_KEY, 0},
    {"value", SO(value), tensor_fields, N_TENSOR, FIRST_VALUE, 0},
    {"rope", SO(rope), rope_fields, N_ROPE, FIRST_ROPE, 0},
    {"chunk", SO(chunk), chunk_fields, N_CHUNK, FIRST_CHUNK, 0},
    {"outliers", SO(pipe), outlier_fields, N_OUTLIERS, FIRST_OUTLIERS, 1},
    {"anchors", SO(pipe), anchor_fields, N_ANCHORS, FIRST_ANCHORS, 1},
    {"error_feedback", SO(pipe), feedback_fields, N_FEEDBACK, FIRST_FEEDBACK, 1},
    {"mixed_precision", SO(pipe), mixed_fields, N_MIXED, FIRST_MIXED, 1},
};

bool kvf_sch_section_on(const struct kvf_scheme *s, int sec) {
    const kvf_pipeline_cfg *p = &s->pipe;
    switch (sec) {
    case S_OUTLIERS: return p->outliers[0] || p->outliers[1];
    case S_ANCHORS: return p->anchor_every != 0;
    case S_FEEDBACK: return p->feedback_decay != 0;
    case S_MIXED: return p->mp_fraction[0] != 0 || p->mp_fraction[1] != 0 || p->mp_table[0];
    default: return true;
    }
}

const kvf_sch_field *kvf_sch_fid_desc(int fid, int *sec) {
    int s = N_SECTIONS - 1;
    while (kvf_sch_sections[s].first > fid) s--;
    if (sec) *sec = s;
    return &kvf_sch_sections[s].f[fid - kvf_sch_sections[s].first];
}

void kvf_sch_fid_path(int fid, char *buf, size_t n) {
    int sec;
    const kvf_sch_field *d = kvf_sch_fid_desc(fid, &sec);
    snprintf(buf, n, "%s%s%s", kvf_sch_sections[sec].name, sec ? "." : "", d->name);
}

void *kvf_sch_field_ptr(const struct kvf_scheme *s, int fid) {
    int sec;
    const kvf_sch_field *d = kvf_sch_fid_desc(fid, &sec);
    return (char *)s + kvf_sch_sections[sec].off + d->off;
}

/* An F_SECTIONS field points at rope.n_sections; its values follow. */
int *kvf_sch_sections_of(void *n_sections) {
    return (int *)((char *)n_sections + offsetof(kvf_rope_cfg, sections) -
                   offsetof(kvf_rope_cfg, n_sections));
}

/* ============================================================ value checks */

bool kvf_sch_valid_name(const char *s, size_t len) {
    if (len < 1 || len > NAME_MAX_LEN) return false;
    for (size_t i = 0; i < len; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_'))
            return false;
    }
    return true;
}

bool kvf_sch_int_ok(const kvf_sch_field *d, int64_t v) {
    if (v < d->lo || v > d->hi) return false;
    if (!d->set) return true;
    for (const int *p = d->set; *p; p++)
        if (*p == v) return true;
    return false;
}

/* An enum value indexes its spellings: 0 .. (number of names - 1). */
bool kvf_sch_enum_ok(const kvf_sch_field *d, int64_t v) {
    int64_t n = 0;
    while (d->names[n]) n++;
    return v >= 0 && v < n;
}

bool kvf_sch_num_ok(double v) { return isfinite(v) && v > 0 && v <= THETA_MAX; }

bool kvf_sch_frac_ok(double v) { return isfinite(v) && v >= 0 && v < 1; }

bool kvf_sch_path_ok(const char *s, size_t len) {
    if (len < 1 || len >= PATH_FIELD_LEN) return false;
    for (size_t i = 0; i < len; i++)
        if ((unsigned char)s[i] < 32 || s[i] == 127) return false;
    return true;
}

/* "must be ..." for a field, without the value found. */
void kvf_sch_describe(const kvf_sch_field *d, char *buf, size_t n) {
    size_t k = 0;
    switch (d->kind) {
    case F_INT:
    case F_I64:
        if (!d->set) {
            snprintf(buf, n, "must be an integer in %lld..%lld", (long long)d->lo,
                     (long long)d->hi);
            return;
        }
        k = (size_t)snprintf(buf, n, "must be one of");
        for (const int *p = d->set; *p && k < n; p++)
            k += (size_t)snprintf(buf + k, n - k, "%s %d", p == d->set ? "" : ",", *p);
        return;
    case F_ENUM:
        k = (size_t)snprintf(buf, n, "must be one of");
        for (const char *const *p = d->names; *p && k < n; p++)
            k += (size_t)snprintf(buf + k, n - k, "%s \"%s\"", p == d->names ? "" : ",", *p);
        return;
    case F_NUM: snprintf(buf, n, "must be a finite number > 0 and <= 1e12"); return;
    case F_FRAC: snprintf(buf, n, "must be a number >= 0 and < 1"); return;
    case F_PATH: snprintf(buf, n, "must be a file path of 1..%d characters", PATH_FIELD_LEN - 1); return;
    case F_NAME:
    case F_BASE:
        snprintf(buf, n, "must be a string of 1..%d characters from [A-Za-z0-9_]", NAME_MAX_LEN);
        return;
    case F_SECTION: snprintf(buf, n, "must be a table"); return;
    case F_SECTIONS:
        snprintf(buf, n, "must be an array of 1..%d integers in %lld..%lld", KVF_MAX_ROPE_SECTIONS,
                 (long long)d->lo, (long long)d->hi);
        return;
    }
}

/* ================================================================ defaults */

void kvf_scheme_defaults(struct kvf_scheme *s) {
    static const kvf_tensor_cfg tensor = {
        .bits = 2, .group_size = 64, .axis = KVF_AXIS_CHANNEL, .mode = KVF_MODE_AFFINE,
        .scale_format = KVF_SCALE_FP16, .centroids = 0, .kmeans_iters = 2, .kmeans_labels = KVF_LABELS_FINAL, .seed = 0,
        .qsac_candidates = 1, .psac_rank = 0, .stages = 1, .rotation = KVF_ROTATION_NONE,
        .assign = KVF_ASSIGN_FAST};
    memset(s, 0, sizeof *s);
    s->head_dim = 128;
    s->key = tensor;
    s->value = tensor;
    s->rope.placement = KVF_ROPE_NONE;
    s->rope.layout = KVF_ROPE_HALF;
    s->rope.theta = 10000.0;
    s->rope.n_sections = 0; /* absent: one section of head_dim / 2, filled by finalize */
    s->chunk.tokens = 4680;
    s->chunk.span = 1;
    s->chunk.recent = 0;
    s->chunk.sink = 0;
    /* The pipeline is off (its sections absent); where a section is given,
     * these fill the fields it leaves out. */
    s->pipe.anchor_bits = 8;
    s->pipe.mp_refine_bits = 2;
}

/* Defaults that depend on other fields, filled once the chain is merged: an
 * absent rope.sections is one section of head_dim / 2 pairs (1D RoPE). */
void kvf_sch_fill_derived(struct kvf_scheme *s) {
    if (s->rope.n_sections == 0) {
        memset(s->rope.sections, 0, sizeof s->rope.sections);
        s->rope.n_sections = 1;
        s->rope.sections[0] = s->head_dim / 2;
    }
}

/* ========================================================= canonical text */

typedef struct text {
    char b[4096];
    size_t n;
} text;

static void put(text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void put(text *t, const char *fmt, ...) {
    va_list ap;
    if (t->n >= sizeof t->b) return;
    va_start(ap, fmt);
    int k = vsnprintf(t->b + t->n, sizeof t->b - t->n, fmt, ap);
    va_end(ap);
    t->n = k < 0 ? sizeof t->b : t->n + (size_t)k;
}

/* Shortest %g form that reads back to the same double, always with a '.'. */
static void put_double(text *t, double x) {
    char buf[64];
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(buf, sizeof buf, "%.*g", prec, x);
        if (strtod(buf, NULL) == x) break;
    }
    for (char *c = buf; *c; c++)
        if (*c == ',') *c = '.'; /* a locale's decimal comma */
    put(t, "%s%s", buf, strpbrk(buf, ".eEni") ? "" : ".0");
}

static void put_value(text *t, const kvf_sch_field *d, const void *p) {
    switch (d->kind) {
    case F_INT: put(t, "%d", *(const int *)p); break;
    case F_I64: put(t, "%lld", (long long)*(const int64_t *)p); break;
    case F_ENUM: put(t, "\"%s\"", d->names[*(const int *)p]); break;
    case F_NUM:
    case F_FRAC: put_double(t, *(const double *)p); break;
    case F_NAME: put(t, "\"%s\"", (const char *)p); break;
    case F_PATH: {
        put(t, "\"");
        for (const char *c = p; *c; c++) put(t, *c == '"' || *c == '\\' ? "\\%c" : "%c", *c);
        put(t, "\"");
        break;
    }
    case F_SECTIONS: {
        const int *n = p, *a = kvf_sch_sections_of((void *)p);
        put(t, "{");
        for (int k = 0; k < *n; k++) put(t, "%s%d", k ? ", " : " ", a[k]);
        put(t, " }");
        break;
    }
    default: break;
    }
}

static void put_section(text *t, const struct kvf_scheme *s, int sec) {
    const kvf_sch_section *S = &kvf_sch_sections[sec];
    put(t, "  %s = {", S->name);
    for (int i = 0, shown = 0; i < S->n; i++) {
        const void *p = kvf_sch_field_ptr(s, FID(sec, i));
        /* An unset path (no table) is absent from the text, as from the file. */
        if (S->f[i].kind == F_PATH && !*(const char *)p) continue;
        put(t, "%s%s = ", shown++ ? ", " : " ", S->f[i].name);
        put_value(t, &S->f[i], p);
    }
    put(t, " },\n");
}

/* Canonical text, hash and id of a checked scheme. */
int kvf_sch_canonical(struct kvf_scheme *s) {
    text *t = calloc(1, sizeof *t);
    if (!t) return kvf_set_error(KVF_ENOMEM, "out of memory");
    put(t, "return {\n");
    for (int i = 0; i < N_TOP; i++) {
        const kvf_sch_field *d = &top_fields[i];
        if (d->kind == F_SECTION) {
            if (kvf_sch_section_on(s, (int)d->lo)) put_section(t, s, (int)d->lo);
        } else if (d->kind != F_BASE) {
            put(t, "  %s = ", d->name);
            put_value(t, d, kvf_sch_field_ptr(s, FID(S_TOP, i)));
            put(t, ",\n");
        }
    }
    put(t, "}\n");
    int rc = t->n < sizeof s->canonical ? KVF_OK : kvf_set_error(KVF_EINVAL, "canonical text too long");
    if (!rc) {
        memcpy(s->canonical, t->b, t->n + 1);
        s->hash = XXH3_64bits(s->canonical, t->n);
        snprintf(s->id, sizeof s->id, "%s_%08x", s->name, (unsigned)(s->hash >> 32));
    }
    free(t);
    return rc;
}
