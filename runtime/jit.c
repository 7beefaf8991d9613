/* JIT: scheme -> generated source -> NVRTC image, through the disk cache. */
#include "cuda_api.h"
#include "gen.h"
#include "jit.h"

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

int kvf_jit_image(const struct kvf_scheme *s, const char *arch, int want_ptx, void **image, size_t *size,
                  const char **origin) {
    const kvf_nvrtc_api *nv;
    int rc = kvf_nvrtc_load(&nv);
    if (rc) return rc;
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
