#!/usr/bin/env bash
# Input-pipeline benchmark (issue 18): the trainer on synthetic data vs real JPEGs, PyTorch, ResNet-50.
#
# In one run on a GPU machine with no network: generate the JPEG set deterministically
# (bench/make_jpegs.py: ImageNet-like sizes, as class folders and as .tar shards); time the GPU
# path's decoders alone (DECODE_PROBE=1: bench/gpu_decode_probe.py, every GPU at once, then one);
# then train on every GPU, by default issue 27's cases: synthetic data, JPEGs with default
# settings (`--decode auto`: split, the workers take what they keep up with at the rates each
# rank measures at start-up, the device decoder the rest) on tars and on class folders, both
# again at CORES_PER_GPU, and the GPU path alone; print images/sec and the ratio to synthetic.
# Then (PROBE=1) bench/loader_probe.py times the loaders alone, without a model, to show where the
# old CPU pipeline lost its time.
#
# Runs vary from run to run (issue 27), so every case runs REPEAT times, in rounds (each round runs
# every case once, so a slow spell of the machine falls on several cases rather than on one), and
# the table gives per case the min and median of the ratio to the median synthetic rate at the
# same GPU count. A case kind:GPUs:C runs under `taskset` on the first C x GPUs CPUs (C cores per
# GPU, as on hosts with fewer cores than this one; the trainer's auto worker count follows).
#
#   bash bench/data_pipeline.sh
# Environment: OUT (output folder, /tmp/data-bench), DATA (/tmp/jpegs; generated when missing),
# IMAGES (25600), GPUS (all), RUNS (kind:GPUs[:cores per GPU]; kind synthetic or <decode>-<layout>,
# decode auto | gpu | cpu, layout tar | folder; a kind ending in +compile adds --compile, one with
# +perimage crops the device half's images one launch each, TRAINOP_DEVICE_CROP=per-image, the
# path before issue 27's batched crop: gpu-tar+perimage:2), CORES_PER_GPU (12: the default RUNS' reduced-core
# cases), REPEAT (3 rounds), DEADLINE (seconds after the start after which no new run starts; none),
# BATCH (256 per GPU), STEPS (50 per epoch), EPOCHS (3; the first is not timed), PROBE (1), PROBES
# (the loader_probe variants), TRACE (0; 1: train through bench/spread_trace.py and summarise each
# run's traces (raw under TRACES, tarred into OUT/traces.tgz): per-step and GPU step times,
# per-worker batch times, CPU steal, GPU clocks),
# DECODE_PROBE (1: time the GPU path's decoders alone first, bench/gpu_decode_probe.py),
# EXTRA (more trainer arguments), PY (python3).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/data-bench}" PY="${PY:-python3}" DATA="${DATA:-/tmp/jpegs}"
IMAGES="${IMAGES:-25600}" BATCH="${BATCH:-256}" STEPS="${STEPS:-50}" EPOCHS="${EPOCHS:-3}"
GPUS="${GPUS:-$(nvidia-smi -L | wc -l)}"
CORES_PER_GPU="${CORES_PER_GPU:-12}" REPEAT="${REPEAT:-3}" DEADLINE="${DEADLINE:-}" TRACE="${TRACE:-0}"
RUNS="${RUNS:-synthetic:$GPUS auto-tar:$GPUS auto-folder:$GPUS auto-tar:$GPUS:$CORES_PER_GPU auto-folder:$GPUS:$CORES_PER_GPU gpu-tar:$GPUS}"
PROBE="${PROBE:-1}" PROBES="${PROBES:-pil old old-nopin old-uint8 new-cpu new-gpu}"
T0=$(date +%s) TRACES="${TRACES:-/tmp/data-bench-traces}"
mkdir -p "$OUT"
results="$OUT/results.jsonl"
: >"$results"
# NVLink multicast stays off on shared hosts (it can take the GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/trainer_images/trainer${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; echo "cpus $(nproc)"; date -u
  cat COMMIT 2>/dev/null || git log -1 --format="commit %h"; } | tee "$OUT/machine.txt"

if [[ ! -d $DATA/tar ]]; then
  start=$(date +%s)
  "$PY" bench/make_jpegs.py "$DATA" --images "$IMAGES" | tee "$OUT/data.txt"
  echo "generated in $(( $(date +%s) - start )) s"
fi

# The GPU path's device half alone (bench/gpu_decode_probe.py: the decoders, then the per-image
# and the batched crop side by side): every GPU at once, then one.
if [[ ${DECODE_PROBE:-1} == 1 ]]; then
  for n in "$GPUS" 1; do
    torchrun --standalone --nproc-per-node "$n" bench/gpu_decode_probe.py "$DATA/tar" >"$OUT/decode-probe-$n.log" 2>&1
    grep -h '^{"probe' "$OUT/decode-probe-$n.log" | tee -a "$OUT/decode-probe.jsonl"
  done
fi

rate_of() {  # the trainer's final images/sec from its log
  "$PY" -c 'import json,sys
for l in open(sys.argv[1]):
    if l.startswith("{") and json.loads(l).get("final"): print(json.loads(l)["imagesPerSec"])' "$1"
}

