/*
 * Writes the seed corpus of fuzz_dump.c (fuzz/corpus/dump/): small synthetic
 * KV dumps (post-RoPE only; with k_pre, q_pre and pos; several layers and
 * heads; d = 64; NaN and infinities in K, V and Q) and recon files of the fixed dump FD_FIXED written by
 * `kvforge eval --write-recon`'s code for three schemes (packed chunks only,
 * an exact recent chunk, sink and span). Deterministic.
 *
 *   out/fuzz/mkseeds_dump fuzz/corpus/dump
 */
#include "fuzz_dump.h"

#include "eval.h"

static _Noreturn void die(const char *what) {
    fprintf(stderr, "mkseeds_dump: %s: %s\n", what, kvf_last_error());
    exit(1);
}

static void dump_seed(const char *dir, const char *name, const fd_cfg *c, uint64_t seed) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (fd_write_dump(path, c, seed)) die(path);
}

static void recon_seed(const char *dir, const char *name, const char *scheme_text, const char *dump_path) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    kvf_scheme *s;
    kvf_dump *d;
    if (kvf_scheme_load_string(scheme_text, strlen(scheme_text), "=mkseeds_dump", &s)) die(scheme_text);
    if (kvf_dump_open(dump_path, &d)) die(dump_path);
    kvf_eval_options opt = {.device = KVF_DEVICE_CPU, .threads = 1, .recon_out = path};
    kvf_eval_report r;
    if (kvf_eval_run(s, d, &opt, &r)) die(path);
    kvf_eval_report_free(&r);
    kvf_dump_close(d);
    kvf_scheme_free(s);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fputs("usage: mkseeds_dump DIR\n", stderr);
        return 2;
    }
    const char *dir = argv[1];
    dump_seed(dir, "dump_fixed", &FD_FIXED, 1);
    const fd_cfg pre = {1, 2, 2, 1, 128, 3, 4, 1, 0};
    dump_seed(dir, "dump_pre", &pre, 2);
    const fd_cfg gqa = {2, 2, 4, 2, 128, 1, 3, 0, 0};
    dump_seed(dir, "dump_gqa", &gqa, 3);
    const fd_cfg d64 = {1, 3, 1, 1, 64, 2, 5, 0, 0};
    dump_seed(dir, "dump_d64", &d64, 4);
    const fd_cfg nan = {2, 3, 2, 1, 128, 2, 4, 0, 1}; /* NaN and infinities in K, V and Q */
    dump_seed(dir, "dump_nonfinite", &nan, 5);
    const fd_cfg nan64 = {1, 3, 2, 1, 64, 2, 4, 0, 1}; /* the same for the k-means scheme (d = 64) */
    dump_seed(dir, "dump_nonfinite_d64", &nan64, 6);
    char fixed[1024];
    snprintf(fixed, sizeof fixed, "%s/dump_fixed", dir);
    recon_seed(dir, "recon_rtn_int2", "return { base = 'rtn_int2' }", fixed);
    recon_seed(dir, "recon_kivi_int2", "return { base = 'kivi_int2' }", fixed);
    recon_seed(dir, "recon_sink_span", "return { base = 'rtn_int4', chunk = { sink = 1, span = 2 } }", fixed);
    return 0;
}
