/* The generator: configuration-only CUDA and C from a scheme (see gen.h). */
#include "gen.h"

#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ------------------------------------------------------------ growable text */

static void buf_reserve(kvf_buf *b, size_t extra) {
    if (b->oom || b->len + extra + 1 <= b->cap) return;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + extra + 1) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) { b->oom = 1; return; }
    b->p = p;
    b->cap = cap;
}

void kvf_buf_append(kvf_buf *b, const char *s, size_t n) {
    buf_reserve(b, n);
    if (b->oom) return;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}

void kvf_buf_printf(kvf_buf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) { b->oom = 1; return; }
    buf_reserve(b, (size_t)n);
    if (b->oom) return;
    va_start(ap, fmt);
    vsnprintf(b->p + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

void kvf_buf_c_string(kvf_buf *b, const char *s, size_t n) {
    kvf_buf_append(b, "\"", 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '\n') kvf_buf_append(b, i + 1 < n ? "\\n\"\n    \"" : "\\n", i + 1 < n ? 9 : 2);
        else if (c == '"' || c == '\\') kvf_buf_printf(b, "\\%c", c);
        else if (c == '\t') kvf_buf_append(b, "\\t", 2);
        else if (c < 32 || c >= 127) kvf_buf_printf(b, "\\%03o", c);
        else kvf_buf_append(b, (const char *)&c, 1);
    }
    kvf_buf_append(b, "\"", 1);
}

void kvf_buf_c_bytes(kvf_buf *b, const void *data, size_t n) {
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++) kvf_buf_printf(b, "%s0x%02x,", i % 16 ? "" : "\n    ", p[i]);
    kvf_buf_append(b, "\n", 1);
}

char *kvf_buf_take(kvf_buf *b) {
    if (b->oom) { free(b->p); b->p = NULL; return NULL; }
    char *p = b->p ? b->p : calloc(1, 1);
    b->p = NULL;
    b->len = b->cap = 0;
    return p;
}

/* ------------------------------------------------------------ spellings */

static void upper_id(const struct kvf_scheme *s, char *buf, size_t len) {
    snprintf(buf, len, "KVF_%s", s->id);
    for (char *p = buf; *p; p++) *p = (char)toupper((unsigned char)*p);
}

/* kvf_abi.h's names of a plan's enum values, so the generated file reads as
 * the configuration it is. */
static const char *mode_name(int m) {
    return m == KVF_MODE_TERNARY ? "KVF_MODE_TERNARY" : m == KVF_MODE_SYMMETRIC ? "KVF_MODE_SYMMETRIC" : "KVF_MODE_AFFINE";
}
static const char *sfmt_name(int f) {
    return f == KVF_SCALE_INT8_FP16 ? "KVF_SCALE_INT8_FP16" : f == KVF_SCALE_FP8 ? "KVF_SCALE_FP8" : "KVF_SCALE_FP16";
}
static const char *axis_name(int a) { return a == KVF_AXIS_TOKEN ? "KVF_AXIS_TOKEN" : "KVF_AXIS_CHANNEL"; }
static const char *decode_rope_name(int r) {
    return r == KVF_DECODE_ROPE_HALF          ? "KVF_DECODE_ROPE_HALF"
           : r == KVF_DECODE_ROPE_INTERLEAVED ? "KVF_DECODE_ROPE_INTERLEAVED"
                                              : "KVF_DECODE_ROPE_NONE";
}

/* The first line of every generated file. Only the source's basename, so the
 * output (and the JIT cache key) does not depend on where the file was read. */
static void header_line(kvf_buf *b, const struct kvf_scheme *s, const char *comment) {
    const char *base = strrchr(s->source, '/');
    base = base ? base + 1 : s->source;
    kvf_buf_printf(b, "%s Generated from schemes/%s by kvforge gen %s. Do not edit.\n", comment,
                   *base ? base : "(text)", KVF_VERSION_STRING);
}

/* ------------------------------------------------------------------ CUDA */

/* The source being written: the whole (want = -1) or one program's. */
typedef struct cuda_out {
    kvf_buf b;
    const kvf_plan *plan;
    int want;
} cuda_out;

static int emits(const cuda_out *o, int unit) { return o->want < 0 || o->plan->unit_program[unit] == o->want; }

