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

/* ---------------------------------------------------------------- naming */

const char *const kvf_role_names[KVF_ROLE_COUNT] = {
    "header", "encode_k", "encode_v", "decode_kv",
    "k_prep", "k_init", "k_assign", "k_assign_qsac", "k_accumulate", "k_finalize", "k_pad", "k_subtract",
    "k_residual",
    "v_prep", "v_init", "v_assign", "v_assign_qsac", "v_accumulate", "v_finalize", "v_pad", "v_subtract",
    "v_residual",
    "qstats_init", "qstats_accumulate", "qstats_eigen", "psac_basis", "psac_encode", "qsac_weights",
};

char kvf_section_path(const kvf_tensor_cfg *t) {
    if (t->bits == 16) return 'A';
    if (t->axis == KVF_AXIS_TOKEN) return 'T';
    if (t->centroids > 0 || t->psac_rank > 0 || t->stages > 1) return 'B';
    return 'A';
}

/* The templates' G: bits 16 stores rows as they are, and takes 8 (one lane). */
static int template_group(const kvf_tensor_cfg *c) { return c->bits == 16 ? 8 : c->group_size; }

/* Stage 0 reads the BF16 input itself (no rotation, one stage). */
static int reads_bf16(const kvf_tensor_cfg *c) { return c->rotation != KVF_ROTATION_HADAMARD && c->stages == 1; }

static const char *mode_macro(int mode) {
    return mode == KVF_MODE_SYMMETRIC ? "KVF_MODE_SYMMETRIC" : "KVF_MODE_AFFINE";
}

static const char *sfmt_macro(int f) { return f == KVF_SCALE_INT8_FP16 ? "KVF_SCALE_INT8_FP16" : "KVF_SCALE_FP16"; }

/* KVF_KMEANS_KERNELS' arguments after the prefix, with QSAC = qsac. */
static void kmeans_args(const struct kvf_scheme *s, const kvf_tensor_cfg *c, int qsac, char *buf, size_t len) {
    snprintf(buf, len, "%d, %d, %d, %d, %d, %s, %s, %d, %d", s->head_dim, c->rotation == KVF_ROTATION_HADAMARD,
             template_group(c), qsac, c->bits, mode_macro(c->mode), sfmt_macro(c->scale_format), c->centroids,
             reads_bf16(c));
}

int kvf_gen_kmeans_owner(const struct kvf_scheme *s, int t) {
    char a[160], b[160];
    if (!t || kvf_section_path(&s->key) != 'B' || kvf_section_path(&s->value) != 'B') return t;
    kmeans_args(s, &s->key, 1, a, sizeof a); /* QSAC aside: values never run it */
    kmeans_args(s, &s->value, 1, b, sizeof b);
    return strcmp(a, b) ? t : 0;
}

int kvf_gen_role_kernel(const struct kvf_scheme *s, int role) {
    if (role >= KVF_R_V_PREP && role <= KVF_R_V_RESIDUAL && kvf_gen_kmeans_owner(s, 1) == 0)
        return role - KVF_R_SECTION_STRIDE;
    return role;
}

void kvf_gen_kernel_name(const struct kvf_scheme *s, int role, char *buf, size_t len) {
    snprintf(buf, len, "kvf_%s_%s", s->id, kvf_role_names[kvf_gen_role_kernel(s, role)]);
}

void kvf_gen_roles(const struct kvf_scheme *s, int present[KVF_ROLE_COUNT]) {
    const kvf_tensor_cfg *sec[2] = {&s->key, &s->value};
    memset(present, 0, sizeof(int) * KVF_ROLE_COUNT);
    present[KVF_R_HEADER] = present[KVF_R_DECODE] = 1;
    present[KVF_R_QSTATS_INIT] = present[KVF_R_QSTATS_ACCUMULATE] = present[KVF_R_QSTATS_EIGEN] = 1;
    for (int t = 0; t < 2; t++) {
        if (kvf_section_path(sec[t]) != 'B') { present[KVF_R_ENCODE_K + t] = 1; continue; }
        for (int r = KVF_R_K_PREP; r <= KVF_R_K_RESIDUAL; r++) present[r + t * KVF_R_SECTION_STRIDE] = 1;
        /* QSAC only where it chooses among more than one centroid (keys' stage 0). */
        present[KVF_R_K_ASSIGN_QSAC + t * KVF_R_SECTION_STRIDE] = t == 0 && sec[t]->qsac_candidates > 1;
    }
    if (s->key.psac_rank > 0) present[KVF_R_PSAC_BASIS] = present[KVF_R_PSAC_ENCODE] = 1;
    if (s->key.qsac_candidates > 1) present[KVF_R_QSAC_WEIGHTS] = 1;
}

