/*
 * The launches of a scheme's plan on a device: each kernel gets its one
 * parameter struct (templates/kvf_abi.h), filled here from the plan and the
 * layout. Grids follow the templates' tile constants, declared in the same
 * header.
 */
#include "gpu/context.h"

#include <math.h>
#include <string.h>

static unsigned blocks_for(int64_t items, int64_t per_block) {
    return (unsigned)((items + per_block - 1) / per_block);
}

/* Rows of D channels, D/8 lanes each, KVF_BLOCK threads per block. */
static unsigned row_grid(const kvf_context *ctx, const kvf_shape *sh) {
    return blocks_for((int64_t)sh->n_tokens * sh->n_heads, KVF_BLOCK / (ctx->scheme->head_dim / KVF_VEC));
}

static CUdeviceptr dptr(const void *p) { return (CUdeviceptr)(uintptr_t)p; }

int kvf_gpu_check_args(const void *a, const void *b, const void *packed, const kvf_shape *sh, const char *fn) {
    if (((uintptr_t)a | (uintptr_t)b | (uintptr_t)packed) & 15u)
        return kvf_set_error(KVF_EINVAL, "%s: K, V and packed pointers must be 16-byte aligned", fn);
    if ((sh->token_stride | sh->head_stride) & (KVF_VEC - 1))
        return kvf_set_error(KVF_EINVAL, "%s: token_stride and head_stride must be multiples of 8 (got %lld, %lld)",
                             fn, (long long)sh->token_stride, (long long)sh->head_stride);
    if (sh->n_tokens > INT32_MAX || (int64_t)sh->n_tokens * sh->n_heads > (int64_t)INT32_MAX * KVF_BLOCK / 32)
        return kvf_set_error(KVF_EINVAL, "%s: %lld tokens x %d heads is too large for one launch", fn,
                             (long long)sh->n_tokens, sh->n_heads);
    /* Some kernels take the head from grid y (PSAC, decode, query
     * statistics, the Lloyd sums; the assignments loop over heads): checked
     * before any of them writes. */
    if (sh->n_heads > 65535)
        return kvf_set_error(KVF_EINVAL, "%s: %d heads: the GPU kernels take at most 65535", fn, sh->n_heads);
    return KVF_OK;
}

/* One kernel of the plan with its parameter struct: grid (gx, gy), block
 * threads, dynamic shared bytes. */
static int launch(kvf_context *ctx, int role, unsigned gx, unsigned gy, unsigned block, unsigned smem,
                  const void *params, void *stream) {
    if (!ctx->fn[role])
        return kvf_set_error(KVF_EINVAL, "scheme %s has no %s kernel", ctx->scheme->id, kvf_role_names[role]);
    if (!gx || !gy) return KVF_OK;
    void *args[] = {(void *)params};
    CUresult r = ctx->cu->cuLaunchKernel(ctx->fn[role], gx, gy, 1, block, 1, 1, smem, (CUstream)stream, args, NULL);
    if (r != CUDA_SUCCESS) {
        char what[200];
        snprintf(what, sizeof what, "cuLaunchKernel(%s)", kvf_role_names[role]);
        return kvf_cuda_fail(r, what, __FILE__, __LINE__, ctx->device);
    }
    return KVF_OK;
}

/* A 1-D grid of KVF_BLOCK threads. */
static int launch1(kvf_context *ctx, int role, unsigned grid, const void *params, void *stream) {
    return launch(ctx, role, grid, 1, KVF_BLOCK, 0, params, stream);
}

static struct kvf_stage_planes stage_planes(const kvf_stage_layout *s) {
    struct kvf_stage_planes a = {s->codes_off, s->scales_off, s->tscales_off, s->zeros_off, s->index_off,
                                 s->centroids_off};
    return a;
}

static struct kvf_pipe_planes pipe_planes(const kvf_section_layout *l) {
    struct kvf_pipe_planes a = {l->oidx_off, l->oval_off, l->mmap_off, l->mcode_off, l->mscale_off};
    return a;
}

static struct kvf_section_planes section_planes(const kvf_section_layout *l) {
    struct kvf_section_planes a;
    memset(&a, 0, sizeof a);
    for (int s = 0; s < KVF_MAX_STAGES; s++) a.stage[s] = stage_planes(&l->stage[s]);
    a.basis = l->basis_off;
    a.coef = l->coef_off;
    a.cscale = l->cscale_off;
    a.bscale = l->bscale_off;
    a.pipe = pipe_planes(l); /* decode reads the outliers, the map and the refinements there */
    return a;
}

