/* A context's private parts, shared by the context's life (context.c) and its
 * launches (launch.c). */
#ifndef KVF_GPU_CONTEXT_H
#define KVF_GPU_CONTEXT_H

#include "gpu/cuda_api.h"
#include "internal.h"

struct kvf_context {
    struct kvf_scheme *scheme; /* its own copy; scheme->plan says what to launch */
    int device;                /* KVF_DEVICE_CPU or the CUDA ordinal */
    char backend[24];
    const char *origin;
    const kvf_cuda_api *cu;
    CUdevice dev;
    CUcontext cuctx;
    CUmodule module[KVF_MAX_PROGRAMS]; /* the programs' modules (kvf_jit_programs), or an image's one */
    int n_modules;
    CUfunction fn[KVF_ROLE_COUNT]; /* NULL where the scheme has no such kernel */
    int sms;                       /* multiprocessors (sizes the k-means assignment grid) */
    int smem_optin;                /* dynamic shared bytes a block may opt into on this device */
    int assign_cfg[2][KVF_AC_COUNT]; /* per section: the k-means module's <prefix>_assign_cfg */
    CUdeviceptr ws;                /* workspace of the k-means/PSAC path, grown on demand */
    size_t ws_bytes;
};

/* A GPU entry point makes the device's context current once (kvf_ctx_push)
 * for all its driver calls and launches, and gives it back (kvf_ctx_pop,
 * which returns rc) on every way out. */
int kvf_ctx_push(const kvf_context *ctx);
int kvf_ctx_pop(const kvf_context *ctx, int rc);

/* An encode's inputs besides K and V, checked (context.c). */
typedef struct kvf_gpu_inputs {
    const void *qstats;
    kvf_warm_src warm;
    const void *anchor;        /* NULL: none */
    kvf_layout anchor_layout;  /* its layout, with anchor */
    float *feedback;           /* NULL: none */
    int feedback_in;
    const uint8_t *channel_map;
} kvf_gpu_inputs;

/* launch.c, each inside kvf_ctx_push. Arguments are checked by the caller
 * (context.c). */
int kvf_gpu_encode(kvf_context *ctx, const void *k, const void *v, const kvf_shape *sh, const kvf_layout *l,
                   const kvf_gpu_inputs *in, void *packed, void *stream);
int kvf_gpu_decode(kvf_context *ctx, const void *packed, const kvf_shape *sh, const kvf_layout *l,
                   const int32_t *positions, const void *anchor, const kvf_layout *anchor_layout, void *k_out,
                   void *v_out, void *stream);
int kvf_gpu_qstats_init(kvf_context *ctx, void *qstats, size_t total, const kvf_qstats_layout *ql, void *stream);
int kvf_gpu_qstats_update(kvf_context *ctx, void *qstats, const kvf_qstats_layout *ql, const void *q,
                          const kvf_shape *q_shape, int group, void *stream);
/* The alignment, stride and size rules of the kernels. */
int kvf_gpu_check_args(const void *a, const void *b, const void *packed, const kvf_shape *sh, const char *fn);

#endif
