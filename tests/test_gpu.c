/* GPU against the CPU reference: packed bytes identical, decode bit-identical,
 * runs repeatable, strided tensors, precompiled images. Skipped (and says so)
 * where there is no GPU. */
#include "testutil.h"
#include "cuda_api.h"
#include "jit.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

static const kvf_cuda_api *cu;
static CUcontext pctx;
static CUdevice dev;
static char skip_reason[600];
static char *cache_dir;

#define CK(call) assert_int_equal(cu->call, CUDA_SUCCESS)

static int setup(void **state) {
    (void)state;
    int n = 0;
    cache_dir = tu_mkdtemp();
    setenv("KVFORGE_CACHE_DIR", cache_dir, 1);
    if (kvf_device_count(&n) != KVF_OK) {
        snprintf(skip_reason, sizeof skip_reason, "%s", kvf_last_error());
        printf("GPU tests skipped: %s\n", skip_reason);
        return 0;
    }
    kvf_cuda_load(&cu);
    if (cu->cuDeviceGet(&dev, 0) || cu->cuDevicePrimaryCtxRetain(&pctx, dev) || cu->cuCtxPushCurrent(pctx)) return -1;
    char name[128] = "";
    cu->cuDeviceGetName(name, sizeof name, dev);
    printf("GPU: %s\n", name);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    if (pctx) {
        CUcontext p;
        cu->cuCtxPopCurrent(&p);
        cu->cuDevicePrimaryCtxRelease(dev);
    }
    tu_rmtree(cache_dir);
    free(cache_dir);
    return 0;
}

#define SKIP_WITHOUT_GPU()                                    \
    do {                                                      \
        if (skip_reason[0]) { printf("skipped: no GPU\n"); skip(); } \
    } while (0)

static CUdeviceptr dalloc(size_t n, int poison) {
    CUdeviceptr p = 0;
    CK(cuMemAlloc(&p, n));
    CK(cuMemsetD8(p, (unsigned char)poison, n));
    return p;
}

/* Random BF16 in [-8, 8) with a few large values: not only synthetic data. */
static void random_bf16(uint16_t *x, size_t n, uint64_t seed) {
    uint64_t s = seed * 2654435761u + 1;
    for (size_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        float v = (float)((s >> 40) & 0xffff) / 4096.0f - 8.0f;
        if (((s >> 20) & 255) == 7) v *= 40.0f;
        x[i] = kvf_f32_to_bf16(v);
    }
}

typedef struct run_case { int64_t tokens; int heads; int token_major; int pad; } run_case;

/* Element count of a tensor with the case's layout and padding. */
static size_t tensor_elems(const run_case *c, int d, kvf_shape *sh) {
    sh->n_tokens = c->tokens;
    sh->n_heads = c->heads;
    if (c->token_major) { /* [N][H][d] (+pad per token) */
        sh->head_stride = d;
        sh->token_stride = (int64_t)c->heads * d + c->pad;
        return (size_t)(sh->token_stride * c->tokens);
    }
    sh->token_stride = d + c->pad; /* [H][N][d] (+pad per token) */
    sh->head_stride = sh->token_stride * c->tokens;
    return (size_t)(sh->head_stride * c->heads);
}

