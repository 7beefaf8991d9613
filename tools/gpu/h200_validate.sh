#!/usr/bin/env bash
# Run on the GPU machine over a copy of the work tree with out/ carried
# (built here by `make all aot-demo carry`). Prints what docs/VALIDATION.md
# and docs/BENCHMARKS.md record. Parts: tests, demo, jit, aot, sanitizer, bench
# (the default set), and python (pytest and examples on the GPU) and profile
# (ncu per-kernel times of one layer's encode + decode) and source (ncu's
# SASS source view of single kernel launches, summarized by
# tools/gpu/ncu_source.py) and ab (out/bin against every variant in out/xbench,
# built by tools/gpu/variant.sh), which only run when named, e.g.
# `bash tools/gpu/h200_validate.sh tests bench python`.
set -u
export LD_LIBRARY_PATH=$PWD/out/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export KVF_SRC=$PWD KVFORGE_CACHE_DIR=$(mktemp -d) KVFORGE_LIB=$PWD/out/lib/libkvforge.so
parts=${*:-tests demo jit aot sanitizer bench}
log=${OUT:-/tmp}/validate.log
has() { case " $parts " in *" $1 "*) return 0;; esac; return 1; }
{
echo "== commit $(cat out/COMMIT 2>/dev/null || echo unknown)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
if has tests; then
  echo "== tests"
  fails=0
  # KVF_VALIDATE_TESTS: the test binaries to run (names; default all)
  bins=out/bin/test_*
  [ -n "${KVF_VALIDATE_TESTS:-}" ] && bins=$(printf 'out/bin/%s ' $KVF_VALIDATE_TESTS)
  for t in $bins; do
    echo "--- $t"
    "$t" >"${OUT:-/tmp}/test.txt" 2>&1 || { fails=$((fails+1)); echo "FAILED: $t"; }
    grep -vE '^\[ *(RUN|OK) ' "${OUT:-/tmp}/test.txt"
  done
  echo "test binaries failed: $fails"
fi
if has demo; then
  echo "== demo (GPU)"
  for s in rtn_int2 qvg_int2 quantwm_int2; do out/bin/kvforge demo schemes/$s.lua; done
fi
if has jit; then
  # NVRTC 13 keeps what it compiles in the driver's compute cache (~/.nv) where
  # it can load libcuda, so a second compile of the same source there reads
  # ~0.4 s: CUDA_CACHE_DISABLE=1 makes each of these a first compile
  # (docs/journal/benchmarks.md, entry f481413).
  echo "== cold compile (kvforge and driver caches off, fresh processes: the target's <= 3 s) and warm"
  for s in rtn_int2 qvg_int2 quantwm_int2; do CUDA_CACHE_DISABLE=1 KVFORGE_CACHE=0 out/bin/kvforge compile $s --arch sm_90; done
  out/bin/kvforge compile quantwm_int2 --arch sm_90
  out/bin/kvforge compile quantwm_int2 --arch sm_90
fi
if has aot; then
  echo "== exported kernels with NVRTC unreachable"
  KVFORGE_NVRTC_PATH=/nonexistent LD_DEBUG=libs out/bin/aot_demo 2>ld.txt; echo "aot_demo exit $?"
  echo "libraries opened that mention nvrtc: $(grep -c 'nvrtc' ld.txt)"
fi
if has sanitizer && command -v compute-sanitizer >/dev/null; then
  # KVF_TEST_SMALL=1 (tests/test_gpu.c): the same tests on a few dozen tokens and
  # 2 heads; at full size racecheck did not finish test_gpu in 150 s. First the
  # shared-memory kernels (k-means assign: qvg_int2, and assign_ranges, whose
  # blocks stage two heads in turn; query statistics: quantwm_int2), then every
  # shipped scheme; each run bounded by `timeout` (exit 124 = timed out), 580 s
  # at most in all: the part fits one 600 s command on its own. The k-means
  # list took 132 s and, once, more than 140 (docs/journal/validation.md, entry
  # 550dd58), so 200.
  echo "== compute-sanitizer over test_gpu in small mode (API errors of the deliberate bad-image test not reported)"
  san() { # name, scheme list ("" = all), tool, limit in s, extra options (may be absent)
    local start=$SECONDS rc
    KVF_TEST_SMALL=1 KVF_TEST_SCHEMES="$2" timeout "$4" compute-sanitizer --tool "$3" ${5:-} --error-exitcode 9 \
      out/bin/test_gpu >"${OUT:-/tmp}/san_$1.txt" 2>&1; rc=$?
    echo "$1: $3 ${2:-all schemes}: exit $rc after $((SECONDS - start)) s"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Invalid|out of bounds|hazard|PASSED|FAILED" "${OUT:-/tmp}/san_$1.txt" | head -6
  }
  san race_kmeans_qstats qvg_int2,quantwm_int2,assign_ranges racecheck 200
  [ -n "${KVF_SAN_ALL:-}" ] && san race_all "" racecheck 240 # KVF_SAN_ALL=1: every scheme (about 4 min)
  san mem_all "" memcheck 140 "--report-api-errors no"
fi
if has python; then
  echo "== python binding on the GPU"
  PYTHONPATH=python python3 -m pytest -q -s -rs python/tests 2>&1 | tail -25
  PYTHONPATH=python python3 examples/attention_layer.py --scheme schemes/rtn_int2.lua --chunks 4
  PYTHONPATH=python python3 examples/attention_layer.py --scheme schemes/quantwm_int2.lua --chunks 4
fi
if has profile && command -v ncu >/dev/null; then
  echo "== ncu: per-kernel time of one encode + decode of the layer (qvg_int2, quantwm_int2)"
  for s in qvg_int2 quantwm_int2; do
    ncu --clock-control none --metrics gpu__time_duration.sum --csv out/bin/kvf_bench --reps 1 --no-probe $s \
      >${OUT:-/tmp}/ncu_$s.csv 2>&1
    python3 - ${OUT:-/tmp}/ncu_$s.csv <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
hdr = rows[0]; k = hdr.index("Kernel Name"); v = hdr.index("Metric Value"); u = hdr.index("Metric Unit")
scale = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0, "second": 1e3, "s": 1e3}
tot = collections.OrderedDict()
for r in rows[1:]:
    name = r[k].split("_", 3)[-1] if r[k].startswith("kvf_") else r[k]
    t, n = tot.get(name, (0.0, 0)); tot[name] = (t + float(r[v].replace(",", "")) * scale.get(r[u], float("nan")), n + 1)
