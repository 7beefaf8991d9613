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
    /* the pipeline (docs/METHODS.md 11): the layer's last anchor span (the
     * anchor scheme's context, anchor_tokens of them, anchor_bytes; 0: none),
     * the carried error (f32 [2][H][N][d]) and the layer's channel map */
    kvf_scheme *anchor_s;
    kvf_context *actx;
    int64_t anchor_tokens;
    size_t anchor_bytes, anchor_cap, fb_bytes, fb_cap, map_bytes, map_cap;
    void *anchor_host, *fb_host, *map_host;
    int feedback, has_map;
    /* device state */
    const kvf_cuda_api *cu;
    CUdevice dev;
    CUcontext pctx;
    int retained, pushed;
    dbuf k, v, k_out, v_out, packed[2], pos, q, qs_dev, anchor_dev, fb_dev, map_dev;
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
    dbuf *all[] = {&b->k,   &b->v, &b->k_out,  &b->v_out,      &b->packed[0], &b->packed[1],
                   &b->pos, &b->q, &b->qs_dev, &b->anchor_dev, &b->fb_dev,    &b->map_dev};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (all[i]->p) b->cu->cuMemFree(all[i]->p);
    if (b->pushed) {
        CUcontext popped;
        b->cu->cuCtxPopCurrent(&popped);
    }
    if (b->retained) b->cu->cuDevicePrimaryCtxRelease(b->dev);
}

/* The pointers of one span's encode and decode (device pointers on a
 * device): the statistics, the previous span, the anchor, the carried error,
 * the channel map. An anchor span takes none of them (its scheme is RTN). */
typedef struct span_io {
    const void *qs, *prev, *anchor, *map;
    float *fb;
} span_io;

static int code_span(kvf_eval_backend *b, const kvf_eval_span *sp, const span_io *io, const void *k, const void *v,
                     const kvf_shape *sh, const int32_t *pos, void *out, size_t bytes, void *k_out, void *v_out) {
    if (sp->anchor) {
        int rc = kvf_encode(b->actx, k, v, sh, NULL, out, bytes, NULL);
        return rc ? rc : kvf_decode(b->actx, out, bytes, sh, pos, k_out, v_out, NULL);
    }
    const int against = sp->against && b->anchor_bytes;
    if (sp->against && !b->anchor_bytes)
        return kvf_set_error(KVF_EINVAL, "a span coded against an anchor, and the layer has none packed yet");
    kvf_encode_args ea = {.qstats = io->qs, .channel_map = b->has_map ? io->map : NULL};
    if (b->warm && sp->warm && b->prev_bytes) {
        ea.prev = io->prev;
        ea.prev_bytes = b->prev_bytes;
        ea.prev_n_tokens = b->prev_tokens;
    }
    if (against) {
        ea.anchor = io->anchor;
        ea.anchor_bytes = b->anchor_bytes;
        ea.anchor_n_tokens = b->anchor_tokens;
    }
    if (b->feedback) {
        ea.feedback = io->fb;
        ea.feedback_in = sp->feedback_in;
    }
    kvf_decode_args da = {.positions = pos};
    if (against) {
        da.anchor = ea.anchor;
        da.anchor_bytes = ea.anchor_bytes;
        da.anchor_n_tokens = ea.anchor_n_tokens;
    }
    int rc = kvf_encode_ex(b->ctx, k, v, sh, &ea, out, bytes, NULL);
    return rc ? rc : kvf_decode_ex(b->ctx, out, bytes, sh, &da, k_out, v_out, NULL);
}

