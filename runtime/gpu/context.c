/* Contexts: a scheme bound to a backend (the CPU reference, or a CUDA device
 * with its loaded kernels), and the public encode/decode/statistics entry
 * points. Arguments are checked here; the CPU runs the reference
 * (runtime/cpu/), a device the plan's launches (launch.c). */
#include "gpu/context.h"
#include "gpu/jit.h"

#include <stdlib.h>
#include <string.h>

/* A copy of a scheme (free with kvf_scheme_free): a context owns its own. */
static int scheme_clone(const struct kvf_scheme *s, struct kvf_scheme **out) {
    struct kvf_scheme *c = malloc(sizeof *c);
    if (!c) return kvf_set_error(KVF_ENOMEM, "out of memory copying scheme %s", s->name);
    memcpy(c, s, sizeof *c);
    *out = c;
    return KVF_OK;
}

const kvf_scheme *kvf_context_scheme(const kvf_context *ctx) { return ctx ? ctx->scheme : NULL; }
const char *kvf_context_backend(const kvf_context *ctx) { return ctx ? ctx->backend : ""; }
const char *kvf_context_origin(const kvf_context *ctx) { return ctx ? ctx->origin : ""; }

static int new_context(const kvf_scheme *s, int device, kvf_context **out) {
    kvf_context *ctx = calloc(1, sizeof *ctx);
    if (!ctx) return kvf_set_error(KVF_ENOMEM, "out of memory for a context");
    int rc = scheme_clone(s, &ctx->scheme);
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
    KVF_CU(ctx->cu, ctx->device, cuDeviceGetAttribute(&ctx->sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, ctx->dev));
    KVF_CU(ctx->cu, ctx->device,
           cuDeviceGetAttribute(&ctx->smem_optin, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, ctx->dev));
    KVF_CU(ctx->cu, ctx->device, cuDevicePrimaryCtxRetain(&ctx->cuctx, ctx->dev));
    snprintf(ctx->backend, sizeof ctx->backend, "sm_%d%d", *cc_major, *cc_minor);
    return KVF_OK;
}

int kvf_ctx_push(const kvf_context *ctx) {
    KVF_CU(ctx->cu, ctx->device, cuCtxPushCurrent(ctx->cuctx));
    return KVF_OK;
}

int kvf_ctx_pop(const kvf_context *ctx, int rc) {
    CUcontext popped;
    ctx->cu->cuCtxPopCurrent(&popped);
    return rc;
}

/* A global of whichever module defines it (each program defines its own
 * globals; the format and interface globals are in every one):
 * CUDA_ERROR_NOT_FOUND where none does. Inside kvf_ctx_push. */
static CUresult module_global(const kvf_context *ctx, const char *name, CUdeviceptr *p, size_t *bytes) {
    CUresult r = CUDA_ERROR_NOT_FOUND;
    for (int m = 0; m < ctx->n_modules && r == CUDA_ERROR_NOT_FOUND; m++)
        r = ctx->cu->cuModuleGetGlobal(p, bytes, ctx->module[m], name);
    return r;
}

/* A k-means section's module global kvf_<id>_<k|v>_<sym> (templates/kvf_kmeans.cuh),
 * checked to have `want` bytes. Inside kvf_ctx_push. */
static int kmeans_global(kvf_context *ctx, int t, const char *sym, size_t want, CUdeviceptr *p) {
    char name[160];
    size_t bytes;
    snprintf(name, sizeof name, "kvf_%s_%c_%s", ctx->scheme->id, t ? 'v' : 'k', sym);
    CUresult r = module_global(ctx, name, p, &bytes);
    if (r == CUDA_SUCCESS && bytes != want) r = CUDA_ERROR_INVALID_IMAGE;
    if (r != CUDA_SUCCESS)
        return kvf_wrap_error(kvf_cuda_fail(r, "cuModuleGetGlobal", __FILE__, __LINE__, ctx->device),
                              "reading %s (%zu bytes expected)", name, want);
    return KVF_OK;
}

