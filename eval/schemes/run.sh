#!/usr/bin/env bash
# The CPU frontier and the pipeline's ablation on one dump: `kvforge eval` (the
# CPU reference) of the shipped schemes named below and of every scheme file in
# this folder, one combined JSON, the Pareto plot and the per-layer comparison
# (eval/frontier.py). Mixed-precision schemes read the sensitivity table TABLE
# (default: the scheme's own small-model table in eval/worldmodel/tables/, else
# stable_int2's there).
#
#   bash eval/schemes/run.sh DUMP OUTDIR [TABLE]
#
# Knobs: KVF_FRONTIER_SHIPPED (the shipped schemes, space-separated),
# KVF_FRONTIER_FILES (scheme files instead of this folder's), KVF_THREADS.
# On the small world model's 16-chunk dump (3 layers) it takes about an hour on
# 2 cores; the k-means schemes take the longest.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
[ $# -ge 2 ] || { echo "usage: $0 DUMP OUTDIR [TABLE]" >&2; exit 2; }
dump=$1 out=$2 table=${3:-$repo/eval/worldmodel/tables/stable_int2.small.json}
py=${PYTHON:-$repo/.venv/bin/python}
[ -x "$py" ] || py=python3
shipped=${KVF_FRONTIER_SHIPPED:-"rtn_int2 kivi_int2 quarot_int2 qvg_int2 quantwm_int2 qvg7_int2 quantwm7_int2 qvg8_ternary qvg9_ternary qvg7k_ternary stable_int2 stable_noef_int2 stable_qvg_int2 rtn_int4 qvg_int4"}
files=${KVF_FRONTIER_FILES:-$(ls "$here"/*.lua)}
mkdir -p "$out/tables"
# frontier.py gives a mixed-precision scheme NAME the table NAME.json: one copy a name.
# A shipped scheme with its own table of the small model (eval/worldmodel/tables/NAME.small.json)
# takes it unless TABLE is named.
for s in $shipped $files; do
  n=$(basename "$s" .lua)
  own=$repo/eval/worldmodel/tables/$n.small.json
  if [ $# -lt 3 ] && [ -f "$own" ]; then cp "$own" "$out/tables/$n.json"; else cp "$table" "$out/tables/$n.json"; fi
done
# shellcheck disable=SC2086
"$py" "$repo/eval/frontier.py" run --kvforge "$repo/out/bin/kvforge" --data "$dump" \
  --schemes $shipped $files --table-dir "$out/tables" ${KVF_THREADS:+--threads $KVF_THREADS} \
  --out "$out/combined.json" | tee "$out/summary.txt"
title="kvforge on $(basename "$dump") (CPU reference)"
"$py" "$repo/eval/frontier.py" plot "$out/combined.json" --png "$out/frontier.png" --title "$title" | tee -a "$out/summary.txt"
"$py" "$repo/eval/frontier.py" plot "$out/combined.json" --bytes held --png "$out/frontier_held.png" \
  --title "$title, bytes held" | tee -a "$out/summary.txt"
"$py" "$repo/eval/frontier.py" compare "$out/combined.json" --png "$out/compare.png" --md "$out/compare.md" --title "$title"
