/*
 * Disk cache of compiled kernels.
 *
 * Directory: $KVFORGE_CACHE_DIR, else $XDG_CACHE_HOME/kvforge (an absolute
 * XDG_CACHE_HOME only, as the XDG spec asks), else $HOME/.cache/kvforge (the
 * passwd home when HOME is unset); one subfolder per arch ("sm_90"). The
 * environment is read on every call. KVFORGE_CACHE=0 (or off/false/no) turns
 * the cache off: get misses, put and clear do nothing, lock returns -1 and
 * kvf_cache_dir gives "".
 *
 * Entry DIR/ARCH/HEX.bin (little-endian):
 *   8  magic "KVFCACHE"
 *   4  format version (ENTRY_VERSION)
 *   4  metadata length M
 *   8  payload length P
 *   8  XXH3-64 of metadata + payload
 *   M  metadata (JSON text written by the caller)
 *   P  payload (the cubin)
 * The file size must be exactly 32 + M + P. Anything else (truncated, wrong
 * magic or version, checksum mismatch, not a regular file, a symlink) is a
 * miss; the next put replaces it. Nothing is removed on a miss, so a reader
 * can never delete an entry another process has just renamed into place.
 *
 * Writes go to DIR/ARCH/HEX.bin.tmp.XXXXXX (mkostemp), are fsync'ed and renamed
 * over HEX.bin: a reader sees the old entry or the new one, never half of one;
 * a writer killed mid-way leaves only a temp file, which get, put and list
 * ignore and kvf_cache_clear removes. Two processes compiling the same key are
 * safe without a lock (either rename wins, both entries are valid);
 * kvf_cache_lock (flock on HEX.lock) lets a caller avoid compiling twice:
 * lock, get again, compile and put on a miss, unlock.
 *
 * Security: the root and arch directories must be directories owned by the
 * effective user and not writable by group or others; the arch directory and
 * entries are opened with O_NOFOLLOW; an entry must be a regular file owned by
 * the effective user and not writable by group or others (else a miss, and the
 * next put replaces it). A directory that cannot be created or is
 * refused disables the cache with one warning per directory (kvf_warn_once)
 * naming the path, the failing call and the errno text; everything else keeps
 * working.
 *
 * Statuses: get returns KVF_OK on a hit, CACHE_MISS (1) on a miss of any kind
 * (the reason is in kvf_last_error) and KVF_EINVAL/KVF_ENOMEM otherwise. put
 * returns KVF_OK when the entry was stored, the cache is off, or it could not
 * be stored (warned once; the reason is in kvf_last_error): a cache that does
 * not work never fails the caller. Only bad arguments give KVF_EINVAL.
 */
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include "internal.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <limits.h>
#include <pwd.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#define ENTRY_MAGIC "KVFCACHE"
#define ENTRY_VERSION 1u
#define ENTRY_HEADER_BYTES 32u
#define KEY_DOMAIN "kvforge-cache-key-v1"
#define HEX_LEN 32
#define ARCH_MAX 32
#define TEMP_INFIX ".bin.tmp."

_Static_assert(sizeof(size_t) >= sizeof(uint64_t), "entry sizes are 64-bit");

enum { CACHE_MISS = 1 };
/* Outcomes of opening the cache directories besides KVF_OK and errors. */
enum { DIR_OFF = 1, DIR_ABSENT = 2 };

/* ================================================================== key */

static void hash_count(XXH3_state_t *st, uint64_t n) {
    uint8_t le[8];
    kvf_put_u64(le, n);
    XXH3_128bits_update(st, le, sizeof le);
}

/* Length-prefixed field: no two field lists concatenate to the same bytes. */
static void hash_field(XXH3_state_t *st, const void *data, size_t len) {
    hash_count(st, len);
    if (len) XXH3_128bits_update(st, data, len);
}

static void hash_string(XXH3_state_t *st, const char *s) {
    hash_field(st, s ? s : "", s ? strlen(s) : 0);
}

