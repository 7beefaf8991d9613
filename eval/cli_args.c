/* Command-line options (cli_args.h). */
#include "cli_args.h"

#include "internal.h"

#include <string.h>

/* The short options of longs: "-:" (operands in order, missing values as ':')
 * then each character val, with ':' when it takes a value. */
static void short_options(const struct option *longs, char *buf, size_t cap) {
    size_t o = 0;
    buf[o++] = ':';
    for (const struct option *l = longs; l->name && o + 3 < cap; l++)
        if (l->val > 0 && l->val < 128 && !l->flag) {
            buf[o++] = (char)l->val;
            if (l->has_arg == required_argument) buf[o++] = ':';
        }
    buf[o] = 0;
}

/* The option getopt_long refused, as the user wrote it, into buf. After a
 * long option optind has passed it (argv[optind - 1] starts with "--"); a
 * short one may sit inside a cluster ("-hx"), so it is named by optopt. */
static const char *refused(int argc, char **argv, const struct option *longs, char *buf, size_t cap) {
    const char *prev = optind >= 2 && optind - 1 < argc ? argv[optind - 1] : "";
    if (!strncmp(prev, "--", 2)) {
        const size_t n = strcspn(prev, "=");
        int is_long = optopt == 0; /* unknown or ambiguous long option */
        for (const struct option *l = longs; !is_long && l->name; l++)
            is_long = l->val == optopt && !strncmp(l->name, prev + 2, n - 2);
        if (is_long) {
            snprintf(buf, cap, "%.*s", (int)(n < 200 ? n : 200), prev);
            return buf;
        }
    }
    if (optopt > 0x20 && optopt < 0x7f) snprintf(buf, cap, "-%c", optopt);
    else snprintf(buf, cap, "%.200s", prev);
    return buf;
}

int kvf_cli_getopt(int argc, char **argv, const struct option *longs, const char *prog, FILE *err, int *state) {
    char shorts[128], name[256];
    if (!*state) {
        optind = 0; /* glibc: a full reset, also of a cluster left half read */
        opterr = 0;
        *state = 1;
    }
    short_options(longs, shorts, sizeof shorts);
    int c = getopt_long(argc, argv, shorts, longs, NULL);
    if (c != '?' && c != ':') return c;
    refused(argc, argv, longs, name, sizeof name);
    if (c == ':') fprintf(err, "%s: option '%s' needs a value\n", prog, name);
    else if (strchr(name, '=') == NULL && optopt != 0 && !strncmp(name, "--", 2))
        fprintf(err, "%s: option '%s' takes no value\n", prog, name);
    else fprintf(err, "%s: unknown option '%s'\n", prog, name);
    fprintf(err, "Try '%s --help'.\n", prog);
    return '?';
}

int kvf_cli_twice(const char *prog, const char *name, FILE *err) {
    fprintf(err, "%s: option '--%s' given twice\nTry '%s --help'.\n", prog, name, prog);
    return KVF_CLI_USAGE;
}

/* Every input is an option: a positional argument is a usage error. */
static int unexpected_argument(const char *prog, const char *arg, FILE *err) {
    fprintf(err, "%s: unexpected argument '%.200s' (every input is given by an option)\nTry '%s --help'.\n", prog, arg,
            prog);
    return KVF_CLI_USAGE;
}

/* ------------------------------------------------------------------ eval */

