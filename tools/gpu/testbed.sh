#!/usr/bin/env bash
# The world-model testbed on the GPU machine: the large model, long autoregressive
# streams, and what the KV-cache schemes do to them. Run from the repository root
# with, carried: out/lib (libkvforge.so and the libraries `make carry` puts beside
# it), out/bin/kvforge and out/data/vtest.avi (`make data` here; the machine has no
# network). Each subcommand is one device command, under its own time guard
# (TB_DEADLINE seconds, default 570); everything kept is written to $OUT (at most
# 8 files).
#
#   train               train the large model (eval/worldmodel/train.py --preset large:
#                       the recipe and its time budget are that preset's, as in
#                       `make wm-train-large`): weights_large.safetensors (+ shards if
#                       any), train_report_large.json, train_large.log. ~270 s.
#   rollout [SCHEMES]   long rollouts of the large model: 1 real held-out chunk (frames
#                       636..638), 31 chunks generated through each scheme's cache;
#                       rollout_long.json, temporal.png, rollout_strip.png,
#                       flicker_grid.png, rollout_img.tar (every PNG), rollout.log.
#                       ~3 min for the default 9 schemes.
#   dump [SCHEMES]      the long stream's Q/K/V (dump_kv.py --preset long: BF16 rollout,
#                       32 chunks, 3 layers, every 256th query; kept in /tmp, ~0.7 GB),
#                       then `kvforge eval --gpu` of each scheme on it; eval_long.jsonl,
#                       eval_long_tables.txt, dump.log. ~4-6 min for 9 schemes.
#   peaked              attention peakedness per layer and head of the small and the
#                       large model (peaked.py, 8 teacher-forced held-out chunks, every
#                       16th query); peaked.json, peaked.txt. ~1 min.
#
# SCHEMES: names of shipped schemes or .lua paths (default: the nine shipped ones).
# Environment: WM_LARGE (the large weights; default eval/worldmodel/weights_large.safetensors,
# else out/wm/weights_large.safetensors), WM_MODEL=large|small (rollout, dump), WM_CHUNKS
# (generated chunks, default 31), WM_STARTS (first frames, comma-separated, default 636;
# 636,699 gives two streams that both end inside the held-out frames; dump: the first),
# WM_FACTORY (rollout: one --cache-factory spec, e.g.
# qvg_peer=eval/peer/qvg_cache.py:make_cache), WM_TABLE_DIR (rollout: the sensitivity tables
# of mixed-precision schemes, LABEL.json, from `kvforge calibrate` on this model), WM_ATTN_STRIDE
# (rollout's attention probe, default 0: the peak memory is then the scheme's alone),
# WM_DUMP_LAYERS (default spread3), WM_DUMP_QSTRIDE (256), WM_DUMP_CACHE (a scheme whose
# compressed cache generates the dumped stream; default: the BF16 rollout), WM_PEAKED_CHUNKS
# (8), WM_PEAKED_QSTRIDE (16). For a dry run on a machine without a GPU: TB_PYTHON (the
# python with torch), TB_TRAIN_ARGS (extra train.py arguments, e.g. a tiny --config),
# TB_EVAL_BACKEND (default --gpu; empty: kvforge eval on the CPU).
set -u
cmd=${1:-}
[ $# -gt 0 ] && shift
export PYTHONUNBUFFERED=1 LD_LIBRARY_PATH=$PWD/out/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} KVF_SRC=$PWD
export KVFORGE_CACHE_DIR=${KVFORGE_CACHE_DIR:-/tmp/kc} KVFORGE_LIB=$PWD/out/lib/libkvforge.so
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
O=${OUT:-/tmp/out}; mkdir -p "$O"
DEADLINE=$((SECONDS + ${TB_DEADLINE:-570}))
left() { echo $((DEADLINE - SECONDS)); }
PY=${TB_PYTHON:-python3}
WM=eval/worldmodel
FR=/tmp/wm_frames.npz
DEFAULT_SCHEMES="rtn_int2 kivi_int2 quarot_int2 qvg_int2 qvg_pro_int2 quantwm_int2 rtn_int4 qvg_int4 quantwm_int4"