void kvf_cache_make_key(const char *arch, int nvrtc_major, int nvrtc_minor,
                        const char *const *options, int n_options,
                        const char *const *sources, const size_t *source_lens, int n_sources,
                        kvf_cache_key *out) {
    XXH3_state_t st;
    char nvrtc[32];
    XXH3_INITSTATE(&st);
    XXH3_128bits_reset(&st);
    hash_string(&st, KEY_DOMAIN);
    hash_string(&st, KVF_VERSION_STRING);
    hash_string(&st, arch);
    snprintf(nvrtc, sizeof nvrtc, "%d.%d", nvrtc_major, nvrtc_minor);
    hash_string(&st, nvrtc);
    hash_count(&st, n_options > 0 ? (uint64_t)n_options : 0);
    for (int i = 0; i < n_options; i++) hash_string(&st, options[i]);
    hash_count(&st, n_sources > 0 ? (uint64_t)n_sources : 0);
    for (int i = 0; i < n_sources; i++) {
        const char *src = sources[i] ? sources[i] : "";
        size_t len = source_lens && sources[i] ? source_lens[i] : strlen(src);
        hash_field(&st, src, len);
    }
    XXH128_canonical_t canon;
    XXH128_canonicalFromHash(&canon, XXH3_128bits_digest(&st));
    static const char digits[] = "0123456789abcdef";
    for (int i = 0; i < 16; i++) {
        out->bytes[i] = canon.digest[i];
        out->hex[2 * i] = digits[canon.digest[i] >> 4];
        out->hex[2 * i + 1] = digits[canon.digest[i] & 15];
    }
    out->hex[HEX_LEN] = 0;
}

/* ============================================================ directory */

static bool cache_disabled(void) {
    const char *v = getenv("KVFORGE_CACHE");
    return v && (!strcmp(v, "0") || !strcasecmp(v, "off") || !strcasecmp(v, "false") ||
                 !strcasecmp(v, "no"));
}

static int format_path(char *buf, size_t len, const char *a, const char *b) {
    int n = snprintf(buf, len, "%s%s", a, b);
    if (n < 0 || (size_t)n >= len)
        return kvf_set_error(KVF_ERANGE, "disk cache: path too long: %s%s", a, b);
    return KVF_OK;
}

static int join_path(char *buf, size_t len, const char *dir, const char *name) {
    int n = snprintf(buf, len, "%s/%s", dir, name);
    if (n < 0 || (size_t)n >= len)
        return kvf_set_error(KVF_ERANGE, "disk cache: path too long: %s/%s", dir, name);
    return KVF_OK;
}

static const char *passwd_home(char *buf, size_t len) {
    struct passwd pw, *res = NULL;
    if (getpwuid_r(geteuid(), &pw, buf, len, &res) != 0 || !res || !pw.pw_dir) return NULL;
    return pw.pw_dir;
}

/* Root directory from the environment: KVF_OK, DIR_OFF or an error status. */
static int root_path(char *buf, size_t len) {
    if (cache_disabled()) return DIR_OFF;
    const char *dir = getenv("KVFORGE_CACHE_DIR");
    if (dir && *dir) return format_path(buf, len, dir, "");
    const char *xdg = getenv("XDG_CACHE_HOME");
    if (xdg && xdg[0] == '/') return format_path(buf, len, xdg, "/kvforge");
    char pwbuf[4096];
    const char *home = getenv("HOME");
    if (!home || !*home) home = passwd_home(pwbuf, sizeof pwbuf);
    if (!home)
        return kvf_set_error(KVF_EIO, "disk cache: no directory: KVFORGE_CACHE_DIR, "
                                      "XDG_CACHE_HOME and HOME are unset");
    return format_path(buf, len, home, "/.cache/kvforge");
}

/* kvf_warn_once key for a kind of problem with a directory (long paths cut). */
static void warn_key(char *key, size_t len, const char *kind, const char *path) {
    if (snprintf(key, len, "%s:%s", kind, path) >= (int)len) key[len - 1] = 0;
}

/* The directory cannot be used: record why, warn once for it, KVF_EIO. */
static int dir_unusable(const char *path, const char *what) {
    char key[128];
    kvf_set_error(KVF_EIO, "disk cache: %s: %s", path, what);
    warn_key(key, sizeof key, "cache", path);
    kvf_warn_once(key, "disk cache disabled, kernels will be compiled every time: %s: %s",
                  path, what);
    return KVF_EIO;
}

static int dir_call_failed(const char *path, const char *call, int err) {
    char what[PATH_MAX + 128];
    snprintf(what, sizeof what, "%s: %s", call, strerror(err));
    return dir_unusable(path, what);
}

