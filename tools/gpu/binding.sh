#!/usr/bin/env bash
# The Python binding's GPU parts, on the GPU machine, from the repository root
# with out/ carried (built here by `make all carry`, then
# `bash tools/gpu/binding.sh --prepare` here, which puts pytest and its
# dependencies, unpacked, in out/gpu-py for a machine without pytest).
#
# Runs, about 90 s in all (each step bounded by `timeout`):
#   * python/tests/test_torch_ops.py: torch.compile (fullgraph) of qstats_update +
#     encode + decode + SDPA on CUDA against eager; CUDA graph capture and replay
#     of decode (functional and decode_into) + SDPA, and of
#     QuantizedKVCache.keys_values(out=...) + SDPA; torch.compile
#     mode="reduce-overhead" over decode + SDPA; a batched cache (batch 3) on
#     the GPU against per-entry caches and the batched CPU reference;
#   * python/tests/test_gpu_torch.py (the binding's GPU tests: GPU against CPU
#     reference, layouts, streams, the chunk policy);
#   * `kvforge demo` and examples/attention_layer.py with a pre-RoPE scheme
#     (3-axis positions) on the GPU.
# Writes to $OUT/binding/: pytest.txt (and junit.xml), demo.txt, example.txt, env.txt.
set -u
if [ "${1:-}" = "--prepare" ]; then
  # Here, on the development machine: pytest for the GPU machine (pure Python wheels).
  set -e
  d=$(mktemp -d)
  python3 -m pip download -q --only-binary=:all: --python-version 3.10 -d "$d" pytest exceptiongroup tomli
  rm -rf out/gpu-py && mkdir -p out/gpu-py
  for w in "$d"/*.whl; do python3 -m zipfile -e "$w" out/gpu-py; done
  rm -rf "$d"
  echo "out/gpu-py: $(ls out/gpu-py | tr '\n' ' ')"
  exit 0
fi

out=${OUT:-/tmp}/binding
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/out/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export KVFORGE_LIB=$PWD/out/lib/libkvforge.so KVFORGE_CLI=$PWD/out/bin/kvforge
export KVFORGE_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
pyp=$PWD/python
python3 -c 'import pytest' 2>/dev/null || pyp=$pyp:$PWD/out/gpu-py
start=$SECONDS
{
  echo "commit $(cat out/COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
  echo "C compiler (inductor/triton launchers): $(command -v cc gcc | head -1)"
  echo "pytest from: $(PYTHONPATH=$pyp python3 -c 'import pytest; print(pytest.__file__, pytest.__version__)')"
} >"$out/env.txt" 2>&1

echo "== pytest (GPU parts of the binding)"
PYTHONPATH=$pyp timeout 150 python3 -m pytest -q -rs -p no:cacheprovider --junitxml="$out/junit.xml" \
  python/tests/test_torch_ops.py python/tests/test_gpu_torch.py >"$out/pytest.txt" 2>&1
echo "pytest exit $? after $((SECONDS - start)) s"
tail -15 "$out/pytest.txt"

pre=$(mktemp -d)/rtn_int4_pre.lua
echo 'return { base = "rtn_int4", name = "rtn_int4_pre", rope = { placement = "pre", sections = { 22, 21, 21 }, layout = "interleaved" } }' >"$pre"
echo "== kvforge demo on the GPU (a pre-RoPE scheme, then quantwm_int2)"
{
  timeout 60 out/bin/kvforge demo "$pre"; echo "exit $?"
  timeout 60 out/bin/kvforge demo quantwm_int2; echo "exit $?"
} >"$out/demo.txt" 2>&1
cat "$out/demo.txt"

echo "== examples/attention_layer.py on the GPU (480p shape, 3 chunks, pre-RoPE scheme)"
PYTHONPATH=$pyp timeout 90 python3 examples/attention_layer.py --scheme "$pre" --chunks 3 >"$out/example.txt" 2>&1
echo "exit $?" >>"$out/example.txt"
tail -6 "$out/example.txt"
echo "== total $((SECONDS - start)) s"