int kvf_gen_kernels(const struct kvf_scheme *s, int roles[KVF_ROLE_COUNT]) {
    int present[KVF_ROLE_COUNT], n = 0;
    kvf_gen_roles(s, present);
    for (int r = 0; r < KVF_ROLE_COUNT; r++)
        if (present[r] && kvf_gen_role_kernel(s, r) == r) roles[n++] = r;
    return n;
}

static void upper_id(const struct kvf_scheme *s, char *buf, size_t len) {
    snprintf(buf, len, "KVF_%s", s->id);
    for (char *p = buf; *p; p++) *p = (char)toupper((unsigned char)*p);
}

static const char *rope_macro(const struct kvf_scheme *s, int is_key) {
    if (!is_key || s->rope.placement != KVF_ROPE_PRE) return "KVF_ROPE_NONE";
    return s->rope.layout == KVF_ROPE_INTERLEAVED ? "KVF_ROPE_INTERLEAVED" : "KVF_ROPE_HALF";
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

/* The programs of the JIT (kvf_gen_output.program): what each instantiation
 * belongs to, and which program compiles it (-1: the scheme has none). */
enum { U_REST, U_KMEANS_K, U_KMEANS_V, U_QSAC, U_COUNT };

static int programs_of(const struct kvf_scheme *s, int prog[U_COUNT]) {
    int present[KVF_ROLE_COUNT], n = 0;
    kvf_gen_roles(s, present);
    prog[U_REST] = n++;
    prog[U_KMEANS_K] = present[KVF_R_K_ASSIGN] ? n++ : -1;
    prog[U_KMEANS_V] = present[KVF_R_V_ASSIGN] && kvf_gen_role_kernel(s, KVF_R_V_ASSIGN) == KVF_R_V_ASSIGN ? n++ : -1;
    prog[U_QSAC] = present[KVF_R_K_ASSIGN_QSAC] ? n++ : -1;
    return n;
}

/* The source being written: the whole (want = -1) or one program's. */
typedef struct cuda_out {
    kvf_buf b;
    int want, prog[U_COUNT];
} cuda_out;

static int emits(const cuda_out *o, int unit) { return o->want < 0 || o->prog[unit] == o->want; }

/* One tensor section's encode instantiation. */
static void gen_encode_section(cuda_out *o, const struct kvf_scheme *s, int t) {
    const kvf_tensor_cfg *c = t ? &s->value : &s->key;
    kvf_buf *b = &o->b;
    char name[160];
    const int g = template_group(c), bf = reads_bf16(c);
    switch (kvf_section_path(c)) {
    case 'T':
        if (!emits(o, U_REST)) break;
        kvf_gen_kernel_name(s, KVF_R_ENCODE_K + t, name, sizeof name);
        kvf_buf_printf(b, "KVF_KIVI_ENCODE_KERNEL(%s, %d, %d, %d, %s)\n", name, s->head_dim, c->bits, g,
                       mode_macro(c->mode));
        break;
    case 'B':
        if (kvf_gen_kmeans_owner(s, t) != t) {
            if (o->want < 0)
                kvf_buf_printf(b, "// value section: the key section's k-means kernels (same template arguments)\n");
            break;
        }
        kmeans_args(s, c, t ? 1 : c->qsac_candidates, name, sizeof name);
        if (emits(o, t ? U_KMEANS_V : U_KMEANS_K))
            kvf_buf_printf(b, "KVF_KMEANS_KERNELS(kvf_%s_%c, %s)\n", s->id, t ? 'v' : 'k', name);
        if (t == 0 && c->qsac_candidates > 1 && emits(o, U_QSAC)) /* kvf_gen_roles' KVF_R_K_ASSIGN_QSAC */
            kvf_buf_printf(b, "KVF_KMEANS_QSAC_KERNEL(kvf_%s_k, %d, %d, %d, %d)\n", s->id, s->head_dim, g,
                           c->qsac_candidates, bf);
        break;
    default:
        if (!emits(o, U_REST)) break;
        kvf_gen_kernel_name(s, KVF_R_ENCODE_K + t, name, sizeof name);
        kvf_buf_printf(b, "KVF_RTN_ENCODE_KERNEL(%s, %d, %d, %d, %s, %s, %d)\n", name, s->head_dim, c->bits, g,
                       mode_macro(c->mode), sfmt_macro(c->scale_format), c->rotation == KVF_ROTATION_HADAMARD);
    }
}

/* The decode: one kvf_decode::section typedef per tensor section, and the
 * kernel that runs both (templates/kvf_decode.cuh). */
static void gen_decode(kvf_buf *b, const struct kvf_scheme *s) {
    char name[160];
    kvf_gen_kernel_name(s, KVF_R_DECODE, name, sizeof name);
    for (int t = 0; t < 2; t++) {
        const kvf_tensor_cfg *c = t ? &s->value : &s->key;
        kvf_buf_printf(b, "typedef kvf_decode::section<%d, %d, %d, %s, %s, %s, %d, %d, %d, %d, %s> %s_%s;\n",
                       s->head_dim, c->bits, template_group(c), mode_macro(c->mode), sfmt_macro(c->scale_format),
                       c->axis == KVF_AXIS_TOKEN ? "KVF_AXIS_TOKEN" : "KVF_AXIS_CHANNEL", c->centroids, c->stages,
                       c->rotation == KVF_ROTATION_HADAMARD, c->psac_rank, rope_macro(s, t == 0), name,
                       t ? "value" : "key");
    }
    kvf_buf_printf(b, "KVF_DECODE_KERNEL(%s, %s_key, %s_value)\n", name, name, name);
}

/* want: -1 for the whole source, else program `want` of n_programs. Every
 * program defines the format and interface globals, which a context checks
 * in each module it loads. */
static char *gen_cuda(const struct kvf_scheme *s, int want) {
    cuda_out o = {.want = want};
    const int n_programs = programs_of(s, o.prog);
    kvf_buf *b = &o.b;
    char name[160];
    header_line(b, s, "//");
    kvf_buf_printf(b, "// Scheme %s (hash %016llx): configuration and instantiations only;\n"
                      "// the algorithms are in the templates included below.\n",
                   s->name, (unsigned long long)s->hash);
    if (want >= 0)
        kvf_buf_printf(b, "// Program %d of %d that the JIT compiles at once (gen/gen.h kvf_gen_output).\n", want + 1,
                       n_programs);
    kvf_buf_printf(b, "#include \"kvf_rtn.cuh\"\n#include \"kvf_kivi.cuh\"\n#include \"kvf_kmeans.cuh\"\n"
                      "#include \"kvf_psac.cuh\"\n#include \"kvf_decode.cuh\"\n\n");
    kvf_buf_printf(b, "KVF_FORMAT_VERSION_GLOBAL(%uu)\nKVF_KERNEL_ABI_GLOBAL(%uu)\n", KVF_FORMAT_VERSION,
                   KVF_KERNEL_ABI);
    kvf_gen_kernel_name(s, KVF_R_HEADER, name, sizeof name);
    if (emits(&o, U_REST)) kvf_buf_printf(b, "KVF_HEADER_KERNEL(%s)\n", name);
    for (int t = 0; t < 2; t++) gen_encode_section(&o, s, t);
    if (emits(&o, U_REST)) {
        gen_decode(b, s);
        kvf_buf_printf(b, "KVF_QSTATS_KERNELS(kvf_%s, %d, %d)\n", s->id, s->head_dim, s->key.psac_rank);
        if (s->key.psac_rank > 0)
            kvf_buf_printf(b, "KVF_PSAC_KERNELS(kvf_%s, %d, %d)\n", s->id, s->head_dim, s->key.psac_rank);
        if (s->key.qsac_candidates > 1) kvf_buf_printf(b, "KVF_QSAC_WEIGHTS_KERNEL(kvf_%s, %d)\n", s->id, s->head_dim);
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
    kvf_buf_printf(&b, "   Layout constants, kernel names and typed wrappers for scheme %s. */\n", s->name);
    kvf_buf_printf(&b, "#ifndef %s_H\n#define %s_H\n#include <stddef.h>\n#include <stdint.h>\n", up, up);
    kvf_buf_printf(&b, "#include \"kvforge.h\"\n\n");
    kvf_buf_printf(&b, "#define %s_HASH 0x%016llxull\n", up, (unsigned long long)s->hash);
    kvf_buf_printf(&b, "#define %s_HEAD_DIM %d\n", up, s->head_dim);
    kvf_buf_printf(&b, "#define %s_HEADER_BYTES %u\n", up, KVF_HEADER_BYTES);
    section_defines(&b, up, "KEY", &l->key);
    section_defines(&b, up, "VALUE", &l->value);
    int roles[KVF_ROLE_COUNT];
    kvf_buf_printf(&b, "#define %s_KERNEL_COUNT %d\n\n", up, kvf_gen_kernels(s, roles));
    kvf_buf_printf(&b, "extern const char kvf_%s_scheme[];       /* canonical configuration */\n", s->id);
    kvf_buf_printf(&b, "extern const char kvf_%s_cuda_source[];  /* %s.cu, for JIT */\n", s->id, s->id);
    kvf_buf_printf(&b, "extern const char *const kvf_%s_kernel_names[%s_KERNEL_COUNT];\n\n", s->id, up);
    kvf_buf_printf(&b, "/* Load the scheme this file was generated from. */\n"
                       "int kvf_%s_load_scheme(kvf_scheme **out);\n", s->id);
    kvf_buf_printf(&b, "/* Encode/decode a head-major [n_heads][n_tokens][%d] BF16 chunk; fail with\n"
                       "   KVF_EINVAL if ctx was made for another scheme. */\n", s->head_dim);
    kvf_buf_printf(&b, "int kvf_%s_encode(kvf_context *ctx, const void *k, const void *v, int64_t n_tokens,\n"
                       "    int32_t n_heads, void *packed, size_t packed_bytes, void *stream);\n", s->id);
    kvf_buf_printf(&b, "int kvf_%s_decode(kvf_context *ctx, const void *packed, size_t packed_bytes,\n"
                       "    int64_t n_tokens, int32_t n_heads, void *k_out, void *v_out, void *stream);\n", s->id);
    kvf_buf_printf(&b, "\n#endif\n");
    return kvf_buf_take(&b);
}

/* ------------------------------------------------------------------ C source */

static char *gen_c(const struct kvf_scheme *s, const char *cuda) {
    kvf_buf b = {0};
    char up[128], name[160];
    upper_id(s, up, sizeof up);
    header_line(&b, s, "/*");
    kvf_buf_printf(&b, "   Configuration data and wrappers for scheme %s. */\n", s->name);
    kvf_buf_printf(&b, "#include \"%s.h\"\n\n", s->id);
    kvf_buf_printf(&b, "const char kvf_%s_scheme[] =\n    ", s->id);
    kvf_buf_c_string(&b, s->canonical, strlen(s->canonical));
    kvf_buf_printf(&b, ";\n\nconst char kvf_%s_cuda_source[] =\n    ", s->id);
    kvf_buf_c_string(&b, cuda, strlen(cuda));
    kvf_buf_printf(&b, ";\n\nconst char *const kvf_%s_kernel_names[%s_KERNEL_COUNT] = {\n", s->id, up);
    int roles[KVF_ROLE_COUNT];
    for (int i = 0, n = kvf_gen_kernels(s, roles); i < n; i++) {
        kvf_gen_kernel_name(s, roles[i], name, sizeof name);
        kvf_buf_printf(&b, "    \"%s\",\n", name);
    }
    kvf_buf_printf(&b, "};\n\n");
    kvf_buf_printf(&b,
                   "int kvf_%s_load_scheme(kvf_scheme **out) {\n"
                   "    return kvf_scheme_load_string(kvf_%s_scheme, sizeof kvf_%s_scheme - 1, \"=%s\", out);\n"
                   "}\n\n", s->id, s->id, s->id, s->id);
    kvf_buf_printf(&b,
                   "static int check_ctx(kvf_context *ctx) {\n"
                   "    if (!ctx || kvf_scheme_hash(kvf_context_scheme(ctx)) != %s_HASH) return KVF_EINVAL;\n"
                   "    return KVF_OK;\n"
                   "}\n\n", up);
    kvf_buf_printf(&b,
                   "int kvf_%s_encode(kvf_context *ctx, const void *k, const void *v, int64_t n_tokens,\n"
                   "    int32_t n_heads, void *packed, size_t packed_bytes, void *stream) {\n"
                   "    kvf_shape shape = {n_tokens, n_heads, 0, 0};\n"
                   "    int rc = check_ctx(ctx);\n"
                   "    return rc ? rc : kvf_encode(ctx, k, v, &shape, NULL, packed, packed_bytes, stream);\n"
                   "}\n\n", s->id);
    kvf_buf_printf(&b,
                   "int kvf_%s_decode(kvf_context *ctx, const void *packed, size_t packed_bytes,\n"
                   "    int64_t n_tokens, int32_t n_heads, void *k_out, void *v_out, void *stream) {\n"
                   "    kvf_shape shape = {n_tokens, n_heads, 0, 0};\n"
                   "    int rc = check_ctx(ctx);\n"
                   "    return rc ? rc : kvf_decode(ctx, packed, packed_bytes, &shape, NULL, k_out, v_out, stream);\n"
                   "}\n", s->id);
    return kvf_buf_take(&b);
}

static char *file_name(const struct kvf_scheme *s, const char *ext) {
    size_t n = strlen(s->id) + strlen(ext) + 1;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s%s", s->id, ext);
    return p;
}

/* What the kernels of templates/ cannot do although the scheme is valid. */
static int gpu_check(const struct kvf_scheme *s) {
    int r = s->key.psac_rank;
    if (r > 0 && (r > 32 || (r & (r - 1))))
        return kvf_set_error(KVF_ENOTIMPL,
                             "key.psac_rank = %d: the GPU PSAC kernel needs a power of two up to 32 "
                             "(the CPU backend, KVF_DEVICE_CPU, takes any rank)", r);
    /* kvf_qstats::eigen holds U and M U of a head in static shared memory (2 x d x r f32, within 48 KB). */
    if (r > 0 && s->head_dim * r > 4096)
        return kvf_set_error(KVF_ENOTIMPL,
                             "key.psac_rank = %d with head_dim = %d: the GPU statistics kernel needs head_dim x "
                             "psac_rank <= 4096 (the CPU backend, KVF_DEVICE_CPU, takes any rank)",
                             r, s->head_dim);
    /* gen_encode_section and kvf_gen_roles give values the plain nearest centroid. */
    if (s->value.qsac_candidates > 1)
        return kvf_set_error(KVF_ENOTIMPL,
                             "value.qsac_candidates = %d: the GPU encoder runs QSAC for keys only "
                             "(the CPU backend, KVF_DEVICE_CPU, has it for values, with w = 1)",
                             s->value.qsac_candidates);
    return KVF_OK;
}

/* The checks every output needs: methods, the GPU's limits, a layout. */
static int gen_check(const struct kvf_scheme *s, kvf_layout *l) {
    int rc = kvf_scheme_check_supported(s);
    if (!rc) rc = gpu_check(s);
    if (!rc) rc = kvf_layout_compute(s, 1, 1, l);
    return rc;
}

static int out_of_memory(const struct kvf_scheme *s, kvf_gen_output *out) {
    kvf_gen_output_free(out);
    return kvf_set_error(KVF_ENOMEM, "generator: out of memory for scheme %s", s->name);
}

/* out->program and out->program_name (the JIT's programs). */
static int gen_programs(const struct kvf_scheme *s, kvf_gen_output *out) {
    int prog[U_COUNT], bad = 0;
    out->n_programs = programs_of(s, prog);
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
    out->c = out->cu ? gen_c(s, out->cu) : NULL;
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

int kvf_write_file(const char *path, const void *data, size_t n) {
    size_t plen = strlen(path);
    char *tmp = malloc(plen + 16);
    if (!tmp) return kvf_set_error(KVF_ENOMEM, "out of memory writing %s", path);
    snprintf(tmp, plen + 16, "%s.tmp.XXXXXX", path);
    int fd = mkstemp(tmp);
    if (fd < 0) {
        int e = errno;
        free(tmp);
        return kvf_set_error(KVF_EIO, "cannot create a file beside %s: %s", path, strerror(e));
    }
    const char *p = data;
    size_t left = n;
    while (left) {
        ssize_t w = write(fd, p, left);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            int e = errno;
            close(fd); unlink(tmp); free(tmp);
            return kvf_set_error(KVF_EIO, "writing %s: %s", path, strerror(e));
        }
        p += w;
        left -= (size_t)w;
    }
    fchmod(fd, 0644);
    if (close(fd) || rename(tmp, path)) {
        int e = errno;
        unlink(tmp); free(tmp);
        return kvf_set_error(KVF_EIO, "writing %s: %s", path, strerror(e));
    }
    free(tmp);
    return KVF_OK;
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
