#!/usr/bin/env bash
# Run on the GPU machine over a copy of the work tree with out/ carried
# (built here by `make all aot-demo carry`). Prints what docs/VALIDATION.md records.
set -u
export LD_LIBRARY_PATH=$PWD/out/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export KVF_SRC=$PWD KVFORGE_CACHE_DIR=$(mktemp -d)
log=${OUT:-/tmp}/validate.log
{
echo "== commit $(cat out/COMMIT 2>/dev/null || echo unknown)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "== tests"
fails=0
for t in out/bin/test_*; do echo "--- $t"; "$t" || fails=$((fails+1)); done
echo "test binaries failed: $fails"
echo "== demo (GPU)"
out/bin/kvforge demo schemes/rtn_int2.lua
out/bin/kvforge demo schemes/rtn_int4.lua
echo "== cold compile (cache off) and warm"
KVFORGE_CACHE=0 out/bin/kvforge compile rtn_int2 --arch sm_90
out/bin/kvforge compile rtn_int2 --arch sm_90
out/bin/kvforge compile rtn_int2 --arch sm_90
echo "== exported kernels with NVRTC unreachable"
KVFORGE_NVRTC_PATH=/nonexistent LD_DEBUG=libs out/bin/aot_demo 2>ld.txt; echo "aot_demo exit $?"
echo "libraries opened that mention nvrtc: $(grep -c 'nvrtc' ld.txt)"
if command -v compute-sanitizer >/dev/null; then
  echo "== compute-sanitizer memcheck over test_gpu"
  compute-sanitizer --tool memcheck --error-exitcode 9 out/bin/test_gpu >san.txt 2>&1; echo "memcheck exit $?"; tail -5 san.txt
  echo "== compute-sanitizer racecheck over test_gpu"
  compute-sanitizer --tool racecheck --error-exitcode 9 out/bin/test_gpu >san2.txt 2>&1; echo "racecheck exit $?"; tail -3 san2.txt
fi
} 2>&1 | tee "$log"
