/*
 * QuaRot-style rotation (docs/METHODS.md section 5): the normalized
 * Walsh-Hadamard transform along the d channels of one vector, in place. The
 * normalized matrix H / sqrt(d) is symmetric and orthogonal, so it is its own
 * inverse: decode applies the same transform.
 */
#include "cpu/ref.h"

#include <math.h>

/* 1/sqrt(d) rounded to f32: 0.125f for 64, 0.088388347648f for 128, 0.0625f for 256. */
static float norm_of(int d) { return (float)(1.0 / sqrt((double)d)); }

void kvf_ref_hadamard(float *x, int d) {
    for (int len = 1; len < d; len <<= 1)
        for (int i = 0; i < d; i++) {
            if (i & len) continue;
            float a = x[i], b = x[i + len];
            x[i] = a + b;
            x[i + len] = a - b;
        }
    float k = norm_of(d);
    for (int i = 0; i < d; i++) x[i] = x[i] * k;
}
