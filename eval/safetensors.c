/* Safetensors reader and writer (see safetensors.h). */
#include "safetensors.h"

#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors data is little-endian; this reader assumes a little-endian host"
#endif

#define META_KEY "__metadata__"

struct kvf_st_file {
    char *label;
    const uint8_t *bytes; /* kvf_st_parse's bytes, else NULL: read from fd */
    size_t len;           /* of the bytes or the file */
    int fd;               /* kvf_st_open's file, else -1 */
    struct timespec mtime; /* the file's when opened (kvf_st_check_unchanged) */
    json_t *root;       /* the header; tensor names point into its keys */
    json_t *meta;       /* borrowed from root, or NULL */
    kvf_st_tensor *t;   /* sorted by name */
    size_t n;
};

static const struct { const char *name; size_t size; } dtypes[KVF_ST_DTYPE_COUNT] = {
    [KVF_ST_BOOL] = {"BOOL", 1},       [KVF_ST_U8] = {"U8", 1},   [KVF_ST_I8] = {"I8", 1},
    [KVF_ST_F8_E4M3] = {"F8_E4M3", 1}, [KVF_ST_F8_E5M2] = {"F8_E5M2", 1},
    [KVF_ST_I16] = {"I16", 2},         [KVF_ST_U16] = {"U16", 2}, [KVF_ST_F16] = {"F16", 2},
    [KVF_ST_BF16] = {"BF16", 2},       [KVF_ST_I32] = {"I32", 4}, [KVF_ST_U32] = {"U32", 4},
    [KVF_ST_F32] = {"F32", 4},         [KVF_ST_I64] = {"I64", 8}, [KVF_ST_U64] = {"U64", 8},
    [KVF_ST_F64] = {"F64", 8},
};

const char *kvf_st_dtype_name(kvf_st_dtype t) {
    return (unsigned)t < KVF_ST_DTYPE_COUNT ? dtypes[t].name : "?";
}

size_t kvf_st_dtype_size(kvf_st_dtype t) { return (unsigned)t < KVF_ST_DTYPE_COUNT ? dtypes[t].size : 0; }

static int dtype_from_name(const char *s, kvf_st_dtype *out) {
    for (int i = 0; i < KVF_ST_DTYPE_COUNT; i++)
        if (!strcmp(s, dtypes[i].name)) { *out = (kvf_st_dtype)i; return 1; }
    return 0;
}

const char *kvf_st_printable(const char *s, char *buf, size_t cap) {
    size_t o = 0;
    for (size_t i = 0; s[i] && o + 8 < cap; i++) {
        unsigned char c = (unsigned char)s[i];
        if (o >= 80) { memcpy(buf + o, "...", 3); o += 3; break; }
        if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\') buf[o++] = (char)c;
        else o += (size_t)snprintf(buf + o, cap - o, "\\x%02x", c);
    }
    buf[o] = 0;
    return buf;
}

/* --------------------------------------------------------------- parsing */

/* A JSON integer in [0, max], else 0. */
static int json_uint(const json_t *j, uint64_t max, uint64_t *out) {
    if (!json_is_integer(j)) return 0;
    json_int_t v = json_integer_value(j);
    if (v < 0 || (uint64_t)v > max) return 0;
    *out = (uint64_t)v;
    return 1;
}

