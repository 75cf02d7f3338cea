#!/usr/bin/env bash
# Issue 27, diagnosis: repeated traced 4-GPU JPEG runs under several conditions, interleaved, until
# a deadline; per-run summaries (bench/spread_trace.py --summary) and the raw traces under OUT.
#   CONDS="name:cpus:workers:env ..." (cpus: all or a taskset list; workers: auto or a number;
#   env: comma-separated VAR=value or -), ROUNDS, DEADLINE (seconds after start to stop starting runs)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/spread}" DATA="${DATA:-/tmp/jpegs}" PY="${PY:-python3}"
STEPS="${STEPS:-50}" EPOCHS="${EPOCHS:-3}" BATCH="${BATCH:-256}" LAYOUT="${LAYOUT:-tar}"
ROUNDS="${ROUNDS:-4}" DEADLINE="${DEADLINE:-470}" SYN="${SYN:-1}"
CONDS="${CONDS:-c64w15:all:auto:- c48w11:0-47:auto:- c64w11:all:11:- c64w15u:all:auto:TRACE_IN_ORDER=0}"
GPUS="$(nvidia-smi -L | wc -l)"
T0=$(date +%s)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/trainer_images/trainer${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT" /tmp/tr
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; echo "cpus $(nproc)"; date -u
  cat COMMIT 2>/dev/null || git log -1 --format="commit %h"; lscpu | grep -E 'Model name|Thread|Core|Socket|NUMA'
  for c in 0 1 2 31 32 47 48 63; do echo "cpu$c siblings $(cat /sys/devices/system/cpu/cpu$c/topology/thread_siblings_list 2>/dev/null)"; done
  nvidia-smi topo -m; python3 -c 'import torch,torchvision; print(torch.__version__, torchvision.__version__)'; } >"$OUT/machine.txt" 2>&1
[[ -d $DATA/tar ]] || "$PY" bench/make_jpegs.py "$DATA" --images 25600 >>"$OUT/machine.txt"
src_of() { [[ $LAYOUT == tar ]] && echo "$DATA/tar" || echo "$DATA/folder/train"; }
rate_of() { "$PY" -c 'import json,sys
for l in open(sys.argv[1]):
    if l.startswith("{") and json.loads(l).get("final"): print(json.loads(l)["imagesPerSec"])' "$1"; }
res="$OUT/runs.jsonl"; : >"$res"
if [[ $SYN == 1 ]]; then
  torchrun --standalone --nproc-per-node "$GPUS" -m trainop_trainer --framework pytorch --backend native --synthetic \
    --num-classes 100 --precision bf16 --channels-last --batch-size "$BATCH" --epochs "$EPOCHS" --steps-per-epoch "$STEPS" \
    --output-dir /tmp/o-syn >/tmp/tr/syn.log 2>&1
  echo "{\"cond\": \"synthetic\", \"imagesPerSec\": $(rate_of /tmp/tr/syn.log || echo null), \"t\": $(( $(date +%s) - T0 ))}" | tee -a "$res"
fi
for round in $(seq 1 "$ROUNDS"); do
  for c in $CONDS; do
    IFS=: read -r name cpus workers envs <<<"$c"
    (( $(date +%s) - T0 > DEADLINE )) && break 2
    d="/tmp/tr/$name-$round"; mkdir -p "$d"
    pre=(); [[ $cpus == all ]] || pre=(taskset -c "$cpus")
    envv=(); [[ $envs == - ]] || IFS=, read -ra envv <<<"$envs"
    "$PY" bench/spread_trace.py --sample "$d/threads.jsonl" & sampler=$!
    s=$(date +%s)
    env TRACE_DIR="$d" "${envv[@]}" "${pre[@]}" torchrun --standalone --nproc-per-node "$GPUS" bench/spread_trace.py \
      --framework pytorch --backend native --data-dir "$(src_of)" --loader-workers "$workers" --precision bf16 --channels-last \
      --batch-size "$BATCH" --epochs "$EPOCHS" --steps-per-epoch "$STEPS" --output-dir "/tmp/o-$name" >"$d/train.log" 2>&1
    kill "$sampler"; wait "$sampler" 2>/dev/null
    rate=$(rate_of "$d/train.log")
    [[ -n $rate ]] || tail -5 "$d/train.log"
    echo "{\"cond\": \"$name\", \"round\": $round, \"imagesPerSec\": ${rate:-null}, \"seconds\": $(( $(date +%s) - s )), \"t\": $(( $(date +%s) - T0 ))}" | tee -a "$res"
  done
done
"$PY" bench/spread_trace.py --summary /tmp/tr/*-[0-9]* >"$OUT/summary.jsonl" 2>"$OUT/summary.err"
tar czf "$OUT/traces.tgz" -C /tmp tr 2>/dev/null
echo "done in $(( $(date +%s) - T0 )) s"
