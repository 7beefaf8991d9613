/* Evaluation backends: the CPU reference or a CUDA device (see backend.h). */
#include "backend.h"

#include "gpu/cuda_api.h"

#include <stdlib.h>
#include <string.h>

typedef struct dbuf { CUdeviceptr p; size_t cap; } dbuf;

struct kvf_eval_backend {
    kvf_context *ctx;
    int device; /* KVF_DEVICE_CPU or the CUDA ordinal */
    char desc[96];
    /* query statistics: host memory on the CPU, qs_dev on a device */
    void *qs_host;
    size_t qs_bytes, qs_cap;
    int qs_ready;
    /* packed spans: [cur] is written; when warm, [cur ^ 1] holds the layer's
     * previous span (prev_tokens of them, prev_bytes; 0: none), and a cold
     * backend uses [0] only */
    int warm, cur;
    int64_t prev_tokens;
    size_t prev_bytes;
    void *packed_host[2];
    size_t packed_cap[2];
    /* device state */
    const kvf_cuda_api *cu;
    CUdevice dev;
    CUcontext pctx;
    int retained, pushed;
    dbuf k, v, k_out, v_out, packed[2], pos, q, qs_dev;
};

static size_t bf16_bytes(const kvf_shape *sh, int d) { return (size_t)sh->n_tokens * sh->n_heads * d * 2; }

/* Host buffer of at least need bytes (64-byte aligned), kept across calls. */
static int host_reserve(void **p, size_t *cap, size_t need, const char *what) {
    if (*cap >= need) return KVF_OK;
    void *q = aligned_alloc(64, (need + 63) & ~(size_t)63);
    if (!q) return kvf_set_error(KVF_ENOMEM, "out of memory for %zu bytes of %s", need, what);
    free(*p);
    *p = q;
    *cap = need;
    return KVF_OK;
}

/* ------------------------------------------------------------ device */

static int dev_reserve(kvf_eval_backend *b, dbuf *buf, size_t need) {
    if (buf->cap >= need) return KVF_OK;
    if (buf->p) b->cu->cuMemFree(buf->p);
    buf->p = 0;
    buf->cap = 0;
    KVF_CU(b->cu, b->device, cuMemAlloc(&buf->p, need ? need : 16));
    buf->cap = need;
    return KVF_OK;
}

static int dev_upload(kvf_eval_backend *b, dbuf *buf, const void *host, size_t bytes) {
    int rc = dev_reserve(b, buf, bytes);
    if (rc) return rc;
    KVF_CU(b->cu, b->device, cuMemcpyHtoD(buf->p, host, bytes));
    return KVF_OK;
}

/* Keep the device's primary context current for the buffers of the run. */
static int dev_open(kvf_eval_backend *b) {
    int rc = kvf_cuda_load(&b->cu);
    if (rc) return rc;
    KVF_CU(b->cu, b->device, cuDeviceGet(&b->dev, b->device));
    KVF_CU(b->cu, b->device, cuDevicePrimaryCtxRetain(&b->pctx, b->dev));
    b->retained = 1;
    KVF_CU(b->cu, b->device, cuCtxPushCurrent(b->pctx));
    b->pushed = 1;
    return KVF_OK;
}

static void dev_close(kvf_eval_backend *b) {
    dbuf *all[] = {&b->k, &b->v, &b->k_out, &b->v_out, &b->packed[0], &b->packed[1], &b->pos, &b->q, &b->qs_dev};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (all[i]->p) b->cu->cuMemFree(all[i]->p);
    if (b->pushed) {
        CUcontext popped;
        b->cu->cuCtxPopCurrent(&popped);
    }
    if (b->retained) b->cu->cuDevicePrimaryCtxRelease(b->dev);
}

/* Encode one span: kvf_encode_warm from the layer's previous span (prev, in
 * the backend's memory) when there is one (only a warm backend keeps one),
 * else kvf_encode. */
