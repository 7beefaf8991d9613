#!/usr/bin/env bash
# The world model under Ulysses sequence parallelism on 2 GPUs (NCCL), kvforge on every
# rank (eval/worldmodel/sp_rollout.py). Needs a machine with 2 GPUs (nvidia-h200-x2). Run
# from the repository root with out/lib carried (libkvforge.so and what `make carry` puts
# beside it) and, for the real footage, out/data/vtest.avi (`make data`; without it the
# frames are synthetic). One device command, about 1 to 3 minutes (an estimate from the
# rollout timings in eval/worldmodel/TESTBED.md), under its own time guard
# (SP_DEADLINE seconds, default 570). Writes to $OUT:
#
#   sp_check.json   2 ranks against 1 process: the large model, 1 real chunk then
#                   SP_CHECK_CHUNKS (6) generated, schemes bf16, rtn_int2, qvg_int2: per
#                   scheme whether the generated chunks are identical, their largest
#                   difference and PSNR per chunk against the single-process rollout
#   sp_long.json    the long stream: 1 real chunk, SP_CHUNKS (31) generated (the last
#                   predicted from 140,400 cached tokens), bf16 and SP_SCHEME (qvg_int2):
#                   per-GPU peak memory, cache bytes per GPU and seconds per chunk on 2
#                   GPUs, and (--check) the same rollout on one GPU (rank 0) for both
#   sp_summary.txt  the tables of both
#   sp.log          everything printed
#
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
# NVSHMEM_DISABLE_NVLS=1): a program using it can take the host's shared GPUs out of
# service. Environment: SP_NPROC (2), SP_WEIGHTS (default eval/worldmodel/
# weights_large.safetensors), SP_SCHEME, SP_CHUNKS, SP_CHECK_CHUNKS, SP_CHECK_SCHEMES
# (rtn_int2,qvg_int2), SP_SYNTHETIC (N synthetic frames instead of the footage). A dry
# run on a machine without GPUs: SP_DEVICE=cpu (gloo), SP_PYTHON (the python with torch),
# SP_WEIGHTS (a tiny model, or the large one with few chunks and rtn_int2 alone).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 LD_LIBRARY_PATH=$PWD/out/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export KVFORGE_CACHE_DIR=${KVFORGE_CACHE_DIR:-/tmp/kc} KVFORGE_LIB=$PWD/out/lib/libkvforge.so
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
O=${OUT:-/tmp/out}; mkdir -p "$O"
DEADLINE=$((SECONDS + ${SP_DEADLINE:-570}))
left() { echo $((DEADLINE - SECONDS)); }
PY=${SP_PYTHON:-python3}
NP=${SP_NPROC:-2}
DEV=${SP_DEVICE:-cuda}
W=${SP_WEIGHTS:-eval/worldmodel/weights_large.safetensors}
LOG=$O/sp.log
: > "$LOG"

{
  echo "== sp (commit $(git rev-parse --short HEAD 2>/dev/null || cat out/COMMIT 2>/dev/null || echo unknown))"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
  env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)=' | sort
} | tee -a "$LOG"
[ -f "$KVFORGE_LIB" ] || { echo "no $KVFORGE_LIB: run make here and carry out/lib" | tee -a "$LOG"; exit 2; }
[ -f "$W" ] || { echo "no weights $W" | tee -a "$LOG"; exit 2; }
if [ "$DEV" = cuda ]; then
  n=$($PY -c 'import torch; print(torch.cuda.device_count())' 2>>"$LOG")
  [ "${n:-0}" -ge "$NP" ] || { echo "$NP GPUs needed, torch sees ${n:-0}" | tee -a "$LOG"; exit 2; }
fi

src=()
if [ -n "${SP_SYNTHETIC:-}" ]; then
  src=(--synthetic "$SP_SYNTHETIC" --first-frame 0)
