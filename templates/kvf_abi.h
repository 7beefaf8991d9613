/*
 * kvf_abi.h: what the C side and the CUDA templates share, declared once.
 *
 * The enums a scheme's fields take, the plane structs that say where each
 * plane of a packed cache lies, the tile constants both sides size launches
 * with, and one parameter struct per kernel: the host (runtime/gpu/context.c)
 * fills it, the kernel (templates/) takes it by value. It is compiled as C11
 * by the library and as CUDA C++ by NVRTC (no headers there, hence no
 * <stdint.h> and plain integer types of fixed size on both: int is 32 bits,
 * long long and pointers 64).
 *
 * The kernel-interface version a context checks in every image it loads
 * (kvf_kernel_abi) is a hash of this file's text (runtime/core/abi.c), so an image made by a kvforge whose structs or constants
 * differ is refused instead of being launched wrongly.
 */
#ifndef KVF_ABI_H
#define KVF_ABI_H

/* A device address: a typed pointer in a kernel, a CUdeviceptr-sized integer
 * on the host (which only fills it in). */
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define KVF_DPTR(T) T *
#else
#define KVF_DPTR(T) unsigned long long
#endif

/* ------------------------------------------------------------ scheme enums */

enum { KVF_AXIS_CHANNEL = 0, KVF_AXIS_TOKEN = 1 };          /* groups along channels of a token, or tokens of a channel */
/* scale + zero; scale alone; or scale alone with INT2's three symmetric
 * levels stored 8 codes to a 13-bit field (KVF_TERNARY_*, FORMAT.md) */
enum { KVF_MODE_AFFINE = 0, KVF_MODE_SYMMETRIC = 1, KVF_MODE_TERNARY = 2 };
enum { KVF_SCALE_FP16 = 0, KVF_SCALE_INT8_FP16 = 1, KVF_SCALE_FP8 = 2 }; /* group scale formats (FORMAT.md) */
enum { KVF_ROPE_NONE = 0, KVF_ROPE_PRE = 1, KVF_ROPE_POST = 2 }; /* rope.placement */
enum { KVF_ROPE_HALF = 0, KVF_ROPE_INTERLEAVED = 1 };        /* rope.layout: pair p is (p, p + d/2) or (2p, 2p + 1) */
enum { KVF_ROTATION_NONE = 0, KVF_ROTATION_HADAMARD = 1 };
enum { KVF_LABELS_FINAL = 0, KVF_LABELS_LAST_STEP = 1 };    /* where a k-means section's stored labels come from */

/* What the decode does to a section's rows for RoPE: nothing, or turn keys
 * cached before RoPE with the scheme's layout (a template argument). */
enum { KVF_DECODE_ROPE_NONE = 0, KVF_DECODE_ROPE_HALF = 1, KVF_DECODE_ROPE_INTERLEAVED = 2 };

/* How a tensor section is encoded (runtime/core/plan.c decides, once):
 * rows: one launch, a lane group per (token, head) row: RTN, QuaRot's
 *       rotated RTN, and bits 16 (rows kept as they are);
 * token_groups: one launch, groups of G tokens of one channel (KIVI keys);
 * kmeans: the workspace path (k-means smoothing, progressive stages, QSAC,
 *       PSAC): several launches over an f32 workspace. */
enum { KVF_PATH_ROWS = 0, KVF_PATH_TOKEN_GROUPS = 1, KVF_PATH_KMEANS = 2 };

/* Ternary codes: the codes c_0..c_7 (0, 1, 2) of channels 8b..8b+7 of a row
 * are the number F_b = c_0 + 3 c_1 + ... + 3^7 c_7 (< 3^8 = 6561 < 2^13), at
 * bits 13b .. 13b+12 of the row read as one little-endian bit string: 1.625
 * bits a value instead of 2, and one lane of 8 channels decodes its own field. */
#define KVF_TERNARY_FIELD_BITS 13
#define KVF_TERNARY_ROW_BYTES(d) ((((d) / 8) * KVF_TERNARY_FIELD_BITS + 7) / 8)

#define KVF_MAX_STAGES 8
#define KVF_MAX_ROPE_SECTIONS 4
#define KVF_MAX_PSAC_RANK 64 /* PSAC's exactness argument (METHODS.md 4) needs r <= 64 */

/* --------------------------------------------------------- packed format */

#define KVF_PACKED_MAGIC 0x3146564bu /* "KVF1" little-endian */
#define KVF_FORMAT_VERSION 2u        /* 2: PSAC basis int8 with a per-head f32 scale (FORMAT.md) */
#define KVF_HEADER_BYTES 64u
#define KVF_PLANE_ALIGN 256u

/* The 64-byte header of a packed cache as 8 words, passed by value to the
 * kernel that writes it. */
