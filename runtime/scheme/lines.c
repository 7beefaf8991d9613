/*
 * The line index. Lua tables keep no line numbers, so a small tokenizer over
 * the text Lua reads (load.c skips a byte-order mark and a '#' line first)
 * records the first line of every `name = ...` field path ("key.bits"), and
 * the line of the last top-level `return`: errors found in the returned table
 * name the line that set the field.
 */
#include "scheme_impl.h"

#include <stdlib.h>
#include <string.h>

#define LI_DEPTH 32 /* nested table constructors followed */

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
    kvf_sch_lines *li;
    char chain[LI_PATH]; /* lvalue being read: "a.b.c" */
    char pending[LI_PATH];
    bool has_pending;     /* the last token was `path =` */
    char bracket[LI_PATH];
    bool has_bracket;     /* read `[ "string"` */
    int depth;
    struct { char prefix[LI_PATH]; bool active; } frame[LI_DEPTH];
    int prev;
} recorder;

static void li_add(kvf_sch_lines *li, const char *path, int line) {
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

void kvf_sch_build_lines(const char *text, size_t len, kvf_sch_lines *li) {
    recorder *r = calloc(1, sizeof *r);
    lexer lx = {text, text + len, 1};
    token t;
    li->n = 0;
    li->return_line = 0;
    if (!r) return;
    r->li = li;
    r->prev = K_EOF;
    do {
        next_token(&lx, &t);
        rec_token(r, &t);
    } while (t.kind != K_EOF);
    free(r);
}

/* Line of a path, else of its parent table, else of the `return`, else 1. */
int kvf_sch_line_of(const kvf_sch_lines *li, const char *path) {
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