for round in $(seq 1 "$REPEAT"); do
for run in $RUNS; do
  if [[ -n $DEADLINE ]] && (( $(date +%s) - T0 > DEADLINE )); then echo "deadline: no more runs"; break 2; fi
  IFS=: read -r kind n cores <<<"$run"
  more=() case=$kind envs=()
  if [[ $kind == *+perimage* ]]; then kind=${kind/+perimage/}; envs=(TRAINOP_DEVICE_CROP=per-image); fi
  if [[ $kind == *+compile ]]; then kind=${kind%+compile}; more=(--compile); fi
  case $kind in
    synthetic) src=(--synthetic --num-classes 100) ;;
    gpu-*) src=(--data-dir "$DATA/${kind#*-}" --decode gpu) ;;
    auto-*) src=(--data-dir "$DATA/${kind#*-}") ;;
    cpu-*) src=(--data-dir "$DATA/${kind#*-}" --decode cpu) ;;
  esac
  [[ $kind == *-folder ]] && src[1]="$DATA/folder/train"
  pin=()
  if [[ -n $cores ]]; then pin=(taskset -c "0-$(( cores * n - 1 ))"); case="$case@${cores}cpg"; fi
  log="$OUT/train-$case-$n-$round.log"
  start=$(date +%s)
  if [[ $TRACE == 1 ]]; then
    trace="$TRACES/$case-$n-$round"; mkdir -p "$trace"
    "$PY" bench/spread_trace.py --sys "$trace/sys.jsonl" & sys_pid=$!
    nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,temperature.gpu,utilization.gpu,clocks_throttle_reasons.active \
      --format=csv,noheader -lms 500 >"$trace/gpu.csv" 2>/dev/null & smi_pid=$!
    env TRACE_DIR="$trace" "${envs[@]}" "${pin[@]}" torchrun --standalone --nproc-per-node "$n" bench/spread_trace.py --framework pytorch \
      --backend native "${src[@]}" --precision bf16 --channels-last --batch-size "$BATCH" --epochs "$EPOCHS" \
      --steps-per-epoch "$STEPS" --output-dir "/tmp/data-bench-$kind-$n" "${more[@]}" ${EXTRA:-} >"$log" 2>&1
    kill "$sys_pid" "$smi_pid"; wait "$sys_pid" "$smi_pid" 2>/dev/null
    BATCH="$BATCH" "$PY" bench/spread_trace.py --summary "$trace" >>"$OUT/trace-summary.jsonl"
  else
    env "${envs[@]}" "${pin[@]}" torchrun --standalone --nproc-per-node "$n" -m trainop_trainer --framework pytorch --backend native "${src[@]}" \
      --precision bf16 --channels-last --batch-size "$BATCH" --epochs "$EPOCHS" --steps-per-epoch "$STEPS" \
      --output-dir "/tmp/data-bench-$kind-$n" "${more[@]}" ${EXTRA:-} >"$log" 2>&1
  fi
  rate=$(rate_of "$log")
  echo "{\"run\": \"$case\", \"gpus\": $n, \"round\": $round, \"imagesPerSec\": ${rate:-null}, \"seconds\": $(( $(date +%s) - start )), \"t\": $(( $(date +%s) - T0 ))}" | tee -a "$results"
  [[ -n $rate ]] || tail -20 "$log"
  (( round == 1 )) && grep -h "decodes" "$log" | head -1
done
done
[[ $TRACE == 1 ]] && tar czf "$OUT/traces.tgz" -C "$TRACES" .

if [[ $PROBE == 1 ]]; then
  workers=$(( $(nproc) / GPUS - 1 ))
  for v in $PROBES; do
    log="$OUT/probe-$v.log"
    torchrun --standalone --nproc-per-node "$GPUS" bench/loader_probe.py "$DATA/tar" --variant "$v" \
      --workers "$([[ $v == new-gpu ]] && echo 6 || echo "$workers")" --batch "$BATCH" >"$log" 2>&1
    "$PY" -c 'import json,sys
rows=[json.loads(l) for l in open(sys.argv[1]) if l.startswith("{\"probe")]
print(json.dumps({"probe": sys.argv[2], "ranks": len(rows), "workers": rows[0]["workers"] if rows else None,
                  "imagesPerSec": round(sum(r["imagesPerSec"] for r in rows), 1) if rows else None}))' "$log" "$v" \
      | tee -a "$results"
  done
fi

"$PY" - "$results" <<'EOF'
import json, sys
import statistics
rows = [json.loads(l) for l in open(sys.argv[1])]
runs = [r for r in rows if "run" in r]
syn = {}
for r in runs:
    if r["run"] == "synthetic" and r["imagesPerSec"] is not None:
        syn.setdefault(r["gpus"], []).append(r["imagesPerSec"])
base = {g: statistics.median(v) for g, v in syn.items()}
print("\nrun                 GPUs  images/s (each run)           per GPU (median)  vs synthetic median: min  median")
cases = {}
for r in runs:
    cases.setdefault((r["run"], r["gpus"]), []).append(r["imagesPerSec"])
for (name, gpus), rates in cases.items():
    ok = [x for x in rates if x is not None]
    each = " ".join("FAILED" if x is None else f"{x:.0f}" for x in rates)
    if not ok:
        print(f"{name:19} {gpus:4}  {each}"); continue
    med = statistics.median(ok)
    b = base.get(gpus)
    ratio = f"{min(ok) / b:.2f}  {med / b:.2f}" if b else ""
    print(f"{name:19} {gpus:4}  {each:30} {med / gpus:7.0f}           {ratio}")
probes = [r for r in rows if "probe" in r]
if probes:
    print("\nloader alone (no model)   ranks  workers/rank  images/s")
    for r in probes:
        print(f"{r['probe']:25} {r['ranks']:5}  {r['workers']!s:12}  {r['imagesPerSec']}")
EOF
