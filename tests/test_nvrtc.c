/* NVRTC without a GPU: every shipped scheme compiles for sm_80 and sm_90, and
 * JIT images go through the disk cache (hit, miss on a change of arch). */
#include "testutil.h"
#include "gpu/cuda_api.h"
#include "gen.h"
#include "gpu/jit.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static char *cache_dir;

/* ---- compiled images, shared: every_scheme_compiles keeps rtn_int4's
 * kvf_jit_image cubins (with the cache off) as the references jit_race
 * compares its racers against, so jit_race need not compile them itself. */
typedef struct jit_result {
    char origin[16];
    size_t size;
    uint8_t *image;
} jit_result;

static const char *const archs[2] = {"sm_80", "sm_90"};
static jit_result rtn_int4_ref[2]; /* per archs[]; image NULL until compiled */

/* Before each test: the cache on, in the suite's directory (a test that
 * turns it off or moves it and then fails does not leave that to the next). */
static int fresh_env(void **state) {
    (void)state;
    setenv("KVFORGE_CACHE_DIR", cache_dir, 1);
    unsetenv("KVFORGE_CACHE");
    return 0;
}

static int setup(void **state) {
    cache_dir = tu_mkdtemp();
    return fresh_env(state);
}

static int teardown(void **state) {
    (void)state;
    for (int a = 0; a < 2; a++) free(rtn_int4_ref[a].image);
    tu_rmtree(cache_dir);
    free(cache_dir);
    return 0;
}

/* A cubin: an ELF file of some size. */
static void check_cubin(const void *image, size_t size) {
    assert_true(size > 1000);
    assert_memory_equal(image, "\177ELF", 4); /* a cubin is an ELF file */
}

/* One scheme's ptxas report (see every_scheme_compiles): every kernel has
 * registers; with strict (NVRTC 13) no kernel spills more than 64 bytes, the
 * assignment kernels (16 warps a block cap them at 128 registers on sm_90)
 * and the group encodes none, the decode neither spills nor has a stack
 * frame (decode_spill > 0: spills at most that many bytes each way, stack
 * allowed). *decode, *assign: how many kernels of each the report lists. */
static void check_usage(const char *label, const char *arch, const kvf_kernel_usage *u, int k, int strict,
                        long decode_spill, int *decode, int *assign) {
    *decode = *assign = 0;
    for (int i = 0; i < k; i++) {
        assert_true(u[i].registers >= 1 && u[i].registers <= 255);
        if (u[i].spill_stores || u[i].spill_loads || !strict)
            print_message("%s %s %s: %d registers, spills %ld/%ld bytes, stack %ld\n", label, arch, u[i].name,
                          u[i].registers, u[i].spill_stores, u[i].spill_loads, u[i].stack);
        const size_t len = strlen(u[i].name), sfx = sizeof "_decode_kv" - 1;
        const int is_decode = len > sfx && !strcmp(u[i].name + len - sfx, "_decode_kv");
        const int is_assign = strstr(u[i].name, "_assign") != NULL;
        *decode += is_decode;
        *assign += is_assign;
        if (!strict) continue;
        assert_true(u[i].spill_stores <= 64 && u[i].spill_loads <= 64);
        if (is_assign) assert_int_equal(u[i].spill_stores + u[i].spill_loads, 0);
        /* The group encodes (RTN, QuaRot, KIVI's keys and values) do not spill
         * (every_scheme_compiles also caps the unrotated RTN kernel's registers). */
        if (strstr(u[i].name, "_encode_k") || strstr(u[i].name, "_encode_v"))
            assert_int_equal(u[i].spill_stores + u[i].spill_loads, 0);
        if (is_decode && !decode_spill) assert_int_equal(u[i].spill_stores + u[i].spill_loads + u[i].stack, 0);
        if (is_decode && decode_spill)
            assert_true(u[i].spill_stores <= decode_spill && u[i].spill_loads <= decode_spill);
    }
}

