/* JIT: scheme -> generated source -> NVRTC image, through the disk cache. */
#include "gpu/cuda_api.h"
#include "gen.h"
#include "gpu/jit.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void make_key(const char *source, const char *arch, const kvf_nvrtc_api *nv, kvf_cache_key *key) {
    /* Source parts: the generated file and every template it may include. */
    const char *parts[40];
    size_t lens[40];
    int n = 0;
    parts[n] = source;
    lens[n++] = strlen(source);
    for (const kvf_embedded_file *f = kvf_embedded_templates; f->name && n < 39; f++) {
        parts[n] = f->data;
        lens[n++] = f->size;
    }
    const char *const *opts = kvf_nvrtc_options();
    int n_opts = 0;
    while (opts[n_opts]) n_opts++;
    kvf_cache_make_key(arch, nv->major, nv->minor, opts, n_opts, parts, lens, n, key);
}

/* program: the program's index of n_programs, or -1 for the whole source. */
static void meta_json(const struct kvf_scheme *s, const char *arch, const kvf_nvrtc_api *nv, int program,
                      int n_programs, char *buf, size_t len) {
    char part[64] = "";
    if (program >= 0) snprintf(part, sizeof part, ",\"program\":%d,\"programs\":%d", program, n_programs);
    snprintf(buf, len,
             "{\"scheme\":\"%s\",\"arch\":\"%s\",\"nvrtc\":\"%d.%d\",\"kvforge\":\"%s\",\"created\":%lld%s}",
             s->id, arch, nv->major, nv->minor, KVF_VERSION_STRING, (long long)time(NULL), part);
}

/* A cubin, and ptxas with it, needs a GPU arch: for a virtual one NVRTC
 * writes PTX only (and its "cubin" is empty, without an error). */
static int need_gpu_arch(const char *arch, const char *what) {
    if (!strncmp(arch, "sm_", 3)) return KVF_OK;
    return kvf_set_error(KVF_EINVAL, "arch %s is not a GPU arch (sm_XX), which %s needs (a virtual arch, compute_XX, "
                         "has PTX only)", arch, what);
}

/* One source's image (the whole, program = -1, or program `program` of
 * n_programs) from the disk cache or NVRTC; safe to run on several threads
 * at once for different sources. */
static int image_of(const struct kvf_scheme *s, const kvf_nvrtc_api *nv, const char *source, const char *name,
                    const char *arch, int want_ptx, int program, int n_programs, void **image, size_t *size,
                    const char **origin) {
    char cache_arch[40];
    snprintf(cache_arch, sizeof cache_arch, "%s%s", arch, want_ptx ? "-ptx" : "");
    kvf_cache_key key;
    make_key(source, cache_arch, nv, &key);
    if (kvf_cache_get(cache_arch, &key, image, size) == KVF_OK) {
        *origin = "disk-cache";
        return KVF_OK;
    }
    /* Another process may be compiling the same key: wait for it, look again. */
    int rc = KVF_OK, lock = kvf_cache_lock(cache_arch, &key);
    if (lock >= 0 && kvf_cache_get(cache_arch, &key, image, size) == KVF_OK) {
        *origin = "disk-cache";
    } else {
        rc = kvf_nvrtc_compile(source, name, arch, want_ptx, image, size);
        if (rc == KVF_OK) {
            char meta[512];
            meta_json(s, cache_arch, nv, program, n_programs, meta, sizeof meta);
            kvf_cache_put(cache_arch, &key, meta, *image, *size); /* failures only warn */
            *origin = "nvrtc";
        } else {
            kvf_wrap_error(rc, "scheme %s", s->name);
        }
    }
    if (lock >= 0) kvf_cache_unlock(lock);
    return rc;
}

