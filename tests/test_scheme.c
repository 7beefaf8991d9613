/* Scheme loader: shipped schemes, defaults, inheritance, canonical text, and a
 * corpus of bad and hostile files (tests/schemes_bad/) with their messages. */
#include "testutil.h"

#include <dirent.h>
#include <lauxlib.h>
#include <lua.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------- helpers */

/* snprintf that fails the test on truncation. */
static void fmt(char *buf, size_t n, const char *f, ...) __attribute__((format(printf, 3, 4)));
static void fmt(char *buf, size_t n, const char *f, ...) {
    va_list ap;
    va_start(ap, f);
    int k = vsnprintf(buf, n, f, ap);
    va_end(ap);
    if (k < 0 || (size_t)k >= n) fail_msg("test buffer too small for \"%s\"", f);
}

static kvf_scheme *load_file(const char *path) {
    kvf_scheme *s = NULL;
    int rc = kvf_scheme_load(path, &s);
    if (rc) fail_msg("loading %s: %s", path, kvf_last_error());
    return s;
}

static void write_file(const char *dir, const char *name, const char *text) {
    tu_write_file(tu_join(dir, name), text, strlen(text));
}

/* CPU time of this thread: what the sandbox's time limit counts, and what a
 * loaded machine does not inflate. */
static double cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Expect failure with status rc and a message that contains want. */
static void expect_error(int got_rc, int rc, const char *want) {
    if (got_rc != rc)
        fail_msg("status %d (%s), wanted %d; message: %s", got_rc, kvf_status_name(got_rc), rc,
                 kvf_last_error());
    if (!strstr(kvf_last_error(), want))
        fail_msg("message \"%s\" lacks \"%s\"", kvf_last_error(), want);
}

static void expect_str_error(const char *text, const char *want) {
    kvf_scheme *s = (kvf_scheme *)1;
    expect_error(kvf_scheme_load_string(text, strlen(text), "=str", &s), KVF_ESCHEME, want);
    assert_null(s);
}

/* ------------------------------------------------------ shipped schemes */

static const char rtn_int2_canonical[] =
    "return {\n"
    "  name = \"rtn_int2\",\n"
    "  head_dim = 128,\n"
    "  key = { assign = \"fast\", axis = \"channel\", bits = 2, centroids = 0, group_size = 64, kmeans_iters = 2, "
    "kmeans_labels = \"final\", mode = \"affine\", psac_rank = 0, qsac_candidates = 1, rotation = \"none\", "
    "scale_format = \"fp16\", seed = 0, stages = 1 },\n"
    "  value = { assign = \"fast\", axis = \"channel\", bits = 2, centroids = 0, group_size = 64, kmeans_iters = 2, "
    "kmeans_labels = \"final\", mode = \"affine\", psac_rank = 0, qsac_candidates = 1, rotation = \"none\", "
    "scale_format = \"fp16\", seed = 0, stages = 1 },\n"
    "  rope = { layout = \"half\", placement = \"none\", sections = { 64 }, theta = 10000.0 },\n"
    "  chunk = { recent = 0, sink = 0, span = 1, tokens = 4680 },\n"
    "}\n";

static void test_builtin_list_loads(void **state) {
    (void)state;
    const char *const *names = kvf_builtin_schemes();
    int n = 0, saw2 = 0, saw4 = 0;
    assert_non_null(names);
    assert_ptr_equal(names, kvf_builtin_schemes());
    for (; names[n]; n++) {
        kvf_scheme *s = tu_scheme(names[n]);
        char src[128];
        fmt(src, sizeof src, "<builtin>/%s.lua", names[n]);
        assert_string_equal(kvf_scheme_name(s), names[n]);
        assert_string_equal(s->source, src);
        assert_int_equal(kvf_scheme_head_dim(s), 128);
        saw2 += !strcmp(names[n], "rtn_int2");
        saw4 += !strcmp(names[n], "rtn_int4");
        kvf_scheme_free(s);
    }
    assert_true(n >= 2);
    assert_int_equal(saw2, 1);
    assert_int_equal(saw4, 1);
}

/* Every .lua file in schemes/ loads from disk and matches the embedded copy. */
/* Calls fn(path, name) for each NAME.lua in the repository folder dir;
 * returns how many. */
static int each_lua_file(const char *dir, void (*fn)(const char *path, const char *name)) {
    DIR *d = opendir(tu_path(dir));
    struct dirent *e;
    int n = 0;
    assert_non_null(d);
    while ((e = readdir(d))) {
        size_t len = strlen(e->d_name);
        if (len < 5 || strcmp(e->d_name + len - 4, ".lua")) continue;
        char rel[512], path[1024], name[256]; /* path: a copy (tu_path's buffers rotate) */
        fmt(rel, sizeof rel, "%s/%s", dir, e->d_name);
        fmt(path, sizeof path, "%s", tu_path(rel));
        fmt(name, sizeof name, "%.*s", (int)(len - 4), e->d_name);
        fn(path, name);
        n++;
    }
    closedir(d);
    return n;
}

static void disk_matches_builtin(const char *path, const char *name) {
    kvf_scheme *disk = load_file(path), *emb = tu_scheme(name);
    assert_string_equal(disk->source, path);
    assert_string_equal(kvf_scheme_canonical(disk), kvf_scheme_canonical(emb));
    assert_true(kvf_scheme_hash(disk) == kvf_scheme_hash(emb));
    assert_string_equal(kvf_scheme_id(disk), kvf_scheme_id(emb));
    kvf_scheme_free(disk);
    kvf_scheme_free(emb);
}

static void test_disk_schemes_match_builtin(void **state) {
    (void)state;
    int n = each_lua_file("schemes", disk_matches_builtin);
    int builtins = 0;
    while (kvf_builtin_schemes()[builtins]) builtins++;
    assert_int_equal(n, builtins);
}

/* A tensor of plain RTN: channel groups of 64, affine, fp16 scales, no
 * centroids, QSAC, PSAC or stages. */
static void check_rtn_tensor(const kvf_tensor_cfg *t, int bits) {
    assert_int_equal(t->bits, bits);
    assert_int_equal(t->group_size, 64);
    assert_int_equal(t->axis, KVF_AXIS_CHANNEL);
    assert_int_equal(t->mode, KVF_MODE_AFFINE);
    assert_int_equal(t->scale_format, KVF_SCALE_FP16);
    assert_int_equal(t->centroids, 0);
    assert_int_equal(t->qsac_candidates, 1);
    assert_int_equal(t->psac_rank, 0);
    assert_int_equal(t->stages, 1);
}

static void check_rtn(const kvf_scheme *s, int bits) {
    check_rtn_tensor(&s->key, bits);
    check_rtn_tensor(&s->value, bits);
    assert_int_equal(s->head_dim, 128);
    assert_int_equal(s->rope.placement, KVF_ROPE_NONE);
}

