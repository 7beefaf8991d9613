/* Generator: determinism, file naming and headers, generated C compiles clean. */
#include "testutil.h"
#include "gen.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void generates_deterministically(void **state) {
    (void)state;
    for (const char *const *n = kvf_builtin_schemes(); *n; n++) {
        kvf_scheme *a = tu_scheme(*n), *b;
        assert_int_equal(kvf_scheme_load(tu_path("schemes/rtn_int2.lua"), &b), KVF_OK);
        kvf_scheme_free(b);
        b = tu_scheme(*n); /* loaded a second time, after another scheme */
        kvf_gen_output x, y;
        assert_int_equal(kvf_gen(a, &x), KVF_OK);
        assert_int_equal(kvf_gen(b, &y), KVF_OK);
        assert_string_equal(x.cu, y.cu);
        assert_string_equal(x.c, y.c);
        assert_string_equal(x.h, y.h);
        assert_int_equal(x.n_programs, y.n_programs);
        for (int p = 0; p < x.n_programs; p++) {
            assert_string_equal(x.program[p], y.program[p]);
            assert_string_equal(x.program_name[p], y.program_name[p]);
        }
        kvf_gen_output_free(&x);
        kvf_gen_output_free(&y);
        kvf_scheme_free(a);
        kvf_scheme_free(b);
    }
}

static void names_and_headers(void **state) {
    (void)state;
    kvf_scheme *s = tu_scheme("rtn_int2");
    kvf_gen_output g;
    assert_int_equal(kvf_gen(s, &g), KVF_OK);
    char want[128];
    snprintf(want, sizeof want, "%s.cu", kvf_scheme_id(s));
    assert_string_equal(g.cu_name, want);
    assert_non_null(strstr(g.cu_name, "rtn_int2_"));
    /* Every file says where it came from and not to edit it, on line one. */
    const char *files[3] = {g.cu, g.c, g.h};
    for (int i = 0; i < 3; i++) {
        const char *nl = strchr(files[i], '\n');
        assert_non_null(nl);
        char first[256];
        snprintf(first, sizeof first, "%.*s", (int)(nl - files[i]), files[i]);
        assert_non_null(strstr(first, "Generated from schemes/rtn_int2.lua"));
        assert_non_null(strstr(first, "Do not edit"));
    }
    /* Configuration only: the CUDA file instantiates, the template computes. */
    assert_non_null(strstr(g.cu, "#include \"kvf_rtn.cuh\""));
    assert_null(strstr(g.cu, "__device__"));
    assert_null(strstr(g.cu, "for ("));
    /* The decode kernel, instantiated in the CUDA file under the plan's name;
     * the C file holds the canonical configuration the AOT export loads. */
    char kname[160], kwant[200];
    kvf_kernel_name(s, KVF_R_DECODE, kname, sizeof kname);
    snprintf(kwant, sizeof kwant, "KVF_DECODE_KERNEL(%s,", kname);
    assert_non_null(strstr(g.cu, kwant));
    snprintf(kwant, sizeof kwant, "const char kvf_%s_scheme[]", kvf_scheme_id(s));
    assert_non_null(strstr(g.c, kwant));
    /* A different configuration gets a different id and different files. */
    kvf_scheme *s4 = tu_scheme("rtn_int4");
    kvf_gen_output g4;
    assert_int_equal(kvf_gen(s4, &g4), KVF_OK);
    assert_string_not_equal(g.cu_name, g4.cu_name);
    assert_string_not_equal(g.cu, g4.cu);
    kvf_gen_output_free(&g4);
    kvf_scheme_free(s4);
    kvf_gen_output_free(&g);
    kvf_scheme_free(s);
}

/* The generated C and header compile with -Wall -Wextra -Werror. */
static void generated_c_compiles(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    for (const char *const *n = kvf_builtin_schemes(); *n; n++) {
        kvf_scheme *s = tu_scheme(*n);
        kvf_gen_output g;
        assert_int_equal(kvf_gen(s, &g), KVF_OK);
        assert_int_equal(kvf_gen_write(&g, dir), KVF_OK);
        char cmd[4096];
        snprintf(cmd, sizeof cmd, "cc -std=c11 -Wall -Wextra -Werror -pedantic -I%s -I%s -c %s/%s -o %s/x.o",
                 tu_path("include"), dir, dir, g.c_name, dir);
        assert_int_equal(system(cmd), 0);
        kvf_gen_output_free(&g);
        kvf_scheme_free(s);
    }
    tu_rmtree(dir);
    free(dir);
}

/* kvf_gen refuses a valid scheme with KVF_ENOTIMPL and names the field. */
static void expect_gen_refused(const char *text, const char *field) {
    kvf_scheme *s = tu_scheme_text(text);
    kvf_gen_output g;
    assert_int_equal(kvf_gen(s, &g), KVF_ENOTIMPL);
    assert_non_null(strstr(kvf_last_error(), field));
    assert_int_equal(kvf_gen_programs(s, &g), KVF_ENOTIMPL); /* the JIT's entry makes the same checks */
    assert_non_null(strstr(kvf_last_error(), field));
    kvf_scheme_free(s);
}

