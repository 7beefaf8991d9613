#!/usr/bin/env bash
# Block-streamed attention over the packed cache (kvforge.attention) on the GPU
# machine, from the repository root with out/ carried (built here by `make all`;
# pytest comes from out/gpu-py where the machine has none: run
# `bash tools/gpu/attention.sh --prepare` here first, which is binding.sh's).
#
# About 90 s in all, each step bounded by `timeout` (at most 142 s):
#   1. python/tests/test_attention.py, its CUDA tests: cache.attention on CUDA
#      against the CPU reference (rtn_int2, qvg_int2, a sink/recent/span policy,
#      a rope "pre" scheme, batch + nhd, anchors; blocks per entry and grouped;
#      the Triton and the torch merge), and a CUDA graph capture + replay of one
#      decode + attention step against eager (55 s at most);
#   2. bench/attention_bench.py: LongCat's layer shape (32 heads, chunks of 4940
#      tokens, 6/12/24 chunks) and the world model's (2 KV heads, 8 query heads,
#      chunks of 4680, 4/8/16/32 chunks), rtn_int2 and qvg_int2, 4680 queries:
#      time and peak transient memory of decode-everything-then-SDPA against
#      block-streamed attention (a block per entry, and 4 chunks a block), the
#      errors against it and against float32, and a CUDA graph of one step
#      (85 s at most; configurations not started after 60 s are skipped, and
#      say so).
# Writes to $OUT/attention/: env.txt, pytest.txt, attention.json, attention.txt, bench.log.
# KVF_ATTN_BENCH_ARGS: more bench options (here, on the CPU, the whole script is
# checked with KVF_ATTN_BENCH_ARGS="--device cpu --tiny --rounds 2 --inner 1").
set -u
if [ "${1:-}" = "--prepare" ]; then
  exec bash tools/gpu/binding.sh --prepare
fi

out=${OUT:-/tmp}/attention
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/out/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export KVFORGE_LIB=$PWD/out/lib/libkvforge.so KVFORGE_CLI=$PWD/out/bin/kvforge
# One JIT cache for both steps: the bench reuses the kernels the tests compiled.
export KVFORGE_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
export KVF_COMMIT=$(cat out/COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)
pyp=$PWD/python
python3 -c 'import pytest' 2>/dev/null || pyp=$pyp:$PWD/out/gpu-py
start=$SECONDS
{
  echo "commit $KVF_COMMIT"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
  python3 -c 'import triton; print("triton", triton.__version__)' 2>&1 | tail -1
} >"$out/env.txt" 2>&1
cat "$out/env.txt"

echo "== pytest: test_attention.py, CUDA tests"
if PYTHONPATH=$pyp python3 -c 'import pytest' 2>/dev/null; then
  PYTHONPATH=$pyp timeout 55 python3 -m pytest -q -rs -p no:cacheprovider -k cuda \
    python/tests/test_attention.py >"$out/pytest.txt" 2>&1
  echo "pytest exit $? after $((SECONDS - start)) s"
  tail -8 "$out/pytest.txt"
else
  echo "no pytest here and no out/gpu-py (bash tools/gpu/attention.sh --prepare on the development machine)" \
    | tee "$out/pytest.txt"
fi

echo "== bench/attention_bench.py"
PYTHONPATH=$pyp timeout 85 python3 bench/attention_bench.py --out "$out" --budget-s 60 ${KVF_ATTN_BENCH_ARGS:-} >"$out/bench.log" 2>&1
echo "bench exit $? after $((SECONDS - start)) s"
tail -25 "$out/bench.log"
