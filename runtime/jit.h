/* JIT compile of a scheme's kernels through the disk cache (jit.c). */
#ifndef KVF_JIT_H
#define KVF_JIT_H
#include "internal.h"

/* Image (cubin, or PTX when want_ptx) of the scheme's kernels for arch
 * ("sm_90"), from the disk cache or NVRTC. *origin: "disk-cache" or "nvrtc".
 * Needs no GPU. The caller frees *image. */
int kvf_jit_image(const struct kvf_scheme *s, const char *arch, int want_ptx, void **image, size_t *size,
                  const char **origin);

/* Export: cubins for each arch (+ PTX of the newest) in one fatbin written by
 * the toolkit's `fatbinary`, and C + header embedding it (export.c). */
int kvf_export(const struct kvf_scheme *s, const char *const *archs, int n_archs, const char *dir);
#endif