static int dev_roundtrip(kvf_eval_backend *b, const kvf_eval_span *sp, const uint16_t *k, const uint16_t *v,
                         const kvf_shape *sh, const int32_t *positions, int n_axes, uint16_t *k_out, uint16_t *v_out,
                         size_t packed) {
    const size_t bytes = bf16_bytes(sh, kvf_scheme_head_dim(kvf_context_scheme(b->ctx)));
    dbuf *out = sp->anchor ? &b->anchor_dev : &b->packed[b->cur];
    int rc;
    if ((rc = dev_upload(b, &b->k, k, bytes)) || (rc = dev_upload(b, &b->v, v, bytes)) ||
        (rc = dev_reserve(b, &b->k_out, bytes)) || (rc = dev_reserve(b, &b->v_out, bytes)) ||
        (rc = dev_reserve(b, out, packed)) || (b->feedback && (rc = dev_reserve(b, &b->fb_dev, 4 * bytes))))
        return rc;
    if (positions && (rc = dev_upload(b, &b->pos, positions, (size_t)sh->n_tokens * n_axes * sizeof *positions)))
        return rc;
    span_io io = {.qs = b->qs_ready ? (void *)(uintptr_t)b->qs_dev.p : NULL,
                  .prev = (const void *)(uintptr_t)b->packed[b->cur ^ 1].p,
                  .anchor = (const void *)(uintptr_t)b->anchor_dev.p,
                  .map = (const void *)(uintptr_t)b->map_dev.p,
                  .fb = (float *)(uintptr_t)b->fb_dev.p};
    const int32_t *dpos = positions ? (const int32_t *)(uintptr_t)b->pos.p : NULL;
    if ((rc = code_span(b, sp, &io, (void *)(uintptr_t)b->k.p, (void *)(uintptr_t)b->v.p, sh, dpos,
                        (void *)(uintptr_t)out->p, packed, (void *)(uintptr_t)b->k_out.p,
                        (void *)(uintptr_t)b->v_out.p)))
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
    kvf_scheme_info info;
    int rc = kvf_scheme_get_info(s, &info);
    if (!rc) rc = kvf_context_create(s, device, &b->ctx);
    if (!rc && info.anchor_every > 0 && !(rc = kvf_scheme_anchor(s, &b->anchor_s)))
        rc = kvf_context_create(b->anchor_s, device, &b->actx);
    b->feedback = info.feedback_decay > 0;
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
    kvf_context_destroy(b->actx);
    kvf_scheme_free(b->anchor_s);
    free(b->anchor_host);
    free(b->fb_host);
    free(b->map_host);
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

int kvf_eval_backend_new_layer(kvf_eval_backend *b, const uint8_t *map, int32_t n_kv_heads) {
    b->prev_tokens = 0;
    b->prev_bytes = 0;
    b->anchor_bytes = 0;
    b->anchor_tokens = 0;
    b->has_map = map != NULL;
    if (!map) return KVF_OK;
    b->map_bytes = (size_t)2 * n_kv_heads * kvf_scheme_head_dim(kvf_context_scheme(b->ctx));
    if (b->device != KVF_DEVICE_CPU) return dev_upload(b, &b->map_dev, map, b->map_bytes);
    int rc = host_reserve(&b->map_host, &b->map_cap, b->map_bytes, "a channel map");
    if (!rc) memcpy(b->map_host, map, b->map_bytes);
    return rc;
}

size_t kvf_eval_backend_state_bytes(const kvf_eval_backend *b) { return b && b->feedback ? b->fb_bytes : 0; }

static int host_roundtrip(kvf_eval_backend *b, const kvf_eval_span *sp, const uint16_t *k, const uint16_t *v,
                          const kvf_shape *shape, const int32_t *positions, uint16_t *k_out, uint16_t *v_out,
                          size_t need) {
    void **slot = sp->anchor ? &b->anchor_host : &b->packed_host[b->cur];
    size_t *cap = sp->anchor ? &b->anchor_cap : &b->packed_cap[b->cur];
    const size_t fb = 4 * bf16_bytes(shape, kvf_scheme_head_dim(kvf_context_scheme(b->ctx)));
    int rc = host_reserve(slot, cap, need, "a packed span");
    if (!rc && b->feedback) rc = host_reserve(&b->fb_host, &b->fb_cap, fb, "the carried error");
    if (rc) return rc;
    span_io io = {.qs = b->qs_ready ? b->qs_host : NULL, .prev = b->packed_host[b->cur ^ 1],
                  .anchor = b->anchor_host, .map = b->map_host, .fb = b->fb_host};
    return code_span(b, sp, &io, k, v, shape, positions, *slot, need, k_out, v_out);
}

int kvf_eval_backend_roundtrip(kvf_eval_backend *b, const kvf_eval_span *span, const uint16_t *k, const uint16_t *v,
                               const kvf_shape *shape, const int32_t *positions, int n_axes, uint16_t *k_out,
                               uint16_t *v_out, size_t *packed_bytes) {
    static const kvf_eval_span plain = {0};
    const kvf_eval_span *sp = span ? span : &plain;
    if (sp->anchor && !b->actx) return kvf_set_error(KVF_EINVAL, "an anchor span, and the scheme has no anchors");
    size_t need;
    int rc = kvf_packed_size(kvf_context_scheme(sp->anchor ? b->actx : b->ctx), shape->n_tokens, shape->n_heads, &need);
    if (rc) return rc;
    *packed_bytes = need;
    rc = b->device != KVF_DEVICE_CPU ? dev_roundtrip(b, sp, k, v, shape, positions, n_axes, k_out, v_out, need)
                                     : host_roundtrip(b, sp, k, v, shape, positions, k_out, v_out, need);
    if (rc) return rc; /* on failure nothing moves: the previous span and anchor stay */
    if (b->feedback) b->fb_bytes = 4 * bf16_bytes(shape, kvf_scheme_head_dim(kvf_context_scheme(b->ctx)));
    if (sp->anchor) { /* the layer's anchor now; no warm start reads across it */
        b->anchor_tokens = shape->n_tokens;
        b->anchor_bytes = need;
        b->prev_bytes = 0;
        return KVF_OK;
    }
    if (!b->warm) return KVF_OK;
    /* this span is the next one's previous */
    b->prev_tokens = shape->n_tokens;
    b->prev_bytes = need;
    b->cur ^= 1;
    return KVF_OK;
}
