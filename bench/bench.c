/*
 * kvforge benchmark: on the GPU, the device-to-device copy ceiling, then
 * every scheme's encode and decode of one LongCat-sized layer (K and V of 32
 * heads x 29640 tokens x d = 128, heterogeneous data as docs/BACKGROUND.md
 * section 1), and the JIT costs. One table: times, GB/s, fraction of the copy
 * ceiling and of the write-only ceiling (cuMemsetD32 over the bytes the decode
 * writes), ratio to QVG's figures (docs/BACKGROUND.md section 5: encode
 * 4.77 ms, decode 0.44 ms on an H200).
 * Beside the ceilings it prints the INT2 decode probe (bench/kvf_probe.cuh):
 * an INT2 decode's bytes read and written with no arithmetic to speak of.
 * bench/sdpa.py measures the BF16 SDPA ceiling and decode + SDPA.
 *   out/bin/kvf_bench [--tokens N] [--heads H] [--reps R] [--no-probe] [--data FILE] [--assign A] [SCHEME ...]
 * --no-probe leaves the probe out (tools/gpu/h200_validate.sh's ncu profile of
 * the schemes' kernels, which the probe's launches would only lengthen).
 * --data FILE takes K and V from layer 0 of a world-model dump (eval/dump.h)
 * instead of kvf_synth_kv: the synthetic layer sends almost no assignment
 * tile through the k-means filter's f64 path, the dump's values most of them
 * (tools/gpu/assign_candidates.py). The dump's heads and tokens are tiled over
 * the layer's (data_fill).
 * --assign fast|exact|both sets the k-means sections' assign field (the
 * schemes' own by default): both runs each scheme twice in this process, the
 * fast assignment, then the exact one (the row "<scheme>/exact").
 */
