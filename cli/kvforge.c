/* kvforge command line: gen, compile, export, info, cache, demo, eval. */
#include "gpu/cuda_api.h"
#include "eval.h"
#include "gen.h"
#include "gpu/jit.h"
#include "cpu/ref.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int usage(void) {
    fputs("usage:\n"
          "  kvforge gen SCHEME.lua [-o DIR]                 write the generated CUDA, C and header\n"
          "  kvforge compile SCHEME.lua [--arch sm_90,...] [--resources]\n"
          "                                                  NVRTC compile only (no GPU needed; compute_XX: PTX);\n"
          "                                                  --resources: ptxas's registers/spills/static shared\n"
          "                                                  memory per kernel\n"
          "  kvforge export SCHEME.lua --arch sm_80,sm_90 -o DIR   fatbin + C/header embedding it\n"
          "  kvforge info SCHEME.lua                         canonical configuration and footprint\n"
          "  kvforge cache list | cache clear | cache dir    the JIT disk cache\n"
          "  kvforge demo [SCHEME.lua] [--cpu]                encode/decode a synthetic chunk\n"
          "  kvforge eval --scheme SCHEME.lua --data DUMP.safetensors [--gpu] [--json] [--threads N] [--warm]\n"
          "               [--write-recon RECON.safetensors]\n"
          "                                                  attention-level quality on a KV dump; --warm:\n"
          "                                                  k-means warm-started from the previous span;\n"
          "                                                  --write-recon: the scheme's cache as a recon file\n"
          "  kvforge eval --peer RECON.safetensors --data DUMP.safetensors [--json] [--threads N]\n"
          "                                                  the same metrics for another system's cache\n"
          "                                                  (docs/QUALITY.md, eval/peer/)\n"
          "A SCHEME is a file path, or the name of a shipped scheme (rtn_int2).\n",
          stderr);
    return 2;
}

static int fail(int rc) {
    fprintf(stderr, "kvforge: %s: %s\n", kvf_strerror(rc), kvf_last_error());
    return 1;
}

static int load_scheme(const char *arg, kvf_scheme **s) {
    if (strchr(arg, '/') || strstr(arg, ".lua") || access(arg, F_OK) == 0) return kvf_scheme_load(arg, s);
    return kvf_scheme_load_builtin(arg, s);
}

/* Split "sm_80,sm_90" in place. */
static int split_archs(char *list, const char **archs, int max) {
    int n = 0;
    for (char *tok = strtok(list, ","); tok && n < max; tok = strtok(NULL, ",")) archs[n++] = tok;
    return n;
}

static const char *opt_value(int argc, char **argv, const char *name, const char *def) {
    for (int i = 0; i + 1 < argc; i++)
        if (!strcmp(argv[i], name)) return argv[i + 1];
    return def;
}

static int has_flag(int argc, char **argv, const char *name) {
    for (int i = 0; i < argc; i++)
        if (!strcmp(argv[i], name)) return 1;
    return 0;
}

static int cmd_gen(int argc, char **argv) {
    if (argc < 1) return usage();
    kvf_scheme *s;
    int rc = load_scheme(argv[0], &s);
    if (rc) return fail(rc);
    const char *dir = opt_value(argc, argv, "-o", "out/gen");
    kvf_gen_output g;
    if (!(rc = kvf_gen(s, &g))) {
        rc = kvf_gen_write(&g, dir);
        if (!rc) printf("wrote %s/%s, %s/%s, %s/%s\n", dir, g.cu_name, dir, g.c_name, dir, g.h_name);
        kvf_gen_output_free(&g);
    }
    kvf_scheme_free(s);
    return rc ? fail(rc) : 0;
}

/* The scheme named by argv[0] and the --arch list (default sm_80,sm_90):
 * spec as given, archs split from a copy of it. */
typedef struct arch_job { kvf_scheme *s; const char *spec; char list[256]; const char *archs[16]; int n; } arch_job;

static int arch_job_open(int argc, char **argv, arch_job *j) {
    int rc = load_scheme(argv[0], &j->s);
    if (rc) return rc;
    j->spec = opt_value(argc, argv, "--arch", "sm_80,sm_90");
    snprintf(j->list, sizeof j->list, "%s", j->spec);
    j->n = split_archs(j->list, j->archs, 16);
    return KVF_OK;
}

