/*
 * Scheme loader. A scheme is a Lua 5.4 chunk that returns a table (see
 * docs/SCHEMES.md). Each file runs in its own sandboxed lua_State (memory cap,
 * instruction limit, a few safe libraries); the returned table is read with raw
 * access only, inside lua_pcall, into a C "patch" of set fields. A `base` is
 * loaded first and the patches are applied on top of each other, then the
 * merged configuration is checked as a whole and written as canonical text.
 *
 * Lines: Lua tables keep no line numbers, so a small tokenizer over the source
 * text records the first line of every `name = ...` field path ("key.bits").
 */
#include "internal.h"

#include <lauxlib.h>
#include <lua.h>
#include <lualib.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <xxhash.h>

#define SB_MEM_CAP (32u << 20)        /* bytes one scheme's Lua state may hold */
#define SB_INSN_LIMIT 5000000LL       /* VM instructions one scheme may run */
#define SB_INSN_STEP 100              /* count hook period */
#define SB_TIME_LIMIT 1.0             /* CPU seconds a load (a scheme and its bases) may take */
#define SB_MAX_FILE (1u << 20)        /* largest scheme file */
#define MAX_BASES 8                   /* `base` links in one chain */
#define MAX_CHAIN (MAX_BASES + 1)
#define NAME_MAX_LEN 48
#define PATH_LEN 512
#define THETA_MAX 1e12 /* describe() spells it out */

/* ================================================================ fields */

enum fkind { F_INT, F_I64, F_NUM, F_ENUM, F_NAME, F_BASE, F_SECTION, F_LATER, F_SECTIONS };

typedef struct fdesc {
    const char *name;
    int kind;                  /* enum fkind */
    size_t off;                /* in the section's struct (kvf_scheme for top) */
    int64_t lo, hi;            /* range (F_ENUM: from names); section index for F_SECTION */
    const int *set;            /* allowed values, 0-terminated, or NULL */
    const char *const *names;  /* enum spellings, NULL-terminated */
} fdesc;

static const int bits_set[] = {2, 4, 8, 16, 0};
static const int group_set[] = {16, 32, 64, 128, 256, 0};
static const int head_dim_set[] = {64, 128, 256, 0};
static const char *const axis_names[] = {"channel", "token", NULL};
static const char *const mode_names[] = {"affine", "symmetric", NULL};
static const char *const scale_names[] = {"fp16", "int8_fp16", NULL};
static const char *const placement_names[] = {"none", "pre", "post", NULL};
static const char *const layout_names[] = {"half", "interleaved", NULL};
static const char *const rotation_names[] = {"none", "hadamard", NULL};
static const char *const labels_names[] = {"final", "last_step", NULL};
static const char *const assign_names[] = {"fast", "exact", NULL};

enum { S_TOP, S_KEY, S_VALUE, S_ROPE, S_CHUNK, N_SECTIONS };
enum { TOP_NAME, TOP_BASE, TOP_HEAD_DIM, TOP_KEY, TOP_VALUE, TOP_ROPE, TOP_CHUNK, N_TOP = 11 };
enum { T_ASSIGN, T_AXIS, T_BITS, T_CENTROIDS, T_GROUP, T_ITERS, T_LABELS, T_MODE, T_PSAC, T_QSAC,
       T_ROTATION, T_SCALE, T_SEED, T_STAGES, N_TENSOR };
enum { R_LAYOUT, R_PLACEMENT, R_SECTIONS, R_THETA, N_ROPE };
enum { C_RECENT, C_SINK, C_SPAN, C_TOKENS, N_CHUNK };

#define SO(m) offsetof(struct kvf_scheme, m)
#define TO(m) offsetof(kvf_tensor_cfg, m)
/* Top level, in canonical order (base and the later options are not written). */
static const fdesc top_fields[N_TOP] = {
    {"name", F_NAME, SO(name), 1, NAME_MAX_LEN, NULL, NULL},
    {"base", F_BASE, 0, 1, NAME_MAX_LEN, NULL, NULL},
    {"head_dim", F_INT, SO(head_dim), 64, 256, head_dim_set, NULL},
    {"key", F_SECTION, SO(key), S_KEY, S_KEY, NULL, NULL},
    {"value", F_SECTION, SO(value), S_VALUE, S_VALUE, NULL, NULL},
    {"rope", F_SECTION, SO(rope), S_ROPE, S_ROPE, NULL, NULL},
    {"chunk", F_SECTION, SO(chunk), S_CHUNK, S_CHUNK, NULL, NULL},
    {"outliers", F_LATER, 0, 0, 0, NULL, NULL},
    {"anchors", F_LATER, 0, 0, 0, NULL, NULL},
    {"error_feedback", F_LATER, 0, 0, 0, NULL, NULL},
    {"mixed_precision", F_LATER, 0, 0, 0, NULL, NULL},
};
/* Nested sections: sorted by name (the canonical text relies on it). */
static const fdesc tensor_fields[N_TENSOR] = {
    {"assign", F_ENUM, TO(assign), 0, 0, NULL, assign_names},
    {"axis", F_ENUM, TO(axis), 0, 0, NULL, axis_names},
    {"bits", F_INT, TO(bits), 2, 16, bits_set, NULL},
    {"centroids", F_INT, TO(centroids), 0, 256, NULL, NULL},
    {"group_size", F_INT, TO(group_size), 16, 256, group_set, NULL},
    {"kmeans_iters", F_INT, TO(kmeans_iters), 0, 100, NULL, NULL},
    {"kmeans_labels", F_ENUM, TO(kmeans_labels), 0, 0, NULL, labels_names},
    {"mode", F_ENUM, TO(mode), 0, 0, NULL, mode_names},
    {"psac_rank", F_INT, TO(psac_rank), 0, KVF_MAX_PSAC_RANK, NULL, NULL},
    {"qsac_candidates", F_INT, TO(qsac_candidates), 1, 256, NULL, NULL},
    {"rotation", F_ENUM, TO(rotation), 0, 0, NULL, rotation_names},
    {"scale_format", F_ENUM, TO(scale_format), 0, 0, NULL, scale_names},
    {"seed", F_I64, TO(seed), 0, (int64_t)1 << 53, NULL, NULL},
    {"stages", F_INT, TO(stages), 1, 8, NULL, NULL},
};
static const fdesc rope_fields[N_ROPE] = {
    {"layout", F_ENUM, offsetof(kvf_rope_cfg, layout), 0, 0, NULL, layout_names},
    {"placement", F_ENUM, offsetof(kvf_rope_cfg, placement), 0, 0, NULL, placement_names},
    /* n_sections, then sections[]: an array of 1..KVF_MAX_ROPE_SECTIONS pair counts */
    {"sections", F_SECTIONS, offsetof(kvf_rope_cfg, n_sections), 1, 128, NULL, NULL},
    {"theta", F_NUM, offsetof(kvf_rope_cfg, theta), 0, 0, NULL, NULL},
};
static const fdesc chunk_fields[N_CHUNK] = {
    {"recent", F_INT, offsetof(kvf_chunk_cfg, recent), 0, 64, NULL, NULL},
    {"sink", F_INT, offsetof(kvf_chunk_cfg, sink), 0, 64, NULL, NULL},
    {"span", F_INT, offsetof(kvf_chunk_cfg, span), 1, 64, NULL, NULL},
    {"tokens", F_INT, offsetof(kvf_chunk_cfg, tokens), 1, 1048576, NULL, NULL},
};

typedef struct section {
    const char *name; /* "" for the top level */
    size_t off;       /* of the section inside struct kvf_scheme */
    const fdesc *f;
    int n, first;     /* fields; flat id of the first */
} section;

static const section sections[N_SECTIONS] = {
    {"", 0, top_fields, N_TOP, 0},
    {"key", SO(key), tensor_fields, N_TENSOR, N_TOP},
    {"value", SO(value), tensor_fields, N_TENSOR, N_TOP + N_TENSOR},
    {"rope", SO(rope), rope_fields, N_ROPE, N_TOP + 2 * N_TENSOR},
    {"chunk", SO(chunk), chunk_fields, N_CHUNK, N_TOP + 2 * N_TENSOR + N_ROPE},
};
#define NF (N_TOP + 2 * N_TENSOR + N_ROPE + N_CHUNK)
#define FID(sec, idx) (sections[sec].first + (idx))

static const fdesc *fid_desc(int fid, int *sec) {
    int s = N_SECTIONS - 1;
    while (sections[s].first > fid) s--;
    if (sec) *sec = s;
    return &sections[s].f[fid - sections[s].first];
}

