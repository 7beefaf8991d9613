/*
 * Building blocks of the CPU reference (docs/METHODS.md), one file per
 * method. All host memory, f32 vectors of head_dim channels unless said.
 * The orchestration (ref_encode.c) calls these per head and stage.
 */
#ifndef KVF_REF_H
#define KVF_REF_H
#include "internal.h"

/* ref_hadamard.c: normalized Walsh-Hadamard transform in place (METHODS.md 5). */
void kvf_ref_hadamard(float *x, int d);

#define KVF_REF_MAX_DIM 1024 /* head_dim bound of the CPU reference (its stack vectors) */

/* ref_rope.c: apply RoPE in place to one key vector (METHODS.md 6); pos has
 * rope->n_sections (>= 1; 0 is read as 1) entries. The inverse frequency and
 * the position axis of each of the d/2 pairs (-1: not turned) depend on the
 * scheme only: kvf_ref_rope_table computes them once, kvf_ref_rope_apply turns
 * every vector with them; kvf_ref_rope does both for one vector (d <= 1024). */
void kvf_ref_rope_table(int d, const kvf_rope_cfg *rope, float *inv, int *axis);
void kvf_ref_rope_apply(float *x, int d, int layout, const float *inv, const int *axis, const int32_t *pos);
void kvf_ref_rope(float *x, int d, const kvf_rope_cfg *rope, const int32_t *pos);

/* ref_kmeans.c: seeded strided init + Lloyd iterations over n vectors
 * e[n][d] (f32); writes the final bf16 centroids cent[C][d] (C = min(c, n))
 * and, where last_z is not NULL and iters > 0, the last Lloyd step's
 * assignment last_z[n] (the clusters whose means the centroids are;
 * kmeans_labels = "last_step") (METHODS.md 3). KVF_OK, or KVF_ENOMEM for its
 * work space. */
int kvf_ref_kmeans(const float *e, int64_t n, int d, int c, int iters, int64_t seed, int stage,
                   int head, uint16_t *cent, int *last_z);
/* The same, warm-started: row j < c_warm (<= C) of the initial table is
 * warm[j] (bf16; the previous span's centroids) where that row holds no NaN
 * or Inf, the strided sample's otherwise, and the rows past c_warm are the
 * sample's (kvf_encode_warm, METHODS.md 3). warm NULL or c_warm 0:
 * kvf_ref_kmeans. */
int kvf_ref_kmeans_warm(const float *e, int64_t n, int d, int c, int iters, int64_t seed, int stage,
                        int head, const uint16_t *warm, int c_warm, uint16_t *cent, int *last_z);
/* Nearest centroid (f64 distance, ties to the lowest index). The norms
 * ||mu_j||^2 (f64, channel order) depend on the table only: compute them once
 * with kvf_ref_centroid_norms and assign every token with
 * kvf_ref_nearest_normed; kvf_ref_nearest does both for one vector. */
#define KVF_REF_MAX_CENTROIDS 256 /* the loader's limit (u8 indices) */
void kvf_ref_centroid_norms(const uint16_t *cent, int c, int d, double *norms);
int kvf_ref_nearest_normed(const float *x, const uint16_t *cent, const double *norms, int c, int d);
int kvf_ref_nearest(const float *x, const uint16_t *cent, int c, int d);
/* QSAC: the index chosen among the m best candidates by weighted distance
 * (w: d channel weights), scored by the residual ranges of groups of
 * group_size channels (METHODS.md 3). */
int kvf_ref_qsac(const float *x, const uint16_t *cent, int c, int d, const float *w, int m, int group_size);

/* ref_qstats.c: query statistics (kvf_ref_qstats_init/update in internal.h) and
 * these accessors: M_h diagonal (count 0 -> all ones) and the basis. */
int kvf_ref_qstats_weights(const void *qstats, int32_t head, int d, float *w);
/* f32 U [d][r] and lambda [r] of a head; returns 0 when count_h == 0 (no basis). */
int kvf_ref_qstats_basis(const void *qstats, int32_t head, int d, int r, const float **u,
                         const float **lambda);
/* Orthogonal iteration on a symmetric d x d matrix (METHODS.md 4): u [d][r]
 * in/out, iters steps, then lambda sorted descending (columns reordered). */
void kvf_ref_orthogonal_iteration(const float *m, int d, int r, int iters, float *u, float *lambda);

/* ref_psac.c (METHODS.md 4). The stored basis of one head: u f32 [d][r] ->
 * int8 codes b [d][r] and one f32 scale (all 0 when u has no usable maximum).
 * PSAC of one token: e = x - x_hat_0 [d], lambda [r]; writes coef int8 [r] and
 * its fp16 scale (0 when not kept). Apply adds the stored correction to y. */
void kvf_ref_psac_basis(const float *u, int d, int r, int8_t *b, float *bscale);
void kvf_ref_psac_encode(const float *e, const int8_t *b, float bscale, const float *lambda, int d, int r,
                         int8_t *coef, uint16_t *scale);
void kvf_ref_psac_apply(float *y, const int8_t *b, float bscale, const int8_t *coef, uint16_t scale, int d, int r);

/* ref_quant.c: residual quantization of head h at one stage (METHODS.md 2,
 * FORMAT.md): r [n][d] f32 -> the stage's codes and scale planes of that head
 * (axis channel or token, fp16 or int8_fp16 scales, affine or symmetric;
 * bits < 16). Decode writes what the decoder adds: rhat [n][d]. */
void kvf_ref_quant_encode(const kvf_section_layout *l, const kvf_stage_layout *st, int64_t n,
                          int32_t h, int d, const float *r, uint8_t *packed);
void kvf_ref_quant_decode(const kvf_section_layout *l, const kvf_stage_layout *st, int64_t n,
                          int32_t h, int d, const uint8_t *packed, float *rhat);

/* ref_pipeline.c: the practitioner's pipeline (METHODS.md 11). */
/* The k channels of a row r of largest magnitude (a NaN above every number;
 * ties: the lower channel), largest first. */
void kvf_ref_outliers_pick(const float *r, int d, int k, uint8_t *idx);
/* Refinement of a row's calibrated channels (map[c]: the slot, 255 none):
 * the difference r - rhat quantized symmetric at `bits` under the row's
 * fp16 scale (its largest |difference| / (2^(bits-1) - 1); a difference that
 * is not finite, as at an outlier where r is NaN, counts as 0); codes at bit
 * slot * bits (m slots), the scale, and what decode adds to each refined
 * channel (add[c]; other channels untouched). */
void kvf_ref_refine_encode(const float *r, const float *rhat, const uint8_t *map, int d, int m, int bits,
                           uint8_t *codes, uint16_t *scale, float *add);
/* What decode adds to each refined channel of a row (others untouched). */
void kvf_ref_refine_decode(const uint8_t *codes, uint16_t scale, const uint8_t *map, int d, int bits, float *add);
/* Section t's rows of head h of an anchor span (of scheme `anchor`,
 * kvf_scheme_anchor's) as f32 [n_tokens][d], before RoPE. */
int kvf_ref_anchor_rows(const struct kvf_scheme *anchor, const uint8_t *packed, int64_t n_tokens, int32_t n_heads,
                        int32_t h, int t, float *rows);

#endif