/* ptxas's report per kernel for each arch (kvf_jit_usage). */
static int print_usage_report(kvf_scheme *s, const arch_job *j) {
    int rc = KVF_OK;
    char prefix[160];
    snprintf(prefix, sizeof prefix, "kvf_%s_", kvf_scheme_id(s));
    for (int i = 0; i < j->n && !rc; i++) {
        kvf_kernel_usage *u;
        int n;
        if ((rc = kvf_jit_usage(s, j->archs[i], &u, &n, NULL))) break;
        printf("%s %s: %d kernels (ptxas report of the NVRTC compile of its programs)\n", kvf_scheme_id(s),
               j->archs[i], n);
        printf("  %-26s %9s %8s %12s %11s %12s\n", "kernel", "registers", "barriers", "spills st/ld", "stack bytes",
               "static smem");
        for (int k = 0; k < n; k++) {
            const char *name = strncmp(u[k].name, prefix, strlen(prefix)) ? u[k].name : u[k].name + strlen(prefix);
            char spills[32];
            snprintf(spills, sizeof spills, "%ld/%ld", u[k].spill_stores, u[k].spill_loads);
            printf("  %-26s %9d %8d %12s %11ld %12ld\n", name, u[k].registers, u[k].barriers, spills, u[k].stack,
                   u[k].smem);
        }
        free(u);
    }
    return rc;
}