static void test_rtn_schemes(void **state) {
    (void)state;
    kvf_scheme *s2 = tu_scheme("rtn_int2"), *s4 = tu_scheme("rtn_int4");
    check_rtn(s2, 2);
    check_rtn(s4, 4);
    assert_string_equal(kvf_scheme_canonical(s2), rtn_int2_canonical);
    assert_null(strstr(kvf_scheme_canonical(s2), "source"));
    char id[64];
    fmt(id, sizeof id, "rtn_int2_%08x", (unsigned)(kvf_scheme_hash(s2) >> 32));
    assert_string_equal(kvf_scheme_id(s2), id);
    assert_int_equal(strlen(kvf_scheme_id(s4)), strlen("rtn_int4_") + 8);
    assert_true(kvf_scheme_hash(s2) != kvf_scheme_hash(s4));
    kvf_scheme_free(s2);
    kvf_scheme_free(s4);
}

/* ------------------------------------------------------------ defaults */

static void test_defaults(void **state) {
    (void)state;
    kvf_scheme *s = tu_scheme_text("return {}");
    struct kvf_scheme d;
    kvf_scheme_defaults(&d);
    assert_string_equal(s->name, "scheme");
    assert_string_equal(s->source, "test");
    assert_string_equal(d.name, "");
    assert_int_equal(d.canonical[0], 0);
    const kvf_tensor_cfg *t[3] = {&s->key, &s->value, &d.key};
    for (int i = 0; i < 3; i++) {
        check_rtn_tensor(t[i], 2);
        assert_int_equal(t[i]->kmeans_iters, 2);
        assert_int_equal(t[i]->kmeans_labels, KVF_LABELS_FINAL);
        assert_true(t[i]->seed == 0);
        assert_int_equal(t[i]->rotation, KVF_ROTATION_NONE);
        assert_int_equal(t[i]->assign, KVF_ASSIGN_FAST);
    }
    assert_int_equal(s->head_dim, 128);
    assert_int_equal(s->rope.placement, KVF_ROPE_NONE);
    assert_int_equal(s->rope.layout, KVF_ROPE_HALF);
    /* rope.sections depends on head_dim: absent (0) until the scheme is finalized,
     * then one section of head_dim / 2 pairs. */
    assert_int_equal(d.rope.n_sections, 0);
    assert_int_equal(s->rope.n_sections, 1);
    assert_int_equal(s->rope.sections[0], 64);
    assert_int_equal(kvf_scheme_finalize(&d), KVF_OK);
    assert_true(s->rope.theta == 10000.0);
    assert_int_equal(s->chunk.tokens, 4680);
    assert_int_equal(s->chunk.span, 1);
    assert_int_equal(s->chunk.recent, 0);
    assert_int_equal(s->chunk.sink, 0);
    assert_memory_equal(&s->key, &d.key, sizeof d.key);
    assert_memory_equal(&s->value, &d.value, sizeof d.value);
    assert_memory_equal(&s->rope, &d.rope, sizeof d.rope);
    assert_memory_equal(&s->chunk, &d.chunk, sizeof d.chunk);
    kvf_scheme *h64 = tu_scheme_text("return { head_dim = 64 }");
    assert_int_equal(h64->rope.n_sections, 1);
    assert_int_equal(h64->rope.sections[0], 32);
    kvf_scheme_free(h64);
    /* The pipeline's sections: absent or nil is off, and a section that turns
     * nothing on is written as absent. */
    kvf_scheme *l = tu_scheme_text("return { anchors = nil, outliers = { key = 0 }, error_feedback = { decay = 0 } }");
    assert_string_equal(kvf_scheme_canonical(l), kvf_scheme_canonical(s));
    kvf_scheme_free(l);
    /* One that does is written, and reads back the same. */
    l = tu_scheme_text("return { outliers = { key = 2 }, anchors = { every = 8 }, error_feedback = { decay = 0.7 },"
                       " mixed_precision = { key_fraction = 0.2, table = 'sens.json' } }");
    assert_int_equal(l->pipe.outliers[0], 2);
    assert_int_equal(l->pipe.anchor_bits, 8);
    assert_non_null(strstr(kvf_scheme_canonical(l), "anchors = { bits = 8, every = 8 }"));
    assert_non_null(strstr(kvf_scheme_canonical(l), "table = \"sens.json\""));
    kvf_scheme *back = tu_scheme_text(kvf_scheme_canonical(l));
    assert_string_equal(kvf_scheme_canonical(back), kvf_scheme_canonical(l));
    kvf_scheme_free(back);
    kvf_scheme_free(l);
    kvf_scheme_free(s);
}

/* Every field read, with integral floats taken as integers. */
static void test_all_fields_read(void **state) {
    (void)state;
    kvf_scheme *s = tu_scheme_text(
        "return { name = 'full', head_dim = 256,\n"
        " key = { bits = 4, group_size = 2^5, axis = 'channel', mode = 'symmetric',\n"
        "  scale_format = 'int8_fp16', centroids = 256, kmeans_iters = 10, seed = 2^53,\n"
        "  qsac_candidates = 4, psac_rank = 8, stages = 3 },\n"
        " value = { bits = 8, group_size = 16, axis = 'token', rotation = 'hadamard' },\n"
        " rope = { placement = 'post', layout = 'interleaved', theta = 1e6, sections = { 32, 48, 2^4*3 } },\n"
        " chunk = { tokens = 4096, span = 2, recent = 3, sink = 1 } }");
    assert_string_equal(s->name, "full");
    assert_int_equal(s->head_dim, 256);
    assert_int_equal(s->key.bits, 4);
    assert_int_equal(s->key.group_size, 32);
    assert_int_equal(s->key.mode, KVF_MODE_SYMMETRIC);
    assert_int_equal(s->key.scale_format, KVF_SCALE_INT8_FP16);
    assert_int_equal(s->key.centroids, 256);
    assert_int_equal(s->key.kmeans_iters, 10);
    assert_true(s->key.seed == (int64_t)1 << 53);
    assert_int_equal(s->key.qsac_candidates, 4);
    assert_int_equal(s->key.psac_rank, 8);
    assert_int_equal(s->key.stages, 3);
    assert_int_equal(s->value.bits, 8);
    assert_int_equal(s->value.axis, KVF_AXIS_TOKEN);
    assert_int_equal(s->value.mode, KVF_MODE_AFFINE);
    assert_int_equal(s->value.rotation, KVF_ROTATION_HADAMARD);
    assert_int_equal(s->key.rotation, KVF_ROTATION_NONE);
    assert_int_equal(s->rope.n_sections, 3);
    assert_int_equal(s->rope.sections[0], 32);
    assert_int_equal(s->rope.sections[1], 48);
    assert_int_equal(s->rope.sections[2], 48);
    assert_int_equal(s->rope.sections[3], 0);
    assert_int_equal(s->rope.placement, KVF_ROPE_POST);
    assert_int_equal(s->rope.layout, KVF_ROPE_INTERLEAVED);
    assert_true(s->rope.theta == 1e6);
    assert_int_equal(s->chunk.tokens, 4096);
    assert_int_equal(s->chunk.span, 2);
    assert_int_equal(s->chunk.recent, 3);
    assert_int_equal(s->chunk.sink, 1);
    kvf_scheme_free(s);
}

