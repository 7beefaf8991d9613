/* Contexts: a scheme bound to a backend (CPU reference or a CUDA device with
 * its loaded kernels), and the encode/decode entry points. */
#include "gpu/cuda_api.h"
#include "gen.h"
#include "gpu/jit.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* templates/kvf_kmeans.cuh's assign_cfg entries (KVF_KMEANS_KERNELS): dynamic
 * shared bytes, threads and tokens per block of the plain and the QSAC
 * assignment, whether stage 0 reads the BF16 input, the residual's rows per
 * thread, the Lloyd sums' threads per block. */
enum { AC_SMEM, AC_SMEM_QSAC, AC_THREADS, AC_THREADS_QSAC, AC_TOKENS, AC_TOKENS_QSAC, AC_BF16_SOURCE, AC_RES_ROWS,
       AC_SUM_THREADS, AC_COUNT };

struct kvf_context {
    struct kvf_scheme *scheme;
    int device; /* KVF_DEVICE_CPU or the CUDA ordinal */
    char backend[24];
    const char *origin;
    const kvf_cuda_api *cu;
    CUdevice dev;
    CUcontext cuctx;
    CUmodule module[KVF_GEN_MAX_PROGRAMS]; /* the programs' modules (kvf_jit_programs), or an image's one */
    int n_modules;
    CUfunction fn[KVF_ROLE_COUNT]; /* NULL where the scheme has no such kernel */
    int sms;                       /* multiprocessors (sizes the k-means assignment grid) */
    int smem_optin;                /* dynamic shared bytes a block may opt into on this device */
    int assign_cfg[2][AC_COUNT];   /* per section: kvf_kmeans assign_cfg, indexed by AC_* */
    CUdeviceptr ws;                /* workspace of the k-means/PSAC path, grown on demand */
    size_t ws_bytes;
};

/* Deep copy of a scheme (free with kvf_scheme_free): a context owns its own. */
static int scheme_clone(const struct kvf_scheme *s, struct kvf_scheme **out) {
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

/* A GPU entry point makes the device's context current once (push_ctx) for
 * all its driver calls and launches, and gives it back (pop_ctx) on every way
 * out: launch3 and workspace run inside and do not push. */
static int push_ctx(const kvf_context *ctx) {
    KVF_CU(ctx->cu, ctx->device, cuCtxPushCurrent(ctx->cuctx));
    return KVF_OK;
}

static int pop_ctx(const kvf_context *ctx, int rc) {
    CUcontext popped;
    ctx->cu->cuCtxPopCurrent(&popped);
    return rc;
}

/* A global of whichever module defines it (each program defines its own
 * globals; the format and interface globals are in every one):
 * CUDA_ERROR_NOT_FOUND where none does. Inside push_ctx. */
static CUresult module_global(const kvf_context *ctx, const char *name, CUdeviceptr *p, size_t *bytes) {
    CUresult r = CUDA_ERROR_NOT_FOUND;
    for (int m = 0; m < ctx->n_modules && r == CUDA_ERROR_NOT_FOUND; m++)
        r = ctx->cu->cuModuleGetGlobal(p, bytes, ctx->module[m], name);
    return r;
}

/* A k-means section's module global kvf_<id>_<k|v>_<sym> (templates/kvf_kmeans.cuh),
 * checked to have `want` bytes. Inside push_ctx. */
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
 * and the remedy, when it has none or another value. Inside push_ctx. */
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
            rc = check_image_u32(ctx, m, "kvf_kernel_abi", KVF_KERNEL_ABI, "kernel interface", "launches");
    return rc;
}