int kvf_jit_image(const struct kvf_scheme *s, const char *arch, int want_ptx, void **image, size_t *size,
                  const char **origin) {
    *image = NULL;
    /* Refused before anything is compiled or cached. */
    int rc = want_ptx ? KVF_OK : need_gpu_arch(arch, "a cubin");
    if (rc) return rc;
    const kvf_nvrtc_api *nv;
    if ((rc = kvf_nvrtc_load(&nv))) return rc;
    kvf_gen_output g;
    if ((rc = kvf_gen(s, &g))) return rc;
    rc = image_of(s, nv, g.cu, g.cu_name, arch, want_ptx, -1, 0, image, size, origin);
    kvf_gen_output_free(&g);
    return rc;
}

/* The programs of kvf_jit_programs and kvf_jit_usage, one task each. */
typedef struct programs_job {
    const struct kvf_scheme *s;
    const kvf_nvrtc_api *nv;
    const kvf_gen_output *g;
    const char *arch;
    int want_ptx;
    kvf_jit_images *out;
    const char *origin[KVF_GEN_MAX_PROGRAMS];
    char *report[KVF_GEN_MAX_PROGRAMS]; /* kvf_jit_usage's ptxas reports; NULL: kvf_jit_programs */
    int with_report;
} programs_job;

static int program_task(void *arg, int p, int worker) {
    (void)worker;
    programs_job *j = arg;
    if (j->with_report) {
        int rc = kvf_nvrtc_compile_report(j->g->program[p], j->g->program_name[p], j->arch, &j->out->image[p],
                                          &j->out->size[p], &j->report[p]);
        return rc ? kvf_wrap_error(rc, "scheme %s", j->s->name) : KVF_OK;
    }
    return image_of(j->s, j->nv, j->g->program[p], j->g->program_name[p], j->arch, j->want_ptx, p, j->g->n_programs,
                    &j->out->image[p], &j->out->size[p], &j->origin[p]);
}

/* Every program of the scheme on a thread of its own, into j->out (zeroed
 * by the caller). */
static int run_programs(programs_job *j) {
    int rc = kvf_nvrtc_load(&j->nv);
    if (rc) return rc;
    kvf_gen_output g;
    if ((rc = kvf_gen_programs(j->s, &g))) return rc;
    j->g = &g;
    const kvf_tasks t = {.n_tasks = g.n_programs, .threads = g.n_programs, .arg = j, .run = program_task};
    rc = kvf_parallel_for(&t);
    j->out->n = g.n_programs;
    j->out->origin = "disk-cache";
    for (int p = 0; p < g.n_programs; p++)
        if (j->origin[p] && strcmp(j->origin[p], "disk-cache")) j->out->origin = "nvrtc";
    if (rc) kvf_jit_images_free(j->out);
    kvf_gen_output_free(&g);
    return rc;
}

int kvf_jit_programs(const struct kvf_scheme *s, const char *arch, int want_ptx, kvf_jit_images *out) {
    memset(out, 0, sizeof *out);
    int rc = want_ptx ? KVF_OK : need_gpu_arch(arch, "a cubin");
    if (rc) return rc;
    programs_job j = {.s = s, .arch = arch, .want_ptx = want_ptx, .out = out};
    return run_programs(&j);
}

void kvf_jit_images_free(kvf_jit_images *im) {
    for (int p = 0; p < KVF_GEN_MAX_PROGRAMS; p++) free(im->image[p]);
    memset(im, 0, sizeof *im);
}

/* The number just before `what` in line (", 16512 bytes smem"), or -1. */
static long number_before(const char *line, const char *what) {
    const char *p = strstr(line, what);
    if (!p) return -1;
    while (p > line && p[-1] == ' ') p--;
    const char *e = p;
    while (p > line && p[-1] >= '0' && p[-1] <= '9') p--;
    return p < e ? strtol(p, NULL, 10) : -1;
}