#include "gpu/cuda_api.h"
#include "dump.h"
#include "gen.h"
#include "gpu/jit.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CK(call)                                                                             \
    do {                                                                                     \
        CUresult r_ = cu->call;                                                              \
        if (r_ != CUDA_SUCCESS) {                                                            \
            kvf_cuda_fail(r_, #call, __FILE__, __LINE__, 0);                                 \
            fprintf(stderr, "kvf_bench: %s\n", kvf_last_error());                            \
            exit(1);                                                                         \
        }                                                                                    \
    } while (0)

static const kvf_cuda_api *cu;

static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

typedef int (*bench_fn)(void *arg);

/* Two warm-up calls, then reps timed ones between events a and b into t. */
static int timed_calls(bench_fn fn, void *arg, int reps, CUevent a, CUevent b, float *t) {
    int rc;
    for (int i = 0; i < 2; i++)
        if ((rc = fn(arg))) return rc;
    for (int i = 0; i < reps; i++) {
        KVF_CU(cu, 0, cuEventRecord(a, NULL));
        if ((rc = fn(arg))) return rc;
        KVF_CU(cu, 0, cuEventRecord(b, NULL));
        KVF_CU(cu, 0, cuEventSynchronize(b));
        KVF_CU(cu, 0, cuEventElapsedTime(&t[i], a, b));
    }
    return KVF_OK;
}

/* Median of reps timings (ms) into *ms: KVF_OK, or the first failure (fn's
 * status, or the driver call's, a fault in fn's kernels included). */
static int time_try(bench_fn fn, void *arg, int reps, float *ms) {
    CUevent a = NULL, b = NULL;
    float t[256];
    if (reps > 256) reps = 256;
    CUresult r = cu->cuEventCreate(&a, 0);
    if (r == CUDA_SUCCESS) r = cu->cuEventCreate(&b, 0);
    int rc = r == CUDA_SUCCESS ? timed_calls(fn, arg, reps, a, b, t)
                               : kvf_cuda_fail(r, "cuEventCreate", __FILE__, __LINE__, 0);
    if (a) cu->cuEventDestroy(a);
    if (b) cu->cuEventDestroy(b);
    if (rc) return rc;
    qsort(t, (size_t)reps, sizeof *t, cmp_float);
    *ms = t[reps / 2];
    return KVF_OK;
}

/* time_try, and the bench ends on a failure. */
static float time_median(bench_fn fn, void *arg, int reps) {
    float ms;
    if (time_try(fn, arg, reps, &ms)) {
        fprintf(stderr, "kvf_bench: %s\n", kvf_last_error());
        exit(1);
    }
    return ms;
}

typedef struct copy_arg { CUdeviceptr dst, src; size_t n; } copy_arg;
static int do_copy(void *p) {
    copy_arg *c = p;
    KVF_CU(cu, 0, cuMemcpyDtoDAsync(c->dst, c->src, c->n, NULL));
    return KVF_OK;
}

/* Write-only ceiling: a memset of n bytes (n a multiple of 4). */
static int do_fill(void *p) {
    copy_arg *c = p;
    KVF_CU(cu, 0, cuMemsetD32Async(c->dst, 0x3f803f80u, c->n / 4, NULL));
    return KVF_OK;
}

typedef struct codec_arg {
    kvf_context *ctx;
    CUdeviceptr k, v, packed, k2, v2, qs, pos;
    size_t packed_bytes, qs_bytes;
    kvf_shape sh, qsh; /* qsh: one chunk of queries (the first 4680 rows of K) */
    /* the pipeline (NULL: none): a span coded against an anchor span, carrying
     * the error of the one before, with a channel map */
    const kvf_encode_args *ea;
    const kvf_decode_args *da;
} codec_arg;

static int do_encode(void *p) {
    codec_arg *c = p;
    if (c->ea) {
        kvf_encode_args a = *c->ea;
        a.qstats = c->qs ? (void *)c->qs : NULL;
        return kvf_encode_ex(c->ctx, (void *)c->k, (void *)c->v, &c->sh, &a, (void *)c->packed, c->packed_bytes, NULL);
    }
    return kvf_encode(c->ctx, (void *)c->k, (void *)c->v, &c->sh, c->qs ? (void *)c->qs : NULL, (void *)c->packed,
                      c->packed_bytes, NULL);
}

/* One chunk's update of the query statistics (warm: 6 iterations per head). */
static int do_qstats(void *p) {
    codec_arg *c = p;
    return kvf_qstats_update(c->ctx, (void *)c->qs, c->qs_bytes, (void *)c->k, &c->qsh, NULL);
}

static int do_decode(void *p) {
    codec_arg *c = p;
    if (c->da) {
        kvf_decode_args a = *c->da;
        a.positions = c->pos ? (int32_t *)c->pos : NULL;
        return kvf_decode_ex(c->ctx, (void *)c->packed, c->packed_bytes, &c->sh, &a, (void *)c->k2, (void *)c->v2, NULL);
    }
    return kvf_decode(c->ctx, (void *)c->packed, c->packed_bytes, &c->sh, c->pos ? (int32_t *)c->pos : NULL,
                      (void *)c->k2, (void *)c->v2, NULL);
}

/* The INT2 decode probe (bench/kvf_probe.cuh, embedded by the Makefile): an
 * INT2 decode's bytes with no arithmetic to speak of, without and with a
 * centroid gather; the same bytes read and written by separate blocks; the
 * rows' stores alone. */
enum { PROBE_PLAIN, PROBE_GATHER, PROBE_SPLIT, PROBE_WRITE, PROBE_N };
typedef struct probe_arg {
    CUfunction fn;
    CUdeviceptr codes, sz, idx, table, out;
    unsigned n, grid_x, grid_y, block;
} probe_arg;

static int do_probe(void *p) {
    probe_arg *a = p;
    void *args[] = {&a->codes, &a->sz, &a->idx, &a->table, &a->out, &a->n};
    KVF_CU(cu, 0, cuLaunchKernel(a->fn, a->grid_x, a->grid_y, 2, a->block, 1, 1, 0, NULL, args, NULL));
    return KVF_OK;
}

/* What probe_ceilings holds, freed by probe_free whatever happened. */
typedef struct probe_state {
    probe_arg a;
    CUmodule mod;
    void *image;
    unsigned char *idx;
} probe_state;

static void probe_free(probe_state *st) {
    free(st->idx);
    free(st->image);
    CUdeviceptr bufs[4] = {st->a.codes, st->a.sz, st->a.idx, st->a.table};
    for (int i = 0; i < 4; i++)
        if (bufs[i]) cu->cuMemFree(bufs[i]);
    if (st->mod) cu->cuModuleUnload(st->mod);
}

/* probe_ceilings' work: compile and load the probe, fill its inputs, time
 * its kernels. */
static int probe_run(probe_state *st, CUdevice dev, int64_t tokens, int heads, int reps, double bw[PROBE_N],
                     float ms[PROBE_N]) {
    int major, minor, ptx, rc;
    char arch[32];
    size_t size;
    probe_arg *a = &st->a;
    const size_t rows = (size_t)tokens * heads * 2;
    if (!(st->idx = malloc(rows))) return kvf_set_error(KVF_ENOMEM, "kvf_bench: probe: out of memory");
    KVF_CU(cu, 0, cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev));
    KVF_CU(cu, 0, cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev));
    if ((rc = kvf_nvrtc_pick_arch(major, minor, arch, sizeof arch, &ptx)) ||
        (rc = kvf_nvrtc_compile(kvf_bench_probe[0].data, "kvf_probe.cu", arch, ptx, &st->image, &size)))
        return rc;
    KVF_CU(cu, 0, cuModuleLoadData(&st->mod, st->image));
    CUdeviceptr geometry;
    size_t geometry_bytes;
    unsigned g[7]; /* kvf_probe::BLOCK, TILE, CODE_BYTES, SZ_BYTES, ROW_BYTES, TABLE_ROWS, SPLIT */
    KVF_CU(cu, 0, cuModuleGetGlobal(&geometry, &geometry_bytes, st->mod, "kvf_probe_geometry"));
    if (geometry_bytes != sizeof g)
        return kvf_set_error(KVF_EFORMAT, "kvf_bench: probe: kvf_probe_geometry has %zu bytes", geometry_bytes);
    KVF_CU(cu, 0, cuMemcpyDtoH(g, geometry, sizeof g));
    /* Its output rows are the bench's layer's (d = 128 BF16), its indices bytes. */
    if (g[4] != 256 || g[5] != 256)
        return kvf_set_error(KVF_EFORMAT, "kvf_bench: probe: rows of %u bytes and tables of %u rows, not 256 and 256",
                             g[4], g[5]);
    a->block = g[0];
    const int64_t tiles = (tokens + g[1] - 1) / g[1];
    const unsigned grid_x[PROBE_N] = {(unsigned)tiles, (unsigned)tiles,
                                      (unsigned)((tiles + g[6] - 1) / g[6] * (g[6] + 1)),
                                      (unsigned)((tokens * (g[4] / 16) + g[0] - 1) / g[0])};
    const size_t code_bytes = g[2], sz_bytes = g[3], table_bytes = (size_t)heads * 2 * g[5] * g[4];
    KVF_CU(cu, 0, cuMemAlloc(&a->codes, rows * code_bytes));
    KVF_CU(cu, 0, cuMemAlloc(&a->sz, rows * sz_bytes));
    KVF_CU(cu, 0, cuMemAlloc(&a->idx, rows));
    KVF_CU(cu, 0, cuMemAlloc(&a->table, table_bytes));
    KVF_CU(cu, 0, cuMemsetD8(a->codes, 0x5a, rows * code_bytes));
    KVF_CU(cu, 0, cuMemsetD8(a->sz, 0x3c, rows * sz_bytes));
    KVF_CU(cu, 0, cuMemsetD8(a->table, 0x3f, table_bytes));
    for (size_t r = 0; r < rows; r++) st->idx[r] = (unsigned char)((r * 2654435761u) >> 13); /* scattered */
    KVF_CU(cu, 0, cuMemcpyHtoD(a->idx, st->idx, rows));
    const char *names[PROBE_N] = {"kvf_probe_int2", "kvf_probe_int2_gather", "kvf_probe_int2_split",
                                  "kvf_probe_write"};
    for (int k = 0; k < PROBE_N; k++) {
        KVF_CU(cu, 0, cuModuleGetFunction(&a->fn, st->mod, names[k]));
        a->grid_x = grid_x[k];
        if ((rc = time_try(do_probe, a, reps, &ms[k]))) return rc;
        double bytes = (double)rows * (code_bytes + sz_bytes + g[4]);
        if (k == PROBE_GATHER) bytes += rows + (double)table_bytes;
        if (k == PROBE_WRITE) bytes = (double)rows * g[4];
        bw[k] = bytes / (ms[k] * 1e-3) / 1e9;
    }
    return KVF_OK;
}