void kvf_eval_usage(FILE *out) {
    fputs("usage: kvforge eval --scheme SCHEME --data DUMP.safetensors [options]\n"
          "       kvforge eval --peer RECON.safetensors --data DUMP.safetensors [options]\n"
          "Attention-level quality of a KV-cache scheme (or of another system's cache, a peer's\n"
          "recon file) on a world model's KV dump, streamed chunk by chunk (docs/QUALITY.md).\n"
          "\n"
          "  -s, --scheme SCHEME     a scheme file, or the name of a shipped scheme (rtn_int2)\n"
          "  -p, --peer RECON        score a peer's recon file (eval/peer/) instead of a scheme\n"
          "  -d, --data DUMP         the KV dump (a regular safetensors file)\n"
          "      --gpu               run the scheme's kernels on GPU 0 (default: the CPU reference)\n"
          "      --json              the report as JSON on stdout (default: a table)\n"
          "  -t, --threads N         metric threads, 1..256 (default: the online CPUs)\n"
          "      --warm              k-means of each span warm-started from the layer's previous span\n"
          "      --table TABLE       mixed precision's sensitivity table (kvforge calibrate writes it;\n"
          "                          default: the scheme's mixed_precision.table)\n"
          "      --write-recon FILE  also write the scheme's cache as a recon file\n"
          "      --strict            a NaN or infinity in the dump is an error (default: a warning,\n"
          "                          counted in the report, the metrics it enters undefined)\n"
          "  -q, --quiet             no progress on stderr (shown only when stderr is a terminal)\n"
          "  -h, --help              this help\n"
          "Exit status: 0 done (warnings on stderr), 1 the evaluation failed, 2 a usage error.\n",
          out);
}

enum { O_GPU = 256, O_JSON, O_WARM, O_WRITE_RECON, O_STRICT, O_TABLE };