frames() {
  # The footage, decoded here (the frames' sha256 goes into every output). Uncompressed:
  # written and read back in a fraction of the time of the zip of `make data`.
  [ -s "$FR" ] && return 0
  [ -f out/data/vtest.avi ] || { echo "out/data/vtest.avi is missing: run 'make data' and carry it"; exit 2; }
  timeout "$(left)" $PY $WM/frames.py --fast out/data/vtest.avi "$FR.tmp.npz" && mv "$FR.tmp.npz" "$FR" || exit 1
}

large_weights() {
  for w in ${WM_LARGE:-} $WM/weights_large.safetensors out/wm/weights_large.safetensors; do
    [ -f "$w" ] && { echo "$w"; return 0; }
  done
  echo "no large weights: run 'tools/gpu/testbed.sh train' and put its weights_large.safetensors" \
       "(and any .shard files) in $WM/, or name them in WM_LARGE" >&2
  return 1
}

model_weights() {
  case ${WM_MODEL:-large} in
    small) echo $WM/weights.safetensors;;
    large) large_weights;;
    *) echo "WM_MODEL must be large or small" >&2; return 1;;
  esac
}

scheme_list() {  # "$@" or the defaults, as a comma-separated list
  local s=${*:-$DEFAULT_SCHEMES}
  echo "$s" | tr ' ' ','
}

echo "== testbed $cmd (commit $(git rev-parse --short HEAD 2>/dev/null || cat out/COMMIT 2>/dev/null || echo unknown))"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true

case $cmd in
train)
  frames
  timeout "$(left)" $PY $WM/train.py --preset large --frames "$FR" --out-dir /tmp/wm_large \
      --weights-name weights_large.safetensors --report-name train_report_large.json ${TB_TRAIN_ARGS:-} 2>&1 \
      | tee "$O/train_large.log"
  rc=${PIPESTATUS[0]}
  cp /tmp/wm_large/weights_large*.safetensors /tmp/wm_large/train_report_large.json "$O/" 2>/dev/null
  # Also where the other subcommands look, for a later call on this same machine.
  mkdir -p out/wm && cp /tmp/wm_large/weights_large*.safetensors out/wm/ 2>/dev/null
  ls -l "$O"
  exit "$rc"
  ;;
rollout)
  frames
  W=$(model_weights) || exit 2
  fac=()
  [ -n "${WM_FACTORY:-}" ] && fac=(--cache-factory "$WM_FACTORY")
  [ -n "${WM_TABLE_DIR:-}" ] && fac+=(--table-dir "$WM_TABLE_DIR")
  timeout "$(left)" $PY $WM/rollout.py --weights "$W" --frames "$FR" --starts "${WM_STARTS:-636}" \
      --prompt-chunks 1 --chunks "${WM_CHUNKS:-31}" --attn-stride "${WM_ATTN_STRIDE:-0}" \
      --schemes "bf16,$(scheme_list "$@")" ${fac[@]+"${fac[@]}"} --strip-schemes bf16,qvg_int2,quantwm_int2 \
      --json "$O/rollout_long.json" --img-dir /tmp/wm_img --tar "$O/rollout_img.tar" 2>&1 | tee "$O/rollout.log"
  rc=${PIPESTATUS[0]}
  for f in temporal.png rollout_strip.png flicker_grid.png; do
    [ -f /tmp/wm_img/$f ] && cp /tmp/wm_img/$f "$O/"
  done
  exit "$rc"
  ;;
