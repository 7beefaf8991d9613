/* Disk cache of compiled kernels (runtime/gpu/cache.c). */
#include "testutil.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define ARCH "sm_90"
#define META "{\"scheme\":\"rtn_int2_1a2b3c4d\",\"arch\":\"sm_90\",\"nvrtc\":\"13.0\"," \
             "\"kvforge\":\"" KVF_VERSION_STRING "\",\"created\":1700000000}"

typedef struct fixture {
    char *tmp;             /* private temp dir, removed afterwards */
    char cache[PATH_MAX];  /* tmp/cache: KVFORGE_CACHE_DIR (not created yet) */
} fixture;

static int setup(void **state) {
    fixture *fx = calloc(1, sizeof *fx);
    fx->tmp = tu_mkdtemp();
    snprintf(fx->cache, sizeof fx->cache, "%s/cache", fx->tmp);
    setenv("KVFORGE_CACHE_DIR", fx->cache, 1);
    unsetenv("KVFORGE_CACHE");
    *state = fx;
    return 0;
}

static int teardown(void **state) {
    fixture *fx = *state;
    unsetenv("KVFORGE_CACHE");
    tu_rmtree(fx->tmp);
    free(fx->tmp);
    free(fx);
    return 0;
}

/* ------------------------------------------------------------- helpers */

static void fill_payload(uint8_t *p, size_t n, uint64_t seed) {
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        p[i] = (uint8_t)x;
    }
}

static void key_of(const char *arch, int nvrtc_minor, const char *option, const char *source,
                   kvf_cache_key *k) {
    const char *opts[] = {"-std=c++17", option};
    const char *srcs[] = {"#include <kvf_rtn.cuh>\n", source};
    kvf_cache_make_key(arch, 13, nvrtc_minor, opts, 2, srcs, NULL, 2, k);
}

static void base_key(kvf_cache_key *k) { key_of(ARCH, 0, "-DBITS=2", "KVF_INSTANTIATE(2)", k); }

static const char *entry_path(const fixture *fx, const char *arch, const kvf_cache_key *k,
                              const char *suffix) {
    static char buf[4][PATH_MAX + 64];
    static int slot;
    char *b = buf[slot++ & 3];
    snprintf(b, sizeof buf[0], "%s/%s/%s%s", fx->cache, arch, k->hex, suffix);
    return b;
}

static void put_ok(const char *arch, const kvf_cache_key *k, const uint8_t *p, size_t n) {
    int rc = kvf_cache_put(arch, k, META, p, n);
    if (rc) fail_msg("put: %s", kvf_last_error());
}

static void assert_hit(const char *arch, const kvf_cache_key *k, const uint8_t *p, size_t n) {
    void *got = NULL;
    size_t got_n = 0;
    int rc = kvf_cache_get(arch, k, &got, &got_n);
    if (rc != KVF_OK) fail_msg("expected a hit, got %d: %s", rc, kvf_last_error());
    assert_int_equal(got_n, n);
    assert_memory_equal(got, p, n);
    free(got);
}

static void assert_miss(const char *arch, const kvf_cache_key *k) {
    void *got = (void *)1;
    size_t got_n = 7;
    assert_int_equal(kvf_cache_get(arch, k, &got, &got_n), 1);
    assert_null(got);
    assert_int_equal(got_n, 0);
}

static bool exists(const char *path) {
    struct stat st;
    return lstat(path, &st) == 0;
}

/* Names in a directory containing `part` (0 if the directory is missing). */
static int count_names(const char *dir, const char *part) {
    DIR *d = opendir(dir);
    int n = 0;
    if (!d) return 0;
    for (struct dirent *e; (e = readdir(d));)
        if (e->d_name[0] != '.' && strstr(e->d_name, part)) n++;
    closedir(d);
    return n;
}

/* Capture what is written to stderr between begin and end. */
typedef struct capture { int saved; char path[PATH_MAX]; } capture;