/* Every shipped scheme compiles for sm_80 and sm_90 to a cubin per program
 * (what a context loads: kvf_jit_programs), with ptxas's report of its
 * kernels (kvforge compile --resources): every kernel listed with its
 * registers, in one program only. With NVRTC 13 (what docs/BENCHMARKS.md's
 * report and the H200 runs used), also the register allocation measured
 * there: the decode, which is bound by bandwidth, neither spills nor uses a
 * stack frame, and no kernel spills more than 64 bytes (qstats_eigen spills 8
 * bytes in some PSAC shapes for sm_90, psac_decode_shapes_do_not_spill); the
 * unrotated RTN encode (RTN, and KIVI's values) stays at 32 registers, 8
 * blocks of 256 threads an SM (kvf_rtn MIN_BLOCKS). Another toolkit
 * allocates registers its own way: there the report is printed. One compile
 * per scheme and arch serves both (the report's cubins differ from the
 * cache's only in the options recorded in them); rtn_int4 also goes through
 * kvf_jit_image (the whole source, one program, as the AOT export compiles
 * it), whose cubins jit_race compares its racers against. */
static void every_scheme_compiles(void **state) {
    (void)state;
    const kvf_nvrtc_api *nv;
    assert_int_equal(kvf_nvrtc_load(&nv), KVF_OK);
    const int strict = nv->major == 13;
    setenv("KVFORGE_CACHE", "0", 1); /* a real compile every time */
    for (const char *const *n = kvf_builtin_schemes(); *n; n++) {
        kvf_scheme *s = tu_scheme(*n);
        for (int a = 0; a < 2; a++) {
            kvf_jit_images im;
            kvf_kernel_usage *u;
            int k = 0;
            if (kvf_jit_usage(s, archs[a], &u, &k, &im))
                fail_msg("%s for %s: %s", *n, archs[a], kvf_last_error());
            /* A cubin per program: the k-means schemes have more than one. */
            assert_in_range(im.n, 1, KVF_GEN_MAX_PROGRAMS);
            assert_true((im.n > 1) == (s->plan.sec[0].path == KVF_PATH_KMEANS || s->plan.sec[1].path == KVF_PATH_KMEANS));
            for (int p = 0; p < im.n; p++) check_cubin(im.image[p], im.size[p]);
            kvf_jit_images_free(&im);
            int decode, assign;
            check_usage(*n, archs[a], u, k, strict, 0, &decode, &assign);
            assert_int_equal(decode, 1); /* one kernel decodes K and V */
            /* One kernel per role the plan says the scheme has (a value
             * section sharing the keys' k-means kernels adds none), each in
             * one program only. */
            int roles[KVF_ROLE_COUNT], assign_roles = 0, n_roles = 0;
            for (int r = 0; r < KVF_ROLE_COUNT; r++)
                if (s->plan.has[r] && s->plan.served_by[r] == r) roles[n_roles++] = r;
            for (int r = 0; r < n_roles; r++) assign_roles += strstr(kvf_role_names[roles[r]], "_assign") != NULL;
            assert_int_equal(k, n_roles);
            for (int r = 0; r < n_roles; r++) {
                char name[160];
                int found = 0;
                kvf_kernel_name(s, roles[r], name, sizeof name);
                for (int i = 0; i < k; i++) found += !strcmp(u[i].name, name);
                if (found != 1) fail_msg("%s for %s: kernel %s in %d programs", *n, archs[a], name, found);
            }
            assert_int_equal(assign, assign_roles);
            /* The unrotated RTN encode (kvf_rtn MIN_BLOCKS): RTN's, and KIVI's values'. */
            for (int i = 0; i < k && strict; i++)
                if ((!strncmp(*n, "rtn_", 4) && strstr(u[i].name, "_encode_")) ||
                    (!strncmp(*n, "kivi_", 5) && strstr(u[i].name, "_encode_v")))
                    assert_in_range(u[i].registers, 1, 32);
            free(u);
            if (strcmp(*n, "rtn_int4")) continue;
            const char *origin = NULL;
            void *image = NULL;
            size_t size = 0;
            int rc = kvf_jit_image(s, archs[a], 0, &image, &size, &origin);
            if (rc) fail_msg("%s for %s: %s", *n, archs[a], kvf_last_error());
            assert_string_equal(origin, "nvrtc");
            check_cubin(image, size);
            free(rtn_int4_ref[a].image);
            rtn_int4_ref[a] = (jit_result){"nvrtc", size, image};
        }
        kvf_scheme_free(s);
    }
}

/* The parser on a report with Windows line ends, a device function's
 * properties between two entries, an entry without shared memory, and one
 * that spills; and on reports it must refuse. */