int kvf_ptxas_report_parse(const char *log, kvf_kernel_usage **out, int *n_out) {
    const int n = kvf_count_str(log, "Compiling entry function '");
    if (n == 0) return kvf_set_error(KVF_EFORMAT, "ptxas report lists no kernel");
    kvf_kernel_usage *u = calloc((size_t)n, sizeof *u);
    unsigned char *have = calloc((size_t)n, 1); /* 1: the stack/spill line, 2: the register line */
    if (!u || !have) {
        free(u), free(have);
        return kvf_set_error(KVF_ENOMEM, "out of memory for the ptxas report");
    }
    int k = -1;
    char props[128] = "";
    for (const char *line = log; line && *line;) {
        const char *end = strchr(line, '\n');
        size_t len = end ? (size_t)(end - line) : strlen(line);
        char buf[512];
        snprintf(buf, sizeof buf, "%.*s", (int)(len < sizeof buf ? len : sizeof buf - 1), line);
        for (size_t m = strlen(buf); m > 0 && (buf[m - 1] == '\r' || buf[m - 1] == ' '); m--) buf[m - 1] = 0;
        const char *q;
        if ((q = strstr(buf, "Compiling entry function '")) && k + 1 < n) {
            q += strlen("Compiling entry function '");
            k++;
            snprintf(u[k].name, sizeof u[k].name, "%.*s", (int)strcspn(q, "'"), q);
            props[0] = 0;
        } else if ((q = strstr(buf, "Function properties for "))) {
            snprintf(props, sizeof props, "%s", q + strlen("Function properties for "));
        } else if (k >= 0 && strstr(buf, "bytes stack frame") && !strcmp(props, u[k].name)) {
            u[k].stack = number_before(buf, "bytes stack frame");
            u[k].spill_stores = number_before(buf, "bytes spill stores");
            u[k].spill_loads = number_before(buf, "bytes spill loads");
            if (u[k].stack >= 0 && u[k].spill_stores >= 0 && u[k].spill_loads >= 0) have[k] |= 1;
        } else if (k >= 0 && (q = strstr(buf, "Used ")) && strstr(q, " registers")) {
            u[k].registers = (int)number_before(q, " registers");
            u[k].barriers = (int)number_before(q, " barriers");
            long sm = number_before(q, " bytes smem");
            u[k].smem = sm < 0 ? 0 : sm;
            if (u[k].registers >= 0) have[k] |= 2;
        }
        line = end ? end + 1 : NULL;
    }
    int rc = KVF_OK;
    for (int i = 0; i < n && !rc; i++)
        if (have[i] != 3)
            rc = kvf_set_error(KVF_EFORMAT, "ptxas report: kernel '%s' has no %s line", u[i].name,
                               have[i] & 1 ? "\"Used N registers\"" : "\"N bytes stack frame, N bytes spill stores\"");
    free(have);
    if (rc) {
        free(u);
        return rc;
    }
    *out = u;
    *n_out = n;
    return KVF_OK;
}

int kvf_jit_usage(const struct kvf_scheme *s, const char *arch, kvf_kernel_usage **usage, int *n,
                  kvf_jit_images *images) {
    *usage = NULL;
    *n = 0;
    kvf_jit_images own;
    kvf_jit_images *im = images ? images : &own;
    memset(im, 0, sizeof *im);
    int rc = need_gpu_arch(arch, "the register report");
    if (rc) return rc;
    programs_job j = {.s = s, .arch = arch, .out = im, .with_report = 1};
    rc = run_programs(&j);
    /* The programs' reports in program order, one list. */
    kvf_kernel_usage *all = NULL;
    int total = 0;
    for (int p = 0; p < im->n && rc == KVF_OK; p++) {
        kvf_kernel_usage *u;
        int k;
        if ((rc = kvf_ptxas_report_parse(j.report[p], &u, &k))) {
            kvf_wrap_error(rc, "scheme %s for %s, program %d", s->name, arch, p);
            break;
        }
        kvf_kernel_usage *grown = realloc(all, (size_t)(total + k) * sizeof *all);
        if (!grown) {
            free(u);
            rc = kvf_set_error(KVF_ENOMEM, "out of memory for the ptxas report");
            break;
        }
        all = grown;
        memcpy(all + total, u, (size_t)k * sizeof *u);
        total += k;
        free(u);
    }
    for (int p = 0; p < KVF_GEN_MAX_PROGRAMS; p++) free(j.report[p]);
    if (rc || !images) kvf_jit_images_free(im);
    if (rc) {
        free(all);
        return rc;
    }
    *usage = all;
    *n = total;
    return KVF_OK;
}