struct kvf_header_words { unsigned long long w[8]; };

/* Byte offsets of the planes of one progressive stage of a tensor section
 * inside a packed cache (FORMAT.md; 0 where a plane is absent). */
struct kvf_stage_planes {
    unsigned long long codes, scales, tscales, zeros, index, centroids;
};

/* The pipeline's planes of a section (METHODS.md 11): outliers' channels and
 * exact values; mixed precision's channel map, refinement codes and scales. */
struct kvf_pipe_planes {
    unsigned long long oidx, oval, mmap, mcode, mscale;
};

/* A tensor section's planes: its stages, then PSAC's, then the pipeline's. */
struct kvf_section_planes {
    struct kvf_stage_planes stage[KVF_MAX_STAGES];
    unsigned long long basis, coef, cscale, bscale;
    struct kvf_pipe_planes pipe;
};

/* The anchor a span is coded against (temporal anchors): its packed span
 * (the anchor scheme's: RTN at the anchor's bits, or BF16 rows at 16), the
 * planes of the section's rows there, and its tokens (token t of the span
 * reads the anchor's row t % tokens). */
struct kvf_anchor_ref {
    KVF_DPTR(const unsigned char) packed;
    unsigned long long codes, scales, zeros;
    int tokens, pad;
};

/* RoPE of keys cached before RoPE (METHODS.md 6): log2(theta), and the
 * frequency pairs of each position axis. */
struct kvf_rope_args {
    double log2_theta;
    int n_sections;
    int sections[KVF_MAX_ROPE_SECTIONS];
};

/* A layer's query statistics buffer (METHODS.md 4): byte offsets of its
 * planes and its shape. */
struct kvf_qstats_planes {
    unsigned long long count, msum, u, lambda;
    int n_heads, d, r, pad;
};

/* ---------------------------------------------------------- tile constants */

#define KVF_BLOCK 256            /* threads of the row kernels' blocks */
#define KVF_VEC 8                /* channels one lane holds in the row kernels (one 16-byte load) */
#define KVF_PSAC_ENCODE_ROWS 128 /* threads (one a token) of the PSAC encode's blocks */
#define KVF_QSTATS_TILE 32       /* channels per side of a statistics block's tile */
#define KVF_DECODE_RPT 4         /* rows of a decode thread at 8 channels a lane (the grid's unit) */

/* The k-means module's launch facts, read from the module itself
 * (<prefix>_assign_cfg) so the host and the compiled kernels cannot disagree:
 * the assignment's dynamic shared bytes, threads per block and tokens per
 * block (plain, then QSAC), whether stage 0 reads the BF16 input, the
 * residual's rows per thread, the Lloyd sums' threads per block. */
enum {
    KVF_AC_SMEM, KVF_AC_SMEM_QSAC, KVF_AC_THREADS, KVF_AC_THREADS_QSAC, KVF_AC_TOKENS, KVF_AC_TOKENS_QSAC,
    KVF_AC_BF16_SOURCE, KVF_AC_RES_ROWS, KVF_AC_SUM_THREADS, KVF_AC_COUNT
};

/* The k-means assignment's filter statistics (<prefix>_assign_stats: word 0
 * switches counting on, then these), read by the bench. */
enum {
    KVF_AS_TOKENS,     /* tokens assigned */
    KVF_AS_CANDIDATES, /* their candidates after the filter (1 for a quick pick) */
    KVF_AS_FULL,       /* tokens that took the full scan */
    KVF_AS_AGAIN,      /* tokens filtered twice */
    KVF_AS_EXACT,      /* tokens that took their candidates' f64 distances */
    KVF_AS_N
};

/* ------------------------------------------------- kernel parameter structs */

/* A BF16 tensor of one span: element (token t, head h, channel c) at
 * x[t * ts + h * hs + c]. */
struct kvf_bf16_src {
    KVF_DPTR(const unsigned short) x;
    long long ts, hs;
};

/* The header kernel of the multi-launch encodes. */
struct kvf_header_params {
    KVF_DPTR(unsigned char) packed;
    struct kvf_header_words hdr;
};

/* What an encode kernel of a section needs of the pipeline (METHODS.md 11):
 * where the pipeline's planes go, the anchor the span is coded against, the
 * carried error, the channel map. Zero where the scheme has none. */
struct kvf_pipe_io {
    struct kvf_pipe_planes planes;
    struct kvf_anchor_ref anchor;      /* packed 0: no anchor */
    KVF_DPTR(float) fb;                /* the section's carried error [H][N][d], read if fb_in, written */
    KVF_DPTR(const unsigned char) map; /* the section's channel map [H][d] */
    int fb_in;
    float decay;
};