/* Section t's rows of an anchor span (its layout al), or none. */
static struct kvf_anchor_ref anchor_ref(const void *anchor, const kvf_layout *al, int t) {
    struct kvf_anchor_ref a;
    memset(&a, 0, sizeof a);
    if (!anchor) return a;
    const kvf_section_layout *l = t ? &al->value : &al->key;
    a.packed = dptr(anchor);
    a.codes = l->stage[0].codes_off;
    a.scales = l->stage[0].scales_off;
    a.zeros = l->stage[0].zeros_off;
    a.tokens = (int)al->n_tokens;
    return a;
}

/* What section t's encode kernels take of the pipeline. */
static struct kvf_pipe_io pipe_io(const kvf_context *ctx, const kvf_gpu_inputs *in, const kvf_layout *l, int t) {
    struct kvf_pipe_io io;
    memset(&io, 0, sizeof io);
    const kvf_section_layout *sl = t ? &l->value : &l->key;
    const size_t nd = (size_t)l->n_heads * (size_t)l->n_tokens * (size_t)l->head_dim;
    io.planes = pipe_planes(sl);
    io.anchor = anchor_ref(in->anchor, &in->anchor_layout, t);
    if (in->feedback) io.fb = dptr(in->feedback + (size_t)t * nd);
    if (in->channel_map && sl->mp_channels)
        io.map = dptr(in->channel_map + (size_t)t * (size_t)l->n_heads * (size_t)l->head_dim);
    io.fb_in = in->feedback_in;
    io.decay = (float)ctx->scheme->pipe.feedback_decay;
    return io;
}

static struct kvf_qstats_planes qstats_planes(const kvf_qstats_layout *l) {
    struct kvf_qstats_planes a = {l->count_off, l->msum_off, l->u_off, l->lambda_off, l->n_heads, l->head_dim,
                                  l->rank, 0};
    return a;
}

/* ------------------------------------------------------------- k-means */

/* Workspace of the k-means path (docs/METHODS.md 3): the f32 working vectors
 * e (absent when stage 0 reads the BF16 input and nothing needs the final
 * error), indices, the Lloyd sums and counts of each part of the tokens,
 * QSAC's weights. */
typedef struct { CUdeviceptr e, idx, acc, cnt, w; } ws_parts;

/* Token parts of the Lloyd sums: one block per head and part, about one
 * block (of 1024 threads: it fills a multiprocessor) per multiprocessor in
 * all, at least 256 tokens a part. */
static int sum_parts(const kvf_context *ctx, const kvf_shape *sh) {
    int64_t p = ctx->sms / sh->n_heads, most = (sh->n_tokens + 255) / 256;
    if (p > most) p = most;
    if (p > 64) p = 64;
    return p < 1 ? 1 : (int)p;
}

static int workspace(kvf_context *ctx, const kvf_shape *sh, int need_e, int parts, ws_parts *p) {
    const int64_t rows = (int64_t)sh->n_tokens * sh->n_heads, d = ctx->scheme->head_dim;
    size_t off[6], need = 0;
    const size_t sizes[5] = {need_e ? (size_t)(rows * d * 4) : 0, (size_t)rows * 4,
                             (size_t)parts * sh->n_heads * 256 * d * 8, (size_t)parts * sh->n_heads * 256 * 4,
                             (size_t)(sh->n_heads * d * 4)};
    for (int i = 0; i < 5; i++) { off[i] = need; need += (sizes[i] + 255) & ~(size_t)255; }
    if (need > ctx->ws_bytes) {
        const kvf_cuda_api *cu = ctx->cu;
        if (ctx->ws) cu->cuMemFree(ctx->ws); /* synchronizes: earlier launches are done with it */
        ctx->ws = 0;
        ctx->ws_bytes = 0;
        CUresult r = cu->cuMemAlloc(&ctx->ws, need);
        if (r != CUDA_SUCCESS) return kvf_cuda_fail(r, "cuMemAlloc(workspace)", __FILE__, __LINE__, ctx->device);
        ctx->ws_bytes = need;
    }
    p->e = need_e ? ctx->ws + off[0] : 0;
    p->idx = ctx->ws + off[1];
    p->acc = ctx->ws + off[2];
    p->cnt = ctx->ws + off[3];
    p->w = ctx->ws + off[4];
    return KVF_OK;
}

