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

/* A new layer begins: its first span is encoded from a cold start, with no
 * anchor and no carried error. map: mixed precision's channel map of the
 * layer (kvf_mixed_map, u8 [2][n_kv_heads][head_dim]), NULL for a scheme
 * without mixed precision. */
int kvf_eval_backend_new_layer(kvf_eval_backend *b, const uint8_t *map, int32_t n_kv_heads);

/* What the chunk policy says of a span (kvf_chunk_step). */
typedef struct kvf_eval_span {
    int anchor;      /* an anchor: kvf_scheme_anchor's scheme; later spans are coded against it */
    int against;     /* coded against the layer's last anchor */
    int feedback_in; /* continues the error carried from the previous span */
    int warm;        /* the previous span may warm-start its k-means (a warm backend only) */
} kvf_eval_span;

/* Encode the BF16 K and V of one span ([H][N][d] contiguous) with the current
 * statistics (when initialized) and what span says, decode it into
 * k_out/v_out (positions int32 [N][n_axes] or NULL); *packed_bytes: the
 * span's packed size (the anchor scheme's for an anchor). */
int kvf_eval_backend_roundtrip(kvf_eval_backend *b, const kvf_eval_span *span, const uint16_t *k, const uint16_t *v,
                               const kvf_shape *shape, const int32_t *positions, int n_axes, uint16_t *k_out,
                               uint16_t *v_out, size_t *packed_bytes);

/* Bytes of encoder state a layer holds besides its cache: error feedback's
 * carried error (f32, keys and values, one span), 0 without it. */
size_t kvf_eval_backend_state_bytes(const kvf_eval_backend *b);

#endif
