#!/usr/bin/env bash
# Issue 27, second diagnosis: does CPU load alone (no data dependence) slow the training step, and
# does reserving CPUs for each rank's own process restore it? In one call:
#   syn          synthetic data (baseline)
#   syn+load     synthetic data while bench/loader_probe.py (new-cpu, W workers per rank, 4 ranks)
#                decodes the JPEG set beside it: the CPU load of the real pipeline, none of its data
#   tar          JPEG tars, default settings
#   tar-w13      JPEG tars, 13 workers per rank (control for the next)
#   tar-res2     JPEG tars, 13 workers per rank, each rank's process on 2 reserved CPUs, workers on the rest
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/spread-b}" DATA="${DATA:-/tmp/jpegs}" PY="${PY:-python3}" DEADLINE="${DEADLINE:-240}"
ORDER="${ORDER:-syn syn+load tar tar-res2 tar-w13 tar tar-res2 syn+load}"
T0=$(date +%s) GPUS="$(nvidia-smi -L | wc -l)"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 BATCH=256
export PYTHONPATH="$PWD/trainer_images/trainer${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT" /tmp/trb
{ nvidia-smi --query-gpu=name --format=csv,noheader | head -1; echo "cpus $(nproc)"; date -u; cat COMMIT; } | tee "$OUT/machine.txt"
[[ -d $DATA/tar ]] || "$PY" bench/make_jpegs.py "$DATA" --images 25600 >>"$OUT/machine.txt"
res="$OUT/runs.jsonl"; : >"$res"
i=0
for c in $ORDER; do
  (( $(date +%s) - T0 > DEADLINE )) && break
  i=$((i + 1)); d="/tmp/trb/$c-$i"; mkdir -p "$d"
  src=(--data-dir "$DATA/tar") envv=() bg=
  case $c in
    syn|syn+load) src=(--synthetic --num-classes 100) ;;
    tar-w13) src+=(--loader-workers 13) ;;
    tar-res2) src+=(--loader-workers 13); envv=(TRACE_RESERVE=2) ;;
  esac
  "$PY" bench/spread_trace.py --sys "$d/sys.jsonl" & sys_pid=$!
  if [[ $c == syn+load ]]; then
    torchrun --standalone --nproc-per-node "$GPUS" bench/loader_probe.py "$DATA/tar" --variant new-cpu \
      --workers $(( $(nproc) / GPUS - 1 )) --seconds 60 >"$d/probe.log" 2>&1 & bg=$!
  fi
  s=$(date +%s)
  env TRACE_DIR="$d" "${envv[@]}" torchrun --standalone --nproc-per-node "$GPUS" bench/spread_trace.py --framework pytorch \
    --backend native "${src[@]}" --precision bf16 --channels-last --batch-size 256 --epochs 3 --steps-per-epoch 50 \
    --output-dir "/tmp/o-$c" >"$d/train.log" 2>&1
  [[ -n $bg ]] && { kill -- "$bg"; pkill -P "$bg"; wait "$bg" 2>/dev/null; }
  kill "$sys_pid"; wait "$sys_pid" 2>/dev/null
  rate=$("$PY" -c 'import json,sys
for l in open(sys.argv[1]):
    if l.startswith("{") and json.loads(l).get("final"): print(json.loads(l)["imagesPerSec"])' "$d/train.log")
  [[ -n $rate ]] || tail -5 "$d/train.log"
  echo "{\"cond\": \"$c\", \"i\": $i, \"imagesPerSec\": ${rate:-null}, \"seconds\": $(( $(date +%s) - s )), \"t\": $(( $(date +%s) - T0 ))}" | tee -a "$res"
  "$PY" bench/spread_trace.py --summary "$d" >>"$OUT/summary.jsonl"
done
tar czf "$OUT/traces.tgz" -C /tmp trb
