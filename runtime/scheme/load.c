/*
 * Loading a scheme: where its text comes from (a file, a string, a shipped
 * scheme), the chain of `base` schemes applied under it (each file run and read
 * in its own sandbox, its patch written over its bases'), errors located at
 * the file and line that set a field (the blame callback kvf_plan_build
 * reports through), the checks of the merged scheme, kvf_scheme_finalize for
 * schemes filled in by code, and the public API.
 */
#include "scheme_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define SB_MAX_FILE (1u << 20)        /* largest scheme file */
#define MAX_BASES 8                   /* `base` links in one chain */
#define MAX_CHAIN (MAX_BASES + 1)
#define PATH_LEN 512

/* ================================================================ sources */

/* Where a scheme's text comes from. */
typedef struct source {
    char *text;
    size_t len;
    bool owned;
    bool has_dir;            /* a file: `base` looks beside it first */
    char dir[PATH_LEN];      /* "" (the current directory) or ending in '/' */
    char chunkname[PATH_LEN + 1];
    char display[PATH_LEN];  /* in messages and kvf_scheme.source */
    char ident[PATH_LEN];    /* for cycle detection */
    char default_name[PATH_LEN];
} source;

typedef struct origin {
    int file; /* index in loader.files; -1 = default */
    int line;
} origin;

/* A chain of schemes being merged into s, top file first in files[]. */
typedef struct loader {
    struct kvf_scheme *s;
    int nfiles;
    char files[MAX_CHAIN][PATH_LEN];
    char ident[MAX_CHAIN][PATH_LEN];
    int return_line[MAX_CHAIN];
    origin org[NF];
    double deadline; /* of the whole chain (kvf_sch_now() clock) */
} loader;

/* What a path that is not a regular file names, for its refusal. */
static const char *file_kind(mode_t m) {
    return S_ISDIR(m)    ? "a directory"
           : S_ISFIFO(m) ? "a FIFO"
           : S_ISCHR(m)  ? "a character device"
           : S_ISBLK(m)  ? "a block device"
           : S_ISSOCK(m) ? "a socket"
                         : "not a regular file";
}

static int not_regular(const char *path, mode_t m) {
    return kvf_set_error(KVF_EIO, "cannot read %s: it is %s; a scheme is read from a regular file",
                         path, file_kind(m));
}

/* A scheme is read from a regular file only: opening a FIFO blocks until a
 * writer comes, reading a device may never end (or opening it may act on
 * the device), a directory has no text. stat refuses those without opening
 * them; the open does not block, and fstat checks what was opened (the path
 * may have changed in between). */
static int read_file(const char *path, source *src) {
    struct stat st;
    if (stat(path, &st) != 0)
        return kvf_set_error(KVF_EIO, "cannot open %s: %s", path, strerror(errno));
    if (!S_ISREG(st.st_mode)) return not_regular(path, st.st_mode);
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    if (fd < 0) return kvf_set_error(KVF_EIO, "cannot open %s: %s", path, strerror(errno));
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        int rc = S_ISREG(st.st_mode) ? kvf_set_error(KVF_EIO, "cannot read %s: %s", path,
                                                     strerror(errno))
                                     : not_regular(path, st.st_mode);
        close(fd);
        return rc;
    }
    src->text = malloc(SB_MAX_FILE + 1);
    src->owned = true;
    src->len = 0;
    bool err = false;
    while (src->text && src->len < SB_MAX_FILE + 1) {
        ssize_t k = read(fd, src->text + src->len, SB_MAX_FILE + 1 - src->len);
        if (k < 0 && errno == EINTR) continue;
        err = k < 0;
        if (k <= 0) break;
        src->len += (size_t)k;
    }
    close(fd);
    if (!src->text) return kvf_set_error(KVF_ENOMEM, "%s: out of memory", path);
    if (err) return kvf_set_error(KVF_EIO, "cannot read %s", path);
    if (src->len > SB_MAX_FILE)
        return kvf_set_error(KVF_ESCHEME, "%s:1: file too large (a scheme has at most %u KiB)",
                             path, SB_MAX_FILE >> 10);
    src->text[src->len] = 0;
    return KVF_OK;
}