static void capture_begin(capture *c, const fixture *fx) {
    snprintf(c->path, sizeof c->path, "%s/stderr.txt", fx->tmp);
    fflush(stderr);
    c->saved = dup(2);
    int fd = open(c->path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    assert_true(fd >= 0 && c->saved >= 0);
    dup2(fd, 2);
    close(fd);
}

/* Returns the captured text (malloc'ed). */
static char *capture_end(capture *c) {
    static char text[16384];
    fflush(stderr);
    dup2(c->saved, 2);
    close(c->saved);
    FILE *f = fopen(c->path, "rb");
    assert_non_null(f);
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = 0;
    fputs(text, stderr); /* keep the warnings visible in the test log */
    return strdup(text);
}

/* What kvf_cache_list prints (malloc'ed, len bytes), checking it succeeds. */
static char *list_text(size_t *len) {
    char *text;
    FILE *out = open_memstream(&text, len);
    assert_non_null(out);
    assert_int_equal(kvf_cache_list(out), KVF_OK);
    fclose(out);
    return text;
}

/* --------------------------------------------------------------- tests */

static void test_put_get_hit(void **state) {
    fixture *fx = *state;
    static uint8_t payload[100000];
    kvf_cache_key k;
    struct stat st;
    fill_payload(payload, sizeof payload, 1);
    base_key(&k);
    assert_miss(ARCH, &k);
    assert_false(exists(fx->cache)); /* a lookup creates nothing */
    put_ok(ARCH, &k, payload, sizeof payload);
    assert_hit(ARCH, &k, payload, sizeof payload);
    /* layout and permissions */
    assert_true(exists(entry_path(fx, ARCH, &k, ".bin")));
    assert_int_equal(stat(fx->cache, &st), 0);
    assert_int_equal(st.st_mode & 077, 0);
    char arch_dir[PATH_MAX + 16];
    snprintf(arch_dir, sizeof arch_dir, "%s/%s", fx->cache, ARCH);
    assert_int_equal(stat(arch_dir, &st), 0);
    assert_int_equal(st.st_mode & 077, 0);
    assert_int_equal(stat(entry_path(fx, ARCH, &k, ".bin"), &st), 0);
    assert_int_equal(st.st_mode & 077, 0);
    assert_int_equal(count_names(arch_dir, ".tmp."), 0);
    /* a second put of the same key replaces the entry */
    payload[5] ^= 1;
    put_ok(ARCH, &k, payload, sizeof payload);
    assert_hit(ARCH, &k, payload, sizeof payload);
}

static void test_key(void **state) {
    (void)state;
    kvf_cache_key base, again, k;
    base_key(&base);
    base_key(&again);
    assert_int_equal(strlen(base.hex), 32);
    for (int i = 0; i < 32; i++)
        assert_non_null(strchr("0123456789abcdef", base.hex[i]));
    assert_string_equal(base.hex, again.hex);
    assert_memory_equal(base.bytes, again.bytes, 16);

    key_of(ARCH, 0, "-DBITS=2", "KVF_INSTANTIATE(4)", &k); /* source */
    assert_string_not_equal(k.hex, base.hex);
    key_of(ARCH, 0, "-DBITS=4", "KVF_INSTANTIATE(2)", &k); /* option */
    assert_string_not_equal(k.hex, base.hex);
    key_of("sm_80", 0, "-DBITS=2", "KVF_INSTANTIATE(2)", &k); /* arch */
    assert_string_not_equal(k.hex, base.hex);
    key_of(ARCH, 1, "-DBITS=2", "KVF_INSTANTIATE(2)", &k); /* NVRTC version */
    assert_string_not_equal(k.hex, base.hex);
    kvf_cache_make_key(ARCH, 12, 0, NULL, 0, NULL, NULL, 0, &k);
    kvf_cache_make_key(ARCH, 1, 20, NULL, 0, NULL, NULL, 0, &again); /* "12.0" vs "1.20" */
    assert_string_not_equal(k.hex, again.hex);

    /* explicit lengths give the same key as NUL-terminated sources */
    const char *opts[] = {"-std=c++17", "-DBITS=2"};
    const char *srcs[] = {"#include <kvf_rtn.cuh>\n", "KVF_INSTANTIATE(2)"};
    size_t lens[] = {strlen(srcs[0]), strlen(srcs[1])};
    kvf_cache_make_key(ARCH, 13, 0, opts, 2, srcs, lens, 2, &k);
    assert_string_equal(k.hex, base.hex);

    /* concatenation is unambiguous: "ab" vs "a","b"; an option vs a source */
    const char *ab[] = {"ab"}, *a_b[] = {"a", "b"}, *x[] = {"x"}, *ax[] = {"-a", "x"};
    const char *opt_a[] = {"-a"};
    kvf_cache_make_key(ARCH, 13, 0, NULL, 0, ab, NULL, 1, &k);
    kvf_cache_make_key(ARCH, 13, 0, NULL, 0, a_b, NULL, 2, &again);
    assert_string_not_equal(k.hex, again.hex);
    kvf_cache_make_key(ARCH, 13, 0, opt_a, 1, x, NULL, 1, &k);
    kvf_cache_make_key(ARCH, 13, 0, NULL, 0, ax, NULL, 2, &again);
    assert_string_not_equal(k.hex, again.hex);
}

static void test_changed_key_misses(void **state) {
    (void)state;
    static uint8_t payload[4096];
    kvf_cache_key base, k;
    fill_payload(payload, sizeof payload, 2);
    base_key(&base);
    put_ok(ARCH, &base, payload, sizeof payload);
    key_of(ARCH, 0, "-DBITS=2", "KVF_INSTANTIATE(4)", &k);
    assert_miss(ARCH, &k);
    key_of(ARCH, 0, "-DBITS=4", "KVF_INSTANTIATE(2)", &k);
    assert_miss(ARCH, &k);
    key_of(ARCH, 1, "-DBITS=2", "KVF_INSTANTIATE(2)", &k);
    assert_miss(ARCH, &k);
    key_of("sm_80", 0, "-DBITS=2", "KVF_INSTANTIATE(2)", &k);
    assert_miss("sm_80", &k);
    assert_miss("sm_80", &base); /* same key, other arch folder */
    assert_hit(ARCH, &base, payload, sizeof payload);
}

/* Damage the entry with `damage`, expect a miss, then put and expect a hit. */
static void check_recovers(const fixture *fx, void (*damage)(const char *path),
                           const char *reason) {
    static uint8_t payload[8192];
    kvf_cache_key k;
    fill_payload(payload, sizeof payload, 3);
    base_key(&k);
    put_ok(ARCH, &k, payload, sizeof payload);
    assert_hit(ARCH, &k, payload, sizeof payload);
    damage(entry_path(fx, ARCH, &k, ".bin"));
    assert_miss(ARCH, &k);
    if (reason && !strstr(kvf_last_error(), reason))
        fail_msg("miss reason \"%s\" lacks \"%s\"", kvf_last_error(), reason);
    put_ok(ARCH, &k, payload, sizeof payload);
    assert_hit(ARCH, &k, payload, sizeof payload);
}

static void flip_byte_at(const char *path, long off_from_end) {
    FILE *f = fopen(path, "r+b");
    assert_non_null(f);
    assert_int_equal(fseek(f, off_from_end, off_from_end < 0 ? SEEK_END : SEEK_SET), 0);
    int c = fgetc(f);
    assert_int_equal(fseek(f, -1, SEEK_CUR), 0);
    fputc(c ^ 0x40, f);
    assert_int_equal(fclose(f), 0);
}

static void flip_payload_byte(const char *path) { flip_byte_at(path, -100); }
static void flip_meta_byte(const char *path) { flip_byte_at(path, 32 + 3); }
static void flip_magic(const char *path) { flip_byte_at(path, 0); }
static void bump_version(const char *path) { flip_byte_at(path, 8); }
static void truncate_tail(const char *path) {
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(truncate(path, st.st_size - 1), 0);
}
static void truncate_header(const char *path) { assert_int_equal(truncate(path, 10), 0); }
static void make_empty(const char *path) { assert_int_equal(truncate(path, 0), 0); }
static void write_garbage(const char *path) {
    uint8_t junk[5000];
    fill_payload(junk, sizeof junk, 99);
    tu_write_file(path, junk, sizeof junk);
}
static void grow_file(const char *path) {
    FILE *f = fopen(path, "ab");
    assert_non_null(f);
    fputs("trailing", f);
    fclose(f);
}

static void test_corrupt_entries_miss(void **state) {
    fixture *fx = *state;
    check_recovers(fx, flip_payload_byte, "checksum");
    check_recovers(fx, flip_meta_byte, "checksum");
    check_recovers(fx, flip_magic, "magic");
    check_recovers(fx, bump_version, "version");
    check_recovers(fx, truncate_tail, "corrupt");
    check_recovers(fx, truncate_header, "shorter");
    check_recovers(fx, make_empty, "shorter");
    check_recovers(fx, write_garbage, "corrupt");
    check_recovers(fx, grow_file, "corrupt");
}

/* A cache directory under a regular file cannot be created (root or not). */
static void test_uncreatable_dir(void **state) {
    fixture *fx = *state;
    static uint8_t payload[1000];
    char file[PATH_MAX], dir[PATH_MAX + 16];
    capture cap;
    kvf_cache_key k;
    fill_payload(payload, sizeof payload, 4);
    base_key(&k);
    snprintf(file, sizeof file, "%s/file", fx->tmp);
    tu_write_file(file, "x", 1);
    snprintf(dir, sizeof dir, "%s/sub", file);
    setenv("KVFORGE_CACHE_DIR", dir, 1);

    capture_begin(&cap, fx);
    assert_miss(ARCH, &k);
    assert_int_equal(kvf_cache_put(ARCH, &k, META, payload, sizeof payload), KVF_OK);
    assert_non_null(strstr(kvf_last_error(), dir));
    assert_non_null(strstr(kvf_last_error(), strerror(ENOTDIR)));
    assert_miss(ARCH, &k);
    assert_int_equal(kvf_cache_put(ARCH, &k, META, payload, sizeof payload), KVF_OK);
    assert_int_equal(kvf_cache_lock(ARCH, &k), -1);
    char *err = capture_end(&cap);
    assert_int_equal(kvf_count_str(err, "warning"), 1);
    assert_non_null(strstr(err, dir));
    assert_non_null(strstr(err, strerror(ENOTDIR)));
    free(err);
}

/* A directory owned by another user is refused (tests run as root: chown works). */
static void test_foreign_owner_refused(void **state) {
    fixture *fx = *state;
    static uint8_t payload[1000];
    capture cap;
    kvf_cache_key k;
    fill_payload(payload, sizeof payload, 5);
    base_key(&k);
    uid_t other = geteuid() == 65534 ? 65533 : 65534;
    char owned_by[64];
    snprintf(owned_by, sizeof owned_by, "owned by uid %u", (unsigned)other);
    assert_int_equal(mkdir(fx->cache, 0700), 0);
    if (chown(fx->cache, other, other) != 0) skip(); /* not root: cannot give it away */

    capture_begin(&cap, fx);
    assert_int_equal(kvf_cache_put(ARCH, &k, META, payload, sizeof payload), KVF_OK);
    assert_miss(ARCH, &k);
    assert_int_equal(kvf_cache_lock(ARCH, &k), -1);
    char *err = capture_end(&cap);
    assert_int_equal(kvf_count_str(err, "warning"), 1);
    assert_non_null(strstr(err, owned_by));
    assert_non_null(strstr(err, fx->cache));
    free(err);
    assert_int_equal(count_names(fx->cache, ""), 0); /* nothing written there */
}

static void test_world_writable_refused(void **state) {
    fixture *fx = *state;
    static uint8_t payload[1000];
    char arch_dir[PATH_MAX + 16];
    capture cap;
    kvf_cache_key k;
    fill_payload(payload, sizeof payload, 6);
    base_key(&k);
    assert_int_equal(mkdir(fx->cache, 0700), 0);
    assert_int_equal(chmod(fx->cache, 0777), 0);

    capture_begin(&cap, fx);
    assert_int_equal(kvf_cache_put(ARCH, &k, META, payload, sizeof payload), KVF_OK);
    assert_miss(ARCH, &k);
    char *err = capture_end(&cap);
    assert_int_equal(kvf_count_str(err, "warning"), 1);
    assert_non_null(strstr(err, "writable by group or others"));
    free(err);
    assert_int_equal(count_names(fx->cache, ""), 0);

    /* a group-writable arch folder inside a good root is refused as well */
    assert_int_equal(chmod(fx->cache, 0700), 0);
    snprintf(arch_dir, sizeof arch_dir, "%s/%s", fx->cache, ARCH);
    assert_int_equal(mkdir(arch_dir, 0700), 0);
    assert_int_equal(chmod(arch_dir, 0770), 0);
    capture_begin(&cap, fx);
    assert_int_equal(kvf_cache_put(ARCH, &k, META, payload, sizeof payload), KVF_OK);
    assert_miss(ARCH, &k);
    err = capture_end(&cap);
    assert_int_equal(kvf_count_str(err, "warning"), 1);
    assert_non_null(strstr(err, arch_dir));
    free(err);
    assert_int_equal(count_names(arch_dir, ""), 0);
}

/* An entry owned by another user is not served (tests run as root: chown works);
 * `cache list` shows it refused; the next put replaces it with one of ours. */
static void test_foreign_entry_refused(void **state) {
    fixture *fx = *state;
    static uint8_t payload[3000];
    char owned_by[80], *text;
    size_t len;
    struct stat st;
    kvf_cache_key k;
    fill_payload(payload, sizeof payload, 14);
    base_key(&k);
    put_ok(ARCH, &k, payload, sizeof payload);
    const char *path = entry_path(fx, ARCH, &k, ".bin");
    uid_t other = geteuid() == 65534 ? 65533 : 65534;
    if (chown(path, other, other) != 0) skip(); /* not root: cannot give it away */
    snprintf(owned_by, sizeof owned_by, "refused: owned by uid %u", (unsigned)other);
    assert_miss(ARCH, &k);
    if (!strstr(kvf_last_error(), owned_by)) fail_msg("miss reason: %s", kvf_last_error());
    text = list_text(&len);
    snprintf(owned_by, sizeof owned_by, "%s refused (owned by uid %u", k.hex, (unsigned)other);
    if (!strstr(text, owned_by)) fail_msg("cache list: %s", text);
    free(text);
    put_ok(ARCH, &k, payload, sizeof payload);
    assert_hit(ARCH, &k, payload, sizeof payload);
    assert_int_equal(lstat(path, &st), 0);
    assert_int_equal(st.st_uid, geteuid());
}

/* An entry others could have written is not served either. */
static void test_writable_entry_refused(void **state) {
    fixture *fx = *state;
    static uint8_t payload[3000];
    static const mode_t modes[] = {0666, 0620, 0602};
    struct stat st;
    kvf_cache_key k;
    fill_payload(payload, sizeof payload, 15);
    base_key(&k);
    const char *path = entry_path(fx, ARCH, &k, ".bin");
    for (size_t i = 0; i < sizeof modes / sizeof modes[0]; i++) {
        put_ok(ARCH, &k, payload, sizeof payload);
        assert_hit(ARCH, &k, payload, sizeof payload);
        assert_int_equal(chmod(path, modes[i]), 0);
        assert_miss(ARCH, &k);
        if (!strstr(kvf_last_error(), "refused: writable by group or others"))
            fail_msg("mode %o: miss reason: %s", (unsigned)modes[i], kvf_last_error());
    }
    put_ok(ARCH, &k, payload, sizeof payload);
    assert_hit(ARCH, &k, payload, sizeof payload);
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(st.st_mode & 077, 0);
}

static void test_cache_off(void **state) {
    fixture *fx = *state;
    static uint8_t payload[1000];
    char buf[PATH_MAX];
    kvf_cache_key k;
    fill_payload(payload, sizeof payload, 7);
    base_key(&k);
    put_ok(ARCH, &k, payload, sizeof payload);
    setenv("KVFORGE_CACHE", "0", 1);
    assert_miss(ARCH, &k); /* the entry is there, but the cache is off */
    assert_int_equal(kvf_cache_dir(buf, sizeof buf), KVF_OK);
    assert_string_equal(buf, "");
    assert_int_equal(kvf_cache_lock(ARCH, &k), -1);
    assert_int_equal(kvf_cache_clear(), KVF_OK);
    unsetenv("KVFORGE_CACHE");
    assert_hit(ARCH, &k, payload, sizeof payload); /* clear did nothing while off */

    /* off: put writes nothing, not even the directory */
    char fresh[PATH_MAX + 16];
    snprintf(fresh, sizeof fresh, "%s/fresh", fx->tmp);
    setenv("KVFORGE_CACHE_DIR", fresh, 1);
    setenv("KVFORGE_CACHE", "0", 1);
    assert_int_equal(kvf_cache_put(ARCH, &k, META, payload, sizeof payload), KVF_OK);
    assert_false(exists(fresh));
    unsetenv("KVFORGE_CACHE");
}

static void test_symlinks_not_followed(void **state) {
    fixture *fx = *state;
    static uint8_t payload[2000];
    char elsewhere[PATH_MAX + 32], other_dir[PATH_MAX + 32], link_dir[PATH_MAX + 32];
    capture cap;
    kvf_cache_key k;
    fill_payload(payload, sizeof payload, 8);
    base_key(&k);
    put_ok(ARCH, &k, payload, sizeof payload);
    /* move the valid entry away and leave a symlink to it */
    snprintf(elsewhere, sizeof elsewhere, "%s/elsewhere.bin", fx->tmp);
    assert_int_equal(rename(entry_path(fx, ARCH, &k, ".bin"), elsewhere), 0);
    assert_int_equal(symlink(elsewhere, entry_path(fx, ARCH, &k, ".bin")), 0);
    assert_miss(ARCH, &k);
    assert_non_null(strstr(kvf_last_error(), "symlink"));
    /* the next put replaces the link, not its target */
    payload[0] ^= 1;
    put_ok(ARCH, &k, payload, sizeof payload);
    assert_hit(ARCH, &k, payload, sizeof payload);
    struct stat st;
    assert_int_equal(lstat(entry_path(fx, ARCH, &k, ".bin"), &st), 0);
    assert_true(S_ISREG(st.st_mode));

    /* an arch folder that is a symlink is not used */
    snprintf(other_dir, sizeof other_dir, "%s/other", fx->tmp);
    snprintf(link_dir, sizeof link_dir, "%s/sm_86", fx->cache);
    assert_int_equal(mkdir(other_dir, 0700), 0);
    assert_int_equal(symlink(other_dir, link_dir), 0);
    capture_begin(&cap, fx);
    assert_int_equal(kvf_cache_put("sm_86", &k, META, payload, sizeof payload), KVF_OK);
    assert_miss("sm_86", &k);
    char *err = capture_end(&cap);
    assert_int_equal(kvf_count_str(err, "warning"), 1);
    assert_non_null(strstr(err, "symlink"));
    free(err);
    assert_int_equal(count_names(other_dir, ""), 0);
}

static void test_bad_arguments(void **state) {
    (void)state;
    uint8_t payload[16] = {1};
    void *p;
    size_t n;
    kvf_cache_key k;
    base_key(&k);
    assert_int_equal(kvf_cache_put("../etc", &k, META, payload, sizeof payload), KVF_EINVAL);
    assert_int_equal(kvf_cache_put("", &k, META, payload, sizeof payload), KVF_EINVAL);
    assert_int_equal(kvf_cache_put(NULL, &k, META, payload, sizeof payload), KVF_EINVAL);
    assert_int_equal(kvf_cache_put(ARCH, NULL, META, payload, sizeof payload), KVF_EINVAL);
    assert_int_equal(kvf_cache_put(ARCH, &k, META, NULL, 0), KVF_EINVAL);
    assert_int_equal(kvf_cache_get("a/b", &k, &p, &n), KVF_EINVAL);
    assert_int_equal(kvf_cache_get(ARCH, &k, NULL, &n), KVF_EINVAL);
    assert_int_equal(kvf_cache_lock("..", &k), -1);
    assert_int_equal(kvf_cache_dir(NULL, 10), KVF_EINVAL);
    assert_int_equal(kvf_cache_list(NULL), KVF_EINVAL);
    kvf_cache_unlock(-1); /* harmless */
}

static void test_cache_dir_from_environment(void **state) {
    fixture *fx = *state;
    char buf[PATH_MAX], small[8];
    char *home = getenv("HOME") ? strdup(getenv("HOME")) : NULL;
    char *xdg = getenv("XDG_CACHE_HOME") ? strdup(getenv("XDG_CACHE_HOME")) : NULL;

    assert_int_equal(kvf_cache_dir(buf, sizeof buf), KVF_OK);
    assert_string_equal(buf, fx->cache);
    assert_int_equal(kvf_cache_dir(small, sizeof small), KVF_ERANGE);

    unsetenv("KVFORGE_CACHE_DIR");
    setenv("XDG_CACHE_HOME", "/xdg/cache", 1);
    setenv("HOME", "/home/someone", 1);
    assert_int_equal(kvf_cache_dir(buf, sizeof buf), KVF_OK);
    assert_string_equal(buf, "/xdg/cache/kvforge");
    setenv("XDG_CACHE_HOME", "relative/ignored", 1);
    assert_int_equal(kvf_cache_dir(buf, sizeof buf), KVF_OK);
    assert_string_equal(buf, "/home/someone/.cache/kvforge");
    unsetenv("XDG_CACHE_HOME");
    assert_int_equal(kvf_cache_dir(buf, sizeof buf), KVF_OK);
    assert_string_equal(buf, "/home/someone/.cache/kvforge");
    setenv("KVFORGE_CACHE_DIR", "", 1); /* empty = unset */
    assert_int_equal(kvf_cache_dir(buf, sizeof buf), KVF_OK);
    assert_string_equal(buf, "/home/someone/.cache/kvforge");

    /* HOME as the fallback actually works end to end */
    setenv("HOME", fx->tmp, 1);
    static uint8_t payload[500];
    kvf_cache_key k;
    fill_payload(payload, sizeof payload, 9);
    base_key(&k);
    put_ok(ARCH, &k, payload, sizeof payload);
    assert_hit(ARCH, &k, payload, sizeof payload);
    snprintf(buf, sizeof buf, "%s/.cache/kvforge/%s/%s.bin", fx->tmp, ARCH, k.hex);
    assert_true(exists(buf));

    if (home) setenv("HOME", home, 1); else unsetenv("HOME");
    if (xdg) setenv("XDG_CACHE_HOME", xdg, 1); else unsetenv("XDG_CACHE_HOME");
    free(home);
    free(xdg);
}

static void test_lock(void **state) {
    fixture *fx = *state;
    kvf_cache_key k;
    base_key(&k);
    int fd = kvf_cache_lock(ARCH, &k);
    if (fd < 0) fail_msg("lock: %s", kvf_last_error());
    assert_true(exists(entry_path(fx, ARCH, &k, ".lock")));
    /* another process cannot take it while we hold it */
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int child_fd = open(entry_path(fx, ARCH, &k, ".lock"), O_RDWR);
        _exit(flock(child_fd, LOCK_EX | LOCK_NB) == 0 ? 1 : (errno == EWOULDBLOCK ? 0 : 2));
    }
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
    kvf_cache_unlock(fd);
    int again = kvf_cache_lock(ARCH, &k);
    assert_true(again >= 0);
    kvf_cache_unlock(again);
}

