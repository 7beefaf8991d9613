/*
 * libFuzzer target: the safetensors reader, the dump and recon readers, and
 * `kvforge eval` on what they accept (eval/). The input is read twice:
 *
 *  1. as a KV dump (kvf_dump_parse). An accepted dump is evaluated on the CPU
 *     (one thread) by every scheme of fd_schemes whose head_dim it has:
 *     post-RoPE ones must succeed on any accepted dump, the pre-RoPE one may
 *     only refuse it for its RoPE (KVF_EFORMAT); every report must have its
 *     shares in [0, 1], a positive compression, and build as JSON and as a table.
 *  2. as a recon file (kvf_recon_parse) of the fixed dump FD_FIXED (made once,
 *     fuzz_dump.h). An accepted recon of that shape is scored as a peer: only
 *     an exact-marked chunk that is not the dump's may be refused
 *     (KVF_EFORMAT); the report checks are the same, and its compression is
 *     the BF16 bytes over the recon's stored bytes.
 *
 * Parse failures must say why (a message) and leave no object behind.
 */
#include "fuzz_common.h"
#include "fuzz_dump.h"

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
        kvf_eval_report_free(&r);
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

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static const uint8_t none[1] = {0};
    fd_state *st = fd_get();
    if (!data) data = none;
    fd_as_dump(st, data, size);
    fd_as_recon(st, data, size);
    return 0;
}
