/* Contexts: a scheme bound to a backend (CPU reference or a CUDA device with
 * its loaded kernels), and the encode/decode entry points. */
#include "cuda_api.h"
#include "gen.h"
#include "jit.h"

#include <stdlib.h>
#include <string.h>

struct kvf_context {
    struct kvf_scheme *scheme;
    int device; /* KVF_DEVICE_CPU or the CUDA ordinal */
    char backend[24];
    const char *origin;
    const kvf_cuda_api *cu;
    CUdevice dev;
    CUcontext cuctx;
    CUmodule module;
    CUfunction fn[KVF_KERNEL_COUNT];
};

int kvf_scheme_clone(const struct kvf_scheme *s, struct kvf_scheme **out) {
    struct kvf_scheme *c = malloc(sizeof *c);
    char *canon = s->canonical ? strdup(s->canonical) : NULL;
    if (!c || (s->canonical && !canon)) {
        free(c);
        free(canon);
        return kvf_set_error(KVF_ENOMEM, "out of memory copying scheme %s", s->name);
    }
    memcpy(c, s, sizeof *c);
    c->canonical = canon;
    *out = c;
    return KVF_OK;
}

const kvf_scheme *kvf_context_scheme(const kvf_context *ctx) { return ctx ? ctx->scheme : NULL; }
const char *kvf_context_backend(const kvf_context *ctx) { return ctx ? ctx->backend : ""; }
const char *kvf_context_origin(const kvf_context *ctx) { return ctx ? ctx->origin : ""; }

static int new_context(const kvf_scheme *s, int device, kvf_context **out) {
    kvf_context *ctx = calloc(1, sizeof *ctx);
    if (!ctx) return kvf_set_error(KVF_ENOMEM, "out of memory for a context");
    int rc = kvf_scheme_clone(s, &ctx->scheme);
    if (rc) { free(ctx); return rc; }
    ctx->device = device;
    *out = ctx;
    return KVF_OK;
}

/* Bind the device's primary context and read its arch. */
static int open_device(kvf_context *ctx, int *cc_major, int *cc_minor) {
    int rc = kvf_cuda_load(&ctx->cu);
    if (rc) return rc;
    int count = 0;
    KVF_CU(ctx->cu, ctx->device, cuDeviceGetCount(&count));
    if (ctx->device < 0 || ctx->device >= count)
        return kvf_set_error(KVF_ENODEV, "no CUDA device %d (%d present)", ctx->device, count);
    KVF_CU(ctx->cu, ctx->device, cuDeviceGet(&ctx->dev, ctx->device));
    KVF_CU(ctx->cu, ctx->device,
           cuDeviceGetAttribute(cc_major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, ctx->dev));
    KVF_CU(ctx->cu, ctx->device,
           cuDeviceGetAttribute(cc_minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, ctx->dev));
    KVF_CU(ctx->cu, ctx->device, cuDevicePrimaryCtxRetain(&ctx->cuctx, ctx->dev));
    snprintf(ctx->backend, sizeof ctx->backend, "sm_%d%d", *cc_major, *cc_minor);
    return KVF_OK;
}

static int load_module(kvf_context *ctx, const void *image) {
    const kvf_cuda_api *cu = ctx->cu;
    KVF_CU(cu, ctx->device, cuCtxPushCurrent(ctx->cuctx));
    CUresult r = cu->cuModuleLoadData(&ctx->module, image);
    int rc = KVF_OK;
    if (r != CUDA_SUCCESS) {
        rc = kvf_cuda_fail(r, "cuModuleLoadData(&module, image)", __FILE__, __LINE__, ctx->device);
        ctx->module = NULL;
    }
    for (int k = 0; k < KVF_KERNEL_COUNT && rc == KVF_OK; k++) {
        char name[160];
        kvf_gen_kernel_name(ctx->scheme, k, name, sizeof name);
        r = cu->cuModuleGetFunction(&ctx->fn[k], ctx->module, name);
        if (r != CUDA_SUCCESS)
            rc = kvf_wrap_error(kvf_cuda_fail(r, "cuModuleGetFunction", __FILE__, __LINE__, ctx->device),
                                "kernel %s not in the image (made for another scheme?)", name);
    }
    CUcontext popped;
    cu->cuCtxPopCurrent(&popped);
    return rc;
}