static void test_finalize_programmatic(void **state) {
    (void)state;
    struct kvf_scheme s;
    kvf_scheme_defaults(&s);
    assert_int_equal(kvf_scheme_finalize(&s), KVF_OK);
    assert_string_equal(s.name, "scheme");
    kvf_scheme *ref = tu_scheme_text("return {}");
    assert_string_equal(s.canonical, kvf_scheme_canonical(ref));
    assert_true(s.hash == kvf_scheme_hash(ref));
    kvf_scheme_free(ref);
    fmt(s.name, sizeof s.name, "prog");
    s.key.bits = 4;
    assert_int_equal(kvf_scheme_finalize(&s), KVF_OK); /* frees the old text */
    ref = tu_scheme_text("return { name = 'prog', key = { bits = 4 } }");
    assert_string_equal(s.canonical, kvf_scheme_canonical(ref));
    assert_string_equal(s.id, kvf_scheme_id(ref));
    kvf_scheme_free(ref);
    s.key.bits = 3;
    expect_error(kvf_scheme_finalize(&s), KVF_ESCHEME, "prog: key.bits: must be one of");
    s.key.bits = 2;
    s.head_dim = 64;
    s.value.group_size = 128;
    expect_error(kvf_scheme_finalize(&s), KVF_ESCHEME, "value.group_size: must divide head_dim");
    s.value.group_size = 64;
    s.rope.theta = 0;
    expect_error(kvf_scheme_finalize(&s), KVF_ESCHEME, "rope.theta");
    s.rope.theta = 10000;
    fmt(s.name, sizeof s.name, "a b");
    expect_error(kvf_scheme_finalize(&s), KVF_ESCHEME, "name: must be");
}

/* --------------------------------------------------------- inheritance */

static void test_inheritance(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    write_file(dir, "parent.lua",
               "return { base = 'rtn_int4', name = 'parent_name', key = { group_size = 32 },\n"
               "  rope = { placement = 'post', theta = 500000 } }\n");
    write_file(dir, "child.lua",
               "return { base = 'parent', value = { bits = 8 }, rope = { layout = 'interleaved' } }\n");
    kvf_scheme *s = load_file(tu_join(dir, "child.lua"));
    assert_string_equal(s->name, "child"); /* the base's name does not carry over */
    assert_string_equal(s->source, tu_join(dir, "child.lua"));
    assert_int_equal(s->key.bits, 4);        /* builtin rtn_int4, through parent */
    assert_int_equal(s->key.group_size, 32); /* parent */
    assert_int_equal(s->value.bits, 8);      /* child */
    assert_int_equal(s->value.group_size, 64);
    assert_int_equal(s->rope.placement, KVF_ROPE_POST);
    assert_true(s->rope.theta == 500000.0);
    assert_int_equal(s->rope.layout, KVF_ROPE_INTERLEAVED); /* sections merge per field */
    kvf_scheme_free(s);

    /* A sibling file shadows the builtin of the same name... */
    write_file(dir, "rtn_int2.lua", "return { head_dim = 256 }\n");
    write_file(dir, "variant.lua", "return { base = 'rtn_int2' }\n");
    s = load_file(tu_join(dir, "variant.lua"));
    assert_int_equal(s->head_dim, 256);
    assert_string_equal(s->name, "variant");
    kvf_scheme_free(s);
    /* ...but a builtin's own base is always the builtin. */
    write_file(dir, "variant4.lua", "return { base = 'rtn_int4' }\n");
    s = load_file(tu_join(dir, "variant4.lua"));
    assert_int_equal(s->head_dim, 128);
    check_rtn(s, 4);
    kvf_scheme_free(s);

    /* A check across files names the file and line that set the field. */
    write_file(dir, "wide.lua", "return {\n  key = { group_size = 128 },\n}\n");
    write_file(dir, "narrow.lua", "return { base = 'wide', head_dim = 64 }\n");
    kvf_scheme *bad = NULL;
    char want[1200];
    fmt(want, sizeof want, "%s:2: key.group_size: must divide head_dim (64)",
             tu_join(dir, "wide.lua"));
    expect_error(kvf_scheme_load(tu_join(dir, "narrow.lua"), &bad), KVF_ESCHEME, want);

    /* Strings resolve bases among the shipped schemes only. */
    s = tu_scheme_text("return { base = 'rtn_int4', name = 'from_string' }");
    check_rtn(s, 4);
    kvf_scheme_free(s);
    tu_rmtree(dir);
    free(dir);
}

static void test_cycles_and_depth(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    char name[32], text[128], want[1200];
    kvf_scheme *s = NULL;
    write_file(dir, "a.lua", "return {\n  base = 'b',\n}\n");
    write_file(dir, "b.lua", "return {\n  base = 'a',\n}\n");
    fmt(want, sizeof want, "%s:2: base: cycle: %s -> %s -> %s", tu_join(dir, "b.lua"),
             tu_join(dir, "a.lua"), tu_join(dir, "b.lua"), tu_join(dir, "a.lua"));
    expect_error(kvf_scheme_load(tu_join(dir, "a.lua"), &s), KVF_ESCHEME, want);
    /* d0 -> d1 -> ... -> d8: eight links load, a ninth does not. */
    for (int i = 0; i < 8; i++) {
        fmt(name, sizeof name, "d%d.lua", i);
        fmt(text, sizeof text, "return { base = 'd%d', chunk = { recent = %d } }\n", i + 1, i);
        write_file(dir, name, text);
    }
    write_file(dir, "d8.lua", "return { key = { bits = 8 } }\n");
    s = load_file(tu_join(dir, "d0.lua"));
    assert_int_equal(s->key.bits, 8);
    assert_int_equal(s->chunk.recent, 0);
    assert_string_equal(s->name, "d0");
    kvf_scheme_free(s);
    s = load_file(tu_join(dir, "d1.lua"));
    assert_int_equal(s->chunk.recent, 1);
    kvf_scheme_free(s);
    write_file(dir, "d8.lua", "return {\n  base = 'rtn_int2' }\n");
    fmt(want, sizeof want, "%s:2: base: chain of bases deeper than 8", tu_join(dir, "d8.lua"));
    expect_error(kvf_scheme_load(tu_join(dir, "d0.lua"), &s), KVF_ESCHEME, want);
    tu_rmtree(dir);
    free(dir);
}

/* ------------------------------------------------------ canonical text */

static const char *const variants[] = {
    "return { name = 'v', head_dim = 64 }",
    "return { name = 'v', key = { bits = 4 } }",
    "return { name = 'v', value = { bits = 4 } }",
    "return { name = 'v', key = { bits = 16 } }",
    "return { name = 'v', key = { group_size = 32 } }",
    "return { name = 'v', value = { group_size = 128 } }",
    "return { name = 'v', key = { axis = 'token', group_size = 16 }, chunk = { tokens = 4096 } }",
    "return { name = 'v', value = { axis = 'token', group_size = 64 } }", /* partial last group */
    "return { name = 'v', key = { rotation = 'hadamard' } }",
    "return { name = 'v', value = { rotation = 'hadamard' } }",
    "return { name = 'v', rope = { placement = 'pre', sections = { 16, 24, 24 } } }",
    "return { name = 'v', rope = { sections = { 24, 24, 16 } } }",
    "return { name = 'v', rope = { sections = { 16, 16, 16, 16 } } }",
    "return { name = 'v', key = { mode = 'symmetric' } }",
    "return { name = 'v', value = { mode = 'ternary' } }",
    "return { name = 'v', key = { scale_format = 'int8_fp16' } }",
    "return { name = 'v', key = { centroids = 256 } }",
    "return { name = 'v', key = { kmeans_iters = 3 } }",
    "return { name = 'v', key = { centroids = 256, kmeans_labels = 'last_step' } }",
    "return { name = 'v', key = { seed = 1 } }",
    "return { name = 'v', key = { centroids = 256, qsac_candidates = 4 } }",
    "return { name = 'v', key = { centroids = 256, assign = 'exact' } }",
    "return { name = 'v', value = { centroids = 256, assign = 'exact' } }",
    "return { name = 'v', key = { psac_rank = 8 } }",
    "return { name = 'v', key = { centroids = 256, stages = 2 } }",
    "return { name = 'v', value = { centroids = 256, kmeans_iters = 5, seed = 7 } }",
    "return { name = 'v', rope = { placement = 'pre' } }",
    "return { name = 'v', rope = { layout = 'interleaved' } }",
    "return { name = 'v', rope = { theta = 10000.5 } }",
    "return { name = 'v', rope = { theta = 0.1 } }",
    "return { name = 'v', chunk = { tokens = 1560 } }",
    "return { name = 'v', chunk = { span = 2 } }",
    "return { name = 'v', chunk = { recent = 1 } }",
    "return { name = 'v', chunk = { sink = 1 } }",
    "return { name = 'w' }",
};
#define N_VARIANTS (sizeof variants / sizeof variants[0])