static void fid_path(int fid, char *buf, size_t n) {
    int sec;
    const fdesc *d = fid_desc(fid, &sec);
    snprintf(buf, n, "%s%s%s", sections[sec].name, sec ? "." : "", d->name);
}

static void *field_ptr(const struct kvf_scheme *s, int fid) {
    int sec;
    const fdesc *d = fid_desc(fid, &sec);
    return (char *)s + sections[sec].off + d->off;
}

/* An F_SECTIONS field points at rope.n_sections; its values follow. */
static int *sections_of(void *n_sections) {
    return (int *)((char *)n_sections + offsetof(kvf_rope_cfg, sections) -
                   offsetof(kvf_rope_cfg, n_sections));
}

/* ============================================================ value checks */

static bool valid_name(const char *s, size_t len) {
    if (len < 1 || len > NAME_MAX_LEN) return false;
    for (size_t i = 0; i < len; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_'))
            return false;
    }
    return true;
}

static bool int_ok(const fdesc *d, int64_t v) {
    if (v < d->lo || v > d->hi) return false;
    if (!d->set) return true;
    for (const int *p = d->set; *p; p++)
        if (*p == v) return true;
    return false;
}

/* An enum value indexes its spellings: 0 .. (number of names - 1). */
static bool enum_ok(const fdesc *d, int64_t v) {
    int64_t n = 0;
    while (d->names[n]) n++;
    return v >= 0 && v < n;
}

static bool num_ok(double v) { return isfinite(v) && v > 0 && v <= THETA_MAX; }

/* "must be ..." for a field, without the value found. */
static void describe(const fdesc *d, char *buf, size_t n) {
    size_t k = 0;
    switch (d->kind) {
    case F_INT:
    case F_I64:
        if (!d->set) {
            snprintf(buf, n, "must be an integer in %lld..%lld", (long long)d->lo,
                     (long long)d->hi);
            return;
        }
        k = (size_t)snprintf(buf, n, "must be one of");
        for (const int *p = d->set; *p && k < n; p++)
            k += (size_t)snprintf(buf + k, n - k, "%s %d", p == d->set ? "" : ",", *p);
        return;
    case F_ENUM:
        k = (size_t)snprintf(buf, n, "must be one of");
        for (const char *const *p = d->names; *p && k < n; p++)
            k += (size_t)snprintf(buf + k, n - k, "%s \"%s\"", p == d->names ? "" : ",", *p);
        return;
    case F_NUM: snprintf(buf, n, "must be a finite number > 0 and <= 1e12"); return;
    case F_NAME:
    case F_BASE:
        snprintf(buf, n, "must be a string of 1..%d characters from [A-Za-z0-9_]", NAME_MAX_LEN);
        return;
    case F_SECTION: snprintf(buf, n, "must be a table"); return;
    case F_SECTIONS:
        snprintf(buf, n, "must be an array of 1..%d integers in %lld..%lld", KVF_MAX_ROPE_SECTIONS,
                 (long long)d->lo, (long long)d->hi);
        return;
    default: snprintf(buf, n, "not implemented yet (a later issue adds it)"); return;
    }
}

/* ============================================================= line index */

#define LI_MAX 256
#define LI_PATH 64
#define LI_DEPTH 32

typedef struct lineidx {
    struct { char path[LI_PATH]; int line; } e[LI_MAX];
    int n;
    int return_line; /* last `return` outside any table constructor */
} lineidx;

enum { K_EOF, K_NAME, K_KEYWORD, K_STRING, K_OTHER, K_LBRACE, K_RBRACE, K_ASSIGN, K_DOT,
       K_LBRACKET, K_RBRACKET };

typedef struct lexer {
    const char *p, *end;
    int line;
} lexer;

typedef struct token {
    int kind, line;
    const char *s; /* name or string contents */
    size_t len;
} token;

static bool is_nl(char c) { return c == '\n' || c == '\r'; }
static bool is_alpha(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}
static bool is_digit(char c) { return c >= '0' && c <= '9'; }

/* Skip one Lua newline (\n, \r, \r\n or \n\r). */
static void lx_newline(lexer *lx) {
    char c = *lx->p++;
    if (lx->p < lx->end && is_nl(*lx->p) && *lx->p != c) lx->p++;
    lx->line++;
}

/* At '[': level of a long bracket "[==[" or -1. */
static int long_level(const lexer *lx) {
    const char *q = lx->p + 1;
    int level = 0;
    while (q < lx->end && *q == '=') q++, level++;
    return (q < lx->end && *q == '[') ? level : -1;
}

/* Skip a long bracket of the given level starting at lx->p; contents out. */
static void skip_long(lexer *lx, int level, token *t) {
    lx->p += level + 2;
    if (t) t->s = lx->p;
    while (lx->p < lx->end) {
        if (*lx->p == ']') {
            const char *q = lx->p + 1;
            int l = 0;
            while (q < lx->end && *q == '=') q++, l++;
            if (l == level && q < lx->end && *q == ']') {
                if (t) t->len = (size_t)(lx->p - t->s);
                lx->p = q + 1;
                return;
            }
            lx->p++;
        } else if (is_nl(*lx->p)) {
            lx_newline(lx);
        } else {
            lx->p++;
        }
    }
    if (t) t->len = (size_t)(lx->p - t->s);
}

static void skip_space(lexer *lx) {
    while (lx->p < lx->end) {
        char c = *lx->p;
        if (is_nl(c)) {
            lx_newline(lx);
        } else if (c == ' ' || c == '\t' || c == '\f' || c == '\v') {
            lx->p++;
        } else if (c == '-' && lx->p + 1 < lx->end && lx->p[1] == '-') {
            lx->p += 2;
            int level = (lx->p < lx->end && *lx->p == '[') ? long_level(lx) : -1;
            if (level >= 0) {
                skip_long(lx, level, NULL);
            } else {
                while (lx->p < lx->end && !is_nl(*lx->p)) lx->p++;
            }
        } else {
            return;
        }
    }
}

static void lex_short_string(lexer *lx, token *t) {
    char q = *lx->p++;
    t->kind = K_STRING;
    t->s = lx->p;
    while (lx->p < lx->end && *lx->p != q) {
        if (*lx->p == '\\' && lx->p + 1 < lx->end) {
            lx->p++;
            if (is_nl(*lx->p)) lx_newline(lx); else lx->p++;
        } else if (is_nl(*lx->p)) {
            lx_newline(lx); /* after \z, or an unfinished string: Lua reports it */
        } else {
            lx->p++;
        }
    }
    t->len = (size_t)(lx->p - t->s);
    if (lx->p < lx->end) lx->p++;
}

static bool is_keyword(const char *s, size_t len) {
    static const char *const kw[] = {"and", "break", "do", "else", "elseif", "end", "false",
                                     "for", "function", "goto", "if", "in", "local", "nil",
                                     "not", "or", "repeat", "return", "then", "true", "until",
                                     "while", NULL};
    for (const char *const *k = kw; *k; k++)
        if (strlen(*k) == len && !memcmp(*k, s, len)) return true;
    return false;
}

static void lex_number(lexer *lx) {
    while (lx->p < lx->end) {
        char c = *lx->p, prev = lx->p[-1];
        if (is_alpha(c) || is_digit(c) || c == '.' ||
            ((c == '+' || c == '-') && (prev == 'e' || prev == 'E' || prev == 'p' || prev == 'P')))
            lx->p++;
        else
            break;
    }
}

static void lex_punct(lexer *lx, token *t) {
    char c = *lx->p++;
    bool eq_next = lx->p < lx->end && *lx->p == '=';
    t->kind = K_OTHER;
    switch (c) {
    case '{': t->kind = K_LBRACE; break;
    case '}': t->kind = K_RBRACE; break;
    case ']': t->kind = K_RBRACKET; break;
    case '[': t->kind = K_LBRACKET; break;
    case '=':
        if (eq_next) lx->p++; else t->kind = K_ASSIGN;
        break;
    case '<': case '>': case '~':
        if (eq_next) lx->p++;
        break;
    case '.':
        if (lx->p < lx->end && *lx->p == '.') {
            while (lx->p < lx->end && *lx->p == '.') lx->p++;
        } else {
            t->kind = K_DOT;
        }
        break;
    default: break;
    }
}

static void next_token(lexer *lx, token *t) {
    skip_space(lx);
    t->line = lx->line;
    t->s = lx->p;
    t->len = 0;
    if (lx->p >= lx->end) { t->kind = K_EOF; return; }
    char c = *lx->p;
    if (is_alpha(c)) {
        while (lx->p < lx->end && (is_alpha(*lx->p) || is_digit(*lx->p))) lx->p++;
        t->len = (size_t)(lx->p - t->s);
        t->kind = is_keyword(t->s, t->len) ? K_KEYWORD : K_NAME;
    } else if (is_digit(c) || (c == '.' && lx->p + 1 < lx->end && is_digit(lx->p[1]))) {
        lx->p++;
        lex_number(lx);
        t->kind = K_OTHER;
    } else if (c == '"' || c == '\'') {
        lex_short_string(lx, t);
    } else if (c == '[' && long_level(lx) >= 0) {
        t->kind = K_STRING;
        skip_long(lx, long_level(lx), t);
    } else {
        lex_punct(lx, t);
    }
}