static int parse_shape(const kvf_st_file *f, const char *name, const json_t *shape, kvf_st_tensor *t) {
    char pn[128];
    if (!json_is_array(shape))
        return kvf_set_error(KVF_EFORMAT, "%s: tensor \"%s\": \"shape\" must be an array of integers", f->label,
                             kvf_st_printable(name, pn, sizeof pn));
    size_t nd = json_array_size(shape);
    if (nd > KVF_ST_MAX_DIMS)
        return kvf_set_error(KVF_EFORMAT, "%s: tensor \"%s\": %zu dimensions, at most %d are supported", f->label,
                             kvf_st_printable(name, pn, sizeof pn), nd, KVF_ST_MAX_DIMS);
    t->ndim = (int)nd;
    t->n_elements = 1;
    for (size_t i = 0; i < nd; i++) {
        uint64_t dim;
        if (!json_uint(json_array_get(shape, i), INT64_MAX, &dim))
            return kvf_set_error(KVF_EFORMAT, "%s: tensor \"%s\": shape[%zu] must be a non-negative integer",
                                 f->label, kvf_st_printable(name, pn, sizeof pn), i);
        t->shape[i] = (int64_t)dim;
        if (__builtin_mul_overflow(t->n_elements, dim, &t->n_elements))
            return kvf_set_error(KVF_EFORMAT, "%s: tensor \"%s\": element count overflows", f->label,
                                 kvf_st_printable(name, pn, sizeof pn));
    }
    return KVF_OK;
}

static int parse_offsets(const kvf_st_file *f, const char *name, const json_t *offs, size_t data_len,
                         uint64_t *begin, uint64_t *end) {
    char pn[128];
    if (!json_is_array(offs) || json_array_size(offs) != 2 || !json_uint(json_array_get(offs, 0), INT64_MAX, begin) ||
        !json_uint(json_array_get(offs, 1), INT64_MAX, end))
        return kvf_set_error(KVF_EFORMAT,
                             "%s: tensor \"%s\": \"data_offsets\" must be [begin, end], two non-negative integers",
                             f->label, kvf_st_printable(name, pn, sizeof pn));
    if (*begin > *end)
        return kvf_set_error(KVF_EFORMAT, "%s: tensor \"%s\": data_offsets [%" PRIu64 ", %" PRIu64 "]: begin > end",
                             f->label, kvf_st_printable(name, pn, sizeof pn), *begin, *end);
    if (*end > data_len)
        return kvf_set_error(KVF_EFORMAT,
                             "%s: tensor \"%s\": data_offsets [%" PRIu64 ", %" PRIu64
                             "] run past the end of the data (%zu bytes after the header)",
                             f->label, kvf_st_printable(name, pn, sizeof pn), *begin, *end, data_len);
    return KVF_OK;
}

/* One tensor entry {"dtype", "shape", "data_offsets"}; nothing else allowed. */
static int parse_entry(const kvf_st_file *f, const char *name, json_t *e, uint64_t data, size_t data_len,
                       kvf_st_tensor *t) {
    char pn[128];
    if (!json_is_object(e))
        return kvf_set_error(KVF_EFORMAT, "%s: tensor \"%s\": entry must be an object", f->label,
                             kvf_st_printable(name, pn, sizeof pn));
    const char *k;
    json_t *v;
    json_object_foreach(e, k, v) {
        if (strcmp(k, "dtype") && strcmp(k, "shape") && strcmp(k, "data_offsets")) {
            char pk[128];
            return kvf_set_error(KVF_EFORMAT, "%s: tensor \"%s\": unknown field \"%s\"", f->label,
                                 kvf_st_printable(name, pn, sizeof pn), kvf_st_printable(k, pk, sizeof pk));
        }
    }
    memset(t, 0, sizeof *t);
    t->name = name;
    const json_t *dt = json_object_get(e, "dtype");
    if (!json_is_string(dt))
        return kvf_set_error(KVF_EFORMAT, "%s: tensor \"%s\": \"dtype\" must be a string", f->label,
                             kvf_st_printable(name, pn, sizeof pn));
    if (!dtype_from_name(json_string_value(dt), &t->dtype)) {
        char pd[128];
        return kvf_set_error(KVF_EFORMAT, "%s: tensor \"%s\": unknown dtype \"%s\"", f->label,
                             kvf_st_printable(name, pn, sizeof pn), kvf_st_printable(json_string_value(dt), pd, sizeof pd));
    }
    int rc = parse_shape(f, name, json_object_get(e, "shape"), t);
    uint64_t begin = 0, end = 0, want;
    if (!rc) rc = parse_offsets(f, name, json_object_get(e, "data_offsets"), data_len, &begin, &end);
    if (rc) return rc;
    if (__builtin_mul_overflow(t->n_elements, (uint64_t)dtypes[t->dtype].size, &want) || want != end - begin)
        return kvf_set_error(KVF_EFORMAT,
                             "%s: tensor \"%s\": %" PRIu64 " %s elements need %" PRIu64
                             " bytes, data_offsets [%" PRIu64 ", %" PRIu64 "] hold %" PRIu64,
                             f->label, kvf_st_printable(name, pn, sizeof pn), t->n_elements, dtypes[t->dtype].name,
                             t->n_elements * dtypes[t->dtype].size, begin, end, end - begin);
    t->file = f;
    t->offset = data + begin;
    t->n_bytes = (size_t)(end - begin);
    return KVF_OK;
}

