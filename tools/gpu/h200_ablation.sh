#!/usr/bin/env bash
# QuantWM ablation on the world-model dump (docs/QUALITY.md), on the GPU machine.
set -u
export LD_LIBRARY_PATH=$PWD/out/lib KVFORGE_CACHE_DIR=/tmp/kc
python3 eval/worldmodel/frames.py out/data/vtest.avi /tmp/f.npz >/dev/null || exit 1
python3 eval/worldmodel/dump_kv.py --weights eval/worldmodel/weights.safetensors --frames /tmp/f.npz \
  --layers all --chunks 5 --q-stride 16 --out /tmp/kv_full.safetensors 2>&1 | tail -1
for s in schemes/qvg_int2.lua eval/ablation/qvg_int2_twolevel.lua eval/ablation/quantwm_int2_noqsac.lua \
         eval/ablation/quantwm_int2_nopsac.lua schemes/quantwm_int2.lua; do
  echo "--- $s"; out/bin/kvforge eval --scheme $s --data /tmp/kv_full.safetensors --gpu --threads 16 | grep -E "^(overall|[0-9])"
done
