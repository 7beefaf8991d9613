/*
 * kvforge: KV-cache compression for video world models.
 *
 * Public C API. Every function returns a status: KVF_OK (0) or a negative
 * kvf_status; kvf_strerror() names the code and kvf_last_error() gives the
 * detailed message of the last failure on the calling thread (file, line and
 * field for schemes; the CUDA call, file and line for GPU errors).
 *
 * Device pointers and streams are the caller's: kvforge never allocates the
 * packed cache or the BF16 tensors. Streams are passed as void* (a CUstream or
 * cudaStream_t; NULL is the legacy default stream).
 */
#ifndef KVFORGE_H
#define KVFORGE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* What libkvforge exports: these functions and nothing else (it is built
 * with hidden visibility). */
#if defined(__GNUC__)
#define KVF_API __attribute__((visibility("default")))
#else
#define KVF_API
#endif

#define KVF_VERSION_MAJOR 0
#define KVF_VERSION_MINOR 2
#define KVF_VERSION_PATCH 0
#define KVF_VERSION_STR2(x) #x
#define KVF_VERSION_STR(a, b, c) KVF_VERSION_STR2(a) "." KVF_VERSION_STR2(b) "." KVF_VERSION_STR2(c)
#define KVF_VERSION_STRING KVF_VERSION_STR(KVF_VERSION_MAJOR, KVF_VERSION_MINOR, KVF_VERSION_PATCH)

/* The one table of statuses (libuv's pattern): it makes the enum here, and
 * the names and messages kvf_status_name and kvf_strerror return (the
 * Python binding asks those, so it cannot drift). XX(NAME, code, message). */
#define KVF_STATUS_MAP(XX)                                                                           \
    XX(OK, 0, "success")                                                                             \
    XX(EINVAL, -1, "invalid argument")                   /* null, size, stride, alignment */         \
    XX(ENOMEM, -2, "out of host memory")                                                             \
    XX(ESCHEME, -3, "invalid scheme")                    /* the message names file:line: field */    \
    XX(ENOTIMPL, -4, "not implemented yet")              /* a valid configuration this build lacks */\
    XX(ENOCUDA, -5, "CUDA driver library (libcuda) not found")                                       \
    XX(ENODEV, -6, "no CUDA device")                     /* or the ordinal does not exist */         \
    XX(ENONVRTC, -7, "NVRTC library not found: only precompiled kernels can load")                   \
    XX(ECOMPILE, -8, "kernel compilation failed")        /* NVRTC's log in the message */            \
    XX(ECUDA, -9, "CUDA driver call failed")             /* the call, file and line in the message */\
    XX(EIO, -10, "file system error")                                                                \
    XX(EFORMAT, -11, "wrong or corrupt format")          /* packed cache or file of another format */\
    XX(ERANGE, -12, "buffer too small")                                                              \
    XX(ETOOL, -13, "external tool failed")               /* fatbinary */

typedef enum kvf_status {
#define KVF_STATUS_ENUM(name, code, msg) KVF_##name = code,
    KVF_STATUS_MAP(KVF_STATUS_ENUM)
#undef KVF_STATUS_ENUM
} kvf_status;

/* Name and one-line description of a status code, like strerror. */
KVF_API const char *kvf_strerror(int status);
KVF_API const char *kvf_status_name(int status);
/* Detailed message of the last error on this thread ("" if none). */
KVF_API const char *kvf_last_error(void);

KVF_API const char *kvf_version(void);

/* ------------------------------------------------------------------ schemes */

typedef struct kvf_scheme kvf_scheme;

/* Load a scheme from a Lua file (sandboxed). */
KVF_API int kvf_scheme_load(const char *path, kvf_scheme **out);
/* Load from text; chunkname is used in messages (e.g. "@myscheme.lua"). */
KVF_API int kvf_scheme_load_string(const char *text, size_t len, const char *chunkname,
                           kvf_scheme **out);
/* Load one of the schemes shipped inside the library, by name ("rtn_int2"). */
KVF_API int kvf_scheme_load_builtin(const char *name, kvf_scheme **out);
KVF_API void kvf_scheme_free(kvf_scheme *s);

