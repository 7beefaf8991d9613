/* kvforge command line: gen, compile, export, info, cache, demo, eval.
 * Every subcommand parses its options with getopt_long (one table each,
 * eval/cli_args.c's messages): --help prints its usage on stdout (exit 0);
 * an unknown option, a missing value or a bad operand is a usage error
 * (exit 2, the option named on stderr); a failure is exit 1. */
#include "gpu/cuda_api.h"
#include "calibrate.h"
#include "cli_args.h"
#include "eval.h"
#include "gen.h"
#include "gpu/jit.h"
#include "cpu/ref.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/stat.h>
#include <unistd.h>

#define USAGE_ERROR KVF_CLI_USAGE

static const char overview[] =
    "usage: kvforge COMMAND [options]\n"
    "KV-cache compression schemes for video world models: kernels, quality, demo.\n"
    "\n"
    "commands:\n"
    "  gen SCHEME [-o DIR]              write the generated CUDA, C and header\n"
    "  compile SCHEME [--arch LIST] [--resources]\n"
    "                                   NVRTC compile only (no GPU needed)\n"
    "  export SCHEME [--arch LIST] [-o DIR]\n"
    "                                   fatbin + C/header embedding it (precompiled kernels)\n"
    "  info SCHEME                      canonical configuration and footprint\n"
    "  cache list|clear|dir             the JIT disk cache\n"
    "  demo [SCHEME] [--cpu]            encode/decode a synthetic chunk\n"
    "  eval --scheme SCHEME --data DUMP attention-level quality on a KV dump (--peer RECON:\n"
    "                                   another system's cache)\n"
    "  calibrate --scheme SCHEME --data DUMP -o TABLE\n"
    "                                   mixed precision's sensitivity table from a KV dump\n"
    "  version                          the version\n"
    "  help [COMMAND]                   this text, or a command's (also: COMMAND --help)\n"
    "\n"
    "A SCHEME is a file path, or the name of a shipped scheme (rtn_int2).\n"
    "Exit status: 0 done, 1 failed, 2 a usage error.\n";

static const char usage_gen[] =
    "usage: kvforge gen SCHEME [-o DIR]\n"
    "Write the scheme's generated CUDA (instantiations of templates/), C and header.\n"
    "  -o, --output DIR   where (default: out/gen)\n"
    "  -h, --help         this help\n";

static const char usage_compile[] =
    "usage: kvforge compile SCHEME [--arch LIST] [--resources] [--quiet]\n"
    "NVRTC compile of the scheme's kernels (no GPU needed), from the disk cache when there.\n"
    "  -a, --arch LIST    comma-separated, each once: sm_XX (cubin) or compute_XX (PTX)\n"
    "                     (default: sm_80,sm_90)\n"
    "  -r, --resources    ptxas's registers, spills and static shared memory per kernel\n"
    "  -q, --quiet        no progress on stderr (shown only when stderr is a terminal)\n"
    "  -h, --help         this help\n";

static const char usage_export[] =
    "usage: kvforge export SCHEME [--arch LIST] [-o DIR] [--quiet]\n"
    "Precompiled kernels: a fatbin (a cubin per arch, PTX of the newest) and C/header embedding it.\n"
    "  -a, --arch LIST    comma-separated sm_XX, each once (default: sm_80,sm_90)\n"
    "  -o, --output DIR   where (default: out/export)\n"
    "  -q, --quiet        no progress on stderr (shown only when stderr is a terminal)\n"
    "  -h, --help         this help\n";

static const char usage_info[] =
    "usage: kvforge info SCHEME\n"
    "The scheme's canonical configuration, its id, and its footprint at two spans.\n"
    "  -h, --help         this help\n";

static const char usage_cache[] =
    "usage: kvforge cache list|clear|dir\n"
    "The JIT disk cache ($KVFORGE_CACHE_DIR, else $XDG_CACHE_HOME/kvforge, else ~/.cache/kvforge;\n"
    "KVFORGE_CACHE=0 turns it off).\n"
    "  list               its entries\n"
    "  clear              remove them\n"
    "  dir                its directory\n"
    "  -h, --help         this help\n";