static void roundtrip(const kvf_scheme *s) {
    const char *c = kvf_scheme_canonical(s);
    kvf_scheme *r = NULL;
    if (kvf_scheme_load_string(c, strlen(c), "=canonical", &r))
        fail_msg("canonical text of %s does not load: %s", s->name, kvf_last_error());
    assert_string_equal(kvf_scheme_canonical(r), c);
    assert_true(kvf_scheme_hash(r) == kvf_scheme_hash(s));
    assert_string_equal(kvf_scheme_id(r), kvf_scheme_id(s));
    kvf_scheme_free(r);
}

static void test_canonical_roundtrip(void **state) {
    (void)state;
    for (const char *const *b = kvf_builtin_schemes(); *b; b++) {
        kvf_scheme *s = tu_scheme(*b);
        roundtrip(s);
        kvf_scheme_free(s);
    }
    for (size_t i = 0; i < N_VARIANTS; i++) {
        kvf_scheme *s = tu_scheme_text(variants[i]);
        roundtrip(s);
        kvf_scheme_free(s);
    }
}

/* The evaluation's ablation schemes (eval/ablation/, docs/QUALITY.md) load,
 * and their canonical text reads back. */
static void loads_and_reads_back(const char *path, const char *name) {
    (void)name;
    kvf_scheme *s = load_file(path);
    roundtrip(s);
    kvf_scheme_free(s);
}

static void test_ablation_schemes_load(void **state) {
    (void)state;
    assert_true(each_lua_file("eval/ablation", loads_and_reads_back) >= 7);
}

static void test_canonical_deterministic(void **state) {
    (void)state;
    kvf_scheme *a = tu_scheme("rtn_int4"), *b = tu_scheme("rtn_int4");
    kvf_scheme *c = tu_scheme_text("return { name = 'rtn_int4', key = { bits = 4 }, value = { bits = 4 } }");
    /* Same configuration written another way: same text, same hash. */
    kvf_scheme *d = tu_scheme_text("return { value = { centroids = 0, bits = 2^2 }, name = 'rtn_int4',"
                                   " rope = { theta = 1e4 }, key = { bits = 4.0 } }");
    assert_string_equal(kvf_scheme_canonical(a), kvf_scheme_canonical(b));
    assert_string_equal(kvf_scheme_canonical(a), kvf_scheme_canonical(c));
    assert_string_equal(kvf_scheme_canonical(a), kvf_scheme_canonical(d));
    assert_true(kvf_scheme_hash(a) == kvf_scheme_hash(d));
    kvf_scheme_free(a);
    kvf_scheme_free(b);
    kvf_scheme_free(c);
    kvf_scheme_free(d);
}

static void test_hash_differs_per_field(void **state) {
    (void)state;
    uint64_t h[N_VARIANTS + 1];
    kvf_scheme *base = tu_scheme_text("return { name = 'v' }");
    h[N_VARIANTS] = kvf_scheme_hash(base);
    kvf_scheme_free(base);
    for (size_t i = 0; i < N_VARIANTS; i++) {
        kvf_scheme *s = tu_scheme_text(variants[i]);
        h[i] = kvf_scheme_hash(s);
        kvf_scheme_free(s);
    }
    for (size_t i = 0; i <= N_VARIANTS; i++)
        for (size_t j = i + 1; j <= N_VARIANTS; j++)
            if (h[i] == h[j]) fail_msg("same hash: <%s> and <%s>", variants[i],
                                       j < N_VARIANTS ? variants[j] : "defaults");
}

/* ------------------------------------------------------------ bad files */

typedef struct bad_case {
    const char *file; /* in tests/schemes_bad/ */
    int line;
    const char *want; /* substring; "a|b" accepts either */
    const char *at;   /* file the message names, if not `file` */
} bad_case;