/* A u32 global the generator writes into every image and program (`name`),
 * which module m must hold equal to `want`: KVF_EFORMAT naming `what`
 * ("packed format") and what this library does with it (`verb`: "reads"),
 * and the remedy, when it has none or another value. Inside kvf_ctx_push. */
static int check_image_u32(kvf_context *ctx, int m, const char *name, unsigned want, const char *what,
                           const char *verb) {
    CUdeviceptr p;
    size_t bytes = 0;
    uint32_t v = 0;
    CUresult r = ctx->cu->cuModuleGetGlobal(&p, &bytes, ctx->module[m], name);
    if (r != CUDA_SUCCESS && r != CUDA_ERROR_NOT_FOUND)
        return kvf_wrap_error(kvf_cuda_fail(r, "cuModuleGetGlobal", __FILE__, __LINE__, ctx->device), "reading %s",
                              name);
    if (r != CUDA_SUCCESS || bytes != sizeof v)
        return kvf_set_error(KVF_EFORMAT, "kernel image has no %s: made by a kvforge older than %s version %u "
                                          "(export or compile it again)", name, what, want);
    if ((r = ctx->cu->cuMemcpyDtoH(&v, p, sizeof v)) != CUDA_SUCCESS)
        return kvf_wrap_error(kvf_cuda_fail(r, "cuMemcpyDtoH", __FILE__, __LINE__, ctx->device), "reading %s", name);
    if (v != want)
        return kvf_set_error(KVF_EFORMAT, "kernel image implements %s version %u, this library %s version %u "
                                          "(export or compile it again)", what, v, verb, want);
    return KVF_OK;
}

/* The image must implement this library's packed format (kvf_format_version:
 * another would misread caches) and be launched the way this library
 * launches (kvf_kernel_abi: grids and arguments; another would run on the
 * wrong grid). Both are templates/kvf_common.cuh globals written by gen.c. */
static int check_image_format(kvf_context *ctx) {
    int rc = KVF_OK;
    for (int m = 0; m < ctx->n_modules && rc == KVF_OK; m++)
        if (!(rc = check_image_u32(ctx, m, "kvf_format_version", KVF_FORMAT_VERSION, "packed format", "reads")))
            rc = check_image_u32(ctx, m, "kvf_kernel_abi", kvf_kernel_abi(), "kernel interface", "launches");
    return rc;
}

/* A kernel of whichever module defines it. Inside kvf_ctx_push. */
static CUresult module_function(const kvf_context *ctx, const char *name, CUfunction *f) {
    CUresult r = CUDA_ERROR_NOT_FOUND;
    for (int m = 0; m < ctx->n_modules && r == CUDA_ERROR_NOT_FOUND; m++)
        r = ctx->cu->cuModuleGetFunction(f, ctx->module[m], name);
    return r;
}

/* images: n images, a module each (the programs of kvf_jit_programs, or an
 * exported image). remedy: what to do when the k-means assignment needs more
 * shared memory than the device allows (it depends on where the images came
 * from). */