static void ptxas_report_parsed(void **state) {
    (void)state;
    const char *log = "ptxas info    : 0 bytes gmem\r\n"
                      "ptxas info    : Compiling entry function 'kvf_a' for 'sm_90'\r\n"
                      "ptxas info    : Function properties for kvf_a\r\n"
                      "ptxas         .     16 bytes stack frame, 20 bytes spill stores, 24 bytes spill loads\r\n"
                      "ptxas info    : Used 48 registers, used 1 barriers, 9264 bytes smem, 384 bytes cmem[0]\r\n"
                      "ptxas info    : Function properties for helper\r\n"
                      "ptxas         .     64 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads\r\n"
                      "ptxas info    : Compiling entry function 'kvf_b' for 'sm_90'\r\n"
                      "ptxas info    : Function properties for kvf_b\r\n"
                      "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\r\n"
                      "ptxas info    : Used 8 registers, used 0 barriers, 360 bytes cmem[0]\r\n"
                      "ptxas info    : Compile time = 2.441 ms\r\n";
    kvf_kernel_usage *u;
    int n = 0;
    assert_int_equal(kvf_ptxas_report_parse(log, &u, &n), KVF_OK);
    assert_int_equal(n, 2);
    assert_string_equal(u[0].name, "kvf_a");
    assert_int_equal(u[0].registers, 48);
    assert_int_equal(u[0].barriers, 1);
    assert_int_equal(u[0].stack, 16);
    assert_int_equal(u[0].spill_stores, 20);
    assert_int_equal(u[0].spill_loads, 24);
    assert_int_equal(u[0].smem, 9264);
    assert_string_equal(u[1].name, "kvf_b");
    assert_int_equal(u[1].registers, 8);
    assert_int_equal(u[1].barriers, 0);
    assert_int_equal(u[1].smem, 0);
    assert_int_equal(u[1].spill_stores + u[1].spill_loads + u[1].stack, 0); /* not helper's */
    free(u);
    /* An entry without its register line, one without its own stack/spill
     * line (helper's does not count), and a report without entries. */
    const char *no_regs = "ptxas info    : Compiling entry function 'kvf_a' for 'sm_90'\n"
                          "ptxas info    : Function properties for kvf_a\n"
                          "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n";
    assert_int_equal(kvf_ptxas_report_parse(no_regs, &u, &n), KVF_EFORMAT);
    assert_non_null(strstr(kvf_last_error(), "kernel 'kvf_a' has no \"Used N registers\" line"));
    const char *no_spills = "ptxas info    : Compiling entry function 'kvf_a' for 'sm_90'\n"
                            "ptxas info    : Function properties for helper\n"
                            "ptxas         .     8 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads\n"
                            "ptxas info    : Used 40 registers, used 0 barriers\n";
    assert_int_equal(kvf_ptxas_report_parse(no_spills, &u, &n), KVF_EFORMAT);
    assert_non_null(strstr(kvf_last_error(), "kernel 'kvf_a' has no \"N bytes stack frame"));
    assert_int_equal(kvf_ptxas_report_parse("ptxas info    : 0 bytes gmem\n", &u, &n), KVF_EFORMAT);
    assert_non_null(strstr(kvf_last_error(), "no kernel"));
    /* A virtual arch has no ptxas report. */
    kvf_scheme *s = tu_scheme("rtn_int2");
    assert_int_equal(kvf_jit_usage(s, "compute_90", &u, &n, NULL), KVF_EINVAL);
    assert_non_null(
        strstr(kvf_last_error(), "arch compute_90 is not a GPU arch (sm_XX), which the register report needs"));
    kvf_scheme_free(s);
}

/* The decode of PSAC shapes other than the shipped ones (ranks 2-32,
 * head_dim 64-256, two stages, Hadamard keys) neither spills nor has a stack
 * frame on sm_90: kvf_decode::section's MIN_BLOCKS_AS_KEY bounds the joined
 * kernel to 64 registers only where that holds (a bound for every
 * single-stage PSAC key spilled all of these but rank 2 and the two-stage
 * shape; Hadamard's 8/12 bytes). RoPE-pre keys
 * have a stack frame for RoPE's calls (64 bytes, no spills, with the PSAC
 * basis in shared memory: docs/journal/benchmarks.md, entry 7f36120): at
 * most 8 bytes of spills. Every other kernel
 * as check_usage requires. With NVRTC 13, as every_scheme_compiles. */