static int cmd_compile(int argc, char **argv) {
    if (argc < 1) return usage();
    arch_job j;
    int rc = arch_job_open(argc, argv, &j);
    if (rc) return fail(rc);
    kvf_scheme *s = j.s;
    if (has_flag(argc, argv, "--resources")) {
        rc = print_usage_report(s, &j);
        kvf_scheme_free(s);
        return rc ? fail(rc) : 0;
    }
    for (int i = 0; i < j.n && !rc; i++) {
        kvf_jit_images im;
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        const int ptx = !strncmp(j.archs[i], "compute_", 8); /* a virtual arch: PTX */
        rc = kvf_jit_programs(s, j.archs[i], ptx, &im); /* what a context loads */
        clock_gettime(CLOCK_MONOTONIC, &t1);
        if (!rc) {
            size_t bytes = 0;
            for (int p = 0; p < im.n; p++) bytes += ptx ? strlen(im.image[p]) : im.size[p];
            printf("%s %s: %d program%s, %zu bytes of %s from %s in %.1f ms\n", kvf_scheme_id(s), j.archs[i], im.n,
                   im.n > 1 ? "s" : "", bytes, ptx ? "PTX" : "cubin", im.origin,
                   (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6);
            kvf_jit_images_free(&im);
        }
    }
    kvf_scheme_free(s);
    return rc ? fail(rc) : 0;
}

static int cmd_export(int argc, char **argv) {
    if (argc < 1) return usage();
    arch_job j;
    int rc = arch_job_open(argc, argv, &j);
    if (rc) return fail(rc);
    kvf_scheme *s = j.s;
    const char *dir = opt_value(argc, argv, "-o", "out/export");
    rc = kvf_export(s, j.archs, j.n, dir);
    if (!rc) printf("exported %s for %s to %s (%s.fatbin, %s_aot.c/.h, %s.c/.h)\n", kvf_scheme_id(s), j.spec, dir,
                    kvf_scheme_id(s), kvf_scheme_id(s), kvf_scheme_id(s));
    kvf_scheme_free(s);
    return rc ? fail(rc) : 0;
}

static int cmd_info(int argc, char **argv) {
    if (argc < 1) return usage();
    kvf_scheme *s;
    int rc = load_scheme(argv[0], &s);
    if (rc) return fail(rc);
    printf("-- %s (id %s)\n%s", argv[0], kvf_scheme_id(s), kvf_scheme_canonical(s));
    static const int64_t spans[] = {4680, 37440};
    for (int i = 0; i < 2; i++) {
        kvf_footprint f;
        if (kvf_footprint_of(s, spans[i], 1, &f) == KVF_OK)
            printf("-- %lld tokens x 1 head: %zu bytes packed, %zu BF16, %.3fx, %.3f bits/value\n",
                   (long long)spans[i], f.packed_bytes, f.bf16_bytes, f.compression, f.bits_per_value);
    }
    kvf_scheme_free(s);
    return 0;
}

static int cmd_cache(int argc, char **argv) {
    if (argc < 1) return usage();
    int rc;
    if (!strcmp(argv[0], "list")) rc = kvf_cache_list(stdout);
    else if (!strcmp(argv[0], "clear")) rc = kvf_cache_clear();
    else if (!strcmp(argv[0], "dir")) {
        char dir[4096];
        rc = kvf_cache_dir(dir, sizeof dir);
        if (!rc) puts(*dir ? dir : "(disk cache off)");
    } else return usage();
    return rc ? fail(rc) : 0;
}

/* ------------------------------------------------------------------ demo */

typedef struct demo_err { double sq_err, sq_ref, max_abs; } demo_err;

static demo_err compare(const uint16_t *x, const uint16_t *y, size_t n) {
    demo_err e = {0, 0, 0};
    for (size_t i = 0; i < n; i++) {
        double a = kvf_bf16_to_f32(x[i]), d = kvf_bf16_to_f32(y[i]) - a;
        e.sq_err += d * d;
        e.sq_ref += a * a;
        if (fabs(d) > e.max_abs) e.max_abs = fabs(d);
    }
    return e;
}

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

/* Round trip through a device: copies in, encode, decode, copies out. */
static int demo_gpu(kvf_context *ctx, const uint16_t *k, const uint16_t *v, const uint16_t *q, const kvf_shape *sh,
                    const int32_t *pos, size_t pos_bytes, size_t packed_bytes, uint16_t *k2, uint16_t *v2,
                    double *ms) {
    const kvf_cuda_api *cu;
    int rc = kvf_cuda_load(&cu);
    if (rc) return rc;
    size_t n = (size_t)sh->n_tokens * sh->n_heads * kvf_scheme_head_dim(kvf_context_scheme(ctx)) * 2;
    CUcontext pctx, popped;
    CUdevice dev;
    CUdeviceptr dk = 0, dv = 0, dp = 0, dk2 = 0, dv2 = 0;
    KVF_CU(cu, 0, cuDeviceGet(&dev, 0));
    KVF_CU(cu, 0, cuDevicePrimaryCtxRetain(&pctx, dev));
    KVF_CU(cu, 0, cuCtxPushCurrent(pctx));
    KVF_CU(cu, 0, cuMemAlloc(&dk, n));
    KVF_CU(cu, 0, cuMemAlloc(&dv, n));
    KVF_CU(cu, 0, cuMemAlloc(&dk2, n));
    KVF_CU(cu, 0, cuMemAlloc(&dv2, n));
    KVF_CU(cu, 0, cuMemAlloc(&dp, packed_bytes));
    KVF_CU(cu, 0, cuMemcpyHtoD(dk, k, n));
    KVF_CU(cu, 0, cuMemcpyHtoD(dv, v, n));
    CUdeviceptr dpos = 0;
    if (pos) {
        KVF_CU(cu, 0, cuMemAlloc(&dpos, pos_bytes));
        KVF_CU(cu, 0, cuMemcpyHtoD(dpos, pos, pos_bytes));
    }
    CUdeviceptr dq = 0, dqs = 0;
    size_t qbytes = 0;
    if (q) { /* statistics of the previous chunk's queries */
        if ((rc = kvf_qstats_size(kvf_context_scheme(ctx), sh->n_heads, &qbytes))) return rc;
        KVF_CU(cu, 0, cuMemAlloc(&dq, n));
        KVF_CU(cu, 0, cuMemAlloc(&dqs, qbytes));
        KVF_CU(cu, 0, cuMemcpyHtoD(dq, q, n));
        if ((rc = kvf_qstats_init(ctx, (void *)dqs, qbytes, sh->n_heads, NULL)) ||
            (rc = kvf_qstats_update(ctx, (void *)dqs, qbytes, (void *)dq, sh, NULL)))
            return rc;
    }
    double t0 = now_ms();
    if (!(rc = kvf_encode(ctx, (void *)dk, (void *)dv, sh, q ? (void *)dqs : NULL, (void *)dp, packed_bytes, NULL)))
        rc = kvf_decode(ctx, (void *)dp, packed_bytes, sh, pos ? (const int32_t *)dpos : NULL, (void *)dk2,
                        (void *)dv2, NULL);
    if (rc) return rc;
    KVF_CU(cu, 0, cuCtxSynchronize());
    *ms = now_ms() - t0;
    KVF_CU(cu, 0, cuMemcpyDtoH(k2, dk2, n));
    KVF_CU(cu, 0, cuMemcpyDtoH(v2, dv2, n));
    cu->cuMemFree(dk); cu->cuMemFree(dv); cu->cuMemFree(dk2); cu->cuMemFree(dv2); cu->cuMemFree(dp);
    if (dq) { cu->cuMemFree(dq); cu->cuMemFree(dqs); }
    if (dpos) cu->cuMemFree(dpos);
    cu->cuCtxPopCurrent(&popped);
    cu->cuDevicePrimaryCtxRelease(dev);
    return KVF_OK;
}

/* Token positions of the demo's chunk for a scheme that caches keys before
 * RoPE (METHODS.md 6): int32 [tokens][axes]. One axis: the token's index;
 * more: (frame, row, column) of a 480p latent grid of 30 x 52 patches, 1560
 * tokens a frame, further axes 0. */
static int32_t *demo_positions(int64_t tokens, int axes) {
    int32_t *p = malloc((size_t)tokens * axes * sizeof *p);
    if (!p) return NULL;
    for (int64_t t = 0; t < tokens; t++)
        for (int a = 0; a < axes; a++) {
            int64_t r = t % 1560, v = axes == 1 ? t : a == 0 ? t / 1560 : a == 1 ? r / 52 : a == 2 ? r % 52 : 0;
            p[t * axes + a] = (int32_t)v;
        }
    return p;
}

/* The keys the decode should give back for a pre-RoPE scheme: the input keys
 * turned by the same RoPE (the CPU reference's), [heads][tokens][d]. */
static void demo_rope_keys(const kvf_scheme *s, uint16_t *k, int64_t tokens, int heads, const int32_t *pos) {
    const int d = s->head_dim, axes = s->rope.n_sections < 1 ? 1 : s->rope.n_sections;
    float x[KVF_REF_MAX_DIM];
    for (int h = 0; h < heads; h++)
        for (int64_t t = 0; t < tokens; t++) {
            uint16_t *row = k + ((size_t)h * tokens + t) * d;
            for (int c = 0; c < d; c++) x[c] = kvf_bf16_to_f32(row[c]);
            kvf_ref_rope(x, d, &s->rope, pos + t * axes);
            for (int c = 0; c < d; c++) row[c] = kvf_f32_to_bf16(x[c]);
        }
}

static int cmd_demo(int argc, char **argv) {
    const char *path = argc > 0 && argv[0][0] != '-' ? argv[0] : "schemes/quantwm_int2.lua";
    kvf_scheme *s;
    int rc = load_scheme(path, &s);
    if (rc) return fail(rc);
    const int heads = 8, d = kvf_scheme_head_dim(s);
    const int64_t tokens = 4680; /* 3 frames x 1560 tokens: one chunk at 480p */
    kvf_shape sh = {tokens, heads, 0, 0};
    size_t n = (size_t)tokens * heads * d, packed_bytes;
    if ((rc = kvf_packed_size(s, tokens, heads, &packed_bytes))) return fail(rc);
    uint16_t *k = malloc(n * 2), *v = malloc(n * 2), *k2 = malloc(n * 2), *v2 = malloc(n * 2);
    uint8_t *packed = malloc(packed_bytes);
    if (!k || !v || !k2 || !v2 || !packed) return fail(kvf_set_error(KVF_ENOMEM, "demo buffers"));
    kvf_synth_kv(k, tokens, heads, d, 1);
    kvf_synth_kv(v, tokens, heads, d, 2);
    uint16_t *q = NULL;
    if (kvf_scheme_reads_qstats(s)) {
        q = malloc(n * 2);
        if (!q) return fail(kvf_set_error(KVF_ENOMEM, "demo buffers"));
        kvf_synth_kv(q, tokens, heads, d, 3);
    }
    /* Keys cached before RoPE: the decode turns them, and needs the positions. */
    const int pre = s->rope.placement == KVF_ROPE_PRE, axes = s->rope.n_sections < 1 ? 1 : s->rope.n_sections;
    int32_t *pos = NULL;
    if (pre && !(pos = demo_positions(tokens, axes))) return fail(kvf_set_error(KVF_ENOMEM, "demo positions"));
    const size_t pos_bytes = (size_t)tokens * axes * sizeof(int32_t);

    int count = 0, want_cpu = has_flag(argc, argv, "--cpu");
    kvf_context *ctx = NULL;
    char why[600] = "--cpu given";
    if (!want_cpu) {
        rc = kvf_device_count(&count);
        if (rc) snprintf(why, sizeof why, "%s", kvf_last_error());
        else if ((rc = kvf_context_create(s, 0, &ctx))) return fail(rc);
    }
    double ms = 0;
    if (ctx) {
        printf("backend: GPU %s (kernels from %s)\n", kvf_context_backend(ctx), kvf_context_origin(ctx));
        if ((rc = demo_gpu(ctx, k, v, q, &sh, pos, pos_bytes, packed_bytes, k2, v2, &ms))) return fail(rc);
    } else {
        printf("backend: CPU reference (no GPU: %s)\n", why);
        if ((rc = kvf_context_create(s, KVF_DEVICE_CPU, &ctx))) return fail(rc);
        void *qs = NULL;
        size_t qbytes = 0;
        if (q && (!(rc = kvf_qstats_size(s, heads, &qbytes)) && !(qs = aligned_alloc(256, (qbytes + 255) & ~(size_t)255))))
            rc = kvf_set_error(KVF_ENOMEM, "demo query statistics");
        if (rc || (q && ((rc = kvf_qstats_init(ctx, qs, qbytes, heads, NULL)) ||
                         (rc = kvf_qstats_update(ctx, qs, qbytes, q, &sh, NULL)))))
            return fail(rc);
        double t0 = now_ms();
        if ((rc = kvf_encode(ctx, k, v, &sh, qs, packed, packed_bytes, NULL)) ||
            (rc = kvf_decode(ctx, packed, packed_bytes, &sh, pos, k2, v2, NULL)))
            return fail(rc);
        ms = now_ms() - t0;
        free(qs);
    }
    if (q) printf("query statistics: from one earlier synthetic chunk of queries (QSAC weights, PSAC basis)\n");
    free(q);
    if (pre) {
        demo_rope_keys(s, k, tokens, heads, pos);
        printf("RoPE: keys cached before RoPE; decode turned them with %d-axis positions (%s), compared with "
               "the input keys turned the same way\n", axes, axes == 1 ? "token index" : "frame, row, column");
    }
    free(pos);
    kvf_footprint f;
    kvf_footprint_of(s, tokens, heads, &f);
    demo_err ek = compare(k, k2, n), ev = compare(v, v2, n);
    printf("scheme: %s (%s)\n", kvf_scheme_id(s), path);
    printf("chunk: %lld tokens x %d heads x d=%d, synthetic video-like K/V (per-token scale, moving outlier channels)\n",
           (long long)tokens, heads, d);
    printf("stored: %zu bytes for %zu BF16 bytes: compression %.2fx (%.2f bits per value)\n", f.packed_bytes,
           f.bf16_bytes, f.compression, f.bits_per_value);
    printf("K: relative error %.4f, MSE %.5f, max |err| %.3f\n", sqrt(ek.sq_err / ek.sq_ref), ek.sq_err / n, ek.max_abs);
    printf("V: relative error %.4f, MSE %.5f, max |err| %.3f\n", sqrt(ev.sq_err / ev.sq_ref), ev.sq_err / n, ev.max_abs);
    printf("encode + decode: %.2f ms (wall clock, %s)\n", ms, kvf_context_backend(ctx));
    kvf_context_destroy(ctx);
    kvf_scheme_free(s);
    free(k); free(v); free(k2); free(v2); free(packed);
    return 0;
}

/* ------------------------------------------------------------------ eval */

typedef struct eval_args { const char *scheme, *peer, *data, *recon_out; int gpu, json, threads, warm; } eval_args;

static int parse_eval_args(int argc, char **argv, eval_args *a) {
    memset(a, 0, sizeof *a);
    for (int i = 0; i < argc; i++) {
        const char *o = argv[i];
        if (!strcmp(o, "--gpu")) a->gpu = 1;
        else if (!strcmp(o, "--json")) a->json = 1;
        else if (!strcmp(o, "--warm")) a->warm = 1;
        else if (i + 1 < argc && !strcmp(o, "--scheme")) a->scheme = argv[++i];
        else if (i + 1 < argc && !strcmp(o, "--data")) a->data = argv[++i];
        else if (i + 1 < argc && !strcmp(o, "--peer")) a->peer = argv[++i];
        else if (i + 1 < argc && !strcmp(o, "--write-recon")) a->recon_out = argv[++i];
        else if (i + 1 < argc && !strcmp(o, "--threads")) {
            long long n;
            if (!kvf_parse_int(argv[++i], 1, KVF_MAX_THREADS, &n)) {
                fprintf(stderr, "kvforge eval: --threads %s: must be an integer in 1..%d\n", argv[i], KVF_MAX_THREADS);
                return 2;
            }
            a->threads = (int)n;
        } else {
            fprintf(stderr, "kvforge eval: unknown or incomplete option '%s'\n", o);
            return usage();
        }
    }
    if (!a->scheme == !a->peer || !a->data) {
        fputs("kvforge eval: --data and one of --scheme or --peer are required\n", stderr);
        return usage();
    }
    if (a->peer && (a->gpu || a->warm || a->recon_out)) {
        fprintf(stderr, "kvforge eval: --peer takes no %s: the recon file holds the peer's decoded cache\n",
                a->gpu ? "--gpu" : a->warm ? "--warm" : "--write-recon");
        return 2;
    }
    return 0;
}

static int print_report(const kvf_eval_report *r, int json) {
    if (!json) {
        kvf_eval_print_table(r, stdout);
        return 0;
    }
    char *text = kvf_eval_report_json(r);
    if (!text) return fail(kvf_set_error(KVF_ENOMEM, "cannot build the JSON report"));
    puts(text);
    free(text);
    return 0;
}

static int cmd_eval(int argc, char **argv) {
    eval_args a;
    int rc = parse_eval_args(argc, argv, &a);
    if (rc) return rc;
    kvf_scheme *s = NULL;
    kvf_recon *recon = NULL;
    if ((rc = a.peer ? kvf_recon_open(a.peer, &recon) : load_scheme(a.scheme, &s))) return fail(rc);
    kvf_dump *d;
    if ((rc = kvf_dump_open(a.data, &d))) {
        kvf_scheme_free(s);
        kvf_recon_close(recon);
        return fail(rc);
    }
    kvf_eval_options opt = {a.gpu ? 0 : KVF_DEVICE_CPU, a.threads, a.warm, a.recon_out};
    kvf_eval_report r;
    rc = recon ? kvf_eval_run_peer(recon, d, &opt, &r) : kvf_eval_run(s, d, &opt, &r);
    kvf_dump_close(d);
    kvf_scheme_free(s);
    kvf_recon_close(recon);
    if (rc) return fail(rc);
    int status = print_report(&r, a.json);
    kvf_eval_report_free(&r);
    return status;
}

int main(int argc, char **argv) {
    if (argc < 2) return usage();
    const char *cmd = argv[1];
    argc -= 2;
    argv += 2;
    if (!strcmp(cmd, "gen")) return cmd_gen(argc, argv);
    if (!strcmp(cmd, "compile")) return cmd_compile(argc, argv);
    if (!strcmp(cmd, "export")) return cmd_export(argc, argv);
    if (!strcmp(cmd, "info")) return cmd_info(argc, argv);
    if (!strcmp(cmd, "cache")) return cmd_cache(argc, argv);
    if (!strcmp(cmd, "demo")) return cmd_demo(argc, argv);
    if (!strcmp(cmd, "eval")) return cmd_eval(argc, argv);
    if (!strcmp(cmd, "version") || !strcmp(cmd, "--version")) { puts(KVF_VERSION_STRING); return 0; }
    return usage();
}