static int load_modules(kvf_context *ctx, void *const *images, int n, const char *remedy) {
    const kvf_cuda_api *cu = ctx->cu;
    int rc = kvf_ctx_push(ctx);
    if (rc) return rc;
    CUresult r;
    for (int m = 0; m < n && rc == KVF_OK; m++) {
        if ((r = cu->cuModuleLoadData(&ctx->module[m], images[m])) != CUDA_SUCCESS)
            rc = kvf_cuda_fail(r, "cuModuleLoadData(&module, image)", __FILE__, __LINE__, ctx->device);
        else
            ctx->n_modules = m + 1;
    }
    if (rc == KVF_OK) rc = check_image_format(ctx);
    const kvf_plan *plan = &ctx->scheme->plan;
    for (int k = 0; k < KVF_ROLE_COUNT && rc == KVF_OK; k++) {
        if (!plan->has[k]) continue;
        char name[160];
        kvf_kernel_name(ctx->scheme, k, name, sizeof name);
        r = module_function(ctx, name, &ctx->fn[k]);
        if (r != CUDA_SUCCESS)
            rc = kvf_wrap_error(kvf_cuda_fail(r, "cuModuleGetFunction", __FILE__, __LINE__, ctx->device),
                                "kernel %s not in the image (made for another scheme?)", name);
    }
    /* The assignment kernels' launch shape and shared memory come from the
     * module itself (kvf_kmeans assign_cfg), so they cannot disagree. A value
     * section that runs the key section's kernels takes the key's. */
    for (int t = 0; t < 2 && rc == KVF_OK; t++) {
        if (!ctx->fn[KVF_R_K_ASSIGN + t * KVF_R_SECTION_STRIDE]) continue;
        if (plan->sec[t].kmeans_owner != t) {
            memcpy(ctx->assign_cfg[t], ctx->assign_cfg[0], sizeof ctx->assign_cfg[t]);
            continue;
        }
        CUdeviceptr p;
        if ((rc = kmeans_global(ctx, t, "assign_cfg", sizeof ctx->assign_cfg[t], &p))) break;
        if ((r = cu->cuMemcpyDtoH(ctx->assign_cfg[t], p, sizeof ctx->assign_cfg[t])) != CUDA_SUCCESS) {
            rc = kvf_cuda_fail(r, "cuMemcpyDtoH(assign_cfg)", __FILE__, __LINE__, ctx->device);
            break;
        }
        for (int k = 0; k < 2 && rc == KVF_OK; k++) {
            CUfunction f = ctx->fn[KVF_R_K_ASSIGN + k + t * KVF_R_SECTION_STRIDE];
            /* The template sizes the block for its arch's shared memory
             * (kvf_kmeans smem_optin_bytes): an image made for another arch
             * (a PTX or cubin image), or a device below its arch's figure,
             * may need more. */
            if (f && ctx->assign_cfg[t][KVF_AC_SMEM + k] > ctx->smem_optin) {
                rc = kvf_set_error(KVF_ENOTIMPL,
                                   "the k-means %s assignment of scheme %s needs %d bytes of shared memory per block, "
                                   "device %d (%s) allows %d: %s",
                                   k ? "QSAC" : "nearest-centroid", ctx->scheme->id, ctx->assign_cfg[t][KVF_AC_SMEM + k],
                                   ctx->device, ctx->backend, ctx->smem_optin, remedy);
                break;
            }
            if (f && (r = cu->cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                 ctx->assign_cfg[t][KVF_AC_SMEM + k])) != CUDA_SUCCESS)
                rc = kvf_cuda_fail(r, "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)", __FILE__, __LINE__,
                                   ctx->device);
        }
    }
    return kvf_ctx_pop(ctx, rc);
}

int kvf_context_create(const kvf_scheme *s, int device, kvf_context **out) {
    if (!s || !out) return kvf_set_error(KVF_EINVAL, "kvf_context_create: scheme and out must not be NULL");
    *out = NULL;
    if (device != KVF_DEVICE_CPU && s->plan.gpu_status) return kvf_set_error(s->plan.gpu_status, "%s", s->plan.gpu_reason);
    kvf_context *ctx;
    int rc = new_context(s, device, &ctx);
    if (rc) return rc;
    if (device == KVF_DEVICE_CPU) {
        snprintf(ctx->backend, sizeof ctx->backend, "cpu");
        ctx->origin = "cpu";
        *out = ctx;
        return KVF_OK;
    }
    int major = 0, minor = 0, ptx = 0;
    char arch[32];
    kvf_jit_images im = {0};
    if (!(rc = open_device(ctx, &major, &minor)) && !(rc = kvf_nvrtc_pick_arch(major, minor, arch, sizeof arch, &ptx)) &&
        !(rc = kvf_jit_programs(ctx->scheme, arch, ptx, &im))) {
        ctx->origin = im.origin;
        rc = load_modules(ctx, im.image, im.n,
                          ptx ? "this NVRTC compiled PTX for an older arch than the device's; use an NVRTC that "
                                "knows the device's arch, or an image exported for it"
                              : "the device allows less than templates/kvf_kmeans.cuh's smem_optin_bytes assumes "
                                "for its arch");
    }
    kvf_jit_images_free(&im);
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
    else if (!(rc = open_device(ctx, &major, &minor))) {
        ctx->origin = "image";
        void *const one[1] = {(void *)image};
        rc = load_modules(ctx, one, 1, "use an image compiled for its arch");
    }
    if (rc) { kvf_context_destroy(ctx); return rc; }
    *out = ctx;
    return KVF_OK;
}