/* The pipeline's template arguments (PK, PM, PB, AB[, FB]) of a section. */
static void pipe_args(const kvf_section_plan *c, int with_feedback, char *buf, size_t len) {
    if (with_feedback)
        snprintf(buf, len, "%d, %d, %d, %d, %d", c->outliers, c->mp_channels, c->mp_bits, c->anchor_bits, c->feedback);
    else
        snprintf(buf, len, "%d, %d, %d, %d", c->outliers, c->mp_channels, c->mp_bits, c->anchor_bits);
}

/* KVF_KMEANS_KERNELS' arguments after the prefix. */
static void kmeans_args(const struct kvf_scheme *s, const kvf_section_plan *c, char *buf, size_t len) {
    char pipe[64];
    pipe_args(c, 1, pipe, sizeof pipe);
    snprintf(buf, len, "%d, %d, %d, %d, %d, %s, %s, %d, %d, %s, %d", s->head_dim, c->rotation == KVF_ROTATION_HADAMARD,
             c->group, c->qsac, c->bits, mode_name(c->mode), sfmt_name(c->scale_format), c->centroids,
             c->bf16_source, pipe, c->exact);
}

/* One tensor section's encode instantiations. */
static void gen_encode_section(cuda_out *o, const struct kvf_scheme *s, int t) {
    const kvf_section_plan *c = &o->plan->sec[t];
    kvf_buf *b = &o->b;
    char name[200], pipe[64];
    pipe_args(c, 1, pipe, sizeof pipe);
    switch (c->path) {
    case KVF_PATH_TOKEN_GROUPS:
        if (!emits(o, KVF_UNIT_REST)) break;
        kvf_kernel_name(s, KVF_R_ENCODE_K + t, name, sizeof name);
        kvf_buf_printf(b, "KVF_KIVI_ENCODE_KERNEL(%s, %d, %d, %d, %s)\n", name, s->head_dim, c->bits, c->group,
                       mode_name(c->mode));
        break;
    case KVF_PATH_KMEANS:
        if (c->kmeans_owner != t) {
            if (o->want < 0)
                kvf_buf_printf(b, "// value section: the key section's k-means kernels (same template arguments)\n");
            break;
        }
        kmeans_args(s, c, name, sizeof name);
        if (emits(o, t ? KVF_UNIT_KMEANS_V : KVF_UNIT_KMEANS_K))
            kvf_buf_printf(b, "KVF_KMEANS_KERNELS(kvf_%s_%c, %s)\n", s->id, t ? 'v' : 'k', name);
        if (o->plan->has[KVF_R_K_ASSIGN_QSAC + t * KVF_R_SECTION_STRIDE] && emits(o, KVF_UNIT_QSAC))
            kvf_buf_printf(b, "KVF_KMEANS_QSAC_KERNEL(kvf_%s_%c, %d, %d, %d, %d, %d)\n", s->id, t ? 'v' : 'k',
                           s->head_dim, c->group, c->qsac, c->bf16_source, c->exact);
        break;
    default:
        if (!emits(o, KVF_UNIT_REST)) break;
        kvf_kernel_name(s, KVF_R_ENCODE_K + t, name, sizeof name);
        kvf_buf_printf(b, "KVF_RTN_ENCODE_KERNEL(%s, %d, %d, %d, %s, %s, %d, %s)\n", name, s->head_dim, c->bits,
                       c->group, mode_name(c->mode), sfmt_name(c->scale_format), c->rotation == KVF_ROTATION_HADAMARD,
                       pipe);
    }
}

/* The decode: one kvf_decode::section typedef per tensor section, and the
 * kernel that runs both (templates/kvf_decode.cuh). */
static void gen_decode(cuda_out *o, const struct kvf_scheme *s) {
    char name[160];
    kvf_kernel_name(s, KVF_R_DECODE, name, sizeof name);
    for (int t = 0; t < 2; t++) {
        const kvf_section_plan *c = &o->plan->sec[t];
        char pipe[64];
        pipe_args(c, 0, pipe, sizeof pipe);
        kvf_buf_printf(&o->b, "typedef kvf_decode::section<%d, %d, %d, %s, %s, %s, %d, %d, %d, %d, %s, %s> %s_%s;\n",
                       s->head_dim, c->bits, c->group, mode_name(c->mode), sfmt_name(c->scale_format),
                       axis_name(c->axis), c->centroids, c->stages, c->rotation == KVF_ROTATION_HADAMARD,
                       c->psac_rank, decode_rope_name(c->decode_rope), pipe, name, t ? "value" : "key");
    }
    kvf_buf_printf(&o->b, "KVF_DECODE_KERNEL(%s, %s_key, %s_value)\n", name, name, name);
}

