#!/usr/bin/env bash
# Input-pipeline benchmark (issue 18): the trainer on synthetic data vs real JPEGs, PyTorch, ResNet-50.
#
# In one run on a GPU machine with no network: generate the JPEG set deterministically
# (bench/make_jpegs.py: ImageNet-like sizes, as class folders and as .tar shards), then train on
# 1 GPU and on every GPU with synthetic data and with JPEGs: the default (`--decode auto`: split,
# each batch shared between the loader workers' decode and nvJPEG on the GPU), the GPU path alone
# and the CPU path alone, default loader settings; print images/sec and the ratio to synthetic.
# Then (PROBE=1) bench/loader_probe.py times the loaders alone, without a model, to show where the
# old CPU pipeline lost its time.
#
#   bash bench/data_pipeline.sh
# Environment: OUT (output folder, /tmp/data-bench), DATA (/tmp/jpegs; generated when missing),
# IMAGES (25600), GPUS (all), RUNS (kind:GPUs pairs; kind synthetic or <decode>-<layout>, decode
# auto | gpu | cpu, layout tar | folder), BATCH (256 per GPU), STEPS (50 per epoch), EPOCHS (3; the first is not timed),
# PROBE (1), PROBES (the loader_probe variants), EXTRA (more trainer arguments), PY (python3).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/data-bench}" PY="${PY:-python3}" DATA="${DATA:-/tmp/jpegs}"
IMAGES="${IMAGES:-25600}" BATCH="${BATCH:-256}" STEPS="${STEPS:-50}" EPOCHS="${EPOCHS:-3}"
GPUS="${GPUS:-$(nvidia-smi -L | wc -l)}"
RUNS="${RUNS:-synthetic:1 auto-tar:1 gpu-tar:1 cpu-tar:1 synthetic:$GPUS auto-tar:$GPUS gpu-tar:$GPUS cpu-tar:$GPUS auto-folder:$GPUS}"
PROBE="${PROBE:-1}" PROBES="${PROBES:-pil old old-nopin old-uint8 new-cpu new-gpu}"
mkdir -p "$OUT"
results="$OUT/results.jsonl"
: >"$results"
# NVLink multicast stays off on shared hosts (it can take the GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/trainer_images/trainer${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; echo "cpus $(nproc)"; date -u; } | tee "$OUT/machine.txt"

if [[ ! -d $DATA/tar ]]; then
  start=$(date +%s)
  "$PY" bench/make_jpegs.py "$DATA" --images "$IMAGES" | tee "$OUT/data.txt"
  echo "generated in $(( $(date +%s) - start )) s"
fi

rate_of() {  # the trainer's final images/sec from its log
  "$PY" -c 'import json,sys
for l in open(sys.argv[1]):
    if l.startswith("{") and json.loads(l).get("final"): print(json.loads(l)["imagesPerSec"])' "$1"
}

for run in $RUNS; do
  kind=${run%:*} n=${run#*:}
  case $kind in
    synthetic) src=(--synthetic --num-classes 100) ;;
    gpu-*) src=(--data-dir "$DATA/${kind#*-}" --decode gpu) ;;
    auto-*) src=(--data-dir "$DATA/${kind#*-}") ;;
    cpu-*) src=(--data-dir "$DATA/${kind#*-}" --decode cpu) ;;
  esac
  [[ $kind == *-folder ]] && src[1]="$DATA/folder/train"
  log="$OUT/train-$kind-$n.log"
  start=$(date +%s)
  torchrun --standalone --nproc-per-node "$n" -m trainop_trainer --framework pytorch --backend native "${src[@]}" \
    --precision bf16 --channels-last --batch-size "$BATCH" --epochs "$EPOCHS" --steps-per-epoch "$STEPS" \
    --output-dir "/tmp/data-bench-$kind-$n" ${EXTRA:-} >"$log" 2>&1
  rate=$(rate_of "$log")
  echo "{\"run\": \"$kind\", \"gpus\": $n, \"imagesPerSec\": ${rate:-null}, \"seconds\": $(( $(date +%s) - start ))}" | tee -a "$results"
  [[ -n $rate ]] || tail -20 "$log"
  grep -h "decodes" "$log" | head -1
done

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
rows = [json.loads(l) for l in open(sys.argv[1])]
synthetic = {r["gpus"]: r["imagesPerSec"] for r in rows if r.get("run") == "synthetic"}
print("\nrun          GPUs  images/s  per GPU  vs synthetic")
for r in rows:
    if "run" not in r:
        continue
    rate, syn = r["imagesPerSec"], synthetic.get(r["gpus"])
    if rate is None:
        print(f"{r['run']:12} {r['gpus']:4}  FAILED"); continue
    ratio = f"{rate / syn:.2f}" if syn else ""
    print(f"{r['run']:12} {r['gpus']:4}  {rate:8.0f}  {rate / r['gpus']:7.0f}  {ratio}")
probes = [r for r in rows if "probe" in r]
if probes:
    print("\nloader alone (no model)   ranks  workers/rank  images/s")
    for r in probes:
        print(f"{r['probe']:25} {r['ranks']:5}  {r['workers']!s:12}  {r['imagesPerSec']}")
EOF
