/*
 * Packed cache layout (format version 2): plane offsets, the 64-byte header,
 * shapes and strides. docs/FORMAT.md describes the bytes; this file is the
 * one place that computes them.
 */
#include "internal.h"

#include <inttypes.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kvforge stores little-endian planes and assumes a little-endian host"
#endif

/* ---------------------------------------------------------- size arithmetic */

static int mul_size(size_t a, size_t b, size_t *out) { return __builtin_mul_overflow(a, b, out); }
static int add_size(size_t a, size_t b, size_t *out) { return __builtin_add_overflow(a, b, out); }

/* Round up to KVF_PLANE_ALIGN; nonzero on overflow. */
static int align_up(size_t x, size_t *out) {
    if (add_size(x, KVF_PLANE_ALIGN - 1, out)) return 1;
    *out &= ~(size_t)(KVF_PLANE_ALIGN - 1);
    return 0;
}

/* ----------------------------------------------------------------- layout */

/* Places planes one after the other, each at the next multiple of 256. */
typedef struct placer {
    size_t off;
    bool overflow;
} placer;

static void place(placer *p, size_t a, size_t b, size_t *off, size_t *bytes) {
    size_t start, n, end;
    if (p->overflow || align_up(p->off, &start) || mul_size(a, b, &n) || add_size(start, n, &end)) {
        p->overflow = true;
        return;
    }
    *off = start;
    *bytes = n;
    p->off = end;
}

/* Stage 0's quantized planes: codes, then (below bits 16) scales, token scales
 * and zeros. */
static void place_quant(placer *p, const kvf_section_layout *l, size_t rows, size_t heads, int head_dim,
                        kvf_stage_layout *st) {
    size_t gpt = (size_t)l->groups_per_token;
    place(p, rows, l->code_bytes_per_token, &st->codes_off, &st->codes_bytes);
    if (l->bits == 16) return;
    bool affine = l->mode == KVF_MODE_AFFINE;
    if (l->axis == KVF_AXIS_TOKEN) {
        size_t grows = heads * (size_t)l->groups_along_tokens; /* cannot overflow: <= rows */
        place(p, grows, (size_t)head_dim * 2, &st->scales_off, &st->scales_bytes);
        if (affine) place(p, grows, (size_t)head_dim * 2, &st->zeros_off, &st->zeros_bytes);
    } else if (l->scale_format == KVF_SCALE_FP16 || l->scale_format == KVF_SCALE_FP8) {
        const size_t b = l->scale_format == KVF_SCALE_FP8 ? 1 : 2; /* an fp16 or FP8 E4M3 scale (and zero) a group */
        place(p, rows, gpt * b, &st->scales_off, &st->scales_bytes);
        if (affine) place(p, rows, gpt * b, &st->zeros_off, &st->zeros_bytes);
    } else {
        place(p, rows, gpt, &st->scales_off, &st->scales_bytes);   /* u8 group scale codes */
        place(p, rows, 2, &st->tscales_off, &st->tscales_bytes);   /* fp16 token scales */
        if (affine) place(p, rows, gpt, &st->zeros_off, &st->zeros_bytes); /* int8 zero codes */
    }
}

/* A stage's centroid indices and centroids (METHODS.md section 7; stage 0's
 * come after its quantized planes, into which the last residual goes). */
static void place_centroids(placer *p, const kvf_section_layout *l, size_t rows, size_t heads, int head_dim,
                            kvf_stage_layout *st) {
    if (l->centroids > 0) { /* 0 at bits 16 */
        place(p, rows, 1, &st->index_off, &st->index_bytes);
        place(p, heads * (size_t)l->centroids, (size_t)head_dim * 2, &st->centroids_off,
              &st->centroids_bytes);
    }
}

/* Place the planes of one section (its plan: bits 16 has fixed values for the
 * fields it does not read) from p->off on. */