/* The plain assignment of one k-means stage: labels (int32, the Lloyd
 * step's workspace) and/or plane (the packed index plane); 0 = not written. */
static int assign_plain(kvf_context *ctx, int t, struct kvf_kmeans_assign_params a, CUdeviceptr labels,
                        CUdeviceptr plane, unsigned grid, void *stream) {
    const int *ac = ctx->assign_cfg[t];
    a.idx_ws = labels;
    a.idx_plane = plane;
    a.weights = 0;
    return launch(ctx, KVF_R_K_ASSIGN + t * KVF_R_SECTION_STRIDE, grid, 1, (unsigned)ac[KVF_AC_THREADS],
                  (unsigned)ac[KVF_AC_SMEM], &a, stream);
}

/* k-means of one stage (METHODS.md 3): init, Lloyd steps, final assignment;
 * with kmeans_labels = "last_step" the last step's assignment writes the
 * index plane too, and there is no final assignment. warm (0: none): the
 * previous span's table of this stage, whose first min(its tokens, c_eff)
 * rows replace the strided sample's where they hold no NaN or Inf
 * (prev_tokens: its tokens; kvf_kmeans::init). */
static int kmeans_stage(kvf_context *ctx, int t, int stage, const kvf_shape *sh, const struct kvf_kmeans_src *src,
                        const ws_parts *ws, int parts, CUdeviceptr packed, const kvf_stage_layout *sl,
                        CUdeviceptr weights, CUdeviceptr warm, int64_t prev_tokens, void *stream) {
    const kvf_tensor_cfg *c = t ? &ctx->scheme->value : &ctx->scheme->key;
    const kvf_section_plan *sp = &ctx->scheme->plan.sec[t];
    const int base = t * KVF_R_SECTION_STRIDE, d = ctx->scheme->head_dim;
    const int nh = sh->n_heads, n = (int)sh->n_tokens, c_alloc = sp->centroids, c_eff = n < c_alloc ? n : c_alloc;
    const CUdeviceptr cent = packed + sl->centroids_off, idx_plane = packed + sl->index_off;
    const int *ac = ctx->assign_cfg[t];
    int rc = KVF_OK;
    /* The assignment's blocks share the (head, token tile) pairs of all heads
     * in equal contiguous ranges: one block (its shared memory allows one) a
     * multiprocessor, or one for each block's worth of tokens of each head
     * where that is fewer. */
    unsigned g_tok[2];
    for (int k = 0; k < 2; k++) {
        int64_t g = (int64_t)nh * blocks_for(n, ac[KVF_AC_TOKENS + k]);
        g_tok[k] = (unsigned)(g < ctx->sms ? g : ctx->sms);
    }
    const unsigned g_cd = blocks_for((int64_t)nh * c_eff * d, KVF_BLOCK);
    const struct kvf_kmeans_init_params init = {
        .src = *src, .n = n, .nh = nh, .c_eff = c_eff, .stage = stage, .seed = (long long)c->seed, .cent = cent,
        .c_alloc = c_alloc, .c_warm = !warm ? 0 : prev_tokens < c_eff ? (int)prev_tokens : c_eff, .warm = warm};
    const struct kvf_kmeans_assign_params assign = {
        .src = *src, .n = n, .nh = nh, .c_eff = c_eff, .c_alloc = c_alloc, .cent = cent};
    const struct kvf_kmeans_accumulate_params acc = {
        .src = *src, .idx = ws->idx, .n = n, .c_eff = c_eff, .chunk = (n + parts - 1) / parts, .acc = ws->acc,
        .cnt = ws->cnt};
    const struct kvf_kmeans_finalize_params fin = {
        .nh = nh, .c_eff = c_eff, .parts = parts, .c_alloc = c_alloc, .acc = ws->acc, .cnt = ws->cnt, .cent = cent};
    const int last_step = kvf_labels_of_last_step(c);
    if ((rc = launch1(ctx, KVF_R_K_INIT + base, g_cd, &init, stream))) return rc;
    for (int it = 0; it < c->kmeans_iters; it++) {
        CUdeviceptr plane = last_step && it == c->kmeans_iters - 1 ? idx_plane : 0;
        /* accumulate: one block per (part, head). */
        if ((rc = assign_plain(ctx, t, assign, ws->idx, plane, g_tok[0], stream)) ||
            (rc = launch(ctx, KVF_R_K_ACCUMULATE + base, (unsigned)parts, (unsigned)nh,
                         (unsigned)ac[KVF_AC_SUM_THREADS], 0, &acc, stream)) ||
            (rc = launch1(ctx, KVF_R_K_FINALIZE + base, g_cd, &fin, stream)))
            return rc;
    }
    /* The final labels: the last Lloyd step's (its assignment wrote the index
     * plane), else QSAC's for stage 0 of keys, else one more plain pass. */
    if (!last_step && stage == 0 && sp->qsac > 1) {
        struct kvf_kmeans_assign_params q = assign;
        q.idx_plane = idx_plane;
        q.weights = weights;
        rc = launch(ctx, KVF_R_K_ASSIGN_QSAC + base, g_tok[1], 1, (unsigned)ac[KVF_AC_THREADS_QSAC],
                    (unsigned)ac[KVF_AC_SMEM_QSAC], &q, stream);
    } else if (!last_step) {
        rc = assign_plain(ctx, t, assign, 0, idx_plane, g_tok[0], stream);
    }
    if (rc || c_eff == c_alloc) return rc;
    const struct kvf_kmeans_pad_params pad = {.nh = nh, .c_eff = c_eff, .c_alloc = c_alloc, .cent = cent};
    return launch1(ctx, KVF_R_K_PAD + base, blocks_for((int64_t)nh * (c_alloc - c_eff) * d, KVF_BLOCK), &pad, stream);
}

