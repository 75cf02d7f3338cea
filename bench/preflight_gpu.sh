#!/bin/sh
# The preflight's bus bandwidth next to an all-reduce run by hand (bench/allreduce.py), in one
# call on one GPU machine (docs/benchmarks.md). Run from the repository root on the device:
#   sh bench/preflight_gpu.sh
# NVLink multicast stays off, as the device machines require.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=trainer_images/trainer
G=$(nvidia-smi -L | wc -l)
date -u; nvidia-smi -L; python3 -c 'import torch; print(torch.__version__, torch.cuda.nccl.version())'
for n in $(seq 2 "$G"); do
  for mb in 64 1024; do  # 64 MiB: the preflight's default size
    torchrun --standalone --nproc-per-node="$n" -m trainop_trainer.preflight --size-mb "$mb" \
      --iterations 20 --min-busbw 0 2>&1 | grep -E 'trainop-preflight|Error|error' | head -5
  done
  torchrun --standalone --nproc-per-node="$n" bench/allreduce.py --size-mb 64 1024 --iterations 20 \
    2>&1 | grep -E 'by-hand|Error|error' | head -5
done
# The pairwise path: one-GPU "workers" (static rendezvous, node rank = worker, as in the pods),
# with a threshold no pair reaches.
for i in $(seq 0 $((G - 1))); do
  CUDA_VISIBLE_DEVICES=$i torchrun --nnodes="$G" --nproc-per-node=1 --node-rank="$i" \
    --master-addr=127.0.0.1 --master-port=29411 -m trainop_trainer.preflight --size-mb 64 \
    --iterations 20 --min-busbw 100000 > "/tmp/pair$i.log" 2>&1 &
done
wait
grep -h trainop-preflight /tmp/pair0.log
grep -h 'Using network\|NET/' /tmp/trainop-nccl.* 2>/dev/null | sed 's/.*NCCL INFO //' | sort | uniq -c | head -8
date -u