/* ---- processes racing on one key */

#define RACE_BYTES (1u << 20)
enum { RACE_LOCKED = 4, RACE_UNLOCKED = 4, RACE_PUTS = 4, RACE_READS = 200 };

static int payload_matches(const void *got, size_t n, const uint8_t *want) {
    return n == RACE_BYTES && memcmp(got, want, RACE_BYTES) == 0;
}

/* Lock, double-check, "compile" and put on a miss: exit 0 hit, 1 compiled. */
static int race_locked(const kvf_cache_key *k, const uint8_t *want) {
    void *got;
    size_t n;
    int fd = kvf_cache_lock(ARCH, k);
    if (fd < 0) return 10;
    int rc = kvf_cache_get(ARCH, k, &got, &n);
    if (rc == KVF_OK) {
        int ok = payload_matches(got, n, want);
        free(got);
        kvf_cache_unlock(fd);
        return ok ? 0 : 11;
    }
    usleep(20000); /* compiling */
    if (kvf_cache_put(ARCH, k, META, want, RACE_BYTES) != KVF_OK) return 12;
    kvf_cache_unlock(fd);
    return 1;
}

static int race_unlocked(const kvf_cache_key *k, const uint8_t *want) {
    for (int i = 0; i < RACE_PUTS; i++)
        if (kvf_cache_put(ARCH, k, META, want, RACE_BYTES) != KVF_OK) return 20;
    return 0;
}