/* The k-means path of one section: stages (stage 0 on the BF16 input itself
 * where the plan says so, else on the prepared f32 workspace), the residual,
 * then PSAC for keys. */
static int encode_kmeans(kvf_context *ctx, int t, const void *x, const kvf_shape *sh, const void *qstats,
                         const kvf_warm_src *warm, const struct kvf_pipe_io *io, CUdeviceptr packed,
                         const kvf_section_layout *l, void *stream) {
    const kvf_section_plan *c = &ctx->scheme->plan.sec[t];
    const int base = t * KVF_R_SECTION_STRIDE, d = ctx->scheme->head_dim;
    const int bf = ctx->assign_cfg[t][KVF_AC_BF16_SOURCE], parts = sum_parts(ctx, sh);
    const int n = (int)sh->n_tokens, nh = sh->n_heads;
    int rc;
    ws_parts ws = {0};
    if ((rc = workspace(ctx, sh, !bf || c->psac_rank > 0, parts, &ws))) return rc;
    struct kvf_qstats_planes q = {0};
    const CUdeviceptr qs = dptr(qstats);
    if (t == 0 && ctx->scheme->plan.reads_qstats) {
        kvf_qstats_layout ql;
        if ((rc = kvf_qstats_layout_compute(ctx->scheme, nh, &ql))) return rc;
        q = qstats_planes(&ql);
    }
    struct kvf_kmeans_src src = {ws.e, d, (long long)n * d};
    if (bf) {
        src.p = dptr(x);
        src.ts = sh->token_stride;
        src.hs = sh->head_stride;
    } else {
        const struct kvf_kmeans_prep_params prep = {{dptr(x), sh->token_stride, sh->head_stride}, n, nh, ws.e, *io};
        if ((rc = launch1(ctx, KVF_R_K_PREP + base, row_grid(ctx, sh), &prep, stream))) return rc;
    }
    if (c->qsac > 1) {
        const struct kvf_qsac_weights_params w = {.qs = qs, .l = q, .nh = nh, .w = ws.w};
        if ((rc = launch1(ctx, KVF_R_QSAC_WEIGHTS, blocks_for((int64_t)nh * d, KVF_BLOCK), &w, stream))) return rc;
    }
    /* Every stage smooths with its own centroids; the last residual alone is
     * quantized, into stage 0's planes (METHODS.md 1). Only the workspace has
     * later stages (a BF16 source means one stage). */
    const int last = c->stages - 1;
    for (int s = 0; s < c->stages && c->centroids > 0; s++) {
        CUdeviceptr w = 0;
        if (warm->packed) w = dptr(warm->packed) + (t ? warm->L.value : warm->L.key).stage[s].centroids_off;
        if ((rc = kmeans_stage(ctx, t, s, sh, &src, &ws, parts, packed, &l->stage[s], ws.w, w, warm->L.n_tokens,
                               stream)))
            return rc;
        if (s == last) break;
        const struct kvf_kmeans_subtract_params sub = {ws.e, n, nh, packed, stage_planes(&l->stage[s])};
        if ((rc = launch1(ctx, KVF_R_K_SUBTRACT + base, blocks_for((int64_t)n * nh * d, KVF_BLOCK), &sub, stream)))
            return rc;
    }
    struct kvf_kmeans_residual_params res = {.src = src, .e_out = ws.e, .n = n, .nh = nh,
                                             .write_e = c->psac_rank > 0, .packed = packed,
                                             .planes = stage_planes(&l->stage[0]),
                                             .in = {dptr(x), sh->token_stride, sh->head_stride}, .pipe = *io};
    res.planes.index = l->stage[last].index_off;
    res.planes.centroids = l->stage[last].centroids_off;
    const unsigned res_grid =
        blocks_for((int64_t)n * nh, (int64_t)KVF_BLOCK / (d / KVF_VEC) * ctx->assign_cfg[t][KVF_AC_RES_ROWS]);
    if ((rc = launch1(ctx, KVF_R_K_RESIDUAL + base, res_grid, &res, stream))) return rc;
    if (t == 1 || c->psac_rank == 0) return KVF_OK;
    const struct kvf_psac_basis_params pb = {qs, q, packed, l->basis_off, l->bscale_off};
    const struct kvf_psac_encode_params pe = {.e = ws.e, .n = n, .qs = qs, .l = q, .packed = packed,
                                              .basis_off = l->basis_off, .bscale_off = l->bscale_off,
                                              .coef_off = l->coef_off, .cscale_off = l->cscale_off};
    /* One block per head (kvf_psac::basis: the head's maximum, then its codes). */
    if ((rc = launch1(ctx, KVF_R_PSAC_BASIS, (unsigned)nh, &pb, stream))) return rc;
    /* Grid (token blocks, heads: at most 65535), one thread a token. */
    return launch(ctx, KVF_R_PSAC_ENCODE, blocks_for(n, KVF_PSAC_ENCODE_ROWS), (unsigned)nh, KVF_PSAC_ENCODE_ROWS, 0,
                  &pe, stream);
}