static void place_section(placer *p, const kvf_section_plan *c, int head_dim, int64_t n_tokens, size_t heads,
                          kvf_section_layout *l) {
    size_t rows = (size_t)n_tokens * heads; /* checked by the caller */
    memset(l, 0, sizeof *l);
    l->bits = c->bits;
    l->mode = c->mode;
    l->axis = c->axis;
    l->scale_format = c->scale_format;
    l->group_size = c->bits < 16 ? c->group : head_dim;
    l->groups_per_token = c->bits < 16 && c->axis == KVF_AXIS_CHANNEL ? head_dim / c->group : 0;
    l->groups_along_tokens = c->bits < 16 && c->axis == KVF_AXIS_TOKEN ? (n_tokens + c->group - 1) / c->group : 0;
    l->centroids = c->centroids;
    l->stages = c->stages;
    l->psac_rank = c->psac_rank;
    l->rotation = c->rotation;
    /* ternary implies bits 2 (the plan's rule) */
    l->code_bytes_per_token = c->mode == KVF_MODE_TERNARY ? (size_t)KVF_TERNARY_ROW_BYTES(head_dim)
                                                          : (size_t)head_dim * (size_t)c->bits / 8;
    place_quant(p, l, rows, heads, head_dim, &l->stage[0]);
    for (int s = 0; s < l->stages; s++) place_centroids(p, l, rows, heads, head_dim, &l->stage[s]);
    if (l->psac_rank > 0) {
        size_t r = (size_t)l->psac_rank;
        place(p, heads * (size_t)head_dim, r, &l->basis_off, &l->basis_bytes);
        place(p, heads, 4, &l->bscale_off, &l->bscale_bytes);
        place(p, rows, r, &l->coef_off, &l->coef_bytes);
        place(p, rows, 2, &l->cscale_off, &l->cscale_bytes);
    }
    l->outliers = c->outliers;
    l->mp_channels = c->mp_channels;
    l->mp_bits = c->mp_bits;
    if (c->outliers > 0) {
        place(p, rows, (size_t)c->outliers, &l->oidx_off, &l->oidx_bytes);
        place(p, rows, (size_t)c->outliers * 2, &l->oval_off, &l->oval_bytes);
    }
    if (c->mp_channels > 0) {
        place(p, heads, (size_t)head_dim, &l->mmap_off, &l->mmap_bytes);
        place(p, rows, (size_t)c->mp_channels * (size_t)c->mp_bits / 8, &l->mcode_off, &l->mcode_bytes);
        place(p, rows, 2, &l->mscale_off, &l->mscale_bytes);
    }
}

int kvf_layout_compute(const struct kvf_scheme *s, int64_t n_tokens, int32_t n_heads,
                       kvf_layout *out) {
    if (!s || !out) return kvf_set_error(KVF_EINVAL, "kvf_layout_compute: NULL argument");
    if (n_tokens < 1) return kvf_set_error(KVF_EINVAL, "n_tokens = %" PRId64 ": must be >= 1", n_tokens);
    if (n_heads < 1) return kvf_set_error(KVF_EINVAL, "n_heads = %" PRId32 ": must be >= 1", n_heads);
    memset(out, 0, sizeof *out);
    out->n_tokens = n_tokens;
    out->n_heads = n_heads;
    out->head_dim = s->head_dim;
    size_t rows;
    placer p = {KVF_HEADER_BYTES, false};
    if ((uint64_t)n_tokens > SIZE_MAX || mul_size((size_t)n_tokens, (size_t)n_heads, &rows))
        p.overflow = true;
    if (!p.overflow) place_section(&p, &s->plan.sec[0], s->head_dim, n_tokens, (size_t)n_heads, &out->key);
    if (!p.overflow) place_section(&p, &s->plan.sec[1], s->head_dim, n_tokens, (size_t)n_heads, &out->value);
    if (p.overflow || align_up(p.off, &out->total_bytes))
        return kvf_set_error(KVF_EINVAL, "%" PRId64 " tokens x %" PRId32 " heads: packed size overflows",
                             n_tokens, n_heads);
    return KVF_OK;
}

void kvf_header_fill(const struct kvf_scheme *s, const kvf_layout *l, kvf_packed_header *h) {
    memset(h, 0, sizeof *h);
    h->magic = KVF_PACKED_MAGIC;
    h->format_version = KVF_FORMAT_VERSION;
    h->scheme_hash = s->hash;
    h->n_tokens = (uint64_t)l->n_tokens;
    h->n_heads = (uint32_t)l->n_heads;
    h->head_dim = (uint32_t)l->head_dim;
    h->total_bytes = l->total_bytes;
    h->key_bits = (uint8_t)l->key.bits;
    h->value_bits = (uint8_t)l->value.bits;
}

/* ------------------------------------------------------------ public API */

int kvf_packed_size(const kvf_scheme *s, int64_t n_tokens, int32_t n_heads, size_t *bytes) {
    if (!s || !bytes) return kvf_set_error(KVF_EINVAL, "kvf_packed_size: NULL argument");
    kvf_layout l;
    int rc = kvf_layout_compute(s, n_tokens, n_heads, &l);
    if (rc) return rc;
    *bytes = l.total_bytes;
    return KVF_OK;
}