int kvf_context_create(const kvf_scheme *s, int device, kvf_context **out) {
    if (!s || !out) return kvf_set_error(KVF_EINVAL, "kvf_context_create: scheme and out must not be NULL");
    *out = NULL;
    int rc = kvf_scheme_check_supported(s);
    if (rc) return rc;
    kvf_context *ctx;
    if ((rc = new_context(s, device, &ctx))) return rc;
    if (device == KVF_DEVICE_CPU) {
        snprintf(ctx->backend, sizeof ctx->backend, "cpu");
        ctx->origin = "cpu";
        *out = ctx;
        return KVF_OK;
    }
    int major = 0, minor = 0, ptx = 0;
    char arch[32];
    void *image = NULL;
    size_t size = 0;
    if (!(rc = open_device(ctx, &major, &minor)) && !(rc = kvf_nvrtc_pick_arch(major, minor, arch, sizeof arch, &ptx)) &&
        !(rc = kvf_jit_image(ctx->scheme, arch, ptx, &image, &size, &ctx->origin)))
        rc = load_module(ctx, image);
    free(image);
    if (rc) { kvf_context_destroy(ctx); return rc; }
    *out = ctx;
    return KVF_OK;
}

int kvf_context_create_from_image(const char *canonical, const void *image, size_t image_size, int device,
                                  kvf_context **out) {
    if (!canonical || !image || !image_size || !out)
        return kvf_set_error(KVF_EINVAL, "kvf_context_create_from_image: NULL or empty argument");
    *out = NULL;
    kvf_scheme *s;
    int rc = kvf_scheme_load_string(canonical, strlen(canonical), "=exported scheme", &s);
    if (rc) return rc;
    kvf_context *ctx;
    rc = new_context(s, device, &ctx);
    kvf_scheme_free(s);
    if (rc) return rc;
    int major, minor;
    if (device == KVF_DEVICE_CPU) rc = kvf_set_error(KVF_EINVAL, "an image needs a CUDA device, not the CPU");
    else if (!(rc = open_device(ctx, &major, &minor))) rc = load_module(ctx, image);
    if (rc) { kvf_context_destroy(ctx); return rc; }
    ctx->origin = "image";
    *out = ctx;
    return KVF_OK;
}

void kvf_context_destroy(kvf_context *ctx) {
    if (!ctx) return;
    if (ctx->module && ctx->cu->cuCtxPushCurrent(ctx->cuctx) == CUDA_SUCCESS) {
        CUcontext popped;
        ctx->cu->cuModuleUnload(ctx->module);
        ctx->cu->cuCtxPopCurrent(&popped);
    }
    if (ctx->cuctx) ctx->cu->cuDevicePrimaryCtxRelease(ctx->dev);
    kvf_scheme_free(ctx->scheme);
    free(ctx);
}

/* ------------------------------------------------------------- launches */

enum { BLOCK = 256, VEC = 8 }; /* templates/kvf_rtn.cuh: kvf_rtn::BLOCK, VEC */

static int check_device_args(const kvf_context *ctx, const void *a, const void *b, const void *packed,
                             const kvf_shape *sh, const char *fn) {
    if (((uintptr_t)a | (uintptr_t)b | (uintptr_t)packed) & 15u)
        return kvf_set_error(KVF_EINVAL, "%s: K, V and packed pointers must be 16-byte aligned", fn);
    if ((sh->token_stride | sh->head_stride) & (VEC - 1))
        return kvf_set_error(KVF_EINVAL, "%s: token_stride and head_stride must be multiples of 8 (got %lld, %lld)",
                             fn, (long long)sh->token_stride, (long long)sh->head_stride);
    if (sh->n_tokens > INT32_MAX || (int64_t)sh->n_tokens * sh->n_heads > (int64_t)INT32_MAX * BLOCK)
        return kvf_set_error(KVF_EINVAL, "%s: %lld tokens x %d heads is too large for one launch", fn,
                             (long long)sh->n_tokens, sh->n_heads);
    (void)ctx;
    return KVF_OK;
}

static int prepare(const kvf_context *ctx, const void *a, const void *b, const void *packed,
                   size_t packed_bytes, const kvf_shape *shape, kvf_shape *sh, kvf_layout *l, const char *fn) {
    if (!ctx || !a || !b || !packed || !shape)
        return kvf_set_error(KVF_EINVAL, "%s: NULL context, tensor, packed buffer or shape", fn);
    int rc = kvf_shape_resolve(shape, ctx->scheme->head_dim, sh);
    if (rc) return kvf_wrap_error(rc, "%s", fn);
    if ((rc = kvf_layout_compute(ctx->scheme, sh->n_tokens, sh->n_heads, l))) return rc;
    if (packed_bytes < l->total_bytes)
        return kvf_set_error(KVF_ERANGE, "%s: packed buffer has %zu bytes, %lld tokens x %d heads need %zu", fn,
                             packed_bytes, (long long)sh->n_tokens, sh->n_heads, l->total_bytes);
    if (ctx->device != KVF_DEVICE_CPU) return check_device_args(ctx, a, b, packed, sh, fn);
    /* The CPU reads and writes BF16 elements as uint16_t: they must be 2-byte
     * aligned (any other alignment, and any stride, is fine; packed is bytes). */
    if (((uintptr_t)a | (uintptr_t)b) & 1u)
        return kvf_set_error(KVF_EINVAL, "%s: K and V pointers must be 2-byte aligned (BF16 elements)", fn);
    return KVF_OK;
}

