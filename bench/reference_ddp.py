"""Reference: the plainest torchrun + DDP ResNet-50 loop on synthetic data (the baseline the
trainer's PyTorch path is measured against). Same batch, bf16 autocast, channels_last, optional
torch.compile; prints one JSON line with the total images/sec over the timed epochs.

    torchrun --nproc-per-node N bench/reference_ddp.py --batch-size 256 --steps 50 --epochs 3 [--compile]
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torchvision

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=256)
p.add_argument("--steps", type=int, default=50)
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--image-size", type=int, default=224)
p.add_argument("--compile", action="store_true")
args = p.parse_args()

rank, size, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
device = torch.device("cuda", local)
torch.cuda.set_device(device)
torch.backends.cudnn.benchmark = True
dist.init_process_group("nccl", device_id=device)

model = torchvision.models.resnet50().to(device).to(memory_format=torch.channels_last)
model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local], gradient_as_bucket_view=True)
step_model = torch.compile(model) if args.compile else model
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-5)
loss_fn = torch.nn.CrossEntropyLoss()
x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device).contiguous(
    memory_format=torch.channels_last)
y = torch.randint(0, 1000, (args.batch_size,), device=device)

rates = []
for _epoch in range(args.epochs):
    start = time.perf_counter()
    for _ in range(args.steps):
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(step_model(x), y)
        loss.backward()
        opt.step()
    loss.item()
    rate = torch.tensor([args.steps * args.batch_size / (time.perf_counter() - start)], device=device)
    dist.all_reduce(rate)
    rates.append(rate.item())
timed = rates[1:] or rates  # the first epoch holds cudnn autotuning and compilation
total = len(timed) / sum(1 / r for r in timed)
if rank == 0:
    print(json.dumps({"reference": True, "imagesPerSec": round(total, 1), "worldSize": size}), flush=True)
dist.destroy_process_group()