void kvf_context_destroy(kvf_context *ctx) {
    if (!ctx) return;
    /* The modules and the workspace belong to the context: free them with it
     * current (the caller's thread may have none, or another). */
    if ((ctx->n_modules || ctx->ws) && ctx->cu->cuCtxPushCurrent(ctx->cuctx) == CUDA_SUCCESS) {
        CUcontext popped;
        for (int m = 0; m < ctx->n_modules; m++) ctx->cu->cuModuleUnload(ctx->module[m]);
        if (ctx->ws) ctx->cu->cuMemFree(ctx->ws);
        ctx->cu->cuCtxPopCurrent(&popped);
    }
    if (ctx->cuctx) ctx->cu->cuDevicePrimaryCtxRelease(ctx->dev);
    kvf_scheme_free(ctx->scheme);
    free(ctx);
}

int kvf_context_assign_stats(kvf_context *ctx, int enable, unsigned long long out[2][2 * KVF_AS_N]) {
    memset(out, 0, sizeof(unsigned long long) * 2 * 2 * KVF_AS_N);
    if (!ctx || ctx->device == KVF_DEVICE_CPU) return kvf_set_error(KVF_EINVAL, "assign stats: no GPU context");
    const kvf_cuda_api *cu = ctx->cu;
    int rc = kvf_ctx_push(ctx);
    if (rc) return rc;
    CUresult r = cu->cuCtxSynchronize();
    for (int t = 0; t < 2 && r == CUDA_SUCCESS && rc == KVF_OK; t++) {
        /* A value section that runs the key section's kernels counts in out[0]. */
        if (!ctx->fn[KVF_R_K_ASSIGN + t * KVF_R_SECTION_STRIDE] || ctx->scheme->plan.sec[t].kmeans_owner != t) continue;
        /* Each assignment kernel's own global (the QSAC one's where it has it). */
        for (int k = 0; k < 2 && r == CUDA_SUCCESS && rc == KVF_OK; k++) {
            if (!ctx->fn[KVF_R_K_ASSIGN + k + t * KVF_R_SECTION_STRIDE]) continue;
            CUdeviceptr p;
            unsigned long long v[1 + KVF_AS_N], z[1 + KVF_AS_N] = {(unsigned long long)(enable > 0)};
            if ((rc = kmeans_global(ctx, t, k ? "assign_qsac_stats" : "assign_stats", sizeof v, &p))) break;
            if ((r = cu->cuMemcpyDtoH(v, p, sizeof v)) != CUDA_SUCCESS) break;
            memcpy(out[t] + KVF_AS_N * k, v + 1, KVF_AS_N * sizeof v[0]);
            if (enable >= 0) r = cu->cuMemcpyHtoD(p, z, sizeof z);
        }
    }
    if (rc == KVF_OK && r != CUDA_SUCCESS)
        rc = kvf_cuda_fail(r, "assign stats (cuCtxSynchronize/cuMemcpy)", __FILE__, __LINE__, ctx->device);
    return kvf_ctx_pop(ctx, rc);
}

