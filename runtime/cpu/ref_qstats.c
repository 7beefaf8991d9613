/*
 * Query statistics of QuantWM on host memory (docs/METHODS.md section 4): the
 * buffer layout, its header check, the running sum of q q^T per KV head and
 * the top-r eigenvectors of the mean by orthogonal iteration.
 *
 * Arithmetic (METHODS.md 4, "Decisions"): a chunk's sum of q q^T is
 * accumulated in f64 (exact for bf16 queries in any order) and added to the
 * f32 sums with one rounding. M and U are f32; inside the orthogonal
 * iteration Z = M U, its Gram-Schmidt and the Rayleigh quotients are f64
 * (sums in channel order), each new column rounded to f32 once normalized.
 *
 * Non-finite queries (METHODS.md 4): a query row (one head's d values of one
 * token) holding a NaN or an Inf is left out entirely, counted in the
 * header's `skipped`; the statistics are those of the chunk without it.
 */
#include "cpu/ref.h"

#include <inttypes.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#define QSTATS_HEADER_BYTES 64u
#define QSTATS_ALIGN 256u
#define COLD_ITERS 24
#define WARM_ITERS 6
/* A column whose norm after Gram-Schmidt is at most this fraction of its norm
 * before is treated as zero (it lay in the span of the previous columns up to
 * f64 rounding) and replaced by a unit vector. */
#define ZERO_COLUMN_RATIO 1e-10
/* A unit vector e_c is "not in the span" when its part orthogonal to the
 * previous columns has at least this norm. */
#define UNIT_RESIDUAL_MIN 0.5

typedef struct qstats_header {
    uint32_t magic, version, n_heads, head_dim, rank, reserved0;
    uint64_t skipped; /* query rows left out because they held NaN or Inf (version 2) */
    uint32_t reserved[8];
} qstats_header;
_Static_assert(offsetof(qstats_header, skipped) == 24, "skipped at byte 24 (the GPU template writes it there)");
_Static_assert(sizeof(qstats_header) == QSTATS_HEADER_BYTES, "qstats header is 64 bytes");

/* ------------------------------------------------------------------ layout */

static int align_up(size_t x, size_t *out) {
    if (__builtin_add_overflow(x, QSTATS_ALIGN - 1, out)) return 1;
    *out &= ~(size_t)(QSTATS_ALIGN - 1);
    return 0;
}

/* Place a plane of n elements of `size` bytes at the next aligned offset. */
static int place_plane(size_t *off, size_t n, size_t size, size_t *plane_off) {
    size_t bytes;
    return align_up(*off, plane_off) || __builtin_mul_overflow(n, size, &bytes) ||
           __builtin_add_overflow(*plane_off, bytes, off);
}

static int layout_of(int32_t n_heads, int d, int r, kvf_qstats_layout *out) {
    memset(out, 0, sizeof *out);
    out->n_heads = n_heads;
    out->head_dim = d;
    out->rank = r;
    size_t h = (size_t)n_heads, dd = (size_t)d, off = QSTATS_HEADER_BYTES;
    int bad = place_plane(&off, h, sizeof(double), &out->count_off) ||
              place_plane(&off, h * dd * dd, sizeof(float), &out->msum_off);
    if (!bad && r > 0)
        bad = place_plane(&off, h * dd * (size_t)r, sizeof(float), &out->u_off) ||
              place_plane(&off, h * (size_t)r, sizeof(float), &out->lambda_off);
    if (bad || align_up(off, &out->total_bytes))
        return kvf_set_error(KVF_EINVAL, "query statistics of %" PRId32 " heads x head_dim %d: size overflows",
                             n_heads, d);
    return KVF_OK;
}

int kvf_qstats_layout_compute(const struct kvf_scheme *s, int32_t n_heads, kvf_qstats_layout *out) {
    if (!s || !out) return kvf_set_error(KVF_EINVAL, "kvf_qstats_layout_compute: NULL argument");
    if (n_heads < 1) return kvf_set_error(KVF_EINVAL, "n_kv_heads = %" PRId32 ": must be >= 1", n_heads);
    /* head_dim and psac_rank obey the plan's rules (kvf_plan_build). */
    return layout_of(n_heads, s->head_dim, s->key.psac_rank, out);
}

int kvf_qstats_size(const kvf_scheme *s, int32_t n_kv_heads, size_t *bytes) {
    if (!s || !bytes) return kvf_set_error(KVF_EINVAL, "kvf_qstats_size: NULL argument");
    kvf_qstats_layout l;
    int rc = kvf_qstats_layout_compute(s, n_kv_heads, &l);
    if (rc) return rc;
    *bytes = l.total_bytes;
    return KVF_OK;
}