KVF_API const char *kvf_scheme_name(const kvf_scheme *s);
/* Normalized configuration as canonical Lua text (every field, sorted). */
KVF_API const char *kvf_scheme_canonical(const kvf_scheme *s);
/* 64-bit hash of the canonical text; id = name + "_" + 8 hex digits. */
KVF_API uint64_t kvf_scheme_hash(const kvf_scheme *s);
KVF_API const char *kvf_scheme_id(const kvf_scheme *s);
KVF_API int kvf_scheme_head_dim(const kvf_scheme *s);

/* What a caller (the Python binding, a cache manager) needs to know of a
 * scheme. Fields may be added at the end in later versions. */
typedef struct kvf_scheme_info {
    int head_dim;
    int key_bits, value_bits;
    int chunk_tokens, chunk_span, chunk_recent, chunk_sink;
    int rope_placement;      /* 0 none, 1 pre, 2 post */
    int rope_axes;           /* position axes (rope.sections count), >= 1 */
    int psac_rank;           /* key.psac_rank */
    int key_centroids;
    int key_qsac_candidates; /* encode reads query statistics when > 1 or psac_rank > 0 */
    int rope_layout;         /* 0 half, 1 interleaved */
    int rope_sections[4];    /* frequency pairs per axis; 1-D RoPE = { head_dim / 2 } */
    double rope_theta;
    /* The pipeline (docs/METHODS.md 11), keys then values; zero: off. */
    int outliers[2];         /* values a row keeps exactly */
    int mixed_channels[2];   /* refined channels a head: the encode needs a channel map (kvf_mixed_map) */
    int anchor_every;        /* chunks from one anchor to the next: the stream needs anchor spans */
    int anchor_bits;
    double feedback_decay;   /* > 0: the encode carries error feedback state */
} kvf_scheme_info;
KVF_API int kvf_scheme_get_info(const kvf_scheme *s, kvf_scheme_info *out);

/* Names of the shipped schemes, NULL-terminated. */
KVF_API const char *const *kvf_builtin_schemes(void);

/* ------------------------------------------------------------ chunk policy */

/*
 * The chunk policy of a scheme (its chunk section: span, recent, sink), as
 * every cache of a layer's stream applies it, so callers need not re-derive
 * it: after chunk t (0-based) of a layer is appended and attended to, pack
 * the span pack_first .. pack_first + pack_chunks - 1 (pack_chunks 0: none).
 * Chunks t < sink stay BF16 for ever; the `recent` newest others stay BF16;
 * older ones wait in BF16 until `span` of them can be packed together. A
 * span is encoded with the layer's query statistics as they are when it is
 * packed (queries of chunks < t: the statistics are updated after the pack);
 * warm_first, warm_chunks: the previous packed span of the layer, which
 * kvf_encode_warm may start its k-means from (warm_chunks 0: none). With
 * anchors, the first packed span of the stream and every one `every` chunks
 * after it is an anchor; an anchor must outlive every span coded against it
 * (a cache evicts an anchor together with the spans that follow it up to
 * the next anchor).
 */
typedef struct kvf_chunk_step {
    int64_t pack_first;
    int32_t pack_chunks;
    int32_t sink;         /* 1: chunk t is a sink chunk (BF16 for ever) */
    int64_t warm_first;
    int32_t warm_chunks;
    /* Temporal anchors (anchors = { every }): 1 when the span packed now is an
     * anchor (encode it with kvf_scheme_anchor's scheme), else the span is
     * coded against the anchor span that starts at anchor_first (-1: none). */
    int32_t anchor;
    int64_t anchor_first;
    int32_t anchor_chunks;
    /* Error feedback: 1 when the span packed now continues the carried error
     * of the span packed before it (0 for the first span, and after an
     * anchor, which resets it). */
    int32_t feedback_in;
} kvf_chunk_step;
KVF_API int kvf_chunk_policy(const kvf_scheme *s, int64_t t, kvf_chunk_step *out);

/* ------------------------------------------------------------ packed layout */