/* A valid scheme naming a method this build does not have is refused clearly. */
static void unimplemented_method_refused(void **state) {
    (void)state;
    expect_gen_refused("return { base = 'quantwm_int2', name = 'wm6', key = { psac_rank = 6 } }", "key.psac_rank = 6");
    /* Valid and a power of two, but U and M U of a head would not fit the statistics kernel's shared memory. */
    expect_gen_refused("return { base = 'quantwm_int2', name = 'wm32', head_dim = 256, key = { psac_rank = 32 } }",
                       "key.psac_rank = 32 with head_dim = 256");
}

/* Values with QSAC: the CPU runs it (w = 1), the GPU encoder would take the
 * plain nearest centroid; refused rather than decoded differently. */
static void value_qsac_refused(void **state) {
    (void)state;
    expect_gen_refused("return { base = 'qvg_int2', name = 'vq', value = { qsac_candidates = 4, kmeans_labels = 'final' } }",
                       "value.qsac_candidates = 4");
}

/* Sections whose k-means kernels would be identical compile them once: the
 * value roles name the key section's kernels (quantwm_int2: only QSAC
 * differs, and values never run it); different arguments keep both. */
static void kmeans_kernels_shared_when_identical(void **state) {
    (void)state;
    const struct { const char *text; int shared; } cases[] = {
        {"return { base = 'qvg_int2', name = 'q' }", 1},
        {"return { base = 'quantwm_int2', name = 'w' }", 1},
        {"return { base = 'qvg_int2', name = 'v4', value = { bits = 4 } }", 0},
        {"return { base = 'qvg_int2', name = 'kx', key = { assign = 'exact' } }", 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kvf_scheme *s = tu_scheme_text(cases[i].text);
        kvf_gen_output g;
        assert_int_equal(kvf_gen(s, &g), KVF_OK);
        assert_int_equal(s->plan.sec[1].kmeans_owner, cases[i].shared ? 0 : 1);
        char k[160], v[160], want[200];
        for (int r = KVF_R_V_PREP; r <= KVF_R_V_RESIDUAL; r++) {
            if (r == KVF_R_V_ASSIGN_QSAC) continue;
            kvf_kernel_name(s, r - KVF_R_SECTION_STRIDE, k, sizeof k);
            kvf_kernel_name(s, r, v, sizeof v);
            if (cases[i].shared) assert_string_equal(k, v);
            else assert_string_not_equal(k, v);
        }
        snprintf(want, sizeof want, "KVF_KMEANS_KERNELS(kvf_%s_v,", kvf_scheme_id(s));
        if (cases[i].shared) assert_null(strstr(g.cu, want));
        else assert_non_null(strstr(g.cu, want));
        snprintf(want, sizeof want, "KVF_KMEANS_KERNELS(kvf_%s_k,", kvf_scheme_id(s));
        assert_non_null(strstr(g.cu, want));
        /* The key section's k-means kernels are instantiated once. */
        const char *first = strstr(g.cu, want);
        assert_null(strstr(first + 1, want));
        kvf_gen_output_free(&g);
        kvf_scheme_free(s);
    }
}

/* A section's assign field reaches its k-means kernels as the last template
 * argument (EXACT): 0 for "fast", the default; 1 for "exact", and for QSAC
 * over more than 8 candidates, which the fast assignment does not keep. */
static void assign_field_sets_exact(void **state) {
    (void)state;
    const struct { const char *text; int k, v; } cases[] = {
        {"return { base = 'quantwm_int2', name = 'w' }", 0, 0},
        {"return { base = 'quantwm_int2', name = 'wx', key = { assign = 'exact' }, value = { assign = 'exact' } }", 1, 1},
        {"return { base = 'quantwm_int2', name = 'w16', key = { qsac_candidates = 16 } }", 1, 0},
        {"return { base = 'qvg_int2', name = 'vx', value = { assign = 'exact' } }", 0, 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kvf_scheme *s = tu_scheme_text(cases[i].text);
        assert_int_equal(s->plan.sec[0].exact, cases[i].k);
        assert_int_equal(s->plan.sec[1].exact, cases[i].v);
        kvf_gen_output g;
        assert_int_equal(kvf_gen(s, &g), KVF_OK);
        for (int t = 0; t < 2; t++) {
            char want[200];
            snprintf(want, sizeof want, "KVF_KMEANS_KERNELS(kvf_%s_%c,", kvf_scheme_id(s), t ? 'v' : 'k');
            const char *line = strstr(g.cu, want);
            if (t == 1 && s->plan.sec[1].kmeans_owner == 0) {
                assert_null(line);
                continue;
            }
            assert_non_null(line);
            const char *end = strchr(line, '\n');
            assert_true(end - line > 3 && end[-1] == ')' && end[-2] == (t ? cases[i].v : cases[i].k) + '0' &&
                        end[-3] == ' ');
        }
        const char *q = strstr(g.cu, "KVF_KMEANS_QSAC_KERNEL(");
        assert_true((q != NULL) == s->plan.has[KVF_R_K_ASSIGN_QSAC]);
        const char *end = q ? strchr(q, '\n') : NULL;
        if (q) assert_true(end[-1] == ')' && end[-2] == cases[i].k + '0');
        kvf_gen_output_free(&g);
        kvf_scheme_free(s);
    }
    /* bits 16 keeps rows: no k-means, no assignment to choose. */
    kvf_scheme *s = tu_scheme_text("return { base = 'qvg_int2', name = 'k16', key = { bits = 16, centroids = 0, "
                                   "assign = 'exact' } }");
    assert_int_equal(s->plan.sec[0].exact, 0);
    kvf_scheme_free(s);
}

/* How many times `line` is a whole line of text. */
static int count_line(const char *text, const char *line, size_t len) {
    int n = 0;
    for (const char *p = text; (p = strstr(p, line)); p += len)
        if ((p == text || p[-1] == '\n') && (p[len] == '\n' || !p[len])) n++;
    return n;
}

/* The JIT's programs hold the whole source's kernels between them, each
 * instantiation in exactly one, and each the format and interface globals:
 * a program for the rest, one per section that owns its k-means kernels, one
 * for the QSAC assignment. */
static void programs_split_the_whole_source(void **state) {
    (void)state;
    const char *texts[] = {
        "return { base = 'rtn_int2', name = 'r' }",
        "return { base = 'kivi_int2', name = 'k' }",
        "return { base = 'qvg_int2', name = 'q' }",           /* values run the keys' k-means kernels */
        "return { base = 'quantwm_int2', name = 'w' }",       /* and QSAC */
        "return { base = 'qvg_int2', name = 'v4', value = { bits = 4 } }",
        "return { base = 'quantwm_int2', name = 'w4', value = { bits = 4 } }", /* all four */
        "return { base = 'quantwm_int2', name = 'wr', value = { centroids = 0 } }",
    };
    const int want_programs[] = {1, 1, 2, 3, 3, 4, 3};
    for (size_t i = 0; i < sizeof texts / sizeof *texts; i++) {
        kvf_scheme *s = tu_scheme_text(texts[i]);
        kvf_gen_output g;
        assert_int_equal(kvf_gen(s, &g), KVF_OK);
        if (g.n_programs != want_programs[i]) fail_msg("%s: %d programs, want %d", texts[i], g.n_programs, want_programs[i]);
        for (int p = 0; p < g.n_programs; p++) {
            char name[160];
            snprintf(name, sizeof name, "%s.p%d.cu", kvf_scheme_id(s), p);
            assert_string_equal(g.program_name[p], name);
            assert_non_null(strstr(g.program[p], "\nKVF_FORMAT_VERSION_GLOBAL("));
            assert_non_null(strstr(g.program[p], "\nKVF_KERNEL_ABI_GLOBAL("));
        }
        /* Every instantiation line of the whole in one program only, and no
         * other line in the programs. */
        int whole_lines = 0, program_lines = 0;
        for (const char *l = g.cu; *l;) {
            size_t len = strcspn(l, "\n");
            if ((!strncmp(l, "KVF_", 4) || !strncmp(l, "typedef ", 8)) && strncmp(l, "KVF_FORMAT_VERSION_GLOBAL(", 26) &&
                strncmp(l, "KVF_KERNEL_ABI_GLOBAL(", 22)) {
                char line[1024];
                snprintf(line, sizeof line, "%.*s", (int)len, l);
                int in = 0;
                for (int p = 0; p < g.n_programs; p++) in += count_line(g.program[p], line, len);
                if (in != 1) fail_msg("%s: \"%s\" in %d programs", texts[i], line, in);
                whole_lines++;
            }
            l += len + (l[len] == '\n');
        }
        for (int p = 0; p < g.n_programs; p++)
            for (const char *l = g.program[p]; *l;) {
                size_t len = strcspn(l, "\n");
                program_lines += !strncmp(l, "KVF_", 4) || !strncmp(l, "typedef ", 8);
                l += len + (l[len] == '\n');
            }
        assert_int_equal(program_lines, whole_lines + 2 * g.n_programs); /* + the two globals each */
        /* kvf_gen_programs (the JIT's): the same programs, and nothing else. */
        kvf_gen_output only;
        assert_int_equal(kvf_gen_programs(s, &only), KVF_OK);
        assert_int_equal(only.n_programs, g.n_programs);
        for (int p = 0; p < g.n_programs; p++) {
            assert_string_equal(only.program[p], g.program[p]);
            assert_string_equal(only.program_name[p], g.program_name[p]);
        }
        assert_null(only.cu);
        assert_null(only.c);
        assert_null(only.h);
        kvf_gen_output_free(&only);
        kvf_gen_output_free(&g);
        kvf_scheme_free(s);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(generates_deterministically),
        cmocka_unit_test(names_and_headers),
        cmocka_unit_test(generated_c_compiles),
        cmocka_unit_test(unimplemented_method_refused),
        cmocka_unit_test(value_qsac_refused),
        cmocka_unit_test(kmeans_kernels_shared_when_identical),
        cmocka_unit_test(assign_field_sets_exact),
        cmocka_unit_test(programs_split_the_whole_source),
    };
    return cmocka_run_group_tests_name("generator", tests, NULL, NULL);
}
