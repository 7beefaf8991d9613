/*
 * A strict reader (and a small writer) of safetensors files: 8-byte
 * little-endian header length, a JSON header (parsed with Jansson) mapping
 * tensor names to {dtype, shape, data_offsets} plus an optional
 * "__metadata__" object of strings, then the data. Every offset, shape and
 * dtype is checked before anything is read; a hostile file gives KVF_EFORMAT
 * with a message naming the file and the tensor, never a crash.
 */
#ifndef KVF_SAFETENSORS_H
#define KVF_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#define KVF_ST_MAX_DIMS 8
#define KVF_ST_MAX_HEADER (100u << 20) /* the safetensors limit: 100 MB of JSON */

typedef enum kvf_st_dtype {
    KVF_ST_BOOL, KVF_ST_U8, KVF_ST_I8, KVF_ST_F8_E4M3, KVF_ST_F8_E5M2,
    KVF_ST_I16, KVF_ST_U16, KVF_ST_F16, KVF_ST_BF16,
    KVF_ST_I32, KVF_ST_U32, KVF_ST_F32,
    KVF_ST_I64, KVF_ST_U64, KVF_ST_F64,
    KVF_ST_DTYPE_COUNT
} kvf_st_dtype;

typedef struct kvf_st_file kvf_st_file;

typedef struct kvf_st_tensor {
    const char *name;          /* owned by the file */
    kvf_st_dtype dtype;
    int ndim;
    int64_t shape[KVF_ST_MAX_DIMS];
    uint64_t n_elements;
    const kvf_st_file *file;   /* the file it is in (kvf_st_read reads from it) */
    uint64_t offset;           /* of its first byte from the start of the file */
    size_t n_bytes;
} kvf_st_tensor;

/* Name ("BF16") and element size of a dtype. */
const char *kvf_st_dtype_name(kvf_st_dtype t);
size_t kvf_st_dtype_size(kvf_st_dtype t);

/* Open a regular file read-only and parse its header; the data is read when
 * asked (kvf_st_read, pread), so a file truncated while open gives KVF_EIO,
 * never SIGBUS. A FIFO, device, socket or directory is refused (KVF_EIO) and
 * never waited on (opened O_NONBLOCK). `*out` is NULL on failure. */
int kvf_st_open(const char *path, kvf_st_file **out);
/* Parse bytes in memory (not copied: they must outlive the file object).
 * `label` names the bytes in messages. */
int kvf_st_parse(const void *bytes, size_t len, const char *label, kvf_st_file **out);
void kvf_st_close(kvf_st_file *f);

const char *kvf_st_label(const kvf_st_file *f);
/* Bytes [off, off + n) of a tensor's data into out (any alignment). KVF_EIO
 * when the file now ends before them (truncated while open) or cannot be read
 * (out zeroed then); KVF_EINVAL when the range is outside the tensor. */
int kvf_st_read(const kvf_st_tensor *t, size_t off, size_t n, void *out);
/* KVF_EIO when the file's size or modification time differ from when it was
 * opened (changed while read); KVF_OK for bytes in memory. */
int kvf_st_check_unchanged(const kvf_st_file *f);
size_t kvf_st_count(const kvf_st_file *f);
/* Tensors sorted by name (strcmp order), 0 <= i < kvf_st_count(f). */
const kvf_st_tensor *kvf_st_at(const kvf_st_file *f, size_t i);
/* NULL when absent. */
const kvf_st_tensor *kvf_st_find(const kvf_st_file *f, const char *name);
/* A "__metadata__" value, or NULL when absent. */
const char *kvf_st_meta(const kvf_st_file *f, const char *key);
/* s made safe to print in a message (control and non-ASCII bytes as \xNN,
 * cut after 80 characters) in buf; returns buf. */
const char *kvf_st_printable(const char *s, char *buf, size_t cap);

/* ------------------------------------------------------------- writer */

typedef struct kvf_st_write_tensor {
    const char *name;
    kvf_st_dtype dtype;
    int ndim;
    int64_t shape[KVF_ST_MAX_DIMS];
    const void *data; /* little-endian, n_elements * dtype size bytes */
} kvf_st_write_tensor;

/* Write a file: metadata as n_meta (key, value) string pairs; data laid out
 * in the order given, header padded with spaces to a multiple of 8. */
int kvf_st_write(const char *path, const char *const *meta_kv, int n_meta, const kvf_st_write_tensor *t,
                 int n_tensors);

#endif