/*
 * Shape and strides (in elements) of a BF16 K or V tensor of one chunk:
 * element (token t, head h, channel c) is at t*token_stride + h*head_stride + c.
 * Strides of 0 mean head-major contiguous [n_heads][n_tokens][head_dim]
 * (torch's [B=1, H, N, d]). Channels are always contiguous.
 */
typedef struct kvf_shape {
    int64_t n_tokens;
    int32_t n_heads;
    int64_t token_stride;
    int64_t head_stride;
} kvf_shape;

/* Bytes of the packed cache of n_tokens x n_heads (K and V, header included). */
KVF_API int kvf_packed_size(const kvf_scheme *s, int64_t n_tokens, int32_t n_heads, size_t *bytes);

/* Stored bytes against BF16 bytes of K and V of the same tokens. */
typedef struct kvf_footprint {
    size_t packed_bytes;   /* everything stored, header included */
    size_t bf16_bytes;     /* 2 * n_tokens * n_heads * head_dim * 2 */
    double compression;    /* bf16_bytes / packed_bytes */
    double bits_per_value; /* 8 * packed_bytes / (2 * n_tokens * n_heads * head_dim) */
} kvf_footprint;
KVF_API int kvf_footprint_of(const kvf_scheme *s, int64_t n_tokens, int32_t n_heads, kvf_footprint *out);

/* ----------------------------------------------------------------- contexts */

typedef struct kvf_context kvf_context;

#define KVF_DEVICE_CPU (-1)

/* Number of CUDA devices (0 when libcuda is missing or sees none: status tells). */
KVF_API int kvf_device_count(int *count);

/*
 * Create a context for a scheme on a CUDA device ordinal, or KVF_DEVICE_CPU for
 * the CPU reference backend (host pointers). On a device this JIT-compiles the
 * scheme's kernels with NVRTC for the device's arch, through the disk cache
 * ($KVFORGE_CACHE_DIR, else $XDG_CACHE_HOME/kvforge, else ~/.cache/kvforge;
 * KVFORGE_CACHE=0 turns it off). KVF_ENOTIMPL as kvf_context_create_from_image
 * when the compiled image's k-means assignment needs more shared memory per
 * block than the device allows (a GPU newer than NVRTC that gets the PTX of
 * an arch with more), and when the arch cannot hold the assignment's
 * centroid rows at all (head_dim 256 on the 99 KiB archs: sm_86, sm_89,
 * sm_12x, and archs the templates do not name); KVF_ECOMPILE, with NVRTC's
 * log, for any other failed compile.
 */
KVF_API int kvf_context_create(const kvf_scheme *s, int device, kvf_context **out);
/*
 * Create a context from precompiled kernels (an exported fatbin or cubin image)
 * and the scheme's canonical text: needs no NVRTC. See `kvforge export`.
 * KVF_EFORMAT for an image of another packed format or kernel interface;
 * KVF_ENOTIMPL when its k-means assignment needs more shared memory per block
 * than the device allows (an image made for an arch with more: export for
 * the device's own arch, e.g. sm_86 or sm_89, whose 99 KiB sm_80's image
 * exceeds).
 */
KVF_API int kvf_context_create_from_image(const char *scheme_canonical, const void *image,
                                  size_t image_size, int device, kvf_context **out);
KVF_API void kvf_context_destroy(kvf_context *ctx);

KVF_API const kvf_scheme *kvf_context_scheme(const kvf_context *ctx);
/* "cpu" or "sm_90" and so on. */
KVF_API const char *kvf_context_backend(const kvf_context *ctx);
/* How the kernels were obtained: "cpu", "nvrtc", "disk-cache", "image". */
KVF_API const char *kvf_context_origin(const kvf_context *ctx);

/*
 * Encode the BF16 K and V of one span (one chunk, or the chunks the scheme
 * quantizes together) into `packed` (packed_bytes at least kvf_packed_size()).
 * `qstats` (may be NULL: cold start) is the layer's query statistics (see
 * below), read only. On a device, all pointers are device pointers, work is
 * queued on `stream` and the call returns before it finishes.
 * Alignment: on a device, k, v and packed 16-byte aligned and strides multiples
 * of 8; on the CPU, k and v 2-byte aligned (packed and strides: any).
 */