int kvf_warm_check(const kvf_scheme *s, const void *prev, size_t prev_bytes, int64_t prev_n_tokens, int32_t n_heads,
                   const void *packed, size_t packed_bytes, kvf_layout *L) {
    if (prev_n_tokens < 1)
        return kvf_set_error(KVF_EINVAL, "the previous span has %lld tokens: at least 1", (long long)prev_n_tokens);
    int rc = kvf_layout_compute(s, prev_n_tokens, n_heads, L);
    if (rc) return rc;
    if (prev_bytes < L->total_bytes)
        return kvf_set_error(KVF_ERANGE, "%zu bytes given, %zu needed for %lld tokens x %d heads", prev_bytes,
                             L->total_bytes, (long long)prev_n_tokens, (int)n_heads);
    const uintptr_t p = (uintptr_t)prev, o = (uintptr_t)packed; /* two buffers: compared as addresses */
    if (p < o + packed_bytes && o < p + L->total_bytes) return kvf_set_error(KVF_EINVAL, "it overlaps the output");
    return KVF_OK;
}

int kvf_footprint_of(const kvf_scheme *s, int64_t n_tokens, int32_t n_heads, kvf_footprint *out) {
    if (!s || !out) return kvf_set_error(KVF_EINVAL, "kvf_footprint_of: NULL argument");
    size_t packed;
    int rc = kvf_packed_size(s, n_tokens, n_heads, &packed);
    if (rc) return rc;
    /* Values of K and V together: 2 * N * H * d (no overflow: the packed size,
     * which is at least a quarter of a byte per value, did not overflow). */
    double values = 2.0 * (double)n_tokens * (double)n_heads * (double)s->head_dim;
    size_t bf16;
    if (mul_size((size_t)n_tokens * (size_t)n_heads, (size_t)s->head_dim * 4, &bf16))
        return kvf_set_error(KVF_EINVAL, "kvf_footprint_of: BF16 size overflows");
    out->packed_bytes = packed;
    out->bf16_bytes = bf16;
    out->compression = (double)bf16 / (double)packed;
    out->bits_per_value = 8.0 * (double)packed / values;
    return KVF_OK;
}

static int header_mismatch_u64(const char *field, uint64_t got, uint64_t want) {
    return kvf_set_error(KVF_EFORMAT, "packed cache header: %s is %" PRIu64 ", expected %" PRIu64,
                         field, got, want);
}

int kvf_packed_check(const kvf_scheme *s, const void *header, size_t header_bytes,
                     int64_t n_tokens, int32_t n_heads) {
    if (!s || !header) return kvf_set_error(KVF_EINVAL, "kvf_packed_check: NULL argument");
    if (header_bytes < KVF_HEADER_BYTES)
        return kvf_set_error(KVF_ERANGE, "packed cache header: %zu bytes given, the header is %u",
                             header_bytes, KVF_HEADER_BYTES);
    kvf_layout l;
    int rc = kvf_layout_compute(s, n_tokens, n_heads, &l);
    if (rc) return rc;
    kvf_packed_header h, want;
    memcpy(&h, header, sizeof h);
    kvf_header_fill(s, &l, &want);

    if (h.magic != KVF_PACKED_MAGIC)
        return kvf_set_error(KVF_EFORMAT,
                             "not a kvforge packed cache: magic 0x%08" PRIx32 ", expected 0x%08" PRIx32
                             " (\"KVF1\")", h.magic, (uint32_t)KVF_PACKED_MAGIC);
    if (h.format_version != KVF_FORMAT_VERSION)
        return kvf_set_error(KVF_EFORMAT,
                             "packed cache has format version %" PRIu32 ", this library reads version %u",
                             h.format_version, KVF_FORMAT_VERSION);
    if (h.scheme_hash != want.scheme_hash)
        return kvf_set_error(KVF_EFORMAT,
                             "packed cache was written by scheme hash %016" PRIx64
                             ", this scheme is %016" PRIx64 " (%s)",
                             h.scheme_hash, want.scheme_hash, s->name);
    if (h.head_dim != want.head_dim) return header_mismatch_u64("head_dim", h.head_dim, want.head_dim);
    if (h.key_bits != want.key_bits) return header_mismatch_u64("key_bits", h.key_bits, want.key_bits);
    if (h.value_bits != want.value_bits)
        return header_mismatch_u64("value_bits", h.value_bits, want.value_bits);
    if (h.n_tokens != want.n_tokens) return header_mismatch_u64("n_tokens", h.n_tokens, want.n_tokens);
    if (h.n_heads != want.n_heads) return header_mismatch_u64("n_heads", h.n_heads, want.n_heads);
    if (h.total_bytes != want.total_bytes)
        return header_mismatch_u64("total_bytes", h.total_bytes, want.total_bytes);
    if (memcmp(h.reserved0, want.reserved0, sizeof h.reserved0) ||
        memcmp(h.reserved, want.reserved, sizeof h.reserved))
        return kvf_set_error(KVF_EFORMAT, "packed cache header: reserved bytes are not zero");
    return KVF_OK;
}