static const bad_case bad_cases[] = {
    {"unknown_key.lua", 5, "key.bitz: unknown field", NULL},
    {"unknown_top.lua", 4, "colour: unknown field", NULL},
    {"wrong_type.lua", 4, "value.bits: must be one of 2, 4, 8, 16 (got \"4\")", NULL},
    {"section_not_table.lua", 4, "rope: must be a table (got \"pre\")", NULL},
    {"bits_range.lua", 5, "key.bits: must be one of 2, 4, 8, 16 (got 3)", NULL},
    {"tokens_range.lua", 4, "chunk.tokens: must be an integer in 1..1048576 (got 0)", NULL},
    {"not_integer.lua", 3, "key.group_size: must be one of 16, 32, 64, 128, 256 (got 64.5)", NULL},
    {"bad_enum.lua", 4, "key.axis: must be one of \"channel\", \"token\" (got \"tokens\")", NULL},
    {"bad_theta.lua", 5, "rope.theta: must be a finite number > 0 and <= 1e12 (got -1)", NULL},
    {"nan_theta.lua", 3, "rope.theta: must be a finite number > 0 and <= 1e12 (got nan)", NULL},
    {"bad_name.lua", 3,
     "name: must be a string of 1..48 characters from [A-Za-z0-9_] (got \"rtn-int2\")", NULL},
    {"bad-name.lua", 2, "name: not set, and the file name \"bad-name\" is not a valid name", NULL},
    {"head_dim_range.lua", 3, "head_dim: must be one of 64, 128, 256 (got 96)", NULL},
    {"seed_range.lua", 3, "key.seed: must be an integer in 0..9007199254740992 (got -1)", NULL},
    {"group_not_dividing.lua", 5,
     "key.group_size: must divide head_dim (64) when axis = \"channel\" (got 128)", NULL},
    {"token_axis_centroids.lua", 6, "key.centroids: must be 0 when axis = \"token\"", NULL},
    {"token_axis_int8.lua", 6,
     "value.scale_format: must be \"fp16\" when axis = \"token\" (its scales are per channel and "
     "group of tokens) (got \"int8_fp16\")", NULL},
    {"rope_sections_sum.lua", 6,
     "rope.sections: must add up to head_dim / 2 (64) frequency pairs (got 60)", NULL},
    {"rope_sections_hole.lua", 4,
     "rope.sections: must be an array of 1..4 integers in 1..128 (got table)", NULL},
    {"rope_sections_float.lua", 3, "rope.sections: must be an array of 1..4 integers", NULL},
    {"bad_assign.lua", 5, "key.assign: must be one of \"fast\", \"exact\" (got \"approx\")", NULL},
    {"bad_rotation.lua", 5,
     "key.rotation: must be one of \"none\", \"hadamard\" (got \"random\")", NULL},
    {"psac_in_value.lua", 5, "value.psac_rank: must be 0 in value: values get no PSAC (got 8)",
     NULL},
    {"psac_head_dim.lua", 5, "key.psac_rank: must be < head_dim (64) (got 64)", NULL},
    {"qsac_without_centroids.lua", 4, "key.qsac_candidates: must be 1 when centroids = 0", NULL},
    {"qsac_over_centroids.lua", 5, "key.qsac_candidates: must be <= centroids (2) (got 4)", NULL},
    {"stages_without_centroids.lua", 4, "value.stages: must be 1 when centroids = 0", NULL},
    {"labels_without_iters.lua", 6,
     "key.kmeans_labels: must be \"final\" when kmeans_iters = 0 (\"last_step\" takes the labels of "
     "the last Lloyd step) (got \"last_step\")", NULL},
    {"labels_with_qsac.lua", 6,
     "key.qsac_candidates: must be 1 when kmeans_labels = \"last_step\" (QSAC is a final assignment: "
     "set kmeans_labels = \"final\") (got 4)", NULL},
    {"bad_labels.lua", 5, "value.kmeans_labels: must be one of \"final\", \"last_step\" (got \"nearest\")",
     NULL},
    {"labels_iters_over_base.lua", 6,
     "key.kmeans_iters: must be >= 1 when kmeans_labels = \"last_step\" (the labels of the last Lloyd step) "
     "(got 0)", NULL},
    {"labels_over_qsac_base.lua", 6,
     "key.kmeans_labels: must be \"final\" when qsac_candidates > 1 (QSAC is the final assignment) "
     "(got \"last_step\")", NULL},
    {"centroids_bf16.lua", 5, "key.centroids: must be 0 when bits = 16", NULL},
    {"ternary_bits.lua", 4,
     "key.mode: \"ternary\" stores the three levels of symmetric INT2: it needs bits = 2 (got bits = 4)", NULL},
    {"ternary_token_axis.lua", 5,
     "value.mode: \"ternary\" packs the codes of a row: it needs axis = \"channel\" (got \"token\")", NULL},
    {"syntax_error.lua", 4, "'}' expected (to close '{' at line 2) near 'key'", NULL},
    {"runtime_error.lua", 4, "attempt to index a nil value (local 'cfg')", NULL},
    {"error_call.lua", 3, "custom failure 3", NULL},
    {"error_level0.lua", 3, "no position here", NULL},
    {"error_table.lua", 2, "error object is a table value", NULL},
    {"infinite_loop.lua", 2, "instruction limit exceeded", NULL},
    {"pcall_loop.lua", 3, "instruction limit exceeded", NULL},
    {"xpcall_loop.lua", 4, "instruction limit exceeded", NULL},
    {"memory_string.lua", 2, "memory limit exceeded", NULL},
    {"memory_concat.lua", 4, "memory limit exceeded", NULL},
    {"memory_table.lua", 6, "memory limit exceeded", NULL},
    {"memory_pcall.lua", 2, "memory limit exceeded", NULL},
    {"deep_recursion.lua", 2, "memory limit exceeded|stack overflow", NULL},
    {"c_stack_overflow.lua", 2, "stack overflow", NULL},
    {"io_access.lua", 2, "attempt to index a nil value (global 'io')", NULL},
    {"os_access.lua", 2, "attempt to index a nil value (global 'os')", NULL},
    {"require_access.lua", 2, "attempt to call a nil value (global 'require')", NULL},
    {"load_access.lua", 2, "attempt to call a nil value (global 'load')", NULL},
    {"dofile_access.lua", 2, "attempt to call a nil value (global 'dofile')", NULL},
    {"loadfile_access.lua", 2, "attempt to call a nil value (global 'loadfile')", NULL},
    {"debug_access.lua", 2, "attempt to index a nil value (global 'debug')", NULL},
    {"package_access.lua", 2, "attempt to index a nil value (global 'package')", NULL},
    {"string_dump.lua", 2, "attempt to call a nil value (field 'dump')", NULL},
    {"collectgarbage.lua", 2, "attempt to call a nil value (global 'collectgarbage')", NULL},
    {"print_access.lua", 2, "attempt to call a nil value (global 'print')", NULL},
    {"pattern_gsub.lua", 3, "attempt to call a nil value (method 'gsub')", NULL},
    {"table_move.lua", 2, "attempt to call a nil value (field 'move')", NULL},
    {"gc_metamethod.lua", 2, "__gc metamethods are not allowed in a scheme", NULL},
    {"metatable_return.lua", 2, "return value: must be a plain table (it has a metatable)", NULL},
    {"metatable_section.lua", 4, "key: must be a plain table (it has a metatable)", NULL},
    {"return_number.lua", 2, "return value: must be a table (got 42)", NULL},
    {"no_return.lua", 1, "return value: must be a table (got nil)", NULL},
    {"non_string_key.lua", 2, "[1]: unknown field (field names are strings)", NULL},
    {"outliers.lua", 4, "outliers.fraction: unknown field", NULL},
    {"anchors_true.lua", 3, "anchors: must be a table (got true)", NULL},
    {"anchors_zero.lua", 3, "anchors.every: must be an integer in 1..100000 (got 0)", NULL},
    {"feedback_decay_one.lua", 3, "error_feedback.decay: must be a number >= 0 and < 1", NULL},
    {"mixed_all_channels.lua", 3, "mixed_precision.key_fraction: leaves no channel at the base precision", NULL},
    {"base_missing.lua", 3, "base: no scheme named \"no_such_scheme\"", NULL},
    {"base_path.lua", 3, "base: must be a string of 1..48 characters from [A-Za-z0-9_] "
                         "(got \"../schemes/rtn_int2\")", NULL},
    {"base_self.lua", 3, "base: cycle:", NULL},
    {"cycle_a.lua", 4, "base: cycle:", "cycle_b.lua"},
    {"cycle_b.lua", 3, "base: cycle:", "cycle_a.lua"},
    {"bad_parent_child.lua", 5, "key.bits: must be one of 2, 4, 8, 16 (got 3)", "bits_range.lua"},
    {"statement_style.lua", 6, "value.bitz: unknown field", NULL},
    {"computed_section.lua", 5, "key.bits: must be one of 2, 4, 8, 16 (got 3)", NULL},
    {"tokenizer_tricks.lua", 10, "value.bits: must be one of 2, 4, 8, 16 (got 3)", NULL},
    {"bracket_key.lua", 4, "key.bits: must be one of 2, 4, 8, 16 (got 5)", NULL},
    {"bytecode.lua", 1, "attempt to load a binary chunk (mode is 't')", NULL},
    /* Work inside C, where the instruction hook never fires: the clock and the
     * guards in front of the library functions stop it. */
    {"rep_empty.lua", 4, "head_dim: must be one of 64, 128, 256 (got 0)", NULL},
    {"concat_churn.lua", 3, "time limit exceeded", NULL},
    {"string_compare.lua", 4, "time limit exceeded", NULL},
    {"table_shift.lua", 4, "time limit exceeded", NULL},
    {"len_insert.lua", 3, "table.insert: a table with a metatable is not allowed in a scheme", NULL},
    {"vararg_copy.lua", 4, "time limit exceeded", NULL},
    {"sort_loop.lua", 4, "time limit exceeded|instruction limit exceeded", NULL},
    {"xpcall_error_loop.lua", 4, "time limit exceeded|instruction limit exceeded", NULL},
};
#define N_BAD (sizeof bad_cases / sizeof bad_cases[0])