KVF_API int kvf_encode(kvf_context *ctx, const void *k, const void *v, const kvf_shape *shape,
               const void *qstats, void *packed, size_t packed_bytes, void *stream);
/*
 * kvf_encode with each k-means warm-started from the previous span's
 * centroids (docs/METHODS.md section 3): `prev` is the packed cache of the
 * previous span of this layer (same scheme and head count, prev_n_tokens
 * tokens, prev_bytes at least its kvf_packed_size; NULL: kvf_encode). The
 * initial table of each section, stage and head is the previous span's first
 * min(centroids, prev_n_tokens, n_tokens) rows (each that holds no NaN or
 * Inf; the strided sample's row otherwise), the rest the strided sample as
 * kvf_encode's; the Lloyd steps and every later step are kvf_encode's, so the
 * result is as reproducible (the same inputs, the same bytes). Sections
 * without centroids ignore it. `prev` must not overlap `packed`. On a device
 * it is a device pointer, 16-byte aligned (as `packed`), read on `stream`, and
 * its header is not read (check it with kvf_packed_check); on the CPU its
 * header is checked.
 */
KVF_API int kvf_encode_warm(kvf_context *ctx, const void *k, const void *v, const kvf_shape *shape,
                    const void *qstats, const void *prev, size_t prev_bytes, int64_t prev_n_tokens,
                    void *packed, size_t packed_bytes, void *stream);
/*
 * What an encode may take besides K and V (kvf_encode_ex): zero it, then set
 * what the scheme uses. On a device every pointer is a device pointer,
 * 16-byte aligned. kvf_encode and kvf_encode_warm are this with only qstats
 * and prev set.
 */
typedef struct kvf_encode_args {
    const void *qstats;          /* the layer's query statistics (QSAC, PSAC), or NULL (kvf_encode) */
    const void *prev;            /* the previous span's packed cache (kvf_encode_warm), or NULL */
    size_t prev_bytes;
    int64_t prev_n_tokens;
    /* Temporal anchors (scheme field anchors): the anchor span this span is
     * coded against, a packed cache of kvf_scheme_anchor's scheme of
     * anchor_n_tokens tokens and the same heads; token t is coded as its
     * difference from the anchor's row t % anchor_n_tokens. NULL: none (the
     * span is coded as it is). */
    const void *anchor;
    size_t anchor_bytes;
    int64_t anchor_n_tokens;
    /* Error feedback (scheme field error_feedback): f32 [2][n_heads][n_tokens]
     * [head_dim], keys then values, head-major: the error carried from the
     * previous span at the same token position is read (decay times it is
     * added before quantizing) when feedback_in is 1, and the new error
     * (the input minus what decode returns, before RoPE) written. 0 for the
     * stream's first span and the span after an anchor. Decode never needs
     * it. */
    float *feedback;
    int feedback_in;
    /* Mixed precision (scheme field mixed_precision): u8 [2][n_heads]
     * [head_dim], keys then values: the slot of each refined channel among
     * its head's refined channels, 255 for the others (kvf_mixed_map). */
    const uint8_t *channel_map;
} kvf_encode_args;
KVF_API int kvf_encode_ex(kvf_context *ctx, const void *k, const void *v, const kvf_shape *shape,
                          const kvf_encode_args *args, void *packed, size_t packed_bytes, void *stream);

/* What a decode may take besides the packed span (kvf_decode_ex). */
typedef struct kvf_decode_args {
    const int32_t *positions;    /* rope.placement = "pre": int32 [n_tokens][n_axes], else NULL */
    const void *anchor;          /* the anchor the span was coded against (kvf_encode_args.anchor), or NULL */
    size_t anchor_bytes;
    int64_t anchor_n_tokens;
} kvf_decode_args;
KVF_API int kvf_decode_ex(kvf_context *ctx, const void *packed, size_t packed_bytes, const kvf_shape *shape,
                          const kvf_decode_args *args, void *k_out, void *v_out, void *stream);

