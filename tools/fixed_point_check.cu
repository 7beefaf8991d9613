// Exhaustive check of templates/kvf_kmeans.cuh's fixed_point_split against
// the conversion-instruction form it replaced (rintf, floorf, f2i), over all
// 2^32 f32 bit patterns (every BF16 value is one of them). A one-off proof
// for docs/VALIDATION.md, not part of the build (it uses the CUDA runtime):
//   nvcc -O3 -arch=sm_90 -I templates -o out/bin/fixed_point_check tools/fixed_point_check.cu
//   out/bin/fixed_point_check   (exit 0: identical for every input)
#include <cstdio>
#include "kvf_kmeans.cuh"

// The form before 2026-11-29 (session 5).
__device__ __forceinline__ void split_with_conversions(float v, int &hi, u32 &lo) {
    float r = __fmul_rn(v, 1048576.0f);
    r = r != r ? 0.0f : fminf(fmaxf(r, -68719476736.0f), 68719476736.0f);
    r = rintf(r);
    const float q = floorf(__fmul_rn(r, 9.5367431640625e-7f));
    hi = __float2int_rn(q);
    lo = __float2uint_rn(__fmaf_rn(-q, 1048576.0f, r));
}

__global__ void check(u64 *bad, u64 *first) {
    for (u64 b = (u64)blockIdx.x * blockDim.x + threadIdx.x; b < (1ull << 32); b += (u64)gridDim.x * blockDim.x) {
        const float v = __uint_as_float((u32)b);
        int h1, h2;
        u32 l1, l2;
        split_with_conversions(v, h1, l1);
        kvf_kmeans::fixed_point_split(v, h2, l2);
        if ((h1 != h2 || l1 != l2) && atomicAdd(bad, 1ull) == 0) *first = b;
    }
}

int main() {
    u64 *d, h[2] = {0, 0};
    if (cudaMalloc(&d, sizeof h) != cudaSuccess) return fprintf(stderr, "no GPU\n"), 2;
    cudaMemset(d, 0, sizeof h);
    check<<<132 * 8, 256>>>(d, d + 1);
    cudaError_t e = cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost);
    printf("fixed_point_split over all 2^32 f32 patterns: %llu differ (first 0x%08llx), %s\n", h[0], h[1],
           cudaGetErrorString(e));
    return e != cudaSuccess || h[0] != 0;
}