int kvf_eval_parse_args(int argc, char **argv, kvf_eval_args *a, FILE *err) {
    static const struct option longs[] = {
        {"scheme", required_argument, NULL, 's'}, {"peer", required_argument, NULL, 'p'},
        {"data", required_argument, NULL, 'd'},   {"threads", required_argument, NULL, 't'},
        {"gpu", no_argument, NULL, O_GPU},        {"json", no_argument, NULL, O_JSON},
        {"warm", no_argument, NULL, O_WARM},      {"write-recon", required_argument, NULL, O_WRITE_RECON},
        {"strict", no_argument, NULL, O_STRICT},  {"quiet", no_argument, NULL, 'q'},
        {"table", required_argument, NULL, O_TABLE}, {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    const char *prog = "kvforge eval";
    memset(a, 0, sizeof *a);
    int state = 0, c;
    while ((c = kvf_cli_getopt(argc, argv, longs, prog, err, &state)) != -1) {
        const char **value = c == 's' ? &a->scheme : c == 'p' ? &a->peer : c == 'd' ? &a->data
                           : c == O_WRITE_RECON ? &a->recon_out : c == O_TABLE ? &a->table : NULL;
        if (value) {
            if (*value) {
                const struct option *l = longs;
                while (l->val != c) l++;
                return kvf_cli_twice(prog, l->name, err);
            }
            if (!*optarg) {
                const struct option *l = longs;
                while (l->val != c) l++;
                fprintf(err, "%s: option '--%s' needs a value, not an empty one\n", prog, l->name);
                return KVF_CLI_USAGE;
            }
            *value = optarg;
            continue;
        }
        switch (c) {
        case 't': {
            long long n;
            if (a->threads) return kvf_cli_twice(prog, "threads", err);
            if (!kvf_parse_int(optarg, 1, KVF_MAX_THREADS, &n)) {
                fprintf(err, "%s: --threads '%.200s': must be an integer in 1..%d\n", prog, optarg, KVF_MAX_THREADS);
                return KVF_CLI_USAGE;
            }
            a->threads = (int)n;
            break;
        }
        case O_GPU: a->gpu = 1; break;
        case O_JSON: a->json = 1; break;
        case O_WARM: a->warm = 1; break;
        case O_STRICT: a->strict = 1; break;
        case 'q': a->quiet = 1; break;
        case 'h': a->help = 1; break;
        default: return KVF_CLI_USAGE; /* '?': said */
        }
    }
    if (a->help) return 0;
    if (optind < argc) return unexpected_argument(prog, argv[optind], err);
    if (!a->scheme == !a->peer || !a->data) {
        fprintf(err, "%s: %s\nTry '%s --help'.\n", prog,
                a->scheme && a->peer ? "--scheme and --peer exclude each other: give one of --scheme or --peer"
                                     : "--data and one of --scheme or --peer are required",
                prog);
        return KVF_CLI_USAGE;
    }
    if (a->peer && (a->gpu || a->warm || a->recon_out || a->table)) {
        fprintf(err, "%s: --peer takes no %s: the recon file holds the peer's decoded cache\n", prog,
                a->gpu ? "--gpu" : a->warm ? "--warm" : a->recon_out ? "--write-recon" : "--table");
        return KVF_CLI_USAGE;
    }
    return 0;
}

/* ------------------------------------------------------------- calibrate */

void kvf_calibrate_usage(FILE *out) {
    fputs("usage: kvforge calibrate --scheme SCHEME --data DUMP.safetensors -o TABLE.json [options]\n"
          "Mixed precision's sensitivity table (docs/FORMAT.md): the scheme's error per channel,\n"
          "measured on the CPU reference over a KV dump's chunks, weighted for keys by the\n"
          "queries' energy (docs/METHODS.md section 11). Give it to kvforge eval --table, the\n"
          "Python cache, or the scheme's mixed_precision.table.\n"
          "\n"
          "  -s, --scheme SCHEME     a scheme with mixed_precision (a file or a shipped name)\n"
          "  -d, --data DUMP         the KV dump (a regular safetensors file)\n"
          "  -o, --output TABLE      the table to write (replaced atomically)\n"
          "  -c, --chunks A[:N]      chunks A .. A + N - 1 of each layer (default: all; N absent:\n"
          "                          to the last); calibrate on chunks you do not evaluate on\n"
          "  -q, --quiet             no progress on stderr (shown only when stderr is a terminal)\n"
          "  -h, --help              this help\n"
          "Exit status: 0 done, 1 the calibration failed, 2 a usage error.\n",
          out);
}

int kvf_calibrate_parse_args(int argc, char **argv, kvf_calibrate_args *a, FILE *err) {
    static const struct option longs[] = {
        {"scheme", required_argument, NULL, 's'}, {"data", required_argument, NULL, 'd'},
        {"output", required_argument, NULL, 'o'}, {"chunks", required_argument, NULL, 'c'},
        {"quiet", no_argument, NULL, 'q'},        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    const char *prog = "kvforge calibrate";
    memset(a, 0, sizeof *a);
    int state = 0, c, chunks_given = 0;
    while ((c = kvf_cli_getopt(argc, argv, longs, prog, err, &state)) != -1) {
        const char **value = c == 's' ? &a->scheme : c == 'd' ? &a->data : c == 'o' ? &a->output : NULL;
        const struct option *l = longs;
        while (l->name && l->val != c) l++;
        if (value) {
            if (*value) return kvf_cli_twice(prog, l->name, err);
            if (!*optarg) {
                fprintf(err, "%s: option '--%s' needs a value, not an empty one\n", prog, l->name);
                return KVF_CLI_USAGE;
            }
            *value = optarg;
            continue;
        }
        switch (c) {
        case 'c': {
            if (chunks_given++) return kvf_cli_twice(prog, "chunks", err);
            char first[32];
            const char *colon = strchr(optarg, ':');
            const size_t n = colon ? (size_t)(colon - optarg) : strlen(optarg);
            long long f = -1, k = 0;
            if (n < sizeof first) {
                memcpy(first, optarg, n);
                first[n] = 0;
            }
            if (n >= sizeof first || !kvf_parse_int(first, 0, 1 << 20, &f) ||
                (colon && !kvf_parse_int(colon + 1, 1, 1 << 20, &k))) {
                fprintf(err, "%s: --chunks '%.200s': must be FIRST or FIRST:COUNT (FIRST >= 0, COUNT >= 1)\n",
                        prog, optarg);
                return KVF_CLI_USAGE;
            }
            a->first_chunk = (int)f;
            a->n_chunks = (int)k;
            break;
        }
        case 'q': a->quiet = 1; break;
        case 'h': a->help = 1; break;
        default: return KVF_CLI_USAGE; /* '?': said */
        }
    }
    if (a->help) return 0;
    if (optind < argc) return unexpected_argument(prog, argv[optind], err);
    if (!a->scheme || !a->data || !a->output) {
        fprintf(err, "%s: --%s is required\nTry '%s --help'.\n", prog,
                !a->scheme ? "scheme" : !a->data ? "data" : "output", prog);
        return KVF_CLI_USAGE;
    }
    return 0;
}