static int encode_span(kvf_eval_backend *b, const void *k, const void *v, const kvf_shape *sh, const void *qs,
                       const void *prev, void *out, size_t bytes) {
    if (b->prev_bytes)
        return kvf_encode_warm(b->ctx, k, v, sh, qs, prev, b->prev_bytes, b->prev_tokens, out, bytes, NULL);
    return kvf_encode(b->ctx, k, v, sh, qs, out, bytes, NULL);
}

static int dev_roundtrip(kvf_eval_backend *b, const uint16_t *k, const uint16_t *v, const kvf_shape *sh,
                         const int32_t *positions, int n_axes, uint16_t *k_out, uint16_t *v_out, size_t packed) {
    const size_t bytes = bf16_bytes(sh, kvf_scheme_head_dim(kvf_context_scheme(b->ctx)));
    dbuf *out = &b->packed[b->cur];
    int rc;
    if ((rc = dev_upload(b, &b->k, k, bytes)) || (rc = dev_upload(b, &b->v, v, bytes)) ||
        (rc = dev_reserve(b, &b->k_out, bytes)) || (rc = dev_reserve(b, &b->v_out, bytes)) ||
        (rc = dev_reserve(b, out, packed)))
        return rc;
    if (positions && (rc = dev_upload(b, &b->pos, positions, (size_t)sh->n_tokens * n_axes * sizeof *positions)))
        return rc;
    void *qs = b->qs_ready ? (void *)(uintptr_t)b->qs_dev.p : NULL;
    const int32_t *dpos = positions ? (const int32_t *)(uintptr_t)b->pos.p : NULL;
    if ((rc = encode_span(b, (void *)(uintptr_t)b->k.p, (void *)(uintptr_t)b->v.p, sh, qs,
                          (const void *)(uintptr_t)b->packed[b->cur ^ 1].p, (void *)(uintptr_t)out->p, packed)) ||
        (rc = kvf_decode(b->ctx, (void *)(uintptr_t)out->p, packed, sh, dpos, (void *)(uintptr_t)b->k_out.p,
                         (void *)(uintptr_t)b->v_out.p, NULL)))
        return rc;
    KVF_CU(b->cu, b->device, cuCtxSynchronize());
    KVF_CU(b->cu, b->device, cuMemcpyDtoH(k_out, b->k_out.p, bytes));
    KVF_CU(b->cu, b->device, cuMemcpyDtoH(v_out, b->v_out.p, bytes));
    return KVF_OK;
}

/* ------------------------------------------------------------ common */

int kvf_eval_backend_open(const kvf_scheme *s, int device, int warm, kvf_eval_backend **out) {
    if (!s || !out) return kvf_set_error(KVF_EINVAL, "kvf_eval_backend_open: NULL argument");
    *out = NULL;
    kvf_eval_backend *b = calloc(1, sizeof *b);
    if (!b) return kvf_set_error(KVF_ENOMEM, "out of memory for an evaluation backend");
    b->device = device;
    b->warm = warm != 0;
    int rc = kvf_context_create(s, device, &b->ctx);
    if (!rc && device != KVF_DEVICE_CPU) rc = dev_open(b);
    if (rc) { kvf_eval_backend_close(b); return rc; }
    if (device == KVF_DEVICE_CPU) snprintf(b->desc, sizeof b->desc, "CPU reference");
    else
        snprintf(b->desc, sizeof b->desc, "GPU %d %s (kernels from %s)", device, kvf_context_backend(b->ctx),
                 kvf_context_origin(b->ctx));
    *out = b;
    return KVF_OK;
}

void kvf_eval_backend_close(kvf_eval_backend *b) {
    if (!b) return;
    if (b->cu) dev_close(b);
    kvf_context_destroy(b->ctx);
    free(b->qs_host);
    free(b->packed_host[0]);
    free(b->packed_host[1]);
    free(b);
}