static const char usage_demo[] =
    "usage: kvforge demo [SCHEME] [--cpu]\n"
    "Encode and decode one synthetic 480p chunk (default scheme: schemes/quantwm_int2.lua) on\n"
    "GPU 0, or the CPU reference where there is no GPU; errors and time.\n"
    "  -c, --cpu          the CPU reference even where there is a GPU\n"
    "  -h, --help         this help\n";

static const char usage_version[] =
    "usage: kvforge version\n"
    "The version of kvforge.\n";

static int fail(int rc) {
    fprintf(stderr, "kvforge: %s: %s\n", kvf_strerror(rc), kvf_last_error());
    return 1;
}

/* A usage error about operands: the message, the hint; exit status 2. */
static int usage_error(const char *prog, const char *fmt, const char *what) {
    fprintf(stderr, "%s: ", prog);
    fprintf(stderr, fmt, what);
    fprintf(stderr, "\nTry '%s --help'.\n", prog);
    return USAGE_ERROR;
}

/* Exactly n operands (from optind) but at most max; names what is missing. */
static int operands(int argc, char **argv, const char *prog, int min, int max, const char *what) {
    const int n = argc - optind;
    if (n < min) return usage_error(prog, "missing %s", what);
    if (n > max) return usage_error(prog, "unexpected argument '%.200s'", argv[optind + max]);
    return 0;
}

/* A path given for a file must be a regular file where it exists: a FIFO
 * would block the read (or write) forever, a device or directory makes no
 * sense. KVF_EIO with a message, else KVF_OK. */
static int regular_or_absent(const char *path, const char *what) {
    struct stat st;
    if (stat(path, &st) != 0 || S_ISREG(st.st_mode)) return KVF_OK;
    return kvf_set_error(KVF_EIO, "%s: is %s, not a regular file: give a %s", path,
                         S_ISDIR(st.st_mode) ? "a directory" : S_ISFIFO(st.st_mode) ? "a FIFO" : "a device or socket",
                         what);
}

static int load_scheme(const char *arg, kvf_scheme **s) {
    int rc = regular_or_absent(arg, "scheme file (.lua)");
    if (rc) return rc;
    if (strchr(arg, '/') || strstr(arg, ".lua") || access(arg, F_OK) == 0) return kvf_scheme_load(arg, s);
    return kvf_scheme_load_builtin(arg, s);
}

/* Whether progress goes to stderr: a terminal there, and no --quiet. */
static int show_progress(int quiet) { return !quiet && isatty(STDERR_FILENO); }

/* One progress line on a terminal's stderr, overwritten by the next ("\r",
 * clear to the end of the line); NULL clears it. */
static void progress_line(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void progress_line(const char *fmt, ...) {
    fputs("\r\033[K", stderr);
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        vfprintf(stderr, fmt, ap);
        va_end(ap);
    }
    fflush(stderr);
}

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

/* ------------------------------------------------------------------ gen */

static int cmd_gen(int argc, char **argv) {
    static const struct option longs[] = {
        {"output", required_argument, NULL, 'o'}, {"help", no_argument, NULL, 'h'}, {NULL, 0, NULL, 0}};
    const char *prog = "kvforge gen", *dir = NULL;
    int state = 0, c;
    while ((c = kvf_cli_getopt(argc, argv, longs, prog, stderr, &state)) != -1) {
        if (c == 'h') { fputs(usage_gen, stdout); return 0; }
        if (c != 'o') return USAGE_ERROR;
        if (dir) return kvf_cli_twice(prog, "output", stderr);
        dir = optarg;
    }
    int rc = operands(argc, argv, prog, 1, 1, "SCHEME");
    if (rc) return rc;
    if (!dir) dir = "out/gen";
    kvf_scheme *s;
    if ((rc = load_scheme(argv[optind], &s))) return fail(rc);
    kvf_gen_output g;
    if (!(rc = kvf_gen(s, &g))) {
        rc = kvf_gen_write(&g, dir);
        if (!rc) printf("wrote %s/%s, %s/%s, %s/%s\n", dir, g.cu_name, dir, g.c_name, dir, g.h_name);
        kvf_gen_output_free(&g);
    }
    kvf_scheme_free(s);
    return rc ? fail(rc) : 0;
}

