/*
 * The Lua sandbox. Each scheme file runs in its own lua_State: an allocator
 * with a cap, an instruction budget and a CPU-time limit (hooks, and a guard
 * in front of every library function), a few safe libraries, and pcall/xpcall
 * that cannot catch the limits. Then the returned table is read (read.c)
 * inside lua_pcall. Lua's own messages are rewritten to "file:line: ...".
 */
#include "scheme_impl.h"

#include <lauxlib.h>
#include <lualib.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define SB_MEM_CAP (32u << 20)        /* bytes one scheme's Lua state may hold */
#define SB_INSN_LIMIT 5000000LL       /* VM instructions one scheme may run */
#define SB_INSN_STEP 100              /* count hook period */

enum { FATAL_NONE, FATAL_MEM, FATAL_INSN, FATAL_TIME };

typedef struct sandbox {
    size_t used;     /* bytes held by the Lua state */
    long long insns; /* instructions run (in steps of SB_INSN_STEP) */
    double deadline; /* kvf_sch_now() seconds: the load's time limit */
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
double kvf_sch_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Whether a limit is hit (the first one hit is recorded, with its line). */
static bool sb_over(sandbox *sb) {
    if (!sb->fatal) {
        if (sb->insns > SB_INSN_LIMIT) sb->fatal = FATAL_INSN;
        else if (kvf_sch_now() > sb->deadline) sb->fatal = FATAL_TIME;
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

/* ================================================================ running */

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
static int lua_message(lua_State *L, const sandbox *sb, const kvf_sch_unit *u) {
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

static int lua_failure(lua_State *L, sandbox *sb, const kvf_sch_unit *u, int status) {
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

static int run_in(lua_State *L, sandbox *sb, kvf_sch_unit *u) {
    lua_pushcfunction(L, sb_setup);
    if (lua_pcall(L, 0, 0, 0) != LUA_OK)
        return kvf_set_error(KVF_ENOMEM, "%s: cannot set up the Lua sandbox", u->display);
    lua_sethook(L, sb_hook, LUA_MASKLINE | LUA_MASKCOUNT, SB_INSN_STEP);
    int st = luaL_loadbufferx(L, u->text, u->len, u->chunkname, "t");
    if (st == LUA_OK) st = lua_pcall(L, 0, 1, 0);
    if (st != LUA_OK) return lua_failure(L, sb, u, st);
    lua_pushcfunction(L, kvf_sch_read_table);
    lua_pushlightuserdata(L, u);
    lua_rotate(L, -3, 2); /* kvf_sch_read_table, u, returned value */
    st = lua_pcall(L, 2, 0, 0);
    if (st != LUA_OK) return lua_failure(L, sb, u, st);
    return u->failed ? kvf_set_error(KVF_ESCHEME, "%s", u->err) : KVF_OK;
}

int kvf_sch_run(kvf_sch_unit *u, double deadline) {
    sandbox sb = {0};
    sb.deadline = deadline;
    lua_State *L = lua_newstate(sb_alloc, &sb);
    if (!L) return kvf_set_error(KVF_ENOMEM, "%s: cannot create a Lua state", u->display);
    int rc = run_in(L, &sb, u);
    lua_close(L);
    return rc;
}