const char *kvf_eval_backend_describe(const kvf_eval_backend *b) { return b ? b->desc : ""; }

int kvf_eval_backend_qstats_init(kvf_eval_backend *b, int32_t n_kv_heads, size_t *bytes) {
    size_t need;
    int rc = kvf_qstats_size(kvf_context_scheme(b->ctx), n_kv_heads, &need);
    if (rc) return rc;
    b->qs_ready = 0;
    b->qs_bytes = need;
    if (b->device == KVF_DEVICE_CPU) {
        if (!(rc = host_reserve(&b->qs_host, &b->qs_cap, need, "query statistics")))
            rc = kvf_qstats_init(b->ctx, b->qs_host, need, n_kv_heads, NULL);
    } else if (!(rc = dev_reserve(b, &b->qs_dev, need)))
        rc = kvf_qstats_init(b->ctx, (void *)(uintptr_t)b->qs_dev.p, need, n_kv_heads, NULL);
    if (rc) return rc;
    b->qs_ready = 1;
    *bytes = need;
    return KVF_OK;
}

int kvf_eval_backend_qstats_update(kvf_eval_backend *b, const uint16_t *q, const kvf_shape *q_shape) {
    if (!b->qs_ready) return kvf_set_error(KVF_EINVAL, "query statistics updated before they were initialized");
    if (b->device == KVF_DEVICE_CPU) return kvf_qstats_update(b->ctx, b->qs_host, b->qs_bytes, q, q_shape, NULL);
    int rc = dev_upload(b, &b->q, q, bf16_bytes(q_shape, kvf_scheme_head_dim(kvf_context_scheme(b->ctx))));
    if (!rc) rc = kvf_qstats_update(b->ctx, (void *)(uintptr_t)b->qs_dev.p, b->qs_bytes, (void *)(uintptr_t)b->q.p,
                                    q_shape, NULL);
    if (rc) return rc;
    KVF_CU(b->cu, b->device, cuCtxSynchronize());
    return KVF_OK;
}

void kvf_eval_backend_new_layer(kvf_eval_backend *b) {
    b->prev_tokens = 0;
    b->prev_bytes = 0;
}

static int host_roundtrip(kvf_eval_backend *b, const uint16_t *k, const uint16_t *v, const kvf_shape *shape,
                          const int32_t *positions, uint16_t *k_out, uint16_t *v_out, size_t need) {
    int rc = host_reserve(&b->packed_host[b->cur], &b->packed_cap[b->cur], need, "a packed span");
    if (rc) return rc;
    void *qs = b->qs_ready ? b->qs_host : NULL, *out = b->packed_host[b->cur];
    if ((rc = encode_span(b, k, v, shape, qs, b->packed_host[b->cur ^ 1], out, need))) return rc;
    return kvf_decode(b->ctx, out, need, shape, positions, k_out, v_out, NULL);
}

int kvf_eval_backend_roundtrip(kvf_eval_backend *b, const uint16_t *k, const uint16_t *v, const kvf_shape *shape,
                               const int32_t *positions, int n_axes, uint16_t *k_out, uint16_t *v_out,
                               size_t *packed_bytes) {
    size_t need;
    int rc = kvf_packed_size(kvf_context_scheme(b->ctx), shape->n_tokens, shape->n_heads, &need);
    if (rc) return rc;
    *packed_bytes = need;
    rc = b->device != KVF_DEVICE_CPU ? dev_roundtrip(b, k, v, shape, positions, n_axes, k_out, v_out, need)
                                     : host_roundtrip(b, k, v, shape, positions, k_out, v_out, need);
    if (rc || !b->warm) return rc; /* on failure not swapped: the previous span stays the previous */
    /* this span is the next one's previous */
    b->prev_tokens = shape->n_tokens;
    b->prev_bytes = need;
    b->cur ^= 1;
    return KVF_OK;
}