/* -------------------------------------------------------------- encode */

int kvf_gpu_encode(kvf_context *ctx, const void *k, const void *v, const kvf_shape *sh, const kvf_layout *l,
                   const kvf_gpu_inputs *in, void *packed, void *stream) {
    const void *qstats = in->qstats;
    const kvf_warm_src *warm = &in->warm;
    kvf_packed_header hdr;
    kvf_header_fill(ctx->scheme, l, &hdr);
    struct kvf_header_words words;
    memcpy(&words, &hdr, sizeof words);
    int rc, header_written = 0;
    const void *src[2] = {k, v};
    const kvf_section_layout *sec[2] = {&l->key, &l->value};
    const CUdeviceptr dp = dptr(packed);
    for (int t = 0; t < 2; t++) {
        const kvf_section_plan *c = &ctx->scheme->plan.sec[t];
        if (c->path == KVF_PATH_KMEANS) {
            if (!header_written) {
                const struct kvf_header_params h = {dp, words};
                if ((rc = launch1(ctx, KVF_R_HEADER, 1, &h, stream))) return rc;
                header_written = 1;
            }
            const struct kvf_pipe_io io = pipe_io(ctx, in, l, t);
            if ((rc = encode_kmeans(ctx, t, src[t], sh, qstats, warm, &io, dp, sec[t], stream))) return rc;
            continue;
        }
        const struct kvf_encode_params e = {.in = {dptr(src[t]), sh->token_stride, sh->head_stride},
                                            .n_tokens = (int)sh->n_tokens, .n_heads = sh->n_heads, .packed = dp,
                                            .planes = stage_planes(&sec[t]->stage[0]),
                                            .write_header = !header_written, .hdr = words,
                                            .pipe = pipe_io(ctx, in, l, t)};
        header_written = 1;
        const unsigned grid =
            c->path == KVF_PATH_TOKEN_GROUPS
                ? blocks_for((sh->n_tokens + c->group - 1) / c->group * sh->n_heads,
                             KVF_BLOCK / (ctx->scheme->head_dim / KVF_VEC))
                : row_grid(ctx, sh);
        if ((rc = launch1(ctx, KVF_R_ENCODE_K + t, grid, &e, stream))) return rc;
    }
    /* Mixed precision: the channel map goes into the span, so its decode needs
     * nothing else. */
    for (int t = 0; t < 2; t++) {
        const kvf_section_layout *sl = sec[t];
        if (!sl->mp_channels) continue;
        const CUdeviceptr map = dptr(in->channel_map + (size_t)t * (size_t)l->n_heads * (size_t)l->head_dim);
        CUresult r = ctx->cu->cuMemcpyDtoDAsync(dp + sl->mmap_off, map, sl->mmap_bytes, (CUstream)stream);
        if (r != CUDA_SUCCESS) return kvf_cuda_fail(r, "cuMemcpyDtoDAsync(channel map)", __FILE__, __LINE__, ctx->device);
    }
    return KVF_OK;
}