for name, (t, n) in tot.items(): print(f"  {name:28s} {n:4d} launches {t:9.3f} ms total {t/n:8.3f} ms each")
PY
  done
fi
if has source && command -v ncu >/dev/null; then
  # KVF_SOURCE: "SCHEME:KERNEL_REGEX ..." (regex over the kernel's name, e.g.
  # kvf_qvg_int2_e50221e9_k_assign); the first matching launch of
  # `kvf_bench --reps 1 SCHEME` is profiled with `--set full` (about 20 s
  # each). The CSVs and logs come back as one archive (the GPU machine
  # returns at most 8 files).
  default_source='qvg_int2:_k_assign$ quantwm_int2:_k_assign_qsac$ quantwm_int2:_k_residual$'
  echo "== ncu source view of single launches: ${KVF_SOURCE:-$default_source}"
  src_dir=$(mktemp -d)
  for spec in ${KVF_SOURCE:-$default_source}; do
    s=${spec%%:*} k=${spec#*:}
    tag=$(printf '%s_%s' "$s" "$k" | tr -c 'A-Za-z0-9_' '_')
    timeout 200 ncu --set full --import-source yes -k "regex:$k" -c 1 -f -o "$src_dir/$tag" \
      out/bin/kvf_bench --reps 1 "$s" >"$src_dir/$tag.log" 2>&1 || echo "ncu $tag: exit $?"
    if ncu --import "$src_dir/$tag.ncu-rep" --page source --csv --print-source sass >"$src_dir/$tag.csv" \
      2>>"$src_dir/$tag.log"; then
      python3 tools/gpu/ncu_source.py "$src_dir/$tag.csv" --top 12
    else
      echo "ncu $tag: no source page (see $tag.log in the archive)"
    fi
    ncu --import "$src_dir/$tag.ncu-rep" --page details --csv >"$src_dir/${tag}_details.csv" 2>>"$src_dir/$tag.log"
  done
  tar czf "${OUT:-/tmp}/ncu_source.tgz" --exclude='*.ncu-rep' -C "$src_dir" . && echo "CSVs and logs: ncu_source.tgz"
fi
if has ab; then
  # Rounds of `kvf_bench --reps N ARGS SCHEMES` alternating out/bin and each
  # variant (same process order every round, so drift shows as a trend), then
  # each variant's test_gpu over KVF_AB_TEST's schemes (empty: none).
  # KVF_AB_ARGS: more kvf_bench options (unset: --no-probe, the probe not
  # being what an A/B compares; set but empty: none, for binaries built before
  # edcc1e8; e.g. "--no-probe --data eval/worldmodel/kv_small.safetensors").
  rounds=${KVF_AB_ROUNDS:-2} reps=${KVF_AB_REPS:-5} schemes=${KVF_AB_SCHEMES:-qvg_int2 quantwm_int2}
  args=${KVF_AB_ARGS---no-probe}
  echo "== ab: $rounds rounds of kvf_bench --reps $reps $args $schemes (name scheme encode_ms decode_ms of_copy)"
  for r in $(seq "$rounds"); do
    for b in out/bin/kvf_bench out/xbench/*/kvf_bench; do
      [ -x "$b" ] || continue
      v=$(basename "$(dirname "$b")"); [ "$v" = bin ] && v=main
      res=$(timeout 300 "$b" --reps "$reps" $args $schemes 2>&1); rc=$?
      printf '%s\n' "$res" | awk -v v="$v" '$2 ~ /x$/ && NF >= 8 {print "  " v, $1, $3, $6, $9}'
      # a binary that refuses an option (built before it) or fails says so here, not by missing lines
      [ "$rc" = 0 ] || { echo "  $v: kvf_bench exit $rc:"; printf '%s\n' "$res" | tail -3 | sed 's/^/    /'; }
    done
  done
  if [ -n "${KVF_AB_TEST:-}" ]; then
    for t in out/xbench/*/test_gpu; do
      [ -x "$t" ] || continue
      v=$(basename "$(dirname "$t")") start=$SECONDS
      KVF_TEST_SCHEMES=$KVF_AB_TEST timeout 300 "$t" >"${OUT:-/tmp}/ab_$v.txt" 2>&1
      rc=$?
      echo "  test_gpu $v ($KVF_AB_TEST): exit $rc after $((SECONDS - start)) s"
    done
  fi
fi
if has bench; then
  echo "== bench"
  out/bin/kvf_bench
  python3 bench/sdpa.py rtn_int2 kivi_int2 qvg_int2 quantwm_int2
fi
} 2>&1 | tee "$log"
