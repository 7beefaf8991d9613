/*
 * An application that links kernels exported by `kvforge export` and runs
 * them with no NVRTC: build with `make aot-demo`, run out/bin/aot_demo.
 * KVF_AOT_ID (the scheme id, e.g. rtn_int2_1a2b3c4d) is set by the Makefile.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_api.h"

#define CAT2(a, b, c) a##b##c
#define CAT(a, b, c) CAT2(a, b, c)
#define AOT_CREATE CAT(kvf_, KVF_AOT_ID, _context_create)
#define AOT_LOAD_SCHEME CAT(kvf_, KVF_AOT_ID, _load_scheme)

int main(void) {
    kvf_context *gpu, *cpu;
    kvf_scheme *s;
    int rc = AOT_CREATE(0, &gpu);
    if (rc) { fprintf(stderr, "aot_demo: %s: %s\n", kvf_strerror(rc), kvf_last_error()); return 1; }
    if ((rc = AOT_LOAD_SCHEME(&s)) || (rc = kvf_context_create(s, KVF_DEVICE_CPU, &cpu))) {
        fprintf(stderr, "aot_demo: %s\n", kvf_last_error());
        return 1;
    }
    printf("kernels from: %s on %s\n", kvf_context_origin(gpu), kvf_context_backend(gpu));
    const kvf_cuda_api *cu;
    kvf_cuda_load(&cu);
    const int64_t tokens = 4680;
    const int heads = 4, d = kvf_scheme_head_dim(s);
    size_t n = (size_t)tokens * heads * d, bytes;
    kvf_packed_size(s, tokens, heads, &bytes);
    uint16_t *k = malloc(n * 2), *v = malloc(n * 2), *kg = malloc(n * 2), *vg = malloc(n * 2), *kc = malloc(n * 2),
             *vc = malloc(n * 2);
    uint8_t *packed = malloc(bytes);
    kvf_synth_kv(k, tokens, heads, d, 21);
    kvf_synth_kv(v, tokens, heads, d, 22);
    kvf_shape sh = {tokens, heads, 0, 0};
    kvf_encode(cpu, k, v, &sh, NULL, packed, bytes, NULL);
    kvf_decode(cpu, packed, bytes, &sh, NULL, kc, vc, NULL);
    CUdevice dev;
    CUcontext pctx, popped;
    CUdeviceptr dk, dv, dp;
    KVF_CU(cu, 0, cuDeviceGet(&dev, 0));
    KVF_CU(cu, 0, cuDevicePrimaryCtxRetain(&pctx, dev));
    KVF_CU(cu, 0, cuCtxPushCurrent(pctx));
    KVF_CU(cu, 0, cuMemAlloc(&dk, n * 2));
    KVF_CU(cu, 0, cuMemAlloc(&dv, n * 2));
    KVF_CU(cu, 0, cuMemAlloc(&dp, bytes));
    KVF_CU(cu, 0, cuMemcpyHtoD(dk, k, n * 2));
    KVF_CU(cu, 0, cuMemcpyHtoD(dv, v, n * 2));
    if ((rc = kvf_encode(gpu, (void *)dk, (void *)dv, &sh, NULL, (void *)dp, bytes, NULL)) ||
        (rc = kvf_decode(gpu, (void *)dp, bytes, &sh, NULL, (void *)dk, (void *)dv, NULL))) {
        fprintf(stderr, "aot_demo: %s\n", kvf_last_error());
        return 1;
    }
    KVF_CU(cu, 0, cuCtxSynchronize());
    KVF_CU(cu, 0, cuMemcpyDtoH(kg, dk, n * 2));
    KVF_CU(cu, 0, cuMemcpyDtoH(vg, dv, n * 2));
    int same = !memcmp(kg, kc, n * 2) && !memcmp(vg, vc, n * 2);
    printf("exported kernels: %lld tokens x %d heads encoded and decoded on the GPU; %s the CPU reference\n",
           (long long)tokens, heads, same ? "bit-identical to" : "DIFFERENT FROM");
    cu->cuMemFree(dk); cu->cuMemFree(dv); cu->cuMemFree(dp);
    cu->cuCtxPopCurrent(&popped);
    kvf_context_destroy(gpu);
    kvf_context_destroy(cpu);
    kvf_scheme_free(s);
    return same ? 0 : 1;
}
