/*
 * Where the evaluation runs a scheme: the CPU reference (host buffers) or a
 * CUDA device (device buffers through runtime/gpu/cuda_api.h; the decoded K/V
 * come back to the host for the metrics). Host tensors in and out either way.
 */
#ifndef KVF_EVAL_BACKEND_H
#define KVF_EVAL_BACKEND_H

#include "kvforge.h"

typedef struct kvf_eval_backend kvf_eval_backend;

/* device: KVF_DEVICE_CPU or a CUDA ordinal. warm: encode each span with
 * kvf_encode_warm from the previous span of the layer (see
 * kvf_eval_backend_new_layer), else kvf_encode. */
int kvf_eval_backend_open(const kvf_scheme *s, int device, int warm, kvf_eval_backend **out);
void kvf_eval_backend_close(kvf_eval_backend *b);
/* "cpu", or "sm_90 (kernels from nvrtc)" and so on. */
const char *kvf_eval_backend_describe(const kvf_eval_backend *b);

/* (Re)initialize the layer's query statistics for n_kv_heads; *bytes = their size. */
int kvf_eval_backend_qstats_init(kvf_eval_backend *b, int32_t n_kv_heads, size_t *bytes);
/* Add one chunk's BF16 queries [n_heads][n_tokens][d]. */
int kvf_eval_backend_qstats_update(kvf_eval_backend *b, const uint16_t *q, const kvf_shape *q_shape);

/* A new layer begins: its first span is encoded from a cold start. */
void kvf_eval_backend_new_layer(kvf_eval_backend *b);

/* Encode the BF16 K and V of one span ([H][N][d] contiguous) with the current
 * statistics (when initialized), warm-started from the layer's previous span
 * when the backend is warm, decode it into k_out/v_out (positions int32
 * [N][n_axes] or NULL); *packed_bytes = kvf_packed_size. */
int kvf_eval_backend_roundtrip(kvf_eval_backend *b, const uint16_t *k, const uint16_t *v, const kvf_shape *shape,
                               const int32_t *positions, int n_axes, uint16_t *k_out, uint16_t *v_out,
                               size_t *packed_bytes);

#endif