/* State of the field recorder over the token stream. */
typedef struct recorder {
    lineidx *li;
    char chain[LI_PATH]; /* lvalue being read: "a.b.c" */
    char pending[LI_PATH];
    bool has_pending;     /* the last token was `path =` */
    char bracket[LI_PATH];
    bool has_bracket;     /* read `[ "string"` */
    int depth;
    struct { char prefix[LI_PATH]; bool active; } frame[LI_DEPTH];
    int prev;
} recorder;

static void li_add(lineidx *li, const char *path, int line) {
    for (int i = 0; i < li->n; i++)
        if (!strcmp(li->e[i].path, path)) return;
    if (li->n == LI_MAX) return;
    snprintf(li->e[li->n].path, LI_PATH, "%s", path);
    li->e[li->n++].line = line;
}

static void chain_set(recorder *r, const char *s, size_t len) {
    if (len >= LI_PATH) len = LI_PATH - 1;
    memcpy(r->chain, s, len);
    r->chain[len] = 0;
}

static void chain_append(recorder *r, const token *t) {
    size_t k = strlen(r->chain);
    if (k + 1 + t->len >= LI_PATH) return;
    r->chain[k] = '.';
    memcpy(r->chain + k + 1, t->s, t->len);
    r->chain[k + 1 + t->len] = 0;
}

/* `chain =`: record the field path it names, if any. */
static void rec_assign(recorder *r, int line) {
    char path[LI_PATH];
    r->has_pending = false;
    if (!r->chain[0]) return;
    if (r->depth == 0) {
        const char *dot = strchr(r->chain, '.'); /* var.field.sub = ... */
        if (!dot) return;
        snprintf(path, sizeof path, "%s", dot + 1);
    } else {
        int top = r->depth - 1;
        if (top >= LI_DEPTH || !r->frame[top].active) return;
        const char *pre = r->frame[top].prefix;
        int k = snprintf(path, sizeof path, "%s%s%s", pre, *pre ? "." : "", r->chain);
        if (k < 0 || k >= (int)sizeof path) return;
    }
    li_add(r->li, path, line);
    memcpy(r->pending, path, sizeof path);
    r->has_pending = true;
}

static void rec_lbrace(recorder *r) {
    if (r->depth < LI_DEPTH) {
        bool named = r->prev == K_ASSIGN && r->has_pending;
        r->frame[r->depth].active = named || r->depth == 0;
        snprintf(r->frame[r->depth].prefix, LI_PATH, "%s", named ? r->pending : "");
    }
    r->depth++;
}

static void rec_token(recorder *r, const token *t) {
    bool keep_chain = false;
    switch (t->kind) {
    case K_NAME:
        if (r->prev == K_DOT && r->chain[0]) chain_append(r, t);
        else chain_set(r, t->s, t->len);
        keep_chain = true;
        break;
    case K_KEYWORD:
        if (r->depth == 0 && t->len == 6 && !memcmp(t->s, "return", 6))
            r->li->return_line = t->line;
        break;
    case K_DOT: keep_chain = true; break;
    case K_LBRACKET: r->has_bracket = false; break;
    case K_STRING:
        if (r->prev == K_LBRACKET && t->len < LI_PATH) {
            memcpy(r->bracket, t->s, t->len);
            r->bracket[t->len] = 0;
            r->has_bracket = true;
        }
        break;
    case K_RBRACKET:
        if (r->prev == K_STRING && r->has_bracket) {
            chain_set(r, r->bracket, strlen(r->bracket));
            keep_chain = true;
        }
        break;
    case K_ASSIGN: rec_assign(r, t->line); break;
    case K_LBRACE: rec_lbrace(r); break;
    case K_RBRACE: if (r->depth > 0) r->depth--; break;
    default: break;
    }
    if (!keep_chain) r->chain[0] = 0;
    if (t->kind != K_ASSIGN) r->has_pending = false; /* `=` only names the next token */
    r->prev = t->kind;
}

static void build_lineidx(const char *text, size_t len, lineidx *li) {
    recorder *r = calloc(1, sizeof *r);
    lexer lx = {text, text + len, 1};
    token t;
    li->n = 0;
    li->return_line = 0;
    if (!r) return;
    r->li = li;
    r->prev = K_EOF;
    if (len >= 1 && text[0] == '#') /* Lua skips a first line starting with '#' */
        while (lx.p < lx.end && !is_nl(*lx.p)) lx.p++;
    do {
        next_token(&lx, &t);
        rec_token(r, &t);
    } while (t.kind != K_EOF);
    free(r);
}

/* Line of a path, else of its parent table, else of the `return`, else 1. */
static int li_line(const lineidx *li, const char *path) {
    char p[LI_PATH];
    snprintf(p, sizeof p, "%s", path);
    for (;;) {
        for (int i = 0; i < li->n; i++)
            if (!strcmp(li->e[i].path, p)) return li->e[i].line;
        char *dot = strrchr(p, '.');
        if (!dot) break;
        *dot = 0;
    }
    return li->return_line > 0 ? li->return_line : 1;
}

/* ================================================================ sandbox */

enum { FATAL_NONE, FATAL_MEM, FATAL_INSN, FATAL_TIME };

typedef struct sandbox {
    size_t used;     /* bytes held by the Lua state */
    long long insns; /* instructions run (in steps of SB_INSN_STEP) */
    double deadline; /* sb_now() seconds: the load's time limit */
    int line;        /* last line the chunk ran (line hook) */
    int mem_line;    /* line when the allocator last refused */
    int fatal, fatal_line;
} sandbox;

/* Allocator with a cap; growth beyond it fails (Lua raises a memory error). */
static void *sb_alloc(void *ud, void *ptr, size_t osize, size_t nsize) {
    sandbox *sb = ud;
    size_t old = ptr ? osize : 0;
    if (nsize == 0) {
        free(ptr);
        sb->used -= old;
        return NULL;
    }
    if (nsize > old && nsize - old > SB_MEM_CAP - sb->used) {
        sb->mem_line = sb->line;
        return NULL;
    }
    void *p = realloc(ptr, nsize);
    if (p) sb->used = sb->used - old + nsize;
    return p;
}

static sandbox *sb_of(lua_State *L) {
    void *ud;
    lua_getallocf(L, &ud);
    return ud;
}

/* CPU time of the calling thread (the one the Lua state runs on): unlike the
 * wall clock, a loaded machine does not make a scheme fail. */
static double sb_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Whether a limit is hit (the first one hit is recorded, with its line). */
static bool sb_over(sandbox *sb) {
    if (!sb->fatal) {
        if (sb->insns > SB_INSN_LIMIT) sb->fatal = FATAL_INSN;
        else if (sb_now() > sb->deadline) sb->fatal = FATAL_TIME;
        if (sb->fatal) sb->fatal_line = sb->line;
    }
    return sb->fatal != FATAL_NONE;
}

static int sb_raise(lua_State *L, const sandbox *sb) {
    lua_pushstring(L, sb->fatal == FATAL_MEM    ? "memory limit exceeded"
                      : sb->fatal == FATAL_TIME ? "time limit exceeded"
                                                : "instruction limit exceeded");
    return lua_error(L);
}

/*
 * Line events track the current line; count events the instruction budget and
 * the clock. The clock catches what instructions do not measure: single
 * instructions and library calls whose work grows with a string or a table
 * (comparing or concatenating long strings, table.insert into a long array),
 * up to the 32 MiB a scheme may hold. Once a limit is hit every later hook
 * raises again, so nothing more runs.
 */
static void sb_hook(lua_State *L, lua_Debug *ar) {
    sandbox *sb = sb_of(L);
    if (ar->event == LUA_HOOKLINE) {
        sb->line = ar->currentline;
        if (sb->fatal) sb_raise(L, sb);
        return;
    }
    sb->insns += SB_INSN_STEP;
    if (sb_over(sb)) sb_raise(L, sb);
}

/*
 * Every library function is called through a guard that checks the limits
 * first: a loop of calls that each work long inside C (where no hook fires)
 * stops at the next call. The original function runs in the guard's own frame
 * (called directly, not through lua_call), so its messages are unchanged.
 */
