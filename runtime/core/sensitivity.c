/*
 * The sensitivity table of calibrated mixed precision (docs/FORMAT.md
 * "Sensitivity table"; written by `kvforge calibrate`) and the channel map a
 * layer's encode takes from it (kvf_mixed_map). JSON, read with Jansson.
 */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define TABLE_FORMAT "kvforge-sensitivity"
#define TABLE_VERSION 1
#define TABLE_MAX_BYTES (64u << 20)

/* A relative table path is read beside the scheme file that names it. */
static void resolve(const struct kvf_scheme *s, const char *path, char *out, size_t n) {
    const char *slash = strrchr(s->source, '/');
    if (path[0] == '/' || !slash || !strncmp(s->source, "<builtin>", 9) || !strncmp(s->source, "<", 1)) {
        snprintf(out, n, "%s", path);
        return;
    }
    snprintf(out, n, "%.*s/%s", (int)(slash - s->source), s->source, path);
}

/* The whole file, refusing what is not a regular file (a FIFO would block). */
static int read_table(const char *path, char **text) {
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return kvf_set_error(KVF_EIO, "sensitivity table %s: %s", path, strerror(errno));
    struct stat st;
    int rc = KVF_OK;
    if (fstat(fd, &st)) rc = kvf_set_error(KVF_EIO, "sensitivity table %s: %s", path, strerror(errno));
    else if (!S_ISREG(st.st_mode)) rc = kvf_set_error(KVF_EIO, "sensitivity table %s: not a regular file", path);
    else if ((size_t)st.st_size > TABLE_MAX_BYTES)
        rc = kvf_set_error(KVF_EFORMAT, "sensitivity table %s: %lld bytes, at most %u", path, (long long)st.st_size,
                           TABLE_MAX_BYTES);
    char *buf = rc ? NULL : malloc((size_t)st.st_size + 1);
    if (!rc && !buf) rc = kvf_set_error(KVF_ENOMEM, "out of memory reading %s", path);
    size_t got = 0;
    while (!rc && got < (size_t)st.st_size) {
        ssize_t r = read(fd, buf + got, (size_t)st.st_size - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) rc = kvf_set_error(KVF_EIO, "sensitivity table %s: %s", path, r ? strerror(errno) : "shorter than its size");
        else got += (size_t)r;
    }
    close(fd);
    if (rc) { free(buf); return rc; }
    buf[got] = 0;
    *text = buf;
    return KVF_OK;
}

static int integer_field(json_t *root, const char *path, const char *key, long long *v) {
    json_t *j = json_object_get(root, key);
    if (!json_is_integer(j))
        return kvf_set_error(KVF_EFORMAT, "sensitivity table %s: \"%s\" must be an integer", path, key);
    *v = json_integer_value(j);
    return KVF_OK;
}

/* scores of section `name`, layer `layer`: [heads][d] into out. */
static int scores_of(json_t *root, const char *path, const char *name, long long layers, long long heads, int d,
                     int layer, float *out) {
    json_t *sec = json_object_get(root, name);
    if (!json_is_array(sec) || (long long)json_array_size(sec) != layers)
        return kvf_set_error(KVF_EFORMAT, "sensitivity table %s: \"%s\" must be an array of %lld layers", path, name,
                             layers);
    for (long long l = 0; l < layers; l++) {
        json_t *lj = json_array_get(sec, (size_t)l);
        if (!json_is_array(lj) || (long long)json_array_size(lj) != heads)
            return kvf_set_error(KVF_EFORMAT, "sensitivity table %s: %s[%lld] must be an array of %lld KV heads", path,
                                 name, l, heads);
        for (long long h = 0; h < heads; h++) {
            json_t *hj = json_array_get(lj, (size_t)h);
            if (!json_is_array(hj) || (int)json_array_size(hj) != d)
                return kvf_set_error(KVF_EFORMAT, "sensitivity table %s: %s[%lld][%lld] must be an array of %d scores",
                                     path, name, l, h, d);
            for (int c = 0; c < d; c++) {
                json_t *v = json_array_get(hj, (size_t)c);
                double x = json_is_number(v) ? json_number_value(v) : NAN;
                if (!isfinite(x) || x < 0)
                    return kvf_set_error(KVF_EFORMAT,
                                         "sensitivity table %s: %s[%lld][%lld][%d] must be a finite number >= 0", path,
                                         name, l, h, c);
                if (l == layer) out[h * d + c] = (float)x;
            }
        }
    }
    return KVF_OK;
}

/* The m channels of highest score (ties: the lower channel), numbered in
 * channel order, into map [d] (255 for the others). */
