/* NVRTC without a GPU: every shipped scheme compiles for sm_80 and sm_90, and
 * JIT images go through the disk cache (hit, miss on a change of arch). */
#include "testutil.h"
#include "cuda_api.h"
#include "jit.h"

#include <stdlib.h>
#include <string.h>

static char *cache_dir;

static int setup(void **state) {
    (void)state;
    cache_dir = tu_mkdtemp();
    setenv("KVFORGE_CACHE_DIR", cache_dir, 1);
    unsetenv("KVFORGE_CACHE");
    return 0;
}

static int teardown(void **state) {
    (void)state;
    tu_rmtree(cache_dir);
    free(cache_dir);
    return 0;
}

static void every_scheme_compiles(void **state) {
    (void)state;
    const char *archs[2] = {"sm_80", "sm_90"};
    setenv("KVFORGE_CACHE", "0", 1); /* a real compile every time */
    for (const char *const *n = kvf_builtin_schemes(); *n; n++) {
        kvf_scheme *s = tu_scheme(*n);
        for (int a = 0; a < 2; a++) {
            void *image = NULL;
            size_t size = 0;
            const char *origin = NULL;
            int rc = kvf_jit_image(s, archs[a], 0, &image, &size, &origin);
            if (rc == KVF_ENOTIMPL) { /* a method without GPU kernels yet */
                printf("%s: %s (skipped)\n", *n, kvf_last_error());
                break;
            }
            if (rc) fail_msg("%s for %s: %s", *n, archs[a], kvf_last_error());
            assert_string_equal(origin, "nvrtc");
            assert_true(size > 1000);
            assert_memory_equal(image, "\177ELF", 4); /* a cubin is an ELF file */
            free(image);
        }
        kvf_scheme_free(s);
    }
    unsetenv("KVFORGE_CACHE");
}

static void jit_uses_disk_cache(void **state) {
    (void)state;
    kvf_scheme *s = tu_scheme("rtn_int2");
    void *a = NULL, *b = NULL, *c = NULL;
    size_t na, nb, nc;
    const char *oa, *ob, *oc;
    assert_int_equal(kvf_jit_image(s, "sm_90", 0, &a, &na, &oa), KVF_OK);
    assert_string_equal(oa, "nvrtc");
    assert_int_equal(kvf_jit_image(s, "sm_90", 0, &b, &nb, &ob), KVF_OK);
    assert_string_equal(ob, "disk-cache");
    assert_int_equal(na, nb);
    assert_memory_equal(a, b, na);
    assert_int_equal(kvf_jit_image(s, "sm_80", 0, &c, &nc, &oc), KVF_OK);
    assert_string_equal(oc, "nvrtc"); /* another arch is another key */
    free(a); free(b); free(c);
    kvf_scheme_free(s);
}

static void ptx_fallback_compiles(void **state) {
    (void)state;
    kvf_scheme *s = tu_scheme("rtn_int4");
    void *p = NULL;
    size_t n;
    const char *o;
    assert_int_equal(kvf_jit_image(s, "compute_90", 1, &p, &n, &o), KVF_OK);
    assert_non_null(strstr((const char *)p, ".entry"));
    free(p);
    /* A GPU newer than NVRTC knows gets PTX of the newest arch it supports. */
    char arch[32];
    int ptx = 0;
    assert_int_equal(kvf_nvrtc_pick_arch(9, 0, arch, sizeof arch, &ptx), KVF_OK);
    assert_string_equal(arch, "sm_90");
    assert_int_equal(ptx, 0);
    assert_int_equal(kvf_nvrtc_pick_arch(99, 0, arch, sizeof arch, &ptx), KVF_OK);
    assert_int_equal(ptx, 1);
    assert_memory_equal(arch, "compute_", 8);
    kvf_scheme_free(s);
}

static void compile_error_reports_log(void **state) {
    (void)state;
    void *img = NULL;
    size_t n;
    int rc = kvf_nvrtc_compile("this is not CUDA", "broken.cu", "sm_90", 0, &img, &n);
    assert_int_equal(rc, KVF_ECOMPILE);
    assert_non_null(strstr(kvf_last_error(), "broken.cu"));
    assert_null(img);
}

int main(void) {
    const kvf_nvrtc_api *api;
    if (kvf_nvrtc_load(&api)) {
        /* The toolkit is a build dependency (make setup); NVRTC must be there. */
        fprintf(stderr, "NVRTC could not be loaded: %s\n", kvf_last_error());
        return 1;
    }
    printf("NVRTC %d.%d\n", api->major, api->minor);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(every_scheme_compiles),
        cmocka_unit_test(jit_uses_disk_cache),
        cmocka_unit_test(ptx_fallback_compiles),
        cmocka_unit_test(compile_error_reports_log),
    };
    return cmocka_run_group_tests_name("nvrtc", tests, setup, teardown);
}