/* A kernel of whichever module defines it. Inside push_ctx. */
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
    int rc = push_ctx(ctx);
    if (rc) return rc;
    CUresult r;
    for (int m = 0; m < n && rc == KVF_OK; m++) {
        if ((r = cu->cuModuleLoadData(&ctx->module[m], images[m])) != CUDA_SUCCESS)
            rc = kvf_cuda_fail(r, "cuModuleLoadData(&module, image)", __FILE__, __LINE__, ctx->device);
        else
            ctx->n_modules = m + 1;
    }
    if (rc == KVF_OK) rc = check_image_format(ctx);
    int present[KVF_ROLE_COUNT];
    kvf_gen_roles(ctx->scheme, present);
    for (int k = 0; k < KVF_ROLE_COUNT && rc == KVF_OK; k++) {
        if (!present[k]) continue;
        char name[160];
        kvf_gen_kernel_name(ctx->scheme, k, name, sizeof name);
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
        if (kvf_gen_kmeans_owner(ctx->scheme, t) != t) {
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
            if (f && ctx->assign_cfg[t][AC_SMEM + k] > ctx->smem_optin) {
                rc = kvf_set_error(KVF_ENOTIMPL,
                                   "the k-means %s assignment of scheme %s needs %d bytes of shared memory per block, "
                                   "device %d (%s) allows %d: %s",
                                   k ? "QSAC" : "nearest-centroid", ctx->scheme->id, ctx->assign_cfg[t][AC_SMEM + k],
                                   ctx->device, ctx->backend, ctx->smem_optin, remedy);
                break;
            }
            if (f && (r = cu->cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                 ctx->assign_cfg[t][AC_SMEM + k])) != CUDA_SUCCESS)
                rc = kvf_cuda_fail(r, "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)", __FILE__, __LINE__,
                                   ctx->device);
        }
    }
    return pop_ctx(ctx, rc);
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
    int rc = push_ctx(ctx);
    if (rc) return rc;
    CUresult r = cu->cuCtxSynchronize();
    for (int t = 0; t < 2 && r == CUDA_SUCCESS && rc == KVF_OK; t++) {
        /* A value section that runs the key section's kernels counts in out[0]. */
        if (!ctx->fn[KVF_R_K_ASSIGN + t * KVF_R_SECTION_STRIDE] || kvf_gen_kmeans_owner(ctx->scheme, t) != t) continue;
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
    return pop_ctx(ctx, rc);
}

/* ------------------------------------------------------------- launches */

enum { BLOCK = 256, VEC = 8 }; /* the templates' block size and channels per lane */
enum { PSAC_ROWS = 128 };       /* kvf_psac::ENCODE_ROWS: the PSAC encode's block size */
enum { QSTATS_TILE = 32 };      /* kvf_qstats::ACC_TILE: channels per side of a statistics block's tile */

static int check_device_args(const void *a, const void *b, const void *packed, const kvf_shape *sh, const char *fn) {
    if (((uintptr_t)a | (uintptr_t)b | (uintptr_t)packed) & 15u)
        return kvf_set_error(KVF_EINVAL, "%s: K, V and packed pointers must be 16-byte aligned", fn);
    if ((sh->token_stride | sh->head_stride) & (VEC - 1))
        return kvf_set_error(KVF_EINVAL, "%s: token_stride and head_stride must be multiples of 8 (got %lld, %lld)",
                             fn, (long long)sh->token_stride, (long long)sh->head_stride);
    if (sh->n_tokens > INT32_MAX || (int64_t)sh->n_tokens * sh->n_heads > (int64_t)INT32_MAX * BLOCK / 32)
        return kvf_set_error(KVF_EINVAL, "%s: %lld tokens x %d heads is too large for one launch", fn,
                             (long long)sh->n_tokens, sh->n_heads);
    /* Some kernels take the head from grid y (PSAC, decode, query
     * statistics, the Lloyd sums; the assignments loop over heads): checked
     * before any of them writes. */
    if (sh->n_heads > 65535)
        return kvf_set_error(KVF_EINVAL, "%s: %d heads: the GPU kernels take at most 65535", fn, sh->n_heads);
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
    if (ctx->device != KVF_DEVICE_CPU) return check_device_args(a, b, packed, sh, fn);
    /* The CPU reads and writes BF16 elements as uint16_t: they must be 2-byte
     * aligned (any other alignment, and any stride, is fine; packed is bytes). */
    if (((uintptr_t)a | (uintptr_t)b) & 1u)
        return kvf_set_error(KVF_EINVAL, "%s: K and V pointers must be 2-byte aligned (BF16 elements)", fn);
    return KVF_OK;
}

static unsigned blocks_for(int64_t items, int64_t per_block) {
    return (unsigned)((items + per_block - 1) / per_block);
}

/* Rows of D channels, D/8 lanes each, BLOCK threads per block. */
static unsigned row_grid(const kvf_context *ctx, const kvf_shape *sh) {
    return blocks_for((int64_t)sh->n_tokens * sh->n_heads, BLOCK / (ctx->scheme->head_dim / VEC));
}

/* Inside push_ctx (the caller's entry point made the context current). */
static int launch3(kvf_context *ctx, int role, unsigned gx, unsigned gy, unsigned gz, unsigned block, unsigned smem,
                   void **args, void *stream) {
    const kvf_cuda_api *cu = ctx->cu;
    if (!ctx->fn[role])
        return kvf_set_error(KVF_EINVAL, "scheme %s has no %s kernel", ctx->scheme->id, kvf_role_names[role]);
    if (!gx || !gy || !gz) return KVF_OK;
    CUresult r = cu->cuLaunchKernel(ctx->fn[role], gx, gy, gz, block, 1, 1, smem, (CUstream)stream, args, NULL);
    if (r != CUDA_SUCCESS) {
        char what[200];
        snprintf(what, sizeof what, "cuLaunchKernel(%s)", kvf_role_names[role]);
        return kvf_cuda_fail(r, what, __FILE__, __LINE__, ctx->device);
    }
    return KVF_OK;
}