static void pick(const float *score, int d, int m, uint8_t *map) {
    uint8_t chosen[256] = {0};
    for (int i = 0; i < m; i++) {
        int best = -1;
        for (int c = 0; c < d; c++)
            if (!chosen[c] && (best < 0 || score[c] > score[best])) best = c;
        chosen[best] = 1;
    }
    for (int c = 0, slot = 0; c < d; c++) map[c] = chosen[c] ? (uint8_t)slot++ : 255;
}

int kvf_mixed_map_parse(const struct kvf_scheme *s, const char *text, size_t len, const char *path, int32_t layer,
                        int32_t n_kv_heads, uint8_t *map) {
    const int m[2] = {s->plan.sec[0].mp_channels, s->plan.sec[1].mp_channels}, d = s->head_dim;
    json_error_t err;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &err);
    if (!root) return kvf_set_error(KVF_EFORMAT, "sensitivity table %s:%d: %s", path, err.line, err.text);
    long long version = 0, hd = 0, heads = 0, layers = 0;
    json_t *fmt = json_object_get(root, "format");
    float *score = malloc((size_t)n_kv_heads * (size_t)d * sizeof(float));
    int rc = KVF_OK;
    if (!score) rc = kvf_set_error(KVF_ENOMEM, "out of memory reading %s", path);
    else if (!json_is_object(root) || !json_is_string(fmt) || strcmp(json_string_value(fmt), TABLE_FORMAT))
        rc = kvf_set_error(KVF_EFORMAT, "sensitivity table %s: \"format\" must be \"%s\"", path, TABLE_FORMAT);
    else if ((rc = integer_field(root, path, "version", &version)))
        ;
    else if (version != TABLE_VERSION)
        rc = kvf_set_error(KVF_EFORMAT, "sensitivity table %s: version %lld, this library reads %d", path, version,
                           TABLE_VERSION);
    else if ((rc = integer_field(root, path, "head_dim", &hd)) || (rc = integer_field(root, path, "kv_heads", &heads)) ||
             (rc = integer_field(root, path, "layers", &layers)))
        ;
    else if (hd != d)
        rc = kvf_set_error(KVF_EFORMAT, "sensitivity table %s: head_dim %lld, scheme %s has %d", path, hd, s->name, d);
    else if (heads != n_kv_heads)
        rc = kvf_set_error(KVF_EFORMAT, "sensitivity table %s: kv_heads %lld, the cache has %d", path, heads,
                           (int)n_kv_heads);
    else if (layers < 1 || layers > 65536 || layer >= layers)
        rc = kvf_set_error(KVF_EFORMAT, "sensitivity table %s: layers %lld, layer %d asked for", path, layers,
                           (int)layer);
    for (int t = 0; t < 2 && !rc; t++) {
        uint8_t *mt = map + (size_t)t * (size_t)n_kv_heads * (size_t)d;
        if (!m[t]) {
            memset(mt, 255, (size_t)n_kv_heads * (size_t)d);
            continue;
        }
        if ((rc = scores_of(root, path, t ? "value" : "key", layers, heads, d, layer, score))) break;
        for (int h = 0; h < n_kv_heads; h++) pick(score + (size_t)h * d, d, m[t], mt + (size_t)h * d);
    }
    free(score);
    json_decref(root);
    return rc;
}

int kvf_mixed_map(const kvf_scheme *s, const char *table_path, int32_t layer, int32_t n_kv_heads, uint8_t *map) {
    if (!s || !map) return kvf_set_error(KVF_EINVAL, "kvf_mixed_map: NULL argument");
    if (!s->plan.sec[0].mp_channels && !s->plan.sec[1].mp_channels)
        return kvf_set_error(KVF_EINVAL, "kvf_mixed_map: scheme %s has no mixed precision", s->name);
    if (n_kv_heads < 1 || n_kv_heads > 65535 || layer < 0)
        return kvf_set_error(KVF_EINVAL, "kvf_mixed_map: layer %d, %d KV heads", (int)layer, (int)n_kv_heads);
    const char *given = table_path ? table_path : s->pipe.mp_table;
    if (!given[0])
        return kvf_set_error(KVF_EINVAL, "kvf_mixed_map: scheme %s names no sensitivity table "
                                         "(mixed_precision.table): give one (kvforge calibrate writes it)", s->name);
    char path[1024];
    resolve(s, given, path, sizeof path);
    char *text = NULL;
    int rc = read_table(path, &text);
    if (rc) return rc;
    rc = kvf_mixed_map_parse(s, text, strlen(text), path, layer, n_kv_heads, map);
    free(text);
    return rc;
}
