/* JIT compile of a scheme's kernels through the disk cache (jit.c). */
#ifndef KVF_JIT_H
#define KVF_JIT_H
#include "gen.h"
#include "internal.h"

/* Image (cubin, or PTX when want_ptx) of the scheme's kernels for arch
 * ("sm_90"; PTX also for "compute_90") as one program (the generator's whole
 * source, what an AOT export holds), from the disk cache or NVRTC.
 * *origin: "disk-cache" or "nvrtc". KVF_EINVAL for a cubin of a virtual arch.
 * Needs no GPU. The caller frees *image. */
int kvf_jit_image(const struct kvf_scheme *s, const char *arch, int want_ptx, void **image, size_t *size,
                  const char **origin);

/* The images of a scheme's programs (kvf_gen_output.program), one module each. */
typedef struct kvf_jit_images {
    int n;
    void *image[KVF_GEN_MAX_PROGRAMS];
    size_t size[KVF_GEN_MAX_PROGRAMS];
    const char *origin; /* "disk-cache" when every program came from it, else "nvrtc" */
} kvf_jit_images;

/* What a context loads: the images of the scheme's programs for arch, as
 * kvf_jit_image makes one, each from the disk cache (a key per program) or
 * NVRTC, the programs on threads of their own at once. The images are those
 * of the same kernels as kvf_jit_image's, split by program. Free with
 * kvf_jit_images_free (also after a failure, which frees them itself). */
int kvf_jit_programs(const struct kvf_scheme *s, const char *arch, int want_ptx, kvf_jit_images *out);
void kvf_jit_images_free(kvf_jit_images *images);

/* One kernel of ptxas's report. */
typedef struct kvf_kernel_usage {
    char name[128];
    int registers, barriers;
    long stack, spill_stores, spill_loads, smem; /* bytes; smem: static shared memory */
} kvf_kernel_usage;

/* NVRTC compile of the scheme's programs (kvf_jit_programs, at once) for
 * arch ("sm_90"; no cache, no GPU) with ptxas's report parsed per kernel:
 * *usage (n entries, in program order and each program's report's order; the
 * caller frees it), and with images (NULL: not wanted) the cubins, which the
 * caller frees with kvf_jit_images_free (they differ in bytes from
 * kvf_jit_programs': the report option is recorded in them). KVF_EINVAL for
 * a virtual arch (compute_90: no ptxas); KVF_EFORMAT when a report lists no
 * kernel, or a kernel without its register line or its stack/spill line (a
 * report this code does not know). */
int kvf_jit_usage(const struct kvf_scheme *s, const char *arch, kvf_kernel_usage **usage, int *n,
                  kvf_jit_images *images);

/* The parser of kvf_jit_usage. ptxas -v lines, per entry: "Compiling entry
 * function 'NAME' for 'sm_90'", "Function properties for NAME", ". N bytes
 * stack frame, N bytes spill stores, N bytes spill loads", "Used N
 * registers, used N barriers, N bytes smem, ..." (smem absent when 0). Other
 * functions' properties are skipped. */
int kvf_ptxas_report_parse(const char *log, kvf_kernel_usage **usage, int *n);

/* Export: cubins for each arch (+ PTX of the newest) in one fatbin written by
 * the toolkit's `fatbinary`, and C + header embedding it (export.c). */
int kvf_export(const struct kvf_scheme *s, const char *const *archs, int n_archs, const char *dir);
#endif