static int launch(kvf_context *ctx, int role, unsigned grid, void **args, void *stream) {
    return launch3(ctx, role, grid, 1, 1, BLOCK, 0, args, stream);
}

/* The templates' plane structs (kvf_quant::stage_planes, kvf_decode::section_planes). */
typedef struct { uint64_t codes, scales, tscales, zeros, index, centroids; } stage_arg;
typedef struct { stage_arg stage[KVF_MAX_STAGES]; uint64_t basis, coef, cscale, bscale; } section_arg;
typedef struct { double log2_theta; int32_t n_sections, sections[4]; } rope_arg;
_Static_assert(KVF_MAX_ROPE_SECTIONS == 4, "rope_arg.sections mirrors kvf_decode's rope_args");
typedef struct { uint64_t count, msum, u, lambda; int32_t n_heads, d, r, pad; } qstats_arg;

static stage_arg stage_of(const kvf_stage_layout *s) {
    stage_arg a = {s->codes_off, s->scales_off, s->tscales_off, s->zeros_off, s->index_off, s->centroids_off};
    return a;
}

static section_arg section_of(const kvf_section_layout *l) {
    section_arg a;
    memset(&a, 0, sizeof a);
    for (int s = 0; s < KVF_MAX_STAGES; s++) a.stage[s] = stage_of(&l->stage[s]);
    a.basis = l->basis_off;
    a.coef = l->coef_off;
    a.cscale = l->cscale_off;
    a.bscale = l->bscale_off;
    return a;
}

/* total (the buffer size) may be NULL. */
static int qstats_arg_of(const kvf_scheme *s, int32_t n_heads, qstats_arg *q, size_t *total) {
    kvf_qstats_layout l;
    int rc = kvf_qstats_layout_compute(s, n_heads, &l);
    if (rc) return rc;
    qstats_arg a = {l.count_off, l.msum_off, l.u_off, l.lambda_off, l.n_heads, l.head_dim, l.rank, 0};
    *q = a;
    if (total) *total = l.total_bytes;
    return KVF_OK;
}

/* Workspace of the k-means path (docs/METHODS.md 3): the f32 working vectors
 * e (absent when stage 0 reads the BF16 input and nothing needs the final
 * error), indices, the Lloyd sums and counts of each part of the tokens,
 * QSAC's weights. */
typedef struct { CUdeviceptr e, idx, acc, cnt, w; } ws_parts;

/* Token parts of the Lloyd sums: one block per head and part, about one
 * block (of 1024 threads: it fills a multiprocessor) per multiprocessor in
 * all, at least 256 tokens a part. */
static int sum_parts(const kvf_context *ctx, const kvf_shape *sh) {
    int64_t p = ctx->sms / sh->n_heads, most = (sh->n_tokens + 255) / 256;
    if (p > most) p = most;
    if (p > 64) p = 64;
    return p < 1 ? 1 : (int)p;
}

/* Inside push_ctx, like launch3. */
static int workspace(kvf_context *ctx, const kvf_shape *sh, int need_e, int parts, ws_parts *p) {
    const int64_t rows = (int64_t)sh->n_tokens * sh->n_heads, d = ctx->scheme->head_dim;
    size_t off[6], need = 0;
    const size_t sizes[5] = {need_e ? (size_t)(rows * d * 4) : 0, (size_t)rows * 4,
                             (size_t)parts * sh->n_heads * 256 * d * 8, (size_t)parts * sh->n_heads * 256 * 4,
                             (size_t)(sh->n_heads * d * 4)};
    for (int i = 0; i < 5; i++) { off[i] = need; need += (sizes[i] + 255) & ~(size_t)255; }
    if (need > ctx->ws_bytes) {
        const kvf_cuda_api *cu = ctx->cu;
        if (ctx->ws) cu->cuMemFree(ctx->ws); /* synchronizes: earlier launches are done with it */
        ctx->ws = 0;
        ctx->ws_bytes = 0;
        CUresult r = cu->cuMemAlloc(&ctx->ws, need);
        if (r != CUDA_SUCCESS) return kvf_cuda_fail(r, "cuMemAlloc(workspace)", __FILE__, __LINE__, ctx->device);
        ctx->ws_bytes = need;
    }
    p->e = need_e ? ctx->ws + off[0] : 0;
    p->idx = ctx->ws + off[1];
    p->acc = ctx->ws + off[2];
    p->cnt = ctx->ws + off[3];
    p->w = ctx->ws + off[4];
    return KVF_OK;
}

