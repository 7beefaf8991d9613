/*
 * The generator: from a loaded scheme, the configuration-only CUDA source (it
 * includes the hand-written templates/) and a C source + header with layout
 * constants, the kernel name table, typed wrappers and the CUDA source as a
 * string. A library: the CLI (`kvforge gen`) and the runtime's JIT both use it.
 */
#ifndef KVF_GEN_H
#define KVF_GEN_H

#include "internal.h"

/* Kernels a scheme may need, by role. The entry of role R is named
 * "kvf_<id>_<kvf_role_names[R]>"; kvf_gen_roles says which a scheme has. */
enum kvf_role {
    KVF_R_HEADER = 0,
    KVF_R_ENCODE_K, KVF_R_ENCODE_V, KVF_R_DECODE, /* one kernel decodes K and V */
    /* Workspace path (centroids, stages, PSAC): per section, K then V. */
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

/* How a tensor section is encoded: 'A' one RTN launch (QuaRot included), 'T'
 * per-channel groups along tokens (KIVI), 'B' the workspace path (k-means,
 * stages, PSAC). */
char kvf_section_path(const kvf_tensor_cfg *t);
/* present[r] = 1 for every role the scheme's generated source defines. */
void kvf_gen_roles(const struct kvf_scheme *s, int present[KVF_ROLE_COUNT]);

/* The most programs kvf_gen_output splits a scheme's kernels into. */
#define KVF_GEN_MAX_PROGRAMS 4

typedef struct kvf_gen_output {
    char *cu_name, *cu; /* "<id>.cu": configuration + instantiations */
    /* The same kernels as cu, split into programs the JIT compiles at once on
     * separate threads (runtime/gpu/jit.c kvf_jit_programs), a module each: its
     * cold compile then takes about as long as its slowest program, not the
     * sum of the kernels that NVRTC's split compile cannot share out. Program
     * 0: the header, the one-launch encodes, the decode, the query statistics,
     * PSAC and the QSAC weights; then each section's k-means kernels
     * (KVF_KMEANS_KERNELS, once where the value section runs the key's); then
     * the QSAC assignment. Each defines the format and interface globals.
     * Names "<id>.pN.cu". The AOT export compiles cu, one module. */
    int n_programs;
    char *program_name[KVF_GEN_MAX_PROGRAMS], *program[KVF_GEN_MAX_PROGRAMS];
    char *c_name, *c;   /* "<id>.c": constants, name table, wrappers, source string */
    char *h_name, *h;   /* "<id>.h" */
} kvf_gen_output;

/* Generate the files for a scheme (KVF_ENOTIMPL if a method is not implemented). */
int kvf_gen(const struct kvf_scheme *s, kvf_gen_output *out);
/* The same checks, and only the programs (n_programs, program, program_name;
 * the other fields NULL): what a context's JIT compiles, without the whole
 * source, the C file and the header it does not use (quantwm_int2, here:
 * 17 us against kvf_gen's 88 us, most of that formatting those). */
int kvf_gen_programs(const struct kvf_scheme *s, kvf_gen_output *out);
void kvf_gen_output_free(kvf_gen_output *out);
/* Write the three files into dir (created if missing). */
int kvf_gen_write(const kvf_gen_output *out, const char *dir);
/* Kernel entry name of a role, e.g. "kvf_rtn_int2_1a2b3c4d_encode_k": that
 * of the role whose kernel serves it (kvf_gen_role_kernel). */
void kvf_gen_kernel_name(const struct kvf_scheme *s, int role, char *buf, size_t len);
/* The roles whose kernels the generated source defines, each kernel once
 * (present and served by itself, kvf_gen_role_kernel), in role order, into
 * roles; returns how many. */
int kvf_gen_kernels(const struct kvf_scheme *s, int roles[KVF_ROLE_COUNT]);
/* The role whose kernel serves `role`: itself, or the key section's k-means
 * role where the value section runs the key's kernels (kvf_gen_kmeans_owner). */
int kvf_gen_role_kernel(const struct kvf_scheme *s, int role);
/* Which section's k-means kernels (KVF_KMEANS_KERNELS) section t (0 key,
 * 1 value) runs: its own, or 0 where the value section's template arguments
 * equal the key section's (only QSAC's, which values never run, may differ),
 * so NVRTC compiles them once. Its module globals (assign_cfg, assign_stats)
 * are then the owner's too. */
int kvf_gen_kmeans_owner(const struct kvf_scheme *s, int t);

/* Growable string used by the generator and the exporter. */
typedef struct kvf_buf { char *p; size_t len, cap; int oom; } kvf_buf;
void kvf_buf_printf(kvf_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void kvf_buf_append(kvf_buf *b, const char *s, size_t n);
/* Append data as the body of a C string literal split over lines. */
void kvf_buf_c_string(kvf_buf *b, const char *s, size_t n);
/* Append data as a C byte array initializer body. */
void kvf_buf_c_bytes(kvf_buf *b, const void *data, size_t n);
char *kvf_buf_take(kvf_buf *b); /* NULL if an allocation failed */

/* Write a whole file atomically (temp + rename). */
int kvf_write_file(const char *path, const void *data, size_t n);

#endif