/* want: -1 for the whole source, else program `want`. Every program defines
 * the format and interface globals, which a context checks in each module
 * it loads. */
static char *gen_cuda(const struct kvf_scheme *s, int want) {
    const kvf_plan *p = &s->plan;
    cuda_out o = {.plan = p, .want = want};
    kvf_buf *b = &o.b;
    char name[160];
    header_line(b, s, "//");
    kvf_buf_printf(b, "// Scheme %s (hash %016llx): configuration and instantiations only;\n"
                      "// the algorithms are in the templates included below.\n",
                   s->name, (unsigned long long)s->hash);
    if (want >= 0)
        kvf_buf_printf(b, "// Program %d of %d that the JIT compiles at once (gen/gen.h kvf_gen_output).\n", want + 1,
                       p->n_programs);
    kvf_buf_printf(b, "#include \"kvf_rtn.cuh\"\n#include \"kvf_kivi.cuh\"\n#include \"kvf_kmeans.cuh\"\n"
                      "#include \"kvf_psac.cuh\"\n#include \"kvf_decode.cuh\"\n\n");
    kvf_buf_printf(b, "KVF_FORMAT_VERSION_GLOBAL(%uu)\nKVF_KERNEL_ABI_GLOBAL(0x%08xu)\n", KVF_FORMAT_VERSION,
                   kvf_kernel_abi());
    kvf_kernel_name(s, KVF_R_HEADER, name, sizeof name);
    if (emits(&o, KVF_UNIT_REST)) kvf_buf_printf(b, "KVF_HEADER_KERNEL(%s)\n", name);
    for (int t = 0; t < 2; t++) gen_encode_section(&o, s, t);
    if (emits(&o, KVF_UNIT_REST)) {
        gen_decode(&o, s);
        kvf_buf_printf(b, "KVF_QSTATS_KERNELS(kvf_%s, %d, %d)\n", s->id, s->head_dim, p->sec[0].psac_rank);
        if (p->has[KVF_R_PSAC_BASIS])
            kvf_buf_printf(b, "KVF_PSAC_KERNELS(kvf_%s, %d, %d)\n", s->id, s->head_dim, p->sec[0].psac_rank);
        if (p->has[KVF_R_QSAC_WEIGHTS]) kvf_buf_printf(b, "KVF_QSAC_WEIGHTS_KERNEL(kvf_%s, %d)\n", s->id, s->head_dim);
    }
    return kvf_buf_take(b);
}

/* --------------------------------------------------------------- C header */

/* Sizes of whole buffers: kvf_packed_size (a per-token constant could not count
 * centroids, token scales or PSAC planes). */
static void section_defines(kvf_buf *b, const char *up, const char *tag, const kvf_section_layout *l) {
    kvf_buf_printf(b, "#define %s_%s_BITS %d\n", up, tag, l->bits);
    kvf_buf_printf(b, "#define %s_%s_GROUP_SIZE %d\n", up, tag, l->group_size);
    kvf_buf_printf(b, "#define %s_%s_CODE_BYTES_PER_TOKEN_HEAD %zu\n", up, tag, l->code_bytes_per_token);
}

static char *gen_h(const struct kvf_scheme *s, const kvf_layout *l) {
    kvf_buf b = {0};
    char up[128];
    upper_id(s, up, sizeof up);
    header_line(&b, s, "/*");
    kvf_buf_printf(&b, "   Canonical configuration and layout constants of scheme %s. */\n", s->name);
    kvf_buf_printf(&b, "#ifndef %s_H\n#define %s_H\n#include \"kvforge.h\"\n\n", up, up);
    kvf_buf_printf(&b, "#define %s_HASH 0x%016llxull\n", up, (unsigned long long)s->hash);
    kvf_buf_printf(&b, "#define %s_HEAD_DIM %d\n", up, s->head_dim);
    kvf_buf_printf(&b, "#define %s_HEADER_BYTES %u\n", up, KVF_HEADER_BYTES);
    section_defines(&b, up, "KEY", &l->key);
    section_defines(&b, up, "VALUE", &l->value);
    kvf_buf_printf(&b, "\nextern const char kvf_%s_scheme[]; /* canonical configuration (Lua text) */\n", s->id);
    kvf_buf_printf(&b, "/* Load the scheme this file was generated from (kvf_scheme_free it). */\n"
                       "int kvf_%s_load_scheme(kvf_scheme **out);\n", s->id);
    kvf_buf_printf(&b, "\n#endif\n");
    return kvf_buf_take(&b);
}