/* One-launch encodes (paths rows and token_groups). */
struct kvf_encode_params {
    struct kvf_bf16_src in;
    int n_tokens, n_heads;
    KVF_DPTR(unsigned char) packed;
    struct kvf_stage_planes planes;
    int write_header, pad;
    struct kvf_header_words hdr;
    struct kvf_pipe_io pipe;
};

/* The decode of both sections: grid (k_blocks + v_blocks, heads). */
struct kvf_decode_params {
    KVF_DPTR(const unsigned char) packed;
    struct kvf_section_planes planes[2]; /* key, value */
    int n_tokens, pad;
    KVF_DPTR(unsigned short) out[2];     /* key, value */
    long long ts, hs;                    /* of both outputs */
    KVF_DPTR(const int) positions;       /* [n_tokens][n_sections] for decode RoPE, else 0 */
    struct kvf_rope_args rope;
    unsigned blocks[2];                  /* blocks of the key section, of the value section */
    struct kvf_anchor_ref anchor[2];     /* the anchor the span was coded against (packed 0: none) */
};

/* The k-means path (METHODS.md 3). src: the BF16 input (when stage 0 reads
 * it) or the f32 working vectors e [heads][n][d]. */
struct kvf_kmeans_src {
    KVF_DPTR(const void) p;
    long long ts, hs;
};

struct kvf_kmeans_prep_params {
    struct kvf_bf16_src in;
    int n, nh;
    KVF_DPTR(float) e;
    struct kvf_pipe_io pipe; /* the anchor's row is subtracted, decay x the carried error added */
};

struct kvf_kmeans_init_params {
    struct kvf_kmeans_src src;
    int n, nh, c_eff, stage;
    long long seed;
    KVF_DPTR(unsigned short) cent;
    int c_alloc, c_warm;
    KVF_DPTR(const unsigned short) warm; /* the previous span's table, or 0 */
};

struct kvf_kmeans_assign_params {
    struct kvf_kmeans_src src;
    int n, nh, c_eff, c_alloc;
    KVF_DPTR(const unsigned short) cent;
    KVF_DPTR(int) idx_ws;              /* labels for the Lloyd step, or 0 */
    KVF_DPTR(unsigned char) idx_plane; /* the packed index plane, or 0 */
    KVF_DPTR(const float) weights;     /* QSAC's channel weights (QSAC kernel only) */
};

struct kvf_kmeans_accumulate_params {
    struct kvf_kmeans_src src;
    KVF_DPTR(const int) idx;
    int n, c_eff, chunk, pad;
    KVF_DPTR(long long) acc;
    KVF_DPTR(int) cnt;
};

struct kvf_kmeans_finalize_params {
    int nh, c_eff, parts, c_alloc;
    KVF_DPTR(const long long) acc;
    KVF_DPTR(const int) cnt;
    KVF_DPTR(unsigned short) cent;
};

struct kvf_kmeans_pad_params {
    int nh, c_eff, c_alloc, pad;
    KVF_DPTR(unsigned short) cent;
};

struct kvf_kmeans_subtract_params {
    KVF_DPTR(float) e;
    int n, nh;
    KVF_DPTR(const unsigned char) packed;
    struct kvf_stage_planes planes;
};

struct kvf_kmeans_residual_params {
    struct kvf_kmeans_src src;
    KVF_DPTR(float) e_out; /* the final error (PSAC reads it), when write_e */
    int n, nh, write_e, pad;
    KVF_DPTR(unsigned char) packed;
    struct kvf_stage_planes planes;
    struct kvf_bf16_src in;  /* the input as given: outliers keep it, the carried error is taken from it */
    struct kvf_pipe_io pipe;
};

/* PSAC (METHODS.md 4) and QSAC's channel weights. */
struct kvf_psac_basis_params {
    KVF_DPTR(const unsigned char) qs;
    struct kvf_qstats_planes l;
    KVF_DPTR(unsigned char) packed;
    unsigned long long basis_off, bscale_off;
};

struct kvf_psac_encode_params {
    KVF_DPTR(const float) e;
    int n, pad;
    KVF_DPTR(const unsigned char) qs;
    struct kvf_qstats_planes l;
    KVF_DPTR(unsigned char) packed;
    unsigned long long basis_off, bscale_off, coef_off, cscale_off;
};

struct kvf_qsac_weights_params {
    KVF_DPTR(const unsigned char) qs;
    struct kvf_qstats_planes l;
    int nh, pad;
    KVF_DPTR(float) w;
};

/* Query statistics. */
struct kvf_qstats_init_params {
    KVF_DPTR(unsigned char) qs;
    unsigned long long total;
    struct kvf_qstats_planes l;
};

struct kvf_qstats_update_params {
    struct kvf_bf16_src q;
    int n, group; /* query rows; query heads per KV head */
    KVF_DPTR(unsigned char) qs;
    struct kvf_qstats_planes l;
};

#endif