/* Rows of a stage's working vectors: the BF16 input, or the f32 workspace. */
typedef struct { CUdeviceptr p; int64_t ts, hs; } src_arg;

/* The plain assignment of one k-means stage: labels (int32, the Lloyd
 * step's workspace) and/or plane (the packed index plane); 0 = not written. */
static int assign_plain(kvf_context *ctx, int t, const src_arg *src, int n, int nh, int c_eff, CUdeviceptr cent,
                        int c_alloc, CUdeviceptr labels, CUdeviceptr plane, unsigned grid, void *stream) {
    const int *ac = ctx->assign_cfg[t]; /* kvf_kmeans assign_cfg */
    void *a[] = {(void *)&src->p, (void *)&src->ts, (void *)&src->hs, &n, &nh, &c_eff, &cent, &c_alloc, &labels, &plane};
    return launch3(ctx, KVF_R_K_ASSIGN + t * KVF_R_SECTION_STRIDE, grid, 1, 1, (unsigned)ac[AC_THREADS],
                   (unsigned)ac[AC_SMEM], a, stream);
}

/* k-means of one stage (METHODS.md 3): init, Lloyd steps, final assignment;
 * with kmeans_labels = "last_step" the last step's assignment writes the
 * index plane too, and there is no final assignment. warm (0: none): the
 * previous span's table of this stage, whose first min(its tokens, c_eff)
 * rows replace the strided sample's where they hold no NaN or Inf
 * (prev_tokens: its tokens; kvf_kmeans::init). */
static int kmeans_stage(kvf_context *ctx, int t, int stage, const kvf_shape *sh, const src_arg *src,
                        const ws_parts *ws, int parts, CUdeviceptr packed, const kvf_stage_layout *sl,
                        CUdeviceptr weights, CUdeviceptr warm, int64_t prev_tokens, void *stream) {
    const kvf_tensor_cfg *c = t ? &ctx->scheme->value : &ctx->scheme->key;
    const int base = t * KVF_R_SECTION_STRIDE, d = ctx->scheme->head_dim;
    int nh = sh->n_heads;
    int n = (int)sh->n_tokens, c_alloc = c->centroids, c_eff = n < c_alloc ? n : c_alloc, rc = KVF_OK;
    long long seed = (long long)c->seed;
    CUdeviceptr cent = packed + sl->centroids_off, idx_plane = packed + sl->index_off;
    const int *ac = ctx->assign_cfg[t]; /* kvf_kmeans assign_cfg */
    /* The assignment's blocks share the (head, token tile) pairs of all heads
     * in equal contiguous ranges: one block (its shared memory allows one) a
     * multiprocessor, or one for each block's worth of tokens of each head
     * where that is fewer. */
    unsigned g_tok[2];
    for (int k = 0; k < 2; k++) {
        int64_t g = (int64_t)nh * blocks_for(n, ac[AC_TOKENS + k]);
        g_tok[k] = (unsigned)(g < ctx->sms ? g : ctx->sms);
    }
    unsigned g_cd = blocks_for((int64_t)nh * c_eff * d, BLOCK);
    int chunk = (int)((n + parts - 1) / parts);
    int c_warm = !warm ? 0 : prev_tokens < c_eff ? (int)prev_tokens : c_eff;
    void *a_init[] = {(void *)&src->p, (void *)&src->ts, (void *)&src->hs, &n, &nh, &c_eff, &seed, &stage, &cent,
                      &c_alloc, &warm, &c_warm};
    const bool last_step = kvf_labels_of_last_step(c);
    if ((rc = launch(ctx, KVF_R_K_INIT + base, g_cd, a_init, stream))) return rc;
    for (int it = 0; it < c->kmeans_iters; it++) {
        CUdeviceptr plane = last_step && it == c->kmeans_iters - 1 ? idx_plane : 0;
        void *a_ac[] = {(void *)&src->p, (void *)&src->ts, (void *)&src->hs, (void *)&ws->idx, &n, &c_eff, &chunk,
                        (void *)&ws->acc, (void *)&ws->cnt};
        void *a_fi[] = {&nh, &c_eff, &parts, (void *)&ws->acc, (void *)&ws->cnt, &cent, &c_alloc};
        /* accumulate: one block per (part, head). */
        if ((rc = assign_plain(ctx, t, src, n, nh, c_eff, cent, c_alloc, ws->idx, plane, g_tok[0], stream)) ||
            (rc = launch3(ctx, KVF_R_K_ACCUMULATE + base, (unsigned)parts, (unsigned)nh, 1, (unsigned)ac[AC_SUM_THREADS],
                          0, a_ac, stream)) ||
            (rc = launch(ctx, KVF_R_K_FINALIZE + base, g_cd, a_fi, stream)))
            return rc;
    }
    /* The final labels: the last Lloyd step's (its assignment wrote the index
     * plane), else QSAC's for stage 0 of keys, else one more plain pass. */
    if (!last_step && t == 0 && stage == 0 && c->qsac_candidates > 1) {
        void *a_q[] = {(void *)&src->p, (void *)&src->ts, (void *)&src->hs, &n, &nh, &c_eff, &cent, &c_alloc,
                       &idx_plane, &weights};
        rc = launch3(ctx, KVF_R_K_ASSIGN_QSAC, g_tok[1], 1, 1, (unsigned)ac[AC_THREADS_QSAC], (unsigned)ac[AC_SMEM_QSAC], a_q,
                     stream);
    } else if (!last_step) {
        rc = assign_plain(ctx, t, src, n, nh, c_eff, cent, c_alloc, 0, idx_plane, g_tok[0], stream);
    }
    if (rc || c_eff == c_alloc) return rc;
    void *a_pad[] = {&nh, &c_eff, &c_alloc, &cent};
    return launch(ctx, KVF_R_K_PAD + base, blocks_for((int64_t)nh * (c_alloc - c_eff) * d, BLOCK), a_pad, stream);
}