static void psac_decode_shapes_do_not_spill(void **state) {
    (void)state;
    const kvf_nvrtc_api *nv;
    assert_int_equal(kvf_nvrtc_load(&nv), KVF_OK);
    if (nv->major != 13) skip();
    const char *const shapes[] = {
        "return { base = 'quantwm_int2', name = 'wm_d64_r2', head_dim = 64, key = { psac_rank = 2 } }",
        "return { base = 'quantwm_int2', name = 'wm_d64_r16', head_dim = 64, key = { psac_rank = 16 } }",
        "return { base = 'quantwm_int2', name = 'wm_d128_r16', key = { psac_rank = 16 } }",
        "return { base = 'quantwm_int2', name = 'wm_d128_r32', key = { psac_rank = 32 } }",
        "return { base = 'quantwm_int2', name = 'wm_d256_r8', head_dim = 256, key = { psac_rank = 8 } }",
        "return { base = 'quantwm_int2', name = 'wm_d256_r16', head_dim = 256, key = { psac_rank = 16 } }",
        "return { base = 'quantwm_int2', name = 'wm2_r32', key = { psac_rank = 32, stages = 2 } }",
        "return { base = 'quantwm_int2', name = 'wm_rot', key = { rotation = 'hadamard' } }",
        "return { base = 'quantwm_int2', name = 'wm_rope', rope = { placement = 'pre' } }",
    };
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) {
        kvf_scheme *s = tu_scheme_text(shapes[i]);
        kvf_kernel_usage *u;
        int k = 0, decode, assign;
        if (kvf_jit_usage(s, "sm_90", &u, &k, NULL)) fail_msg("%s: %s", shapes[i], kvf_last_error());
        /* Keys cached before RoPE with PSAC (a shape no shipped scheme has)
         * spill a little at the decode's 64 registers: 12/16 bytes with
         * the decode's one parameter struct (kvf_abi.h), 8/8 before it. */
        check_usage(s->name, "sm_90", u, k, 1, strstr(shapes[i], "'pre'") ? 16 : 0, &decode, &assign);
        assert_int_equal(decode, 1);
        free(u);
        kvf_scheme_free(s);
    }
}

/* kvf_bench's probe (bench/kvf_probe.cuh, embedded in kvf_bench and here)
 * compiles for both archs with the library's templates as include files: its
 * four kernels and the geometry global the bench reads; with NVRTC 13 no
 * kernel spills (as every_scheme_compiles). */