static void name_from_path(const char *path, char *out, size_t n) {
    const char *b = strrchr(path, '/');
    b = b ? b + 1 : path;
    size_t len = strlen(b);
    if (len > 4 && !strcmp(b + len - 4, ".lua")) len -= 4;
    if (len >= n) len = n - 1;
    memcpy(out, b, len);
    out[len] = 0;
}

static int source_from_file(const char *path, source *src) {
    if (strlen(path) >= PATH_LEN)
        return kvf_set_error(KVF_EINVAL, "scheme path too long (%zu bytes)", strlen(path));
    int rc = read_file(path, src);
    if (rc) return rc;
    const char *slash = strrchr(path, '/');
    size_t dl = slash ? (size_t)(slash - path) + 1 : 0;
    src->has_dir = true;
    memcpy(src->dir, path, dl);
    src->dir[dl] = 0;
    snprintf(src->chunkname, sizeof src->chunkname, "@%s", path);
    snprintf(src->display, sizeof src->display, "%s", path);
    if (!realpath(path, src->ident)) snprintf(src->ident, sizeof src->ident, "%s", path);
    name_from_path(path, src->default_name, sizeof src->default_name);
    return KVF_OK;
}

static bool source_builtin(const char *name, source *src) {
    char file[NAME_MAX_LEN + 8];
    snprintf(file, sizeof file, "%s.lua", name);
    const kvf_embedded_file *f = kvf_find_embedded(kvf_embedded_schemes, file);
    if (!f) return false;
    src->text = (char *)f->data;
    src->len = f->size;
    snprintf(src->chunkname, sizeof src->chunkname, "@<builtin>/%s", file);
    snprintf(src->display, sizeof src->display, "<builtin>/%s", file);
    snprintf(src->ident, sizeof src->ident, "<builtin>/%s", file);
    snprintf(src->default_name, sizeof src->default_name, "%s", name);
    return true;
}

static void source_release(source *src) {
    if (src && src->owned) free(src->text);
    free(src);
}

/* ================================================================= chains */

static int load_chain(loader *ld, const source *src, int depth);

/* Whether DIR/NAME.lua is there for a base: a regular file that can be
 * opened, or something else by that name (which read_file refuses, naming
 * it). Nothing is opened but a regular file. */
static bool beside(const char *path) {
    struct stat st;
    if (stat(path, &st) != 0) return false;
    if (!S_ISREG(st.st_mode)) return true;
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    if (fd >= 0) close(fd);
    return fd >= 0;
}

/* DIR/NAME.lua beside the child, else the shipped NAME.lua. */
static int resolve_base(const source *child, const char *name, int line, source *bs) {
    char path[PATH_LEN + NAME_MAX_LEN + 8] = "";
    if (child->has_dir) {
        snprintf(path, sizeof path, "%s%s.lua", child->dir, name);
        if (beside(path)) return source_from_file(path, bs);
    }
    if (source_builtin(name, bs)) return KVF_OK;
    return kvf_set_error(KVF_ESCHEME,
                         "%s:%d: base: no scheme named \"%s\" (looked for %s%sthe shipped "
                         "schemes) (got \"%s\")",
                         child->display, line, name, path, *path ? " and " : "", name);
}

static int cycle_error(const loader *ld, const source *child, const kvf_sch_value *b,
                       const source *bs) {
    char chain[2048];
    size_t k = 0;
    for (int i = 0; i < ld->nfiles && k < sizeof chain; i++)
        k += (size_t)snprintf(chain + k, sizeof chain - k, "%s -> ", ld->files[i]);
    if (k < sizeof chain) snprintf(chain + k, sizeof chain - k, "%s", bs->display);
    return kvf_set_error(KVF_ESCHEME, "%s:%d: base: cycle: %s (got \"%s\")", child->display,
                         b->line, chain, b->s);
}