static unsigned grid_for(const kvf_context *ctx, const kvf_shape *sh) {
    int64_t rows_per_block = BLOCK / (ctx->scheme->head_dim / VEC);
    return (unsigned)(((int64_t)sh->n_tokens * sh->n_heads + rows_per_block - 1) / rows_per_block);
}

static int launch(kvf_context *ctx, int kernel, unsigned grid, void **args, void *stream) {
    const kvf_cuda_api *cu = ctx->cu;
    KVF_CU(cu, ctx->device, cuCtxPushCurrent(ctx->cuctx));
    CUresult r = cu->cuLaunchKernel(ctx->fn[kernel], grid, 1, 1, BLOCK, 1, 1, 0, (CUstream)stream, args, NULL);
    CUcontext popped;
    cu->cuCtxPopCurrent(&popped);
    if (r != CUDA_SUCCESS) return kvf_cuda_fail(r, "cuLaunchKernel", __FILE__, __LINE__, ctx->device);
    return KVF_OK;
}

typedef struct { uint64_t codes, scales, zeros; } planes_arg; /* kvf_planes */

static planes_arg planes_of(const kvf_section_layout *s) {
    planes_arg p = {s->codes_off, s->scales_off, s->zeros_off};
    return p;
}

int kvf_encode(kvf_context *ctx, const void *k, const void *v, const kvf_shape *shape, const void *qstats,
               void *packed, size_t packed_bytes, void *stream) {
    kvf_shape sh;
    kvf_layout l;
    int rc = prepare(ctx, k, v, packed, packed_bytes, shape, &sh, &l, "kvf_encode");
    if (rc) return rc;
    if (ctx->device == KVF_DEVICE_CPU) return kvf_ref_encode(ctx->scheme, k, v, &sh, qstats, packed, packed_bytes);
    kvf_packed_header hdr;
    kvf_header_fill(ctx->scheme, &l, &hdr);
    int n_tokens = (int)sh.n_tokens, n_heads = sh.n_heads;
    unsigned grid = grid_for(ctx, &sh);
    const void *src[2] = {k, v};
    const kvf_section_layout *sec[2] = {&l.key, &l.value};
    for (int t = 0; t < 2; t++) {
        planes_arg planes = planes_of(sec[t]);
        int write_header = t == 0;
        void *args[] = {(void *)&src[t], &sh.token_stride, &sh.head_stride, &n_tokens, &n_heads, &packed,
                        &planes, &write_header, &hdr};
        if ((rc = launch(ctx, KVF_KERNEL_ENCODE_K + t, grid, args, stream))) return rc;
    }
    return KVF_OK;
}

int kvf_decode(kvf_context *ctx, const void *packed, size_t packed_bytes, const kvf_shape *shape,
               const int32_t *positions, void *k_out, void *v_out, void *stream) {
    kvf_shape sh;
    kvf_layout l;
    int rc = prepare(ctx, k_out, v_out, packed, packed_bytes, shape, &sh, &l, "kvf_decode");
    if (rc) return rc;
    if (ctx->device == KVF_DEVICE_CPU) return kvf_ref_decode(ctx->scheme, packed, packed_bytes, &sh, positions, k_out, v_out);
    int n_tokens = (int)sh.n_tokens, n_heads = sh.n_heads;
    unsigned grid = grid_for(ctx, &sh);
    void *dst[2] = {k_out, v_out};
    const kvf_section_layout *sec[2] = {&l.key, &l.value};
    for (int t = 0; t < 2; t++) {
        planes_arg planes = planes_of(sec[t]);
        void *args[] = {(void *)&packed, &planes, &n_tokens, &n_heads, &dst[t], &sh.token_stride, &sh.head_stride};
        if ((rc = launch(ctx, KVF_KERNEL_DECODE_K + t, grid, args, stream))) return rc;
    }
    return KVF_OK;
}