/* Encode and decode one case on both backends and compare. */
static void compare_case(kvf_context *gpu, kvf_context *cpu, const run_case *c, int data) {
    const kvf_scheme *s = kvf_context_scheme(gpu);
    int d = kvf_scheme_head_dim(s);
    kvf_shape sh;
    size_t n = tensor_elems(c, d, &sh), packed_bytes;
    assert_int_equal(kvf_packed_size(s, c->tokens, c->heads, &packed_bytes), KVF_OK);
    uint16_t *k = malloc(n * 2), *v = malloc(n * 2);
    uint16_t *kc = malloc(n * 2), *vc = malloc(n * 2), *kg = malloc(n * 2), *vg = malloc(n * 2);
    uint8_t *pc = malloc(packed_bytes), *pg = malloc(packed_bytes), *pg2 = malloc(packed_bytes);
    if (data) { random_bf16(k, n, 11 + c->tokens); random_bf16(v, n, 12 + c->tokens); }
    else {
        /* Synthetic data is head-major contiguous: spread it into the layout. */
        uint16_t *tmp = malloc((size_t)c->tokens * c->heads * d * 2 * 2);
        kvf_synth_kv(tmp, c->tokens, c->heads, d, 5);
        kvf_synth_kv(tmp + (size_t)c->tokens * c->heads * d, c->tokens, c->heads, d, 6);
        memset(k, 0x7f, n * 2); memset(v, 0x7f, n * 2);
        for (int h = 0; h < c->heads; h++)
            for (int64_t t = 0; t < c->tokens; t++) {
                size_t src = ((size_t)h * c->tokens + t) * d, dst = t * sh.token_stride + h * sh.head_stride;
                memcpy(k + dst, tmp + src, d * 2);
                memcpy(v + dst, tmp + (size_t)c->tokens * c->heads * d + src, d * 2);
            }
        free(tmp);
    }
    memcpy(kc, k, n * 2); memcpy(vc, v, n * 2); /* padding keeps its values on the CPU side */
    assert_int_equal(kvf_encode(cpu, k, v, &sh, NULL, pc, packed_bytes, NULL), KVF_OK);
    assert_int_equal(kvf_decode(cpu, pc, packed_bytes, &sh, NULL, kc, vc, NULL), KVF_OK);

    CUdeviceptr dk = dalloc(n * 2, 0), dv = dalloc(n * 2, 0), dp = dalloc(packed_bytes, 0xa5);
    CUdeviceptr dk2 = dalloc(n * 2, 0), dv2 = dalloc(n * 2, 0);
    CK(cuMemcpyHtoD(dk, k, n * 2));
    CK(cuMemcpyHtoD(dv, v, n * 2));
    CK(cuMemcpyHtoD(dk2, k, n * 2)); /* so padding holds the same as on the CPU side */
    CK(cuMemcpyHtoD(dv2, v, n * 2));
    assert_int_equal(kvf_encode(gpu, (void *)dk, (void *)dv, &sh, NULL, (void *)dp, packed_bytes, NULL), KVF_OK);
    CK(cuCtxSynchronize());
    CK(cuMemcpyDtoH(pg, dp, packed_bytes));
    /* Bytes between planes are padding nobody writes: compare the planes. */
    kvf_layout l;
    kvf_layout_compute(s, c->tokens, c->heads, &l);
    const kvf_section_layout *secs[2] = {&l.key, &l.value};
    assert_memory_equal(pg, pc, KVF_HEADER_BYTES);
    for (int t = 0; t < 2; t++) {
        assert_memory_equal(pg + secs[t]->codes_off, pc + secs[t]->codes_off, secs[t]->codes_bytes);
        if (secs[t]->scales_bytes)
            assert_memory_equal(pg + secs[t]->scales_off, pc + secs[t]->scales_off, secs[t]->scales_bytes);
        if (secs[t]->zeros_bytes)
            assert_memory_equal(pg + secs[t]->zeros_off, pc + secs[t]->zeros_off, secs[t]->zeros_bytes);
    }
    assert_int_equal(kvf_decode(gpu, (void *)dp, packed_bytes, &sh, NULL, (void *)dk2, (void *)dv2, NULL), KVF_OK);
    CK(cuCtxSynchronize());
    CK(cuMemcpyDtoH(kg, dk2, n * 2));
    CK(cuMemcpyDtoH(vg, dv2, n * 2));
    assert_memory_equal(kg, kc, n * 2); /* bit-identical, padding untouched */
    assert_memory_equal(vg, vc, n * 2);
    /* Same input, same GPU: the same bytes again. */
    CK(cuMemsetD8(dp, 0x5a, packed_bytes));
    assert_int_equal(kvf_encode(gpu, (void *)dk, (void *)dv, &sh, NULL, (void *)dp, packed_bytes, NULL), KVF_OK);
    CK(cuCtxSynchronize());
    CK(cuMemcpyDtoH(pg2, dp, packed_bytes));
    for (int t = 0; t < 2; t++)
        assert_memory_equal(pg2 + secs[t]->codes_off, pg + secs[t]->codes_off, secs[t]->codes_bytes);
    cu->cuMemFree(dk); cu->cuMemFree(dv); cu->cuMemFree(dp); cu->cuMemFree(dk2); cu->cuMemFree(dv2);
    free(k); free(v); free(kc); free(vc); free(kg); free(vg); free(pc); free(pg); free(pg2);
}

static const run_case cases[] = {
    {4680, 8, 0, 0},  /* one 480p chunk, head-major */
    {1560, 4, 1, 0},  /* token-major [N][H][d] */
    {37, 3, 0, 8},    /* odd count, padded rows */
    {1, 1, 1, 16},    /* a single token */
};