/* ------------------------------------------------------------ header check */

static int header_mismatch(const char *field, uint32_t got, uint32_t want) {
    return kvf_set_error(KVF_EFORMAT, "query statistics header: %s is %" PRIu32 ", expected %" PRIu32, field,
                         got, want);
}

/* Copy a host buffer's header and check its size, magic and version (the
 * checks kvf_qstats_check and kvf_qstats_skipped share); `who` starts the
 * messages. */
static int read_header(const void *buf, size_t bytes, const char *who, qstats_header *h) {
    if (bytes < QSTATS_HEADER_BYTES)
        return kvf_set_error(KVF_ERANGE, "%s: %zu bytes given, the header is %u", who, bytes, QSTATS_HEADER_BYTES);
    memcpy(h, buf, sizeof *h);
    if (h->magic != KVF_QSTATS_MAGIC)
        return kvf_set_error(KVF_EFORMAT,
                             "%s: not a kvforge query-statistics buffer: magic 0x%08" PRIx32 ", expected 0x%08" PRIx32
                             " (\"KVFQ\"; was kvf_qstats_init called?)",
                             who, h->magic, (uint32_t)KVF_QSTATS_MAGIC);
    if (h->version != KVF_QSTATS_VERSION)
        return kvf_set_error(KVF_EFORMAT,
                             "%s: version %" PRIu32 ", this library reads %u (make them again with kvf_qstats_init)",
                             who, h->version, KVF_QSTATS_VERSION);
    return KVF_OK;
}

int kvf_qstats_check(const struct kvf_scheme *s, const void *qstats, size_t bytes, int32_t n_heads) {
    if (!s || !qstats) return kvf_set_error(KVF_EINVAL, "query statistics: NULL scheme or buffer");
    if ((uintptr_t)qstats & 15u)
        return kvf_set_error(KVF_EINVAL, "query statistics buffer must be 16-byte aligned");
    qstats_header h;
    int rc = read_header(qstats, bytes, "query statistics", &h);
    if (rc) return rc;
    if (h.head_dim != (uint32_t)s->head_dim) return header_mismatch("head_dim", h.head_dim, (uint32_t)s->head_dim);
    if (h.rank != (uint32_t)s->key.psac_rank)
        return header_mismatch("rank (the scheme's key.psac_rank)", h.rank, (uint32_t)s->key.psac_rank);
    if (h.n_heads < 1 || h.n_heads > INT32_MAX)
        return kvf_set_error(KVF_EFORMAT, "query statistics header: n_heads is %" PRIu32, h.n_heads);
    if (n_heads != 0 && h.n_heads != (uint32_t)n_heads) return header_mismatch("n_heads", h.n_heads, (uint32_t)n_heads);
    for (int i = 0; i < 8; i++)
        if (h.reserved0 || h.reserved[i])
            return kvf_set_error(KVF_EFORMAT, "query statistics header: reserved words are not zero");
    kvf_qstats_layout l;
    if ((rc = kvf_qstats_layout_compute(s, (int32_t)h.n_heads, &l))) return rc;
    if (bytes < l.total_bytes)
        return kvf_set_error(KVF_ERANGE, "query statistics: buffer has %zu bytes, %" PRIu32 " heads need %zu", bytes,
                             h.n_heads, l.total_bytes);
    return KVF_OK;
}

int kvf_qstats_skipped(const void *header, size_t header_bytes, uint64_t *skipped) {
    if (!header || !skipped) return kvf_set_error(KVF_EINVAL, "kvf_qstats_skipped: NULL argument");
    qstats_header h;
    int rc = read_header(header, header_bytes, "kvf_qstats_skipped", &h);
    if (rc) return rc;
    *skipped = h.skipped;
    return KVF_OK;
}

/* Layout from the header alone (accessors; the buffer was checked before). */
static int header_layout(const void *qstats, kvf_qstats_layout *l) {
    qstats_header h;
    memcpy(&h, qstats, sizeof h);
    if (h.magic != KVF_QSTATS_MAGIC || h.n_heads < 1 || h.n_heads > INT32_MAX)
        return kvf_set_error(KVF_EFORMAT, "not a kvforge query-statistics buffer");
    if (h.head_dim > KVF_REF_MAX_DIM || h.rank >= h.head_dim)
        return kvf_set_error(KVF_EFORMAT, "query statistics header: head_dim %" PRIu32 ", rank %" PRIu32,
                             h.head_dim, h.rank);
    return layout_of((int32_t)h.n_heads, (int)h.head_dim, (int)h.rank, l);
}