/* Every hit a reader sees is whole. */
static int race_reader(const kvf_cache_key *k, const uint8_t *want) {
    for (int i = 0; i < RACE_READS; i++) {
        void *got;
        size_t n;
        int rc = kvf_cache_get(ARCH, k, &got, &n);
        if (rc == KVF_OK) {
            int ok = payload_matches(got, n, want);
            free(got);
            if (!ok) return 30;
        } else if (rc != 1) {
            return 31;
        }
    }
    return 0;
}

/* After a race: at most one racer compiled (the lock and double-check stopped
 * the others), the entry is whole, one entry and no temp file are left. */
static void check_race_end(const fixture *fx, const kvf_cache_key *k, const uint8_t *want, int compiled) {
    assert_true(compiled <= 1);
    assert_hit(ARCH, k, want, RACE_BYTES);
    char arch_dir[PATH_MAX + 16];
    snprintf(arch_dir, sizeof arch_dir, "%s/%s", fx->cache, ARCH);
    assert_int_equal(count_names(arch_dir, ".tmp."), 0);
    assert_int_equal(count_names(arch_dir, ".bin"), 1);
}

static void test_processes_race(void **state) {
    fixture *fx = *state;
    uint8_t *want = malloc(RACE_BYTES);
    pid_t pids[RACE_LOCKED + RACE_UNLOCKED + 1];
    int go[2], n = 0;
    kvf_cache_key k;
    fill_payload(want, RACE_BYTES, 10);
    base_key(&k);
    assert_int_equal(pipe(go), 0);
    for (int i = 0; i < RACE_LOCKED + RACE_UNLOCKED + 1; i++) {
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            char c;
            close(go[1]);
            if (read(go[0], &c, 1) != 0) _exit(40); /* wait for the start */
            if (i < RACE_LOCKED) _exit(race_locked(&k, want));
            if (i < RACE_LOCKED + RACE_UNLOCKED) _exit(race_unlocked(&k, want));
            _exit(race_reader(&k, want));
        }
        pids[n++] = pid;
    }
    close(go[0]);
    close(go[1]); /* everyone starts now */
    int compiled = 0;
    for (int i = 0; i < n; i++) {
        int status;
        assert_int_equal(waitpid(pids[i], &status, 0), pids[i]);
        assert_true(WIFEXITED(status));
        int code = WEXITSTATUS(status);
        if (i < RACE_LOCKED && code == 1) { compiled++; continue; }
        if (code) fail_msg("child %d exited with %d", i, code);
    }
    check_race_end(fx, &k, want, compiled);
    free(want);
}