static int sb_guard(lua_State *L) {
    sandbox *sb = sb_of(L);
    if (sb_over(sb)) return sb_raise(L, sb);
    return lua_tocfunction(L, lua_upvalueindex(1))(L);
}

/* string.rep of empty pieces loops n times in C without allocating anything:
 * string.rep("", math.maxinteger) would never return. The result is "". */
static int sb_rep(lua_State *L) {
    size_t len, seplen;
    luaL_checklstring(L, 1, &len);
    lua_Integer n = luaL_checkinteger(L, 2);
    luaL_optlstring(L, 3, "", &seplen);
    if (n > 0 && len == 0 && seplen == 0) {
        lua_pushliteral(L, "");
        return 1;
    }
    return sb_guard(L);
}

/* The table functions read the length with __len and the elements with
 * lua_geti/lua_seti: with a __len of math.maxinteger, table.insert(t, 1, x)
 * loops for ever inside C. They take plain tables only. */
static int sb_table_guard(lua_State *L) {
    if (lua_type(L, 1) == LUA_TTABLE && lua_getmetatable(L, 1))
        return luaL_error(L,
                          "%s: a table with a metatable is not allowed in a scheme (its __len "
                          "would run the loop inside C, beyond the sandbox's limits)",
                          lua_tostring(L, lua_upvalueindex(2)));
    return sb_guard(L);
}

/* Put the guard in front of every C function of the table at idx, except
 * those with upvalues (the sandbox's own setmetatable). */
static void guard_library(lua_State *L, int idx, const char *lib) {
    idx = lua_absindex(L, idx);
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        const char *name = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : NULL;
        if (name && lua_tocfunction(L, -1)) {
            if (lua_getupvalue(L, -1, 1)) {
                lua_pop(L, 1); /* a closure: left as it is */
            } else {
                bool table_fn = lib && !strcmp(lib, LUA_TABLIBNAME) && strcmp(name, "pack");
                lua_pushvalue(L, -2); /* key */
                lua_pushvalue(L, -2); /* the original function: upvalue 1 */
                if (table_fn) {
                    lua_pushfstring(L, "%s.%s", lib, name);
                    lua_pushcclosure(L, sb_table_guard, 2);
                } else {
                    bool rep = lib && !strcmp(lib, LUA_STRLIBNAME) && !strcmp(name, "rep");
                    lua_pushcclosure(L, rep ? sb_rep : sb_guard, 1);
                }
                lua_rawset(L, idx); /* an existing field: allowed during lua_next */
            }
        }
        lua_pop(L, 1);
    }
}

/* pcall/xpcall that cannot catch the sandbox limits (as lbaselib's finishpcall). */
static int finish_pcall(lua_State *L, int status, int extra) {
    sandbox *sb = sb_of(L);
    if (status == LUA_ERRMEM && !sb->fatal) {
        sb->fatal = FATAL_MEM;
        sb->fatal_line = sb->mem_line;
    }
    if (status != LUA_OK && sb->fatal) return lua_error(L);
    if (status == LUA_OK) return lua_gettop(L) - extra;
    lua_pushboolean(L, 0);
    lua_pushvalue(L, -2);
    return 2;
}

static int sb_pcall(lua_State *L) {
    luaL_checkany(L, 1);
    lua_pushboolean(L, 1);
    lua_insert(L, 1);
    return finish_pcall(L, lua_pcall(L, lua_gettop(L) - 2, LUA_MULTRET, 0), 0);
}

static int sb_xpcall(lua_State *L) {
    int n = lua_gettop(L);
    luaL_checktype(L, 2, LUA_TFUNCTION);
    lua_pushboolean(L, 1);
    lua_pushvalue(L, 1);
    lua_rotate(L, 3, 2);
    return finish_pcall(L, lua_pcall(L, n - 2, LUA_MULTRET, 2), 2);
}

/* Finalizers run at lua_close with hooks off: no __gc, so none can loop. */
static int sb_setmetatable(lua_State *L) {
    if (lua_type(L, 2) == LUA_TTABLE) {
        lua_pushliteral(L, "__gc");
        int t = lua_rawget(L, 2);
        lua_pop(L, 1);
        if (t != LUA_TNIL) return luaL_error(L, "__gc metamethods are not allowed in a scheme");
    }
    lua_pushvalue(L, lua_upvalueindex(1));
    lua_insert(L, 1);
    lua_call(L, lua_gettop(L) - 1, 1);
    return 1;
}

static void drop_fields(lua_State *L, const char *table, const char *const *names) {
    if (table) lua_getfield(L, -1, table);
    for (; *names; names++) {
        lua_pushnil(L);
        lua_setfield(L, -2, *names);
    }
    if (table) lua_pop(L, 1);
}

/*
 * Libraries: base, string, table, math. Removed: everything that loads code,
 * prints or touches the GC; string.dump; the pattern functions and table.move
 * (they can run for hours inside C, where the instruction hook never fires);
 * math.random (schemes are deterministic).
 */
static int sb_setup(lua_State *L) {
    static const luaL_Reg libs[] = {{LUA_GNAME, luaopen_base},
                                    {LUA_STRLIBNAME, luaopen_string},
                                    {LUA_TABLIBNAME, luaopen_table},
                                    {LUA_MATHLIBNAME, luaopen_math},
                                    {NULL, NULL}};
    static const char *const g_drop[] = {"dofile", "loadfile", "load", "require",
                                         "collectgarbage", "print", "warn", NULL};
    static const char *const str_drop[] = {"dump", "find", "match", "gmatch", "gsub", NULL};
    static const char *const tab_drop[] = {"move", NULL};
    static const char *const math_drop[] = {"random", "randomseed", NULL};
    for (const luaL_Reg *l = libs; l->name; l++) {
        luaL_requiref(L, l->name, l->func, 1);
        lua_pop(L, 1);
    }
    lua_pushglobaltable(L);
    drop_fields(L, NULL, g_drop);
    drop_fields(L, LUA_STRLIBNAME, str_drop);
    drop_fields(L, LUA_TABLIBNAME, tab_drop);
    drop_fields(L, LUA_MATHLIBNAME, math_drop);
    lua_pushcfunction(L, sb_pcall);
    lua_setfield(L, -2, "pcall");
    lua_pushcfunction(L, sb_xpcall);
    lua_setfield(L, -2, "xpcall");
    lua_getfield(L, -1, "setmetatable");
    lua_pushcclosure(L, sb_setmetatable, 1);
    lua_setfield(L, -2, "setmetatable");
    guard_library(L, -1, NULL);
    static const char *const guarded[] = {LUA_STRLIBNAME, LUA_TABLIBNAME, LUA_MATHLIBNAME};
    for (int i = 0; i < 3; i++) {
        lua_getfield(L, -1, guarded[i]);
        guard_library(L, -1, guarded[i]);
        lua_pop(L, 1);
    }
    return 0;
}

/* ================================================================ reading */

typedef struct fval {
    bool set;
    int line;
    int64_t i; /* integers and enum indexes; the count of an array */
    double d;
    int arr[KVF_MAX_ROPE_SECTIONS]; /* F_SECTIONS values */
    char s[NAME_MAX_LEN + 1];
} fval;

/* One scheme file being read: its text, line index and the fields it sets. */
typedef struct unit {
    const char *text;
    size_t len;
    const char *chunkname; /* "@path" or "=name" */
    const char *display;   /* path or name used in messages */
    lineidx li;
    fval v[NF];
    bool failed;
    char err[1024];
} unit;

static void fmt_string(const char *s, size_t len, char *buf, size_t n) {
    size_t k = 0, max = len > 40 ? 40 : len;
    buf[k++] = '"';
    for (size_t i = 0; i < max && k + 6 < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') k += (size_t)snprintf(buf + k, n - k, "\\%c", c);
        else if (c < 32 || c >= 127) k += (size_t)snprintf(buf + k, n - k, "\\%u", c);
        else buf[k++] = (char)c;
    }
    snprintf(buf + k, n - k, "%s\"", len > max ? "..." : "");
}

/* The value at idx, as "(got ...)" shows it; reads it raw, calls nothing. */
static void fmt_got(lua_State *L, int idx, char *buf, size_t n) {
    size_t len;
    switch (lua_type(L, idx)) {
    case LUA_TSTRING: {
        const char *s = lua_tolstring(L, idx, &len);
        fmt_string(s, len, buf, n);
        break;
    }
    case LUA_TNUMBER:
        if (lua_isinteger(L, idx)) snprintf(buf, n, "%lld", (long long)lua_tointeger(L, idx));
        else if (isnan(lua_tonumber(L, idx))) snprintf(buf, n, "nan");
        else snprintf(buf, n, "%.14g", (double)lua_tonumber(L, idx));
        break;
    case LUA_TBOOLEAN: snprintf(buf, n, "%s", lua_toboolean(L, idx) ? "true" : "false"); break;
    default: snprintf(buf, n, "%s", luaL_typename(L, idx)); break;
    }
}

