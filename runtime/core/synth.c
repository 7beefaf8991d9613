/* Deterministic synthetic K/V with video-like statistics (demo and tests). */
#include "internal.h"

#include <math.h>

static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double uniform01(uint64_t *s) { return (double)(splitmix64(s) >> 11) * 0x1.0p-53; }

static double normal(uint64_t *s) {
    double u1 = uniform01(s), u2 = uniform01(s);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

void kvf_synth_kv(uint16_t *x, int64_t n_tokens, int n_heads, int head_dim, uint64_t seed) {
    for (int h = 0; h < n_heads; h++) {
        /* A slowly varying per-head channel profile, as real heads have. */
        for (int64_t t = 0; t < n_tokens; t++) {
            uint64_t st = seed * 0x100000001b3ull + (uint64_t)h * 0x9e3779b97f4a7c15ull +
                          (uint64_t)t * 0xd1b54a32d192ed03ull;
            double scale = 0.5 + uniform01(&st);
            int o1 = (int)(splitmix64(&st) % (uint64_t)head_dim);
            int o2 = (int)(splitmix64(&st) % (uint64_t)head_dim);
            uint16_t *row = x + ((int64_t)h * n_tokens + t) * head_dim;
            for (int c = 0; c < head_dim; c++) {
                double base = normal(&st) + 0.5 * sin(0.37 * c + 0.11 * h);
                double v = scale * base;
                if (c == o1 || c == o2) v += (splitmix64(&st) & 1 ? 20.0 : -20.0) * scale;
                row[c] = kvf_f32_to_bf16((float)v);
            }
        }
    }
}