/* ---- threads of one process racing on one key (flock is per open file, so
 * each thread's kvf_cache_lock excludes the others) */

typedef struct race_arg {
    int index;
    const kvf_cache_key *k;
    const uint8_t *want;
    pthread_barrier_t *go;
    int code;
} race_arg;

static void *race_thread(void *p) {
    race_arg *a = p;
    pthread_barrier_wait(a->go);
    if (a->index < RACE_LOCKED) a->code = race_locked(a->k, a->want);
    else if (a->index < RACE_LOCKED + RACE_UNLOCKED) a->code = race_unlocked(a->k, a->want);
    else a->code = race_reader(a->k, a->want);
    return NULL;
}

static void test_threads_race(void **state) {
    fixture *fx = *state;
    enum { N = RACE_LOCKED + RACE_UNLOCKED + 2 };
    uint8_t *want = malloc(RACE_BYTES);
    pthread_t th[N];
    race_arg args[N];
    pthread_barrier_t go;
    kvf_cache_key k;
    fill_payload(want, RACE_BYTES, 16);
    base_key(&k);
    assert_int_equal(pthread_barrier_init(&go, NULL, N), 0);
    for (int i = 0; i < N; i++) {
        args[i] = (race_arg){i, &k, want, &go, -1};
        assert_int_equal(pthread_create(&th[i], NULL, race_thread, &args[i]), 0);
    }
    int compiled = 0;
    for (int i = 0; i < N; i++) {
        pthread_join(th[i], NULL);
        if (i < RACE_LOCKED && args[i].code == 1) { compiled++; continue; }
        if (args[i].code) fail_msg("thread %d returned %d", i, args[i].code);
    }
    pthread_barrier_destroy(&go);
    check_race_end(fx, &k, want, compiled);
    free(want);
}

