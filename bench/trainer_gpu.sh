#!/usr/bin/env bash
# GPU benchmark of the trainer's PyTorch path (issue 4), for a machine with >= 2 GPUs and no network.
#
# In one run: the trainer (`python -m trainop_trainer`, DDP) and bench/reference_ddp.py (a plain
# DDP ResNet-50 loop), same per-GPU batch, bf16, channels_last, on 1 and 2 GPUs, and optionally
# Horovod (built here from the sdist by trainer_images/install.sh) vs DDP under mpirun.
# Prints a table (trainer/reference ratio, 2-GPU scaling) and writes $OUT/results.jsonl.
#
#   RUNS="eager:1 eager:2 compile:1 compile:2" HOROVOD=1 bash bench/trainer_gpu.sh
# Environment: RUNS (mode:GPUs pairs, mode eager or compile), HOROVOD (1: build and run Horovod on 2 GPUs; needs
# $HOROVOD_SDIST and cffi importable), BATCH (per GPU, 256), STEPS (per epoch, 50), EPOCHS (3;
# the first is not timed), PY (python3), OUT (output folder).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/trainer-bench}"
PY="${PY:-python3}"
BATCH="${BATCH:-256}" STEPS="${STEPS:-50}" EPOCHS="${EPOCHS:-3}"
RUNS="${RUNS:-eager:1 eager:2 compile:1 compile:2}"
HOROVOD="${HOROVOD:-0}"
mkdir -p "$OUT"
results="$OUT/results.jsonl"
# NVLink multicast stays off on shared hosts (it can take the GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/trainer_images/trainer${PYTHONPATH:+:$PYTHONPATH}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpus.txt"

if [[ $HOROVOD == 1 ]]; then
  cache=/tmp/trainop-cache
  mkdir -p "$cache/horovod" && cp "$HOROVOD_SDIST" "$cache/horovod/"
  (TRAINOP_PYTHON="$PY" TRAINOP_FRAMEWORKS=pytorch TRAINOP_GPU=1 HOROVOD_CUDA_CC=90 TRAINOP_CACHE="$cache" \
    bash trainer_images/install.sh horovod >"$OUT/horovod-build.log" 2>&1; echo "exit $?" >>"$OUT/horovod-build.log") &
  build=$!
fi

common=(--batch-size "$BATCH" --epochs "$EPOCHS" --steps-per-epoch "$STEPS")
trainer_args=(--framework pytorch --synthetic --precision bf16 --channels-last "${common[@]}")

# record NAME GPUS MODE LOGFILE: the run's final images/sec into results.jsonl.
record() {
  local rate
  rate="$("$PY" - "$4" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    if line.startswith("{"):
        rec = json.loads(line)
        if rec.get("final") or rec.get("reference"):
            print(rec["imagesPerSec"])
EOF
)"
  echo "{\"run\": \"$1\", \"gpus\": $2, \"mode\": \"$3\", \"imagesPerSec\": ${rate:-null}}" | tee -a "$results"
}

for run in $RUNS; do
  mode=${run%:*} n=${run#*:}
  flag=()
  [[ $mode == compile ]] && flag=(--compile)
  log="$OUT/trainer-$mode-$n.log"
  torchrun --standalone --nproc-per-node "$n" -m trainop_trainer "${trainer_args[@]}" "${flag[@]}" \
    --backend native --output-dir "/tmp/trainer-$mode-$n" >"$log" 2>&1
  record trainer "$n" "$mode" "$log"
  log="$OUT/reference-$mode-$n.log"
  torchrun --standalone --nproc-per-node "$n" bench/reference_ddp.py --batch-size "$BATCH" --steps "$STEPS" \
    --epochs "$EPOCHS" "${flag[@]}" >"$log" 2>&1
  record reference "$n" "$mode" "$log"
done

if [[ $HOROVOD == 1 ]]; then
  wait "$build"
  tail -3 "$OUT/horovod-build.log"
  for backend in horovod native; do
    log="$OUT/mpirun-$backend.log"
    # --bind-to none: Open MPI's default core binding starves the data path (TOOLCHAIN.md).
    mpirun -np 2 --bind-to none -x PYTHONPATH -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST \
      -x NVSHMEM_DISABLE_NVLS -x PYTHONUNBUFFERED -x MASTER_PORT=29611 \
      "$PY" -m trainop_trainer "${trainer_args[@]}" --backend "$backend" --output-dir "/tmp/mpirun-$backend" >"$log" 2>&1
    record "mpirun-$backend" 2 eager "$log"
    grep -h "parameter sha256" "$log"
  done
fi

"$PY" - "$results" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
get = {(r["run"], r["gpus"], r["mode"]): r["imagesPerSec"] for r in rows}
print("\nrun            mode     GPUs  images/s  per GPU  trainer/ref  scaling vs 1 GPU")
for (run, gpus, mode), rate in sorted(get.items()):
    if rate is None:
        print(f"{run:14} {mode:8} {gpus:4}  FAILED"); continue
    ref = get.get(("reference", gpus, mode))
    one = get.get((run, 1, mode)) or (get.get(("trainer", 1, mode)) if run.startswith("mpirun") else None)
    ratio = f"{rate / ref:.3f}" if ref and run != "reference" else ""
    scaling = f"{rate / (gpus * one):.1%}" if gpus > 1 and one else ""
    print(f"{run:14} {mode:8} {gpus:4}  {rate:8.0f}  {rate / gpus:7.0f}  {ratio:11}  {scaling}")
EOF
