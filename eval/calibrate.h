/* `kvforge calibrate`: the sensitivity table of calibrated mixed precision
 * from a KV dump (calibrate.c; docs/METHODS.md section 11). */
#ifndef KVF_EVAL_CALIBRATE_H
#define KVF_EVAL_CALIBRATE_H

#include "dump.h"
#include "kvforge.h"

/* Called after each (layer, chunk) measured: done of total. */
typedef void (*kvf_calibrate_progress)(void *arg, int done, int total);

/* Measure scheme s's error on chunks first_chunk .. first_chunk + n_chunks - 1
 * of every layer of the dump (n_chunks <= 0: to the last) on the CPU
 * reference, and write the table (JSON, docs/FORMAT.md) to out_path. */
int kvf_calibrate(const kvf_scheme *s, const kvf_dump *d, int first_chunk, int n_chunks, const char *out_path,
                  kvf_calibrate_progress progress, void *progress_arg);

#endif
