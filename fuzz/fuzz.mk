# Fuzzing and sanitizer builds. Included from the Makefile, after its variables:
#
#   include fuzz/fuzz.mk
#
# make fuzz        build the libFuzzer targets (clang, ASan + UBSan) into $(FUZZ_O) and
#                  run each for FUZZ_SECONDS from its seed corpus (fuzz/run.sh); a crash,
#                  a sanitizer report or a timeout fails, the input lands in
#                  $(FUZZ_O)/artifacts/TARGET/
# make fuzz-build  only build them
# make fuzz-seeds  regenerate the committed seeds fuzz/corpus/packed, fuzz/corpus/roundtrip and fuzz/corpus/dump
# make test-asan   the whole cmocka suite and the CPU demo under ASan + UBSan ($(SAN_O))
#
# Needs clang with compiler-rt (Debian 12: clang, libclang-rt-14-dev).

FUZZ_CC ?= clang
FUZZ_O ?= out/fuzz
FUZZ_SECONDS ?= 60
# Extra libFuzzer flags, e.g. FUZZ_FLAGS=-jobs=2 or -runs=N
FUZZ_FLAGS ?=
FUZZ_TARGETS := fuzz_scheme fuzz_packed fuzz_roundtrip fuzz_dump fuzz_table
FUZZ_SAN := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
FUZZ_CFLAGS := -std=c11 -D_GNU_SOURCE $(WARN) -O1 -g $(FUZZ_SAN) -pthread \
	-Iinclude -Iruntime -Itemplates -Igen -Ieval -Ifuzz -I$(O)/gen $(LUA_CFLAGS) -I$(CUDA_HOME)/include \
	-DKVF_DEFAULT_CUDA_HOME='"$(CUDA_HOME)"'
FUZZ_LIB_OBJ := $(patsubst %.c,$(FUZZ_O)/obj/%.o,$(LIB_SRC) $(EVAL_SRC)) $(FUZZ_O)/obj/embedded.o
# Per target: seed directories (read only) and libFuzzer options.
FUZZ_SEEDS_fuzz_scheme := fuzz/corpus/scheme fuzz/regress/scheme schemes tests/schemes_bad
FUZZ_SEEDS_fuzz_packed := fuzz/corpus/packed fuzz/regress/packed
FUZZ_SEEDS_fuzz_roundtrip := fuzz/corpus/roundtrip fuzz/regress/roundtrip
FUZZ_SEEDS_fuzz_dump := fuzz/corpus/dump fuzz/corpus/dump_args fuzz/regress/dump
FUZZ_SEEDS_fuzz_table := fuzz/corpus/table fuzz/regress/table
FUZZ_OPTS_fuzz_scheme := -dict=fuzz/scheme.dict -timeout=10 -max_len=4096
FUZZ_OPTS_fuzz_packed := -timeout=10 -max_len=32768
FUZZ_OPTS_fuzz_roundtrip := -timeout=10 -max_len=8192
FUZZ_OPTS_fuzz_dump := -dict=fuzz/dump.dict -timeout=10 -max_len=32768
FUZZ_OPTS_fuzz_table := -timeout=10 -max_len=65536

.PHONY: fuzz fuzz-build fuzz-seeds test-asan

