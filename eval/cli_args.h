/*
 * Command-line options of `kvforge` (cli/kvforge.c): getopt_long with the
 * messages of a Unix tool, and the parser of `kvforge eval`, a function of
 * its own so that the fuzzer (fuzz/fuzz_dump.c) calls it with any argv.
 */
#ifndef KVF_EVAL_CLI_ARGS_H
#define KVF_EVAL_CLI_ARGS_H

#include <getopt.h>
#include <stdio.h>

/* Exit status of a usage error (unknown option, missing value, bad value). */
#define KVF_CLI_USAGE 2

/* getopt_long over argv[0..argc) (argv[0]: the command's name; argv is
 * permuted: operands end up after the options, from the returned optind)
 * with the short options of longs' entries whose val is a character and
 * glibc's own messages off. Returns the option's val, -1 after the last
 * option, or '?' after writing "PROG: unknown option '--x'", "option '-o'
 * needs a value" or "option '--json' takes no value" and a hint to err.
 * Call with *state = 0 before the first option of a parse (it resets getopt). */
int kvf_cli_getopt(int argc, char **argv, const struct option *longs, const char *prog, FILE *err, int *state);

/* "PROG: option '--NAME' given twice" and the hint, for a value option given
 * again; returns KVF_CLI_USAGE. */
int kvf_cli_twice(const char *prog, const char *name, FILE *err);

/* What `kvforge eval` was asked. */
typedef struct kvf_eval_args {
    const char *scheme, *peer, *data, *recon_out, *table; /* NULL when not given */
    int gpu, json, threads, warm, strict, quiet;
    int help; /* --help: print kvf_eval_usage to stdout, exit 0, nothing else done */
} kvf_eval_args;

/* Parse `kvforge eval`'s arguments (argv[0] "eval"; argv is permuted).
 * 0: *a holds them (exactly one of scheme and peer, and data, unless help);
 * KVF_CLI_USAGE: a usage error, said on err (every message names the option). */
int kvf_eval_parse_args(int argc, char **argv, kvf_eval_args *a, FILE *err);
void kvf_eval_usage(FILE *out);

typedef struct kvf_calibrate_args {
    const char *scheme, *data, *output; /* NULL when not given */
    int first_chunk, n_chunks;          /* --chunks A[:N]; n_chunks 0: to the last */
    int quiet, help;
} kvf_calibrate_args;

/* `kvforge calibrate`'s arguments, as kvf_eval_parse_args. */
int kvf_calibrate_parse_args(int argc, char **argv, kvf_calibrate_args *a, FILE *err);
void kvf_calibrate_usage(FILE *out);

#endif