static void gpu_matches_cpu(void **state) {
    (void)state;
    SKIP_WITHOUT_GPU();
    for (const char *const *name = kvf_builtin_schemes(); *name; name++) {
        kvf_scheme *s = tu_scheme(*name);
        kvf_context *gpu, *cpu;
        int rc = kvf_context_create(s, 0, &gpu);
        if (rc == KVF_ENOTIMPL) { /* a method without GPU kernels yet */
            printf("%s: %s (skipped)\n", *name, kvf_last_error());
            kvf_scheme_free(s);
            continue;
        }
        if (rc) fail_msg("%s: %s", *name, kvf_last_error());
        assert_int_equal(kvf_context_create(s, KVF_DEVICE_CPU, &cpu), KVF_OK);
        for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
            for (int data = 0; data < 2; data++) compare_case(gpu, cpu, &cases[i], data);
        printf("%s on %s: packed bytes and decode identical to the CPU reference (%zu shapes x 2 data sets)\n",
               kvf_scheme_id(s), kvf_context_backend(gpu), sizeof cases / sizeof *cases);
        kvf_context_destroy(gpu);
        kvf_context_destroy(cpu);
        kvf_scheme_free(s);
    }
}

static double ms_since(const struct timespec *t0) {
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (t1.tv_sec - t0->tv_sec) * 1e3 + (t1.tv_nsec - t0->tv_nsec) / 1e6;
}

static void context_from_cache_and_image(void **state) {
    (void)state;
    SKIP_WITHOUT_GPU();
    kvf_scheme *s = tu_scheme("rtn_int4");
    kvf_context *a, *b, *img_ctx, *cpu;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    assert_int_equal(kvf_context_create(s, 0, &a), KVF_OK);
    double cold = ms_since(&t0);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    assert_int_equal(kvf_context_create(s, 0, &b), KVF_OK);
    double warm = ms_since(&t0);
    printf("context create: %s %.1f ms, then %s %.1f ms\n", kvf_context_origin(a), cold, kvf_context_origin(b), warm);
    assert_string_equal(kvf_context_origin(b), "disk-cache");
    /* A precompiled image loads with no NVRTC involved. */
    void *image;
    size_t size;
    const char *origin;
    assert_int_equal(kvf_jit_image(s, kvf_context_backend(a), 0, &image, &size, &origin), KVF_OK);
    assert_int_equal(kvf_context_create_from_image(kvf_scheme_canonical(s), image, size, 0, &img_ctx), KVF_OK);
    assert_string_equal(kvf_context_origin(img_ctx), "image");
    assert_int_equal(kvf_context_create(s, KVF_DEVICE_CPU, &cpu), KVF_OK);
    run_case c = {300, 2, 0, 0};
    compare_case(img_ctx, cpu, &c, 1);
    /* An image of another scheme is refused by name. */
    kvf_scheme *other = tu_scheme("rtn_int2");
    kvf_context *bad;
    assert_int_equal(kvf_context_create_from_image(kvf_scheme_canonical(other), image, size, 0, &bad), KVF_ECUDA);
    assert_non_null(strstr(kvf_last_error(), "not in the image"));
    free(image);
    kvf_context_destroy(a); kvf_context_destroy(b); kvf_context_destroy(img_ctx); kvf_context_destroy(cpu);
    kvf_scheme_free(s); kvf_scheme_free(other);
}

static void bad_arguments_refused(void **state) {
    (void)state;
    SKIP_WITHOUT_GPU();
    kvf_scheme *s = tu_scheme("rtn_int2");
    kvf_context *g;
    assert_int_equal(kvf_context_create(s, 0, &g), KVF_OK);
    kvf_shape sh = {64, 2, 0, 0};
    size_t bytes;
    kvf_packed_size(s, 64, 2, &bytes);
    CUdeviceptr k = dalloc(64 * 2 * 128 * 2 + 64, 0), p = dalloc(bytes + 64, 0);
    assert_int_equal(kvf_encode(g, (void *)(k + 2), (void *)k, &sh, NULL, (void *)p, bytes, NULL), KVF_EINVAL);
    assert_non_null(strstr(kvf_last_error(), "aligned"));
    assert_int_equal(kvf_encode(g, (void *)k, (void *)k, &sh, NULL, (void *)p, bytes - 1, NULL), KVF_ERANGE);
    kvf_shape odd = {64, 2, 132, 0};
    assert_int_equal(kvf_encode(g, (void *)k, (void *)k, &odd, NULL, (void *)p, bytes, NULL), KVF_EINVAL);
    kvf_context *none = (kvf_context *)1;
    assert_int_equal(kvf_context_create(s, 99, &none), KVF_ENODEV);
    assert_null(none);
    cu->cuMemFree(k); cu->cuMemFree(p);
    kvf_context_destroy(g);
    kvf_scheme_free(s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(gpu_matches_cpu),
        cmocka_unit_test(context_from_cache_and_image),
        cmocka_unit_test(bad_arguments_refused),
    };
    return cmocka_run_group_tests_name("gpu", tests, setup, teardown);
}