/* CPU seconds a hostile file may take: 2, or $KVF_TEST_TIME_LIMIT under valgrind. */
static double time_limit(void) {
    const char *e = getenv("KVF_TEST_TIME_LIMIT");
    return e && atof(e) > 0 ? atof(e) : 2.0;
}

static bool has_any(const char *msg, const char *want) {
    char buf[512];
    fmt(buf, sizeof buf, "%s", want);
    for (char *tok = strtok(buf, "|"); tok; tok = strtok(NULL, "|"))
        if (strstr(msg, tok)) return true;
    return false;
}

static void check_bad(const bad_case *c) {
    char rel[256], prefix[1200];
    fmt(rel, sizeof rel, "tests/schemes_bad/%s", c->file);
    const char *path = tu_path(rel);
    fmt(rel, sizeof rel, "tests/schemes_bad/%s", c->at ? c->at : c->file);
    fmt(prefix, sizeof prefix, "%s:%d: ", tu_path(rel), c->line);
    kvf_scheme *s = (kvf_scheme *)1;
    double t0 = cpu_s(), w0 = tu_now_s();
    int rc = kvf_scheme_load(path, &s);
    double dt = cpu_s() - t0, wall = tu_now_s() - w0;
    const char *msg = kvf_last_error();
    if (rc != KVF_ESCHEME) fail_msg("%s: status %s, message: %s", c->file, kvf_status_name(rc), msg);
    assert_null(s);
    if (strncmp(msg, prefix, strlen(prefix)))
        fail_msg("%s: message \"%s\" does not start with \"%s\"", c->file, msg, prefix);
    if (!has_any(msg, c->want)) fail_msg("%s: message \"%s\" lacks \"%s\"", c->file, msg, c->want);
    if (strstr(msg, " ran")) fail_msg("%s: a metamethod ran: %s", c->file, msg);
    if (dt > time_limit()) fail_msg("%s: took %.2f s of CPU time", c->file, dt);
    if (wall > 10 * time_limit()) fail_msg("%s: took %.2f s", c->file, wall);
}

static void test_bad_corpus(void **state) {
    (void)state;
    kvf_scheme *before = tu_scheme("rtn_int2");
    for (size_t i = 0; i < N_BAD; i++) check_bad(&bad_cases[i]);
    /* Every file in the corpus is covered by a case. */
    DIR *d = opendir(tu_path("tests/schemes_bad"));
    struct dirent *e;
    int files = 0;
    assert_non_null(d);
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        bool found = false;
        for (size_t i = 0; i < N_BAD; i++) found = found || !strcmp(bad_cases[i].file, e->d_name);
        if (!found) fail_msg("tests/schemes_bad/%s has no case", e->d_name);
        files++;
    }
    closedir(d);
    assert_int_equal(files, (int)N_BAD);
    /* tu_time_limited_schemes (which test_fuzz_replay skips) lists exactly
     * the cases stopped by the time limit. */
    int listed = 0, timed = 0;
    for (const char *const *f = tu_time_limited_schemes; *f; f++) listed++;
    for (size_t i = 0; i < N_BAD; i++) {
        const bool t = strstr(bad_cases[i].want, "time limit exceeded") != NULL;
        if (t != (bool)tu_listed(bad_cases[i].file, tu_time_limited_schemes))
            fail_msg("%s: %s", bad_cases[i].file, t ? "time-limited but not in tu_time_limited_schemes"
                                                     : "in tu_time_limited_schemes but not time-limited");
        timed += t;
    }
    assert_int_equal(listed, timed);
    /* The process is healthy: a good scheme loads the same as before. */
    kvf_scheme *after = tu_scheme("rtn_int2");
    assert_string_equal(kvf_scheme_canonical(after), kvf_scheme_canonical(before));
    kvf_scheme_free(before);
    kvf_scheme_free(after);
}

/* ------------------------------------------------- hostile strings */

typedef struct dumpbuf {
    char data[4096];
    size_t len;
} dumpbuf;

static int dump_writer(lua_State *L, const void *p, size_t sz, void *ud) {
    dumpbuf *b = ud;
    (void)L;
    if (b->len + sz > sizeof b->data) return 1;
    memcpy(b->data + b->len, p, sz);
    b->len += sz;
    return 0;
}

/* Real precompiled bytecode, through load_string and through a file. */
static void test_bytecode_rejected(void **state) {
    (void)state;
    lua_State *L = luaL_newstate();
    static dumpbuf b;
    assert_int_equal(luaL_loadstring(L, "return { head_dim = 64 }"), LUA_OK);
    assert_int_equal(lua_dump(L, dump_writer, &b, 1), 0);
    const char *code = b.data;
    size_t len = b.len;
    assert_memory_equal(code, "\033Lua", 4);
    kvf_scheme *s = (kvf_scheme *)1;
    expect_error(kvf_scheme_load_string(code, len, "@exported.bin", &s), KVF_ESCHEME,
                 "exported.bin:1: attempt to load a binary chunk (mode is 't')");
    assert_null(s);
    char *dir = tu_mkdtemp();
    tu_write_file(tu_join(dir, "compiled.lua"), code, len);
    expect_error(kvf_scheme_load(tu_join(dir, "compiled.lua"), &s), KVF_ESCHEME, "binary chunk");
    lua_close(L);
    tu_rmtree(dir);
    free(dir);
}