/* The k-means path of one section: stages (stage 0 on the BF16 input itself
 * where assign_cfg says so, else on the prepared f32 workspace), the residual,
 * then PSAC for keys. */
static int encode_workspace(kvf_context *ctx, int t, const void *x, const kvf_shape *sh, const void *qstats,
                            const kvf_warm_src *warm, CUdeviceptr packed, const kvf_section_layout *l, void *stream) {
    const kvf_tensor_cfg *c = t ? &ctx->scheme->value : &ctx->scheme->key;
    const int base = t * KVF_R_SECTION_STRIDE, d = ctx->scheme->head_dim;
    const int bf = ctx->assign_cfg[t][AC_BF16_SOURCE], parts = sum_parts(ctx, sh);
    int n = (int)sh->n_tokens, nh = sh->n_heads, rc;
    ws_parts ws;
    if ((rc = workspace(ctx, sh, !bf || c->psac_rank > 0, parts, &ws))) return rc;
    qstats_arg q = {0};
    CUdeviceptr qs = (CUdeviceptr)(uintptr_t)qstats;
    if (t == 0 && kvf_scheme_reads_qstats(ctx->scheme) && (rc = qstats_arg_of(ctx->scheme, nh, &q, NULL)))
        return rc;
    src_arg src = {ws.e, d, (int64_t)n * d};
    if (bf) {
        src.p = (CUdeviceptr)(uintptr_t)x;
        src.ts = sh->token_stride;
        src.hs = sh->head_stride;
    } else {
        void *a_prep[] = {(void *)&x, (void *)&sh->token_stride, (void *)&sh->head_stride, &n, &nh, (void *)&ws.e};
        if ((rc = launch(ctx, KVF_R_K_PREP + base, row_grid(ctx, sh), a_prep, stream))) return rc;
    }
    if (t == 0 && c->qsac_candidates > 1) {
        void *a_w[] = {&qs, &q, &nh, (void *)&ws.w};
        if ((rc = launch(ctx, KVF_R_QSAC_WEIGHTS, blocks_for((int64_t)nh * d, BLOCK), a_w, stream)))
            return rc;
    }
    /* Every stage smooths with its own centroids; the last residual alone is
     * quantized, into stage 0's planes (METHODS.md 1). Only the workspace has
     * later stages (a BF16 source means one stage). */
    const int last = c->stages - 1;
    for (int s = 0; s < c->stages && c->centroids > 0; s++) {
        CUdeviceptr w = 0;
        if (warm->packed)
            w = (CUdeviceptr)(uintptr_t)warm->packed + (t ? warm->L.value : warm->L.key).stage[s].centroids_off;
        if ((rc = kmeans_stage(ctx, t, s, sh, &src, &ws, parts, packed, &l->stage[s], ws.w, w, warm->L.n_tokens,
                               stream)))
            return rc;
        if (s == last) break;
        stage_arg st = stage_of(&l->stage[s]);
        void *a_sub[] = {(void *)&ws.e, &n, &nh, &packed, &st};
        if ((rc = launch(ctx, KVF_R_K_SUBTRACT + base, blocks_for((int64_t)n * nh * d, BLOCK), a_sub, stream)))
            return rc;
    }
    stage_arg planes = stage_of(&l->stage[0]);
    planes.index = l->stage[last].index_off;
    planes.centroids = l->stage[last].centroids_off;
    int write_e = c->psac_rank > 0;
    void *a_res[] = {(void *)&src.p, (void *)&src.ts, (void *)&src.hs, (void *)&ws.e, &n, &nh, &packed, &planes,
                     &write_e};
    const unsigned res_grid = blocks_for((int64_t)n * nh, (int64_t)BLOCK / (d / VEC) * ctx->assign_cfg[t][AC_RES_ROWS]);
    if ((rc = launch(ctx, KVF_R_K_RESIDUAL + base, res_grid, a_res, stream))) return rc;
    if (t == 1 || c->psac_rank == 0) return KVF_OK;
    uint64_t basis_off = l->basis_off, bscale_off = l->bscale_off, coef_off = l->coef_off, cscale_off = l->cscale_off;
    void *a_b[] = {&qs, &q, &packed, &basis_off, &bscale_off};
    void *a_p[] = {(void *)&ws.e, &n, &qs, &q, &packed, &basis_off, &bscale_off, &coef_off, &cscale_off};
    /* One block per head (kvf_psac::basis: the head's maximum, then its codes). */
    if ((rc = launch(ctx, KVF_R_PSAC_BASIS, (unsigned)nh, a_b, stream))) return rc;
    /* Grid (token blocks, heads: at most 65535, check_device_args), kvf_psac::ENCODE_ROWS threads: one a token. */
    return launch3(ctx, KVF_R_PSAC_ENCODE, blocks_for(n, PSAC_ROWS), (unsigned)nh, 1, PSAC_ROWS, 0, a_p, stream);
}