/* ------------------------------------------------------ compile, export */

#define MAX_ARCHS 16

/* The scheme and the archs of compile and export: --arch's list split (a copy). */
typedef struct arch_job {
    kvf_scheme *s;
    const char *spec;
    char list[256];
    const char *archs[MAX_ARCHS];
    int n;
} arch_job;

/* Split spec ("sm_80,sm_90") into j: every entry non-empty and given once. */
static int parse_archs(const char *prog, const char *spec, arch_job *j) {
    j->spec = spec;
    j->n = 0;
    if (strlen(spec) >= sizeof j->list) return usage_error(prog, "--arch '%.80s...': too long", spec);
    snprintf(j->list, sizeof j->list, "%s", spec);
    for (char *p = j->list;;) {
        char *comma = strchr(p, ',');
        if (comma) *comma = 0;
        if (!*p) return usage_error(prog, "--arch '%s': an empty entry (write sm_80,sm_90)", spec);
        for (int i = 0; i < j->n; i++)
            if (!strcmp(j->archs[i], p)) {
                fprintf(stderr, "%s: --arch '%s': %s is given twice\nTry '%s --help'.\n", prog, spec, p, prog);
                return USAGE_ERROR;
            }
        if (j->n == MAX_ARCHS) return usage_error(prog, "--arch '%s': more than 16 entries", spec);
        j->archs[j->n++] = p;
        if (!comma) return 0;
        p = comma + 1;
    }
}

enum { ARCH_RESOURCES = 1, ARCH_OUTPUT = 2 };

/* compile's and export's options (which: ARCH_RESOURCES for compile,
 * ARCH_OUTPUT for export) and the scheme; 0, a usage status, or -1 after
 * --help (printed). */
static int arch_args(int argc, char **argv, const char *prog, const char *usage, int which, arch_job *j,
                     int *resources, const char **dir, int *quiet) {
    static const struct option compile_longs[] = {
        {"arch", required_argument, NULL, 'a'}, {"resources", no_argument, NULL, 'r'},
        {"quiet", no_argument, NULL, 'q'},     {"help", no_argument, NULL, 'h'}, {NULL, 0, NULL, 0}};
    static const struct option export_longs[] = {
        {"arch", required_argument, NULL, 'a'}, {"output", required_argument, NULL, 'o'},
        {"quiet", no_argument, NULL, 'q'},     {"help", no_argument, NULL, 'h'}, {NULL, 0, NULL, 0}};
    const struct option *longs = which == ARCH_OUTPUT ? export_longs : compile_longs;
    const char *arch = NULL;
    int state = 0, c;
    *quiet = 0;
    while ((c = kvf_cli_getopt(argc, argv, longs, prog, stderr, &state)) != -1) {
        switch (c) {
        case 'h': fputs(usage, stdout); return -1;
        case 'q': *quiet = 1; break;
        case 'r': *resources = 1; break;
        case 'a':
            if (arch) return kvf_cli_twice(prog, "arch", stderr);
            arch = optarg;
            break;
        case 'o':
            if (*dir) return kvf_cli_twice(prog, "output", stderr);
            *dir = optarg;
            break;
        default: return USAGE_ERROR;
        }
    }
    int rc = operands(argc, argv, prog, 1, 1, "SCHEME");
    if (rc || (rc = parse_archs(prog, arch ? arch : "sm_80,sm_90", j))) return rc;
    if ((rc = load_scheme(argv[optind], &j->s))) return fail(rc);
    return 0;
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
    arch_job j;
    int resources = 0, quiet;
    const char *unused = NULL;
    int rc = arch_args(argc, argv, "kvforge compile", usage_compile, ARCH_RESOURCES, &j, &resources, &unused, &quiet);
    if (rc) return rc < 0 ? 0 : rc;
    kvf_scheme *s = j.s;
    if (resources) {
        rc = print_usage_report(s, &j);
        kvf_scheme_free(s);
        return rc ? fail(rc) : 0;
    }
    const int progress = j.n > 1 && show_progress(quiet);
    for (int i = 0; i < j.n && !rc; i++) {
        kvf_jit_images im;
        if (progress) progress_line("kvforge compile: %s (%d of %d)...", j.archs[i], i + 1, j.n);
        const double t0 = now_ms();
        const int ptx = !strncmp(j.archs[i], "compute_", 8); /* a virtual arch: PTX */
        rc = kvf_jit_programs(s, j.archs[i], ptx, &im); /* what a context loads */
        const double ms = now_ms() - t0;
        if (progress) progress_line(NULL);
        if (!rc) {
            size_t bytes = 0;
            for (int p = 0; p < im.n; p++) bytes += ptx ? strlen(im.image[p]) : im.size[p];
            printf("%s %s: %d program%s, %zu bytes of %s from %s in %.1f ms\n", kvf_scheme_id(s), j.archs[i], im.n,
                   im.n > 1 ? "s" : "", bytes, ptx ? "PTX" : "cubin", im.origin, ms);
            fflush(stdout);
            kvf_jit_images_free(&im);
        }
    }
    kvf_scheme_free(s);
    return rc ? fail(rc) : 0;
}