static bool rd_fail(unit *u, int line, const char *path, const char *what, lua_State *L,
                    int idx) {
    char got[128] = "";
    if (L) fmt_got(L, idx, got, sizeof got);
    snprintf(u->err, sizeof u->err, "%s:%d: %s: %s%s%s%s", u->display, line, path, what,
             L ? " (got " : "", got, L ? ")" : "");
    u->failed = true;
    return false;
}

static bool read_section(lua_State *L, unit *u, int sec, int idx);

static bool is_plain_table(lua_State *L, unit *u, int line, const char *path, int idx) {
    if (!lua_istable(L, idx)) return rd_fail(u, line, path, "must be a table", L, idx);
    if (lua_getmetatable(L, idx)) {
        lua_pop(L, 1);
        return rd_fail(u, line, path, "must be a plain table (it has a metatable)", NULL, 0);
    }
    return true;
}

/* Integers, and floats with an integral value (2^6 is a float in Lua 5.4). */
static bool read_int(lua_State *L, const fdesc *d, fval *v) {
    int ok = 0;
    lua_Integer x = 0;
    if (lua_type(L, -1) == LUA_TNUMBER) x = lua_tointegerx(L, -1, &ok);
    if (!ok || !int_ok(d, x)) return false;
    v->i = x;
    return true;
}

static bool read_enum(lua_State *L, const fdesc *d, fval *v) {
    if (lua_type(L, -1) != LUA_TSTRING) return false;
    const char *s = lua_tostring(L, -1);
    for (int i = 0; d->names[i]; i++)
        if (!strcmp(s, d->names[i])) { v->i = i; return true; }
    return false;
}

static bool read_name(lua_State *L, fval *v) {
    size_t len;
    if (lua_type(L, -1) != LUA_TSTRING) return false;
    const char *s = lua_tolstring(L, -1, &len);
    if (!valid_name(s, len)) return false;
    memcpy(v->s, s, len + 1);
    return true;
}

/* An array of 1..KVF_MAX_ROPE_SECTIONS integers in d's range (rope.sections):
 * a plain table whose keys are exactly 1..n. Raw reads only. */
static bool read_array(lua_State *L, const fdesc *d, fval *v) {
    int t = lua_gettop(L), n = 0, max_key = 0;
    if (!lua_istable(L, t) || lua_getmetatable(L, t)) {
        lua_settop(L, t);
        return false;
    }
    lua_pushnil(L);
    while (lua_next(L, t)) {
        int ok = 0;
        lua_Integer k = lua_type(L, -2) == LUA_TNUMBER ? lua_tointegerx(L, -2, &ok) : 0;
        fval e = {0};
        if (!ok || k < 1 || k > KVF_MAX_ROPE_SECTIONS || !read_int(L, d, &e)) {
            lua_settop(L, t);
            return false;
        }
        v->arr[k - 1] = (int)e.i;
        n++;
        if (k > max_key) max_key = (int)k;
        lua_pop(L, 1);
    }
    v->i = n;
    return n >= 1 && n == max_key; /* distinct keys in 1..n: no holes */
}

/* The value at the top of the stack, for field idx of section sec. */
static bool read_value(lua_State *L, unit *u, int sec, int idx, const char *path, int line) {
    const fdesc *d = &sections[sec].f[idx];
    fval *v = &u->v[FID(sec, idx)];
    char what[160];
    bool ok = false;
    describe(d, what, sizeof what);
    switch (d->kind) {
    case F_INT:
    case F_I64: ok = read_int(L, d, v); break;
    case F_NUM:
        ok = lua_type(L, -1) == LUA_TNUMBER && num_ok(lua_tonumber(L, -1));
        if (ok) v->d = lua_tonumber(L, -1);
        break;
    case F_ENUM: ok = read_enum(L, d, v); break;
    case F_SECTIONS: ok = read_array(L, d, v); break;
    case F_NAME:
    case F_BASE: ok = read_name(L, v); break;
    case F_SECTION:
        if (!is_plain_table(L, u, line, path, lua_gettop(L))) return false;
        return read_section(L, u, (int)d->lo, lua_gettop(L));
    case F_LATER:
        if (lua_isnil(L, -1) || (lua_isboolean(L, -1) && !lua_toboolean(L, -1))) return true;
        return rd_fail(u, line, path, what, NULL, 0);
    }
    if (!ok) return rd_fail(u, line, path, what, L, -1);
    v->set = true;
    v->line = line;
    return true;
}

static int find_field(const section *S, const char *k) {
    for (int i = 0; i < S->n; i++)
        if (!strcmp(S->f[i].name, k)) return i;
    return -1;
}

/* Entry (key at -2, value at -1) of section sec. */
static bool read_entry(lua_State *L, unit *u, int sec) {
    const section *S = &sections[sec];
    const char *sep = sec ? "." : "";
    char path[LI_PATH + 64], key[96];
    size_t len;
    if (lua_type(L, -2) != LUA_TSTRING) {
        fmt_got(L, -2, key, sizeof key);
        snprintf(path, sizeof path, "%s[%s]", S->name, key);
        return rd_fail(u, li_line(&u->li, sec ? S->name : ""), path,
                       "unknown field (field names are strings)", NULL, 0);
    }
    const char *k = lua_tolstring(L, -2, &len);
    bool ident = valid_name(k, len); /* also rules out embedded NULs */
    int idx = ident ? find_field(S, k) : -1;
    if (ident) {
        snprintf(path, sizeof path, "%s%s%s", S->name, sep, k);
    } else {
        fmt_string(k, len, key, sizeof key);
        snprintf(path, sizeof path, "%s[%s]", S->name, key);
    }
    int line = li_line(&u->li, ident ? path : S->name);
    if (idx < 0) return rd_fail(u, line, path, "unknown field", NULL, 0);
    return read_value(L, u, sec, idx, path, line);
}

static bool read_section(lua_State *L, unit *u, int sec, int idx) {
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        if (!read_entry(L, u, sec)) {
            lua_pop(L, 2);
            return false;
        }
        lua_pop(L, 1);
    }
    return true;
}

/* lua_pcall'ed: (unit lightuserdata, returned value). Raw reads only. */
static int read_main(lua_State *L) {
    unit *u = lua_touserdata(L, 1);
    int line = u->li.return_line > 0 ? u->li.return_line : 1;
    if (is_plain_table(L, u, line, "return value", 2)) read_section(L, u, S_TOP, 2);
    return 0;
}

/* Lua's own short name of a chunk (luaO_chunkid), for '@' and '=' names. */
static void chunk_id(const char *src, char *out) {
    size_t len = strlen(src);
    if (len <= LUA_IDSIZE) {
        memcpy(out, src + 1, len);
    } else if (*src == '=') {
        memcpy(out, src + 1, LUA_IDSIZE - 1);
        out[LUA_IDSIZE - 1] = 0;
    } else {
        memcpy(out, "...", 3);
        memcpy(out + 3, src + 1 + len - (LUA_IDSIZE - 3), LUA_IDSIZE - 3);
    }
}

/* Lua's message with the full file name, always "file:line: ...". */
static int lua_message(lua_State *L, const sandbox *sb, const unit *u) {
    char id[LUA_IDSIZE];
    const char *msg = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
    size_t dl = strlen(u->display), il;
    int line = sb->line > 0 ? sb->line : 1;
    if (!msg)
        return kvf_set_error(KVF_ESCHEME, "%s:%d: error object is a %s value", u->display, line,
                             luaL_typename(L, -1));
    chunk_id(u->chunkname, id);
    il = strlen(id);
    if (!strncmp(msg, id, il) && msg[il] == ':')
        return kvf_set_error(KVF_ESCHEME, "%s%s", u->display, msg + il);
    if (!strncmp(msg, u->display, dl) && msg[dl] == ':')
        return kvf_set_error(KVF_ESCHEME, "%s", msg);
    return kvf_set_error(KVF_ESCHEME, "%s:%d: %s", u->display, line, msg);
}