elif [ -f out/data/vtest.avi ]; then
  FR=/tmp/sp_frames.npz
  if [ ! -s "$FR" ]; then
    timeout "$(left)" $PY eval/worldmodel/frames.py --fast out/data/vtest.avi "$FR.tmp.npz" >>"$LOG" 2>&1 \
      && mv "$FR.tmp.npz" "$FR" || { echo "frames.py failed" | tee -a "$LOG"; exit 1; }
  fi
  src=(--frames "$FR" --first-frame 636)
else
  echo "no out/data/vtest.avi: synthetic frames" | tee -a "$LOG"
  src=(--synthetic 120 --first-frame 0)
fi

sp() {  # sp_rollout.py on $NP ranks, under the time guard
  timeout "$(left)" $PY -m torch.distributed.run --standalone --nproc_per_node "$NP" \
      eval/worldmodel/sp_rollout.py --weights "$W" "${src[@]}" --device "$DEV" "$@" 2>&1 | tee -a "$LOG"
  return "${PIPESTATUS[0]}"
}

rc=0
echo "== check: $NP ranks against 1 process" | tee -a "$LOG"
sp --chunks "${SP_CHECK_CHUNKS:-6}" --schemes "bf16,${SP_CHECK_SCHEMES:-rtn_int2,qvg_int2}" --check --json "$O/sp_check.json" || rc=1
echo "== long stream: ${SP_CHUNKS:-31} chunks generated" | tee -a "$LOG"
sp --chunks "${SP_CHUNKS:-31}" --schemes "bf16,${SP_SCHEME:-qvg_int2}" --check --json "$O/sp_long.json" || rc=1

$PY - "$O/sp_check.json" "$O/sp_long.json" <<'PY' 2>&1 | tee "$O/sp_summary.txt"
import json, os, sys
MiB = 2 ** 20
for path in sys.argv[1:]:
    if not os.path.exists(path):
        print(f"{os.path.basename(path)}: missing")
        continue
    r = json.load(open(path))
    print(f"\n{os.path.basename(path)}: {r['world_size']} ranks ({r['backend']}, {r['device']}), "
          f"{r['kv_heads_per_rank']} KV / {r['q_heads_per_rank']} query heads and {r['tokens_per_rank']} tokens "
          f"a rank, {r['generated_chunks']} chunk(s) generated, {r['context_tokens_at_last_chunk']} tokens cached "
          f"at the last{' (partial)' if r['partial'] else ''}")
    print("%-10s %7s %10s %20s %11s | %10s %11s | %9s %12s %9s" % (
        "scheme", "ratio", "cache/GPU", "peak/GPU (over mdl)", "ms/chunk", "1-GPU peak", "1-GPU ms/ch",
        "identical", "max |diff|", "min PSNR"))
    for n, s in r["schemes"].items():
        if s["status"] != "ok":
            print(f"{n:10s} ERROR {s.get('error')}")
            continue
        pk = s["peak_gpu_bytes_per_rank"]
        po = s["peak_gpu_bytes_over_model_per_rank"]
        peak = "/".join(f"{x / MiB:.0f}" for x in pk) + " (" + "/".join(f"{x / MiB:.0f}" for x in po) + ")" \
            if pk[0] is not None else "-"
        c = s.get("check") or {}
        p1 = c.get("single_peak_gpu_bytes")
        print("%-10s %6.2fx %9.1fM %20s %11.1f | %10s %11s | %9s %12.4g %9.2f" % (
            n, s["compression_ratio"], max(s["cache_bytes_per_rank"]) / MiB, peak,
            1e3 * s["mean_seconds_per_generated_chunk"],
            f"{p1 / MiB:.0f}M" if p1 else "-",
            f"{1e3 * c['single_mean_seconds_per_generated_chunk']:.1f}" if c else "-",
            c.get("identical", "-"), c.get("max_abs_diff", float("nan")),
            min(c["psnr_vs_single_per_chunk"]) if c else float("nan")))
PY
ls -l "$O" | tee -a "$LOG"
exit "$rc"