/* Progress of an export: each arch's cubin (and the newest's PTX) compiled
 * into the disk cache first, one line each, so that kvf_export finds them
 * there (it asks for "sm_NN" cubins and the newest arch's "compute_NN" PTX,
 * runtime/gpu/export.c); with the cache off, one line for the whole. A
 * failure here is left for kvf_export to report. */
static void export_progress(const kvf_scheme *s, const arch_job *j) {
    char dir[4096];
    if (kvf_cache_dir(dir, sizeof dir) != KVF_OK || !*dir) {
        progress_line("kvforge export: compiling %d arch%s and PTX...", j->n, j->n > 1 ? "es" : "");
        return;
    }
    int newest = 0;
    for (int i = 1; i < j->n; i++)
        if (atoi(j->archs[i] + 3) > atoi(j->archs[newest] + 3)) newest = i;
    for (int i = 0; i <= j->n; i++) {
        char arch[40];
        const int ptx = i == j->n;
        if (strncmp(j->archs[ptx ? newest : i], "sm_", 3)) return; /* kvf_export refuses it */
        snprintf(arch, sizeof arch, "%s_%d", ptx ? "compute" : "sm", atoi(j->archs[ptx ? newest : i] + 3));
        progress_line("kvforge export: %s %s (%d of %d)...", arch, ptx ? "PTX" : "cubin", i + 1, j->n + 1);
        void *image = NULL;
        size_t size;
        const char *origin;
        int rc = kvf_jit_image(s, arch, ptx, &image, &size, &origin);
        free(image);
        if (rc) return;
    }
    progress_line("kvforge export: fatbin and sources...");
}

static int cmd_export(int argc, char **argv) {
    arch_job j;
    int unused = 0, quiet;
    const char *dir = NULL;
    int rc = arch_args(argc, argv, "kvforge export", usage_export, ARCH_OUTPUT, &j, &unused, &dir, &quiet);
    if (rc) return rc < 0 ? 0 : rc;
    if (!dir) dir = "out/export";
    kvf_scheme *s = j.s;
    const int progress = j.n > 1 && show_progress(quiet);
    if (progress) export_progress(s, &j);
    rc = kvf_export(s, j.archs, j.n, dir);
    if (progress) progress_line(NULL);
    if (!rc) printf("exported %s for %s to %s (%s.fatbin, %s_aot.c/.h, %s.c/.h)\n", kvf_scheme_id(s), j.spec, dir,
                    kvf_scheme_id(s), kvf_scheme_id(s), kvf_scheme_id(s));
    kvf_scheme_free(s);
    return rc ? fail(rc) : 0;
}

/* ------------------------------------------------------------ info, cache */

/* Commands with --help as their only option: 0 to go on, else the status. */
static int help_only(int argc, char **argv, const char *prog, const char *usage, int *done) {
    static const struct option longs[] = {{"help", no_argument, NULL, 'h'}, {NULL, 0, NULL, 0}};
    int state = 0, c;
    *done = 1;
    while ((c = kvf_cli_getopt(argc, argv, longs, prog, stderr, &state)) != -1) {
        if (c != 'h') return USAGE_ERROR;
        fputs(usage, stdout);
        return 0;
    }
    *done = 0;
    return 0;
}

