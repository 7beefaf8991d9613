/* Status codes, per-thread error messages and one-time warnings. */
#include "internal.h"

#include <pthread.h>
#include <stdarg.h>
#include <string.h>

static _Thread_local char last_error[4096];

static const struct { int code; const char *name, *text; } status_table[] = {
#define KVF_STATUS_ROW(name, code, msg) {code, "KVF_" #name, msg},
    KVF_STATUS_MAP(KVF_STATUS_ROW)
#undef KVF_STATUS_ROW
};

const char *kvf_strerror(int status) {
    for (size_t i = 0; i < sizeof status_table / sizeof status_table[0]; i++)
        if (status_table[i].code == status) return status_table[i].text;
    return "unknown status";
}

const char *kvf_status_name(int status) {
    for (size_t i = 0; i < sizeof status_table / sizeof status_table[0]; i++)
        if (status_table[i].code == status) return status_table[i].name;
    return "KVF_UNKNOWN";
}

const char *kvf_last_error(void) { return last_error; }

const char *kvf_version(void) { return KVF_VERSION_STRING; }

void kvf_clear_error(void) { last_error[0] = 0; }

int kvf_set_error(int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return status;
}

int kvf_wrap_error(int status, const char *fmt, ...) {
    char prefix[1024], old[sizeof last_error];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    memcpy(old, last_error, sizeof old);
    if (snprintf(last_error, sizeof last_error, "%s: %s", prefix, old) >= (int)sizeof last_error)
        last_error[sizeof last_error - 1] = 0; /* truncated: keep what fits */
    return status;
}

static pthread_mutex_t warn_lock = PTHREAD_MUTEX_INITIALIZER;
static char warned[16][128];
static int n_warned;

void kvf_warn_once(const char *key, const char *fmt, ...) {
    pthread_mutex_lock(&warn_lock);
    for (int i = 0; i < n_warned; i++)
        if (!strcmp(warned[i], key)) { pthread_mutex_unlock(&warn_lock); return; }
    if (n_warned < 16) snprintf(warned[n_warned++], sizeof warned[0], "%s", key);
    pthread_mutex_unlock(&warn_lock);
    va_list ap;
    va_start(ap, fmt);
    fputs("kvforge: warning: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

const kvf_embedded_file *kvf_find_embedded(const kvf_embedded_file *table, const char *name) {
    for (const kvf_embedded_file *f = table; f->name; f++)
        if (!strcmp(f->name, name)) return f;
    return NULL;
}