/* Times the probe's kernels (PROBE_*) over K and V of the layer into out (2
 * x heads x tokens rows of 256 bytes: the decode's output size). bw: GB/s
 * counting the bytes read (with the gather, each head's 64 KiB table once, as
 * the decode's packed bytes count its centroids) and written; ms: median times.
 * KVF_OK, or why the probe could not run (the bench then goes on without it). */
static int probe_ceilings(CUdevice dev, int64_t tokens, int heads, CUdeviceptr out, int reps, double bw[PROBE_N],
                          float ms[PROBE_N]) {
    probe_state st = {.a = {.n = (unsigned)tokens, .grid_y = (unsigned)heads, .out = out}};
    int rc = probe_run(&st, dev, tokens, heads, reps, bw, ms);
    probe_free(&st);
    return rc;
}

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static int usage(const char *what, const char *arg) {
    fprintf(stderr,
            "kvf_bench: %s%s%s\nusage: kvf_bench [--tokens N] [--heads H] [--reps R] [--no-probe] [--data FILE] "
            "[--assign A] [SCHEME ...]\n"
            "  N 1..1048576 tokens a head (29640), H 1..1024 heads (32), R 1..256 decode repetitions (20);\n"
            "  --no-probe: without the INT2 decode probe;\n"
            "  --data FILE: K and V from layer 0 of a world-model dump (eval/dump.h; head_dim 128), its heads\n"
            "  and its chunks' tokens repeated to fill H x N (synthetic data otherwise);\n"
            "  --assign fast|exact|both: the k-means assignment (the scheme's by default); both: each scheme\n"
            "  twice, fast then exact;\n"
            "  SCHEME: shipped schemes (all by default)\n",
            what, arg ? ": " : "", arg ? arg : "");
    return 2;
}

