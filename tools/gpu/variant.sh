#!/usr/bin/env bash
# Build the work tree as it is now (committed or not) as a named variant for
# an A/B run on the GPU machine: static kvf_bench and test_gpu (templates
# embedded at build time) in out/xbench/NAME, objects in out/xbuild/NAME.
#   tools/gpu/variant.sh NAME
# Typical use: change a template, `tools/gpu/variant.sh NAME`, undo the change,
# `make all carry`; carry out/bin, out/lib and out/xbench; on the GPU machine
# `bash tools/gpu/h200_validate.sh ab` benches out/bin against every variant.
set -eu
name=${1:?usage: tools/gpu/variant.sh NAME}
case $name in *[!A-Za-z0-9_.-]*) echo "variant name: letters, digits, _ . - only" >&2; exit 2;; esac
make -s -j"$(nproc)" O="out/xbuild/$name" "out/xbuild/$name/bin/kvf_bench" "out/xbuild/$name/bin/test_gpu"
mkdir -p "out/xbench/$name"
cp "out/xbuild/$name/bin/kvf_bench" "out/xbuild/$name/bin/test_gpu" "out/xbench/$name/"
git rev-parse --short HEAD > "out/xbench/$name/BASE"
git status --short --untracked-files=all > "out/xbench/$name/DIFF" # what differs from BASE (out/ is ignored)
echo "variant $name: out/xbench/$name (on $(cat "out/xbench/$name/BASE"), $(wc -l < "out/xbench/$name/DIFF") files changed)"
