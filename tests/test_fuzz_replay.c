/*
 * The fuzz targets' inputs in the ordinary suite: every seed (fuzz/corpus/,
 * the shipped schemes, tests/schemes_bad/ but for the files test_scheme
 * already runs to the loader's time limit) and every saved finding
 * (fuzz/regress/TARGET/: the inputs that crashed, hung or broke an oracle,
 * kept after the fix) goes through the same code and checks as under
 * libFuzzer (fuzz/fuzz_*.c, included here), with a failed check failing the
 * test instead of aborting.
 */
#include "testutil.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char current[1024]; /* the input being replayed, for messages */

#define FUZZ_FAIL(what) fail_msg("%s (input %s)", what, current)

#define LLVMFuzzerTestOneInput fuzz_scheme_one
#include "../fuzz/fuzz_scheme.c"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput fuzz_packed_one
#include "../fuzz/fuzz_packed.c"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput fuzz_roundtrip_one
#include "../fuzz/fuzz_roundtrip.c"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput fuzz_dump_one
#include "../fuzz/fuzz_dump.c"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput fuzz_table_one
#include "../fuzz/fuzz_table.c"
#undef LLVMFuzzerTestOneInput

typedef int (*target_fn)(const uint8_t *, size_t);

static uint8_t *read_all(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) fail_msg("cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *p = malloc(len > 0 ? (size_t)len : 1); /* exactly the input: ASan sees overreads */
    assert_non_null(p);
    *n = len > 0 ? fread(p, 1, (size_t)len, f) : 0;
    fclose(f);
    assert_int_equal(*n, (size_t)(len > 0 ? len : 0));
    return p;
}

/* Every regular file of a directory (relative to the source tree) but those in
 * skip (NULL: none); returns how many. */
static int replay_dir(target_fn fn, const char *rel, const char *const *skip) {
    DIR *d = opendir(tu_path(rel));
    int n = 0;
    if (!d) return 0; /* fuzz/regress/TARGET exists once something was found */
    for (struct dirent *e; (e = readdir(d));) {
        if (e->d_name[0] == '.' || !strcmp(e->d_name, "README.md") || tu_listed(e->d_name, skip)) continue;
        char path[600];
        snprintf(path, sizeof path, "%s/%s", rel, e->d_name);
        snprintf(current, sizeof current, "%s", path);
        size_t len;
        uint8_t *data = read_all(tu_path(path), &len);
        fn(data, len);
        free(data);
        n++;
    }
    closedir(d);
    return n;
}

static void replay_scheme(void **state) {
    (void)state;
    assert_true(replay_dir(fuzz_scheme_one, "schemes", NULL) >= 2);
    /* The bad schemes that run until the loader's 1 s CPU limit are skipped:
     * test_scheme's test_bad_corpus loads each (status, message, CPU time).
     * A renamed file would silently be replayed (and cost its second) again. */
    for (const char *const *f = tu_time_limited_schemes; *f; f++) {
        char rel[128];
        snprintf(rel, sizeof rel, "tests/schemes_bad/%s", *f);
        assert_int_equal(access(tu_path(rel), R_OK), 0);
    }
    assert_true(replay_dir(fuzz_scheme_one, "tests/schemes_bad", tu_time_limited_schemes) >= 50);
    replay_dir(fuzz_scheme_one, "fuzz/corpus/scheme", NULL);
    int found = replay_dir(fuzz_scheme_one, "fuzz/regress/scheme", NULL);
    print_message("scheme: %d saved findings replayed\n", found);
    fuzz_scheme_one(NULL, 0);
}

/* A committed packed seed goes through the target and is a cache one of
 * fuzz_packed's schemes accepts at its header's shape (seeded_schemes: which).
 * A seed whose scheme hash went stale (a scheme's canonical text changed)
 * reaches only the error paths: `make fuzz-seeds` writes them again. */
static unsigned seeded_schemes;
static int packed_seed(const uint8_t *data, size_t size) {
    fuzz_packed_one(data, size);
    fp_scheme *sch = fp_schemes();
    if (size < KVF_HEADER_BYTES) FUZZ_FAIL("seed shorter than a header");
    int64_t n = (int64_t)kvf_get_u64(data + 16);
    int32_t h = (int32_t)kvf_get_u32(data + 24);
    unsigned ok = 0;
    for (int i = 0; i < FUZZ_SCHEMES; i++)
        ok |= (unsigned)(kvf_packed_check(sch[i].s, data, size, n, h) == KVF_OK) << i;
    if (!ok) FUZZ_FAIL("no fuzz_packed scheme accepts this seed (stale: run make fuzz-seeds)");
    seeded_schemes |= ok;
    return 0;
}

static void replay_packed(void **state) {
    (void)state;
    assert_true(replay_dir(packed_seed, "fuzz/corpus/packed", NULL) >= 10);
    assert_int_equal(seeded_schemes, (1u << FUZZ_SCHEMES) - 1); /* every scheme has a current seed */
    int found = replay_dir(fuzz_packed_one, "fuzz/regress/packed", NULL);
    print_message("packed: %d saved findings replayed\n", found);
    static const uint8_t tiny[3] = {1, 2, 3};
    fuzz_packed_one(NULL, 0);
    fuzz_packed_one(tiny, sizeof tiny);
}

static void replay_roundtrip(void **state) {
    (void)state;
    assert_true(replay_dir(fuzz_roundtrip_one, "fuzz/corpus/roundtrip", NULL) >= 4);
    int found = replay_dir(fuzz_roundtrip_one, "fuzz/regress/roundtrip", NULL);
    print_message("roundtrip: %d saved findings replayed\n", found);
}

/* The sensitivity-table seeds (one accepted, the others refused) and every
 * saved finding. */
static void replay_table(void **state) {
    (void)state;
    assert_true(replay_dir(fuzz_table_one, "fuzz/corpus/table", NULL) >= 4);
    int found = replay_dir(fuzz_table_one, "fuzz/regress/table", NULL);
    print_message("table: %d saved findings replayed\n", found);
}

/* The dump seeds are accepted dumps or recon files of the fixed dump (so the
 * evaluation runs on them), and every saved finding replays. */
static int dump_seed(const uint8_t *data, size_t size) {
    fuzz_dump_one(data, size);
    kvf_dump *d;
    kvf_recon *r;
    if (kvf_dump_parse(data, size, current, &d) == KVF_OK) {
        kvf_dump_close(d);
    } else if (kvf_recon_parse(data, size, current, &r) == KVF_OK) {
        int ok = kvf_recon_check_dump(r, fd_get()->dump) == KVF_OK;
        kvf_recon_close(r);
        if (!ok) FUZZ_FAIL("recon seed of another dump (stale: run make fuzz-seeds)");
    } else {
        FUZZ_FAIL("dump seed is neither a dump nor a recon file (stale: run make fuzz-seeds)");
    }
    return 0;
}

static void replay_dump(void **state) {
    (void)state;
    assert_true(replay_dir(dump_seed, "fuzz/corpus/dump", NULL) >= 7);
    int found = replay_dir(fuzz_dump_one, "fuzz/regress/dump", NULL);
    print_message("dump: %d saved findings replayed\n", found);
    fuzz_dump_one(NULL, 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(replay_scheme),
        cmocka_unit_test(replay_packed),
        cmocka_unit_test(replay_roundtrip),
        cmocka_unit_test(replay_dump),
        cmocka_unit_test(replay_table),
    };
    return cmocka_run_group_tests_name("fuzz replay", tests, NULL, NULL);
}