/* Opens the dump of --data for the bench's layer (head_dim d, layer 0's k
 * and v in every chunk): 0 with *out set, or usage's status with the file
 * and what is wrong named. */
static int data_open(const char *path, int d, kvf_dump **out) {
    kvf_dump *dump;
    if (kvf_dump_open(path, &dump)) return usage("cannot use --data", kvf_last_error());
    /* kvf_dump_open has checked that every layer and chunk has its k and v (data_fill reads them). */
    if (dump->head_dim != d) {
        char why[512];
        snprintf(why, sizeof why, "%s: head_dim %d, the bench's layer has d = %d", path, dump->head_dim, d);
        kvf_dump_close(dump);
        return usage("cannot use --data", why);
    }
    *out = dump;
    return 0;
}

/* K (role KVF_DUMP_K) or V (KVF_DUMP_V) of the bench's layer, [heads][tokens][d],
 * from layer 0 of the dump: head h is the dump's head h % kv_heads, token t
 * its token t % (chunks * N) of the chunks concatenated in order. */
static void data_fill(const kvf_dump *dump, int role, int64_t tokens, int heads, int d, uint16_t *x) {
    const int64_t n = dump->tokens, total = n * dump->chunks;
    for (int h = 0; h < heads; h++)
        for (int64_t t = 0; t < tokens;) {
            const int64_t s = t % total, j = s % n, run = n - j < tokens - t ? n - j : tokens - t;
            const kvf_st_tensor *src = kvf_dump_tensor(dump, 0, (int)(s / n), role);
            kvf_dump_bf16(src, ((size_t)(h % dump->kv_heads) * n + j) * d, (size_t)run * d,
                          x + ((size_t)h * tokens + t) * d);
            t += run;
        }
}