/* The scheme of a scheme's anchor spans (anchors = { every, bits }): RTN at
 * the anchor's bits (BF16 rows at 16) with the scheme's head_dim, group size,
 * RoPE and chunk policy, none of its other methods. KVF_EINVAL for a scheme
 * without anchors. Free with kvf_scheme_free. */
KVF_API int kvf_scheme_anchor(const kvf_scheme *s, kvf_scheme **anchor);

/* Mixed precision's channel map for one layer (kvf_encode_args.channel_map):
 * from the sensitivity table (`kvforge calibrate`; table_path NULL: the one
 * the scheme names), per section and KV head the scheme's count of channels
 * of highest score (ties: the lower channel), numbered in channel order.
 * KVF_EFORMAT for a table that does not match the scheme (head_dim, KV heads,
 * layers), KVF_EIO for one that cannot be read; the message names the file
 * and the field. map: u8 [2][n_kv_heads][head_dim] (host memory). */
KVF_API int kvf_mixed_map(const kvf_scheme *s, const char *table_path, int32_t layer, int32_t n_kv_heads,
                          uint8_t *map);

/*
 * Decode a packed span back to BF16 K and V with the given shape and strides.
 * `positions` (int32 [n_tokens][n_axes], device memory on a device) is needed
 * only when the scheme caches keys before RoPE (rope.placement = "pre"): decode
 * then applies RoPE; otherwise pass NULL.
 */
KVF_API int kvf_decode(kvf_context *ctx, const void *packed, size_t packed_bytes,
               const kvf_shape *shape, const int32_t *positions, void *k_out, void *v_out,
               void *stream);

/*
 * Query statistics of one layer (QuantWM): per KV head, the running sum of
 * q q^T over the queries of finished chunks, their count, and the top-r
 * eigenvectors of the mean (PSAC's basis). A caller-allocated buffer (device
 * memory for a device context, host memory for the CPU); layout in
 * docs/METHODS.md. Update it after a chunk's attention, before encoding the
 * next chunk's keys: statistics are strictly causal.
 */
KVF_API int kvf_qstats_size(const kvf_scheme *s, int32_t n_kv_heads, size_t *bytes);
KVF_API int kvf_qstats_init(kvf_context *ctx, void *qstats, size_t bytes, int32_t n_kv_heads, void *stream);
/* q: BF16 queries of one chunk, shape->n_heads query heads (a multiple of the
 * statistics' KV heads: grouped-query attention), same stride rules as K.
 * Non-finite queries: a query row (one query head's head_dim values of one
 * token) holding any NaN or Inf is skipped: it adds nothing to the sums or the
 * count, so the statistics are exactly those of the chunk without it and stay
 * finite; the chunk's other rows count as usual. A KV head that gets no row
 * from the chunk keeps its statistics and basis unchanged. The call still
 * returns KVF_OK (on a device it cannot know without a synchronisation); the
 * rows skipped so far are counted in the buffer's header: kvf_qstats_skipped. */
KVF_API int kvf_qstats_update(kvf_context *ctx, void *qstats, size_t bytes, const void *q,
                      const kvf_shape *q_shape, void *stream);
/* Query rows skipped for NaN/Inf over the buffer's life (all KV heads), read
 * from a host copy of its header (the first 64 bytes or more; for a device
 * buffer, copy them after the update has finished). */
KVF_API int kvf_qstats_skipped(const void *header, size_t header_bytes, uint64_t *skipped);

/* Host-side check of a packed cache's header (a host copy of its first 64 bytes
 * or more) against a scheme and shape: KVF_EFORMAT with the reason otherwise. */
KVF_API int kvf_packed_check(const kvf_scheme *s, const void *header, size_t header_bytes,
                     int64_t n_tokens, int32_t n_heads);

/* ------------------------------------------------------------- disk cache */

/* Directory the disk cache uses now (after the environment) into buf; "" when
 * KVFORGE_CACHE=0 turns it off. Creates nothing. */
KVF_API int kvf_cache_dir(char *buf, size_t buflen);
/* Remove every entry (all arches). */
KVF_API int kvf_cache_clear(void);

#ifdef __cplusplus
}
#endif
#endif
