/*
 * The generator: a scheme's plan (runtime/core/plan.c) printed as
 * configuration-only CUDA source (instantiations of the hand-written
 * templates/) and a C source + header with its canonical configuration and
 * layout constants. A library: the CLI (`kvforge gen`), the JIT and the AOT
 * export use it.
 */
#ifndef KVF_GEN_H
#define KVF_GEN_H

#include "internal.h"

/* The most programs kvf_gen_output splits a scheme's kernels into. */
#define KVF_GEN_MAX_PROGRAMS KVF_MAX_PROGRAMS

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
    char *c_name, *c;   /* "<id>.c": the canonical configuration and its loader (the AOT export links it) */
    char *h_name, *h;   /* "<id>.h" */
} kvf_gen_output;

/* Generate the files for a scheme: its plan printed (KVF_ENOTIMPL where the
 * plan says the GPU templates cannot run it). */
int kvf_gen(const struct kvf_scheme *s, kvf_gen_output *out);
/* Only the programs (n_programs, program, program_name; the other fields
 * NULL): what a context's JIT compiles. */
int kvf_gen_programs(const struct kvf_scheme *s, kvf_gen_output *out);
void kvf_gen_output_free(kvf_gen_output *out);
/* Write the three files into dir (created if missing). */
int kvf_gen_write(const kvf_gen_output *out, const char *dir);

/* Growable string used by the generator and the exporter. */
typedef struct kvf_buf { char *p; size_t len, cap; int oom; } kvf_buf;
void kvf_buf_printf(kvf_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void kvf_buf_append(kvf_buf *b, const char *s, size_t n);
/* Append data as the body of a C string literal split over lines. */
void kvf_buf_c_string(kvf_buf *b, const char *s, size_t n);
/* Append data as a C byte array initializer body. */
void kvf_buf_c_bytes(kvf_buf *b, const void *data, size_t n);
char *kvf_buf_take(kvf_buf *b); /* NULL if an allocation failed */


#endif
