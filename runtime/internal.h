/* Internal interfaces of libkvforge shared by runtime/, gen/ and tests/. */
#ifndef KVF_INTERNAL_H
#define KVF_INTERNAL_H

#include "kvforge.h"
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

/* ------------------------------------------------------------ errors (error.c) */

/* Record the detailed message for the calling thread and return status. */
int kvf_set_error(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Prefix the current message ("ctx: <old message>"), keep status. */
int kvf_wrap_error(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void kvf_clear_error(void);
/* Print a warning to stderr once per key (process-wide). */
void kvf_warn_once(const char *key, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ------------------------------------------------------------ scheme (scheme/) */

/* The enums of a scheme's fields, the plane structs and the kernel parameter
 * structs are templates/kvf_abi.h's, shared with the CUDA templates. */
#include "kvf_abi.h"

/* assign: the GPU's k-means assignment (the CPU reference is exact for both;
 * the plan gives the kernels EXACT, docs/METHODS.md section 3). */
enum { KVF_ASSIGN_FAST = 0, KVF_ASSIGN_EXACT = 1 };

/* One of the two tensor sections (key, value) of a scheme. */
typedef struct kvf_tensor_cfg {
    int bits;            /* 2, 4, 8, or 16 (= kept BF16) */
    int group_size;      /* values per quantization group */
    int axis;            /* KVF_AXIS_* */
    int mode;            /* KVF_MODE_* */
    int scale_format;    /* KVF_SCALE_* */
    int centroids;       /* 0 = no k-means smoothing, else 1..256 */
    int kmeans_iters;    /* Lloyd iterations */
    int kmeans_labels;   /* KVF_LABELS_* */
    int64_t seed;        /* k-means seed */
    int qsac_candidates; /* QSAC M (1 = plain nearest centroid) */
    int psac_rank;       /* PSAC r (0 = off; keys only) */
    int stages;          /* progressive residual stages (1 = QVG) */
    int rotation;        /* KVF_ROTATION_* (QuaRot-style Hadamard) */
    int assign;          /* KVF_ASSIGN_*: the GPU's k-means assignment */
} kvf_tensor_cfg;

/* Whether a section stores the last Lloyd step's labels (no final
 * assignment): kmeans_labels = "last_step" with a step to take them from
 * (the plan refuses "last_step" without one where there are centroids). The
 * CPU reference and the GPU launches both decide by this. */
static inline int kvf_labels_of_last_step(const kvf_tensor_cfg *c) {
    return c->kmeans_labels == KVF_LABELS_LAST_STEP && c->kmeans_iters > 0;
}

typedef struct kvf_rope_cfg {
    int placement; /* KVF_ROPE_NONE, _PRE, _POST */
    int layout;    /* KVF_ROPE_HALF, _INTERLEAVED */
    double theta;
    int n_sections;                      /* position axes (1 = 1D RoPE) */
    int sections[KVF_MAX_ROPE_SECTIONS]; /* frequency pairs per axis, sum = head_dim / 2 */
} kvf_rope_cfg;

typedef struct kvf_chunk_cfg {
    int tokens; /* tokens per chunk */
    int span;   /* chunks quantized together */
    int recent; /* most recent chunks kept BF16 */
    int sink;   /* first chunks never quantized */
} kvf_chunk_cfg;

/* The practitioner's temporally stable pipeline (docs/METHODS.md section 11):
 * outlier separation, temporal anchors, error feedback and calibrated mixed
 * precision. Zero everywhere: off. */
typedef struct kvf_pipeline_cfg {
    int outliers[2];         /* per section (key, value): values a token row keeps exactly (0: off) */
    int anchor_every;        /* chunks from one anchor to the next (0: no anchors) */
    int anchor_bits;         /* the anchors' precision: 4, 8 or 16 */
    double feedback_decay;   /* error feedback's decay in [0, 1) (0: off) */
    double mp_fraction[2];   /* mixed precision: the share of channels refined, per section (0: off) */
    int mp_refine_bits;      /* the refinement codes' bits: 2, 4 or 8 */
    char mp_table[512];      /* the sensitivity table (kvforge calibrate), as written in the scheme */
} kvf_pipeline_cfg;

/* ------------------------------------------------------------- plan (core/plan.c) */

/* Kernels a scheme may need, by role. The entry of role R is named
 * "kvf_<id>_<kvf_role_names[R]>"; the plan says which a scheme has. */
enum kvf_role {
    KVF_R_HEADER = 0,
    KVF_R_ENCODE_K, KVF_R_ENCODE_V, KVF_R_DECODE, /* one kernel decodes K and V */
    /* The k-means path: per section, K then V. */
    KVF_R_K_PREP, KVF_R_K_INIT, KVF_R_K_ASSIGN, KVF_R_K_ASSIGN_QSAC, KVF_R_K_ACCUMULATE,
    KVF_R_K_FINALIZE, KVF_R_K_PAD, KVF_R_K_SUBTRACT, KVF_R_K_RESIDUAL,
    KVF_R_V_PREP, KVF_R_V_INIT, KVF_R_V_ASSIGN, KVF_R_V_ASSIGN_QSAC, KVF_R_V_ACCUMULATE,
    KVF_R_V_FINALIZE, KVF_R_V_PAD, KVF_R_V_SUBTRACT, KVF_R_V_RESIDUAL,
    KVF_R_QSTATS_INIT, KVF_R_QSTATS_ACCUMULATE, KVF_R_QSTATS_EIGEN,
    KVF_R_PSAC_BASIS, KVF_R_PSAC_ENCODE, KVF_R_QSAC_WEIGHTS,
    KVF_ROLE_COUNT
};
#define KVF_R_SECTION_STRIDE (KVF_R_V_PREP - KVF_R_K_PREP)
extern const char *const kvf_role_names[KVF_ROLE_COUNT];

/* The programs a context's JIT compiles at once, a module each: 0 holds the
 * header, the one-launch encodes, the decode, the statistics, PSAC and QSAC's
 * weights; then each section's k-means kernels (once where the value section
 * runs the key's); then QSAC's assignment. */
enum { KVF_UNIT_REST, KVF_UNIT_KMEANS_K, KVF_UNIT_KMEANS_V, KVF_UNIT_QSAC, KVF_UNIT_COUNT };
#define KVF_MAX_PROGRAMS KVF_UNIT_COUNT

/* How one tensor section is encoded and decoded: its path and the template
 * arguments of its kernels (what the generator prints), and the launch
 * geometry the context uses. */
typedef struct kvf_section_plan {
    int path;         /* KVF_PATH_* */
    int bits;         /* 2, 4, 8, 16 */
    int group;        /* the templates' G: group_size, or 8 (one lane) at bits 16 */
    int mode, scale_format, axis, centroids, stages, rotation, psac_rank;
    int decode_rope;  /* KVF_DECODE_ROPE_*: keys cached before RoPE get it at decode */
    int qsac;         /* QSAC candidates of the k-means assignment (1: nearest centroid) */
    int bf16_source;  /* k-means stage 0 reads the BF16 input (no rotation, one stage) */
    int kmeans_owner; /* the section (0 key, 1 value) whose k-means kernels it runs */
    int exact;        /* the k-means assignment agrees with the CPU bit for bit (the templates' EXACT) */
    int decode_tiles; /* token tiles a decode block loops over per pass */
    /* The pipeline (kvf_pipeline_cfg), as template arguments: */
    int outliers;     /* values a row keeps exactly (0: none) */
    int mp_channels;  /* refined channels a head (0: none) */
    int mp_bits;      /* their refinement codes' bits */
    int anchor_bits;  /* 0, or the anchors' bits: spans code x - the anchor's row */
    int feedback;     /* the encode adds the carried error and writes the new one */
} kvf_section_plan;

typedef struct kvf_plan {
    kvf_section_plan sec[2];                  /* key, value */
    unsigned char has[KVF_ROLE_COUNT];        /* the kernels the scheme needs */
    unsigned char served_by[KVF_ROLE_COUNT];  /* the role whose kernel runs it (V may run K's k-means) */
    signed char unit_program[KVF_UNIT_COUNT]; /* the JIT program of each unit, -1 none */
    int n_programs;
    int reads_qstats;                         /* keys with QSAC or PSAC read query statistics */
    int gpu_status;                           /* KVF_OK, or KVF_ENOTIMPL where the templates cannot run it */
    char gpu_reason[240];                     /* why not (names the field) */
} kvf_plan;

/* Rule reporting of kvf_plan_build: the loader passes one that names the
 * file and line that set the field (the first of the two where a rule ties
 * two fields); NULL reports the field only. Returns the status to return. */
typedef struct kvf_plan_blame {
    int (*report)(void *arg, const char *field, const char *msg, const char *other, const char *other_msg);
    void *arg;
} kvf_plan_blame;

struct kvf_scheme;
/* Check every rule between a scheme's fields, once, and derive its plan
 * (runtime/core/plan.c). KVF_ESCHEME names the field; a scheme the CPU
 * reference runs but the GPU templates cannot gets gpu_status. */
int kvf_plan_build(const struct kvf_scheme *s, const kvf_plan_blame *blame, kvf_plan *out);
/* Entry name of a role's kernel, e.g. "kvf_rtn_int2_1a2b3c4d_encode_k": that
 * of the role whose kernel serves it. */
void kvf_kernel_name(const struct kvf_scheme *s, int role, char *buf, size_t len);

struct kvf_scheme {
    char name[64];
    char source[512];     /* file the scheme was loaded from ("<builtin>/x.lua" for shipped) */
    int head_dim;         /* 64, 128, 256 */
    kvf_tensor_cfg key, value;
    kvf_rope_cfg rope;
    kvf_chunk_cfg chunk;
    kvf_pipeline_cfg pipe;
    char canonical[4096]; /* normalized configuration (Lua text) */
    uint64_t hash;        /* XXH3-64 of canonical */
    char id[96];          /* name_xxxxxxxx */
    kvf_plan plan;        /* derived by kvf_scheme_finalize / the loader */
};

/* Fill every field with its documented default (name left empty). */
void kvf_scheme_defaults(struct kvf_scheme *s);
/* Check the fields (ranges, then every rule between them: kvf_plan_build),
 * then build the plan, canonical text, hash and id: a scheme filled in by
 * code is usable only after this. */
int kvf_scheme_finalize(struct kvf_scheme *s);
/* RoPE position axes (>= 1) and, when sections is not NULL, their frequency
 * pairs, unused entries 0. */
int kvf_rope_sections(const struct kvf_scheme *s, int sections[KVF_MAX_ROPE_SECTIONS]);
/* Whether encoding reads query statistics (the plan's reads_qstats). */
static inline int kvf_scheme_reads_qstats(const struct kvf_scheme *s) { return s->plan.reads_qstats; }

/* ------------------------------------------------------ embedded files (embed) */

typedef struct kvf_embedded_file {
    const char *name;  /* basename, e.g. "rtn_int2.lua" or "kvf_rtn.cuh" */
    const char *data;  /* NUL-terminated */
    size_t size;
} kvf_embedded_file;

extern const kvf_embedded_file kvf_embedded_schemes[];  /* terminated by name == NULL */
extern const kvf_embedded_file kvf_embedded_templates[];
/* bench/kvf_probe.cuh, linked into kvf_bench and test_nvrtc only (Makefile). */
extern const kvf_embedded_file kvf_bench_probe[];
const kvf_embedded_file *kvf_find_embedded(const kvf_embedded_file *table, const char *name);

/* -------------------------------------------------------------- layout (layout.c) */

/* The kernel-interface version: a hash of templates/kvf_abi.h's text as
 * embedded in this library (the generator writes it into every module as
 * kvf_kernel_abi; a context refuses an image of another value). */
uint32_t kvf_kernel_abi(void);

/* The 64-byte header at the start of every packed cache (little-endian). */
typedef struct kvf_packed_header {
    uint32_t magic;          /* KVF_PACKED_MAGIC */
    uint32_t format_version; /* KVF_FORMAT_VERSION */
    uint64_t scheme_hash;    /* kvf_scheme_hash() */
    uint64_t n_tokens;
    uint32_t n_heads;
    uint32_t head_dim;
    uint64_t total_bytes;    /* kvf_packed_size() */
    uint8_t key_bits, value_bits, reserved0[6];
    uint64_t reserved[2];
} kvf_packed_header;
_Static_assert(sizeof(kvf_packed_header) == KVF_HEADER_BYTES, "header is 64 bytes");

/* Planes of one progressive stage of a tensor section (docs/METHODS.md section 7).
 * An absent plane has offset 0 and size 0. */
typedef struct kvf_stage_layout {
    size_t codes_off, codes_bytes;         /* u8 [H][N][d*b/8] (bf16 [H][N][d] at 16 bits) */
    size_t scales_off, scales_bytes;       /* fp16 scales, or u8 group scale codes (int8_fp16) */
    size_t tscales_off, tscales_bytes;     /* fp16 [H][N] token scales (int8_fp16) */
    size_t zeros_off, zeros_bytes;         /* fp16 offsets, or int8 zero codes (int8_fp16) */
    size_t index_off, index_bytes;         /* u8 [H][N] centroid indices */
    size_t centroids_off, centroids_bytes; /* bf16 [H][C][d] */
} kvf_stage_layout;

/* Byte offsets of the planes of one tensor section inside a packed cache. */
typedef struct kvf_section_layout {
    int bits, group_size, groups_per_token, mode;
    int axis, scale_format, centroids, stages, psac_rank, rotation;
    int64_t groups_along_tokens;  /* axis token: ceil(N / G) */
    size_t code_bytes_per_token;  /* per head: head_dim * bits / 8 */
    kvf_stage_layout stage[KVF_MAX_STAGES];
    size_t basis_off, basis_bytes;   /* PSAC: int8 [H][d][r] basis codes */
    size_t bscale_off, bscale_bytes; /* PSAC: f32 [H] basis scales */
    size_t coef_off, coef_bytes;     /* PSAC: int8 [H][N][r] */
    size_t cscale_off, cscale_bytes; /* PSAC: fp16 [H][N] */
    /* The pipeline's planes (METHODS.md 11), after the others, so a scheme
     * without them keeps its layout: */
    int outliers, mp_channels, mp_bits;
    size_t oidx_off, oidx_bytes;     /* outliers: u8 [H][N][K] channels */
    size_t oval_off, oval_bytes;     /* outliers: bf16 [H][N][K] values, exactly as given */
    size_t mmap_off, mmap_bytes;     /* mixed precision: u8 [H][d] slot of each channel (255: not refined) */
    size_t mcode_off, mcode_bytes;   /* mixed precision: [H][N][M * bits / 8] refinement codes */
    size_t mscale_off, mscale_bytes; /* mixed precision: fp16 [H][N] refinement scales */
} kvf_section_layout;

typedef struct kvf_layout {
    int64_t n_tokens;
    int32_t n_heads;
    int head_dim;
    kvf_section_layout key, value;
    size_t total_bytes;
} kvf_layout;

int kvf_layout_compute(const struct kvf_scheme *s, int64_t n_tokens, int32_t n_heads,
                       kvf_layout *out);
void kvf_header_fill(const struct kvf_scheme *s, const kvf_layout *l, kvf_packed_header *h);
/* The previous span of a warm start (kvf_encode_warm), checked on the CPU and
 * a device alike: its layout for prev_n_tokens tokens of n_heads heads into
 * *L; KVF_EINVAL for prev_n_tokens < 1 or where its bytes overlap the output's
 * first packed_bytes, KVF_ERANGE when prev_bytes cannot hold that layout. */
int kvf_warm_check(const struct kvf_scheme *s, const void *prev, size_t prev_bytes, int64_t prev_n_tokens,
                   int32_t n_heads, const void *packed, size_t packed_bytes, kvf_layout *L);

/* ----------------------------------------------------------- anchors (anchor.c) */

/* The anchor scheme of s (kvf_scheme_anchor) into a caller's struct. */
int kvf_anchor_scheme_of(const struct kvf_scheme *s, struct kvf_scheme *a);
/* An encode's or decode's anchor (NULL: none, KVF_OK): its scheme into
 * *anchor_s, its layout into *AL, its size and place checked against the
 * output's first packed_bytes (fn names the caller in messages). */
int kvf_pipeline_args_check(const struct kvf_scheme *s, const kvf_layout *L, const void *packed, size_t packed_bytes,
                            const void *anchor, size_t anchor_bytes, int64_t anchor_n_tokens,
                            struct kvf_scheme *anchor_s, kvf_layout *AL, const char *fn);

/* -------------------------------------------- sensitivity table (sensitivity.c) */

/* kvf_mixed_map over a table's text (path names it in messages): the reader
 * the fuzzer drives. */
int kvf_mixed_map_parse(const struct kvf_scheme *s, const char *text, size_t len, const char *path, int32_t layer,
                        int32_t n_kv_heads, uint8_t *map);

/* ------------------------------------------------- number formats (numfmt.c) */

float kvf_bf16_to_f32(uint16_t b);
uint16_t kvf_f32_to_bf16(float f);  /* round to nearest even; a NaN is 0x7FC0 (FORMAT.md) */
float kvf_f16_to_f32(uint16_t h);
uint16_t kvf_f32_to_f16(float f);   /* round to nearest even; saturates to +-65504 */
/* FP8 E4M3 (FORMAT.md): round to nearest even, +-448 for larger values and
 * infinities, 0x7F for a NaN; kvf_e4m3_encode refuses NaN and Inf (KVF_ERANGE). */
uint8_t kvf_f32_to_e4m3(float f);
float kvf_e4m3_to_f32(uint8_t c);
int kvf_e4m3_encode(float f, uint8_t *out);

/* --------------------------------------------------- CPU reference (ref_*.c) */

/* Encode/decode of a whole packed cache on host memory: the CPU backend and
 * the oracle of the GPU kernels. qstats may be NULL; positions only for
 * rope.placement = "pre". */
int kvf_ref_encode(const struct kvf_scheme *s, const uint16_t *k, const uint16_t *v,
                   const kvf_shape *shape, const void *qstats, uint8_t *packed, size_t packed_bytes);
/* A warm start's source: the previous span's packed cache and its layout. */
typedef struct kvf_warm_src {
    const uint8_t *packed; /* NULL: none */
    kvf_layout L;
} kvf_warm_src;
/* kvf_ref_encode with the k-means warm-started from prev, the packed cache
 * of prev_n_tokens tokens (same scheme and heads; its header is checked) of
 * the previous span (kvf_encode_warm); prev NULL: kvf_ref_encode. */
int kvf_ref_encode_warm(const struct kvf_scheme *s, const uint16_t *k, const uint16_t *v, const kvf_shape *shape,
                        const void *qstats, const uint8_t *prev, size_t prev_bytes, int64_t prev_n_tokens,
                        uint8_t *packed, size_t packed_bytes);
/* kvf_encode_ex and kvf_decode_ex on host memory: every input of the
 * pipeline (anchors, error feedback, mixed precision's channel map). */
int kvf_ref_encode_ex(const struct kvf_scheme *s, const uint16_t *k, const uint16_t *v, const kvf_shape *shape,
                      const kvf_encode_args *args, uint8_t *packed, size_t packed_bytes);
int kvf_ref_decode_ex(const struct kvf_scheme *s, const uint8_t *packed, size_t packed_bytes, const kvf_shape *shape,
                      const kvf_decode_args *args, uint16_t *k_out, uint16_t *v_out);
int kvf_ref_decode(const struct kvf_scheme *s, const uint8_t *packed, size_t packed_bytes,
                   const kvf_shape *shape, const int32_t *positions, uint16_t *k_out, uint16_t *v_out);

/* Query statistics on host memory (ref_qstats.c), layout in docs/METHODS.md. */
#define KVF_QSTATS_MAGIC 0x5146564bu /* "KVFQ" */
#define KVF_QSTATS_VERSION 2u         /* 2: u64 count of skipped non-finite query rows at byte 24 */
typedef struct kvf_qstats_layout {
    int32_t n_heads;
    int head_dim, rank;
    size_t count_off, msum_off, u_off, lambda_off, total_bytes;
} kvf_qstats_layout;
int kvf_qstats_layout_compute(const struct kvf_scheme *s, int32_t n_heads, kvf_qstats_layout *out);
int kvf_ref_qstats_init(const struct kvf_scheme *s, void *qstats, size_t bytes, int32_t n_heads);
int kvf_ref_qstats_update(const struct kvf_scheme *s, void *qstats, size_t bytes, const uint16_t *q,
                          const kvf_shape *q_shape);
/* Check a host qstats buffer's header against a scheme (and n_heads unless 0). */
int kvf_qstats_check(const struct kvf_scheme *s, const void *qstats, size_t bytes, int32_t n_heads);

/* Resolve strides of 0 to head-major contiguous; check they are valid. */
int kvf_shape_resolve(const kvf_shape *in, int head_dim, kvf_shape *out);

/* ------------------------------------------------------ synthetic data (synth.c) */

/*
 * Deterministic BF16 tensor [n_heads][n_tokens][head_dim] with video-like
 * statistics: unit-variance base values, a per-token scale in [0.5, 1.5] and
 * two outlier channels per token of amplitude ~20 that differ from token to
 * token (ANCHORS.md's heterogeneous data). Same seed, same bytes.
 */
void kvf_synth_kv(uint16_t *x, int64_t n_tokens, int n_heads, int head_dim, uint64_t seed);

/* ------------------------------------------------------- toolkit (cuda_api.c) */

/* The CUDA toolkit (NVRTC, fatbinary): $CUDA_HOME, else the build's default. */
const char *kvf_cuda_home(void);

/* ---------------------------------------------------------- files (fileio.c) */

typedef struct kvf_bytes { const void *p; size_t n; } kvf_bytes;
/* Write the parts one after the other to path, atomically: a temporary file
 * beside it (mode bits `mode`), fsync'ed, renamed over path. KVF_EIO names
 * the path and the call that failed. */
int kvf_write_atomic(const char *path, const kvf_bytes *parts, int n_parts, unsigned mode);
/* kvf_write_atomic of one buffer, mode 0644. */
int kvf_write_file(const char *path, const void *data, size_t n);

/* ------------------------------------------------------------------ strings */

/* A decimal integer in [lo, hi] into *out, the whole string, no sign or
 * spaces (at most 18 digits): 1, or 0 with *out untouched. */
static inline int kvf_parse_int(const char *s, long long lo, long long hi, long long *out) {
    if (!s || !*s || strlen(s) > 18) return 0;
    long long v = 0;
    for (const char *p = s; *p; p++) {
        if (*p < '0' || *p > '9') return 0;
        v = v * 10 + (*p - '0');
    }
    if (v < lo || v > hi) return 0;
    *out = v;
    return 1;
}

/* How many times needle occurs in s, without overlaps. */
static inline int kvf_count_str(const char *s, const char *needle) {
    int n = 0;
    for (const char *p = s; (p = strstr(p, needle)); p += strlen(needle)) n++;
    return n;
}

/* ------------------------------------------------------- little-endian fields */

/* Little-endian fields of the packed planes, the cache's key and entries. */
static inline void kvf_put_u16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)(v & 0xffu);
    p[1] = (uint8_t)(v >> 8);
}
static inline uint16_t kvf_get_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline void kvf_put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint32_t kvf_get_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline void kvf_put_u64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint64_t kvf_get_u64(const uint8_t *p) {
    return (uint64_t)kvf_get_u32(p) | (uint64_t)kvf_get_u32(p + 4) << 32;
}
static inline void kvf_put_f32(uint8_t *p, float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    kvf_put_u32(p, u);
}
static inline float kvf_get_f32(const uint8_t *p) {
    uint32_t u = kvf_get_u32(p);
    float v;
    memcpy(&v, &u, 4);
    return v;
}

/* ------------------------------------------------------ threads (parallel.c) */

/* CPUs this thread may run on (its affinity mask; else the online CPUs), at least 1. */
int kvf_cpu_count(void);

/* The most threads kvf_parallel_for runs. */
#define KVF_MAX_THREADS 256

/* run(arg, task, worker) for every task 0..n_tasks-1 on up to `threads`
 * threads (at most n_tasks and KVF_MAX_THREADS): worker 0 is the calling thread, 1.. the
 * helpers (fewer if threads cannot start). setup(arg, worker), when given,
 * runs on each worker first: a helper whose setup fails takes no task, the
 * caller's failure is returned; teardown after a worker's last task. Tasks
 * are handed out in order and none after a failure (those running finish);
 * the lowest failing task's status and message come back here,
 * as one thread going in order would report them (runtime/core/parallel.c). */
typedef struct kvf_tasks {
    int n_tasks, threads;
    void *arg;
    int (*setup)(void *arg, int worker);
    int (*run)(void *arg, int task, int worker);
    void (*teardown)(void *arg, int worker);
} kvf_tasks;
int kvf_parallel_for(const kvf_tasks *t);

/* -------------------------------------------------------------- cache (cache.c) */

typedef struct kvf_cache_key {
    uint8_t bytes[16]; /* XXH3-128 */
    char hex[33];
} kvf_cache_key;

/* Key over: kvforge version, arch, NVRTC version, options, source parts. */
void kvf_cache_make_key(const char *arch, int nvrtc_major, int nvrtc_minor,
                        const char *const *options, int n_options,
                        const char *const *sources, const size_t *source_lens, int n_sources,
                        kvf_cache_key *out);
/* Look up: KVF_OK and a malloc'ed payload on a hit; 1 on a miss (corrupt = miss). */
int kvf_cache_get(const char *arch, const kvf_cache_key *key, void **payload, size_t *size);
/* Store atomically (temp file + rename). Failure to write only warns (once). */
int kvf_cache_put(const char *arch, const kvf_cache_key *key, const char *meta_json,
                  const void *payload, size_t size);
/* Serialize compiles of one key across processes: returns a lock fd or -1. */
int kvf_cache_lock(const char *arch, const kvf_cache_key *key);
void kvf_cache_unlock(int fd);
/* Print the entries (kvforge cache list). */
int kvf_cache_list(FILE *out);

/* The k-means assignment's filter statistics (templates/kvf_kmeans.cuh
 * assign_stats and assign_qsac_stats), for bench/: enable = 1 zeroes and
 * starts counting, 0 stops, -1 only reads. out[t] for K (t = 0) and V: per
 * kernel (plain at 0, QSAC at KVF_AS_N) the KVF_AS_* counts (kvf_abi.h).
 * Where V runs K's kernels (the plan's kmeans_owner), out[0] counts both and
 * out[1] stays 0. */
int kvf_context_assign_stats(struct kvf_context *ctx, int enable, unsigned long long out[2][2 * KVF_AS_N]);

#endif