static int lua_failure(lua_State *L, sandbox *sb, const unit *u, int status) {
    if (status == LUA_ERRMEM && !sb->fatal) {
        sb->fatal = FATAL_MEM;
        sb->fatal_line = sb->mem_line;
    }
    int line = sb->fatal_line > 0 ? sb->fatal_line : 1;
    if (sb->fatal == FATAL_MEM)
        return kvf_set_error(KVF_ESCHEME, "%s:%d: memory limit exceeded (a scheme may use %u MiB)",
                             u->display, line, SB_MEM_CAP >> 20);
    if (sb->fatal == FATAL_INSN)
        return kvf_set_error(KVF_ESCHEME,
                             "%s:%d: instruction limit exceeded (a scheme may run %lld Lua "
                             "instructions; an endless loop?)",
                             u->display, line, SB_INSN_LIMIT);
    if (sb->fatal == FATAL_TIME)
        return kvf_set_error(KVF_ESCHEME,
                             "%s:%d: time limit exceeded (a scheme and its bases may take %g s "
                             "of CPU time; a loop over long strings or tables?)",
                             u->display, line, SB_TIME_LIMIT);
    return lua_message(L, sb, u);
}

static int run_in(lua_State *L, sandbox *sb, unit *u) {
    lua_pushcfunction(L, sb_setup);
    if (lua_pcall(L, 0, 0, 0) != LUA_OK)
        return kvf_set_error(KVF_ENOMEM, "%s: cannot set up the Lua sandbox", u->display);
    lua_sethook(L, sb_hook, LUA_MASKLINE | LUA_MASKCOUNT, SB_INSN_STEP);
    int st = luaL_loadbufferx(L, u->text, u->len, u->chunkname, "t");
    if (st == LUA_OK) st = lua_pcall(L, 0, 1, 0);
    if (st != LUA_OK) return lua_failure(L, sb, u, st);
    lua_pushcfunction(L, read_main);
    lua_pushlightuserdata(L, u);
    lua_rotate(L, -3, 2); /* read_main, u, returned value */
    st = lua_pcall(L, 2, 0, 0);
    if (st != LUA_OK) return lua_failure(L, sb, u, st);
    return u->failed ? kvf_set_error(KVF_ESCHEME, "%s", u->err) : KVF_OK;
}

/* Run one scheme file in a fresh sandbox and read the fields it sets. */
static int run_unit(unit *u, double deadline) {
    sandbox sb = {0};
    sb.deadline = deadline;
    lua_State *L = lua_newstate(sb_alloc, &sb);
    if (!L) return kvf_set_error(KVF_ENOMEM, "%s: cannot create a Lua state", u->display);
    int rc = run_in(L, &sb, u);
    lua_close(L);
    return rc;
}

/* ================================================================ loading */

/* Where a scheme's text comes from. */
typedef struct source {
    char *text;
    size_t len;
    bool owned;
    bool has_dir;            /* a file: `base` looks beside it first */
    char dir[PATH_LEN];      /* "" (the current directory) or ending in '/' */
    char chunkname[PATH_LEN + 1];
    char display[PATH_LEN];  /* in messages and kvf_scheme.source */
    char ident[PATH_LEN];    /* for cycle detection */
    char default_name[PATH_LEN];
} source;

typedef struct origin {
    int file; /* index in loader.files; -1 = default */
    int line;
} origin;

/* A chain of schemes being merged into s, top file first in files[]. */
typedef struct loader {
    struct kvf_scheme *s;
    int nfiles;
    char files[MAX_CHAIN][PATH_LEN];
    char ident[MAX_CHAIN][PATH_LEN];
    int return_line[MAX_CHAIN];
    origin org[NF];
    double deadline; /* of the whole chain (sb_now() clock) */
} loader;

static int read_file(const char *path, source *src) {
    FILE *f = fopen(path, "rb");
    if (!f) return kvf_set_error(KVF_EIO, "cannot open %s: %s", path, strerror(errno));
    src->text = malloc(SB_MAX_FILE + 1);
    src->owned = true;
    src->len = src->text ? fread(src->text, 1, SB_MAX_FILE + 1, f) : 0;
    int err = ferror(f);
    fclose(f);
    if (!src->text) return kvf_set_error(KVF_ENOMEM, "%s: out of memory", path);
    if (err) return kvf_set_error(KVF_EIO, "cannot read %s", path);
    if (src->len > SB_MAX_FILE)
        return kvf_set_error(KVF_ESCHEME, "%s:1: file too large (a scheme has at most %u KiB)",
                             path, SB_MAX_FILE >> 10);
    src->text[src->len] = 0;
    return KVF_OK;
}

static void name_from_path(const char *path, char *out, size_t n) {
    const char *b = strrchr(path, '/');
    b = b ? b + 1 : path;
    size_t len = strlen(b);
    if (len > 4 && !strcmp(b + len - 4, ".lua")) len -= 4;
    if (len >= n) len = n - 1;
    memcpy(out, b, len);
    out[len] = 0;
}

static int source_from_file(const char *path, source *src) {
    if (strlen(path) >= PATH_LEN)
        return kvf_set_error(KVF_EINVAL, "scheme path too long (%zu bytes)", strlen(path));
    int rc = read_file(path, src);
    if (rc) return rc;
    const char *slash = strrchr(path, '/');
    size_t dl = slash ? (size_t)(slash - path) + 1 : 0;
    src->has_dir = true;
    memcpy(src->dir, path, dl);
    src->dir[dl] = 0;
    snprintf(src->chunkname, sizeof src->chunkname, "@%s", path);
    snprintf(src->display, sizeof src->display, "%s", path);
    if (!realpath(path, src->ident)) snprintf(src->ident, sizeof src->ident, "%s", path);
    name_from_path(path, src->default_name, sizeof src->default_name);
    return KVF_OK;
}

static bool source_builtin(const char *name, source *src) {
    char file[NAME_MAX_LEN + 8];
    snprintf(file, sizeof file, "%s.lua", name);
    const kvf_embedded_file *f = kvf_find_embedded(kvf_embedded_schemes, file);
    if (!f) return false;
    src->text = (char *)f->data;
    src->len = f->size;
    snprintf(src->chunkname, sizeof src->chunkname, "@<builtin>/%s", file);
    snprintf(src->display, sizeof src->display, "<builtin>/%s", file);
    snprintf(src->ident, sizeof src->ident, "<builtin>/%s", file);
    snprintf(src->default_name, sizeof src->default_name, "%s", name);
    return true;
}

static void source_release(source *src) {
    if (src && src->owned) free(src->text);
    free(src);
}

static int load_chain(loader *ld, const source *src, int depth);

/* DIR/NAME.lua beside the child, else the shipped NAME.lua. */
static int resolve_base(const source *child, const char *name, int line, source *bs) {
    char path[PATH_LEN + NAME_MAX_LEN + 8] = "";
    if (child->has_dir) {
        snprintf(path, sizeof path, "%s%s.lua", child->dir, name);
        FILE *f = fopen(path, "rb");
        if (f) {
            fclose(f);
            return source_from_file(path, bs);
        }
    }
    if (source_builtin(name, bs)) return KVF_OK;
    return kvf_set_error(KVF_ESCHEME,
                         "%s:%d: base: no scheme named \"%s\" (looked for %s%sthe shipped "
                         "schemes) (got \"%s\")",
                         child->display, line, name, path, *path ? " and " : "", name);
}

static int cycle_error(const loader *ld, const source *child, const fval *b, const source *bs) {
    char chain[2048];
    size_t k = 0;
    for (int i = 0; i < ld->nfiles && k < sizeof chain; i++)
        k += (size_t)snprintf(chain + k, sizeof chain - k, "%s -> ", ld->files[i]);
    if (k < sizeof chain) snprintf(chain + k, sizeof chain - k, "%s", bs->display);
    return kvf_set_error(KVF_ESCHEME, "%s:%d: base: cycle: %s (got \"%s\")", child->display,
                         b->line, chain, b->s);
}

static int load_base(loader *ld, const source *child, const fval *b, int depth) {
    if (depth >= MAX_BASES)
        return kvf_set_error(KVF_ESCHEME,
                             "%s:%d: base: chain of bases deeper than %d (got \"%s\")",
                             child->display, b->line, MAX_BASES, b->s);
    source *bs = calloc(1, sizeof *bs);
    if (!bs) return kvf_set_error(KVF_ENOMEM, "out of memory");
    int rc = resolve_base(child, b->s, b->line, bs);
    for (int i = 0; !rc && i < ld->nfiles; i++)
        if (!strcmp(ld->ident[i], bs->ident)) rc = cycle_error(ld, child, b, bs);
    if (!rc) rc = load_chain(ld, bs, depth + 1);
    source_release(bs);
    return rc;
}