/* ----------------------------------------------------------------- shapes */

/*
 * A stride of 0 takes its head-major contiguous value: token_stride = head_dim,
 * then head_stride = n_tokens * token_stride. The element map must be one to
 * one: sorting the two outer dimensions by stride, each must step past the
 * whole extent of the ones inside it. A dimension of extent 1 is never
 * stepped, so its stride only has to be non-negative.
 */
int kvf_shape_resolve(const kvf_shape *in, int head_dim, kvf_shape *out) {
    if (!in || !out) return kvf_set_error(KVF_EINVAL, "shape is NULL");
    if (head_dim < 1) return kvf_set_error(KVF_EINVAL, "head_dim = %d: must be >= 1", head_dim);
    if (in->n_tokens < 1)
        return kvf_set_error(KVF_EINVAL, "shape.n_tokens = %" PRId64 ": must be >= 1", in->n_tokens);
    if (in->n_heads < 1)
        return kvf_set_error(KVF_EINVAL, "shape.n_heads = %" PRId32 ": must be >= 1", in->n_heads);
    if (in->token_stride < 0)
        return kvf_set_error(KVF_EINVAL, "shape.token_stride = %" PRId64 ": must be >= 0 (0 = contiguous)",
                             in->token_stride);
    if (in->head_stride < 0)
        return kvf_set_error(KVF_EINVAL, "shape.head_stride = %" PRId64 ": must be >= 0 (0 = contiguous)",
                             in->head_stride);

    kvf_shape r = *in;
    if (r.token_stride == 0) r.token_stride = head_dim;
    if (r.head_stride == 0 && __builtin_mul_overflow(r.n_tokens, r.token_stride, &r.head_stride))
        return kvf_set_error(KVF_EINVAL, "shape: n_tokens * token_stride overflows");

    /* Span of the last element + 1 must fit in int64. */
    int64_t a, b, span;
    if (__builtin_mul_overflow(r.n_tokens - 1, r.token_stride, &a) ||
        __builtin_mul_overflow((int64_t)r.n_heads - 1, r.head_stride, &b) ||
        __builtin_add_overflow(a, b, &span) || __builtin_add_overflow(span, (int64_t)head_dim, &span))
        return kvf_set_error(KVF_EINVAL, "shape: the tensor's extent overflows int64");

    int tok_outer = r.n_tokens > 1, head_outer = r.n_heads > 1;
    if (tok_outer && head_outer) {
        if (r.token_stride <= r.head_stride) {
            if (r.token_stride < head_dim)
                return kvf_set_error(KVF_EINVAL,
                                     "shape.token_stride = %" PRId64 ": tokens overlap (must be >= head_dim = %d)",
                                     r.token_stride, head_dim);
            if (r.head_stride < (r.n_tokens - 1) * r.token_stride + head_dim)
                return kvf_set_error(KVF_EINVAL,
                                     "shape.head_stride = %" PRId64 ": heads overlap (must be >= %" PRId64
                                     " for %" PRId64 " tokens of stride %" PRId64 ")",
                                     r.head_stride, (r.n_tokens - 1) * r.token_stride + head_dim,
                                     r.n_tokens, r.token_stride);
        } else {
            if (r.head_stride < head_dim)
                return kvf_set_error(KVF_EINVAL,
                                     "shape.head_stride = %" PRId64 ": heads overlap (must be >= head_dim = %d)",
                                     r.head_stride, head_dim);
            if (r.token_stride < ((int64_t)r.n_heads - 1) * r.head_stride + head_dim)
                return kvf_set_error(KVF_EINVAL,
                                     "shape.token_stride = %" PRId64 ": tokens overlap (must be >= %" PRId64
                                     " for %" PRId32 " heads of stride %" PRId64 ")",
                                     r.token_stride, ((int64_t)r.n_heads - 1) * r.head_stride + head_dim,
                                     r.n_heads, r.head_stride);
        }
    } else if (tok_outer && r.token_stride < head_dim) {
        return kvf_set_error(KVF_EINVAL,
                             "shape.token_stride = %" PRId64 ": tokens overlap (must be >= head_dim = %d)",
                             r.token_stride, head_dim);
    } else if (head_outer && r.head_stride < head_dim) {
        return kvf_set_error(KVF_EINVAL,
                             "shape.head_stride = %" PRId64 ": heads overlap (must be >= head_dim = %d)",
                             r.head_stride, head_dim);
    }
    *out = r;
    return KVF_OK;
}