/* A device buffer's header is not read here (that would synchronize): only its alignment. */
static int check_qstats_arg(const kvf_context *ctx, const void *qstats) {
    if (!qstats || !kvf_scheme_reads_qstats(ctx->scheme)) return KVF_OK;
    if ((uintptr_t)qstats & 15u) return kvf_set_error(KVF_EINVAL, "kvf_encode: qstats must be 16-byte aligned");
    return KVF_OK;
}

/* kvf_encode's launches (inside push_ctx). */
static int encode_device(kvf_context *ctx, const void *k, const void *v, const kvf_shape *sh, const kvf_layout *l,
                         const void *qstats, const kvf_warm_src *warm, void *packed, void *stream) {
    kvf_packed_header hdr;
    kvf_header_fill(ctx->scheme, l, &hdr);
    int rc, n_tokens = (int)sh->n_tokens, n_heads = sh->n_heads, header_written = 0;
    const void *src[2] = {k, v};
    const kvf_section_layout *sec[2] = {&l->key, &l->value};
    const kvf_tensor_cfg *cfg[2] = {&ctx->scheme->key, &ctx->scheme->value};
    CUdeviceptr dp = (CUdeviceptr)(uintptr_t)packed;
    for (int t = 0; t < 2; t++) {
        char path = kvf_section_path(cfg[t]);
        if (path == 'B') {
            if (!header_written) {
                void *a_h[] = {&packed, &hdr};
                if ((rc = launch(ctx, KVF_R_HEADER, 1, a_h, stream))) return rc;
                header_written = 1;
            }
            if ((rc = encode_workspace(ctx, t, src[t], sh, qstats, warm, dp, sec[t], stream))) return rc;
            continue;
        }
        stage_arg planes = stage_of(&sec[t]->stage[0]);
        int write_header = !header_written;
        header_written = 1;
        void *args[] = {(void *)&src[t], (void *)&sh->token_stride, (void *)&sh->head_stride, &n_tokens, &n_heads,
                        &packed, &planes, &write_header, &hdr};
        unsigned grid = path == 'T' ? blocks_for(((int64_t)n_tokens + cfg[t]->group_size - 1) / cfg[t]->group_size *
                                                     n_heads, BLOCK / (ctx->scheme->head_dim / VEC))
                                    : row_grid(ctx, sh);
        if ((rc = launch(ctx, KVF_R_ENCODE_K + t, grid, args, stream))) return rc;
    }
    return KVF_OK;
}

/* kvf_encode and kvf_encode_warm (fn: which, for messages). */
static int encode(kvf_context *ctx, const void *k, const void *v, const kvf_shape *shape, const void *qstats,
                  const void *prev, size_t prev_bytes, int64_t prev_n_tokens, void *packed, size_t packed_bytes,
                  void *stream, const char *fn) {
    kvf_shape sh;
    kvf_layout l;
    int rc = prepare(ctx, k, v, packed, packed_bytes, shape, &sh, &l, fn);
    if (rc) return rc;
    if (ctx->device == KVF_DEVICE_CPU)
        return kvf_ref_encode_warm(ctx->scheme, k, v, &sh, qstats, prev, prev_bytes, prev_n_tokens, packed,
                                   packed_bytes);
    /* The previous span's header is not read on a device (kvf_decode does not
     * read one either): its size and place are checked. */
    kvf_warm_src warm = {prev, {0}};
    if (prev) {
        if ((rc = kvf_warm_check(ctx->scheme, prev, prev_bytes, prev_n_tokens, sh.n_heads, packed, l.total_bytes,
                                 &warm.L)))
            return kvf_wrap_error(rc, "%s: the previous span's packed cache", fn);
        if ((uintptr_t)prev & 15u) /* the init kernel reads its rows 16 bytes at a time */
            return kvf_set_error(KVF_EINVAL, "%s: the previous span's packed cache must be 16-byte aligned", fn);
    }
    if ((rc = check_qstats_arg(ctx, qstats)) || (rc = push_ctx(ctx))) return rc;
    return pop_ctx(ctx, encode_device(ctx, k, v, &sh, &l, qstats, &warm, packed, stream));
}