static void test_hostile_strings(void **state) {
    (void)state;
    char deep[2100];
    memset(deep, '(', 1000);
    fmt(deep + 1000, sizeof deep - 1000, "1");
    memset(deep + 1001, ')', 1000);
    deep[2001] = 0;
    char nested[4000] = "return ";
    for (int i = 0; i < 1000; i++) strcat(nested, "{");
    for (int i = 0; i < 1000; i++) strcat(nested, "}");
    double t0 = tu_now_s();
    expect_str_error(deep, "str:1:");
    expect_str_error(nested, "str:1:");
    expect_str_error("local t = {} t[1] = t return t", "[1]: unknown field");
    expect_str_error("return { key = { bits = 2, [true] = 1 } }", "key[true]: unknown field");
    expect_str_error("return { ['a b'] = 1 }", "str:1: [\"a b\"]: unknown field");
    expect_str_error("return { key = { bits = true } }", "(got true)");
    expect_str_error("return { key = { bits = {} } }", "(got table)");
    expect_str_error("return { key = { bits = 2^63 } }", "key.bits: must be one of");
    expect_str_error("return { rope = { theta = math.huge } }", "(got inf)");
    expect_str_error("return { rope = { theta = 1/0 } }", "rope.theta");
    expect_str_error("return { chunk = { tokens = '64' } }", "(got \"64\")");
    expect_str_error("return { rope = { sections = {} } }", "rope.sections: must be an array");
    expect_str_error("return { rope = { sections = { 16, 16, 16, 8, 8 } } }", "rope.sections");
    expect_str_error("return { rope = { sections = { 64, x = 1 } } }", "rope.sections");
    expect_str_error("return { rope = { sections = { 0, 64 } } }", "rope.sections");
    expect_str_error("return { rope = { sections = { '64' } } }", "rope.sections");
    expect_str_error("return { rope = { sections = 64 } }", "rope.sections: must be an array");
    expect_str_error("return { rope = { sections = setmetatable({ 64 }, {}) } }", "rope.sections");
    expect_str_error("return { head_dim = 64, rope = { sections = { 64 } } }",
                     "rope.sections: must add up to head_dim / 2 (32)");
    expect_str_error("return { outliers = 0 }", "outliers: must be a table");
    expect_str_error("return { mixed_precision = { fraction = 0.2 } }", "mixed_precision.fraction: unknown field");
    expect_str_error("return { error_feedback = { beta = 0.7 } }", "error_feedback.beta: unknown field");
    expect_str_error("return { outliers = { key = 2 }, key = { bits = 16 } }", "outliers.key: applies to quantized");
    expect_str_error("return { anchors = { every = 3, bits = 8 }, chunk = { span = 2 } }",
                     "anchors.every: must be a multiple of chunk.span");
    expect_str_error("return math.random(1)", "(field 'random')");
    expect_str_error("local s = getmetatable('').__index return s.dump(print)", "str:1:");
    /* __gc added after setmetatable never marks the object: closing does not hang. */
    kvf_scheme *s = tu_scheme_text("local t = setmetatable({}, {}) local mt = getmetatable(t)\n"
                             "mt.__gc = function() while true do end end\nt = nil\nreturn {}");
    kvf_scheme_free(s);
    expect_str_error("local t = setmetatable({}, { __close = function() while true do end end })\n"
                     "do local x <close> = t end\nreturn {}",
                     "str:1: instruction limit exceeded");
    assert_true(tu_now_s() - t0 < 5 * time_limit());
}

/* Lua shortens long chunk names to "...tail"; the loader's messages do not. */
static void test_long_path_in_messages(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    char sub[1024];
    fmt(sub, sizeof sub, "%s/a_rather_long_directory_name_for_the_scheme_files_of_a_test",
             dir);
    assert_int_equal(mkdir(sub, 0700), 0);
    write_file(sub, "s.lua", "return {\n  head_dim = 128\n  key = {}\n}\n");
    write_file(sub, "r.lua", "local x\nreturn { head_dim = x.y }\n");
    char want[1200];
    kvf_scheme *s = NULL;
    fmt(want, sizeof want, "%s:3:", tu_join(sub, "s.lua"));
    expect_error(kvf_scheme_load(tu_join(sub, "s.lua"), &s), KVF_ESCHEME, want);
    assert_true(strncmp(kvf_last_error(), want, strlen(want)) == 0);
    fmt(want, sizeof want, "%s:2: attempt to index a nil value", tu_join(sub, "r.lua"));
    expect_error(kvf_scheme_load(tu_join(sub, "r.lua"), &s), KVF_ESCHEME, want);
    assert_true(strncmp(kvf_last_error(), want, strlen(want)) == 0);
    tu_rmtree(dir);
    free(dir);
}

/* ------------------------------------------------------------- the API */

static void test_api_errors(void **state) {
    (void)state;
    kvf_scheme *s = (kvf_scheme *)1;
    expect_error(kvf_scheme_load(NULL, &s), KVF_EINVAL, "NULL");
    assert_null(s);
    expect_error(kvf_scheme_load("x.lua", NULL), KVF_EINVAL, "NULL");
    expect_error(kvf_scheme_load_string(NULL, 0, NULL, &s), KVF_EINVAL, "NULL");
    expect_error(kvf_scheme_load_builtin(NULL, &s), KVF_EINVAL, "NULL");
    expect_error(kvf_scheme_load(tu_path("tests/schemes_bad/no_such_file.lua"), &s), KVF_EIO,
                 "no_such_file.lua");
    expect_error(kvf_scheme_load_builtin("no_such", &s), KVF_EINVAL,
                 "no shipped scheme named \"no_such\" (shipped: ");
    expect_error(kvf_scheme_load_builtin("../schemes/rtn_int2", &s), KVF_EINVAL, "no shipped");
    assert_null(s);
    /* Chunk names: "@file", "=name", a bare name, none. */
    const char *t = "return {";
    expect_error(kvf_scheme_load_string(t, strlen(t), "@dir/f.lua", &s), KVF_ESCHEME, "dir/f.lua:1:");
    expect_error(kvf_scheme_load_string(t, strlen(t), "=exported", &s), KVF_ESCHEME, "exported:1:");
    expect_error(kvf_scheme_load_string(t, strlen(t), "bare", &s), KVF_ESCHEME, "bare:1:");
    expect_error(kvf_scheme_load_string(t, strlen(t), NULL, &s), KVF_ESCHEME, "<string>:1:");
    /* The length is honoured: text past len is not read. */
    const char *cut = "return {} garbage";
    assert_int_equal(kvf_scheme_load_string(cut, 9, NULL, &s), KVF_OK);
    assert_string_equal(s->source, "<string>");
    kvf_scheme_free(s);
    kvf_scheme_free(NULL);
    assert_null(kvf_scheme_name(NULL));
    assert_int_equal(kvf_scheme_head_dim(NULL), 0);
    /* Too large a file is refused before Lua sees it. */
    char *dir = tu_mkdtemp();
    FILE *f = fopen(tu_join(dir, "big.lua"), "wb");
    assert_non_null(f);
    for (int i = 0; i < (1 << 20) / 16 + 1; i++) fputs("-- padding line\n", f);
    fputs("return {}\n", f);
    fclose(f);
    expect_error(kvf_scheme_load(tu_join(dir, "big.lua"), &s), KVF_ESCHEME, "file too large");
    /* A file name without .lua, and a valid default name. */
    write_file(dir, "my_variant.lua", "return { key = { bits = 4 } }");
    s = load_file(tu_join(dir, "my_variant.lua"));
    assert_string_equal(kvf_scheme_name(s), "my_variant");
    assert_int_equal(strncmp(kvf_scheme_id(s), "my_variant_", 11), 0);
    kvf_scheme_free(s);
    tu_rmtree(dir);
    free(dir);
}

/* A scheme path that is not a regular file is refused, naming the path, and
 * never opened blocking: a FIFO without a writer would hang an open(2) for
 * reading. The alarm turns a hang into a failure. */