/* mkdir -p with mode 0700; on failure *failed is the component that failed. */
static int mkdir_p(const char *path, char *failed, size_t failed_len) {
    char tmp[PATH_MAX];
    if (format_path(tmp, sizeof tmp, path, "")) {
        snprintf(failed, failed_len, "%s", path);
        errno = ENAMETOOLONG;
        return -1;
    }
    for (char *p = tmp + 1;; p++) {
        if (*p != '/' && *p != 0) continue;
        char saved = *p;
        *p = 0;
        if (mkdir(tmp, 0700) != 0 && errno != EEXIST) {
            snprintf(failed, failed_len, "%s", tmp);
            return -1;
        }
        *p = saved;
        if (!saved) return 0;
    }
}

/* The cache's trust rule for the root, the arch directories and the entries:
 * owned by the effective user and not writable by group or others. If not,
 * false and the reason ("refused: ...") in what. */
static bool is_private(const struct stat *st, char *what, size_t len) {
    if (st->st_uid != geteuid()) {
        snprintf(what, len, "refused: owned by uid %u, not by the current user (uid %u)",
                 (unsigned)st->st_uid, (unsigned)geteuid());
        return false;
    }
    if (st->st_mode & (S_IWGRP | S_IWOTH)) {
        snprintf(what, len, "refused: writable by group or others (mode %03o)",
                 (unsigned)(st->st_mode & 0777));
        return false;
    }
    return true;
}

/* Refuse a directory that is not ours or that others can write into. */
static int check_private_dir(int fd, const char *path) {
    struct stat st;
    char what[128];
    if (fstat(fd, &st) != 0) return dir_call_failed(path, "fstat", errno);
    if (!S_ISDIR(st.st_mode)) return dir_unusable(path, "not a directory");
    if (!is_private(&st, what, sizeof what)) return dir_unusable(path, what);
    return KVF_OK;
}