static int load_base(loader *ld, const source *child, const kvf_sch_value *b, int depth) {
    if (depth >= MAX_BASES)
        return kvf_set_error(KVF_ESCHEME,
                             "%s:%d: base: chain of bases deeper than %d (got \"%s\")",
                             child->display, b->line, MAX_BASES, b->s);
    source *bs = calloc(1, sizeof *bs);
    if (!bs) return kvf_set_error(KVF_ENOMEM, "out of memory");
    int rc = resolve_base(child, b->s, b->line, bs);
    for (int i = 0; !rc && i < ld->nfiles; i++)
        if (!strcmp(ld->ident[i], bs->ident)) rc = cycle_error(ld, child, b, bs);
    if (!rc) rc = load_chain(ld, bs, depth + 1);
    source_release(bs);
    return rc;
}

/* Write the fields a file sets over what its bases gave. */
static void apply(loader *ld, const kvf_sch_unit *u, int file, int depth) {
    for (int fid = 0; fid < NF; fid++) {
        const kvf_sch_value *v = &u->v[fid];
        const kvf_sch_field *d = kvf_sch_fid_desc(fid, NULL);
        void *p = kvf_sch_field_ptr(ld->s, fid);
        if (!v->set || (d->kind == F_NAME && depth > 0)) continue;
        switch (d->kind) {
        case F_INT:
        case F_ENUM: *(int *)p = (int)v->i; break;
        case F_I64: *(int64_t *)p = v->i; break;
        case F_NUM:
        case F_FRAC: *(double *)p = v->d; break;
        case F_NAME: snprintf(ld->s->name, sizeof ld->s->name, "%s", v->s); break;
        case F_PATH: snprintf((char *)p, PATH_FIELD_LEN, "%s", v->s); break;
        case F_SECTIONS:
            *(int *)p = (int)v->i;
            memcpy(kvf_sch_sections_of(p), v->arr, sizeof v->arr);
            break;
        default: continue;
        }
        ld->org[fid].file = file;
        ld->org[fid].line = v->line;
    }
}

/* Where the text Lua reads starts, as luaL_loadfile skips it: a UTF-8
 * byte-order mark, then a first line starting with '#' (a Unix "#!" line) up
 * to its '\n', which stays so that the lines after it keep their numbers
 * (unless a binary chunk follows: then it starts there, and mode "t"
 * refuses it). */
static size_t lua_start(const char *text, size_t len) {
    size_t k = len >= 3 && !memcmp(text, "\xEF\xBB\xBF", 3) ? 3 : 0;
    if (k < len && text[k] == '#') {
        while (k < len && text[k] != '\n') k++;
        if (k + 1 < len && text[k + 1] == LUA_SIGNATURE[0]) k++;
    }
    return k;
}

static int load_chain(loader *ld, const source *src, int depth) {
    int file = ld->nfiles++;
    kvf_sch_unit *u = calloc(1, sizeof *u);
    if (!u) return kvf_set_error(KVF_ENOMEM, "out of memory");
    snprintf(ld->files[file], PATH_LEN, "%s", src->display);
    snprintf(ld->ident[file], PATH_LEN, "%s", src->ident);
    size_t skip = lua_start(src->text, src->len);
    u->text = src->text + skip;
    u->len = src->len - skip;
    u->chunkname = src->chunkname;
    u->display = src->display;
    kvf_sch_build_lines(u->text, u->len, &u->li);
    ld->return_line[file] = u->li.return_line > 0 ? u->li.return_line : 1;
    int rc = kvf_sch_run(u, ld->deadline);
    if (!rc && u->v[TOP_BASE].set) rc = load_base(ld, src, &u->v[TOP_BASE], depth);
    else if (!rc) kvf_scheme_defaults(ld->s);
    if (!rc) apply(ld, u, file, depth);
    free(u);
    return rc;
}

/* ================================================================ checks */

