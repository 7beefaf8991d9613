#!/usr/bin/env bash
# The pipeline's kernels (outliers, anchors, error feedback, mixed precision),
# the FP8 scales and the fast k-means assignment on the GPU machine, against
# the CPU reference, and their speed; over a copy of the work tree with out/
# carried (`make all carry` here; nothing is built there). Parts, each under
# `timeout` (exit 124 = timed out), 560 s at most in all:
#   tests   test_gpu (every case: the shipped schemes, the pipeline's 3-span
#           cases and 40-span streams, the fast assignment's contract) and
#           test_eval (kvforge eval --gpu against the CPU);
#   bench   kvf_bench on the LongCat layer: the fast and the exact assignment
#           of the k-means schemes in one process, then the other schemes;
#   python  the binding's pipeline cache and torch tests on the GPU;
#   eval    kvforge eval of stable_int2 on the committed dump, GPU and CPU, with
#           a table that kvforge calibrate writes there: the two JSON reports'
#           metrics must be equal.
# Everything kept goes to $OUT: pipeline.log (the summary) and one file a part.
# Knobs: KVF_PIPE_ONLY (a test_gpu filter, e.g. 'gpu_pipeline*'), KVF_PIPE_ASSIGN=0 (no
# fast/exact bench), KVF_PIPE_BENCH (the second bench's schemes).
#   bash tools/gpu/pipeline.sh [tests] [bench] [python] [eval]   (all by default)
set -u
OUT=${OUT:-/tmp/pipeline}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/out/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export KVF_SRC=$PWD KVFORGE_CACHE_DIR=$(mktemp -d) KVFORGE_LIB=$PWD/out/lib/libkvforge.so
parts=${*:-tests bench python eval}
has() { case " $parts " in *" $1 "*) return 0;; esac; return 1; }
t0=$SECONDS
# run NAME LIMIT CMD...: CMD's output into $OUT/NAME, its exit status and seconds in the
# summary; every part within the 560 s of the whole.
. "$(dirname "$0")/lib.sh"
RUN_OUT=$OUT RUN_BUDGET=560 RUN_T0=$t0
{
echo "== commit $(cat out/COMMIT 2>/dev/null || echo unknown)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null
fails=0
if has tests; then
  echo "== test_gpu (all cases) and test_eval"
  KVF_TEST_ONLY=${KVF_PIPE_ONLY:-} run test_gpu.txt 300 out/bin/test_gpu || fails=$((fails+1))
  grep -vE '^\[ *(RUN|OK) |qstats: counts and sums identical' "$OUT/test_gpu.txt" | grep -E \
    "pipeline|spans|FAILED|PASSED|ERROR|error|skipped|apart|stream" | head -40
  run test_eval.txt 60 out/bin/test_eval || fails=$((fails+1))
  grep -E "gpu|GPU|FAILED|PASSED|ERROR" "$OUT/test_eval.txt" | head -10
fi
if has bench; then
  echo "== kvf_bench: the LongCat layer (32 heads x 29640 tokens x 128)"
  [ "${KVF_PIPE_ASSIGN:-1}" = 1 ] && run bench_assign.txt 90 out/bin/kvf_bench --reps 10 --no-probe --assign both qvg_int2 quantwm_int2 qvg7_int2 \
    quantwm7_int2 || fails=$((fails+1))
  [ -f "$OUT/bench_assign.txt" ] && grep -E "^(scheme|copy|qvg|quantwm)" "$OUT/bench_assign.txt"
  run bench.txt 60 out/bin/kvf_bench --reps 10 --no-probe ${KVF_PIPE_BENCH:-rtn_int2 stable_int2 kivi_int2 qvg_int4} || fails=$((fails+1))
  grep -E "^(scheme|copy|rtn|stable|kivi|qvg)" "$OUT/bench.txt"
fi
if has python; then
  echo "== the binding on the GPU: the pipeline cache and the torch tests"
  run python.txt 150 env PYTHONPATH=python python3 -m pytest -q -rs python/tests/test_pipeline.py \
    python/tests/test_gpu_torch.py || fails=$((fails+1))
  tail -6 "$OUT/python.txt"
fi
if has eval; then
  # The 3-chunk seed dump: chunk 1, coded against the anchor (chunk 0) with outliers
  # and refined channels, is scored at step 2 (kv_small's 2 chunks score the anchor only).
  echo "== kvforge eval of stable_int2 on fuzz/corpus/dump/dump_fixed: GPU and CPU"
  D=fuzz/corpus/dump/dump_fixed
  tab=$(mktemp -d)/stable.json
  run calibrate.txt 60 out/bin/kvforge calibrate --scheme stable_int2 --data $D -o "$tab" --chunks 0:1 -q || fails=$((fails+1))
  run eval_gpu.json 60 out/bin/kvforge eval --scheme stable_int2 --data $D --table "$tab" --gpu --json -q || fails=$((fails+1))
  run eval_cpu.json 90 out/bin/kvforge eval --scheme stable_int2 --data $D --table "$tab" --json -q --threads 16 || fails=$((fails+1))
  python3 - "$OUT/eval_gpu.json" "$OUT/eval_cpu.json" <<'PY' || fails=$((fails+1))
import json, sys
g, c = (json.load(open(p)) for p in sys.argv[1:3])
keys = ["top1_shift", "top5_overlap", "attn_out_rel_err", "key_mse", "value_mse", "qk_err", "compression"]
same = all(g["overall"][k] == c["overall"][k] for k in keys) and g["layers"] == c["layers"]
print("stable_int2 on dump_fixed:", {k: g["overall"][k] for k in keys})
print("GPU and CPU reports' metrics", "identical" if same else "DIFFER", "; anchors", g["policy"]["anchor_spans"])
sys.exit(0 if same else 1)
PY
fi
echo "== parts failed or timed out: $fails; $((SECONDS - t0)) s in all"
} 2>&1 | tee "$OUT/pipeline.log"