/* Open (and with create, make) the root: KVF_OK with *fd, DIR_ABSENT, KVF_EIO. */
static int open_root(const char *root, bool create, int *fd) {
    char failed[PATH_MAX];
    *fd = -1;
    if (create && mkdir_p(root, failed, sizeof failed) != 0) {
        char call[PATH_MAX + 8];
        int err = errno;
        snprintf(call, sizeof call, "mkdir %s", failed);
        return dir_call_failed(root, call, err);
    }
    int d = open(root, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (d < 0) {
        if (errno == ENOENT && !create) return DIR_ABSENT;
        return dir_call_failed(root, "open", errno);
    }
    int rc = check_private_dir(d, root);
    if (rc) { close(d); return rc; }
    *fd = d;
    return KVF_OK;
}

/* Open an arch subdirectory of an open root without following a symlink. */
static int open_subdir(int rootfd, const char *path, const char *name, bool create, int *fd) {
    *fd = -1;
    if (create && mkdirat(rootfd, name, 0700) != 0 && errno != EEXIST)
        return dir_call_failed(path, "mkdir", errno);
    int d = openat(rootfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (d < 0) {
        int err = errno;
        struct stat st;
        if (err == ENOENT && !create) return DIR_ABSENT;
        if (fstatat(rootfd, name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode))
            return dir_unusable(path, "refused: a symlink");
        return dir_call_failed(path, "open", err);
    }
    int rc = check_private_dir(d, path);
    if (rc) { close(d); return rc; }
    *fd = d;
    return KVF_OK;
}

static bool valid_arch(const char *arch) {
    size_t n = arch ? strlen(arch) : 0;
    if (n == 0 || n >= ARCH_MAX || arch[0] == '.') return false;
    for (size_t i = 0; i < n; i++) {
        char c = arch[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_' || c == '.' || c == '-'))
            return false;
    }
    return true;
}

static int check_args(const char *arch, const kvf_cache_key *key, const char *fn) {
    if (!valid_arch(arch))
        return kvf_set_error(KVF_EINVAL, "%s: invalid arch \"%s\"", fn, arch ? arch : "(null)");
    if (!key || strnlen(key->hex, sizeof key->hex) != HEX_LEN)
        return kvf_set_error(KVF_EINVAL, "%s: invalid key", fn);
    return KVF_OK;
}

/*
 * Open DIR/ARCH: KVF_OK with *fd and path (DIR/ARCH), DIR_OFF, DIR_ABSENT (not
 * there and !create), or an error (set, and warned once where the directory
 * is unusable).
 */
static int open_arch_dir(const char *arch, bool create, int *fd, char *path, size_t path_len) {
    char root[PATH_MAX];
    int rootfd, rc;
    *fd = -1;
    rc = root_path(root, sizeof root);
    if (rc == DIR_OFF) return rc;
    if (rc) {
        char why[512];
        snprintf(why, sizeof why, "%s", kvf_last_error());
        return dir_unusable("(cache directory)", why);
    }
    rc = open_root(root, create, &rootfd);
    if (rc) return rc;
    rc = join_path(path, path_len, root, arch);
    if (!rc) rc = open_subdir(rootfd, path, arch, create, fd);
    close(rootfd);
    return rc;
}

/* ================================================================ entries */

typedef struct entry {
    uint8_t *data;        /* metadata then payload (malloc'ed) */
    uint32_t meta_len;
    uint64_t payload_len;
    time_t mtime;
    char why[96];         /* reason of a miss */
} entry;

/* Read exactly n bytes: 0, or -1 with errno (0 = end of file). */
static int read_full(int fd, void *buf, size_t n) {
    uint8_t *p = buf;
    while (n) {
        ssize_t r = read(fd, p, n > (1u << 30) ? (1u << 30) : n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) { if (r == 0) errno = 0; return -1; }
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

static int entry_miss(entry *e, const char *dir, const char *name, const char *what, int err) {
    snprintf(e->why, sizeof e->why, "%s%s%s", what, err ? ": " : "", err ? strerror(err) : "");
    return kvf_set_error(CACHE_MISS, "disk cache miss: %s/%s: %s", dir, name, e->why);
}

/* Parse and check the 32-byte header against the file size. */
static int parse_header(const uint8_t *h, uint64_t file_size, entry *e, uint64_t *sum,
                        const char **why) {
    if (memcmp(h, ENTRY_MAGIC, 8) != 0) { *why = "corrupt: wrong magic"; return -1; }
    if (kvf_get_u32(h + 8) != ENTRY_VERSION) { *why = "corrupt: unknown format version"; return -1; }
    e->meta_len = kvf_get_u32(h + 12);
    e->payload_len = kvf_get_u64(h + 16);
    *sum = kvf_get_u64(h + 24);
    uint64_t body = file_size - ENTRY_HEADER_BYTES;
    if (e->payload_len > body || e->meta_len != body - e->payload_len) {
        *why = "corrupt: sizes do not match the file size (truncated?)";
        return -1;
    }
    if (e->payload_len == 0) { *why = "corrupt: empty payload"; return -1; }
    return 0;
}

/* Read and verify an entry of an open arch dir: KVF_OK, CACHE_MISS, KVF_ENOMEM. */
static int read_entry_fd(int fd, const char *dir, const char *name, entry *e) {
    struct stat st;
    uint8_t h[ENTRY_HEADER_BYTES];
    const char *why = NULL;
    uint64_t sum;
    if (fstat(fd, &st) != 0) return entry_miss(e, dir, name, "fstat", errno);
    if (!S_ISREG(st.st_mode)) return entry_miss(e, dir, name, "not a regular file", 0);
    char what[80];
    if (!is_private(&st, what, sizeof what)) return entry_miss(e, dir, name, what, 0);
    e->mtime = st.st_mtime;
    if (st.st_size < (off_t)ENTRY_HEADER_BYTES)
        return entry_miss(e, dir, name, "corrupt: shorter than the header", 0);
    if (read_full(fd, h, sizeof h) != 0) return entry_miss(e, dir, name, "read", errno);
    if (parse_header(h, (uint64_t)st.st_size, e, &sum, &why) != 0)
        return entry_miss(e, dir, name, why, 0);
    size_t body = (size_t)e->meta_len + (size_t)e->payload_len;
    e->data = malloc(body);
    if (!e->data)
        return kvf_set_error(KVF_ENOMEM, "disk cache: %s/%s: malloc(%zu) failed", dir, name, body);
    if (read_full(fd, e->data, body) != 0) {
        int err = errno;
        free(e->data);
        e->data = NULL;
        return err ? entry_miss(e, dir, name, "read", err)
                   : entry_miss(e, dir, name, "corrupt: truncated while reading", 0);
    }
    if (XXH3_64bits(e->data, body) != sum) {
        free(e->data);
        e->data = NULL;
        return entry_miss(e, dir, name, "corrupt: checksum mismatch", 0);
    }
    return KVF_OK;
}

static int read_entry(int dirfd, const char *dir, const char *name, entry *e) {
    memset(e, 0, sizeof *e);
    /* O_NONBLOCK: a FIFO planted as an entry must not block the open. */
    int fd = openat(dirfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
        return entry_miss(e, dir, name, errno == ELOOP ? "open (symlink refused)" : "open", errno);
    int rc = read_entry_fd(fd, dir, name, e);
    close(fd);
    return rc;
}

static void entry_name(const kvf_cache_key *key, const char *suffix, char *buf, size_t len) {
    snprintf(buf, len, "%.32s%s", key->hex, suffix);
}

int kvf_cache_get(const char *arch, const kvf_cache_key *key, void **payload, size_t *size) {
    char dir[PATH_MAX], name[64];
    int dirfd, rc;
    entry e;
    if (!payload || !size) return kvf_set_error(KVF_EINVAL, "kvf_cache_get: null output");
    *payload = NULL;
    *size = 0;
    if ((rc = check_args(arch, key, "kvf_cache_get"))) return rc;
    rc = open_arch_dir(arch, false, &dirfd, dir, sizeof dir);
    if (rc == DIR_OFF) return kvf_set_error(CACHE_MISS, "disk cache off (KVFORGE_CACHE=0)");
    if (rc == DIR_ABSENT)
        return kvf_set_error(CACHE_MISS, "disk cache miss: no directory for %s", arch);
    if (rc) return CACHE_MISS; /* unusable: warned, message set */
    entry_name(key, ".bin", name, sizeof name);
    rc = read_entry(dirfd, dir, name, &e);
    close(dirfd);
    if (rc) return rc;
    memmove(e.data, e.data + e.meta_len, e.payload_len);
    void *shrunk = realloc(e.data, e.payload_len);
    *payload = shrunk ? shrunk : e.data;
    *size = e.payload_len;
    return KVF_OK;
}

/* Header, metadata and payload written atomically over the entry (owner-only,
 * as the folder), then the folder fsync'ed: KVF_OK or KVF_EIO (set). */
static int store_entry(int dirfd, const char *dir, const char *name, const char *meta,
                       size_t meta_len, const void *payload, size_t size) {
    char final[PATH_MAX];
    if (join_path(final, sizeof final, dir, name)) return KVF_EIO;
    uint8_t h[ENTRY_HEADER_BYTES];
    XXH3_state_t st;
    XXH3_INITSTATE(&st);
    XXH3_64bits_reset(&st);
    XXH3_64bits_update(&st, meta, meta_len);
    XXH3_64bits_update(&st, payload, size);
    memcpy(h, ENTRY_MAGIC, 8);
    kvf_put_u32(h + 8, ENTRY_VERSION);
    kvf_put_u32(h + 12, (uint32_t)meta_len);
    kvf_put_u64(h + 16, size);
    kvf_put_u64(h + 24, XXH3_64bits_digest(&st));
    const kvf_bytes parts[3] = {{h, sizeof h}, {meta, meta_len}, {payload, size}};
    int rc = kvf_write_atomic(final, parts, 3, 0600);
    if (rc) return kvf_wrap_error(rc, "disk cache");
    (void)fsync(dirfd); /* make the rename durable; best effort */
    return KVF_OK;
}

int kvf_cache_put(const char *arch, const kvf_cache_key *key, const char *meta_json,
                  const void *payload, size_t size) {
    char dir[PATH_MAX], name[64], key_buf[128];
    int dirfd, rc;
    if ((rc = check_args(arch, key, "kvf_cache_put"))) return rc;
    if (!payload || size == 0) return kvf_set_error(KVF_EINVAL, "kvf_cache_put: empty payload");
    if (!meta_json) meta_json = "{}";
    size_t meta_len = strlen(meta_json);
    if (meta_len > UINT32_MAX) return kvf_set_error(KVF_EINVAL, "kvf_cache_put: metadata too long");
    rc = open_arch_dir(arch, true, &dirfd, dir, sizeof dir);
    if (rc) return KVF_OK; /* off, or unusable (warned once, message set) */
    entry_name(key, ".bin", name, sizeof name);
    rc = store_entry(dirfd, dir, name, meta_json, meta_len, payload, size);
    close(dirfd);
    if (rc) {
        warn_key(key_buf, sizeof key_buf, "cache-write", dir);
        kvf_warn_once(key_buf, "disk cache: could not store a kernel: %s", kvf_last_error());
    }
    return KVF_OK;
}

int kvf_cache_lock(const char *arch, const kvf_cache_key *key) {
    char dir[PATH_MAX], name[64];
    int dirfd;
    if (check_args(arch, key, "kvf_cache_lock")) return -1;
    int rc = open_arch_dir(arch, true, &dirfd, dir, sizeof dir);
    if (rc == DIR_OFF) {
        kvf_set_error(KVF_EIO, "disk cache off (KVFORGE_CACHE=0): no lock");
        return -1;
    }
    if (rc) return -1;
    entry_name(key, ".lock", name, sizeof name);
    int fd = openat(dirfd, name, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    int err = errno;
    close(dirfd);
    if (fd < 0) {
        kvf_set_error(KVF_EIO, "disk cache: %s/%s: open: %s", dir, name, strerror(err));
        return -1;
    }
    while (flock(fd, LOCK_EX) != 0) {
        if (errno == EINTR) continue;
        kvf_set_error(KVF_EIO, "disk cache: %s/%s: flock: %s", dir, name, strerror(errno));
        close(fd);
        return -1;
    }
    return fd;
}

void kvf_cache_unlock(int fd) {
    if (fd < 0) return;
    flock(fd, LOCK_UN);
    close(fd);
}

/* ============================================================== dir, list, clear */

/* The root after the environment; "" (and KVF_OK) when KVFORGE_CACHE=0. Creates nothing. */
int kvf_cache_dir(char *buf, size_t buflen) {
    char root[PATH_MAX];
    if (!buf || buflen == 0) return kvf_set_error(KVF_EINVAL, "kvf_cache_dir: no buffer");
    buf[0] = 0;
    int rc = root_path(root, sizeof root);
    if (rc == DIR_OFF) return KVF_OK;
    if (rc) return rc;
    if (strlen(root) >= buflen)
        return kvf_set_error(KVF_ERANGE, "kvf_cache_dir: %zu bytes needed", strlen(root) + 1);
    memcpy(buf, root, strlen(root) + 1);
    return KVF_OK;
}

static bool is_hex_prefix(const char *name) {
    for (int i = 0; i < HEX_LEN; i++)
        if (!((name[i] >= '0' && name[i] <= '9') || (name[i] >= 'a' && name[i] <= 'f')))
            return false;
    return true;
}

static int is_entry_file(const struct dirent *d) {
    return strlen(d->d_name) == HEX_LEN + 4 && is_hex_prefix(d->d_name) &&
           !strcmp(d->d_name + HEX_LEN, ".bin");
}

/* HEX.bin, HEX.lock and HEX.bin.tmp.XXXXXX: what kvf_cache_clear removes. */
static int is_cache_file(const struct dirent *d) {
    const char *n = d->d_name;
    if (strlen(n) < HEX_LEN + 4 || !is_hex_prefix(n)) return 0;
    return !strcmp(n + HEX_LEN, ".bin") || !strcmp(n + HEX_LEN, ".lock") ||
           !strncmp(n + HEX_LEN, TEMP_INFIX, strlen(TEMP_INFIX));
}

static int is_arch_dir(const struct dirent *d) { return valid_arch(d->d_name); }

typedef int (*arch_visit_fn)(int archfd, const char *dir, const char *arch, void *ctx);

/* Call fn for each arch subdirectory (sorted); off or absent = nothing to do. */
static int for_each_arch(arch_visit_fn fn, void *ctx) {
    char root[PATH_MAX], dir[PATH_MAX];
    struct dirent **names = NULL;
    int rootfd, status = KVF_OK;
    int rc = root_path(root, sizeof root);
    if (rc == DIR_OFF) return KVF_OK;
    if (rc) return rc;
    rc = open_root(root, false, &rootfd);
    if (rc == DIR_ABSENT) return KVF_OK;
    if (rc) return rc;
    int n = scandirat(rootfd, ".", &names, is_arch_dir, alphasort);
    if (n < 0) {
        status = kvf_set_error(KVF_EIO, "disk cache: %s: scandir: %s", root, strerror(errno));
        n = 0;
    }
    for (int i = 0; i < n; i++) {
        const char *arch = names[i]->d_name;
        struct stat st;
        int archfd;
        /* anything but a real directory (a file, a symlink) is not ours: skip it */
        if (fstatat(rootfd, arch, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode) &&
            join_path(dir, sizeof dir, root, arch) == KVF_OK) {
            rc = open_subdir(rootfd, dir, arch, false, &archfd);
            if (rc == KVF_OK) {
                rc = fn(archfd, dir, arch, ctx);
                close(archfd);
            }
            if (rc < 0) status = rc;
        }
        free(names[i]);
    }
    free(names);
    close(rootfd);
    return status;
}

static const char *json_field(json_t *meta, const char *name) {
    const char *v = json_string_value(json_object_get(meta, name));
    return v && *v ? v : "?";
}

static void list_entry(FILE *out, int archfd, const char *dir, const char *arch,
                       const char *name) {
    entry e;
    char when[32] = "?";
    if (read_entry(archfd, dir, name, &e) != KVF_OK) {
        const char *why = e.why[0] ? e.why : kvf_last_error(), *state = "corrupt";
        if (!strncmp(why, "corrupt: ", 9)) why += 9;
        else if (!strncmp(why, "refused: ", 9)) why += 9, state = "refused";
        fprintf(out, "%s %.32s %s (%s)\n", arch, name, state, why);
        return;
    }
    struct tm tm;
    if (localtime_r(&e.mtime, &tm)) strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", &tm);
    json_t *meta = json_loadb((const char *)e.data, e.meta_len, 0, NULL);
    /* A program of the JIT's (runtime/gpu/jit.c): which of how many; none for a whole source. */
    char program[48] = "";
    json_t *p = json_object_get(meta, "program"), *n = json_object_get(meta, "programs");
    if (json_is_integer(p) && json_is_integer(n))
        snprintf(program, sizeof program, " program=%lld/%lld", (long long)json_integer_value(p) + 1,
                 (long long)json_integer_value(n));
    fprintf(out, "%s %.32s %" PRIu64 " %s scheme=%s%s nvrtc=%s\n", arch, name, e.payload_len,
            when, json_field(meta, "scheme"), program, json_field(meta, "nvrtc"));
    json_decref(meta);
    free(e.data);
}

static int list_arch(int archfd, const char *dir, const char *arch, void *ctx) {
    struct dirent **names = NULL;
    int n = scandirat(archfd, ".", &names, is_entry_file, alphasort);
    if (n < 0) return kvf_set_error(KVF_EIO, "disk cache: %s: scandir: %s", dir, strerror(errno));
    for (int i = 0; i < n; i++) {
        list_entry(ctx, archfd, dir, arch, names[i]->d_name);
        free(names[i]);
    }
    free(names);
    return KVF_OK;
}

int kvf_cache_list(FILE *out) {
    if (!out) return kvf_set_error(KVF_EINVAL, "kvf_cache_list: null stream");
    int rc = for_each_arch(list_arch, out);
    if (fflush(out) != 0 && rc == KVF_OK)
        rc = kvf_set_error(KVF_EIO, "kvf_cache_list: fflush: %s", strerror(errno));
    return rc;
}

static int clear_arch(int archfd, const char *dir, const char *arch, void *ctx) {
    struct dirent **names = NULL;
    int status = KVF_OK;
    (void)arch;
    (void)ctx;
    int n = scandirat(archfd, ".", &names, is_cache_file, alphasort);
    if (n < 0) return kvf_set_error(KVF_EIO, "disk cache: %s: scandir: %s", dir, strerror(errno));
    for (int i = 0; i < n; i++) {
        if (unlinkat(archfd, names[i]->d_name, 0) != 0 && errno != ENOENT)
            status = kvf_set_error(KVF_EIO, "disk cache: %s/%s: unlink: %s", dir,
                                   names[i]->d_name, strerror(errno));
        free(names[i]);
    }
    free(names);
    return status;
}

int kvf_cache_clear(void) { return for_each_arch(clear_arch, NULL); }
