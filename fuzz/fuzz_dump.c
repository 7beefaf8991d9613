/*
 * libFuzzer target: the safetensors reader, the dump and recon readers,
 * `kvforge eval` on what they accept (eval/), and its option parser. The
 * input is read three times:
 *
 *  1. as a KV dump (kvf_dump_parse). An accepted dump is evaluated on the CPU
 *     (one thread) by every scheme of fd_schemes whose head_dim it has:
 *     post-RoPE ones must succeed on any accepted dump, the pre-RoPE one may
 *     only refuse it for its RoPE (KVF_EFORMAT); every report must have its
 *     shares in [0, 1], a positive compression, and build as JSON and as a table.
 *     Its NaN and infinity accounting is checked against a count of its own:
 *     each listed tensor's count and first place, every K, V and scored Q
 *     tensor holding some listed, the totals summing up, undefined metrics and
 *     a warning where there are any, and strict refusing the dump then.
 *  2. as a recon file (kvf_recon_parse) of the fixed dump FD_FIXED (made once,
 *     fuzz_dump.h). An accepted recon of that shape is scored as a peer: only
 *     an exact-marked chunk that is not the dump's may be refused
 *     (KVF_EFORMAT); the report checks are the same, and its compression is
 *     the BF16 bytes over the recon's stored bytes.
 *  3. as the arguments of `kvforge eval` (kvf_eval_parse_args): the bytes
 *     split at NUL and newline into an argv. The parse either succeeds with
 *     a complete request whose strings are the arguments' own, or is a usage
 *     error with a message naming the command; parsing again from the
 *     original order gives the same (getopt's state is reset).
 *
 * Parse failures must say why (a message) and leave no object behind.
 */
#include "fuzz_common.h"
#include "fuzz_dump.h"

#include "cli_args.h"
#include "eval.h"

#include <math.h>
#include <unistd.h>

#define FD_SCHEMES 4
/* pre: caches keys before RoPE (needs k_pre, pos and the dump's RoPE to match). */
static const struct { const char *src; int pre; } fd_scheme_src[FD_SCHEMES] = {
    {"rtn_int2", 0},
    {"return { base = 'kivi_int2', name = 'fd_kivi' }", 0}, /* recent = 1: exact chunks in the history */
    {"return { base = 'rtn_int2', name = 'fd_pre', rope = { placement = 'pre', sections = {16, 24, 24} } }", 1},
    {"return { base = 'quantwm_int2', name = 'fd_cent16', head_dim = 64,\n"
     "  key = { centroids = 16, psac_rank = 4 }, value = { centroids = 16, stages = 2 } }",
     0}, /* k-means, query statistics, d = 64 */
};

typedef struct fd_state {
    kvf_scheme *s[FD_SCHEMES];
    uint8_t *fixed; /* the bytes of FD_FIXED's dump */
    kvf_dump *dump; /* parsed from them */
    FILE *null;
} fd_state;

static fd_state *fd_get(void) {
    static fd_state st;
    static int ready;
    if (ready) return &st;
    for (int i = 0; i < FD_SCHEMES; i++) {
        const char *src = fd_scheme_src[i].src;
        int rc = strncmp(src, "return", 6) ? kvf_scheme_load_builtin(src, &st.s[i])
                                           : kvf_scheme_load_string(src, strlen(src), "=fuzz_dump", &st.s[i]);
        FUZZ_CHECK(rc == KVF_OK);
    }
    char path[] = "/tmp/kvf_fuzz_dump_XXXXXX";
    int fd = mkstemp(path);
    FUZZ_CHECK(fd >= 0);
    close(fd);
    FUZZ_CHECK(fd_write_dump(path, &FD_FIXED, 1) == KVF_OK);
    size_t n = 0;
    st.fixed = fd_read_file(path, &n);
    unlink(path);
    FUZZ_CHECK(st.fixed != NULL);
    FUZZ_CHECK(kvf_dump_parse(st.fixed, n, "fixed dump", &st.dump) == KVF_OK);
    st.null = fopen("/dev/null", "w");
    FUZZ_CHECK(st.null != NULL);
    ready = 1;
    return &st;
}

static int share_ok(double x) { return isnan(x) || (x >= 0 && x <= 1); }

static void fd_check_report(fd_state *st, const kvf_eval_report *r) {
    const kvf_eval_metrics *m = &r->overall;
    FUZZ_CHECK(share_ok(m->top1_shift) && share_ok(m->top5_overlap));
    FUZZ_CHECK(isnan(m->attn_out_rel_err) || m->attn_out_rel_err >= 0);
    FUZZ_CHECK(m->bf16_bytes > 0 && (m->stored_bytes == 0 ? isnan(m->compression) : m->compression > 0));
    for (int l = 0; l < r->layers; l++) FUZZ_CHECK(share_ok(r->layer[l].top1_shift));
    char *js = kvf_eval_report_json(r);
    FUZZ_CHECK(js != NULL);
    free(js);
    kvf_eval_print_table(r, st->null);
}