/* ---------------------------------------------------------- entry points */

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
    if (ctx->device != KVF_DEVICE_CPU) return kvf_gpu_check_args(a, b, packed, sh, fn);
    /* The CPU reads and writes BF16 elements as uint16_t: they must be 2-byte
     * aligned (any other alignment, and any stride, is fine; packed is bytes). */
    if (((uintptr_t)a | (uintptr_t)b) & 1u)
        return kvf_set_error(KVF_EINVAL, "%s: K and V pointers must be 2-byte aligned (BF16 elements)", fn);
    return KVF_OK;
}

/* A device buffer's header is not read here (that would synchronize): only its alignment. */
static int check_qstats_arg(const kvf_context *ctx, const void *qstats) {
    if (!qstats || !kvf_scheme_reads_qstats(ctx->scheme)) return KVF_OK;
    if ((uintptr_t)qstats & 15u) return kvf_set_error(KVF_EINVAL, "kvf_encode: qstats must be 16-byte aligned");
    return KVF_OK;
}

/* A device pointer's alignment: the kernels load and store 16 bytes at a time. */
static int aligned16(const void *p, const char *fn, const char *what) {
    if ((uintptr_t)p & 15u) return kvf_set_error(KVF_EINVAL, "%s: %s must be 16-byte aligned", fn, what);
    return KVF_OK;
}

/* kvf_encode, kvf_encode_warm and kvf_encode_ex (fn: which, for messages). */
static int encode(kvf_context *ctx, const void *k, const void *v, const kvf_shape *shape, const kvf_encode_args *a,
                  void *packed, size_t packed_bytes, void *stream, const char *fn) {
    kvf_shape sh;
    kvf_layout l;
    int rc = prepare(ctx, k, v, packed, packed_bytes, shape, &sh, &l, fn);
    if (rc) return rc;
    if (ctx->device == KVF_DEVICE_CPU) return kvf_ref_encode_ex(ctx->scheme, k, v, &sh, a, packed, packed_bytes);
    /* Headers are not read on a device (that would synchronize): sizes and
     * places are checked. */
    kvf_gpu_inputs in = {.qstats = a->qstats, .warm = {a->prev, {0}}, .anchor = a->anchor,
                         .feedback = ctx->scheme->pipe.feedback_decay > 0 ? a->feedback : NULL,
                         .feedback_in = a->feedback_in, .channel_map = a->channel_map};
    if (a->prev) {
        if ((rc = kvf_warm_check(ctx->scheme, a->prev, a->prev_bytes, a->prev_n_tokens, sh.n_heads, packed,
                                 l.total_bytes, &in.warm.L)))
            return kvf_wrap_error(rc, "%s: the previous span's packed cache", fn);
        if ((rc = aligned16(a->prev, fn, "the previous span's packed cache"))) return rc;
    }
    struct kvf_scheme anchor_s;
    if ((rc = kvf_pipeline_args_check(ctx->scheme, &l, packed, l.total_bytes, a->anchor, a->anchor_bytes,
                                      a->anchor_n_tokens, &anchor_s, &in.anchor_layout, fn)) ||
        (a->anchor && (rc = aligned16(a->anchor, fn, "the anchor"))) ||
        (in.feedback && (rc = aligned16(in.feedback, fn, "the feedback state"))))
        return rc;
    if ((l.key.mp_channels || l.value.mp_channels) && !a->channel_map)
        return kvf_set_error(KVF_EINVAL, "%s: scheme %s refines calibrated channels (mixed_precision): the channel "
                                         "map is required (kvf_mixed_map)", fn, ctx->scheme->name);
    if ((rc = check_qstats_arg(ctx, a->qstats)) || (rc = kvf_ctx_push(ctx))) return rc;
    return kvf_ctx_pop(ctx, kvf_gpu_encode(ctx, k, v, &sh, &l, &in, packed, stream));
}

int kvf_encode(kvf_context *ctx, const void *k, const void *v, const kvf_shape *shape, const void *qstats,
               void *packed, size_t packed_bytes, void *stream) {
    const kvf_encode_args a = {.qstats = qstats};
    return encode(ctx, k, v, shape, &a, packed, packed_bytes, stream, "kvf_encode");
}

