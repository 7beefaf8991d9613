/*
 * Reading a scheme's returned table into a patch: the fields it sets, each
 * with its value and line (kvf_sch_unit.v), or the first error, as
 * "file:line: field: must be ... (got ...)". Raw access only (no metamethod
 * runs), inside lua_pcall.
 */
#include "scheme_impl.h"

#include <lauxlib.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

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

static bool rd_fail(kvf_sch_unit *u, int line, const char *path, const char *what, lua_State *L,
                    int idx) {
    char got[128] = "";
    if (L) fmt_got(L, idx, got, sizeof got);
    snprintf(u->err, sizeof u->err, "%s:%d: %s: %s%s%s%s", u->display, line, path, what,
             L ? " (got " : "", got, L ? ")" : "");
    u->failed = true;
    return false;
}

static bool read_section(lua_State *L, kvf_sch_unit *u, int sec, int idx);

static bool is_plain_table(lua_State *L, kvf_sch_unit *u, int line, const char *path, int idx) {
    if (!lua_istable(L, idx)) return rd_fail(u, line, path, "must be a table", L, idx);
    if (lua_getmetatable(L, idx)) {
        lua_pop(L, 1);
        return rd_fail(u, line, path, "must be a plain table (it has a metatable)", NULL, 0);
    }
    return true;
}

/* Integers, and floats with an integral value (2^6 is a float in Lua 5.4). */
static bool read_int(lua_State *L, const kvf_sch_field *d, kvf_sch_value *v) {
    int ok = 0;
    lua_Integer x = 0;
    if (lua_type(L, -1) == LUA_TNUMBER) x = lua_tointegerx(L, -1, &ok);
    if (!ok || !kvf_sch_int_ok(d, x)) return false;
    v->i = x;
    return true;
}

static bool read_enum(lua_State *L, const kvf_sch_field *d, kvf_sch_value *v) {
    if (lua_type(L, -1) != LUA_TSTRING) return false;
    const char *s = lua_tostring(L, -1);
    for (int i = 0; d->names[i]; i++)
        if (!strcmp(s, d->names[i])) { v->i = i; return true; }
    return false;
}

static bool read_name(lua_State *L, kvf_sch_value *v) {
    size_t len;
    if (lua_type(L, -1) != LUA_TSTRING) return false;
    const char *s = lua_tolstring(L, -1, &len);
    if (!kvf_sch_valid_name(s, len)) return false;
    memcpy(v->s, s, len + 1);
    return true;
}

/* An array of 1..KVF_MAX_ROPE_SECTIONS integers in d's range (rope.sections):
 * a plain table whose keys are exactly 1..n. Raw reads only. */
static bool read_array(lua_State *L, const kvf_sch_field *d, kvf_sch_value *v) {
    int t = lua_gettop(L), n = 0, max_key = 0;
    if (!lua_istable(L, t) || lua_getmetatable(L, t)) {
        lua_settop(L, t);
        return false;
    }
    lua_pushnil(L);
    while (lua_next(L, t)) {
        int ok = 0;
        lua_Integer k = lua_type(L, -2) == LUA_TNUMBER ? lua_tointegerx(L, -2, &ok) : 0;
        kvf_sch_value e = {0};
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
static bool read_value(lua_State *L, kvf_sch_unit *u, int sec, int idx, const char *path,
                       int line) {
    const kvf_sch_field *d = &kvf_sch_sections[sec].f[idx];
    kvf_sch_value *v = &u->v[FID(sec, idx)];
    char what[160];
    bool ok = false;
    kvf_sch_describe(d, what, sizeof what);
    switch (d->kind) {
    case F_INT:
    case F_I64: ok = read_int(L, d, v); break;
    case F_NUM:
        ok = lua_type(L, -1) == LUA_TNUMBER && kvf_sch_num_ok(lua_tonumber(L, -1));
        if (ok) v->d = lua_tonumber(L, -1);
        break;
    case F_FRAC:
        ok = lua_type(L, -1) == LUA_TNUMBER && kvf_sch_frac_ok(lua_tonumber(L, -1));
        if (ok) v->d = lua_tonumber(L, -1);
        break;
    case F_PATH: {
        size_t len = 0;
        const char *str = lua_type(L, -1) == LUA_TSTRING ? lua_tolstring(L, -1, &len) : NULL;
        ok = str && kvf_sch_path_ok(str, len);
        if (ok) memcpy(v->s, str, len + 1);
        break;
    }
    case F_ENUM: ok = read_enum(L, d, v); break;
    case F_SECTIONS: ok = read_array(L, d, v); break;
    case F_NAME:
    case F_BASE: ok = read_name(L, v); break;
    case F_SECTION:
        if (!is_plain_table(L, u, line, path, lua_gettop(L))) return false;
        return read_section(L, u, (int)d->lo, lua_gettop(L));
    }
    if (!ok) return rd_fail(u, line, path, what, L, -1);
    v->set = true;
    v->line = line;
    return true;
}

static int find_field(const kvf_sch_section *S, const char *k) {
    for (int i = 0; i < S->n; i++)
        if (!strcmp(S->f[i].name, k)) return i;
    return -1;
}

/* Entry (key at -2, value at -1) of section sec. */
static bool read_entry(lua_State *L, kvf_sch_unit *u, int sec) {
    const kvf_sch_section *S = &kvf_sch_sections[sec];
    const char *sep = sec ? "." : "";
    char path[LI_PATH + 64], key[96];
    size_t len;
    if (lua_type(L, -2) != LUA_TSTRING) {
        fmt_got(L, -2, key, sizeof key);
        snprintf(path, sizeof path, "%s[%s]", S->name, key);
        return rd_fail(u, kvf_sch_line_of(&u->li, sec ? S->name : ""), path,
                       "unknown field (field names are strings)", NULL, 0);
    }
    const char *k = lua_tolstring(L, -2, &len);
    bool ident = kvf_sch_valid_name(k, len); /* also rules out embedded NULs */
    int idx = ident ? find_field(S, k) : -1;
    if (ident) {
        snprintf(path, sizeof path, "%s%s%s", S->name, sep, k);
    } else {
        fmt_string(k, len, key, sizeof key);
        snprintf(path, sizeof path, "%s[%s]", S->name, key);
    }
    int line = kvf_sch_line_of(&u->li, ident ? path : S->name);
    if (idx < 0) return rd_fail(u, line, path, "unknown field", NULL, 0);
    return read_value(L, u, sec, idx, path, line);
}

static bool read_section(lua_State *L, kvf_sch_unit *u, int sec, int idx) {
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

int kvf_sch_read_table(lua_State *L) {
    kvf_sch_unit *u = lua_touserdata(L, 1);
    int line = u->li.return_line > 0 ? u->li.return_line : 1;
    if (is_plain_table(L, u, line, "return value", 2)) read_section(L, u, S_TOP, 2);
    return 0;
}