/* A writer killed mid-way leaves at most a temp file, never a half entry. */
static void test_killed_writer(void **state) {
    fixture *fx = *state;
    size_t big = 32u << 20;
    uint8_t *want = malloc(big);
    char arch_dir[PATH_MAX + 16], stale[PATH_MAX + 64];
    kvf_cache_key k;
    fill_payload(want, big, 11);
    base_key(&k);
    snprintf(arch_dir, sizeof arch_dir, "%s/%s", fx->cache, ARCH);

    for (int round = 0; round < 3; round++) {
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            for (;;) kvf_cache_put(ARCH, &k, META, want, big);
        }
        usleep(30000 + 20000 * round);
        kill(pid, SIGKILL);
        assert_int_equal(waitpid(pid, NULL, 0), pid);
        void *got;
        size_t n;
        int rc = kvf_cache_get(ARCH, &k, &got, &n);
        if (rc == KVF_OK) {
            assert_int_equal(n, big);
            assert_memory_equal(got, want, big);
            free(got);
        } else {
            assert_int_equal(rc, 1);
        }
    }
    print_message("temp files left by killed writers: %d\n", count_names(arch_dir, ".tmp."));
    /* a stale temp file (as a kill -9 leaves) is ignored by get, put and list */
    snprintf(stale, sizeof stale, "%s/%s.bin.tmp.AbC123", arch_dir, k.hex);
    tu_write_file(stale, "KVFCACHE half", 13);
    put_ok(ARCH, &k, want, 1000);
    assert_hit(ARCH, &k, want, 1000);
    size_t len;
    char *text = list_text(&len);
    assert_int_equal(kvf_count_str(text, "\n"), 1);
    free(text);
    assert_int_equal(kvf_cache_clear(), KVF_OK);
    assert_int_equal(count_names(arch_dir, ".tmp."), 0);
    free(want);
}