int main(int argc, char **argv) {
    int64_t tokens = 29640;
    int heads = 32, reps = 20, probe = 1;
    const int d = 128;
    const char *data = NULL; /* --data FILE */
    const char *only[32];
    int n_only = 0;
    int assign = -1; /* --assign: KVF_ASSIGN_FAST, KVF_ASSIGN_EXACT, 2 both; -1 the scheme's */
    /* The arguments are checked before any GPU work (exit status 2). */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--tokens") || !strcmp(a, "--heads") || !strcmp(a, "--reps")) {
            const long long hi = a[2] == 't' ? 1048576 : a[2] == 'h' ? 1024 : 256; /* 256: time_try's timings */
            long long v;
            if (i + 1 >= argc || !kvf_parse_int(argv[i + 1], 1, hi, &v)) return usage("needs an integer in range", a);
            i++;
            if (a[2] == 't') tokens = v;
            else if (a[2] == 'h') heads = (int)v;
            else reps = (int)v;
        } else if (!strcmp(a, "--assign")) {
            const char *m = i + 1 < argc ? argv[++i] : "";
            assign = !strcmp(m, "fast") ? KVF_ASSIGN_FAST : !strcmp(m, "exact") ? KVF_ASSIGN_EXACT
                   : !strcmp(m, "both") ? 2 : -2;
            if (assign == -2) return usage("needs fast, exact or both", a);
        } else if (!strcmp(a, "--no-probe")) {
            probe = 0;
        } else if (!strcmp(a, "--data")) {
            /* An option after --data is not its file ("--data --no-probe"): a file
             * whose name starts with "--" is given as ./--name. */
            if (i + 1 >= argc || !strncmp(argv[i + 1], "--", 2)) return usage("needs a file", a);
            data = argv[++i];
        } else if (a[0] == '-') {
            return usage("unknown option", a);
        } else {
            int known = 0;
            for (const char *const *b = kvf_builtin_schemes(); *b && !known; b++) known = !strcmp(*b, a);
            if (!known) return usage("no shipped scheme of that name", a);
            if (n_only == 32) return usage("at most 32 schemes", NULL);
            only[n_only++] = a;
        }
    }
    /* The dump is checked with the arguments too (no GPU needed). */
    kvf_dump *dump = NULL;
    if (data) {
        int rc = data_open(data, d, &dump);
        if (rc) return rc;
        printf("data: %s (layer 0, K/V heads tiled h %% %d, tokens t %% %lld: %d chunks x %lld)\n", data,
               dump->kv_heads, (long long)dump->tokens * dump->chunks, dump->chunks, (long long)dump->tokens);
    } else {
        printf("data: synthetic (kvf_synth_kv)\n");
    }
    /* QVG's figures (docs/BACKGROUND.md section 5) are of the LongCat
     * layer's synthetic equivalent only. */
    const int anchor_shape = !dump && tokens == 29640 && heads == 32;
    /* The JIT columns' cold compile is a first compile only with the driver's
     * compute cache off (NVRTC 13 keeps its output there): set before libcuda
     * and NVRTC load, unless the caller set it. */
    setenv("CUDA_CACHE_DISABLE", "1", 0);
    const int driver_cache_off = !strcmp(getenv("CUDA_CACHE_DISABLE"), "1");
    int count;
    if (kvf_device_count(&count)) {
        printf("kvf_bench: no GPU (%s): nothing to measure\n", kvf_last_error());
        kvf_dump_close(dump);
        return 0;
    }
    kvf_cuda_load(&cu);
    CUdevice dev;
    CUcontext pctx;
    char name[128];
    CK(cuDeviceGet(&dev, 0));
    CK(cuDeviceGetName(name, sizeof name, dev));
    CK(cuDevicePrimaryCtxRetain(&pctx, dev));
    CK(cuCtxPushCurrent(pctx));

    /* Copy ceiling: 2 GiB device to device, read + write counted. */
    copy_arg cp = {0, 0, (size_t)2 << 30};
    CK(cuMemAlloc(&cp.src, cp.n));
    CK(cuMemAlloc(&cp.dst, cp.n));
    CK(cuMemsetD8(cp.src, 1, cp.n));
    float copy_ms = time_median(do_copy, &cp, reps);
    double copy_bw = 2.0 * cp.n / (copy_ms * 1e-3) / 1e9;
    /* The same copy at an INT2 decode's size: half of what the probe moves
     * (codes, scales and BF16 rows: 296 bytes a row of K and V) each way, so
     * the ceiling's own loss at that size is printed beside it. */
    copy_arg cs = cp;
    cs.n = (size_t)tokens * heads * 296;
    if (cs.n > cp.n) cs.n = cp.n;
    float copy_s_ms = time_median(do_copy, &cs, reps);
    double copy_s_bw = 2.0 * cs.n / (copy_s_ms * 1e-3) / 1e9;
    cu->cuMemFree(cp.src);
    cu->cuMemFree(cp.dst);

    size_t n = (size_t)tokens * heads * d;
    uint16_t *host = malloc(n * 2 * 2);
    if (!host) { fprintf(stderr, "kvf_bench: out of memory for the layer (%zu bytes)\n", n * 4); return 1; }
    if (dump) {
        data_fill(dump, KVF_DUMP_K, tokens, heads, d, host);
        data_fill(dump, KVF_DUMP_V, tokens, heads, d, host + n);
        kvf_dump_close(dump);
        dump = NULL;
    } else {
        kvf_synth_kv(host, tokens, heads, d, 1);
        kvf_synth_kv(host + n, tokens, heads, d, 2);
    }
    codec_arg c;
    memset(&c, 0, sizeof c);
    c.sh.n_tokens = tokens;
    c.sh.n_heads = heads;
    CK(cuMemAlloc(&c.k, n * 2));
    CK(cuMemAlloc(&c.v, n * 2));
    CK(cuMemAlloc(&c.k2, n * 2));
    CK(cuMemAlloc(&c.v2, n * 2));
    CK(cuMemcpyHtoD(c.k, host, n * 2));
    CK(cuMemcpyHtoD(c.v, host + n, n * 2));
    free(host);
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)tokens * 4);
    if (!pos) { fprintf(stderr, "kvf_bench: out of memory for the positions\n"); return 1; }
    for (int64_t t = 0; t < tokens * 4; t++) pos[t] = (int32_t)(t % 1000);
    CUdeviceptr dpos;
    CK(cuMemAlloc(&dpos, sizeof(int32_t) * (size_t)tokens * 4));
    CK(cuMemcpyHtoD(dpos, pos, sizeof(int32_t) * (size_t)tokens * 4));
    free(pos);

    /* Write-only ceiling over what a decode writes: K and V in BF16, as one
     * memset of that many bytes (the decode writes two such halves). */
    copy_arg fill = {0, 0, 2 * n * 2};
    CK(cuMemAlloc(&fill.dst, fill.n));
    float fill_ms = time_median(do_fill, &fill, reps);
    double fill_bw = fill.n / (fill_ms * 1e-3) / 1e9;
    double probe_bw[PROBE_N];
    float probe_ms[PROBE_N];
    int probe_rc = probe ? probe_ceilings(dev, tokens, heads, fill.dst, reps, probe_bw, probe_ms) : KVF_OK;
    cu->cuMemFree(fill.dst);

    printf("GPU: %s; layer: K and V of %d heads x %lld tokens x d=%d (BF16 %.1f MB each)\n", name, heads,
           (long long)tokens, d, n * 2 / 1e6);
    printf("copy ceiling: %.0f GB/s (2 GiB device-to-device, read + write, median of %d)\n", copy_bw, reps);
    printf("copy of %.0f MB (an INT2 decode's bytes, half each way): %.0f GB/s = %.1f%% of the copy ceiling\n",
           cs.n / 1e6, copy_s_bw, 100.0 * copy_s_bw / copy_bw);
    printf("write ceiling: %.0f GB/s (cuMemsetD32 of the decode's %.0f MB of BF16 output: %.3f ms, median of %d)\n",
           fill_bw, fill.n / 1e6, fill_ms, reps);
    if (!probe)
        printf("INT2 decode probe: not run (--no-probe)\n\n");
    else if (probe_rc == KVF_OK)
        printf("INT2 decode probe (bench/kvf_probe.cuh: qvg_int2's bytes a row, no arithmetic, one launch):\n"
               "  codes and scales: %.0f GB/s = %.1f%% of copy (%.3f ms); with the centroid gather: %.0f GB/s = "
               "%.1f%% of copy (%.3f ms)\n"
               "  codes and scales read and rows written by separate blocks (no load feeds a store): %.0f GB/s = "
               "%.1f%% of copy (%.3f ms)\n"
               "  the rows' 16-byte stores alone: %.0f GB/s = %.1f%% of copy (%.3f ms)\n\n",
               probe_bw[0], 100.0 * probe_bw[0] / copy_bw, probe_ms[0], probe_bw[1], 100.0 * probe_bw[1] / copy_bw,
               probe_ms[1], probe_bw[2], 100.0 * probe_bw[2] / copy_bw, probe_ms[2], probe_bw[3],
               100.0 * probe_bw[3] / copy_bw, probe_ms[3]);
    else
        printf("INT2 decode probe: not run (%s)\n\n", kvf_last_error());
    printf("%-16s %8s %9s %9s %9s %10s %7s %8s %9s %9s %9s\n", "scheme", "ratio", "encode", "vs QVG", "decode",
           "dec GB/s", "of copy", "of write", "vs QVG", "JIT cold", "JIT hit");
    const char *const *names = kvf_builtin_schemes();
    const int reps5 = reps < 5 ? reps : 5; /* encode and statistics updates: the slower calls */
    const int variants = assign == 2 ? 2 : 1;
    for (int iv = 0; names[iv / variants]; iv++) {
        const int i = iv / variants;
        int wanted = !n_only;
        for (int j = 0; j < n_only; j++) wanted |= !strcmp(only[j], names[i]);
        if (!wanted) continue;
        kvf_scheme *s;
        if (kvf_scheme_load_builtin(names[i], &s)) { fprintf(stderr, "%s\n", kvf_last_error()); return 1; }
        char row[80]; /* the scheme's name, "/exact" where both variants run */
        snprintf(row, sizeof row, "%s%s", names[i], assign == 2 && iv % 2 ? "/exact" : "");
        if (assign >= 0) {
            s->key.assign = s->value.assign = assign == 2 ? (iv % 2 ? KVF_ASSIGN_EXACT : KVF_ASSIGN_FAST) : assign;
            if (kvf_scheme_finalize(s)) { fprintf(stderr, "%s\n", kvf_last_error()); return 1; }
        }
        /* JIT: a cold compile (no cache), then a context from the disk cache. */
        setenv("KVFORGE_CACHE", "0", 1);
        double t0 = now_ms();
        if (kvf_context_create(s, 0, &c.ctx)) { fprintf(stderr, "%s\n", kvf_last_error()); return 1; }
        double cold = now_ms() - t0;
        kvf_context_destroy(c.ctx);
        unsetenv("KVFORGE_CACHE");
        kvf_context *warm;
        kvf_context_create(s, 0, &warm); /* fills the cache */
        kvf_context_destroy(warm);
        t0 = now_ms();
        if (kvf_context_create(s, 0, &c.ctx)) { fprintf(stderr, "%s\n", kvf_last_error()); return 1; }
        double hit = now_ms() - t0;
        kvf_packed_size(s, tokens, heads, &c.packed_bytes);
        CK(cuMemAlloc(&c.packed, c.packed_bytes));
        c.qs = 0;
        if (kvf_scheme_reads_qstats(s)) { /* statistics of one chunk of queries, added several times (timed) */
            kvf_qstats_size(s, heads, &c.qs_bytes);
            CK(cuMemAlloc(&c.qs, c.qs_bytes));
            c.qsh = (kvf_shape){tokens < 4680 ? tokens : 4680, heads, 0, 0};
            if (kvf_qstats_init(c.ctx, (void *)c.qs, c.qs_bytes, heads, NULL) || do_qstats(&c)) {
                fprintf(stderr, "%s\n", kvf_last_error());
                return 1;
            }
            float upd = time_median(do_qstats, &c, reps5);
            fprintf(stderr, "  %s query statistics: one update of %lld queries x %d heads %.3f ms (median of %d)\n",
                    row, (long long)c.qsh.n_tokens, heads, upd, reps5);
        }
        c.pos = s->rope.placement == KVF_ROPE_PRE ? dpos : 0;
        /* The pipeline in its steady state: an anchor span of the same tokens
         * (its scheme's encode, not timed), the carried error read and written,
         * each head refining its first channels. Decode reads the anchor too. */
        kvf_encode_args ea = {0};
        kvf_decode_args da = {0};
        CUdeviceptr d_anchor = 0, d_fb = 0, d_map = 0;
        kvf_scheme *as = NULL;
        kvf_context *actx = NULL;
        size_t anchor_bytes = 0;
        c.ea = NULL, c.da = NULL;
        if (s->pipe.anchor_every || s->pipe.feedback_decay > 0 || s->plan.sec[0].mp_channels ||
            s->plan.sec[1].mp_channels) {
            const size_t mb = (size_t)2 * heads * s->head_dim;
            uint8_t *map = malloc(mb);
            for (size_t i = 0; i < mb; i++) {
                const int sec = (int)(i / ((size_t)heads * s->head_dim)), ch = (int)(i % (size_t)s->head_dim);
                map[i] = ch < s->plan.sec[sec].mp_channels ? (uint8_t)ch : 255;
            }
            CK(cuMemAlloc(&d_map, mb));
            CK(cuMemcpyHtoD(d_map, map, mb));
            free(map);
            ea.channel_map = (uint8_t *)d_map;
            if (s->pipe.feedback_decay > 0) {
                CK(cuMemAlloc(&d_fb, 2 * n * sizeof(float)));
                CK(cuMemsetD8(d_fb, 0, 2 * n * sizeof(float)));
                ea.feedback = (float *)d_fb, ea.feedback_in = 1;
            }
            if (s->pipe.anchor_every) {
                if (kvf_scheme_anchor(s, &as) || kvf_context_create(as, 0, &actx)) {
                    fprintf(stderr, "%s\n", kvf_last_error());
                    return 1;
                }
                kvf_packed_size(as, tokens, heads, &anchor_bytes);
                CK(cuMemAlloc(&d_anchor, anchor_bytes));
                if (kvf_encode(actx, (void *)c.k, (void *)c.v, &c.sh, NULL, (void *)d_anchor, anchor_bytes, NULL)) {
                    fprintf(stderr, "%s\n", kvf_last_error());
                    return 1;
                }
                ea.anchor = da.anchor = (void *)d_anchor;
                ea.anchor_bytes = da.anchor_bytes = anchor_bytes;
                ea.anchor_n_tokens = da.anchor_n_tokens = tokens;
            }
            c.ea = &ea, c.da = &da;
        }
        float enc = time_median(do_encode, &c, reps5);
        unsigned long long st[2][2 * KVF_AS_N];
        const int kmeans = s->plan.sec[0].path == KVF_PATH_KMEANS || s->plan.sec[1].path == KVF_PATH_KMEANS;
        if (kmeans && !kvf_context_assign_stats(c.ctx, 1, st) && !do_encode(&c) &&
            !kvf_context_assign_stats(c.ctx, 0, st))
            for (int t = 0; t < 2; t++)
                for (int k = 0; k < 2; k++) {
                    const unsigned long long *a = st[t] + KVF_AS_N * k;
                    const double tok = (double)a[KVF_AS_TOKENS];
                    if (a[KVF_AS_TOKENS])
                        fprintf(stderr, "  %s %s assign%s: %llu tokens, %.2f candidates/token, %.3f%% with f64 distances, "
                                "%.3f%% full scans, %.3f%% filtered twice\n", row,
                                t ? "V" : !k && s->plan.sec[1].kmeans_owner == 0 ? "K+V" : "K", k ? " (QSAC)" : "",
                                a[KVF_AS_TOKENS], a[KVF_AS_CANDIDATES] / tok, 100.0 * a[KVF_AS_EXACT] / tok,
                                100.0 * a[KVF_AS_FULL] / tok, 100.0 * a[KVF_AS_AGAIN] / tok);
                }
        float dec = time_median(do_decode, &c, reps);
        double moved = (double)c.packed_bytes + (double)anchor_bytes + 2.0 * n * 2;
        double bw = moved / (dec * 1e-3) / 1e9;
        kvf_footprint f;
        kvf_footprint_of(s, tokens, heads, &f);
        char vs_enc[16] = "-", vs_dec[16] = "-";
        if (anchor_shape) {
            snprintf(vs_enc, sizeof vs_enc, "%.2fx", 4.77 / enc);
            snprintf(vs_dec, sizeof vs_dec, "%.2fx", 0.44 / dec);
        }
        printf("%-16s %7.2fx %7.3f ms %9s %7.3f ms %10.0f %6.1f%% %7.1f%% %9s %7.0f ms %6.1f ms\n", row,
               f.compression, enc, vs_enc, dec, bw, 100.0 * bw / copy_bw, 100.0 * fill_ms / dec, vs_dec, cold, hit);
        fflush(stdout);
        cu->cuMemFree(c.packed);
        if (c.qs) cu->cuMemFree(c.qs);
        if (d_anchor) cu->cuMemFree(d_anchor);
        if (d_fb) cu->cuMemFree(d_fb);
        if (d_map) cu->cuMemFree(d_map);
        kvf_context_destroy(actx);
        kvf_scheme_free(as);
        kvf_context_destroy(c.ctx);
        kvf_scheme_free(s);
    }
    printf("\nencode: K+V of the layer (median of 5); decode: K+V to BF16 (median of %d); dec GB/s counts packed\n"
           "bytes read (and an anchor span's, for a scheme with anchors) + BF16 bytes written; a pipeline scheme\n"
           "runs in its steady state (coded against an anchor, carrying the error, refining each head's first\n"
           "channels); 'of copy' = dec GB/s / copy ceiling; 'of write' = the memset of the\n"
           "same output bytes' time / decode time (1.0 = decode as fast as writing its output alone);\n"
           "'vs QVG' = QVG's time / ours (docs/BACKGROUND.md section 5: 4.77 ms, 0.44 ms; of 32 heads x 29640\n"
           "tokens: '-' at other shapes and with --data);\n"
           "JIT cold = context creation with NVRTC, no kvforge disk cache and %s (its programs compiled at once);\n"
           "JIT hit = from the disk cache.\n", reps,
           driver_cache_off ? "the driver's compute cache off (CUDA_CACHE_DISABLE=1): a first compile"
                            : "the driver's compute cache on (CUDA_CACHE_DISABLE given as other than 1): on a "
                              "host that compiled the same source before, not a first compile");
    CUdeviceptr layer[5] = {c.k, c.v, c.k2, c.v2, dpos};
    for (int i = 0; i < 5; i++) cu->cuMemFree(layer[i]);
    return 0;
}