# The library again, with coverage for libFuzzer and the sanitizers.
$(FUZZ_O)/obj/%.o: %.c $(wildcard include/*.h runtime/*.h runtime/*/*.h gen/*.h eval/*.h)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer-no-link -c -o $@ $<

$(FUZZ_O)/obj/embedded.o: $(O)/gen/embedded.c runtime/internal.h
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer-no-link -c -o $@ $<

$(FUZZ_O)/%: fuzz/%.c fuzz/fuzz_common.h $(FUZZ_LIB_OBJ)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer -o $@ $< $(FUZZ_LIB_OBJ) $(STATIC_DEPS)

.SECONDARY: $(FUZZ_LIB_OBJ)

$(FUZZ_O)/fuzz_dump: fuzz/fuzz_dump.h

fuzz-build: $(addprefix $(FUZZ_O)/,$(FUZZ_TARGETS))

fuzz: fuzz-build
	@mkdir -p fuzz/regress/scheme fuzz/regress/packed fuzz/regress/roundtrip fuzz/regress/dump fuzz/regress/table
	@status=0; for t in $(FUZZ_TARGETS); do \
	  case $$t in \
	    fuzz_scheme) seeds="$(FUZZ_SEEDS_fuzz_scheme)"; opts="$(FUZZ_OPTS_fuzz_scheme)";; \
	    fuzz_packed) seeds="$(FUZZ_SEEDS_fuzz_packed)"; opts="$(FUZZ_OPTS_fuzz_packed)";; \
	    fuzz_dump) seeds="$(FUZZ_SEEDS_fuzz_dump)"; opts="$(FUZZ_OPTS_fuzz_dump)";; \
	    fuzz_table) seeds="$(FUZZ_SEEDS_fuzz_table)"; opts="$(FUZZ_OPTS_fuzz_table)";; \
	    *) seeds="$(FUZZ_SEEDS_fuzz_roundtrip)"; opts="$(FUZZ_OPTS_fuzz_roundtrip)";; \
	  esac; \
	  sh fuzz/run.sh $(FUZZ_O)/$$t $(FUZZ_SECONDS) $(FUZZ_O)/work/$$t $(FUZZ_O)/artifacts/$$t \
	    $(FUZZ_O)/logs/$$t.log $$opts $(FUZZ_FLAGS) -- $$seeds || status=1; \
	done; exit $$status

# Seeds for the packed-cache targets: real caches encoded on the CPU (small: < 200 KB).
$(FUZZ_O)/mkseeds: fuzz/mkseeds.c fuzz/fuzz_common.h $(O)/lib/libkvforge.a
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -o $@ $< $(O)/lib/libkvforge.a $(STATIC_DEPS)

# Seeds for the dump target: small synthetic dumps and recon files (< 100 KB).
$(FUZZ_O)/mkseeds_dump: fuzz/mkseeds_dump.c fuzz/fuzz_dump.h $(EVAL_LIB) $(O)/lib/libkvforge.a
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -Ifuzz -o $@ $< $(EVAL_LIB) $(O)/lib/libkvforge.a $(STATIC_DEPS)

fuzz-seeds: $(FUZZ_O)/mkseeds $(FUZZ_O)/mkseeds_dump
	rm -rf fuzz/corpus/packed fuzz/corpus/roundtrip fuzz/corpus/dump
	mkdir -p fuzz/corpus/packed fuzz/corpus/roundtrip fuzz/corpus/dump
	$(FUZZ_O)/mkseeds fuzz/corpus
	$(FUZZ_O)/mkseeds_dump fuzz/corpus/dump
	@du -sh fuzz/corpus/packed fuzz/corpus/roundtrip fuzz/corpus/dump

# tests/test_fuzz_replay.c includes the targets: rebuild it when they change.
$(O)/obj/tests/test_fuzz_replay.o: $(wildcard fuzz/*.c fuzz/*.h)

# ---------------------------------------------------------------- sanitizers

SAN_CC ?= clang
SAN_O ?= out/asan
SAN_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
SAN_TEST_BIN := $(patsubst tests/%.c,$(SAN_O)/bin/%,$(TEST_SRC))
# LSan suppressions for libraries we do not own (fuzz/lsan.supp); UBSan stops at
# the first report (-fno-sanitize-recover) and prints its stack.
# protect_shadow_gap=0: the CUDA driver maps memory where ASan would otherwise
# reserve its shadow gap (needed only where test_gpu finds a GPU).
SAN_ENV := ASAN_OPTIONS=detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1:protect_shadow_gap=0 \
	LSAN_OPTIONS=suppressions=$(CURDIR)/fuzz/lsan.supp:print_suppressions=0 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

# The sub-make builds the library, the tests and the CLI with the sanitizers in
# $(SAN_O) (CC carries the flags, so compiles and links both get them).
test-asan:
	$(MAKE) O=$(SAN_O) CC="$(SAN_CC) $(SAN_FLAGS)" CFLAGS="-O1 -g" $(SAN_TEST_BIN) $(SAN_O)/bin/kvforge
	@$(SAN_ENV) KVF_SRC=$(CURDIR) O=$(SAN_O) sh tests/run_all.sh $(SAN_TEST_BIN)
	$(SAN_ENV) KVFORGE_CACHE=0 $(SAN_O)/bin/kvforge demo --cpu
