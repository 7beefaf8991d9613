/* JIT: scheme -> generated source -> NVRTC image, through the disk cache. */
#include "cuda_api.h"
#include "gen.h"
#include "jit.h"

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

static void meta_json(const struct kvf_scheme *s, const char *arch, const kvf_nvrtc_api *nv, char *buf,
                      size_t len) {
    snprintf(buf, len,
             "{\"scheme\":\"%s\",\"arch\":\"%s\",\"nvrtc\":\"%d.%d\",\"kvforge\":\"%s\",\"created\":%lld}",
             s->id, arch, nv->major, nv->minor, KVF_VERSION_STRING, (long long)time(NULL));
}

/* A cubin, and ptxas with it, needs a GPU arch: for a virtual one NVRTC
 * writes PTX only (and its "cubin" is empty, without an error). */
static int need_gpu_arch(const char *arch, const char *what) {
    if (!strncmp(arch, "sm_", 3)) return KVF_OK;
    return kvf_set_error(KVF_EINVAL, "arch %s is not a GPU arch (sm_XX), which %s needs (a virtual arch, compute_XX, "
                         "has PTX only)", arch, what);
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
    char cache_arch[40];
    snprintf(cache_arch, sizeof cache_arch, "%s%s", arch, want_ptx ? "-ptx" : "");
    kvf_cache_key key;
    make_key(g.cu, cache_arch, nv, &key);
    if (kvf_cache_get(cache_arch, &key, image, size) == KVF_OK) {
        *origin = "disk-cache";
        kvf_gen_output_free(&g);
        return KVF_OK;
    }
    /* Another process may be compiling the same key: wait for it, look again. */
    int lock = kvf_cache_lock(cache_arch, &key);
    if (lock >= 0 && kvf_cache_get(cache_arch, &key, image, size) == KVF_OK) {
        *origin = "disk-cache";
    } else {
        rc = kvf_nvrtc_compile(g.cu, g.cu_name, arch, want_ptx, image, size);
        if (rc == KVF_OK) {
            char meta[512];
            meta_json(s, cache_arch, nv, meta, sizeof meta);
            kvf_cache_put(cache_arch, &key, meta, *image, *size); /* failures only warn */
            *origin = "nvrtc";
        } else {
            kvf_wrap_error(rc, "scheme %s", s->name);
        }
    }
    if (lock >= 0) kvf_cache_unlock(lock);
    kvf_gen_output_free(&g);
    return rc;
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

int kvf_jit_usage(const struct kvf_scheme *s, const char *arch, kvf_kernel_usage **usage, int *n, void **image,
                  size_t *size) {
    void *img = NULL;
    size_t bytes = 0;
    if (image) *image = NULL;
    int rc = need_gpu_arch(arch, "the register report");
    if (rc) return rc;
    kvf_gen_output g;
    if ((rc = kvf_gen(s, &g))) return rc;
    char *report = NULL;
    rc = kvf_nvrtc_compile_report(g.cu, g.cu_name, arch, &img, &bytes, &report);
    if (rc == KVF_OK) rc = kvf_ptxas_report_parse(report, usage, n);
    if (rc) kvf_wrap_error(rc, "scheme %s for %s", s->name, arch);
    if (rc == KVF_OK && image) {
        *image = img, *size = bytes;
        img = NULL;
    }
    free(img);
    free(report);
    kvf_gen_output_free(&g);
    return rc;
}
