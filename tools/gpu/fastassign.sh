#!/usr/bin/env bash
# The fast k-means assignment (assign = "fast", docs/METHODS.md 3) on the GPU
# machine, over a copy of the work tree with out/ carried (built here by
# `make -j2`; nothing is built there). About 130 s, each part bounded by
# `timeout` (exit 124 = timed out), 150 s at most in all:
#  1. bench (45 s at most): kvf_bench --assign both over qvg_int2,
#     quantwm_int2 and qvg_int4, the fast and the exact assignment of each in
#     one process (rows <scheme> and <scheme>/exact) on the LongCat layer;
#  2. fast (65 s at most): test_gpu's gpu_fast_assign and
#     gpu_fast_assign_dump, the contract against the CPU reference (at most
#     0.5% of indices differ, each tensor's MSE within 0.5%; same bytes run
#     after run) for FAST_SCHEMES;
#  3. exact (38 s at most): test_gpu's gpu_matches_cpu for EXACT_SCHEMES
#     with assign = "exact": the CPU's bytes.
# Everything kept goes to $OUT: fastassign.log (the summary), bench.txt,
# test_fast.txt, test_exact.txt.
#   bash tools/gpu/fastassign.sh [bench] [fast] [exact]   (all three by default)
set -u
OUT=${OUT:-/tmp/fastassign}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/out/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export KVF_SRC=$PWD KVFORGE_CACHE_DIR=$(mktemp -d)
parts=${*:-bench fast exact}
has() { case " $parts " in *" $1 "*) return 0;; esac; return 1; }
FAST_SCHEMES=${FAST_SCHEMES:-qvg_int2,quantwm_int2,qvg_pro_int2}
EXACT_SCHEMES=${EXACT_SCHEMES:-qvg_int2,quantwm_int2}
for b in out/bin/kvf_bench out/bin/test_gpu; do
  [ -x "$b" ] || { echo "fastassign.sh: $b missing: carry out/ (built by make -j2)" >&2; exit 2; }
done
# run NAME LIMIT CMD...: CMD's output into $OUT/NAME, its exit status and seconds in the summary.
. "$(dirname "$0")/lib.sh"
RUN_OUT=$OUT
{
echo "== commit $(cat out/COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null
fails=0
if has bench; then
  echo "== bench: fast and exact assignment in one process (encode: median of 5; decode: of 10)"
  run bench.txt 45 out/bin/kvf_bench --reps 10 --no-probe --assign both qvg_int2 quantwm_int2 qvg_int4 || fails=$((fails+1))
  grep -E "^(scheme|qvg|quantwm)|assign" "$OUT/bench.txt"
fi
if has fast; then
  echo "== test_gpu: the fast assignment's contract ($FAST_SCHEMES; the dump: qvg_int2, quantwm_int2)"
  KVF_TEST_ONLY='gpu_fast_assign*' KVF_TEST_SCHEMES=$FAST_SCHEMES run test_fast.txt 65 out/bin/test_gpu || fails=$((fails+1))
  grep -E "indices differ from|differ$|FAILED|PASSED|ERROR|error|skipped" "$OUT/test_fast.txt"
fi
if has exact; then
  echo "== test_gpu: gpu_matches_cpu with assign = \"exact\" ($EXACT_SCHEMES)"
  KVF_TEST_ONLY=gpu_matches_cpu KVF_TEST_SCHEMES=$EXACT_SCHEMES run test_exact.txt 38 out/bin/test_gpu || fails=$((fails+1))
  grep -E "agrees with|filtered twice|FAILED|PASSED|ERROR|error|skipped" "$OUT/test_exact.txt"
fi
echo "== parts failed or timed out: $fails"
} 2>&1 | tee "$OUT/fastassign.log"
