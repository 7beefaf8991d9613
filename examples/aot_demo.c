/*
 * An application that links kernels exported by `kvforge export` and runs
 * them with no NVRTC, built as an outside application would be: the public
 * header kvforge.h, the exported files, libkvforge and the CUDA runtime
 * (`make aot-demo`, then out/bin/aot_demo). KVF_AOT_ID (the scheme id, e.g.
 * rtn_int2_1a2b3c4d) is set by the Makefile. It encodes and decodes one
 * chunk on the GPU and on the CPU reference and compares the two.
 */
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvforge.h"

#define CAT2(a, b, c) a##b##c
#define CAT(a, b, c) CAT2(a, b, c)
#define AOT_CREATE CAT(kvf_, KVF_AOT_ID, _context_create)
#define AOT_LOAD_SCHEME CAT(kvf_, KVF_AOT_ID, _load_scheme)

#define CHECK_CUDA(call)                                                                                 \
    do {                                                                                                 \
        cudaError_t e_ = (call);                                                                         \
        if (e_ != cudaSuccess) {                                                                         \
            fprintf(stderr, "aot_demo: %s failed at %s:%d: %s\n", #call, __FILE__, __LINE__,             \
                    cudaGetErrorString(e_));                                                             \
            exit(1);                                                                                     \
        }                                                                                                \
    } while (0)

#define CHECK_KVF(call)                                                                                  \
    do {                                                                                                 \
        int rc_ = (call);                                                                                \
        if (rc_) {                                                                                       \
            fprintf(stderr, "aot_demo: %s: %s: %s\n", #call, kvf_strerror(rc_), kvf_last_error());       \
            exit(1);                                                                                     \
        }                                                                                                \
    } while (0)

/* BF16 of a float (round to nearest even; the demo's values are finite). */
static uint16_t bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Deterministic values with an outlier channel per token, as KV caches have. */
static void fill(uint16_t *x, size_t n, int d, uint64_t seed) {
    for (size_t i = 0; i < n; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        float u = (float)((seed >> 40) & 0xffffff) / 16777216.0f - 0.5f;
        x[i] = bf16((i % (size_t)d) == (i / (size_t)d) % (size_t)d ? 20.0f * u : 2.0f * u);
    }
}

int main(void) {
    kvf_context *gpu, *cpu;
    kvf_scheme *s;
    CHECK_CUDA(cudaSetDevice(0)); /* the primary context the library's kernels load into */
    CHECK_KVF(AOT_CREATE(0, &gpu));
    CHECK_KVF(AOT_LOAD_SCHEME(&s));
    CHECK_KVF(kvf_context_create(s, KVF_DEVICE_CPU, &cpu));
    printf("kernels from: %s on %s\n", kvf_context_origin(gpu), kvf_context_backend(gpu));
    const int64_t tokens = 4680;
    const int heads = 4, d = kvf_scheme_head_dim(s);
    const size_t n = (size_t)tokens * heads * d;
    size_t bytes;
    CHECK_KVF(kvf_packed_size(s, tokens, heads, &bytes));
    uint16_t *k = malloc(n * 2), *v = malloc(n * 2), *kg = malloc(n * 2), *vg = malloc(n * 2), *kc = malloc(n * 2),
             *vc = malloc(n * 2);
    uint8_t *packed = malloc(bytes);
    if (!k || !v || !kg || !vg || !kc || !vc || !packed) return fprintf(stderr, "aot_demo: out of memory\n"), 1;
    fill(k, n, d, 21);
    fill(v, n, d, 22);
    kvf_shape sh = {tokens, heads, 0, 0};
    CHECK_KVF(kvf_encode(cpu, k, v, &sh, NULL, packed, bytes, NULL));
    CHECK_KVF(kvf_decode(cpu, packed, bytes, &sh, NULL, kc, vc, NULL));
    void *dk, *dv, *dp;
    CHECK_CUDA(cudaMalloc(&dk, n * 2));
    CHECK_CUDA(cudaMalloc(&dv, n * 2));
    CHECK_CUDA(cudaMalloc(&dp, bytes));
    CHECK_CUDA(cudaMemcpy(dk, k, n * 2, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dv, v, n * 2, cudaMemcpyHostToDevice));
    CHECK_KVF(kvf_encode(gpu, dk, dv, &sh, NULL, dp, bytes, NULL));
    CHECK_KVF(kvf_decode(gpu, dp, bytes, &sh, NULL, dk, dv, NULL));
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(cudaMemcpy(kg, dk, n * 2, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(vg, dv, n * 2, cudaMemcpyDeviceToHost));
    const int same = !memcmp(kg, kc, n * 2) && !memcmp(vg, vc, n * 2);
    printf("exported kernels: %lld tokens x %d heads encoded and decoded on the GPU; %s the CPU reference\n",
           (long long)tokens, heads, same ? "bit-identical to" : "DIFFERENT FROM");
    cudaFree(dk);
    cudaFree(dv);
    cudaFree(dp);
    kvf_context_destroy(gpu);
    kvf_context_destroy(cpu);
    kvf_scheme_free(s);
    free(k), free(v), free(kg), free(vg), free(kc), free(vc), free(packed);
    return same ? 0 : 1;
}
