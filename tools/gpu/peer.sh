#!/usr/bin/env bash
# QVG (quant-videogen, the peer) beside kvforge on the GPU machine: out/ and .whl/ carried
# (.whl/: quant_videogen-0.1.0, termcolor, loguru and einops wheels from `pip download
# --no-deps`; torch and triton are the machine's). Steps, each bounded by `timeout`:
#   1. install the wheels into /tmp/site (no index, no dependencies);
#   2. the KV dump: all 6 layers, 5 chunks, every 16th query (eval/worldmodel/dump_kv.py)
#      when out/data/vtest.avi was carried, else the committed eval/worldmodel/kv_small;
#   3. eval/peer/qvg_peer.py over it for the three QVG configurations (shipped default,
#      asymmetric, QVG-Pro) -> recon files;
#   4. eval/frontier.py: `kvforge eval --gpu` for kvforge's schemes and `kvforge eval --peer`
#      for the recon files -> one combined JSON and the Pareto plot;
#   5. bench/peer_bench.py: encode/decode of the LongCat layer, QVG and kvforge in one process.
# Files under $OUT: peer.log, harness.json, frontier.json, frontier.png, peer_bench.json.
# Expected: about 4 minutes on one H200 (Triton's autotuning included); every step is cut
# to what is left of KVF_PEER_BUDGET (560 s) so the whole stays within one 600 s command.
# KVF_PEER_CONFIGS: the QVG configurations (default: the three); KVF_PEER_LAYERS: the dump's
# layers (default all; "0,2,5" is the 16-chunk CPU frontier's dump); KVF_PEER_ARGS: more
# qvg_peer.py options (e.g. "--quant-factor 8": QVG's spans of 8 chunks, as qvg7_int2's); KVF_PEER_BENCH=0: no step 5;
# KVF_PEER_SCHEMES: kvforge's schemes to score (default below); KVF_PEER_EVAL_S: the scoring step's
# cap in seconds (150); KVF_PEER_TABLES: the
# sensitivity tables of mixed-precision schemes (NAME.json, `kvforge calibrate` on a dump
# of the same model); KVF_PEER_CHUNKS: chunks of the dump (default 5); KVF_PEER_GPU=0: score and
# bench on the CPU (to try the script where there is no GPU: the peer then skips).
set -u
O=${OUT:-/tmp/out}; mkdir -p "$O"
PY=${PYTHON:-python3}
exec > >(tee "$O/peer.log") 2>&1
export PYTHONUNBUFFERED=1 LD_LIBRARY_PATH=$PWD/out/lib KVF_SRC=$PWD KVFORGE_CACHE_DIR=/tmp/kc
export KVFORGE_LIB=$PWD/out/lib/libkvforge.so PYTHONPATH=/tmp/site:$PWD/python:$PWD/eval/peer
schemes=${KVF_PEER_SCHEMES:-rtn_int2 qvg_int2 quantwm_int2 qvg_pro_int2}
gpu=${KVF_PEER_GPU:-1}
configs=${KVF_PEER_CONFIGS:-qvg-peer_int2_g64 qvg-peer_int2_g64_asym qvg-peer_pro_int2_g16}
t0=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - t0 )) s] $*"; }
# Seconds a step may take: its cap, or what is left of the whole run's budget (one
# command on the GPU machine runs at most 600 s), at least 5.
budget=${KVF_PEER_BUDGET:-560}
tl() { local left=$(( budget - ($(date +%s) - t0) )); local c=$1; [ $left -lt $c ] && c=$left; [ $c -lt 5 ] && c=5; echo $c; }

stamp "install the peer's wheels"
ls .whl/*.whl || { echo "no .whl/ carried: run 'pip download --no-deps quant-videogen termcolor loguru einops -d .whl'"; exit 1; }
$PY -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"

stamp "dump"
dump=eval/worldmodel/kv_small.safetensors
if [ -f out/data/vtest.avi ]; then
  dev=cuda; [ "$gpu" = 0 ] && dev=cpu
  timeout $(tl 60) $PY eval/worldmodel/frames.py out/data/vtest.avi /tmp/f.npz && \
  timeout $(tl 90) $PY eval/worldmodel/dump_kv.py --weights eval/worldmodel/weights.safetensors --frames /tmp/f.npz \
    --layers ${KVF_PEER_LAYERS:-all} --chunks ${KVF_PEER_CHUNKS:-5} --q-stride 16 --device $dev --out /tmp/kv_full.safetensors 2>&1 | tail -2 && \
  [ -f /tmp/kv_full.safetensors ] && dump=/tmp/kv_full.safetensors
fi
echo "dump: $dump"

stamp "QVG over the dump (eval/peer/qvg_peer.py)"
recons=""
for c in $configs; do
  timeout $(tl 120) $PY eval/peer/qvg_peer.py --data "$dump" --config $c --out /tmp/recon_$c.safetensors \
    --json /tmp/harness_$c.json ${KVF_PEER_ARGS:-}
  rc=$?
  if [ $rc = 0 ]; then recons="$recons /tmp/recon_$c.safetensors"; else echo "qvg_peer $c: exit $rc"; fi
done
$PY - "$O/harness.json" $configs <<'PY'
import json, os, sys
out = {}
for c in sys.argv[2:]:
    p = f"/tmp/harness_{c}.json"
    if os.path.exists(p):
        out[c] = json.load(open(p))
json.dump(out, open(sys.argv[1], "w"), indent=1)
PY

stamp "kvforge eval: schemes and peers (eval/frontier.py)"
gflag=--gpu; [ "$gpu" = 0 ] && gflag=
# frontier.json is rewritten after every entry: a step cut short keeps what it scored (and the plot
# shows it). Ten schemes over a 16-chunk dump of 3 layers took more than 150 s on the H200.
timeout $(tl ${KVF_PEER_EVAL_S:-150}) $PY eval/frontier.py run --kvforge out/bin/kvforge --data "$dump" \
  --schemes $schemes --peers $recons $gflag --threads 16 ${KVF_PEER_TABLES:+--table-dir "$KVF_PEER_TABLES"} \
  --out "$O/frontier.json"
[ -s "$O/frontier.json" ] && \
  $PY eval/frontier.py plot "$O/frontier.json" --png "$O/frontier.png" --title "kvforge and QVG on $(basename $dump)"

if [ "${KVF_PEER_BENCH:-1}" = 0 ]; then stamp "done (no bench: KVF_PEER_BENCH=0)"; exit 0; fi
stamp "bench (bench/peer_bench.py)"
if [ "$gpu" = 0 ]; then bargs="--device cpu --tokens 512 --heads 2 --reps 2 --warmup 1 --peers none"; else bargs=""; fi
timeout $(tl 200) $PY bench/peer_bench.py $bargs --json "$O/peer_bench.json"
echo "peer_bench exit $?"
stamp "done"