static void bench_probe_compiles(void **state) {
    (void)state;
    const kvf_nvrtc_api *nv;
    assert_int_equal(kvf_nvrtc_load(&nv), KVF_OK);
    assert_string_equal(kvf_bench_probe[0].name, "kvf_probe.cuh");
    /* The geometry global the bench reads: 7 u32 (28 bytes) in global memory. */
    void *ptx = NULL;
    size_t ptx_size = 0;
    if (kvf_nvrtc_compile(kvf_bench_probe[0].data, "kvf_probe.cu", "compute_90", 1, &ptx, &ptx_size))
        fail_msg("probe PTX: %s", kvf_last_error());
    assert_non_null(memmem(ptx, ptx_size, ".global .align 4 .b8 kvf_probe_geometry[28]",
                           strlen(".global .align 4 .b8 kvf_probe_geometry[28]")));
    free(ptx);
    for (int a = 0; a < 2; a++) {
        void *image = NULL;
        size_t size = 0;
        char *report = NULL;
        if (kvf_nvrtc_compile_report(kvf_bench_probe[0].data, "kvf_probe.cu", archs[a], &image, &size, &report))
            fail_msg("probe for %s: %s", archs[a], kvf_last_error());
        check_cubin(image, size);
        kvf_kernel_usage *u;
        int n = 0;
        assert_int_equal(kvf_ptxas_report_parse(report, &u, &n), KVF_OK);
        assert_int_equal(n, 4);
        const char *kernels[4] = {"kvf_probe_int2", "kvf_probe_int2_gather", "kvf_probe_int2_split", "kvf_probe_write"};
        int seen = 0;
        for (int i = 0; i < n; i++) {
            for (int k = 0; k < 4; k++) seen |= !strcmp(u[i].name, kernels[k]) << k;
            if (nv->major == 13) assert_int_equal(u[i].spill_stores + u[i].spill_loads + u[i].stack, 0);
        }
        assert_int_equal(seen, 15);
        free(u);
        free(report);
        free(image);
    }
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

/* What a context loads: a k-means scheme with QSAC as its three programs,
 * compiled at once, then each from the disk cache with the same bytes; as
 * PTX too (a GPU newer than NVRTC), each program with the globals a context
 * checks; a cubin of a virtual arch refused before anything is compiled. */
static void jit_programs_use_disk_cache(void **state) {
    (void)state;
    kvf_scheme *s = tu_scheme_text("return { base = 'quantwm_int2', name = 'jp', head_dim = 64 }");
    kvf_jit_images a, b, p;
    assert_int_equal(kvf_jit_programs(s, "sm_90", 0, &a), KVF_OK);
    assert_string_equal(a.origin, "nvrtc");
    assert_int_equal(a.n, 3);
    assert_int_equal(kvf_jit_programs(s, "sm_90", 0, &b), KVF_OK);
    assert_string_equal(b.origin, "disk-cache");
    assert_int_equal(b.n, a.n);
    for (int i = 0; i < a.n; i++) {
        check_cubin(a.image[i], a.size[i]);
        assert_int_equal(a.size[i], b.size[i]);
        assert_memory_equal(a.image[i], b.image[i], a.size[i]);
        for (int j = 0; j < i; j++) assert_true(a.size[i] != a.size[j] || memcmp(a.image[i], a.image[j], a.size[i]));
    }
    assert_int_equal(kvf_jit_programs(s, "compute_90", 1, &p), KVF_OK);
    assert_int_equal(p.n, 3);
    char want[2][64];
    snprintf(want[0], sizeof want[0], " kvf_format_version = %u;", KVF_FORMAT_VERSION);
    snprintf(want[1], sizeof want[1], " kvf_kernel_abi = %u;", kvf_kernel_abi());
    for (int i = 0; i < p.n; i++) {
        assert_non_null(strstr((const char *)p.image[i], ".entry"));
        for (int w = 0; w < 2; w++) assert_non_null(strstr((const char *)p.image[i], want[w]));
    }
    kvf_jit_images_free(&a);
    kvf_jit_images_free(&b);
    kvf_jit_images_free(&p);
    assert_int_equal(kvf_jit_programs(s, "compute_90", 0, &a), KVF_EINVAL);
    assert_int_equal(a.n, 0);
    assert_null(a.image[0]);
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
    /* The two globals a context checks on load (runtime/gpu/context.c
     * check_image_format), with this library's values: test_gpu checks the
     * refusal of an image without them or with other values. */
    char want[64];
    snprintf(want, sizeof want, " kvf_format_version = %u;", KVF_FORMAT_VERSION);
    assert_non_null(strstr((const char *)p, want));
    snprintf(want, sizeof want, " kvf_kernel_abi = %u;", kvf_kernel_abi());
    assert_non_null(strstr((const char *)p, want));
    free(p);
    /* A cubin of a virtual arch: NVRTC would give an empty one; refused
     * before anything is compiled or cached. */
    p = &n; /* not NULL: the call must clear it */
    assert_int_equal(kvf_jit_image(s, "compute_90", 0, &p, &n, &o), KVF_EINVAL);
    assert_null(p);
    assert_non_null(strstr(kvf_last_error(), "arch compute_90 is not a GPU arch (sm_XX), which a cubin needs"));
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

/* ---- racing on one key: every racer gets the same, correct image, and the
 * flock in kvf_jit_image lets only one of them compile. */

static void jit_once(const char *arch, jit_result *r) {
    kvf_scheme *s = NULL;
    const char *origin = "";
    void *image = NULL;
    memset(r, 0, sizeof *r);
    if (kvf_scheme_load_builtin("rtn_int4", &s) == KVF_OK &&
        kvf_jit_image(s, arch, 0, &image, &r->size, &origin) == KVF_OK) {
        snprintf(r->origin, sizeof r->origin, "%s", origin);
        r->image = image;
    }
    kvf_scheme_free(s);
}

/* The racers' results against a reference image compiled with the cache off
 * (every_scheme_compiles', when it ran). */
static void check_race(const jit_result *r, int n, const char *arch) {
    jit_result own = {"", 0, NULL};
    const jit_result *ref = &own;
    for (int a = 0; a < 2; a++)
        if (!strcmp(arch, archs[a]) && rtn_int4_ref[a].image) ref = &rtn_int4_ref[a];
    if (!ref->image) {
        setenv("KVFORGE_CACHE", "0", 1);
        jit_once(arch, &own);
        unsetenv("KVFORGE_CACHE");
    }
    assert_non_null(ref->image);
    int compiled = 0;
    for (int i = 0; i < n; i++) {
        if (!r[i].image) fail_msg("racer %d got no image", i);
        assert_int_equal(r[i].size, ref->size);
        assert_memory_equal(r[i].image, ref->image, ref->size);
        compiled += !strcmp(r[i].origin, "nvrtc");
        if (strcmp(r[i].origin, "nvrtc") && strcmp(r[i].origin, "disk-cache"))
            fail_msg("racer %d: origin %s", i, r[i].origin);
    }
    assert_int_equal(compiled, 1);
    free(own.image);
}

static void *jit_thread(void *p) {
    jit_result *r = p;
    jit_once("sm_80", r);
    return NULL;
}

static void jit_race(void **state) {
    (void)state;
    enum { N = 2 };
    char *dir = tu_mkdtemp();
    setenv("KVFORGE_CACHE_DIR", dir, 1);
    /* two processes: each sends its origin and image through a pipe */
    jit_result r[N];
    int fds[N][2];
    pid_t pid[N];
    for (int i = 0; i < N; i++) {
        assert_int_equal(pipe(fds[i]), 0);
        pid[i] = fork();
        assert_true(pid[i] >= 0);
        if (pid[i] == 0) {
            jit_result mine;
            jit_once("sm_90", &mine);
            int ok = write(fds[i][1], &mine, sizeof mine) == (ssize_t)sizeof mine &&
                     (!mine.size || write(fds[i][1], mine.image, mine.size) == (ssize_t)mine.size);
            _exit(ok ? 0 : 1);
        }
        close(fds[i][1]);
    }
    for (int i = 0; i < N; i++) {
        FILE *f = fdopen(fds[i][0], "rb");
        assert_non_null(f);
        assert_int_equal(fread(&r[i], sizeof r[i], 1, f), 1);
        r[i].image = malloc(r[i].size ? r[i].size : 1);
        assert_int_equal(fread(r[i].image, 1, r[i].size, f), r[i].size);
        fclose(f);
        int status;
        assert_int_equal(waitpid(pid[i], &status, 0), pid[i]);
        assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    check_race(r, N, "sm_90");
    for (int i = 0; i < N; i++) free(r[i].image);
    /* two threads, another arch (another key) */
    pthread_t th[N];
    for (int i = 0; i < N; i++) assert_int_equal(pthread_create(&th[i], NULL, jit_thread, &r[i]), 0);
    for (int i = 0; i < N; i++) pthread_join(th[i], NULL);
    check_race(r, N, "sm_80");
    for (int i = 0; i < N; i++) free(r[i].image);
    tu_rmtree(dir); /* the next test's fresh_env points the cache back at cache_dir */
    free(dir);
}

static void compile_error_reports_log(void **state) {
    (void)state;
    void *img = NULL;
    size_t n;
    int rc = kvf_nvrtc_compile("this is not CUDA", "broken.cu", "sm_90", 0, &img, &n);
    assert_int_equal(rc, KVF_ECOMPILE);
    assert_non_null(strstr(kvf_last_error(), "broken.cu"));
    assert_null(img);
    /* A template's KVF_NOT_ON_THIS_ARCH assertion alone is KVF_ENOTIMPL;
     * with any other error beside it, KVF_ECOMPILE (the log has both). */
    const char *marked = "#include \"kvf_common.cuh\"\n"
                         "static_assert(sizeof(int) == 3, KVF_NOT_ON_THIS_ARCH \"too small here\");\n";
    rc = kvf_nvrtc_compile(marked, "marked.cu", "sm_90", 0, &img, &n);
    assert_int_equal(rc, KVF_ENOTIMPL);
    assert_non_null(strstr(kvf_last_error(), "marked.cu cannot run on sm_90"));
    assert_non_null(strstr(kvf_last_error(), "too small here"));
    assert_null(img);
    const char *both = "#include \"kvf_common.cuh\"\n"
                       "static_assert(sizeof(int) == 3, KVF_NOT_ON_THIS_ARCH \"too small here\");\n"
                       "int f() { return g; }\n";
    rc = kvf_nvrtc_compile(both, "both.cu", "sm_90", 0, &img, &n);
    assert_int_equal(rc, KVF_ECOMPILE);
    assert_non_null(strstr(kvf_last_error(), "too small here"));
    assert_null(img);
}

/* The k-means assignment sizes its block to the arch's shared memory
 * (kvf_kmeans smem_optin_bytes): qvg_int2 and quantwm_int2 (between them
 * the plain and the QSAC assignment) also compile for sm_86 (99 KiB a block,
 * against sm_90's 227 KiB), head_dim 256 fits sm_80's 163 KiB, and where its
 * centroid rows alone do not fit (sm_86) the compile fails saying so, as
 * KVF_ENOTIMPL (a valid scheme this arch cannot run; other failed compiles
 * are KVF_ECOMPILE, compile_error_reports_log), instead of an image whose
 * launch fails on the device. The fit is decided
 * by the front end (a static_assert): PTX is enough. The assignment with the
 * most registers, QSAC over M = 8 candidates on an f32 source (a second key
 * stage), takes 14 warps on sm_90 (8 on sm_80, with more registers to
 * spare): the report's rules of every_scheme_compiles hold for it. */
/* The pipeline's kernels (outliers, refined channels, anchors, error
 * feedback; METHODS.md 11) compile for sm_90 over an RTN and a k-means base,
 * with each option alone and all together; with NVRTC 13 the row encodes
 * and the decode do not spill. */
static void pipeline_shapes_compile(void **state) {
    (void)state;
    const kvf_nvrtc_api *nv;
    assert_int_equal(kvf_nvrtc_load(&nv), KVF_OK);
    for (int base = 0; base < 2; base++)
        for (int opt = 0; opt < 5; opt++) {
            struct kvf_scheme s;
            tu_hand_scheme(&s, 128, 2, 2, 64, KVF_MODE_AFFINE);
            if (base) s.key.centroids = s.value.centroids = 64;
            if (opt == 0 || opt == 4) s.pipe.outliers[0] = s.pipe.outliers[1] = 2;
            if (opt == 1 || opt == 4) s.pipe.mp_fraction[0] = 0.2, s.pipe.mp_fraction[1] = 0.1, s.pipe.mp_refine_bits = 2;
            if (opt == 2 || opt == 4) s.pipe.anchor_every = 8, s.pipe.anchor_bits = opt == 4 ? 8 : 4;
            if (opt == 3 || opt == 4) s.pipe.feedback_decay = 0.7;
            tu_finalize(&s);
            kvf_kernel_usage *u;
            int k = 0, decode, assign;
            if (kvf_jit_usage(&s, "sm_90", &u, &k, NULL)) fail_msg("base %d option %d: %s", base, opt, kvf_last_error());
            check_usage(base ? "pipe_kmeans" : "pipe_rtn", "sm_90", u, k, nv->major == 13, 0, &decode, &assign);
            assert_int_equal(decode, 1);
            free(u);
        }
}

static void kmeans_fits_arch_shared_memory(void **state) {
    (void)state;
    setenv("KVFORGE_CACHE", "0", 1);
    const char *const d256 = "return { base = 'qvg_int2', name = 'qvg_d256', head_dim = 256 }";
    const struct { const char *name, *text, *arch; int rc; } cases[] = {
        {"qvg_int2", NULL, "compute_86", KVF_OK},
        {"quantwm_int2", NULL, "compute_86", KVF_OK},
        {"qvg_d256", d256, "compute_80", KVF_OK},
        {"qvg_d256", d256, "compute_86", KVF_ENOTIMPL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kvf_scheme *s = cases[i].text ? tu_scheme_text(cases[i].text) : tu_scheme(cases[i].name);
        void *image = NULL;
        size_t size = 0;
        const char *origin;
        int rc = kvf_jit_image(s, cases[i].arch, 1, &image, &size, &origin);
        if (rc != cases[i].rc)
            fail_msg("%s for %s: %d (%s), expected %d", cases[i].name, cases[i].arch, rc, rc ? kvf_last_error() : "",
                     cases[i].rc);
        if (rc) {
            assert_null(image);
            assert_non_null(strstr(kvf_last_error(), "more shared memory than this GPU arch has"));
        }
        free(image);
        kvf_scheme_free(s);
    }
    const kvf_nvrtc_api *nv;
    assert_int_equal(kvf_nvrtc_load(&nv), KVF_OK);
    kvf_scheme *wm8 = tu_scheme_text("return { base = 'quantwm_int2', name = 'wm8', key = { qsac_candidates = 8, "
                                     "stages = 2 } }");
    kvf_kernel_usage *u;
    int k = 0, decode, assign;
    if (kvf_jit_usage(wm8, "sm_90", &u, &k, NULL)) fail_msg("wm8 for sm_90: %s", kvf_last_error());
    check_usage("wm8", "sm_90", u, k, nv->major == 13, 0, &decode, &assign);
    assert_int_equal(assign, 3); /* k_assign, k_assign_qsac, v_assign */
    free(u);
    kvf_scheme_free(wm8);
}

/* The shipped schemes take the fast assignment (every_scheme_compiles); the
 * exact one (assign = "exact", what the GPU tests compare with the CPU byte
 * for byte) compiles as well and under the same rules: the plain assignment
 * over a BF16 source and over the f32 workspace (qvg_pro_int2), QSAC
 * (quantwm_int2), QSAC over M = 8 on an f32 source (the most registers),
 * for sm_90; and it still fits sm_86's shared memory. */
static void exact_assignment_compiles(void **state) {
    (void)state;
    const kvf_nvrtc_api *nv;
    assert_int_equal(kvf_nvrtc_load(&nv), KVF_OK);
    setenv("KVFORGE_CACHE", "0", 1);
    const struct { const char *text, *arch; int assigns; } cases[] = {
        {"return { base = 'qvg_int2', name = 'qx', key = { assign = 'exact' }, value = { assign = 'exact' } }",
         "sm_90", 1},
        {"return { base = 'qvg_pro_int2', name = 'px', key = { assign = 'exact' }, value = { assign = 'exact' } }",
         "sm_90", 1},
        {"return { base = 'quantwm_int2', name = 'wx', key = { assign = 'exact' }, value = { assign = 'exact' } }",
         "sm_90", 2},
        {"return { base = 'quantwm_int2', name = 'wx8', key = { qsac_candidates = 8, stages = 2, assign = 'exact' }, "
         "value = { assign = 'exact' } }", "sm_90", 3},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kvf_scheme *s = tu_scheme_text(cases[i].text);
        assert_true(s->plan.sec[0].exact && s->plan.sec[1].exact);
        kvf_kernel_usage *u;
        int k = 0, decode, assign;
        if (kvf_jit_usage(s, cases[i].arch, &u, &k, NULL)) fail_msg("%s: %s", cases[i].text, kvf_last_error());
        check_usage(s->name, cases[i].arch, u, k, nv->major == 13, 0, &decode, &assign);
        assert_int_equal(assign, cases[i].assigns);
        free(u);
        kvf_scheme_free(s);
    }
    kvf_scheme *s = tu_scheme_text(cases[2].text);
    void *image = NULL;
    size_t size = 0;
    const char *origin;
    if (kvf_jit_image(s, "compute_86", 1, &image, &size, &origin)) fail_msg("wx for compute_86: %s", kvf_last_error());
    free(image);
    kvf_scheme_free(s);
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
        cmocka_unit_test_setup(every_scheme_compiles, fresh_env),
        cmocka_unit_test_setup(ptxas_report_parsed, fresh_env),
        cmocka_unit_test_setup(psac_decode_shapes_do_not_spill, fresh_env),
        cmocka_unit_test_setup(bench_probe_compiles, fresh_env),
        cmocka_unit_test_setup(jit_uses_disk_cache, fresh_env),
        cmocka_unit_test_setup(jit_programs_use_disk_cache, fresh_env),
        cmocka_unit_test_setup(ptx_fallback_compiles, fresh_env),
        cmocka_unit_test_setup(jit_race, fresh_env),
        cmocka_unit_test_setup(compile_error_reports_log, fresh_env),
        cmocka_unit_test_setup(kmeans_fits_arch_shared_memory, fresh_env),
        cmocka_unit_test_setup(exact_assignment_compiles, fresh_env),
        cmocka_unit_test_setup(pipeline_shapes_compile, fresh_env),
    };
    return cmocka_run_group_tests_name("nvrtc", tests, setup, teardown);
}
