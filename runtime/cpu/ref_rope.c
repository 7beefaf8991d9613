/*
 * RoPE of one key vector (docs/METHODS.md section 6): frequency pair p rotates
 * channels (p, p + d/2) ("half") or (2p, 2p + 1) ("interleaved"); the pairs
 * are cut into consecutive sections, one per position axis, and pair p_a of
 * section a (n_a pairs, d_a = 2 n_a) turns by pos_a * theta^(-2 p_a / d_a).
 */
#include "cpu/ref.h"

#include <math.h>

/* theta^(-2 p / d_a) computed in f64, rounded to f32. */
static float inv_frequency(double theta, int p, int d_a) {
    return (float)exp2(-((2.0 * p) / d_a) * log2(theta));
}

/* Channels of frequency pair p. */
static void pair_channels(int layout, int d, int p, int *c0, int *c1) {
    if (layout == KVF_ROPE_INTERLEAVED) *c0 = 2 * p, *c1 = 2 * p + 1;
    else *c0 = p, *c1 = p + d / 2;
}

static void rotate_pair(float *x, int c0, int c1, float ang) {
    float cs = cosf(ang), sn = sinf(ang), a = x[c0], b = x[c1];
    x[c0] = a * cs - b * sn;
    x[c1] = a * sn + b * cs;
}

void kvf_ref_rope_table(int d, const kvf_rope_cfg *rope, float *inv, int *axis) {
    int half = d / 2, n_sections = rope->n_sections < 1 ? 1 : rope->n_sections, first = 0;
    for (int p = 0; p < half; p++) axis[p] = -1;
    for (int a = 0; a < n_sections && first < half; a++) {
        /* One section is all d/2 pairs (1D RoPE) whatever sections[0] says;
         * pairs past the sections' sum (the loader forbids it) stay as they are. */
        int n = n_sections == 1 ? half : rope->sections[a];
        if (n > half - first) n = half - first;
        for (int pa = 0; pa < n; pa++) inv[first + pa] = inv_frequency(rope->theta, pa, 2 * n), axis[first + pa] = a;
        first += n > 0 ? n : 0;
    }
}

void kvf_ref_rope_apply(float *x, int d, int layout, const float *inv, const int *axis, const int32_t *pos) {
    for (int p = 0; p < d / 2; p++) {
        if (axis[p] < 0) continue;
        int c0, c1;
        pair_channels(layout, d, p, &c0, &c1);
        rotate_pair(x, c0, c1, (float)pos[axis[p]] * inv[p]);
    }
}

void kvf_ref_rope(float *x, int d, const kvf_rope_cfg *rope, const int32_t *pos) {
    float inv[KVF_REF_MAX_DIM / 2];
    int axis[KVF_REF_MAX_DIM / 2];
    if (d > KVF_REF_MAX_DIM) return;
    kvf_ref_rope_table(d, rope, inv, axis);
    kvf_ref_rope_apply(x, d, rope->layout, inv, axis, pos);
}