static double *count_plane(void *q, const kvf_qstats_layout *l) { return (double *)((uint8_t *)q + l->count_off); }
static float *msum_of(void *q, const kvf_qstats_layout *l, int32_t h) {
    return (float *)((uint8_t *)q + l->msum_off) + (size_t)h * l->head_dim * l->head_dim;
}
static float *u_of(void *q, const kvf_qstats_layout *l, int32_t h) {
    return (float *)((uint8_t *)q + l->u_off) + (size_t)h * l->head_dim * l->rank;
}
static float *lambda_of(void *q, const kvf_qstats_layout *l, int32_t h) {
    return (float *)((uint8_t *)q + l->lambda_off) + (size_t)h * l->rank;
}

/* -------------------------------------------------------------------- init */

int kvf_ref_qstats_init(const struct kvf_scheme *s, void *qstats, size_t bytes, int32_t n_heads) {
    if (!s || !qstats) return kvf_set_error(KVF_EINVAL, "kvf_qstats_init: NULL scheme or buffer");
    if ((uintptr_t)qstats & 15u)
        return kvf_set_error(KVF_EINVAL, "kvf_qstats_init: the buffer must be 16-byte aligned");
    kvf_qstats_layout l;
    int rc = kvf_qstats_layout_compute(s, n_heads, &l);
    if (rc) return rc;
    if (bytes < l.total_bytes)
        return kvf_set_error(KVF_ERANGE, "kvf_qstats_init: buffer has %zu bytes, %" PRId32 " KV heads need %zu",
                             bytes, n_heads, l.total_bytes);
    memset(qstats, 0, l.total_bytes); /* counts, sums, U and lambda: 0 */
    qstats_header h = {KVF_QSTATS_MAGIC, KVF_QSTATS_VERSION, (uint32_t)n_heads, (uint32_t)l.head_dim,
                       (uint32_t)l.rank, 0, 0, {0}};
    memcpy(qstats, &h, sizeof h);
    return KVF_OK;
}

/* ------------------------------------------------------------- accessors */

int kvf_ref_qstats_weights(const void *qstats, int32_t head, int d, float *w) {
    kvf_qstats_layout l;
    int rc = header_layout(qstats, &l);
    if (rc) return rc;
    if (head < 0 || head >= l.n_heads || d != l.head_dim)
        return kvf_set_error(KVF_EINVAL, "query statistics: head %" PRId32 " / head_dim %d outside %" PRId32 " x %d",
                             head, d, l.n_heads, l.head_dim);
    void *q = (void *)qstats;
    double count = count_plane(q, &l)[head];
    const float *m = msum_of(q, &l, head);
    for (int c = 0; c < d; c++) w[c] = count > 0 ? (float)((double)m[(size_t)c * d + c] / count) : 1.0f;
    return KVF_OK;
}

int kvf_ref_qstats_basis(const void *qstats, int32_t head, int d, int r, const float **u, const float **lambda) {
    kvf_qstats_layout l;
    int rc = header_layout(qstats, &l);
    if (rc) return rc;
    if (head < 0 || head >= l.n_heads || d != l.head_dim || r != l.rank || r < 1)
        return kvf_set_error(KVF_EINVAL,
                             "query statistics: head %" PRId32 ", head_dim %d, rank %d do not match %" PRId32
                             " x %d, rank %d",
                             head, d, r, l.n_heads, l.head_dim, l.rank);
    void *q = (void *)qstats;
    if (!(count_plane(q, &l)[head] > 0)) return 0;
    *u = u_of(q, &l, head);
    *lambda = lambda_of(q, &l, head);
    return 1;
}

/* ---------------------------------------------------- orthogonal iteration */

/* Subtract from v (f64, d) its components along columns 0..j-1 of u [d][r]
 * (modified Gram-Schmidt: each dot product with the already updated v). */
static void project_out(double *v, const float *u, int d, int r, int j) {
    for (int k = 0; k < j; k++) {
        double dot = 0;
        for (int i = 0; i < d; i++) dot += v[i] * (double)u[(size_t)i * r + k];
        for (int i = 0; i < d; i++) v[i] -= dot * (double)u[(size_t)i * r + k];
    }
}

static double norm_of(const double *v, int d) {
    double s = 0;
    for (int i = 0; i < d; i++) s += v[i] * v[i];
    return sqrt(s);
}

/* Write v / norm (f64, rounded to f32) into column j of u. */
static void store_column(float *u, int d, int r, int j, const double *v, double norm) {
    for (int i = 0; i < d; i++) u[(size_t)i * r + j] = (float)(v[i] / norm);
}