/* The first non-finite element of t, (its count; *first its index), read independently of the run. */
static size_t fd_count_tensor(const kvf_st_tensor *t, size_t *first) {
    uint16_t *x = malloc(t->n_bytes ? t->n_bytes : 1);
    FUZZ_CHECK(x != NULL);
    FUZZ_CHECK(kvf_dump_bf16(t, 0, t->n_elements, x) == KVF_OK);
    size_t n = 0;
    for (size_t i = 0; i < t->n_elements; i++)
        if ((x[i] & 0x7f80u) == 0x7f80u && n++ == 0) *first = i;
    free(x);
    return n;
}

static void fd_check_nonfinite(fd_state *st, const kvf_dump *d, const kvf_eval_report *r) {
    int64_t sum = 0, roles = 0, layers = 0;
    for (int i = 0; i < r->n_nonfinite; i++) {
        const kvf_eval_nonfinite *e = &r->nonfinite[i];
        const kvf_st_tensor *t = kvf_st_find(d->file, e->tensor);
        FUZZ_CHECK(t != NULL && t->ndim == 3);
        size_t first = 0, n = fd_count_tensor(t, &first);
        FUZZ_CHECK(e->count > 0 && (size_t)e->count == n);
        const size_t per_head = (size_t)t->shape[1] * (size_t)t->shape[2];
        FUZZ_CHECK((size_t)e->head == first / per_head && (size_t)e->token == first % per_head / (size_t)t->shape[2] &&
                   (size_t)e->channel == first % (size_t)t->shape[2] && !isfinite(e->first));
        sum += e->count;
        for (int j = 0; j < i; j++) FUZZ_CHECK(strcmp(r->nonfinite[j].tensor, e->tensor) != 0); /* listed once */
    }
    for (int role = 0; role < KVF_DUMP_ROLES; role++) roles += r->nonfinite_by_role[role];
    for (int l = 0; l < r->layers; l++) layers += r->layer_nonfinite[l];
    FUZZ_CHECK(sum == r->nonfinite_values && roles == sum && layers == sum);
    /* K and V of every chunk and the queries of every chunk but the first are read: none is missed */
    for (int l = 0; l < d->layers; l++)
        for (int c = 0; c < d->chunks; c++)
            for (int role = 0; role < KVF_DUMP_ROLES; role++) {
                if (role != KVF_DUMP_K && role != KVF_DUMP_V && !(role == KVF_DUMP_Q && c > 0)) continue;
                const kvf_st_tensor *t = kvf_dump_tensor(d, l, c, role);
                size_t first;
                if (!fd_count_tensor(t, &first)) continue;
                int listed = 0;
                for (int i = 0; i < r->n_nonfinite && !listed; i++) listed = !strcmp(r->nonfinite[i].tensor, t->name);
                FUZZ_CHECK(listed);
            }
    FUZZ_CHECK(r->tensors_checked >= (int64_t)d->layers * (3 * d->chunks - 1));
    if (r->nonfinite_values) {
        FUZZ_CHECK(isnan(r->overall.top1_shift) && isnan(r->overall.attn_out_rel_err));
        FUZZ_CHECK(kvf_eval_print_warnings(r, st->null) >= 1);
    }
}

static void fd_as_dump(fd_state *st, const uint8_t *data, size_t size) {
    static kvf_dump sentinel;
    kvf_dump *d = &sentinel;
    int rc = kvf_dump_parse(data, size, "fuzz", &d);
    FUZZ_CHECK((rc == KVF_OK) == (d != NULL));
    if (rc) {
        FUZZ_CHECK(rc == KVF_EFORMAT && *kvf_last_error());
        return;
    }
    for (int l = 0; l < d->layers; l++)
        for (int c = 0; c < d->chunks; c++)
            FUZZ_CHECK(kvf_dump_tensor(d, l, c, KVF_DUMP_Q) && kvf_dump_tensor(d, l, c, KVF_DUMP_K) &&
                       kvf_dump_tensor(d, l, c, KVF_DUMP_V));
    for (int i = 0; i < FD_SCHEMES; i++) {
        if (kvf_scheme_head_dim(st->s[i]) != d->head_dim) continue;
        kvf_eval_options opt = {.device = KVF_DEVICE_CPU, .threads = 1, .warm = i == 3}; /* the k-means one warm-started */
        kvf_eval_report r;
        rc = kvf_eval_run(st->s[i], d, &opt, &r);
        FUZZ_CHECK(rc == KVF_OK || (fd_scheme_src[i].pre && rc == KVF_EFORMAT));
        if (rc) continue;
        fd_check_report(st, &r);
        fd_check_nonfinite(st, d, &r);
        FUZZ_CHECK(r.warm == (i == 3) && r.warm_spans_scored <= r.warm_spans);
        const int64_t bad = r.nonfinite_values;
        kvf_eval_report_free(&r);
        if (bad && i == 0) { /* strict: the same dump refused, saying why */
            opt.strict = 1;
            rc = kvf_eval_run(st->s[i], d, &opt, &r);
            FUZZ_CHECK(rc == KVF_EFORMAT && strstr(kvf_last_error(), "strict"));
        }
    }
    kvf_dump_close(d);
}

