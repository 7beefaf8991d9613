# kvforge build. `make` builds the library, the CLI and the tests; `make setup`
# installs the Debian packages, `make test` builds
# and runs the cmocka suite, `make demo` runs the main job.
CUDA_HOME ?= /usr/local/cuda
O ?= out
CC ?= cc
PYTHON ?= python3
# The world-model scripts and tests run in the binding's virtual environment (PY, python/python.mk).
WM_PYTHON ?= $(PY)
# `make` alone builds the library, the CLI and the tests (eval/data.mk's
# targets come after this one).
.DEFAULT_GOAL := all
include eval/data.mk

LUA_CFLAGS := -I/usr/include/lua5.4
WARN := -Wall -Wextra -Werror
CFLAGS ?= -O2 -g
ALL_CFLAGS := -std=c11 -D_GNU_SOURCE $(WARN) $(CFLAGS) -fPIC -fvisibility=hidden -pthread \
	-Iinclude -Iruntime -Itemplates -Igen -I$(O)/gen $(LUA_CFLAGS) -I$(CUDA_HOME)/include \
	-DKVF_DEFAULT_CUDA_HOME='"$(CUDA_HOME)"'

# Executables carry Lua, xxHash and Jansson statically (they run on the GPU
# machine as they are); the shared library links them dynamically (Debian's
# archives are not PIC) and `make carry` copies them beside it.
STATIC_DEPS := -Wl,-Bstatic -llua5.4 -lxxhash -ljansson -Wl,-Bdynamic -lm -ldl -pthread
SHARED_DEPS := -llua5.4 -lxxhash -ljansson -lm -ldl -pthread