int kvf_encode(kvf_context *ctx, const void *k, const void *v, const kvf_shape *shape, const void *qstats,
               void *packed, size_t packed_bytes, void *stream) {
    return encode(ctx, k, v, shape, qstats, NULL, 0, 0, packed, packed_bytes, stream, "kvf_encode");
}

int kvf_encode_warm(kvf_context *ctx, const void *k, const void *v, const kvf_shape *shape, const void *qstats,
                    const void *prev, size_t prev_bytes, int64_t prev_n_tokens, void *packed, size_t packed_bytes,
                    void *stream) {
    return encode(ctx, k, v, shape, qstats, prev, prev_bytes, prev_n_tokens, packed, packed_bytes, stream,
                  "kvf_encode_warm");
}

static rope_arg rope_of(const kvf_scheme *s) {
    rope_arg r;
    memset(&r, 0, sizeof r);
    r.log2_theta = log2(s->rope.theta > 0 ? s->rope.theta : 10000.0);
    r.n_sections = kvf_rope_sections(s, r.sections);
    return r;
}

int kvf_decode(kvf_context *ctx, const void *packed, size_t packed_bytes, const kvf_shape *shape,
               const int32_t *positions, void *k_out, void *v_out, void *stream) {
    kvf_shape sh;
    kvf_layout l;
    int rc = prepare(ctx, k_out, v_out, packed, packed_bytes, shape, &sh, &l, "kvf_decode");
    if (rc) return rc;
    /* Keys cached before RoPE get it at decode, bits 16 included (METHODS.md:
     * "Bits 16"), as the CPU reference does. */
    if (ctx->scheme->rope.placement == KVF_ROPE_PRE && !positions)
        return kvf_set_error(KVF_EINVAL, "kvf_decode: scheme %s caches keys before RoPE: positions are required",
                             ctx->scheme->name);
    if (ctx->device == KVF_DEVICE_CPU)
        return kvf_ref_decode(ctx->scheme, packed, packed_bytes, &sh, positions, k_out, v_out);
    /* Grid (token tiles of K, then of V; heads): blockIdx.y is the head
     * (templates/kvf_decode.cuh; at most 65535, check_device_args). */
    int n_tokens = (int)sh.n_tokens, n_heads = sh.n_heads;
    const kvf_section_layout *sec[2] = {&l.key, &l.value};
    section_arg planes[2];
    unsigned blocks[2];
    for (int t = 0; t < 2; t++) {
        /* Tokens per block: BLOCK / (d/8) rows x 4 (kvf_decode::tiling's
         * largest rows per thread at 8 channels a lane; at 16 channels a
         * lane, lane_channels, BLOCK / (d/16) rows x 2, the same tokens;
         * where tiling takes half as many rows a thread, a block's tiles are
         * half this size and it covers twice as many), x
         * tiles per block: 4 with centroids or PSAC (a block loads its next
         * tile's centroid indices while it decodes this one where they fit
         * 4 registers, and its head's PSAC basis once; qvg_pro_int2's 4
         * stages, which do not fit, gained too), 2 otherwise. Measured on the H200 (session 11,
         * decode K+V): qvg_int2 0.182 ms at 1 tile, 0.167 at 2, 0.164 at 4;
         * kivi_int2 0.156 at 1, 0.151 at 2; rtn_int2 0.149-0.150 at 1 and 2,
         * 0.153 at 4; quantwm_int2's PSAC keys fastest at 4 (of 2, 4, 8). A
         * section's blocks loop over tiles b, b + nb, ... of their own size,
         * so this only tunes speed; it keeps nb x tile below 2^32 for the
         * kernel's u32 token math. */
        const int tiles = sec[t]->centroids > 0 || sec[t]->psac_rank > 0 ? 4 : 2;
        int64_t tile = (int64_t)(BLOCK / (ctx->scheme->head_dim / VEC)) * 4 * tiles;
        blocks[t] = blocks_for(sh.n_tokens, tile);
        planes[t] = section_of(sec[t]);
    }
    rope_arg rope = rope_of(ctx->scheme);
    void *args[] = {(void *)&packed, &planes[0], &planes[1], &n_tokens, &k_out, &v_out,
                    &sh.token_stride, &sh.head_stride, (void *)&positions, &rope, &blocks[0], &blocks[1]};
    if ((rc = push_ctx(ctx))) return rc;
    rc = launch3(ctx, KVF_R_DECODE, blocks[0] + blocks[1], (unsigned)n_heads, 1, BLOCK, 0, args, stream);
    return pop_ctx(ctx, rc);
}

