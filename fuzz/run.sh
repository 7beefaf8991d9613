#!/bin/sh
# Run one libFuzzer target for a bounded time and summarize it.
#   fuzz/run.sh BIN SECONDS WORKDIR ARTIFACT_DIR LOG [extra libFuzzer args] -- CORPUS_DIR...
# New inputs go to WORKDIR (the first corpus directory); seeds are read from the
# others. Prints one summary line; exits 1 if the target crashed, leaked, hit a
# sanitizer error or timed out on an input (the input is in ARTIFACT_DIR).
set -u
bin=$1 secs=$2 work=$3 art=$4 log=$5
shift 5
args=""
while [ $# -gt 0 ] && [ "$1" != "--" ]; do args="$args $1"; shift; done
[ $# -gt 0 ] && shift
seeds=""
for d in "$@"; do [ -d "$d" ] && seeds="$seeds $d"; done
mkdir -p "$work" "$art" "$(dirname "$log")"
name=$(basename "$bin")
before=$(ls "$art" | wc -l)
# shellcheck disable=SC2086
"$bin" -max_total_time="$secs" -print_final_stats=1 -artifact_prefix="$art/" $args "$work" $seeds >"$log" 2>&1
rc=$?
after=$(ls "$art" | wc -l)
runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
persec=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
cov=$(grep -E '^#[0-9]+' "$log" | tail -1 | sed -n 's/.*cov: \([0-9]*\).*ft: \([0-9]*\).*corp: \([0-9]*\).*/cov \1, ft \2, corpus \3/p')
echo "$name: ${runs:-?} executions in ${secs}s (${persec:-?}/s), ${cov:-no coverage line}, rc $rc, new artifacts $((after - before)) (log: $log)"
if [ $rc -ne 0 ] || [ "$after" -ne "$before" ]; then
  grep -E 'ERROR|SUMMARY|fuzz check failed|ALARM|runtime error' "$log" | head -20
  exit 1
fi