RUNTIME_SRC := $(sort $(wildcard runtime/*/*.c))
GEN_SRC := $(filter-out gen/embed.c,$(sort $(wildcard gen/*.c)))
LIB_SRC := $(RUNTIME_SRC) $(GEN_SRC)
include eval/eval.mk
LIB_OBJ := $(patsubst %.c,$(O)/obj/%.o,$(LIB_SRC)) $(O)/obj/embedded.o
TEMPLATES := $(sort $(wildcard templates/*))
SCHEMES := $(sort $(wildcard schemes/*.lua))
TEST_SRC := $(sort $(wildcard tests/test_*.c))
TEST_BIN := $(patsubst tests/%.c,$(O)/bin/%,$(TEST_SRC))

.PHONY: all setup test test-gpu demo clean carry lib aot-demo bench

all: $(O)/lib/libkvforge.a $(O)/lib/libkvforge.so $(O)/bin/kvforge $(O)/bin/kvf_bench $(TEST_BIN)

setup:
	apt-get update
	DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
		make gcc liblua5.4-dev libcmocka-dev libxxhash-dev libjansson-dev python3 python3-venv \
		clang libclang-rt-14-dev
	$(MAKE) py-setup

$(O)/bin/embed: gen/embed.c
	@mkdir -p $(dir $@)
	$(CC) -std=c11 $(WARN) -O2 -o $@ $<

# Shipped schemes and kernel templates are compiled into the library: JIT and
# `base = "..."` work wherever the library goes. The folders are prerequisites
# too, so removing a file (which changes the folder's time) rebuilds it.
$(O)/gen/embedded.c: $(O)/bin/embed $(TEMPLATES) $(SCHEMES) templates schemes
	@mkdir -p $(dir $@)
	$(O)/bin/embed $@ kvf_embedded_schemes $(SCHEMES) -- kvf_embedded_templates $(TEMPLATES)

# Embedded files' objects (the library's; the bench's probe, below).
$(O)/obj/embedded.o $(O)/obj/bench_probe.o: $(O)/obj/%.o: $(O)/gen/%.c runtime/internal.h
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -c -o $@ $<

# -MMD -MP: the compiler lists every header an object includes (the .d files
# included at the end), so a changed header rebuilds whatever includes it, the
# test that includes the fuzz targets included.
$(O)/obj/%.o: %.c $(wildcard include/*.h runtime/*.h runtime/*/*.h gen/*.h templates/*.h)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -MMD -MP -c -o $@ $<

$(O)/lib/libkvforge.a: $(LIB_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@
	ar rcs $@ $^

$(O)/lib/libkvforge.so: $(LIB_OBJ)
	@mkdir -p $(dir $@)
	$(CC) -shared -o $@ $^ -Wl,--no-undefined -Wl,-soname,libkvforge.so.0 \
		-Wl,-rpath,'$$ORIGIN' $(SHARED_DEPS)

$(O)/bin/kvforge: $(O)/obj/cli/kvforge.o $(EVAL_LIB) $(O)/lib/libkvforge.a
	@mkdir -p $(dir $@)
	$(CC) -o $@ $< $(EVAL_LIB) $(O)/lib/libkvforge.a $(STATIC_DEPS)

$(O)/bin/test_%: $(O)/obj/tests/test_%.o $(O)/obj/tests/testutil.o $(EVAL_LIB) $(O)/lib/libkvforge.a
	@mkdir -p $(dir $@)
	$(CC) -o $@ $(filter %.o,$^) $(EVAL_LIB) $(O)/lib/libkvforge.a -lcmocka $(STATIC_DEPS)

# test_nvrtc also compiles the bench's probe.
$(O)/bin/test_nvrtc: $(O)/obj/bench_probe.o

# Test objects are kept (as intermediates make would delete them, and a
# rebuilt testutil.o would relink every test).
.SECONDARY: $(patsubst tests/%.c,$(O)/obj/tests/%.o,$(TEST_SRC) tests/testutil.c)

lib: $(O)/lib/libkvforge.a $(O)/lib/libkvforge.so

# Unit tests. GPU tests skip (and say so) where there is no GPU.
test: all
	@KVF_SRC=$(CURDIR) O=$(O) sh tests/run_all.sh $(TEST_BIN)
	@KVF_SRC=$(CURDIR) O=$(O) sh tests/test_cli.sh
	@sh tests/check_exports.sh $(O)/lib/libkvforge.so include/kvforge.h
	@$(PYTHON) tests/format_model.py --check
	@$(MAKE) --no-print-directory py-test
	@$(MAKE) --no-print-directory wm-test
	@$(WM_PYTHON) -m pytest -q tests/test_frontier_compare.py

test-gpu: all
	@KVF_SRC=$(CURDIR) O=$(O) sh tests/run_all.sh $(O)/bin/test_gpu

SCHEME ?= schemes/quantwm_int2.lua
demo: $(O)/bin/kvforge
	$(O)/bin/kvforge demo $(SCHEME)

# Copy what the binaries need at run time on a machine with none of the
# Debian packages (the GPU machine) into $(O)/lib.
carry: all
	cp -L /usr/lib/x86_64-linux-gnu/libcmocka.so.0 /usr/lib/x86_64-linux-gnu/liblua5.4.so.0 \
		/usr/lib/x86_64-linux-gnu/libxxhash.so.0 /usr/lib/x86_64-linux-gnu/libjansson.so.4 $(O)/lib/

clean:
	rm -rf $(O)

# An application linking exported (precompiled) kernels: no NVRTC at run time.
# Built as an outside application: the public header, the exported files,
# libkvforge and the CUDA runtime (static), nothing of the library's inside.
AOT_SCHEME ?= rtn_int2
aot-demo: $(O)/bin/kvforge $(O)/lib/libkvforge.a
	rm -rf $(O)/export && $(O)/bin/kvforge export $(AOT_SCHEME) --arch sm_80,sm_90 -o $(O)/export
	id=$$($(O)/bin/kvforge info $(AOT_SCHEME) | sed -n 's/.*(id \(.*\))/\1/p'); \
	$(CC) -std=c11 $(WARN) -O2 -Iinclude -I$(O)/export -I$(CUDA_HOME)/include \
		-include $(O)/export/$${id}_aot.h -DKVF_AOT_ID=$$id \
		-o $(O)/bin/aot_demo examples/aot_demo.c $(O)/export/$${id}_aot.c $(O)/export/$${id}.c \
		$(O)/lib/libkvforge.a $(STATIC_DEPS) -L$(CUDA_HOME)/lib64 -lcudart_static -lrt

# Benchmark: built by `make all`, run on a GPU by `make bench`. Its
# probe kernel (bench/kvf_probe.cuh) is embedded in kvf_bench only, so it is
# not part of the library's templates nor of the schemes' JIT cache keys.
$(O)/gen/bench_probe.c: $(O)/bin/embed bench/kvf_probe.cuh
	@mkdir -p $(dir $@)
	$(O)/bin/embed $@ kvf_bench_probe bench/kvf_probe.cuh

$(O)/bin/kvf_bench: $(O)/obj/bench/bench.o $(O)/obj/bench_probe.o $(EVAL_LIB) $(O)/lib/libkvforge.a
	@mkdir -p $(dir $@)
	$(CC) -o $@ $(filter %.o,$^) $(EVAL_LIB) $(O)/lib/libkvforge.a $(STATIC_DEPS)

bench: $(O)/bin/kvf_bench
	$(O)/bin/kvf_bench
	$(PYTHON) bench/sdpa.py

include python/python.mk
include fuzz/fuzz.mk

-include $(wildcard $(O)/obj/*.d $(O)/obj/*/*.d $(O)/obj/*/*/*.d)