int kvf_encode_warm(kvf_context *ctx, const void *k, const void *v, const kvf_shape *shape, const void *qstats,
                    const void *prev, size_t prev_bytes, int64_t prev_n_tokens, void *packed, size_t packed_bytes,
                    void *stream) {
    const kvf_encode_args a = {.qstats = qstats, .prev = prev, .prev_bytes = prev_bytes, .prev_n_tokens = prev_n_tokens};
    return encode(ctx, k, v, shape, &a, packed, packed_bytes, stream, "kvf_encode_warm");
}

int kvf_encode_ex(kvf_context *ctx, const void *k, const void *v, const kvf_shape *shape, const kvf_encode_args *args,
                  void *packed, size_t packed_bytes, void *stream) {
    if (!args) return kvf_set_error(KVF_EINVAL, "kvf_encode_ex: args is NULL");
    return encode(ctx, k, v, shape, args, packed, packed_bytes, stream, "kvf_encode_ex");
}

static int decode(kvf_context *ctx, const void *packed, size_t packed_bytes, const kvf_shape *shape,
                  const kvf_decode_args *a, void *k_out, void *v_out, void *stream, const char *fn) {
    kvf_shape sh;
    kvf_layout l;
    int rc = prepare(ctx, k_out, v_out, packed, packed_bytes, shape, &sh, &l, fn);
    if (rc) return rc;
    /* Keys cached before RoPE get it at decode, bits 16 included (METHODS.md:
     * "Bits 16"), as the CPU reference does. */
    if (ctx->scheme->rope.placement == KVF_ROPE_PRE && !a->positions)
        return kvf_set_error(KVF_EINVAL, "%s: scheme %s caches keys before RoPE: positions are required", fn,
                             ctx->scheme->name);
    if (ctx->device == KVF_DEVICE_CPU) return kvf_ref_decode_ex(ctx->scheme, packed, packed_bytes, &sh, a, k_out, v_out);
    struct kvf_scheme anchor_s;
    kvf_layout al;
    if ((rc = kvf_pipeline_args_check(ctx->scheme, &l, packed, l.total_bytes, a->anchor, a->anchor_bytes,
                                      a->anchor_n_tokens, &anchor_s, &al, fn)) ||
        (a->anchor && (rc = aligned16(a->anchor, fn, "the anchor"))))
        return rc;
    if ((rc = kvf_ctx_push(ctx))) return rc;
    return kvf_ctx_pop(ctx, kvf_gpu_decode(ctx, packed, &sh, &l, a->positions, a->anchor, a->anchor ? &al : NULL,
                                           k_out, v_out, stream));
}

int kvf_decode(kvf_context *ctx, const void *packed, size_t packed_bytes, const kvf_shape *shape,
               const int32_t *positions, void *k_out, void *v_out, void *stream) {
    const kvf_decode_args a = {.positions = positions};
    return decode(ctx, packed, packed_bytes, shape, &a, k_out, v_out, stream, "kvf_decode");
}

int kvf_decode_ex(kvf_context *ctx, const void *packed, size_t packed_bytes, const kvf_shape *shape,
                  const kvf_decode_args *args, void *k_out, void *v_out, void *stream) {
    if (!args) return kvf_set_error(KVF_EINVAL, "kvf_decode_ex: args is NULL");
    return decode(ctx, packed, packed_bytes, shape, args, k_out, v_out, stream, "kvf_decode_ex");
}

/* ------------------------------------------------------- query statistics */