/* Write the fields a file sets over what its bases gave. */
static void apply(loader *ld, const unit *u, int file, int depth) {
    for (int fid = 0; fid < NF; fid++) {
        const fval *v = &u->v[fid];
        const fdesc *d = fid_desc(fid, NULL);
        void *p = field_ptr(ld->s, fid);
        if (!v->set || (d->kind == F_NAME && depth > 0)) continue;
        switch (d->kind) {
        case F_INT:
        case F_ENUM: *(int *)p = (int)v->i; break;
        case F_I64: *(int64_t *)p = v->i; break;
        case F_NUM: *(double *)p = v->d; break;
        case F_NAME: snprintf(ld->s->name, sizeof ld->s->name, "%s", v->s); break;
        case F_SECTIONS:
            *(int *)p = (int)v->i;
            memcpy(sections_of(p), v->arr, sizeof v->arr);
            break;
        default: continue;
        }
        ld->org[fid].file = file;
        ld->org[fid].line = v->line;
    }
}

static int load_chain(loader *ld, const source *src, int depth) {
    int file = ld->nfiles++;
    unit *u = calloc(1, sizeof *u);
    if (!u) return kvf_set_error(KVF_ENOMEM, "out of memory");
    snprintf(ld->files[file], PATH_LEN, "%s", src->display);
    snprintf(ld->ident[file], PATH_LEN, "%s", src->ident);
    u->text = src->text;
    u->len = src->len;
    u->chunkname = src->chunkname;
    u->display = src->display;
    build_lineidx(src->text, src->len, &u->li);
    ld->return_line[file] = u->li.return_line > 0 ? u->li.return_line : 1;
    int rc = run_unit(u, ld->deadline);
    if (!rc && u->v[TOP_BASE].set) rc = load_base(ld, src, &u->v[TOP_BASE], depth);
    else if (!rc) kvf_scheme_defaults(ld->s);
    if (!rc) apply(ld, u, file, depth);
    free(u);
    return rc;
}

/* ================================================================ checks */

/* "file:line" of the setting that gave a field its value. */
static void locate(const loader *ld, const struct kvf_scheme *s, int fid, char *buf, size_t n) {
    if (!ld) {
        snprintf(buf, n, "%s", s->source[0] ? s->source : s->name[0] ? s->name : "scheme");
    } else if (ld->org[fid].file < 0) {
        snprintf(buf, n, "%s:%d", ld->files[0], ld->return_line[0]);
    } else {
        snprintf(buf, n, "%s:%d", ld->files[ld->org[fid].file], ld->org[fid].line);
    }
}

