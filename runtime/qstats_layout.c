/*
 * Layout of a query-statistics buffer (docs/METHODS.md section 4): a 64-byte
 * header, then count f64 [H], msum f32 [H][d][d], u f32 [H][d][r] and lambda
 * f32 [H][r], each at the next multiple of 256. This file computes offsets and
 * checks headers; runtime/ref_qstats.c fills and updates the buffer.
 */
#include "internal.h"

#include <inttypes.h>
#include <string.h>

#define QSTATS_VERSION 1u

/* The 64-byte header, little-endian. */
typedef struct qstats_header {
    uint32_t magic, version, n_heads, head_dim, rank;
    uint32_t reserved[11];
} qstats_header;
_Static_assert(sizeof(qstats_header) == KVF_HEADER_BYTES, "qstats header is 64 bytes");

typedef struct qplacer {
    size_t off;
    bool overflow;
} qplacer;

/* Next multiple of 256 for a plane of a * b * c bytes; returns its offset. */
static size_t qplace(qplacer *p, size_t a, size_t b, size_t c) {
    size_t start, n, end;
    if (p->overflow || __builtin_add_overflow(p->off, (size_t)KVF_PLANE_ALIGN - 1, &start) ||
        __builtin_mul_overflow(a, b, &n) || __builtin_mul_overflow(n, c, &n)) {
        p->overflow = true;
        return 0;
    }
    start &= ~(size_t)(KVF_PLANE_ALIGN - 1);
    if (__builtin_add_overflow(start, n, &end)) {
        p->overflow = true;
        return 0;
    }
    p->off = end;
    return start;
}

int kvf_qstats_layout_compute(const struct kvf_scheme *s, int32_t n_heads, kvf_qstats_layout *out) {
    if (!s || !out) return kvf_set_error(KVF_EINVAL, "kvf_qstats_layout_compute: NULL argument");
    if (n_heads < 1)
        return kvf_set_error(KVF_EINVAL, "query statistics: n_heads = %" PRId32 ": must be >= 1", n_heads);
    if (s->head_dim < 1 || s->key.psac_rank < 0 || s->key.psac_rank >= s->head_dim)
        return kvf_set_error(KVF_ESCHEME, "query statistics: head_dim = %d, key.psac_rank = %d", s->head_dim,
                             s->key.psac_rank);
    memset(out, 0, sizeof *out);
    out->n_heads = n_heads;
    out->head_dim = s->head_dim;
    out->rank = s->key.psac_rank;
    size_t h = (size_t)n_heads, d = (size_t)s->head_dim, r = (size_t)out->rank;
    qplacer p = {KVF_HEADER_BYTES, false};
    out->count_off = qplace(&p, h, 1, sizeof(double));
    out->msum_off = qplace(&p, h, d * d, sizeof(float));
    out->u_off = qplace(&p, h, d * r, sizeof(float));
    out->lambda_off = qplace(&p, h, r, sizeof(float));
    out->total_bytes = qplace(&p, 0, 0, 0); /* the end, rounded up to 256 */
    if (p.overflow)
        return kvf_set_error(KVF_EINVAL, "query statistics of %" PRId32 " heads: size overflows", n_heads);
    return KVF_OK;
}

int kvf_qstats_check(const struct kvf_scheme *s, const void *qstats, size_t bytes, int32_t n_heads) {
    if (!s || !qstats) return kvf_set_error(KVF_EINVAL, "kvf_qstats_check: NULL argument");
    if (bytes < KVF_HEADER_BYTES)
        return kvf_set_error(KVF_ERANGE, "query statistics: %zu bytes given, the header alone is %u", bytes,
                             KVF_HEADER_BYTES);
    qstats_header hd;
    memcpy(&hd, qstats, sizeof hd);
    if (hd.magic != KVF_QSTATS_MAGIC)
        return kvf_set_error(KVF_EFORMAT,
                             "not a kvforge query-statistics buffer: magic 0x%08" PRIx32
                             ", expected 0x%08" PRIx32 " (\"KVFQ\"; kvf_qstats_init writes it)",
                             hd.magic, (uint32_t)KVF_QSTATS_MAGIC);
    if (hd.version != QSTATS_VERSION)
        return kvf_set_error(KVF_EFORMAT, "query statistics have version %" PRIu32 ", this library reads %u",
                             hd.version, QSTATS_VERSION);
    if (hd.head_dim != (uint32_t)s->head_dim)
        return kvf_set_error(KVF_EFORMAT, "query statistics: head_dim is %" PRIu32 ", the scheme's is %d",
                             hd.head_dim, s->head_dim);
    if (hd.rank != (uint32_t)s->key.psac_rank)
        return kvf_set_error(KVF_EFORMAT,
                             "query statistics: rank is %" PRIu32 ", the scheme's key.psac_rank is %d",
                             hd.rank, s->key.psac_rank);
    if (hd.n_heads < 1 || hd.n_heads > INT32_MAX || (n_heads > 0 && hd.n_heads != (uint32_t)n_heads))
        return kvf_set_error(KVF_EFORMAT, "query statistics: n_heads is %" PRIu32 ", expected %" PRId32,
                             hd.n_heads, n_heads);
    for (int i = 0; i < 11; i++)
        if (hd.reserved[i])
            return kvf_set_error(KVF_EFORMAT, "query statistics: reserved header bytes are not zero");
    kvf_qstats_layout l;
    int rc = kvf_qstats_layout_compute(s, (int32_t)hd.n_heads, &l);
    if (rc) return rc;
    if (bytes < l.total_bytes)
        return kvf_set_error(KVF_ERANGE, "query statistics: %zu bytes given, %" PRIu32 " heads need %zu", bytes,
                             hd.n_heads, l.total_bytes);
    return KVF_OK;
}

int kvf_qstats_size(const kvf_scheme *s, int32_t n_kv_heads, size_t *bytes) {
    if (!s || !bytes) return kvf_set_error(KVF_EINVAL, "kvf_qstats_size: NULL argument");
    kvf_qstats_layout l;
    int rc = kvf_qstats_layout_compute(s, n_kv_heads, &l);
    if (rc) return rc;
    *bytes = l.total_bytes;
    return KVF_OK;
}