static int parse_metadata(kvf_st_file *f, json_t *m) {
    if (!json_is_object(m))
        return kvf_set_error(KVF_EFORMAT, "%s: \"%s\" must be an object of strings", f->label, META_KEY);
    const char *k;
    json_t *v;
    json_object_foreach(m, k, v) {
        char pk[128];
        if (!json_is_string(v))
            return kvf_set_error(KVF_EFORMAT, "%s: %s[\"%s\"] must be a string", f->label, META_KEY,
                                 kvf_st_printable(k, pk, sizeof pk));
    }
    f->meta = m;
    return KVF_OK;
}

static int cmp_tensor(const void *a, const void *b) {
    return strcmp(((const kvf_st_tensor *)a)->name, ((const kvf_st_tensor *)b)->name);
}

static int cmp_by_offset(const void *a, const void *b) {
    const kvf_st_tensor *x = *(const kvf_st_tensor *const *)a, *y = *(const kvf_st_tensor *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* Two non-empty tensors must not share bytes. */
static int check_overlaps(const kvf_st_file *f) {
    if (f->n < 2) return KVF_OK;
    const kvf_st_tensor **by = malloc(f->n * sizeof *by);
    if (!by) return kvf_set_error(KVF_ENOMEM, "%s: out of memory", f->label);
    size_t m = 0;
    for (size_t i = 0; i < f->n; i++)
        if (f->t[i].n_bytes) by[m++] = &f->t[i];
    qsort(by, m, sizeof *by, cmp_by_offset);
    int rc = KVF_OK;
    for (size_t i = 1; i < m && !rc; i++)
        if (by[i - 1]->offset + by[i - 1]->n_bytes > by[i]->offset) {
            char pa[128], pb[128];
            rc = kvf_set_error(KVF_EFORMAT, "%s: tensors \"%s\" and \"%s\" overlap in the data", f->label,
                               kvf_st_printable(by[i - 1]->name, pa, sizeof pa), kvf_st_printable(by[i]->name, pb, sizeof pb));
        }
    free(by);
    return rc;
}

/* The header's length (the file's first 8 bytes) against the file's length. */
static int check_header_length(const kvf_st_file *f, uint64_t hlen) {
    if (hlen > KVF_ST_MAX_HEADER)
        return kvf_set_error(KVF_EFORMAT, "%s: header length %" PRIu64 " exceeds the %u-byte limit", f->label, hlen,
                             KVF_ST_MAX_HEADER);
    if (hlen > f->len - 8)
        return kvf_set_error(KVF_EFORMAT, "%s: header length %" PRIu64 " runs past the end of the file (%zu bytes)",
                             f->label, hlen, f->len);
    return KVF_OK;
}

/* The JSON header (text, hlen bytes, from byte 8 of the file). */
static int parse_header(kvf_st_file *f, const char *text, uint64_t hlen) {
    json_error_t err;
    f->root = json_loadb(text, (size_t)hlen, JSON_REJECT_DUPLICATES, &err);
    if (!f->root)
        return kvf_set_error(KVF_EFORMAT, "%s: header is not valid JSON: %s (line %d, column %d)", f->label, err.text,
                             err.line, err.column);
    if (!json_is_object(f->root)) return kvf_set_error(KVF_EFORMAT, "%s: header must be a JSON object", f->label);
    const uint64_t data = 8 + hlen;
    size_t data_len = f->len - 8 - (size_t)hlen, n = json_object_size(f->root);
    f->t = calloc(n ? n : 1, sizeof *f->t);
    if (!f->t) return kvf_set_error(KVF_ENOMEM, "%s: out of memory for %zu tensors", f->label, n);
    const char *k;
    json_t *v;
    int rc = KVF_OK;
    json_object_foreach(f->root, k, v) {
        if (!strcmp(k, META_KEY)) rc = parse_metadata(f, v);
        else if (!*k) rc = kvf_set_error(KVF_EFORMAT, "%s: a tensor has an empty name", f->label);
        else rc = parse_entry(f, k, v, data, data_len, &f->t[f->n++]);
        if (rc) return rc;
    }
    qsort(f->t, f->n, sizeof *f->t, cmp_tensor);
    return check_overlaps(f);
}

static int new_file(const char *label, kvf_st_file **out) {
    *out = calloc(1, sizeof **out);
    if (*out) (*out)->fd = -1;
    if (!*out || !((*out)->label = strdup(label ? label : "<memory>"))) {
        free(*out);
        *out = NULL;
        return kvf_set_error(KVF_ENOMEM, "out of memory opening %s", label ? label : "<memory>");
    }
    return KVF_OK;
}

int kvf_st_parse(const void *bytes, size_t len, const char *label, kvf_st_file **out) {
    if (!out) return kvf_set_error(KVF_EINVAL, "kvf_st_parse: out is NULL");
    *out = NULL;
    if (!bytes && len) return kvf_set_error(KVF_EINVAL, "kvf_st_parse: NULL bytes");
    kvf_st_file *f;
    int rc = new_file(label, &f);
    if (rc) return rc;
    f->bytes = bytes;
    f->len = len;
    uint64_t hlen = 0;
    if (len < 8)
        rc = kvf_set_error(KVF_EFORMAT, "%s: %zu bytes: too short for the 8-byte header length", f->label, len);
    else memcpy(&hlen, bytes, 8);
    if (rc || (rc = check_header_length(f, hlen)) || (rc = parse_header(f, (const char *)bytes + 8, hlen))) {
        kvf_st_close(f);
        return rc;
    }
    *out = f;
    return KVF_OK;
}

/* What a file that is not a regular one is, for the message. */
static const char *file_kind(mode_t m) {
    return S_ISDIR(m) ? "a directory" : S_ISFIFO(m) ? "a FIFO (named pipe)" : S_ISCHR(m) ? "a character device"
         : S_ISBLK(m) ? "a block device" : S_ISSOCK(m) ? "a socket" : "not a regular file";
}

/* n bytes at offset `at` of f's file; KVF_EIO naming what when it ends before them. */
static int read_at(const kvf_st_file *f, uint64_t at, size_t n, void *out, const char *what) {
    size_t done = 0;
    while (done < n) {
        size_t ask = n - done < ((size_t)1 << 30) ? n - done : (size_t)1 << 30;
        ssize_t got = pread(f->fd, (uint8_t *)out + done, ask, (off_t)(at + done));
        if (got < 0 && errno == EINTR) continue;
        if (got > 0) { done += (size_t)got; continue; }
        int saved = errno;
        memset((uint8_t *)out + done, 0, n - done);
        if (got < 0)
            return kvf_set_error(KVF_EIO, "%s: cannot read %s: %s", f->label, what, strerror(saved));
        struct stat st;
        long long now = fstat(f->fd, &st) == 0 ? (long long)st.st_size : -1;
        return kvf_set_error(KVF_EIO,
                             "%s: the file changed while read: %s needs bytes up to %llu, the file now ends at "
                             "byte %lld (it had %zu when opened)",
                             f->label, what, (unsigned long long)(at + n), now, f->len);
    }
    return KVF_OK;
}

int kvf_st_open(const char *path, kvf_st_file **out) {
    if (!path || !out) return kvf_set_error(KVF_EINVAL, "kvf_st_open: NULL argument");
    *out = NULL;
    /* O_NONBLOCK: opening a FIFO with no writer does not wait (it is refused
     * below); it changes nothing for a regular file. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) return kvf_set_error(KVF_EIO, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int saved = errno;
        close(fd);
        return kvf_set_error(KVF_EIO, "%s: cannot stat: %s", path, strerror(saved));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return kvf_set_error(KVF_EIO, "%s: is %s, not a regular file: give a safetensors file", path,
                             file_kind(st.st_mode));
    }
    kvf_st_file *f;
    int rc = new_file(path, &f);
    if (rc) { close(fd); return rc; }
    f->fd = fd;
    f->len = (size_t)st.st_size;
    f->mtime = st.st_mtim;
    uint64_t hlen = 0;
    char *text = NULL;
    if (f->len < 8)
        rc = kvf_set_error(KVF_EFORMAT, "%s: %zu bytes: too short for the 8-byte header length", path, f->len);
    else if (!(rc = read_at(f, 0, 8, &hlen, "the header length")) && !(rc = check_header_length(f, hlen))) {
        if (!(text = malloc(hlen ? (size_t)hlen : 1)))
            rc = kvf_set_error(KVF_ENOMEM, "%s: out of memory for a %" PRIu64 "-byte header", path, hlen);
        else if (!(rc = read_at(f, 8, (size_t)hlen, text, "the header")))
            rc = parse_header(f, text, hlen);
    }
    free(text);
    if (rc) { kvf_st_close(f); return rc; }
    *out = f;
    return KVF_OK;
}

int kvf_st_read(const kvf_st_tensor *t, size_t off, size_t n, void *out) {
    if (!t || !t->file || (n && !out)) return kvf_set_error(KVF_EINVAL, "kvf_st_read: NULL argument");
    const kvf_st_file *f = t->file;
    if (off > t->n_bytes || n > t->n_bytes - off)
        return kvf_set_error(KVF_EINVAL, "%s: tensor \"%s\": bytes [%zu, %zu) are outside its %zu", f->label, t->name,
                             off, off + n, t->n_bytes);
    if (!n) return KVF_OK;
    if (f->bytes) {
        memcpy(out, f->bytes + t->offset + off, n);
        return KVF_OK;
    }
    char what[160], pn[128];
    snprintf(what, sizeof what, "tensor \"%s\"", kvf_st_printable(t->name, pn, sizeof pn));
    return read_at(f, t->offset + off, n, out, what);
}

int kvf_st_check_unchanged(const kvf_st_file *f) {
    if (!f || f->fd < 0) return KVF_OK;
    struct stat st;
    if (fstat(f->fd, &st) != 0) return kvf_set_error(KVF_EIO, "%s: cannot stat: %s", f->label, strerror(errno));
    if ((size_t)st.st_size != f->len || st.st_mtim.tv_sec != f->mtime.tv_sec || st.st_mtim.tv_nsec != f->mtime.tv_nsec)
        return kvf_set_error(KVF_EIO,
                             "%s: the file changed while read (%lld bytes now, %zu when opened; modified since): "
                             "the results would mix two files",
                             f->label, (long long)st.st_size, f->len);
    return KVF_OK;
}

void kvf_st_close(kvf_st_file *f) {
    if (!f) return;
    if (f->fd >= 0) close(f->fd);
    json_decref(f->root);
    free(f->t);
    free(f->label);
    free(f);
}

const char *kvf_st_label(const kvf_st_file *f) { return f ? f->label : ""; }
size_t kvf_st_count(const kvf_st_file *f) { return f ? f->n : 0; }
const kvf_st_tensor *kvf_st_at(const kvf_st_file *f, size_t i) { return f && i < f->n ? &f->t[i] : NULL; }

const kvf_st_tensor *kvf_st_find(const kvf_st_file *f, const char *name) {
    if (!f || !name) return NULL;
    kvf_st_tensor key = {.name = name};
    return bsearch(&key, f->t, f->n, sizeof *f->t, cmp_tensor);
}

const char *kvf_st_meta(const kvf_st_file *f, const char *key) {
    if (!f || !f->meta || !key) return NULL;
    return json_string_value(json_object_get(f->meta, key));
}

/* ---------------------------------------------------------------- writer */

static json_t *write_header(const char *const *meta_kv, int n_meta, const kvf_st_write_tensor *t, int n,
                            uint64_t *data_len) {
    json_t *root = json_object(), *meta = n_meta > 0 ? json_object() : NULL;
    if (!root || (n_meta > 0 && !meta)) goto fail;
    for (int i = 0; i < n_meta; i++)
        if (json_object_set_new(meta, meta_kv[2 * i], json_string(meta_kv[2 * i + 1]))) goto fail;
    if (meta && json_object_set_new(root, META_KEY, meta)) { meta = NULL; goto fail; }
    meta = NULL;
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        json_t *shape = json_array();
        uint64_t bytes = kvf_st_dtype_size(t[i].dtype);
        for (int d = 0; shape && d < t[i].ndim; d++) {
            json_array_append_new(shape, json_integer(t[i].shape[d]));
            bytes *= (uint64_t)t[i].shape[d];
        }
        json_t *e = shape ? json_pack("{s:s, s:o, s:[I, I]}", "dtype", kvf_st_dtype_name(t[i].dtype), "shape", shape,
                                      "data_offsets", (json_int_t)off, (json_int_t)(off + bytes))
                          : NULL;
        if (!e || json_object_set_new(root, t[i].name, e)) goto fail;
        off += bytes;
    }
    *data_len = off;
    return root;
fail:
    json_decref(meta);
    json_decref(root);
    return NULL;
}

int kvf_st_write(const char *path, const char *const *meta_kv, int n_meta, const kvf_st_write_tensor *t,
                 int n_tensors) {
    if (!path || (n_meta > 0 && !meta_kv) || (n_tensors > 0 && !t))
        return kvf_set_error(KVF_EINVAL, "kvf_st_write: NULL argument");
    uint64_t data_len;
    json_t *root = write_header(meta_kv, n_meta, t, n_tensors, &data_len);
    char *text = root ? json_dumps(root, JSON_COMPACT) : NULL;
    json_decref(root);
    if (!text) return kvf_set_error(KVF_ENOMEM, "%s: cannot build the safetensors header", path);
    size_t len = strlen(text);
    uint64_t hlen = (len + 7) & ~(size_t)7;
    FILE *fp = fopen(path, "wb");
    int ok = fp != NULL && fwrite(&hlen, 8, 1, fp) == 1 && fwrite(text, 1, len, fp) == len;
    for (size_t i = len; ok && i < hlen; i++) ok = fputc(' ', fp) != EOF;
    for (int i = 0; ok && i < n_tensors; i++) {
        size_t bytes = kvf_st_dtype_size(t[i].dtype);
        for (int d = 0; d < t[i].ndim; d++) bytes *= (size_t)t[i].shape[d];
        ok = bytes == 0 || fwrite(t[i].data, 1, bytes, fp) == bytes;
    }
    int saved = errno;
    free(text);
    if (fp && fclose(fp) != 0) ok = 0;
    if (!ok) return kvf_set_error(KVF_EIO, "%s: cannot write: %s", path, strerror(saved ? saved : errno));
    return KVF_OK;
}