static int cmd_info(int argc, char **argv) {
    const char *prog = "kvforge info";
    int done, rc = help_only(argc, argv, prog, usage_info, &done);
    if (done) return rc;
    if ((rc = operands(argc, argv, prog, 1, 1, "SCHEME"))) return rc;
    const char *path = argv[optind];
    kvf_scheme *s;
    if ((rc = load_scheme(path, &s))) return fail(rc);
    printf("-- %s (id %s)\n%s", path, kvf_scheme_id(s), kvf_scheme_canonical(s));
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
    const char *prog = "kvforge cache";
    int done, rc = help_only(argc, argv, prog, usage_cache, &done);
    if (done) return rc;
    if ((rc = operands(argc, argv, prog, 1, 1, "the action (list, clear or dir)"))) return rc;
    const char *what = argv[optind];
    if (!strcmp(what, "list")) rc = kvf_cache_list(stdout);
    else if (!strcmp(what, "clear")) rc = kvf_cache_clear();
    else if (!strcmp(what, "dir")) {
        char dir[4096];
        rc = kvf_cache_dir(dir, sizeof dir);
        if (!rc) puts(*dir ? dir : "(disk cache off)");
    } else return usage_error(prog, "unknown action '%.200s' (list, clear or dir)", what);
    return rc ? fail(rc) : 0;
}

