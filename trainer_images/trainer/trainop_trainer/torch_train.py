"""PyTorch path: torchvision ResNet, Horovod or DDP (NCCL on GPU, gloo on CPU)."""

from __future__ import annotations

import contextlib
import itertools
import sys
import time

import torch
import torch.distributed as dist
import torchvision
from torch import nn

from trainop_trainer import checkpoint, data, elastic, events, nccl, report
from trainop_trainer.config import Config
from trainop_trainer.world import World


class _Collective:
    """The few collectives the loop needs, over Horovod or torch.distributed (or none, alone)."""

    def __init__(self, cfg: Config, world: World, device: torch.device):
        self.hvd = None
        self.dist = False
        if cfg.backend == "horovod":
            import horovod.torch as hvd

            hvd.init()
            if hvd.size() != world.size:
                raise RuntimeError(f"Horovod sees {hvd.size()} ranks, the launcher {world.size}")
            self.hvd = hvd
        elif world.size > 1:
            dist.init_process_group(
                backend="nccl" if device.type == "cuda" else "gloo",
                init_method=f"tcp://{world.master_addr}:{world.master_port}",
                rank=world.rank, world_size=world.size, device_id=device if device.type == "cuda" else None)
            self.dist = True

    def sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if self.hvd:
            t = self.hvd.allreduce(t, op=self.hvd.Sum, name="trainop.report")
        elif self.dist:
            t = t.to(_device_of_backend())
            dist.all_reduce(t)
        return t.cpu().tolist()

    def broadcast_object(self, obj):
        """Rank 0's `obj` on every rank (a resumed checkpoint: only rank 0's host has it)."""
        if self.hvd:
            return self.hvd.broadcast_object(obj, root_rank=0, name="trainop.resume")
        if self.dist:
            box = [obj]
            dist.broadcast_object_list(box, src=0)
            return box[0]
        return obj

    def gather_object(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        if self.hvd:
            return self.hvd.allgather_object(obj, name="trainop.rng")
        if self.dist:
            out = [None] * dist.get_world_size()
            dist.all_gather_object(out, obj)
            return out
        return [obj]

    def any(self, flag: bool) -> bool:
        """True on every rank when it is True on one (a SIGTERM that reached some ranks)."""
        return self.sum([1.0 if flag else 0.0])[0] > 0

    def close(self) -> None:
        if self.dist:
            dist.destroy_process_group()


def _device_of_backend() -> torch.device:
    # NCCL reduces only CUDA tensors; gloo only CPU ones.
    return torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")


def _synthetic_part(cfg: Config, part: int, device: torch.device, memory_format) -> list:
    """The synthetic batches of one stream: a rank's (`part` = its rank), or in an elastic run one
    part of the global batch, whichever rank trains on it (at the maximum world, part = rank)."""
    patterns, labels = data.synthetic_task(cfg.num_classes, cfg.synthetic_batches, cfg.batch_size, part, cfg.seed)
    patterns = torch.from_numpy(patterns).permute(0, 3, 1, 2).to(device)  # NCHW
    reps = -(-cfg.image_size // data.PATTERN)
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 1 + part)
    batches = []
    for y in torch.from_numpy(labels).to(device):
        x = torch.randn(cfg.batch_size, 3, cfg.image_size, cfg.image_size, generator=gen, device=device)
        x += patterns[y].repeat(1, 1, reps, reps)[:, :, : cfg.image_size, : cfg.image_size]
        batches.append((x.contiguous(memory_format=memory_format), y))
    return batches


def _synthetic_batches(cfg: Config, world: World, device: torch.device, memory_format, start: int = 0):
    parts = cfg.elastic.parts(world.rank) if cfg.elastic else [world.rank]
    streams = [_synthetic_part(cfg, part, device, memory_format) for part in parts]
    # Step k trains on batch k mod len of each of its parts: a resumed run continues the cycle where it stopped.
    k = start % cfg.synthetic_batches
    order = [s[c] for c in [*range(k, cfg.synthetic_batches), *range(k)] for s in streams]
    return itertools.cycle(order), 100


def _folder_batches(cfg: Config, world: World, device: torch.device, memory_format, start: int = 0,
                    appetite: float = 0.0):
    """A `torch_data.Loader` (iterable; `state_dict()`/`load_state_dict()` hold its position:
    the batches consumed, so a run resumed at global step `start` continues where it stopped).
    `appetite`: images/s the model trains at (`_appetite`), which sizes `split`'s CPU share."""
    from trainop_trainer import torch_data

    dataset = data.scan(cfg.data_dir)
    mode = dataset.read_mode(cfg.read_mode)
    data.describe_shard(dataset, world.rank, world.size, cfg.data_dir, mode, cfg.elastic)
    decode_on = cfg.decode if cfg.decode != "auto" else ("split" if device.type == "cuda" else "cpu")
    workers = cfg.loader_workers if cfg.loader_workers is not None else data.auto_workers(world.local_size, decode_on)
    loader = torch_data.Loader(dataset, world.rank, world.size, cfg.batch_size, cfg.image_size, cfg.seed, workers,
                               decode_on, mode, device, memory_format, cfg.max_bad_samples, appetite=appetite,
                               elastic=cfg.elastic)
    if start:  # the loader counts micro-batches: `accumulation` a step in an elastic run
        loader.load_state_dict({**loader.state_dict(), "batches": start * cfg.accumulation})
    print(f"trainop_trainer: rank {world.rank} decodes {loader.cpu_count} of every {cfg.batch_size} images on the "
          f"CPU ({workers} loader workers), the rest on the {device.type.upper()} ({decode_on}"
          + (f", {loader.decoder.name}, {torch_data.crop_way(device)} crop" if loader.decoder is not None else "")
          + (f"; measured: {loader.rates[0]:.0f} images/s per worker, the model trains at {loader.rates[1]:.0f}"
             if loader.rates else "") + ")",
          file=sys.stderr, flush=True)
    if cfg.elastic:
        return loader, loader.plan.steps_per_epoch
    return loader, dataset.steps_per_epoch(world.size, cfg.batch_size, mode)


def _appetite(cfg: Config, net: nn.Module, device: torch.device, memory_format) -> float:
    """Images/s this model trains at on this device (torch_data.measure_appetite), for `split`;
    0.0 where no split happens. Timed on the bare model, before Horovod's optimizer or DDP wrap
    it: a backward through their parameters would fire their all-reduce hooks out of step."""
    from trainop_trainer import torch_data

    split = cfg.decode == "split" or (cfg.decode == "auto" and device.type == "cuda")
    if cfg.synthetic or not split or device.type != "cuda":
        return 0.0
    net.to(memory_format=memory_format)
    try:
        return torch_data.measure_appetite(net, cfg.batch_size, cfg.image_size, device, memory_format, cfg.precision)
    finally:
        net.to(memory_format=torch.contiguous_format)  # Horovod's broadcast checks contiguity (below)


def train(cfg: Config, world: World) -> None:
    if torch.cuda.is_available():
        device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    else:
        device = torch.device("cpu")
    # NCCL (CUDA, more than one rank) reads NCCL_DEBUG* when it makes its first communicator.
    probe = nccl.TransportProbe() if device.type == "cuda" and world.size > 1 else None
    comm = _Collective(cfg, world, device)
    try:
        _train(cfg, world, device, comm, probe)
    finally:
        if probe:
            probe.poll()  # NCCL's last warnings into the log, also when training failed


def _train(cfg: Config, world: World, device: torch.device, comm: _Collective,
           probe: nccl.TransportProbe | None) -> None:
    torch.manual_seed(cfg.seed)
    memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format

    dtype = torch.float64 if cfg.precision == "fp64" else torch.float32
    net = getattr(torchvision.models, cfg.model)(num_classes=cfg.num_classes).to(device, dtype)
    appetite = _appetite(cfg, net, device, memory_format)  # before any wrap (below): see _appetite
    optimizer = torch.optim.SGD(net.parameters(), lr=cfg.base_lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    accumulation = cfg.accumulation  # micro-batches per step (elastic.py)
    if comm.hvd:
        # Broadcast while the tensors are still in the default layout (Horovod checks contiguity).
        comm.hvd.broadcast_parameters(net.state_dict(), root_rank=0)
        comm.hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        # backward_passes_per_step: the hooks add `accumulation` backward passes up, then all-reduce once
        optimizer = comm.hvd.DistributedOptimizer(optimizer, named_parameters=net.named_parameters(),
                                                  backward_passes_per_step=accumulation)
    # After the wrap: Horovod's DistributedOptimizer is a new optimizer over the same param groups,
    # without the wrapped one's state (momentum buffers).
    resumed = _resume(cfg, world, comm, net, optimizer)
    net = net.to(memory_format=memory_format)
    model = nn.parallel.DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None,
                                                gradient_as_bucket_view=True) if comm.dist else net
    step_model = torch.compile(model) if cfg.compile else model

    make = _synthetic_batches if cfg.synthetic else _folder_batches
    start_step = resumed["step"] if resumed else 0
    batches, default_steps = make(cfg, world, device, memory_format, start_step,
                                  **({} if cfg.synthetic else {"appetite": appetite}))
    bad_samples = getattr(batches, "bad_samples", None)  # a data set's Loader (data.BadSamples); None: synthetic
    steps = cfg.steps_per_epoch or default_steps
    if resumed and resumed["warning"] and world.is_chief:
        report.write_line(sys.stderr, resumed["warning"])
    if resumed and cfg.elastic and resumed["worldSize"] != world.size and world.is_chief:
        report.write_line(sys.stderr, elastic.resume_line(resumed["worldSize"], cfg.elastic, start_step, steps))
    loss_fn = nn.CrossEntropyLoss()
    sample_log = elastic.SampleLog(cfg.sample_log, world.rank, world.size) if cfg.sample_log else None
    reporter = report.Reporter(cfg.metrics_file, world.size, cfg.batch_size * cfg.scale(world.size), world.is_chief,
                               total_steps=cfg.epochs * steps, report_seconds=cfg.report_seconds,
                               stall_seconds=cfg.stall_seconds, min_step_seconds=cfg.min_step_seconds,
                               events=events.open_writer(cfg.framework, cfg.output_dir) if world.is_chief else None,
                               bad_samples=0 if bad_samples is not None else None)

    def step_fn():
        """One optimizer step over `accumulation` micro-batches: each one's loss divided by their
        number, so the gradients add up to their mean; DDP all-reduces on the last backward only
        (no_sync before it), Horovod's hooks after `accumulation` passes. Returns the mean loss."""
        optimizer.zero_grad()
        total = torch.zeros((), device=device, dtype=dtype)
        for a in range(accumulation):
            x, y = next(batches)
            last = a == accumulation - 1
            with contextlib.nullcontext() if last or not comm.dist else model.no_sync():
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16"):
                    loss = loss_fn(step_model(x.to(dtype)), y)
                (loss / accumulation if accumulation > 1 else loss).backward()
            total += loss.detach()
        optimizer.step()
        return total / accumulation

    saver = _Saver(cfg, world, comm, net, optimizer)
    global_step, loss = start_step, 0.0
    first_epoch, offset = divmod(start_step, steps)
    for epoch in range(first_epoch + 1, cfg.epochs + 1):
        model.train()
        start = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        ran = steps - offset
        first = global_step
        reporter.start_epoch(first)
        for _ in range(ran):
            # The schedule is a function of the global step: a resumed run continues it.
            # An elastic run's peak is scaled by its maximum world, so a resize does not move it.
            lr = report.learning_rate(global_step, steps, cfg.base_lr, cfg.scale(world.size), cfg.warmup_epochs)
            for group in optimizer.param_groups:
                group["lr"] = lr
            step_loss = step_fn()
            loss_sum += step_loss
            global_step += 1
            if sample_log:
                taken = batches.consumed if hasattr(batches, "consumed") else None
                samples = None if taken is None else [
                    i for n in range(taken - accumulation, taken) for i in batches.samples_of(n)]
                sample_log.step(global_step, epoch, samples, step_loss.item() / world.size)
            reporter.alive()
            if reporter.due():
                reporter.between(epoch, global_step, loss_sum.item() / (global_step - first))  # waits for the device
            if saver.after_step(global_step, epoch):
                comm.close()
                raise SystemExit(143)  # stopped by SIGTERM, state saved
        offset = 0
        local_loss = loss_sum.item() / ran  # waits for the device: the epoch's time is complete
        own_rate = ran * cfg.batch_size * accumulation / (time.perf_counter() - start)
        if world.is_chief:
            # Before the collective, so the other ranks wait for it there, outside their timed epoch.
            torch.save({"epoch": epoch, "model": net.state_dict(), "optimizer": optimizer.state_dict()},
                       cfg.output_dir / f"checkpoint-epoch{epoch}.pt")
        # Every rank says which network its NCCL chose (none on CPU): rank 0 reports the gang's.
        mine = probe.poll() if probe else None
        total_rate, loss_total, socket_ranks, ib_ranks, bad_total = comm.sum(
            [own_rate, local_loss, float(mine == "Socket"), float(mine == "IB"),
             float(bad_samples.count if bad_samples is not None else 0)])
        reporter.transport = nccl.gang_transport(socket_ranks, ib_ranks)
        if bad_samples is not None:
            reporter.bad_samples = int(bad_total)  # the ranks' shards are disjoint: a sum of distinct files
            bad_samples.check(int(bad_total))  # on every rank alike: the gang's count above the limit
        loss = loss_total / world.size
        reporter.epoch(epoch, global_step, loss, total_rate, ran)
    if hasattr(batches, "close"):
        batches.close()
    reporter.final(cfg.epochs, global_step, loss)
    report.log_digest(world.rank, world.size,
                      report.parameter_digest(p.detach().float().cpu().numpy() for p in net.parameters()))
    if world.is_chief:
        torch.save(net.state_dict(), cfg.output_dir / "model.pt")
    comm.close()


def _resume(cfg: Config, world: World, comm: _Collective, net, optimizer) -> dict | None:
    """Load the checkpoint to resume from (rank 0 reads it, every rank gets it): model,
    optimizer (momentum buffers), this rank's RNG state; returns {"step", "epoch"} or None."""
    state = None
    if world.is_chief:
        path = checkpoint.resolve(cfg.resume_from, cfg.checkpoint_dir)
        if path is not None:
            state = checkpoint.torch_load(path, world.size, cfg.elastic)
            print(f"trainop_trainer: resuming from {path} at step {state['step']}", file=sys.stderr, flush=True)
        elif cfg.resume_from:
            print(f"trainop_trainer: no complete checkpoint under {cfg.checkpoint_dir.parent}; starting at step 0",
                  file=sys.stderr, flush=True)
    if cfg.resume_from and world.size > 1:
        state = comm.broadcast_object(state)
    if state is None:
        return None
    net.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    # At another world size (an elastic resume) every rank takes rank 0's RNG state: every rank
    # seeded alike at the start, so a fresh run would hold the same; the draws differ from the
    # uninterrupted run's (docs/elastic.md: dropout and other random ops are not continued).
    same = state["worldSize"] == world.size
    checkpoint.set_torch_rng_state(state["rng"][world.rank if same else 0])
    return {"step": state["step"], "epoch": state["epoch"], "worldSize": state["worldSize"],
            "warning": state["warning"]}



class _Saver(checkpoint.Saver):
    """Every rank's RNG state goes to rank 0, which writes the checkpoint (checkpoint.torch_save)."""

    def __init__(self, cfg: Config, world: World, comm: _Collective, net, optimizer):
        super().__init__(cfg, world)
        self.comm, self.net, self.optimizer = comm, net, optimizer

    def sum(self, values: list[float]) -> list[float]:
        return self.comm.sum(values)

    def write(self, step: int, epoch: int):
        rng = self.comm.gather_object(checkpoint.torch_rng_state())  # a collective: every rank
        if not self.world.is_chief:
            return None
        return checkpoint.torch_save(self.cfg.checkpoint_dir, step, epoch, self.world.size,
                                     self.net, self.optimizer, rng, self.cfg.elastic)