/* -------------------------------------------------------------- decode */

int kvf_gpu_decode(kvf_context *ctx, const void *packed, const kvf_shape *sh, const kvf_layout *l,
                   const int32_t *positions, const void *anchor, const kvf_layout *anchor_layout, void *k_out,
                   void *v_out, void *stream) {

    const kvf_scheme *s = ctx->scheme;
    struct kvf_decode_params p;
    memset(&p, 0, sizeof p);
    p.packed = dptr(packed);
    p.planes[0] = section_planes(&l->key);
    p.planes[1] = section_planes(&l->value);
    p.n_tokens = (int)sh->n_tokens;
    p.out[0] = dptr(k_out);
    p.out[1] = dptr(v_out);
    p.ts = sh->token_stride;
    p.hs = sh->head_stride;
    p.positions = dptr(positions);
    p.anchor[0] = anchor_ref(anchor, anchor_layout, 0);
    p.anchor[1] = anchor_ref(anchor, anchor_layout, 1);
    p.rope.log2_theta = log2(s->rope.theta > 0 ? s->rope.theta : 10000.0);
    p.rope.n_sections = kvf_rope_sections(s, p.rope.sections);
    /* Grid (token tiles of K, then of V; heads): blockIdx.y is the head (at
     * most 65535, kvf_gpu_check_args). A tile is KVF_BLOCK / (d/8) rows x
     * KVF_DECODE_RPT, and a block loops over the plan's decode_tiles of them
     * per pass (kvf_decode::tiling adapts rows and channels a thread to the
     * same tile); a section's blocks loop over tiles b, b + nb, ..., so this
     * only tunes speed, keeping nb x tile below 2^32 for the kernel's u32
     * token math. */
    for (int t = 0; t < 2; t++) {
        const int64_t tile = (int64_t)(KVF_BLOCK / (s->head_dim / KVF_VEC)) * KVF_DECODE_RPT * s->plan.sec[t].decode_tiles;
        p.blocks[t] = blocks_for(sh->n_tokens, tile);
    }
    return launch(ctx, KVF_R_DECODE, p.blocks[0] + p.blocks[1], (unsigned)sh->n_heads, KVF_BLOCK, 0, &p, stream);
}

/* ---------------------------------------------------- query statistics */

int kvf_gpu_qstats_init(kvf_context *ctx, void *qstats, size_t total, const kvf_qstats_layout *ql, void *stream) {
    const struct kvf_qstats_init_params p = {dptr(qstats), total, qstats_planes(ql)};
    const unsigned grid = blocks_for((int64_t)(total / 8), KVF_BLOCK);
    return launch1(ctx, KVF_R_QSTATS_INIT, grid > 1024 ? 1024 : grid, &p, stream);
}

int kvf_gpu_qstats_update(kvf_context *ctx, void *qstats, const kvf_qstats_layout *ql, const void *q,
                          const kvf_shape *sh, int group, void *stream) {
    const struct kvf_qstats_update_params p = {{dptr(q), sh->token_stride, sh->head_stride}, (int)sh->n_tokens, group,
                                               dptr(qstats), qstats_planes(ql)};
    /* Both kernels test each query row for NaN/Inf: accumulate leaves such rows
     * out of the sums, eigen counts the others (the count is known only there).
     * accumulate's grid: the tiles on or above the diagonal of M, per KV head. */
    const unsigned side = (unsigned)(ctx->scheme->head_dim / KVF_QSTATS_TILE), tiles = side * (side + 1) / 2;
    int rc = launch(ctx, KVF_R_QSTATS_ACCUMULATE, tiles, (unsigned)ql->n_heads, KVF_BLOCK, 0, &p, stream);
    return rc ? rc : launch1(ctx, KVF_R_QSTATS_EIGEN, (unsigned)ql->n_heads, &p, stream);
}