static int cmd_version(int argc, char **argv) {
    const char *prog = "kvforge version";
    int done, rc = help_only(argc, argv, prog, usage_version, &done);
    if (done) return rc;
    if ((rc = operands(argc, argv, prog, 0, 0, ""))) return rc;
    puts(KVF_VERSION_STRING);
    return 0;
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

static int run_demo(const char *path, int want_cpu) {
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

    int count = 0;
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

static int cmd_demo(int argc, char **argv) {
    static const struct option longs[] = {
        {"cpu", no_argument, NULL, 'c'}, {"help", no_argument, NULL, 'h'}, {NULL, 0, NULL, 0}};
    const char *prog = "kvforge demo";
    int state = 0, c, cpu = 0;
    while ((c = kvf_cli_getopt(argc, argv, longs, prog, stderr, &state)) != -1) {
        if (c == 'h') { fputs(usage_demo, stdout); return 0; }
        if (c != 'c') return USAGE_ERROR;
        cpu = 1;
    }
    int rc = operands(argc, argv, prog, 0, 1, "");
    if (rc) return rc;
    return run_demo(optind < argc ? argv[optind] : "schemes/quantwm_int2.lua", cpu);
}

/* ------------------------------------------------------------------ eval */

static void eval_progress(void *user, int layer, int layers, int chunk, int chunks) {
    (void)user;
    const double done = ((double)layer * chunks + chunk + 1) / ((double)layers * chunks);
    progress_line("kvforge eval: layer %d of %d, chunk %d of %d (%.0f%%)", layer + 1, layers, chunk + 1, chunks,
                  100 * done);
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
    kvf_eval_args a;
    int rc = kvf_eval_parse_args(argc, argv, &a, stderr);
    if (rc) return rc;
    if (a.help) {
        kvf_eval_usage(stdout);
        return 0;
    }
    if (a.recon_out && (rc = regular_or_absent(a.recon_out, "recon file path to write"))) return fail(rc);
    kvf_scheme *s = NULL;
    kvf_recon *recon = NULL;
    if ((rc = a.peer ? kvf_recon_open(a.peer, &recon) : load_scheme(a.scheme, &s))) return fail(rc);
    kvf_dump *d;
    if ((rc = kvf_dump_open(a.data, &d))) {
        kvf_scheme_free(s);
        kvf_recon_close(recon);
        return fail(rc);
    }
    const int progress = show_progress(a.quiet);
    kvf_eval_options opt = {.device = a.gpu ? 0 : KVF_DEVICE_CPU, .threads = a.threads, .warm = a.warm,
                            .recon_out = a.recon_out, .strict = a.strict, .table = a.table,
                            .progress = progress ? eval_progress : NULL};
    kvf_eval_report r;
    rc = recon ? kvf_eval_run_peer(recon, d, &opt, &r) : kvf_eval_run(s, d, &opt, &r);
    if (progress) progress_line(NULL);
    kvf_dump_close(d);
    kvf_scheme_free(s);
    kvf_recon_close(recon);
    if (rc) return fail(rc);
    int status = print_report(&r, a.json);
    fflush(stdout);
    kvf_eval_print_warnings(&r, stderr);
    kvf_eval_report_free(&r);
    return status;
}

/* ------------------------------------------------------------- calibrate */

static void calibrate_progress(void *user, int done, int total) {
    (void)user;
    progress_line("kvforge calibrate: %d of %d (layer, chunk) measured (%.0f%%)", done, total, 100.0 * done / total);
}

static int cmd_calibrate(int argc, char **argv) {
    kvf_calibrate_args a;
    int rc = kvf_calibrate_parse_args(argc, argv, &a, stderr);
    if (rc) return rc;
    if (a.help) {
        kvf_calibrate_usage(stdout);
        return 0;
    }
    if ((rc = regular_or_absent(a.output, "table file path to write"))) return fail(rc);
    kvf_scheme *s = NULL;
    kvf_dump *d = NULL;
    if ((rc = load_scheme(a.scheme, &s)) || (rc = kvf_dump_open(a.data, &d))) {
        kvf_scheme_free(s);
        return fail(rc);
    }
    const int progress = show_progress(a.quiet);
    rc = kvf_calibrate(s, d, a.first_chunk, a.n_chunks, a.output, progress ? calibrate_progress : NULL, NULL);
    if (progress) progress_line(NULL);
    kvf_dump_close(d);
    kvf_scheme_free(s);
    if (rc) return fail(rc);
    printf("%s\n", a.output);
    return 0;
}

/* ------------------------------------------------------------------ main */

typedef struct command {
    const char *name;
    int (*run)(int argc, char **argv);
    void (*usage_fn)(FILE *out); /* a usage printed by a function (eval's, calibrate's), or NULL */
    const char *usage;
} command;

static const command commands[] = {
    {"gen", cmd_gen, NULL, usage_gen},
    {"compile", cmd_compile, NULL, usage_compile},
    {"export", cmd_export, NULL, usage_export},
    {"info", cmd_info, NULL, usage_info},
    {"cache", cmd_cache, NULL, usage_cache},
    {"demo", cmd_demo, NULL, usage_demo},
    {"eval", cmd_eval, kvf_eval_usage, NULL},
    {"calibrate", cmd_calibrate, kvf_calibrate_usage, NULL},
    {"version", cmd_version, NULL, usage_version},
};

static const command *find_command(const char *name) {
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (!strcmp(commands[i].name, name)) return &commands[i];
    return NULL;
}

static int unknown_command(const char *name) {
    fprintf(stderr, "kvforge: unknown command '%.200s'\nTry 'kvforge --help'.\n", name);
    return USAGE_ERROR;
}

/* kvforge help [COMMAND] */
static int cmd_help(int argc, char **argv) {
    if (argc > 2) return usage_error("kvforge help", "unexpected argument '%.200s'", argv[2]);
    if (argc < 2) { fputs(overview, stdout); return 0; }
    const command *c = find_command(argv[1]);
    if (!c) return unknown_command(argv[1]);
    if (c->usage_fn) c->usage_fn(stdout);
    else fputs(c->usage, stdout);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fputs(overview, stderr);
        return USAGE_ERROR;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "--help") || !strcmp(cmd, "-h") || !strcmp(cmd, "help")) return cmd_help(argc - 1, argv + 1);
    if (!strcmp(cmd, "--version")) return cmd_version(1, argv + 1);
    if (cmd[0] == '-') {
        fprintf(stderr, "kvforge: unknown option '%.200s' (options follow the command)\nTry 'kvforge --help'.\n", cmd);
        return USAGE_ERROR;
    }
    const command *c = find_command(cmd);
    /* the command's argv: argv[0] its name, as getopt_long wants */
    return c ? c->run(argc - 1, argv + 1) : unknown_command(cmd);
}