dump)
  frames
  W=$(model_weights) || exit 2
  cs=()
  [ -n "${WM_DUMP_CACHE:-}" ] && cs=(--cache-scheme "$WM_DUMP_CACHE")
  D=/tmp/kv_long.safetensors
  timeout "$(left)" $PY $WM/dump_kv.py --weights "$W" --frames "$FR" --preset long \
      --chunks $((${WM_CHUNKS:-31} + 1)) --layers "${WM_DUMP_LAYERS:-spread3}" \
      --q-stride "${WM_DUMP_QSTRIDE:-256}" --start "$(echo "${WM_STARTS:-636}" | cut -d, -f1)" ${cs[@]+"${cs[@]}"} --out "$D" 2>&1 | tee "$O/dump.log"
  [ "${PIPESTATUS[0]}" = 0 ] || exit 1
  : > "$O/eval_long.jsonl"
  for s in $(scheme_list "$@" | tr ',' ' '); do
    case $s in *.lua) f=$s;; *) f=schemes/$s.lua;; esac
    if [ "$(left)" -lt 45 ]; then echo "skipped $s: under 45 s left" | tee -a "$O/dump.log"; continue; fi
    t0=$SECONDS
    if timeout "$(($(left) - 15))" out/bin/kvforge eval --scheme "$f" --data "$D" ${TB_EVAL_BACKEND---gpu} --threads "$(nproc)" \
        --json > /tmp/e.json 2>>"$O/dump.log"; then
      { printf '{"scheme":"%s","wall_s":%d,"report":' "$(basename "$s" .lua)" $((SECONDS - t0))
        tr -d '\n' < /tmp/e.json; echo '}'; } >> "$O/eval_long.jsonl"
      echo "$s: $((SECONDS - t0)) s" | tee -a "$O/dump.log"
    else
      echo "$s: kvforge eval failed or ran out of time" | tee -a "$O/dump.log"
    fi
  done
  $PY - "$O/eval_long.jsonl" <<'PY' | tee "$O/eval_long_tables.txt"
import json, sys
keys = ["top1_shift", "top5_overlap", "attn_out_rel_err", "key_mse", "value_mse", "qk_err", "compression"]
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("overall (every layer, every step): " + " ".join(keys))
print("%-20s" % "scheme" + "".join("%17s" % k for k in keys) + "%8s" % "wall_s")
fmt = lambda v: "%17.5g" % (v if v is not None else float("nan"))
for r in rows:
    o = r["report"]["overall"]
    print("%-20s" % r["scheme"] + "".join(fmt(o.get(k)) for k in keys) + "%8d" % r["wall_s"])
# How the attention error grows with the context: per step (chunk), mean over the layers.
for k in ("top1_shift", "attn_out_rel_err"):
    print(f"\n{k} by step (chunk c attends c+1 chunks), mean over layers")
    steps = None
    for r in rows:
        per = {}
        for L in r["report"]["layers"]:
            for c in L.get("chunks", []):
                if c.get(k) is not None:
                    per.setdefault(c["chunk"], []).append(c[k])
        cs = sorted(per)
        if steps is None:
            steps = [c for c in cs if c in (1, 2, 4, 8, 16, 24) or c == cs[-1]]
            print("%-20s" % "scheme" + "".join("%10s" % ("c=%d" % c) for c in steps))
        print("%-20s" % r["scheme"] + "".join("%10.4g" % (sum(per[c]) / len(per[c])) if c in per else "%10s" % "-"
                                              for c in steps))
PY
  ;;
peaked)
  frames
  WL=$(large_weights) || exit 2
  timeout "$(left)" $PY $WM/peaked.py --frames "$FR" --weights small=$WM/weights.safetensors --weights large="$WL" \
      --chunks "${WM_PEAKED_CHUNKS:-8}" --q-stride "${WM_PEAKED_QSTRIDE:-16}" --json "$O/peaked.json" 2>&1 \
      | tee "$O/peaked.txt"
  exit "${PIPESTATUS[0]}"
  ;;
*)
  sed -n '2,/^set -u/p' "$0" | sed '$d'
  exit 2
  ;;
esac
