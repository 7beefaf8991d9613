/* Files written whole and atomically: a temporary file beside the target,
 * written, fsync'ed and renamed over it, so a reader sees the old file or the
 * new one, never a part (the generator's output, the disk cache's entries,
 * the export). */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int write_full(int fd, const void *buf, size_t n) {
    const uint8_t *p = buf;
    while (n) {
        ssize_t w = write(fd, p, n > (1u << 30) ? (1u << 30) : n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            if (w == 0) errno = EIO;
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int failed(char *tmp, const char *path, const char *call, int err) {
    if (tmp) unlink(tmp);
    free(tmp);
    return kvf_set_error(KVF_EIO, "%s: %s: %s", path, call, strerror(err));
}

int kvf_write_atomic(const char *path, const kvf_bytes *parts, int n_parts, unsigned mode) {
    const size_t plen = strlen(path);
    char *tmp = malloc(plen + 16);
    if (!tmp) return kvf_set_error(KVF_ENOMEM, "out of memory writing %s", path);
    snprintf(tmp, plen + 16, "%s.tmp.XXXXXX", path);
    int fd = mkostemp(tmp, O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        free(tmp);
        return kvf_set_error(KVF_EIO, "cannot create a file beside %s: %s", path, strerror(e));
    }
    const char *call = NULL;
    for (int i = 0; i < n_parts && !call; i++)
        if (parts[i].n && write_full(fd, parts[i].p, parts[i].n)) call = "write";
    if (!call && fchmod(fd, (mode_t)mode)) call = "fchmod";
    if (!call && fsync(fd)) call = "fsync";
    if (call) {
        int e = errno;
        close(fd);
        return failed(tmp, path, call, e);
    }
    if (close(fd)) return failed(tmp, path, "close", errno);
    if (rename(tmp, path)) return failed(tmp, path, "rename", errno);
    free(tmp);
    return KVF_OK;
}

int kvf_write_file(const char *path, const void *data, size_t n) {
    const kvf_bytes part = {data, n};
    return kvf_write_atomic(path, &part, 1, 0644);
}