/* "file:line" of the setting that gave a field its value. */
static void locate(const loader *ld, const struct kvf_scheme *s, int fid, char *buf, size_t n) {
    if (!ld) {
        snprintf(buf, n, "%s", s->source[0] ? s->source : s->name[0] ? s->name : "scheme");
    } else if (ld->org[fid].file < 0) {
        snprintf(buf, n, "%s:%d", ld->files[0], ld->return_line[0]);
    } else {
        snprintf(buf, n, "%s:%d", ld->files[ld->org[fid].file], ld->org[fid].line);
    }
}

static int bad(const loader *ld, const struct kvf_scheme *s, int fid, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static int bad(const loader *ld, const struct kvf_scheme *s, int fid, const char *fmt, ...) {
    char where[PATH_LEN + 16], path[LI_PATH], what[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    locate(ld, s, fid, where, sizeof where);
    kvf_sch_fid_path(fid, path, sizeof path);
    return kvf_set_error(KVF_ESCHEME, "%s: %s: %s", where, path, what);
}

/* Two fields in conflict: the error names the one set nearest the top file
 * (the file that brought the conflict in, e.g. over a base that set the
 * other; a default counts as farthest) with its message, a if a tie. */
static int conflict(const loader *ld, const struct kvf_scheme *s, int a, const char *msg_a, int b,
                    const char *msg_b) {
    const bool blame_b = ld && ld->org[b].file >= 0 && (ld->org[a].file < 0 || ld->org[b].file < ld->org[a].file);
    return blame_b ? bad(ld, s, b, "%s", msg_b) : bad(ld, s, a, "%s", msg_a);
}

/* Whether section sec is there: always, but for a pipeline section, which is
 * there when a file sets one of its fields (in code: kvf_sch_section_on). */
static bool section_present(const struct kvf_scheme *s, const loader *ld, int sec) {
    const kvf_sch_section *S = &kvf_sch_sections[sec];
    if (!S->optional) return true;
    if (!ld) return kvf_sch_section_on(s, sec);
    for (int i = 0; i < S->n; i++)
        if (ld->org[FID(sec, i)].file >= 0) return true;
    return false;
}

/* Every field of every section there in its range (for schemes filled in by
 * code too). */
static int check_ranges(const struct kvf_scheme *s, const loader *ld) {
    char what[160];
    for (int fid = 0; fid < NF; fid++) {
        int sec;
        const kvf_sch_field *d = kvf_sch_fid_desc(fid, &sec);
        if (!section_present(s, ld, sec)) continue;
        const void *p = kvf_sch_field_ptr(s, fid);
        int64_t i = d->kind == F_I64 ? *(const int64_t *)p : 0;
        double x = d->kind == F_NUM || d->kind == F_FRAC ? *(const double *)p : 0;
        bool ok = true;
        if (d->kind == F_INT || d->kind == F_ENUM) i = *(const int *)p;
        if (d->kind == F_INT || d->kind == F_I64) ok = kvf_sch_int_ok(d, i);
        if (d->kind == F_ENUM) ok = kvf_sch_enum_ok(d, i);
        if (d->kind == F_NUM) ok = kvf_sch_num_ok(x);
        if (d->kind == F_FRAC) ok = kvf_sch_frac_ok(x);
        if (d->kind == F_PATH) ok = !*(const char *)p || kvf_sch_path_ok((const char *)p, strlen((const char *)p));
        if (d->kind == F_NAME) ok = kvf_sch_valid_name(s->name, strlen(s->name));
        if (d->kind == F_SECTIONS) {
            const int *n = p, *a = kvf_sch_sections_of((void *)p);
            ok = *n >= 1 && *n <= KVF_MAX_ROPE_SECTIONS;
            for (int k = 0; ok && k < *n; k++) ok = a[k] >= d->lo && a[k] <= d->hi;
            if (!ok) {
                kvf_sch_describe(d, what, sizeof what);
                return bad(ld, s, fid, "%s (got %d values)", what, *n);
            }
        }
        if (ok) continue;
        kvf_sch_describe(d, what, sizeof what);
        if (d->kind == F_NUM || d->kind == F_FRAC) return bad(ld, s, fid, "%s (got %g)", what, x);
        if (d->kind == F_PATH) return bad(ld, s, fid, "%s (got \"%.60s\")", what, (const char *)p);
        if (d->kind == F_NAME) return bad(ld, s, fid, "%s (got \"%.60s\")", what, s->name);
        return bad(ld, s, fid, "%s (got %lld)", what, (long long)i);
    }
    return KVF_OK;
}


/* The field id of a path such as "key.psac_rank" (the plan's rules name
 * fields by path); -1 if none. */
static int fid_of_path(const char *path) {
    char p[LI_PATH];
    for (int fid = 0; fid < NF; fid++) {
        kvf_sch_fid_path(fid, p, sizeof p);
        if (!strcmp(p, path)) return fid;
    }
    return -1;
}

typedef struct blame_arg {
    const loader *ld;
    const struct kvf_scheme *s;
} blame_arg;

/* kvf_plan_build's reports, located at the file and line that set the field
 * (of two tied fields, the one set nearest the top file: conflict()). */
static int blame_report(void *arg, const char *field, const char *msg, const char *other, const char *other_msg) {
    const blame_arg *b = arg;
    const int a = fid_of_path(field), o = other ? fid_of_path(other) : -1;
    if (a < 0) return kvf_set_error(KVF_ESCHEME, "%s: %s", field, msg);
    if (o < 0) return bad(b->ld, b->s, a, "%s", msg);
    return conflict(b->ld, b->s, a, msg, o, other_msg);
}

/* Ranges field by field, then every rule between fields (the plan's). */
static int check_scheme(struct kvf_scheme *s, const loader *ld) {
    int rc = check_ranges(s, ld);
    if (rc) return rc;
    blame_arg arg = {ld, s};
    const kvf_plan_blame blame = {blame_report, &arg};
    return kvf_plan_build(s, &blame, &s->plan);
}

/* ================================================================ public */

int kvf_scheme_finalize(struct kvf_scheme *s) {
    if (!s) return kvf_set_error(KVF_EINVAL, "kvf_scheme_finalize: scheme is NULL");
    if (!s->name[0]) snprintf(s->name, sizeof s->name, "scheme");
    kvf_sch_fill_derived(s);
    int rc = check_scheme(s, NULL);
    return rc ? rc : kvf_sch_canonical(s);
}

/* The top file names the scheme; bases never do. */
static int finish_top(loader *ld, const source *src) {
    struct kvf_scheme *s = ld->s;
    if (ld->org[FID(S_TOP, TOP_NAME)].file < 0) {
        size_t len = strlen(src->default_name);
        if (!kvf_sch_valid_name(src->default_name, len))
            return kvf_set_error(KVF_ESCHEME,
                                 "%s:%d: name: not set, and the file name \"%.60s\" is not a "
                                 "valid name (1..%d characters from [A-Za-z0-9_]): set name",
                                 src->display, ld->return_line[0], src->default_name,
                                 NAME_MAX_LEN);
        memcpy(s->name, src->default_name, len + 1);
    }
    kvf_sch_fill_derived(s);
    int rc = check_scheme(s, ld);
    if (rc) return rc;
    snprintf(s->source, sizeof s->source, "%s", src->display);
    return kvf_sch_canonical(s);
}

static int load_top(const source *src, kvf_scheme **out) {
    loader *ld = calloc(1, sizeof *ld);
    struct kvf_scheme *s = calloc(1, sizeof *s);
    int rc = (ld && s) ? KVF_OK : kvf_set_error(KVF_ENOMEM, "out of memory");
    for (int i = 0; !rc && i < NF; i++) ld->org[i].file = -1;
    if (!rc) {
        ld->s = s;
        ld->deadline = kvf_sch_now() + SB_TIME_LIMIT;
        rc = load_chain(ld, src, 0);
    }
    if (!rc) rc = finish_top(ld, src);
    if (rc) kvf_scheme_free(s);
    else *out = s;
    free(ld);
    if (!rc) kvf_clear_error();
    return rc;
}

int kvf_scheme_load(const char *path, kvf_scheme **out) {
    if (out) *out = NULL;
    if (!path || !out) return kvf_set_error(KVF_EINVAL, "kvf_scheme_load: NULL argument");
    source *src = calloc(1, sizeof *src);
    if (!src) return kvf_set_error(KVF_ENOMEM, "out of memory");
    int rc = source_from_file(path, src);
    if (!rc) rc = load_top(src, out);
    source_release(src);
    return rc;
}

int kvf_scheme_load_string(const char *text, size_t len, const char *chunkname,
                           kvf_scheme **out) {
    if (out) *out = NULL;
    if (!text || !out) return kvf_set_error(KVF_EINVAL, "kvf_scheme_load_string: NULL argument");
    if (len > SB_MAX_FILE)
        return kvf_set_error(KVF_ESCHEME, "scheme text too large (at most %u KiB)",
                             SB_MAX_FILE >> 10);
    source *src = calloc(1, sizeof *src);
    if (!src) return kvf_set_error(KVF_ENOMEM, "out of memory");
    if (!chunkname || !*chunkname) chunkname = "=<string>";
    bool marked = *chunkname == '@' || *chunkname == '=';
    snprintf(src->chunkname, sizeof src->chunkname, "%s%s", marked ? "" : "=", chunkname);
    snprintf(src->display, sizeof src->display, "%s", src->chunkname + 1);
    snprintf(src->ident, sizeof src->ident, "<string>"); /* never a base */
    snprintf(src->default_name, sizeof src->default_name, "scheme");
    src->text = (char *)text;
    src->len = len;
    int rc = load_top(src, out);
    source_release(src);
    return rc;
}

int kvf_scheme_load_builtin(const char *name, kvf_scheme **out) {
    if (out) *out = NULL;
    if (!name || !out) return kvf_set_error(KVF_EINVAL, "kvf_scheme_load_builtin: NULL argument");
    source *src = calloc(1, sizeof *src);
    if (!src) return kvf_set_error(KVF_ENOMEM, "out of memory");
    int rc = KVF_OK;
    if (!kvf_sch_valid_name(name, strlen(name)) || !source_builtin(name, src)) {
        char list[512] = "";
        size_t k = 0;
        for (const char *const *b = kvf_builtin_schemes(); *b && k < sizeof list; b++)
            k += (size_t)snprintf(list + k, sizeof list - k, "%s%s", k ? ", " : "", *b);
        rc = kvf_set_error(KVF_EINVAL, "no shipped scheme named \"%.64s\" (shipped: %s)", name,
                           list);
    }
    if (!rc) rc = load_top(src, out);
    source_release(src);
    return rc;
}

void kvf_scheme_free(kvf_scheme *s) { free(s); }

const char *kvf_scheme_name(const kvf_scheme *s) { return s ? s->name : NULL; }
const char *kvf_scheme_canonical(const kvf_scheme *s) { return s ? s->canonical : NULL; }
uint64_t kvf_scheme_hash(const kvf_scheme *s) { return s ? s->hash : 0; }
const char *kvf_scheme_id(const kvf_scheme *s) { return s ? s->id : NULL; }
int kvf_scheme_head_dim(const kvf_scheme *s) { return s ? s->head_dim : 0; }

#define MAX_BUILTIN 64
static char builtin_store[MAX_BUILTIN][NAME_MAX_LEN + 1];
static const char *builtin_names[MAX_BUILTIN + 1];
static pthread_once_t builtin_once = PTHREAD_ONCE_INIT;

static void builtin_init(void) {
    int n = 0;
    for (const kvf_embedded_file *f = kvf_embedded_schemes; f->name && n < MAX_BUILTIN; f++) {
        size_t len = strlen(f->name);
        if (len <= 4 || strcmp(f->name + len - 4, ".lua") || !kvf_sch_valid_name(f->name, len - 4))
            continue;
        memcpy(builtin_store[n], f->name, len - 4);
        builtin_store[n][len - 4] = 0;
        builtin_names[n] = builtin_store[n];
        n++;
    }
    builtin_names[n] = NULL;
}

const char *const *kvf_builtin_schemes(void) {
    pthread_once(&builtin_once, builtin_init);
    return builtin_names;
}