static void test_not_regular_file(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    char path[1100], want[1200];
    kvf_scheme *s = (kvf_scheme *)1;
    fmt(path, sizeof path, "%s", tu_join(dir, "pipe.lua"));
    assert_int_equal(mkfifo(path, 0600), 0);
    alarm(20);
    fmt(want, sizeof want, "cannot read %s: it is a FIFO", path);
    expect_error(kvf_scheme_load(path, &s), KVF_EIO, want);
    assert_null(s);
    /* A base of that name beside a scheme is the FIFO, refused too. */
    write_file(dir, "child.lua", "return { base = 'pipe' }\n");
    expect_error(kvf_scheme_load(tu_join(dir, "child.lua"), &s), KVF_EIO, want);
    alarm(0);
    fmt(want, sizeof want, "cannot read %s: it is a directory", dir);
    expect_error(kvf_scheme_load(dir, &s), KVF_EIO, want);
    assert_int_equal(mkdir(tu_join(dir, "sub.lua"), 0700), 0);
    write_file(dir, "child2.lua", "return { base = 'sub' }\n");
    expect_error(kvf_scheme_load(tu_join(dir, "child2.lua"), &s), KVF_EIO, "sub.lua: it is a directory");
    struct stat st;
    if (stat("/dev/null", &st) == 0 && S_ISCHR(st.st_mode))
        expect_error(kvf_scheme_load("/dev/null", &s), KVF_EIO,
                     "cannot read /dev/null: it is a character device");
    /* A symbolic link to a regular file is a regular file. */
    write_file(dir, "real.lua", "return { key = { bits = 4 } }\n");
    assert_int_equal(symlink(tu_join(dir, "real.lua"), tu_join(dir, "link.lua")), 0);
    s = load_file(tu_join(dir, "link.lua"));
    assert_int_equal(s->key.bits, 4);
    kvf_scheme_free(s);
    tu_rmtree(dir);
    free(dir);
}

/* As luaL_loadfile: a UTF-8 byte-order mark and a first line starting with
 * '#' are skipped, and the lines after them keep their numbers, in a file,
 * in a string and in a base. */
static void test_bom_and_shebang(void **state) {
    (void)state;
    static const char *const prefixes[] = {"\xEF\xBB\xBF", "#!/usr/bin/env kvforge\n",
                                           "\xEF\xBB\xBF#!x\r\n", "# a comment\n"};
    char *dir = tu_mkdtemp();
    kvf_scheme *plain = tu_scheme_text("return { key = { bits = 4 } }\n");
    for (size_t i = 0; i < sizeof prefixes / sizeof prefixes[0]; i++) {
        const char *pre = prefixes[i];
        int extra = pre[strlen(pre) - 1] == '\n'; /* lines the prefix adds */
        char text[256], want[1200];
        kvf_scheme *s = NULL;
        fmt(text, sizeof text, "%sreturn { key = { bits = 4 } }\n", pre);
        write_file(dir, "ok.lua", text);
        s = load_file(tu_join(dir, "ok.lua"));
        assert_true(kvf_scheme_hash(s) != 0);
        assert_int_equal(s->key.bits, 4);
        kvf_scheme_free(s);
        s = tu_scheme_text(text);
        assert_true(kvf_scheme_hash(s) == kvf_scheme_hash(plain));
        kvf_scheme_free(s);
        /* A field's line (the line index) and a Lua error's line (Lua). */
        fmt(text, sizeof text, "%sreturn {\n  key = { bits = 3 },\n}\n", pre);
        write_file(dir, "field.lua", text);
        fmt(want, sizeof want, "%s:%d: key.bits: must be one of", tu_join(dir, "field.lua"), 2 + extra);
        expect_error(kvf_scheme_load(tu_join(dir, "field.lua"), &s), KVF_ESCHEME, want);
        fmt(want, sizeof want, "str:%d: key.bits", 2 + extra);
        expect_str_error(text, want);
        fmt(text, sizeof text, "%slocal x\n\nreturn x.y\n", pre);
        write_file(dir, "lua.lua", text);
        fmt(want, sizeof want, "%s:%d: attempt to index a nil value", tu_join(dir, "lua.lua"), 3 + extra);
        expect_error(kvf_scheme_load(tu_join(dir, "lua.lua"), &s), KVF_ESCHEME, want);
        /* Through a base beside the file. */
        fmt(text, sizeof text, "%sreturn {\n  value = { bits = 5 } }\n", pre);
        write_file(dir, "parent.lua", text);
        write_file(dir, "kid.lua", "return { base = 'parent' }\n");
        fmt(want, sizeof want, "%s:%d: value.bits", tu_join(dir, "parent.lua"), 2 + extra);
        expect_error(kvf_scheme_load(tu_join(dir, "kid.lua"), &s), KVF_ESCHEME, want);
    }
    kvf_scheme_free(plain);
    /* Only a first line: '#' later, or a second mark, is Lua's syntax error. */
    expect_str_error("return {}\n# no\n", "str:2:");
    expect_str_error("\xEF\xBB\xBF\xEF\xBB\xBFreturn {}", "str:1:");
    /* A binary chunk after the '#' line is still refused as one. */
    expect_str_error("#!x\n\033Lua", "str:1: attempt to load a binary chunk (mode is 't')");
    tu_rmtree(dir);
    free(dir);
}

/* Loading is thread-safe: same results from several threads at once. */
static void *thread_body(void *arg) {
    uint64_t want = *(uint64_t *)arg;
    for (int i = 0; i < 20; i++) {
        kvf_scheme *s = NULL;
        if (kvf_scheme_load_builtin("rtn_int4", &s) || kvf_scheme_hash(s) != want) return "loading rtn_int4 failed";
        kvf_scheme_free(s);
        const char *bad = "return { key = { bits = 3 } }";
        if (kvf_scheme_load_string(bad, strlen(bad), "=t", &s) != KVF_ESCHEME ||
            strcmp(kvf_last_error(), "t:1: key.bits: must be one of 2, 4, 8, 16 (got 3)"))
            return "wrong error for a bad string";
    }
    return NULL;
}

static void test_threads(void **state) {
    (void)state;
    kvf_scheme *ref = tu_scheme("rtn_int4");
    uint64_t want = kvf_scheme_hash(ref);
    pthread_t th[4];
    for (int i = 0; i < 4; i++) assert_int_equal(pthread_create(&th[i], NULL, thread_body, &want), 0);
    for (int i = 0; i < 4; i++) {
        void *r;
        pthread_join(th[i], &r);
        if (r) fail_msg("thread %d: %s", i, (const char *)r);
    }
    kvf_scheme_free(ref);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_builtin_list_loads),
        cmocka_unit_test(test_disk_schemes_match_builtin),
        cmocka_unit_test(test_rtn_schemes),
        cmocka_unit_test(test_defaults),
        cmocka_unit_test(test_all_fields_read),
        cmocka_unit_test(test_finalize_programmatic),
        cmocka_unit_test(test_inheritance),
        cmocka_unit_test(test_cycles_and_depth),
        cmocka_unit_test(test_canonical_roundtrip),
        cmocka_unit_test(test_ablation_schemes_load),
        cmocka_unit_test(test_canonical_deterministic),
        cmocka_unit_test(test_hash_differs_per_field),
        cmocka_unit_test(test_bad_corpus),
        cmocka_unit_test(test_bytecode_rejected),
        cmocka_unit_test(test_hostile_strings),
        cmocka_unit_test(test_long_path_in_messages),
        cmocka_unit_test(test_api_errors),
        cmocka_unit_test(test_not_regular_file),
        cmocka_unit_test(test_bom_and_shebang),
        cmocka_unit_test(test_threads),
    };
    return cmocka_run_group_tests_name("scheme", tests, NULL, NULL);
}