/* A zero column j: the first unit vector e_c whose part orthogonal to columns
 * 0..j-1 has norm >= UNIT_RESIDUAL_MIN (else the one with the largest part). */
static void replace_zero_column(float *u, int d, int r, int j) {
    double v[KVF_REF_MAX_DIM];
    int best = 0;
    double best_norm = -1;
    for (int c = 0; c < d; c++) {
        memset(v, 0, sizeof(double) * (size_t)d);
        v[c] = 1.0;
        project_out(v, u, d, r, j);
        double n = norm_of(v, d);
        if (n > best_norm) best = c, best_norm = n;
        if (n >= UNIT_RESIDUAL_MIN) break;
    }
    memset(v, 0, sizeof(double) * (size_t)d);
    v[best] = 1.0;
    project_out(v, u, d, r, j);
    project_out(v, u, d, r, j);
    store_column(u, d, r, j, v, norm_of(v, d));
}

/* Orthonormalize v against columns 0..j-1 of u and store it as column j.
 * The projection runs twice: the columns are f32, orthonormal only to about
 * 1e-7, and a column that loses most of its norm would keep their error. */
static void gram_schmidt_column(float *u, int d, int r, int j, double *v) {
    double before = norm_of(v, d);
    project_out(v, u, d, r, j);
    project_out(v, u, d, r, j);
    double after = norm_of(v, d);
    if (!(after > ZERO_COLUMN_RATIO * before)) replace_zero_column(u, d, r, j);
    else store_column(u, d, r, j, v, after);
}

/* v = M u_j (f64, sums in channel order). */
static void matvec_column(const float *m, const float *u, int d, int r, int j, double *v) {
    for (int i = 0; i < d; i++) {
        double s = 0;
        for (int k = 0; k < d; k++) s += (double)m[(size_t)i * d + k] * (double)u[(size_t)k * r + j];
        v[i] = s;
    }
}

/* One step: U <- MGS(M U), in place column by column (column j of M U needs
 * only the old column j; columns before it are already the new ones). */
static void iteration_step(const float *m, int d, int r, float *u) {
    double v[KVF_REF_MAX_DIM];
    for (int j = 0; j < r; j++) {
        matvec_column(m, u, d, r, j, v);
        gram_schmidt_column(u, d, r, j, v);
    }
}

/* u_j^T M u_j (f64, rounded to f32). */
static float rayleigh(const float *m, const float *u, int d, int r, int j) {
    double v[KVF_REF_MAX_DIM], s = 0;
    matvec_column(m, u, d, r, j, v);
    for (int i = 0; i < d; i++) s += (double)u[(size_t)i * r + j] * v[i];
    return (float)s;
}

static void swap_columns(float *u, int d, int r, int a, int b) {
    for (int i = 0; i < d; i++) {
        float t = u[(size_t)i * r + a];
        u[(size_t)i * r + a] = u[(size_t)i * r + b];
        u[(size_t)i * r + b] = t;
    }
}

/* Stable insertion sort of the columns by descending lambda. */
static void sort_by_lambda(float *u, float *lambda, int d, int r) {
    for (int j = 1; j < r; j++)
        for (int k = j; k > 0 && lambda[k] > lambda[k - 1]; k--) {
            float t = lambda[k];
            lambda[k] = lambda[k - 1];
            lambda[k - 1] = t;
            swap_columns(u, d, r, k, k - 1);
        }
}

void kvf_ref_orthogonal_iteration(const float *m, int d, int r, int iters, float *u, float *lambda) {
    if (d < 1 || d > KVF_REF_MAX_DIM || r < 1 || r > d) return;
    for (int it = 0; it < iters; it++) iteration_step(m, d, r, u);
    for (int j = 0; j < r; j++) lambda[j] = rayleigh(m, u, d, r, j);
    sort_by_lambda(u, lambda, d, r);
}

/* Cold start: the first r columns of the identity plus
 * 0.01 * ((i*7 + j*13) % 17 - 8) / 8, in f64, orthonormalized by MGS. */
static void cold_start(float *u, int d, int r) {
    double v[KVF_REF_MAX_DIM];
    for (int j = 0; j < r; j++) {
        for (int i = 0; i < d; i++) v[i] = (i == j ? 1.0 : 0.0) + 0.01 * (double)((i * 7 + j * 13) % 17 - 8) / 8.0;
        gram_schmidt_column(u, d, r, j, v);
    }
}

/* ------------------------------------------------------------------ update */

