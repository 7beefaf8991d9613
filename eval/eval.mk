# Quality evaluation (eval/): the safetensors reader, the dump format, the
# metrics, the streaming driver and its reports. Compiled into libkvforge, so
# the CLI (`kvforge eval`) and every test link it as they link the rest.
# Include from the Makefile after LIB_SRC and before LIB_OBJ:
#   include eval/eval.mk
EVAL_SRC := $(sort $(wildcard eval/*.c))
EVAL_HDR := $(wildcard eval/*.h)
LIB_SRC += $(EVAL_SRC)
ALL_CFLAGS += -Ieval

$(patsubst %.c,$(O)/obj/%.o,$(EVAL_SRC)) $(O)/obj/tests/test_eval.o $(O)/obj/tools/kvforge.o \
	$(O)/obj/bench/bench.o $(O)/obj/tests/test_faults.o: $(EVAL_HDR)

# The metric loops (dot products, softmax-weighted sums, e^T M e) run over
# unknown lengths: -O3 vectorizes them (-O2's cheap cost model does not).
$(O)/obj/eval/metrics.o: ALL_CFLAGS += -O3