static void test_list(void **state) {
    fixture *fx = *state;
    static uint8_t payload[4096];
    kvf_cache_key a, b, c;
    char *text;
    size_t len;
    fill_payload(payload, sizeof payload, 12);
    base_key(&a);
    key_of("sm_80", 8, "-DBITS=4", "KVF_INSTANTIATE(4)", &b);
    key_of(ARCH, 0, "-DBITS=8", "KVF_INSTANTIATE(8)", &c);
    put_ok(ARCH, &a, payload, sizeof payload);
    const char *meta_b = "{\"scheme\":\"rtn_int4_00c0ffee\",\"nvrtc\":\"12.8\"}";
    assert_int_equal(kvf_cache_put("sm_80", &b, meta_b, payload, 100), KVF_OK);
    put_ok(ARCH, &c, payload, 10);
    flip_payload_byte(entry_path(fx, ARCH, &c, ".bin"));
    kvf_cache_unlock(kvf_cache_lock(ARCH, &a)); /* a lock file: not an entry */

    text = list_text(&len);
    fputs(text, stderr);
    assert_int_equal(kvf_count_str(text, "\n"), 3);
    /* sorted by arch: sm_80 first */
    assert_true(strncmp(text, "sm_80 ", 6) == 0);
    char line[512];
    snprintf(line, sizeof line, "sm_80 %s 100 ", b.hex);
    assert_non_null(strstr(text, line));
    assert_non_null(strstr(text, "scheme=rtn_int4_00c0ffee nvrtc=12.8"));
    snprintf(line, sizeof line, "sm_90 %s 4096 ", a.hex);
    assert_non_null(strstr(text, line));
    assert_non_null(strstr(text, "scheme=rtn_int2_1a2b3c4d nvrtc=13.0"));
    snprintf(line, sizeof line, "sm_90 %s corrupt", c.hex);
    assert_non_null(strstr(text, line));
    free(text);

    /* an empty or missing cache lists nothing */
    setenv("KVFORGE_CACHE_DIR", "/nonexistent/kvforge-test", 1);
    text = list_text(&len);
    assert_int_equal(len, 0);
    free(text);
}

