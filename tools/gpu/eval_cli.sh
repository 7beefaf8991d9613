#!/usr/bin/env bash
# `kvforge eval` on the GPU machine: the GPU backend on dumps holding NaN and
# infinities, and the per-layer comparison of several schemes. Runs from the
# repository root with out/ carried (built with `make`); python3 with matplotlib.
# Steps, each bounded by `timeout`:
#   1. out/bin/test_eval (its GPU test compares the GPU's reports with the CPU's);
#   2. `kvforge eval --gpu` on the NaN/Inf seed dumps (fuzz/corpus/dump/dump_nonfinite*):
#      exit 0, the same non-finite counts as the CPU reference, undefined metrics; --strict
#      exits 1;
#   3. eval/frontier.py run --gpu over eval/worldmodel/kv_small.safetensors for
#      KVF_EVAL_SCHEMES, then `compare` -> one markdown table and one PNG.
# Files under $OUT: eval_cli.log, combined.json, compare.md, compare.png.
# Expected: about 1 minute on one H200 (NVRTC compiles included); the whole is cut to
# KVF_EVAL_BUDGET (300 s). KVF_EVAL_GPU=0 runs the same on the CPU (to try it without a GPU).
set -u
OD=${OUT:-/tmp/out}; mkdir -p "$OD"
PY=${PYTHON:-python3}
exec > >(tee "$OD/eval_cli.log") 2>&1
export LD_LIBRARY_PATH=$PWD/out/lib KVF_SRC=$PWD O=out KVFORGE_CACHE_DIR=/tmp/kc
schemes=${KVF_EVAL_SCHEMES:-rtn_int2 rtn_int4 kivi_int2 qvg_int2 quantwm_int2}
gpu=${KVF_EVAL_GPU:-1}
gflag=$([ "$gpu" = 1 ] && echo --gpu)
t0=$(date +%s)
budget=${KVF_EVAL_BUDGET:-300}
status=0
stamp() { echo "== [$(( $(date +%s) - t0 )) s] $*"; }
tl() { local left=$(( budget - ($(date +%s) - t0) )); local c=$1; [ $left -lt $c ] && c=$left; [ $c -lt 5 ] && c=5; echo $c; }
fail() { echo "FAIL: $*"; status=1; }

stamp "test_eval"
[ "$gpu" = 1 ] && { nvidia-smi -L || fail "no GPU visible"; }
timeout "$(tl 150)" out/bin/test_eval || fail "test_eval"

stamp "NaN and infinities through the GPU backend"
# count in a JSON report: nonfinite.values, and whether overall.top1_shift is null
jq_py='import json,sys; r=json.load(open(sys.argv[1])); print(r["nonfinite"]["values"], r["overall"]["top1_shift"] is None)'
for dump in fuzz/corpus/dump/dump_nonfinite fuzz/corpus/dump/dump_nonfinite_d64; do
  if [ "${dump%_d64}" != "$dump" ]; then s="return { base = 'quantwm_int2', name = 'nan_cent16', head_dim = 64, key = { centroids = 16, psac_rank = 4 }, value = { centroids = 16, stages = 2 } }"
  else s=qvg_int2; fi
  if [ "${dump%_d64}" != "$dump" ]; then printf '%s\n' "$s" > /tmp/s64.lua; s=/tmp/s64.lua; fi
  for dev in cpu gpu; do
    flag=$([ $dev = gpu ] && echo "$gflag")
    timeout "$(tl 60)" out/bin/kvforge eval --scheme "$s" --data "$dump" --json --threads 4 $flag \
      >"/tmp/nan_$dev.json" 2>"/tmp/nan_$dev.err"
    rc=$?
    echo "$dump $dev: exit $rc; $(head -c 300 /tmp/nan_$dev.err)"
    [ $rc -eq 0 ] || fail "$dump $dev: exit $rc"
  done
  cpu=$($PY -c "$jq_py" /tmp/nan_cpu.json) gpu_=$($PY -c "$jq_py" /tmp/nan_gpu.json)
  echo "$dump: non-finite values and undefined top-1: CPU $cpu, GPU $gpu_"
  [ "$cpu" = "$gpu_" ] && [ "${cpu#* }" = True ] || fail "$dump: CPU '$cpu' and GPU '$gpu_' differ or top-1 is defined"
  timeout "$(tl 60)" out/bin/kvforge eval --scheme "$s" --data "$dump" --strict $gflag >/dev/null 2>/tmp/strict.err
  rc=$?
  echo "$dump --strict: exit $rc; $(head -c 300 /tmp/strict.err)"
  [ $rc -eq 1 ] || fail "$dump --strict: exit $rc, expected 1"
done

stamp "frontier run ($schemes) and compare on kv_small"
timeout "$(tl 200)" $PY eval/frontier.py run --kvforge out/bin/kvforge --data eval/worldmodel/kv_small.safetensors \
  --schemes $schemes $gflag --threads 16 --out "$OD/combined.json" || fail "frontier run"
timeout "$(tl 60)" $PY eval/frontier.py compare "$OD/combined.json" --png "$OD/compare.png" --md "$OD/compare.md" \
  --title "kvforge eval per layer on kv_small ($([ "$gpu" = 1 ] && echo GPU || echo CPU))" || fail "compare"
[ -f "$OD/compare.md" ] && cat "$OD/compare.md"

stamp "done: status $status"
exit $status