/* ------------------------------------------------------- query statistics */

int kvf_qstats_init(kvf_context *ctx, void *qstats, size_t bytes, int32_t n_kv_heads, void *stream) {
    if (!ctx || !qstats || n_kv_heads < 1)
        return kvf_set_error(KVF_EINVAL, "kvf_qstats_init: NULL context or buffer, or n_kv_heads < 1");
    qstats_arg q;
    size_t total;
    int rc = qstats_arg_of(ctx->scheme, n_kv_heads, &q, &total);
    if (rc) return kvf_wrap_error(rc, "kvf_qstats_init");
    if (bytes < total)
        return kvf_set_error(KVF_ERANGE, "kvf_qstats_init: buffer has %zu bytes, %d KV heads need %zu (kvf_qstats_size)",
                             bytes, n_kv_heads, total);
    if (ctx->device == KVF_DEVICE_CPU) return kvf_ref_qstats_init(ctx->scheme, qstats, bytes, n_kv_heads);
    if ((uintptr_t)qstats & 15u) return kvf_set_error(KVF_EINVAL, "kvf_qstats_init: buffer must be 16-byte aligned");
    uint64_t tot = total;
    void *args[] = {&qstats, &tot, &q};
    unsigned grid = blocks_for((int64_t)(total / 8), BLOCK);
    if ((rc = push_ctx(ctx))) return rc;
    return pop_ctx(ctx, launch(ctx, KVF_R_QSTATS_INIT, grid > 1024 ? 1024 : grid, args, stream));
}

/* kvf_qstats_update on a device (inside push_ctx). */
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
    int32_t n_kv = (int32_t)hdr[2];
    qstats_arg qa;
    kvf_shape sh;
    if ((rc = qstats_arg_of(ctx->scheme, n_kv, &qa, NULL))) return rc;
    if ((rc = kvf_shape_resolve(q_shape, ctx->scheme->head_dim, &sh))) return kvf_wrap_error(rc, "kvf_qstats_update");
    if (sh.n_heads % n_kv)
        return kvf_set_error(KVF_EINVAL, "kvf_qstats_update: %d query heads is not a multiple of %d KV heads",
                             sh.n_heads, n_kv);
    if ((rc = check_device_args(q, q, qstats, &sh, "kvf_qstats_update"))) return rc;
    int n = (int)sh.n_tokens, group = sh.n_heads / n_kv, d = ctx->scheme->head_dim;
    /* Both kernels test each query row for NaN/Inf: accumulate leaves such rows
     * out of the sums, eigen counts the others (the count is known only there). */
    void *a_acc[] = {(void *)&q, &sh.token_stride, &sh.head_stride, &n, &group, &qstats, &qa};
    void *a_eig[] = {&qstats, &qa, (void *)&q, &sh.token_stride, &sh.head_stride, &n, &group};
    const unsigned side = (unsigned)(d / QSTATS_TILE), tiles = side * (side + 1) / 2; /* kvf_qstats::acc_grid */
    if ((rc = launch3(ctx, KVF_R_QSTATS_ACCUMULATE, tiles, (unsigned)n_kv, 1, BLOCK, 0, a_acc, stream)))
        return rc;
    return launch3(ctx, KVF_R_QSTATS_EIGEN, (unsigned)n_kv, 1, 1, BLOCK, 0, a_eig, stream);
}

int kvf_qstats_update(kvf_context *ctx, void *qstats, size_t bytes, const void *q, const kvf_shape *q_shape,
                      void *stream) {
    if (!ctx || !qstats || !q || !q_shape)
        return kvf_set_error(KVF_EINVAL, "kvf_qstats_update: NULL context, buffer, queries or shape");
    /* The CPU reference checks the buffer and resolves the query shape itself. */
    if (ctx->device == KVF_DEVICE_CPU) return kvf_ref_qstats_update(ctx->scheme, qstats, bytes, q, q_shape);
    int rc = push_ctx(ctx);
    return rc ? rc : pop_ctx(ctx, qstats_update_device(ctx, qstats, bytes, q, q_shape, stream));
}