static int bad(const loader *ld, const struct kvf_scheme *s, int fid, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static int bad(const loader *ld, const struct kvf_scheme *s, int fid, const char *fmt, ...) {
    char where[PATH_LEN + 16], path[LI_PATH], what[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    locate(ld, s, fid, where, sizeof where);
    fid_path(fid, path, sizeof path);
    return kvf_set_error(KVF_ESCHEME, "%s: %s: %s", where, path, what);
}

/* Two fields in conflict: the error names the one set nearest the top file
 * (the file that brought the conflict in, e.g. over a base that set the
 * other; a default counts as farthest) with its message, a if a tie. */
static int conflict(const loader *ld, const struct kvf_scheme *s, int a, const char *msg_a, int b,
                    const char *msg_b) {
    const bool blame_b = ld && ld->org[b].file >= 0 && (ld->org[a].file < 0 || ld->org[b].file < ld->org[a].file);
    return blame_b ? bad(ld, s, b, "%s", msg_b) : bad(ld, s, a, "%s", msg_a);
}

/* Every field in its range (for schemes filled in by code). */
static int check_ranges(const struct kvf_scheme *s, const loader *ld) {
    char what[160];
    for (int fid = 0; fid < NF; fid++) {
        const fdesc *d = fid_desc(fid, NULL);
        const void *p = field_ptr(s, fid);
        int64_t i = d->kind == F_I64 ? *(const int64_t *)p : 0;
        double x = d->kind == F_NUM ? *(const double *)p : 0;
        bool ok = true;
        if (d->kind == F_INT || d->kind == F_ENUM) i = *(const int *)p;
        if (d->kind == F_INT || d->kind == F_I64) ok = int_ok(d, i);
        if (d->kind == F_ENUM) ok = enum_ok(d, i);
        if (d->kind == F_NUM) ok = num_ok(x);
        if (d->kind == F_NAME) ok = valid_name(s->name, strlen(s->name));
        if (d->kind == F_SECTIONS) {
            const int *n = p, *a = sections_of((void *)p);
            ok = *n >= 1 && *n <= KVF_MAX_ROPE_SECTIONS;
            for (int k = 0; ok && k < *n; k++) ok = a[k] >= d->lo && a[k] <= d->hi;
            if (!ok) {
                describe(d, what, sizeof what);
                return bad(ld, s, fid, "%s (got %d values)", what, *n);
            }
        }
        if (ok) continue;
        describe(d, what, sizeof what);
        if (d->kind == F_NUM) return bad(ld, s, fid, "%s (got %g)", what, x);
        if (d->kind == F_NAME) return bad(ld, s, fid, "%s (got \"%.60s\")", what, s->name);
        return bad(ld, s, fid, "%s (got %lld)", what, (long long)i);
    }
    return KVF_OK;
}

/* Defaults that depend on other fields, filled once the chain is merged: an
 * absent rope.sections is one section of head_dim / 2 pairs (1D RoPE). */
static void fill_derived(struct kvf_scheme *s) {
    if (s->rope.n_sections == 0) {
        memset(s->rope.sections, 0, sizeof s->rope.sections);
        s->rope.n_sections = 1;
        s->rope.sections[0] = s->head_dim / 2;
    }
}

/* The field id of a path such as "key.psac_rank" (the plan's rules name
 * fields by path); -1 if none. */
static int fid_of_path(const char *path) {
    char p[LI_PATH];
    for (int fid = 0; fid < NF; fid++) {
        fid_path(fid, p, sizeof p);
        if (!strcmp(p, path)) return fid;
    }
    return -1;
}

typedef struct blame_arg {
    const loader *ld;
    const struct kvf_scheme *s;
} blame_arg;

/* kvf_plan_build's reports, located at the file and line that set the field
 * (of two tied fields, the one set nearest the top file: conflict()). */
static int blame_report(void *arg, const char *field, const char *msg, const char *other, const char *other_msg) {
    const blame_arg *b = arg;
    const int a = fid_of_path(field), o = other ? fid_of_path(other) : -1;
    if (a < 0) return kvf_set_error(KVF_ESCHEME, "%s: %s", field, msg);
    if (o < 0) return bad(b->ld, b->s, a, "%s", msg);
    return conflict(b->ld, b->s, a, msg, o, other_msg);
}

/* Ranges field by field, then every rule between fields (the plan's). */
static int check_scheme(struct kvf_scheme *s, const loader *ld) {
    int rc = check_ranges(s, ld);
    if (rc) return rc;
    blame_arg arg = {ld, s};
    const kvf_plan_blame blame = {blame_report, &arg};
    return kvf_plan_build(s, &blame, &s->plan);
}

/* ========================================================= canonical text */

typedef struct text {
    char b[4096];
    size_t n;
} text;

static void put(text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void put(text *t, const char *fmt, ...) {
    va_list ap;
    if (t->n >= sizeof t->b) return;
    va_start(ap, fmt);
    int k = vsnprintf(t->b + t->n, sizeof t->b - t->n, fmt, ap);
    va_end(ap);
    t->n = k < 0 ? sizeof t->b : t->n + (size_t)k;
}

/* Shortest %g form that reads back to the same double, always with a '.'. */
static void put_double(text *t, double x) {
    char buf[64];
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(buf, sizeof buf, "%.*g", prec, x);
        if (strtod(buf, NULL) == x) break;
    }
    for (char *c = buf; *c; c++)
        if (*c == ',') *c = '.'; /* a locale's decimal comma */
    put(t, "%s%s", buf, strpbrk(buf, ".eEni") ? "" : ".0");
}

static void put_value(text *t, const fdesc *d, const void *p) {
    switch (d->kind) {
    case F_INT: put(t, "%d", *(const int *)p); break;
    case F_I64: put(t, "%lld", (long long)*(const int64_t *)p); break;
    case F_ENUM: put(t, "\"%s\"", d->names[*(const int *)p]); break;
    case F_NUM: put_double(t, *(const double *)p); break;
    case F_NAME: put(t, "\"%s\"", (const char *)p); break;
    case F_SECTIONS: {
        const int *n = p, *a = sections_of((void *)p);
        put(t, "{");
        for (int k = 0; k < *n; k++) put(t, "%s%d", k ? ", " : " ", a[k]);
        put(t, " }");
        break;
    }
    default: break;
    }
}

static void put_section(text *t, const struct kvf_scheme *s, int sec) {
    const section *S = &sections[sec];
    put(t, "  %s = {", S->name);
    for (int i = 0; i < S->n; i++) {
        put(t, "%s%s = ", i ? ", " : " ", S->f[i].name);
        put_value(t, &S->f[i], field_ptr(s, FID(sec, i)));
    }
    put(t, " },\n");
}

/* Canonical text, hash and id of a checked scheme. */
static int build_canonical(struct kvf_scheme *s) {
    text *t = calloc(1, sizeof *t);
    if (!t) return kvf_set_error(KVF_ENOMEM, "out of memory");
    put(t, "return {\n");
    for (int i = 0; i < N_TOP; i++) {
        const fdesc *d = &top_fields[i];
        if (d->kind == F_SECTION) {
            put_section(t, s, (int)d->lo);
        } else if (d->kind != F_BASE && d->kind != F_LATER) {
            put(t, "  %s = ", d->name);
            put_value(t, d, field_ptr(s, FID(S_TOP, i)));
            put(t, ",\n");
        }
    }
    put(t, "}\n");
    int rc = t->n < sizeof s->canonical ? KVF_OK : kvf_set_error(KVF_EINVAL, "canonical text too long");
    if (!rc) {
        memcpy(s->canonical, t->b, t->n + 1);
        s->hash = XXH3_64bits(s->canonical, t->n);
        snprintf(s->id, sizeof s->id, "%s_%08x", s->name, (unsigned)(s->hash >> 32));
    }
    free(t);
    return rc;
}

/* ================================================================ public */

void kvf_scheme_defaults(struct kvf_scheme *s) {
    static const kvf_tensor_cfg tensor = {
        .bits = 2, .group_size = 64, .axis = KVF_AXIS_CHANNEL, .mode = KVF_MODE_AFFINE,
        .scale_format = KVF_SCALE_FP16, .centroids = 0, .kmeans_iters = 2, .kmeans_labels = KVF_LABELS_FINAL, .seed = 0,
        .qsac_candidates = 1, .psac_rank = 0, .stages = 1, .rotation = KVF_ROTATION_NONE,
        .assign = KVF_ASSIGN_FAST};
    memset(s, 0, sizeof *s);
    s->head_dim = 128;
    s->key = tensor;
    s->value = tensor;
    s->rope.placement = KVF_ROPE_NONE;
    s->rope.layout = KVF_ROPE_HALF;
    s->rope.theta = 10000.0;
    s->rope.n_sections = 0; /* absent: one section of head_dim / 2, filled by finalize */
    s->chunk.tokens = 4680;
    s->chunk.span = 1;
    s->chunk.recent = 0;
    s->chunk.sink = 0;
}

int kvf_scheme_finalize(struct kvf_scheme *s) {
    if (!s) return kvf_set_error(KVF_EINVAL, "kvf_scheme_finalize: scheme is NULL");
    if (!s->name[0]) snprintf(s->name, sizeof s->name, "scheme");
    fill_derived(s);
    int rc = check_scheme(s, NULL);
    return rc ? rc : build_canonical(s);
}

/* The top file names the scheme; bases never do. */
static int finish_top(loader *ld, const source *src) {
    struct kvf_scheme *s = ld->s;
    if (ld->org[FID(S_TOP, TOP_NAME)].file < 0) {
        size_t len = strlen(src->default_name);
        if (!valid_name(src->default_name, len))
            return kvf_set_error(KVF_ESCHEME,
                                 "%s:%d: name: not set, and the file name \"%.60s\" is not a "
                                 "valid name (1..%d characters from [A-Za-z0-9_]): set name",
                                 src->display, ld->return_line[0], src->default_name,
                                 NAME_MAX_LEN);
        memcpy(s->name, src->default_name, len + 1);
    }
    fill_derived(s);
    int rc = check_scheme(s, ld);
    if (rc) return rc;
    snprintf(s->source, sizeof s->source, "%s", src->display);
    return build_canonical(s);
}

static int load_top(const source *src, kvf_scheme **out) {
    loader *ld = calloc(1, sizeof *ld);
    struct kvf_scheme *s = calloc(1, sizeof *s);
    int rc = (ld && s) ? KVF_OK : kvf_set_error(KVF_ENOMEM, "out of memory");
    for (int i = 0; !rc && i < NF; i++) ld->org[i].file = -1;
    if (!rc) {
        ld->s = s;
        ld->deadline = sb_now() + SB_TIME_LIMIT;
        rc = load_chain(ld, src, 0);
    }
    if (!rc) rc = finish_top(ld, src);
    if (rc) kvf_scheme_free(s);
    else *out = s;
    free(ld);
    if (!rc) kvf_clear_error();
    return rc;
}

int kvf_scheme_load(const char *path, kvf_scheme **out) {
    if (out) *out = NULL;
    if (!path || !out) return kvf_set_error(KVF_EINVAL, "kvf_scheme_load: NULL argument");
    source *src = calloc(1, sizeof *src);
    if (!src) return kvf_set_error(KVF_ENOMEM, "out of memory");
    int rc = source_from_file(path, src);
    if (!rc) rc = load_top(src, out);
    source_release(src);
    return rc;
}

int kvf_scheme_load_string(const char *text, size_t len, const char *chunkname,
                           kvf_scheme **out) {
    if (out) *out = NULL;
    if (!text || !out) return kvf_set_error(KVF_EINVAL, "kvf_scheme_load_string: NULL argument");
    if (len > SB_MAX_FILE)
        return kvf_set_error(KVF_ESCHEME, "scheme text too large (at most %u KiB)",
                             SB_MAX_FILE >> 10);
    source *src = calloc(1, sizeof *src);
    if (!src) return kvf_set_error(KVF_ENOMEM, "out of memory");
    if (!chunkname || !*chunkname) chunkname = "=<string>";
    bool marked = *chunkname == '@' || *chunkname == '=';
    snprintf(src->chunkname, sizeof src->chunkname, "%s%s", marked ? "" : "=", chunkname);
    snprintf(src->display, sizeof src->display, "%s", src->chunkname + 1);
    snprintf(src->ident, sizeof src->ident, "<string>"); /* never a base */
    snprintf(src->default_name, sizeof src->default_name, "scheme");
    src->text = (char *)text;
    src->len = len;
    int rc = load_top(src, out);
    source_release(src);
    return rc;
}

int kvf_scheme_load_builtin(const char *name, kvf_scheme **out) {
    if (out) *out = NULL;
    if (!name || !out) return kvf_set_error(KVF_EINVAL, "kvf_scheme_load_builtin: NULL argument");
    source *src = calloc(1, sizeof *src);
    if (!src) return kvf_set_error(KVF_ENOMEM, "out of memory");
    int rc = KVF_OK;
    if (!valid_name(name, strlen(name)) || !source_builtin(name, src)) {
        char list[512] = "";
        size_t k = 0;
        for (const char *const *b = kvf_builtin_schemes(); *b && k < sizeof list; b++)
            k += (size_t)snprintf(list + k, sizeof list - k, "%s%s", k ? ", " : "", *b);
        rc = kvf_set_error(KVF_EINVAL, "no shipped scheme named \"%.64s\" (shipped: %s)", name,
                           list);
    }
    if (!rc) rc = load_top(src, out);
    source_release(src);
    return rc;
}

void kvf_scheme_free(kvf_scheme *s) { free(s); }

const char *kvf_scheme_name(const kvf_scheme *s) { return s ? s->name : NULL; }
const char *kvf_scheme_canonical(const kvf_scheme *s) { return s ? s->canonical : NULL; }
uint64_t kvf_scheme_hash(const kvf_scheme *s) { return s ? s->hash : 0; }
const char *kvf_scheme_id(const kvf_scheme *s) { return s ? s->id : NULL; }
int kvf_scheme_head_dim(const kvf_scheme *s) { return s ? s->head_dim : 0; }

#define MAX_BUILTIN 64
static char builtin_store[MAX_BUILTIN][NAME_MAX_LEN + 1];
static const char *builtin_names[MAX_BUILTIN + 1];
static pthread_once_t builtin_once = PTHREAD_ONCE_INIT;

static void builtin_init(void) {
    int n = 0;
    for (const kvf_embedded_file *f = kvf_embedded_schemes; f->name && n < MAX_BUILTIN; f++) {
        size_t len = strlen(f->name);
        if (len <= 4 || strcmp(f->name + len - 4, ".lua") || !valid_name(f->name, len - 4))
            continue;
        memcpy(builtin_store[n], f->name, len - 4);
        builtin_store[n][len - 4] = 0;
        builtin_names[n] = builtin_store[n];
        n++;
    }
    builtin_names[n] = NULL;
}

const char *const *kvf_builtin_schemes(void) {
    pthread_once(&builtin_once, builtin_init);
    return builtin_names;
}