static void fd_as_recon(fd_state *st, const uint8_t *data, size_t size) {
    static kvf_recon sentinel;
    kvf_recon *rc_ = &sentinel;
    int rc = kvf_recon_parse(data, size, "fuzz recon", &rc_);
    FUZZ_CHECK((rc == KVF_OK) == (rc_ != NULL));
    if (rc) {
        FUZZ_CHECK(rc == KVF_EFORMAT && *kvf_last_error());
        return;
    }
    kvf_eval_options opt = {.device = KVF_DEVICE_CPU, .threads = 1};
    kvf_eval_report r;
    rc = kvf_eval_run_peer(rc_, st->dump, &opt, &r);
    FUZZ_CHECK(rc == KVF_OK || rc == KVF_EFORMAT);
    if (rc == KVF_OK) {
        fd_check_report(st, &r);
        double bytes = 0;
        for (int l = 0; l < rc_->layers; l++) bytes += kvf_recon_layer_bytes(rc_, l, NULL);
        FUZZ_CHECK(r.overall.stored_bytes == bytes);
        kvf_eval_report_free(&r);
    }
    kvf_recon_close(rc_);
}

#define FD_MAX_ARGS 32
#define FD_ARGS_BYTES 1024

/* Whether s (NULL allowed) lies in buf[0..n). */
static int fd_inside(const char *s, const char *buf, size_t n) { return !s || (s >= buf && s < buf + n); }

static void fd_same_args(const kvf_eval_args *a, const kvf_eval_args *b) {
    const char *const x[4] = {a->scheme, a->peer, a->data, a->recon_out}, *const y[4] = {b->scheme, b->peer, b->data, b->recon_out};
    for (int i = 0; i < 4; i++) FUZZ_CHECK(x[i] == y[i]); /* the same argument (pointers into one buffer) */
    FUZZ_CHECK(a->gpu == b->gpu && a->json == b->json && a->threads == b->threads && a->warm == b->warm &&
               a->strict == b->strict && a->quiet == b->quiet && a->help == b->help);
}

static void fd_as_args(const uint8_t *data, size_t size) {
    static char buf[FD_ARGS_BYTES + 1], name[] = "eval";
    char *argv[FD_MAX_ARGS + 2], *orig[FD_MAX_ARGS + 2];
    const size_t n = size < FD_ARGS_BYTES ? size : FD_ARGS_BYTES;
    memcpy(buf, data, n);
    buf[n] = 0;
    int argc = 0;
    argv[argc++] = name;
    for (size_t i = 0; i < n && argc < FD_MAX_ARGS + 1;) {
        while (i < n && (buf[i] == 0 || buf[i] == '\n')) buf[i++] = 0;
        if (i == n) break;
        argv[argc++] = buf + i;
        while (i < n && buf[i] != 0 && buf[i] != '\n') i++;
        if (i < n) buf[i++] = 0;
    }
    argv[argc] = NULL;
    memcpy(orig, argv, sizeof argv);
    static char err[2][4096];
    kvf_eval_args a[2];
    int rc[2];
    for (int k = 0; k < 2; k++) {
        memset(err[k], 0, sizeof err[k]);
        FILE *f = fmemopen(err[k], sizeof err[k] - 1, "w");
        FUZZ_CHECK(f != NULL);
        if (k) memcpy(argv, orig, sizeof argv); /* getopt_long permuted them */
        rc[k] = kvf_eval_parse_args(argc, argv, &a[k], f);
        fclose(f);
    }
    FUZZ_CHECK(rc[0] == rc[1] && !strcmp(err[0], err[1]));
    FUZZ_CHECK(rc[0] == 0 || rc[0] == KVF_CLI_USAGE);
    if (rc[0]) {
        FUZZ_CHECK(!strncmp(err[0], "kvforge eval: ", 14));
        return;
    }
    FUZZ_CHECK(!*err[0]);
    fd_same_args(&a[0], &a[1]);
    const kvf_eval_args *p = &a[0];
    FUZZ_CHECK(fd_inside(p->scheme, buf, n) && fd_inside(p->peer, buf, n) && fd_inside(p->data, buf, n) &&
               fd_inside(p->recon_out, buf, n));
    FUZZ_CHECK(p->threads >= 0 && p->threads <= KVF_MAX_THREADS);
    if (p->help) return;
    FUZZ_CHECK(p->data && *p->data && (!p->scheme != !p->peer));
    FUZZ_CHECK(!p->peer || (!p->gpu && !p->warm && !p->recon_out));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static const uint8_t none[1] = {0};
    fd_state *st = fd_get();
    if (!data) data = none;
    fd_as_dump(st, data, size);
    fd_as_recon(st, data, size);
    fd_as_args(data, size);
    return 0;
}
