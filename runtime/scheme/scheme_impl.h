/*
 * What the scheme loader's files share (runtime/scheme/ only). A scheme is a
 * Lua 5.4 chunk that returns a table (docs/SCHEMES.md):
 *
 *   fields.c   the field table, field access, value checks, defaults, canonical text
 *   lines.c    the line index: the first line of every `name = ...` field path
 *   sandbox.c  the Lua sandbox a scheme file runs in, and Lua's messages
 *   read.c     the returned table, read raw into a patch of set fields
 *   load.c     sources, `base` chains, located errors, the checks, the public API
 *
 * Nothing here is exported: the library is built with -fvisibility=hidden and
 * these functions are not KVF_API.
 */
#ifndef KVF_SCHEME_IMPL_H
#define KVF_SCHEME_IMPL_H

#include "internal.h"

#include <lua.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define NAME_MAX_LEN 48
#define SB_TIME_LIMIT 1.0 /* CPU seconds a load (a scheme and its bases) may take */

/* ---------------------------------------------------------------- fields */

/* F_FRAC: a number in [0, 1); F_PATH: a file path (a string of 1..511 bytes
 * without control characters). */
enum fkind { F_INT, F_I64, F_NUM, F_ENUM, F_NAME, F_BASE, F_SECTION, F_SECTIONS, F_FRAC, F_PATH };
#define PATH_FIELD_LEN 512

typedef struct kvf_sch_field {
    const char *name;
    int kind;                  /* enum fkind */
    size_t off;                /* in the section's struct (kvf_scheme for top) */
    int64_t lo, hi;            /* range (F_ENUM: from names); section index for F_SECTION */
    const int *set;            /* allowed values, 0-terminated, or NULL */
    const char *const *names;  /* enum spellings, NULL-terminated */
} kvf_sch_field;

enum { S_TOP, S_KEY, S_VALUE, S_ROPE, S_CHUNK, S_OUTLIERS, S_ANCHORS, S_FEEDBACK, S_MIXED, N_SECTIONS };
enum { TOP_NAME, TOP_BASE, TOP_HEAD_DIM, TOP_KEY, TOP_VALUE, TOP_ROPE, TOP_CHUNK, TOP_OUTLIERS, TOP_ANCHORS,
       TOP_FEEDBACK, TOP_MIXED, N_TOP };
enum { T_ASSIGN, T_AXIS, T_BITS, T_CENTROIDS, T_GROUP, T_ITERS, T_LABELS, T_MODE, T_PSAC, T_QSAC,
       T_ROTATION, T_SCALE, T_SEED, T_STAGES, N_TENSOR };
enum { R_LAYOUT, R_PLACEMENT, R_SECTIONS, R_THETA, N_ROPE };
enum { C_RECENT, C_SINK, C_SPAN, C_TOKENS, N_CHUNK };
/* The pipeline's sections (METHODS.md 11): optional, absent means off. */
enum { O_KEY, O_VALUE, N_OUTLIERS };
enum { A_BITS, A_EVERY, N_ANCHORS };
enum { E_DECAY, N_FEEDBACK };
enum { M_KEY_FRACTION, M_REFINE_BITS, M_TABLE, M_VALUE_FRACTION, N_MIXED };

typedef struct kvf_sch_section {
    const char *name; /* "" for the top level */
    size_t off;       /* of the section inside struct kvf_scheme */
    const kvf_sch_field *f;
    int n, first;     /* fields; flat id of the first */
    int optional;     /* a pipeline section: checked and written only when present */
} kvf_sch_section;

extern const kvf_sch_section kvf_sch_sections[N_SECTIONS];
/* Fields are numbered flat across the sections: a field id ("fid"). */
#define NF (N_TOP + 2 * N_TENSOR + N_ROPE + N_CHUNK + N_OUTLIERS + N_ANCHORS + N_FEEDBACK + N_MIXED)
#define FID(sec, idx) (kvf_sch_sections[sec].first + (idx))

const kvf_sch_field *kvf_sch_fid_desc(int fid, int *sec);
void kvf_sch_fid_path(int fid, char *buf, size_t n);
void *kvf_sch_field_ptr(const struct kvf_scheme *s, int fid);
int *kvf_sch_sections_of(void *n_sections);

bool kvf_sch_valid_name(const char *s, size_t len);
bool kvf_sch_int_ok(const kvf_sch_field *d, int64_t v);
bool kvf_sch_enum_ok(const kvf_sch_field *d, int64_t v);
bool kvf_sch_num_ok(double v);
bool kvf_sch_frac_ok(double v);
bool kvf_sch_path_ok(const char *s, size_t len);
/* Whether an optional section is there in a scheme filled in by code: a
 * field that turns it on is set (outliers, anchors.every, a decay, a
 * fraction or a table). The loader knows it by what the files set. */
bool kvf_sch_section_on(const struct kvf_scheme *s, int sec);
void kvf_sch_describe(const kvf_sch_field *d, char *buf, size_t n);

void kvf_sch_fill_derived(struct kvf_scheme *s);
int kvf_sch_canonical(struct kvf_scheme *s);

/* ------------------------------------------------------------ line index */

#define LI_MAX 256
#define LI_PATH 64

typedef struct kvf_sch_lines {
    struct { char path[LI_PATH]; int line; } e[LI_MAX];
    int n;
    int return_line; /* last `return` outside any table constructor */
} kvf_sch_lines;

void kvf_sch_build_lines(const char *text, size_t len, kvf_sch_lines *li);
int kvf_sch_line_of(const kvf_sch_lines *li, const char *path);

/* -------------------------------------------------------- running, reading */

typedef struct kvf_sch_value {
    bool set;
    int line;
    int64_t i; /* integers and enum indexes; the count of an array */
    double d;
    int arr[KVF_MAX_ROPE_SECTIONS]; /* F_SECTIONS values */
    char s[PATH_FIELD_LEN];
} kvf_sch_value;

/* One scheme file being read: its text, line index and the fields it sets. */
typedef struct kvf_sch_unit {
    const char *text;
    size_t len;
    const char *chunkname; /* "@path" or "=name" */
    const char *display;   /* path or name used in messages */
    kvf_sch_lines li;
    kvf_sch_value v[NF];
    bool failed;
    char err[1024];
} kvf_sch_unit;

/* CPU seconds of the calling thread: the clock of the load's time limit. */
double kvf_sch_now(void);
/* Run one scheme file in a fresh sandbox and read the fields it sets. */
int kvf_sch_run(kvf_sch_unit *u, double deadline);
/* lua_pcall'ed: (unit lightuserdata, returned value). Raw reads only. */
int kvf_sch_read_table(lua_State *L);

#endif
