#!/usr/bin/env bash
# The quality evaluation on the GPU machine (out/ carried, with out/data/vtest.avi from `make data`):
# rollouts through the Python binding, a multi-layer KV dump, `kvforge eval --gpu`
# for every shipped scheme, and the decode benchmark. Files come back under $OUT.
# KVF_Q_SCHEMES: the schemes to evaluate instead (names or .lua paths: an A/B of
# scheme options); KVF_Q_FULL=0: only the dump and the evaluation (no rollouts,
# no bench).
set -u
export PYTHONUNBUFFERED=1 LD_LIBRARY_PATH=$PWD/out/lib KVF_SRC=$PWD KVFORGE_CACHE_DIR=/tmp/kc
export KVFORGE_LIB=$PWD/out/lib/libkvforge.so PYTHONPATH=$PWD/python
O=${OUT:-/tmp/out}; mkdir -p "$O"
schemes=${KVF_Q_SCHEMES:-rtn_int2 kivi_int2 quarot_int2 qvg_int2 qvg_pro_int2 quantwm_int2 rtn_int4 qvg_int4 quantwm_int4}
full=${KVF_Q_FULL:-1}
python3 eval/worldmodel/frames.py out/data/vtest.avi /tmp/f.npz || exit 1
if [ "$full" != 0 ]; then
  echo "== rollouts"
  python3 eval/worldmodel/rollout.py --weights eval/worldmodel/weights.safetensors --frames /tmp/f.npz \
    --json "$O/rollouts.json" --img-dir /tmp/img --tar "$O/rollout_img.tar" > "$O/rollout.log" 2>&1
  echo "rollout exit $?"; tail -25 "$O/rollout.log"
fi
echo "== dump: every layer, 5 chunks, every 16th query"
python3 eval/worldmodel/dump_kv.py --weights eval/worldmodel/weights.safetensors --frames /tmp/f.npz \
  --layers all --chunks 5 --q-stride 16 --out /tmp/kv_full.safetensors 2>&1 | tail -2
echo "== kvforge eval --gpu"
: > "$O/eval_all.jsonl"
for s in $schemes; do
  case $s in *.lua) ;; *) s=schemes/$s.lua;; esac
  out/bin/kvforge eval --scheme $s --data /tmp/kv_full.safetensors --gpu --threads 16 --json > /tmp/e.json \
    && { printf '{"scheme":"%s","report":' "$(basename "$s" .lua)"; tr -d '\n' < /tmp/e.json; echo '}'; } >> "$O/eval_all.jsonl"
done
python3 - "$O/eval_all.jsonl" <<'PY' | tee "$O/eval_tables.txt"
import json, sys
keys = ["top1_shift", "top5_overlap", "attn_out_rel_err", "key_mse", "value_mse", "qk_err", "compression"]
print("%-20s" % "scheme" + "".join("%15s" % k for k in keys))
for line in open(sys.argv[1]):
    r = json.loads(line); o = r["report"]["overall"]
    print("%-20s" % r["scheme"] + "".join("%15.5g" % (o[k] if o[k] is not None else float("nan")) for k in keys))
PY
[ "$full" != 0 ] || exit 0
echo "== bench (decode)"
{ out/bin/kvf_bench rtn_int2 kivi_int2 qvg_int2 quantwm_int2; python3 bench/sdpa.py rtn_int2 kivi_int2 qvg_int2 quantwm_int2; } 2>&1 | tee "$O/bench.log" | tail -22