static void test_clear(void **state) {
    fixture *fx = *state;
    static uint8_t payload[4096];
    char other[PATH_MAX + 32], stale[PATH_MAX + 64], arch_dir[PATH_MAX + 16];
    kvf_cache_key a, b;
    fill_payload(payload, sizeof payload, 13);
    base_key(&a);
    key_of("sm_80", 0, "-DBITS=2", "KVF_INSTANTIATE(2)", &b);
    put_ok(ARCH, &a, payload, sizeof payload);
    put_ok("sm_80", &b, payload, sizeof payload);
    kvf_cache_unlock(kvf_cache_lock(ARCH, &a));
    snprintf(stale, sizeof stale, "%s/%s/%s.bin.tmp.xYz789", fx->cache, ARCH, a.hex);
    tu_write_file(stale, "half", 4);
    snprintf(other, sizeof other, "%s/%s/README", fx->cache, ARCH);
    tu_write_file(other, "not ours", 8);

    assert_int_equal(kvf_cache_clear(), KVF_OK);
    assert_miss(ARCH, &a);
    assert_miss("sm_80", &b);
    snprintf(arch_dir, sizeof arch_dir, "%s/%s", fx->cache, ARCH);
    assert_int_equal(count_names(arch_dir, ""), 1); /* only README is left */
    assert_true(exists(other));
    snprintf(arch_dir, sizeof arch_dir, "%s/sm_80", fx->cache);
    assert_int_equal(count_names(arch_dir, ""), 0);
    /* clear works again and on a cache that does not exist */
    assert_int_equal(kvf_cache_clear(), KVF_OK);
    setenv("KVFORGE_CACHE_DIR", "/nonexistent/kvforge-test", 1);
    assert_int_equal(kvf_cache_clear(), KVF_OK);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_put_get_hit, setup, teardown),
        cmocka_unit_test_setup_teardown(test_key, setup, teardown),
        cmocka_unit_test_setup_teardown(test_changed_key_misses, setup, teardown),
        cmocka_unit_test_setup_teardown(test_corrupt_entries_miss, setup, teardown),
        cmocka_unit_test_setup_teardown(test_uncreatable_dir, setup, teardown),
        cmocka_unit_test_setup_teardown(test_foreign_owner_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_world_writable_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_foreign_entry_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_writable_entry_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cache_off, setup, teardown),
        cmocka_unit_test_setup_teardown(test_symlinks_not_followed, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_arguments, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cache_dir_from_environment, setup, teardown),
        cmocka_unit_test_setup_teardown(test_lock, setup, teardown),
        cmocka_unit_test_setup_teardown(test_processes_race, setup, teardown),
        cmocka_unit_test_setup_teardown(test_threads_race, setup, teardown),
        cmocka_unit_test_setup_teardown(test_killed_writer, setup, teardown),
        cmocka_unit_test_setup_teardown(test_list, setup, teardown),
        cmocka_unit_test_setup_teardown(test_clear, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