/* Whether every value of a query row is finite (a bf16 NaN or Inf has all
 * exponent bits set). */
static int row_finite(const uint16_t *row, int d) {
    for (int c = 0; c < d; c++)
        if ((row[c] & 0x7f80u) == 0x7f80u) return 0;
    return 1;
}

/* acc [d][d] = sum of q q^T (f64) over the finite rows of query heads
 * h*group .. h*group+group-1, heads then tokens in order; exact for bf16.
 * Returns how many rows it summed. */
static int64_t accumulate_head(const uint16_t *q, const kvf_shape *sh, int32_t h, int group, int d, double *acc) {
    double x[KVF_REF_MAX_DIM];
    int64_t used = 0;
    memset(acc, 0, sizeof(double) * (size_t)d * d);
    for (int g = 0; g < group; g++) {
        const uint16_t *head = q + (int64_t)(h * group + g) * sh->head_stride;
        for (int64_t t = 0; t < sh->n_tokens; t++) {
            const uint16_t *row = head + t * sh->token_stride;
            if (!row_finite(row, d)) continue;
            used++;
            for (int c = 0; c < d; c++) x[c] = kvf_bf16_to_f32(row[c]);
            for (int i = 0; i < d; i++)
                for (int j = i; j < d; j++) acc[(size_t)i * d + j] += x[i] * x[j];
        }
    }
    for (int i = 0; i < d; i++)
        for (int j = 0; j < i; j++) acc[(size_t)i * d + j] = acc[(size_t)j * d + i];
    return used;
}

/* msum += acc with one rounding per element. */
static void add_to_msum(float *msum, const double *acc, int d) {
    for (size_t i = 0; i < (size_t)d * d; i++) msum[i] = (float)((double)msum[i] + acc[i]);
}

/* U and lambda of one head from M = msum / count (f32). */
static void update_basis(const float *msum, double count, int cold, int d, int r, float *m, float *u,
                         float *lambda) {
    for (size_t i = 0; i < (size_t)d * d; i++) m[i] = (float)((double)msum[i] / count);
    if (cold) cold_start(u, d, r);
    kvf_ref_orthogonal_iteration(m, d, r, cold ? COLD_ITERS : WARM_ITERS, u, lambda);
}

int kvf_ref_qstats_update(const struct kvf_scheme *s, void *qstats, size_t bytes, const uint16_t *q,
                          const kvf_shape *q_shape) {
    if (!s || !qstats || !q || !q_shape)
        return kvf_set_error(KVF_EINVAL, "kvf_qstats_update: NULL scheme, buffer, queries or shape");
    int rc = kvf_qstats_check(s, qstats, bytes, 0);
    if (rc) return rc;
    kvf_qstats_layout l;
    if ((rc = header_layout(qstats, &l))) return rc;
    kvf_shape sh;
    if ((rc = kvf_shape_resolve(q_shape, l.head_dim, &sh))) return kvf_wrap_error(rc, "kvf_qstats_update: queries");
    if (sh.n_heads % l.n_heads != 0)
        return kvf_set_error(KVF_EINVAL,
                             "kvf_qstats_update: %" PRId32 " query heads is not a multiple of the statistics' %" PRId32
                             " KV heads",
                             sh.n_heads, l.n_heads);
    int d = l.head_dim, r = l.rank, group = sh.n_heads / l.n_heads;
    double *acc = malloc(sizeof(double) * (size_t)d * d);
    float *m = malloc(sizeof(float) * (size_t)d * d);
    if (!acc || !m) {
        free(acc), free(m);
        return kvf_set_error(KVF_ENOMEM, "kvf_qstats_update: out of memory");
    }
    double *count = count_plane(qstats, &l);
    uint64_t skipped = 0;
    for (int32_t h = 0; h < l.n_heads; h++) {
        double before = count[h];
        int64_t used = accumulate_head(q, &sh, h, group, d, acc);
        skipped += (uint64_t)(sh.n_tokens * group - used);
        if (used == 0) continue; /* nothing added: sums, count and basis stay as they are */
        add_to_msum(msum_of(qstats, &l, h), acc, d);
        count[h] = before + (double)used;
        if (r > 0) update_basis(msum_of(qstats, &l, h), count[h], before == 0, d, r, m, u_of(qstats, &l, h),
                                lambda_of(qstats, &l, h));
    }
    qstats_header hd;
    memcpy(&hd, qstats, sizeof hd);
    hd.skipped += skipped;
    memcpy(qstats, &hd, sizeof hd);
    free(acc), free(m);
    return KVF_OK;
}
