# Quality evaluation (eval/): the safetensors reader, the dump format, the
# metrics, the streaming driver and its reports. Not part of libkvforge: an
# archive of its own, $(EVAL_LIB), that the CLI (`kvforge eval`), the tests and
# the bench link beside the library. Include from the Makefile after LIB_SRC:
#   include eval/eval.mk
EVAL_SRC := $(sort $(wildcard eval/*.c))
EVAL_HDR := $(wildcard eval/*.h)
EVAL_OBJ := $(patsubst %.c,$(O)/obj/%.o,$(EVAL_SRC))
EVAL_LIB := $(O)/lib/libkvforge_eval.a
ALL_CFLAGS += -Ieval

$(EVAL_LIB): $(EVAL_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@
	ar rcs $@ $^

$(EVAL_OBJ) $(O)/obj/tests/test_eval.o $(O)/obj/cli/kvforge.o \
	$(O)/obj/bench/bench.o $(O)/obj/tests/test_faults.o: $(EVAL_HDR)

# The metric loops (dot products, softmax-weighted sums, e^T M e) run over
# unknown lengths: -O3 vectorizes them (-O2's cheap cost model does not).
$(O)/obj/eval/metrics.o: ALL_CFLAGS += -O3