/* ------------------------------------------------------------------ C source */

static char *gen_c(const struct kvf_scheme *s) {
    kvf_buf b = {0};
    header_line(&b, s, "/*");
    kvf_buf_printf(&b, "   Canonical configuration of scheme %s. */\n", s->name);
    kvf_buf_printf(&b, "#include \"%s.h\"\n\n", s->id);
    kvf_buf_printf(&b, "const char kvf_%s_scheme[] =\n    ", s->id);
    kvf_buf_c_string(&b, s->canonical, strlen(s->canonical));
    kvf_buf_printf(&b, ";\n\n");
    kvf_buf_printf(&b,
                   "int kvf_%s_load_scheme(kvf_scheme **out) {\n"
                   "    return kvf_scheme_load_string(kvf_%s_scheme, sizeof kvf_%s_scheme - 1, \"=%s\", out);\n"
                   "}\n", s->id, s->id, s->id, s->id);
    return kvf_buf_take(&b);
}

static char *file_name(const struct kvf_scheme *s, const char *ext) {
    size_t n = strlen(s->id) + strlen(ext) + 1;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s%s", s->id, ext);
    return p;
}

/* What every output needs: a scheme the GPU templates run (the plan says),
 * and its layout. */
static int gen_check(const struct kvf_scheme *s, kvf_layout *l) {
    if (s->plan.gpu_status) return kvf_set_error(s->plan.gpu_status, "%s", s->plan.gpu_reason);
    return kvf_layout_compute(s, 1, 1, l);
}

static int out_of_memory(const struct kvf_scheme *s, kvf_gen_output *out) {
    kvf_gen_output_free(out);
    return kvf_set_error(KVF_ENOMEM, "generator: out of memory for scheme %s", s->name);
}

/* out->program and out->program_name (the JIT's programs). */
static int gen_programs(const struct kvf_scheme *s, kvf_gen_output *out) {
    int bad = 0;
    out->n_programs = s->plan.n_programs;
    for (int p = 0; p < out->n_programs; p++) {
        char ext[16];
        snprintf(ext, sizeof ext, ".p%d.cu", p);
        out->program[p] = gen_cuda(s, p);
        out->program_name[p] = file_name(s, ext);
        bad |= !out->program[p] || !out->program_name[p];
    }
    return bad ? out_of_memory(s, out) : KVF_OK;
}

int kvf_gen_programs(const struct kvf_scheme *s, kvf_gen_output *out) {
    memset(out, 0, sizeof *out);
    kvf_layout l;
    int rc = gen_check(s, &l);
    return rc ? rc : gen_programs(s, out);
}

int kvf_gen(const struct kvf_scheme *s, kvf_gen_output *out) {
    memset(out, 0, sizeof *out);
    kvf_layout l;
    int rc = gen_check(s, &l);
    if (rc || (rc = gen_programs(s, out))) return rc;
    out->cu = gen_cuda(s, -1);
    out->c = gen_c(s);
    out->h = gen_h(s, &l);
    out->cu_name = file_name(s, ".cu");
    out->c_name = file_name(s, ".c");
    out->h_name = file_name(s, ".h");
    if (!out->cu || !out->c || !out->h || !out->cu_name || !out->c_name || !out->h_name) return out_of_memory(s, out);
    return KVF_OK;
}

void kvf_gen_output_free(kvf_gen_output *out) {
    free(out->cu_name); free(out->cu);
    free(out->c_name); free(out->c);
    free(out->h_name); free(out->h);
    for (int p = 0; p < out->n_programs; p++) {
        free(out->program_name[p]);
        free(out->program[p]);
    }
    memset(out, 0, sizeof *out);
}

int kvf_gen_write(const kvf_gen_output *out, const char *dir) {
    if (mkdir(dir, 0755) && errno != EEXIST)
        return kvf_set_error(KVF_EIO, "cannot create directory %s: %s", dir, strerror(errno));
    const char *names[3] = {out->cu_name, out->c_name, out->h_name};
    const char *data[3] = {out->cu, out->c, out->h};
    for (int i = 0; i < 3; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        int rc = kvf_write_file(path, data[i], strlen(data[i]));
        if (rc) return rc;
    }
    return KVF_OK;
}