int kvf_qstats_init(kvf_context *ctx, void *qstats, size_t bytes, int32_t n_kv_heads, void *stream) {
    if (!ctx || !qstats || n_kv_heads < 1)
        return kvf_set_error(KVF_EINVAL, "kvf_qstats_init: NULL context or buffer, or n_kv_heads < 1");
    kvf_qstats_layout ql;
    int rc = kvf_qstats_layout_compute(ctx->scheme, n_kv_heads, &ql);
    if (rc) return kvf_wrap_error(rc, "kvf_qstats_init");
    if (bytes < ql.total_bytes)
        return kvf_set_error(KVF_ERANGE, "kvf_qstats_init: buffer has %zu bytes, %d KV heads need %zu (kvf_qstats_size)",
                             bytes, n_kv_heads, ql.total_bytes);
    if (ctx->device == KVF_DEVICE_CPU) return kvf_ref_qstats_init(ctx->scheme, qstats, bytes, n_kv_heads);
    if ((uintptr_t)qstats & 15u) return kvf_set_error(KVF_EINVAL, "kvf_qstats_init: buffer must be 16-byte aligned");
    if ((rc = kvf_ctx_push(ctx))) return rc;
    return kvf_ctx_pop(ctx, kvf_gpu_qstats_init(ctx, qstats, ql.total_bytes, &ql, stream));
}

/* kvf_qstats_update on a device (inside kvf_ctx_push). */
static int qstats_update_device(kvf_context *ctx, void *qstats, size_t bytes, const void *q, const kvf_shape *q_shape,
                                void *stream) {
    /* The KV head count is the buffer's: its header, checked on a host copy
     * as kvf_qstats_check checks a host buffer (a blocking read). The caller's
     * stream is drained first: cuMemcpyDtoH runs on the legacy stream, which
     * does not wait for a non-blocking stream's kvf_qstats_init or update. */
    _Alignas(16) uint32_t hdr[16];
    _Static_assert(sizeof hdr == 64, "the qstats header (METHODS.md 4)");
    CUresult r = ctx->cu->cuStreamSynchronize((CUstream)stream);
    if (r != CUDA_SUCCESS) return kvf_cuda_fail(r, "cuStreamSynchronize(stream)", __FILE__, __LINE__, ctx->device);
    r = bytes < sizeof hdr ? CUDA_SUCCESS : ctx->cu->cuMemcpyDtoH(hdr, (CUdeviceptr)(uintptr_t)qstats, sizeof hdr);
    if (r != CUDA_SUCCESS) return kvf_cuda_fail(r, "cuMemcpyDtoH(qstats header)", __FILE__, __LINE__, ctx->device);
    int rc = kvf_qstats_check(ctx->scheme, hdr, bytes, 0);
    if (rc) return kvf_wrap_error(rc, "kvf_qstats_update");
    const int32_t n_kv = (int32_t)hdr[2];
    kvf_qstats_layout ql;
    kvf_shape sh;
    if ((rc = kvf_qstats_layout_compute(ctx->scheme, n_kv, &ql))) return rc;
    if ((rc = kvf_shape_resolve(q_shape, ctx->scheme->head_dim, &sh))) return kvf_wrap_error(rc, "kvf_qstats_update");
    if (sh.n_heads % n_kv)
        return kvf_set_error(KVF_EINVAL, "kvf_qstats_update: %d query heads is not a multiple of %d KV heads",
                             sh.n_heads, n_kv);
    if ((rc = kvf_gpu_check_args(q, q, qstats, &sh, "kvf_qstats_update"))) return rc;
    return kvf_gpu_qstats_update(ctx, qstats, &ql, q, &sh, sh.n_heads / n_kv, stream);
}

int kvf_qstats_update(kvf_context *ctx, void *qstats, size_t bytes, const void *q, const kvf_shape *q_shape,
                      void *stream) {
    if (!ctx || !qstats || !q || !q_shape)
        return kvf_set_error(KVF_EINVAL, "kvf_qstats_update: NULL context, buffer, queries or shape");
    /* The CPU reference checks the buffer and resolves the query shape itself. */
    if (ctx->device == KVF_DEVICE_CPU) return kvf_ref_qstats_update(ctx->scheme, qstats, bytes, q, q_shape);
    int rc = kvf_ctx_push(ctx);
    return rc ? rc : kvf_ctx_pop(ctx, qstats_update_device(ctx, qstats, bytes, q, q_shape, stream));
}
